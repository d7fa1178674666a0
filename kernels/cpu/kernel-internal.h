/* SPDX-License-Identifier: MIT */
/*
 * For the kernels' own tests and benchmark: every table compiled in, the
 * "-cached" twins (plain parameter stores) included, whether or not this CPU runs it.
 */
#ifndef AOQK_KERNEL_INTERNAL_H
#define AOQK_KERNEL_INTERNAL_H

#include <stdbool.h>

#include "aoq-kernel.h"

struct aoqk_variant {
	const struct aoqk_kernel *kernel;
	bool runnable; /* this CPU and OS run it */
};

/* Every table compiled in (default and "-cached"), best first; *n gets the count. */
const struct aoqk_variant *aoqk_variants(size_t *n);

#endif
