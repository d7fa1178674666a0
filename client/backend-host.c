/* SPDX-License-Identifier: MIT */
/*
 * The host backend ("cpu"): device memory is host memory.
 *
 * Gradient copies (d2h) and synchronous copies complete before they return.
 * Parameter copies (h2d) are queued and land only when the trainer waits
 * for them, the way a GPU's copy stream is ordered before the work that
 * waits on it: waiting on an event (host_wait or stream_wait) performs every
 * queued copy up to and including that event's, in the order they were
 * queued.  So an update never changes a buffer that the trainer's backward
 * may still be reading, and a training run on the cpu device is
 * deterministic (without this, the progress thread's memcpy raced the
 * trainer's backward).
 * Releasing an event does not cancel its copy: it still lands at the next
 * wait on a later event, or is dropped at close.
 *
 * Tracing: a gradient copy is timed around its memcpy; a parameter copy
 * around the memcpy that lands it (in the waiting thread), so its span
 * starts when the trainer first waits for it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

struct aoq_event {
	uint64_t seq;
};

struct host_copy {
	void *dst;
	const void *src;
	size_t bytes;
	uint64_t seq;
	struct aoq_copy_time *tm;
};

struct aoq_backend {
	pthread_mutex_t lock;
	struct host_copy *q; /* ring of queued parameter copies */
	size_t head, len, cap;
	uint64_t next_seq;   /* seq of the next queued copy (1-based) */
};

static int host_open(struct aoq_backend **out, int index, const struct aoq_options *o)
{
	if (index != 0)
		return aoq_set_error(-ENODEV, "device cpu:%d does not exist (use cpu)", index);
	struct aoq_backend *b = calloc(1, sizeof(*b));
	if (!b)
		return -ENOMEM;
	pthread_mutex_init(&b->lock, NULL);
	b->next_seq = 1;
	*out = b;
	return 0;
}

static void host_close(struct aoq_backend *b)
{
	pthread_mutex_destroy(&b->lock);
	free(b->q);
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
                    aoq_done_fn done, void *arg, struct aoq_copy_time *tm)
{
	aoq_copy_time_start(tm);
	memcpy(dst, src, bytes);
	aoq_copy_time_end(tm);
	done(arg, 0);
	return 0;
}

/* Queues a copy (caller holds b->lock). */
static int enqueue(struct aoq_backend *b, void *dst, const void *src, size_t bytes, uint64_t *seq,
                   struct aoq_copy_time *tm)
{
	if (b->len == b->cap) {
		size_t cap = b->cap ? b->cap * 2 : 64;
		struct host_copy *q = malloc(cap * sizeof(*q));
		if (!q)
			return -ENOMEM;
		for (size_t i = 0; i < b->len; i++)
			q[i] = b->q[(b->head + i) % b->cap];
		free(b->q);
		b->q = q;
		b->head = 0;
		b->cap = cap;
	}
	*seq = b->next_seq++;
	b->q[(b->head + b->len) % b->cap] = (struct host_copy){ dst, src, bytes, *seq, tm };
	b->len++;
	return 0;
}

static int host_h2d(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
                    struct aoq_event **ev, struct aoq_copy_time *tm)
{
	struct aoq_event *e = malloc(sizeof(*e));
	if (!e)
		return aoq_set_error(-ENOMEM, "out of memory");
	pthread_mutex_lock(&b->lock);
	int r = enqueue(b, dst, src, bytes, &e->seq, tm);
	pthread_mutex_unlock(&b->lock);
	if (r < 0) {
		free(e);
		return aoq_set_error(r, "out of memory");
	}
	*ev = e;
	return 0;
}

/* Lands every queued copy up to and including ev's. */
static int host_host_wait(struct aoq_backend *b, struct aoq_event *ev)
{
	if (!ev)
		return 0;
	pthread_mutex_lock(&b->lock);
	while (b->len && b->q[b->head].seq <= ev->seq) {
		const struct host_copy *c = &b->q[b->head];
		aoq_copy_time_start(c->tm);
		memcpy(c->dst, c->src, c->bytes);
		aoq_copy_time_end(c->tm);
		b->head = (b->head + 1) % b->cap;
		b->len--;
	}
	pthread_mutex_unlock(&b->lock);
	return 0;
}

/* The host is the stream: a stream wait is a host wait. */
static int host_stream_wait(struct aoq_backend *b, struct aoq_event *ev, void *stream)
{
	return host_host_wait(b, ev);
}

static void host_event_release(struct aoq_backend *b, struct aoq_event *ev)
{
	free(ev);
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
