/* SPDX-License-Identifier: MIT */
/* Per-uid accounts: connections, memory, buffered frames. */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "account.h"

struct aoqd_account *aoqd_account_get(struct aoqd_account *_Atomic *list, uid_t uid)
{
	for (struct aoqd_account *a = atomic_load_explicit(list, memory_order_acquire); a; a = a->next)
		if (a->uid == uid)
			return a;
	struct aoqd_account *a = calloc(1, sizeof(*a));
	if (!a)
		return NULL;
	a->uid = uid;
	a->list = list;
	atomic_init(&a->bytes, 0);
	a->next = atomic_load_explicit(list, memory_order_relaxed);
	/* published whole: a worker walking the list (auto limits) sees
	 * next and uid set */
	atomic_store_explicit(list, a, memory_order_release);
	return a;
}

void aoqd_account_free_all(struct aoqd_account *_Atomic *list)
{
	struct aoqd_account *a = atomic_exchange(list, NULL);
	while (a) {
		struct aoqd_account *next = a->next;
		free(a);
		a = next;
	}
}

/* AOQD_AUTO_PERCENT of the machine's memory, read once. */
static uint64_t auto_pool(void)
{
	static _Atomic uint64_t pool;
	uint64_t p = atomic_load_explicit(&pool, memory_order_relaxed);
	if (!p) {
		long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
		p = pages > 0 && psize > 0 ? (uint64_t)pages / 100 * AOQD_AUTO_PERCENT * (uint64_t)psize : 1;
		atomic_store_explicit(&pool, p, memory_order_relaxed);
	}
	return p;
}

uint64_t aoqd_account_limit(const struct aoqd_account *a, uint64_t limit)
{
	if (limit != AOQD_QUOTA_AUTO || !a->list)
		return limit;
	uint64_t pool = auto_pool(), others = 0;
	unsigned uids = 1;
	for (const struct aoqd_account *o = atomic_load_explicit(a->list, memory_order_acquire); o; o = o->next) {
		uint64_t b = atomic_load_explicit(&o->bytes, memory_order_relaxed);
		if (o == a || !b)
			continue;
		uids++;
		others = others > UINT64_MAX - b ? UINT64_MAX : others + b;
	}
	uint64_t share = pool / uids, left = others < pool ? pool - others : 0;
	return share < left ? share : left;
}

int aoqd_account_charge(struct aoqd_account *a, uint64_t n, uint64_t limit)
{
	/* an auto limit is taken once per charge: two uids charging at the
	 * same instant may each pass on the other's old figure (one request
	 * each) */
	uint64_t lim = aoqd_account_limit(a, limit);
	uint64_t cur = atomic_load(&a->bytes), next;
	do {
		if (__builtin_add_overflow(cur, n, &next) || (limit && next > lim))
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
