/* SPDX-License-Identifier: MIT */
/* The arena: layout, creation, sealing, doorbells.  Loop thread, except
 * aoqd_arena_ring(). */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "arena.h"
#include "held.h"
#include "pool.h"

void aoqd_arena_init(struct aoqd_arena *a)
{
	memset(a, 0, sizeof(*a));
	a->fd = a->doorbell_in = a->doorbell_out = a->peer_in = a->peer_out = -1;
	pthread_mutex_init(&a->ring_lock, NULL);
}

static uint64_t biggest_tensor(const struct aoqd_state *st)
{
	uint64_t biggest = 0;
	for (uint32_t i = 0; i < st->ntensors; i++)
		if (st->tensors[i].numel > biggest)
			biggest = st->tensors[i].numel;
	return biggest;
}

static int make_doorbells(struct aoqd_arena *a)
{
	int in[2], out[2];
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, in) < 0)
		return -errno;
	a->doorbell_in = in[0];
	a->peer_in = in[1];
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, out) < 0)
		return -errno;
	a->doorbell_out = out[0];
	a->peer_out = out[1];
	/* Each end is one-way. */
	shutdown(a->doorbell_in, SHUT_WR);
	shutdown(a->doorbell_out, SHUT_RD);
	return 0;
}

int aoqd_arena_build(struct aoqd_arena *a, const struct aoqd_state *st, uint64_t session_id, uint64_t max_bytes)
{
	return aoqd_arena_build_lanes(a, st, session_id, max_bytes, 1);
}

/* The layout of st's arena with `lanes` lanes: every offset and size in
 * a, a->slots allocated; no memory mapped. */
static int layout(struct aoqd_arena *a, const struct aoqd_state *st, uint64_t max_bytes, uint32_t lanes)
{
	if (lanes < 1 || lanes > AOQ_MAX_LOCAL_WORLD)
		return -EINVAL;
	uint64_t off = aoq_align_up(sizeof(struct aoq_arena_header), AOQ_ARENA_ALIGN);
	off = aoq_align_up(off + (uint64_t)st->ntensors * sizeof(struct aoq_arena_tensor), AOQ_ARENA_ALIGN);
	uint64_t biggest = biggest_tensor(st);
	if (st->window) {
		/* Staging slots of up to 1 Mi elements, grad and param areas of
		 * 4 bytes per element each (any dtype fits). */
		a->slot_elems = aoq_align_up(biggest < (1u << 20) ? biggest : (1u << 20), AOQK_Q8_BLOCK);
		uint64_t n = st->window / (8 * a->slot_elems);
		if (n < 2)
			n = 2;
		if (n > 4096)
			n = 4096;
		a->nslots = (uint32_t)n;
	} else {
		a->nslots = st->ntensors;
	}
	off = aoq_align_up(off + (uint64_t)a->nslots * sizeof(struct aoq_arena_slot), AOQ_ARENA_ALIGN);
	/* Room for two steps' records: a tensor is pushed in pieces of
	 * AOQ_PUSH_CHUNK_ELEMS, or one per slot with a window. */
	uint64_t recs = 0;
	for (uint32_t i = 0; !st->window && i < st->ntensors; i++)
		recs += (st->tensors[i].numel + AOQ_PUSH_CHUNK_ELEMS - 1) / AOQ_PUSH_CHUNK_ELEMS + (lanes - 1);
	uint64_t cap = 2 * (st->window ? a->nslots : recs);
	a->ring_cap = (uint32_t)(cap < 256 ? 256 : cap > AOQ_RING_MAX_CAP ? AOQ_RING_MAX_CAP : cap);
	uint64_t ring_bytes = sizeof(struct aoq_ring) + (uint64_t)a->ring_cap * sizeof(struct aoq_rec);
	/* A lane: the to-daemon ring, the to-client ring, the transfer area
	 * (4 Mi fp32 values, or the largest tensor); one per local rank. */
	a->xfer_bytes = 4 * (biggest < AOQD_MAX_TRANSFER_ELEMS ? biggest : AOQD_MAX_TRANSFER_ELEMS);
	a->lanes = lanes;
	a->lane_off = off;
	a->lane_bytes = 2 * aoq_align_up(ring_bytes, AOQ_ARENA_ALIGN) + aoq_align_up(a->xfer_bytes, AOQ_ARENA_ALIGN);
	uint64_t to_daemon = off;
	uint64_t to_client = to_daemon + aoq_align_up(ring_bytes, AOQ_ARENA_ALIGN);
	a->xfer_off = to_client + aoq_align_up(ring_bytes, AOQ_ARENA_ALIGN);
	a->to_daemon_off = to_daemon;
	a->to_client_off = to_client;
	off += (uint64_t)lanes * a->lane_bytes;
	a->slots = calloc(a->nslots, sizeof(*a->slots));
	if (!a->slots)
		return -ENOMEM;
	for (uint32_t i = 0; i < a->nslots; i++) {
		struct aoq_arena_slot *sl = &a->slots[i];
		uint64_t gb, pb;
		if (st->window) {
			gb = pb = a->slot_elems * 4;
		} else {
			gb = st->tensors[i].numel * aoqk_dtype_size(st->tensors[i].grad_dtype);
			/* a master that is the parameter needs no param area */
			pb = aoqd_tensor_master_param(st, &st->tensors[i])
				? 0 : st->tensors[i].numel * aoqk_dtype_size(st->tensors[i].param_dtype);
		}
		sl->grad_off = off;
		sl->grad_bytes = gb;
		off = aoq_align_up(off + gb, AOQ_ARENA_ALIGN);
		sl->param_off = off;
		sl->param_bytes = pb;
		off = aoq_align_up(off + pb, AOQ_ARENA_ALIGN);
		if (st->delayed) /* the second buffer */
			off = aoq_align_up(off + pb, AOQ_ARENA_ALIGN);
		if (off > max_bytes)
			return -EFBIG;
	}
	a->size = off;
	return 0;
}

int aoqd_arena_size(const struct aoqd_state *st, uint64_t max_bytes, uint32_t lanes, uint64_t *size)
{
	struct aoqd_arena a = { .fd = -1 };
	int r = layout(&a, st, max_bytes, lanes);
	*size = a.size;
	free(a.slots);
	return r;
}

int aoqd_arena_build_lanes(struct aoqd_arena *a, const struct aoqd_state *st, uint64_t session_id, uint64_t max_bytes,
                           uint32_t lanes)
{
	int r = layout(a, st, max_bytes, lanes);
	if (r < 0)
		return r;
	uint64_t tensor_table = aoq_align_up(sizeof(struct aoq_arena_header), AOQ_ARENA_ALIGN);
	uint64_t slot_table = aoq_align_up(tensor_table + (uint64_t)st->ntensors * sizeof(struct aoq_arena_tensor),
	                                   AOQ_ARENA_ALIGN);
	uint64_t to_daemon = a->to_daemon_off, to_client = a->to_client_off;
	uint64_t data = a->lane_off + (uint64_t)a->lanes * a->lane_bytes;
	int fd = memfd_create("aoq-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	a->fd = fd;
	a->owner = true;
	a->held_wd = aoqd_held_watch(fd);
	if (ftruncate(fd, (off_t)a->size) < 0)
		return -errno;
	void *p = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return -errno;
	/* Huge pages where shmem_enabled allows (advise): a large arena's
	 * first touch and every later mapping of it (the trainer's, the next
	 * session's after a restart) then cost a page-table entry per 2 MiB,
	 * not per 4 KiB (docs/operating.md, "Huge pages"). */
	if (a->size >= (2u << 20))
		madvise(p, a->size, MADV_HUGEPAGE);
	a->base = p;
	struct aoq_arena_header *h = p;
	h->magic = AOQ_ARENA_MAGIC;
	h->version = AOQ_ARENA_VERSION;
	h->size = a->size;
	h->tensors = st->ntensors;
	h->slots = a->nslots;
	h->window = st->window;
	h->slot_elems = a->slot_elems;
	h->ring_capacity = a->ring_cap;
	h->rec_size = sizeof(struct aoq_rec);
	h->tensor_table_off = tensor_table;
	h->slot_table_off = slot_table;
	h->to_daemon_off = to_daemon;
	h->to_client_off = to_client;
	h->data_off = data;
	h->session_id = session_id;
	h->xfer_off = a->xfer_off;
	h->xfer_bytes = a->xfer_bytes;
	h->flags = st->delayed ? AOQ_ARENA_DELAYED : 0;
	h->masters_size = st->masters_size;
	struct aoq_arena_tensor *tt = (void *)(a->base + tensor_table);
	for (uint32_t i = 0; i < st->ntensors; i++) {
		tt[i].numel = st->tensors[i].numel;
		tt[i].param_dtype = st->tensors[i].param_dtype;
		tt[i].grad_dtype = st->tensors[i].grad_dtype;
		tt[i].group = st->tensors[i].group;
		tt[i].slot = st->window ? UINT32_MAX : i;
		tt[i].master_off = aoqd_tensor_master_param(st, &st->tensors[i]) ? st->tensors[i].master_off : AOQ_NO_MASTER;
	}
	memcpy(a->base + slot_table, a->slots, (size_t)a->nslots * sizeof(*a->slots));
	/* The layout keeps the rules every reader checks. */
	if (aoq_arena_header_check(h, a->size) < 0)
		return -EPROTO;
	for (uint32_t i = 0; i < a->nslots; i++)
		if (aoq_arena_slot_check(h, &a->slots[i], 0, 0) < 0)
			return -EPROTO;
	for (uint32_t i = 0; i < st->ntensors; i++)
		if (aoq_arena_master_check(h, &tt[i]) < 0)
			return -EPROTO;
	a->to_daemon = (struct aoq_ring_cons){ .ring = (void *)(a->base + to_daemon), .cap = a->ring_cap };
	a->to_client = (struct aoq_ring_prod){ .ring = (void *)(a->base + to_client), .cap = a->ring_cap };
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0)
		return -errno;
	return make_doorbells(a);
}

int aoqd_arena_join(struct aoqd_arena *a, const struct aoqd_arena *of, uint32_t lane)
{
	if (lane >= of->lanes || of->fd < 0)
		return -EINVAL;
	a->fd = fcntl(of->fd, F_DUPFD_CLOEXEC, 0);
	if (a->fd < 0)
		return -errno;
	a->size = of->size;
	void *p = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
	if (p == MAP_FAILED)
		return -errno;
	a->base = p;
	a->nslots = of->nslots;
	a->slot_elems = of->slot_elems;
	a->slots = calloc(a->nslots, sizeof(*a->slots));
	if (!a->slots)
		return -ENOMEM;
	memcpy(a->slots, of->slots, (size_t)a->nslots * sizeof(*a->slots));
	a->ring_cap = of->ring_cap;
	a->lanes = of->lanes;
	a->lane_off = of->lane_off;
	a->lane_bytes = of->lane_bytes;
	uint64_t d = (uint64_t)lane * of->lane_bytes;
	a->to_daemon_off = of->to_daemon_off + d;
	a->to_client_off = of->to_client_off + d;
	a->xfer_off = of->xfer_off + d;
	a->xfer_bytes = of->xfer_bytes;
	a->to_daemon = (struct aoq_ring_cons){ .ring = (void *)(a->base + a->to_daemon_off), .cap = a->ring_cap };
	a->to_client = (struct aoq_ring_prod){ .ring = (void *)(a->base + a->to_client_off), .cap = a->ring_cap };
	return make_doorbells(a);
}

int aoqd_arena_watch(struct aoqd_arena *a, uv_loop_t *loop, uv_poll_cb cb, void *data)
{
	int r = uv_poll_init(loop, &a->doorbell_poll, a->doorbell_in);
	if (r < 0)
		return r;
	a->doorbell_poll.data = data;
	a->poll_open = true;
	return uv_poll_start(&a->doorbell_poll, UV_READABLE, cb);
}

void aoqd_arena_pause(struct aoqd_arena *a)
{
	if (a->poll_open)
		uv_poll_stop(&a->doorbell_poll);
}

bool aoqd_arena_unwatch(struct aoqd_arena *a, uv_close_cb closed_cb)
{
	if (!a->poll_open)
		return false;
	a->poll_open = false;
	uv_close((uv_handle_t *)&a->doorbell_poll, closed_cb);
	return true;
}

int aoqd_arena_lock(struct aoqd_arena *a, _Atomic uint64_t *locked_total)
{
	if (!a->base)
		return 0;
	/* Locked as its pages are first written (the trainer's copies), not
	 * populated here on the loop thread: a large model's gradient areas
	 * would hold every session for seconds. */
	if (mlock2(a->base, a->size, MLOCK_ONFAULT) < 0)
		return -errno;
	a->locked = a->size;
	a->locked_total = locked_total;
	atomic_fetch_add(locked_total, a->size);
	return 0;
}

/* The client may keep its fd and mapping (and reads its rings' last
 * counters and the Error after a failure): what the memfd holds stays
 * charged to the uid until no description of it is left (held.h). */
static void held_release(struct aoqd_arena *a)
{
	struct stat sb;
	if (a->fd >= 0 && a->owner && fstat(a->fd, &sb) == 0)
		aoqd_held_release(a->held_wd, a->account, (uint64_t)sb.st_blocks * 512);
	a->owner = false;
}

void aoqd_arena_free(struct aoqd_arena *a)
{
	if (a->locked && a->locked_total)
		atomic_fetch_sub(a->locked_total, a->locked);
	a->locked = 0;
	free(a->slots);
	a->slots = NULL;
	if (a->base)
		munmap(a->base, a->size);
	held_release(a);
	if (a->fd >= 0)
		close(a->fd);
	if (a->doorbell_in >= 0)
		close(a->doorbell_in);
	if (a->doorbell_out >= 0)
		close(a->doorbell_out);
	aoqd_arena_sent(a);
	a->base = NULL;
	a->fd = a->doorbell_in = a->doorbell_out = -1;
	pthread_mutex_destroy(&a->ring_lock);
}

void aoqd_arena_free_later(struct aoqd_arena *a, struct aoqd_release *later)
{
	held_release(a); /* before the fd goes: it reads the memfd's size */
	if (later && a->base) {
		aoqd_release(later, a->base, a->size, a->fd);
		a->base = NULL;
		a->fd = -1;
	}
	aoqd_arena_free(a);
}

void aoqd_arena_sent(struct aoqd_arena *a)
{
	if (a->peer_in >= 0)
		close(a->peer_in);
	if (a->peer_out >= 0)
		close(a->peer_out);
	a->peer_in = a->peer_out = -1;
}

int aoqd_arena_ack(struct aoqd_arena *a)
{
	uint8_t buf[256];
	for (int i = 0; i < 64; i++) {
		ssize_t r = recv(a->doorbell_in, buf, sizeof(buf), MSG_DONTWAIT);
		if (r == 0)
			return -ECONNRESET;
		if (r < 0)
			return errno == ECONNRESET ? -ECONNRESET : 0;
		if ((size_t)r < sizeof(buf))
			return 0;
	}
	return 0; /* the rest at the next wake */
}

void aoqd_arena_ring(struct aoqd_arena *a)
{
	uint8_t one = 1;
	ssize_t r = send(a->doorbell_out, &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
	(void)r; /* EAGAIN: the client has wake-ups to read; EPIPE: it is gone */
}

void aoqd_arena_set_trace(struct aoqd_arena *a, bool on)
{
	if (a->to_client.ring)
		atomic_store_explicit(&a->to_client.ring->trace, on ? 1u : 0u, memory_order_relaxed);
}
