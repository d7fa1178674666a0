/* SPDX-License-Identifier: MIT */
/*
 * A restart that loses no step (docs/design.md, "The fd store"): at a
 * stop under systemd (NOTIFY_SOCKET set) every trainer's state goes, rolled
 * back to its last completed step, into a sealed memfd that aoqd hands to
 * systemd's file-descriptor store (FDSTORE=1, FDNAME=aoq-state-<id>); the
 * next aoqd gets them back with its listening socket
 * (sd_listen_fds_with_names), validates each as hostile input and offers it
 * as a leased session, before any snapshot is read.  Built without
 * libsystemd, nothing is stored or taken (snapshots as before); the stored
 * form's codec is built either way.  Loop thread.
 */
#ifndef AOQD_FDSTORE_H
#define AOQD_FDSTORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct aoqd_server;

/* The FDNAME prefix of a stored state (the rest: the session's id). */
#define AOQD_FDSTORE_PREFIX "aoq-state-"

/* Whether a passed fd's name is a stored state's. */
bool aoqd_fdstore_is_state(const char *name);
/* Keeps passed fd `fd` named `name` (a stored state) for
 * aoqd_fdstore_adopt(); the fd is ours from now on. */
void aoqd_fdstore_keep(int fd, const char *name);
/* Validates every kept fd and makes each good one a leased session (lease
 * as a snapshot restore); a bad one is logged and closed.  Every kept fd
 * leaves systemd's store (FDSTOREREMOVE=1).  Returns the sessions made. */
int aoqd_fdstore_adopt(struct aoqd_server *srv);
/* Whether snapshot file `name` (in state_dir) is of a key that
 * aoqd_fdstore_adopt() took back: the restore does not read it. */
bool aoqd_fdstore_taken(const char *name);
/* At a stop, before the sessions close: with NOTIFY_SOCKET set, waits for
 * the workers to finish what they run, rolls every trainer's open step
 * back and stores its state (FDSTORE=1).  Returns the states stored. */
int aoqd_fdstore_save(struct aoqd_server *srv);

/* The stored form (exposed for the tests): encodes session state into a
 * new sealed memfd; decodes one (hostile input).  fdstore.c. */
struct aoqd_state;
struct aoqd_snap_key;
int aoqd_fdstore_encode(const struct aoqd_snap_key *key, const struct aoqd_state *st, unsigned threads);
int aoqd_fdstore_decode(int fd, int lock_memory, _Atomic uint64_t *locked_total, unsigned threads,
                        struct aoqd_snap_key *key, struct aoqd_state *st, char *why, size_t len);

#endif
