/* SPDX-License-Identifier: MIT */
/*
 * An aoqd inside the fuzzer's process (fuzz-daemon.c): the real server,
 * sessions, data plane and worker pool on a libuv loop that the fuzzer
 * turns itself, and one hostile client per input on a real Unix socket.
 * Each input gets a fresh connection, and the session is gone (every
 * reference dropped, its memory freed) before the input ends, so an input
 * replays alike and a leak is the input's.
 */
#ifndef AOQ_FUZZ_DAEMON_H
#define AOQ_FUZZ_DAEMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "aoq-arena.h"
#include "aoq.pb-c.h"

struct fz_client {
	int sock;
	struct aoqd_session *s; /* the daemon's session; we hold a reference */
	/* The arena, once a Registered reply brought it. */
	int arena_fd, bell_out, bell_in; /* bell_out: we ring the daemon */
	uint8_t *base;
	uint64_t size;
	struct aoq_arena_header h;  /* our copy, checked */
	struct aoq_ring *to_daemon; /* NULL until the arena came */
	struct aoq_ring *to_client;
	uint64_t head;              /* our producer counter */
	uint64_t tail;              /* our consumer counter */
	uint64_t last_out;          /* fz_settle: the daemon's jobs out, and */
	double out_since;           /* since when (CLOCK_MONOTONIC, s) */
};

/* Starts the daemon once (first call); a fresh connection, accepted.
 * Aborts when the harness itself cannot work. */
void fz_connect(struct fz_client *c);
/* Sends bytes as they are (partial frames included). */
void fz_send_raw(struct fz_client *c, const uint8_t *p, size_t n);
/* Sends body as one frame (the length prefix added). */
void fz_send_frame(struct fz_client *c, const uint8_t *body, size_t n);
/* Encodes and sends one message. */
void fz_send_env(struct fz_client *c, const Aoq__Envelope *env);
/* Pushes a record on the to-daemon ring (the arena must be there) and
 * rings the daemon's doorbell. */
void fz_push(struct fz_client *c, const struct aoq_rec *rec);
/* Takes every answer off the to-client ring, as a client does. */
void fz_pop_all(struct fz_client *c);
/* Turns the loop until the daemon has read everything sent and its
 * workers are idle (or the session is gone); reads and drops the replies,
 * mapping the arena when it comes. */
void fz_settle(struct fz_client *c);
/* True while the daemon's session is open. */
bool fz_alive(const struct fz_client *c);
/* Closes the client and waits until the session is freed. */
void fz_close(struct fz_client *c);

#endif
