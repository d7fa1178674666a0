/* SPDX-License-Identifier: MIT */
/*
 * Snapshot files (daemon/snapshot.c) without a daemon:
 *  - write -> load round trip, byte for byte, of random states in every
 *    precision, with an SGD group without momentum (no moments), a Lion
 *    group (one), duplicate tensor names (indexed keys), split masters of
 *    16 and of 8 low bits (the 24-bit master);
 *  - damaged files are refused with a message naming what is wrong: a
 *    flipped data byte (checksum), truncation, a bad header length, bad
 *    JSON, a wrong format version, a bad checksum field;
 *  - random mutations of the header and length never crash the loader
 *    (this test runs under ASan/UBSan in tests/run-all.sh) and never load
 *    something that differs from what was written.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

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

/* A random state: groups AdamW, SGD without momentum and Lion (no q8 for
 * the last two), tensors of odd sizes, random bytes in every array; m24:
 * split masters (q8 and q4 beside bf16 parameters) keep 8 low bits. */
static void make_state(struct aoqd_state *st, int prec, uint32_t nt, bool dup_names, bool m24)
{
	memset(st, 0, sizeof(*st));
	st->precision = (Aoq__StatePrecision)prec;
	st->master24 = m24;
	st->seed = rnd();
	st->window = rnd() % 2 ? 0 : 1u << 20;
	st->skip_nonfinite = rnd() % 2;
	st->max_grad_norm = rnd() % 2 ? 0 : 1.25;
	bool q8 = aoqk_precision_blocked((enum aoqk_precision)prec); /* q8 or q4 */
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
		snprintf(nm, sizeof(nm), "layers.%u.weight", dup_names ? 0 : i);
		t->name = strdup(nm);
		t->numel = 1 + rnd() % 3000;
		t->group = (uint32_t)(rnd() % st->ngroups);
		/* with m24, the first tensor's bf16 parameter splits its master */
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
		uint8_t *p = t->state_mem;
		for (size_t k = 0; k < t->state_len; k++)
			p[k] = (uint8_t)rnd();
		fill_split_master(t, rnd);
		EXPECT(!aoqd_tensor_lo(t) || aoqd_tensor_lo_size(t) == (m24 ? 1u : 2u), "tensor %u: a low half of %u bytes",
		       i, aoqd_tensor_lo_size(t));
	}
}

static size_t arr_bytes(const struct aoqd_state *st, const struct aoqd_tensor *t, int k)
{
	enum aoqk_precision p = (enum aoqk_precision)st->precision;
	size_t blocks = aoqk_scale_count(p, t->numel);
	switch (k) {
	case 0: return t->numel * aoqd_tensor_master_size(t);
	case 5: return t->numel * aoqd_tensor_lo_size(t);
	case 1: return t->st.m ? aoqk_moment_bytes(p, t->numel) : 0;
	case 2: return t->st.v ? aoqk_moment_bytes(p, t->numel) : 0;
	case 3: return t->st.m_scale && t->st.m ? blocks * 4 : 0;
	default: return t->st.v_scale && t->st.v ? blocks * 4 : 0;
	}
}

static const void *arr(const struct aoqk_state *a, int k)
{
	const void *p[6] = { a->master, a->m, a->v, a->m_scale, a->v_scale, aoqd_lo(a) };
	return p[k];
}

/* Everything a snapshot keeps is equal. */
static bool same_state(const struct aoqd_state *a, const struct aoqd_state *b, char *why, size_t len)
{
	if (a->precision != b->precision || a->master24 != b->master24 || a->seed != b->seed || a->window != b->window ||
	    a->skip_nonfinite != b->skip_nonfinite || a->max_grad_norm != b->max_grad_norm ||
	    a->ngroups != b->ngroups || a->ntensors != b->ntensors) {
		snprintf(why, len, "options or counts differ");
		return false;
	}
	for (uint32_t g = 0; g < a->ngroups; g++) {
		const struct aoqd_group *x = &a->groups[g], *y = &b->groups[g];
		if (x->kind != y->kind || x->hp.lr != y->hp.lr || x->hp.beta1 != y->hp.beta1 || x->hp.beta2 != y->hp.beta2 ||
		    x->hp.eps != y->hp.eps || x->hp.weight_decay != y->hp.weight_decay || x->moments != y->moments ||
		    x->hp.decoupled != y->hp.decoupled) {
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
		for (int k = 0; k < 6; k++) {
			size_t n = arr_bytes(a, x, k);
			if (n != arr_bytes(b, y, k) || (n && memcmp(arr(&x->st, k), arr(&y->st, k), n))) {
				snprintf(why, len, "tensor %u array %d differs", i, k);
				return false;
			}
		}
	}
	return true;
}

static char dir[64];

static void copy_file(const char *from, const char *to, uint8_t **data, size_t *size)
{
	FILE *f = fopen(from, "rb");
	fseek(f, 0, SEEK_END);
	*size = (size_t)ftell(f);
	fseek(f, 0, SEEK_SET);
	*data = malloc(*size + 1);
	if (fread(*data, 1, *size, f) != *size)
		exit(1);
	fclose(f);
	(void)to;
}

static void put_file(const char *path, const uint8_t *d, size_t n)
{
	FILE *f = fopen(path, "wb");
	fwrite(d, 1, n, f);
	fclose(f);
}

/* The damaged copy must be refused with `want` in the message. */
static void expect_refused(const char *what, const uint8_t *d, size_t n, const char *want)
{
	char path[128], why[512] = "";
	snprintf(path, sizeof(path), "%s/bad.safetensors", dir);
	put_file(path, d, n);
	struct aoqd_state st;
	struct aoqd_snap_key key;
	uint64_t step;
	int r = aoqd_snapshot_load(path, 0, &locked, &key, &step, &st, why, sizeof(why));
	EXPECT(r < 0, "%s: loaded", what);
	if (r == 0)
		aoqd_state_free(&st, &locked);
	EXPECT(r >= 0 || strstr(why, want), "%s: message '%s' lacks '%s'", what, why, want);
}

static void round_trip(int prec, bool dup, bool m24)
{
	struct aoqd_state st, back;
	make_state(&st, prec, 1 + (uint32_t)(rnd() % 12), dup, m24);
	struct aoqd_snap_key key = { .uid = 1000, .rank = 3 };
	snprintf(key.job, sizeof(key.job), "job-%d \"quoted\" /x", prec);
	char path[4096], why[512];
	struct aoqd_error err;
	int r = aoqd_snapshot_write(dir, &key, 4242, &st, path, sizeof(path), &err);
	EXPECT(r == 0, "write (precision %d): %s", prec, err.msg);
	struct aoqd_snap_key k2;
	uint64_t step = 0;
	r = aoqd_snapshot_load(path, 0, &locked, &k2, &step, &back, why, sizeof(why));
	EXPECT(r == 0, "load (precision %d): %s", prec, why);
	if (r == 0) {
		EXPECT(step == 4242 && k2.uid == 1000 && k2.rank == 3 && strcmp(k2.job, key.job) == 0, "key or step");
		EXPECT(same_state(&st, &back, why, sizeof(why)), "precision %d%s%s: %s", prec, dup ? " (dup names)" : "",
		       m24 ? " (24-bit master)" : "", why);
		aoqd_state_free(&back, &locked);
	}
	/* Damaged copies of this file. */
	uint8_t *d;
	size_t n;
	copy_file(path, NULL, &d, &n);
	uint64_t hlen = 0;
	for (int i = 0; i < 8; i++)
		hlen |= (uint64_t)d[i] << (8 * i);
	d[n - 1] ^= 0x10;
	expect_refused("flipped data byte", d, n, "checksum");
	d[n - 1] ^= 0x10;
	expect_refused("truncated", d, n - 1, "do not hold");
	expect_refused("no header", d, 5, "truncated");
	uint8_t save[8];
	memcpy(save, d, 8);
	d[5] = 1; /* 2^40 */
	expect_refused("huge header length", d, n, "bad header length");
	memcpy(d, save, 8);
	d[8] = 'x';
	expect_refused("bad JSON", d, n, "not JSON");
	d[8] = '{';
	char *v = memmem(d + 8, hlen, "\"format_version\":\"1\"", 20);
	EXPECT(v != NULL, "no format_version in the header");
	if (v) {
		v[18] = '9';
		expect_refused("wrong version", d, n, "format version 9");
		v[18] = '1';
		memcpy(v + 17, "11 ", 3); /* a number where a string belongs */
		expect_refused("metadata not a string", d, n, "metadata format_version is not a string");
		memcpy(v + 17, "\"1\"", 3);
	}
	char *c = memmem(d + 8, hlen, "\"checksum\":\"crc32:", 18);
	if (c) {
		c[18] = 'g'; /* not hex */
		expect_refused("bad checksum field", d, n, "bad checksum");
		c[18] = '0';
	}
	/* Fuzz: random mutations of the header (and its length) must be
	 * refused or load exactly what was written. */
	int iters = getenv("AOQ_TEST_SLOW") ? 20 : 150;
	for (int it = 0; it < iters; it++) {
		uint8_t *m = malloc(n);
		memcpy(m, d, n);
		size_t mn = n;
		int kind = (int)(rnd() % 4);
		if (kind == 0) {
			for (int j = 0; j < 1 + (int)(rnd() % 4); j++)
				m[8 + rnd() % hlen] = (uint8_t)rnd();
		} else if (kind == 1) {
			m[rnd() % 8] = (uint8_t)rnd();
		} else if (kind == 2) {
			mn = rnd() % n;
		} else {
			/* a digit in the header changed to another digit */
			for (int j = 0; j < 20; j++) {
				size_t at = 8 + rnd() % hlen;
				if (m[at] >= '0' && m[at] <= '9') {
					m[at] = (uint8_t)('0' + rnd() % 10);
					break;
				}
			}
		}
		char p2[128];
		snprintf(p2, sizeof(p2), "%s/fuzz.safetensors", dir);
		put_file(p2, m, mn);
		struct aoqd_state fs;
		struct aoqd_snap_key fk;
		uint64_t fstep;
		if (aoqd_snapshot_load(p2, 0, &locked, &fk, &fstep, &fs, why, sizeof(why)) == 0) {
			/* a mutation the format does not see (a job name
			 * byte, a hyperparameter digit...) may load; the arrays
			 * must still be what was written */
			bool same_arrays = fs.ntensors == st.ntensors;
			for (uint32_t i = 0; same_arrays && i < st.ntensors; i++)
				for (int k = 0; k < 5; k++) {
					size_t b = arr_bytes(&st, &st.tensors[i], k);
					if (b != arr_bytes(&fs, &fs.tensors[i], k) ||
					    (b && memcmp(arr(&st.tensors[i].st, k), arr(&fs.tensors[i].st, k), b)))
						same_arrays = false;
				}
			EXPECT(same_arrays || fs.precision != st.precision, "a mutated file loaded other arrays");
			aoqd_state_free(&fs, &locked);
		}
		free(m);
	}
	free(d);
	aoqd_state_free(&st, &locked);
}

struct restored {
	int n;
	uint32_t ranks;
};

static int on_restore(const struct aoqd_snap_key *key, uint64_t step, struct aoqd_state *st, void *arg)
{
	struct restored *r = arg;
	EXPECT(step == 4242 && key->uid == 1000 && st->ntensors > 0, "restored key/step/state");
	r->n++;
	r->ranks |= 1u << key->rank;
	if (key->rank == 5)
		return -EINVAL; /* refused: freed by the caller */
	aoqd_state_free(st, &locked);
	free(st);
	return 0;
}

/* restore_all: every good file of a directory, damaged ones skipped. */
static void restore(void)
{
	char rd[80], path[4096];
	snprintf(rd, sizeof(rd), "%s/restore", dir);
	mkdir(rd, 0700);
	struct aoqd_error err;
	for (uint32_t rank = 4; rank <= 6; rank++) {
		struct aoqd_state st;
		make_state(&st, (int)rank % 5, 3, false, true);
		struct aoqd_snap_key key = { .uid = 1000, .rank = rank };
		snprintf(key.job, sizeof(key.job), "r");
		EXPECT(aoqd_snapshot_write(rd, &key, 4242, &st, path, sizeof(path), &err) == 0, "%s", err.msg);
		aoqd_state_free(&st, &locked);
	}
	/* damage rank 6's file */
	uint8_t *d;
	size_t n;
	copy_file(path, NULL, &d, &n);
	d[n - 3] ^= 1;
	put_file(path, d, n);
	free(d);
	struct restored r = { 0, 0 };
	int got = aoqd_snapshot_restore_all(rd, 0, &locked, on_restore, &r);
	EXPECT(got == 1 && r.n == 2 && r.ranks == ((1u << 4) | (1u << 5)), "restore_all: %d taken, %d offered, ranks 0x%x",
	       got, r.n, r.ranks);
	/* the damaged file is renamed aside, not tried again */
	char aside[4200];
	snprintf(aside, sizeof(aside), "%s.rejected", path);
	EXPECT(access(path, F_OK) < 0 && access(aside, F_OK) == 0, "the damaged file was not renamed to %s", aside);
	r = (struct restored){ 0, 0 };
	got = aoqd_snapshot_restore_all(rd, 0, &locked, on_restore, &r);
	EXPECT(got == 1 && r.n == 2, "restore_all again: %d taken, %d offered", got, r.n);
	EXPECT(aoqd_snapshot_restore_all("/nonexistent-aoq", 0, &locked, on_restore, &r) == -ENOENT, "no dir");
}

int main(void)
{
	const char *seed = getenv("AOQ_TEST_SEED");
	rs = seed ? strtoull(seed, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
	printf("seed %" PRIu64 "\n", rs);
	snprintf(dir, sizeof(dir), "/tmp/aoq-snap-XXXXXX");
	if (!mkdtemp(dir))
		return 1;
	for (int prec = 0; prec <= AOQK_STATE_BF16_Q4; prec++) {
		round_trip(prec, false, false);
		round_trip(prec, true, false);
		round_trip(prec, false, true);
	}
	restore();
	/* The atomic write leaves nothing behind but the files. */
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "ls -A %s | grep -c '^\\.snapshot-' >/dev/null && exit 1; rm -rf %s", dir, dir);
	EXPECT(system(cmd) == 0, "a temp file was left in %s", dir);
	EXPECT(atomic_load(&locked) == 0, "locked bytes not given back");
	if (failures)
		fprintf(stderr, "%d failures (seed %" PRIu64 ")\n", failures, rs);
	return failures ? 1 : 0;
}
