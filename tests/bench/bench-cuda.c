/* SPDX-License-Identifier: MIT */
/*
 * CUDA benchmark: a synthetic trainer of L linear layers of
 * d x d bf16 weights (16 x 8192^2 = 1.07 G parameters by default) on
 * T tokens, trained two ways in the same run:
 *
 *   gpu   fp32 master, m, v on the device and a fused AdamW kernel run per
 *         layer as soon as its gradient is final (the on-GPU baseline);
 *   aoq   the optimizer in aoqd through libaoq's CUDA backend: each
 *         gradient is pushed as soon as it is final, the next forward waits
 *         per layer for its parameter (aoq_wait_param).
 *
 * Also measured in the same run: pinned bandwidth (cudaMallocHost and a
 * cudaHostRegister'ed memfd MAP_SHARED mapping like the arena, each way and
 * both ways at once), the aoq update alone (push every gradient with no
 * compute and wait for every parameter: D2H + CPU + H2D, nothing to hide
 * under), and the library's D2H rate within it.
 *
 *   share of the CPU update hidden = (fwd + bwd + update_alone - step_aoq)
 *                                    / update_alone, clamped to [0, 1]
 *
 * GEMMs: cuBLAS (cublasGemmEx, bf16, fp32 accumulation) loaded with dlopen
 * ($AOQ_CUBLAS, else libcublas.so.13 / libcublas.so); a simple WMMA kernel
 * when it cannot be loaded (reported).
 *
 *   bench-cuda [--aoqd PATH] [--layers L] [--dim d] [--tokens T1,T2,...]
 *              [--steps N] [--threads N]
 */
#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "bench-cuda-kernels.h"
#include "harness.h"

#define CK(call)                                                                                   \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		if (e_ != cudaSuccess)                                                             \
			aoqt_fail("%s: %s (%s)", #call, cudaGetErrorName(e_), cudaGetErrorString(e_)); \
	} while (0)

/* ---- cuBLAS through dlopen (types from its ABI, no header or link) ---- */

typedef int (*cublas_create_fn)(void **);
typedef int (*cublas_set_stream_fn)(void *, cudaStream_t);
typedef int (*cublas_gemm_ex_fn)(void *, int, int, int, int, int, const void *, const void *, int, int,
                                 const void *, int, int, const void *, void *, int, int, int, int);
static void *cublas;
static cublas_gemm_ex_fn gemm_ex;
enum { OP_N = 0, OP_T = 1, R_16BF = 14, COMPUTE_32F = 68, GEMM_DEFAULT = -1 };

static void cublas_load(cudaStream_t s)
{
	const char *names[] = { getenv("AOQ_CUBLAS"), "libcublas.so.13", "libcublas.so",
	                        "/usr/local/cuda/lib64/libcublas.so.13" };
	void *lib = NULL;
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !lib; i++)
		if (names[i])
			lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		printf("cuBLAS: not loaded (%s); using the WMMA fallback GEMM\n", dlerror());
		return;
	}
	cublas_create_fn create;
	cublas_set_stream_fn set_stream;
	/* POSIX's way to take a function from dlsym (ISO C has no cast). */
	*(void **)&create = dlsym(lib, "cublasCreate_v2");
	*(void **)&set_stream = dlsym(lib, "cublasSetStream_v2");
	*(void **)&gemm_ex = dlsym(lib, "cublasGemmEx");
	if (!create || !set_stream || !gemm_ex || create(&cublas) != 0 || set_stream(cublas, s) != 0) {
		printf("cuBLAS: loaded but unusable; using the WMMA fallback GEMM\n");
		gemm_ex = NULL;
		return;
	}
	printf("cuBLAS: loaded\n");
}

/* Row-major C[M x N] = op(A) op(B). */
static void gemm(int ta, int tb, int M, int N, int K, const uint16_t *A, const uint16_t *B, uint16_t *C,
                 cudaStream_t s)
{
	if (gemm_ex) {
		float one = 1.0f, zero = 0.0f;
		/* Column-major view: C^T (N x M) = op(B)^T op(A)^T. */
		int st = gemm_ex(cublas, tb ? OP_T : OP_N, ta ? OP_T : OP_N, N, M, K, &one, B, R_16BF, tb ? K : N, A,
		                 R_16BF, ta ? M : K, &zero, C, R_16BF, N, COMPUTE_32F, GEMM_DEFAULT);
		if (st != 0)
			aoqt_fail("cublasGemmEx: status %d", st);
		return;
	}
	CK(bench_gemm_bf16(ta, tb, M, N, K, A, B, C, s));
}

/* ---- the model ---- */

struct model {
	int L, d, tmax;
	uint16_t **w, **g;  /* [L] d x d */
	uint16_t **x;       /* [L+1] T x d activations */
	uint16_t *gy[3];    /* T x d: the fixed output gradient, then a ping-pong */
	float **master, **m, **v; /* gpu baseline state */
	cudaStream_t s;
	cudaEvent_t e0, e1, e2;
};

static void forward(struct model *md, int T, struct aoq_client *c)
{
	for (int l = 0; l < md->L; l++) {
		if (c)
			CHECK_OK(aoq_wait_param(c, (uint32_t)l, md->s));
		gemm(0, 0, T, md->d, md->d, md->x[l], md->w[l], md->x[l + 1], md->s);
	}
}

static uint64_t adam_k;

/* Backward from a fixed output gradient; each layer's gradient goes to the
 * optimizer as soon as W's last use (dX = dY W^T) is enqueued. */
static void backward(struct model *md, int T, struct aoq_client *c)
{
	const float lr = 1e-6f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
	if (!c)
		adam_k++;
	float bc1 = 1.0f - powf(b1, (float)adam_k), bc2 = 1.0f - powf(b2, (float)adam_k);
	const uint16_t *gin = md->gy[0];
	for (int l = md->L - 1; l >= 0; l--) {
		uint16_t *gout = gin == md->gy[1] ? md->gy[2] : md->gy[1];
		gemm(1, 0, md->d, md->d, T, md->x[l], gin, md->g[l], md->s);  /* dW = X^T dY */
		if (l > 0)
			gemm(0, 1, T, md->d, md->d, gin, md->w[l], gout, md->s); /* dX = dY W^T */
		if (c)
			CHECK_OK(aoq_push_grad(c, (uint32_t)l, 0, md->s));
		else
			CK(bench_adamw(md->w[l], md->master[l], md->m[l], md->v[l], md->g[l], (size_t)md->d * md->d, lr, b1,
			               b2, eps, wd, bc1, bc2, md->s));
		gin = l > 0 ? gout : gin;
	}
	if (c)
		CHECK_OK(aoq_step_end(c));
}

static double used_bytes(void)
{
	size_t fr, tot;
	CK(cudaMemGetInfo(&fr, &tot));
	return (double)(tot - fr);
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(double), cmp_double);
	return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- pinned bandwidth ---- */

struct bw {
	double h2d, d2h, both;
};

static struct bw pinned_bw(void *host, size_t bytes, cudaStream_t s1, cudaStream_t s2)
{
	void *dev;
	CK(cudaMalloc(&dev, 2 * bytes));
	cudaEvent_t a, b;
	CK(cudaEventCreate(&a));
	CK(cudaEventCreate(&b));
	struct bw r = { 0 };
	for (int rep = 0; rep < 4; rep++) {
		float ms;
		CK(cudaEventRecord(a, s1));
		CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s1));
		CK(cudaEventRecord(b, s1));
		CK(cudaEventSynchronize(b));
		CK(cudaEventElapsedTime(&ms, a, b));
		r.h2d = fmax(r.h2d, bytes / (ms * 1e6));
		CK(cudaEventRecord(a, s1));
		CK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s1));
		CK(cudaEventRecord(b, s1));
		CK(cudaEventSynchronize(b));
		CK(cudaEventElapsedTime(&ms, a, b));
		r.d2h = fmax(r.d2h, bytes / (ms * 1e6));
		/* Both ways: half of the buffer each way at once. */
		CK(cudaDeviceSynchronize());
		double t0 = aoqt_now();
		CK(cudaMemcpyAsync(dev, host, bytes / 2, cudaMemcpyHostToDevice, s1));
		CK(cudaMemcpyAsync((char *)host + bytes / 2, (char *)dev + bytes, bytes / 2, cudaMemcpyDeviceToHost, s2));
		CK(cudaDeviceSynchronize());
		r.both = fmax(r.both, bytes / ((aoqt_now() - t0) * 1e9));
	}
	cudaEventDestroy(a);
	cudaEventDestroy(b);
	CK(cudaFree(dev));
	return r;
}

int main(int argc, char **argv)
{
	aoqt_init("bench-cuda");
	const char *aoqd = AOQD_PATH, *tokens = "8192,32768";
	int L = 16, d = 8192, steps = 8;
	const char *threads = NULL, *modes = "unbounded";
	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--aoqd"))
			aoqd = argv[i + 1];
		else if (!strcmp(argv[i], "--layers"))
			L = atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--dim"))
			d = atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--tokens"))
			tokens = argv[i + 1];
		else if (!strcmp(argv[i], "--steps"))
			steps = atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--threads"))
			threads = argv[i + 1];
		else if (!strcmp(argv[i], "--modes"))
			modes = argv[i + 1]; /* unbounded, windowMiB (e.g. window256), delayed */
		else
			aoqt_fail("unknown option %s", argv[i]);
	}
	int tok[8], ntok = 0, tmax = 0;
	for (const char *p = tokens; *p && ntok < 8;) {
		tok[ntok] = atoi(p);
		if (tok[ntok] <= 0 || tok[ntok] % 64 || L <= 0 || d % 64)
			aoqt_fail("tokens and dim must be positive multiples of 64");
		tmax = tok[ntok] > tmax ? tok[ntok] : tmax;
		ntok++;
		p = strchr(p, ',');
		if (!p)
			break;
		p++;
	}
	int dev_count = 0;
	if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
		printf("SKIP: no CUDA device\n");
		return AOQT_SKIP;
	}
	CK(cudaSetDevice(0));
	struct cudaDeviceProp prop;
	CK(cudaGetDeviceProperties(&prop, 0));
	CK(cudaFree(NULL));
	double used0 = used_bytes();
	size_t nper = (size_t)d * d;
	double params = (double)nper * L;
	printf("device: %s; model: %d layers of %dx%d bf16 = %.3f G parameters; steps timed: %d\n", prop.name, L, d, d,
	       params * 1e-9, steps);

	struct model md = { .L = L, .d = d, .tmax = tmax };
	CK(cudaStreamCreateWithFlags(&md.s, cudaStreamNonBlocking));
	CK(cudaEventCreate(&md.e0));
	CK(cudaEventCreate(&md.e1));
	CK(cudaEventCreate(&md.e2));
	cublas_load(md.s);

	/* Pinned bandwidth, cudaMallocHost and a registered memfd mapping. */
	size_t bwbytes = 1ull << 30;
	cudaStream_t s2;
	CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
	void *ph;
	CK(cudaMallocHost(&ph, bwbytes));
	memset(ph, 1, bwbytes);
	struct bw bw_pinned = pinned_bw(ph, bwbytes, md.s, s2);
	CK(cudaFreeHost(ph));
	int mfd = memfd_create("bench-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	CHECK(mfd >= 0 && ftruncate(mfd, (off_t)bwbytes) == 0, "memfd");
	void *mm = mmap(NULL, bwbytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
	CHECK(mm != MAP_FAILED, "mmap");
	memset(mm, 1, bwbytes);
	double tr = aoqt_now();
	CK(cudaHostRegister(mm, bwbytes, cudaHostRegisterDefault));
	tr = aoqt_now() - tr;
	struct bw bw_memfd = pinned_bw(mm, bwbytes, md.s, s2);
	CK(cudaHostUnregister(mm));
	munmap(mm, bwbytes);
	close(mfd);
	printf("pinned bandwidth (GB/s, 1 GiB): cudaMallocHost H2D %.1f D2H %.1f both %.1f; registered memfd H2D %.1f "
	       "D2H %.1f both %.1f (cudaHostRegister of 1 GiB: %.0f ms)\n",
	       bw_pinned.h2d, bw_pinned.d2h, bw_pinned.both, bw_memfd.h2d, bw_memfd.d2h, bw_memfd.both, tr * 1e3);

	/* The model. */
	md.w = calloc((size_t)L, sizeof(void *));
	md.g = calloc((size_t)L, sizeof(void *));
	md.x = calloc((size_t)L + 1, sizeof(void *));
	md.master = calloc((size_t)L, sizeof(void *));
	md.m = calloc((size_t)L, sizeof(void *));
	md.v = calloc((size_t)L, sizeof(void *));
	for (int l = 0; l < L; l++) {
		CK(cudaMalloc((void **)&md.w[l], nper * 2));
		CK(cudaMalloc((void **)&md.g[l], nper * 2));
	}
	for (int l = 0; l <= L; l++)
		CK(cudaMalloc((void **)&md.x[l], (size_t)tmax * d * 2));
	CK(cudaMalloc((void **)&md.gy[0], (size_t)tmax * d * 2));
	CK(cudaMalloc((void **)&md.gy[1], (size_t)tmax * d * 2));
	CK(cudaMalloc((void **)&md.gy[2], (size_t)tmax * d * 2));
	CK(bench_fill(md.x[0], NULL, (size_t)tmax * d, 1.0f, 1, md.s));
	CK(bench_fill(md.gy[0], NULL, (size_t)tmax * d, 1.0f, 2, md.s));
	float ws = sqrtf(3.0f / (float)d);

	/* ---- gpu: fused AdamW on the device ---- */
	for (int l = 0; l < L; l++) {
		CK(cudaMalloc((void **)&md.master[l], nper * 4));
		CK(cudaMalloc((void **)&md.m[l], nper * 4));
		CK(cudaMalloc((void **)&md.v[l], nper * 4));
		CK(cudaMemsetAsync(md.m[l], 0, nper * 4, md.s));
		CK(cudaMemsetAsync(md.v[l], 0, nper * 4, md.s));
		CK(bench_fill(md.w[l], md.master[l], nper, ws, 100 + (uint32_t)l, md.s));
	}
	CK(cudaStreamSynchronize(md.s));
	double mem_gpu = used_bytes() - used0;
	double *fwd_ms = calloc((size_t)ntok, sizeof(double)), *bwd_ms = calloc((size_t)ntok, sizeof(double));
	double *step_gpu = calloc((size_t)ntok, sizeof(double)), *step_aoq = calloc((size_t)ntok, sizeof(double));
	double *t = calloc((size_t)steps, sizeof(double)), *tf = calloc((size_t)steps, sizeof(double));
	double *tb = calloc((size_t)steps, sizeof(double));
	for (int ti = 0; ti < ntok; ti++) {
		int T = tok[ti];
		for (int k = -2; k < steps; k++) {
			CK(cudaStreamSynchronize(md.s));
			double t0 = aoqt_now();
			CK(cudaEventRecord(md.e0, md.s));
			forward(&md, T, NULL);
			CK(cudaEventRecord(md.e1, md.s));
			backward(&md, T, NULL);
			CK(cudaEventRecord(md.e2, md.s));
			CK(cudaStreamSynchronize(md.s));
			if (k >= 0) {
				float a, b;
				t[k] = (aoqt_now() - t0) * 1e3;
				CK(cudaEventElapsedTime(&a, md.e0, md.e1));
				CK(cudaEventElapsedTime(&b, md.e1, md.e2));
				tf[k] = a;
				tb[k] = b;
			}
		}
		step_gpu[ti] = median(t, steps);
		fwd_ms[ti] = median(tf, steps);
		bwd_ms[ti] = median(tb, steps); /* includes the per-layer AdamW */
	}
	/* Backward without the optimizer, for the aoq comparison. */
	double *bwd_only = calloc((size_t)ntok, sizeof(double));
	for (int ti = 0; ti < ntok; ti++) {
		int T = tok[ti];
		for (int k = 0; k < 3; k++) {
			const uint16_t *gin = md.gy[0];
			CK(cudaEventRecord(md.e1, md.s));
			for (int l = L - 1; l >= 0; l--) {
				uint16_t *gout = gin == md.gy[1] ? md.gy[2] : md.gy[1];
				gemm(1, 0, d, d, T, md.x[l], gin, md.g[l], md.s);
				if (l > 0)
					gemm(0, 1, T, d, d, gin, md.w[l], gout, md.s);
				gin = l > 0 ? gout : gin;
			}
			CK(cudaEventRecord(md.e2, md.s));
			CK(cudaEventSynchronize(md.e2));
			float b;
			CK(cudaEventElapsedTime(&b, md.e1, md.e2));
			tb[k] = b;
		}
		bwd_only[ti] = median(tb, 3);
	}
	for (int l = 0; l < L; l++) {
		CK(cudaFree(md.master[l]));
		CK(cudaFree(md.m[l]));
		CK(cudaFree(md.v[l]));
	}

	/* ---- aoq ---- */
	/* One aoq session per mode, on a fresh daemon each. */
	for (const char *mp = modes; mp && *mp; mp = strchr(mp, ',') ? strchr(mp, ',') + 1 : NULL) {
	char mode[32];
	snprintf(mode, sizeof(mode), "%.*s", (int)strcspn(mp, ","), mp);
	uint64_t window = strncmp(mode, "window", 6) == 0 ? (uint64_t)atoi(mode + 6) << 20 : 0;
	bool delayed = strcmp(mode, "delayed") == 0;
	if (!window && !delayed && strcmp(mode, "unbounded") != 0)
		aoqt_fail("unknown mode %s", mode);
	struct aoqt_daemon dm;
	const char *args[3] = { NULL, NULL, NULL };
	if (threads) {
		args[0] = "--threads";
		args[1] = threads;
	}
	CHECK_OK(aoqt_daemon_start(&dm, aoqd, args));
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = dm.socket;
	o.device = "cuda:0";
	o.job = "bench-cuda";
	o.cuda_stream = md.s;
	o.window = window;
	o.delayed_update = delayed;
	struct aoq_client *c;
	CHECK_OK(aoq_connect(&c, &o));
	struct aoq_group grp = { .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 1e-6, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
	                         .weight_decay = 0.1 };
	CHECK_OK(aoq_add_group(c, &grp));
	for (int l = 0; l < L; l++) {
		char name[16];
		snprintf(name, sizeof(name), "w%d", l);
		struct aoq_tensor td = { .size = sizeof(struct aoq_tensor), .name = name, .numel = nper, .param_dtype = AOQ_BF16, .grad_dtype = AOQ_BF16,
		                         .param = md.w[l], .grad = md.g[l] };
		CHECK_OK(aoq_add_tensor(c, &td));
	}
	double treg = aoqt_now();
	CHECK_OK(aoq_register(c));
	treg = aoqt_now() - treg;
	double mem_aoq = used_bytes() - used0;

	/* The update alone: every gradient pushed at once, no compute. */
	double upd[8], d2h_rate[8];
	int nupd = steps < 8 ? steps : 8;
	for (int k = -1; k < nupd; k++) {
		CK(cudaStreamSynchronize(md.s));
		double t0 = aoqt_now();
		for (int l = L - 1; l >= 0; l--)
			CHECK_OK(aoq_push_grad(c, (uint32_t)l, 0, md.s));
		for (int l = L - 1; l >= 0; l--)
			CHECK_OK(aoq_grad_copied(c, (uint32_t)l));
		double td = aoqt_now() - t0;
		CHECK_OK(aoq_step_end(c));
		for (int l = 0; l < L; l++)
			CHECK_OK(aoq_wait_param(c, (uint32_t)l, md.s));
		CK(cudaStreamSynchronize(md.s));
		if (k >= 0) {
			upd[k] = (aoqt_now() - t0) * 1e3;
			d2h_rate[k] = params * 2 / td * 1e-9;
		}
	}
	double upd_ms = median(upd, nupd), d2h_lib = median(d2h_rate, nupd);
	struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
	CHECK_OK(aoq_sync(c, &res));
	if (res.nonfinite)
		printf("WARNING: non-finite gradients in the update-only steps\n");

	/* Steady state: steps back to back, the next forward waiting per
	 * layer for its parameter (no host sync between steps). */
	for (int ti = 0; ti < ntok; ti++) {
		int T = tok[ti];
		for (int k = 0; k < 2; k++) { /* warm-up */
			forward(&md, T, c);
			backward(&md, T, c);
		}
		CHECK_OK(aoq_sync(c, NULL));
		CK(cudaStreamSynchronize(md.s));
		double t0 = aoqt_now();
		for (int k = 0; k < steps; k++) {
			forward(&md, T, c);
			backward(&md, T, c);
		}
		for (int l = 0; l < L; l++)
			CHECK_OK(aoq_wait_param(c, (uint32_t)l, md.s));
		CK(cudaStreamSynchronize(md.s));
		step_aoq[ti] = (aoqt_now() - t0) * 1e3 / steps;
		CHECK_OK(aoq_sync(c, &res));
		if (res.nonfinite) /* skipped steps do less work: say so */
			printf("WARNING: non-finite gradients at %d tokens (step %" PRIu64 " skipped)\n", T, res.step);
	}
	aoq_close(c);
	int rc = aoqt_daemon_stop(&dm, 60000, true);

	printf("\n== mode %s%s\n", mode, delayed ? " (parameters one step stale)" : "");
	printf("registration (pin %.2f GiB arena, load %.2f G initial values): %.2f s; aoqd exit %d\n",
	       window ? (double)window / (1u << 30) : params * 4 / (1u << 30), params * 1e-9, treg, rc);
	printf("aoq update alone (D2H + CPU AdamW + H2D of every tensor, no compute): %.1f ms = %.2f G params/s; "
	       "library D2H %.1f GB/s (pinned D2H %.1f)\n",
	       upd_ms, params / upd_ms * 1e-6, d2h_lib, bw_memfd.d2h);
	printf("peak device memory above the context: gpu AdamW %.2f GiB, aoq %.2f GiB (activations sized for %d tokens)\n",
	       mem_gpu / (1u << 30), mem_aoq / (1u << 30), tmax);
	printf("\n| tokens | fwd ms | bwd ms | gpu AdamW step ms | aoq step ms | aoq / gpu | CPU update "
	       "hidden | PCIe GB/s avg (both ways) |\n|---|---|---|---|---|---|---|---|\n");
	for (int ti = 0; ti < ntok; ti++) {
		double hidden = (fwd_ms[ti] + bwd_only[ti] + upd_ms - step_aoq[ti]) / upd_ms;
		hidden = hidden < 0 ? 0 : hidden > 1 ? 1 : hidden;
		printf("| %d | %.1f | %.1f | %.1f | %.1f | %.2f | %.0f%% | %.1f |\n", tok[ti], fwd_ms[ti],
		       bwd_only[ti], step_gpu[ti], step_aoq[ti], step_aoq[ti] / step_gpu[ti], 100 * hidden,
		       params * 4 / (step_aoq[ti] * 1e6));
	}
	fflush(stdout);
	}
	return 0;
}
