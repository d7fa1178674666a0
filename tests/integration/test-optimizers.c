/* SPDX-License-Identifier: MIT */
/*
 * SGD (momentum 0 and 0.9, nesterov, dampening, weight decay) and Lion in
 * the daemon, fp32 and bf16 states, against the harness's double reference
 * over several steps with a changing lr; the momentum buffer read back as
 * exp_avg; what the daemon refuses for them (q8 state, exp_avg_sq, a
 * buffer added by SetHyperparams, nesterov with dampening).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define NT 3
#define STEPS 6
static const double base_clip = 2.0;
static const uint64_t sizes[NT] = { 3, 4097, (1u << 18) + 13 };

struct run {
	struct aoq_client *c;
	float *param[NT], *grad[NT];
	struct aoqt_ref ref[NT];
};

static struct aoq_options base_opts = AOQ_OPTIONS_INIT; /* the modes case sets clipping and skipping */

static int open_run(struct run *r, const char *sock, enum aoq_precision prec, const struct aoq_group *hp, uint64_t seed)
{
	struct aoq_options o = base_opts;
	o.socket = sock;
	o.job = "optimizers";
	o.device = "cpu";
	o.precision = prec;
	CHECK_OK(aoq_connect(&r->c, &o));
	CHECK_OK(aoq_add_group(r->c, hp));
	for (int t = 0; t < NT; t++) {
		r->param[t] = aoqt_xmalloc(sizes[t] * 4);
		r->grad[t] = aoqt_xmalloc(sizes[t] * 4);
		struct aoqt_rng g = aoqt_rng_for(seed, t, 0);
		aoqt_ref_init(&r->ref[t], sizes[t]);
		for (size_t i = 0; i < sizes[t]; i++) {
			/* bf16 master: start from bf16 values so that the reference starts equal */
			r->param[t][i] = (float)aoqt_round(aoqt_uniform(&g), AOQ_BF16);
			r->ref[t].p[i] = r->param[t][i];
		}
		char name[16];
		snprintf(name, sizeof(name), "t%d", t);
		struct aoq_tensor d = AOQ_TENSOR_INIT;
		d.name = name;
		d.numel = sizes[t];
		d.param_dtype = AOQ_FP32;
		d.grad_dtype = AOQ_FP32;
		d.param = r->param[t];
		d.grad = r->grad[t];
		CHECK(aoq_add_tensor(r->c, &d) == t, "tensor index");
	}
	return aoq_register(r->c);
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

static const char *kind_name(const struct aoq_group *hp)
{
	return hp->kind == AOQ_SGD ? "sgd" : "lion";
}

static void run_case(const char *sock, enum aoq_precision prec, struct aoq_group hp, uint64_t seed)
{
	struct run r;
	char what[160];
	snprintf(what, sizeof(what), "%s prec %d momentum %g dampening %g nesterov %d wd %g", kind_name(&hp), (int)prec,
	         hp.momentum, hp.dampening, (int)hp.nesterov, hp.weight_decay);
	CHECK_OK(open_run(&r, sock, prec, &hp, seed));
	bool bf16_master = prec != AOQ_STATE_FP32;
	bool has_m = hp.kind == AOQ_LION || hp.momentum != 0;
	float *buf = aoqt_xmalloc(sizes[NT - 1] * 4);
	for (uint64_t step = 1; step <= STEPS; step++) {
		if (step > 1) { /* a schedule: the lr changes every step */
			hp.lr *= 0.7;
			CHECK_OK(aoq_set_hyperparams(r.c, 0, &hp));
		}
		for (int t = 0; t < NT; t++) {
			struct aoqt_rng g = aoqt_rng_for(seed, t, step);
			for (size_t i = 0; i < sizes[t]; i++)
				r.grad[t][i] = (float)(0.1 * aoqt_uniform(&g));
			if (bf16_master) {
				/* bf16 state: check one step at a time from where the
				 * daemon is (its stochastic rounding is checked by the
				 * kernel tests) */
				CHECK_OK(aoq_read_state(r.c, (uint32_t)t, AOQ_MASTER, AOQ_FP32, 0, sizes[t], buf));
				aoqt_ref_resync(&r.ref[t], buf);
				if (has_m && step > 1) {
					CHECK_OK(aoq_read_state(r.c, (uint32_t)t, AOQ_EXP_AVG, AOQ_FP32, 0, sizes[t], buf));
					for (size_t i = 0; i < sizes[t]; i++) {
						r.ref[t].m[i] = buf[i];
						r.ref[t].em[i] = 0;
					}
				}
			}
		}
		for (int t = NT - 1; t >= 0; t--)
			CHECK_OK(aoq_push_grad(r.c, (uint32_t)t, 0, NULL));
		CHECK_OK(aoq_step_end(r.c));
		CHECK_OK(aoq_sync(r.c, NULL));
		for (int t = 0; t < NT; t++) {
			aoqt_ref_step(&r.ref[t], &hp, r.grad[t]);
			if (!bf16_master) {
				CHECK(aoqt_check_param(what, &r.ref[t], r.param[t], AOQ_FP32) == 0, "%s: step %lu tensor %d",
				      what, (unsigned long)step, t);
			} else {
				/* stochastic rounding to bf16: either neighbour of the value */
				size_t bad = 0;
				for (size_t i = 0; i < sizes[t]; i++) {
					double ref = r.ref[t].p[i];
					if (!(fabs(r.param[t][i] - ref) <= r.ref[t].err[i] + 0x1p-7 * fabs(ref) + 1e-38) && bad++ < 5)
						fprintf(stderr, "  %s step %lu tensor %d [%zu]: got %.9g want %.9g\n", what,
						        (unsigned long)step, t, i, r.param[t][i], ref);
				}
				CHECK(bad == 0, "%s: step %lu tensor %d: %zu elements off", what, (unsigned long)step, t, bad);
			}
			if (has_m) {
				/* the momentum buffer (Lion's m) is exp_avg */
				CHECK_OK(aoq_read_state(r.c, (uint32_t)t, AOQ_EXP_AVG, AOQ_FP32, 0, sizes[t], buf));
				size_t bad = 0;
				for (size_t i = 0; i < sizes[t]; i++) {
					double ref = r.ref[t].m[i];
					double tol = (prec == AOQ_STATE_BF16_ALL ? 0x1p-7 : 1e-5) * fabs(ref) + 2 * r.ref[t].em[i] + 1e-30;
					if (!(fabs(buf[i] - ref) <= tol) && bad++ < 5)
						fprintf(stderr, "  %s step %lu tensor %d exp_avg[%zu]: got %.9g want %.9g\n", what,
						        (unsigned long)step, t, i, buf[i], ref);
				}
				CHECK(bad == 0, "%s: step %lu tensor %d exp_avg: %zu elements off", what, (unsigned long)step, t,
				      bad);
			}
		}
	}
	/* one moment at most: exp_avg_sq is refused with a message, and so is
	 * exp_avg without momentum */
	int rr = aoq_read_state(r.c, 0, AOQ_EXP_AVG_SQ, AOQ_FP32, 0, sizes[0], buf);
	CHECK(rr == -EINVAL && strstr(aoq_last_error(), "exp_avg_sq"), "%s: exp_avg_sq read: %d %s", what, rr,
	      aoq_last_error());
	close_run(&r);
	if (!has_m) {
		CHECK_OK(open_run(&r, sock, prec, &hp, seed));
		rr = aoq_read_state(r.c, 0, AOQ_EXP_AVG, AOQ_FP32, 0, sizes[0], buf);
		CHECK(rr == -EINVAL && strstr(aoq_last_error(), "exp_avg"), "%s: exp_avg read: %d %s", what, rr,
		      aoq_last_error());
		close_run(&r);
		/* no buffer was allocated: SetHyperparams may not ask for one */
		CHECK_OK(open_run(&r, sock, prec, &hp, seed));
		struct aoq_group h2 = hp;
		h2.momentum = 0.9;
		rr = aoq_set_hyperparams(r.c, 0, &h2);
		CHECK(rr < 0 && strstr(aoq_last_error(), "momentum"), "%s: momentum added: %d %s", what, rr,
		      aoq_last_error());
		close_run(&r);
	}
	free(buf);
	printf("%s: ok\n", what);
}

/* Clipping (max_grad_norm), skip_nonfinite and two micro-batches per step
 * (the fp32 accumulator) with the new kinds; the first step is skipped, so
 * that SGD's first update is the next one (its buffer starts there). */
static void run_modes(const char *sock, struct aoq_group hp, uint64_t seed)
{
	struct run r;
	char what[160];
	snprintf(what, sizeof(what), "%s modes momentum %g nesterov %d", kind_name(&hp), hp.momentum, (int)hp.nesterov);
	base_opts.max_grad_norm = 2.0;
	base_opts.skip_nonfinite = true;
	CHECK_OK(open_run(&r, sock, AOQ_STATE_FP32, &hp, seed));
	base_opts = (struct aoq_options)AOQ_OPTIONS_INIT;
	size_t nmax = sizes[NT - 1];
	float *ga = aoqt_xmalloc(nmax * 4), *sum = aoqt_xmalloc(nmax * 4 * NT), *before = aoqt_xmalloc(nmax * 4);
	for (uint64_t step = 1; step <= STEPS; step++) {
		bool skip = step == 1;
		double sumsq = 0;
		for (int t = NT - 1; t >= 0; t--) {
			struct aoqt_rng g = aoqt_rng_for(seed, t, 2 * step);
			for (size_t i = 0; i < sizes[t]; i++)
				r.grad[t][i] = (float)(0.1 * aoqt_uniform(&g));
			memcpy(ga, r.grad[t], sizes[t] * 4);
			CHECK_OK(aoq_push_grad(r.c, (uint32_t)t, AOQ_PUSH_ACCUMULATE, NULL));
			CHECK_OK(aoq_grad_copied(r.c, (uint32_t)t)); /* the buffer is refilled next */
			g = aoqt_rng_for(seed, t, 2 * step + 1);
			for (size_t i = 0; i < sizes[t]; i++) {
				r.grad[t][i] = (float)(0.1 * aoqt_uniform(&g));
				sum[t * nmax + i] = ga[i] + r.grad[t][i]; /* fp32, as the accumulator */
			}
			if (skip && t == 1)
				r.grad[t][7] = NAN;
			sumsq += aoqt_sumsq(sum + t * nmax, sizes[t]);
			CHECK_OK(aoq_push_grad(r.c, (uint32_t)t, 0, NULL));
		}
		memcpy(before, r.param[NT - 1], nmax * 4);
		CHECK_OK(aoq_step_end(r.c));
		struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_sync(r.c, &res));
		CHECK(res.skipped == skip, "%s step %lu: skipped %d", what, (unsigned long)step, (int)res.skipped);
		if (skip) {
			CHECK(memcmp(before, r.param[NT - 1], nmax * 4) == 0, "%s: a skipped step changed parameters", what);
			continue;
		}
		double scale = fmin(1.0, base_clip / (sqrt(sumsq) + 1e-6));
		CHECK(scale < 1 && fabs(res.clip_scale - scale) <= 1e-5 * scale, "%s step %lu: clip %g, expected %g", what,
		      (unsigned long)step, res.clip_scale, scale);
		for (int t = 0; t < NT; t++) {
			float *gs = sum + t * nmax;
			for (size_t i = 0; i < sizes[t]; i++)
				gs[i] = gs[i] * (float)res.clip_scale; /* as the kernel: (acc + grad) * grad_scale in fp32 */
			aoqt_ref_step(&r.ref[t], &hp, gs);
			CHECK(aoqt_check_param(what, &r.ref[t], r.param[t], AOQ_FP32) == 0, "%s: step %lu tensor %d", what,
			      (unsigned long)step, t);
		}
	}
	free(ga);
	free(sum);
	free(before);
	close_run(&r);
	printf("%s: ok\n", what);
}

static void refused(const char *sock, enum aoq_precision prec, struct aoq_group hp, const char *needle)
{
	struct run r;
	int rr = open_run(&r, sock, prec, &hp, 1);
	CHECK(rr < 0 && strstr(aoq_last_error(), needle), "%s prec %d: registration gave %d (%s), expected a refusal "
	      "naming '%s'", kind_name(&hp), (int)prec, rr, aoq_last_error(), needle);
	printf("refused: %s\n", aoq_last_error());
	close_run(&r);
}

int main(int argc, char **argv)
{
	aoqt_init("integration-optimizers");
	struct aoqt_daemon d;
	const char *args[] = { "--threads", "2", NULL };
	CHECK_OK(aoqt_daemon_start(&d, aoqt_aoqd_path(argc, argv), args));
	struct aoq_group sgd = AOQ_GROUP_INIT, lion = AOQ_GROUP_INIT;
	sgd.kind = AOQ_SGD;
	sgd.lr = 0.05;
	lion.kind = AOQ_LION;
	lion.lr = 1e-3;
	lion.beta1 = 0.9;
	lion.beta2 = 0.99;
	lion.weight_decay = 0.1;
	static const enum aoq_precision precs[] = { AOQ_STATE_FP32, AOQ_STATE_BF16, AOQ_STATE_BF16_ALL };
	for (size_t pi = 0; pi < sizeof(precs) / sizeof(precs[0]); pi++) {
		enum aoq_precision p = precs[pi];
		struct aoq_group h = sgd;
		run_case(d.socket, p, h, 10 + pi);
		h.momentum = 0.9;
		h.nesterov = true;
		h.weight_decay = 0.01;
		run_case(d.socket, p, h, 20 + pi);
		h.nesterov = false;
		h.dampening = 0.25;
		h.weight_decay = 1e-3;
		run_case(d.socket, p, h, 30 + pi);
		run_case(d.socket, p, lion, 40 + pi);
	}
	struct aoq_group m = sgd;
	m.momentum = 0.9;
	m.nesterov = true;
	m.weight_decay = 0.01;
	run_modes(d.socket, m, 50);
	run_modes(d.socket, lion, 51);
	refused(d.socket, AOQ_STATE_Q8, sgd, "STATE_Q8");
	refused(d.socket, AOQ_STATE_BF16_Q8, lion, "STATE_BF16_Q8");
	refused(d.socket, AOQ_STATE_Q4, sgd, "STATE_Q4");
	refused(d.socket, AOQ_STATE_BF16_Q4, lion, "STATE_BF16_Q4");
	struct aoq_group bad = sgd;
	bad.momentum = 0.9;
	bad.dampening = 0.1;
	bad.nesterov = true;
	refused(d.socket, AOQ_STATE_FP32, bad, "nesterov");
	CHECK(aoqt_daemon_stop(&d, 10000, true) == 0, "aoqd did not exit cleanly");
	return 0;
}
