/* SPDX-License-Identifier: MIT */
/*
 * The consistent capture of a live state at a step boundary
 * (docs/design.md, "Snapshots") and the writer thread that copies and
 * writes it off the loop (snapfile.c writes the file).
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "aoq-arena.h"
#include "aoq-config.h"
#include "log.h"
#include "pool.h"
#include "snapshot.h"

/* ---- the capture ---- */

enum { T_PENDING, T_COPYING, T_DONE };

/* The capture copies a tensor in blocks of this many elements (a multiple
 * of AOQK_Q8_BLOCK), each before its first update after the boundary: the
 * workers that update a block copy it, in parallel, and only what they
 * touch; a whole tensor at a time made every other worker wait for one
 * copy of it (0.8-0.96 s added to the first step after a request at 64 Mi
 * parameters in 16 tensors on the H200 host). */
#define CAPTURE_BLOCK (1u << 18)

/*
 * The undo swap.  A session that may be leased keeps an undo copy of its
 * state (state.h): before its first update in a step, every range of the
 * state is saved there, on its own pages after the state's.  So when the
 * step after the boundary ends, the undo copy holds the state at the
 * boundary for every range that step updated.  Such a capture copies
 * nothing while training goes on: at that step's end (the loop thread,
 * nothing in flight, the next step's records held) it moves the undo
 * copy's pages out to the capture (mremap: page tables, no data), maps
 * fresh pages in their place for the next step's saves, and copies from
 * the live state only the ranges that step did not update (none when every
 * tensor took the whole step); then the writer writes.  Without an undo
 * copy, or with the state in a memfd (whose pages cannot move out), the
 * capture copies blocks (above).
 */

struct aoqd_capture {
	pthread_mutex_t lock;   /* ts[], and snap_after's changes */
	pthread_cond_t cond;    /* a block's copy is done */
	struct aoqd_state *st;
	struct aoqd_snapshotter *w;
	uint32_t n;
	uint64_t nblocks;
	uint64_t *first;        /* per tensor: its first block's index in ts[] */
	uint8_t *ts;            /* per block: T_* */
	void **copy;            /* per tensor: a copy of its state mapping (mapped at arm) */
	size_t *copy_len;       /* per tensor: its length */
	bool swap;              /* the undo swap (above) */
	bool swap_wait;         /* undo swap: at the boundary, waits for the next step's end */
	unsigned idle_ticks;    /* swap_wait: sampler ticks the session was idle at (aoqd_snapshot_tick) */
	bool swapped;           /* copy[] holds moved undo pages: kept as spares after the write */
	/* Per tensor: the pages of the last undo swap's capture, kept after
	 * its write to be the next swap's fresh undo pages (MADV_FREE: the
	 * kernel may take them back under pressure).  Fresh anonymous pages
	 * cost a first touch on the step path (a page fault and zeroing, far
	 * dearer in a VM); these were touched already.  Loop thread; freed
	 * with the state. */
	void **spare;
	size_t *spare_len;
	/* aoqd_snapshot_prepare: the writer is touching the spares (loop
	 * thread; the writer owns spare[] meanwhile), its stop and outcome */
	bool prep;
	_Atomic bool prep_cancel;
	int prep_result;
	aoqd_snapshot_prep_fn prep_fn;
	void *prep_arg;
	uint64_t *steps;        /* per tensor: steps at the boundary */
	/* for Stats: array bytes the writer has passed to the file (writer
	 * thread), of data_bytes (set when the file is prepared) */
	_Atomic uint64_t written;
	uint64_t data_bytes;
	uint64_t boundary;
	bool armed, ready;      /* loop thread */
	struct aoqd_snapfile *file;
	char *dir;
	struct aoqd_snap_key key;
	aoqd_snapshot_done_fn done;
	void *arg;
	int result;
	char why[512];
	char path[PATH_MAX];
	struct aoqd_capture *next; /* the writer's queue, then its done list */
};

struct aoqd_snapshotter {
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct aoqd_capture *queue, **qtail;
	struct aoqd_capture *done_list;
	bool busy, stop;
	uv_async_t async;
	bool pinned;
	cpu_set_t cpus;
	struct aoqd_pool *pool;   /* whose idle times the writes wait for (NULL: none) */
	struct aoqd_snap_pace pace; /* under lock */
	_Atomic bool hurry;       /* stopping: the write in progress goes on without waiting */
	_Atomic uint64_t chunks, forced, waited_ns; /* aoqd_snapshotter_pace_stats */
	_Atomic uint64_t overlap_ns;                /* writer time beside updates (pacer) */
};

/* Takes block k of tensor i unless it is taken (with c->lock held; may
 * wait for a copy in progress): true when the caller copies it. */
static bool block_take(struct aoqd_capture *c, uint64_t k)
{
	while (c->ts[k] == T_COPYING)
		pthread_cond_wait(&c->cond, &c->lock);
	if (c->ts[k] == T_DONE)
		return false;
	c->ts[k] = T_COPYING;
	return true;
}

/* Copies block b of tensor i (called with c->lock not held), then marks it
 * done. */
static void block_copy(struct aoqd_capture *c, uint32_t i, uint64_t b)
{
	const struct aoqd_tensor *t = &c->st->tensors[i];
	uint64_t e = b * CAPTURE_BLOCK;
	uint64_t n = t->numel - e < CAPTURE_BLOCK ? t->numel - e : CAPTURE_BLOCK;
	aoqd_state_copy_out(t, e, n, c->copy[i]);
	pthread_mutex_lock(&c->lock);
	c->ts[c->first[i] + b] = T_DONE;
	pthread_cond_broadcast(&c->cond);
	pthread_mutex_unlock(&c->lock);
}

void aoqd_snapshot_capture(struct aoqd_state *st, uint32_t i, uint64_t step, uint64_t begin, uint64_t count)
{
	struct aoqd_capture *c = st->snap;
	if (count == 0)
		return;
	uint64_t b0 = begin / CAPTURE_BLOCK, b1 = (begin + count - 1) / CAPTURE_BLOCK;
	for (uint64_t b = b0; b <= b1; b++) {
		pthread_mutex_lock(&c->lock);
		uint64_t after = atomic_load_explicit(&st->snap_after, memory_order_relaxed);
		bool mine = after && step >= after && i < c->n && c->first[i] + b < c->first[i + 1] &&
		            block_take(c, c->first[i] + b);
		pthread_mutex_unlock(&c->lock);
		if (mine)
			block_copy(c, i, b);
	}
}

/* Ends the guards: no update waits for this capture any more; waits for
 * copies in progress. */
static void capture_disarm(struct aoqd_capture *c)
{
	pthread_mutex_lock(&c->lock);
	atomic_store_explicit(&c->st->snap_after, 0, memory_order_release);
	for (uint64_t k = 0; k < c->nblocks; k++)
		while (c->ts[k] == T_COPYING)
			pthread_cond_wait(&c->cond, &c->lock);
	pthread_mutex_unlock(&c->lock);
}

static void capture_release(struct aoqd_capture *c)
{
	for (uint32_t i = 0; c->copy && i < c->n; i++)
		if (c->copy[i])
			munmap(c->copy[i], c->copy_len[i]);
	free(c->copy);
	free(c->copy_len);
	c->copy_len = NULL;
	c->swap = c->swap_wait = c->swapped = false;
	free(c->ts);
	free(c->first);
	free(c->steps);
	free(c->dir);
	aoqd_snapfile_free(c->file);
	c->copy = NULL;
	c->ts = NULL;
	c->first = NULL;
	c->nblocks = 0;
	c->steps = NULL;
	c->dir = NULL;
	c->file = NULL;
	c->n = 0;
}

/* The spare table for n tensors, if there is none. */
static bool spares_alloc(struct aoqd_capture *c, uint32_t n)
{
	if (c->spare)
		return true;
	c->spare = calloc(n ? n : 1, sizeof(void *));
	c->spare_len = calloc(n ? n : 1, sizeof(size_t));
	if (c->spare && c->spare_len)
		return true;
	free(c->spare);
	free(c->spare_len);
	c->spare = NULL;
	c->spare_len = NULL;
	return false;
}

/* The swap's copies become the spares (loop thread; the writer is done with
 * them). */
static void keep_spares(struct aoqd_capture *c)
{
	if (!spares_alloc(c, c->n))
		return;
	for (uint32_t i = 0; i < c->n; i++) {
		if (!c->copy[i])
			continue;
		if (c->spare[i])
			munmap(c->spare[i], c->spare_len[i]);
		c->spare[i] = c->copy[i];
		c->spare_len[i] = c->copy_len[i];
		c->copy[i] = NULL;
	}
}

/* Loop thread: hands the outcome to its owner; the capture may be armed
 * again from then on. */
static void capture_finish(struct aoqd_capture *c)
{
	aoqd_snapshot_done_fn done = c->done;
	void *arg = c->arg;
	int r = c->result;
	char path[PATH_MAX], why[512];
	snprintf(path, sizeof(path), "%s", c->path);
	snprintf(why, sizeof(why), "%s", c->why);
	if (c->swapped)
		keep_spares(c);
	capture_release(c);
	c->armed = c->ready = false;
	done(arg, r, path, why); /* may free the state, and c with it */
}

/* The block copies (no undo swap): the block table, and each tensor's copy
 * mapped now (pages come as blocks are copied), so that no update finds it
 * missing.  0 or -ENOMEM (what was mapped stays for capture_release). */
static int capture_blocks(struct aoqd_capture *c)
{
	const struct aoqd_state *st = c->st;
	c->first[0] = 0;
	for (uint32_t i = 0; i < c->n; i++)
		c->first[i + 1] = c->first[i] + (st->tensors[i].numel + CAPTURE_BLOCK - 1) / CAPTURE_BLOCK;
	c->nblocks = c->first[c->n];
	free(c->ts);
	c->ts = calloc(c->nblocks ? c->nblocks : 1, 1);
	if (!c->ts) {
		c->nblocks = 0;
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < c->n; i++) {
		size_t len = st->tensors[i].state_len;
		void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			return -ENOMEM;
		/* Huge pages: the workers fault the copy in during the first
		 * step after the boundary, 4 KiB faults from 15 threads at once
		 * were most of that step's added time. */
		if (len >= (2u << 20))
			madvise(p, len, MADV_HUGEPAGE);
		c->copy[i] = p;
		c->copy_len[i] = len;
	}
	return 0;
}

/* The state's capture, made on first use (NULL: no memory). */
static struct aoqd_capture *capture_get(struct aoqd_state *st)
{
	if (!st->snap) {
		struct aoqd_capture *c = calloc(1, sizeof(*c));
		if (!c)
			return NULL;
		pthread_mutex_init(&c->lock, NULL);
		pthread_cond_init(&c->cond, NULL);
		c->st = st;
		st->snap = c;
	}
	return st->snap;
}

/* Whether a capture of st is an undo swap: every tensor has its undo
 * copy on private pages of its own, and the state is large enough for a
 * copy of it to matter (AOQD_SNAPSHOT_SWAP_MIN).  A state in a memfd (state.h,
 * aoqd_state_set_memfd) cannot give its pages away: its captures copy
 * blocks. */
static bool swap_possible(const struct aoqd_state *st)
{
	long page = sysconf(_SC_PAGESIZE);
	bool swap = st->undo && st->ntensors > 0;
	uint64_t bytes = 0;
	for (uint32_t i = 0; i < st->ntensors && swap; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		swap = t->undo_off && t->undo_off % (uint64_t)page == 0 && t->state_len > t->undo_off && !t->in_memfd;
		bytes += t->undo_off;
	}
	return swap && bytes >= AOQD_SNAPSHOT_SWAP_MIN;
}

int aoqd_snapshot_arm(struct aoqd_snapshotter *w, struct aoqd_state *st, const struct aoqd_snap_key *key,
                      const char *dir, uint64_t boundary, bool ready, aoqd_snapshot_done_fn done, void *arg,
                      struct aoqd_error *err)
{
	if (!dir || !*dir)
		return AOQD_REFUSE(err, INVALID, "snapshots are off (no state_dir)");
	struct aoqd_capture *c = capture_get(st);
	if (!c)
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	if (c->armed || c->prep)
		return AOQD_REFUSE(err, BUSY, "a snapshot of this session is being taken");
	uint32_t n = st->ntensors;
	c->first = calloc((size_t)n + 1, sizeof(uint64_t));
	c->copy = calloc(n ? n : 1, sizeof(void *));
	c->copy_len = calloc(n ? n : 1, sizeof(size_t));
	c->steps = calloc(n ? n : 1, sizeof(uint64_t));
	c->dir = strdup(dir);
	if (!c->first || !c->copy || !c->copy_len || !c->steps || !c->dir) {
		capture_release(c);
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	}
	c->n = n;
	c->swap = swap_possible(st);
	if (!c->swap && capture_blocks(c) < 0) {
		capture_release(c);
		return AOQD_REFUSE(err, NO_MEMORY, "snapshot: no memory for a copy of the state");
	}
	c->w = w;
	c->boundary = boundary;
	c->key = *key;
	c->done = done;
	c->arg = arg;
	c->result = 0;
	c->why[0] = c->path[0] = 0;
	c->armed = true;
	c->ready = false;
	c->swap_wait = false;
	c->idle_ticks = 0;
	/* The undo swap needs no guard: UINT64_MAX only keeps loads and step
	 * changes out (aoqd_snapshot_capturing) until the swap. */
	atomic_store_explicit(&st->snap_after, c->swap ? UINT64_MAX : boundary + 1, memory_order_release);
	if (ready)
		aoqd_snapshot_ready(st, boundary);
	return 0;
}

static void capture_fail_now(struct aoqd_capture *c, int r, const char *why)
{
	capture_disarm(c);
	c->result = r;
	snprintf(c->why, sizeof(c->why), "%s", why);
	capture_finish(c);
}

/* Moves tensor i's undo copy out to the capture and maps fresh pages in its
 * place (the undo swap; loop thread, nothing in flight).  If the move
 * fails, copies it instead. */
static int undo_take(struct aoqd_capture *c, uint32_t i)
{
	struct aoqd_tensor *t = &c->st->tensors[i];
	size_t len = t->state_len - t->undo_off;
	uint8_t *undo = (uint8_t *)t->state_mem + t->undo_off;
	void *dst = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (dst == MAP_FAILED)
		return -errno;
	void *out = mremap(undo, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, dst);
	void *in = MAP_FAILED;
	if (out != MAP_FAILED && c->spare && c->spare[i] && c->spare_len[i] == len) {
		in = mremap(c->spare[i], len, len, MREMAP_MAYMOVE | MREMAP_FIXED, undo);
		if (in != MAP_FAILED)
			c->spare[i] = NULL;
	}
	if (out != MAP_FAILED && in == MAP_FAILED) {
		in = mmap(undo, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
		if (in == MAP_FAILED && mremap(out, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, undo) == MAP_FAILED) {
			/* the state has a hole where its undo copy was: cannot
			 * be (the range was just freed); the session must not go on */
			aoqd_err("snapshot", "undo swap: cannot put the undo copy back: %s", strerror(errno));
			abort();
		}
	}
	if (in == MAP_FAILED) {
		/* the copy, then (on this thread: a stall, but a snapshot) */
		if (out == MAP_FAILED)
			munmap(dst, len);
		dst = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (dst == MAP_FAILED)
			return -errno;
		memcpy(dst, undo, len);
		c->copy[i] = dst;
		c->copy_len[i] = len;
		return 0;
	}
	if (len >= (2u << 20))
		madvise(undo, len, MADV_HUGEPAGE);
	if (t->locked) {
		/* the moved pages stay locked: unlocked, and the new ones
		 * locked as they fault (the locked total does not change) */
		munlock(out, len);
		if (mlock2(undo, len, MLOCK_ONFAULT) != 0) {
			static bool warned;
			if (!warned)
				aoqd_warn("snapshot", "undo swap: cannot lock the new undo pages (%s): they run unlocked",
				          strerror(errno));
			warned = true;
		}
	}
	c->copy[i] = out; /* laid out as the state mapping (state.c, range_copy) */
	c->copy_len[i] = len;
	c->swapped = true;
	return 0;
}

/* The undo swap at the end of the step after the boundary: every tensor's
 * undo copy becomes its capture, and the ranges that step did not update
 * (still at the boundary's values in the live state) are copied in.
 * 0, or -errno with why set. */
static int undo_swap(struct aoqd_capture *c, uint64_t step, char *why, size_t len)
{
	struct aoqd_state *st = c->st;
	for (uint32_t i = 0; i < c->n; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		int r = undo_take(c, i);
		if (r < 0) {
			snprintf(why, len, "undo swap: tensor %u: %s", i, strerror(-r));
			return r;
		}
		/* the ranges of tensor i that step did not update */
		uint64_t b = 0;
		bool updated = t->cur_step == step;
		for (uint32_t k = 0; updated && k < t->ndone; k++) {
			if (t->done[k].b > b)
				aoqd_state_copy_out(t, b, t->done[k].b - b, c->copy[i]);
			b = t->done[k].e;
		}
		if (b < t->numel)
			aoqd_state_copy_out(t, b, t->numel - b, c->copy[i]);
	}
	return 0;
}

static void capture_enqueue(struct aoqd_capture *c)
{
	struct aoqd_snapshotter *w = c->w;
	pthread_mutex_lock(&w->lock);
	c->next = NULL;
	*w->qtail = c;
	w->qtail = &c->next;
	pthread_cond_signal(&w->cond);
	pthread_mutex_unlock(&w->lock);
}

void aoqd_snapshot_ready(struct aoqd_state *st, uint64_t step_ended)
{
	struct aoqd_capture *c = st->snap;
	if (c && c->armed && c->swap_wait && step_ended > c->boundary) {
		char why[256];
		int r = undo_swap(c, c->boundary + 1, why, sizeof(why));
		c->swap_wait = false;
		if (r < 0) {
			capture_fail_now(c, r, why);
			return;
		}
		atomic_store_explicit(&st->snap_after, 0, memory_order_release);
		aoqd_debug("snapshot", "'%s' rank %u: step %" PRIu64 "'s undo copy taken as the snapshot at step %" PRIu64,
		           c->key.job, c->key.rank, c->boundary + 1, c->boundary);
		capture_enqueue(c);
		return;
	}
	if (!c || !c->armed || c->ready || step_ended < c->boundary)
		return;
	c->ready = true;
	/* A tensor whose first record of the next step came already counted
	 * that step (dataplane.c, accept_record): one less at the boundary. */
	for (uint32_t i = 0; i < c->n; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		c->steps[i] = t->cur_step > c->boundary && t->steps ? t->steps - 1 : t->steps;
	}
	c->file = aoqd_snapfile_prepare(&c->key, c->boundary, st, c->steps);
	atomic_store(&c->written, 0);
	c->data_bytes = c->file ? aoqd_snapfile_data_bytes(c->file) : 0;
	if (!c->file) {
		char why[128];
		snprintf(why, sizeof(why), "snapshot header: %s", strerror(errno));
		capture_fail_now(c, -errno, why);
		return;
	}
	if (c->swap) {
		c->swap_wait = true; /* until the next step's end */
		return;
	}
	capture_enqueue(c);
}

void aoqd_snapshot_tick(struct aoqd_state *st, bool idle)
{
	struct aoqd_capture *c = st->snap;
	if (!c || !c->armed || !c->swap_wait)
		return;
	if (!idle) {
		c->idle_ticks = 0;
		return;
	}
	if (++c->idle_ticks < 3)
		return;
	/* Idle at three ticks in a row (2-3 s: longer than a forward pass),
	 * the step the swap waits for has not begun: the state is still the
	 * boundary's, and the blocks are copied instead (as without an undo
	 * copy). */
	if (capture_blocks(c) < 0) {
		capture_fail_now(c, -ENOMEM, "snapshot: no memory for a copy of the state");
		return;
	}
	c->swap = c->swap_wait = false;
	atomic_store_explicit(&st->snap_after, c->boundary + 1, memory_order_release);
	aoqd_debug("snapshot", "'%s' rank %u: idle after step %" PRIu64 ": the snapshot copies the state", c->key.job,
	           c->key.rank, c->boundary);
	capture_enqueue(c);
}

/* Boundary of st's capture waiting to be ready, or UINT64_MAX. */
static uint64_t pending_boundary(const struct aoqd_state *st)
{
	const struct aoqd_capture *c = st->snap;
	if (!c || !c->armed)
		return UINT64_MAX;
	return c->swap_wait ? c->boundary + 1 : !c->ready ? c->boundary : UINT64_MAX;
}

void aoqd_snapshot_cancel(struct aoqd_state *st, const char *gone)
{
	struct aoqd_capture *c = st->snap;
	if (c && c->prep) {
		snprintf(c->why, sizeof(c->why), "%s before its snapshot began", gone);
		atomic_store(&c->prep_cancel, true); /* prep_fn follows */
		return;
	}
	uint64_t boundary = pending_boundary(st);
	if (boundary == UINT64_MAX)
		return; /* none, or writing already */
	char why[sizeof(c->why)];
	snprintf(why, sizeof(why), "%s before step %" PRIu64 " ended", gone, boundary);
	capture_fail_now(c, -ECANCELED, why);
}

bool aoqd_snapshot_busy(const struct aoqd_state *st)
{
	return st->snap && (st->snap->armed || st->snap->prep);
}

const char *aoqd_snapshot_phase(const struct aoqd_state *st, uint64_t *written, uint64_t *total)
{
	const struct aoqd_capture *c = st->snap;
	*written = *total = 0;
	if (!c || (!c->prep && !c->armed))
		return "";
	if (c->prep)
		return "preparing";
	if (!c->ready || c->swap_wait)
		return "armed";
	*written = atomic_load_explicit(&c->written, memory_order_relaxed);
	*total = c->data_bytes;
	return "writing";
}

int aoqd_snapshot_prepare(struct aoqd_snapshotter *w, struct aoqd_state *st, aoqd_snapshot_prep_fn fn, void *arg)
{
	if (!swap_possible(st))
		return 0;
	struct aoqd_capture *c = capture_get(st);
	if (!c || !spares_alloc(c, st->ntensors))
		return -ENOMEM;
	if (c->armed || c->prep)
		return -EBUSY;
	bool missing = false;
	for (uint32_t i = 0; i < st->ntensors && !missing; i++)
		missing = !c->spare[i] || c->spare_len[i] != st->tensors[i].state_len - st->tensors[i].undo_off;
	if (!missing)
		return 0;
	c->w = w;
	c->prep = true;
	atomic_store(&c->prep_cancel, false);
	c->prep_result = 0;
	c->why[0] = 0;
	c->prep_fn = fn;
	c->prep_arg = arg;
	capture_enqueue(c);
	return 1;
}

void aoqd_snapshot_state_free(struct aoqd_state *st)
{
	aoqd_snapshot_state_free_later(st, NULL);
}

void aoqd_snapshot_state_free_later(struct aoqd_state *st, struct aoqd_release *later)
{
	struct aoqd_capture *c = st->snap;
	if (!c)
		return;
	capture_release(c);
	for (uint32_t i = 0; c->spare && i < st->ntensors; i++)
		if (c->spare[i])
			aoqd_release(later, c->spare[i], c->spare_len[i], -1);
	free(c->spare);
	free(c->spare_len);
	pthread_mutex_destroy(&c->lock);
	pthread_cond_destroy(&c->cond);
	free(c);
	st->snap = NULL;
}

/* ---- the writer thread ---- */

/*
 * Pacing (docs/snapshots.md, "Writing"): the writer writes the file in
 * chunks (AOQD_SNAPSHOT_CHUNK) and before each waits until no update is
 * queued or running in the worker pool: in training the workers are idle
 * during the forward pass and between steps, and the checksum, the copy
 * into the page cache and the writeback then take no memory bandwidth or
 * core from an update.  So that a trainer that keeps the workers busy all
 * the time cannot hold a snapshot back for ever, the wait ends at the time
 * a minimum rate says the chunk is due: chunk k (B bytes before it) is
 * written at the latest slack + B / min_rate after the write began, busy
 * workers or not.  Time written in idle windows counts towards that
 * schedule: a writer ahead of it never writes while the workers run.
 */

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

struct pacer {
	struct aoqd_snapshotter *w;
	struct aoqd_snap_pace cfg;
	uint64_t start_ns, bytes;       /* bytes: before the chunk to come */
	uint64_t started;               /* the pool's tasks started when it was last seen idle */
	uint64_t chunks, forced, waited_ns;
	uint64_t gapped; /* due chunks written in a step's idle gap (no task running) */
	_Atomic uint64_t *progress; /* when set: bytes before the chunk to come, for Stats */
	/* Exposure: chunks during which an update ran (the pool was busy when
	 * the chunk began, or a task started before it ended) and their time:
	 * what the writer did beside the workers, measured, not estimated. */
	uint64_t chunk_t0, chunk_started;
	bool chunk_busy;
	uint64_t overlapped, overlap_ns;
};

/* When the next chunk is due at the latest (the minimum rate). */
static uint64_t pace_due(const struct pacer *p)
{
	return p->start_ns + p->cfg.slack_ns +
	       (uint64_t)((double)p->bytes / (double)(p->cfg.min_rate ? p->cfg.min_rate : 1) * 1e9);
}

/* The chunk before now (if any) was written beside an update? */
static void pace_account(struct pacer *p)
{
	if (!p->w->pool || !p->chunk_t0)
		return;
	uint64_t started;
	aoqd_pool_wait_idle(p->w->pool, 0, &started);
	if (p->chunk_busy || started != p->chunk_started) {
		p->overlapped++;
		p->overlap_ns += mono_ns() - p->chunk_t0;
	}
	p->chunk_t0 = 0;
}

/* Waits for idle workers or the due time (pace_chunk); returns whether
 * the pool is busy as the caller goes on. */
static bool pace_wait(struct pacer *p, uint64_t due)
{
	struct aoqd_snapshotter *w = p->w;
	uint64_t t0 = mono_ns();
	bool busy = false;
	for (uint64_t t = t0;; t = mono_ns()) {
		if (atomic_load_explicit(&w->hurry, memory_order_relaxed)) {
			busy = !aoqd_pool_idle(w->pool);
			break;
		}
		uint64_t left = due > t ? due - t : 0, started;
		bool idle = aoqd_pool_wait_idle(w->pool, left < 50000000u ? left : 50000000u, &started);
		if (idle && (started == p->started || left == 0)) {
			p->started = started;
			break;
		}
		if (idle) { /* newly idle: settles */
			p->started = started;
			uint64_t ns = left < p->cfg.settle_ns ? left : p->cfg.settle_ns;
			struct timespec ts = { (time_t)(ns / 1000000000u), (long)(ns % 1000000000u) };
			nanosleep(&ts, NULL);
			continue;
		}
		if (left == 0) {
			/* Due while a step is open or a task runs: a step's
			 * idle gap (the workers waiting for the trainer's next
			 * gradient) costs the trainer less than a chunk beside
			 * running updates; wait a little for one, up to a
			 * fixed time past the due time (so the minimum rate
			 * holds, 20 ms late at most). */
			uint64_t until = due + AOQD_SNAPSHOT_GAP_WAIT_MS * 1000000ull, now = mono_ns();
			bool gap = aoqd_pool_wait_gap(w->pool, until > now ? until - now : 0);
			if (gap) {
				p->gapped++;
			} else {
				p->forced++;
				atomic_fetch_add(&w->forced, 1);
			}
			busy = true;
			break;
		}
	}
	p->waited_ns += mono_ns() - t0;
	return busy;
}

/* Before work of the writer's that is not a chunk of the file (releasing a
 * written copy's pages: page-table work and TLB shootdowns that would
 * interrupt every core running aoqd's threads): idle workers too, up to
 * the next chunk's due time. */
static void pace_idle(struct pacer *p)
{
	if (!p->w->pool)
		return;
	pace_account(p);
	pace_wait(p, pace_due(p));
}

/* aoqd_snapfile_pace's callback: waits for idle workers (a newly idle pool
 * after settle_ns with no task started: AOQD_SNAPSHOT_SETTLE_US) or the
 * chunk's due time ("Pacing"), whichever comes first; at once when aoqd is
 * stopping.  Chunks follow each other at once while no task starts in
 * between.  Waits in slices of 50 ms at most, to notice the stop. */
static void pace_chunk(void *arg, uint64_t bytes)
{
	struct pacer *p = arg;
	struct aoqd_snapshotter *w = p->w;
	uint64_t due = pace_due(p);
	if (p->progress)
		atomic_store_explicit(p->progress, p->bytes, memory_order_relaxed);
	p->bytes += bytes;
	p->chunks++;
	if (w->pool) {
		pace_account(p);
		p->chunk_busy = pace_wait(p, due);
		p->chunk_started = p->started; /* the count when last seen idle */
		p->chunk_t0 = mono_ns();
	}
	atomic_fetch_add(&w->chunks, 1);
}

/* Writer thread: copies every tensor, lets updates go, then writes the
 * copies.  It copies in registration order, the reverse of the order the
 * next step's gradients come (backward, last tensor first): the workers
 * copy the first tensors they need themselves and the writer works from
 * the other end, so neither waits for the other until they meet (in the
 * same order, a worker would keep waiting for the tensor the writer holds,
 * and a starved writer stalls the step). */
static void capture_write(struct aoqd_capture *c)
{
	struct aoqd_error err;
	struct aoqd_state *st = c->st;
	for (uint32_t i = 0; i < c->n; i++) {
		for (uint64_t b = 0; c->first[i] + b < c->first[i + 1]; b++) {
			pthread_mutex_lock(&c->lock);
			bool mine = block_take(c, c->first[i] + b);
			pthread_mutex_unlock(&c->lock);
			if (mine)
				block_copy(c, i, b);
		}
	}
	capture_disarm(c);
	struct pacer pace = { .w = c->w, .started = UINT64_MAX, .progress = &c->written };
	pthread_mutex_lock(&c->w->lock);
	pace.cfg = c->w->pace;
	pthread_mutex_unlock(&c->w->lock);
	pace.start_ns = mono_ns();
	aoqd_snapfile_pace(c->file, pace.cfg.chunk, pace_chunk, &pace);
	int r = aoqd_snapfile_open(c->file, c->dir, &err);
	for (uint32_t i = 0; r == 0 && i < c->n; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		uint8_t *base = c->copy[i];
		const uint8_t *mem = t->state_mem;
#define REBASE(p) ((p) ? (void *)(base + ((const uint8_t *)(p) - mem)) : NULL)
		struct aoqk_state a = t->st;
		a.master = REBASE(t->st.master);
		a.m = REBASE(t->st.m);
		a.v = REBASE(t->st.v);
		a.m_scale = REBASE(t->st.m_scale);
		a.v_scale = REBASE(t->st.v_scale);
		a.master_lo = REBASE(t->st.master_lo);
		a.master_lo8 = REBASE(t->st.master_lo8);
#undef REBASE
		r = aoqd_snapfile_put(c->file, i, &a, &err);
		pace_idle(&pace);
		if (c->swapped) {
			/* kept for the next swap (capture_finish) */
			madvise(c->copy[i], c->copy_len[i], MADV_FREE);
		} else {
			munmap(c->copy[i], c->copy_len[i]);
			c->copy[i] = NULL;
		}
	}
	if (r == 0)
		r = aoqd_snapfile_commit(c->file, c->path, sizeof(c->path), &err);
	if (r < 0) {
		c->result = r;
		snprintf(c->why, sizeof(c->why), "%s", err.msg);
	}
	pace_account(&pace);
	atomic_fetch_add(&c->w->waited_ns, pace.waited_ns);
	atomic_fetch_add(&c->w->overlap_ns, pace.overlap_ns);
	aoqd_debug("snapshot",
	           "'%s' rank %u: %.1f MiB written in %.2f s, %" PRIu64 " chunks; waited %.1f ms for idle workers, "
	           "%" PRIu64 " chunks written while they were busy (due by the minimum rate), %" PRIu64 " more due "
	           "in a step's idle gap; %" PRIu64 " chunks overlapped by updates, %.1f ms of writer time beside them",
	           c->key.job, c->key.rank, (double)pace.bytes / (1u << 20), (double)(mono_ns() - pace.start_ns) / 1e9,
	           pace.chunks, (double)pace.waited_ns / 1e6, pace.forced, pace.gapped, pace.overlapped,
	           (double)pace.overlap_ns / 1e6);
	aoqd_snapfile_free(c->file); /* removes the temp file if it is still there */
	c->file = NULL;
}

/* Writer thread (aoqd_snapshot_prepare): maps the spares the state lacks
 * and writes a byte to each of their pages, a chunk at a time, paced like
 * the file's chunks (idle workers, or the minimum rate).  A spare is not
 * in use until a swap moves it in, and an undo copy is read only where the
 * step saved into it, so what is written there does not matter.  Tensors
 * last first: the order of the next step's gradients. */
static void capture_prep(struct aoqd_capture *c)
{
	struct aoqd_snapshotter *w = c->w;
	const struct aoqd_state *st = c->st;
	struct pacer pace = { .w = w, .started = UINT64_MAX };
	pthread_mutex_lock(&w->lock);
	pace.cfg = w->pace;
	pthread_mutex_unlock(&w->lock);
	pace.start_ns = mono_ns();
	size_t page = (size_t)sysconf(_SC_PAGESIZE), chunk = pace.cfg.chunk ? pace.cfg.chunk : AOQD_SNAPSHOT_CHUNK;
	int r = 0;
	for (uint32_t i = st->ntensors; r == 0 && i-- > 0;) {
		const struct aoqd_tensor *t = &st->tensors[i];
		size_t len = t->state_len - t->undo_off;
		if (c->spare[i] && c->spare_len[i] != len) {
			munmap(c->spare[i], c->spare_len[i]);
			c->spare[i] = NULL;
		}
		if (!c->spare[i]) {
			void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			if (p == MAP_FAILED) {
				r = -errno;
				break;
			}
			if (len >= (2u << 20))
				madvise(p, len, MADV_HUGEPAGE);
			c->spare[i] = p;
			c->spare_len[i] = len;
		}
		volatile uint8_t *p = c->spare[i];
		for (size_t off = 0; off < len; off += chunk) {
			if (atomic_load(&c->prep_cancel) || atomic_load_explicit(&w->hurry, memory_order_relaxed)) {
				r = atomic_load(&c->prep_cancel) ? -ECANCELED : -ESHUTDOWN;
				break;
			}
			if (w->pool) {
				pace_account(&pace);
				pace.chunk_busy = pace_wait(&pace, pace_due(&pace));
				pace.chunk_started = pace.started;
				pace.chunk_t0 = mono_ns();
			}
			size_t end = len - off < chunk ? len : off + chunk;
			for (size_t q = off; q < end; q += page)
				p[q] = 0;
			pace.bytes += end - off;
			pace.chunks++;
		}
	}
	pace_account(&pace);
	atomic_fetch_add(&w->overlap_ns, pace.overlap_ns);
	c->prep_result = r;
	aoqd_debug("snapshot",
	           "spares prepared for the undo swap: %.1f MiB touched in %.2f s, %" PRIu64 " chunks (%s); idle-worker "
	           "waits %.1f ms, %" PRIu64 " chunks due by the minimum rate (%" PRIu64 " more in a step's idle gap), "
	           "%" PRIu64 " overlapped by updates, %.1f ms beside them",
	           (double)pace.bytes / (1u << 20), (double)(mono_ns() - pace.start_ns) / 1e9, pace.chunks,
	           r == 0 ? "done" : strerror(-r), (double)pace.waited_ns / 1e6, pace.forced, pace.gapped,
	           pace.overlapped, (double)pace.overlap_ns / 1e6);
}

static void *writer_main(void *arg)
{
	struct aoqd_snapshotter *w = arg;
	/* Niced below the workers (10: about a tenth of a core's time when
	 * every core is busy): the checksum and the file writes would
	 * otherwise take a core from a worker, and the whole step waits for
	 * its slowest worker.  A worker that waits for a block the writer is
	 * copying waits for one block (CAPTURE_BLOCK), not a tensor, so the
	 * priority inversion seen with whole-tensor copies (4 s steps on a
	 * loaded 2-core host) is bounded. */
	if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10) < 0)
		aoqd_debug("snapshot", "writer thread: setpriority: %s", strerror(errno));
	/* and off the workers' cores when they are pinned: even at nice 10 it
	 * took about a tenth of the core it shared with a worker, and every
	 * step waits for its slowest worker */
	if (w->pinned && pthread_setaffinity_np(pthread_self(), sizeof(w->cpus), &w->cpus) != 0)
		aoqd_debug("snapshot", "writer thread: cannot set its cores");
	pthread_mutex_lock(&w->lock);
	for (;;) {
		while (!w->queue && !w->stop)
			pthread_cond_wait(&w->cond, &w->lock);
		struct aoqd_capture *c = w->queue;
		if (!c)
			break;
		w->queue = c->next;
		if (!w->queue)
			w->qtail = &w->queue;
		w->busy = true;
		bool stop = w->stop;
		pthread_mutex_unlock(&w->lock);
		if (stop && c->prep) {
			c->prep_result = -ESHUTDOWN;
		} else if (stop) {
			capture_disarm(c);
			c->result = -ECANCELED;
			snprintf(c->why, sizeof(c->why), "aoqd is stopping");
		} else if (c->prep) {
			capture_prep(c);
		} else {
			capture_write(c);
		}
		pthread_mutex_lock(&w->lock);
		w->busy = false;
		c->next = w->done_list;
		w->done_list = c;
		uv_async_send(&w->async);
	}
	pthread_mutex_unlock(&w->lock);
	return NULL;
}

static void writer_done(uv_async_t *h)
{
	struct aoqd_snapshotter *w = h->data;
	pthread_mutex_lock(&w->lock);
	struct aoqd_capture *c = w->done_list;
	w->done_list = NULL;
	pthread_mutex_unlock(&w->lock);
	while (c) {
		struct aoqd_capture *next = c->next;
		if (c->prep) {
			char why[512];
			/* c->why: the loop thread's (aoqd_snapshot_cancel) */
			snprintf(why, sizeof(why), "%s",
			         c->prep_result == -ESHUTDOWN ? "aoqd is stopping"
			         : c->prep_result == -ECANCELED && c->why[0] ? c->why : strerror(-c->prep_result));
			c->prep = false;
			c->prep_fn(c->prep_arg, c->prep_result, why); /* may free the state, and c with it */
		} else {
			capture_finish(c);
		}
		c = next;
	}
}

static void writer_closed(uv_handle_t *h)
{
	struct aoqd_snapshotter *w = h->data;
	pthread_mutex_destroy(&w->lock);
	pthread_cond_destroy(&w->cond);
	free(w);
}

struct aoqd_snapshotter *aoqd_snapshotter_new(uv_loop_t *loop, const cpu_set_t *cpus, struct aoqd_pool *pool)
{
	struct aoqd_snapshotter *w = calloc(1, sizeof(*w));
	if (!w)
		return NULL;
	w->pool = pool;
	w->pace = (struct aoqd_snap_pace){ AOQD_SNAPSHOT_CHUNK, AOQD_SNAPSHOT_MIN_RATE, AOQD_SNAPSHOT_SLACK_MS * 1000000ull,
		                           AOQD_SNAPSHOT_SETTLE_US * 1000ull };
	pthread_mutex_init(&w->lock, NULL);
	pthread_cond_init(&w->cond, NULL);
	w->qtail = &w->queue;
	int r = uv_async_init(loop, &w->async, writer_done);
	if (r < 0) {
		free(w);
		errno = -r;
		return NULL;
	}
	w->async.data = w;
	w->pinned = cpus != NULL;
	if (cpus)
		w->cpus = *cpus;
	r = pthread_create(&w->thread, NULL, writer_main, w);
	if (r != 0) {
		uv_close((uv_handle_t *)&w->async, writer_closed);
		errno = r;
		return NULL;
	}
	return w;
}

bool aoqd_snapshotter_idle(struct aoqd_snapshotter *w)
{
	pthread_mutex_lock(&w->lock);
	bool idle = !w->queue && !w->busy && !w->done_list;
	pthread_mutex_unlock(&w->lock);
	return idle;
}

void aoqd_snapshotter_free(struct aoqd_snapshotter *w)
{
	if (!w)
		return;
	atomic_store(&w->hurry, true);
	pthread_mutex_lock(&w->lock);
	w->stop = true;
	pthread_cond_signal(&w->cond);
	pthread_mutex_unlock(&w->lock);
	pthread_join(w->thread, NULL);
	writer_done(&w->async);
	uv_close((uv_handle_t *)&w->async, writer_closed);
}

void aoqd_snapshotter_set_pace(struct aoqd_snapshotter *w, const struct aoqd_snap_pace *pace)
{
	pthread_mutex_lock(&w->lock);
	w->pace = *pace;
	if (!w->pace.chunk)
		w->pace.chunk = AOQD_SNAPSHOT_CHUNK;
	pthread_mutex_unlock(&w->lock);
}

void aoqd_snapshotter_pace_stats(struct aoqd_snapshotter *w, uint64_t *chunks, uint64_t *forced, uint64_t *waited_ns)
{
	*chunks = atomic_load(&w->chunks);
	*forced = atomic_load(&w->forced);
	*waited_ns = atomic_load(&w->waited_ns);
}
