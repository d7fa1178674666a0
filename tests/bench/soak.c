/* SPDX-License-Identifier: MIT */
/*
 * soak: a long run of one aoqd under several trainers, one of them killed
 * and resumed again and again (a benchmark, not a test: tests/bench/RESULTS.md).
 *
 *   - --clients N trainers (default 4): N - 1 threads of this process
 *     ("steady"), and one child process (the "victim", this binary run
 *     again with --victim) killed with SIGKILL every --kill-every steps
 *     (default 1000) at a random moment of its step and started again; it
 *     resumes its leased state each time;
 *   - every trainer runs --steps steps (default 10000) of the same tensors
 *     (sizes below), gradients a function of (seed, tensor, step) only;
 *   - snapshots: in every other period of --kill-every steps (the odd ones)
 *     each steady trainer asks for a snapshot of its own session every
 *     --snapshot-every steps (default 100), as aoqctl snapshot does,
 *     without waiting for it; the even periods take none;
 *   - aoqd's RSS when the first steady trainer is at step 100 and at the
 *     end (every trainer done, all sessions still open and idle, no
 *     snapshot in progress), and their ratio (target: within 1%); each
 *     steady trainer takes one warm-up snapshot at step 50, so that the
 *     first snapshot's one-time costs (code pages of json-c and zlib, the
 *     writer thread's stack and heap: about 170 KiB measured) are in both
 *     figures, and the victim is killed once at step 50 for the same
 *     reason (the lease and resume paths); also RSS at the end of every
 *     period, and its parts;
 *   - the steady trainers' step time (pushes, StepEnd, sync; steps after
 *     100) in periods with snapshots and without, and the difference: the
 *     snapshot stall per step;
 *   - the victim's final state (parameters, master, moments, step
 *     counters) against a reference session that trained the same steps
 *     undisturbed: "bit-exact: ok" or "FAIL" (exit status 1).
 *
 * Tensors per trainer (--elems E, default 65536): E bf16 (bf16 gradient),
 * E/4 + 7 fp32, 4097 fp32 (fp16 gradient), 1000 bf16; with the default E
 * 86,640 parameters, 1.0 MiB of fp32 state.  Small, so that 4 x 10,000
 * steps take minutes on 2 cores: the run soaks the control path, leases,
 * resumes and snapshots, not the kernels.
 *
 *   soak [--clients N] [--steps N] [--kill-every N] [--snapshot-every N]
 *        [--elems E] [--threads N] [--precision fp32|q8|bf16] [--dir DIR] [--aoqd PATH]
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#ifndef AOQD_PATH
#define AOQD_PATH "aoqd"
#endif

#define NT 4

static uint64_t numel[NT];
static const enum aoq_dtype pdt[NT] = { AOQ_BF16, AOQ_FP32, AOQ_FP32, AOQ_BF16 };
static const enum aoq_dtype gdt[NT] = { AOQ_BF16, AOQ_FP32, AOQ_FP16, AOQ_BF16 };
static enum aoq_precision prec = AOQ_STATE_FP32;
static char sock[108];

static void set_sizes(uint64_t e)
{
	numel[0] = e;
	numel[1] = e / 4 + 7;
	numel[2] = 4097;
	numel[3] = 1000;
}

static void grad_of(uint64_t k, int t, void *g)
{
	struct aoqt_rng r = aoqt_rng_for(0x50a6, (uint64_t)t, k);
	for (uint64_t i = 0; i < numel[t]; i++)
		aoqt_store(g, i, gdt[t], aoqt_uniform(&r) * 0.05);
}

struct trainer {
	struct aoq_client *c;
	void *param[NT], *grad[NT];
	uint64_t step;
	bool resumed;
	uint64_t resumed_at;
};

static void trainer_open(struct trainer *tr, const char *job, uint32_t lease)
{
	memset(tr, 0, sizeof(*tr));
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	o.job = job;
	o.precision = prec;
	o.seed = 1234;
	o.lease_seconds = lease;
	CHECK_OK(aoq_connect(&tr->c, &o));
	struct aoq_group g = AOQ_GROUP_INIT;
	g.kind = AOQ_ADAMW;
	g.lr = 1e-3;
	g.beta1 = 0.9;
	g.beta2 = 0.999;
	g.eps = 1e-8;
	g.weight_decay = 0.01;
	CHECK_OK(aoq_add_group(tr->c, &g));
	for (int t = 0; t < NT; t++) {
		tr->param[t] = aoqt_xmalloc(numel[t] * aoqt_dtype_size(pdt[t]));
		tr->grad[t] = aoqt_xmalloc(numel[t] * aoqt_dtype_size(gdt[t]));
		struct aoqt_rng r = aoqt_rng_for(0x50a7, (uint64_t)t, 0);
		for (uint64_t i = 0; i < numel[t]; i++)
			aoqt_store(tr->param[t], i, pdt[t], aoqt_uniform(&r));
		char name[16];
		snprintf(name, sizeof(name), "w%d", t);
		struct aoq_tensor d = AOQ_TENSOR_INIT;
		d.name = name;
		d.numel = numel[t];
		d.param_dtype = pdt[t];
		d.grad_dtype = gdt[t];
		d.param = tr->param[t];
		d.grad = tr->grad[t];
		CHECK_OK(aoq_add_tensor(tr->c, &d));
	}
	CHECK_OK(aoq_register(tr->c));
	tr->resumed = aoq_resumed(tr->c, &tr->resumed_at) == 1;
	tr->step = tr->resumed ? tr->resumed_at : 0;
}

static void trainer_step(struct trainer *tr)
{
	uint64_t k = tr->step + 1;
	for (int t = NT - 1; t >= 0; t--) {
		grad_of(k, t, tr->grad[t]);
		CHECK_OK(aoq_push_grad(tr->c, (uint32_t)t, 0, NULL));
		CHECK_OK(aoq_grad_copied(tr->c, (uint32_t)t));
	}
	CHECK_OK(aoq_step_end(tr->c));
	CHECK_OK(aoq_sync(tr->c, NULL));
	tr->step = k;
}

/* Parameters, master, moments (as fp32) and step counters, bit for bit. */
static size_t trainer_image(struct trainer *tr, uint8_t **out)
{
	size_t len = 0;
	for (int t = 0; t < NT; t++)
		len += numel[t] * (aoqt_dtype_size(pdt[t]) + 12) + 8;
	uint8_t *p = aoqt_xcalloc(1, len);
	*out = p;
	CHECK_OK(aoq_sync(tr->c, NULL));
	for (int t = 0; t < NT; t++) {
		size_t pb = numel[t] * aoqt_dtype_size(pdt[t]);
		memcpy(p, tr->param[t], pb);
		p += pb;
		for (int w = AOQ_MASTER; w <= AOQ_EXP_AVG_SQ; w++) {
			CHECK_OK(aoq_read_state(tr->c, (uint32_t)t, (enum aoq_state_kind)w, AOQ_FP32, 0, numel[t], p));
			p += numel[t] * 4;
		}
		CHECK_OK(aoq_get_tensor_steps(tr->c, (uint32_t)t, 1, (uint64_t *)(void *)p));
		p += 8;
	}
	return len;
}

static void trainer_close(struct trainer *tr)
{
	aoq_close(tr->c);
	for (int t = 0; t < NT; t++) {
		free(tr->param[t]);
		free(tr->grad[t]);
	}
}

/* ---- the victim (a child process) ---- */

struct shared {
	_Atomic uint64_t synced;  /* its last synced step */
	_Atomic uint64_t resumed; /* 1 + the step it resumed at; 0 fresh */
	_Atomic int done;         /* image written */
	_Atomic int release;      /* the parent measured: close and exit */
};

static int victim_main(char **argv)
{
	/* argv: SOCKET SHM TARGET IMAGE ELEMS PREC */
	snprintf(sock, sizeof(sock), "%s", argv[0]);
	int fd = open(argv[1], O_RDWR);
	struct shared *sh = fd >= 0 ? mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
	CHECK(sh != MAP_FAILED, "victim: shared page");
	uint64_t target = strtoull(argv[2], NULL, 10);
	set_sizes(strtoull(argv[4], NULL, 10));
	prec = (enum aoq_precision)atoi(argv[5]);
	struct trainer tr;
	trainer_open(&tr, "soak-victim", 0);
	atomic_store(&sh->resumed, tr.resumed ? tr.resumed_at + 1 : 0);
	atomic_store(&sh->synced, tr.step);
	while (tr.step < target) {
		trainer_step(&tr);
		atomic_store(&sh->synced, tr.step);
	}
	uint8_t *im;
	size_t len = trainer_image(&tr, &im);
	FILE *f = fopen(argv[3], "wb");
	CHECK(f && fwrite(im, 1, len, f) == len && fclose(f) == 0, "victim: image");
	free(im);
	atomic_store(&sh->done, 1);
	while (!atomic_load(&sh->release))
		usleep(10000);
	trainer_close(&tr);
	return 0;
}

/* ---- steady trainers ---- */

struct steady {
	pthread_t th;
	int i;
	uint64_t steps, kill_every, snap_every;
	double sum[2];   /* step seconds: [0] periods without snapshots, [1] with */
	uint64_t n[2];
	unsigned snaps_done, snaps_failed, snaps_skipped;
	_Atomic uint64_t step;
	_Atomic int finished;
	_Atomic int release;
};

static pid_t daemon_pid;
static _Atomic uint64_t rss100;

/* RssAnon, RssFile, RssShmem of /proc/PID/status, in KiB */
struct rss_parts {
	unsigned long anon, file, shmem;
};
static struct rss_parts rss_parts_of(pid_t pid)
{
	struct rss_parts r = { 0, 0, 0 };
	char path[64], line[256];
	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	FILE *f = fopen(path, "re");
	while (f && fgets(line, sizeof(line), f)) {
		sscanf(line, "RssAnon: %lu", &r.anon);
		sscanf(line, "RssFile: %lu", &r.file);
		sscanf(line, "RssShmem: %lu", &r.shmem);
	}
	if (f)
		fclose(f);
	return r;
}
static struct rss_parts parts100;
/* RSS when the first steady trainer ends each period (kill_every steps) */
#define MAX_PERIODS 64
static uint64_t rss_period[MAX_PERIODS];

static uint64_t session_id(const char *job)
{
	Aoq__Envelope *e = NULL;
	CHECK_OK(aoqt_stats(sock, &e));
	uint64_t id = 0;
	for (size_t i = 0; i < e->stats->n_sessions; i++)
		if (strcmp(e->stats->sessions[i]->job, job) == 0 && strcmp(e->stats->sessions[i]->state, "training") == 0)
			id = e->stats->sessions[i]->id;
	aoq_envelope_free(e);
	CHECK(id, "no session of %s", job);
	return id;
}

/* Reads a SnapshotDone or Error when one is there (wait: block for it). */
static bool snap_reply(struct steady *s, int fd, bool wait)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	if (poll(&p, 1, wait ? 60000 : 0) != 1)
		return false;
	Aoq__Envelope *rep = NULL;
	CHECK(aoq_recv_frame(fd, &rep, NULL, 0, NULL) >= 0, "snapshot connection closed");
	if (rep->msg_case == AOQ__ENVELOPE__MSG_SNAPSHOT_DONE)
		s->snaps_done++;
	else
		s->snaps_failed++;
	aoq_envelope_free(rep);
	return true;
}

static void *steady_run(void *arg)
{
	struct steady *s = arg;
	char job[32];
	snprintf(job, sizeof(job), "soak-%d", s->i);
	struct trainer tr;
	trainer_open(&tr, job, AOQ_LEASE_NONE);
	uint64_t id = session_id(job);
	int fd = aoqt_raw_connect(sock);
	CHECK(fd >= 0, "connect");
	CHECK_OK(aoqt_raw_hello(fd, "aoqctl", 0, true, NULL));
	bool pending = false;
	while (tr.step < s->steps) {
		if (tr.step == 50) {
			/* warm-up: the first snapshot's one-time costs (the writer's
			 * code and heap pages) come before the step-100 RSS */
			Aoq__SnapshotRequest q = AOQ__SNAPSHOT_REQUEST__INIT;
			q.session = id;
			CHECK_OK(aoqt_send_msg(fd, AOQ__ENVELOPE__MSG_SNAPSHOT_REQUEST, &q));
			CHECK(snap_reply(s, fd, true), "the warm-up snapshot did not finish");
			s->snaps_done--;
		}
		int with = (int)((tr.step / s->kill_every) & 1);
		if (with && tr.step % s->snap_every == 0) {
			if (pending && snap_reply(s, fd, false))
				pending = false;
			if (pending) {
				s->snaps_skipped++;
			} else {
				Aoq__SnapshotRequest q = AOQ__SNAPSHOT_REQUEST__INIT;
				q.session = id;
				CHECK_OK(aoqt_send_msg(fd, AOQ__ENVELOPE__MSG_SNAPSHOT_REQUEST, &q));
				pending = true;
			}
		}
		double t0 = aoqt_now();
		trainer_step(&tr);
		double dt = aoqt_now() - t0;
		/* the first 100 steps warm up */
		if (tr.step > 100) {
			s->sum[with] += dt;
			s->n[with]++;
		}
		if (pending && snap_reply(s, fd, false))
			pending = false;
		atomic_store(&s->step, tr.step);
		if (s->i == 0 && tr.step == 100) {
			atomic_store(&rss100, aoqt_rss_bytes(daemon_pid));
			parts100 = rss_parts_of(daemon_pid);
		}
		if (s->i == 0 && tr.step % s->kill_every == 0 && tr.step / s->kill_every < MAX_PERIODS)
			rss_period[tr.step / s->kill_every] = aoqt_rss_bytes(daemon_pid);
	}
	if (pending)
		CHECK(snap_reply(s, fd, true), "the last snapshot did not finish");
	close(fd);
	atomic_store(&s->finished, 1);
	while (!atomic_load(&s->release))
		usleep(10000);
	trainer_close(&tr);
	return NULL;
}

static pid_t spawn_victim(const char *self, const char *shm, uint64_t target, const char *image, uint64_t elems)
{
	char a[3][32];
	snprintf(a[0], sizeof(a[0]), "%" PRIu64, target);
	snprintf(a[1], sizeof(a[1]), "%" PRIu64, elems);
	snprintf(a[2], sizeof(a[2]), "%d", (int)prec);
	pid_t pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		execl(self, self, "--victim", sock, shm, a[0], image, a[1], a[2], (char *)NULL);
		_exit(127);
	}
	return pid;
}

int main(int argc, char **argv)
{
	if (argc > 2 && strcmp(argv[1], "--victim") == 0) {
		aoqt_init("soak-victim");
		return victim_main(argv + 2);
	}
	unsigned clients = 4, threads = 1;
	uint64_t steps = 10000, kill_every = 1000, snap_every = 100, elems = 65536;
	const char *aoqd = AOQD_PATH, *dir = NULL, *prec_name = "fp32";
	static const struct option opts[] = {
		{ "clients", required_argument, NULL, 'c' }, { "steps", required_argument, NULL, 'n' },
		{ "kill-every", required_argument, NULL, 'k' }, { "snapshot-every", required_argument, NULL, 's' },
		{ "elems", required_argument, NULL, 'e' }, { "threads", required_argument, NULL, 'j' },
		{ "precision", required_argument, NULL, 'p' }, { "dir", required_argument, NULL, 'd' },
		{ "aoqd", required_argument, NULL, 'a' }, { NULL, 0, NULL, 0 },
	};
	int o;
	while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (o) {
		case 'c': clients = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'n': steps = strtoull(optarg, NULL, 0); break;
		case 'k': kill_every = strtoull(optarg, NULL, 0); break;
		case 's': snap_every = strtoull(optarg, NULL, 0); break;
		case 'e': elems = strtoull(optarg, NULL, 0); break;
		case 'j': threads = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'p': prec_name = optarg; break;
		case 'd': dir = optarg; break;
		case 'a': aoqd = optarg; break;
		default: fprintf(stderr, "usage: see the comment at the top of soak.c\n"); return 2;
		}
	}
	if (clients < 2 || clients > 64 || steps < 200 || kill_every < 10 || snap_every < 1 || elems < 1) {
		fprintf(stderr, "soak: --clients 2..64, --steps >= 200, --kill-every >= 10, --snapshot-every >= 1\n");
		return 2;
	}
	prec = strcmp(prec_name, "q8") == 0 ? AOQ_STATE_Q8 : strcmp(prec_name, "bf16") == 0 ? AOQ_STATE_BF16
	                                                                                     : AOQ_STATE_FP32;
	set_sizes(elems);
	aoqt_init("soak");
	char seed[32];
	snprintf(seed, sizeof(seed), "%" PRIu64, aoqt_seed);
	setenv("AOQ_TEST_SEED", seed, 1); /* the victim computes the same gradients */
	char self[4096];
	ssize_t sl = readlink("/proc/self/exe", self, sizeof(self) - 1);
	CHECK(sl > 0, "readlink");
	self[sl] = 0;
	char tmpl[] = "/var/tmp/aoq-soak-XXXXXX";
	if (!dir) {
		CHECK(mkdtemp(tmpl), "mkdtemp");
		dir = tmpl;
	}
	char th[16];
	snprintf(th, sizeof(th), "%u", threads);
	const char *args[] = { "--state-dir", dir, "--threads", th, NULL };
	struct aoqt_daemon d;
	CHECK_OK(aoqt_daemon_start(&d, aoqd, args));
	daemon_pid = d.pid;
	snprintf(sock, sizeof(sock), "%s", d.socket);
	uint64_t params = 0;
	for (int t = 0; t < NT; t++)
		params += numel[t];
	printf("soak: aoqd %s, %u workers; %u trainers (%u steady threads, 1 victim process killed every %" PRIu64
	       " steps), %" PRIu64 " steps each; %" PRIu64 " parameters per trainer (%" PRIu64 ", %" PRIu64
	       ", %" PRIu64 ", %" PRIu64 "), %s state; snapshots every %" PRIu64 " steps in odd periods of %" PRIu64
	       " steps; state dir %s\n", aoqd, threads, clients, clients - 1, kill_every, steps, params, numel[0],
	       numel[1], numel[2], numel[3], prec_name, snap_every, kill_every, dir);
	fflush(stdout);
	double t_start = aoqt_now();

	char shm[256], image[256];
	snprintf(shm, sizeof(shm), "%s/shared", d.dir);
	snprintf(image, sizeof(image), "%s/victim.image", d.dir);
	int fd = open(shm, O_RDWR | O_CREAT | O_TRUNC, 0600);
	CHECK(fd >= 0 && ftruncate(fd, 4096) == 0, "shared file");
	struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	CHECK(sh != MAP_FAILED, "mmap");
	close(fd);

	struct steady *st = aoqt_xcalloc(clients - 1, sizeof(*st));
	for (unsigned i = 0; i < clients - 1; i++) {
		st[i].i = (int)i;
		st[i].steps = steps;
		st[i].kill_every = kill_every;
		st[i].snap_every = snap_every;
		CHECK(pthread_create(&st[i].th, NULL, steady_run, &st[i]) == 0, "pthread_create");
	}
	/* The victim: killed at a random moment once past each multiple of
	 * kill_every, until it has run to the end. */
	struct aoqt_rng rng = aoqt_rng_for(0x50a8, 0, 0);
	unsigned kills = 0, resumes = 0, at_synced = 0;
	/* A warm-up kill at step 50, like the warm-up snapshot: the lease and
	 * resume paths' one-time costs (code pages first run) are in the
	 * step-100 RSS too. */
	uint64_t next_kill = 50, synced = 0;
	pid_t pid = spawn_victim(self, shm, steps, image, elems);
	for (;;) {
		if (atomic_load(&sh->done))
			break;
		uint64_t now = atomic_load(&sh->synced);
		if (next_kill < steps && now >= next_kill) {
			usleep((useconds_t)(aoqt_next(&rng) % 3000));
			kill(pid, SIGKILL);
			int ws;
			CHECK(waitpid(pid, &ws, 0) == pid, "waitpid");
			if (WIFEXITED(ws) && atomic_load(&sh->done))
				break; /* it finished first */
			CHECK(WIFSIGNALED(ws), "the victim failed (status %d)", ws);
			synced = atomic_load(&sh->synced);
			kills++;
			next_kill = next_kill < kill_every ? kill_every : next_kill + kill_every;
			memset(sh, 0, sizeof(*sh));
			pid = spawn_victim(self, shm, steps, image, elems);
			double t0 = aoqt_now();
			while (!atomic_load(&sh->resumed)) {
				CHECK(aoqt_now() - t0 < 60, "the victim did not resume after kill %u", kills);
				usleep(1000);
			}
			uint64_t at = atomic_load(&sh->resumed) - 1;
			CHECK(at == synced || at == synced + 1, "kill %u: resumed at %" PRIu64 ", synced %" PRIu64, kills, at,
			      synced);
			resumes++;
			at_synced += at == synced;
			continue;
		}
		CHECK(waitpid(pid, NULL, WNOHANG) == 0, "the victim died by itself");
		usleep(1000);
	}
	for (unsigned i = 0; i < clients - 1; i++)
		while (!atomic_load(&st[i].finished))
			usleep(10000);
	double t_run = aoqt_now() - t_start;
	/* Every session open and idle, no snapshot in progress. */
	uint64_t rss_end = aoqt_rss_bytes(d.pid), r100 = atomic_load(&rss100);
	struct rss_parts parts_end = rss_parts_of(d.pid);
	atomic_store(&sh->release, 1);
	for (unsigned i = 0; i < clients - 1; i++) {
		atomic_store(&st[i].release, 1);
		pthread_join(st[i].th, NULL);
	}
	int ws;
	CHECK(waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "the last victim failed");

	/* The reference: the victim's steps, undisturbed. */
	struct trainer ref;
	trainer_open(&ref, "soak-reference", AOQ_LEASE_NONE);
	while (ref.step < steps)
		trainer_step(&ref);
	uint8_t *want, *got;
	size_t len = trainer_image(&ref, &want);
	trainer_close(&ref);
	got = aoqt_xmalloc(len);
	FILE *f = fopen(image, "rb");
	CHECK(f, "victim image");
	size_t glen = fread(got, 1, len, f);
	fclose(f);
	size_t diff = 0;
	for (size_t i = 0; i < len; i++)
		diff += i >= glen || got[i] != want[i];
	bool exact = glen == len && diff == 0;

	double sum[2] = { 0, 0 };
	uint64_t n[2] = { 0, 0 };
	unsigned done = 0, failed = 0, skipped = 0;
	for (unsigned i = 0; i < clients - 1; i++) {
		for (int w = 0; w < 2; w++) {
			sum[w] += st[i].sum[w];
			n[w] += st[i].n[w];
		}
		done += st[i].snaps_done;
		failed += st[i].snaps_failed;
		skipped += st[i].snaps_skipped;
	}
	double ratio = r100 ? (double)rss_end / (double)r100 : 0;
	printf("soak: %.1f s for the run (%" PRIu64 " steps x %u trainers)\n", t_run, steps, clients);
	printf("aoqd RSS: at step 100 %.2f MiB, at the end %.2f MiB, ratio %.4f (%s: within 1%%)\n", r100 / 1048576.0,
	       rss_end / 1048576.0, ratio, ratio > 0 && ratio <= 1.01 && ratio >= 0.99 ? "ok" : "FAIL");
	printf("aoqd RSS parts (KiB) at step 100 / at the end: anon %lu / %lu, file %lu / %lu, shmem %lu / %lu\n",
	       parts100.anon, parts_end.anon, parts100.file, parts_end.file, parts100.shmem, parts_end.shmem);
	printf("aoqd RSS (MiB) at the end of each period of %" PRIu64 " steps:", kill_every);
	for (uint64_t k = 1; k <= steps / kill_every && k < MAX_PERIODS; k++)
		printf(" %.2f", rss_period[k] / 1048576.0);
	printf("\n");
	double m0 = n[0] ? sum[0] / (double)n[0] : 0, m1 = n[1] ? sum[1] / (double)n[1] : 0;
	printf("step time (steady trainers): without snapshots %.3f ms (%" PRIu64 " steps), with a snapshot every %" PRIu64
	       " steps %.3f ms (%" PRIu64 " steps): stall %+.3f ms per step (%+.1f%%), %+.2f ms per snapshot\n",
	       m0 * 1e3, n[0], snap_every, m1 * 1e3, n[1], (m1 - m0) * 1e3, m0 > 0 ? (m1 - m0) / m0 * 100 : 0,
	       (m1 - m0) * 1e3 * (double)snap_every);
	printf("snapshots: %u written, %u failed, %u skipped (the previous one still in progress)\n", done, failed,
	       skipped);
	printf("victim: %u kills, %u resumes (%u at the synced step, the rest one further), final step %" PRIu64
	       "; bit-exact against the undisturbed reference: %s", kills, resumes, at_synced, steps,
	       exact ? "ok\n" : "FAIL");
	if (!exact)
		printf(" (%zu of %zu bytes differ)\n", diff, len);
	free(want);
	free(got);
	CHECK(aoqt_daemon_alive(&d), "aoqd died");
	aoqt_daemon_stop(&d, 60000, false);
	/* the snapshots, the shared page, the image, the daemon's dir */
	char cmd[600];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s' '%s'", d.dir, dir == tmpl ? tmpl : "/nonexistent-aoq-soak");
	if (system(cmd) != 0)
		fprintf(stderr, "soak: could not remove %s\n", d.dir);
	free(st);
	return exact && failed == 0 ? 0 : 1;
}
