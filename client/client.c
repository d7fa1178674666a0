/* SPDX-License-Identifier: MIT */
/*
 * libaoq: the session with aoqd, from aoq_connect (Hello, Welcome) to
 * aoq_close (Bye, the arena unmapped once no copy can write it).  The
 * control socket carries requests and replies (control.c); gradients and
 * parameters move through the arena's rings (push.c, progress.c, copy.c).
 * client.h lists the files and the order in which they call each other.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "aoq-version.h"
#include "control.h"
#include "copy.h"
#include "trace.h"

const char *aoq_version(void)
{
	return aoq_full_version();
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
		{ "aoq_device_step", sizeof(struct aoq_device_step) },
	};
	for (size_t i = 0; name && i < sizeof(sizes) / sizeof(sizes[0]); i++)
		if (strcmp(name, sizes[i].name) == 0)
			return sizes[i].size;
	return 0;
}

/* How long a thread waiting for an answer polls the to-client ring before
 * it sleeps (docs/operating.md, "Clients"): AOQ_SPIN_US microseconds,
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
	int r = aoqc_size_ok(opts->size, sizeof(*opts), "aoq_options");
	if (r < 0)
		return r;
	if (opts->master_bits != 0 && opts->master_bits != 24 && opts->master_bits != 32)
		return aoq_set_error(-EINVAL, "aoq_options.master_bits %u: 0 or 32 (an fp32 master) or 24 (the 24-bit "
		                     "master)", opts->master_bits);
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
	h.arena_version = AOQ_ARENA_VERSION;
	h.version = (char *)aoq_full_version();
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
	r = aoqc_ctl_call(c, &env, AOQ__ENVELOPE__MSG_WELCOME, &rep);
	if (r < 0) {
		aoq_close(c);
		return r;
	}
	/* A daemon refuses a Hello of another protocol or arena; one that let it
	 * through (it predates the check) is refused here, both versions named. */
	const Aoq__Welcome *w = rep->welcome;
	if (w->protocol_version != AOQ_PROTOCOL_VERSION || w->arena_version != AOQ_ARENA_VERSION) {
		r = aoq_set_error(-EPROTONOSUPPORT,
		                  "aoqd at %s speaks protocol %u, arena %u; libaoq %s speaks protocol %u, arena %u: use "
		                  "libaoq and aoqd of one release", path, w->protocol_version, w->arena_version,
		                  aoq_full_version(), AOQ_PROTOCOL_VERSION, AOQ_ARENA_VERSION);
		aoq_envelope_free(rep);
		aoq_close(c);
		return r;
	}
	c->session_id = w->session_id;
	c->xfer_at = w->xfer_at;
	c->release_ok = w->release_tensors;
	aoq_envelope_free(rep);
	*out = c;
	return 0;
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
	if (c->sock >= 0 && !aoqc_failed(c)) {
		if (c->registered && aoq_sync(c, NULL) == 0) {
			pthread_mutex_lock(&c->ctl_lock);
			aoqc_report_spans(c); /* a trace in progress gets the last copies */
			pthread_mutex_unlock(&c->ctl_lock);
		}
		Aoq__Bye b = AOQ__BYE__INIT;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_BYE;
		env.bye = &b;
		aoq_send_frame(c->sock, &env, NULL, 0);
	}
	if (c->progress_running) {
		aoqc_ring(c->wake_fd);
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
		aoqc_evref_put(c, c->tensors[i].h2d);
		if (c->tensors[i].last_use)
			c->ops->event_release(c->be, c->tensors[i].last_use);
		free((char *)c->tensors[i].d.name);
	}
	for (uint32_t i = 0; c->slots && i < c->hdr.slots; i++)
		aoqc_evref_put(c, c->slots[i].h2d);
	free(c->slots);
	free(c->free_slots);
	if (c->arena) {
		if (c->be && c->registered)
			c->ops->unregister_host(c->be, c->arena, c->arena_size);
		munmap(c->arena, c->arena_size);
	}
	if (c->masters) {
		for (uint32_t k = 0; c->be && k < c->masters_n; k++) {
			uint64_t b = k ? c->masters_end[k - 1] : 0;
			if (c->masters_pinned & (1u << k))
				c->ops->unregister_host_ro(c->be, c->masters + b, c->masters_end[k] - b);
		}
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
