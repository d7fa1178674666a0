/* SPDX-License-Identifier: MIT */
/*
 * The one definition of the number conversions (kernels/aoq-convert.h, used
 * by the kernels and the daemon's state transfer) against the harness's
 * independent double reference: every bf16/fp16 bit pattern decodes to the
 * reference value, random floats (normal, subnormal, overflowing, ties)
 * round as the reference rounds, and the q8 and q4 codebooks decode to
 * their formula and encode to the nearest code; fp32 masters loaded into
 * the 24-bit master (aoqd_master_split) come back (aoqd_master_join) rounded to
 * the nearest 24-bit value, ties to even, with the parameter their
 * rounding half away from zero.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "aoq-convert.h"
#include "convert.h"
#include "harness.h"

#include "expect.h"

static void test_decode_all(void)
{
	size_t bad = 0;
	for (uint32_t b = 0; b < 65536; b++) {
		double rb = aoqt_decode(b, AOQ_BF16), rh = aoqt_decode(b, AOQ_FP16);
		float gb = aoqk_bf16_to_f32((uint16_t)b), gh = aoqk_f16_to_f32((uint16_t)b);
		if (isnan(rb) ? !isnan(gb) : (double)gb != rb || !signbit(gb) != !signbit(rb))
			bad++;
		if (isnan(rh) ? !isnan(gh) : (double)gh != rh || !signbit(gh) != !signbit(rh))
			bad++;
	}
	EXPECT(bad == 0, "%zu bf16/fp16 patterns decode differently from the reference", bad);
}

static void test_encode_random(void)
{
	srand(4242);
	size_t bad16 = 0, badbf = 0;
	for (int i = 0; i < 400000; i++) {
		uint32_t u = ((uint32_t)rand() << 16) ^ (uint32_t)rand();
		/* Half the draws near the fp16 range, where subnormals, ties and
		 * overflow live; the others anywhere in fp32. */
		if (i & 1)
			u = (u & 0x807fffffu) | ((uint32_t)(100 + rand() % 45) << 23);
		if (i % 7 == 0)
			u &= ~0x0fffu; /* exact ties in both formats */
		float f;
		memcpy(&f, &u, 4);
		if (isnan(f))
			continue;
		if (aoqk_f32_to_f16(f) != aoqt_encode(f, AOQ_FP16))
			bad16++;
		if (aoqk_f32_to_bf16(f) != aoqt_encode(f, AOQ_BF16))
			badbf++;
	}
	EXPECT(bad16 == 0, "%zu fp16 roundings differ from the reference", bad16);
	EXPECT(badbf == 0, "%zu bf16 roundings differ from the reference", badbf);
	EXPECT(aoqk_f32_to_f16(65520.0f) == 0x7c00, "65520 -> fp16 inf");
	EXPECT(aoqk_f32_to_f16(65519.0f) == 0x7bff, "65519 -> fp16 max");
	EXPECT(aoqk_f32_to_f16(0x1p-25f) == 0x0000, "tie with 0 -> even");
	EXPECT(aoqk_f32_to_f16(0x1.8p-25f) == 0x0001, "above the tie -> 1");
	float qnan = NAN;
	EXPECT(isnan(aoqk_bf16_to_f32(aoqk_f32_to_bf16(qnan))), "bf16 NaN stays NaN");
	EXPECT(isnan(aoqk_f16_to_f32(aoqk_f32_to_f16(qnan))), "fp16 NaN stays NaN");
}

/* q8 format 2 from its definition (kernels/README.md), in double: exponent
 * code >> mb, mantissa code & (2^mb - 1), both relative to E = cmax >> mb
 * (the largest code just below 2), minus the offset 2^-E. */
static double q8_grid(unsigned c, int mb, unsigned cmax)
{
	int e0 = (int)(cmax >> mb);
	return ldexp(1.0 + (double)(c & ((1u << mb) - 1)) / (1 << mb), (int)(c >> mb) - e0) - ldexp(1, -e0);
}

static double q8_mgrid(unsigned c)
{
	return q8_grid(c, AOQK_Q8_M_MB, 127);
}

static double q8_ugrid(unsigned c)
{
	return q8_grid(c, AOQK_Q8_U_MB, 255);
}

static void test_q8(void)
{
	size_t bad = 0, badrt = 0;
	const float scale = 3.0f;
	const double mtop = q8_mgrid(127), utop = q8_ugrid(255);
	for (unsigned c = 0; c < 256; c++) {
		double want = (c & 0x80 ? -1 : 1) * q8_mgrid(c & 0x7f) / mtop * scale;
		float got = aoqk_q8_m_decode((uint8_t)c, scale);
		if (fabs(got - want) > 1e-6 * fabs(want))
			bad++;
		/* the code of a decoded value is the code itself (-0 is +0) */
		if (aoqk_q8_m_encode(got, aoqk_q8_inv(AOQK_Q8_M_TOP, scale)) != (c == 0x80 ? 0 : c))
			badrt++;
	}
	for (unsigned c = 0; c < 256; c++) {
		double u = q8_ugrid(c) / utop * scale;
		float got = aoqk_q8_v_decode((uint8_t)c, scale);
		if (fabs(got - u * u) > 1e-6 * u * u)
			bad++;
		if (aoqk_q8_v_encode(got, aoqk_q8_inv(AOQK_Q8_U_TOP, scale)) != c)
			badrt++;
	}
	EXPECT(bad == 0, "%zu q8 codes do not decode to the format", bad);
	EXPECT(badrt == 0, "%zu q8 codes do not round-trip", badrt);
	/* nearest: halfway between two codes' values rounds away from zero, a
	 * quarter of the way stays */
	for (unsigned c = 1; c < 126; c++) {
		double lo = q8_mgrid(c) / mtop * scale, hi = q8_mgrid(c + 1) / mtop * scale;
		float inv = aoqk_q8_inv(AOQK_Q8_M_TOP, scale);
		if (aoqk_q8_m_encode((float)(lo + 0.25 * (hi - lo)), inv) != c ||
		    aoqk_q8_m_encode((float)-(lo + 0.75 * (hi - lo)), inv) != (0x80 | (c + 1)))
			bad++;
	}
	EXPECT(bad == 0, "%zu q8 m values do not round to the nearest code", bad);
	EXPECT(aoqk_q8_v_encode(1e-30f, aoqk_q8_inv(AOQK_Q8_U_TOP, 1.0f)) == 1, "a non-zero v keeps a non-zero code");
	EXPECT(aoqk_q8_v_encode(0.0f, aoqk_q8_inv(AOQK_Q8_U_TOP, 1.0f)) == 0, "zero v is code 0");
	EXPECT(aoqk_q8_m_encode(-3.0f, aoqk_q8_inv(AOQK_Q8_M_TOP, 3.0f)) == 0xff, "the block's max is the extreme code");
	EXPECT(aoqk_q8_m_encode(2e-40f, aoqk_q8_inv(AOQK_Q8_M_TOP, 1e-39f)) > 0, "a denormal block still encodes");
	EXPECT(aoqk_q8_m_encode(0.0f, aoqk_q8_inv(AOQK_Q8_M_TOP, 1e-45f)) == 0, "zero in a denormal block is 0");
}

/* Format 1 (the earlier codebook) still decodes as it was defined. */
static void test_q8v1(void)
{
	size_t bad = 0;
	const float scale = 3.0f;
	for (int q = -127; q <= 127; q++) {
		double want = (double)q * abs(q) / (127.0 * 127.0) * scale;
		float got = aoqk_q8v1_m_decode((int8_t)q, scale);
		if (fabs(got - want) > 1e-6 * scale)
			bad++;
		if (aoqk_q8v1_m_encode(got, 1.0f / scale) != q)
			bad++;
	}
	for (int q = 0; q <= 255; q++) {
		double u = (double)q * q / (255.0 * 255.0) * scale;
		float got = aoqk_q8v1_v_decode((uint8_t)q, scale);
		if (fabs(got - u * u) > 1e-6 * scale * scale)
			bad++;
		if (aoqk_q8v1_v_encode(got, 1.0f / scale) != q)
			bad++;
	}
	EXPECT(bad == 0, "%zu format 1 codes do not decode to their codebook or do not round-trip", bad);
	/* Non-finite values (a LoadState of inf or NaN; found by fuzzing):
	 * format 1 gives NaN code 0 and nothing past the extreme code (the
	 * float-to-int cast was undefined); format 2 clamps codes. */
	EXPECT(aoqk_q8v1_m_encode(NAN, 1.0f) == 0 && aoqk_q8v1_m_encode(INFINITY, 0.0f) == 0,
	       "format 1: NaN m (and inf * a zero inverse) is code 0");
	EXPECT(aoqk_q8v1_m_encode(-INFINITY, 1.0f) == -127 && aoqk_q8v1_m_encode(1e30f, 1.0f) == 127,
	       "format 1: an infinite or huge m is the extreme code");
	EXPECT(aoqk_q8v1_v_encode(NAN, 1.0f) == 0 && aoqk_q8v1_v_encode(INFINITY, 1.0f) == 255,
	       "format 1: NaN v is code 0, an infinite one the extreme code");
	EXPECT((aoqk_q8_m_encode(-INFINITY, aoqk_q8_inv(AOQK_Q8_M_TOP, 1.0f)) & 0x7f) == 127 &&
	       aoqk_q8_v_encode(INFINITY, aoqk_q8_inv(AOQK_Q8_U_TOP, 1.0f)) == 255,
	       "format 2: an infinite moment is the extreme code");
}

/* State saved from a daemon that held format 1: its ReadState decoded the
 * codes to values (aoqk_q8v1_*_decode), and LoadState now encodes those
 * values in format 2 (daemon/convert.c).  Every loaded value must be the
 * format-2 code nearest to the saved one: within half a code spacing (a
 * tiny m may become 0; a tiny non-zero v takes the smallest non-zero code),
 * the block maxima exact, zeros zero, signs kept. */
static void test_q8_load_v1(void)
{
	enum { N = 4 * AOQK_Q8_BLOCK + 77 };
	static int8_t m1[N];
	static uint8_t v1[N], m2[N], v2[N];
	static float ms1[5], vs1[5], ms2[5], vs2[5], saved_m[N], saved_v[N], got_m[N], got_v[N];
	size_t bad = 0;
	uint64_t r = 0x1234567;
	for (size_t b = 0; b < 5; b++) {
		ms1[b] = (float)ldexp(1.0 + (double)(b % 3), -(int)(b * 7));
		vs1[b] = (float)ldexp(1.5, -(int)(b * 5) - 3);
	}
	for (size_t i = 0; i < N; i++) {
		r = r * 6364136223846793005ull + 1442695040888963407ull;
		m1[i] = (int8_t)((int)((r >> 33) % 255) - 127);
		v1[i] = (uint8_t)(r >> 45);
		if (i % AOQK_Q8_BLOCK == 3) { /* each block reaches its scale */
			m1[i] = -127;
			v1[i] = 255;
		}
		saved_m[i] = aoqk_q8v1_m_decode(m1[i], ms1[i / AOQK_Q8_BLOCK]);
		saved_v[i] = aoqk_q8v1_v_decode(v1[i], vs1[i / AOQK_Q8_BLOCK]);
	}
	aoqd_q8_encode(m2, ms2, saved_m, false, 0, N);
	aoqd_q8_encode(v2, vs2, saved_v, true, 0, N);
	aoqd_q8_decode(got_m, m2, ms2, false, 0, N);
	aoqd_q8_decode(got_v, v2, vs2, true, 0, N);
	for (size_t b = 0; b < 5; b++)
		if (ms2[b] != ms1[b] || vs2[b] != vs1[b])
			bad++;
	EXPECT(bad == 0, "%zu block scales differ from the saved state's maxima", bad);
	for (size_t i = 0; i < N; i++) {
		size_t b = i / AOQK_Q8_BLOCK;
		/* the spacing of format 2 around x (relative to the block's
		 * top): 2^(e - 3) for m, 2^(e - 4) for sqrt(v), e = x's binade,
		 * at least the linear bottom binade's */
		int m0 = 127 >> AOQK_Q8_M_MB, u0 = 255 >> AOQK_Q8_U_MB;
		double xm = fabs(saved_m[i]) / ms1[b] * q8_mgrid(127) + ldexp(1, -m0);
		double xu = sqrt(saved_v[i]) / vs1[b] * q8_ugrid(255) + ldexp(1, -u0);
		int em, eu;
		frexp(xm, &em);
		frexp(xu, &eu);
		double hm = ldexp(1, em - 1 - AOQK_Q8_M_MB) / q8_mgrid(127) * ms1[b] * (0.5 + 1e-3);
		double hu = ldexp(1, eu - 1 - AOQK_Q8_U_MB) / q8_ugrid(255) * vs1[b] * (0.5 + 1e-3);
		double umin = q8_ugrid(1) / q8_ugrid(255) * vs1[b];
		if (fabs(got_m[i] - saved_m[i]) > hm || (saved_m[i] == 0 && got_m[i] != 0) ||
		    (got_m[i] != 0 && (got_m[i] < 0) != (saved_m[i] < 0)))
			bad++;
		if ((fabs(sqrt(got_v[i]) - sqrt(saved_v[i])) > hu &&
		     !(fabs(sqrt(got_v[i]) - umin) <= 1e-6 * umin && sqrt(saved_v[i]) < umin)) ||
		    (saved_v[i] == 0) != (got_v[i] == 0))
			bad++;
	}
	EXPECT(bad == 0, "%zu values of format-1 state load into format 2 beyond half a code", bad);
}

/* q4 (kernels/README.md, "q4 moments"): every code decodes to the format's
 * value, round-trips, encodes to the nearest code; and the daemon's array
 * conversion (LoadState / ReadState, aoqd_q4_encode / _decode) keeps each
 * value within half a code of its block's grid, packs two codes a byte in
 * the layout of the kernels, and zeroes the last group's codes past the end. */
static void test_q4(void)
{
	size_t bad = 0, badrt = 0;
	const float scale = 3.0f;
	const double mtop = q8_grid(7, AOQK_Q4_M_MB, 7), utop = q8_grid(15, AOQK_Q4_U_MB, 15);
	for (unsigned c = 0; c < 16; c++) {
		double want = (c & 8 ? -1 : 1) * q8_grid(c & 7, AOQK_Q4_M_MB, 7) / mtop * scale;
		float got = aoqk_q4_m_decode(c, scale);
		if (fabs(got - want) > 1e-6 * fabs(want))
			bad++;
		if (aoqk_q4_m_encode(got, aoqk_q8_inv(AOQK_Q4_M_TOP, scale)) != (c == 8 ? 0 : c))
			badrt++;
		double u = q8_grid(c, AOQK_Q4_U_MB, 15) / utop * scale;
		float gv = aoqk_q4_v_decode(c, scale);
		if (fabs(gv - u * u) > 1e-6 * u * u)
			bad++;
		if (aoqk_q4_v_encode(gv, aoqk_q8_inv(AOQK_Q4_U_TOP, scale)) != c)
			badrt++;
	}
	EXPECT(bad == 0, "%zu q4 codes do not decode to the format", bad);
	EXPECT(badrt == 0, "%zu q4 codes do not round-trip", badrt);
	for (unsigned c = 0; c < 6; c++) {
		double lo = q8_grid(c, AOQK_Q4_M_MB, 7) / mtop * scale, hi = q8_grid(c + 1, AOQK_Q4_M_MB, 7) / mtop * scale;
		float inv = aoqk_q8_inv(AOQK_Q4_M_TOP, scale);
		if (aoqk_q4_m_encode((float)(lo + 0.25 * (hi - lo)), inv) != c ||
		    aoqk_q4_m_encode((float)-(lo + 0.75 * (hi - lo)), inv) != (8 | (c + 1)))
			bad++;
	}
	EXPECT(bad == 0, "%zu q4 m values do not round to the nearest code", bad);
	EXPECT(aoqk_q4_v_encode(1e-30f, aoqk_q8_inv(AOQK_Q4_U_TOP, 1.0f)) == 1, "q4: a non-zero v keeps a non-zero code");
	EXPECT(aoqk_q4_v_encode(0.0f, aoqk_q8_inv(AOQK_Q4_U_TOP, 1.0f)) == 0, "q4: zero v is code 0");
	EXPECT(aoqk_q4_m_encode(-3.0f, aoqk_q8_inv(AOQK_Q4_M_TOP, 3.0f)) == 15, "q4: the block's max is the extreme code");

	/* the array conversion: 1000 elements (7 blocks, the last partial, and
	 * a partial last group), values spread over 6 decades */
	enum { N = 1000 };
	static float src[N], got[N], scales[(N + 127) / 128];
	static uint8_t codes[(N + 31) / 32 * 16];
	srand(77);
	for (int second = 0; second < 2; second++) {
		memset(codes, 0xff, sizeof(codes)); /* the padding must come back 0 */
		for (size_t i = 0; i < N; i++) {
			double x = pow(10.0, -6.0 * rand() / RAND_MAX) * (second || rand() & 1 ? 1 : -1);
			src[i] = (float)(second ? x * x : x);
		}
		src[5] = 0.0f;
		aoqd_q4_encode(codes, scales, src, second, 0, N, N);
		aoqd_q4_decode(got, codes, scales, second, 0, N);
		size_t badv = 0, badl = 0;
		for (size_t i = 0; i < N; i++) {
			size_t b = i / AOQK_Q4_BLOCK;
			double top = second ? utop : mtop;
			unsigned cmax = second ? 15 : 7;
			int mb = second ? AOQK_Q4_U_MB : AOQK_Q4_M_MB;
			double x = second ? sqrt(src[i]) : fabs(src[i]), y = second ? sqrt(got[i]) : fabs(got[i]);
			/* the two grid values around x: y must be the nearer (or the
			 * smallest non-zero code for a tiny non-zero v) */
			double pos = x / scales[b] * top, lo = 0, hi = 0;
			for (unsigned c = 0; c < cmax; c++) {
				lo = q8_grid(c, mb, cmax);
				hi = q8_grid(c + 1, mb, cmax);
				if (hi >= pos)
					break;
			}
			double want = pos - lo <= hi - pos ? lo : hi;
			if (second && x > 0 && want == 0)
				want = q8_grid(1, mb, cmax);
			if (fabs(y / scales[b] * top - want) > 1e-5 * (want + 1e-30) + 1e-6 * (hi - lo))
				badv++;
			if (!second && got[i] != 0 && (got[i] < 0) != (src[i] < 0))
				badv++;
			unsigned c = (codes[i / 32 * 16 + i % 16] >> (i % 32 >= 16 ? 4 : 0)) & 15u;
			if (c != aoqk_q4_get(codes, i))
				badl++;
		}
		for (size_t i = N; i % 32; i++)
			if (aoqk_q4_get(codes, i) != 0)
				badl++;
		EXPECT(badv == 0, "q4 %s: %zu loaded values not the nearest code", second ? "v" : "m", badv);
		EXPECT(badl == 0, "q4 %s: %zu codes in the wrong place or padding not 0", second ? "v" : "m", badl);
		/* a piece that starts on a later block decodes the same values */
		static float part[N];
		aoqd_q4_decode(part, codes, scales, second, 256, N - 256);
		EXPECT(!memcmp(part, got + 256, (N - 256) * sizeof(float)), "q4 %s: a piece decodes differently",
		       second ? "v" : "m");
	}
}

/* The value of a 24-bit pattern (fp32 bits, low byte zero) in double;
 * the pattern past the largest finite one stands for 2^128, where IEEE
 * rounding overflows. */
static double v24(uint32_t b)
{
	if ((b & 0x7fffffffu) == 0x7f800000u)
		return (b >> 31 ? -1.0 : 1.0) * ldexp(1.0, 128);
	float f;
	memcpy(&f, &b, 4);
	return f;
}

static void test_split8(void)
{
	enum { N = 1 << 16 };
	static uint32_t src[N], back[N];
	static uint16_t hi[N];
	static int8_t lo8[N];
	uint64_t s = 0x24b17;
	for (size_t i = 0; i < N; i++) {
		s = s * 6364136223846793005ull + 1442695040888963407ull;
		uint32_t b = (uint32_t)(s >> 32);
		switch (i % 8) {
		case 0: b = (b & ~0xffu) | 0x80u; break;                 /* a tie */
		case 1: b = (b & 0x807fffffu) | 0x7f7fff00u; break;      /* near the largest */
		case 2: b &= 0x807fffffu; break;                         /* subnormal */
		case 3: b = (b & ~0xffu); break;                          /* already 24-bit */
		default: break;
		}
		src[i] = b;
	}
	src[4] = 0x7fc01234u; /* a NaN */
	src[5] = 0x7f800000u; /* inf */
	aoqd_master_split(hi, lo8, 1, src, N);
	aoqd_master_join(back, hi, lo8, 1, N);
	int bad = 0;
	for (size_t i = 0; i < N && bad < 5; i++) {
		uint32_t b = src[i];
		if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x7fffffu)) {
			if ((back[i] & 0x7f800000u) != 0x7f800000u || !(back[i] & 0x7fffffu) || (hi[i] & 0x7fc0) != 0x7fc0)
				bad++, fprintf(stderr, "NaN %08x came back %08x (hi %04x)\n", b, back[i], hi[i]);
			continue;
		}
		/* the two 24-bit neighbours, by their values */
		uint32_t dn = b & ~0xffu, up = dn + 0x100u;
		double x = v24(b), a = v24(dn), c = v24(up);
		double da = fabs(x - a), dc = fabs(c - x);
		uint32_t want = da < dc ? dn : dc < da ? up : (dn & 0x100u) ? up : dn;
		/* the parameter: the value rounded half away from zero to bf16 */
		uint32_t pd = want & 0xffff0000u, pu = pd + 0x10000u;
		double w = v24(want), ea = fabs(w - v24(pd)), ec = fabs(v24(pu) - w);
		uint16_t wp = (uint16_t)((ea < ec ? pd : pu) >> 16);
		if ((want & 0x7fffffffu) == 0x7f800000u)
			wp = (uint16_t)(want >> 16);
		if (back[i] != want || hi[i] != wp)
			bad++, fprintf(stderr, "%08x came back %08x (hi %04x), expected %08x (hi %04x)\n", b, back[i], hi[i],
			               want, wp);
	}
	EXPECT(bad == 0, "the 24-bit master's load: %d values wrong", bad);
}

int main(void)
{
	test_decode_all();
	test_encode_random();
	test_q8();
	test_q8v1();
	test_q8_load_v1();
	test_q4();
	test_split8();
	return failures != 0;
}
