/* SPDX-License-Identifier: MIT */
/*
 * A session's arena (arena.c): the sealed memfd shared with the client,
 * the daemon's private copy of its layout, the two rings and the two
 * doorbells.  The layout is proto/aoq-arena.h's; the daemon never reads
 * the shared header or tables back.
 */
#ifndef AOQD_ARENA_H
#define AOQD_ARENA_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "aoq-arena.h"
#include "state.h"

/* Elements per Load/Read request: bounds the time one request holds a
 * worker (about 16 ms of conversion) and sizes the transfer area. */
#define AOQD_MAX_TRANSFER_ELEMS (4u << 20)

struct aoqd_arena {
	int fd;
	uint8_t *base;
	uint64_t size;
	uint32_t nslots;
	uint64_t slot_elems;
	uint64_t xfer_off, xfer_bytes;
	/* Replica groups: lanes (one per local rank) of lane_bytes from
	 * lane_off; this arena's own lane's rings (a member's view, or lane 0). */
	uint32_t lanes;
	uint64_t lane_off, lane_bytes;
	uint64_t to_daemon_off, to_client_off;
	struct aoq_arena_slot *slots; /* private copy */
	bool owner;                   /* made the memfd (not a member's view) */
	int held_wd;                  /* its watch (held.h): charged until no client holds it */
	struct aoqd_account *account; /* the uid charged for it (register.c sets it) */
	uint32_t ring_cap;
	struct aoq_ring_cons to_daemon;   /* loop thread */
	struct aoq_ring_prod to_client;   /* under ring_lock */
	pthread_mutex_t ring_lock;
	/* Doorbells: a socket pair per direction.  The client gets its own
	 * ends, never a file description the daemon uses, so it cannot make
	 * the daemon's reads or writes block (O_NONBLOCK lives in the
	 * description); the daemon reads and writes with MSG_DONTWAIT. */
	int doorbell_in;   /* the client rings: we read */
	int doorbell_out;  /* we ring */
	int peer_in, peer_out; /* the client's ends, until sent */
	uv_poll_t doorbell_poll;
	bool poll_open;
	uint64_t locked;                 /* bytes mlock'ed, counted in *locked_total */
	_Atomic uint64_t *locked_total;
};

void aoqd_arena_init(struct aoqd_arena *a);
/* Lays out, creates, fills, checks and seals the arena for st's tensors;
 * creates the doorbells.  0 or -errno (-EFBIG: larger than max_bytes). */
int aoqd_arena_build(struct aoqd_arena *a, const struct aoqd_state *st, uint64_t session_id, uint64_t max_bytes);
/* The same with `lanes` lanes (a replica group's arena: a lane per local
 * rank, proto/aoq-arena.h).  The answer rings hold every lane's records. */
int aoqd_arena_build_lanes(struct aoqd_arena *a, const struct aoqd_state *st, uint64_t session_id, uint64_t max_bytes,
                           uint32_t lanes);
/* The size aoqd_arena_build_lanes would give st's arena, without making
 * it (what a resume charges before it takes a leased state over).  0 or
 * -errno (-EFBIG: larger than max_bytes). */
int aoqd_arena_size(const struct aoqd_state *st, uint64_t max_bytes, uint32_t lanes, uint64_t *size);
/* A replica group member's view of the group's arena `of`: its own mapping
 * of the same memfd (a dup), lane `lane`'s rings and transfer area, its own
 * doorbells.  Not locked (the group's mapping is).  0 or -errno. */
int aoqd_arena_join(struct aoqd_arena *a, const struct aoqd_arena *of, uint32_t lane);
/* Locks the mapping in memory: 0 (the bytes are added to *locked_total
 * until the free), or -errno (mlock refused it). */
int aoqd_arena_lock(struct aoqd_arena *a, _Atomic uint64_t *locked_total);
/* Watches the client's doorbell: cb(data) runs on the loop thread. */
int aoqd_arena_watch(struct aoqd_arena *a, uv_loop_t *loop, uv_poll_cb cb, void *data);
/* Stops watching (the handle stays until aoqd_arena_unwatch). */
void aoqd_arena_pause(struct aoqd_arena *a);
/* Closes the doorbell's handle; true when there was one (closed_cb will
 * run). */
bool aoqd_arena_unwatch(struct aoqd_arena *a, uv_close_cb closed_cb);
/* Unmaps and closes everything (after the handle closed). */
void aoqd_arena_free(struct aoqd_arena *a);
/* aoqd_arena_free, but the mapping and the memfd (whose pages go with
 * them) are added to `later` (pool.h; NULL: now), so that they are let go
 * off the loop.  What the memfd holds stays charged to the uid until its
 * pages are gone (held.h), as with aoqd_arena_free. */
struct aoqd_release;
void aoqd_arena_free_later(struct aoqd_arena *a, struct aoqd_release *later);
/* The client's ends of the doorbells are sent: closes the daemon's copies. */
void aoqd_arena_sent(struct aoqd_arena *a);
/* Consumes the client's rings: 0, or -ECONNRESET when the client closed
 * its end. */
int aoqd_arena_ack(struct aoqd_arena *a);
/* Wakes the client (any thread); never blocks.  A full doorbell means the
 * client has wake-ups it has not read yet: that is success too. */
void aoqd_arena_ring(struct aoqd_arena *a);
/* Tells the client whether its copies are traced (the to-client ring's
 * `trace` word; a hint the client may ignore).  No-op before the build. */
void aoqd_arena_set_trace(struct aoqd_arena *a, bool on);

#endif
