/* SPDX-License-Identifier: MIT */
/*
 * The snapshot writer's pacing (daemon/snapshot.c, "Pacing";
 * docs/snapshots.md, "Writing"), with a worker pool of one thread and the
 * writer thread, no daemon.  A capture of a 6 MiB state (block copies, no
 * undo copy) is armed at a boundary and written:
 *  - gate: a task holds the worker busy and the minimum rate is off (due
 *    in a minute): after 0.5 s the snapshot is not written; once the task
 *    ends it is, no chunk was written while the worker was busy, and the
 *    writer counts the wait;
 *  - step: no task runs but a step is open (aoqd_pool_step_open: the
 *    trainer is copying its next gradient): not written until it closes;
 *    with the minimum rate on, written in that gap as chunks come due,
 *    none counted as beside a busy worker;
 *  - guard: the worker is busy all the time: the snapshot is written
 *    anyway, its chunks due by the minimum rate (16 MiB/s after 100 ms of
 *    slack): not before that schedule allows (0.4 s) and well within it;
 *  - gap: the worker runs 30 ms tasks with 20 ms gaps (a training loop's
 *    update and forward pass), the minimum rate off: the snapshot is
 *    written in the gaps alone;
 *  - settle: the worker runs 2 ms tasks back to back, each submitted as
 *    the previous one ends (the pool idle for microseconds, as between two
 *    jobs of a step), the minimum rate off, the settling time 200 ms (not
 *    the default 2 ms: this host's scheduler can hold the submitting
 *    thread back a few ms): in 1 s no chunk is written (a writer that took
 *    every idle moment writes them all); once the tasks stop, all are.  A
 *    round in which the host held the trainer back for 100 ms (a real
 *    idle moment) is not counted, and another is run, five at most;
 *  - cache: with the worker idle, 256 KiB chunks: once written, at most
 *    three chunks of the file are left in the page cache (write-behind;
 *    skipped on tmpfs, which has no writeback);
 *  - stop: the worker is busy, the minimum rate off, and the writer is
 *    freed (aoqd stopping): the write in progress completes at once.
 * Each file loads and holds the state's arrays.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "pool.h"
#include "snapshot.h"

#include "expect.h"

#define NT 2
#define NUMEL (256u * 1024) /* per tensor: 3 MiB of fp32 AdamW state */

static _Atomic uint64_t locked;
static char dir[64];

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_ms(unsigned ms)
{
	struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000 };
	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

static void make_state(struct aoqd_state *st)
{
	memset(st, 0, sizeof(*st));
	st->precision = AOQ__STATE_PRECISION__STATE_FP32;
	st->ngroups = 1;
	st->groups = calloc(1, sizeof(*st->groups));
	Aoq__Hyperparams h = AOQ__HYPERPARAMS__INIT;
	h.lr = 1e-3;
	h.beta1 = 0.9;
	h.beta2 = 0.999;
	h.eps = 1e-8;
	aoqd_group_set(&st->groups[0], AOQ__OPTIMIZER_KIND__ADAMW, &h);
	st->groups[0].moments = aoqd_group_moments(&st->groups[0]);
	st->ntensors = NT;
	st->tensors = calloc(NT, sizeof(*st->tensors));
	for (uint32_t i = 0; i < NT; i++) {
		char nm[32];
		snprintf(nm, sizeof(nm), "w.%u", i);
		st->tensors[i].name = strdup(nm);
		st->tensors[i].numel = NUMEL;
		st->tensors[i].steps = 5;
		st->parameters += NUMEL;
	}
	uint64_t failed;
	if (aoqd_state_alloc(st, 0, &locked, &failed) < 0) {
		fprintf(stderr, "alloc failed\n");
		exit(1);
	}
	uint32_t x = 12345;
	for (uint32_t i = 0; i < NT; i++) {
		uint8_t *p = st->tensors[i].state_mem;
		for (size_t k = 0; k < st->tensors[i].state_len; k++) {
			x = x * 1103515245u + 12345u;
			p[k] = (uint8_t)(x >> 16);
		}
	}
}

static void free_state(struct aoqd_state *st)
{
	aoqd_snapshot_state_free(st);
	aoqd_state_free(st, &locked);
}

/* A task that keeps the worker busy: until `release` (hold) or for ms. */
struct busy {
	struct aoqd_task t;
	_Atomic bool release, done;
	unsigned ms;
	_Atomic double started, ended; /* now_s() on the worker */
};

static void busy_run(struct aoqd_task *t, unsigned worker)
{
	(void)worker;
	struct busy *b = (struct busy *)t;
	atomic_store(&b->started, now_s());
	if (b->ms) {
		double end = now_s() + b->ms / 1e3;
		while (now_s() < end) /* a compute loop, not a sleep */
			;
	} else {
		while (!atomic_load(&b->release))
			sleep_ms(1);
	}
	atomic_store(&b->ended, now_s());
	atomic_store(&b->done, true);
}

static struct aoqd_queue queue;

static void submit(struct aoqd_pool *p, struct busy *b, unsigned ms)
{
	memset(&b->t, 0, sizeof(b->t));
	b->t.run = busy_run;
	b->ms = ms;
	atomic_store(&b->release, false);
	atomic_store(&b->done, false);
	aoqd_pool_submit(p, &queue, (struct aoqd_key){ 0, 0 }, &b->t, &b->t, 1);
}

static void wait_done(struct busy *b)
{
	while (!atomic_load(&b->done))
		sleep_ms(1);
}

struct outcome {
	bool called;
	int r;
	char path[4096];
	char why[512];
};

static void on_done(void *arg, int r, const char *path, const char *why)
{
	struct outcome *o = arg;
	o->called = true;
	o->r = r;
	snprintf(o->path, sizeof(o->path), "%s", path ? path : "");
	snprintf(o->why, sizeof(o->why), "%s", why ? why : "");
}

/* Runs the loop until the snapshot is done or timeout_s passed. */
static bool run_until(uv_loop_t *loop, struct outcome *o, double timeout_s)
{
	double end = now_s() + timeout_s;
	while (!o->called && now_s() < end) {
		uv_run(loop, UV_RUN_NOWAIT);
		sleep_ms(2);
	}
	uv_run(loop, UV_RUN_NOWAIT);
	return o->called;
}

/* The file holds st's arrays. */
static void check_file(const char *what, const struct outcome *o, const struct aoqd_state *st)
{
	EXPECT(o->called && o->r == 0, "%s: snapshot failed: %d %s", what, o->r, o->why);
	if (!o->called || o->r != 0)
		return;
	struct aoqd_state back;
	struct aoqd_snap_key key;
	uint64_t step;
	char why[512];
	int r = aoqd_snapshot_load(o->path, 0, &locked, &key, &step, &back, why, sizeof(why));
	EXPECT(r == 0, "%s: load: %s", what, why);
	if (r != 0)
		return;
	EXPECT(step == 5 && back.ntensors == NT, "%s: step %" PRIu64 ", %u tensors", what, step, back.ntensors);
	for (uint32_t i = 0; i < NT && i < back.ntensors; i++) {
		const struct aoqk_state *a = &st->tensors[i].st, *b = &back.tensors[i].st;
		EXPECT(memcmp(a->master, b->master, NUMEL * 4) == 0 && memcmp(a->m, b->m, NUMEL * 4) == 0 &&
		               memcmp(a->v, b->v, NUMEL * 4) == 0,
		       "%s: tensor %u differs", what, i);
	}
	aoqd_state_free(&back, &locked);
}

static struct aoqd_snap_key key = { .uid = 1000, .rank = 0, .job = "pace" };

static void arm(struct aoqd_snapshotter *w, struct aoqd_state *st, struct outcome *o)
{
	struct aoqd_error err;
	memset(o, 0, sizeof(*o));
	int r = aoqd_snapshot_arm(w, st, &key, dir, 5, true, on_done, o, &err);
	EXPECT(r == 0, "arm: %s", err.msg);
}

struct stats {
	uint64_t chunks, forced, waited_ns;
};

static struct stats stats(struct aoqd_snapshotter *w)
{
	struct stats s;
	aoqd_snapshotter_pace_stats(w, &s.chunks, &s.forced, &s.waited_ns);
	return s;
}

/* The minimum rate off: a chunk is due after a minute. */
static const struct aoqd_snap_pace idle_only = { 256u << 10, 1, 60000000000ull, 2000000u };

static void gate(uv_loop_t *loop, struct aoqd_pool *pool, struct aoqd_snapshotter *w, struct aoqd_state *st)
{
	struct busy b;
	struct outcome o;
	aoqd_snapshotter_set_pace(w, &(struct aoqd_snap_pace){ 64u << 10, 1, 60000000000ull, 2000000u });
	struct stats s0 = stats(w);
	submit(pool, &b, 0);
	while (aoqd_pool_idle(pool))
		sleep_ms(1);
	arm(w, st, &o);
	run_until(loop, &o, 0.5);
	EXPECT(!o.called, "gate: the snapshot was written while the worker was busy");
	atomic_store(&b.release, true);
	double t0 = now_s();
	EXPECT(run_until(loop, &o, 30), "gate: no snapshot 30 s after the worker went idle");
	printf("gate: written %.3f s after the worker went idle\n", now_s() - t0);
	check_file("gate", &o, st);
	struct stats s1 = stats(w);
	EXPECT(s1.forced == s0.forced, "gate: %" PRIu64 " chunks written while the worker was busy",
	       s1.forced - s0.forced);
	EXPECT(s1.chunks - s0.chunks >= 6 * 16, "gate: %" PRIu64 " chunks", s1.chunks - s0.chunks);
	EXPECT(s1.waited_ns - s0.waited_ns >= 400000000u, "gate: waited %.3f s for the idle worker",
	       (double)(s1.waited_ns - s0.waited_ns) / 1e9);
	wait_done(&b);
}

/* An open step (aoqd_pool_step_open) with no task running: the workers
 * wait for the trainer's next gradient, whose copy is the step's path;
 * the writer waits as for a busy worker. */
static void step(uv_loop_t *loop, struct aoqd_pool *pool, struct aoqd_snapshotter *w, struct aoqd_state *st)
{
	struct outcome o;
	aoqd_snapshotter_set_pace(w, &(struct aoqd_snap_pace){ 64u << 10, 1, 60000000000ull, 2000000u });
	struct stats s0 = stats(w);
	aoqd_pool_step_open(pool);
	EXPECT(!aoqd_pool_wait_idle(pool, 20000000u, NULL), "step: the pool counts as idle with a step open");
	arm(w, st, &o);
	run_until(loop, &o, 0.5);
	EXPECT(!o.called, "step: the snapshot was written while a step was open");
	aoqd_pool_step_close(pool);
	EXPECT(aoqd_pool_wait_idle(pool, 1000000000u, NULL), "step: not idle once the step closed");
	EXPECT(run_until(loop, &o, 30), "step: no snapshot 30 s after the step closed");
	check_file("step", &o, st);
	struct stats s1 = stats(w);
	EXPECT(s1.forced == s0.forced, "step: %" PRIu64 " chunks written while the step was open", s1.forced - s0.forced);
	/* The minimum rate on (16 MiB/s after 100 ms) and the step kept open:
	 * the chunks come due and go out in the step's gap (no task runs),
	 * not counted as written beside a busy worker. */
	struct outcome o2;
	aoqd_snapshotter_set_pace(w, &(struct aoqd_snap_pace){ 256u << 10, 16u << 20, 100000000u, 2000000u });
	aoqd_pool_step_open(pool);
	double t0 = now_s();
	arm(w, st, &o2);
	EXPECT(run_until(loop, &o2, 30), "step: no snapshot in 30 s with the minimum rate on and a step open");
	double took = now_s() - t0;
	printf("step: written in %.3f s by the minimum rate in a step's gap\n", took);
	EXPECT(took >= 0.4, "step: written in %.3f s, before the minimum rate made it due", took);
	check_file("step, due", &o2, st);
	aoqd_pool_step_close(pool);
	struct stats s2 = stats(w);
	EXPECT(s2.forced == s1.forced, "step: %" PRIu64 " chunks counted as beside a busy worker in a step's gap",
	       s2.forced - s1.forced);
}

static void guard(uv_loop_t *loop, struct aoqd_pool *pool, struct aoqd_snapshotter *w, struct aoqd_state *st)
{
	struct busy b;
	struct outcome o;
	aoqd_snapshotter_set_pace(w, &(struct aoqd_snap_pace){ 256u << 10, 16u << 20, 100000000u, 2000000u });
	struct stats s0 = stats(w);
	submit(pool, &b, 0);
	while (aoqd_pool_idle(pool))
		sleep_ms(1);
	double t0 = now_s();
	arm(w, st, &o);
	bool done = run_until(loop, &o, 30);
	double took = now_s() - t0;
	EXPECT(done, "guard: no snapshot in 30 s while the worker is busy");
	EXPECT(!atomic_load(&b.done), "guard: the task ended");
	printf("guard: written in %.3f s while the worker was busy\n", took);
	check_file("guard", &o, st);
	struct stats s1 = stats(w);
	/* 24 chunks of 256 KiB: the last one is due 100 ms + 5.75 MiB / 16
	 * MiB/s = 0.46 s after the write began */
	EXPECT(s1.chunks - s0.chunks == 24 && s1.forced - s0.forced >= 20,
	       "guard: %" PRIu64 " chunks, %" PRIu64 " written while the worker was busy", s1.chunks - s0.chunks,
	       s1.forced - s0.forced);
	EXPECT(took >= 0.4, "guard: written in %.3f s, before the minimum rate made it due", took);
	atomic_store(&b.release, true);
	wait_done(&b);
}

struct trainer {
	struct aoqd_pool *pool;
	unsigned busy_ms, gap_ms;
	_Atomic bool stop;
	unsigned steps;
	double max_gap; /* s, the longest the worker waited for the next task */
};

/* Tasks of busy_ms, gap_ms apart (0: the next submitted as the last one
 * ends). */
static void *train(void *arg)
{
	struct trainer *t = arg;
	struct busy b;
	double last_end = 0;
	while (!atomic_load(&t->stop)) {
		submit(t->pool, &b, t->busy_ms);
		if (t->gap_ms) {
			wait_done(&b);
			while (!aoqd_pool_idle(t->pool))
				;
			sleep_ms(t->gap_ms);
		} else {
			while (!atomic_load(&b.done))
				;
		}
		double gap = atomic_load(&b.started) - last_end;
		if (last_end > 0 && gap > t->max_gap)
			t->max_gap = gap;
		last_end = atomic_load(&b.ended);
		t->steps++;
	}
	/* the wait the stop cut short (a trainer held back as the round
	 * ended submits no task whose start would count it) */
	double gap = now_s() - last_end;
	if (last_end > 0 && gap > t->max_gap)
		t->max_gap = gap;
	return NULL;
}

static void gap(uv_loop_t *loop, struct aoqd_pool *pool, struct aoqd_snapshotter *w, struct aoqd_state *st)
{
	struct outcome o;
	aoqd_snapshotter_set_pace(w, &idle_only);
	struct stats s0 = stats(w);
	struct trainer t = { .pool = pool, .busy_ms = 30, .gap_ms = 20 };
	pthread_t th;
	pthread_create(&th, NULL, train, &t);
	sleep_ms(50);
	double t0 = now_s();
	arm(w, st, &o);
	bool done = run_until(loop, &o, 30);
	double took = now_s() - t0;
	atomic_store(&t.stop, true);
	pthread_join(th, NULL);
	EXPECT(done, "gap: no snapshot in 30 s with 20 ms idle gaps");
	printf("gap: written in %.3f s over %u steps\n", took, t.steps);
	check_file("gap", &o, st);
	struct stats s1 = stats(w);
	EXPECT(s1.forced == s0.forced, "gap: %" PRIu64 " chunks written while the worker was busy",
	       s1.forced - s0.forced);
}

/* The check holds while the trainer keeps the worker fed: a host that
 * holds the submitting thread back for half the settling time (a loaded
 * machine under a sanitizer) makes a real idle moment, in which writing is
 * right.  Such a round is not counted and the next one tries again. */
static void settle(uv_loop_t *loop, struct aoqd_pool *pool, struct aoqd_snapshotter *w, struct aoqd_state *st)
{
	const double settle_s = 0.2;
	aoqd_snapshotter_set_pace(w, &(struct aoqd_snap_pace){ 64u << 10, 1, 60000000000ull, 200000000u });
	bool checked = false;
	for (int round = 0; round < 5 && !checked; round++) {
		struct outcome o;
		struct trainer t = { .pool = pool, .busy_ms = 2 };
		pthread_t th;
		pthread_create(&th, NULL, train, &t);
		sleep_ms(50);
		struct stats s0 = stats(w);
		arm(w, st, &o);
		run_until(loop, &o, 1.0);
		struct stats s1 = stats(w);
		atomic_store(&t.stop, true);
		pthread_join(th, NULL);
		printf("settle: %" PRIu64 " of 96 chunks written in 1 s of %u back-to-back tasks, "
		       "the longest wait for a task %.1f ms\n",
		       s1.chunks - s0.chunks, t.steps, t.max_gap * 1e3);
		if (t.max_gap < settle_s / 2) {
			checked = true;
			EXPECT(!o.called && s1.chunks == s0.chunks,
			       "settle: %" PRIu64 " of 96 chunks written between back-to-back tasks",
			       s1.chunks - s0.chunks);
		}
		EXPECT(run_until(loop, &o, 30), "settle: no snapshot 30 s after the tasks stopped");
		check_file("settle", &o, st);
	}
	if (!checked)
		printf("settle: not checked: the host held the trainer back in every round\n");
}

/* Pages of the file at path in the page cache, and its pages. */
static void cached(const char *path, size_t *resident, size_t *pages)
{
	*resident = *pages = 0;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	struct stat sb;
	if (fd < 0 || fstat(fd, &sb) < 0 || sb.st_size == 0) {
		if (fd >= 0)
			close(fd);
		return;
	}
	size_t page = (size_t)sysconf(_SC_PAGESIZE), len = (size_t)sb.st_size;
	void *m = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED)
		return;
	*pages = (len + page - 1) / page;
	unsigned char *v = calloc(*pages, 1);
	if (v && mincore(m, len, v) == 0)
		for (size_t i = 0; i < *pages; i++)
			*resident += v[i] & 1;
	free(v);
	munmap(m, len);
}

static void cache(uv_loop_t *loop, struct aoqd_pool *pool, struct aoqd_snapshotter *w, struct aoqd_state *st)
{
	(void)pool;
	struct statfs sf;
	if (statfs(dir, &sf) == 0 && (sf.f_type == TMPFS_MAGIC || sf.f_type == RAMFS_MAGIC)) {
		printf("cache: skipped (%s is tmpfs: no writeback)\n", dir);
		return;
	}
	struct outcome o;
	aoqd_snapshotter_set_pace(w, &idle_only);
	arm(w, st, &o);
	EXPECT(run_until(loop, &o, 30), "cache: no snapshot in 30 s");
	size_t resident, pages;
	cached(o.path, &resident, &pages);
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	printf("cache: %zu of the file's %zu pages in the page cache after the write\n", resident, pages);
	EXPECT(pages > 0 && resident * page <= 3 * (256u << 10) + 4 * page,
	       "cache: %zu of %zu pages left in the page cache", resident, pages);
	check_file("cache", &o, st);
}

static void stop(uv_loop_t *loop, struct aoqd_pool *pool, struct aoqd_snapshotter *w, struct aoqd_state *st)
{
	struct busy b;
	struct outcome o;
	aoqd_snapshotter_set_pace(w, &idle_only);
	submit(pool, &b, 0);
	while (aoqd_pool_idle(pool))
		sleep_ms(1);
	arm(w, st, &o);
	run_until(loop, &o, 0.3);
	EXPECT(!o.called, "stop: the snapshot was written while the worker was busy");
	double t0 = now_s();
	aoqd_snapshotter_free(w); /* finishes the write in progress */
	double took = now_s() - t0;
	printf("stop: the writer stopped in %.3f s\n", took);
	EXPECT(took < 10, "stop: the writer took %.3f s to stop", took);
	uv_run(loop, UV_RUN_NOWAIT);
	check_file("stop", &o, st);
	atomic_store(&b.release, true);
	wait_done(&b);
}

int main(void)
{
	snprintf(dir, sizeof(dir), "/tmp/aoq-pace-XXXXXX");
	if (!mkdtemp(dir))
		return 1;
	uv_loop_t loop;
	uv_loop_init(&loop);
	struct aoqd_pool *pool = aoqd_pool_new(1, NULL, 0);
	struct aoqd_snapshotter *w = aoqd_snapshotter_new(&loop, NULL, pool);
	if (!pool || !w) {
		fprintf(stderr, "cannot start the pool or the writer\n");
		return 1;
	}
	EXPECT(aoqd_pool_idle(pool), "a new pool is not idle");
	EXPECT(aoqd_pool_wait_idle(pool, 0, NULL), "a new pool is not idle");
	struct aoqd_state st;
	make_state(&st);
	gate(&loop, pool, w, &st);
	step(&loop, pool, w, &st);
	guard(&loop, pool, w, &st);
	gap(&loop, pool, w, &st);
	settle(&loop, pool, w, &st);
	cache(&loop, pool, w, &st);
	stop(&loop, pool, w, &st);
	uv_run(&loop, UV_RUN_DEFAULT); /* the writer's handle closes */
	uv_loop_close(&loop);
	aoqd_pool_free(pool);
	free_state(&st);
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "ls -A %s | grep -c '^\\.snapshot-' >/dev/null && exit 1; rm -rf %s", dir, dir);
	EXPECT(system(cmd) == 0, "a temp file was left in %s", dir);
	EXPECT(atomic_load(&locked) == 0, "locked bytes not given back");
	if (failures)
		fprintf(stderr, "%d failures\n", failures);
	return failures ? 1 : 0;
}
