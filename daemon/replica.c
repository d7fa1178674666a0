/* SPDX-License-Identifier: MIT */
/*
 * Replica groups (docs/design.md, "Replica groups"): the hubs' list, a
 * member's join (the group's state made by its first member, checked
 * against by the others, or a leased group's state resumed), a member's
 * leave and close, and the group's lease when its last member has gone.  A
 * group's poll is the loop's (events.c).  Loop thread.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "dataplane.h"
#include "lease.h"
#include "log.h"
#include "populate.h"
#include "register.h"
#include "replica.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"

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
	struct aoqd_session *h = aoqd_session_new(srv);
	struct aoqd_replica *rep = calloc(1, sizeof(*rep));
	char *job = strdup(s->conn.job);
	char *dev = strdup("group");
	if (!h || !rep || !job || !dev) {
		if (h)
			aoqd_session_unref(h);
		free(rep);
		free(job);
		free(dev);
		return NULL;
	}
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
	rep->progress_ns = aoqd_now_ns();
	h->rep = rep;
	return h;
}

/* Takes h off the hub list; the list's reference is the caller's now. */
static void hub_detach(struct aoqd_session *h)
{
	aoqd_step_close(h); /* its step, if one was open, will not end */
	/* as at a session's close (aoqd_session_close): a snapshot waiting for a
	 * step's end or still preparing fails; one writing goes on */
	char gone[80];
	snprintf(gone, sizeof(gone), "replica group %" PRIu64 " ended", h->id);
	aoqd_snapshot_cancel(&h->st, gone);
	aoqd_populate_stop(h); /* no member left to load or step */
	for (struct aoqd_session **p = &h->srv->hubs; *p; p = &(*p)->next)
		if (*p == h) {
			*p = h->next;
			h->next = NULL;
			return;
		}
}

/* The group's last member has closed.  When a member's trainer went away
 * (rep->lost) and the group has a lease, its state stays: the hub moves from
 * the hub list to the session list as a leased session keyed (uid, job,
 * AOQD_GROUP_RANK), whose interrupted step is rolled back once its last job
 * is done (aoqd_lease_settle), and which the next group of the job with the same
 * local world and layout resumes (group_join).  Otherwise the state goes. */
static void group_gone(struct aoqd_session *h)
{
	uint64_t lease = h->rep->lost ? aoqd_lease_for(h) : 0;
	hub_detach(h);
	if (!lease) {
		if (!h->srv->stopping)
			aoqd_session_forget_snapshot(h); /* the group's state ends here */
		aoqd_session_unref(h); /* the hub list's */
		return;
	}
	aoqd_session_link(h); /* the hub list's reference is the session list's now */
	h->state = AOQD_LEASED;
	h->lease_until = aoqd_now_ns() + lease;
	aoqd_session_set_leasing(h, true);
	aoqd_info("session", "replica group %" PRIu64 " (uid %u job '%s', %u local ranks): %s; state leased for %" PRIu64
	          " s, resumable at step %" PRIu64, h->id, (unsigned)h->conn.uid, h->conn.job, h->rep->world, h->rep->why,
	          lease / 1000000000u, h->st.last_step + 1);
	aoqd_lease_settle(h);
}

/* Registration of a member (s->local_world > 1): the group's state is made
 * by its first member, checked against by the others; each gets its lane. */
static int group_join(struct aoqd_session *s, struct aoqd_error *err)
{
	struct aoqd_server *srv = s->srv;
	struct aoqd_session *h = find_hub(srv, s->conn.uid, s->conn.job);
	struct aoqd_session *l = h ? NULL : aoqd_lease_find(srv, s->conn.uid, s->conn.job, AOQD_GROUP_RANK);
	int r;
	s->adopt_wait = 0;
	if (l && !l->settled) {
		/* The leased group's last jobs still run: the reply waits. */
		s->adopt_wait = l->id;
		return AOQD_ADOPT_WAIT;
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
		uint64_t pages;
		if ((r = aoqd_lease_reserve(s, l, s->local_world, &pages, err)) < 0)
			return r;
		if (!(h = hub_new(s))) {
			if (s->st.account)
				aoqd_account_uncharge(s->st.account, pages);
			return AOQD_FAIL(err, NO_MEMORY, "out of memory");
		}
		aoqd_lease_take(s, l, &h->st);
		h->st.charged += pages;
		h->arena_charged = pages;
		h->steps.next_step = h->st.last_step + 1;
		h->resumed_from = l->id;
		if ((r = aoqd_register_hub(h, s, true, err)) < 0) {
			aoqd_session_unref(h); /* the state goes: the new group failed to start */
			aoqd_lease_end(l, "its resume failed", true);
			return r;
		}
		aoqd_info("session", "replica group %" PRIu64 ": resumes session %" PRIu64 " (job '%s', %u local ranks) at "
		          "step %" PRIu64, h->id, l->id, s->conn.job, s->local_world, h->st.last_step + 1);
		aoqd_lease_end(l, "resumed", false);
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
	if ((r = aoqd_register_member(s, h, s->on_doorbell, err)) < 0)
		return r;
	if (rep->joined == rep->world)
		uv_async_send(&srv->wake); /* records that waited for the group */
	return AOQD_GROUP_JOINED;
}

bool aoqd_replica_leave(struct aoqd_session *m, enum aoqd_leave how)
{
	bool clean = how == AOQD_LEAVE_BYE;
	struct aoqd_session *h = m->hub;
	if (!h)
		return false;
	struct aoqd_replica *rep = h->rep;
	if (!rep->broken) {
		bool between = rep->joined == rep->world && rep->ends == 0 && aoqd_steps_idle(&h->steps) &&
		               h->steps.accepted[h->steps.next_step & 1] == 0;
		rep->broken = true;
		rep->lost = how == AOQD_LEAVE_LOST;
		snprintf(rep->why, sizeof(rep->why), "local rank %u (session %" PRIu64 ", pid %d) %s replica group %" PRIu64
		         " of job '%s'%s", m->local_rank, m->id, (int)m->conn.peer_pid,
		         clean ? "left" : "was lost from", h->id, h->conn.job,
		         clean && between ? " between steps" : " in the middle of a step");
		aoqd_warn("session", "%s", rep->why);
		if (!(clean && between)) {
			atomic_store(&h->dead, true); /* the step's remaining updates are not run */
			return true;
		}
	}
	return false;
}

void aoqd_replica_close(struct aoqd_session *m)
{
	struct aoqd_session *h = m->hub;
	if (!h)
		return;
	m->hub = NULL;
	if (--h->rep->live == 0)
		group_gone(h);
	aoqd_session_unref(h);
}

int aoqd_replica_adopt(struct aoqd_session *s, struct aoqd_error *err)
{
	return s->local_world > 1 ? group_join(s, err) : aoqd_lease_resume(s, err);
}

bool aoqd_replica_overdue(struct aoqd_session *h, uint64_t now)
{
	struct aoqd_replica *rep = h->rep;
	if (rep->broken)
		return false;
	uint64_t mark = rep->joined;
	for (uint32_t k = 0; k < rep->world; k++)
		if (rep->members[k])
			mark += rep->members[k]->arrived;
	if (mark != rep->progress_mark) {
		rep->progress_mark = mark;
		rep->progress_ns = now;
		return false;
	}
	uint32_t limit = h->srv->cfg.replica_wait_seconds;
	if (now - rep->progress_ns < (uint64_t)limit * 1000000000u)
		return false;
	/* Whom the group waits for: ranks not joined; else, once one member
	 * came to the open step, those that did not. */
	uint64_t step = h->steps.next_step;
	bool begun = false;
	for (uint32_t k = 0; k < rep->world; k++)
		if (rep->members[k] && rep->members[k]->arrived >= step)
			begun = true;
	if (rep->joined == rep->world && !begun)
		return false; /* every rank between steps: nobody waits */
	char ranks[120] = "";
	size_t n = 0;
	uint32_t missing = 0;
	for (uint32_t k = 0; k < rep->world; k++) {
		struct aoqd_session *m = rep->members[k];
		if (rep->joined < rep->world ? m != NULL : m->arrived >= step)
			continue;
		if (n < sizeof(ranks))
			n += (size_t)snprintf(ranks + n, sizeof(ranks) - n, "%s%u", missing ? ", " : "", k);
		missing++;
	}
	if (rep->joined < rep->world)
		snprintf(rep->why, sizeof(rep->why), "local rank%s %s of replica group %" PRIu64 " (job '%s') did not join "
		         "within %u s (replica_wait_seconds)", missing > 1 ? "s" : "", ranks, h->id, h->conn.job, limit);
	else
		snprintf(rep->why, sizeof(rep->why), "local rank%s %s of replica group %" PRIu64 " (job '%s') sent nothing "
		         "of step %" PRIu64 " within %u s of the others (replica_wait_seconds)", missing > 1 ? "s" : "",
		         ranks, h->id, h->conn.job, step, limit);
	aoqd_warn("session", "%s", rep->why);
	rep->broken = true;
	atomic_store(&h->dead, true); /* the step's remaining updates are not run */
	return true;
}
