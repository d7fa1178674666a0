/* SPDX-License-Identifier: MIT */
/*
 * Fair share between sessions (daemon/pool.h): a small job (16 tensors of
 * 64 Ki elements) steps while a job ten times its size (40 tensors of
 * 256 Ki) steps as fast as it can, on a daemon with one worker.  The check
 * is structural, so a loaded machine does not make it flaky: the big job's
 * chunks run between the start and the end of each small step (the
 * daemon's chunk counter, read before and after) stay within 2.5 times the
 * small step's own elements, median over the steps.  Deficit round robin
 * by elements gives the big job the small one's share (1x) plus what it
 * runs alone around the small step (the chunk running at the start, and
 * during the small client's StepEnd, sync and Stats round trips): 1.5x to
 * 1.75x measured on a loaded 2-core machine.  One task per turn let it run
 * a 256 Ki chunk between every two of the small job's 64 Ki ones: up to
 * 4x (measured 2.75x and 3.75x; the client-side noise can hide it, so the
 * pool's order itself is checked exactly in tests/unit/test-pool.c).  The
 * step latencies alone and beside the big job are printed, not checked:
 * on a shared 2-core machine the trainers' own copies compete with the
 * worker for the cores.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "harness.h"

#define SMALL_T 16
#define SMALL_N 65536u
#define BIG_T 40
#define BIG_N 262144u
#define STEPS 15

struct side {
	struct aoq_client *c;
	int nt;
	float *p[BIG_T], *g[BIG_T];
};

static void open_side(struct side *s, const char *sock, const char *job, int nt, uint32_t n)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	o.job = job;
	o.device = "cpu";
	CHECK_OK(aoq_connect(&s->c, &o));
	struct aoq_group h = { .size = sizeof(h), .kind = AOQ_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
	                       .eps = 1e-8, .weight_decay = 0.01 };
	CHECK_OK(aoq_add_group(s->c, &h));
	s->nt = nt;
	for (int t = 0; t < nt; t++) {
		s->p[t] = aoqt_xcalloc(n, sizeof(float));
		s->g[t] = aoqt_xcalloc(n, sizeof(float));
		for (uint32_t i = 0; i < n; i++)
			s->g[t][i] = (float)((i % 7) + 1) * 1e-3f;
		char name[16];
		snprintf(name, sizeof(name), "t%d", t);
		struct aoq_tensor td = { .size = sizeof(td), .name = name, .numel = n, .param_dtype = AOQ_FP32,
		                         .grad_dtype = AOQ_FP32, .group = 0, .param = s->p[t], .grad = s->g[t] };
		CHECK_OK(aoq_add_tensor(s->c, &td));
	}
	CHECK_OK(aoq_register(s->c));
}

static void step(struct side *s)
{
	for (int t = 0; t < s->nt; t++)
		CHECK_OK(aoq_push_grad(s->c, (uint32_t)t, 0, NULL));
	CHECK_OK(aoq_step_end(s->c));
	CHECK_OK(aoq_sync(s->c, NULL));
}

static void close_side(struct side *s)
{
	aoq_close(s->c);
	for (int t = 0; t < s->nt; t++) {
		free(s->p[t]);
		free(s->g[t]);
	}
}

static struct aoqt_daemon d;
static atomic_bool stop;
static atomic_uint big_steps;

static void *big_main(void *arg)
{
	struct side *b = arg;
	while (!atomic_load(&stop)) {
		step(b);
		atomic_fetch_add(&big_steps, 1);
	}
	return NULL;
}

/* The chunks the job's session has run so far. */
static uint64_t chunks_of(const char *job)
{
	Aoq__Envelope *st = NULL;
	CHECK_OK(aoqt_stats(d.socket, &st));
	uint64_t n = UINT64_MAX;
	for (size_t k = 0; k < st->stats->n_sessions; k++)
		if (strcmp(st->stats->sessions[k]->job, job) == 0)
			n = st->stats->sessions[k]->chunks;
	aoq_envelope_free(st);
	CHECK(n != UINT64_MAX, "no session of job %s in Stats", job);
	return n;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	return v[n / 2];
}

int main(int argc, char **argv)
{
	aoqt_init("fairshare");
	const char *exe = aoqt_aoqd_path(argc, argv);
	const char *args[] = { "--threads", "1", NULL };
	CHECK_OK(aoqt_daemon_start(&d, exe, args));
	static struct side small, big;
	open_side(&small, d.socket, "small", SMALL_T, SMALL_N);
	open_side(&big, d.socket, "big", BIG_T, BIG_N);

	double alone[STEPS], shared[STEPS], big_elems[STEPS];
	for (int i = 0; i < 3; i++)
		step(&small);
	for (int i = 0; i < STEPS; i++) {
		double t0 = aoqt_now();
		step(&small);
		alone[i] = aoqt_now() - t0;
	}

	pthread_t th;
	CHECK(pthread_create(&th, NULL, big_main, &big) == 0, "thread");
	while (atomic_load(&big_steps) < 1)
		step(&small); /* the big job is under way */
	for (int i = 0; i < STEPS; i++) {
		uint64_t c0 = chunks_of("big");
		double t0 = aoqt_now();
		step(&small);
		shared[i] = aoqt_now() - t0;
		uint64_t c1 = chunks_of("big");
		/* one worker: a 256 Ki tensor is one chunk */
		big_elems[i] = (double)(c1 - c0) * BIG_N;
	}
	atomic_store(&stop, true);
	pthread_join(th, NULL);

	double small_elems = (double)SMALL_T * SMALL_N;
	double a = median(alone, STEPS), s = median(shared, STEPS), be = median(big_elems, STEPS);
	printf("small step alone %.3f ms, beside the big job %.3f ms (%.2fx); big job's elements during a small "
	       "step: %.0f (%.2fx the small step's %.0f), %u big steps\n",
	       a * 1e3, s * 1e3, s / a, be, be / small_elems, small_elems, atomic_load(&big_steps));
	CHECK(be <= 2.5 * small_elems, "the big job ran %.0f elements during a small step of %.0f (median): more "
	      "than its fair share and the slop around it", be, small_elems);
	close_side(&small);
	close_side(&big);
	CHECK(aoqt_daemon_stop(&d, 10000, true) == 0, "aoqd exits cleanly");
	printf("ok\n");
	return 0;
}
