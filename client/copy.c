/* SPDX-License-Identifier: MIT */
/*
 * The backends' copies: each gradient piece goes from the device into the
 * arena and its record to the daemon once the copy completes (on whatever
 * thread the backend completes it); each updated range goes back to the
 * device, and the tensor (and the window's slot) keeps the event of its
 * last copy.  A backend's completion callbacks take c->lock, so no backend
 * call is made under it.
 */
#include <errno.h>
#include <stdlib.h>

#include "copy.h"
#include "control.h"
#include "trace.h"

struct copy_done {
	struct aoq_client *c;
	uint32_t t;
	struct aoq_rec rec;
};

static struct evref *evref_new(struct aoq_event *ev, unsigned refs)
{
	struct evref *r = malloc(sizeof(*r));
	if (r) {
		r->ev = ev;
		r->refs = refs;
	}
	return r;
}

/* Caller holds c->lock. */
void aoqc_evref_put(struct aoq_client *c, struct evref *r)
{
	if (r && --r->refs == 0) {
		if (r->ev)
			c->ops->event_release(c->be, r->ev);
		free(r);
	}
}

/* Starts the copy of an updated range to the device; the event goes to
 * the tensor (and the slot it came from).  Caller holds c->lock, which is
 * dropped around the backend call: a backend's completion callbacks take
 * c->lock, and CUDA forbids waiting on them from inside its own calls, so
 * no backend call is made under c->lock. */
void aoqc_copy_param(struct aoq_client *c, struct tensor *x, const uint8_t *src, uint64_t offset,
                     uint64_t count, struct slot *sl, uint64_t step)
{
	struct aoq_event *ev = NULL, *after = x->last_use;
	void *stream = x->stream;
	uint8_t *dst = (uint8_t *)x->d.param + offset * x->psize;
	struct aoq_copy_time *tm = aoqc_span_new(c, AOQ__TRACE_SPAN_KIND__SPAN_H2D, (uint32_t)(x - c->tensors), step, offset,
	                                         count);
	pthread_mutex_unlock(&c->lock);
	int e = after && c->ops->h2d_after
		? c->ops->h2d_after(c->be, dst, src, count * x->psize, after, &ev, tm)
		: c->ops->h2d(c->be, dst, src, count * x->psize, stream, &ev, tm);
	struct evref *r = e < 0 ? NULL : evref_new(ev, sl ? 2 : 1);
	if (e == 0 && !r && ev) {
		c->ops->host_wait(c->be, ev);
		c->ops->event_release(c->be, ev);
		e = -ENOMEM;
	}
	pthread_mutex_lock(&c->lock);
	if (e < 0) {
		aoqc_fail(c, e, "parameter copy to the device failed: %s", aoq_last_error());
		return;
	}
	aoqc_evref_put(c, x->h2d);
	x->h2d = r;
	if (sl) {
		aoqc_evref_put(c, sl->h2d);
		sl->h2d = r;
	}
}

/* The gradient is in the arena: post its record (any thread). */
static void grad_copied(void *arg, int status)
{
	struct deadline dl = { 0 };
	struct copy_done *d = arg;
	struct aoq_client *c = d->c;
	struct tensor *x = &c->tensors[d->t];
	pthread_mutex_lock(&c->lock);
	x->copied++;
	if (status < 0) {
		aoqc_fail(c, status, "gradient copy of tensor %u failed", d->t);
	} else {
		int r;
		while ((r = aoq_ring_push(&c->to_daemon, &d->rec)) == -EAGAIN && !c->error)
			if (!aoq_ring_wait_space(&c->to_daemon, 1))
				aoqc_wait_daemon(c, &dl);
		/* the ring was empty: wake aoqd, unless its loop polls the ring
		 * (loop_spin_us; aoq-arena.h, consumer_spinning) */
		if (r == 1 && aoq_ring_consumer_sleeps(&c->to_daemon))
			aoqc_ring(c->bell_out);
		else if (r < 0 && !c->error)
			aoqc_fail(c, r, "the daemon's ring counter is corrupt");
	}
	pthread_cond_broadcast(&c->cond);
	pthread_mutex_unlock(&c->lock);
	free(d);
}

/* Starts one gradient copy into the arena; its record follows when done,
 * and when `after` is given (a parameter copy out of the master the record
 * lets the daemon write again; only with ops->d2h_after), after that too.
 * Caller holds c->lock; it is dropped around the backend call. */
int aoqc_start_copy(struct aoq_client *c, struct tensor *x, uint8_t *dst, const uint8_t *src,
                    const struct aoq_rec *rec, struct aoq_event *after)
{
	struct copy_done *d = malloc(sizeof(*d));
	if (!d)
		return -ENOMEM;
	d->c = c;
	d->t = rec->tensor;
	d->rec = *rec;
	x->pushed++;
	x->copies++;
	struct aoq_copy_time *tm =
		aoqc_span_new(c, AOQ__TRACE_SPAN_KIND__SPAN_D2H, rec->tensor, rec->step, rec->offset, rec->count);
	pthread_mutex_unlock(&c->lock);
	int r = after ? c->ops->d2h_after(c->be, dst, src, rec->count * x->gsize, x->stream, after, grad_copied, d, tm)
	              : c->ops->d2h(c->be, dst, src, rec->count * x->gsize, x->stream, grad_copied, d, tm);
	pthread_mutex_lock(&c->lock);
	if (r < 0) {
		aoqc_fail(c, r, "gradient copy of tensor %u failed: %s", rec->tensor, aoq_last_error());
		free(d);
	}
	return r;
}

int aoqc_wait_event(struct aoq_client *c, struct evref *ev, void *stream, bool host)
{
	if (!ev)
		return 0;
	int r = host ? c->ops->host_wait(c->be, ev->ev) : c->ops->stream_wait(c->be, ev->ev, stream);
	pthread_mutex_lock(&c->lock);
	aoqc_evref_put(c, ev);
	pthread_mutex_unlock(&c->lock);
	return r;
}
