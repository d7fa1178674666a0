/* SPDX-License-Identifier: MIT */
/*
 * Timed copies for aoqctl trace (trace.c): a fixed pool of spans, filled
 * while the daemon sets the to-client ring's trace word, reported to aoqd
 * as TraceSpans.
 */
#ifndef AOQ_CLIENT_TRACE_H
#define AOQ_CLIENT_TRACE_H

#include "client.h"

/* A pool entry for a copy to time, or NULL (not traced, or the pool is
 * full).  Caller holds c->lock. */
struct aoq_copy_time *aoqc_span_new(struct aoq_client *c, int kind, uint32_t t, uint64_t step, uint64_t offset,
                                    uint64_t count);
/* Sends the finished spans (one TraceSpans frame) and frees their entries.
 * Caller holds ctl_lock. */
int aoqc_report_spans(struct aoq_client *c);

#endif
