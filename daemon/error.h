/* SPDX-License-Identifier: MIT */
/*
 * The daemon's one error flow (docs/design.md, "Errors").  A handler that
 * cannot do what a message asks fills a struct aoqd_error and returns the
 * negative errno of its code; it never changes the session itself.  The
 * session (close.c) turns the error into the Error reply: a refusal keeps
 * the session, any other error fails it (Error, then the connection closes).
 */
#ifndef AOQD_ERROR_H
#define AOQD_ERROR_H

#include <stdbool.h>

#include "aoq.pb-c.h"

struct aoqd_error {
	Aoq__ErrorCode code;
	bool refusal;      /* the request is refused, the session goes on */
	char msg[512];
};

/* Fills e and returns the code's negative errno (never 0). */
int aoqd_error_set(struct aoqd_error *e, Aoq__ErrorCode code, bool refusal, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

/* The session fails: return AOQD_FAIL(err, INVALID, "...") */
#define AOQD_FAIL(e, code, ...) aoqd_error_set(e, AOQ__ERROR_CODE__##code, false, __VA_ARGS__)
/* The request is refused; the session goes on. */
#define AOQD_REFUSE(e, code, ...) aoqd_error_set(e, AOQ__ERROR_CODE__##code, true, __VA_ARGS__)

/* A handler's non-error results: it replied, or its reply comes later and
 * the connection reads nothing meanwhile. */
#define AOQD_REPLIED 0
#define AOQD_DEFERRED 1

#endif
