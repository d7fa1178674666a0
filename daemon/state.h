/* SPDX-License-Identifier: MIT */
/*
 * The optimizer state of a session (state.c; its memory statemem.c): groups and their
 * hyperparameters, tensors and their state arrays, the registration's
 * choices.  It knows nothing of connections, arenas or steps in flight, so
 * that it can outlive a connection or serve several (docs/design.md,
 * "The daemon's parts").
 */
#ifndef AOQD_STATE_H
#define AOQD_STATE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "account.h"
#include "aoq-arena.h"
#include "aoq-kernel.h"
#include "aoq.pb-c.h"

struct aoqd_group {
	Aoq__OptimizerKind kind;
	struct aoqk_hparams hp; /* step and grad_scale filled per job */
	unsigned moments;       /* moments allocated, aoqd_group_moments() at registration */
};

struct aoqd_tensor {
	char *name;
	uint64_t numel;
	enum aoqk_dtype param_dtype, grad_dtype;
	uint32_t group;
	struct aoqk_state st;
	void *state_mem;       /* one mapping holding master, m, v, scales */
	size_t state_len;      /* (and their undo copy at undo_off, when kept) */
	/* The master is the parameter (aoq-arena.h): the master's pages at
	 * state_mem are the masters memfd's from master_off (a shared mapping
	 * over the start of the private one), and map_len bytes of address
	 * space are reserved so that an undo copy can be added in place.
	 * AOQ_NO_MASTER and 0 otherwise. */
	uint64_t master_off;
	size_t map_len;
	size_t undo_off;       /* 0: no undo copy */
	bool locked;           /* the mapping is locked (mlock) */
	/* The state in the session's memfd (aoqd_state_set_memfd): this
	 * tensor's slot, its arrays then its undo room, starts at mem_off in
	 * st->mem_fd; map_len covers the slot. */
	bool in_memfd;
	uint64_t mem_off;
	/* The client steps it itself now (ReleaseTensors): its arrays' pages
	 * dropped, no accumulator; gradients, transfers and snapshots of it
	 * are refused.  Set with __atomic_store_n: populate.c's workers read
	 * it. */
	bool released;
	float *acc;            /* fp32 micro-batch accumulator, allocated on first use */
	uint64_t acc_step;     /* step whose micro-batches acc holds */
	uint64_t steps;        /* updates applied (bias correction) */
	uint64_t cur_step;     /* step of the update in progress */
	/* Ranges [b, e) with a final gradient in cur_step, sorted, merged:
	 * two final records of the same elements are refused. */
	struct aoqd_range { uint64_t b, e; } *done;
	uint32_t ndone, cap_done;
};

/*
 * The journal of a state in a memfd (docs/design.md, "The fd store"): what
 * a new aoqd needs to take back the state of one that was killed, written
 * so that every prefix of its stores is valid.  At AOQD_STATE_MEMFD_JOURNAL
 * in the memfd: this head, the step counters at the last two boundaries
 * (u64 [2][ntensors]), the groups' hyperparameters (aoqd_journal_hp
 * [ngroups]), the save log (aoqd_journal_entry [cap]).  Little-endian,
 * this host's atomics; a reader trusts none of it.
 */
#define AOQD_JOURNAL_DIRTY (1ull << 63)
/* The journal's stop mark: no stop wrote the memfd since (a kill); a stop
 * wrote it with the masters that are parameters copied into their slots;
 * a stop wrote it and left those masters in their memfds in the store,
 * which the next aoqd then needs as after a kill. */
enum { AOQD_STOPPED_NOT = 0, AOQD_STOPPED = 1, AOQD_STOPPED_MASTERS_APART = 2 };
struct aoqd_journal {
	/* last_step, with AOQD_JOURNAL_DIRTY when no rollback can take the
	 * state back to it (loaded since, no undo copy, never completed a
	 * step); stored last at a step's end (release) */
	_Atomic uint64_t boundary;
	_Atomic uint64_t log_n;    /* entries taken in the log (may pass cap) */
	_Atomic uint32_t overflow; /* the log was full: the open step cannot be undone */
	uint32_t cap;              /* entries the log holds */
	_Atomic uint32_t stopped;  /* a stop wrote the memfd: AOQD_STOPPED_* */
	uint32_t zero[9];
};
/* A group's hyperparameters: v[sel] is the one in force (lr, beta1, beta2,
 * eps, weight_decay, momentum, dampening, nesterov); the other is written,
 * then sel flipped (release). */
struct aoqd_journal_hp {
	_Atomic uint32_t sel;
	uint32_t zero;
	double v[2][8];
};
/* One range saved to the undo copy in step `step` (stored last, release),
 * before its kernel ran. */
struct aoqd_journal_entry {
	_Atomic uint64_t step;
	uint32_t tensor, zero;
	uint64_t offset, count;
};
_Static_assert(sizeof(struct aoqd_journal) == 64, "journal head");
_Static_assert(sizeof(struct aoqd_journal_hp) == 136, "journal hp");
_Static_assert(sizeof(struct aoqd_journal_entry) == 32, "journal entry");
#define AOQD_STATE_MEMFD_JOURNAL 4096u

struct aoqd_state {
	Aoq__StatePrecision precision;
	uint64_t window, seed;
	double max_grad_norm;  /* > 0: clip the step's global norm */
	bool skip_nonfinite;   /* skip a step with an inf/nan gradient */
	bool defer;            /* either: updates wait for the step's norm */
	bool delayed;          /* two param buffers, by step parity */
	/* Split masters keep 8 low bits, not 16: the 24-bit master
	 * (Register.master_bits 24; aoqk_state.master_lo8). */
	bool master24;
	bool options_set;      /* the first Register frame set the above */
	/* Lease and resume (README, "Lease and resume"): with `undo`, every
	 * tensor's mapping holds a second copy of its arrays, where each range
	 * is saved before its update; aoqd_state_rollback() then takes the
	 * state back to the end of last_step, the last completed step.
	 * `dirty`: state was loaded since last_step (a LoadState), which no
	 * rollback undoes, or is new and not loaded yet: such a state is not
	 * leased. */
	bool undo;
	bool dirty;
	uint64_t last_step;
	/* The masters (aoq-arena.h, "The master as the parameter"):
	 * masters_size bytes, 0 when no tensor's master is its parameter,
	 * in masters_n memfds laid end to end: memfd k holds the bytes
	 * [masters_end[k-1], masters_end[k]) (from 0 for k = 0), whole
	 * tensors each.  Several memfds, not one: shmem takes a lock of the
	 * file per new page, and the workers that fault a large model's
	 * masters in wait on it (4.2 GB/s for one memfd against 12.6 for a
	 * memfd per thread on the H200 host; RESULTS.md, "Faulting shared
	 * memory"). */
	int masters_fd[AOQ_MASTER_MEMFDS];
	int masters_wd[AOQ_MASTER_MEMFDS]; /* watches (held.h): charged until no client holds them */
	uint64_t masters_end[AOQ_MASTER_MEMFDS];
	uint32_t masters_n;
	uint64_t masters_size;
	/* Taking back a killed or stopped aoqd's state (fdstore.c): the
	 * masters memfds the fd store kept for it, checked
	 * (aoqd_state_masters_check), each taken as the state's own where it
	 * can be trained in place (masters_adopted, bit k: aoqd's
	 * read-write description, sealed against resizing, not against
	 * writes), else read into a new one; masters_restored: they were. */
	const int *masters_from;
	uint32_t masters_from_n;
	uint32_t masters_adopted;
	bool masters_restored;
	/* Every masters memfd went to the fd store (aoqd_state_store_masters):
	 * a stop then leaves the masters there and copies none into the
	 * slots (fdstore.c, AOQD_STOPPED_MASTERS_APART). */
	bool masters_stored;
	/* The state in one memfd (docs/design.md, "The fd store"): mem_fd
	 * (valid when `memfd`) holds a header page, the journal, then every
	 * tensor's slot (from mem_data_off), then the fd store's
	 * descriptor.  store_name: its name in systemd's fd store ("" when
	 * not stored); store_kept: a stop wrote it for the next aoqd, so
	 * freeing the state leaves it in the store. */
	bool memfd;
	bool store_kept;
	int mem_fd;
	uint64_t mem_data_off, mem_data_len;
	char store_name[40];
	/* The journal in the memfd (struct aoqd_journal; NULL without one),
	 * mapped jmap_len bytes at jh. */
	struct aoqd_journal *jh;
	uint64_t *jsteps;              /* [2][ntensors]: steps at even, odd boundaries */
	struct aoqd_journal_hp *jhp;   /* [ngroups] */
	struct aoqd_journal_entry *jlog; /* [jh->cap] */
	size_t jmap_len;
	uint32_t ngroups, ntensors;
	uint32_t cap_groups, cap_tensors;
	struct aoqd_group *groups;
	struct aoqd_tensor *tensors;
	uint64_t state_bytes;  /* state arrays and accumulators */
	uint64_t locked_bytes; /* of which locked in memory */
	uint64_t parameters;   /* elements of every tensor */
	uint32_t nreleased;    /* tensors released (aoqd_state_release) */
	/* Everything the session holds (tables and names, page-rounded state
	 * mappings and accumulators, the arena) is charged to its uid's
	 * account before it is taken; quota is the uid's limit (0: none). */
	struct aoqd_account *account;
	uint64_t quota;
	uint64_t charged;
	/* Snapshots (snapshot.c): an armed capture's boundary + 1 (0: none),
	 * which every update checks before touching a tensor, and the
	 * capture's bookkeeping. */
	_Atomic uint64_t snap_after;
	struct aoqd_capture *snap;
};

/* Tensor steps the daemon takes: a step counter never wraps. */
#define AOQD_MAX_TENSOR_STEPS (1ull << 62)

/* Optimizer kinds the daemon runs: Adam, AdamW, SGD, Lion. */
bool aoqd_kind_valid(int kind);
/* Hyperparameters the kernels accept for `kind`; a message for the client
 * when not. */
bool aoqd_hp_valid(int kind, const Aoq__Hyperparams *h, char *why, size_t len);
/* Whether the kernels run `kind` in state precision p (SGD and Lion: no q8). */
bool aoqd_kind_precision_ok(int kind, Aoq__StatePrecision p);
/* Moments a group's tensors need: Adam/AdamW 2 (m, v), Lion and SGD with
 * momentum 1 (m), SGD without momentum 0.  Registration stores it in
 * g->moments; SetHyperparams may not raise it. */
unsigned aoqd_group_moments(const struct aoqd_group *g);
void aoqd_group_set(struct aoqd_group *g, Aoq__OptimizerKind kind, const Aoq__Hyperparams *h);
bool aoqd_dtype_valid(int d);

/* Charges n bytes to the session's uid: 0, or -EDQUOT past its quota. */
int aoqd_state_charge(struct aoqd_state *st, uint64_t n);
/* The bytes the session's uid may hold now (its quota, an auto quota
 * worked out: account.h), for messages. */
uint64_t aoqd_state_quota(const struct aoqd_state *st);
/* Marks elements [b, b + n) of tensor t final in its current step: 1 when
 * the whole tensor is then final, 0 when not yet, -EEXIST when some of
 * them already were, -ENOMEM. */
int aoqd_tensor_mark_done(struct aoqd_tensor *t, uint64_t b, uint64_t n);

/* A tensor's state arrays: master, m, v, m_scale, v_scale, master_lo. */
#define AOQD_STATE_ARRAYS 6

/* Bytes of one tensor's state arrays with `moments` moments (0: master
 * only, 1: m, 2: m and v), the master split or not: lo is the low half's
 * bytes per element (0: not split, 2: aoqk_state.master_lo, 1: the 24-bit
 * master's master_lo8); off[] receives the arrays' offsets. */
uint64_t aoqd_state_len(enum aoqk_precision p, uint64_t n, unsigned moments, unsigned lo,
                        uint64_t off[AOQD_STATE_ARRAYS]);
/* The same for tensor x of st as aoqd_state_alloc lays it out: a master
 * that is the parameter takes whole pages. */
uint64_t aoqd_state_tensor_len(const struct aoqd_state *st, const struct aoqd_tensor *x,
                               uint64_t off[AOQD_STATE_ARRAYS]);
/* Whether aoqd_state_alloc splits x's master (kernels/README.md, "The split
 * master"): q8 or q4 state with a bf16 parameter, where masters are parameters
 * (master_param).  The high half is then x's parameter in the masters
 * memfd, and the low half a private array (st.master_lo).  Snapshots, the
 * fd store and state transfers see the fp32 master. */
bool aoqd_tensor_wants_split(const struct aoqd_state *st, const struct aoqd_tensor *x);
/* The low half's bytes per element aoqd_state_alloc gives x: 0 (not
 * split), 2 (master_lo), 1 (st->master24: master_lo8, kernels/README.md
 * "The 24-bit master"). */
unsigned aoqd_tensor_wants_lo(const struct aoqd_state *st, const struct aoqd_tensor *x);
/* A split master's low half: its array (NULL when not split) and bytes
 * per element. */
static inline void *aoqd_lo(const struct aoqk_state *a)
{
	return a->master_lo ? a->master_lo : a->master_lo8;
}
static inline unsigned aoqd_lo_size(const struct aoqk_state *a)
{
	return a->master_lo ? 2 : a->master_lo8 ? 1 : 0;
}
static inline void *aoqd_tensor_lo(const struct aoqd_tensor *x)
{
	return aoqd_lo(&x->st);
}
static inline unsigned aoqd_tensor_lo_size(const struct aoqd_tensor *x)
{
	return aoqd_lo_size(&x->st);
}
/* Bytes per element of x's st.master array as allocated (2 when split). */
static inline size_t aoqd_tensor_master_size(const struct aoqd_tensor *x)
{
	return aoqd_tensor_lo(x) ? 2 : aoqk_master_size(x->st.precision);
}
/* Whether aoqd_state_alloc makes masters the parameters where it can
 * (aoqd.conf master_param; on by default).  Process-wide. */
void aoqd_state_set_master_param(bool on);
bool aoqd_state_master_param(void);
/* Whether x's parameter is its master for a client of st (aoq-arena.h):
 * a bf16 master in the masters memfd (with the delayed update too: the
 * client copies the master before it pushes the next gradient; docs/decisions.md,
 * "The master is the parameter"). */
static inline bool aoqd_tensor_master_param(const struct aoqd_state *st, const struct aoqd_tensor *x)
{
	return st->masters_size && x->master_off != UINT64_MAX;
}
/* The masters memfd that holds byte `off` of the masters, and the
 * offset there. */
static inline int aoqd_state_masters_fd(const struct aoqd_state *st, uint64_t off, uint64_t *local, uint32_t *which)
{
	uint32_t k = 0;
	while (k + 1 < st->masters_n && off >= st->masters_end[k])
		k++;
	*local = off - (k ? st->masters_end[k - 1] : 0);
	if (which)
		*which = k;
	return st->masters_fd[k];
}
/* Where states are mapped: in one memfd per session, stored in systemd's
 * fd store under `aoq-state-<n>` (on: aoqd runs under systemd with the fd
 * store and a lease), or in private anonymous mappings (off: transparent
 * huge pages; docs/design.md, "The fd store").  Process-wide; states
 * already mapped keep theirs. */
void aoqd_state_set_memfd(bool on);
/* The names given to stored states start above n (the names of states a
 * restart found in the store). */
void aoqd_state_store_names_above(uint64_t n);
/* The fd store's name of masters memfd k of the state stored as
 * `state_name` (aoq-state-<n>): aoq-masters-<n>-<k>. */
void aoqd_state_masters_name(const char *state_name, uint32_t k, char *buf, size_t len);
/* Puts st's masters memfds in the fd store (when st's memfd is there);
 * a state taken back stores its new ones once the old ones left. */
void aoqd_state_store_masters(struct aoqd_state *st);
/* A read-only description of st's masters memfd k, for a client (a new
 * fd, or -errno): it can map it read-only, not write it, resize it, punch
 * holes in it or seal it, and the memfd's mode (0400, aoqd's uid) keeps
 * another uid from reopening it for writing through /proc. */
int aoqd_state_masters_reopen(const struct aoqd_state *st, uint32_t k);
/* Lays out st's masters (its tables valid) and checks n stored masters
 * memfds against it: as many, each a regular file of its memfd's size.
 * 0, or -EBADFD with the reason in why. */
int aoqd_state_masters_check(struct aoqd_state *st, const int *fds, uint32_t n, char *why, size_t wlen);
/* The bytes of st's memfd slots (every tensor's arrays and undo room,
 * each on pages of its own; a large master that is the parameter puts its
 * slot at the phase modulo 2 MiB of its offset in its masters memfd, holes
 * between), with each tensor's offset from the data's in off[] (NULL: not
 * wanted); UINT64_MAX when the sum overflows.  The tables (groups,
 * tensors) must be valid; lays out the masters (master_off). */
uint64_t aoqd_state_memfd_layout(struct aoqd_state *st, uint64_t *off);
/* The journal of st's tables: its save log's entries, its length; the
 * data's offset in the memfd (the header page, the journal's pages). */
/* Threads of the copies a restart makes (the undo ranges a rollback or a
 * journal copies back, the stored masters). */
#define AOQD_UNSAVE_THREADS 8u
uint32_t aoqd_journal_cap(const struct aoqd_state *st);
uint64_t aoqd_journal_len(const struct aoqd_state *st);
uint64_t aoqd_state_memfd_data_off(const struct aoqd_state *st);
/* Journal writes (no-ops without a journal; loop thread): the boundary
 * at a step's end (the step counters, then last_step, then the log
 * emptied), the state made dirty (a load), a group's hyperparameters.
 * aoqd_state_rollback writes the boundary too. */
void aoqd_state_journal_boundary(struct aoqd_state *st);
void aoqd_state_journal_dirty(struct aoqd_state *st);
void aoqd_state_journal_hp(struct aoqd_state *st, uint32_t g);
/* Elements [off, off + count) of tensor `tensor`, to come back from its
 * undo copy (off on a q8 block). */
struct aoqd_undo {
	uint32_t tensor;
	uint64_t off, count;
};
/* Copies the ranges u[0..n) back from their tensors' undo copies, split
 * by elements over up to `threads` threads (this one included; 8 at most):
 * a killed aoqd's save log replayed (fdstore.c, which merges the ranges
 * that overlap), a rollback.  The ranges must be disjoint: a step saves
 * each range once. */
void aoqd_state_unsave_all(struct aoqd_state *st, const struct aoqd_undo *u, size_t n, unsigned threads);
/* Maps st's tensors in place from fd, a memfd of this layout that a
 * stopping aoqd wrote (fdstore.c validated it), with the undo copy kept:
 * no array is copied but a master that is a parameter, which goes into
 * the new masters memfd.  st keeps a duplicate of fd (closed with it),
 * named `name` in the fd store.  0 or -errno as aoqd_state_alloc. */
int aoqd_state_adopt(struct aoqd_state *st, int fd, const char *name, int lock_memory, _Atomic uint64_t *locked_total,
                     uint64_t *failed_len);
/* Maps every tensor's state.  lock_memory: 0 no, 1 try, 2 required;
 * locked bytes are added to *locked_total.  0, or -errno with *failed_len
 * the size that could not be had. */
int aoqd_state_alloc(struct aoqd_state *st, int lock_memory, _Atomic uint64_t *locked_total, uint64_t *failed_len);
/* Frees every tensor and array; gives the locked bytes back. */
void aoqd_state_free(struct aoqd_state *st, _Atomic uint64_t *locked_total);
/* aoqd_state_free, the accounting done now, but the state's mappings and
 * its memfd added to `later` (pool.h), to be let go off the loop. */
struct aoqd_release;
void aoqd_state_free_later(struct aoqd_state *st, _Atomic uint64_t *locked_total, struct aoqd_release *later);
/* Tensor t's state leaves aoqd for its client (ReleaseTensors): the
 * accounting done now (the bytes given back and uncharged, the locked
 * bytes), its accumulator added to `later` (pool.h), and what frees its
 * pages added to `drop` (aoqd_state_drop; NULL or no memory for the list:
 * done here): unlocked, a fresh anonymous mapping put in place of the
 * arrays or, in the session's memfd, its slot punched.  The mapping itself stays until aoqd_state_free
 * (populate.c's workers may still be on their way to it).  A master that
 * is the parameter keeps its pages in the masters memfd (sealed, and the
 * client's), which stay charged.  Loop thread, nothing in flight, no undo
 * copy.  Returns the bytes st->state_bytes lost (the uid's charge falls
 * by their whole pages). */
struct aoqd_drop {
	size_t n, cap;
	struct aoqd_drop_item {
		uint8_t *p;         /* the tensor's mapping */
		size_t unlock;      /* bytes to munlock from p (0: none) */
		size_t keep, len;   /* a fresh mapping over [p + keep, p + len) (len 0: none) */
		int fd;             /* -1, or punch [off, off + flen) of this memfd */
		off_t off, flen;
	} *v;
};
#define AOQD_DROP_INIT { 0, 0, NULL }
uint64_t aoqd_state_release(struct aoqd_state *st, struct aoqd_tensor *t, _Atomic uint64_t *locked_total,
                            struct aoqd_release *later, struct aoqd_drop *drop);
/* Frees the pages in d and empties it (any thread: the caller keeps the
 * session, and with it the mappings and the memfd, until it returns). */
void aoqd_state_drop(struct aoqd_drop *d);
/* The tensor's accumulator, mapped on first use.  0, -EDQUOT (past the
 * uid's quota) or -ENOMEM. */
int aoqd_state_acc(struct aoqd_state *st, struct aoqd_tensor *t);

/* Undo copies (st->undo): saves elements [b, b + n) of every array of t
 * before their update (any thread, each its own range); rollback puts the
 * saved ranges of the step after st->last_step back, with the tensors'
 * step counters, so that no part of an interrupted step stays (loop
 * thread, nothing in flight). */
void aoqd_state_save(struct aoqd_tensor *t, uint64_t b, uint64_t n);
/* The same, logged in st's journal as saved in `step` before its kernel
 * runs (any thread; an update's chunk). */
void aoqd_state_save_logged(struct aoqd_state *st, struct aoqd_tensor *t, uint64_t b, uint64_t n, uint64_t step);
/* Copies elements [b, b + n) of every array of t's state (q8 scales: the
 * blocks they touch; b on a q8 block) into dst, a region of t->state_len
 * bytes laid out as t's state mapping (snapshot captures). */
void aoqd_state_copy_out(const struct aoqd_tensor *t, uint64_t b, uint64_t n, void *dst);
/* Gives a state without undo copy one (a state restored from a snapshot,
 * resumed by a trainer with a lease): each mapping grows in place or moves
 * (mremap, no copy of the arrays), locked when it was, charged to the uid.
 * 0, or -EDQUOT / -errno with the state as it was.  Loop thread, nothing
 * in flight. */
int aoqd_state_add_undo(struct aoqd_state *st, _Atomic uint64_t *locked_total);
void aoqd_state_rollback(struct aoqd_state *st, unsigned threads);
/* Whether aoqd_state_rollback would copy anything back: a range of the
 * open step changed in a state with its undo copy. */
bool aoqd_state_open_step(const struct aoqd_state *st);
/* Whether st (a new registration's tables) has the layout of the leased
 * state `old`: 0, or -EINVAL with the first difference in why. */
int aoqd_state_same_layout(const struct aoqd_state *st, const struct aoqd_state *old, char *why, size_t len);

/* Elements [e, e + n) of state kind `what` (AOQ__STATE_KIND__*) to or from
 * fp32 buf; q8 pieces start on a block and are whole blocks or end the
 * tensor. */
void aoqd_state_io(struct aoqd_tensor *t, int what, bool load, float *buf, uint64_t e, size_t n);

#endif
