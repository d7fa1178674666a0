/* SPDX-License-Identifier: MIT */
/* The unit tests' one assertion: prints the failed condition with a
 * message and counts it; main() returns failures != 0. */
#ifndef AOQ_UNIT_EXPECT_H
#define AOQ_UNIT_EXPECT_H

#include <stdio.h>

static int failures;
#define EXPECT(cond, ...)                                                        \
	do {                                                                     \
		if (!(cond)) {                                                   \
			fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                            \
			fputc('\n', stderr);                                     \
			failures++;                                              \
		}                                                                \
	} while (0)

#endif
