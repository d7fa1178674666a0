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

#include <stdbool.h>
#include <stddef.h>

#include "aoq/aoq.h"

struct aoq_backend;
struct aoq_event; /* a backend's completion marker; NULL means "already complete" */

typedef void (*aoq_done_fn)(void *arg, int status);

struct aoq_backend_ops {
	const char *name;
	/* index: N of "cuda:N"/"xpu:N" (0 for "cpu").  Errors: -ENODEV with a
	 * message (aoq_set_error) when there is no such device or runtime. */
	int (*open)(struct aoq_backend **out, int index, const struct aoq_options *o);
	void (*close)(struct aoq_backend *b);
	/* Pins host memory (the arena) for DMA at its exact size. */
	int (*register_host)(struct aoq_backend *b, void *ptr, size_t len);
	void (*unregister_host)(struct aoq_backend *b, void *ptr, size_t len);
	/* Copies device src -> host dst after the work queued on `stream` so far
	 * (NULL: the backend's default) and returns without waiting; done(arg, 0)
	 * runs once the bytes are in dst (may run before d2h returns). */
	int (*d2h)(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
	           aoq_done_fn done, void *arg);
	/* Copies host src -> device dst after the work queued on `stream` so far
	 * and returns an event marking its completion in *ev (NULL when done). */
	int (*h2d)(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
	           struct aoq_event **ev);
	/* Optional (NULL where every copy is synchronous).  record: an event
	 * marking the work queued on `stream` so far.  h2d_after: as h2d, but
	 * ordered after `after` (an event from record) instead of `stream`. The
	 * library records at push time, when the gradient is final and the old
	 * parameter is no longer used, so the copy back does not wait for the
	 * rest of backward. */
	int (*record)(struct aoq_backend *b, void *stream, struct aoq_event **ev);
	int (*h2d_after)(struct aoq_backend *b, void *dst, const void *src, size_t bytes,
	                 struct aoq_event *after, struct aoq_event **ev);
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

/* Sets the calling thread's aoq_last_error() text; returns err. */
int aoq_set_error(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
