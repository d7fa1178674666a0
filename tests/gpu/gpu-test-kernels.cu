// SPDX-License-Identifier: MIT
// Kernels of the GPU tests.  See gpu-test-kernels.h.
#include <cuda_bf16.h>

#include "gpu-test-kernels.h"

namespace {

__device__ __forceinline__ float bf(uint16_t b)
{
	return __uint_as_float((uint32_t)b << 16);
}

// One block per row i; 256 threads = 64 columns x 4 lanes over k.
__global__ void fwd_part_kernel(float *hpart, const float *x, size_t ldx, size_t k0, const uint16_t *w, size_t kb)
{
	__shared__ float acc[4][RACE_N];
	int i = blockIdx.x, j = threadIdx.x % RACE_N, lane = threadIdx.x / RACE_N;
	const float *xr = x + (size_t)i * ldx + k0;
	float a = 0.0f;
	for (size_t k = (size_t)lane; k < kb; k += 4)
		a = fmaf(xr[k], bf(w[k * RACE_N + j]), a);
	acc[lane][j] = a;
	__syncthreads();
	if (lane == 0)
		hpart[i * RACE_N + j] = ((acc[0][j] + acc[1][j]) + acc[2][j]) + acc[3][j];
}

__global__ void sum_parts_kernel(float *h, const float *hparts, size_t nb)
{
	int t = blockIdx.x * blockDim.x + threadIdx.x;
	if (t >= RACE_M * RACE_N)
		return;
	float a = 0.0f;
	for (size_t b = 0; b < nb; b++)
		a += hparts[b * RACE_M * RACE_N + t];
	h[t] = a;
}

__global__ void err_kernel(float *e, const float *h, const float *w2, const float *y)
{
	int t = blockIdx.x * blockDim.x + threadIdx.x;
	if (t >= RACE_M * RACE_N)
		return;
	int i = t / RACE_N, j = t % RACE_N;
	float a = 0.0f;
	for (int k = 0; k < RACE_N; k++)
		a = fmaf(h[i * RACE_N + k], w2[k * RACE_N + j], a);
	e[t] = (a - y[t]) * (1.0f / RACE_M);
}

__global__ void back_head_kernel(float *dw2, float *d, const float *h, const float *e, const float *w2)
{
	int t = blockIdx.x * blockDim.x + threadIdx.x;
	if (t < RACE_N * RACE_N) { // dW2[a][j] = sum_i h[i][a] e[i][j]
		int a = t / RACE_N, j = t % RACE_N;
		float s = 0.0f;
		for (int i = 0; i < RACE_M; i++)
			s = fmaf(h[i * RACE_N + a], e[i * RACE_N + j], s);
		dw2[t] = s;
	} else if (t < RACE_N * RACE_N + RACE_M * RACE_N) { // d[i][a] = sum_j e[i][j] W2[a][j]
		int u = t - RACE_N * RACE_N;
		int i = u / RACE_N, a = u % RACE_N;
		float s = 0.0f;
		for (int j = 0; j < RACE_N; j++)
			s = fmaf(e[i * RACE_N + j], w2[a * RACE_N + j], s);
		d[u] = s;
	}
}

__global__ void dw1_kernel(float *g, const float *x, size_t ldx, size_t k0, size_t kb, const float *d)
{
	size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
	if (t >= kb * RACE_N)
		return;
	size_t k = t / RACE_N;
	int j = (int)(t % RACE_N);
	float s = 0.0f;
	for (int i = 0; i < RACE_M; i++)
		s = fmaf(x[(size_t)i * ldx + k0 + k], d[i * RACE_N + j], s);
	g[t] = s;
}

__global__ void spin_kernel(uint64_t ns)
{
	uint64_t t0, t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
	do {
		asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	} while (t - t0 < ns);
}

__global__ void fill_kernel(uint16_t *buf, size_t n, uint32_t seed)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) {
		uint32_t z = (uint32_t)i * 2654435761u ^ seed * 40503u;
		z ^= z >> 15;
		z *= 2246822519u;
		z ^= z >> 13;
		float v = ((float)(z & 0xffff) - 32768.0f) * (1.0f / 32768.0f) * 1e-2f;
		buf[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
	}
}

} // namespace

extern "C" cudaError_t race_fwd_part(float *hpart, const float *x, size_t ldx, size_t k0, const uint16_t *w1b,
                                     size_t kb, cudaStream_t s)
{
	fwd_part_kernel<<<RACE_M, 4 * RACE_N, 0, s>>>(hpart, x, ldx, k0, w1b, kb);
	return cudaGetLastError();
}

extern "C" cudaError_t race_head(float *h, float *e, float *d, float *dw2, const float *hparts, size_t nb,
                                 const float *w2, const float *y, cudaStream_t s)
{
	sum_parts_kernel<<<(RACE_M * RACE_N + 255) / 256, 256, 0, s>>>(h, hparts, nb);
	err_kernel<<<(RACE_M * RACE_N + 255) / 256, 256, 0, s>>>(e, h, w2, y);
	back_head_kernel<<<(RACE_N * RACE_N + RACE_M * RACE_N + 255) / 256, 256, 0, s>>>(dw2, d, h, e, w2);
	return cudaGetLastError();
}

extern "C" cudaError_t race_dw1(float *g, const float *x, size_t ldx, size_t k0, size_t kb, const float *d,
                                cudaStream_t s)
{
	size_t n = kb * RACE_N;
	dw1_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(g, x, ldx, k0, kb, d);
	return cudaGetLastError();
}

extern "C" cudaError_t spin_ns(uint64_t ns, cudaStream_t s)
{
	spin_kernel<<<1, 32, 0, s>>>(ns);
	return cudaGetLastError();
}

extern "C" cudaError_t fill_bf16(uint16_t *buf, size_t n, uint32_t seed, cudaStream_t s)
{
	fill_kernel<<<264, 256, 0, s>>>(buf, n, seed);
	return cudaGetLastError();
}
