/* SPDX-License-Identifier: MIT */
/*
 * libaoq's control socket and the session's sticky error (control.c).  The
 * bottom of libaoq: it calls no other file of the library.
 */
#ifndef AOQ_CLIENT_CONTROL_H
#define AOQ_CLIENT_CONTROL_H

#include "client.h"

/* Marks the session broken (caller holds c->lock) and wakes every waiter;
 * the first error sticks.  Returns err. */
int aoqc_fail(struct aoq_client *c, int err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The sticky error as the calling thread's aoq_last_error(); caller holds
 * c->lock. */
int aoqc_session_error(struct aoq_client *c);
/* The sticky error (0: none), for a thread that does not hold c->lock. */
int aoqc_failed(struct aoq_client *c);
/* aoqc_session_error() for a thread that does not hold c->lock; 0 when the
 * session is fine. */
int aoqc_session_error_locked(struct aoq_client *c);
/* Sleeps on c->cond (caller holds c->lock) until woken or the call's
 * deadline, past which the session fails with -ETIMEDOUT. */
void aoqc_wait_daemon(struct aoq_client *c, struct deadline *dl);
/* Rings a doorbell (aoqd's socket or our own eventfd). */
void aoqc_ring(int fd);
/* Reads the reply of kind want (StepEnded replies of earlier StepEnds are
 * taken on the way).  Caller holds ctl_lock. */
int aoqc_ctl_recv(struct aoq_client *c, int want, Aoq__Envelope **out, int *fds, int *nfds);
/* Sends env and reads its reply (aoqc_ctl_recv).  Caller holds ctl_lock. */
int aoqc_ctl_call(struct aoq_client *c, const Aoq__Envelope *env, int want, Aoq__Envelope **out);
/* Sends env only; its reply is read later (aoqc_ctl_recv), so that the
 * daemon works on it meanwhile.  A connection the daemon closed is left to
 * that read, which reports why.  Caller holds ctl_lock. */
int aoqc_ctl_send(struct aoq_client *c, const Aoq__Envelope *env);
/* A public struct's size field against the layout this library knows. */
int aoqc_size_ok(uint32_t size, size_t want, const char *what);

#endif
