/* SPDX-License-Identifier: MIT */
/*
 * The worker pool's order (daemon/pool.h): within a queue, chains run by
 * key (equal keys first come, first served; a chain's tasks in order, the
 * rest of a started chain before anything queued behind it); across
 * queues, deficit round robin by the tasks' costs (one task per turn when
 * every task costs a quantum).  One worker, held by a gate task while the
 * queues fill, makes the order deterministic.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "pool.h"

#include "expect.h"

struct ttask {
	struct aoqd_task task;
	char name[8];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static bool gate_open, gate_entered;
static char order[256];
static int ran;

static void run_gate(struct aoqd_task *t, unsigned worker)
{
	(void)t;
	(void)worker;
	pthread_mutex_lock(&lock);
	gate_entered = true;
	pthread_cond_broadcast(&cond);
	while (!gate_open)
		pthread_cond_wait(&cond, &lock);
	pthread_mutex_unlock(&lock);
}

static void run_rec(struct aoqd_task *t, unsigned worker)
{
	(void)worker;
	struct ttask *x = (struct ttask *)t;
	pthread_mutex_lock(&lock);
	if (strlen(order) + strlen(x->name) + 2 < sizeof(order)) {
		strcat(order, x->name);
		strcat(order, " ");
	}
	ran++;
	pthread_cond_broadcast(&cond);
	pthread_mutex_unlock(&lock);
}

/* x0 of the third case: runs, then queues y0 with a smaller key. */
struct inject {
	struct aoqd_pool *p;
	struct aoqd_queue *q;
	struct ttask *y;
};
static struct inject inject;

static void run_and_submit(struct aoqd_task *t, unsigned worker)
{
	run_rec(t, worker);
	memset(inject.y, 0, sizeof(*inject.y));
	snprintf(inject.y->name, sizeof(inject.y->name), "y0");
	inject.y->task.run = run_rec;
	aoqd_pool_submit(inject.p, inject.q, (struct aoqd_key){ 1, 6 }, &inject.y->task, &inject.y->task, 1);
}

/* Submits the tasks named in `names` (space-separated) as one chain. */
static void submit(struct aoqd_pool *p, struct aoqd_queue *q, struct ttask *pool, int *used,
                   uint64_t hi, uint64_t lo, const char *names)
{
	char buf[64];
	snprintf(buf, sizeof(buf), "%s", names);
	struct aoqd_task *first = NULL, *last = NULL;
	uint64_t n = 0;
	for (char *s = strtok(buf, " "); s; s = strtok(NULL, " ")) {
		struct ttask *x = &pool[(*used)++];
		memset(x, 0, sizeof(*x));
		snprintf(x->name, sizeof(x->name), "%s", s);
		x->task.run = run_rec;
		if (last)
			last->next = &x->task;
		else
			first = &x->task;
		last = &x->task;
		n++;
	}
	aoqd_pool_submit(p, q, (struct aoqd_key){ hi, lo }, first, last, n);
}

static void hold(struct aoqd_pool *p, struct aoqd_queue *gq, struct aoqd_task *gate)
{
	pthread_mutex_lock(&lock);
	gate_open = gate_entered = false;
	order[0] = 0;
	ran = 0;
	pthread_mutex_unlock(&lock);
	memset(gate, 0, sizeof(*gate));
	gate->run = run_gate;
	aoqd_pool_submit(p, gq, (struct aoqd_key){ 0, 0 }, gate, gate, 1);
	pthread_mutex_lock(&lock);
	while (!gate_entered)
		pthread_cond_wait(&cond, &lock);
	pthread_mutex_unlock(&lock);
}

/* Opens the gate and waits (at most 10 s) until n tasks ran. */
static void release_and_wait(int n)
{
	struct timespec dl;
	clock_gettime(CLOCK_REALTIME, &dl);
	dl.tv_sec += 10;
	pthread_mutex_lock(&lock);
	gate_open = true;
	pthread_cond_broadcast(&cond);
	while (ran < n && pthread_cond_timedwait(&cond, &lock, &dl) == 0)
		;
	pthread_mutex_unlock(&lock);
}

int main(void)
{
	struct aoqd_pool *p = aoqd_pool_new(1, NULL, 0);
	EXPECT(p != NULL, "pool");
	if (!p)
		return 1;
	static struct ttask tasks[64];
	struct aoqd_task gate;
	struct aoqd_queue g = { 0 }, a = { 0 }, b = { 0 };
	int used = 0;

	/* Keys order the chains of one queue. */
	hold(p, &g, &gate);
	submit(p, &a, tasks, &used, 1, 5, "a0 a1 a2");
	submit(p, &a, tasks, &used, 1, 2, "b0 b1"); /* to the front */
	submit(p, &a, tasks, &used, 1, 5, "c0");    /* equal key: behind a */
	submit(p, &a, tasks, &used, 0, 9, "d0");    /* earlier step first */
	submit(p, &a, tasks, &used, 1, 3, "e0");    /* into the middle */
	submit(p, &a, tasks, &used, 2, 0, "f0");    /* to the back */
	EXPECT(aoqd_pool_queued(p, &a) == 9, "queued %llu", (unsigned long long)aoqd_pool_queued(p, &a));
	release_and_wait(9);
	EXPECT(strcmp(order, "d0 b0 b1 e0 a0 a1 a2 c0 f0 ") == 0, "order by key: %s", order);
	EXPECT(aoqd_pool_queued(p, &a) == 0, "queued after");

	/* Keys decide at every take: a smaller key that arrives while a chain
	 * runs goes before that chain's remaining tasks. */
	used = 0;
	hold(p, &g, &gate);
	submit(p, &a, tasks, &used, 1, 7, "x0 x1 x2");
	tasks[0].task.run = run_and_submit;
	inject = (struct inject){ p, &a, &tasks[10] };
	release_and_wait(4);
	EXPECT(strcmp(order, "x0 y0 x1 x2 ") == 0, "a smaller key overtakes a running chain: %s", order);

	/* Round robin across queues: one task per turn. */
	used = 0;
	hold(p, &g, &gate);
	submit(p, &a, tasks, &used, 5, 0, "A0 A1 A2");
	submit(p, &b, tasks, &used, 9, 0, "B0 B1");
	release_and_wait(3 + 2);
	EXPECT(strcmp(order, "A0 B0 A1 B1 A2 ") == 0, "round robin: %s", order);

	/* Deficit round robin by cost: a queue of large tasks (4 quanta each)
	 * and one of small ones (a quarter quantum): the small queue's eight
	 * tasks, two quanta of work, run after one large task, not between
	 * large ones (one task per turn would interleave them A0 B0 A1 B1 ...
	 * and keep the small queue waiting for three large tasks). */
	used = 0;
	hold(p, &g, &gate);
	submit(p, &a, tasks, &used, 5, 0, "A0 A1 A2 A3");
	for (int i = 0; i < 4; i++)
		tasks[i].task.cost = 4 * AOQD_POOL_QUANTUM;
	submit(p, &b, tasks, &used, 9, 0, "B0 B1 B2 B3 B4 B5 B6 B7");
	for (int i = 4; i < 12; i++)
		tasks[i].task.cost = AOQD_POOL_QUANTUM / 4;
	release_and_wait(12);
	EXPECT(strcmp(order, "A0 B0 B1 B2 B3 B4 B5 B6 B7 A1 A2 A3 ") == 0, "fair share by cost: %s", order);

	/* Equal shares: two queues of the same cost per task alternate by
	 * quanta (two tasks of half a quantum per turn). */
	used = 0;
	hold(p, &g, &gate);
	submit(p, &a, tasks, &used, 5, 0, "A0 A1 A2 A3");
	submit(p, &b, tasks, &used, 9, 0, "B0 B1 B2 B3");
	for (int i = 0; i < 8; i++)
		tasks[i].task.cost = AOQD_POOL_QUANTUM / 2;
	release_and_wait(8);
	EXPECT(strcmp(order, "A0 A1 B0 B1 A2 A3 B2 B3 ") == 0, "equal shares: %s", order);

	aoqd_pool_free(p);

	/* Spinning workers (spin_ns): every task submitted runs, whether it
	 * comes while the worker spins (at once) or after the spin, when it
	 * sleeps (every 8th, after 3 ms); and a pool stops while its workers
	 * spin (freed right after the last task). */
	p = aoqd_pool_new(2, NULL, 1000000);
	EXPECT(p != NULL, "pool with spin");
	if (!p)
		return 1;
	pthread_mutex_lock(&lock);
	ran = 0;
	order[0] = 0;
	pthread_mutex_unlock(&lock);
	for (int i = 0; i < 64; i++) {
		struct ttask *x = &tasks[i];
		memset(x, 0, sizeof(*x));
		x->task.run = run_rec;
		snprintf(x->name, sizeof(x->name), "s");
		aoqd_pool_submit(p, &a, (struct aoqd_key){ 1, 0 }, &x->task, &x->task, 1);
		struct timespec dl;
		clock_gettime(CLOCK_REALTIME, &dl);
		dl.tv_sec += 10;
		pthread_mutex_lock(&lock);
		while (ran < i + 1 && pthread_cond_timedwait(&cond, &lock, &dl) == 0)
			;
		EXPECT(ran == i + 1, "spinning pool: task %d of 64 ran? (%d ran)", i, ran);
		pthread_mutex_unlock(&lock);
		if (i % 8 == 7)
			nanosleep(&(struct timespec){ 0, 3000000 }, NULL);
	}
	aoqd_pool_free(p);
	if (failures)
		fprintf(stderr, "%d failures\n", failures);
	else
		printf("ok\n");
	return failures != 0;
}
