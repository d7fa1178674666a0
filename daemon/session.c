/* SPDX-License-Identifier: MIT */
/*
 * Sessions: creation on a new connection, references, the session list,
 * closing; the message table and dispatch(), where a handler's error
 * becomes a refusal or a failed session; the events that drive a session
 * besides its messages (the client's doorbell, the workers' wake).  Loop
 * thread, except aoqd_session_unref(), whose last call may come from a
 * worker.
 */
#include <errno.h>
#include <sched.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aoq-config.h"
#include "dataplane.h"
#include "log.h"
#include "register.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"
#include "transfer.h"
#include "wire.h"

/* Frames one connection may have handled per turn of the loop, and bytes
 * of frames (at least one frame): a Register frame of 1 MiB is some 50,000
 * tensors of work. */
#define FRAMES_PER_TURN 16
#define FRAME_BYTES_PER_TURN (128u << 10)

static void session_close(struct aoqd_session *s);
static void session_fail(struct aoqd_session *s, const struct aoqd_error *e);
static void trace_finish(struct aoqd_session *s);
static void trace_check(struct aoqd_session *s);
static void process_frames(struct aoqd_session *s);

/* ---- references and the list ---- */

void aoqd_session_ref(struct aoqd_session *s)
{
	atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
}

/* The LEASING bit of refs: set while the session is leased, so that the
 * reference before the last one, dropped on a worker, wakes the loop to
 * settle the lease.  It shares the count's word because nothing of s may
 * be read after the decrement (the loop may free s at once): the one
 * atomic read-modify-write tells both the count and whether to wake. */
#define REFS_LEASING (1 << 30)

void aoqd_session_set_leasing(struct aoqd_session *s, bool on)
{
	if (on)
		atomic_fetch_or_explicit(&s->refs, REFS_LEASING, memory_order_acq_rel);
	else
		atomic_fetch_and_explicit(&s->refs, ~REFS_LEASING, memory_order_acq_rel);
}

int aoqd_session_refcount(struct aoqd_session *s)
{
	return atomic_load_explicit(&s->refs, memory_order_acquire) & ~REFS_LEASING;
}

void aoqd_session_unref(struct aoqd_session *s)
{
	struct aoqd_server *srv = s->srv; /* outlives every session */
	int was = atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel);
	if (was == (REFS_LEASING | 2))
		uv_async_send(&srv->wake); /* the loop settles the lease */
	if ((was & ~REFS_LEASING) != 1)
		return;
	if (s->rep) {
		/* A replica group's hub: its members' references go now (their
		 * rings were the answers' way out). */
		for (uint32_t k = 0; k < s->rep->world; k++)
			if (s->rep->members[k])
				aoqd_session_unref(s->rep->members[k]);
		free(s->rep);
		s->rep = NULL;
	}
	aoqd_snapshot_state_free(&s->st);
	aoqd_state_free(&s->st, &s->srv->locked_bytes);
	aoqd_arena_free(&s->arena);
	aoqd_conn_free(&s->conn);
	aoqd_steps_fini(&s->steps);
	aoqd_stats_fini(&s->stats);
	free(s);
#ifdef __GLIBC__
	/* A session's end frees many small blocks (protobuf messages,
	 * tables, jobs) across the threads' malloc arenas: give their free
	 * pages back, so that a daemon whose trainers come and go for days
	 * does not keep the high-water mark (tests/bench/soak). */
	malloc_trim(0);
#endif
}

static void link_session(struct aoqd_session *s)
{
	struct aoqd_server *srv = s->srv;
	s->linked = true;
	s->next = srv->sessions;
	if (srv->sessions)
		srv->sessions->prev = s;
	srv->sessions = s;
}

/* Unlinks s; its own `next` stays, so that a walk standing on s goes on
 * (s is freed no earlier than the end of the loop's turn). */
static bool unlink_session(struct aoqd_session *s)
{
	struct aoqd_server *srv = s->srv;
	if (!s->linked)
		return false;
	s->linked = false;
	if (s->prev)
		s->prev->next = s->next;
	else
		srv->sessions = s->next;
	if (s->next)
		s->next->prev = s->prev;
	s->prev = NULL;
	return true;
}

/* Leased sessions that ended this turn (lease_end): their list reference
 * is dropped at the next wake, when no walk of the list stands on them. */
static struct aoqd_session *zombies;

static void reap_zombies(void)
{
	while (zombies) {
		struct aoqd_session *z = zombies;
		zombies = z->zombie_next;
		aoqd_session_unref(z);
	}
}

static void on_handle_closed(uv_handle_t *h)
{
	aoqd_session_unref(h->data);
}


/* ---- replica groups (docs/design.md, "Replica groups") ---- */

/* lease_adopt_cb's answers besides 0, 1 and errors */
#define ADOPT_WAIT 2
#define GROUP_JOINED 3

static struct aoqd_session *find_hub(struct aoqd_server *srv, uid_t uid, const char *job)
{
	for (struct aoqd_session *h = srv->hubs; h; h = h->next)
		if (h->conn.uid == uid && strcmp(h->conn.job, job) == 0)
			return h;
	return NULL;
}

/* A new hub for s's group: a session without a connection, not in the
 * session list; the hub list holds its first reference. */
static struct aoqd_session *hub_new(struct aoqd_session *s)
{
	struct aoqd_server *srv = s->srv;
	struct aoqd_session *h = calloc(1, sizeof(*h));
	struct aoqd_replica *rep = calloc(1, sizeof(*rep));
	char *job = strdup(s->conn.job);
	char *dev = strdup("group");
	if (!h || !rep || !job || !dev) {
		free(h);
		free(rep);
		free(job);
		free(dev);
		return NULL;
	}
	h->srv = srv;
	atomic_init(&h->refs, 1);
	aoqd_arena_init(&h->arena);
	aoqd_steps_init(&h->steps);
	aoqd_stats_init(&h->stats);
	h->id = ++srv->next_id;
	h->conn.uid = s->conn.uid;
	h->conn.gid = (gid_t)-1;
	h->conn.job = job;
	h->conn.device = dev;
	h->conn.rank = UINT32_MAX;
	h->account = s->account;
	h->state = AOQD_READY;
	h->lease_ns = s->lease_ns; /* the group's lease is its first member's */
	rep->world = s->local_world;
	h->rep = rep;
	return h;
}

/* Takes h off the hub list; the list's reference is the caller's now. */
static void hub_detach(struct aoqd_session *h)
{
	aoqd_step_close(h); /* its step, if one was open, will not end */
	/* as at a session's close (session_close): a snapshot waiting for a
	 * step's end or still preparing fails; one writing goes on */
	char gone[80];
	snprintf(gone, sizeof(gone), "replica group %" PRIu64 " ended", h->id);
	aoqd_snapshot_cancel(&h->st, gone);
	for (struct aoqd_session **p = &h->srv->hubs; *p; p = &(*p)->next)
		if (*p == h) {
			*p = h->next;
			h->next = NULL;
			return;
		}
}

static uint64_t lease_for(const struct aoqd_session *s);
static void lease_settle(struct aoqd_session *s);

/* The group's last member has closed.  When a member's trainer went away
 * (rep->lost) and the group has a lease, its state stays: the hub moves from
 * the hub list to the session list as a leased session keyed (uid, job,
 * AOQD_GROUP_RANK), whose interrupted step is rolled back once its last job
 * is done (lease_settle), and which the next group of the job with the same
 * local world and layout resumes (group_join).  Otherwise the state goes. */
static void group_gone(struct aoqd_session *h)
{
	uint64_t lease = h->rep->lost ? lease_for(h) : 0;
	hub_detach(h);
	if (!lease) {
		aoqd_session_unref(h); /* the hub list's */
		return;
	}
	link_session(h); /* the hub list's reference is the session list's now */
	h->state = AOQD_LEASED;
	h->lease_until = aoqd_now_ns() + lease;
	aoqd_session_set_leasing(h, true);
	aoqd_info("session", "replica group %" PRIu64 " (uid %u job '%s', %u local ranks): %s; state leased for %" PRIu64
	          " s, resumable at step %" PRIu64, h->id, (unsigned)h->conn.uid, h->conn.job, h->rep->world, h->rep->why,
	          lease / 1000000000u, h->st.last_step + 1);
	lease_settle(h);
}

/* Registration of a member (s->local_world > 1): the group's state is made
 * by its first member, checked against by the others; each gets its lane. */
static struct aoqd_session *find_leased(struct aoqd_server *srv, uid_t uid, const char *job, uint32_t rank);
static void take_leased_state(struct aoqd_session *s, struct aoqd_session *l, struct aoqd_state *dst);
static void lease_end(struct aoqd_session *s, const char *why);

static int group_join(struct aoqd_session *s, struct aoqd_error *err)
{
	struct aoqd_server *srv = s->srv;
	struct aoqd_session *h = find_hub(srv, s->conn.uid, s->conn.job);
	struct aoqd_session *l = h ? NULL : find_leased(srv, s->conn.uid, s->conn.job, AOQD_GROUP_RANK);
	int r;
	s->adopt_wait = 0;
	if (l && !l->settled) {
		/* The leased group's last jobs still run: the reply waits. */
		s->adopt_wait = l->id;
		return ADOPT_WAIT;
	}
	if (l) {
		/* The group's state was leased (a member's trainer went away):
		 * the first member of the new group resumes it, the others
		 * join as usual (docs/design.md, "Replica groups"). */
		char why[512];
		if (!l->rep || l->rep->world != s->local_world)
			return AOQD_FAIL(err, INVALID, "cannot resume the replica group of job '%s' (leased session %" PRIu64
			                 "): it has %u local ranks, this rank says %u; 'aoqctl drop %" PRIu64 "' ends it",
			                 s->conn.job, l->id, l->rep ? l->rep->world : 1, s->local_world, l->id);
		if (aoqd_state_same_layout(&s->st, &l->st, why, sizeof(why)) < 0)
			return AOQD_FAIL(err, INVALID, "cannot resume the replica group of job '%s' (leased session %" PRIu64
			                 "): %s; 'aoqctl drop %" PRIu64 "' ends it", s->conn.job, l->id, why, l->id);
		if (!(h = hub_new(s)))
			return AOQD_FAIL(err, NO_MEMORY, "out of memory");
		take_leased_state(s, l, &h->st);
		h->steps.next_step = h->st.last_step + 1;
		h->resumed_from = l->id;
		if ((r = aoqd_register_hub(h, s, true, err)) < 0) {
			aoqd_session_unref(h); /* the state goes: the new group failed to start */
			lease_end(l, "its resume failed");
			return r;
		}
		aoqd_info("session", "replica group %" PRIu64 ": resumes session %" PRIu64 " (job '%s', %u local ranks) at "
		          "step %" PRIu64, h->id, l->id, s->conn.job, s->local_world, h->st.last_step + 1);
		lease_end(l, "resumed");
		h->next = srv->hubs;
		srv->hubs = h;
	} else if (h) {
		struct aoqd_replica *rep = h->rep;
		if (rep->broken)
			return AOQD_FAIL(err, BUSY, "the replica group of job '%s' is ending (%s); join a new one once its "
			                 "members have closed", s->conn.job, rep->why);
		if (rep->world != s->local_world)
			return AOQD_FAIL(err, INVALID, "local world %u, but the replica group of job '%s' has %u local ranks",
			                 s->local_world, s->conn.job, rep->world);
		if (rep->members[s->local_rank])
			return AOQD_FAIL(err, BUSY, "local rank %u of job '%s' is in the replica group already (session %" PRIu64
			                 ")", s->local_rank, s->conn.job, rep->members[s->local_rank]->id);
		if ((r = aoqd_register_same(s, h, err)) < 0)
			return r;
	} else {
		if (!(h = hub_new(s)))
			return AOQD_FAIL(err, NO_MEMORY, "out of memory");
		if ((r = aoqd_register_hub(h, s, false, err)) < 0) {
			aoqd_session_unref(h);
			return r;
		}
		h->next = srv->hubs;
		srv->hubs = h;
	}
	struct aoqd_replica *rep = h->rep;
	aoqd_session_ref(s);
	rep->members[s->local_rank] = s;
	rep->joined++;
	rep->live++;
	aoqd_session_ref(h);
	s->hub = h;
	s->arrived = h->steps.next_step - 1;
	if ((r = aoqd_register_member(s, h, aoqd_session_on_doorbell, err)) < 0)
		return r;
	if (rep->joined == rep->world)
		uv_async_send(&srv->wake); /* records that waited for the group */
	return GROUP_JOINED;
}

/* Fails every other live member of m's group with PEER_LOST. */
static void group_fail_others(struct aoqd_session *m)
{
	struct aoqd_replica *rep = m->hub->rep;
	for (uint32_t k = 0; k < rep->world; k++) {
		struct aoqd_session *o = rep->members[k];
		if (!o || o == m || (o->state != AOQD_READY && o->state != AOQD_REGISTERING))
			continue;
		struct aoqd_error e;
		AOQD_FAIL(&e, PEER_LOST, "%s", rep->why);
		session_fail(o, &e);
	}
}

/* Member m leaves its group (closing or failing).  A clean leave (Bye with
 * the group between steps) ends the group's steps: the others may still
 * read state, and get PEER_LOST at their next record or StepEnd.  Any other
 * leave fails the others now; the group's workers stop, so no member waits
 * on an update that will not come.  The group's state goes with its last
 * member, unless a lost trainer (LEAVE_LOST) broke a group with a lease
 * (group_gone: the open step is rolled back), so a partial step is never
 * kept. */
enum leave { LEAVE_BYE, LEAVE_LOST, LEAVE_FAILED };

static void group_leave(struct aoqd_session *m, enum leave how)
{
	bool clean = how == LEAVE_BYE;
	struct aoqd_session *h = m->hub;
	if (!h)
		return;
	struct aoqd_replica *rep = h->rep;
	if (!rep->broken) {
		bool between = rep->joined == rep->world && rep->ends == 0 && aoqd_steps_idle(&h->steps) &&
		               h->steps.accepted[h->steps.next_step & 1] == 0;
		rep->broken = true;
		rep->lost = how == LEAVE_LOST;
		snprintf(rep->why, sizeof(rep->why), "local rank %u (session %" PRIu64 ", pid %d) %s replica group %" PRIu64
		         " of job '%s'%s", m->local_rank, m->id, (int)m->conn.peer_pid,
		         clean ? "left" : "was lost from", h->id, h->conn.job,
		         clean && between ? " between steps" : " in the middle of a step");
		aoqd_warn("session", "%s", rep->why);
		if (!(clean && between)) {
			atomic_store(&h->dead, true); /* the step's remaining updates are not run */
			group_fail_others(m);
		}
	}
}

/* A member closes: its reference on the hub goes; the last member's close
 * takes the hub off the list. */
static void group_close(struct aoqd_session *m)
{
	struct aoqd_session *h = m->hub;
	if (!h)
		return;
	group_leave(m, m->no_lease ? LEAVE_BYE : LEAVE_LOST);
	m->hub = NULL;
	if (--h->rep->live == 0)
		group_gone(h);
	aoqd_session_unref(h);
}

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
				session_fail(m, &err);
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
					session_fail(m, &err); /* and the group with it */
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
				process_frames(m); /* frames that waited behind StepEnd */
		}
		if (rep->broken)
			break;
	}
out:
	aoqd_session_unref(h);
}

/* ---- lease and resume ---- */

/* Nanoseconds the session's state is leased for if it closes now: only a
 * registered trainer that went away (no Bye, no failure, no drop), whose
 * state has its undo copy and no load since its last step, and while the
 * configured lease (reloadable) is on. */
static uint64_t lease_for(const struct aoqd_session *s)
{
	uint64_t cap = (uint64_t)s->srv->cfg.lease_seconds * 1000000000u;
	if (s->state != AOQD_READY || s->no_lease || !s->st.undo || s->st.dirty || s->srv->stopping)
		return 0;
	return s->lease_ns < cap ? s->lease_ns : cap;
}

/* Once nothing of the dead connection runs (only the list's reference is
 * left): the interrupted step goes back, the arena goes (a trainer that
 * resumes gets a new one) and stops counting against the quota. */
static void lease_settle(struct aoqd_session *s)
{
	if (s->state != AOQD_LEASED || s->settled || aoqd_session_refcount(s) != 1)
		return;
	aoqd_state_rollback(&s->st);
	if (s->arena.size && s->st.account) {
		uint64_t n = aoqd_page_round(s->arena.size);
		aoqd_account_uncharge(s->st.account, n);
		s->st.charged -= n;
	}
	aoqd_arena_free(&s->arena);
	aoqd_arena_init(&s->arena);
	if (s->rep) {
		/* A leased group: its members are closed, their rings unused. */
		for (uint32_t k = 0; k < s->rep->world; k++)
			if (s->rep->members[k]) {
				aoqd_session_unref(s->rep->members[k]);
				s->rep->members[k] = NULL;
			}
	}
	s->settled = true;
	aoqd_debug("session", "session %" PRIu64 ": lease settled at step %" PRIu64, s->id, s->st.last_step);
}

/* Ends a leased session for good: its memory and quota go back. */
static void lease_end(struct aoqd_session *s, const char *why)
{
	aoqd_info("session", "session %" PRIu64 " (uid %u job '%s' rank %u): lease ended (%s)", s->id,
	          (unsigned)s->conn.uid, s->conn.job ? s->conn.job : "", s->conn.rank, why);
	s->state = AOQD_CLOSING;
	aoqd_session_set_leasing(s, false);
	if (unlink_session(s)) {
		s->zombie_next = zombies;
		zombies = s;
		uv_async_send(&s->srv->wake);
	}
}

static bool same_key(const struct aoqd_session *a, uid_t uid, const char *job, uint32_t rank)
{
	return a->conn.uid == uid && a->conn.rank == rank && a->conn.job && strcmp(a->conn.job, job) == 0;
}

static struct aoqd_session *find_leased(struct aoqd_server *srv, uid_t uid, const char *job, uint32_t rank)
{
	for (struct aoqd_session *o = srv->sessions; o; o = o->next)
		if (o->state == AOQD_LEASED && same_key(o, uid, job, rank))
			return o;
	return NULL;
}


static int group_join(struct aoqd_session *s, struct aoqd_error *err);

/* The registration's adopt callback: takes the leased state of the same
 * key when its layout matches; a replica group's member joins its group
 * instead (GROUP_JOINED: registered and answered). */
static int lease_adopt_cb(struct aoqd_session *s, struct aoqd_error *err)
{
	if (s->local_world > 1)
		return group_join(s, err);
	struct aoqd_session *l = find_leased(s->srv, s->conn.uid, s->conn.job, s->conn.rank);
	s->adopt_wait = 0;
	if (!l)
		return 0;
	if (!l->settled) {
		/* Its last jobs still run: the reply waits (a wake settles it). */
		s->adopt_wait = l->id;
		return ADOPT_WAIT;
	}
	char why[512];
	if (aoqd_state_same_layout(&s->st, &l->st, why, sizeof(why)) < 0)
		return AOQD_FAIL(err, INVALID, "cannot resume job '%s' rank %u (leased session %" PRIu64 "): %s; "
		                 "'aoqctl drop %" PRIu64 "' ends it", s->conn.job, s->conn.rank, l->id, why, l->id);
	take_leased_state(s, l, &s->st);
	s->steps.next_step = s->st.last_step + 1;
	s->resumed_from = l->id;
	aoqd_info("session", "session %" PRIu64 ": resumes session %" PRIu64 " (job '%s' rank %u) at step %" PRIu64,
	          s->id, l->id, s->conn.job, s->conn.rank, s->st.last_step + 1);
	lease_end(l, "resumed");
	return 1;
}

/* Leased session l's state goes to *dst (s->st, or s's new hub's): the
 * arrays, steps, hyperparameters and seed carry over; the options that
 * shape the arena and the steps are the new trainer's (s->st, whose tables
 * are freed, leaving s->st empty but for its account and quota when dst is
 * elsewhere). */
static void take_leased_state(struct aoqd_session *s, struct aoqd_session *l, struct aoqd_state *dst)
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

struct aoqd_session *aoqd_session_find(struct aoqd_server *srv, uint64_t id)
{
	for (struct aoqd_session *s = srv->sessions; s; s = s->next)
		if (s->id == id && (s->state == AOQD_READY || s->state == AOQD_REGISTERING || s->state == AOQD_LEASED))
			return s;
	return NULL;
}

struct aoqd_session *aoqd_session_next(struct aoqd_server *srv, struct aoqd_session *s)
{
	for (s = s ? s->next : srv->sessions; s; s = s->next)
		if (s->state == AOQD_READY || s->state == AOQD_REGISTERING || s->state == AOQD_LEASED)
			return s;
	return NULL;
}

int64_t aoqd_lease_adopt(struct aoqd_server *srv, const struct aoqd_lease_key *key, struct aoqd_state *st,
                         uint64_t lease_ns, struct aoqd_error *err)
{
	for (struct aoqd_session *o = srv->sessions; o; o = o->next)
		if (o->state != AOQD_OBSERVER && o->state != AOQD_CLOSING && same_key(o, key->uid, key->job, key->rank)) {
			AOQD_FAIL(err, INVALID, "job '%s' rank %u of uid %u has session %" PRIu64 " already", key->job,
			          key->rank, (unsigned)key->uid, o->id);
			return -EEXIST;
		}
	struct aoqd_session *s = calloc(1, sizeof(*s));
	struct aoqd_account *a = aoqd_account_get(&srv->accounts, key->uid);
	char *job = strdup(key->job);
	/* a replica group's state: the next group of its job resumes it */
	struct aoqd_replica *rep = key->local_world > 1 ? calloc(1, sizeof(*rep)) : NULL;
	if (!s || !a || !job || (key->local_world > 1 && !rep) ||
	    (key->local_world > 1 && (key->rank != AOQD_GROUP_RANK || key->local_world > AOQ_MAX_LOCAL_WORLD))) {
		free(s);
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
	s->srv = srv;
	atomic_init(&s->refs, 1);
	aoqd_arena_init(&s->arena);
	aoqd_steps_init(&s->steps);
	aoqd_stats_init(&s->stats);
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
	if (!st->account) {
		uint64_t n = 0;
		for (uint32_t i = 0; i < st->ntensors; i++)
			n += aoqd_page_round(st->tensors[i].state_len);
		st->account = a;
		aoqd_account_charge(a, n, 0);
		st->charged += n;
	}
	st->quota = srv->cfg.max_state_bytes_per_uid;
	s->st = *st;
	memset(st, 0, sizeof(*st));
	s->state = AOQD_LEASED;
	s->settled = true;
	s->lease_until = aoqd_now_ns() + lease_ns;
	aoqd_session_set_leasing(s, true);
	link_session(s);
	aoqd_info("session", "session %" PRIu64 " (uid %u job '%s' rank %u): restored state leased for %" PRIu64
	          " s, resumable at step %" PRIu64, s->id, (unsigned)key->uid, job, key->rank, lease_ns / 1000000000u,
	          s->st.last_step + 1);
	return (int64_t)s->id;
}

/* Closes the connection and the doorbell, unlinks the session; the memory
 * goes with the last reference (running jobs hold one). */
static void session_close(struct aoqd_session *s)
{
	if (s->state == AOQD_LEASED) {
		lease_end(s, "server stopping");
		return;
	}
	/* observers (aoqctl) come and go every second: their lines are debug */
	bool quiet = s->state == AOQD_OBSERVER ||
	             (s->conn.job && strcmp(s->conn.job, "aoqctl") == 0);
	uint64_t lease = lease_for(s);
	atomic_store(&s->dead, true);
	s->state = AOQD_CLOSING;
	aoqd_step_close(s); /* an open step will not end */
	group_close(s); /* a replica group's member */
	trace_finish(s); /* what was recorded goes out */
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
		lease_settle(s);
		return;
	}
	if (unlink_session(s)) {
		const char *job = s->conn.job ? s->conn.job : "";
		aoqd_log(quiet ? AOQD_LOG_DEBUG : AOQD_LOG_INFO, "session",
		         "session %" PRIu64 " closed (job '%s' rank %u, %" PRIu64 " steps)",
		         s->id, job, s->conn.rank, s->stats.steps_done);
		aoqd_session_unref(s); /* the list's reference */
	}
}

void aoqd_sessions_sample(struct aoqd_server *srv)
{
	uint64_t now = aoqd_now_ns();
	struct aoqd_session *next;
	for (struct aoqd_session *s = srv->sessions; s; s = next) {
		next = s->next;
		if (s->state == AOQD_LEASED) {
			if (now >= s->lease_until)
				lease_end(s, "expired");
			continue;
		}
		if (s->state == AOQD_READY || s->state == AOQD_REGISTERING)
			aoqd_stats_sample(&s->stats, now);
		if (s->state == AOQD_READY && !s->hub)
			aoqd_steps_sample(s);
		trace_check(s);
	}
	for (struct aoqd_session *h = srv->hubs; h; h = h->next) {
		aoqd_stats_sample(&h->stats, now);
		aoqd_steps_sample(h); /* a snapshot of an idle group */
	}
}

void aoqd_sessions_close_all(struct aoqd_server *srv)
{
	while (srv->sessions)
		session_close(srv->sessions);
	reap_zombies();
}

/* ---- errors ---- */

/* The one place where an error fails a session: log, stop everything it
 * does, send the Error; the connection goes once it is written. */
static void session_fail(struct aoqd_session *s, const struct aoqd_error *e)
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
	group_leave(s, LEAVE_FAILED); /* the other members fail too (PEER_LOST) */
}

/* A handler's error: a refusal answers Error and goes on. */
static void session_error(struct aoqd_session *s, const struct aoqd_error *e)
{
	if (!e->refusal) {
		session_fail(s, e);
		return;
	}
	aoqd_info("session", "session %" PRIu64 ": request refused: %s: %s", s->id, aoq_error_name(e->code), e->msg);
	aoqd_conn_send_error(&s->conn, e->code, e->msg, false);
}

/* ---- handlers that belong to the session as a whole ---- */

static int on_hello(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__Hello *h = env->hello;
	const struct aoqd_config *cfg = &s->srv->cfg;
	struct aoqd_conn *c = &s->conn;
	if (h->protocol_version != AOQ_PROTOCOL_VERSION)
		return AOQD_FAIL(err, VERSION, "protocol version %u, this daemon speaks %u",
		                 h->protocol_version, AOQ_PROTOCOL_VERSION);
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
			    !same_key(o, c->uid, c->job, c->rank))
				continue;
			if (!aoqd_conn_peer_gone(&o->conn))
				return AOQD_FAIL(err, BUSY, "job '%s' rank %u of uid %u is connected already (session %" PRIu64
				                 ", pid %d)", c->job, c->rank, (unsigned)c->uid, o->id, (int)o->conn.peer_pid);
			session_close(o);
			break;
		}
		/* Leased sessions count, but not the one this trainer resumes. */
		uint32_t n = 0;
		for (struct aoqd_session *o = s->srv->sessions; o; o = o->next)
			if (o->conn.uid == c->uid && o->state != AOQD_OBSERVER && o != s &&
			    !(o->state == AOQD_LEASED && same_key(o, c->uid, c->job, c->rank)))
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
	w.limits = &lim;
	Aoq__Envelope r = AOQ__ENVELOPE__INIT;
	r.msg_case = AOQ__ENVELOPE__MSG_WELCOME;
	r.welcome = &w;
	aoqd_log(h->observer ? AOQD_LOG_DEBUG : AOQD_LOG_INFO, "session",
	         "session %" PRIu64 ": hello from pid %d uid %u job '%s' rank %u device '%s'%s", s->id,
	         (int)c->peer_pid, (unsigned)c->uid, c->job, c->rank, c->device, h->observer ? " (observer)" : "");
	aoqd_conn_send(c, &r);
	return AOQD_REPLIED;
}

static int on_register(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	int r = aoqd_register(s, env->register_, aoqd_session_on_doorbell, lease_adopt_cb, err);
	return r == ADOPT_WAIT ? AOQD_DEFERRED : r == GROUP_JOINED ? AOQD_REPLIED : r;
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

/* Root, or a member of admin_gid (primary or supplementary group). */
static bool is_admin(const struct aoqd_session *who)
{
	const struct aoqd_config *cfg = &who->srv->cfg;
	return who->conn.uid == 0 ||
	       (cfg->admin_gid != (uint32_t)-1 && aoqd_conn_in_group(&who->conn, (gid_t)cfg->admin_gid));
}

static bool may_see(const struct aoqd_session *who, const struct aoqd_session *s)
{
	return is_admin(who) || who->conn.uid == s->conn.uid;
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
		if (!may_see(who, s))
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
		x->parameters = s->st.parameters; /* no walk over the tensors: Stats costs O(sessions) */
		x->state = (char *)state_name(s->state);
		x->precision = s->st.precision;
		x->arena_bytes = s->arena.size;
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
	if (is_admin(who)) {
		st.locked_bytes = atomic_load(&srv->locked_bytes);
		st.rss_bytes = aoqd_rss_bytes();
	} else {
		/* Others' figures are not a plain user's business: only what
		 * its own sessions lock. */
		for (struct aoqd_session *s = srv->sessions; s; s = s->next)
			if (s->conn.uid == who->conn.uid)
				st.locked_bytes += s->st.locked_bytes;
		for (struct aoqd_session *h = srv->hubs; h; h = h->next)
			if (h->conn.uid == who->conn.uid)
				st.locked_bytes += h->st.locked_bytes;
	}
	st.uptime_seconds = (double)(aoqd_now_ns() - srv->start_ns) / 1e9;
	st.n_sessions = k;
	st.sessions = sp;
	st.version = AOQ_VERSION;
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

/* ---- traces ---- */

#define TRACE_MAX_STEPS 1000000 /* aoqctl's bound; memory is bounded by spans */
#define TRACE_SPANS_PER_FRAME 8192 /* a span packs to < 100 bytes */
#define TRACE_NAMES_BYTES (512u << 10)

/* Sends the trace's spans to whoever asked (frames of at most 1 MiB, more on
 * all but the last) and ends the trace.  Names only the tensors it uses. */
static void trace_finish(struct aoqd_session *s)
{
	struct aoqd_session *to = s->trace_to;
	if (!to)
		return;
	s->trace_to = NULL;
	aoqd_arena_set_trace(&s->arena, false);
	struct aoqd_trace t = aoqd_trace_take(&s->stats);
	if (t.full)
		aoqd_warn("session", "session %" PRIu64 ": trace cut at %zu spans", s->id, t.n);
	uint32_t nt = s->st.ntensors;
	uint32_t *map = calloc(nt ? nt : 1, sizeof(*map));
	char **names = calloc(nt ? nt : 1, sizeof(*names));
	Aoq__TraceSpan *sp = calloc(TRACE_SPANS_PER_FRAME, sizeof(*sp));
	Aoq__TraceSpan **spp = calloc(TRACE_SPANS_PER_FRAME, sizeof(*spp));
	if (!map || !names || !sp || !spp) {
		if (to->state != AOQD_CLOSING)
			aoqd_conn_send_error(&to->conn, AOQ__ERROR_CODE__NO_MEMORY, "out of memory for the trace", false);
		goto out;
	}
	uint32_t nnames = 0;
	size_t name_bytes = 0;
	for (size_t i = 0; i < t.n; i++) {
		uint32_t k = t.spans[i].tensor;
		if (k >= nt)
			continue;
		if (!map[k]) {
			const char *nm = s->st.tensors[k].name ? s->st.tensors[k].name : "";
			size_t len = strlen(nm) + 8;
			names[nnames] = (char *)(name_bytes + len <= TRACE_NAMES_BYTES ? nm : "?");
			name_bytes += len;
			map[k] = ++nnames;
		}
	}
	size_t i = 0;
	do {
		Aoq__Trace tr = AOQ__TRACE__INIT;
		tr.session = s->id;
		tr.job = s->conn.job ? s->conn.job : "";
		tr.rank = s->conn.rank;
		if (i == 0) {
			tr.n_tensor_names = nnames;
			tr.tensor_names = names;
		}
		size_t n = 0;
		for (; i < t.n && n < TRACE_SPANS_PER_FRAME; i++) {
			const struct aoqd_span *x = &t.spans[i];
			Aoq__TraceSpan *y = &sp[n];
			aoq__trace_span__init(y);
			y->step = x->step;
			y->tensor = x->tensor < nt ? map[x->tensor] - 1 : UINT32_MAX;
			y->kind = (Aoq__TraceSpanKind)x->kind;
			y->start_ns = x->start_ns;
			y->duration_ns = x->dur_ns;
			y->worker = x->worker;
			y->offset = x->offset;
			y->count = x->count;
			spp[n++] = y;
		}
		tr.n_spans = n;
		tr.spans = spp;
		tr.more = i < t.n;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_TRACE;
		env.trace = &tr;
		if (to->state == AOQD_CLOSING || aoqd_conn_send(&to->conn, &env) < 0)
			break;
	} while (i < t.n);
	aoqd_debug("session", "session %" PRIu64 ": trace of %zu spans sent to session %" PRIu64, s->id, t.n, to->id);
out:
	free(map);
	free(names);
	free(sp);
	free(spp);
	free(t.spans);
	aoqd_session_unref(to);
}

/* The traced steps have all ended (loop thread). */
static void trace_check(struct aoqd_session *s)
{
	if (s->trace_to && s->state == AOQD_READY)
		aoqd_arena_set_trace(&s->arena, true); /* the client times its copies */
	if (s->trace_to && (s->stats.steps_done >= s->trace_done_at || s->trace_to->state == AOQD_CLOSING))
		trace_finish(s);
}

/* TraceSpans: the client's timed copies (hostile input: every span is
 * checked, a bad one fails the session).  Kept when the step is traced. */
static int on_trace_spans(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__TraceSpans *m = env->trace_spans;
	if (m->n_spans > AOQ_TRACE_SPANS_MAX)
		return AOQD_FAIL(err, INVALID, "TraceSpans: %zu spans (at most %u)", m->n_spans, AOQ_TRACE_SPANS_MAX);
	uint64_t now = aoqd_now_ns(), end;
	for (size_t i = 0; i < m->n_spans; i++) {
		const Aoq__TraceSpan *x = m->spans[i];
		if ((x->kind != AOQ__TRACE_SPAN_KIND__SPAN_D2H && x->kind != AOQ__TRACE_SPAN_KIND__SPAN_H2D) ||
		    x->tensor >= s->st.ntensors || x->count == 0 ||
		    !aoq_range_ok(x->offset, x->count, s->st.tensors[x->tensor].numel) || x->start_ns == 0 ||
		    __builtin_add_overflow(x->start_ns, x->duration_ns, &end) || end > now)
			return AOQD_FAIL(err, INVALID, "TraceSpans: span %zu (kind %d, tensor %u) is impossible", i,
			                 (int)x->kind, x->tensor);
	}
	pthread_mutex_lock(&s->stats.lock);
	for (size_t i = 0; s->stats.trace.on && i < m->n_spans; i++) {
		const Aoq__TraceSpan *x = m->spans[i];
		struct aoqd_span sp = { .step = x->step, .start_ns = x->start_ns, .dur_ns = x->duration_ns,
		                        .offset = x->offset, .count = x->count, .tensor = x->tensor,
		                        .kind = x->kind == AOQ__TRACE_SPAN_KIND__SPAN_D2H ? AOQD_SPAN_D2H : AOQD_SPAN_H2D };
		aoqd_trace_add(&s->stats, &sp);
	}
	pthread_mutex_unlock(&s->stats.lock);
	return AOQD_REPLIED; /* a report: no reply */
}

/* TraceRequest: record the next `steps` steps of a session the asker may
 * see; the Trace frames go out once they have ended. */
static int on_trace(struct aoqd_session *who, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__TraceRequest *m = env->trace_request;
	if (m->steps == 0 || m->steps > TRACE_MAX_STEPS)
		return AOQD_REFUSE(err, INVALID, "trace: steps %u is not in 1..%u", m->steps, TRACE_MAX_STEPS);
	struct aoqd_session *s = who->srv->sessions;
	while (s && s->id != m->session)
		s = s->next;
	if (!s || s->state == AOQD_OBSERVER || s->state == AOQD_HELLO || s->state == AOQD_CLOSING ||
	    s->state == AOQD_LEASED || !may_see(who, s))
		return AOQD_REFUSE(err, NOT_FOUND, "no session %" PRIu64 " that you may trace", m->session);
	if (s == who)
		return AOQD_REFUSE(err, INVALID, "a session cannot trace itself");
	if (s->hub)
		return AOQD_REFUSE(err, INVALID, "traces of a replica group's members are not supported yet");
	if (s->trace_to)
		return AOQD_REFUSE(err, BUSY, "session %" PRIu64 " is being traced already", m->session);
	/* Step next_step may be under way, and the client may already be copying
	 * the one after it (next_step moves when the loop reads a StepEnd), with
	 * its copies untimed: the trace starts at the step after that.  The client
	 * times its copies from now on, so that step's are all timed. */
	uint64_t first = s->steps.next_step + 2;
	if (s->state == AOQD_READY)
		aoqd_arena_set_trace(&s->arena, true);
	if (aoqd_trace_start(&s->stats, first, first + m->steps - 1) < 0)
		return AOQD_REFUSE(err, BUSY, "session %" PRIu64 " is being traced already", m->session);
	/* steps_done counts StepEnded replies: the step before next_step may
	 * still be ending (end_pending), then next_step, then the traced ones,
	 * the step skipped above, then one more: the client reports a step's
	 * parameter copies (H2D) with the next StepEnd, once they have landed. */
	s->trace_done_at = s->stats.steps_done + (s->steps.end_pending ? 1 : 0) + 2 + m->steps + 1;
	aoqd_session_ref(who);
	s->trace_to = who;
	aoqd_info("session", "session %" PRIu64 ": tracing steps %" PRIu64 "..%" PRIu64 " for session %" PRIu64, s->id,
	          first, first + m->steps - 1, who->id);
	return AOQD_REPLIED;
}

/* ---- snapshots ---- */

/* SnapshotRequest: a snapshot of a session the asker may see; SnapshotDone
 * (or Error) comes once the file is on disk. */
static int on_snapshot(struct aoqd_session *who, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__SnapshotRequest *m = env->snapshot_request;
	struct aoqd_session *s = who->srv->sessions;
	while (s && s->id != m->session)
		s = s->next;
	if (!s || s->state != AOQD_READY || !may_see(who, s))
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
	session_close(s);
	return AOQD_REPLIED;
}

/* aoqctl drop: ends a session the asker may see (its own uid's; root and
 * admin_gid any), and its lease, for good. */
static int on_drop(struct aoqd_session *who, const Aoq__Envelope *env, struct aoqd_error *err)
{
	uint64_t id = env->drop_request->session;
	struct aoqd_session *s = aoqd_session_find(who->srv, id);
	if (!s || !may_see(who, s))
		return AOQD_REFUSE(err, NOT_FOUND, "no session %" PRIu64 " that you may drop", id);
	if (s == who)
		return AOQD_REFUSE(err, INVALID, "a session cannot drop itself (send Bye)");
	char why[64];
	snprintf(why, sizeof(why), "dropped by uid %u", (unsigned)who->conn.uid);
	if (s->state == AOQD_LEASED) {
		lease_end(s, why);
	} else {
		struct aoqd_error e;
		AOQD_FAIL(&e, NOT_FOUND, "session %" PRIu64 " %s (aoqctl drop)", id, why);
		s->no_lease = true;
		session_fail(s, &e);
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
	{ AOQ__ENVELOPE__MSG_STATS_REQUEST, IN(REGISTERING) | IN(READY) | IN(OBSERVER), "StatsRequest before Hello",
	  on_stats },
	{ AOQ__ENVELOPE__MSG_TRACE_REQUEST, IN(REGISTERING) | IN(READY) | IN(OBSERVER), "TraceRequest before Hello",
	  on_trace },
	{ AOQ__ENVELOPE__MSG_SNAPSHOT_REQUEST, IN(REGISTERING) | IN(READY) | IN(OBSERVER),
	  "SnapshotRequest before Hello", on_snapshot },
	{ AOQ__ENVELOPE__MSG_DROP_REQUEST, IN(REGISTERING) | IN(READY) | IN(OBSERVER), "DropRequest before Hello",
	  on_drop },
	{ AOQ__ENVELOPE__MSG_TRACE_SPANS, IN(READY), "TraceSpans before registration", on_trace_spans },
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
		session_error(s, &err);
	trace_check(s); /* a StepEnd may have ended the last traced step */
}

/* Decodes and handles every whole frame in the buffer, unless a deferred
 * reply (StepEnd, a transfer) holds the connection: replies go out in
 * request order. */
static void process_frames(struct aoqd_session *s)
{
	struct aoqd_conn *c = &s->conn;
	size_t off = 0;
	unsigned handled = 0;
	s->backlog = false;
	while (s->state != AOQD_CLOSING && !s->steps.end_pending && !s->steps.xfer_busy && !s->adopt_wait &&
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
			session_fail(s, &err);
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
	aoqd_conn_want_read(c, !s->steps.end_pending && !s->steps.xfer_busy && !s->adopt_wait &&
	                       aoqd_conn_queued(c) < AOQD_MAX_QUEUED_REPLY_BYTES);
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
	session_close(owner);
}

/* Reading stopped for a full write queue: go on once it drained. */
static void conn_writable(void *owner)
{
	struct aoqd_session *s = owner;
	if (!s->conn.reading && s->state != AOQD_CLOSING &&
	    aoqd_conn_queued(&s->conn) < AOQD_MAX_QUEUED_REPLY_BYTES / 2)
		process_frames(s);
}

static void conn_read(void *owner, ssize_t nread)
{
	struct aoqd_session *s = owner;
	if (nread == UV_ENOBUFS) {
		struct aoqd_error err;
		AOQD_FAIL(&err, QUOTA, "uid %u holds more than %" PRIu64 " bytes of unfinished frames "
		          "(max_buffered_bytes_per_uid)", (unsigned)s->conn.uid, s->srv->cfg.max_buffered_bytes_per_uid);
		session_fail(s, &err);
		return;
	}
	if (nread < 0) {
		if (nread != UV_EOF)
			aoqd_info("session", "session %" PRIu64 ": read: %s", s->id, uv_strerror((int)nread));
		else if (s->state == AOQD_READY)
			aoqd_info("session", "session %" PRIu64 ": client went away", s->id);
		session_close(s);
		return;
	}
	process_frames(s);
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
	struct aoqd_session *s = calloc(1, sizeof(*s));
	if (!s) {
		aoqd_err("server", "out of memory for a new connection");
		return;
	}
	s->srv = srv;
	atomic_init(&s->refs, 1); /* the list's */
	aoqd_arena_init(&s->arena);
	aoqd_steps_init(&s->steps);
	aoqd_stats_init(&s->stats);
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
	link_session(s);
	if (s->conn.uid == (uid_t)-1) {
		session_close(s);
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
		session_close(s);
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

/* Takes what the session's ring holds, as its doorbell does; true when it
 * took a record (records of the next step wait for StepEnd, and all wait
 * while the answers have no room). */
static bool ring_poll(struct aoqd_session *s)
{
	struct aoqd_error err;
	uint64_t tail = s->arena.to_daemon.tail;
	int r = aoqd_steps_poll(s, true, &err);
	if (r < 0)
		session_fail(s, &err);
	else if (r == 1)
		process_frames(s); /* frames that waited behind StepEnd */
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
 * spin; RESULTS.md, thirteenth session).
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
		 * p50 23.1 -> 18.4 us (RESULTS.md, seventeenth session) */
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
		/* The trainer died or left (its doorbell closes with its
		 * socket, in either order): the lease, if any, keeps its
		 * state, as when its connection ends first. */
		aoqd_info("session", "session %" PRIu64 ": client went away (doorbell closed)", s->id);
		session_close(s);
		return;
	}
	if (s->hub && status >= 0) {
		group_poll(s->hub);
		return;
	}
	if (status < 0) {
		AOQD_FAIL(&err, INTERNAL, "doorbell: %s", uv_strerror(status));
		session_fail(s, &err);
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
		session_fail(s, &err);
	}
}

void aoqd_sessions_wake(struct aoqd_server *srv)
{
	struct aoqd_session *next;
	reap_zombies();
	for (struct aoqd_session *s = srv->sessions; s; s = s->next)
		lease_settle(s);
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
			int r = aoqd_register_finish(s, aoqd_session_on_doorbell, lease_adopt_cb, &err);
			if (r < 0)
				session_error(s, &err);
			else if (r != ADOPT_WAIT)
				process_frames(s);
			aoqd_session_unref(s);
			again = true;
			break;
		}
	}
	for (struct aoqd_session *s = srv->sessions; s; s = next) {
		next = s->next;
		if (s->backlog && s->state != AOQD_CLOSING) {
			aoqd_session_ref(s);
			process_frames(s);
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
			session_fail(s, &err);
			continue;
		}
		if (r == 1)
			process_frames(s);
		if (s->state == AOQD_READY && aoqd_transfer_poll(s))
			process_frames(s);
		trace_check(s);
	}
	for (struct aoqd_session *h = srv->hubs; h; h = next) {
		next = h->next;
		group_poll(h);
	}
}
