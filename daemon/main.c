/* SPDX-License-Identifier: MIT */
/* aoqd: the command line over the daemon library. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aoq-config.h"
#include "server.h"
#include "log.h"
#include "wire.h"

static void usage(FILE *f)
{
	fprintf(f,
	        "usage: aoqd [options]\n"
	        "  --socket PATH       listen on PATH (default $XDG_RUNTIME_DIR/aoq/aoqd.sock,\n"
	        "                      or a socket passed by systemd)\n"
	        "  --listen-fd N       use the listening socket on fd N\n"
	        "  --threads N         worker threads (default: all cores but one)\n"
	        "  --kernel NAME       auto|scalar|avx2|avx512|avx512bf16 (or $AOQ_KERNEL)\n"
	        "  --lock-memory M     yes|try|no: mlock the optimizer state (default try)\n"
	        "  --config FILE       read key = value settings (see deploy/aoqd.conf)\n"
	        "  --log-level L       error|warn|info|debug\n"
	        "  --version, --help\n");
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "listen-fd", required_argument, NULL, 'f' },
		{ "threads", required_argument, NULL, 't' },
		{ "kernel", required_argument, NULL, 'k' },
		{ "lock-memory", required_argument, NULL, 'l' },
		{ "config", required_argument, NULL, 'c' },
		{ "log-level", required_argument, NULL, 'L' },
		{ "version", no_argument, NULL, 'V' },
		{ "help", no_argument, NULL, 'h' },
		{ 0 },
	};
	struct aoqd_config cfg;
	aoqd_config_defaults(&cfg);
	const char *env_kernel = getenv("AOQ_KERNEL");
	if (env_kernel && *env_kernel)
		cfg.kernel = env_kernel;
	int c;
	/* A config file first, so the command line wins. */
	for (int i = 1; i < argc - 1; i++)
		if (strcmp(argv[i], "--config") == 0 && aoqd_config_load(&cfg, argv[i + 1]) < 0)
			return 2;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 's': cfg.socket_path = optarg; break;
		case 'f': cfg.listen_fd = atoi(optarg); break;
		case 't': cfg.threads = (unsigned)atoi(optarg); break;
		case 'k': cfg.kernel = optarg; break;
		case 'l':
			cfg.lock_memory = strcmp(optarg, "no") == 0 ? 0 : strcmp(optarg, "yes") == 0 ? 2 : 1;
			break;
		case 'c': break;
		case 'L':
			if (aoqd_log_parse_level(optarg) < 0) {
				usage(stderr);
				return 2;
			}
			aoqd_log_level = (enum aoqd_log_level)aoqd_log_parse_level(optarg);
			break;
		case 'V': printf("aoqd %s\n", AOQ_VERSION); return 0;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	char path[108];
	if (!cfg.socket_path && cfg.listen_fd < 0) {
		/* By hand: the per-user default (a client tries /run/aoq first). */
		const char *xdg = getenv("XDG_RUNTIME_DIR");
		int n = xdg && *xdg ? snprintf(path, sizeof(path), "%s/aoq/aoqd.sock", xdg)
		                    : snprintf(path, sizeof(path), "/tmp/aoq-%u/aoqd.sock", (unsigned)getuid());
		if (n < 0 || (size_t)n >= sizeof(path)) {
			aoqd_err("main", "socket path too long");
			return 2;
		}
		cfg.socket_path = path;
	}
	signal(SIGPIPE, SIG_IGN);
	uv_loop_t loop;
	uv_loop_init(&loop);
	struct aoqd_server srv;
	int r = aoqd_server_init(&srv, &loop, &cfg);
	if (r < 0) {
		uv_run(&loop, UV_RUN_DEFAULT); /* closes what init opened */
		aoqd_server_fini(&srv);
		uv_loop_close(&loop);
		return 1;
	}
	uv_run(&loop, UV_RUN_DEFAULT);
	aoqd_server_fini(&srv);
	r = uv_loop_close(&loop);
	if (r != 0)
		aoqd_warn("main", "loop closed with live handles: %s", uv_strerror(r));
	aoqd_info("main", "stopped");
	return 0;
}
