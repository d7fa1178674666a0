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

/* Moves a tensor's initial values into the daemon's master copy. */
int aoqc_load_initial(struct aoq_client *c, uint32_t i)
{
	struct tensor *x = &c->tensors[i];
	enum aoq_dtype dt = x->d.init ? x->d.init_dtype : x->d.param_dtype;
	size_t dsize = dt == AOQ_FP32 ? 4 : 2;
	uint64_t room = c->hdr.xfer_bytes / dsize;
	uint8_t *xfer = c->arena + c->hdr.xfer_off;
	/* A replica group's rank loads its own slice (the others theirs). */
	uint64_t end = c->world ? x->se : x->d.numel;
	for (uint64_t off = c->world ? x->sb : 0; off < end; off += room) {
		uint64_t n = end - off < room ? end - off : room;
		int r;
		if (x->d.init)
			memcpy(xfer, (const uint8_t *)x->d.init + off * dsize, n * dsize);
		else if ((r = c->ops->copy_to_host(c->be, xfer, (const uint8_t *)x->d.param + off * dsize, n * dsize)) < 0)
			return r;
		Aoq__LoadState m = AOQ__LOAD_STATE__INIT;
		m.tensor = i;
		m.what = AOQ__STATE_KIND__PARAM;
		m.dtype = (Aoq__DType)dt;
		m.offset = off;
		m.count = n;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_LOAD_STATE;
		env.load_state = &m;
		if ((r = aoqc_ctl_call(c, &env, AOQ__ENVELOPE__MSG_DONE, NULL)) < 0)
			return r;
	}
	return 0;
}

/* A resumed session: tensor i's parameter from the daemon's master, in
 * its param dtype (rounded as the updates round it). */
int aoqc_load_resumed(struct aoq_client *c, uint32_t i)
{
	struct tensor *x = &c->tensors[i];
	uint64_t room = c->hdr.xfer_bytes / x->psize;
	uint8_t *xfer = c->arena + c->hdr.xfer_off;
	for (uint64_t off = 0; off < x->d.numel; off += room) {
		uint64_t n = x->d.numel - off < room ? x->d.numel - off : room;
		Aoq__ReadState m = AOQ__READ_STATE__INIT;
		m.tensor = i;
		m.what = AOQ__STATE_KIND__MASTER;
		m.dtype = (Aoq__DType)x->d.param_dtype;
		m.offset = off;
		m.count = n;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_READ_STATE;
		env.read_state = &m;
		int r = aoqc_ctl_call(c, &env, AOQ__ENVELOPE__MSG_DONE, NULL);
		if (r < 0)
			return r;
		if ((r = c->ops->copy_to_device(c->be, (uint8_t *)x->d.param + off * x->psize, xfer, n * x->psize)) < 0)
			return r;
	}
	return 0;
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
		if (load) {
			memcpy(xfer, p, n * dsize);
			lm.tensor = t, lm.what = what, lm.dtype = (Aoq__DType)dtype, lm.offset = offset + done, lm.count = n;
			env.msg_case = AOQ__ENVELOPE__MSG_LOAD_STATE;
			env.load_state = &lm;
		} else {
			rm.tensor = t, rm.what = what, rm.dtype = (Aoq__DType)dtype, rm.offset = offset + done, rm.count = n;
			env.msg_case = AOQ__ENVELOPE__MSG_READ_STATE;
			env.read_state = &rm;
		}
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
