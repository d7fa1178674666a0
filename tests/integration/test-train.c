/* SPDX-License-Identifier: MIT */
/*
 * Four concurrent trainers against one aoqd.  Each has tensors of 1, 3, 4097
 * and 2^20+13 elements; across the 16 tensors every (grad dtype, param
 * dtype) pair occurs; AdamW and Adam groups with different betas, eps and
 * weight decay; 20 steps with a learning rate that changes every step (and
 * a weight decay that changes once).  After every step every parameter is
 * compared with the double-precision reference of harness.c.
 *
 * Two clients set the next step's hyperparameters before the first push,
 * the other two right after aoq_step_end(), while the daemon may still be
 * computing the current step: a change must apply from the next step only.
 * Some bf16/fp16 tensors start from fp32 `init` values; the master is read
 * back after registration and must equal them exactly.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "harness.h"

#define NCLIENTS 4
#define NTENS 4
#define NSTEPS 20

static const uint64_t sizes[NTENS] = { 1, 3, 4097, (1u << 20) + 13 };
static const enum aoq_dtype dtypes[3] = { AOQ_FP32, AOQ_BF16, AOQ_FP16 };

struct tens {
	int idx;
	uint64_t n;
	enum aoq_dtype pd, gd;
	uint32_t group;
	void *param, *grad;
	float *gval; /* this step's gradient as exact floats */
	float *init; /* fp32 initial master, or NULL */
	struct aoqt_ref ref;
};

struct client {
	int id;
	const char *socket;
	pthread_t th;
	struct aoq_group g0[2]; /* step-1 hyperparameters */
	struct tens t[NTENS];
	bool read_state_ok;
};

static bool read_state_unsupported;

static struct aoq_group hp_at(const struct client *c, uint32_t g, uint64_t step)
{
	struct aoq_group h = c->g0[g];
	/* A different lr every step: cosine with a floor, plus a per-client phase. */
	h.lr = c->g0[g].lr * (0.55 + 0.45 * cos(0.37 * (double)(step - 1) + c->id));
	if (g == 0 && step >= 10)
		h.weight_decay = c->g0[g].weight_decay * 3;
	return h;
}

static void setup(struct client *c)
{
	c->g0[0] = (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 1e-3 * (1 + c->id), .beta1 = 0.9, .beta2 = 0.999,
	                                .eps = 1e-8, .weight_decay = 0.01 * (c->id + 1) };
	c->g0[1] = (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAM, .lr = 2e-3, .beta1 = 0.8, .beta2 = 0.99,
	                                .eps = c->id == 3 ? 1e-3 : 1e-6, .weight_decay = c->id % 2 ? 0.0 : 0.02 };
	for (int j = 0; j < NTENS; j++) {
		struct tens *t = &c->t[j];
		int combo = (4 * c->id + j) % 9;
		t->n = sizes[j];
		t->gd = dtypes[combo / 3];
		t->pd = dtypes[combo % 3];
		t->group = (uint32_t)((c->id + j) % 2);
		t->param = aoqt_xmalloc(t->n * aoqt_dtype_size(t->pd));
		t->grad = aoqt_xmalloc(t->n * aoqt_dtype_size(t->gd));
		t->gval = aoqt_xmalloc(t->n * sizeof(float));
		aoqt_ref_init(&t->ref, t->n);
		struct aoqt_rng rng = aoqt_rng_for(1, (uint64_t)c->id, (uint64_t)j);
		if (t->pd != AOQ_FP32 && (c->id + j) % 2 == 0)
			t->init = aoqt_xmalloc(t->n * sizeof(float));
		for (uint64_t i = 0; i < t->n; i++) {
			double x = 2 * aoqt_uniform(&rng);
			if ((aoqt_next(&rng) & 63) == 0)
				x = 0;
			if (t->init) {
				/* A full-precision fp32 master; the device copy is
				 * its rounding, as a trainer would hold it. */
				t->init[i] = (float)x;
				aoqt_store(t->param, i, t->pd, t->init[i]);
				t->ref.p[i] = t->init[i];
			} else {
				aoqt_store(t->param, i, t->pd, x);
				t->ref.p[i] = aoqt_load(t->param, i, t->pd);
			}
		}
	}
}

static void fill_grads(struct client *c, uint64_t step)
{
	for (int j = 0; j < NTENS; j++) {
		struct tens *t = &c->t[j];
		struct aoqt_rng rng = aoqt_rng_for(2 + step, (uint64_t)c->id, (uint64_t)j);
		const double scale[3] = { 1.0, 0.1, 1e-3 };
		double s = scale[(c->id + j + (int)step) % 3];
		for (uint64_t i = 0; i < t->n; i++) {
			double x = s * aoqt_uniform(&rng);
			uint64_t z = aoqt_next(&rng) & 63;
			if (z == 0)
				x = 0;
			else if (z == 1)
				x = -0.0;
			aoqt_store(t->grad, i, t->gd, x);
			t->gval[i] = (float)aoqt_load(t->grad, i, t->gd);
		}
	}
}

static void check_master(struct client *c, struct aoq_client *ac)
{
	for (int j = 0; j < NTENS; j++) {
		struct tens *t = &c->t[j];
		float *m = aoqt_xmalloc(t->n * sizeof(float));
		int r = aoq_read_state(ac, (uint32_t)t->idx, 0, AOQ_FP32, 0, t->n, m);
		if (r == -ENOSYS || r == -EOPNOTSUPP) {
			read_state_unsupported = true;
			free(m);
			return;
		}
		CHECK_OK(r);
		for (uint64_t i = 0; i < t->n; i++) {
			float want = t->init ? t->init[i] : (float)aoqt_load(t->param, i, t->pd);
			CHECK(memcmp(&m[i], &want, 4) == 0,
			      "client %d tensor %d (%s param%s): initial master [%" PRIu64 "] is %.9g, want %.9g",
			      c->id, j, aoq_dtype_name(t->pd), t->init ? ", fp32 init" : "", i, m[i], want);
		}
		free(m);
	}
	c->read_state_ok = true;
}

static void *run_client(void *arg)
{
	struct client *c = arg;
	struct aoq_options o = AOQ_OPTIONS_INIT;
	char job[64];
	snprintf(job, sizeof(job), "train-%d-%d", (int)getpid(), c->id);
	o.socket = c->socket;
	o.device = "cpu";
	o.job = job;
	o.rank = (uint32_t)c->id;
	struct aoq_client *ac = NULL;
	CHECK_OK(aoq_connect(&ac, &o));
	for (uint32_t g = 0; g < 2; g++) {
		struct aoq_group h = hp_at(c, g, 1);
		int r = aoq_add_group(ac, &h);
		CHECK_OK(r);
		CHECK(r == (int)g, "group index %d, want %u", r, g);
	}
	for (int j = 0; j < NTENS; j++) {
		struct tens *t = &c->t[j];
		char name[32];
		snprintf(name, sizeof(name), "c%d.t%d", c->id, j);
		struct aoq_tensor d = { .size = sizeof(struct aoq_tensor), .name = name, .numel = t->n, .param_dtype = t->pd, .grad_dtype = t->gd,
		                        .group = t->group, .param = t->param, .grad = t->grad,
		                        .init = t->init, .init_dtype = AOQ_FP32 };
		t->idx = aoq_add_tensor(ac, &d);
		CHECK_OK(t->idx);
	}
	CHECK_OK(aoq_register(ac));
	check_master(c, ac);

	uint32_t order[NTENS] = { 0, 1, 2, 3 };
	struct aoqt_rng rng = aoqt_rng_for(99, (uint64_t)c->id, 0);
	bool late = c->id % 2 == 1; /* set hyperparameters right after step_end */
	for (uint64_t k = 1; k <= NSTEPS; k++) {
		if (k > 1 && !late)
			for (uint32_t g = 0; g < 2; g++) {
				struct aoq_group h = hp_at(c, g, k);
				CHECK_OK(aoq_set_hyperparams(ac, g, &h));
			}
		uint64_t cur = aoq_current_step(ac);
		CHECK(cur == k, "client %d: aoq_current_step = %" PRIu64 " before step %" PRIu64, c->id, cur, k);
		fill_grads(c, k);
		for (int i = NTENS - 1; i > 0; i--) { /* a new push order every step */
			int s = (int)(aoqt_next(&rng) % (uint64_t)(i + 1));
			uint32_t tmp = order[i];
			order[i] = order[s];
			order[s] = tmp;
		}
		for (int i = 0; i < NTENS; i++)
			CHECK_OK(aoq_push_grad(ac, (uint32_t)c->t[order[i]].idx, 0, NULL));
		CHECK_OK(aoq_step_end(ac));
		if (late && k < NSTEPS)
			for (uint32_t g = 0; g < 2; g++) {
				struct aoq_group h = hp_at(c, g, k + 1);
				CHECK_OK(aoq_set_hyperparams(ac, g, &h));
			}
		struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_sync(ac, &res));
		double sumsq = 0;
		for (int j = 0; j < NTENS; j++)
			sumsq += aoqt_sumsq(c->t[j].gval, c->t[j].n);
		CHECK(res.step == k, "client %d: step result for step %" PRIu64 ", want %" PRIu64, c->id, res.step, k);
		CHECK(res.tensors_updated == NTENS, "client %d step %" PRIu64 ": %" PRIu64 " tensors updated, want %d",
		      c->id, k, res.tensors_updated, NTENS);
		CHECK(!res.nonfinite, "client %d step %" PRIu64 ": nonfinite reported for finite gradients", c->id, k);
		CHECK(fabs(res.grad_sumsq - sumsq) <= 1e-6 * sumsq + 1e-30,
		      "client %d step %" PRIu64 ": grad_sumsq %.12g, want %.12g (sum of the squared gradients)", c->id,
		      k, res.grad_sumsq, sumsq);

		size_t bad = 0;
		for (int j = 0; j < NTENS; j++) {
			struct tens *t = &c->t[j];
			struct aoq_group h = hp_at(c, t->group, k);
			aoqt_ref_step(&t->ref, &h, t->gval);
			char what[96];
			snprintf(what, sizeof(what), "client %d step %" PRIu64 " tensor %d (%" PRIu64 " elems, grad %s, param %s, %s)",
			         c->id, k, j, t->n, aoq_dtype_name(t->gd), aoq_dtype_name(t->pd),
			         h.kind == AOQ_ADAMW ? "AdamW" : "Adam");
			bad += aoqt_check_param(what, &t->ref, t->param, t->pd);
			if (t->pd == AOQ_FP32)
				aoqt_ref_resync(&t->ref, t->param);
		}
		CHECK(bad == 0, "client %d step %" PRIu64 ": %zu parameters differ from the reference", c->id, k, bad);
	}
	/* The masters of bf16/fp16 params (hidden behind their rounding) after
	 * 20 steps, within the accumulated fp32 bound. */
	if (c->read_state_ok)
		for (int j = 0; j < NTENS; j++) {
			struct tens *t = &c->t[j];
			if (t->pd == AOQ_FP32)
				continue;
			float *m = aoqt_xmalloc(t->n * sizeof(float));
			CHECK_OK(aoq_read_state(ac, (uint32_t)t->idx, 0, AOQ_FP32, 0, t->n, m));
			char what[64];
			snprintf(what, sizeof(what), "client %d tensor %d", c->id, j);
			size_t bad = aoqt_check_master(what, &t->ref, m);
			CHECK(bad == 0, "client %d tensor %d: %zu master values differ from the reference", c->id, j, bad);
			free(m);
		}
	aoq_close(ac);
	return NULL;
}

int main(int argc, char **argv)
{
	aoqt_init("integration-train");
	const char *exe = aoqt_aoqd_path(argc, argv);
	struct aoqt_daemon d;
	static const char *const args[] = { "--threads", "2", NULL };
	CHECK_OK(aoqt_daemon_start(&d, exe, args));

	static struct client cl[NCLIENTS];
	for (int i = 0; i < NCLIENTS; i++) {
		cl[i].id = i;
		cl[i].socket = d.socket;
		setup(&cl[i]);
	}
	for (int i = 0; i < NCLIENTS; i++)
		CHECK(pthread_create(&cl[i].th, NULL, run_client, &cl[i]) == 0, "pthread_create");
	for (int i = 0; i < NCLIENTS; i++)
		pthread_join(cl[i].th, NULL);
	if (read_state_unsupported)
		printf("note: aoq_read_state is not supported; initial and final masters not checked\n");

	Aoq__Envelope *st = NULL;
	CHECK_OK(aoqt_stats(d.socket, &st));
	CHECK(st->stats->threads == 2, "stats: %u threads, want 2", st->stats->threads);
	aoq_envelope_free(st);

	int rc = aoqt_daemon_stop(&d, 20000, true);
	CHECK(rc == 0, "aoqd exit status %d after SIGTERM, want 0", rc);
	for (int i = 0; i < NCLIENTS; i++)
		for (int j = 0; j < NTENS; j++) {
			struct tens *t = &cl[i].t[j];
			free(t->param);
			free(t->grad);
			free(t->gval);
			free(t->init);
			aoqt_ref_free(&t->ref);
		}
	printf("ok: %d clients x %d tensors x %d steps match the reference\n", NCLIENTS, NTENS, NSTEPS);
	return 0;
}
