/* SPDX-License-Identifier: MIT */
/* Stand-ins for the device backends this build does not have. */
#include <errno.h>

#include "aoq-config.h"
#include "backend.h"

#ifndef AOQ_WITH_CUDA_BACKEND
static int cuda_open(struct aoq_backend **out, int index, const struct aoq_options *o)
{
	return aoq_set_error(-ENODEV, "no CUDA device: this libaoq was built without CUDA");
}
const struct aoq_backend_ops aoq_backend_cuda = { .name = "cuda", .open = cuda_open };

int aoq_device_adam_q8(const struct aoq_device_step *s, void *cuda_stream)
{
	(void)s;
	(void)cuda_stream;
	return aoq_set_error(-ENOTSUP, "aoq_device_adam_q8: this libaoq was built without CUDA");
}
#endif

#ifndef AOQ_WITH_ZE_BACKEND
static int ze_open(struct aoq_backend **out, int index, const struct aoq_options *o)
{
	return aoq_set_error(-ENODEV, "no XPU device: this libaoq was built without Level Zero");
}
const struct aoq_backend_ops aoq_backend_ze = { .name = "ze", .open = ze_open };

const char *aoq_ze_staging_mode(void)
{
	return "none";
}
#endif
