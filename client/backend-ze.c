/* SPDX-License-Identifier: MIT */
/* The Level Zero backend ("xpu:N"): being written (issue 5). */
#include <errno.h>

#include "backend.h"

static int ze_open(struct aoq_backend **out, int index, const struct aoq_options *o)
{
	return aoq_set_error(-ENODEV, "no XPU device: the Level Zero backend is not implemented yet");
}

const struct aoq_backend_ops aoq_backend_ze = { .name = "ze", .open = ze_open };
