/* SPDX-License-Identifier: MIT */
/* aoqd internals: the server (loop, connections), sessions, jobs. */
#ifndef AOQD_H
#define AOQD_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "aoq-arena.h"
#include "aoq-kernel.h"
#include "aoq.pb-c.h"
#include "pool.h"

struct aoqd_config {
	const char *socket_path;  /* --socket */
	int listen_fd;            /* --listen-fd, or -1 */
	unsigned threads;         /* 0: all cores but one */
	const char *kernel;       /* NULL/"auto" or a variant name */
	int lock_memory;          /* 0 no, 1 try (default), 2 required */
	uint32_t max_sessions_per_uid;
	uint32_t max_connections;
	uint32_t max_tensors;
	uint64_t max_tensor_elems;
	uint64_t max_arena_bytes;
	uint64_t max_state_bytes_per_uid; /* 0: unlimited */
	uint32_t admin_gid;       /* sees every session; (gid_t)-1 none */
};

void aoqd_config_defaults(struct aoqd_config *c);
/* Reads "key = value" lines; unknown keys are errors. */
int aoqd_config_load(struct aoqd_config *c, const char *path);

/* Latency histogram: log2 buckets with 8 steps per octave, in ns. */
#define AOQD_HIST_BUCKETS 320
struct aoqd_hist {
	uint64_t n;
	uint32_t b[AOQD_HIST_BUCKETS];
};
void aoqd_hist_add(struct aoqd_hist *h, uint64_t ns);
double aoqd_hist_quantile_us(const struct aoqd_hist *h, double q);

uint64_t aoqd_now_ns(void);

struct aoqd_group {
	Aoq__OptimizerKind kind;
	struct aoqk_hparams hp; /* step and grad_scale filled per job */
};

struct aoqd_tensor {
	char *name;
	uint64_t numel;
	enum aoqk_dtype param_dtype, grad_dtype;
	uint32_t group;
	struct aoqk_state st;
	void *state_mem;       /* one mapping holding master, m, v, scales */
	size_t state_len;
	float *acc;            /* fp32 micro-batch accumulator, allocated on first use */
	uint64_t acc_step;     /* step whose micro-batches acc holds */
	uint64_t steps;        /* updates applied (bias correction) */
	uint64_t cur_step;     /* step of the update in progress */
	uint64_t done_elems;   /* elements with a final gradient in cur_step */
};

enum aoqd_session_state {
	AOQD_HELLO = 0,   /* waiting for Hello */
	AOQD_REGISTERING, /* Hello done; Register frames may come */
	AOQD_READY,       /* arena sent; training */
	AOQD_OBSERVER,    /* aoqctl: queries only */
	AOQD_CLOSING,
};

struct aoqd_server;

struct aoqd_session {
	struct aoqd_server *srv;
	struct aoqd_session *prev, *next; /* server's list; loop thread only */
	uint64_t id;
	_Atomic int refs;
	_Atomic bool dead;      /* set on close: workers skip its chunks */
	enum aoqd_session_state state;

	/* control connection (loop thread) */
	uv_pipe_t pipe;
	bool pipe_open;
	bool reading;
	uint8_t *rbuf;
	size_t rlen, rcap;
	pid_t peer_pid;
	uid_t uid;
	gid_t gid;
	char *job;
	uint32_t rank;
	char *device;
	uint32_t pid;

	/* registration */
	Aoq__StatePrecision precision;
	uint64_t window, seed;
	double max_grad_norm;  /* > 0: clip the step's global norm */
	bool skip_nonfinite;   /* skip a step with an inf/nan gradient */
	bool defer;            /* either: updates wait for the step's norm */
	bool delayed;          /* two param buffers, by step parity */
	uint32_t ngroups, ntensors;
	struct aoqd_group *groups;
	struct aoqd_tensor *tensors;
	uint32_t cap_groups, cap_tensors;
	bool reg_started;

	/* arena (our own copy of its layout; never read back) */
	int arena_fd;
	uint8_t *arena;
	uint64_t arena_size;
	uint32_t nslots;
	uint64_t slot_elems;
	uint64_t xfer_off, xfer_bytes;
	struct aoq_arena_slot *slots; /* private copy */
	uint32_t ring_cap;
	struct aoq_ring_cons to_daemon;   /* loop thread */
	struct aoq_ring_prod to_client;   /* under ring_lock */
	pthread_mutex_t ring_lock;
	int doorbell_in;   /* eventfd the client rings */
	int doorbell_out;  /* eventfd we ring */
	uv_poll_t doorbell_poll;
	bool poll_open;

	/* steps (loop thread, except the atomics) */
	uint64_t next_step;       /* records must carry this step */
	bool held;                /* a record of next_step + 1 waits for StepEnd */
	bool space_wait;          /* waiting for the client to free param-ring space */
	uint64_t ending_step;     /* StepEnd received, reply pending */
	bool step_end_pending;
	bool xfer_busy;                 /* a LoadState/ReadState runs on the pool */
	_Atomic bool xfer_done;
	uint64_t xfer_count;
	_Atomic uint64_t inflight[2];   /* jobs per step parity */
	_Atomic uint64_t outstanding;   /* jobs accepted, record not yet posted */
	uint64_t accepted[2];           /* records accepted per step parity */
	uint64_t arrivals;              /* records accepted, ever: the order of the pool keys */
	pthread_mutex_t step_lock;      /* guards the per-step sums and lists below */
	double sumsq[2];
	bool nonfinite[2];
	uint64_t updated[2];
	struct aoqd_job *deferred[2];   /* deferred: jobs whose norm is summed */
	_Atomic uint64_t norming[2];    /* deferred: norm jobs still running */
	bool released[2];               /* deferred: the step's updates started */
	double clip_scale[2];
	bool skipped[2];

	/* stats */
	pthread_mutex_t stats_lock;
	uint64_t bytes_in, bytes_out, chunks, cpu_ns, steps_done;
	uint64_t state_bytes, locked_bytes;
	struct aoqd_hist chunk_hist, rec_hist;

	struct aoqd_queue queue; /* pool queue; guarded by the pool */
};

struct aoqd_server {
	struct aoqd_config cfg;
	uv_loop_t *loop;
	uv_pipe_t listener;
	uv_async_t wake;          /* workers -> loop: a step may have finished */
	uv_signal_t sigterm, sigint, sighup;
	uv_timer_t watchdog;
	bool watchdog_on;
	struct aoqd_pool *pool;
	const struct aoqk_kernel *kernel;
	struct aoqd_session *sessions;
	uint64_t next_id;
	uint32_t connections;
	uint64_t start_ns;
	_Atomic uint64_t locked_bytes;
	bool stopping;
	bool bound;               /* we created the socket file (unlinked at exit) */
	int exit_code;
};

/* server.c */
int aoqd_server_init(struct aoqd_server *srv, uv_loop_t *loop, const struct aoqd_config *cfg);
void aoqd_server_stop(struct aoqd_server *srv);
void aoqd_server_fini(struct aoqd_server *srv);
int aoqd_send(struct aoqd_session *s, const Aoq__Envelope *env);
int aoqd_send_with_fds(struct aoqd_session *s, const Aoq__Envelope *env, const int *fds, int nfds);
/* Logs, sends Error{code, message}, and closes the session's connection. */
void aoqd_session_fail(struct aoqd_session *s, Aoq__ErrorCode code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* Sends an Error reply but keeps the session. */
void aoqd_reply_error(struct aoqd_session *s, Aoq__ErrorCode code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
void aoqd_session_unref(struct aoqd_session *s);
void aoqd_session_ref(struct aoqd_session *s);
void aoqd_resume_reading(struct aoqd_session *s);

/* session.c: registration and the data plane */
void aoqd_on_register(struct aoqd_session *s, const Aoq__Register *m);
void aoqd_on_set_hyperparams(struct aoqd_session *s, const Aoq__SetHyperparams *m);
/* Returns true when the reply is deferred (the connection stops reading). */
bool aoqd_on_step_end(struct aoqd_session *s, const Aoq__StepEnd *m);
/* Return true when the reply is deferred (a transfer on the pool). */
bool aoqd_on_load_state(struct aoqd_session *s, const Aoq__LoadState *m);
bool aoqd_on_read_state(struct aoqd_session *s, const Aoq__ReadState *m);
void aoqd_check_transfer(struct aoqd_session *s);
void aoqd_on_tensor_steps(struct aoqd_session *s, const Aoq__TensorSteps *m);
/* dataplane.c */
struct aoqd_job;
void aoqd_drain(struct aoqd_session *s);
bool aoqd_release_step(struct aoqd_session *s);
void aoqd_drop_deferred(struct aoqd_session *s);
void aoqd_ring_doorbell(int fd);
/* Loop thread, after a wake: sends StepEnded when the step is done. */
void aoqd_check_step_end(struct aoqd_session *s);
void aoqd_session_release_data(struct aoqd_session *s);
void aoqd_session_free_state(struct aoqd_session *s);

/* stats.c */
void aoqd_on_stats(struct aoqd_session *s, const Aoq__StatsRequest *m);

#endif
