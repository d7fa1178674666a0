/* SPDX-License-Identifier: MIT */
/*
 * aoqctl's parts and what they share.  aoqctl is one program in several
 * files, each owning one thing:
 *
 *   aoqctl.c          the command line: options, usage, which command runs
 *   aoqctl-conn.c     the connection to aoqd as an observer (Hello, a
 *                     request and its reply, Bye), and how a failure is said
 *   aoqctl-stats.c    the stats and sessions commands, --watch
 *   aoqctl-trace.c    the trace command: Trace frames to Chrome trace JSON
 *   aoqctl-control.c  the snapshot and drop commands
 *   aoqctl-view.c     one Stats reply with its per-job and per-uid sums
 *   aoqctl-table.c    the table format (stats, sessions)
 *   aoqctl-json.c     the JSON format (json-c), and the JSON helpers the
 *                     trace uses
 *   aoqctl-prom.c     the Prometheus text exposition format
 *   aoqctl-text.c     text for a terminal: numbers, units, times, UTF-8 and
 *                     control characters made safe, the table printer
 *   aoqctl-out.c      -o FILE: written to a temp file, renamed when complete
 *
 * Calls go down this list's layers: the command line calls the commands;
 * the commands call the connection, the view, the formats and the output;
 * the formats call text.  Nothing calls up.
 */
#ifndef AOQCTL_H
#define AOQCTL_H

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "wire.h"

enum {
	EXIT_OK = 0,
	EXIT_UNREACHABLE = 1,
	EXIT_USAGE = 2,
};

enum ctl_format { CTL_FMT_TABLE, CTL_FMT_JSON, CTL_FMT_PROMETHEUS };

/* ---- aoqctl-text.c ---- */

/* The rank of a replica group's state (a group leased after a member's
 * trainer went away): shown as "group". */
#define GROUP_RANK UINT32_MAX

void ctl_fmt_bytes(char *buf, size_t len, uint64_t v);
void ctl_fmt_count(char *buf, size_t len, uint64_t v);
void ctl_fmt_rank(char *buf, size_t len, const Aoq__SessionStats *s);
void ctl_fmt_uptime(char *buf, size_t len, double s);
void ctl_fmt_double(char *buf, size_t len, double v, int prec);
void ctl_fmt_time(char *buf, size_t len, double t);
/* A state precision's name; master_bits 24 (the 24-bit master) marks q8 and q4 "-bf24". */
const char *ctl_precision_name(int p, uint32_t master_bits);
const char *ctl_str_or(const char *s, const char *dflt);

#define TABLE_MAX_COLS 16
#define CELL_LEN 64

struct table {
	size_t ncols;
	const char *head[TABLE_MAX_COLS];
	bool right[TABLE_MAX_COLS]; /* right-align (numbers) */
	size_t nrows;
	char (*cells)[TABLE_MAX_COLS][CELL_LEN];
};

void ctl_cell_set(char *cell, const char *str);
int ctl_table_print(const struct table *t, FILE *f);
char *ctl_clean_utf8(const char *str);

/* ---- aoqctl-view.c ---- */

/* Sums over sessions: one per (uid, job) for the job rows, one per uid. */
struct rollup {
	uint32_t uid;
	const char *job; /* NULL in a uid row */
	uint64_t jobs; /* uid rows: distinct jobs */
	uint64_t sessions, tensors, parameters, steps_max, bytes_in, bytes_out, chunks;
	uint64_t state_bytes, arena_bytes;
	double cpu_seconds;
	uint64_t with_rates; /* sessions whose rates are valid */
	double steps_per_second, params_per_second, bytes_in_per_second, bytes_out_per_second;
};

/* One Stats reply as the formats print it. */
struct view {
	const Aoq__Stats *st;
	double timestamp;        /* seconds since the epoch */
	struct rollup *jobs, *uids;
	size_t njobs, nuids;
};

bool ctl_has_rates(const Aoq__SessionStats *s);
int ctl_view_init(struct view *v, const Aoq__Stats *st);
void ctl_view_fini(struct view *v);

/* ---- the formats: aoqctl-table.c, aoqctl-json.c, aoqctl-prom.c ---- */

int ctl_print_stats_table(const struct view *v, FILE *f);
int ctl_print_sessions(const Aoq__Stats *st, FILE *f);
int ctl_print_stats_json(const struct view *v, FILE *f, bool one_line);
int ctl_print_stats_prometheus(const struct view *v, FILE *f);

#define JADD(obj, key, val) json_object_object_add(obj, key, val)
json_object *ctl_jdouble_fmt(double v, bool fixed3);
json_object *ctl_jstring(const char *s);

/* ---- aoqctl-out.c ---- */

/* -o FILE: written as FILE.tmp.PID, renamed over FILE when complete, so a
 * reader (node_exporter's textfile collector) never sees half a file. */
struct out {
	FILE *f;
	const char *path;
	char tmp[4096];
};

int ctl_out_open(struct out *o, const char *path);
int ctl_out_close(struct out *o, bool ok);

/* ---- aoqctl-conn.c ---- */

int ctl_fail_unreachable(const char *path, int err, const char *what, const char *msg);
int ctl_observer_connect(const char *path, int *sock_out);
int ctl_observer_request(const char *path, const Aoq__Envelope *env, Aoq__Envelope__MsgCase want,
                         const char *what, int *sock_out, Aoq__Envelope **rep);
int ctl_request_stats(int sock, const char *path, bool all, Aoq__Envelope **out);
void ctl_say_bye(int sock);

/* ---- the commands: aoqctl-stats.c, aoqctl-trace.c, aoqctl-control.c ---- */

int ctl_run_stats(const char *path, bool all, enum ctl_format fmt, bool sessions_only, double watch,
                  const char *output);
int ctl_run_trace(const char *path, uint64_t session, uint32_t steps, const char *output);
int ctl_run_snapshot(const char *path, uint64_t session);
int ctl_run_drop(const char *path, uint64_t session);

#endif
