/* SPDX-License-Identifier: MIT */
/* Random split masters for the state round-trip tests (test-snapshot.c,
 * test-fdstore.c). */
#ifndef AOQ_TEST_SPLIT_FILL_H
#define AOQ_TEST_SPLIT_FILL_H

#include "state.h"

/* A split master (q8 or q4 beside a bf16 parameter) holds the split of
 * some fp32 value: random bits, a NaN as the one quiet NaN (the split of
 * a NaN's payload does not come back alike); a 24-bit one (master_lo8),
 * of such a value with its low byte zero.  Nothing for a master that is
 * not split. */
static inline void fill_split_master(struct aoqd_tensor *t, uint64_t (*rnd)(void))
{
	for (size_t e = 0; aoqd_tensor_lo(t) && e < t->numel; e++) {
		uint32_t b = (uint32_t)rnd();
		if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x7fffffu))
			b = 0x7fc00000u;
		if (t->st.master_lo)
			aoqk_split(b, (uint16_t *)t->st.master + e, (uint16_t *)t->st.master_lo + e);
		else
			aoqk_split8(b & ~0xffu, (uint16_t *)t->st.master + e, (int8_t *)t->st.master_lo8 + e);
	}
}

#endif
