/* SPDX-License-Identifier: MIT */
/*
 * State transfer: LoadState and ReadState move one range of one tensor's
 * state between the arena's transfer area and the state arrays, converting
 * on the way; TensorSteps reads or sets the tensors' step counts;
 * ReleaseTensors lets tensors' state go to the client for good.
 *
 * Transfers run on the worker pool in pieces, not on the loop thread: a
 * request converts up to 4 Mi elements, and a model's worth of them at
 * registration would hold every other session's traffic.  The reply waits,
 * like StepEnd's, and the connection reads nothing meanwhile.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "log.h"
#include "pool.h"
#include "convert.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"
#include "state.h"
#include "transfer.h"

#define XFER_PIECE (1u << 16) /* elements per task; a multiple of the q8 block */

struct xfer_task {
	struct aoqd_task task;
	struct xfer *x;
	uint64_t begin, count;
};

struct xfer {
	struct aoqd_session *s;
	struct aoqd_session *hub; /* a replica group member's (a reference: its state) */
	struct aoqd_tensor *t;
	bool load;
	int what;
	enum aoqk_dtype dtype;
	uint8_t *data;
	uint64_t offset;
	_Atomic uint32_t remaining;
	struct xfer_task tasks[];
};

/* The session whose state and steps a request concerns: a replica group
 * member's hub (docs/design.md, "Replica groups"), else s. */
static struct aoqd_session *owner(struct aoqd_session *s)
{
	return s->hub ? s->hub : s;
}

static int transfer_valid(struct aoqd_session *m, uint32_t tensor, int what, int dtype, uint64_t offset,
                          uint64_t count, uint64_t at, bool load, struct aoqd_error *err)
{
	struct aoqd_session *s = owner(m);
	if (!aoqd_steps_idle(&s->steps))
		return AOQD_REFUSE(err, BUSY, "state transfer while updates are in flight");
	if (load && aoqd_snapshot_capturing(&s->st))
		return AOQD_REFUSE(err, BUSY, "state load while a snapshot copies the state");
	if (tensor < s->st.ntensors && s->st.tensors[tensor].released)
		return AOQD_FAIL(err, INVALID, "state transfer: tensor %u was released (ReleaseTensors)", tensor);
	if (tensor >= s->st.ntensors || !aoqd_dtype_valid(dtype) || what < 0 || what > AOQ__STATE_KIND__PARAM ||
	    (what == AOQ__STATE_KIND__PARAM && !load))
		return AOQD_FAIL(err, INVALID, "state transfer: tensor %u what %d dtype %d", tensor, what, dtype);
	const struct aoqd_tensor *t = &s->st.tensors[tensor];
	if ((what == AOQ__STATE_KIND__EXP_AVG && !t->st.m) || (what == AOQ__STATE_KIND__EXP_AVG_SQ && !t->st.v))
		return AOQD_FAIL(err, INVALID, "state transfer: tensor %u (group %u, %s) has no %s", tensor, t->group,
		                 protobuf_c_enum_descriptor_get_value(&aoq__optimizer_kind__descriptor,
		                                                      s->st.groups[t->group].kind)->name,
		                 what == AOQ__STATE_KIND__EXP_AVG ? "exp_avg (SGD without momentum keeps no buffer)"
		                                                  : "exp_avg_sq (SGD and Lion keep one moment, exp_avg)");
	uint64_t bytes;
	if (count == 0 || !aoq_range_ok(offset, count, t->numel) ||
	    !aoq_mul_ok(count, aoqk_dtype_size((enum aoqk_dtype)dtype), &bytes) || bytes > m->arena.xfer_bytes)
		return AOQD_FAIL(err, INVALID, "state transfer: tensor %u elements %" PRIu64 "+%" PRIu64 " (at most %" PRIu64
		                 " bytes per request)", tensor, offset, count, m->arena.xfer_bytes);
	if (at % 64 || at > m->arena.xfer_bytes - bytes)
		return AOQD_FAIL(err, INVALID, "state transfer: %" PRIu64 " bytes at byte %" PRIu64 " of the %" PRIu64
		                 "-byte transfer area (at: a multiple of 64, the bytes within the area)", bytes, at,
		                 m->arena.xfer_bytes);
	if (load && m->hub) {
		/* Each member writes its own slice only: no two members write
		 * the same elements, and a slice changes only by its owner. */
		uint64_t b, e;
		aoq_slice(t->numel, s->rep->world, m->local_rank, &b, &e);
		if (offset < b || offset + count > e)
			return AOQD_FAIL(err, INVALID, "state load: tensor %u elements %" PRIu64 "+%" PRIu64 " outside local "
			                 "rank %u's slice %" PRIu64 "..%" PRIu64 " of the replica group", tensor, offset, count,
			                 m->local_rank, b, e);
	}
	if (load && (what == AOQ__STATE_KIND__EXP_AVG || what == AOQ__STATE_KIND__EXP_AVG_SQ) &&
	    aoqk_precision_blocked((enum aoqk_precision)s->st.precision) &&
	    (offset % AOQK_Q8_BLOCK || (count % AOQK_Q8_BLOCK && offset + count != t->numel)))
		return AOQD_REFUSE(err, INVALID, "q8 and q4 moments load in whole blocks of %u elements", AOQK_Q8_BLOCK);
	return 0;
}

/* The master moves in its own dtype (a bf16 master as bf16, an fp32 one as
 * fp32): a copy, not a conversion through fp32 (the conversion would give
 * the same bits).  A split master (aoqk_state.master_lo, or the 24-bit
 * master's master_lo8) loads bf16 values as its high half with a zero low
 * half, which is what their split is. */
static bool master_as_is(const struct xfer *x)
{
	if (x->what != AOQ__STATE_KIND__MASTER && x->what != AOQ__STATE_KIND__PARAM)
		return false;
	if (aoqd_tensor_lo(x->t))
		return x->load && x->dtype == AOQK_BF16;
	return x->dtype == (aoqk_precision_bf16_master(x->t->st.precision) ? AOQK_BF16 : AOQK_FP32);
}

static void xfer_run(struct aoqd_task *task, unsigned worker)
{
	struct xfer_task *k = (struct xfer_task *)task;
	struct xfer *x = k->x;
	struct aoqd_session *s = x->s;
	size_t dsize = aoqk_dtype_size(x->dtype);
	float buf[4096];
	(void)worker;
	bool as_is = master_as_is(x);
	if (as_is) {
		uint8_t *d = x->data + k->begin * dsize;
		uint8_t *m = (uint8_t *)x->t->st.master + (x->offset + k->begin) * dsize;
		if (x->load)
			memcpy(m, d, k->count * dsize);
		else
			memcpy(d, m, k->count * dsize);
		if (aoqd_tensor_lo(x->t)) {
			unsigned ls = aoqd_tensor_lo_size(x->t);
			memset((uint8_t *)aoqd_tensor_lo(x->t) + (x->offset + k->begin) * ls, 0, k->count * ls);
		}
	}
	for (uint64_t i = 0; !as_is && i < k->count && !atomic_load_explicit(&s->dead, memory_order_relaxed); i += 4096) {
		size_t n = k->count - i < 4096 ? k->count - i : 4096;
		uint8_t *d = x->data + (k->begin + i) * dsize;
		uint64_t e = x->offset + k->begin + i;
		if (x->load) {
			aoqd_to_f32(buf, d, x->dtype, n);
			aoqd_state_io(x->t, x->what, true, buf, e, n);
		} else {
			aoqd_state_io(x->t, x->what, false, buf, e, n);
			aoqd_from_f32(d, x->dtype, buf, n);
		}
	}
	if (atomic_fetch_sub_explicit(&x->remaining, 1, memory_order_acq_rel) == 1) {
		atomic_store(&s->steps.xfer_done, true);
		uv_async_send(&s->srv->wake);
		struct aoqd_session *hub = x->hub;
		free(x);
		if (hub)
			s->steps.ops->release(hub);
		s->steps.ops->release(s);
	}
}

static int start_transfer(struct aoqd_session *s, bool load, uint32_t tensor, int what, int dtype,
                          uint64_t offset, uint64_t count, uint64_t at, struct aoqd_error *err)
{
	struct aoqd_state *st = &owner(s)->st;
	int r = transfer_valid(s, tensor, what, dtype, offset, count, at, load, err);
	if (r < 0)
		return r;
	uint32_t n = (uint32_t)((count + XFER_PIECE - 1) / XFER_PIECE);
	struct xfer *x = calloc(1, sizeof(*x) + (size_t)n * sizeof(struct xfer_task));
	if (!x)
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	x->s = s;
	x->t = &st->tensors[tensor];
	x->load = load;
	x->what = what;
	x->dtype = (enum aoqk_dtype)dtype;
	x->data = s->arena.base + s->arena.xfer_off + at;
	x->offset = offset;
	atomic_init(&x->remaining, n);
	for (uint32_t i = 0; i < n; i++) {
		x->tasks[i].task.run = xfer_run;
		x->tasks[i].task.next = i + 1 < n ? &x->tasks[i + 1].task : NULL;
		x->tasks[i].x = x;
		x->tasks[i].begin = (uint64_t)i * XFER_PIECE;
		x->tasks[i].count = i + 1 < n ? XFER_PIECE : count - x->tasks[i].begin;
		x->tasks[i].task.cost = x->tasks[i].count;
	}
	if (load) {
		st->dirty = true; /* no rollback undoes a load: not leased until the next step ends */
		aoqd_state_journal_dirty(st);
	}
	s->steps.xfer_busy = true;
	s->steps.xfer_count = count;
	atomic_store(&s->steps.xfer_done, false);
	s->steps.ops->hold(s);
	if (s->hub) {
		x->hub = s->hub;
		s->steps.ops->hold(s->hub);
	}
	/* A transfer runs alone (no steps meanwhile): any key will do. */
	aoqd_pool_submit(s->srv->pool, &s->queue, (struct aoqd_key){ 0, 0 }, &x->tasks[0].task,
	                 &x->tasks[n - 1].task, n);
	return AOQD_DEFERRED;
}

int aoqd_on_load_state(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__LoadState *m = env->load_state;
	return start_transfer(s, true, m->tensor, m->what, m->dtype, m->offset, m->count, m->at, err);
}

int aoqd_on_read_state(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__ReadState *m = env->read_state;
	return start_transfer(s, false, m->tensor, m->what, m->dtype, m->offset, m->count, m->at, err);
}

bool aoqd_transfer_poll(struct aoqd_session *s)
{
	if (!s->steps.xfer_busy || !atomic_load(&s->steps.xfer_done))
		return false;
	s->steps.xfer_busy = false;
	aoqd_conn_send_done(&s->conn, s->steps.xfer_count);
	return true;
}

int aoqd_on_tensor_steps(struct aoqd_session *from, const Aoq__Envelope *env, struct aoqd_error *err)
{
	struct aoqd_session *s = owner(from);
	const Aoq__TensorSteps *m = env->tensor_steps;
	uint64_t n = m->set ? m->n_steps : m->count;
	if (!aoq_range_ok(m->first, n, s->st.ntensors) || n > 65536)
		return AOQD_FAIL(err, INVALID, "TensorSteps: tensors %u+%" PRIu64 " of %u", m->first, n, s->st.ntensors);
	if (m->set && !aoqd_steps_idle(&s->steps))
		return AOQD_REFUSE(err, BUSY, "TensorSteps while updates are in flight");
	if (m->set && aoqd_snapshot_capturing(&s->st))
		return AOQD_REFUSE(err, BUSY, "TensorSteps while a snapshot copies the state");
	for (uint64_t i = 0; m->set && i < n; i++)
		if (m->steps[i] > AOQD_MAX_TENSOR_STEPS)
			return AOQD_REFUSE(err, INVALID, "TensorSteps: tensor %" PRIu64 ": %" PRIu64 " steps (at most %" PRIu64
			                   ")", m->first + i, m->steps[i], (uint64_t)AOQD_MAX_TENSOR_STEPS);
	uint64_t *steps = calloc(n ? n : 1, sizeof(uint64_t));
	if (!steps)
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	for (uint64_t i = 0; i < n; i++) {
		struct aoqd_tensor *t = &s->st.tensors[m->first + i];
		if (m->set) {
			t->steps = m->steps[i];
			t->cur_step = 0;
			s->st.dirty = true;
			aoqd_state_journal_dirty(&s->st);
		}
		steps[i] = t->steps;
	}
	Aoq__TensorSteps r = AOQ__TENSOR_STEPS__INIT;
	r.first = m->first;
	r.n_steps = n;
	r.steps = steps;
	r.count = (uint32_t)n;
	Aoq__Envelope reply = AOQ__ENVELOPE__INIT;
	reply.msg_case = AOQ__ENVELOPE__MSG_TENSOR_STEPS;
	reply.tensor_steps = &r;
	aoqd_conn_send(&from->conn, &reply);
	free(steps);
	return AOQD_REPLIED;
}

/* A release's pages freed on a thread of its own: gigabytes of them (7 GB
 * at 3.48 B with the host share) would hold the loop, and every session
 * of the node with it, for a second.  The thread holds the session, so its
 * mappings and memfd stay until it is done.  False: no thread (the caller
 * frees them). */
struct drop_job {
	struct aoqd_session *s;
	struct aoqd_drop d;
};

static void *drop_run(void *arg)
{
	struct drop_job *j = arg;
	aoqd_state_drop(&j->d);
	aoqd_session_unref(j->s);
	free(j);
	return NULL;
}

static bool drop_off_loop(struct aoqd_session *s, struct aoqd_drop *d)
{
	struct drop_job *j = malloc(sizeof(*j));
	if (!j)
		return false;
	j->s = s;
	j->d = *d;
	aoqd_session_ref(s);
	if (aoqd_thread_waited(drop_run, j) != 0) {
		aoqd_session_unref(s);
		free(j);
		return false;
	}
	*d = (struct aoqd_drop)AOQD_DROP_INIT;
	return true;
}

/* ReleaseTensors (proto/aoq.proto): the state of tensors the client steps
 * itself from now on is let go.  Refused where a copy of it must stay: a
 * lease's undo copy and rollback, a replica group's one state, a snapshot
 * on its way; the whole request checked before any tensor goes. */
int aoqd_on_release_tensors(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__ReleaseTensors *m = env->release_tensors;
	struct aoqd_state *st = &s->st;
	if (s->hub || s->rep)
		return AOQD_REFUSE(err, INVALID, "ReleaseTensors in a replica group: its members share one state");
	if (st->undo)
		return AOQD_REFUSE(err, INVALID, "ReleaseTensors in a session with a lease: a resume would need the state "
		                   "(connect with no lease)");
	if (!aoqd_steps_idle(&s->steps))
		return AOQD_REFUSE(err, BUSY, "ReleaseTensors while updates are in flight");
	if (aoqd_snapshot_busy(st))
		return AOQD_REFUSE(err, BUSY, "ReleaseTensors while a snapshot of this session is being taken");
	if (m->n_tensors == 0 || m->n_tensors > st->ntensors)
		return AOQD_FAIL(err, INVALID, "ReleaseTensors: %zu tensors of %u", m->n_tensors, st->ntensors);
	uint8_t *seen = calloc(st->ntensors, 1);
	if (!seen)
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	int r = 0;
	for (size_t i = 0; i < m->n_tensors && r == 0; i++) {
		uint32_t k = m->tensors[i];
		if (k >= st->ntensors)
			r = AOQD_FAIL(err, INVALID, "ReleaseTensors: tensor %u of %u", k, st->ntensors);
		else if (seen[k] || st->tensors[k].released)
			r = AOQD_FAIL(err, INVALID, "ReleaseTensors: tensor %u %s", k,
			              seen[k] ? "named twice" : "was released before");
		else
			seen[k] = 1;
	}
	free(seen);
	if (r < 0)
		return r;
	struct aoqd_release later = AOQD_RELEASE_INIT;
	struct aoqd_drop drop = AOQD_DROP_INIT;
	uint64_t bytes = 0;
	for (size_t i = 0; i < m->n_tensors; i++)
		bytes += aoqd_state_release(st, &st->tensors[m->tensors[i]], &s->srv->locked_bytes, &later, &drop);
	aoqd_release_start(&later);
	bool off = bytes >= AOQD_RELEASE_OFF_LOOP_BYTES && drop_off_loop(s, &drop);
	if (!off)
		aoqd_state_drop(&drop);
	aoqd_info("session", "session %" PRIu64 ": %zu tensors' state (%" PRIu64 " bytes) released to the trainer, %u of "
	          "%u in all%s", s->id, m->n_tensors, bytes, st->nreleased, st->ntensors,
	          off ? "; its pages go on a thread of their own" : "");
	aoqd_conn_send_done(&s->conn, bytes);
	return AOQD_REPLIED;
}
