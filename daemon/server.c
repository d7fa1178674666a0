/* SPDX-License-Identifier: MIT */
/*
 * The control plane: the libuv loop, the listening socket, one connection
 * per session, frames in and out.  Runs on the main thread only.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "aoq-config.h"
#include "aoqd.h"
#include "log.h"
#include "wire.h"

#if AOQ_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

/* A client that does not read its replies stops being read once this much
 * waits to be written to it. */
#define MAX_QUEUED_REPLY_BYTES (4u << 20)

struct write_req {
	uv_write_t req;
	uint8_t *buf;
	struct aoqd_session *close_after; /* close this session once written */
};

static void session_close(struct aoqd_session *s);
static void process_frames(struct aoqd_session *s);

void aoqd_session_ref(struct aoqd_session *s)
{
	atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
}

/* The last reference may drop on a worker thread: by then every uv handle
 * is closed, so freeing is plain memory and fds. */
void aoqd_session_unref(struct aoqd_session *s)
{
	if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1)
		return;
	aoqd_session_free_state(s);
	free(s->rbuf);
	free(s->job);
	free(s->device);
	pthread_mutex_destroy(&s->ring_lock);
	pthread_mutex_destroy(&s->step_lock);
	pthread_mutex_destroy(&s->stats_lock);
	free(s);
}

static void on_written(uv_write_t *req, int status)
{
	struct write_req *w = (struct write_req *)req;
	struct aoqd_session *s = req->handle->data;
	free(w->buf);
	/* Reading stopped for a full write queue: go on once it drained. */
	if (!w->close_after && s->pipe_open && !s->reading && s->state != AOQD_CLOSING &&
	    uv_stream_get_write_queue_size(req->handle) < MAX_QUEUED_REPLY_BYTES / 2)
		process_frames(s);
	if (w->close_after) {
		session_close(w->close_after);
		aoqd_session_unref(w->close_after);
	}
	free(w);
}

static int send_frame(struct aoqd_session *s, const Aoq__Envelope *env, bool close_after)
{
	if (!s->pipe_open)
		return -ENOTCONN;
	struct write_req *w = calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	size_t len;
	int r = aoq_frame_encode(env, &w->buf, &len);
	if (r < 0) {
		free(w);
		return r;
	}
	uv_buf_t b = uv_buf_init((char *)w->buf, (unsigned)len);
	if (close_after) {
		aoqd_session_ref(s);
		w->close_after = s;
	}
	r = uv_write(&w->req, (uv_stream_t *)&s->pipe, &b, 1, on_written);
	if (r < 0) {
		free(w->buf);
		free(w);
		if (close_after) {
			session_close(s);
			aoqd_session_unref(s);
		}
		return r;
	}
	return 0;
}

int aoqd_send(struct aoqd_session *s, const Aoq__Envelope *env)
{
	int r = send_frame(s, env, false);
	if (r < 0 && r != -ENOTCONN) {
		aoqd_warn("session", "session %" PRIu64 ": cannot send: %s", s->id, uv_strerror(r));
		session_close(s);
	}
	return r;
}

/*
 * libuv sends at most one fd per write, so a reply carrying the arena and
 * both doorbells goes out with sendmsg() directly.  That is safe only with
 * nothing queued before it, which holds: a well-behaved client has read
 * every earlier reply while it waits for this one.  Whatever the socket
 * did not take goes through the write queue in order.
 */
int aoqd_send_with_fds(struct aoqd_session *s, const Aoq__Envelope *env, const int *fds, int nfds)
{
	if (!s->pipe_open)
		return -ENOTCONN;
	if (uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe) != 0)
		return -EAGAIN;
	uint8_t *buf;
	size_t len;
	int r = aoq_frame_encode(env, &buf, &len);
	if (r < 0)
		return r;
	uv_os_fd_t fd;
	uv_fileno((uv_handle_t *)&s->pipe, &fd);
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int) * AOQ_MAX_FDS)];
	} ctl;
	memset(&ctl, 0, sizeof(ctl));
	struct iovec iov = { .iov_base = buf, .iov_len = len };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
	                      .msg_controllen = CMSG_SPACE(sizeof(int) * nfds) };
	struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
	memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
	ssize_t n;
	do
		n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
	while (n < 0 && errno == EINTR);
	if (n < 0) {
		r = -errno;
		free(buf);
		return r;
	}
	if ((size_t)n < len) {
		struct write_req *w = calloc(1, sizeof(*w));
		if (!w) {
			free(buf);
			return -ENOMEM;
		}
		w->buf = buf;
		uv_buf_t b = uv_buf_init((char *)buf + n, (unsigned)(len - (size_t)n));
		r = uv_write(&w->req, (uv_stream_t *)&s->pipe, &b, 1, on_written);
		if (r < 0) {
			free(buf);
			free(w);
			return r;
		}
		return 0;
	}
	free(buf);
	return 0;
}

static void send_error(struct aoqd_session *s, Aoq__ErrorCode code, const char *msg, bool close_after)
{
	Aoq__Error e = AOQ__ERROR__INIT;
	e.code = code;
	e.message = (char *)msg;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_ERROR;
	env.error = &e;
	if (send_frame(s, &env, close_after) < 0 && close_after)
		session_close(s);
}

void aoqd_session_fail(struct aoqd_session *s, Aoq__ErrorCode code, const char *fmt, ...)
{
	if (s->state == AOQD_CLOSING)
		return;
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	aoqd_warn("session", "session %" PRIu64 " (uid %u pid %d job '%s' rank %u): %s: %s; closing it",
	          s->id, (unsigned)s->uid, (int)s->peer_pid, s->job ? s->job : "", s->rank,
	          aoq_error_name(code), msg);
	/* Stop everything the session does now; the connection goes once the
	 * Error is written. */
	atomic_store(&s->dead, true);
	if (s->reading) {
		uv_read_stop((uv_stream_t *)&s->pipe);
		s->reading = false;
	}
	if (s->poll_open)
		uv_poll_stop(&s->doorbell_poll);
	send_error(s, code, msg, true);
	s->state = AOQD_CLOSING;
}

void aoqd_reply_error(struct aoqd_session *s, Aoq__ErrorCode code, const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	aoqd_info("session", "session %" PRIu64 ": request refused: %s: %s", s->id, aoq_error_name(code), msg);
	send_error(s, code, msg, false);
}

static void on_handle_closed(uv_handle_t *h)
{
	aoqd_session_unref(h->data);
}

/* Closes the connection and the doorbell, unlinks the session; the memory
 * goes with the last reference (running chunks hold one). */
static void session_close(struct aoqd_session *s)
{
	struct aoqd_server *srv = s->srv;
	atomic_store(&s->dead, true);
	if (s->state != AOQD_CLOSING)
		s->state = AOQD_CLOSING;
	aoqd_drop_deferred(s);
	if (s->pipe_open) {
		s->pipe_open = false;
		s->reading = false;
		aoqd_session_ref(s);
		uv_close((uv_handle_t *)&s->pipe, on_handle_closed);
		srv->connections--;
	}
	if (s->poll_open) {
		s->poll_open = false;
		aoqd_session_ref(s);
		uv_close((uv_handle_t *)&s->doorbell_poll, on_handle_closed);
	}
	if (s->prev || s->next || srv->sessions == s) {
		if (s->prev)
			s->prev->next = s->next;
		else
			srv->sessions = s->next;
		if (s->next)
			s->next->prev = s->prev;
		s->prev = s->next = NULL;
		aoqd_log(s->job && strcmp(s->job, "aoqctl") == 0 ? AOQD_LOG_DEBUG : AOQD_LOG_INFO, "session", "session %" PRIu64 " closed (job '%s' rank %u, %" PRIu64 " steps)",
		          s->id, s->job ? s->job : "", s->rank, s->steps_done);
		aoqd_session_unref(s); /* the list's reference */
	}
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	struct aoqd_session *s = h->data;
	/* Room for a whole maximal frame at most; process_frames drains it. */
	size_t want = s->rlen + 65536;
	if (want > 4 + AOQ_MAX_FRAME)
		want = 4 + AOQ_MAX_FRAME;
	if (s->rcap < want) {
		uint8_t *n = realloc(s->rbuf, want);
		if (n) {
			s->rbuf = n;
			s->rcap = want;
		}
	}
	buf->base = (char *)s->rbuf + s->rlen;
	buf->len = s->rcap - s->rlen;
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
	struct aoqd_session *s = st->data;
	if (nread < 0) {
		if (nread != UV_EOF)
			aoqd_info("session", "session %" PRIu64 ": read: %s", s->id, uv_strerror((int)nread));
		else if (s->state == AOQD_READY)
			aoqd_info("session", "session %" PRIu64 ": client went away", s->id);
		session_close(s);
		return;
	}
	if (nread == 0)
		return;
	s->rlen += (size_t)nread;
	process_frames(s);
}

static void dispatch(struct aoqd_session *s, Aoq__Envelope *env, bool *deferred)
{
	*deferred = false;
	switch (env->msg_case) {
	case AOQ__ENVELOPE__MSG_HELLO: {
		const Aoq__Hello *h = env->hello;
		if (s->state != AOQD_HELLO)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "Hello twice"); return; }
		if (h->protocol_version != AOQ_PROTOCOL_VERSION)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__VERSION, "protocol version %u, this daemon speaks %u",
			                         h->protocol_version, AOQ_PROTOCOL_VERSION); return; }
		if (strlen(h->job) > 128 || strlen(h->device) > 64)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__INVALID, "job or device name too long"); return; }
		s->job = strdup(h->job);
		s->device = strdup(h->device);
		s->rank = h->rank;
		s->pid = h->pid;
		if (!s->job || !s->device)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__NO_MEMORY, "out of memory"); return; }
		if (!h->observer) {
			uint32_t n = 0;
			for (struct aoqd_session *o = s->srv->sessions; o; o = o->next)
				if (o->uid == s->uid && o->state != AOQD_OBSERVER && o != s)
					n++;
			if (n >= s->srv->cfg.max_sessions_per_uid)
				{ aoqd_session_fail(s, AOQ__ERROR_CODE__QUOTA, "uid %u has %u sessions (the limit)",
				                         (unsigned)s->uid, n); return; }
		}
		s->state = h->observer ? AOQD_OBSERVER : AOQD_REGISTERING;
		Aoq__Limits lim = AOQ__LIMITS__INIT;
		lim.max_frame = AOQ_MAX_FRAME;
		lim.max_tensors = s->srv->cfg.max_tensors;
		lim.max_tensor_elems = s->srv->cfg.max_tensor_elems;
		lim.max_arena_bytes = s->srv->cfg.max_arena_bytes;
		lim.max_groups = 65536;
		Aoq__Welcome w = AOQ__WELCOME__INIT;
		w.session_id = s->id;
		w.protocol_version = AOQ_PROTOCOL_VERSION;
		w.limits = &lim;
		Aoq__Envelope r = AOQ__ENVELOPE__INIT;
		r.msg_case = AOQ__ENVELOPE__MSG_WELCOME;
		r.welcome = &w;
		if (!h->observer)
			aoqd_info("session", "session %" PRIu64 ": hello from pid %d uid %u job '%s' rank %u device '%s'",
			          s->id, (int)s->peer_pid, (unsigned)s->uid, s->job, s->rank, s->device);
		aoqd_send(s, &r);
		return;
	}
	case AOQ__ENVELOPE__MSG_REGISTER:
		if (s->state != AOQD_REGISTERING)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "Register not expected now"); return; }
		{ aoqd_on_register(s, env->register_); return; }
	case AOQ__ENVELOPE__MSG_SET_HYPERPARAMS:
		if (s->state != AOQD_READY)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "SetHyperparams before registration"); return; }
		{ aoqd_on_set_hyperparams(s, env->set_hyperparams); return; }
	case AOQ__ENVELOPE__MSG_STEP_END:
		if (s->state != AOQD_READY)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "StepEnd before registration"); return; }
		*deferred = aoqd_on_step_end(s, env->step_end);
		return;
	case AOQ__ENVELOPE__MSG_LOAD_STATE:
		if (s->state != AOQD_READY)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "LoadState before registration"); return; }
		*deferred = aoqd_on_load_state(s, env->load_state);
		return;
	case AOQ__ENVELOPE__MSG_READ_STATE:
		if (s->state != AOQD_READY)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "ReadState before registration"); return; }
		*deferred = aoqd_on_read_state(s, env->read_state);
		return;
	case AOQ__ENVELOPE__MSG_TENSOR_STEPS:
		if (s->state != AOQD_READY)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "TensorSteps before registration"); return; }
		{ aoqd_on_tensor_steps(s, env->tensor_steps); return; }
	case AOQ__ENVELOPE__MSG_STATS_REQUEST:
		if (s->state == AOQD_HELLO)
			{ aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "StatsRequest before Hello"); return; }
		{ aoqd_on_stats(s, env->stats_request); return; }
	case AOQ__ENVELOPE__MSG_BYE:
		aoqd_info("session", "session %" PRIu64 ": bye", s->id);
		session_close(s);
		return;
	default:
		{ aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "unexpected message %d", (int)env->msg_case); return; }
	}
}

/* Decodes and handles every whole frame in the buffer, unless a deferred
 * reply (StepEnd) holds the connection: replies go out in request order. */
static void process_frames(struct aoqd_session *s)
{
	size_t off = 0;
	while (s->state != AOQD_CLOSING && !s->step_end_pending && !s->xfer_busy && s->rlen - off >= 4 &&
	       uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe) < MAX_QUEUED_REPLY_BYTES) {
		uint32_t len = aoq_frame_len(s->rbuf + off);
		if (len > AOQ_MAX_FRAME) {
			aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "frame of %u bytes (the limit is %u)", len, AOQ_MAX_FRAME);
			break;
		}
		if (s->rlen - off - 4 < len)
			break;
		Aoq__Envelope *env = aoq_envelope_decode(s->rbuf + off + 4, len);
		off += 4 + (size_t)len;
		if (!env) {
			aoqd_session_fail(s, AOQ__ERROR_CODE__PROTOCOL, "frame does not decode");
			break;
		}
		bool deferred;
		dispatch(s, env, &deferred);
		aoq_envelope_free(env);
	}
	if (s->state == AOQD_CLOSING) {
		s->rlen = 0;
		return;
	}
	memmove(s->rbuf, s->rbuf + off, s->rlen - off);
	s->rlen -= off;
	bool want = !s->step_end_pending && !s->xfer_busy &&
	            uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe) < MAX_QUEUED_REPLY_BYTES;
	if (want && !s->reading && s->pipe_open) {
		uv_read_start((uv_stream_t *)&s->pipe, on_alloc, on_read);
		s->reading = true;
	} else if (!want && s->reading) {
		uv_read_stop((uv_stream_t *)&s->pipe);
		s->reading = false;
	}
}

void aoqd_resume_reading(struct aoqd_session *s)
{
	process_frames(s);
}

static void on_connection(uv_stream_t *listener, int status)
{
	struct aoqd_server *srv = listener->data;
	if (status < 0) {
		aoqd_warn("server", "accept: %s", uv_strerror(status));
		return;
	}
	struct aoqd_session *s = calloc(1, sizeof(*s));
	if (!s) {
		aoqd_err("server", "out of memory for a new connection");
		return;
	}
	s->srv = srv;
	s->arena_fd = s->doorbell_in = s->doorbell_out = -1;
	atomic_init(&s->refs, 1); /* the server list's */
	pthread_mutex_init(&s->ring_lock, NULL);
	pthread_mutex_init(&s->step_lock, NULL);
	pthread_mutex_init(&s->stats_lock, NULL);
	uv_pipe_init(srv->loop, &s->pipe, 0);
	s->pipe.data = s;
	if (uv_accept(listener, (uv_stream_t *)&s->pipe) < 0) {
		/* Not linked yet: the close callback drops the only reference. */
		uv_close((uv_handle_t *)&s->pipe, on_handle_closed);
		return;
	}
	s->pipe_open = true;
	srv->connections++;
	s->id = ++srv->next_id;
	s->next_step = 1;
	s->state = AOQD_HELLO;
	uv_os_fd_t fd;
	uv_fileno((uv_handle_t *)&s->pipe, &fd);
	struct ucred cred;
	socklen_t cl = sizeof(cred);
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0) {
		aoqd_warn("server", "SO_PEERCRED: %s; refusing the connection", strerror(errno));
		s->uid = (uid_t)-1;
	} else {
		s->uid = cred.uid;
		s->gid = cred.gid;
		s->peer_pid = cred.pid;
	}
	s->next = srv->sessions;
	if (srv->sessions)
		srv->sessions->prev = s;
	srv->sessions = s;
	if (s->uid == (uid_t)-1) {
		session_close(s);
		return;
	}
	if (srv->connections > srv->cfg.max_connections) {
		aoqd_session_fail(s, AOQ__ERROR_CODE__QUOTA, "too many connections");
		return;
	}
	aoqd_debug("server", "connection %" PRIu64 " from pid %d uid %u", s->id, (int)s->peer_pid, (unsigned)s->uid);
	uv_read_start((uv_stream_t *)&s->pipe, on_alloc, on_read);
	s->reading = true;
}

static void on_wake(uv_async_t *a)
{
	struct aoqd_server *srv = a->data;
	struct aoqd_session *next;
	for (struct aoqd_session *s = srv->sessions; s; s = next) {
		next = s->next;
		if (s->state != AOQD_READY)
			continue;
		if (s->space_wait)
			aoqd_drain(s);
		if (s->state == AOQD_READY && s->step_end_pending)
			aoqd_check_step_end(s);
		if (s->state == AOQD_READY && s->xfer_busy)
			aoqd_check_transfer(s);
	}
}

static void on_signal(uv_signal_t *h, int signum)
{
	struct aoqd_server *srv = h->data;
	if (signum == SIGHUP) {
		/* Reload: only the log level and limits are reread for now. */
		aoqd_info("server", "SIGHUP: nothing to reload");
		return;
	}
	aoqd_info("server", "signal %d: stopping", signum);
	aoqd_server_stop(srv);
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
		if (n > 1)
			aoqd_warn("server", "%d sockets passed by systemd; using the first", n);
		if (n >= 1) {
			fd = SD_LISTEN_FDS_START;
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

int aoqd_server_init(struct aoqd_server *srv, uv_loop_t *loop, const struct aoqd_config *cfg)
{
	memset(srv, 0, sizeof(*srv));
	srv->cfg = *cfg;
	srv->loop = loop;
	srv->start_ns = aoqd_now_ns();
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
	srv->pool = aoqd_pool_new(n, pin ? pins : NULL);
	if (!srv->pool)
		return -errno;
	aoqd_info("server", "%u workers%s (%ld cpus), kernel %s", n, pin ? " pinned" : "", ncpu, srv->kernel->name);
	uv_async_init(loop, &srv->wake, on_wake);
	srv->wake.data = srv;
	uv_signal_init(loop, &srv->sigterm);
	uv_signal_init(loop, &srv->sigint);
	uv_signal_init(loop, &srv->sighup);
	srv->sigterm.data = srv->sigint.data = srv->sighup.data = srv;
	uv_signal_start(&srv->sigterm, on_signal, SIGTERM);
	uv_signal_start(&srv->sigint, on_signal, SIGINT);
	uv_signal_start(&srv->sighup, on_signal, SIGHUP);
	int r = open_listener(srv);
	if (r < 0) {
		aoqd_server_stop(srv);
		return r;
	}
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
	while (srv->sessions)
		session_close(srv->sessions);
	if (uv_is_active((uv_handle_t *)&srv->listener) || srv->listener.loop)
		uv_close((uv_handle_t *)&srv->listener, NULL);
	uv_close((uv_handle_t *)&srv->wake, NULL);
	uv_close((uv_handle_t *)&srv->sigterm, NULL);
	uv_close((uv_handle_t *)&srv->sigint, NULL);
	uv_close((uv_handle_t *)&srv->sighup, NULL);
}

void aoqd_server_fini(struct aoqd_server *srv)
{
	aoqd_pool_free(srv->pool);
	srv->pool = NULL;
	/* Only our own socket: a failed bind may have met a live daemon's. */
	if (srv->bound)
		unlink(srv->cfg.socket_path);
}
