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

/* The transfer area as one or two places (protocol 3's xfer_offset): with
 * two, aoqd serves a request from one while the client fills (load) or
 * empties (read) the other, so that the client's copies and aoqd's
 * conversions overlap instead of taking turns.  An area too small to halve
 * (a model of tiny tensors) is one place. */
#define XFER_HALF_MIN 4096u

struct pipe {
	struct aoq_client *c;
	bool load;
	uint32_t tensor;
	int what;
	enum aoq_dtype dtype;
	size_t dsize;
	uint64_t room;   /* elements per piece */
	uint64_t place;  /* bytes between the places */
	unsigned places; /* 1 or 2 */
	bool pending;    /* a request is in flight: its reply is still to be read */
};

static void pipe_init(struct pipe *p, struct aoq_client *c, bool load, uint32_t t, int what, enum aoq_dtype dtype)
{
	uint64_t x = c->hdr.xfer_bytes;
	p->c = c;
	p->load = load;
	p->tensor = t;
	p->what = what;
	p->dtype = dtype;
	p->dsize = dtype == AOQ_FP32 ? 4 : 2;
	p->places = x >= 2 * (uint64_t)XFER_HALF_MIN ? 2 : 1;
	p->place = p->places == 2 ? x / 2 / AOQ_ARENA_ALIGN * AOQ_ARENA_ALIGN : x;
	p->room = p->place / p->dsize;
	p->pending = false;
}

static uint8_t *pipe_at(const struct pipe *p, uint64_t k)
{
	return p->c->arena + p->c->hdr.xfer_off + (k % p->places) * p->place;
}

/* Sends the request for piece k: n elements at off, at piece k's place. */
static int pipe_send(struct pipe *p, uint64_t k, uint64_t off, uint64_t n)
{
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	Aoq__LoadState lm = AOQ__LOAD_STATE__INIT;
	Aoq__ReadState rm = AOQ__READ_STATE__INIT;
	uint64_t xoff = (k % p->places) * p->place;
	if (p->load) {
		lm.tensor = p->tensor, lm.what = p->what, lm.dtype = (Aoq__DType)p->dtype;
		lm.offset = off, lm.count = n, lm.xfer_offset = xoff;
		env.msg_case = AOQ__ENVELOPE__MSG_LOAD_STATE;
		env.load_state = &lm;
	} else {
		rm.tensor = p->tensor, rm.what = p->what, rm.dtype = (Aoq__DType)p->dtype;
		rm.offset = off, rm.count = n, rm.xfer_offset = xoff;
		env.msg_case = AOQ__ENVELOPE__MSG_READ_STATE;
		env.read_state = &rm;
	}
	int r = aoqc_ctl_send(p->c, &env, AOQ__ENVELOPE__MSG_DONE);
	p->pending = r == 0;
	return r;
}

/* Reads the reply of the request in flight, if any. */
static int pipe_wait(struct pipe *p)
{
	if (!p->pending)
		return 0;
	p->pending = false;
	return aoqc_ctl_recv(p->c, AOQ__ENVELOPE__MSG_DONE, NULL, NULL, NULL);
}

/* Copies a piece between the client's memory and the transfer area: load:
 * elements [off, off + n) into at; read: out of at. */
typedef int (*piece_fn)(void *ctx, uint64_t off, uint64_t n, uint8_t *at);

/* Elements [b, e) of the tensor through the area, piece by piece, each
 * piece's copy beside aoqd's work on the one before (load) or after (read).
 * Stops at the first failure, with no request left unanswered. */
static int pipe_run(struct pipe *p, uint64_t b, uint64_t e, piece_fn copy, void *ctx)
{
	int r = 0;
	uint64_t k = 0;
	if (p->load) {
		for (uint64_t off = b; off < e; off += p->room, k++) {
			uint64_t n = e - off < p->room ? e - off : p->room;
			if (p->places == 1 && (r = pipe_wait(p)) < 0)
				return r;
			int cr = copy(ctx, off, n, pipe_at(p, k));
			if ((r = pipe_wait(p)) < 0 || (r = cr) < 0 || (r = pipe_send(p, k, off, n)) < 0)
				break;
		}
		int w = pipe_wait(p);
		return r < 0 ? r : w;
	}
	if (b >= e)
		return 0;
	uint64_t n = e - b < p->room ? e - b : p->room;
	if ((r = pipe_send(p, 0, b, n)) < 0)
		return r;
	for (uint64_t off = b;; k++) {
		if ((r = pipe_wait(p)) < 0)
			return r;
		uint64_t next = off + n, nn = e - next < p->room ? e - next : p->room;
		bool more = next < e;
		if (more && p->places == 2 && (r = pipe_send(p, k + 1, next, nn)) < 0)
			return r;
		if ((r = copy(ctx, off, n, pipe_at(p, k))) < 0) {
			pipe_wait(p);
			return r;
		}
		if (!more)
			return 0;
		if (p->places == 1 && (r = pipe_send(p, k + 1, next, nn)) < 0)
			return r;
		off = next;
		n = nn;
	}
}

struct initial {
	struct aoq_client *c;
	const struct tensor *x;
	size_t dsize;
};

static int copy_initial(void *ctx, uint64_t off, uint64_t n, uint8_t *at)
{
	struct initial *in = ctx;
	if (in->x->d.init) {
		memcpy(at, (const uint8_t *)in->x->d.init + off * in->dsize, n * in->dsize);
		return 0;
	}
	return in->c->ops->copy_to_host(in->c->be, at, (const uint8_t *)in->x->d.param + off * in->dsize, n * in->dsize);
}

/* Moves a tensor's initial values into the daemon's master. */
int aoqc_load_initial(struct aoq_client *c, uint32_t i)
{
	struct tensor *x = &c->tensors[i];
	enum aoq_dtype dt = x->d.init ? x->d.init_dtype : x->d.param_dtype;
	struct pipe p;
	pipe_init(&p, c, true, i, AOQ__STATE_KIND__PARAM, dt);
	struct initial in = { .c = c, .x = x, .dsize = p.dsize };
	/* A replica group's rank loads its own slice (the others theirs). */
	return pipe_run(&p, c->world ? x->sb : 0, c->world ? x->se : x->d.numel, copy_initial, &in);
}

static int copy_resumed(void *ctx, uint64_t off, uint64_t n, uint8_t *at)
{
	struct initial *in = ctx;
	return in->c->ops->copy_to_device(in->c->be, (uint8_t *)in->x->d.param + off * in->dsize, at, n * in->dsize);
}

/* A resumed session: tensor i's parameter from the daemon's master, in
 * its param dtype (rounded as the updates round it). */
int aoqc_load_resumed(struct aoq_client *c, uint32_t i)
{
	struct tensor *x = &c->tensors[i];
	struct pipe p;
	pipe_init(&p, c, false, i, AOQ__STATE_KIND__MASTER, x->d.param_dtype);
	struct initial in = { .c = c, .x = x, .dsize = p.dsize };
	return pipe_run(&p, 0, x->d.numel, copy_resumed, &in);
}

struct user_buf {
	uint8_t *base; /* element `first` of the range */
	uint64_t first;
	size_t dsize;
	bool load;
};

static int copy_user(void *ctx, uint64_t off, uint64_t n, uint8_t *at)
{
	struct user_buf *u = ctx;
	uint8_t *mine = u->base + (off - u->first) * u->dsize;
	if (u->load)
		memcpy(at, mine, n * u->dsize);
	else
		memcpy(mine, at, n * u->dsize);
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
	struct pipe p;
	pthread_mutex_lock(&c->ctl_lock);
	pipe_init(&p, c, load, t, what, dtype);
	struct user_buf u = { .base = buf, .first = offset, .dsize = dsize, .load = load };
	r = pipe_run(&p, offset, offset + count, copy_user, &u);
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
