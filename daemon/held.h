/* SPDX-License-Identifier: MIT */
/*
 * Memory a client can keep alive (held.c; docs/design.md, "Shared nodes"):
 * the arena and a masters memfd (the master as the parameter) are shared
 * with the client, which may keep their fds and mappings after Bye.  Its pages stay charged to the uid until no open file
 * description of the memfd is left: an inotify watch, added when the memfd
 * is made, counts the descriptions (IN_OPEN: a reopen through
 * /proc/PID/fd; IN_CLOSE: the last reference of one, fd or mapping, gone).
 * Any thread, but aoqd_held_poll (loop thread).  A masters memfd a restart
 * took back from the fd store (statemem.c) is watched from then on:
 * descriptions opened before (the trainers of the aoqd before had them)
 * are not counted, so one a client keeps open past its session after a
 * restart is not charged; each restart can leave at most one such memfd
 * per session that had one, as a copy would leave the old memfd.
 */
#ifndef AOQD_HELD_H
#define AOQD_HELD_H

#include <stdint.h>

struct aoqd_account;

/* The inotify fd for the loop to poll (-1: none; aoqd_held_watch then
 * answers -1 and memory is uncharged at the daemon's release, as before). */
int aoqd_held_init(void);
/* Watches memfd fd (just made: one description).  The watch's handle, or
 * -1. */
int aoqd_held_watch(int fd);
/* The daemon lets go of watch wd's memfd (it closes its fd next): `bytes`
 * (what the memfd holds now) are charged to `acc` until the last
 * description is gone. */
void aoqd_held_release(int wd, struct aoqd_account *acc, uint64_t bytes);
/* Reads the watch's events; uncharges what is released. */
void aoqd_held_poll(void);
/* Bytes charged for memory the daemon let go of and clients still hold. */
uint64_t aoqd_held_bytes(void);

#endif
