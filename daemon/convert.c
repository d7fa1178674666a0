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

/* q8 moments, the codebook of kernels/README.md: per block of
 * AOQK_Q8_BLOCK elements, m = q * |q| * m_scale / 127^2 and
 * sqrt(v) = q^2 * v_scale / 255^2. */
void aoqd_q8_decode(float *dst, const void *codes, const float *scales, bool second, uint64_t first, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint64_t e = first + i;
		float s = scales[e / AOQK_Q8_BLOCK];
		if (!second) {
			float q = (float)((const int8_t *)codes)[e];
			dst[i] = q * fabsf(q) * (s / 16129.0f);
		} else {
			float q = (float)((const uint8_t *)codes)[e];
			float u = q * q * (s / 65025.0f);
			dst[i] = u * u;
		}
	}
}

/* Encodes whole blocks: first is a block boundary; n covers whole blocks
 * or ends the tensor.  Round to nearest in code space. */
void aoqd_q8_encode(void *codes, float *scales, const float *src, bool second, uint64_t first, size_t n)
{
	for (size_t b = 0; b < n; b += AOQK_Q8_BLOCK) {
		size_t len = n - b < AOQK_Q8_BLOCK ? n - b : AOQK_Q8_BLOCK;
		float mx = 0;
		for (size_t i = 0; i < len; i++) {
			float x = second ? sqrtf(fmaxf(src[b + i], 0.0f)) : fabsf(src[b + i]);
			if (x > mx)
				mx = x;
		}
		uint64_t e0 = first + b;
		scales[e0 / AOQK_Q8_BLOCK] = mx;
		float inv = mx > 0 ? 1.0f / mx : 0.0f;
		for (size_t i = 0; i < len; i++) {
			if (!second) {
				float m = src[b + i];
				float x = nearbyintf(sqrtf(fabsf(m) * inv) * 127.0f);
				((int8_t *)codes)[e0 + i] = (int8_t)(m < 0 ? -x : x);
			} else {
				float u = sqrtf(fmaxf(src[b + i], 0.0f));
				float y = nearbyintf(sqrtf(u * inv) * 255.0f);
				if (y == 0 && u > 0)
					y = 1; /* a non-zero v keeps a non-zero code */
				((uint8_t *)codes)[e0 + i] = (uint8_t)y;
			}
		}
	}
}
