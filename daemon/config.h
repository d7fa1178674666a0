/* SPDX-License-Identifier: MIT */
/*
 * aoqd's settings: one table of keys shared by the config file and the
 * command line, so both check a value the same way (type, range, the
 * allowed words) and name the key or flag in every error.
 *
 * struct aoqd_config itself is declared in aoqd.h.
 */
#ifndef AOQD_CONFIG_H
#define AOQD_CONFIG_H

#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#include "aoqd.h"

/* Upper bound of `threads` (worker threads; 0 = every allowed core but one). */
#define AOQD_MAX_THREADS 1024u

/*
 * Sets one key from its text.  Returns 0; -ENOENT for an unknown key (err
 * says so); -EINVAL or -ERANGE for a bad value, with err naming what the key
 * accepts.  A string value is copied (the copy lives as long as the daemon).
 */
int aoqd_config_set(struct aoqd_config *c, const char *key, const char *value, char *err, size_t errlen);

/*
 * Whole-number parsing for settings: decimal or 0x hex, no sign, no
 * fraction; with sizes, a K/M/G/T suffix (powers of 1024).  -EINVAL when it
 * is not such a number, -ERANGE when it overflows 64 bits.
 */
int aoqd_parse_u64(const char *s, int allow_suffix, uint64_t *out);

/*
 * Checks what no single key can: the socket path fits sun_path, the kernel
 * runs on this CPU, a --listen-fd is an open listening Unix stream socket.
 * Returns 0 or a negative errno with err filled.
 */
int aoqd_config_check(const struct aoqd_config *c, char *err, size_t errlen);

/* Prints the effective settings as config-file lines. */
void aoqd_config_print(const struct aoqd_config *c, FILE *f);

#endif
