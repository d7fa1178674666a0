/* SPDX-License-Identifier: MIT */
/*
 * Faults: a trainer's state outlives it (README, "Lease and resume").
 *
 *   kill     a trainer (this binary re-executed, --trainer) is killed with
 *            SIGKILL mid-step KILLS times (100; 20 under AOQ_TEST_SLOW;
 *            AOQT_KILLS sets it), and more till half as many resumed,
 *            while two other sessions train;
 *            each new trainer resumes the leased state at the last completed
 *            step (the interrupted one rolled back); at the end its state
 *            (parameters, master, both moments, step counters) equals an
 *            undisturbed run of as many steps bit for bit, and so do the
 *            other two sessions.  Each state a trainer resumed is compared
 *            with an undisturbed run's at that step: a difference names
 *            the kill that left it.
 *   unloaded a trainer that dies between Registered and its first
 *            LoadState leaves no lease (its state holds no parameters).
 *   bye      a trainer that closes its doorbells before its Bye leaves no
 *            lease.
 *   layout   resuming with another layout: Error naming the first difference.
 *   expiry   a lease of 1 s ends: the session leaves the stats and the uid's
 *            locked bytes go back.
 *   drop     DropRequest ends a leased session (its trainer then starts afresh).
 *   uid      another uid (setpriv, as nobody) neither resumes, drops nor sees
 *            it; needs root, else that part is skipped.
 *   refused  a resume refused for the uid's quota leaves the lease as it was.
 *
 * Run one case by hand: test-faults build/daemon/aoqd --case NAME.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "aoq/aoq.h"
#include "harness.h"
#include "wire.h"

#define TT 3
static const struct {
	uint64_t n;
	enum aoq_dtype pd, gd;
	uint32_t group;
} tdesc[TT] = {
	{ 4097, AOQ_FP32, AOQ_FP32, 0 },
	{ 20011, AOQ_BF16, AOQ_BF16, 1 },
	{ 1000, AOQ_FP32, AOQ_FP16, 0 },
};

/* The killed trainer's state: a bf16 master with q8 moments, so that
 * tensor 1 (bf16 parameters) has its master as the parameter, shared with
 * the trainer (aoq-arena.h) and rolled back and resumed in place. */
#define VICTIM_PREC AOQ_STATE_BF16_Q8

static char self_exe[4096];
static struct aoqt_daemon daemon_;

/* What a trainer shares with the test (MAP_SHARED before the exec: a file). */
struct shared {
	_Atomic uint64_t synced;   /* last step it saw complete (aoq_sync) */
	_Atomic uint64_t resumed;  /* 1 + the step it resumed at, 0 when fresh */
	_Atomic int paused;        /* reached its kill point */
	_Atomic int registered;
	_Atomic int imaged;        /* wrote the state it resumed (case kill) */
	_Atomic int done;
};

static struct aoq_group hp_of(uint32_t g, uint64_t k)
{
	struct aoq_group h = AOQ_GROUP_INIT;
	h.kind = g == 0 ? AOQ_ADAMW : AOQ_ADAM;
	h.lr = (g == 0 ? 2e-3 : 1e-3) * (1.0 + 0.5 * sin(0.3 * (double)k));
	h.beta1 = 0.9;
	h.beta2 = g == 0 ? 0.999 : 0.98;
	h.eps = g == 0 ? 1e-8 : 1e-6;
	h.weight_decay = g == 0 ? 0.02 : 0.01;
	return h;
}

/* The gradient of step k: a function of (k, t, i) only, so that a resumed
 * trainer pushes what an undisturbed one would. */
static void grad_of(uint64_t k, int t, void *g)
{
	struct aoqt_rng r = aoqt_rng_for(0x6a11, (uint64_t)t, k);
	for (uint64_t i = 0; i < tdesc[t].n; i++)
		aoqt_store(g, i, tdesc[t].gd, (aoqt_uniform(&r) - 0.5) * 0.1);
}

struct trainer {
	const char *job;
	enum aoq_precision prec;
	struct aoq_client *c;
	void *param[TT], *grad[TT];
	uint64_t step; /* last step completed */
	uint64_t resumed_at;
	bool resumed;
	bool fixed_hp; /* the registration's hyperparameters throughout */
};

static int trainer_open_window(struct trainer *tr, const char *job, enum aoq_precision prec, uint32_t lease_s,
                               uint64_t window)
{
	memset(tr, 0, sizeof(*tr));
	tr->job = job;
	tr->prec = prec;
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = daemon_.socket;
	o.job = job;
	o.precision = prec;
	o.seed = 77;
	o.lease_seconds = lease_s;
	o.timeout_ms = 60000;
	o.window = window;
	int r = aoq_connect(&tr->c, &o);
	if (r < 0)
		return r;
	for (uint32_t g = 0; g < 2; g++) {
		struct aoq_group h = hp_of(g, 1);
		if ((r = aoq_add_group(tr->c, &h)) < 0)
			return r;
	}
	for (int t = 0; t < TT; t++) {
		tr->param[t] = aoqt_xmalloc(tdesc[t].n * aoqt_dtype_size(tdesc[t].pd));
		tr->grad[t] = aoqt_xmalloc(tdesc[t].n * aoqt_dtype_size(tdesc[t].gd));
		struct aoqt_rng rng = aoqt_rng_for(0x1417, (uint64_t)t, 0);
		for (uint64_t i = 0; i < tdesc[t].n; i++)
			aoqt_store(tr->param[t], i, tdesc[t].pd, aoqt_uniform(&rng) - 0.5);
		if (t == 0 && getenv("AOQT_UNREADABLE")) {
			/* case unloaded: libaoq faults reading the initial
			 * parameters, after Registered, before any LoadState
			 * (the process dies: nothing is freed) */
			tr->param[t] = mmap(NULL, tdesc[t].n * 4, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			CHECK(tr->param[t] != MAP_FAILED, "mmap: %s", strerror(errno));
		}
		char name[16];
		snprintf(name, sizeof(name), "w%d", t);
		struct aoq_tensor d = AOQ_TENSOR_INIT;
		d.name = name;
		d.numel = tdesc[t].n;
		d.param_dtype = tdesc[t].pd;
		d.grad_dtype = tdesc[t].gd;
		d.group = tdesc[t].group;
		d.param = tr->param[t];
		d.grad = tr->grad[t];
		if ((r = aoq_add_tensor(tr->c, &d)) < 0)
			return r;
	}
	if ((r = aoq_register(tr->c)) < 0)
		return r;
	tr->resumed = aoq_resumed(tr->c, &tr->resumed_at) == 1;
	tr->step = tr->resumed_at;
	return 0;
}

static int trainer_open(struct trainer *tr, const char *job, enum aoq_precision prec, uint32_t lease_s)
{
	return trainer_open_window(tr, job, prec, lease_s, 0);
}

/* One step; stop_after >= 0: stop (return 1) after that many pushes, or
 * after StepEnd when it is TT, without syncing: the kill point. */
static int trainer_step(struct trainer *tr, int stop_after)
{
	uint64_t k = tr->step + 1;
	int r;
	CHECK(aoq_current_step(tr->c) == k, "%s: current step %" PRIu64 ", expected %" PRIu64, tr->job,
	      aoq_current_step(tr->c), k);
	for (uint32_t g = 0; g < 2 && !tr->fixed_hp; g++) {
		struct aoq_group h = hp_of(g, k);
		if ((r = aoq_set_hyperparams(tr->c, g, &h)) < 0)
			return r;
	}
	for (int t = TT - 1; t >= 0; t--) {
		if (stop_after == TT - 1 - t)
			return 1;
		grad_of(k, t, tr->grad[t]);
		if ((r = aoq_push_grad(tr->c, (uint32_t)t, 0, NULL)) < 0)
			return r;
		if ((r = aoq_grad_copied(tr->c, (uint32_t)t)) < 0)
			return r;
	}
	if ((r = aoq_step_end(tr->c)) < 0)
		return r;
	if (stop_after == TT)
		return 1;
	if ((r = aoq_sync(tr->c, NULL)) < 0)
		return r;
	tr->step = k;
	return 0;
}

/* The whole state, bit for bit: params, master, moments, step counters. */
struct image {
	uint8_t *bytes;
	size_t len;
};

static void trainer_image(struct trainer *tr, struct image *im)
{
	size_t len = 0;
	for (int t = 0; t < TT; t++)
		len += tdesc[t].n * (aoqt_dtype_size(tdesc[t].pd) + 12) + 8;
	im->bytes = aoqt_xcalloc(1, len);
	im->len = len;
	uint8_t *p = im->bytes;
	CHECK_OK(aoq_sync(tr->c, NULL));
	for (int t = 0; t < TT; t++) {
		size_t pb = tdesc[t].n * aoqt_dtype_size(tdesc[t].pd);
		memcpy(p, tr->param[t], pb);
		p += pb;
		for (int w = AOQ_MASTER; w <= AOQ_EXP_AVG_SQ; w++) {
			CHECK_OK(aoq_read_state(tr->c, (uint32_t)t, (enum aoq_state_kind)w, AOQ_FP32, 0, tdesc[t].n, p));
			p += tdesc[t].n * 4;
		}
		uint64_t steps;
		CHECK_OK(aoq_get_tensor_steps(tr->c, (uint32_t)t, 1, &steps));
		memcpy(p, &steps, 8);
		p += 8;
	}
}

static void trainer_close(struct trainer *tr)
{
	aoq_close(tr->c);
	for (int t = 0; t < TT; t++) {
		free(tr->param[t]);
		free(tr->grad[t]);
	}
}

static void image_compare(const char *what, const struct image *a, const struct image *b)
{
	CHECK(a->len == b->len, "%s: image sizes", what);
	size_t diff = 0, first = 0;
	for (size_t i = 0; i < a->len; i++)
		if (a->bytes[i] != b->bytes[i] && !diff++)
			first = i;
	CHECK(diff == 0, "%s: %zu bytes differ from the undisturbed run (first at %zu)", what, diff, first);
}

/* An undisturbed run of `steps` steps (a fresh job, no lease). */
static void baseline(const char *job, enum aoq_precision prec, uint64_t steps, struct image *im)
{
	struct trainer tr;
	CHECK_OK(trainer_open(&tr, job, prec, AOQ_LEASE_NONE));
	while (tr.step < steps)
		CHECK_OK(trainer_step(&tr, -1));
	trainer_image(&tr, im);
	trainer_close(&tr);
}

/* ---- the trainer process (--trainer SOCKET SHM JOB TARGET STOP) ---- */

static int trainer_main(char **argv)
{
	snprintf(daemon_.socket, sizeof(daemon_.socket), "%s", argv[0]);
	int fd = open(argv[1], O_RDWR);
	struct shared *sh = fd >= 0 ? mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
	CHECK(sh != MAP_FAILED, "trainer: shared page: %s", strerror(errno));
	uint64_t target = strtoull(argv[3], NULL, 10);
	/* > 0: stop in that step; 0: run to target (killed at any moment);
	 * -1: run to target, then write the image */
	long stop_step = strtol(argv[4], NULL, 10);
	int stop_after = atoi(argv[5]);
	const char *lease = getenv("AOQT_LEASE");
	struct trainer tr;
	/* case kill's victims: VICTIM_PREC; the other cases': q8 */
	enum aoq_precision prec = getenv("AOQT_VICTIM") ? VICTIM_PREC : AOQ_STATE_Q8;
	CHECK_OK(trainer_open(&tr, argv[2], prec, lease ? (uint32_t)atoi(lease) : 0));
	atomic_store(&sh->resumed, tr.resumed ? tr.resumed_at + 1 : 0);
	atomic_store(&sh->synced, tr.step);
	if (tr.resumed && strcmp(argv[6], "-") != 0 && stop_step >= 0) {
		/* the state it resumed, for the test to compare (case kill) */
		struct image im;
		trainer_image(&tr, &im);
		FILE *f = fopen(argv[6], "wb");
		CHECK(f && fwrite(im.bytes, 1, im.len, f) == im.len && fclose(f) == 0, "trainer: image: %s",
		      strerror(errno));
		free(im.bytes);
		atomic_store(&sh->imaged, 1);
	}
	atomic_store(&sh->registered, 1);
	while (tr.step < target) {
		bool last = stop_step > 0 && tr.step + 1 >= (uint64_t)stop_step;
		int r = trainer_step(&tr, last ? stop_after : -1);
		CHECK_OK(r);
		atomic_store(&sh->synced, tr.step);
		if (r == 1) {
			atomic_store(&sh->paused, 1);
			for (;;)
				pause(); /* the test kills us here, mid-step */
		}
	}
	if (stop_step < 0) {
		struct image im;
		trainer_image(&tr, &im);
		FILE *f = fopen(argv[6], "wb");
		CHECK(f && fwrite(im.bytes, 1, im.len, f) == im.len && fclose(f) == 0, "trainer: image: %s",
		      strerror(errno));
		free(im.bytes);
	}
	trainer_close(&tr);
	atomic_store(&sh->done, 1);
	return 0;
}

static pid_t spawn_trainer(const char *shm, const char *job, uint64_t target, long stop_step, int stop_after,
                           const char *image)
{
	char a[4][32];
	snprintf(a[0], sizeof(a[0]), "%" PRIu64, target);
	snprintf(a[1], sizeof(a[1]), "%ld", stop_step);
	snprintf(a[2], sizeof(a[2]), "%d", stop_after);
	pid_t pid = fork();
	CHECK(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		execl(self_exe, self_exe, "--trainer", daemon_.socket, shm, job, a[0], a[1], a[2], image ? image : "-",
		      (char *)NULL);
		_exit(127);
	}
	return pid;
}

/* ---- case kill ---- */

struct other {
	pthread_t th;
	char job[32];
	_Atomic bool stop;
	uint64_t steps;
	struct image im;
};

static void *other_run(void *arg)
{
	struct other *o = arg;
	struct trainer tr;
	CHECK_OK(trainer_open(&tr, o->job, AOQ_STATE_FP32, 0));
	while (!atomic_load(&o->stop) && tr.step < 4000) {
		CHECK_OK(trainer_step(&tr, -1));
		usleep(2000);
	}
	o->steps = tr.step;
	trainer_image(&tr, &o->im);
	trainer_close(&tr);
	return NULL;
}

/* One trainer of case kill: where it was told to stop, whether it got
 * there, and the step it resumed at + 1 (0: fresh, or killed before it
 * wrote the state it resumed). */
struct kill_point {
	long stop_step;
	int stop_after;
	bool random, paused;
	uint64_t resumed;
};

/* Each state a trainer resumed equals an undisturbed run's at that step:
 * a difference names the kill that left it (the trainer before's). */
static void resumed_compare(const struct kill_point *kp, int kills)
{
	struct trainer tr;
	CHECK_OK(trainer_open(&tr, "base-resumed", VICTIM_PREC, AOQ_LEASE_NONE));
	int checked = 0;
	for (uint64_t next = 1;;) {
		/* the next step a trainer resumed at, in order (+ 1) */
		uint64_t at1 = UINT64_MAX;
		for (int i = 0; i < kills; i++)
			if (kp[i].resumed >= next && kp[i].resumed < at1)
				at1 = kp[i].resumed;
		if (at1 == UINT64_MAX)
			break;
		next = at1 + 1;
		uint64_t at = at1 - 1;
		while (tr.step < at)
			CHECK_OK(trainer_step(&tr, -1));
		struct image want;
		trainer_image(&tr, &want);
		for (int i = 0; i < kills; i++) {
			if (kp[i].resumed != at1)
				continue;
			char path[300];
			snprintf(path, sizeof(path), "%s/resumed-%d", daemon_.dir, i);
			struct image got = { aoqt_xmalloc(want.len), 0 };
			FILE *f = fopen(path, "rb");
			CHECK(f, "%s: %s", path, strerror(errno));
			got.len = fread(got.bytes, 1, want.len, f);
			fclose(f);
			size_t diff = 0;
			for (size_t b = 0; b < want.len; b++)
				diff += got.bytes[b] != want.bytes[b];
			const struct kill_point *k = i > 0 ? &kp[i - 1] : NULL;
			CHECK(got.len == want.len && diff == 0,
			      "kill %d: the state resumed at step %" PRIu64 " differs from the undisturbed run's (%zu bytes); "
			      "the trainer before was told to stop in step %ld after %d pushes%s, %s",
			      i, at, diff, k ? k->stop_step : 0, k ? k->stop_after : 0,
			      k && k->random ? " (killed at a random moment)" : "",
			      k && k->paused ? "and got there" : "and was killed before");
			free(got.bytes);
			checked++;
		}
		free(want.bytes);
	}
	trainer_close(&tr);
	printf("kill: %d resumed states equal an undisturbed run's at their step\n", checked);
}

static void case_kill(int kills)
{
	/* The victim's precision reaches the trainer processes through their
	 * environment.  Set before the other trainers' threads start and unset
	 * after they end: setenv and unsetenv race with their getenv (libaoq
	 * reads AOQ_* at connect; a crash seen 7 times in 150 runs). */
	setenv("AOQT_VICTIM", "1", 1);
	struct other others[2];
	for (int i = 0; i < 2; i++) {
		memset(&others[i], 0, sizeof(others[i]));
		snprintf(others[i].job, sizeof(others[i].job), "other-%d", i);
		CHECK(pthread_create(&others[i].th, NULL, other_run, &others[i]) == 0, "pthread_create");
	}
	char shm[256], image[256];
	snprintf(shm, sizeof(shm), "%s/shared", daemon_.dir);
	snprintf(image, sizeof(image), "%s/image", daemon_.dir);
	int fd = open(shm, O_RDWR | O_CREAT | O_TRUNC, 0600);
	CHECK(fd >= 0 && ftruncate(fd, 4096) == 0, "shared file: %s", strerror(errno));
	struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	CHECK(sh != MAP_FAILED, "mmap");
	close(fd);
	struct aoqt_rng rng = aoqt_rng_for(0x99, 1, 2);
	uint64_t synced = 0, resumes = 0, rolled = 0;
	/* Kills before step 1 is synced, and random ones before the trainer
	 * registered, leave nothing to resume; how many there are depends on
	 * the seed (one run of 20 kills had 9 resumes).  Past the kills asked
	 * for, the victim is killed again until half as many resumed, at most
	 * twice as many kills in all.  A trainer takes the victim at most 4
	 * steps past the last synced one, so none reaches the target. */
	const int most = 2 * kills;
	const uint64_t target = (uint64_t)most + 40;
	struct kill_point *kp = aoqt_xcalloc((size_t)most, sizeof(*kp));
	int n = 0; /* kills made */
	for (; n < most && synced + 4 < target && (n < kills || resumes < (uint64_t)kills / 2); n++) {
		memset(sh, 0, sizeof(*sh));
		/* Stop in the step after 0..1 more whole steps, after 0..TT pushes
		 * (TT: after StepEnd, before its reply is read). */
		long stop_step = (long)(synced + 1 + (aoqt_next(&rng) % 2));
		int stop_after = (int)(aoqt_next(&rng) % (TT + 1));
		bool random_kill = aoqt_next(&rng) % 4 == 0; /* or at a random moment */
		kp[n] = (struct kill_point){ .stop_step = stop_step, .stop_after = stop_after, .random = random_kill };
		/* A random kill may come after the trainer paused in its stop
		 * step: the kill point then is that step's.  A trainer that
		 * resumed writes the state it resumed to resumed-n first. */
		char resumed_image[300];
		snprintf(resumed_image, sizeof(resumed_image), "%s/resumed-%d", daemon_.dir, n);
		pid_t pid = spawn_trainer(shm, "victim", target, stop_step + (random_kill ? 2 : 0), stop_after,
		                          resumed_image);
		double t0 = aoqt_now();
		if (random_kill) {
			/* at any moment: registering, loading, training */
			useconds_t us = (useconds_t)(aoqt_next(&rng) % 20000);
			while (!atomic_load(&sh->paused) && aoqt_now() - t0 < us * 1e-6)
				usleep(100);
		} else {
			while (!atomic_load(&sh->paused) && aoqt_now() - t0 < 30)
				usleep(200);
			CHECK(atomic_load(&sh->paused), "kill %d: the trainer never reached its kill point", n);
		}
		kill(pid, SIGKILL);
		int st;
		CHECK(waitpid(pid, &st, 0) == pid && WIFSIGNALED(st), "kill %d: the trainer ended by itself (%d)", n, st);
		uint64_t res = atomic_load(&sh->resumed);
		kp[n].paused = atomic_load(&sh->paused);
		kp[n].resumed = atomic_load(&sh->imaged) ? res : 0;
		if (atomic_load(&sh->registered)) {
			/* Once a step was complete there is a lease to resume. */
			CHECK(res > 0 || synced == 0, "kill %d: the trainer did not resume (step %" PRIu64 " was synced)", n,
			      synced);
			if (res > 0) {
				uint64_t at = res - 1;
				/* The last completed step: the one synced, or the one
				 * whose StepEnd was sent before the trainer died. */
				CHECK(at == synced || at == synced + 1, "kill %d: resumed at step %" PRIu64 ", last synced %" PRIu64,
				      n, at, synced);
				rolled += at == synced;
				resumes++;
			}
			synced = atomic_load(&sh->synced);
		}
	}
	/* The last trainer runs to the end and writes its state. */
	memset(sh, 0, sizeof(*sh));
	pid_t pid = spawn_trainer(shm, "victim", target, -1, 0, image);
	int st;
	CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the last trainer failed (%d)", st);
	CHECK(atomic_load(&sh->resumed) > 0, "the last trainer did not resume");
	for (int i = 0; i < 2; i++) {
		atomic_store(&others[i].stop, true);
		pthread_join(others[i].th, NULL);
	}
	unsetenv("AOQT_VICTIM");
	printf("kill: %d kills, %" PRIu64 " resumes (%" PRIu64 " at the synced step, the rest one further), "
	       "victim at step %" PRIu64 ", others at %" PRIu64 " and %" PRIu64 " steps\n",
	       n, resumes, rolled, target, others[0].steps, others[1].steps);
	CHECK(resumes >= (uint64_t)kills / 2, "only %" PRIu64 " resumes in %d kills", resumes, n);
	struct image got = { 0 }, want;
	FILE *f = fopen(image, "rb");
	CHECK(f, "image: %s", strerror(errno));
	baseline("base-victim", VICTIM_PREC, target, &want);
	got.bytes = aoqt_xmalloc(want.len);
	got.len = fread(got.bytes, 1, want.len, f);
	fclose(f);
	resumed_compare(kp, n);
	free(kp);
	image_compare("victim", &got, &want);
	free(got.bytes);
	free(want.bytes);
	for (int i = 0; i < 2; i++) {
		struct image b;
		char job[32];
		snprintf(job, sizeof(job), "base-other-%d", i);
		baseline(job, AOQ_STATE_FP32, others[i].steps, &b);
		image_compare(others[i].job, &others[i].im, &b);
		free(b.bytes);
		free(others[i].im.bytes);
	}
	printf("kill: the victim and both others equal their undisturbed runs bit for bit\n");
}

/* ---- stats helpers ---- */

static const Aoq__SessionStats *find_stats(const Aoq__Envelope *e, const char *job)
{
	for (size_t i = 0; i < e->stats->n_sessions; i++)
		if (strcmp(e->stats->sessions[i]->job, job) == 0)
			return e->stats->sessions[i];
	return NULL;
}

/* A trainer of `job` that trains `steps` steps, then dies (SIGKILL). */
static void train_and_die(const char *job, uint64_t steps)
{
	char shm[256];
	snprintf(shm, sizeof(shm), "%s/shared-%s", daemon_.dir, job);
	int fd = open(shm, O_RDWR | O_CREAT | O_TRUNC, 0600);
	CHECK(fd >= 0 && ftruncate(fd, 4096) == 0, "shared file");
	struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	pid_t pid = spawn_trainer(shm, job, steps + 10, (long)steps + 1, 1, NULL);
	double t0 = aoqt_now();
	while (!atomic_load(&sh->paused) && aoqt_now() - t0 < 30)
		usleep(200);
	CHECK(atomic_load(&sh->paused), "%s: never reached its kill point", job);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	munmap(sh, sizeof(*sh));
}

/* Waits until the session of `job` is in state `state` (NULL: gone). */
static const Aoq__SessionStats *wait_state(Aoq__Envelope **e, const char *job, const char *state)
{
	double t0 = aoqt_now();
	for (;;) {
		if (*e)
			aoq_envelope_free(*e);
		*e = NULL;
		CHECK_OK(aoqt_stats(daemon_.socket, e));
		const Aoq__SessionStats *s = find_stats(*e, job);
		if (state ? s && strcmp(s->state, state) == 0 : !s)
			return s;
		CHECK(aoqt_now() - t0 < 20, "%s: not %s after 20 s", job, state ? state : "gone");
		usleep(20000);
	}
}

/* ---- case unloaded ---- */

/* A trainer that dies between Registered and its first LoadState (its
 * parameters unreadable: libaoq faults copying them) leaves a state with
 * no parameters in it: not leased, so the next trainer of the key starts
 * afresh instead of resuming zeros at step 0. */
static void case_unloaded(void)
{
	char shm[256];
	snprintf(shm, sizeof(shm), "%s/shared-unl", daemon_.dir);
	int fd = open(shm, O_RDWR | O_CREAT | O_TRUNC, 0600);
	CHECK(fd >= 0 && ftruncate(fd, 4096) == 0, "shared file");
	close(fd);
	setenv("AOQT_UNREADABLE", "1", 1);
	pid_t pid = spawn_trainer(shm, "unl", 5, -1, 0, NULL);
	unsetenv("AOQT_UNREADABLE");
	int st;
	CHECK(waitpid(pid, &st, 0) == pid && WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV,
	      "unloaded: the trainer did not fault loading its parameters (%d)", st);
	/* It died after Registered: the daemon registered its state.  aoqd
	 * logs that after sending Registered, so the trainer can be gone
	 * before the line is written: the log is read until it is there. */
	char *log = aoqt_daemon_log(&daemon_);
	char hello[64], registered[64];
	snprintf(hello, sizeof(hello), "hello from pid %d ", (int)pid);
	const char *h = strstr(log, hello);
	unsigned long id = 0;
	while (h && h > log && h[-1] != '\n')
		h--; /* "aoqd info session: session N: hello from pid P ..." */
	CHECK(h && sscanf(h, "%*[^:]: session %lu: hello", &id) == 1, "unloaded: no hello from pid %d in the log",
	      (int)pid);
	snprintf(registered, sizeof(registered), "session %lu: registered ", id);
	for (double t0 = aoqt_now(); !strstr(log, registered) && aoqt_now() - t0 < 10;) {
		usleep(10000);
		free(log);
		log = aoqt_daemon_log(&daemon_);
	}
	CHECK(strstr(log, registered), "unloaded: session %lu was not registered", id);
	free(log);
	Aoq__Envelope *e = NULL;
	wait_state(&e, "unl", NULL);
	aoq_envelope_free(e);
	struct trainer tr;
	CHECK_OK(trainer_open(&tr, "unl", AOQ_STATE_Q8, 0));
	CHECK(!tr.resumed, "unloaded: the next trainer resumed a state never loaded (at step %" PRIu64 ")",
	      tr.resumed_at);
	trainer_close(&tr);
	printf("unloaded: a trainer killed before loading its parameters left no lease (session %lu)\n", id);
}

/* ---- case bye ---- */

/* A trainer that closes its doorbells, then says Bye and closes its socket,
 * ends its session for good: no lease, though aoqd sees the doorbells' hangup
 * before the Bye (aoq_close says Bye and then closes every fd; a process's
 * fds close in any order).  Before, the hangup leased the state of a trainer
 * that had said goodbye. */
static void case_bye(void)
{
	struct aoqt_raw s;
	uint64_t n1[1] = { 4096 };
	CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "bye-last", n1, 1));
	/* one step ends: the state is one a lease would keep */
	struct aoq_rec rec = { .tensor = 0, .slot = 0, .count = n1[0], .step = 1 };
	CHECK_OK(aoqt_raw_push(&s, &rec));
	Aoq__StepEnd se = AOQ__STEP_END__INIT;
	se.step = 1;
	CHECK_OK(aoqt_send_msg(s.sock, AOQ__ENVELOPE__MSG_STEP_END, &se));
	Aoq__Envelope *env = NULL;
	for (;;) {
		CHECK_OK(aoq_recv_frame(s.sock, &env, NULL, 0, NULL));
		bool ended = env->msg_case == AOQ__ENVELOPE__MSG_STEP_ENDED;
		CHECK(ended || env->msg_case != AOQ__ENVELOPE__MSG_ERROR, "bye: step 1 failed");
		aoq_envelope_free(env);
		if (ended)
			break;
	}
	close(s.to_daemon);
	close(s.to_client);
	s.to_daemon = s.to_client = -1;
	usleep(300000);
	Aoq__Bye b = AOQ__BYE__INIT;
	CHECK_OK(aoqt_send_msg(s.sock, AOQ__ENVELOPE__MSG_BYE, &b));
	uint64_t id = s.id;
	aoqt_raw_close(&s);
	Aoq__Envelope *e = NULL;
	wait_state(&e, "bye-last", NULL);
	aoq_envelope_free(e);
	printf("bye: a trainer that closed its doorbells before its Bye left no lease (session %" PRIu64 ")\n", id);
}

/* ---- case layout ---- */

/* Registers job "lay" with tensor 1 of numel1 elements and master_bits:
 * refused with `want` in the message. */
static void layout_refused(uint64_t numel1, uint32_t master_bits, const char *want)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = daemon_.socket;
	o.job = "lay";
	o.precision = AOQ_STATE_Q8;
	o.master_bits = master_bits;
	struct aoq_client *c;
	CHECK_OK(aoq_connect(&c, &o));
	for (uint32_t g = 0; g < 2; g++) {
		struct aoq_group h = hp_of(g, 1);
		CHECK_OK(aoq_add_group(c, &h));
	}
	float *buf = aoqt_xcalloc(30000, 4);
	for (int t = 0; t < TT; t++) {
		char name[16];
		snprintf(name, sizeof(name), "w%d", t);
		struct aoq_tensor d = AOQ_TENSOR_INIT;
		d.name = name;
		d.numel = t == 1 ? numel1 : tdesc[t].n;
		d.param_dtype = tdesc[t].pd;
		d.grad_dtype = tdesc[t].gd;
		d.group = tdesc[t].group;
		d.param = buf;
		CHECK_OK(aoq_add_tensor(c, &d));
	}
	int r = aoq_register(c);
	const char *msg = aoq_last_error();
	printf("layout: %d %s\n", r, msg);
	CHECK(r < 0 && strstr(msg, want), "layout: expected '%s', got %d '%s'", want, r, msg);
	aoq_close(c);
	free(buf);
}

static void case_layout(void)
{
	train_and_die("lay", 3);
	Aoq__Envelope *e = NULL;
	wait_state(&e, "lay", "leased");
	aoq_envelope_free(e);
	/* Same job, tensor 1 with another numel; the same tensors with the
	 * 24-bit master (their bf16 tensors' masters split in 8 low bits). */
	layout_refused(8192, 0, "tensor 1 'w1': numel 8192 here, 20011 in the leased session");
	layout_refused(tdesc[1].n, 24, "a 24-bit master here, a 32-bit one in the leased session");
	/* The lease is still there for the right trainer. */
	e = NULL;
	wait_state(&e, "lay", "leased");
	aoq_envelope_free(e);
}

/* ---- case expiry ---- */

/* The state bytes that sessions of `job` hold (other cases' leases,
 * when every case runs in one daemon, are not counted). */
static uint64_t job_state_bytes(const char *job)
{
	Aoq__Envelope *e = NULL;
	CHECK_OK(aoqt_stats(daemon_.socket, &e));
	uint64_t n = 0;
	for (size_t i = 0; i < e->stats->n_sessions; i++)
		if (strcmp(e->stats->sessions[i]->job, job) == 0)
			n += e->stats->sessions[i]->state_bytes;
	aoq_envelope_free(e);
	return n;
}

static void case_expiry(void)
{
	/* Hello asks 1 s (capped by lease_seconds): expires soon. */
	setenv("AOQT_LEASE", "1", 1);
	train_and_die("exp", 2);
	Aoq__Envelope *e = NULL;
	const Aoq__SessionStats *s = wait_state(&e, "exp", "leased");
	CHECK(s->lease_left_seconds > 0 && s->lease_left_seconds <= 1.0, "expiry: %g s left", s->lease_left_seconds);
	CHECK(s->last_step == 2, "expiry: last step %" PRIu64, s->last_step);
	CHECK(job_state_bytes("exp") > 0, "expiry: the leased state holds no memory");
	double t0 = aoqt_now();
	wait_state(&e, "exp", NULL);
	aoq_envelope_free(e);
	printf("expiry: gone after %.2f s\n", aoqt_now() - t0);
	CHECK(job_state_bytes("exp") == 0, "expiry: state bytes still held");
	char *log = aoqt_daemon_log(&daemon_);
	CHECK(strstr(log, "lease ended (expired)"), "expiry: not logged");
	free(log);
	unsetenv("AOQT_LEASE");
}

/* ---- case drop ---- */

static void case_drop(void)
{
	train_and_die("drp", 2);
	Aoq__Envelope *e = NULL;
	const Aoq__SessionStats *s = wait_state(&e, "drp", "leased");
	uint64_t id = s->id;
	char msg[256] = "";
	CHECK_OK(aoqt_drop(daemon_.socket, id, msg, sizeof(msg)));
	wait_state(&e, "drp", NULL);
	aoq_envelope_free(e);
	CHECK(aoqt_drop(daemon_.socket, id, msg, sizeof(msg)) == -ENOENT, "drop twice: '%s'", msg);
	/* The next trainer of the key starts afresh. */
	struct trainer tr;
	CHECK_OK(trainer_open(&tr, "drp", AOQ_STATE_Q8, 0));
	CHECK(!tr.resumed, "drop: the next trainer resumed");
	/* A live session: dropped, its trainer sees an error, no lease. */
	e = NULL;
	s = wait_state(&e, "drp", "training");
	CHECK_OK(aoqt_drop(daemon_.socket, s->id, msg, sizeof(msg)));
	aoq_envelope_free(e);
	int r = 0;
	for (int i = 0; i < 100 && r == 0; i++)
		r = trainer_step(&tr, -1);
	CHECK(r < 0, "drop: the dropped trainer trains on");
	trainer_close(&tr);
	e = NULL;
	wait_state(&e, "drp", NULL);
	aoq_envelope_free(e);
	printf("drop: leased and live sessions dropped\n");
}

/* ---- case dup ---- */

/* A second connection with the key of a live session is refused by name;
 * once the first trainer is gone, the next one resumes. */
static void case_dup(void)
{
	struct trainer a, b;
	CHECK_OK(trainer_open(&a, "dup", AOQ_STATE_Q8, 0));
	CHECK_OK(trainer_step(&a, -1));
	int r = trainer_open(&b, "dup", AOQ_STATE_Q8, 0);
	const char *msg = aoq_last_error();
	printf("dup: %d %s\n", r, msg);
	CHECK(r == -EBUSY && strstr(msg, "job 'dup' rank 0 of uid") && strstr(msg, "is connected already"),
	      "dup: %d '%s'", r, msg);
	if (b.c)
		aoq_close(b.c);
	CHECK_OK(trainer_step(&a, -1)); /* the first one goes on */
	trainer_close(&a);              /* Bye: no lease */
	CHECK_OK(trainer_open(&b, "dup", AOQ_STATE_Q8, 0));
	CHECK(!b.resumed, "dup: a session that said Bye was resumed");
	trainer_close(&b);
}

/* ---- case uid ---- */

static int uid_main(char **argv)
{
	/* As nobody: argv = SOCKET ID JOB */
	snprintf(daemon_.socket, sizeof(daemon_.socket), "%s", argv[0]);
	uint64_t id = strtoull(argv[1], NULL, 10);
	char msg[256] = "";
	int r = aoqt_drop(daemon_.socket, id, msg, sizeof(msg));
	CHECK(r == -ENOENT, "uid: another uid's drop: %d '%s'", r, msg);
	Aoq__Envelope *e = NULL;
	CHECK_OK(aoqt_stats(daemon_.socket, &e));
	CHECK(!find_stats(e, argv[2]), "uid: another uid sees the leased session");
	aoq_envelope_free(e);
	struct trainer tr;
	CHECK_OK(trainer_open(&tr, argv[2], AOQ_STATE_Q8, AOQ_LEASE_NONE));
	CHECK(!tr.resumed, "uid: another uid resumed the session");
	trainer_close(&tr);
	printf("uid: nobody neither drops, sees nor resumes it\n");
	return 0;
}

static void case_uid(void)
{
	if (geteuid() != 0 || system("setpriv --version >/dev/null 2>&1") != 0) {
		printf("uid: needs root and setpriv: skipped\n");
		return;
	}
	CHECK(chmod(daemon_.dir, 0755) == 0 && chmod(daemon_.socket, 0666) == 0, "chmod: %s", strerror(errno));
	train_and_die("mine", 2);
	Aoq__Envelope *e = NULL;
	const Aoq__SessionStats *s = wait_state(&e, "mine", "leased");
	char id[32];
	snprintf(id, sizeof(id), "%" PRIu64, s->id);
	aoq_envelope_free(e);
	pid_t pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		execlp("setpriv", "setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", self_exe, "--as-other",
		       daemon_.socket, id, "mine", (char *)NULL);
		_exit(127);
	}
	int st;
	CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "uid: the other uid's checks failed");
	e = NULL;
	s = wait_state(&e, "mine", "leased");
	aoq_envelope_free(e);
	/* Its owner still resumes it. */
	struct trainer tr;
	CHECK_OK(trainer_open(&tr, "mine", AOQ_STATE_Q8, 0));
	CHECK(tr.resumed && tr.resumed_at == 2, "uid: the owner did not resume at step 2");
	trainer_close(&tr);
}

/* ---- case quota ---- */

/* max_sessions_per_uid = 2: two leased sessions fill it; a third job is
 * refused by name; the trainer that resumes one of them is not. */
static void case_quota(const char *exe)
{
	char conf[256];
	snprintf(conf, sizeof(conf), "%s/quota.conf", daemon_.dir);
	FILE *f = fopen(conf, "w");
	CHECK(f && fputs("max_sessions_per_uid = 2\n", f) >= 0 && fclose(f) == 0, "quota.conf");
	char keep[256];
	snprintf(keep, sizeof(keep), "/tmp/aoqt-quota-%d.conf", (int)getpid());
	CHECK(rename(conf, keep) == 0, "rename");
	aoqt_daemon_stop(&daemon_, 10000, true); /* may still be starting: any status */
	const char *args[] = { "--threads", "1", "--config", keep, NULL };
	CHECK_OK(aoqt_daemon_start(&daemon_, exe, args));
	train_and_die("qa", 2);
	train_and_die("qb", 2);
	Aoq__Envelope *e = NULL;
	wait_state(&e, "qa", "leased");
	wait_state(&e, "qb", "leased");
	aoq_envelope_free(e);
	struct trainer tr;
	int r = trainer_open(&tr, "qc", AOQ_STATE_Q8, 0);
	const char *msg = aoq_last_error();
	printf("quota: %d %s\n", r, msg);
	CHECK(r == -EDQUOT && strstr(msg, "2 sessions, leased ones included (max_sessions_per_uid)"),
	      "quota: a third session: %d '%s'", r, msg);
	aoq_close(tr.c);
	CHECK_OK(trainer_open(&tr, "qa", AOQ_STATE_Q8, 0));
	CHECK(tr.resumed && tr.resumed_at == 2, "quota: qa did not resume at step 2");
	trainer_close(&tr);
	unlink(keep);
	printf("quota: leased sessions count, the resumed one does not\n");
}

/* ---- case refused ---- */

/* A resume refused for the uid's quota leaves the lease as it was: the
 * resuming trainer asks for a staging window whose arena (some 10 MiB)
 * passes max_state_bytes_per_uid (4 MiB), the first trainer's did not;
 * the next trainer, with the first one's arena, resumes at step 2. */
static void case_refused(const char *exe)
{
	char conf[256];
	snprintf(conf, sizeof(conf), "/tmp/aoqt-refused-%d.conf", (int)getpid());
	FILE *f = fopen(conf, "w");
	CHECK(f && fputs("max_state_bytes_per_uid = 4194304\n", f) >= 0 && fclose(f) == 0, "refused.conf");
	aoqt_daemon_stop(&daemon_, 10000, true);
	const char *args[] = { "--threads", "1", "--config", conf, NULL };
	CHECK_OK(aoqt_daemon_start(&daemon_, exe, args));
	train_and_die("ref", 2);
	Aoq__Envelope *e = NULL;
	uint64_t id = wait_state(&e, "ref", "leased")->id;
	aoq_envelope_free(e);
	struct trainer tr;
	int r = trainer_open_window(&tr, "ref", AOQ_STATE_Q8, 0, 64ull * 8 * 20480);
	const char *msg = aoq_last_error();
	printf("refused: %d %s\n", r, msg);
	CHECK(r == -EDQUOT && strstr(msg, "quota"), "refused: the oversized resume: %d '%s'", r, msg);
	trainer_close(&tr);
	e = NULL;
	const Aoq__SessionStats *s = wait_state(&e, "ref", "leased");
	CHECK(s->id == id && s->last_step == 2, "refused: the lease changed (session %" PRIu64 " at step %" PRIu64
	      ", was %" PRIu64 " at step 2)", s->id, s->last_step, id);
	aoq_envelope_free(e);
	CHECK_OK(trainer_open(&tr, "ref", AOQ_STATE_Q8, 0));
	CHECK(tr.resumed && tr.resumed_at == 2, "refused: the next trainer did not resume at step 2 (resumed %d at %"
	      PRIu64 ")", tr.resumed, tr.resumed_at);
	CHECK_OK(trainer_step(&tr, -1));
	trainer_close(&tr);
	unlink(conf);
	printf("refused: the lease outlived a resume refused for the quota\n");
}

/* ---- case memlock ---- */

/* aoqd as nobody (no CAP_IPC_LOCK) under RLIMIT_MEMLOCK 256 KiB: `try` trains
 * unlocked and says so once; `yes` refuses the registration by name. */
static void case_memlock(const char *exe)
{
	if (geteuid() != 0 || system("setpriv --version >/dev/null 2>&1 && prlimit --version >/dev/null 2>&1") != 0) {
		printf("memlock: needs root, setpriv and prlimit: skipped\n");
		return;
	}
	char wrap[] = "/tmp/aoqt-memlock-XXXXXX";
	int fd = mkstemp(wrap);
	CHECK(fd >= 0, "mkstemp");
	dprintf(fd, "#!/bin/sh\nexec prlimit --memlock=262144:262144 setpriv --reuid=65534 --regid=65534 --clear-groups "
	        "--inh-caps=-all %s \"$@\"\n", exe);
	close(fd);
	chmod(wrap, 0755);
	for (int yes = 0; yes < 2; yes++) {
		aoqt_daemon_stop(&daemon_, 10000, true); /* may still be starting: any status */
		const char *args[] = { "--threads", "1", "--lock-memory", yes ? "yes" : "try", NULL };
		CHECK_OK(aoqt_daemon_start(&daemon_, wrap, args));
		struct trainer tr[2];
		int r = trainer_open(&tr[0], "lock-a", AOQ_STATE_FP32, 0);
		if (yes) {
			const char *msg = aoq_last_error();
			printf("memlock yes: %d %s\n", r, msg);
			CHECK(r == -ENOMEM && strstr(msg, "LimitMEMLOCK"), "memlock yes: %d '%s'", r, msg);
			aoq_close(tr[0].c);
			continue;
		}
		CHECK_OK(r);
		CHECK_OK(trainer_open(&tr[1], "lock-b", AOQ_STATE_FP32, 0));
		for (int k = 0; k < 3; k++)
			for (int i = 0; i < 2; i++)
				CHECK_OK(trainer_step(&tr[i], -1));
		for (int i = 0; i < 2; i++)
			trainer_close(&tr[i]);
		char *log = aoqt_daemon_log(&daemon_);
		int n = 0;
		for (const char *p = log; (p = strstr(p, "cannot lock optimizer state")); p++)
			n++;
		CHECK(n == 1, "memlock try: 'cannot lock optimizer state' logged %d times", n);
		n = 0;
		for (const char *p = log; (p = strstr(p, "cannot lock its arena")); p++)
			n++;
		CHECK(n <= 1, "memlock try: 'cannot lock its arena' logged %d times", n);
		free(log);
		printf("memlock try: trained unlocked, warned once\n");
	}
	unlink(wrap);
}

/* ---- case restart ---- */

/*
 * aoqd killed (SIGKILL) under four training sessions (fp32 state with a
 * window of two staging slots, q8 moments, bf16 master, bf16 master + q4
 * moments: the snapshot formats), after a snapshot of each at step RS_K.  aoqd is stopped
 * (SIGSTOP) first, so that every trainer is inside a libaoq call waiting for
 * it (a push waiting for a staging slot, a request's reply, aoq_sync) when
 * the kill comes.  Every such call, and every call after it, must fail
 * within RS_BOUND s of the kill (no hang; libaoq's 60 s timeout cannot
 * produce that).  A restarted aoqd on the same state_dir, which also holds
 * a damaged snapshot (CRC mismatch) of a fourth key, must skip that file,
 * say so and rename it aside, and offer the four snapshots as leased
 * sessions: each trainer reconnects with its key and layout, resumes at
 * RS_K and trains on to RS_K + RS_M, bit for bit like an undisturbed run.
 */
#define RS 4
#define RS_K 4
#define RS_M 6
/* The bound: the kernel closes a killed aoqd's sockets at once; libaoq's
 * progress thread polls the doorbell and the control socket and fails every
 * wait when either closes, and requests read EOF.  What takes time is
 * scheduling on a loaded 2-core machine (and ASan's slower code): measured
 * in milliseconds here, so 1 s leaves a wide margin without hiding a wait
 * that does not look at the socket (its deadline is 60 s). */
#define RS_BOUND 1.0
static const struct {
	const char *job;
	enum aoq_precision prec;
	uint64_t window;
} rs_desc[RS] = {
	/* 2 staging slots for 3 tensors and no SetHyperparams: when aoqd
	 * stops, this trainer waits in aoq_push_grad for a slot (a wait on
	 * the ring, not on the socket) */
	{ "rs-fp32", AOQ_STATE_FP32, 1 },
	{ "rs-q8", AOQ_STATE_Q8, 0 },
	{ "rs-bf16", AOQ_STATE_BF16, 0 },
	{ "rs-bf16q4", AOQ_STATE_BF16_Q4, 0 },
};

struct rs_client {
	pthread_t th;
	int i;
	struct trainer tr;
	_Atomic int paused; /* at step RS_K, waiting for go */
	_Atomic int go;
	_Atomic int paused2, go2; /* rs-fp32: at step RS_K + 2, until aoqd is stopped */
	_Atomic uint64_t step;
	_Atomic int64_t call_since; /* start of the call in progress (ns), 0: none */
	_Atomic(const char *) call;
	/* the first failed call */
	int64_t err_at, err_start;
	const char *err_call;
	int err;
	char errmsg[256];
	double after_max; /* the longest call after it */
	int after_ok;     /* calls after it that did not fail */
	const char *ok_call;
	_Atomic int done;
};

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#define TIMED(c, name, expr)                                                                   \
	do {                                                                                   \
		atomic_store(&(c)->call, name);                                               \
		int64_t t0_ = now_ns();                                                        \
		atomic_store(&(c)->call_since, t0_);                                           \
		int r_ = (expr);                                                               \
		atomic_store(&(c)->call_since, 0);                                             \
		if (r_ < 0) {                                                                  \
			(c)->err_at = now_ns();                                                \
			(c)->err_start = t0_;                                                  \
			(c)->err_call = name;                                                  \
			(c)->err = r_;                                                         \
			snprintf((c)->errmsg, sizeof((c)->errmsg), "%s", aoq_last_error());    \
			return r_;                                                             \
		}                                                                              \
	} while (0)

static int rs_step(struct rs_client *c)
{
	struct trainer *tr = &c->tr;
	uint64_t k = tr->step + 1;
	for (uint32_t g = 0; g < 2 && !tr->fixed_hp; g++) {
		struct aoq_group h = hp_of(g, k);
		TIMED(c, "aoq_set_hyperparams", aoq_set_hyperparams(tr->c, g, &h));
	}
	for (int t = TT - 1; t >= 0; t--) {
		grad_of(k, t, tr->grad[t]);
		TIMED(c, "aoq_push_grad", aoq_push_grad(tr->c, (uint32_t)t, 0, NULL));
		TIMED(c, "aoq_grad_copied", aoq_grad_copied(tr->c, (uint32_t)t));
	}
	TIMED(c, "aoq_step_end", aoq_step_end(tr->c));
	TIMED(c, "aoq_sync", aoq_sync(tr->c, NULL));
	tr->step = k;
	return 0;
}

/* A call after the session failed: must fail, and at once. */
static void rs_after(struct rs_client *c, const char *name, int r, int64_t t0)
{
	double s = (double)(now_ns() - t0) * 1e-9;
	c->after_max = s > c->after_max ? s : c->after_max;
	if (r >= 0 && !c->after_ok++)
		c->ok_call = name;
}

static void *rs_run(void *arg)
{
	struct rs_client *c = arg;
	struct trainer *tr = &c->tr;
	CHECK_OK(trainer_open_window(tr, rs_desc[c->i].job, rs_desc[c->i].prec, 0, rs_desc[c->i].window));
	tr->fixed_hp = rs_desc[c->i].window != 0;
	for (;;) {
		if (tr->step == RS_K && !atomic_load(&c->go)) {
			atomic_store(&c->paused, 1);
			while (!atomic_load(&c->go))
				usleep(1000);
		}
		if (c->i == 0 && tr->step == RS_K + 2 && !atomic_load(&c->go2)) {
			atomic_store(&c->paused2, 1);
			while (!atomic_load(&c->go2))
				usleep(1000);
		}
		if (rs_step(c) < 0)
			break;
		atomic_store(&c->step, tr->step);
	}
	struct aoq_group h = hp_of(0, tr->step + 1);
	int64_t t0 = now_ns();
	rs_after(c, "aoq_push_grad", aoq_push_grad(tr->c, 0, 0, NULL), t0);
	t0 = now_ns();
	rs_after(c, "aoq_step_end", aoq_step_end(tr->c), t0);
	t0 = now_ns();
	rs_after(c, "aoq_sync", aoq_sync(tr->c, NULL), t0);
	t0 = now_ns();
	rs_after(c, "aoq_set_hyperparams", aoq_set_hyperparams(tr->c, 0, &h), t0);
	/* A wait for an update already answered may succeed (the value is
	 * there); it must not hang. */
	t0 = now_ns();
	int wr = aoq_wait_param(tr->c, 1, NULL);
	rs_after(c, "aoq_wait_param", wr < 0 ? wr : -1, t0);
	t0 = now_ns();
	aoq_close(tr->c);
	rs_after(c, "aoq_close", -1, t0);
	for (int t = 0; t < TT; t++) {
		free(tr->param[t]);
		free(tr->grad[t]);
	}
	atomic_store(&c->done, 1);
	return NULL;
}

/* SnapshotRequest for the session of `job` (as aoqctl snapshot): its step. */
static uint64_t rs_snapshot(const char *job, char *path, size_t plen)
{
	Aoq__Envelope *e = NULL;
	uint64_t id = wait_state(&e, job, "training")->id, step = 0;
	aoq_envelope_free(e);
	CHECK(aoqt_snapshot(daemon_.socket, id, path, plen, &step) == 0, "snapshot of %s: %s", job, path);
	return step;
}

/* A copy of snapshot `from` as `to`, its job renamed (the same length, in
 * the header, which the CRC does not cover) and one data byte flipped. */
static void rs_damage(const char *from, const char *to, const char *job, const char *newjob)
{
	FILE *f = fopen(from, "rb");
	CHECK(f, "%s: %s", from, strerror(errno));
	CHECK(fseek(f, 0, SEEK_END) == 0, "seek");
	long len = ftell(f);
	rewind(f);
	uint8_t *b = aoqt_xmalloc((size_t)len);
	CHECK(fread(b, 1, (size_t)len, f) == (size_t)len, "read %s", from);
	fclose(f);
	uint64_t hlen = 0;
	for (int i = 0; i < 8; i++)
		hlen |= (uint64_t)b[i] << (8 * i);
	CHECK(hlen + 8 < (uint64_t)len, "%s: header", from);
	char pat[64];
	snprintf(pat, sizeof(pat), "\"%s\"", job);
	char *h = (char *)b + 8, *p = memmem(h, hlen, pat, strlen(pat));
	CHECK(p && strlen(newjob) == strlen(job), "%s: no %s in the header", from, pat);
	memcpy(p + 1, newjob, strlen(newjob));
	b[8 + hlen + (uint64_t)(len - 8 - (long)hlen) / 2] ^= 0x10;
	f = fopen(to, "wb");
	CHECK(f && fwrite(b, 1, (size_t)len, f) == (size_t)len && fclose(f) == 0, "write %s", to);
	free(b);
}

static void rm_tree_flat(const char *dir)
{
	DIR *d = opendir(dir);
	if (!d)
		return;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		char p[512];
		snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
		unlink(p);
	}
	closedir(d);
	rmdir(dir);
}

static void case_restart(const char *exe)
{
	char sd[] = "/tmp/aoqt-state-XXXXXX";
	CHECK(mkdtemp(sd), "mkdtemp: %s", strerror(errno));
	aoqt_daemon_stop(&daemon_, 10000, true); /* may still be starting: any status */
	const char *args[] = { "--threads", "1", "--state-dir", sd, NULL };
	CHECK_OK(aoqt_daemon_start(&daemon_, exe, args));
	struct rs_client *cl = aoqt_xcalloc(RS, sizeof(*cl));
	for (int i = 0; i < RS; i++) {
		cl[i].i = i;
		CHECK(pthread_create(&cl[i].th, NULL, rs_run, &cl[i]) == 0, "pthread_create");
	}
	double t0 = aoqt_now();
	for (int i = 0; i < RS; i++)
		while (!atomic_load(&cl[i].paused)) {
			CHECK(aoqt_now() - t0 < 60, "restart: %s never reached step %d", rs_desc[i].job, RS_K);
			usleep(1000);
		}
	char snap[RS][512];
	for (int i = 0; i < RS; i++) {
		uint64_t at = rs_snapshot(rs_desc[i].job, snap[i], sizeof(snap[i]));
		CHECK(at == RS_K, "restart: %s: snapshot at step %" PRIu64 ", expected %d", rs_desc[i].job, at, RS_K);
		atomic_store(&cl[i].go, 1);
	}
	/* Train past the snapshot: the restored state must be the snapshot's. */
	t0 = aoqt_now();
	for (int i = 0; i < RS; i++)
		while (atomic_load(&cl[i].step) < RS_K + 2) {
			CHECK(aoqt_now() - t0 < 60, "restart: %s stuck at step %" PRIu64, rs_desc[i].job,
			      atomic_load(&cl[i].step));
			usleep(1000);
		}
	/* Stopped, then killed: every trainer is in a call that waits for aoqd.
	 * rs-fp32 starts its step once aoqd is stopped: its third push waits
	 * for a staging slot. */
	while (!atomic_load(&cl[0].paused2)) {
		CHECK(aoqt_now() - t0 < 60, "restart: rs-fp32 never reached step %d", RS_K + 2);
		usleep(1000);
	}
	CHECK(kill(daemon_.pid, SIGSTOP) == 0, "SIGSTOP: %s", strerror(errno));
	atomic_store(&cl[0].go2, 1);
	t0 = aoqt_now();
	for (int i = 0; i < RS; i++)
		for (;;) {
			int64_t since = atomic_load(&cl[i].call_since);
			if (since && now_ns() - since > 100000000)
				break;
			CHECK(aoqt_now() - t0 < 10, "restart: %s is not waiting for the stopped aoqd", rs_desc[i].job);
			usleep(1000);
		}
	const char *blocked[RS];
	for (int i = 0; i < RS; i++)
		blocked[i] = atomic_load(&cl[i].call);
	CHECK(strcmp(blocked[0], "aoq_push_grad") == 0, "restart: rs-fp32 waits in %s, not for a staging slot",
	      blocked[0]);
	int64_t t_kill = now_ns();
	CHECK(kill(daemon_.pid, SIGKILL) == 0, "SIGKILL: %s", strerror(errno));
	t0 = aoqt_now();
	for (int i = 0; i < RS; i++)
		while (!atomic_load(&cl[i].done)) {
			CHECK(aoqt_now() - t0 < 5, "restart: %s still in %s 5 s after aoqd was killed", rs_desc[i].job,
			      atomic_load(&cl[i].call));
			usleep(1000);
		}
	for (int i = 0; i < RS; i++) {
		pthread_join(cl[i].th, NULL);
		struct rs_client *c = &cl[i];
		double s = (double)(c->err_at - (c->err_start > t_kill ? c->err_start : t_kill)) * 1e-9;
		printf("restart: %s waiting in %s at the kill: %s failed %.1f ms after it (%d: %s); "
		       "later calls failed within %.1f ms\n", rs_desc[i].job, blocked[i], c->err_call,
		       (double)(c->err_at - t_kill) * 1e-6, c->err, c->errmsg, c->after_max * 1e3);
		CHECK(c->err_at >= t_kill, "restart: %s: %s failed before the kill (%d: %s)", rs_desc[i].job, c->err_call,
		      c->err, c->errmsg);
		CHECK(s <= RS_BOUND, "restart: %s: %s took %.3f s to fail after aoqd was killed", rs_desc[i].job,
		      c->err_call, s);
		CHECK(c->after_ok == 0, "restart: %s: %d calls succeeded on a dead daemon (%s)", rs_desc[i].job, c->after_ok,
		      c->ok_call);
		CHECK(c->after_max <= RS_BOUND, "restart: %s: a call on the dead session took %.3f s", rs_desc[i].job,
		      c->after_max);
	}
	int st;
	CHECK(waitpid(daemon_.pid, &st, 0) == daemon_.pid && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
	      "restart: aoqd did not die of SIGKILL (%d)", st);
	if (daemon_.pidfd >= 0)
		close(daemon_.pidfd);
	daemon_.pid = -1;
	rm_tree_flat(daemon_.dir);

	/* A damaged snapshot of another key beside the three. */
	char bad[600], aside[620];
	snprintf(bad, sizeof(bad), "%s/%u-rs-fpXX-0.safetensors", sd, (unsigned)getuid());
	rs_damage(snap[0], bad, "rs-fp32", "rs-fpXX");
	CHECK_OK(aoqt_daemon_start(&daemon_, exe, args));
	/* Restored before the daemon listens: once it answers, they are there. */
	Aoq__Envelope *e = NULL;
	for (int i = 0; i < RS; i++) {
		const Aoq__SessionStats *s = wait_state(&e, rs_desc[i].job, "leased");
		CHECK(s->last_step == RS_K, "restart: %s restored at step %" PRIu64, rs_desc[i].job, s->last_step);
	}
	CHECK(!find_stats(e, "rs-fpXX"), "restart: the damaged snapshot was restored");
	aoq_envelope_free(e);
	char *log = aoqt_daemon_log(&daemon_);
	char *line = log ? strstr(log, "rs-fpXX-0.safetensors: checksum mismatch") : NULL;
	CHECK(line, "restart: the damaged snapshot is not named in the log");
	char *eol = strchr(line, '\n');
	printf("restart: log: ...%.*s\n", eol ? (int)(eol - line) : 200, line);
	snprintf(aside, sizeof(aside), "%s.rejected", bad);
	struct stat sb;
	CHECK(stat(bad, &sb) < 0 && stat(aside, &sb) == 0, "restart: the damaged snapshot was not renamed to %s", aside);
	CHECK(strstr(line, aside), "restart: the log does not say where the damaged file went");
	free(log);

	/* rs-q8 first: a trainer process resumes it, and dies in step RS_K + 3:
	 * the restored state, once resumed, is leased again (it was given an
	 * undo copy), at RS_K + 2 with step RS_K + 3 rolled back. */
	char shm[256];
	snprintf(shm, sizeof(shm), "%s/shared-rs", daemon_.dir);
	int fd = open(shm, O_RDWR | O_CREAT | O_TRUNC, 0600);
	CHECK(fd >= 0 && ftruncate(fd, 4096) == 0, "shared file");
	struct shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	CHECK(sh != MAP_FAILED, "mmap");
	close(fd);
	pid_t pid = spawn_trainer(shm, "rs-q8", RS_K + RS_M, RS_K + 3, 1, NULL);
	t0 = aoqt_now();
	while (!atomic_load(&sh->paused) && aoqt_now() - t0 < 30)
		usleep(200);
	CHECK(atomic_load(&sh->paused), "restart: the rs-q8 trainer process never reached step %d", RS_K + 3);
	CHECK(atomic_load(&sh->resumed) == RS_K + 1, "restart: the rs-q8 trainer process resumed %" PRIu64 " - 1",
	      atomic_load(&sh->resumed));
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	munmap(sh, sizeof(*sh));
	e = NULL;
	const Aoq__SessionStats *ls = wait_state(&e, "rs-q8", "leased");
	CHECK(ls->last_step == RS_K + 2, "restart: rs-q8 leased again at step %" PRIu64 ", expected %d", ls->last_step,
	      RS_K + 2);
	aoq_envelope_free(e);

	/* Each trainer resumes at the snapshot's step (rs-q8: at RS_K + 2) and
	 * trains on, bit-exact. */
	for (int i = 0; i < RS; i++) {
		struct trainer tr;
		CHECK_OK(trainer_open_window(&tr, rs_desc[i].job, rs_desc[i].prec, 0, rs_desc[i].window));
		tr.fixed_hp = rs_desc[i].window != 0;
		uint64_t at = i == 1 ? RS_K + 2 : RS_K;
		CHECK(tr.resumed && tr.resumed_at == at, "restart: %s: resumed %d at step %" PRIu64 ", expected %" PRIu64,
		      rs_desc[i].job, tr.resumed, tr.resumed_at, at);
		while (tr.step < RS_K + RS_M)
			CHECK_OK(trainer_step(&tr, -1));
		struct image got, want;
		trainer_image(&tr, &got);
		trainer_close(&tr);
		char job[32];
		snprintf(job, sizeof(job), "base-%s", rs_desc[i].job);
		struct trainer b;
		CHECK_OK(trainer_open_window(&b, job, rs_desc[i].prec, AOQ_LEASE_NONE, rs_desc[i].window));
		b.fixed_hp = rs_desc[i].window != 0;
		while (b.step < RS_K + RS_M)
			CHECK_OK(trainer_step(&b, -1));
		trainer_image(&b, &want);
		trainer_close(&b);
		image_compare(rs_desc[i].job, &got, &want);
		free(got.bytes);
		free(want.bytes);
	}
	printf("restart: fp32, q8, bf16 and bf16 + q4 sessions resumed at step %d from their snapshots (q8 killed again, "
	       "leased and resumed once more) and equal undisturbed runs of %d steps bit for bit\n", RS_K, RS_K + RS_M);
	/* A session snapshot before its trainer died, resumed, snapshot
	 * again: the capture moves with the state to the new session. */
	memset(shm, 0, sizeof(shm));
	snprintf(shm, sizeof(shm), "%s/shared-snl", daemon_.dir);
	fd = open(shm, O_RDWR | O_CREAT | O_TRUNC, 0600);
	CHECK(fd >= 0 && ftruncate(fd, 4096) == 0, "shared file");
	sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	CHECK(sh != MAP_FAILED, "mmap");
	close(fd);
	pid = spawn_trainer(shm, "snl", 10, 3, 0, NULL);
	t0 = aoqt_now();
	while (!atomic_load(&sh->paused) && aoqt_now() - t0 < 30)
		usleep(200);
	CHECK(atomic_load(&sh->paused), "restart: the snl trainer never reached step 3");
	char p1[512], p2[512];
	CHECK(rs_snapshot("snl", p1, sizeof(p1)) == 2, "restart: snl: snapshot not at step 2");
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	munmap(sh, sizeof(*sh));
	e = NULL;
	wait_state(&e, "snl", "leased");
	aoq_envelope_free(e);
	{
		struct trainer tr;
		CHECK_OK(trainer_open(&tr, "snl", AOQ_STATE_Q8, 0));
		CHECK(tr.resumed && tr.resumed_at == 2, "restart: snl did not resume at step 2");
		CHECK_OK(trainer_step(&tr, -1));
		CHECK(rs_snapshot("snl", p2, sizeof(p2)) == 3, "restart: snl: second snapshot not at step 3");
		CHECK_OK(trainer_step(&tr, -1));
		trainer_close(&tr);
	}
	free(cl);
	CHECK(aoqt_daemon_alive(&daemon_), "aoqd died");
	rm_tree_flat(sd);
}

int main(int argc, char **argv)
{
	if (argc > 2 && strcmp(argv[1], "--trainer") == 0) {
		aoqt_init("faults-trainer");
		return trainer_main(argv + 2);
	}
	if (argc > 2 && strcmp(argv[1], "--as-other") == 0) {
		aoqt_init("faults-uid");
		return uid_main(argv + 2);
	}
	const char *c = "all";
	for (int i = 2; i + 1 < argc; i++)
		if (strcmp(argv[i], "--case") == 0)
			c = argv[i + 1];
	aoqt_init("faults");
	/* The trainers (other processes) compute the same gradients. */
	char seed[32];
	snprintf(seed, sizeof(seed), "%" PRIu64, aoqt_seed);
	setenv("AOQ_TEST_SEED", seed, 1);
	ssize_t n = readlink("/proc/self/exe", self_exe, sizeof(self_exe) - 1);
	CHECK(n > 0, "readlink /proc/self/exe");
	self_exe[n] = 0;
	const char *exe = aoqt_aoqd_path(argc, argv);
	const char *args[] = { "--threads", "1", NULL };
	CHECK_OK(aoqt_daemon_start(&daemon_, exe, args));
	bool all = strcmp(c, "all") == 0;
	if (all || strcmp(c, "kill") == 0)
		case_kill(getenv("AOQT_KILLS") ? atoi(getenv("AOQT_KILLS")) : getenv("AOQ_TEST_SLOW") ? 20 : 100);
	if (all || strcmp(c, "unloaded") == 0)
		case_unloaded();
	if (all || strcmp(c, "bye") == 0)
		case_bye();
	if (all || strcmp(c, "layout") == 0)
		case_layout();
	if (all || strcmp(c, "expiry") == 0)
		case_expiry();
	if (all || strcmp(c, "drop") == 0)
		case_drop();
	if (all || strcmp(c, "dup") == 0)
		case_dup();
	if (all || strcmp(c, "uid") == 0)
		case_uid();
	if (all || strcmp(c, "quota") == 0)
		case_quota(exe);
	if (all || strcmp(c, "refused") == 0)
		case_refused(exe);
	if (all || strcmp(c, "memlock") == 0)
		case_memlock(exe);
	if (all || strcmp(c, "restart") == 0)
		case_restart(exe);
	CHECK(aoqt_daemon_alive(&daemon_), "aoqd died");
	CHECK(aoqt_daemon_stop(&daemon_, 10000, true) == 0, "aoqd did not stop cleanly");
	printf("ok\n");
	return 0;
}
