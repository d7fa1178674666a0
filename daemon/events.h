/* SPDX-License-Identifier: MIT */
/* What drives the sessions besides their messages (events.c): what the
 * server's handles call.  Loop thread. */
#ifndef AOQD_EVENTS_H
#define AOQD_EVENTS_H

#include <uv.h>

struct aoqd_server;

/* A new connection on the server's listener: a session in state HELLO. */
void aoqd_session_accept(struct aoqd_server *srv, uv_stream_t *listener);
/* The server's wake: every session looks at what its workers finished. */
void aoqd_sessions_wake(struct aoqd_server *srv);
/* The server's idle handle while the loop spins: polls the to-daemon rings
 * of the sessions that spin; stops once none got a record for spin_ns. */
void aoqd_sessions_spin(struct aoqd_server *srv);
/* Fails sessions whose handshake (Hello, then Register or observer) is
 * past the deadline; the server's timer calls it. */
void aoqd_sessions_sweep(struct aoqd_server *srv);
/* Ends every session's rate interval and every expired lease (the server's
 * timer, every AOQD_RATE_INTERVAL_MS). */
#define AOQD_RATE_INTERVAL_MS 1000
void aoqd_sessions_sample(struct aoqd_server *srv);
/* Closes every session (the server stops). */
void aoqd_sessions_close_all(struct aoqd_server *srv);
/* The client's doorbell rang (a uv_poll_cb for aoqd_arena_watch; its data
 * is the session). */
void aoqd_session_on_doorbell(uv_poll_t *h, int status, int events);

#endif
