/* SPDX-License-Identifier: MIT */
/* Kernels of tests/bench/bench-cuda.c: a fallback bf16 GEMM (used when
 * cuBLAS cannot be loaded), a fused AdamW for the on-GPU baseline, and a
 * random bf16 fill.  All enqueue on `s` and return the launch error. */
#ifndef AOQ_BENCH_CUDA_KERNELS_H
#define AOQ_BENCH_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Row-major C[M x N] = op(A) op(B), bf16 in and out, fp32 accumulation.
 * op(A) is M x K (A stored K x M when ta), op(B) is K x N (B stored N x K
 * when tb).  M, N, K multiples of 64.  Tensor cores through WMMA. */
cudaError_t bench_gemm_bf16(int ta, int tb, int M, int N, int K, const uint16_t *A, const uint16_t *B, uint16_t *C,
                            cudaStream_t s);

/* AdamW on n elements: bf16 grad in, fp32 master/m/v, bf16 param out.
 * bc1 = 1 - beta1^k, bc2 = 1 - beta2^k. */
cudaError_t bench_adamw(uint16_t *param, float *master, float *m, float *v, const uint16_t *grad, size_t n, float lr,
                        float beta1, float beta2, float eps, float wd, float bc1, float bc2, cudaStream_t s);

/* buf[i] = bf16(scale * uniform(-1, 1)), hash of (i, seed); master (when
 * non-NULL) gets the same values in fp32. */
cudaError_t bench_fill(uint16_t *buf, float *master, size_t n, float scale, uint32_t seed, cudaStream_t s);

#ifdef __cplusplus
}
#endif

#endif
