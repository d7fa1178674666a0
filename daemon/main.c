/* SPDX-License-Identifier: MIT */
/* aoqd: the command line over the daemon library. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aoq-config.h"
#include "aoq-version.h"
#include "config.h"
#include "server.h"
#include "log.h"
#include "wire.h"

static void usage(FILE *f)
{
	fprintf(f,
	        "usage: aoqd [options]\n"
	        "  --socket PATH       listen on PATH (default $XDG_RUNTIME_DIR/aoq/aoqd.sock,\n"
	        "                      or a socket passed by systemd); at most 107 bytes\n"
	        "  --listen-fd N       use the listening Unix socket on fd N\n"
	        "  --threads N         worker threads, 0..1024 (default 0 = all cores but one)\n"
	        "  --kernel NAME       auto|scalar|avx2|avx512|avx512bf16 (or $AOQ_KERNEL)\n"
	        "  --lock-memory M     yes|try|no: mlock the optimizer state (default try)\n"
	        "  --config FILE       read key = value settings (see aoqd.conf(5));\n"
	        "                      flags given on the command line win\n"
	        "  --log-level L       error|warn|info|debug\n"
	        "  --state-dir DIR     where snapshots go (default $STATE_DIRECTORY or /var/lib/aoq)\n"
	        "  --check-config      check the settings, print the effective ones, exit\n"
	        "  -h, --help          this text\n"
	        "  -V, --version       the version\n"
	        "Options take their value as '--opt VALUE' or '--opt=VALUE'.\n");
}

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...)
{
	va_list ap;
	fputs("aoqd: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\nTry 'aoqd --help'.\n", stderr);
	return 2;
}

enum { O_SOCKET = 256, O_LISTEN_FD, O_THREADS, O_KERNEL, O_LOCK, O_CONFIG, O_LOG, O_CHECK, O_STATE_DIR };

static const struct option opts[] = {
	{ "socket", required_argument, NULL, O_SOCKET },
	{ "listen-fd", required_argument, NULL, O_LISTEN_FD },
	{ "threads", required_argument, NULL, O_THREADS },
	{ "kernel", required_argument, NULL, O_KERNEL },
	{ "lock-memory", required_argument, NULL, O_LOCK },
	{ "config", required_argument, NULL, O_CONFIG },
	{ "log-level", required_argument, NULL, O_LOG },
	{ "check-config", no_argument, NULL, O_CHECK },
	{ "state-dir", required_argument, NULL, O_STATE_DIR },
	{ "version", no_argument, NULL, 'V' },
	{ "help", no_argument, NULL, 'h' },
	{ 0 },
};

/* The config key behind a flag (NULL: not a setting). */
static const char *flag_key(int c)
{
	switch (c) {
	case O_SOCKET: return "socket";
	case O_THREADS: return "threads";
	case O_KERNEL: return "kernel";
	case O_LOCK: return "lock_memory";
	case O_LOG: return "log_level";
	case O_STATE_DIR: return "state_dir";
	default: return NULL;
	}
}

static const char *flag_name(int c)
{
	for (const struct option *o = opts; o->name; o++)
		if (o->val == c)
			return o->name;
	return "?";
}

/* The settings: defaults, $AOQ_KERNEL, the config file, then the flags (the
 * command line wins), then the default socket.  At start and on SIGHUP.
 * Returns 0; 2 for a bad flag or environment (err says which); 1 when the
 * config file is bad (config.c logged why). */
static char default_socket[108];

static int build_config(struct aoqd_config *cfg, int argc, char **argv, const char *config_path, char *err,
                        size_t errlen)
{
	char why[192];
	int c;
	aoqd_config_defaults(cfg);
	const char *env_kernel = getenv("AOQ_KERNEL");
	if (env_kernel && *env_kernel && aoqd_config_set(cfg, "kernel", env_kernel, why, sizeof(why)) < 0) {
		snprintf(err, errlen, "AOQ_KERNEL: %s", why);
		return 2;
	}
	if (config_path && aoqd_config_load(cfg, config_path) < 0) {
		snprintf(err, errlen, "%s is not valid", config_path);
		return 1;
	}
	optind = 0;
	opterr = 0;
	while ((c = getopt_long(argc, argv, ":hV", opts, NULL)) != -1) {
		const char *key = flag_key(c);
		if (key) {
			if (aoqd_config_set(cfg, key, optarg, why, sizeof(why)) < 0) {
				snprintf(err, errlen, "--%s: %s", flag_name(c), why);
				return 2;
			}
		} else if (c == O_LISTEN_FD) {
			uint64_t fd;
			int r = aoqd_parse_u64(optarg, 0, &fd);
			if (r < 0 || fd > INT_MAX) {
				snprintf(err, errlen, "--listen-fd: '%s' is not a file descriptor number (0..%d)", optarg,
				         INT_MAX);
				return 2;
			}
			cfg->listen_fd = (int)fd;
		}
	}
	if (!cfg->socket_path && cfg->listen_fd < 0) {
		/* By hand: the per-user default (a client tries /run/aoq first). */
		const char *xdg = getenv("XDG_RUNTIME_DIR");
		int n = xdg && *xdg ? snprintf(default_socket, sizeof(default_socket), "%s/aoq/aoqd.sock", xdg)
		                    : snprintf(default_socket, sizeof(default_socket), "/tmp/aoq-%u/aoqd.sock",
		                               (unsigned)getuid());
		if (n < 0 || (size_t)n >= sizeof(default_socket)) {
			snprintf(err, errlen, "the default socket path under $XDG_RUNTIME_DIR is longer than %zu bytes; "
			         "give --socket", sizeof(default_socket) - 1);
			return 2;
		}
		cfg->socket_path = default_socket;
	}
	return 0;
}

/* What SIGHUP re-reads. */
static struct {
	int argc;
	char **argv;
	const char *config_path;
} cmdline;

/* SIGHUP (the server's reload callback): the settings again, from the saved
 * config path and the same command line; a bad file keeps the old ones. */
static void reload(struct aoqd_server *srv)
{
	struct aoqd_config cfg;
	char err[256];
	if (!cmdline.config_path)
		aoqd_info("main", "reload: no --config file; the command line is read again");
	int r = build_config(&cfg, cmdline.argc, cmdline.argv, cmdline.config_path, err, sizeof(err));
	if (r == 0)
		r = aoqd_config_check(&cfg, err, sizeof(err));
	if (r != 0) {
		aoqd_err("main", "reload: %s; keeping the settings in use", err);
		return;
	}
	aoqd_server_apply(srv, &cfg);
}

int main(int argc, char **argv)
{
	struct aoqd_config cfg;
	const char *config_path = NULL;
	bool check = false;
	char err[256];
	int c;

	/* Pass 1: the syntax of every flag, --config, --help, --version.  The
	 * config file is read before the other flags are applied, so the
	 * command line wins whatever the order. */
	opterr = 0;
	while ((c = getopt_long(argc, argv, ":hV", opts, NULL)) != -1) {
		switch (c) {
		case O_CONFIG:
			if (config_path)
				return usage_error("--config: given twice");
			config_path = optarg;
			break;
		case O_CHECK: check = true; break;
		case 'V':
			printf("aoqd %s (protocol %u, arena %u)\n", aoq_full_version(), AOQ_PROTOCOL_VERSION,
			       AOQ_ARENA_VERSION);
			return 0;
		case 'h': usage(stdout); return 0;
		case ':': return usage_error("option '%s' needs a value", argv[optind - 1]);
		case '?':
			if (optopt)
				return usage_error("unknown option '-%c'", optopt);
			return usage_error("unknown option '%s'", argv[optind - 1]);
		default: break;
		}
	}
	if (optind < argc)
		return usage_error("unexpected argument '%s' (aoqd takes no positional arguments)", argv[optind]);

	/* Pass 2: the settings. */
	int r = build_config(&cfg, argc, argv, config_path, err, sizeof(err));
	if (r == 1)
		return 2;
	if (r != 0) {
		if (strncmp(err, "--", 2) == 0)
			return usage_error("%s", err);
		fprintf(stderr, "aoqd: %s\n", err);
		return 2;
	}
	aoqd_log_level = (enum aoqd_log_level)cfg.log_level;
	if (aoqd_config_check(&cfg, err, sizeof(err)) < 0) {
		fprintf(stderr, "aoqd: %s\n", err);
		return 2;
	}
	if (check) {
		aoqd_config_print(&cfg, stdout);
		fprintf(stderr, "aoqd: configuration ok\n");
		return fflush(stdout) == 0 ? 0 : 1;
	}
	cmdline.argc = argc;
	cmdline.argv = argv;
	cmdline.config_path = config_path;

	signal(SIGPIPE, SIG_IGN);
	uv_loop_t loop;
	uv_loop_init(&loop);
	struct aoqd_server srv;
	r = aoqd_server_init(&srv, &loop, &cfg);
	if (r < 0) {
		uv_run(&loop, UV_RUN_DEFAULT); /* closes what init opened */
		aoqd_server_fini(&srv);
		uv_loop_close(&loop);
		return 1;
	}
	srv.reload = reload; /* SIGHUP is handled only once the loop runs */
	uv_run(&loop, UV_RUN_DEFAULT);
	aoqd_server_fini(&srv);
	r = uv_loop_close(&loop);
	if (r != 0)
		aoqd_warn("main", "loop closed with live handles: %s", uv_strerror(r));
	aoqd_info("main", "stopped");
	return 0;
}
