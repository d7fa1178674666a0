/* SPDX-License-Identifier: MIT */
/*
 * bench-spine: the whole path (client, daemon, kernels) on the host backend ("cpu"), against
 * the CPU kernel alone in the same run.
 *
 *  (a) round trip per tensor, gradient pushed -> updated parameter ready
 *      (aoq_push_grad + aoq_sync_param, one tensor at a time), for 1000
 *      tensors of 4096 elements, p50/p99; the kernel alone on the same
 *      sizes (1000 separate states, one call per tensor, one thread); the
 *      protocol's own overhead is the difference.
 *  (b) throughput on one tensor of 2^28 elements (--elems): a whole step
 *      (push, step_end, sync) in G params/s, next to the kernel alone run
 *      with as many threads as the daemon, and next to the machine's
 *      memory bandwidth (threads copying).
 *  (c) host bytes per parameter: the daemon's state (Stats state_bytes /
 *      parameters), the arena, and the daemon's RSS growth.
 *
 * It starts its own aoqd (--aoqd PATH, default the build's) with
 * --threads N (default: all cores but one, as aoqd itself).
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "aoq-kernel.h"
#include "harness.h"

#ifndef AOQD_PATH
#define AOQD_PATH "aoqd"
#endif

static struct {
	const char *aoqd;
	unsigned threads;
	uint64_t elems;
	uint32_t tensors;
	uint64_t tensor_elems;
	int lat_steps;
	int tput_steps;
	enum aoq_dtype gd, pd;
	bool skip_tput;
	int client_cpu; /* -1: where the scheduler puts it */
} opt = { AOQD_PATH, 0, 1ull << 28, 1000, 4096, 11, 4, AOQ_BF16, AOQ_BF16, false, -1 };

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double quantile(double *v, size_t n, double q)
{
	qsort(v, n, sizeof(double), cmp_double);
	size_t i = (size_t)ceil(q * (double)n);
	if (i > 0)
		i--;
	return v[i < n ? i : n - 1];
}

static void *xalloc_big(size_t bytes)
{
	/* Page-aligned, faulted in now so no pass pays for first touch. */
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		fprintf(stderr, "bench: cannot allocate %zu MiB\n", bytes >> 20);
		exit(1);
	}
	madvise(p, bytes, MADV_HUGEPAGE);
	memset(p, 0, bytes);
	return p;
}

static void fill_grad(void *g, uint64_t n, enum aoq_dtype t, uint64_t seed)
{
	struct aoqt_rng r = { seed };
	for (uint64_t i = 0; i < n; i++)
		aoqt_store(g, i, t, 1e-2 * aoqt_uniform(&r));
}

static struct aoqk_hparams kernel_hp(uint64_t step)
{
	return (struct aoqk_hparams){ .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
	                              .weight_decay = 0.01f, .decoupled = true, .step = step, .grad_scale = 1.0f };
}

static Aoq__SessionStats *find_session(Aoq__Envelope *st, const char *job)
{
	for (size_t i = 0; i < st->stats->n_sessions; i++)
		if (strcmp(st->stats->sessions[i]->job, job) == 0)
			return st->stats->sessions[i];
	return NULL;
}

/* ---- (a) latency ---------------------------------------------------------- */

/* CPU seconds a process has used so far (utime + stime from /proc), or -1. */
static double proc_cpu_s(pid_t pid)
{
	char path[64], buf[1024];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return -1;
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = '\0';
	const char *p = strrchr(buf, ')'); /* the name may hold spaces */
	unsigned long ut, st;
	if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
		return -1;
	return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static double self_cpu_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void bench_latency(struct aoqt_daemon *d, const struct aoqk_kernel *k)
{
	const uint32_t nt = opt.tensors;
	const uint64_t n = opt.tensor_elems;
	const size_t gs = aoqt_dtype_size(opt.gd), ps = aoqt_dtype_size(opt.pd);

	/* The kernel alone: one state per tensor, as the daemon holds them. */
	float *state = xalloc_big((size_t)nt * n * 3 * sizeof(float));
	uint8_t *grads = xalloc_big((size_t)nt * n * gs);
	uint8_t *params = xalloc_big((size_t)nt * n * ps);
	for (uint32_t t = 0; t < nt; t++)
		fill_grad(grads + (size_t)t * n * gs, n, opt.gd, 1000 + t);
	size_t samples = (size_t)nt * (size_t)(opt.lat_steps - 1);
	double *kt = aoqt_xcalloc(samples, sizeof(double));
	size_t ks = 0;
	for (int step = 1; step <= opt.lat_steps; step++) {
		struct aoqk_hparams hp = kernel_hp((uint64_t)step);
		for (uint32_t t = 0; t < nt; t++) {
			float *base = state + (size_t)t * n * 3;
			struct aoqk_state st = { .precision = AOQK_STATE_FP32, .n = n, .master = base,
			                         .m = base + n, .v = base + 2 * n };
			struct aoqk_chunk c = { .begin = 0, .count = n, .grad = grads + (size_t)t * n * gs,
			                        .grad_dtype = (enum aoqk_dtype)opt.gd, .param = params + (size_t)t * n * ps,
			                        .param_dtype = (enum aoqk_dtype)opt.pd, .skip_nonfinite = true };
			struct aoqk_report rep;
			double t0 = aoqt_now();
			k->adam(&hp, &st, &c, &rep);
			double t1 = aoqt_now();
			if (step > 1)
				kt[ks++] = (t1 - t0) * 1e6;
		}
	}
	munmap(state, (size_t)nt * n * 3 * sizeof(float));

	/* Through the daemon. */
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = d->socket;
	o.job = "bench-latency";
	o.device = "cpu";
	/* AOQ_BENCH_NO_LEASE: without the lease's undo copy (README, "Lease and resume") */
	o.lease_seconds = getenv("AOQ_BENCH_NO_LEASE") ? AOQ_LEASE_NONE : 0;
	struct aoq_client *c;
	CHECK_OK(aoq_connect(&c, &o));
	struct aoq_group g = { .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
	                       .weight_decay = 0.01 };
	CHECK_OK(aoq_add_group(c, &g));
	for (uint32_t t = 0; t < nt; t++) {
		char name[32];
		snprintf(name, sizeof(name), "t%u", t);
		struct aoq_tensor td = { .size = sizeof(struct aoq_tensor), .name = name, .numel = n, .param_dtype = opt.pd, .grad_dtype = opt.gd,
		                         .param = params + (size_t)t * n * ps, .grad = grads + (size_t)t * n * gs };
		CHECK_OK(aoq_add_tensor(c, &td));
	}
	double r0 = aoqt_now();
	CHECK_OK(aoq_register(c));
	double reg_s = aoqt_now() - r0;
	double *rt = aoqt_xcalloc(samples, sizeof(double));
	size_t rs = 0;
	double step_sum = 0;
	double cpu_c0 = self_cpu_s(), cpu_d0 = proc_cpu_s(d->pid), wall0 = aoqt_now();
	for (int step = 1; step <= opt.lat_steps; step++) {
		double s0 = aoqt_now();
		for (uint32_t t = 0; t < nt; t++) {
			double t0 = aoqt_now();
			CHECK_OK(aoq_push_grad(c, t, 0, NULL));
			CHECK_OK(aoq_sync_param(c, t));
			double t1 = aoqt_now();
			if (step > 1)
				rt[rs++] = (t1 - t0) * 1e6;
		}
		CHECK_OK(aoq_step_end(c));
		CHECK_OK(aoq_sync(c, NULL));
		if (step > 1)
			step_sum += aoqt_now() - s0;
	}
	double cpu_c = self_cpu_s() - cpu_c0, cpu_d = proc_cpu_s(d->pid) - cpu_d0, wall = aoqt_now() - wall0;
	double trips = (double)nt * opt.lat_steps;
	/* The daemon's own percentiles of the one-at-a-time round trips (the
	 * pipelined steps below queue hundreds of records: taken after them, the
	 * record's p99 was their queueing, milliseconds) */
	Aoq__Envelope *st = NULL;
	CHECK_OK(aoqt_stats(d->socket, &st));
	Aoq__SessionStats *ss = find_session(st, "bench-latency");
	/* Pipelined: every tensor pushed at once, as backward would. */
	double p0 = aoqt_now();
	for (int step = 0; step < opt.lat_steps - 1; step++) {
		for (uint32_t t = 0; t < nt; t++)
			CHECK_OK(aoq_push_grad(c, t, 0, NULL));
		CHECK_OK(aoq_step_end(c));
		CHECK_OK(aoq_sync(c, NULL));
	}
	double pipe_s = (aoqt_now() - p0) / (opt.lat_steps - 1);

	double k50 = quantile(kt, ks, 0.5), k99 = quantile(kt, ks, 0.99);
	double r50 = quantile(rt, rs, 0.5), r99 = quantile(rt, rs, 0.99);
	printf("\n(a) round trip per tensor, %u tensors x %" PRIu64 " elements (grad %s, param %s), %d steps after 1 "
	       "warm-up (%zu samples)\n",
	       nt, n, aoq_dtype_name(opt.gd), aoq_dtype_name(opt.pd), opt.lat_steps - 1, rs);
	printf("    push -> param ready (aoq_push_grad + aoq_sync_param)   p50 %8.1f us   p99 %8.1f us\n", r50, r99);
	printf("    kernel alone (%s, 1 thread, same states)         p50 %8.1f us   p99 %8.1f us\n", k->name, k50, k99);
	printf("    protocol overhead (round trip - kernel)              p50 %8.1f us   p99 %8.1f us   (target p99 < 50 us)\n",
	       r50 - k50, r99 - k99);
	if (ss)
		printf("    daemon's view (one at a time, the warm-up step too): record accepted -> param posted  p50 %.1f us "
		       "p99 %.1f us; chunk p50 %.1f us p99 %.1f us\n",
		       ss->record_p50_us, ss->record_p99_us, ss->chunk_p50_us, ss->chunk_p99_us);
	printf("    CPU per round trip, one at a time: trainer process %.1f us, aoqd %.1f us (wall %.1f us; the kernel "
	       "and copies included)\n",
	       cpu_c / trips * 1e6, cpu_d0 < 0 ? -1.0 : cpu_d / trips * 1e6, wall / trips * 1e6);
	printf("    one tensor at a time: %.2f ms per step; all %u pushed at once: %.2f ms per step (%.1f us per tensor)\n",
	       step_sum / (opt.lat_steps - 1) * 1e3, nt, pipe_s * 1e3, pipe_s * 1e6 / nt);
	printf("    registration of %u tensors: %.1f ms\n", nt, reg_s * 1e3);
	aoq_envelope_free(st);
	aoq_close(c);
	munmap(grads, (size_t)nt * n * gs);
	munmap(params, (size_t)nt * n * ps);
	free(kt);
	free(rt);
}

/* ---- (b) throughput ------------------------------------------------------- */

struct worker {
	pthread_t th;
	pthread_barrier_t *start, *end;
	const struct aoqk_kernel *k;
	const struct aoqk_state *st;
	const uint8_t *grad;
	uint8_t *param;
	uint64_t begin, count;
	int passes;
	bool copy; /* bandwidth mode: copy src -> dst */
	const uint8_t *src;
	uint8_t *dst;
	size_t bytes;
};

static void *worker_run(void *arg)
{
	struct worker *w = arg;
	const size_t gs = aoqt_dtype_size(opt.gd), ps = aoqt_dtype_size(opt.pd);
	const uint64_t chunk = 1u << 16; /* a multiple of AOQK_Q8_BLOCK */
	for (int pass = 0; pass < w->passes; pass++) {
		pthread_barrier_wait(w->start);
		if (w->copy) {
			memcpy(w->dst, w->src, w->bytes);
		} else {
			struct aoqk_hparams hp = kernel_hp((uint64_t)pass + 1);
			for (uint64_t b = w->begin; b < w->begin + w->count; b += chunk) {
				uint64_t cnt = w->begin + w->count - b < chunk ? w->begin + w->count - b : chunk;
				struct aoqk_chunk c = { .begin = b, .count = cnt, .grad = w->grad + b * gs,
				                        .grad_dtype = (enum aoqk_dtype)opt.gd, .param = w->param + b * ps,
				                        .param_dtype = (enum aoqk_dtype)opt.pd, .skip_nonfinite = true };
				struct aoqk_report rep;
				w->k->adam(&hp, w->st, &c, &rep);
			}
		}
		pthread_barrier_wait(w->end);
	}
	return NULL;
}

/* Runs `passes` timed passes over [0, n) with opt.threads threads (kernel,
 * or copying when src/dst are given); returns the best pass in seconds. */
static double run_passes(const struct aoqk_kernel *k, const struct aoqk_state *st, const uint8_t *grad,
                         uint8_t *param, uint64_t n, int passes, const uint8_t *src, uint8_t *dst, size_t bytes)
{
	unsigned nt = opt.threads;
	struct worker *w = aoqt_xcalloc(nt, sizeof(*w));
	pthread_barrier_t start, end;
	pthread_barrier_init(&start, NULL, nt + 1);
	pthread_barrier_init(&end, NULL, nt + 1);
	uint64_t per = (n / nt + AOQK_Q8_BLOCK - 1) / AOQK_Q8_BLOCK * AOQK_Q8_BLOCK;
	size_t bper = (bytes / nt + 4095) & ~(size_t)4095;
	for (unsigned i = 0; i < nt; i++) {
		w[i] = (struct worker){ .start = &start, .end = &end, .k = k, .st = st, .grad = grad, .param = param,
		                        .passes = passes, .copy = src != NULL };
		uint64_t b = per * i < n ? per * i : n;
		w[i].begin = b;
		w[i].count = (i == nt - 1 || b + per > n) ? n - b : per;
		if (src) {
			size_t ob = bper * i < bytes ? bper * i : bytes;
			w[i].src = src + ob;
			w[i].dst = dst + ob;
			w[i].bytes = (i == nt - 1 || ob + bper > bytes) ? bytes - ob : bper;
		}
		pthread_create(&w[i].th, NULL, worker_run, &w[i]);
	}
	double best = INFINITY;
	for (int p = 0; p < passes; p++) {
		pthread_barrier_wait(&start);
		double t0 = aoqt_now();
		pthread_barrier_wait(&end);
		double dt = aoqt_now() - t0;
		if (p > 0 || passes == 1)
			best = dt < best ? dt : best;
	}
	for (unsigned i = 0; i < nt; i++)
		pthread_join(w[i].th, NULL);
	pthread_barrier_destroy(&start);
	pthread_barrier_destroy(&end);
	free(w);
	return best;
}

static void bench_throughput(struct aoqt_daemon *d, const struct aoqk_kernel *k)
{
	const uint64_t n = opt.elems;
	const size_t gs = aoqt_dtype_size(opt.gd), ps = aoqt_dtype_size(opt.pd);
	const double bpp = 12 + 12 + (double)gs + (double)ps; /* read+write state, read grad, write param */

	/* Memory bandwidth: copying 1 GiB (or the gradient's size). */
	size_t cb = n * gs > (1u << 30) ? (size_t)n * gs : (size_t)1 << 30;
	uint8_t *src = xalloc_big(cb), *dst = xalloc_big(cb);
	double ct = run_passes(NULL, NULL, NULL, NULL, 0, 4, src, dst, cb);
	munmap(src, cb);
	munmap(dst, cb);
	double copy_gbs = 2.0 * (double)cb / ct / 1e9;

	/* The kernel alone. */
	float *state = xalloc_big((size_t)n * 3 * sizeof(float));
	uint8_t *grad = xalloc_big((size_t)n * gs), *param = xalloc_big((size_t)n * ps);
	fill_grad(grad, n, opt.gd, 7);
	struct aoqk_state st = { .precision = AOQK_STATE_FP32, .n = n, .master = state, .m = state + n,
	                         .v = state + 2 * n };
	double kt = run_passes(k, &st, grad, param, n, opt.tput_steps, NULL, NULL, 0);
	munmap(state, (size_t)n * 3 * sizeof(float));

	/* Through the daemon, a whole step at a time. */
	Aoq__Envelope *st0 = NULL;
	CHECK_OK(aoqt_stats(d->socket, &st0));
	uint64_t rss0 = aoqt_rss_bytes(d->pid);
	aoq_envelope_free(st0);
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = d->socket;
	o.job = "bench-throughput";
	o.device = "cpu";
	/* AOQ_BENCH_NO_LEASE: without the lease's undo copy (README, "Lease and resume") */
	o.lease_seconds = getenv("AOQ_BENCH_NO_LEASE") ? AOQ_LEASE_NONE : 0;
	struct aoq_client *c;
	CHECK_OK(aoq_connect(&c, &o));
	struct aoq_group g = { .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
	                       .weight_decay = 0.01 };
	CHECK_OK(aoq_add_group(c, &g));
	struct aoq_tensor td = { .size = sizeof(struct aoq_tensor), .name = "big", .numel = n, .param_dtype = opt.pd, .grad_dtype = opt.gd,
	                         .param = param, .grad = grad };
	CHECK_OK(aoq_add_tensor(c, &td));
	double r0 = aoqt_now();
	CHECK_OK(aoq_register(c));
	double reg_s = aoqt_now() - r0;
	double best = INFINITY, sum = 0;
	for (int s = 0; s < opt.tput_steps; s++) {
		double t0 = aoqt_now();
		CHECK_OK(aoq_push_grad(c, 0, 0, NULL));
		CHECK_OK(aoq_step_end(c));
		CHECK_OK(aoq_sync(c, NULL));
		double dt = aoqt_now() - t0;
		if (s > 0 || opt.tput_steps == 1) {
			best = dt < best ? dt : best;
			sum += dt;
		}
	}
	int timed = opt.tput_steps > 1 ? opt.tput_steps - 1 : 1;
	Aoq__Envelope *st1 = NULL;
	CHECK_OK(aoqt_stats(d->socket, &st1));
	uint64_t rss1 = aoqt_rss_bytes(d->pid);
	Aoq__SessionStats *ss = find_session(st1, "bench-throughput");

	double e2e = (double)n / best / 1e9, kern = (double)n / kt / 1e9;
	printf("\n(b) throughput, one tensor of %" PRIu64 " elements (grad %s, param %s, fp32 state), %u threads\n", n,
	       aoq_dtype_name(opt.gd), aoq_dtype_name(opt.pd), opt.threads);
	printf("    memory bandwidth (threads copying %zu MiB)        %7.1f GB/s\n", cb >> 20, copy_gbs);
	printf("    kernel alone (%s)                              %7.3f G params/s  (%.1f GB/s at %.0f B/param)\n",
	       k->name, kern, kern * bpp, bpp);
	printf("    aoqd end to end (push, step_end, sync)            %7.3f G params/s  best of %d, mean %.3f\n", e2e,
	       timed, (double)n * timed / sum / 1e9);
	printf("    ratio end to end / kernel alone                   %7.2f   (target >= 0.90)\n", e2e / kern);
	printf("    ratio kernel / copy bandwidth                     %7.2f\n", kern * bpp / copy_gbs);
	printf("    registration (state + arena + initial values)      %7.1f ms\n", reg_s * 1e3);

	printf("\n(c) host bytes per parameter\n");
	if (ss && ss->parameters) {
		printf("    daemon state (Stats state_bytes / parameters)    %6.2f B  (%" PRIu64 " / %" PRIu64 ")\n",
		       (double)ss->state_bytes / (double)ss->parameters, ss->state_bytes, ss->parameters);
		printf("    arena (Stats arena_bytes / parameters)           %6.2f B  (%" PRIu64 ")\n",
		       (double)ss->arena_bytes / (double)ss->parameters, ss->arena_bytes);
		printf("    daemon RSS growth / parameters                   %6.2f B  (%.0f MiB -> %.0f MiB)\n",
		       ((double)rss1 - (double)rss0) / (double)ss->parameters, rss0 / 1048576.0, rss1 / 1048576.0);
		printf("    daemon locked bytes                              %" PRIu64 " MiB\n", st1->stats->locked_bytes >> 20);
		printf("    daemon's chunk latency p50 %.1f us p99 %.1f us over %" PRIu64 " chunks\n", ss->chunk_p50_us,
		       ss->chunk_p99_us, ss->chunks);
	} else {
		printf("    (the session is missing from Stats)\n");
	}
	aoq_envelope_free(st1);
	aoq_close(c);
	munmap(grad, (size_t)n * gs);
	munmap(param, (size_t)n * ps);
}

static enum aoq_dtype parse_dtype(const char *s)
{
	if (strcmp(s, "fp32") == 0)
		return AOQ_FP32;
	if (strcmp(s, "bf16") == 0)
		return AOQ_BF16;
	if (strcmp(s, "fp16") == 0)
		return AOQ_FP16;
	fprintf(stderr, "bench: unknown dtype '%s'\n", s);
	exit(2);
}

static void usage(const char *argv0)
{
	printf("usage: %s [options]\n"
	       "  --aoqd PATH          daemon to start (default %s)\n"
	       "  --threads N          aoqd --threads, and the kernel-alone threads (default: cores - 1)\n"
	       "  --elems N            elements of the throughput tensor (default 2^28; ~5 GB of RAM)\n"
	       "  --tensors N          latency: tensors (default 1000)\n"
	       "  --tensor-elems N     latency: elements per tensor (default 4096)\n"
	       "  --steps N            latency: steps, the first a warm-up (default 11)\n"
	       "  --tput-steps N       throughput: steps/passes, the first a warm-up (default 4)\n"
	       "  --grad T --param T   dtypes fp32|bf16|fp16 (default bf16, bf16)\n"
	       "  --no-throughput      only (a)\n"
	       "  --client-cpu N       pin the benchmark's trainer thread (and libaoq's, started from it) to CPU N\n"
	       "                       once aoqd runs (default: unpinned)\n",
	       argv0, AOQD_PATH);
}

int main(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "aoqd", required_argument, NULL, 'a' },     { "threads", required_argument, NULL, 't' },
		{ "elems", required_argument, NULL, 'e' },    { "tensors", required_argument, NULL, 'n' },
		{ "tensor-elems", required_argument, NULL, 'E' }, { "steps", required_argument, NULL, 's' },
		{ "tput-steps", required_argument, NULL, 'S' }, { "grad", required_argument, NULL, 'g' },
		{ "param", required_argument, NULL, 'p' },    { "no-throughput", no_argument, NULL, 'N' },
		{ "client-cpu", required_argument, NULL, 'C' }, { "help", no_argument, NULL, 'h' },
		{ 0 },
	};
	int ch;
	while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
		switch (ch) {
		case 'a': opt.aoqd = optarg; break;
		case 't': opt.threads = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'e': opt.elems = strtoull(optarg, NULL, 0); break;
		case 'n': opt.tensors = (uint32_t)strtoul(optarg, NULL, 0); break;
		case 'E': opt.tensor_elems = strtoull(optarg, NULL, 0); break;
		case 's': opt.lat_steps = atoi(optarg); break;
		case 'S': opt.tput_steps = atoi(optarg); break;
		case 'g': opt.gd = parse_dtype(optarg); break;
		case 'p': opt.pd = parse_dtype(optarg); break;
		case 'N': opt.skip_tput = true; break;
		case 'C': {
			char *end;
			long v = strtol(optarg, &end, 10);
			if (*optarg == '\0' || *end != '\0' || v < 0 || v >= CPU_SETSIZE) {
				fprintf(stderr, "bench-spine: --client-cpu wants a CPU number, not '%s'\n", optarg);
				return 2;
			}
			opt.client_cpu = (int)v;
			break;
		}
		case 'h': usage(argv[0]); return 0;
		default: usage(argv[0]); return 2;
		}
	}
	if (opt.threads == 0) {
		long nc = sysconf(_SC_NPROCESSORS_ONLN);
		opt.threads = nc > 1 ? (unsigned)nc - 1 : 1;
	}
	if (opt.lat_steps < 2)
		opt.lat_steps = 2;
	if (opt.tput_steps < 1)
		opt.tput_steps = 1;
	if (opt.tensors == 0 || opt.tensor_elems == 0 || opt.elems == 0) {
		usage(argv[0]);
		return 2;
	}
	aoqt_init("bench-spine");
	const struct aoqk_kernel *k = aoqk_select(NULL);
	CHECK(k != NULL, "no kernel: %s", strerror(errno));

	char targ[16];
	snprintf(targ, sizeof(targ), "%u", opt.threads);
	const char *args[] = { "--threads", targ, NULL };
	struct aoqt_daemon d;
	CHECK_OK(aoqt_daemon_start(&d, opt.aoqd, args));
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	if (opt.client_cpu >= 0) {
		/* after the daemon started: it keeps the mask it was given */
		cpu_set_t one;
		CPU_ZERO(&one);
		CPU_SET(opt.client_cpu, &one);
		int r = pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
		CHECK(r == 0, "--client-cpu %d: %s", opt.client_cpu, strerror(r));
	}
	char where[32] = "unpinned";
	if (opt.client_cpu >= 0)
		snprintf(where, sizeof(where), "on CPU %d", opt.client_cpu);
	printf("bench-spine: %ld CPUs online, aoqd --threads %u, kernel %s, trainer thread %s\n", ncpu, opt.threads,
	       k->name, where);

	bench_latency(&d, k);
	if (!opt.skip_tput)
		bench_throughput(&d, k);

	int rc = aoqt_daemon_stop(&d, 60000, true);
	CHECK(rc == 0, "aoqd exit status %d", rc);
	return 0;
}
