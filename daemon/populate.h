/* SPDX-License-Identifier: MIT */
/*
 * A new state's memory faulted in on the worker pool (populate.c), ahead
 * of its first use: the state is mapped unpopulated (statemem.c, lock_state),
 * so without this each LoadState waits for the kernel to zero the master's
 * fresh pages, and the first step for the moments'.
 */
#ifndef AOQD_POPULATE_H
#define AOQD_POPULATE_H

#include <stdbool.h>

struct aoqd_session;

/*
 * Faults in s's state, just allocated (every tensor's master, moments and
 * scales; not the undo copies, which the undo swap remaps), in chunks on
 * the pool, behind every other task of s: the masters first, in the order
 * the trainer loads them, then the rest.  The chunks hold s until the last
 * has run; those that run once s is dead or aoqd_populate_stop(s) was
 * called do nothing.  A failure is logged once, and what is left faults
 * in at first use, as without this.  The thread that owns s->st now (the
 * loop, or a registration's build thread).
 */
void aoqd_populate_start(struct aoqd_session *s);
/* What is left of s's populating is dropped (any thread). */
void aoqd_populate_stop(struct aoqd_session *s);
/* The same for s's new arena (of 64 MiB or more): its pages faulted in on
 * the pool, charged to aoqd's memory as the updates' first writes were,
 * while the trainer maps it and loads or reads back its parameters, so
 * that its gradients' copies and the updates' writes in the first step
 * meet pages that exist instead of trapping per 4 KiB shmem page (after a
 * restart the resumed session's arena is new: tests/bench/RESULTS.md,
 * "Restart", "The arena faulted in on the pool"). */
void aoqd_populate_arena(struct aoqd_session *s);
/* Tests: fault pages in by touching them, as on a kernel without
 * MADV_POPULATE_WRITE (populate.c), or not.  Process-wide. */
void aoqd_populate_touch(bool on);

#endif
