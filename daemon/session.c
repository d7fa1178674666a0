/* SPDX-License-Identifier: MIT */
/*
 * A session's memory: creation, references (the last one frees it), the
 * session list, and who may see a session.  Loop thread, except
 * aoqd_session_unref(), whose last call may come from a worker, and
 * aoqd_session_ref().
 */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "log.h"
#include "pool.h"
#include "server.h"
#include "session.h"
#include "snapshot.h"

/* What the session gives its steps, data plane and transfers: they hold it
 * while a job, a transfer or a snapshot request runs for it. */
static const struct aoqd_steps_ops steps_ops = {
	.hold = aoqd_session_ref,
	.release = aoqd_session_unref,
};

struct aoqd_session *aoqd_session_new(struct aoqd_server *srv)
{
	struct aoqd_session *s = calloc(1, sizeof(*s));
	if (!s)
		return NULL;
	s->srv = srv;
	atomic_init(&s->refs, 1);
	aoqd_arena_init(&s->arena);
	aoqd_steps_init(&s->steps);
	s->steps.ops = &steps_ops;
	aoqd_stats_init(&s->stats);
	return s;
}

/* ---- references ---- */

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
	/* This may be the loop thread, which every other session waits on:
	 * the mappings and memfds of a large state and arena are let go on a
	 * thread of their own (2 GiB of shared-memory arena took 0.375 s on a
	 * 2-core machine, a state in a memfd more), the accounting now. */
	struct aoqd_release later = AOQD_RELEASE_INIT;
	struct aoqd_release *big = s->st.state_bytes + s->arena.size >= AOQD_RELEASE_OFF_LOOP_BYTES ? &later : NULL;
	aoqd_snapshot_state_free_later(&s->st, big);
	aoqd_state_free_later(&s->st, &s->srv->locked_bytes, big);
	aoqd_arena_free_later(&s->arena, big);
	aoqd_release_start(&later);
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

/* ---- the list ---- */

void aoqd_session_link(struct aoqd_session *s)
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
bool aoqd_session_unlink(struct aoqd_session *s)
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

/* Leased sessions that ended this turn (aoqd_session_bury): their list
 * reference is dropped at the next wake, when no walk of the list stands
 * on them. */
static struct aoqd_session *zombies;

void aoqd_session_bury(struct aoqd_session *s)
{
	if (aoqd_session_unlink(s)) {
		s->zombie_next = zombies;
		zombies = s;
		uv_async_send(&s->srv->wake);
	}
}

void aoqd_sessions_reap(void)
{
	while (zombies) {
		struct aoqd_session *z = zombies;
		zombies = z->zombie_next;
		aoqd_session_unref(z);
	}
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


void aoqd_session_forget_snapshot(struct aoqd_session *s)
{
	const char *dir = s->srv->cfg.state_dir;
	s->snap_forget = true;
	if (!dir || !*dir || !s->conn.job)
		return;
	struct aoqd_snap_key key = { .uid = (uint32_t)s->conn.uid, .rank = s->conn.rank,
		                     .local_world = s->rep ? s->rep->world : 0 };
	snprintf(key.job, sizeof(key.job), "%s", s->conn.job);
	char path[PATH_MAX];
	if (aoqd_snapshot_path(dir, &key, path, sizeof(path)) == 0 && unlink(path) == 0)
		aoqd_info("snapshot", "session %" PRIu64 ": %s removed (the state ended)", s->id, path);
}

/* Root, or a member of admin_gid (primary or supplementary group). */
bool aoqd_session_is_admin(const struct aoqd_session *who)
{
	const struct aoqd_config *cfg = &who->srv->cfg;
	return who->conn.uid == 0 ||
	       (cfg->admin_gid != (uint32_t)-1 && aoqd_conn_in_group(&who->conn, (gid_t)cfg->admin_gid));
}

bool aoqd_session_may_see(const struct aoqd_session *who, const struct aoqd_session *s)
{
	return aoqd_session_is_admin(who) || who->conn.uid == s->conn.uid;
}
