/* SPDX-License-Identifier: MIT */
/*
 * The server (server.c): the libuv loop's listener, signals, watchdog, the
 * worker pool, the kernel, the workers' wake-up.  Main thread only.
 */
#ifndef AOQD_SERVER_H
#define AOQD_SERVER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "account.h"
#include "aoq-kernel.h"
#include "config.h"
#include "pool.h"

struct aoqd_session;
struct aoqd_snapshotter;

struct aoqd_server {
	struct aoqd_config cfg;
	uv_loop_t *loop;
	uv_pipe_t listener;
	uv_async_t wake;          /* workers -> loop: a step may have finished */
	/* While active the loop does not sleep and polls the rings of the
	 * sessions that spin (events.c, aoqd_sessions_spin) until spin_until. */
	uv_idle_t spin;
	uint64_t spin_ns;         /* loop_spin_us, when workers are pinned (else 0) */
	unsigned ncpus;           /* cores we may run on */
	uint64_t spin_until;
	/* For Stats (loop thread): when the spin began, the time spun before,
	 * the polls that took records (doorbells the trainers did not ring),
	 * and the doorbells after which the loop did not spin because tasks
	 * were waiting for a worker. */
	uint64_t spin_since, spin_total_ns, spin_takes, spin_busy;
	bool pinned;              /* the loop has a core of its own */
	uv_signal_t sigterm, sigint, sighup;
	uv_timer_t watchdog;
	uv_timer_t rates;         /* ends each session's rate interval */
	bool watchdog_on;
	uv_timer_t sweep;         /* handshake deadlines */
	uv_poll_t held;           /* memory clients keep after their session (held.h) */
	bool held_on;
	struct aoqd_pool *pool;
	const struct aoqk_kernel *kernel;
	struct aoqd_snapshotter *snapshotter; /* the snapshot writer thread */
	/* Sessions (session.c, the list; the session files walk it). */
	struct aoqd_session *sessions;
	struct aoqd_session *hubs; /* replica groups' hubs (replica.c), linked by `next` */
	uint64_t next_id;
	uint32_t connections;
	struct aoqd_account *_Atomic accounts; /* one per uid seen (events.c, lease.c charge them) */
	uint64_t start_ns;
	_Atomic uint64_t locked_bytes;
	/* SIGHUP: builds the settings again and hands them to
	 * aoqd_server_apply (main.c's; NULL: SIGHUP is only logged). */
	void (*reload)(struct aoqd_server *srv);
	bool stopping;
	bool bound;               /* we created the socket file (unlinked at exit) */
	int exit_code;
};

int aoqd_server_init(struct aoqd_server *srv, uv_loop_t *loop, const struct aoqd_config *cfg);
void aoqd_server_stop(struct aoqd_server *srv);
/*
 * Applies new settings while running: the log level, the limits and quotas
 * (each checked at the next request that meets it; sessions keep what they
 * were given) and admin_gid.  Logs every change, and each setting that
 * differs but takes a restart (socket, listen fd, threads, kernel,
 * lock_memory), which keeps its old value.
 */
void aoqd_server_apply(struct aoqd_server *srv, const struct aoqd_config *cfg);
void aoqd_server_fini(struct aoqd_server *srv);

#endif
