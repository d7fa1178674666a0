/* SPDX-License-Identifier: MIT */
/* The device string to its backend (aoq_backend_lookup); dtype names. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

const char *aoq_dtype_name(enum aoq_dtype t)
{
	switch (t) {
	case AOQ_FP32: return "fp32";
	case AOQ_BF16: return "bf16";
	case AOQ_FP16: return "fp16";
	}
	return "?";
}

int aoq_backend_lookup(const char *device, const struct aoq_backend_ops **ops, int *index)
{
	if (!device || strcmp(device, "cpu") == 0) {
		*ops = &aoq_backend_host;
		*index = 0;
		return 0;
	}
	const char *num;
	if (strncmp(device, "cuda", 4) == 0) {
		*ops = &aoq_backend_cuda;
		num = device + 4;
	} else if (strncmp(device, "xpu", 3) == 0) {
		*ops = &aoq_backend_ze;
		num = device + 3;
	} else {
		return aoq_set_error(-EINVAL, "unknown device '%s' (cpu, cuda:N or xpu:N)", device);
	}
	if (*num == '\0') {
		*index = 0;
		return 0;
	}
	char *end;
	long v = *num == ':' ? strtol(num + 1, &end, 10) : -1;
	if (*num != ':' || end == num + 1 || *end || v < 0 || v > 1024)
		return aoq_set_error(-EINVAL, "bad device index in '%s'", device);
	*index = (int)v;
	return 0;
}
