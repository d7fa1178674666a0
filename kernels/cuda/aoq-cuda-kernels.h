/* SPDX-License-Identifier: MIT */
/*
 * Device-side kernels of aoq (casts, quantization), C interface.  Built by nvcc
 * for sm_90 with a compute_90 PTX fallback (client/cuda/meson.build).
 *
 * - Gradient cast before D2H: fp32 -> bf16 (or fp16) on the device, round
 *   to nearest even, so an fp32 or AMP gradient crosses PCIe in 2 bytes per
 *   element; push the bf16 buffer as a tensor registered with grad_dtype
 *   AOQ_BF16.
 * - Parameter pull: (re)materialise a device parameter from the daemon's
 *   fp32 master one tensor at a time: copy the fp32 master (host, ideally
 *   pinned: the arena, or aoq_read_state() into pinned memory) into a
 *   device staging buffer the size of the largest tensor, then cast on the
 *   device to bf16/fp16 (or fp32 copy), or quantise to int8 weight-only
 *   per output channel.  Peak device memory is then the model in its
 *   device dtype plus one fp32 staging tensor.
 *
 * int8 weight-only, per channel (torchao's int8 weight-only layout): for a
 * weight of `rows` output channels by `cols` inputs (row-major), the scale
 * of row r is s_r = max_j |w_rj| / 127 (1 when the row is all zeros), and
 * q_rj = clamp(rint(w_rj / s_r), -127, 127), rint rounding half to even;
 * dequantised w'_rj = q_rj * s_r.  Scales are fp32.  Non-finite weights
 * give an unspecified row (the caller's trainer has already failed).
 *
 * Every function enqueues on `stream` (NULL: the legacy default stream),
 * returns without waiting, and returns cudaSuccess or the launch error.
 * Element counts may be any size (no alignment needed).
 */
#ifndef AOQ_CUDA_KERNELS_H
#define AOQ_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dtypes, same values as enum aoq_dtype */
enum aoq_cuda_dtype {
	AOQ_CUDA_FP32 = 0,
	AOQ_CUDA_BF16 = 1,
	AOQ_CUDA_FP16 = 2,
};

/* dst[i] = round_to_nearest_even(src[i]) in dtype `to` (bf16/fp16/fp32). */
cudaError_t aoq_cuda_cast_from_f32(void *dst, enum aoq_cuda_dtype to, const float *src, size_t n,
                                   cudaStream_t stream);
/* dst[i] = (float)src[i]: bf16/fp16/fp32 to fp32 (exact). */
cudaError_t aoq_cuda_cast_to_f32(float *dst, const void *src, enum aoq_cuda_dtype from, size_t n,
                                 cudaStream_t stream);

/* Pull: H2D of host_master (n fp32) into staging (device, >= n floats),
 * then cast into dst (device, dtype `to`).  For `to` == fp32 the copy goes
 * straight into dst and staging may be NULL. */
cudaError_t aoq_cuda_pull_cast(void *dst, enum aoq_cuda_dtype to, const float *host_master, float *staging,
                               size_t n, cudaStream_t stream);

/* Per-channel int8 quantisation of a device fp32 weight [rows x cols]. */
cudaError_t aoq_cuda_quantize_int8_rows(int8_t *q, float *scales, const float *w, size_t rows, size_t cols,
                                        cudaStream_t stream);
/* Pull + quantise: H2D of host_master into staging, then quantise. */
cudaError_t aoq_cuda_pull_int8(int8_t *q, float *scales, const float *host_master, float *staging, size_t rows,
                               size_t cols, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
