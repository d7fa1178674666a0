/* SPDX-License-Identifier: MIT */
/*
 * The fd store's stored form (daemon/fdstore.c) without a daemon:
 *  - masters that are parameters land at addresses of their memfd
 *    offsets' phase modulo 2 MiB, privately and in the store's memfd;
 *  - states allocated in memfds (aoqd_state_set_memfd), their descriptor
 *    written, then taken back in place: every array of the taken state is
 *    the written one's, byte for byte, and is the same memory (a write to
 *    one shows in the other: no copy), in every precision (groups AdamW,
 *    SGD without momentum, Lion; odd sizes; masters that are parameters);
 *  - a journal of a half-done step is replayed (the logged ranges back
 *    from the undo copy, the boundary's counters, the last hyperparameters),
 *    and one whose logged ranges overlap is replayed as their union, no
 *    two threads copying the same bytes (run under TSan by
 *    tests/run-all.sh);
 *  - an unsealed, write-sealed, cut, grown, header-less or retyped memfd,
 *    or one whose journal is dirty, overflowed or out of range, is refused
 *    with a message naming what is wrong;
 *  - random mutations of the descriptor with its checksum recomputed (so
 *    that the field checks, not the CRC, must catch them) and of the
 *    header never crash the decoder (run under ASan/UBSan by
 *    tests/run-all.sh) and never give a state whose arrays differ from
 *    what was written.
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

#include "fdstore.h"
#include "snapfile.h"
#include "snapshot.h"

#include "expect.h"
#include "split-fill.h"

static uint64_t rs;
static uint64_t rnd(void)
{
	uint64_t z = (rs += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static _Atomic uint64_t locked;

/* m24: split masters keep 8 low bits (the 24-bit master); the first
 * tensor's parameter is then bf16, so that its master splits. */
static void make_state(struct aoqd_state *st, int prec, uint32_t nt, bool m24)
{
	memset(st, 0, sizeof(*st));
	st->precision = (Aoq__StatePrecision)prec;
	st->master24 = m24;
	st->seed = rnd();
	st->window = rnd() % 2 ? 0 : 1u << 20;
	st->skip_nonfinite = rnd() % 2;
	st->max_grad_norm = rnd() % 2 ? 0 : 1.25;
	st->last_step = rnd() % 100000;
	bool q8 = aoqk_precision_blocked((enum aoqk_precision)prec);
	st->ngroups = q8 ? 1 : 3;
	st->groups = calloc(st->ngroups, sizeof(*st->groups));
	Aoq__Hyperparams h = AOQ__HYPERPARAMS__INIT;
	h.lr = 1e-3 * (double)(rnd() % 1000 + 1) / 7.0;
	h.beta1 = 0.9;
	h.beta2 = 0.999;
	h.eps = 1e-8;
	h.weight_decay = 0.1;
	aoqd_group_set(&st->groups[0], AOQ__OPTIMIZER_KIND__ADAMW, &h);
	if (!q8) {
		Aoq__Hyperparams s = AOQ__HYPERPARAMS__INIT;
		s.lr = 0.1;
		aoqd_group_set(&st->groups[1], AOQ__OPTIMIZER_KIND__SGD, &s);
		h.beta2 = 0.99;
		aoqd_group_set(&st->groups[2], AOQ__OPTIMIZER_KIND__LION, &h);
	}
	for (uint32_t g = 0; g < st->ngroups; g++)
		st->groups[g].moments = aoqd_group_moments(&st->groups[g]);
	st->ntensors = nt;
	st->tensors = calloc(nt, sizeof(*st->tensors));
	for (uint32_t i = 0; i < nt; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		char nm[64];
		snprintf(nm, sizeof(nm), "layers.%u.weight", i);
		t->name = strdup(nm);
		t->numel = 1 + rnd() % 3000;
		t->group = (uint32_t)(rnd() % st->ngroups);
		t->param_dtype = m24 && i == 0 ? AOQK_BF16 : (enum aoqk_dtype)(rnd() % 3);
		t->grad_dtype = (enum aoqk_dtype)(rnd() % 3);
		t->steps = rnd() % 100000;
		st->parameters += t->numel;
	}
	uint64_t failed;
	if (aoqd_state_alloc(st, 0, &locked, &failed) < 0) {
		fprintf(stderr, "alloc failed\n");
		exit(1);
	}
	for (uint32_t i = 0; i < nt; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		void *arr[5] = { t->st.master, t->st.m, t->st.v, t->st.m_scale, t->st.v_scale };
		enum aoqk_precision p = (enum aoqk_precision)prec;
		size_t len[5] = { t->numel * aoqd_tensor_master_size(t), aoqk_moment_bytes(p, t->numel),
		                  aoqk_moment_bytes(p, t->numel), aoqk_scale_count(p, t->numel) * 4,
		                  aoqk_scale_count(p, t->numel) * 4 };
		for (int k = 0; k < 5; k++)
			for (size_t b = 0; arr[k] && b < len[k]; b++)
				((uint8_t *)arr[k])[b] = (uint8_t)rnd();
		fill_split_master(t, rnd);
		EXPECT(!aoqd_tensor_lo(t) || aoqd_tensor_lo_size(t) == (m24 ? 1u : 2u), "tensor %u: a low half of %u bytes",
		       i, aoqd_tensor_lo_size(t));
	}
}

/* Arrays by the stored form's own rule (snapfile.h). */
static bool same_state(const struct aoqd_state *a, const struct aoqd_state *b, char *why, size_t len)
{
	if (a->precision != b->precision || a->master24 != b->master24 || a->seed != b->seed || a->window != b->window ||
	    a->skip_nonfinite != b->skip_nonfinite || a->max_grad_norm != b->max_grad_norm ||
	    a->last_step != b->last_step || a->ngroups != b->ngroups || a->ntensors != b->ntensors) {
		snprintf(why, len, "options or counts differ");
		return false;
	}
	for (uint32_t g = 0; g < a->ngroups; g++) {
		const struct aoqd_group *x = &a->groups[g], *y = &b->groups[g];
		if (x->kind != y->kind || x->hp.lr != y->hp.lr || x->hp.beta1 != y->hp.beta1 || x->hp.beta2 != y->hp.beta2 ||
		    x->hp.eps != y->hp.eps || x->hp.weight_decay != y->hp.weight_decay || x->moments != y->moments) {
			snprintf(why, len, "group %u differs", g);
			return false;
		}
	}
	for (uint32_t i = 0; i < a->ntensors; i++) {
		const struct aoqd_tensor *x = &a->tensors[i], *y = &b->tensors[i];
		if (strcmp(x->name, y->name) || x->numel != y->numel || x->group != y->group || x->steps != y->steps ||
		    x->param_dtype != y->param_dtype || x->grad_dtype != y->grad_dtype) {
			snprintf(why, len, "tensor %u's description differs", i);
			return false;
		}
		enum aoqk_precision p = (enum aoqk_precision)a->precision;
		for (int k = 0; k < A_N; k++) {
			const char *dt;
			uint64_t elems;
			unsigned es;
			if (!snap_arr_info(p, x->numel, a->groups[x->group].moments, k, &dt, &elems, &es))
				continue;
			if (k == A_MASTER && aoqd_tensor_lo(x)) {
				/* split: the stored fp32 master comes back as the same halves */
				unsigned ls = aoqd_tensor_lo_size(x);
				if (aoqd_tensor_lo_size(y) != ls || memcmp(x->st.master, y->st.master, x->numel * 2) ||
				    memcmp(aoqd_tensor_lo(x), aoqd_tensor_lo(y), x->numel * ls)) {
					snprintf(why, len, "tensor %u's split master differs", i);
					return false;
				}
				continue;
			}
			if (memcmp(snap_arr_ptr(&x->st, k), snap_arr_ptr(&y->st, k), elems * es)) {
				snprintf(why, len, "tensor %u array %d differs", i, k);
				return false;
			}
		}
	}
	return true;
}

static uint8_t *read_all(int fd, size_t *n)
{
	struct stat sb;
	fstat(fd, &sb);
	*n = (size_t)sb.st_size;
	uint8_t *d = malloc(*n);
	if (pread(fd, d, *n, 0) != (ssize_t)*n)
		exit(1);
	return d;
}

/* A memfd holding d, sealed unless `unsealed`. */
static int memfd_of(const uint8_t *d, size_t n, bool unsealed)
{
	int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0 || ftruncate(fd, (off_t)n) < 0 || pwrite(fd, d, n, 0) != (ssize_t)n)
		exit(1);
	if (!unsealed)
		fcntl(fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
	return fd;
}

static uint64_t desc_off(const uint8_t *d)
{
	uint64_t o;
	memcpy(&o, d + 32, 8);
	return o;
}

static void fix_crc(uint8_t *d)
{
	uint64_t off = desc_off(d), len;
	memcpy(&len, d + 40, 8);
	uint32_t c = (uint32_t)crc32(crc32(0, Z_NULL, 0), d + 16, 48);
	c = (uint32_t)crc32(c, d + off, (uInt)len);
	memcpy(d + 12, &c, 4);
}

/* d (n bytes) must be refused with `want` in the reason. */
static void expect_refused(const char *what, const uint8_t *d, size_t n, bool unsealed, const char *want)
{
	int fd = memfd_of(d, n, unsealed);
	struct aoqd_snap_key key;
	struct aoqd_state st;
	char why[512] = "";
	int r = aoqd_fdstore_decode(fd, "aoq-state-9", 0, &locked, 2, &key, &st, why, sizeof(why));
	EXPECT(r < 0 && strstr(why, want), "%s: r %d, why '%s' (want '%s')", what, r, why, want);
	if (r == 0)
		aoqd_state_free(&st, &locked);
	close(fd);
}

/* A state of three tensors with its undo copy, described in its memfd
 * under job `job`: its journal is what a live aoqd writes. */
static void journal_state(struct aoqd_state *st, const char *job)
{
	make_state(st, 0, 3, false);
	EXPECT(aoqd_state_add_undo(st, &locked) == 0, "undo copy");
	struct aoqd_snap_key key = { .uid = 7, .rank = 0 };
	snprintf(key.job, sizeof(key.job), "%s", job);
	EXPECT(aoqd_fdstore_write(&key, st, false) == 0, "describe");
}

/* Masters that are parameters, of 2 MiB and more, at addresses congruent
 * modulo 2 MiB to their offsets in their masters memfds (so that huge
 * shmem pages can map them by 2 MiB), in private mappings and in the fd
 * store's memfd, whose slots then start at the same phase. */
static void masters_phase(bool memfd)
{
	const uint64_t huge = 2u << 20;
	const uint64_t sizes[6] = { 1536u << 10, (3u << 20) + 7, 700000, (2u << 20) + 1000, 5u << 20, 1u << 20 };
	struct aoqd_state st;
	memset(&st, 0, sizeof(st));
	st.precision = AOQ__STATE_PRECISION__STATE_Q8;
	st.ngroups = 1;
	st.groups = calloc(1, sizeof(*st.groups));
	Aoq__Hyperparams h = AOQ__HYPERPARAMS__INIT;
	h.lr = 1e-3;
	h.beta1 = 0.9;
	h.beta2 = 0.999;
	h.eps = 1e-8;
	aoqd_group_set(&st.groups[0], AOQ__OPTIMIZER_KIND__ADAMW, &h);
	st.groups[0].moments = aoqd_group_moments(&st.groups[0]);
	st.ntensors = 6;
	st.tensors = calloc(6, sizeof(*st.tensors));
	for (uint32_t i = 0; i < 6; i++) {
		struct aoqd_tensor *t = &st.tensors[i];
		t->name = strdup("w");
		t->numel = sizes[i];
		t->param_dtype = AOQK_BF16;
		t->grad_dtype = AOQK_BF16;
		st.parameters += t->numel;
	}
	aoqd_state_set_memfd(memfd);
	uint64_t failed;
	EXPECT(aoqd_state_alloc(&st, 0, &locked, &failed) == 0, "alloc");
	EXPECT(st.memfd == memfd && st.masters_n >= 1, "memfd %d, %u masters memfds", st.memfd, st.masters_n);
	int checked = 0;
	for (uint32_t i = 0; i < 6; i++) {
		const struct aoqd_tensor *t = &st.tensors[i];
		uint64_t local;
		if (t->master_off == AOQ_NO_MASTER || t->numel * 2 < huge)
			continue;
		aoqd_state_masters_fd(&st, t->master_off, &local, NULL);
		EXPECT((uintptr_t)t->st.master % huge == local % huge,
		       "%s: tensor %u's master at %#" PRIxPTR ", its memfd offset %#" PRIx64 ": another phase",
		       memfd ? "memfd" : "private", i, (uintptr_t)t->st.master, local);
		if (memfd)
			EXPECT((st.mem_data_off + t->mem_off) % huge == local % huge, "tensor %u's slot at another phase", i);
		checked++;
	}
	EXPECT(checked == 5, "%d masters of 2 MiB or more checked, want 5", checked);
	aoqd_state_free(&st, &locked);
	aoqd_state_set_memfd(true);
}

int main(void)
{
	rs = (uint64_t)getpid() * 0x100000001b3ull ^ (uint64_t)time(NULL);
	printf("seed %" PRIu64 "\n", rs);
	masters_phase(false);
	masters_phase(true);
	aoqd_state_set_memfd(true);
	uint8_t *keep = NULL;
	size_t keep_n = 0;
	/* every precision, then q8 and q4 with the 24-bit master */
	for (int run = 0; run < SNAP_NPREC + 2; run++) {
		int prec = run < SNAP_NPREC ? run : run == SNAP_NPREC ? AOQK_STATE_Q8 : AOQK_STATE_Q4;
		struct aoqd_state st;
		make_state(&st, prec, 1 + (uint32_t)(rnd() % 9), run >= SNAP_NPREC);
		EXPECT(st.memfd, "precision %d: state not in a memfd", prec);
		struct aoqd_snap_key key = { .uid = 1000, .rank = 3 };
		snprintf(key.job, sizeof(key.job), "job-%d", run);
		int r = aoqd_fdstore_write(&key, &st, true);
		EXPECT(r == 0, "write precision %d: %s", prec, strerror(-r));
		if (r < 0)
			continue;
		int fd = dup(st.mem_fd);
		int seals = fcntl(fd, F_GET_SEALS);
		int need = F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL;
		EXPECT(seals >= 0 && (seals & need) == need && !(seals & F_SEAL_WRITE), "seals %#x", seals);
		if (prec == 0)
			keep = read_all(fd, &keep_n);
		struct aoqd_snap_key k2;
		struct aoqd_state back;
		char why[512] = "";
		r = aoqd_fdstore_decode(fd, "aoq-state-1", 0, &locked, 3, &k2, &back, why, sizeof(why));
		EXPECT(r == 0, "decode precision %d: %s", prec, why);
		if (r == 0) {
			EXPECT(k2.uid == 1000 && k2.rank == 3 && strcmp(k2.job, key.job) == 0, "key differs");
			EXPECT(same_state(&st, &back, why, sizeof(why)), "precision %d: %s", prec, why);
			EXPECT(back.memfd && back.undo && strcmp(back.store_name, "aoq-state-1") == 0,
			       "taken state not in its memfd with its undo copy");
			/* in place: the taken state's m is the written state's */
			for (uint32_t i = 0; i < st.ntensors; i++) {
				struct aoqd_tensor *x = &st.tensors[i], *y = &back.tensors[i];
				if (!x->st.m)
					continue;
				uint8_t *mx = x->st.m, *my = y->st.m;
				mx[0] ^= 0x5a;
				EXPECT(my[0] == mx[0] && x->st.m != y->st.m, "tensor %u: the taken state is a copy", i);
			}
			back.store_kept = true;
			aoqd_state_free(&back, &locked);
		}
		close(fd);
		aoqd_state_free(&st, &locked);
	}
	if (!keep)
		return 1;

	/* Damaged copies, each refused with its reason. */
	uint8_t *d = malloc(keep_n + 8192);
	uint64_t doff = desc_off(keep), desc;
	memcpy(&desc, keep + 40, 8);
	memcpy(d, keep, keep_n);
	expect_refused("unsealed", d, keep_n, true, "not sealed");
	{
		int fd = memfd_of(d, keep_n, true);
		fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
		struct aoqd_snap_key key;
		struct aoqd_state st;
		char why[512] = "";
		int r = aoqd_fdstore_decode(fd, "aoq-state-9", 0, &locked, 2, &key, &st, why, sizeof(why));
		EXPECT(r < 0 && strstr(why, "sealed against writes"), "write-sealed: r %d, why '%s'", r, why);
		close(fd);
	}
	expect_refused("cut short", d, keep_n - 4096, false, "not the");
	memset(d + keep_n, 0, 8192);
	expect_refused("grown", d, keep_n + 4096, false, "not the");
	expect_refused("header only", d, 63, false, "not a memfd of the stored form");
	d[doff + 3] ^= 1;
	expect_refused("descriptor byte", d, keep_n, false, "checksum mismatch");
	memcpy(d, keep, keep_n);
	d[8] = 4;
	expect_refused("version", d, keep_n, false, "version 4");
	/* an older aoqd's layout (its slots without the masters' phase) */
	d[8] = 2;
	expect_refused("older version", d, keep_n, false, "version 2");
	memcpy(d, keep, keep_n);
	d[0] = 'X';
	expect_refused("magic", d, keep_n, false, "magic");
	memcpy(d, keep, keep_n);
	d[4096 + 24] = 3; /* the journal's stop mark (state.h, AOQD_STOPPED_*) */
	expect_refused("stop mark", d, keep_n, false, "bad stop mark 3");
	memcpy(d, keep, keep_n);
	memset(d, 0, 8);
	expect_refused("no header", d, keep_n, false, "no stored-form header");
	memcpy(d, keep, keep_n);
	d[50] = 1;
	expect_refused("reserved", d, keep_n, false, "reserved");
	memcpy(d, keep, keep_n);
	d[1000] = 1;
	expect_refused("header page", d, keep_n, false, "reserved");
	memcpy(d, keep, keep_n);
	uint32_t big = 1u << 30;
	memcpy(d + doff + 8, &big, 4); /* the job's length */
	fix_crc(d);
	expect_refused("job length", d, keep_n, false, "job name");

	memcpy(d, keep, keep_n);
	uint32_t many = 1u << 24;
	memcpy(d + doff + 12 + 5 + 24 + 8 + 4 + 4 + 4, &many, 4); /* tensors, after job "job-0" */
	fix_crc(d);
	expect_refused("tensor count", d, keep_n, false, "do not fit");

	memcpy(d, keep, keep_n);
	uint64_t numel;
	memcpy(&numel, d + doff + 12 + 5 + 48 + 68 * 3 + 4 + 15, 8); /* tensor 0's numel ("layers.0.weight") */
	numel += 4096;
	memcpy(d + doff + 12 + 5 + 48 + 68 * 3 + 4 + 15, &numel, 8);
	fix_crc(d);
	expect_refused("numel", d, keep_n, false, "slots take");

	/* Random mutations of the descriptor (checksum made right) and of the
	 * header: refused, or a state mapped from the memfd's own slots
	 * (never a read outside the memfd: ASan, no SIGBUS). */
	int loaded = 0;
	for (int it = 0; it < 3000; it++) {
		memcpy(d, keep, keep_n);
		int flips = 1 + (int)(rnd() % 4);
		for (int f = 0; f < flips; f++) {
			size_t at = it % 3 == 0 ? (size_t)(rnd() % 64) : doff + (size_t)(rnd() % desc);
			d[at] = rnd() % 3 == 0 ? (uint8_t)rnd() : (uint8_t)(d[at] ^ (1u << (rnd() % 8)));
		}
		if (it % 3)
			fix_crc(d);
		int fd = memfd_of(d, keep_n, false);
		struct aoqd_snap_key k2;
		struct aoqd_state back;
		char why[512] = "";
		if (aoqd_fdstore_decode(fd, "aoq-state-9", 0, &locked, 2, &k2, &back, why, sizeof(why)) == 0) {
			loaded++;
			EXPECT(back.ntensors >= 1 && back.ngroups >= 1, "a decoded state without tensors");
			back.store_kept = true;
			aoqd_state_free(&back, &locked);
		} else {
			EXPECT(why[0], "refused without a reason");
		}
		close(fd);
	}
	printf("mutations: %d of 3000 decoded (values the checks allow), the rest refused\n", loaded);

	/* The journal: a step half done when aoqd was killed.  Its log's
	 * ranges come back from the undo copy, the counters are the
	 * boundary's, the hyperparameters the last set. */
	{
		struct aoqd_state st;
		journal_state(&st, "journal");
		uint64_t nt = st.ntensors, ng = st.ngroups, open = st.last_step + 1, steps0[3];
		size_t mb = st.tensors[0].numel * 4;
		uint8_t *before = malloc(mb);
		memcpy(before, st.tensors[0].st.master, mb);
		for (uint32_t i = 0; i < 2; i++) {
			struct aoqd_tensor *t = &st.tensors[i];
			steps0[i] = t->steps;
			aoqd_state_save_logged(&st, t, 0, t->numel, open);
			memset(t->st.master, 0x55, t->numel * 4); /* its kernel ran */
			t->steps++;
		}
		steps0[2] = st.tensors[2].steps;
		st.groups[0].hp.lr = 0.5;
		aoqd_state_journal_hp(&st, 0);
		size_t jn;
		int fd = dup(st.mem_fd);
		uint8_t *img = read_all(fd, &jn);
		struct aoqd_snap_key k2;
		struct aoqd_state back;
		char why[512] = "";
		int r = aoqd_fdstore_decode(fd, "aoq-state-3", 0, &locked, 2, &k2, &back, why, sizeof(why));
		EXPECT(r == 0, "replay: %s", why);
		if (r == 0) {
			EXPECT(back.last_step == open - 1, "replay: last step %" PRIu64, back.last_step);
			EXPECT(memcmp(back.tensors[0].st.master, before, mb) == 0, "replay: tensor 0 not taken back");
			for (uint32_t i = 0; i < 3; i++)
				EXPECT(back.tensors[i].steps == steps0[i], "replay: tensor %u steps %" PRIu64 ", want %" PRIu64, i,
				       back.tensors[i].steps, steps0[i]);
			EXPECT(back.groups[0].hp.lr == 0.5, "replay: lr %g", back.groups[0].hp.lr);
			back.store_kept = true;
			aoqd_state_free(&back, &locked);
		}
		close(fd);
		/* hostile journals, each refused with its reason */
		const size_t J = 4096, E = J + 64 + 16 * nt + 136 * ng;
		struct {
			const char *what, *want;
			size_t at;
			uint64_t v;
			int size;
		} bad[] = {
			{ "dirty", "no step boundary", J, (open - 1) | AOQD_JOURNAL_DIRTY, 8 },
			{ "log past cap", "overflowed", J + 8, 1u << 30, 8 },
			{ "overflow", "overflowed", J + 16, 1, 4 },
			{ "cap", "a log of", J + 20, 3, 4 },
			{ "entry tensor", "tensor 999", E + 8, 999, 4 },
			{ "entry range", "elements", E + 16, 1u << 30, 8 },
			{ "steps", "steps", J + 64 + 8 * ((open - 1) & 1) * nt, 1ull << 63, 8 },
			{ "hp selector", "selector", J + 64 + 16 * nt, 7, 4 },
		};
		for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
			uint8_t *m = malloc(jn);
			memcpy(m, img, jn);
			memcpy(m + bad[k].at, &bad[k].v, (size_t)bad[k].size);
			expect_refused(bad[k].what, m, jn, false, bad[k].want);
			free(m);
		}
		free(img);
		free(before);
		aoqd_state_free(&st, &locked);
	}

	/* A log whose ranges overlap (aoqd logs each range of a step once;
	 * another writer of the memfd may not): replayed as their union, on
	 * four threads that never copy the same bytes (the tsan suite runs
	 * this). */
	{
		struct aoqd_state st;
		journal_state(&st, "overlap");
		uint64_t open = st.last_step + 1;
		struct aoqd_tensor *t = &st.tensors[0];
		uint64_t n = t->numel;
		size_t mb = n * 4;
		uint8_t *before = malloc(mb);
		memcpy(before, t->st.master, mb);
		aoqd_state_save_logged(&st, t, 0, n, open);
		aoqd_state_save_logged(&st, t, 0, n, open);
		aoqd_state_save_logged(&st, t, n / 4, n / 2, open);
		aoqd_state_save_logged(&st, t, n / 2, n - n / 2, open);
		memset(t->st.master, 0x55, mb);
		int fd = dup(st.mem_fd);
		struct aoqd_snap_key k2;
		struct aoqd_state back;
		char why[512] = "";
		int r = aoqd_fdstore_decode(fd, "aoq-state-3", 0, &locked, 4, &k2, &back, why, sizeof(why));
		EXPECT(r == 0, "overlapping log: %s", why);
		if (r == 0) {
			EXPECT(memcmp(back.tensors[0].st.master, before, mb) == 0, "overlapping log: tensor 0 not taken back");
			back.store_kept = true;
			aoqd_state_free(&back, &locked);
		}
		close(fd);
		free(before);
		aoqd_state_free(&st, &locked);
	}
	EXPECT(atomic_load(&locked) == 0, "locked bytes left: %" PRIu64, (uint64_t)atomic_load(&locked));
	free(d);
	free(keep);
	return failures != 0;
}
