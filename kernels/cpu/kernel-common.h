/* SPDX-License-Identifier: MIT */
/*
 * Helpers shared by every kernel variant: argument checks, the per-call
 * constants and the stochastic-rounding hash; the scalar dtype conversions
 * and the q8 codebook constants come from aoq-convert.h.
 *
 * Everything here is plain C; the SIMD variants include it too, and use it
 * only outside their inner loops.
 */
#ifndef AOQK_KERNEL_COMMON_H
#define AOQK_KERNEL_COMMON_H

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "aoq-convert.h"
#include "aoq-kernel.h"

#define AOQK_ALWAYS_INLINE inline __attribute__((always_inline))

/* The q8 codebook constants and the scalar conversions: aoq-convert.h. */


/* Per-call constants, computed once per chunk from the hyperparameters. */
struct aoqk_consts {
	float w1;        /* 1 - beta1 (lerp weight) */
	float w1c;       /* 1 - w1, for the large-weight lerp form */
	float b2;        /* beta2 */
	float w2;        /* 1 - beta2 */
	float nstep;     /* -(lr / (1 - beta1^step)) */
	float bc2s;      /* sqrt(1 - beta2^step) */
	float eps;
	float decay;     /* AdamW: 1 - lr * weight_decay */
	float wd;        /* Adam: weight_decay added as L2 to the gradient */
	float gscale;
	int lerp_small;  /* |w1| < 0.5: m + w1 * (g - m), else g - (g - m) * w1c */
	int adamw;       /* apply decay */
	int l2;          /* apply wd * param to the gradient */
	uint32_t srkey;  /* stochastic rounding key, from (seed, step) */
	/* SGD and Lion */
	float b1;        /* Lion: beta1 */
	float nlr;       /* -lr */
	float mom;       /* SGD: momentum */
	float damp1;     /* SGD: 1 - dampening */
	int wd_on;       /* weight_decay != 0 (SGD: L2, Lion: decoupled) */
	int mom_on;      /* SGD: momentum != 0 (else no buffer) */
	int first;       /* SGD: step 1, the buffer starts as the gradient */
	int nesterov;    /* SGD */
};

static inline uint64_t aoqk_splitmix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

static inline uint32_t aoqk_fmix32(uint32_t h)
{
	h ^= h >> 16;
	h *= 0x85ebca6bu;
	h ^= h >> 13;
	h *= 0xc2b2ae35u;
	h ^= h >> 16;
	return h;
}

/* Key of the index hash for the vector whose first element has global
 * index i0 (the high half of the index only moves the key). */
static inline uint32_t aoqk_sr_vkey(uint32_t srkey, uint64_t i0)
{
	return srkey + (uint32_t)(i0 >> 32) * 0x27d4eb2fu;
}

/* The 16 random bits used to round element i: the same function every
 * variant computes lane-wise. */
static inline uint32_t aoqk_sr_bits(uint32_t srkey, uint64_t i)
{
	return aoqk_fmix32((uint32_t)i + aoqk_sr_vkey(srkey, i)) >> 16;
}

static inline void aoqk_consts_init(struct aoqk_consts *k, const struct aoqk_hparams *hp,
                                    uint64_t seed)
{
	double b1 = hp->beta1, b2 = hp->beta2, lr = hp->lr, wd = hp->weight_decay;
	double step = (double)hp->step;
	double bc1 = 1.0 - pow(b1, step);
	double bc2 = 1.0 - pow(b2, step);

	k->w1 = (float)(1.0 - b1);
	k->w1c = 1.0f - k->w1; /* torch's lerp: opmath_t(1) - weight */
	k->b2 = (float)b2;
	k->w2 = (float)(1.0 - b2);
	k->nstep = (float)(-(lr / bc1));
	k->bc2s = (float)sqrt(bc2);
	k->eps = (float)hp->eps;
	k->decay = (float)(1.0 - lr * wd);
	k->wd = (float)wd;
	k->gscale = hp->grad_scale;
	k->lerp_small = fabsf(k->w1) < 0.5f;
	k->adamw = hp->decoupled && hp->weight_decay != 0.0;
	k->l2 = !hp->decoupled && hp->weight_decay != 0.0;
	k->srkey = (uint32_t)aoqk_splitmix64(seed ^ aoqk_splitmix64(hp->step));
	k->b1 = (float)b1;
	k->nlr = (float)-lr;
	k->mom = (float)hp->momentum;
	k->damp1 = (float)(1.0 - hp->dampening);
	k->wd_on = wd != 0.0;
	k->mom_on = hp->momentum != 0.0;
	k->first = hp->step == 1;
	k->nesterov = hp->nesterov;
}

static inline int aoqk_dtype_ok(enum aoqk_dtype t)
{
	return t == AOQK_FP32 || t == AOQK_BF16 || t == AOQK_FP16;
}

/* The contract of aoqk_kernel.adam, checked before touching anything. */
static inline int aoqk_check(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                             const struct aoqk_chunk *c, const struct aoqk_report *rep)
{
	if (!hp || !st || !c || !rep)
		return -EINVAL;
	if ((unsigned)st->precision > AOQK_STATE_BF16_ALL)
		return -EINVAL;
	if (!aoqk_dtype_ok(c->grad_dtype) || (c->param && !aoqk_dtype_ok(c->param_dtype)))
		return -EINVAL;
	if (hp->step == 0)
		return -EINVAL;
	if (c->begin > st->n || c->count > st->n - c->begin)
		return -EINVAL;
	if (c->count == 0)
		return 0;
	if (!c->grad || !st->master || !st->m || !st->v)
		return -EINVAL;
	if (aoqk_precision_q8(st->precision)) {
		if (c->begin % AOQK_Q8_BLOCK != 0)
			return -EINVAL;
		if (!st->m_scale || !st->v_scale)
			return -EINVAL;
		/* a chunk ends on a block boundary or at the tensor's end */
		if (c->count % AOQK_Q8_BLOCK != 0 && c->begin + c->count != st->n)
			return -EINVAL;
	}
	return 0;
}

/* The contract of aoqk_kernel.sgd (lion = 0) and .lion (lion = 1): no q8
 * state, no v; m only where a buffer is kept; nesterov as torch allows it. */
static inline int aoqk_check_sl(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                                const struct aoqk_chunk *c, const struct aoqk_report *rep,
                                int lion)
{
	if (!hp || !st || !c || !rep)
		return -EINVAL;
	if (st->precision != AOQK_STATE_FP32 && st->precision != AOQK_STATE_BF16 &&
	    st->precision != AOQK_STATE_BF16_ALL)
		return -EINVAL;
	if (!aoqk_dtype_ok(c->grad_dtype) || (c->param && !aoqk_dtype_ok(c->param_dtype)))
		return -EINVAL;
	if (hp->step == 0)
		return -EINVAL;
	if (!lion && hp->nesterov && (!(hp->momentum > 0.0) || hp->dampening != 0.0))
		return -EINVAL;
	if (c->begin > st->n || c->count > st->n - c->begin)
		return -EINVAL;
	if (c->count == 0)
		return 0;
	if (!c->grad || !st->master)
		return -EINVAL;
	if ((lion || hp->momentum != 0.0) && !st->m)
		return -EINVAL;
	return 0;
}

#endif
