/* SPDX-License-Identifier: MIT */
/*
 * libaoq: the session with aoqd.  The control socket carries requests and
 * replies (blocking, under ctl_lock); gradients and parameters move through
 * the arena's rings.  A progress thread sleeps on the daemon's doorbell,
 * takes param records and starts the copies back to the device; a thread
 * waiting for an answer polls the ring a short while first and takes them
 * itself (spin_answers).
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "aoq-arena.h"
#include "backend.h"
#include "wire.h"

#define TENSORS_PER_FRAME 256

/* A backend event shared by a tensor and a staging slot (under c->lock). */
struct evref {
	struct aoq_event *ev;
	unsigned refs;
};

struct tensor {
	struct aoq_tensor d;
	size_t gsize, psize;
	uint64_t pushed;    /* records posted */
	uint64_t answered;  /* records answered */
	uint64_t copies;    /* gradient copies started */
	uint64_t copied;    /* gradient copies finished */
	/* The last parameter copy issued; backends complete copies to the
	 * device in issue order, so it covers every earlier one. */
	struct evref *h2d;
	uint8_t *grad_area, *param_area; /* no window: the tensor's own slot */
	/* The master is the parameter (aoq-arena.h): copies come from here,
	 * in the masters memfd, not from a param area.  NULL otherwise. */
	const uint8_t *master_area;
	uint64_t param_buf;  /* delayed: bytes from one param buffer to the other */
	struct aoq_event *last_use; /* recorded at push: the old value's last use */
	bool pending;        /* delayed: an update waits in the arena */
	uint64_t pending_step;
	void *stream;        /* stream of the last push */
	/* Replica group: this rank's slice [sb, se); the step of the last
	 * final push (want) and the last step whose every element was
	 * answered (done), counted per step parity (got, got_step). */
	uint64_t sb, se;
	uint64_t want, done;
	uint64_t got[2], got_step[2];
};

/* A staging slot of the window. */
struct slot {
	uint8_t *grad_area, *param_area;
	struct evref *h2d;   /* the last copy out of its param area */
	bool busy;
	uint32_t tensor;
	uint64_t offset, count;
};

struct copy_done {
	struct aoq_client *c;
	uint32_t t;
	struct aoq_rec rec;
};

/* aoqctl trace: a copy being timed.  Only while the daemon sets the
 * to-client ring's `trace` word; the backend writes tm, the library reports
 * finished spans (TraceSpans) before each StepEnd and before Bye.  A fixed
 * pool: when every entry is taken, a copy goes untimed. */
struct cspan {
	struct aoq_copy_time tm;
	uint64_t step, offset, count;
	uint32_t tensor;
	int kind; /* Aoq__TraceSpanKind */
	bool used;
};
#define TRACE_POOL AOQ_TRACE_SPANS_MAX

struct aoq_client {
	int sock;
	pthread_mutex_t ctl_lock;
	struct aoq_options o;
	char *job, *socket_path, *device;
	const struct aoq_backend_ops *ops;
	struct aoq_backend *be;
	uint64_t session_id;
	bool resumed;
	uint64_t resumed_step;
	uint32_t world;      /* replica group: local ranks (0: none) */

	struct aoq_group *groups;
	uint32_t ngroups, cap_groups;
	struct tensor *tensors;
	uint32_t ntensors, cap_tensors;
	bool registered;

	uint8_t *arena;
	uint64_t arena_size;
	/* The masters memfd, mapped read-only (aoq-arena.h); NULL: none. */
	uint8_t *masters;
	uint64_t masters_size;
	bool masters_registered;
	struct aoq_arena_header hdr; /* validated copy */
	int bell_out;  /* we ring the daemon */
	int bell_in;   /* the daemon rings us */
	int wake_fd;   /* stops the progress thread */
	pthread_t progress;
	bool progress_running;

	pthread_mutex_t lock; /* tensors' counters, the rings, error */
	pthread_cond_t cond;
	/* The to-client ring's one consumer at a time: the progress thread,
	 * or a waiting thread that polls it (wait_answered).  Taken before
	 * c->lock, never while holding it. */
	pthread_mutex_t drain_lock;
	uint64_t spin_ns;     /* how long a waiting thread polls at most (AOQ_SPIN_US) */
	bool spinning;        /* a thread polls (under c->lock) */
	/* The polling thread's own (spin_answers): the current budget and
	 * the count of polls, for the periodic full-length probe. */
	uint64_t spin_budget_ns;
	uint64_t spin_polls;
	struct aoq_ring_prod to_daemon;
	struct aoq_ring_cons to_client;
	struct slot *slots;   /* window mode */
	uint32_t *free_slots;
	uint32_t nfree;
	int error;            /* sticky: the session is over */
	bool closed_error;    /* error is the daemon's Error read after it closed */
	char errmsg[256];

	struct cspan *spans;  /* trace pool (TRACE_POOL), allocated when first traced */
	uint32_t span_next;   /* where the search for a free entry starts */
	uint32_t spans_used;  /* entries taken (0: report_spans has nothing to do) */

	uint64_t step;        /* the step pushes belong to */
	uint64_t step_ends_pending;
	struct aoq_step_result last;
};

static int fail_session(struct aoq_client *c, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Marks the session broken (caller holds c->lock) and wakes every waiter. */
static int fail_session(struct aoq_client *c, int err, const char *fmt, ...)
{
	if (!c->error) {
		c->error = err;
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(c->errmsg, sizeof(c->errmsg), fmt, ap);
		va_end(ap);
	}
	pthread_cond_broadcast(&c->cond);
	return err;
}

static int session_error(struct aoq_client *c)
{
	return aoq_set_error(c->error, "aoq session ended: %s", c->errmsg);
}

/* The sticky error, for a thread that does not hold c->lock: the progress
 * thread may be failing the session right now (the tsan phase of
 * tests/run-all.sh found the unlocked read). */
static int failed(struct aoq_client *c)
{
	pthread_mutex_lock(&c->lock);
	int r = c->error;
	pthread_mutex_unlock(&c->lock);
	return r;
}

/* session_error() for a thread that does not hold c->lock; 0 when the
 * session is fine. */
static int session_error_locked(struct aoq_client *c)
{
	pthread_mutex_lock(&c->lock);
	int r = c->error ? session_error(c) : 0;
	pthread_mutex_unlock(&c->lock);
	return r;
}

/* A deadline for the waits of one call, set at its first wait. */
struct deadline {
	bool set;
	struct timespec at;
};

/* Sleeps on c->cond (caller holds c->lock) until woken or until the call's
 * deadline; past the deadline the session fails with -ETIMEDOUT, which ends
 * every wait loop (they all test c->error). */
static void wait_daemon(struct aoq_client *c, struct deadline *dl)
{
	if (c->o.timeout_ms == AOQ_TIMEOUT_NONE) {
		pthread_cond_wait(&c->cond, &c->lock);
		return;
	}
	if (!dl->set) {
		clock_gettime(CLOCK_MONOTONIC, &dl->at);
		dl->at.tv_sec += c->o.timeout_ms / 1000;
		dl->at.tv_nsec += (long)(c->o.timeout_ms % 1000) * 1000000L;
		if (dl->at.tv_nsec >= 1000000000L) {
			dl->at.tv_sec++;
			dl->at.tv_nsec -= 1000000000L;
		}
		dl->set = true;
	}
	if (pthread_cond_timedwait(&c->cond, &c->lock, &dl->at) == ETIMEDOUT)
		fail_session(c, -ETIMEDOUT, "aoqd did not answer within %u ms (stalled or overloaded; "
		             "aoq_options.timeout_ms sets the deadline)", c->o.timeout_ms);
}

/* Rings a doorbell: aoqd's are sockets (send: no SIGPIPE when the daemon
 * is gone, never blocking); our own wake_fd is an eventfd. */
static void ring(int fd)
{
	uint64_t one = 1;
	ssize_t r = send(fd, &one, sizeof(one), MSG_NOSIGNAL | MSG_DONTWAIT);
	if (r < 0 && errno == ENOTSOCK)
		r = write(fd, &one, sizeof(one));
	(void)r;
}

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
static void evref_put(struct aoq_client *c, struct evref *r)
{
	if (r && --r->refs == 0) {
		if (r->ev)
			c->ops->event_release(c->be, r->ev);
		free(r);
	}
}

/* ---- control path ---- */

/* Sends env and returns the reply of the wanted kind; StepEnded replies of
 * earlier StepEnd requests that arrive first are consumed on the way.
 * Caller holds ctl_lock. */
static int ctl_recv(struct aoq_client *c, int want, Aoq__Envelope **out, int *fds, int *nfds)
{
	for (;;) {
		Aoq__Envelope *rep;
		int r = aoq_recv_frame(c->sock, &rep, fds, fds ? AOQ_MAX_FDS : 0, nfds);
		if (r == -EAGAIN || r == -EWOULDBLOCK) {
			/* SO_RCVTIMEO: the deadline passed mid-request; the reply
			 * may still come, so the connection is out of step. */
			pthread_mutex_lock(&c->lock);
			fail_session(c, -ETIMEDOUT, "aoqd did not answer within %u ms", c->o.timeout_ms);
			pthread_mutex_unlock(&c->lock);
			return aoq_set_error(-ETIMEDOUT, "aoqd did not answer within %u ms (stalled or overloaded; "
			                     "aoq_options.timeout_ms sets the deadline)", c->o.timeout_ms);
		}
		if (r < 0) {
			pthread_mutex_lock(&c->lock);
			/* The progress thread read why the daemon closed (closed_why):
			 * that is the answer. */
			int why = c->closed_error ? session_error(c) : 0;
			fail_session(c, r, "control socket: %s", strerror(-r));
			pthread_mutex_unlock(&c->lock);
			return why ? why : aoq_set_error(r, "aoqd: control socket: %s", strerror(-r));
		}
		if (rep->msg_case == AOQ__ENVELOPE__MSG_STEP_ENDED && c->step_ends_pending > 0) {
			pthread_mutex_lock(&c->lock);
			c->step_ends_pending--;
			c->last.step = rep->step_ended->step;
			c->last.grad_sumsq = rep->step_ended->grad_sumsq;
			c->last.nonfinite = rep->step_ended->nonfinite;
			c->last.tensors_updated = rep->step_ended->tensors_updated;
			c->last.skipped = rep->step_ended->skipped;
			c->last.clip_scale = rep->step_ended->clip_scale;
			pthread_mutex_unlock(&c->lock);
			aoq_envelope_free(rep);
			if (want == AOQ__ENVELOPE__MSG_STEP_ENDED)
				return 0;
			continue;
		}
		if (rep->msg_case == AOQ__ENVELOPE__MSG_ERROR) {
			r = aoq_error_to_errno(rep->error->code);
			aoq_set_error(r ? r : -EIO, "aoqd: %s: %s", aoq_error_name(rep->error->code), rep->error->message);
			aoq_envelope_free(rep);
			if (fds && *nfds) {
				for (int i = 0; i < *nfds; i++)
					close(fds[i]);
				*nfds = 0;
			}
			return r ? r : -EIO;
		}
		if ((int)rep->msg_case != want) {
			aoq_envelope_free(rep);
			pthread_mutex_lock(&c->lock);
			fail_session(c, -EPROTO, "unexpected reply %d", (int)rep->msg_case);
			pthread_mutex_unlock(&c->lock);
			return aoq_set_error(-EPROTO, "aoqd sent an unexpected reply");
		}
		if (out)
			*out = rep;
		else
			aoq_envelope_free(rep);
		return 0;
	}
}

static int ctl_call(struct aoq_client *c, const Aoq__Envelope *env, int want, Aoq__Envelope **out)
{
	int r = session_error_locked(c);
	if (r < 0)
		return r;
	r = aoq_send_frame(c->sock, env, NULL, 0);
	if (r == -EAGAIN || r == -EWOULDBLOCK) {
		pthread_mutex_lock(&c->lock);
		fail_session(c, -ETIMEDOUT, "aoqd did not take a request within %u ms", c->o.timeout_ms);
		pthread_mutex_unlock(&c->lock);
		return aoq_set_error(-ETIMEDOUT, "aoqd did not take a request within %u ms", c->o.timeout_ms);
	}
	if (r == -EPIPE || r == -ECONNRESET) {
		/* The daemon closed the connection, perhaps after saying why
		 * (a QUOTA refusal): an Error waiting to be read wins. */
		int e = ctl_recv(c, want, out, NULL, NULL);
		if (e < 0 && e != -EPIPE && e != -ECONNRESET)
			return e;
	}
	if (r < 0)
		return aoq_set_error(r, "aoqd: send: %s", strerror(-r));
	return ctl_recv(c, want, out, NULL, NULL);
}

const char *aoq_version(void)
{
	return AOQ_VERSION_STRING;
}

int aoq_abi_version(void)
{
	return AOQ_ABI_VERSION;
}

size_t aoq_struct_size(const char *name)
{
	static const struct {
		const char *name;
		size_t size;
	} sizes[] = {
		{ "aoq_options", sizeof(struct aoq_options) },
		{ "aoq_group", sizeof(struct aoq_group) },
		{ "aoq_tensor", sizeof(struct aoq_tensor) },
		{ "aoq_step_result", sizeof(struct aoq_step_result) },
	};
	for (size_t i = 0; name && i < sizeof(sizes) / sizeof(sizes[0]); i++)
		if (strcmp(name, sizes[i].name) == 0)
			return sizes[i].size;
	return 0;
}

/* A public struct's size field against the layout this library knows. */
static int size_ok(uint32_t size, size_t want, const char *what)
{
	if (size == want)
		return 0;
	return aoq_set_error(-EINVAL, "struct %s has size %u, this libaoq (ABI %d) knows %zu: initialise it "
	                     "with its AOQ_*_INIT or rebuild against this <aoq/aoq.h>",
	                     what, size, AOQ_ABI_VERSION, want);
}

/* How long a thread waiting for an answer polls the to-client ring before
 * it sleeps (README, "Waiting for an update"): AOQ_SPIN_US microseconds,
 * default 50; none with one CPU, where polling only delays the daemon. */
#define SPIN_US_DEFAULT 50u
#define SPIN_US_MAX 10000u
static uint64_t spin_ns_default(void)
{
	uint64_t us = SPIN_US_DEFAULT;
	const char *e = getenv("AOQ_SPIN_US");
	if (e && *e) {
		char *end;
		unsigned long v = strtoul(e, &end, 10);
		if (*end == '\0')
			us = v > SPIN_US_MAX ? SPIN_US_MAX : v;
	}
	return sysconf(_SC_NPROCESSORS_ONLN) < 2 ? 0 : us * 1000u;
}

int aoq_connect(struct aoq_client **out, const struct aoq_options *opts)
{
	struct aoq_options def = AOQ_OPTIONS_INIT;
	if (!opts)
		opts = &def;
	int r = size_ok(opts->size, sizeof(*opts), "aoq_options");
	if (r < 0)
		return r;
	struct aoq_client *c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->sock = c->bell_in = c->bell_out = c->wake_fd = -1;
	pthread_mutex_init(&c->ctl_lock, NULL);
	pthread_mutex_init(&c->lock, NULL);
	pthread_mutex_init(&c->drain_lock, NULL);
	c->spin_ns = c->spin_budget_ns = spin_ns_default();
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&c->cond, &ca);
	pthread_condattr_destroy(&ca);
	c->o = *opts;
	if (!c->o.timeout_ms)
		c->o.timeout_ms = AOQ_DEFAULT_TIMEOUT_MS;
	c->job = strdup(opts->job ? opts->job : "default");
	c->device = strdup(opts->device ? opts->device : "cpu");
	c->step = 1;
	char path[256];
	r = aoq_socket_path(opts->socket, path, sizeof(path));
	if (r < 0 || !c->job || !c->device || !(c->socket_path = strdup(path))) {
		aoq_close(c);
		return aoq_set_error(r < 0 ? r : -ENOMEM, "socket path too long");
	}
	c->o.job = c->job;
	c->o.device = c->device;
	c->o.socket = c->socket_path;
	int index;
	if ((r = aoq_backend_lookup(c->device, &c->ops, &index)) < 0) {
		aoq_close(c);
		return r;
	}
	if ((r = c->ops->open(&c->be, index, &c->o)) < 0) {
		c->be = NULL;
		aoq_close(c);
		return r;
	}
	c->sock = aoq_socket_connect_timeout(path, c->o.timeout_ms == AOQ_TIMEOUT_NONE ? 0 : c->o.timeout_ms);
	if (c->sock < 0) {
		r = c->sock;
		if (r == -ETIMEDOUT)
			aoq_set_error(r, "aoqd at %s did not accept the connection within %u ms", path, c->o.timeout_ms);
		else
			aoq_set_error(r, "cannot connect to aoqd at %s: %s (is aoqd running? set AOQ_SOCKET)", path, strerror(-r));
		aoq_close(c);
		return r;
	}
	Aoq__Hello h = AOQ__HELLO__INIT;
	h.protocol_version = AOQ_PROTOCOL_VERSION;
	h.job = c->job;
	h.rank = opts->rank;
	h.device = c->device;
	h.pid = (uint32_t)getpid();
	h.lease_seconds = opts->lease_seconds;
	if (opts->local_world > 1) {
		if (opts->local_world > AOQ_MAX_LOCAL_WORLD || opts->local_rank >= opts->local_world ||
		    opts->window || opts->delayed_update) {
			aoq_close(c);
			return aoq_set_error(-EINVAL, "replica group: local rank %u of local world %u (2 to %u ranks; window 0 "
			                     "and no delayed update)", opts->local_rank, opts->local_world, AOQ_MAX_LOCAL_WORLD);
		}
		h.local_world = opts->local_world;
		h.local_rank = opts->local_rank;
		c->world = opts->local_world;
	}
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_HELLO;
	env.hello = &h;
	Aoq__Envelope *rep;
	r = ctl_call(c, &env, AOQ__ENVELOPE__MSG_WELCOME, &rep);
	if (r < 0) {
		aoq_close(c);
		return r;
	}
	c->session_id = rep->welcome->session_id;
	aoq_envelope_free(rep);
	*out = c;
	return 0;
}

int aoq_add_group(struct aoq_client *c, const struct aoq_group *g)
{
	int r = size_ok(g->size, sizeof(*g), "aoq_group");
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

static bool dtype_ok(enum aoq_dtype t)
{
	return t == AOQ_FP32 || t == AOQ_BF16 || t == AOQ_FP16;
}

int aoq_add_tensor(struct aoq_client *c, const struct aoq_tensor *t)
{
	int r = size_ok(t->size, sizeof(*t), "aoq_tensor");
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
			r = ctl_recv(c, AOQ__ENVELOPE__MSG_REGISTER_MORE, NULL, NULL, NULL);
		else
			r = ctl_recv(c, AOQ__ENVELOPE__MSG_REGISTERED, reply, fds, nfds);
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

/* A pool entry for a copy to time, or NULL when the session is not traced
 * (the fast path: one relaxed load) or the pool is full.  Under c->lock. */
static struct aoq_copy_time *span_new(struct aoq_client *c, int kind, uint32_t t, uint64_t step, uint64_t offset,
                                      uint64_t count)
{
	if (!c->to_client.ring || !atomic_load_explicit(&c->to_client.ring->trace, memory_order_relaxed))
		return NULL;
	if (!c->spans && !(c->spans = calloc(TRACE_POOL, sizeof(*c->spans))))
		return NULL;
	for (uint32_t k = 0; k < TRACE_POOL; k++) {
		struct cspan *x = &c->spans[(c->span_next + k) % TRACE_POOL];
		if (x->used)
			continue;
		c->span_next = (c->span_next + k + 1) % TRACE_POOL;
		atomic_store_explicit(&x->tm.start_ns, 0, memory_order_relaxed);
		atomic_store_explicit(&x->tm.end_ns, 0, memory_order_relaxed);
		x->step = step;
		x->offset = offset;
		x->count = count;
		x->tensor = t;
		x->kind = kind;
		x->used = true;
		c->spans_used++;
		return &x->tm;
	}
	return NULL;
}

/* Sends the finished spans of the pool (one TraceSpans frame; the pool
 * holds at most what a frame may carry) and frees their entries.  Caller
 * holds ctl_lock. */
static int report_spans(struct aoq_client *c)
{
	pthread_mutex_lock(&c->lock);
	if (!c->spans_used) {
		pthread_mutex_unlock(&c->lock);
		return 0;
	}
	Aoq__TraceSpan *sp = calloc(TRACE_POOL, sizeof(*sp));
	Aoq__TraceSpan **spp = calloc(TRACE_POOL, sizeof(*spp));
	size_t n = 0;
	for (uint32_t i = 0; sp && spp && i < TRACE_POOL; i++) {
		struct cspan *x = &c->spans[i];
		uint64_t end = x->used ? atomic_load_explicit(&x->tm.end_ns, memory_order_acquire) : 0;
		if (!end)
			continue;
		uint64_t start = atomic_load_explicit(&x->tm.start_ns, memory_order_relaxed);
		x->used = false;
		c->spans_used--;
		if (start == 0 || start > end)
			continue;
		aoq__trace_span__init(&sp[n]);
		sp[n].step = x->step;
		sp[n].tensor = x->tensor;
		sp[n].kind = (Aoq__TraceSpanKind)x->kind;
		sp[n].start_ns = start;
		sp[n].duration_ns = end - start;
		sp[n].offset = x->offset;
		sp[n].count = x->count;
		spp[n] = &sp[n];
		n++;
	}
	pthread_mutex_unlock(&c->lock);
	int r = 0;
	if (n) {
		Aoq__TraceSpans m = AOQ__TRACE_SPANS__INIT;
		m.n_spans = n;
		m.spans = spp;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_TRACE_SPANS;
		env.trace_spans = &m;
		r = aoq_send_frame(c->sock, &env, NULL, 0);
		if (r < 0)
			aoq_set_error(r, "aoqd: send: %s", strerror(-r));
	}
	free(sp);
	free(spp);
	return r;
}

/* Starts the copy of an updated range to the device; the event goes to
 * the tensor (and the slot it came from).  Caller holds c->lock, which is
 * dropped around the backend call: a backend's completion callbacks take
 * c->lock, and CUDA forbids waiting on them from inside its own calls, so
 * no backend call is made under c->lock. */
static void copy_param(struct aoq_client *c, struct tensor *x, const uint8_t *src, uint64_t offset,
                       uint64_t count, struct slot *sl, uint64_t step)
{
	struct aoq_event *ev = NULL, *after = x->last_use;
	void *stream = x->stream;
	uint8_t *dst = (uint8_t *)x->d.param + offset * x->psize;
	struct aoq_copy_time *tm = span_new(c, AOQ__TRACE_SPAN_KIND__SPAN_H2D, (uint32_t)(x - c->tensors), step, offset,
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
		fail_session(c, e, "parameter copy to the device failed: %s", aoq_last_error());
		return;
	}
	evref_put(c, x->h2d);
	x->h2d = r;
	if (sl) {
		evref_put(c, sl->h2d);
		sl->h2d = r;
	}
}

static void handle_record(struct aoq_client *c, const struct aoq_rec *r)
{
	struct tensor *x = &c->tensors[r->tensor];
	pthread_mutex_lock(&c->lock);
	if (c->slots) {
		struct slot *sl = &c->slots[r->slot];
		if (r->status == AOQ_REC_UPDATED && x->master_area)
			copy_param(c, x, x->master_area + r->offset * x->psize, r->offset, r->count, NULL, r->step);
		else if (r->status == AOQ_REC_UPDATED)
			copy_param(c, x, sl->param_area, r->offset, r->count, sl, r->step);
		sl->busy = false;
		c->free_slots[c->nfree++] = r->slot;
	} else if (r->status == AOQ_REC_UPDATED) {
		if (c->o.delayed_update) {
			/* Lands with the tensor's next push (or aoq_flush). */
			x->pending = true;
			x->pending_step = r->step;
		} else {
			copy_param(c, x, (x->master_area ? x->master_area : x->param_area) + r->offset * x->psize, r->offset,
			           r->count, NULL, r->step);
		}
	}
	if (!c->world || (r->offset >= x->sb && r->offset < x->se))
		x->answered++; /* ours */
	if (c->world && r->status != AOQ_REC_ACCUMULATED) {
		unsigned p = r->step & 1;
		if (x->got_step[p] != r->step) {
			x->got_step[p] = r->step;
			x->got[p] = 0;
		}
		x->got[p] += r->count;
		if (x->got[p] == x->d.numel && r->step > x->done)
			x->done = r->step; /* every slice of the step answered */
	}
	pthread_cond_broadcast(&c->cond);
	pthread_mutex_unlock(&c->lock);
}

/* Whether tensor x's updated parameter has come (caller holds c->lock):
 * every record answered, and in a replica group every slice of the step
 * of its last final push. */
static bool param_answered(const struct aoq_client *c, const struct tensor *x)
{
	return x->answered >= x->pushed && (!c->world || x->done >= x->want);
}

/* Takes every param record off the ring.  False when the session broke.
 * Caller holds drain_lock. */
static bool drain_ring(struct aoq_client *c)
{
	for (;;) {
		struct aoq_rec r;
		int n = aoq_ring_peek(&c->to_client, &r);
		if (n < 0) {
			pthread_mutex_lock(&c->lock);
			fail_session(c, -EPROTO, "the daemon's ring counter is corrupt");
			pthread_mutex_unlock(&c->lock);
			return false;
		}
		if (n == 0) {
			if (aoq_ring_idle(&c->to_client))
				return true;
			continue;
		}
		bool ok = r.tensor < c->ntensors && aoq_range_ok(r.offset, r.count, c->tensors[r.tensor].d.numel) &&
		          (r.status == AOQ_REC_UPDATED || r.status == AOQ_REC_ACCUMULATED || r.status == AOQ_REC_SKIPPED);
		if (ok) {
			pthread_mutex_lock(&c->lock);
			const struct tensor *x = &c->tensors[r.tensor];
			if (c->world && !(r.offset >= x->sb && r.offset < x->se))
				/* another rank's slice: an update of a step we are in */
				ok = (r.offset + r.count <= x->sb || r.offset >= x->se) && r.status != AOQ_REC_ACCUMULATED &&
				     r.step >= 1 && r.step <= c->step;
			else
				ok = c->tensors[r.tensor].answered < c->tensors[r.tensor].pushed;
			if (c->slots) {
				/* The answer must match what the slot was lent for. */
				const struct slot *sl = r.slot < c->hdr.slots ? &c->slots[r.slot] : NULL;
				ok = ok && sl && sl->busy && sl->tensor == r.tensor && sl->offset == r.offset && sl->count == r.count;
			} else {
				ok = ok && r.slot == r.tensor;
			}
			pthread_mutex_unlock(&c->lock);
		}
		if (!ok) {
			pthread_mutex_lock(&c->lock);
			fail_session(c, -EPROTO, "the daemon sent a bad record (tensor %u)", r.tensor);
			pthread_mutex_unlock(&c->lock);
			return false;
		}
		aoq_ring_pop(&c->to_client);
		if (aoq_ring_producer_waiting(&c->to_client))
			ring(c->bell_out);
		handle_record(c, &r);
	}
}

static bool drain_params(struct aoq_client *c)
{
	pthread_mutex_lock(&c->drain_lock);
	bool ok = drain_ring(c);
	pthread_mutex_unlock(&c->drain_lock);
	return ok;
}

/* The daemon closed the connection: when no request is reading it, the
 * Error it sent before closing (e.g. PEER_LOST from a replica group) becomes
 * the session's error, rather than a bare "closed".  Progress thread. */
static void closed_why(struct aoq_client *c)
{
	if (pthread_mutex_trylock(&c->ctl_lock) != 0)
		return; /* a request is reading: it gets the Error itself */
	for (int i = 0; i < 64; i++) {
		Aoq__Envelope *rep;
		/* The peer closed: what it sent is buffered, so this does not wait. */
		if (aoq_recv_frame(c->sock, &rep, NULL, 0, NULL) < 0)
			break;
		bool err = rep->msg_case == AOQ__ENVELOPE__MSG_ERROR;
		if (err) {
			int r = aoq_error_to_errno(rep->error->code);
			pthread_mutex_lock(&c->lock);
			if (!c->error)
				c->closed_error = true;
			fail_session(c, r ? r : -EIO, "aoqd: %s: %s", aoq_error_name(rep->error->code), rep->error->message);
			pthread_mutex_unlock(&c->lock);
		}
		aoq_envelope_free(rep);
		if (err)
			break;
	}
	pthread_mutex_unlock(&c->ctl_lock);
}

static void *progress_main(void *arg)
{
	struct aoq_client *c = arg;
	struct pollfd p[3] = {
		{ .fd = c->bell_in, .events = POLLIN },
		{ .fd = c->wake_fd, .events = POLLIN },
		{ .fd = c->sock, .events = POLLRDHUP },
	};
	for (;;) {
		if (poll(p, 3, -1) < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		if (p[1].revents)
			break;
		if (p[0].revents & (POLLIN | POLLHUP)) {
			/* An eventfd or a socket: take every pending ring. */
			uint8_t v[256];
			ssize_t r = read(c->bell_in, v, sizeof(v));
			if (r == 0) {
				drain_params(c);
				/* aoqd closes a doorbell only after the connection,
				 * so what it said before closing is buffered. */
				closed_why(c);
				pthread_mutex_lock(&c->lock);
				fail_session(c, -ECONNRESET, "aoqd closed the doorbell (see its log)");
				pthread_mutex_unlock(&c->lock);
				break;
			}
			/* The daemon also rings when it freed space in our ring. */
			pthread_mutex_lock(&c->lock);
			pthread_cond_broadcast(&c->cond);
			pthread_mutex_unlock(&c->lock);
		}
		if (!drain_params(c))
			break;
		if (p[2].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
			drain_params(c);
			closed_why(c);
			pthread_mutex_lock(&c->lock);
			fail_session(c, -ECONNRESET, "aoqd closed the session (see its log, or the reply to the next request)");
			pthread_mutex_unlock(&c->lock);
			break;
		}
	}
	return NULL;
}

/* Moves a tensor's initial values into the daemon's master copy. */
static int load_initial(struct aoq_client *c, uint32_t i)
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
		if ((r = ctl_call(c, &env, AOQ__ENVELOPE__MSG_DONE, NULL)) < 0)
			return r;
	}
	return 0;
}

/* A resumed session: tensor i's parameter from the daemon's master, in
 * its param dtype (rounded as the updates round it). */
static int load_resumed(struct aoq_client *c, uint32_t i)
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
		int r = ctl_call(c, &env, AOQ__ENVELOPE__MSG_DONE, NULL);
		if (r < 0)
			return r;
		if ((r = c->ops->copy_to_device(c->be, (uint8_t *)x->d.param + off * x->psize, xfer, n * x->psize)) < 0)
			return r;
	}
	return 0;
}

int aoq_resumed(struct aoq_client *c, uint64_t *step)
{
	if (step)
		*step = c->resumed ? c->resumed_step : 0;
	return c->resumed ? 1 : 0;
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
	if ((nfds != 3 && nfds != 4) || rep->registered->fds != (uint32_t)nfds) {
		r = aoq_set_error(-EPROTO, "aoqd sent %d fds with the arena, expected %u (3 or 4)", nfds,
		                  rep->registered->fds);
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
	if (nfds == 4) {
		/* The masters: the daemon's own pages, which only it writes
		 * (sealed against writable mappings), so read-only here. */
		struct stat ms;
		void *q = MAP_FAILED;
		if (fstat(fds[3], &ms) == 0 && ms.st_size > 0)
			q = mmap(NULL, (size_t)ms.st_size, PROT_READ, MAP_SHARED, fds[3], 0);
		if (q == MAP_FAILED) {
			munmap(p, c->arena_size);
			r = aoq_set_error(-EPROTO, "cannot map the masters memfd: %s", strerror(errno));
			goto out_fds;
		}
		c->masters = q;
		c->masters_size = (uint64_t)ms.st_size;
		close(fds[3]);
	}
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
	if (c->masters && c->ops->register_host_ro) {
		/* Unpinned, copies still work (slower): a warning, not an error. */
		if (c->ops->register_host_ro(c->be, c->masters, c->masters_size) == 0)
			c->masters_registered = true;
		else
			fprintf(stderr, "aoq: warning: %s; parameters are copied from pageable memory\n", aoq_last_error());
	}
	if (c->resumed) {
		/* The daemon's state is the truth: parameters come from it. */
		c->step = c->resumed_step + 1;
		for (uint32_t i = 0; i < c->ntensors && r == 0; i++)
			r = load_resumed(c, i);
	}
	for (uint32_t i = 0; i < c->ntensors && r == 0 && !c->resumed; i++)
		r = load_initial(c, i);
	if (r < 0)
		goto out;
	c->wake_fd = eventfd(0, EFD_CLOEXEC);
	if (c->wake_fd < 0) {
		r = -errno;
		goto out;
	}
	if ((r = -pthread_create(&c->progress, NULL, progress_main, c)) < 0)
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

uint64_t aoq_current_step(struct aoq_client *c)
{
	pthread_mutex_lock(&c->lock);
	uint64_t s = c->step;
	pthread_mutex_unlock(&c->lock);
	return s;
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
		fail_session(c, status, "gradient copy of tensor %u failed", d->t);
	} else {
		int r;
		while ((r = aoq_ring_push(&c->to_daemon, &d->rec)) == -EAGAIN && !c->error)
			if (!aoq_ring_wait_space(&c->to_daemon, 1))
				wait_daemon(c, &dl);
		/* the ring was empty: wake aoqd, unless its loop polls the ring
		 * (loop_spin_us; aoq-arena.h, consumer_spinning) */
		if (r == 1 && aoq_ring_consumer_sleeps(&c->to_daemon))
			ring(c->bell_out);
		else if (r < 0 && !c->error)
			fail_session(c, r, "the daemon's ring counter is corrupt");
	}
	pthread_cond_broadcast(&c->cond);
	pthread_mutex_unlock(&c->lock);
	free(d);
}

/* Delayed update: where x's pending update lies (its master, or the param
 * buffer of its step's parity). */
static const uint8_t *pending_src(const struct tensor *x)
{
	return x->master_area ? x->master_area : x->param_area + ((x->pending_step & 1) ? x->param_buf : 0);
}

/* Starts one gradient copy into the arena; its record follows when done,
 * and when `after` is given (a parameter copy out of the master the record
 * lets the daemon write again; only with ops->d2h_after), after that too.
 * Caller holds c->lock; it is dropped around the backend call. */
static int start_copy(struct aoq_client *c, struct tensor *x, uint8_t *dst, const uint8_t *src,
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
		span_new(c, AOQ__TRACE_SPAN_KIND__SPAN_D2H, rec->tensor, rec->step, rec->offset, rec->count);
	pthread_mutex_unlock(&c->lock);
	int r = after ? c->ops->d2h_after(c->be, dst, src, rec->count * x->gsize, x->stream, after, grad_copied, d, tm)
	              : c->ops->d2h(c->be, dst, src, rec->count * x->gsize, x->stream, grad_copied, d, tm);
	pthread_mutex_lock(&c->lock);
	if (r < 0) {
		fail_session(c, r, "gradient copy of tensor %u failed: %s", rec->tensor, aoq_last_error());
		free(d);
	}
	return r;
}

int aoq_push_grad_ptr(struct aoq_client *c, uint32_t t, const void *grad, unsigned flags, void *stream)
{
	struct deadline dl = { 0 };
	if (!c->registered)
		return aoq_set_error(-EINVAL, "aoq_push_grad before aoq_register");
	if (t >= c->ntensors || !grad || (flags & ~AOQ_PUSH_ACCUMULATE))
		return aoq_set_error(-EINVAL, "aoq_push_grad: bad tensor %u, buffer or flags", t);
	struct tensor *x = &c->tensors[t];
	int r = 0;
	pthread_mutex_lock(&c->lock);
	/* One record of a tensor at a time: its slot is reused, and the
	 * daemon must see micro-batches in order. */
	while (!c->error && x->answered < x->pushed)
		wait_daemon(c, &dl);
	if (c->error) {
		pthread_mutex_unlock(&c->lock);
		return session_error(c);
	}
	x->stream = stream ? stream : c->o.cuda_stream;
	if (x->last_use) {
		c->ops->event_release(c->be, x->last_use);
		x->last_use = NULL;
	}
	if (c->ops->record && !c->o.delayed_update) {
		/* The gradient is final: the old parameter is no longer used by
		 * the work queued so far.  The update may land after that.  (No
		 * backend call under c->lock: see copy_param.) */
		struct aoq_event *ev = NULL;
		void *st = x->stream;
		pthread_mutex_unlock(&c->lock);
		int e = c->ops->record(c->be, st, &ev);
		pthread_mutex_lock(&c->lock);
		x->last_use = ev;
		if (e < 0) {
			fail_session(c, e, "cannot record an event on the stream: %s", aoq_last_error());
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
		evref_put(c, prev);
		if (r < 0)
			fail_session(c, r, "parameter copy to the device failed: %s", aoq_last_error());
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
			evref_put(c, prev);
		}
		if (x->pending && r == 0) {
			x->pending = false;
			copy_param(c, x, pending_src(x), 0, x->d.numel, NULL, x->pending_step);
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
					evref_put(c, after);
					after = NULL;
					if (r < 0)
						fail_session(c, r, "parameter copy to the device failed: %s", aoq_last_error());
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
		r = start_copy(c, x, x->grad_area + off * x->gsize, (const uint8_t *)grad + off * x->gsize, &rec,
		               after ? after->ev : NULL);
	}
	evref_put(c, after);
	for (uint64_t off = 0; r == 0 && c->slots && off < x->d.numel; off += c->hdr.slot_elems) {
		while (!c->error && c->nfree == 0)
			wait_daemon(c, &dl);
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
		evref_put(c, prev);
		rec.slot = i;
		rec.offset = off;
		rec.count = sl->count;
		if (r == 0)
			r = start_copy(c, x, sl->grad_area, (const uint8_t *)grad + off * x->gsize, &rec, NULL);
	}
	if (r == 0 && c->error)
		r = session_error(c);
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
		wait_daemon(c, &dl);
	int r = c->error && x->copied < x->copies ? session_error(c) : 0;
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
	int r = c->error && n ? session_error(c) : (int)(n > INT32_MAX ? INT32_MAX : n);
	pthread_mutex_unlock(&c->lock);
	return r;
}

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/*
 * A waiting thread takes the answers itself: it polls the to-client ring
 * for at most spin_ns, handling every record that comes (drain_ring), until
 * x's records are answered.  Meanwhile the ring says so
 * (aoq_ring_set_spinning) and the daemon's worker does not ring the
 * doorbell: no progress thread wakes, and the waiting thread does not
 * sleep, for an answer that comes within the spin.  It yields the CPU every
 * few microseconds, so on a box with few cores the daemon's threads still
 * run.  One thread polls at a time; the others sleep as before.
 *
 * The budget adapts: a poll that ends without the answer halves it (down
 * to SPIN_MIN_NS), one that gets it restores the whole AOQ_SPIN_US, and
 * every SPIN_PROBE-th poll tries the whole length.  When answers take long
 * (large tensors) or the daemon cannot run meanwhile (more runnable threads
 * than cores: polling then only takes CPU time from the daemon), the
 * thread soon polls for a few microseconds only.  Caller holds c->lock
 * (dropped meanwhile); false when it did not poll.
 */
#define SPIN_MIN_NS 2000u
#define SPIN_PROBE 16u
static bool spin_answers(struct aoq_client *c, const struct tensor *x)
{
	if (!c->spin_ns || c->spinning || !c->to_client.ring)
		return false;
	c->spinning = true;
	pthread_mutex_unlock(&c->lock);
	pthread_mutex_lock(&c->drain_lock);
	aoq_ring_set_spinning(&c->to_client, true);
	uint64_t budget = c->spin_polls++ % SPIN_PROBE == 0 ? c->spin_ns : c->spin_budget_ns;
	uint64_t end = mono_ns() + budget;
	bool ok = true, done = false;
	for (unsigned i = 1;; i++) {
		if (atomic_load_explicit(&c->to_client.ring->head, memory_order_acquire) != c->to_client.tail) {
			if (!(ok = drain_ring(c)))
				break;
			pthread_mutex_lock(&c->lock);
			done = c->error || param_answered(c, x);
			pthread_mutex_unlock(&c->lock);
			if (done)
				break;
		}
		if (i % 64 == 0) {
			if (mono_ns() >= end)
				break;
			sched_yield();
		} else {
			aoq_cpu_relax();
		}
	}
	aoq_ring_set_spinning(&c->to_client, false);
	if (done)
		c->spin_budget_ns = c->spin_ns;
	else if (c->spin_budget_ns / 2 >= SPIN_MIN_NS)
		c->spin_budget_ns /= 2;
	if (ok)
		drain_ring(c); /* pushed before the daemon saw the word cleared: no ring came */
	pthread_mutex_unlock(&c->drain_lock);
	pthread_mutex_lock(&c->lock);
	c->spinning = false;
	return true;
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
	while (!c->o.delayed_update && !c->error && !param_answered(c, x)) {
		if (!spun && (spun = spin_answers(c, x)))
			continue;
		wait_daemon(c, &dl);
	}
	int r = !c->o.delayed_update && !param_answered(c, x) ? session_error(c) : 0;
	*ev = r == 0 && x->h2d && x->h2d->ev ? x->h2d : NULL;
	if (*ev)
		(*ev)->refs++;
	pthread_mutex_unlock(&c->lock);
	return r;
}

static int wait_event(struct aoq_client *c, struct evref *ev, void *stream, bool host)
{
	if (!ev)
		return 0;
	int r = host ? c->ops->host_wait(c->be, ev->ev) : c->ops->stream_wait(c->be, ev->ev, stream);
	pthread_mutex_lock(&c->lock);
	evref_put(c, ev);
	pthread_mutex_unlock(&c->lock);
	return r;
}

int aoq_wait_param(struct aoq_client *c, uint32_t t, void *stream)
{
	struct evref *ev;
	int r = wait_answered(c, t, &ev);
	return r < 0 ? r : wait_event(c, ev, stream ? stream : c->o.cuda_stream, false);
}

int aoq_sync_param(struct aoq_client *c, uint32_t t)
{
	struct evref *ev;
	int r = wait_answered(c, t, &ev);
	return r < 0 ? r : wait_event(c, ev, NULL, true);
}

int aoq_set_hyperparams(struct aoq_client *c, uint32_t g, const struct aoq_group *hp)
{
	int r = size_ok(hp->size, sizeof(*hp), "aoq_group");
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
	r = ctl_call(c, &env, AOQ__ENVELOPE__MSG_DONE, NULL);
	if (r == 0)
		c->groups[g] = *hp;
	pthread_mutex_unlock(&c->ctl_lock);
	return r;
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
			wait_daemon(c, &dl);
	int r = c->error ? session_error(c) : 0;
	pthread_mutex_unlock(&c->lock);
	if (r == 0)
		r = report_spans(c); /* the step's gradient copies, the last step's parameter copies */
	if (r == 0) {
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_STEP_END;
		env.step_end = &m;
		r = aoq_send_frame(c->sock, &env, NULL, 0);
		int why = 0;
		if (r == -EPIPE || r == -ECONNRESET) {
			/* The daemon closed the session, perhaps saying why
			 * (PEER_LOST): that Error is the answer. */
			int e = ctl_recv(c, AOQ__ENVELOPE__MSG_STEP_ENDED, NULL, NULL, NULL);
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
	if (last && size_ok(last->size, sizeof(*last), "aoq_step_result") < 0)
		return -EINVAL;
	if (!c->registered)
		return aoq_set_error(-EINVAL, "aoq_sync before aoq_register");
	int r = 0;
	pthread_mutex_lock(&c->ctl_lock);
	while (r == 0 && c->step_ends_pending > 0)
		r = ctl_recv(c, AOQ__ENVELOPE__MSG_STEP_ENDED, NULL, NULL, NULL);
	pthread_mutex_unlock(&c->ctl_lock);
	pthread_mutex_lock(&c->lock);
	for (uint32_t i = 0; i < c->ntensors; i++)
		while (!c->error && !param_answered(c, &c->tensors[i]))
			wait_daemon(c, &dl);
	if (c->error && r == 0)
		r = session_error(c);
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
		copy_param(c, x, pending_src(x), 0, x->d.numel, NULL, x->pending_step);
	}
	if (c->error && r == 0)
		r = session_error(c);
	pthread_mutex_unlock(&c->lock);
	for (uint32_t i = 0; r == 0 && i < c->ntensors; i++)
		r = aoq_sync_param(c, i);
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
		r = ctl_call(c, &env, AOQ__ENVELOPE__MSG_DONE, NULL);
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
		r = ctl_call(c, &env, AOQ__ENVELOPE__MSG_TENSOR_STEPS, &rep);
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

/* Waits, within the deadline, until every gradient copy has completed. */
static bool copies_done(struct aoq_client *c)
{
	struct timespec at;
	clock_gettime(CLOCK_MONOTONIC, &at);
	uint32_t ms = c->o.timeout_ms == AOQ_TIMEOUT_NONE ? AOQ_DEFAULT_TIMEOUT_MS : c->o.timeout_ms;
	at.tv_sec += ms / 1000;
	at.tv_nsec += (long)(ms % 1000) * 1000000L;
	if (at.tv_nsec >= 1000000000L) {
		at.tv_sec++;
		at.tv_nsec -= 1000000000L;
	}
	pthread_mutex_lock(&c->lock);
	bool done = false;
	for (;;) {
		done = true;
		for (uint32_t i = 0; i < c->ntensors; i++)
			if (c->tensors[i].copied < c->tensors[i].copies)
				done = false;
		if (done || pthread_cond_timedwait(&c->cond, &c->lock, &at) == ETIMEDOUT)
			break;
	}
	pthread_mutex_unlock(&c->lock);
	return done;
}

void aoq_close(struct aoq_client *c)
{
	if (!c)
		return;
	if (c->sock >= 0 && !failed(c)) {
		if (c->registered && aoq_sync(c, NULL) == 0) {
			pthread_mutex_lock(&c->ctl_lock);
			report_spans(c); /* a trace in progress gets the last copies */
			pthread_mutex_unlock(&c->ctl_lock);
		}
		Aoq__Bye b = AOQ__BYE__INIT;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_BYE;
		env.bye = &b;
		aoq_send_frame(c->sock, &env, NULL, 0);
	}
	if (c->progress_running) {
		ring(c->wake_fd);
		pthread_join(c->progress, NULL);
	}
	/* A gradient copy still in flight (a device's, after an error skipped
	 * the sync above) lands in the arena and pushes its record when it
	 * completes: wait for it before unmapping, or it writes into whatever
	 * is mapped there next (another session's ring).  Past the deadline
	 * the arena and the client are left mapped and allocated. */
	if (c->arena && !copies_done(c)) {
		aoq_set_error(-ETIMEDOUT, "aoq_close: gradient copies did not complete; the session's memory is left");
		return;
	}
	for (uint32_t i = 0; i < c->ntensors; i++) {
		evref_put(c, c->tensors[i].h2d);
		if (c->tensors[i].last_use)
			c->ops->event_release(c->be, c->tensors[i].last_use);
		free((char *)c->tensors[i].d.name);
	}
	for (uint32_t i = 0; c->slots && i < c->hdr.slots; i++)
		evref_put(c, c->slots[i].h2d);
	free(c->slots);
	free(c->free_slots);
	if (c->arena) {
		if (c->be && c->registered)
			c->ops->unregister_host(c->be, c->arena, c->arena_size);
		munmap(c->arena, c->arena_size);
	}
	if (c->masters) {
		if (c->be && c->masters_registered)
			c->ops->unregister_host_ro(c->be, c->masters, c->masters_size);
		munmap(c->masters, c->masters_size);
	}
	if (c->be)
		c->ops->close(c->be);
	free(c->spans); /* the backend may time copies until it is closed */
	if (c->sock >= 0)
		close(c->sock);
	if (c->bell_in >= 0)
		close(c->bell_in);
	if (c->bell_out >= 0)
		close(c->bell_out);
	if (c->wake_fd >= 0)
		close(c->wake_fd);
	free(c->tensors);
	free(c->groups);
	free(c->job);
	free(c->device);
	free(c->socket_path);
	pthread_mutex_destroy(&c->ctl_lock);
	pthread_mutex_destroy(&c->lock);
	pthread_mutex_destroy(&c->drain_lock);
	pthread_cond_destroy(&c->cond);
	free(c);
}
