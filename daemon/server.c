/* SPDX-License-Identifier: MIT */
/*
 * The server: the listening socket (systemd's, a given fd, or our own),
 * signals, the systemd watchdog, the worker pool and kernel, the workers'
 * wake-up.  Each new connection becomes a session (events.c).  Main
 * thread only.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "aoq-config.h"
#include "lease.h"
#include "log.h"
#include "pool.h"
#include "server.h"
#include "events.h"
#include "held.h"
#include "fdstore.h"
#include "populate.h"
#include "session.h"
#include "snapshot.h"
#include "wire.h"

#if AOQ_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

static void on_connection(uv_stream_t *listener, int status)
{
	struct aoqd_server *srv = listener->data;
	if (status < 0) {
		aoqd_warn("server", "accept: %s", uv_strerror(status));
		return;
	}
	aoqd_session_accept(srv, listener);
}

static void on_wake(uv_async_t *a)
{
	aoqd_sessions_wake(a->data);
}

/* Below this many cores the trainer shares the loop's core: the loop does
 * not spin by default, and its thread is pinned (aoqd_server_init). */
#define SHARED_LOOP_CORE_BELOW 4u

/* The loop's spin (events.c, spin_start) in ns: only when the workers are
 * pinned, so that the loop has a core of its own; "auto" (the default)
 * spins with 4 cores or more.  On 2 cores the trainer shares the loop's
 * core (the other is the worker's), and a spinning loop doubled
 * bench-spine's round trip there; on the 16-core H200 host it cut it by a
 * third.  The spin stops while tasks wait for a worker (spin_start): spinning
 * then made a 3.48 B model's CPU-bound step 29% slower (H200 host,
 * 2026-12-02, 8acd4a4; tests/bench/RESULTS.md, "Control-plane latency"). */
static uint64_t loop_spin_ns(const struct aoqd_server *srv, uint32_t us)
{
	if (!srv->pinned)
		return 0;
	if (us == AOQD_LOOP_SPIN_AUTO)
		us = srv->ncpus >= SHARED_LOOP_CORE_BELOW ? 50 : 0;
	return (uint64_t)us * 1000u;
}

static void on_sweep(uv_timer_t *t)
{
	aoqd_sessions_sweep(t->data);
}

/*
 * Every connection may hold four descriptors (the socket, the arena and two
 * doorbells): the soft RLIMIT_NOFILE goes up to what max_connections needs
 * (a service's default of 1024 made accept fail with EMFILE), or
 * max_connections comes down to what the hard limit allows.
 */
static void fit_fd_limit(struct aoqd_config *cfg)
{
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) < 0)
		return;
	rlim_t need = (rlim_t)cfg->max_connections * 4 + 64;
	if (rl.rlim_cur < need) {
		rlim_t old = rl.rlim_cur;
		rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= need ? need : rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			rl.rlim_cur = old;
	}
	if (rl.rlim_cur < need) {
		uint32_t fit = rl.rlim_cur > 64 + 4 ? (uint32_t)((rl.rlim_cur - 64) / 4) : 1;
		aoqd_warn("server", "RLIMIT_NOFILE is %llu: max_connections %u lowered to %u (raise LimitNOFILE)",
		          (unsigned long long)rl.rlim_cur, cfg->max_connections, fit);
		cfg->max_connections = fit;
	}
}

static void on_signal(uv_signal_t *h, int signum)
{
	struct aoqd_server *srv = h->data;
	if (signum == SIGHUP) {
		if (!srv->reload) {
			aoqd_info("server", "SIGHUP: nothing to reload");
			return;
		}
		aoqd_info("server", "SIGHUP: reloading the settings");
#if AOQ_HAVE_SYSTEMD
		sd_notifyf(0, "RELOADING=1\nMONOTONIC_USEC=%" PRIu64, aoqd_now_ns() / 1000);
#endif
		srv->reload(srv);
#if AOQ_HAVE_SYSTEMD
		sd_notify(0, "READY=1");
#endif
		return;
	}
	aoqd_info("server", "signal %d: stopping", signum);
	aoqd_server_stop(srv);
}

static void on_rates(uv_timer_t *t)
{
	aoqd_sessions_sample(t->data);
}

#if AOQ_HAVE_SYSTEMD
static void on_watchdog(uv_timer_t *t)
{
	sd_notify(0, "WATCHDOG=1");
}
#endif

static int make_socket_dir(const char *path)
{
	char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
	snprintf(dir, sizeof(dir), "%s", path);
	char *slash = strrchr(dir, '/');
	if (!slash || slash == dir)
		return 0;
	*slash = '\0';
	if (mkdir(dir, 0700) < 0 && errno != EEXIST)
		return -errno;
	return 0;
}

/* A socket file left by a dead daemon is removed; a live one is an error. */
static int remove_stale_socket(const char *path)
{
	struct stat st;
	if (lstat(path, &st) < 0)
		return errno == ENOENT ? 0 : -errno;
	if (!S_ISSOCK(st.st_mode))
		return -EEXIST;
	int fd = aoq_socket_connect(path);
	if (fd >= 0) {
		close(fd);
		return -EADDRINUSE;
	}
	return unlink(path) < 0 ? -errno : 0;
}

static int open_listener(struct aoqd_server *srv)
{
	uv_pipe_init(srv->loop, &srv->listener, 0);
	srv->listener.data = srv;
	int fd = srv->cfg.listen_fd;
#if AOQ_HAVE_SYSTEMD
	if (fd < 0) {
		char **names = NULL;
		int n = sd_listen_fds_with_names(1, &names);
		/* the fd store's states (fdstore.c) come with the socket */
		int sockets = 0;
		for (int i = 0; i < n; i++) {
			if (names && (aoqd_fdstore_is_state(names[i]) || aoqd_fdstore_is_masters(names[i])))
				aoqd_fdstore_keep(SD_LISTEN_FDS_START + i, names[i]);
			else if (sockets++ == 0)
				fd = SD_LISTEN_FDS_START + i;
		}
		if (sockets > 1)
			aoqd_warn("server", "%d sockets passed by systemd; using the first", sockets);
		if (fd >= 0) {
			if (sd_is_socket(fd, AF_UNIX, SOCK_STREAM, 1) <= 0) {
				aoqd_err("server", "fd %d from systemd is not a listening Unix stream socket", fd);
				fd = -2;
			}
		}
		if (names) {
			for (int i = 0; names[i]; i++)
				free(names[i]);
			free(names);
		}
		if (fd == -2)
			return -EINVAL;
	}
#endif
	int r;
	if (fd >= 0) {
		fcntl(fd, F_SETFD, FD_CLOEXEC);
		r = uv_pipe_open(&srv->listener, fd);
		if (r < 0) {
			aoqd_err("server", "listen fd %d: %s", fd, uv_strerror(r));
			return r;
		}
		aoqd_info("server", "listening on fd %d", fd);
	} else {
		const char *path = srv->cfg.socket_path;
		if ((r = make_socket_dir(path)) < 0 || (r = remove_stale_socket(path)) < 0) {
			aoqd_err("server", "socket %s: %s", path, strerror(-r));
			return r;
		}
		mode_t old = umask(0077);
		r = uv_pipe_bind(&srv->listener, path);
		umask(old);
		if (r < 0) {
			aoqd_err("server", "bind %s: %s", path, uv_strerror(r));
			return r;
		}
		srv->bound = true;
		aoqd_info("server", "listening on %s", path);
	}
	r = uv_listen((uv_stream_t *)&srv->listener, 128, on_connection);
	if (r < 0)
		aoqd_err("server", "listen: %s", uv_strerror(r));
	return r;
}

/* A client let go of a masters memfd (held.h). */
static void on_held(uv_poll_t *h, int status, int events)
{
	(void)h;
	(void)status;
	(void)events;
	aoqd_held_poll();
}

/* Restore on restart: one snapshot becomes a leased session keyed as it was. */
static int restore_one(const struct aoqd_snap_key *k, uint64_t step, struct aoqd_state *st, void *arg)
{
	struct aoqd_server *srv = arg;
	struct aoqd_error err = { 0 };
	struct aoqd_lease_key lk = { .uid = (uid_t)k->uid, .job = k->job, .rank = k->rank, .local_world = k->local_world };
	st->last_step = step;
	int64_t id = aoqd_lease_adopt(srv, &lk, st, (uint64_t)srv->cfg.lease_seconds * 1000000000u, &err);
	if (id < 0) {
		aoqd_warn("server", "snapshot of uid %u job '%s' rank %u not restored: %s", k->uid, k->job, k->rank,
		          err.msg[0] ? err.msg : strerror((int)-id));
		return id == -EDQUOT ? -EDQUOT : -1; /* restore_all frees it (and removes a file past the limits) */
	}
	free(st); /* adopt took the arrays and zeroed *st */
	struct aoqd_session *s = aoqd_session_find(srv, (uint64_t)id);
	if (s)
		aoqd_fdstore_describe(s); /* a kill keeps it too (fdstore.h) */
	aoqd_info("server", "session %" PRId64 ": uid %u job '%s' rank %u restored at step %" PRIu64
	          " from its snapshot, leased for %u s", id, k->uid, k->job, k->rank, step, srv->cfg.lease_seconds);
	return 0;
}

/* The snapshots of state_dir, offered to their trainers as leased sessions
 * (docs/snapshots.md).  Without leases nothing could resume them. */
static void restore_snapshots(struct aoqd_server *srv)
{
	const char *dir = srv->cfg.state_dir;
	if (!dir)
		return;
	if (srv->cfg.lease_seconds == 0) {
		aoqd_info("server", "lease_seconds = 0: the snapshots in %s are not restored", dir);
		return;
	}
	int n = aoqd_snapshot_restore_all(dir, srv->cfg.lock_memory, &srv->locked_bytes, restore_one, srv);
	if (n > 0)
		aoqd_info("server", "%d session(s) restored from the snapshots in %s", n, dir);
	else if (n == -ENOENT && (strcmp(dir, AOQD_STATE_DIR) != 0 || srv->cfg.snapshot_every_steps ||
	                          srv->cfg.snapshot_every_seconds))
		/* chosen by hand (or needed by periodic snapshots) and missing: say
		 * so now, not at the first snapshot; aoqd does not create it (a
		 * mistyped path would get a directory of its own) */
		aoqd_warn("server", "state_dir %s does not exist: snapshots fail until it is created", dir);
	else if (n < 0 && n != -ENOENT)
		aoqd_warn("server", "cannot read the snapshots in %s: %s", dir, strerror(-n));
}

/* States live in memfds kept in systemd's fd store when a stop can hand
 * them to the next aoqd: under systemd (NOTIFY_SOCKET), built with
 * libsystemd, with a lease (docs/design.md, "The fd store"); in private
 * mappings with transparent huge pages otherwise. */
/* Whether shmem (the arenas, and the states kept for the fd store) gets
 * transparent huge pages where aoqd asks (MADV_HUGEPAGE): the bracketed
 * word of shmem_enabled.  Unknown (no file): assumed so, nothing said. */
static bool shmem_huge(char *word, size_t len)
{
	char buf[128] = "";
	snprintf(word, len, "?");
	FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "re");
	if (!f)
		return true;
	bool got = fgets(buf, sizeof(buf), f) != NULL;
	fclose(f);
	char *b = got ? strchr(buf, '[') : NULL, *e = b ? strchr(b, ']') : NULL;
	if (!e)
		return true;
	snprintf(word, len, "%.*s", (int)(e - b - 1), b + 1);
	return strcmp(word, "never") != 0 && strcmp(word, "deny") != 0;
}

static void set_memfd(const struct aoqd_config *cfg)
{
	const char *ns = getenv("NOTIFY_SOCKET");
	bool memfd = AOQ_HAVE_SYSTEMD && ns && *ns && cfg->lease_seconds > 0;
	aoqd_state_set_memfd(memfd);
	/* said where it costs most: a restart's pause (run by hand, only an
	 * arena's first touch) */
	char word[32];
	if (memfd && !shmem_huge(word, sizeof(word)))
		aoqd_info("server", "shmem_enabled is '%s': the states kept for the fd store and the arenas run on "
		          "4 KiB pages, whose page tables cost time at both ends of a restart and at every first touch; "
		          "'advise' gives them huge pages (docs/operating.md, \"Huge pages\")", word);
}

int aoqd_server_init(struct aoqd_server *srv, uv_loop_t *loop, const struct aoqd_config *cfg)
{
	memset(srv, 0, sizeof(*srv));
	srv->cfg = *cfg;
	srv->loop = loop;
	srv->start_ns = aoqd_now_ns();
	aoqd_state_set_master_param(cfg->master_param);
	set_memfd(cfg);
	srv->kernel = aoqk_select(cfg->kernel);
	if (!srv->kernel) {
		aoqd_err("server", "kernel '%s': %s", cfg->kernel ? cfg->kernel : "auto",
		         errno == ENOTSUP ? "this CPU lacks its instructions" : "no such kernel");
		return -EINVAL;
	}
	unsigned n = cfg->threads;
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	cpu_set_t allowed;
	int cpus[1024];
	unsigned ncpus = 0;
	if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0)
		for (int i = 0; i < CPU_SETSIZE && ncpus < 1024; i++)
			if (CPU_ISSET(i, &allowed))
				cpus[ncpus++] = i;
	if (n == 0)
		n = ncpus > 1 ? ncpus - 1 : 1;
	/* Pin one worker per allowed core, skipping the first (the loop's);
	 * more workers than cores run unpinned. */
	int pins[1024];
	bool pin = ncpus > 1 && n <= ncpus - 1;
	for (unsigned i = 0; pin && i < n; i++)
		pins[i] = cpus[i + 1];
	/* pinned workers spin a while before they sleep (pool.c, spin_until_woken) */
	srv->pool = aoqd_pool_new(n, pin ? pins : NULL, pin ? (uint64_t)cfg->worker_spin_us * 1000u : 0);
	if (!srv->pool)
		return -errno;

	fit_fd_limit(&srv->cfg);
	/* The snapshot writer runs on the cores no worker is pinned to. */
	cpu_set_t spare;
	CPU_ZERO(&spare);
	for (unsigned i = 0; pin && i < ncpus; i++)
		if (i == 0 || i > n)
			CPU_SET(cpus[i], &spare);
	srv->snapshotter = aoqd_snapshotter_new(loop, pin ? &spare : NULL, srv->pool);
	if (!srv->snapshotter) {
		aoqd_err("server", "cannot start the snapshot writer: %s", strerror(errno));
		return -errno;
	}
	/* On a machine of 2 or 3 cores with pinned workers the loop thread
	 * keeps the first core (the workers and the snapshot writer, started
	 * above, have their own masks).  There the trainer shares it, and
	 * unpinned the scheduler moved the loop onto the worker's core now and
	 * then: on a 2-core VM bench-spine's p99 was above 50 us in 12 of 48
	 * runs unpinned, in 2 of 48 pinned.  On the 16-core H200 host the pinned loop
	 * was slower (p99 median 76 us against 57 in 8 alternating runs), so
	 * from 4 cores, where the loop spins instead ("auto"), it stays free
	 * (2026-12-02, 6931aa8; tests/bench/RESULTS.md, "Control-plane latency"). */
	if (pin && ncpus < SHARED_LOOP_CORE_BELOW) {
		cpu_set_t one;
		CPU_ZERO(&one);
		CPU_SET(cpus[0], &one);
		int pr = pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
		if (pr != 0)
			aoqd_warn("server", "cannot pin the loop thread to cpu %d: %s", cpus[0], strerror(pr));
	}
	uv_async_init(loop, &srv->wake, on_wake);
	srv->wake.data = srv;
	srv->pinned = pin;
	srv->ncpus = ncpus;
	srv->spin_ns = loop_spin_ns(srv, cfg->loop_spin_us);
	aoqd_info("server", "%u workers%s (%ld cpus), kernel %s, loop spin %" PRIu64 " us", n, pin ? " pinned" : "", ncpu,
	          srv->kernel->name, srv->spin_ns / 1000u);
	uv_idle_init(loop, &srv->spin);
	srv->spin.data = srv;
	uv_timer_init(loop, &srv->sweep);
	srv->sweep.data = srv;
	uint64_t every = cfg->handshake_timeout_ms / 4 + 1;
	uv_timer_start(&srv->sweep, on_sweep, every, every);
	uv_signal_init(loop, &srv->sigterm);
	uv_signal_init(loop, &srv->sigint);
	uv_signal_init(loop, &srv->sighup);
	srv->sigterm.data = srv->sigint.data = srv->sighup.data = srv;
	uv_signal_start(&srv->sigterm, on_signal, SIGTERM);
	uv_signal_start(&srv->sigint, on_signal, SIGINT);
	uv_signal_start(&srv->sighup, on_signal, SIGHUP);
	uv_timer_init(loop, &srv->rates);
	srv->rates.data = srv;
	uv_timer_start(&srv->rates, on_rates, AOQD_RATE_INTERVAL_MS, AOQD_RATE_INTERVAL_MS);
	int hfd = aoqd_held_init();
	if (hfd >= 0 && uv_poll_init(loop, &srv->held, hfd) == 0) {
		srv->held.data = srv;
		uv_poll_start(&srv->held, UV_READABLE, on_held);
		srv->held_on = true;
	}
	int r = open_listener(srv);
	if (r < 0) {
		aoqd_server_stop(srv);
		return r;
	}
	aoqd_fdstore_adopt(srv); /* before the snapshots: newer */
	restore_snapshots(srv);
#if AOQ_HAVE_SYSTEMD
	uint64_t usec = 0;
	if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) {
		uv_timer_init(loop, &srv->watchdog);
		uv_timer_start(&srv->watchdog, on_watchdog, usec / 2000, usec / 2000);
		srv->watchdog_on = true;
	}
	sd_notifyf(0, "READY=1\nSTATUS=serving, %u workers, kernel %s\nMAINPID=%d", n, srv->kernel->name, (int)getpid());
#endif
	return 0;
}

static const char *level_name(int l)
{
	static const char *const names[] = { "error", "warn", "info", "debug" };
	return l >= 0 && l <= AOQD_LOG_DEBUG ? names[l] : "?";
}

static bool same_str(const char *a, const char *b)
{
	return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

void aoqd_server_apply(struct aoqd_server *srv, const struct aoqd_config *n)
{
	struct aoqd_config *o = &srv->cfg;
	unsigned changed = 0, restart = 0;
	if (n->log_level != (int)aoqd_log_level) {
		aoqd_info("server", "reload: log_level %s -> %s", level_name((int)aoqd_log_level), level_name(n->log_level));
		aoqd_log_level = (enum aoqd_log_level)n->log_level;
		o->log_level = n->log_level;
		changed++;
	}
#define LIVE(f, fmt)                                                                                        \
	do {                                                                                                \
		if (o->f != n->f) {                                                                         \
			aoqd_info("server", "reload: " #f " %" fmt " -> %" fmt, o->f, n->f);                \
			o->f = n->f;                                                                        \
			changed++;                                                                          \
		}                                                                                           \
	} while (0)
	LIVE(max_connections, PRIu32);
	LIVE(max_sessions_per_uid, PRIu32);
	LIVE(lease_seconds, PRIu32);
	set_memfd(o); /* new sessions */
	LIVE(max_tensors, PRIu32);
	LIVE(max_tensor_elems, PRIu64);
	LIVE(max_arena_bytes, PRIu64);
	if (o->max_state_bytes_per_uid != n->max_state_bytes_per_uid) {
		char was[24], now[24];
		snprintf(was, sizeof(was), "%" PRIu64, o->max_state_bytes_per_uid);
		snprintf(now, sizeof(now), "%" PRIu64, n->max_state_bytes_per_uid);
		aoqd_info("server", "reload: max_state_bytes_per_uid %s -> %s",
		          o->max_state_bytes_per_uid == AOQD_QUOTA_AUTO ? "auto" : was,
		          n->max_state_bytes_per_uid == AOQD_QUOTA_AUTO ? "auto" : now);
		o->max_state_bytes_per_uid = n->max_state_bytes_per_uid;
		changed++;
	}
	LIVE(replica_wait_seconds, PRIu32);
	LIVE(snapshot_every_steps, PRIu64);
	LIVE(snapshot_every_seconds, PRIu64);
#undef LIVE
	if (o->master_param != n->master_param) {
		/* sessions keep what they registered with */
		aoqd_info("server", "reload: master_param %s -> %s (new sessions)", o->master_param ? "yes" : "no",
		          n->master_param ? "yes" : "no");
		o->master_param = n->master_param;
		aoqd_state_set_master_param(n->master_param);
		changed++;
	}
	if (!same_str(o->state_dir, n->state_dir)) {
		aoqd_info("server", "reload: state_dir %s -> %s", o->state_dir ? o->state_dir : "", n->state_dir ? n->state_dir : "");
		o->state_dir = n->state_dir;
		changed++;
	}
	if (o->admin_gid != n->admin_gid) {
		char a[16] = "none", b[16] = "none";
		if (o->admin_gid != (uint32_t)-1)
			snprintf(a, sizeof(a), "%" PRIu32, o->admin_gid);
		if (n->admin_gid != (uint32_t)-1)
			snprintf(b, sizeof(b), "%" PRIu32, n->admin_gid);
		aoqd_info("server", "reload: admin_gid %s -> %s", a, b);
		o->admin_gid = n->admin_gid;
		changed++;
	}
	/* The rest is built once at start. */
	if (!same_str(o->socket_path, n->socket_path) || o->listen_fd != n->listen_fd) {
		aoqd_warn("server", "reload: socket changed (%s -> %s): takes a restart; still listening on the old one",
		          o->socket_path ? o->socket_path : "a given fd", n->socket_path ? n->socket_path : "a given fd");
		restart++;
	}
	if (o->loop_spin_us != n->loop_spin_us) {
		aoqd_info("server", "reload: loop_spin_us: the loop now polls %" PRIu64 " us after a record%s",
		          loop_spin_ns(srv, n->loop_spin_us) / 1000u,
		          srv->pinned ? "" : " (0: the workers are not pinned)");
		o->loop_spin_us = n->loop_spin_us;
		srv->spin_ns = loop_spin_ns(srv, n->loop_spin_us);
		changed++;
	}
	if (o->worker_spin_us != n->worker_spin_us) {
		aoqd_warn("server", "reload: worker_spin_us %" PRIu32 " -> %" PRIu32 " takes a restart", o->worker_spin_us,
		          n->worker_spin_us);
		restart++;
	}
	if (o->threads != n->threads) {
		aoqd_warn("server", "reload: threads %u -> %u takes a restart (the pool is not resized while running)",
		          o->threads, n->threads);
		restart++;
	}
	if (!same_str(o->kernel && strcmp(o->kernel, "auto") ? o->kernel : NULL,
	              n->kernel && strcmp(n->kernel, "auto") ? n->kernel : NULL)) {
		aoqd_warn("server", "reload: kernel %s -> %s takes a restart", o->kernel ? o->kernel : "auto",
		          n->kernel ? n->kernel : "auto");
		restart++;
	}
	if (o->lock_memory != n->lock_memory) {
		aoqd_warn("server", "reload: lock_memory takes a restart");
		restart++;
	}
	aoqd_info("server", "reload: %u setting%s changed%s", changed, changed == 1 ? "" : "s",
	          restart ? "; some take a restart (above)" : "");
}

/* Closes every handle; uv_run returns once they are gone. */
void aoqd_server_stop(struct aoqd_server *srv)
{
	if (srv->stopping)
		return;
	srv->stopping = true;
#if AOQ_HAVE_SYSTEMD
	sd_notify(0, "STOPPING=1");
	if (srv->watchdog_on)
		uv_close((uv_handle_t *)&srv->watchdog, NULL);
#endif
	/* populating states is no use now, and the fd store waits for the
	 * pool to empty */
	for (struct aoqd_session *s = srv->sessions; s; s = s->next)
		aoqd_populate_stop(s);
	for (struct aoqd_session *h = srv->hubs; h; h = h->next)
		aoqd_populate_stop(h);
	/* the rollbacks of dead trainers' steps under way end (their threads
	 * hold the states), so the fd store keeps those leases, and no thread
	 * outlives the daemon */
	aoqd_leases_settle_all(srv, false);
	aoqd_fdstore_save(srv); /* a restart loses no step (fdstore.h) */
	aoqd_sessions_close_all(srv);
	aoqd_snapshotter_free(srv->snapshotter); /* finishes the snapshot being written */
	srv->snapshotter = NULL;
	if (uv_is_active((uv_handle_t *)&srv->listener) || srv->listener.loop)
		uv_close((uv_handle_t *)&srv->listener, NULL);
	uv_close((uv_handle_t *)&srv->wake, NULL);
	uv_close((uv_handle_t *)&srv->spin, NULL);
	uv_close((uv_handle_t *)&srv->sweep, NULL);
	uv_close((uv_handle_t *)&srv->rates, NULL);
	if (srv->held_on)
		uv_close((uv_handle_t *)&srv->held, NULL);
	srv->held_on = false;
	uv_close((uv_handle_t *)&srv->sigterm, NULL);
	uv_close((uv_handle_t *)&srv->sigint, NULL);
	uv_close((uv_handle_t *)&srv->sighup, NULL);
}

void aoqd_server_fini(struct aoqd_server *srv)
{
	aoqd_pool_free(srv->pool);
	srv->pool = NULL;
	aoqd_release_wait(); /* no thread outlives the daemon */
	aoqd_account_free_all(&srv->accounts);
	aoqd_fdstore_barrier(); /* the store's removals read before we exit */
	/* Only our own socket: a failed bind may have met a live daemon's. */
	if (srv->bound)
		unlink(srv->cfg.socket_path);
}
