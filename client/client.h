/* SPDX-License-Identifier: MIT */
/*
 * libaoq's private view of one session with aoqd (docs/design.md, "Where
 * things live"): struct aoq_client and the parts its files share.  Calls
 * between libaoq's files go one way, down that table:
 *
 *   client.c    the session's life: connect (Hello), close, version
 *   register.c  groups, tensors, Register, the arena's check
 *   transfer.c  state transfer through the arena's transfer area
 *   push.c      the data path: gradients out, parameters waited for, steps
 *   progress.c  the to-client ring: the progress thread, the waiter's poll
 *   copy.c      the backends' copies: gradients to the arena, parameters back
 *   trace.c     timed copies (aoqctl trace)
 *   control.c   the control socket, the sticky error, waits and doorbells
 *
 * Locks: ctl_lock (one request on the socket at a time), then drain_lock
 * (one consumer of the to-client ring), then lock (everything else).  No
 * backend call is made under lock.
 */
#ifndef AOQ_CLIENT_CLIENT_H
#define AOQ_CLIENT_CLIENT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "aoq-arena.h"
#include "backend.h"
#include "wire.h"

/* A backend event shared by a tensor and a staging slot (under c->lock). */
struct evref {
	struct aoq_event *ev;
	unsigned refs;
};

struct tensor {
	struct aoq_tensor d;
	size_t gsize, psize;
	uint64_t pushed;    /* records posted */
	uint64_t answered;  /* records answered */
	uint64_t copies;    /* gradient copies started */
	uint64_t copied;    /* gradient copies finished */
	/* The last parameter copy started; backends complete copies to the
	 * device in the order they start, so it covers every earlier one. */
	struct evref *h2d;
	uint8_t *grad_area, *param_area; /* no window: the tensor's own slot */
	/* The master is the parameter (aoq-arena.h): copies come from here,
	 * in the masters memfd, not from a param area.  NULL otherwise. */
	const uint8_t *master_area;
	uint64_t param_buf;  /* delayed: bytes from one param buffer to the other */
	struct aoq_event *last_use; /* recorded at push: the old value's last use */
	bool pending;        /* delayed: an update waits in the arena */
	bool released;       /* its state left aoqd (aoq_release_tensors): no more pushes */
	uint64_t pending_step;
	void *stream;        /* stream of the last push */
	/* Replica group: this rank's slice [sb, se); the step of the last
	 * final push (want) and the last step whose every element was
	 * answered (done), counted per step parity (got, got_step). */
	uint64_t sb, se;
	uint64_t want, done;
	uint64_t got[2], got_step[2];
};

/* A staging slot of the window. */
struct slot {
	uint8_t *grad_area, *param_area;
	struct evref *h2d;   /* the last copy out of its param area */
	bool busy;
	uint32_t tensor;
	uint64_t offset, count;
};

/* aoqctl trace: a copy being timed.  Only while the daemon sets the
 * to-client ring's `trace` word; the backend writes tm, the library reports
 * finished spans (TraceSpans) before each StepEnd and before Bye.  A fixed
 * pool: when every entry is taken, a copy goes untimed. */
struct cspan {
	struct aoq_copy_time tm;
	uint64_t step, offset, count;
	uint32_t tensor;
	int kind; /* Aoq__TraceSpanKind */
	bool used;
};
#define TRACE_POOL AOQ_TRACE_SPANS_MAX

struct aoq_client {
	int sock;
	pthread_mutex_t ctl_lock;
	struct aoq_options o;
	char *job, *socket_path, *device;
	const struct aoq_backend_ops *ops;
	struct aoq_backend *be;
	uint64_t session_id;
	bool xfer_at;        /* the daemon takes LoadState/ReadState's `at` (transfer.c) */
	bool release_ok;     /* the daemon takes ReleaseTensors (transfer.c) */
	bool resumed;
	uint64_t resumed_step;
	uint32_t world;      /* replica group: local ranks (0: none) */

	struct aoq_group *groups;
	uint32_t ngroups, cap_groups;
	struct tensor *tensors;
	uint32_t ntensors, cap_tensors;
	bool registered;

	uint8_t *arena;
	uint64_t arena_size;
	/* The masters memfds, mapped read-only end to end (aoq-arena.h);
	 * NULL: none.  Memfd k ends at byte masters_end[k]; bit k of
	 * masters_pinned: it is registered with the backend. */
	uint8_t *masters;
	uint64_t masters_size;
	uint64_t masters_end[AOQ_MASTER_MEMFDS];
	uint32_t masters_n;
	uint32_t masters_pinned;
	struct aoq_arena_header hdr; /* validated copy */
	int bell_out;  /* we ring the daemon */
	int bell_in;   /* the daemon rings us */
	int wake_fd;   /* stops the progress thread */
	pthread_t progress;
	bool progress_running;

	pthread_mutex_t lock; /* tensors' counters, the rings, error */
	pthread_cond_t cond;
	/* The to-client ring's one consumer at a time: the progress thread,
	 * or a waiting thread that polls it (aoqc_spin_answers).  Taken before
	 * c->lock, never while holding it. */
	pthread_mutex_t drain_lock;
	uint64_t spin_ns;     /* how long a waiting thread polls at most (AOQ_SPIN_US) */
	bool spinning;        /* a thread polls (under c->lock) */
	/* The polling thread's own (aoqc_spin_answers): the current budget and
	 * the count of polls, for the periodic full-length probe. */
	uint64_t spin_budget_ns;
	uint64_t spin_polls;
	struct aoq_ring_prod to_daemon;
	struct aoq_ring_cons to_client;
	struct slot *slots;   /* window mode */
	uint32_t *free_slots;
	uint32_t nfree;
	int error;            /* sticky: the session is over */
	bool closed_error;    /* error is the daemon's Error read after it closed */
	char errmsg[256];

	struct cspan *spans;  /* trace pool (TRACE_POOL), allocated when first traced */
	uint32_t span_next;   /* where the search for a free entry starts */
	uint32_t spans_used;  /* entries taken (0: aoqc_report_spans has nothing to do) */

	uint64_t step;        /* the step pushes belong to */
	uint64_t step_ends_pending;
	struct aoq_step_result last;
};

/* A deadline for the waits of one call, set at its first wait. */
struct deadline {
	bool set;
	struct timespec at;
};

static inline bool dtype_ok(enum aoq_dtype t)
{
	return t == AOQ_FP32 || t == AOQ_BF16 || t == AOQ_FP16;
}

#endif
