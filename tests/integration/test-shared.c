/* SPDX-License-Identifier: MIT */
/*
 * Replica groups (docs/design.md, "Replica groups"): the local ranks of one
 * job share one optimizer state.
 *
 * - bitexact: 2 and 3 ranks (one thread drives them all: pushes and
 *   StepEnd do not block) train alongside a single session R of the same
 *   layout fed the same gradients (micro-batches on even steps, the
 *   learning rate changing per step).  After every step every rank's
 *   parameters equal R's bit for bit, the masters read back at the end too,
 *   and the daemon's state bytes for the group equal R's (one replica, not
 *   one per rank), reported on one row.
 * - mismatch: a rank with another layout is refused (INVALID, naming the
 *   difference) and does not hurt the group; a rank with the right layout
 *   then completes it.
 * - disconnect: of 3 ranks, one (a child process) dies in the middle of
 *   step 2; the other two get PEER_LOST (-ECONNABORTED) from aoq_sync within
 *   seconds (never the 60 s timeout), and the group is gone (no partial step
 *   survives).
 * - lease: a group with a lease; one rank (a child process) dies in the
 *   middle of step 3.  The other gets PEER_LOST; once it has closed, the
 *   group's state is listed as leased (rank "group", last step 2).  A new
 *   group with another local world is refused and the lease stays; a new
 *   group of 2 resumes it at step 2, its parameters loaded from the state
 *   equal a single session's after step 2 bit for bit, and steps 3 to 5
 *   stay bit-exact with it (the interrupted step left nothing behind).
 * - restart (its own test, mode "restart"): a group with a lease and a
 *   state_dir trains 3 steps; a snapshot asked with a member's session id
 *   is the group's state (file uid-job-group.safetensors, metadata
 *   local_world 2); aoqd is killed (SIGKILL) in the middle of step 4 and
 *   restarted on the same state_dir: the group's state is leased again, a
 *   new group of 2 resumes it at step 3 and trains to step 5 bit-exact with
 *   a single session that was never interrupted.  Before that, aoqctl drop
 *   of the restored group makes a new group start afresh, and the next
 *   start restores the file again.
 * - hostile: a raw member posts a record in another rank's slice: it gets
 *   BAD_RECORD, the libaoq rank PEER_LOST.
 * - fdstore (its own tests, modes "fdstore term" and "fdstore kill", built
 *   with the supervisor of tests/integration/supervisor.c): a group of 2
 *   with a lease (bf16 master + q8: its masters memfds stored too) trains
 *   3 steps under a supervisor that keeps the fd store as systemd does;
 *   aoqd is stopped (SIGTERM) or killed (SIGKILL: the journal) in the
 *   middle of step 4 and started again: the group's state comes back from
 *   the store, no snapshot read, a new group of 2 resumes it at step 3 and
 *   trains to step 5 bit-exact with a single session never interrupted.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "snapshot.h"
#ifdef AOQT_SUPERVISOR
#include "supervisor.h"
#endif

#define NT 6
#define NSTEPS 5

static const struct aoqt_tdesc desc[NT] = {
	{ 4097, AOQ_FP32, AOQ_FP32, 0 },
	{ (1u << 20) + 13, AOQ_BF16, AOQ_BF16, 1 },
	{ 3, AOQ_BF16, AOQ_FP32, 0 },
	{ 65537, AOQ_FP16, AOQ_FP16, 1 },
	{ 1, AOQ_BF16, AOQ_BF16, 0 },
	{ 700, AOQ_FP32, AOQ_FP32, 1 },
};

static double clip; /* max_grad_norm of the sessions opened */
static uint32_t lease_secs = AOQ_LEASE_NONE; /* the sessions' lease */
static enum aoq_precision prec = AOQ_STATE_FP32; /* the sessions' state (fixed seed) */

struct rank {
	struct aoq_client *c;
	void *param[NT];
	void *grad[NT];
};

static struct aoq_group hp_at(uint32_t g, uint64_t k)
{
	struct aoq_group h = g == 0
		? (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 3e-3, .beta1 = 0.9,
		                      .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.05 }
		: (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAM, .lr = 1e-3, .beta1 = 0.85,
		                      .beta2 = 0.995, .eps = 1e-7, .weight_decay = 0.01 };
	h.lr *= 1.0 + 0.25 * (double)((k * 7) % 5);
	return h;
}

/* Connects (world 0: a session of its own) and registers the tensors of d
 * with initial values init; returns aoq_register's result. */
static int open_rank(struct rank *r, const char *sock, const char *job, uint32_t world, uint32_t lr,
                     const struct aoqt_tdesc *d, float *const *init)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	o.job = job;
	o.rank = lr;
	o.local_world = world;
	o.local_rank = lr;
	o.lease_seconds = lease_secs;
	o.timeout_ms = 60000;
	o.max_grad_norm = clip;
	o.precision = prec;
	o.seed = 0x5eed; /* the same stochastic rounding in the group and the single session */
	CHECK_OK(aoq_connect(&r->c, &o));
	for (uint32_t g = 0; g < 2; g++) {
		struct aoq_group h = hp_at(g, 1);
		CHECK_OK(aoq_add_group(r->c, &h));
	}
	for (int t = 0; t < NT; t++) {
		r->param[t] = aoqt_xmalloc(d[t].n * aoqt_dtype_size(d[t].pd));
		r->grad[t] = aoqt_xmalloc(d[t].n * aoqt_dtype_size(d[t].gd));
		for (uint64_t i = 0; i < d[t].n; i++)
			aoqt_store(r->param[t], i, d[t].pd, init[t][i % desc[t].n]);
		char name[16];
		snprintf(name, sizeof(name), "t%d", t);
		struct aoq_tensor td = { .size = sizeof(struct aoq_tensor), .name = name, .numel = d[t].n,
		                         .param_dtype = d[t].pd, .grad_dtype = d[t].gd, .group = d[t].group,
		                         .param = r->param[t], .grad = r->grad[t] };
		CHECK_OK(aoq_add_tensor(r->c, &td));
	}
	return aoq_register(r->c);
}

static void close_rank(struct rank *r)
{
	aoq_close(r->c);
	for (int t = 0; t < NT; t++) {
		free(r->param[t]);
		free(r->grad[t]);
	}
	memset(r, 0, sizeof(*r));
}

/* Micro-batch mb of tensor t at step k, the same for every rank (DDP's
 * averaged gradient). */
static void fill_grad(struct rank *r, int t, uint64_t k, int mb)
{
	struct aoqt_rng rng = aoqt_rng_for(k, (uint64_t)t, (uint64_t)mb);
	double scale = mb ? 0.3 : 1.0;
	for (uint64_t i = 0; i < desc[t].n; i++)
		aoqt_store(r->grad[t], i, desc[t].gd, scale * aoqt_uniform(&rng));
}

/* Step k's gradients pushed on every rank in ranks[0..n) and StepEnd. */
static void push_step(struct rank *ranks, uint32_t n, uint64_t k, int ntensors)
{
	int nmb = k % 2 == 0 ? 2 : 1;
	for (uint32_t q = 0; q < n; q++)
		for (uint32_t g = 0; g < 2; g++) {
			struct aoq_group h = hp_at(g, k);
			CHECK_OK(aoq_set_hyperparams(ranks[q].c, g, &h));
		}
	for (int mb = 0; mb < nmb; mb++)
		for (int t = ntensors - 1; t >= 0; t--)
			for (uint32_t q = 0; q < n; q++) {
				fill_grad(&ranks[q], t, k, mb);
				CHECK_OK(aoq_push_grad(ranks[q].c, (uint32_t)t, mb + 1 < nmb ? AOQ_PUSH_ACCUMULATE : 0, NULL));
				CHECK_OK(aoq_grad_copied(ranks[q].c, (uint32_t)t));
			}
}

static float *init_vals[NT];

/* The last half of step k's tensors (backward order) pushed by one rank; a
 * forked child's, so errors are returned, not checked. */
static int push_half(struct rank *me, uint64_t k)
{
	for (int t = NT - 1; t >= NT / 2; t--) {
		fill_grad(me, t, k, 0);
		if (aoq_push_grad(me->c, (uint32_t)t, 0, NULL) < 0 || aoq_grad_copied(me->c, (uint32_t)t) < 0)
			return -1;
	}
	return 0;
}

/* Masters and moments read through rank r (all of them: reads are not
 * sliced) equal the single session ref's, bit for bit. */
static void same_state(const struct rank *r, const struct rank *ref, const char *what)
{
	for (int t = 0; t < NT; t++)
		for (int k = AOQ_MASTER; k <= AOQ_EXP_AVG_SQ; k++) {
			float *a = aoqt_xmalloc(desc[t].n * 4), *b = aoqt_xmalloc(desc[t].n * 4);
			CHECK_OK(aoq_read_state(r->c, (uint32_t)t, k, AOQ_FP32, 0, desc[t].n, a));
			CHECK_OK(aoq_read_state(ref->c, (uint32_t)t, k, AOQ_FP32, 0, desc[t].n, b));
			CHECK(memcmp(a, b, desc[t].n * 4) == 0, "%s: tensor %d state %d differs from the single session's",
			      what, t, k);
			free(a);
			free(b);
		}
}

static const Aoq__SessionStats *find_row(const Aoq__Stats *st, const char *job, uint32_t rank)
{
	for (size_t i = 0; i < st->n_sessions; i++)
		if (strcmp(st->sessions[i]->job, job) == 0 && st->sessions[i]->rank == rank)
			return st->sessions[i];
	return NULL;
}

static void test_bitexact(const struct aoqt_daemon *d, uint32_t world)
{
	char job[48], rjob[48];
	snprintf(job, sizeof(job), "group%u-%d-%d", world, (int)prec, (int)getpid());
	snprintf(rjob, sizeof(rjob), "single%u-%d-%d", world, (int)prec, (int)getpid());
	struct rank ref, ranks[3];
	CHECK_OK(open_rank(&ref, d->socket, rjob, 0, 0, desc, init_vals));
	for (uint32_t q = 0; q < world; q++)
		CHECK_OK(open_rank(&ranks[q], d->socket, job, world, q, desc, init_vals));
	for (uint64_t k = 1; k <= NSTEPS; k++) {
		push_step(&ref, 1, k, NT);
		push_step(ranks, world, k, NT);
		struct aoq_step_result res = AOQ_STEP_RESULT_INIT, rres = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_step_end(ref.c));
		for (uint32_t q = 0; q < world; q++)
			CHECK_OK(aoq_step_end(ranks[q].c));
		CHECK_OK(aoq_sync(ref.c, &rres));
		for (uint32_t q = 0; q < world; q++) {
			CHECK_OK(aoq_sync(ranks[q].c, &res));
			CHECK(res.step == k && res.tensors_updated == rres.tensors_updated &&
			      fabs(res.grad_sumsq - rres.grad_sumsq) <= 1e-12 * rres.grad_sumsq, /* summed in another order */
			      "world %u rank %u step %" PRIu64 ": StepEnded step %" PRIu64 " tensors %" PRIu64 " sumsq %.17g, "
			      "the single session's %" PRIu64 " %.17g", world, q, k, res.step, res.tensors_updated,
			      res.grad_sumsq, rres.tensors_updated, rres.grad_sumsq);
			for (int t = 0; t < NT; t++)
				for (uint64_t i = 0; i < desc[t].n; i++)
					CHECK(aoqt_bits(ranks[q].param[t], i, desc[t].pd) == aoqt_bits(ref.param[t], i, desc[t].pd),
					      "world %u rank %u step %" PRIu64 " tensor %d element %" PRIu64 ": %.9g, the single "
					      "session's %.9g", world, q, k, t, i, aoqt_load(ranks[q].param[t], i, desc[t].pd),
					      aoqt_load(ref.param[t], i, desc[t].pd));
		}
	}
	/* The masters and moments, read from the last rank (all of them:
	 * reads are not sliced). */
	same_state(&ranks[world - 1], &ref, world == 2 ? "world 2" : "world 3");
	/* No member gives the group's one state away (ReleaseTensors), and
	 * the refusal ends nothing (the rows below) */
	const uint32_t t0 = 0;
	int e = aoq_release_tensors(ranks[0].c, &t0, 1, NULL);
	CHECK(e < 0 && strstr(aoq_last_error(), "replica group"), "world %u: ReleaseTensors in a group: %d %s", world, e,
	      aoq_last_error());
	/* Host memory of one replica. */
	Aoq__Envelope *env = NULL;
	CHECK_OK(aoqt_stats(d->socket, &env));
	const Aoq__SessionStats *r0 = find_row(env->stats, rjob, 0);
	CHECK(r0 && r0->state_bytes > 0, "no stats row for the single session");
	uint64_t sum = 0, arena = 0;
	unsigned owners = 0;
	for (uint32_t q = 0; q < world; q++) {
		const Aoq__SessionStats *x = find_row(env->stats, job, q);
		CHECK(x && x->local_world == world && x->local_rank == q, "world %u rank %u: no group row", world, q);
		sum += x->state_bytes;
		arena += x->arena_bytes;
		owners += x->group_owner;
		CHECK(x->steps == NSTEPS, "world %u rank %u: %" PRIu64 " steps", world, q, x->steps);
	}
	CHECK(sum == r0->state_bytes && owners == 1, "world %u: the group holds %" PRIu64 " bytes of state over %u owner "
	      "rows, one replica is %" PRIu64, world, sum, owners, r0->state_bytes);
	CHECK(arena > 0, "world %u: no arena reported", world);
	printf("world %u%s: %u ranks bit-exact with one session over %d steps; state %" PRIu64 " bytes (one replica), "
	       "arena %" PRIu64 " bytes (single: %" PRIu64 ")\n", world,
	       prec == AOQ_STATE_BF16_Q8 ? ", bf16 master + q8 (masters shared)" : "", world, NSTEPS, sum, arena,
	       r0->arena_bytes);
	aoq_envelope_free(env);
	close_rank(&ref);
	for (uint32_t q = 0; q < world; q++)
		close_rank(&ranks[q]);
}

/* Clipping: the norm is summed over every rank's slice.  The sum's order
 * differs from a lone session's, so the ranks are compared with each other
 * bit for bit and with the lone session within rounding. */
static void test_clip(const struct aoqt_daemon *d)
{
	char job[48], rjob[48];
	snprintf(job, sizeof(job), "clip-%d", (int)getpid());
	snprintf(rjob, sizeof(rjob), "clipref-%d", (int)getpid());
	clip = 5.0;
	struct rank ref, ranks[2];
	CHECK_OK(open_rank(&ref, d->socket, rjob, 0, 0, desc, init_vals));
	for (uint32_t q = 0; q < 2; q++)
		CHECK_OK(open_rank(&ranks[q], d->socket, job, 2, q, desc, init_vals));
	clip = 0;
	for (uint64_t k = 1; k <= 3; k++) {
		push_step(&ref, 1, k, NT);
		push_step(ranks, 2, k, NT);
		struct aoq_step_result res[2] = { AOQ_STEP_RESULT_INIT, AOQ_STEP_RESULT_INIT }, rres = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_step_end(ref.c));
		for (uint32_t q = 0; q < 2; q++)
			CHECK_OK(aoq_step_end(ranks[q].c));
		CHECK_OK(aoq_sync(ref.c, &rres));
		for (uint32_t q = 0; q < 2; q++)
			CHECK_OK(aoq_sync(ranks[q].c, &res[q]));
		CHECK(rres.clip_scale < 0.1 && res[0].clip_scale == res[1].clip_scale &&
		      fabs(res[0].clip_scale - rres.clip_scale) <= 1e-9 * rres.clip_scale,
		      "step %" PRIu64 ": clip scale %.17g / %.17g, the lone session's %.17g", k, res[0].clip_scale,
		      res[1].clip_scale, rres.clip_scale);
		for (int t = 0; t < NT; t++)
			for (uint64_t i = 0; i < desc[t].n; i++) {
				CHECK(aoqt_bits(ranks[0].param[t], i, desc[t].pd) == aoqt_bits(ranks[1].param[t], i, desc[t].pd),
				      "clip step %" PRIu64 " tensor %d element %" PRIu64 ": the ranks differ", k, t, i);
				double a = aoqt_load(ranks[0].param[t], i, desc[t].pd), b = aoqt_load(ref.param[t], i, desc[t].pd);
				double tol = desc[t].pd == AOQ_FP32 ? 1e-6 : desc[t].pd == AOQ_BF16 ? 1e-2 : 2e-3;
				CHECK(fabs(a - b) <= tol * (fabs(b) + 1e-3), "clip step %" PRIu64 " tensor %d element %" PRIu64
				      ": %.9g, the lone session's %.9g", k, t, i, a, b);
			}
	}
	printf("clip: 2 ranks identical to each other and within rounding of one session\n");
	close_rank(&ref);
	for (uint32_t q = 0; q < 2; q++)
		close_rank(&ranks[q]);
}

static void test_mismatch(const struct aoqt_daemon *d)
{
	char job[48];
	snprintf(job, sizeof(job), "mismatch-%d", (int)getpid());
	struct aoqt_tdesc other[NT];
	memcpy(other, desc, sizeof(other));
	other[3].n += 1;
	struct rank a, b, c;
	CHECK_OK(open_rank(&a, d->socket, job, 2, 0, desc, init_vals));
	int r = open_rank(&b, d->socket, job, 2, 1, other, init_vals);
	CHECK(r == -EINVAL && strstr(aoq_last_error(), "numel 65538 here, 65537 in the group"),
	      "a rank of another layout: %d (%s), want -EINVAL naming the difference", r, aoq_last_error());
	close_rank(&b);
	CHECK_OK(open_rank(&c, d->socket, job, 2, 1, desc, init_vals));
	struct rank both[2] = { a, c };
	push_step(both, 2, 1, NT);
	CHECK_OK(aoq_step_end(a.c));
	CHECK_OK(aoq_step_end(c.c));
	CHECK_OK(aoq_sync(a.c, NULL));
	CHECK_OK(aoq_sync(c.c, NULL));
	close_rank(&a);
	close_rank(&c);
	printf("mismatch: refused with \"%s\"; the group went on\n", "numel 65538 here, 65537 in the group");
}

static bool job_listed(const struct aoqt_daemon *d, const char *job)
{
	Aoq__Envelope *env = NULL;
	CHECK_OK(aoqt_stats(d->socket, &env));
	bool found = false;
	for (size_t i = 0; i < env->stats->n_sessions; i++)
		found |= strcmp(env->stats->sessions[i]->job, job) == 0;
	aoq_envelope_free(env);
	return found;
}

static void test_disconnect(const struct aoqt_daemon *d)
{
	char job[48];
	snprintf(job, sizeof(job), "disconnect-%d", (int)getpid());
	int go[2], back[2];
	CHECK(pipe(go) == 0 && pipe(back) == 0, "pipe");
	pid_t pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		/* Local rank 2: step 1 whole, then half of step 2, then gone. */
		struct rank me;
		if (open_rank(&me, d->socket, job, 3, 2, desc, init_vals) < 0)
			_exit(2);
		for (int t = NT - 1; t >= 0; t--) {
			fill_grad(&me, t, 1, 0);
			if (aoq_push_grad(me.c, (uint32_t)t, 0, NULL) < 0 || aoq_grad_copied(me.c, (uint32_t)t) < 0)
				_exit(3);
		}
		if (aoq_step_end(me.c) < 0 || aoq_sync(me.c, NULL) < 0)
			_exit(4);
		if (push_half(&me, 2) < 0)
			_exit(5);
		char x = 1;
		if (write(go[1], &x, 1) != 1 || read(back[0], &x, 1) != 1)
			_exit(6);
		_exit(0); /* no Bye, no close: the kernel closes the sockets */
	}
	close(go[1]);
	close(back[0]);
	struct rank ranks[2];
	for (uint32_t q = 0; q < 2; q++)
		CHECK_OK(open_rank(&ranks[q], d->socket, job, 3, q, desc, init_vals));
	push_step(ranks, 2, 1, NT);
	for (uint32_t q = 0; q < 2; q++)
		CHECK_OK(aoq_step_end(ranks[q].c));
	for (uint32_t q = 0; q < 2; q++)
		CHECK_OK(aoq_sync(ranks[q].c, NULL));
	char x = 1;
	CHECK(read(go[0], &x, 1) == 1, "the child rank did not reach step 2");
	CHECK(write(back[1], &x, 1) == 1, "pipe");
	int status;
	CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "child rank: status %d", status);
	double t0 = aoqt_now();
	/* The two live ranks push step 2 and wait: the step cannot complete. */
	int pushed_err = 0;
	for (int t = NT - 1; t >= 0 && !pushed_err; t--)
		for (uint32_t q = 0; q < 2 && !pushed_err; q++) {
			fill_grad(&ranks[q], t, 2, 0);
			int r = aoq_push_grad(ranks[q].c, (uint32_t)t, 0, NULL);
			if (r < 0)
				pushed_err = r;
		}
	for (uint32_t q = 0; q < 2; q++) {
		int r = aoq_step_end(ranks[q].c);
		if (r == 0)
			r = aoq_sync(ranks[q].c, NULL);
		double secs = aoqt_now() - t0;
		/* libaoq reports the daemon's PEER_LOST; when the session
		 * broke while this thread held the connection without reading
		 * it, the bare "closed" comes first: the log says why. */
		char *log = aoqt_daemon_log((struct aoqt_daemon *)d);
		bool logged = log && strstr(log, "PEER_LOST: local rank 2");
		free(log);
		CHECK(r == -ECONNABORTED || (r < 0 && strstr(aoq_last_error(), "PEER_LOST")) || (r == -ECONNRESET && logged),
		      "rank %u after local rank 2 died: %d (%s), want -ECONNABORTED (PEER_LOST)", q, r, aoq_last_error());
		CHECK(secs < 10, "rank %u learned of the lost rank after %.1f s", q, secs);
		printf("disconnect: rank %u: %s after %.3f s\n", q, aoq_last_error(), secs);
	}
	for (uint32_t q = 0; q < 2; q++)
		close_rank(&ranks[q]);
	/* The group and its state are gone: nothing of the interrupted step
	 * stays (no lease for a group). */
	double t1 = aoqt_now();
	while (job_listed(d, job) && aoqt_now() - t1 < 10)
		usleep(10000);
	CHECK(!job_listed(d, job), "the broken group's sessions are still listed");
	close(go[0]);
	close(back[1]);
}

/* Every rank's parameters equal ref's, bit for bit. */
static void check_params(const struct rank *ranks, uint32_t n, const struct rank *ref, const char *what, uint64_t k)
{
	for (uint32_t q = 0; q < n; q++)
		for (int t = 0; t < NT; t++)
			for (uint64_t i = 0; i < desc[t].n; i++)
				CHECK(aoqt_bits(ranks[q].param[t], i, desc[t].pd) == aoqt_bits(ref->param[t], i, desc[t].pd),
				      "%s: rank %u step %" PRIu64 " tensor %d element %" PRIu64 ": %.9g, the single session's %.9g",
				      what, q, k, t, i, aoqt_load(ranks[q].param[t], i, desc[t].pd),
				      aoqt_load(ref->param[t], i, desc[t].pd));
}

/* The leased row of job's group state, if listed. */
static bool group_leased(const struct aoqt_daemon *d, const char *job, uint64_t *last_step, uint32_t *world)
{
	Aoq__Envelope *env = NULL;
	CHECK_OK(aoqt_stats(d->socket, &env));
	const Aoq__SessionStats *x = find_row(env->stats, job, UINT32_MAX);
	bool leased = x && strcmp(x->state, "leased") == 0;
	if (leased) {
		*last_step = x->last_step;
		*world = x->local_world;
	}
	aoq_envelope_free(env);
	return leased;
}

static void test_lease(const struct aoqt_daemon *d)
{
	char job[48], rjob[48];
	snprintf(job, sizeof(job), "lease-%d", (int)getpid());
	snprintf(rjob, sizeof(rjob), "lease-ref-%d", (int)getpid());
	lease_secs = 60;
	int go[2], back[2];
	CHECK(pipe(go) == 0 && pipe(back) == 0, "pipe");
	pid_t pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		/* Local rank 1: steps 1 and 2, half of step 3, then gone. */
		struct rank me;
		if (open_rank(&me, d->socket, job, 2, 1, desc, init_vals) < 0)
			_exit(2);
		for (uint64_t k = 1; k <= 2; k++) {
			push_step(&me, 1, k, NT);
			if (aoq_step_end(me.c) < 0 || aoq_sync(me.c, NULL) < 0)
				_exit(3);
		}
		if (push_half(&me, 3) < 0)
			_exit(5);
		char x = 1;
		if (write(go[1], &x, 1) != 1 || read(back[0], &x, 1) != 1)
			_exit(6);
		_exit(0); /* no Bye: the trainer is gone */
	}
	close(go[1]);
	close(back[0]);
	struct rank ref, r0;
	CHECK_OK(open_rank(&ref, d->socket, rjob, 0, 0, desc, init_vals));
	CHECK_OK(open_rank(&r0, d->socket, job, 2, 0, desc, init_vals));
	for (uint64_t k = 1; k <= 2; k++) {
		push_step(&ref, 1, k, NT);
		push_step(&r0, 1, k, NT);
		CHECK_OK(aoq_step_end(ref.c));
		CHECK_OK(aoq_step_end(r0.c));
		CHECK_OK(aoq_sync(ref.c, NULL));
		CHECK_OK(aoq_sync(r0.c, NULL));
	}
	check_params(&r0, 1, &ref, "before the loss", 2);
	char x = 1;
	CHECK(read(go[0], &x, 1) == 1, "the child rank did not reach step 3");
	/* Rank 0 is in step 3 too (a push of the child's half), then the
	 * child goes. */
	fill_grad(&r0, NT - 1, 3, 0);
	CHECK_OK(aoq_push_grad(r0.c, NT - 1, 0, NULL));
	CHECK(write(back[1], &x, 1) == 1, "pipe");
	int status;
	CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "child rank: status %d", status);
	int r = aoq_step_end(r0.c);
	if (r == 0)
		r = aoq_sync(r0.c, NULL);
	CHECK(r < 0, "rank 0's step 3 completed without rank 1");
	close_rank(&r0);
	double t0 = aoqt_now();
	uint64_t last = 0;
	uint32_t world = 0;
	while (!group_leased(d, job, &last, &world) && aoqt_now() - t0 < 10)
		usleep(10000);
	CHECK(group_leased(d, job, &last, &world), "the group's state is not listed as leased");
	CHECK(last == 2 && world == 2, "the leased group: last step %" PRIu64 ", local world %u (want 2, 2)", last, world);

	/* Another local world cannot resume it, and the lease stays. */
	struct rank bad;
	r = open_rank(&bad, d->socket, job, 3, 0, desc, init_vals);
	CHECK(r == -EINVAL && strstr(aoq_last_error(), "local ranks"), "a group of 3 resuming one of 2: %d (%s)", r,
	      aoq_last_error());
	close_rank(&bad);
	CHECK(group_leased(d, job, &last, &world), "the lease went with a refused resume");

	/* A new group of 2 resumes at step 2. */
	struct rank g[2];
	for (uint32_t q = 0; q < 2; q++) {
		CHECK_OK(open_rank(&g[q], d->socket, job, 2, q, desc, init_vals));
		uint64_t at = 0;
		CHECK(aoq_resumed(g[q].c, &at) == 1 && at == 2, "rank %u: resumed %d at %" PRIu64 " (want step 2)", q,
		      aoq_resumed(g[q].c, NULL), at);
	}
	CHECK(!group_leased(d, job, &last, &world), "the lease is still listed after the resume");
	check_params(g, 2, &ref, "resumed", 2);
	for (uint64_t k = 3; k <= NSTEPS; k++) {
		push_step(&ref, 1, k, NT);
		push_step(g, 2, k, NT);
		CHECK_OK(aoq_step_end(ref.c));
		for (uint32_t q = 0; q < 2; q++)
			CHECK_OK(aoq_step_end(g[q].c));
		CHECK_OK(aoq_sync(ref.c, NULL));
		for (uint32_t q = 0; q < 2; q++)
			CHECK_OK(aoq_sync(g[q].c, NULL));
		check_params(g, 2, &ref, "after the resume", k);
	}
	same_state(&g[1], &ref, "lease");
	printf("lease: rank 1 lost in step 3, the group's state leased at step %" PRIu64 ", resumed by a new group, "
	       "bit-exact with one session to step %d\n", last, NSTEPS);
	close_rank(&ref);
	for (uint32_t q = 0; q < 2; q++)
		close_rank(&g[q]);
	close(go[0]);
	close(back[1]);
	lease_secs = AOQ_LEASE_NONE;
}

/* Copies of every tensor's parameter. */
static void save_params(const struct rank *r, void **out)
{
	for (int t = 0; t < NT; t++) {
		size_t n = desc[t].n * aoqt_dtype_size(desc[t].pd);
		out[t] = aoqt_xmalloc(n);
		memcpy(out[t], r->param[t], n);
	}
}

static void check_saved(const struct rank *ranks, uint32_t n, void *const *want, const char *what)
{
	struct rank ref = { 0 };
	for (int t = 0; t < NT; t++)
		ref.param[t] = want[t];
	check_params(ranks, n, &ref, what, 0);
}

/* One session's parameters after steps 3 and NSTEPS, in at3 and at5
 * (allocated here). */
static void reference_run(const char *sock, const char *job, void **at3, void **at5)
{
	struct rank ref;
	CHECK_OK(open_rank(&ref, sock, job, 0, 0, desc, init_vals));
	for (uint64_t k = 1; k <= NSTEPS; k++) {
		push_step(&ref, 1, k, NT);
		CHECK_OK(aoq_step_end(ref.c));
		CHECK_OK(aoq_sync(ref.c, NULL));
		if (k == 3)
			save_params(&ref, at3);
	}
	save_params(&ref, at5);
	close_rank(&ref);
}

/* Steps from to `to` of a group of 2, each ended and synced. */
static void group_steps(struct rank *g, uint64_t from, uint64_t to)
{
	for (uint64_t k = from; k <= to; k++) {
		push_step(g, 2, k, NT);
		for (uint32_t q = 0; q < 2; q++)
			CHECK_OK(aoq_step_end(g[q].c));
		for (uint32_t q = 0; q < 2; q++)
			CHECK_OK(aoq_sync(g[q].c, NULL));
	}
}

/* Half of step k of a group of 2: the last tensors pushed by both. */
static void group_half_step(struct rank *g, uint64_t k)
{
	for (int t = NT - 1; t >= NT / 2; t--)
		for (uint32_t q = 0; q < 2; q++) {
			fill_grad(&g[q], t, k, 0);
			CHECK_OK(aoq_push_grad(g[q].c, (uint32_t)t, 0, NULL));
		}
}

/* The single session's parameters after steps 3 and 5 (job ref_job) into
 * at3 and at5, then a group of 2 of job opened and trained to step 3. */
static void group_start(struct rank *g, const char *sock, const char *job, const char *ref_job, void **at3,
                        void **at5)
{
	reference_run(sock, ref_job, at3, at5);
	for (uint32_t q = 0; q < 2; q++)
		CHECK_OK(open_rank(&g[q], sock, job, 2, q, desc, init_vals));
	group_steps(g, 1, 3);
}

/* A new group of 2 resumes job's state at step 3 (`from`: where the state
 * came back from), equal to the single session's at3, and trains on to
 * step NSTEPS, equal to at5. */
static void group_resume(struct rank *g, const char *sock, const char *job, void *const *at3, void *const *at5,
                         const char *from)
{
	for (uint32_t q = 0; q < 2; q++) {
		CHECK_OK(open_rank(&g[q], sock, job, 2, q, desc, init_vals));
		uint64_t at = 0;
		CHECK(aoq_resumed(g[q].c, &at) == 1 && at == 3, "rank %u: resumed at %" PRIu64 " (want 3)", q, at);
	}
	char what[96];
	snprintf(what, sizeof(what), "resumed from %s", from);
	check_saved(g, 2, at3, what);
	group_steps(g, 4, NSTEPS);
	check_saved(g, 2, at5, "after the restart");
}

static int test_restart(const char *exe)
{
	char sd[] = "/tmp/aoq-groupsnap-XXXXXX";
	CHECK(mkdtemp(sd), "mkdtemp");
	const char *args[] = { "--threads", "2", "--state-dir", sd, NULL };
	struct aoqt_daemon d;
	CHECK_OK(aoqt_daemon_start(&d, exe, args));
	char job[48];
	snprintf(job, sizeof(job), "restart-%d", (int)getpid());
	lease_secs = 60;
	/* The single session's parameters after steps 3 and 5. */
	void *at3[NT], *at5[NT];
	struct rank g[2];
	group_start(g, d.socket, job, "restart-ref", at3, at5);
	check_saved(g, 2, at3, "before the snapshot");
	/* A member's id names the group's state. */
	Aoq__Envelope *env = NULL;
	CHECK_OK(aoqt_stats(d.socket, &env));
	const Aoq__SessionStats *row = find_row(env->stats, job, 1);
	CHECK(row && row->local_world == 2, "no row of local rank 1");
	uint64_t member = row->id;
	aoq_envelope_free(env);
	char path[4096];
	uint64_t step = 0;
	int r = aoqt_snapshot(d.socket, member, path, sizeof(path), &step);
	CHECK(r == 0 && step == 3, "snapshot of the group (member %" PRIu64 "): %d %s, step %" PRIu64, member, r, path,
	      step);
	char want[256];
	snprintf(want, sizeof(want), "/%u-%s-group.safetensors", (unsigned)getuid(), job);
	CHECK(strlen(path) > strlen(want) && strcmp(path + strlen(path) - strlen(want), want) == 0,
	      "the group's snapshot is %s, want ...%s", path, want);
	{
		static _Atomic uint64_t locked;
		struct aoqd_state st;
		struct aoqd_snap_key key;
		char why[512];
		CHECK(aoqd_snapshot_load(path, 0, &locked, &key, &step, &st, why, sizeof(why)) == 0, "load: %s", why);
		CHECK(key.local_world == 2 && key.rank == UINT32_MAX && step == 3 && strcmp(key.job, job) == 0,
		      "the file's key: rank %u local world %u step %" PRIu64 " job %s", key.rank, key.local_world, step,
		      key.job);
		aoqd_state_free(&st, &locked);
	}
	/* Half of step 4, then aoqd dies. */
	group_half_step(g, 4);
	CHECK(kill(d.pid, SIGKILL) == 0, "kill");
	for (uint32_t q = 0; q < 2; q++) {
		r = aoq_step_end(g[q].c);
		if (r == 0)
			r = aoq_sync(g[q].c, NULL);
		CHECK(r < 0, "rank %u: step 4 ended without aoqd", q);
		close_rank(&g[q]);
	}
	aoqt_daemon_stop(&d, 10000, true);

	CHECK_OK(aoqt_daemon_start(&d, exe, args));
	uint64_t last = 0;
	uint32_t world = 0;
	CHECK(group_leased(&d, job, &last, &world) && last == 3 && world == 2,
	      "after the restart: the group's state is not leased at step 3 (%" PRIu64 ", local world %u)", last, world);
	/* aoqctl drop ends the restored group's lease and removes its file
	 * (docs/snapshots.md, "Retention"): a new group starts afresh.  The
	 * file, put back from a link made before the drop, is restored at
	 * the next start. */
	char keep[sizeof(path) + 8];
	snprintf(keep, sizeof(keep), "%s.keep", path);
	CHECK(link(path, keep) == 0, "link %s: %s", path, strerror(errno));
	CHECK_OK(aoqt_stats(d.socket, &env));
	row = find_row(env->stats, job, UINT32_MAX);
	CHECK(row, "no row of the leased group");
	uint64_t leased_id = row->id;
	aoq_envelope_free(env);
	char msg[256] = "";
	CHECK(aoqt_drop(d.socket, leased_id, msg, sizeof(msg)) == 0, "drop of the leased group: %s", msg);
	CHECK(!group_leased(&d, job, &last, &world), "the group is still leased after its drop");
	struct stat kst;
	for (int i = 0; i < 100 && stat(path, &kst) == 0; i++)
		usleep(20000);
	CHECK(stat(path, &kst) < 0 && errno == ENOENT, "the dropped group's snapshot %s stayed", path);
	for (uint32_t q = 0; q < 2; q++) {
		CHECK_OK(open_rank(&g[q], d.socket, job, 2, q, desc, init_vals));
		CHECK(aoq_resumed(g[q].c, NULL) == 0, "rank %u resumed a dropped group", q);
	}
	for (uint32_t q = 0; q < 2; q++)
		close_rank(&g[q]); /* Bye: the new group's state ends (no file) */
	CHECK(rename(keep, path) == 0, "rename %s: %s", keep, strerror(errno));
	CHECK(kill(d.pid, SIGKILL) == 0, "kill");
	aoqt_daemon_stop(&d, 10000, true);
	CHECK_OK(aoqt_daemon_start(&d, exe, args));
	CHECK(group_leased(&d, job, &last, &world) && last == 3 && world == 2,
	      "after the second restart: the group's state is not leased at step 3 (%" PRIu64 ", local world %u)", last,
	      world);
	group_resume(g, d.socket, job, at3, at5, "the snapshot");
	printf("restart: the group's snapshot at step 3 (%s), aoqd killed in step 4 and restarted, a new group resumed "
	       "at step 3, bit-exact with one session at step %d\n", path, NSTEPS);
	/* A snapshot that waits for the group's step to end when the group
	 * ends fails with the cause, as at a session's close.  The first
	 * snapshot of this aoqd prepares the spares; the second, asked in the
	 * middle of a step, waits for its end. */
	CHECK_OK(aoqt_stats(d.socket, &env));
	row = find_row(env->stats, job, 0);
	CHECK(row && row->local_world == 2, "no row of local rank 0");
	member = row->id;
	aoq_envelope_free(env);
	r = aoqt_snapshot(d.socket, member, path, sizeof(path), &step);
	CHECK(r == 0 && step == NSTEPS, "snapshot of the group at step %d: %d %s, step %" PRIu64, NSTEPS, r, path, step);
	for (int t = NT - 1; t >= NT / 2; t--)
		for (uint32_t q = 0; q < 2; q++) {
			fill_grad(&g[q], t, NSTEPS + 1, 0);
			CHECK_OK(aoq_push_grad(g[q].c, (uint32_t)t, 0, NULL));
		}
	int fd = aoqt_snapshot_ask(d.socket, member);
	CHECK(fd >= 0, "snapshot request");
	usleep(100000);
	for (uint32_t q = 0; q < 2; q++)
		close_rank(&g[q]);
	CHECK(aoqt_snapshot_wait(fd, path, sizeof(path), &step) < 0 && strstr(path, "replica group") &&
	      strstr(path, "ended before step"),
	      "a snapshot waiting for the step of a group that ended: %s", path);
	printf("restart: a snapshot asked in step %d, the group gone before its end: %s\n", NSTEPS + 1, path);
	for (int t = 0; t < NT; t++) {
		free(at3[t]);
		free(at5[t]);
	}
	CHECK(aoqt_daemon_stop(&d, 10000, true) == 0, "aoqd did not stop cleanly");
	char cmd[300];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", sd);
	CHECK(system(cmd) == 0, "rm");
	return 0;
}

static void test_hostile(const struct aoqt_daemon *d)
{
	char job[48];
	snprintf(job, sizeof(job), "hostile-%d", (int)getpid());
	/* A libaoq rank of the raw client's layout: one AdamW group, fp32. */
	static const uint64_t numel[2] = { 4096, 1000 };
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = d->socket;
	o.job = job;
	o.local_world = 2;
	o.local_rank = 0;
	o.timeout_ms = 60000;
	struct aoq_client *c;
	CHECK_OK(aoq_connect(&c, &o));
	struct aoq_group g = { .size = sizeof(g), .kind = AOQ_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	CHECK_OK(aoq_add_group(c, &g));
	float *p[2], *gr[2];
	for (int t = 0; t < 2; t++) {
		p[t] = aoqt_xcalloc(numel[t], 4);
		gr[t] = aoqt_xcalloc(numel[t], 4);
		char name[8];
		snprintf(name, sizeof(name), "t%d", t);
		struct aoq_tensor td = { .size = sizeof(td), .name = name, .numel = numel[t], .param_dtype = AOQ_FP32,
		                         .grad_dtype = AOQ_FP32, .param = p[t], .grad = gr[t] };
		CHECK_OK(aoq_add_tensor(c, &td));
	}
	CHECK_OK(aoq_register(c));
	struct aoqt_raw raw;
	CHECK_OK(aoqt_raw_open_group(&raw, d->socket, job, numel, 2, 2, 1));
	uint64_t b, e;
	aoq_slice(numel[0], 2, 1, &b, &e);
	CHECK(b == 2048 && e == 4096, "slice of rank 1: %" PRIu64 "..%" PRIu64, b, e);
	/* Rank 0's elements, posted by rank 1. */
	struct aoq_rec rec = { .tensor = 0, .slot = 0, .offset = 0, .count = 256, .step = 1 };
	CHECK_OK(aoqt_raw_push(&raw, &rec));
	char msg[256];
	int code = aoqt_raw_expect_close(raw.sock, 10000, msg, sizeof(msg));
	CHECK(code == AOQ__ERROR_CODE__BAD_RECORD && strstr(msg, "slice"), "hostile rank: code %d (%s), want BAD_RECORD",
	      code, msg);
	aoqt_raw_close(&raw);
	/* The honest rank's step fails: its group lost a rank. */
	int r = aoq_push_grad(c, 0, 0, NULL);
	if (r == 0)
		r = aoq_step_end(c);
	if (r == 0)
		r = aoq_sync(c, NULL);
	CHECK(r == -ECONNABORTED, "honest rank after the hostile one failed: %d (%s)", r, aoq_last_error());
	aoq_close(c);
	for (int t = 0; t < 2; t++) {
		free(p[t]);
		free(gr[t]);
	}
	printf("hostile: \"%s\"\n", msg);
}

#ifdef AOQT_SUPERVISOR
static int test_fdstore(const char *exe, bool term)
{
	struct sup s;
	sup_init(&s, false, NULL);
	sup_start(&s, exe, NULL, NULL, 0);
	lease_secs = 60;
	prec = AOQ_STATE_BF16_Q8;
	char job[48];
	snprintf(job, sizeof(job), "fdstore-%d", (int)getpid());
	void *at3[NT], *at5[NT];
	struct rank g[2];
	group_start(g, s.sock, job, "fdstore-ref", at3, at5);
	/* Half of step 4, then aoqd goes. */
	group_half_step(g, 4);
	size_t before = strlen(sup_log(&s));
	sup_kill(&s, term ? SIGTERM : SIGKILL);
	const char *log = sup_log(&s) + before;
	if (term)
		CHECK(strstr(log, "local world 2): state at step 3 kept in the fd store"), "the group was not kept:\n%s",
		      log);
	int states = 0;
	for (int i = 0; i < s.nstored; i++)
		states += strncmp(s.stored_name[i], "aoq-state-", 10) == 0;
	CHECK(states == 1 && s.nstored > 1, "%d states (%d fds) in the store, want the group's and its masters", states,
	      s.nstored);
	for (uint32_t q = 0; q < 2; q++) {
		int r = aoq_step_end(g[q].c);
		if (r == 0)
			r = aoq_sync(g[q].c, NULL);
		CHECK(r < 0, "rank %u: step 4 ended without aoqd", q);
		close_rank(&g[q]);
	}
	before = strlen(sup_log(&s));
	sup_start(&s, exe, NULL, NULL, 0);
	log = sup_log(&s) + before;
	printf("--- the restarted aoqd's log up to READY=1 ---\n%s---\n", log);
	CHECK(strstr(log, "rank 4294967295 taken back from the fd store"), "the group was not taken back:\n%s", log);
	CHECK(term || strstr(log, "journal replayed"), "no journal replayed after SIGKILL:\n%s", log);
	CHECK(!strstr(log, "from its snapshot") && !strstr(log, "refused"), "a snapshot or a refusal:\n%s", log);
	group_resume(g, s.sock, job, at3, at5, "the fd store");
	for (uint32_t q = 0; q < 2; q++)
		close_rank(&g[q]);
	for (int t = 0; t < NT; t++) {
		free(at3[t]);
		free(at5[t]);
	}
	/* the group said Bye: its state and masters left the store */
	sup_kill(&s, SIGTERM);
	CHECK(s.nstored == 0, "%d fds stored after the group said Bye", s.nstored);
	printf("fdstore: a group of 2 %s in step 4 resumed at step 3 from the fd store, bit-exact at step %d\n",
	       term ? "stopped" : "killed", NSTEPS);
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s.dir);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", s.dir);
	return 0;
}
#endif

int main(int argc, char **argv)
{
	aoqt_init("integration-shared");
	const char *exe = aoqt_aoqd_path(argc, argv);
	for (int t = 0; t < NT; t++) {
		init_vals[t] = aoqt_xmalloc(desc[t].n * sizeof(float));
		struct aoqt_rng rng = aoqt_rng_for(0, (uint64_t)t, 7);
		for (uint64_t i = 0; i < desc[t].n; i++)
			init_vals[t][i] = (float)(1.5 * aoqt_uniform(&rng));
	}
	if (argc > 2 && strcmp(argv[2], "restart") == 0)
		return test_restart(exe);
#ifdef AOQT_SUPERVISOR
	if (argc > 3 && strcmp(argv[2], "fdstore") == 0)
		return test_fdstore(exe, strcmp(argv[3], "term") == 0);
#endif
	struct aoqt_daemon d;
	static const char *const args[] = { "--threads", "2", NULL };
	CHECK_OK(aoqt_daemon_start(&d, exe, args));
	test_disconnect(&d); /* first: the children fork before any thread */
	test_lease(&d);
	test_bitexact(&d, 2);
	test_bitexact(&d, 3);
	/* bf16 master + q8: the bf16 tensors' masters are their parameters,
	 * which every rank copies from the group's masters memfd */
	prec = AOQ_STATE_BF16_Q8;
	test_bitexact(&d, 2);
	prec = AOQ_STATE_FP32;
	test_clip(&d);
	test_mismatch(&d);
	test_hostile(&d);
	for (int t = 0; t < NT; t++)
		free(init_vals[t]);
	CHECK(aoqt_daemon_stop(&d, 10000, true) == 0, "aoqd did not stop cleanly");
	return 0;
}
