/* SPDX-License-Identifier: MIT */
/* Registration (register.c): Register frames build the optimizer state
 * and the arena; SetHyperparams changes a group's. */
#ifndef AOQD_REGISTER_H
#define AOQD_REGISTER_H

#include "aoq.pb-c.h"
#include "error.h"

struct aoqd_session;

#include <stdint.h>

/* One Register frame.  uid_state_bytes: the state the client's uid holds
 * in its other sessions (the quota counts it). */
int aoqd_register(struct aoqd_session *s, const Aoq__Register *m, uint64_t uid_state_bytes, struct aoqd_error *err);
int aoqd_on_set_hyperparams(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);

#endif
