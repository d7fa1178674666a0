/* SPDX-License-Identifier: MIT */
/*
 * State transfer: LoadState and ReadState through the arena's transfer
 * area, in pieces of its size, the initial values at registration, a
 * resumed session's parameters, TensorSteps.
 */
#include <errno.h>
#include <string.h>

#include "transfer.h"
#include "control.h"

/* The transfer area in one window, or two halves (the daemon takes `at`,
 * Welcome.xfer_at, and the area is large enough to split): while the
 * daemon loads one half (or fills it, for a read), the client fills (or
 * empties) the other, so that its copies (from or to the device, or a
 * memcpy) overlap the daemon's work instead of following it. */
#define XFER_SPLIT_MIN (128u << 10)
struct windows {
	uint8_t *base;
	uint64_t bytes; /* of one window, a multiple of 64 */
	unsigned n;
};

static struct windows windows_of(const struct aoq_client *c)
{
	struct windows w = { c->arena + c->hdr.xfer_off, c->hdr.xfer_bytes, 1 };
	if (c->xfer_at && c->hdr.xfer_bytes >= XFER_SPLIT_MIN) {
		w.bytes = c->hdr.xfer_bytes / 2 / 64 * 64;
		w.n = 2;
	}
	return w;
}

/* env: a LoadState (load) or ReadState of n elements from off, through the
 * transfer area at byte `at`; l and rd hold the message. */
static void xfer_fill(Aoq__Envelope *env, Aoq__LoadState *l, Aoq__ReadState *rd, bool load, uint32_t i, int what,
                      enum aoq_dtype dt, uint64_t off, uint64_t n, uint64_t at)
{
	/* the two messages have the same fields */
#define XFER_FIELDS(m)                                                                               \
	((m)->tensor = i, (m)->what = (Aoq__StateKind)what, (m)->dtype = (Aoq__DType)dt, (m)->offset = off, \
	 (m)->count = n, (m)->at = at)
	if (load) {
		XFER_FIELDS(l);
		env->msg_case = AOQ__ENVELOPE__MSG_LOAD_STATE;
		env->load_state = l;
	} else {
		XFER_FIELDS(rd);
		env->msg_case = AOQ__ENVELOPE__MSG_READ_STATE;
		env->read_state = rd;
	}
#undef XFER_FIELDS
}

static int xfer_send(struct aoq_client *c, bool load, uint32_t i, int what, enum aoq_dtype dt, uint64_t off,
                     uint64_t n, uint64_t at)
{
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	Aoq__LoadState l = AOQ__LOAD_STATE__INIT;
	Aoq__ReadState rd = AOQ__READ_STATE__INIT;
	xfer_fill(&env, &l, &rd, load, i, what, dt, off, n, at);
	return aoqc_ctl_send(c, &env);
}

/* Piece k's bytes into window k % n (a load's source). */
static int fill_piece(struct aoq_client *c, const struct tensor *x, enum aoq_dtype dt, const struct windows *w,
                      uint64_t k, uint64_t off, uint64_t n)
{
	size_t dsize = dt == AOQ_FP32 ? 4 : 2;
	uint8_t *dst = w->base + (k % w->n) * w->bytes;
	if (x->d.init) {
		memcpy(dst, (const uint8_t *)x->d.init + off * dsize, n * dsize);
		return 0;
	}
	return c->ops->copy_to_host(c->be, dst, (const uint8_t *)x->d.param + off * dsize, n * dsize);
}

/* Moves a tensor's initial values into the daemon's master copy: piece
 * k+1 is copied into its window while the daemon loads piece k. */
int aoqc_load_initial(struct aoq_client *c, uint32_t i)
{
	struct tensor *x = &c->tensors[i];
	enum aoq_dtype dt = x->d.init ? x->d.init_dtype : x->d.param_dtype;
	size_t dsize = dt == AOQ_FP32 ? 4 : 2;
	struct windows w = windows_of(c);
	uint64_t room = w.bytes / dsize;
	/* A replica group's rank loads its own slice (the others theirs). */
	uint64_t begin = c->world ? x->sb : 0, end = c->world ? x->se : x->d.numel;
	if (begin >= end)
		return 0;
	uint64_t n0 = end - begin < room ? end - begin : room;
	int r = fill_piece(c, x, dt, &w, 0, begin, n0);
	if (r == 0)
		r = xfer_send(c, true, i, AOQ__STATE_KIND__PARAM, dt, begin, n0, 0);
	for (uint64_t k = 0, off = begin; r == 0; k++) {
		uint64_t next = off + room < end ? off + room : end, nn = end - next < room ? end - next : room;
		int fr = 0;
		if (next < end && w.n == 2)
			fr = fill_piece(c, x, dt, &w, k + 1, next, nn); /* overlaps the daemon's load of piece k */
		r = aoqc_ctl_recv(c, AOQ__ENVELOPE__MSG_DONE, NULL, NULL, NULL);
		if (r == 0)
			r = fr;
		if (r < 0 || next >= end)
			break;
		if (w.n == 1)
			r = fill_piece(c, x, dt, &w, k + 1, next, nn);
		if (r == 0)
			r = xfer_send(c, true, i, AOQ__STATE_KIND__PARAM, dt, next, nn, ((k + 1) % w.n) * w.bytes);
		off = next;
	}
	return r;
}

/* A resumed session: tensor i's parameter from the daemon's master, in
 * its param dtype (rounded as the updates round it); the daemon reads
 * piece k+1 into its window while piece k is copied out.  A master that is
 * the parameter (the masters memfds) is copied straight from our mapping
 * of it: aoqd left it there at the resumed step, rolled back before it
 * answered the registration, in the very bytes the updates copy out. */
int aoqc_load_resumed(struct aoq_client *c, uint32_t i)
{
	struct tensor *x = &c->tensors[i];
	if (x->master_area)
		return x->d.numel ? c->ops->copy_to_device(c->be, x->d.param, x->master_area, x->d.numel * x->psize) : 0;
	enum aoq_dtype dt = x->d.param_dtype;
	struct windows w = windows_of(c);
	uint64_t room = w.bytes / x->psize, end = x->d.numel;
	if (end == 0)
		return 0;
	int r = xfer_send(c, false, i, AOQ__STATE_KIND__MASTER, dt, 0, end < room ? end : room, 0);
	for (uint64_t k = 0, off = 0; r == 0; k++) {
		uint64_t n = end - off < room ? end - off : room, next = off + n;
		uint64_t nn = end - next < room ? end - next : room;
		r = aoqc_ctl_recv(c, AOQ__ENVELOPE__MSG_DONE, NULL, NULL, NULL);
		if (r < 0)
			break;
		bool ahead = next < end && w.n == 2;
		if (ahead)
			r = xfer_send(c, false, i, AOQ__STATE_KIND__MASTER, dt, next, nn, ((k + 1) % w.n) * w.bytes);
		int cr = r < 0 ? 0
		                 : c->ops->copy_to_device(c->be, (uint8_t *)x->d.param + off * x->psize,
		                                          w.base + (k % w.n) * w.bytes, n * x->psize);
		if (cr < 0) {
			if (ahead) /* its reply read, the connection stays in step */
				aoqc_ctl_recv(c, AOQ__ENVELOPE__MSG_DONE, NULL, NULL, NULL);
			return cr;
		}
		if (r < 0 || next >= end)
			break;
		if (!ahead)
			r = xfer_send(c, false, i, AOQ__STATE_KIND__MASTER, dt, next, nn, 0);
		off = next;
	}
	return r;
}

static int transfer(struct aoq_client *c, bool load, uint32_t t, int what, enum aoq_dtype dtype,
                    uint64_t offset, uint64_t count, void *buf)
{
	if (!c->registered || t >= c->ntensors || what < 0 || what > 2 || !dtype_ok(dtype) ||
	    !aoq_range_ok(offset, count, c->tensors[t].d.numel))
		return aoq_set_error(-EINVAL, "state transfer: bad arguments");
	int r = aoq_sync(c, NULL);
	if (r < 0)
		return r;
	size_t dsize = dtype == AOQ_FP32 ? 4 : 2;
	if (load && c->world) {
		/* A replica group's rank writes only its own slice: every rank
		 * loads the same values, each its part (docs/design.md). */
		const struct tensor *x = &c->tensors[t];
		uint64_t b = offset > x->sb ? offset : x->sb;
		uint64_t e = offset + count < x->se ? offset + count : x->se;
		if (b >= e)
			return 0;
		buf = (uint8_t *)buf + (b - offset) * dsize;
		offset = b;
		count = e - b;
	}
	uint64_t room = c->hdr.xfer_bytes / dsize;
	uint8_t *xfer = c->arena + c->hdr.xfer_off;
	pthread_mutex_lock(&c->ctl_lock);
	for (uint64_t done = 0; r == 0 && done < count; done += room) {
		uint64_t n = count - done < room ? count - done : room;
		uint8_t *p = (uint8_t *)buf + done * dsize;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		Aoq__LoadState lm = AOQ__LOAD_STATE__INIT;
		Aoq__ReadState rm = AOQ__READ_STATE__INIT;
		if (load)
			memcpy(xfer, p, n * dsize);
		xfer_fill(&env, &lm, &rm, load, t, what, dtype, offset + done, n, 0);
		r = aoqc_ctl_call(c, &env, AOQ__ENVELOPE__MSG_DONE, NULL);
		if (r == 0 && !load)
			memcpy(p, xfer, n * dsize);
	}
	pthread_mutex_unlock(&c->ctl_lock);
	return r;
}

int aoq_read_state(struct aoq_client *c, uint32_t t, enum aoq_state_kind what, enum aoq_dtype dtype, uint64_t offset,
                   uint64_t count, void *dst)
{
	return transfer(c, false, t, what, dtype, offset, count, dst);
}

int aoq_load_state(struct aoq_client *c, uint32_t t, enum aoq_state_kind what, enum aoq_dtype dtype, uint64_t offset,
                   uint64_t count, const void *src)
{
	return transfer(c, true, t, what, dtype, offset, count, (void *)src);
}

static int tensor_steps(struct aoq_client *c, uint32_t first, uint32_t n, uint64_t *steps, bool set)
{
	if (!c->registered || !aoq_range_ok(first, n, c->ntensors))
		return aoq_set_error(-EINVAL, "tensor steps: bad range");
	int r = aoq_sync(c, NULL);
	for (uint32_t done = 0; r == 0 && done < n;) {
		uint32_t k = n - done < 65536 ? n - done : 65536;
		Aoq__TensorSteps m = AOQ__TENSOR_STEPS__INIT;
		m.first = first + done;
		m.set = set;
		m.count = k;
		if (set) {
			m.n_steps = k;
			m.steps = steps + done;
		}
		Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep = NULL;
		env.msg_case = AOQ__ENVELOPE__MSG_TENSOR_STEPS;
		env.tensor_steps = &m;
		pthread_mutex_lock(&c->ctl_lock);
		r = aoqc_ctl_call(c, &env, AOQ__ENVELOPE__MSG_TENSOR_STEPS, &rep);
		pthread_mutex_unlock(&c->ctl_lock);
		if (r == 0 && rep->tensor_steps->n_steps != k)
			r = aoq_set_error(-EPROTO, "aoqd answered %zu steps for %u", rep->tensor_steps->n_steps, k);
		if (r == 0 && !set)
			memcpy(steps + done, rep->tensor_steps->steps, k * sizeof(uint64_t));
		aoq_envelope_free(rep);
		done += k;
	}
	return r;
}

int aoq_get_tensor_steps(struct aoq_client *c, uint32_t first, uint32_t n, uint64_t *steps)
{
	return tensor_steps(c, first, n, steps, false);
}

int aoq_set_tensor_steps(struct aoq_client *c, uint32_t first, uint32_t n, const uint64_t *steps)
{
	return tensor_steps(c, first, n, (uint64_t *)steps, true);
}

int aoq_release_tensors(struct aoq_client *c, const uint32_t *tensors, uint32_t n, uint64_t *bytes)
{
	if (!c->registered || !tensors || n == 0)
		return aoq_set_error(-EINVAL, "aoq_release_tensors: no tensors, or before aoq_register");
	for (uint32_t i = 0; i < n; i++)
		if (tensors[i] >= c->ntensors || c->tensors[tensors[i]].released)
			return aoq_set_error(-EINVAL, "aoq_release_tensors: tensor %u %s", tensors[i],
			                     tensors[i] >= c->ntensors ? "does not exist" : "was released before");
	if (!c->release_ok)
		return aoq_set_error(-EOPNOTSUPP, "aoq_release_tensors: this aoqd keeps every tensor's state (it is "
		                     "older than ReleaseTensors)");
	int r = aoq_sync(c, NULL);
	if (r < 0)
		return r;
	Aoq__ReleaseTensors m = AOQ__RELEASE_TENSORS__INIT;
	m.n_tensors = n;
	m.tensors = (uint32_t *)tensors;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep = NULL;
	env.msg_case = AOQ__ENVELOPE__MSG_RELEASE_TENSORS;
	env.release_tensors = &m;
	pthread_mutex_lock(&c->ctl_lock);
	r = aoqc_ctl_call(c, &env, AOQ__ENVELOPE__MSG_DONE, &rep);
	pthread_mutex_unlock(&c->ctl_lock);
	if (r == 0) {
		/* the caller read the state, the pending update's master with it
		 * (delayed update): nothing of aoqd's may land on the parameter
		 * again (aoq_flush) */
		pthread_mutex_lock(&c->lock);
		for (uint32_t i = 0; i < n; i++) {
			c->tensors[tensors[i]].released = true;
			c->tensors[tensors[i]].pending = false;
		}
		pthread_mutex_unlock(&c->lock);
		if (bytes)
			*bytes = rep->done->value;
	}
	aoq_envelope_free(rep);
	return r;
}
