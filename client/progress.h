/* SPDX-License-Identifier: MIT */
/*
 * The to-client ring's consumer (progress.c): records are checked against
 * what was pushed, then answered (the parameter's copy started).  The
 * progress thread sleeps on the daemon's doorbell; a waiting thread polls
 * the ring a short while first (aoqc_spin_answers).  One consumer at a time
 * (drain_lock).
 */
#ifndef AOQ_CLIENT_PROGRESS_H
#define AOQ_CLIENT_PROGRESS_H

#include "client.h"

/* Whether tensor x's updated parameter has come (caller holds c->lock). */
bool aoqc_param_answered(const struct aoq_client *c, const struct tensor *x);
/* The progress thread (pthread_create's start routine; arg: the client). */
void *aoqc_progress_main(void *arg);
/* Polls the ring for x's answers for at most the spin budget.  Caller holds
 * c->lock (dropped meanwhile); false when it did not poll. */
bool aoqc_spin_answers(struct aoq_client *c, const struct tensor *x);

#endif
