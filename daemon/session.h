/* SPDX-License-Identifier: MIT */
/*
 * A session: one client's connection and what it trains.  Its parts each
 * have one owner (docs/design.md, "Where things live"):
 *
 *   conn    the control connection                  conn.c
 *   st      the optimizer state                     state.c, statemem.c (register.c fills it)
 *   arena   the shared memory, rings, doorbells     arena.c
 *   steps   steps and transfers in flight           steps.c, dataplane.c, transfer.c
 *   stats   counters and histograms                 stats.c
 *
 * The whole is the session files' (top to bottom): events.c (what drives a
 * session: its connection, doorbell, the wake, the timers), message.c (the
 * message table), close.c (close, and the one place where an error fails
 * the session), trace.c, replica.c (replica groups), lease.c (lease and
 * resume) and session.c (its memory, references and the list).  The steps,
 * the data plane and transfers hold a session through the aoqd_steps_ops
 * it gives them (steps.h), never by calling these files.
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
#include "lease.h"

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
	/* The last time a member joined or came to a step (the sum of joined
	 * and the members' `arrived` changed): the 1 s sampler's measure of a
	 * rank the group waits for (aoqd_replica_overdue). */
	uint64_t progress_mark, progress_ns;
	struct aoqd_session *members[AOQ_MAX_LOCAL_WORLD]; /* by local rank */
};

struct aoqd_session {
	struct aoqd_server *srv;
	struct aoqd_session *prev, *next; /* the session list; loop thread only */
	uint64_t id;
	_Atomic int refs;       /* count | REFS_LEASING (session.c) */
	_Atomic bool dead;      /* set on close: workers skip its chunks */
	_Atomic bool populate_off; /* its state's populating stops (populate.h) */
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
	uv_poll_cb on_doorbell; /* what runs when the client rings (events.c) */
	/* aoqctl trace: who asked (a reference) and the steps_done count at
	 * which the traced steps have all ended.  Loop thread. */
	struct aoqd_session *trace_to;
	uint64_t trace_done_at;
	uint64_t trace_charged; /* the recorder's bound, charged to the uid */
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
	/* registered: the session reached READY (its key may have a snapshot
	 * file); snap_forget: its state ended for good, so its key's file is
	 * deleted, and so is one a write still under way puts in place
	 * (docs/snapshots.md, "Retention"). */
	bool registered;
	bool snap_forget;
	uint64_t lease_until;
	bool settled;
	/* The interrupted step being rolled back on a thread of its own
	 * (lease.c), which holds a reference: settled once it is gone. */
	bool rolling_back;
	uint64_t adopt_wait;
	uint64_t resumed_from;
	/* Bytes of the arena charged to st before a resume took a leased
	 * state over (lease.c, aoqd_lease_reserve): a refused resume leaves
	 * the lease as it was; the registration's arena takes the charge. */
	uint64_t arena_charged;
	/* A registration's state and arena being built off the loop
	 * (register.c, AOQD_BUILDING): the loop leaves st and arena alone
	 * until build_done; the worker's results below. */
	bool building;
	_Atomic bool build_done;
	bool build_alloc_failed;
	int build_r, build_lock;
	uint64_t build_failed_len;
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
 * A new session with one reference (the caller's; the list's once
 * linked), its parts initialised and given the session's aoqd_steps_ops;
 * NULL without memory.
 */
struct aoqd_session *aoqd_session_new(struct aoqd_server *srv);
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

/* The session list (srv->sessions; loop thread).  link: at the head, the
 * list's reference is the caller's.  unlink: false when s was not linked;
 * s keeps its `next`, so that a walk standing on s goes on.  bury: unlinks
 * s and drops the list's reference at the next wake (aoqd_sessions_reap),
 * when no walk of the list stands on it. */
void aoqd_session_link(struct aoqd_session *s);
bool aoqd_session_unlink(struct aoqd_session *s);
void aoqd_session_bury(struct aoqd_session *s);
void aoqd_sessions_reap(void);
/*
 * For snapshots and aoqctl: a session by id, live or leased (not
 * observers, not closing); NULL when none.
 */
struct aoqd_session *aoqd_session_find(struct aoqd_server *srv, uint64_t id);
/* The next session after s (NULL: the first), live or leased, to walk
 * every one (do not close sessions while walking). */
struct aoqd_session *aoqd_session_next(struct aoqd_server *srv, struct aoqd_session *s);
/* s's state ended for good (Bye, drop, failure, its lease over): the
 * snapshot file of its key goes from state_dir, now and after a write
 * still under way (s->snap_forget). */
void aoqd_session_forget_snapshot(struct aoqd_session *s);
/* Root, or a member of admin_gid (primary or supplementary group); whether
 * `who` may see (trace, snapshot, drop) s: an admin, or s's uid. */
bool aoqd_session_is_admin(const struct aoqd_session *who);
bool aoqd_session_may_see(const struct aoqd_session *who, const struct aoqd_session *s);

#endif
