/* SPDX-License-Identifier: MIT */
/* The calling thread's last error text (error.c): every file of libaoq sets
 * it with the error it returns; it calls no other file of libaoq. */
#ifndef AOQ_CLIENT_ERROR_H
#define AOQ_CLIENT_ERROR_H

#include "aoq/aoq.h"

/* Sets the calling thread's aoq_last_error() text; returns err. */
int aoq_set_error(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
