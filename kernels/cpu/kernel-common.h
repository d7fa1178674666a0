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

/* unused: each variant's layer defines the whole set of helpers, and a
 * body uses some (clang reports unused static inline functions of a .c) */
#define AOQK_ALWAYS_INLINE inline __attribute__((always_inline, unused))

/* The q8 codebook constants and the scalar conversions: aoq-convert.h. */


/* Per-call constants, computed once per chunk from the hyperparameters. */
struct aoqk_consts {
	float w1;        /* 1 - beta1 (lerp weight) */
	float w1c;       /* 1 - w1, for the large-weight lerp form */
	float b2;        /* beta2 */
	float sb2;       /* sqrt(beta2): q8 decodes sqrt(v) * sqrt(beta2), whose square is v * beta2 */
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
static const uint32_t aoqk_rk[2][4] = {
	{ 0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u }, /* RK1, A's */
	{ 0xb7e15162u, 0x8aed2a6au, 0xbf715880u, 0x9cf4f3c7u }, /* RK2, B's */
};

/* AES's SubBytes and MixColumns for one byte of row 0, as a column
 * (little-endian: byte r is row r): the word (2 S(x), S(x), S(x), 3 S(x)),
 * S the AES S-box (FIPS-197: the inverse in GF(2^8) modulo x^8 + x^4 +
 * x^3 + x + 1, then the affine map with 0x63).  Rows 1, 2, 3 are this word
 * rotated by 8, 16, 24 bits.  Generated, not typed. */
static const uint32_t aoqk_aes_t0[256] = {
	0xa56363c6u, 0x847c7cf8u, 0x997777eeu, 0x8d7b7bf6u, 0x0df2f2ffu, 0xbd6b6bd6u, 0xb16f6fdeu, 0x54c5c591u,
	0x50303060u, 0x03010102u, 0xa96767ceu, 0x7d2b2b56u, 0x19fefee7u, 0x62d7d7b5u, 0xe6abab4du, 0x9a7676ecu,
	0x45caca8fu, 0x9d82821fu, 0x40c9c989u, 0x877d7dfau, 0x15fafaefu, 0xeb5959b2u, 0xc947478eu, 0x0bf0f0fbu,
	0xecadad41u, 0x67d4d4b3u, 0xfda2a25fu, 0xeaafaf45u, 0xbf9c9c23u, 0xf7a4a453u, 0x967272e4u, 0x5bc0c09bu,
	0xc2b7b775u, 0x1cfdfde1u, 0xae93933du, 0x6a26264cu, 0x5a36366cu, 0x413f3f7eu, 0x02f7f7f5u, 0x4fcccc83u,
	0x5c343468u, 0xf4a5a551u, 0x34e5e5d1u, 0x08f1f1f9u, 0x937171e2u, 0x73d8d8abu, 0x53313162u, 0x3f15152au,
	0x0c040408u, 0x52c7c795u, 0x65232346u, 0x5ec3c39du, 0x28181830u, 0xa1969637u, 0x0f05050au, 0xb59a9a2fu,
	0x0907070eu, 0x36121224u, 0x9b80801bu, 0x3de2e2dfu, 0x26ebebcdu, 0x6927274eu, 0xcdb2b27fu, 0x9f7575eau,
	0x1b090912u, 0x9e83831du, 0x742c2c58u, 0x2e1a1a34u, 0x2d1b1b36u, 0xb26e6edcu, 0xee5a5ab4u, 0xfba0a05bu,
	0xf65252a4u, 0x4d3b3b76u, 0x61d6d6b7u, 0xceb3b37du, 0x7b292952u, 0x3ee3e3ddu, 0x712f2f5eu, 0x97848413u,
	0xf55353a6u, 0x68d1d1b9u, 0x00000000u, 0x2cededc1u, 0x60202040u, 0x1ffcfce3u, 0xc8b1b179u, 0xed5b5bb6u,
	0xbe6a6ad4u, 0x46cbcb8du, 0xd9bebe67u, 0x4b393972u, 0xde4a4a94u, 0xd44c4c98u, 0xe85858b0u, 0x4acfcf85u,
	0x6bd0d0bbu, 0x2aefefc5u, 0xe5aaaa4fu, 0x16fbfbedu, 0xc5434386u, 0xd74d4d9au, 0x55333366u, 0x94858511u,
	0xcf45458au, 0x10f9f9e9u, 0x06020204u, 0x817f7ffeu, 0xf05050a0u, 0x443c3c78u, 0xba9f9f25u, 0xe3a8a84bu,
	0xf35151a2u, 0xfea3a35du, 0xc0404080u, 0x8a8f8f05u, 0xad92923fu, 0xbc9d9d21u, 0x48383870u, 0x04f5f5f1u,
	0xdfbcbc63u, 0xc1b6b677u, 0x75dadaafu, 0x63212142u, 0x30101020u, 0x1affffe5u, 0x0ef3f3fdu, 0x6dd2d2bfu,
	0x4ccdcd81u, 0x140c0c18u, 0x35131326u, 0x2fececc3u, 0xe15f5fbeu, 0xa2979735u, 0xcc444488u, 0x3917172eu,
	0x57c4c493u, 0xf2a7a755u, 0x827e7efcu, 0x473d3d7au, 0xac6464c8u, 0xe75d5dbau, 0x2b191932u, 0x957373e6u,
	0xa06060c0u, 0x98818119u, 0xd14f4f9eu, 0x7fdcdca3u, 0x66222244u, 0x7e2a2a54u, 0xab90903bu, 0x8388880bu,
	0xca46468cu, 0x29eeeec7u, 0xd3b8b86bu, 0x3c141428u, 0x79dedea7u, 0xe25e5ebcu, 0x1d0b0b16u, 0x76dbdbadu,
	0x3be0e0dbu, 0x56323264u, 0x4e3a3a74u, 0x1e0a0a14u, 0xdb494992u, 0x0a06060cu, 0x6c242448u, 0xe45c5cb8u,
	0x5dc2c29fu, 0x6ed3d3bdu, 0xefacac43u, 0xa66262c4u, 0xa8919139u, 0xa4959531u, 0x37e4e4d3u, 0x8b7979f2u,
	0x32e7e7d5u, 0x43c8c88bu, 0x5937376eu, 0xb76d6ddau, 0x8c8d8d01u, 0x64d5d5b1u, 0xd24e4e9cu, 0xe0a9a949u,
	0xb46c6cd8u, 0xfa5656acu, 0x07f4f4f3u, 0x25eaeacfu, 0xaf6565cau, 0x8e7a7af4u, 0xe9aeae47u, 0x18080810u,
	0xd5baba6fu, 0x887878f0u, 0x6f25254au, 0x722e2e5cu, 0x241c1c38u, 0xf1a6a657u, 0xc7b4b473u, 0x51c6c697u,
	0x23e8e8cbu, 0x7cdddda1u, 0x9c7474e8u, 0x211f1f3eu, 0xdd4b4b96u, 0xdcbdbd61u, 0x868b8b0du, 0x858a8a0fu,
	0x907070e0u, 0x423e3e7cu, 0xc4b5b571u, 0xaa6666ccu, 0xd8484890u, 0x05030306u, 0x01f6f6f7u, 0x120e0e1cu,
	0xa36161c2u, 0x5f35356au, 0xf95757aeu, 0xd0b9b969u, 0x91868617u, 0x58c1c199u, 0x271d1d3au, 0xb99e9e27u,
	0x38e1e1d9u, 0x13f8f8ebu, 0xb398982bu, 0x33111122u, 0xbb6969d2u, 0x70d9d9a9u, 0x898e8e07u, 0xa7949433u,
	0xb69b9b2du, 0x221e1e3cu, 0x92878715u, 0x20e9e9c9u, 0x49cece87u, 0xff5555aau, 0x78282850u, 0x7adfdfa5u,
	0x8f8c8c03u, 0xf8a1a159u, 0x80898909u, 0x170d0d1au, 0xdabfbf65u, 0x31e6e6d7u, 0xc6424284u, 0xb86868d0u,
	0xc3414182u, 0xb0999929u, 0x772d2d5au, 0x110f0f1eu, 0xcbb0b07bu, 0xfc5454a8u, 0xd6bbbb6du, 0x3a16162cu,
};

static inline uint32_t aoqk_rotl32(uint32_t x, unsigned r)
{
	return x << r | x >> (32 - r);
}

/* One AES encryption round, x86's AESENC: ShiftRows, SubBytes,
 * MixColumns, then the xor with the round key, on the 128-bit state w
 * (4 words, column c = word c) in place.  The plain C kernel's random bits;
 * the SIMD variants use the instruction (test-kernels checks that every
 * variant gives plain C's bits).  Output column c takes row r from input
 * column c + r (ShiftRows). */
static inline void aoqk_aesenc_soft(uint32_t w[4], const uint32_t k[4])
{
	uint32_t o[4];

	for (unsigned c = 0; c < 4; c++)
		o[c] = aoqk_aes_t0[w[c] & 0xff] ^ aoqk_rotl32(aoqk_aes_t0[(w[(c + 1) % 4] >> 8) & 0xff], 8) ^
		       aoqk_rotl32(aoqk_aes_t0[(w[(c + 2) % 4] >> 16) & 0xff], 16) ^
		       aoqk_rotl32(aoqk_aes_t0[w[(c + 3) % 4] >> 24], 24) ^ k[c];
	memcpy(w, o, sizeof(o));
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
	k->sb2 = (float)sqrt(b2);
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
	if ((unsigned)st->precision > AOQK_STATE_BF16_Q4)
		return -EINVAL;
	if ((st->master_lo || st->master_lo8) && st->precision != AOQK_STATE_Q8 && st->precision != AOQK_STATE_Q4)
		return -EINVAL;
	if (st->master_lo && st->master_lo8)
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
	if (aoqk_precision_blocked(st->precision)) {
		size_t blk = aoqk_block(st->precision);
		if (c->begin % blk != 0)
			return -EINVAL;
		if (!st->m_scale || !st->v_scale)
			return -EINVAL;
		/* a chunk ends on a block boundary or at the tensor's end */
		if (c->count % blk != 0 && c->begin + c->count != st->n)
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
	if (st->master_lo || st->master_lo8)
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
