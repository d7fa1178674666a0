/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "aoq-arena.h"
#include "log.h"
#include "pool.h"

struct worker {
	struct aoqd_pool *pool;
	pthread_t thread;
	unsigned index;
	int cpu;
	pthread_cond_t cond; /* its own: a submit wakes one chosen worker */
	/* On the idle stack: set and cleared under the pool's lock, read
	 * without it (atomically) while the worker spins (spin_until_woken). */
	bool idle;
};

/* Idle workers wait on a stack, and a submit wakes the one that went idle
 * last: its core is the warmest (caches, and not yet in a deep sleep
 * state), where a shared condition variable woke the one that had waited
 * longest (bench-spine on the 16-core H200 host, before this: a small
 * tensor's round trip p99 369 us with 15 workers, 46 us with one;
 * tests/bench/RESULTS.md). */
struct aoqd_pool {
	pthread_mutex_t lock;
	struct aoqd_queue *rr_head, *rr_tail; /* queues with work */
	bool stop;
	unsigned n;
	struct worker *workers;
	unsigned *idle; /* worker indexes, the last gone idle on top */
	unsigned nidle;
	/* Tasks queued that no worker has taken, and workers woken for them
	 * that have not run yet: written under the lock, atomically, for
	 * aoqd_pool_backlog, which reads them without. */
	uint64_t waiting;
	unsigned waking;
	/* For the snapshot writer (aoqd_pool_wait_idle): tasks running, and
	 * the threads waiting for none queued or running.  Kept under the
	 * lock the workers take anyway around each task: no cost added. */
	unsigned running;
	uint64_t started; /* tasks and steps opened, ever */
	unsigned steps_open; /* aoqd_pool_step_open */
	unsigned idle_waiters, gap_waiters;
	pthread_cond_t idle_cond; /* CLOCK_MONOTONIC */
	uint64_t spin_ns; /* an idle worker spins this long before it sleeps */
};

/* Wakes up to n idle workers, the warmest first.  Caller holds the lock. */
static void wake(struct aoqd_pool *p, uint64_t n)
{
	while (n-- > 0 && p->nidle > 0) {
		struct worker *w = &p->workers[p->idle[--p->nidle]];
		__atomic_store_n(&p->waking, p->waking + 1, __ATOMIC_RELAXED);
		__atomic_store_n(&w->idle, false, __ATOMIC_RELEASE);
		pthread_cond_signal(&w->cond);
	}
}

static bool key_less(struct aoqd_key a, struct aoqd_key b)
{
	return a.hi < b.hi || (a.hi == b.hi && a.lo < b.lo);
}

/* The first task of q's first chain; the rest of that chain stays first. */
static struct aoqd_task *pop_task(struct aoqd_queue *q)
{
	struct aoqd_task *t = q->head;
	struct aoqd_task *rest = t->next;
	if (rest) {
		rest->next_chain = t->next_chain;
		rest->key = t->key;
		if (q->tail == t)
			q->tail = rest;
		q->head = rest;
	} else {
		q->head = t->next_chain;
		if (!q->head)
			q->tail = NULL;
	}
	q->queued--;
	t->next = t->next_chain = NULL;
	return t;
}

/* Gradients come last layer first, so a new chain usually goes to the
 * front, and a tensor's later pieces right behind its earlier ones. */
static void insert_chain(struct aoqd_queue *q, struct aoqd_task *c)
{
	c->next_chain = NULL;
	if (!q->head) {
		q->head = q->tail = c;
	} else if (!key_less(c->key, q->tail->key)) {
		q->tail->next_chain = c;
		q->tail = c;
	} else if (key_less(c->key, q->head->key)) {
		c->next_chain = q->head;
		q->head = c;
	} else {
		struct aoqd_task *at = q->head;
		while (at->next_chain && !key_less(c->key, at->next_chain->key))
			at = at->next_chain;
		c->next_chain = at->next_chain;
		at->next_chain = c;
	}
}

/* Deficit round robin (pool.h): a front queue without credit earns a
 * quantum and goes to the back.  Ends: every pass adds a quantum to a queue
 * whose debt is at most one task's cost. */
static struct aoqd_task *take(struct aoqd_pool *p)
{
	struct aoqd_queue *q = p->rr_head;
	while (q->credit <= 0) {
		q->credit += AOQD_POOL_QUANTUM;
		if (q->next) {
			p->rr_head = q->next;
			q->next = NULL;
			p->rr_tail->next = q;
			p->rr_tail = q;
			q = p->rr_head;
		}
	}
	struct aoqd_task *t = pop_task(q);
	__atomic_store_n(&p->waiting, p->waiting - 1, __ATOMIC_RELAXED);
	q->credit -= (int64_t)(t->cost ? t->cost : AOQD_POOL_QUANTUM);
	if (!q->head) {
		p->rr_head = q->next;
		if (!p->rr_head)
			p->rr_tail = NULL;
		q->next = NULL;
		q->active = false;
		q->credit = 0;
	}
	return t;
}

/* CLOCK_MONOTONIC now + timeout_ns. */
static struct timespec deadline(uint64_t timeout_ns)
{
	struct timespec until;
	clock_gettime(CLOCK_MONOTONIC, &until);
	uint64_t ns = (uint64_t)until.tv_nsec + timeout_ns % 1000000000u;
	until.tv_sec += (time_t)(timeout_ns / 1000000000u + ns / 1000000000u);
	until.tv_nsec = (long)(ns % 1000000000u);
	return until;
}

/* A worker gone idle spins a while (lock dropped) before it sleeps on its
 * condition variable: a submit in that time (wake() clears idle) reaches it
 * without a futex wake-up.  Waking a sleeping core costs most of a small
 * tensor's round trip (bench-spine on the H200 host: record accepted ->
 * parameter posted p50 21.5 us for a 4.4 us chunk); the trainer's next
 * small push comes within tens of microseconds, so a worker that spins
 * 50 us catches it.  Only with a core of its own (pinned: the pool's
 * creator passes 0 otherwise), so the spin takes no one's CPU time.
 *
 * Pinned is not alone: the trainer's thread that the worker's answer wakes
 * may be placed on the worker's core (the scheduler puts a wakee near its
 * waker), and on 2 cores the loop thread shares it too.  So the spin yields
 * every 64 pauses (a few microseconds): a runnable thread on this core runs
 * at once instead of at the next tick.  bench-spine on a 2-core VM, 20
 * runs each, push -> param ready p99: without the yield 8 runs near 20 us
 * and 12 at 53-161 us; with it 16 under 53 us, none above 77 (2026-12-02,
 * 4da9cad; docs/operating.md, worker_spin_us; tests/bench/RESULTS.md,
 * "Control-plane latency").  Caller holds the lock; it is held again on
 * return. */
static void spin_until_woken(struct aoqd_pool *p, struct worker *w)
{
	pthread_mutex_unlock(&p->lock);
	struct timespec until = deadline(p->spin_ns), now;
	while (__atomic_load_n(&w->idle, __ATOMIC_ACQUIRE)) {
		for (int i = 0; i < 64; i++)
			aoq_cpu_relax();
		sched_yield();
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (now.tv_sec > until.tv_sec || (now.tv_sec == until.tv_sec && now.tv_nsec >= until.tv_nsec))
			break;
	}
	pthread_mutex_lock(&p->lock);
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct aoqd_pool *p = w->pool;
	if (w->cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(w->cpu, &set);
		if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0)
			aoqd_warn("pool", "worker %u: cannot pin to cpu %d", w->index, w->cpu);
	}
	pthread_mutex_lock(&p->lock);
	for (;;) {
		while (!p->stop && !p->rr_head) {
			__atomic_store_n(&w->idle, true, __ATOMIC_RELAXED);
			p->idle[p->nidle++] = w->index;
			if (p->spin_ns && !p->stop)
				spin_until_woken(p, w);
			while (w->idle && !p->stop)
				pthread_cond_wait(&w->cond, &p->lock);
			if (w->idle) { /* stop: off the stack by itself */
				unsigned k = 0;
				while (p->idle[k] != w->index)
					k++;
				memmove(&p->idle[k], &p->idle[k + 1], (p->nidle - k - 1) * sizeof(*p->idle));
				p->nidle--;
				__atomic_store_n(&w->idle, false, __ATOMIC_RELAXED);
			} else { /* woken by wake() */
				__atomic_store_n(&p->waking, p->waking - 1, __ATOMIC_RELAXED);
			}
		}
		if (!p->rr_head) /* stop, and nothing left */
			break;
		struct aoqd_task *t = take(p);
		p->running++;
		p->started++;
		pthread_mutex_unlock(&p->lock);
		t->run(t, w->index);
		pthread_mutex_lock(&p->lock);
		if (--p->running == 0 && !p->rr_head && ((!p->steps_open && p->idle_waiters) || p->gap_waiters))
			pthread_cond_broadcast(&p->idle_cond);
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

struct aoqd_pool *aoqd_pool_new(unsigned n, const int *cpus, uint64_t spin_ns)
{
	struct aoqd_pool *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->spin_ns = spin_ns;
	p->workers = calloc(n, sizeof(*p->workers));
	p->idle = calloc(n ? n : 1, sizeof(*p->idle));
	if (!p->workers || !p->idle) {
		free(p->workers);
		free(p->idle);
		free(p);
		return NULL;
	}
	pthread_mutex_init(&p->lock, NULL);
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&p->idle_cond, &ca);
	pthread_condattr_destroy(&ca);
	for (unsigned i = 0; i < n; i++)
		pthread_cond_init(&p->workers[i].cond, NULL);
	for (unsigned i = 0; i < n; i++) {
		struct worker *w = &p->workers[i];
		w->pool = p;
		w->index = i;
		w->cpu = cpus ? cpus[i] : -1;
		int r = pthread_create(&w->thread, NULL, worker_main, w);
		if (r != 0) {
			aoqd_err("pool", "cannot start worker %u: %s", i, strerror(r));
			p->n = i;
			aoqd_pool_free(p);
			errno = r;
			return NULL;
		}
		p->n = i + 1;
	}
	return p;
}

void aoqd_pool_free(struct aoqd_pool *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->lock);
	p->stop = true;
	for (unsigned i = 0; i < p->n; i++)
		pthread_cond_signal(&p->workers[i].cond);
	pthread_mutex_unlock(&p->lock);
	for (unsigned i = 0; i < p->n; i++)
		pthread_join(p->workers[i].thread, NULL);
	pthread_mutex_destroy(&p->lock);
	pthread_cond_destroy(&p->idle_cond);
	for (unsigned i = 0; i < p->n; i++)
		pthread_cond_destroy(&p->workers[i].cond);
	free(p->workers);
	free(p->idle);
	free(p);
}

unsigned aoqd_pool_threads(const struct aoqd_pool *p)
{
	return p->n;
}

void aoqd_pool_submit(struct aoqd_pool *p, struct aoqd_queue *q, struct aoqd_key key,
                      struct aoqd_task *first, struct aoqd_task *last, uint64_t n)
{
	last->next = NULL;
	first->key = key;
	pthread_mutex_lock(&p->lock);
	insert_chain(q, first);
	q->queued += n;
	__atomic_store_n(&p->waiting, p->waiting + n, __ATOMIC_RELAXED);
	if (!q->active) {
		q->active = true;
		q->credit = AOQD_POOL_QUANTUM;
		q->next = NULL;
		if (p->rr_tail)
			p->rr_tail->next = q;
		else
			p->rr_head = q;
		p->rr_tail = q;
	}
	wake(p, n);
	pthread_mutex_unlock(&p->lock);
}

uint64_t aoqd_pool_queued(struct aoqd_pool *p, struct aoqd_queue *q)
{
	pthread_mutex_lock(&p->lock);
	uint64_t n = q->queued;
	pthread_mutex_unlock(&p->lock);
	return n;
}

bool aoqd_pool_backlog(struct aoqd_pool *p)
{
	return __atomic_load_n(&p->waiting, __ATOMIC_RELAXED) > __atomic_load_n(&p->waking, __ATOMIC_RELAXED);
}

bool aoqd_pool_idle(struct aoqd_pool *p)
{
	pthread_mutex_lock(&p->lock);
	bool idle = !p->rr_head && p->running == 0;
	pthread_mutex_unlock(&p->lock);
	return idle;
}

bool aoqd_pool_wait_idle(struct aoqd_pool *p, uint64_t timeout_ns, uint64_t *started)
{
	struct timespec until = deadline(timeout_ns);
	pthread_mutex_lock(&p->lock);
	p->idle_waiters++;
	int r = 0;
	while ((p->rr_head || p->running || p->steps_open) && r != ETIMEDOUT)
		r = pthread_cond_timedwait(&p->idle_cond, &p->lock, &until);
	p->idle_waiters--;
	bool idle = !p->rr_head && p->running == 0 && !p->steps_open;
	if (started)
		*started = p->started;
	pthread_mutex_unlock(&p->lock);
	return idle;
}

bool aoqd_pool_wait_gap(struct aoqd_pool *p, uint64_t timeout_ns)
{
	struct timespec until = deadline(timeout_ns);
	pthread_mutex_lock(&p->lock);
	p->gap_waiters++;
	int r = 0;
	while ((p->rr_head || p->running) && r != ETIMEDOUT)
		r = pthread_cond_timedwait(&p->idle_cond, &p->lock, &until);
	p->gap_waiters--;
	bool gap = !p->rr_head && p->running == 0;
	pthread_mutex_unlock(&p->lock);
	return gap;
}

void aoqd_pool_step_open(struct aoqd_pool *p)
{
	pthread_mutex_lock(&p->lock);
	p->steps_open++;
	p->started++; /* a busy time begins: the writer's settle starts over */
	pthread_mutex_unlock(&p->lock);
}

void aoqd_pool_step_close(struct aoqd_pool *p)
{
	pthread_mutex_lock(&p->lock);
	if (p->steps_open && --p->steps_open == 0 && !p->rr_head && !p->running && p->idle_waiters)
		pthread_cond_broadcast(&p->idle_cond);
	pthread_mutex_unlock(&p->lock);
}

void aoqd_threads_run(void *(*fn)(void *), void *args, size_t size, unsigned n)
{
	pthread_t tid[16];
	bool started[16] = { false };
	if (n > 16)
		n = 16;
	for (unsigned k = 1; k < n; k++)
		started[k] = pthread_create(&tid[k], NULL, fn, (char *)args + k * size) == 0;
	if (n)
		fn(args);
	for (unsigned k = 1; k < n; k++) {
		if (started[k])
			pthread_join(tid[k], NULL);
		else
			fn((char *)args + k * size);
	}
}

int aoqd_thread_detached(void *(*fn)(void *), void *arg)
{
	pthread_t t;
	pthread_attr_t at;
	int e = pthread_attr_init(&at);
	if (e != 0)
		return e;
	e = pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	if (e == 0)
		e = pthread_create(&t, &at, fn, arg);
	pthread_attr_destroy(&at);
	return e;
}

static void let_go(const struct aoqd_release_item *it)
{
	if (it->p)
		munmap(it->p, it->len);
	if (it->fd >= 0)
		close(it->fd);
}

void aoqd_release(struct aoqd_release *r, void *p, size_t len, int fd)
{
	struct aoqd_release_item it = { p, len, fd };
	if (r && r->n == r->cap) {
		size_t cap = r->cap ? 2 * r->cap : 16;
		struct aoqd_release_item *v = realloc(r->v, cap * sizeof(*v));
		if (v) {
			r->v = v;
			r->cap = cap;
		}
	}
	if (r && r->n < r->cap)
		r->v[r->n++] = it;
	else
		let_go(&it);
}

static _Atomic int releasing;

/* Lets go of r's items and frees its list. */
static void release_items(struct aoqd_release *r)
{
	for (size_t i = 0; i < r->n; i++)
		let_go(&r->v[i]);
	free(r->v);
	*r = (struct aoqd_release)AOQD_RELEASE_INIT;
}

static void *release_run(void *arg)
{
	release_items(arg);
	free(arg);
	atomic_fetch_sub_explicit(&releasing, 1, memory_order_release);
	return NULL;
}

struct waited {
	void *(*fn)(void *);
	void *arg;
};

static void *waited_run(void *arg)
{
	struct waited w = *(struct waited *)arg;
	free(arg);
	w.fn(w.arg);
	atomic_fetch_sub_explicit(&releasing, 1, memory_order_release);
	return NULL;
}

int aoqd_thread_waited(void *(*fn)(void *), void *arg)
{
	struct waited *w = malloc(sizeof(*w));
	if (!w)
		return ENOMEM;
	*w = (struct waited){ fn, arg };
	atomic_fetch_add_explicit(&releasing, 1, memory_order_acq_rel);
	int e = aoqd_thread_detached(waited_run, w);
	if (e != 0) {
		atomic_fetch_sub_explicit(&releasing, 1, memory_order_release);
		free(w);
	}
	return e;
}

void aoqd_release_start(struct aoqd_release *r)
{
	struct aoqd_release *mine = r->n ? malloc(sizeof(*mine)) : NULL;
	if (!mine) {
		release_items(r); /* nothing, or no memory: here */
		return;
	}
	*mine = *r;
	*r = (struct aoqd_release)AOQD_RELEASE_INIT;
	atomic_fetch_add_explicit(&releasing, 1, memory_order_acq_rel);
	if (aoqd_thread_detached(release_run, mine) != 0) {
		atomic_fetch_sub_explicit(&releasing, 1, memory_order_release);
		release_items(mine);
		free(mine);
	}
}

bool aoqd_poll_until(bool (*done)(void *), void *arg, unsigned ms)
{
	for (unsigned waited = 0; !done(arg); waited++) {
		if (waited == ms)
			return false;
		usleep(1000);
	}
	return true;
}

static bool released(void *arg)
{
	(void)arg;
	return atomic_load_explicit(&releasing, memory_order_acquire) == 0;
}

void aoqd_release_wait(void)
{
	if (!aoqd_poll_until(released, NULL, 60000))
		aoqd_warn("pool", "memory still being let go after 60 s");
}
