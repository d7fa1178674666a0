/* SPDX-License-Identifier: MIT */
/*
 * Memory a client can keep alive after its session: see held.h.  A table
 * of watches under one lock: a release may come from a worker (the
 * session's last reference), the events are read on the loop.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <unistd.h>

#include "account.h"
#include "held.h"
#include "log.h"

struct held {
	int wd;
	int64_t open;              /* descriptions of the memfd */
	bool released;             /* the daemon let go: the charge below */
	struct aoqd_account *acc;
	uint64_t bytes;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int ifd = -1;
static struct held *tab;
static size_t n, cap;
static uint64_t held_total;

int aoqd_held_init(void)
{
	if (ifd < 0)
		ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
	if (ifd < 0)
		aoqd_warn("server", "inotify: %s: memory a client keeps after its session is not charged to its uid",
		          strerror(errno));
	return ifd;
}

static struct held *find(int wd)
{
	for (size_t i = 0; i < n; i++)
		if (tab[i].wd == wd)
			return &tab[i];
	return NULL;
}

/* Drops entry e (lock held): its charge goes back. */
static void drop(struct held *e)
{
	if (e->released) {
		aoqd_account_uncharge(e->acc, e->bytes);
		held_total -= e->bytes;
	}
	*e = tab[--n];
}

int aoqd_held_watch(int fd)
{
	if (ifd < 0)
		return -1;
	char path[64];
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	pthread_mutex_lock(&lock);
	int wd = -1;
	if (n == cap) {
		size_t nc = cap ? 2 * cap : 64;
		struct held *p = realloc(tab, nc * sizeof(*p));
		if (!p)
			goto out;
		tab = p;
		cap = nc;
	}
	wd = inotify_add_watch(ifd, path, IN_OPEN | IN_CLOSE_WRITE | IN_CLOSE_NOWRITE);
	if (wd < 0) {
		aoqd_warn("server", "inotify watch of a masters memfd: %s", strerror(errno));
		goto out;
	}
	/* A memfd's inode is its own: a new wd each time. */
	tab[n++] = (struct held){ .wd = wd, .open = 1 };
out:
	pthread_mutex_unlock(&lock);
	return wd;
}

void aoqd_held_release(int wd, struct aoqd_account *acc, uint64_t bytes)
{
	if (wd < 0 || !acc)
		return;
	pthread_mutex_lock(&lock);
	struct held *e = find(wd);
	if (e && !e->released) {
		aoqd_account_charge(acc, bytes, 0); /* held already: no quota to check */
		e->released = true;
		e->acc = acc;
		e->bytes = bytes;
		held_total += bytes;
	}
	pthread_mutex_unlock(&lock);
}

void aoqd_held_poll(void)
{
	if (ifd < 0)
		return;
	union {
		struct inotify_event ev;
		char b[4096];
	} buf;
	for (;;) {
		ssize_t r = read(ifd, buf.b, sizeof(buf.b));
		if (r <= 0)
			return;
		pthread_mutex_lock(&lock);
		for (ssize_t off = 0; off + (ssize_t)sizeof(struct inotify_event) <= r;) {
			const struct inotify_event *ev = (const void *)(buf.b + off);
			off += (ssize_t)sizeof(*ev) + ev->len;
			struct held *e = find(ev->wd);
			if (!e)
				continue;
			if (ev->mask & IN_OPEN)
				e->open++;
			if (ev->mask & (IN_CLOSE_WRITE | IN_CLOSE_NOWRITE))
				e->open--;
			/* aoqd's own description is open until it lets go: a
			 * close below it is of one opened before the watch (a
			 * masters memfd a restart took back, which the
			 * trainers of the aoqd before had open) */
			if (!e->released && e->open < 1)
				e->open = 1;
			if (ev->mask & IN_IGNORED) {
				drop(e);
				continue;
			}
			if (e->open <= 0 && e->released) {
				/* no description left: the pages go with the watch */
				int wd = e->wd;
				drop(e);
				inotify_rm_watch(ifd, wd);
			}
		}
		pthread_mutex_unlock(&lock);
	}
}

uint64_t aoqd_held_bytes(void)
{
	pthread_mutex_lock(&lock);
	uint64_t b = held_total;
	pthread_mutex_unlock(&lock);
	return b;
}
