/* SPDX-License-Identifier: MIT */
/*
 * Registration: Register frames (one, or several with `more`) describe the
 * groups and tensors; the last one allocates the optimizer state, builds
 * the arena and sends it with both doorbells.  SetHyperparams changes a
 * group's hyperparameters between steps.  Loop thread.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "fdstore.h"
#include "log.h"
#include "pool.h"
#include "populate.h"
#include "register.h"
#include "server.h"
#include "session.h"
#include "state.h"
#include "wire.h"

static int cfg_lock(const struct aoqd_session *s)
{
	return s->srv->cfg.lock_memory;
}

/* The first Register frame's session-wide options. */
static int set_options(struct aoqd_session *s, const Aoq__Register *m, struct aoqd_error *err)
{
	struct aoqd_state *st = &s->st;
	if (m->precision < 0 || m->precision > AOQ__STATE_PRECISION__STATE_BF16_Q4)
		return AOQD_FAIL(err, INVALID, "unknown state precision %d", (int)m->precision);
	st->precision = m->precision;
	st->window = m->window;
	st->seed = m->seed ? m->seed : ((uint64_t)aoqd_now_ns() * 0x9e3779b97f4a7c15ull) ^ s->id;
	if (!isfinite(m->max_grad_norm) || m->max_grad_norm < 0)
		return AOQD_FAIL(err, INVALID, "max_grad_norm %g", m->max_grad_norm);
	if (m->delayed && m->window)
		return AOQD_FAIL(err, INVALID, "the delayed update needs a slot per tensor (no window)");
	if (s->local_world > 1 && (m->window || m->delayed))
		return AOQD_FAIL(err, INVALID, "a replica group (local_world %u) needs a slot per tensor and no delayed "
		                 "update (window 0, delayed off)", s->local_world);
	st->max_grad_norm = m->max_grad_norm;
	st->skip_nonfinite = m->skip_nonfinite;
	st->defer = m->max_grad_norm > 0 || m->skip_nonfinite;
	st->delayed = m->delayed;
	if (m->master_bits != 0 && m->master_bits != 24 && m->master_bits != 32)
		return AOQD_FAIL(err, INVALID, "master_bits %u: 0 or 32 (an fp32 master) or 24 (the 24-bit master)",
		                 m->master_bits);
	/* only q8 and q4 with an fp32 master split it: elsewhere the master
	 * stays as the precision says, and the session carries no flag that
	 * a resume or a replica would have to match */
	st->master24 = m->master_bits == 24 && (m->precision == AOQ__STATE_PRECISION__STATE_Q8 ||
	                                        m->precision == AOQ__STATE_PRECISION__STATE_Q4);
	st->options_set = true;
	return 0;
}

/* Appends the frame's groups and tensors. */
static int add_tensors(struct aoqd_session *s, const Aoq__Register *m, struct aoqd_error *err)
{
	const struct aoqd_config *cfg = &s->srv->cfg;
	struct aoqd_state *st = &s->st;
	char why[256];
	if (m->n_groups > 65536 - st->ngroups)
		return AOQD_FAIL(err, INVALID, "too many groups");
	if (m->n_tensors > cfg->max_tensors - st->ntensors)
		return AOQD_FAIL(err, INVALID, "more than %u tensors", cfg->max_tensors);
	/* A frame's tensors are handled in one turn of the loop: a few ms. */
	if (m->n_tensors > AOQD_MAX_TENSORS_PER_FRAME || m->n_groups > AOQD_MAX_TENSORS_PER_FRAME)
		return AOQD_FAIL(err, INVALID, "%zu tensors and %zu groups in one Register frame (at most %u each; send "
		                 "more frames)", m->n_tensors, m->n_groups, AOQD_MAX_TENSORS_PER_FRAME);
	/* The tables and names this frame adds, charged before they are
	 * built (an unfinished registration holds them too). */
	uint32_t ng = aoq_grow_cap(st->cap_groups, st->ngroups + (uint32_t)m->n_groups);
	uint32_t nt = aoq_grow_cap(st->cap_tensors, st->ntensors + (uint32_t)m->n_tensors);
	uint64_t bytes = (uint64_t)(ng - st->cap_groups) * sizeof(struct aoqd_group) +
	                 (uint64_t)(nt - st->cap_tensors) * sizeof(struct aoqd_tensor);
	for (size_t i = 0; i < m->n_tensors; i++)
		bytes += strlen(m->tensors[i]->name) + 1 + 16; /* and malloc's header */
	if (aoqd_state_charge(st, bytes) < 0)
		return AOQD_FAIL(err, QUOTA, "uid %u: the registration's tables (%" PRIu64 " bytes more) would pass its quota "
		                 "of %" PRIu64 " bytes", (unsigned)s->conn.uid, bytes, aoqd_state_quota(st));
	if (m->n_groups) {
		struct aoqd_group *g = aoq_grow(st->groups, &st->cap_groups, st->ngroups + (uint32_t)m->n_groups,
		                                 sizeof(*g));
		if (!g)
			return AOQD_FAIL(err, NO_MEMORY, "out of memory");
		st->groups = g;
	}
	for (size_t i = 0; i < m->n_groups; i++) {
		const Aoq__Group *mg = m->groups[i];
		if (!aoqd_kind_valid(mg->kind))
			return AOQD_FAIL(err, INVALID, "group %u: unknown optimizer %d", st->ngroups, (int)mg->kind);
		if (!aoqd_kind_precision_ok(mg->kind, st->precision))
			return AOQD_FAIL(err, INVALID, "group %u: %s does not run in state precision %s (q8 and q4 moments are "
			                 "Adam's; use STATE_FP32, STATE_BF16 or STATE_BF16_ALL)", st->ngroups,
			                 protobuf_c_enum_descriptor_get_value(&aoq__optimizer_kind__descriptor, mg->kind)->name,
			                 protobuf_c_enum_descriptor_get_value(&aoq__state_precision__descriptor,
			                                                      st->precision)->name);
		if (!aoqd_hp_valid(mg->kind, mg->hp, why, sizeof(why)))
			return AOQD_FAIL(err, INVALID, "group %u: %s", st->ngroups, why);
		struct aoqd_group *g = &st->groups[st->ngroups++];
		aoqd_group_set(g, mg->kind, mg->hp);
		g->moments = aoqd_group_moments(g);
	}
	if (m->n_tensors) {
		struct aoqd_tensor *t = aoq_grow(st->tensors, &st->cap_tensors, st->ntensors + (uint32_t)m->n_tensors,
		                                  sizeof(*t));
		if (!t)
			return AOQD_FAIL(err, NO_MEMORY, "out of memory");
		st->tensors = t;
	}
	for (size_t i = 0; i < m->n_tensors; i++) {
		const Aoq__TensorDesc *d = m->tensors[i];
		if (strlen(d->name) > 1024)
			return AOQD_FAIL(err, INVALID, "tensor %u: name too long", st->ntensors);
		if (d->numel == 0 || d->numel > cfg->max_tensor_elems)
			return AOQD_FAIL(err, INVALID, "tensor %u: %" PRIu64 " elements (1 to %" PRIu64 ")",
			                 st->ntensors, d->numel, cfg->max_tensor_elems);
		if (!aoqd_dtype_valid(d->param_dtype) || !aoqd_dtype_valid(d->grad_dtype))
			return AOQD_FAIL(err, INVALID, "tensor %u: unknown dtype", st->ntensors);
		struct aoqd_tensor *x = &st->tensors[st->ntensors];
		x->name = strdup(d->name);
		if (!x->name)
			return AOQD_FAIL(err, NO_MEMORY, "out of memory");
		x->numel = d->numel;
		x->param_dtype = (enum aoqk_dtype)d->param_dtype;
		x->grad_dtype = (enum aoqk_dtype)d->grad_dtype;
		x->group = d->group;
		st->parameters += d->numel;
		st->ntensors++; /* counted now so that aoqd_state_free frees the name */
	}
	return 0;
}

/* The last frame: the tables checked, the state charged to the uid's
 * quota (not yet mapped: alloc_state). */
static int charge_state(struct aoqd_session *s, struct aoqd_error *err)
{
	const struct aoqd_config *cfg = &s->srv->cfg;
	struct aoqd_state *st = &s->st;
	if (st->ntensors == 0 || st->ngroups == 0)
		return AOQD_FAIL(err, INVALID, "registration without tensors or groups");
	for (uint32_t i = 0; i < st->ntensors; i++)
		if (st->tensors[i].group >= st->ngroups)
			return AOQD_FAIL(err, INVALID, "tensor %u: group %u of %u", i, st->tensors[i].group, st->ngroups);
	uint64_t total = 0, mapped = 0;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		uint64_t off[AOQD_STATE_ARRAYS];
		uint64_t len = aoqd_state_tensor_len(st, &st->tensors[i], off);
		/* the undo copy of a session that may be leased, on its own
		 * pages (statemem.c, aoqd_state_alloc) */
		uint64_t pages = st->undo ? 2 * aoqd_page_round(len) : aoqd_page_round(len);
		if (st->undo)
			len *= 2;
		if (__builtin_add_overflow(total, len, &total) || __builtin_add_overflow(mapped, pages, &mapped))
			return AOQD_FAIL(err, NO_MEMORY, "state too large");
	}
	/* One mapping per tensor: what is locked is whole pages. */
	if (aoqd_state_charge(st, mapped) < 0)
		return AOQD_FAIL(err, QUOTA, "uid %u: %" PRIu64 " bytes of state (%" PRIu64 " in whole pages) would pass its "
		                 "quota of %" PRIu64 " bytes%s: raise max_state_bytes_per_uid in aoqd's config (a size, a share "
		                 "of memory such as 90%%, or 0: no limit)", (unsigned)s->conn.uid, total, mapped,
		                 aoqd_state_quota(st), st->quota == AOQD_QUOTA_AUTO ? " (auto: its share of "
		                 "the memory the other uids leave)" : "");
	st->state_bytes = total;
	/* A new state holds no parameters until the trainer loads them: it
	 * is not leased before its first step ends (a trainer killed between
	 * Registered and its first LoadState would leave zeros to resume). */
	st->dirty = true;
	(void)cfg;
	return 0;
}

static int alloc_failed(int r, int lock_memory, uint64_t failed_len, struct aoqd_error *err)
{
	return AOQD_FAIL(err, NO_MEMORY, "cannot %s %" PRIu64 " bytes of optimizer state: %s%s",
	                 r == -ENOMEM || r == -EAGAIN || r == -EPERM ? "lock" : "allocate", failed_len, strerror(-r),
	                 lock_memory == 2 ? " (raise LimitMEMLOCK or give CAP_IPC_LOCK)" : "");
}

/* The charged state, mapped. */
static int make_state(struct aoqd_session *s, struct aoqd_error *err)
{
	int r = charge_state(s, err);
	if (r < 0)
		return r;
	uint64_t failed_len = 0;
	int lock = s->srv->cfg.lock_memory;
	r = aoqd_state_alloc(&s->st, lock, &s->srv->locked_bytes, &failed_len);
	return r < 0 ? alloc_failed(r, lock, failed_len, err) : 0;
}

/*
 * A registration of more tensors than this maps its state and builds its
 * arena on a thread of its own, not the loop: at 100,000 tensors that is
 * some 200 ms during which the loop would serve no other session
 * (bench-regstall).  Not on the pool either: one worker busy that long
 * would hold the sessions queued behind it.  The Register reply waits (the
 * connection reads nothing meanwhile); the wake that follows the build
 * finishes it (aoqd_register_built).
 */
#define BUILD_OFF_LOOP_TENSORS AOQD_MAX_TENSORS_PER_FRAME

struct build {
	struct aoqd_session *s;  /* a reference */
	bool alloc;              /* a new state (not a resumed one) */
	int lock_memory;         /* the settings when it began */
	uint64_t max_arena_bytes;
};

/* The build's thread: nothing of the session but its state and arena,
 * which the loop leaves alone while s->building. */
static void *build_run(void *arg)
{
	struct build *b = arg;
	struct aoqd_session *s = b->s;
	int r = 0;
	s->build_alloc_failed = false;
	if (b->alloc && (r = aoqd_state_alloc(&s->st, b->lock_memory, &s->srv->locked_bytes, &s->build_failed_len)) < 0)
		s->build_alloc_failed = true;
	else if (b->alloc || s->st.memfd)
		aoqd_populate_start(s); /* its workers fault in while the arena is built */
	if (r == 0)
		r = aoqd_arena_build(&s->arena, &s->st, s->id, b->max_arena_bytes);
	s->build_r = r;
	s->build_lock = b->lock_memory;
	free(b);
	atomic_store_explicit(&s->build_done, true, memory_order_release);
	uv_async_send(&s->srv->wake);
	s->steps.ops->release(s);
	return NULL;
}

/* The arena's pages charged to st; a resume charged them before it took
 * the leased state over (s->arena_charged, lease.c). */
static int charge_arena(struct aoqd_session *s, struct aoqd_state *st, uint64_t size)
{
	s->arena.account = st->account; /* held after the session, if the client keeps it */
	uint64_t pages = aoqd_page_round(size), pre = s->arena_charged;
	s->arena_charged = 0;
	if (pre == pages)
		return 0;
	if (pre) {
		if (st->account)
			aoqd_account_uncharge(st->account, pre);
		st->charged -= pre;
	}
	return aoqd_state_charge(st, pages);
}

int aoqd_register(struct aoqd_session *s, const Aoq__Register *m, uv_poll_cb on_doorbell, aoqd_adopt_fn adopt,
                  struct aoqd_error *err)
{
	struct aoqd_state *st = &s->st;
	int r;
	if (!st->options_set && (r = set_options(s, m, err)) < 0)
		return r;
	if ((r = add_tensors(s, m, err)) < 0)
		return r;
	if (m->more) {
		Aoq__RegisterMore rm = AOQ__REGISTER_MORE__INIT;
		rm.tensors_so_far = st->ntensors;
		Aoq__Envelope reply = AOQ__ENVELOPE__INIT;
		reply.msg_case = AOQ__ENVELOPE__MSG_REGISTER_MORE;
		reply.register_more = &rm;
		aoqd_conn_send(&s->conn, &reply);
		return AOQD_REPLIED;
	}
	return aoqd_register_finish(s, on_doorbell, adopt, err);
}

static int arena_made(struct aoqd_session *s, uv_poll_cb on_doorbell, int r, struct aoqd_error *err);

int aoqd_register_finish(struct aoqd_session *s, uv_poll_cb on_doorbell, aoqd_adopt_fn adopt, struct aoqd_error *err)
{
	struct aoqd_state *st = &s->st;
	/* A leased state of the same key and layout, or a new one. */
	int r = adopt(s, err);
	if (r < 0 || r > 1)
		return r; /* > 1: the adopter's own answer (it waits) */
	bool fresh = r == 0;
	if (fresh && (r = charge_state(s, err)) < 0)
		return r;
	struct build *b = st->ntensors > BUILD_OFF_LOOP_TENSORS ? calloc(1, sizeof(*b)) : NULL;
	if (b) {
		b->s = s;
		b->alloc = fresh;
		b->lock_memory = s->srv->cfg.lock_memory;
		b->max_arena_bytes = s->srv->cfg.max_arena_bytes;
		s->building = true;
		atomic_store(&s->build_done, false);
		s->steps.ops->hold(s);
		if (aoqd_thread_detached(build_run, b) == 0)
			return AOQD_BUILDING;
		/* no thread: built here, as a small one */
		s->building = false;
		s->steps.ops->release(s);
		free(b);
	}
	if (fresh) {
		uint64_t failed_len = 0;
		int lock = s->srv->cfg.lock_memory;
		if ((r = aoqd_state_alloc(st, lock, &s->srv->locked_bytes, &failed_len)) < 0)
			return alloc_failed(r, lock, failed_len, err);
		aoqd_populate_start(s);
	} else if (st->memfd) {
		aoqd_populate_start(s); /* a resumed state's undo room (populate.c) */
	}
	r = aoqd_arena_build(&s->arena, st, s->id, s->srv->cfg.max_arena_bytes);
	return arena_made(s, on_doorbell, r, err);
}

int aoqd_register_built(struct aoqd_session *s, uv_poll_cb on_doorbell, struct aoqd_error *err)
{
	s->building = false;
	if (s->build_alloc_failed)
		return alloc_failed(s->build_r, s->build_lock, s->build_failed_len, err);
	return arena_made(s, on_doorbell, s->build_r, err);
}

/* The arena built (r: its result): charged, locked, watched, sent. */
/* Registered's fds: the arena, its doorbells, then read-only descriptions
 * of the masters memfds (closed by registered_fds_close once sent).  0 or
 * -errno. */
static int registered_fds(int fds[AOQ_MAX_FDS], const struct aoqd_arena *a, const struct aoqd_state *st)
{
	fds[0] = a->fd;
	fds[1] = a->peer_in;
	fds[2] = a->peer_out;
	for (uint32_t k = 0; k < st->masters_n; k++) {
		fds[3 + k] = aoqd_state_masters_reopen(st, k);
		if (fds[3 + k] < 0) {
			int e = fds[3 + k];
			while (k-- > 0)
				close(fds[3 + k]);
			return e;
		}
	}
	return 0;
}

static void registered_fds_close(int fds[AOQ_MAX_FDS], const struct aoqd_state *st)
{
	for (uint32_t k = 0; k < st->masters_n; k++)
		close(fds[3 + k]);
}

static int arena_made(struct aoqd_session *s, uv_poll_cb on_doorbell, int r, struct aoqd_error *err)
{
	struct aoqd_state *st = &s->st;
	/* The memfd's pages are taken as the client fills it: charged now. */
	if (r == 0 && charge_arena(s, st, s->arena.size) < 0)
		return AOQD_FAIL(err, QUOTA, "uid %u: the arena (%" PRIu64 " bytes) would pass its quota of %" PRIu64
		                 " bytes", (unsigned)s->conn.uid, s->arena.size, aoqd_state_quota(st));
	if (r == 0 && cfg_lock(s) && (r = aoqd_arena_lock(&s->arena, &s->srv->locked_bytes)) < 0) {
		static bool warned;
		if (cfg_lock(s) == 2)
			return AOQD_FAIL(err, NO_MEMORY, "cannot lock the arena (%" PRIu64 " bytes) in memory: %s (lock_memory "
			                 "= yes; raise LimitMEMLOCK or give CAP_IPC_LOCK)", s->arena.size, strerror(-r));
		if (!warned)
			aoqd_warn("session", "session %" PRIu64 ": cannot lock its arena (%" PRIu64 " bytes) in memory (%s): "
			          "running unlocked; raise LimitMEMLOCK (ulimit -l) or give CAP_IPC_LOCK (logged once)",
			          s->id, s->arena.size, strerror(-r));
		warned = true;
		r = 0;
	}
	if (r == 0)
		r = aoqd_arena_watch(&s->arena, s->srv->loop, on_doorbell, s);
	if (r < 0)
		return AOQD_FAIL(err, NO_MEMORY, "cannot create the arena: %s", strerror(-r));
	aoqd_populate_arena(s);
	Aoq__Registered reg = AOQ__REGISTERED__INIT;
	reg.arena_size = s->arena.size;
	reg.tensors = st->ntensors;
	reg.state_bytes = st->state_bytes;
	reg.fds = 3 + st->masters_n;
	reg.seed = st->seed;
	reg.resumed = s->resumed_from != 0;
	reg.resumed_step = s->resumed_from ? st->last_step : 0;
	reg.resumed_from = s->resumed_from;
	Aoq__Envelope reply = AOQ__ENVELOPE__INIT;
	reply.msg_case = AOQ__ENVELOPE__MSG_REGISTERED;
	reply.registered = &reg;
	int fds[AOQ_MAX_FDS];
	if ((r = registered_fds(fds, &s->arena, st)) < 0)
		return AOQD_FAIL(err, INTERNAL, "cannot open the masters for the client: %s", strerror(-r));
	r = aoqd_conn_send_with_fds(&s->conn, &reply, fds, (int)reg.fds);
	registered_fds_close(fds, st);
	aoqd_arena_sent(&s->arena);
	if (r < 0 && s->resumed_from && (r == -EPIPE || r == -ECONNRESET)) {
		/* The trainer died while resuming: it went away like any other
		 * (its closed socket ends the session next), so the state it
		 * took over is leased again instead of lost. */
		s->state = AOQD_READY;
		s->registered = true;
		aoqd_info("session", "session %" PRIu64 ": the trainer went away while resuming at step %" PRIu64, s->id,
		          st->last_step + 1);
		return AOQD_REPLIED;
	}
	if (r < 0)
		return AOQD_FAIL(err, INTERNAL, "cannot send the arena: %s", strerror(-r));
	aoqd_fdstore_describe(s); /* a killed aoqd's state can come back (fdstore.h) */
	s->state = AOQD_READY;
	s->registered = true;
	aoqd_info("session", "session %" PRIu64 ": registered %u tensors in %u groups, %" PRIu64
	          " bytes of state (%s%s), arena %" PRIu64 " bytes, masters shared %" PRIu64 " bytes in %u memfds",
	          s->id, st->ntensors, st->ngroups, st->state_bytes,
	          protobuf_c_enum_descriptor_get_value(&aoq__state_precision__descriptor, st->precision)->name,
	          st->master24 ? ", 24-bit split masters" : "", s->arena.size, st->masters_size, st->masters_n);
	return AOQD_REPLIED;
}

/* ---- replica groups (docs/design.md, "Replica groups") ---- */

int aoqd_register_hub(struct aoqd_session *hub, struct aoqd_session *s, bool resumed, struct aoqd_error *err)
{
	int r = 0;
	if (!resumed) {
		/* The first member's tables become the group's (charged to the
		 * same uid: the charge moves with them). */
		struct aoqd_account *acc = s->st.account;
		uint64_t quota = s->st.quota;
		hub->st = s->st;
		memset(&s->st, 0, sizeof(s->st));
		s->st.account = acc;
		s->st.quota = quota;
		if ((r = make_state(hub, err)) < 0)
			return r;
	}
	r = aoqd_arena_build_lanes(&hub->arena, &hub->st, hub->id, hub->srv->cfg.max_arena_bytes, hub->rep->world);
	if (r == 0 && charge_arena(hub, &hub->st, hub->arena.size) < 0)
		return AOQD_FAIL(err, QUOTA, "uid %u: the replica group's arena (%" PRIu64 " bytes) would pass its quota of %"
		                 PRIu64 " bytes", (unsigned)hub->conn.uid, hub->arena.size, aoqd_state_quota(&hub->st));
	if (r == 0 && cfg_lock(s) && aoqd_arena_lock(&hub->arena, &hub->srv->locked_bytes) < 0 && cfg_lock(s) == 2)
		return AOQD_FAIL(err, NO_MEMORY, "cannot lock the replica group's arena (%" PRIu64 " bytes) in memory "
		                 "(lock_memory = yes; raise LimitMEMLOCK or give CAP_IPC_LOCK)", hub->arena.size);
	if (r < 0)
		return AOQD_FAIL(err, NO_MEMORY, "cannot create the replica group's arena: %s", strerror(-r));
	if (!resumed)
		aoqd_populate_start(hub); /* here: a failed group's state goes at once (replica.c) */
	aoqd_fdstore_describe(hub); /* a killed aoqd's group can come back (fdstore.h) */
	aoqd_info("session", "replica group %" PRIu64 " (uid %u job '%s', %u local ranks): %u tensors in %u groups, %"
	          PRIu64 " bytes of state (%s%s), arena %" PRIu64 " bytes, masters shared %" PRIu64 " bytes", hub->id,
	          (unsigned)hub->conn.uid, hub->conn.job, hub->rep->world, hub->st.ntensors, hub->st.ngroups,
	          hub->st.state_bytes,
	          protobuf_c_enum_descriptor_get_value(&aoq__state_precision__descriptor, hub->st.precision)->name,
	          hub->st.master24 ? ", 24-bit split masters" : "", hub->arena.size, hub->st.masters_size);
	return 0;
}

int aoqd_register_same(struct aoqd_session *s, const struct aoqd_session *hub, struct aoqd_error *err)
{
	const struct aoqd_state *a = &s->st, *b = &hub->st;
	char why[512];
	const char *opt = a->max_grad_norm != b->max_grad_norm ? "max_grad_norm"
	                  : a->skip_nonfinite != b->skip_nonfinite ? "skip_nonfinite" : NULL;
	if (opt)
		return AOQD_FAIL(err, INVALID, "local rank %u cannot join the replica group of job '%s': %s differs from the "
		                 "group's", s->local_rank, s->conn.job, opt);
	if (aoqd_state_same_layout(a, b, why, sizeof(why)) < 0) {
		/* state.c words the other side as "the leased session" */
		char *p = strstr(why, "the leased session");
		if (p)
			snprintf(p, sizeof(why) - (size_t)(p - why), "the group");
		return AOQD_FAIL(err, INVALID, "local rank %u cannot join the replica group of job '%s': the layout differs "
		                 "from the group's: %s", s->local_rank, s->conn.job, why);
	}
	/* Its tables are not needed: the group's are the same. */
	struct aoqd_account *acc = s->st.account;
	uint64_t quota = s->st.quota;
	aoqd_state_free(&s->st, &s->srv->locked_bytes);
	memset(&s->st, 0, sizeof(s->st));
	s->st.account = acc;
	s->st.quota = quota;
	return 0;
}

int aoqd_register_member(struct aoqd_session *s, struct aoqd_session *hub, uv_poll_cb on_doorbell,
                         struct aoqd_error *err)
{
	int r = aoqd_arena_join(&s->arena, &hub->arena, s->local_rank);
	if (r == 0)
		r = aoqd_arena_watch(&s->arena, s->srv->loop, on_doorbell, s);
	if (r < 0)
		return AOQD_FAIL(err, NO_MEMORY, "cannot map the replica group's arena: %s", strerror(-r));
	Aoq__Registered reg = AOQ__REGISTERED__INIT;
	reg.arena_size = s->arena.size;
	reg.tensors = hub->st.ntensors;
	reg.state_bytes = hub->st.state_bytes;
	reg.fds = 3 + hub->st.masters_n;
	reg.seed = hub->st.seed;
	reg.lane_to_daemon_off = s->arena.to_daemon_off;
	reg.lane_to_client_off = s->arena.to_client_off;
	reg.lane_xfer_off = s->arena.xfer_off;
	reg.group_id = hub->id;
	reg.local_world = hub->rep->world;
	/* A group that resumed a leased state: every member loads the
	 * parameters from it (no step can have ended before all joined). */
	reg.resumed = hub->resumed_from != 0;
	reg.resumed_step = hub->resumed_from ? hub->st.last_step : 0;
	reg.resumed_from = hub->resumed_from;
	Aoq__Envelope reply = AOQ__ENVELOPE__INIT;
	reply.msg_case = AOQ__ENVELOPE__MSG_REGISTERED;
	reply.registered = &reg;
	int fds[AOQ_MAX_FDS];
	if ((r = registered_fds(fds, &s->arena, &hub->st)) < 0)
		return AOQD_FAIL(err, INTERNAL, "cannot open the masters for the client: %s", strerror(-r));
	r = aoqd_conn_send_with_fds(&s->conn, &reply, fds, (int)reg.fds);
	registered_fds_close(fds, &hub->st);
	aoqd_arena_sent(&s->arena);
	if (r < 0)
		return AOQD_FAIL(err, INTERNAL, "cannot send the arena: %s", strerror(-r));
	s->state = AOQD_READY;
	s->registered = true;
	aoqd_info("session", "session %" PRIu64 ": local rank %u of %u joined replica group %" PRIu64, s->id,
	          s->local_rank, hub->rep->world, hub->id);
	return AOQD_REPLIED;
}

int aoqd_on_set_hyperparams(struct aoqd_session *from, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__SetHyperparams *m = env->set_hyperparams;
	/* A replica group member sets its hub's (every member sends the same;
	 * the group takes a step's records once every member came to it). */
	struct aoqd_session *s = from->hub ? from->hub : from;
	struct aoqd_state *st = &s->st;
	char why[256];
	if (m->group >= st->ngroups)
		return AOQD_FAIL(err, INVALID, "SetHyperparams: group %u of %u", m->group, st->ngroups);
	struct aoqd_group *g = &st->groups[m->group];
	if (!aoqd_hp_valid(g->kind, m->hp, why, sizeof(why)))
		return AOQD_FAIL(err, INVALID, "SetHyperparams: group %u: %s", m->group, why);
	if (g->kind == AOQ__OPTIMIZER_KIND__SGD && g->moments == 0 && m->hp->momentum != 0)
		return AOQD_FAIL(err, INVALID, "SetHyperparams: group %u: SGD registered without momentum has no "
		                 "momentum buffer (register the group with momentum > 0)", m->group);
	uint64_t cur = s->steps.next_step;
	if (m->step != cur || s->steps.accepted[cur & 1] != 0)
		return AOQD_REFUSE(err, BUSY, "hyperparameters for step %" PRIu64 " cannot change now (current step %"
		                   PRIu64 " has %s gradients)", m->step, cur, s->steps.accepted[cur & 1] ? "received" : "no");
	aoqd_group_set(g, g->kind, m->hp);
	aoqd_state_journal_hp(st, m->group);
	aoqd_conn_send_done(&from->conn, 0);
	return AOQD_REPLIED;
}
