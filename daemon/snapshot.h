/* SPDX-License-Identifier: MIT */
/*
 * Snapshots of a session's optimizer state (snapfile.c writes the file,
 * snapload.c loads it, snapshot.c captures and runs the writer), in the safetensors
 * format (docs/snapshots.md): an 8-byte little-endian header length, a JSON
 * header (per tensor dtype, shape, data_offsets; a __metadata__ map of
 * strings), then the raw arrays.
 *
 * Three layers:
 *  - the file: aoqd_snapfile_prepare() builds the header from a state (loop
 *    thread), aoqd_snapfile_open/put/commit write it atomically (temp file in
 *    the same directory, fsync, rename, fsync of the directory), and
 *    aoqd_snapshot_load() reads and validates one (hostile input);
 *  - the capture: a consistent copy of a live state at a step boundary,
 *    taken tensor by tensor by the writer thread, or by the worker that is
 *    about to update a tensor the writer has not reached
 *    (aoqd_snapshot_guard(); docs/design.md, "Snapshots");
 *  - the writer thread, which copies and writes off the loop and reports
 *    back on the loop thread.
 */
#ifndef AOQD_SNAPSHOT_H
#define AOQD_SNAPSHOT_H

#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "error.h"
#include "state.h"

#define AOQD_SNAPSHOT_FORMAT "aoq-optimizer-state"
#define AOQD_SNAPSHOT_VERSION 1
#define AOQD_SNAPSHOT_SUFFIX ".safetensors"
/* The temp file a write goes to before its rename (and six random characters):
 * one left at start, from a write a crash cut short, is removed. */
#define AOQD_SNAPSHOT_TEMP ".snapshot-"
/* The header is at most this long (safetensors' own readers refuse more
 * than 100 MB). */
#define AOQD_SNAPSHOT_MAX_HEADER (100u << 20)

/* Whose state it is: a session's key. */
struct aoqd_snap_key {
	uint32_t uid;
	uint32_t rank;        /* 4294967295 for a replica group's state */
	uint32_t local_world; /* a replica group's local ranks (metadata local_world); 0 otherwise */
	char job[129];
};

/* ---- the file ---- */

struct aoqd_snapfile;

/*
 * Builds the header of a snapshot of st taken after step `step` (the
 * session's last completed step).  tensor_steps[i]: tensor i's step count
 * at that boundary (NULL: st->tensors[i].steps).  Reads st's tables only
 * (names, groups, options), not its arrays.  NULL with errno set.
 */
struct aoqd_snapfile *aoqd_snapfile_prepare(const struct aoqd_snap_key *key, uint64_t step,
                                            const struct aoqd_state *st, const uint64_t *tensor_steps);
/* Creates the temp file in dir and writes the header.  0 or -errno, err
 * filled. */
int aoqd_snapfile_open(struct aoqd_snapfile *f, const char *dir, struct aoqd_error *err);
/* Writes tensor i's arrays (the layout of st->tensors[i].st: master, m,
 * v, scales), in any order of tensors. */
int aoqd_snapfile_put(struct aoqd_snapfile *f, uint32_t i, const struct aoqk_state *a, struct aoqd_error *err);
/* The data is written (and checksummed) in chunks of `chunk` bytes (0: the
 * default, AOQD_SNAPSHOT_CHUNK), before(arg, bytes) called before each
 * (NULL: none): the writer thread waits there for idle workers. */
#define AOQD_SNAPSHOT_CHUNK (1u << 20)
void aoqd_snapfile_pace(struct aoqd_snapfile *f, uint64_t chunk, void (*before)(void *arg, uint64_t bytes), void *arg);
/* Every tensor put: checksum into the header, fsync, rename over the
 * session key's file, fsync of the directory.  The final path goes to
 * path (len bytes).  On any error the temp file is removed and the
 * previous snapshot stays. */
int aoqd_snapfile_commit(struct aoqd_snapfile *f, char *path, size_t len, struct aoqd_error *err);
void aoqd_snapfile_free(struct aoqd_snapfile *f);
/* Tensors of the file (in write order, the order captures take them). */
uint32_t aoqd_snapfile_tensors(const struct aoqd_snapfile *f);
/* Bytes of the file's data section (every array). */
uint64_t aoqd_snapfile_data_bytes(const struct aoqd_snapfile *f);

/* The whole state at once from its arrays (the caller keeps it still):
 * prepare, open, put every tensor, commit. */
int aoqd_snapshot_write(const char *dir, const struct aoqd_snap_key *key, uint64_t step,
                        const struct aoqd_state *st, char *path, size_t len, struct aoqd_error *err);

/* The file name of a key's snapshot in dir: "<uid>-<job>-<rank>.safetensors"
 * with the job's bytes outside [A-Za-z0-9._-] as %XX. */
int aoqd_snapshot_path(const char *dir, const struct aoqd_snap_key *key, char *path, size_t len);

/*
 * Reads and validates a snapshot: header length within the file and the
 * limit, the JSON's types, every array's dtype, shape and offsets (inside
 * the data, contiguous, no extra entries), the format and its version,
 * the groups' hyperparameters, and the data's checksum.  Fills a zeroed
 * st (groups, tensors with names and steps, options, state arrays
 * allocated with aoqd_state_alloc(lock_memory) and filled), *key and
 * *step.  0, or -errno with a message in why.  st is left empty on error.
 */
int aoqd_snapshot_load(const char *path, int lock_memory, _Atomic uint64_t *locked_total, struct aoqd_snap_key *key,
                       uint64_t *step, struct aoqd_state *st, char *why, size_t len);

/*
 * Restore on restart: loads every "*.safetensors" of dir and hands each
 * (key, step, state) to fn.  The state is malloc'ed and filled (arrays
 * allocated, locked per lock_memory, counted in *locked_total, no account
 * charged): fn takes it (returns 0; it frees it later with
 * aoqd_state_free() and free()) or refuses it (< 0: freed here; -EDQUOT:
 * past the uid's limits, the file is removed too).  Newest files first.  The
 * coordinator wires fn to the lease code (aoqd_lease_adopt).  A file that does not load is logged
 * and skipped.  Returns the number of states taken, or -errno when dir
 * cannot be read (-ENOENT: no directory, nothing to restore).
 */
typedef int (*aoqd_snapshot_restore_fn)(const struct aoqd_snap_key *key, uint64_t step, struct aoqd_state *st,
                                        void *arg);
int aoqd_snapshot_restore_all(const char *dir, int lock_memory, _Atomic uint64_t *locked_total,
                              aoqd_snapshot_restore_fn fn, void *arg);

/* ---- the capture and the writer ---- */

struct aoqd_snapshotter;

/* Called on the loop thread when a snapshot is on disk (r == 0, path set)
 * or failed (r < 0, why set). */
typedef void (*aoqd_snapshot_done_fn)(void *arg, int r, const char *path, const char *why);

struct aoqd_pool;

/* The writer thread and its loop-side wake.  NULL with errno set. */
/* cpus: the cores the writer may run on (those no worker is pinned to), or
 * NULL for any.  pool: the workers whose idle times the writer writes in
 * (snapshot.c, "Pacing"), or NULL to write at once. */
struct aoqd_snapshotter *aoqd_snapshotter_new(uv_loop_t *loop, const cpu_set_t *cpus, struct aoqd_pool *pool);

/* How the writer paces itself (snapshot.c, "Pacing"; docs/snapshots.md):
 * it writes `chunk` bytes at a time, each when the workers are idle, or at
 * the latest when a minimum rate makes it due: chunk k, B bytes into the
 * data, slack_ns + B / min_rate after the write began. */
struct aoqd_snap_pace {
	uint64_t chunk;    /* bytes; 0: AOQD_SNAPSHOT_CHUNK */
	uint64_t min_rate; /* bytes per second */
	uint64_t slack_ns;
	uint64_t settle_ns; /* a newly idle pool is trusted after this long with no task started */
};
/* 64 MiB/s: a 1 G parameter AdamW state (12 GiB) in at most 3.2 min when
 * the workers never rest; 200 ms: longer than an update of a step's
 * gradients usually runs, shorter than a person waits for aoqctl. */
#define AOQD_SNAPSHOT_MIN_RATE (64ull << 20)
#define AOQD_SNAPSHOT_SLACK_MS 200
/* Between two jobs of a step (the loop thread turning the next records into
 * a job, a gradient that arrives a moment later) the pool is idle for
 * microseconds, and a chunk begun then would run beside the next job's
 * updates: the writer trusts an idle pool once it stayed idle this long
 * with no task started; then chunks follow each other while none starts. */
#define AOQD_SNAPSHOT_SETTLE_US 2000
/* A chunk due by the minimum rate while a step is open waits this long at
 * most for a moment no task runs (a gap between the step's gradients)
 * before it is written beside running updates. */
#define AOQD_SNAPSHOT_GAP_WAIT_MS 20
/* A state (master and moments, undo copy not counted) smaller than this is
 * captured by block copies even where the undo swap is possible: copying
 * 16 MiB beside a step takes a few ms, where the swap waits for the next
 * step's end, 2-3 s when the trainer is idle (aoqd_snapshot_tick). */
#define AOQD_SNAPSHOT_SWAP_MIN (16ull << 20)
/* Tests: sets the pacing of the writes to come. */
void aoqd_snapshotter_set_pace(struct aoqd_snapshotter *w, const struct aoqd_snap_pace *pace);
/* Since the writer started: chunks written (counted as each begins), those
 * written while workers were busy (due by the minimum rate), and the time
 * spent waiting for idle workers (counted as each snapshot ends). */
void aoqd_snapshotter_pace_stats(struct aoqd_snapshotter *w, uint64_t *chunks, uint64_t *forced, uint64_t *waited_ns);
/* Waits for the snapshot being written, fails the queued ones, stops the
 * thread and closes the loop handle (the loop must run once more). */
void aoqd_snapshotter_free(struct aoqd_snapshotter *w);
/* The writer is idle (tests, benchmarks). */
bool aoqd_snapshotter_idle(struct aoqd_snapshotter *w);

/*
 * Arms a capture of st at step boundary `boundary`: from now on every
 * update of a step after `boundary` first makes sure its tensor is
 * captured (aoqd_snapshot_guard).  ready: every update up to the boundary
 * is done (else call aoqd_snapshot_ready() when it is).  done(arg) is
 * called on the loop thread with the outcome.  -EBUSY when st has a
 * capture in progress.  Loop thread.
 */
int aoqd_snapshot_arm(struct aoqd_snapshotter *w, struct aoqd_state *st, const struct aoqd_snap_key *key,
                      const char *dir, uint64_t boundary, bool ready, aoqd_snapshot_done_fn done, void *arg,
                      struct aoqd_error *err);
/* The state is at its capture's boundary (the boundary step's last update
 * is done): the writer may start.  Takes the tensors' steps then.  Loop
 * thread; nothing when st has no capture waiting. */
void aoqd_snapshot_ready(struct aoqd_state *st, uint64_t step_ended);
/* Called on the loop thread when aoqd_snapshot_prepare's work is done
 * (r == 0) or stopped (r < 0, why says why). */
typedef void (*aoqd_snapshot_prep_fn)(void *arg, int r, const char *why);
/*
 * Before a capture by the undo swap: the swap maps a spare in place of the
 * undo copy it takes, and the step after it saves every element there.
 * Pages never touched would be faulted in and zeroed by the workers on that
 * step's path (at 1 G parameters, 12 GiB of first touches in one step);
 * this maps the spares a state lacks and touches their pages on the writer
 * thread, chunk by chunk in the workers' idle time (the writer's pacing),
 * before the capture is armed.  1: queued, fn(arg, r) follows on the loop
 * thread (aoqd_snapshot_busy() is true until then); 0: nothing to prepare
 * (no undo swap, or every spare is there); -errno.  Loop thread.
 */
int aoqd_snapshot_prepare(struct aoqd_snapshotter *w, struct aoqd_state *st, aoqd_snapshot_prep_fn fn, void *arg);
/* The state's owner went away (`gone`: "session 7 closed"): a capture
 * whose boundary is not reached fails ("session 7 closed before step 12
 * ended"), a preparation stops at its next chunk ("... before its snapshot
 * began").  A capture already writing goes on (it holds what it needs).
 * Loop thread. */
void aoqd_snapshot_cancel(struct aoqd_state *st, const char *gone);
/* What st's snapshot under way is doing, for Stats: "" (none),
 * "preparing", "armed" or "writing", with the array bytes written so far
 * and in all (0 until it writes).  Loop thread. */
const char *aoqd_snapshot_phase(const struct aoqd_state *st, uint64_t *written, uint64_t *total);
/* The 1 s sampler (loop thread): idle, the session is between steps with
 * nothing of the next accepted.  A capture waiting for the undo swap
 * (snapshot.c) that saw the session idle at two ticks in a row copies the
 * state instead: the step it waits for may not come soon. */
void aoqd_snapshot_tick(struct aoqd_state *st, bool idle);
/* Whether st has a capture armed or writing, or spares being prepared. */
bool aoqd_snapshot_busy(const struct aoqd_state *st);
/* Frees what captures of st keep (the state is being freed; no capture
 * runs). */
void aoqd_snapshot_state_free(struct aoqd_state *st);
/* The same, the spare mappings added to `later` (pool.h; NULL: now). */
struct aoqd_release;
void aoqd_snapshot_state_free_later(struct aoqd_state *st, struct aoqd_release *later);

void aoqd_snapshot_capture(struct aoqd_state *st, uint32_t tensor, uint64_t step, uint64_t begin, uint64_t count);

/* A capture is armed and has not taken every tensor yet: loads and step
 * changes wait (BUSY). */
static inline bool aoqd_snapshot_capturing(struct aoqd_state *st)
{
	return atomic_load_explicit(&st->snap_after, memory_order_acquire) != 0;
}

/* Before an update of elements [begin, begin + count) of tensor `tensor`
 * in step `step` touches its state (workers): copies the capture's blocks
 * that hold them (snapshot.c, CAPTURE_BLOCK) first when a capture of an
 * earlier boundary has not taken them yet, or waits while another thread
 * copies one.  Costs one atomic load when no
 * capture runs. */
static inline void aoqd_snapshot_guard(struct aoqd_state *st, uint32_t tensor, uint64_t step, uint64_t begin,
                                       uint64_t count)
{
	uint64_t after = atomic_load_explicit(&st->snap_after, memory_order_acquire);
	if (after && step >= after)
		aoqd_snapshot_capture(st, tensor, step, begin, count);
}

#endif
