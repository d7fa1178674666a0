/* SPDX-License-Identifier: MIT */
/*
 * What one uid may hold (daemon/account.h) and which final records a step
 * takes (aoqd_tensor_mark_done, daemon/state.h): charges stop at the limit
 * and take nothing when refused; the auto limit is a uid's fair share of
 * 90% of the memory among the uids holding some, never more than the
 * others leave; a tensor's final ranges merge in any order, refuse any
 * overlap, and end the tensor only when they cover it.
 */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "account.h"
#include "state.h"

#include "expect.h"

static void test_account(void)
{
	struct aoqd_account *_Atomic list = NULL;
	struct aoqd_account *a = aoqd_account_get(&list, 1000), *b = aoqd_account_get(&list, 1001);
	EXPECT(a && b && a != b, "two uids, two accounts");
	EXPECT(aoqd_account_get(&list, 1000) == a, "one account per uid");
	EXPECT(aoqd_account_charge(a, 60, 100) == 0, "within the limit");
	EXPECT(aoqd_account_charge(a, 41, 100) == -EDQUOT, "past the limit");
	EXPECT(atomic_load(&a->bytes) == 60, "a refused charge takes nothing (%llu)",
	       (unsigned long long)atomic_load(&a->bytes));
	EXPECT(aoqd_account_charge(a, 40, 100) == 0, "up to the limit exactly");
	EXPECT(aoqd_account_charge(b, 100, 100) == 0, "another uid has its own");
	EXPECT(aoqd_account_charge(a, UINT64_MAX, 0) == -EDQUOT, "no overflow without a limit");
	aoqd_account_uncharge(a, 100);
	EXPECT(atomic_load(&a->bytes) == 0, "given back");
	long page = sysconf(_SC_PAGESIZE);
	EXPECT(aoqd_page_round(1) == (uint64_t)page && aoqd_page_round((uint64_t)page) == (uint64_t)page &&
	       aoqd_page_round(0) == 0 && aoqd_page_round(UINT64_MAX) == UINT64_MAX, "page rounding");
	aoqd_account_free_all(&list);
	EXPECT(!list, "freed");
}

/* max_state_bytes_per_uid = auto. */
static void test_auto(void)
{
	struct aoqd_account *_Atomic list = NULL;
	long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
	uint64_t pool = (uint64_t)pages / 100 * AOQD_AUTO_PERCENT * (uint64_t)psize;
	struct aoqd_account *a = aoqd_account_get(&list, 1000);
	EXPECT(aoqd_account_limit(a, AOQD_QUOTA_AUTO) == pool, "alone: all of the pool (%llu, want %llu)",
	       (unsigned long long)aoqd_account_limit(a, AOQD_QUOTA_AUTO), (unsigned long long)pool);
	EXPECT(aoqd_account_limit(a, 12345) == 12345 && aoqd_account_limit(a, 0) == 0, "numbers stay numbers");
	/* One uid alone takes 70% of the pool, which a 50% limit refused. */
	uint64_t big = pool / 10 * 7;
	EXPECT(aoqd_account_charge(a, big, AOQD_QUOTA_AUTO) == 0, "alone: 70%% of the pool");
	EXPECT(aoqd_account_charge(a, pool - big + 1, AOQD_QUOTA_AUTO) == -EDQUOT, "alone: not past the pool");
	/* A second uid: half the pool, but only what the first leaves. */
	struct aoqd_account *b = aoqd_account_get(&list, 1001);
	EXPECT(aoqd_account_limit(b, AOQD_QUOTA_AUTO) == pool - big, "the second gets what is left (%llu)",
	       (unsigned long long)aoqd_account_limit(b, AOQD_QUOTA_AUTO));
	EXPECT(aoqd_account_charge(b, pool - big + 1, AOQD_QUOTA_AUTO) == -EDQUOT, "not more than is left");
	EXPECT(aoqd_account_charge(b, pool / 10, AOQD_QUOTA_AUTO) == 0, "a tenth of the pool");
	/* The first keeps what it holds but cannot grow past its half now. */
	EXPECT(aoqd_account_limit(a, AOQD_QUOTA_AUTO) == pool / 2, "two uids: half each (%llu)",
	       (unsigned long long)aoqd_account_limit(a, AOQD_QUOTA_AUTO));
	EXPECT(aoqd_account_charge(a, 1, AOQD_QUOTA_AUTO) == -EDQUOT, "over its half: no more");
	/* The first gives all back: the second may have half, then three
	 * uids a third each. */
	aoqd_account_uncharge(a, big);
	EXPECT(aoqd_account_limit(b, AOQD_QUOTA_AUTO) == pool, "the first gone: the second alone");
	struct aoqd_account *c = aoqd_account_get(&list, 1002);
	EXPECT(aoqd_account_charge(a, 1, AOQD_QUOTA_AUTO) == 0 && aoqd_account_charge(c, 1, AOQD_QUOTA_AUTO) == 0,
	       "two more uids");
	EXPECT(aoqd_account_limit(b, AOQD_QUOTA_AUTO) == pool / 3, "three uids: a third each (%llu)",
	       (unsigned long long)aoqd_account_limit(b, AOQD_QUOTA_AUTO));
	/* An account the others fill leaves nothing, and nothing means
	 * refused, not unlimited. */
	aoqd_account_uncharge(a, 1);
	aoqd_account_uncharge(c, 1);
	aoqd_account_uncharge(b, pool / 10);
	EXPECT(aoqd_account_charge(b, pool, AOQD_QUOTA_AUTO) == 0, "one uid holds the whole pool");
	EXPECT(aoqd_account_limit(a, AOQD_QUOTA_AUTO) == 0 && aoqd_account_charge(a, 1, AOQD_QUOTA_AUTO) == -EDQUOT,
	       "nothing left: refused");
	aoqd_account_free_all(&list);
}

static void test_ranges(void)
{
	struct aoqd_tensor t = { .numel = 100 };
	/* In order, the usual case. */
	EXPECT(aoqd_tensor_mark_done(&t, 0, 30) == 0, "first piece");
	EXPECT(aoqd_tensor_mark_done(&t, 30, 30) == 0 && t.ndone == 1, "merged");
	EXPECT(aoqd_tensor_mark_done(&t, 0, 50) == -EEXIST, "the same half twice");
	EXPECT(aoqd_tensor_mark_done(&t, 59, 2) == -EEXIST, "overlapping the end by one");
	EXPECT(aoqd_tensor_mark_done(&t, 60, 40) == 1, "the whole tensor");
	/* Out of order, with gaps filled last. */
	t.ndone = 0;
	EXPECT(aoqd_tensor_mark_done(&t, 80, 20) == 0, "last piece first");
	EXPECT(aoqd_tensor_mark_done(&t, 20, 10) == 0 && t.ndone == 2, "a piece in the middle");
	EXPECT(aoqd_tensor_mark_done(&t, 25, 1) == -EEXIST, "inside a piece");
	EXPECT(aoqd_tensor_mark_done(&t, 10, 71) == -EEXIST, "spanning a piece");
	EXPECT(aoqd_tensor_mark_done(&t, 0, 20) == 0 && t.ndone == 2, "joined on the right");
	EXPECT(aoqd_tensor_mark_done(&t, 30, 50) == 1 && t.ndone == 1, "bridging two pieces");
	/* Twice the elements of a tensor in two records of half: refused. */
	t.ndone = 0;
	EXPECT(aoqd_tensor_mark_done(&t, 0, 50) == 0, "first half");
	EXPECT(aoqd_tensor_mark_done(&t, 0, 50) == -EEXIST, "first half again is not the second");
	free(t.done);
}

int main(void)
{
	test_account();
	test_auto();
	test_ranges();
	if (!failures)
		printf("ok\n");
	return failures != 0;
}
