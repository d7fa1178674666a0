/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "wire.h"

int aoq_frame_encode(const Aoq__Envelope *env, uint8_t **buf, size_t *len)
{
	size_t n = aoq__envelope__get_packed_size(env);
	if (n > AOQ_MAX_FRAME)
		return -EMSGSIZE;
	uint8_t *b = malloc(4 + n);
	if (!b)
		return -ENOMEM;
	b[0] = n & 0xff;
	b[1] = (n >> 8) & 0xff;
	b[2] = (n >> 16) & 0xff;
	b[3] = (n >> 24) & 0xff;
	aoq__envelope__pack(env, b + 4);
	*buf = b;
	*len = 4 + n;
	return 0;
}

Aoq__Envelope *aoq_envelope_decode(const uint8_t *body, size_t len)
{
	Aoq__Envelope *env = aoq__envelope__unpack(NULL, len, body);
	if (env && env->msg_case == AOQ__ENVELOPE__MSG__NOT_SET) {
		aoq__envelope__free_unpacked(env, NULL);
		return NULL;
	}
	return env;
}

void aoq_envelope_free(Aoq__Envelope *env)
{
	if (env)
		aoq__envelope__free_unpacked(env, NULL);
}

int aoq_send_frame(int sock, const Aoq__Envelope *env, const int *fds, int nfds)
{
	uint8_t *buf;
	size_t len;
	int r = aoq_frame_encode(env, &buf, &len);
	if (r < 0)
		return r;
	if (nfds < 0 || nfds > AOQ_MAX_FDS) {
		free(buf);
		return -EINVAL;
	}
	size_t off = 0;
	while (off < len) {
		struct iovec iov = { .iov_base = buf + off, .iov_len = len - off };
		union {
			struct cmsghdr h;
			char b[CMSG_SPACE(sizeof(int) * AOQ_MAX_FDS)];
		} ctl;
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
		if (off == 0 && nfds > 0) {
			memset(&ctl, 0, sizeof(ctl));
			msg.msg_control = ctl.b;
			msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
			struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
			c->cmsg_level = SOL_SOCKET;
			c->cmsg_type = SCM_RIGHTS;
			c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
			memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
		}
		ssize_t w = sendmsg(sock, &msg, MSG_NOSIGNAL);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			r = -errno;
			free(buf);
			return r;
		}
		off += (size_t)w;
	}
	free(buf);
	return 0;
}

static void close_fds(int *fds, int n)
{
	for (int i = 0; i < n; i++)
		close(fds[i]);
}

/* Reads exactly len bytes; collects SCM_RIGHTS fds on the way. */
static int recv_all(int sock, uint8_t *p, size_t len, int *fds, int max_fds, int *nfds)
{
	size_t off = 0;
	while (off < len) {
		struct iovec iov = { .iov_base = p + off, .iov_len = len - off };
		union {
			struct cmsghdr h;
			char b[CMSG_SPACE(sizeof(int) * AOQ_MAX_FDS)];
		} ctl;
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1,
		                      .msg_control = ctl.b, .msg_controllen = sizeof(ctl.b) };
		ssize_t r = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
			if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
				continue;
			int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
			int got[AOQ_MAX_FDS];
			if (n > AOQ_MAX_FDS)
				n = AOQ_MAX_FDS; /* cannot happen: the buffer holds AOQ_MAX_FDS */
			memcpy(got, CMSG_DATA(c), sizeof(int) * n);
			for (int i = 0; i < n; i++) {
				if (*nfds < max_fds)
					fds[(*nfds)++] = got[i];
				else {
					close(got[i]);
					msg.msg_flags |= MSG_CTRUNC;
				}
			}
		}
		if (msg.msg_flags & MSG_CTRUNC)
			return -EPROTO;
		if (r == 0)
			return -ECONNRESET;
		off += (size_t)r;
	}
	return 0;
}

int aoq_recv_frame(int sock, Aoq__Envelope **env, int *fds, int max_fds, int *nfds)
{
	uint8_t hdr[4];
	int dummy = 0;
	if (!nfds)
		nfds = &dummy, max_fds = 0;
	*nfds = 0;
	if (max_fds > AOQ_MAX_FDS)
		max_fds = AOQ_MAX_FDS;
	int r = recv_all(sock, hdr, 4, fds, max_fds, nfds);
	if (r < 0)
		goto fail;
	uint32_t len = aoq_frame_len(hdr);
	if (len > AOQ_MAX_FRAME) {
		r = -EMSGSIZE;
		goto fail;
	}
	uint8_t *body = malloc(len ? len : 1);
	if (!body) {
		r = -ENOMEM;
		goto fail;
	}
	r = recv_all(sock, body, len, fds, max_fds, nfds);
	if (r == 0) {
		*env = aoq_envelope_decode(body, len);
		if (!*env)
			r = -EBADMSG;
	}
	free(body);
	if (r < 0)
		goto fail;
	return 0;
fail:
	close_fds(fds, *nfds);
	*nfds = 0;
	return r;
}

int aoq_error_to_errno(int code)
{
	switch (code) {
	case AOQ__ERROR_CODE__OK: return 0;
	case AOQ__ERROR_CODE__PROTOCOL: return -EPROTO;
	case AOQ__ERROR_CODE__VERSION: return -EPROTONOSUPPORT;
	case AOQ__ERROR_CODE__INVALID: return -EINVAL;
	case AOQ__ERROR_CODE__NO_MEMORY: return -ENOMEM;
	case AOQ__ERROR_CODE__QUOTA: return -EDQUOT;
	case AOQ__ERROR_CODE__BAD_RECORD: return -EBADMSG;
	case AOQ__ERROR_CODE__BUSY: return -EBUSY;
	case AOQ__ERROR_CODE__PERMISSION: return -EPERM;
	case AOQ__ERROR_CODE__NOT_FOUND: return -ENOENT;
	case AOQ__ERROR_CODE__PEER_LOST: return -ECONNABORTED;
	default: return -EIO;
	}
}

const char *aoq_error_name(int code)
{
	const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(&aoq__error_code__descriptor, code);
	return v ? v->name : "UNKNOWN";
}

int aoq_call(int sock, const Aoq__Envelope *env, Aoq__Envelope **reply, char **errmsg)
{
	int r = aoq_send_frame(sock, env, NULL, 0);
	if (r < 0)
		return r;
	Aoq__Envelope *rep;
	r = aoq_recv_frame(sock, &rep, NULL, 0, NULL);
	if (r < 0)
		return r;
	if (rep->msg_case == AOQ__ENVELOPE__MSG_ERROR) {
		r = aoq_error_to_errno(rep->error->code);
		if (r == 0)
			r = -EIO;
		if (errmsg)
			*errmsg = strdup(rep->error->message ? rep->error->message : "");
		aoq_envelope_free(rep);
		return r;
	}
	*reply = rep;
	return 0;
}

int aoq_socket_path(const char *explicit_path, char *buf, size_t len)
{
	const char *p = explicit_path && *explicit_path ? explicit_path : getenv("AOQ_SOCKET");
	int n;
	struct stat st;
	if (p && *p)
		n = snprintf(buf, len, "%s", p);
	else if (stat("/run/aoq/aoqd.sock", &st) == 0 && S_ISSOCK(st.st_mode))
		n = snprintf(buf, len, "/run/aoq/aoqd.sock");
	else if ((p = getenv("XDG_RUNTIME_DIR")) && *p)
		n = snprintf(buf, len, "%s/aoq/aoqd.sock", p);
	else
		n = snprintf(buf, len, "/tmp/aoq-%u/aoqd.sock", (unsigned)getuid());
	if (n < 0 || (size_t)n >= len)
		return -ENAMETOOLONG;
	return 0;
}

int aoq_socket_connect_timeout(const char *path, uint32_t timeout_ms)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	strcpy(sa.sun_path, path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	if (timeout_ms) {
		/* Linux applies SO_SNDTIMEO to a unix socket's connect too (a
		 * listener whose backlog is full). */
		struct timeval tv = { .tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000 };
		if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0 ||
		    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0) {
			int r = -errno;
			close(fd);
			return r;
		}
	}
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int r = errno == EAGAIN || errno == EINPROGRESS ? -ETIMEDOUT : -errno;
		close(fd);
		return r;
	}
	return fd;
}

int aoq_socket_connect(const char *path)
{
	return aoq_socket_connect_timeout(path, 0);
}

uint32_t aoq_grow_cap(uint32_t cap, uint32_t need)
{
	if (need <= cap)
		return cap;
	uint32_t n = cap ? cap : 16;
	while (n < need)
		n = n > UINT32_MAX / 2 ? need : n * 2;
	return n;
}

void *aoq_grow(void *p, uint32_t *cap, uint32_t need, size_t elem)
{
	if (need <= *cap)
		return p;
	uint32_t n = aoq_grow_cap(*cap, need);
	void *q = realloc(p, (size_t)n * elem);
	if (!q)
		return NULL;
	memset((char *)q + (size_t)*cap * elem, 0, (size_t)(n - *cap) * elem);
	*cap = n;
	return q;
}
