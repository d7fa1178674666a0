/* SPDX-License-Identifier: MIT */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

uint64_t aoqt_seed;
static const char *test_name = "test";
static struct aoqt_daemon *current_daemon;
static pthread_mutex_t fail_lock = PTHREAD_MUTEX_INITIALIZER;

double aoqt_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void aoqt_init(const char *name)
{
	test_name = name;
	const char *s = getenv("AOQ_TEST_SEED");
	if (s && *s) {
		aoqt_seed = strtoull(s, NULL, 0);
	} else {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		aoqt_seed = ((uint64_t)ts.tv_sec * 1000000007ull) ^ (uint64_t)ts.tv_nsec ^
		            ((uint64_t)getpid() << 40);
	}
	signal(SIGPIPE, SIG_IGN);
	setvbuf(stdout, NULL, _IOLBF, 0);
	printf("%s: seed %" PRIu64 " (rerun with AOQ_TEST_SEED=%" PRIu64 ")\n", name, aoqt_seed, aoqt_seed);
}

const char *aoqt_fmt(const char *fmt, ...)
{
	static _Thread_local char buf[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	return buf;
}

static void dump_log_tail(struct aoqt_daemon *d, int lines)
{
	char *log = aoqt_daemon_log(d);
	if (!log)
		return;
	size_t n = strlen(log);
	const char *p = log + n;
	int seen = 0;
	while (p > log && seen <= lines) {
		p--;
		if (*p == '\n')
			seen++;
	}
	fprintf(stderr, "---- aoqd log (%s), last %d lines ----\n%s\n---- end of log ----\n", d->log, lines,
	        p == log ? p : p + 1);
	free(log);
}

void aoqt_fail_at(const char *file, int line, const char *fmt, ...)
{
	pthread_mutex_lock(&fail_lock);
	char msg[2048];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	fprintf(stderr, "FAIL %s:%d: %s\n%s: seed %" PRIu64 " (rerun with AOQ_TEST_SEED=%" PRIu64 ")\n", file, line,
	        msg, test_name, aoqt_seed, aoqt_seed);
	printf("FAIL %s:%d: %s (seed %" PRIu64 ")\n", file, line, msg, aoqt_seed);
	if (current_daemon)
		dump_log_tail(current_daemon, 60);
	fflush(stdout);
	fflush(stderr);
	/* _exit: other threads are still running; the daemon gets its death
	 * signal when this process goes, and its dir stays for a post-mortem. */
	_exit(1);
}

void *aoqt_xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);
	if (!p)
		aoqt_fail("out of memory (%zu bytes)", n);
	return p;
}

void *aoqt_xcalloc(size_t n, size_t sz)
{
	void *p = calloc(n ? n : 1, sz ? sz : 1);
	if (!p)
		aoqt_fail("out of memory (%zu x %zu bytes)", n, sz);
	return p;
}

/* ---- the daemon -------------------------------------------------------- */

const char *aoqt_aoqd_path(int argc, char **argv)
{
	if (argc > 1 && argv[1][0] != '-')
		return argv[1];
	const char *p = getenv("AOQD");
	if (p && *p)
		return p;
	fprintf(stderr, "usage: %s AOQD_PATH (or set AOQD)\n", argv[0]);
	exit(2);
}

int aoqt_daemon_start(struct aoqt_daemon *d, const char *exe, const char *const *args)
{
	memset(d, 0, sizeof(*d));
	d->pid = -1;
	d->pidfd = -1;
	const char *tmp = getenv("TMPDIR");
	if (!tmp || !*tmp || strlen(tmp) > 48)
		tmp = "/tmp";
	snprintf(d->dir, sizeof(d->dir), "%s/aoqt-XXXXXX", tmp);
	if (!mkdtemp(d->dir))
		return -errno;
	snprintf(d->socket, sizeof(d->socket), "%s/aoqd.sock", d->dir);
	snprintf(d->log, sizeof(d->log), "%s/aoqd.log", d->dir);

	int r;
	int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (lfd < 0)
		return -errno;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", d->socket);
	if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(lfd, 1024) < 0) {
		r = -errno;
		close(lfd);
		return r;
	}
	int logfd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
	if (logfd < 0) {
		r = -errno;
		close(lfd);
		return r;
	}

	/* Everything the child needs is built before fork: the parent may be
	 * multithreaded, so the child only calls async-signal-safe functions. */
	char fdarg[16];
	snprintf(fdarg, sizeof(fdarg), "%d", lfd);
	const char *argv[64];
	int n = 0;
	argv[n++] = exe;
	argv[n++] = "--listen-fd";
	argv[n++] = fdarg;
	bool own_state_dir = false;
	for (int i = 0; args && args[i] && n < 61; i++) {
		own_state_dir |= strcmp(args[i], "--state-dir") == 0 || strcmp(args[i], "--config") == 0;
		argv[n++] = args[i];
	}
	/* A test's daemon never restores the node's snapshots (default
	 * state_dir): its own, empty unless the test snapshots there (a
	 * test's config file says where itself). */
	char statedir[sizeof(d->dir) + 8];
	snprintf(statedir, sizeof(statedir), "%s/state", d->dir);
	if (!own_state_dir) {
		argv[n++] = "--state-dir";
		argv[n++] = statedir;
	}
	argv[n] = NULL;
	pid_t parent = getpid();
	sigset_t none;
	sigemptyset(&none);

	pid_t pid = fork();
	if (pid < 0) {
		r = -errno;
		close(lfd);
		close(logfd);
		return r;
	}
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		if (getppid() != parent)
			_exit(127);
		sigprocmask(SIG_SETMASK, &none, NULL);
		signal(SIGPIPE, SIG_DFL);
		dup2(logfd, STDERR_FILENO);
		dup2(logfd, STDOUT_FILENO);
		fcntl(lfd, F_SETFD, 0); /* the one fd the daemon inherits */
		execv(exe, (char *const *)argv);
		static const char m[] = "aoqt: exec of aoqd failed\n";
		if (write(STDERR_FILENO, m, sizeof(m) - 1) < 0)
			_exit(127);
		_exit(127);
	}
	close(lfd);
	close(logfd);
	d->pid = pid;
	d->pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
	current_daemon = d;
	return 0;
}

bool aoqt_daemon_alive(struct aoqt_daemon *d)
{
	if (d->pid <= 0)
		return false;
	siginfo_t si = { 0 };
	if (waitid(P_PID, (id_t)d->pid, &si, WEXITED | WNOHANG | WNOWAIT) < 0)
		return false;
	return si.si_pid == 0;
}

static void remove_dir(const char *dir)
{
	DIR *dp = opendir(dir);
	if (!dp)
		return;
	struct dirent *e;
	while ((e = readdir(dp))) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		char p[512];
		snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
		unlink(p);
	}
	closedir(dp);
	rmdir(dir);
}

int aoqt_daemon_stop(struct aoqt_daemon *d, int timeout_ms, bool rm)
{
	if (d->pid <= 0)
		return -1;
	int ret = -1;
	kill(d->pid, SIGTERM);
	bool exited = true;
	if (d->pidfd >= 0) {
		struct pollfd pf = { .fd = d->pidfd, .events = POLLIN };
		int r;
		do
			r = poll(&pf, 1, timeout_ms);
		while (r < 0 && errno == EINTR);
		if (r == 0) {
			fprintf(stderr, "aoqd (pid %d) did not exit within %d ms of SIGTERM; killing it\n", (int)d->pid,
			        timeout_ms);
			kill(d->pid, SIGKILL);
			exited = false;
		}
		close(d->pidfd);
		d->pidfd = -1;
	}
	int st;
	while (waitpid(d->pid, &st, 0) < 0 && errno == EINTR)
		;
	if (exited && WIFEXITED(st))
		ret = WEXITSTATUS(st);
	else if (WIFSIGNALED(st))
		fprintf(stderr, "aoqd (pid %d) died by signal %d\n", (int)d->pid, WTERMSIG(st));
	d->pid = -1;
	if (ret != 0)
		dump_log_tail(d, 60);
	if (current_daemon == d)
		current_daemon = NULL;
	if (rm && ret == 0)
		remove_dir(d->dir);
	return ret;
}

char *aoqt_daemon_log(struct aoqt_daemon *d)
{
	FILE *f = fopen(d->log, "re");
	if (!f)
		return NULL;
	size_t cap = 65536, len = 0;
	char *buf = malloc(cap);
	size_t r;
	while (buf && (r = fread(buf + len, 1, cap - len - 1, f)) > 0) {
		len += r;
		if (cap - len < 2) {
			char *nb = realloc(buf, cap * 2);
			if (!nb) {
				free(buf);
				buf = NULL;
				break;
			}
			buf = nb;
			cap *= 2;
		}
	}
	fclose(f);
	if (buf)
		buf[len] = 0;
	return buf;
}

size_t aoqt_daemon_log_size(struct aoqt_daemon *d)
{
	struct stat st;
	return stat(d->log, &st) == 0 ? (size_t)st.st_size : 0;
}

struct session_lines {
	uint64_t id;
	int min;
};

static bool log_has_session(struct aoqt_daemon *d, const void *arg)
{
	const struct session_lines *sl = arg;
	char needle[48];
	snprintf(needle, sizeof(needle), "session %" PRIu64, sl->id);
	size_t nl = strlen(needle);
	char *log = aoqt_daemon_log(d);
	int lines = 0;
	for (char *line = log, *next; line && *line; line = next) {
		next = strchr(line, '\n');
		if (next)
			*next++ = 0;
		for (const char *p = line; (p = strstr(p, needle)); p++) {
			char c = p[nl];
			if (c < '0' || c > '9') {
				lines++;
				break;
			}
		}
		if (!next)
			break;
	}
	free(log);
	return lines >= sl->min;
}

static bool log_grew(struct aoqt_daemon *d, const void *arg)
{
	return aoqt_daemon_log_size(d) > *(const size_t *)arg;
}

static bool wait_log(struct aoqt_daemon *d, bool (*pred)(struct aoqt_daemon *, const void *), const void *arg,
                     int timeout_ms)
{
	int in = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
	if (in >= 0)
		inotify_add_watch(in, d->log, IN_MODIFY);
	double deadline = aoqt_now() + timeout_ms / 1000.0;
	bool ok = false;
	for (;;) {
		if (pred(d, arg)) {
			ok = true;
			break;
		}
		double left = deadline - aoqt_now();
		if (left <= 0)
			break;
		struct pollfd pf = { .fd = in, .events = POLLIN };
		/* Without inotify, re-check every 50 ms. */
		poll(&pf, in >= 0 ? 1 : 0, in >= 0 ? (int)(left * 1000) + 1 : 50);
		char buf[4096];
		while (in >= 0 && read(in, buf, sizeof(buf)) > 0)
			;
	}
	if (in >= 0)
		close(in);
	return ok;
}

bool aoqt_wait_log_session(struct aoqt_daemon *d, uint64_t id, int min_lines, int timeout_ms)
{
	struct session_lines sl = { id, min_lines };
	return wait_log(d, log_has_session, &sl, timeout_ms);
}

bool aoqt_wait_log_growth(struct aoqt_daemon *d, size_t size, int timeout_ms)
{
	return wait_log(d, log_grew, &size, timeout_ms);
}

int aoqt_count_fds(pid_t pid)
{
	char p[64];
	snprintf(p, sizeof(p), "/proc/%d/fd", (int)pid);
	DIR *dp = opendir(p);
	if (!dp)
		return -1;
	int n = 0;
	struct dirent *e;
	while ((e = readdir(dp)))
		if (e->d_name[0] != '.')
			n++;
	closedir(dp);
	if (pid == getpid())
		n--; /* the directory's own fd */
	return n;
}

uint64_t aoqt_rss_bytes(pid_t pid)
{
	char p[64], line[256];
	snprintf(p, sizeof(p), "/proc/%d/status", (int)pid);
	FILE *f = fopen(p, "re");
	uint64_t kb = 0;
	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "VmRSS: %" SCNu64, &kb) == 1)
			break;
	fclose(f);
	return kb * 1024;
}

/* ---- dtypes ------------------------------------------------------------ */

size_t aoqt_dtype_size(enum aoq_dtype t)
{
	return t == AOQ_FP32 ? 4 : 2;
}

/* 2^e for a normal double exponent, exactly (faster than ldexp). */
static inline double pow2(int e)
{
	uint64_t b = (uint64_t)(e + 1023) << 52;
	double d;
	memcpy(&d, &b, 8);
	return d;
}

/* x rounded to p significand bits with smallest normal exponent emin and
 * largest exponent emax, ties to even.  A subnormal result: scale so that
 * the quantum is 1 and round to an integer (exact in double, since x has
 * at most 53 bits). */
static double round_fmt(double x, int p, int emin, int emax)
{
	if (x == 0 || !isfinite(x))
		return x;
	uint64_t xb;
	memcpy(&xb, &x, 8);
	int lead = (int)((xb >> 52) & 0x7ff) - 1023; /* x = 1.f * 2^lead */
	double y, max = (2.0 - pow2(1 - p)) * pow2(emax);
	if (lead >= emin) {
		/* a normal result: x's own bits rounded to p significand bits,
		 * ties to even (a carry out of the significand steps the exponent;
		 * the same values as the scaled nearbyint below, without its
		 * libm call and two multiplies) */
		int drop = 53 - p;
		uint64_t yb = (xb + (1ull << (drop - 1)) - 1 + ((xb >> drop) & 1)) & ~((1ull << drop) - 1);
		memcpy(&y, &yb, 8);
	} else {
		/* subnormal: the quantum stops shrinking at emin's */
		int qe = emin - (p - 1);
		y = nearbyint(x * pow2(-qe)) * pow2(qe); /* FE_TONEAREST: ties to even */
	}
	if (fabs(y) > max)
		return copysign(INFINITY, x);
	return y;
}

double aoqt_round(double x, enum aoq_dtype t)
{
	switch (t) {
	case AOQ_BF16: return round_fmt(x, 8, -126, 127);
	case AOQ_FP16: return round_fmt(x, 11, -14, 15);
	default: return round_fmt(x, 24, -126, 127);
	}
}

uint32_t aoqt_encode(double x, enum aoq_dtype t)
{
	double y = aoqt_round(x, t);
	if (t == AOQ_FP32 || t == AOQ_BF16) {
		float f = (float)y; /* exact: y is representable */
		uint32_t b;
		memcpy(&b, &f, 4);
		if (isnan(y))
			b = 0x7fc00000u;
		return t == AOQ_FP32 ? b : b >> 16;
	}
	uint32_t sign = signbit(y) ? 0x8000u : 0;
	double a = fabs(y);
	if (isnan(y))
		return 0x7e00u;
	if (isinf(a))
		return sign | 0x7c00u;
	if (a == 0)
		return sign;
	uint64_t ab;
	memcpy(&ab, &a, 8);
	int lead = (int)((ab >> 52) & 0x7ff) - 1023;
	if (lead < -14)
		return sign | (uint32_t)(a * pow2(24));
	return sign | (uint32_t)(lead + 15) << 10 | ((uint32_t)(a * pow2(10 - lead)) - 1024u);
}

double aoqt_decode(uint32_t b, enum aoq_dtype t)
{
	float f;
	switch (t) {
	case AOQ_BF16:
		b <<= 16;
		/* fall through */
	case AOQ_FP32:
		memcpy(&f, &b, 4);
		return f;
	case AOQ_FP16: {
		double s = (b & 0x8000u) ? -1.0 : 1.0;
		uint32_t ex = (b >> 10) & 31, mant = b & 1023;
		if (ex == 0)
			return s * (double)mant * pow2(-24);
		if (ex == 31)
			return mant ? NAN : s * INFINITY;
		return s * (double)(1024 + mant) * pow2((int)ex - 25);
	}
	}
	return NAN;
}

void aoqt_store(void *buf, size_t i, enum aoq_dtype t, double x)
{
	uint32_t b = aoqt_encode(x, t);
	if (t == AOQ_FP32)
		memcpy((uint8_t *)buf + 4 * i, &b, 4);
	else {
		uint16_t h = (uint16_t)b;
		memcpy((uint8_t *)buf + 2 * i, &h, 2);
	}
}

uint32_t aoqt_bits(const void *buf, size_t i, enum aoq_dtype t)
{
	if (t == AOQ_FP32) {
		uint32_t b;
		memcpy(&b, (const uint8_t *)buf + 4 * i, 4);
		return b;
	}
	uint16_t h;
	memcpy(&h, (const uint8_t *)buf + 2 * i, 2);
	return h;
}

double aoqt_load(const void *buf, size_t i, enum aoq_dtype t)
{
	return aoqt_decode(aoqt_bits(buf, i, t), t);
}

uint64_t aoqt_ulp_dist(uint32_t a, uint32_t b, enum aoq_dtype t)
{
	if (isnan(aoqt_decode(a, t)) || isnan(aoqt_decode(b, t)))
		return UINT64_MAX;
	uint32_t signbit = t == AOQ_FP32 ? 0x80000000u : 0x8000u;
	int64_t oa = (a & signbit) ? -(int64_t)(a & ~signbit) : (int64_t)a;
	int64_t ob = (b & signbit) ? -(int64_t)(b & ~signbit) : (int64_t)b;
	return oa > ob ? (uint64_t)(oa - ob) : (uint64_t)(ob - oa);
}

/* ---- the reference optimizer ------------------------------------------- */

void aoqt_ref_init(struct aoqt_ref *r, size_t n)
{
	r->n = n;
	r->k = 0;
	r->p = aoqt_xcalloc(n, sizeof(double));
	r->m = aoqt_xcalloc(n, sizeof(double));
	r->v = aoqt_xcalloc(n, sizeof(double));
	r->err = aoqt_xcalloc(n, sizeof(double));
	r->em = aoqt_xcalloc(n, sizeof(double));
}

void aoqt_ref_free(struct aoqt_ref *r)
{
	free(r->p);
	free(r->m);
	free(r->v);
	free(r->err);
	free(r->em);
	memset(r, 0, sizeof(*r));
}

/* torch.optim.SGD: L2 decay, the buffer starts as the first gradient,
 * buf = momentum * buf + (1 - dampening) * g, nesterov g + momentum * buf.
 * em bounds the buffer's fp32 error as for Adam's m. */
static void ref_sgd(struct aoqt_ref *r, const struct aoq_group *hp, const float *g)
{
	const double lr = hp->lr, wd = hp->weight_decay, mu = hp->momentum, damp = hp->dampening;
	const double u32 = 0x1p-23;
	for (size_t i = 0; i < r->n; i++) {
		double p = r->p[i], gi = g[i] + wd * p;
		double eg = u32 * (fabs((double)g[i]) + 2 * fabs(wd * p));
		double d = gi, ed = eg;
		if (mu != 0) {
			double b0 = r->m[i], b, eb;
			if (r->k == 1) {
				b = gi;
				eb = eg;
			} else {
				b = mu * b0 + (1.0 - damp) * gi;
				eb = mu * r->em[i] + (1.0 - damp) * eg + u32 * (fabs(mu * b0) + fabs((1.0 - damp) * gi) + fabs(b));
			}
			r->m[i] = b;
			r->em[i] = eb;
			if (hp->nesterov) {
				d = gi + mu * b;
				ed = eg + mu * eb + u32 * (fabs(gi) + fabs(mu * b) + fabs(d));
			} else {
				d = b;
				ed = eb;
			}
		}
		double u = lr * d;
		p -= u;
		r->p[i] = p;
		r->err[i] += AOQT_RTOL * fabs(p) + AOQT_UTOL * fabs(u) + 2 * lr * ed;
	}
}

/* Lion (lion-pytorch): decoupled decay, p -= lr * sign(beta1 m + (1 - beta1) g),
 * m = beta2 m + (1 - beta2) g.  Where the interpolation is within its fp32
 * error of zero, the sign is free: the error bound takes 2 lr. */
static void ref_lion(struct aoqt_ref *r, const struct aoq_group *hp, const float *g)
{
	const double lr = hp->lr, wd = hp->weight_decay, b1 = hp->beta1, b2 = hp->beta2;
	const double u32 = 0x1p-23;
	for (size_t i = 0; i < r->n; i++) {
		double p = r->p[i], m0 = r->m[i], gi = g[i];
		double dec = p * lr * wd;
		p -= dec;
		double c = b1 * m0 + (1.0 - b1) * gi;
		double ec = b1 * r->em[i] + u32 * (fabs(b1 * m0) + fabs((1.0 - b1) * gi) + fabs(c));
		double sg = c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0;
		p -= lr * sg;
		double m = b2 * m0 + (1.0 - b2) * gi;
		r->em[i] = b2 * r->em[i] + u32 * (fabs(b2 * m0) + fabs((1.0 - b2) * gi) + fabs(m));
		r->m[i] = m;
		r->p[i] = p;
		r->err[i] += AOQT_RTOL * fabs(p) + AOQT_UTOL * (fabs(dec) + lr) + (fabs(c) <= 2 * ec ? 2 * lr : 0);
	}
}

void aoqt_ref_step(struct aoqt_ref *r, const struct aoq_group *hp, const float *g)
{
	const double lr = hp->lr, b1 = hp->beta1, b2 = hp->beta2;
	const double eps = hp->eps, wd = hp->weight_decay;
	r->k++;
	if (hp->kind == AOQ_SGD) {
		ref_sgd(r, hp, g);
		return;
	}
	if (hp->kind == AOQ_LION) {
		ref_lion(r, hp, g);
		return;
	}
	const double bc1 = 1.0 - pow(b1, (double)r->k);
	const double bc2 = 1.0 - pow(b2, (double)r->k);
	const double u32 = 0x1p-23; /* two half-ulps of fp32 per rounding */
	for (size_t i = 0; i < r->n; i++) {
		double p = r->p[i], gi = g[i], change = 0, eg = 0;
		if (hp->kind == AOQ_ADAM) {
			eg = u32 * (fabs(gi) + fabs(wd * p));
			gi += wd * p;
		} else {
			double dec = p * lr * wd;
			p -= dec;
			change += fabs(dec);
		}
		double m0 = r->m[i];
		double m = b1 * m0 + (1.0 - b1) * gi;
		double v = b2 * r->v[i] + (1.0 - b2) * gi * gi;
		double den = sqrt(v / bc2) + eps;
		double u = lr * (m / bc1) / den;
		p -= u;
		change += fabs(u);
		double em = b1 * r->em[i] + (1.0 - b1) * eg + u32 * (fabs(b1 * m0) + fabs((1.0 - b1) * gi) + fabs(m));
		r->em[i] = em;
		r->m[i] = m;
		r->v[i] = v;
		r->p[i] = p;
		r->err[i] += AOQT_RTOL * fabs(p) + AOQT_UTOL * change + 2 * lr * (em / bc1) / den;
	}
}

void aoqt_ref_resync(struct aoqt_ref *r, const float *p)
{
	for (size_t i = 0; i < r->n; i++) {
		r->p[i] = p[i];
		r->err[i] = 0;
	}
}

double aoqt_sumsq(const float *g, size_t n)
{
	double s = 0;
	for (size_t i = 0; i < n; i++)
		s += (double)g[i] * g[i];
	return s;
}

#define MAX_REPORT 5

size_t aoqt_check_param(const char *what, const struct aoqt_ref *r, const void *param, enum aoq_dtype t)
{
	size_t bad = 0;
	for (size_t i = 0; i < r->n; i++) {
		uint32_t got = aoqt_bits(param, i, t);
		double gv = aoqt_decode(got, t), ref = r->p[i], tol = r->err[i];
		/* Within the fp32 bound, or (bf16/fp16) 1 ulp of the reference
		 * rounded to t. */
		if (!isnan(gv) && fabs(gv - ref) <= tol)
			continue;
		uint32_t want = aoqt_encode(ref, t);
		uint64_t ulps = aoqt_ulp_dist(got, want, t);
		if (t != AOQ_FP32 && ulps <= 1)
			continue;
		{
			if (bad < MAX_REPORT)
				fprintf(stderr,
				        "  %s [%zu] after %" PRIu64 " steps: got %.9g (0x%x) want %.12g "
				        "(0x%x, %s; |diff| %.3g, tol %.3g, %" PRIu64 " ulp)\n",
				        what, i, r->k, gv, got, ref, want, aoq_dtype_name(t), fabs(gv - ref), tol,
				        ulps);
			bad++;
		}
	}
	if (bad)
		fprintf(stderr, "  %s: %zu of %zu elements off\n", what, bad, r->n);
	return bad;
}

size_t aoqt_check_master(const char *what, const struct aoqt_ref *r, const float *master)
{
	size_t bad = 0;
	for (size_t i = 0; i < r->n; i++) {
		double gv = master[i], ref = r->p[i];
		if (isnan(gv) || fabs(gv - ref) > r->err[i]) {
			if (bad < MAX_REPORT)
				fprintf(stderr, "  %s master [%zu] after %" PRIu64 " steps: got %.9g want %.12g (tol %.3g)\n",
				        what, i, r->k, gv, ref, r->err[i]);
			bad++;
		}
	}
	if (bad)
		fprintf(stderr, "  %s master: %zu of %zu elements off\n", what, bad, r->n);
	return bad;
}

/* ---- raw protocol ------------------------------------------------------ */

int aoqt_raw_connect(const char *path)
{
	int fd = aoq_socket_connect(path);
	if (fd < 0)
		return fd;
	struct timeval tv = { .tv_sec = 20 };
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	return fd;
}

int aoqt_send_env(int fd, Aoq__Envelope *env)
{
	return aoq_send_frame(fd, env, NULL, 0);
}

int aoqt_send_msg(int fd, Aoq__Envelope__MsgCase c, void *msg)
{
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = c;
	/* Every member of the oneof is a pointer at the same place. */
	env.hello = msg;
	return aoqt_send_env(fd, &env);
}

int aoqt_raw_hello(int fd, const char *job, uint32_t rank, bool observer, uint64_t *id)
{
	Aoq__Hello h = AOQ__HELLO__INIT;
	h.protocol_version = AOQ_PROTOCOL_VERSION;
	h.arena_version = AOQ_ARENA_VERSION;
	h.job = (char *)job;
	h.rank = rank;
	h.device = (char *)"cpu";
	h.pid = (uint32_t)getpid();
	h.observer = observer;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_HELLO;
	env.hello = &h;
	Aoq__Envelope *rep = NULL;
	int r = aoq_call(fd, &env, &rep, NULL);
	if (r < 0)
		return r;
	if (rep->msg_case != AOQ__ENVELOPE__MSG_WELCOME) {
		aoq_envelope_free(rep);
		return -EPROTO;
	}
	if (id)
		*id = rep->welcome->session_id;
	aoq_envelope_free(rep);
	return 0;
}

int aoqt_raw_expect_close(int fd, int timeout_ms, char *msg, size_t msglen)
{
	int code = -1;
	double deadline = aoqt_now() + timeout_ms / 1000.0;
	if (msg && msglen)
		msg[0] = 0;
	for (;;) {
		double left = deadline - aoqt_now();
		if (left <= 0)
			return -2;
		struct pollfd pf = { .fd = fd, .events = POLLIN };
		int pr = poll(&pf, 1, (int)(left * 1000) + 1);
		if (pr < 0 && errno == EINTR)
			continue;
		if (pr == 0)
			return -2;
		Aoq__Envelope *env = NULL;
		int fds[AOQ_MAX_FDS], nfds = 0;
		int r = aoq_recv_frame(fd, &env, fds, AOQ_MAX_FDS, &nfds);
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		if (r == -ECONNRESET || r == -EPIPE)
			return code; /* EOF (or reset after the daemon closed) */
		if (r == -EAGAIN)
			return -2;
		if (r < 0)
			return -3;
		if (env->msg_case == AOQ__ENVELOPE__MSG_ERROR && code == -1) {
			code = (int)env->error->code;
			if (msg && msglen)
				snprintf(msg, msglen, "%s", env->error->message ? env->error->message : "");
		}
		aoq_envelope_free(env);
	}
}

static int raw_open(struct aoqt_raw *s, const char *path, const char *job, const uint64_t *numel, uint32_t n,
                    uint32_t world, uint32_t rank, bool bf16);

const char *const aoqt_mw_names[AOQT_MW_N] = { "map", "write", "truncate", "punch", "seal" };

void aoqt_masters_write_attempts(int fd, size_t len, int e[AOQT_MW_N])
{
	void *w = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	e[AOQT_MW_MAP] = w == MAP_FAILED ? errno : 0;
	if (w != MAP_FAILED)
		munmap(w, len);
	uint16_t junk[8] = { 0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0, 0x7fc0 };
	e[AOQT_MW_WRITE] = pwrite(fd, junk, sizeof(junk), 0) < 0 ? errno : 0;
	e[AOQT_MW_TRUNCATE] = ftruncate(fd, 0) < 0 ? errno : 0;
	e[AOQT_MW_PUNCH] = fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) < 0 ? errno : 0;
	e[AOQT_MW_SEAL] = fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE) < 0 ? errno : 0;
}

int aoqt_raw_open(struct aoqt_raw *s, const char *path, const char *job, const uint64_t *numel, uint32_t n)
{
	return raw_open(s, path, job, numel, n, 0, 0, false);
}

int aoqt_raw_open_bf16(struct aoqt_raw *s, const char *path, const char *job, const uint64_t *numel, uint32_t n)
{
	return raw_open(s, path, job, numel, n, 0, 0, true);
}

int aoqt_raw_open_group(struct aoqt_raw *s, const char *path, const char *job, const uint64_t *numel, uint32_t n,
                        uint32_t world, uint32_t rank)
{
	return raw_open(s, path, job, numel, n, world, rank, false);
}

static int raw_open(struct aoqt_raw *s, const char *path, const char *job, const uint64_t *numel, uint32_t n,
                    uint32_t world, uint32_t rank, bool bf16)
{
	memset(s, 0, sizeof(*s));
	s->sock = s->arena_fd = s->to_daemon = s->to_client = s->masters_fd = -1;
	if (n > 8)
		return -EINVAL;
	int r = aoqt_raw_connect(path);
	if (r < 0)
		return r;
	s->sock = r;
	if (world > 1) {
		Aoq__Hello h = AOQ__HELLO__INIT;
		h.protocol_version = AOQ_PROTOCOL_VERSION;
		h.arena_version = AOQ_ARENA_VERSION;
		h.job = (char *)job;
		h.rank = rank;
		h.device = (char *)"cpu";
		h.pid = (uint32_t)getpid();
		h.local_world = world;
		h.local_rank = rank;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT;
		env.msg_case = AOQ__ENVELOPE__MSG_HELLO;
		env.hello = &h;
		Aoq__Envelope *rep = NULL;
		r = aoq_call(s->sock, &env, &rep, NULL);
		if (r < 0)
			return r;
		bool ok = rep->msg_case == AOQ__ENVELOPE__MSG_WELCOME;
		if (ok)
			s->id = rep->welcome->session_id;
		aoq_envelope_free(rep);
		if (!ok)
			return -EPROTO;
	} else {
		r = aoqt_raw_hello(s->sock, job, 0, false, &s->id);
		if (r < 0)
			return r;
	}

	Aoq__Hyperparams hp = AOQ__HYPERPARAMS__INIT;
	hp.lr = 1e-3;
	hp.beta1 = 0.9;
	hp.beta2 = 0.999;
	hp.eps = 1e-8;
	Aoq__Group g = AOQ__GROUP__INIT;
	g.kind = AOQ__OPTIMIZER_KIND__ADAMW;
	g.hp = &hp;
	Aoq__Group *gp = &g;
	Aoq__TensorDesc td[8], *tdp[8];
	char names[8][16];
	for (uint32_t i = 0; i < n; i++) {
		aoq__tensor_desc__init(&td[i]);
		snprintf(names[i], sizeof(names[i]), "t%u", i);
		td[i].name = names[i];
		td[i].numel = numel[i];
		td[i].param_dtype = bf16 ? AOQ__DTYPE__BF16 : AOQ__DTYPE__FP32;
		td[i].grad_dtype = bf16 ? AOQ__DTYPE__BF16 : AOQ__DTYPE__FP32;
		td[i].group = 0;
		tdp[i] = &td[i];
		s->numel[i] = numel[i];
	}
	s->tensors = n;
	Aoq__Register reg = AOQ__REGISTER__INIT;
	reg.n_groups = 1;
	reg.groups = &gp;
	reg.n_tensors = n;
	reg.tensors = tdp;
	reg.more = false;
	reg.precision = bf16 ? AOQ__STATE_PRECISION__STATE_BF16 : AOQ__STATE_PRECISION__STATE_FP32;
	r = aoqt_send_msg(s->sock, AOQ__ENVELOPE__MSG_REGISTER, &reg);
	if (r < 0)
		return r;
	Aoq__Envelope *rep = NULL;
	int fds[AOQ_MAX_FDS], nfds = 0;
	r = aoq_recv_frame(s->sock, &rep, fds, AOQ_MAX_FDS, &nfds);
	if (r < 0)
		return r;
	if (rep->msg_case != AOQ__ENVELOPE__MSG_REGISTERED || (bf16 ? nfds < 4 : nfds != 3)) {
		fprintf(stderr, "raw register: reply %d with %d fds (%s)\n", (int)rep->msg_case, nfds,
		        rep->msg_case == AOQ__ENVELOPE__MSG_ERROR ? rep->error->message : "");
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		aoq_envelope_free(rep);
		return -EPROTO;
	}
	uint64_t lane[3] = { rep->registered->lane_to_daemon_off, rep->registered->lane_to_client_off,
	                     rep->registered->lane_xfer_off };
	aoq_envelope_free(rep);
	s->arena_fd = fds[0];
	s->to_daemon = fds[1];
	s->to_client = fds[2];
	if (bf16)
		s->masters_fd = fds[3];
	for (int i = 4; i < nfds; i++)
		close(fds[i]); /* the other masters memfds (a large model's) */
	struct stat st;
	if (fstat(s->arena_fd, &st) < 0)
		return -errno;
	if ((size_t)st.st_size < sizeof(struct aoq_arena_header))
		return -EPROTO;
	s->arena_size = (size_t)st.st_size;
	void *a = mmap(NULL, s->arena_size, PROT_READ | PROT_WRITE, MAP_SHARED, s->arena_fd, 0);
	if (a == MAP_FAILED)
		return -errno;
	s->arena = a;
	memcpy(&s->hdr, s->arena, sizeof(s->hdr));
	if (world > 1) {
		s->hdr.to_daemon_off = lane[0];
		s->hdr.to_client_off = lane[1];
		s->hdr.xfer_off = lane[2];
	}
	const struct aoq_arena_header *h = &s->hdr;
	if (aoq_arena_header_check(h, s->arena_size) < 0 || h->tensors != n) {
		fprintf(stderr, "raw register: bad arena header\n");
		return -EPROTO;
	}
	s->prod.ring = (struct aoq_ring *)(s->arena + h->to_daemon_off);
	s->prod.cap = h->ring_capacity;
	s->prod.head = 0;
	s->cons.ring = (struct aoq_ring *)(s->arena + h->to_client_off);
	s->cons.cap = h->ring_capacity;
	s->cons.tail = 0;
	return 0;
}

void aoqt_raw_close(struct aoqt_raw *s)
{
	if (s->arena)
		munmap(s->arena, s->arena_size);
	int fds[] = { s->sock, s->arena_fd, s->to_daemon, s->to_client, s->masters_fd };
	for (int i = 0; i < 5; i++)
		if (fds[i] >= 0)
			close(fds[i]);
	memset(s, 0, sizeof(*s));
	s->sock = s->arena_fd = s->to_daemon = s->to_client = s->masters_fd = -1;
}

int aoqt_raw_push(struct aoqt_raw *s, const struct aoq_rec *rec)
{
	int r = aoq_ring_push(&s->prod, rec);
	if (r < 0)
		return r;
	/* Ring whether or not the helper says it must: a hostile client may
	 * well, and it costs nothing here. */
	uint64_t one = 1;
	if (write(s->to_daemon, &one, sizeof(one)) != sizeof(one))
		return -errno;
	return 0;
}

int aoqt_raw_pop(struct aoqt_raw *s, struct aoq_rec *rec, int timeout_ms)
{
	double deadline = aoqt_now() + timeout_ms / 1000.0;
	for (;;) {
		int r = aoq_ring_peek(&s->cons, rec);
		if (r < 0)
			return r;
		if (r == 1) {
			aoq_ring_pop(&s->cons);
			return 1;
		}
		if (!aoq_ring_idle(&s->cons))
			continue;
		double left = deadline - aoqt_now();
		if (left <= 0)
			return 0;
		struct pollfd pf = { .fd = s->to_client, .events = POLLIN };
		if (poll(&pf, 1, (int)(left * 1000) + 1) > 0) {
			uint64_t v;
			ssize_t n = read(s->to_client, &v, sizeof(v));
			if (n < 0 && errno != EAGAIN)
				return -errno;
			/* The daemon closed its end (a failed session): no record
			 * will come; the ring was drained above. */
			if (n == 0 && aoq_ring_idle(&s->cons))
				return -EPIPE;
		}
	}
}

int aoqt_stats(const char *path, Aoq__Envelope **out)
{
	int fd = aoqt_raw_connect(path);
	if (fd < 0)
		return fd;
	int r = aoqt_raw_hello(fd, "aoqt-observer", 0, true, NULL);
	if (r < 0)
		goto done;
	Aoq__StatsRequest req = AOQ__STATS_REQUEST__INIT;
	req.all_sessions = true;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_STATS_REQUEST;
	env.stats_request = &req;
	Aoq__Envelope *rep = NULL;
	r = aoq_call(fd, &env, &rep, NULL);
	if (r < 0)
		goto done;
	if (rep->msg_case != AOQ__ENVELOPE__MSG_STATS) {
		aoq_envelope_free(rep);
		r = -EPROTO;
		goto done;
	}
	*out = rep;
done:
	close(fd);
	return r;
}

void aoqt_victim_tensors(struct aoq_client *c, const struct aoqt_tdesc *d, int n, uint64_t seed, void **param,
                         void **grad, float **gval, struct aoqt_ref *ref)
{
	for (int t = 0; t < n; t++) {
		param[t] = aoqt_xmalloc(d[t].n * aoqt_dtype_size(d[t].pd));
		grad[t] = aoqt_xmalloc(d[t].n * aoqt_dtype_size(d[t].gd));
		gval[t] = aoqt_xmalloc(d[t].n * sizeof(float));
		aoqt_ref_init(&ref[t], d[t].n);
		struct aoqt_rng rng = aoqt_rng_for(seed, (uint64_t)t, 0);
		for (uint64_t i = 0; i < d[t].n; i++) {
			aoqt_store(param[t], i, d[t].pd, aoqt_uniform(&rng));
			ref[t].p[i] = aoqt_load(param[t], i, d[t].pd);
		}
		char name[16];
		snprintf(name, sizeof(name), "w%d", t);
		struct aoq_tensor td = { .size = sizeof(struct aoq_tensor), .name = name, .numel = d[t].n,
		                         .param_dtype = d[t].pd, .grad_dtype = d[t].gd, .group = d[t].group,
		                         .param = param[t], .grad = grad[t] };
		int r = aoq_add_tensor(c, &td);
		if (r != t)
			aoqt_fail("aoq_add_tensor w%d = %d: %s", t, r, aoq_last_error());
	}
}

struct aoq_group aoqt_victim_group(uint32_t g, uint64_t k)
{
	struct aoq_group h = g == 0
		? (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 2e-3, .beta1 = 0.9,
		                      .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.02 }
		: (struct aoq_group){ .size = sizeof(struct aoq_group), .kind = AOQ_ADAM, .lr = 1e-3, .beta1 = 0.9,
		                      .beta2 = 0.98, .eps = 1e-6, .weight_decay = 0.01 };
	h.lr *= 1.0 + 0.5 * sin(0.3 * (double)k);
	return h;
}

void aoqt_victim_open(struct aoqt_victim *v, const char *socket, const char *job, int timeout_ms,
                      const struct aoqt_tdesc *d, int n, uint64_t seed, uint64_t gseed, void **param)
{
	*v = (struct aoqt_victim){ .job = job, .d = d, .n = n, .gseed = gseed, .param = param };
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = socket;
	o.job = job;
	o.device = "cpu";
	if (timeout_ms > 0)
		o.timeout_ms = (uint32_t)timeout_ms;
	if (aoq_connect(&v->c, &o) < 0)
		aoqt_fail("victim %s: aoq_connect: %s", job, aoq_last_error());
	for (uint32_t g = 0; g < 2; g++) {
		struct aoq_group h = aoqt_victim_group(g, 1);
		if (aoq_add_group(v->c, &h) < 0)
			aoqt_fail("victim %s: aoq_add_group: %s", job, aoq_last_error());
	}
	v->grad = aoqt_xcalloc((size_t)n, sizeof(*v->grad));
	v->gval = aoqt_xcalloc((size_t)n, sizeof(*v->gval));
	v->ref = aoqt_xcalloc((size_t)n, sizeof(*v->ref));
	aoqt_victim_tensors(v->c, d, n, seed, param, v->grad, v->gval, v->ref);
	if (aoq_register(v->c) < 0)
		aoqt_fail("victim %s: aoq_register: %s", job, aoq_last_error());
}

void aoqt_victim_step(struct aoqt_victim *v, uint64_t k)
{
	if (k > 1)
		for (uint32_t g = 0; g < 2; g++) {
			struct aoq_group h = aoqt_victim_group(g, k);
			if (aoq_set_hyperparams(v->c, g, &h) < 0)
				aoqt_fail("victim %s step %" PRIu64 ": aoq_set_hyperparams: %s", v->job, k, aoq_last_error());
		}
	for (int t = 0; t < v->n; t++) {
		const struct aoqt_tdesc *d = &v->d[t];
		struct aoqt_rng rng = aoqt_rng_for(v->gseed + k, (uint64_t)t, 0);
		for (uint64_t i = 0; i < d->n; i++) {
			aoqt_store(v->grad[t], i, d->gd, 0.1 * aoqt_uniform(&rng));
			v->gval[t][i] = (float)aoqt_load(v->grad[t], i, d->gd);
		}
		if (aoq_push_grad(v->c, (uint32_t)t, 0, NULL) < 0)
			aoqt_fail("victim %s step %" PRIu64 ": aoq_push_grad %d: %s", v->job, k, t, aoq_last_error());
	}
	struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
	if (aoq_step_end(v->c) < 0 || aoq_sync(v->c, &res) < 0)
		aoqt_fail("victim %s step %" PRIu64 ": %s", v->job, k, aoq_last_error());
	if (res.step != k || res.tensors_updated != (uint64_t)v->n)
		aoqt_fail("victim %s: step result %" PRIu64 " with %" PRIu64 " tensors, want %" PRIu64 " with %d", v->job,
		          res.step, res.tensors_updated, k, v->n);
	size_t bad = 0;
	for (int t = 0; t < v->n; t++) {
		struct aoq_group h = aoqt_victim_group(v->d[t].group, k);
		aoqt_ref_step(&v->ref[t], &h, v->gval[t]);
		char what[96];
		snprintf(what, sizeof(what), "victim %s step %" PRIu64 " tensor %d", v->job, k, t);
		bad += aoqt_check_param(what, &v->ref[t], v->param[t], v->d[t].pd);
		if (v->d[t].pd == AOQ_FP32)
			aoqt_ref_resync(&v->ref[t], v->param[t]);
	}
	if (bad)
		aoqt_fail("victim %s step %" PRIu64 ": %zu parameters differ from the reference", v->job, k, bad);
}

void aoqt_victim_close(struct aoqt_victim *v)
{
	aoq_close(v->c);
	v->c = NULL;
	for (int t = 0; t < v->n; t++) {
		free(v->grad[t]);
		free(v->gval[t]);
		aoqt_ref_free(&v->ref[t]);
	}
	free(v->grad);
	free(v->gval);
	free(v->ref);
}

int aoqt_snapshot_ask(const char *sock, uint64_t id)
{
	int fd = aoqt_raw_connect(sock);
	CHECK_OK(fd);
	uint64_t oid;
	CHECK_OK(aoqt_raw_hello(fd, "aoqctl", 0, true, &oid));
	Aoq__SnapshotRequest q = AOQ__SNAPSHOT_REQUEST__INIT;
	q.session = id;
	CHECK_OK(aoqt_send_msg(fd, AOQ__ENVELOPE__MSG_SNAPSHOT_REQUEST, &q));
	return fd;
}

int aoqt_snapshot_wait(int fd, char *path, size_t len, uint64_t *step)
{
	Aoq__Envelope *rep = NULL;
	int r = aoq_recv_frame(fd, &rep, NULL, 0, NULL);
	CHECK(r >= 0 && rep, "no reply to SnapshotRequest (%d)", r);
	if (rep->msg_case == AOQ__ENVELOPE__MSG_ERROR) {
		snprintf(path, len, "%s", rep->error->message);
		r = -(int)rep->error->code - 1000;
	} else {
		CHECK(rep->msg_case == AOQ__ENVELOPE__MSG_SNAPSHOT_DONE, "reply %d", (int)rep->msg_case);
		snprintf(path, len, "%s", rep->snapshot_done->path);
		*step = rep->snapshot_done->step;
		r = 0;
	}
	aoq_envelope_free(rep);
	close(fd);
	return r;
}

int aoqt_snapshot(const char *sock, uint64_t id, char *path, size_t len, uint64_t *step)
{
	return aoqt_snapshot_wait(aoqt_snapshot_ask(sock, id), path, len, step);
}

void aoqt_job_open(struct aoqt_job *j, const char *sock, const char *job, uint32_t nt, uint64_t n)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	o.job = job;
	o.device = "cpu";
	CHECK_OK(aoq_connect(&j->c, &o));
	struct aoq_group h = { .size = sizeof(h), .kind = AOQ_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
	                       .eps = 1e-8, .weight_decay = 0.01 };
	CHECK_OK(aoq_add_group(j->c, &h));
	j->nt = nt;
	j->p = aoqt_xcalloc(nt, sizeof(float *));
	j->g = aoqt_xcalloc(nt, sizeof(float *));
	for (uint32_t t = 0; t < nt; t++) {
		j->p[t] = aoqt_xcalloc(n, sizeof(float));
		j->g[t] = aoqt_xcalloc(n, sizeof(float));
		for (uint64_t i = 0; i < n; i++)
			j->g[t][i] = (float)((i % 7) + 1) * 1e-3f;
		char name[16];
		snprintf(name, sizeof(name), "t%u", t);
		struct aoq_tensor td = { .size = sizeof(td), .name = name, .numel = n, .param_dtype = AOQ_FP32,
		                         .grad_dtype = AOQ_FP32, .group = 0, .param = j->p[t], .grad = j->g[t] };
		CHECK_OK(aoq_add_tensor(j->c, &td));
	}
	CHECK_OK(aoq_register(j->c));
}

double aoqt_job_step(struct aoqt_job *j)
{
	double t0 = aoqt_now();
	for (uint32_t t = 0; t < j->nt; t++)
		CHECK_OK(aoq_push_grad(j->c, t, 0, NULL));
	CHECK_OK(aoq_step_end(j->c));
	CHECK_OK(aoq_sync(j->c, NULL));
	return aoqt_now() - t0;
}

void aoqt_job_close(struct aoqt_job *j)
{
	aoq_close(j->c);
	for (uint32_t t = 0; t < j->nt; t++) {
		free(j->p[t]);
		free(j->g[t]);
	}
	free(j->p);
	free(j->g);
	memset(j, 0, sizeof(*j));
}

int aoqt_drop(const char *path, uint64_t id, char *msg, size_t len)
{
	int fd = aoqt_raw_connect(path);
	if (fd < 0)
		return fd;
	int r = aoqt_raw_hello(fd, "aoqctl", 0, true, NULL);
	if (r == 0) {
		Aoq__DropRequest m = AOQ__DROP_REQUEST__INIT;
		m.session = id;
		Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep = NULL;
		env.msg_case = AOQ__ENVELOPE__MSG_DROP_REQUEST;
		env.drop_request = &m;
		char *em = NULL;
		r = aoq_call(fd, &env, &rep, &em);
		if (em)
			snprintf(msg, len, "%s", em);
		free(em);
		if (r == 0 && rep->msg_case != AOQ__ENVELOPE__MSG_DONE)
			r = -EPROTO;
		if (r == 0)
			aoq_envelope_free(rep);
	}
	close(fd);
	return r;
}

struct aoq_group aoqt_adamw(double lr)
{
	struct aoq_group g = AOQ_GROUP_INIT;
	g.kind = AOQ_ADAMW;
	g.lr = lr;
	g.beta1 = 0.9;
	g.beta2 = 0.999;
	g.eps = 1e-8;
	return g;
}
