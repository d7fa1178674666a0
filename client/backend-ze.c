/* SPDX-License-Identifier: MIT */
/*
 * The Level Zero backend ("xpu:N", docs/design.md, Client backends): Intel GPUs through the Level
 * Zero loader.
 *
 * Devices: "xpu:N" is the N-th GPU-type device over all drivers, in the
 * loader's order.  The trainer's ze_context/ze_device from aoq_options are
 * used as given; without them the backend creates its own context.
 * aoq_options.ze_queue, when set, is an immediate command list
 * (ze_command_list_handle_t) used as the default `stream`.
 *
 * Copies: two immediate command lists ("lanes") on a copy engine, one per
 * direction.  Each lane has a worker thread that takes the lane's pending
 * copies in order and blocks in zeEventHostSynchronize(UINT64_MAX) on each
 * (no spinning), then finishes it: a staged D2H copy is moved from staging
 * into the arena, the done callback runs, events and staging are recycled.
 *
 * Host memory: when the driver offers zexDriverImportExternalPointer
 * (Intel's host pointer import), the arena is imported at its exact size
 * and copies go straight between device and arena ("import" mode).
 * Otherwise ("staging" mode) each lane has a ring of zeMemAllocHost memory
 * (AOQ_ZE_STAGING_BYTES, default min(64 MiB, arena size)); a copy is split
 * into pieces of at most half the ring, and the CPU moves the bytes between
 * ring and arena.  AOQ_ZE_STAGING=copy forces staging mode.
 *
 * Ordering:
 * - d2h after `stream`: an event is signaled on the stream (from the
 *   caller's thread, which owns the stream) and the copy waits for it.
 * - h2d: libaoq calls it from its progress thread once the daemon answered
 *   the tensor's last push; that answer implies the gradient copy, and so
 *   every use of the old value queued on the push's stream, has completed.
 *   Level Zero command lists must not be used from two threads at once, so
 *   by default h2d does not touch the trainer's list.  With
 *   AOQ_ZE_H2D_AFTER_STREAM=1 it also signals an event on `stream` from the
 *   progress thread and waits for it (only for drivers whose lists are
 *   thread-safe).
 * - stream_wait: a barrier on the stream that waits for the copy's event
 *   and signals a marker; the copy's event is recycled only once it and
 *   every marker have signaled, so a pending wait never sees a reused event.
 *   Without any stream (NULL and no ze_queue) stream_wait blocks the host.
 *
 * Tracing (aoqctl trace, only when libaoq passes a struct aoq_copy_time):
 * host timestamps, the start when the copy is appended (so a gradient's
 * span includes its wait for the trainer's stream) and the end when the
 * lane thread sees the last piece complete (after a staged piece's memcpy).
 * Device timestamps (zeEventQueryKernelTimestamp) would be tighter but need
 * timestamp event pools and a device-to-host clock conversion: not done.
 *
 * After a failed zeInit no other ze function is ever called (the loader
 * can crash otherwise).
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <ze_api.h>

#include "backend.h"

#define EVENTS_PER_POOL 64
#define MAX_IMPORTS 8
#define STAGING_DEFAULT ((size_t)64 << 20)
#define STAGING_MIN ((size_t)4096)
#define CLOSE_MARKER_WAIT_NS 2000000000ull

/* The staging mode of the most recently registered arena (<aoq/aoq.h>). */
static _Atomic(const char *) last_mode = "none";

const char *aoq_ze_staging_mode(void)
{
	return atomic_load(&last_mode);
}

/* ---- errors ------------------------------------------------------------- */

static const char *ze_name(ze_result_t r)
{
	switch (r) {
	case ZE_RESULT_SUCCESS: return "ZE_RESULT_SUCCESS";
	case ZE_RESULT_NOT_READY: return "ZE_RESULT_NOT_READY";
	case ZE_RESULT_ERROR_DEVICE_LOST: return "ZE_RESULT_ERROR_DEVICE_LOST";
	case ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY: return "ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY";
	case ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY: return "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY";
	case ZE_RESULT_ERROR_UNINITIALIZED: return "ZE_RESULT_ERROR_UNINITIALIZED";
	case ZE_RESULT_ERROR_UNSUPPORTED_FEATURE: return "ZE_RESULT_ERROR_UNSUPPORTED_FEATURE";
	case ZE_RESULT_ERROR_INVALID_ARGUMENT: return "ZE_RESULT_ERROR_INVALID_ARGUMENT";
	case ZE_RESULT_ERROR_INVALID_NULL_HANDLE: return "ZE_RESULT_ERROR_INVALID_NULL_HANDLE";
	case ZE_RESULT_ERROR_INVALID_NULL_POINTER: return "ZE_RESULT_ERROR_INVALID_NULL_POINTER";
	case ZE_RESULT_ERROR_INVALID_SIZE: return "ZE_RESULT_ERROR_INVALID_SIZE";
	case ZE_RESULT_ERROR_OVERLAPPING_REGIONS: return "ZE_RESULT_ERROR_OVERLAPPING_REGIONS";
	default: return "ze_result_t";
	}
}

/* Sets the error text and returns a negative errno for a failed ze call. */
static int ze_fail(ze_result_t r, const char *what)
{
	int err = -EIO;
	if (r == ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY || r == ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)
		err = -ENOMEM;
	else if (r == ZE_RESULT_ERROR_DEVICE_LOST)
		err = -ENODEV;
	else if (r == ZE_RESULT_ERROR_UNSUPPORTED_FEATURE)
		err = -ENOTSUP;
	else if (r == ZE_RESULT_ERROR_INVALID_ARGUMENT || r == ZE_RESULT_ERROR_INVALID_NULL_HANDLE ||
	         r == ZE_RESULT_ERROR_INVALID_NULL_POINTER || r == ZE_RESULT_ERROR_INVALID_SIZE ||
	         r == ZE_RESULT_ERROR_OVERLAPPING_REGIONS)
		err = -EINVAL;
	return aoq_set_error(err, "Level Zero: %s failed: %s (0x%08x)", what, ze_name(r), (unsigned)r);
}

static bool debug_enabled(void)
{
	const char *s = getenv("AOQ_DEBUG");
	return s && *s && strcmp(s, "0") != 0;
}

/* ---- zeInit, once per process ------------------------------------------ */

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static ze_result_t init_result = ZE_RESULT_ERROR_UNINITIALIZED;

static void init_ze(void)
{
	init_result = zeInit(0);
}

/* ---- types -------------------------------------------------------------- */

struct zev {
	ze_event_handle_t h;
	struct zev *next; /* free list, or an aoq_event's markers */
	bool held;        /* a lane's worker has yet to finish with it */
};

struct zev_pool {
	ze_event_pool_handle_t pool;
	struct zev_pool *next;
	uint32_t created;
	struct zev ev[EVENTS_PER_POOL];
};

/* An h2d copy's completion, handed to libaoq. */
struct aoq_event {
	struct zev *done;
	struct zev *markers; /* signaled by streams after their wait on done */
	struct aoq_event *next; /* zombie list */
};

/* One transfer of d2h/h2d, possibly split into pieces. */
struct xfer {
	int refs;   /* pieces in flight + the submitter */
	int status;
	aoq_done_fn done;
	void *arg;
	struct aoq_copy_time *tm; /* traced: stamped when the last piece completes */
};

struct op {
	struct op *next;
	struct zev *ev;     /* the piece's completion */
	struct zev *pre;    /* stream signal the piece waited for, or NULL */
	bool keep_ev;       /* ev belongs to an aoq_event */
	uint8_t *stage;     /* staging used, or NULL */
	uint64_t stage_end;
	void *dst;          /* D2H staging: memcpy stage -> dst of len */
	size_t len;
	struct xfer *x;
};

struct lane {
	const char *name;
	struct aoq_backend *b;
	ze_command_list_handle_t list;
	pthread_mutex_t submit; /* serialises appends to list and staging allocation */
	pthread_cond_t cond;    /* under b->lock: work queued, staging freed */
	struct op *head, *tail; /* under b->lock */
	uint8_t *stage;         /* staging ring (zeMemAllocHost), lazily */
	size_t stage_size;
	uint64_t stage_head, stage_tail; /* byte counters, under b->lock */
	pthread_t thread;
	bool running;
	bool stop;
};

struct import {
	void *ptr;
	size_t len;
};

typedef ze_result_t (*import_fn)(ze_driver_handle_t, void *, size_t);
typedef ze_result_t (*release_fn)(ze_driver_handle_t, void *);

struct aoq_backend {
	int index;
	ze_driver_handle_t driver; /* NULL when a caller's device matched no driver */
	ze_device_handle_t dev;
	ze_context_handle_t ctx;
	bool own_ctx;
	ze_command_list_handle_t default_stream;
	bool h2d_after_stream;
	bool force_staging;
	size_t staging_bytes; /* 0: from the arena size */
	import_fn import;
	release_fn release;
	const char *mode;

	pthread_mutex_t lock; /* events, lanes' queues and rings, imports */
	struct zev_pool *pools;
	struct zev *free_ev;
	struct aoq_event *zombies;
	struct import imports[MAX_IMPORTS];
	size_t largest_registered;

	struct lane d2h, h2d;
};

/* ---- events ------------------------------------------------------------- */

static bool ev_done(struct zev *e)
{
	return zeEventQueryStatus(e->h) == ZE_RESULT_SUCCESS;
}

static void ev_put(struct aoq_backend *b, struct zev *e)
{
	zeEventHostReset(e->h);
	e->next = b->free_ev;
	b->free_ev = e;
}

static bool zombie_finished(struct aoq_event *ev)
{
	if (ev->done->held || !ev_done(ev->done))
		return false;
	for (struct zev *m = ev->markers; m; m = m->next)
		if (!ev_done(m))
			return false;
	return true;
}

static void aoq_event_recycle(struct aoq_backend *b, struct aoq_event *ev)
{
	struct zev *m = ev->markers;
	while (m) {
		struct zev *next = m->next;
		ev_put(b, m);
		m = next;
	}
	ev_put(b, ev->done);
	free(ev);
}

/* Recycles released events that every user is done with. Under b->lock. */
static void reap_zombies(struct aoq_backend *b)
{
	struct aoq_event **pp = &b->zombies;
	while (*pp) {
		struct aoq_event *ev = *pp;
		if (zombie_finished(ev)) {
			*pp = ev->next;
			aoq_event_recycle(b, ev);
		} else {
			pp = &ev->next;
		}
	}
}

/* A reset event, host-visible. Under b->lock. */
static int ev_get(struct aoq_backend *b, struct zev **out)
{
	if (!b->free_ev)
		reap_zombies(b);
	if (!b->free_ev) {
		struct zev_pool *p = calloc(1, sizeof(*p));
		if (!p)
			return aoq_set_error(-ENOMEM, "out of memory for Level Zero events");
		ze_event_pool_desc_t pd = {
			.stype = ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
			.flags = ZE_EVENT_POOL_FLAG_HOST_VISIBLE,
			.count = EVENTS_PER_POOL,
		};
		ze_result_t zr = zeEventPoolCreate(b->ctx, &pd, 1, &b->dev, &p->pool);
		if (zr != ZE_RESULT_SUCCESS) {
			free(p);
			return ze_fail(zr, "zeEventPoolCreate");
		}
		for (uint32_t i = 0; i < EVENTS_PER_POOL; i++) {
			ze_event_desc_t ed = {
				.stype = ZE_STRUCTURE_TYPE_EVENT_DESC,
				.index = i,
				.signal = ZE_EVENT_SCOPE_FLAG_HOST,
				.wait = ZE_EVENT_SCOPE_FLAG_HOST,
			};
			if ((zr = zeEventCreate(p->pool, &ed, &p->ev[i].h)) != ZE_RESULT_SUCCESS)
				break;
			p->created++;
			p->ev[i].next = b->free_ev;
			b->free_ev = &p->ev[i];
		}
		p->next = b->pools;
		b->pools = p;
		if (p->created == 0)
			return ze_fail(zr, "zeEventCreate");
	}
	*out = b->free_ev;
	b->free_ev = (*out)->next;
	(*out)->next = NULL;
	return 0;
}

static int ev_get_locked(struct aoq_backend *b, struct zev **out)
{
	pthread_mutex_lock(&b->lock);
	int r = ev_get(b, out);
	pthread_mutex_unlock(&b->lock);
	return r;
}

static void ev_put_locked(struct aoq_backend *b, struct zev *e)
{
	pthread_mutex_lock(&b->lock);
	ev_put(b, e);
	pthread_mutex_unlock(&b->lock);
}

/* ---- lanes -------------------------------------------------------------- */

/* Drops one reference of x; the last one reports. Under b->lock, which it
 * drops around the callback. */
static void xfer_unref(struct aoq_backend *b, struct xfer *x)
{
	if (--x->refs > 0)
		return;
	aoq_done_fn done = x->done;
	void *arg = x->arg;
	int status = x->status;
	if (status == 0)
		aoq_copy_time_end(x->tm);
	free(x);
	if (done) {
		pthread_mutex_unlock(&b->lock);
		done(arg, status);
		pthread_mutex_lock(&b->lock);
	}
}

static void *lane_main(void *arg)
{
	struct lane *l = arg;
	struct aoq_backend *b = l->b;
	pthread_mutex_lock(&b->lock);
	for (;;) {
		while (!l->head && !l->stop)
			pthread_cond_wait(&l->cond, &b->lock);
		struct op *o = l->head;
		if (!o)
			break;
		pthread_mutex_unlock(&b->lock);
		ze_result_t zr = zeEventHostSynchronize(o->ev->h, UINT64_MAX);
		int st = 0;
		if (zr != ZE_RESULT_SUCCESS)
			st = ze_fail(zr, "zeEventHostSynchronize");
		else if (o->dst)
			memcpy(o->dst, o->stage, o->len);
		pthread_mutex_lock(&b->lock);
		l->head = o->next;
		if (!l->head)
			l->tail = NULL;
		if (o->stage)
			l->stage_tail = o->stage_end;
		/* An event whose wait failed may still signal: never reuse it. */
		if (o->keep_ev)
			o->ev->held = false;
		if (zr == ZE_RESULT_SUCCESS) {
			if (!o->keep_ev)
				ev_put(b, o->ev);
			if (o->pre)
				ev_put(b, o->pre);
		}
		pthread_cond_broadcast(&l->cond);
		if (st && !o->x->status)
			o->x->status = st;
		xfer_unref(b, o->x);
		free(o);
	}
	pthread_mutex_unlock(&b->lock);
	return NULL;
}

static size_t staging_size(struct aoq_backend *b)
{
	if (b->staging_bytes)
		return b->staging_bytes;
	size_t n = STAGING_DEFAULT;
	if (b->largest_registered && b->largest_registered < n)
		n = b->largest_registered;
	if (n < 256 * 1024)
		n = 256 * 1024;
	return (n + 4095) & ~(size_t)4095;
}

/* Allocates l's staging ring on first use. Caller holds l->submit. */
static int stage_init(struct aoq_backend *b, struct lane *l)
{
	if (l->stage)
		return 0;
	size_t size = staging_size(b);
	ze_host_mem_alloc_desc_t hd = { .stype = ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC };
	void *mem;
	ze_result_t zr = zeMemAllocHost(b->ctx, &hd, size, 64, &mem);
	if (zr != ZE_RESULT_SUCCESS)
		return ze_fail(zr, "zeMemAllocHost (staging)");
	pthread_mutex_lock(&b->lock);
	l->stage = mem;
	l->stage_size = size;
	pthread_mutex_unlock(&b->lock);
	return 0;
}

/* Allocates n bytes of l's staging ring, waiting for space. Caller holds
 * l->submit, not b->lock. */
static int stage_alloc(struct aoq_backend *b, struct lane *l, size_t n, uint8_t **p, uint64_t *end)
{
	uint64_t need = (n + 63) & ~(uint64_t)63;
	if (need > l->stage_size)
		return aoq_set_error(-EINVAL, "Level Zero staging: piece of %zu bytes exceeds the ring", n);
	pthread_mutex_lock(&b->lock);
	uint64_t skip;
	for (;;) {
		uint64_t pos = l->stage_head % l->stage_size;
		skip = pos + need > l->stage_size ? l->stage_size - pos : 0;
		if (l->stage_head + skip + need - l->stage_tail <= l->stage_size)
			break;
		pthread_cond_wait(&l->cond, &b->lock);
	}
	l->stage_head += skip;
	*p = l->stage + l->stage_head % l->stage_size;
	l->stage_head += need;
	*end = l->stage_head;
	pthread_mutex_unlock(&b->lock);
	return 0;
}

static bool is_imported(struct aoq_backend *b, const void *p, size_t n)
{
	uintptr_t a = (uintptr_t)p;
	bool ok = false;
	pthread_mutex_lock(&b->lock);
	for (int i = 0; i < MAX_IMPORTS && !ok; i++) {
		uintptr_t s = (uintptr_t)b->imports[i].ptr;
		ok = b->imports[i].ptr && a >= s && n <= b->imports[i].len && a - s <= b->imports[i].len - n;
	}
	pthread_mutex_unlock(&b->lock);
	return ok;
}

/*
 * Copies bytes from src to dst on lane l (D2H: host = dst; H2D: host = src)
 * after the work on `stream` so far (when non-NULL).  done(arg, status) runs
 * once every piece is complete.  With keep, the last piece's event goes to
 * *keep (the caller owns it) instead of being recycled.
 */
static int submit(struct aoq_backend *b, struct lane *l, bool to_host, void *dst, const void *src,
                  size_t bytes, ze_command_list_handle_t stream, aoq_done_fn done, void *arg,
                  struct zev **keep, struct aoq_copy_time *tm)
{
	void *host = to_host ? dst : (void *)src;
	bool direct = is_imported(b, host, bytes);
	struct xfer *x = calloc(1, sizeof(*x));
	if (!x)
		return aoq_set_error(-ENOMEM, "out of memory");
	x->refs = 1;
	x->done = done;
	x->arg = arg;
	x->tm = tm;
	aoq_copy_time_start(tm);
	int r = 0;
	struct zev *pre = NULL;
	pthread_mutex_lock(&l->submit);
	if (stream) {
		if ((r = ev_get_locked(b, &pre)) < 0)
			goto fail;
		ze_result_t zr = zeCommandListAppendSignalEvent(stream, pre->h);
		if (zr != ZE_RESULT_SUCCESS) {
			ev_put_locked(b, pre);
			pre = NULL;
			r = ze_fail(zr, "zeCommandListAppendSignalEvent (on the trainer's stream)");
			goto fail;
		}
	}
	if (!direct && (r = stage_init(b, l)) < 0)
		goto fail;
	size_t piece = direct ? bytes : (l->stage_size / 2) & ~(size_t)63;
	size_t off = 0;
	do {
		size_t n = bytes - off < piece ? bytes - off : piece;
		bool last = off + n == bytes;
		struct op *o = calloc(1, sizeof(*o));
		if (!o) {
			r = aoq_set_error(-ENOMEM, "out of memory");
			goto fail;
		}
		if ((r = ev_get_locked(b, &o->ev)) < 0) {
			free(o);
			goto fail;
		}
		uint8_t *d = (uint8_t *)dst + off;
		const uint8_t *s = (const uint8_t *)src + off;
		uint64_t old_head = l->stage_head;
		if (!direct) {
			if ((r = stage_alloc(b, l, n, &o->stage, &o->stage_end)) < 0) {
				ev_put_locked(b, o->ev);
				free(o);
				goto fail;
			}
			if (to_host) {
				o->dst = d;
				o->len = n;
				d = o->stage;
			} else {
				memcpy(o->stage, s, n);
				s = o->stage;
			}
		}
		ze_event_handle_t w = pre ? pre->h : NULL;
		ze_result_t zr = zeCommandListAppendMemoryCopy(l->list, d, s, n, o->ev->h, off == 0 && pre ? 1 : 0,
		                                               off == 0 && pre ? &w : NULL);
		pthread_mutex_lock(&b->lock);
		if (zr != ZE_RESULT_SUCCESS) {
			if (o->stage)
				l->stage_head = old_head; /* the newest allocation, not in use */
			ev_put(b, o->ev);
			pthread_mutex_unlock(&b->lock);
			free(o);
			r = ze_fail(zr, "zeCommandListAppendMemoryCopy");
			goto fail;
		}
		if (off == 0) {
			o->pre = pre;
			pre = NULL;
		}
		if (last && keep) {
			o->keep_ev = true;
			o->ev->held = true;
			*keep = o->ev;
		}
		o->x = x;
		x->refs++;
		if (l->tail)
			l->tail->next = o;
		else
			l->head = o;
		l->tail = o;
		pthread_cond_broadcast(&l->cond);
		pthread_mutex_unlock(&b->lock);
		off += n;
	} while (off < bytes);
	pthread_mutex_unlock(&l->submit);
	pthread_mutex_lock(&b->lock);
	xfer_unref(b, x);
	pthread_mutex_unlock(&b->lock);
	return 0;

fail:
	/* Pieces already queued complete on their own; nobody is told. */
	if (pre) {
		/* Signaled on the stream but never waited for: recycle when done. */
		struct aoq_event *z = calloc(1, sizeof(*z));
		if (z) {
			z->done = pre;
			pthread_mutex_lock(&b->lock);
			z->next = b->zombies;
			b->zombies = z;
			pthread_mutex_unlock(&b->lock);
		}
	}
	pthread_mutex_unlock(&l->submit);
	pthread_mutex_lock(&b->lock);
	x->done = NULL;
	x->tm = NULL; /* a failed copy has no span */
	xfer_unref(b, x);
	pthread_mutex_unlock(&b->lock);
	return r;
}

static int lane_start(struct aoq_backend *b, struct lane *l, const char *name, uint32_t ordinal,
                      uint32_t index)
{
	l->name = name;
	l->b = b;
	pthread_mutex_init(&l->submit, NULL);
	pthread_cond_init(&l->cond, NULL);
	ze_command_queue_desc_t qd = {
		.stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
		.ordinal = ordinal,
		.index = index,
		.mode = ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS,
		.priority = ZE_COMMAND_QUEUE_PRIORITY_NORMAL,
	};
	ze_result_t zr = zeCommandListCreateImmediate(b->ctx, b->dev, &qd, &l->list);
	if (zr != ZE_RESULT_SUCCESS) {
		l->list = NULL;
		return ze_fail(zr, "zeCommandListCreateImmediate");
	}
	int r = pthread_create(&l->thread, NULL, lane_main, l);
	if (r)
		return aoq_set_error(-r, "cannot start the Level Zero %s thread: %s", name, strerror(r));
	l->running = true;
	return 0;
}

static void lane_stop(struct aoq_backend *b, struct lane *l)
{
	if (l->running) {
		pthread_mutex_lock(&b->lock);
		l->stop = true;
		pthread_cond_broadcast(&l->cond);
		pthread_mutex_unlock(&b->lock);
		pthread_join(l->thread, NULL);
		l->running = false;
	}
	if (l->list)
		zeCommandListDestroy(l->list);
	if (l->stage)
		zeMemFree(b->ctx, l->stage);
	if (l->b) {
		pthread_mutex_destroy(&l->submit);
		pthread_cond_destroy(&l->cond);
	}
}

/* ---- open/close --------------------------------------------------------- */

/* The index-th GPU over all drivers (index < 0: the driver owning want). */
static int find_device(struct aoq_backend *b, int index, ze_device_handle_t want)
{
	uint32_t nd = 0;
	ze_result_t zr = zeDriverGet(&nd, NULL);
	if (zr != ZE_RESULT_SUCCESS)
		return ze_fail(zr, "zeDriverGet");
	ze_driver_handle_t *drv = calloc(nd ? nd : 1, sizeof(*drv));
	if (!drv)
		return -ENOMEM;
	int r = -ENODEV, seen = 0;
	if ((zr = zeDriverGet(&nd, drv)) != ZE_RESULT_SUCCESS) {
		free(drv);
		return ze_fail(zr, "zeDriverGet");
	}
	for (uint32_t i = 0; i < nd && r == -ENODEV; i++) {
		uint32_t n = 0;
		if (zeDeviceGet(drv[i], &n, NULL) != ZE_RESULT_SUCCESS || n == 0)
			continue;
		ze_device_handle_t *dev = calloc(n, sizeof(*dev));
		if (!dev)
			break;
		if (zeDeviceGet(drv[i], &n, dev) == ZE_RESULT_SUCCESS) {
			for (uint32_t j = 0; j < n; j++) {
				if (want) {
					if (dev[j] == want) {
						b->driver = drv[i];
						r = 0;
						break;
					}
					continue;
				}
				ze_device_properties_t p = { .stype = ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES };
				if (zeDeviceGetProperties(dev[j], &p) != ZE_RESULT_SUCCESS || p.type != ZE_DEVICE_TYPE_GPU)
					continue;
				if (seen++ == index) {
					b->driver = drv[i];
					b->dev = dev[j];
					r = 0;
					break;
				}
			}
		}
		free(dev);
	}
	free(drv);
	if (r == -ENODEV && !want)
		aoq_set_error(-ENODEV, "no XPU device xpu:%d: Level Zero reports %d GPU device%s", index, seen,
		              seen == 1 ? "" : "s");
	return r;
}

/* A copy engine: a copy-only group first, else any group that copies. */
static int pick_queue_group(struct aoq_backend *b, uint32_t *ordinal, uint32_t *nqueues)
{
	uint32_t n = 0;
	ze_result_t zr = zeDeviceGetCommandQueueGroupProperties(b->dev, &n, NULL);
	if (zr != ZE_RESULT_SUCCESS)
		return ze_fail(zr, "zeDeviceGetCommandQueueGroupProperties");
	if (n == 0)
		return aoq_set_error(-ENODEV, "XPU device xpu:%d has no command queue groups", b->index);
	ze_command_queue_group_properties_t *p = calloc(n, sizeof(*p));
	if (!p)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++)
		p[i].stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES;
	if ((zr = zeDeviceGetCommandQueueGroupProperties(b->dev, &n, p)) != ZE_RESULT_SUCCESS) {
		free(p);
		return ze_fail(zr, "zeDeviceGetCommandQueueGroupProperties");
	}
	int best = -1, score = -1;
	for (uint32_t i = 0; i < n; i++) {
		bool copy = p[i].flags & ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY;
		bool compute = p[i].flags & ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE;
		int s = copy ? (compute ? 1 : 2) : 0;
		if (s > score && p[i].numQueues > 0) {
			score = s;
			best = (int)i;
		}
	}
	if (best < 0) {
		free(p);
		return aoq_set_error(-ENODEV, "XPU device xpu:%d has no usable command queue", b->index);
	}
	*ordinal = (uint32_t)best;
	*nqueues = p[best].numQueues;
	free(p);
	return 0;
}

static void ze_close(struct aoq_backend *b);

static int ze_open(struct aoq_backend **out, int index, const struct aoq_options *o)
{
	pthread_once(&init_once, init_ze);
	if (init_result != ZE_RESULT_SUCCESS)
		return aoq_set_error(-ENODEV,
		                     "no Level Zero driver: zeInit failed with %s (0x%08x); install Intel's compute "
		                     "runtime (intel-level-zero-gpu / libze-intel-gpu1) for xpu devices",
		                     ze_name(init_result), (unsigned)init_result);
	struct aoq_backend *b = calloc(1, sizeof(*b));
	if (!b)
		return -ENOMEM;
	pthread_mutex_init(&b->lock, NULL);
	b->index = index;
	b->mode = "staging";
	int r;
	if (o->ze_device) {
		b->dev = o->ze_device;
		if ((r = find_device(b, -1, b->dev)) < 0 && !o->ze_context) {
			r = aoq_set_error(-ENODEV, "the ze_device handle of aoq_options belongs to no Level Zero driver");
			goto fail;
		}
	} else if ((r = find_device(b, index, NULL)) < 0) {
		goto fail;
	}
	if (o->ze_context) {
		b->ctx = o->ze_context;
	} else {
		ze_context_desc_t cd = { .stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC };
		ze_result_t zr = zeContextCreate(b->driver, &cd, &b->ctx);
		if (zr != ZE_RESULT_SUCCESS) {
			b->ctx = NULL;
			r = ze_fail(zr, "zeContextCreate");
			goto fail;
		}
		b->own_ctx = true;
	}
	b->default_stream = o->ze_queue;

	const char *s = getenv("AOQ_ZE_STAGING");
	b->force_staging = s && strcmp(s, "copy") == 0;
	s = getenv("AOQ_ZE_STAGING_BYTES");
	if (s && *s) {
		char *end;
		unsigned long long v = strtoull(s, &end, 0);
		if (*end || v < STAGING_MIN) {
			r = aoq_set_error(-EINVAL, "AOQ_ZE_STAGING_BYTES=%s: want a byte count >= %zu", s, STAGING_MIN);
			goto fail;
		}
		b->staging_bytes = (size_t)v & ~(size_t)63;
	}
	s = getenv("AOQ_ZE_H2D_AFTER_STREAM");
	b->h2d_after_stream = s && strcmp(s, "1") == 0;

	if (b->driver && !b->force_staging) {
		void *fi = NULL, *fr = NULL;
		if (zeDriverGetExtensionFunctionAddress(b->driver, "zexDriverImportExternalPointer", &fi) ==
		            ZE_RESULT_SUCCESS &&
		    zeDriverGetExtensionFunctionAddress(b->driver, "zexDriverReleaseImportedPointer", &fr) ==
		            ZE_RESULT_SUCCESS &&
		    fi && fr) {
			memcpy(&b->import, &fi, sizeof(fi));
			memcpy(&b->release, &fr, sizeof(fr));
		}
	}

	uint32_t ordinal = 0, nq = 0;
	if ((r = pick_queue_group(b, &ordinal, &nq)) < 0)
		goto fail;
	if ((r = lane_start(b, &b->d2h, "d2h", ordinal, 0)) < 0 ||
	    (r = lane_start(b, &b->h2d, "h2d", ordinal, nq > 1 ? 1 : 0)) < 0)
		goto fail;
	if (debug_enabled())
		fprintf(stderr, "aoq: ze: xpu:%d: %s context, copy queue group %u (%u queues), host pointer import %s\n",
		        index, b->own_ctx ? "own" : "caller's", ordinal, nq, b->import ? "available" : "not available");
	*out = b;
	return 0;
fail:
	ze_close(b);
	return r;
}

static void ze_close(struct aoq_backend *b)
{
	lane_stop(b, &b->d2h);
	lane_stop(b, &b->h2d);
	/* Streams may still hold waits on released events: give them a moment,
	 * and leak the events rather than destroy one that a list may read. */
	bool leak = false;
	struct timespec t0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (struct aoq_event *z = b->zombies; z; z = z->next) {
		struct zev *e = z->done;
		for (struct zev *m = z->markers;; m = m->next) {
			struct timespec t;
			clock_gettime(CLOCK_MONOTONIC, &t);
			uint64_t spent = (uint64_t)(t.tv_sec - t0.tv_sec) * 1000000000u + (uint64_t)(t.tv_nsec - t0.tv_nsec);
			uint64_t left = spent < CLOSE_MARKER_WAIT_NS ? CLOSE_MARKER_WAIT_NS - spent : 0;
			if (zeEventHostSynchronize(e->h, left) != ZE_RESULT_SUCCESS)
				leak = true;
			if (!m)
				break;
			e = m;
		}
	}
	while (b->zombies) {
		struct aoq_event *z = b->zombies;
		b->zombies = z->next;
		free(z);
	}
	if (leak) {
		fprintf(stderr, "aoq: ze: xpu:%d: a stream never reached its wait for a parameter copy; "
		                "leaking its events\n", b->index);
	}
	while (b->pools) {
		struct zev_pool *p = b->pools;
		b->pools = p->next;
		if (!leak) {
			for (uint32_t i = 0; i < p->created; i++)
				zeEventDestroy(p->ev[i].h);
			zeEventPoolDestroy(p->pool);
		}
		free(p);
	}
	for (int i = 0; i < MAX_IMPORTS; i++)
		if (b->imports[i].ptr)
			b->release(b->driver, b->imports[i].ptr);
	if (b->own_ctx && !leak)
		zeContextDestroy(b->ctx);
	pthread_mutex_destroy(&b->lock);
	free(b);
}

/* ---- the interface ------------------------------------------------------ */

static int ze_register(struct aoq_backend *b, void *p, size_t len)
{
	pthread_mutex_lock(&b->lock);
	if (len > b->largest_registered)
		b->largest_registered = len;
	int slot = -1;
	for (int i = 0; i < MAX_IMPORTS && slot < 0; i++)
		if (!b->imports[i].ptr)
			slot = i;
	pthread_mutex_unlock(&b->lock);
	const char *mode = "staging";
	if (b->import && slot >= 0) {
		ze_result_t zr = b->import(b->driver, p, len);
		if (zr == ZE_RESULT_SUCCESS) {
			pthread_mutex_lock(&b->lock);
			b->imports[slot] = (struct import){ p, len };
			pthread_mutex_unlock(&b->lock);
			mode = "import";
		} else if (debug_enabled()) {
			fprintf(stderr, "aoq: ze: xpu:%d: zexDriverImportExternalPointer of %zu bytes failed with %s "
			                "(0x%08x); using staging\n", b->index, len, ze_name(zr), (unsigned)zr);
		}
	}
	b->mode = mode;
	atomic_store(&last_mode, mode);
	if (debug_enabled())
		fprintf(stderr, "aoq: ze: xpu:%d: arena of %zu bytes, host staging mode: %s\n", b->index, len, mode);
	return 0;
}

static void ze_unregister(struct aoq_backend *b, void *p, size_t len)
{
	pthread_mutex_lock(&b->lock);
	for (int i = 0; i < MAX_IMPORTS; i++) {
		if (b->imports[i].ptr == p && b->imports[i].len == len) {
			b->release(b->driver, p);
			b->imports[i] = (struct import){ NULL, 0 };
		}
	}
	pthread_mutex_unlock(&b->lock);
}

static ze_command_list_handle_t stream_of(struct aoq_backend *b, void *stream)
{
	return stream ? (ze_command_list_handle_t)stream : b->default_stream;
}

static int ze_d2h(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
                  aoq_done_fn done, void *arg, struct aoq_copy_time *tm)
{
	if (bytes == 0) {
		aoq_copy_time_start(tm);
		aoq_copy_time_end(tm);
		done(arg, 0);
		return 0;
	}
	return submit(b, &b->d2h, true, dst, src, bytes, stream_of(b, stream), done, arg, NULL, tm);
}

static int ze_h2d(struct aoq_backend *b, void *dst, const void *src, size_t bytes, void *stream,
                  struct aoq_event **ev, struct aoq_copy_time *tm)
{
	*ev = NULL;
	if (bytes == 0) {
		aoq_copy_time_start(tm);
		aoq_copy_time_end(tm);
		return 0;
	}
	struct aoq_event *e = calloc(1, sizeof(*e));
	if (!e)
		return aoq_set_error(-ENOMEM, "out of memory");
	ze_command_list_handle_t s = b->h2d_after_stream ? stream_of(b, stream) : NULL;
	int r = submit(b, &b->h2d, false, dst, src, bytes, s, NULL, NULL, &e->done, tm);
	if (r < 0) {
		free(e);
		return r;
	}
	*ev = e;
	return 0;
}

static int ze_host_wait(struct aoq_backend *b, struct aoq_event *ev)
{
	if (!ev)
		return 0;
	ze_result_t zr = zeEventHostSynchronize(ev->done->h, UINT64_MAX);
	return zr == ZE_RESULT_SUCCESS ? 0 : ze_fail(zr, "zeEventHostSynchronize");
}

static int ze_stream_wait(struct aoq_backend *b, struct aoq_event *ev, void *stream)
{
	if (!ev)
		return 0;
	ze_command_list_handle_t s = stream_of(b, stream);
	if (!s)
		return ze_host_wait(b, ev);
	struct zev *m;
	int r = ev_get_locked(b, &m);
	if (r < 0)
		return r;
	ze_result_t zr = zeCommandListAppendBarrier(s, m->h, 1, &ev->done->h);
	if (zr != ZE_RESULT_SUCCESS) {
		ev_put_locked(b, m);
		return ze_fail(zr, "zeCommandListAppendBarrier (on the trainer's stream)");
	}
	pthread_mutex_lock(&b->lock);
	m->next = ev->markers;
	ev->markers = m;
	pthread_mutex_unlock(&b->lock);
	return 0;
}

static void ze_event_release(struct aoq_backend *b, struct aoq_event *ev)
{
	if (!ev)
		return;
	pthread_mutex_lock(&b->lock);
	if (zombie_finished(ev)) {
		aoq_event_recycle(b, ev);
	} else {
		ev->next = b->zombies;
		b->zombies = ev;
	}
	pthread_mutex_unlock(&b->lock);
}

struct sync_wait {
	pthread_mutex_t m;
	pthread_cond_t c;
	bool done;
	int status;
};

static void sync_done(void *arg, int status)
{
	struct sync_wait *w = arg;
	pthread_mutex_lock(&w->m);
	w->done = true;
	w->status = status;
	pthread_cond_signal(&w->c);
	pthread_mutex_unlock(&w->m);
}

static int ze_copy_to_host(struct aoq_backend *b, void *dst, const void *src, size_t bytes)
{
	struct sync_wait w = { .m = PTHREAD_MUTEX_INITIALIZER, .c = PTHREAD_COND_INITIALIZER };
	int r = ze_d2h(b, dst, src, bytes, NULL, sync_done, &w, NULL);
	if (r == 0) {
		pthread_mutex_lock(&w.m);
		while (!w.done)
			pthread_cond_wait(&w.c, &w.m);
		pthread_mutex_unlock(&w.m);
		r = w.status;
	}
	pthread_mutex_destroy(&w.m);
	pthread_cond_destroy(&w.c);
	return r;
}

static int ze_copy_to_device(struct aoq_backend *b, void *dst, const void *src, size_t bytes)
{
	struct aoq_event *ev;
	int r = ze_h2d(b, dst, src, bytes, NULL, &ev, NULL);
	if (r == 0) {
		r = ze_host_wait(b, ev);
		ze_event_release(b, ev);
	}
	return r;
}

const struct aoq_backend_ops aoq_backend_ze = {
	.name = "ze",
	.open = ze_open,
	.close = ze_close,
	.register_host = ze_register,
	.unregister_host = ze_unregister,
	.d2h = ze_d2h,
	.h2d = ze_h2d,
	.stream_wait = ze_stream_wait,
	.host_wait = ze_host_wait,
	.event_release = ze_event_release,
	.copy_to_host = ze_copy_to_host,
	.copy_to_device = ze_copy_to_device,
};
