/* SPDX-License-Identifier: MIT */
/*
 * The worker pool: one pinned thread per allowed core, running chunk tasks.
 * Every session has its own queue; workers take one task at a time from the
 * queues with work in round-robin order, so sessions share the pool fairly
 * whatever their queue lengths.
 */
#ifndef AOQD_POOL_H
#define AOQD_POOL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

struct aoqd_task {
	struct aoqd_task *next;
	void (*run)(struct aoqd_task *t, unsigned worker);
};

struct aoqd_queue {
	struct aoqd_task *head, *tail;
	struct aoqd_queue *next; /* in the pool's round-robin list */
	bool active;
	uint64_t queued;
};

struct aoqd_pool;

/* cpus: the cores to pin to (n of them), or NULL for no pinning. */
struct aoqd_pool *aoqd_pool_new(unsigned n, const int *cpus);
void aoqd_pool_free(struct aoqd_pool *p);
unsigned aoqd_pool_threads(const struct aoqd_pool *p);

/* Appends the chain first..last (n tasks) to q. */
void aoqd_pool_submit(struct aoqd_pool *p, struct aoqd_queue *q,
                      struct aoqd_task *first, struct aoqd_task *last, uint64_t n);

/* Tasks in q not yet started. */
uint64_t aoqd_pool_queued(struct aoqd_pool *p, struct aoqd_queue *q);

#endif
