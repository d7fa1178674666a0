/* SPDX-License-Identifier: MIT */
/*
 * aoqctl trace: a copy being timed.  Only while the daemon sets the
 * to-client ring's `trace` word; the backend writes the times, libaoq
 * reports finished spans (TraceSpans) before each StepEnd and before Bye.
 */
#include <stdlib.h>

#include "trace.h"

/* A pool entry for a copy to time, or NULL when the session is not traced
 * (the fast path: one relaxed load) or the pool is full.  Under c->lock. */
struct aoq_copy_time *aoqc_span_new(struct aoq_client *c, int kind, uint32_t t, uint64_t step, uint64_t offset,
                                    uint64_t count)
{
	if (!c->to_client.ring || !atomic_load_explicit(&c->to_client.ring->trace, memory_order_relaxed))
		return NULL;
	if (!c->spans && !(c->spans = calloc(TRACE_POOL, sizeof(*c->spans))))
		return NULL;
	for (uint32_t k = 0; k < TRACE_POOL; k++) {
		struct cspan *x = &c->spans[(c->span_next + k) % TRACE_POOL];
		if (x->used)
			continue;
		c->span_next = (c->span_next + k + 1) % TRACE_POOL;
		atomic_store_explicit(&x->tm.start_ns, 0, memory_order_relaxed);
		atomic_store_explicit(&x->tm.end_ns, 0, memory_order_relaxed);
		x->step = step;
		x->offset = offset;
		x->count = count;
		x->tensor = t;
		x->kind = kind;
		x->used = true;
		c->spans_used++;
		return &x->tm;
	}
	return NULL;
}

/* Sends the finished spans of the pool (one TraceSpans frame; the pool
 * holds at most what a frame may carry) and frees their entries.  Caller
 * holds ctl_lock. */
int aoqc_report_spans(struct aoq_client *c)
{
	pthread_mutex_lock(&c->lock);
	if (!c->spans_used) {
		pthread_mutex_unlock(&c->lock);
		return 0;
	}
	Aoq__TraceSpan *sp = calloc(TRACE_POOL, sizeof(*sp));
	Aoq__TraceSpan **spp = calloc(TRACE_POOL, sizeof(*spp));
	size_t n = 0;
	for (uint32_t i = 0; sp && spp && i < TRACE_POOL; i++) {
		struct cspan *x = &c->spans[i];
		uint64_t end = x->used ? atomic_load_explicit(&x->tm.end_ns, memory_order_acquire) : 0;
		if (!end)
			continue;
		uint64_t start = atomic_load_explicit(&x->tm.start_ns, memory_order_relaxed);
		x->used = false;
		c->spans_used--;
		if (start == 0 || start > end)
			continue;
		aoq__trace_span__init(&sp[n]);
		sp[n].step = x->step;
		sp[n].tensor = x->tensor;
		sp[n].kind = (Aoq__TraceSpanKind)x->kind;
		sp[n].start_ns = start;
		sp[n].duration_ns = end - start;
		sp[n].offset = x->offset;
		sp[n].count = x->count;
		spp[n] = &sp[n];
		n++;
	}
	pthread_mutex_unlock(&c->lock);
	int r = 0;
	if (n) {
		Aoq__TraceSpans m = AOQ__TRACE_SPANS__INIT;
		m.n_spans = n;
		m.spans = spp;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_TRACE_SPANS;
		env.trace_spans = &m;
		r = aoq_send_frame(c->sock, &env, NULL, 0);
		if (r < 0)
			aoq_set_error(r, "aoqd: send: %s", strerror(-r));
	}
	free(sp);
	free(spp);
	return r;
}
