/* SPDX-License-Identifier: MIT */
/*
 * A restart that loses no step (docs/design.md, "The fd store"), through a
 * small supervisor that does what systemd does for aoqd.service: it makes
 * the listening socket and the notify datagram socket (NOTIFY_SOCKET),
 * receives READY=1 and FDSTORE=1 messages with their fds (SCM_RIGHTS),
 * kills aoqd mid-step and starts it again with LISTEN_FDS, LISTEN_PID and
 * LISTEN_FDNAMES: the socket, then the stored fds.  A libaoq trainer
 * trains through it, reconnects, resumes and must end bit for bit where
 * an undisturbed run of the same job ends (parameters, masters, moments,
 * step counters).
 *
 *   term: SIGTERM mid-step; the states come back from the store, with four
 *         hostile fds beside them (unsealed, damaged descriptor, cut short,
 *         a pipe), each refused and logged; no snapshot exists to read.
 *   kill: SIGKILL mid-step; nothing reaches the store and the restart
 *         falls back to the periodic snapshots, as without systemd.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#define NT 4
#define STEPS 10
#define KILL_AT 6 /* the step in progress when aoqd goes */
static const uint64_t sizes[NT] = { 1000, 4097, 33, 70001 };
static const enum aoq_dtype pdt[NT] = { AOQ_FP32, AOQ_FP32, AOQ_BF16, AOQ_FP32 };

/* ---- the supervisor ---- */

#define MAX_STORED 16
struct sup {
	char dir[64], sock[108], notify[108], log[128], state[128], conf[128];
	int lfd, nfd;
	pid_t pid;
	int nstored;
	int stored_fd[MAX_STORED];
	char stored_name[MAX_STORED][256];
	int removes; /* FDSTOREREMOVE=1 seen */
	bool ready;
};

static void sup_init(struct sup *s, bool snapshots)
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
}

/* One notify datagram (waits up to timeout_ms): false when none came. */
static bool sup_recv(struct sup *s, int timeout_ms)
{
	struct pollfd p = { .fd = s->nfd, .events = POLLIN };
	if (poll(&p, 1, timeout_ms) <= 0)
		return false;
	char data[4096];
	union {
		char buf[CMSG_SPACE(sizeof(int) * 32) + CMSG_SPACE(sizeof(struct ucred))];
		struct cmsghdr align;
	} cm;
	struct iovec iov = { data, sizeof(data) - 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.buf, .msg_controllen = sizeof(cm.buf) };
	ssize_t n = recvmsg(s->nfd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
	if (n < 0)
		return false;
	CHECK(!(mh.msg_flags & (MSG_CTRUNC | MSG_TRUNC)), "notify message truncated");
	data[n] = '\0';
	int fds[32], nf = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
			memcpy(fds + nf, CMSG_DATA(c), sizeof(int) * (size_t)k);
			nf += k;
		}
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
	if (strstr(data, "FDSTORE=1")) {
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
static void sup_start(struct sup *s, const char *exe, const int *extra, const char *const *extra_names, int nextra)
{
	int src[2 * MAX_STORED + 1], n = 0;
	char names[4096] = "aoqd.socket";
	src[n++] = s->lfd;
	for (int i = 0; i < s->nstored; i++) {
		src[n++] = s->stored_fd[i];
		strcat(names, ":");
		strcat(names, s->stored_name[i]);
	}
	for (int i = 0; i < nextra; i++) {
		src[n++] = extra[i];
		strcat(names, ":");
		strcat(names, extra_names[i]);
	}
	char env_fds[32], env_names[4200], env_notify[160], env_pid[32] = "LISTEN_PID=";
	snprintf(env_fds, sizeof(env_fds), "LISTEN_FDS=%d", n);
	snprintf(env_names, sizeof(env_names), "LISTEN_FDNAMES=%s", names);
	snprintf(env_notify, sizeof(env_notify), "NOTIFY_SOCKET=%s", s->notify);
	char *envp[] = { env_fds, env_names, env_notify, env_pid, "AOQ_KERNEL=scalar", NULL };
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
		int tmp[2 * MAX_STORED + 1];
		for (int i = 0; i < n; i++)
			tmp[i] = fcntl(src[i], F_DUPFD_CLOEXEC, 64);
		for (int i = 0; i < n; i++)
			if (tmp[i] < 0 || dup2(tmp[i], 3 + i) < 0)
				_exit(126);
		dup2(logfd, 1);
		dup2(logfd, 2);
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
static void sup_kill(struct sup *s, int sig)
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

static char *sup_log(struct sup *s)
{
	FILE *f = fopen(s->log, "r");
	CHECK(f, "log: %s", strerror(errno));
	static char buf[1 << 20];
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = '\0';
	fclose(f);
	return buf;
}

static int count(const char *hay, const char *needle)
{
	int n = 0;
	for (const char *p = hay; (p = strstr(p, needle)); p++)
		n++;
	return n;
}

/* ---- the trainer ---- */

struct trainer {
	struct aoq_client *c;
	void *param[NT];
	void *grad[NT];
};

static struct aoq_group group(uint32_t g, uint64_t k)
{
	return aoqt_victim_group(g, k);
}

/* Connects and registers job with parameters p0 (fresh) or the resumed
 * ones; returns the resumed step (0: afresh). */
static uint64_t trainer_open(struct trainer *t, const char *sock, const char *job, bool fresh)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	o.job = job;
	o.timeout_ms = 30000;
	o.seed = 12345;
	CHECK_OK(aoq_connect(&t->c, &o));
	for (uint32_t g = 0; g < 2; g++) {
		struct aoq_group h = group(g, 1);
		CHECK_OK(aoq_add_group(t->c, &h));
	}
	for (int i = 0; i < NT; i++) {
		size_t es = aoqt_dtype_size(pdt[i]);
		if (!t->param[i]) {
			t->param[i] = aoqt_xcalloc(sizes[i], es);
			t->grad[i] = aoqt_xcalloc(sizes[i], es);
		}
		if (fresh) {
			struct aoqt_rng r = aoqt_rng_for(7, (uint64_t)i, 1);
			for (uint64_t e = 0; e < sizes[i]; e++)
				aoqt_store(t->param[i], e, pdt[i], aoqt_uniform(&r));
		}
		char name[16];
		snprintf(name, sizeof(name), "w%d", i);
		struct aoq_tensor d = AOQ_TENSOR_INIT;
		d.name = name;
		d.numel = sizes[i];
		d.param_dtype = d.grad_dtype = pdt[i];
		d.group = (uint32_t)i % 2;
		d.param = t->param[i];
		d.grad = t->grad[i];
		CHECK_OK(aoq_add_tensor(t->c, &d));
	}
	CHECK_OK(aoq_register(t->c));
	uint64_t step = 0;
	int r = aoq_resumed(t->c, &step);
	CHECK(r >= 0, "aoq_resumed: %d", r);
	return r ? step : 0;
}

static void fill_grad(struct trainer *t, int i, uint64_t k)
{
	struct aoqt_rng r = aoqt_rng_for(k, (uint64_t)i, 2);
	for (uint64_t e = 0; e < sizes[i]; e++)
		aoqt_store(t->grad[i], e, pdt[i], 0.1 * aoqt_uniform(&r));
}

/* Step k; with `part` only the first two tensors are pushed and the first
 * one's update waited for: the step stays open, half done. */
static int trainer_step(struct trainer *t, uint64_t k, bool part)
{
	int r;
	for (uint32_t g = 0; g < 2; g++) {
		struct aoq_group h = group(g, k);
		if ((r = aoq_set_hyperparams(t->c, g, &h)) < 0)
			return r;
	}
	for (int i = 0; i < (part ? 2 : NT); i++) {
		fill_grad(t, i, k);
		if ((r = aoq_push_grad(t->c, (uint32_t)i, 0, NULL)) < 0)
			return r;
	}
	if (part)
		return aoq_sync_param(t->c, 0);
	struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
	if ((r = aoq_step_end(t->c)) < 0 || (r = aoq_sync(t->c, &res)) < 0)
		return r;
	CHECK(res.step == k && res.tensors_updated == NT, "step %" PRIu64 ": result step %" PRIu64 ", %" PRIu64
	      " tensors", k, res.step, res.tensors_updated);
	return 0;
}

/* Everything of the trainer's state: params, masters and moments as fp32,
 * step counters. */
struct image {
	float *v[NT][4];
	uint64_t steps[NT];
};

static void image_take(struct trainer *t, struct image *im)
{
	for (int i = 0; i < NT; i++) {
		size_t es = aoqt_dtype_size(pdt[i]);
		im->v[i][0] = aoqt_xcalloc(sizes[i], es);
		memcpy(im->v[i][0], t->param[i], sizes[i] * es);
		const enum aoq_state_kind kinds[3] = { AOQ_MASTER, AOQ_EXP_AVG, AOQ_EXP_AVG_SQ };
		for (int k = 0; k < 3; k++) {
			im->v[i][k + 1] = aoqt_xcalloc(sizes[i], sizeof(float));
			CHECK_OK(aoq_read_state(t->c, (uint32_t)i, kinds[k], AOQ_FP32, 0, sizes[i], im->v[i][k + 1]));
		}
	}
	CHECK_OK(aoq_get_tensor_steps(t->c, 0, NT, im->steps));
}

static void image_same(const struct image *a, const struct image *b, const char *what)
{
	static const char *const kn[4] = { "param", "master", "exp_avg", "exp_avg_sq" };
	for (int i = 0; i < NT; i++) {
		CHECK(a->steps[i] == b->steps[i], "%s: tensor %d steps %" PRIu64 " vs %" PRIu64, what, i, a->steps[i],
		      b->steps[i]);
		for (int k = 0; k < 4; k++) {
			size_t bytes = sizes[i] * (k == 0 ? aoqt_dtype_size(pdt[i]) : sizeof(float));
			if (memcmp(a->v[i][k], b->v[i][k], bytes) != 0) {
				size_t e = 0;
				const uint8_t *x = (const uint8_t *)a->v[i][k], *y = (const uint8_t *)b->v[i][k];
				while (x[e] == y[e])
					e++;
				aoqt_fail("%s: tensor %d %s differs from the undisturbed run (first at byte %zu)", what, i,
				          kn[k], e);
			}
		}
	}
}

static void trainer_close(struct trainer *t)
{
	if (t->c)
		aoq_close(t->c);
	t->c = NULL;
}

/* ---- hostile fds beside the real ones ---- */

static int sealed_copy(int src, off_t cut, off_t flip)
{
	struct stat sb;
	CHECK(fstat(src, &sb) == 0, "fstat");
	off_t len = sb.st_size - cut;
	int fd = memfd_create("bad", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	CHECK(fd >= 0 && ftruncate(fd, len) == 0, "memfd: %s", strerror(errno));
	char buf[65536];
	for (off_t o = 0; o < len;) {
		ssize_t n = pread(src, buf, (size_t)(len - o < (off_t)sizeof(buf) ? len - o : (off_t)sizeof(buf)), o);
		CHECK(n > 0, "pread: %s", strerror(errno));
		if (flip >= o && flip < o + n)
			buf[flip - o] ^= 0x40;
		CHECK(pwrite(fd, buf, (size_t)n, o) == n, "pwrite");
		o += n;
	}
	CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) == 0, "seal");
	return fd;
}

int main(int argc, char **argv)
{
	aoqt_init("integration-fdstore");
	const char *exe = aoqt_aoqd_path(argc, argv);
	const char *mode = argc > 2 ? argv[2] : "term";
	bool term = strcmp(mode, "term") == 0;
	CHECK(term || strcmp(mode, "kill") == 0, "mode '%s': term or kill", mode);
	signal(SIGPIPE, SIG_IGN);

	struct sup s;
	sup_init(&s, !term);
	sup_start(&s, exe, NULL, NULL, 0);

	/* The undisturbed run, and its image after every step. */
	struct trainer ref = { 0 };
	static struct image at[STEPS + 1];
	CHECK(trainer_open(&ref, s.sock, "undisturbed", true) == 0, "a fresh job resumed");
	for (uint64_t k = 1; k <= STEPS; k++) {
		CHECK_OK(trainer_step(&ref, k, false));
		image_take(&ref, &at[k]);
	}
	trainer_close(&ref);

	/* The same job, with aoqd going mid-step. */
	struct trainer run = { 0 };
	CHECK(trainer_open(&run, s.sock, "restarted", true) == 0, "a fresh job resumed");
	int ino = inotify_init1(IN_CLOEXEC);
	CHECK(ino >= 0 && inotify_add_watch(ino, s.state, IN_MOVED_TO) >= 0, "inotify: %s", strerror(errno));
	for (uint64_t k = 1; k < KILL_AT; k++) {
		CHECK_OK(trainer_step(&run, k, false));
		if (!term && k == 2) {
			/* kill: a snapshot of this job on disk before going on */
			bool ours = false;
			while (!ours) {
				struct pollfd p = { .fd = ino, .events = POLLIN };
				CHECK(poll(&p, 1, 20000) == 1, "no snapshot of the job written within 20 s");
				union {
					char b[4096];
					struct inotify_event align;
				} ev;
				ssize_t n = read(ino, ev.b, sizeof(ev.b));
				for (ssize_t o = 0; o + (ssize_t)sizeof(struct inotify_event) <= n;) {
					const struct inotify_event *e = (const struct inotify_event *)(const void *)(ev.b + o);
					ours |= e->len && strstr(e->name, "-restarted-");
					o += (ssize_t)sizeof(*e) + e->len;
				}
			}
		}
	}
	close(ino);
	CHECK_OK(trainer_step(&run, KILL_AT, true));
	size_t before = strlen(sup_log(&s));
	sup_kill(&s, term ? SIGTERM : SIGKILL);
	const char *log = sup_log(&s) + before;
	printf("--- aoqd's log from the kill on ---\n%s---\n", log);
	if (term) {
		CHECK(s.nstored == 1, "%d states in the store after SIGTERM, want 1 (the job's)", s.nstored);
		CHECK(strstr(log, "kept in the fd store"), "no 'kept in the fd store' in the log");
	} else {
		CHECK(s.nstored == 0, "%d states in the store after SIGKILL", s.nstored);
	}
	/* The trainer sees its daemon gone. */
	int r = aoq_push_grad(run.c, 2, 0, NULL);
	if (r >= 0)
		r = aoq_step_end(run.c);
	if (r >= 0)
		r = aoq_sync(run.c, NULL);
	CHECK(r < 0, "a step went through a dead daemon");
	trainer_close(&run);

	int extra[4] = { -1, -1, -1, -1 };
	const char *const extra_names[4] = { "aoq-state-900001", "aoq-state-900002", "aoq-state-900003",
	                                     "aoq-state-900004" };
	int nextra = 0, pipefd[2] = { -1, -1 };
	if (term) {
		/* unsealed */
		extra[0] = memfd_create("bad", MFD_CLOEXEC | MFD_ALLOW_SEALING);
		CHECK(extra[0] >= 0 && ftruncate(extra[0], 1 << 16) == 0, "memfd");
		extra[1] = sealed_copy(s.stored_fd[0], 0, 100); /* a descriptor byte flipped */
		extra[2] = sealed_copy(s.stored_fd[0], 4096, -1); /* cut short */
		CHECK(pipe2(pipefd, O_CLOEXEC) == 0, "pipe");
		extra[3] = pipefd[0];
		nextra = 4;
	}
	int stored = s.nstored;
	before = strlen(sup_log(&s));
	sup_start(&s, exe, extra, extra_names, nextra);
	log = sup_log(&s) + before;
	printf("--- the restarted aoqd's log up to READY=1 ---\n%s---\n", log);
	for (int i = 0; i < nextra; i++)
		close(extra[i]);
	if (pipefd[1] >= 0)
		close(pipefd[1]);
	if (term) {
		CHECK(count(log, "refused") == 4, "%d 'refused' lines for the 4 hostile fds:\n%s", count(log, "refused"),
		      log);
		CHECK(strstr(log, "taken back from the fd store"), "the stored state was not taken back:\n%s", log);
		CHECK(s.removes == stored + nextra && s.nstored == 0, "%d FDSTOREREMOVE for %d fds; %d left", s.removes,
		      stored + nextra, s.nstored);
		CHECK(!strstr(log, "from its snapshot") && !strstr(log, "restored uid"), "a snapshot was read:\n%s", log);
	} else {
		CHECK(strstr(log, "from its snapshot"), "no snapshot restored after SIGKILL:\n%s", log);
	}

	/* The trainer comes back and resumes at its last completed step. */
	uint64_t resumed = trainer_open(&run, s.sock, "restarted", false);
	if (term)
		CHECK(resumed == KILL_AT - 1, "resumed at step %" PRIu64 ", want %d", resumed, KILL_AT - 1);
	else
		CHECK(resumed >= 1 && resumed < KILL_AT, "resumed at step %" PRIu64 " from the snapshots", resumed);
	struct image now;
	image_take(&run, &now);
	image_same(&now, &at[resumed], "at the resume");
	for (uint64_t k = resumed + 1; k <= STEPS; k++)
		CHECK_OK(trainer_step(&run, k, false));
	image_take(&run, &now);
	image_same(&now, &at[STEPS], "at the end");
	trainer_close(&run);

	/* Every session ended with a Bye: the next stop stores nothing. */
	sup_kill(&s, SIGTERM);
	CHECK(s.nstored == 0, "%d states stored after every trainer said Bye", s.nstored);
	printf("ok: %s, resumed at step %" PRIu64 ", bit-exact after %d steps\n", mode, resumed, STEPS);
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s.dir);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", s.dir);
	return 0;
}
