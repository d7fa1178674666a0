/* SPDX-License-Identifier: MIT */
/*
 * A shared training node (docs/design.md, "Shared nodes"): local users of
 * other uids attack aoqd while a victim trainer (libaoq, host backend, root)
 * trains.  Each case
 * (--case NAME) starts its own daemon, starts the victim, measures its step
 * latency undisturbed (the baseline), runs the attack as another uid
 * (`setpriv --reuid --regid --clear-groups`, this binary re-executed in an
 * attacker mode), checks what the attack must not achieve, and then asks of
 * the victim:
 *   - it made progress during the attack and finished every step with a
 *     result checked against the harness's double reference;
 *   - its parameters equal, bit for bit, those of the same inputs run alone
 *     on the same daemon afterwards;
 *   - no step took longer than the case's bound: LAT_HANG_MS (5 s) for the
 *     attacks that used to hang or lock out the daemon (before the fixes:
 *     forever), and for the stall case the baseline's slowest step plus
 *     LAT_STALL_MS (1 s; before the fix: 17 s); both times 5 under
 *     AOQ_TEST_SLOW and in sanitizer builds.  The bounds leave room for a
 *     loaded 2-core CI machine; the daemon's own design bound is a few ms
 *     (16 frames per connection per turn, Stats in O(sessions));
 * and the daemon still exits 0 on SIGTERM.
 *
 * Cases:
 *   doorbell   (1) the attacker clears O_NONBLOCK on the doorbells it was
 *              given and saturates them, in sessions whose answers wake it
 *              from the workers and (producer_waiting) from the loop;
 *   stall      (2) an unfinished registration of 2^19 tensors (frames of
 *              4,096, the most the daemon takes), then 500 pipelined
 *              StatsRequests;
 *   lockout    (3) 1,100 idle connections from one uid, a daemon started
 *              with a soft RLIMIT_NOFILE of 1024: other uids' trainers and
 *              observers still connect, over-cap connections get a QUOTA
 *              Error before the close, idle ones go at the handshake
 *              deadline;
 *   halfframes (3) 100 connections each holding 1 MiB - 1 of a frame: the
 *              daemon's memory does not grow by 100 MiB;
 *   quota      (4) with max_state_bytes_per_uid = 64M: 100,000 one-element
 *              tensors, an unfinished registration of 120,000 tensors with
 *              1,000-byte names, and a session whose accumulation buffer
 *              would pass the quota: the daemon's RSS grows by at most the
 *              quota plus 48 MiB, and the accumulation is refused (QUOTA);
 *   quota-default (4) without a config (max_state_bytes_per_uid = auto): a
 *              uid alone registers a session holding 75% of the machine's
 *              memory (fp32 state of 28%, its undo copy and its arena:
 *              a single-user node needs no config change) but not one of
 *              27% more (past 90%); beside another uid's trainer one uid
 *              cannot register state of 60% (its share is half);
 *              deploy/aoqd.conf's stated default parses;
 *   identity   (5) a Hello claiming pid 1 with a job name holding a newline
 *              and device name holding an escape: stats show the peer's real
 *              pid, the log has no forged line and no raw control byte; a
 *              non-admin uid sees no daemon-wide figures;
 *   requests   (6) Register without groups or tensors (INVALID), TensorSteps
 *              of 2^64-1 (refused), two final records of the same half of a
 *              tensor (BAD_RECORD), admin_gid through a supplementary group,
 *              and every way to write its own masters memfd (a reopen for
 *              writing through /proc, chmod, a writable mapping, write,
 *              resize, a punched hole, a seal) refused.
 *
 * Needs root (setpriv to other uids); exits 77 (skip) otherwise.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define ATT_UID 65534u   /* the attacker */
#define OTHER_UID 65533u /* a bystander: an observer of another uid */
#define ADMIN_GID 4242u
#define LAT_HANG_MS 5000.0
#define LAT_STALL_MS 1000.0

static struct aoqt_daemon daemon_;
static bool slow;
static char self_exe[4096];

/* ---- the victim trainer ------------------------------------------------- */

#define TT 3
static const struct aoqt_tdesc tdesc[TT] = {
	{ 4097, AOQ_FP32, AOQ_FP32, 0 },
	{ 65539, AOQ_BF16, AOQ_BF16, 1 },
	{ 1000, AOQ_FP16, AOQ_FP32, 0 },
};

#define MAX_STEPS 20000
struct victim {
	const char *job;
	uint64_t steps;            /* exactly this many, or 0: until stop */
	atomic_bool stop;
	_Atomic uint64_t min_steps;
	_Atomic uint64_t done;
	void *param[TT];
	uint64_t final_steps;
	double *lat_ms;            /* [k] latency of step k (1-based) */
	int err;                   /* a failure of the connection itself */
};

static void *victim_run(void *arg)
{
	struct victim *v = arg;
	struct aoqt_victim vt;
	v->lat_ms = aoqt_xcalloc(MAX_STEPS + 2, sizeof(double));
	/* A stalled daemon fails the step instead of hanging the test. */
	aoqt_victim_open(&vt, daemon_.socket, v->job, slow ? 120000 : 30000, tdesc, TT, 0x5151, 0x6262, v->param);
	uint64_t k = 0;
	for (;;) {
		if (v->steps ? k >= v->steps : (atomic_load(&v->stop) && k >= atomic_load(&v->min_steps)))
			break;
		k++;
		CHECK(k < MAX_STEPS, "victim: runaway");
		double t0 = aoqt_now();
		aoqt_victim_step(&vt, k);
		v->lat_ms[k] = (aoqt_now() - t0) * 1e3;
		atomic_store(&v->done, k);
	}
	v->final_steps = k;
	aoqt_victim_close(&vt);
	return NULL;
}

static void wait_steps(struct victim *v, uint64_t target, double timeout_ms, const char *what)
{
	double end = aoqt_now() + timeout_ms / 1e3;
	while (atomic_load(&v->done) < target) {
		CHECK(aoqt_now() < end, "%s: the victim is at step %" PRIu64 " after %.0f ms, want %" PRIu64
		      " (stalled)", what, atomic_load(&v->done), timeout_ms, target);
		usleep(2000);
	}
}

static double max_lat(const struct victim *v, uint64_t from, uint64_t to)
{
	double m = 0;
	for (uint64_t k = from; k <= to && k < MAX_STEPS; k++)
		if (v->lat_ms[k] > m)
			m = v->lat_ms[k];
	return m;
}

/* ---- attackers: this binary under setpriv -------------------------------- */

struct attacker {
	pid_t pid;
	int cmd;  /* its stdin */
	int out;  /* its stdout */
	char buf[8192];
	size_t len;
};

/* groups: NULL for --clear-groups, else "--groups=..." */
static void att_start(struct attacker *a, const char *mode, uid_t uid, const char *groups, const char *arg)
{
	int in[2], out[2];
	CHECK(pipe2(in, O_CLOEXEC) == 0 && pipe2(out, O_CLOEXEC) == 0, "pipe2");
	char ru[32], rg[32];
	snprintf(ru, sizeof(ru), "--reuid=%u", (unsigned)uid);
	snprintf(rg, sizeof(rg), "--regid=%u", (unsigned)uid);
	const char *argv[16];
	int n = 0;
	argv[n++] = "setpriv";
	argv[n++] = ru;
	argv[n++] = rg;
	argv[n++] = groups ? groups : "--clear-groups";
	argv[n++] = "--";
	argv[n++] = self_exe;
	argv[n++] = "--attacker";
	argv[n++] = mode;
	argv[n++] = daemon_.socket;
	argv[n++] = arg ? arg : "-";
	argv[n] = NULL;
	/* An attacker's leaks are no finding (and LeakSanitizer cannot stop
	 * the world of a process that changed its uid).  The environment is
	 * built before fork: the child of a threaded process only execs. */
	extern char **environ;
	static char opts[512];
	static char *envp[512];
	const char *asan = getenv("ASAN_OPTIONS");
	snprintf(opts, sizeof(opts), "ASAN_OPTIONS=%s%sdetect_leaks=0", asan ? asan : "", asan && *asan ? ":" : "");
	int ne = 0;
	for (char **e = environ; *e && ne < 510; e++)
		if (strncmp(*e, "ASAN_OPTIONS=", 13) != 0)
			envp[ne++] = *e;
	envp[ne++] = opts;
	envp[ne] = NULL;
	memset(a, 0, sizeof(*a));
	a->pid = fork();
	CHECK(a->pid >= 0, "fork");
	if (a->pid == 0) {
		dup2(in[0], STDIN_FILENO);
		dup2(out[1], STDOUT_FILENO);
		execvpe("setpriv", (char *const *)argv, envp);
		_exit(127);
	}
	close(in[0]);
	close(out[1]);
	a->cmd = in[1];
	a->out = out[0];
}

/* The attacker's next line (without the newline). */
static void att_line(struct attacker *a, char *line, size_t cap, double timeout_ms, const char *what)
{
	double end = aoqt_now() + timeout_ms / 1e3;
	for (;;) {
		char *nl = memchr(a->buf, '\n', a->len);
		if (nl) {
			size_t l = (size_t)(nl - a->buf);
			snprintf(line, cap, "%.*s", (int)l, a->buf);
			memmove(a->buf, nl + 1, a->len - l - 1);
			a->len -= l + 1;
			printf("  attacker: %s\n", line);
			return;
		}
		double left = end - aoqt_now();
		CHECK(left > 0, "%s: no word from the attacker within %.0f ms", what, timeout_ms);
		struct pollfd pf = { .fd = a->out, .events = POLLIN };
		int r = poll(&pf, 1, (int)(left * 1e3) + 1);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			continue;
		CHECK(a->len < sizeof(a->buf) - 1, "attacker line too long");
		ssize_t got = read(a->out, a->buf + a->len, sizeof(a->buf) - 1 - a->len);
		CHECK(got > 0, "%s: the attacker exited (%zd)", what, got);
		a->len += (size_t)got;
	}
}

static void att_say(struct attacker *a, const char *cmd)
{
	CHECK(write(a->cmd, cmd, strlen(cmd)) == (ssize_t)strlen(cmd), "write to the attacker");
}

static void att_stop(struct attacker *a)
{
	close(a->cmd);
	close(a->out);
	double end = aoqt_now() + 20;
	int st;
	while (waitpid(a->pid, &st, WNOHANG) == 0) {
		if (aoqt_now() > end) {
			kill(a->pid, SIGKILL);
			waitpid(a->pid, &st, 0);
			break;
		}
		usleep(10000);
	}
}

/* ---- attacker side -------------------------------------------------------- */

static const char *att_sock;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	putchar('\n');
	fflush(stdout);
}

/* The next command from the parent; false at EOF. */
static bool hear(char *buf, size_t cap)
{
	size_t n = 0;
	while (n + 1 < cap) {
		char ch;
		ssize_t r = read(STDIN_FILENO, &ch, 1);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return false;
		if (ch == '\n')
			break;
		buf[n++] = ch;
	}
	buf[n] = 0;
	return true;
}

static void hold_until_eof(void)
{
	char b[64];
	while (hear(b, sizeof(b)))
		;
}

static void send_all(int fd, const void *p, size_t n)
{
	const uint8_t *b = p;
	while (n) {
		ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && errno == EAGAIN) {
			struct pollfd pf = { .fd = fd, .events = POLLOUT };
			if (poll(&pf, 1, 2000) <= 0)
				return;
			continue;
		}
		if (w < 0)
			return;
		b += w;
		n -= (size_t)w;
	}
}

static size_t frame_of(Aoq__Envelope__MsgCase c, void *msg, uint8_t **buf)
{
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = c;
	env.hello = msg;
	size_t len = 0;
	if (aoq_frame_encode(&env, buf, &len) < 0)
		exit(3);
	return len;
}

static void hello_msg(Aoq__Hello *h, const char *job, bool observer)
{
	aoq__hello__init(h);
	h->protocol_version = AOQ_PROTOCOL_VERSION;
	h->arena_version = AOQ_ARENA_VERSION;
	h->job = (char *)job;
	h->device = (char *)"cpu";
	h->pid = (uint32_t)getpid();
	h->observer = observer;
}

static Aoq__Hyperparams att_hp = AOQ__HYPERPARAMS__INIT;
static Aoq__Group att_group = AOQ__GROUP__INIT;

static void att_group_init(void)
{
	att_hp.lr = 1e-3;
	att_hp.beta1 = 0.9;
	att_hp.beta2 = 0.999;
	att_hp.eps = 1e-8;
	att_group.kind = AOQ__OPTIMIZER_KIND__ADAMW;
	att_group.hp = &att_hp;
}

/* One Register frame of n tensors named by fmt(i) (first frame carries
 * the group when with_group). */
static size_t register_frame(uint8_t **buf, uint32_t first, uint32_t n, uint64_t numel, size_t name_len,
                             bool with_group, bool more)
{
	Aoq__TensorDesc *td = aoqt_xcalloc(n, sizeof(*td));
	Aoq__TensorDesc **tp = aoqt_xcalloc(n, sizeof(*tp));
	char *names = aoqt_xmalloc((size_t)n * (name_len + 16));
	for (uint32_t i = 0; i < n; i++) {
		char *nm = names + (size_t)i * (name_len + 16);
		int l = snprintf(nm, 16, "t%u", first + i);
		if (name_len > (size_t)l) {
			memset(nm + l, 'n', name_len - (size_t)l);
			nm[name_len] = 0;
		}
		aoq__tensor_desc__init(&td[i]);
		td[i].name = nm;
		td[i].numel = numel;
		td[i].param_dtype = AOQ__DTYPE__FP32;
		td[i].grad_dtype = AOQ__DTYPE__FP32;
		tp[i] = &td[i];
	}
	Aoq__Group *gp = &att_group;
	Aoq__Register reg = AOQ__REGISTER__INIT;
	reg.n_groups = with_group ? 1 : 0;
	reg.groups = with_group ? &gp : NULL;
	reg.n_tensors = n;
	reg.tensors = tp;
	reg.more = more;
	size_t len = frame_of(AOQ__ENVELOPE__MSG_REGISTER, &reg, buf);
	free(td);
	free(tp);
	free(names);
	return len;
}

static void set_blocking(int fd)
{
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
}

/* Makes the doorbell the daemon writes block on its next write: blocking
 * mode, counter one below its maximum (for an eventfd; harmless data for
 * anything else). */
static void jam(struct aoqt_raw *s)
{
	set_blocking(s->to_client);
	set_blocking(s->to_daemon);
	uint64_t big = 0xfffffffffffffffeull;
	struct pollfd pf = { .fd = s->to_client, .events = POLLOUT };
	if (poll(&pf, 1, 0) == 1 && (pf.revents & POLLOUT)) {
		ssize_t r = write(s->to_client, &big, 8);
		(void)r; /* a one-way socket refuses it: fine */
	}
}

static int att_doorbell(void)
{
	struct aoqt_raw s[4];
	uint64_t n1[1] = { 4097 };
	/* Three sessions whose answers a worker posts (2 workers). */
	for (int i = 0; i < 3; i++) {
		char job[32];
		snprintf(job, sizeof(job), "att-bell-w%d", i);
		if (aoqt_raw_open(&s[i], att_sock, job, n1, 1) < 0) {
			say("open-failed %d", i);
			hold_until_eof();
			return 0;
		}
		jam(&s[i]);
		struct aoq_rec rec = { .tensor = 0, .slot = 0, .count = 4097, .step = 1 };
		aoq_ring_push(&s[i].prod, &rec);
		uint64_t one = 1;
		if (write(s[i].to_daemon, &one, 8) != 8)
			say("ring-failed");
	}
	/* One whose pop the loop answers through the doorbell. */
	if (aoqt_raw_open(&s[3], att_sock, "att-bell-loop", n1, 1) < 0) {
		say("open-failed 3");
		hold_until_eof();
		return 0;
	}
	jam(&s[3]);
	atomic_store(&s[3].prod.ring->producer_waiting, 1);
	struct aoq_rec rec = { .tensor = 0, .slot = 0, .count = 4097, .step = 1 };
	aoq_ring_push(&s[3].prod, &rec);
	uint64_t one = 1;
	if (write(s[3].to_daemon, &one, 8) != 8)
		say("ring-failed");
	say("attacked");
	hold_until_eof();
	return 0;
}

static int att_stall(const char *arg)
{
	uint32_t total = 1u << 19, per = 4096, stats = 500;
	int fd = aoqt_raw_connect(att_sock);
	if (fd < 0 || aoqt_raw_hello(fd, "att-stall", 0, false, NULL) < 0) {
		say("hello-failed");
		hold_until_eof();
		return 0;
	}
	for (uint32_t first = 0; first < total; first += per) {
		uint32_t n = total - first < per ? total - first : per;
		uint8_t *buf;
		size_t len = register_frame(&buf, first, n, 1, 0, first == 0, true);
		send_all(fd, buf, len);
		free(buf);
	}
	Aoq__StatsRequest req = AOQ__STATS_REQUEST__INIT;
	req.all_sessions = true;
	uint8_t *one;
	size_t len = frame_of(AOQ__ENVELOPE__MSG_STATS_REQUEST, &req, &one);
	uint8_t *many = aoqt_xmalloc(len * stats);
	for (uint32_t i = 0; i < stats; i++)
		memcpy(many + i * len, one, len);
	send_all(fd, many, len * stats);
	say("sent");
	uint32_t got = 0, more = 0;
	for (;;) {
		Aoq__Envelope *env = NULL;
		int r = aoq_recv_frame(fd, &env, NULL, 0, NULL);
		if (r < 0)
			break;
		if (env->msg_case == AOQ__ENVELOPE__MSG_STATS)
			got++;
		else if (env->msg_case == AOQ__ENVELOPE__MSG_REGISTER_MORE)
			more++;
		aoq_envelope_free(env);
		if (got == stats)
			break;
	}
	say("answered %u stats %u more", got, more);
	(void)arg;
	hold_until_eof();
	return 0;
}

/* Reads whatever a connection holds without blocking: 0 still open, 1
 * closed after an Error of code *code, 2 closed without one. */
static int conn_state(int fd, int *code)
{
	*code = -1;
	for (;;) {
		struct pollfd pf = { .fd = fd, .events = POLLIN };
		if (poll(&pf, 1, 0) <= 0)
			return 0;
		Aoq__Envelope *env = NULL;
		int r = aoq_recv_frame(fd, &env, NULL, 0, NULL);
		if (r == -EAGAIN)
			return 0;
		if (r < 0)
			return *code >= 0 ? 1 : 2;
		if (env->msg_case == AOQ__ENVELOPE__MSG_ERROR && *code < 0)
			*code = (int)env->error->code;
		aoq_envelope_free(env);
	}
}

/* A connection that says Hello as an observer: 1 Welcome, 2 QUOTA, 0 else. */
static int observer_conn(int *out)
{
	int fd = aoq_socket_connect(att_sock);
	*out = -1;
	if (fd < 0)
		return 0;
	struct timeval tv = { .tv_sec = 10 };
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	Aoq__Hello h;
	hello_msg(&h, "att-hello", true);
	uint8_t *b;
	size_t l = frame_of(AOQ__ENVELOPE__MSG_HELLO, &h, &b);
	send_all(fd, b, l);
	free(b);
	Aoq__Envelope *env = NULL;
	int r = aoq_recv_frame(fd, &env, NULL, 0, NULL), res = 0;
	if (r == 0 && env->msg_case == AOQ__ENVELOPE__MSG_WELCOME)
		res = 1;
	else if (r == 0 && env->msg_case == AOQ__ENVELOPE__MSG_ERROR && env->error->code == AOQ__ERROR_CODE__QUOTA)
		res = 2;
	if (r == 0)
		aoq_envelope_free(env);
	if (res == 1)
		*out = fd;
	else
		close(fd);
	return res;
}

static int att_idle(void)
{
	struct rlimit rl;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	/* The uid's cap, filled with observers (they never time out). */
	enum { OBS = 100, N = 1100 };
	static int obs[OBS], fds[N];
	int welcome = 0, quota = 0, other = 0;
	for (int i = 0; i < OBS; i++) {
		int r = observer_conn(&obs[i]);
		welcome += r == 1;
		quota += r == 2;
		other += r == 0;
	}
	say("observers welcome %d quota %d other %d", welcome, quota, other);
	/* Then 1,100 connections that never say a word. */
	int n = 0, refused = 0;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", att_sock);
	while (n < N && refused < 200) {
		int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
		if (fd < 0)
			break;
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 && errno != EINPROGRESS) {
			close(fd);
			refused++;
			usleep(1000);
			continue;
		}
		fds[n++] = fd;
	}
	say("opened %d refused %d", n, refused);
	char cmd[64];
	while (hear(cmd, sizeof(cmd))) {
		if (strcmp(cmd, "check") == 0) {
			int open = 0, q = 0, err = 0, bare = 0;
			for (int i = 0; i < n; i++) {
				if (fds[i] < 0)
					continue;
				int code, st = conn_state(fds[i], &code);
				if (st == 0) {
					open++;
					continue;
				}
				if (st == 1 && code == AOQ__ERROR_CODE__QUOTA)
					q++;
				else if (st == 1)
					err++;
				else
					bare++;
				close(fds[i]);
				fds[i] = -1;
			}
			say("state open %d quota %d error %d bare %d", open, q, err, bare);
		} else if (strcmp(cmd, "hellos") == 0) {
			/* Over the cap, a client that says Hello at once (as
			 * aoqctl does) must read why it is refused. */
			int hq = 0, hw = 0, ho = 0;
			for (int i = 0; i < 20; i++) {
				int fd, r = observer_conn(&fd);
				hw += r == 1;
				hq += r == 2;
				ho += r == 0;
				if (fd >= 0)
					close(fd);
			}
			struct aoq_options o = AOQ_OPTIONS_INIT;
			o.socket = att_sock;
			o.job = "att-libaoq";
			o.timeout_ms = 10000;
			struct aoq_client *c = NULL;
			int r = aoq_connect(&c, &o);
			const char *msg = r < 0 ? aoq_last_error() : "connected";
			say("hellos quota %d welcome %d other %d libaoq %d %s", hq, hw, ho, r,
			    strstr(msg, "QUOTA") || strstr(msg, "quota") ? "quota-message" : "no-quota-message");
			if (r == 0)
				aoq_close(c);
		} else if (strcmp(cmd, "idle10") == 0) {
			/* Below the cap now: idle connections that only the
			 * handshake deadline ends. */
			for (int i = 0; i < OBS; i++)
				if (obs[i] >= 0)
					close(obs[i]);
			for (int i = 0; i < n; i++)
				if (fds[i] >= 0)
					close(fds[i]);
			usleep(500000); /* the daemon sees those closes first */
			n = 0;
			for (int i = 0; i < 10; i++) {
				int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
				if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
					fds[n++] = fd;
				else if (fd >= 0)
					close(fd);
			}
			say("idle %d", n);
		}
	}
	return 0;
}

static int att_halfframes(void)
{
	enum { N = 100 };
	static int fds[N];
	uint8_t *body = aoqt_xcalloc(1, AOQ_MAX_FRAME);
	uint32_t len = AOQ_MAX_FRAME;
	uint8_t pre[4] = { len & 0xff, (len >> 8) & 0xff, (len >> 16) & 0xff, len >> 24 };
	int sent = 0;
	for (int i = 0; i < N; i++) {
		fds[i] = aoqt_raw_connect(att_sock);
		if (fds[i] < 0)
			continue;
		if (aoqt_raw_hello(fds[i], "att-half", 0, true, NULL) < 0)
			continue;
		int fl = fcntl(fds[i], F_GETFL);
		fcntl(fds[i], F_SETFL, fl | O_NONBLOCK);
		send_all(fds[i], pre, 4);
		send_all(fds[i], body, AOQ_MAX_FRAME - 1);
		sent++;
	}
	/* Those the daemon would not buffer are refused with QUOTA. */
	usleep(300000);
	int quota = 0;
	for (int i = 0; i < N; i++) {
		int code;
		if (fds[i] >= 0 && conn_state(fds[i], &code) == 1 && code == AOQ__ERROR_CODE__QUOTA)
			quota++;
	}
	say("sent %d quota %d", sent, quota);
	hold_until_eof();
	return 0;
}

/* Expects the reply to a request: its kind or the Error's code.  Fds that
 * come with it (the arena, the doorbells) stay open, as a client's do: a
 * session whose client closed its doorbell is over. */
static int reply_code(int fd, int *errcode)
{
	Aoq__Envelope *env = NULL;
	int fds[AOQ_MAX_FDS], nfds = 0;
	*errcode = -1;
	int r = aoq_recv_frame(fd, &env, fds, AOQ_MAX_FDS, &nfds);
	if (r < 0)
		return -1;
	int kind = (int)env->msg_case;
	if (kind == AOQ__ENVELOPE__MSG_ERROR)
		*errcode = (int)env->error->code;
	aoq_envelope_free(env);
	return kind;
}

/* Waits until the daemon no longer lists a session of job `job` (its
 * memory goes back to the uid's account as it closes), then one more
 * round trip. */
static void wait_gone(const char *job)
{
	for (int i = 0; i < 2000; i++) {
		Aoq__Envelope *st = NULL;
		if (aoqt_stats(att_sock, &st) < 0)
			return;
		bool listed = false;
		for (size_t k = 0; k < st->stats->n_sessions; k++)
			if (strcmp(st->stats->sessions[k]->job, job) == 0)
				listed = true;
		aoq_envelope_free(st);
		if (!listed)
			break;
		usleep(1000);
	}
	Aoq__Envelope *st = NULL;
	if (aoqt_stats(att_sock, &st) == 0)
		aoq_envelope_free(st);
}

static int att_quota(void)
{
	char cmd[64];
	/* (a) 100,000 one-element tensors in one session. */
	{
		int fd = aoqt_raw_connect(att_sock);
		int code = -1, kind = -1;
		if (fd >= 0 && aoqt_raw_hello(fd, "att-tiny", 0, false, NULL) == 0) {
			for (uint32_t first = 0; first < 100000; first += 4000) {
				uint8_t *buf;
				size_t len = register_frame(&buf, first, 4000, 1, 0, first == 0, first + 4000 < 100000);
				send_all(fd, buf, len);
				free(buf);
				kind = reply_code(fd, &code);
				if (kind != AOQ__ENVELOPE__MSG_REGISTER_MORE)
					break;
			}
		}
		say("tiny %s %d", kind == AOQ__ENVELOPE__MSG_REGISTERED ? "registered" : "refused", code);
		if (!hear(cmd, sizeof(cmd)))
			return 0;
		close(fd);
		wait_gone("att-tiny");
	}
	/* (b) an unfinished registration of 120,000 tensors named with 1,000
	 * bytes each. */
	{
		int fd = aoqt_raw_connect(att_sock);
		int code = -1, kind = -1;
		uint32_t sent = 0, per = 1000;
		if (fd >= 0 && aoqt_raw_hello(fd, "att-names", 0, false, NULL) == 0) {
			for (uint32_t first = 0; first < 120000; first += per) {
				uint8_t *buf;
				size_t len = register_frame(&buf, first, per, 1, 1000, first == 0, true);
				send_all(fd, buf, len);
				free(buf);
				kind = reply_code(fd, &code);
				if (kind != AOQ__ENVELOPE__MSG_REGISTER_MORE)
					break;
				sent += per;
			}
		}
		say("names %u %d", sent, code);
		if (!hear(cmd, sizeof(cmd)))
			return 0;
		close(fd);
		wait_gone("att-names");
	}
	/* (c) state + arena just under the quota, the accumulator over it. */
	{
		struct aoqt_raw s;
		uint64_t n1[1] = { 2621440 };
		int r = aoqt_raw_open(&s, att_sock, "att-acc", n1, 1);
		if (r < 0) {
			say("acc register-refused %d", r);
		} else {
			memset(s.arena + s.hdr.data_off, 0, s.arena_size - s.hdr.data_off);
			struct aoq_rec rec = { .tensor = 0, .slot = 0, .count = n1[0], .step = 1,
			                       .flags = AOQ_REC_ACCUMULATE };
			aoqt_raw_push(&s, &rec);
			struct aoq_rec back;
			int got = aoqt_raw_pop(&s, &back, 20000);
			char msg[256];
			int code = got == 1 ? -5 : aoqt_raw_expect_close(s.sock, 5000, msg, sizeof(msg));
			say("acc %s %d", got == 1 ? "accumulated" : "refused", code);
		}
		hold_until_eof();
	}
	return 0;
}

/* A session whose fp32 state (12 bytes per element) is `percent` of the
 * memory (with the default lease its undo copy doubles that, and the arena
 * of slots adds a third of it): "registered" or "refused" and the Error's
 * code. */
static const char *register_share(int fd, unsigned rank, unsigned percent, int *code)
{
	long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
	uint64_t mem = (uint64_t)pages * (uint64_t)psize;
	uint64_t numel = mem / 1200 * percent;
	int kind = -1;
	*code = -1;
	if (fd >= 0 && aoqt_raw_hello(fd, "att-default", rank, false, NULL) == 0) {
		uint8_t *buf;
		size_t len = register_frame(&buf, 0, 1, numel, 0, true, false);
		send_all(fd, buf, len);
		free(buf);
		kind = reply_code(fd, code);
	}
	return kind == AOQ__ENVELOPE__MSG_REGISTERED ? "registered" : "refused";
}

/* arg "60": one session of 60% of the memory; "28+10": one of 28%, then,
 * holding it, another of 10% (register_share). */
static int att_quota_default(const char *arg)
{
	unsigned first = 60, second = 0;
	if (arg)
		sscanf(arg, "%u+%u", &first, &second);
	int code, fd = aoqt_raw_connect(att_sock);
	const char *res = register_share(fd, 0, first, &code);
	if (!second) {
		say("default %s %d", res, code);
	} else {
		int code2, fd2 = aoqt_raw_connect(att_sock);
		const char *res2 = register_share(fd2, 1, second, &code2);
		say("alone %s %d then %s %d", res, code, res2, code2);
	}
	hold_until_eof();
	return 0;
}

static int att_spoof(void)
{
	int fd = aoqt_raw_connect(att_sock);
	if (fd < 0) {
		say("connect-failed");
		hold_until_eof();
		return 0;
	}
	Aoq__Hello h;
	hello_msg(&h, "evil\naoqd warn session: forged line", false);
	h.pid = 1;
	h.device = (char *)"cpu\x1b[2J";
	uint8_t *b;
	size_t l = frame_of(AOQ__ENVELOPE__MSG_HELLO, &h, &b);
	send_all(fd, b, l);
	free(b);
	int code, kind = reply_code(fd, &code);
	/* A registration, so the session is listed. */
	l = register_frame(&b, 0, 1, 100, 0, true, false);
	send_all(fd, b, l);
	free(b);
	int kind2 = reply_code(fd, &code);
	say("spoofed pid %d welcome %d registered %d", (int)getpid(), kind == AOQ__ENVELOPE__MSG_WELCOME,
	    kind2 == AOQ__ENVELOPE__MSG_REGISTERED);
	hold_until_eof();
	return 0;
}

static int att_observer(void)
{
	Aoq__Envelope *st = NULL;
	int r = aoqt_stats(att_sock, &st);
	if (r < 0) {
		say("stats failed %d", r);
	} else {
		bool root = false;
		for (size_t i = 0; i < st->stats->n_sessions; i++)
			if (st->stats->sessions[i]->uid == 0)
				root = true;
		say("stats locked %" PRIu64 " rss %" PRIu64 " sessions %zu root %d", st->stats->locked_bytes,
		    st->stats->rss_bytes, st->stats->n_sessions, root);
		aoq_envelope_free(st);
	}
	hold_until_eof();
	return 0;
}

static int att_requests(void)
{
	int code, kind;
	/* (a) no groups, (b) no tensors. */
	for (int v = 0; v < 2; v++) {
		int fd = aoqt_raw_connect(att_sock);
		kind = -1;
		code = -1;
		if (fd >= 0 && aoqt_raw_hello(fd, "att-empty", 0, false, NULL) == 0) {
			uint8_t *b;
			size_t l = v == 0 ? register_frame(&b, 0, 1, 10, 0, false, false)
			                  : register_frame(&b, 0, 0, 10, 0, true, false);
			send_all(fd, b, l);
			free(b);
			kind = reply_code(fd, &code);
		}
		say("empty-%s %s", v == 0 ? "groups" : "tensors",
		    kind == AOQ__ENVELOPE__MSG_ERROR ? aoq_error_name(code) : "no-error");
		if (fd >= 0)
			close(fd);
	}
	/* (c) TensorSteps beyond the counter. */
	{
		struct aoqt_raw s;
		uint64_t n1[1] = { 100 };
		const char *res = "open-failed";
		if (aoqt_raw_open(&s, att_sock, "att-steps", n1, 1) == 0) {
			Aoq__TensorSteps ts = AOQ__TENSOR_STEPS__INIT;
			uint64_t big = UINT64_MAX;
			ts.first = 0;
			ts.set = true;
			ts.n_steps = 1;
			ts.steps = &big;
			aoqt_send_msg(s.sock, AOQ__ENVELOPE__MSG_TENSOR_STEPS, &ts);
			kind = reply_code(s.sock, &code);
			res = kind == AOQ__ENVELOPE__MSG_ERROR ? aoq_error_name(code)
			      : kind == AOQ__ENVELOPE__MSG_TENSOR_STEPS ? "accepted" : "no-reply";
			aoqt_raw_close(&s);
		}
		say("tensorsteps %s", res);
	}
	/* (d) two final records of the same half. */
	{
		struct aoqt_raw s;
		uint64_t n1[1] = { 100 };
		const char *res = "open-failed";
		if (aoqt_raw_open(&s, att_sock, "att-twice", n1, 1) == 0) {
			struct aoq_rec rec = { .tensor = 0, .slot = 0, .offset = 0, .count = 50, .step = 1 };
			aoqt_raw_push(&s, &rec);
			aoqt_raw_push(&s, &rec);
			Aoq__StepEnd se = AOQ__STEP_END__INIT;
			se.step = 1;
			aoqt_send_msg(s.sock, AOQ__ENVELOPE__MSG_STEP_END, &se);
			Aoq__Envelope *env = NULL;
			res = "no-reply";
			for (;;) {
				int r = aoq_recv_frame(s.sock, &env, NULL, 0, NULL);
				if (r < 0)
					break;
				if (env->msg_case == AOQ__ENVELOPE__MSG_ERROR)
					res = aoq_error_name((int)env->error->code);
				else if (env->msg_case == AOQ__ENVELOPE__MSG_STEP_ENDED)
					res = env->step_ended->tensors_updated ? "tensor-updated" : "not-updated";
				aoq_envelope_free(env);
				break;
			}
			aoqt_raw_close(&s);
		}
		say("twice %s", res);
	}
	/* (e) its own masters memfd (a bf16 master that is the parameter),
	 * writable by no way open to another uid than aoqd's: reopened
	 * read-write through /proc, its mode changed, mapped writable,
	 * written, resized, a hole punched, sealed. */
	{
		struct aoqt_raw s;
		uint64_t n2[2] = { 4097, 100 };
		char res[256] = "open-failed";
		if (aoqt_raw_open_bf16(&s, att_sock, "att-masters", n2, 2) == 0) {
			char path[64];
			snprintf(path, sizeof(path), "/proc/self/fd/%d", s.masters_fd);
			size_t len = (size_t)s.hdr.masters_size;
			int rw = open(path, O_RDWR | O_CLOEXEC);
			int e_reopen = rw < 0 ? errno : 0;
			if (rw >= 0)
				close(rw);
			int e_chmod = fchmod(s.masters_fd, 0666) < 0 ? errno : 0;
			int e[AOQT_MW_N];
			aoqt_masters_write_attempts(s.masters_fd, len, e);
			int n = snprintf(res, sizeof(res), "reopen:%s chmod:%s", e_reopen ? strerrorname_np(e_reopen) : "ok",
			                 e_chmod ? strerrorname_np(e_chmod) : "ok");
			for (int i = 0; i < AOQT_MW_N && n > 0 && (size_t)n < sizeof(res); i++)
				n += snprintf(res + n, sizeof(res) - (size_t)n, " %s:%s", aoqt_mw_names[i],
				              e[i] ? strerrorname_np(e[i]) : "ok");
			aoqt_raw_close(&s);
		}
		say("masters %s", res);
	}
	hold_until_eof();
	return 0;
}

static int attacker_main(const char *mode, const char *sock, const char *arg)
{
	signal(SIGPIPE, SIG_IGN);
	att_sock = sock;
	att_group_init();
	if (strcmp(mode, "doorbell") == 0)
		return att_doorbell();
	if (strcmp(mode, "stall") == 0)
		return att_stall(arg);
	if (strcmp(mode, "idle") == 0)
		return att_idle();
	if (strcmp(mode, "halfframes") == 0)
		return att_halfframes();
	if (strcmp(mode, "quota") == 0)
		return att_quota();
	if (strcmp(mode, "quota-default") == 0)
		return att_quota_default(arg);
	if (strcmp(mode, "spoof") == 0)
		return att_spoof();
	if (strcmp(mode, "observer") == 0)
		return att_observer();
	if (strcmp(mode, "requests") == 0)
		return att_requests();
	fprintf(stderr, "unknown attacker mode %s\n", mode);
	return 2;
}

/* ---- the cases (parent side) ---------------------------------------------- */

struct run {
	struct victim v;
	pthread_t th;
	uint64_t base_from, base_to, attack_from, attack_to;
	double bound_ms;
};

static char config_path[128];

static void start_daemon(const char *exe, const char *config, const char *const *extra)
{
	const char *args[16];
	int n = 0;
	args[n++] = "--threads";
	args[n++] = "2";
	if (config) {
		const char *tmp = getenv("TMPDIR");
		snprintf(config_path, sizeof(config_path), "%s/aoqt-conf-XXXXXX", tmp && *tmp ? tmp : "/tmp");
		int fd = mkstemp(config_path);
		CHECK(fd >= 0, "mkstemp");
		CHECK(write(fd, config, strlen(config)) == (ssize_t)strlen(config), "write config");
		close(fd);
		args[n++] = "--config";
		args[n++] = config_path;
	}
	for (int i = 0; extra && extra[i]; i++)
		args[n++] = extra[i];
	args[n] = NULL;
	CHECK_OK(aoqt_daemon_start(&daemon_, exe, args));
	/* Other uids reach the socket; only the test reads the log. */
	CHECK(chmod(daemon_.dir, 0755) == 0 && chmod(daemon_.socket, 0666) == 0, "chmod: %s", strerror(errno));
}

static void begin(struct run *r, const char *job)
{
	memset(r, 0, sizeof(*r));
	static char jobs[4][48];
	static int nj;
	snprintf(jobs[nj & 3], sizeof(jobs[0]), "%s-%d", job, (int)getpid());
	r->v.job = jobs[nj++ & 3];
	CHECK(pthread_create(&r->th, NULL, victim_run, &r->v) == 0, "pthread_create");
	wait_steps(&r->v, 8, slow ? 300000 : 60000, "baseline");
	r->base_from = 3;
	r->base_to = atomic_load(&r->v.done);
	r->attack_from = r->base_to + 1;
}

/* Called when the attack is over: the victim must make `more` steps within
 * the bound each, then stops; bit-exact against a run alone. */
static void finish(struct run *r, double bound_ms, uint64_t more, const char *what)
{
	uint64_t now = atomic_load(&r->v.done);
	wait_steps(&r->v, now + more, bound_ms * (double)(more + 1), what);
	r->attack_to = atomic_load(&r->v.done);
	atomic_store(&r->v.min_steps, r->attack_to + 2);
	atomic_store(&r->v.stop, true);
	pthread_join(r->th, NULL);
	double base = max_lat(&r->v, r->base_from, r->base_to);
	double worst = max_lat(&r->v, r->attack_from, r->attack_to);
	printf("%s: victim steps %" PRIu64 "..%" PRIu64 " under attack, slowest %.1f ms (baseline %.1f ms, "
	       "bound %.0f ms)\n", what, r->attack_from, r->attack_to, worst, base, bound_ms);
	CHECK(r->attack_to > r->attack_from, "%s: the victim made no progress under attack", what);
	CHECK(worst <= bound_ms, "%s: a victim step took %.1f ms under attack (baseline %.1f ms, bound %.0f ms)",
	      what, worst, base, bound_ms);
	struct victim solo = { .steps = r->v.final_steps };
	char job[48];
	snprintf(job, sizeof(job), "solo-%d", (int)getpid());
	solo.job = job;
	victim_run(&solo);
	for (int t = 0; t < TT; t++) {
		size_t bytes = tdesc[t].n * aoqt_dtype_size(tdesc[t].pd);
		CHECK(memcmp(r->v.param[t], solo.param[t], bytes) == 0,
		      "%s: tensor %d of the victim differs from the same run alone after %" PRIu64 " steps", what, t,
		      r->v.final_steps);
		free(r->v.param[t]);
		free(solo.param[t]);
	}
	free(r->v.lat_ms);
	free(solo.lat_ms);
	printf("%s: victim == the same run alone, bit for bit, after %" PRIu64 " steps\n", what, r->v.final_steps);
}

static void end_daemon(void)
{
	CHECK(aoqt_daemon_alive(&daemon_), "aoqd died");
	int rc = aoqt_daemon_stop(&daemon_, slow ? 60000 : 20000, false);
	if (config_path[0])
		unlink(config_path);
	config_path[0] = 0;
	CHECK(rc == 0, "aoqd exit status %d after SIGTERM, want 0 (within the time)", rc);
	/* A sanitizer build of the daemon reports into its log, leaks at exit
	 * included. */
	char *log = aoqt_daemon_log(&daemon_);
	CHECK(log && !strstr(log, "Sanitizer") && !strstr(log, "runtime error"), "the daemon's log has a sanitizer "
	      "report (%s)", daemon_.log);
	free(log);
	unlink(daemon_.log);
	unlink(daemon_.socket);
	rmdir(daemon_.dir);
}

/* A sanitizer's allocator keeps what is freed (quarantine, shadow): the
 * daemon's RSS says nothing about what it holds there. */
static bool rss_meaningful(void)
{
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
	return false;
#else
	return true;
#endif
}

static double hang_bound(void)
{
	return LAT_HANG_MS * (slow ? 5 : 1);
}

static void case_doorbell(const char *exe)
{
	start_daemon(exe, NULL, NULL);
	struct run r;
	begin(&r, "victim-bell");
	struct attacker a;
	char line[512];
	att_start(&a, "doorbell", ATT_UID, NULL, NULL);
	att_line(&a, line, sizeof(line), 60000, "doorbell");
	CHECK(strcmp(line, "attacked") == 0, "doorbell: attacker says '%s'", line);
	finish(&r, hang_bound(), 20, "doorbell");
	/* A new session still trains (the workers are free). */
	struct victim after = { .steps = 3, .job = "after-bell" };
	victim_run(&after);
	for (int t = 0; t < TT; t++)
		free(after.param[t]);
	free(after.lat_ms);
	att_stop(&a);
	end_daemon();
}

static void case_stall(const char *exe)
{
	start_daemon(exe, NULL, NULL);
	struct run r;
	begin(&r, "victim-stall");
	double base = max_lat(&r.v, r.base_from, r.base_to);
	struct attacker a;
	char line[512];
	att_start(&a, "stall", ATT_UID, NULL, NULL);
	att_line(&a, line, sizeof(line), 120000, "stall");
	CHECK(strcmp(line, "sent") == 0, "stall: attacker says '%s'", line);
	att_line(&a, line, sizeof(line), slow ? 600000 : 180000, "stall");
	unsigned got = 0, more = 0;
	CHECK(sscanf(line, "answered %u stats %u more", &got, &more) == 2 && got == 500,
	      "stall: the attacker's requests were not all answered: '%s'", line);
	finish(&r, base + LAT_STALL_MS * (slow ? 5 : 1), 5, "stall");
	att_stop(&a);
	end_daemon();
}

static void case_lockout(const char *exe)
{
	/* The soft limit a plain service gets. */
	struct rlimit old, rl;
	CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0, "getrlimit");
	rl = old;
	rl.rlim_cur = 1024;
	CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0, "setrlimit");
	start_daemon(exe, "max_connections_per_uid = 64\nhandshake_timeout_ms = 2000\n", NULL);
	CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0, "setrlimit");
	struct run r;
	begin(&r, "victim-lockout");
	struct attacker a, obs;
	char line[512];
	att_start(&a, "idle", ATT_UID, NULL, NULL);
	att_line(&a, line, sizeof(line), 120000, "lockout");
	int w = 0, q = 0, o = 0;
	CHECK(sscanf(line, "observers welcome %d quota %d other %d", &w, &q, &o) == 3, "lockout: '%s'", line);
	CHECK(w == 64 && q == 36 && o == 0, "lockout: 100 observers of one uid with a cap of 64: %d welcome, %d QUOTA, "
	      "%d other", w, q, o);
	att_line(&a, line, sizeof(line), 120000, "lockout");
	int opened = 0, refused = 0;
	CHECK(sscanf(line, "opened %d refused %d", &opened, &refused) == 2, "lockout: '%s'", line);
	/* Another user's new trainer and observer get in at once. */
	double t0 = aoqt_now();
	struct victim fresh = { .steps = 3, .job = "fresh-lockout" };
	victim_run(&fresh);
	for (int t = 0; t < TT; t++)
		free(fresh.param[t]);
	free(fresh.lat_ms);
	printf("lockout: a new trainer of another uid trained 3 steps in %.0f ms\n", (aoqt_now() - t0) * 1e3);
	att_start(&obs, "observer", OTHER_UID, NULL, NULL);
	att_line(&obs, line, sizeof(line), 30000, "lockout observer");
	CHECK(strncmp(line, "stats locked", 12) == 0, "lockout: an observer of another uid got no Stats: '%s'", line);
	att_stop(&obs);
	/* Over the uid's cap: a QUOTA Error, then the close. */
	att_say(&a, "check\n");
	att_line(&a, line, sizeof(line), 30000, "lockout check");
	int open = 0, quota = 0, err = 0, bare = 0;
	CHECK(sscanf(line, "state open %d quota %d error %d bare %d", &open, &quota, &err, &bare) == 4, "'%s'", line);
	CHECK(quota > 0 && bare == 0 && err == 0, "lockout: connections over the uid's cap must read a QUOTA Error "
	      "before the close (%d did, %d another Error, %d closed without one)", quota, err, bare);
	att_say(&a, "hellos\n");
	att_line(&a, line, sizeof(line), 60000, "lockout hellos");
	int hq = 0, hw = 0, ho = 0, lr = 0;
	char lm[64] = "";
	CHECK(sscanf(line, "hellos quota %d welcome %d other %d libaoq %d %63s", &hq, &hw, &ho, &lr, lm) == 5, "'%s'",
	      line);
	CHECK(hq == 20 && lr < 0 && strcmp(lm, "quota-message") == 0,
	      "lockout: Hellos over the uid's cap: %d QUOTA, %d Welcome, %d other; libaoq %d %s", hq, hw, ho, lr, lm);
	/* Idle connections below the cap go at the handshake deadline, with
	 * an Error. */
	att_say(&a, "idle10\n");
	att_line(&a, line, sizeof(line), 30000, "lockout idle");
	CHECK(strcmp(line, "idle 10") == 0, "lockout: '%s'", line);
	usleep((useconds_t)(slow ? 12000000 : 4000000));
	att_say(&a, "check\n");
	att_line(&a, line, sizeof(line), 30000, "lockout deadline");
	CHECK(sscanf(line, "state open %d quota %d error %d bare %d", &open, &quota, &err, &bare) == 4, "'%s'", line);
	CHECK(open == 0 && bare == 0 && err == 10, "lockout: after the handshake deadline %d idle connections are "
	      "open, %d were closed without an Error", open, bare);
	finish(&r, hang_bound(), 5, "lockout");
	att_stop(&a);
	end_daemon();
}

static void case_halfframes(const char *exe)
{
	start_daemon(exe, NULL, NULL);
	struct run r;
	begin(&r, "victim-half");
	uint64_t rss0 = aoqt_rss_bytes(daemon_.pid);
	struct attacker a;
	char line[512];
	att_start(&a, "halfframes", ATT_UID, NULL, NULL);
	att_line(&a, line, sizeof(line), 120000, "halfframes");
	int sent = 0, quota = 0;
	CHECK(sscanf(line, "sent %d quota %d", &sent, &quota) == 2 && sent == 100 && quota > 0,
	      "halfframes: no connection holding a half-sent frame was refused with QUOTA: '%s'", line);
	uint64_t rss1 = aoqt_rss_bytes(daemon_.pid);
	double grew = ((double)rss1 - (double)rss0) / 1048576.0;
	printf("halfframes: aoqd RSS %.1f -> %.1f MiB\n", rss0 / 1048576.0, rss1 / 1048576.0);
	if (rss_meaningful())
		CHECK(grew < 48, "halfframes: 100 half-sent 1 MiB frames grew the daemon by %.1f MiB", grew);
	finish(&r, hang_bound(), 5, "halfframes");
	att_stop(&a);
	end_daemon();
}

static void case_quota(const char *exe)
{
	/* No lease: the RSS bound below counts state without its undo copy,
	 * and the arena is built before its charge is refused (README, "Lease
	 * and resume"). */
	start_daemon(exe, "max_state_bytes_per_uid = 64M\nlease_seconds = 0\n", NULL);
	struct run r;
	begin(&r, "victim-quota");
	const double limit = 64 + 48;
	uint64_t rss0 = aoqt_rss_bytes(daemon_.pid);
	struct attacker a;
	char line[512];
	att_start(&a, "quota", ATT_UID, NULL, NULL);
	const char *parts[] = { "tiny", "names", "acc" };
	for (int i = 0; i < 3; i++) {
		att_line(&a, line, sizeof(line), slow ? 600000 : 120000, parts[i]);
		uint64_t rss = aoqt_rss_bytes(daemon_.pid);
		double grew = ((double)rss - (double)rss0) / 1048576.0;
		printf("quota %s: aoqd RSS grew by %.1f MiB (at most %.0f)\n", parts[i], grew, limit);
		if (rss_meaningful())
			CHECK(grew <= limit, "quota %s: one uid with a 64 MiB quota grew the daemon by %.1f MiB ('%s')",
			      parts[i], grew, line);
		unsigned names = 0;
		int code = -1;
		if (i == 0)
			CHECK(strcmp(line, "tiny refused 5") == 0,
			      "quota: 100,000 one-element tensors (400 MiB in whole pages) were not refused: '%s'", line);
		if (i == 1)
			CHECK(sscanf(line, "names %u %d", &names, &code) == 2 && names < 120000 && code == 5,
			      "quota: an unfinished registration with 120 MB of names was not refused: '%s'", line);
		if (i == 2)
			CHECK(strcmp(line, "acc refused 5") == 0,
			      "quota: an accumulation buffer past the quota was allowed ('%s')", line);
		if (i < 2)
			att_say(&a, "next\n");
	}
	finish(&r, hang_bound(), 5, "quota");
	att_stop(&a);
	end_daemon();
}

static void case_quota_default(const char *exe, const char *conf)
{
	static const char *const extra[] = { "--lock-memory", "no", NULL };
	start_daemon(exe, NULL, extra);
	struct attacker a;
	char line[512];
	/* alone: the whole auto pool (90%) is the uid's */
	att_start(&a, "quota-default", ATT_UID, NULL, "28+10");
	att_line(&a, line, sizeof(line), 60000, "quota-alone");
	CHECK(strcmp(line, "alone registered -1 then refused 5") == 0,
	      "quota-default: a uid alone could not register a session of 75%% of the memory, or could one of 27%% "
	      "more: '%s'", line);
	att_stop(&a);
	end_daemon();
	start_daemon(exe, NULL, extra);
	struct run r;
	begin(&r, "victim-qdef");
	att_start(&a, "quota-default", ATT_UID, NULL, "60");
	att_line(&a, line, sizeof(line), 60000, "quota-default");
	CHECK(strcmp(line, "default refused 5") == 0,
	      "quota-default: one uid registered state of 60%% of the memory: '%s'", line);
	finish(&r, hang_bound(), 5, "quota-default");
	att_stop(&a);
	end_daemon();

	/* deploy/aoqd.conf states the default it has: uncommented, it
	 * parses, and it is no longer "0 = no limit". */
	FILE *f = fopen(conf, "re");
	CHECK(f, "%s: %s", conf, strerror(errno));
	char l[512], value[128] = "";
	while (fgets(l, sizeof(l), f))
		if (sscanf(l, "#max_state_bytes_per_uid = %127s", value) == 1)
			break;
	fclose(f);
	CHECK(value[0] && strcmp(value, "0") != 0, "deploy/aoqd.conf: max_state_bytes_per_uid default '%s'", value);
	char cfg[256];
	snprintf(cfg, sizeof(cfg), "max_state_bytes_per_uid = %s\n", value);
	start_daemon(exe, cfg, NULL);
	Aoq__Envelope *st = NULL;
	CHECK_OK(aoqt_stats(daemon_.socket, &st)); /* it serves (and has its signal handlers) */
	aoq_envelope_free(st);
	end_daemon();
}

static bool log_has_line_starting(const char *log, const char *prefix)
{
	for (const char *p = log; p && *p;) {
		if (strncmp(p, prefix, strlen(prefix)) == 0)
			return true;
		p = strchr(p, '\n');
		if (p)
			p++;
	}
	return false;
}

static void case_identity(const char *exe)
{
	start_daemon(exe, NULL, NULL);
	struct run r;
	begin(&r, "victim-identity");
	struct attacker a, obs;
	char line[512];
	att_start(&a, "spoof", ATT_UID, NULL, NULL);
	att_line(&a, line, sizeof(line), 60000, "identity");
	int pid = 0, w = 0, reg = 0;
	CHECK(sscanf(line, "spoofed pid %d welcome %d registered %d", &pid, &w, &reg) == 3 && w && reg, "'%s'", line);
	Aoq__Envelope *st = NULL;
	CHECK_OK(aoqt_stats(daemon_.socket, &st));
	bool found = false;
	for (size_t i = 0; i < st->stats->n_sessions; i++) {
		Aoq__SessionStats *ss = st->stats->sessions[i];
		if (strncmp(ss->job, "evil", 4) != 0)
			continue;
		found = true;
		CHECK(ss->pid == (uint32_t)pid, "identity: stats show pid %u for the session, its peer is pid %d", ss->pid,
		      pid);
	}
	aoq_envelope_free(st);
	CHECK(found, "identity: the attacker's session is not listed");
	char *log = aoqt_daemon_log(&daemon_);
	CHECK(log, "log");
	CHECK(!log_has_line_starting(log, "aoqd warn session: forged line"), "identity: a job name forged a log line");
	CHECK(!strchr(log, '\x1b'), "identity: a raw escape byte reached the log");
	free(log);
	att_start(&obs, "observer", OTHER_UID, NULL, NULL);
	att_line(&obs, line, sizeof(line), 30000, "identity observer");
	uint64_t locked = 1, rss = 1;
	unsigned n = 0;
	int root = 1;
	CHECK(sscanf(line, "stats locked %" SCNu64 " rss %" SCNu64 " sessions %u root %d", &locked, &rss, &n, &root) == 4,
	      "identity observer: '%s'", line);
	CHECK(locked == 0 && rss == 0 && n == 0 && !root,
	      "identity: a uid without sessions sees locked %" PRIu64 " rss %" PRIu64 " and %u sessions", locked, rss, n);
	att_stop(&obs);
	finish(&r, hang_bound(), 5, "identity");
	att_stop(&a);
	end_daemon();
}

static void case_requests(const char *exe)
{
	char cfg[64];
	snprintf(cfg, sizeof(cfg), "admin_gid = %u\n", ADMIN_GID);
	start_daemon(exe, cfg, NULL);
	struct run r;
	begin(&r, "victim-requests");
	struct attacker a, adm, plain;
	char line[512];
	att_start(&a, "requests", ATT_UID, NULL, NULL);
	att_line(&a, line, sizeof(line), 60000, "requests");
	CHECK(strcmp(line, "empty-groups INVALID") == 0, "requests: Register without groups: '%s'", line);
	att_line(&a, line, sizeof(line), 60000, "requests");
	CHECK(strcmp(line, "empty-tensors INVALID") == 0, "requests: Register without tensors: '%s'", line);
	att_line(&a, line, sizeof(line), 60000, "requests");
	CHECK(strcmp(line, "tensorsteps INVALID") == 0, "requests: TensorSteps 2^64-1: '%s'", line);
	att_line(&a, line, sizeof(line), 60000, "requests");
	CHECK(strcmp(line, "twice BAD_RECORD") == 0, "requests: two final records of the same half: '%s'", line);
	att_line(&a, line, sizeof(line), 60000, "requests");
	CHECK(strncmp(line, "masters ", 8) == 0 && !strstr(line, "open-failed") && !strstr(line, ":ok"),
	      "requests: another uid wrote its way into its masters memfd: '%s'", line);
	char groups[32];
	snprintf(groups, sizeof(groups), "--groups=%u", ADMIN_GID);
	att_start(&adm, "observer", OTHER_UID, groups, NULL);
	att_line(&adm, line, sizeof(line), 30000, "requests admin");
	uint64_t locked = 0, rss = 0;
	unsigned n = 0;
	int root = 0;
	CHECK(sscanf(line, "stats locked %" SCNu64 " rss %" SCNu64 " sessions %u root %d", &locked, &rss, &n, &root) == 4 &&
	      root, "requests: a member of admin_gid through a supplementary group does not see root's session: '%s'",
	      line);
	att_stop(&adm);
	att_start(&plain, "observer", OTHER_UID, NULL, NULL);
	att_line(&plain, line, sizeof(line), 30000, "requests plain");
	CHECK(sscanf(line, "stats locked %" SCNu64 " rss %" SCNu64 " sessions %u root %d", &locked, &rss, &n, &root) == 4 &&
	      !root, "requests: a uid outside admin_gid sees root's session: '%s'", line);
	att_stop(&plain);
	finish(&r, hang_bound(), 5, "requests");
	att_stop(&a);
	end_daemon();
}

int main(int argc, char **argv)
{
	if (argc > 4 && strcmp(argv[1], "--attacker") == 0)
		return attacker_main(argv[2], argv[3], argv[4]);
	aoqt_init("shared-node");
	const char *exe = aoqt_aoqd_path(argc, argv);
	const char *which = NULL, *conf = NULL;
	for (int i = 2; i + 1 < argc; i++) {
		if (strcmp(argv[i], "--case") == 0)
			which = argv[i + 1];
		if (strcmp(argv[i], "--conf") == 0)
			conf = argv[i + 1];
	}
	if (!which) {
		fprintf(stderr, "usage: %s AOQD --case NAME [--conf deploy/aoqd.conf]\n", argv[0]);
		return 2;
	}
	if (geteuid() != 0) {
		printf("needs root (attackers run as other uids through setpriv): skipped\n");
		return AOQT_SKIP;
	}
	if (system("setpriv --version >/dev/null 2>&1") != 0) {
		printf("setpriv (util-linux) not found: skipped\n");
		return AOQT_SKIP;
	}
	ssize_t sl = readlink("/proc/self/exe", self_exe, sizeof(self_exe) - 1);
	CHECK(sl > 0, "readlink /proc/self/exe");
	self_exe[sl] = 0;
	/* Other uids exec this binary: every directory above it must let them. */
	CHECK(access(self_exe, X_OK) == 0, "self");
	slow = getenv("AOQ_TEST_SLOW") != NULL;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
	slow = true; /* the bounds are for an optimised build */
#endif
	if (strcmp(which, "doorbell") == 0)
		case_doorbell(exe);
	else if (strcmp(which, "stall") == 0)
		case_stall(exe);
	else if (strcmp(which, "lockout") == 0)
		case_lockout(exe);
	else if (strcmp(which, "halfframes") == 0)
		case_halfframes(exe);
	else if (strcmp(which, "quota") == 0)
		case_quota(exe);
	else if (strcmp(which, "quota-default") == 0)
		case_quota_default(exe, conf ? conf : "deploy/aoqd.conf");
	else if (strcmp(which, "identity") == 0)
		case_identity(exe);
	else if (strcmp(which, "requests") == 0)
		case_requests(exe);
	else
		aoqt_fail("unknown case %s", which);
	printf("ok\n");
	return 0;
}
