/* SPDX-License-Identifier: MIT */
/*
 * Per-uid accounts (account.c): what one uid holds of the daemon, charged
 * before it is taken, so that no local user can take the service away from
 * the others (docs/design.md, "Shared nodes").
 *
 *   connections  open connections (loop thread)
 *   bytes        memory held for the uid's sessions: registration tables
 *                and names, page-rounded state mappings, accumulators,
 *                arenas (any thread: a session's last reference may drop on
 *                a worker)
 *   buffered     read buffers holding parts of frames beyond the first
 *                64 KiB of each connection (loop thread)
 *
 * An account lives as long as the server: one per uid ever seen.
 *
 * Memory limits (max_state_bytes_per_uid) are a number of bytes, 0 (none)
 * or AOQD_QUOTA_AUTO, the default: the uid's fair share of
 * AOQD_AUTO_PERCENT of the machine's memory, that share divided among the
 * uids holding memory in the daemon at the charge (the charging uid
 * included) and never more than the others leave of it.  One uid alone may
 * use it all; each uid that comes gets an equal part of what is free; no
 * uid loses what it holds (docs/design.md, "Shared nodes").
 */
#ifndef AOQD_ACCOUNT_H
#define AOQD_ACCOUNT_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#define AOQD_QUOTA_AUTO UINT64_MAX
#define AOQD_AUTO_PERCENT 90

struct aoqd_account {
	struct aoqd_account *next;  /* set before the account is published */
	struct aoqd_account *_Atomic *list; /* the list it is on: auto limits count the others */
	uid_t uid;
	uint32_t connections;
	_Atomic uint64_t bytes;
	uint64_t buffered;
};

/* The uid's account, created on first use (loop thread; other threads may
 * walk the list meanwhile); NULL when out of memory. */
struct aoqd_account *aoqd_account_get(struct aoqd_account *_Atomic *list, uid_t uid);
void aoqd_account_free_all(struct aoqd_account *_Atomic *list);
/* Charges n bytes if the account stays within limit (0: no limit;
 * AOQD_QUOTA_AUTO: aoqd_account_limit's share): 0, or -EDQUOT and nothing
 * charged.  Any thread. */
int aoqd_account_charge(struct aoqd_account *a, uint64_t n, uint64_t limit);
/* The bytes a's uid may hold under limit: limit itself, or for
 * AOQD_QUOTA_AUTO the share above as of now (for messages and stats). */
uint64_t aoqd_account_limit(const struct aoqd_account *a, uint64_t limit);
void aoqd_account_uncharge(struct aoqd_account *a, uint64_t n);
/* n rounded up to whole pages: what a mapping of n bytes takes. */
uint64_t aoqd_page_round(uint64_t n);

#endif
