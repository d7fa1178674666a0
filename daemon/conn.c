/* SPDX-License-Identifier: MIT */
/*
 * A control connection: the socket, frames in and out.  Loop thread only.
 */
#include <errno.h>
#include <poll.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "aoq-arena.h"
#include "conn.h"
#include "log.h"
#include "wire.h"

struct write_req {
	uv_write_t req;
	uint8_t *buf;
	bool close_after; /* close the connection once written */
};

static void on_written(uv_write_t *req, int status)
{
	struct write_req *w = (struct write_req *)req;
	struct aoqd_conn *c = req->handle->data;
	(void)status;
	free(w->buf);
	if (!w->close_after && c->open)
		c->ops->writable(c->owner);
	if (w->close_after) {
		c->ops->close(c->owner);
		c->ops->release(c->owner);
	}
	free(w);
}

static int send_frame(struct aoqd_conn *c, const Aoq__Envelope *env, bool close_after)
{
	if (!c->open)
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
		c->ops->hold(c->owner);
		w->close_after = true;
	}
	r = uv_write(&w->req, (uv_stream_t *)&c->pipe, &b, 1, on_written);
	if (r < 0) {
		free(w->buf);
		free(w);
		if (close_after) {
			c->ops->close(c->owner);
			c->ops->release(c->owner);
		}
		return r;
	}
	return 0;
}

int aoqd_conn_send(struct aoqd_conn *c, const Aoq__Envelope *env)
{
	int r = send_frame(c, env, false);
	if (r < 0 && r != -ENOTCONN) {
		aoqd_warn("session", "session %" PRIu64 ": cannot send: %s", c->id, uv_strerror(r));
		c->ops->close(c->owner);
	}
	return r;
}

void aoqd_conn_send_error(struct aoqd_conn *c, Aoq__ErrorCode code, const char *msg, bool close_after)
{
	Aoq__Error e = AOQ__ERROR__INIT;
	e.code = code;
	e.message = (char *)msg;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_ERROR;
	env.error = &e;
	if (send_frame(c, &env, close_after) < 0 && close_after)
		c->ops->close(c->owner);
}

void aoqd_conn_refuse(struct aoqd_conn *c, Aoq__ErrorCode code, const char *msg)
{
	if (!c->open)
		return;
	Aoq__Error e = AOQ__ERROR__INIT;
	e.code = code;
	e.message = (char *)msg;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_ERROR;
	env.error = &e;
	uint8_t *buf;
	size_t len;
	if (aoq_frame_encode(&env, &buf, &len) < 0)
		return;
	uv_os_fd_t fd;
	if (uv_fileno((uv_handle_t *)&c->pipe, &fd) == 0) {
		ssize_t n = send(fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
		(void)n; /* a client that is gone reads nothing anyway */
	}
	free(buf);
}

int aoqd_conn_send_done(struct aoqd_conn *c, uint64_t value)
{
	Aoq__Done d = AOQ__DONE__INIT;
	d.value = value;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_DONE;
	env.done = &d;
	return aoqd_conn_send(c, &env);
}

/*
 * libuv sends at most one fd per write, so a reply carrying the arena and
 * both doorbells goes out with sendmsg() directly.  That is safe only with
 * nothing queued before it, which holds: a well-behaved client has read
 * every earlier reply while it waits for this one.  Whatever the socket
 * did not take goes through the write queue in order.
 */
int aoqd_conn_send_with_fds(struct aoqd_conn *c, const Aoq__Envelope *env, const int *fds, int nfds)
{
	if (!c->open)
		return -ENOTCONN;
	if (nfds < 1 || nfds > AOQ_MAX_FDS)
		return -EINVAL;
	if (uv_stream_get_write_queue_size((uv_stream_t *)&c->pipe) != 0)
		return -EAGAIN;
	uint8_t *buf;
	size_t len;
	int r = aoq_frame_encode(env, &buf, &len);
	if (r < 0)
		return r;
	uv_os_fd_t fd;
	uv_fileno((uv_handle_t *)&c->pipe, &fd);
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(int) * AOQ_MAX_FDS)];
	} ctl;
	memset(&ctl, 0, sizeof(ctl));
	struct iovec iov = { .iov_base = buf, .iov_len = len };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
	                      .msg_controllen = CMSG_SPACE(sizeof(int) * nfds) };
	struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
	memcpy(CMSG_DATA(cm), fds, sizeof(int) * nfds);
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
		r = uv_write(&w->req, (uv_stream_t *)&c->pipe, &b, 1, on_written);
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

size_t aoqd_conn_queued(const struct aoqd_conn *c)
{
	return uv_stream_get_write_queue_size((const uv_stream_t *)&c->pipe);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	struct aoqd_conn *c = h->data;
	(void)suggested;
	/* Room for a whole maximal frame at most; the owner drains it. */
	size_t want = c->rlen + 65536;
	if (want > 4 + AOQ_MAX_FRAME)
		want = 4 + AOQ_MAX_FRAME;
	if (c->rcap < want) {
		/* Beyond the base, the uid's budget pays (half-sent frames
		 * must not hold the daemon's memory). */
		uint64_t charge = want > AOQD_CONN_BASE_BUFFER ? want - AOQD_CONN_BASE_BUFFER : 0;
		if (c->buffered && charge > c->buffer_charged) {
			uint64_t more = charge - c->buffer_charged;
			if (c->buffer_limit && *c->buffered + more > c->buffer_limit) {
				c->over_budget = true;
				buf->base = NULL;
				buf->len = 0; /* on_read gets UV_ENOBUFS */
				return;
			}
		}
		uint8_t *n = realloc(c->rbuf, want);
		if (n) {
			c->rbuf = n;
			c->rcap = want;
			if (c->buffered && charge > c->buffer_charged) {
				*c->buffered += charge - c->buffer_charged;
				c->buffer_charged = charge;
			}
		}
	}
	buf->base = (char *)c->rbuf + c->rlen;
	buf->len = c->rcap - c->rlen;
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
	struct aoqd_conn *c = st->data;
	(void)buf;
	if (nread == 0)
		return;
	if (nread > 0)
		c->rlen += (size_t)nread;
	if (nread == UV_ENOBUFS && !c->over_budget)
		return; /* out of memory for a moment: libuv tries again */
	c->ops->read(c->owner, nread);
}

void aoqd_conn_want_read(struct aoqd_conn *c, bool want)
{
	if (want && !c->reading && c->open) {
		uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read);
		c->reading = true;
	} else if (!want && c->reading) {
		uv_read_stop((uv_stream_t *)&c->pipe);
		c->reading = false;
	}
}

int aoqd_conn_frame(struct aoqd_conn *c, size_t *off, Aoq__Envelope **env, struct aoqd_error *err)
{
	if (c->rlen - *off < 4)
		return 0;
	uint32_t len = aoq_frame_len(c->rbuf + *off);
	if (len > AOQ_MAX_FRAME)
		return AOQD_FAIL(err, PROTOCOL, "frame of %u bytes (the limit is %u)", len, AOQ_MAX_FRAME);
	if (c->rlen - *off - 4 < len)
		return 0;
	*env = aoq_envelope_decode(c->rbuf + *off + 4, len);
	*off += 4 + (size_t)len;
	if (!*env)
		return AOQD_FAIL(err, PROTOCOL, "frame does not decode");
	return 1;
}

/* Gives a large read buffer back once what it holds fits the base. */
static void shrink(struct aoqd_conn *c)
{
	if (c->rcap <= AOQD_CONN_BASE_BUFFER || c->rlen > AOQD_CONN_BASE_BUFFER / 2)
		return;
	uint8_t *n = realloc(c->rbuf, AOQD_CONN_BASE_BUFFER);
	if (!n)
		return;
	c->rbuf = n;
	c->rcap = AOQD_CONN_BASE_BUFFER;
	if (c->buffered)
		*c->buffered -= c->buffer_charged;
	c->buffer_charged = 0;
}

void aoqd_conn_consume(struct aoqd_conn *c, size_t n)
{
	if (n == 0)
		return;
	if (n < c->rlen)
		memmove(c->rbuf, c->rbuf + n, c->rlen - n);
	c->rlen -= n;
	shrink(c);
}

void aoqd_conn_budget(struct aoqd_conn *c, uint64_t *buffered, uint64_t limit)
{
	c->buffered = buffered;
	c->buffer_limit = limit;
}

bool aoqd_conn_in_group(const struct aoqd_conn *c, gid_t gid)
{
	if (c->gid == gid)
		return true;
	for (int i = 0; i < c->ngroups; i++)
		if (c->groups[i] == gid)
			return true;
	return false;
}

static void on_closed(uv_handle_t *h)
{
	struct aoqd_conn *c = h->data;
	c->ops->release(c->owner);
}

int aoqd_conn_accept(struct aoqd_conn *c, uv_loop_t *loop, uv_stream_t *listener, uint64_t id,
                     const struct aoqd_conn_ops *ops, void *owner)
{
	c->ops = ops;
	c->owner = owner;
	c->id = id;
	uv_pipe_init(loop, &c->pipe, 0);
	c->pipe.data = c;
	c->handle_live = true;
	int r = uv_accept(listener, (uv_stream_t *)&c->pipe);
	if (r < 0)
		return r;
	c->open = true;
	uv_os_fd_t fd;
	uv_fileno((uv_handle_t *)&c->pipe, &fd);
	struct ucred cred;
	socklen_t cl = sizeof(cred);
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0) {
		aoqd_warn("server", "SO_PEERCRED: %s; refusing the connection", strerror(errno));
		c->uid = (uid_t)-1;
	} else {
		c->uid = cred.uid;
		c->gid = cred.gid;
		c->peer_pid = cred.pid;
	}
	/* Supplementary groups count for admin_gid (Linux 4.13+). */
	gid_t groups[256];
	socklen_t gl = sizeof(groups);
	if (c->uid != (uid_t)-1 && getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &gl) == 0 && gl > 0) {
		c->groups = malloc(gl);
		if (c->groups) {
			memcpy(c->groups, groups, gl);
			c->ngroups = (int)(gl / sizeof(gid_t));
		}
	}
	return 0;
}

bool aoqd_conn_close(struct aoqd_conn *c)
{
	bool was_open = c->open;
	if (c->buffered)
		*c->buffered -= c->buffer_charged;
	c->buffer_charged = 0;
	c->buffered = NULL;
	c->open = false;
	c->reading = false;
	if (c->handle_live) {
		c->handle_live = false;
		c->ops->hold(c->owner);
		uv_close((uv_handle_t *)&c->pipe, on_closed);
	}
	return was_open;
}

bool aoqd_conn_peer_gone(struct aoqd_conn *c)
{
	uv_os_fd_t fd;
	if (!c->open || uv_fileno((uv_handle_t *)&c->pipe, &fd) < 0)
		return true;
	struct pollfd p = { .fd = fd, .events = POLLRDHUP };
	return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

void aoqd_conn_free(struct aoqd_conn *c)
{
	free(c->rbuf);
	free(c->job);
	free(c->device);
	free(c->groups);
	c->groups = NULL;
	c->rbuf = NULL;
	c->job = c->device = NULL;
}
