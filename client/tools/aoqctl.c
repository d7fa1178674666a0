/* SPDX-License-Identifier: MIT */
/*
 * aoqctl: shows what aoqd is doing.
 *
 *   aoqctl [--socket PATH] stats [--json] [--all]
 *   aoqctl [--socket PATH] sessions [--all]
 *
 * It speaks the control protocol directly (proto/wire.h) as an observer:
 * Hello{observer} -> Welcome, StatsRequest -> Stats.
 *
 * Exit status: 0 ok, 1 the daemon is unreachable or answered with an error,
 * 2 usage.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aoq-config.h"
#include "wire.h"

enum {
	EXIT_OK = 0,
	EXIT_UNREACHABLE = 1,
	EXIT_USAGE = 2,
};

static const char usage_text[] =
	"Usage: aoqctl [--socket PATH] COMMAND [OPTIONS]\n"
	"\n"
	"Shows what the aoq optimizer daemon (aoqd) is doing.\n"
	"\n"
	"Commands:\n"
	"  stats [--json] [--all]   daemon-wide figures and one row per session\n"
	"  sessions [--all]         one line per session: id job rank uid pid device state precision\n"
	"\n"
	"Options:\n"
	"  -s, --socket PATH   the daemon's socket (default: $AOQ_SOCKET, else\n"
	"                      /run/aoq/aoqd.sock when it exists, else\n"
	"                      $XDG_RUNTIME_DIR/aoq/aoqd.sock)\n"
	"  -j, --json          stats: print JSON instead of a table\n"
	"  -a, --all           every session the caller may see (root and the admin\n"
	"                      group see other users' sessions), not only the caller's\n"
	"  -h, --help          this text\n"
	"  -V, --version       the version\n"
	"\n"
	"Exit status: 0 ok, 1 daemon unreachable or error, 2 usage.\n";

/* ---- formatting helpers ------------------------------------------------ */

/* "1.50 GiB", "512 B". */
static void fmt_bytes(char *buf, size_t len, uint64_t v)
{
	static const char *const unit[] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB" };
	double d = (double)v;
	unsigned u = 0;
	while (d >= 1024.0 && u + 1 < sizeof(unit) / sizeof(unit[0])) {
		d /= 1024.0;
		u++;
	}
	if (u == 0)
		snprintf(buf, len, "%" PRIu64 " B", v);
	else
		snprintf(buf, len, "%.*f %s", d < 10.0 ? 2 : d < 100.0 ? 1 : 0, d, unit[u]);
}

/* "12.3k", "4.10M", "999". */
static void fmt_count(char *buf, size_t len, uint64_t v)
{
	static const char *const unit[] = { "", "k", "M", "G", "T", "P", "E" };
	double d = (double)v;
	unsigned u = 0;
	while (d >= 1000.0 && u + 1 < sizeof(unit) / sizeof(unit[0])) {
		d /= 1000.0;
		u++;
	}
	if (u == 0)
		snprintf(buf, len, "%" PRIu64, v);
	else
		snprintf(buf, len, "%.*f%s", d < 10.0 ? 2 : d < 100.0 ? 1 : 0, d, unit[u]);
}

/* "3d 04:05:06", "04:05:06". */
static void fmt_uptime(char *buf, size_t len, double s)
{
	if (!isfinite(s) || s < 0)
		s = 0;
	uint64_t t = (uint64_t)s;
	uint64_t d = t / 86400, h = t / 3600 % 24, m = t / 60 % 60, sec = t % 60;
	if (d)
		snprintf(buf, len, "%" PRIu64 "d %02" PRIu64 ":%02" PRIu64 ":%02" PRIu64, d, h, m, sec);
	else
		snprintf(buf, len, "%02" PRIu64 ":%02" PRIu64 ":%02" PRIu64, h, m, sec);
}

static void fmt_double(char *buf, size_t len, double v, int prec)
{
	if (!isfinite(v))
		snprintf(buf, len, "-");
	else
		snprintf(buf, len, "%.*f", prec, v);
}

static const char *precision_name(int p)
{
	switch (p) {
	case AOQ__STATE_PRECISION__STATE_FP32: return "fp32";
	case AOQ__STATE_PRECISION__STATE_Q8: return "q8";
	case AOQ__STATE_PRECISION__STATE_BF16: return "bf16";
	case AOQ__STATE_PRECISION__STATE_BF16_Q8: return "bf16-q8";
	case AOQ__STATE_PRECISION__STATE_BF16_ALL: return "bf16-all";
	default: return "unknown";
	}
}

static const char *str_or(const char *s, const char *dflt)
{
	return s && *s ? s : dflt;
}

/* ---- UTF-8 ---------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when invalid. */
static size_t utf8_valid(const unsigned char *s)
{
	unsigned c = s[0];
	size_t n;
	uint32_t cp;
	if (c < 0x80)
		return 1;
	else if ((c & 0xe0) == 0xc0)
		n = 2, cp = c & 0x1f;
	else if ((c & 0xf0) == 0xe0)
		n = 3, cp = c & 0x0f;
	else if ((c & 0xf8) == 0xf0)
		n = 4, cp = c & 0x07;
	else
		return 0;
	for (size_t i = 1; i < n; i++) {
		if ((s[i] & 0xc0) != 0x80)
			return 0;
		cp = cp << 6 | (s[i] & 0x3f);
	}
	if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
	    cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
		return 0;
	return n;
}

/* ---- a small table printer --------------------------------------------- */

#define TABLE_MAX_COLS 16
#define CELL_LEN 64

struct table {
	size_t ncols;
	const char *head[TABLE_MAX_COLS];
	bool right[TABLE_MAX_COLS]; /* right-align (numbers) */
	size_t nrows;
	char (*cells)[TABLE_MAX_COLS][CELL_LEN];
};

/* Sanitises a cell for a terminal: control characters and invalid UTF-8
 * become '?'; a long text is cut at a character boundary. */
static void cell_set(char *cell, const char *str)
{
	const unsigned char *s = (const unsigned char *)str;
	size_t o = 0;
	while (*s) {
		size_t n = utf8_valid(s);
		bool bad = n == 0 || *s < 0x20 || *s == 0x7f;
		if (bad)
			n = 1;
		if (o + n + 1 > CELL_LEN)
			break;
		if (bad)
			cell[o] = '?';
		else
			memcpy(cell + o, s, n);
		o += n;
		s += n;
	}
	cell[o] = 0;
}

/* Display width: characters, not bytes (cells hold valid UTF-8). */
static size_t cell_width(const char *s)
{
	size_t w = 0;
	for (; *s; s++)
		w += ((unsigned char)*s & 0xc0) != 0x80;
	return w;
}

static void print_padded(FILE *f, const char *s, size_t width, bool right)
{
	size_t w = cell_width(s);
	if (right)
		for (; w < width; w++)
			fputc(' ', f);
	fputs(s, f);
	if (!right)
		for (; w < width; w++)
			fputc(' ', f);
}

static int table_print(const struct table *t, FILE *f)
{
	size_t w[TABLE_MAX_COLS];
	for (size_t c = 0; c < t->ncols; c++) {
		w[c] = cell_width(t->head[c]);
		for (size_t r = 0; r < t->nrows; r++) {
			size_t l = cell_width(t->cells[r][c]);
			if (l > w[c])
				w[c] = l;
		}
	}
	for (size_t r = 0; r <= t->nrows; r++) {
		for (size_t c = 0; c < t->ncols; c++) {
			const char *s = r == 0 ? t->head[c] : t->cells[r - 1][c];
			bool last = c + 1 == t->ncols;
			print_padded(f, s, last && !t->right[c] ? 0 : w[c], t->right[c]);
			if (!last)
				fputs("  ", f);
		}
		fputc('\n', f);
	}
	return ferror(f) ? -EIO : 0;
}

/* ---- a tiny JSON emitter ----------------------------------------------- */

struct json {
	FILE *f;
	int depth;
	bool first[16]; /* no comma needed yet at this depth */
};

static void json_sep(struct json *j)
{
	if (j->depth > 0) {
		if (!j->first[j->depth])
			fputc(',', j->f);
		j->first[j->depth] = false;
	}
}

/* Writes s as a JSON string; invalid UTF-8 becomes U+FFFD. */
static void json_str_raw(FILE *f, const char *str)
{
	const unsigned char *s = (const unsigned char *)(str ? str : "");
	fputc('"', f);
	while (*s) {
		unsigned c = *s;
		switch (c) {
		case '"': fputs("\\\"", f); s++; continue;
		case '\\': fputs("\\\\", f); s++; continue;
		case '\b': fputs("\\b", f); s++; continue;
		case '\f': fputs("\\f", f); s++; continue;
		case '\n': fputs("\\n", f); s++; continue;
		case '\r': fputs("\\r", f); s++; continue;
		case '\t': fputs("\\t", f); s++; continue;
		default: break;
		}
		if (c < 0x20 || c == 0x7f) {
			fprintf(f, "\\u%04x", c);
			s++;
			continue;
		}
		size_t n = utf8_valid(s);
		if (n == 0) {
			fputs("\\ufffd", f);
			s++;
			continue;
		}
		fwrite(s, 1, n, f);
		s += n;
	}
	fputc('"', f);
}

static void json_key(struct json *j, const char *key)
{
	json_sep(j);
	if (key) {
		json_str_raw(j->f, key);
		fputc(':', j->f);
	}
}

static void json_open(struct json *j, const char *key, char bracket)
{
	json_key(j, key);
	fputc(bracket, j->f);
	if (j->depth + 1 < (int)(sizeof(j->first) / sizeof(j->first[0])))
		j->depth++;
	j->first[j->depth] = true;
}

static void json_close(struct json *j, char bracket)
{
	fputc(bracket, j->f);
	if (j->depth > 0)
		j->depth--;
}

static void json_string(struct json *j, const char *key, const char *v)
{
	json_key(j, key);
	json_str_raw(j->f, v);
}

static void json_u64(struct json *j, const char *key, uint64_t v)
{
	json_key(j, key);
	fprintf(j->f, "%" PRIu64, v);
}

static void json_double(struct json *j, const char *key, double v)
{
	json_key(j, key);
	if (isfinite(v))
		fprintf(j->f, "%.17g", v);
	else
		fputs("null", j->f);
}

/* ---- talking to the daemon --------------------------------------------- */

static int fail_unreachable(const char *path, int err, const char *what, const char *msg)
{
	fprintf(stderr, "aoqctl: %s aoqd at %s: %s%s%s\n", what, path, strerror(-err),
	        msg ? ": " : "", msg ? msg : "");
	if (err == -ENOENT || err == -ECONNREFUSED)
		fprintf(stderr, "aoqctl: is aoqd running? (choose its socket with --socket or AOQ_SOCKET)\n");
	return EXIT_UNREACHABLE;
}

/* Connects, says Hello as an observer and fetches Stats into *out. */
static int fetch_stats(const char *path, bool all, Aoq__Envelope **out)
{
	int sock = aoq_socket_connect(path);
	if (sock < 0)
		return fail_unreachable(path, sock, "cannot connect to", NULL);

	int ret = EXIT_UNREACHABLE;
	char *msg = NULL;
	Aoq__Envelope *rep = NULL;

	Aoq__Hello hello = AOQ__HELLO__INIT;
	hello.protocol_version = AOQ_PROTOCOL_VERSION;
	hello.job = (char *)"aoqctl";
	hello.device = (char *)"";
	hello.observer = true;
	hello.pid = (uint32_t)getpid();
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_HELLO;
	env.hello = &hello;
	int r = aoq_call(sock, &env, &rep, &msg);
	if (r < 0) {
		fail_unreachable(path, r, "handshake failed with", msg);
		goto out;
	}
	if (rep->msg_case != AOQ__ENVELOPE__MSG_WELCOME) {
		fprintf(stderr, "aoqctl: aoqd at %s answered Hello with message %d, not Welcome\n",
		        path, (int)rep->msg_case);
		goto out;
	}
	aoq_envelope_free(rep);
	rep = NULL;

	Aoq__StatsRequest req = AOQ__STATS_REQUEST__INIT;
	req.all_sessions = all;
	env = (Aoq__Envelope)AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_STATS_REQUEST;
	env.stats_request = &req;
	r = aoq_call(sock, &env, &rep, &msg);
	if (r < 0) {
		fail_unreachable(path, r, "stats request failed at", msg);
		goto out;
	}
	if (rep->msg_case != AOQ__ENVELOPE__MSG_STATS || !rep->stats) {
		fprintf(stderr, "aoqctl: aoqd at %s answered StatsRequest with message %d, not Stats\n",
		        path, (int)rep->msg_case);
		goto out;
	}

	/* Polite goodbye; the daemon may or may not answer it. */
	Aoq__Bye bye = AOQ__BYE__INIT;
	Aoq__Envelope benv = AOQ__ENVELOPE__INIT;
	benv.msg_case = AOQ__ENVELOPE__MSG_BYE;
	benv.bye = &bye;
	(void)aoq_send_frame(sock, &benv, NULL, 0);

	*out = rep;
	rep = NULL;
	ret = EXIT_OK;
out:
	free(msg);
	aoq_envelope_free(rep);
	close(sock);
	return ret;
}

/* ---- output ------------------------------------------------------------ */

static int print_stats_json(const Aoq__Stats *st)
{
	struct json j = { .f = stdout };
	json_open(&j, NULL, '{');
	json_string(&j, "version", st->version);
	json_u64(&j, "pid", st->pid);
	json_u64(&j, "threads", st->threads);
	json_string(&j, "kernel", st->kernel);
	json_u64(&j, "locked_bytes", st->locked_bytes);
	json_u64(&j, "rss_bytes", st->rss_bytes);
	json_double(&j, "uptime_seconds", st->uptime_seconds);
	json_open(&j, "sessions", '[');
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		json_open(&j, NULL, '{');
		json_u64(&j, "id", s->id);
		json_string(&j, "job", s->job);
		json_u64(&j, "rank", s->rank);
		json_u64(&j, "uid", s->uid);
		json_u64(&j, "pid", s->pid);
		json_string(&j, "device", s->device);
		json_string(&j, "state", s->state);
		json_string(&j, "precision", precision_name(s->precision));
		json_u64(&j, "tensors", s->tensors);
		json_u64(&j, "parameters", s->parameters);
		json_u64(&j, "steps", s->steps);
		json_u64(&j, "bytes_in", s->bytes_in);
		json_u64(&j, "bytes_out", s->bytes_out);
		json_double(&j, "optimizer_cpu_seconds", s->optimizer_cpu_seconds);
		json_u64(&j, "chunks", s->chunks);
		json_double(&j, "chunk_p50_us", s->chunk_p50_us);
		json_double(&j, "chunk_p99_us", s->chunk_p99_us);
		json_double(&j, "record_p50_us", s->record_p50_us);
		json_double(&j, "record_p99_us", s->record_p99_us);
		json_u64(&j, "state_bytes", s->state_bytes);
		json_u64(&j, "arena_bytes", s->arena_bytes);
		json_close(&j, '}');
	}
	json_close(&j, ']');
	json_close(&j, '}');
	fputc('\n', stdout);
	return ferror(stdout) ? -EIO : 0;
}

static int print_stats_table(const Aoq__Stats *st)
{
	char locked[32], rss[32], up[32];
	fmt_bytes(locked, sizeof(locked), st->locked_bytes);
	fmt_bytes(rss, sizeof(rss), st->rss_bytes);
	fmt_uptime(up, sizeof(up), st->uptime_seconds);
	printf("aoqd %s  pid %" PRIu32 "  threads %" PRIu32 "  kernel %s  locked %s  rss %s  uptime %s\n",
	       str_or(st->version, "?"), st->pid, st->threads, str_or(st->kernel, "?"), locked, rss, up);
	if (st->n_sessions == 0) {
		printf("no sessions\n");
		return ferror(stdout) ? -EIO : 0;
	}
	putchar('\n');

	struct table t = {
		.ncols = 13,
		.head = { "ID", "JOB", "RANK", "UID", "TENSORS", "PARAMS", "STEPS", "IN", "OUT",
		          "CPU s", "CHUNK p50us", "p99us", "OPT STATE" },
		.right = { true, false, true, true, true, true, true, true, true, true, true, true, true },
		.nrows = st->n_sessions,
	};
	t.cells = calloc(st->n_sessions, sizeof(*t.cells));
	if (!t.cells)
		return -ENOMEM;
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		char (*row)[CELL_LEN] = t.cells[i];
		snprintf(row[0], CELL_LEN, "%" PRIu64, s->id);
		cell_set(row[1], str_or(s->job, "-"));
		snprintf(row[2], CELL_LEN, "%" PRIu32, s->rank);
		snprintf(row[3], CELL_LEN, "%" PRIu32, s->uid);
		snprintf(row[4], CELL_LEN, "%" PRIu32, s->tensors);
		fmt_count(row[5], CELL_LEN, s->parameters);
		snprintf(row[6], CELL_LEN, "%" PRIu64, s->steps);
		fmt_bytes(row[7], CELL_LEN, s->bytes_in);
		fmt_bytes(row[8], CELL_LEN, s->bytes_out);
		fmt_double(row[9], CELL_LEN, s->optimizer_cpu_seconds, 3);
		fmt_double(row[10], CELL_LEN, s->chunk_p50_us, 1);
		fmt_double(row[11], CELL_LEN, s->chunk_p99_us, 1);
		fmt_bytes(row[12], CELL_LEN, s->state_bytes);
	}
	int r = table_print(&t, stdout);
	free(t.cells);
	return r;
}

static int print_sessions(const Aoq__Stats *st)
{
	struct table t = {
		.ncols = 8,
		.head = { "ID", "JOB", "RANK", "UID", "PID", "DEVICE", "STATE", "PRECISION" },
		.right = { true, false, true, true, true, false, false, false },
		.nrows = st->n_sessions,
	};
	if (st->n_sessions == 0) {
		printf("no sessions\n");
		return ferror(stdout) ? -EIO : 0;
	}
	t.cells = calloc(st->n_sessions, sizeof(*t.cells));
	if (!t.cells)
		return -ENOMEM;
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		char (*row)[CELL_LEN] = t.cells[i];
		snprintf(row[0], CELL_LEN, "%" PRIu64, s->id);
		cell_set(row[1], str_or(s->job, "-"));
		snprintf(row[2], CELL_LEN, "%" PRIu32, s->rank);
		snprintf(row[3], CELL_LEN, "%" PRIu32, s->uid);
		snprintf(row[4], CELL_LEN, "%" PRIu32, s->pid);
		cell_set(row[5], str_or(s->device, "-"));
		cell_set(row[6], str_or(s->state, "-"));
		cell_set(row[7], precision_name(s->precision));
	}
	int r = table_print(&t, stdout);
	free(t.cells);
	return r;
}

/* ---- main -------------------------------------------------------------- */

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

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "json", no_argument, NULL, 'j' },
		{ "all", no_argument, NULL, 'a' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	const char *socket_arg = NULL;
	bool json = false, all = false;
	int c;

	opterr = 0;
	/* Options before the command word ('+': stop at the first non-option). */
	while ((c = getopt_long(argc, argv, "+:s:jahV", longopts, NULL)) != -1) {
		switch (c) {
		case 's': socket_arg = optarg; break;
		case 'j': json = true; break;
		case 'a': all = true; break;
		case 'h': fputs(usage_text, stdout); return EXIT_OK;
		case 'V': printf("aoqctl %s (protocol %u)\n", AOQ_VERSION, AOQ_PROTOCOL_VERSION); return EXIT_OK;
		case ':': return usage_error("option '%s' needs an argument", argv[optind - 1]);
		default: return usage_error("unknown option '%s'", argv[optind - 1]);
		}
	}
	if (optind >= argc)
		return usage_error("no command given");
	const char *cmd = argv[optind++];

	/* Options after the command word: parse the rest as its own argv whose
	 * argv[0] is the command (optind = 0 makes glibc start afresh). */
	int sub_argc = argc - optind + 1;
	char **sub_argv = argv + optind - 1;
	optind = 0;
	while ((c = getopt_long(sub_argc, sub_argv, ":s:jahV", longopts, NULL)) != -1) {
		switch (c) {
		case 's': socket_arg = optarg; break;
		case 'j': json = true; break;
		case 'a': all = true; break;
		case 'h': fputs(usage_text, stdout); return EXIT_OK;
		case 'V': printf("aoqctl %s (protocol %u)\n", AOQ_VERSION, AOQ_PROTOCOL_VERSION); return EXIT_OK;
		case ':': return usage_error("option '%s' needs an argument", sub_argv[optind - 1]);
		default: return usage_error("unknown option '%s'", sub_argv[optind - 1]);
		}
	}
	if (optind < sub_argc)
		return usage_error("unexpected argument '%s'", sub_argv[optind]);

	bool is_stats = strcmp(cmd, "stats") == 0;
	bool is_sessions = strcmp(cmd, "sessions") == 0;
	if (!is_stats && !is_sessions)
		return usage_error("unknown command '%s'", cmd);
	if (json && !is_stats)
		return usage_error("--json goes with 'stats'");

	char path[512];
	int r = aoq_socket_path(socket_arg, path, sizeof(path));
	if (r < 0) {
		fprintf(stderr, "aoqctl: socket path too long\n");
		return EXIT_USAGE;
	}

	Aoq__Envelope *rep = NULL;
	int ret = fetch_stats(path, all, &rep);
	if (ret != EXIT_OK)
		return ret;
	if (is_stats)
		r = json ? print_stats_json(rep->stats) : print_stats_table(rep->stats);
	else
		r = print_sessions(rep->stats);
	aoq_envelope_free(rep);
	if (fflush(stdout) != 0 || r < 0) {
		fprintf(stderr, "aoqctl: cannot write output: %s\n", strerror(r < 0 ? -r : errno));
		return EXIT_UNREACHABLE;
	}
	return EXIT_OK;
}
