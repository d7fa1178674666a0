/* SPDX-License-Identifier: MIT */
/*
 * Steps: StepEnd, and its reply once the step's last update is answered.
 * Loop thread.  The StepEnded reply waits while updates run, and the
 * connection reads nothing meanwhile, so replies keep request order.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "dataplane.h"
#include "log.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"
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

/* ---- snapshots ---- */

void aoqd_steps_sample(struct aoqd_session *s)
{
	struct aoqd_steps *st = &s->steps;
	aoqd_snapshot_tick(&s->st, aoqd_steps_idle(st) && st->accepted[st->next_step & 1] == 0);
}

struct snap_req {
	struct aoqd_session *s, *who; /* references */
	uint64_t t0, boundary;
};

/* Loop thread: the snapshot is on disk, or failed. */
static void snap_done(void *arg, int r, const char *path, const char *why)
{
	struct snap_req *q = arg;
	struct aoqd_session *s = q->s, *who = q->who;
	double secs = (double)(aoqd_now_ns() - q->t0) / 1e9;
	if (r == 0 && s->snap_forget && unlink(path) == 0) {
		/* the state ended while its file was written: it goes */
		aoqd_info("snapshot", "session %" PRIu64 ": %s removed (the state ended during its write)", s->id, path);
	} else if (r == 0) {
		s->snap_step = q->boundary;
		s->snap_wall_ns = aoqd_wall_ns();
		aoqd_log(who ? AOQD_LOG_INFO : AOQD_LOG_DEBUG, "snapshot",
		         "session %" PRIu64 ": step %" PRIu64 " written to %s in %.3f s", s->id, q->boundary, path, secs);
	} else {
		aoqd_warn("snapshot", "session %" PRIu64 ": snapshot of step %" PRIu64 " failed: %s", s->id, q->boundary, why);
	}
	if (who && who->state != AOQD_CLOSING) {
		if (r == 0) {
			Aoq__SnapshotDone d = AOQ__SNAPSHOT_DONE__INIT;
			d.session = s->id;
			d.path = (char *)path;
			d.step = q->boundary;
			d.seconds = secs;
			Aoq__Envelope env = AOQ__ENVELOPE__INIT;
			env.msg_case = AOQ__ENVELOPE__MSG_SNAPSHOT_DONE;
			env.snapshot_done = &d;
			aoqd_conn_send(&who->conn, &env);
		} else {
			aoqd_conn_send_error(&who->conn, r == -ENOMEM ? AOQ__ERROR_CODE__NO_MEMORY : AOQ__ERROR_CODE__INTERNAL,
			                     why, false);
		}
	}
	free(q);
	if (who)
		s->steps.ops->release(who);
	s->steps.ops->release(s);
}

/* Where a snapshot asked for now goes: the last step's end when the
 * session is between steps with nothing of the next accepted (ready at
 * once), else the end of the step under way. */
static uint64_t snap_boundary(struct aoqd_session *s, bool *between)
{
	struct aoqd_steps *st = &s->steps;
	*between = aoqd_steps_idle(st) && st->accepted[st->next_step & 1] == 0;
	return *between ? st->next_step - 1 : st->next_step;
}

static int snap_arm(struct snap_req *q, uint64_t boundary, bool ready, struct aoqd_error *err)
{
	struct aoqd_session *s = q->s;
	struct aoqd_snap_key key = { .uid = (uint32_t)s->conn.uid, .rank = s->conn.rank,
		                     .local_world = s->rep ? s->rep->world : 0 };
	snprintf(key.job, sizeof(key.job), "%s", s->conn.job ? s->conn.job : "");
	q->boundary = boundary;
	int r = aoqd_snapshot_arm(s->srv->snapshotter, &s->st, &key, s->srv->cfg.state_dir, boundary, ready, snap_done,
	                          q, err);
	if (r == 0)
		aoqd_debug("snapshot", "session %" PRIu64 ": snapshot armed at step %" PRIu64 "%s", s->id, boundary,
		           ready ? " (now)" : "");
	return r;
}

/* Loop thread: the spares for the first undo swap are ready (or not): the
 * snapshot is armed where the session is now, a later step than asked when
 * training went on meanwhile. */
static void snap_prepared(void *arg, int r, const char *why)
{
	struct snap_req *q = arg;
	struct aoqd_session *s = q->s;
	struct aoqd_error err = { 0 };
	if (r == 0 && s->state != AOQD_READY)
		r = AOQD_REFUSE(&err, INTERNAL, "session %" PRIu64 " closed before its snapshot began", s->id);
	else if (r < 0)
		snprintf(err.msg, sizeof(err.msg), "snapshot not taken: %s", why);
	if (r == 0) {
		bool between;
		uint64_t b = snap_boundary(s, &between);
		r = snap_arm(q, b, between, &err);
	}
	if (r < 0)
		snap_done(q, r, "", err.msg); /* frees q */
}

static int snapshot_at(struct aoqd_session *s, struct aoqd_session *who, uint64_t boundary, bool ready,
                       struct aoqd_error *err)
{
	if (!s->srv->cfg.state_dir || !*s->srv->cfg.state_dir)
		return AOQD_REFUSE(err, INVALID, "snapshots are off (no state_dir)");
	struct snap_req *q = calloc(1, sizeof(*q));
	if (!q)
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	q->s = s;
	q->who = who;
	q->t0 = aoqd_now_ns();
	q->boundary = boundary;
	s->steps.ops->hold(s);
	if (who)
		s->steps.ops->hold(who);
	/* a first undo swap's spares are touched first, in idle time */
	int r = aoqd_snapshot_prepare(s->srv->snapshotter, &s->st, snap_prepared, q);
	if (r == 1) {
		aoqd_debug("snapshot", "session %" PRIu64 ": preparing the undo swap's pages before the snapshot", s->id);
		return 0;
	}
	if (r < 0)
		r = r == -EBUSY ? AOQD_REFUSE(err, BUSY, "a snapshot of this session is being taken")
		                : AOQD_REFUSE(err, NO_MEMORY, "snapshot: %s", strerror(-r));
	else
		r = snap_arm(q, boundary, ready, err);
	if (r < 0) {
		if (who)
			s->steps.ops->release(who);
		s->steps.ops->release(s);
		free(q);
		return r;
	}
	return 0;
}

int aoqd_steps_snapshot(struct aoqd_session *s, struct aoqd_session *who, struct aoqd_error *err)
{
	if (s->st.delayed)
		return AOQD_REFUSE(err, INVALID, "snapshots of a session with the delayed update are not supported");
	if (s->st.nreleased)
		return AOQD_REFUSE(err, INVALID, "session %" PRIu64 " released %u tensors' state to its trainer "
		                   "(ReleaseTensors): a snapshot would not hold them", s->id, s->st.nreleased);
	if (s->hub)
		s = s->hub; /* a replica group's member: the group's state */
	bool between;
	uint64_t boundary = snap_boundary(s, &between);
	return snapshot_at(s, who, boundary, between, err);
}

/* StepEnd of `step` arrived: a periodic snapshot at its end, when one is
 * due (before the next step's records can be taken). */
static void maybe_snapshot(struct aoqd_session *s, uint64_t step)
{
	const struct aoqd_config *cfg = &s->srv->cfg;
	if ((!cfg->snapshot_every_steps && !cfg->snapshot_every_seconds) || s->st.delayed || s->st.nreleased ||
	    aoqd_snapshot_busy(&s->st))
		return;
	uint64_t now = aoqd_now_ns();
	if (!s->snap_mono_ns)
		s->snap_mono_ns = now;
	bool due = (cfg->snapshot_every_steps && step % cfg->snapshot_every_steps == 0) ||
	           (cfg->snapshot_every_seconds && now - s->snap_mono_ns >= cfg->snapshot_every_seconds * 1000000000ull);
	if (!due)
		return;
	s->snap_mono_ns = now;
	struct aoqd_error err;
	if (snapshot_at(s, NULL, step, false, &err) < 0)
		aoqd_warn("snapshot", "session %" PRIu64 ": periodic snapshot not started: %s", s->id, err.msg);
}

/* Sends StepEnded for the ending step if its last job is done. */
static bool finish_step(struct aoqd_session *s)
{
	struct aoqd_steps *st = &s->steps;
	unsigned p = st->ending_step & 1;
	/* Not done while a record of the step may still wait in the ring. */
	if (!st->end_pending || atomic_load(&st->inflight[p]) != 0 || aoqd_space_wait(s) ||
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
	if (!st->accepted[p ^ 1])
		aoqd_step_close(s); /* (records of the next step may be in already) */
	st->end_pending = false;
	atomic_store(&st->end_waits, false);
	s->st.last_step = e.step;
	s->st.dirty = false;
	aoqd_state_journal_boundary(&s->st); /* a kill now keeps this step (fdstore.h) */
	if (!s->st.undo)
		aoqd_state_journal_dirty(&s->st); /* no lease: not kept after a kill either */
	pthread_mutex_lock(&s->stats.lock);
	s->stats.steps_done++;
	pthread_mutex_unlock(&s->stats.lock);
	if (e.nonfinite)
		aoqd_info("session", "session %" PRIu64 ": step %" PRIu64 " had non-finite gradients", s->id, e.step);
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_STEP_ENDED;
	env.step_ended = &e;
	aoqd_snapshot_ready(&s->st, e.step); /* a snapshot armed at this step may be written */
	if (s->rep) {
		/* A replica group's hub: every member's StepEnd is answered. */
		for (uint32_t k = 0; k < s->rep->world; k++) {
			struct aoqd_session *m = s->rep->members[k];
			if (!m || m->state != AOQD_READY || !m->steps.end_pending)
				continue;
			m->steps.end_pending = false;
			pthread_mutex_lock(&m->stats.lock);
			m->stats.steps_done++;
			pthread_mutex_unlock(&m->stats.lock);
			aoqd_conn_send(&m->conn, &env);
		}
		return true;
	}
	return aoqd_conn_send(&s->conn, &env) == 0;
}

/* StepEnd of a replica group's member: the group's step ends once every
 * member's StepEnd is in; the loop's next wake then takes the members'
 * records and answers them all (events.c, group_poll). */
static int member_step_end(struct aoqd_session *m, uint64_t step, struct aoqd_error *err)
{
	struct aoqd_session *g = m->hub;
	struct aoqd_replica *rep = g->rep;
	if (rep->broken)
		return AOQD_FAIL(err, PEER_LOST, "%s", rep->why);
	if (step != g->steps.next_step)
		return AOQD_FAIL(err, PROTOCOL, "StepEnd for step %" PRIu64 ", the replica group's current step is %" PRIu64,
		                 step, g->steps.next_step);
	m->steps.ending_step = step;
	m->steps.end_pending = true;
	m->arrived = step;
	if (++rep->ends == rep->world) {
		rep->ends = 0;
		maybe_snapshot(g, step);
		g->steps.ending_step = step;
		g->steps.end_pending = true;
		/* the hub's last job wakes the loop (dataplane.c, job_answer) */
		atomic_store(&g->steps.end_waits, true);
		g->steps.next_step++;
		for (uint32_t k = 0; k < rep->world; k++)
			if (rep->members[k])
				rep->members[k]->steps.held = false;
		uv_async_send(&g->srv->wake);
	}
	return AOQD_DEFERRED;
}

int aoqd_on_step_end(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__StepEnd *m = env->step_end;
	struct aoqd_steps *st = &s->steps;
	if (s->hub)
		return member_step_end(s, m->step, err);
	if (m->step != st->next_step)
		return AOQD_FAIL(err, PROTOCOL, "StepEnd for step %" PRIu64 ", the current step is %" PRIu64,
		                 m->step, st->next_step);
	maybe_snapshot(s, m->step);
	st->ending_step = m->step;
	st->end_pending = true;
	atomic_store(&st->end_waits, true); /* before finish_step() reads inflight */
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
	if (s->hub)
		return 0; /* a replica group's member: events.c polls its hub */
	/* A replica group's hub has no ring of its own: events.c drains its
	 * members first. */
	if (!s->rep && (doorbell || st->space_wait)) {
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
	if (st->held && !s->rep) {
		/* the next step's records waited for this one (undo copy) */
		st->held = false;
		int r = aoqd_drain(s, err);
		if (r < 0)
			return r;
	}
	return 1;
}
