/* SPDX-License-Identifier: MIT */
/*
 * Traces (aoqctl trace): TraceRequest arms the recorder of a session the
 * asker may see (stats.c records the spans), TraceSpans adds the client's
 * timed copies, and the Trace frames go out once the traced steps have
 * ended or the session closes.  Loop thread.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "server.h"
#include "session.h"
#include "trace.h"
#include "wire.h"

#define TRACE_MAX_STEPS 1000000 /* aoqctl's bound; memory is bounded by spans */
#define TRACE_SPANS_PER_FRAME 8192 /* a span packs to < 100 bytes */
#define TRACE_NAMES_BYTES (512u << 10)

/* Sends the trace's spans to whoever asked (frames of at most 1 MiB, more on
 * all but the last) and ends the trace.  Names only the tensors it uses. */
void aoqd_trace_send(struct aoqd_session *s)
{
	struct aoqd_session *to = s->trace_to;
	if (!to)
		return;
	s->trace_to = NULL;
	aoqd_arena_set_trace(&s->arena, false);
	struct aoqd_trace t = aoqd_trace_take(&s->stats);
	if (t.full)
		aoqd_warn("session", "session %" PRIu64 ": trace cut at %zu spans", s->id, t.n);
	uint32_t nt = s->st.ntensors;
	uint32_t *map = calloc(nt ? nt : 1, sizeof(*map));
	char **names = calloc(nt ? nt : 1, sizeof(*names));
	Aoq__TraceSpan *sp = calloc(TRACE_SPANS_PER_FRAME, sizeof(*sp));
	Aoq__TraceSpan **spp = calloc(TRACE_SPANS_PER_FRAME, sizeof(*spp));
	if (!map || !names || !sp || !spp) {
		if (to->state != AOQD_CLOSING)
			aoqd_conn_send_error(&to->conn, AOQ__ERROR_CODE__NO_MEMORY, "out of memory for the trace", false);
		goto out;
	}
	uint32_t nnames = 0;
	size_t name_bytes = 0;
	for (size_t i = 0; i < t.n; i++) {
		uint32_t k = t.spans[i].tensor;
		if (k >= nt)
			continue;
		if (!map[k]) {
			const char *nm = s->st.tensors[k].name ? s->st.tensors[k].name : "";
			size_t len = strlen(nm) + 8;
			names[nnames] = (char *)(name_bytes + len <= TRACE_NAMES_BYTES ? nm : "?");
			name_bytes += len;
			map[k] = ++nnames;
		}
	}
	size_t i = 0;
	do {
		Aoq__Trace tr = AOQ__TRACE__INIT;
		tr.session = s->id;
		tr.job = s->conn.job ? s->conn.job : "";
		tr.rank = s->conn.rank;
		if (i == 0) {
			tr.n_tensor_names = nnames;
			tr.tensor_names = names;
		}
		size_t n = 0;
		for (; i < t.n && n < TRACE_SPANS_PER_FRAME; i++) {
			const struct aoqd_span *x = &t.spans[i];
			Aoq__TraceSpan *y = &sp[n];
			aoq__trace_span__init(y);
			y->step = x->step;
			y->tensor = x->tensor < nt ? map[x->tensor] - 1 : UINT32_MAX;
			y->kind = (Aoq__TraceSpanKind)x->kind;
			y->start_ns = x->start_ns;
			y->duration_ns = x->dur_ns;
			y->worker = x->worker;
			y->offset = x->offset;
			y->count = x->count;
			spp[n++] = y;
		}
		tr.n_spans = n;
		tr.spans = spp;
		tr.more = i < t.n;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_TRACE;
		env.trace = &tr;
		if (to->state == AOQD_CLOSING || aoqd_conn_send(&to->conn, &env) < 0)
			break;
	} while (i < t.n);
	aoqd_debug("session", "session %" PRIu64 ": trace of %zu spans sent to session %" PRIu64, s->id, t.n, to->id);
out:
	free(map);
	free(names);
	free(sp);
	free(spp);
	free(t.spans);
	aoqd_account_uncharge(s->account, s->trace_charged);
	s->trace_charged = 0;
	aoqd_session_unref(to);
}

/* The traced steps have all ended (loop thread). */
void aoqd_trace_check(struct aoqd_session *s)
{
	if (s->trace_to && s->state == AOQD_READY)
		aoqd_arena_set_trace(&s->arena, true); /* the client times its copies */
	if (s->trace_to && (s->stats.steps_done >= s->trace_done_at || s->trace_to->state == AOQD_CLOSING))
		aoqd_trace_send(s);
}

/* TraceSpans: the client's timed copies (hostile input: every span is
 * checked, a bad one fails the session).  Kept when the step is traced. */
int aoqd_on_trace_spans(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__TraceSpans *m = env->trace_spans;
	if (m->n_spans > AOQ_TRACE_SPANS_MAX)
		return AOQD_FAIL(err, INVALID, "TraceSpans: %zu spans (at most %u)", m->n_spans, AOQ_TRACE_SPANS_MAX);
	uint64_t now = aoqd_now_ns(), end;
	for (size_t i = 0; i < m->n_spans; i++) {
		const Aoq__TraceSpan *x = m->spans[i];
		if ((x->kind != AOQ__TRACE_SPAN_KIND__SPAN_D2H && x->kind != AOQ__TRACE_SPAN_KIND__SPAN_H2D) ||
		    x->tensor >= s->st.ntensors || x->count == 0 ||
		    !aoq_range_ok(x->offset, x->count, s->st.tensors[x->tensor].numel) || x->start_ns == 0 ||
		    __builtin_add_overflow(x->start_ns, x->duration_ns, &end) || end > now)
			return AOQD_FAIL(err, INVALID, "TraceSpans: span %zu (kind %d, tensor %u) is impossible", i,
			                 (int)x->kind, x->tensor);
	}
	pthread_mutex_lock(&s->stats.lock);
	for (size_t i = 0; s->stats.trace.on && i < m->n_spans; i++) {
		const Aoq__TraceSpan *x = m->spans[i];
		struct aoqd_span sp = { .step = x->step, .start_ns = x->start_ns, .dur_ns = x->duration_ns,
		                        .offset = x->offset, .count = x->count, .tensor = x->tensor,
		                        .kind = x->kind == AOQ__TRACE_SPAN_KIND__SPAN_D2H ? AOQD_SPAN_D2H : AOQD_SPAN_H2D };
		aoqd_trace_add(&s->stats, &sp);
	}
	pthread_mutex_unlock(&s->stats.lock);
	return AOQD_REPLIED; /* a report: no reply */
}

/* TraceRequest: record the next `steps` steps of a session the asker may
 * see; the Trace frames go out once they have ended. */
int aoqd_on_trace(struct aoqd_session *who, const Aoq__Envelope *env, struct aoqd_error *err)
{
	const Aoq__TraceRequest *m = env->trace_request;
	if (m->steps == 0 || m->steps > TRACE_MAX_STEPS)
		return AOQD_REFUSE(err, INVALID, "trace: steps %u is not in 1..%u", m->steps, TRACE_MAX_STEPS);
	struct aoqd_session *s = who->srv->sessions;
	while (s && s->id != m->session)
		s = s->next;
	if (!s || s->state == AOQD_OBSERVER || s->state == AOQD_HELLO || s->state == AOQD_CLOSING ||
	    s->state == AOQD_LEASED || !aoqd_session_may_see(who, s))
		return AOQD_REFUSE(err, NOT_FOUND, "no session %" PRIu64 " that you may trace", m->session);
	if (s == who)
		return AOQD_REFUSE(err, INVALID, "a session cannot trace itself");
	if (s->hub)
		return AOQD_REFUSE(err, INVALID, "traces of a replica group's members are not supported yet");
	if (s->trace_to)
		return AOQD_REFUSE(err, BUSY, "session %" PRIu64 " is being traced already", m->session);
	/* Step next_step may be under way, and the client may already be copying
	 * the one after it (next_step moves when the loop reads a StepEnd), with
	 * its copies untimed: the trace starts at the step after that.  The client
	 * times its copies from now on, so that step's are all timed. */
	uint64_t first = s->steps.next_step + 2;
	if (s->state == AOQD_READY)
		aoqd_arena_set_trace(&s->arena, true);
	/* The recorder may grow to its bound: charged to the traced uid
	 * until the trace ends. */
	uint64_t bytes = aoqd_page_round((uint64_t)AOQD_TRACE_MAX_SPANS * sizeof(struct aoqd_span));
	if (aoqd_account_charge(s->account, bytes, s->srv->cfg.max_state_bytes_per_uid) < 0)
		return AOQD_REFUSE(err, QUOTA, "uid %u: a trace's buffer (%" PRIu64 " bytes) would pass its quota of %"
		                   PRIu64 " bytes (max_state_bytes_per_uid)", (unsigned)s->conn.uid, bytes,
		                   aoqd_account_limit(s->account, s->srv->cfg.max_state_bytes_per_uid));
	if (aoqd_trace_start(&s->stats, first, first + m->steps - 1) < 0) {
		aoqd_account_uncharge(s->account, bytes);
		return AOQD_REFUSE(err, BUSY, "session %" PRIu64 " is being traced already", m->session);
	}
	s->trace_charged = bytes;
	/* steps_done counts StepEnded replies: the step before next_step may
	 * still be ending (end_pending), then next_step, then the traced ones,
	 * the step skipped above, then one more: the client reports a step's
	 * parameter copies (H2D) with the next StepEnd, once they have landed. */
	s->trace_done_at = s->stats.steps_done + (s->steps.end_pending ? 1 : 0) + 2 + m->steps + 1;
	aoqd_session_ref(who);
	s->trace_to = who;
	aoqd_info("session", "session %" PRIu64 ": tracing steps %" PRIu64 "..%" PRIu64 " for session %" PRIu64, s->id,
	          first, first + m->steps - 1, who->id);
	return AOQD_REPLIED;
}
