/* SPDX-License-Identifier: MIT */
/*
 * The worker pool: one pinned thread per allowed core, running chunk tasks.
 * Every session has its own queue; workers take one task at a time from the
 * queues with work by deficit round robin over the tasks' costs (elements):
 * the queue in front runs tasks while it has credit, then goes to the back
 * and earns AOQD_POOL_QUANTUM more.  So every session with queued work gets
 * the same share of elements updated whatever its chunk sizes and queue
 * lengths: a job's large step cannot starve another's small one, which
 * waits at most a quantum (plus the chunks running) per other session
 * between its own tasks.  A queue that empties forfeits its credit.
 *
 * Within a session's queue, tasks run in the order of their keys, not of
 * their arrival: a job's chunks are submitted as one chain with one key, and
 * the chain with the smallest key goes first (equal keys: first come, first
 * served).  The data plane keys a job by step, then newest first
 * (dataplane.c, job_submit): gradients arrive in backward order, last
 * layer first, but the next forward needs the first layer first, so the
 * update of a layer that forward needs sooner overtakes the ones queued
 * before it.
 */
#ifndef AOQD_POOL_H
#define AOQD_POOL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

struct aoqd_key {
	uint64_t hi, lo;
};

struct aoqd_task {
	struct aoqd_task *next; /* in its chain */
	void (*run)(struct aoqd_task *t, unsigned worker);
	uint64_t cost; /* elements of work; 0 counts as a whole quantum */
	/* Set and read by the pool on the first task of a chain only: */
	struct aoqd_task *next_chain;
	struct aoqd_key key;
};

/* A sorted list of chains (their first tasks). */
struct aoqd_queue {
	struct aoqd_task *head, *tail;
	struct aoqd_queue *next; /* in the pool's round-robin list */
	bool active;
	uint64_t queued;
	int64_t credit; /* deficit round robin (under the pool's lock) */
};

struct aoqd_pool;

/* A queue's share per turn: 64 Ki elements, a quarter of the largest chunk
 * (dataplane.c), about 30 us of AdamW on one core. */
#define AOQD_POOL_QUANTUM 65536

/* cpus: the cores to pin to (n of them), or NULL for no pinning.  spin_ns:
 * how long a worker gone idle spins before it sleeps (0: it sleeps at
 * once; pool.c, spin_until_woken). */
struct aoqd_pool *aoqd_pool_new(unsigned n, const int *cpus, uint64_t spin_ns);
void aoqd_pool_free(struct aoqd_pool *p);
unsigned aoqd_pool_threads(const struct aoqd_pool *p);

/* Runs fn(args + k * size) for k < n, each on a thread of its own, the
 * first on this one (16 at most), and waits for them; a thread that cannot
 * start leaves its part to this one.  For the one-off copies of a start or
 * stop, outside the pool (fdstore.c, statemem.c). */
void aoqd_threads_run(void *(*fn)(void *), void *args, size_t size, unsigned n);
/* Starts fn(arg) on a detached thread of its own, outside the pool (a
 * large registration's build, a dead trainer's rollback): 0, or the
 * error pthread gave (nothing started). */
int aoqd_thread_detached(void *(*fn)(void *), void *arg);
/* The same, and aoqd_release_wait waits for it too (a release's pages
 * dropped: transfer.c). */
int aoqd_thread_waited(void *(*fn)(void *), void *arg);
/* Asks done(arg) every millisecond until it says true (true), or for `ms`
 * milliseconds at most (false): a stop waiting for detached threads. */
bool aoqd_poll_until(bool (*done)(void *), void *arg, unsigned ms);

/*
 * Mappings to unmap and fds to close on a thread of its own: freeing the
 * pages of a large state or arena (shared memory above all: 0.375 s for a
 * 2 GiB arena on a 2-core machine) would otherwise hold the loop, and
 * every session with it.  The accounting is the caller's, done at once.
 * aoqd_release: p (len bytes; NULL: none) and fd (-1: none) added to r,
 * or let go now when r is NULL or there is no memory for the list.
 * start: the list goes to a detached thread (or is let go here, if none
 * starts), and r is empty again.  wait: until every such thread is done
 * (60 s at most), before the process exits.
 */
struct aoqd_release {
	size_t n, cap;
	struct aoqd_release_item {
		void *p; /* NULL: fd alone */
		size_t len;
		int fd;  /* -1: mapping alone */
	} *v;
};
#define AOQD_RELEASE_INIT { 0, 0, NULL }
/* What is worth a thread: a state and arena of this many bytes or more. */
#define AOQD_RELEASE_OFF_LOOP_BYTES (64ull << 20)
void aoqd_release(struct aoqd_release *r, void *p, size_t len, int fd);
void aoqd_release_start(struct aoqd_release *r);
void aoqd_release_wait(void);

/* Queues the chain first..last (n tasks, linked by next) in q, after every
 * chain whose key is smaller or equal and before the others. */
void aoqd_pool_submit(struct aoqd_pool *p, struct aoqd_queue *q, struct aoqd_key key,
                      struct aoqd_task *first, struct aoqd_task *last, uint64_t n);

/* Tasks in q not yet started. */
uint64_t aoqd_pool_queued(struct aoqd_pool *p, struct aoqd_queue *q);

/* More tasks are queued than workers were woken for them: some wait for a
 * worker to finish.  A hint, read without the lock, for the loop's spin
 * (events.c, spin_start). */
bool aoqd_pool_backlog(struct aoqd_pool *p);

/* No task queued or running, in any queue. */
bool aoqd_pool_idle(struct aoqd_pool *p);
/* Waits until no task is queued or running, at most timeout_ns: true when
 * that is so on return.  *started (when not NULL): the tasks started so
 * far, to tell an idle time that went on from a new one.  For the snapshot
 * writer, which writes while the workers are idle (snapshot.c); the
 * workers signal it when the last running task ends with none queued,
 * under the lock they take anyway. */
bool aoqd_pool_wait_idle(struct aoqd_pool *p, uint64_t timeout_ns, uint64_t *started);
/* A session's step is open (from its first accepted gradient to its
 * StepEnded) / closed.  aoqd_pool_wait_idle() counts an open step as busy
 * even while no task runs: between two gradients of a step the workers
 * wait for the trainer, whose copies (the device's DMA into the arena, the
 * host backend's memcpy) are the step's path then, and a snapshot chunk
 * written there takes memory bandwidth from them (+60-85 ms per step at 1 G
 * parameters on the H200 host, tests/bench/RESULTS.md).  Loop thread. */
void aoqd_pool_step_open(struct aoqd_pool *p);
void aoqd_pool_step_close(struct aoqd_pool *p);
/* Waits until no task is queued or running, an open step or not (a gap in
 * a step), at most timeout_ns: true when that is so on return.  For the
 * writer's chunk that is due while a step is open (snapshot.c, pace_wait). */
bool aoqd_pool_wait_gap(struct aoqd_pool *p, uint64_t timeout_ns);

#endif
