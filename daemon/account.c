/* SPDX-License-Identifier: MIT */
/* Per-uid accounts: connections, memory, buffered frames. */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "account.h"

struct aoqd_account *aoqd_account_get(struct aoqd_account **list, uid_t uid)
{
	for (struct aoqd_account *a = *list; a; a = a->next)
		if (a->uid == uid)
			return a;
	struct aoqd_account *a = calloc(1, sizeof(*a));
	if (!a)
		return NULL;
	a->uid = uid;
	atomic_init(&a->bytes, 0);
	a->next = *list;
	*list = a;
	return a;
}

void aoqd_account_free_all(struct aoqd_account **list)
{
	while (*list) {
		struct aoqd_account *a = *list;
		*list = a->next;
		free(a);
	}
}

int aoqd_account_charge(struct aoqd_account *a, uint64_t n, uint64_t limit)
{
	uint64_t cur = atomic_load(&a->bytes), next;
	do {
		if (__builtin_add_overflow(cur, n, &next) || (limit && next > limit))
			return -EDQUOT;
	} while (!atomic_compare_exchange_weak(&a->bytes, &cur, next));
	return 0;
}

void aoqd_account_uncharge(struct aoqd_account *a, uint64_t n)
{
	atomic_fetch_sub(&a->bytes, n);
}

uint64_t aoqd_page_round(uint64_t n)
{
	long p = sysconf(_SC_PAGESIZE);
	uint64_t page = p > 0 ? (uint64_t)p : 4096;
	return n > UINT64_MAX - page ? UINT64_MAX : (n + page - 1) / page * page;
}
