/* SPDX-License-Identifier: MIT */
/* Daemon configuration: defaults and the "key = value" file. */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "log.h"

void aoqd_config_defaults(struct aoqd_config *c)
{
	memset(c, 0, sizeof(*c));
	c->listen_fd = -1;
	c->lock_memory = 1;
	c->max_sessions_per_uid = 64;
	c->max_connections = 1024;
	c->max_tensors = 1u << 20;
	c->max_tensor_elems = 1ull << 36;
	c->max_arena_bytes = 1ull << 40;
	c->admin_gid = (uint32_t)-1;
	/* One uid cannot ask for more state than the machine has memory. */
	long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
	c->max_state_bytes_per_uid = pages > 0 && psize > 0 ? (uint64_t)pages * (uint64_t)psize : 0;
}

static char *trim(char *s)
{
	while (isspace((unsigned char)*s))
		s++;
	char *e = s + strlen(s);
	while (e > s && isspace((unsigned char)e[-1]))
		*--e = '\0';
	return s;
}

static int parse_u64(const char *v, uint64_t *out)
{
	char *end;
	errno = 0;
	unsigned long long x = strtoull(v, &end, 0);
	if (errno || end == v)
		return -EINVAL;
	end = trim(end);
	uint64_t mul = 1;
	if (*end == 'K' || *end == 'k')
		mul = 1ull << 10, end++;
	else if (*end == 'M')
		mul = 1ull << 20, end++;
	else if (*end == 'G')
		mul = 1ull << 30, end++;
	else if (*end == 'T')
		mul = 1ull << 40, end++;
	if (*end)
		return -EINVAL;
	if (__builtin_mul_overflow((uint64_t)x, mul, out))
		return -ERANGE;
	return 0;
}

/* Only the last occurrence of a string option is kept (leaked on purpose:
 * the config lives as long as the daemon). */
int aoqd_config_load(struct aoqd_config *c, const char *path)
{
	FILE *f = fopen(path, "r");
	if (!f) {
		aoqd_err("config", "%s: %s", path, strerror(errno));
		return -errno;
	}
	char line[512];
	int lineno = 0, r = 0;
	while (fgets(line, sizeof(line), f)) {
		lineno++;
		char *s = trim(line);
		if (!*s || *s == '#')
			continue;
		char *eq = strchr(s, '=');
		if (!eq) {
			aoqd_err("config", "%s:%d: expected key = value", path, lineno);
			r = -EINVAL;
			break;
		}
		*eq = '\0';
		char *k = trim(s), *v = trim(eq + 1);
		uint64_t x = 0;
		bool num = parse_u64(v, &x) == 0;
		if (strcmp(k, "socket") == 0)
			c->socket_path = strdup(v);
		else if (strcmp(k, "threads") == 0 && num)
			c->threads = (unsigned)x;
		else if (strcmp(k, "kernel") == 0)
			c->kernel = strdup(v);
		else if (strcmp(k, "lock_memory") == 0)
			c->lock_memory = strcmp(v, "no") == 0 ? 0 : strcmp(v, "yes") == 0 ? 2 : 1;
		else if (strcmp(k, "max_sessions_per_uid") == 0 && num)
			c->max_sessions_per_uid = (uint32_t)x;
		else if (strcmp(k, "max_connections") == 0 && num)
			c->max_connections = (uint32_t)x;
		else if (strcmp(k, "max_tensors") == 0 && num)
			c->max_tensors = (uint32_t)x;
		else if (strcmp(k, "max_tensor_elems") == 0 && num)
			c->max_tensor_elems = x;
		else if (strcmp(k, "max_arena_bytes") == 0 && num)
			c->max_arena_bytes = x;
		else if (strcmp(k, "max_state_bytes_per_uid") == 0 && num)
			c->max_state_bytes_per_uid = x;
		else if (strcmp(k, "admin_gid") == 0 && num)
			c->admin_gid = (uint32_t)x;
		else if (strcmp(k, "log_level") == 0 && aoqd_log_parse_level(v) >= 0)
			aoqd_log_level = (enum aoqd_log_level)aoqd_log_parse_level(v);
		else {
			aoqd_err("config", "%s:%d: unknown key or bad value: %s = %s", path, lineno, k, v);
			r = -EINVAL;
			break;
		}
	}
	fclose(f);
	return r;
}
