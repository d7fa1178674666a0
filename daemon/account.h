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
 */
#ifndef AOQD_ACCOUNT_H
#define AOQD_ACCOUNT_H

#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

struct aoqd_account {
	struct aoqd_account *next;
	uid_t uid;
	uint32_t connections;
	_Atomic uint64_t bytes;
	uint64_t buffered;
};

/* The uid's account, created on first use; NULL when out of memory. */
struct aoqd_account *aoqd_account_get(struct aoqd_account **list, uid_t uid);
void aoqd_account_free_all(struct aoqd_account **list);
/* Charges n bytes if the account stays within limit (0: no limit): 0, or
 * -EDQUOT and nothing charged. */
int aoqd_account_charge(struct aoqd_account *a, uint64_t n, uint64_t limit);
void aoqd_account_uncharge(struct aoqd_account *a, uint64_t n);
/* n rounded up to whole pages: what a mapping of n bytes takes. */
uint64_t aoqd_page_round(uint64_t n);

#endif
