/* SPDX-License-Identifier: MIT */
/* Lease and resume (lease.c; README, "Lease and resume").  Loop thread. */
#ifndef AOQD_LEASE_H
#define AOQD_LEASE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "error.h"

struct aoqd_server;
struct aoqd_session;
struct aoqd_state;

/* The adopt callback's answer (register.h, aoqd_adopt_fn) when the leased
 * state is not settled yet: the Register reply waits for a wake. */
#define AOQD_ADOPT_WAIT 2

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
 * quota and the uid's session cap, as a live registration: -EDQUOT past
 * them) unless st->account is set already.  Returns the new session's id
 * (> 0), or -EEXIST (a session with that key exists, err says which),
 * -EDQUOT, -ENOMEM.
 */
int64_t aoqd_lease_adopt(struct aoqd_server *srv, const struct aoqd_lease_key *key, struct aoqd_state *st,
                         uint64_t lease_ns, struct aoqd_error *err);

/* Nanoseconds s's state is leased for if it closes now: only a registered
 * trainer that went away (no Bye, no failure, no drop), whose state has
 * its undo copy and no load since its last step, and while the configured
 * lease (reloadable) is on; 0: no lease. */
uint64_t aoqd_lease_for(const struct aoqd_session *s);
/* Once only the list's reference is left: the arena goes and stops
 * counting against the quota, the interrupted step goes back (on a thread
 * of its own unless the server is stopping; the wake after it settles the
 * lease: `settled`, as at once when no step was open).  No-op otherwise. */
void aoqd_lease_settle(struct aoqd_session *s);
/* At a stop: waits (60 s at most) for the rollbacks under way off the loop
 * and settles their leases; with `all` (the fd store keeps what is
 * settled) every other lease that can be settled too. */
void aoqd_leases_settle_all(struct aoqd_server *srv, bool all);
/* Ends a leased session for good: its memory and quota go back; with
 * `forget` (expired, dropped, a resume that failed) its key's snapshot
 * file goes too (aoqd_session_forget_snapshot). */
void aoqd_lease_end(struct aoqd_session *s, const char *why, bool forget);
bool aoqd_lease_same_key(const struct aoqd_session *a, uid_t uid, const char *job, uint32_t rank);
/* The leased session keyed (uid, job, rank), or NULL. */
struct aoqd_session *aoqd_lease_find(struct aoqd_server *srv, uid_t uid, const char *job, uint32_t rank);
/* Leased session l's state goes to *dst (s->st, or s's new hub's): the
 * arrays, steps, hyperparameters and seed carry over; the options that
 * shape the arena and the steps are the new trainer's. */
void aoqd_lease_take(struct aoqd_session *s, struct aoqd_session *l, struct aoqd_state *dst);
/* Before s takes leased session l's state over (with `lanes` lanes: a
 * replica group's): the arena it will get, charged to s's account now
 * (*pages), so that a resume refused for the quota or the arena's size
 * leaves the lease as it was.  The caller adds *pages to the taken
 * state's charge (and to the session's arena_charged).  0, or -errno with
 * err filled. */
int aoqd_lease_reserve(struct aoqd_session *s, const struct aoqd_session *l, uint32_t lanes, uint64_t *pages,
                       struct aoqd_error *err);
/* A trainer's registration resumes the leased state of its key when the
 * layout matches: 1 when it did, 0 when there is none, AOQD_ADOPT_WAIT,
 * or -errno with err filled (the lease stays). */
int aoqd_lease_resume(struct aoqd_session *s, struct aoqd_error *err);

#endif
