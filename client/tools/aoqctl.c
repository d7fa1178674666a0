/* SPDX-License-Identifier: MIT */
/*
 * aoqctl: shows what aoqd is doing.
 *
 *   aoqctl [--socket PATH] stats [--json|--prometheus] [--all] [--watch [SEC]] [-o FILE]
 *   aoqctl [--socket PATH] sessions [--all]
 *   aoqctl [--socket PATH] trace SESSION [--steps N] -o FILE
 *   aoqctl [--socket PATH] snapshot SESSION
 *   aoqctl [--socket PATH] drop SESSION
 *
 * It speaks the control protocol directly (proto/wire.h) as an observer:
 * Hello{observer} -> Welcome, then StatsRequest -> Stats (repeatedly with
 * --watch, on one connection), or TraceRequest -> Trace frames.
 *
 * The per-job and per-uid rows are sums over the per-session rows of one
 * Stats reply.  Rates (steps/s, params/s, bytes/s) are the daemon's, over its
 * own interval (SessionStats.rate_interval_seconds > 0); aoqctl never diffs
 * two replies.  JSON is built with json-c; the Prometheus text is written
 * here, line by line, as the exposition format 0.0.4 asks.
 *
 * Exit status: 0 ok, 1 the daemon is unreachable or answered with an error
 * (or the output could not be written), 2 usage.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "aoq-config.h"
#include "wire.h"

enum {
	EXIT_OK = 0,
	EXIT_UNREACHABLE = 1,
	EXIT_USAGE = 2,
};

static const char usage_text[] =
	"Usage: aoqctl [--socket PATH] COMMAND [OPTIONS]\n"
	"\n"
	"Shows what the aoq optimizer daemon (aoqd) is doing.\n"
	"\n"
	"Commands:\n"
	"  stats        daemon-wide figures, then one row per session, per job and per uid\n"
	"  sessions     one line per session: id job rank uid pid device state precision,\n"
	"               last completed step, lease time left (leased: trainer gone),\n"
	"               replica group (id:local rank/local world)\n"
	"  trace ID     record the next steps of session ID as a Chrome trace (Perfetto)\n"
	"  snapshot ID  write session ID's optimizer state to the daemon's state_dir\n"
	"               (safetensors); waits until the file is on disk, prints its path\n"
	"  drop ID      end session ID (live or leased) and its lease for good\n"
	"\n"
	"Options:\n"
	"  -s, --socket PATH     the daemon's socket (default: $AOQ_SOCKET, else\n"
	"                        /run/aoq/aoqd.sock when it exists, else\n"
	"                        $XDG_RUNTIME_DIR/aoq/aoqd.sock)\n"
	"  -j, --json            stats: JSON instead of a table\n"
	"  -p, --prometheus      stats: Prometheus text exposition format\n"
	"  -w, --watch [SEC]     stats: refresh every SEC seconds (default 2) until\n"
	"                        interrupted; JSON is then one object per line\n"
	"  -o, --output FILE     stats, trace: write FILE (atomically: FILE.tmp, then\n"
	"                        renamed) instead of standard output\n"
	"  -n, --steps N         trace: steps to record (default 3)\n"
	"  -a, --all             every session the caller may see (root and the admin\n"
	"                        group see other users' sessions), not only the caller's\n"
	"  -h, --help            this text\n"
	"  -V, --version         the version\n"
	"\n"
	"Exit status: 0 ok, 1 daemon unreachable or error, 2 usage.\n";

/* ---- formatting helpers ------------------------------------------------ */

/* v in units of base (1024: "1.50 GiB", "512 B"; 1000: "12.3k", "999"):
 * three significant digits past the first unit. */
static void fmt_scaled(char *buf, size_t len, uint64_t v, double base, const char *const unit[7], const char *sep)
{
	double d = (double)v;
	unsigned u = 0;
	while (d >= base && u + 1 < 7) {
		d /= base;
		u++;
	}
	if (u == 0)
		snprintf(buf, len, "%" PRIu64 "%s%s", v, sep, unit[0]);
	else
		snprintf(buf, len, "%.*f%s%s", d < 10.0 ? 2 : d < 100.0 ? 1 : 0, d, sep, unit[u]);
}

static void fmt_bytes(char *buf, size_t len, uint64_t v)
{
	static const char *const unit[7] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB" };
	fmt_scaled(buf, len, v, 1024.0, unit, " ");
}

/* The rank of a replica group's state (a group leased after a member's
 * trainer went away): shown as "group". */
#define GROUP_RANK UINT32_MAX

static void fmt_rank(char *buf, size_t len, const Aoq__SessionStats *s)
{
	if (s->rank == GROUP_RANK && s->local_world >= 2)
		snprintf(buf, len, "group");
	else
		snprintf(buf, len, "%" PRIu32, s->rank);
}

static void fmt_count(char *buf, size_t len, uint64_t v)
{
	static const char *const unit[7] = { "", "k", "M", "G", "T", "P", "E" };
	fmt_scaled(buf, len, v, 1000.0, unit, "");
}

/* "3d 04:05:06", "04:05:06". */
static void fmt_uptime(char *buf, size_t len, double s)
{
	if (!isfinite(s) || s < 0)
		s = 0;
	uint64_t t = (uint64_t)s;
	uint64_t d = t / 86400, h = t / 3600 % 24, m = t / 60 % 60, sec = t % 60;
	if (d)
		snprintf(buf, len, "%" PRIu64 "d %02" PRIu64 ":%02" PRIu64 ":%02" PRIu64, d, h, m, sec);
	else
		snprintf(buf, len, "%02" PRIu64 ":%02" PRIu64 ":%02" PRIu64, h, m, sec);
}

static void fmt_double(char *buf, size_t len, double v, int prec)
{
	if (!isfinite(v))
		snprintf(buf, len, "-");
	else
		snprintf(buf, len, "%.*f", prec, v);
}

static const char *precision_name(int p)
{
	switch (p) {
	case AOQ__STATE_PRECISION__STATE_FP32: return "fp32";
	case AOQ__STATE_PRECISION__STATE_Q8: return "q8";
	case AOQ__STATE_PRECISION__STATE_BF16: return "bf16";
	case AOQ__STATE_PRECISION__STATE_BF16_Q8: return "bf16-q8";
	case AOQ__STATE_PRECISION__STATE_BF16_ALL: return "bf16-all";
	default: return "unknown";
	}
}

static const char *str_or(const char *s, const char *dflt)
{
	return s && *s ? s : dflt;
}

/* ---- UTF-8 ---------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when invalid. */
static size_t utf8_valid(const unsigned char *s)
{
	unsigned c = s[0];
	size_t n;
	uint32_t cp;
	if (c < 0x80)
		return 1;
	else if ((c & 0xe0) == 0xc0)
		n = 2, cp = c & 0x1f;
	else if ((c & 0xf0) == 0xe0)
		n = 3, cp = c & 0x0f;
	else if ((c & 0xf8) == 0xf0)
		n = 4, cp = c & 0x07;
	else
		return 0;
	for (size_t i = 1; i < n; i++) {
		if ((s[i] & 0xc0) != 0x80)
			return 0;
		cp = cp << 6 | (s[i] & 0x3f);
	}
	if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
	    cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
		return 0;
	return n;
}

/* ---- a small table printer --------------------------------------------- */

#define TABLE_MAX_COLS 16
#define CELL_LEN 64

struct table {
	size_t ncols;
	const char *head[TABLE_MAX_COLS];
	bool right[TABLE_MAX_COLS]; /* right-align (numbers) */
	size_t nrows;
	char (*cells)[TABLE_MAX_COLS][CELL_LEN];
};

/* Sanitises a cell for a terminal: control characters and invalid UTF-8
 * become '?'; a long text is cut at a character boundary. */
static void cell_set(char *cell, const char *str)
{
	const unsigned char *s = (const unsigned char *)str;
	size_t o = 0;
	while (*s) {
		size_t n = utf8_valid(s);
		bool bad = n == 0 || *s < 0x20 || *s == 0x7f;
		if (bad)
			n = 1;
		if (o + n + 1 > CELL_LEN)
			break;
		if (bad)
			cell[o] = '?';
		else
			memcpy(cell + o, s, n);
		o += n;
		s += n;
	}
	cell[o] = 0;
}

/* Display width: characters, not bytes (cells hold valid UTF-8). */
static size_t cell_width(const char *s)
{
	size_t w = 0;
	for (; *s; s++)
		w += ((unsigned char)*s & 0xc0) != 0x80;
	return w;
}

static void print_padded(FILE *f, const char *s, size_t width, bool right)
{
	size_t w = cell_width(s);
	if (right)
		for (; w < width; w++)
			fputc(' ', f);
	fputs(s, f);
	if (!right)
		for (; w < width; w++)
			fputc(' ', f);
}

static int table_print(const struct table *t, FILE *f)
{
	size_t w[TABLE_MAX_COLS];
	for (size_t c = 0; c < t->ncols; c++) {
		w[c] = cell_width(t->head[c]);
		for (size_t r = 0; r < t->nrows; r++) {
			size_t l = cell_width(t->cells[r][c]);
			if (l > w[c])
				w[c] = l;
		}
	}
	for (size_t r = 0; r <= t->nrows; r++) {
		for (size_t c = 0; c < t->ncols; c++) {
			const char *s = r == 0 ? t->head[c] : t->cells[r - 1][c];
			bool last = c + 1 == t->ncols;
			print_padded(f, s, last && !t->right[c] ? 0 : w[c], t->right[c]);
			if (!last)
				fputs("  ", f);
		}
		fputc('\n', f);
	}
	return ferror(f) ? -EIO : 0;
}

/* ---- strings from the daemon ------------------------------------------- */

/* A copy of str as valid UTF-8 without control characters (each bad byte
 * becomes U+FFFD): job and device names come from other processes. */
static char *clean_utf8(const char *str)
{
	const unsigned char *s = (const unsigned char *)(str ? str : "");
	size_t len = strlen((const char *)s);
	char *out = malloc(len * 3 + 1), *o = out;
	if (!out)
		return NULL;
	while (*s) {
		size_t n = utf8_valid(s);
		if (n == 0 || *s < 0x20 || *s == 0x7f) {
			memcpy(o, "\xef\xbf\xbd", 3);
			o += 3;
			s++;
			continue;
		}
		memcpy(o, s, n);
		o += n;
		s += n;
	}
	*o = '\0';
	return out;
}

/* ---- rollups ------------------------------------------------------------ */

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

struct view {
	const Aoq__Stats *st;
	double timestamp;        /* seconds since the epoch */
	struct rollup *jobs, *uids;
	size_t njobs, nuids;
};

static bool has_rates(const Aoq__SessionStats *s)
{
	return s->rate_interval_seconds > 0 && isfinite(s->rate_interval_seconds);
}

static void rollup_add(struct rollup *r, const Aoq__SessionStats *s)
{
	r->sessions++;
	r->tensors += s->tensors;
	r->parameters += s->parameters;
	if (s->steps > r->steps_max)
		r->steps_max = s->steps;
	r->bytes_in += s->bytes_in;
	r->bytes_out += s->bytes_out;
	r->chunks += s->chunks;
	r->state_bytes += s->state_bytes;
	r->arena_bytes += s->arena_bytes;
	r->cpu_seconds += s->optimizer_cpu_seconds;
	if (has_rates(s)) {
		r->with_rates++;
		/* ranks of a job step together: the job's step rate is the
		 * fastest rank's, its data rates the sum */
		if (s->steps_per_second > r->steps_per_second)
			r->steps_per_second = s->steps_per_second;
		r->params_per_second += s->params_per_second;
		r->bytes_in_per_second += s->bytes_in_per_second;
		r->bytes_out_per_second += s->bytes_out_per_second;
	}
}

static struct rollup *rollup_find(struct rollup *rows, size_t *n, uint32_t uid, const char *job)
{
	for (size_t i = 0; i < *n; i++)
		if (rows[i].uid == uid && (job ? rows[i].job && strcmp(rows[i].job, job) == 0 : !rows[i].job))
			return &rows[i];
	struct rollup *r = &rows[(*n)++];
	memset(r, 0, sizeof(*r));
	r->uid = uid;
	r->job = job;
	return r;
}

static double now_unix(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int view_init(struct view *v, const Aoq__Stats *st)
{
	memset(v, 0, sizeof(*v));
	v->st = st;
	v->timestamp = st->timestamp_unix_ns ? (double)st->timestamp_unix_ns / 1e9 : now_unix();
	size_t n = st->n_sessions ? st->n_sessions : 1;
	v->jobs = calloc(n, sizeof(*v->jobs));
	v->uids = calloc(n, sizeof(*v->uids));
	if (!v->jobs || !v->uids) {
		free(v->jobs);
		free(v->uids);
		return -ENOMEM;
	}
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		size_t njobs = v->njobs;
		rollup_add(rollup_find(v->jobs, &v->njobs, s->uid, s->job ? s->job : ""), s);
		struct rollup *u = rollup_find(v->uids, &v->nuids, s->uid, NULL);
		rollup_add(u, s);
		u->jobs += v->njobs > njobs;
	}
	return 0;
}

static void view_fini(struct view *v)
{
	free(v->jobs);
	free(v->uids);
}

/* "2026-11-30T17:20:01.250Z" */
static void fmt_time(char *buf, size_t len, double t)
{
	time_t sec = (time_t)t;
	struct tm tm;
	gmtime_r(&sec, &tm);
	int ms = (int)((t - (double)sec) * 1000);
	if (ms < 0 || ms > 999)
		ms = 0;
	snprintf(buf, len, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
	         tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}

/* ---- table output ------------------------------------------------------- */

static void fmt_rate_bytes(char *buf, size_t len, bool valid, double v)
{
	if (!valid || !isfinite(v) || v < 0) {
		snprintf(buf, len, "-");
		return;
	}
	fmt_bytes(buf, len, (uint64_t)v);
	strncat(buf, "/s", len - strlen(buf) - 1);
}

static void fmt_rate(char *buf, size_t len, bool valid, double v, int prec)
{
	if (!valid)
		snprintf(buf, len, "-");
	else
		fmt_double(buf, len, v, prec);
}

static int print_rollups(const char *title, const struct rollup *rows, size_t n, bool jobs)
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
			cell_set(row[0], str_or(r->job, "-"));
			snprintf(row[1], CELL_LEN, "%" PRIu32, r->uid);
		} else {
			snprintf(row[0], CELL_LEN, "%" PRIu32, r->uid);
			snprintf(row[1], CELL_LEN, "%" PRIu64, r->jobs);
		}
		snprintf(row[2], CELL_LEN, "%" PRIu64, r->sessions);
		fmt_count(row[3], CELL_LEN, r->parameters);
		snprintf(row[4], CELL_LEN, "%" PRIu64, r->steps_max);
		fmt_rate(row[5], CELL_LEN, rates, r->steps_per_second, 2);
		fmt_rate_bytes(row[6], CELL_LEN, rates, r->bytes_in_per_second);
		fmt_rate_bytes(row[7], CELL_LEN, rates, r->bytes_out_per_second);
		fmt_bytes(row[8], CELL_LEN, r->bytes_in);
		fmt_double(row[9], CELL_LEN, r->cpu_seconds, 3);
		fmt_bytes(row[10], CELL_LEN, r->state_bytes);
	}
	printf("\n%s\n", title);
	int ret = table_print(&t, stdout);
	free(t.cells);
	return ret;
}

static int print_stats_table(const struct view *v)
{
	const Aoq__Stats *st = v->st;
	char locked[32], rss[32], up[32], when[64];
	fmt_bytes(locked, sizeof(locked), st->locked_bytes);
	fmt_bytes(rss, sizeof(rss), st->rss_bytes);
	fmt_uptime(up, sizeof(up), st->uptime_seconds);
	fmt_time(when, sizeof(when), v->timestamp);
	printf("%s  aoqd %s  pid %" PRIu32 "  threads %" PRIu32 "  kernel %s  locked %s  rss %s  uptime %s\n",
	       when, str_or(st->version, "?"), st->pid, st->threads, str_or(st->kernel, "?"), locked, rss, up);
	if (st->loop_spin_us || st->loop_spin_takes || st->loop_spin_busy)
		printf("loop spin %" PRIu32 " us: polled %.3f s, %" PRIu64 " polls took records (no doorbell), %" PRIu64
		       " doorbells with tasks waiting (no spin)\n",
		       st->loop_spin_us, st->loop_spin_seconds, st->loop_spin_takes, st->loop_spin_busy);
	if (st->n_sessions == 0) {
		printf("no sessions\n");
		return ferror(stdout) ? -EIO : 0;
	}
	putchar('\n');

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
		bool rates = has_rates(s);
		snprintf(row[0], CELL_LEN, "%" PRIu64, s->id);
		cell_set(row[1], str_or(s->job, "-"));
		fmt_rank(row[2], CELL_LEN, s);
		snprintf(row[3], CELL_LEN, "%" PRIu32, s->uid);
		fmt_count(row[4], CELL_LEN, s->parameters);
		snprintf(row[5], CELL_LEN, "%" PRIu64, s->steps);
		fmt_rate(row[6], CELL_LEN, rates, s->steps_per_second, 2);
		fmt_rate_bytes(row[7], CELL_LEN, rates, s->bytes_in_per_second);
		fmt_rate_bytes(row[8], CELL_LEN, rates, s->bytes_out_per_second);
		fmt_bytes(row[9], CELL_LEN, s->bytes_in);
		fmt_double(row[10], CELL_LEN, s->optimizer_cpu_seconds, 3);
		fmt_double(row[11], CELL_LEN, s->chunk_p50_us, 1);
		fmt_double(row[12], CELL_LEN, s->chunk_p99_us, 1);
		fmt_bytes(row[13], CELL_LEN, s->state_bytes);
	}
	int r = table_print(&t, stdout);
	free(t.cells);
	if (r == 0)
		r = print_rollups("JOBS", v->jobs, v->njobs, true);
	if (r == 0)
		r = print_rollups("UIDS", v->uids, v->nuids, false);
	return r;
}

static int print_sessions(const Aoq__Stats *st)
{
	struct table t = {
		.ncols = 12,
		.head = { "ID", "JOB", "RANK", "UID", "PID", "DEVICE", "STATE", "PRECISION", "STEP", "LEASE", "GROUP",
		          "SNAPSHOT" },
		.right = { true, false, true, true, true, false, false, false, true, true, false, false },
		.nrows = st->n_sessions,
	};
	if (st->n_sessions == 0) {
		printf("no sessions\n");
		return ferror(stdout) ? -EIO : 0;
	}
	t.cells = calloc(st->n_sessions, sizeof(*t.cells));
	if (!t.cells)
		return -ENOMEM;
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		char (*row)[CELL_LEN] = t.cells[i];
		snprintf(row[0], CELL_LEN, "%" PRIu64, s->id);
		cell_set(row[1], str_or(s->job, "-"));
		fmt_rank(row[2], CELL_LEN, s);
		snprintf(row[3], CELL_LEN, "%" PRIu32, s->uid);
		snprintf(row[4], CELL_LEN, "%" PRIu32, s->pid);
		cell_set(row[5], str_or(s->device, "-"));
		cell_set(row[6], str_or(s->state, "-"));
		cell_set(row[7], precision_name(s->precision));
		snprintf(row[8], CELL_LEN, "%" PRIu64, s->last_step);
		if (s->state && strcmp(s->state, "leased") == 0)
			snprintf(row[9], CELL_LEN, "%.0fs", ceil(s->lease_left_seconds));
		else
			cell_set(row[9], "-");
		/* a replica group's member: group id, local rank/local world;
		 * a group's leased state: group id, its local world */
		if (s->local_world >= 2 && s->rank == GROUP_RANK)
			snprintf(row[10], CELL_LEN, "%" PRIu64 ":%" PRIu32 " ranks", s->group_id, s->local_world);
		else if (s->local_world >= 2)
			snprintf(row[10], CELL_LEN, "%" PRIu64 ":%" PRIu32 "/%" PRIu32, s->group_id, s->local_rank,
			         s->local_world);
		else
			cell_set(row[10], "-");
		/* a snapshot under way: its phase, and how far its write is */
		const char *ph = str_or(s->snapshot_phase, "");
		if (strcmp(ph, "writing") == 0 && s->snapshot_data_bytes)
			snprintf(row[11], CELL_LEN, "writing %.0f%%",
			         100.0 * (double)s->snapshot_written_bytes / (double)s->snapshot_data_bytes);
		else
			cell_set(row[11], *ph ? ph : "-");
	}
	int r = table_print(&t, stdout);
	free(t.cells);
	return r;
}

/* ---- JSON output (json-c) ----------------------------------------------- */

/* A number printed short (%.6g, or fmt); JSON null when not finite. */
static json_object *jdouble_fmt(double v, bool fixed3)
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
	return jdouble_fmt(v, false);
}

static json_object *jstring(const char *s)
{
	char *c = clean_utf8(s);
	json_object *o = json_object_new_string(c ? c : "");
	free(c);
	return o;
}

#define JADD(obj, key, val) json_object_object_add(obj, key, val)

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
		JADD(o, "job", jstring(r->job));
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
	fmt_time(when, sizeof(when), v->timestamp);
	json_object *root = json_object_new_object();
	JADD(root, "timestamp", json_object_new_string(when));
	JADD(root, "timestamp_unix", jdouble_fmt(v->timestamp, true));
	JADD(root, "version", jstring(st->version));
	JADD(root, "pid", json_object_new_uint64(st->pid));
	JADD(root, "threads", json_object_new_uint64(st->threads));
	JADD(root, "kernel", jstring(st->kernel));
	JADD(root, "locked_bytes", json_object_new_uint64(st->locked_bytes));
	JADD(root, "rss_bytes", json_object_new_uint64(st->rss_bytes));
	JADD(root, "uptime_seconds", jdouble_fmt(st->uptime_seconds, true));
	JADD(root, "loop_spin_us", json_object_new_uint64(st->loop_spin_us));
	JADD(root, "loop_spin_seconds", jdouble_fmt(st->loop_spin_seconds, true));
	JADD(root, "loop_spin_takes", json_object_new_uint64(st->loop_spin_takes));
	JADD(root, "loop_spin_busy", json_object_new_uint64(st->loop_spin_busy));
	json_object *arr = json_object_new_array();
	for (size_t i = 0; i < st->n_sessions; i++) {
		const Aoq__SessionStats *s = st->sessions[i];
		json_object *o = json_object_new_object();
		JADD(o, "id", json_object_new_uint64(s->id));
		JADD(o, "job", jstring(s->job));
		JADD(o, "rank", json_object_new_uint64(s->rank));
		JADD(o, "uid", json_object_new_uint64(s->uid));
		JADD(o, "pid", json_object_new_uint64(s->pid));
		JADD(o, "device", jstring(s->device));
		JADD(o, "state", jstring(s->state));
		JADD(o, "last_step", json_object_new_uint64(s->last_step));
		JADD(o, "lease_left_seconds", strcmp(str_or(s->state, ""), "leased") == 0 ? jdouble(s->lease_left_seconds) : NULL);
		JADD(o, "precision", json_object_new_string(precision_name(s->precision)));
		JADD(o, "tensors", json_object_new_uint64(s->tensors));
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
		JADD(o, "rates", jrates(has_rates(s), s->rate_interval_seconds, s->steps_per_second,
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

static int print_stats_json(const struct view *v, FILE *f, bool one_line)
{
	json_object *root = stats_json(v);
	const char *text = json_object_to_json_string_ext(root, one_line ? JSON_C_TO_STRING_PLAIN
	                                                             : JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED);
	int r = text && fputs(text, f) >= 0 && fputc('\n', f) != EOF ? 0 : -EIO;
	json_object_put(root);
	return r;
}

/* ---- Prometheus text exposition format 0.0.4 ------------------------------ */

/* A label value: valid UTF-8 with \\, \" and \n escaped. */
static void prom_label_value(FILE *f, const char *v)
{
	char *c = clean_utf8(v);
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

#define GETTER(fname, expr) \
	static double fname(const Aoq__SessionStats *s) { return (double)(expr); }
GETTER(get_tensors, s->tensors)
GETTER(get_parameters, s->parameters)
GETTER(get_steps, s->steps)
GETTER(get_bytes_in, s->bytes_in)
GETTER(get_bytes_out, s->bytes_out)
GETTER(get_cpu, s->optimizer_cpu_seconds)
GETTER(get_chunks, s->chunks)
GETTER(get_state, s->state_bytes)
GETTER(get_arena, s->arena_bytes)

static int print_stats_prometheus(const struct view *v, FILE *f)
{
	const Aoq__Stats *st = v->st;
	prom_head(f, "aoq_daemon_info", "gauge", "aoqd build and kernel in use (always 1).");
	fputs("aoq_daemon_info{version=\"", f);
	prom_label_value(f, st->version);
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
			fprintf(f, "\",precision=\"%s\"} 1\n", precision_name(s->precision));
		}
	}
	prom_session_family(f, st, "aoq_session_tensors", "gauge", "Tensors registered by the session.", get_tensors);
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
	if (st->n_sessions) {
		prom_head(f, "aoq_session_chunk_latency_seconds", "gauge",
		          "Chunk update latency quantiles over the session's life.");
		for (int q = 0; q < 2; q++)
			for (size_t i = 0; i < st->n_sessions; i++) {
				const Aoq__SessionStats *s = st->sessions[i];
				fputs("aoq_session_chunk_latency_seconds", f);
				prom_session_labels(f, s);
				fprintf(f, ",quantile=\"%s\"} ", q ? "0.99" : "0.5");
				prom_value(f, (q ? s->chunk_p99_us : s->chunk_p50_us) / 1e6);
				fputc('\n', f);
			}
		prom_head(f, "aoq_session_record_latency_seconds", "gauge",
		          "Gradient record accepted to parameter record posted, quantiles over the session's life.");
		for (int q = 0; q < 2; q++)
			for (size_t i = 0; i < st->n_sessions; i++) {
				const Aoq__SessionStats *s = st->sessions[i];
				fputs("aoq_session_record_latency_seconds", f);
				prom_session_labels(f, s);
				fprintf(f, ",quantile=\"%s\"} ", q ? "0.99" : "0.5");
				prom_value(f, (q ? s->record_p99_us : s->record_p50_us) / 1e6);
				fputc('\n', f);
			}
	}
	return ferror(f) ? -EIO : 0;
}

/* ---- talking to the daemon --------------------------------------------- */

static int fail_unreachable(const char *path, int err, const char *what, const char *msg)
{
	fprintf(stderr, "aoqctl: %s aoqd at %s: %s%s%s\n", what, path, strerror(-err),
	        msg ? ": " : "", msg ? msg : "");
	if (err == -ENOENT || err == -ECONNREFUSED)
		fprintf(stderr, "aoqctl: is aoqd running? (choose its socket with --socket or AOQ_SOCKET)\n");
	return EXIT_UNREACHABLE;
}

/* Connects and says Hello as an observer; *sock on success. */
static int observer_connect(const char *path, int *sock_out)
{
	int sock = aoq_socket_connect(path);
	if (sock < 0)
		return fail_unreachable(path, sock, "cannot connect to", NULL);
	char *msg = NULL;
	Aoq__Envelope *rep = NULL;
	Aoq__Hello hello = AOQ__HELLO__INIT;
	hello.protocol_version = AOQ_PROTOCOL_VERSION;
	hello.job = (char *)"aoqctl";
	hello.device = (char *)"";
	hello.observer = true;
	hello.pid = (uint32_t)getpid();
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_HELLO;
	env.hello = &hello;
	int ret = EXIT_UNREACHABLE;
	int r = aoq_call(sock, &env, &rep, &msg);
	if (r < 0) {
		fail_unreachable(path, r, "handshake failed with", msg);
	} else if (rep->msg_case != AOQ__ENVELOPE__MSG_WELCOME) {
		fprintf(stderr, "aoqctl: aoqd at %s answered Hello with message %d, not Welcome\n", path,
		        (int)rep->msg_case);
	} else {
		ret = EXIT_OK;
		*sock_out = sock;
		sock = -1;
	}
	free(msg);
	aoq_envelope_free(rep);
	if (sock >= 0)
		close(sock);
	return ret;
}

static void say_bye(int sock)
{
	/* Polite goodbye; the daemon may or may not answer it. */
	Aoq__Bye bye = AOQ__BYE__INIT;
	Aoq__Envelope benv = AOQ__ENVELOPE__INIT;
	benv.msg_case = AOQ__ENVELOPE__MSG_BYE;
	benv.bye = &bye;
	(void)aoq_send_frame(sock, &benv, NULL, 0);
}

static int request_stats(int sock, const char *path, bool all, Aoq__Envelope **out)
{
	char *msg = NULL;
	Aoq__Envelope *rep = NULL;
	Aoq__StatsRequest req = AOQ__STATS_REQUEST__INIT;
	req.all_sessions = all;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_STATS_REQUEST;
	env.stats_request = &req;
	int r = aoq_call(sock, &env, &rep, &msg);
	if (r < 0) {
		fail_unreachable(path, r, "stats request failed at", msg);
		free(msg);
		return EXIT_UNREACHABLE;
	}
	if (rep->msg_case != AOQ__ENVELOPE__MSG_STATS || !rep->stats) {
		fprintf(stderr, "aoqctl: aoqd at %s answered StatsRequest with message %d, not Stats\n", path,
		        (int)rep->msg_case);
		aoq_envelope_free(rep);
		return EXIT_UNREACHABLE;
	}
	*out = rep;
	return EXIT_OK;
}

/* ---- output files ------------------------------------------------------ */

/* -o FILE: written as FILE.tmp.PID, renamed over FILE when complete, so a
 * reader (node_exporter's textfile collector) never sees half a file. */
struct out {
	FILE *f;
	const char *path;
	char tmp[4096];
};

static int out_open(struct out *o, const char *path)
{
	o->path = path;
	if (!path) {
		o->f = stdout;
		return 0;
	}
	int n = snprintf(o->tmp, sizeof(o->tmp), "%s.tmp.%d", path, (int)getpid());
	if (n < 0 || (size_t)n >= sizeof(o->tmp)) {
		fprintf(stderr, "aoqctl: --output: path too long\n");
		return -ENAMETOOLONG;
	}
	o->f = fopen(o->tmp, "w");
	if (!o->f) {
		int e = errno;
		fprintf(stderr, "aoqctl: --output: cannot create %s: %s\n", o->tmp, strerror(e));
		return -e;
	}
	return 0;
}

/* ok: the content is complete.  Returns 0 or a negative errno (printed). */
static int out_close(struct out *o, bool ok)
{
	if (!o->path) {
		if (fflush(stdout) != 0) {
			fprintf(stderr, "aoqctl: cannot write output: %s\n", strerror(errno));
			return -EIO;
		}
		return ok ? 0 : -EIO;
	}
	bool good = ok && fflush(o->f) == 0 && !ferror(o->f) && fsync(fileno(o->f)) == 0;
	int e = errno;
	if (fclose(o->f) != 0)
		good = false;
	if (good && rename(o->tmp, o->path) < 0) {
		e = errno;
		good = false;
	}
	if (!good) {
		if (ok)
			fprintf(stderr, "aoqctl: cannot write %s: %s\n", o->path, strerror(e));
		unlink(o->tmp);
		return -EIO;
	}
	return 0;
}

/* ---- trace ------------------------------------------------------------- */

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
	JADD(args, "name", jstring(name));
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
		JADD(args, "tensor", jstring(tname));
		JADD(args, "offset", json_object_new_uint64(sp->offset));
		JADD(args, "count", json_object_new_uint64(sp->count));
		char label[160];
		snprintf(label, sizeof(label), "%s %s", span_name(sp->kind), tname);
		if (sp->kind == AOQ__TRACE_SPAN_KIND__SPAN_QUEUE_WAIT) {
			uint64_t id = (*next_id)++;
			for (int end = 0; end < 2; end++) {
				json_object *e = json_object_new_object();
				JADD(e, "name", jstring(label));
				JADD(e, "cat", json_object_new_string("queue"));
				JADD(e, "ph", json_object_new_string(end ? "e" : "b"));
				JADD(e, "id", json_object_new_uint64(id));
				JADD(e, "ts", jdouble_fmt(end ? ts + dur : ts, true));
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
		JADD(e, "name", jstring(label));
		JADD(e, "cat", json_object_new_string(span_name(sp->kind)));
		JADD(e, "ph", json_object_new_string("X"));
		JADD(e, "ts", jdouble_fmt(ts, true));
		JADD(e, "dur", jdouble_fmt(dur, true));
		JADD(e, "pid", json_object_new_uint64(t->session));
		JADD(e, "tid", json_object_new_int(tid));
		JADD(e, "args", args);
		json_object_array_add(events, e);
	}
}

/* ---- snapshot ---------------------------------------------------------- */

/* Connects as an observer, sends env and takes the reply, which must be a
 * `want` message: EXIT_OK with *rep (the caller frees it and closes
 * *sock), else the failure said on stderr (`what` names the request). */
static int observer_request(const char *path, const Aoq__Envelope *env, Aoq__Envelope__MsgCase want,
                            const char *what, int *sock_out, Aoq__Envelope **rep)
{
	int sock;
	int ret = observer_connect(path, &sock);
	if (ret != EXIT_OK)
		return ret;
	char *msg = NULL;
	*rep = NULL;
	int r = aoq_call(sock, env, rep, &msg);
	ret = EXIT_UNREACHABLE;
	if (r < 0) {
		if (msg)
			fprintf(stderr, "aoqctl: %s failed: %s\n", what, msg);
		else
			fail_unreachable(path, r, "request failed at", msg);
	} else if ((*rep)->msg_case != want) {
		fprintf(stderr, "aoqctl: aoqd at %s answered the %s with message %d, not %d\n", path, what,
		        (int)(*rep)->msg_case, (int)want);
		aoq_envelope_free(*rep);
		*rep = NULL;
	} else {
		ret = EXIT_OK;
	}
	free(msg);
	if (ret != EXIT_OK) {
		close(sock);
		return ret;
	}
	*sock_out = sock;
	return EXIT_OK;
}

static int run_snapshot(const char *path, uint64_t session)
{
	Aoq__SnapshotRequest req = AOQ__SNAPSHOT_REQUEST__INIT;
	req.session = session;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep;
	env.msg_case = AOQ__ENVELOPE__MSG_SNAPSHOT_REQUEST;
	env.snapshot_request = &req;
	char what[64];
	snprintf(what, sizeof(what), "snapshot of session %" PRIu64, session);
	int sock;
	int ret = observer_request(path, &env, AOQ__ENVELOPE__MSG_SNAPSHOT_DONE, what, &sock, &rep);
	if (ret != EXIT_OK)
		return ret;
	printf("%s\n", rep->snapshot_done->path);
	fprintf(stderr, "aoqctl: session %" PRIu64 " at step %" PRIu64 " written in %.3f s\n", session,
	        rep->snapshot_done->step, rep->snapshot_done->seconds);
	aoq_envelope_free(rep);
	close(sock);
	return EXIT_OK;
}

/* ---- drop -------------------------------------------------------------- */

static int run_drop(const char *path, uint64_t session)
{
	Aoq__DropRequest req = AOQ__DROP_REQUEST__INIT;
	req.session = session;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep;
	env.msg_case = AOQ__ENVELOPE__MSG_DROP_REQUEST;
	env.drop_request = &req;
	char what[64];
	snprintf(what, sizeof(what), "drop of session %" PRIu64, session);
	int sock;
	int ret = observer_request(path, &env, AOQ__ENVELOPE__MSG_DONE, what, &sock, &rep);
	if (ret != EXIT_OK)
		return ret;
	printf("session %" PRIu64 " dropped\n", session);
	aoq_envelope_free(rep);
	say_bye(sock);
	close(sock);
	return EXIT_OK;
}

static int run_trace(const char *path, uint64_t session, uint32_t steps, const char *output)
{
	int sock;
	int ret = observer_connect(path, &sock);
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
			else
				fail_unreachable(path, r, "trace request failed at", msg);
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
			char *job = clean_utf8(t->job);
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
				names[i] = clean_utf8(t->tensor_names[i]);
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
	say_bye(sock);
	for (uint32_t w = 0; w < max_worker && w < 4096; w++) {
		char wname[32];
		snprintf(wname, sizeof(wname), "worker %" PRIu32, w);
		json_object_array_add(events, trace_meta("thread_name", session, TID_WORKER0 + (int)w, wname));
	}
	json_object *root = json_object_new_object();
	JADD(root, "traceEvents", json_object_get(events));
	JADD(root, "displayTimeUnit", json_object_new_string("ms"));
	struct out o;
	if (out_open(&o, output) == 0) {
		const char *text = json_object_to_json_string_ext(root, JSON_C_TO_STRING_PLAIN);
		bool ok = text && fputs(text, o.f) >= 0 && fputc('\n', o.f) != EOF;
		if (out_close(&o, ok) == 0)
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

/* ---- stats and --watch --------------------------------------------------- */

static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig)
{
	(void)sig;
	interrupted = 1;
}

enum format { FMT_TABLE, FMT_JSON, FMT_PROMETHEUS };

static int show_stats(const Aoq__Stats *st, enum format fmt, bool sessions_only, bool watching, const char *output)
{
	struct view v;
	if (view_init(&v, st) < 0) {
		fprintf(stderr, "aoqctl: out of memory\n");
		return EXIT_UNREACHABLE;
	}
	struct out o;
	int r = out_open(&o, output);
	if (r == 0) {
		if (sessions_only)
			r = print_sessions(st);
		else if (fmt == FMT_JSON)
			r = print_stats_json(&v, o.f, watching);
		else if (fmt == FMT_PROMETHEUS)
			r = print_stats_prometheus(&v, o.f);
		else
			r = print_stats_table(&v);
		r = out_close(&o, r == 0);
	}
	view_fini(&v);
	return r == 0 ? EXIT_OK : EXIT_UNREACHABLE;
}

static int run_stats(const char *path, bool all, enum format fmt, bool sessions_only, double watch,
                     const char *output)
{
	int sock;
	int ret = observer_connect(path, &sock);
	if (ret != EXIT_OK)
		return ret;
	bool tty = watch > 0 && fmt == FMT_TABLE && isatty(STDOUT_FILENO);
	if (watch > 0) {
		struct sigaction sa = { .sa_handler = on_interrupt };
		sigemptyset(&sa.sa_mask);
		sigaction(SIGINT, &sa, NULL);
		sigaction(SIGTERM, &sa, NULL);
	}
	for (;;) {
		Aoq__Envelope *rep = NULL;
		ret = request_stats(sock, path, all, &rep);
		if (ret != EXIT_OK)
			break;
		if (tty)
			fputs("\033[H\033[2J", stdout); /* home, clear: redraw in place */
		else if (watch > 0 && fmt == FMT_TABLE)
			putchar('\n');
		ret = show_stats(rep->stats, fmt, sessions_only, watch > 0, output);
		aoq_envelope_free(rep);
		if (ret != EXIT_OK || watch <= 0)
			break;
		struct timespec ts = { .tv_sec = (time_t)watch,
		                       .tv_nsec = (long)((watch - floor(watch)) * 1e9) };
		while (!interrupted && nanosleep(&ts, &ts) < 0 && errno == EINTR)
			;
		if (interrupted)
			break;
	}
	say_bye(sock);
	close(sock);
	return ret;
}

/* ---- main -------------------------------------------------------------- */

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...)
{
	va_list ap;
	fputs("aoqctl: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\nTry 'aoqctl --help'.\n", stderr);
	return EXIT_USAGE;
}

/* A whole number in [lo, hi] (decimal), or false. */
static bool parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
	if (!s || *s < '0' || *s > '9')
		return false;
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || *end || v < lo || v > hi)
		return false;
	*out = v;
	return true;
}

/* Seconds for --watch: a positive decimal up to a day. */
static bool parse_seconds(const char *s, double *out)
{
	if (!s || ((*s < '0' || *s > '9') && *s != '.'))
		return false;
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno || *end || !(v >= 0.1) || v > 86400)
		return false;
	*out = v;
	return true;
}

struct args {
	const char *socket, *output;
	bool json, prometheus, all;
	double watch;
	uint64_t steps;
	bool steps_set;
};

/* Parses options of one argv (before or after the command word).  Returns
 * -1 to go on, or an exit status. */
static int parse_opts(int argc, char **argv, const char *optstring, struct args *a)
{
	static const struct option longopts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "json", no_argument, NULL, 'j' },
		{ "prometheus", no_argument, NULL, 'p' },
		{ "watch", optional_argument, NULL, 'w' },
		{ "output", required_argument, NULL, 'o' },
		{ "steps", required_argument, NULL, 'n' },
		{ "all", no_argument, NULL, 'a' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	int c;
	while ((c = getopt_long(argc, argv, optstring, longopts, NULL)) != -1) {
		switch (c) {
		case 's': a->socket = optarg; break;
		case 'j': a->json = true; break;
		case 'p': a->prometheus = true; break;
		case 'a': a->all = true; break;
		case 'o': a->output = optarg; break;
		case 'w': {
			const char *v = optarg;
			/* "--watch 5": take the next word when it is a number */
			if (!v && optind < argc && parse_seconds(argv[optind], &a->watch)) {
				optind++;
				break;
			}
			a->watch = 2;
			if (v && !parse_seconds(v, &a->watch))
				return usage_error("--watch: '%s' is not a number of seconds (0.1..86400)", v);
			break;
		}
		case 'n':
			if (!parse_u64(optarg, 1, 1000000, &a->steps))
				return usage_error("--steps: '%s' is not a whole number in 1..1000000", optarg);
			a->steps_set = true;
			break;
		case 'h': fputs(usage_text, stdout); return EXIT_OK;
		case 'V': printf("aoqctl %s (protocol %u)\n", AOQ_VERSION, AOQ_PROTOCOL_VERSION); return EXIT_OK;
		case ':': return usage_error("option '%s' needs a value", argv[optind - 1]);
		default:
			if (optopt && optopt < 256)
				return usage_error("unknown option '-%c'", optopt);
			return usage_error("unknown option '%s'", argv[optind - 1]);
		}
	}
	return -1;
}

int main(int argc, char **argv)
{
	struct args a = { .steps = 3 };
	opterr = 0;
	/* Options before the command word ('+': stop at the first non-option). */
	int r = parse_opts(argc, argv, "+:s:jpw::o:n:ahV", &a);
	if (r >= 0)
		return r;
	if (optind >= argc)
		return usage_error("no command given");
	const char *cmd = argv[optind++];

	/* Options after the command word: parse the rest as its own argv whose
	 * argv[0] is the command (optind = 0 makes glibc start afresh); the
	 * operands (trace's session id) are permuted to the end. */
	int sub_argc = argc - optind + 1;
	char **sub_argv = argv + optind - 1;
	optind = 0;
	r = parse_opts(sub_argc, sub_argv, ":s:jpw::o:n:ahV", &a);
	if (r >= 0)
		return r;
	char **operands = sub_argv + optind;
	int noperands = sub_argc - optind;

	bool is_stats = strcmp(cmd, "stats") == 0;
	bool is_sessions = strcmp(cmd, "sessions") == 0;
	bool is_trace = strcmp(cmd, "trace") == 0;
	bool is_snapshot = strcmp(cmd, "snapshot") == 0;
	bool is_drop = strcmp(cmd, "drop") == 0;
	if (!is_stats && !is_sessions && !is_trace && !is_snapshot && !is_drop)
		return usage_error("unknown command '%s'", cmd);
	uint64_t session = 0;
	if (is_drop || is_trace || is_snapshot) {
		/* one operand, the session id */
		if (noperands < 1)
			return usage_error("%s: which session? (aoqctl %s SESSION%s; ids: aoqctl sessions)", cmd, cmd,
			                   is_trace ? " -o FILE" : "");
		if (!parse_u64(operands[0], 1, UINT64_MAX, &session))
			return usage_error("%s: '%s' is not a session id", cmd, operands[0]);
		if (noperands > 1)
			return usage_error("unexpected argument '%s'", operands[1]);
	}
	if (is_drop) {
		if (a.json || a.prometheus || a.watch > 0 || a.output || a.steps_set || a.all)
			return usage_error("drop takes no options");
	} else if (is_trace) {
		if (!a.output)
			return usage_error("trace: -o FILE is required (the trace is JSON for Perfetto)");
	} else if (is_snapshot) {
		if (a.output || a.all || a.steps_set || a.json || a.prometheus || a.watch > 0)
			return usage_error("snapshot takes no options but --socket");
	} else if (noperands > 0) {
		return usage_error("unexpected argument '%s'", operands[0]);
	}
	if (a.json && a.prometheus)
		return usage_error("--json and --prometheus exclude each other");
	if ((a.json || a.prometheus || a.watch > 0) && !is_stats)
		return usage_error("--%s goes with 'stats'", a.json ? "json" : a.prometheus ? "prometheus" : "watch");
	if (a.steps_set && !is_trace)
		return usage_error("--steps goes with 'trace'");
	if (a.output && is_sessions)
		return usage_error("--output goes with 'stats' and 'trace'");
	if (a.watch > 0 && (a.prometheus || a.output))
		return usage_error("--watch does not go with %s (Prometheus scrapes pull; rewrite the file from a timer)",
		                   a.prometheus ? "--prometheus" : "--output");
	if (a.all && is_trace)
		return usage_error("--all goes with 'stats' and 'sessions'");

	char path[512];
	r = aoq_socket_path(a.socket, path, sizeof(path));
	if (r < 0) {
		fprintf(stderr, "aoqctl: socket path too long\n");
		return EXIT_USAGE;
	}
	if (is_trace)
		return run_trace(path, session, (uint32_t)a.steps, a.output);
	if (is_snapshot)
		return run_snapshot(path, session);
	if (is_drop)
		return run_drop(path, session);
	enum format fmt = a.json ? FMT_JSON : a.prometheus ? FMT_PROMETHEUS : FMT_TABLE;
	return run_stats(path, a.all, fmt, is_sessions, a.watch, a.output);
}
