// SPDX-License-Identifier: MIT
// Device-side kernels of aoq: casts, parameter pull, int8 weight-only
// per-channel quantisation.  See aoq-cuda-kernels.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <math.h>

#include "../aoq-convert.h"
#include "../aoq-kernel.h"
#include "aoq-cuda-kernels.h"

namespace {

constexpr int kThreads = 256;

unsigned grid_for(size_t n, size_t per_block)
{
	size_t g = (n + per_block - 1) / per_block;
	if (g > 65535u * 16u)
		g = 65535u * 16u; // grid-stride loops cover the rest
	return g ? (unsigned)g : 1u;
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }

// Four elements per thread through 16-byte loads when src is aligned, a
// scalar loop otherwise and for the tail.
template <typename T>
__global__ void cast_from_f32_kernel(T *__restrict__ dst, const float *__restrict__ src, size_t n)
{
	size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
	size_t stride = (size_t)gridDim.x * blockDim.x;
	bool vec = ((uintptr_t)src % 16) == 0;
	size_t n4 = vec ? n / 4 : 0;
	for (size_t i = tid; i < n4; i += stride) {
		float4 v = reinterpret_cast<const float4 *>(src)[i];
		dst[4 * i + 0] = from_f32<T>(v.x);
		dst[4 * i + 1] = from_f32<T>(v.y);
		dst[4 * i + 2] = from_f32<T>(v.z);
		dst[4 * i + 3] = from_f32<T>(v.w);
	}
	for (size_t i = 4 * n4 + tid; i < n; i += stride)
		dst[i] = from_f32<T>(src[i]);
}

template <typename T>
__global__ void cast_to_f32_kernel(float *__restrict__ dst, const T *__restrict__ src, size_t n)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride)
		dst[i] = to_f32<T>(src[i]);
}

// One block per row: absmax reduction, then quantise.
__global__ void quantize_rows_kernel(int8_t *__restrict__ q, float *__restrict__ scales,
                                     const float *__restrict__ w, size_t rows, size_t cols)
{
	__shared__ float red[kThreads / 32];
	for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
		const float *row = w + r * cols;
		float m = 0.0f;
		for (size_t j = threadIdx.x; j < cols; j += blockDim.x)
			m = fmaxf(m, fabsf(row[j]));
		for (int o = 16; o > 0; o >>= 1)
			m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
		if ((threadIdx.x & 31) == 0)
			red[threadIdx.x / 32] = m;
		__syncthreads();
		if (threadIdx.x < 32) {
			m = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.0f;
			for (int o = 16; o > 0; o >>= 1)
				m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
			if (threadIdx.x == 0)
				red[0] = m;
		}
		__syncthreads();
		float s = red[0] > 0.0f ? red[0] / 127.0f : 1.0f;
		if (threadIdx.x == 0)
			scales[r] = s;
		int8_t *qr = q + r * cols;
		for (size_t j = threadIdx.x; j < cols; j += blockDim.x) {
			float v = rintf(row[j] / s);
			v = fminf(fmaxf(v, -127.0f), 127.0f);
			qr[j] = (int8_t)v;
		}
		__syncthreads(); // red[] is reused by the next row
	}
}

// ---- Adam/AdamW with q8 moments (aoq-cuda-kernels.h) ----
//
// One warp per q8 block (AOQK_Q8_BLOCK = 256 elements, 8 per lane): decode
// m and sqrt(v), update as aoqd's kernels do (kernels/cpu/kernel-body.h,
// vstep: torch's lerp and addcmul roundings, den = fma(sqrt(v), 1 /
// sqrt(bc2), eps)), take the block's max |m| and max sqrt(v) with warp
// shuffles (no shared memory, no block barrier), encode with 8 random bits
// at the top of the discarded ones.  Whole blocks of 16-byte aligned
// tensors move in 16-byte loads and stores (kVec); the last, partial block
// and unaligned tensors element by element.
static_assert(AOQK_Q8_BLOCK == 256, "a warp of 32 lanes, 8 elements each");
constexpr int kQ8PerLane = 8;

struct Q8Codes {
	float m_k, m_top, u_k, u_top; // aoq-convert.h's K and TOP
};

template <typename T> __device__ __forceinline__ float load_f32(const T *p, size_t i) { return to_f32<T>(p[i]); }
template <> __device__ __forceinline__ float load_f32<float>(const float *p, size_t i) { return p[i]; }
template <typename T> __device__ __forceinline__ void store_f32(T *p, size_t i, float x) { p[i] = from_f32<T>(x); }
template <> __device__ __forceinline__ void store_f32<float>(float *p, size_t i, float x) { p[i] = x; }

// 8 elements from/to 16-byte aligned memory
__device__ __forceinline__ void load8(const float *p, float *x)
{
	float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
	x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
template <typename H> __device__ __forceinline__ void load8(const H *p, float *x)
{
	uint4 u = *reinterpret_cast<const uint4 *>(p);
	const H *h = reinterpret_cast<const H *>(&u);
	for (int j = 0; j < 8; j++)
		x[j] = to_f32<H>(h[j]);
}
__device__ __forceinline__ void store8(float *p, const float *x)
{
	reinterpret_cast<float4 *>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
	reinterpret_cast<float4 *>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
}
template <typename H> __device__ __forceinline__ void store8(H *p, const float *x)
{
	uint4 u;
	H *h = reinterpret_cast<H *>(&u);
	for (int j = 0; j < 8; j++)
		h[j] = from_f32<H>(x[j]);
	*reinterpret_cast<uint4 *>(p) = u;
}

// aoqk_q8_inv: top / s, 0 for an empty block, FLT_MAX where it overflows
__device__ __forceinline__ float q8_inv(float top, float s)
{
	float q = __fdiv_rn(top, s);
	return s > 0.0f ? fminf(q, 3.40282347e38f) : 0.0f;
}

// The split master: an fp32 master whose high half is the bf16 parameter
// (its rounding to nearest even) and whose low 16 bits are kept apart.  The
// high half is the parameter, or the parameter less one where the low half
// is above one half (the rounding went up); a low half of exactly one half
// (0x8000) would leave that open, so split() never stores one: it moves
// such a master one fp32 ulp (toward the side the rounding took, so the
// parameter stays its rounding).
__device__ __forceinline__ float join_master(uint32_t pb, uint32_t lo)
{
	return __uint_as_float((pb - (lo > 0x8000u ? 1u : 0u)) << 16 | lo);
}

__device__ __forceinline__ void split_master(float w, uint16_t *pb, uint16_t *lo)
{
	uint32_t b = __float_as_uint(w);
	if ((b & 0x7fffffffu) > 0x7f800000u) { // NaN: a quiet NaN, as aoqk_f32_to_bf16
		*pb = (uint16_t)((b >> 16) | 0x40u);
		*lo = (uint16_t)b;
		return;
	}
	if ((b & 0xffffu) == 0x8000u)
		b = (b >> 16) & 1u ? b + 1u : b - 1u;
	*pb = (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
	*lo = (uint16_t)b;
}

// kSplit: master is NULL, lo the master's low halves, P bf16 (split_master)
template <typename P, typename G, bool kVec, bool kSplit>
__global__ void __launch_bounds__(256) adam_q8_kernel(P *param, const G *__restrict__ grad, float *master,
                                                      uint16_t *lo, uint8_t *__restrict__ mc,
                                                      uint8_t *__restrict__ vc, float *__restrict__ ms,
                                                      float *__restrict__ vs, size_t n, struct aoq_cuda_adam_q8 k,
                                                      Q8Codes q)
{
	const unsigned lane = threadIdx.x & 31u;
	const bool own_param = (void *)param != (void *)master; // an fp32 parameter is its own master
	size_t nblocks = (n + AOQK_Q8_BLOCK - 1) / AOQK_Q8_BLOCK;
	size_t nwarps = ((size_t)gridDim.x * blockDim.x) >> 5;
	for (size_t b = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nblocks; b += nwarps) {
		size_t i0 = b * AOQK_Q8_BLOCK + lane * kQ8PerLane;
		bool full = kVec && (b + 1) * AOQK_Q8_BLOCK <= n;
		float g[kQ8PerLane], w[kQ8PerLane], m[kQ8PerLane], u[kQ8PerLane];
		uint8_t cm[kQ8PerLane], cu[kQ8PerLane];
		uint16_t pb[kQ8PerLane], pl[kQ8PerLane];
		if (full) {
			load8(grad + i0, g);
			if constexpr (kSplit) {
				*reinterpret_cast<uint4 *>(pb) = *reinterpret_cast<const uint4 *>(param + i0);
				*reinterpret_cast<uint4 *>(pl) = *reinterpret_cast<const uint4 *>(lo + i0);
				for (int j = 0; j < kQ8PerLane; j++)
					w[j] = join_master(pb[j], pl[j]);
			} else {
				load8(master + i0, w);
			}
			*reinterpret_cast<uint2 *>(cm) = *reinterpret_cast<const uint2 *>(mc + i0);
			*reinterpret_cast<uint2 *>(cu) = *reinterpret_cast<const uint2 *>(vc + i0);
		} else {
			for (int j = 0; j < kQ8PerLane; j++) {
				bool in = i0 + j < n;
				g[j] = in ? load_f32<G>(grad, i0 + j) : 0.0f;
				if constexpr (kSplit)
					w[j] = in ? join_master(reinterpret_cast<const uint16_t *>(param)[i0 + j], lo[i0 + j])
					          : 0.0f;
				else
					w[j] = in ? master[i0 + j] : 0.0f;
				cm[j] = in ? mc[i0 + j] : 0;
				cu[j] = in ? vc[i0 + j] : 0;
			}
		}
		// the block's scales as aoqk_q8_*_decode applies them: (F(c) - K) * (scale / TOP)
		float sm = __fdiv_rn(ms[b], q.m_top), su = __fdiv_rn(vs[b], q.u_top);
		float mx_m = 0.0f, mx_u = 0.0f;
		for (int j = 0; j < kQ8PerLane; j++) {
			float gj = __fmul_rn(g[j], k.gscale), wj = w[j];
			if (k.l2)
				gj = __fmaf_rn(k.wd, wj, gj);
			if (k.adamw)
				wj = __fmul_rn(wj, k.decay);
			uint32_t c = cm[j];
			float y = __fsub_rn(__uint_as_float(((c & 0x7fu) + AOQK_Q8_M_C0) << AOQK_Q8_M_SHIFT), q.m_k);
			float mj = __fmul_rn(y, sm);
			if (c & 0x80u)
				mj = -mj;
			y = __fsub_rn(__uint_as_float((cu[j] + AOQK_Q8_U_C0) << AOQK_Q8_U_SHIFT), q.u_k);
			float uj = __fmul_rn(y, su);
			float v = __fmul_rn(uj, uj);
			// exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
			float d = __fsub_rn(gj, mj);
			mj = k.lerp_small ? __fmaf_rn(k.w1, d, mj) : __fmaf_rn(-d, k.w1c, gj);
			v = __fmaf_rn(k.w2, __fmul_rn(gj, gj), __fmul_rn(v, k.b2));
			uj = __fsqrt_rn(v);
			float den = __fmaf_rn(uj, k.inv_bc2s, k.eps);
			w[j] = __fmaf_rn(k.nstep, __fdiv_rn(mj, den), wj);
			if (!full && i0 + j >= n)
				mj = uj = 0.0f; // past the end: out of the maxima
			m[j] = mj;
			u[j] = uj;
			mx_m = fmaxf(mx_m, fabsf(mj));
			mx_u = fmaxf(mx_u, uj); // NaN skipped, as the CPU kernels' max
		}
		if constexpr (kSplit) {
			for (int j = 0; j < kQ8PerLane; j++)
				split_master(w[j], &pb[j], &pl[j]);
			if (full) {
				*reinterpret_cast<uint4 *>(param + i0) = *reinterpret_cast<const uint4 *>(pb);
				*reinterpret_cast<uint4 *>(lo + i0) = *reinterpret_cast<const uint4 *>(pl);
			} else {
				for (int j = 0; j < kQ8PerLane && i0 + j < n; j++) {
					reinterpret_cast<uint16_t *>(param)[i0 + j] = pb[j];
					lo[i0 + j] = pl[j];
				}
			}
		} else if (full) {
			store8(master + i0, w);
			if (own_param)
				store8(param + i0, w);
		} else {
			for (int j = 0; j < kQ8PerLane && i0 + j < n; j++) {
				master[i0 + j] = w[j];
				if (own_param)
					store_f32<P>(param, i0 + j, w[j]);
			}
		}
		for (int o = 16; o > 0; o >>= 1) {
			mx_m = fmaxf(mx_m, __shfl_xor_sync(0xffffffffu, mx_m, o));
			mx_u = fmaxf(mx_u, __shfl_xor_sync(0xffffffffu, mx_u, o));
		}
		float inv_m = q8_inv(q.m_top, mx_m), inv_u = q8_inv(q.u_top, mx_u);
		for (int j = 0; j < kQ8PerLane; j++) {
			uint32_t h = aoq_cuda_mix32((uint32_t)(i0 + j) ^ k.key);
			uint32_t rm = ((h >> 8) & 0xffu) << (AOQK_Q8_M_SHIFT - 8) | 1u << (AOQK_Q8_M_SHIFT - 9);
			uint32_t ru = (h & 0xffu) << (AOQK_Q8_U_SHIFT - 8) | 1u << (AOQK_Q8_U_SHIFT - 9);
			uint32_t c = ((__float_as_uint(__fmaf_rn(fabsf(m[j]), inv_m, q.m_k)) + rm) >> AOQK_Q8_M_SHIFT) -
			             AOQK_Q8_M_C0;
			c = c < 127u ? c : 127u;
			cm[j] = (uint8_t)(c | (__float_as_uint(m[j]) >> 31) << 7);
			c = ((__float_as_uint(__fmaf_rn(u[j], inv_u, q.u_k)) + ru) >> AOQK_Q8_U_SHIFT) - AOQK_Q8_U_C0;
			c = c < 255u ? c : 255u;
			if (c == 0 && u[j] > 0.0f)
				c = 1; // a non-zero v keeps a non-zero code
			cu[j] = (uint8_t)c;
		}
		if (full) {
			*reinterpret_cast<uint2 *>(mc + i0) = *reinterpret_cast<const uint2 *>(cm);
			*reinterpret_cast<uint2 *>(vc + i0) = *reinterpret_cast<const uint2 *>(cu);
		} else {
			for (int j = 0; j < kQ8PerLane && i0 + j < n; j++) {
				mc[i0 + j] = cm[j];
				vc[i0 + j] = cu[j];
			}
		}
		if (lane == 0) { // after the shuffles: every lane has read ms[b] and vs[b]
			ms[b] = mx_m;
			vs[b] = mx_u;
		}
	}
}

bool aligned16(const void *p)
{
	return ((uintptr_t)p & 15u) == 0;
}

template <typename P, typename G, bool kSplit>
cudaError_t adam_q8_launch2(P *param, const G *grad, float *master, uint16_t *lo, uint8_t *m, uint8_t *v, float *ms,
                            float *vs, size_t n, const struct aoq_cuda_adam_q8 &k, cudaStream_t stream)
{
	Q8Codes q = { AOQK_Q8_M_K, AOQK_Q8_M_TOP, AOQK_Q8_U_K, AOQK_Q8_U_TOP };
	// 8 warps (q8 blocks) per CUDA block
	unsigned g = grid_for((n + AOQK_Q8_BLOCK - 1) / AOQK_Q8_BLOCK, 8);
	if (k.max_blocks && g > k.max_blocks)
		g = k.max_blocks; // the grid-stride loop covers the rest
	if (aligned16(param) && aligned16(grad) && aligned16(kSplit ? (void *)lo : (void *)master) &&
	    ((uintptr_t)m & 7u) == 0 && ((uintptr_t)v & 7u) == 0)
		adam_q8_kernel<P, G, true, kSplit><<<g, 256, 0, stream>>>(param, grad, master, lo, m, v, ms, vs, n, k, q);
	else
		adam_q8_kernel<P, G, false, kSplit><<<g, 256, 0, stream>>>(param, grad, master, lo, m, v, ms, vs, n, k,
		                                                           q);
	return cudaGetLastError();
}

template <typename P, bool kSplit>
cudaError_t adam_q8_launch(P *param, const void *grad, enum aoq_cuda_dtype gt, float *master, uint16_t *lo,
                           uint8_t *m, uint8_t *v, float *ms, float *vs, size_t n, const struct aoq_cuda_adam_q8 &k,
                           cudaStream_t stream)
{
	switch (gt) {
	case AOQ_CUDA_FP32:
		return adam_q8_launch2<P, float, kSplit>(param, static_cast<const float *>(grad), master, lo, m, v, ms,
		                                         vs, n, k, stream);
	case AOQ_CUDA_BF16:
		return adam_q8_launch2<P, __nv_bfloat16, kSplit>(param, static_cast<const __nv_bfloat16 *>(grad), master,
		                                                 lo, m, v, ms, vs, n, k, stream);
	case AOQ_CUDA_FP16:
		return adam_q8_launch2<P, __half, kSplit>(param, static_cast<const __half *>(grad), master, lo, m, v, ms,
		                                          vs, n, k, stream);
	default:
		return cudaErrorInvalidValue;
	}
}

cudaError_t launched()
{
	return cudaGetLastError();
}

} // namespace

extern "C" cudaError_t aoq_cuda_cast_from_f32(void *dst, enum aoq_cuda_dtype to, const float *src, size_t n,
                                              cudaStream_t stream)
{
	if (n == 0)
		return cudaSuccess;
	unsigned g = grid_for(n, (size_t)kThreads * 4);
	switch (to) {
	case AOQ_CUDA_FP32:
		return cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
	case AOQ_CUDA_BF16:
		cast_from_f32_kernel<<<g, kThreads, 0, stream>>>(static_cast<__nv_bfloat16 *>(dst), src, n);
		return launched();
	case AOQ_CUDA_FP16:
		cast_from_f32_kernel<<<g, kThreads, 0, stream>>>(static_cast<__half *>(dst), src, n);
		return launched();
	}
	return cudaErrorInvalidValue;
}

extern "C" cudaError_t aoq_cuda_cast_to_f32(float *dst, const void *src, enum aoq_cuda_dtype from, size_t n,
                                            cudaStream_t stream)
{
	if (n == 0)
		return cudaSuccess;
	unsigned g = grid_for(n, kThreads);
	switch (from) {
	case AOQ_CUDA_FP32:
		return cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, stream);
	case AOQ_CUDA_BF16:
		cast_to_f32_kernel<<<g, kThreads, 0, stream>>>(dst, static_cast<const __nv_bfloat16 *>(src), n);
		return launched();
	case AOQ_CUDA_FP16:
		cast_to_f32_kernel<<<g, kThreads, 0, stream>>>(dst, static_cast<const __half *>(src), n);
		return launched();
	}
	return cudaErrorInvalidValue;
}

extern "C" cudaError_t aoq_cuda_pull_cast(void *dst, enum aoq_cuda_dtype to, const float *host_master,
                                          float *staging, size_t n, cudaStream_t stream)
{
	if (to == AOQ_CUDA_FP32)
		return cudaMemcpyAsync(dst, host_master, n * sizeof(float), cudaMemcpyHostToDevice, stream);
	if (!staging)
		return cudaErrorInvalidValue;
	cudaError_t e = cudaMemcpyAsync(staging, host_master, n * sizeof(float), cudaMemcpyHostToDevice, stream);
	if (e != cudaSuccess)
		return e;
	return aoq_cuda_cast_from_f32(dst, to, staging, n, stream);
}

extern "C" cudaError_t aoq_cuda_quantize_int8_rows(int8_t *q, float *scales, const float *w, size_t rows,
                                                   size_t cols, cudaStream_t stream)
{
	if (rows == 0 || cols == 0)
		return cudaSuccess;
	unsigned g = rows < 65535u * 16u ? (unsigned)rows : 65535u * 16u;
	quantize_rows_kernel<<<g, kThreads, 0, stream>>>(q, scales, w, rows, cols);
	return launched();
}

extern "C" cudaError_t aoq_cuda_pull_int8(int8_t *q, float *scales, const float *host_master, float *staging,
                                          size_t rows, size_t cols, cudaStream_t stream)
{
	if (!staging)
		return cudaErrorInvalidValue;
	cudaError_t e = cudaMemcpyAsync(staging, host_master, rows * cols * sizeof(float), cudaMemcpyHostToDevice,
	                                stream);
	if (e != cudaSuccess)
		return e;
	return aoq_cuda_quantize_int8_rows(q, scales, staging, rows, cols, stream);
}

extern "C" void aoq_cuda_adam_q8_consts(struct aoq_cuda_adam_q8 *k, double lr, double beta1, double beta2,
                                        double eps, double weight_decay, int decoupled, uint64_t step,
                                        uint64_t seed, float grad_scale)
{
	// as aoqk_consts_init (kernels/cpu/kernel-common.h)
	double bc1 = 1.0 - pow(beta1, (double)step);
	double bc2 = 1.0 - pow(beta2, (double)step);
	k->w1 = (float)(1.0 - beta1);
	k->w1c = 1.0f - k->w1;
	k->b2 = (float)beta2;
	k->w2 = (float)(1.0 - beta2);
	k->nstep = (float)(-(lr / bc1));
	k->inv_bc2s = (float)(1.0 / sqrt(bc2));
	k->eps = (float)eps;
	k->decay = (float)(1.0 - lr * weight_decay);
	k->wd = (float)weight_decay;
	k->gscale = grad_scale;
	k->lerp_small = fabsf(k->w1) < 0.5f;
	k->adamw = decoupled && weight_decay != 0.0;
	k->l2 = !decoupled && weight_decay != 0.0;
	k->key = aoq_cuda_q8_key(seed, step);
	k->max_blocks = 0;
}

extern "C" cudaError_t aoq_cuda_adam_q8_step(void *param, enum aoq_cuda_dtype pt, const void *grad,
                                             enum aoq_cuda_dtype gt, float *master, uint16_t *master_lo,
                                             uint8_t *m, uint8_t *v, float *m_scale, float *v_scale, size_t n,
                                             const struct aoq_cuda_adam_q8 *k, cudaStream_t stream)
{
	if (n == 0)
		return cudaSuccess;
	if (!master == !master_lo || (master_lo && pt != AOQ_CUDA_BF16))
		return cudaErrorInvalidValue; // one master: fp32, or the low halves beside a bf16 parameter
	if (master_lo)
		return adam_q8_launch<__nv_bfloat16, true>(static_cast<__nv_bfloat16 *>(param), grad, gt, nullptr,
		                                           master_lo, m, v, m_scale, v_scale, n, *k, stream);
	switch (pt) {
	case AOQ_CUDA_FP32:
		return adam_q8_launch<float, false>(static_cast<float *>(param), grad, gt, master, nullptr, m, v, m_scale,
		                                    v_scale, n, *k, stream);
	case AOQ_CUDA_BF16:
		return adam_q8_launch<__nv_bfloat16, false>(static_cast<__nv_bfloat16 *>(param), grad, gt, master,
		                                            nullptr, m, v, m_scale, v_scale, n, *k, stream);
	case AOQ_CUDA_FP16:
		return adam_q8_launch<__half, false>(static_cast<__half *>(param), grad, gt, master, nullptr, m, v,
		                                     m_scale, v_scale, n, *k, stream);
	}
	return cudaErrorInvalidValue;
}
