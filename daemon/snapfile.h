/* SPDX-License-Identifier: MIT */
/*
 * The arrays of a snapshot's tensors and the names its header uses, shared
 * by the writer (snapfile.c) and the loader (snapload.c); snapshot.h is the
 * interface of all three snapshot files.
 */
#ifndef AOQD_SNAPFILE_H
#define AOQD_SNAPFILE_H

#include <stdbool.h>
#include <stdint.h>

#include "aoq-kernel.h"

/* A tensor's arrays, in this order: "<key>.master", "<key>.exp_avg",
 * "<key>.exp_avg_sq", and for q8 "<key>.exp_avg.scale",
 * "<key>.exp_avg_sq.scale". */
enum { A_MASTER, A_M, A_V, A_MS, A_VS, A_N };
extern const char *const snap_arr_suffix[A_N];

/* The metadata's names of enum aoqk_precision, the group kinds and the
 * tensor dtypes, indexed by their values. */
#define SNAP_NPREC 7
#define SNAP_NKIND 4
#define SNAP_NDTYPE 3
extern const char *const snap_prec_names[SNAP_NPREC];
extern const char *const snap_kind_names[SNAP_NKIND];
extern const char *const snap_dtype_names[SNAP_NDTYPE];

/* Array k of a tensor of n elements with this many moments: false when it
 * has none; else its safetensors dtype, element count and element size. */
bool snap_arr_info(enum aoqk_precision p, uint64_t n, unsigned moments, int k, const char **dtype,
                   uint64_t *elems, unsigned *esize);
/* Array k of a tensor's state (enum above). */
const void *snap_arr_ptr(const struct aoqk_state *a, int k);
/* Reads (write false) or writes n bytes at offset off of fd, whole: a
 * short transfer goes on, EINTR is retried, end of file is -EIO.  0 or
 * -errno. */
int snap_pio(int fd, void *p, uint64_t n, uint64_t off, bool write);
/* zlib's CRC-32 of n bytes, continued from crc (any length). */
uint32_t snap_crc(uint32_t crc, const void *p, uint64_t n);

#endif
