/* SPDX-License-Identifier: MIT */
/*
 * An aoqd inside the fuzzer's process: see fuzz-daemon.h.
 *
 * The daemon is aoqd-core itself (server.c, events.c and everything below
 * it), started once with one worker thread and small limits so that an
 * input cannot make it allocate much.  The loop runs only inside these
 * helpers, on the fuzzer's thread, so the loop thread is the fuzzer's.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "fuzz-daemon.h"
#include "log.h"
#include "server.h"
#include "session.h"
#include "wire.h"

/* Wall time an input may take to settle or to close before the harness
 * calls it a hang (a daemon that spins or never frees a session). */
#define SETTLE_LIMIT_S 10.0

static uv_loop_t loop;
static struct aoqd_server srv;
static char sock_path[108];
static bool started;

static void die(const char *what)
{
	fprintf(stderr, "fuzz-daemon: %s: %s\n", what, strerror(errno));
	abort();
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void start(void)
{
	static char dir[] = "/tmp/aoq-fuzz.XXXXXX";
	signal(SIGPIPE, SIG_IGN);
	if (!mkdtemp(dir))
		die("mkdtemp");
	snprintf(sock_path, sizeof(sock_path), "%s/aoqd.sock", dir);
	aoqd_log_level = AOQD_LOG_ERROR;
	struct aoqd_config cfg;
	aoqd_config_defaults(&cfg);
	cfg.socket_path = sock_path;
	cfg.listen_fd = -1;
	cfg.threads = 1;
	cfg.lock_memory = 0;
	cfg.log_level = AOQD_LOG_ERROR;
	/* Small limits: an input cannot ask for much memory. */
	cfg.max_tensors = 64;
	cfg.max_tensor_elems = 1u << 16;
	cfg.max_arena_bytes = 8u << 20;
	cfg.max_state_bytes_per_uid = 64u << 20;
	/* Every input's session must be freed when it closes (the check
	 * below): no leases (the faults suite covers them).  Snapshots an
	 * input asks for go to this run's own directory. */
	cfg.lease_seconds = 0;
	static char state_dir[sizeof(dir) + 8];
	snprintf(state_dir, sizeof(state_dir), "%s/state", dir);
	cfg.state_dir = state_dir;
	if (uv_loop_init(&loop) < 0)
		die("uv_loop_init");
	if (aoqd_server_init(&srv, &loop, &cfg) < 0)
		die("aoqd_server_init");
	/* The fuzzer keeps its own SIGINT/SIGTERM handling. */
	uv_signal_stop(&srv.sigterm);
	uv_signal_stop(&srv.sigint);
	uv_signal_stop(&srv.sighup);
	/* The socket file goes when the fuzzer exits. */
	started = true;
}

static int daemon_fd(const struct fz_client *c)
{
	uv_os_fd_t fd = -1;
	if (c->s->conn.handle_live && uv_fileno((const uv_handle_t *)&c->s->conn.pipe, &fd) < 0)
		fd = -1;
	return c->s->conn.handle_live ? fd : -1;
}

void fz_connect(struct fz_client *c)
{
	if (!started)
		start();
	memset(c, 0, sizeof(*c));
	c->arena_fd = c->bell_out = c->bell_in = -1;
	c->sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (c->sock < 0)
		die("socket");
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	memcpy(a.sun_path, sock_path, strlen(sock_path) + 1);
	if (connect(c->sock, (struct sockaddr *)&a, sizeof(a)) < 0)
		die("connect");
	fcntl(c->sock, F_SETFL, O_NONBLOCK);
	struct aoqd_session *before = srv.sessions;
	double t0 = now_s();
	while (srv.sessions == before) {
		uv_run(&loop, UV_RUN_NOWAIT);
		if (now_s() - t0 > SETTLE_LIMIT_S) {
			fprintf(stderr, "fuzz-daemon: the daemon did not accept the connection\n");
			abort();
		}
	}
	c->s = srv.sessions;
	aoqd_session_ref(c->s);
}

bool fz_alive(const struct fz_client *c)
{
	return c->s->state != AOQD_CLOSING;
}

/* A client checks the arena it maps like libaoq does. */
static void map_arena(struct fz_client *c, int *fds)
{
	struct stat st;
	if (fstat(fds[0], &st) < 0 || (uint64_t)st.st_size < sizeof(struct aoq_arena_header)) {
		fprintf(stderr, "fuzz-daemon: the arena's size is wrong\n");
		abort();
	}
	void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	if (p == MAP_FAILED)
		die("mmap");
	c->base = p;
	c->size = (uint64_t)st.st_size;
	memcpy(&c->h, c->base, sizeof(c->h));
	if (aoq_arena_header_check(&c->h, c->size) < 0) {
		/* The daemon built an arena that breaks its own rules. */
		fprintf(stderr, "fuzz-daemon: the daemon's arena fails aoq_arena_header_check\n");
		abort();
	}
	c->arena_fd = fds[0];
	c->bell_out = fds[1];
	c->bell_in = fds[2];
	c->to_daemon = (struct aoq_ring *)(c->base + c->h.to_daemon_off);
	c->to_client = (struct aoq_ring *)(c->base + c->h.to_client_off);
	c->head = c->tail = 0;
}

/* Reads and drops what the daemon sent; keeps the arena's fds. */
static void read_replies(struct fz_client *c)
{
	static uint8_t buf[65536];
	for (;;) {
		union {
			struct cmsghdr h;
			char b[CMSG_SPACE(sizeof(int) * AOQ_MAX_FDS)];
		} ctl;
		struct iovec iov = { .iov_base = buf, .iov_len = sizeof(buf) };
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
		                      .msg_controllen = sizeof(ctl.b) };
		ssize_t n = recvmsg(c->sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (n <= 0)
			return;
		for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
			if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
				continue;
			int fds[AOQ_MAX_FDS];
			int nfds = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
			if (nfds > AOQ_MAX_FDS)
				nfds = AOQ_MAX_FDS; /* cannot happen: the buffer holds AOQ_MAX_FDS */
			memcpy(fds, CMSG_DATA(cm), sizeof(int) * (size_t)nfds);
			if (nfds >= 3 && !c->to_daemon) {
				for (int i = 3; i < nfds; i++)
					close(fds[i]); /* the masters memfds: read-only, not fuzzed */
				map_arena(c, fds);
				continue;
			}
			for (int i = 0; i < nfds; i++)
				close(fds[i]);
		}
	}
}

static void turn(struct fz_client *c)
{
	uv_run(&loop, UV_RUN_NOWAIT);
	read_replies(c);
}

void fz_send_raw(struct fz_client *c, const uint8_t *p, size_t n)
{
	double t0 = now_s();
	while (n > 0) {
		ssize_t w = send(c->sock, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (w > 0) {
			p += w;
			n -= (size_t)w;
			continue;
		}
		if (w < 0 && errno != EAGAIN && errno != EINTR)
			return; /* the daemon closed the connection */
		/* The socket is full: the daemon reads on its turn, or has
		 * stopped reading (a deferred reply, replies not read). */
		turn(c);
		if (!c->s->conn.reading || now_s() - t0 > SETTLE_LIMIT_S)
			return;
	}
}

void fz_send_frame(struct fz_client *c, const uint8_t *body, size_t n)
{
	uint8_t len[4] = { (uint8_t)n, (uint8_t)(n >> 8), (uint8_t)(n >> 16), (uint8_t)(n >> 24) };
	fz_send_raw(c, len, 4);
	fz_send_raw(c, body, n);
}

void fz_send_env(struct fz_client *c, const Aoq__Envelope *env)
{
	uint8_t *buf;
	size_t len;
	if (aoq_frame_encode(env, &buf, &len) < 0) {
		fprintf(stderr, "fuzz-daemon: cannot encode a frame\n");
		abort();
	}
	fz_send_raw(c, buf, len);
	free(buf);
}

static void ring_daemon(struct fz_client *c)
{
	uint8_t b = 1;
	ssize_t n = send(c->bell_out, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
	(void)n; /* full: the daemon has a wake-up pending anyway */
}

void fz_push(struct fz_client *c, const struct aoq_rec *rec)
{
	if (!c->to_daemon)
		return;
	struct aoq_ring_prod p = { .ring = c->to_daemon, .cap = c->h.ring_capacity, .head = c->head };
	int r = aoq_ring_push(&p, rec);
	c->head = p.head;
	if (r >= 0)
		ring_daemon(c);
}

void fz_pop_all(struct fz_client *c)
{
	if (!c->to_client)
		return;
	struct aoq_ring_cons q = { .ring = c->to_client, .cap = c->h.ring_capacity, .tail = c->tail };
	struct aoq_rec rec;
	while (aoq_ring_peek(&q, &rec) == 1)
		aoq_ring_pop(&q);
	c->tail = q.tail;
	if (aoq_ring_producer_waiting(&q))
		ring_daemon(c);
	uint8_t b[64];
	while (recv(c->bell_in, b, sizeof(b), MSG_DONTWAIT) > 0)
		;
}

/* Nothing more will happen without the client: the daemon has read what
 * it may read, written what it had to write, and no work is on the pool.
 * A closing session is settled once only our reference is left. */
static bool quiet(struct fz_client *c)
{
	struct aoqd_session *s = c->s;
	if (s->state == AOQD_CLOSING)
		return aoqd_session_refcount(s) == 1;
	if (s->backlog || s->steps.xfer_busy || aoqd_conn_queued(&s->conn) != 0)
		return false;
	/* Jobs out: running, or (clipping, step skipping) summed and waiting
	 * in the deferred list for a StepEnd only the client can send.  From
	 * outside the two look alike: call it quiet once the count has not
	 * moved for 2 ms (a chunk takes well under that; on a loaded
	 * machine the input may just settle less far, which is harmless). */
	uint64_t out = atomic_load(&s->steps.outstanding);
	double t = now_s();
	if (out != c->last_out) {
		c->last_out = out;
		c->out_since = t;
	}
	if (out != 0 && t - c->out_since < 0.002) {
		sched_yield();
		return false;
	}
	int fd = daemon_fd(c), unread = 0;
	if (s->conn.reading && fd >= 0 && ioctl(fd, FIONREAD, &unread) == 0 && unread > 0)
		return false;
	return true;
}

void fz_settle(struct fz_client *c)
{
	double t0 = now_s();
	int idle = 0;
	while (idle < 3) {
		turn(c);
		if (quiet(c)) {
			idle++;
		} else {
			idle = 0;
			/* A session that keeps the loop busy this long is a hang
			 * (a frame or a record handled again and again). */
			if (now_s() - t0 > SETTLE_LIMIT_S) {
				fprintf(stderr, "fuzz-daemon: the session does not settle (state %d, %llu jobs out)\n",
				        (int)c->s->state, (unsigned long long)atomic_load(&c->s->steps.outstanding));
				abort();
			}
		}
	}
}

void fz_close(struct fz_client *c)
{
	if (c->base)
		munmap(c->base, c->size);
	if (c->arena_fd >= 0)
		close(c->arena_fd);
	if (c->bell_out >= 0)
		close(c->bell_out);
	if (c->bell_in >= 0)
		close(c->bell_in);
	close(c->sock);
	/* The daemon sees the close on its next turn; the session is freed
	 * once the list, its handles and its jobs let it go. */
	double t0 = now_s();
	while (c->s->state != AOQD_CLOSING || aoqd_session_refcount(c->s) != 1) {
		uv_run(&loop, UV_RUN_NOWAIT);
		if (now_s() - t0 > SETTLE_LIMIT_S) {
			fprintf(stderr, "fuzz-daemon: a closed session is not released (%d references)\n",
			        aoqd_session_refcount(c->s));
			abort();
		}
	}
	aoqd_session_unref(c->s);
	if (srv.sessions) {
		fprintf(stderr, "fuzz-daemon: a session outlives its connection\n");
		abort();
	}
	memset(c, 0, sizeof(*c));
}
