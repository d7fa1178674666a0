/* SPDX-License-Identifier: MIT */
/* The calling thread's last error text (aoq_last_error). */
#include <stdarg.h>
#include <stdio.h>

#include "error.h"

static __thread char last_error[512];

const char *aoq_last_error(void)
{
	return last_error;
}

int aoq_set_error(int err, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	return err;
}
