/* SPDX-License-Identifier: MIT */
/*
 * Daemon configuration: defaults, one table of keys, the "key = value" file.
 *
 * Every key is parsed strictly: whole numbers with overflow checks and a
 * range, words from a fixed list, strings non-empty.  An error names the key
 * (and, in a file, the path and line); "unknown key" and "bad value" are
 * different errors.
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "account.h"
#include "aoq-kernel.h"
#include "config.h"
#include "log.h"

#define SUN_PATH_MAX (sizeof(((struct sockaddr_un *)0)->sun_path) - 1)

void aoqd_config_defaults(struct aoqd_config *c)
{
	memset(c, 0, sizeof(*c));
	c->listen_fd = -1;
	c->lock_memory = 1;
	c->master_param = true;
	c->max_sessions_per_uid = 64;
	c->lease_seconds = 600;
	c->worker_spin_us = 50;
	/* auto: 50 us with 4 cores or more; the loop does not spin over a
	 * backlog (events.c, spin_start), so a CPU-bound update keeps the
	 * trainer's core; README, "Configuration" */
	c->loop_spin_us = AOQD_LOOP_SPIN_AUTO;
	c->max_connections = 1024;
	c->max_tensors = 1u << 20;
	c->max_tensor_elems = 1ull << 36;
	c->max_arena_bytes = 1ull << 40;
	c->admin_gid = (uint32_t)-1;
	c->log_level = AOQD_LOG_INFO;
	c->max_connections_per_uid = 128;
	c->handshake_timeout_ms = 30000;
	c->replica_wait_seconds = 60;
	c->max_buffered_bytes_per_uid = 16ull << 20;
	/* One uid holds at most half the machine's memory. */
	c->max_state_bytes_per_uid = AOQD_QUOTA_AUTO;
	/* systemd's StateDirectory= (a list: the first) */
	static char sd[3001];
	const char *e = getenv("STATE_DIRECTORY");
	if (e && e[0] == '/' && strcspn(e, ":") < sizeof(sd)) {
		memcpy(sd, e, strcspn(e, ":"));
		sd[strcspn(e, ":")] = 0;
		c->state_dir = sd;
	} else {
		c->state_dir = AOQD_STATE_DIR;
	}
}

uint64_t aoqd_config_mem_fraction(unsigned percent)
{
	long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
	if (pages <= 0 || psize <= 0)
		return 0;
	return (uint64_t)pages / 100 * percent * (uint64_t)psize;
}

int aoqd_parse_u64(const char *s, int allow_suffix, uint64_t *out)
{
	/* strtoull accepts leading blanks and a sign ("-1" wraps): refuse them. */
	if (!isdigit((unsigned char)*s))
		return -EINVAL;
	/* Decimal, or hex after 0x; never octal ("010" is ten). */
	int base = 10;
	if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
		base = 16;
		s += 2;
		if (!isxdigit((unsigned char)*s))
			return -EINVAL;
	}
	char *end;
	errno = 0;
	unsigned long long x = strtoull(s, &end, base);
	if (errno == ERANGE)
		return -ERANGE;
	if (errno || end == s)
		return -EINVAL;
	uint64_t mul = 1;
	if (allow_suffix && *end && !end[1]) {
		switch (*end) {
		case 'K': case 'k': mul = 1ull << 10; end++; break;
		case 'M': mul = 1ull << 20; end++; break;
		case 'G': mul = 1ull << 30; end++; break;
		case 'T': mul = 1ull << 40; end++; break;
		default: break;
		}
	}
	if (*end)
		return -EINVAL;
	if (__builtin_mul_overflow((uint64_t)x, mul, out))
		return -ERANGE;
	return 0;
}

enum key_kind { K_STRING, K_PATH, K_COUNT, K_SIZE, K_MEMSIZE, K_LOCK, K_LOG, K_KERNEL, K_GID, K_BOOL };

struct key {
	const char *name;
	enum key_kind kind;
	size_t off;       /* in struct aoqd_config */
	size_t width;     /* 4 or 8 bytes, numbers only */
	uint64_t lo, hi;  /* numbers only */
};

#define OFF(f) offsetof(struct aoqd_config, f)
#define W(f) sizeof(((struct aoqd_config *)0)->f)
static const struct key keys[] = {
	{ "socket", K_STRING, OFF(socket_path), 0, 0, 0 },
	{ "threads", K_COUNT, OFF(threads), W(threads), 0, AOQD_MAX_THREADS },
	{ "worker_spin_us", K_COUNT, OFF(worker_spin_us), W(worker_spin_us), 0, 10000 },
	{ "loop_spin_us", K_COUNT, OFF(loop_spin_us), W(loop_spin_us), 0, 10000 },
	{ "kernel", K_KERNEL, OFF(kernel), 0, 0, 0 },
	{ "lock_memory", K_LOCK, OFF(lock_memory), 0, 0, 0 },
	{ "master_param", K_BOOL, OFF(master_param), 0, 0, 0 },
	{ "log_level", K_LOG, 0, 0, 0, 0 },
	{ "max_connections", K_COUNT, OFF(max_connections), W(max_connections), 1, 1u << 20 },
	{ "max_sessions_per_uid", K_COUNT, OFF(max_sessions_per_uid), W(max_sessions_per_uid), 1, 1u << 20 },
	{ "max_tensors", K_COUNT, OFF(max_tensors), W(max_tensors), 1, UINT32_MAX },
	{ "max_tensor_elems", K_SIZE, OFF(max_tensor_elems), W(max_tensor_elems), 1, 1ull << 48 },
	{ "max_arena_bytes", K_SIZE, OFF(max_arena_bytes), W(max_arena_bytes), 1ull << 16, 1ull << 52 },
	{ "max_state_bytes_per_uid", K_MEMSIZE, OFF(max_state_bytes_per_uid), W(max_state_bytes_per_uid), 0,
	  AOQD_QUOTA_AUTO - 1 },
	{ "max_connections_per_uid", K_COUNT, OFF(max_connections_per_uid), W(max_connections_per_uid), 1, 1u << 20 },
	{ "handshake_timeout_ms", K_COUNT, OFF(handshake_timeout_ms), W(handshake_timeout_ms), 100, 3600000 },
	{ "replica_wait_seconds", K_COUNT, OFF(replica_wait_seconds), W(replica_wait_seconds), 1, 86400 },
	{ "max_buffered_bytes_per_uid", K_SIZE, OFF(max_buffered_bytes_per_uid), W(max_buffered_bytes_per_uid),
	  1ull << 20, 1ull << 40 },
	{ "lease_seconds", K_COUNT, OFF(lease_seconds), W(lease_seconds), 0, 7u * 86400 },
	{ "admin_gid", K_GID, OFF(admin_gid), W(admin_gid), 0, UINT32_MAX - 1 },
	{ "state_dir", K_PATH, OFF(state_dir), 0, 0, 0 },
	{ "snapshot_every_steps", K_COUNT, OFF(snapshot_every_steps), W(snapshot_every_steps), 0, 1ull << 62 },
	{ "snapshot_every_seconds", K_COUNT, OFF(snapshot_every_seconds), W(snapshot_every_seconds), 0, 1ull << 40 },
};

/* The counts that also take "auto", and the value it stores. */
static const struct {
	const char *key;
	uint64_t value;
} autos[] = { { "threads", 0 }, { "loop_spin_us", AOQD_LOOP_SPIN_AUTO } };

static const uint64_t *auto_value(const struct key *k)
{
	for (size_t i = 0; i < sizeof(autos) / sizeof(autos[0]); i++)
		if (strcmp(k->name, autos[i].key) == 0)
			return &autos[i].value;
	return NULL;
}

/* Every string value ever set. */
struct owned {
	struct owned *next;
	char s[];
};
static struct owned *owned;

static const char *const lock_words[] = { "no", "try", "yes" };
static const char *const bool_words[] = { "no", "yes" };
static const char *const kernel_words[] = { "auto", "scalar", "avx2", "avx512", "avx512bf16" };

static int word_index(const char *v, const char *const *words, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (strcmp(v, words[i]) == 0)
			return (int)i;
	return -1;
}

static int set_number(struct aoqd_config *c, const struct key *k, const char *v, char *err, size_t errlen)
{
	uint64_t x;
	bool size = k->kind == K_SIZE || k->kind == K_MEMSIZE;
	int r = aoqd_parse_u64(v, size, &x);
	if (r == -EINVAL) {
		snprintf(err, errlen, "'%s' is not a whole number%s", v,
		         size ? (k->kind == K_MEMSIZE ? " (optionally with a K, M, G or T suffix), N% of the memory or auto"
		                                      : " (optionally with a K, M, G or T suffix)")
		              : auto_value(k) ? " or auto" : "");
		return r;
	}
	if (r == -ERANGE || x < k->lo || x > k->hi) {
		snprintf(err, errlen, "%s is out of range (%" PRIu64 "..%" PRIu64 ")", v, k->lo, k->hi);
		return -ERANGE;
	}
	void *p = (char *)c + k->off;
	if (k->width == 4) {
		uint32_t x32 = (uint32_t)x;
		memcpy(p, &x32, 4);
	} else {
		memcpy(p, &x, 8);
	}
	return 0;
}

static void list_words(char *buf, size_t len, const char *const *words, size_t n)
{
	size_t o = 0;
	buf[0] = '\0';
	for (size_t i = 0; i < n && o < len; i++) {
		int w = snprintf(buf + o, len - o, "%s%s", i ? (i + 1 == n ? " or " : ", ") : "", words[i]);
		if (w < 0)
			break;
		o += (size_t)w;
	}
}

/* Edit distance of a and b, letters compared without case; keys are short
 * (anything past 63 bytes counts as different). */
static unsigned edit_distance(const char *a, const char *b)
{
	size_t la = strlen(a), lb = strlen(b);
	if (la > 63 || lb > 63)
		return UINT32_MAX;
	unsigned row[64];
	for (size_t j = 0; j <= lb; j++)
		row[j] = (unsigned)j;
	for (size_t i = 1; i <= la; i++) {
		unsigned diag = row[0];
		row[0] = (unsigned)i;
		for (size_t j = 1; j <= lb; j++) {
			unsigned up = row[j];
			unsigned sub = diag + (tolower((unsigned char)a[i - 1]) != tolower((unsigned char)b[j - 1]));
			unsigned best = up + 1 < row[j - 1] + 1 ? up + 1 : row[j - 1] + 1;
			row[j] = sub < best ? sub : best;
			diag = up;
		}
	}
	return row[lb];
}

/* The key an unknown one was most likely meant to be: the nearest within 3
 * edits (and fewer than its own length), or NULL. */
static const char *nearest_key(const char *key)
{
	const char *best = NULL;
	unsigned bd = 4;
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		unsigned d = edit_distance(key, keys[i].name);
		if (d < bd && d < strlen(key)) {
			bd = d;
			best = keys[i].name;
		}
	}
	return best;
}

int aoqd_config_set(struct aoqd_config *c, const char *key, const char *v, char *err, size_t errlen)
{
	const struct key *k = NULL;
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
		if (strcmp(key, keys[i].name) == 0)
			k = &keys[i];
	if (!k) {
		const char *near = nearest_key(key);
		if (near)
			snprintf(err, errlen, "unknown key '%s' (did you mean '%s'?)", key, near);
		else
			snprintf(err, errlen, "unknown key '%s'", key);
		return -ENOENT;
	}
	if (!*v) {
		snprintf(err, errlen, "needs a value");
		return -EINVAL;
	}
	char words[128];
	int i;
	switch (k->kind) {
	case K_MEMSIZE: {
		/* A size, "N%" of the machine's memory (1..100), or auto (a
		 * fair share: account.h). */
		size_t n = strlen(v);
		if (strcmp(v, "auto") == 0) {
			uint64_t x = AOQD_QUOTA_AUTO;
			memcpy((char *)c + k->off, &x, 8);
			return 0;
		}
		if (n > 1 && v[n - 1] == '%') {
			char num[16];
			uint64_t pct;
			if (n - 1 >= sizeof(num)) {
				snprintf(err, errlen, "'%s' is not a share of memory (1%%..100%%)", v);
				return -EINVAL;
			}
			memcpy(num, v, n - 1);
			num[n - 1] = '\0';
			if (aoqd_parse_u64(num, 0, &pct) < 0 || pct < 1 || pct > 100) {
				snprintf(err, errlen, "'%s' is not a share of memory (1%%..100%%)", v);
				return -ERANGE;
			}
			uint64_t x = aoqd_config_mem_fraction((unsigned)pct);
			memcpy((char *)c + k->off, &x, 8);
			return 0;
		}
		return set_number(c, k, v, err, errlen);
	}
	case K_COUNT:
	case K_SIZE:
		if (auto_value(k) && strcmp(v, "auto") == 0) {
			uint64_t x = *auto_value(k);
			uint32_t x4 = (uint32_t)x;
			memcpy((char *)c + k->off, k->width == 8 ? (const void *)&x : (const void *)&x4, k->width);
			return 0;
		}
		return set_number(c, k, v, err, errlen);
	case K_GID: {
		if (isdigit((unsigned char)*v))
			return set_number(c, k, v, err, errlen);
		if (strcmp(v, "none") == 0) {
			c->admin_gid = (uint32_t)-1;
			return 0;
		}
		struct group *g = getgrnam(v);
		if (!g) {
			snprintf(err, errlen, "'%s' is neither a gid nor a known group name", v);
			return -EINVAL;
		}
		c->admin_gid = (uint32_t)g->gr_gid;
		return 0;
	}
	case K_LOCK:
		if ((i = word_index(v, lock_words, 3)) < 0) {
			list_words(words, sizeof(words), lock_words, 3);
			snprintf(err, errlen, "'%s' is not one of %s", v, words);
			return -EINVAL;
		}
		c->lock_memory = i == 0 ? 0 : i == 1 ? 1 : 2;
		return 0;
	case K_BOOL:
		if ((i = word_index(v, bool_words, 2)) < 0) {
			list_words(words, sizeof(words), bool_words, 2);
			snprintf(err, errlen, "'%s' is not one of %s", v, words);
			return -EINVAL;
		}
		*(bool *)(void *)((char *)c + k->off) = i == 1;
		return 0;
	case K_LOG:
		if ((i = aoqd_log_parse_level(v)) < 0) {
			snprintf(err, errlen, "'%s' is not one of error, warn, info or debug", v);
			return -EINVAL;
		}
		c->log_level = i;
		return 0;
	case K_KERNEL:
		if (word_index(v, kernel_words, 5) < 0) {
			list_words(words, sizeof(words), kernel_words, 5);
			snprintf(err, errlen, "'%s' is not one of %s", v, words);
			return -EINVAL;
		}
		break;
	case K_PATH:
		if (v[0] != '/' || strlen(v) > 3000) {
			snprintf(err, errlen, "'%s' is not an absolute path of at most 3000 bytes", v);
			return -EINVAL;
		}
		break;
	case K_STRING:
		if (strlen(v) > SUN_PATH_MAX) {
			snprintf(err, errlen, "socket path is %zu bytes; a Unix socket path has at most %zu",
			         strlen(v), SUN_PATH_MAX);
			return -ENAMETOOLONG;
		}
		break;
	}
	/* Strings: a copy that lives as long as the daemon (an older value of
	 * the same key may still be referenced, so none is freed); the list
	 * keeps them reachable. */
	size_t n = strlen(v);
	struct owned *o = malloc(sizeof(*o) + n + 1);
	if (!o) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	memcpy(o->s, v, n + 1);
	o->next = owned;
	owned = o;
	char *copy = o->s;
	memcpy((char *)c + k->off, &copy, sizeof(copy));
	return 0;
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

/* A '#' at the start of a line or after a blank starts a comment, so
 * "threads = 4  # the rest for the trainer" works and "a#b" stays a value. */
static void strip_comment(char *s)
{
	for (char *p = s; *p; p++)
		if (*p == '#' && (p == s || isspace((unsigned char)p[-1]))) {
			*p = '\0';
			return;
		}
}

/* The config file is a regular file of at most this many bytes: a FIFO,
 * a device (/dev/zero), a symbolic link or a huge file is refused before
 * a byte is read (it is read on the loop thread at SIGHUP). */
#define CONFIG_MAX_BYTES (1u << 20)

int aoqd_config_load(struct aoqd_config *c, const char *path)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
	struct stat sb;
	int e = 0;
	if (fd < 0)
		e = errno;
	else if (fstat(fd, &sb) < 0)
		e = errno;
	if (e) {
		if (fd >= 0)
			close(fd);
		aoqd_err("config", "cannot read %s: %s", path,
		         e == ELOOP ? "a symbolic link (give the file itself)" : strerror(e));
		return -e;
	}
	if (!S_ISREG(sb.st_mode) || sb.st_size > CONFIG_MAX_BYTES) {
		close(fd);
		aoqd_err("config", "cannot read %s: %s", path,
		         !S_ISREG(sb.st_mode) ? "not a regular file" : "larger than 1 MiB");
		return -EINVAL;
	}
	FILE *f = fdopen(fd, "r");
	if (!f) {
		e = errno;
		close(fd);
		aoqd_err("config", "cannot read %s: %s", path, strerror(e));
		return -e;
	}
	char line[4096], err[256];
	int lineno = 0, r = 0;
	while (fgets(line, sizeof(line), f)) {
		lineno++;
		size_t len = strlen(line);
		if (len == sizeof(line) - 1 && line[len - 1] != '\n' && !feof(f)) {
			aoqd_err("config", "%s:%d: line longer than %zu bytes", path, lineno, sizeof(line) - 2);
			r = -EINVAL;
			break;
		}
		strip_comment(line);
		char *s = trim(line);
		if (!*s)
			continue;
		char *eq = strchr(s, '=');
		if (!eq) {
			aoqd_err("config", "%s:%d: expected 'key = value', got '%s'", path, lineno, s);
			r = -EINVAL;
			break;
		}
		*eq = '\0';
		char *k = trim(s), *v = trim(eq + 1);
		if (!*k) {
			aoqd_err("config", "%s:%d: a value without a key", path, lineno);
			r = -EINVAL;
			break;
		}
		r = aoqd_config_set(c, k, v, err, sizeof(err));
		if (r == -ENOENT) {
			aoqd_err("config", "%s:%d: %s", path, lineno, err);
			break;
		}
		if (r < 0) {
			aoqd_err("config", "%s:%d: %s: %s", path, lineno, k, err);
			break;
		}
	}
	if (r == 0 && ferror(f)) {
		aoqd_err("config", "%s: read error", path);
		r = -EIO;
	}
	fclose(f);
	return r;
}

int aoqd_config_check(const struct aoqd_config *c, char *err, size_t errlen)
{
	if (c->socket_path && strlen(c->socket_path) > SUN_PATH_MAX) {
		snprintf(err, errlen, "socket path %s is %zu bytes; a Unix socket path has at most %zu",
		         c->socket_path, strlen(c->socket_path), SUN_PATH_MAX);
		return -ENAMETOOLONG;
	}
	if (c->socket_path && !*c->socket_path) {
		snprintf(err, errlen, "the socket path is empty");
		return -EINVAL;
	}
	if (!aoqk_select(c->kernel)) {
		int e = errno;
		snprintf(err, errlen, "kernel '%s': %s", c->kernel ? c->kernel : "auto",
		         e == ENOTSUP ? "this CPU (or this build) lacks its instructions" : "no such kernel");
		return -EINVAL;
	}
	if (c->listen_fd >= 0) {
		int type = 0;
		socklen_t tl = sizeof(type);
		struct sockaddr_storage sa;
		socklen_t sl = sizeof(sa);
		if (fcntl(c->listen_fd, F_GETFD) < 0) {
			snprintf(err, errlen, "listen fd %d is not open", c->listen_fd);
			return -EBADF;
		}
		if (getsockopt(c->listen_fd, SOL_SOCKET, SO_TYPE, &type, &tl) < 0 || type != SOCK_STREAM ||
		    getsockname(c->listen_fd, (struct sockaddr *)&sa, &sl) < 0 || sa.ss_family != AF_UNIX) {
			snprintf(err, errlen, "listen fd %d is not a Unix stream socket", c->listen_fd);
			return -ENOTSOCK;
		}
	}
	return 0;
}

void aoqd_config_print(const struct aoqd_config *c, FILE *f)
{
	static const char *const levels[] = { "error", "warn", "info", "debug" };
	if (c->listen_fd >= 0)
		fprintf(f, "# listen fd %d\n", c->listen_fd);
	if (c->socket_path)
		fprintf(f, "socket = %s\n", c->socket_path);
	if (c->threads)
		fprintf(f, "threads = %u\n", c->threads);
	else
		fprintf(f, "threads = auto\n");
	fprintf(f, "worker_spin_us = %" PRIu32 "\n", c->worker_spin_us);
	if (c->loop_spin_us == AOQD_LOOP_SPIN_AUTO)
		fprintf(f, "loop_spin_us = auto\n");
	else
		fprintf(f, "loop_spin_us = %" PRIu32 "\n", c->loop_spin_us);
	fprintf(f, "kernel = %s\n", c->kernel && *c->kernel ? c->kernel : "auto");
	fprintf(f, "lock_memory = %s\n", c->lock_memory == 0 ? "no" : c->lock_memory == 2 ? "yes" : "try");
	fprintf(f, "master_param = %s\n", c->master_param ? "yes" : "no");
	fprintf(f, "log_level = %s\n", levels[c->log_level >= 0 && c->log_level <= AOQD_LOG_DEBUG ? c->log_level : AOQD_LOG_INFO]);
	fprintf(f, "max_connections = %" PRIu32 "\n", c->max_connections);
	fprintf(f, "max_sessions_per_uid = %" PRIu32 "\n", c->max_sessions_per_uid);
	fprintf(f, "lease_seconds = %" PRIu32 "\n", c->lease_seconds);
	fprintf(f, "max_tensors = %" PRIu32 "\n", c->max_tensors);
	fprintf(f, "max_tensor_elems = %" PRIu64 "\n", c->max_tensor_elems);
	fprintf(f, "max_arena_bytes = %" PRIu64 "\n", c->max_arena_bytes);
	if (c->max_state_bytes_per_uid == AOQD_QUOTA_AUTO)
		fprintf(f, "max_state_bytes_per_uid = auto\n");
	else
		fprintf(f, "max_state_bytes_per_uid = %" PRIu64 "\n", c->max_state_bytes_per_uid);
	fprintf(f, "max_connections_per_uid = %" PRIu32 "\n", c->max_connections_per_uid);
	fprintf(f, "handshake_timeout_ms = %" PRIu32 "\n", c->handshake_timeout_ms);
	fprintf(f, "replica_wait_seconds = %" PRIu32 "\n", c->replica_wait_seconds);
	fprintf(f, "max_buffered_bytes_per_uid = %" PRIu64 "\n", c->max_buffered_bytes_per_uid);
	if (c->admin_gid == (uint32_t)-1)
		fprintf(f, "admin_gid = none\n");
	else
		fprintf(f, "admin_gid = %" PRIu32 "\n", c->admin_gid);
	fprintf(f, "state_dir = %s\n", c->state_dir ? c->state_dir : "");
	fprintf(f, "snapshot_every_steps = %" PRIu64 "\n", c->snapshot_every_steps);
	fprintf(f, "snapshot_every_seconds = %" PRIu64 "\n", c->snapshot_every_seconds);
}
