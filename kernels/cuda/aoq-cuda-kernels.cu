// SPDX-License-Identifier: MIT
// Device-side kernels of aoq: casts, parameter pull, int8 weight-only
// per-channel quantisation.  See aoq-cuda-kernels.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
