// SPDX-License-Identifier: MIT
// Kernels of the CUDA benchmark.  See bench-cuda-kernels.h.
#include <cuda_bf16.h>
#include <mma.h>

#include "bench-cuda-kernels.h"

using namespace nvcuda;

namespace {

// A 64x64 tile of C per block of 4 warps, each warp 32x32 (2x2 fragments
// of 16x16), K in steps of 16 straight from global memory (L2-resident
// operands).  A fallback, not a fast GEMM.
template <typename LA, typename LB>
__global__ void gemm_kernel(int M, int N, int K, const __nv_bfloat16 *A, int lda, const __nv_bfloat16 *B, int ldb,
                            __nv_bfloat16 *C, bool ta, bool tb)
{
	__shared__ float stage[4][16 * 16];
	int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	int m0 = blockIdx.y * 64 + (warp / 2) * 32, n0 = blockIdx.x * 64 + (warp % 2) * 32;
	wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
	for (int i = 0; i < 2; i++)
		for (int j = 0; j < 2; j++)
			wmma::fill_fragment(acc[i][j], 0.0f);
	for (int k = 0; k < K; k += 16) {
		wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LA> a[2];
		wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, LB> b[2];
		for (int i = 0; i < 2; i++) {
			int mm = m0 + 16 * i;
			const __nv_bfloat16 *pa = ta ? A + (size_t)k * lda + mm : A + (size_t)mm * lda + k;
			wmma::load_matrix_sync(a[i], pa, lda);
		}
		for (int j = 0; j < 2; j++) {
			int nn = n0 + 16 * j;
			const __nv_bfloat16 *pb = tb ? B + (size_t)nn * ldb + k : B + (size_t)k * ldb + nn;
			wmma::load_matrix_sync(b[j], pb, ldb);
		}
		for (int i = 0; i < 2; i++)
			for (int j = 0; j < 2; j++)
				wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
	}
	for (int i = 0; i < 2; i++)
		for (int j = 0; j < 2; j++) {
			wmma::store_matrix_sync(stage[warp], acc[i][j], 16, wmma::mem_row_major);
			__syncwarp();
			for (int e = lane; e < 256; e += 32) {
				int r = e / 16, cc = e % 16;
				C[(size_t)(m0 + 16 * i + r) * N + n0 + 16 * j + cc] = __float2bfloat16_rn(stage[warp][e]);
			}
			__syncwarp();
		}
}

__global__ void adamw_kernel(__nv_bfloat16 *param, float *master, float *m, float *v, const __nv_bfloat16 *grad,
                             size_t n, float lr, float b1, float b2, float eps, float wd, float bc1, float bc2)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;
	float step = lr / bc1, rbc2 = rsqrtf(bc2);
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) {
		float g = __bfloat162float(grad[i]);
		float p = master[i] * (1.0f - lr * wd);
		float mi = b1 * m[i] + (1.0f - b1) * g;
		float vi = b2 * v[i] + (1.0f - b2) * g * g;
		p -= step * mi / (sqrtf(vi) * rbc2 + eps);
		m[i] = mi;
		v[i] = vi;
		master[i] = p;
		param[i] = __float2bfloat16_rn(p);
	}
}

__global__ void fill_kernel(__nv_bfloat16 *buf, float *master, size_t n, float scale, uint32_t seed)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) {
		uint64_t z = (uint64_t)i * 0x9e3779b97f4a7c15ull ^ ((uint64_t)seed << 32);
		z ^= z >> 31;
		z *= 0xbf58476d1ce4e5b9ull;
		z ^= z >> 29;
		float u = (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
		__nv_bfloat16 b = __float2bfloat16_rn(scale * u);
		buf[i] = b;
		if (master)
			master[i] = __bfloat162float(b);
	}
}

} // namespace

extern "C" cudaError_t bench_gemm_bf16(int ta, int tb, int M, int N, int K, const uint16_t *A, const uint16_t *B,
                                       uint16_t *C, cudaStream_t s)
{
	if (M % 64 || N % 64 || K % 64)
		return cudaErrorInvalidValue;
	dim3 grid(N / 64, M / 64);
	const __nv_bfloat16 *a = reinterpret_cast<const __nv_bfloat16 *>(A);
	const __nv_bfloat16 *b = reinterpret_cast<const __nv_bfloat16 *>(B);
	__nv_bfloat16 *c = reinterpret_cast<__nv_bfloat16 *>(C);
	int lda = ta ? M : K, ldb = tb ? K : N;
	if (ta && tb)
		gemm_kernel<wmma::col_major, wmma::col_major><<<grid, 128, 0, s>>>(M, N, K, a, lda, b, ldb, c, true, true);
	else if (ta)
		gemm_kernel<wmma::col_major, wmma::row_major><<<grid, 128, 0, s>>>(M, N, K, a, lda, b, ldb, c, true, false);
	else if (tb)
		gemm_kernel<wmma::row_major, wmma::col_major><<<grid, 128, 0, s>>>(M, N, K, a, lda, b, ldb, c, false, true);
	else
		gemm_kernel<wmma::row_major, wmma::row_major><<<grid, 128, 0, s>>>(M, N, K, a, lda, b, ldb, c, false, false);
	return cudaGetLastError();
}

extern "C" cudaError_t bench_adamw(uint16_t *param, float *master, float *m, float *v, const uint16_t *grad, size_t n,
                                   float lr, float beta1, float beta2, float eps, float wd, float bc1, float bc2,
                                   cudaStream_t s)
{
	adamw_kernel<<<132 * 8, 256, 0, s>>>(reinterpret_cast<__nv_bfloat16 *>(param), master, m, v,
	                                     reinterpret_cast<const __nv_bfloat16 *>(grad), n, lr, beta1, beta2, eps, wd,
	                                     bc1, bc2);
	return cudaGetLastError();
}

extern "C" cudaError_t bench_fill(uint16_t *buf, float *master, size_t n, float scale, uint32_t seed, cudaStream_t s)
{
	fill_kernel<<<132 * 8, 256, 0, s>>>(reinterpret_cast<__nv_bfloat16 *>(buf), master, n, scale, seed);
	return cudaGetLastError();
}
