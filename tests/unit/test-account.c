/* SPDX-License-Identifier: MIT */
/*
 * What one uid may hold (daemon/account.h) and which final records a step
 * takes (aoqd_tensor_mark_done, daemon/state.h): charges stop at the limit
 * and take nothing when refused; a tensor's final ranges merge in any
 * order, refuse any overlap, and end the tensor only when they cover it.
 */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "account.h"
#include "state.h"

#include "expect.h"

static void test_account(void)
{
	struct aoqd_account *list = NULL;
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
	test_ranges();
	if (!failures)
		printf("ok\n");
	return failures != 0;
}
