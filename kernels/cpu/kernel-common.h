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

/* q8 states' random bits come from AES rounds (README.md, "bf16 master
 * with stochastic rounding"): one AESENC per 16 elements on AVX-512 (VAES)
 * is one uop, where the xorshift it replaced was six.  The round keys are
 * arbitrary constants (the digits of pi, then of e, in hex); the seed
 * already carries the step's key.  Words in the order of an xmm register:
 * word j is bytes 4j..4j+3, little-endian. */
#define AOQK_RK1_0 0x243f6a88u
#define AOQK_RK1_1 0x85a308d3u
#define AOQK_RK1_2 0x13198a2eu
#define AOQK_RK1_3 0x03707344u
#define AOQK_RK2_0 0xb7e15162u
#define AOQK_RK2_1 0x8aed2a6au
#define AOQK_RK2_2 0xbf715880u
#define AOQK_RK2_3 0x9cf4f3c7u

/* The AES S-box (FIPS-197: the inverse in GF(2^8) modulo x^8 + x^4 + x^3 +
 * x + 1, then the affine map with 0x63), generated, not typed. */
static const uint8_t aoqk_aes_sbox[256] = {
	0x63, 0x7c, 0x77, 0x7b, 0xf2, 0x6b, 0x6f, 0xc5, 0x30, 0x01, 0x67, 0x2b, 0xfe, 0xd7, 0xab, 0x76,
	0xca, 0x82, 0xc9, 0x7d, 0xfa, 0x59, 0x47, 0xf0, 0xad, 0xd4, 0xa2, 0xaf, 0x9c, 0xa4, 0x72, 0xc0,
	0xb7, 0xfd, 0x93, 0x26, 0x36, 0x3f, 0xf7, 0xcc, 0x34, 0xa5, 0xe5, 0xf1, 0x71, 0xd8, 0x31, 0x15,
	0x04, 0xc7, 0x23, 0xc3, 0x18, 0x96, 0x05, 0x9a, 0x07, 0x12, 0x80, 0xe2, 0xeb, 0x27, 0xb2, 0x75,
	0x09, 0x83, 0x2c, 0x1a, 0x1b, 0x6e, 0x5a, 0xa0, 0x52, 0x3b, 0xd6, 0xb3, 0x29, 0xe3, 0x2f, 0x84,
	0x53, 0xd1, 0x00, 0xed, 0x20, 0xfc, 0xb1, 0x5b, 0x6a, 0xcb, 0xbe, 0x39, 0x4a, 0x4c, 0x58, 0xcf,
	0xd0, 0xef, 0xaa, 0xfb, 0x43, 0x4d, 0x33, 0x85, 0x45, 0xf9, 0x02, 0x7f, 0x50, 0x3c, 0x9f, 0xa8,
	0x51, 0xa3, 0x40, 0x8f, 0x92, 0x9d, 0x38, 0xf5, 0xbc, 0xb6, 0xda, 0x21, 0x10, 0xff, 0xf3, 0xd2,
	0xcd, 0x0c, 0x13, 0xec, 0x5f, 0x97, 0x44, 0x17, 0xc4, 0xa7, 0x7e, 0x3d, 0x64, 0x5d, 0x19, 0x73,
	0x60, 0x81, 0x4f, 0xdc, 0x22, 0x2a, 0x90, 0x88, 0x46, 0xee, 0xb8, 0x14, 0xde, 0x5e, 0x0b, 0xdb,
	0xe0, 0x32, 0x3a, 0x0a, 0x49, 0x06, 0x24, 0x5c, 0xc2, 0xd3, 0xac, 0x62, 0x91, 0x95, 0xe4, 0x79,
	0xe7, 0xc8, 0x37, 0x6d, 0x8d, 0xd5, 0x4e, 0xa9, 0x6c, 0x56, 0xf4, 0xea, 0x65, 0x7a, 0xae, 0x08,
	0xba, 0x78, 0x25, 0x2e, 0x1c, 0xa6, 0xb4, 0xc6, 0xe8, 0xdd, 0x74, 0x1f, 0x4b, 0xbd, 0x8b, 0x8a,
	0x70, 0x3e, 0xb5, 0x66, 0x48, 0x03, 0xf6, 0x0e, 0x61, 0x35, 0x57, 0xb9, 0x86, 0xc1, 0x1d, 0x9e,
	0xe1, 0xf8, 0x98, 0x11, 0x69, 0xd9, 0x8e, 0x94, 0x9b, 0x1e, 0x87, 0xe9, 0xce, 0x55, 0x28, 0xdf,
	0x8c, 0xa1, 0x89, 0x0d, 0xbf, 0xe6, 0x42, 0x68, 0x41, 0x99, 0x2d, 0x0f, 0xb0, 0x54, 0xbb, 0x16,
};

static inline uint8_t aoqk_xtime(uint8_t a)
{
	return (uint8_t)((a << 1) ^ ((a >> 7) * 0x1bu));
}

/* One AES encryption round, x86's AESENC: ShiftRows, SubBytes,
 * MixColumns, then the xor with the round key, on the 128-bit state w
 * (4 words) in place.  The plain C kernel's random bits; the SIMD variants
 * use the instruction (test-kernels checks that they agree). */
static inline void aoqk_aesenc_soft(uint32_t w[4], uint32_t k0, uint32_t k1, uint32_t k2,
                                    uint32_t k3)
{
	uint8_t s[16], t[16];
	const uint32_t k[4] = { k0, k1, k2, k3 };

	for (unsigned i = 0; i < 16; i++)
		s[i] = (uint8_t)(w[i / 4] >> (8 * (i % 4)));
	/* byte r + 4c is row r of column c; row r rotates left by r */
	for (unsigned c = 0; c < 4; c++)
		for (unsigned r = 0; r < 4; r++)
			t[r + 4 * c] = aoqk_aes_sbox[s[r + 4 * ((c + r) % 4)]];
	for (unsigned c = 0; c < 4; c++) {
		uint8_t a0 = t[4 * c], a1 = t[4 * c + 1], a2 = t[4 * c + 2], a3 = t[4 * c + 3];
		uint8_t x = (uint8_t)(a0 ^ a1 ^ a2 ^ a3);
		s[4 * c] = (uint8_t)(a0 ^ x ^ aoqk_xtime((uint8_t)(a0 ^ a1)));
		s[4 * c + 1] = (uint8_t)(a1 ^ x ^ aoqk_xtime((uint8_t)(a1 ^ a2)));
		s[4 * c + 2] = (uint8_t)(a2 ^ x ^ aoqk_xtime((uint8_t)(a2 ^ a3)));
		s[4 * c + 3] = (uint8_t)(a3 ^ x ^ aoqk_xtime((uint8_t)(a3 ^ a0)));
	}
	for (unsigned j = 0; j < 4; j++)
		w[j] = ((uint32_t)s[4 * j] | (uint32_t)s[4 * j + 1] << 8 | (uint32_t)s[4 * j + 2] << 16 |
		        (uint32_t)s[4 * j + 3] << 24) ^ k[j];
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
