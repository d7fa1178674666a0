/* SPDX-License-Identifier: MIT */
/*
 * aoq_device_adam_q8 (<aoq/aoq.h>): one Adam/AdamW step of a tensor whose
 * fp32 master and q8 moments stay on the device, for aoq.torch's GPU share.
 * The arguments come from the caller's process, but its pointers are the
 * caller's own device memory: what is checked here is what would make the
 * launch itself wrong (sizes, dtypes, hyperparameters).
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>

#include <cuda_runtime_api.h>

#include "aoq-cuda-kernels.h"
#include "backend.h"

static int dtype_ok(enum aoq_dtype t)
{
	return t == AOQ_FP32 || t == AOQ_BF16 || t == AOQ_FP16;
}

int aoq_device_adam_q8(const struct aoq_device_step *s, void *cuda_stream)
{
	/* the struct as it was before max_blocks is still taken */
	const size_t min_size = offsetof(struct aoq_device_step, max_blocks);
	if (!s || s->size < min_size)
		return aoq_set_error(-EINVAL, "aoq_device_adam_q8: struct aoq_device_step of %u bytes, want %zu "
		                     "(%zu without max_blocks)", s ? s->size : 0u, sizeof(*s), min_size);
	unsigned max_blocks = s->size >= sizeof(*s) ? s->max_blocks : 0;
	if (s->n == 0)
		return 0;
	if (!s->param || !s->grad || !s->m || !s->v || !s->m_scale || !s->v_scale || s->device < 0)
		return aoq_set_error(-EINVAL, "aoq_device_adam_q8: a NULL buffer or a negative device");
	if (!s->master == !s->master_lo || (s->master_lo && s->param_dtype != AOQ_BF16))
		return aoq_set_error(-EINVAL, "aoq_device_adam_q8: one master: master, or master_lo beside a bf16 "
		                     "parameter");
	if (!dtype_ok(s->param_dtype) || !dtype_ok(s->grad_dtype))
		return aoq_set_error(-EINVAL, "aoq_device_adam_q8: unknown dtype (param %d, grad %d)",
		                     (int)s->param_dtype, (int)s->grad_dtype);
	if (s->step == 0 || !(s->lr >= 0) || !(s->beta1 >= 0 && s->beta1 < 1) || !(s->beta2 >= 0 && s->beta2 < 1) ||
	    !(s->eps >= 0) || !isfinite(s->lr) || !isfinite(s->eps) || !isfinite(s->weight_decay) ||
	    !isfinite(s->grad_scale))
		return aoq_set_error(-EINVAL, "aoq_device_adam_q8: bad hyperparameters (step %llu, lr %g, betas %g %g, "
		                     "eps %g, weight_decay %g)", (unsigned long long)s->step, s->lr, s->beta1,
		                     s->beta2, s->eps, s->weight_decay);

	int prev = -1;
	if (cudaGetDevice(&prev) != cudaSuccess)
		prev = -1;
	cudaError_t e = prev == s->device ? cudaSuccess : cudaSetDevice(s->device);
	if (e == cudaSuccess) {
		struct aoq_cuda_adam_q8 k;
		aoq_cuda_adam_q8_consts(&k, s->lr, s->beta1, s->beta2, s->eps, s->weight_decay, s->decoupled, s->step,
		                        s->seed, s->grad_scale);
		k.max_blocks = max_blocks;
		e = aoq_cuda_adam_q8_step(s->param, (enum aoq_cuda_dtype)s->param_dtype, s->grad,
		                          (enum aoq_cuda_dtype)s->grad_dtype, s->master, s->master_lo, s->m, s->v,
		                          s->m_scale, s->v_scale, s->n, &k, (cudaStream_t)cuda_stream);
	}
	if (prev >= 0 && prev != s->device)
		cudaSetDevice(prev);
	if (e != cudaSuccess)
		return aoq_set_error(e == cudaErrorInvalidValue ? -EINVAL : e == cudaErrorInvalidDevice ? -ENODEV : -EIO,
		                     "aoq_device_adam_q8: CUDA: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
	return 0;
}
