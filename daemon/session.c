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
#include <time.h>
#include <unistd.h>

#include "aoqd.h"
#include "convert.h"
#include "log.h"

#define FAIL(s, code, ...) aoqd_session_fail(s, AOQ__ERROR_CODE__##code, __VA_ARGS__)

/* Elements per Load/Read request: bounds the time one request holds the
 * loop thread (about 16 ms of conversion). */
#define MAX_TRANSFER_ELEMS (4u << 20)

struct chunk {
	struct aoqd_task task;
	struct job *job;
	uint64_t begin, count; /* within the record's range */
	struct aoqk_report rep;
};

struct job {
	struct aoqd_session *s;
	struct aoqd_tensor *t;
	struct aoq_rec rec;
	struct aoqk_hparams hp;
	bool accumulate;
	bool acc_first;  /* first micro-batch of the step: acc starts from zero */
	bool use_acc;
	const uint8_t *grad; /* element rec.offset */
	uint8_t *param;
	uint64_t seed;
	uint64_t t0;
	_Atomic uint32_t remaining;
	uint32_t nchunks;
	struct chunk chunks[];
};

static uint64_t thread_cpu_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void ring_doorbell(int fd)
{
	uint64_t one = 1;
	ssize_t r = write(fd, &one, sizeof(one));
	(void)r; /* EAGAIN: the counter is saturated, the peer is woken anyway */
}

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
	uint64_t master = n * (aoqk_precision_bf16_master(p) ? 2 : 4);
	uint64_t mom = n * (aoqk_precision_q8(p) ? 1 : 4);
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
	g->hp.lr = (float)h->lr;
	g->hp.beta1 = (float)h->beta1;
	g->hp.beta2 = (float)h->beta2;
	g->hp.eps = (float)h->eps;
	g->hp.weight_decay = (float)h->weight_decay;
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
		if (m->precision < 0 || m->precision > AOQ__STATE_PRECISION__STATE_BF16_Q8)
			{ FAIL(s, INVALID, "unknown state precision %d", (int)m->precision); return; }
		s->precision = m->precision;
		s->window = m->window;
		s->seed = m->seed ? m->seed : ((uint64_t)aoqd_now_ns() * 0x9e3779b97f4a7c15ull) ^ s->id;
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
	uint64_t cap = 2 * (uint64_t)(s->window ? s->nslots : s->ntensors);
	s->ring_cap = (uint32_t)(cap < 256 ? 256 : cap > 65536 ? 65536 : cap);
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
	struct aoq_arena_tensor *tt = (void *)(s->arena + tensor_table);
	for (uint32_t i = 0; i < s->ntensors; i++) {
		tt[i].numel = s->tensors[i].numel;
		tt[i].param_dtype = s->tensors[i].param_dtype;
		tt[i].grad_dtype = s->tensors[i].grad_dtype;
		tt[i].group = s->tensors[i].group;
		tt[i].slot = s->window ? UINT32_MAX : i;
	}
	memcpy(s->arena + slot_table, s->slots, (size_t)s->nslots * sizeof(*s->slots));
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

/* ---- the data plane ---- */

static void post_record(struct aoqd_session *s, const struct job *j, int32_t status)
{
	struct aoq_rec out = j->rec;
	out.flags = 0;
	out.status = status;
	pthread_mutex_lock(&s->ring_lock);
	int r = atomic_load(&s->dead) ? 0 : aoq_ring_push(&s->to_client, &out);
	pthread_mutex_unlock(&s->ring_lock);
	if (r == 1)
		ring_doorbell(s->doorbell_out);
	else if (r < 0) {
		/* Reserved space vanished: the client wrote its tail counter. */
		atomic_store(&s->dead, true);
		uv_async_send(&s->srv->wake);
	}
}

static void job_complete(struct job *j)
{
	struct aoqd_session *s = j->s;
	double sumsq = 0;
	bool nonfinite = false;
	for (uint32_t i = 0; i < j->nchunks; i++) {
		sumsq += j->chunks[i].rep.sumsq;
		nonfinite |= j->chunks[i].rep.nonfinite;
	}
	int32_t status = j->accumulate ? AOQ_REC_ACCUMULATED : AOQ_REC_UPDATED;
	post_record(s, j, status);
	uint64_t now = aoqd_now_ns();
	unsigned p = j->rec.step & 1;
	pthread_mutex_lock(&s->step_lock);
	s->sumsq[p] += sumsq;
	s->nonfinite[p] |= nonfinite;
	if (!j->accumulate)
		s->updated[p]++;
	pthread_mutex_unlock(&s->step_lock);
	pthread_mutex_lock(&s->stats_lock);
	s->bytes_in += j->rec.count * aoqk_dtype_size(j->t->grad_dtype);
	if (!j->accumulate)
		s->bytes_out += j->rec.count * aoqk_dtype_size(j->t->param_dtype);
	aoqd_hist_add(&s->rec_hist, now - j->t0);
	pthread_mutex_unlock(&s->stats_lock);
	atomic_fetch_sub(&s->outstanding, 1);
	if (atomic_fetch_sub(&s->inflight[p], 1) == 1)
		uv_async_send(&s->srv->wake);
	free(j);
	aoqd_session_unref(s);
}

static void chunk_run(struct aoqd_task *task, unsigned worker)
{
	struct chunk *c = (struct chunk *)task;
	struct job *j = c->job;
	struct aoqd_session *s = j->s;
	if (!atomic_load_explicit(&s->dead, memory_order_relaxed)) {
		const struct aoqk_kernel *k = s->srv->kernel;
		struct aoqd_tensor *t = j->t;
		uint64_t begin = j->rec.offset + c->begin;
		const uint8_t *grad = j->grad + c->begin * aoqk_dtype_size(t->grad_dtype);
		uint64_t c0 = thread_cpu_ns(), w0 = aoqd_now_ns();
		if (j->accumulate) {
			if (j->acc_first)
				memset(t->acc + begin, 0, c->count * sizeof(float));
			k->accumulate(t->acc + begin, grad, t->grad_dtype, 1.0f, c->count);
		} else {
			struct aoqk_chunk ch = {
				.begin = begin,
				.count = c->count,
				.grad = grad,
				.grad_dtype = t->grad_dtype,
				.acc = j->use_acc ? t->acc + begin : NULL,
				.param = j->param + c->begin * aoqk_dtype_size(t->param_dtype),
				.param_dtype = t->param_dtype,
				.seed = j->seed,
				.skip_nonfinite = false,
			};
			if (k->adam(&j->hp, &t->st, &ch, &c->rep) < 0)
				c->rep.nonfinite = true; /* validated before: cannot happen */
		}
		uint64_t c1 = thread_cpu_ns(), w1 = aoqd_now_ns();
		pthread_mutex_lock(&s->stats_lock);
		s->cpu_ns += c1 - c0;
		s->chunks++;
		aoqd_hist_add(&s->chunk_hist, w1 - w0);
		pthread_mutex_unlock(&s->stats_lock);
	}
	if (atomic_fetch_sub_explicit(&j->remaining, 1, memory_order_acq_rel) == 1)
		job_complete(j);
}

/* Elements per chunk: every worker gets a share of a large tensor, chunks
 * stay cache-sized, and a q8 block never straddles two chunks. */
static uint64_t chunk_elems(struct aoqd_session *s, uint64_t count)
{
	uint64_t w = aoqd_pool_threads(s->srv->pool);
	uint64_t c = aoq_align_up((count + w - 1) / w, AOQK_Q8_BLOCK);
	if (c < 16384)
		c = 16384;
	if (c > 262144)
		c = 262144;
	return c;
}

/* Validates one record; a message for the client when it is bad. */
static bool rec_valid(struct aoqd_session *s, const struct aoq_rec *r, char *why, size_t len)
{
	if (r->flags & ~AOQ_REC_FLAGS_KNOWN) {
		snprintf(why, len, "unknown flags 0x%x", r->flags);
		return false;
	}
	if (r->tensor >= s->ntensors) {
		snprintf(why, len, "tensor %u of %u", r->tensor, s->ntensors);
		return false;
	}
	const struct aoqd_tensor *t = &s->tensors[r->tensor];
	if (r->count == 0 || !aoq_range_ok(r->offset, r->count, t->numel)) {
		snprintf(why, len, "tensor %u: elements %" PRIu64 "+%" PRIu64 " outside 0..%" PRIu64,
		         r->tensor, r->offset, r->count, t->numel);
		return false;
	}
	if (s->window) {
		if (r->slot >= s->nslots || r->count > s->slot_elems) {
			snprintf(why, len, "slot %u (of %u) cannot hold %" PRIu64 " elements", r->slot, s->nslots, r->count);
			return false;
		}
	} else if (r->slot != r->tensor) {
		snprintf(why, len, "tensor %u: slot %u is not its own", r->tensor, r->slot);
		return false;
	}
	if (aoqk_precision_q8((enum aoqk_precision)s->precision) &&
	    (r->offset % AOQK_Q8_BLOCK || (r->count % AOQK_Q8_BLOCK && r->offset + r->count != t->numel))) {
		snprintf(why, len, "tensor %u: q8 state needs chunks on %u-element blocks", r->tensor, AOQK_Q8_BLOCK);
		return false;
	}
	/* The client posts every record of a step before its StepEnd, but the
	 * socket can overtake the ring: the ending step's records stay valid
	 * while its StepEnd is pending. */
	if (r->step != s->next_step && !(s->step_end_pending && r->step == s->ending_step)) {
		snprintf(why, len, "tensor %u: step %" PRIu64 ", the current step is %" PRIu64, r->tensor, r->step, s->next_step);
		return false;
	}
	return true;
}

/* Turns a valid record into a job of chunks for the pool.  False when the
 * session failed. */
static bool accept_record(struct aoqd_session *s, const struct aoq_rec *r)
{
	struct aoqd_tensor *t = &s->tensors[r->tensor];
	bool accumulate = r->flags & AOQ_REC_ACCUMULATE;
	bool acc_first = false, use_acc = false;
	if (accumulate) {
		if (!t->acc) {
			void *p = mmap(NULL, t->numel * sizeof(float), PROT_READ | PROT_WRITE,
			               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			if (p == MAP_FAILED) {
				FAIL(s, NO_MEMORY, "tensor %u: no memory for the gradient accumulator", r->tensor);
				return false;
			}
			t->acc = p;
			s->state_bytes += t->numel * sizeof(float);
		}
		if (t->acc_step != r->step) {
			t->acc_step = r->step;
			acc_first = true;
		}
	} else {
		use_acc = t->acc && t->acc_step == r->step;
		if (t->cur_step != r->step) {
			t->cur_step = r->step;
			t->steps++;
			t->done_elems = 0;
		}
		t->done_elems += r->count;
		if (t->done_elems > t->numel) {
			FAIL(s, BAD_RECORD, "tensor %u: more than one final gradient in step %" PRIu64, r->tensor, r->step);
			return false;
		}
	}
	uint64_t ce = chunk_elems(s, r->count);
	uint32_t n = (uint32_t)((r->count + ce - 1) / ce);
	struct job *j = calloc(1, sizeof(*j) + (size_t)n * sizeof(struct chunk));
	if (!j) {
		FAIL(s, NO_MEMORY, "out of memory");
		return false;
	}
	j->s = s;
	j->t = t;
	j->rec = *r;
	j->hp = s->groups[t->group].hp;
	j->hp.step = t->steps;
	j->accumulate = accumulate;
	j->acc_first = acc_first;
	j->use_acc = use_acc;
	const struct aoq_arena_slot *sl = &s->slots[s->window ? r->slot : r->tensor];
	uint64_t first = s->window ? 0 : r->offset;
	j->grad = s->arena + sl->grad_off + first * aoqk_dtype_size(t->grad_dtype);
	j->param = s->arena + sl->param_off + first * aoqk_dtype_size(t->param_dtype);
	j->seed = s->seed ^ (r->step * 0xd1b54a32d192ed03ull);
	j->t0 = aoqd_now_ns();
	j->nchunks = n;
	atomic_init(&j->remaining, n);
	for (uint32_t i = 0; i < n; i++) {
		struct chunk *c = &j->chunks[i];
		c->task.run = chunk_run;
		c->task.next = i + 1 < n ? &j->chunks[i + 1].task : NULL;
		c->job = j;
		c->begin = (uint64_t)i * ce;
		c->count = i + 1 < n ? ce : r->count - c->begin;
	}
	aoqd_session_ref(s);
	atomic_fetch_add(&s->outstanding, 1);
	atomic_fetch_add(&s->inflight[r->step & 1], 1);
	s->accepted[r->step & 1]++;
	aoqd_pool_submit(s->srv->pool, &s->queue, &j->chunks[0].task, &j->chunks[n - 1].task, n);
	return true;
}

/*
 * Takes records off the to-daemon ring while they are valid and there is
 * room for their answers.  Stops (without consuming) at a record of the next
 * step until StepEnd arrives, and when the answers could overflow the
 * to-client ring until the client frees space.
 */
void aoqd_drain(struct aoqd_session *s)
{
	char why[256];
	s->space_wait = false;
	while (s->state == AOQD_READY && !s->held) {
		struct aoq_rec rec;
		int r = aoq_ring_peek(&s->to_daemon, &rec);
		if (r < 0)
			{ FAIL(s, BAD_RECORD, "the to-daemon ring's head counter is corrupt"); return; }
		if (r == 0) {
			if (aoq_ring_idle(&s->to_daemon))
				return;
			continue;
		}
		if (rec.step == s->next_step + 1 && s->next_step + 1 > s->next_step) {
			s->held = true; /* until StepEnd(next_step) */
			return;
		}
		if (!rec_valid(s, &rec, why, sizeof(why)))
			{ FAIL(s, BAD_RECORD, "%s", why); return; }
		/* Every accepted record is answered: keep room for all of them. */
		pthread_mutex_lock(&s->ring_lock);
		int64_t space = aoq_ring_space(&s->to_client);
		bool room = space > (int64_t)atomic_load(&s->outstanding);
		if (space >= 0 && !room && aoq_ring_wait_space(&s->to_client, atomic_load(&s->outstanding) + 1))
			room = true;
		pthread_mutex_unlock(&s->ring_lock);
		if (space < 0)
			{ FAIL(s, BAD_RECORD, "the to-client ring's tail counter is corrupt"); return; }
		if (!room) {
			s->space_wait = true;
			return;
		}
		aoq_ring_pop(&s->to_daemon);
		if (aoq_ring_producer_waiting(&s->to_daemon))
			ring_doorbell(s->doorbell_out);
		if (!accept_record(s, &rec))
			return;
	}
}

/* ---- steps ---- */

/* Sends StepEnded for the ending step if its last job is done. */
static bool finish_step(struct aoqd_session *s)
{
	unsigned p = s->ending_step & 1;
	/* Not done while a record of the step may still wait in the ring. */
	if (!s->step_end_pending || atomic_load(&s->inflight[p]) != 0 || s->space_wait)
		return false;
	Aoq__StepEnded e = AOQ__STEP_ENDED__INIT;
	pthread_mutex_lock(&s->step_lock);
	e.step = s->ending_step;
	e.grad_sumsq = s->sumsq[p];
	e.nonfinite = s->nonfinite[p];
	e.tensors_updated = s->updated[p];
	s->sumsq[p] = 0;
	s->nonfinite[p] = false;
	s->updated[p] = 0;
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
	if (what != AOQ__STATE_KIND__MASTER && what != AOQ__STATE_KIND__PARAM &&
	    aoqk_precision_q8((enum aoqk_precision)s->precision)) {
		aoqd_reply_error(s, AOQ__ERROR_CODE__INVALID, "moments of q8 state cannot be transferred yet");
		return false;
	}
	*data = s->arena + s->xfer_off;
	return true;
}

void aoqd_on_load_state(struct aoqd_session *s, const Aoq__LoadState *m)
{
	uint8_t *data;
	if (!transfer_valid(s, m->tensor, m->what, m->dtype, m->offset, m->count, true, &data))
		return;
	struct aoqd_tensor *t = &s->tensors[m->tensor];
	float *tmp = malloc(m->count * sizeof(float));
	if (!tmp)
		{ aoqd_reply_error(s, AOQ__ERROR_CODE__NO_MEMORY, "out of memory"); return; }
	aoqd_to_f32(tmp, data, (enum aoqk_dtype)m->dtype, m->count);
	if (m->what == AOQ__STATE_KIND__MASTER || m->what == AOQ__STATE_KIND__PARAM) {
		if (aoqk_precision_bf16_master(t->st.precision))
			aoqd_from_f32((uint16_t *)t->st.master + m->offset, AOQK_BF16, tmp, m->count);
		else
			memcpy((float *)t->st.master + m->offset, tmp, m->count * sizeof(float));
	} else {
		float *dst = m->what == AOQ__STATE_KIND__EXP_AVG ? t->st.m : t->st.v;
		memcpy(dst + m->offset, tmp, m->count * sizeof(float));
	}
	free(tmp);
	send_done(s, m->count);
}

void aoqd_on_read_state(struct aoqd_session *s, const Aoq__ReadState *m)
{
	uint8_t *data;
	if (!transfer_valid(s, m->tensor, m->what, m->dtype, m->offset, m->count, false, &data))
		return;
	struct aoqd_tensor *t = &s->tensors[m->tensor];
	float *tmp = malloc(m->count * sizeof(float));
	if (!tmp)
		{ aoqd_reply_error(s, AOQ__ERROR_CODE__NO_MEMORY, "out of memory"); return; }
	if (m->what == AOQ__STATE_KIND__MASTER) {
		if (aoqk_precision_bf16_master(t->st.precision))
			aoqd_to_f32(tmp, (uint16_t *)t->st.master + m->offset, AOQK_BF16, m->count);
		else
			memcpy(tmp, (float *)t->st.master + m->offset, m->count * sizeof(float));
	} else {
		const float *src = m->what == AOQ__STATE_KIND__EXP_AVG ? t->st.m : t->st.v;
		memcpy(tmp, src + m->offset, m->count * sizeof(float));
	}
	aoqd_from_f32(data, (enum aoqk_dtype)m->dtype, tmp, m->count);
	free(tmp);
	send_done(s, m->count);
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
