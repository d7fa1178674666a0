/* SPDX-License-Identifier: MIT */
/*
 * Lease and resume (README, "Lease and resume"; docs/design.md, "The
 * daemon's parts"): how long a state stays once its trainer is gone, the
 * rollback of its interrupted step once nothing of the dead connection
 * runs (settle), the end of a lease, and the takeover of a leased state by
 * the trainer that comes back with the same key and layout.  Expiry runs on
 * the rate timer (events.c).  Loop thread; the rollback of a large step
 * runs on a thread of its own.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"
#include "lease.h"
#include "log.h"
#include "pool.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"

/* Nanoseconds the session's state is leased for if it closes now: only a
 * registered trainer that went away (no Bye, no failure, no drop), whose
 * state has its undo copy and no load since its last step, and while the
 * configured lease (reloadable) is on. */
uint64_t aoqd_lease_for(const struct aoqd_session *s)
{
	uint64_t cap = (uint64_t)s->srv->cfg.lease_seconds * 1000000000u;
	if (s->state != AOQD_READY || s->no_lease || !s->st.undo || s->st.dirty || s->srv->stopping)
		return 0;
	return s->lease_ns < cap ? s->lease_ns : cap;
}

/* The interrupted step's rollback, off the loop: copying back what a
 * step changed in a large state takes a second or more on one thread
 * (1.2 s for a whole step of 1 G fp32 parameters on the H200 host,
 * RESULTS.md), which on the loop would hold every other session of the
 * node (and so would freeing a large arena: aoqd_release_start).  The thread
 * has the state to itself: nothing of the dead connection runs, a resume
 * waits for `settled`, and a lease that ends meanwhile leaves the memory
 * to the thread's reference. */
static void *rollback_run(void *arg)
{
	struct aoqd_session *s = arg;
	aoqd_state_rollback(&s->st, 1); /* one thread, beside the workers */
	aoqd_session_unref(s); /* wakes the loop, which settles the lease */
	return NULL;
}

static bool rollback_off_loop(struct aoqd_session *s)
{
	aoqd_session_ref(s);
	if (aoqd_thread_detached(rollback_run, s) != 0) {
		aoqd_session_unref(s);
		return false;
	}
	return true;
}

/* Once nothing of the dead connection runs (only the list's reference is
 * left): the arena goes (a trainer that resumes gets a new one) and stops
 * counting against the quota, and the interrupted step goes back, on a
 * thread of its own but at a stop (the fd store keeps only settled
 * states).  The thread's end brings this back to mark the lease settled. */
void aoqd_lease_settle(struct aoqd_session *s)
{
	if (s->state != AOQD_LEASED || s->settled || aoqd_session_refcount(s) != 1)
		return;
	if (s->rolling_back) {
		s->rolling_back = false; /* its thread is gone with its reference */
		s->settled = true;
		aoqd_debug("session", "session %" PRIu64 ": lease settled at step %" PRIu64 " (rolled back off the loop)",
		           s->id, s->st.last_step);
		return;
	}
	if (s->arena.size && s->st.account) {
		uint64_t n = aoqd_page_round(s->arena.size);
		aoqd_account_uncharge(s->st.account, n);
		s->st.charged -= n;
	}
	struct aoqd_release later = AOQD_RELEASE_INIT;
	aoqd_arena_free_later(&s->arena, s->arena.size >= AOQD_RELEASE_OFF_LOOP_BYTES ? &later : NULL);
	aoqd_release_start(&later); /* a large arena's pages, off the loop */
	aoqd_arena_init(&s->arena);
	if (s->rep) {
		/* A leased group: its members are closed, their rings unused. */
		for (uint32_t k = 0; k < s->rep->world; k++)
			if (s->rep->members[k]) {
				aoqd_session_unref(s->rep->members[k]);
				s->rep->members[k] = NULL;
			}
	}
	if (!s->srv->stopping && aoqd_state_open_step(&s->st) && rollback_off_loop(s)) {
		s->rolling_back = true;
		return;
	}
	aoqd_state_rollback(&s->st, 1);
	s->settled = true;
	aoqd_debug("session", "session %" PRIu64 ": lease settled at step %" PRIu64, s->id, s->st.last_step);
}

struct settle_all {
	struct aoqd_server *srv;
	bool all;
};

/* One pass over the leases: settled where they can be; true when no
 * rollback is under way. */
static bool settled_all(void *arg)
{
	const struct settle_all *a = arg;
	bool busy = false;
	for (struct aoqd_session *s = a->srv->sessions; s; s = s->next) {
		if (a->all || s->rolling_back)
			aoqd_lease_settle(s);
		busy |= s->state == AOQD_LEASED && s->rolling_back;
	}
	return !busy;
}

void aoqd_leases_settle_all(struct aoqd_server *srv, bool all)
{
	struct settle_all a = { srv, all };
	if (!aoqd_poll_until(settled_all, &a, 60000))
		aoqd_warn("session", "a leased state's rollback has not ended within 60 s");
}

/* Ends a leased session for good: its memory and quota go back. */
void aoqd_lease_end(struct aoqd_session *s, const char *why, bool forget)
{
	if (forget)
		aoqd_session_forget_snapshot(s);
	aoqd_info("session", "session %" PRIu64 " (uid %u job '%s' rank %u): lease ended (%s)", s->id,
	          (unsigned)s->conn.uid, s->conn.job ? s->conn.job : "", s->conn.rank, why);
	s->state = AOQD_CLOSING;
	aoqd_session_set_leasing(s, false);
	aoqd_session_bury(s);
}

bool aoqd_lease_same_key(const struct aoqd_session *a, uid_t uid, const char *job, uint32_t rank)
{
	return a->conn.uid == uid && a->conn.rank == rank && a->conn.job && strcmp(a->conn.job, job) == 0;
}

struct aoqd_session *aoqd_lease_find(struct aoqd_server *srv, uid_t uid, const char *job, uint32_t rank)
{
	for (struct aoqd_session *o = srv->sessions; o; o = o->next)
		if (o->state == AOQD_LEASED && aoqd_lease_same_key(o, uid, job, rank))
			return o;
	return NULL;
}

int aoqd_lease_reserve(struct aoqd_session *s, const struct aoqd_session *l, uint32_t lanes, uint64_t *pages,
                       struct aoqd_error *err)
{
	/* The arena the resumed state will have: the leased state's tables
	 * with the options that shape the arena taken from s (as
	 * aoqd_lease_take does). */
	struct aoqd_state view = l->st;
	view.window = s->st.window;
	view.delayed = s->st.delayed;
	uint64_t size;
	int r = aoqd_arena_size(&view, s->srv->cfg.max_arena_bytes, lanes, &size);
	if (r < 0)
		return AOQD_FAIL(err, INVALID, "cannot resume job '%s' (leased session %" PRIu64 "): its arena would be "
		                 "%s; the lease stays", s->conn.job, l->id,
		                 r == -EFBIG ? "larger than max_arena_bytes" : strerror(-r));
	*pages = aoqd_page_round(size);
	/* s's own tables go at the takeover: they do not count here. */
	struct aoqd_account *acc = s->st.account;
	if (!acc)
		return 0;
	aoqd_account_uncharge(acc, s->st.charged);
	r = aoqd_account_charge(acc, *pages, s->st.quota);
	aoqd_account_charge(acc, s->st.charged, 0);
	if (r < 0)
		return AOQD_FAIL(err, QUOTA, "uid %u: cannot resume job '%s' (leased session %" PRIu64 "): its arena (%"
		                 PRIu64 " bytes) would pass the uid's quota of %" PRIu64 " bytes (max_state_bytes_per_uid); "
		                 "the lease stays", (unsigned)s->conn.uid, s->conn.job, l->id, size, aoqd_state_quota(&s->st));
	return 0;
}

int aoqd_lease_resume(struct aoqd_session *s, struct aoqd_error *err)
{
	struct aoqd_session *l = aoqd_lease_find(s->srv, s->conn.uid, s->conn.job, s->conn.rank);
	s->adopt_wait = 0;
	if (!l)
		return 0;
	if (!l->settled) {
		/* Its last jobs still run: the reply waits (a wake settles it). */
		s->adopt_wait = l->id;
		return AOQD_ADOPT_WAIT;
	}
	char why[512];
	if (aoqd_state_same_layout(&s->st, &l->st, why, sizeof(why)) < 0)
		return AOQD_FAIL(err, INVALID, "cannot resume job '%s' rank %u (leased session %" PRIu64 "): %s; "
		                 "'aoqctl drop %" PRIu64 "' ends it", s->conn.job, s->conn.rank, l->id, why, l->id);
	uint64_t pages;
	int r = aoqd_lease_reserve(s, l, 1, &pages, err);
	if (r < 0)
		return r;
	aoqd_lease_take(s, l, &s->st);
	s->st.charged += pages;
	s->arena_charged = pages;
	s->steps.next_step = s->st.last_step + 1;
	s->resumed_from = l->id;
	aoqd_info("session", "session %" PRIu64 ": resumes session %" PRIu64 " (job '%s' rank %u) at step %" PRIu64,
	          s->id, l->id, s->conn.job, s->conn.rank, s->st.last_step + 1);
	aoqd_lease_end(l, "resumed", false);
	return 1;
}

/* Leased session l's state goes to *dst (s->st, or s's new hub's): the
 * arrays, steps, hyperparameters and seed carry over; the options that
 * shape the arena and the steps are the new trainer's (s->st, whose tables
 * are freed, leaving s->st empty but for its account and quota when dst is
 * elsewhere). */
void aoqd_lease_take(struct aoqd_session *s, struct aoqd_session *l, struct aoqd_state *dst)
{
	/* The leased state's capture (idle: a settled lease has no snapshot
	 * in flight) points at l->st: freed here, the resumed session makes
	 * its own at its first snapshot. */
	aoqd_snapshot_state_free(&l->st);
	struct aoqd_state mine = s->st, old = l->st;
	old.window = mine.window;
	old.max_grad_norm = mine.max_grad_norm;
	old.skip_nonfinite = mine.skip_nonfinite;
	old.defer = mine.defer;
	old.delayed = mine.delayed;
	old.quota = mine.quota;
	bool want_undo = mine.undo;
	struct aoqd_account *acc = mine.account;
	aoqd_state_free(&mine, &s->srv->locked_bytes);
	memset(&s->st, 0, sizeof(s->st));
	s->st.account = acc;
	s->st.quota = old.quota;
	*dst = old;
	memset(&l->st, 0, sizeof(l->st));
	/* A state restored from a snapshot has no undo copy: it gets one
	 * now, so that this trainer's session is leased in turn. */
	int u = want_undo ? aoqd_state_add_undo(dst, &s->srv->locked_bytes) : 0;
	if (u < 0)
		aoqd_warn("session", "session %" PRIu64 ": no undo copy for the resumed state (%s): not leased if its "
		          "trainer dies", s->id, strerror(-u));
}

int64_t aoqd_lease_adopt(struct aoqd_server *srv, const struct aoqd_lease_key *key, struct aoqd_state *st,
                         uint64_t lease_ns, struct aoqd_error *err)
{
	for (struct aoqd_session *o = srv->sessions; o; o = o->next)
		if (o->state != AOQD_OBSERVER && o->state != AOQD_CLOSING &&
		    aoqd_lease_same_key(o, key->uid, key->job, key->rank)) {
			AOQD_FAIL(err, INVALID, "job '%s' rank %u of uid %u has session %" PRIu64 " already", key->job,
			          key->rank, (unsigned)key->uid, o->id);
			return -EEXIST;
		}
	struct aoqd_session *s = aoqd_session_new(srv);
	struct aoqd_account *a = aoqd_account_get(&srv->accounts, key->uid);
	char *job = strdup(key->job);
	/* a replica group's state: the next group of its job resumes it */
	struct aoqd_replica *rep = key->local_world > 1 ? calloc(1, sizeof(*rep)) : NULL;
	if (!s || !a || !job || (key->local_world > 1 && !rep) ||
	    (key->local_world > 1 && (key->rank != AOQD_GROUP_RANK || key->local_world > AOQ_MAX_LOCAL_WORLD))) {
		if (s)
			aoqd_session_unref(s);
		free(job);
		free(rep);
		if (rep || key->local_world > 1) {
			AOQD_FAIL(err, INVALID, "a replica group's state needs rank %u and 2 to %u local ranks",
			          AOQD_GROUP_RANK, AOQ_MAX_LOCAL_WORLD);
			return -EINVAL;
		}
		AOQD_FAIL(err, NO_MEMORY, "out of memory");
		return -ENOMEM;
	}
	s->conn.uid = key->uid;
	s->conn.gid = (gid_t)-1;
	s->conn.job = job;
	s->conn.rank = key->rank;
	s->conn.peer_pid = 0;
	s->id = ++srv->next_id;
	s->account = a;
	if (rep) {
		rep->world = key->local_world;
		s->rep = rep;
	}
	/* The limits of a live registration: the tables' sizes, the uid's
	 * sessions (leased ones included) and its quota. */
	uint64_t biggest = 0;
	for (uint32_t i = 0; i < st->ntensors; i++)
		if (st->tensors[i].numel > biggest)
			biggest = st->tensors[i].numel;
	if (st->ntensors > srv->cfg.max_tensors || biggest > srv->cfg.max_tensor_elems) {
		aoqd_session_unref(s); /* and job, rep */
		AOQD_FAIL(err, QUOTA, "%u tensors, the largest of %" PRIu64 " elements (max_tensors %u, max_tensor_elems %"
		          PRIu64 ")", st->ntensors, biggest, srv->cfg.max_tensors, srv->cfg.max_tensor_elems);
		return -EDQUOT;
	}
	uint32_t count = 0;
	for (struct aoqd_session *o = srv->sessions; o; o = o->next)
		if (o != s && o->conn.uid == key->uid && o->state != AOQD_OBSERVER && o->state != AOQD_CLOSING)
			count++;
	if (count >= srv->cfg.max_sessions_per_uid) {
		aoqd_session_unref(s); /* and job, rep */
		AOQD_FAIL(err, QUOTA, "uid %u has %u sessions, leased ones included (max_sessions_per_uid)",
		          (unsigned)key->uid, count);
		return -EDQUOT;
	}
	if (!st->account) {
		uint64_t n = 0;
		for (uint32_t i = 0; i < st->ntensors; i++)
			n += aoqd_page_round(st->tensors[i].state_len);
		if (aoqd_account_charge(a, n, srv->cfg.max_state_bytes_per_uid) < 0) {
			aoqd_session_unref(s); /* and job, rep */
			AOQD_FAIL(err, QUOTA, "uid %u: %" PRIu64 " bytes of state would pass its quota of %" PRIu64
			          " bytes (max_state_bytes_per_uid)", (unsigned)key->uid, n,
			          aoqd_account_limit(a, srv->cfg.max_state_bytes_per_uid));
			return -EDQUOT;
		}
		st->account = a;
		st->charged += n;
	}
	st->quota = srv->cfg.max_state_bytes_per_uid;
	s->st = *st;
	memset(st, 0, sizeof(*st));
	s->state = AOQD_LEASED;
	s->settled = true;
	s->lease_until = aoqd_now_ns() + lease_ns;
	aoqd_session_set_leasing(s, true);
	aoqd_session_link(s);
	aoqd_info("session", "session %" PRIu64 " (uid %u job '%s' rank %u): restored state leased for %" PRIu64
	          " s, resumable at step %" PRIu64, s->id, (unsigned)key->uid, job, key->rank, lease_ns / 1000000000u,
	          s->st.last_step + 1);
	return (int64_t)s->id;
}
