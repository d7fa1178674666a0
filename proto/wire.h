/* SPDX-License-Identifier: MIT */
/* Frames on the control socket: a 4-byte little-endian length, then one
 * protobuf Envelope of at most AOQ_MAX_FRAME bytes; and the helpers the
 * daemon and libaoq share. */
#ifndef AOQ_WIRE_H
#define AOQ_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "aoq-arena.h"
#include "aoq.pb-c.h"

/* Encodes env as one frame into a malloc'ed buffer. */
int aoq_frame_encode(const Aoq__Envelope *env, uint8_t **buf, size_t *len);

/* Reads the little-endian length prefix at p. */
static inline uint32_t aoq_frame_len(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Decodes a frame body; NULL when it does not decode or has no message. */
Aoq__Envelope *aoq_envelope_decode(const uint8_t *body, size_t len);
void aoq_envelope_free(Aoq__Envelope *env);

/*
 * Blocking helpers for clients (libaoq, aoqctl, tests).
 * aoq_send_frame sends env with up to AOQ_MAX_FDS fds attached.
 * aoq_recv_frame reads one whole frame; fds that arrived with it are
 * returned in fds[]/ *nfds (at most max_fds; more, or a truncated control
 * message, is -EPROTO and every received fd is closed).
 */
int aoq_send_frame(int sock, const Aoq__Envelope *env, const int *fds, int nfds);
int aoq_recv_frame(int sock, Aoq__Envelope **env, int *fds, int max_fds, int *nfds);

/* Sends env and reads one reply; an Error reply becomes its negative errno
 * (text in *errmsg when non-NULL, malloc'ed). */
int aoq_call(int sock, const Aoq__Envelope *env, Aoq__Envelope **reply, char **errmsg);

/* Maps a protocol ErrorCode to a negative errno and back. */
int aoq_error_to_errno(int code);
const char *aoq_error_name(int code);

/* The socket path: explicit, else $AOQ_SOCKET, else /run/aoq/aoqd.sock when
 * it exists, else $XDG_RUNTIME_DIR/aoq/aoqd.sock (or /tmp/aoq-UID/aoqd.sock).
 * Writes into buf; -ENAMETOOLONG if it does not fit. */
int aoq_socket_path(const char *explicit_path, char *buf, size_t len);
/* Connects a blocking SOCK_STREAM socket; returns the fd or -errno. */
int aoq_socket_connect(const char *path);
/* The same with a deadline of timeout_ms (0: none) on the connect and on
 * every later send and receive of the socket (SO_SNDTIMEO, SO_RCVTIMEO): a
 * call past it fails with -EAGAIN (-ETIMEDOUT for the connect). */
int aoq_socket_connect_timeout(const char *path, uint32_t timeout_ms);

/* Grows an array of elem-sized entries to hold need (new entries zeroed),
 * doubling from 16; NULL when out of memory (the array is unchanged). */
void *aoq_grow(void *p, uint32_t *cap, uint32_t need, size_t elem);
/* The capacity aoq_grow() gives for need (what a caller charges first). */
uint32_t aoq_grow_cap(uint32_t cap, uint32_t need);

#endif
