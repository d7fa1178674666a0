/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>

#include "error.h"
#include "wire.h"

int aoqd_error_set(struct aoqd_error *e, Aoq__ErrorCode code, bool refusal, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
	va_end(ap);
	e->code = code;
	e->refusal = refusal;
	int r = aoq_error_to_errno(code);
	return r < 0 ? r : -EIO;
}
