/* SPDX-License-Identifier: MIT */
/*
 * Gradient accumulation: session A pushes 4 micro-batches per step (the
 * first 3 with AOQ_PUSH_ACCUMULATE, reusing one grad buffer after
 * aoq_grad_copied()), session B pushes once per step the sum of the same
 * micro-batches, computed in fp32 in micro-batch order, as an fp32
 * gradient.  For tensors whose gradient is fp32 in A, A and B must agree
 * bit for bit every step; every tensor of A and B must match the double
 * reference fed with the fp32 sums.  Micro-batches interleave across
 * tensors on even steps and come tensor by tensor on odd steps.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include "harness.h"

#define NT 6
#define NSTEPS 6
#define NMB 4

struct tdesc {
	uint64_t n;
	enum aoq_dtype gd, pd;
	uint32_t group;
};

static const struct tdesc desc[NT] = {
	{ 4097, AOQ_FP32, AOQ_FP32, 0 },
	{ (1u << 20) + 13, AOQ_FP32, AOQ_BF16, 1 },
	{ 3, AOQ_BF16, AOQ_FP32, 0 },
	{ 4097, AOQ_FP16, AOQ_FP16, 1 },
	{ 1, AOQ_BF16, AOQ_BF16, 0 },
	{ 65537, AOQ_FP32, AOQ_FP16, 0 },
};

struct side {
	struct aoq_client *c;
	int idx[NT];
	void *param[NT];
	void *grad[NT];
	struct aoqt_ref ref[NT];
};

static struct aoq_group hp_at(uint32_t g, uint64_t k)
{
	struct aoq_group h = g == 0
		? (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		                      .weight_decay = 0.05 }
		: (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAM, .lr = 1e-3, .beta1 = 0.85, .beta2 = 0.995, .eps = 1e-7,
		                      .weight_decay = 0.01 };
	h.lr *= 1.0 + 0.25 * (double)((k * 7) % 5);
	return h;
}

static void open_side(struct side *s, const char *sock, const char *job, bool summed, float *const *init_vals)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	o.job = job;
	o.device = "cpu";
	CHECK_OK(aoq_connect(&s->c, &o));
	for (uint32_t g = 0; g < 2; g++) {
		struct aoq_group h = hp_at(g, 1);
		CHECK_OK(aoq_add_group(s->c, &h));
	}
	for (int t = 0; t < NT; t++) {
		const struct tdesc *d = &desc[t];
		enum aoq_dtype gd = summed ? AOQ_FP32 : d->gd;
		s->param[t] = aoqt_xmalloc(d->n * aoqt_dtype_size(d->pd));
		s->grad[t] = aoqt_xmalloc(d->n * aoqt_dtype_size(gd));
		aoqt_ref_init(&s->ref[t], d->n);
		for (uint64_t i = 0; i < d->n; i++) {
			aoqt_store(s->param[t], i, d->pd, init_vals[t][i]);
			s->ref[t].p[i] = aoqt_load(s->param[t], i, d->pd);
		}
		char name[16];
		snprintf(name, sizeof(name), "t%d", t);
		struct aoq_tensor td = { .size = sizeof(struct aoq_tensor), .name = name, .numel = d->n, .param_dtype = d->pd, .grad_dtype = gd,
		                         .group = d->group, .param = s->param[t], .grad = s->grad[t] };
		s->idx[t] = aoq_add_tensor(s->c, &td);
		CHECK_OK(s->idx[t]);
	}
	CHECK_OK(aoq_register(s->c));
}

static void close_side(struct side *s)
{
	aoq_close(s->c);
	for (int t = 0; t < NT; t++) {
		free(s->param[t]);
		free(s->grad[t]);
		aoqt_ref_free(&s->ref[t]);
	}
}

/* Micro-batch mb of tensor t at step k into A's grad buffer; adds it to
 * the fp32 running sum in order. */
static void micro_batch(struct side *a, float *sum, int t, uint64_t k, int mb)
{
	const struct tdesc *d = &desc[t];
	struct aoqt_rng rng = aoqt_rng_for(k, (uint64_t)t, (uint64_t)mb);
	/* Scales that differ by orders of magnitude, so the fp32 sum depends
	 * on the order in which it is taken. */
	const double scale[NMB] = { 1.0, 3e-4, 0.07, 2e-6 };
	for (uint64_t i = 0; i < d->n; i++) {
		double x = scale[(mb + (int)i) % NMB] * aoqt_uniform(&rng);
		aoqt_store(a->grad[t], i, d->gd, x);
		float g = (float)aoqt_load(a->grad[t], i, d->gd);
		sum[i] = mb == 0 ? g : sum[i] + g;
	}
}

static void push(struct side *a, int t, int mb)
{
	unsigned flags = mb < NMB - 1 ? AOQ_PUSH_ACCUMULATE : 0;
	CHECK_OK(aoq_push_grad(a->c, (uint32_t)a->idx[t], flags, NULL));
	/* The buffer is refilled for the next micro-batch. */
	CHECK_OK(aoq_grad_copied(a->c, (uint32_t)a->idx[t]));
}

int main(int argc, char **argv)
{
	aoqt_init("integration-accumulate");
	const char *exe = aoqt_aoqd_path(argc, argv);
	struct aoqt_daemon d;
	static const char *const args[] = { "--threads", "2", NULL };
	CHECK_OK(aoqt_daemon_start(&d, exe, args));

	float *init[NT], *sum[NT];
	for (int t = 0; t < NT; t++) {
		init[t] = aoqt_xmalloc(desc[t].n * sizeof(float));
		sum[t] = aoqt_xmalloc(desc[t].n * sizeof(float));
		struct aoqt_rng rng = aoqt_rng_for(0, (uint64_t)t, 7);
		for (uint64_t i = 0; i < desc[t].n; i++)
			init[t][i] = (float)(1.5 * aoqt_uniform(&rng));
	}
	char job[2][48];
	snprintf(job[0], sizeof(job[0]), "accumulate-%d", (int)getpid());
	snprintf(job[1], sizeof(job[1]), "summed-%d", (int)getpid());
	struct side a, b;
	open_side(&a, d.socket, job[0], false, init);
	open_side(&b, d.socket, job[1], true, init);

	size_t not_bitexact = 0;
	for (uint64_t k = 1; k <= NSTEPS; k++) {
		if (k > 1)
			for (uint32_t g = 0; g < 2; g++) {
				struct aoq_group h = hp_at(g, k);
				CHECK_OK(aoq_set_hyperparams(a.c, g, &h));
				CHECK_OK(aoq_set_hyperparams(b.c, g, &h));
			}
		CHECK(aoq_current_step(a.c) == k, "A: current step %" PRIu64 ", want %" PRIu64, aoq_current_step(a.c), k);
		if (k % 2 == 0) {
			for (int mb = 0; mb < NMB; mb++)
				for (int t = 0; t < NT; t++) {
					micro_batch(&a, sum[t], t, k, mb);
					push(&a, t, mb);
				}
		} else {
			for (int t = NT - 1; t >= 0; t--)
				for (int mb = 0; mb < NMB; mb++) {
					micro_batch(&a, sum[t], t, k, mb);
					push(&a, t, mb);
				}
		}
		for (int t = 0; t < NT; t++) {
			memcpy(b.grad[t], sum[t], desc[t].n * sizeof(float));
			CHECK_OK(aoq_push_grad(b.c, (uint32_t)b.idx[t], 0, NULL));
		}
		CHECK_OK(aoq_step_end(a.c));
		CHECK_OK(aoq_step_end(b.c));
		struct aoq_step_result ra = AOQ_STEP_RESULT_INIT, rb = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_sync(a.c, &ra));
		CHECK_OK(aoq_sync(b.c, &rb));
		double ss = 0;
		for (int t = 0; t < NT; t++)
			ss += aoqt_sumsq(sum[t], desc[t].n);
		CHECK(ra.step == k && rb.step == k, "step results %" PRIu64 "/%" PRIu64 ", want %" PRIu64, ra.step,
		      rb.step, k);
		CHECK(ra.tensors_updated == NT && rb.tensors_updated == NT,
		      "step %" PRIu64 ": %" PRIu64 " (accumulated) and %" PRIu64 " (summed) tensors updated, want %d", k,
		      ra.tensors_updated, rb.tensors_updated, NT);
		CHECK(fabs(ra.grad_sumsq - ss) <= 1e-6 * ss,
		      "step %" PRIu64 ": accumulated grad_sumsq %.12g, want %.12g (of the summed gradient)", k,
		      ra.grad_sumsq, ss);
		CHECK(fabs(rb.grad_sumsq - ss) <= 1e-6 * ss, "step %" PRIu64 ": summed grad_sumsq %.12g, want %.12g", k,
		      rb.grad_sumsq, ss);

		size_t bad = 0;
		for (int t = 0; t < NT; t++) {
			const struct tdesc *dd = &desc[t];
			struct aoq_group h = hp_at(dd->group, k);
			char what[96];
			size_t bytes = dd->n * aoqt_dtype_size(dd->pd);
			bool same = memcmp(a.param[t], b.param[t], bytes) == 0;
			if (dd->gd == AOQ_FP32) {
				if (!same) {
					for (uint64_t i = 0; i < dd->n; i++)
						if (aoqt_bits(a.param[t], i, dd->pd) != aoqt_bits(b.param[t], i, dd->pd)) {
							fprintf(stderr,
							        "  step %" PRIu64 " tensor %d [%" PRIu64 "]: accumulated %.9g, summed %.9g\n",
							        k, t, i, aoqt_load(a.param[t], i, dd->pd),
							        aoqt_load(b.param[t], i, dd->pd));
							break;
						}
					bad++;
				}
			} else if (!same) {
				not_bitexact++;
			}
			aoqt_ref_step(&a.ref[t], &h, sum[t]);
			aoqt_ref_step(&b.ref[t], &h, sum[t]);
			snprintf(what, sizeof(what), "accumulated: step %" PRIu64 " tensor %d (grad %s, param %s)", k, t,
			         aoq_dtype_name(dd->gd), aoq_dtype_name(dd->pd));
			bad += aoqt_check_param(what, &a.ref[t], a.param[t], dd->pd);
			snprintf(what, sizeof(what), "summed: step %" PRIu64 " tensor %d (param %s)", k, t,
			         aoq_dtype_name(dd->pd));
			bad += aoqt_check_param(what, &b.ref[t], b.param[t], dd->pd);
			if (dd->pd == AOQ_FP32) {
				aoqt_ref_resync(&a.ref[t], a.param[t]);
				aoqt_ref_resync(&b.ref[t], b.param[t]);
			}
		}
		CHECK(bad == 0, "step %" PRIu64 ": %zu mismatches (fp32-grad tensors must be bit-exact between "
		      "accumulated and summed sessions, every tensor within the reference's tolerance)", k, bad);
	}
	if (not_bitexact)
		printf("note: %zu (tensor, step) pairs with bf16/fp16 grads were not bit-exact between the "
		       "accumulated and the summed session (within tolerance; not required)\n", not_bitexact);
	close_side(&a);
	close_side(&b);
	for (int t = 0; t < NT; t++) {
		free(init[t]);
		free(sum[t]);
	}
	int rc = aoqt_daemon_stop(&d, 20000, true);
	CHECK(rc == 0, "aoqd exit status %d after SIGTERM, want 0", rc);
	printf("ok: %d steps of %d micro-batches match one step on the fp32 sum\n", NSTEPS, NMB);
	return 0;
}
