/* SPDX-License-Identifier: MIT */
/*
 * Messages: the message table and dispatch(), where a handler's error
 * becomes a refusal or a failed session; the frames one connection may have
 * handled per turn of the loop; the handlers that belong to the session as
 * a whole (Hello, Register, Stats, SnapshotRequest, Bye, DropRequest).  The
 * other handlers live with what they act on (register.c, steps.c,
 * transfer.c, trace.c).  Loop thread.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aoq-config.h"
#include "aoq-version.h"
#include "close.h"
#include "lease.h"
#include "log.h"
#include "message.h"
#include "register.h"
#include "replica.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"
#include "steps.h"
#include "trace.h"
#include "transfer.h"
#include "wire.h"

/* Frames one connection may have handled per turn of the loop, and bytes
 * of frames (at least one frame): a Register frame of 1 MiB is some 50,000
 * tensors of work. */
#define FRAMES_PER_TURN 16
#define FRAME_BYTES_PER_TURN (128u << 10)

/* ---- Hello ---- */

static int on_hello(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__Hello *h = env->hello;
	const struct aoqd_config *cfg = &s->srv->cfg;
	struct aoqd_conn *c = &s->conn;
	/* Both sides' versions in the refusal: the client's (from its Hello,
	 * bounded and made printable) and this daemon's. */
	if (h->protocol_version != AOQ_PROTOCOL_VERSION || (!h->observer && h->arena_version != AOQ_ARENA_VERSION)) {
		char theirs[64];
		const char *v = h->protocol_version >= 2 && h->version ? h->version : "";
		size_t n = 0;
		for (; v[n] && n + 1 < sizeof(theirs); n++)
			theirs[n] = v[n] > 0x20 && v[n] < 0x7f ? v[n] : '?';
		theirs[n] = 0;
		return AOQD_FAIL(err, VERSION,
		                 "client %s speaks protocol %u, arena %u; aoqd %s speaks protocol %u, arena %u: use libaoq "
		                 "and aoqd of one release",
		                 n ? theirs : "(no version sent)", h->protocol_version,
		                 h->arena_version, aoq_full_version(), AOQ_PROTOCOL_VERSION, AOQ_ARENA_VERSION);
	}
	if (strlen(h->job) > 128 || strlen(h->device) > 64)
		return AOQD_FAIL(err, INVALID, "job or device name too long");
	c->job = strdup(h->job);
	c->device = strdup(h->device);
	c->rank = h->rank;
	c->pid = h->pid;
	if (!c->job || !c->device)
		return AOQD_FAIL(err, NO_MEMORY, "out of memory");
	if (h->local_world > AOQ_MAX_LOCAL_WORLD || (h->local_world > 1 && h->local_rank >= h->local_world))
		return AOQD_FAIL(err, INVALID, "local rank %u of local world %u (a replica group has 2 to %u local ranks)",
		                 h->local_rank, h->local_world, AOQ_MAX_LOCAL_WORLD);
	if (h->rank == AOQD_GROUP_RANK && !h->observer)
		return AOQD_FAIL(err, INVALID, "rank %u is reserved (the key of a replica group's state)", h->rank);
	if (h->local_world > 1 && !h->observer) {
		s->local_world = h->local_world;
		s->local_rank = h->local_rank;
	}
	if (!h->observer) {
		/* One live connection per key: a trainer whose process is gone
		 * (its socket closed, the close not handled yet) is leased now,
		 * anything else is refused. */
		struct aoqd_session *next;
		for (struct aoqd_session *o = s->srv->sessions; o; o = next) {
			next = o->next;
			if (o == s || (o->state != AOQD_REGISTERING && o->state != AOQD_READY) ||
			    !aoqd_lease_same_key(o, c->uid, c->job, c->rank))
				continue;
			if (!aoqd_conn_peer_gone(&o->conn))
				return AOQD_FAIL(err, BUSY, "job '%s' rank %u of uid %u is connected already (session %" PRIu64
				                 ", pid %d)", c->job, c->rank, (unsigned)c->uid, o->id, (int)o->conn.peer_pid);
			aoqd_session_close(o);
			break;
		}
		/* Leased sessions count, but not the one this trainer resumes. */
		uint32_t n = 0;
		for (struct aoqd_session *o = s->srv->sessions; o; o = o->next)
			if (o->conn.uid == c->uid && o->state != AOQD_OBSERVER && o != s &&
			    !(o->state == AOQD_LEASED && aoqd_lease_same_key(o, c->uid, c->job, c->rank)))
				n++;
		if (n >= cfg->max_sessions_per_uid)
			return AOQD_FAIL(err, QUOTA, "uid %u has %u sessions, leased ones included (max_sessions_per_uid)",
			                 (unsigned)c->uid, n);
		uint64_t want = h->lease_seconds == UINT32_MAX ? 0
		                : h->lease_seconds == 0 || h->lease_seconds > cfg->lease_seconds ? cfg->lease_seconds
		                : h->lease_seconds;
		s->lease_ns = want * 1000000000u;
		s->st.undo = want > 0; /* the rollback needs the undo copy */
	}
	s->state = h->observer ? AOQD_OBSERVER : AOQD_REGISTERING;
	Aoq__Limits lim = AOQ__LIMITS__INIT;
	lim.max_frame = AOQ_MAX_FRAME;
	lim.max_tensors = cfg->max_tensors;
	lim.max_tensor_elems = cfg->max_tensor_elems;
	lim.max_arena_bytes = cfg->max_arena_bytes;
	lim.max_groups = 65536;
	Aoq__Welcome w = AOQ__WELCOME__INIT;
	w.session_id = s->id;
	w.protocol_version = AOQ_PROTOCOL_VERSION;
	w.arena_version = AOQ_ARENA_VERSION;
	w.version = (char *)aoq_full_version();
	w.limits = &lim;
	w.xfer_at = true;
	w.release_tensors = true;
	Aoq__Envelope r = AOQ__ENVELOPE__INIT;
	r.msg_case = AOQ__ENVELOPE__MSG_WELCOME;
	r.welcome = &w;
	aoqd_log(h->observer ? AOQD_LOG_DEBUG : AOQD_LOG_INFO, "session",
	         "session %" PRIu64 ": hello from pid %d uid %u job '%s' rank %u device '%s'%s", s->id,
	         (int)c->peer_pid, (unsigned)c->uid, c->job, c->rank, c->device, h->observer ? " (observer)" : "");
	aoqd_conn_send(c, &r);
	return AOQD_REPLIED;
}

/* ---- Register, Stats, snapshots, Bye, Drop ---- */

static int on_register(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	int r = aoqd_register(s, env->register_, s->on_doorbell, aoqd_replica_adopt, err);
	return r == AOQD_ADOPT_WAIT || r == AOQD_BUILDING ? AOQD_DEFERRED : r == AOQD_GROUP_JOINED ? AOQD_REPLIED : r;
}

static const char *state_name(enum aoqd_session_state st)
{
	switch (st) {
	case AOQD_HELLO: return "hello";
	case AOQD_REGISTERING: return "registering";
	case AOQD_READY: return "training";
	case AOQD_OBSERVER: return "observer";
	case AOQD_LEASED: return "leased";
	default: return "closing";
	}
}

/* Stats: the sessions the asker may see, and the daemon's totals. */
static int on_stats(struct aoqd_session *who, const Aoq__Envelope *env, struct aoqd_error *err)
{
	struct aoqd_server *srv = who->srv;
	(void)env;
	size_t n = 0;
	for (struct aoqd_session *s = srv->sessions; s; s = s->next)
		if (s->state == AOQD_READY || s->state == AOQD_REGISTERING || s->state == AOQD_LEASED)
			n++;
	Aoq__SessionStats *ss = calloc(n ? n : 1, sizeof(*ss));
	Aoq__SessionStats **sp = calloc(n ? n : 1, sizeof(*sp));
	if (!ss || !sp) {
		free(ss);
		free(sp);
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	}
	size_t k = 0;
	for (struct aoqd_session *s = srv->sessions; s && k < n; s = s->next) {
		if (s->state != AOQD_READY && s->state != AOQD_REGISTERING && s->state != AOQD_LEASED)
			continue;
		if (!aoqd_session_may_see(who, s))
			continue;
		Aoq__SessionStats *x = &ss[k];
		aoq__session_stats__init(x);
		x->id = s->id;
		x->job = s->conn.job ? s->conn.job : "";
		x->rank = s->conn.rank;
		x->uid = (uint32_t)s->conn.uid;
		x->pid = (uint32_t)s->conn.peer_pid; /* SO_PEERCRED's, not what Hello claims */
		x->device = s->conn.device ? s->conn.device : "";
		x->tensors = s->st.ntensors;
		x->tensors_released = s->st.nreleased;
		x->parameters = s->st.parameters; /* no walk over the tensors: Stats costs O(sessions) */
		x->state = (char *)state_name(s->state);
		x->precision = s->st.precision;
		x->master_bits = s->st.master24 ? 24 : 32;
		x->arena_bytes = s->building ? 0 : s->arena.size; /* being built off the loop */
		aoqd_stats_fill(&s->stats, x);
		x->state_bytes = s->st.state_bytes;
		x->snapshot_step = s->snap_step;
		x->snapshot_unix_ns = s->snap_wall_ns;
		x->snapshot_phase = (char *)aoqd_snapshot_phase(&s->st, &x->snapshot_written_bytes, &x->snapshot_data_bytes);
		x->last_step = s->st.last_step;
		if (s->hub) {
			/* A replica group's member: the group's figures once, on
			 * the row of its lowest live local rank. */
			struct aoqd_session *h = s->hub;
			const struct aoqd_session *owner = NULL;
			for (uint32_t r = 0; r < h->rep->world && !owner; r++)
				if (h->rep->members[r] && h->rep->members[r]->state == AOQD_READY)
					owner = h->rep->members[r];
			x->local_world = h->rep->world;
			x->local_rank = s->local_rank;
			x->group_id = h->id;
			x->group_owner = owner == s;
			x->tensors = h->st.ntensors;
			x->parameters = h->st.parameters;
			x->precision = h->st.precision;
			x->master_bits = h->st.master24 ? 24 : 32;
			x->last_step = h->st.last_step;
			x->snapshot_step = h->snap_step;
			x->snapshot_unix_ns = h->snap_wall_ns;
			x->snapshot_phase = (char *)aoqd_snapshot_phase(&h->st, &x->snapshot_written_bytes,
			                                                &x->snapshot_data_bytes);
			if (owner == s) {
				aoqd_stats_fill(&h->stats, x);
				x->state_bytes = h->st.state_bytes;
				x->arena_bytes = h->arena.size;
			} else {
				x->arena_bytes = 0;
			}
		}
		if (s->rep) {
			/* A replica group's leased state (rank AOQD_GROUP_RANK). */
			x->local_world = s->rep->world;
			x->group_id = s->id;
			x->group_owner = true;
		}
		if (s->state == AOQD_LEASED) {
			uint64_t now = aoqd_now_ns();
			x->lease_left_seconds = s->lease_until > now ? (double)(s->lease_until - now) / 1e9 : 0;
			x->pid = 0;
		}
		sp[k] = x;
		k++;
	}
	Aoq__Stats st = AOQ__STATS__INIT;
	st.threads = aoqd_pool_threads(srv->pool);
	st.kernel = (char *)srv->kernel->name;
	if (aoqd_session_is_admin(who)) {
		st.locked_bytes = atomic_load(&srv->locked_bytes);
		st.rss_bytes = aoqd_rss_bytes();
	} else {
		/* Others' figures are not a plain user's business: only what
		 * its own sessions lock. */
		for (struct aoqd_session *s = srv->sessions; s; s = s->next)
			if (s->conn.uid == who->conn.uid && !s->building) /* mapped off the loop now */
				st.locked_bytes += s->st.locked_bytes;
		for (struct aoqd_session *h = srv->hubs; h; h = h->next)
			if (h->conn.uid == who->conn.uid)
				st.locked_bytes += h->st.locked_bytes;
	}
	st.uptime_seconds = (double)(aoqd_now_ns() - srv->start_ns) / 1e9;
	st.n_sessions = k;
	st.sessions = sp;
	st.version = (char *)aoq_full_version();
	st.pid = (uint32_t)getpid();
	st.timestamp_unix_ns = aoqd_wall_ns();
	st.loop_spin_us = (uint32_t)(srv->spin_ns / 1000u);
	st.loop_spin_seconds = (double)(srv->spin_total_ns + (uv_is_active((uv_handle_t *)&srv->spin)
	                                                          ? aoqd_now_ns() - srv->spin_since : 0)) / 1e9;
	st.loop_spin_takes = srv->spin_takes;
	st.loop_spin_busy = srv->spin_busy;
	Aoq__Envelope reply = AOQ__ENVELOPE__INIT;
	reply.msg_case = AOQ__ENVELOPE__MSG_STATS;
	reply.stats = &st;
	aoqd_conn_send(&who->conn, &reply);
	free(ss);
	free(sp);
	return AOQD_REPLIED;
}


/* SnapshotRequest: a snapshot of a session the asker may see; SnapshotDone
 * (or Error) comes once the file is on disk. */
static int on_snapshot(struct aoqd_session *who, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__SnapshotRequest *m = env->snapshot_request;
	struct aoqd_session *s = who->srv->sessions;
	while (s && s->id != m->session)
		s = s->next;
	if (!s || s->state != AOQD_READY || !aoqd_session_may_see(who, s))
		return AOQD_REFUSE(err, NOT_FOUND, "no training session %" PRIu64 " that you may snapshot", m->session);
	if (s == who)
		return AOQD_REFUSE(err, INVALID, "ask for a snapshot from another connection (aoqctl)");
	int r = aoqd_steps_snapshot(s, who, err);
	return r < 0 ? r : AOQD_REPLIED;
}

static int on_bye(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	(void)env;
	(void)err;
	aoqd_log(s->state == AOQD_OBSERVER ? AOQD_LOG_DEBUG : AOQD_LOG_INFO, "session", "session %" PRIu64 ": bye",
	         s->id);
	s->no_lease = true; /* a trainer that says goodbye is done */
	aoqd_session_close(s);
	return AOQD_REPLIED;
}

/* aoqctl drop: ends a session the asker may see (its own uid's; root and
 * admin_gid any), and its lease, for good. */
static int on_drop(struct aoqd_session *who, const Aoq__Envelope *env, struct aoqd_error *err)
{
	uint64_t id = env->drop_request->session;
	struct aoqd_session *s = aoqd_session_find(who->srv, id);
	if (!s || !aoqd_session_may_see(who, s))
		return AOQD_REFUSE(err, NOT_FOUND, "no session %" PRIu64 " that you may drop", id);
	if (s == who)
		return AOQD_REFUSE(err, INVALID, "a session cannot drop itself (send Bye)");
	char why[64];
	snprintf(why, sizeof(why), "dropped by uid %u", (unsigned)who->conn.uid);
	if (s->state == AOQD_LEASED) {
		aoqd_lease_end(s, why, true);
	} else {
		struct aoqd_error e;
		AOQD_FAIL(&e, NOT_FOUND, "session %" PRIu64 " %s (aoqctl drop)", id, why);
		s->no_lease = true;
		aoqd_session_fail(s, &e);
	}
	aoqd_conn_send_done(&who->conn, id);
	return AOQD_REPLIED;
}

/* ---- the message table ---- */

#define IN(x) (1u << AOQD_##x)

struct handler {
	Aoq__Envelope__MsgCase msg;
	unsigned states;          /* where the message is allowed */
	const char *elsewhere;    /* the PROTOCOL error's text in any other state */
	int (*fn)(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);
};

static const struct handler handlers[] = {
	{ AOQ__ENVELOPE__MSG_HELLO, IN(HELLO), "Hello twice", on_hello },
	{ AOQ__ENVELOPE__MSG_REGISTER, IN(REGISTERING), "Register not expected now", on_register },
	{ AOQ__ENVELOPE__MSG_SET_HYPERPARAMS, IN(READY), "SetHyperparams before registration", aoqd_on_set_hyperparams },
	{ AOQ__ENVELOPE__MSG_STEP_END, IN(READY), "StepEnd before registration", aoqd_on_step_end },
	{ AOQ__ENVELOPE__MSG_LOAD_STATE, IN(READY), "LoadState before registration", aoqd_on_load_state },
	{ AOQ__ENVELOPE__MSG_READ_STATE, IN(READY), "ReadState before registration", aoqd_on_read_state },
	{ AOQ__ENVELOPE__MSG_TENSOR_STEPS, IN(READY), "TensorSteps before registration", aoqd_on_tensor_steps },
	{ AOQ__ENVELOPE__MSG_RELEASE_TENSORS, IN(READY), "ReleaseTensors before registration", aoqd_on_release_tensors },
	{ AOQ__ENVELOPE__MSG_STATS_REQUEST, IN(REGISTERING) | IN(READY) | IN(OBSERVER), "StatsRequest before Hello",
	  on_stats },
	{ AOQ__ENVELOPE__MSG_TRACE_REQUEST, IN(REGISTERING) | IN(READY) | IN(OBSERVER), "TraceRequest before Hello",
	  aoqd_on_trace },
	{ AOQ__ENVELOPE__MSG_SNAPSHOT_REQUEST, IN(REGISTERING) | IN(READY) | IN(OBSERVER),
	  "SnapshotRequest before Hello", on_snapshot },
	{ AOQ__ENVELOPE__MSG_DROP_REQUEST, IN(REGISTERING) | IN(READY) | IN(OBSERVER), "DropRequest before Hello",
	  on_drop },
	{ AOQ__ENVELOPE__MSG_TRACE_SPANS, IN(READY), "TraceSpans before registration", aoqd_on_trace_spans },
	{ AOQ__ENVELOPE__MSG_BYE, IN(HELLO) | IN(REGISTERING) | IN(READY) | IN(OBSERVER), "Bye while closing", on_bye },
};

/* Runs the message's handler if the session's state allows it; an error
 * becomes the Error reply here and nowhere else. */
static void dispatch(struct aoqd_session *s, const Aoq__Envelope *env)
{
	struct aoqd_error err;
	const struct handler *h = NULL;
	for (size_t i = 0; i < sizeof(handlers) / sizeof(handlers[0]); i++)
		if (handlers[i].msg == env->msg_case)
			h = &handlers[i];
	int r;
	if (!h)
		r = AOQD_FAIL(&err, PROTOCOL, "unexpected message %d", (int)env->msg_case);
	else if (!(h->states & (1u << s->state)))
		r = AOQD_FAIL(&err, PROTOCOL, "%s", h->elsewhere);
	else
		r = h->fn(s, env, &err);
	if (r < 0)
		aoqd_session_error(s, &err);
	aoqd_trace_check(s); /* a StepEnd may have ended the last traced step */
}

/* Decodes and handles every whole frame in the buffer, unless a deferred
 * reply (StepEnd, a transfer) holds the connection: replies go out in
 * request order. */
void aoqd_session_frames(struct aoqd_session *s)
{
	struct aoqd_conn *c = &s->conn;
	size_t off = 0;
	unsigned handled = 0;
	s->backlog = false;
	while (s->state != AOQD_CLOSING && !s->steps.end_pending && !s->steps.xfer_busy && !s->adopt_wait && !s->building &&
	       aoqd_conn_queued(c) < AOQD_MAX_QUEUED_REPLY_BYTES) {
		struct aoqd_error err;
		Aoq__Envelope *env = NULL;
		if (handled == FRAMES_PER_TURN || (handled > 0 && off >= FRAME_BYTES_PER_TURN)) {
			/* The rest waits for the next turn of the loop, after
			 * everyone else's events: one client's pipelined
			 * requests do not hold the others' records. */
			if (c->rlen - off >= 4) {
				s->backlog = true;
				uv_async_send(&s->srv->wake);
			}
			break;
		}
		int r = aoqd_conn_frame(c, &off, &env, &err);
		handled++;
		if (r == 0)
			break;
		if (r < 0) {
			aoqd_session_fail(s, &err);
			break;
		}
		dispatch(s, env);
		aoq_envelope_free(env);
	}
	if (s->state == AOQD_CLOSING) {
		aoqd_conn_consume(c, c->rlen);
		return;
	}
	aoqd_conn_consume(c, off);
	aoqd_conn_want_read(c, !s->steps.end_pending && !s->steps.xfer_busy && !s->adopt_wait && !s->building &&
	                       aoqd_conn_queued(c) < AOQD_MAX_QUEUED_REPLY_BYTES);
}
