/* SPDX-License-Identifier: MIT */
/* Element conversions for state transfer (load/read), off the step path. */
#ifndef AOQD_CONVERT_H
#define AOQD_CONVERT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "aoq-kernel.h"

/* The element conversions are kernels/aoq-convert.h's. */

/* dst[i] = (float)src[i] */
void aoqd_to_f32(float *dst, const void *src, enum aoqk_dtype t, size_t n);
/* dst[i] = src[i] rounded to t */
void aoqd_from_f32(void *dst, enum aoqk_dtype t, const float *src, size_t n);

/* A split master: n fp32 values (bit patterns, any alignment) from their
 * halves, and back, by the low half's bytes per element: 2, master_lo
 * (aoqk_split_join, aoqk_split); 1, the 24-bit master's master_lo8
 * (aoqk_split8_join, aoqk_split8), whose split first rounds each value to
 * 24 bits, to nearest even.  lo points at the first element's low half. */
void aoqd_master_join(void *dst, const uint16_t *hi, const void *lo, unsigned lo_size, size_t n);
void aoqd_master_split(uint16_t *hi, void *lo, unsigned lo_size, const void *src, size_t n);

/* q8 moments (kernels/README.md): `second` selects v (unsigned codes of
 * sqrt(v)) instead of m.  first is the element index of dst[0]/src[0]. */
void aoqd_q8_decode(float *dst, const void *codes, const float *scales, bool second, uint64_t first, size_t n);
void aoqd_q8_encode(void *codes, float *scales, const float *src, bool second, uint64_t first, size_t n);

/* q4 moments, the same way (kernels/README.md, "q4 moments"); first is a
 * block boundary for the encode, and numel the tensor's length (the
 * codes past it in its last group are set to 0). */
void aoqd_q4_decode(float *dst, const void *codes, const float *scales, bool second, uint64_t first, size_t n);
void aoqd_q4_encode(void *codes, float *scales, const float *src, bool second, uint64_t first, size_t n,
                    uint64_t numel);

#endif
