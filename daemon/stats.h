/* SPDX-License-Identifier: MIT */
/* Counters and latency histograms of a session, the clock, and the Stats
 * reply's per-session and daemon-wide parts (stats.c). */
#ifndef AOQD_STATS_H
#define AOQD_STATS_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "aoq.pb-c.h"

uint64_t aoqd_now_ns(void);
/* CLOCK_REALTIME, ns since the epoch. */
uint64_t aoqd_wall_ns(void);

/* Latency histogram: log2 buckets with 8 steps per octave, in ns. */
#define AOQD_HIST_BUCKETS 320
struct aoqd_hist {
	uint64_t n;
	uint64_t sum_ns;
	uint32_t b[AOQD_HIST_BUCKETS];
};
void aoqd_hist_add(struct aoqd_hist *h, uint64_t ns);
double aoqd_hist_quantile_us(const struct aoqd_hist *h, double q);

/* A trace (aoqctl trace): the daemon's spans of steps [first, last], in
 * CLOCK_MONOTONIC ns.  Bounded: past AOQD_TRACE_MAX_SPANS spans it records
 * no more (full). */
enum aoqd_span_kind { AOQD_SPAN_D2H = 0, AOQD_SPAN_QUEUE_WAIT = 1, AOQD_SPAN_CPU = 2, AOQD_SPAN_H2D = 3 }; /* = TraceSpanKind */
struct aoqd_span {
	uint64_t step, start_ns, dur_ns, offset, count;
	uint32_t tensor, kind, worker;
};
#define AOQD_TRACE_MAX_SPANS (1u << 18) /* 256 Ki spans, 14 MiB */
struct aoqd_trace {
	bool on;
	bool full;
	uint64_t first, last;
	struct aoqd_span *spans;
	size_t n, cap;
};

/* A session's counters; workers add to them under lock. */
struct aoqd_stats {
	pthread_mutex_t lock;
	uint64_t bytes_in, bytes_out, chunks, cpu_ns, steps_done;
	uint64_t elements; /* parameters updated (records answered UPDATED) */
	struct aoqd_hist chunk_hist, rec_hist;
	/* Rates over the last sampling interval (aoqd_stats_sample, loop
	 * thread); rate_interval_s == 0: none yet. */
	uint64_t snap_ns, snap_steps, snap_elements, snap_in, snap_out;
	double rate_interval_s, steps_ps, params_ps, in_ps, out_ps;
	struct aoqd_trace trace;
};

void aoqd_stats_init(struct aoqd_stats *st);
void aoqd_stats_fini(struct aoqd_stats *st);
/* Ends a sampling interval at now_ns: the rates become the counters' change
 * since the last call (or since aoqd_stats_init) over the time between. */
void aoqd_stats_sample(struct aoqd_stats *st, uint64_t now_ns);
/* Copies the counters into x (under the lock). */
void aoqd_stats_fill(struct aoqd_stats *st, Aoq__SessionStats *x);

/* Starts recording steps [first, last]; -EBUSY when a trace is on. */
int aoqd_trace_start(struct aoqd_stats *st, uint64_t first, uint64_t last);
/* Adds a span when its step is traced (the caller holds st->lock). */
void aoqd_trace_add(struct aoqd_stats *st, const struct aoqd_span *sp);
/* Stops the trace and hands its spans over, sorted by start (free them). */
struct aoqd_trace aoqd_trace_take(struct aoqd_stats *st);

/* The process's resident set, in bytes. */
uint64_t aoqd_rss_bytes(void);

#endif
