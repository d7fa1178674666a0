/* SPDX-License-Identifier: MIT */
/*
 * bench-restart: how long a trainer is paused when aoqd restarts mid-step,
 * with the fd store (SIGTERM: the state is rolled back in its memfd, the
 * next aoqd maps it in place; SIGKILL: the next aoqd replays the memfd's
 * journal) against a snapshot restore of the same state (a snapshot at
 * the last completed step, SIGKILL, the store emptied as by `systemctl
 * stop`, the next aoqd reads the snapshot).
 * A supervisor does what systemd does (tests/integration/supervisor.h),
 * or systemd itself: run under tests/ops/unit-ns.sh ($AOQ_UNIT_LOG set),
 * the trainer uses the real aoqd.service through its socket unit and
 * restarts it with `systemctl restart aoqd.service`, `systemctl kill
 * --signal=SIGKILL aoqd.service` (Restart=on-failure starts it again) and,
 * for the snapshot restore, that kill and `systemctl stop` (the store
 * emptied) and `start`; aoqd's config is then unit-ns.sh's --conf.
 *
 *   bench-restart [PARAMS [TENSORS [PRECISION [nosnapshot]]]]
 *       (default 2^30 parameters, 16 tensors, fp32; PRECISION below;
 *       nosnapshot: the fd store's restarts only, where a snapshot's
 *       write would not fit in memory beside the state)
 *
 * aoqd: $AOQD when set, else the build's (not under systemd), with the
 * kernel $AOQ_KERNEL names (default auto: the machine's best).
 *
 * One AdamW job (fp32: 12 B of state per parameter, and the lease's undo
 * copy as much again; PRECISION q8 or bf16-q8: bf16 parameters whose
 * masters live in memfds of their own), host backend.  The pause: from the signal until the
 * trainer has finished the interrupted step again, less that step's
 * undisturbed time; with its parts (the old aoqd's stop, the new one's
 * start to READY=1, the trainer's reconnect and resume) and aoqd's log
 * lines timed from the signal.  The trainer lets go of its old session
 * while the new aoqd starts, as a trainer does that meets the dead socket;
 * its tensors are not copied into the supervisor's fork (systemd's PID 1
 * is small).  Peak memory is
 * about 40 B per parameter (the state and its undo copy in their memfd,
 * 24, and the trainer's 16).
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "supervisor.h"

#ifndef AOQD_PATH
#define AOQD_PATH "aoqd"
#endif

static const char *aoqd_exe(void)
{
	const char *e = getenv("AOQD");
	return e && *e ? e : AOQD_PATH;
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* aoqd's log lines as they come, each with the time since the restart
 * began (aoqd's lines carry no time of their own): where a pause goes. */
static struct {
	pthread_mutex_t mu;
	const char *path;
	double t0;
	char buf[1 << 16];
	size_t len;
	bool stop;
} tail = { .mu = PTHREAD_MUTEX_INITIALIZER };

static void *tail_run(void *arg)
{
	(void)arg;
	FILE *f = NULL;
	char line[1024];
	size_t have = 0;
	while (!tail.stop) {
		if (!f)
			f = fopen(tail.path, "r");
		int c;
		while (f && (c = fgetc(f)) != EOF) {
			if (have < sizeof(line) - 1)
				line[have++] = (char)c;
			if (c != '\n')
				continue;
			line[have] = '\0';
			have = 0;
			pthread_mutex_lock(&tail.mu);
			if (tail.t0 > 0 && tail.len < sizeof(tail.buf) - 1)
				tail.len += (size_t)snprintf(tail.buf + tail.len, sizeof(tail.buf) - tail.len,
				                             "    +%6.3f s  %s", now() - tail.t0, line);
			if (tail.len >= sizeof(tail.buf))
				tail.len = sizeof(tail.buf) - 1;
			pthread_mutex_unlock(&tail.mu);
		}
		if (f)
			clearerr(f);
		usleep(2000);
	}
	if (f)
		fclose(f);
	return NULL;
}

/* From now, lines are timed from t0 (the lines kept so far dropped). */
static void tail_mark(double t0)
{
	pthread_mutex_lock(&tail.mu);
	tail.t0 = t0;
	tail.len = 0;
	pthread_mutex_unlock(&tail.mu);
}

/* Waits until a line since the mark holds `needle`; false after timeout_s. */
static bool tail_wait(const char *needle, double timeout_s)
{
	double t_end = now() + timeout_s;
	for (;;) {
		pthread_mutex_lock(&tail.mu);
		tail.buf[tail.len] = '\0';
		bool seen = strstr(tail.buf, needle) != NULL;
		pthread_mutex_unlock(&tail.mu);
		if (seen)
			return true;
		if (now() > t_end)
			return false;
		usleep(1000);
	}
}

static void tail_print(void)
{
	usleep(20000); /* the last lines read */
	pthread_mutex_lock(&tail.mu);
	fwrite(tail.buf, 1, tail.len, stdout);
	tail.len = 0;
	pthread_mutex_unlock(&tail.mu);
}

struct job {
	struct aoq_client *c;
	unsigned nt;
	uint64_t per;
	enum aoq_dtype dt;     /* the parameters' and gradients' */
	enum aoq_precision prec;
	void **p, **g;
};

static double connected_s, registered_s, pushed_s; /* the last job_open's connect and register, job_step's pushes */

static uint64_t job_open(struct job *j, const char *sock)
{
	double t_open = now();
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	o.job = "bench-restart";
	o.timeout_ms = 600000;
	o.seed = 1;
	o.precision = j->prec;
	CHECK_OK(aoq_connect(&j->c, &o));
	connected_s = now() - t_open;
	struct aoq_group g = AOQ_GROUP_INIT;
	g.kind = AOQ_ADAMW;
	g.lr = 1e-4;
	g.beta1 = 0.9;
	g.beta2 = 0.999;
	g.eps = 1e-8;
	g.weight_decay = 0.01;
	CHECK_OK(aoq_add_group(j->c, &g));
	for (unsigned i = 0; i < j->nt; i++) {
		char name[32];
		snprintf(name, sizeof(name), "layers.%u.weight", i);
		struct aoq_tensor t = AOQ_TENSOR_INIT;
		t.name = name;
		t.numel = j->per;
		t.param_dtype = t.grad_dtype = j->dt;
		t.param = j->p[i];
		t.grad = j->g[i];
		CHECK_OK(aoq_add_tensor(j->c, &t));
	}
	double t_reg = now();
	CHECK_OK(aoq_register(j->c)); /* a resume reads the parameters back in it */
	registered_s = now() - t_reg;
	uint64_t step = 0;
	CHECK(aoq_resumed(j->c, &step) >= 0, "aoq_resumed");
	return step;
}

/* Step k's first `upto` tensors (all: the whole step, synced). */
static int job_step(struct job *j, unsigned upto)
{
	int r;
	double t = now();
	for (unsigned i = 0; i < upto; i++)
		if ((r = aoq_push_grad(j->c, i, 0, NULL)) < 0)
			return r;
	pushed_s = now() - t;
	if (upto < j->nt)
		return aoq_sync_param(j->c, 0);
	struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
	if ((r = aoq_step_end(j->c)) < 0 || (r = aoq_sync(j->c, &res)) < 0)
		return r;
	return 0;
}

static uint64_t session_id(const char *sock)
{
	Aoq__Envelope *env;
	CHECK_OK(aoqt_stats(sock, &env));
	CHECK(env->stats && env->stats->n_sessions >= 1, "no session in Stats");
	uint64_t id = 0;
	for (size_t i = 0; i < env->stats->n_sessions; i++)
		if (strcmp(env->stats->sessions[i]->job, "bench-restart") == 0)
			id = env->stats->sessions[i]->id;
	aoq_envelope_free(env);
	CHECK(id, "the job's session is not in Stats");
	return id;
}

static void *close_run(void *c)
{
	aoq_close(c);
	return NULL;
}

struct pause {
	double stop, start, resume, redo, total;
	double connect, reg, push; /* of resume (reg: the parameters read back), of redo */
	uint64_t at;
};

/* Under systemd (tests/ops/unit-ns.sh): aoqd's output, else NULL. */
static const char *unit_log;

static void systemctl(const char *args)
{
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "systemctl --no-pager %s", args);
	int r = system(cmd);
	CHECK(r == 0, "'%s' exited %d", cmd, r);
}

static void *restart_run(void *arg)
{
	(void)arg;
	systemctl("restart aoqd.service"); /* returns at the new aoqd's READY=1 */
	return NULL;
}

/* Half of a step, aoqd killed with sig (and the store emptied when
 * `drop`), started again, the trainer back and the step done again.
 * Under systemd: SIGTERM is `systemctl restart` (the stop ends at the old
 * aoqd's last line, the start at the command's return), SIGKILL
 * `systemctl kill` with the unit's own restart (counted in the resume's
 * connect). */
static struct pause restart(struct sup *s, struct job *j, const char *sock, int sig, bool drop, double step_s)
{
	struct pause p;
	CHECK_OK(job_step(j, j->nt / 2));
	double t0 = now();
	tail_mark(t0);
	pthread_t restarter;
	if (unit_log && sig == SIGTERM) {
		/* the trainer lets go of its session once its daemon is gone,
		 * as one does that meets the dead socket: not before (a Bye
		 * would end the state) */
		CHECK(pthread_create(&restarter, NULL, restart_run, NULL) == 0, "pthread_create");
		CHECK(tail_wait("aoqd info main: stopped", 600), "the old aoqd did not stop within 600 s");
	} else if (unit_log) {
		systemctl("kill --signal=SIGKILL aoqd.service");
		if (drop)
			systemctl("stop aoqd.service"); /* the store emptied */
	} else {
		sup_kill(s, sig);
		for (int i = 0; drop && i < s->nstored; i++)
			close(s->stored_fd[i]);
		if (drop)
			s->nstored = 0;
	}
	double t1 = now();
	/* The trainer lets go of its old session (unmaps its arena) as the
	 * daemon's socket dies, while the new aoqd starts: at once. */
	pthread_t closer;
	CHECK(pthread_create(&closer, NULL, close_run, j->c) == 0, "pthread_create");
	if (!unit_log)
		sup_start(s, aoqd_exe(), NULL, NULL, 0);
	else if (sig == SIGTERM)
		pthread_join(restarter, NULL);
	else if (drop)
		systemctl("start aoqd.service");
	double t2 = now();
	pthread_join(closer, NULL);
	j->c = NULL;
	p.at = job_open(j, sock);
	double t3 = now();
	CHECK_OK(job_step(j, j->nt));
	double t4 = now();
	p.stop = t1 - t0;
	p.start = t2 - t1;
	p.resume = t3 - t2;
	p.redo = t4 - t3;
	p.connect = connected_s;
	p.reg = registered_s;
	p.push = pushed_s;
	p.total = t4 - t0 - step_s;
	return p;
}

/* The trainer's tensors, not copied into the supervisor's fork: systemd
 * starts aoqd from a small PID 1, and a fork that copied the page tables
 * of 8 GB of tensors (1 G parameters) took about a second, counted in the
 * start's time although no aoqd runs yet. */
static void *trainer_alloc(size_t bytes)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(p != MAP_FAILED, "mmap %zu: %s", bytes, strerror(errno));
	CHECK(madvise(p, bytes, MADV_DONTFORK) == 0, "MADV_DONTFORK: %s", strerror(errno));
	return p;
}

static double undisturbed_push_s;
static uint64_t param_bytes; /* the trainer's parameters */

static void report(const char *what, const struct pause *p, double step_s)
{
	printf("%-22s pause %7.3f s  (stop %6.3f, start to READY %6.3f, reconnect+resume %6.3f, step %6.3f vs %6.3f "
	       "undisturbed), resumed at step %" PRIu64 "\n",
	       what, p->total, p->stop, p->start, p->resume, p->redo, step_s, p->at);
	printf("    of the resume: reconnect %.3f s, registration with the parameters read back %.3f s (%.2f GB/s); "
	       "the step's pushes %.3f s (undisturbed %.3f); aoqd's log:\n",
	       p->connect, p->reg, p->reg > 0 ? (double)param_bytes / p->reg * 1e-9 : 0.0, p->push, undisturbed_push_s);
	tail_print();
}

int main(int argc, char **argv)
{
	aoqt_init("bench-restart");
	uint64_t params = argc > 1 ? strtoull(argv[1], NULL, 0) : (1ull << 30);
	unsigned nt = argc > 2 ? (unsigned)strtoul(argv[2], NULL, 0) : 16;
	const char *mode = argc > 3 ? argv[3] : "fp32";
	bool snapshot = true;
	if (argc > 4) {
		CHECK(argc == 5 && strcmp(argv[4], "nosnapshot") == 0,
		      "usage: bench-restart [PARAMS [TENSORS [PRECISION [nosnapshot]]]]");
		snapshot = false;
	}
	CHECK(params >= nt && nt >= 2, "PARAMS >= TENSORS >= 2");
	/* PRECISION: fp32 (fp32 parameters and state, 12 B a parameter), q8
	 * (bf16 parameters, the split master and q8 moments: the default for
	 * bf16 parameters, 6 B) or bf16-q8 (bf16 parameters, the bf16 master
	 * that is the parameter and q8 moments, 4 B); the masters that are the
	 * parameters live in memfds of their own, which the store keeps too. */
	struct job j = { .nt = nt, .per = params / nt, .dt = AOQ_FP32, .prec = AOQ_STATE_FP32 };
	double bpp = 12;
	if (strcmp(mode, "q8") == 0) {
		j.dt = AOQ_BF16;
		j.prec = AOQ_STATE_Q8;
		bpp = 6;
	} else if (strcmp(mode, "bf16-q8") == 0) {
		j.dt = AOQ_BF16;
		j.prec = AOQ_STATE_BF16_Q8;
		bpp = 4;
	} else {
		CHECK(strcmp(mode, "fp32") == 0, "PRECISION '%s': fp32, q8 or bf16-q8", mode);
	}
	signal(SIGPIPE, SIG_IGN);
	struct sup s = { .pid = -1 };
	const char *sock = s.sock;
	unit_log = getenv("AOQ_UNIT_LOG");
	if (unit_log && *unit_log) {
		sock = getenv("AOQ_SOCKET");
		CHECK(sock && *sock, "$AOQ_UNIT_LOG without $AOQ_SOCKET (run under tests/ops/unit-ns.sh)");
		tail.path = unit_log;
		printf("bench-restart: aoqd.service under systemd, socket %s\n", sock);
	} else {
		unit_log = NULL;
		sup_init(&s, false, "lease_seconds = 600\nlog_level = info\nthreads = 0\n");
		/* the machine's best kernel, as the unit runs it (the tests'
		 * supervisor runs the scalar one); $AOQ_KERNEL picks another */
		const char *k = getenv("AOQ_KERNEL");
		s.kernel = k && *k ? k : "auto";
		sup_start(&s, aoqd_exe(), NULL, NULL, 0);
		tail.path = s.log;
	}
	pthread_t tailer;
	CHECK(pthread_create(&tailer, NULL, tail_run, NULL) == 0, "pthread_create");

	param_bytes = j.per * nt * (j.dt == AOQ_FP32 ? 4 : 2);
	j.p = aoqt_xcalloc(nt, sizeof(*j.p));
	j.g = aoqt_xcalloc(nt, sizeof(*j.g));
	for (unsigned i = 0; i < nt; i++) {
		size_t es = j.dt == AOQ_FP32 ? 4 : 2;
		j.p[i] = trainer_alloc(j.per * es);
		j.g[i] = trainer_alloc(j.per * es);
		for (uint64_t k = 0; k < j.per; k++) {
			aoqt_store(j.p[i], k, j.dt, 1.0 + (double)(k & 127) * 1e-3);
			aoqt_store(j.g[i], k, j.dt, 1e-2 * (double)((k * 7) & 255) / 255.0);
		}
	}
	printf("bench-restart: %" PRIu64 " %s parameters in %u tensors, AdamW, %s (%.1f GB of state)\n", j.per * nt,
	       j.dt == AOQ_FP32 ? "fp32" : "bf16", nt, mode, (double)(j.per * nt) * bpp * 1e-9);
	CHECK(job_open(&j, sock) == 0, "a fresh job resumed");
	double step_s = 1e9;
	for (int k = 0; k < 4; k++) {
		double t = now();
		CHECK_OK(job_step(&j, nt));
		if (k > 0 && now() - t < step_s) {
			step_s = now() - t;
			undisturbed_push_s = pushed_s;
		}
	}
	printf("undisturbed step: %.3f s\n", step_s);

	/* The fd store: SIGTERM mid-step. */
	struct pause fds = restart(&s, &j, sock, SIGTERM, false, step_s);
	report("fd store (SIGTERM)", &fds, step_s);
	/* The fd store: SIGKILL mid-step, the journal replayed. */
	struct pause kill = restart(&s, &j, sock, SIGKILL, false, step_s);
	report("fd store (SIGKILL)", &kill, step_s);

	/* A snapshot of the same state at its last completed step, then
	 * SIGKILL mid-step and the store emptied: the next aoqd reads the
	 * snapshot. */
	if (snapshot) {
		char path[4096];
		uint64_t snap_step = 0;
		double ts = now();
		int sfd = aoqt_snapshot_ask(sock, session_id(sock));
		CHECK(sfd >= 0, "SnapshotRequest: %d", sfd);
		struct timeval forever = { 0, 0 }; /* the write may take minutes */
		setsockopt(sfd, SOL_SOCKET, SO_RCVTIMEO, &forever, sizeof(forever));
		int r = aoqt_snapshot_wait(sfd, path, sizeof(path), &snap_step);
		CHECK(r == 0, "snapshot: %d %s", r, path);
		printf("snapshot at step %" PRIu64 " written in %.3f s: %s\n", snap_step, now() - ts, path);
		struct pause snap = restart(&s, &j, sock, SIGKILL, true, step_s);
		report("snapshot (SIGKILL)", &snap, step_s);
	}
	/* The fd store again, after the snapshot's run: the order's effect
	 * (fresh memory, a host's background work) shows as the spread. */
	struct pause fds2 = restart(&s, &j, sock, SIGTERM, false, step_s);
	report("fd store again", &fds2, step_s);

	const char *log = unit_log ? "" : sup_log(&s);
	for (const char *l = log; (l = strstr(l, "aoqd info fdstore:")); l++) {
		const char *e = strchr(l, '\n');
		printf("  %.*s\n", e ? (int)(e - l) : (int)strlen(l), l);
	}
	for (const char *l = log; (l = strstr(l, "from its snapshot")); l++) {
		const char *b = l;
		while (b > log && b[-1] != '\n')
			b--;
		const char *e = strchr(l, '\n');
		printf("  %.*s\n", e ? (int)(e - b) : (int)strlen(b), b);
	}
	aoq_close(j.c);
	tail.stop = true;
	pthread_join(tailer, NULL);
	if (unit_log)
		return 0;
	sup_kill(&s, SIGTERM);
	char cmd[160];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s.dir);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", s.dir);
	return 0;
}
