/* SPDX-License-Identifier: MIT */
/*
 * Registration: groups and tensors, the Register frames, the arena and
 * masters mapped and checked against what was registered, the initial
 * values loaded (or a resumed session's parameters read back), the
 * progress thread started; hyperparameters set later.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "control.h"
#include "progress.h"
#include "transfer.h"

#define TENSORS_PER_FRAME 256

int aoq_add_group(struct aoq_client *c, const struct aoq_group *g)
{
	int r = aoqc_size_ok(g->size, sizeof(*g), "aoq_group");
	if (r < 0)
		return r;
	if (c->registered)
		return aoq_set_error(-EBUSY, "groups must be added before aoq_register()");
	if (g->kind != AOQ_ADAMW && g->kind != AOQ_ADAM && g->kind != AOQ_SGD && g->kind != AOQ_LION)
		return aoq_set_error(-EINVAL, "unknown optimizer kind %d", (int)g->kind);
	struct aoq_group *n = aoq_grow(c->groups, &c->cap_groups, c->ngroups + 1, sizeof(*n));
	if (!n)
		return -ENOMEM;
	c->groups = n;
	c->groups[c->ngroups] = *g;
	return (int)c->ngroups++;
}

int aoq_add_tensor(struct aoq_client *c, const struct aoq_tensor *t)
{
	int r = aoqc_size_ok(t->size, sizeof(*t), "aoq_tensor");
	if (r < 0)
		return r;
	if (c->registered)
		return aoq_set_error(-EBUSY, "tensors must be added before aoq_register()");
	if (t->numel == 0 || !dtype_ok(t->param_dtype) || !dtype_ok(t->grad_dtype) ||
	    (t->init && !dtype_ok(t->init_dtype)) || !t->param)
		return aoq_set_error(-EINVAL, "tensor '%s': needs numel > 0, known dtypes and a param buffer",
		                     t->name ? t->name : "");
	if (c->ntensors >= INT32_MAX)
		return -E2BIG;
	struct tensor *n = aoq_grow(c->tensors, &c->cap_tensors, c->ntensors + 1, sizeof(*n));
	if (!n)
		return -ENOMEM;
	c->tensors = n;
	struct tensor *x = &c->tensors[c->ntensors];
	memset(x, 0, sizeof(*x));
	x->d = *t;
	x->d.name = strdup(t->name ? t->name : "");
	if (!x->d.name)
		return -ENOMEM;
	x->gsize = t->grad_dtype == AOQ_FP32 ? 4 : 2;
	x->psize = t->param_dtype == AOQ_FP32 ? 4 : 2;
	return (int)c->ntensors++;
}

static Aoq__Hyperparams hp_of(const struct aoq_group *g)
{
	Aoq__Hyperparams h = AOQ__HYPERPARAMS__INIT;
	h.lr = g->lr;
	h.beta1 = g->beta1;
	h.beta2 = g->beta2;
	h.eps = g->eps;
	h.weight_decay = g->weight_decay;
	h.momentum = g->momentum;
	h.dampening = g->dampening;
	h.nesterov = g->nesterov;
	return h;
}

static Aoq__OptimizerKind kind_of(enum aoq_optimizer k)
{
	switch (k) {
	case AOQ_ADAM: return AOQ__OPTIMIZER_KIND__ADAM;
	case AOQ_SGD: return AOQ__OPTIMIZER_KIND__SGD;
	case AOQ_LION: return AOQ__OPTIMIZER_KIND__LION;
	case AOQ_ADAMW: return AOQ__OPTIMIZER_KIND__ADAMW;
	}
	return (Aoq__OptimizerKind)-1; /* checked by aoq_add_group() */
}

/* Sends the groups and tensors in frames of TENSORS_PER_FRAME. */
static int send_registration(struct aoq_client *c, int *fds, int *nfds, Aoq__Envelope **reply)
{
	Aoq__Hyperparams *hps = calloc(c->ngroups, sizeof(*hps));
	Aoq__Group *gs = calloc(c->ngroups, sizeof(*gs));
	Aoq__Group **gp = calloc(c->ngroups, sizeof(*gp));
	Aoq__TensorDesc *ts = calloc(TENSORS_PER_FRAME, sizeof(*ts));
	Aoq__TensorDesc *tp[TENSORS_PER_FRAME];
	int r = -ENOMEM;
	if (!hps || !gs || !gp || !ts)
		goto out;
	for (uint32_t i = 0; i < c->ngroups; i++) {
		hps[i] = hp_of(&c->groups[i]);
		aoq__group__init(&gs[i]);
		gs[i].kind = kind_of(c->groups[i].kind);
		gs[i].hp = &hps[i];
		gp[i] = &gs[i];
	}
	uint32_t next = 0;
	bool first = true;
	do {
		Aoq__Register reg = AOQ__REGISTER__INIT;
		if (first) {
			reg.n_groups = c->ngroups;
			reg.groups = gp;
			reg.precision = (Aoq__StatePrecision)c->o.precision;
			reg.window = c->o.window;
			reg.seed = c->o.seed;
			reg.max_grad_norm = c->o.max_grad_norm;
			reg.skip_nonfinite = c->o.skip_nonfinite;
			reg.delayed = c->o.delayed_update;
			reg.master_bits = c->o.master_bits;
		}
		size_t n = 0;
		while (n < TENSORS_PER_FRAME && next < c->ntensors) {
			struct tensor *x = &c->tensors[next++];
			aoq__tensor_desc__init(&ts[n]);
			ts[n].name = (char *)x->d.name;
			ts[n].numel = x->d.numel;
			ts[n].param_dtype = (Aoq__DType)x->d.param_dtype;
			ts[n].grad_dtype = (Aoq__DType)x->d.grad_dtype;
			ts[n].group = x->d.group;
			tp[n] = &ts[n];
			n++;
		}
		reg.n_tensors = n;
		reg.tensors = tp;
		reg.more = next < c->ntensors;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_REGISTER;
		env.register_ = &reg;
		if ((r = aoq_send_frame(c->sock, &env, NULL, 0)) < 0) {
			aoq_set_error(r, "aoqd: send: %s", strerror(-r));
			goto out;
		}
		if (reg.more)
			r = aoqc_ctl_recv(c, AOQ__ENVELOPE__MSG_REGISTER_MORE, NULL, NULL, NULL);
		else
			r = aoqc_ctl_recv(c, AOQ__ENVELOPE__MSG_REGISTERED, reply, fds, nfds);
		if (r < 0)
			goto out;
		first = false;
	} while (next < c->ntensors);
out:
	free(hps);
	free(gs);
	free(gp);
	free(ts);
	return r;
}

/* Checks the daemon's arena header against the mapping and our tensors. */
static int check_arena(struct aoq_client *c, const Aoq__Registered *reg)
{
	const struct aoq_arena_header *h = (const void *)c->arena;
	struct aoq_arena_header hd;
	memcpy(&hd, h, sizeof(hd));
	if (c->world) {
		/* A replica group: our lane's rings and transfer area. */
		if (reg->local_world != c->world)
			return -EPROTO;
		hd.to_daemon_off = reg->lane_to_daemon_off;
		hd.to_client_off = reg->lane_to_client_off;
		hd.xfer_off = reg->lane_xfer_off;
	}
	if (aoq_arena_header_check(&hd, c->arena_size) < 0 || hd.tensors != c->ntensors || hd.window != c->o.window)
		return -EPROTO;
	bool delayed = hd.flags & AOQ_ARENA_DELAYED;
	if (delayed != c->o.delayed_update || hd.masters_size != c->masters_size)
		return -EPROTO;
	const struct aoq_arena_tensor *tt = (const void *)(c->arena + hd.tensor_table_off);
	const struct aoq_arena_slot *sl = (const void *)(c->arena + hd.slot_table_off);
	for (uint32_t i = 0; i < c->ntensors; i++) {
		struct tensor *x = &c->tensors[i];
		struct aoq_arena_tensor te = tt[i];
		if (te.numel != x->d.numel || te.param_dtype != (uint32_t)x->d.param_dtype ||
		    te.grad_dtype != (uint32_t)x->d.grad_dtype || aoq_arena_master_check(&hd, &te) < 0)
			return -EPROTO;
		x->master_area = te.master_off == AOQ_NO_MASTER ? NULL : c->masters + te.master_off;
		if (hd.window)
			continue;
		struct aoq_arena_slot s = sl[i];
		uint64_t pbuf = delayed ? aoq_align_up(s.param_bytes, AOQ_ARENA_ALIGN) : 0;
		if (aoq_arena_slot_check(&hd, &s, x->d.numel * x->gsize, x->master_area ? 0 : x->d.numel * x->psize) < 0)
			return -EPROTO;
		aoq_slice(x->d.numel, c->world, c->o.local_rank, &x->sb, &x->se);
		x->grad_area = c->arena + s.grad_off;
		x->param_area = c->arena + s.param_off;
		x->param_buf = pbuf;
	}
	if (hd.window) {
		c->slots = calloc(hd.slots, sizeof(*c->slots));
		c->free_slots = calloc(hd.slots, sizeof(*c->free_slots));
		if (!c->slots || !c->free_slots)
			return -ENOMEM;
		for (uint32_t i = 0; i < hd.slots; i++) {
			struct aoq_arena_slot s = sl[i];
			if (aoq_arena_slot_check(&hd, &s, hd.slot_elems * 4, hd.slot_elems * 4) < 0)
				return -EPROTO;
			c->slots[i].grad_area = c->arena + s.grad_off;
			c->slots[i].param_area = c->arena + s.param_off;
			c->free_slots[c->nfree++] = hd.slots - 1 - i;
		}
	}
	c->hdr = hd;
	c->to_daemon = (struct aoq_ring_prod){ .ring = (void *)(c->arena + hd.to_daemon_off), .cap = hd.ring_capacity };
	c->to_client = (struct aoq_ring_cons){ .ring = (void *)(c->arena + hd.to_client_off), .cap = hd.ring_capacity };
	return 0;
}

int aoq_resumed(struct aoq_client *c, uint64_t *step)
{
	if (step)
		*step = c->resumed ? c->resumed_step : 0;
	return c->resumed ? 1 : 0;
}

/* The masters memfds (aoq-arena.h), mapped read-only end to end at
 * c->masters.  The daemon's own pages, which only it writes (read-only
 * descriptions of memfds of mode 0400).  0 or -EPROTO. */
static int map_masters(struct aoq_client *c, const int *fds, uint32_t n)
{
	uint64_t size = 0, pg = (uint64_t)sysconf(_SC_PAGESIZE);
	if (n > AOQ_MASTER_MEMFDS)
		return aoq_set_error(-EPROTO, "aoqd sent %u masters memfds, at most %d", n, AOQ_MASTER_MEMFDS);
	for (uint32_t k = 0; k < n; k++) {
		struct stat ms;
		if (fstat(fds[k], &ms) < 0 || ms.st_size <= 0 || (uint64_t)ms.st_size % pg ||
		    __builtin_add_overflow(size, (uint64_t)ms.st_size, &size) || size > SIZE_MAX)
			return aoq_set_error(-EPROTO, "masters memfd %u of %u: a size of whole pages expected", k + 1, n);
		c->masters_end[k] = size;
	}
	uint8_t *q = mmap(NULL, (size_t)size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (q == MAP_FAILED)
		return aoq_set_error(-errno, "cannot map the masters: %s", strerror(errno));
	for (uint32_t k = 0; k < n; k++) {
		uint64_t b = k ? c->masters_end[k - 1] : 0;
		if (mmap(q + b, (size_t)(c->masters_end[k] - b), PROT_READ, MAP_SHARED | MAP_FIXED, fds[k], 0) ==
		    MAP_FAILED) {
			int e = errno;
			munmap(q, (size_t)size);
			return aoq_set_error(-EPROTO, "cannot map masters memfd %u of %u: %s", k + 1, n, strerror(e));
		}
	}
	/* as aoqd's mappings of them: 2 MiB pages where the host's
	 * shmem_enabled allows (docs/operating.md, "Huge pages") */
	if (size >= (2u << 20))
		madvise(q, (size_t)size, MADV_HUGEPAGE);
	c->masters = q;
	c->masters_size = size;
	c->masters_n = n;
	return 0;
}

/* The masters pinned with the backend, a memfd at a time, each as soon as
 * the loads have written all of its masters, on a thread of their own so
 * that a pin overlaps the loads of the memfds after it.  Pins come after
 * the loads: by then aoqd has written every page, and pinning pages that
 * exist runs at 23-28 GB/s on the H200 host, where pinning a new memfd's
 * holes faults them in one by one at 2-2.6 GB/s (tests/bench/pin_bench.py;
 * RESULTS.md, "Pinning the masters after the load").  The loads go through
 * the arena, never through this mapping.  A resume's masters exist from
 * the start: all are pinned at once, while the resume copies the
 * parameters out of them (transfer.c). */
struct pinner {
	struct aoq_client *c;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	uint32_t ready; /* memfds whose masters are loaded; UINT32_MAX: give up */
	pthread_t tid;
};

static uint32_t memfd_of(const struct aoq_client *c, const uint8_t *master)
{
	uint64_t off = (uint64_t)(master - c->masters);
	uint32_t k = 0;
	while (k + 1 < c->masters_n && off >= c->masters_end[k])
		k++;
	return k;
}

static void pin_ready(struct pinner *p, uint32_t ready)
{
	pthread_mutex_lock(&p->lock);
	p->ready = ready;
	pthread_cond_signal(&p->cond);
	pthread_mutex_unlock(&p->lock);
}

static void *pin_main(void *arg)
{
	struct pinner *p = arg;
	struct aoq_client *c = p->c;
	for (uint32_t k = 0; k < c->masters_n; k++) {
		pthread_mutex_lock(&p->lock);
		while (p->ready <= k)
			pthread_cond_wait(&p->cond, &p->lock);
		bool give_up = p->ready == UINT32_MAX;
		pthread_mutex_unlock(&p->lock);
		if (give_up)
			return NULL;
		/* Unpinned, copies still work (slower): a warning, not an error. */
		uint64_t b = k ? c->masters_end[k - 1] : 0;
		if (c->ops->register_host_ro(c->be, c->masters + b, c->masters_end[k] - b) < 0) {
			fprintf(stderr, "aoq: warning: %s; parameters are copied from pageable memory\n", aoq_last_error());
			return NULL;
		}
		c->masters_pinned |= 1u << k;
	}
	return NULL;
}

int aoq_register(struct aoq_client *c)
{
	if (c->registered)
		return aoq_set_error(-EBUSY, "already registered");
	if (c->ntensors == 0 || c->ngroups == 0)
		return aoq_set_error(-EINVAL, "nothing to register: add groups and tensors first");
	for (uint32_t i = 0; i < c->ntensors; i++)
		if (c->tensors[i].d.group >= c->ngroups)
			return aoq_set_error(-EINVAL, "tensor '%s': no group %u", c->tensors[i].d.name, c->tensors[i].d.group);
	pthread_mutex_lock(&c->ctl_lock);
	int fds[AOQ_MAX_FDS], nfds = 0;
	Aoq__Envelope *rep = NULL;
	int r = send_registration(c, fds, &nfds, &rep);
	if (r < 0)
		goto out;
	if (nfds < 3 || rep->registered->fds != (uint32_t)nfds) {
		r = aoq_set_error(-EPROTO, "aoqd sent %d fds with the arena, expected %u (3 to %d)", nfds,
		                  rep->registered->fds, AOQ_MAX_FDS);
		goto out_fds;
	}
	struct stat st;
	c->resumed = rep->registered->resumed;
	c->resumed_step = rep->registered->resumed_step;
	c->arena_size = rep->registered->arena_size;
	c->o.seed = rep->registered->seed;
	if (fstat(fds[0], &st) < 0 || (uint64_t)st.st_size != c->arena_size || c->arena_size < sizeof(struct aoq_arena_header)) {
		r = aoq_set_error(-EPROTO, "the arena's size does not match");
		goto out_fds;
	}
	void *p = mmap(NULL, c->arena_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	if (p == MAP_FAILED) {
		r = aoq_set_error(-errno, "cannot map the arena: %s", strerror(errno));
		goto out_fds;
	}
	/* aoqd asks for huge pages on the arena too: mapped by 2 MiB where
	 * the host's shmem_enabled allows (advise), else a no-op */
	if (c->arena_size >= (2u << 20))
		madvise(p, c->arena_size, MADV_HUGEPAGE);
	if (nfds > 3 && (r = map_masters(c, fds + 3, (uint32_t)nfds - 3)) < 0) {
		munmap(p, c->arena_size);
		goto out_fds;
	}
	for (int k = 3; k < nfds; k++)
		close(fds[k]);
	close(fds[0]);
	c->arena = p;
	c->bell_out = fds[1];
	c->bell_in = fds[2];
	nfds = 0;
	if ((r = check_arena(c, rep->registered)) < 0) {
		uint32_t v = ((const struct aoq_arena_header *)(const void *)c->arena)->version;
		if (v != AOQ_ARENA_VERSION)
			aoq_set_error(r, "aoqd's arena is version %u, this libaoq reads version %u: use libaoq and aoqd of "
			              "the same release", v, AOQ_ARENA_VERSION);
		else
			aoq_set_error(r, "the arena's layout is inconsistent");
		goto out;
	}
	if ((r = c->ops->register_host(c->be, c->arena, c->arena_size)) < 0)
		goto out;
	c->registered = true;
	/* The masters are pinned as the loads finish each memfd (above). */
	struct pinner pn = { .c = c, .lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER };
	uint32_t last[AOQ_MASTER_MEMFDS] = { 0 }; /* memfd k's last tensor */
	for (uint32_t i = 0; i < c->ntensors; i++)
		if (c->tensors[i].master_area)
			last[memfd_of(c, c->tensors[i].master_area)] = i;
	bool pinning = c->masters && c->ops->register_host_ro;
	bool threaded = pinning && pthread_create(&pn.tid, NULL, pin_main, &pn) == 0;
	if (c->resumed)
		c->step = c->resumed_step + 1; /* the daemon's state is the truth: parameters come from it */
	/* A resume's masters are there already (it copies its parameters from
	 * them): all pinned at once, while it copies. */
	uint32_t pinned_from = c->resumed && threaded ? c->masters_n : 0;
	if (pinned_from)
		pin_ready(&pn, pinned_from);
	for (uint32_t i = 0, ready = pinned_from; i < c->ntensors && r == 0; i++) {
		r = c->resumed ? aoqc_load_resumed(c, i) : aoqc_load_initial(c, i);
		while (ready < c->masters_n && last[ready] <= i)
			ready++;
		pin_ready(&pn, r < 0 ? UINT32_MAX : ready);
	}
	if (threaded)
		pthread_join(pn.tid, NULL);
	else if (pinning && r == 0)
		pin_main(&pn); /* no thread: here, all loaded (pn.ready is every memfd) */
	if (r < 0)
		goto out;
	c->wake_fd = eventfd(0, EFD_CLOEXEC);
	if (c->wake_fd < 0) {
		r = -errno;
		goto out;
	}
	if ((r = -pthread_create(&c->progress, NULL, aoqc_progress_main, c)) < 0)
		goto out;
	c->progress_running = true;
	goto out;
out_fds:
	for (int i = 0; i < nfds; i++)
		close(fds[i]);
out:
	aoq_envelope_free(rep);
	pthread_mutex_unlock(&c->ctl_lock);
	return r;
}

uint64_t aoq_session_seed(struct aoq_client *c)
{
	return c->o.seed;
}

int aoq_set_hyperparams(struct aoq_client *c, uint32_t g, const struct aoq_group *hp)
{
	int r = aoqc_size_ok(hp->size, sizeof(*hp), "aoq_group");
	if (r < 0)
		return r;
	if (g >= c->ngroups)
		return aoq_set_error(-EINVAL, "no group %u", g);
	if (!c->registered) {
		c->groups[g] = *hp;
		return 0;
	}
	Aoq__Hyperparams h = hp_of(hp);
	Aoq__SetHyperparams m = AOQ__SET_HYPERPARAMS__INIT;
	m.group = g;
	m.hp = &h;
	pthread_mutex_lock(&c->ctl_lock);
	m.step = aoq_current_step(c);
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_SET_HYPERPARAMS;
	env.set_hyperparams = &m;
	r = aoqc_ctl_call(c, &env, AOQ__ENVELOPE__MSG_DONE, NULL);
	if (r == 0)
		c->groups[g] = *hp;
	pthread_mutex_unlock(&c->ctl_lock);
	return r;
}
