/* SPDX-License-Identifier: MIT */
/*
 * Kernel benchmark (not a test).
 *
 *   bench-kernels [-n PARAMS] [-t THREADS] [-r REPS] [-c CHUNK] [-k VARIANT,...]
 *   bench-kernels --resident[=N] [-r REPS] [-c CHUNK] [-k VARIANT,...]
 *   bench-kernels --triad [-n PARAMS] [-t THREADS] [-r REPS]
 *
 * --triad: the host's memory bandwidth alone (the copies and triads below),
 * ending with the line "TRIAD nt <GB/s> plain <GB/s>", for a benchmark that
 * wants the ceiling of the moment beside its own figures
 * (tests/bench/train_gpt.py --host-triad).
 *
 * --resident: compute only, one thread: every Adam state precision (bf16
 * grad in, bf16 param out) on one N-element tensor (default 64 Ki: all of
 * its arrays stay in L2) updated over and over, timed in thread CPU time
 * (a shared machine's other processes do not count); per variant and
 * precision the best and the median of REPS runs of about 16 M elements
 * each, in G params/s per thread, ns and core cycles per element (the clock
 * estimated from a chain of dependent integer adds, one per cycle).  Lines
 *   RESIDENT <name> gparams_per_s=<best> ns_per_param=<best> cycles_per_param=<best> median_gparams_per_s=<m>
 *
 * Defaults: 256M parameters, one thread per CPU this process may use, 5 timed
 * repetitions (the median counts), chunks of 32768 elements.  Every runnable
 * variant (and its "-cached" twin, plain parameter stores) x state precision with bf16 grads in and
 * bf16 params out, plus fp32 grads/params for fp32 state; the host's bandwidth
 * in the same run with the same threads (STREAM-like copy and triad, plain
 * and non-temporal stores); and, for the headline job (fp32 state, bf16 in,
 * bf16 out), variants that drop a stage: memory traffic only, compute only
 * (cache-resident chunk), and the non-finite pre-scan.  SGD (momentum 0.9)
 * and Lion rows follow Adam's for every variant, fp32, bf16 and all-bf16
 * state, bf16 in and out; their names start with the variant, then "sgd_"
 * or "lion_".
 *
 * --shmem: every buffer in a memfd mapped MAP_SHARED (shmem pages, as
 * aoqd's state when it lives in a memfd for the fd store) instead of
 * private anonymous memory with transparent huge pages.
 *
 * GB/s counts the bytes the job must move (kernels/README.md: 28 B/param for fp32
 * state with bf16 grad and param), not what the hardware moved (e.g. the
 * read-for-ownership of plain stores).  The last lines are
 *   RESULT <name> gparams_per_s=<x> gbps=<y> ratio_to_triad=<z>
 * with the ratio to the non-temporal triad of the same run.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <getopt.h>
#include <immintrin.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "aoq-kernel.h"
#include "kernel-common.h"
#include "kernel-internal.h"

/* Stage-dropping builds of the avx512bf16 kernel (bench.sh builds them;
 * absent from the meson build): the q8 path without its code decode, its
 * hash, or its encode pass, or its sqrt (nodiv1) or sqrt and division
 * (nodiv2: the divider's share).  Results are wrong; only the time counts.
 * Last, q8_exact: the q8 update with IEEE's sqrt and division instead of
 * the library's approximations (right results, the A/B of that change). */
extern const struct aoqk_kernel aoqk_kernel_q8_nodecode __attribute__((weak));
extern const struct aoqk_kernel aoqk_kernel_q8_nohash __attribute__((weak));
extern const struct aoqk_kernel aoqk_kernel_q8_noencode __attribute__((weak));
extern const struct aoqk_kernel aoqk_kernel_q8_nodiv1 __attribute__((weak));
extern const struct aoqk_kernel aoqk_kernel_q8_nodiv2 __attribute__((weak));
extern const struct aoqk_kernel aoqk_kernel_q8_exact __attribute__((weak));
static const struct aoqk_kernel *const stage_drops[] = {
	&aoqk_kernel_q8_nodecode, &aoqk_kernel_q8_nohash, &aoqk_kernel_q8_noencode,
	&aoqk_kernel_q8_nodiv1,   &aoqk_kernel_q8_nodiv2,   &aoqk_kernel_q8_exact,
};
#define NDROPS (sizeof(stage_drops) / sizeof(stage_drops[0]))

static size_t N = (size_t)256 << 20;
static int T;
static int REPS = 5;
static size_t CHUNK = 32768;

/* ------------------------------------------------------------------ */
/* Thread pool: T pinned workers, a job runs on all of them at once. */

static pthread_barrier_t bar_start, bar_end;
static void (*job)(int tid);
static volatile int quit;
static int cpus[1024];

static void *worker(void *arg)
{
	int tid = (int)(intptr_t)arg;
	cpu_set_t set;
	CPU_ZERO(&set);
	CPU_SET(cpus[tid], &set);
	pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	for (;;) {
		pthread_barrier_wait(&bar_start);
		if (quit)
			break;
		job(tid);
		pthread_barrier_wait(&bar_end);
	}
	return NULL;
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double run_job(void (*fn)(int))
{
	job = fn;
	double t0 = now();
	pthread_barrier_wait(&bar_start);
	pthread_barrier_wait(&bar_end);
	return now() - t0;
}

static void slice(int tid, size_t *lo, size_t *hi)
{
	size_t blocks = (N + AOQK_Q8_BLOCK - 1) / AOQK_Q8_BLOCK;
	*lo = blocks * (size_t)tid / (size_t)T * AOQK_Q8_BLOCK;
	*hi = blocks * (size_t)(tid + 1) / (size_t)T * AOQK_Q8_BLOCK;
	if (*hi > N)
		*hi = N;
	if (*lo > N)
		*lo = N;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Median of REPS timed runs after one warm-up. */
static double timed(void (*fn)(int), void (*before)(void))
{
	double t[64];
	int reps = REPS < 64 ? REPS : 64;
	if (before)
		before();
	run_job(fn);
	for (int i = 0; i < reps; i++) {
		if (before)
			before();
		t[i] = run_job(fn);
	}
	qsort(t, (size_t)reps, sizeof(double), cmp_double);
	return t[reps / 2];
}

/* ------------------------------------------------------------------ */
/* Buffers, first touched by the thread that uses them. */

static float *master32, *m32, *v32, *ms, *vs;
static void *grad, *param;
static uint16_t *master16, *m16, *v16;
static int8_t *mq;
static uint8_t *vq;

static bool use_shmem; /* --shmem */

static void *big(size_t bytes)
{
	void *p;
	if (use_shmem) {
		int fd = memfd_create("bench-kernels", MFD_CLOEXEC);
		if (fd < 0 || ftruncate(fd, (off_t)bytes) < 0) {
			fprintf(stderr, "memfd %zu: %s\n", bytes, strerror(errno));
			exit(1);
		}
		p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		close(fd);
	} else {
		p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	}
	if (p == MAP_FAILED) {
		fprintf(stderr, "mmap %zu: %s\n", bytes, strerror(errno));
		exit(1);
	}
	madvise(p, bytes, MADV_HUGEPAGE);
	return p;
}

/* Gradients in the dtype of the job: normal numbers around 1e-2 (no
 * denormals or NaN from reading one dtype's bits as another's). */
static enum aoqk_dtype grad_dtype_now = (enum aoqk_dtype)-1, fill_dtype;

static void grad_job(int tid)
{
	size_t lo, hi;
	uint32_t x = 88172645u + (uint32_t)tid * 104729u;
	slice(tid, &lo, &hi);
	for (size_t i = lo; i < hi; i++) {
		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		float g = (float)(int32_t)x * 0x1p-31f * 1e-2f;
		if (fill_dtype == AOQK_FP32)
			((float *)grad)[i] = g;
		else if (fill_dtype == AOQK_BF16)
			((uint16_t *)grad)[i] = (uint16_t)(aoqk_f2u(g) >> 16);
		else
			((uint16_t *)grad)[i] = aoqk_f32_to_f16(g);
	}
}

static void set_grad_dtype(enum aoqk_dtype d)
{
	if (d == grad_dtype_now)
		return;
	fill_dtype = d;
	run_job(grad_job);
	grad_dtype_now = d;
}

static void init_job(int tid)
{
	size_t lo, hi;
	uint32_t x = 2463534242u + (uint32_t)tid * 7919u;
	slice(tid, &lo, &hi);
	for (size_t i = lo; i < hi; i++) {
		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		float r = (float)(int32_t)x * 0x1p-31f; /* [-1, 1) */
		master32[i] = r;
		m32[i] = r * 1e-3f;
		v32[i] = r * r * 1e-6f + 1e-12f;
		((float *)param)[i] = 0.0f;
		master16[i] = (uint16_t)(aoqk_f2u(r) >> 16);
		m16[i] = (uint16_t)(aoqk_f2u(r * 1e-3f) >> 16);
		v16[i] = (uint16_t)(aoqk_f2u(r * r * 1e-6f + 1e-12f) >> 16);
		mq[i] = (int8_t)(x >> 25);
		vq[i] = (uint8_t)(x >> 8);
	}
	/* the scales of q8's blocks and of q4's (half their size) */
	for (size_t b = lo / AOQK_Q4_BLOCK; b < (hi + AOQK_Q4_BLOCK - 1) / AOQK_Q4_BLOCK; b++) {
		ms[b] = 1e-3f;
		vs[b] = 1e-3f;
	}
}

/* ------------------------------------------------------------------ */
/* The kernel job. */

static const struct aoqk_kernel *cur_k;
static enum aoqk_precision cur_prec;
static enum aoqk_dtype cur_gd, cur_pd;
static int cur_skip;
static int cur_noparam; /* no parameter out: the bf16 master is the parameter (docs/decisions.md) */
static int cur_split;   /* q8's or q4's master split, m16 its low halves (kernels/README.md, "The split master");
                         * 2: the 24-bit master, m16's bytes its low bytes ("The 24-bit master") */
static struct aoqk_hparams cur_hp;
static size_t cur_chunk;
enum { OPT_ADAM, OPT_SGD, OPT_LION };
static int cur_opt;

static void *moment_ptr(enum aoqk_precision p, void *f32, void *q8, void *b16)
{
	if (aoqk_precision_blocked(p)) /* q4: the first half of q8's bytes */
		return q8;
	return aoqk_precision_bf16_moments(p) ? b16 : f32;
}

static void kernel_job(int tid)
{
	size_t lo, hi;
	struct aoqk_state st = {
		.precision = cur_prec,
		.n = N,
		.master = aoqk_precision_bf16_master(cur_prec) || cur_split ? (void *)master16 : (void *)master32,
		.m = moment_ptr(cur_prec, m32, mq, m16),
		.v = cur_opt != OPT_ADAM ? NULL : moment_ptr(cur_prec, v32, vq, v16),
		.m_scale = ms,
		.v_scale = vs,
		.master_lo = cur_split == 1 ? (void *)m16 : NULL,
		.master_lo8 = cur_split == 2 ? (void *)m16 : NULL,
	};
	int (*fn)(const struct aoqk_hparams *, const struct aoqk_state *, const struct aoqk_chunk *,
	          struct aoqk_report *) = cur_opt == OPT_SGD    ? cur_k->sgd
	                                  : cur_opt == OPT_LION ? cur_k->lion
	                                                        : cur_k->adam;
	size_t gs = aoqk_dtype_size(cur_gd), ps = aoqk_dtype_size(cur_pd);
	slice(tid, &lo, &hi);
	for (size_t b = lo; b < hi; b += cur_chunk) {
		size_t cnt = hi - b < cur_chunk ? hi - b : cur_chunk;
		struct aoqk_chunk c = {
			.begin = b,
			.count = cnt,
			.grad = (char *)grad + b * gs,
			.grad_dtype = cur_gd,
			.param = cur_noparam ? NULL : (char *)param + b * ps,
			.param_dtype = cur_pd,
			.seed = 12345,
			.skip_nonfinite = cur_skip,
		};
		struct aoqk_report rep;
		if (fn(&cur_hp, &st, &c, &rep) != 0) {
			fprintf(stderr, "kernel %s refused a chunk\n", cur_k->name);
			exit(1);
		}
	}
}

/* Compute only: the same number of elements, updating the thread's first
 * chunk over and over (it stays in L1/L2). */
static void kernel_hot_job(int tid)
{
	size_t lo, hi;
	struct aoqk_state st = {
		.precision = cur_prec,
		.n = N,
		.master = aoqk_precision_bf16_master(cur_prec) ? (void *)master16 : (void *)master32,
		.m = aoqk_precision_blocked(cur_prec) ? (void *)mq : (void *)m32,
		.v = aoqk_precision_blocked(cur_prec) ? (void *)vq : (void *)v32,
		.m_scale = ms,
		.v_scale = vs,
	};
	size_t gs = aoqk_dtype_size(cur_gd), ps = aoqk_dtype_size(cur_pd);
	size_t hot = 8192;
	slice(tid, &lo, &hi);
	for (size_t done = lo; done < hi; done += hot) {
		struct aoqk_chunk c = {
			.begin = lo, .count = hot, .grad = (char *)grad + lo * gs, .grad_dtype = cur_gd,
			.param = (char *)param + lo * ps, .param_dtype = cur_pd, .seed = 1,
		};
		struct aoqk_report rep;
		cur_k->adam(&cur_hp, &st, &c, &rep);
	}
}

static void next_step(void)
{
	cur_hp.step++;
}

/* --resident: passes over the whole (small) tensor in chunks, timed in
 * the worker's CPU time. */
static size_t res_passes;
static double res_seconds;

static double thread_cpu_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void resident_job(int tid)
{
	double t0 = thread_cpu_now();
	for (size_t p = 0; p < res_passes; p++) {
		kernel_job(tid);
		cur_hp.step++;
	}
	res_seconds = thread_cpu_now() - t0;
}

/* The core clock in GHz: 200 dependent register-register integer adds per
 * iteration run at one per cycle (the loop's own counter runs beside them;
 * adds of an immediate are not used: recent cores fold chains of them at
 * rename). */
static void clock_job(int tid)
{
	uint64_t x = (uint64_t)tid, one = 1;
	const size_t iters = 1000000;
	double t0 = thread_cpu_now();
	for (size_t i = 0; i < iters; i++)
		__asm__ volatile(".rept 200\n\taddq %1, %0\n\t.endr" : "+r"(x) : "r"(one));
	res_seconds = thread_cpu_now() - t0;
}

static double core_ghz(void)
{
	double best = 0;
	for (int i = 0; i < 5; i++) {
		run_job(clock_job);
		double g = 200e6 / res_seconds * 1e-9;
		if (g > best)
			best = g;
	}
	return best;
}

/* ------------------------------------------------------------------ */
/* STREAM-like copy and triad over fp32 arrays, and "memory only": the
 * headline job's loads and stores with the math dropped. */

static int have_avx512, have_avx2;

__attribute__((target("avx512f"))) static void copy512(float *a, const float *b, size_t lo, size_t hi, int nt)
{
	size_t i = lo;
	if (nt)
		for (; i + 16 <= hi; i += 16)
			_mm512_stream_ps(a + i, _mm512_load_ps(b + i));
	else
		for (; i + 16 <= hi; i += 16)
			_mm512_store_ps(a + i, _mm512_load_ps(b + i));
	for (; i < hi; i++)
		a[i] = b[i];
}

__attribute__((target("avx512f"))) static void triad512(float *a, const float *b, const float *c, size_t lo,
                                                        size_t hi, int nt)
{
	__m512 s = _mm512_set1_ps(3.0f);
	size_t i = lo;
	if (nt)
		for (; i + 16 <= hi; i += 16)
			_mm512_stream_ps(a + i, _mm512_add_ps(_mm512_load_ps(b + i), _mm512_mul_ps(s, _mm512_load_ps(c + i))));
	else
		for (; i + 16 <= hi; i += 16)
			_mm512_store_ps(a + i, _mm512_add_ps(_mm512_load_ps(b + i), _mm512_mul_ps(s, _mm512_load_ps(c + i))));
	for (; i < hi; i++)
		a[i] = b[i] + 3.0f * c[i];
}

__attribute__((target("avx512f,avx512bw"))) static void memonly512(size_t lo, size_t hi)
{
	const uint16_t *g = grad;
	uint16_t *p = param;
	for (size_t i = lo; i + 16 <= hi; i += 16) {
		__m512 gv = _mm512_castsi512_ps(_mm512_slli_epi32(
			_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(g + i))), 16));
		__m512 m = _mm512_add_ps(_mm512_loadu_ps(m32 + i), gv);
		__m512 v = _mm512_add_ps(_mm512_loadu_ps(v32 + i), gv);
		__m512 w = _mm512_sub_ps(_mm512_loadu_ps(master32 + i), m);
		_mm512_storeu_ps(m32 + i, m);
		_mm512_storeu_ps(v32 + i, v);
		_mm512_storeu_ps(master32 + i, w);
		_mm256_storeu_si256((__m256i *)(void *)(p + i),
		                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(w), 16)));
	}
}

/* The q8 precisions' loads and stores with no math (the ceiling of
 * their access pattern): per 256-element block both fp32 scales read and
 * written; per element the bf16 grad read, the master (bf16 or fp32) and
 * both codes read and written back with plain stores, the bf16 param
 * written with non-temporal stores, as the kernel does.  Each value
 * written depends on what was read (xor, byte add), so nothing is dropped.
 * Whole blocks only: with -n not a multiple of 256 the last thread skips
 * fewer than 256 elements that the rate still counts. */
__attribute__((target("avx512f,avx512bw"))) static void memonly_q8_512(size_t lo, size_t hi, int bfm)
{
	const uint16_t *g = grad;
	uint16_t *p = param;
	for (size_t b = lo; b + AOQK_Q8_BLOCK <= hi; b += AOQK_Q8_BLOCK) {
		size_t blk = b / AOQK_Q8_BLOCK;
		ms[blk] = ms[blk] * 0.5f + 1.0f;
		vs[blk] = vs[blk] * 0.5f + 1.0f;
		for (size_t i = b; i < b + AOQK_Q8_BLOCK; i += 64) {
			__m512i g0 = _mm512_loadu_si512((const void *)(g + i));
			__m512i g1 = _mm512_loadu_si512((const void *)(g + i + 32));
			__m512i w0, w1;
			if (bfm) {
				w0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(master16 + i)), g0);
				w1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(master16 + i + 32)), g1);
				_mm512_storeu_si512((void *)(master16 + i), w0);
				_mm512_storeu_si512((void *)(master16 + i + 32), w1);
			} else {
				__m512i f[4];
				for (int k = 0; k < 4; k++) {
					__m512i gk = _mm512_cvtepu16_epi32(
						_mm256_loadu_si256((const __m256i *)(const void *)(g + i + 16 * k)));
					f[k] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(master32 + i + 16 * k)),
					                        _mm512_slli_epi32(gk, 16));
					_mm512_storeu_si512((void *)(master32 + i + 16 * k), f[k]);
				}
				w0 = _mm512_packus_epi32(_mm512_srli_epi32(f[0], 16), _mm512_srli_epi32(f[1], 16));
				w1 = _mm512_packus_epi32(_mm512_srli_epi32(f[2], 16), _mm512_srli_epi32(f[3], 16));
			}
			__m512i c = _mm512_packs_epi16(w0, w1);
			_mm512_storeu_si512((void *)(mq + i),
			                    _mm512_add_epi8(_mm512_loadu_si512((const void *)(mq + i)), c));
			_mm512_storeu_si512((void *)(vq + i),
			                    _mm512_add_epi8(_mm512_loadu_si512((const void *)(vq + i)), c));
			_mm512_stream_si512((void *)(p + i), w0);
			_mm512_stream_si512((void *)(p + i + 32), w1);
		}
	}
}

__attribute__((target("sse2"))) static void copy_sse(float *a, const float *b, size_t lo, size_t hi, int nt)
{
	size_t i = lo;
	for (; i + 4 <= hi; i += 4) {
		if (nt)
			_mm_stream_ps(a + i, _mm_load_ps(b + i));
		else
			_mm_store_ps(a + i, _mm_load_ps(b + i));
	}
	for (; i < hi; i++)
		a[i] = b[i];
}

__attribute__((target("sse2"))) static void triad_sse(float *a, const float *b, const float *c, size_t lo,
                                                      size_t hi, int nt)
{
	__m128 s = _mm_set1_ps(3.0f);
	size_t i = lo;
	for (; i + 4 <= hi; i += 4) {
		__m128 x = _mm_add_ps(_mm_load_ps(b + i), _mm_mul_ps(s, _mm_load_ps(c + i)));
		if (nt)
			_mm_stream_ps(a + i, x);
		else
			_mm_store_ps(a + i, x);
	}
	for (; i < hi; i++)
		a[i] = b[i] + 3.0f * c[i];
}

static int stream_nt;

static void copy_job(int tid)
{
	size_t lo, hi;
	slice(tid, &lo, &hi);
	if (have_avx512)
		copy512(m32, master32, lo, hi, stream_nt);
	else
		copy_sse(m32, master32, lo, hi, stream_nt);
	_mm_sfence();
}

static void triad_job(int tid)
{
	size_t lo, hi;
	slice(tid, &lo, &hi);
	if (have_avx512)
		triad512(m32, master32, v32, lo, hi, stream_nt);
	else
		triad_sse(m32, master32, v32, lo, hi, stream_nt);
	_mm_sfence();
}

static void memonly_job(int tid)
{
	size_t lo, hi;
	slice(tid, &lo, &hi);
	for (size_t b = lo; b < hi; b += CHUNK)
		memonly512(b, hi - b < CHUNK ? hi : b + CHUNK);
}

static int memonly_bfm;

static void memonly_q8_job(int tid)
{
	size_t lo, hi;
	slice(tid, &lo, &hi);
	memonly_q8_512(lo, hi, memonly_bfm);
	_mm_sfence();
}

/* ------------------------------------------------------------------ */

struct result {
	char name[96];
	double gps, gbps;
};

static struct result results[256];
static int nresults;

static void record(const char *name, double seconds, double elems, double bytes_per_elem)
{
	struct result *r = &results[nresults++];
	snprintf(r->name, sizeof(r->name), "%s", name);
	r->gps = elems / seconds * 1e-9;
	r->gbps = elems * bytes_per_elem / seconds * 1e-9;
	printf("%-40s %9.2f ms %8.3f Gparam/s %8.1f GB/s\n", name, seconds * 1e3, r->gps, r->gbps);
	fflush(stdout);
}

static const char *prec_name(enum aoqk_precision p)
{
	static const char *n[] = { "fp32", "q8", "bf16", "bf16q8", "bf16all", "q4", "bf16q4" };
	return n[p];
}

static const char *dt_name(enum aoqk_dtype d)
{
	static const char *n[] = { "fp32", "bf16", "fp16" };
	return n[d];
}

/* Bytes the job must move per parameter: grad in, master and moments read
 * and written, param out (Adam: m and v; SGD with momentum and Lion: m),
 * q8, q4: each moment's fp32 block scale read and written; q4's codes are
 * half a byte (kernels/README.md,
 * "Bytes per parameter"). */
static double job_bytes_opt(enum aoqk_precision p, enum aoqk_dtype gd, enum aoqk_dtype pd, int opt)
{
	double master = (double)aoqk_master_size(p);
	double mom = aoqk_precision_q4(p) ? 0.5 : (double)aoqk_moment_size(p);
	double nmom = opt == OPT_ADAM ? 2 : 1;
	double scales = aoqk_precision_blocked(p) ? 2 * nmom * 4.0 / (double)aoqk_block(p) : 0; /* r + w */
	return (double)aoqk_dtype_size(gd) + 2 * master + 2 * nmom * mom + scales +
	       (double)aoqk_dtype_size(pd);
}

static double job_bytes(enum aoqk_precision p, enum aoqk_dtype gd, enum aoqk_dtype pd)
{
	return job_bytes_opt(p, gd, pd, OPT_ADAM);
}

static void bench_kernel(const struct aoqk_kernel *k, enum aoqk_precision p, enum aoqk_dtype gd,
                         enum aoqk_dtype pd, int skip, size_t chunk, const char *suffix)
{
	char name[96];
	set_grad_dtype(gd);
	cur_k = k;
	cur_prec = p;
	cur_gd = gd;
	cur_pd = pd;
	cur_skip = skip;
	cur_chunk = chunk;
	cur_hp = (struct aoqk_hparams){ .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
	                                .weight_decay = 0.01f, .decoupled = true, .step = 1,
	                                .grad_scale = 1.0f };
	if (cur_opt == OPT_SGD)
		cur_hp = (struct aoqk_hparams){ .lr = 1e-2, .momentum = 0.9, .weight_decay = 1e-4,
		                                .step = 1, .grad_scale = 1.0f };
	else if (cur_opt == OPT_LION)
		cur_hp = (struct aoqk_hparams){ .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.99,
		                                .weight_decay = 0.01, .step = 1, .grad_scale = 1.0f };
	double t = timed(kernel_job, next_step);
	snprintf(name, sizeof(name), "%s_%s%s_%s_%s%s", k->name,
	         cur_opt == OPT_SGD ? "sgd_" : cur_opt == OPT_LION ? "lion_" : "", prec_name(p),
	         dt_name(gd), dt_name(pd), suffix);
	for (char *c = name; *c; c++)
		if (*c == '-')
			*c = '_';
	record(name, t, (double)N,
	       job_bytes_opt(p, gd, pd, cur_opt) - (cur_noparam ? (double)aoqk_dtype_size(pd) : 0.0) -
	               (cur_split == 2 ? 2.0 : 0.0));
}

/* One variant x precision on the resident tensor: REPS timed runs of
 * about 16 M elements after a warm-up run; the best and the median. */
static void bench_resident(const struct aoqk_kernel *k, enum aoqk_precision p, double ghz)
{
	char name[96];
	double t[64];
	int reps = REPS < 64 ? REPS : 64;

	cur_k = k;
	cur_prec = p;
	cur_gd = AOQK_BF16;
	cur_pd = AOQK_BF16;
	cur_skip = 0;
	cur_chunk = CHUNK;
	cur_opt = OPT_ADAM;
	cur_hp = (struct aoqk_hparams){ .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
	                                .weight_decay = 0.01f, .decoupled = true, .step = 1,
	                                .grad_scale = 1.0f };
	res_passes = ((size_t)16 << 20) / N + 1;
	run_job(resident_job);
	for (int i = 0; i < reps; i++) {
		run_job(resident_job);
		t[i] = res_seconds / ((double)res_passes * (double)N);
	}
	qsort(t, (size_t)reps, sizeof(double), cmp_double);
	snprintf(name, sizeof(name), "%s_%s_bf16_bf16%s", k->name, prec_name(p),
	         cur_split == 2 ? "_split8" : cur_split ? "_split" : "");
	for (char *c = name; *c; c++)
		if (*c == '-')
			*c = '_';
	printf("RESIDENT %-32s gparams_per_s=%.3f ns_per_param=%.3f cycles_per_param=%.2f "
	       "median_gparams_per_s=%.3f\n",
	       name, 1e-9 / t[0], t[0] * 1e9, t[0] * 1e9 * ghz, 1e-9 / t[reps / 2]);
	fflush(stdout);
}

static int wanted(const char *list, const char *name)
{
	if (!list)
		return 1;
	size_t l = strlen(name);
	for (const char *s = list; *s;) {
		const char *e = strchr(s, ',');
		size_t n = e ? (size_t)(e - s) : strlen(s);
		if (n == l && !strncmp(s, name, n))
			return 1;
		s += n + (e ? 1 : 0);
	}
	return 0;
}

static void stream_all(const char *tag)
{
	char name[64];
	for (stream_nt = 0; stream_nt < 2; stream_nt++) {
		snprintf(name, sizeof(name), "stream_copy%s%s", stream_nt ? "_nt" : "", tag);
		record(name, timed(copy_job, NULL), (double)N, 8);
		snprintf(name, sizeof(name), "stream_triad%s%s", stream_nt ? "_nt" : "", tag);
		record(name, timed(triad_job, NULL), (double)N, 12);
	}
}

static const char bench_usage[] =
	"usage: bench-kernels [-n params] [-t threads] [-r reps] [-c chunk] [-k variant,...]\n"
	"  -n N       parameters per tensor (default 256Mi)\n"
	"  -t N       threads, 1..1024 (default: every allowed core)\n"
	"  -r N       repetitions; the median is reported (default 5)\n"
	"  -c N       chunk elements (default 32768)\n"
	"  -k LIST    kernel variants to run, comma separated\n"
	"  --modes    only the triads and the Adam state precisions of the variants\n"
	"             (-k, default: the best) and the MODE lines\n"
	"  --resident[=N]  compute only: one thread, one N-element tensor (default 65536)\n"
	"             updated over and over in cache; per precision G params/s, ns and cycles\n"
	"  --triad    only the copies and triads, then one line: TRIAD nt <GB/s> plain <GB/s>\n"
	"             (the host's memory bandwidth beside another benchmark)\n"
	"  --shmem    buffers in a memfd (shmem pages, MAP_SHARED), not anonymous memory\n"
	"  -h, --help this text\n";

/* A decimal or 0x number in [lo, hi]; otherwise names the option and fails. */
static bool bench_arg(const char *s, const char *opt, unsigned long long lo, unsigned long long hi,
                      unsigned long long *out)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 0);
	if (errno || end == s || *end || *s == '-' || v < lo || v > hi) {
		fprintf(stderr, "bench-kernels: %s: '%s' is not a number in %llu..%llu\n", opt, s, lo, hi);
		return false;
	}
	*out = v;
	return true;
}

static const struct result *find_result(const char *name)
{
	for (int i = 0; i < nresults; i++)
		if (!strcmp(results[i].name, name))
			return &results[i];
	return NULL;
}

/* The row name of variant k's Adam job at precision p, bf16 grad in and
 * bf16 param out, as bench_kernel records it. */
static void bf16_row_name(char *buf, size_t len, const char *k, enum aoqk_precision p, const char *suffix)
{
	snprintf(buf, len, "%s_%s_bf16_bf16%s", k, prec_name(p), suffix);
	for (char *c = buf; *c; c++)
		if (*c == '-')
			*c = '_';
}

/* A MODE line: precision p's row (name suffix; its bytes per parameter
 * as bench_kernel recorded them) against the triads at the start, the end
 * and the better of the two. */
static void mode_line(const struct aoqk_kernel *k, enum aoqk_precision p, const char *suffix, const char *note,
                      double triad, double triad_end)
{
	char name[96];
	double best = triad > triad_end ? triad : triad_end;
	bf16_row_name(name, sizeof(name), k->name, p, suffix);
	const struct result *r = find_result(name);
	if (r)
		printf("MODE %-10s %14.4f %10.3f %8.1f %8.3f %8.3f %8.3f%s\n", prec_name(p),
		       r->gbps / r->gps, r->gps, r->gbps,
		       triad > 0 ? r->gbps / triad : 0.0, triad_end > 0 ? r->gbps / triad_end : 0.0,
		       best > 0 ? r->gbps / best : 0.0, note);
}

int main(int argc, char **argv)
{
	const char *klist = NULL;
	int opt;
	bool resident = false, modes_only = false, triad_only = false;
	size_t res_n = 0;
	cpu_set_t set;

	sched_getaffinity(0, sizeof(set), &set);
	for (int c = 0; c < CPU_SETSIZE && T < 1024; c++)
		if (CPU_ISSET(c, &set))
			cpus[T++] = c;
	int ncpu = T;
	static const struct option longopts[] = {
		{ "help", no_argument, NULL, 'h' },
		{ "resident", optional_argument, NULL, 'R' },
		{ "modes", no_argument, NULL, 'M' },
		{ "triad", no_argument, NULL, 'T' },
		{ "shmem", no_argument, NULL, 'S' },
		{ NULL, 0, NULL, 0 },
	};
	unsigned long long v;
	while ((opt = getopt_long(argc, argv, "n:t:r:c:k:h", longopts, NULL)) != -1) {
		switch (opt) {
		case 'n':
			if (!bench_arg(optarg, "-n", AOQK_Q8_BLOCK, SIZE_MAX / 16, &v))
				return 2;
			N = (size_t)v;
			break;
		case 't':
			if (!bench_arg(optarg, "-t", 1, 1024, &v))
				return 2;
			T = (int)v;
			break;
		case 'r':
			if (!bench_arg(optarg, "-r", 1, 1000000, &v))
				return 2;
			REPS = (int)v;
			break;
		case 'c':
			if (!bench_arg(optarg, "-c", AOQK_Q8_BLOCK, SIZE_MAX / 16, &v))
				return 2;
			CHUNK = (size_t)v / AOQK_Q8_BLOCK * AOQK_Q8_BLOCK;
			break;
		case 'k':
			klist = optarg;
			break;
		case 'M':
			modes_only = true;
			break;
		case 'T':
			triad_only = true;
			break;
		case 'S':
			use_shmem = true;
			break;
		case 'R':
			resident = true;
			if (optarg && !bench_arg(optarg, "--resident", AOQK_Q8_BLOCK, (size_t)1 << 30, &v))
				return 2;
			res_n = optarg ? (size_t)v : 65536;
			break;
		case 'h':
			fputs(bench_usage, stdout);
			return 0;
		default:
			fputs(bench_usage, stderr);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "bench-kernels: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	if (resident && triad_only) {
		fputs("bench-kernels: --resident and --triad do not go together\n", stderr);
		return 2;
	}
	if (resident) {
		N = res_n;
		T = 1;
		cpus[0] = sched_getcpu() >= 0 ? sched_getcpu() : cpus[0];
	}
	for (int i = ncpu; i < T; i++)
		cpus[i] = cpus[i % ncpu];
	have_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
	have_avx2 = __builtin_cpu_supports("avx2");

	printf("bench-kernels: %zu params, %d threads, %d reps (median), chunk %zu, default kernel %s\n", N, T,
	       REPS, CHUNK, aoqk_select(NULL)->name);

	size_t nb = (N + AOQK_Q4_BLOCK - 1) / AOQK_Q4_BLOCK; /* q4's blocks, the smaller */
	master32 = big(N * 4);
	m32 = big(N * 4);
	v32 = big(N * 4);
	grad = big(N * 4);
	param = big(N * 4);
	master16 = big(N * 2);
	m16 = big(N * 2);
	v16 = big(N * 2);
	mq = big(N);
	vq = big(N);
	ms = big(nb * 4);
	vs = big(nb * 4);

	pthread_barrier_init(&bar_start, NULL, (unsigned)T + 1);
	pthread_barrier_init(&bar_end, NULL, (unsigned)T + 1);
	pthread_t th[1024];
	for (int i = 0; i < T; i++)
		pthread_create(&th[i], NULL, worker, (void *)(intptr_t)i);
	double t0 = now();
	run_job(init_job);
	printf("init %.2f s\n", now() - t0);

	if (resident) {
		/* normal gradients: with zeros the moments decay into denormals */
		set_grad_dtype(AOQK_BF16);
		double ghz = core_ghz();
		printf("resident: %zu elements, chunks of %zu, one thread, core clock %.2f GHz "
		       "(dependent adds)\n", N, CHUNK, ghz);
		size_t nv;
		const struct aoqk_variant *vars = aoqk_variants(&nv);
		for (size_t i = 0; i < nv; i++) {
			const struct aoqk_kernel *k = vars[i].kernel;
			/* default: the best variant only */
			if (!vars[i].runnable || (klist ? !wanted(klist, k->name) : k != aoqk_select(NULL)))
				continue;
			for (int p = 0; p <= AOQK_STATE_BF16_Q4; p++)
				bench_resident(k, (enum aoqk_precision)p, ghz);
			cur_split = cur_noparam = 1;
			bench_resident(k, AOQK_STATE_Q8, ghz);
			bench_resident(k, AOQK_STATE_Q4, ghz);
			cur_split = 2;
			bench_resident(k, AOQK_STATE_Q8, ghz);
			bench_resident(k, AOQK_STATE_Q4, ghz);
			cur_split = cur_noparam = 0;
		}
		for (size_t i = 0; i < NDROPS; i++) {
			const struct aoqk_kernel *x = stage_drops[i];
			if (!x || !__builtin_cpu_supports("avx512bf16") || (klist && !wanted(klist, x->name)))
				continue;
			bench_resident(x, AOQK_STATE_Q8, ghz);
			bench_resident(x, AOQK_STATE_BF16_Q8, ghz);
			bench_resident(x, AOQK_STATE_Q4, ghz);
			bench_resident(x, AOQK_STATE_BF16_Q4, ghz);
			cur_split = cur_noparam = 1;
			bench_resident(x, AOQK_STATE_Q8, ghz);
			cur_split = cur_noparam = 0;
		}
		printf("resident: core clock %.2f GHz after the runs\n", core_ghz());
		quit = 1;
		pthread_barrier_wait(&bar_start);
		pthread_join(th[0], NULL);
		return 0;
	}

	const struct aoqk_kernel *best = aoqk_select(NULL);
	stream_all("");
	if (triad_only)
		goto done;

	size_t nv;
	const struct aoqk_variant *vars = aoqk_variants(&nv);
	for (size_t i = 0; i < nv; i++) {
		const struct aoqk_kernel *k = vars[i].kernel;
		if (!vars[i].runnable || (modes_only && !klist ? k != aoqk_select(NULL) : !wanted(klist, k->name))) {
			printf("%s: skipped\n", k->name);
			continue;
		}
		for (int p = 0; p <= AOQK_STATE_BF16_Q4; p++)
			bench_kernel(k, (enum aoqk_precision)p, AOQK_BF16, AOQK_BF16, 0, CHUNK, "");
		/* a bf16 master with bf16 parameters is the parameter's bits:
		 * the same jobs without the parameter copy, 2 B/param less
		 * (aoqd's master_param; docs/decisions.md, "The master is the
		 * parameter") */
		cur_noparam = 1;
		for (int p = AOQK_STATE_BF16; p <= AOQK_STATE_BF16_Q4; p++)
			if (aoqk_precision_bf16_master((enum aoqk_precision)p))
				bench_kernel(k, (enum aoqk_precision)p, AOQK_BF16, AOQK_BF16, 0, CHUNK, "_noparam");
		/* q8 and q4 with the master split, its high half the
		 * parameter: 2 B less than q8, q4 (the parameter is not
		 * written apart) */
		cur_split = 1;
		bench_kernel(k, AOQK_STATE_Q8, AOQK_BF16, AOQK_BF16, 0, CHUNK, "_split");
		bench_kernel(k, AOQK_STATE_Q4, AOQK_BF16, AOQK_BF16, 0, CHUNK, "_split");
		/* the 24-bit master: 2 B less again (one byte beside the
		 * parameter, read and written) */
		cur_split = 2;
		bench_kernel(k, AOQK_STATE_Q8, AOQK_BF16, AOQK_BF16, 0, CHUNK, "_split8");
		bench_kernel(k, AOQK_STATE_Q4, AOQK_BF16, AOQK_BF16, 0, CHUNK, "_split8");
		cur_split = 0;
		cur_noparam = 0;
		if (modes_only)
			continue;
		bench_kernel(k, AOQK_STATE_FP32, AOQK_FP32, AOQK_FP32, 0, CHUNK, "");
		static const enum aoqk_precision slp[] = { AOQK_STATE_FP32, AOQK_STATE_BF16,
		                                           AOQK_STATE_BF16_ALL };
		for (cur_opt = OPT_SGD; cur_opt <= OPT_LION; cur_opt++)
			for (int p = 0; p < 3; p++)
				bench_kernel(k, slp[p], AOQK_BF16, AOQK_BF16, 0, CHUNK, "");
		cur_opt = OPT_ADAM;
	}

	/* the q8 precisions' access patterns without their math: the
	 * ceiling of their loads and stores (MODE lines below) */
	if (have_avx512) {
		set_grad_dtype(AOQK_BF16);
		for (memonly_bfm = 0; memonly_bfm < 2; memonly_bfm++) {
			enum aoqk_precision p = memonly_bfm ? AOQK_STATE_BF16_Q8 : AOQK_STATE_Q8;
			char name[64];
			snprintf(name, sizeof(name), "memonly_%s_bf16_bf16", prec_name(p));
			record(name, timed(memonly_q8_job, NULL), (double)N, job_bytes(p, AOQK_BF16, AOQK_BF16));
		}
	}

	/* where the headline job's time goes, with the default kernel */
	if (modes_only)
		goto again;
	bench_kernel(best, AOQK_STATE_FP32, AOQK_BF16, AOQK_BF16, 1, CHUNK, "_prescan");
	bench_kernel(best, AOQK_STATE_FP32, AOQK_FP16, AOQK_FP16, 0, CHUNK, "");
	bench_kernel(best, AOQK_STATE_FP32, AOQK_BF16, AOQK_BF16, 0, 4096, "_chunk4k");
	bench_kernel(best, AOQK_STATE_FP32, AOQK_BF16, AOQK_BF16, 0, 262144, "_chunk256k");
	if (have_avx512) {
		set_grad_dtype(AOQK_BF16);
		record("memonly_fp32_bf16_bf16", timed(memonly_job, NULL), (double)N, 28);
	}
	set_grad_dtype(AOQK_BF16);
	for (int p = 0; p < 4; p++) {
		char name[96];
		cur_k = best;
		cur_prec = (enum aoqk_precision)p;
		cur_gd = AOQK_BF16;
		cur_pd = AOQK_BF16;
		snprintf(name, sizeof(name), "computeonly_%s_bf16_bf16", prec_name(cur_prec));
		record(name, timed(kernel_hot_job, next_step), (double)N,
		       job_bytes(cur_prec, AOQK_BF16, AOQK_BF16));
	}

	for (size_t i = 0; i < NDROPS; i++) {
		const struct aoqk_kernel *x = stage_drops[i];
		if (!x || !have_avx512 || !__builtin_cpu_supports("avx512bf16") || (klist && !wanted(klist, x->name)))
			continue;
		for (int p = 1; p < 4; p += 2) {
			char name[96];
			bench_kernel(x, (enum aoqk_precision)p, AOQK_BF16, AOQK_BF16, 0, CHUNK, "");
			cur_k = x;
			cur_prec = (enum aoqk_precision)p;
			snprintf(name, sizeof(name), "computeonly_%s_%s", x->name, prec_name(cur_prec));
			record(name, timed(kernel_hot_job, next_step), (double)N,
			       job_bytes(cur_prec, AOQK_BF16, AOQK_BF16));
		}
	}

again:
	stream_all("_again");

done:
	quit = 1;
	pthread_barrier_wait(&bar_start);
	for (int i = 0; i < T; i++)
		pthread_join(th[i], NULL);

	double triad = 0, triad_end = 0;
	for (int i = 0; i < nresults; i++) {
		if (!strcmp(results[i].name, "stream_triad_nt"))
			triad = results[i].gbps;
		if (!strcmp(results[i].name, "stream_triad_nt_again"))
			triad_end = results[i].gbps;
	}
	/* every Adam state precision of the default kernel, bf16 grad in and
	 * bf16 param out: bytes per parameter per step and the ratio to the
	 * triad (the delayed update moves the same bytes as its precision: the
	 * param goes to the other of two buffers) */
	/* the triad moves within one run (on the H200 host 159.5 -> 114.5
	 * GB/s): the ratio to the triad at the start, at the end, and to the
	 * better of the two */
	if (triad_only)
		goto results;
	double triad_best = triad > triad_end ? triad : triad_end;
	printf("MODE triad_nt start %.1f GB/s, end %.1f GB/s\n", triad, triad_end);
	printf("MODE %-10s %14s %10s %8s %8s %8s %8s\n", "precision", "bytes/param", "Gparam/s", "GB/s",
	       "/start", "/end", "/best");
	for (int p = 0; p <= AOQK_STATE_BF16_Q4; p++)
		mode_line(best, (enum aoqk_precision)p, "", "", triad, triad_end);
	for (int p = AOQK_STATE_BF16; p <= AOQK_STATE_BF16_Q4; p++)
		if (aoqk_precision_bf16_master((enum aoqk_precision)p))
			mode_line(best, (enum aoqk_precision)p, "_noparam", "  (no param out)", triad, triad_end);
	mode_line(best, AOQK_STATE_Q8, "_split", "  (split master)", triad, triad_end);
	mode_line(best, AOQK_STATE_Q4, "_split", "  (split master)", triad, triad_end);
	mode_line(best, AOQK_STATE_Q8, "_split8", "  (24-bit master)", triad, triad_end);
	mode_line(best, AOQK_STATE_Q4, "_split8", "  (24-bit master)", triad, triad_end);
	/* the q8 kernels against their own loads and stores without math */
	for (int p = AOQK_STATE_Q8; p <= AOQK_STATE_BF16_Q8; p += 2) {
		char kname[96], mname[64];
		bf16_row_name(kname, sizeof(kname), best->name, (enum aoqk_precision)p, "");
		snprintf(mname, sizeof(mname), "memonly_%s_bf16_bf16", prec_name((enum aoqk_precision)p));
		const struct result *kr = find_result(kname), *mr = find_result(mname);
		if (kr && mr)
			printf("MODE %-10s memory only %.3f Gparam/s %.1f GB/s (%.3f of the best triad); "
			       "kernel / memory only %.3f\n",
			       prec_name((enum aoqk_precision)p), mr->gps, mr->gbps,
			       triad_best > 0 ? mr->gbps / triad_best : 0.0, kr->gps / mr->gps);
	}
results:
	for (int i = 0; i < nresults; i++)
		printf("RESULT %s gparams_per_s=%.4f gbps=%.2f ratio_to_triad=%.3f\n", results[i].name,
		       results[i].gps, results[i].gbps, triad > 0 ? results[i].gbps / triad : 0.0);
	if (triad_only) {
		const struct result *pl = find_result("stream_triad");
		printf("TRIAD nt %.1f plain %.1f\n", triad, pl ? pl->gbps : 0.0);
	}
	return 0;
}
