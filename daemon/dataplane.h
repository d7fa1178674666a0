/* SPDX-License-Identifier: MIT */
/* The data plane (dataplane.c): ring records -> jobs of chunks on the
 * worker pool -> param records. */
#ifndef AOQD_DATAPLANE_H
#define AOQD_DATAPLANE_H

#include <stdbool.h>

#include "error.h"

struct aoqd_session;

/* Takes records off the to-daemon ring (loop thread).  0, or -errno with
 * err filled (a bad record, a corrupt ring, no memory).  A replica group's
 * member: its own ring, into its hub's state (docs/design.md, "Replica
 * groups"). */
int aoqd_drain(struct aoqd_session *s, struct aoqd_error *err);
/* Records of s may wait in a ring for room for their answers (a replica
 * group's hub: in any member's ring). */
bool aoqd_space_wait(const struct aoqd_session *s);
/* s's step is open from its first accepted gradient to its StepEnded, or to
 * the session's end (aoqd_pool_step_open: the snapshot writer writes while
 * no step is open anywhere).  Idempotent.  Loop thread. */
void aoqd_step_open(struct aoqd_session *s);
void aoqd_step_close(struct aoqd_session *s);
/* Deferred sessions: starts the ending step's updates once its norm is
 * summed (loop thread).  True when the step was released now. */
bool aoqd_release_step(struct aoqd_session *s);
/* Drops the jobs of a closing session that wait in a deferred list. */
void aoqd_drop_deferred(struct aoqd_session *s);

#endif
