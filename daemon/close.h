/* SPDX-License-Identifier: MIT */
/* A session's end (close.c): its close, and the one place where an error
 * fails it.  Loop thread. */
#ifndef AOQD_CLOSE_H
#define AOQD_CLOSE_H

#include "error.h"

struct aoqd_session;

/* Closes the connection and the doorbell, unlinks the session (or leases
 * its state: lease.c); the memory goes with the last reference (running
 * jobs hold one).  A leased session's lease ends. */
void aoqd_session_close(struct aoqd_session *s);
/* Logs e, stops everything s does, sends the Error; the connection goes
 * once it is written.  A replica group's other members fail too
 * (PEER_LOST). */
void aoqd_session_fail(struct aoqd_session *s, const struct aoqd_error *e);
/* A handler's error: a refusal answers Error and the session goes on; any
 * other error fails it. */
void aoqd_session_error(struct aoqd_session *s, const struct aoqd_error *e);

#endif
