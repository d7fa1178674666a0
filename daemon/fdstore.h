/* SPDX-License-Identifier: MIT */
/*
 * A restart that loses no step (docs/design.md, "The fd store"): under
 * systemd (NOTIFY_SOCKET set) with a lease, every session's state lives in
 * a memfd that systemd's file-descriptor store holds from its allocation
 * (statemem.c: FDSTORE=1, FDNAME=aoq-state-<n>) to its end (FDSTOREREMOVE=1).
 * A registered state's memfd holds its descriptor and a journal that
 * makes it whole at every instant; at a stop every trainer's state is
 * rolled back in place to its last completed step.  The next aoqd, after a
 * stop or a kill, gets them back with its listening socket
 * (sd_listen_fds_with_names), validates each as hostile input, replays
 * its journal and maps it in place as a leased session, before any
 * snapshot is read.  Built without libsystemd,
 * nothing is stored or taken (snapshots as before); the stored form's
 * codec is built either way.  Loop thread.
 */
#ifndef AOQD_FDSTORE_H
#define AOQD_FDSTORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct aoqd_server;

/* The FDNAME prefix of a stored state (the rest: a number). */
#define AOQD_FDSTORE_PREFIX "aoq-state-"

/* The FDNAME prefix of a stored state's masters memfd (aoq-masters-<n>-<k>:
 * masters memfd k of state aoq-state-<n>). */
#define AOQD_FDSTORE_MASTERS_PREFIX "aoq-masters-"

/* Whether a passed fd's name is a stored state's, or its masters'. */
bool aoqd_fdstore_is_state(const char *name);
bool aoqd_fdstore_is_masters(const char *name);
/* Keeps passed fd `fd` named `name` (a stored state) for
 * aoqd_fdstore_adopt(); the fd is ours from now on. */
void aoqd_fdstore_keep(int fd, const char *name);
/* Validates every kept fd and makes each good one a leased session (lease
 * as a snapshot restore) whose state is the memfd, mapped in place (it
 * stays in systemd's store under its name); a bad one is logged, closed
 * and leaves the store (FDSTOREREMOVE=1).  Returns the sessions made. */
int aoqd_fdstore_adopt(struct aoqd_server *srv);
/* Whether snapshot file `name` (in state_dir) is of a key that
 * aoqd_fdstore_adopt() took back: the restore does not read it. */
bool aoqd_fdstore_taken(const char *name);
/* At a stop, before the sessions close: with NOTIFY_SOCKET set, waits for
 * the workers to finish what they run, rolls every trainer's and replica
 * group's open step back in its memfd and writes the memfd's descriptor,
 * so that the state stays in the store.  Returns the states kept. */
int aoqd_fdstore_save(struct aoqd_server *srv);
/* A session's state described in its memfd (key, tables, header), its
 * journal started: at registration and at a snapshot's restore, so that
 * a killed aoqd's state can be taken back (a no-op for a state not in a
 * stored memfd, or for a replica group's member: the group's is its
 * hub's). */
struct aoqd_session;
void aoqd_fdstore_describe(struct aoqd_session *s);
/* Before exit: waits (5 s at most) until the manager has read every
 * message sent, the store's removals included (NOTIFY_SOCKET set). */
void aoqd_fdstore_barrier(void);

/* The stored form (exposed for the tests): write: st's descriptor and
 * header into its memfd (st in a memfd, at a step boundary), sealed
 * against growing and shrinking; 0 or -errno.  decode: validates fd
 * (hostile input) and maps its state in place (aoqd_state_adopt; named
 * `name` in the store), then clears its header; 0, or -errno with the
 * reason in why.  fdstore.c. */
struct aoqd_state;
struct aoqd_snap_key;
int aoqd_fdstore_write(const struct aoqd_snap_key *key, struct aoqd_state *st, bool stop);
int aoqd_fdstore_decode(int fd, const char *name, int lock_memory, _Atomic uint64_t *locked_total, unsigned threads,
                        struct aoqd_snap_key *key, struct aoqd_state *st, char *why, size_t len);
/* decode with the nm masters memfds the store kept for it (the fd store's
 * aoq-masters-<n>-<k>, in k's order): a killed aoqd's masters that are
 * parameters, read into the new ones (checked first; wrong ones are left
 * out with a warning, and then only a stop's state comes back). */
int aoqd_fdstore_decode_masters(int fd, const char *name, const int *mfds, uint32_t nm, int lock_memory,
                                _Atomic uint64_t *locked_total, unsigned threads, struct aoqd_snap_key *key,
                                struct aoqd_state *st, char *why, size_t len);

#endif
