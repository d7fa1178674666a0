/* SPDX-License-Identifier: MIT */
#include <math.h>
#include <string.h>

#include "convert.h"

float aoqd_bf16_to_float(uint16_t b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

uint16_t aoqd_float_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u) /* nan: keep it quiet and nan */
		return (uint16_t)((u >> 16) | 0x40);
	u += 0x7fffu + ((u >> 16) & 1);
	return (uint16_t)(u >> 16);
}

float aoqd_half_to_float(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000) << 16;
	uint32_t exp = (h >> 10) & 0x1f;
	uint32_t man = h & 0x3ff;
	float f;
	if (exp == 0) {
		f = ldexpf((float)man, -24);
		if (sign)
			f = -f;
		return f;
	}
	uint32_t u;
	if (exp == 31)
		u = sign | 0x7f800000u | (man << 13);
	else
		u = sign | ((exp + 112) << 23) | (man << 13);
	memcpy(&f, &u, 4);
	return f;
}

uint16_t aoqd_float_to_half(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
	uint32_t a = u & 0x7fffffffu;
	if (a > 0x7f800000u)
		return sign | 0x7e00;
	if (a >= 0x477ff000u) /* rounds to >= 65520: inf */
		return sign | 0x7c00;
	if (a < 0x38800000u) { /* below the smallest normal: subnormal or zero */
		float af;
		memcpy(&af, &a, 4);
		/* af * 2^24 rounded to nearest even is the subnormal mantissa */
		return sign | (uint16_t)nearbyintf(af * 16777216.0f);
	}
	uint32_t r = a + 0xfffu + ((a >> 13) & 1) - (112u << 23);
	return sign | (uint16_t)(r >> 13);
}

void aoqd_to_f32(float *dst, const void *src, enum aoqk_dtype t, size_t n)
{
	const uint16_t *h = src;
	switch (t) {
	case AOQK_FP32:
		memcpy(dst, src, n * 4);
		break;
	case AOQK_BF16:
		for (size_t i = 0; i < n; i++)
			dst[i] = aoqd_bf16_to_float(h[i]);
		break;
	case AOQK_FP16:
		for (size_t i = 0; i < n; i++)
			dst[i] = aoqd_half_to_float(h[i]);
		break;
	}
}

void aoqd_from_f32(void *dst, enum aoqk_dtype t, const float *src, size_t n)
{
	uint16_t *h = dst;
	switch (t) {
	case AOQK_FP32:
		memcpy(dst, src, n * 4);
		break;
	case AOQK_BF16:
		for (size_t i = 0; i < n; i++)
			h[i] = aoqd_float_to_bf16(src[i]);
		break;
	case AOQK_FP16:
		for (size_t i = 0; i < n; i++)
			h[i] = aoqd_float_to_half(src[i]);
		break;
	}
}
