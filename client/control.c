/* SPDX-License-Identifier: MIT */
/*
 * libaoq's control socket: one request and its reply at a time (under
 * ctl_lock), the session's sticky error, the waits with a deadline and the
 * doorbells.  It calls no other file of libaoq.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "control.h"

/* Marks the session broken (caller holds c->lock) and wakes every waiter. */
int aoqc_fail(struct aoq_client *c, int err, const char *fmt, ...)
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

int aoqc_session_error(struct aoq_client *c)
{
	return aoq_set_error(c->error, "aoq session ended: %s", c->errmsg);
}

/* The sticky error, for a thread that does not hold c->lock: the progress
 * thread may be failing the session right now (the tsan phase of
 * tests/run-all.sh found the unlocked read). */
int aoqc_failed(struct aoq_client *c)
{
	pthread_mutex_lock(&c->lock);
	int r = c->error;
	pthread_mutex_unlock(&c->lock);
	return r;
}

/* aoqc_session_error() for a thread that does not hold c->lock; 0 when the
 * session is fine. */
int aoqc_session_error_locked(struct aoq_client *c)
{
	pthread_mutex_lock(&c->lock);
	int r = c->error ? aoqc_session_error(c) : 0;
	pthread_mutex_unlock(&c->lock);
	return r;
}

/* Sleeps on c->cond (caller holds c->lock) until woken or until the call's
 * deadline; past the deadline the session fails with -ETIMEDOUT, which ends
 * every wait loop (they all test c->error). */
void aoqc_wait_daemon(struct aoq_client *c, struct deadline *dl)
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
		aoqc_fail(c, -ETIMEDOUT, "aoqd did not answer within %u ms (stalled or overloaded; "
		          "aoq_options.timeout_ms sets the deadline)", c->o.timeout_ms);
}

/* Rings a doorbell: aoqd's are sockets (send: no SIGPIPE when the daemon
 * is gone, never blocking); our own wake_fd is an eventfd. */
void aoqc_ring(int fd)
{
	uint64_t one = 1;
	ssize_t r = send(fd, &one, sizeof(one), MSG_NOSIGNAL | MSG_DONTWAIT);
	if (r < 0 && errno == ENOTSOCK)
		r = write(fd, &one, sizeof(one));
	(void)r;
}

/* Sends env and returns the reply of the wanted kind; StepEnded replies of
 * earlier StepEnd requests that arrive first are consumed on the way.
 * Caller holds ctl_lock. */
int aoqc_ctl_recv(struct aoq_client *c, int want, Aoq__Envelope **out, int *fds, int *nfds)
{
	for (;;) {
		Aoq__Envelope *rep;
		int r = aoq_recv_frame(c->sock, &rep, fds, fds ? AOQ_MAX_FDS : 0, nfds);
		if (r == -EAGAIN || r == -EWOULDBLOCK) {
			/* SO_RCVTIMEO: the deadline passed mid-request; the reply
			 * may still come, so the connection is out of step. */
			pthread_mutex_lock(&c->lock);
			aoqc_fail(c, -ETIMEDOUT, "aoqd did not answer within %u ms", c->o.timeout_ms);
			pthread_mutex_unlock(&c->lock);
			return aoq_set_error(-ETIMEDOUT, "aoqd did not answer within %u ms (stalled or overloaded; "
			                     "aoq_options.timeout_ms sets the deadline)", c->o.timeout_ms);
		}
		if (r < 0) {
			pthread_mutex_lock(&c->lock);
			/* The progress thread read why the daemon closed (closed_why):
			 * that is the answer. */
			int why = c->closed_error ? aoqc_session_error(c) : 0;
			aoqc_fail(c, r, "control socket: %s", strerror(-r));
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
			aoqc_fail(c, -EPROTO, "unexpected reply %d", (int)rep->msg_case);
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

/* Sends env: 0, -ETIMEDOUT (the daemon took nothing: the session failed,
 * the error set), or aoq_send_frame's error (-EPIPE, -ECONNRESET: the
 * daemon closed the connection). */
static int send_request(struct aoq_client *c, const Aoq__Envelope *env)
{
	int r = aoq_send_frame(c->sock, env, NULL, 0);
	if (r == -EAGAIN || r == -EWOULDBLOCK) {
		pthread_mutex_lock(&c->lock);
		aoqc_fail(c, -ETIMEDOUT, "aoqd did not take a request within %u ms", c->o.timeout_ms);
		pthread_mutex_unlock(&c->lock);
		return aoq_set_error(-ETIMEDOUT, "aoqd did not take a request within %u ms", c->o.timeout_ms);
	}
	return r;
}

int aoqc_ctl_send(struct aoq_client *c, const Aoq__Envelope *env)
{
	int r = aoqc_session_error_locked(c);
	if (r < 0)
		return r;
	r = send_request(c, env);
	if (r == -EPIPE || r == -ECONNRESET)
		return 0; /* the read that follows says why */
	if (r < 0 && r != -ETIMEDOUT)
		return aoq_set_error(r, "aoqd: send: %s", strerror(-r));
	return r;
}

int aoqc_ctl_call(struct aoq_client *c, const Aoq__Envelope *env, int want, Aoq__Envelope **out)
{
	int r = aoqc_session_error_locked(c);
	if (r < 0)
		return r;
	r = send_request(c, env);
	if (r == -ETIMEDOUT)
		return r;
	if (r == -EPIPE || r == -ECONNRESET) {
		/* The daemon closed the connection, perhaps after saying why
		 * (a QUOTA refusal): an Error waiting to be read wins. */
		int e = aoqc_ctl_recv(c, want, out, NULL, NULL);
		if (e < 0 && e != -EPIPE && e != -ECONNRESET)
			return e;
	}
	if (r < 0)
		return aoq_set_error(r, "aoqd: send: %s", strerror(-r));
	return aoqc_ctl_recv(c, want, out, NULL, NULL);
}

/* A public struct's size field against the layout this library knows. */
int aoqc_size_ok(uint32_t size, size_t want, const char *what)
{
	if (size == want)
		return 0;
	return aoq_set_error(-EINVAL, "struct %s has size %u, this libaoq (ABI %d) knows %zu: initialise it "
	                     "with its AOQ_*_INIT or rebuild against this <aoq/aoq.h>",
	                     what, size, AOQ_ABI_VERSION, want);
}
