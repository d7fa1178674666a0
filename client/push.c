/* SPDX-License-Identifier: MIT */
/*
 * The data path: gradients pushed (in pieces, or through the window's
 * slots), updated parameters waited for, steps ended, sync and flush.
 */
#include <errno.h>
#include <stdint.h>

#include "control.h"
#include "copy.h"
#include "progress.h"
#include "trace.h"

uint64_t aoq_current_step(struct aoq_client *c)
{
	pthread_mutex_lock(&c->lock);
	uint64_t s = c->step;
	pthread_mutex_unlock(&c->lock);
	return s;
}

/* Delayed update: where x's pending update lies (its master, or the param
 * buffer of its step's parity). */
static const uint8_t *pending_src(const struct tensor *x)
{
	return x->master_area ? x->master_area : x->param_area + ((x->pending_step & 1) ? x->param_buf : 0);
}

int aoq_push_grad_ptr(struct aoq_client *c, uint32_t t, const void *grad, unsigned flags, void *stream)
{
	struct deadline dl = { 0 };
	if (!c->registered)
		return aoq_set_error(-EINVAL, "aoq_push_grad before aoq_register");
	if (t >= c->ntensors || !grad || (flags & ~AOQ_PUSH_ACCUMULATE))
		return aoq_set_error(-EINVAL, "aoq_push_grad: bad tensor %u, buffer or flags", t);
	struct tensor *x = &c->tensors[t];
	if (x->released)
		return aoq_set_error(-EINVAL, "aoq_push_grad: tensor %u's state was released (aoq_release_tensors)", t);
	int r = 0;
	pthread_mutex_lock(&c->lock);
	/* One record of a tensor at a time: its slot is reused, and the
	 * daemon must see micro-batches in order. */
	while (!c->error && x->answered < x->pushed)
		aoqc_wait_daemon(c, &dl);
	if (c->error) {
		pthread_mutex_unlock(&c->lock);
		return aoqc_session_error(c);
	}
	x->stream = stream ? stream : c->o.cuda_stream;
	if (x->last_use) {
		c->ops->event_release(c->be, x->last_use);
		x->last_use = NULL;
	}
	if (c->ops->record && !c->o.delayed_update) {
		/* The gradient is final: the old parameter is no longer used by
		 * the work queued so far.  The update may land after that.  (No
		 * backend call under c->lock: see copy.c.) */
		struct aoq_event *ev = NULL;
		void *st = x->stream;
		pthread_mutex_unlock(&c->lock);
		int e = c->ops->record(c->be, st, &ev);
		pthread_mutex_lock(&c->lock);
		x->last_use = ev;
		if (e < 0) {
			aoqc_fail(c, e, "cannot record an event on the stream: %s", aoq_last_error());
			pthread_mutex_unlock(&c->lock);
			return e;
		}
	}
	struct aoq_rec rec = { .tensor = t, .slot = t, .step = c->step,
	                       .flags = (flags & AOQ_PUSH_ACCUMULATE) ? AOQ_REC_ACCUMULATE : 0 };
	if ((!c->slots || x->master_area) && !c->o.delayed_update && x->h2d && x->h2d->ev) {
		/* The daemon writes the tensor's param area (or its master,
		 * with a window too) again once this record is posted: the
		 * copy out of it must have landed.  A trainer that waited for
		 * the parameter (the usual case) finds it done; the host
		 * backend lands queued copies here. */
		struct evref *prev = x->h2d;
		prev->refs++;
		pthread_mutex_unlock(&c->lock);
		r = c->ops->host_wait(c->be, prev->ev);
		pthread_mutex_lock(&c->lock);
		aoqc_evref_put(c, prev);
		if (r < 0)
			aoqc_fail(c, r, "parameter copy to the device failed: %s", aoq_last_error());
	}
	struct evref *after = NULL; /* the copy this push's records wait for */
	if (c->o.delayed_update) {
		/* The last copy out of the buffer this step will write is done
		 * (it left during the previous step); then the pending update
		 * goes to the device, after the work on the stream so far. */
		struct evref *prev = x->h2d;
		if (prev && prev->ev) {
			prev->refs++;
			pthread_mutex_unlock(&c->lock);
			r = c->ops->host_wait(c->be, prev->ev);
			pthread_mutex_lock(&c->lock);
			aoqc_evref_put(c, prev);
		}
		if (x->pending && r == 0) {
			x->pending = false;
			aoqc_copy_param(c, x, pending_src(x), 0, x->d.numel, NULL, x->pending_step);
			/* the master is the parameter: this push's update writes
			 * it again, so its records wait for the copy (on the
			 * device where the backend can order the gradient's copy
			 * after it, else here, once for every piece) */
			if (x->master_area && x->h2d && x->h2d->ev) {
				after = x->h2d;
				after->refs++;
				if (!c->ops->d2h_after) {
					pthread_mutex_unlock(&c->lock);
					r = c->ops->host_wait(c->be, after->ev);
					pthread_mutex_lock(&c->lock);
					aoqc_evref_put(c, after);
					after = NULL;
					if (r < 0)
						aoqc_fail(c, r, "parameter copy to the device failed: %s", aoq_last_error());
				}
			}
		}
	}
	/* In pieces: the daemon starts on the first while the rest copies.
	 * In a replica group only our slice (the others push theirs). */
	uint64_t end = c->world ? x->se : x->d.numel;
	if (c->world && !(flags & AOQ_PUSH_ACCUMULATE))
		x->want = c->step;
	for (uint64_t off = c->world ? x->sb : 0; r == 0 && !c->slots && off < end; off += AOQ_PUSH_CHUNK_ELEMS) {
		rec.offset = off;
		rec.count = end - off < AOQ_PUSH_CHUNK_ELEMS ? end - off : AOQ_PUSH_CHUNK_ELEMS;
		r = aoqc_start_copy(c, x, x->grad_area + off * x->gsize, (const uint8_t *)grad + off * x->gsize, &rec,
		                    after ? after->ev : NULL);
	}
	aoqc_evref_put(c, after);
	for (uint64_t off = 0; r == 0 && c->slots && off < x->d.numel; off += c->hdr.slot_elems) {
		while (!c->error && c->nfree == 0)
			aoqc_wait_daemon(c, &dl);
		if (c->error)
			break;
		uint32_t i = c->free_slots[--c->nfree];
		struct slot *sl = &c->slots[i];
		struct evref *prev = sl->h2d;
		sl->h2d = NULL;
		sl->busy = true;
		sl->tensor = t;
		sl->offset = off;
		sl->count = x->d.numel - off < c->hdr.slot_elems ? x->d.numel - off : c->hdr.slot_elems;
		if (prev && prev->ev) {
			/* Its param area may still be on its way to the device. */
			pthread_mutex_unlock(&c->lock);
			r = c->ops->host_wait(c->be, prev->ev);
			pthread_mutex_lock(&c->lock);
		}
		aoqc_evref_put(c, prev);
		rec.slot = i;
		rec.offset = off;
		rec.count = sl->count;
		if (r == 0)
			r = aoqc_start_copy(c, x, sl->grad_area, (const uint8_t *)grad + off * x->gsize, &rec, NULL);
	}
	if (r == 0 && c->error)
		r = aoqc_session_error(c);
	pthread_mutex_unlock(&c->lock);
	return r;
}

int aoq_push_grad(struct aoq_client *c, uint32_t t, unsigned flags, void *stream)
{
	if (t >= c->ntensors)
		return aoq_set_error(-EINVAL, "aoq_push_grad: no tensor %u", t);
	if (!c->tensors[t].d.grad)
		return aoq_set_error(-EINVAL, "tensor %u has no registered grad buffer", t);
	return aoq_push_grad_ptr(c, t, c->tensors[t].d.grad, flags, stream);
}

int aoq_grad_copied(struct aoq_client *c, uint32_t t)
{
	struct deadline dl = { 0 };
	if (t >= c->ntensors)
		return -EINVAL;
	struct tensor *x = &c->tensors[t];
	pthread_mutex_lock(&c->lock);
	while (!c->error && x->copied < x->copies)
		aoqc_wait_daemon(c, &dl);
	int r = c->error && x->copied < x->copies ? aoqc_session_error(c) : 0;
	pthread_mutex_unlock(&c->lock);
	return r;
}

int aoq_grad_pending(struct aoq_client *c, uint32_t t)
{
	if (t >= c->ntensors)
		return aoq_set_error(-EINVAL, "aoq_grad_pending: no tensor %u", t);
	struct tensor *x = &c->tensors[t];
	pthread_mutex_lock(&c->lock);
	uint64_t n = x->copies - x->copied;
	int r = c->error && n ? aoqc_session_error(c) : (int)(n > INT32_MAX ? INT32_MAX : n);
	pthread_mutex_unlock(&c->lock);
	return r;
}

/* Waits until tensor t's last record is answered (not with the delayed
 * update: its copy leaves at the next push) and takes a reference to the
 * last copy to the device. */
static int wait_answered(struct aoq_client *c, uint32_t t, struct evref **ev)
{
	struct deadline dl = { 0 };
	if (t >= c->ntensors)
		return aoq_set_error(-EINVAL, "no tensor %u", t);
	struct tensor *x = &c->tensors[t];
	pthread_mutex_lock(&c->lock);
	bool spun = false;
	while (!c->o.delayed_update && !c->error && !aoqc_param_answered(c, x)) {
		if (!spun && (spun = aoqc_spin_answers(c, x)))
			continue;
		aoqc_wait_daemon(c, &dl);
	}
	int r = !c->o.delayed_update && !aoqc_param_answered(c, x) ? aoqc_session_error(c) : 0;
	*ev = r == 0 && x->h2d && x->h2d->ev ? x->h2d : NULL;
	if (*ev)
		(*ev)->refs++;
	pthread_mutex_unlock(&c->lock);
	return r;
}

int aoq_wait_param(struct aoq_client *c, uint32_t t, void *stream)
{
	struct evref *ev;
	int r = wait_answered(c, t, &ev);
	return r < 0 ? r : aoqc_wait_event(c, ev, stream ? stream : c->o.cuda_stream, false);
}

int aoq_sync_param(struct aoq_client *c, uint32_t t)
{
	struct evref *ev;
	int r = wait_answered(c, t, &ev);
	return r < 0 ? r : aoqc_wait_event(c, ev, NULL, true);
}

int aoq_step_end(struct aoq_client *c)
{
	struct deadline dl = { 0 };
	if (!c->registered)
		return aoq_set_error(-EINVAL, "aoq_step_end before aoq_register");
	pthread_mutex_lock(&c->ctl_lock);
	Aoq__StepEnd m = AOQ__STEP_END__INIT;
	pthread_mutex_lock(&c->lock);
	m.step = c->step;
	/* Gradient copies still in flight must post before the step closes. */
	for (uint32_t i = 0; i < c->ntensors; i++)
		while (!c->error && c->tensors[i].copied < c->tensors[i].copies)
			aoqc_wait_daemon(c, &dl);
	int r = c->error ? aoqc_session_error(c) : 0;
	pthread_mutex_unlock(&c->lock);
	if (r == 0)
		r = aoqc_report_spans(c); /* the step's gradient copies, the last step's parameter copies */
	if (r == 0) {
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_STEP_END;
		env.step_end = &m;
		r = aoq_send_frame(c->sock, &env, NULL, 0);
		int why = 0;
		if (r == -EPIPE || r == -ECONNRESET) {
			/* The daemon closed the session, perhaps saying why
			 * (PEER_LOST): that Error is the answer. */
			int e = aoqc_ctl_recv(c, AOQ__ENVELOPE__MSG_STEP_ENDED, NULL, NULL, NULL);
			if (e < 0 && e != -EPIPE && e != -ECONNRESET)
				why = e;
		}
		if (why)
			r = why;
		else if (r < 0)
			aoq_set_error(r, "aoqd: send: %s", strerror(-r));
	}
	if (r == 0) {
		pthread_mutex_lock(&c->lock);
		c->step_ends_pending++;
		c->step++;
		pthread_mutex_unlock(&c->lock);
	}
	pthread_mutex_unlock(&c->ctl_lock);
	return r;
}

int aoq_sync(struct aoq_client *c, struct aoq_step_result *last)
{
	struct deadline dl = { 0 };
	if (last && aoqc_size_ok(last->size, sizeof(*last), "aoq_step_result") < 0)
		return -EINVAL;
	if (!c->registered)
		return aoq_set_error(-EINVAL, "aoq_sync before aoq_register");
	int r = 0;
	pthread_mutex_lock(&c->ctl_lock);
	while (r == 0 && c->step_ends_pending > 0)
		r = aoqc_ctl_recv(c, AOQ__ENVELOPE__MSG_STEP_ENDED, NULL, NULL, NULL);
	pthread_mutex_unlock(&c->ctl_lock);
	pthread_mutex_lock(&c->lock);
	for (uint32_t i = 0; i < c->ntensors; i++)
		while (!c->error && !aoqc_param_answered(c, &c->tensors[i]))
			aoqc_wait_daemon(c, &dl);
	if (c->error && r == 0)
		r = aoqc_session_error(c);
	pthread_mutex_unlock(&c->lock);
	for (uint32_t i = 0; r == 0 && i < c->ntensors; i++)
		r = aoq_sync_param(c, i);
	if (r == 0 && last) {
		pthread_mutex_lock(&c->lock);
		*last = c->last;
		last->size = sizeof(*last);
		pthread_mutex_unlock(&c->lock);
	}
	return r;
}

int aoq_flush(struct aoq_client *c)
{
	if (!c->registered)
		return aoq_set_error(-EINVAL, "aoq_flush before aoq_register");
	int r = aoq_sync(c, NULL);
	pthread_mutex_lock(&c->lock);
	for (uint32_t i = 0; r == 0 && i < c->ntensors; i++) {
		struct tensor *x = &c->tensors[i];
		if (!x->pending)
			continue;
		x->pending = false;
		aoqc_copy_param(c, x, pending_src(x), 0, x->d.numel, NULL, x->pending_step);
	}
	if (c->error && r == 0)
		r = aoqc_session_error(c);
	pthread_mutex_unlock(&c->lock);
	for (uint32_t i = 0; r == 0 && i < c->ntensors; i++)
		r = aoq_sync_param(c, i);
	return r;
}
