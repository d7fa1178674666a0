/* SPDX-License-Identifier: MIT */
/*
 * Where a state's arrays live (docs/design.md, "The fd store", and
 * docs/decisions.md, "The master is the parameter"): each tensor's
 * mapping (private huge pages, or a slot of the session's memfd kept in
 * systemd's fd store), the masters memfds of masters that are parameters
 * (made, or at a restart taken back from the store in place or copied),
 * their locking, the undo copy's room, and letting all of it go.  Loop
 * thread, but a restart's copies (threads of their own) and
 * aoqd_state_free_later's releases (pool.h).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "aoq-arena.h"
#include "aoq-config.h"
#include "held.h"
#include "log.h"
#include "pool.h"
#include "state.h"

#if AOQ_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

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
	return master_param_on && x->param_dtype == AOQK_BF16 &&
	       (st->precision == AOQ__STATE_PRECISION__STATE_Q8 || st->precision == AOQ__STATE_PRECISION__STATE_Q4);
}

unsigned aoqd_tensor_wants_lo(const struct aoqd_state *st, const struct aoqd_tensor *x)
{
	return !aoqd_tensor_wants_split(st, x) ? 0 : st->master24 ? 1 : 2;
}

/* Whether x's master goes to the masters memfd (before the allocation):
 * a bf16 master, or the split master's high half. */
static bool wants_master_param(const struct aoqd_state *st, const struct aoqd_tensor *x)
{
	return aoqk_master_size((enum aoqk_precision)st->precision) == 2 ? master_param_on && x->param_dtype == AOQK_BF16
	                                                                 : aoqd_tensor_wants_split(st, x);
}

uint64_t aoqd_state_tensor_len(const struct aoqd_state *st, const struct aoqd_tensor *x,
                               uint64_t off[AOQD_STATE_ARRAYS])
{
	uint64_t len = aoqd_state_len((enum aoqk_precision)st->precision, x->numel, st->groups[x->group].moments,
	                              aoqd_tensor_wants_lo(st, x), off);
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

/* A huge page: the unit in which a file's pages map by 2 MiB, where they
 * are huge (shmem_enabled=advise and MADV_HUGEPAGE), only at addresses
 * congruent to their file offset modulo it. */
#define HUGE_PAGE (2u << 20)

/* `len` bytes of address space (PROT_NONE, nothing behind them) at an
 * address congruent to `phase` modulo HUGE_PAGE when `phased`, for a
 * file's pages at an offset of that phase to be mapped over (MAP_FIXED): a
 * master that is the parameter lands at its masters memfd's offset, which
 * the kernel's own choice of address would not follow.  NULL with *err on
 * failure. */
static uint8_t *reserve_at_phase(size_t len, uint64_t phase, bool phased, int *err)
{
	size_t span = len + (phased ? HUGE_PAGE : 0);
	uint8_t *r = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (r == MAP_FAILED) {
		*err = -errno;
		return NULL;
	}
	if (!phased)
		return r; /* one mmap for the many small tensors of a large model */
	size_t d = (size_t)((phase % HUGE_PAGE + HUGE_PAGE - (uintptr_t)r % HUGE_PAGE) % HUGE_PAGE);
	if (d)
		munmap(r, d);
	munmap(r + d + len, span - d - len);
	return r + d;
}

/* A tensor whose master is its parameter: `reserve` bytes of address space
 * (room for an undo copy, aoqd_state_add_undo), the masters memfd's pages
 * from moff over the first mlen bytes, private pages for the rest of
 * `whole`. */
static void *map_state_master(int fd, uint64_t moff, size_t mlen, size_t whole, size_t reserve, int lock_memory,
                              bool *locked, int *err)
{
	/* a master smaller than a huge page has none: any address */
	uint8_t *p = reserve_at_phase(reserve, mlen >= HUGE_PAGE ? moff : 0, mlen >= HUGE_PAGE, err);
	if (!p)
		return NULL;
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

/* Whether x's master is the parameter and at least a huge page: mapped at
 * its memfd offset's phase (slot_start, map_state_memfd). */
static bool master_phased(const struct aoqd_tensor *x)
{
	return x->master_off != AOQ_NO_MASTER && x->numel * 2 >= HUGE_PAGE;
}

/* Where tensor x's slot starts, at pos or after it (holes between): a
 * master that is the parameter, of a huge page or more, starts at the
 * phase modulo HUGE_PAGE of its offset in its masters memfd, so that one
 * address (reserve_at_phase) maps both the masters memfd's pages and the
 * slot's by 2 MiB where they are huge.  The masters laid out
 * (masters_layout). */
static uint64_t slot_start(const struct aoqd_state *st, const struct aoqd_tensor *x, uint64_t pos, uint64_t doff)
{
	if (!master_phased(x))
		return pos;
	uint64_t local;
	aoqd_state_masters_fd(st, x->master_off, &local, NULL);
	return pos + (local % HUGE_PAGE + HUGE_PAGE - (doff + pos) % HUGE_PAGE) % HUGE_PAGE;
}

uint64_t aoqd_state_memfd_layout(struct aoqd_state *st, uint64_t *off)
{
	masters_layout(st);
	uint64_t pos = 0, doff = aoqd_state_memfd_data_off(st);
	for (uint32_t i = 0; i < st->ntensors; i++) {
		uint64_t o[AOQD_STATE_ARRAYS];
		uint64_t len = aoqd_state_tensor_len(st, &st->tensors[i], o);
		if (len > (UINT64_MAX >> 2) || pos > (UINT64_MAX >> 2))
			return UINT64_MAX;
		pos = slot_start(st, &st->tensors[i], pos, doff);
		if (off)
			off[i] = pos;
		if (__builtin_add_overflow(pos, slot_len(len), &pos))
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
	for (uint32_t b = 0; b < n; b += AOQD_UNSAVE_THREADS)
		aoqd_threads_run(masters_copy_run, c + b, sizeof(c[0]),
		                 n - b < AOQD_UNSAVE_THREADS ? n - b : AOQD_UNSAVE_THREADS);
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
	/* a large master: at the slot's phase, which the layout made the
	 * master's too (slot_start); else where the kernel puts a mapping of
	 * the file (at the slot's phase where huge pages can be had) */
	bool phased = master_phased(x);
	uint8_t *r = phased ? reserve_at_phase(reserve, (uint64_t)at, true, err) : NULL;
	if (phased && !r)
		return NULL;
	uint8_t *p = mmap(r, reserve, PROT_READ | PROT_WRITE, MAP_SHARED | (phased ? MAP_FIXED : 0), st->mem_fd, at);
	if (p == MAP_FAILED) {
		*err = -errno;
		if (r)
			munmap(r, reserve);
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
			x->mem_off = pos = slot_start(st, x, pos, st->mem_data_off);
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
		unsigned lo = aoqd_tensor_wants_lo(st, x);
		x->st.master_lo = lo == 2 ? p + off[5] : NULL;
		x->st.master_lo8 = lo == 1 ? p + off[5] : NULL;
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

static void drop_item(const struct aoqd_drop_item *x)
{
	if (x->unlock)
		munlock(x->p, x->unlock);
	if (x->fd >= 0)
		fallocate(x->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, x->off, x->flen);
	else if (x->len > x->keep)
		/* a fresh mapping in place of the arrays: their pages go whether
		 * or not munlock took (MADV_DONTNEED refuses locked pages, and
		 * AddressSanitizer makes munlock a no-op), and the range is never
		 * unmapped (populate.c) */
		mmap(x->p + x->keep, x->len - x->keep, PROT_READ | PROT_WRITE,
		     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
}

void aoqd_state_drop(struct aoqd_drop *d)
{
	for (size_t i = 0; i < d->n; i++)
		drop_item(&d->v[i]);
	free(d->v);
	d->v = NULL;
	d->n = d->cap = 0;
}

uint64_t aoqd_state_release(struct aoqd_state *st, struct aoqd_tensor *t, _Atomic uint64_t *locked_total,
                            struct aoqd_release *later, struct aoqd_drop *drop)
{
	/* charged at registration: the page-rounded arrays, a master that is
	 * the parameter on whole pages of its own at their start (no undo
	 * copy: a state that keeps one is never released) */
	uint64_t len = t->state_len;
	uint64_t keep = t->master_off != AOQ_NO_MASTER ? aoqd_page_round(t->numel * 2) : 0;
	uint64_t charged = aoqd_page_round(len) - keep, bytes = len - keep;
	/* Marked first: the populate chunks (populate.c) that have not reached
	 * the tensor pass over it; one already at it faults in at most its own
	 * 2 MiB again, never into an unmapped range. */
	__atomic_store_n(&t->released, true, __ATOMIC_RELEASE);
	struct aoqd_drop_item x = { (uint8_t *)t->state_mem, t->locked ? len : 0, keep, len, -1, 0, 0 };
	if (t->in_memfd) {
		x.fd = st->mem_fd;
		x.off = (off_t)(st->mem_data_off + t->mem_off);
		x.flen = (off_t)slot_len(len);
	}
	if (!x.p) {
		/* nothing mapped */
	} else if (drop && drop->n == drop->cap) {
		size_t cap = drop->cap ? 2 * drop->cap : 16;
		struct aoqd_drop_item *v = realloc(drop->v, cap * sizeof(*v));
		if (v) {
			drop->v = v;
			drop->cap = cap;
		}
	}
	if (x.p && drop && drop->n < drop->cap)
		drop->v[drop->n++] = x;
	else if (x.p)
		drop_item(&x);
	if (t->locked) {
		st->locked_bytes -= len;
		atomic_fetch_sub(locked_total, len);
	}
	if (t->acc) {
		aoqd_release(later, t->acc, t->numel * sizeof(float), -1);
		charged += aoqd_page_round(t->numel * sizeof(float));
		bytes += t->numel * sizeof(float);
	}
	st->state_bytes -= bytes;
	if (st->account)
		aoqd_account_uncharge(st->account, charged);
	st->charged -= charged;
	struct aoqk_state none = { .precision = t->st.precision, .n = t->st.n };
	t->st = none;
	t->acc = NULL;
	t->locked = false;
	st->nreleased++;
	return bytes;
}

/* Moves tensor t's mapping to p, keeping every array's offset. */
static void rebase(struct aoqd_tensor *t, uint8_t *p)
{
	uint8_t *o = t->state_mem;
	void **arr[5] = { &t->st.master, &t->st.m, &t->st.v, &t->st.master_lo, &t->st.master_lo8 };
	for (int k = 0; k < 5; k++)
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
