/* SPDX-License-Identifier: MIT */
/*
 * Optimizer state: hyperparameter rules, the state arrays of every tensor
 * (one mapping each, locked in memory when asked; private, or slots of the
 * session's memfd kept in systemd's fd store), their conversion to and
 * from fp32 for state transfer.  Loop thread, except aoqd_state_io(),
 * which transfer tasks run on workers (each its own range).
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "aoq-arena.h"
#include "aoq-config.h"
#include "convert.h"
#include "held.h"
#include "log.h"
#include "pool.h"
#include "state.h"
#include "wire.h"

#if AOQ_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

bool aoqd_kind_valid(int kind)
{
	return kind == AOQ__OPTIMIZER_KIND__ADAMW || kind == AOQ__OPTIMIZER_KIND__ADAM ||
	       kind == AOQ__OPTIMIZER_KIND__SGD || kind == AOQ__OPTIMIZER_KIND__LION;
}

static const char *kind_name(int kind)
{
	const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(&aoq__optimizer_kind__descriptor, kind);
	return v ? v->name : "?";
}

bool aoqd_hp_valid(int kind, const Aoq__Hyperparams *h, char *why, size_t len)
{
	if (!h) {
		snprintf(why, len, "missing hyperparameters");
		return false;
	}
	bool ok = isfinite(h->lr) && h->lr >= 0 && isfinite(h->weight_decay) && h->weight_decay >= 0;
	switch (kind) {
	case AOQ__OPTIMIZER_KIND__SGD:
		/* torch.optim.SGD; the nesterov rule is torch's (and the kernel's) */
		ok = ok && h->momentum >= 0 && h->momentum < 1 && h->dampening >= 0 && h->dampening <= 1 &&
		     (!h->nesterov || (h->momentum > 0 && h->dampening == 0));
		if (!ok) {
			snprintf(why, len, "SGD hyperparameters out of range (lr %g momentum %g dampening %g nesterov %d wd %g; "
			         "nesterov needs momentum > 0 and dampening 0)",
			         h->lr, h->momentum, h->dampening, (int)h->nesterov, h->weight_decay);
			return false;
		}
		return true;
	case AOQ__OPTIMIZER_KIND__LION:
		ok = ok && h->beta1 >= 0 && h->beta1 < 1 && h->beta2 >= 0 && h->beta2 < 1;
		break;
	default:
		ok = ok && h->beta1 >= 0 && h->beta1 < 1 && h->beta2 >= 0 && h->beta2 < 1 && isfinite(h->eps) && h->eps > 0;
		break;
	}
	if (!ok) {
		snprintf(why, len, "%s hyperparameters out of range (lr %g betas %g %g eps %g wd %g)",
		         kind_name(kind), h->lr, h->beta1, h->beta2, h->eps, h->weight_decay);
		return false;
	}
	return true;
}

bool aoqd_kind_precision_ok(int kind, Aoq__StatePrecision p)
{
	/* kernels/README.md, "SGD and Lion": no q8 or q4 moment for SGD and Lion */
	if (kind == AOQ__OPTIMIZER_KIND__SGD || kind == AOQ__OPTIMIZER_KIND__LION)
		return !aoqk_precision_blocked((enum aoqk_precision)p);
	return true;
}

unsigned aoqd_group_moments(const struct aoqd_group *g)
{
	switch (g->kind) {
	case AOQ__OPTIMIZER_KIND__SGD:
		return g->hp.momentum != 0 ? 1 : 0;
	case AOQ__OPTIMIZER_KIND__LION:
		return 1;
	default:
		return 2;
	}
}

void aoqd_group_set(struct aoqd_group *g, Aoq__OptimizerKind kind, const Aoq__Hyperparams *h)
{
	g->kind = kind;
	g->hp.lr = h->lr;
	g->hp.beta1 = h->beta1;
	g->hp.beta2 = h->beta2;
	g->hp.eps = h->eps;
	g->hp.weight_decay = h->weight_decay;
	g->hp.decoupled = kind == AOQ__OPTIMIZER_KIND__ADAMW;
	g->hp.momentum = kind == AOQ__OPTIMIZER_KIND__SGD ? h->momentum : 0;
	g->hp.dampening = kind == AOQ__OPTIMIZER_KIND__SGD ? h->dampening : 0;
	g->hp.nesterov = kind == AOQ__OPTIMIZER_KIND__SGD && h->nesterov;
	g->hp.grad_scale = 1.0f;
}

bool aoqd_dtype_valid(int d)
{
	return d == AOQ__DTYPE__FP32 || d == AOQ__DTYPE__BF16 || d == AOQ__DTYPE__FP16;
}

uint64_t aoqd_state_len(enum aoqk_precision p, uint64_t n, unsigned moments, bool split,
                        uint64_t off[AOQD_STATE_ARRAYS])
{
	uint64_t master = n * (split ? 2 : aoqk_master_size(p));
	uint64_t mom = aoqk_moment_bytes(p, n);
	uint64_t scale = aoqk_scale_count(p, n) * 4;
	uint64_t o = 0;
	off[0] = o; o = aoq_align_up(o + master, 64);
	off[1] = o; o = aoq_align_up(o + (moments >= 1 ? mom : 0), 64);
	off[2] = o; o = aoq_align_up(o + (moments >= 2 ? mom : 0), 64);
	off[3] = o; o = aoq_align_up(o + scale, 64);
	off[4] = o; o = aoq_align_up(o + scale, 64);
	off[5] = o; o = aoq_align_up(o + (split ? n * 2 : 0), 64);
	return o;
}

static bool master_param_on = true;

void aoqd_state_set_master_param(bool on)
{
	master_param_on = on;
}

bool aoqd_state_master_param(void)
{
	return master_param_on;
}

bool aoqd_tensor_wants_split(const struct aoqd_state *st, const struct aoqd_tensor *x)
{
	return master_param_on && st->precision == AOQ__STATE_PRECISION__STATE_Q8 && x->param_dtype == AOQK_BF16;
}

/* Whether x's master goes to the masters memfd (before the allocation):
 * a bf16 master, or the split master's high half. */
static bool wants_master_param(const struct aoqd_state *st, const struct aoqd_tensor *x)
{
	return master_param_on && x->param_dtype == AOQK_BF16 &&
	       (aoqk_master_size((enum aoqk_precision)st->precision) == 2 ||
	        st->precision == AOQ__STATE_PRECISION__STATE_Q8);
}

uint64_t aoqd_state_tensor_len(const struct aoqd_state *st, const struct aoqd_tensor *x,
                               uint64_t off[AOQD_STATE_ARRAYS])
{
	uint64_t len = aoqd_state_len((enum aoqk_precision)st->precision, x->numel, st->groups[x->group].moments,
	                              aoqd_tensor_wants_split(st, x), off);
	if (wants_master_param(st, x)) {
		/* the master's pages are the memfd's: the rest starts on a page */
		uint64_t d = aoqd_page_round(x->numel * 2) - off[1];
		for (int k = 1; k < AOQD_STATE_ARRAYS; k++)
			off[k] += d;
		len += d;
	}
	return len;
}

static int lock_state(void *p, size_t len, int lock_memory, bool *locked)
{
	*locked = false;
	if (!lock_memory)
		return 0;
	/* Locked as they are first written, not populated here: the loop
	 * thread does not fault in (and the kernel zero) a whole model's
	 * state at registration; the workers do, in parallel, ahead of the
	 * loads and the first step (populate.h), or else the loads and the
	 * first step as they write.  The limit (RLIMIT_MEMLOCK) is checked
	 * here, for the whole length. */
	if (mlock2(p, len, MLOCK_ONFAULT) == 0) {
		*locked = true;
	} else if (lock_memory == 2) {
		return -errno;
	} else {
		static bool warned;
		if (!warned)
			aoqd_warn("session", "cannot lock optimizer state in memory (%s): running unlocked; "
			          "raise LimitMEMLOCK (ulimit -l) or give CAP_IPC_LOCK", strerror(errno));
		warned = true;
	}
	return 0;
}

static void *map_state(size_t len, int lock_memory, bool *locked, int *err)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		*err = -errno;
		return NULL;
	}
	if (len >= (2u << 20))
		madvise(p, len, MADV_HUGEPAGE);
	if ((*err = lock_state(p, len, lock_memory, locked)) < 0) {
		munmap(p, len);
		return NULL;
	}
	return p;
}

/* A tensor whose master is its parameter: `reserve` bytes of address space
 * (room for an undo copy, aoqd_state_add_undo), the masters memfd's pages
 * from moff over the first mlen bytes, private pages for the rest of
 * `whole`. */
static void *map_state_master(int fd, uint64_t moff, size_t mlen, size_t whole, size_t reserve, int lock_memory,
                              bool *locked, int *err)
{
	uint8_t *p = mmap(NULL, reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED) {
		*err = -errno;
		return NULL;
	}
	if (mmap(p, mlen, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, (off_t)moff) == MAP_FAILED ||
	    (whole > mlen &&
	     mmap(p + mlen, whole - mlen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
	             MAP_FAILED)) {
		*err = -errno;
		munmap(p, reserve);
		return NULL;
	}
	if (mlen >= (2u << 20))
		madvise(p, mlen, MADV_HUGEPAGE); /* the masters memfd's: where shmem_enabled allows */
	if (whole - mlen >= (2u << 20))
		madvise(p + mlen, whole - mlen, MADV_HUGEPAGE);
	if ((*err = lock_state(p, whole, lock_memory, locked)) < 0) {
		munmap(p, reserve);
		return NULL;
	}
	return p;
}

/* The smallest share of the masters worth a memfd of its own: more memfds
 * than this gives are no faster to fault in (and each is a descriptor the
 * client maps and pins). */
#define MASTERS_MEMFD_MIN (64u << 20)

/* A masters memfd's mode: aoqd's uid may read it (its read-only
 * descriptions for clients are reopened through /proc), nobody else may
 * open it at all. */
#define MASTERS_MODE 0400

/* The masters' layout for every tensor whose master becomes its
 * parameter: their offsets in x->master_off (AOQ_NO_MASTER for the
 * others), in up to AOQ_MASTER_MEMFDS memfds of about equal size
 * (state.h), each of whole tensors: masters_size, masters_n,
 * masters_end. */
static void masters_layout(struct aoqd_state *st)
{
	uint64_t size = 0;
	uint32_t nmasters = 0;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		struct aoqd_tensor *x = &st->tensors[i];
		x->master_off = AOQ_NO_MASTER;
		if (wants_master_param(st, x)) {
			x->master_off = size;
			size += aoqd_page_round(x->numel * 2);
			nmasters++;
		}
	}
	st->masters_size = 0;
	st->masters_n = 0;
	if (!size)
		return;
	uint64_t want = size / MASTERS_MEMFD_MIN;
	uint32_t n = want < 1 ? 1 : want > AOQ_MASTER_MEMFDS ? AOQ_MASTER_MEMFDS : (uint32_t)want;
	if (n > nmasters)
		n = nmasters;
	/* memfd k ends after the tensor that reaches (k + 1) / n of the bytes */
	uint32_t k = 0;
	for (uint32_t i = 0; i < st->ntensors && k + 1 < n; i++) {
		const struct aoqd_tensor *x = &st->tensors[i];
		if (x->master_off == AOQ_NO_MASTER)
			continue;
		uint64_t end = x->master_off + aoqd_page_round(x->numel * 2);
		if (end < size && end >= size / n * (k + 1))
			st->masters_end[k++] = end;
	}
	st->masters_end[k++] = size;
	st->masters_n = k;
	st->masters_size = size;
}

int aoqd_state_masters_check(struct aoqd_state *st, const int *fds, uint32_t n, char *why, size_t wlen)
{
	masters_layout(st);
	if (n != st->masters_n) {
		snprintf(why, wlen, "%u masters memfds stored, its tensors make %u", n, st->masters_n);
		return -EBADFD;
	}
	for (uint32_t k = 0; k < n; k++) {
		struct stat sb;
		uint64_t want = st->masters_end[k] - (k ? st->masters_end[k - 1] : 0);
		if (fstat(fds[k], &sb) < 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != want) {
			snprintf(why, wlen, "masters memfd %u: not a memfd of %" PRIu64 " bytes", k, want);
			return -EBADFD;
		}
	}
	return 0;
}

/* Whether a stored masters memfd can be the new state's own, trained in
 * place: aoqd's read-write description (a client only ever gets read-only
 * ones: aoqd_state_masters_reopen), sealed against resizing, so that
 * nobody cuts it under the mappings, and not against writes (an older
 * aoqd sealed its masters F_SEAL_FUTURE_WRITE: they are copied), with
 * the mode aoqd gives its own (a client of another uid cannot reopen it
 * for writing through /proc). */
static bool masters_adoptable(int fd)
{
	int fl = fcntl(fd, F_GETFL), seals = fcntl(fd, F_GET_SEALS);
	int need = F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL;
	return fl >= 0 && (fl & O_ACCMODE) == O_RDWR && seals >= 0 && (seals & need) == need &&
	       !(seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) && fchmod(fd, MASTERS_MODE) == 0;
}

/* The masters memfds of st's layout (masters_layout), made, or at a
 * restart the stored ones (st->masters_from) taken where they can be
 * (masters_adoptable; st->masters_adopted).  0 or -errno (none made
 * then). */
static int make_masters(struct aoqd_state *st)
{
	masters_layout(st);
	uint32_t k = st->masters_n;
	st->masters_n = 0;
	st->masters_adopted = 0;
	if (!k)
		return 0;
	uint64_t size = st->masters_size;
	st->masters_size = 0;
	uint32_t adopted = 0;
	for (uint32_t j = 0; j < k; j++) {
		uint64_t b = j ? st->masters_end[j - 1] : 0;
		int fd = -1;
		if (st->masters_from_n == k && masters_adoptable(st->masters_from[j])) {
			fd = fcntl(st->masters_from[j], F_DUPFD_CLOEXEC, 3);
			adopted |= fd >= 0 ? 1u << j : 0;
		} else {
			fd = memfd_create("aoq-masters", MFD_CLOEXEC | MFD_ALLOW_SEALING);
			/* read and written by aoqd alone: no reopen for writing
			 * through /proc by another uid */
			if (fd >= 0 && (ftruncate(fd, (off_t)(st->masters_end[j] - b)) < 0 || fchmod(fd, MASTERS_MODE) < 0)) {
				int e = errno;
				close(fd);
				errno = e;
				fd = -1;
			}
		}
		if (fd < 0) {
			int e = -errno;
			while (j-- > 0)
				close(st->masters_fd[j]);
			return e;
		}
		st->masters_fd[j] = fd;
	}
	for (uint32_t j = 0; j < k; j++)
		st->masters_wd[j] = aoqd_held_watch(st->masters_fd[j]);
	st->masters_n = k;
	st->masters_size = size;
	st->masters_adopted = adopted;
	return 0;
}

int aoqd_state_masters_reopen(const struct aoqd_state *st, uint32_t k)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/self/fd/%d", st->masters_fd[k]);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	return fd >= 0 ? fd : -errno;
}

void aoqd_state_masters_name(const char *state_name, uint32_t k, char *buf, size_t len)
{
	const char *n = strncmp(state_name, "aoq-state-", 10) == 0 ? state_name + 10 : state_name;
	snprintf(buf, len, "aoq-masters-%s-%u", n, k);
}

/* ---- the state in a memfd (docs/design.md, "The fd store") ---- */

static bool memfd_on;
static uint64_t store_seq;

void aoqd_state_set_memfd(bool on)
{
	memfd_on = on;
}

void aoqd_state_store_names_above(uint64_t n)
{
	if (n > store_seq)
		store_seq = n;
}

/* A message to systemd's fd store (FDSTORE=1 with fd, or FDSTOREREMOVE=1):
 * > 0 sent. */
static int store_notify(const char *msg, int fd)
{
#if AOQ_HAVE_SYSTEMD
	return fd >= 0 ? sd_pid_notify_with_fds(0, 0, msg, &fd, 1) : sd_notify(0, msg);
#else
	(void)msg;
	(void)fd;
	return 0;
#endif
}

void aoqd_state_store_masters(struct aoqd_state *st)
{
	st->masters_stored = st->store_name[0] && st->masters_n;
	for (uint32_t k = 0; st->store_name[0] && k < st->masters_n; k++) {
		char nm[64], msg[128];
		aoqd_state_masters_name(st->store_name, k, nm, sizeof(nm));
		snprintf(msg, sizeof(msg), "FDSTORE=1\nFDPOLL=0\nFDNAME=%s", nm);
		if (store_notify(msg, st->masters_fd[k]) <= 0) {
			st->masters_stored = false;
			static bool warned;
			if (!warned)
				aoqd_warn("session", "masters memfd not kept in the fd store: a kill of aoqd loses its steps "
				          "(a stop copies them into the state's memfd; logged once)");
			warned = true;
		}
	}
}

/* A tensor's slot: its arrays, then its undo room, each on pages of its
 * own (len: aoqd_state_tensor_len). */
static uint64_t slot_len(uint64_t len)
{
	return 2 * aoqd_page_round(len);
}

uint32_t aoqd_journal_cap(const struct aoqd_state *st)
{
	/* An update's chunk takes one entry; a record's chunks are at least
	 * 16384 elements but its last, and a step has a record per range a
	 * client pushes: room for 8 pieces per tensor and twice the chunks
	 * of the whole state (a client that pushes more, smaller pieces
	 * overflows it: its own state is then not taken back after a kill). */
	uint64_t n = 0;
	for (uint32_t i = 0; i < st->ntensors; i++)
		n += st->tensors[i].numel;
	uint64_t cap = 8ull * st->ntensors + n / 8192 + 1024;
	return cap > (1u << 26) ? (1u << 26) : (uint32_t)cap;
}

uint64_t aoqd_journal_len(const struct aoqd_state *st)
{
	return sizeof(struct aoqd_journal) + 16ull * st->ntensors + sizeof(struct aoqd_journal_hp) * st->ngroups +
	       sizeof(struct aoqd_journal_entry) * (uint64_t)aoqd_journal_cap(st);
}

uint64_t aoqd_state_memfd_data_off(const struct aoqd_state *st)
{
	return AOQD_STATE_MEMFD_JOURNAL + aoqd_page_round(aoqd_journal_len(st));
}

uint64_t aoqd_state_memfd_layout(const struct aoqd_state *st, uint64_t *off)
{
	uint64_t pos = 0;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		uint64_t o[AOQD_STATE_ARRAYS];
		uint64_t len = aoqd_state_tensor_len(st, &st->tensors[i], o);
		if (off)
			off[i] = pos;
		if (len > (UINT64_MAX >> 2) || __builtin_add_overflow(pos, slot_len(len), &pos))
			return UINT64_MAX;
	}
	return pos;
}

/* Reads len bytes of `from` at off into p (a hostile source may be
 * shorter: -EIO).  0 or -errno. */
static int read_into(int from, off_t off, uint8_t *p, size_t len)
{
	for (size_t done = 0; done < len;) {
		ssize_t got = pread(from, p + done, len - done, off + (off_t)done);
		if (got <= 0)
			return got < 0 ? -errno : -EIO;
		done += (size_t)got;
	}
	return 0;
}

/* Threads of the copies a restart makes (the undo ranges, the stored
 * masters). */
#define UNSAVE_THREADS 8u

struct masters_copy {
	int from, to;
	uint64_t len;
	int err;
};

/* One stored masters memfd into its new one, through a mapping that asks
 * for huge pages before anything writes it (as a write(2) would fill the
 * memfd with 4 KiB pages under shmem_enabled=advise). */
static void *masters_copy_run(void *arg)
{
	struct masters_copy *c = arg;
	if (!c->len)
		return NULL;
	uint8_t *p = mmap(NULL, c->len, PROT_READ | PROT_WRITE, MAP_SHARED, c->to, 0);
	if (p == MAP_FAILED) {
		c->err = -errno;
		return NULL;
	}
	if (c->len >= (2u << 20))
		madvise(p, c->len, MADV_HUGEPAGE);
	c->err = read_into(c->from, 0, p, c->len);
	munmap(p, c->len);
	return NULL;
}

/* The masters the store kept (a restart's: st->masters_from, of st's
 * layout: aoqd_state_masters_check) into the new masters memfds, a thread
 * per memfd (8 at most at a time): new pages of a memfd per thread fault
 * in about three times as fast as of one (RESULTS.md, "Faulting shared
 * memory"); one thread took 1.6-1.8 s for 2.1 GB of masters at a restart
 * on the H200 host.  0 or -errno. */
static int copy_stored_masters(struct aoqd_state *st)
{
	struct masters_copy c[AOQ_MASTER_MEMFDS];
	uint32_t n = st->masters_n;
	if (st->masters_adopted == (n >= 32 ? UINT32_MAX : (1u << n) - 1))
		return 0;
	for (uint32_t k = 0; k < n; k++) {
		uint64_t len = st->masters_end[k] - (k ? st->masters_end[k - 1] : 0);
		/* an adopted memfd is the stored one: nothing to copy */
		c[k] = (struct masters_copy){ st->masters_from[k], st->masters_fd[k],
		                              st->masters_adopted & (1u << k) ? 0 : len, 0 };
	}
	for (uint32_t b = 0; b < n; b += UNSAVE_THREADS)
		aoqd_threads_run(masters_copy_run, c + b, sizeof(c[0]), n - b < UNSAVE_THREADS ? n - b : UNSAVE_THREADS);
	int err = 0;
	for (uint32_t k = 0; k < n && !err; k++)
		err = c[k].err;
	return err;
}

/* Tensor x's slot from st's memfd (at x->mem_off): `reserve` bytes, the
 * first `whole` used (arrays, and undo copy when kept); a master that is
 * the parameter gets the masters memfd's pages over its first mlen bytes,
 * after `adopt` copied what the slot held there into them (the stop put
 * it there) and gave the slot's pages back. */
static void *map_state_memfd(struct aoqd_state *st, struct aoqd_tensor *x, size_t mlen, size_t whole, size_t reserve,
                             bool adopt, int lock_memory, bool *locked, int *err)
{
	off_t at = (off_t)(st->mem_data_off + x->mem_off);
	uint8_t *p = mmap(NULL, reserve, PROT_READ | PROT_WRITE, MAP_SHARED, st->mem_fd, at);
	if (p == MAP_FAILED) {
		*err = -errno;
		return NULL;
	}
	if (x->master_off != AOQ_NO_MASTER) {
		size_t mb = x->numel * 2;
		uint64_t moff;
		int mfd = aoqd_state_masters_fd(st, x->master_off, &moff, NULL);
		/* The masters memfd's pages over the slot's head, asked for
		 * huge pages before anything writes them: the copies below
		 * write through this mapping, as a write(2) would fill the
		 * memfd with 4 KiB pages under shmem_enabled=advise. */
		if (mmap(p, mlen, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, mfd, (off_t)moff) == MAP_FAILED) {
			*err = -errno;
			munmap(p, reserve);
			return NULL;
		}
		if (mlen >= (2u << 20))
			madvise(p, mlen, MADV_HUGEPAGE);
		/* a killed aoqd's: the masters the store kept, as they were
		 * (the journal's replay undoes the open step's), are in the
		 * new memfds already (copy_stored_masters) */
		if (adopt && st->masters_from_n) {
			st->masters_restored = true;
#ifdef MADV_POPULATE_WRITE
			/* this mapping's page tables, which the copy's own
			 * mapping did not fill: else the journal's replay and
			 * the redone step trap on them */
			madvise(p, mlen, MADV_POPULATE_WRITE);
#endif
		}
		/* after a stop: only what the slot holds, a hole stays a hole
		 * (zeros), so that a hostile memfd makes aoqd allocate no more
		 * than it holds */
		for (off_t pos = at, end = at + (off_t)mb; adopt && !st->masters_from_n && pos < end;) {
			off_t d = lseek(st->mem_fd, pos, SEEK_DATA);
			if (d < 0 || d >= end)
				break;
			off_t h = lseek(st->mem_fd, d, SEEK_HOLE);
			if (h < 0 || h > end)
				h = end;
			if ((*err = read_into(st->mem_fd, d, p + (d - at), (size_t)(h - d))) < 0) {
				munmap(p, reserve);
				return NULL;
			}
			pos = h;
		}
		if (adopt)
			fallocate(st->mem_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, at, (off_t)mlen);
	}
	if (whole >= (2u << 20))
		madvise(p, whole, MADV_HUGEPAGE); /* taken where shmem_enabled allows */
	if ((*err = lock_state(p, whole, lock_memory, locked)) < 0) {
		munmap(p, reserve);
		return NULL;
	}
	return p;
}

/* The state's memfd: `fd` adopted, or a new one (-1) of the layout's
 * size, stored in the fd store.  0 or -errno. */
static int make_memfd(struct aoqd_state *st, int fd, const char *name)
{
	uint64_t data = aoqd_state_memfd_layout(st, NULL), doff = aoqd_state_memfd_data_off(st);
	if (data == UINT64_MAX || data > (uint64_t)INT64_MAX - doff)
		return -EFBIG;
	bool fresh = fd < 0;
	if (fresh) {
		fd = memfd_create("aoq-state", MFD_CLOEXEC | MFD_ALLOW_SEALING);
		if (fd < 0)
			return -errno;
		if (ftruncate(fd, (off_t)(doff + data)) < 0) {
			int e = -errno;
			close(fd);
			return e;
		}
	}
	size_t jlen = aoqd_page_round(aoqd_journal_len(st));
	uint8_t *j = mmap(NULL, jlen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, AOQD_STATE_MEMFD_JOURNAL);
	if (j == MAP_FAILED) {
		int e = -errno;
		if (fresh)
			close(fd);
		return e;
	}
	st->jh = (struct aoqd_journal *)(void *)j;
	st->jsteps = (uint64_t *)(void *)(j + sizeof(struct aoqd_journal));
	st->jhp = (struct aoqd_journal_hp *)(void *)(st->jsteps + 2ull * st->ntensors);
	st->jlog = (struct aoqd_journal_entry *)(void *)(st->jhp + st->ngroups);
	st->jmap_len = jlen;
	if (fresh) {
		/* nothing to go back to until a step ends */
		st->jh->cap = aoqd_journal_cap(st);
		atomic_store_explicit(&st->jh->boundary, AOQD_JOURNAL_DIRTY, memory_order_release);
	}
	st->memfd = true;
	st->mem_fd = fd;
	st->mem_data_off = doff;
	st->mem_data_len = data;
	st->store_kept = false;
	if (name) {
		snprintf(st->store_name, sizeof(st->store_name), "%s", name);
		return 0;
	}
	char nm[sizeof(st->store_name)], msg[128];
	snprintf(nm, sizeof(nm), "aoq-state-%" PRIu64, ++store_seq);
	snprintf(msg, sizeof(msg), "FDSTORE=1\nFDPOLL=0\nFDNAME=%s", nm);
	int r = store_notify(msg, fd);
	if (r > 0) {
		snprintf(st->store_name, sizeof(st->store_name), "%s", nm);
		/* the masters too (made before the state's memfd): a killed
		 * aoqd's state needs them (fdstore.c, the journal) */
		aoqd_state_store_masters(st);
	} else {
		st->store_name[0] = '\0';
		static bool warned;
		if (!warned)
			aoqd_warn("session", "state memfd not kept in the fd store (%s): a restart loses its steps",
			          r < 0 ? strerror(-r) : "no NOTIFY_SOCKET");
		warned = true;
	}
	return 0;
}

static int alloc(struct aoqd_state *st, int fd, const char *name, int lock_memory, _Atomic uint64_t *locked_total,
                 uint64_t *failed_len)
{
	enum aoqk_precision prec = (enum aoqk_precision)st->precision;
	bool adopt = fd >= 0;
	int err = make_masters(st);
	if (err == 0 && adopt && (fd = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0)
		err = -errno;
	if (err == 0 && (adopt || memfd_on) && (err = make_memfd(st, fd, name)) < 0 && adopt)
		close(fd);
	if (err == 0 && adopt && st->masters_from_n)
		err = copy_stored_masters(st);
	if (err < 0) {
		*failed_len = 0;
		return err;
	}
	uint64_t pos = 0;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		struct aoqd_tensor *x = &st->tensors[i];
		uint64_t off[AOQD_STATE_ARRAYS];
		unsigned moments = st->groups[x->group].moments;
		uint64_t len = aoqd_state_tensor_len(st, x, off);
		/* the undo copy after it, on a page: a snapshot can move it out
		 * whole (snapshot.c, "undo swap") */
		uint64_t uoff = st->undo ? aoqd_page_round(len) : 0;
		uint64_t whole = uoff + len;
		bool locked;
		uint8_t *p;
		if (st->memfd) {
			x->in_memfd = true;
			x->mem_off = pos;
			pos += slot_len(len);
			x->map_len = aoqd_page_round(len) + len;
			p = map_state_memfd(st, x, off[1], whole, x->map_len, adopt, lock_memory, &locked, &err);
		} else if (x->master_off != AOQ_NO_MASTER) {
			x->map_len = aoqd_page_round(len) + len;
			uint64_t moff;
			int mfd = aoqd_state_masters_fd(st, x->master_off, &moff, NULL);
			p = map_state_master(mfd, moff, off[1], whole, x->map_len, lock_memory, &locked, &err);
		} else {
			p = map_state(whole, lock_memory, &locked, &err);
		}
		if (!p) {
			x->map_len = 0;
			*failed_len = whole;
			return err;
		}
		x->state_mem = p;
		x->state_len = whole;
		x->undo_off = uoff;
		x->locked = locked;
		len = whole;
		if (locked) {
			st->locked_bytes += len;
			atomic_fetch_add(locked_total, len);
		}
		x->st.precision = prec;
		x->st.n = x->numel;
		x->st.master = p + off[0];
		x->st.m = moments >= 1 ? p + off[1] : NULL; /* SGD without momentum: none */
		x->st.v = moments >= 2 ? p + off[2] : NULL; /* SGD and Lion: none */
		x->st.m_scale = aoqk_precision_blocked(prec) ? (float *)(p + off[3]) : NULL;
		x->st.v_scale = aoqk_precision_blocked(prec) ? (float *)(p + off[4]) : NULL;
		x->st.master_lo = aoqd_tensor_wants_split(st, x) ? p + off[5] : NULL;
	}
	/* The daemon's mappings are made: nobody changes the masters' size.
	 * Clients get read-only descriptions (aoqd_state_masters_reopen); a
	 * state outside the fd store also seals them against writable
	 * mappings, for good, while one in the store leaves that to the mode
	 * and the descriptions, so that the next aoqd can take them as they
	 * are and train them in place (the adopted ones are sealed so). */
	int seals = F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL | (st->memfd ? 0 : F_SEAL_FUTURE_WRITE);
	for (uint32_t k = 0; k < st->masters_n; k++)
		if (!(st->masters_adopted & (1u << k)) && fcntl(st->masters_fd[k], F_ADD_SEALS, seals) < 0) {
			*failed_len = 0;
			return -errno;
		}
	return 0;
}

int aoqd_state_alloc(struct aoqd_state *st, int lock_memory, _Atomic uint64_t *locked_total, uint64_t *failed_len)
{
	return alloc(st, -1, NULL, lock_memory, locked_total, failed_len);
}

int aoqd_state_adopt(struct aoqd_state *st, int fd, const char *name, int lock_memory, _Atomic uint64_t *locked_total,
                     uint64_t *failed_len)
{
	return alloc(st, fd, name, lock_memory, locked_total, failed_len);
}

int aoqd_state_charge(struct aoqd_state *st, uint64_t n)
{
	if (!st->account)
		return 0;
	int r = aoqd_account_charge(st->account, n, st->quota);
	if (r == 0)
		st->charged += n;
	return r;
}

uint64_t aoqd_state_quota(const struct aoqd_state *st)
{
	return st->account ? aoqd_account_limit(st->account, st->quota) : st->quota;
}

int aoqd_tensor_mark_done(struct aoqd_tensor *t, uint64_t b, uint64_t n)
{
	uint64_t e = b + n; /* validated: within the tensor */
	uint32_t i = 0;
	/* Sorted and merged: every range before i ends before b. */
	while (i < t->ndone && t->done[i].e < b)
		i++;
	if (i < t->ndone && t->done[i].b < e && b < t->done[i].e)
		return -EEXIST;
	if (i < t->ndone && t->done[i].e == b) {
		t->done[i].e = e;
		if (i + 1 < t->ndone && t->done[i + 1].b == e) {
			t->done[i].e = t->done[i + 1].e;
			memmove(&t->done[i + 1], &t->done[i + 2], (t->ndone - i - 2) * sizeof(t->done[0]));
			t->ndone--;
		}
	} else if (i < t->ndone && t->done[i].b == e) {
		t->done[i].b = b;
	} else {
		struct aoqd_range *d = aoq_grow(t->done, &t->cap_done, t->ndone + 1, sizeof(*d));
		if (!d)
			return -ENOMEM;
		t->done = d;
		memmove(&t->done[i + 1], &t->done[i], (t->ndone - i) * sizeof(t->done[0]));
		t->done[i] = (struct aoqd_range){ b, e };
		t->ndone++;
	}
	return t->ndone == 1 && t->done[0].b == 0 && t->done[0].e == t->numel;
}

void aoqd_state_free(struct aoqd_state *st, _Atomic uint64_t *locked_total)
{
	aoqd_state_free_later(st, locked_total, NULL);
}

void aoqd_state_free_later(struct aoqd_state *st, _Atomic uint64_t *locked_total, struct aoqd_release *later)
{
	for (uint32_t i = 0; i < st->ntensors; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		if (t->state_mem)
			aoqd_release(later, t->state_mem, t->map_len ? t->map_len : t->state_len, -1);
		t->state_mem = NULL;
		if (t->acc)
			aoqd_release(later, t->acc, t->numel * sizeof(float), -1);
		free(t->name);
		free(t->done);
	}
	if (st->account && st->charged)
		aoqd_account_uncharge(st->account, st->charged);
	st->charged = 0;
	if (st->locked_bytes)
		atomic_fetch_sub(locked_total, st->locked_bytes);
	st->locked_bytes = 0;
	free(st->tensors);
	free(st->groups);
	st->tensors = NULL;
	st->groups = NULL;
	st->ntensors = st->ngroups = 0;
	uint32_t stored_masters = st->masters_n;
	/* The client may keep the masters (its parameters) after its session:
	 * what they hold stays charged to the uid until no description of
	 * them is left (held.h). */
	for (uint32_t k = 0; k < st->masters_n; k++) {
		struct stat sb;
		if (fstat(st->masters_fd[k], &sb) == 0)
			aoqd_held_release(st->masters_wd[k], st->account, (uint64_t)sb.st_blocks * 512);
		aoqd_release(later, NULL, 0, st->masters_fd[k]);
	}
	st->masters_n = 0;
	st->masters_size = 0;
	if (st->memfd) {
		/* Gone for good unless a stop wrote it for the next aoqd: it
		 * leaves the fd store, so the store never holds memory no
		 * session accounts for. */
		if (st->store_name[0] && !st->store_kept) {
			char msg[128];
			snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=%s", st->store_name);
			store_notify(msg, -1);
			for (uint32_t k = 0; k < stored_masters; k++) {
				char nm[64];
				aoqd_state_masters_name(st->store_name, k, nm, sizeof(nm));
				snprintf(msg, sizeof(msg), "FDSTOREREMOVE=1\nFDNAME=%s", nm);
				store_notify(msg, -1);
			}
		}
		aoqd_release(later, NULL, 0, st->mem_fd);
	}
	if (st->jh)
		aoqd_release(later, st->jh, st->jmap_len, -1);
	st->jh = NULL;
	st->jsteps = NULL;
	st->jhp = NULL;
	st->jlog = NULL;
	st->memfd = false;
	st->store_name[0] = '\0';
}

int aoqd_state_acc(struct aoqd_state *st, struct aoqd_tensor *t)
{
	if (t->acc)
		return 0;
	if (aoqd_state_charge(st, aoqd_page_round(t->numel * sizeof(float))) < 0)
		return -EDQUOT;
	void *p = mmap(NULL, t->numel * sizeof(float), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED) {
		uint64_t n = aoqd_page_round(t->numel * sizeof(float));
		if (st->account)
			aoqd_account_uncharge(st->account, n);
		st->charged -= n;
		return -ENOMEM;
	}
	t->acc = p;
	st->state_bytes += t->numel * sizeof(float);
	return 0;
}

void aoqd_state_io(struct aoqd_tensor *t, int what, bool load, float *buf, uint64_t e, size_t n)
{
	if (what == AOQ__STATE_KIND__MASTER || what == AOQ__STATE_KIND__PARAM) {
		if (t->st.master_lo) {
			uint16_t *hi = (uint16_t *)t->st.master + e, *lo = (uint16_t *)t->st.master_lo + e;
			if (load)
				aoqd_split(hi, lo, buf, n);
			else
				aoqd_split_join(buf, hi, lo, n);
		} else if (aoqk_precision_bf16_master(t->st.precision)) {
			if (load)
				aoqd_from_f32((uint16_t *)t->st.master + e, AOQK_BF16, buf, n);
			else
				aoqd_to_f32(buf, (uint16_t *)t->st.master + e, AOQK_BF16, n);
		} else if (load) {
			memcpy((float *)t->st.master + e, buf, n * sizeof(float));
		} else {
			memcpy(buf, (float *)t->st.master + e, n * sizeof(float));
		}
		return;
	}
	bool second = what == AOQ__STATE_KIND__EXP_AVG_SQ;
	void *mom = second ? t->st.v : t->st.m;
	if (aoqk_precision_q8(t->st.precision)) {
		float *scale = second ? t->st.v_scale : t->st.m_scale;
		if (load)
			aoqd_q8_encode(mom, scale, buf, second, e, n);
		else
			aoqd_q8_decode(buf, mom, scale, second, e, n);
	} else if (aoqk_precision_q4(t->st.precision)) {
		float *scale = second ? t->st.v_scale : t->st.m_scale;
		if (load)
			aoqd_q4_encode(mom, scale, buf, second, e, n, t->numel);
		else
			aoqd_q4_decode(buf, mom, scale, second, e, n);
	} else if (aoqk_precision_bf16_moments(t->st.precision)) {
		if (load)
			aoqd_from_f32((uint16_t *)mom + e, AOQK_BF16, buf, n);
		else
			aoqd_to_f32(buf, (uint16_t *)mom + e, AOQK_BF16, n);
	} else if (load) {
		memcpy((float *)mom + e, buf, n * sizeof(float));
	} else {
		memcpy(buf, (float *)mom + e, n * sizeof(float));
	}
}

/* A copy the update path will not read back (the lease's undo copy, a
 * snapshot's capture): on x86-64 with non-temporal stores, so it neither
 * reads its target's lines first (read for ownership: as many bytes again
 * as it writes) nor pushes the state the kernel is about to update out of
 * the caches.  The caller fences (_mm_sfence) before anyone reads it. */
static void copy_aside(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__x86_64__)
	if (n >= 256) {
		size_t head = (size_t)(-(uintptr_t)dst & 15);
		memcpy(dst, src, head);
		dst += head;
		src += head;
		n -= head;
		for (; n >= 64; dst += 64, src += 64, n -= 64) {
			__m128i a = _mm_loadu_si128((const __m128i *)(const void *)src);
			__m128i b = _mm_loadu_si128((const __m128i *)(const void *)(src + 16));
			__m128i c = _mm_loadu_si128((const __m128i *)(const void *)(src + 32));
			__m128i d = _mm_loadu_si128((const __m128i *)(const void *)(src + 48));
			_mm_stream_si128((__m128i *)(void *)dst, a);
			_mm_stream_si128((__m128i *)(void *)(dst + 16), b);
			_mm_stream_si128((__m128i *)(void *)(dst + 32), c);
			_mm_stream_si128((__m128i *)(void *)(dst + 48), d);
		}
	}
#endif
	memcpy(dst, src, n);
}

/* Copies elements [b, b + n) of every array of t between the state and
 * other, a region laid out as the state mapping (out: state -> other). */
static void range_copy(const struct aoqd_tensor *t, uint64_t b, uint64_t n, uint8_t *other, bool out)
{
	const uint8_t *base = t->state_mem;
	enum aoqk_precision p = t->st.precision;
	/* q8, q4: the ranges start on a block and end on one or at the end;
	 * q4's codes are bytes [b / 2, the end of the group of b + n) */
	uint64_t blk = aoqk_block(p) ? aoqk_block(p) : 1;
	bool q4 = aoqk_precision_q4(p);
	uint64_t mb = q4 ? b / 2 : b, mn = q4 ? aoqk_moment_bytes(p, b + n) - b / 2 : n;
	struct {
		void *arr;
		size_t el;
		uint64_t b, n;
	} part[AOQD_STATE_ARRAYS] = {
		{ t->st.master, aoqd_tensor_master_size(t), b, n },
		{ t->st.master_lo, 2, b, n },
		{ t->st.m, q4 ? 1 : aoqk_moment_size(p), mb, mn },
		{ t->st.v, q4 ? 1 : aoqk_moment_size(p), mb, mn },
		{ t->st.m_scale, 4, b / blk, (b + n + blk - 1) / blk - b / blk },
		{ t->st.v_scale, 4, b / blk, (b + n + blk - 1) / blk - b / blk },
	};
	for (int i = 0; i < AOQD_STATE_ARRAYS; i++) {
		if (!part[i].arr)
			continue;
		uint8_t *live = (uint8_t *)part[i].arr + part[i].b * part[i].el;
		uint8_t *copy = other + (live - base);
		if (out)
			copy_aside(copy, live, part[i].n * part[i].el);
		else
			memcpy(live, copy, part[i].n * part[i].el);
	}
#if defined(__x86_64__)
	if (out)
		_mm_sfence(); /* the non-temporal stores of copy_aside */
#endif
}

static void undo_copy(struct aoqd_tensor *t, uint64_t b, uint64_t n, bool save)
{
	range_copy(t, b, n, (uint8_t *)t->state_mem + t->undo_off, save);
}

void aoqd_state_copy_out(const struct aoqd_tensor *t, uint64_t b, uint64_t n, void *dst)
{
	range_copy(t, b, n, dst, true);
}

void aoqd_state_save(struct aoqd_tensor *t, uint64_t b, uint64_t n)
{
	if (t->undo_off)
		undo_copy(t, b, n, true);
}

void aoqd_state_save_logged(struct aoqd_state *st, struct aoqd_tensor *t, uint64_t b, uint64_t n, uint64_t step)
{
	if (!t->undo_off)
		return;
	undo_copy(t, b, n, true); /* its non-temporal stores fenced */
	struct aoqd_journal *jh = st->jh;
	if (!jh)
		return;
	uint64_t i = atomic_fetch_add_explicit(&jh->log_n, 1, memory_order_relaxed);
	if (i >= jh->cap) {
		atomic_store_explicit(&jh->overflow, 1, memory_order_release);
		return;
	}
	struct aoqd_journal_entry *e = &st->jlog[i];
	e->tensor = (uint32_t)(t - st->tensors);
	e->offset = b;
	e->count = n;
	/* last: a kill before it leaves an entry of an older step, ignored
	 * (the range was saved but not yet changed) */
	atomic_store_explicit(&e->step, step, memory_order_release);
}

struct unsaver {
	struct aoqd_state *st;
	const struct aoqd_undo *u;
	size_t n;
};

static void *unsave_run(void *arg)
{
	const struct unsaver *w = arg;
	for (size_t i = 0; i < w->n; i++) {
		struct aoqd_tensor *t = &w->st->tensors[w->u[i].tensor];
		if (t->undo_off)
			undo_copy(t, w->u[i].off, w->u[i].count, false);
	}
	return NULL;
}

/* One thread copied back a whole step of 1 G fp32 parameters (12.9 GB) in
 * 1.2 s on the H200 host, most of a restart's pause after a kill
 * (RESULTS.md, "Restart under systemd").  A thread's start is tens of
 * microseconds: worth it from a few ranges on (the tests' small states
 * take this path too). */
void aoqd_state_unsave_all(struct aoqd_state *st, const struct aoqd_undo *u, size_t n, unsigned threads)
{
	uint64_t total = 0;
	for (size_t i = 0; i < n; i++)
		total += u[i].count;
	if (threads > UNSAVE_THREADS)
		threads = UNSAVE_THREADS;
	if (threads > n)
		threads = (unsigned)n;
	if (threads < 1)
		threads = 1;
	struct unsaver w[UNSAVE_THREADS];
	uint64_t per = (total + threads - 1) / threads, acc = 0;
	size_t at = 0;
	for (unsigned k = 0; k < threads; k++) {
		size_t b = at;
		/* the ranges that begin in the k-th share of the elements */
		while (at < n && (k + 1 == threads || acc < (uint64_t)(k + 1) * per))
			acc += u[at++].count;
		w[k] = (struct unsaver){ st, u + b, at - b };
	}
	aoqd_threads_run(unsave_run, w, sizeof(w[0]), threads);
}

void aoqd_state_journal_boundary(struct aoqd_state *st)
{
	struct aoqd_journal *jh = st->jh;
	if (!jh)
		return;
	uint64_t *js = st->jsteps + (st->last_step & 1) * (uint64_t)st->ntensors;
	for (uint32_t i = 0; i < st->ntensors; i++)
		js[i] = st->tensors[i].steps;
	/* (a state without undo copy is made dirty by its first update:
	 * dataplane.c) */
	uint64_t dirty = st->dirty ? AOQD_JOURNAL_DIRTY : 0;
	atomic_store_explicit(&jh->boundary, st->last_step | dirty, memory_order_release);
	/* the log of the step that ended: its entries are of last_step or
	 * older from now on, and go */
	uint64_t n = atomic_load_explicit(&jh->log_n, memory_order_relaxed);
	for (uint64_t i = 0; i < n && i < jh->cap; i++)
		atomic_store_explicit(&st->jlog[i].step, 0, memory_order_relaxed);
	atomic_store_explicit(&jh->log_n, 0, memory_order_release);
	atomic_store_explicit(&jh->overflow, 0, memory_order_release);
}

void aoqd_state_journal_dirty(struct aoqd_state *st)
{
	if (st->jh)
		atomic_store_explicit(&st->jh->boundary, st->last_step | AOQD_JOURNAL_DIRTY, memory_order_release);
}

void aoqd_state_journal_hp(struct aoqd_state *st, uint32_t g)
{
	if (!st->jh || g >= st->ngroups)
		return;
	struct aoqd_journal_hp *h = &st->jhp[g];
	const struct aoqk_hparams *hp = &st->groups[g].hp;
	uint32_t next = (atomic_load_explicit(&h->sel, memory_order_relaxed) & 1) ^ 1;
	double *v = h->v[next];
	v[0] = hp->lr;
	v[1] = hp->beta1;
	v[2] = hp->beta2;
	v[3] = hp->eps;
	v[4] = hp->weight_decay;
	v[5] = hp->momentum;
	v[6] = hp->dampening;
	v[7] = hp->nesterov ? 1 : 0;
	atomic_store_explicit(&h->sel, next, memory_order_release);
}

/* Moves tensor t's mapping to p, keeping every array's offset. */
static void rebase(struct aoqd_tensor *t, uint8_t *p)
{
	uint8_t *o = t->state_mem;
	void **arr[4] = { &t->st.master, &t->st.m, &t->st.v, &t->st.master_lo };
	for (int k = 0; k < 4; k++)
		if (*arr[k])
			*arr[k] = p + ((uint8_t *)*arr[k] - o);
	if (t->st.m_scale)
		t->st.m_scale = (float *)(void *)(p + ((uint8_t *)t->st.m_scale - o));
	if (t->st.v_scale)
		t->st.v_scale = (float *)(void *)(p + ((uint8_t *)t->st.v_scale - o));
	t->state_mem = p;
}

/* A tensor whose master is its parameter: maps (add) the undo copy's len
 * bytes at uoff into its reserved room, locked when the state is, or gives
 * them back to the reservation.  0 or -errno. */
static int undo_room(const struct aoqd_state *st, struct aoqd_tensor *t, size_t uoff, size_t len, bool add)
{
	uint8_t *at = (uint8_t *)t->state_mem + uoff;
	if (t->in_memfd) {
		/* the room is the memfd slot's, mapped already: its pages come
		 * as the saves write them, and go back to the memfd when not
		 * wanted */
		if (!add) {
			fallocate(st->mem_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
			          (off_t)(st->mem_data_off + t->mem_off + uoff), (off_t)aoqd_page_round(len));
			return 0;
		}
		if (len >= (2u << 20))
			madvise(at, len, MADV_HUGEPAGE);
		if (t->locked && mlock2(at, len, MLOCK_ONFAULT) < 0)
			return -errno;
		return 0;
	}
	if (!add) {
		mmap(at, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
		return 0;
	}
	if (mmap(at, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
		return -errno;
	if (len >= (2u << 20))
		madvise(at, len, MADV_HUGEPAGE);
	if (t->locked && mlock(at, len) < 0) {
		int e = -errno;
		undo_room(st, t, uoff, len, false);
		return e;
	}
	return 0;
}

int aoqd_state_add_undo(struct aoqd_state *st, _Atomic uint64_t *locked_total)
{
	if (st->undo)
		return 0;
	uint64_t extra = 0;
	for (uint32_t i = 0; i < st->ntensors; i++)
		extra += aoqd_page_round(st->tensors[i].state_len); /* the undo copy, on its own pages */
	if (aoqd_state_charge(st, extra) < 0)
		return -EDQUOT;
	uint32_t i;
	int err = 0;
	for (i = 0; i < st->ntensors; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		size_t len = t->state_len, uoff = aoqd_page_round(len);
		if (t->map_len) {
			/* the master is the memfd's: the copy goes into the room
			 * reserved after the mapping */
			if ((err = undo_room(st, t, uoff, len, true)) < 0)
				break;
		} else {
			/* a locked mapping's new pages are locked (and counted
			 * against RLIMIT_MEMLOCK: EAGAIN past it) */
			void *p = mremap(t->state_mem, len, uoff + len, MREMAP_MAYMOVE);
			if (p == MAP_FAILED) {
				err = -errno;
				break;
			}
			rebase(t, p);
		}
		t->state_len = uoff + len;
		t->undo_off = uoff;
		st->state_bytes += len;
		if (t->locked) {
			st->locked_bytes += uoff;
			atomic_fetch_add(locked_total, uoff);
		}
	}
	if (!err) {
		st->undo = true;
		return 0;
	}
	while (i-- > 0) {
		struct aoqd_tensor *t = &st->tensors[i];
		size_t uoff = t->undo_off, len = t->state_len - uoff;
		if (t->map_len) {
			undo_room(st, t, uoff, len, false);
		} else {
			void *p = mremap(t->state_mem, t->state_len, len, 0); /* shrinking in place cannot fail */
			if (p != MAP_FAILED)
				rebase(t, p);
		}
		t->state_len = len;
		t->undo_off = 0;
		st->state_bytes -= len;
		if (t->locked) {
			st->locked_bytes -= uoff;
			atomic_fetch_sub(locked_total, uoff);
		}
	}
	if (st->account)
		aoqd_account_uncharge(st->account, extra);
	st->charged -= extra;
	return err;
}

bool aoqd_state_open_step(const struct aoqd_state *st)
{
	for (uint32_t i = 0; i < st->ntensors; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		if (t->cur_step > st->last_step && t->ndone && t->undo_off)
			return true;
	}
	return false;
}

void aoqd_state_rollback(struct aoqd_state *st, unsigned threads)
{
	uint64_t open = st->last_step + 1;
	/* the ranges the open step changed, copied back together (in turn
	 * where there is no memory for their list) */
	size_t n = 0, cap = 0;
	for (uint32_t i = 0; i < st->ntensors; i++)
		if (st->tensors[i].cur_step >= open && st->tensors[i].undo_off)
			cap += st->tensors[i].ndone;
	struct aoqd_undo *u = cap ? malloc(cap * sizeof(*u)) : NULL;
	for (uint32_t i = 0; i < st->ntensors; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		if (t->acc_step >= open)
			t->acc_step = 0; /* the micro-batches of the open step are gone */
		if (t->cur_step < open)
			continue;
		for (uint32_t k = 0; k < t->ndone && t->undo_off; k++) {
			if (u)
				u[n++] = (struct aoqd_undo){ i, t->done[k].b, t->done[k].e - t->done[k].b };
			else
				undo_copy(t, t->done[k].b, t->done[k].e - t->done[k].b, false);
		}
		t->steps--; /* the open step counted it */
		t->cur_step = 0;
		t->ndone = 0;
	}
	aoqd_state_unsave_all(st, u, n, threads);
	free(u);
	/* back at last_step: the journal says so, its log empties */
	aoqd_state_journal_boundary(st);
}

static const char *dtype_name(enum aoqk_dtype d)
{
	return d == AOQK_FP32 ? "fp32" : d == AOQK_BF16 ? "bf16" : "fp16";
}

int aoqd_state_same_layout(const struct aoqd_state *st, const struct aoqd_state *old, char *why, size_t len)
{
	if (st->precision != old->precision) {
		snprintf(why, len, "state precision %s here, %s in the leased session",
		         protobuf_c_enum_descriptor_get_value(&aoq__state_precision__descriptor, st->precision)->name,
		         protobuf_c_enum_descriptor_get_value(&aoq__state_precision__descriptor, old->precision)->name);
		return -EINVAL;
	}
	if (st->ngroups != old->ngroups) {
		snprintf(why, len, "%u groups here, %u in the leased session", st->ngroups, old->ngroups);
		return -EINVAL;
	}
	for (uint32_t i = 0; i < st->ngroups; i++)
		if (st->groups[i].kind != old->groups[i].kind || st->groups[i].moments != old->groups[i].moments) {
			snprintf(why, len, "group %u: %s with %u moments here, %s with %u in the leased session", i,
			         kind_name(st->groups[i].kind), st->groups[i].moments, kind_name(old->groups[i].kind),
			         old->groups[i].moments);
			return -EINVAL;
		}
	if (st->ntensors != old->ntensors) {
		snprintf(why, len, "%u tensors here, %u in the leased session", st->ntensors, old->ntensors);
		return -EINVAL;
	}
	for (uint32_t i = 0; i < st->ntensors; i++) {
		const struct aoqd_tensor *a = &st->tensors[i], *b = &old->tensors[i];
		if (strcmp(a->name, b->name) != 0)
			snprintf(why, len, "tensor %u: name '%.200s' here, '%.200s' in the leased session", i, a->name, b->name);
		else if (a->numel != b->numel)
			snprintf(why, len, "tensor %u '%.200s': numel %" PRIu64 " here, %" PRIu64 " in the leased session", i,
			         a->name, a->numel, b->numel);
		else if (a->param_dtype != b->param_dtype || a->grad_dtype != b->grad_dtype)
			snprintf(why, len, "tensor %u '%.200s': param/grad dtype %s/%s here, %s/%s in the leased session", i,
			         a->name, dtype_name(a->param_dtype), dtype_name(a->grad_dtype), dtype_name(b->param_dtype),
			         dtype_name(b->grad_dtype));
		else if (a->group != b->group)
			snprintf(why, len, "tensor %u '%.200s': group %u here, %u in the leased session", i, a->name, a->group,
			         b->group);
		else
			continue;
		return -EINVAL;
	}
	return 0;
}
