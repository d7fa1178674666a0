/* SPDX-License-Identifier: MIT */
/*
 * AVX-512 (F, BW, VL) + F16C kernel: 16 lanes.  Built twice: as "avx512",
 * and with AOQK_AVX512BF16 (and -mavx512bf16) as "avx512bf16", which writes
 * bf16 parameters with vcvtneps2bf16 (round to nearest even; the one
 * difference: results below 2^-126 in magnitude are flushed to zero).
 * FMA only where the body asks for it (vf_fma), so results equal the plain C
 * kernel's bit for bit, except the q8 update's approximate sqrt and division
 * (vf_q8_sqrt, vf_q8_div below).
 */
#include <immintrin.h>

#include "kernel-common.h"

#define W 16
#if defined(AOQK_KVAR) /* the benchmark's stage-dropping builds */
#define KVAR AOQK_KVAR
#elif defined(AOQK_AVX512BF16)
#define KVAR avx512bf16
#else
#define KVAR avx512
#endif
#define KHAS_NT 1

typedef __m512 vf;
typedef __m512i vi;
typedef __m256i vh;
typedef struct {
	__m512d a, b;
} vacc;

#define KI static AOQK_ALWAYS_INLINE __attribute__((unused)) /* not every helper is used by every build */

KI vf vf_zero(void) { return _mm512_setzero_ps(); }
KI vf vf_set1(float x) { return _mm512_set1_ps(x); }
KI vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
KI void vf_storeu(float *p, vf x) { _mm512_storeu_ps(p, x); }
KI void vf_stream(float *p, vf x) { _mm512_stream_ps(p, x); }
KI void vf_sfence(void) { _mm_sfence(); }
KI vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
KI vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
KI vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
KI vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
KI vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
KI vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
KI vf vf_sqrt(vf a) { return _mm512_sqrt_ps(a); }
/* The q8 update's sqrt(v) and m / den (README.md, "q8: the approximate
 * divider"): v * rsqrt14(v) and m * rcp14(den), each within 2^-14 of the
 * IEEE result, on the vector ports instead of the divider.  fixupimm
 * gives v itself where v is +-0, +inf or NaN (there the product is NaN or
 * 0 * inf), as sqrt does.  AOQK_Q8_EXACT (a benchmark build) keeps IEEE's. */
#ifndef AOQK_Q8_EXACT
#define KQ8_APPROX 14
KI vf vf_q8_sqrt(vf v)
{
	return _mm512_fixupimm_ps(_mm512_mul_ps(v, _mm512_rsqrt14_ps(v)), v, _mm512_set1_epi32(0x00100111), 0);
}
KI vf vf_q8_div(vf m, vf den) { return _mm512_mul_ps(m, _mm512_rcp14_ps(den)); }
#else
#define KQ8_APPROX 0
KI vf vf_q8_sqrt(vf v) { return _mm512_sqrt_ps(v); }
KI vf vf_q8_div(vf m, vf den) { return _mm512_div_ps(m, den); }
#endif
KI vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
KI vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
KI vf vf_abs(vf a) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff))); }
KI vf vf_copysign(vf x, vf s)
{
	return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(x), _mm512_castps_si512(s),
	                                                     _mm512_set1_epi32((int)0x80000000u), 0xf8));
}
/* The maxima of the lanes of a and of b (a block's two scales), in one
 * reduction: the 128-bit lanes of both halved into one vector, then
 * within the lanes.  The order of a max reduction does not matter for the
 * blocks' maxima (no lane is NaN or -0). */
KI void vf_hmax2(vf a, vf b, float *ma, float *mb)
{
	vf t = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
	t = _mm512_max_ps(t, _mm512_shuffle_f32x4(t, t, 0xb1));
	t = _mm512_max_ps(t, _mm512_permute_ps(t, 0x4e));
	t = _mm512_max_ps(t, _mm512_permute_ps(t, 0xb1));
	*ma = _mm512_cvtss_f32(t);
	*mb = _mm_cvtss_f32(_mm512_extractf32x4_ps(t, 2));
}
/* +-1 for non-zero a, a itself for +-0 and NaN (Lion's sign) */
KI vf vf_sign(vf a)
{
	return _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_OQ),
	                          vf_copysign(_mm512_set1_ps(1.0f), a));
}

KI vi vi_set1(uint32_t x) { return _mm512_set1_epi32((int)x); }
KI vi vi_iota(uint32_t base)
{
	return _mm512_add_epi32(_mm512_set1_epi32((int)base),
	                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
KI vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
KI vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
KI vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
KI vi vi_zero(void) { return _mm512_setzero_si512(); }
KI vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
KI vi vi_loadu(const uint32_t *p) { return _mm512_loadu_si512((const void *)p); }
KI void vi_storeu(uint32_t *p, vi x) { _mm512_storeu_si512((void *)p, x); }
KI vi vi_max_s(vi a, vi b) { return _mm512_max_epi32(a, b); }
KI vi vi_min_u(vi a, vi b) { return _mm512_min_epu32(a, b); }
KI vi vi_min_s(vi a, vi b) { return _mm512_min_epi32(a, b); }
KI vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
KI vi vi_mullo(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
/* (a & m) | c,  (a & m) | (b & ~m),  a ^ (b & m): one vpternlogd each.
 * Its first operand is also its destination: the bit-select's is a, not
 * the mask (a constant, which would be copied first each time). */
KI vi vi_andor(vi a, vi m, vi c) { return _mm512_ternarylogic_epi32(a, m, c, 0xea); }
KI vi vi_bitsel(vi m, vi a, vi b) { return _mm512_ternarylogic_epi32(a, m, b, 0xe2); }
KI vi vi_xorand(vi a, vi b, vi m) { return _mm512_ternarylogic_epi32(a, b, m, 0x78); }
/* isnan(x) ? b | 0x400000 (the quiet bit) : b + r, lane-wise */
KI vi vi_add_or_quiet(vf x, vi b, vi r)
{
	return _mm512_mask_add_epi32(_mm512_or_si512(b, _mm512_set1_epi32(0x400000)),
	                             _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), b, r);
}
/* One AESENC per 128-bit lane with round key 1 or 2 (kernel-common.h):
 * VAES in the avx512bf16 build (every CPU with AVX512_BF16 and VBMI has
 * it, and dispatch checks), AES-NI lane by lane in the avx512 build. */
KI vi vi_aesenc(vi x, int which)
{
	const __m128i k = _mm_loadu_si128((const __m128i *)(const void *)aoqk_rk[which - 1]);
#ifdef __VAES__
	return _mm512_aesenc_epi128(x, _mm512_broadcast_i32x4(k));
#else
	vi r = _mm512_castsi128_si512(_mm_aesenc_si128(_mm512_castsi512_si128(x), k));
	r = _mm512_inserti32x4(r, _mm_aesenc_si128(_mm512_extracti32x4_epi32(x, 1), k), 1);
	r = _mm512_inserti32x4(r, _mm_aesenc_si128(_mm512_extracti32x4_epi32(x, 2), k), 2);
	return _mm512_inserti32x4(r, _mm_aesenc_si128(_mm512_extracti32x4_epi32(x, 3), k), 3);
#endif
}
#define vi_srli(a, s) _mm512_srli_epi32((a), (s))
#define vi_slli(a, s) _mm512_slli_epi32((a), (s))
KI vi vf_as_vi(vf a) { return _mm512_castps_si512(a); }
KI vf vi_as_vf(vi a) { return _mm512_castsi512_ps(a); }
KI vf vi_to_vf(vi a) { return _mm512_cvtepi32_ps(a); }
KI vi vf_to_vi_trunc(vf a) { return _mm512_cvttps_epi32(a); }
KI vi vi_select_nan(vf x, vi if_nan, vi other)
{
	return _mm512_mask_mov_epi32(other, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), if_nan);
}
/* 1 where no lane of x is NaN and no lane's low 16 bits are 0x8000 (the
 * split master's plain case): two compares, one mask test */
KI int vf_split_plain(vf x)
{
	__mmask16 n = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
	__mmask32 t = _mm512_mask_cmpeq_epi16_mask(0x55555555u, _mm512_castps_si512(x), _mm512_set1_epi16((short)0x8000));
	return (n | t) == 0;
}

/* The split pair loop's plain case for two vectors (run_chunk): 1 where
 * vf_split_plain holds for both and, with AVX512_BF16, no lane is
 * denormal either (vcvtne2ps2bf16 takes those as zero; vi_round_hi16).
 * One fpclass (DQ) finds NaNs and denormals at once. */
KI int vf_split_plain2(vf a, vf b)
{
#ifdef AOQK_AVX512BF16
	const vi tie = _mm512_set1_epi16((short)0x8000);
	__mmask16 n = _mm512_fpclass_ps_mask(a, 0xa1) | _mm512_fpclass_ps_mask(b, 0xa1);
	__mmask32 t = _mm512_mask_cmpeq_epi16_mask(0x55555555u, _mm512_castps_si512(a), tie) |
	              _mm512_mask_cmpeq_epi16_mask(0x55555555u, _mm512_castps_si512(b), tie);
	return (n | t) == 0;
#else
	return vf_split_plain(a) & vf_split_plain(b);
#endif
}

/* 1 where no lane of a or b is NaN */
KI int vf_nonan2(vf a, vf b)
{
	return (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) == 0;
}

#ifdef AOQK_AVX512BF16
/* the second byte of each lane of a, then of b, to p: one byte permute */
#define KHAS_BYTE1X2 1
KI void vi_store_byte1x2(uint8_t *p, vi a, vi b)
{
	const vi idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, (int)0x7d797571, (int)0x6d696561,
	                                (int)0x5d595551, (int)0x4d494541, (int)0x3d393531, (int)0x2d292521,
	                                (int)0x1d191511, (int)0x0d090501);
	_mm256_storeu_si256((__m256i *)(void *)p, _mm512_castsi512_si256(_mm512_permutex2var_epi8(a, idx, b)));
}
#endif

/* The low 16 bits of each lane of a, then of b: 32 words in element order */
KI vi vi_pack_lo16(vi a, vi b)
{
	const vi idx = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26,
	                                24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
	return _mm512_permutex2var_epi16(a, idx, b);
}

/* The top 16 bits of each lane of a, then of b: 32 bf16 in element order
 * (one two-table permute: bytes with VBMI, words without) */
KI vi vi_pack_hi16(vi a, vi b)
{
#ifdef AOQK_AVX512BF16
	const vi idx = _mm512_set_epi32((int)0x7f7e7b7a, (int)0x77767372, (int)0x6f6e6b6a, (int)0x67666362,
	                                 (int)0x5f5e5b5a, (int)0x57565352, (int)0x4f4e4b4a, (int)0x47464342,
	                                 (int)0x3f3e3b3a, (int)0x37363332, (int)0x2f2e2b2a, (int)0x27262322,
	                                 (int)0x1f1e1b1a, (int)0x17161312, (int)0x0f0e0b0a, (int)0x07060302);
	return _mm512_permutex2var_epi8(a, idx, b);
#else
	const vi idx = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
	                                25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
	return _mm512_permutex2var_epi16(a, idx, b);
#endif
}
/* a and b rounded to nearest even bf16, 32 in element order, where
 * vf_split_plain2 holds (no NaN, no denormal, no tie): one conversion of
 * both; without AVX512_BF16 kernel-body.h's rounding sums */
#ifdef AOQK_AVX512BF16
KI vi vi_round_hi16(vi a, vi b) { return (vi)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(b), _mm512_castsi512_ps(a)); }
#else
#define KROUND_HI16_GENERIC 1
#endif
KI void vi_stream(uint32_t *p, vi x) { _mm512_stream_si512((void *)p, x); }
KI vh vh_zero(void) { return _mm256_setzero_si256(); }
KI vh vh_loadu(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)(const void *)p); }
KI void vh_storeu(uint16_t *p, vh x) { _mm256_storeu_si256((__m256i *)(void *)p, x); }
KI void vh_stream(uint16_t *p, vh x) { _mm256_stream_si256((__m256i *)(void *)p, x); }
KI vh vi_to_vh(vi a) { return _mm512_cvtepi32_epi16(a); }
KI vi vh_to_vi_s(vh h) { return _mm512_cvtepi16_epi32(h); }
/* The low and the high 16 bits of each lane of w (one word permute) */
KI void vi_halves(vi w, vh *lo, vh *hi)
{
	const vi idx = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26, 24, 22,
	                                20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
	vi p = _mm512_permutexvar_epi16(idx, w);
	*lo = _mm512_castsi512_si256(p);
	*hi = _mm512_extracti64x4_epi64(p, 1);
}
#ifdef AOQK_AVX512BF16
/* bf16 bytes 2k, 2k+1 to bytes 4k+2, 4k+3 of lane k, zeros below: one
 * vpermb (with VBMI) where the widening and the shift are two uops */
KI vf vh_bf16_to_f(vh h)
{
	const vi idx = _mm512_set_epi32((int)0x1f1e0000, (int)0x1d1c0000, (int)0x1b1a0000, (int)0x19180000,
	                                (int)0x17160000, (int)0x15140000, (int)0x13120000, (int)0x11100000,
	                                (int)0x0f0e0000, (int)0x0d0c0000, (int)0x0b0a0000, (int)0x09080000,
	                                (int)0x07060000, (int)0x05040000, (int)0x03020000, (int)0x01000000);
	return _mm512_castsi512_ps(
		_mm512_maskz_permutexvar_epi8(0xccccccccccccccccull, idx, _mm512_castsi256_si512(h)));
}
#else
KI vf vh_bf16_to_f(vh h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif
KI vf vh_f16_to_f(vh h) { return _mm512_cvtph_ps(h); }
KI vh vf_to_f16(vf x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#ifdef AOQK_AVX512BF16
KI vh vf_to_bf16(vf x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#else
KI vh vf_to_bf16(vf x)
{
	vi b = _mm512_castps_si512(x);
	vi lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
	vi r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
	vi q = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
	return vi_to_vh(vi_select_nan(x, q, r));
}
#endif

KI vi vb_load_i8(const int8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)p)); }
KI vi vb_load_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)p)); }
KI void vb_store_u8(uint8_t *p, vi q) { _mm_storeu_si128((__m128i *)(void *)p, _mm512_cvtepi32_epi8(q)); }
/* The top byte of each lane of x to a, the low byte of each lane of y to
 * b (q8's m and v codes): with VBMI one two-table byte permute and two
 * stores (vpmovdb is two uops on port 5) */
KI void vb_store_codes(uint8_t *a, uint8_t *b, vi x, vi y)
{
#ifdef AOQK_AVX512BF16
	const vi idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, (int)0x7c787470, (int)0x6c686460,
	                                (int)0x5c585450, (int)0x4c484440, (int)0x3f3b3733, (int)0x2f2b2723,
	                                (int)0x1f1b1713, (int)0x0f0b0703);
	vi r = _mm512_permutex2var_epi8(x, idx, y);
	_mm_storeu_si128((__m128i *)(void *)a, _mm512_castsi512_si128(r));
	_mm_storeu_si128((__m128i *)(void *)b, _mm512_extracti32x4_epi32(r, 1));
#else
	vb_store_u8(a, _mm512_srli_epi32(x, 24));
	vb_store_u8(b, y);
#endif
}

#ifdef AOQK_AVX512BF16
/* vb_store_codes for two vectors: the top bytes of x0 then x1 to a, the low
 * bytes of y0 then y1 to b, one two-table permute and one 32-byte store
 * each (no extract of the upper half) */
#define KHAS_CODES2 1
KI void vb_store_codes2(uint8_t *a, uint8_t *b, vi x0, vi y0, vi x1, vi y1)
{
	const vi idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, (int)0x7c787470, (int)0x6c686460,
	                                (int)0x5c585450, (int)0x4c484440, (int)0x3c383430, (int)0x2c282420,
	                                (int)0x1c181410, (int)0x0c080400);
	const vi three = _mm512_set1_epi8(3);
	_mm256_storeu_si256((__m256i *)(void *)a,
	                    _mm512_castsi512_si256(_mm512_permutex2var_epi8(x0, _mm512_or_si512(idx, three), x1)));
	_mm256_storeu_si256((__m256i *)(void *)b, _mm512_castsi512_si256(_mm512_permutex2var_epi8(y0, idx, y1)));
}
#endif

/* q4's decode: a table of 16 floats indexed by the low 4 bits of each
 * lane of idx, one vpermps (it reads only those bits) */
typedef __m512 vtab;
KI vtab vt_load(const float *t) { return _mm512_loadu_ps(t); }
KI vtab vt_mul(vtab a, float s) { return _mm512_mul_ps(a, _mm512_set1_ps(s)); }
KI vtab vt_sq(vtab a) { return _mm512_mul_ps(a, a); }
KI vf vt_lookup(vtab t, vi idx) { return _mm512_permutexvar_ps(idx, t); }

KI vacc vacc_zero(void) { return (vacc){ _mm512_setzero_pd(), _mm512_setzero_pd() }; }
KI void vacc_add_sq(vacc *a, vf g)
{
	__m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
	__m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
	/* the product of two floats is exact in double: the FMA rounds as
	 * the multiply and add of the plain C kernel */
	a->a = _mm512_fmadd_pd(lo, lo, a->a);
	a->b = _mm512_fmadd_pd(hi, hi, a->b);
}
/* adds the lanes of x (once per q8 block: the fp32 sums of squares) */
KI void vacc_add(vacc *a, vf x)
{
	a->a = _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), a->a);
	a->b = _mm512_add_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))), a->b);
}
KI double vacc_sum(vacc a) { return _mm512_reduce_add_pd(_mm512_add_pd(a.a, a.b)); }

#include "kernel-body.h"
