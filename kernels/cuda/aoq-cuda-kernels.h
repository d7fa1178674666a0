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
 * - Adam/AdamW with q8 moments on the device (aoq.torch's GPU share): one
 *   step of a tensor whose fp32 master and q8 moments stay on the device,
 *   in aoqd's q8 format (kernels/README.md, "q8 moments": blocks of
 *   AOQK_Q8_BLOCK elements, a scale per block, stochastic rounding in code
 *   space), so the share costs 6 bytes per parameter instead of fp32
 *   moments' 12.  The random bits are aoq_cuda_q8_bits() below, which the
 *   Python binding's reference step (aoq/_q8.py) computes alike.
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

/* The constants of one q8 step, computed on the host from the
 * hyperparameters as aoqd's kernels do (aoq_cuda_adam_q8_consts). */
struct aoq_cuda_adam_q8 {
	float w1, w1c, b2, w2, nstep, inv_bc2s, eps, decay, wd, gscale;
	int lerp_small, adamw, l2;
	uint32_t key; /* the step's random key: aoq_cuda_q8_key(seed, step) */
	unsigned max_blocks; /* the launch's grid at most (0: as the tensor needs; the consts leave 0) */
};

/* Fills k from the hyperparameters (step counts from 1; decoupled: AdamW). */
void aoq_cuda_adam_q8_consts(struct aoq_cuda_adam_q8 *k, double lr, double beta1, double beta2, double eps,
                             double weight_decay, int decoupled, uint64_t step, uint64_t seed, float grad_scale);

/* Host and device (the kernel draws element i's bits with it) */
#ifdef __CUDACC__
#define AOQ_CUDA_HD __host__ __device__
#else
#define AOQ_CUDA_HD
#endif

/* The 32-bit mix of the random bits (Wellons' "lowbias32"), the step's key
 * and element i's bits: bits 0..7 round its v code, bits 8..15 its m code. */
static inline AOQ_CUDA_HD uint32_t aoq_cuda_mix32(uint32_t x)
{
	x ^= x >> 16;
	x *= 0x7feb352du;
	x ^= x >> 15;
	x *= 0x846ca68bu;
	x ^= x >> 16;
	return x;
}

static inline uint32_t aoq_cuda_q8_key(uint64_t seed, uint64_t step)
{
	return aoq_cuda_mix32((uint32_t)seed ^ aoq_cuda_mix32((uint32_t)(seed >> 32) ^ aoq_cuda_mix32((uint32_t)step)));
}

/* One step of n elements: param (dtype `pt`, written from the new master,
 * round to nearest even), grad (dtype `gt`, read), the fp32 master (read
 * and written), m and v codes (n bytes each), m_scale and v_scale (one
 * float per AOQK_Q8_BLOCK elements), all device memory of one tensor.  The
 * master is either `master` (n floats; param itself for an fp32 parameter)
 * or, with master NULL and a bf16 parameter, split: master_lo holds its low
 * 16 bits, the parameter its high half rounded to nearest (n uint16_t; 2
 * bytes per parameter instead of 4; a master whose low half would be
 * exactly 0x8000 moves one fp32 ulp, so the parameter stays its rounding
 * and the pair stays unambiguous). */
cudaError_t aoq_cuda_adam_q8_step(void *param, enum aoq_cuda_dtype pt, const void *grad, enum aoq_cuda_dtype gt,
                                  float *master, uint16_t *master_lo, uint8_t *m, uint8_t *v, float *m_scale,
                                  float *v_scale, size_t n, const struct aoq_cuda_adam_q8 *k, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
