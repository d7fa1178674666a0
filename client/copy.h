/* SPDX-License-Identifier: MIT */
/*
 * The backends' copies (copy.c): a gradient from the device into the arena,
 * whose record goes to the daemon when the copy completes; an updated
 * parameter from the arena (or the master) back to the device; the events
 * that say when they landed.  No backend call is made under c->lock.
 */
#ifndef AOQ_CLIENT_COPY_H
#define AOQ_CLIENT_COPY_H

#include "client.h"

/* Drops a reference to a shared event.  Caller holds c->lock. */
void aoqc_evref_put(struct aoq_client *c, struct evref *r);
/* Starts the copy of an updated range to the device; the event goes to
 * tensor x (and to slot sl, if any).  Caller holds c->lock (dropped around
 * the backend call). */
void aoqc_copy_param(struct aoq_client *c, struct tensor *x, const uint8_t *src, uint64_t offset, uint64_t count,
                     struct slot *sl, uint64_t step);
/* Starts one gradient copy into the arena; rec goes to the daemon when it
 * is done (and after `after`, with ops->d2h_after).  Caller holds c->lock
 * (dropped around the backend call). */
int aoqc_start_copy(struct aoq_client *c, struct tensor *x, uint8_t *dst, const uint8_t *src,
                    const struct aoq_rec *rec, struct aoq_event *after);
/* Waits for ev on the host or on stream, then drops the reference (NULL:
 * nothing to wait for).  Caller does not hold c->lock. */
int aoqc_wait_event(struct aoq_client *c, struct evref *ev, void *stream, bool host);

#endif
