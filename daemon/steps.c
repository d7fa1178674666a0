/* SPDX-License-Identifier: MIT */
/*
 * Steps: StepEnd, and its reply once the step's last update is answered.
 * Loop thread.  The StepEnded reply waits while updates run, and the
 * connection reads nothing meanwhile, so replies keep request order.
 */
#include <inttypes.h>

#include "dataplane.h"
#include "log.h"
#include "session.h"
#include "steps.h"

void aoqd_steps_init(struct aoqd_steps *st)
{
	st->next_step = 1;
	pthread_mutex_init(&st->lock, NULL);
}

void aoqd_steps_fini(struct aoqd_steps *st)
{
	pthread_mutex_destroy(&st->lock);
}

bool aoqd_steps_idle(struct aoqd_steps *st)
{
	return atomic_load(&st->outstanding) == 0 && !st->end_pending;
}

/* Sends StepEnded for the ending step if its last job is done. */
static bool finish_step(struct aoqd_session *s)
{
	struct aoqd_steps *st = &s->steps;
	unsigned p = st->ending_step & 1;
	/* Not done while a record of the step may still wait in the ring. */
	if (!st->end_pending || atomic_load(&st->inflight[p]) != 0 || st->space_wait ||
	    (s->st.defer && !st->released[p]))
		return false;
	Aoq__StepEnded e = AOQ__STEP_ENDED__INIT;
	pthread_mutex_lock(&st->lock);
	e.step = st->ending_step;
	e.grad_sumsq = st->sumsq[p];
	e.nonfinite = st->nonfinite[p];
	e.tensors_updated = st->updated[p];
	e.skipped = st->skipped[p];
	e.clip_scale = s->st.defer ? st->clip_scale[p] : 1.0;
	st->sumsq[p] = 0;
	st->nonfinite[p] = false;
	st->updated[p] = 0;
	st->released[p] = false;
	st->skipped[p] = false;
	pthread_mutex_unlock(&st->lock);
	st->accepted[p] = 0;
	st->end_pending = false;
	s->st.last_step = e.step;
	s->st.dirty = false;
	pthread_mutex_lock(&s->stats.lock);
	s->stats.steps_done++;
	pthread_mutex_unlock(&s->stats.lock);
	if (e.nonfinite)
		aoqd_info("session", "session %" PRIu64 ": step %" PRIu64 " had non-finite gradients", s->id, e.step);
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_STEP_ENDED;
	env.step_ended = &e;
	return aoqd_conn_send(&s->conn, &env) == 0;
}

int aoqd_on_step_end(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__StepEnd *m = env->step_end;
	struct aoqd_steps *st = &s->steps;
	if (m->step != st->next_step)
		return AOQD_FAIL(err, PROTOCOL, "StepEnd for step %" PRIu64 ", the current step is %" PRIu64,
		                 m->step, st->next_step);
	st->ending_step = m->step;
	st->end_pending = true;
	st->next_step++;
	/* Takes the step's records the ring still holds, then the next step's. */
	st->held = false;
	int r = aoqd_drain(s, err);
	if (r < 0)
		return r;
	aoqd_release_step(s);
	if (finish_step(s) && st->held) {
		/* the next step's records waited for this one (undo copy) */
		st->held = false;
		if ((r = aoqd_drain(s, err)) < 0)
			return r;
	}
	return st->end_pending ? AOQD_DEFERRED : AOQD_REPLIED;
}

int aoqd_steps_poll(struct aoqd_session *s, bool doorbell, struct aoqd_error *err)
{
	struct aoqd_steps *st = &s->steps;
	if (doorbell || st->space_wait) {
		int r = aoqd_drain(s, err);
		if (r < 0)
			return r;
	}
	if (s->state != AOQD_READY || !st->end_pending)
		return 0;
	/* A worker found the to-client ring's counter impossible. */
	if (atomic_load(&s->dead))
		return AOQD_FAIL(err, BAD_RECORD, "the to-client ring's tail counter is corrupt");
	aoqd_release_step(s);
	if (!finish_step(s))
		return 0;
	if (st->held) {
		/* the next step's records waited for this one (undo copy) */
		st->held = false;
		int r = aoqd_drain(s, err);
		if (r < 0)
			return r;
	}
	return 1;
}
