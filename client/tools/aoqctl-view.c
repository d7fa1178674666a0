/* SPDX-License-Identifier: MIT */
/*
 * aoqctl's view of one Stats reply: the per-job and per-uid rows are sums
 * over the per-session rows of that reply.  Rates (steps/s, params/s,
 * bytes/s) are the daemon's, over its own interval
 * (SessionStats.rate_interval_seconds > 0); aoqctl never diffs two replies.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "aoqctl.h"

bool ctl_has_rates(const Aoq__SessionStats *s)
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
	if (ctl_has_rates(s)) {
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

int ctl_view_init(struct view *v, const Aoq__Stats *st)
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

void ctl_view_fini(struct view *v)
{
	free(v->jobs);
	free(v->uids);
}
