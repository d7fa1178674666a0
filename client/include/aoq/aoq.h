/* SPDX-License-Identifier: MIT */
/*
 * libaoq: stream gradients to aoqd and get updated parameters back.
 *
 * A trainer connects once, describes its parameter groups and tensors,
 * registers them (the daemon allocates the optimizer state and a shared
 * arena), then per step pushes each tensor's gradient as soon as it is
 * final and waits for the updated parameter where it is next used:
 *
 *     struct aoq_options o = AOQ_OPTIONS_INIT;
 *     o.device = "cpu"; o.job = "demo";
 *     struct aoq_client *c;
 *     aoq_connect(&c, &o);
 *     struct aoq_group hp = AOQ_GROUP_INIT;
 *     hp.kind = AOQ_ADAMW; hp.lr = 1e-3; ...
 *     int g = aoq_add_group(c, &hp);
 *     struct aoq_tensor d = AOQ_TENSOR_INIT;
 *     d.name = "w"; d.numel = n; d.group = g; d.param = w; d.grad = gw;
 *     int t = aoq_add_tensor(c, &d);
 *     aoq_register(c);
 *     for (step...) {
 *         ... backward produces gw ...
 *         aoq_push_grad(c, t, 0, NULL);
 *         aoq_step_end(c);
 *         aoq_wait_param(c, t, NULL);     // or aoq_sync(c)
 *     }
 *     aoq_close(c);
 *
 * Every function returns 0 (or a non-negative value where documented) or a
 * negative errno value.  aoq_last_error() gives a message for the last
 * failure on the calling thread, including the daemon's Error text.
 *
 * Thread safety: one client may be used from several threads; push and wait
 * calls for different tensors may run concurrently.
 *
 * Versions: the soname's number is AOQ_ABI_VERSION; it changes whenever a
 * public struct or a function's signature does.  Every public struct starts
 * with `size`, which the caller sets to sizeof the struct it was compiled
 * with (the AOQ_*_INIT initialisers do); libaoq refuses a struct whose size
 * it does not know with -EINVAL, instead of reading past or misreading it.
 * Bindings that copy the layouts by hand check aoq_abi_version() and
 * aoq_struct_size() first.
 *
 * Pointers: unless said otherwise beside it, a pointer argument is only
 * read (or written) during the call; libaoq copies what it keeps.
 */
#ifndef AOQ_AOQ_H
#define AOQ_AOQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(AOQ_BUILDING_LIBRARY)
#define AOQ_API __attribute__((visibility("default")))
#else
#define AOQ_API
#endif

#define AOQ_VERSION_STRING "0.1.0"
/* The ABI: the soname is libaoq.so.AOQ_ABI_VERSION. */
#define AOQ_ABI_VERSION 5 /* 2: struct aoq_group gained momentum, dampening, nesterov;
                           * 3: struct aoq_options gained lease_seconds;
                           * 4: struct aoq_options gained local_world, local_rank;
                           * 5: struct aoq_options gained master_bits */

enum aoq_dtype {
	AOQ_FP32 = 0,
	AOQ_BF16 = 1,
	AOQ_FP16 = 2,
};

enum aoq_optimizer {
	AOQ_ADAMW = 0, /* lr, beta1, beta2, eps, weight_decay (decoupled) */
	AOQ_ADAM = 1,  /* the same, weight_decay as L2 into the gradient */
	AOQ_SGD = 2,   /* torch.optim.SGD: lr, momentum, dampening, nesterov, weight_decay
	                * (L2); state precisions FP32, BF16, BF16_ALL only */
	AOQ_LION = 3,  /* Lion: lr, beta1, beta2, weight_decay (decoupled); same precisions */
};

/* Optimizer state precision of the session (see kernels/README.md). */
enum aoq_precision {
	AOQ_STATE_FP32 = 0,    /* fp32 master, m, v: 12 bytes per parameter */
	AOQ_STATE_Q8 = 1,      /* fp32 master, 8-bit blockwise m, v */
	AOQ_STATE_BF16 = 2,    /* bf16 master with stochastic rounding, fp32 m, v */
	AOQ_STATE_BF16_Q8 = 3, /* bf16 master, 8-bit m, v */
	AOQ_STATE_BF16_ALL = 4, /* bf16 master, m, v: 6 bytes per parameter */
	AOQ_STATE_Q4 = 5,      /* fp32 master, 4-bit blockwise m, v */
	AOQ_STATE_BF16_Q4 = 6, /* bf16 master, 4-bit m, v: about 3 bytes per parameter */
};

/* Which part of a tensor's optimizer state aoq_read_state() and
 * aoq_load_state() move (values match the protocol's StateKind). */
enum aoq_state_kind {
	AOQ_MASTER = 0,     /* the fp32 (or bf16) master weights */
	AOQ_EXP_AVG = 1,    /* Adam's first moment; SGD's momentum buffer, Lion's m */
	AOQ_EXP_AVG_SQ = 2, /* Adam's second moment (SGD, Lion: none, -EINVAL) */
};

/* Flags of aoq_push_grad(). */
enum {
	/* A non-final micro-batch: the daemon adds the gradient to an fp32
	 * accumulator and updates nothing.  The final push (without this
	 * flag) updates with the sum. */
	AOQ_PUSH_ACCUMULATE = 1u << 0,
};

/* Read by aoq_connect(); the strings are copied. */
struct aoq_options {
	uint32_t size;      /* sizeof(struct aoq_options) */
	const char *socket; /* NULL: $AOQ_SOCKET, else /run/aoq/aoqd.sock when it
	                     * exists, else $XDG_RUNTIME_DIR/aoq/aoqd.sock */
	const char *job;    /* job name; the session key is (uid, job, rank) */
	uint32_t rank;
	const char *device; /* "cpu" (host backend), "cuda:N", "xpu:N" */
	enum aoq_precision precision;
	uint64_t window;    /* staging bytes; 0 = a slot per tensor */
	uint64_t seed;      /* stochastic rounding seed; 0 = daemon's choice */
	/* Global gradient-norm clipping over every tensor of the session, as
	 * torch.nn.utils.clip_grad_norm_: 0 = off.  Updates then start once
	 * the step's last gradient has landed (the norm is summed as they land). */
	double max_grad_norm;
	/* Skip the whole step (no state changes) when any gradient of it is
	 * inf or nan, as GradScaler does; reported by aoq_sync(). */
	bool skip_nonfinite;
	/* Delayed parameter update (ZeRO-Offload's DPU): the update of step N
	 * lands on the device during step N+1, when tensor t's next gradient
	 * is pushed; the model trains on parameters one step stale.
	 * aoq_flush() applies the pending updates (before eval or saving). */
	bool delayed_update;
	/* Borrowed until aoq_close(): the caller keeps these alive. */
	void *cuda_stream;  /* default stream for push/wait (cudaStream_t), or NULL */
	void *ze_context;   /* Level Zero handles to use as given, or NULL */
	void *ze_device;
	void *ze_queue;
	/* Deadline, in milliseconds, of connecting, of each request to aoqd
	 * (registration included) and of each wait for the daemon (push,
	 * wait, sync): past it the call fails with -ETIMEDOUT and the session
	 * is over.  0: AOQ_DEFAULT_TIMEOUT_MS; AOQ_TIMEOUT_NONE: wait forever. */
	uint32_t timeout_ms;
	/* Lease (ABI 3): how long aoqd keeps this session's optimizer state
	 * when the trainer dies or disconnects without aoq_close(), for a
	 * trainer of the same (uid, job, rank) and layout to resume it (see
	 * aoq_resumed()).  0: the daemon's lease_seconds (its cap);
	 * AOQ_LEASE_NONE: no lease (and no undo copy of the state). */
	uint32_t lease_seconds;
	/* Replica group (ABI 4; docs/design.md, "Replica groups"): with
	 * local_world >= 2, the local_world data-parallel ranks of this job on
	 * this node (local ranks 0 .. local_world - 1) share one optimizer
	 * state in aoqd, keyed (uid, job).  Every rank registers the same
	 * layout and pushes the same (averaged) gradients; libaoq sends only
	 * this rank's slice of each (aoq_slice() of <aoq-arena.h>), and every
	 * rank's parameters receive the whole update.  Needs window 0 and no
	 * delayed update; no lease.  A rank that goes away mid-step fails the
	 * others' calls with -ECONNABORTED (PEER_LOST).  0 or 1: a session of
	 * its own. */
	uint32_t local_world;
	uint32_t local_rank;
	/* The master's bits where aoqd splits it (ABI 5): an fp32 master
	 * (AOQ_STATE_Q8 or AOQ_STATE_Q4) beside a bf16 parameter is kept as
	 * the parameter plus its low bits (kernels/README.md, "The split
	 * master").  0 or 32: all 16 low bits, the fp32 master; 24: 8 of them,
	 * the 24-bit master, rounded stochastically at each update (2 bytes
	 * per parameter and step less to move; "The 24-bit master").  Masters
	 * that are not split (fp32 parameters) stay fp32. */
	uint32_t master_bits;
};

#define AOQ_LEASE_NONE UINT32_MAX

#define AOQ_DEFAULT_TIMEOUT_MS 120000u
#define AOQ_TIMEOUT_NONE UINT32_MAX

#define AOQ_OPTIONS_INIT { .size = sizeof(struct aoq_options), .job = "default", .device = "cpu" }

/* Read by aoq_add_group() and aoq_set_hyperparams() (copied). */
struct aoq_group {
	uint32_t size;      /* sizeof(struct aoq_group) */
	enum aoq_optimizer kind;
	double lr;
	double beta1;
	double beta2;
	double eps;
	double weight_decay;
	/* AOQ_SGD only (torch.optim.SGD's arguments; ignored otherwise).
	 * nesterov needs momentum > 0 and dampening 0.  A group registered
	 * with momentum 0 keeps no momentum buffer: aoq_set_hyperparams() may
	 * not give it one later.  ABI 2. */
	double momentum;  /* [0, 1) */
	double dampening; /* [0, 1] */
	bool nesterov;
};

#define AOQ_GROUP_INIT { .size = sizeof(struct aoq_group) }

/* Read by aoq_add_tensor(). */
struct aoq_tensor {
	uint32_t size;    /* sizeof(struct aoq_tensor) */
	const char *name; /* copied */
	uint64_t numel;
	enum aoq_dtype param_dtype;
	enum aoq_dtype grad_dtype;
	uint32_t group;
	/* Device (or host, for "cpu") parameter, borrowed until aoq_close():
	 * the initial value is read from it at aoq_register(), every update
	 * lands in it. */
	void *param;
	/* Device gradient buffer, borrowed until aoq_close(): every
	 * aoq_push_grad() copies from it.  May be NULL, the gradient then given
	 * per push with aoq_push_grad_ptr(). */
	const void *grad;
	/* Initial master values in another dtype (e.g. the fp32 master of a bf16
	 * model), or NULL to start from `param`.  Host memory, read only by
	 * aoq_register(): it may be freed once that returns. */
	const void *init;
	enum aoq_dtype init_dtype;
};

#define AOQ_TENSOR_INIT { .size = sizeof(struct aoq_tensor) }

struct aoq_client;

AOQ_API const char *aoq_last_error(void);
AOQ_API const char *aoq_dtype_name(enum aoq_dtype t);

/* This library's version (AOQ_VERSION_STRING when it matches the header). */
AOQ_API const char *aoq_version(void);
/* This library's AOQ_ABI_VERSION. */
AOQ_API int aoq_abi_version(void);
/* sizeof a public struct as this library knows it, by name ("aoq_options",
 * "aoq_group", "aoq_tensor", "aoq_step_result"); 0 for another name. */
AOQ_API size_t aoq_struct_size(const char *name);

/* Connects and performs the handshake.  opts may be NULL (the defaults of
 * AOQ_OPTIONS_INIT).  The client is the caller's until aoq_close(). */
AOQ_API int aoq_connect(struct aoq_client **out, const struct aoq_options *opts);

/* Describe before aoq_register().  Return the index of the group/tensor. */
AOQ_API int aoq_add_group(struct aoq_client *c, const struct aoq_group *g);
AOQ_API int aoq_add_tensor(struct aoq_client *c, const struct aoq_tensor *t);

/* Sends the description, maps and pins the arena, loads initial values. */
AOQ_API int aoq_register(struct aoq_client *c);

/* The session's stochastic rounding seed (the daemon's choice when the
 * options gave 0): save it with a checkpoint and pass it as options.seed
 * when restoring, so a bf16 master continues bit for bit. */
AOQ_API uint64_t aoq_session_seed(struct aoq_client *c);

/* After aoq_register(): 1 when the registration resumed a leased session
 * of the same (uid, job, rank) and layout (its optimizer state, step
 * counters, hyperparameters and seed carried over; the step the previous
 * trainer left unfinished discarded), with *step (may be NULL) the last
 * completed step: training goes on at *step + 1 (aoq_current_step()), and
 * every tensor's `param` buffer holds the resumed parameter, the initial
 * values being ignored.  0 when the session started afresh. */
AOQ_API int aoq_resumed(struct aoq_client *c, uint64_t *step);

/* The step that the next pushes belong to (1-based). */
AOQ_API uint64_t aoq_current_step(struct aoq_client *c);

/* Pushes tensor t's gradient (from its registered grad buffer).  With a
 * device backend, the copy is ordered after the work already on `stream`
 * (NULL: the options' stream) and the call does not block on it. */
AOQ_API int aoq_push_grad(struct aoq_client *c, uint32_t t, unsigned flags, void *stream);
/* The same from `grad`, which must stay valid and unchanged until the copy
 * finished (aoq_grad_copied(), or aoq_grad_pending() == 0). */
AOQ_API int aoq_push_grad_ptr(struct aoq_client *c, uint32_t t, const void *grad,
                              unsigned flags, void *stream);

/* Host-blocking until tensor t's last pushed gradient has been copied off
 * the device (the buffer may be freed or reused). */
AOQ_API int aoq_grad_copied(struct aoq_client *c, uint32_t t);
/* Without blocking: how many of tensor t's pushed gradient copies have not
 * finished (0: every buffer pushed so far may be freed or reused). */
AOQ_API int aoq_grad_pending(struct aoq_client *c, uint32_t t);

/* Makes `stream` wait until tensor t's updated parameter has landed, without
 * blocking the host.  With the host backend this blocks. */
AOQ_API int aoq_wait_param(struct aoq_client *c, uint32_t t, void *stream);
/* Host-blocking form. */
AOQ_API int aoq_sync_param(struct aoq_client *c, uint32_t t);

/* Hyperparameters of group g from the next step on.  Call between
 * aoq_step_end() and the first push of the next step. */
AOQ_API int aoq_set_hyperparams(struct aoq_client *c, uint32_t g, const struct aoq_group *hp);

/* Ends the current step (every gradient of it has been pushed); returns at
 * once.  aoq_sync() waits for it. */
AOQ_API int aoq_step_end(struct aoq_client *c);

/* Written by aoq_sync(); the caller sets size (AOQ_STEP_RESULT_INIT). */
struct aoq_step_result {
	uint32_t size;           /* sizeof(struct aoq_step_result) */
	uint64_t step;
	double grad_sumsq;       /* sum of squares of the step's gradients (before clipping) */
	bool nonfinite;          /* some gradient was inf or nan */
	bool skipped;            /* the step changed nothing (skip_nonfinite) */
	double clip_scale;       /* factor applied to the gradients (1 = none) */
	uint64_t tensors_updated;
};

#define AOQ_STEP_RESULT_INIT { .size = sizeof(struct aoq_step_result) }

/* Waits for every pushed gradient's parameter and every ended step; the
 * result of the last ended step goes to *last when non-NULL. */
AOQ_API int aoq_sync(struct aoq_client *c, struct aoq_step_result *last);

/* Delayed update: copies every pending updated parameter to the device
 * now (host-blocking).  A no-op otherwise. */
AOQ_API int aoq_flush(struct aoq_client *c);

/* Optimizer state transfer (checkpoints): elements [offset, offset + count)
 * of tensor t's state `what`, to or from a host buffer of `count` elements
 * of `dtype` (used during the call only). */
AOQ_API int aoq_read_state(struct aoq_client *c, uint32_t t, enum aoq_state_kind what, enum aoq_dtype dtype,
                           uint64_t offset, uint64_t count, void *dst);
AOQ_API int aoq_load_state(struct aoq_client *c, uint32_t t, enum aoq_state_kind what, enum aoq_dtype dtype,
                           uint64_t offset, uint64_t count, const void *src);
/* Per-tensor step counters (Adam bias correction). */
AOQ_API int aoq_get_tensor_steps(struct aoq_client *c, uint32_t first, uint32_t n, uint64_t *steps);
AOQ_API int aoq_set_tensor_steps(struct aoq_client *c, uint32_t first, uint32_t n, const uint64_t *steps);

/* The caller steps tensors[0..n) itself from now on (the PyTorch binding's
 * GPU share): aoqd frees their state and takes it off the uid's quota
 * (*bytes, when non-NULL: the bytes given back).  Read their state first
 * (aoq_read_state): it is gone after.  Their gradients may not be pushed
 * again, a delayed update still pending for them never lands (aoq_flush
 * leaves them alone), and the session can no longer be snapshot.  Waits for every
 * update in flight (aoq_sync).  -EINVAL for an index out of range or
 * released before; -EOPNOTSUPP from an aoqd older than the call; an
 * error from aoqd (the session goes on) in a session with a lease or in
 * a replica group, whose state must stay whole. */
AOQ_API int aoq_release_tensors(struct aoq_client *c, const uint32_t *tensors, uint32_t n, uint64_t *bytes);

/* Ends the session cleanly and frees the client; the borrowed buffers
 * (param, grad, streams) are the caller's again. */
AOQ_API void aoq_close(struct aoq_client *c);

/* One Adam/AdamW step of a tensor whose state stays on a CUDA device as an
 * fp32 master and q8 moments in aoqd's format (kernels/README.md, "q8
 * moments"): what aoq.torch's GPU share (gpu_state_budget=) runs for the
 * default precision, 6 bytes of device state per parameter.  Every pointer
 * is device memory of one tensor on CUDA device `device`: param (n elements
 * of param_dtype, written from the new master), grad (n of grad_dtype), the
 * master, m and v (n bytes each, the codes), m_scale and v_scale (ceil(n /
 * 256) floats each).  The master is `master` (n floats; param itself for an
 * fp32 parameter), or, with master NULL and a bf16 parameter, `master_lo`:
 * the low 16 bits of an fp32 master whose high half is the parameter (its
 * rounding to nearest; kernels/README.md, "The same format on the GPU"), 2
 * bytes per parameter.  step counts from 1 (after this step's
 * increment); seed keys the stochastic rounding of the codes.  Enqueued on
 * cuda_stream (a cudaStream_t; NULL: the legacy default stream), not waited
 * for.  Returns 0, -EINVAL (a bad argument), -ENOTSUP (this libaoq was built
 * without CUDA) or the launch's error. */
struct aoq_device_step {
	uint32_t size;              /* sizeof(struct aoq_device_step) */
	int device;                 /* CUDA device index */
	void *param;
	enum aoq_dtype param_dtype;
	const void *grad;
	enum aoq_dtype grad_dtype;
	float *master;
	uint16_t *master_lo;        /* instead of master, beside a bf16 param */
	uint8_t *m, *v;
	float *m_scale, *v_scale;
	uint64_t n;
	double lr, beta1, beta2, eps, weight_decay;
	bool decoupled;             /* AdamW's decay; false: Adam's L2 */
	uint64_t step;
	uint64_t seed;
	float grad_scale;           /* the gradient is multiplied by it (1: as is) */
	/* The launch's grid at most this many blocks of 256 threads, 0 as
	 * many as n needs (a struct whose size ends before this field: 0).
	 * State in pinned host memory (the buffers may be any memory the
	 * device reaches) makes the kernel wait on PCIe, not on the SMs: a few
	 * SMs' worth keeps the link busy and leaves the rest to the trainer. */
	uint32_t max_blocks;
};

AOQ_API int aoq_device_adam_q8(const struct aoq_device_step *s, void *cuda_stream);

/* Level Zero backend: the staging mode of the most recently registered
 * arena ("none" before one; a diagnostic).  A static string. */
AOQ_API const char *aoq_ze_staging_mode(void);

#ifdef __cplusplus
}
#endif

#endif
