/* SPDX-License-Identifier: MIT */
/*
 * aoqctl's table format: `stats` (the daemon, then one row per session, per
 * job and per uid) and `sessions`.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "aoq-version.h"
#include "aoqctl.h"

static void fmt_rate_bytes(char *buf, size_t len, bool valid, double v)
{
	if (!valid || !isfinite(v) || v < 0) {
		snprintf(buf, len, "-");
		return;
	}
	ctl_fmt_bytes(buf, len, (uint64_t)v);
	strncat(buf, "/s", len - strlen(buf) - 1);
}

static void fmt_rate(char *buf, size_t len, bool valid, double v, int prec)
{
	if (!valid)
		snprintf(buf, len, "-");
	else
		ctl_fmt_double(buf, len, v, prec);
}

static int print_rollups(FILE *f, const char *title, const struct rollup *rows, size_t n, bool jobs)
{
	struct table t = {
		.ncols = 11,
		.head = { jobs ? "JOB" : "UID", jobs ? "UID" : "JOBS", "SESSIONS", "PARAMS", "STEPS", "STEP/s",
		          "IN/s", "OUT/s", "IN", "CPU s", "OPT STATE" },
		.right = { !jobs, true, true, true, true, true, true, true, true, true, true },
		.nrows = n,
	};
	t.cells = calloc(n ? n : 1, sizeof(*t.cells));
	if (!t.cells)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++) {
		const struct rollup *r = &rows[i];
		char (*row)[CELL_LEN] = t.cells[i];
		bool rates = r->with_rates > 0;
		if (jobs) {
			ctl_cell_set(row[0], ctl_str_or(r->job, "-"));
			snprintf(row[1], CELL_LEN, "%" PRIu32, r->uid);
		} else {
			snprintf(row[0], CELL_LEN, "%" PRIu32, r->uid);
			snprintf(row[1], CELL_LEN, "%" PRIu64, r->jobs);
		}
		snprintf(row[2], CELL_LEN, "%" PRIu64, r->sessions);
		ctl_fmt_count(row[3], CELL_LEN, r->parameters);
		snprintf(row[4], CELL_LEN, "%" PRIu64, r->steps_max);
		fmt_rate(row[5], CELL_LEN, rates, r->steps_per_second, 2);
		fmt_rate_bytes(row[6], CELL_LEN, rates, r->bytes_in_per_second);
		fmt_rate_bytes(row[7], CELL_LEN, rates, r->bytes_out_per_second);
		ctl_fmt_bytes(row[8], CELL_LEN, r->bytes_in);
		ctl_fmt_double(row[9], CELL_LEN, r->cpu_seconds, 3);
		ctl_fmt_bytes(row[10], CELL_LEN, r->state_bytes);
	}
	fprintf(f, "\n%s\n", title);
	int ret = ctl_table_print(&t, f);
	free(t.cells);
	return ret;
}

int ctl_print_stats_table(const struct view *v, FILE *f)
{
	const Aoq__Stats *st = v->st;
	char locked[32], rss[32], up[32], when[64];
	ctl_fmt_bytes(locked, sizeof(locked), st->locked_bytes);
	ctl_fmt_bytes(rss, sizeof(rss), st->rss_bytes);
	ctl_fmt_uptime(up, sizeof(up), st->uptime_seconds);
	ctl_fmt_time(when, sizeof(when), v->timestamp);
	char version[64];
	ctl_cell_set(version, ctl_str_or(st->version, "?"));
	fprintf(f, "%s  aoqd %s  pid %" PRIu32 "  threads %" PRIu32 "  kernel %s  locked %s  rss %s  uptime %s\n",
	        when, version, st->pid, st->threads, ctl_str_or(st->kernel, "?"), locked, rss, up);
	fprintf(f, "aoqctl %s\n", aoq_full_version());
	if (st->loop_spin_us || st->loop_spin_takes || st->loop_spin_busy)
		fprintf(f, "loop spin %" PRIu32 " us: polled %.3f s, %" PRIu64 " polls took records (no doorbell), %" PRIu64
		       " doorbells with tasks waiting (no spin)\n",
		       st->loop_spin_us, st->loop_spin_seconds, st->loop_spin_takes, st->loop_spin_busy);
	if (st->n_sessions == 0) {
		fprintf(f, "no sessions\n");
		return ferror(f) ? -EIO : 0;
	}
	fputc('\n', f);

	struct table t = {
		.ncols = 14,
		.head = { "ID", "JOB", "RANK", "UID", "PARAMS", "STEPS", "STEP/s", "IN/s", "OUT/s", "IN",
		          "CPU s", "CHUNK p50us", "p99us", "OPT STATE" },
		.right = { true, false, true, true, true, true, true, true, true, true, true, true, true, true },
		.nrows = st->n_sessions,
	};
	t.cells = calloc(st->n_sessions, sizeof(*t.cells));
	if (!t.cells)
		return -ENOMEM;
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		char (*row)[CELL_LEN] = t.cells[i];
		bool rates = ctl_has_rates(s);
		snprintf(row[0], CELL_LEN, "%" PRIu64, s->id);
		ctl_cell_set(row[1], ctl_str_or(s->job, "-"));
		ctl_fmt_rank(row[2], CELL_LEN, s);
		snprintf(row[3], CELL_LEN, "%" PRIu32, s->uid);
		ctl_fmt_count(row[4], CELL_LEN, s->parameters);
		snprintf(row[5], CELL_LEN, "%" PRIu64, s->steps);
		fmt_rate(row[6], CELL_LEN, rates, s->steps_per_second, 2);
		fmt_rate_bytes(row[7], CELL_LEN, rates, s->bytes_in_per_second);
		fmt_rate_bytes(row[8], CELL_LEN, rates, s->bytes_out_per_second);
		ctl_fmt_bytes(row[9], CELL_LEN, s->bytes_in);
		ctl_fmt_double(row[10], CELL_LEN, s->optimizer_cpu_seconds, 3);
		ctl_fmt_double(row[11], CELL_LEN, s->chunk_p50_us, 1);
		ctl_fmt_double(row[12], CELL_LEN, s->chunk_p99_us, 1);
		ctl_fmt_bytes(row[13], CELL_LEN, s->state_bytes);
	}
	int r = ctl_table_print(&t, f);
	free(t.cells);
	if (r == 0)
		r = print_rollups(f, "JOBS", v->jobs, v->njobs, true);
	if (r == 0)
		r = print_rollups(f, "UIDS", v->uids, v->nuids, false);
	return r;
}

int ctl_print_sessions(const Aoq__Stats *st, FILE *f)
{
	struct table t = {
		.ncols = 12,
		.head = { "ID", "JOB", "RANK", "UID", "PID", "DEVICE", "STATE", "PRECISION", "STEP", "LEASE", "GROUP",
		          "SNAPSHOT" },
		.right = { true, false, true, true, true, false, false, false, true, true, false, false },
		.nrows = st->n_sessions,
	};
	if (st->n_sessions == 0) {
		fprintf(f, "no sessions\n");
		return ferror(f) ? -EIO : 0;
	}
	t.cells = calloc(st->n_sessions, sizeof(*t.cells));
	if (!t.cells)
		return -ENOMEM;
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		char (*row)[CELL_LEN] = t.cells[i];
		snprintf(row[0], CELL_LEN, "%" PRIu64, s->id);
		ctl_cell_set(row[1], ctl_str_or(s->job, "-"));
		ctl_fmt_rank(row[2], CELL_LEN, s);
		snprintf(row[3], CELL_LEN, "%" PRIu32, s->uid);
		snprintf(row[4], CELL_LEN, "%" PRIu32, s->pid);
		ctl_cell_set(row[5], ctl_str_or(s->device, "-"));
		ctl_cell_set(row[6], ctl_str_or(s->state, "-"));
		ctl_cell_set(row[7], ctl_precision_name(s->precision, s->master_bits));
		snprintf(row[8], CELL_LEN, "%" PRIu64, s->last_step);
		if (s->state && strcmp(s->state, "leased") == 0)
			snprintf(row[9], CELL_LEN, "%.0fs", ceil(s->lease_left_seconds));
		else
			ctl_cell_set(row[9], "-");
		/* a replica group's member: group id, local rank/local world;
		 * a group's leased state: group id, its local world */
		if (s->local_world >= 2 && s->rank == GROUP_RANK)
			snprintf(row[10], CELL_LEN, "%" PRIu64 ":%" PRIu32 " ranks", s->group_id, s->local_world);
		else if (s->local_world >= 2)
			snprintf(row[10], CELL_LEN, "%" PRIu64 ":%" PRIu32 "/%" PRIu32, s->group_id, s->local_rank,
			         s->local_world);
		else
			ctl_cell_set(row[10], "-");
		/* a snapshot under way: its phase, and how far its write is */
		const char *ph = ctl_str_or(s->snapshot_phase, "");
		if (strcmp(ph, "writing") == 0 && s->snapshot_data_bytes)
			snprintf(row[11], CELL_LEN, "writing %.0f%%",
			         100.0 * (double)s->snapshot_written_bytes / (double)s->snapshot_data_bytes);
		else
			ctl_cell_set(row[11], *ph ? ph : "-");
	}
	int r = ctl_table_print(&t, f);
	free(t.cells);
	return r;
}
