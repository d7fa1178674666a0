/* SPDX-License-Identifier: MIT */
/*
 * A restart that loses no step: sessions' state through systemd's
 * file-descriptor store (fdstore.h; docs/design.md, "The fd store").
 *
 * Under systemd with the fd store, a session's state lives in one memfd
 * from its allocation on (statemem.c, aoqd_state_set_memfd), stored as
 * `aoq-state-<n>` and removed when the state ends.  The stored form is
 * that memfd as a stopping aoqd leaves it (little-endian, this host's
 * byte order; aoqd writes and reads it on one host):
 *
 *   0     "AOQFDST3"          magic (zeros: no stop wrote it)
 *   8     u32 version (3: a master that is the parameter puts its slot at
 *                             its phase modulo 2 MiB; 2 did not)
 *   12    u32 crc             CRC-32 of bytes [16, 64) and the descriptor
 *   16    u64 data_off        4096 + the journal's pages (aoqd_state_memfd_data_off)
 *   24    u64 data_len        the tensors' slots (aoqd_state_memfd_layout)
 *   32    u64 desc_off        data_off + data_len
 *   40    u64 desc_len        desc_off + desc_len = the file's size
 *   48    zeros to 4096
 *   4096  the journal (state.h, struct aoqd_journal): the boundary (last
 *         step, or dirty), the step counters at the last two boundaries,
 *         the groups' hyperparameters, the save log of the open step
 *   data_off: each tensor's slot in registration order, on pages: its
 *       arrays as aoqd_state_alloc lays them out (master, m, v, scales,
 *       the split master's low half), then its undo copy; a master that
 *       is the parameter lives in a masters memfd (stored beside this
 *       one), and is copied into the slot's first pages at the stop only
 *       when not every masters memfd reached the store (the journal's stop
 *       mark tells which: state.h, AOQD_STOPPED_*).  No offset is stored:
 *       they follow from the descriptor.
 *   desc_off: the key: u32 uid, u32 rank, u32 job length, the job's bytes
 *       the state: u64 last_step, seed, window; f64 max_grad_norm;
 *       u32 precision; u8 skip_nonfinite, delayed, master_param (bit 0;
 *       bit 1: the 24-bit master, state.h master24),
 *       local_world (a replica group's local ranks, its rank 4294967295;
 *       0 for a trainer's state);
 *       u32 groups, tensors
 *       per group: u32 kind, moments; f64 lr, beta1, beta2, eps,
 *       weight_decay, momentum, dampening; u32 nesterov
 *       per tensor: u32 name length, the name; u64 numel, steps;
 *       u32 group; u8 param dtype, grad dtype, 0, 0
 *
 * The descriptor and header are written when the session is registered
 * (or its state restored from a snapshot), the header last, and again at
 * a stop; the journal as the state trains.  A memfd without a header (a
 * state killed before its registration ended) is never taken; one with a
 * dirty boundary neither.  After a kill the journal's log is replayed: the
 * ranges saved in the open step come back from the undo copy and the step
 * counters are those of the last boundary.  The reader trusts nothing:
 * size and seals from fstat/F_GET_SEALS (grow and shrink sealed, so the
 * mapping cannot fault), every field bounded as a snapshot's header is
 * (snapload.c), the descriptor's checksum, the slots' length to the byte.
 * The data is neither checksummed nor sealed against writes (the state
 * is trained in place): any bit pattern of an array is a value the
 * kernels take, and nobody but aoqd and the service manager ever held
 * the fd (it never goes to a client).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "aoq-arena.h"
#include "aoq-config.h"
#include "fdstore.h"
#include "lease.h"
#include "log.h"
#include "pool.h"
#include "server.h"
#include "session.h"
#include "snapfile.h"
#include "snapshot.h"
#include "state.h"

#if AOQ_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the stored form is little-endian"
#endif

#define MAGIC "AOQFDST3"
#define VERSION 3u
#define HEAD 64u
/* The descriptor of 2^24 tensors with 4 KiB names is 64 GiB; no aoqd
 * writes more than this (max_tensors is at most 2^24, names are short). */
#define MAX_DESC (256ull << 20)
#define MAX_JOB 128u
#define MAX_NAME 4096u

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- the adopted state's page tables, filled in parallel ---- */

struct range {
	uint8_t *p;
	uint64_t n;
};

#define FILL_THREADS 8u

struct filler {
	const struct range *r;
	size_t nr;
	uint64_t b, e; /* bytes [b, e) of the concatenated ranges */
};

/* The mapping's pages exist (the memfd's): one call per piece maps them,
 * so that the first step after the restart does not trap on every 4 KiB
 * page (shmem has no huge pages by default).  MADV_POPULATE_READ, not
 * _WRITE: a read fault maps the file's pages around it too (fault-around,
 * 16 at a time), writable in a shared mapping of shmem, so the writes that
 * follow do not fault.  On the H200 host it mapped existing locked pages
 * at 16-19 GB/s against _WRITE's 7-13 (tests/bench/bench-shmem.c;
 * RESULTS.md, "Faulting shared memory").  Older kernels: EINVAL, the
 * first step faults them. */
static void *fill_run(void *arg)
{
	const struct filler *w = arg;
	uint64_t pos = 0;
	for (size_t i = 0; i < w->nr && pos < w->e; i++) {
		uint64_t cb = pos, ce = pos + w->r[i].n;
		pos = ce;
		uint64_t b = cb > w->b ? cb : w->b, e = ce < w->e ? ce : w->e;
		if (b >= e)
			continue;
#ifdef MADV_POPULATE_READ
		uintptr_t pb = (uintptr_t)(w->r[i].p + (b - cb)) & ~(uintptr_t)4095;
		uintptr_t pe = ((uintptr_t)(w->r[i].p + (e - cb)) + 4095) & ~(uintptr_t)4095;
		madvise((void *)pb, pe - pb, MADV_POPULATE_READ);
#endif
	}
	return NULL;
}

/* The ranges, split by bytes over up to `threads` threads (this one
 * included); a thread that cannot start leaves its part to this one.
 * Returns how many threads it split them over. */
static unsigned fill_all(const struct range *r, size_t nr, unsigned threads)
{
	uint64_t total = 0;
	for (size_t i = 0; i < nr; i++)
		total += r[i].n;
	if (threads < 1 || total < (64u << 20))
		threads = 1;
	/* more threads contend for the page tables' locks: 4 mapped faster
	 * than 15 on the H200 host (RESULTS.md, "Faulting shared memory") */
	if (threads > FILL_THREADS)
		threads = FILL_THREADS;
	struct filler w[FILL_THREADS];
	uint64_t per = (total + threads - 1) / threads;
	for (unsigned k = 0; k < threads; k++) {
		uint64_t b = (uint64_t)k * per, e = b + per < total ? b + per : total;
		w[k] = (struct filler){ r, nr, b < total ? b : total, e };
	}
	aoqd_threads_run(fill_run, w, sizeof(w[0]), threads);
	return threads;
}

/* ---- the descriptor ---- */

struct buf {
	uint8_t *p;
	size_t len, cap;
	bool fail;
};

static void put(struct buf *b, const void *v, size_t n)
{
	if (b->fail)
		return;
	if (b->len + n > b->cap) {
		size_t cap = b->cap ? b->cap : 4096;
		while (cap < b->len + n)
			cap *= 2;
		uint8_t *p = realloc(b->p, cap);
		if (!p) {
			b->fail = true;
			return;
		}
		b->p = p;
		b->cap = cap;
	}
	memcpy(b->p + b->len, v, n);
	b->len += n;
}

#define PUT(b, type, v)             \
	do {                        \
		type v_ = (type)(v); \
		put(b, &v_, sizeof(v_)); \
	} while (0)

struct rd {
	const uint8_t *p;
	size_t len, pos;
	bool bad;
};

static bool get(struct rd *r, void *v, size_t n)
{
	if (r->bad || n > r->len - r->pos) {
		r->bad = true;
		memset(v, 0, n);
		return false;
	}
	memcpy(v, r->p + r->pos, n);
	r->pos += n;
	return true;
}

static uint32_t get32(struct rd *r)
{
	uint32_t v;
	get(r, &v, sizeof(v));
	return v;
}

static uint64_t get64(struct rd *r)
{
	uint64_t v;
	get(r, &v, sizeof(v));
	return v;
}

static double getf64(struct rd *r)
{
	double v;
	get(r, &v, sizeof(v));
	return v;
}

static uint8_t get8(struct rd *r)
{
	uint8_t v;
	get(r, &v, sizeof(v));
	return v;
}

/* The descriptor of st under key (after the 64-byte header's place: the
 * caller's CRC covers both). */
static int describe(const struct aoqd_snap_key *key, const struct aoqd_state *st, struct buf *b)
{
	size_t jl = strnlen(key->job, sizeof(key->job));
	PUT(b, uint32_t, key->uid);
	PUT(b, uint32_t, key->rank);
	PUT(b, uint32_t, jl);
	put(b, key->job, jl);
	PUT(b, uint64_t, st->last_step);
	PUT(b, uint64_t, st->seed);
	PUT(b, uint64_t, st->window);
	PUT(b, double, st->max_grad_norm);
	PUT(b, uint32_t, st->precision);
	PUT(b, uint8_t, st->skip_nonfinite);
	PUT(b, uint8_t, st->delayed);
	PUT(b, uint8_t, (uint8_t)(aoqd_state_master_param() | (unsigned)st->master24 << 1));
	PUT(b, uint8_t, (uint8_t)key->local_world);
	PUT(b, uint32_t, st->ngroups);
	PUT(b, uint32_t, st->ntensors);
	for (uint32_t g = 0; g < st->ngroups; g++) {
		const struct aoqd_group *gr = &st->groups[g];
		PUT(b, uint32_t, gr->kind);
		PUT(b, uint32_t, gr->moments);
		const double hp[7] = { gr->hp.lr,           gr->hp.beta1,    gr->hp.beta2,    gr->hp.eps,
		                       gr->hp.weight_decay, gr->hp.momentum, gr->hp.dampening };
		put(b, hp, sizeof(hp));
		PUT(b, uint32_t, gr->hp.nesterov);
	}
	for (uint32_t i = 0; i < st->ntensors; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		size_t nl = strlen(t->name);
		PUT(b, uint32_t, nl);
		put(b, t->name, nl);
		PUT(b, uint64_t, t->numel);
		PUT(b, uint64_t, t->steps);
		PUT(b, uint32_t, t->group);
		PUT(b, uint8_t, t->param_dtype);
		PUT(b, uint8_t, t->grad_dtype);
		PUT(b, uint16_t, 0);
	}
	return b->fail ? -ENOMEM : 0;
}

static int pwrite_all(int fd, const void *p, uint64_t n, uint64_t at)
{
	for (uint64_t done = 0; done < n;) {
		ssize_t w = pwrite(fd, (const uint8_t *)p + done, n - done, (off_t)(at + done));
		if (w <= 0)
			return w < 0 ? -errno : -EIO;
		done += (uint64_t)w;
	}
	return 0;
}

static int pread_all(int fd, void *p, uint64_t n, uint64_t at)
{
	for (uint64_t done = 0; done < n;) {
		ssize_t r = pread(fd, (uint8_t *)p + done, n - done, (off_t)(at + done));
		if (r <= 0)
			return r < 0 ? -errno : -EIO;
		done += (uint64_t)r;
	}
	return 0;
}

int aoqd_fdstore_write(const struct aoqd_snap_key *key, struct aoqd_state *st, bool stop)
{
	if (!st->memfd || !st->jh)
		return -ENOTSUP;
	struct buf b = { 0 };
	uint8_t head[HEAD] = { 0 };
	put(&b, head, sizeof(head));
	int r = describe(key, st, &b);
	if (r < 0) {
		free(b.p);
		return r;
	}
	uint64_t desc_len = b.len - HEAD, data_off = st->mem_data_off, data_len = st->mem_data_len;
	uint64_t desc_off = data_off + data_len, size = desc_off + desc_len;
	memcpy(b.p, MAGIC, 8);
	uint32_t ver = VERSION;
	memcpy(b.p + 8, &ver, 4);
	memcpy(b.p + 16, &data_off, 8);
	memcpy(b.p + 24, &data_len, 8);
	memcpy(b.p + 32, &desc_off, 8);
	memcpy(b.p + 40, &desc_len, 8);
	uint32_t crc = snap_crc((uint32_t)crc32(0, Z_NULL, 0), b.p + 16, b.len - 16);
	memcpy(b.p + 12, &crc, 4);
	int fd = st->mem_fd;
	struct stat sb;
	int seals = fcntl(fd, F_GET_SEALS);
	if (fstat(fd, &sb) < 0 || seals < 0) {
		r = -errno;
		goto out;
	}
	/* The descriptor after the slots: its room made at the first stop
	 * (a state's descriptor keeps its length), then grow and shrink are
	 * sealed for the reader. */
	if ((uint64_t)sb.st_size != size && ((seals & F_SEAL_GROW) || ftruncate(fd, (off_t)size) < 0)) {
		r = (seals & F_SEAL_GROW) ? -EBADFD : -errno;
		goto out;
	}
	/* The journal from here on: hyperparameters and boundary as they are
	 * (the stop rolled the open step back; a new state is dirty). */
	for (uint32_t g = 0; g < st->ngroups; g++)
		aoqd_state_journal_hp(st, g);
	aoqd_state_journal_boundary(st);
	/* At a stop a master that is the parameter, which lives in a masters
	 * memfd, stays there when the store holds every masters memfd (as a
	 * kill leaves it: the next aoqd reads them from the store); else it is
	 * copied into its slot's first pages, a hole until now.  The copy
	 * wrote 2 B a parameter into fresh pages of the memfd: at 256 Mi bf16
	 * parameters on the 2-core VM it was 1.9-2.8 s of a 2.3-3.1 s stop. */
	bool apart = stop && st->masters_stored;
	for (uint32_t i = 0; i < st->ntensors && r == 0 && stop && !apart; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		if (aoqd_tensor_master_param(st, t))
			r = pwrite_all(fd, t->st.master, t->numel * 2, data_off + t->mem_off);
	}
	if (r == 0)
		r = pwrite_all(fd, b.p + HEAD, desc_len, desc_off);
	if (r == 0)
		r = pwrite_all(fd, b.p, HEAD, 0); /* the header last */
	if (r == 0 && !(seals & F_SEAL_SEAL) && fcntl(fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0)
		r = -errno;
	if (r == 0)
		atomic_store_explicit(&st->jh->stopped,
		                      !stop ? AOQD_STOPPED_NOT : apart ? AOQD_STOPPED_MASTERS_APART : AOQD_STOPPED,
		                      memory_order_release);
out:
	free(b.p);
	return r;
}

#define BAD(...)                                  \
	do {                                      \
		snprintf(why, wlen, __VA_ARGS__); \
		r = -EINVAL;                      \
		goto out;                         \
	} while (0)

static int undo_order(const void *a, const void *b)
{
	const struct aoqd_undo *x = a, *y = b;
	if (x->tensor != y->tensor)
		return x->tensor < y->tensor ? -1 : 1;
	return x->off < y->off ? -1 : x->off > y->off;
}

/* The ranges in tensor and element order, those that overlap made one
 * (ranges that only touch stay apart, each a piece for a thread): the
 * threads of aoqd_state_unsave_all then never copy the same bytes.  aoqd logs each range of a step once, but the log is another
 * process's memory; copying a union back is what copying each of its
 * ranges in turn does, as they all come from the one undo copy. */
static uint64_t undo_merge(struct aoqd_undo *u, uint64_t n)
{
	if (n < 2)
		return n;
	qsort(u, n, sizeof(*u), undo_order);
	uint64_t k = 0;
	for (uint64_t i = 1; i < n; i++) {
		struct aoqd_undo *last = &u[k];
		if (u[i].tensor == last->tensor && u[i].off < last->off + last->count) {
			uint64_t end = u[i].off + u[i].count;
			if (end > last->off + last->count)
				last->count = end - last->off;
		} else {
			u[++k] = u[i];
		}
	}
	return k + 1;
}

/* The journal of st, mapped in place (hostile: each word read once, then
 * checked): st goes back to its last boundary, as aoqd_state_rollback
 * takes a live state back.  After a stop the log is empty and this takes
 * the counters and hyperparameters the stop wrote.  Every entry is checked
 * before any range is undone. */
static int replay(struct aoqd_state *st, unsigned threads, char *why, size_t wlen)
{
	int r = 0;
	struct aoqd_undo *undos = NULL;
	struct aoqd_journal *jh = st->jh;
	uint64_t boundary = atomic_load_explicit(&jh->boundary, memory_order_acquire);
	uint64_t n = atomic_load_explicit(&jh->log_n, memory_order_acquire);
	uint32_t over = atomic_load_explicit(&jh->overflow, memory_order_acquire), cap = jh->cap;
	uint32_t stopped = atomic_load_explicit(&jh->stopped, memory_order_acquire);
	if (cap != aoqd_journal_cap(st))
		BAD("journal: a log of %u entries, its tables make %u", cap, aoqd_journal_cap(st));
	if (boundary & AOQD_JOURNAL_DIRTY)
		BAD("journal: no step boundary to go back to (loaded since its last step, or no step completed)");
	if (boundary > AOQD_MAX_TENSOR_STEPS)
		BAD("journal: step %" PRIu64 " out of range", boundary);
	if (over || n > cap)
		BAD("journal: the save log overflowed (%" PRIu64 " of %u entries): the open step cannot be undone", n, cap);
	if (stopped > AOQD_STOPPED_MASTERS_APART)
		BAD("journal: bad stop mark %u", stopped);
	if (stopped != AOQD_STOPPED && st->masters_size && !st->masters_restored)
		BAD("journal: %s, and its masters that are parameters did not come back from the store",
		    stopped ? "written at a stop that left its masters in their memfds" : "not written at a stop");
	enum aoqk_precision p = (enum aoqk_precision)st->precision;
	uint64_t blk = aoqk_block(p) ? aoqk_block(p) : 1, undone = 0;
	undos = n ? malloc(n * sizeof(*undos)) : NULL;
	if (n && !undos)
		BAD("journal: no memory for its %" PRIu64 " entries", n);
	for (uint64_t i = 0; i < n; i++) {
		const struct aoqd_journal_entry *e = &st->jlog[i];
		if (atomic_load_explicit(&e->step, memory_order_acquire) != boundary + 1)
			continue; /* an older step's: its range is the boundary's */
		uint32_t ti = e->tensor;
		uint64_t off = e->offset, cnt = e->count;
		if (ti >= st->ntensors)
			BAD("journal: entry %" PRIu64 ": tensor %u of %u", i, ti, st->ntensors);
		struct aoqd_tensor *t = &st->tensors[ti];
		if (cnt == 0 || off >= t->numel || cnt > t->numel - off || off % blk)
			BAD("journal: entry %" PRIu64 ": elements %" PRIu64 "+%" PRIu64 " of tensor %u (%" PRIu64 ")", i, off,
			    cnt, ti, t->numel);
		undos[undone++] = (struct aoqd_undo){ ti, off, cnt };
	}
	const uint64_t *js = st->jsteps + (boundary & 1) * (uint64_t)st->ntensors;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		uint64_t v = js[i];
		if (v > AOQD_MAX_TENSOR_STEPS)
			BAD("journal: tensor %u: %" PRIu64 " steps", i, v);
		st->tensors[i].steps = v;
	}
	for (uint32_t g = 0; g < st->ngroups; g++) {
		const struct aoqd_journal_hp *h = &st->jhp[g];
		uint32_t sel = atomic_load_explicit(&h->sel, memory_order_acquire);
		if (sel > 1)
			BAD("journal: group %u: bad selector %u", g, sel);
		double v[8];
		memcpy(v, h->v[sel], sizeof(v));
		Aoq__Hyperparams hp = AOQ__HYPERPARAMS__INIT;
		hp.lr = v[0];
		hp.beta1 = v[1];
		hp.beta2 = v[2];
		hp.eps = v[3];
		hp.weight_decay = v[4];
		hp.momentum = v[5];
		hp.dampening = v[6];
		hp.nesterov = v[7] == 1;
		char hw[256];
		if ((v[7] != 0 && v[7] != 1) || !aoqd_hp_valid(st->groups[g].kind, &hp, hw, sizeof(hw)))
			BAD("journal: group %u: %s", g, v[7] != 0 && v[7] != 1 ? "bad nesterov" : hw);
		struct aoqd_group tmp = st->groups[g];
		aoqd_group_set(&tmp, tmp.kind, &hp);
		if (aoqd_group_moments(&tmp) > st->groups[g].moments)
			BAD("journal: group %u: its hyperparameters need a moment it has not", g);
		tmp.moments = st->groups[g].moments;
		st->groups[g] = tmp;
	}
	undone = undo_merge(undos, undone);
	aoqd_state_unsave_all(st, undos, undone, threads);
	st->last_step = boundary;
	/* at the boundary: the log empties, no stop wrote what follows */
	aoqd_state_journal_boundary(st);
	atomic_store_explicit(&jh->stopped, 0, memory_order_release);
	if (!stopped)
		aoqd_info("fdstore", "journal replayed: back at step %" PRIu64 ", %" PRIu64 " range(s) of step %" PRIu64
		          " undone", boundary, undone, boundary + 1);
out:
	free(undos);
	return r;
}

int aoqd_fdstore_decode(int fd, const char *name, int lock_memory, _Atomic uint64_t *locked_total, unsigned threads,
                        struct aoqd_snap_key *key, struct aoqd_state *st, char *why, size_t wlen)
{
	return aoqd_fdstore_decode_masters(fd, name, NULL, 0, lock_memory, locked_total, threads, key, st, why, wlen);
}

int aoqd_fdstore_decode_masters(int fd, const char *name, const int *mfds, uint32_t nm, int lock_memory,
                                _Atomic uint64_t *locked_total, unsigned threads, struct aoqd_snap_key *key,
                                struct aoqd_state *st, char *why, size_t wlen)
{
	int r = 0;
	bool allocated = false;
	uint8_t *desc = NULL;
	struct range *fill = NULL;
	uint64_t size = 0;
	memset(st, 0, sizeof(*st));
	memset(key, 0, sizeof(*key));
	struct stat sb;
	if (fstat(fd, &sb) < 0)
		BAD("fstat: %s", strerror(errno));
	if (!S_ISREG(sb.st_mode) || sb.st_size < (off_t)AOQD_STATE_MEMFD_JOURNAL)
		BAD("not a memfd of the stored form (type %o, %lld bytes)", (unsigned)(sb.st_mode & S_IFMT),
		    (long long)sb.st_size);
	size = (uint64_t)sb.st_size;
	uint8_t page[AOQD_STATE_MEMFD_JOURNAL];
	if (pread_all(fd, page, sizeof(page), 0) < 0)
		BAD("cannot read its header: %s", strerror(errno));
	static const uint8_t zero[8];
	if (memcmp(page, zero, 8) == 0)
		BAD("no stored-form header: no stop wrote it (aoqd was killed, or the state trained on since)");
	int seals = fcntl(fd, F_GET_SEALS);
	int need = F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL;
	if (seals < 0 || (seals & need) != need)
		BAD("not sealed against growth and shrinking (seals %#x): its mapping could fault under aoqd",
		    seals < 0 ? 0 : (unsigned)seals);
	if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE))
		BAD("sealed against writes (seals %#x): not a state aoqd trains in place", (unsigned)seals);
	uint32_t ver, crc;
	uint64_t data_off, data_len, desc_off, desc_len;
	memcpy(&ver, page + 8, 4);
	memcpy(&crc, page + 12, 4);
	memcpy(&data_off, page + 16, 8);
	memcpy(&data_len, page + 24, 8);
	memcpy(&desc_off, page + 32, 8);
	memcpy(&desc_len, page + 40, 8);
	if (memcmp(page, MAGIC, 8) != 0)
		BAD("no stored-form magic");
	if (ver != VERSION)
		BAD("stored-form version %u (this aoqd reads %u)", ver, VERSION);
	for (unsigned k = 48; k < sizeof(page); k++)
		if (page[k])
			BAD("reserved header bytes are not zero");
	if (data_off <= AOQD_STATE_MEMFD_JOURNAL || data_off % 4096 || data_off > size || data_len > size - data_off ||
	    desc_off != data_off + data_len || desc_len < 24 ||
	    desc_len > MAX_DESC || desc_off > size || desc_len != size - desc_off)
		BAD("data %" PRIu64 " bytes at %" PRIu64 ", descriptor %" PRIu64 " bytes at %" PRIu64 ": not the %" PRIu64
		    "-byte memfd", data_len, data_off, desc_len, desc_off, size);
	desc = malloc(desc_len);
	if (!desc) {
		snprintf(why, wlen, "out of memory");
		r = -ENOMEM;
		goto out;
	}
	if (pread_all(fd, desc, desc_len, desc_off) < 0)
		BAD("cannot read its descriptor: %s", strerror(errno));
	uint32_t got = snap_crc(snap_crc((uint32_t)crc32(0, Z_NULL, 0), page + 16, HEAD - 16), desc, desc_len);
	if (got != crc)
		BAD("descriptor checksum mismatch (crc32 %08x, header says %08x)", got, crc);
	struct rd rd = { desc, desc_len, 0, false };
	key->uid = get32(&rd);
	key->rank = get32(&rd);
	uint32_t jl = get32(&rd);
	if (jl == 0 || jl > MAX_JOB || !get(&rd, key->job, jl) || memchr(key->job, 0, jl))
		BAD("bad job name (%u bytes)", jl);

	st->last_step = get64(&rd);
	st->seed = get64(&rd);
	st->window = get64(&rd);
	st->max_grad_norm = getf64(&rd);
	uint32_t prec = get32(&rd);
	uint8_t skip = get8(&rd), delayed = get8(&rd), mp = get8(&rd), lw = get8(&rd);
	uint32_t ng = get32(&rd), nt = get32(&rd);
	if (rd.bad)
		BAD("descriptor cut short");
	if (key->rank == UINT32_MAX ? lw < 2 || lw > AOQ_MAX_LOCAL_WORLD : lw != 0)
		BAD("rank %u with a local world of %u (a replica group's state has rank %u and 2 to %u local ranks)",
		    key->rank, lw, UINT32_MAX, AOQ_MAX_LOCAL_WORLD);
	key->local_world = lw;
	if (st->last_step > AOQD_MAX_TENSOR_STEPS || prec >= SNAP_NPREC || skip > 1 || delayed > 1 || mp > 3 ||
	    !(st->max_grad_norm >= 0) || st->max_grad_norm > 1e300)
		BAD("bad options (step %" PRIu64 ", precision %u, max_grad_norm %g)", st->last_step, prec,
		    st->max_grad_norm);
	if ((mp & 1) != aoqd_state_master_param())
		BAD("master_param was %s, is %s: the arrays' layout differs", mp & 1 ? "yes" : "no",
		    aoqd_state_master_param() ? "yes" : "no");
	if (ng == 0 || ng > 65536 || nt == 0 || nt > (1u << 24))
		BAD("%u groups and %u tensors", ng, nt);
	/* a group takes 68 bytes of the descriptor, a tensor at least 29:
	 * no table larger than the descriptor can fill is allocated */
	if ((uint64_t)ng * 68 + (uint64_t)nt * 29 > rd.len - rd.pos)
		BAD("%u groups and %u tensors do not fit in a %" PRIu64 "-byte descriptor", ng, nt, desc_len);
	st->precision = (Aoq__StatePrecision)prec;
	st->skip_nonfinite = skip;
	st->delayed = delayed;
	st->master24 = mp >> 1;
	st->defer = st->skip_nonfinite || st->max_grad_norm > 0;
	st->options_set = true;
	st->groups = calloc(ng, sizeof(*st->groups));
	st->tensors = calloc(nt, sizeof(*st->tensors));
	if (!st->groups || !st->tensors) {
		snprintf(why, wlen, "out of memory");
		r = -ENOMEM;
		goto out;
	}
	st->cap_groups = st->ngroups = ng;
	st->cap_tensors = nt;
	for (uint32_t g = 0; g < ng; g++) {
		uint32_t kind = get32(&rd), moments = get32(&rd);
		Aoq__Hyperparams h = AOQ__HYPERPARAMS__INIT;
		h.lr = getf64(&rd);
		h.beta1 = getf64(&rd);
		h.beta2 = getf64(&rd);
		h.eps = getf64(&rd);
		h.weight_decay = getf64(&rd);
		h.momentum = getf64(&rd);
		h.dampening = getf64(&rd);
		uint32_t nest = get32(&rd);
		if (rd.bad)
			BAD("descriptor cut short in group %u", g);
		h.nesterov = nest == 1;
		char hw[256];
		if (!aoqd_kind_valid((int)kind) || nest > 1)
			BAD("group %u: bad kind %u", g, kind);
		if (!aoqd_hp_valid((int)kind, &h, hw, sizeof(hw)))
			BAD("group %u: %s", g, hw);
		if (!aoqd_kind_precision_ok((int)kind, st->precision))
			BAD("group %u: kind %u does not run in precision %u", g, kind, prec);
		aoqd_group_set(&st->groups[g], (Aoq__OptimizerKind)kind, &h);
		st->groups[g].moments = aoqd_group_moments(&st->groups[g]);
		if (moments != st->groups[g].moments)
			BAD("group %u: %u moments, its kind keeps %u", g, moments, st->groups[g].moments);
	}
	for (uint32_t i = 0; i < nt; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		uint32_t nl = get32(&rd);
		if (nl == 0 || nl > MAX_NAME || nl > rd.len - rd.pos)
			BAD("tensor %u: bad name length %u", i, nl);
		t->name = malloc(nl + 1u);
		if (!t->name) {
			snprintf(why, wlen, "out of memory");
			r = -ENOMEM;
			goto out;
		}
		st->ntensors = i + 1;
		get(&rd, t->name, nl);
		t->name[nl] = '\0';
		uint64_t numel = get64(&rd), steps = get64(&rd);
		uint32_t group = get32(&rd);
		uint8_t pdt = get8(&rd), gdt = get8(&rd), p0 = get8(&rd), p1 = get8(&rd);
		if (rd.bad)
			BAD("descriptor cut short in tensor %u", i);
		if (memchr(t->name, 0, nl) || numel == 0 || numel > (1ull << 48) || steps > AOQD_MAX_TENSOR_STEPS ||
		    group >= ng || !aoqd_dtype_valid(pdt) || !aoqd_dtype_valid(gdt) || p0 || p1)
			BAD("tensor %u: name, numel, steps, group or dtypes out of range", i);
		t->numel = numel;
		t->steps = steps;
		t->group = group;
		t->param_dtype = (enum aoqk_dtype)pdt;
		t->grad_dtype = (enum aoqk_dtype)gdt;
		st->parameters += numel;
	}
	if (rd.pos != rd.len)
		BAD("%zu bytes after the descriptor's last tensor", rd.len - rd.pos);
	uint64_t slots = aoqd_state_memfd_layout(st, NULL);
	if (slots != data_len)
		BAD("%" PRIu64 " bytes of data, the tensors' slots take %" PRIu64, data_len, slots);
	if (data_off != aoqd_state_memfd_data_off(st))
		BAD("data at %" PRIu64 ", after the journal it is at %" PRIu64, data_off, aoqd_state_memfd_data_off(st));
	/* everything is checked but the data: mapped in place, with its undo
	 * copy (the state is leased) */
	st->undo = true;
	if (nm) {
		char mwhy[256];
		if (aoqd_state_masters_check(st, mfds, nm, mwhy, sizeof(mwhy)) == 0) {
			st->masters_from = mfds;
			st->masters_from_n = nm;
		} else {
			aoqd_warn("fdstore", "%s: its stored masters left out: %s", name, mwhy);
		}
	}
	uint64_t failed, t0 = now_ns();
	int a = aoqd_state_adopt(st, fd, name, lock_memory, locked_total, &failed);
	st->masters_from = NULL;
	st->masters_from_n = 0;
	allocated = true;
	if (a < 0) {
		snprintf(why, wlen, "cannot map %" PRIu64 " bytes of state in place: %s", failed, strerror(-a));
		r = a;
		goto out;
	}
	uint64_t t1 = now_ns();
	if ((r = replay(st, threads, why, wlen)) < 0)
		goto out;
	uint64_t t2 = now_ns();
	size_t nfill = 0, capfill = 0;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		st->state_bytes += t->state_len;
		/* the page tables of the pages the memfd holds (its data, not
		 * its holes: nothing is allocated here) */
		off_t b = (off_t)(st->mem_data_off + t->mem_off), e = b + (off_t)t->state_len;
		for (off_t pos = b; pos < e;) {
			off_t d = lseek(fd, pos, SEEK_DATA);
			if (d < 0 || d >= e)
				break;
			off_t h = lseek(fd, d, SEEK_HOLE);
			if (h < 0 || h > e)
				h = e;
			if (nfill == capfill) {
				size_t cap = capfill ? 2 * capfill : 64;
				struct range *f = realloc(fill, cap * sizeof(*f));
				if (!f)
					break;
				fill = f;
				capfill = cap;
			}
			fill[nfill++] = (struct range){ (uint8_t *)t->state_mem + (d - b), (uint64_t)(h - d) };
			pos = h;
		}
	}
	unsigned nth = fill_all(fill, nfill, threads);
	uint64_t t3 = now_ns();
	/* the parts of a taking back that takes a while (a large state) */
	if (t3 - t0 >= 100000000u)
		aoqd_info("fdstore", "%s: mapped in %.3f s, journal %.3f s, page tables %.3f s on %u thread(s)", name,
		          (double)(t1 - t0) / 1e9, (double)(t2 - t1) / 1e9, (double)(t3 - t2) / 1e9, nth);
out:
	if (r < 0) {
		st->store_kept = true; /* the caller takes it out of the store */
		if (allocated || st->tensors)
			aoqd_state_free(st, locked_total);
		free(st->groups);
		memset(st, 0, sizeof(*st));
	}
	free(desc);
	free(fill);
	return r;
}
#undef BAD

/* ---- systemd ---- */

struct kept {
	int fd;
	char name[256];
};
static struct kept *kept;
static size_t nkept, capkept;
/* The snapshot file names of the keys taken back (aoqd_fdstore_taken). */
static char **taken;
static size_t ntaken;

bool aoqd_fdstore_taken(const char *name)
{
	for (size_t i = 0; i < ntaken; i++)
		if (strcmp(taken[i], name) == 0)
			return true;
	return false;
}

static void note_taken(const struct aoqd_snap_key *key)
{
	char path[4200];
	if (aoqd_snapshot_path(NULL, key, path, sizeof(path)) < 0)
		return;
	char **t = realloc(taken, (ntaken + 1) * sizeof(*t));
	if (!t)
		return;
	taken = t;
	if ((taken[ntaken] = strdup(path)))
		ntaken++;
}

bool aoqd_fdstore_is_state(const char *name)
{
	return name && strncmp(name, AOQD_FDSTORE_PREFIX, strlen(AOQD_FDSTORE_PREFIX)) == 0;
}

bool aoqd_fdstore_is_masters(const char *name)
{
	return name && strncmp(name, AOQD_FDSTORE_MASTERS_PREFIX, strlen(AOQD_FDSTORE_MASTERS_PREFIX)) == 0;
}

void aoqd_fdstore_keep(int fd, const char *name)
{
	fcntl(fd, F_SETFD, FD_CLOEXEC);
	/* the states this aoqd stores get names of their own */
	char *end;
	unsigned long long n = strtoull(name + strlen(AOQD_FDSTORE_PREFIX), &end, 10);
	if (aoqd_fdstore_is_state(name) && !*end)
		aoqd_state_store_names_above(n);
	if (nkept == capkept) {
		size_t cap = capkept ? capkept * 2 : 16;
		struct kept *k = realloc(kept, cap * sizeof(*k));
		if (!k) {
			aoqd_warn("fdstore", "out of memory: stored state fd %d (%s) closed", fd, name);
			close(fd);
			return;
		}
		kept = k;
		capkept = cap;
	}
	kept[nkept].fd = fd;
	snprintf(kept[nkept].name, sizeof(kept[nkept].name), "%s", name);
	nkept++;
}

static unsigned copy_threads(const struct aoqd_server *srv)
{
	unsigned n = srv->ncpus ? (unsigned)srv->ncpus : 1u;
	return n > 16 ? 16 : n;
}

static void store_remove(const char *name)
{
#if AOQ_HAVE_SYSTEMD
	char msg[300];
	snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=%s", name);
	sd_notify(0, msg);
#else
	(void)name;
#endif
}

/* The kept masters memfds of the state stored as `state` (by k, into
 * fds[], marked used), how many in a row from k = 0; 0 when they are not
 * all there. */
static uint32_t masters_of(const char *state, int fds[AOQ_MASTER_MEMFDS], bool *used)
{
	uint32_t n = 0;
	for (uint32_t k = 0; k < AOQ_MASTER_MEMFDS; k++) {
		char nm[64];
		aoqd_state_masters_name(state, k, nm, sizeof(nm));
		size_t j = 0;
		while (j < nkept && strcmp(kept[j].name, nm) != 0)
			j++;
		if (j == nkept)
			break;
		used[j] = true;
		fds[n++] = kept[j].fd;
	}
	return n;
}

int aoqd_fdstore_adopt(struct aoqd_server *srv)
{
	int made = 0;
	bool *used = calloc(nkept ? nkept : 1, sizeof(*used));
	if (!used)
		aoqd_warn("fdstore", "out of memory: the stored states' masters are left out");
	for (size_t i = 0; i < nkept; i++) {
		struct kept *k = &kept[i];
		if (aoqd_fdstore_is_masters(k->name))
			continue; /* with its state's */
		uint64_t t0 = now_ns();
		struct aoqd_snap_key key;
		struct aoqd_state st;
		char why[512] = "";
		int mfds[AOQ_MASTER_MEMFDS];
		uint32_t nm = used ? masters_of(k->name, mfds, used) : 0;
		/* Taken, the memfd is the state's, and stays in the store under
		 * its name (statemem.c removes it when the state ends); refused, it
		 * leaves the store.  Its stored masters leave the store either
		 * way: a state taken back has new ones, stored below. */
		int r = aoqd_fdstore_decode_masters(k->fd, k->name, mfds, nm,
		                                    srv->cfg.lease_seconds ? srv->cfg.lock_memory : 0, &srv->locked_bytes,
		                                    copy_threads(srv), &key, &st, why, sizeof(why));
		for (uint32_t m = 0; m < nm; m++) {
			char mn[64];
			aoqd_state_masters_name(k->name, m, mn, sizeof(mn));
			store_remove(mn);
		}
		if (r == 0)
			aoqd_state_store_masters(&st);
		if (r < 0) {
			aoqd_warn("fdstore", "stored state %s (fd %d) refused: %s", k->name, k->fd, why);
			store_remove(k->name);
		} else if (srv->cfg.lease_seconds == 0) {
			aoqd_info("fdstore", "lease_seconds = 0: stored state %s not taken back", k->name);
			aoqd_state_free(&st, &srv->locked_bytes);
		} else {
			struct aoqd_error err = { 0 };
			struct aoqd_lease_key lk = { .uid = (uid_t)key.uid, .job = key.job, .rank = key.rank,
				                     .local_world = key.local_world };
			uint64_t step = st.last_step, bytes = st.mem_data_len;
			char masters[96] = "";
			if (st.masters_restored) {
				uint32_t in_place = (uint32_t)__builtin_popcount(st.masters_adopted);
				snprintf(masters, sizeof(masters), ", its masters: %u stored memfd(s) in place, %u copied",
				         in_place, st.masters_n - in_place);
			}
			int64_t id = aoqd_lease_adopt(srv, &lk, &st, (uint64_t)srv->cfg.lease_seconds * 1000000000u, &err);
			if (id < 0) {
				aoqd_warn("fdstore", "stored state %s (uid %u job '%s' rank %u) not taken back: %s", k->name,
				          key.uid, key.job, key.rank, err.msg[0] ? err.msg : strerror((int)-id));
				aoqd_state_free(&st, &srv->locked_bytes);
			} else {
				made++;
				note_taken(&key);
				aoqd_info("fdstore", "session %" PRId64 ": uid %u job '%s' rank %u taken back from the fd store "
				          "(%s, %" PRIu64 " bytes mapped in place%s) at step %" PRIu64 " in %.3f s, leased for %u s",
				          id, key.uid, key.job, key.rank, k->name, bytes, masters, step,
				          (double)(now_ns() - t0) / 1e9, srv->cfg.lease_seconds);
			}
		}
		close(k->fd);
	}
	/* masters whose state is not there: of no use */
	for (size_t i = 0; i < nkept; i++) {
		if (!aoqd_fdstore_is_masters(kept[i].name))
			continue;
		if (!used || !used[i]) {
			aoqd_warn("fdstore", "stored masters %s without their state: removed from the store", kept[i].name);
			store_remove(kept[i].name);
		}
		close(kept[i].fd);
	}
	free(used);
	free(kept);
	kept = NULL;
	nkept = capkept = 0;
	return made;
}

/* A state that a restart keeps: what a lease would keep (aoqd_lease_for,
 * but for the stop), or a settled lease.  A trainer's, or a replica
 * group's hub's (the group's state; its members hold none, and come back
 * as a new group that resumes it, as after a member was lost). */
static bool storable(const struct aoqd_session *s)
{
	if (s->hub || !s->conn.job || !s->st.ntensors)
		return false;
	if (s->state == AOQD_LEASED)
		return s->settled;
	if (s->rep && s->rep->broken)
		return false; /* a group that is ending */
	return s->state == AOQD_READY && !s->no_lease && s->st.undo && !s->st.dirty;
}

/* The key s's state is stored under: a trainer's, or a group's (rank
 * AOQD_GROUP_RANK, its local world). */
static struct aoqd_snap_key key_of(const struct aoqd_session *s)
{
	struct aoqd_snap_key key = { .uid = (uint32_t)s->conn.uid, .rank = s->conn.rank };
	if (s->rep) {
		key.rank = AOQD_GROUP_RANK;
		key.local_world = s->rep->world;
	}
	snprintf(key.job, sizeof(key.job), "%s", s->conn.job);
	return key;
}

void aoqd_fdstore_describe(struct aoqd_session *s)
{
	if (!s->st.memfd || !s->st.store_name[0] || s->hub || !s->conn.job)
		return;
	struct aoqd_snap_key key = key_of(s);
	int r = aoqd_fdstore_write(&key, &s->st, false);
	if (r < 0)
		aoqd_warn("fdstore", "session %" PRIu64 ": no descriptor in its state's memfd (%s): a restart after a kill "
		          "restores its snapshot", s->id, strerror(-r));
}

#if AOQ_HAVE_SYSTEMD
/* Keeps s's state in the fd store at a stop, if a restart should have it
 * (storable). */
static void store_one(struct aoqd_session *s, unsigned threads, int *stored, uint64_t *bytes)
{
	if (!storable(s)) {
		if ((s->state == AOQD_READY || s->state == AOQD_LEASED) && !s->hub)
			aoqd_info("fdstore", "session %" PRIu64 " not kept in the fd store (%s)", s->id,
			          s->rep ? "a replica group that is ending" : "no lease: dirty, Bye or no undo copy");
		return;
	}
	if (!s->st.memfd || !s->st.store_name[0]) {
		aoqd_info("fdstore", "session %" PRIu64 " not kept in the fd store (its state is not in a stored memfd)", s->id);
		return;
	}
	if (s->state == AOQD_READY)
		aoqd_state_rollback(&s->st, threads); /* the open step goes back, as for a dead trainer */
	struct aoqd_snap_key key = key_of(s);
	int r = aoqd_fdstore_write(&key, &s->st, true);
	if (r < 0) {
		aoqd_warn("fdstore", "session %" PRIu64 ": state not kept in the fd store: %s", s->id, strerror(-r));
		return;
	}
	s->st.store_kept = true; /* its end leaves it in the store */
	(*stored)++;
	*bytes += s->st.mem_data_len;
	char masters[64] = "";
	if (s->st.masters_n && s->st.masters_stored)
		snprintf(masters, sizeof(masters), ", its masters in their %u stored memfd(s)", s->st.masters_n);
	else if (s->st.masters_n)
		snprintf(masters, sizeof(masters), ", its masters copied in");
	aoqd_info("fdstore", "session %" PRIu64 " (uid %u job '%s' %s %u): state at step %" PRIu64
	          " kept in the fd store as %s (%" PRIu64 " bytes, in place%s)", s->id, (unsigned)s->conn.uid,
	          s->conn.job, s->rep ? "local world" : "rank", s->rep ? s->rep->world : s->conn.rank, s->st.last_step,
	          s->st.store_name, s->st.mem_data_len, masters);
}
#endif

int aoqd_fdstore_save(struct aoqd_server *srv)
{
#if AOQ_HAVE_SYSTEMD
	const char *ns = getenv("NOTIFY_SOCKET");
	if (!ns || !*ns || (!srv->sessions && !srv->hubs) || srv->cfg.lease_seconds == 0)
		return 0;
	uint64_t t0 = now_ns();
	/* Nothing may run while a step is rolled back: the loop dispatches
	 * no more (this is the loop thread), the workers finish what they
	 * were given. */
	if (srv->pool && !aoqd_pool_wait_gap(srv->pool, 30ull * 1000000000u)) {
		aoqd_warn("fdstore", "the workers did not finish within 30 s: no state kept in the fd store");
		return 0;
	}
	aoqd_leases_settle_all(srv, true); /* those whose last jobs have just ended too */
	int stored = 0;
	uint64_t bytes = 0;
	/* the sessions (leased groups among them), then the live groups' hubs */
	for (struct aoqd_session *s = srv->sessions; s; s = s->next)
		store_one(s, copy_threads(srv), &stored, &bytes);
	for (struct aoqd_session *h = srv->hubs; h; h = h->next)
		store_one(h, copy_threads(srv), &stored, &bytes);
	if (stored)
		aoqd_info("fdstore", "%d state(s), %" PRIu64 " bytes, kept in the fd store in %.3f s", stored, bytes,
		          (double)(now_ns() - t0) / 1e9);
	return stored;
#else
	(void)srv;
	(void)storable;
	return 0;
#endif
}

void aoqd_fdstore_barrier(void)
{
#if AOQ_HAVE_SYSTEMD
	/* the manager has read our FDSTOREREMOVE messages before we exit (it
	 * reads the notify socket after our death, and then no longer knows
	 * our pid) */
	const char *ns = getenv("NOTIFY_SOCKET");
	if (!ns || !*ns)
		return;
	int b = sd_notify_barrier(0, 5000000);
	if (b < 0)
		aoqd_warn("fdstore", "no answer to the notify barrier: %s", strerror(-b));
#endif
}
