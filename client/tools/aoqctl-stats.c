/* SPDX-License-Identifier: MIT */
/*
 * aoqctl stats and aoqctl sessions: StatsRequest -> Stats, repeatedly with
 * --watch on one connection, each reply printed in the chosen format.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "aoqctl.h"

static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig)
{
	(void)sig;
	interrupted = 1;
}


static int show_stats(const Aoq__Stats *st, enum ctl_format fmt, bool sessions_only, bool watching, const char *output)
{
	struct view v;
	if (ctl_view_init(&v, st) < 0) {
		fprintf(stderr, "aoqctl: out of memory\n");
		return EXIT_UNREACHABLE;
	}
	struct out o;
	int r = ctl_out_open(&o, output);
	if (r == 0) {
		if (sessions_only)
			r = ctl_print_sessions(st, o.f);
		else if (fmt == CTL_FMT_JSON)
			r = ctl_print_stats_json(&v, o.f, watching);
		else if (fmt == CTL_FMT_PROMETHEUS)
			r = ctl_print_stats_prometheus(&v, o.f);
		else
			r = ctl_print_stats_table(&v, o.f);
		r = ctl_out_close(&o, r == 0);
	}
	ctl_view_fini(&v);
	return r == 0 ? EXIT_OK : EXIT_UNREACHABLE;
}

int ctl_run_stats(const char *path, bool all, enum ctl_format fmt, bool sessions_only, double watch,
                     const char *output)
{
	int sock;
	int ret = ctl_observer_connect(path, &sock);
	if (ret != EXIT_OK)
		return ret;
	bool tty = watch > 0 && fmt == CTL_FMT_TABLE && isatty(STDOUT_FILENO);
	if (watch > 0) {
		struct sigaction sa = { .sa_handler = on_interrupt };
		sigemptyset(&sa.sa_mask);
		sigaction(SIGINT, &sa, NULL);
		sigaction(SIGTERM, &sa, NULL);
	}
	for (;;) {
		Aoq__Envelope *rep = NULL;
		ret = ctl_request_stats(sock, path, all, &rep);
		if (ret != EXIT_OK)
			break;
		if (tty)
			fputs("\033[H\033[2J", stdout); /* home, clear: redraw in place */
		else if (watch > 0 && fmt == CTL_FMT_TABLE)
			putchar('\n');
		ret = show_stats(rep->stats, fmt, sessions_only, watch > 0, output);
		aoq_envelope_free(rep);
		if (ret != EXIT_OK || watch <= 0)
			break;
		struct timespec ts = { .tv_sec = (time_t)watch,
		                       .tv_nsec = (long)((watch - floor(watch)) * 1e9) };
		while (!interrupted && nanosleep(&ts, &ts) < 0 && errno == EINTR)
			;
		if (interrupted)
			break;
	}
	ctl_say_bye(sock);
	close(sock);
	return ret;
}
