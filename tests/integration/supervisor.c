/* SPDX-License-Identifier: MIT */
/* A supervisor that does for aoqd what systemd does (supervisor.h). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "supervisor.h"

static void *receiver(void *arg);

void sup_init(struct sup *s, bool snapshots, const char *extra)
{
	memset(s, 0, sizeof(*s));
	s->pid = -1;
	snprintf(s->dir, sizeof(s->dir), "/tmp/aoqt-fds-XXXXXX");
	CHECK(mkdtemp(s->dir), "mkdtemp: %s", strerror(errno));
	snprintf(s->sock, sizeof(s->sock), "%.64s/aoqd.sock", s->dir);
	snprintf(s->notify, sizeof(s->notify), "%.64s/notify", s->dir);
	snprintf(s->log, sizeof(s->log), "%.64s/aoqd.log", s->dir);
	snprintf(s->state, sizeof(s->state), "%.64s/state", s->dir);
	snprintf(s->conf, sizeof(s->conf), "%.64s/aoqd.conf", s->dir);
	CHECK(mkdir(s->state, 0700) == 0, "mkdir: %s", strerror(errno));
	FILE *f = fopen(s->conf, "w");
	CHECK(f, "config: %s", strerror(errno));
	fprintf(f, "threads = 2\nlease_seconds = 60\nlog_level = info\nstate_dir = %s\n", s->state);
	if (snapshots)
		fprintf(f, "snapshot_every_steps = 1\n");
	if (extra)
		fputs(extra, f);
	fclose(f);
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	s->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", s->sock);
	CHECK(s->lfd >= 0 && bind(s->lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(s->lfd, 64) == 0,
	      "listen: %s", strerror(errno));
	s->nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", s->notify);
	CHECK(s->nfd >= 0 && bind(s->nfd, (struct sockaddr *)&sa, sizeof(sa)) == 0, "notify: %s", strerror(errno));
	int on = 1;
	setsockopt(s->nfd, SOL_SOCKET, SO_PASSCRED, &on, sizeof(on));
	pthread_mutex_init(&s->mu, NULL);
	pthread_cond_init(&s->cv, NULL);
	pthread_t t;
	CHECK(pthread_create(&t, NULL, receiver, s) == 0 && pthread_detach(t) == 0, "pthread_create");
}

/* Takes one datagram off the notify socket into the ring, with s->mu held
 * (the ring keeps the socket's order): false when none waits or the ring
 * is full. */
static bool take(struct sup *s)
{
	if (s->count == SUP_RING)
		return false;
	struct sup_note *m = &s->ring[(s->head + s->count) % SUP_RING];
	union {
		char buf[CMSG_SPACE(sizeof(int) * 32) + CMSG_SPACE(sizeof(struct ucred))];
		struct cmsghdr align;
	} cm;
	struct iovec iov = { m->data, sizeof(m->data) - 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof(cm.buf) };
	m->n = recvmsg(s->nfd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
	if (m->n < 0)
		return false;
	m->flags = mh.msg_flags;
	m->nf = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
			memcpy(m->fds + m->nf, CMSG_DATA(c), sizeof(int) * (size_t)k);
			m->nf += k;
		}
	s->count++;
	return true;
}

/* The receiver: takes every datagram off the notify socket as it comes, as
 * systemd does.  Without it a sender of more datagrams than the socket
 * queues (net.unix.max_dgram_qlen, often 10) blocks in sendmsg until the
 * test next calls sup_recv: aoqd storing a large session's masters memfds
 * during a Register blocks its loop there, while the trainer waits for the
 * Register's answer. */
static void *receiver(void *arg)
{
	struct sup *s = arg;
	for (;;) {
		pthread_mutex_lock(&s->mu);
		while (s->count == SUP_RING)
			pthread_cond_wait(&s->cv, &s->mu);
		pthread_mutex_unlock(&s->mu);
		struct pollfd p = { .fd = s->nfd, .events = POLLIN };
		if (poll(&p, 1, -1) <= 0)
			continue;
		pthread_mutex_lock(&s->mu);
		while (take(s))
			;
		pthread_cond_broadcast(&s->cv);
		pthread_mutex_unlock(&s->mu);
	}
	return NULL;
}

/* One notify datagram (waits up to timeout_ms): false when none came. */
bool sup_recv(struct sup *s, int timeout_ms)
{
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += timeout_ms / 1000;
	until.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
	if (until.tv_nsec >= 1000000000) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000;
	}
	struct sup_note m;
	pthread_mutex_lock(&s->mu);
	while (take(s)) /* what came since the receiver last looked */
		;
	while (!s->count && pthread_cond_timedwait(&s->cv, &s->mu, &until) == 0)
		;
	bool got = s->count > 0;
	if (got) {
		m = s->ring[s->head];
		s->head = (s->head + 1) % SUP_RING;
		s->count--;
		pthread_cond_broadcast(&s->cv); /* room for the receiver */
	}
	pthread_mutex_unlock(&s->mu);
	if (!got)
		return false;
	CHECK(!(m.flags & (MSG_CTRUNC | MSG_TRUNC)), "notify message truncated");
	char *data = m.data;
	int *fds = m.fds, nf = m.nf;
	data[m.n] = '\0';
	const char *name = strstr(data, "FDNAME=");
	char nm[256] = "";
	if (name) {
		size_t l = strcspn(name + 7, "\n");
		snprintf(nm, sizeof(nm), "%.*s", (int)l, name + 7);
	}
	if (strstr(data, "READY=1"))
		s->ready = true;
	if (strstr(data, "FDSTOREREMOVE=1")) {
		for (int i = 0; i < s->nstored; i++)
			if (strcmp(s->stored_name[i], nm) == 0) {
				close(s->stored_fd[i]);
				s->stored_fd[i] = s->stored_fd[s->nstored - 1];
				memcpy(s->stored_name[i], s->stored_name[s->nstored - 1], sizeof(s->stored_name[i]));
				s->nstored--;
				break;
			}
		s->removes++;
	}
	if (strstr(data, "FDSTORE=1") && !s->nostore) {
		CHECK(nf == 1 && nm[0], "FDSTORE=1 with %d fds and name '%s'", nf, nm);
		CHECK(s->nstored < MAX_STORED, "too many stored fds");
		s->stored_fd[s->nstored] = fds[0];
		snprintf(s->stored_name[s->nstored], sizeof(s->stored_name[0]), "%s", nm);
		s->nstored++;
	} else {
		for (int i = 0; i < nf; i++)
			close(fds[i]);
	}
	return true;
}

/* Starts aoqd as systemd does: the socket at fd 3, then the stored fds and
 * `extra` (with their names); waits for READY=1. */
void sup_start(struct sup *s, const char *exe, const int *extra, const char *const *extra_names, int nextra)
{
	int src[2 * MAX_STORED + 1], n = 0;
	/* "LISTEN_FDNAMES=aoqd.socket:NAME:..." */
	static char env_names[16 + MAX_STORED * 2 * 257];
	size_t at = (size_t)snprintf(env_names, sizeof(env_names), "LISTEN_FDNAMES=aoqd.socket");
	src[n++] = s->lfd;
	for (int i = 0; i < s->nstored + nextra; i++) {
		CHECK(n < 2 * MAX_STORED + 1, "more than %d fds to pass", 2 * MAX_STORED);
		src[n++] = i < s->nstored ? s->stored_fd[i] : extra[i - s->nstored];
		at += (size_t)snprintf(env_names + at, sizeof(env_names) - at, ":%s",
				       i < s->nstored ? s->stored_name[i] : extra_names[i - s->nstored]);
		CHECK(at < sizeof(env_names), "LISTEN_FDNAMES too long");
	}
	char env_fds[32], env_notify[160], env_pid[32] = "LISTEN_PID=";
	snprintf(env_fds, sizeof(env_fds), "LISTEN_FDS=%d", n);
	snprintf(env_notify, sizeof(env_notify), "NOTIFY_SOCKET=%s", s->notify);
	/* LD_LIBRARY_PATH passed on: a packed aoqd on a machine without its
	 * shared libraries (tests/gpu/run-gpu-tests.sh pack) finds them there */
	static char env_ld[4200];
	const char *ld = getenv("LD_LIBRARY_PATH");
	snprintf(env_ld, sizeof(env_ld), "LD_LIBRARY_PATH=%s", ld ? ld : "");
	char env_kernel[64];
	snprintf(env_kernel, sizeof(env_kernel), "AOQ_KERNEL=%s", s->kernel ? s->kernel : "scalar");
	char *envp[] = { env_fds, env_names, env_notify, env_pid, env_kernel, ld ? env_ld : NULL, NULL };
	char *argv[] = { (char *)exe, "--config", s->conf, NULL };
	int logfd = open(s->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	CHECK(logfd >= 0, "log: %s", strerror(errno));
	s->ready = false;
	pid_t pid = fork();
	CHECK(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		/* LISTEN_PID: our pid, written without stdio */
		char digits[16];
		int k = 0;
		for (pid_t p = getpid(); p; p /= 10)
			digits[k++] = (char)('0' + p % 10);
		char *e = env_pid + strlen(env_pid);
		while (k)
			*e++ = digits[--k];
		*e = '\0';
		/* every fd moved out of the way first: the log's among them (the
		 * passed fds take 3 on, where it may be) */
		int tmp[2 * MAX_STORED + 1];
		for (int i = 0; i < n; i++)
			tmp[i] = fcntl(src[i], F_DUPFD_CLOEXEC, 64);
		int lfd = fcntl(logfd, F_DUPFD_CLOEXEC, 64);
		for (int i = 0; i < n; i++)
			if (tmp[i] < 0 || lfd < 0 || dup2(tmp[i], 3 + i) < 0)
				_exit(126);
		dup2(lfd, 1);
		dup2(lfd, 2);
		execve(exe, argv, envp);
		_exit(127);
	}
	close(logfd);
	s->pid = pid;
	/* the fds passed are the daemon's now (systemd keeps its own copies:
	 * ours stay until FDSTOREREMOVE) */
	for (int t = 0; t < 300 && !s->ready; t++) {
		sup_recv(s, 100);
		int st;
		CHECK(waitpid(pid, &st, WNOHANG) == 0, "aoqd exited before READY=1 (status %d)", st);
	}
	CHECK(s->ready, "no READY=1 within 30 s");
	while (sup_recv(s, 0)) /* FDSTOREREMOVE sent before READY */
		;
}

/* Kills aoqd with sig, waits for it and takes what it stored. */
void sup_kill(struct sup *s, int sig)
{
	CHECK(kill(s->pid, sig) == 0, "kill: %s", strerror(errno));
	int st;
	for (;;) {
		sup_recv(s, 50);
		pid_t w = waitpid(s->pid, &st, WNOHANG);
		if (w == s->pid)
			break;
		CHECK(w == 0, "waitpid: %s", strerror(errno));
	}
	while (sup_recv(s, 0))
		;
	s->pid = -1;
	if (sig == SIGTERM)
		CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "aoqd after SIGTERM: status %#x", st);
}

char *sup_log(struct sup *s)
{
	FILE *f = fopen(s->log, "r");
	CHECK(f, "log: %s", strerror(errno));
	static char buf[1 << 20];
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = '\0';
	fclose(f);
	return buf;
}
