/* SPDX-License-Identifier: MIT */
/*
 * Optimizer state: hyperparameter rules, the undo copy (saves, the
 * journal's records, rollback), accumulators, what a session charges its
 * uid, the arrays' conversion to and from fp32 for state transfer, layout
 * comparison.  Where the arrays live is statemem.c.  Loop thread, except
 * aoqd_state_io(), which transfer tasks run on workers (each its own
 * range), and the saves and copies the workers make.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "aoq-arena.h"
#include "convert.h"
#include "log.h"
#include "pool.h"
#include "state.h"
#include "wire.h"


bool aoqd_kind_valid(int kind)
{
	return kind == AOQ__OPTIMIZER_KIND__ADAMW || kind == AOQ__OPTIMIZER_KIND__ADAM ||
	       kind == AOQ__OPTIMIZER_KIND__SGD || kind == AOQ__OPTIMIZER_KIND__LION;
}

static const char *kind_name(int kind)
{
	const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(&aoq__optimizer_kind__descriptor, kind);
	return v ? v->name : "?";
}

bool aoqd_hp_valid(int kind, const Aoq__Hyperparams *h, char *why, size_t len)
{
	if (!h) {
		snprintf(why, len, "missing hyperparameters");
		return false;
	}
	bool ok = isfinite(h->lr) && h->lr >= 0 && isfinite(h->weight_decay) && h->weight_decay >= 0;
	switch (kind) {
	case AOQ__OPTIMIZER_KIND__SGD:
		/* torch.optim.SGD; the nesterov rule is torch's (and the kernel's) */
		ok = ok && h->momentum >= 0 && h->momentum < 1 && h->dampening >= 0 && h->dampening <= 1 &&
		     (!h->nesterov || (h->momentum > 0 && h->dampening == 0));
		if (!ok) {
			snprintf(why, len, "SGD hyperparameters out of range (lr %g momentum %g dampening %g nesterov %d wd %g; "
			         "nesterov needs momentum > 0 and dampening 0)",
			         h->lr, h->momentum, h->dampening, (int)h->nesterov, h->weight_decay);
			return false;
		}
		return true;
	case AOQ__OPTIMIZER_KIND__LION:
		ok = ok && h->beta1 >= 0 && h->beta1 < 1 && h->beta2 >= 0 && h->beta2 < 1;
		break;
	default:
		ok = ok && h->beta1 >= 0 && h->beta1 < 1 && h->beta2 >= 0 && h->beta2 < 1 && isfinite(h->eps) && h->eps > 0;
		break;
	}
	if (!ok) {
		snprintf(why, len, "%s hyperparameters out of range (lr %g betas %g %g eps %g wd %g)",
		         kind_name(kind), h->lr, h->beta1, h->beta2, h->eps, h->weight_decay);
		return false;
	}
	return true;
}

bool aoqd_kind_precision_ok(int kind, Aoq__StatePrecision p)
{
	/* kernels/README.md, "SGD and Lion": no q8 or q4 moment for SGD and Lion */
	if (kind == AOQ__OPTIMIZER_KIND__SGD || kind == AOQ__OPTIMIZER_KIND__LION)
		return !aoqk_precision_blocked((enum aoqk_precision)p);
	return true;
}

unsigned aoqd_group_moments(const struct aoqd_group *g)
{
	switch (g->kind) {
	case AOQ__OPTIMIZER_KIND__SGD:
		return g->hp.momentum != 0 ? 1 : 0;
	case AOQ__OPTIMIZER_KIND__LION:
		return 1;
	default:
		return 2;
	}
}

void aoqd_group_set(struct aoqd_group *g, Aoq__OptimizerKind kind, const Aoq__Hyperparams *h)
{
	g->kind = kind;
	g->hp.lr = h->lr;
	g->hp.beta1 = h->beta1;
	g->hp.beta2 = h->beta2;
	g->hp.eps = h->eps;
	g->hp.weight_decay = h->weight_decay;
	g->hp.decoupled = kind == AOQ__OPTIMIZER_KIND__ADAMW;
	g->hp.momentum = kind == AOQ__OPTIMIZER_KIND__SGD ? h->momentum : 0;
	g->hp.dampening = kind == AOQ__OPTIMIZER_KIND__SGD ? h->dampening : 0;
	g->hp.nesterov = kind == AOQ__OPTIMIZER_KIND__SGD && h->nesterov;
	g->hp.grad_scale = 1.0f;
}

bool aoqd_dtype_valid(int d)
{
	return d == AOQ__DTYPE__FP32 || d == AOQ__DTYPE__BF16 || d == AOQ__DTYPE__FP16;
}

uint64_t aoqd_state_len(enum aoqk_precision p, uint64_t n, unsigned moments, unsigned lo,
                        uint64_t off[AOQD_STATE_ARRAYS])
{
	uint64_t master = n * (lo ? 2 : aoqk_master_size(p));
	uint64_t mom = aoqk_moment_bytes(p, n);
	uint64_t scale = aoqk_scale_count(p, n) * 4;
	uint64_t o = 0;
	off[0] = o; o = aoq_align_up(o + master, 64);
	off[1] = o; o = aoq_align_up(o + (moments >= 1 ? mom : 0), 64);
	off[2] = o; o = aoq_align_up(o + (moments >= 2 ? mom : 0), 64);
	off[3] = o; o = aoq_align_up(o + scale, 64);
	off[4] = o; o = aoq_align_up(o + scale, 64);
	off[5] = o; o = aoq_align_up(o + n * lo, 64);
	return o;
}

int aoqd_state_charge(struct aoqd_state *st, uint64_t n)
{
	if (!st->account)
		return 0;
	int r = aoqd_account_charge(st->account, n, st->quota);
	if (r == 0)
		st->charged += n;
	return r;
}

uint64_t aoqd_state_quota(const struct aoqd_state *st)
{
	return st->account ? aoqd_account_limit(st->account, st->quota) : st->quota;
}

int aoqd_tensor_mark_done(struct aoqd_tensor *t, uint64_t b, uint64_t n)
{
	uint64_t e = b + n; /* validated: within the tensor */
	uint32_t i = 0;
	/* Sorted and merged: every range before i ends before b. */
	while (i < t->ndone && t->done[i].e < b)
		i++;
	if (i < t->ndone && t->done[i].b < e && b < t->done[i].e)
		return -EEXIST;
	if (i < t->ndone && t->done[i].e == b) {
		t->done[i].e = e;
		if (i + 1 < t->ndone && t->done[i + 1].b == e) {
			t->done[i].e = t->done[i + 1].e;
			memmove(&t->done[i + 1], &t->done[i + 2], (t->ndone - i - 2) * sizeof(t->done[0]));
			t->ndone--;
		}
	} else if (i < t->ndone && t->done[i].b == e) {
		t->done[i].b = b;
	} else {
		struct aoqd_range *d = aoq_grow(t->done, &t->cap_done, t->ndone + 1, sizeof(*d));
		if (!d)
			return -ENOMEM;
		t->done = d;
		memmove(&t->done[i + 1], &t->done[i], (t->ndone - i) * sizeof(t->done[0]));
		t->done[i] = (struct aoqd_range){ b, e };
		t->ndone++;
	}
	return t->ndone == 1 && t->done[0].b == 0 && t->done[0].e == t->numel;
}

int aoqd_state_acc(struct aoqd_state *st, struct aoqd_tensor *t)
{
	if (t->acc)
		return 0;
	if (aoqd_state_charge(st, aoqd_page_round(t->numel * sizeof(float))) < 0)
		return -EDQUOT;
	void *p = mmap(NULL, t->numel * sizeof(float), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		uint64_t n = aoqd_page_round(t->numel * sizeof(float));
		if (st->account)
			aoqd_account_uncharge(st->account, n);
		st->charged -= n;
		return -ENOMEM;
	}
	t->acc = p;
	st->state_bytes += t->numel * sizeof(float);
	return 0;
}

void aoqd_state_io(struct aoqd_tensor *t, int what, bool load, float *buf, uint64_t e, size_t n)
{
	if (what == AOQ__STATE_KIND__MASTER || what == AOQ__STATE_KIND__PARAM) {
		if (aoqd_tensor_lo(t)) {
			unsigned ls = aoqd_tensor_lo_size(t);
			uint16_t *hi = (uint16_t *)t->st.master + e;
			uint8_t *lo = (uint8_t *)aoqd_tensor_lo(t) + e * ls;
			if (load)
				aoqd_master_split(hi, lo, ls, buf, n);
			else
				aoqd_master_join(buf, hi, lo, ls, n);
		} else if (aoqk_precision_bf16_master(t->st.precision)) {
			if (load)
				aoqd_from_f32((uint16_t *)t->st.master + e, AOQK_BF16, buf, n);
			else
				aoqd_to_f32(buf, (uint16_t *)t->st.master + e, AOQK_BF16, n);
		} else if (load) {
			memcpy((float *)t->st.master + e, buf, n * sizeof(float));
		} else {
			memcpy(buf, (float *)t->st.master + e, n * sizeof(float));
		}
		return;
	}
	bool second = what == AOQ__STATE_KIND__EXP_AVG_SQ;
	void *mom = second ? t->st.v : t->st.m;
	if (aoqk_precision_q8(t->st.precision)) {
		float *scale = second ? t->st.v_scale : t->st.m_scale;
		if (load)
			aoqd_q8_encode(mom, scale, buf, second, e, n);
		else
			aoqd_q8_decode(buf, mom, scale, second, e, n);
	} else if (aoqk_precision_q4(t->st.precision)) {
		float *scale = second ? t->st.v_scale : t->st.m_scale;
		if (load)
			aoqd_q4_encode(mom, scale, buf, second, e, n, t->numel);
		else
			aoqd_q4_decode(buf, mom, scale, second, e, n);
	} else if (aoqk_precision_bf16_moments(t->st.precision)) {
		if (load)
			aoqd_from_f32((uint16_t *)mom + e, AOQK_BF16, buf, n);
		else
			aoqd_to_f32(buf, (uint16_t *)mom + e, AOQK_BF16, n);
	} else if (load) {
		memcpy((float *)mom + e, buf, n * sizeof(float));
	} else {
		memcpy(buf, (float *)mom + e, n * sizeof(float));
	}
}

/* A copy the update path will not read back (the lease's undo copy, a
 * snapshot's capture): on x86-64 with non-temporal stores, so it neither
 * reads its target's lines first (read for ownership: as many bytes again
 * as it writes) nor pushes the state the kernel is about to update out of
 * the caches.  The caller fences (_mm_sfence) before anyone reads it. */
static void copy_aside(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__x86_64__)
	if (n >= 256) {
		size_t head = (size_t)(-(uintptr_t)dst & 15);
		memcpy(dst, src, head);
		dst += head;
		src += head;
		n -= head;
		for (; n >= 64; dst += 64, src += 64, n -= 64) {
			__m128i a = _mm_loadu_si128((const __m128i *)(const void *)src);
			__m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + 16));
			__m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 32));
			__m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + 48));
			_mm_stream_si128((__m128i *)(void *)dst, a);
			_mm_stream_si128((__m128i *)(void *)(dst + 16), b);
			_mm_stream_si128((__m128i *)(void *)(dst + 32), c);
			_mm_stream_si128((__m128i *)(void *)(dst + 48), d);
		}
	}
#endif
	memcpy(dst, src, n);
}

/* Copies elements [b, b + n) of every array of t between the state and
 * other, a region laid out as the state mapping (out: state -> other). */
static void range_copy(const struct aoqd_tensor *t, uint64_t b, uint64_t n, uint8_t *other, bool out)
{
	const uint8_t *base = t->state_mem;
	enum aoqk_precision p = t->st.precision;
	/* q8, q4: the ranges start on a block and end on one or at the end;
	 * q4's codes are bytes [b / 2, the end of the group of b + n) */
	uint64_t blk = aoqk_block(p) ? aoqk_block(p) : 1;
	bool q4 = aoqk_precision_q4(p);
	uint64_t mb = q4 ? b / 2 : b, mn = q4 ? aoqk_moment_bytes(p, b + n) - b / 2 : n;
	struct {
		void *arr;
		size_t el;
		uint64_t b, n;
	} part[AOQD_STATE_ARRAYS] = {
		{ t->st.master, aoqd_tensor_master_size(t), b, n },
		{ aoqd_tensor_lo(t), aoqd_tensor_lo_size(t), b, n },
		{ t->st.m, q4 ? 1 : aoqk_moment_size(p), mb, mn },
		{ t->st.v, q4 ? 1 : aoqk_moment_size(p), mb, mn },
		{ t->st.m_scale, 4, b / blk, (b + n + blk - 1) / blk - b / blk },
		{ t->st.v_scale, 4, b / blk, (b + n + blk - 1) / blk - b / blk },
	};
	for (int i = 0; i < AOQD_STATE_ARRAYS; i++) {
		if (!part[i].arr)
			continue;
		uint8_t *live = (uint8_t *)part[i].arr + part[i].b * part[i].el;
		uint8_t *copy = other + (live - base);
		if (out)
			copy_aside(copy, live, part[i].n * part[i].el);
		else
			memcpy(live, copy, part[i].n * part[i].el);
	}
#if defined(__x86_64__)
	if (out)
		_mm_sfence(); /* the non-temporal stores of copy_aside */
#endif
}

static void undo_copy(struct aoqd_tensor *t, uint64_t b, uint64_t n, bool save)
{
	range_copy(t, b, n, (uint8_t *)t->state_mem + t->undo_off, save);
}

void aoqd_state_copy_out(const struct aoqd_tensor *t, uint64_t b, uint64_t n, void *dst)
{
	range_copy(t, b, n, dst, true);
}

void aoqd_state_save(struct aoqd_tensor *t, uint64_t b, uint64_t n)
{
	if (t->undo_off)
		undo_copy(t, b, n, true);
}

void aoqd_state_save_logged(struct aoqd_state *st, struct aoqd_tensor *t, uint64_t b, uint64_t n, uint64_t step)
{
	if (!t->undo_off)
		return;
	undo_copy(t, b, n, true); /* its non-temporal stores fenced */
	struct aoqd_journal *jh = st->jh;
	if (!jh)
		return;
	uint64_t i = atomic_fetch_add_explicit(&jh->log_n, 1, memory_order_relaxed);
	if (i >= jh->cap) {
		atomic_store_explicit(&jh->overflow, 1, memory_order_release);
		return;
	}
	struct aoqd_journal_entry *e = &st->jlog[i];
	e->tensor = (uint32_t)(t - st->tensors);
	e->offset = b;
	e->count = n;
	/* last: a kill before it leaves an entry of an older step, ignored
	 * (the range was saved but not yet changed) */
	atomic_store_explicit(&e->step, step, memory_order_release);
}

struct unsaver {
	struct aoqd_state *st;
	const struct aoqd_undo *u;
	size_t n;
};

static void *unsave_run(void *arg)
{
	const struct unsaver *w = arg;
	for (size_t i = 0; i < w->n; i++) {
		struct aoqd_tensor *t = &w->st->tensors[w->u[i].tensor];
		if (t->undo_off)
			undo_copy(t, w->u[i].off, w->u[i].count, false);
	}
	return NULL;
}

/* One thread copied back a whole step of 1 G fp32 parameters (12.9 GB) in
 * 1.2 s on the H200 host, most of a restart's pause after a kill
 * (RESULTS.md, "Restart under systemd").  A thread's start is tens of
 * microseconds: worth it from a few ranges on (the tests' small states
 * take this path too). */
void aoqd_state_unsave_all(struct aoqd_state *st, const struct aoqd_undo *u, size_t n, unsigned threads)
{
	uint64_t total = 0;
	for (size_t i = 0; i < n; i++)
		total += u[i].count;
	if (threads > AOQD_UNSAVE_THREADS)
		threads = AOQD_UNSAVE_THREADS;
	if (threads > n)
		threads = (unsigned)n;
	if (threads < 1)
		threads = 1;
	struct unsaver w[AOQD_UNSAVE_THREADS];
	uint64_t per = (total + threads - 1) / threads, acc = 0;
	size_t at = 0;
	for (unsigned k = 0; k < threads; k++) {
		size_t b = at;
		/* the ranges that begin in the k-th share of the elements */
		while (at < n && (k + 1 == threads || acc < (uint64_t)(k + 1) * per))
			acc += u[at++].count;
		w[k] = (struct unsaver){ st, u + b, at - b };
	}
	aoqd_threads_run(unsave_run, w, sizeof(w[0]), threads);
}

void aoqd_state_journal_boundary(struct aoqd_state *st)
{
	struct aoqd_journal *jh = st->jh;
	if (!jh)
		return;
	uint64_t *js = st->jsteps + (st->last_step & 1) * (uint64_t)st->ntensors;
	for (uint32_t i = 0; i < st->ntensors; i++)
		js[i] = st->tensors[i].steps;
	/* (a state without undo copy is made dirty by its first update:
	 * dataplane.c) */
	uint64_t dirty = st->dirty ? AOQD_JOURNAL_DIRTY : 0;
	atomic_store_explicit(&jh->boundary, st->last_step | dirty, memory_order_release);
	/* the log of the step that ended: its entries are of last_step or
	 * older from now on, and go */
	uint64_t n = atomic_load_explicit(&jh->log_n, memory_order_relaxed);
	for (uint64_t i = 0; i < n && i < jh->cap; i++)
		atomic_store_explicit(&st->jlog[i].step, 0, memory_order_relaxed);
	atomic_store_explicit(&jh->log_n, 0, memory_order_release);
	atomic_store_explicit(&jh->overflow, 0, memory_order_release);
}

void aoqd_state_journal_dirty(struct aoqd_state *st)
{
	if (st->jh)
		atomic_store_explicit(&st->jh->boundary, st->last_step | AOQD_JOURNAL_DIRTY, memory_order_release);
}

void aoqd_state_journal_hp(struct aoqd_state *st, uint32_t g)
{
	if (!st->jh || g >= st->ngroups)
		return;
	struct aoqd_journal_hp *h = &st->jhp[g];
	const struct aoqk_hparams *hp = &st->groups[g].hp;
	uint32_t next = (atomic_load_explicit(&h->sel, memory_order_relaxed) & 1) ^ 1;
	double *v = h->v[next];
	v[0] = hp->lr;
	v[1] = hp->beta1;
	v[2] = hp->beta2;
	v[3] = hp->eps;
	v[4] = hp->weight_decay;
	v[5] = hp->momentum;
	v[6] = hp->dampening;
	v[7] = hp->nesterov ? 1 : 0;
	atomic_store_explicit(&h->sel, next, memory_order_release);
}

bool aoqd_state_open_step(const struct aoqd_state *st)
{
	for (uint32_t i = 0; i < st->ntensors; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		if (t->cur_step > st->last_step && t->ndone && t->undo_off)
			return true;
	}
	return false;
}

void aoqd_state_rollback(struct aoqd_state *st, unsigned threads)
{
	uint64_t open = st->last_step + 1;
	/* the ranges the open step changed, copied back together (in turn
	 * where there is no memory for their list) */
	size_t n = 0, cap = 0;
	for (uint32_t i = 0; i < st->ntensors; i++)
		if (st->tensors[i].cur_step >= open && st->tensors[i].undo_off)
			cap += st->tensors[i].ndone;
	struct aoqd_undo *u = cap ? malloc(cap * sizeof(*u)) : NULL;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		if (t->acc_step >= open)
			t->acc_step = 0; /* the micro-batches of the open step are gone */
		if (t->cur_step < open)
			continue;
		for (uint32_t k = 0; k < t->ndone && t->undo_off; k++) {
			if (u)
				u[n++] = (struct aoqd_undo){ i, t->done[k].b, t->done[k].e - t->done[k].b };
			else
				undo_copy(t, t->done[k].b, t->done[k].e - t->done[k].b, false);
		}
		t->steps--; /* the open step counted it */
		t->cur_step = 0;
		t->ndone = 0;
	}
	aoqd_state_unsave_all(st, u, n, threads);
	free(u);
	/* back at last_step: the journal says so, its log empties */
	aoqd_state_journal_boundary(st);
}

static const char *dtype_name(enum aoqk_dtype d)
{
	return d == AOQK_FP32 ? "fp32" : d == AOQK_BF16 ? "bf16" : "fp16";
}

int aoqd_state_same_layout(const struct aoqd_state *st, const struct aoqd_state *old, char *why, size_t len)
{
	if (st->precision != old->precision) {
		snprintf(why, len, "state precision %s here, %s in the leased session",
		         protobuf_c_enum_descriptor_get_value(&aoq__state_precision__descriptor, st->precision)->name,
		         protobuf_c_enum_descriptor_get_value(&aoq__state_precision__descriptor, old->precision)->name);
		return -EINVAL;
	}
	if (st->master24 != old->master24) {
		snprintf(why, len, "a %s master here, a %s one in the leased session", st->master24 ? "24-bit" : "32-bit",
		         old->master24 ? "24-bit" : "32-bit");
		return -EINVAL;
	}
	if (st->ngroups != old->ngroups) {
		snprintf(why, len, "%u groups here, %u in the leased session", st->ngroups, old->ngroups);
		return -EINVAL;
	}
	for (uint32_t i = 0; i < st->ngroups; i++)
		if (st->groups[i].kind != old->groups[i].kind || st->groups[i].moments != old->groups[i].moments) {
			snprintf(why, len, "group %u: %s with %u moments here, %s with %u in the leased session", i,
			         kind_name(st->groups[i].kind), st->groups[i].moments, kind_name(old->groups[i].kind),
			         old->groups[i].moments);
			return -EINVAL;
		}
	if (st->ntensors != old->ntensors) {
		snprintf(why, len, "%u tensors here, %u in the leased session", st->ntensors, old->ntensors);
		return -EINVAL;
	}
	for (uint32_t i = 0; i < st->ntensors; i++) {
		const struct aoqd_tensor *a = &st->tensors[i], *b = &old->tensors[i];
		if (strcmp(a->name, b->name) != 0)
			snprintf(why, len, "tensor %u: name '%.200s' here, '%.200s' in the leased session", i, a->name, b->name);
		else if (a->numel != b->numel)
			snprintf(why, len, "tensor %u '%.200s': numel %" PRIu64 " here, %" PRIu64 " in the leased session", i,
			         a->name, a->numel, b->numel);
		else if (a->param_dtype != b->param_dtype || a->grad_dtype != b->grad_dtype)
			snprintf(why, len, "tensor %u '%.200s': param/grad dtype %s/%s here, %s/%s in the leased session", i,
			         a->name, dtype_name(a->param_dtype), dtype_name(a->grad_dtype), dtype_name(b->param_dtype),
			         dtype_name(b->grad_dtype));
		else if (a->group != b->group)
			snprintf(why, len, "tensor %u '%.200s': group %u here, %u in the leased session", i, a->name, a->group,
			         b->group);
		else
			continue;
		return -EINVAL;
	}
	return 0;
}
