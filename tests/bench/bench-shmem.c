/* SPDX-License-Identifier: MIT */
/*
 * bench-shmem: how fast this host faults in and maps memory of the kinds
 * aoqd keeps state in, so that the layout of a state's memfds can be
 * chosen from figures (tests/bench/RESULTS.md, "Faulting shared memory").
 *
 *   bench-shmem [GIB [THREADS]]
 *
 * Each line: GIB of memory, THREADS threads each taking an equal slice
 * with madvise(MADV_POPULATE_WRITE), GB/s.  Kinds: anonymous memory with
 * and without transparent huge pages; one memfd shared by the threads
 * against a memfd per thread (shmem's per-file locks); each with the
 * mapping locked (MLOCK_ONFAULT, as aoqd maps state); and the memfds'
 * pages mapped again once they exist (what a restart that adopts a state
 * does).  The ceiling printed first: memset of anonymous memory already
 * faulted in, on the same threads.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MLOCK_ONFAULT
#define MLOCK_ONFAULT 1
#endif

struct job {
	uint8_t *p;
	size_t len;
	bool memset_only;
	int advice;
	int err;
};

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *run(void *arg)
{
	struct job *j = arg;
	if (j->advice < 0) {
		if (munmap(j->p, j->len) != 0)
			j->err = errno;
		return NULL;
	}
	if (j->memset_only) {
		memset(j->p, 1, j->len);
		return NULL;
	}
	if (madvise(j->p, j->len, j->advice) != 0)
		j->err = errno;
	return NULL;
}

/* bases[i] (one per thread, or one for all when shared) and a slice each */
static double go_advice(uint8_t **bases, bool one_base, size_t total, int threads, bool memset_only, int advice)
{
	pthread_t th[256];
	struct job jobs[256];
	size_t slice = total / (size_t)threads;
	double t0 = now();
	for (int i = 0; i < threads; i++) {
		jobs[i] = (struct job){
			.p = one_base ? bases[0] + (size_t)i * slice : bases[i],
			.len = slice,
			.memset_only = memset_only,
			.advice = advice,
		};
		pthread_create(&th[i], NULL, run, &jobs[i]);
	}
	for (int i = 0; i < threads; i++)
		pthread_join(th[i], NULL);
	double dt = now() - t0;
	for (int i = 0; i < threads; i++)
		if (jobs[i].err) {
			fprintf(stderr, "madvise: %s\n", strerror(jobs[i].err));
			return -1;
		}
	return (double)total / dt / 1e9;
}

static double go(uint8_t **bases, bool one_base, size_t total, int threads, bool memset_only)
{
	return go_advice(bases, one_base, total, threads, memset_only, MADV_POPULATE_WRITE);
}

static uint8_t *map_anon(size_t len, bool thp)
{
	uint8_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return NULL;
	madvise(p, len, thp ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
	return p;
}

static int make_memfd(size_t len)
{
	int fd = memfd_create("bench-shmem", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, (off_t)len) != 0) {
		perror("memfd");
		exit(1);
	}
	return fd;
}

static bool hint; /* MADV_HUGEPAGE on the memfds' mappings, as aoqd asks for */

static uint8_t *map_fd(int fd, size_t len, bool lock)
{
	uint8_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		exit(1);
	}
	if (hint)
		madvise(p, len, MADV_HUGEPAGE);
	if (lock && mlock2(p, len, MLOCK_ONFAULT) != 0)
		fprintf(stderr, "mlock2: %s (not locked)\n", strerror(errno));
	return p;
}

static void line(const char *what, double gbs)
{
	printf("  %-52s %6.2f GB/s\n", what, gbs);
}

/* The n mappings unmapped and made again: the memfds' pages stay, the
 * page tables go. */
static void remap(uint8_t **bases, const int *fds, int n, size_t each, bool lock)
{
	for (int i = 0; i < n; i++) {
		munmap(bases[i], each);
		bases[i] = map_fd(fds[i], each, lock);
	}
}

/* The memfds: one of total bytes, or threads of a slice each; faulted in
 * fresh, then unmapped and mapped again to map the pages that now exist. */
static void memfds(size_t total, int threads, bool per_thread, bool lock)
{
	int n = per_thread ? threads : 1;
	size_t each = per_thread ? total / (size_t)threads : total;
	int fds[256];
	uint8_t *bases[256];
	for (int i = 0; i < n; i++) {
		fds[i] = make_memfd(each);
		bases[i] = map_fd(fds[i], each, lock);
	}
	const char *kind = per_thread ? "a memfd per thread" : "one memfd", *locked = lock ? "locked" : "unlocked";
	char what[96];
	snprintf(what, sizeof(what), "%s, %s: fresh pages", kind, locked);
	line(what, go(bases, !per_thread, total, threads, false));
	remap(bases, fds, n, each, lock);
	snprintf(what, sizeof(what), "%s, %s: pages there, mapped again", kind, locked);
	line(what, go(bases, !per_thread, total, threads, false));
	remap(bases, fds, n, each, lock);
	/* A read fault maps the pages around it that the file has (fault
	 * around), writable in a shared mapping of shmem. */
	snprintf(what, sizeof(what), "%s, %s: pages there, read-populated", kind, locked);
	line(what, go_advice(bases, !per_thread, total, threads, false, MADV_POPULATE_READ));
	/* then written: whether the read-populated pages take write faults */
	double t0 = now();
	go(bases, !per_thread, total, threads, true);
	line("  then memset (write faults if any)", (double)total / (now() - t0) / 1e9);
	for (int i = 0; i < n; i++) {
		munmap(bases[i], each);
		close(fds[i]);
	}
}

/* A locked mapping of one memfd whose pages exist, its page tables
 * filled, unmapped in `threads` slices at once (advice -1: munmap): what
 * an aoqd that stops pays to let go of a state it keeps in its memfd. */
static void unmapping(size_t total, int threads)
{
	int fd = make_memfd(total);
	uint8_t *p = map_fd(fd, total, true);
	go(&p, true, total, threads, false);
	for (int t = 1;; t = threads) {
		munmap(p, total);
		p = map_fd(fd, total, true);
		go_advice(&p, true, total, threads, false, MADV_POPULATE_READ);
		char what[96];
		snprintf(what, sizeof(what), "one memfd, locked, mapped: unmapped on %d thread(s)", t);
		line(what, go_advice(&p, true, total, t, false, -1));
		if (t == threads)
			break;
		p = map_fd(fd, total, true);
	}
	close(fd);
}

int main(int argc, char **argv)
{
	double gib = argc > 1 ? atof(argv[1]) : 4;
	int threads = argc > 2 ? atoi(argv[2]) : (int)sysconf(_SC_NPROCESSORS_ONLN);
	if (threads < 1 || threads > 256 || gib <= 0) {
		fprintf(stderr, "usage: bench-shmem [GIB [THREADS (1-256)]]\n");
		return 2;
	}
	size_t total = (size_t)(gib * (double)(1u << 30));
	total -= total % ((size_t)threads << 21);
	if (total == 0) {
		fprintf(stderr, "bench-shmem: GIB too small for %d threads\n", threads);
		return 2;
	}
	char buf[128] = "?";
	FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
	if (f) {
		if (!fgets(buf, sizeof(buf), f))
			strcpy(buf, "?");
		fclose(f);
		buf[strcspn(buf, "\n")] = 0;
	}
	printf("bench-shmem: %.2f GiB, %d threads; shmem_enabled: %s\n", (double)total / (1u << 30), threads, buf);

	uint8_t *a = map_anon(total, true);
	go(&a, true, total, threads, false);
	line("ceiling: memset of memory already there", go(&a, true, total, threads, true));
	munmap(a, total);
	a = map_anon(total, true);
	line("anonymous, huge pages: fresh", go(&a, true, total, threads, false));
	munmap(a, total);
	a = map_anon(total, false);
	line("anonymous, 4 KiB pages: fresh", go(&a, true, total, threads, false));
	munmap(a, total);

	unmapping(total, threads);
	if (getenv("BENCH_SHMEM_UNMAP_ONLY"))
		return 0;
	memfds(total, threads, false, false);
	memfds(total, threads, true, false);
	memfds(total, threads, false, true);
	memfds(total, threads, true, true);
	/* aoqd's mappings of a stored state: locked, with MADV_HUGEPAGE
	 * (which shmem_enabled=never ignores, or not) */
	hint = true;
	printf("with MADV_HUGEPAGE on the memfds' mappings:\n");
	memfds(total, threads, false, true);
	return 0;
}
