/* SPDX-License-Identifier: MIT */
/*
 * Device backends of libaoq (docs/design.md, Client backends): how gradients leave the device and
 * parameters return to it.  One small interface, three implementations:
 * host (plain memory, device string "cpu"), cuda ("cuda:N"), ze ("xpu:N").
 *
 * Threads: d2h/h2d/stream_wait are called from the trainer's threads and
 * from the client's progress thread; an implementation serialises what it
 * must.  Completion callbacks run on any thread and must only post work
 * (they call no backend function).
 */
#ifndef AOQ_CLIENT_BACKEND_H
#define AOQ_CLIENT_BACKEND_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "aoq/aoq.h"
#include "error.h"

struct aoq_backend;
struct aoq_event; /* a backend's completion marker; NULL means "already complete" */

typedef void (*aoq_done_fn)(void *arg, int status);

/* A traced copy's times (aoqctl trace), CLOCK_MONOTONIC ns: the backend
 * stores start_ns, then end_ns (release) once the bytes have arrived; the
 * library reads end_ns (acquire) and then start_ns.  NULL `tm`: not traced,
 * and a backend does nothing extra.  How each backend times is written in
 * its header comment. */
struct aoq_copy_time {
	_Atomic uint64_t start_ns, end_ns;
};

static inline uint64_t aoq_mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void aoq_copy_time_start(struct aoq_copy_time *tm)
{
	if (tm)
		atomic_store_explicit(&tm->start_ns, aoq_mono_ns(), memory_order_relaxed);
}

static inline void aoq_copy_time_end(struct aoq_copy_time *tm)
{
	if (tm) {
		uint64_t t = aoq_mono_ns();
		if (t == 0)
			t = 1; /* 0 means "not yet" */
		atomic_store_explicit(&tm->end_ns, t, memory_order_release);
	}
}

struct aoq_backend_ops {
	const char *name;
	/* index: N of "cuda:N"/"xpu:N" (0 for "cpu").  Errors: -ENODEV with a
	 * message (aoq_set_error) when there is no such device or runtime. */
	int (*open)(struct aoq_backend **out, int index, const struct aoq_options *o);
	void (*close)(struct aoq_backend *b);
	/* Pins host memory (the arena) for DMA at its exact size. */
	int (*register_host)(struct aoq_backend *b, void *ptr, size_t len);
	void (*unregister_host)(struct aoq_backend *b, void *ptr, size_t len);
	/* Optional: pins a read-only mapping (the masters memfd, aoq-arena.h)
	 * for DMA.  NULL, or an error: copies read it as pageable memory. */
	int (*register_host_ro)(struct aoq_backend *b, void *ptr, size_t len);
	void (*unregister_host_ro)(struct aoq_backend *b, void *ptr, size_t len);
	/* Copies device src -> host dst after the work queued on `stream` so far
	 * (NULL: the backend's default) and returns without waiting; done(arg, 0)
	 * runs once the bytes are in dst (may run before d2h returns).  tm:
	 * see struct aoq_copy_time (end_ns is stored before done runs). */
	int (*d2h)(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
	           aoq_done_fn done, void *arg, struct aoq_copy_time *tm);
	/* Optional: as d2h, and also after `after` (an event from h2d or
	 * h2d_after), without blocking the host.  The delayed update with the
	 * master as the parameter posts a gradient's record only once the copy
	 * of the master it follows has landed (aoq-arena.h).  NULL: the library
	 * waits for `after` on the host before d2h. */
	int (*d2h_after)(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
	                 struct aoq_event *after, aoq_done_fn done, void *arg, struct aoq_copy_time *tm);
	/* Copies host src -> device dst after the work queued on `stream` so far
	 * and returns an event marking its completion in *ev (NULL when done). */
	int (*h2d)(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
	           struct aoq_event **ev, struct aoq_copy_time *tm);
	/* Optional (NULL where every copy is synchronous).  record: an event
	 * marking the work queued on `stream` so far.  h2d_after: as h2d, but
	 * ordered after `after` (an event from record) instead of `stream`. The
	 * library records at push time, when the gradient is final and the old
	 * parameter is no longer used, so the copy back does not wait for the
	 * rest of backward. */
	int (*record)(struct aoq_backend *b, void *stream, struct aoq_event **ev);
	int (*h2d_after)(struct aoq_backend *b, void *dst, const void *src, size_t bytes,
	                 struct aoq_event *after, struct aoq_event **ev, struct aoq_copy_time *tm);
	/* Makes `stream` wait for ev without blocking the host. */
	int (*stream_wait)(struct aoq_backend *b, struct aoq_event *ev, void *stream);
	/* Blocks the host until ev is complete. */
	int (*host_wait)(struct aoq_backend *b, struct aoq_event *ev);
	void (*event_release)(struct aoq_backend *b, struct aoq_event *ev);
	/* Synchronous copies for registration and checkpoints. */
	int (*copy_to_host)(struct aoq_backend *b, void *dst, const void *src, size_t bytes);
	int (*copy_to_device)(struct aoq_backend *b, void *dst, const void *src, size_t bytes);
};

extern const struct aoq_backend_ops aoq_backend_host;
extern const struct aoq_backend_ops aoq_backend_cuda; /* stub when built without CUDA */
extern const struct aoq_backend_ops aoq_backend_ze;   /* stub when built without Level Zero */

/* Parses "cpu", "cuda:N", "xpu:N" into ops + index; -EINVAL otherwise. */
int aoq_backend_lookup(const char *device, const struct aoq_backend_ops **ops, int *index);

#endif
