/* SPDX-License-Identifier: MIT */
/*
 * A session's last references, dropped on two threads at once: a worker
 * drops the one its job held while the loop thread waits for the count to
 * reach 1 and drops the last (what session_close and the fuzz harness's
 * fz_close do).  The loop frees the session as soon as the worker's
 * decrement lands, so aoqd_session_unref must read nothing of the session
 * after it (CI's fuzz-session run once caught the old code reading
 * `leasing` there: a use after free under ASan).  With the session
 * leased, the worker's drop to the list's reference must wake the loop
 * every time, since that wake is what settles the lease.
 *
 * The race shows under ASan and TSan (run-all.sh's asan and tsan phases);
 * a plain build checks the wakes and that nothing hangs.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "expect.h"
#include "server.h"
#include "session.h"

#define ROUNDS 1000 /* TSan reports the race in any round */

static struct aoqd_server srv;
static _Atomic(struct aoqd_session *) handoff;
static int wakes_seen;

static void on_wake(uv_async_t *a)
{
	(void)a;
	wakes_seen++;
}

static void *worker(void *arg)
{
	(void)arg;
	for (int i = 0; i < ROUNDS; i++) {
		struct aoqd_session *s;
		while (!(s = atomic_exchange(&handoff, NULL)))
			sched_yield();
		aoqd_session_unref(s); /* 2 -> 1: the loop frees s right away */
	}
	return NULL;
}

static struct aoqd_session *new_session(bool leased)
{
	struct aoqd_session *s = calloc(1, sizeof(*s));
	if (!s)
		abort();
	s->srv = &srv;
	atomic_init(&s->refs, 1);
	aoqd_arena_init(&s->arena);
	aoqd_steps_init(&s->steps);
	aoqd_stats_init(&s->stats);
	aoqd_session_ref(s); /* the worker's job */
	if (leased)
		aoqd_session_set_leasing(s, true);
	return s;
}

int main(void)
{
	uv_loop_t *loop = uv_default_loop();
	if (uv_async_init(loop, &srv.wake, on_wake) != 0)
		return 1;
	pthread_t t;
	if (pthread_create(&t, NULL, worker, NULL) != 0)
		return 1;
	int leased_rounds = 0;
	for (int i = 0; i < ROUNDS; i++) {
		bool leased = i % 2;
		struct aoqd_session *s = new_session(leased);
		EXPECT(aoqd_session_refcount(s) == 2, "round %d: %d references after two refs", i,
		       aoqd_session_refcount(s));
		atomic_store(&handoff, s);
		/* spin: free as close to the worker's decrement as can be
		 * (yielding now and then for valgrind's one thread at a time) */
		for (unsigned spins = 1; aoqd_session_refcount(s) != 1; spins++)
			if (spins % 4096 == 0)
				sched_yield();
		aoqd_session_unref(s);
		leased_rounds += leased;
		/* uv_async_send coalesces: each leased round's wake is run
		 * before the next round begins. */
		if (leased) {
			int before = wakes_seen;
			for (int spins = 0; wakes_seen == before && spins < 100000; spins++)
				uv_run(loop, UV_RUN_NOWAIT);
			EXPECT(wakes_seen == before + 1, "round %d: the drop to the list's reference of a leased session did not wake the loop", i);
		}
	}
	pthread_join(t, NULL);
	uv_run(loop, UV_RUN_NOWAIT);
	EXPECT(wakes_seen == leased_rounds, "%d wakes for %d leased rounds", wakes_seen, leased_rounds);
	uv_close((uv_handle_t *)&srv.wake, NULL);
	uv_run(loop, UV_RUN_DEFAULT);
	uv_loop_close(loop);
	return failures != 0;
}
