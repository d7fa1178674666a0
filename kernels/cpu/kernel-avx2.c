/* SPDX-License-Identifier: MIT */
/*
 * AVX2 + FMA + F16C kernel: 8 lanes.  Compiled with -mavx2 -mfma -mf16c
 * and -ffp-contract=off: FMA only where the body asks for it (vf_fma, which
 * the plain C kernel computes with fmaf), so the results equal the plain C
 * kernel's bit for bit.
 */
#include <immintrin.h>

#include "kernel-common.h"

#define W 8
#define KVAR avx2
#define KHAS_NT 1

typedef __m256 vf;
typedef __m256i vi;
typedef __m128i vh;
typedef struct {
	__m256d a, b;
} vacc;

#define KI static AOQK_ALWAYS_INLINE __attribute__((unused)) /* not every helper is used by every build */

KI vf vf_zero(void) { return _mm256_setzero_ps(); }
KI vf vf_set1(float x) { return _mm256_set1_ps(x); }
KI vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
KI void vf_storeu(float *p, vf x) { _mm256_storeu_ps(p, x); }
KI void vf_stream(float *p, vf x) { _mm256_stream_ps(p, x); }
KI void vf_sfence(void) { _mm_sfence(); }
KI vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
KI vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
KI vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
KI vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
KI vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
KI vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
KI vf vf_sqrt(vf a) { return _mm256_sqrt_ps(a); }
/* the q8 update's sqrt(v) and m / den: IEEE's (kernel-avx512.c approximates) */
#define KQ8_APPROX 0
KI vf vf_q8_sqrt(vf v) { return _mm256_sqrt_ps(v); }
KI vf vf_q8_div(vf m, vf den) { return _mm256_div_ps(m, den); }
KI vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
KI vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
KI vf vf_abs(vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
KI vf vf_copysign(vf x, vf s)
{
	return _mm256_or_ps(x, _mm256_and_ps(s, _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u))));
}
/* +-1 for non-zero a, a itself for +-0 and NaN (Lion's sign) */
KI vf vf_sign(vf a)
{
	return _mm256_blendv_ps(a, vf_copysign(_mm256_set1_ps(1.0f), a),
	                        _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_OQ));
}
/* The maxima of the lanes of a and of b (a block's two scales), in one
 * reduction (the order does not matter: no lane is NaN or -0) */
KI void vf_hmax2(vf a, vf b, float *ma, float *mb)
{
	__m256 t = _mm256_max_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
	t = _mm256_max_ps(t, _mm256_permute_ps(t, 0x4e));
	t = _mm256_max_ps(t, _mm256_permute_ps(t, 0xb1));
	*ma = _mm256_cvtss_f32(t);
	*mb = _mm_cvtss_f32(_mm256_extractf128_ps(t, 1));
}

KI vi vi_set1(uint32_t x) { return _mm256_set1_epi32((int)x); }
KI vi vi_iota(uint32_t base)
{
	return _mm256_add_epi32(_mm256_set1_epi32((int)base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
KI vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
KI vi vi_xor(vi a, vi b) { return _mm256_xor_si256(a, b); }
KI vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
KI vi vi_zero(void) { return _mm256_setzero_si256(); }
KI vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
KI vi vi_loadu(const uint32_t *p) { return _mm256_loadu_si256((const __m256i *)(const void *)p); }
KI void vi_storeu(uint32_t *p, vi x) { _mm256_storeu_si256((__m256i *)(void *)p, x); }
KI vi vi_max_s(vi a, vi b) { return _mm256_max_epi32(a, b); }
KI vi vi_min_u(vi a, vi b) { return _mm256_min_epu32(a, b); }
KI vi vi_min_s(vi a, vi b) { return _mm256_min_epi32(a, b); }
KI vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
KI vi vi_mullo(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
/* (a & m) | c,  (a & m) | (b & ~m),  a ^ (b & m) */
KI vi vi_andor(vi a, vi m, vi c) { return _mm256_or_si256(_mm256_and_si256(a, m), c); }
KI vi vi_bitsel(vi m, vi a, vi b) { return _mm256_or_si256(_mm256_and_si256(a, m), _mm256_andnot_si256(m, b)); }
KI vi vi_xorand(vi a, vi b, vi m) { return _mm256_xor_si256(a, _mm256_and_si256(b, m)); }
/* isnan(x) ? b | 0x400000 (the quiet bit) : b + r, lane-wise */
KI vi vi_add_or_quiet(vf x, vi b, vi r)
{
	return _mm256_blendv_epi8(_mm256_or_si256(b, _mm256_set1_epi32(0x400000)), _mm256_add_epi32(b, r),
	                          _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)));
}
/* One AESENC per 128-bit lane with round key 1 or 2 (kernel-common.h),
 * by AES-NI (built with -maes; dispatch checks the CPU has it) */
KI vi vi_aesenc(vi x, int which)
{
	const __m128i k = _mm_loadu_si128((const __m128i *)(const void *)aoqk_rk[which - 1]);
	return _mm256_set_m128i(_mm_aesenc_si128(_mm256_extracti128_si256(x, 1), k),
	                        _mm_aesenc_si128(_mm256_castsi256_si128(x), k));
}
#define vi_srli(a, s) _mm256_srli_epi32((a), (s))
#define vi_slli(a, s) _mm256_slli_epi32((a), (s))
KI vi vf_as_vi(vf a) { return _mm256_castps_si256(a); }
KI vf vi_as_vf(vi a) { return _mm256_castsi256_ps(a); }
KI vf vi_to_vf(vi a) { return _mm256_cvtepi32_ps(a); }
KI vi vf_to_vi_trunc(vf a) { return _mm256_cvttps_epi32(a); }
KI vi vi_select_nan(vf x, vi if_nan, vi other)
{
	return _mm256_blendv_epi8(other, if_nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
/* 1 where no lane of x is NaN and no lane's low 16 bits are 0x8000 (the
 * split master's plain case) */
KI int vf_split_plain(vf x)
{
	__m256i l = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0xffff));
	__m256i t = _mm256_cmpeq_epi32(l, _mm256_set1_epi32(0x8000));
	__m256i n = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
	return _mm256_testz_si256(_mm256_or_si256(t, n), _mm256_set1_epi32(-1));
}

KI int vf_split_plain2(vf a, vf b) { return vf_split_plain(a) & vf_split_plain(b); }
/* 1 where no lane of a or b is NaN */
KI int vf_nonan2(vf a, vf b)
{
	return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q))) == 0;
}

/* The low 16 bits of each lane of a, then of b: 16 words in element order */
KI vi vi_pack_lo16(vi a, vi b)
{
	const vi m = _mm256_set1_epi32(0xffff);
	return _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(a, m), _mm256_and_si256(b, m)), 0xd8);
}
#define KROUND_HI16_GENERIC 1 /* kernel-body.h's vi_round_hi16 */

/* The top 16 bits of each lane of a, then of b: 16 bf16 in element order */
KI vi vi_pack_hi16(vi a, vi b)
{
	return _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16)),
	                                0xd8);
}
KI void vi_stream(uint32_t *p, vi x) { _mm256_stream_si256((__m256i *)(void *)p, x); }
KI vh vh_zero(void) { return _mm_setzero_si128(); }
KI vh vh_loadu(const uint16_t *p) { return _mm_loadu_si128((const __m128i *)(const void *)p); }
KI void vh_storeu(uint16_t *p, vh x) { _mm_storeu_si128((__m128i *)(void *)p, x); }
KI void vh_stream(uint16_t *p, vh x) { _mm_stream_si128((__m128i *)(void *)p, x); }
KI vh vi_to_vh(vi a)
{
	return _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
}
KI vi vh_to_vi_s(vh h) { return _mm256_cvtepi16_epi32(h); }
/* The low and the high 16 bits of each lane of w */
KI void vi_halves(vi w, vh *lo, vh *hi)
{
	*lo = vi_to_vh(_mm256_and_si256(w, _mm256_set1_epi32(0xffff)));
	*hi = vi_to_vh(_mm256_srli_epi32(w, 16));
}
KI vf vh_bf16_to_f(vh h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
KI vf vh_f16_to_f(vh h) { return _mm256_cvtph_ps(h); }
KI vh vf_to_f16(vf x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
KI vh vf_to_bf16(vf x)
{
	vi b = _mm256_castps_si256(x);
	vi lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
	vi r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
	vi q = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
	return vi_to_vh(vi_select_nan(x, q, r));
}

KI vi vb_load_i8(const int8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p)); }
KI vi vb_load_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)p)); }
/* the low 8 bits of each lane, as the AVX-512 truncating vpmovdb and the
 * plain C cast (q8 codes of NaN moments lie outside 0..255) */
KI void vb_store_u8(uint8_t *p, vi q)
{
	q = _mm256_and_si256(q, _mm256_set1_epi32(0xff));
	__m128i h = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
	_mm_storel_epi64((__m128i *)(void *)p, _mm_packus_epi16(h, h));
}

/* the top byte of each lane of x to a, the low byte of each lane of y to b */
KI void vb_store_codes(uint8_t *a, uint8_t *b, vi x, vi y)
{
	vb_store_u8(a, _mm256_srli_epi32(x, 24));
	vb_store_u8(b, y);
}

/* q4's decode: a table of 16 floats indexed by the low 4 bits of each
 * lane of idx (two 8-entry permutes, bit 3 picks one: the shift moves it
 * to the sign bit that blendv reads, and drops the bits above) */
typedef struct {
	__m256 lo, hi;
} vtab;
KI vtab vt_load(const float *t) { return (vtab){ _mm256_loadu_ps(t), _mm256_loadu_ps(t + 8) }; }
KI vtab vt_mul(vtab a, float s)
{
	return (vtab){ _mm256_mul_ps(a.lo, _mm256_set1_ps(s)), _mm256_mul_ps(a.hi, _mm256_set1_ps(s)) };
}
KI vtab vt_sq(vtab a) { return (vtab){ _mm256_mul_ps(a.lo, a.lo), _mm256_mul_ps(a.hi, a.hi) }; }
KI vf vt_lookup(vtab t, vi idx)
{
	return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, idx), _mm256_permutevar8x32_ps(t.hi, idx),
	                        _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

KI vacc vacc_zero(void) { return (vacc){ _mm256_setzero_pd(), _mm256_setzero_pd() }; }
KI void vacc_add_sq(vacc *a, vf g)
{
	__m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
	__m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
	/* the product of two floats is exact in double: the FMA rounds as
	 * the multiply and add of the plain C kernel */
	a->a = _mm256_fmadd_pd(lo, lo, a->a);
	a->b = _mm256_fmadd_pd(hi, hi, a->b);
}
/* adds the lanes of x (once per q8 block: the fp32 sums of squares) */
KI void vacc_add(vacc *a, vf x)
{
	a->a = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), a->a);
	a->b = _mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), a->b);
}
KI double vacc_sum(vacc a)
{
	__m256d s = _mm256_add_pd(a.a, a.b);
	__m128d t = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
	return _mm_cvtsd_f64(_mm_add_sd(t, _mm_unpackhi_pd(t, t)));
}

#include "kernel-body.h"
