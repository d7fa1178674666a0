/* SPDX-License-Identifier: MIT */
/* The daemon's configuration (config.c): defaults, the file, the options. */
#ifndef AOQD_CONFIG_H
#define AOQD_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

struct aoqd_config {
	const char *socket_path;  /* --socket */
	int listen_fd;            /* --listen-fd, or -1 */
	unsigned threads;         /* 0: all cores but one */
	const char *kernel;       /* NULL/"auto" or a variant name */
	int lock_memory;          /* 0 no, 1 try (default), 2 required */
	uint32_t max_sessions_per_uid;
	uint32_t max_connections;
	uint32_t max_tensors;
	uint64_t max_tensor_elems;
	uint64_t max_arena_bytes;
	uint64_t max_state_bytes_per_uid; /* 0: unlimited */
	uint32_t admin_gid;       /* sees every session; (gid_t)-1 none */
};

void aoqd_config_defaults(struct aoqd_config *c);
/* Reads "key = value" lines; unknown keys are errors. */
int aoqd_config_load(struct aoqd_config *c, const char *path);

#endif
