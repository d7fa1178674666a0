/* SPDX-License-Identifier: MIT */
/*
 * The session arena: one sealed memfd shared by aoqd and one trainer.
 *
 *   offset 0               struct aoq_arena_header
 *   tensor_table_off       struct aoq_arena_tensor[tensors]
 *   slot_table_off         struct aoq_arena_slot[slots]
 *   to_daemon_off          struct aoq_ring + aoq_rec[ring_capacity]  (client produces)
 *   to_client_off          struct aoq_ring + aoq_rec[ring_capacity]  (daemon produces)
 *   xfer_off               transfer area: state loads and reads (xfer_bytes)
 *   data_off .. size       staging slots, every area 64-byte aligned
 *
 * Without a window, slot t belongs to tensor t: its grad area holds the
 * whole gradient (numel * grad dtype size) and its param area the whole
 * parameter.  A record's data then sits at area + offset * dtype size.
 * With a window, there are `slots` staging slots of `slot_elems` elements
 * each; the client picks a free slot per chunk and the data sits at the
 * start of the slot's areas (count <= slot_elems).
 *
 * The daemon writes the header and tables once, before sealing; it keeps its
 * own copy of the layout and never reads it back.  The client validates the
 * header against the size of what it mapped.  The rings are the only shared
 * state that changes: each side reads the other side's counter exactly once
 * per operation into a local and checks it before use.
 */
#ifndef AOQ_ARENA_H
#define AOQ_ARENA_H

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define AOQ_ARENA_MAGIC 0x41514f41u /* "AOQA" */
#define AOQ_ARENA_VERSION 4u /* 3: masters with the delayed update too; 4: masters in several memfds */
#define AOQ_ARENA_ALIGN 64u
#define AOQ_PROTOCOL_VERSION 2u /* 2: Hello and Welcome carry the arena version and the release */
#define AOQ_MAX_FRAME (1u << 20)
#define AOQ_MASTER_MEMFDS 16 /* the most memfds the masters come in */
#define AOQ_MAX_FDS (3 + AOQ_MASTER_MEMFDS)
/* Clients push a tensor as records of at most this many elements (a
 * multiple of the q8 block), so the daemon updates the first piece while
 * the rest is still being copied; the rings are sized for it. */
#define AOQ_PUSH_CHUNK_ELEMS (1u << 20)
/* The most records a ring holds (the daemon sizes rings within it). */
#define AOQ_RING_MAX_CAP (1u << 20)
/* The most spans one TraceSpans report carries (client-timed copies). */
#define AOQ_TRACE_SPANS_MAX 4096u
/* The most elements a window slot holds (bounds slot_elems * 4). */
#define AOQ_SLOT_MAX_ELEMS (1ull << 40)

struct aoq_arena_header {
	uint32_t magic;
	uint32_t version;
	uint64_t size;
	uint32_t tensors;
	uint32_t slots;
	uint64_t window;      /* 0: a slot per tensor */
	uint64_t slot_elems;  /* window mode: elements per slot */
	uint32_t ring_capacity;
	uint32_t rec_size;
	uint64_t tensor_table_off;
	uint64_t slot_table_off;
	uint64_t to_daemon_off;
	uint64_t to_client_off;
	uint64_t data_off;
	uint64_t session_id;
	uint64_t xfer_off;    /* LoadState/ReadState data */
	uint64_t xfer_bytes;
	uint64_t flags;       /* AOQ_ARENA_DELAYED */
	uint64_t masters_size; /* bytes of the masters (fds 4 on, end to end); 0: none */
};

/* Delayed update: every param area is two buffers of param_bytes, the
 * second at param_off + aoq_align_up(param_bytes, AOQ_ARENA_ALIGN); step s
 * writes buffer s & 1.  A tensor whose master is the parameter has no
 * param area (param_bytes 0): the master is written in place. */
#define AOQ_ARENA_DELAYED 1u

struct aoq_arena_tensor {
	uint64_t numel;
	uint32_t param_dtype;
	uint32_t grad_dtype;
	uint32_t group;
	uint32_t slot; /* its own slot, or UINT32_MAX with a window */
	/* The master is the parameter: the tensor's bf16 master sits at this
	 * offset of the masters (the memfds end to end), and the parameter is copied from there
	 * (its slot has no param area without a window, and with one the
	 * daemon writes none).  AOQ_NO_MASTER: the param area, as always. */
	uint64_t master_off;
};

/*
 * The master as the parameter (docs/decisions.md, "The master is the parameter"):
 * with a bf16 master and bf16 parameters, aoqd keeps
 * each such tensor's master in the session's masters: 1 to
 * AOQ_MASTER_MEMFDS memfds, each of whole tensors' masters and a multiple
 * of AOQ_MASTER_ALIGN bytes, sealed against resizing, of mode 0400, sent
 * as Registered's fds from the fourth on as read-only descriptions (the
 * client cannot map them writable, write, resize or seal them).
 * Laid end to end in that order they are masters_size bytes, which
 * master_off counts in.  The client maps them read-only, end to end, and
 * copies parameters straight from them: the update writes no separate
 * parameter.  The daemon updates a
 * master in place, so a client copies a tensor's parameter out before it
 * pushes that tensor's next final gradient (the rule a slot-per-tensor
 * arena without a window already has).  With the delayed update the copy
 * of step s's update leaves at the push of step s + 1, and the record of
 * that push is posted only once the copy has landed (libaoq orders the
 * gradient's copy after it).
 */
#define AOQ_NO_MASTER UINT64_MAX
#define AOQ_MASTER_ALIGN 4096u

struct aoq_arena_slot {
	uint64_t grad_off;
	uint64_t grad_bytes;
	uint64_t param_off;
	uint64_t param_bytes;
};

/* Record flags, client -> daemon. */
enum {
	AOQ_REC_ACCUMULATE = 1u << 0, /* non-final micro-batch: add to the host accumulator */
};
#define AOQ_REC_FLAGS_KNOWN (AOQ_REC_ACCUMULATE)

/* Record status, daemon -> client. */
enum {
	AOQ_REC_UPDATED = 0,     /* the param area holds the updated values */
	AOQ_REC_ACCUMULATED = 1, /* the gradient was accumulated; no param */
	AOQ_REC_SKIPPED = 2,     /* non-finite gradient: nothing changed; no param */
};

/* Both directions use the same record. */
struct aoq_rec {
	uint32_t tensor;
	uint32_t slot;
	uint64_t offset; /* first element within the tensor */
	uint64_t count;  /* elements */
	uint64_t step;
	uint32_t flags;  /* client -> daemon */
	int32_t status;  /* daemon -> client */
};

struct aoq_ring {
	_Atomic uint64_t head; /* written by the producer only */
	/* Set by a producer that found the ring full: the consumer clears it
	 * after popping and rings the producer's doorbell. */
	_Atomic uint32_t producer_waiting;
	/* The to-client ring only: nonzero while aoqctl traces the session
	 * (daemon writes, client reads as a hint): the client then times its
	 * copies and reports them (TraceSpans). */
	_Atomic uint32_t trace;
	/* The to-client ring only: nonzero while a client thread polls the
	 * ring without sleeping (client writes, daemon reads as a hint): a
	 * push then need not ring the doorbell (aoq_ring_consumer_spinning).
	 * A client that lies only delays its own answers. */
	_Atomic uint32_t consumer_spinning;
	uint8_t pad0[44];
	_Atomic uint64_t tail; /* written by the consumer only */
	uint8_t pad1[56];
	struct aoq_rec recs[];
};

_Static_assert(sizeof(struct aoq_rec) == 40, "record layout");
_Static_assert(sizeof(struct aoq_ring) == 128, "ring layout");
_Static_assert(sizeof(struct aoq_arena_header) == 128, "header layout");
_Static_assert(sizeof(struct aoq_arena_tensor) == 32, "tensor table layout");

/* A spin-wait loop's pause (both sides poll rings and flags a while
 * before they sleep). */
static inline void aoq_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

static inline uint64_t aoq_align_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) & ~(a - 1);
}

/* Overflow-safe a * b; false on overflow. */
static inline bool aoq_mul_ok(uint64_t a, uint64_t b, uint64_t *out)
{
	return !__builtin_mul_overflow(a, b, out);
}

/* Overflow-safe off + len <= limit. */
static inline bool aoq_range_ok(uint64_t off, uint64_t len, uint64_t limit)
{
	uint64_t end;
	return !__builtin_add_overflow(off, len, &end) && end <= limit;
}

/*
 * The arena's layout rules, one definition for every side: the daemon
 * checks the layout it built, the client and the test harness the layout
 * they mapped (map_size bytes).  h is the reader's private copy of the
 * header.  0, or -EPROTO when the layout breaks a rule.
 */
static inline int aoq_arena_header_check(const struct aoq_arena_header *h, uint64_t map_size)
{
	if (h->magic != AOQ_ARENA_MAGIC || h->version != AOQ_ARENA_VERSION || h->size != map_size ||
	    h->size < sizeof(struct aoq_arena_header) || h->rec_size != sizeof(struct aoq_rec) ||
	    h->ring_capacity == 0 || h->ring_capacity > AOQ_RING_MAX_CAP)
		return -EPROTO;
	uint64_t ring_bytes = sizeof(struct aoq_ring) + (uint64_t)h->ring_capacity * sizeof(struct aoq_rec);
	uint64_t tt_bytes = (uint64_t)h->tensors * sizeof(struct aoq_arena_tensor);
	uint64_t st_bytes = (uint64_t)h->slots * sizeof(struct aoq_arena_slot);
	if (!aoq_range_ok(h->tensor_table_off, tt_bytes, h->size) ||
	    !aoq_range_ok(h->slot_table_off, st_bytes, h->size) ||
	    !aoq_range_ok(h->to_daemon_off, ring_bytes, h->size) ||
	    !aoq_range_ok(h->to_client_off, ring_bytes, h->size) ||
	    !aoq_range_ok(h->xfer_off, h->xfer_bytes, h->size) || h->xfer_bytes < 4 ||
	    h->to_daemon_off % 64 || h->to_client_off % 64 || h->tensor_table_off % 8 || h->slot_table_off % 8)
		return -EPROTO;
	if ((h->window == 0 && h->slots != h->tensors) ||
	    (h->window && (h->slots == 0 || h->slot_elems == 0 || h->slot_elems > AOQ_SLOT_MAX_ELEMS)))
		return -EPROTO;
	if (h->masters_size % AOQ_MASTER_ALIGN)
		return -EPROTO;
	return 0;
}

/* One tensor's master (the reader's copy of its table entry) of a checked
 * header: AOQ_NO_MASTER, or a bf16 tensor's whole master, aligned, within
 * the masters memfd.  0 or -EPROTO. */
static inline int aoq_arena_master_check(const struct aoq_arena_header *h, const struct aoq_arena_tensor *t)
{
	uint64_t bytes;
	if (t->master_off == AOQ_NO_MASTER)
		return 0;
	if (!h->masters_size || t->param_dtype != 1u /* AOQ__DTYPE__BF16 */ || t->master_off % AOQ_MASTER_ALIGN ||
	    !aoq_mul_ok(t->numel, 2, &bytes) || !aoq_range_ok(t->master_off, bytes, h->masters_size))
		return -EPROTO;
	return 0;
}

/* One slot (the reader's copy) of a checked header: its areas lie in the
 * arena, the delayed update's second param buffer included, and hold at
 * least grad_need and param_need bytes. */
static inline int aoq_arena_slot_check(const struct aoq_arena_header *h, const struct aoq_arena_slot *s,
                                       uint64_t grad_need, uint64_t param_need)
{
	uint64_t pbuf = (h->flags & AOQ_ARENA_DELAYED) ? aoq_align_up(s->param_bytes, AOQ_ARENA_ALIGN) : 0;
	if (s->grad_bytes < grad_need || s->param_bytes < param_need ||
	    !aoq_range_ok(s->grad_off, s->grad_bytes, h->size) ||
	    !aoq_range_ok(s->param_off, pbuf + s->param_bytes, h->size))
		return -EPROTO;
	return 0;
}

/*
 * Replica groups (docs/design.md, "Replica groups"): the local ranks of one
 * job share one state and one arena.  The arena then has one lane per local
 * rank (its to-daemon ring, its to-client ring, its transfer area, at the
 * offsets Registered gives; the header's offsets are lane 0's), and local
 * rank r owns elements [b, e) of every tensor, where b is r * numel / world
 * rounded down to AOQ_SLICE_ALIGN elements (a q8 block, so that a slice never
 * splits one) and e is the next rank's b (numel for the last rank).  A rank
 * pushes only its slice; a slice may be empty.  One definition for the
 * daemon, libaoq and the tests.
 */
#define AOQ_SLICE_ALIGN 256u
#define AOQ_MAX_LOCAL_WORLD 64u

static inline uint64_t aoq_slice_begin(uint64_t numel, uint32_t world, uint32_t rank)
{
	if (world < 2)
		return 0;
	if (rank >= world)
		return numel;
	/* numel < 2^56 (the daemon's max_tensor_elems is at most 2^48), world
	 * at most 64: no overflow */
	uint64_t b = numel / world * rank + numel % world * rank / world;
	return b - b % AOQ_SLICE_ALIGN;
}

static inline void aoq_slice(uint64_t numel, uint32_t world, uint32_t rank, uint64_t *b, uint64_t *e)
{
	*b = aoq_slice_begin(numel, world, rank);
	*e = world < 2 || rank + 1 >= world ? numel : aoq_slice_begin(numel, world, rank + 1);
}

/* The producer's side of a ring.  `head` is private: the shared head is
 * only written, never read back. */
struct aoq_ring_prod {
	struct aoq_ring *ring;
	uint32_t cap;
	uint64_t head;
};

/* The consumer's side.  `tail` is private likewise. */
struct aoq_ring_cons {
	struct aoq_ring *ring;
	uint32_t cap;
	uint64_t tail;
};

/* Free entries, or -EPROTO when the consumer's counter is impossible. */
static inline int64_t aoq_ring_space(const struct aoq_ring_prod *p)
{
	uint64_t tail = atomic_load_explicit(&p->ring->tail, memory_order_acquire);
	uint64_t used = p->head - tail;
	if (used > p->cap)
		return -EPROTO;
	return (int64_t)(p->cap - used);
}

/*
 * Appends one record.  Returns 1 when the consumer may be asleep and must be
 * woken (the ring was empty as far as it had seen), 0 when not, -EAGAIN when
 * full, -EPROTO when the consumer's counter is impossible.
 */
static inline int aoq_ring_push(struct aoq_ring_prod *p, const struct aoq_rec *rec)
{
	int64_t space = aoq_ring_space(p);
	if (space < 0)
		return (int)space;
	if (space == 0)
		return -EAGAIN;
	memcpy(&p->ring->recs[p->head % p->cap], rec, sizeof(*rec));
	p->head++;
	atomic_store_explicit(&p->ring->head, p->head, memory_order_release);
	/* Pairs with the fence in aoq_ring_idle(): either the consumer sees
	 * our head, or we see that it had consumed everything and sleeps. */
	atomic_thread_fence(memory_order_seq_cst);
	uint64_t tail = atomic_load_explicit(&p->ring->tail, memory_order_relaxed);
	return tail == p->head - 1 ? 1 : 0;
}

/* Copies the next record into *rec.  Returns 1, 0 when empty, -EPROTO when
 * the producer's counter is impossible.  The copy is the caller's to
 * validate: the producer may scribble on the ring at any time. */
static inline int aoq_ring_peek(const struct aoq_ring_cons *c, struct aoq_rec *rec)
{
	uint64_t head = atomic_load_explicit(&c->ring->head, memory_order_acquire);
	uint64_t avail = head - c->tail;
	if (avail > c->cap)
		return -EPROTO;
	if (avail == 0)
		return 0;
	memcpy(rec, &c->ring->recs[c->tail % c->cap], sizeof(*rec));
	return 1;
}

static inline void aoq_ring_pop(struct aoq_ring_cons *c)
{
	c->tail++;
	atomic_store_explicit(&c->ring->tail, c->tail, memory_order_release);
}

/* After popping: true when the producer waits for space and must be woken
 * (through the doorbell in the other direction). */
static inline bool aoq_ring_producer_waiting(const struct aoq_ring_cons *c)
{
	atomic_thread_fence(memory_order_seq_cst);
	if (!atomic_load_explicit(&c->ring->producer_waiting, memory_order_relaxed))
		return false;
	return atomic_exchange_explicit(&c->ring->producer_waiting, 0, memory_order_relaxed) != 0;
}

/* A producer that found the ring full: announce it, then check again; true
 * when there is space after all (no wake will come, none is needed). */
static inline bool aoq_ring_wait_space(struct aoq_ring_prod *p, uint64_t need)
{
	atomic_store_explicit(&p->ring->producer_waiting, 1, memory_order_relaxed);
	atomic_thread_fence(memory_order_seq_cst);
	int64_t space = aoq_ring_space(p);
	return space < 0 || (uint64_t)space >= need;
}

/* After a push that returned 1: false when the consumer announced that it
 * polls the ring without sleeping, so the doorbell need not ring.  The
 * fence in aoq_ring_push() and the one in aoq_ring_idle() (which a
 * consumer calls after clearing the word, before it sleeps) make sure that
 * either the consumer sees the record or the producer sees the cleared
 * word and rings. */
static inline bool aoq_ring_consumer_sleeps(const struct aoq_ring_prod *p)
{
	return atomic_load_explicit(&p->ring->consumer_spinning, memory_order_relaxed) == 0;
}

/* Consumer: announce (1) or withdraw (0) polling without sleeping.  After
 * withdrawing, check the ring once more (aoq_ring_idle) before sleeping. */
static inline void aoq_ring_set_spinning(struct aoq_ring_cons *c, bool on)
{
	atomic_store_explicit(&c->ring->consumer_spinning, on ? 1u : 0u, memory_order_relaxed);
}

/* Call before sleeping on the doorbell: true when the ring is still empty
 * after publishing our tail, so a producer that pushes now will ring. */
static inline bool aoq_ring_idle(const struct aoq_ring_cons *c)
{
	atomic_thread_fence(memory_order_seq_cst);
	return atomic_load_explicit(&c->ring->head, memory_order_relaxed) == c->tail;
}

#endif
