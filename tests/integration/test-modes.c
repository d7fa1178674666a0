/* SPDX-License-Identifier: MIT */
/*
 * Session modes against the double reference:
 * - clip: max_grad_norm clips the global norm of every step (the factor in
 *   StepEnded, the scaled first moment read back from the daemon);
 * - skip: skip_nonfinite skips a step with a nan gradient whole: no
 *   parameter or step counter moves, and the next step matches a reference
 *   that never took it;
 * - delayed: after step N the device holds update N-1; aoq_flush() brings
 *   update N;
 * - window: a session staging through a 2-slot window agrees bit for bit
 *   with one holding a slot per tensor, accumulation included;
 * - tensors: two tensors of one session with the same values and gradients
 *   round with their own random bits (stochastic rounding of a bf16 master,
 *   q8 and q4 codes), not with the same bits at the same index.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define NT 4
static const uint64_t sizes[NT] = { 1, 3, 4097, (1u << 20) + 13 };

static const struct aoq_group hp = { .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 2e-3, .beta1 = 0.9, .beta2 = 0.999,
                                     .eps = 1e-8, .weight_decay = 0.01 };

struct run {
	struct aoq_client *c;
	float *param[NT], *grad[NT];
	struct aoqt_ref ref[NT];
};

static void open_run(struct run *r, const char *sock, const char *job, struct aoq_options o, uint64_t seed)
{
	o.socket = sock;
	o.job = job;
	o.device = "cpu";
	CHECK_OK(aoq_connect(&r->c, &o));
	CHECK_OK(aoq_add_group(r->c, &hp));
	for (int t = 0; t < NT; t++) {
		r->param[t] = aoqt_xmalloc(sizes[t] * 4);
		r->grad[t] = aoqt_xmalloc(sizes[t] * 4);
		struct aoqt_rng g = aoqt_rng_for(seed, t, 0);
		aoqt_ref_init(&r->ref[t], sizes[t]);
		for (size_t i = 0; i < sizes[t]; i++) {
			r->param[t][i] = (float)aoqt_uniform(&g);
			r->ref[t].p[i] = r->param[t][i];
		}
		char name[16];
		snprintf(name, sizeof(name), "t%d", t);
		struct aoq_tensor d = { .size = sizeof(struct aoq_tensor), .name = name, .numel = sizes[t], .param_dtype = AOQ_FP32,
		                        .grad_dtype = AOQ_FP32, .param = r->param[t], .grad = r->grad[t] };
		CHECK(aoq_add_tensor(r->c, &d) == t, "tensor index");
	}
	CHECK_OK(aoq_register(r->c));
}

static void close_run(struct run *r)
{
	aoq_close(r->c);
	for (int t = 0; t < NT; t++) {
		free(r->param[t]);
		free(r->grad[t]);
		aoqt_ref_free(&r->ref[t]);
	}
}

static void fill_grads(struct run *r, uint64_t seed, uint64_t step, double mag)
{
	for (int t = 0; t < NT; t++) {
		struct aoqt_rng g = aoqt_rng_for(seed, t, step);
		for (size_t i = 0; i < sizes[t]; i++)
			r->grad[t][i] = (float)(mag * aoqt_uniform(&g));
	}
}

static void push_all(struct run *r, unsigned flags)
{
	for (int t = NT - 1; t >= 0; t--)
		CHECK_OK(aoq_push_grad(r->c, (uint32_t)t, flags, NULL));
}

static void check_all(const char *what, struct run *r)
{
	for (int t = 0; t < NT; t++)
		CHECK(aoqt_check_param(what, &r->ref[t], r->param[t], AOQ_FP32) == 0, "%s: tensor %d", what, t);
}

static void test_clip(const char *sock)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	struct run r;
	uint64_t seed = 11;
	/* the norm of 2^20 uniform values of magnitude 0.1 is about 34 */
	o.max_grad_norm = 5.0;
	open_run(&r, sock, "clip", o, seed);
	float *gs = aoqt_xmalloc(sizes[NT - 1] * 4), *m = aoqt_xmalloc(sizes[NT - 1] * 4);
	double *prev = aoqt_xmalloc(sizes[NT - 1] * sizeof(double));
	for (uint64_t step = 1; step <= 4; step++) {
		double mag = step == 3 ? 1e-4 : 0.1; /* step 3 stays under the limit */
		fill_grads(&r, seed, step, mag);
		double sum = 0;
		for (int t = 0; t < NT; t++)
			sum += aoqt_sumsq(r.grad[t], sizes[t]);
		double norm = sqrt(sum), scale = o.max_grad_norm / (norm + 1e-6);
		if (scale > 1)
			scale = 1;
		push_all(&r, 0);
		CHECK_OK(aoq_step_end(r.c));
		struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_sync(r.c, &res));
		CHECK(fabs(res.clip_scale - scale) <= 1e-5 * scale, "step %lu: clip %g, expected %g",
		      (unsigned long)step, res.clip_scale, scale);
		CHECK(fabs(res.grad_sumsq - sum) <= 1e-4 * sum, "step %lu: sumsq %g, expected %g",
		      (unsigned long)step, res.grad_sumsq, sum);
		for (int t = 0; t < NT; t++) {
			for (size_t i = 0; i < sizes[t]; i++)
				gs[i] = (float)((double)r.grad[t][i] * (float)scale);
			for (size_t i = 0; i < sizes[t]; i++)
				prev[i] = r.ref[t].m[i];
			aoqt_ref_step(&r.ref[t], &hp, gs);
			CHECK_OK(aoq_read_state(r.c, (uint32_t)t, 1, AOQ_FP32, 0, sizes[t], m));
			/* m cancels between steps: bound the error by the tensor's scale
			 * and by the element's own terms (the daemon's clip scale is
			 * summed in another order, so the scaled gradient may be an ulp
			 * off; cancellation magnifies that relative to m) */
			double big = 0;
			for (size_t i = 0; i < sizes[t]; i++)
				big = fmax(big, fabs(r.ref[t].m[i]));
			for (size_t i = 0; i < sizes[t]; i++)
				CHECK(fabs(m[i] - r.ref[t].m[i]) <= 1e-5 * fabs(r.ref[t].m[i]) + 1e-6 * big +
				      1e-6 * (hp.beta1 * fabs(prev[i]) + (1 - hp.beta1) * fabs(gs[i])),
				      "clip step %lu tensor %d exp_avg[%zu] = %g, expected %g", (unsigned long)step, t, i,
				      m[i], r.ref[t].m[i]);
		}
		check_all("clip", &r);
	}
	free(gs);
	free(m);
	free(prev);
	close_run(&r);
	printf("clip: ok\n");
}

static void test_skip(const char *sock)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	struct run r;
	uint64_t seed = 12;
	o.skip_nonfinite = true;
	open_run(&r, sock, "skip", o, seed);
	float *before = aoqt_xmalloc(sizes[NT - 1] * 4);
	for (uint64_t step = 1; step <= 5; step++) {
		fill_grads(&r, seed, step, 0.1);
		bool bad = step == 3;
		if (bad)
			r.grad[2][100] = NAN;
		memcpy(before, r.param[NT - 1], sizes[NT - 1] * 4);
		push_all(&r, 0);
		CHECK_OK(aoq_step_end(r.c));
		struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_sync(r.c, &res));
		CHECK(res.skipped == bad && res.nonfinite == bad, "step %lu: skipped %d nonfinite %d",
		      (unsigned long)step, res.skipped, res.nonfinite);
		if (bad) {
			CHECK(memcmp(before, r.param[NT - 1], sizes[NT - 1] * 4) == 0, "a skipped step changed parameters");
			uint64_t steps[NT];
			CHECK_OK(aoq_get_tensor_steps(r.c, 0, NT, steps));
			for (int t = 0; t < NT; t++)
				CHECK(steps[t] == 2, "tensor %d took %lu steps, expected 2", t, (unsigned long)steps[t]);
			continue;
		}
		for (int t = 0; t < NT; t++)
			aoqt_ref_step(&r.ref[t], &hp, r.grad[t]);
		check_all("skip", &r);
	}
	free(before);
	close_run(&r);
	printf("skip: ok\n");
}

static void test_delayed(const char *sock)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	struct run r;
	uint64_t seed = 13;
	o.delayed_update = true;
	open_run(&r, sock, "delayed", o, seed);
	/* lag: the reference of what the device holds (one update behind) */
	struct aoqt_ref lag[NT];
	float *prev[NT];
	for (int t = 0; t < NT; t++) {
		aoqt_ref_init(&lag[t], sizes[t]);
		memcpy(lag[t].p, r.ref[t].p, sizes[t] * sizeof(double));
		prev[t] = aoqt_xmalloc(sizes[t] * 4);
	}
	for (uint64_t step = 1; step <= 5; step++) {
		fill_grads(&r, seed, step, 0.1);
		push_all(&r, 0);
		CHECK_OK(aoq_step_end(r.c));
		CHECK_OK(aoq_sync(r.c, NULL));
		for (int t = 0; t < NT; t++) {
			aoqt_ref_step(&r.ref[t], &hp, r.grad[t]);
			if (step > 1)
				aoqt_ref_step(&lag[t], &hp, prev[t]);
			memcpy(prev[t], r.grad[t], sizes[t] * 4);
			CHECK(aoqt_check_param("delayed", &lag[t], r.param[t], AOQ_FP32) == 0,
			      "step %lu tensor %d: not the previous update", (unsigned long)step, t);
		}
	}
	CHECK_OK(aoq_flush(r.c));
	check_all("delayed after flush", &r);
	for (int t = 0; t < NT; t++) {
		aoqt_ref_free(&lag[t]);
		free(prev[t]);
	}
	close_run(&r);
	printf("delayed: ok\n");
}

static void test_window(const char *sock)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	struct run a, b;
	uint64_t seed = 14;
	open_run(&a, sock, "slots", o, seed);
	o.window = 16u << 20; /* two slots of 1 Mi elements */
	open_run(&b, sock, "window", o, seed);
	for (uint64_t step = 1; step <= 4; step++) {
		for (int mb = 0; mb < 2; mb++) {
			unsigned flags = step % 2 == 0 && mb == 0 ? AOQ_PUSH_ACCUMULATE : 0;
			if (step % 2 == 1 && mb == 1)
				break;
			fill_grads(&a, seed, step * 10 + (uint64_t)mb, 0.1);
			fill_grads(&b, seed, step * 10 + (uint64_t)mb, 0.1);
			push_all(&a, flags);
			push_all(&b, flags);
		}
		CHECK_OK(aoq_step_end(a.c));
		CHECK_OK(aoq_step_end(b.c));
		CHECK_OK(aoq_sync(a.c, NULL));
		CHECK_OK(aoq_sync(b.c, NULL));
		for (int t = 0; t < NT; t++)
			CHECK(memcmp(a.param[t], b.param[t], sizes[t] * 4) == 0, "step %lu tensor %d: window differs",
			      (unsigned long)step, t);
	}
	close_run(&a);
	close_run(&b);
	printf("window: ok\n");
}

/*
 * Checkpoint: read master, moments and step counters from session A, load
 * them into a fresh session B with the same seed, train both on: fp32,
 * bf16-master and all-bf16 states continue bit for bit; q8 moments come back within
 * their code spacing and the parameters stay close.
 */
static void test_restore(const char *sock, enum aoq_precision prec)
{
	static const char *const names[] = { "fp32", "q8", "bf16", "bf16+q8", "bf16-all", "q4", "bf16+q4" };
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.precision = prec;
	o.seed = 0x1234567;
	uint64_t seed = 15;
	struct run a, b;
	open_run(&a, sock, "ckpt-a", o, seed);
	for (uint64_t step = 1; step <= 3; step++) {
		fill_grads(&a, seed, step, 0.1);
		push_all(&a, 0);
		CHECK_OK(aoq_step_end(a.c));
		CHECK_OK(aoq_sync(a.c, NULL));
	}
	CHECK(aoq_session_seed(a.c) == o.seed, "seed not kept");
	open_run(&b, sock, "ckpt-b", o, seed + 1); /* other initial values: the load must replace them */
	uint64_t steps[NT];
	CHECK_OK(aoq_get_tensor_steps(a.c, 0, NT, steps));
	CHECK_OK(aoq_set_tensor_steps(b.c, 0, NT, steps));
	size_t nmax = sizes[NT - 1];
	float *x = aoqt_xmalloc(nmax * 4), *y = aoqt_xmalloc(nmax * 4);
	for (int t = 0; t < NT; t++) {
		for (int what = 0; what < 3; what++) {
			CHECK_OK(aoq_read_state(a.c, (uint32_t)t, what, AOQ_FP32, 0, sizes[t], x));
			CHECK_OK(aoq_load_state(b.c, (uint32_t)t, what, AOQ_FP32, 0, sizes[t], x));
			CHECK_OK(aoq_read_state(b.c, (uint32_t)t, what, AOQ_FP32, 0, sizes[t], y));
			bool q4 = what > 0 && (prec == AOQ_STATE_Q4 || prec == AOQ_STATE_BF16_Q4);
			bool q8 = q4 || (what > 0 && (prec == AOQ_STATE_Q8 || prec == AOQ_STATE_BF16_Q8));
			size_t blk = q4 ? 128 : 256;
			double big = 0;
			for (size_t i = 0; i < sizes[t]; i++) {
				/* q8, q4: within one code of the largest value of its
				 * block (q4: the top codes are 20% (m) and 15% (sqrt
				 * v) of it apart, kernels/README.md) */
				if (q8 && i % blk == 0) {
					big = 0;
					for (size_t k = i; k < sizes[t] && k < i + blk; k++)
						big = fmax(big, fabs((double)x[k]));
				}
				double tol = q4 ? (what == 1 ? 0.4 * big : 0.35 * big)
				             : q8 ? (what == 1 ? 2.0 / 127 * big : 4.0 / 255 * big) : 0;
				CHECK(fabs((double)x[i] - y[i]) <= tol, "%s: tensor %d state %d [%zu]: %g loaded as %g",
				      names[prec], t, what, i, x[i], y[i]);
			}
		}
		/* the device copy of B follows the restored master */
		memcpy(b.param[t], a.param[t], sizes[t] * 4);
	}
	for (uint64_t step = 4; step <= 5; step++) {
		fill_grads(&a, seed, step, 0.1);
		fill_grads(&b, seed, step, 0.1);
		push_all(&a, 0);
		push_all(&b, 0);
		CHECK_OK(aoq_step_end(a.c));
		CHECK_OK(aoq_step_end(b.c));
		CHECK_OK(aoq_sync(a.c, NULL));
		CHECK_OK(aoq_sync(b.c, NULL));
	}
	for (int t = 0; t < NT; t++) {
		if (prec == AOQ_STATE_FP32 || prec == AOQ_STATE_BF16 || prec == AOQ_STATE_BF16_ALL) {
			CHECK(memcmp(a.param[t], b.param[t], sizes[t] * 4) == 0, "%s: tensor %d differs after restore",
			      names[prec], t);
		} else {
			for (size_t i = 0; i < sizes[t]; i++)
				CHECK(fabs(a.param[t][i] - b.param[t][i]) <= 2e-3, "%s: tensor %d [%zu]: %g vs %g",
				      names[prec], t, i, a.param[t][i], b.param[t][i]);
		}
	}
	free(x);
	free(y);
	close_run(&a);
	close_run(&b);
	printf("restore %s: ok\n", names[prec]);
}

/* Two tensors with equal values and equal gradients in one session: every
 * precision that rounds stochastically must draw other bits for each, so a
 * fair share of their elements differ after a few steps (about a third
 * for a bf16 master: two independent roundings of a value between two bf16
 * numbers disagree with probability 2f(1 - f)).  With the session's seed
 * alone the two were bit-identical, and a deep model's same-shaped tensors
 * rounded together. */
static void test_independent_rounding(const char *sock, enum aoq_precision prec)
{
	static const char *const names[] = { "fp32", "q8", "bf16", "bf16+q8", "bf16-all", "q4", "bf16+q4" };
	enum { N = 65536 + 5 };
	struct aoq_options o = AOQ_OPTIONS_INIT;
	char job[32];
	/* a job per precision: a closed session may stay leased a moment,
	 * and a registration of another precision would not resume it */
	snprintf(job, sizeof(job), "independent-%d", (int)prec);
	o.socket = sock;
	o.job = job;
	o.device = "cpu";
	o.precision = prec;
	o.seed = 0x5eed;
	struct aoq_client *c;
	CHECK_OK(aoq_connect(&c, &o));
	CHECK_OK(aoq_add_group(c, &hp));
	float *param[2], *grad[2];
	for (int t = 0; t < 2; t++) {
		param[t] = aoqt_xmalloc(N * 4);
		grad[t] = aoqt_xmalloc(N * 4);
		struct aoqt_rng g = aoqt_rng_for(21, 0, 0);
		for (size_t i = 0; i < N; i++)
			param[t][i] = (float)aoqt_uniform(&g);
		char name[8];
		snprintf(name, sizeof(name), "t%d", t);
		struct aoq_tensor d = { .size = sizeof(struct aoq_tensor), .name = name, .numel = N, .param_dtype = AOQ_FP32,
		                        .grad_dtype = AOQ_FP32, .param = param[t], .grad = grad[t] };
		CHECK(aoq_add_tensor(c, &d) == t, "tensor index");
	}
	CHECK_OK(aoq_register(c));
	for (uint64_t step = 1; step <= 3; step++) {
		struct aoqt_rng g = aoqt_rng_for(22, 0, step);
		for (size_t i = 0; i < N; i++)
			grad[0][i] = grad[1][i] = (float)(0.1 * aoqt_uniform(&g));
		CHECK_OK(aoq_push_grad(c, 1, 0, NULL));
		CHECK_OK(aoq_push_grad(c, 0, 0, NULL));
		CHECK_OK(aoq_step_end(c));
		CHECK_OK(aoq_sync(c, NULL));
	}
	size_t differ = 0;
	for (size_t i = 0; i < N; i++)
		differ += memcmp(&param[0][i], &param[1][i], 4) != 0;
	if (prec == AOQ_STATE_FP32)
		CHECK(differ == 0, "fp32: %zu of %d elements differ between equal tensors", differ, N);
	else
		CHECK(differ >= N / 20, "%s: only %zu of %d elements differ between two equal tensors: "
		      "they round with the same random bits", names[prec], differ, N);
	aoq_close(c);
	for (int t = 0; t < 2; t++) {
		free(param[t]);
		free(grad[t]);
	}
	printf("independent rounding %s: %zu of %d elements differ\n", names[prec], differ, N);
}

int main(int argc, char **argv)
{
	aoqt_init("integration-modes");
	struct aoqt_daemon d;
	const char *args[] = { "--threads", "2", NULL };
	CHECK_OK(aoqt_daemon_start(&d, aoqt_aoqd_path(argc, argv), args));
	test_clip(d.socket);
	test_skip(d.socket);
	test_delayed(d.socket);
	test_window(d.socket);
	for (int p = AOQ_STATE_FP32; p <= AOQ_STATE_BF16_Q4; p++)
		test_restore(d.socket, (enum aoq_precision)p);
	for (int p = AOQ_STATE_FP32; p <= AOQ_STATE_BF16_Q4; p++)
		test_independent_rounding(d.socket, (enum aoq_precision)p);
	CHECK(aoqt_daemon_stop(&d, 10000, true) == 0, "aoqd did not exit cleanly");
	return 0;
}
