/* SPDX-License-Identifier: MIT */
/*
 * Steps of a session (steps.c): what is in flight, the per-step sums, the
 * StepEnd reply.  Loop thread, except the atomics and what `lock`
 * guards, which the data plane's workers update.
 */
#ifndef AOQD_STEPS_H
#define AOQD_STEPS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "aoq.pb-c.h"
#include "error.h"

struct aoqd_pool;

struct aoqd_job;
struct aoqd_session;

/*
 * What the session gives its steps, data plane and transfers (session.c,
 * aoqd_session_new): they hold the session while a job, a transfer or a
 * snapshot request runs for it, and let it go when done.  The last release
 * may free the session, on whichever thread drops it.  Any thread.
 */
struct aoqd_steps_ops {
	void (*hold)(struct aoqd_session *s);
	void (*release)(struct aoqd_session *s);
};

struct aoqd_steps {
	const struct aoqd_steps_ops *ops;
	uint64_t next_step;       /* records must carry this step */
	bool held;                /* a record of next_step + 1 waits for StepEnd */
	bool space_wait;          /* waiting for the client to free param-ring space */
	uint64_t ending_step;     /* StepEnd received, reply pending */
	bool end_pending;
	/* end_pending for the workers: the one that ends a step's last job
	 * wakes the loop only while a StepEnd waits for it (set before the
	 * loop looks at inflight, cleared with end_pending) */
	_Atomic bool end_waits;
	bool xfer_busy;                 /* a LoadState/ReadState runs on the pool */
	_Atomic bool xfer_done;
	uint64_t xfer_count;
	_Atomic uint64_t inflight[2];   /* jobs per step parity */
	_Atomic uint64_t outstanding;   /* jobs accepted, record not yet posted */
	uint64_t accepted[2];           /* records accepted per step parity */
	bool open;                      /* a step is open in the pool (dataplane.h, aoqd_step_open) */
	uint64_t arrivals;              /* records accepted, ever: the order of the pool keys */
	pthread_mutex_t lock;           /* guards the per-step sums and lists below */
	double sumsq[2];
	bool nonfinite[2];
	uint64_t updated[2];
	struct aoqd_job *deferred[2];   /* deferred: jobs whose norm is summed */
	_Atomic uint64_t norming[2];    /* deferred: norm jobs still running */
	bool released[2];               /* deferred: the step's updates started */
	double clip_scale[2];
	bool skipped[2];
};

void aoqd_steps_init(struct aoqd_steps *st);
void aoqd_steps_fini(struct aoqd_steps *st);
/* Nothing in flight: no update accepted and unanswered, no StepEnd
 * pending (state transfers need it). */
bool aoqd_steps_idle(struct aoqd_steps *st);

/*
 * Snapshots (snapshot.c does the work): arms one of s (READY) at its next
 * step boundary, its last completed step when it is between steps (no
 * record of the open step taken, no StepEnd pending), else the end of the
 * open step.  who: the aoqctl session that asked, which gets SnapshotDone
 * or Error when the file is on disk; NULL for a periodic one.  0 or -errno
 * with err filled (a refusal).  Loop thread.
 */
int aoqd_steps_snapshot(struct aoqd_session *s, struct aoqd_session *who, struct aoqd_error *err);
/* The 1 s sampler's look at s (loop thread): a snapshot waiting for the
 * step after its boundary learns whether the session is idle. */
void aoqd_steps_sample(struct aoqd_session *s);

/* Handler of StepEnd (a deferred reply while updates run). */
int aoqd_on_step_end(struct aoqd_session *s, const Aoq__Envelope *env, struct aoqd_error *err);
/* After a wake, or a doorbell (doorbell: true): takes records, releases a
 * deferred step,
 * answers StepEnd when its step is done.  1 when it answered (the
 * connection reads again), 0 when not, -errno with err filled. */
int aoqd_steps_poll(struct aoqd_session *s, bool doorbell, struct aoqd_error *err);

#endif
