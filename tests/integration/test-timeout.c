/* SPDX-License-Identifier: MIT */
/*
 * libaoq never hangs on a stalled daemon: connecting, each request and each
 * wait have a deadline (aoq_options.timeout_ms) and fail with -ETIMEDOUT
 * and a message once it has passed.
 *
 * 1. A listener whose backlog is full: aoq_connect() times out in connect.
 * 2. A listener that accepts nothing and answers nothing: the handshake
 *    times out.
 * 3. A real aoqd stopped with SIGSTOP after two clients registered: a wait
 *    for a parameter (condition-variable path) and a control request
 *    (socket path) both time out.
 * Each call must return within [timeout, timeout + 3 s].
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#define TIMEOUT_MS 400u

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void check_elapsed(const char *what, double t0)
{
	double dt = now_s() - t0;
	CHECK(dt >= TIMEOUT_MS * 1e-3 * 0.9 && dt < TIMEOUT_MS * 1e-3 + 3.0,
	      "%s returned after %.3f s; the deadline was %u ms", what, dt, TIMEOUT_MS);
}

static int listener(const char *path, int backlog)
{
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	CHECK(fd >= 0, "socket: %s", strerror(errno));
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	unlink(path);
	CHECK(bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(fd, backlog) == 0,
	      "bind/listen %s: %s", path, strerror(errno));
	return fd;
}

static struct aoq_options opts(const char *socket, const char *job)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = socket;
	o.job = job;
	o.timeout_ms = TIMEOUT_MS;
	return o;
}

static void full_backlog(const char *dir)
{
	char path[100];
	snprintf(path, sizeof(path), "%s/full.sock", dir);
	int l = listener(path, 0);
	/* Fill the backlog with connections nobody accepts. */
	int extra[8], n = 0;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	for (; n < 8; n++) {
		extra[n] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
		if (connect(extra[n], (struct sockaddr *)&sa, sizeof(sa)) < 0) {
			close(extra[n]);
			break;
		}
	}
	CHECK(n < 8, "the backlog of a listen(fd, 0) socket never filled");
	struct aoq_options o = opts(path, "full");
	struct aoq_client *c = NULL;
	double t0 = now_s();
	int r = aoq_connect(&c, &o);
	CHECK(r == -ETIMEDOUT, "connect to a full backlog: %d (%s), expected -ETIMEDOUT", r, aoq_last_error());
	check_elapsed("aoq_connect to a full backlog", t0);
	CHECK(strstr(aoq_last_error(), "did not accept"), "message: %s", aoq_last_error());
	for (int i = 0; i < n; i++)
		close(extra[i]);
	close(l);
	unlink(path);
}

static void silent_listener(const char *dir)
{
	char path[100];
	snprintf(path, sizeof(path), "%s/silent.sock", dir);
	int l = listener(path, 16);
	struct aoq_options o = opts(path, "silent");
	struct aoq_client *c = NULL;
	double t0 = now_s();
	int r = aoq_connect(&c, &o);
	CHECK(r == -ETIMEDOUT, "handshake with a silent listener: %d (%s), expected -ETIMEDOUT", r, aoq_last_error());
	check_elapsed("aoq_connect to a silent listener", t0);
	CHECK(strstr(aoq_last_error(), "did not answer"), "message: %s", aoq_last_error());
	close(l);
	unlink(path);
}

static struct aoq_client *trainer(const char *socket, const char *job, float *param, float *grad, size_t n)
{
	struct aoq_options o = opts(socket, job);
	struct aoq_client *c;
	CHECK_OK(aoq_connect(&c, &o));
	struct aoq_group g = { .size = sizeof(g), .kind = AOQ_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	CHECK_OK(aoq_add_group(c, &g));
	struct aoq_tensor t = { .size = sizeof(t), .name = "w", .numel = n, .param_dtype = AOQ_FP32, .grad_dtype = AOQ_FP32,
	                        .group = 0, .param = param, .grad = grad };
	CHECK(aoq_add_tensor(c, &t) == 0, "add tensor: %s", aoq_last_error());
	CHECK_OK(aoq_register(c));
	return c;
}

static void stopped_daemon(const char *aoqd)
{
	struct aoqt_daemon d;
	CHECK_OK(aoqt_daemon_start(&d, aoqd, NULL));
	enum { N = 1000 };
	static float p1[N], g1[N], p2[N], g2[N];
	for (int i = 0; i < N; i++)
		p1[i] = p2[i] = 1.0f, g1[i] = g2[i] = 0.5f;
	struct aoq_client *a = trainer(d.socket, "stop-a", p1, g1, N);
	struct aoq_client *b = trainer(d.socket, "stop-b", p2, g2, N);
	/* One good step first: the deadline does not fire on a live daemon. */
	CHECK_OK(aoq_push_grad(a, 0, 0, NULL));
	CHECK_OK(aoq_step_end(a));
	CHECK_OK(aoq_sync(a, NULL));

	CHECK(kill(d.pid, SIGSTOP) == 0, "SIGSTOP: %s", strerror(errno));
	CHECK_OK(aoq_push_grad(a, 0, 0, NULL));
	double t0 = now_s();
	int r = aoq_sync_param(a, 0);
	CHECK(r == -ETIMEDOUT, "wait for a parameter from a stopped daemon: %d (%s)", r, aoq_last_error());
	check_elapsed("aoq_sync_param", t0);
	CHECK(strstr(aoq_last_error(), "did not answer"), "message: %s", aoq_last_error());
	/* The session is over: later calls fail at once. */
	t0 = now_s();
	r = aoq_step_end(a);
	CHECK(r < 0 && now_s() - t0 < 1.0, "a call after the timeout: %d after %.3f s", r, now_s() - t0);

	struct aoq_group hp = { .size = sizeof(hp), .kind = AOQ_ADAMW, .lr = 2e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	t0 = now_s();
	r = aoq_set_hyperparams(b, 0, &hp);
	CHECK(r == -ETIMEDOUT, "a request to a stopped daemon: %d (%s)", r, aoq_last_error());
	check_elapsed("aoq_set_hyperparams", t0);

	CHECK(kill(d.pid, SIGCONT) == 0, "SIGCONT: %s", strerror(errno));
	aoq_close(a);
	aoq_close(b);
	CHECK(aoqt_daemon_stop(&d, 10000, true) == 0, "aoqd did not stop cleanly");
}

int main(int argc, char **argv)
{
	aoqt_init("timeout");
	const char *aoqd = aoqt_aoqd_path(argc, argv);
	char dir[] = "/tmp/aoqt-to-XXXXXX";
	CHECK(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
	full_backlog(dir);
	silent_listener(dir);
	stopped_daemon(aoqd);
	rmdir(dir);
	printf("ok\n");
	return 0;
}
