/* SPDX-License-Identifier: MIT */
/*
 * The one definition of the number conversions (kernels/aoq-convert.h, used
 * by the kernels and the daemon's state transfer) against the harness's
 * independent double reference: every bf16/fp16 bit pattern decodes to the
 * reference value, random floats (normal, subnormal, overflowing, ties)
 * round as the reference rounds, and the q8 codebook decodes to its
 * formula and encodes to the nearest code.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "aoq-convert.h"
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

static void test_q8(void)
{
	size_t bad = 0;
	const float scale = 3.0f;
	for (int q = -127; q <= 127; q++) {
		double want = (double)q * abs(q) / (127.0 * 127.0) * scale;
		float got = aoqk_q8_m_decode((int8_t)q, scale);
		if (fabs(got - want) > 1e-6 * scale)
			bad++;
		/* the code of a decoded value is the code itself */
		if (aoqk_q8_m_encode(got, 1.0f / scale) != q)
			bad++;
	}
	for (int q = 0; q <= 255; q++) {
		double u = (double)q * q / (255.0 * 255.0) * scale;
		float got = aoqk_q8_v_decode((uint8_t)q, scale);
		if (fabs(got - u * u) > 1e-6 * scale * scale)
			bad++;
		if (aoqk_q8_v_encode(got, 1.0f / scale) != q)
			bad++;
	}
	EXPECT(bad == 0, "%zu q8 codes do not decode to the codebook or do not round-trip", bad);
	EXPECT(aoqk_q8_v_encode(1e-30f, 1.0f) == 1, "a non-zero v keeps a non-zero code");
	EXPECT(aoqk_q8_v_encode(0.0f, 1.0f) == 0, "zero v is code 0");
	EXPECT(aoqk_q8_m_encode(-3.0f, 1.0f / 3.0f) == -127, "the block's max is the extreme code");
	/* Non-finite values (a LoadState of inf or NaN; found by fuzzing):
	 * NaN is code 0, nothing passes the extreme code. */
	EXPECT(aoqk_q8_m_encode(NAN, 1.0f) == 0 && aoqk_q8_m_encode(INFINITY, 0.0f) == 0,
	       "NaN m (and inf * a zero inverse) is code 0");
	EXPECT(aoqk_q8_m_encode(-INFINITY, 1.0f) == -127 && aoqk_q8_m_encode(1e30f, 1.0f) == 127,
	       "an infinite or huge m is the extreme code");
	EXPECT(aoqk_q8_v_encode(NAN, 1.0f) == 0, "NaN v is code 0");
	EXPECT(aoqk_q8_v_encode(INFINITY, 1.0f) == 255 && aoqk_q8_v_encode(INFINITY, 0.0f) == 1,
	       "an infinite v is the extreme code, or 1 with a zero inverse (non-zero v)");
}

int main(void)
{
	test_decode_all();
	test_encode_random();
	test_q8();
	return failures != 0;
}
