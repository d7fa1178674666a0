/* SPDX-License-Identifier: MIT */
/*
 * The CUDA backend of libaoq ("cuda:N"; docs/design.md, Data plane, The path
 * of one gradient, Client backends).
 *
 * - The arena is pinned in place with cudaHostRegister at its exact size:
 *   DMA goes straight between device tensors and the shared memory the
 *   daemon reads, with no bounce buffer and no framework pinned pool.
 * - Two private copy streams (cudaStreamNonBlocking), one per direction,
 *   so gradients leaving and parameters arriving never queue behind each
 *   other, nor behind the trainer's compute.
 * - Gradient copy: an event recorded on the trainer's stream orders the
 *   copy after the work that produced the gradient; completion is reported
 *   by a host function enqueued behind the copy (cudaLaunchHostFunc), so
 *   nothing spins.  The host function only calls the library's `done`,
 *   which posts the ring record: it makes no CUDA call.
 * - Parameter copy: an event recorded on the trainer's stream when the
 *   daemon's record arrives orders the copy after every use of the old
 *   value enqueued so far; the copy's completion event is returned, and
 *   aoq_wait_param() makes the trainer's stream wait on it
 *   (cudaStreamWaitEvent) without blocking the host.
 * - Tracing (aoqctl trace; only when libaoq passes a struct aoq_copy_time):
 *   a host function enqueued on the copy stream just before the copy
 *   stamps its start, and one just after (for a gradient, the completion
 *   function itself) stamps its end, both CLOCK_MONOTONIC on the host.
 *   The stream reaches the first only once the copy's waits are satisfied,
 *   so the span is the copy itself to within the host-function latency (a
 *   few microseconds), in the daemon's clock, with no event-to-host clock
 *   conversion; the cost (two host-function round trips per copy, which
 *   the copy stream waits for) is paid only while a trace is on.
 * - Events come from a pool (cudaEventDisableTiming|cudaEventBlockingSync:
 *   no timing overhead, and a host wait sleeps instead of spinning).
 *
 * Streams: a NULL stream means the legacy default stream, which orders
 * after every blocking stream of the device (the library substitutes the
 * options' cuda_stream first).  A caller's cudaStream_t is used as given.
 *
 * Device: every entry point makes device N current for the call and
 * restores the caller's current device before returning, so the trainer's
 * threads keep whatever device they had chosen.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "aoq-arena.h"
#include "backend.h"

struct aoq_event {
	cudaEvent_t ev;
	struct aoq_event *next;     /* free list */
	struct aoq_event *all_next; /* every event, for close */
};

struct aoq_backend {
	int device;
	cudaStream_t d2h, h2d;
	cudaStream_t user; /* the options' stream: initial values and checkpoints */
	pthread_mutex_t lock;
	struct aoq_event *free_events;
	struct aoq_event *all_events;
	void *registered;
	size_t registered_len;
	/* the masters memfds' mappings, one registration each */
	void *registered_ro[AOQ_MASTER_MEMFDS];
	size_t registered_ro_len[AOQ_MASTER_MEMFDS];
};

/* A completion handed to the CUDA host-function thread. */
struct host_done {
	aoq_done_fn done;
	void *arg;
	struct aoq_copy_time *tm;
};

static int cuda_errno(cudaError_t e)
{
	switch (e) {
	case cudaSuccess: return 0;
	case cudaErrorMemoryAllocation: return -ENOMEM;
	case cudaErrorInvalidValue:
	case cudaErrorInvalidDevicePointer:
	case cudaErrorInvalidResourceHandle: return -EINVAL;
	case cudaErrorNoDevice:
	case cudaErrorInsufficientDriver:
	case cudaErrorStubLibrary:
	case cudaErrorInvalidDevice: return -ENODEV;
	default: return -EIO;
	}
}

/* Sets the thread's error text from a failed CUDA call; returns -errno. */
static int cuda_fail(cudaError_t e, const char *what)
{
	return aoq_set_error(cuda_errno(e), "CUDA: %s failed: %s (%s)", what, cudaGetErrorName(e),
	                     cudaGetErrorString(e));
}

#define CU(call, what)                                  \
	do {                                            \
		cudaError_t e_ = (call);                \
		if (e_ != cudaSuccess) {                \
			r = cuda_fail(e_, what);        \
			goto out;                       \
		}                                       \
	} while (0)

/* Makes the backend's device current; *prev receives the caller's. */
static int dev_enter(struct aoq_backend *b, int *prev)
{
	if (cudaGetDevice(prev) != cudaSuccess)
		*prev = -1;
	if (*prev == b->device)
		return 0;
	cudaError_t e = cudaSetDevice(b->device);
	return e == cudaSuccess ? 0 : cuda_fail(e, "cudaSetDevice");
}

static void dev_leave(struct aoq_backend *b, int prev)
{
	if (prev >= 0 && prev != b->device)
		cudaSetDevice(prev);
}

/* ---- event pool ---- */

static int event_get(struct aoq_backend *b, struct aoq_event **out)
{
	pthread_mutex_lock(&b->lock);
	struct aoq_event *x = b->free_events;
	if (x)
		b->free_events = x->next;
	pthread_mutex_unlock(&b->lock);
	if (!x) {
		x = calloc(1, sizeof(*x));
		if (!x)
			return aoq_set_error(-ENOMEM, "out of memory");
		cudaError_t e = cudaEventCreateWithFlags(&x->ev, cudaEventDisableTiming | cudaEventBlockingSync);
		if (e != cudaSuccess) {
			free(x);
			return cuda_fail(e, "cudaEventCreateWithFlags");
		}
		pthread_mutex_lock(&b->lock);
		x->all_next = b->all_events;
		b->all_events = x;
		pthread_mutex_unlock(&b->lock);
	}
	x->next = NULL;
	*out = x;
	return 0;
}

static void event_put(struct aoq_backend *b, struct aoq_event *x)
{
	if (!x)
		return;
	pthread_mutex_lock(&b->lock);
	x->next = b->free_events;
	b->free_events = x;
	pthread_mutex_unlock(&b->lock);
}

/* Makes `copy` wait for the work enqueued on `trainer` so far.  The event
 * goes back to the pool at once: a stream wait captures the event's last
 * record when it is enqueued, later records do not affect it. */
static int order_after(struct aoq_backend *b, cudaStream_t copy, void *trainer)
{
	struct aoq_event *x;
	int r = event_get(b, &x);
	if (r < 0)
		return r;
	CU(cudaEventRecord(x->ev, (cudaStream_t)trainer), "cudaEventRecord on the trainer's stream");
	CU(cudaStreamWaitEvent(copy, x->ev, 0), "cudaStreamWaitEvent");
	r = 0;
out:
	event_put(b, x);
	return r;
}

/* ---- open, close ---- */

static const char *no_device_name(cudaError_t e)
{
	switch (e) {
	case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
	case cudaErrorStubLibrary: return "cudaErrorStubLibrary";
	case cudaErrorNoDevice: return "cudaErrorNoDevice";
	default: return NULL;
	}
}

static void cuda_close(struct aoq_backend *b);

static int cuda_open(struct aoq_backend **out, int index, const struct aoq_options *o)
{
	int n = 0;
	cudaError_t e = cudaGetDeviceCount(&n);
	if (e != cudaSuccess) {
		const char *name = no_device_name(e);
		cudaGetLastError();
		if (name)
			return aoq_set_error(-ENODEV, "no CUDA device (%s)", name);
		return aoq_set_error(-ENODEV, "no CUDA device: the CUDA runtime failed to start (%s: %s)",
		                     cudaGetErrorName(e), cudaGetErrorString(e));
	}
	if (n <= 0)
		return aoq_set_error(-ENODEV, "no CUDA device (cudaErrorNoDevice)");
	if (index >= n)
		return aoq_set_error(-ENODEV, "no CUDA device cuda:%d (this machine has %d)", index, n);

	struct aoq_backend *b = calloc(1, sizeof(*b));
	if (!b)
		return aoq_set_error(-ENOMEM, "out of memory");
	b->device = index;
	b->user = (cudaStream_t)o->cuda_stream;
	pthread_mutex_init(&b->lock, NULL);
	int prev, r = dev_enter(b, &prev);
	if (r < 0) {
		pthread_mutex_destroy(&b->lock);
		free(b);
		return r;
	}
	CU(cudaStreamCreateWithFlags(&b->d2h, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (D2H)");
	CU(cudaStreamCreateWithFlags(&b->h2d, cudaStreamNonBlocking), "cudaStreamCreateWithFlags (H2D)");
	r = 0;
out:
	dev_leave(b, prev);
	if (r < 0) {
		cuda_close(b);
		return r;
	}
	*out = b;
	return 0;
}

static void cuda_close(struct aoq_backend *b)
{
	int prev;
	if (dev_enter(b, &prev) == 0) {
		if (b->d2h)
			cudaStreamSynchronize(b->d2h);
		if (b->h2d)
			cudaStreamSynchronize(b->h2d);
		if (b->registered)
			cudaHostUnregister(b->registered);
		for (unsigned k = 0; k < AOQ_MASTER_MEMFDS; k++)
			if (b->registered_ro[k])
				cudaHostUnregister(b->registered_ro[k]);
		for (struct aoq_event *x = b->all_events, *next; x; x = next) {
			next = x->all_next;
			cudaEventDestroy(x->ev);
			free(x);
		}
		if (b->d2h)
			cudaStreamDestroy(b->d2h);
		if (b->h2d)
			cudaStreamDestroy(b->h2d);
		dev_leave(b, prev);
	}
	pthread_mutex_destroy(&b->lock);
	free(b);
}

/* ---- pinning ---- */

/* Pins [p, p + len) with `flags` into *slot (one mapping each: the arena,
 * or a masters memfd); `what` names it in errors. */
static int pin(struct aoq_backend *b, void *p, size_t len, unsigned flags, void **slot, size_t *slot_len,
               const char *what)
{
	if (*slot)
		return aoq_set_error(-EBUSY, "CUDA backend: %s is already registered", what);
	int prev, r = dev_enter(b, &prev);
	if (r < 0)
		return r;
	/* Exact size, no rounding; the mapping is a sealed memfd MAP_SHARED. */
	cudaError_t e = cudaHostRegister(p, len, flags);
	if (e != cudaSuccess) {
		r = aoq_set_error(cuda_errno(e), "CUDA: cannot pin %s (%zu bytes) for DMA: %s (%s)%s", what, len,
		                  cudaGetErrorName(e), cudaGetErrorString(e),
		                  e == cudaErrorMemoryAllocation ? " (check the memlock limit: ulimit -l)" : "");
		cudaGetLastError(); /* not sticky: clear it */
	} else {
		*slot = p;
		*slot_len = len;
	}
	dev_leave(b, prev);
	return r;
}

static void unpin(struct aoq_backend *b, void *p, void **slot, size_t *slot_len)
{
	if (!*slot || *slot != p)
		return;
	int prev;
	if (dev_enter(b, &prev) < 0)
		return;
	/* No copy may still use the mapping once it is unpinned and unmapped. */
	cudaStreamSynchronize(b->d2h);
	cudaStreamSynchronize(b->h2d);
	cudaHostUnregister(p);
	*slot = NULL;
	*slot_len = 0;
	dev_leave(b, prev);
}

static int cuda_register(struct aoq_backend *b, void *p, size_t len)
{
	return pin(b, p, len, cudaHostRegisterDefault, &b->registered, &b->registered_len, "the arena");
}

/* A masters memfd: mapped read-only, so pinned with
 * cudaHostRegisterReadOnly (the device only reads it); up to
 * AOQ_MASTER_MEMFDS of them, each its own registration. */
static int cuda_register_ro(struct aoq_backend *b, void *p, size_t len)
{
	unsigned k = 0;
	while (k < AOQ_MASTER_MEMFDS && b->registered_ro[k])
		k++;
	if (k == AOQ_MASTER_MEMFDS)
		return aoq_set_error(-EBUSY, "CUDA backend: %u masters mappings are registered already",
		                     (unsigned)AOQ_MASTER_MEMFDS);
	return pin(b, p, len, cudaHostRegisterReadOnly, &b->registered_ro[k], &b->registered_ro_len[k],
	           "a masters mapping (read-only)");
}

static void cuda_unregister_ro(struct aoq_backend *b, void *p, size_t len)
{
	(void)len;
	for (unsigned k = 0; k < AOQ_MASTER_MEMFDS; k++)
		if (b->registered_ro[k] == p)
			unpin(b, p, &b->registered_ro[k], &b->registered_ro_len[k]);
}

static void cuda_unregister(struct aoq_backend *b, void *p, size_t len)
{
	(void)len;
	unpin(b, p, &b->registered, &b->registered_len);
}

/* ---- streaming copies ---- */

/* Runs on the CUDA runtime's host-function thread: no CUDA calls here. */
static void CUDART_CB host_done_fn(void *p)
{
	struct host_done *h = p;
	aoq_done_fn done = h->done;
	void *arg = h->arg;
	aoq_copy_time_end(h->tm);
	free(h);
	done(arg, 0);
}

/* Tracing: host functions that stamp a copy's start and end (no CUDA calls). */
static void CUDART_CB stamp_start_fn(void *p)
{
	aoq_copy_time_start(p);
}

static void CUDART_CB stamp_end_fn(void *p)
{
	aoq_copy_time_end(p);
}

static int cuda_d2h_after(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
                          struct aoq_event *after, aoq_done_fn done, void *arg, struct aoq_copy_time *tm)
{
	struct host_done *h = malloc(sizeof(*h));
	if (!h)
		return aoq_set_error(-ENOMEM, "out of memory");
	h->done = done;
	h->arg = arg;
	h->tm = tm;
	int prev, r = dev_enter(b, &prev);
	if (r < 0) {
		free(h);
		return r;
	}
	if ((r = order_after(b, b->d2h, stream)) < 0)
		goto out;
	if (after)
		CU(cudaStreamWaitEvent(b->d2h, after->ev, 0), "cudaStreamWaitEvent (parameter copy)");
	if (tm)
		CU(cudaLaunchHostFunc(b->d2h, stamp_start_fn, tm), "cudaLaunchHostFunc (trace)");
	CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, b->d2h), "cudaMemcpyAsync (gradient)");
	CU(cudaLaunchHostFunc(b->d2h, host_done_fn, h), "cudaLaunchHostFunc");
	h = NULL; /* the host function owns it now */
	r = 0;
out:
	free(h);
	dev_leave(b, prev);
	return r;
}

static int cuda_d2h(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
                    aoq_done_fn done, void *arg, struct aoq_copy_time *tm)
{
	return cuda_d2h_after(b, dst, src, bytes, stream, NULL, done, arg, tm);
}

static int cuda_record(struct aoq_backend *b, void *stream, struct aoq_event **ev)
{
	struct aoq_event *x = NULL;
	*ev = NULL;
	int prev, r = dev_enter(b, &prev);
	if (r < 0)
		return r;
	if ((r = event_get(b, &x)) < 0)
		goto out;
	CU(cudaEventRecord(x->ev, (cudaStream_t)stream), "cudaEventRecord on the trainer's stream");
	*ev = x;
	x = NULL;
	r = 0;
out:
	event_put(b, x);
	dev_leave(b, prev);
	return r;
}

static int cuda_h2d_after(struct aoq_backend *b, void *dst, const void *src, size_t bytes,
                          struct aoq_event *after, struct aoq_event **ev, struct aoq_copy_time *tm)
{
	struct aoq_event *x = NULL;
	*ev = NULL;
	int prev, r = dev_enter(b, &prev);
	if (r < 0)
		return r;
	if (after)
		CU(cudaStreamWaitEvent(b->h2d, after->ev, 0), "cudaStreamWaitEvent");
	if (tm)
		CU(cudaLaunchHostFunc(b->h2d, stamp_start_fn, tm), "cudaLaunchHostFunc (trace)");
	CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, b->h2d), "cudaMemcpyAsync (parameter)");
	if (tm)
		CU(cudaLaunchHostFunc(b->h2d, stamp_end_fn, tm), "cudaLaunchHostFunc (trace)");
	if ((r = event_get(b, &x)) < 0)
		goto out;
	CU(cudaEventRecord(x->ev, b->h2d), "cudaEventRecord (parameter copy)");
	*ev = x;
	x = NULL;
	r = 0;
out:
	event_put(b, x);
	dev_leave(b, prev);
	return r;
}

/* A parameter copy ordered after the work queued on the trainer's stream
 * so far: record, then h2d_after. */
static int cuda_h2d(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
                    struct aoq_event **ev, struct aoq_copy_time *tm)
{
	struct aoq_event *after;
	*ev = NULL;
	int r = cuda_record(b, stream, &after);
	if (r < 0)
		return r;
	r = cuda_h2d_after(b, dst, src, bytes, after, ev, tm);
	event_put(b, after);
	return r;
}

static int cuda_stream_wait(struct aoq_backend *b, struct aoq_event *ev, void *stream)
{
	if (!ev)
		return 0;
	int prev, r = dev_enter(b, &prev);
	if (r < 0)
		return r;
	CU(cudaStreamWaitEvent((cudaStream_t)stream, ev->ev, 0), "cudaStreamWaitEvent");
	r = 0;
out:
	dev_leave(b, prev);
	return r;
}

static int cuda_host_wait(struct aoq_backend *b, struct aoq_event *ev)
{
	if (!ev)
		return 0;
	int r;
	CU(cudaEventSynchronize(ev->ev), "cudaEventSynchronize");
	r = 0;
out:
	return r;
}

static void cuda_event_release(struct aoq_backend *b, struct aoq_event *ev)
{
	event_put(b, ev);
}

/* ---- synchronous copies (registration, checkpoints) ---- */

/* Ordered on the options' stream (NULL: the legacy default stream, which
 * follows every blocking stream), so values written there are read. */
static int sync_copy(struct aoq_backend *b, void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind)
{
	int prev, r = dev_enter(b, &prev);
	if (r < 0)
		return r;
	CU(cudaMemcpyAsync(dst, src, bytes, kind, b->user), "cudaMemcpyAsync");
	CU(cudaStreamSynchronize(b->user), "cudaStreamSynchronize");
	r = 0;
out:
	dev_leave(b, prev);
	return r;
}

static int cuda_copy_to_host(struct aoq_backend *b, void *dst, const void *src, size_t bytes)
{
	return sync_copy(b, dst, src, bytes, cudaMemcpyDeviceToHost);
}

static int cuda_copy_to_device(struct aoq_backend *b, void *dst, const void *src, size_t bytes)
{
	return sync_copy(b, dst, src, bytes, cudaMemcpyHostToDevice);
}

const struct aoq_backend_ops aoq_backend_cuda = {
	.name = "cuda",
	.open = cuda_open,
	.close = cuda_close,
	.register_host = cuda_register,
	.unregister_host = cuda_unregister,
	.register_host_ro = cuda_register_ro,
	.unregister_host_ro = cuda_unregister_ro,
	.d2h = cuda_d2h,
	.d2h_after = cuda_d2h_after,
	.h2d = cuda_h2d,
	.record = cuda_record,
	.h2d_after = cuda_h2d_after,
	.stream_wait = cuda_stream_wait,
	.host_wait = cuda_host_wait,
	.event_release = cuda_event_release,
	.copy_to_host = cuda_copy_to_host,
	.copy_to_device = cuda_copy_to_device,
};
