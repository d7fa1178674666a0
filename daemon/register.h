/* SPDX-License-Identifier: MIT */
/* Registration (register.c): Register frames build the optimizer state
 * and the arena; SetHyperparams changes a group's. */
#ifndef AOQD_REGISTER_H
#define AOQD_REGISTER_H

#include <stdint.h>
#include <uv.h>

#include "aoq.pb-c.h"
#include "error.h"

struct aoqd_session;

/* One Register frame.  uid_state_bytes: the state the client's uid holds
 * in its other sessions (the quota counts it); on_doorbell: what runs when
 * the client rings (its data is the session). */
int aoqd_register(struct aoqd_session *s, const Aoq__Register *m, uint64_t uid_state_bytes, uv_poll_cb on_doorbell,
                  struct aoqd_error *err);
int aoqd_on_set_hyperparams(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);

#endif
