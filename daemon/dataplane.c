/* SPDX-License-Identifier: MIT */
/*
 * The data plane: ring records -> jobs of chunks on the worker pool ->
 * param records.
 *
 * A record becomes one job, split into chunks that workers run in any
 * order; the worker finishing the last chunk answers the record.  Without
 * clipping or step skipping a job updates at once ("direct").  With them
 * the session is "deferred": a final gradient's job first only sums its
 * squares (phase NORM); when the step's last gradient has landed and its
 * StepEnd has arrived, the loop thread releases the step's jobs to update
 * with the clip factor, or answers them SKIPPED.
 *
 * Threads: aoqd_drain() and aoqd_release_step() run on the loop thread;
 * chunk_run() and job_complete() on workers.  Workers touch a session's
 * state arrays (each chunk its own range), the to-client ring (arena.ring_lock),
 * the per-step sums and deferred lists (steps.lock), stats (stats.lock) and
 * atomics.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "dataplane.h"
#include "log.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"

enum job_phase { PHASE_UPDATE, PHASE_ACCUMULATE, PHASE_NORM };

struct chunk {
	struct aoqd_task task;
	struct aoqd_job *job;
	uint64_t begin, count; /* within the record's range */
	struct aoqk_report rep;
};

struct aoqd_job {
	struct aoqd_job *next;  /* deferred list */
	struct aoqd_session *s;
	struct aoqd_session *origin; /* replica group: the member that pushed it (the hub holds it) */
	struct aoqd_tensor *t;
	struct aoq_rec rec;
	struct aoqk_hparams hp;
	Aoq__OptimizerKind kind; /* the group's: which kernel entry updates */
	enum job_phase phase;
	bool acc_first;  /* first micro-batch of the step: acc starts from zero */
	bool opens_step; /* this record counted the tensor's step (a tensor may come in pieces) */
	bool ends_tensor; /* this record completed the tensor's gradient */
	bool use_acc;
	bool save;       /* undo copy: save the range before it changes (lease) */
	uint64_t arrival; /* the session's record count when it came */
	const uint8_t *grad; /* element rec.offset */
	uint8_t *param;
	uint64_t seed;
	uint64_t t0;
	_Atomic uint64_t started; /* a worker's first start on it (trace) */
	_Atomic uint32_t remaining;
	uint32_t nchunks;
	struct chunk chunks[];
};

static uint64_t thread_cpu_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* One answer into one session's to-client ring (any thread): the worker
 * that finished the job writes the record itself (the ring's producer side
 * is serialised by ring_lock) and rings the client's doorbell only when the
 * client may be asleep: a client thread that polls the ring (aoq-arena.h,
 * consumer_spinning) takes the record without a wake-up. */
static void post_to(struct aoqd_session *s, const struct aoq_rec *out)
{
	pthread_mutex_lock(&s->arena.ring_lock);
	int r = atomic_load(&s->dead) ? 0 : aoq_ring_push(&s->arena.to_client, out);
	if (r == 1 && !aoq_ring_consumer_sleeps(&s->arena.to_client))
		r = 0;
	pthread_mutex_unlock(&s->arena.ring_lock);
	if (r == 1)
		aoqd_arena_ring(&s->arena);
	else if (r < 0) {
		/* Reserved space vanished: the client wrote its tail counter. */
		atomic_store(&s->dead, true);
		uv_async_send(&s->srv->wake);
	}
}

/* Delivers a job's answer to the session's client (and in a replica
 * group to every member). */
static void post_record(struct aoqd_session *s, const struct aoqd_job *j, int32_t status)
{
	struct aoq_rec out = j->rec;
	out.flags = 0;
	out.status = status;
	if (s->rep) {
		/* A replica group: every member copies the whole parameter, so
		 * every member gets each answer; an accumulated micro-batch
		 * concerns only the member that pushed it. */
		for (uint32_t k = 0; k < s->rep->world; k++) {
			struct aoqd_session *m = s->rep->members[k];
			if (m && (status != AOQ_REC_ACCUMULATED || m == j->origin))
				post_to(m, &out);
		}
		return;
	}
	post_to(s, &out);
}

/* Answers the job's record and drops it (any thread). */
static void job_answer(struct aoqd_job *j, int32_t status)
{
	struct aoqd_session *s = j->s;
	unsigned p = j->rec.step & 1;
	post_record(s, j, status);
	pthread_mutex_lock(&s->stats.lock);
	s->stats.bytes_in += j->rec.count * aoqk_dtype_size(j->t->grad_dtype);
	if (status == AOQ_REC_UPDATED) {
		s->stats.bytes_out += j->rec.count * aoqk_dtype_size(j->t->param_dtype);
		s->stats.elements += j->rec.count;
	}
	aoqd_hist_add(&s->stats.rec_hist, aoqd_now_ns() - j->t0);
	uint64_t started = atomic_load(&j->started);
	if (s->stats.trace.on && started >= j->t0) {
		struct aoqd_span sp = { .step = j->rec.step, .start_ns = j->t0, .dur_ns = started - j->t0,
		                        .offset = j->rec.offset, .count = j->rec.count, .tensor = j->rec.tensor,
		                        .kind = AOQD_SPAN_QUEUE_WAIT };
		aoqd_trace_add(&s->stats, &sp);
	}
	pthread_mutex_unlock(&s->stats.lock);
	atomic_fetch_sub(&s->steps.outstanding, 1);
	/* The loop wants to hear of the step's last job only while a StepEnd
	 * waits (steps.h, end_waits; both seq_cst: either it sees inflight
	 * at 0 or we see the flag).  Waking it after every answer cost a small
	 * tensor's round trip about 5 us on a 2-core machine. */
	if (atomic_fetch_sub(&s->steps.inflight[p], 1) == 1 && atomic_load(&s->steps.end_waits))
		uv_async_send(&s->srv->wake);
	free(j);
	s->steps.ops->release(s);
}

static void job_complete(struct aoqd_job *j)
{
	struct aoqd_session *s = j->s;
	double sumsq = 0;
	bool nonfinite = false;
	for (uint32_t i = 0; i < j->nchunks; i++) {
		sumsq += j->chunks[i].rep.sumsq;
		nonfinite |= j->chunks[i].rep.nonfinite;
	}
	unsigned p = j->rec.step & 1;
	if (j->phase == PHASE_NORM) {
		/* Wait for the rest of the step; aoqd_release_step() goes on. */
		pthread_mutex_lock(&s->steps.lock);
		/* A closing session dropped its list already (dead is set
		 * before aoqd_drop_deferred() takes this lock). */
		bool dead = atomic_load(&s->dead);
		if (!dead) {
			s->steps.sumsq[p] += sumsq;
			s->steps.nonfinite[p] |= nonfinite;
			j->next = s->steps.deferred[p];
			s->steps.deferred[p] = j;
		}
		pthread_mutex_unlock(&s->steps.lock);
		if (atomic_fetch_sub(&s->steps.norming[p], 1) == 1)
			uv_async_send(&s->srv->wake);
		if (dead)
			job_answer(j, AOQ_REC_SKIPPED); /* posts nothing: the session is dead */
		return;
	}
	pthread_mutex_lock(&s->steps.lock);
	if (!s->st.defer) {
		s->steps.sumsq[p] += sumsq;
		s->steps.nonfinite[p] |= nonfinite;
	}
	if (j->phase == PHASE_UPDATE && j->ends_tensor)
		s->steps.updated[p]++;
	pthread_mutex_unlock(&s->steps.lock);
	job_answer(j, j->phase == PHASE_ACCUMULATE ? AOQ_REC_ACCUMULATED : AOQ_REC_UPDATED);
}

static void chunk_run(struct aoqd_task *task, unsigned worker)
{
	struct chunk *c = (struct chunk *)task;
	struct aoqd_job *j = c->job;
	struct aoqd_session *s = j->s;
	/* Saved even when the session died: a rollback puts back every range
	 * the open step accepted (state.h, "Lease and resume"). */
	if (j->save && j->phase == PHASE_UPDATE)
		aoqd_state_save_logged(&s->st, j->t, j->rec.offset + c->begin, c->count, j->rec.step);
	else if (j->save)
		aoqd_state_save(j->t, j->rec.offset + c->begin, c->count);
	if (!atomic_load_explicit(&s->dead, memory_order_relaxed)) {
		const struct aoqk_kernel *k = s->srv->kernel;
		struct aoqd_tensor *t = j->t;
		uint64_t begin = j->rec.offset + c->begin;
		const uint8_t *grad = j->grad + c->begin * aoqk_dtype_size(t->grad_dtype);
		float *acc = j->use_acc ? t->acc + begin : NULL;
		uint64_t c0 = thread_cpu_ns(), w0 = aoqd_now_ns();
		uint64_t none = 0;
		atomic_compare_exchange_strong(&j->started, &none, w0);
		switch (j->phase) {
		case PHASE_ACCUMULATE:
			if (j->acc_first)
				memset(t->acc + begin, 0, c->count * sizeof(float));
			k->accumulate(t->acc + begin, grad, t->grad_dtype, 1.0f, c->count);
			break;
		case PHASE_NORM:
			k->sumsq(grad, t->grad_dtype, acc, 1.0f, c->count, &c->rep);
			break;
		case PHASE_UPDATE: {
			/* a snapshot's capture takes the chunk's blocks before
			 * their first update after the boundary (snapshot.h) */
			aoqd_snapshot_guard(&s->st, j->rec.tensor, j->rec.step, begin, c->count);
			struct aoqk_chunk ch = {
				.begin = begin,
				.count = c->count,
				.grad = grad,
				.grad_dtype = t->grad_dtype,
				.acc = acc,
				.param = j->param ? j->param + c->begin * aoqk_dtype_size(t->param_dtype) : NULL,
				.param_dtype = t->param_dtype,
				.seed = j->seed,
			};
			int (*update)(const struct aoqk_hparams *, const struct aoqk_state *, const struct aoqk_chunk *,
			              struct aoqk_report *) =
				j->kind == AOQ__OPTIMIZER_KIND__SGD ? k->sgd : j->kind == AOQ__OPTIMIZER_KIND__LION ? k->lion : k->adam;
			if (update(&j->hp, &t->st, &ch, &c->rep) < 0)
				c->rep.nonfinite = true; /* validated before: cannot happen */
			break;
		}
		}
		uint64_t c1 = thread_cpu_ns(), w1 = aoqd_now_ns();
		pthread_mutex_lock(&s->stats.lock);
		s->stats.cpu_ns += c1 - c0;
		s->stats.chunks++;
		aoqd_hist_add(&s->stats.chunk_hist, w1 - w0);
		if (s->stats.trace.on) {
			struct aoqd_span sp = { .step = j->rec.step, .start_ns = w0, .dur_ns = w1 - w0, .offset = begin,
			                        .count = c->count, .tensor = j->rec.tensor, .kind = AOQD_SPAN_CPU,
			                        .worker = worker };
			aoqd_trace_add(&s->stats, &sp);
		}
		pthread_mutex_unlock(&s->stats.lock);
	}
	if (atomic_fetch_sub_explicit(&j->remaining, 1, memory_order_acq_rel) == 1)
		job_complete(j);
}

/* Elements per chunk: every worker gets a share of a large tensor, chunks
 * stay cache-sized, and a q8 block never straddles two chunks. */
static uint64_t chunk_elems(struct aoqd_session *s, uint64_t count)
{
	uint64_t w = aoqd_pool_threads(s->srv->pool);
	uint64_t c = aoq_align_up((count + w - 1) / w, AOQK_Q8_BLOCK);
	if (c < 16384)
		c = 16384;
	if (c > 262144)
		c = 262144;
	return c;
}

static void job_submit(struct aoqd_job *j)
{
	uint32_t n = j->nchunks;
	atomic_store(&j->remaining, n);
	for (uint32_t i = 0; i < n; i++) {
		j->chunks[i].task.run = chunk_run;
		j->chunks[i].task.cost = j->chunks[i].count; /* the pool's fair share (pool.h) */
		j->chunks[i].task.next = i + 1 < n ? &j->chunks[i + 1].task : NULL;
		j->chunks[i].rep = (struct aoqk_report){ 0 };
	}
	/* Earlier steps first.  Within a step, the newest record first: the
	 * gradients come in backward order, so what is left when backward ends
	 * is done in the next forward's order, first layer first.  With the
	 * delayed update the next user of an update is the next step's push
	 * of the same tensor, in backward order: there, the oldest first. */
	struct aoqd_key key = {
		.hi = j->rec.step,
		.lo = j->s->st.delayed ? j->arrival : UINT64_MAX - j->arrival,
	};
	aoqd_pool_submit(j->s->srv->pool, &j->s->queue, key, &j->chunks[0].task, &j->chunks[n - 1].task, n);
}

/* Validates one record of member m (m == s outside a replica group); a
 * message for the client when it is bad. */
static bool rec_valid(struct aoqd_session *s, const struct aoqd_session *m, const struct aoq_rec *r, char *why,
                      size_t len)
{
	if (r->flags & ~AOQ_REC_FLAGS_KNOWN) {
		snprintf(why, len, "unknown flags 0x%x", r->flags);
		return false;
	}
	if (r->tensor >= s->st.ntensors) {
		snprintf(why, len, "tensor %u of %u", r->tensor, s->st.ntensors);
		return false;
	}
	const struct aoqd_tensor *t = &s->st.tensors[r->tensor];
	if (t->released) {
		snprintf(why, len, "tensor %u: its state was released (ReleaseTensors)", r->tensor);
		return false;
	}
	if (r->count == 0 || !aoq_range_ok(r->offset, r->count, t->numel)) {
		snprintf(why, len, "tensor %u: elements %" PRIu64 "+%" PRIu64 " outside 0..%" PRIu64,
		         r->tensor, r->offset, r->count, t->numel);
		return false;
	}
	if (s->st.window) {
		if (r->slot >= s->arena.nslots || r->count > s->arena.slot_elems) {
			snprintf(why, len, "slot %u (of %u) cannot hold %" PRIu64 " elements", r->slot, s->arena.nslots, r->count);
			return false;
		}
	} else if (r->slot != r->tensor) {
		snprintf(why, len, "tensor %u: slot %u is not its own", r->tensor, r->slot);
		return false;
	}
	if (s->rep) {
		uint64_t b, e;
		aoq_slice(t->numel, s->rep->world, m->local_rank, &b, &e);
		if (r->offset < b || r->offset + r->count > e) {
			snprintf(why, len, "tensor %u: elements %" PRIu64 "+%" PRIu64 " outside local rank %u's slice %" PRIu64
			         "..%" PRIu64 " of the replica group", r->tensor, r->offset, r->count, m->local_rank, b, e);
			return false;
		}
	}
	if (aoqk_precision_blocked((enum aoqk_precision)s->st.precision) &&
	    (r->offset % AOQK_Q8_BLOCK || (r->count % AOQK_Q8_BLOCK && r->offset + r->count != t->numel))) {
		snprintf(why, len, "tensor %u: q8 and q4 state need chunks on %u-element blocks", r->tensor, AOQK_Q8_BLOCK);
		return false;
	}
	/* The client posts every record of a step before its StepEnd, but the
	 * socket can overtake the ring: the ending step's records stay valid
	 * while its StepEnd is pending. */
	if (r->step != s->steps.next_step && !(s->steps.end_pending && r->step == s->steps.ending_step)) {
		snprintf(why, len, "tensor %u: step %" PRIu64 ", the current step is %" PRIu64, r->tensor, r->step, s->steps.next_step);
		return false;
	}
	if (s->st.defer && s->steps.end_pending && r->step == s->steps.ending_step && s->steps.released[r->step & 1]) {
		snprintf(why, len, "tensor %u: gradient of step %" PRIu64 " after its StepEnd", r->tensor, r->step);
		return false;
	}
	return true;
}

/* Turns a valid record into a job of chunks for the pool.  0, or -errno
 * with err filled. */
static int accept_record(struct aoqd_session *s, struct aoqd_session *origin, const struct aoq_rec *r,
                         struct aoqd_error *err)
{
	struct aoqd_tensor *t = &s->st.tensors[r->tensor];
	enum job_phase phase = (r->flags & AOQ_REC_ACCUMULATE) ? PHASE_ACCUMULATE : s->st.defer ? PHASE_NORM : PHASE_UPDATE;
	bool acc_first = false, use_acc = false, opens_step = false, ends_tensor = false;
	if (phase == PHASE_ACCUMULATE) {
		int a = aoqd_state_acc(&s->st, t);
		if (a == -EDQUOT)
			return AOQD_FAIL(err, QUOTA, "tensor %u: the gradient accumulator (%" PRIu64 " bytes) would pass uid "
			                 "%u's quota of %" PRIu64 " bytes", r->tensor, t->numel * 4, (unsigned)s->conn.uid,
			                 aoqd_state_quota(&s->st));
		if (a < 0)
			return AOQD_FAIL(err, NO_MEMORY, "tensor %u: no memory for the gradient accumulator", r->tensor);
		if (t->acc_step != r->step) {
			t->acc_step = r->step;
			acc_first = true;
		}
	} else {
		use_acc = t->acc && t->acc_step == r->step;
		if (t->cur_step != r->step) {
			t->cur_step = r->step;
			t->steps++;
			t->ndone = 0;
			opens_step = true;
		}
		int d = aoqd_tensor_mark_done(t, r->offset, r->count);
		if (d == -EEXIST)
			return AOQD_FAIL(err, BAD_RECORD, "tensor %u: elements %" PRIu64 "+%" PRIu64 " had a final gradient "
			                 "in step %" PRIu64 " already", r->tensor, r->offset, r->count, r->step);
		if (d < 0)
			return AOQD_FAIL(err, NO_MEMORY, "out of memory");
		ends_tensor = d == 1;
	}
	uint64_t ce = chunk_elems(s, r->count);
	uint32_t n = (uint32_t)((r->count + ce - 1) / ce);
	struct aoqd_job *j = calloc(1, sizeof(*j) + (size_t)n * sizeof(struct chunk));
	if (!j)
		return AOQD_FAIL(err, NO_MEMORY, "out of memory");
	j->s = s;
	j->origin = origin;
	j->t = t;
	j->rec = *r;
	j->hp = s->st.groups[t->group].hp;
	j->kind = s->st.groups[t->group].kind;
	j->hp.step = t->steps;
	j->phase = phase;
	j->acc_first = acc_first;
	j->use_acc = use_acc;
	j->opens_step = opens_step;
	j->ends_tensor = ends_tensor;
	j->save = phase != PHASE_ACCUMULATE && s->st.undo;
	if (phase == PHASE_UPDATE && !s->st.undo)
		aoqd_state_journal_dirty(&s->st); /* nothing saved: a kill cannot undo it */
	const struct aoq_arena_slot *sl = &s->arena.slots[s->st.window ? r->slot : r->tensor];
	uint64_t first = s->st.window ? 0 : r->offset;
	uint64_t param_off = sl->param_off;
	if (s->st.delayed && (r->step & 1))
		param_off += aoq_align_up(sl->param_bytes, AOQ_ARENA_ALIGN);
	j->grad = s->arena.base + sl->grad_off + first * aoqk_dtype_size(t->grad_dtype);
	/* A master that is the parameter: the update writes the master alone,
	 * and the client copies it from the masters memfd. */
	j->param = aoqd_tensor_master_param(&s->st, t) ? NULL
	                                               : s->arena.base + param_off + first * aoqk_dtype_size(t->param_dtype);
	/* the session's seed and the tensor's index; the kernel mixes in the
	 * tensor's step: a restored session continues alike */
	j->seed = aoqk_tensor_seed(s->st.seed, r->tensor);
	j->t0 = aoqd_now_ns();
	j->arrival = s->steps.arrivals++;
	j->nchunks = n;
	for (uint32_t i = 0; i < n; i++) {
		struct chunk *c = &j->chunks[i];
		c->job = j;
		c->begin = (uint64_t)i * ce;
		c->count = i + 1 < n ? ce : r->count - c->begin;
	}
	unsigned p = r->step & 1;
	s->steps.ops->hold(s);
	atomic_fetch_add(&s->steps.outstanding, 1);
	atomic_fetch_add(&s->steps.inflight[p], 1);
	if (phase == PHASE_NORM)
		atomic_fetch_add(&s->steps.norming[p], 1);
	s->steps.accepted[p]++;
	aoqd_step_open(s);
	job_submit(j);
	return 0;
}

void aoqd_step_open(struct aoqd_session *s)
{
	if (s->steps.open)
		return;
	s->steps.open = true;
	aoqd_pool_step_open(s->srv->pool);
}

void aoqd_step_close(struct aoqd_session *s)
{
	if (!s->steps.open)
		return;
	aoqd_pool_step_close(s->srv->pool);
	s->steps.open = false;
}

bool aoqd_space_wait(const struct aoqd_session *s)
{
	if (s->steps.space_wait)
		return true;
	for (uint32_t k = 0; s->rep && k < s->rep->world; k++)
		if (s->rep->members[k] && s->rep->members[k]->steps.space_wait)
			return true;
	return false;
}

/* Room in every to-client ring that gets s's answers for one more: 1
 * yes, 0 not now (the producer_waiting flag is set), -1 a corrupt counter. */
static int answer_room(struct aoqd_session *s)
{
	uint64_t need = atomic_load(&s->steps.outstanding);
	uint32_t n = s->rep ? s->rep->world : 1;
	for (uint32_t k = 0; k < n; k++) {
		struct aoqd_session *m = s->rep ? s->rep->members[k] : s;
		if (!m || atomic_load(&m->dead))
			continue;
		pthread_mutex_lock(&m->arena.ring_lock);
		int64_t space = aoq_ring_space(&m->arena.to_client);
		bool room = space > (int64_t)need;
		if (space >= 0 && !room && aoq_ring_wait_space(&m->arena.to_client, need + 1))
			room = true;
		pthread_mutex_unlock(&m->arena.ring_lock);
		if (space < 0)
			return -1;
		if (!room)
			return 0;
	}
	return 1;
}

/*
 * Takes records off the to-daemon ring while they are valid and there is
 * room for their answers.  Stops (without consuming) at a record of the next
 * step until StepEnd arrives, and when the answers could overflow the
 * to-client ring until the client frees space.  A replica group's member
 * (m->hub): its own ring, the hub's state and steps; nothing until every
 * member has joined.
 */
int aoqd_drain(struct aoqd_session *m, struct aoqd_error *err)
{
	char why[256];
	struct aoqd_session *s = m->hub ? m->hub : m;
	m->steps.space_wait = false;
	while (m->state == AOQD_READY && !m->steps.held) {
		if (m->hub && (s->rep->joined < s->rep->world || s->rep->broken))
			return 0; /* a broken group fails the member elsewhere */
		struct aoq_rec rec;
		int r = aoq_ring_peek(&m->arena.to_daemon, &rec);
		if (r < 0)
			return AOQD_FAIL(err, BAD_RECORD, "the to-daemon ring's head counter is corrupt");
		if (r == 0) {
			if (aoq_ring_idle(&m->arena.to_daemon))
				return 0;
			continue;
		}
		if (rec.step == s->steps.next_step + 1 && s->steps.next_step + 1 > s->steps.next_step) {
			m->steps.held = true; /* until StepEnd(next_step) */
			return 0;
		}
		/* With an undo copy one step at a time: the next step's records
		 * wait until the ending step is complete, so that a rollback
		 * has one step to undo (state.h).  Without the delayed update a
		 * trainer's next gradients come after the updates they follow
		 * anyway. */
		if (s->st.undo && s->steps.end_pending && rec.step == s->steps.next_step) {
			m->steps.held = true; /* until the ending step's StepEnded */
			return 0;
		}
		if (!rec_valid(s, m, &rec, why, sizeof(why)))
			return AOQD_FAIL(err, BAD_RECORD, "%s", why);
		if (m->hub && rec.step == s->steps.next_step) {
			/* A step's records are taken once every member has
			 * come to it (posted a record of it or ended it): what a
			 * member does before its first push (loads, tensor
			 * steps, hyperparameters) is in before any update. */
			m->arrived = rec.step;
			for (uint32_t k = 0; k < s->rep->world; k++)
				if (s->rep->members[k]->arrived < rec.step)
					return 0;
		}
		/* Every accepted record is answered: keep room for all of them. */
		int room = answer_room(s);
		if (room < 0)
			return AOQD_FAIL(err, BAD_RECORD, "the to-client ring's tail counter is corrupt");
		if (!room) {
			m->steps.space_wait = true;
			return 0;
		}
		aoq_ring_pop(&m->arena.to_daemon);
		if (aoq_ring_producer_waiting(&m->arena.to_daemon))
			aoqd_arena_ring(&m->arena);
		if ((r = accept_record(s, m->hub ? m : NULL, &rec, err)) < 0)
			return r;
	}
	return 0;
}

/*
 * Deferred sessions: once every gradient of the ending step has landed and
 * its norm is summed, updates start with the clip factor, or the whole step
 * is answered SKIPPED.  Loop thread.  True when the step was released now.
 */
bool aoqd_release_step(struct aoqd_session *s)
{
	unsigned p = s->steps.ending_step & 1;
	if (!s->st.defer || !s->steps.end_pending || s->steps.released[p] || aoqd_space_wait(s) ||
	    atomic_load(&s->steps.norming[p]) != 0)
		return false;
	pthread_mutex_lock(&s->steps.lock);
	struct aoqd_job *list = s->steps.deferred[p];
	s->steps.deferred[p] = NULL;
	double norm = sqrt(s->steps.sumsq[p]);
	bool skip = s->st.skip_nonfinite && s->steps.nonfinite[p];
	pthread_mutex_unlock(&s->steps.lock);
	double scale = 1.0;
	if (s->st.max_grad_norm > 0 && norm > 0) {
		/* torch.nn.utils.clip_grad_norm_: coef = max / (norm + 1e-6), at most 1 */
		double coef = s->st.max_grad_norm / (norm + 1e-6);
		if (coef < 1.0)
			scale = coef;
	}
	s->steps.released[p] = true;
	s->steps.clip_scale[p] = scale;
	s->steps.skipped[p] = skip;
	while (list) {
		struct aoqd_job *j = list;
		list = j->next;
		if (skip) {
			/* Nothing changed: the tensor did not take this step. */
			if (j->opens_step)
				j->t->steps--;
			if (j->t->cur_step == j->rec.step)
				j->t->cur_step = 0; /* nothing of it to roll back */
			job_answer(j, AOQ_REC_SKIPPED);
		} else {
			j->phase = PHASE_UPDATE;
			j->save = false; /* saved in its norm phase; unchanged since */
			j->hp.grad_scale = (float)scale;
			job_submit(j);
		}
	}
	return true;
}

/* Jobs of a closing session that wait in a deferred list: drop them. */
void aoqd_drop_deferred(struct aoqd_session *s)
{
	for (unsigned p = 0; p < 2; p++) {
		pthread_mutex_lock(&s->steps.lock);
		struct aoqd_job *list = s->steps.deferred[p];
		s->steps.deferred[p] = NULL;
		pthread_mutex_unlock(&s->steps.lock);
		while (list) {
			struct aoqd_job *j = list;
			list = j->next;
			atomic_fetch_sub(&s->steps.outstanding, 1);
			atomic_fetch_sub(&s->steps.inflight[p], 1);
			free(j);
			s->steps.ops->release(s);
		}
	}
}
