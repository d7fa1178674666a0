/* SPDX-License-Identifier: MIT */
/*
 * aoqd's settings (config.c): defaults, the config file and the command
 * line.  One table of keys is shared by the file and the flags, so both
 * check a value the same way (type, range, the allowed words) and name the
 * key or flag in every error.
 */
#ifndef AOQD_CONFIG_H
#define AOQD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define AOQD_LOOP_SPIN_AUTO UINT32_MAX
/* state_dir without systemd's StateDirectory= */
#define AOQD_STATE_DIR "/var/lib/aoq"

struct aoqd_config {
	const char *socket_path;  /* --socket */
	int listen_fd;            /* --listen-fd, or -1 */
	unsigned threads;         /* 0: all cores but one */
	uint32_t worker_spin_us;  /* a pinned worker gone idle spins this long before it sleeps */
	/* the loop thread polls the rings this long after a record (pinned
	 * workers only, not while tasks wait for a worker); AOQD_LOOP_SPIN_AUTO (the
	 * default): 50 with 4 cores or more, else 0 */
	uint32_t loop_spin_us;
	const char *kernel;       /* NULL/"auto" or a variant name */
	int lock_memory;          /* 0 no, 1 try (default), 2 required */
	/* bf16 masters are the parameters (aoq-arena.h, "The master as the
	 * parameter"): the clients copy them straight from a memfd */
	bool master_param;
	uint32_t max_sessions_per_uid;
	uint32_t lease_seconds;   /* a trainer's state outlives it this long (0: off) */
	uint32_t max_connections;
	uint32_t max_tensors;
	uint64_t max_tensor_elems;
	uint64_t max_arena_bytes;
	uint64_t max_state_bytes_per_uid; /* memory one uid's sessions hold; 0: unlimited;
	                                   * AOQD_QUOTA_AUTO: a fair share (account.h) */
	uint32_t max_connections_per_uid;
	uint32_t handshake_timeout_ms;   /* accept to Welcome (observer) or Registered */
	uint32_t replica_wait_seconds;   /* a replica group waits this long for a missing local rank */
	uint64_t max_buffered_bytes_per_uid; /* partial frames held beyond 64 KiB a connection */
	uint32_t admin_gid;       /* sees every session; (gid_t)-1 none */
	int log_level;            /* enum aoqd_log_level; the caller applies it */
	/* Snapshots (docs/snapshots.md): where, and how often (0: never). */
	const char *state_dir;    /* default $STATE_DIRECTORY (systemd), else /var/lib/aoq */
	uint64_t snapshot_every_steps;
	uint64_t snapshot_every_seconds;
};

/* Upper bound of `threads` (worker threads; 0 = every allowed core but one). */
#define AOQD_MAX_THREADS 1024u

void aoqd_config_defaults(struct aoqd_config *c);

/* percent of the machine's memory, in bytes (0 when unknown). */
uint64_t aoqd_config_mem_fraction(unsigned percent);

/* Reads "key = value" lines (# comments); errors name file:line:key. */
int aoqd_config_load(struct aoqd_config *c, const char *path);

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
