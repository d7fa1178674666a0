/* SPDX-License-Identifier: MIT */
/* Array conversions for state transfer, on the element conversions of
 * kernels/aoq-convert.h (the kernels' own). */
#include <math.h>
#include <string.h>

#include "aoq-convert.h"
#include "convert.h"

void aoqd_to_f32(float *dst, const void *src, enum aoqk_dtype t, size_t n)
{
	const uint16_t *h = src;
	switch (t) {
	case AOQK_FP32:
		memcpy(dst, src, n * 4);
		break;
	case AOQK_BF16:
		for (size_t i = 0; i < n; i++)
			dst[i] = aoqk_bf16_to_f32(h[i]);
		break;
	case AOQK_FP16:
		for (size_t i = 0; i < n; i++)
			dst[i] = aoqk_f16_to_f32(h[i]);
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
			h[i] = aoqk_f32_to_bf16(src[i]);
		break;
	case AOQK_FP16:
		for (size_t i = 0; i < n; i++)
			h[i] = aoqk_f32_to_f16(src[i]);
		break;
	}
}

void aoqd_q8_decode(float *dst, const void *codes, const float *scales, bool second, uint64_t first, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint64_t e = first + i;
		float s = scales[e / AOQK_Q8_BLOCK];
		dst[i] = second ? aoqk_q8_v_decode(((const uint8_t *)codes)[e], s)
		                : aoqk_q8_m_decode(((const uint8_t *)codes)[e], s);
	}
}

/* A block's scale: the largest |m|, or the largest sqrt(v) (second). */
static float block_max(const float *src, size_t len, bool second)
{
	float mx = 0;
	for (size_t i = 0; i < len; i++) {
		float x = second ? sqrtf(fmaxf(src[i], 0.0f)) : fabsf(src[i]);
		if (x > mx)
			mx = x;
	}
	return mx;
}

/* Encodes whole blocks: first is a block boundary; n covers whole blocks
 * or ends the tensor.  Round to nearest in code space. */
void aoqd_q8_encode(void *codes, float *scales, const float *src, bool second, uint64_t first, size_t n)
{
	for (size_t b = 0; b < n; b += AOQK_Q8_BLOCK) {
		size_t len = n - b < AOQK_Q8_BLOCK ? n - b : AOQK_Q8_BLOCK;
		float mx = block_max(src + b, len, second);
		uint64_t e0 = first + b;
		scales[e0 / AOQK_Q8_BLOCK] = mx;
		float inv = aoqk_q8_inv(second ? AOQK_Q8_U_TOP : AOQK_Q8_M_TOP, mx);
		for (size_t i = 0; i < len; i++) {
			if (!second)
				((uint8_t *)codes)[e0 + i] = aoqk_q8_m_encode(src[b + i], inv);
			else
				((uint8_t *)codes)[e0 + i] = aoqk_q8_v_encode(src[b + i], inv);
		}
	}
}

void aoqd_q4_decode(float *dst, const void *codes, const float *scales, bool second, uint64_t first, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint64_t e = first + i;
		float s = scales[e / AOQK_Q4_BLOCK];
		unsigned c = aoqk_q4_get(codes, e);
		dst[i] = second ? aoqk_q4_v_decode(c, s) : aoqk_q4_m_decode(c, s);
	}
}

void aoqd_q4_encode(void *codes, float *scales, const float *src, bool second, uint64_t first, size_t n,
                    uint64_t numel)
{
	for (size_t b = 0; b < n; b += AOQK_Q4_BLOCK) {
		size_t len = n - b < AOQK_Q4_BLOCK ? n - b : AOQK_Q4_BLOCK;
		float mx = block_max(src + b, len, second);
		uint64_t e0 = first + b;
		scales[e0 / AOQK_Q4_BLOCK] = mx;
		float inv = aoqk_q8_inv(second ? AOQK_Q4_U_TOP : AOQK_Q4_M_TOP, mx);
		for (size_t i = 0; i < len; i++)
			aoqk_q4_put(codes, e0 + i, second ? aoqk_q4_v_encode(src[b + i], inv)
			                                  : aoqk_q4_m_encode(src[b + i], inv));
	}
	/* the last group's codes past the tensor's end: 0, as the kernels
	 * write them */
	if (first + n == numel)
		for (uint64_t e = numel; e % AOQK_Q4_GROUP; e++)
			aoqk_q4_put(codes, e, 0);
}

void aoqd_master_join(void *dst, const uint16_t *hi, const void *lo, unsigned lo_size, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint32_t b = lo_size == 1 ? aoqk_split8_join(hi[i], ((const int8_t *)lo)[i])
		                          : aoqk_split_join(hi[i], ((const uint16_t *)lo)[i]);
		memcpy((uint8_t *)dst + 4 * i, &b, 4);
	}
}

void aoqd_master_split(uint16_t *hi, void *lo, unsigned lo_size, const void *src, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint32_t b;
		memcpy(&b, (const uint8_t *)src + 4 * i, 4);
		if (lo_size == 2) {
			aoqk_split(b, &hi[i], &((uint16_t *)lo)[i]);
			continue;
		}
		/* 24 bits: first to nearest even (the largest finite values
		 * round to inf, as IEEE rounding does); a NaN as it is */
		if ((b & 0x7f800000u) != 0x7f800000u || !(b & 0x7fffffu))
			b = (b + 0x7fu + ((b >> 8) & 1u)) & ~0xffu;
		aoqk_split8(b, &hi[i], &((int8_t *)lo)[i]);
	}
}
