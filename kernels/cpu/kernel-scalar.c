/* SPDX-License-Identifier: MIT */
/*
 * Plain C kernel: the body of kernel-body.h with one lane per "vector".
 * The reference the SIMD variants must match bit for bit, and the fallback
 * on CPUs without AVX2.  Compiled without special flags.
 */
#include "kernel-common.h"

#define W 1
#define KVAR scalar
#define KHAS_NT 0

typedef float vf;
typedef uint32_t vi;
typedef uint16_t vh;
typedef double vacc;

static AOQK_ALWAYS_INLINE vf vf_zero(void) { return 0.0f; }
static AOQK_ALWAYS_INLINE vf vf_set1(float x) { return x; }
static AOQK_ALWAYS_INLINE vf vf_loadu(const float *p) { return *p; }
static AOQK_ALWAYS_INLINE void vf_storeu(float *p, vf x) { *p = x; }
static AOQK_ALWAYS_INLINE void vf_stream(float *p, vf x) { *p = x; }
static AOQK_ALWAYS_INLINE void vf_sfence(void) { }
static AOQK_ALWAYS_INLINE vf vf_add(vf a, vf b) { return a + b; }
static AOQK_ALWAYS_INLINE vf vf_sub(vf a, vf b) { return a - b; }
static AOQK_ALWAYS_INLINE vf vf_mul(vf a, vf b) { return a * b; }
static AOQK_ALWAYS_INLINE vf vf_div(vf a, vf b) { return a / b; }
/* a * b + c and c - a * b with one rounding, as the FMA instructions */
static AOQK_ALWAYS_INLINE vf vf_fma(vf a, vf b, vf c) { return fmaf(a, b, c); }
static AOQK_ALWAYS_INLINE vf vf_fnma(vf a, vf b, vf c) { return fmaf(-a, b, c); }
static AOQK_ALWAYS_INLINE vf vf_sqrt(vf a) { return sqrtf(a); }
/* the q8 update's sqrt(v) and m / den: IEEE's (kernel-avx512.c approximates) */
#define KQ8_APPROX 0
static AOQK_ALWAYS_INLINE vf vf_q8_sqrt(vf v) { return sqrtf(v); }
static AOQK_ALWAYS_INLINE vf vf_q8_div(vf m, vf den) { return m / den; }
/* x86 maxps/minps semantics: the second operand when either is NaN */
static AOQK_ALWAYS_INLINE vf vf_max(vf a, vf b) { return a > b ? a : b; }
static AOQK_ALWAYS_INLINE vf vf_min(vf a, vf b) { return a < b ? a : b; }
static AOQK_ALWAYS_INLINE vf vf_abs(vf a) { return aoqk_u2f(aoqk_f2u(a) & 0x7fffffffu); }
static AOQK_ALWAYS_INLINE vf vf_copysign(vf x, vf s)
{
	return aoqk_u2f(aoqk_f2u(x) | (aoqk_f2u(s) & 0x80000000u));
}
static AOQK_ALWAYS_INLINE void vf_hmax2(vf a, vf b, float *ma, float *mb)
{
	*ma = a;
	*mb = b;
}
/* +-1 for non-zero a, a itself for +-0 and NaN (Lion's sign) */
static AOQK_ALWAYS_INLINE vf vf_sign(vf a) { return a > 0.0f ? 1.0f : a < 0.0f ? -1.0f : a; }

static AOQK_ALWAYS_INLINE vi vi_set1(uint32_t x) { return x; }
static AOQK_ALWAYS_INLINE vi vi_iota(uint32_t base) { return base; }
static AOQK_ALWAYS_INLINE vi vi_add(vi a, vi b) { return a + b; }
static AOQK_ALWAYS_INLINE vi vi_xor(vi a, vi b) { return a ^ b; }
static AOQK_ALWAYS_INLINE vi vi_and(vi a, vi b) { return a & b; }
static AOQK_ALWAYS_INLINE vi vi_zero(void) { return 0; }
static AOQK_ALWAYS_INLINE vi vi_sub(vi a, vi b) { return a - b; }
static AOQK_ALWAYS_INLINE vi vi_loadu(const uint32_t *p) { return *p; }
static AOQK_ALWAYS_INLINE void vi_storeu(uint32_t *p, vi x) { *p = x; }
static AOQK_ALWAYS_INLINE vi vi_max_s(vi a, vi b) { return (int32_t)a > (int32_t)b ? a : b; }
static AOQK_ALWAYS_INLINE vi vi_min_u(vi a, vi b) { return a < b ? a : b; }
static AOQK_ALWAYS_INLINE vi vi_min_s(vi a, vi b) { return (int32_t)a < (int32_t)b ? a : b; }
static AOQK_ALWAYS_INLINE vi vi_or(vi a, vi b) { return a | b; }
static AOQK_ALWAYS_INLINE vi vi_mullo(vi a, vi b) { return a * b; }
static AOQK_ALWAYS_INLINE vi vi_andor(vi a, vi m, vi c) { return (a & m) | c; }
static AOQK_ALWAYS_INLINE vi vi_bitsel(vi m, vi a, vi b) { return (a & m) | (b & ~m); }
static AOQK_ALWAYS_INLINE vi vi_xorand(vi a, vi b, vi m) { return a ^ (b & m); }
static AOQK_ALWAYS_INLINE vi vi_add_or_quiet(vf x, vi b, vi r)
{
	return x != x ? b | 0x400000u : b + r;
}
static AOQK_ALWAYS_INLINE vi vi_srli(vi a, int s) { return a >> s; }
static AOQK_ALWAYS_INLINE vi vi_slli(vi a, int s) { return a << s; }
static AOQK_ALWAYS_INLINE vi vf_as_vi(vf a) { return aoqk_f2u(a); }
static AOQK_ALWAYS_INLINE vf vi_as_vf(vi a) { return aoqk_u2f(a); }
static AOQK_ALWAYS_INLINE vf vi_to_vf(vi a) { return (float)(int32_t)a; }
static AOQK_ALWAYS_INLINE vi vf_to_vi_trunc(vf a) { return (uint32_t)(int32_t)a; }
static AOQK_ALWAYS_INLINE vi vi_select_nan(vf x, vi if_nan, vi other)
{
	return x != x ? if_nan : other;
}
/* 1 where x is not NaN and its low 16 bits are not 0x8000 (the split
 * master's plain case) */
static AOQK_ALWAYS_INLINE int vf_split_plain(vf x)
{
	return x == x && (aoqk_f2u(x) & 0xffffu) != 0x8000u;
}

static AOQK_ALWAYS_INLINE vh vh_zero(void) { return 0; }
static AOQK_ALWAYS_INLINE vh vh_loadu(const uint16_t *p) { return *p; }
static AOQK_ALWAYS_INLINE void vh_storeu(uint16_t *p, vh x) { *p = x; }
static AOQK_ALWAYS_INLINE void vh_stream(uint16_t *p, vh x) { *p = x; }
static AOQK_ALWAYS_INLINE vh vi_to_vh(vi a) { return (uint16_t)a; }
static AOQK_ALWAYS_INLINE vi vh_to_vi_s(vh h) { return (vi)(int32_t)(int16_t)h; }
static AOQK_ALWAYS_INLINE void vi_halves(vi w, vh *lo, vh *hi)
{
	*lo = (uint16_t)w;
	*hi = (uint16_t)(w >> 16);
}
static AOQK_ALWAYS_INLINE vf vh_bf16_to_f(vh h) { return aoqk_bf16_to_f32(h); }
static AOQK_ALWAYS_INLINE vf vh_f16_to_f(vh h) { return aoqk_f16_to_f32(h); }
static AOQK_ALWAYS_INLINE vh vf_to_bf16(vf x) { return aoqk_f32_to_bf16(x); }
static AOQK_ALWAYS_INLINE vh vf_to_f16(vf x) { return aoqk_f32_to_f16(x); }

static AOQK_ALWAYS_INLINE vi vb_load_i8(const int8_t *p) { return (uint32_t)(int32_t)*p; }
static AOQK_ALWAYS_INLINE vi vb_load_u8(const uint8_t *p) { return *p; }
static AOQK_ALWAYS_INLINE void vb_store_u8(uint8_t *p, vi q) { *p = (uint8_t)q; }

/* the top byte of x to a, the low byte of y to b */
static AOQK_ALWAYS_INLINE void vb_store_codes(uint8_t *a, uint8_t *b, vi x, vi y)
{
	*a = (uint8_t)(x >> 24);
	*b = (uint8_t)y;
}

/* q4's decode: a table of 16 floats indexed by the low 4 bits of idx */
typedef struct {
	float t[16];
} vtab;
static AOQK_ALWAYS_INLINE vtab vt_load(const float *t)
{
	vtab r;
	memcpy(r.t, t, sizeof(r.t));
	return r;
}
static AOQK_ALWAYS_INLINE vtab vt_mul(vtab a, float s)
{
	for (unsigned i = 0; i < 16; i++)
		a.t[i] *= s;
	return a;
}
static AOQK_ALWAYS_INLINE vtab vt_sq(vtab a)
{
	for (unsigned i = 0; i < 16; i++)
		a.t[i] *= a.t[i];
	return a;
}
static AOQK_ALWAYS_INLINE vf vt_lookup(vtab t, vi idx) { return t.t[idx & 15u]; }

static AOQK_ALWAYS_INLINE vacc vacc_zero(void) { return 0.0; }
static AOQK_ALWAYS_INLINE void vacc_add_sq(vacc *a, vf g) { *a += (double)g * (double)g; }
static AOQK_ALWAYS_INLINE void vacc_add(vacc *a, vf x) { *a += (double)x; }
static AOQK_ALWAYS_INLINE double vacc_sum(vacc a) { return a; }

#include "kernel-body.h"
