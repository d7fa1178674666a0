/* SPDX-License-Identifier: MIT */
/*
 * A control connection (conn.c): the Unix socket of one client, its peer
 * credentials and Hello identity, the read buffer and the frames it holds,
 * replies out (with fds when they carry the arena).  Loop thread only.
 *
 * A connection calls nothing above it: what it has to tell its owner (bytes
 * came, the connection must close, a write finished, a handle holds or
 * drops the owner) goes through the owner's aoqd_conn_ops.  A read buffer
 * that would pass its budget (aoqd_conn_budget) reports UV_ENOBUFS.
 */
#ifndef AOQD_CONN_H
#define AOQD_CONN_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "aoq.pb-c.h"
#include "error.h"

/* A client that does not read its replies stops being read once this much
 * waits to be written to it. */
#define AOQD_MAX_QUEUED_REPLY_BYTES (4u << 20)
/* Read buffer a connection has without charge. */
#define AOQD_CONN_BASE_BUFFER 65536u

struct aoqd_conn_ops {
	void (*hold)(void *owner);     /* a write or a closing handle keeps the owner */
	void (*release)(void *owner);  /* ... and lets it go */
	void (*close)(void *owner);    /* the connection must go: a write failed, or a final Error is out */
	void (*writable)(void *owner); /* a write finished */
	void (*read)(void *owner, ssize_t nread); /* bytes were appended (> 0), or EOF/error (< 0) */
};

struct aoqd_conn {
	uv_pipe_t pipe;
	bool handle_live;  /* pipe initialised and not closed */
	bool open;         /* accepted and not closed */
	bool reading;
	uint8_t *rbuf;
	size_t rlen, rcap;
	/* peer */
	pid_t peer_pid;
	uid_t uid;         /* (uid_t)-1: no credentials */
	gid_t gid;
	gid_t *groups;     /* supplementary groups (SO_PEERGROUPS) */
	int ngroups;
	/* Read buffer beyond AOQD_CONN_BASE_BUFFER, charged to *buffered
	 * (the uid's) up to buffer_limit; past it reading fails with
	 * UV_ENOBUFS. */
	uint64_t *buffered;
	uint64_t buffer_limit;
	uint64_t buffer_charged;
	bool over_budget;
	/* Hello */
	char *job;
	uint32_t rank;
	char *device;
	uint32_t pid;
	uint64_t id;       /* for log lines */
	const struct aoqd_conn_ops *ops;
	void *owner;
};

/* Accepts a connection from listener.  0, or -errno: then the handle must
 * still be closed with aoqd_conn_close(). */
int aoqd_conn_accept(struct aoqd_conn *c, uv_loop_t *loop, uv_stream_t *listener, uint64_t id,
                     const struct aoqd_conn_ops *ops, void *owner);
/* Charges the read buffer beyond its base to *buffered, up to limit (0:
 * none). */
void aoqd_conn_budget(struct aoqd_conn *c, uint64_t *buffered, uint64_t limit);
/* True when gid is the peer's group or one of its supplementary groups. */
bool aoqd_conn_in_group(const struct aoqd_conn *c, gid_t gid);
/* True when the peer closed its end (or the connection is closed): a
 * trainer gone whose EOF this loop has not read yet. */
bool aoqd_conn_peer_gone(struct aoqd_conn *c);
/* Closes the handle; true when the connection was open. */
bool aoqd_conn_close(struct aoqd_conn *c);
/* Frees the buffers and names (after the handle closed). */
void aoqd_conn_free(struct aoqd_conn *c);

/* Sends a frame.  A failure other than -ENOTCONN closes the connection
 * (through ops->close). */
int aoqd_conn_send(struct aoqd_conn *c, const Aoq__Envelope *env);
/* Sends Error{code, msg}; with close_after, the connection closes once it
 * is written. */
void aoqd_conn_send_error(struct aoqd_conn *c, Aoq__ErrorCode code, const char *msg, bool close_after);
/* A connection refused at accept: Error{code, msg} written at once, from
 * the socket's empty buffer (never queued), so the caller closes it right
 * away and the client still reads why. */
void aoqd_conn_refuse(struct aoqd_conn *c, Aoq__ErrorCode code, const char *msg);
/* Sends Done{value}. */
int aoqd_conn_send_done(struct aoqd_conn *c, uint64_t value);
/* Sends a frame with fds (SCM_RIGHTS).  Only with nothing queued before
 * it: -EAGAIN otherwise.  The caller decides what a failure means. */
int aoqd_conn_send_with_fds(struct aoqd_conn *c, const Aoq__Envelope *env, const int *fds, int nfds);

/* Bytes waiting to be written. */
size_t aoqd_conn_queued(const struct aoqd_conn *c);
/* Starts or stops reading. */
void aoqd_conn_want_read(struct aoqd_conn *c, bool want);

/*
 * The next whole frame at *off of the read buffer: 1 and *env (free with
 * aoq_envelope_free), 0 when none is whole yet, or -errno with err filled
 * (a frame too long or that does not decode).
 */
int aoqd_conn_frame(struct aoqd_conn *c, size_t *off, Aoq__Envelope **env, struct aoqd_error *err);
/* Drops the first n bytes of the read buffer (n = rlen: all of it). */
void aoqd_conn_consume(struct aoqd_conn *c, size_t n);

#endif
