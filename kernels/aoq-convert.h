/* SPDX-License-Identifier: MIT */
/*
 * Number conversions, defined once: fp32 <-> bf16/fp16 (scalar, bit-exact
 * with the F16C and integer SIMD paths of the CPU kernels) and the q8
 * moment codebook (kernels/README.md, "q8 moments").
 *
 * Used by the kernels (kernel-common.h includes this header), by the
 * daemon's state transfer (daemon/convert.c) and by the tests, which check
 * these functions against the harness's independent double reference.
 * Plain C, header only: the SIMD variants include it and use it only
 * outside their inner loops.
 */
#ifndef AOQ_CONVERT_H
#define AOQ_CONVERT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* q8 moment formats (kernels/README.md, "q8 moments").  The state holds
 * format 2; format 1 is the earlier codebook, kept for state written with it
 * (decode only, and a nearest-code encode for tests).
 *
 * Format 2, an 8-bit float relative to the block's scale, with a linear
 * bottom binade (like denormals) made by an offset K:
 *   m:        byte = sign << 7 | c, c in [0, 127], 3 exponent and 4 mantissa bits
 *             |m| = (F(c) - K) * m_scale / TOP
 *   sqrt(v):  byte = c in [0, 255], 4 exponent and 4 mantissa bits
 *             sqrt(v) = (F(c) - K) * v_scale / TOP
 * F(c) is the float with bits (c + C0) << SHIFT, SHIFT = 23 - mantissa bits,
 * C0 chosen so that the largest code is the largest float below 2 with that
 * many mantissa bits; K = F(0) (so code 0 is 0) and TOP = F(cmax) - K, both
 * exact.  m_scale is the block's max |m|, v_scale its max sqrt(v).  Encoding
 * adds K to x * TOP / scale and keeps the top bits of its fp32 pattern:
 * shifts and integer adds, no square root and no search. */
#define AOQK_Q8_FORMAT 2
#define AOQK_Q8_M_MB 4 /* m: e3m4 */
#define AOQK_Q8_U_MB 5 /* sqrt(v): e3m5 */
#define AOQK_Q8_M_SHIFT (23 - AOQK_Q8_M_MB)
#define AOQK_Q8_U_SHIFT (23 - AOQK_Q8_U_MB)
#define AOQK_Q8_M_C0 ((127u << AOQK_Q8_M_MB) + (1u << AOQK_Q8_M_MB) - 1u - 127u)
#define AOQK_Q8_U_C0 ((127u << AOQK_Q8_U_MB) + (1u << AOQK_Q8_U_MB) - 1u - 255u)
#define AOQK_Q8_M_K aoqk_u2f(AOQK_Q8_M_C0 << AOQK_Q8_M_SHIFT)
#define AOQK_Q8_U_K aoqk_u2f(AOQK_Q8_U_C0 << AOQK_Q8_U_SHIFT)
#define AOQK_Q8_M_TOP (aoqk_u2f((AOQK_Q8_M_C0 + 127u) << AOQK_Q8_M_SHIFT) - AOQK_Q8_M_K)
#define AOQK_Q8_U_TOP (aoqk_u2f((AOQK_Q8_U_C0 + 255u) << AOQK_Q8_U_SHIFT) - AOQK_Q8_U_K)

/* q4 moments (kernels/README.md, "q4 moments"): format 2's construction
 * with 4-bit codes, two per byte (aoq-kernel.h: a group of 32 elements in
 * 16 bytes, byte l = element l | element l + 16 << 4):
 *   m:        nibble = sign << 3 | c, c in [0, 7], an e1m2 float c
 *             |m| = (F(c) - K) * m_scale / TOP
 *   sqrt(v):  nibble = c in [0, 15], an e2m2 float c
 *             sqrt(v) = (F(c) - K) * v_scale / TOP
 * F, K, TOP as format 2's (F(c) = bits (c + C0) << SHIFT, the largest code
 * just below 2, K = F(0), TOP = F(cmax) - K), m_scale the block's max |m|,
 * v_scale its max sqrt(v), per AOQK_Q4_BLOCK elements.  Code 0 is 0; a
 * non-zero v never gets code 0 (the zero point excluded: sqrt(v) divides). */
#ifndef AOQK_Q4_M_MB
#define AOQK_Q4_M_MB 2 /* m: e1m2 */
#endif
#ifndef AOQK_Q4_U_MB
#define AOQK_Q4_U_MB 2 /* sqrt(v): e2m2 */
#endif
#define AOQK_Q4_M_SHIFT (23 - AOQK_Q4_M_MB)
#define AOQK_Q4_U_SHIFT (23 - AOQK_Q4_U_MB)
#define AOQK_Q4_M_C0 ((127u << AOQK_Q4_M_MB) + (1u << AOQK_Q4_M_MB) - 1u - 7u)
#define AOQK_Q4_U_C0 ((127u << AOQK_Q4_U_MB) + (1u << AOQK_Q4_U_MB) - 1u - 15u)
#define AOQK_Q4_M_K aoqk_u2f(AOQK_Q4_M_C0 << AOQK_Q4_M_SHIFT)
#define AOQK_Q4_U_K aoqk_u2f(AOQK_Q4_U_C0 << AOQK_Q4_U_SHIFT)
#define AOQK_Q4_M_TOP (aoqk_u2f((AOQK_Q4_M_C0 + 7u) << AOQK_Q4_M_SHIFT) - AOQK_Q4_M_K)
#define AOQK_Q4_U_TOP (aoqk_u2f((AOQK_Q4_U_C0 + 15u) << AOQK_Q4_U_SHIFT) - AOQK_Q4_U_K)

/* Format 1 codebooks (square-root companding):
 *   m = sign(q) * q^2 / 127^2 * m_scale        q in [-127, 127] (int8)
 *   sqrt(v) = q^2 / 255^2 * v_scale            q in [0, 255]
 * m_scale is the block's max |m|, v_scale the block's max sqrt(v). */
#define AOQK_Q8V1_M_MAX 127.0f
#define AOQK_Q8V1_U_MAX 255.0f
#define AOQK_Q8V1_M_DIV 16129.0f /* 127^2 */
#define AOQK_Q8V1_U_DIV 65025.0f /* 255^2 */

static inline uint32_t aoqk_f2u(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
}

static inline float aoqk_u2f(uint32_t u)
{
	float f;
	memcpy(&f, &u, 4);
	return f;
}

/* fp32 -> bf16, round to nearest even; NaN -> quiet NaN keeping the sign and
 * the top payload bits.  Same as the SIMD integer path. */
static inline uint16_t aoqk_f32_to_bf16(float f)
{
	uint32_t b = aoqk_f2u(f);
	if ((b & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((b >> 16) | 0x40u);
	return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static inline float aoqk_bf16_to_f32(uint16_t h)
{
	return aoqk_u2f((uint32_t)h << 16);
}

/* fp32 -> fp16, round to nearest even, overflow -> inf, NaN -> quiet NaN
 * keeping the top payload bits: bit-exact with F16C vcvtps2ph (imm RNE).
 * Needs the default rounding mode and no FTZ/DAZ. */
static inline uint16_t aoqk_f32_to_f16(float f)
{
	uint32_t x = aoqk_f2u(f);
	uint32_t sign = (x >> 16) & 0x8000u;
	uint32_t a = x & 0x7fffffffu;
	uint32_t o;

	if (a > 0x7f800000u) {
		o = 0x7e00u | ((a >> 13) & 0x3ffu);
	} else if (a >= 0x47800000u) { /* >= 65536: inf (65520..65536 round up below) */
		o = 0x7c00u;
	} else if (a < 0x38800000u) { /* fp16 subnormal or zero */
		/* aligning the 10 fp16 mantissa bits at the bottom of a float
		 * whose exponent is 2^-1: the float add rounds to nearest even */
		float t = aoqk_u2f(a) + aoqk_u2f(126u << 23);
		o = aoqk_f2u(t) - (126u << 23);
	} else {
		uint32_t odd = (a >> 13) & 1u;
		a += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
		o = a >> 13;
	}
	return (uint16_t)(o | sign);
}

/* fp16 -> fp32, exact; NaN is quieted like F16C vcvtph2ps. */
static inline float aoqk_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t e = (h >> 10) & 0x1fu;
	uint32_t mant = h & 0x3ffu;
	uint32_t o;

	if (e == 0x1f) {
		o = 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0);
	} else if (e == 0) {
		/* subnormal or zero: mant * 2^-24, exact */
		float t = (float)mant * aoqk_u2f(103u << 23);
		o = aoqk_f2u(t);
	} else {
		o = ((e + 112u) << 23) | (mant << 13);
	}
	return aoqk_u2f(o | sign);
}

/* Format 2: one code to its moment value, given the block's scale. */
static inline float aoqk_q8_m_decode(uint8_t code, float m_scale)
{
	float y = aoqk_u2f(((code & 0x7fu) + AOQK_Q8_M_C0) << AOQK_Q8_M_SHIFT) - AOQK_Q8_M_K;
	float x = y * (m_scale / AOQK_Q8_M_TOP);
	return (code & 0x80u) ? -x : x;
}

static inline float aoqk_q8_v_decode(uint8_t code, float v_scale)
{
	float y = aoqk_u2f((code + AOQK_Q8_U_C0) << AOQK_Q8_U_SHIFT) - AOQK_Q8_U_K;
	float u = y * (v_scale / AOQK_Q8_U_TOP);
	return u * u;
}

/* Format 2: the encode factor for a block whose scale (max) is s, with
 * top = AOQK_Q8_M_TOP or AOQK_Q8_U_TOP: top / s, 0 for an empty block, and
 * FLT_MAX where top / s overflows (a block of denormals), so that x * inv
 * stays finite (0 * inf would be NaN: the top code) for every x <= s. */
static inline float aoqk_q8_inv(float top, float s)
{
	/* a compare, not fminf: gcc calls fminf out of line, and the kernels
	 * spill their vector registers around the call twice per block
	 * (top / s is never NaN here, so the results are fminf's) */
	float q = top / s;
	return s > 0.0f ? (q < 3.40282347e38f ? q : 3.40282347e38f) : 0.0f;
}

/* Format 2 encode of x = |m| or sqrt(v) with inv = TOP / the block's scale
 * (or 0): the code of x * inv + K, rounded by adding r to its bits below the
 * kept ones (r = half of them: nearest; random: stochastic), at most cmax. */
static inline uint32_t aoqk_q8_code(float x, float inv, float k, uint32_t r, unsigned shift,
                                    uint32_t c0, uint32_t cmax)
{
	uint32_t c = ((aoqk_f2u(x * inv + k) + r) >> shift) - c0;
	return c < cmax ? c : cmax;
}

/* Round to nearest in code space (the kernels round stochastically; loads
 * of saved state round to nearest).  inv is AOQK_Q8_*_TOP / the block's
 * scale, or 0. */
static inline uint8_t aoqk_q8_m_encode(float m, float inv)
{
	uint32_t c = aoqk_q8_code(fabsf(m), inv, AOQK_Q8_M_K, 1u << (AOQK_Q8_M_SHIFT - 1), AOQK_Q8_M_SHIFT,
	                          AOQK_Q8_M_C0, 127);
	return (uint8_t)(c | (m < 0 ? 0x80u : 0));
}

static inline uint8_t aoqk_q8_v_encode(float v, float inv)
{
	float u = sqrtf(fmaxf(v, 0.0f));
	uint32_t c = aoqk_q8_code(u, inv, AOQK_Q8_U_K, 1u << (AOQK_Q8_U_SHIFT - 1), AOQK_Q8_U_SHIFT,
	                          AOQK_Q8_U_C0, 255);
	if (c == 0 && u > 0)
		c = 1; /* a non-zero v keeps a non-zero code */
	return (uint8_t)c;
}

/* q4: where element i's code is (aoq-kernel.h): byte and shift */
static inline size_t aoqk_q4_byte(uint64_t i)
{
	return (size_t)(i / 32 * 16 + i % 16);
}

static inline unsigned aoqk_q4_shift(uint64_t i)
{
	return (unsigned)(i & 16) >> 2;
}

static inline unsigned aoqk_q4_get(const uint8_t *codes, uint64_t i)
{
	return (codes[aoqk_q4_byte(i)] >> aoqk_q4_shift(i)) & 0xfu;
}

static inline void aoqk_q4_put(uint8_t *codes, uint64_t i, unsigned c)
{
	uint8_t *p = &codes[aoqk_q4_byte(i)];
	unsigned s = aoqk_q4_shift(i);
	*p = (uint8_t)((*p & ~(0xfu << s)) | (c & 0xfu) << s);
}

/* q4: one code to its moment value, given the block's scale. */
static inline float aoqk_q4_m_decode(unsigned code, float m_scale)
{
	float y = aoqk_u2f(((code & 7u) + AOQK_Q4_M_C0) << AOQK_Q4_M_SHIFT) - AOQK_Q4_M_K;
	float x = y * (m_scale / AOQK_Q4_M_TOP);
	return (code & 8u) ? -x : x;
}

static inline float aoqk_q4_v_decode(unsigned code, float v_scale)
{
	float y = aoqk_u2f(((code & 15u) + AOQK_Q4_U_C0) << AOQK_Q4_U_SHIFT) - AOQK_Q4_U_K;
	float u = y * (v_scale / AOQK_Q4_U_TOP);
	return u * u;
}

/* q4, round to nearest in code space; inv is AOQK_Q4_*_TOP / the block's
 * scale, or 0 (aoqk_q8_inv). */
static inline unsigned aoqk_q4_m_encode(float m, float inv)
{
	uint32_t c = aoqk_q8_code(fabsf(m), inv, AOQK_Q4_M_K, 1u << (AOQK_Q4_M_SHIFT - 1), AOQK_Q4_M_SHIFT,
	                          AOQK_Q4_M_C0, 7);
	return c | (m < 0 ? 8u : 0u);
}

static inline unsigned aoqk_q4_v_encode(float v, float inv)
{
	float u = sqrtf(fmaxf(v, 0.0f));
	uint32_t c = aoqk_q8_code(u, inv, AOQK_Q4_U_K, 1u << (AOQK_Q4_U_SHIFT - 1), AOQK_Q4_U_SHIFT,
	                          AOQK_Q4_U_C0, 15);
	if (c == 0 && u > 0)
		c = 1; /* a non-zero v keeps a non-zero code */
	return c;
}

/* Format 1: one code to its moment value, given the block's scale. */
static inline float aoqk_q8v1_m_decode(int8_t code, float m_scale)
{
	float q = (float)code;
	return q * fabsf(q) * (m_scale / AOQK_Q8V1_M_DIV);
}

static inline float aoqk_q8v1_v_decode(uint8_t code, float v_scale)
{
	float q = (float)code;
	float u = q * q * (v_scale / AOQK_Q8V1_U_DIV);
	return u * u;
}

/* Format 1, round to nearest in code space; inv is 1 / the block's scale, or 0. */
static inline int8_t aoqk_q8v1_m_encode(float m, float inv)
{
	float x = nearbyintf(sqrtf(fabsf(m) * inv) * AOQK_Q8V1_M_MAX);
	/* A non-finite value (a block with inf: inv 0, inf * 0; or NaN) has
	 * no code: NaN is 0, and nothing passes the extreme code.  Casting
	 * NaN or an out-of-range float to an integer is undefined (the fuzz
	 * phase's UBSan found it through LoadState).  Format 2 works on the
	 * bits and clamps the code, so it has no such cast. */
	if (!(x <= AOQK_Q8V1_M_MAX))
		x = x > AOQK_Q8V1_M_MAX ? AOQK_Q8V1_M_MAX : 0.0f;
	return (int8_t)(m < 0 ? -x : x);
}

static inline uint8_t aoqk_q8v1_v_encode(float v, float inv)
{
	float u = sqrtf(fmaxf(v, 0.0f));
	float y = nearbyintf(sqrtf(u * inv) * AOQK_Q8V1_U_MAX);
	if (!(y <= AOQK_Q8V1_U_MAX))
		y = y > AOQK_Q8V1_U_MAX ? AOQK_Q8V1_U_MAX : 0.0f; /* as in aoqk_q8v1_m_encode */
	if (y == 0 && u > 0)
		y = 1; /* a non-zero v keeps a non-zero code */
	return (uint8_t)y;
}

#endif
