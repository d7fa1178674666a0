/* SPDX-License-Identifier: MIT */
/*
 * A restart that loses no step: sessions' state through systemd's
 * file-descriptor store (fdstore.h; docs/design.md, "The fd store").
 *
 * The stored form, one sealed memfd per session (little-endian, this
 * host's byte order; aoqd writes and reads it on one host):
 *
 *   0   "AOQFDST1"          magic
 *   8   u32 version (1)
 *   12  u32 crc             CRC-32 of bytes [16, desc_len)
 *   16  u64 desc_len        the descriptor, these 64 bytes included
 *   24  u64 data_off        page-aligned, >= desc_len
 *   32  u64 data_len        data_off + data_len = the file's size
 *   40  24 bytes of zeros
 *   64  the key: u32 uid, u32 rank, u32 job length, the job's bytes
 *       the state: u64 last_step, seed, window; f64 max_grad_norm;
 *       u32 precision; u8 skip_nonfinite, delayed, 0, 0; u32 groups, tensors
 *       per group: u32 kind, moments; f64 lr, beta1, beta2, eps,
 *       weight_decay, momentum, dampening; u32 nesterov
 *       per tensor: u32 name length, the name; u64 numel, steps;
 *       u32 group; u8 param dtype, grad dtype, 0, 0
 *   data_off: every tensor's arrays in registration order (master, m, v,
 *       m scales, v scales, those it has: snapfile.h), each at a multiple
 *       of 64 bytes; offsets follow from the descriptor, none is stored.
 *
 * The reader trusts nothing of it: size and seals from fstat/F_GET_SEALS,
 * every field bounded as a snapshot's header is (snapload.c), the
 * descriptor's checksum, the data's length to the byte.  The data is not
 * checksummed: the seals (write, grow, shrink, seal) keep it as the old
 * aoqd wrote it, and any bit pattern of an array is a value the kernels
 * take; a CRC over 12 GB would cost seconds of every restart.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
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
#include "convert.h"
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

#define MAGIC "AOQFDST1"
#define VERSION 1u
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

/* ---- parallel copies ---- */

enum { COPY, JOIN, SPLIT };

struct copy {
	void *dst;
	const void *src;
	uint64_t n;
	/* A split master (aoqk_state.master_lo) goes as the fp32 master it
	 * is: JOIN writes the fp32 bytes (dst) from the high halves (src) and
	 * the low ones (aux); SPLIT the other way, from src's fp32 bytes.  n
	 * counts the fp32 bytes. */
	int how;
	void *aux;
};

/* Bytes [b, e) of copy c's fp32 side, for JOIN and SPLIT: a thread writes
 * only its own bytes (JOIN), or the elements whose first byte is its own
 * (SPLIT; reading the rest of the last one). */
static void convert(const struct copy *c, uint64_t b, uint64_t e)
{
	if (c->how == JOIN) {
		const uint16_t *hi = c->src, *lo = c->aux;
		uint8_t *d = c->dst;
		for (uint64_t o = b; o < e;) {
			uint64_t el = o / 4, k = o % 4, n = 4 - k < e - o ? 4 - k : e - o;
			uint32_t v = aoqk_split_join(hi[el], lo[el]);
			memcpy(d + o, (const uint8_t *)&v + k, n);
			o += n;
		}
		return;
	}
	uint64_t first = (b + 3) / 4, end = (e + 3) / 4;
	if (first < end)
		aoqd_split((uint16_t *)c->dst + first, (uint16_t *)c->aux + first, (const uint8_t *)c->src + 4 * first,
		           end - first);
}

struct copier {
	const struct copy *c;
	size_t nc;
	uint64_t b, e; /* bytes [b, e) of the concatenated copies */
};

static void *copy_run(void *arg)
{
	const struct copier *w = arg;
	uint64_t pos = 0;
	for (size_t i = 0; i < w->nc && pos < w->e; i++) {
		uint64_t cb = pos, ce = pos + w->c[i].n;
		pos = ce;
		uint64_t b = cb > w->b ? cb : w->b, e = ce < w->e ? ce : w->e;
		if (b >= e)
			continue;
		if (w->c[i].how != COPY) {
			convert(&w->c[i], b - cb, e - cb);
			continue;
		}
		uint8_t *d = (uint8_t *)w->c[i].dst + (b - cb);
#ifdef MADV_POPULATE_WRITE
		/* The destination's pages taken in one call per piece, by each
		 * thread for its own: shmem has no huge pages by default, and a
		 * trap per 4 KiB page costs more than the copy (older kernels:
		 * EINVAL, the copy faults them) */
		uintptr_t pb = (uintptr_t)d & ~(uintptr_t)4095, pe = ((uintptr_t)d + (e - b) + 4095) & ~(uintptr_t)4095;
		madvise((void *)pb, pe - pb, MADV_POPULATE_WRITE);
#endif
		memcpy(d, (const uint8_t *)w->c[i].src + (b - cb), e - b);
	}
	return NULL;
}

/* The copies, split by bytes over up to `threads` threads (this one
 * included); a thread that cannot start leaves its part to this one. */
static void copy_all(const struct copy *c, size_t nc, unsigned threads)
{
	uint64_t total = 0;
	for (size_t i = 0; i < nc; i++)
		total += c[i].n;
	if (threads < 1 || total < (64u << 20))
		threads = 1;
	if (threads > 16)
		threads = 16;
	struct copier w[16];
	pthread_t tid[16];
	bool started[16] = { false };
	uint64_t per = (total + threads - 1) / threads;
	for (unsigned k = 0; k < threads; k++) {
		uint64_t b = (uint64_t)k * per, e = b + per < total ? b + per : total;
		w[k] = (struct copier){ c, nc, b < total ? b : total, e };
		if (k > 0)
			started[k] = pthread_create(&tid[k], NULL, copy_run, &w[k]) == 0;
	}
	copy_run(&w[0]);
	for (unsigned k = 1; k < threads; k++) {
		if (started[k])
			pthread_join(tid[k], NULL);
		else
			copy_run(&w[k]);
	}
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

/* A tensor's arrays in the stored form (up to A_N): their lengths and kinds
 * into lens and ks; *off moves past them (each at a multiple of 64 bytes).
 * Returns how many. */
static size_t tensor_arrays(enum aoqk_precision p, uint64_t numel, unsigned moments, uint64_t *off, uint64_t *lens,
                            int *ks)
{
	size_t n = 0;
	for (int k = 0; k < A_N; k++) {
		const char *dt;
		uint64_t elems;
		unsigned esize;
		if (!snap_arr_info(p, numel, moments, k, &dt, &elems, &esize))
			continue;
		*off = aoq_align_up(*off, 64);
		lens[n] = elems * esize;
		ks[n] = k;
		*off += lens[n];
		n++;
	}
	return n;
}

int aoqd_fdstore_encode(const struct aoqd_snap_key *key, const struct aoqd_state *st, unsigned threads)
{
	struct buf b = { 0 };
	uint8_t head[HEAD] = { 0 };
	put(&b, head, sizeof(head));
	size_t jl = strnlen(key->job, sizeof(key->job));
	PUT(&b, uint32_t, key->uid);
	PUT(&b, uint32_t, key->rank);
	PUT(&b, uint32_t, jl);
	put(&b, key->job, jl);
	PUT(&b, uint64_t, st->last_step);
	PUT(&b, uint64_t, st->seed);
	PUT(&b, uint64_t, st->window);
	PUT(&b, double, st->max_grad_norm);
	PUT(&b, uint32_t, st->precision);
	PUT(&b, uint8_t, st->skip_nonfinite);
	PUT(&b, uint8_t, st->delayed);
	PUT(&b, uint16_t, 0);
	PUT(&b, uint32_t, st->ngroups);
	PUT(&b, uint32_t, st->ntensors);
	for (uint32_t g = 0; g < st->ngroups; g++) {
		const struct aoqd_group *gr = &st->groups[g];
		PUT(&b, uint32_t, gr->kind);
		PUT(&b, uint32_t, gr->moments);
		const double hp[7] = { gr->hp.lr,           gr->hp.beta1,    gr->hp.beta2,    gr->hp.eps,
		                       gr->hp.weight_decay, gr->hp.momentum, gr->hp.dampening };
		put(&b, hp, sizeof(hp));
		PUT(&b, uint32_t, gr->hp.nesterov);
	}
	enum aoqk_precision prec = (enum aoqk_precision)st->precision;
	uint64_t data = 0;
	size_t ncopies = 0;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		size_t nl = strlen(t->name);
		PUT(&b, uint32_t, nl);
		put(&b, t->name, nl);
		PUT(&b, uint64_t, t->numel);
		PUT(&b, uint64_t, t->steps);
		PUT(&b, uint32_t, t->group);
		PUT(&b, uint8_t, t->param_dtype);
		PUT(&b, uint8_t, t->grad_dtype);
		PUT(&b, uint16_t, 0);
		uint64_t lens[A_N];
		int ks[A_N];
		ncopies += tensor_arrays(prec, t->numel, st->groups[t->group].moments, &data, lens, ks);
	}
	if (b.fail) {
		free(b.p);
		return -ENOMEM;
	}
	uint64_t desc_len = b.len, data_off = aoqd_page_round(desc_len), total = data_off + data;
	memcpy(b.p, MAGIC, 8);
	uint32_t ver = VERSION;
	memcpy(b.p + 8, &ver, 4);
	memcpy(b.p + 16, &desc_len, 8);
	memcpy(b.p + 24, &data_off, 8);
	memcpy(b.p + 32, &data, 8);
	uint32_t crc = snap_crc((uint32_t)crc32(0, Z_NULL, 0), b.p + 16, desc_len - 16);
	memcpy(b.p + 12, &crc, 4);

	int r = 0;
	uint8_t *map = MAP_FAILED;
	struct copy *c = NULL;
	int fd = memfd_create("aoq-state", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0 || ftruncate(fd, (off_t)total) < 0) {
		r = -errno;
		goto out;
	}
	map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	c = calloc(ncopies + 1, sizeof(*c));
	if (map == MAP_FAILED || !c) {
		r = map == MAP_FAILED ? -errno : -ENOMEM;
		goto out;
	}
	if (total >= (2u << 20))
		madvise(map, total, MADV_HUGEPAGE);
	c[0] = (struct copy){ map, b.p, desc_len, COPY, NULL };
	size_t nc = 1;
	uint64_t pos = 0;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		uint64_t lens[A_N];
		int ks[A_N];
		uint64_t at = pos;
		size_t n = tensor_arrays(prec, t->numel, st->groups[t->group].moments, &pos, lens, ks);
		for (size_t k = 0; k < n; k++) {
			at = aoq_align_up(at, 64);
			bool join = ks[k] == A_MASTER && t->st.master_lo;
			c[nc++] = (struct copy){ map + data_off + at, snap_arr_ptr(&t->st, ks[k]), lens[k], join ? JOIN : COPY,
			                         t->st.master_lo };
			at += lens[k];
		}
	}
	copy_all(c, nc, threads);
	munmap(map, total);
	map = MAP_FAILED;
	/* Sealed: from now on nobody can change, grow or shrink it. */
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0)
		r = -errno;
out:
	if (map != MAP_FAILED)
		munmap(map, total);
	free(c);
	free(b.p);
	if (r < 0) {
		if (fd >= 0)
			close(fd);
		return r;
	}
	return fd;
}

#define BAD(...)                                  \
	do {                                      \
		snprintf(why, wlen, __VA_ARGS__); \
		r = -EINVAL;                      \
		goto out;                         \
	} while (0)

int aoqd_fdstore_decode(int fd, int lock_memory, _Atomic uint64_t *locked_total, unsigned threads,
                        struct aoqd_snap_key *key, struct aoqd_state *st, char *why, size_t wlen)
{
	int r = 0;
	bool allocated = false;
	uint8_t *map = MAP_FAILED;
	struct copy *c = NULL;
	uint64_t size = 0;
	memset(st, 0, sizeof(*st));
	memset(key, 0, sizeof(*key));
	struct stat sb;
	if (fstat(fd, &sb) < 0)
		BAD("fstat: %s", strerror(errno));
	if (!S_ISREG(sb.st_mode) || sb.st_size < (off_t)HEAD)
		BAD("not a memfd of the stored form (type %o, %lld bytes)", (unsigned)(sb.st_mode & S_IFMT),
		    (long long)sb.st_size);
	size = (uint64_t)sb.st_size;
	int seals = fcntl(fd, F_GET_SEALS);
	int need = F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL;
	if (seals < 0 || (seals & need) != need)
		BAD("not sealed against writes, growth and shrinking (seals %#x): it could change under aoqd",
		    seals < 0 ? 0 : (unsigned)seals);
	map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED)
		BAD("mmap of %" PRIu64 " bytes: %s", size, strerror(errno));
	uint32_t ver, crc;
	uint64_t desc_len, data_off, data_len;
	memcpy(&ver, map + 8, 4);
	memcpy(&crc, map + 12, 4);
	memcpy(&desc_len, map + 16, 8);
	memcpy(&data_off, map + 24, 8);
	memcpy(&data_len, map + 32, 8);
	if (memcmp(map, MAGIC, 8) != 0)
		BAD("no stored-form magic");
	if (ver != VERSION)
		BAD("stored-form version %u (this aoqd reads %u)", ver, VERSION);
	for (unsigned k = 40; k < HEAD; k++)
		if (map[k])
			BAD("reserved header bytes are not zero");
	if (desc_len < HEAD || desc_len > MAX_DESC || desc_len > size || data_off < desc_len || data_off % 4096 ||
	    data_off > size || data_len != size - data_off)
		BAD("descriptor %" PRIu64 " bytes, data at %" PRIu64 " of %" PRIu64 " bytes: not within the %" PRIu64
		    "-byte memfd", desc_len, data_off, data_len, size);
	uint32_t got = snap_crc((uint32_t)crc32(0, Z_NULL, 0), map + 16, desc_len - 16);
	if (got != crc)
		BAD("descriptor checksum mismatch (crc32 %08x, header says %08x)", got, crc);
	struct rd rd = { map + HEAD, desc_len - HEAD, 0, false };
	key->uid = get32(&rd);
	key->rank = get32(&rd);
	uint32_t jl = get32(&rd);
	if (jl == 0 || jl > MAX_JOB || !get(&rd, key->job, jl) || memchr(key->job, 0, jl))
		BAD("bad job name (%u bytes)", jl);
	if (key->rank == UINT32_MAX)
		BAD("a replica group's state (never stored)");
	st->last_step = get64(&rd);
	st->seed = get64(&rd);
	st->window = get64(&rd);
	st->max_grad_norm = getf64(&rd);
	uint32_t prec = get32(&rd);
	uint8_t skip = get8(&rd), delayed = get8(&rd), z0 = get8(&rd), z1 = get8(&rd);
	uint32_t ng = get32(&rd), nt = get32(&rd);
	if (rd.bad)
		BAD("descriptor cut short");
	if (st->last_step > AOQD_MAX_TENSOR_STEPS || prec >= SNAP_NPREC || skip > 1 || delayed > 1 || z0 || z1 ||
	    !(st->max_grad_norm >= 0) || st->max_grad_norm > 1e300)
		BAD("bad options (step %" PRIu64 ", precision %u, max_grad_norm %g)", st->last_step, prec,
		    st->max_grad_norm);
	if (ng == 0 || ng > 65536 || nt == 0 || nt > (1u << 24))
		BAD("%u groups and %u tensors", ng, nt);
	/* a group takes 68 bytes of the descriptor, a tensor at least 29:
	 * no table larger than the descriptor can fill is allocated */
	if ((uint64_t)ng * 68 + (uint64_t)nt * 29 > rd.len - rd.pos)
		BAD("%u groups and %u tensors do not fit in a %" PRIu64 "-byte descriptor", ng, nt, desc_len);
	st->precision = (Aoq__StatePrecision)prec;
	st->skip_nonfinite = skip;
	st->delayed = delayed;
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
	uint64_t data = 0;
	size_t ncopies = 0;
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
		uint64_t lens[A_N];
		int ks[A_N];
		ncopies += tensor_arrays((enum aoqk_precision)prec, numel, st->groups[group].moments, &data, lens, ks);
		if (data > data_len)
			BAD("the arrays pass the %" PRIu64 " bytes of data at tensor %u", data_len, i);
	}
	if (rd.pos != rd.len)
		BAD("%zu bytes after the descriptor's last tensor", rd.len - rd.pos);
	if (data != data_len)
		BAD("%" PRIu64 " bytes of data, the arrays hold %" PRIu64, data_len, data);
	/* everything is checked but the data: now allocate and copy */
	uint64_t failed;
	int a = aoqd_state_alloc(st, lock_memory, locked_total, &failed);
	allocated = true;
	if (a < 0) {
		snprintf(why, wlen, "cannot allocate %" PRIu64 " bytes of state: %s", failed, strerror(-a));
		r = a;
		goto out;
	}
	for (uint32_t i = 0; i < st->ntensors; i++)
		st->state_bytes += st->tensors[i].state_len;
	c = calloc(ncopies + 1, sizeof(*c));
	if (!c) {
		snprintf(why, wlen, "out of memory");
		r = -ENOMEM;
		goto out;
	}
	size_t nc = 0;
	uint64_t pos = 0;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		uint64_t lens[A_N];
		int ks[A_N];
		uint64_t at = pos;
		size_t n = tensor_arrays((enum aoqk_precision)prec, t->numel, st->groups[t->group].moments, &pos, lens, ks);
		for (size_t k = 0; k < n; k++) {
			at = aoq_align_up(at, 64);
			bool split = ks[k] == A_MASTER && t->st.master_lo;
			c[nc++] = (struct copy){ (void *)snap_arr_ptr(&t->st, ks[k]), map + data_off + at, lens[k],
			                         split ? SPLIT : COPY, t->st.master_lo };
			at += lens[k];
		}
	}
	copy_all(c, nc, threads);
out:
	if (r < 0) {
		if (allocated || st->tensors)
			aoqd_state_free(st, locked_total);
		free(st->groups);
		memset(st, 0, sizeof(*st));
	}
	if (map != MAP_FAILED)
		munmap(map, size);
	free(c);
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

void aoqd_fdstore_keep(int fd, const char *name)
{
	fcntl(fd, F_SETFD, FD_CLOEXEC);
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

int aoqd_fdstore_adopt(struct aoqd_server *srv)
{
	int made = 0;
	for (size_t i = 0; i < nkept; i++) {
		struct kept *k = &kept[i];
		uint64_t t0 = now_ns();
		struct aoqd_snap_key key;
		struct aoqd_state st;
		char why[512] = "";
		int r = aoqd_fdstore_decode(k->fd, srv->cfg.lock_memory, &srv->locked_bytes, copy_threads(srv), &key, &st,
		                            why, sizeof(why));
		if (r < 0) {
			aoqd_warn("fdstore", "stored state %s (fd %d) refused: %s", k->name, k->fd, why);
		} else if (srv->cfg.lease_seconds == 0) {
			aoqd_info("fdstore", "lease_seconds = 0: stored state %s not taken back", k->name);
			aoqd_state_free(&st, &srv->locked_bytes);
		} else {
			struct aoqd_error err = { 0 };
			struct aoqd_lease_key lk = { .uid = (uid_t)key.uid, .job = key.job, .rank = key.rank };
			uint64_t step = st.last_step;
			int64_t id = aoqd_lease_adopt(srv, &lk, &st, (uint64_t)srv->cfg.lease_seconds * 1000000000u, &err);
			if (id < 0) {
				aoqd_warn("fdstore", "stored state %s (uid %u job '%s' rank %u) not taken back: %s", k->name,
				          key.uid, key.job, key.rank, err.msg[0] ? err.msg : strerror((int)-id));
				aoqd_state_free(&st, &srv->locked_bytes);
			} else {
				made++;
				note_taken(&key);
				aoqd_info("fdstore", "session %" PRId64 ": uid %u job '%s' rank %u taken back from the fd store "
				          "(%s) at step %" PRIu64 " in %.3f s, leased for %u s", id, key.uid, key.job, key.rank,
				          k->name, step, (double)(now_ns() - t0) / 1e9, srv->cfg.lease_seconds);
			}
		}
#if AOQ_HAVE_SYSTEMD
		/* Taken or refused, it leaves the store: a later restart must not
		 * bring back a state that trained on since. */
		char msg[300];
		snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=%s", k->name);
		sd_notify(0, msg);
#endif
		close(k->fd);
	}
	free(kept);
	kept = NULL;
	nkept = capkept = 0;
	return made;
}

/* A trainer's state that a restart keeps: what a lease would keep
 * (aoqd_lease_for, but for the stop), or a settled lease; not a replica
 * group's (its members' rings and the hub's steps are not stored). */
static bool storable(const struct aoqd_session *s)
{
	if (s->hub || s->rep || !s->conn.job || !s->st.ntensors)
		return false;
	if (s->state == AOQD_LEASED)
		return s->settled;
	return s->state == AOQD_READY && !s->no_lease && s->st.undo && !s->st.dirty;
}

int aoqd_fdstore_save(struct aoqd_server *srv)
{
#if AOQ_HAVE_SYSTEMD
	const char *ns = getenv("NOTIFY_SOCKET");
	if (!ns || !*ns || !srv->sessions || srv->cfg.lease_seconds == 0)
		return 0;
	uint64_t t0 = now_ns();
	/* Nothing may run while a step is rolled back and copied: the loop
	 * dispatches no more (this is the loop thread), the workers finish
	 * what they were given. */
	if (srv->pool && !aoqd_pool_wait_gap(srv->pool, 30ull * 1000000000u)) {
		aoqd_warn("fdstore", "the workers did not finish within 30 s: no state kept in the fd store");
		return 0;
	}
	int stored = 0;
	uint64_t bytes = 0;
	for (struct aoqd_session *s = srv->sessions; s; s = s->next) {
		if (!storable(s)) {
			if (s->state == AOQD_READY || s->state == AOQD_LEASED)
				aoqd_info("fdstore", "session %" PRIu64 " not kept in the fd store (%s)", s->id,
				          s->hub || s->rep ? "a replica group" : "no lease: dirty, Bye or no undo copy");
			continue;
		}
		if (s->state == AOQD_READY)
			aoqd_state_rollback(&s->st); /* the open step goes back, as for a dead trainer */
		struct aoqd_snap_key key = { .uid = (uint32_t)s->conn.uid, .rank = s->conn.rank };
		snprintf(key.job, sizeof(key.job), "%s", s->conn.job);
		int fd = aoqd_fdstore_encode(&key, &s->st, copy_threads(srv));
		if (fd < 0) {
			aoqd_warn("fdstore", "session %" PRIu64 ": state not kept in the fd store: %s", s->id, strerror(-fd));
			continue;
		}
		char msg[128];
		snprintf(msg, sizeof(msg), "FDSTORE=1\nFDPOLL=0\nFDNAME=" AOQD_FDSTORE_PREFIX "%" PRIu64, s->id);
		int r = sd_pid_notify_with_fds(0, 0, msg, &fd, 1);
		struct stat sb;
		uint64_t size = fstat(fd, &sb) == 0 ? (uint64_t)sb.st_size : 0;
		close(fd);
		if (r <= 0) {
			aoqd_warn("fdstore", "session %" PRIu64 ": cannot hand its state to the fd store: %s", s->id,
			          r < 0 ? strerror(-r) : "no NOTIFY_SOCKET");
			continue;
		}
		stored++;
		bytes += size;
		aoqd_info("fdstore", "session %" PRIu64 " (uid %u job '%s' rank %u): state at step %" PRIu64
		          " kept in the fd store as " AOQD_FDSTORE_PREFIX "%" PRIu64 " (%" PRIu64 " bytes)", s->id,
		          (unsigned)s->conn.uid, s->conn.job, s->conn.rank, s->st.last_step, s->id, size);
	}
	if (stored) {
		/* the manager has taken them before we exit (it reads the notify
		 * socket after our death, and then no longer knows our pid) */
		int b = sd_notify_barrier(0, 5000000);
		if (b < 0)
			aoqd_warn("fdstore", "no answer to the notify barrier: %s", strerror(-b));
		aoqd_info("fdstore", "%d state(s), %" PRIu64 " bytes, kept in the fd store in %.3f s", stored, bytes,
		          (double)(now_ns() - t0) / 1e9);
	}
	return stored;
#else
	(void)srv;
	(void)storable;
	return 0;
#endif
}
