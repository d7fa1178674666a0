/* SPDX-License-Identifier: MIT */
/*
 * A session (session.c): one client's connection and what it trains.  Its
 * parts each have one owner (docs/design.md, "Where things live"):
 *
 *   conn    the control connection                  conn.c
 *   st      the optimizer state                     state.c (register.c fills it)
 *   arena   the shared memory, rings, doorbells     arena.c
 *   steps   steps and transfers in flight           steps.c, dataplane.c, transfer.c
 *   stats   counters and histograms                 stats.c
 *
 * session.c owns the whole: creation, references, the session list,
 * closing, the message table and the one place where an error fails the
 * session.
 */
#ifndef AOQD_SESSION_H
#define AOQD_SESSION_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "arena.h"
#include "conn.h"
#include "error.h"
#include "pool.h"
#include "state.h"
#include "stats.h"
#include "steps.h"

enum aoqd_session_state {
	AOQD_HELLO = 0,   /* waiting for Hello */
	AOQD_REGISTERING, /* Hello done; Register frames may come */
	AOQD_READY,       /* arena sent; training */
	AOQD_OBSERVER,    /* aoqctl: queries only */
	AOQD_CLOSING,
	AOQD_LEASED,      /* trainer gone; the state waits for it (lease) */
};

struct aoqd_server;
struct aoqd_session;

/*
 * A replica group (docs/design.md, "Replica groups"): the local ranks of one
 * job (uid, job) sharing one optimizer state.  The group's state, arena,
 * steps, stats and pool queue live in a "hub": a session without a
 * connection, not in the session list (srv->hubs), which the data plane's
 * jobs run on.  Each rank is a member session: its connection, its view of
 * the arena (own rings and doorbells), its StepEnd.  Loop thread.
 *
 * References: the hub holds one on every member that joined (dropped when
 * the hub is freed), each member one on its hub (dropped at the member's
 * close), the hub list one on the hub until every member has closed.
 */
struct aoqd_replica {
	uint32_t world;          /* local ranks */
	uint32_t joined;         /* members registered */
	uint32_t live;           /* members not closed yet */
	uint32_t ends;           /* StepEnds of the open step received */
	bool broken;             /* a member left: no step completes again */
	bool lost;               /* ...because its trainer went away (no Bye, no
	                          * failure): the group's state is leased when
	                          * its last member has closed */
	char why[200];           /* what broke it (PEER_LOST's message) */
	struct aoqd_session *members[AOQ_MAX_LOCAL_WORLD]; /* by local rank */
};

struct aoqd_session {
	struct aoqd_server *srv;
	struct aoqd_session *prev, *next; /* the session list; loop thread only */
	uint64_t id;
	_Atomic int refs;       /* count | REFS_LEASING (session.c) */
	_Atomic bool dead;      /* set on close: workers skip its chunks */
	enum aoqd_session_state state;

	struct aoqd_account *account; /* the uid's (account.c) */
	bool counted;           /* in account->connections */
	bool backlog;           /* whole frames wait for the next turn */
	bool spinning;          /* the loop polls our to-daemon ring (aoqd_sessions_spin) */
	uint64_t accepted_ns;   /* the handshake's deadline counts from here */

	struct aoqd_conn conn;
	struct aoqd_state st;
	struct aoqd_arena arena;
	struct aoqd_steps steps;
	struct aoqd_stats stats;
	struct aoqd_queue queue; /* pool queue; guarded by the pool */
	/* aoqctl trace: who asked (a reference) and the steps_done count at
	 * which the traced steps have all ended.  Loop thread. */
	struct aoqd_session *trace_to;
	uint64_t trace_done_at;
	/* Snapshots: the last one written (step, wall clock), and when the
	 * last periodic one was started (monotonic).  Loop thread. */
	uint64_t snap_step, snap_wall_ns, snap_mono_ns;
	/* Lease and resume (README, "Lease and resume").  lease_ns: how long
	 * the state stays once the trainer is gone (from Hello, capped by
	 * lease_seconds again at the close); no_lease: Bye or drop.  LEASED:
	 * lease_until on the monotonic clock, and refs carries a LEASING bit
	 * (session.c) that tells unref to wake the loop when only the
	 * list's reference is left; `settled`
	 * says the interrupted step was rolled back and the arena freed.
	 * adopt_wait: the id of the leased session this registration waits
	 * for to settle.  resumed_from: the leased session's id. */
	uint64_t lease_ns;
	bool no_lease;
	uint64_t lease_until;
	bool settled;
	uint64_t adopt_wait;
	uint64_t resumed_from;
	/* In srv->sessions.  A leased session that ends is unlinked but keeps
	 * its `next` (a walk of the list may stand on it) and waits on the
	 * zombie list for the next wake to drop the list's reference. */
	bool linked;
	struct aoqd_session *zombie_next;
	/* Replica groups: a member's local world (>= 2) and rank from Hello,
	 * and its hub once registered (a reference); a hub's group (rep), and
	 * its place in srv->hubs (next). */
	uint32_t local_world, local_rank;
	uint64_t arrived; /* member: the last step it posted a record of or ended */
	struct aoqd_session *hub;
	struct aoqd_replica *rep;
};

/*
 * For snapshots (daemon/snapshot.c) and aoqctl: a session by id, live or
 * leased (not observers, not closing); NULL when none.  Loop thread.
 */
struct aoqd_session *aoqd_session_find(struct aoqd_server *srv, uint64_t id);
/* The next session after s (NULL: the first), live or leased, to walk
 * every one (loop thread; do not close sessions while walking). */
struct aoqd_session *aoqd_session_next(struct aoqd_server *srv, struct aoqd_session *s);

/*
 * Lease key: what a reconnecting trainer must present to resume.
 */
struct aoqd_lease_key {
	uid_t uid;
	const char *job;
	uint32_t rank;        /* AOQD_GROUP_RANK for a replica group's state */
	uint32_t local_world; /* a replica group's local ranks; 0 otherwise */
};

/* The rank in the key of a replica group's state (its hub's conn.rank):
 * Hello refuses it as a trainer's rank. */
#define AOQD_GROUP_RANK UINT32_MAX

/*
 * aoqd_lease_adopt: inserts a state restored from elsewhere (a snapshot)
 * as a leased session keyed `key`, for lease_ns nanoseconds, so that the
 * trainer that reconnects with that key and layout resumes it at
 * st->last_step.  The state is taken over: on success *st is zeroed and
 * the session owns its arrays; on failure *st is left to the caller.  st
 * must have been made with aoqd_state_alloc (undo copy or not: a trainer
 * with a lease that resumes a state without one gives it one,
 * aoqd_state_add_undo) and be whole at the end
 * of st->last_step (no open step: every tensor's cur_step at most
 * last_step).  Its mappings are charged to the uid's account (over any
 * quota: the daemon restored them) unless st->account is set already.
 * Returns the new session's id (> 0), or -EEXIST (a session with that key
 * exists, err says which), -ENOMEM.  Loop thread.
 */
int64_t aoqd_lease_adopt(struct aoqd_server *srv, const struct aoqd_lease_key *key, struct aoqd_state *st,
                         uint64_t lease_ns, struct aoqd_error *err);

/* A new connection on the server's listener: a session in state HELLO. */
void aoqd_session_accept(struct aoqd_server *srv, uv_stream_t *listener);
/*
 * References: the session list holds one, and so does everything that may
 * outlive a loop-thread call (a job or transfer on the pool, a write that
 * closes, a closing handle).  The last unref frees the session, on
 * whichever thread drops it: by then every handle is closed.
 */
void aoqd_session_ref(struct aoqd_session *s);
void aoqd_session_unref(struct aoqd_session *s);
/* Leased or not (the LEASING bit of refs); loop thread.  References held
 * now, without the bit; any thread. */
void aoqd_session_set_leasing(struct aoqd_session *s, bool on);
int aoqd_session_refcount(struct aoqd_session *s);
/* The server's wake: every session looks at what its workers finished. */
void aoqd_sessions_wake(struct aoqd_server *srv);
/* The server's idle handle while the loop spins: polls the to-daemon rings
 * of the sessions that spin; stops once none got a record for spin_ns. */
void aoqd_sessions_spin(struct aoqd_server *srv);
/* Fails sessions whose handshake (Hello, then Register or observer) is
 * past the deadline; the server's timer calls it. */
void aoqd_sessions_sweep(struct aoqd_server *srv);
/* Ends every session's rate interval (the server's timer, every
 * AOQD_RATE_INTERVAL_MS). */
#define AOQD_RATE_INTERVAL_MS 1000
void aoqd_sessions_sample(struct aoqd_server *srv);
/* Closes every session (the server stops). */
void aoqd_sessions_close_all(struct aoqd_server *srv);
/* The client's doorbell rang (a uv_poll_cb for aoqd_arena_watch). */
void aoqd_session_on_doorbell(uv_poll_t *h, int status, int events);

#endif
