/* SPDX-License-Identifier: MIT */
/*
 * The Level Zero backend through the real loader and the host-memory test
 * driver (tests/ze-driver), with random command delays (AOQ_ZE_DELAY_US).
 *
 *   test-ze AOQD train        caller's context/device; ze_queue = the
 *                             trainer's immediate list as default stream
 *   test-ze AOQD train-own    the backend's own context, no streams
 *   test-ze AOQD accumulate   3 micro-batches per step (AOQ_PUSH_ACCUMULATE)
 *   test-ze AOQD offload      a fresh device grad buffer per push, poisoned
 *                             and freed as soon as aoq_grad_pending() says 0
 *   test-ze AOQD no-driver    ZE_ENABLE_ALT_DRIVERS names no file
 *
 * Every training mode runs two sessions against one aoqd with the same
 * initial values and gradients: "cpu" (the host backend, host memory) and
 * "xpu:0" (parameters and gradients in zeMemAllocDevice memory, moved in and
 * out by the test's own immediate list).  After every step every parameter
 * of the xpu session must equal the cpu session's bit for bit, and at the
 * end the driver must have seen no unordered copy (its violations counter).
 * Gradients are written to the device on the trainer's list right before
 * the push and parameters are read back on it right after aoq_wait_param(),
 * so a missing ordering shows up as wrong bytes or a violation.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include <ze_api.h>

#include "aoq-ze-testdriver.h"
#include "harness.h"


#define NT 7
#define NSTEPS 10

struct tdesc {
	uint64_t n;
	enum aoq_dtype gd, pd;
	uint32_t group;
};

static const struct tdesc desc[NT] = {
	{ 1, AOQ_FP32, AOQ_FP32, 0 },
	{ 3, AOQ_BF16, AOQ_BF16, 1 },
	{ 4097, AOQ_FP16, AOQ_FP32, 0 },
	{ (1u << 16) + 5, AOQ_FP32, AOQ_BF16, 1 },
	{ 4097, AOQ_BF16, AOQ_FP16, 0 },
	{ (1u << 16) + 5, AOQ_FP16, AOQ_FP16, 1 },
	{ 3, AOQ_FP32, AOQ_FP16, 0 },
};

enum mode { TRAIN, TRAIN_OWN, ACCUMULATE, OFFLOAD };

#define ZE_CHECK(call)                                                                        \
	do {                                                                                  \
		ze_result_t zr_ = (call);                                                     \
		if (zr_ != ZE_RESULT_SUCCESS)                                                 \
			aoqt_fail("%s failed: 0x%08x", #call, (unsigned)zr_);                 \
	} while (0)

/* The trainer's side of Level Zero: its context, device and immediate list. */
struct zenv {
	ze_driver_handle_t drv;
	ze_device_handle_t dev;
	ze_context_handle_t ctx;
	ze_command_list_handle_t list;
	ze_event_pool_handle_t pool;
	ze_event_handle_t ev;
};

static void zenv_open(struct zenv *z)
{
	ZE_CHECK(zeInit(0));
	uint32_t n = 1;
	ZE_CHECK(zeDriverGet(&n, &z->drv));
	CHECK(n == 1, "no driver");
	n = 1;
	ZE_CHECK(zeDeviceGet(z->drv, &n, &z->dev));
	CHECK(n == 1, "no device");
	ze_context_desc_t cd = { .stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC };
	ZE_CHECK(zeContextCreate(z->drv, &cd, &z->ctx));
	ze_command_queue_desc_t qd = { .stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
	                               .mode = ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS };
	ZE_CHECK(zeCommandListCreateImmediate(z->ctx, z->dev, &qd, &z->list));
	ze_event_pool_desc_t pd = { .stype = ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
	                            .flags = ZE_EVENT_POOL_FLAG_HOST_VISIBLE, .count = 1 };
	ZE_CHECK(zeEventPoolCreate(z->ctx, &pd, 1, &z->dev, &z->pool));
	ze_event_desc_t ed = { .stype = ZE_STRUCTURE_TYPE_EVENT_DESC, .signal = ZE_EVENT_SCOPE_FLAG_HOST,
	                       .wait = ZE_EVENT_SCOPE_FLAG_HOST };
	ZE_CHECK(zeEventCreate(z->pool, &ed, &z->ev));
}

static void zenv_close(struct zenv *z)
{
	ZE_CHECK(zeEventDestroy(z->ev));
	ZE_CHECK(zeEventPoolDestroy(z->pool));
	ZE_CHECK(zeCommandListDestroy(z->list));
	ZE_CHECK(zeContextDestroy(z->ctx));
}

/* Blocks until everything queued on the trainer's list has run. */
static void list_sync(struct zenv *z)
{
	ZE_CHECK(zeCommandListAppendBarrier(z->list, z->ev, 0, NULL));
	ZE_CHECK(zeEventHostSynchronize(z->ev, UINT64_MAX));
	ZE_CHECK(zeEventHostReset(z->ev));
}

static void *dev_alloc(struct zenv *z, size_t bytes)
{
	ze_device_mem_alloc_desc_t dd = { .stype = ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC };
	void *p;
	ZE_CHECK(zeMemAllocDevice(z->ctx, &dd, bytes, 64, z->dev, &p));
	return p;
}

static void *host_alloc(struct zenv *z, size_t bytes)
{
	ze_host_mem_alloc_desc_t hd = { .stype = ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC };
	void *p;
	ZE_CHECK(zeMemAllocHost(z->ctx, &hd, bytes, 64, &p));
	return p;
}

static void copy(struct zenv *z, void *dst, const void *src, size_t bytes)
{
	ZE_CHECK(zeCommandListAppendMemoryCopy(z->list, dst, src, bytes, NULL, 0, NULL));
}

struct side {
	bool xpu;
	struct aoq_client *c;
	int idx[NT];
	void *param[NT]; /* host ("cpu") or device memory */
	void *grad[NT];
	void *hgrad[NT]; /* xpu: host source of the gradient copies */
	void *out[NT];   /* xpu: host copy of the parameters */
};

static struct aoq_group hp(uint32_t g, uint64_t k)
{
	struct aoq_group h = g == 0
		? (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
		                      .weight_decay = 0.05 }
		: (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 1e-3, .beta1 = 0.85, .beta2 = 0.995, .eps = 1e-7,
		                      .weight_decay = 0.01 };
	h.lr *= 1.0 + 0.25 * (double)((k * 7) % 5);
	return h;
}

static void open_side(struct side *s, struct zenv *z, enum mode m, const char *sock, const char *job,
                      float *const *init)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	o.job = job;
	o.device = s->xpu ? "xpu:0" : "cpu";
	if (s->xpu && m != TRAIN_OWN) {
		o.ze_context = z->ctx;
		o.ze_device = z->dev;
		o.ze_queue = z->list;
	}
	CHECK_OK(aoq_connect(&s->c, &o));
	for (uint32_t g = 0; g < 2; g++) {
		struct aoq_group h = hp(g, 1);
		CHECK_OK(aoq_add_group(s->c, &h));
	}
	for (int t = 0; t < NT; t++) {
		const struct tdesc *d = &desc[t];
		size_t pb = d->n * aoqt_dtype_size(d->pd), gb = d->n * aoqt_dtype_size(d->gd);
		void *p0 = aoqt_xmalloc(pb);
		for (uint64_t i = 0; i < d->n; i++)
			aoqt_store(p0, i, d->pd, init[t][i]);
		if (s->xpu) {
			s->param[t] = dev_alloc(z, pb);
			s->grad[t] = m == OFFLOAD ? NULL : dev_alloc(z, gb);
			s->hgrad[t] = host_alloc(z, gb);
			s->out[t] = host_alloc(z, pb);
			copy(z, s->param[t], p0, pb);
			list_sync(z);
			free(p0);
		} else {
			s->param[t] = p0;
			s->grad[t] = aoqt_xmalloc(gb);
		}
		char name[16];
		snprintf(name, sizeof(name), "t%d", t);
		struct aoq_tensor td = { .size = sizeof(struct aoq_tensor), .name = name, .numel = d->n, .param_dtype = d->pd, .grad_dtype = d->gd,
		                         .group = d->group, .param = s->param[t], .grad = s->grad[t] };
		s->idx[t] = aoq_add_tensor(s->c, &td);
		CHECK_OK(s->idx[t]);
	}
	CHECK_OK(aoq_register(s->c));
}

static void close_side(struct side *s, struct zenv *z)
{
	aoq_close(s->c);
	for (int t = 0; t < NT; t++) {
		if (s->xpu) {
			ZE_CHECK(zeMemFree(z->ctx, s->param[t]));
			if (s->grad[t])
				ZE_CHECK(zeMemFree(z->ctx, s->grad[t]));
			ZE_CHECK(zeMemFree(z->ctx, s->hgrad[t]));
			ZE_CHECK(zeMemFree(z->ctx, s->out[t]));
		} else {
			free(s->param[t]);
			free(s->grad[t]);
		}
	}
}

/* The gradient of micro-batch mb of tensor t at step k, in its dtype. */
static void make_grad(void *buf, int t, uint64_t k, int mb)
{
	const struct tdesc *d = &desc[t];
	struct aoqt_rng rng = aoqt_rng_for(k, (uint64_t)t, (uint64_t)mb);
	const double scale[3] = { 1.0, 3e-4, 0.07 };
	for (uint64_t i = 0; i < d->n; i++)
		aoqt_store(buf, i, d->gd, scale[(mb + (int)i) % 3] * aoqt_uniform(&rng));
}

/* The stream a push or wait of tensor t uses: the trainer's list or NULL
 * (the default: ze_queue, which is the same list; nothing in TRAIN_OWN). */
static void *stream_for(struct zenv *z, enum mode m, int t)
{
	return m != TRAIN_OWN && t % 2 ? z->list : NULL;
}

static void push_xpu(struct side *s, struct zenv *z, enum mode m, int t, uint64_t k, int mb, int nmb)
{
	size_t gb = desc[t].n * aoqt_dtype_size(desc[t].gd);
	unsigned flags = mb < nmb - 1 ? AOQ_PUSH_ACCUMULATE : 0;
	make_grad(s->hgrad[t], t, k, mb);
	void *g = s->grad[t];
	if (m == OFFLOAD)
		g = dev_alloc(z, gb);
	/* Queued on the trainer's list: the push must be ordered after it. */
	copy(z, g, s->hgrad[t], gb);
	if (m == TRAIN_OWN)
		list_sync(z); /* no stream to order against */
	CHECK_OK(aoq_push_grad_ptr(s->c, (uint32_t)s->idx[t], g, flags, stream_for(z, m, t)));
	if (m == OFFLOAD) {
		/* Poll, as the Python optimizer does: 0 pending means the buffer
		 * may be freed (a wrong 0 lets the poison below reach the daemon). */
		int n;
		while ((n = aoq_grad_pending(s->c, (uint32_t)s->idx[t])) > 0)
			usleep(20);
		CHECK_OK(n);
	} else if (mb < nmb - 1) {
		/* The buffer (and hgrad) may be reused or freed from here on. */
		CHECK_OK(aoq_grad_copied(s->c, (uint32_t)s->idx[t]));
	}
	if (m == OFFLOAD) {
		static const uint8_t poison[4] = { 0xff, 0xff, 0xff, 0xff }; /* NaN in every dtype */
		ZE_CHECK(zeCommandListAppendMemoryFill(z->list, g, poison, sizeof(poison), gb, NULL, 0, NULL));
		list_sync(z);
		ZE_CHECK(zeMemFree(z->ctx, g));
	}
}

static void push_cpu(struct side *s, int t, uint64_t k, int mb, int nmb)
{
	unsigned flags = mb < nmb - 1 ? AOQ_PUSH_ACCUMULATE : 0;
	make_grad(s->grad[t], t, k, mb);
	CHECK_OK(aoq_push_grad(s->c, (uint32_t)s->idx[t], flags, NULL));
	CHECK_OK(aoq_grad_copied(s->c, (uint32_t)s->idx[t]));
}

static size_t first_diff(const void *a, const void *b, size_t elems, size_t esize)
{
	for (size_t i = 0; i < elems; i++)
		if (memcmp((const uint8_t *)a + i * esize, (const uint8_t *)b + i * esize, esize))
			return i;
	return elems;
}

static void train(enum mode m, const char *sock)
{
	struct zenv z;
	zenv_open(&z);

	/* A device that does not exist is a clean error. */
	{
		struct aoq_options o = AOQ_OPTIONS_INIT;
		o.socket = sock;
		o.device = "xpu:7";
		struct aoq_client *c = NULL;
		int r = aoq_connect(&c, &o);
		CHECK(r == -ENODEV, "xpu:7: aoq_connect returned %d (%s), want -ENODEV", r, aoq_last_error());
		CHECK(strstr(aoq_last_error(), "xpu:7"), "message '%s' does not name the device", aoq_last_error());
	}

	float *init[NT];
	for (int t = 0; t < NT; t++) {
		init[t] = aoqt_xmalloc(desc[t].n * sizeof(float));
		struct aoqt_rng rng = aoqt_rng_for(0, (uint64_t)t, 11);
		for (uint64_t i = 0; i < desc[t].n; i++)
			init[t][i] = (float)(1.5 * aoqt_uniform(&rng));
	}
	char job[2][48];
	snprintf(job[0], sizeof(job[0]), "ze-cpu-%d", (int)getpid());
	snprintf(job[1], sizeof(job[1]), "ze-xpu-%d", (int)getpid());
	struct side cpu = { .xpu = false }, xpu = { .xpu = true };
	open_side(&cpu, &z, m, sock, job[0], init);
	open_side(&xpu, &z, m, sock, job[1], init);
	const char *mode = aoq_ze_staging_mode();
	printf("ze staging mode: %s\n", mode);
	CHECK(strcmp(mode, "staging") == 0, "staging mode '%s', want 'staging' (the test driver imports nothing)",
	      mode);

	int nmb = m == ACCUMULATE ? 3 : m == OFFLOAD ? 2 : 1;
	for (uint64_t k = 1; k <= NSTEPS; k++) {
		if (k > 1)
			for (uint32_t g = 0; g < 2; g++) {
				struct aoq_group h = hp(g, k);
				CHECK_OK(aoq_set_hyperparams(cpu.c, g, &h));
				CHECK_OK(aoq_set_hyperparams(xpu.c, g, &h));
			}
		/* Backward order: last tensor first; micro-batches interleave
		 * across tensors on even steps. */
		if (k % 2 == 0) {
			for (int mb = 0; mb < nmb; mb++)
				for (int t = NT - 1; t >= 0; t--) {
					push_cpu(&cpu, t, k, mb, nmb);
					push_xpu(&xpu, &z, m, t, k, mb, nmb);
				}
		} else {
			for (int t = NT - 1; t >= 0; t--)
				for (int mb = 0; mb < nmb; mb++) {
					push_cpu(&cpu, t, k, mb, nmb);
					push_xpu(&xpu, &z, m, t, k, mb, nmb);
				}
		}
		CHECK_OK(aoq_step_end(cpu.c));
		CHECK_OK(aoq_step_end(xpu.c));
		struct aoq_step_result rc = AOQ_STEP_RESULT_INIT, rx = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_sync(cpu.c, &rc));
		/* The next use of each parameter waits on the trainer's list
		 * without blocking the host, then reads it back. */
		for (int t = 0; t < NT; t++) {
			CHECK_OK(aoq_wait_param(xpu.c, (uint32_t)xpu.idx[t], stream_for(&z, m, t)));
			copy(&z, xpu.out[t], xpu.param[t], desc[t].n * aoqt_dtype_size(desc[t].pd));
		}
		list_sync(&z);
		CHECK_OK(aoq_sync(xpu.c, &rx));
		CHECK(rc.step == k && rx.step == k, "step results %" PRIu64 "/%" PRIu64 ", want %" PRIu64, rc.step,
		      rx.step, k);
		CHECK(!rc.nonfinite && !rx.nonfinite, "step %" PRIu64 ": non-finite gradient (cpu %d, xpu %d)", k,
		      rc.nonfinite, rx.nonfinite);
		CHECK(rx.tensors_updated == NT, "step %" PRIu64 ": xpu updated %" PRIu64 " tensors", k,
		      rx.tensors_updated);
		CHECK(fabs(rc.grad_sumsq - rx.grad_sumsq) <= 1e-12 * rc.grad_sumsq,
		      "step %" PRIu64 ": grad_sumsq cpu %.17g, xpu %.17g", k, rc.grad_sumsq, rx.grad_sumsq);
		for (int t = 0; t < NT; t++) {
			size_t es = aoqt_dtype_size(desc[t].pd);
			size_t i = first_diff(cpu.param[t], xpu.out[t], desc[t].n, es);
			CHECK(i == desc[t].n,
			      "step %" PRIu64 " tensor %d (%" PRIu64 " x %s param, %s grad): element %zu is 0x%x on xpu, "
			      "0x%x on cpu",
			      k, t, desc[t].n, aoq_dtype_name(desc[t].pd), aoq_dtype_name(desc[t].gd), i,
			      aoqt_bits(xpu.out[t], i, desc[t].pd), aoqt_bits(cpu.param[t], i, desc[t].pd));
		}
	}
	close_side(&xpu, &z);
	close_side(&cpu, &z);
	int64_t v = aoq_ze_testdriver_violations_loaded();
	CHECK(v == 0, "the test driver counted %" PRId64 " unordered copies (-1: driver not loaded)", v);
	for (int t = 0; t < NT; t++)
		free(init[t]);
	zenv_close(&z);
	printf("%d steps bit-exact against the host backend, 0 violations\n", NSTEPS);
}

static void no_driver(void)
{
	const char *alt = getenv("ZE_ENABLE_ALT_DRIVERS");
	CHECK(alt && access(alt, F_OK) != 0, "ZE_ENABLE_ALT_DRIVERS must name a missing file");
	for (int i = 0; i < 2; i++) {
		struct aoq_options o = AOQ_OPTIONS_INIT;
		o.socket = "/nonexistent/aoqd.sock";
		o.device = "xpu:0";
		struct aoq_client *c = NULL;
		int r = aoq_connect(&c, &o);
		CHECK(r == -ENODEV, "aoq_connect(xpu:0) without a driver returned %d, want -ENODEV", r);
		CHECK(c == NULL, "no client expected");
		const char *msg = aoq_last_error();
		printf("aoq_connect(xpu:0): %s\n", msg);
		CHECK(strstr(msg, "no Level Zero driver") && strstr(msg, "0x"),
		      "message '%s' should say there is no Level Zero driver and give the ze_result_t", msg);
	}
	CHECK(aoq_ze_testdriver_violations_loaded() == -1, "the test driver should not be loaded");
	printf("no driver: -ENODEV with a message, twice\n");
}

int main(int argc, char **argv)
{
	const char *what = argc > 2 ? argv[2] : "train";
	char name[64];
	snprintf(name, sizeof(name), "ze-%s", what);
	aoqt_init(name);
	if (strcmp(what, "no-driver") == 0) {
		no_driver();
		return 0;
	}
	enum mode m;
	if (strcmp(what, "train") == 0)
		m = TRAIN;
	else if (strcmp(what, "train-own") == 0)
		m = TRAIN_OWN;
	else if (strcmp(what, "accumulate") == 0)
		m = ACCUMULATE;
	else if (strcmp(what, "offload") == 0)
		m = OFFLOAD;
	else
		aoqt_fail("unknown mode '%s'", what);
	const char *exe = aoqt_aoqd_path(argc, argv);
	struct aoqt_daemon d;
	static const char *const args[] = { "--threads", "2", NULL };
	CHECK_OK(aoqt_daemon_start(&d, exe, args));
	train(m, d.socket);
	int st = aoqt_daemon_stop(&d, 10000, true);
	CHECK(st == 0, "aoqd exited with %d", st);
	return 0;
}
