/* SPDX-License-Identifier: MIT */
/*
 * aoqctl's Prometheus text exposition format 0.0.4, written line by line.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "aoq-version.h"
#include "aoqctl.h"

/* A label value: valid UTF-8 with \\, \" and \n escaped. */
static void prom_label_value(FILE *f, const char *v)
{
	char *c = ctl_clean_utf8(v);
	for (const char *p = c ? c : ""; *p; p++) {
		if (*p == '\\' || *p == '"')
			fputc('\\', f);
		fputc(*p, f);
	}
	free(c);
}

static void prom_head(FILE *f, const char *name, const char *type, const char *help)
{
	fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void prom_value(FILE *f, double v)
{
	if (isnan(v))
		fputs("NaN", f);
	else if (isinf(v))
		fputs(v > 0 ? "+Inf" : "-Inf", f);
	else if (v == floor(v) && fabs(v) < 1e15)
		fprintf(f, "%.0f", v);
	else
		fprintf(f, "%.6g", v);
}

/* A daemon-wide family: one sample, no labels. */
static void prom_daemon(FILE *f, const char *name, const char *type, const char *help, double v)
{
	prom_head(f, name, type, help);
	fputs(name, f);
	fputc(' ', f);
	prom_value(f, v);
	fputc('\n', f);
}

static void prom_session_labels(FILE *f, const Aoq__SessionStats *s)
{
	fprintf(f, "{session=\"%" PRIu64 "\",job=\"", s->id);
	prom_label_value(f, s->job);
	fprintf(f, "\",rank=\"%" PRIu32 "\",uid=\"%" PRIu32 "\"", s->rank, s->uid);
}

/* One metric family with a sample per session. */
static void prom_session_family(FILE *f, const Aoq__Stats *st, const char *name, const char *type,
                                const char *help, double (*get)(const Aoq__SessionStats *))
{
	if (st->n_sessions == 0)
		return;
	prom_head(f, name, type, help);
	for (size_t i = 0; i < st->n_sessions; i++) {
		fputs(name, f);
		prom_session_labels(f, st->sessions[i]);
		fputs("} ", f);
		prom_value(f, get(st->sessions[i]));
		fputc('\n', f);
	}
}

/* A summary per session: the p50 and p99 of a latency histogram, its sum
 * and its count (record: the records' histogram, else the chunks'). */
static void prom_session_summary(FILE *f, const Aoq__Stats *st, const char *name, const char *help, bool record)
{
	if (st->n_sessions == 0)
		return;
	prom_head(f, name, "summary", help);
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		double p50 = record ? s->record_p50_us : s->chunk_p50_us;
		double p99 = record ? s->record_p99_us : s->chunk_p99_us;
		for (int q = 0; q < 2; q++) {
			fputs(name, f);
			prom_session_labels(f, s);
			fprintf(f, ",quantile=\"%s\"} ", q ? "0.99" : "0.5");
			prom_value(f, (q ? p99 : p50) / 1e6);
			fputc('\n', f);
		}
		fprintf(f, "%s_sum", name);
		prom_session_labels(f, s);
		fputs("} ", f);
		prom_value(f, record ? s->record_latency_sum_seconds : s->chunk_latency_sum_seconds);
		fprintf(f, "\n%s_count", name);
		prom_session_labels(f, s);
		fputs("} ", f);
		prom_value(f, (double)(record ? s->record_latency_count : s->chunk_latency_count));
		fputc('\n', f);
	}
}

#define GETTER(fname, expr) \
	static double fname(const Aoq__SessionStats *s) { return (double)(expr); }
GETTER(get_tensors, s->tensors)
GETTER(get_released, s->tensors_released)
GETTER(get_parameters, s->parameters)
GETTER(get_steps, s->steps)
GETTER(get_bytes_in, s->bytes_in)
GETTER(get_bytes_out, s->bytes_out)
GETTER(get_cpu, s->optimizer_cpu_seconds)
GETTER(get_chunks, s->chunks)
GETTER(get_state, s->state_bytes)
GETTER(get_arena, s->arena_bytes)

int ctl_print_stats_prometheus(const struct view *v, FILE *f)
{
	const Aoq__Stats *st = v->st;
	prom_head(f, "aoq_daemon_info", "gauge",
	          "aoqd's release and build, the kernel in use, and aoqctl's release and build (always 1).");
	fputs("aoq_daemon_info{version=\"", f);
	prom_label_value(f, st->version);
	fputs("\",aoqctl_version=\"", f);
	prom_label_value(f, aoq_full_version());
	fputs("\",kernel=\"", f);
	prom_label_value(f, st->kernel);
	fputs("\"} 1\n", f);
	prom_daemon(f, "aoq_daemon_threads", "gauge", "Worker threads of aoqd.", st->threads);
	prom_daemon(f, "aoq_daemon_locked_memory_bytes", "gauge", "Optimizer state locked in memory (mlock).",
	            (double)st->locked_bytes);
	prom_daemon(f, "aoq_daemon_resident_memory_bytes", "gauge", "Resident set size of aoqd.", (double)st->rss_bytes);
	prom_daemon(f, "aoq_daemon_uptime_seconds", "gauge", "Seconds since aoqd started.", st->uptime_seconds);
	prom_daemon(f, "aoq_daemon_loop_spin_setting_seconds", "gauge",
	            "How long the loop polls a session's ring after a doorbell (loop_spin_us; 0: off).",
	            st->loop_spin_us / 1e6);
	prom_daemon(f, "aoq_daemon_loop_spin_seconds_total", "counter", "Time the loop spent polling rings.",
	            st->loop_spin_seconds);
	prom_daemon(f, "aoq_daemon_loop_spin_takes_total", "counter",
	            "Polls of the spinning loop that took records (doorbells not rung).", (double)st->loop_spin_takes);
	prom_daemon(f, "aoq_daemon_loop_spin_busy_total", "counter",
	            "Doorbells after which the loop did not spin: tasks were waiting for a worker.",
	            (double)st->loop_spin_busy);
	prom_head(f, "aoq_stats_timestamp_seconds", "gauge", "When these figures were taken (Unix time).");
	fprintf(f, "aoq_stats_timestamp_seconds %.3f\n", v->timestamp);
	prom_head(f, "aoq_sessions", "gauge", "Training sessions visible to the caller.");
	fprintf(f, "aoq_sessions %zu\n", st->n_sessions);

	if (st->n_sessions) {
		prom_head(f, "aoq_session_info", "gauge", "One per session: device, state and state precision (always 1).");
		for (size_t i = 0; i < st->n_sessions; i++) {
			const Aoq__SessionStats *s = st->sessions[i];
			fputs("aoq_session_info", f);
			prom_session_labels(f, s);
			fputs(",device=\"", f);
			prom_label_value(f, s->device);
			fputs("\",state=\"", f);
			prom_label_value(f, s->state);
			fprintf(f, "\",precision=\"%s\"} 1\n", ctl_precision_name(s->precision, s->master_bits));
		}
	}
	prom_session_family(f, st, "aoq_session_tensors", "gauge", "Tensors registered by the session.", get_tensors);
	prom_session_family(f, st, "aoq_session_tensors_released", "gauge",
	                    "Tensors whose state the trainer took back (ReleaseTensors): not in state_bytes.", get_released);
	prom_session_family(f, st, "aoq_session_parameters", "gauge", "Parameters (elements) registered by the session.",
	                    get_parameters);
	prom_session_family(f, st, "aoq_session_steps_total", "counter", "Optimizer steps completed.", get_steps);
	prom_session_family(f, st, "aoq_session_bytes_in_total", "counter", "Gradient bytes read from the arena.",
	                    get_bytes_in);
	prom_session_family(f, st, "aoq_session_bytes_out_total", "counter",
	                    "Parameter bytes made ready for the trainer (in the arena, or its masters memfd).", get_bytes_out);
	prom_session_family(f, st, "aoq_session_optimizer_cpu_seconds_total", "counter",
	                    "CPU time spent in the optimizer kernels for the session.", get_cpu);
	prom_session_family(f, st, "aoq_session_chunks_total", "counter", "Update chunks run by the workers.", get_chunks);
	prom_session_family(f, st, "aoq_session_state_bytes", "gauge", "Optimizer state held for the session.", get_state);
	prom_session_family(f, st, "aoq_session_arena_bytes", "gauge", "Size of the session's shared-memory arena.",
	                    get_arena);
	prom_session_summary(f, st, "aoq_session_chunk_latency_seconds",
	                     "Chunk update latency over the session's life (quantiles of log2 buckets, 8 per octave).",
	                     false);
	prom_session_summary(f, st, "aoq_session_record_latency_seconds",
	                     "Gradient record accepted to parameter record posted, over the session's life.", true);
	return ferror(f) ? -EIO : 0;
}
