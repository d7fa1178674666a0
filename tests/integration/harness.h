/* SPDX-License-Identifier: MIT */
/*
 * Test harness shared by the integration, hostile and bench programs:
 * starting the built aoqd on a socket the test created, failure reporting
 * with the run's random seed, dtype conversions written independently of
 * the daemon, a double-precision Adam/AdamW reference, and raw-protocol
 * helpers for clients that do not use libaoq.
 */
#ifndef AOQ_TEST_HARNESS_H
#define AOQ_TEST_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

#include <aoq/aoq.h>

#include "wire.h"

/* ---- failures ---------------------------------------------------------- */

/* Exit status meson reads as "skipped". */
#define AOQT_SKIP 77

/* The run's seed: $AOQ_TEST_SEED when set, else from the clock and pid.
 * aoqt_init() prints it; every failure prints it again. */
extern uint64_t aoqt_seed;
void aoqt_init(const char *test_name);

/* Prints "FAIL file:line: message", the seed and the tail of the daemon's
 * log (when one runs), then exits 1.  Safe from any thread. */
__attribute__((noreturn, format(printf, 3, 4)))
void aoqt_fail_at(const char *file, int line, const char *fmt, ...);
#define aoqt_fail(...) aoqt_fail_at(__FILE__, __LINE__, __VA_ARGS__)

#define CHECK(cond, ...)                                                  \
	do {                                                              \
		if (!(cond))                                              \
			aoqt_fail_at(__FILE__, __LINE__, "check '%s' failed: " \
			             "%s", #cond, aoqt_fmt(__VA_ARGS__));      \
	} while (0)
/* A libaoq/wire call that must return >= 0. */
#define CHECK_OK(expr)                                                          \
	do {                                                                    \
		long long r_ = (long long)(expr);                               \
		if (r_ < 0)                                                     \
			aoqt_fail_at(__FILE__, __LINE__, "%s = %lld (%s): %s", #expr, \
			             r_, strerror((int)-r_), aoq_last_error());  \
	} while (0)

/* printf into a thread-local buffer (for CHECK messages). */
__attribute__((format(printf, 1, 2))) const char *aoqt_fmt(const char *fmt, ...);

/* ---- random numbers ---------------------------------------------------- */

struct aoqt_rng {
	uint64_t s;
};
static inline uint64_t aoqt_next(struct aoqt_rng *r)
{
	/* splitmix64 */
	uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}
/* Uniform in [-1, 1). */
static inline double aoqt_uniform(struct aoqt_rng *r)
{
	return (double)(aoqt_next(r) >> 11) * 0x1p-52 - 1.0;
}
static inline struct aoqt_rng aoqt_rng_for(uint64_t a, uint64_t b, uint64_t c)
{
	struct aoqt_rng r = { aoqt_seed ^ (a * 0x100000001b3ull) ^ (b << 32) ^ (c * 0x9e3779b97f4a7c15ull) };
	aoqt_next(&r);
	return r;
}

/* ---- a victim trainer's tensors (hostile and shared-node tests) ---------- */

struct aoqt_tdesc {
	uint64_t n;
	enum aoq_dtype gd, pd;
	uint32_t group;
};
struct aoqt_ref;
struct aoq_client;
/*
 * Describes tensors "w0".."w<n-1>" of d to c: for each a param buffer of
 * random values in [-1, 1) (from aoqt_rng_for(seed, t, 0), rounded to its
 * dtype, and ref[t] starting from them), a grad buffer and an fp32 gradient
 * buffer gval (malloc'ed; the caller's).  Fails the test on an error.
 */
void aoqt_victim_tensors(struct aoq_client *c, const struct aoqt_tdesc *d, int n, uint64_t seed, void **param,
                         void **grad, float **gval, struct aoqt_ref *ref);

/*
 * A victim trainer (the hostile tests: a session others attack, which must
 * stay exact): two groups (0 AdamW, 1 Adam, lr varying with the step),
 * d's n tensors, each step's gradients from aoqt_rng_for(gseed + k, t, 0),
 * every parameter checked against the double reference after each step.
 */
struct aoqt_victim {
	struct aoq_client *c;
	const char *job;
	const struct aoqt_tdesc *d;
	int n;
	uint64_t gseed;
	void **param;          /* the caller's array of n (filled by open) */
	void **grad;
	float **gval;
	struct aoqt_ref *ref;
};
/* Group g's hyperparameters at step k. */
struct aoq_group aoqt_victim_group(uint32_t g, uint64_t k);
/* Connects (device "cpu"; timeout_ms when > 0), adds the groups, describes
 * the tensors (aoqt_victim_tensors with seed) and registers.  Fails the
 * test on an error. */
void aoqt_victim_open(struct aoqt_victim *v, const char *socket, const char *job, int timeout_ms,
                      const struct aoqt_tdesc *d, int n, uint64_t seed, uint64_t gseed, void **param);
/* Step k (1-based): hyperparameters, every gradient pushed, StepEnd, sync,
 * then the parameters checked against the reference.  Fails the test on
 * an error or a difference. */
void aoqt_victim_step(struct aoqt_victim *v, uint64_t k);
/* aoq_close and the buffers (the params stay the caller's). */
void aoqt_victim_close(struct aoqt_victim *v);

/* A trainer of nt fp32 tensors of n elements each (AdamW, host backend)
 * with fixed gradients: the fair-share test and benchmark.  aoqt_job_step
 * pushes every tensor, ends the step and syncs; returns its seconds. */
struct aoqt_job {
	struct aoq_client *c;
	uint32_t nt;
	float **p, **g;
};
void aoqt_job_open(struct aoqt_job *j, const char *sock, const char *job, uint32_t nt, uint64_t n);
double aoqt_job_step(struct aoqt_job *j);
void aoqt_job_close(struct aoqt_job *j);

/* ---- the daemon -------------------------------------------------------- */

struct aoqt_daemon {
	pid_t pid;
	char dir[96];      /* temp dir holding the socket and the log */
	char socket[108];
	char log[160];
	int pidfd;
};

/* aoqd's path: argv[1] when given, else $AOQD. */
const char *aoqt_aoqd_path(int argc, char **argv);

/*
 * Creates a listening socket in a new temp dir, then forks and execs
 * `exe --listen-fd N` followed by `args` (NULL-terminated, may be NULL),
 * stderr to d->log, PR_SET_PDEATHSIG(SIGTERM).  Clients can connect as soon
 * as this returns.  Call from the main thread: the death signal follows the
 * thread that forked.
 */
int aoqt_daemon_start(struct aoqt_daemon *d, const char *exe, const char *const *args);
/* SIGTERM, then waits up to timeout_ms; returns the exit status (0..255),
 * or -1 when it died by a signal or had to be killed.  Removes the dir
 * when remove_dir. */
int aoqt_daemon_stop(struct aoqt_daemon *d, int timeout_ms, bool remove_dir);
bool aoqt_daemon_alive(struct aoqt_daemon *d);
/* Whole log (malloc'ed, NUL-terminated). */
char *aoqt_daemon_log(struct aoqt_daemon *d);
size_t aoqt_daemon_log_size(struct aoqt_daemon *d);
/* Waits (inotify, no sleeps) until at least min_lines lines of the log
 * mention "session <id>" (not followed by a digit); true when they do
 * within timeout_ms. */
bool aoqt_wait_log_session(struct aoqt_daemon *d, uint64_t id, int min_lines, int timeout_ms);
/* Waits until the log grew past `size`. */
bool aoqt_wait_log_growth(struct aoqt_daemon *d, size_t size, int timeout_ms);
/* Open fds of a process, or -1. */
int aoqt_count_fds(pid_t pid);
/* VmRSS of a process in bytes, or 0. */
uint64_t aoqt_rss_bytes(pid_t pid);

/* ---- dtypes (independent of the daemon's casts) ------------------------ */

size_t aoqt_dtype_size(enum aoq_dtype t);
/* x rounded to the nearest value of dtype t, ties to even, overflow to inf. */
double aoqt_round(double x, enum aoq_dtype t);
/* Bits of aoqt_round(x, t) in dtype t (fp32: the float's bits). */
uint32_t aoqt_encode(double x, enum aoq_dtype t);
double aoqt_decode(uint32_t bits, enum aoq_dtype t);
void aoqt_store(void *buf, size_t i, enum aoq_dtype t, double x);
double aoqt_load(const void *buf, size_t i, enum aoq_dtype t);
uint32_t aoqt_bits(const void *buf, size_t i, enum aoq_dtype t);
/* Distance in units in the last place between two values of dtype t
 * (monotone integer order, so -0 and +0 are 0 apart).  NaN: UINT64_MAX. */
uint64_t aoqt_ulp_dist(uint32_t a, uint32_t b, enum aoq_dtype t);

/* ---- the reference optimizer (double precision) ------------------------ */

/*
 * One tensor's state, every operation in double (the daemon derives its
 * per-step constants from the double hyperparameters and rounds them to
 * float once).
 *
 * err[i] bounds how far an fp32 implementation may be from p[i]: each step
 * adds AOQT_RTOL * |p| (rounding of the master, about 8 ulp of fp32) plus
 * AOQT_UTOL * |change of this step| (v in fp32, and bias corrections that
 * an fp32 kernel may compute with powf: 1 - beta2^k loses digits to
 * cancellation) plus twice the effect of em[i] on the step.  em[i] bounds
 * the fp32 error of the first moment (2^-23 of the terms of each update,
 * decaying with beta1): when gradients of opposite signs cancel in m, m's
 * relative error and so the step's grow without bound, and only its
 * absolute error is small.  Without these terms a value that crosses zero
 * could never meet a purely relative bound.
 */
#define AOQT_RTOL 1e-6
#define AOQT_UTOL 1e-4
struct aoqt_ref {
	size_t n;
	uint64_t k; /* updates applied */
	double *p, *m, *v, *err, *em;
};

void aoqt_ref_init(struct aoqt_ref *r, size_t n);
void aoqt_ref_free(struct aoqt_ref *r);
/* One step with gradient g (exact float values of whatever dtype), of
 * hp->kind: Adam, AdamW, SGD (m is the momentum buffer) or Lion (m). */
void aoqt_ref_step(struct aoqt_ref *r, const struct aoq_group *hp, const float *g);
/* Sets p to the daemon's fp32 values (its master, for an fp32 param) and
 * err to 0, so the next step is checked from where the daemon is: the fp32
 * check then bounds one step's error, not 20 steps of rounding. */
void aoqt_ref_resync(struct aoqt_ref *r, const float *p);
/* Sum of g^2 in double. */
double aoqt_sumsq(const float *g, size_t n);

/*
 * Compares a param buffer of dtype t with the reference.
 * fp32: |out - ref| <= err (after a resync: 1e-6 relative plus 1e-4 of the
 * step's change).  bf16/fp16: at most 1 ulp from the reference rounded to
 * t, or within err of it where err exceeds that ulp (values next to zero,
 * where fp32 itself cannot do better).  NaN never matches.  Prints the
 * first mismatches with `what`; returns their count.
 */
size_t aoqt_check_param(const char *what, const struct aoqt_ref *r, const void *param,
                        enum aoq_dtype t);
/* An fp32 master read back from the daemon: |master - ref| <= err. */
size_t aoqt_check_master(const char *what, const struct aoqt_ref *r, const float *master);

/* ---- raw protocol ------------------------------------------------------ */

/* Connects with 20 s send/receive timeouts; fd or -errno. */
int aoqt_raw_connect(const char *path);
/* Sends Hello, expects Welcome; session id into *id. */
int aoqt_raw_hello(int fd, const char *job, uint32_t rank, bool observer, uint64_t *id);
int aoqt_send_env(int fd, Aoq__Envelope *env);
/* Builds and sends a message of case `c` with the given payload. */
int aoqt_send_msg(int fd, Aoq__Envelope__MsgCase c, void *msg);

/*
 * What aoqctl snapshot sends: an observer connection asks for a snapshot of
 * session id; aoqt_snapshot_ask returns its fd, aoqt_snapshot_wait reads
 * the reply and closes it: 0 with the file's path and step, or the Error's
 * -(code + 1000) with its message in path.  aoqt_snapshot does both.
 */
int aoqt_snapshot_ask(const char *sock, uint64_t id);
int aoqt_snapshot_wait(int fd, char *path, size_t len, uint64_t *step);
int aoqt_snapshot(const char *sock, uint64_t id, char *path, size_t len, uint64_t *step);
/* What aoqctl drop sends: 0, or -errno with the Error's message in msg. */
int aoqt_drop(const char *sock, uint64_t id, char *msg, size_t len);

/*
 * Reads until EOF (or timeout).  Returns the ErrorCode of the first Error
 * frame seen (other frames are skipped), -1 when EOF came with no Error,
 * -2 on timeout (the connection stayed open), -3 on another failure.
 */
int aoqt_raw_expect_close(int fd, int timeout_ms, char *msg, size_t msglen);

struct aoqt_raw {
	int sock;
	uint64_t id;
	int arena_fd, to_daemon, to_client;
	int masters_fd; /* the 4th fd, the first masters memfd (aoq-arena.h, the master as the parameter), or -1 */
	uint8_t *arena;
	size_t arena_size;
	struct aoq_arena_header hdr;
	struct aoq_ring_prod prod;
	struct aoq_ring_cons cons;
	uint32_t tensors;
	uint64_t numel[8];
};
/* Hello + Register (one AdamW group, n <= 8 tensors, fp32/fp32), maps the
 * arena.  0 or -errno. */
int aoqt_raw_open(struct aoqt_raw *s, const char *path, const char *job, const uint64_t *numel,
                  uint32_t n);
/* The same as local rank `rank` of a replica group of `world` ranks (its
 * lane of the group's arena). */
int aoqt_raw_open_group(struct aoqt_raw *s, const char *path, const char *job, const uint64_t *numel, uint32_t n,
                        uint32_t world, uint32_t rank);
/* As aoqt_raw_open with a bf16 master and bf16 params and gradients: the
 * daemon sends the masters memfd too (s->masters_fd; the first of a large model's). */
int aoqt_raw_open_bf16(struct aoqt_raw *s, const char *path, const char *job, const uint64_t *numel, uint32_t n);
void aoqt_raw_close(struct aoqt_raw *s);
/* Every way a holder of a masters memfd's description might write it: a
 * writable shared mapping, write(2), a shrink, a punched hole, a write
 * seal.  e[i] is each attempt's errno, 0 where it succeeded (the memfd
 * may then have changed: its first bytes, a hole, its size). */
enum { AOQT_MW_MAP, AOQT_MW_WRITE, AOQT_MW_TRUNCATE, AOQT_MW_PUNCH, AOQT_MW_SEAL, AOQT_MW_N };
extern const char *const aoqt_mw_names[AOQT_MW_N];
void aoqt_masters_write_attempts(int fd, size_t len, int e[AOQT_MW_N]);
/* Pushes one record and rings the doorbell. */
int aoqt_raw_push(struct aoqt_raw *s, const struct aoq_rec *rec);
/* Waits for a daemon->client record (poll on the doorbell). 1, 0 timeout,
 * -EPIPE when the daemon closed the doorbell (the session failed). */
int aoqt_raw_pop(struct aoqt_raw *s, struct aoq_rec *rec, int timeout_ms);

/* Hello{observer} + StatsRequest{all}; *env holds the Stats reply. */
int aoqt_stats(const char *path, Aoq__Envelope **env);

/* ---- misc -------------------------------------------------------------- */
/* An AdamW group: lr, betas 0.9 and 0.999, eps 1e-8, no weight decay. */
struct aoq_group aoqt_adamw(double lr);
double aoqt_now(void); /* seconds, CLOCK_MONOTONIC */
void *aoqt_xmalloc(size_t n);
void *aoqt_xcalloc(size_t n, size_t sz);

#endif
