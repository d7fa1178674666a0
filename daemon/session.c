/* SPDX-License-Identifier: MIT */
/*
 * Sessions: registration (state, arena, doorbells), the data plane (ring
 * records -> chunk jobs -> param records), steps and state transfer.
 *
 * Threads: everything here runs on the loop thread except chunk_run() and
 * job_complete(), which run on workers.  What workers touch of a session is
 * its state arrays (each chunk its own range), the to-client ring (under
 * ring_lock), the per-step sums (step_lock), stats (stats_lock) and atomics.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "aoqd.h"
#include "convert.h"
#include "log.h"

#define FAIL(s, code, ...) aoqd_session_fail(s, AOQ__ERROR_CODE__##code, __VA_ARGS__)

/* Elements per Load/Read request: bounds the time one request holds the
 * loop thread (about 16 ms of conversion). */
#define MAX_TRANSFER_ELEMS (4u << 20)

/* ---- state allocation ---- */

static void *alloc_state(struct aoqd_session *s, size_t len, bool *locked, int *err)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		*err = -errno;
		return NULL;
	}
	if (len >= (2u << 20))
		madvise(p, len, MADV_HUGEPAGE);
	*locked = false;
	if (s->srv->cfg.lock_memory) {
		if (mlock(p, len) == 0) {
			*locked = true;
		} else if (s->srv->cfg.lock_memory == 2) {
			*err = -errno;
			munmap(p, len);
			return NULL;
		} else {
			static bool warned;
			if (!warned)
				aoqd_warn("session", "cannot lock optimizer state in memory (%s): running unlocked; "
				          "raise LimitMEMLOCK (ulimit -l) or give CAP_IPC_LOCK", strerror(errno));
			warned = true;
		}
	}
	return p;
}

void aoqd_session_free_state(struct aoqd_session *s)
{
	for (uint32_t i = 0; i < s->ntensors; i++) {
		struct aoqd_tensor *t = &s->tensors[i];
		if (t->state_mem)
			munmap(t->state_mem, t->state_len);
		if (t->acc)
			munmap(t->acc, t->numel * sizeof(float));
		free(t->name);
	}
	if (s->locked_bytes)
		atomic_fetch_sub(&s->srv->locked_bytes, s->locked_bytes);
	free(s->tensors);
	free(s->groups);
	free(s->slots);
	s->tensors = NULL;
	s->groups = NULL;
	s->ntensors = 0;
	if (s->arena)
		munmap(s->arena, s->arena_size);
	if (s->arena_fd >= 0)
		close(s->arena_fd);
	if (s->doorbell_in >= 0)
		close(s->doorbell_in);
	if (s->doorbell_out >= 0)
		close(s->doorbell_out);
	s->arena = NULL;
	s->arena_fd = s->doorbell_in = s->doorbell_out = -1;
}

static uint64_t state_len(enum aoqk_precision p, uint64_t n, uint64_t off[5])
{
	uint64_t blocks = (n + AOQK_Q8_BLOCK - 1) / AOQK_Q8_BLOCK;
	uint64_t master = n * aoqk_master_size(p);
	uint64_t mom = n * aoqk_moment_size(p);
	uint64_t scale = aoqk_precision_q8(p) ? blocks * 4 : 0;
	uint64_t o = 0;
	off[0] = o; o = aoq_align_up(o + master, 64);
	off[1] = o; o = aoq_align_up(o + mom, 64);
	off[2] = o; o = aoq_align_up(o + mom, 64);
	off[3] = o; o = aoq_align_up(o + scale, 64);
	off[4] = o; o = aoq_align_up(o + scale, 64);
	return o;
}

/* ---- registration ---- */

static bool hp_valid(const Aoq__Hyperparams *h, char *why, size_t len)
{
	if (!h) {
		snprintf(why, len, "missing hyperparameters");
		return false;
	}
	if (!isfinite(h->lr) || h->lr < 0 || !(h->beta1 >= 0 && h->beta1 < 1) ||
	    !(h->beta2 >= 0 && h->beta2 < 1) || !(isfinite(h->eps) && h->eps > 0) ||
	    !isfinite(h->weight_decay) || h->weight_decay < 0) {
		snprintf(why, len, "hyperparameters out of range (lr %g betas %g %g eps %g wd %g)",
		         h->lr, h->beta1, h->beta2, h->eps, h->weight_decay);
		return false;
	}
	return true;
}

static void set_hp(struct aoqd_group *g, Aoq__OptimizerKind kind, const Aoq__Hyperparams *h)
{
	g->kind = kind;
	g->hp.lr = h->lr;
	g->hp.beta1 = h->beta1;
	g->hp.beta2 = h->beta2;
	g->hp.eps = h->eps;
	g->hp.weight_decay = h->weight_decay;
	g->hp.decoupled = kind == AOQ__OPTIMIZER_KIND__ADAMW;
	g->hp.grad_scale = 1.0f;
}

static bool dtype_valid(int d)
{
	return d == AOQ__DTYPE__FP32 || d == AOQ__DTYPE__BF16 || d == AOQ__DTYPE__FP16;
}

static void *grow(void *p, uint32_t *cap, uint32_t need, size_t elem)
{
	if (need <= *cap)
		return p;
	uint32_t n = *cap ? *cap : 16;
	while (n < need)
		n = n > UINT32_MAX / 2 ? need : n * 2;
	void *q = realloc(p, (size_t)n * elem);
	if (!q)
		return NULL;
	memset((char *)q + (size_t)*cap * elem, 0, (size_t)(n - *cap) * elem);
	*cap = n;
	return q;
}

static int build_arena(struct aoqd_session *s);

void aoqd_on_register(struct aoqd_session *s, const Aoq__Register *m)
{
	const struct aoqd_config *cfg = &s->srv->cfg;
	char why[256];
	if (!s->reg_started) {
		if (m->precision < 0 || m->precision > AOQ__STATE_PRECISION__STATE_BF16_ALL)
			{ FAIL(s, INVALID, "unknown state precision %d", (int)m->precision); return; }
		s->precision = m->precision;
		s->window = m->window;
		s->seed = m->seed ? m->seed : ((uint64_t)aoqd_now_ns() * 0x9e3779b97f4a7c15ull) ^ s->id;
		if (!isfinite(m->max_grad_norm) || m->max_grad_norm < 0)
			{ FAIL(s, INVALID, "max_grad_norm %g", m->max_grad_norm); return; }
		if (m->delayed && m->window)
			{ FAIL(s, INVALID, "the delayed update needs a slot per tensor (no window)"); return; }
		s->max_grad_norm = m->max_grad_norm;
		s->skip_nonfinite = m->skip_nonfinite;
		s->defer = m->max_grad_norm > 0 || m->skip_nonfinite;
		s->delayed = m->delayed;
		s->reg_started = true;
	}
	if (m->n_groups > 65536 - s->ngroups)
		{ FAIL(s, INVALID, "too many groups"); return; }
	if (m->n_tensors > cfg->max_tensors - s->ntensors)
		{ FAIL(s, INVALID, "more than %u tensors", cfg->max_tensors); return; }
	struct aoqd_group *g = grow(s->groups, &s->cap_groups, s->ngroups + (uint32_t)m->n_groups, sizeof(*g));
	if (!g)
		{ FAIL(s, NO_MEMORY, "out of memory"); return; }
	s->groups = g;
	for (size_t i = 0; i < m->n_groups; i++) {
		const Aoq__Group *mg = m->groups[i];
		if (mg->kind != AOQ__OPTIMIZER_KIND__ADAM && mg->kind != AOQ__OPTIMIZER_KIND__ADAMW)
			{ FAIL(s, INVALID, "group %u: unknown optimizer %d", s->ngroups, (int)mg->kind); return; }
		if (!hp_valid(mg->hp, why, sizeof(why)))
			{ FAIL(s, INVALID, "group %u: %s", s->ngroups, why); return; }
		set_hp(&s->groups[s->ngroups++], mg->kind, mg->hp);
	}
	struct aoqd_tensor *t = grow(s->tensors, &s->cap_tensors, s->ntensors + (uint32_t)m->n_tensors, sizeof(*t));
	if (!t)
		{ FAIL(s, NO_MEMORY, "out of memory"); return; }
	s->tensors = t;
	for (size_t i = 0; i < m->n_tensors; i++) {
		const Aoq__TensorDesc *d = m->tensors[i];
		if (strlen(d->name) > 1024)
			{ FAIL(s, INVALID, "tensor %u: name too long", s->ntensors); return; }
		if (d->numel == 0 || d->numel > cfg->max_tensor_elems)
			{ FAIL(s, INVALID, "tensor %u: %" PRIu64 " elements (1 to %" PRIu64 ")",
			            s->ntensors, d->numel, cfg->max_tensor_elems); return; }
		if (!dtype_valid(d->param_dtype) || !dtype_valid(d->grad_dtype))
			{ FAIL(s, INVALID, "tensor %u: unknown dtype", s->ntensors); return; }
		struct aoqd_tensor *x = &s->tensors[s->ntensors];
		x->name = strdup(d->name);
		if (!x->name)
			{ FAIL(s, NO_MEMORY, "out of memory"); return; }
		x->numel = d->numel;
		x->param_dtype = (enum aoqk_dtype)d->param_dtype;
		x->grad_dtype = (enum aoqk_dtype)d->grad_dtype;
		x->group = d->group;
		s->ntensors++; /* counted now so that free_state frees the name */
	}
	if (m->more) {
		Aoq__RegisterMore rm = AOQ__REGISTER_MORE__INIT;
		rm.tensors_so_far = s->ntensors;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_REGISTER_MORE;
		env.register_more = &rm;
		aoqd_send(s, &env);
		return;
	}
	if (s->ntensors == 0 || s->ngroups == 0)
		{ FAIL(s, INVALID, "registration without tensors or groups"); return; }
	for (uint32_t i = 0; i < s->ntensors; i++)
		if (s->tensors[i].group >= s->ngroups)
			{ FAIL(s, INVALID, "tensor %u: group %u of %u", i, s->tensors[i].group, s->ngroups); return; }

	/* Optimizer state, one mapping per tensor. */
	enum aoqk_precision prec = (enum aoqk_precision)s->precision;
	uint64_t total = 0;
	for (uint32_t i = 0; i < s->ntensors; i++) {
		uint64_t off[5];
		uint64_t len = state_len(prec, s->tensors[i].numel, off);
		if (__builtin_add_overflow(total, len, &total))
			{ FAIL(s, NO_MEMORY, "state too large"); return; }
	}
	if (cfg->max_state_bytes_per_uid) {
		uint64_t used = 0;
		for (struct aoqd_session *o = s->srv->sessions; o; o = o->next)
			if (o->uid == s->uid && o != s)
				used += o->state_bytes;
		if (used + total > cfg->max_state_bytes_per_uid)
			{ FAIL(s, QUOTA, "uid %u would hold %" PRIu64 " bytes of state (limit %" PRIu64 ")",
			            (unsigned)s->uid, used + total, cfg->max_state_bytes_per_uid); return; }
	}
	for (uint32_t i = 0; i < s->ntensors; i++) {
		struct aoqd_tensor *x = &s->tensors[i];
		uint64_t off[5];
		uint64_t len = state_len(prec, x->numel, off);
		bool locked;
		int err = 0;
		uint8_t *p = alloc_state(s, len, &locked, &err);
		if (!p)
			{ FAIL(s, NO_MEMORY, "cannot %s %" PRIu64 " bytes of optimizer state: %s%s",
			            err == -ENOMEM || err == -EAGAIN || err == -EPERM ? "lock" : "allocate", len,
			            strerror(-err), cfg->lock_memory == 2 ? " (raise LimitMEMLOCK or give CAP_IPC_LOCK)" : ""); return; }
		x->state_mem = p;
		x->state_len = len;
		if (locked) {
			s->locked_bytes += len;
			atomic_fetch_add(&s->srv->locked_bytes, len);
		}
		x->st.precision = prec;
		x->st.n = x->numel;
		x->st.master = p + off[0];
		x->st.m = p + off[1];
		x->st.v = p + off[2];
		x->st.m_scale = aoqk_precision_q8(prec) ? (float *)(p + off[3]) : NULL;
		x->st.v_scale = aoqk_precision_q8(prec) ? (float *)(p + off[4]) : NULL;
	}
	s->state_bytes = total;
	int r = build_arena(s);
	if (r < 0)
		{ FAIL(s, NO_MEMORY, "cannot create the arena: %s", strerror(-r)); return; }
	Aoq__Registered reg = AOQ__REGISTERED__INIT;
	reg.arena_size = s->arena_size;
	reg.tensors = s->ntensors;
	reg.state_bytes = s->state_bytes;
	reg.fds = 3;
	reg.seed = s->seed;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_REGISTERED;
	env.registered = &reg;
	int fds[3] = { s->arena_fd, s->doorbell_in, s->doorbell_out };
	r = aoqd_send_with_fds(s, &env, fds, 3);
	if (r < 0)
		{ FAIL(s, INTERNAL, "cannot send the arena: %s", strerror(-r)); return; }
	s->state = AOQD_READY;
	aoqd_info("session", "session %" PRIu64 ": registered %u tensors in %u groups, %" PRIu64
	          " bytes of state (%s), arena %" PRIu64 " bytes",
	          s->id, s->ntensors, s->ngroups, s->state_bytes,
	          protobuf_c_enum_descriptor_get_value(&aoq__state_precision__descriptor, s->precision)->name,
	          s->arena_size);
}

static void on_doorbell(uv_poll_t *h, int status, int events)
{
	struct aoqd_session *s = h->data;
	uint64_t v;
	ssize_t r = read(s->doorbell_in, &v, sizeof(v));
	(void)r;
	if (status < 0)
		{ FAIL(s, INTERNAL, "doorbell: %s", uv_strerror(status)); return; }
	aoqd_drain(s);
	if (s->state == AOQD_READY && s->step_end_pending)
		aoqd_check_step_end(s);
}

/* Lays out, creates, fills and seals the arena; creates the doorbells. */
static int build_arena(struct aoqd_session *s)
{
	const struct aoqd_config *cfg = &s->srv->cfg;
	uint64_t off = aoq_align_up(sizeof(struct aoq_arena_header), AOQ_ARENA_ALIGN);
	uint64_t tensor_table = off;
	off = aoq_align_up(off + (uint64_t)s->ntensors * sizeof(struct aoq_arena_tensor), AOQ_ARENA_ALIGN);
	if (s->window) {
		/* Staging slots of up to 1 Mi elements, grad and param areas of
		 * 4 bytes per element each (any dtype fits). */
		uint64_t biggest = 0;
		for (uint32_t i = 0; i < s->ntensors; i++)
			if (s->tensors[i].numel > biggest)
				biggest = s->tensors[i].numel;
		s->slot_elems = aoq_align_up(biggest < (1u << 20) ? biggest : (1u << 20), AOQK_Q8_BLOCK);
		uint64_t n = s->window / (8 * s->slot_elems);
		if (n < 2)
			n = 2;
		if (n > 4096)
			n = 4096;
		s->nslots = (uint32_t)n;
	} else {
		s->nslots = s->ntensors;
	}
	uint64_t slot_table = off;
	off = aoq_align_up(off + (uint64_t)s->nslots * sizeof(struct aoq_arena_slot), AOQ_ARENA_ALIGN);
	/* Room for two steps' records: a tensor is pushed in pieces of
	 * AOQ_PUSH_CHUNK_ELEMS, or one per slot with a window. */
	uint64_t recs = 0;
	for (uint32_t i = 0; !s->window && i < s->ntensors; i++)
		recs += (s->tensors[i].numel + AOQ_PUSH_CHUNK_ELEMS - 1) / AOQ_PUSH_CHUNK_ELEMS;
	uint64_t cap = 2 * (s->window ? s->nslots : recs);
	s->ring_cap = (uint32_t)(cap < 256 ? 256 : cap > AOQ_RING_MAX_CAP ? AOQ_RING_MAX_CAP : cap);
	uint64_t ring_bytes = sizeof(struct aoq_ring) + (uint64_t)s->ring_cap * sizeof(struct aoq_rec);
	uint64_t to_daemon = off;
	off = aoq_align_up(off + ring_bytes, AOQ_ARENA_ALIGN);
	uint64_t to_client = off;
	off = aoq_align_up(off + ring_bytes, AOQ_ARENA_ALIGN);
	/* The transfer area holds 4 Mi fp32 values, or the largest tensor. */
	uint64_t biggest = 0;
	for (uint32_t i = 0; i < s->ntensors; i++)
		if (s->tensors[i].numel > biggest)
			biggest = s->tensors[i].numel;
	s->xfer_off = off;
	s->xfer_bytes = 4 * (biggest < MAX_TRANSFER_ELEMS ? biggest : MAX_TRANSFER_ELEMS);
	off = aoq_align_up(off + s->xfer_bytes, AOQ_ARENA_ALIGN);
	uint64_t data = off;
	s->slots = calloc(s->nslots, sizeof(*s->slots));
	if (!s->slots)
		return -ENOMEM;
	for (uint32_t i = 0; i < s->nslots; i++) {
		struct aoq_arena_slot *sl = &s->slots[i];
		uint64_t gb, pb;
		if (s->window) {
			gb = pb = s->slot_elems * 4;
		} else {
			gb = s->tensors[i].numel * aoqk_dtype_size(s->tensors[i].grad_dtype);
			pb = s->tensors[i].numel * aoqk_dtype_size(s->tensors[i].param_dtype);
		}
		sl->grad_off = off;
		sl->grad_bytes = gb;
		off = aoq_align_up(off + gb, AOQ_ARENA_ALIGN);
		sl->param_off = off;
		sl->param_bytes = pb;
		off = aoq_align_up(off + pb, AOQ_ARENA_ALIGN);
		if (s->delayed) /* the second buffer */
			off = aoq_align_up(off + pb, AOQ_ARENA_ALIGN);
		if (off > cfg->max_arena_bytes)
			return -EFBIG;
	}
	s->arena_size = off;

	int fd = memfd_create("aoq-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	s->arena_fd = fd;
	if (ftruncate(fd, (off_t)s->arena_size) < 0)
		return -errno;
	void *p = mmap(NULL, s->arena_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return -errno;
	s->arena = p;
	struct aoq_arena_header *h = p;
	h->magic = AOQ_ARENA_MAGIC;
	h->version = AOQ_ARENA_VERSION;
	h->size = s->arena_size;
	h->tensors = s->ntensors;
	h->slots = s->nslots;
	h->window = s->window;
	h->slot_elems = s->slot_elems;
	h->ring_capacity = s->ring_cap;
	h->rec_size = sizeof(struct aoq_rec);
	h->tensor_table_off = tensor_table;
	h->slot_table_off = slot_table;
	h->to_daemon_off = to_daemon;
	h->to_client_off = to_client;
	h->data_off = data;
	h->session_id = s->id;
	h->xfer_off = s->xfer_off;
	h->xfer_bytes = s->xfer_bytes;
	h->flags = s->delayed ? AOQ_ARENA_DELAYED : 0;
	struct aoq_arena_tensor *tt = (void *)(s->arena + tensor_table);
	for (uint32_t i = 0; i < s->ntensors; i++) {
		tt[i].numel = s->tensors[i].numel;
		tt[i].param_dtype = s->tensors[i].param_dtype;
		tt[i].grad_dtype = s->tensors[i].grad_dtype;
		tt[i].group = s->tensors[i].group;
		tt[i].slot = s->window ? UINT32_MAX : i;
	}
	memcpy(s->arena + slot_table, s->slots, (size_t)s->nslots * sizeof(*s->slots));
	/* The layout keeps the rules every reader checks. */
	if (aoq_arena_header_check(h, s->arena_size) < 0)
		return -EPROTO;
	for (uint32_t i = 0; i < s->nslots; i++)
		if (aoq_arena_slot_check(h, &s->slots[i], 0, 0) < 0)
			return -EPROTO;
	s->to_daemon = (struct aoq_ring_cons){ .ring = (void *)(s->arena + to_daemon), .cap = s->ring_cap };
	s->to_client = (struct aoq_ring_prod){ .ring = (void *)(s->arena + to_client), .cap = s->ring_cap };
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0)
		return -errno;
	s->doorbell_in = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	s->doorbell_out = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (s->doorbell_in < 0 || s->doorbell_out < 0)
		return -errno;
	int r = uv_poll_init(s->srv->loop, &s->doorbell_poll, s->doorbell_in);
	if (r < 0)
		return r;
	s->doorbell_poll.data = s;
	s->poll_open = true;
	return uv_poll_start(&s->doorbell_poll, UV_READABLE, on_doorbell);
}

/* ---- steps ---- */

/* Sends StepEnded for the ending step if its last job is done. */
static bool finish_step(struct aoqd_session *s)
{
	unsigned p = s->ending_step & 1;
	/* Not done while a record of the step may still wait in the ring. */
	if (!s->step_end_pending || atomic_load(&s->inflight[p]) != 0 || s->space_wait ||
	    (s->defer && !s->released[p]))
		return false;
	Aoq__StepEnded e = AOQ__STEP_ENDED__INIT;
	pthread_mutex_lock(&s->step_lock);
	e.step = s->ending_step;
	e.grad_sumsq = s->sumsq[p];
	e.nonfinite = s->nonfinite[p];
	e.tensors_updated = s->updated[p];
	e.skipped = s->skipped[p];
	e.clip_scale = s->defer ? s->clip_scale[p] : 1.0;
	s->sumsq[p] = 0;
	s->nonfinite[p] = false;
	s->updated[p] = 0;
	s->released[p] = false;
	s->skipped[p] = false;
	pthread_mutex_unlock(&s->step_lock);
	s->accepted[p] = 0;
	s->step_end_pending = false;
	pthread_mutex_lock(&s->stats_lock);
	s->steps_done++;
	pthread_mutex_unlock(&s->stats_lock);
	if (e.nonfinite)
		aoqd_info("session", "session %" PRIu64 ": step %" PRIu64 " had non-finite gradients", s->id, e.step);
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_STEP_ENDED;
	env.step_ended = &e;
	return aoqd_send(s, &env) == 0;
}

void aoqd_check_step_end(struct aoqd_session *s)
{
	if (atomic_load(&s->dead)) {
		if (s->state != AOQD_CLOSING)
			FAIL(s, BAD_RECORD, "the to-client ring's tail counter is corrupt");
		return;
	}
	aoqd_release_step(s);
	if (finish_step(s))
		aoqd_resume_reading(s); /* frames that waited behind StepEnd */
}

bool aoqd_on_step_end(struct aoqd_session *s, const Aoq__StepEnd *m)
{
	if (m->step != s->next_step) {
		FAIL(s, PROTOCOL, "StepEnd for step %" PRIu64 ", the current step is %" PRIu64, m->step, s->next_step);
		return false;
	}
	s->ending_step = m->step;
	s->step_end_pending = true;
	s->next_step++;
	/* Takes the step's records the ring still holds, then the next step's. */
	s->held = false;
	aoqd_drain(s);
	if (s->state != AOQD_READY)
		return false;
	aoqd_release_step(s);
	finish_step(s);
	return s->step_end_pending;
}

static void send_done(struct aoqd_session *s, uint64_t value)
{
	Aoq__Done d = AOQ__DONE__INIT;
	d.value = value;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_DONE;
	env.done = &d;
	aoqd_send(s, &env);
}

void aoqd_on_set_hyperparams(struct aoqd_session *s, const Aoq__SetHyperparams *m)
{
	char why[256];
	if (m->group >= s->ngroups)
		{ FAIL(s, INVALID, "SetHyperparams: group %u of %u", m->group, s->ngroups); return; }
	if (!hp_valid(m->hp, why, sizeof(why)))
		{ FAIL(s, INVALID, "SetHyperparams: %s", why); return; }
	if (m->step != s->next_step || s->accepted[s->next_step & 1] != 0)
		{ aoqd_reply_error(s, AOQ__ERROR_CODE__BUSY,
		                        "hyperparameters for step %" PRIu64 " cannot change now (current step %" PRIu64
		                        " has %s gradients)", m->step, s->next_step,
		                        s->accepted[s->next_step & 1] ? "received" : "no"); return; }
	struct aoqd_group *g = &s->groups[m->group];
	set_hp(g, g->kind, m->hp);
	send_done(s, 0);
}

/* ---- state transfer ---- */

static bool transfer_valid(struct aoqd_session *s, uint32_t tensor, int what, int dtype, uint64_t offset,
                           uint64_t count, bool load, uint8_t **data)
{
	if (atomic_load(&s->outstanding) != 0 || s->step_end_pending) {
		aoqd_reply_error(s, AOQ__ERROR_CODE__BUSY, "state transfer while updates are in flight");
		return false;
	}
	if (tensor >= s->ntensors || !dtype_valid(dtype) || what < 0 || what > AOQ__STATE_KIND__PARAM ||
	    (what == AOQ__STATE_KIND__PARAM && !load)) {
		FAIL(s, INVALID, "state transfer: tensor %u what %d dtype %d", tensor, what, dtype);
		return false;
	}
	const struct aoqd_tensor *t = &s->tensors[tensor];
	uint64_t bytes;
	if (count == 0 || !aoq_range_ok(offset, count, t->numel) ||
	    !aoq_mul_ok(count, aoqk_dtype_size((enum aoqk_dtype)dtype), &bytes) || bytes > s->xfer_bytes) {
		FAIL(s, INVALID, "state transfer: tensor %u elements %" PRIu64 "+%" PRIu64 " (at most %" PRIu64
		     " bytes per request)", tensor, offset, count, s->xfer_bytes);
		return false;
	}
	if (load && (what == AOQ__STATE_KIND__EXP_AVG || what == AOQ__STATE_KIND__EXP_AVG_SQ) &&
	    aoqk_precision_q8((enum aoqk_precision)s->precision) &&
	    (offset % AOQK_Q8_BLOCK || (count % AOQK_Q8_BLOCK && offset + count != t->numel))) {
		aoqd_reply_error(s, AOQ__ERROR_CODE__INVALID, "q8 moments load in whole blocks of %u elements",
		                 AOQK_Q8_BLOCK);
		return false;
	}
	*data = s->arena + s->xfer_off;
	return true;
}

/*
 * Transfers run on the worker pool in pieces, not on the loop thread: a
 * request converts up to 4 Mi elements, and a model's worth of them at
 * registration would hold every other session's traffic.  The reply waits,
 * like StepEnd's, and the connection reads nothing meanwhile.
 */
#define XFER_PIECE (1u << 16) /* elements per task; a multiple of the q8 block */

struct xfer_task {
	struct aoqd_task task;
	struct xfer *x;
	uint64_t begin, count;
};

struct xfer {
	struct aoqd_session *s;
	struct aoqd_tensor *t;
	bool load;
	int what;
	enum aoqk_dtype dtype;
	uint8_t *data;
	uint64_t offset;
	_Atomic uint32_t remaining;
	struct xfer_task tasks[];
};

/* Elements [e, e + n) of state `what` to or from fp32 buf; q8 pieces start
 * on a block and are whole blocks or end the tensor. */
static void state_io(struct aoqd_tensor *t, int what, bool load, float *buf, uint64_t e, size_t n)
{
	if (what == AOQ__STATE_KIND__MASTER || what == AOQ__STATE_KIND__PARAM) {
		if (aoqk_precision_bf16_master(t->st.precision)) {
			if (load)
				aoqd_from_f32((uint16_t *)t->st.master + e, AOQK_BF16, buf, n);
			else
				aoqd_to_f32(buf, (uint16_t *)t->st.master + e, AOQK_BF16, n);
		} else if (load) {
			memcpy((float *)t->st.master + e, buf, n * sizeof(float));
		} else {
			memcpy(buf, (float *)t->st.master + e, n * sizeof(float));
		}
		return;
	}
	bool second = what == AOQ__STATE_KIND__EXP_AVG_SQ;
	void *mom = second ? t->st.v : t->st.m;
	if (aoqk_precision_q8(t->st.precision)) {
		float *scale = second ? t->st.v_scale : t->st.m_scale;
		if (load)
			aoqd_q8_encode(mom, scale, buf, second, e, n);
		else
			aoqd_q8_decode(buf, mom, scale, second, e, n);
	} else if (aoqk_precision_bf16_moments(t->st.precision)) {
		if (load)
			aoqd_from_f32((uint16_t *)mom + e, AOQK_BF16, buf, n);
		else
			aoqd_to_f32(buf, (uint16_t *)mom + e, AOQK_BF16, n);
	} else if (load) {
		memcpy((float *)mom + e, buf, n * sizeof(float));
	} else {
		memcpy(buf, (float *)mom + e, n * sizeof(float));
	}
}

static void xfer_run(struct aoqd_task *task, unsigned worker)
{
	struct xfer_task *k = (struct xfer_task *)task;
	struct xfer *x = k->x;
	struct aoqd_session *s = x->s;
	size_t dsize = aoqk_dtype_size(x->dtype);
	float buf[4096];
	for (uint64_t i = 0; i < k->count && !atomic_load_explicit(&s->dead, memory_order_relaxed); i += 4096) {
		size_t n = k->count - i < 4096 ? k->count - i : 4096;
		uint8_t *d = x->data + (k->begin + i) * dsize;
		uint64_t e = x->offset + k->begin + i;
		if (x->load) {
			aoqd_to_f32(buf, d, x->dtype, n);
			state_io(x->t, x->what, true, buf, e, n);
		} else {
			state_io(x->t, x->what, false, buf, e, n);
			aoqd_from_f32(d, x->dtype, buf, n);
		}
	}
	if (atomic_fetch_sub_explicit(&x->remaining, 1, memory_order_acq_rel) == 1) {
		atomic_store(&s->xfer_done, true);
		uv_async_send(&s->srv->wake);
		free(x);
		aoqd_session_unref(s);
	}
}

static bool start_transfer(struct aoqd_session *s, bool load, uint32_t tensor, int what, int dtype,
                           uint64_t offset, uint64_t count)
{
	uint8_t *data;
	if (!transfer_valid(s, tensor, what, dtype, offset, count, load, &data))
		return false;
	uint32_t n = (uint32_t)((count + XFER_PIECE - 1) / XFER_PIECE);
	struct xfer *x = calloc(1, sizeof(*x) + (size_t)n * sizeof(struct xfer_task));
	if (!x) {
		aoqd_reply_error(s, AOQ__ERROR_CODE__NO_MEMORY, "out of memory");
		return false;
	}
	x->s = s;
	x->t = &s->tensors[tensor];
	x->load = load;
	x->what = what;
	x->dtype = (enum aoqk_dtype)dtype;
	x->data = data;
	x->offset = offset;
	atomic_init(&x->remaining, n);
	for (uint32_t i = 0; i < n; i++) {
		x->tasks[i].task.run = xfer_run;
		x->tasks[i].task.next = i + 1 < n ? &x->tasks[i + 1].task : NULL;
		x->tasks[i].x = x;
		x->tasks[i].begin = (uint64_t)i * XFER_PIECE;
		x->tasks[i].count = i + 1 < n ? XFER_PIECE : count - x->tasks[i].begin;
	}
	s->xfer_busy = true;
	s->xfer_count = count;
	atomic_store(&s->xfer_done, false);
	aoqd_session_ref(s);
	/* A transfer runs alone (no steps meanwhile): any key will do. */
	aoqd_pool_submit(s->srv->pool, &s->queue, (struct aoqd_key){ 0, 0 }, &x->tasks[0].task,
	                 &x->tasks[n - 1].task, n);
	return true;
}

bool aoqd_on_load_state(struct aoqd_session *s, const Aoq__LoadState *m)
{
	return start_transfer(s, true, m->tensor, m->what, m->dtype, m->offset, m->count);
}

bool aoqd_on_read_state(struct aoqd_session *s, const Aoq__ReadState *m)
{
	return start_transfer(s, false, m->tensor, m->what, m->dtype, m->offset, m->count);
}

/* Loop thread, after a wake: answers a finished transfer. */
void aoqd_check_transfer(struct aoqd_session *s)
{
	if (!s->xfer_busy || !atomic_load(&s->xfer_done))
		return;
	s->xfer_busy = false;
	send_done(s, s->xfer_count);
	aoqd_resume_reading(s);
}

void aoqd_on_tensor_steps(struct aoqd_session *s, const Aoq__TensorSteps *m)
{
	uint64_t n = m->set ? m->n_steps : m->count;
	if (!aoq_range_ok(m->first, n, s->ntensors) || n > 65536)
		{ FAIL(s, INVALID, "TensorSteps: tensors %u+%" PRIu64 " of %u", m->first, n, s->ntensors); return; }
	if (m->set && (atomic_load(&s->outstanding) != 0 || s->step_end_pending))
		{ aoqd_reply_error(s, AOQ__ERROR_CODE__BUSY, "TensorSteps while updates are in flight"); return; }
	uint64_t *steps = calloc(n ? n : 1, sizeof(uint64_t));
	if (!steps)
		{ aoqd_reply_error(s, AOQ__ERROR_CODE__NO_MEMORY, "out of memory"); return; }
	for (uint64_t i = 0; i < n; i++) {
		struct aoqd_tensor *t = &s->tensors[m->first + i];
		if (m->set) {
			t->steps = m->steps[i];
			t->cur_step = 0;
		}
		steps[i] = t->steps;
	}
	Aoq__TensorSteps r = AOQ__TENSOR_STEPS__INIT;
	r.first = m->first;
	r.n_steps = n;
	r.steps = steps;
	r.count = (uint32_t)n;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_TENSOR_STEPS;
	env.tensor_steps = &r;
	aoqd_send(s, &env);
	free(steps);
}
