/* SPDX-License-Identifier: MIT */
/* Latency histograms, the clock, and the Stats reply. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "aoq-config.h"
#include "aoqd.h"

uint64_t aoqd_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
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

static uint64_t rss_bytes(void)
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

static const char *state_name(enum aoqd_session_state st)
{
	switch (st) {
	case AOQD_HELLO: return "hello";
	case AOQD_REGISTERING: return "registering";
	case AOQD_READY: return "training";
	case AOQD_OBSERVER: return "observer";
	default: return "closing";
	}
}

static bool may_see(const struct aoqd_session *who, const struct aoqd_session *s)
{
	return who->uid == 0 || who->uid == s->uid ||
	       (who->srv->cfg.admin_gid != (uint32_t)-1 && who->gid == who->srv->cfg.admin_gid);
}

void aoqd_on_stats(struct aoqd_session *who, const Aoq__StatsRequest *m)
{
	struct aoqd_server *srv = who->srv;
	size_t n = 0;
	for (struct aoqd_session *s = srv->sessions; s; s = s->next)
		if (s->state == AOQD_READY || s->state == AOQD_REGISTERING)
			n++;
	Aoq__SessionStats *ss = calloc(n ? n : 1, sizeof(*ss));
	Aoq__SessionStats **sp = calloc(n ? n : 1, sizeof(*sp));
	if (!ss || !sp) {
		free(ss);
		free(sp);
		{ aoqd_reply_error(who, AOQ__ERROR_CODE__NO_MEMORY, "out of memory"); return; }
	}
	size_t k = 0;
	for (struct aoqd_session *s = srv->sessions; s && k < n; s = s->next) {
		if (s->state != AOQD_READY && s->state != AOQD_REGISTERING)
			continue;
		if (!may_see(who, s))
			continue;
		Aoq__SessionStats *x = &ss[k];
		aoq__session_stats__init(x);
		x->id = s->id;
		x->job = s->job ? s->job : "";
		x->rank = s->rank;
		x->uid = (uint32_t)s->uid;
		x->pid = s->pid ? s->pid : (uint32_t)s->peer_pid;
		x->device = s->device ? s->device : "";
		x->tensors = s->ntensors;
		for (uint32_t i = 0; i < s->ntensors; i++)
			x->parameters += s->tensors[i].numel;
		x->state = (char *)state_name(s->state);
		x->precision = s->precision;
		x->arena_bytes = s->arena_size;
		pthread_mutex_lock(&s->stats_lock);
		x->steps = s->steps_done;
		x->bytes_in = s->bytes_in;
		x->bytes_out = s->bytes_out;
		x->optimizer_cpu_seconds = (double)s->cpu_ns / 1e9;
		x->chunks = s->chunks;
		x->chunk_p50_us = aoqd_hist_quantile_us(&s->chunk_hist, 0.5);
		x->chunk_p99_us = aoqd_hist_quantile_us(&s->chunk_hist, 0.99);
		x->record_p50_us = aoqd_hist_quantile_us(&s->rec_hist, 0.5);
		x->record_p99_us = aoqd_hist_quantile_us(&s->rec_hist, 0.99);
		pthread_mutex_unlock(&s->stats_lock);
		x->state_bytes = s->state_bytes;
		sp[k] = x;
		k++;
	}
	Aoq__Stats st = AOQ__STATS__INIT;
	st.threads = aoqd_pool_threads(srv->pool);
	st.kernel = (char *)srv->kernel->name;
	st.locked_bytes = atomic_load(&srv->locked_bytes);
	st.rss_bytes = rss_bytes();
	st.uptime_seconds = (double)(aoqd_now_ns() - srv->start_ns) / 1e9;
	st.n_sessions = k;
	st.sessions = sp;
	st.version = AOQ_VERSION;
	st.pid = (uint32_t)getpid();
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_STATS;
	env.stats = &st;
	aoqd_send(who, &env);
	free(ss);
	free(sp);
}
