/* SPDX-License-Identifier: MIT */
/*
 * bench-fairshare: the fair-share figure.  Two jobs on one aoqd (host
 * backend, the daemon's own worker count unless --threads): a small job of
 * --tensors tensors of --elems elements and a big job --ratio times its size
 * (as many tensors, each --ratio times longer).  The small job's step latency
 * (push every gradient, StepEnd, sync) is measured alone, then while the big
 * job steps as fast as it can; the ratio of the medians is the figure (target
 * at most 2x).  The big job's step time alone and beside the small one is
 * printed too, so the price the big job pays is visible.  The ceiling the
 * small job is compared against is its own latency alone, in the same run.
 *
 * The test (tests/integration/test-fairshare.c) checks the pool's order
 * structurally on one worker; this prints the latencies a user sees.
 */
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#ifndef AOQD_PATH
#define AOQD_PATH "aoqd"
#endif

#define MAX_T 4096

static struct {
	const char *aoqd;
	unsigned threads;
	uint32_t tensors;
	uint64_t elems;
	unsigned ratio;
	int steps;
} opt = { AOQD_PATH, 0, 16, 1u << 20, 10, 30 };


static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double quantile(double *v, int n, double q)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	return v[(int)(q * (n - 1) + 0.5)];
}

static atomic_bool stop;
static atomic_int big_n;
static double big_t[100000];

static void *big_main(void *arg)
{
	struct aoqt_job *b = arg;
	while (!atomic_load(&stop)) {
		double t = aoqt_job_step(b);
		int k = atomic_load(&big_n);
		if (k < (int)(sizeof(big_t) / sizeof(big_t[0])))
			big_t[k] = t;
		atomic_store(&big_n, k + 1);
	}
	return NULL;
}

static void usage(void)
{
	fprintf(stderr, "usage: bench-fairshare [--aoqd PATH] [--threads N] [--tensors T] [--elems N] "
	                "[--ratio R] [--steps S]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	static const struct option lo[] = { { "aoqd", 1, 0, 'a' },  { "threads", 1, 0, 'j' },
		                            { "tensors", 1, 0, 't' }, { "elems", 1, 0, 'n' },
		                            { "ratio", 1, 0, 'r' },   { "steps", 1, 0, 's' },
		                            { 0, 0, 0, 0 } };
	for (int ch; (ch = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
		switch (ch) {
		case 'a': opt.aoqd = optarg; break;
		case 'j': opt.threads = (unsigned)strtoul(optarg, NULL, 0); break;
		case 't': opt.tensors = (uint32_t)strtoul(optarg, NULL, 0); break;
		case 'n': opt.elems = strtoull(optarg, NULL, 0); break;
		case 'r': opt.ratio = (unsigned)strtoul(optarg, NULL, 0); break;
		case 's': opt.steps = atoi(optarg); break;
		default: usage();
		}
	}
	if (optind != argc || opt.tensors < 1 || opt.tensors > MAX_T || opt.elems < 1 || opt.ratio < 1 ||
	    opt.steps < 3 || opt.steps > 100000)
		usage();

	aoqt_init("bench-fairshare");
	struct aoqt_daemon d;
	char thr[16];
	snprintf(thr, sizeof(thr), "%u", opt.threads);
	const char *args[] = { "--threads", thr, NULL };
	CHECK_OK(aoqt_daemon_start(&d, opt.aoqd, opt.threads ? args : (const char *[]){ NULL }));
	static struct aoqt_job small, big;
	aoqt_job_open(&small, d.socket, "small", opt.tensors, opt.elems);
	aoqt_job_open(&big, d.socket, "big", opt.tensors, opt.elems * opt.ratio);
	printf("small job %u x %" PRIu64 " elements, big job %u x %" PRIu64 " (%ux), aoqd threads %s\n", opt.tensors,
	       opt.elems, opt.tensors, opt.elems * opt.ratio, opt.ratio, opt.threads ? thr : "default");

	int n = opt.steps;
	double *alone = aoqt_xcalloc((size_t)n, sizeof(double)), *beside = aoqt_xcalloc((size_t)n, sizeof(double));
	double big_alone[8];
	for (int i = 0; i < 3; i++)
		aoqt_job_step(&small);
	for (int i = 0; i < n; i++)
		alone[i] = aoqt_job_step(&small);
	aoqt_job_step(&big);
	for (int i = 0; i < 8; i++)
		big_alone[i] = aoqt_job_step(&big);

	pthread_t th;
	CHECK(pthread_create(&th, NULL, big_main, &big) == 0, "thread");
	while (atomic_load(&big_n) < 1)
		aoqt_job_step(&small); /* the big job is under way */
	int b0 = atomic_load(&big_n);
	for (int i = 0; i < n; i++)
		beside[i] = aoqt_job_step(&small);
	int b1 = atomic_load(&big_n);
	atomic_store(&stop, true);
	pthread_join(th, NULL);

	double a50 = quantile(alone, n, 0.5), a90 = quantile(alone, n, 0.9);
	double s50 = quantile(beside, n, 0.5), s90 = quantile(beside, n, 0.9);
	double ba = quantile(big_alone, 8, 0.5);
	int nb = b1 - b0 > 0 ? b1 - b0 : 0;
	double bb = nb ? quantile(big_t + b0, nb, 0.5) : 0;
	printf("small step alone: p50 %.3f ms p90 %.3f ms\n", a50 * 1e3, a90 * 1e3);
	printf("small step beside the big job: p50 %.3f ms p90 %.3f ms\n", s50 * 1e3, s90 * 1e3);
	printf("big step alone p50 %.3f ms, beside the small job p50 %.3f ms (%d steps)\n", ba * 1e3, bb * 1e3, nb);
	printf("small job's latency beside / alone: %.2fx (p50), %.2fx (p90); target <= 2x: %s\n", s50 / a50,
	       s90 / a90, s50 / a50 <= 2.0 ? "met" : "missed");
	aoqt_job_close(&small);
	aoqt_job_close(&big);
	free(alone);
	free(beside);
	CHECK(aoqt_daemon_stop(&d, 30000, true) == 0, "aoqd exits cleanly");
	return 0;
}
