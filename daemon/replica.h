/* SPDX-License-Identifier: MIT */
/* Replica groups (replica.c; docs/design.md, "Replica groups").  Loop
 * thread. */
#ifndef AOQD_REPLICA_H
#define AOQD_REPLICA_H

#include <stdbool.h>

#include "error.h"

struct aoqd_session;

/* aoqd_replica_adopt's answer when a member joined its group: registered
 * and answered. */
#define AOQD_GROUP_JOINED 3

/* The registration's adopt callback (register.h, aoqd_adopt_fn): a
 * replica group's member joins its group (AOQD_GROUP_JOINED); any other
 * trainer resumes the leased state of its key (aoqd_lease_resume). */
int aoqd_replica_adopt(struct aoqd_session *s, struct aoqd_error *err);

/* Member m leaves its group (closing or failing).  A clean leave (Bye with
 * the group between steps) ends the group's steps: the others may still
 * read state, and get PEER_LOST at their next record or StepEnd.  Any other
 * leave stops the group's workers, so no member waits on an update that
 * will not come, and returns true: the caller fails the other members now.
 * The group's state goes with its last member, unless a lost trainer
 * (AOQD_LEAVE_LOST) broke a group with a lease (the open step is rolled
 * back), so a partial step is never kept. */
enum aoqd_leave { AOQD_LEAVE_BYE, AOQD_LEAVE_LOST, AOQD_LEAVE_FAILED };
bool aoqd_replica_leave(struct aoqd_session *m, enum aoqd_leave how);
/* The 1 s sampler's look at hub h: true when the group has waited
 * replica_wait_seconds for a local rank that has not joined, or has sent
 * nothing of a step another member began; the group is broken then, and
 * rep->why names the missing ranks (the caller fails the members with
 * PEER_LOST). */
bool aoqd_replica_overdue(struct aoqd_session *h, uint64_t now);
/* A member closes (after aoqd_replica_leave): its reference on the hub
 * goes; the last member's close takes the hub off the list. */
void aoqd_replica_close(struct aoqd_session *m);

#endif
