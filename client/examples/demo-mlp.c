/* SPDX-License-Identifier: MIT */
/*
 * aoq-demo: trains a small MLP with its optimizer step running in aoqd.
 *
 * The model (16 -> 64 tanh -> 1) regresses synthetic data: inputs drawn
 * from a fixed seed, targets from a fixed random "teacher" network plus a
 * little noise.  Forward and backward are plain C on the host; the AdamW
 * step runs in the daemon through libaoq.  Backward produces the last
 * layer's gradients first, so they are pushed first, while the first
 * layer's gradients are still being computed: that overlap is the point of
 * streaming gradients to the daemon.
 *
 * The demo fails (exit 1) unless the loss falls at least 10x.
 *
 * On "cuda:N" (built with CUDA) the parameters and gradients live in device
 * memory, as in a real trainer: the host math stands in for the GPU's, each
 * gradient is copied to the device before it is pushed and the updated
 * parameters are read back after the step.  The default device is cuda:0
 * when the build has CUDA and a device is present, else cpu.
 *
 * With --spawn-daemon PATH it starts PATH itself on a listening socket it
 * created first (--listen-fd), so it needs no running daemon: the meson
 * test 'demo' runs it that way.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <aoq/aoq.h>

#if AOQ_DEMO_CUDA
#include <cuda_runtime_api.h>
#endif

#define N_IN 16
#define N_HID 64
#define N_SAMPLES 256
#define TEACHER_HID 32
#define NOISE_STD 0.01
#define MIN_RATIO 10.0

enum { T_W1, T_B1, T_W2, T_B2, N_TENSORS };

static const char *const tensor_name[N_TENSORS] = { "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias" };
static const uint64_t tensor_numel[N_TENSORS] = { N_HID * N_IN, N_HID, N_HID, 1 };

/* ---- random numbers (fixed seeds: the data is the same every run) ------- */

static uint64_t rng_next(uint64_t *s)
{
	/* splitmix64 */
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static double rng_uniform(uint64_t *s)
{
	return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

static double rng_normal(uint64_t *s)
{
	double u1 = rng_uniform(s), u2 = rng_uniform(s);
	if (u1 < 1e-300)
		u1 = 1e-300;
	return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

/* ---- bf16 ------------------------------------------------------------ */

static float bf16_to_f32(uint16_t h)
{
	uint32_t u = (uint32_t)h << 16;
	float f;
	memcpy(&f, &u, sizeof(f));
	return f;
}

/* Round to nearest even; NaN stays NaN. */
static uint16_t f32_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof(u));
	if ((u & 0x7fffffffu) > 0x7f800000u)
		return (uint16_t)((u >> 16) | 0x40);
	u += 0x7fffu + ((u >> 16) & 1);
	return (uint16_t)(u >> 16);
}

/* ---- the data and the model ------------------------------------------ */

struct data {
	float x[N_SAMPLES][N_IN];
	float y[N_SAMPLES];
};

static void make_data(struct data *d)
{
	uint64_t s = 0x5eedda7aull;
	static double tw1[TEACHER_HID][N_IN], tb1[TEACHER_HID], tw2[TEACHER_HID];
	for (int j = 0; j < TEACHER_HID; j++) {
		for (int i = 0; i < N_IN; i++)
			tw1[j][i] = rng_normal(&s) * 1.5 / sqrt(N_IN);
		tb1[j] = rng_normal(&s) * 0.5;
		tw2[j] = rng_normal(&s) / sqrt(TEACHER_HID);
	}
	double sum = 0, sumsq = 0;
	double raw[N_SAMPLES];
	for (int n = 0; n < N_SAMPLES; n++) {
		for (int i = 0; i < N_IN; i++)
			d->x[n][i] = (float)rng_normal(&s);
		double out = 0;
		for (int j = 0; j < TEACHER_HID; j++) {
			double z = tb1[j];
			for (int i = 0; i < N_IN; i++)
				z += tw1[j][i] * d->x[n][i];
			out += tw2[j] * tanh(z);
		}
		raw[n] = out;
		sum += out;
		sumsq += out * out;
	}
	/* Targets with unit variance, so the starting loss is about 1. */
	double mean = sum / N_SAMPLES;
	double sd = sqrt(fmax(sumsq / N_SAMPLES - mean * mean, 1e-12));
	for (int n = 0; n < N_SAMPLES; n++)
		d->y[n] = (float)((raw[n] - mean) / sd + NOISE_STD * rng_normal(&s));
}

/* Parameters and gradients in fp32, laid out like the tensors. */
struct model {
	float w1[N_HID * N_IN], b1[N_HID], w2[N_HID], b2[1];
	float *p[N_TENSORS];
};

static void model_bind(struct model *m)
{
	m->p[T_W1] = m->w1;
	m->p[T_B1] = m->b1;
	m->p[T_W2] = m->w2;
	m->p[T_B2] = m->b2;
}

static void model_init(struct model *m)
{
	uint64_t s = 0x1417ull;
	model_bind(m);
	for (int i = 0; i < N_HID * N_IN; i++)
		m->w1[i] = (float)(rng_normal(&s) / sqrt(N_IN));
	for (int j = 0; j < N_HID; j++) {
		m->b1[j] = 0;
		m->w2[j] = (float)(rng_normal(&s) / sqrt(N_HID));
	}
	m->b2[0] = 0;
}

static float hidden[N_SAMPLES][N_HID];

/* Mean squared error; fills hidden[] for backward. */
static double forward(const struct model *m, const struct data *d, float *dpred)
{
	double loss = 0;
	for (int n = 0; n < N_SAMPLES; n++) {
		float out = m->b2[0];
		for (int j = 0; j < N_HID; j++) {
			float z = m->b1[j];
			const float *w = &m->w1[j * N_IN];
			for (int i = 0; i < N_IN; i++)
				z += w[i] * d->x[n][i];
			hidden[n][j] = tanhf(z);
			out += m->w2[j] * hidden[n][j];
		}
		float e = out - d->y[n];
		loss += (double)e * e;
		if (dpred)
			dpred[n] = 2.0f * e / N_SAMPLES;
	}
	return loss / N_SAMPLES;
}

static void backward_layer2(const float *dpred, struct model *g)
{
	memset(g->w2, 0, sizeof(g->w2));
	g->b2[0] = 0;
	for (int n = 0; n < N_SAMPLES; n++) {
		g->b2[0] += dpred[n];
		for (int j = 0; j < N_HID; j++)
			g->w2[j] += dpred[n] * hidden[n][j];
	}
}

static void backward_layer1(const float *dpred, const struct model *m, const struct data *d,
                            struct model *g)
{
	memset(g->w1, 0, sizeof(g->w1));
	memset(g->b1, 0, sizeof(g->b1));
	for (int n = 0; n < N_SAMPLES; n++) {
		for (int j = 0; j < N_HID; j++) {
			float h = hidden[n][j];
			float dz = dpred[n] * m->w2[j] * (1.0f - h * h);
			g->b1[j] += dz;
			float *gw = &g->w1[j * N_IN];
			for (int i = 0; i < N_IN; i++)
				gw[i] += dz * d->x[n][i];
		}
	}
}

/* ---- a daemon of our own (--spawn-daemon) ----------------------------- */

struct spawned {
	pid_t pid;
	char dir[256];
	char path[300];
};

static int spawn_daemon(const char *exe, struct spawned *sp)
{
	const char *tmp = getenv("TMPDIR");
	if (!tmp || !*tmp)
		tmp = "/tmp";
	if (snprintf(sp->dir, sizeof(sp->dir), "%s/aoq-demo-XXXXXX", tmp) >= (int)sizeof(sp->dir) ||
	    !mkdtemp(sp->dir)) {
		fprintf(stderr, "aoq-demo: cannot create a temporary directory under %s: %s\n", tmp,
		        strerror(errno));
		return -1;
	}
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	if (snprintf(sp->path, sizeof(sp->path), "%s/aoqd.sock", sp->dir) >= (int)sizeof(sa.sun_path)) {
		fprintf(stderr, "aoq-demo: socket path %s is too long\n", sp->path);
		goto fail_dir;
	}
	strcpy(sa.sun_path, sp->path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, 64) < 0) {
		fprintf(stderr, "aoq-demo: cannot listen on %s: %s\n", sp->path, strerror(errno));
		if (fd >= 0)
			close(fd);
		goto fail_sock;
	}
	pid_t parent = getpid();
	fflush(NULL);
	sp->pid = fork();
	if (sp->pid < 0) {
		fprintf(stderr, "aoq-demo: fork: %s\n", strerror(errno));
		close(fd);
		goto fail_sock;
	}
	if (sp->pid == 0) {
		/* The daemon dies with us; we may have died before the prctl. */
		if (prctl(PR_SET_PDEATHSIG, SIGTERM) < 0 || getppid() != parent)
			_exit(127);
		int flags = fcntl(fd, F_GETFD);
		if (flags < 0 || fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC) < 0)
			_exit(127);
		char fdstr[16];
		snprintf(fdstr, sizeof(fdstr), "%d", fd);
		execl(exe, exe, "--listen-fd", fdstr, "--threads", "2", (char *)NULL);
		fprintf(stderr, "aoq-demo: cannot run %s: %s\n", exe, strerror(errno));
		_exit(127);
	}
	/* The daemon holds the listening socket now; if it dies, our
	 * connection is reset instead of waiting forever. */
	close(fd);
	return 0;

fail_sock:
	unlink(sp->path);
fail_dir:
	rmdir(sp->dir);
	return -1;
}

/* Stops the daemon; -1 when it had failed (crashed, or a non-zero exit). */
static int stop_daemon(struct spawned *sp)
{
	int st, ret = 0;
	kill(sp->pid, SIGTERM);
	while (waitpid(sp->pid, &st, 0) < 0) {
		if (errno != EINTR) {
			fprintf(stderr, "aoq-demo: waitpid: %s\n", strerror(errno));
			ret = -1;
			goto out;
		}
	}
	if (WIFEXITED(st) && WEXITSTATUS(st) != 0) {
		fprintf(stderr, "aoq-demo: aoqd exited with status %d\n", WEXITSTATUS(st));
		ret = -1;
	} else if (WIFSIGNALED(st) && WTERMSIG(st) != SIGTERM) {
		fprintf(stderr, "aoq-demo: aoqd was killed by signal %d (%s)\n", WTERMSIG(st),
		        strsignal(WTERMSIG(st)));
		ret = -1;
	}
out:
	unlink(sp->path);
	rmdir(sp->dir);
	return ret;
}

/* ---- device memory (cuda:N) ------------------------------------------ */

#if AOQ_DEMO_CUDA
static bool cuda_ok(cudaError_t e, const char *what)
{
	if (e == cudaSuccess)
		return true;
	fprintf(stderr, "aoq-demo: %s: %s\n", what, cudaGetErrorString(e));
	return false;
}

static bool cuda_device_present(void)
{
	int n = 0;
	/* No driver (35), the stub driver (34), no device (100): no CUDA. */
	return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#endif

/* Device buffers of the tensors, or NULL when the device is the host. */
struct dev {
	bool on;
	void *param[N_TENSORS], *grad[N_TENSORS];
};

static int dev_open(struct dev *d, const char *device, size_t esize)
{
	memset(d, 0, sizeof(*d));
	if (strncmp(device, "cuda:", 5) != 0)
		return 0;
#if AOQ_DEMO_CUDA
	int idx = atoi(device + 5);
	if (!cuda_ok(cudaSetDevice(idx), "cudaSetDevice"))
		return -1;
	for (int t = 0; t < N_TENSORS; t++)
		if (!cuda_ok(cudaMalloc(&d->param[t], tensor_numel[t] * esize), "cudaMalloc") ||
		    !cuda_ok(cudaMalloc(&d->grad[t], tensor_numel[t] * esize), "cudaMalloc"))
			return -1;
	d->on = true;
#else
	(void)esize;
#endif
	return 0;
}

static void dev_close(struct dev *d)
{
#if AOQ_DEMO_CUDA
	for (int t = 0; t < N_TENSORS; t++) {
		if (d->param[t])
			cudaFree(d->param[t]);
		if (d->grad[t])
			cudaFree(d->grad[t]);
	}
#endif
	memset(d, 0, sizeof(*d));
}

/* Host -> device (to_dev) or back, and wait for it. */
static int dev_copy(struct dev *d, void *host, void *devp, size_t bytes, bool to_dev)
{
#if AOQ_DEMO_CUDA
	if (!d->on)
		return 0;
	/* The library's copy streams are not ordered with ours: finish first. */
	if (!cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize") ||
	    !cuda_ok(cudaMemcpy(to_dev ? devp : host, to_dev ? host : devp, bytes,
	                        to_dev ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost),
	             "cudaMemcpy") ||
	    !cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize"))
		return -1;
#else
	(void)d, (void)host, (void)devp, (void)bytes, (void)to_dev;
#endif
	return 0;
}

/* ---- training -------------------------------------------------------- */

struct config {
	const char *socket;
	const char *device;
	const char *job;
	uint32_t rank;
	long steps;
	double lr;
	bool bf16;
};

/* libaoq's message already names the cause (and the errno text when it
 * matters); the errno text is added only when the library gave none. */
static int fail(const char *what, int r)
{
	const char *msg = aoq_last_error();
	fprintf(stderr, "aoq-demo: %s: %s\n", what, msg && *msg ? msg : strerror(-r));
	return -1;
}

/* Returns 0 when the loss fell at least MIN_RATIO times, 1 when it did
 * not, -1 on an error. */
static int train(const struct config *cfg)
{
	static struct data data;
	static struct model m, g;
	/* bf16 mode: the "device" tensors are bf16; the fp32 master starts
	 * from m (init) and lives in the daemon. */
	static uint16_t p16[N_TENSORS][N_HID * N_IN], g16[N_TENSORS][N_HID * N_IN];
	static float dpred[N_SAMPLES];
	struct aoq_client *c = NULL;
	struct dev dv;
	int ret = -1, r;
	size_t esize = cfg->bf16 ? 2 : 4;

	make_data(&data);
	model_init(&m);
	model_bind(&g);
	if (dev_open(&dv, cfg->device, esize) < 0) {
		dev_close(&dv);
		return -1;
	}
	/* The tensors' buffers: host arrays, or device copies of them. */
	void *hparam[N_TENSORS], *hgrad[N_TENSORS], *param[N_TENSORS], *grad[N_TENSORS];
	for (int t = 0; t < N_TENSORS; t++) {
		hparam[t] = cfg->bf16 ? (void *)p16[t] : (void *)m.p[t];
		hgrad[t] = cfg->bf16 ? (void *)g16[t] : (void *)g.p[t];
		param[t] = dv.on ? dv.param[t] : hparam[t];
		grad[t] = dv.on ? dv.grad[t] : hgrad[t];
	}

	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = cfg->socket;
	o.device = cfg->device;
	o.job = cfg->job;
	o.rank = cfg->rank;
	r = aoq_connect(&c, &o);
	if (r < 0) {
		dev_close(&dv);
		/* a device error or a connection error: the message says which */
		char what[128];
		snprintf(what, sizeof(what), "starting a session on %s", cfg->device);
		return fail(what, r);
	}

	struct aoq_group grp = {
		.size = sizeof(struct aoq_group),
		.kind = AOQ_ADAMW, .lr = cfg->lr, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		.weight_decay = 1e-2,
	};
	int gi = aoq_add_group(c, &grp);
	if (gi < 0) {
		fail("aoq_add_group", gi);
		goto out;
	}
	for (int t = 0; t < N_TENSORS; t++) {
		struct aoq_tensor desc = {
			.size = sizeof(struct aoq_tensor),
			.name = tensor_name[t],
			.numel = tensor_numel[t],
			.group = (uint32_t)gi,
		};
		if (cfg->bf16) {
			for (uint64_t i = 0; i < tensor_numel[t]; i++)
				p16[t][i] = f32_to_bf16(m.p[t][i]);
			desc.param_dtype = desc.grad_dtype = AOQ_BF16;
			desc.init = m.p[t];
			desc.init_dtype = AOQ_FP32;
		} else {
			desc.param_dtype = desc.grad_dtype = AOQ_FP32;
		}
		desc.param = param[t];
		desc.grad = grad[t];
		if (dev_copy(&dv, hparam[t], param[t], tensor_numel[t] * esize, true) < 0)
			goto out;
		r = aoq_add_tensor(c, &desc);
		if (r < 0) {
			fail("aoq_add_tensor", r);
			goto out;
		}
		if (r != t) {
			fprintf(stderr, "aoq-demo: tensor %s got index %d, expected %d\n", tensor_name[t], r, t);
			goto out;
		}
	}
	r = aoq_register(c);
	if (r < 0) {
		fail("aoq_register", r);
		goto out;
	}
	printf("aoq-demo: %d tensors, %" PRIu64 " parameters, %s params and grads, AdamW lr %g, device %s\n",
	       N_TENSORS, (uint64_t)(N_HID * N_IN + N_HID + N_HID + 1), cfg->bf16 ? "bf16" : "fp32",
	       cfg->lr, cfg->device);

	long every = cfg->steps > 200 ? 10 : 1;
	double first = 0, loss = 0;
	for (long step = 1; step <= cfg->steps; step++) {
		for (int t = 0; t < N_TENSORS; t++)
			if (dev_copy(&dv, hparam[t], param[t], tensor_numel[t] * esize, false) < 0)
				goto out;
		if (cfg->bf16)
			for (int t = 0; t < N_TENSORS; t++)
				for (uint64_t i = 0; i < tensor_numel[t]; i++)
					m.p[t][i] = bf16_to_f32(p16[t][i]);
		loss = forward(&m, &data, dpred);
		if (step == 1)
			first = loss;
		if (!isfinite(loss)) {
			fprintf(stderr, "aoq-demo: loss is %g at step %ld\n", loss, step);
			ret = 1;
			goto out;
		}
		if (step % every == 0 || step == 1 || step == cfg->steps)
			printf("step %ld loss %.6g\n", step, loss);

		/* Backward, last layer first; each gradient goes to the daemon
		 * as soon as it is final. */
		static const int order[N_TENSORS] = { T_B2, T_W2, T_B1, T_W1 };
		for (int k = 0; k < N_TENSORS; k++) {
			int t = order[k];
			if (t == T_B2)
				backward_layer2(dpred, &g);
			else if (t == T_B1)
				backward_layer1(dpred, &m, &data, &g);
			if (cfg->bf16)
				for (uint64_t i = 0; i < tensor_numel[t]; i++)
					g16[t][i] = f32_to_bf16(g.p[t][i]);
			if (dev_copy(&dv, hgrad[t], grad[t], tensor_numel[t] * esize, true) < 0)
				goto out;
			r = aoq_push_grad(c, (uint32_t)t, 0, NULL);
			if (r < 0) {
				fail("aoq_push_grad", r);
				goto out;
			}
		}
		r = aoq_step_end(c);
		if (r < 0) {
			fail("aoq_step_end", r);
			goto out;
		}
		struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
		r = aoq_sync(c, &res);
		if (r < 0) {
			fail("aoq_sync", r);
			goto out;
		}
		if (res.nonfinite)
			fprintf(stderr, "aoq-demo: step %" PRIu64 " skipped: non-finite gradient\n", res.step);
	}

	/* The loss after the last update. */
	for (int t = 0; t < N_TENSORS; t++)
		if (dev_copy(&dv, hparam[t], param[t], tensor_numel[t] * esize, false) < 0)
			goto out;
	if (cfg->bf16)
		for (int t = 0; t < N_TENSORS; t++)
			for (uint64_t i = 0; i < tensor_numel[t]; i++)
				m.p[t][i] = bf16_to_f32(p16[t][i]);
	loss = forward(&m, &data, NULL);
	double ratio = first / loss;
	printf("first loss %.6g, last loss %.6g, ratio %.1fx (need %.0fx): %s\n", first, loss, ratio,
	       MIN_RATIO, ratio >= MIN_RATIO ? "ok" : "FAILED");
	ret = ratio >= MIN_RATIO ? 0 : 1;
out:
	aoq_close(c);
	dev_close(&dv);
	return ret;
}

static const char usage_text[] =
	"Usage: aoq-demo [OPTIONS]\n"
	"\n"
	"Trains a 16-64-1 tanh MLP on synthetic regression data with AdamW running in aoqd.\n"
	"Prints the loss every step (every 10th with more than 200 steps) and fails unless\n"
	"the loss falls at least 10x.\n"
	"\n"
	"  --socket PATH         aoqd's socket (default: $AOQ_SOCKET, else the default path)\n"
	"  --device DEV          cpu, cuda:N or xpu:N (default: cuda:0 when built with\n"
	"                        CUDA and a device is present, else cpu)\n"
	"  --steps N             training steps (default: 200)\n"
	"  --lr LR               AdamW learning rate (default: 0.01)\n"
	"  --job NAME            job name of the session (default: aoq-demo)\n"
	"  --rank N              rank of the session (default: 0)\n"
	"  --bf16                bf16 params and grads with an fp32 master in the daemon\n"
	"  --spawn-daemon PATH   start the aoqd at PATH on a private socket for this run\n"
	"  --help                this text\n";

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...)
{
	va_list ap;
	fputs("aoq-demo: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs(" (see aoq-demo --help)\n", stderr);
	return 2;
}

static bool parse_long(const char *s, long lo, long hi, long *out)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < lo || v > hi)
		return false;
	*out = v;
	return true;
}

int main(int argc, char **argv)
{
	enum { O_SOCKET = 256, O_DEVICE, O_STEPS, O_LR, O_JOB, O_RANK, O_BF16, O_SPAWN, O_HELP };
	static const struct option longopts[] = {
		{ "socket", required_argument, NULL, O_SOCKET },
		{ "device", required_argument, NULL, O_DEVICE },
		{ "steps", required_argument, NULL, O_STEPS },
		{ "lr", required_argument, NULL, O_LR },
		{ "job", required_argument, NULL, O_JOB },
		{ "rank", required_argument, NULL, O_RANK },
		{ "bf16", no_argument, NULL, O_BF16 },
		{ "spawn-daemon", required_argument, NULL, O_SPAWN },
		{ "help", no_argument, NULL, O_HELP },
		{ NULL, 0, NULL, 0 },
	};
	struct config cfg = {
		.device = NULL, /* cuda:0 when built with CUDA and a device is present, else cpu */
		.job = "aoq-demo",
		.steps = 200,
		.lr = 1e-2,
	};
	const char *spawn = NULL;
	long v;
	char *end;
	int c;

	opterr = 0;
	while ((c = getopt_long(argc, argv, ":", longopts, NULL)) != -1) {
		switch (c) {
		case O_SOCKET: cfg.socket = optarg; break;
		case O_DEVICE: cfg.device = optarg; break;
		case O_JOB: cfg.job = optarg; break;
		case O_BF16: cfg.bf16 = true; break;
		case O_SPAWN: spawn = optarg; break;
		case O_HELP: fputs(usage_text, stdout); return 0;
		case O_STEPS:
			if (!parse_long(optarg, 1, 10000000, &cfg.steps))
				return usage_error("--steps: '%s' is not a whole number in 1..10000000", optarg);
			break;
		case O_RANK:
			if (!parse_long(optarg, 0, UINT32_MAX, &v))
				return usage_error("--rank: '%s' is not a whole number in 0..%" PRIu32, optarg, UINT32_MAX);
			cfg.rank = (uint32_t)v;
			break;
		case O_LR:
			errno = 0;
			cfg.lr = strtod(optarg, &end);
			if (errno || end == optarg || *end || !(cfg.lr > 0) || !isfinite(cfg.lr))
				return usage_error("--lr: '%s' is not a positive number", optarg);
			break;
		case ':':
			return usage_error("option '%s' needs a value", argv[optind - 1]);
		default:
			return usage_error("unknown option '%s'", argv[optind - 1]);
		}
	}
	if (optind != argc)
		return usage_error("unexpected argument '%s'", argv[optind]);
	if (!cfg.device) {
		cfg.device = "cpu";
#if AOQ_DEMO_CUDA
		if (cuda_device_present())
			cfg.device = "cuda:0";
#endif
	}

	struct spawned sp;
	if (spawn) {
		if (cfg.socket)
			fprintf(stderr, "aoq-demo: --socket is ignored with --spawn-daemon\n");
		if (spawn_daemon(spawn, &sp) < 0)
			return 1;
		cfg.socket = sp.path;
	}
	int r = train(&cfg);
	fflush(stdout);
	if (spawn && stop_daemon(&sp) < 0)
		r = -1;
	return r == 0 ? 0 : 1;
}
