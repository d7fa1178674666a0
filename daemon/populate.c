/* SPDX-License-Identifier: MIT */
/*
 * A new state's first touch, spread over the worker pool (populate.h).
 *
 * How a page is faulted in without clobbering what a LoadState (or the
 * first step) writes to it meanwhile: madvise(MADV_POPULATE_WRITE, Linux
 * 5.14) faults pages in writable (and locks them under MLOCK_ONFAULT)
 * without touching their contents.  Where the kernel lacks it, one byte per
 * page goes through a compare-and-swap of its own value: a write fault
 * that writes back what it read, atomically, so a concurrent store is
 * either before it (and kept) or after it.
 *
 * Chunks take the key after every other (pool.h): a LoadState's pieces and
 * a step's updates overtake what is queued, and the workers populate in
 * the gaps between them (the trainer's copy of the next piece, the round
 * trips), ahead of the loads since the masters go first in load order.
 *
 * Lifetime: the chunks hold the session (steps.ops, as the data plane's
 * jobs do), so its state stays mapped until the last one has run.  Nothing
 * remaps a state's arrays meanwhile: aoqd_state_add_undo() only meets a
 * leased or restored state (settled: no reference but the list's, so no
 * chunk of ours), and the undo swap (snapshot.c) remaps the undo copies,
 * which are not populated here (the first step's saves touch them, a
 * fault per huge page).  A released tensor (ReleaseTensors) keeps its
 * mapping, its pages dropped: a chunk passes over it once it is marked.  A state in a memfd (state.h) has no undo swap
 * and no huge pages (shmem_enabled=never): its undo copies are populated
 * too, last, and so is the undo copy of a resumed one (a state restored
 * from a snapshot gets it at the resume).
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "log.h"
#include "populate.h"
#include "server.h"
#include "session.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older libc headers lack it */
#endif

/* Bytes per chunk: a huge page, a few ms of zeroing at most (about 4 ms
 * each with 15 workers at it on the H200 host), the longest a load or an
 * update waits for a worker busy with one. */
#define CHUNK (2u << 20)
/* An arena smaller than this faults in as it is used (a few ms). */
#define ARENA_MIN (64u << 20)

struct piece {
	uint8_t *p;
	size_t len;
	const bool *released; /* its tensor's (ReleaseTensors: passed over); NULL for the arena */
};

struct chunk {
	struct aoqd_task task;
	struct populate *pop;
	uint32_t first, n; /* pieces */
};

struct populate {
	struct aoqd_session *s; /* the chunks' reference */
	struct piece *pieces;
	uint64_t bytes, t0;
	_Atomic uint32_t remaining;
	_Atomic bool failed;
	struct chunk chunks[];
};

static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static bool have_populate;
static _Atomic bool touch_only; /* aoqd_populate_touch */

/* Whether this kernel has MADV_POPULATE_WRITE (older ones: EINVAL). */
static void probe(void)
{
	long pg = sysconf(_SC_PAGESIZE);
	void *p = mmap(NULL, (size_t)pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return; /* touching then */
	have_populate = madvise(p, (size_t)pg, MADV_POPULATE_WRITE) == 0 || errno != EINVAL;
	munmap(p, (size_t)pg);
}

/* 0, or -errno (ENOMEM: no memory; EFAULT, EHWPOISON: a page that cannot
 * be had). */
static int fault_in(uint8_t *p, size_t len)
{
	if (have_populate && !atomic_load_explicit(&touch_only, memory_order_relaxed)) {
		/* EINTR: a signal came (the kernel stops between pages) */
		for (int tries = 0; tries < 4; tries++) {
			if (madvise(p, len, MADV_POPULATE_WRITE) == 0)
				return 0;
			if (errno != EINTR && errno != EAGAIN)
				break;
		}
		return -errno;
	}
	size_t pg = (size_t)sysconf(_SC_PAGESIZE);
	for (size_t o = 0; o < len; o += pg) {
		uint8_t v = __atomic_load_n(p + o, __ATOMIC_RELAXED);
		__atomic_compare_exchange_n(p + o, &v, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
	}
	return 0;
}

static bool stopped(struct populate *pop)
{
	struct aoqd_session *s = pop->s;
	return atomic_load_explicit(&pop->failed, memory_order_relaxed) ||
	       atomic_load_explicit(&s->dead, memory_order_relaxed) ||
	       atomic_load_explicit(&s->populate_off, memory_order_relaxed);
}

static void chunk_run(struct aoqd_task *task, unsigned worker)
{
	struct chunk *c = (struct chunk *)task;
	struct populate *pop = c->pop;
	struct aoqd_session *s = pop->s;
	(void)worker;
	for (uint32_t i = 0; i < c->n && !stopped(pop); i++) {
		const struct piece *pc = &pop->pieces[c->first + i];
		if (pc->released && __atomic_load_n(pc->released, __ATOMIC_ACQUIRE))
			continue;
		int r = fault_in(pc->p, pc->len);
		if (r < 0 && !atomic_exchange(&pop->failed, true)) {
			static _Atomic bool warned;
			if (!atomic_exchange(&warned, true))
				aoqd_warn("session", "session %" PRIu64 ": cannot fault in its state ahead of use (%s): its pages "
				          "fault in as they are first written (logged once)", s->id, strerror(-r));
		}
	}
	if (atomic_fetch_sub_explicit(&pop->remaining, 1, memory_order_acq_rel) != 1)
		return;
	if (!stopped(pop))
		aoqd_debug("session", "session %" PRIu64 ": %" PRIu64 " bytes of state faulted in, %.1f ms", s->id,
		           pop->bytes, (double)(aoqd_now_ns() - pop->t0) / 1e6);
	free(pop->pieces);
	free(pop);
	s->steps.ops->release(s);
}

/* The page-aligned ranges of tensor x's mapping: pass 0 its master, pass 1
 * the rest (moments, scales) up to its undo copy, pass 2 the undo copy of
 * a state in a memfd.  Adds the pieces of at most CHUNK bytes to pc (when
 * not NULL) and returns their number. */
static uint64_t tensor_pieces(const struct aoqd_tensor *x, int pass, struct piece *pc, uint64_t *bytes)
{
	uint64_t master = aoqd_page_round(x->numel * aoqd_tensor_master_size(x));
	uint64_t end = aoqd_page_round(x->undo_off ? x->undo_off : x->state_len);
	uint64_t b = pass == 0 ? 0 : master, e = pass == 0 ? master : end;
	if (e > end)
		e = end;
	if (pass == 2) {
		b = x->undo_off;
		e = x->in_memfd && x->undo_off ? aoqd_page_round(x->state_len) : b;
	}
	uint64_t n = 0;
	for (uint64_t o = b; o < e; o += CHUNK, n++) {
		uint64_t len = e - o < CHUNK ? e - o : CHUNK;
		if (pc)
			pc[n] = (struct piece){ (uint8_t *)x->state_mem + o, (size_t)len, &x->released };
		*bytes += len;
	}
	return n;
}

/* Reorders the n pieces (a stable sort into nb buckets by bucket[i], then
 * one piece of each bucket in turn), so that the workers that take
 * consecutive chunks fault in different masters memfds at once: shmem
 * takes a lock of the file per new page (state.h).  False: no memory (left
 * as they were). */
static bool interleave(struct piece *pc, const uint32_t *bucket, uint64_t n, uint32_t nb)
{
	struct piece *tmp = malloc(n * sizeof(*tmp));
	uint64_t *at = calloc(3 * (size_t)nb, sizeof(*at)), *end = at + nb, *fill = at + 2 * (size_t)nb;
	if (!tmp || !at) {
		free(tmp);
		free(at);
		return false;
	}
	for (uint64_t i = 0; i < n; i++)
		end[bucket[i]]++;
	for (uint64_t b = 0, sum = 0; b < nb; b++) {
		at[b] = fill[b] = sum;
		sum += end[b];
		end[b] = sum;
	}
	for (uint64_t i = 0; i < n; i++)
		tmp[fill[bucket[i]]++] = pc[i];
	for (uint64_t k = 0; k < n;)
		for (uint32_t b = 0; b < nb; b++)
			if (at[b] < end[b])
				pc[k++] = tmp[at[b]++];
	free(tmp);
	free(at);
	return true;
}

/* The masters' pieces (pass 0) of st, in pc: interleaved across the
 * masters memfds when there are several. */
static void interleave_masters(const struct aoqd_state *st, struct piece *pc)
{
	if (st->masters_n < 2)
		return;
	uint64_t n = 0, bytes = 0;
	for (uint32_t i = 0; i < st->ntensors; i++)
		n += tensor_pieces(&st->tensors[i], 0, NULL, &bytes);
	uint32_t *bucket = malloc(n * sizeof(*bucket));
	if (!bucket)
		return;
	for (uint32_t i = 0, k = 0; i < st->ntensors; i++) {
		const struct aoqd_tensor *x = &st->tensors[i];
		uint32_t b = st->masters_n; /* a master of its own: its bucket */
		uint64_t local;
		if (aoqd_tensor_master_param(st, x))
			aoqd_state_masters_fd(st, x->master_off, &local, &b);
		for (uint64_t j = tensor_pieces(x, 0, NULL, &bytes); j > 0; j--)
			bucket[k++] = b;
	}
	interleave(pc, bucket, n, st->masters_n + 1);
	free(bucket);
}

/* The pieces (bytes in all; taken over) as chunks for s's pool, after
 * every other task. */
static void submit(struct aoqd_session *s, struct piece *pieces, uint64_t npieces, uint64_t bytes)
{
	struct aoqd_pool *pool = s->srv->pool;
	/* Chunks of consecutive pieces, up to CHUNK bytes each: a state of
	 * many small tensors takes few tasks. */
	uint32_t nchunks = 0;
	for (uint64_t i = 0, sum = CHUNK; i < npieces; i++) {
		if (sum + pieces[i].len > CHUNK) {
			nchunks++;
			sum = 0;
		}
		sum += pieces[i].len;
	}
	struct populate *pop = calloc(1, sizeof(*pop) + (size_t)nchunks * sizeof(struct chunk));
	if (!pop) {
		free(pieces);
		return;
	}
	pop->s = s;
	pop->pieces = pieces;
	pop->bytes = bytes;
	pop->t0 = aoqd_now_ns();
	atomic_init(&pop->remaining, nchunks);
	uint32_t c = 0;
	for (uint64_t i = 0, sum = CHUNK; i < npieces; i++) {
		if (sum + pieces[i].len > CHUNK) {
			struct chunk *ch = &pop->chunks[c++];
			ch->task.run = chunk_run;
			ch->task.next = c < nchunks ? &pop->chunks[c].task : NULL;
			ch->pop = pop;
			ch->first = (uint32_t)i;
			sum = 0;
		}
		pop->chunks[c - 1].n++;
		/* the pool's fair share (pool.h) counts elements updated: a
		 * byte faulted in takes about as long as an element of AdamW
		 * (a chunk 1.5-4 ms, 2 Mi elements about 1 ms on one core) */
		pop->chunks[c - 1].task.cost += pieces[i].len;
		sum += pieces[i].len;
	}
	s->steps.ops->hold(s);
	aoqd_pool_submit(pool, &s->queue, (struct aoqd_key){ UINT64_MAX, UINT64_MAX }, &pop->chunks[0].task,
	                 &pop->chunks[nchunks - 1].task, nchunks);
}

void aoqd_populate_start(struct aoqd_session *s)
{
	struct aoqd_state *st = &s->st;
	if (!s->srv->pool || !st->ntensors)
		return;
	pthread_once(&probe_once, probe);
	uint64_t npieces = 0, bytes = 0;
	for (int pass = 0; pass < 3; pass++)
		for (uint32_t i = 0; i < st->ntensors; i++)
			npieces += tensor_pieces(&st->tensors[i], pass, NULL, &bytes);
	if (!npieces || npieces > UINT32_MAX)
		return;
	struct piece *pieces = malloc(npieces * sizeof(*pieces));
	if (!pieces)
		return; /* the pages fault in at first use */
	uint64_t k = 0;
	bytes = 0;
	for (int pass = 0; pass < 3; pass++)
		for (uint32_t i = 0; i < st->ntensors; i++)
			k += tensor_pieces(&st->tensors[i], pass, pieces + k, &bytes);
	interleave_masters(st, pieces);
	submit(s, pieces, npieces, bytes);
}

void aoqd_populate_arena(struct aoqd_session *s)
{
	struct aoqd_arena *a = &s->arena;
	if (!s->srv->pool || !a->base || a->size < ARENA_MIN)
		return;
	pthread_once(&probe_once, probe);
	uint64_t n = (a->size + CHUNK - 1) / CHUNK;
	struct piece *pieces = malloc(n * sizeof(*pieces));
	if (!pieces)
		return; /* the pages fault in at first use */
	for (uint64_t i = 0; i < n; i++) {
		uint64_t o = i * CHUNK, len = a->size - o < CHUNK ? a->size - o : CHUNK;
		pieces[i] = (struct piece){ a->base + o, (size_t)len, NULL };
	}
	submit(s, pieces, n, a->size);
}

void aoqd_populate_stop(struct aoqd_session *s)
{
	atomic_store(&s->populate_off, true);
}

void aoqd_populate_touch(bool on)
{
	atomic_store(&touch_only, on);
}
