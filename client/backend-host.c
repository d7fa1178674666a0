/* SPDX-License-Identifier: MIT */
/* The host backend ("cpu"): device memory is host memory, copies are memcpy
 * and complete before they return. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

struct aoq_backend {
	int unused;
};

static int host_open(struct aoq_backend **out, int index, const struct aoq_options *o)
{
	if (index != 0)
		return aoq_set_error(-ENODEV, "device cpu:%d does not exist (use cpu)", index);
	*out = calloc(1, sizeof(**out));
	return *out ? 0 : -ENOMEM;
}

static void host_close(struct aoq_backend *b)
{
	free(b);
}

static int host_register(struct aoq_backend *b, void *p, size_t len)
{
	return 0;
}

static void host_unregister(struct aoq_backend *b, void *p, size_t len)
{
}

static int host_d2h(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
                    aoq_done_fn done, void *arg)
{
	memcpy(dst, src, bytes);
	done(arg, 0);
	return 0;
}

static int host_h2d(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
                    struct aoq_event **ev)
{
	memcpy(dst, src, bytes);
	*ev = NULL;
	return 0;
}

static int host_stream_wait(struct aoq_backend *b, struct aoq_event *ev, void *stream)
{
	return 0;
}

static int host_host_wait(struct aoq_backend *b, struct aoq_event *ev)
{
	return 0;
}

static void host_event_release(struct aoq_backend *b, struct aoq_event *ev)
{
}

static int host_copy(struct aoq_backend *b, void *dst, const void *src, size_t bytes)
{
	memcpy(dst, src, bytes);
	return 0;
}

const struct aoq_backend_ops aoq_backend_host = {
	.name = "host",
	.open = host_open,
	.close = host_close,
	.register_host = host_register,
	.unregister_host = host_unregister,
	.d2h = host_d2h,
	.h2d = host_h2d,
	.stream_wait = host_stream_wait,
	.host_wait = host_host_wait,
	.event_release = host_event_release,
	.copy_to_host = host_copy,
	.copy_to_device = host_copy,
};
