/* SPDX-License-Identifier: MIT */
/* Traces (trace.c; aoqctl trace).  Loop thread. */
#ifndef AOQD_TRACE_H
#define AOQD_TRACE_H

#include "aoq.pb-c.h"
#include "error.h"

struct aoqd_session;

/* TraceRequest: records the next steps of a session the asker may see. */
int aoqd_on_trace(struct aoqd_session *who, const Aoq__Envelope *env, struct aoqd_error *err);
/* TraceSpans: the client's timed copies (hostile input: every span is
 * checked, a bad one fails the session). */
int aoqd_on_trace_spans(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);
/* Sends s's trace to whoever asked and ends it (no-op without one). */
void aoqd_trace_send(struct aoqd_session *s);
/* Sends s's trace once its traced steps have all ended. */
void aoqd_trace_check(struct aoqd_session *s);

#endif
