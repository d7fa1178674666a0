/* SPDX-License-Identifier: MIT */
/* Latency histograms, the clock, and a session's counters. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "stats.h"

uint64_t aoqd_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t aoqd_wall_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Bucket i covers [2^(i/8), 2^((i+1)/8)) ns: 9% wide, up to ~1e12 ns. */
void aoqd_hist_add(struct aoqd_hist *h, uint64_t ns)
{
	unsigned b = 0;
	if (ns > 1) {
		int lz = __builtin_clzll(ns);
		unsigned oct = 63u - (unsigned)lz;
		/* three bits below the leading one pick the step in the octave */
		unsigned frac = oct >= 3 ? (unsigned)(ns >> (oct - 3)) & 7u : (unsigned)(ns << (3 - oct)) & 7u;
		b = oct * 8 + frac;
	}
	if (b >= AOQD_HIST_BUCKETS)
		b = AOQD_HIST_BUCKETS - 1;
	h->b[b]++;
	h->n++;
	h->sum_ns += ns;
}

double aoqd_hist_quantile_us(const struct aoqd_hist *h, double q)
{
	if (h->n == 0)
		return 0;
	uint64_t want = (uint64_t)ceil(q * (double)h->n);
	if (want == 0)
		want = 1;
	uint64_t seen = 0;
	for (unsigned i = 0; i < AOQD_HIST_BUCKETS; i++) {
		seen += h->b[i];
		if (seen >= want) {
			/* the bucket's midpoint */
			double lo = ldexp(1.0 + (i % 8) / 8.0, (int)(i / 8));
			double hi = ldexp(1.0 + (i % 8 + 1) / 8.0, (int)(i / 8));
			return (lo + hi) / 2 / 1000.0;
		}
	}
	return 0;
}

void aoqd_stats_init(struct aoqd_stats *st)
{
	pthread_mutex_init(&st->lock, NULL);
	st->snap_ns = aoqd_now_ns();
}

int aoqd_trace_start(struct aoqd_stats *st, uint64_t first, uint64_t last)
{
	int r = -EBUSY;
	pthread_mutex_lock(&st->lock);
	if (!st->trace.on) {
		free(st->trace.spans);
		st->trace = (struct aoqd_trace){ .on = true, .first = first, .last = last };
		r = 0;
	}
	pthread_mutex_unlock(&st->lock);
	return r;
}

void aoqd_trace_add(struct aoqd_stats *st, const struct aoqd_span *sp)
{
	struct aoqd_trace *t = &st->trace;
	if (!t->on || t->full || sp->step < t->first || sp->step > t->last)
		return;
	if (t->n == t->cap) {
		size_t cap = t->cap ? t->cap * 2 : 1024;
		if (cap > AOQD_TRACE_MAX_SPANS)
			cap = AOQD_TRACE_MAX_SPANS;
		struct aoqd_span *p = t->n < cap ? realloc(t->spans, cap * sizeof(*p)) : NULL;
		if (!p) {
			t->full = true;
			return;
		}
		t->spans = p;
		t->cap = cap;
	}
	t->spans[t->n++] = *sp;
}

static int span_cmp(const void *a, const void *b)
{
	const struct aoqd_span *x = a, *y = b;
	return x->start_ns < y->start_ns ? -1 : x->start_ns > y->start_ns;
}

struct aoqd_trace aoqd_trace_take(struct aoqd_stats *st)
{
	pthread_mutex_lock(&st->lock);
	struct aoqd_trace t = st->trace;
	st->trace = (struct aoqd_trace){ 0 };
	pthread_mutex_unlock(&st->lock);
	if (t.n)
		qsort(t.spans, t.n, sizeof(*t.spans), span_cmp);
	return t;
}

void aoqd_stats_sample(struct aoqd_stats *st, uint64_t now_ns)
{
	pthread_mutex_lock(&st->lock);
	if (now_ns > st->snap_ns) {
		double dt = (double)(now_ns - st->snap_ns) / 1e9;
		st->rate_interval_s = dt;
		st->steps_ps = (double)(st->steps_done - st->snap_steps) / dt;
		st->params_ps = (double)(st->elements - st->snap_elements) / dt;
		st->in_ps = (double)(st->bytes_in - st->snap_in) / dt;
		st->out_ps = (double)(st->bytes_out - st->snap_out) / dt;
		st->snap_ns = now_ns;
		st->snap_steps = st->steps_done;
		st->snap_elements = st->elements;
		st->snap_in = st->bytes_in;
		st->snap_out = st->bytes_out;
	}
	pthread_mutex_unlock(&st->lock);
}

void aoqd_stats_fini(struct aoqd_stats *st)
{
	free(st->trace.spans);
	pthread_mutex_destroy(&st->lock);
}

void aoqd_stats_fill(struct aoqd_stats *st, Aoq__SessionStats *x)
{
	pthread_mutex_lock(&st->lock);
	x->steps = st->steps_done;
	x->bytes_in = st->bytes_in;
	x->bytes_out = st->bytes_out;
	x->optimizer_cpu_seconds = (double)st->cpu_ns / 1e9;
	x->chunks = st->chunks;
	x->chunk_p50_us = aoqd_hist_quantile_us(&st->chunk_hist, 0.5);
	x->chunk_p99_us = aoqd_hist_quantile_us(&st->chunk_hist, 0.99);
	x->record_p50_us = aoqd_hist_quantile_us(&st->rec_hist, 0.5);
	x->record_p99_us = aoqd_hist_quantile_us(&st->rec_hist, 0.99);
	x->chunk_latency_count = st->chunk_hist.n;
	x->chunk_latency_sum_seconds = (double)st->chunk_hist.sum_ns / 1e9;
	x->record_latency_count = st->rec_hist.n;
	x->record_latency_sum_seconds = (double)st->rec_hist.sum_ns / 1e9;
	x->rate_interval_seconds = st->rate_interval_s;
	x->steps_per_second = st->steps_ps;
	x->params_per_second = st->params_ps;
	x->bytes_in_per_second = st->in_ps;
	x->bytes_out_per_second = st->out_ps;
	pthread_mutex_unlock(&st->lock);
}

uint64_t aoqd_rss_bytes(void)
{
	FILE *f = fopen("/proc/self/statm", "r");
	unsigned long size, res = 0;
	if (f) {
		if (fscanf(f, "%lu %lu", &size, &res) != 2)
			res = 0;
		fclose(f);
	}
	return (uint64_t)res * (uint64_t)sysconf(_SC_PAGESIZE);
}
