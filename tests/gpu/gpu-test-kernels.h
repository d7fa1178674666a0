/* SPDX-License-Identifier: MIT */
/* CUDA kernels of the GPU tests (gpu-test-kernels.cu), C interface.  All
 * enqueue on `s` and return the launch error. */
#ifndef AOQ_GPU_TEST_KERNELS_H
#define AOQ_GPU_TEST_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The race model: x [32 x ldx] fp32, W1 split in blocks [kb x 64] bf16,
 * W2 [64 x 64] fp32, loss 0.5/32 |(x W1) W2 - y|^2.  Every reduction has a
 * fixed order, so results are bitwise reproducible. */
#define RACE_M 32
#define RACE_N 64
/* hpart [32 x 64] = x[:, k0:k0+kb] W1b */
cudaError_t race_fwd_part(float *hpart, const float *x, size_t ldx, size_t k0, const uint16_t *w1b, size_t kb,
                          cudaStream_t s);
/* h = sum over nb parts (in order); e = (h W2 - y) / 32; dW2 = h^T e;
 * d = e W2^T. */
cudaError_t race_head(float *h, float *e, float *d, float *dw2, const float *hparts, size_t nb, const float *w2,
                      const float *y, cudaStream_t s);
/* g [kb x 64] = x[:, k0:k0+kb]^T d */
cudaError_t race_dw1(float *g, const float *x, size_t ldx, size_t k0, size_t kb, const float *d, cudaStream_t s);

/* Busy GPU work for `ns` nanoseconds (one block, %globaltimer). */
cudaError_t spin_ns(uint64_t ns, cudaStream_t s);
/* buf[i] = bf16 of a small deterministic value of (i, seed). */
cudaError_t fill_bf16(uint16_t *buf, size_t n, uint32_t seed, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
