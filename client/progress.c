/* SPDX-License-Identifier: MIT */
/*
 * The to-client ring: a progress thread sleeps on the daemon's doorbell,
 * takes param records and starts the copies back to the device; a thread
 * waiting for an answer polls the ring a short while first and takes them
 * itself (aoqc_spin_answers).  Every record is checked against what was
 * pushed before it is acted on.
 */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "progress.h"
#include "control.h"
#include "copy.h"

static void handle_record(struct aoq_client *c, const struct aoq_rec *r)
{
	struct tensor *x = &c->tensors[r->tensor];
	pthread_mutex_lock(&c->lock);
	if (c->slots) {
		struct slot *sl = &c->slots[r->slot];
		if (r->status == AOQ_REC_UPDATED && x->master_area)
			aoqc_copy_param(c, x, x->master_area + r->offset * x->psize, r->offset, r->count, NULL, r->step);
		else if (r->status == AOQ_REC_UPDATED)
			aoqc_copy_param(c, x, sl->param_area, r->offset, r->count, sl, r->step);
		sl->busy = false;
		c->free_slots[c->nfree++] = r->slot;
	} else if (r->status == AOQ_REC_UPDATED) {
		if (c->o.delayed_update) {
			/* Lands with the tensor's next push (or aoq_flush). */
			x->pending = true;
			x->pending_step = r->step;
		} else {
			aoqc_copy_param(c, x, (x->master_area ? x->master_area : x->param_area) + r->offset * x->psize, r->offset,
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
bool aoqc_param_answered(const struct aoq_client *c, const struct tensor *x)
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
			aoqc_fail(c, -EPROTO, "the daemon's ring counter is corrupt");
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
			aoqc_fail(c, -EPROTO, "the daemon sent a bad record (tensor %u)", r.tensor);
			pthread_mutex_unlock(&c->lock);
			return false;
		}
		aoq_ring_pop(&c->to_client);
		if (aoq_ring_producer_waiting(&c->to_client))
			aoqc_ring(c->bell_out);
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
			aoqc_fail(c, r ? r : -EIO, "aoqd: %s: %s", aoq_error_name(rep->error->code), rep->error->message);
			pthread_mutex_unlock(&c->lock);
		}
		aoq_envelope_free(rep);
		if (err)
			break;
	}
	pthread_mutex_unlock(&c->ctl_lock);
}

void *aoqc_progress_main(void *arg)
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
				aoqc_fail(c, -ECONNRESET, "aoqd closed the doorbell (see its log)");
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
			aoqc_fail(c, -ECONNRESET, "aoqd closed the session (see its log, or the reply to the next request)");
			pthread_mutex_unlock(&c->lock);
			break;
		}
	}
	return NULL;
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
bool aoqc_spin_answers(struct aoq_client *c, const struct tensor *x)
{
	if (!c->spin_ns || c->spinning || !c->to_client.ring)
		return false;
	c->spinning = true;
	pthread_mutex_unlock(&c->lock);
	pthread_mutex_lock(&c->drain_lock);
	aoq_ring_set_spinning(&c->to_client, true);
	uint64_t budget = c->spin_polls++ % SPIN_PROBE == 0 ? c->spin_ns : c->spin_budget_ns;
	uint64_t end = aoq_mono_ns() + budget;
	bool ok = true, done = false;
	for (unsigned i = 1;; i++) {
		if (atomic_load_explicit(&c->to_client.ring->head, memory_order_acquire) != c->to_client.tail) {
			if (!(ok = drain_ring(c)))
				break;
			pthread_mutex_lock(&c->lock);
			done = c->error || aoqc_param_answered(c, x);
			pthread_mutex_unlock(&c->lock);
			if (done)
				break;
		}
		if (i % 64 == 0) {
			if (aoq_mono_ns() >= end)
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
