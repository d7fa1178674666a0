/* SPDX-License-Identifier: MIT */
/*
 * A session's end: its close (the connection, the doorbell, its step, its
 * replica group, its trace, its snapshot; a lease when its trainer went
 * away), and the one place where an error fails a session.  Loop thread.
 */
#include <inttypes.h>
#include <string.h>

#include "close.h"
#include "dataplane.h"
#include "lease.h"
#include "log.h"
#include "replica.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"
#include "trace.h"
#include "wire.h"

static void on_handle_closed(uv_handle_t *h)
{
	aoqd_session_unref(h->data);
}

/* Fails every other live member of m's replica group with PEER_LOST. */
static void fail_others(struct aoqd_session *m)
{
	struct aoqd_replica *rep = m->hub->rep;
	for (uint32_t k = 0; k < rep->world; k++) {
		struct aoqd_session *o = rep->members[k];
		if (!o || o == m || (o->state != AOQD_READY && o->state != AOQD_REGISTERING))
			continue;
		struct aoqd_error e;
		AOQD_FAIL(&e, PEER_LOST, "%s", rep->why);
		aoqd_session_fail(o, &e);
	}
}

/* Closes the connection and the doorbell, unlinks the session; the memory
 * goes with the last reference (running jobs hold one). */
void aoqd_session_close(struct aoqd_session *s)
{
	if (s->state == AOQD_LEASED) {
		aoqd_lease_end(s, "server stopping", false);
		return;
	}
	/* observers (aoqctl) come and go every second: their lines are debug */
	bool quiet = s->state == AOQD_OBSERVER ||
	             (s->conn.job && strcmp(s->conn.job, "aoqctl") == 0);
	uint64_t lease = aoqd_lease_for(s);
	if (!lease && s->registered && !s->hub && !s->srv->stopping)
		aoqd_session_forget_snapshot(s); /* the state ends here */
	atomic_store(&s->dead, true);
	s->state = AOQD_CLOSING;
	aoqd_step_close(s); /* an open step will not end */
	if (aoqd_replica_leave(s, s->no_lease ? AOQD_LEAVE_BYE : AOQD_LEAVE_LOST))
		fail_others(s);
	aoqd_replica_close(s); /* a replica group's member */
	aoqd_trace_send(s); /* what was recorded goes out */
	char gone[64];
	snprintf(gone, sizeof(gone), "session %" PRIu64 " closed", s->id);
	aoqd_snapshot_cancel(&s->st, gone);
	aoqd_drop_deferred(s);
	if (aoqd_conn_close(&s->conn))
		s->srv->connections--;
	if (s->counted) {
		s->counted = false;
		s->account->connections--;
	}
	aoqd_session_ref(s);
	if (!aoqd_arena_unwatch(&s->arena, on_handle_closed))
		aoqd_session_unref(s);
	if (lease) {
		/* Stays in the list: the state waits for its trainer. */
		s->state = AOQD_LEASED;
		s->lease_until = aoqd_now_ns() + lease;
		aoqd_session_set_leasing(s, true);
		aoqd_info("session", "session %" PRIu64 " (uid %u job '%s' rank %u): trainer gone; state leased for %" PRIu64
		          " s, resumable at step %" PRIu64, s->id, (unsigned)s->conn.uid, s->conn.job, s->conn.rank,
		          lease / 1000000000u, s->st.last_step + 1);
		aoqd_lease_settle(s);
		return;
	}
	if (aoqd_session_unlink(s)) {
		const char *job = s->conn.job ? s->conn.job : "";
		aoqd_log(quiet ? AOQD_LOG_DEBUG : AOQD_LOG_INFO, "session",
		         "session %" PRIu64 " closed (job '%s' rank %u, %" PRIu64 " steps)",
		         s->id, job, s->conn.rank, s->stats.steps_done);
		aoqd_session_unref(s); /* the list's reference */
	}
}

/* ---- errors ---- */

/* The one place where an error fails a session: log, stop everything it
 * does, send the Error; the connection goes once it is written. */
void aoqd_session_fail(struct aoqd_session *s, const struct aoqd_error *e)
{
	if (s->state == AOQD_CLOSING)
		return;
	aoqd_warn("session", "session %" PRIu64 " (uid %u pid %d job '%s' rank %u): %s: %s; closing it",
	          s->id, (unsigned)s->conn.uid, (int)s->conn.peer_pid, s->conn.job ? s->conn.job : "", s->conn.rank,
	          aoq_error_name(e->code), e->msg);
	atomic_store(&s->dead, true);
	aoqd_conn_want_read(&s->conn, false);
	aoqd_arena_pause(&s->arena);
	aoqd_conn_send_error(&s->conn, e->code, e->msg, true);
	s->state = AOQD_CLOSING;
	if (aoqd_replica_leave(s, AOQD_LEAVE_FAILED))
		fail_others(s); /* the other members fail too (PEER_LOST) */
}

/* A handler's error: a refusal answers Error and goes on. */
void aoqd_session_error(struct aoqd_session *s, const struct aoqd_error *e)
{
	if (!e->refusal) {
		aoqd_session_fail(s, e);
		return;
	}
	aoqd_info("session", "session %" PRIu64 ": request refused: %s: %s", s->id, aoq_error_name(e->code), e->msg);
	aoqd_conn_send_error(&s->conn, e->code, e->msg, false);
}

