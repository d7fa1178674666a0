/* SPDX-License-Identifier: MIT */
/*
 * What drives the sessions besides their messages: a new connection (per-uid
 * caps), the connection's events, the client's doorbell, the loop's spin on
 * the to-daemon rings, the workers' wake (steps, transfers, leases that
 * settle, registrations that waited), a replica group's poll, and the
 * server's timers (handshake deadline, rates and lease expiry).  Loop
 * thread.
 */
#include <inttypes.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "close.h"
#include "dataplane.h"
#include "events.h"
#include "lease.h"
#include "log.h"
#include "message.h"
#include "register.h"
#include "replica.h"
#include "server.h"
#include "session.h"
#include "steps.h"
#include "trace.h"
#include "transfer.h"
#include "wire.h"

/* ---- the rate timer, and the server's stop ---- */

void aoqd_sessions_sample(struct aoqd_server *srv)
{
	uint64_t now = aoqd_now_ns();
	struct aoqd_session *next;
	for (struct aoqd_session *s = srv->sessions; s; s = next) {
		next = s->next;
		if (s->state == AOQD_LEASED) {
			if (now >= s->lease_until)
				aoqd_lease_end(s, "expired", true);
			continue;
		}
		if (s->state == AOQD_READY || s->state == AOQD_REGISTERING)
			aoqd_stats_sample(&s->stats, now);
		if (s->state == AOQD_READY && !s->hub)
			aoqd_steps_sample(s);
		aoqd_trace_check(s);
	}
	struct aoqd_session *hn;
	for (struct aoqd_session *h = srv->hubs; h; h = hn) {
		hn = h->next;
		aoqd_stats_sample(&h->stats, now);
		aoqd_steps_sample(h); /* a snapshot of an idle group */
		if (aoqd_replica_overdue(h, now)) {
			struct aoqd_replica *rep = h->rep;
			for (uint32_t k = 0; k < rep->world; k++) {
				struct aoqd_session *m = rep->members[k];
				if (!m || (m->state != AOQD_READY && m->state != AOQD_REGISTERING))
					continue;
				struct aoqd_error e;
				AOQD_FAIL(&e, PEER_LOST, "%s", rep->why);
				aoqd_session_fail(m, &e);
			}
		}
	}
}

void aoqd_sessions_close_all(struct aoqd_server *srv)
{
	while (srv->sessions)
		aoqd_session_close(srv->sessions);
	aoqd_sessions_reap();
}

/* ---- the connection's events ---- */

static void conn_hold(void *owner)
{
	aoqd_session_ref(owner);
}

static void conn_release(void *owner)
{
	aoqd_session_unref(owner);
}

static void conn_close(void *owner)
{
	aoqd_session_close(owner);
}

/* Reading stopped for a full write queue: go on once it drained. */
static void conn_writable(void *owner)
{
	struct aoqd_session *s = owner;
	if (!s->conn.reading && s->state != AOQD_CLOSING &&
	    aoqd_conn_queued(&s->conn) < AOQD_MAX_QUEUED_REPLY_BYTES / 2)
		aoqd_session_frames(s);
}

static void conn_read(void *owner, ssize_t nread)
{
	struct aoqd_session *s = owner;
	if (nread == UV_ENOBUFS) {
		struct aoqd_error err;
		AOQD_FAIL(&err, QUOTA, "uid %u holds more than %" PRIu64 " bytes of unfinished frames "
		          "(max_buffered_bytes_per_uid)", (unsigned)s->conn.uid, s->srv->cfg.max_buffered_bytes_per_uid);
		aoqd_session_fail(s, &err);
		return;
	}
	if (nread < 0) {
		if (nread != UV_EOF)
			aoqd_info("session", "session %" PRIu64 ": read: %s", s->id, uv_strerror((int)nread));
		else if (s->state == AOQD_READY)
			aoqd_info("session", "session %" PRIu64 ": client went away", s->id);
		aoqd_session_close(s);
		return;
	}
	aoqd_session_frames(s);
}

static const struct aoqd_conn_ops conn_ops = {
	.hold = conn_hold,
	.release = conn_release,
	.close = conn_close,
	.writable = conn_writable,
	.read = conn_read,
};

void aoqd_session_accept(struct aoqd_server *srv, uv_stream_t *listener)
{
	struct aoqd_session *s = aoqd_session_new(srv);
	if (!s) {
		aoqd_err("server", "out of memory for a new connection");
		return;
	}
	s->on_doorbell = aoqd_session_on_doorbell;
	if (aoqd_conn_accept(&s->conn, srv->loop, listener, 0, &conn_ops, s) < 0) {
		/* Not linked yet: the handle's close drops the last reference. */
		aoqd_conn_close(&s->conn);
		aoqd_session_unref(s);
		return;
	}
	srv->connections++;
	s->id = ++srv->next_id;
	s->conn.id = s->id;
	s->state = AOQD_HELLO;
	s->accepted_ns = aoqd_now_ns();
	aoqd_session_link(s);
	if (s->conn.uid == (uid_t)-1) {
		aoqd_session_close(s);
		return;
	}
	/* Refusals go out as an Error the client reads before the close,
	 * written at once (the socket's buffer is empty), and the connection
	 * closes now: a burst of refused connections never counts against
	 * the caps of the others. */
	struct aoqd_error err;
	s->account = aoqd_account_get(&srv->accounts, s->conn.uid);
	int r = 0;
	if (!s->account)
		r = AOQD_FAIL(&err, NO_MEMORY, "out of memory");
	else if (srv->connections > srv->cfg.max_connections)
		r = AOQD_FAIL(&err, QUOTA, "too many connections (%u, max_connections)", srv->cfg.max_connections);
	else if (s->account->connections >= srv->cfg.max_connections_per_uid)
		r = AOQD_FAIL(&err, QUOTA, "uid %u has %u connections (max_connections_per_uid)", (unsigned)s->conn.uid,
		              s->account->connections);
	if (r < 0) {
		aoqd_info("session", "connection %" PRIu64 " from uid %u pid %d refused: %s: %s", s->id,
		          (unsigned)s->conn.uid, (int)s->conn.peer_pid, aoq_error_name(err.code), err.msg);
		aoqd_conn_refuse(&s->conn, err.code, err.msg);
		aoqd_session_close(s);
		return;
	}
	s->account->connections++;
	s->counted = true;
	s->st.account = s->account;
	s->st.quota = srv->cfg.max_state_bytes_per_uid;
	aoqd_conn_budget(&s->conn, &s->account->buffered, srv->cfg.max_buffered_bytes_per_uid);
	aoqd_debug("server", "connection %" PRIu64 " from pid %d uid %u", s->id, (int)s->conn.peer_pid,
	           (unsigned)s->conn.uid);
	aoqd_conn_want_read(&s->conn, true);
}

/* ---- the data plane's events ---- */

/* A group's progress after a wake or a member's doorbell: every member's
 * records, then the group's step (release, StepEnded to every member), then
 * the frames that waited behind the members' StepEnd. */
static void group_poll(struct aoqd_session *h)
{
	struct aoqd_replica *rep = h->rep;
	struct aoqd_error err;
	aoqd_session_ref(h);
	if (rep->broken) {
		/* after a clean leave: whoever wants a step learns why not */
		for (uint32_t k = 0; k < rep->world; k++) {
			struct aoqd_session *m = rep->members[k];
			struct aoq_rec rec;
			if (!m || m->state != AOQD_READY)
				continue;
			if (m->steps.end_pending || aoq_ring_peek(&m->arena.to_daemon, &rec) != 0) {
				AOQD_FAIL(&err, PEER_LOST, "%s", rep->why);
				aoqd_session_fail(m, &err);
			}
		}
		goto out;
	}
	for (int turn = 0; turn < 8; turn++) {
		for (int pass = 0; pass < 2; pass++)
			for (uint32_t k = 0; k < rep->world; k++) {
				struct aoqd_session *m = rep->members[k];
				if (!m || m->state != AOQD_READY)
					continue;
				if (atomic_load(&m->dead))
					AOQD_FAIL(&err, BAD_RECORD, "the to-client ring's tail counter is corrupt");
				if (atomic_load(&m->dead) || aoqd_drain(m, &err) < 0) {
					aoqd_session_fail(m, &err); /* and the group with it */
					goto out;
				}
			}
		int r = aoqd_steps_poll(h, false, &err);
		if (r < 0)
			aoqd_warn("session", "replica group %" PRIu64 ": %s", h->id, err.msg);
		if (r != 1)
			break;
		/* With an undo copy (a lease), the members' records of the
		 * next step waited for this StepEnded (dataplane.c): the next
		 * turn takes them. */
		for (uint32_t k = 0; k < rep->world; k++)
			if (rep->members[k])
				rep->members[k]->steps.held = false;
		for (uint32_t k = 0; k < rep->world && !rep->broken; k++) {
			struct aoqd_session *m = rep->members[k];
			if (m && m->state == AOQD_READY)
				aoqd_session_frames(m); /* frames that waited behind StepEnd */
		}
		if (rep->broken)
			break;
	}
out:
	aoqd_session_unref(h);
}

/* Takes what the session's ring holds, as its doorbell does; true when it
 * took a record (records of the next step wait for StepEnd, and all wait
 * while the answers have no room). */
static bool ring_poll(struct aoqd_session *s)
{
	struct aoqd_error err;
	uint64_t tail = s->arena.to_daemon.tail;
	int r = aoqd_steps_poll(s, true, &err);
	if (r < 0)
		aoqd_session_fail(s, &err);
	else if (r == 1)
		aoqd_session_frames(s); /* frames that waited behind StepEnd */
	return r >= 0 && s->arena.to_daemon.tail != tail;
}

static void on_spin(uv_idle_t *h)
{
	aoqd_sessions_spin(h->data);
}

/*
 * After a doorbell the loop polls the session's to-daemon ring for
 * loop_spin_us instead of going back to sleep (README, "Configuration"):
 * the ring's consumer_spinning word tells libaoq not to ring meanwhile, so
 * a small tensor's next push reaches a worker without the socket write and
 * the loop's wake-up.  The loop keeps serving everything else while it
 * spins (a libuv idle handle: the loop polls its events without blocking).
 * Replica groups keep the doorbell.  Not while tasks wait for a worker:
 * a record then waits in the queue anyway, and the polling loop would take
 * a core from the trainer when the update is the step's limit (a 3.48 B
 * model's step on the H200 host, 0.473 -> 0.612 s with an unconditional
 * spin; tests/bench/RESULTS.md).
 */
static void spin_start(struct aoqd_session *s)
{
	struct aoqd_server *srv = s->srv;
	if (!srv->spin_ns || s->hub || s->rep || s->state != AOQD_READY || srv->stopping)
		return;
	if (aoqd_pool_backlog(srv->pool)) {
		srv->spin_busy++;
		return;
	}
	uint64_t now = aoqd_now_ns();
	srv->spin_until = now + srv->spin_ns;
	if (!s->spinning) {
		s->spinning = true;
		aoq_ring_set_spinning(&s->arena.to_daemon, true);
	}
	if (!uv_is_active((uv_handle_t *)&srv->spin)) {
		srv->spin_since = now;
		uv_idle_start(&srv->spin, on_spin);
	}
}

void aoqd_sessions_spin(struct aoqd_server *srv)
{
	bool took = false, any = false;
	struct aoqd_session *next;
	for (struct aoqd_session *s = srv->sessions; s; s = next) {
		next = s->next;
		if (!s->spinning)
			continue;
		if (s->state != AOQD_READY || atomic_load(&s->dead)) {
			s->spinning = false; /* its arena may be going: not touched */
			continue;
		}
		any = true;
		if (aoq_ring_idle(&s->arena.to_daemon))
			continue;
		aoqd_session_ref(s);
		if (ring_poll(s)) {
			took = true;
			srv->spin_takes++;
		}
		next = s->next; /* s may have left the list (its ref keeps it) */
		aoqd_session_unref(s);
	}
	uint64_t now = aoqd_now_ns();
	if (took)
		srv->spin_until = now + srv->spin_ns;
	if (any && now < srv->spin_until && !srv->stopping && !aoqd_pool_backlog(srv->pool)) {
		/* a thread placed on the loop's core (often the trainer's: the
		 * other cores are the workers') runs at once, not at the next
		 * tick: bench-spine on the 16-core H200 host, push -> param
		 * p50 23.1 -> 18.4 us (tests/bench/RESULTS.md, 2026-12-02) */
		sched_yield();
		return;
	}
	/* Back to the doorbells: withdraw the word, then look once more (a
	 * push that saw it set did not ring; aoq-arena.h, aoq_ring_idle). */
	uv_idle_stop(&srv->spin);
	srv->spin_total_ns += now - srv->spin_since;
	for (struct aoqd_session *s = srv->sessions; s; s = next) {
		next = s->next;
		if (!s->spinning)
			continue;
		s->spinning = false;
		if (s->state != AOQD_READY || atomic_load(&s->dead))
			continue;
		aoq_ring_set_spinning(&s->arena.to_daemon, false);
		if (!aoq_ring_idle(&s->arena.to_daemon)) {
			/* a push came meanwhile: take it, and spin again */
			aoqd_session_ref(s);
			if (ring_poll(s))
				spin_start(s);
			next = s->next;
			aoqd_session_unref(s);
		}
	}
}

void aoqd_session_on_doorbell(uv_poll_t *h, int status, int events)
{
	struct aoqd_session *s = h->data;
	struct aoqd_error err;
	(void)events;
	int ack = status < 0 ? 0 : aoqd_arena_ack(&s->arena);
	if (ack < 0) {
		/* The trainer died or left: its doorbell closes with its
		 * socket, in either order.  While the connection is open its
		 * frames decide: a Bye still unread there ends the session for
		 * good, its end without one leases it.  (Closing here leased
		 * trainers that had said Bye: aoq_close sends it and then
		 * closes every fd, and the doorbell's hangup could come first.) */
		uv_poll_stop(h);
		if (s->conn.open && s->state != AOQD_CLOSING) {
			aoqd_debug("session", "session %" PRIu64 ": doorbell closed; the connection decides", s->id);
			return;
		}
		aoqd_info("session", "session %" PRIu64 ": client went away (doorbell closed)", s->id);
		aoqd_session_close(s);
		return;
	}
	if (s->hub && status >= 0) {
		group_poll(s->hub);
		return;
	}
	if (status < 0) {
		AOQD_FAIL(&err, INTERNAL, "doorbell: %s", uv_strerror(status));
		aoqd_session_fail(s, &err);
		return;
	}
	ring_poll(s);
	spin_start(s);
}

void aoqd_sessions_sweep(struct aoqd_server *srv)
{
	uint64_t now = aoqd_now_ns(), limit = (uint64_t)srv->cfg.handshake_timeout_ms * 1000000u;
	struct aoqd_session *next;
	for (struct aoqd_session *s = srv->sessions; s; s = next) {
		next = s->next;
		if ((s->state != AOQD_HELLO && s->state != AOQD_REGISTERING) || now - s->accepted_ns <= limit)
			continue;
		struct aoqd_error err;
		AOQD_FAIL(&err, PROTOCOL, "%s not done within %u ms (handshake_timeout_ms)",
		          s->state == AOQD_HELLO ? "Hello" : "registration", srv->cfg.handshake_timeout_ms);
		aoqd_session_fail(s, &err);
	}
}

void aoqd_sessions_wake(struct aoqd_server *srv)
{
	struct aoqd_session *next;
	aoqd_sessions_reap();
	for (struct aoqd_session *s = srv->sessions; s; s = s->next)
		aoqd_lease_settle(s);
	/* Registrations waiting for a leased state that has settled.  An
	 * adoption ends that leased session (unlinks it): walk again. */
	for (bool again = true; again;) {
		again = false;
		for (struct aoqd_session *s = srv->sessions; s; s = s->next) {
			if (!s->adopt_wait || s->state != AOQD_REGISTERING)
				continue;
			struct aoqd_session *l = aoqd_session_find(srv, s->adopt_wait);
			if (l && l->state == AOQD_LEASED && !l->settled)
				continue;
			struct aoqd_error err;
			aoqd_session_ref(s);
			int r = aoqd_register_finish(s, s->on_doorbell, aoqd_replica_adopt, &err);
			if (r < 0)
				aoqd_session_error(s, &err);
			else if (r != AOQD_ADOPT_WAIT)
				aoqd_session_frames(s);
			aoqd_session_unref(s);
			again = true;
			break;
		}
	}
	for (struct aoqd_session *s = srv->sessions; s; s = next) {
		next = s->next;
		if (s->building && atomic_load_explicit(&s->build_done, memory_order_acquire)) {
			/* a registration's state and arena built on a worker */
			struct aoqd_error err;
			aoqd_session_ref(s);
			if (s->state != AOQD_REGISTERING)
				s->building = false; /* failed meanwhile: freed with the session */
			else if (aoqd_register_built(s, s->on_doorbell, &err) < 0)
				aoqd_session_error(s, &err);
			else
				aoqd_session_frames(s);
			next = s->next;
			aoqd_session_unref(s);
			continue;
		}
		if (s->backlog && s->state != AOQD_CLOSING) {
			aoqd_session_ref(s);
			aoqd_session_frames(s);
			bool gone = s->state == AOQD_CLOSING;
			aoqd_session_unref(s);
			if (gone)
				continue;
		}
		if (s->state != AOQD_READY)
			continue;
		struct aoqd_error err;
		int r = aoqd_steps_poll(s, false, &err);
		if (r < 0) {
			aoqd_session_fail(s, &err);
			continue;
		}
		if (r == 1)
			aoqd_session_frames(s);
		if (s->state == AOQD_READY && aoqd_transfer_poll(s))
			aoqd_session_frames(s);
		aoqd_trace_check(s);
	}
	for (struct aoqd_session *h = srv->hubs; h; h = next) {
		next = h->next;
		group_poll(h);
	}
}
