/* SPDX-License-Identifier: MIT */
/*
 * aoqctl trace SESSION: TraceRequest, then Trace frames until one says no
 * more, written as one Chrome trace (Perfetto) JSON file.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aoqctl.h"

static const char *span_name(int kind)
{
	switch (kind) {
	case AOQ__TRACE_SPAN_KIND__SPAN_D2H: return "D2H";
	case AOQ__TRACE_SPAN_KIND__SPAN_QUEUE_WAIT: return "queue wait";
	case AOQ__TRACE_SPAN_KIND__SPAN_CPU_UPDATE: return "CPU update";
	case AOQ__TRACE_SPAN_KIND__SPAN_H2D: return "H2D";
	default: return "unknown";
	}
}

/* Chrome trace-event lanes (tid): copies on their own lanes, each worker on
 * its own; queue waits overlap, so they are async events (b/e). */
enum { TID_D2H = 1, TID_H2D = 2, TID_WORKER0 = 100 };

static json_object *trace_meta(const char *what, uint64_t pid, int tid, const char *name)
{
	json_object *e = json_object_new_object();
	JADD(e, "name", json_object_new_string(what));
	JADD(e, "ph", json_object_new_string("M"));
	JADD(e, "pid", json_object_new_uint64(pid));
	JADD(e, "tid", json_object_new_int(tid));
	json_object *args = json_object_new_object();
	JADD(args, "name", ctl_jstring(name));
	JADD(e, "args", args);
	return e;
}

/* Adds the spans of one Trace frame; t0 is the first span's start. */
static void trace_add(json_object *events, const Aoq__Trace *t, char **names, size_t nnames, uint64_t t0,
                      uint64_t *next_id, uint32_t *max_worker)
{
	for (size_t i = 0; i < t->n_spans; i++) {
		const Aoq__TraceSpan *sp = t->spans[i];
		const char *tname = sp->tensor < nnames ? names[sp->tensor] : "?";
		double ts = (double)(sp->start_ns - t0) / 1e3, dur = (double)sp->duration_ns / 1e3;
		json_object *args = json_object_new_object();
		JADD(args, "step", json_object_new_uint64(sp->step));
		JADD(args, "tensor", ctl_jstring(tname));
		JADD(args, "offset", json_object_new_uint64(sp->offset));
		JADD(args, "count", json_object_new_uint64(sp->count));
		char label[160];
		snprintf(label, sizeof(label), "%s %s", span_name(sp->kind), tname);
		if (sp->kind == AOQ__TRACE_SPAN_KIND__SPAN_QUEUE_WAIT) {
			uint64_t id = (*next_id)++;
			for (int end = 0; end < 2; end++) {
				json_object *e = json_object_new_object();
				JADD(e, "name", ctl_jstring(label));
				JADD(e, "cat", json_object_new_string("queue"));
				JADD(e, "ph", json_object_new_string(end ? "e" : "b"));
				JADD(e, "id", json_object_new_uint64(id));
				JADD(e, "ts", ctl_jdouble_fmt(end ? ts + dur : ts, true));
				JADD(e, "pid", json_object_new_uint64(t->session));
				JADD(e, "tid", json_object_new_int(TID_WORKER0 - 1));
				if (!end)
					JADD(e, "args", json_object_get(args));
				json_object_array_add(events, e);
			}
			json_object_put(args);
			continue;
		}
		int tid = sp->kind == AOQ__TRACE_SPAN_KIND__SPAN_D2H   ? TID_D2H
		          : sp->kind == AOQ__TRACE_SPAN_KIND__SPAN_H2D ? TID_H2D
		                                                       : TID_WORKER0 + (int)(sp->worker % 4096);
		if (sp->kind == AOQ__TRACE_SPAN_KIND__SPAN_CPU_UPDATE && sp->worker + 1 > *max_worker)
			*max_worker = sp->worker + 1;
		json_object *e = json_object_new_object();
		JADD(e, "name", ctl_jstring(label));
		JADD(e, "cat", json_object_new_string(span_name(sp->kind)));
		JADD(e, "ph", json_object_new_string("X"));
		JADD(e, "ts", ctl_jdouble_fmt(ts, true));
		JADD(e, "dur", ctl_jdouble_fmt(dur, true));
		JADD(e, "pid", json_object_new_uint64(t->session));
		JADD(e, "tid", json_object_new_int(tid));
		JADD(e, "args", args);
		json_object_array_add(events, e);
	}
}

int ctl_run_trace(const char *path, uint64_t session, uint32_t steps, const char *output)
{
	int sock;
	int ret = ctl_observer_connect(path, &sock);
	if (ret != EXIT_OK)
		return ret;
	Aoq__TraceRequest req = AOQ__TRACE_REQUEST__INIT;
	req.session = session;
	req.steps = steps;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_TRACE_REQUEST;
	env.trace_request = &req;
	json_object *events = json_object_new_array();
	char **names = NULL;
	size_t nnames = 0;
	uint64_t t0 = 0, next_id = 1;
	uint32_t max_worker = 0;
	bool first = true;
	char *msg = NULL;
	Aoq__Envelope *rep = NULL;
	ret = EXIT_UNREACHABLE;
	int r = aoq_call(sock, &env, &rep, &msg);
	for (;;) {
		if (r < 0) {
			if (r == -EPROTO || r == -EPROTONOSUPPORT)
				fprintf(stderr, "aoqctl: aoqd at %s cannot record traces (it answered: %s)\n", path,
				        msg ? msg : strerror(-r));
			else if (msg)
				fprintf(stderr, "aoqctl: aoqd at %s refused the trace of session %" PRIu64 ": %s\n", path,
				        session, *msg ? msg : strerror(-r));
			else
				ctl_fail_unreachable(path, r, "trace request failed at", msg);
			goto out;
		}
		if (rep->msg_case != AOQ__ENVELOPE__MSG_TRACE || !rep->trace) {
			fprintf(stderr, "aoqctl: aoqd at %s answered TraceRequest with message %d, not Trace\n", path,
			        (int)rep->msg_case);
			goto out;
		}
		const Aoq__Trace *t = rep->trace;
		if (first) {
			char pname[200];
			char *job = ctl_clean_utf8(t->job);
			snprintf(pname, sizeof(pname), "session %" PRIu64 " (%s rank %" PRIu32 ")", t->session,
			         job ? job : "?", t->rank);
			free(job);
			json_object_array_add(events, trace_meta("process_name", t->session, 0, pname));
			json_object_array_add(events, trace_meta("thread_name", t->session, TID_D2H, "D2H copies"));
			json_object_array_add(events, trace_meta("thread_name", t->session, TID_H2D, "H2D copies"));
			json_object_array_add(events, trace_meta("thread_name", t->session, TID_WORKER0 - 1, "queue"));
			nnames = t->n_tensor_names;
			names = calloc(nnames ? nnames : 1, sizeof(*names));
			for (size_t i = 0; names && i < nnames; i++)
				names[i] = ctl_clean_utf8(t->tensor_names[i]);
			if (!names)
				nnames = 0;
			t0 = UINT64_MAX;
			for (size_t i = 0; i < t->n_spans; i++)
				if (t->spans[i]->start_ns < t0)
					t0 = t->spans[i]->start_ns;
			if (t0 == UINT64_MAX)
				t0 = 0;
			first = false;
		}
		trace_add(events, t, names, nnames, t0, &next_id, &max_worker);
		bool more = t->more;
		aoq_envelope_free(rep);
		rep = NULL;
		if (!more)
			break;
		free(msg);
		msg = NULL;
		r = aoq_recv_frame(sock, &rep, NULL, 0, NULL);
		if (r >= 0 && rep->msg_case == AOQ__ENVELOPE__MSG_ERROR && rep->error) {
			msg = strdup(rep->error->message ? rep->error->message : "");
			r = -EIO;
		}
	}
	ctl_say_bye(sock);
	for (uint32_t w = 0; w < max_worker && w < 4096; w++) {
		char wname[32];
		snprintf(wname, sizeof(wname), "worker %" PRIu32, w);
		json_object_array_add(events, trace_meta("thread_name", session, TID_WORKER0 + (int)w, wname));
	}
	json_object *root = json_object_new_object();
	JADD(root, "traceEvents", json_object_get(events));
	JADD(root, "displayTimeUnit", json_object_new_string("ms"));
	struct out o;
	if (ctl_out_open(&o, output) == 0) {
		const char *text = json_object_to_json_string_ext(root, JSON_C_TO_STRING_PLAIN);
		bool ok = text && fputs(text, o.f) >= 0 && fputc('\n', o.f) != EOF;
		if (ctl_out_close(&o, ok) == 0)
			ret = EXIT_OK;
	}
	json_object_put(root);
out:
	json_object_put(events);
	for (size_t i = 0; names && i < nnames; i++)
		free(names[i]);
	free(names);
	free(msg);
	aoq_envelope_free(rep);
	close(sock);
	return ret;
}
