/* SPDX-License-Identifier: MIT */
/*
 * aoqctl: shows what aoqd is doing.
 *
 *   aoqctl [--socket PATH] stats [--json|--prometheus] [--all] [--watch [SEC]] [-o FILE]
 *   aoqctl [--socket PATH] sessions [--all]
 *   aoqctl [--socket PATH] trace SESSION [--steps N] -o FILE
 *   aoqctl [--socket PATH] snapshot SESSION
 *   aoqctl [--socket PATH] drop SESSION
 *
 * This file is the command line: options (before or after the command
 * word), their checks, and which command runs.  aoqctl.h lists the other
 * files and what each owns.
 *
 * Exit status: 0 ok, 1 the daemon is unreachable or answered with an error
 * (or the output could not be written), 2 usage.
 */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "aoq-version.h"
#include "aoqctl.h"

static const char usage_text[] =
	"Usage: aoqctl [--socket PATH] COMMAND [OPTIONS]\n"
	"\n"
	"Shows what the aoq optimizer daemon (aoqd) is doing.\n"
	"\n"
	"Commands:\n"
	"  stats        daemon-wide figures, then one row per session, per job and per uid\n"
	"  sessions     one line per session: id job rank uid pid device state precision,\n"
	"               last completed step, lease time left (leased: trainer gone),\n"
	"               replica group (id:local rank/local world)\n"
	"  trace ID     record the next steps of session ID as a Chrome trace (Perfetto)\n"
	"  snapshot ID  write session ID's optimizer state to the daemon's state_dir\n"
	"               (safetensors); waits until the file is on disk, prints its path\n"
	"  drop ID      end session ID (live or leased) and its lease for good\n"
	"\n"
	"Options:\n"
	"  -s, --socket PATH     the daemon's socket (default: $AOQ_SOCKET, else\n"
	"                        /run/aoq/aoqd.sock when it exists, else\n"
	"                        $XDG_RUNTIME_DIR/aoq/aoqd.sock)\n"
	"  -j, --json            stats: JSON instead of a table\n"
	"  -p, --prometheus      stats: Prometheus text exposition format\n"
	"  -w, --watch [SEC]     stats: refresh every SEC seconds (default 2; at least\n"
	"                        0.1) until interrupted; JSON is then one object\n"
	"                        per line\n"
	"  -o, --output FILE     stats, trace: write FILE (atomically: FILE.tmp, then\n"
	"                        renamed) instead of standard output\n"
	"  -n, --steps N         trace: steps to record (default 3)\n"
	"  -a, --all             every session the caller may see (root and the admin\n"
	"                        group see other users' sessions), not only the caller's\n"
	"  -h, --help            this text\n"
	"  -V, --version         the version\n"
	"\n"
	"Exit status: 0 ok, 1 daemon unreachable or error, 2 usage.\n";

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...)
{
	va_list ap;
	fputs("aoqctl: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\nTry 'aoqctl --help'.\n", stderr);
	return EXIT_USAGE;
}

/* A whole number in [lo, hi] (decimal), or false. */
static bool parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
	if (!s || *s < '0' || *s > '9')
		return false;
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || *end || v < lo || v > hi)
		return false;
	*out = v;
	return true;
}

/* Seconds for --watch: a decimal up to a day; below 0.1 (0 too) is 0.1, as
 * watch(1) takes it. */
static bool parse_seconds(const char *s, double *out)
{
	if (!s || ((*s < '0' || *s > '9') && *s != '.'))
		return false;
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno || *end || !(v >= 0) || v > 86400)
		return false;
	*out = v < 0.1 ? 0.1 : v;
	return true;
}

struct args {
	const char *socket, *output;
	bool json, prometheus, all;
	double watch;
	uint64_t steps;
	bool steps_set;
};

/* Parses options of one argv (before or after the command word).  Returns
 * -1 to go on, or an exit status. */
static int parse_opts(int argc, char **argv, const char *optstring, struct args *a)
{
	static const struct option longopts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "json", no_argument, NULL, 'j' },
		{ "prometheus", no_argument, NULL, 'p' },
		{ "watch", optional_argument, NULL, 'w' },
		{ "output", required_argument, NULL, 'o' },
		{ "steps", required_argument, NULL, 'n' },
		{ "all", no_argument, NULL, 'a' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	int c;
	while ((c = getopt_long(argc, argv, optstring, longopts, NULL)) != -1) {
		switch (c) {
		case 's': a->socket = optarg; break;
		case 'j': a->json = true; break;
		case 'p': a->prometheus = true; break;
		case 'a': a->all = true; break;
		case 'o': a->output = optarg; break;
		case 'w': {
			const char *v = optarg;
			/* "--watch 5": take the next word when it is a number */
			if (!v && optind < argc && parse_seconds(argv[optind], &a->watch)) {
				optind++;
				break;
			}
			a->watch = 2;
			if (v && !parse_seconds(v, &a->watch))
				return usage_error("--watch: '%s' is not a number of seconds (0..86400)", v);
			break;
		}
		case 'n':
			if (!parse_u64(optarg, 1, 1000000, &a->steps))
				return usage_error("--steps: '%s' is not a whole number in 1..1000000", optarg);
			a->steps_set = true;
			break;
		case 'h': fputs(usage_text, stdout); return EXIT_OK;
		case 'V': printf("aoqctl %s (protocol %u)\n", aoq_full_version(), AOQ_PROTOCOL_VERSION); return EXIT_OK;
		case ':': return usage_error("option '%s' needs a value", argv[optind - 1]);
		default:
			if (optopt && optopt < 256)
				return usage_error("unknown option '-%c'", optopt);
			return usage_error("unknown option '%s'", argv[optind - 1]);
		}
	}
	return -1;
}

int main(int argc, char **argv)
{
	struct args a = { .steps = 3 };
	opterr = 0;
	/* Options before the command word ('+': stop at the first non-option). */
	int r = parse_opts(argc, argv, "+:s:jpw::o:n:ahV", &a);
	if (r >= 0)
		return r;
	if (optind >= argc)
		return usage_error("no command given");
	const char *cmd = argv[optind++];

	/* Options after the command word: parse the rest as its own argv whose
	 * argv[0] is the command (optind = 0 makes glibc start afresh); the
	 * operands (trace's session id) are permuted to the end. */
	int sub_argc = argc - optind + 1;
	char **sub_argv = argv + optind - 1;
	optind = 0;
	r = parse_opts(sub_argc, sub_argv, ":s:jpw::o:n:ahV", &a);
	if (r >= 0)
		return r;
	char **operands = sub_argv + optind;
	int noperands = sub_argc - optind;

	bool is_stats = strcmp(cmd, "stats") == 0;
	bool is_sessions = strcmp(cmd, "sessions") == 0;
	bool is_trace = strcmp(cmd, "trace") == 0;
	bool is_snapshot = strcmp(cmd, "snapshot") == 0;
	bool is_drop = strcmp(cmd, "drop") == 0;
	if (!is_stats && !is_sessions && !is_trace && !is_snapshot && !is_drop)
		return usage_error("unknown command '%s'", cmd);
	uint64_t session = 0;
	if (is_drop || is_trace || is_snapshot) {
		/* one operand, the session id */
		if (noperands < 1)
			return usage_error("%s: which session? (aoqctl %s SESSION%s; ids: aoqctl sessions)", cmd, cmd,
			                   is_trace ? " -o FILE" : "");
		if (!parse_u64(operands[0], 1, UINT64_MAX, &session))
			return usage_error("%s: '%s' is not a session id", cmd, operands[0]);
		if (noperands > 1)
			return usage_error("unexpected argument '%s'", operands[1]);
	}
	if (is_drop) {
		if (a.json || a.prometheus || a.watch > 0 || a.output || a.steps_set || a.all)
			return usage_error("drop takes no options");
	} else if (is_trace) {
		if (!a.output)
			return usage_error("trace: -o FILE is required (the trace is JSON for Perfetto)");
	} else if (is_snapshot) {
		if (a.output || a.all || a.steps_set || a.json || a.prometheus || a.watch > 0)
			return usage_error("snapshot takes no options but --socket");
	} else if (noperands > 0) {
		return usage_error("unexpected argument '%s'", operands[0]);
	}
	if (a.json && a.prometheus)
		return usage_error("--json and --prometheus exclude each other");
	if ((a.json || a.prometheus || a.watch > 0) && !is_stats)
		return usage_error("--%s goes with 'stats'", a.json ? "json" : a.prometheus ? "prometheus" : "watch");
	if (a.steps_set && !is_trace)
		return usage_error("--steps goes with 'trace'");
	if (a.output && is_sessions)
		return usage_error("--output goes with 'stats' and 'trace'");
	if (a.watch > 0 && (a.prometheus || a.output))
		return usage_error("--watch does not go with %s (Prometheus scrapes pull; rewrite the file from a timer)",
		                   a.prometheus ? "--prometheus" : "--output");
	if (a.all && is_trace)
		return usage_error("--all goes with 'stats' and 'sessions'");

	char path[512];
	r = aoq_socket_path(a.socket, path, sizeof(path));
	if (r < 0) {
		fprintf(stderr, "aoqctl: socket path too long\n");
		return EXIT_USAGE;
	}
	if (is_trace)
		return ctl_run_trace(path, session, (uint32_t)a.steps, a.output);
	if (is_snapshot)
		return ctl_run_snapshot(path, session);
	if (is_drop)
		return ctl_run_drop(path, session);
	enum ctl_format fmt = a.json ? CTL_FMT_JSON : a.prometheus ? CTL_FMT_PROMETHEUS : CTL_FMT_TABLE;
	return ctl_run_stats(path, a.all, fmt, is_sessions, a.watch, a.output);
}

