/* SPDX-License-Identifier: MIT */
/* State transfer (transfer.c): LoadState and ReadState through the arena's
 * transfer area, on the worker pool; TensorSteps; ReleaseTensors. */
#ifndef AOQD_TRANSFER_H
#define AOQD_TRANSFER_H

#include <stdbool.h>

#include "aoq.pb-c.h"
#include "error.h"

struct aoqd_session;

int aoqd_on_load_state(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);
int aoqd_on_read_state(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);
int aoqd_on_tensor_steps(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);
int aoqd_on_release_tensors(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);
/* After a wake: answers a finished transfer; true when it did (the
 * connection reads again). */
bool aoqd_transfer_poll(struct aoqd_session *s);

#endif
