/* SPDX-License-Identifier: MIT */
/*
 * aoqctl's JSON format, built with json-c; the helpers here also build the
 * trace's Chrome trace JSON.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "aoq-version.h"
#include "aoqctl.h"

/* A number printed short (%.6g, or fmt); JSON null when not finite. */
json_object *ctl_jdouble_fmt(double v, bool fixed3)
{
	if (!isfinite(v))
		return NULL;
	char buf[64];
	if (fixed3)
		snprintf(buf, sizeof(buf), "%.3f", v);
	else
		snprintf(buf, sizeof(buf), "%.6g", v);
	return json_object_new_double_s(v, buf);
}

static json_object *jdouble(double v)
{
	return ctl_jdouble_fmt(v, false);
}

json_object *ctl_jstring(const char *s)
{
	char *c = ctl_clean_utf8(s);
	json_object *o = json_object_new_string(c ? c : "");
	free(c);
	return o;
}


/* Rates as an object, or null when the daemon sent none. */
static json_object *jrates(bool valid, double interval, double steps, double params, double in, double out)
{
	if (!valid)
		return NULL;
	json_object *r = json_object_new_object();
	if (interval > 0)
		JADD(r, "interval_seconds", jdouble(interval));
	JADD(r, "steps_per_second", jdouble(steps));
	JADD(r, "params_per_second", jdouble(params));
	JADD(r, "bytes_in_per_second", jdouble(in));
	JADD(r, "bytes_out_per_second", jdouble(out));
	return r;
}

static json_object *jrollup(const struct rollup *r)
{
	json_object *o = json_object_new_object();
	if (r->job)
		JADD(o, "job", ctl_jstring(r->job));
	JADD(o, "uid", json_object_new_uint64(r->uid));
	if (!r->job)
		JADD(o, "jobs", json_object_new_uint64(r->jobs));
	JADD(o, "sessions", json_object_new_uint64(r->sessions));
	JADD(o, "tensors", json_object_new_uint64(r->tensors));
	JADD(o, "parameters", json_object_new_uint64(r->parameters));
	JADD(o, "steps_max", json_object_new_uint64(r->steps_max));
	JADD(o, "bytes_in", json_object_new_uint64(r->bytes_in));
	JADD(o, "bytes_out", json_object_new_uint64(r->bytes_out));
	JADD(o, "chunks", json_object_new_uint64(r->chunks));
	JADD(o, "optimizer_cpu_seconds", jdouble(r->cpu_seconds));
	JADD(o, "state_bytes", json_object_new_uint64(r->state_bytes));
	JADD(o, "arena_bytes", json_object_new_uint64(r->arena_bytes));
	JADD(o, "rates", jrates(r->with_rates > 0, 0, r->steps_per_second, r->params_per_second,
	                        r->bytes_in_per_second, r->bytes_out_per_second));
	return o;
}

static json_object *stats_json(const struct view *v)
{
	const Aoq__Stats *st = v->st;
	char when[64];
	ctl_fmt_time(when, sizeof(when), v->timestamp);
	json_object *root = json_object_new_object();
	JADD(root, "timestamp", json_object_new_string(when));
	JADD(root, "timestamp_unix", ctl_jdouble_fmt(v->timestamp, true));
	JADD(root, "version", ctl_jstring(st->version));
	JADD(root, "client_version", json_object_new_string(aoq_full_version()));
	JADD(root, "pid", json_object_new_uint64(st->pid));
	JADD(root, "threads", json_object_new_uint64(st->threads));
	JADD(root, "kernel", ctl_jstring(st->kernel));
	JADD(root, "locked_bytes", json_object_new_uint64(st->locked_bytes));
	JADD(root, "rss_bytes", json_object_new_uint64(st->rss_bytes));
	JADD(root, "uptime_seconds", ctl_jdouble_fmt(st->uptime_seconds, true));
	JADD(root, "loop_spin_us", json_object_new_uint64(st->loop_spin_us));
	JADD(root, "loop_spin_seconds", ctl_jdouble_fmt(st->loop_spin_seconds, true));
	JADD(root, "loop_spin_takes", json_object_new_uint64(st->loop_spin_takes));
	JADD(root, "loop_spin_busy", json_object_new_uint64(st->loop_spin_busy));
	json_object *arr = json_object_new_array();
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		json_object *o = json_object_new_object();
		JADD(o, "id", json_object_new_uint64(s->id));
		JADD(o, "job", ctl_jstring(s->job));
		JADD(o, "rank", json_object_new_uint64(s->rank));
		JADD(o, "uid", json_object_new_uint64(s->uid));
		JADD(o, "pid", json_object_new_uint64(s->pid));
		JADD(o, "device", ctl_jstring(s->device));
		JADD(o, "state", ctl_jstring(s->state));
		JADD(o, "last_step", json_object_new_uint64(s->last_step));
		JADD(o, "lease_left_seconds", strcmp(ctl_str_or(s->state, ""), "leased") == 0 ? jdouble(s->lease_left_seconds) : NULL);
		JADD(o, "precision", json_object_new_string(ctl_precision_name(s->precision, s->master_bits)));
		JADD(o, "tensors", json_object_new_uint64(s->tensors));
		JADD(o, "tensors_released", json_object_new_uint64(s->tensors_released));
		JADD(o, "parameters", json_object_new_uint64(s->parameters));
		JADD(o, "steps", json_object_new_uint64(s->steps));
		JADD(o, "bytes_in", json_object_new_uint64(s->bytes_in));
		JADD(o, "bytes_out", json_object_new_uint64(s->bytes_out));
		JADD(o, "optimizer_cpu_seconds", jdouble(s->optimizer_cpu_seconds));
		JADD(o, "chunks", json_object_new_uint64(s->chunks));
		JADD(o, "chunk_p50_us", jdouble(s->chunk_p50_us));
		JADD(o, "chunk_p99_us", jdouble(s->chunk_p99_us));
		JADD(o, "record_p50_us", jdouble(s->record_p50_us));
		JADD(o, "record_p99_us", jdouble(s->record_p99_us));
		JADD(o, "state_bytes", json_object_new_uint64(s->state_bytes));
		json_object *g = NULL;
		if (s->local_world >= 2) {
			/* a replica group's member; the group's state, arena and
			 * counters are on the owner's row */
			g = json_object_new_object();
			JADD(g, "id", json_object_new_uint64(s->group_id));
			JADD(g, "local_rank", json_object_new_uint64(s->local_rank));
			JADD(g, "local_world", json_object_new_uint64(s->local_world));
			JADD(g, "owner", json_object_new_boolean(s->group_owner));
		}
		JADD(o, "group", g);
		/* the last snapshot written, and one under way */
		JADD(o, "snapshot_step", s->snapshot_step ? json_object_new_uint64(s->snapshot_step) : NULL);
		json_object *sn = NULL;
		if (s->snapshot_phase && *s->snapshot_phase) {
			sn = json_object_new_object();
			JADD(sn, "phase", json_object_new_string(s->snapshot_phase));
			JADD(sn, "written_bytes", json_object_new_uint64(s->snapshot_written_bytes));
			JADD(sn, "data_bytes", json_object_new_uint64(s->snapshot_data_bytes));
		}
		JADD(o, "snapshot", sn);
		JADD(o, "arena_bytes", json_object_new_uint64(s->arena_bytes));
		JADD(o, "rates", jrates(ctl_has_rates(s), s->rate_interval_seconds, s->steps_per_second,
		                        s->params_per_second, s->bytes_in_per_second, s->bytes_out_per_second));
		json_object_array_add(arr, o);
	}
	JADD(root, "sessions", arr);
	arr = json_object_new_array();
	for (size_t i = 0; i < v->njobs; i++)
		json_object_array_add(arr, jrollup(&v->jobs[i]));
	JADD(root, "jobs", arr);
	arr = json_object_new_array();
	for (size_t i = 0; i < v->nuids; i++)
		json_object_array_add(arr, jrollup(&v->uids[i]));
	JADD(root, "uids", arr);
	return root;
}

int ctl_print_stats_json(const struct view *v, FILE *f, bool one_line)
{
	json_object *root = stats_json(v);
	const char *text = json_object_to_json_string_ext(root, one_line ? JSON_C_TO_STRING_PLAIN
	                                                             : JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED);
	int r = text && fputs(text, f) >= 0 && fputc('\n', f) != EOF ? 0 : -EIO;
	json_object_put(root);
	return r;
}
