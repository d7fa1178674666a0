/* SPDX-License-Identifier: MIT */
/*
 * Snapshots through the built aoqd (docs/snapshots.md).
 *
 * Mode "roundtrip" (suite integration): for fp32, bf16, q8, bf16_all, q4 and bf16_q4
 * state, a libaoq client trains a few steps; a SnapshotRequest from an
 * observer connection (what aoqctl snapshot sends) answers with the file's
 * path; the file, loaded by aoqd's own loader, holds exactly what ReadState
 * gives through libaoq (master, exp_avg, exp_avg_sq, bit for bit as fp32)
 * and the tensor steps.  Then a snapshot asked mid-step (a gradient pushed,
 * no StepEnd yet) is the state at the end of that step, and training goes
 * on after it.
 *
 * Mode "periodic" (suite integration): snapshot_every_steps = 3 from the
 * config file writes step 6's state; SIGHUP with snapshot_every_steps = 2
 * and another state_dir writes step 8's there and leaves the old file.
 *
 * Mode "disk" (suite faults): the state directory is a small tmpfs.  A
 * snapshot fits; the disk is then filled: the next snapshot fails with
 * ENOSPC in its Error, leaves no temp file, the previous snapshot still
 * loads with its step and contents, and the client trains on; once space
 * is back, a snapshot succeeds again.  Skipped (77) where tmpfs cannot be
 * mounted (not root).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "snapshot.h"

#define NT 3
static uint64_t numel[NT] = { 1000, 777, 300 };

struct trainer {
	struct aoq_client *c;
	float *param[NT], *grad[NT];
	char job[64];
	uint64_t id, step;
};

static bool no_lease; /* the next trainer_open asks for no lease (no undo copy) */

static void trainer_open(struct trainer *t, const char *sock, const char *job, enum aoq_precision prec)
{
	memset(t, 0, sizeof(*t));
	snprintf(t->job, sizeof(t->job), "%s", job);
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	o.device = "cpu";
	o.job = t->job;
	o.rank = 2;
	o.precision = prec;
	if (no_lease)
		o.lease_seconds = AOQ_LEASE_NONE;
	CHECK_OK(aoq_connect(&t->c, &o));
	struct aoq_group g = AOQ_GROUP_INIT;
	g.kind = AOQ_ADAMW;
	g.lr = 1e-2;
	g.beta1 = 0.9;
	g.beta2 = 0.999;
	g.eps = 1e-8;
	g.weight_decay = 0.01;
	CHECK_OK(aoq_add_group(t->c, &g));
	for (int i = 0; i < NT; i++) {
		t->param[i] = aoqt_xmalloc(numel[i] * 4);
		t->grad[i] = aoqt_xmalloc(numel[i] * 4);
		struct aoqt_rng r = aoqt_rng_for(7, (uint64_t)i, 0);
		for (uint64_t k = 0; k < numel[i]; k++)
			t->param[i][k] = (float)aoqt_uniform(&r);
		struct aoq_tensor d = AOQ_TENSOR_INIT;
		char name[32];
		snprintf(name, sizeof(name), "block.%d.weight", i);
		d.name = name;
		d.numel = numel[i];
		d.param_dtype = AOQ_FP32;
		d.grad_dtype = AOQ_FP32;
		d.param = t->param[i];
		d.grad = t->grad[i];
		CHECK_OK(aoq_add_tensor(t->c, &d));
	}
	CHECK_OK(aoq_register(t->c));
	/* our session: the newest with this job name */
	Aoq__Envelope *env;
	CHECK_OK(aoqt_stats(sock, &env));
	for (size_t i = 0; i < env->stats->n_sessions; i++)
		if (strcmp(env->stats->sessions[i]->job, t->job) == 0 && env->stats->sessions[i]->id > t->id)
			t->id = env->stats->sessions[i]->id;
	aoq_envelope_free(env);
	CHECK(t->id > 0, "session of job %s not in Stats", t->job);
}

static void fill(struct trainer *t, int i)
{
	struct aoqt_rng r = aoqt_rng_for(100 + t->step, (uint64_t)i, 1);
	for (uint64_t k = 0; k < numel[i]; k++)
		t->grad[i][k] = (float)aoqt_uniform(&r);
}

/* One step of every tensor but `skip` (-1: none), backward order. */
static void step_but(struct trainer *t, int skip)
{
	t->step++;
	for (int i = NT - 1; i >= 0; i--) {
		if (i == skip)
			continue;
		fill(t, i);
		CHECK_OK(aoq_push_grad(t->c, (uint32_t)i, 0, NULL));
	}
	CHECK_OK(aoq_step_end(t->c));
	struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
	CHECK_OK(aoq_sync(t->c, &res));
}

static void train(struct trainer *t, int steps)
{
	for (int s = 0; s < steps; s++)
		step_but(t, -1);
}

static _Atomic uint64_t locked;

/* The file equals what libaoq reads back now (state and tensor steps). */
static void check_file(struct trainer *t, const char *path, uint64_t want_step, const char *what)
{
	struct aoqd_state st;
	struct aoqd_snap_key key;
	uint64_t step;
	char why[512];
	int r = aoqd_snapshot_load(path, 0, &locked, &key, &step, &st, why, sizeof(why));
	CHECK(r == 0, "%s: load %s: %s", what, path, why);
	CHECK(step == want_step, "%s: the file is at step %" PRIu64 ", want %" PRIu64, what, step, want_step);
	CHECK(strcmp(key.job, t->job) == 0 && key.rank == 2 && key.uid == (uint32_t)getuid(), "%s: key", what);
	CHECK(st.ntensors == NT, "%s: %u tensors", what, st.ntensors);
	uint64_t steps[NT];
	CHECK_OK(aoq_get_tensor_steps(t->c, 0, NT, steps));
	for (int i = 0; i < NT; i++) {
		struct aoqd_tensor *x = &st.tensors[i];
		CHECK(x->numel == numel[i] && x->steps == steps[i], "%s: tensor %d: numel %" PRIu64 " steps %" PRIu64
		      " (libaoq: %" PRIu64 ")", what, i, x->numel, x->steps, steps[i]);
		float *a = aoqt_xmalloc(numel[i] * 4), *b = aoqt_xmalloc(numel[i] * 4);
		for (int what_k = 0; what_k < 3; what_k++) {
			CHECK_OK(aoq_read_state(t->c, (uint32_t)i, (enum aoq_state_kind)what_k, AOQ_FP32, 0, numel[i], a));
			aoqd_state_io(x, what_k, false, b, 0, numel[i]);
			for (uint64_t k = 0; k < numel[i]; k++)
				CHECK(memcmp(&a[k], &b[k], 4) == 0, "%s: tensor %d kind %d [%" PRIu64 "]: file %.9g, ReadState %.9g",
				      what, i, what_k, k, b[k], a[k]);
		}
		free(a);
		free(b);
	}
	aoqd_state_free(&st, &locked);
}

static void trainer_close(struct trainer *t)
{
	aoq_close(t->c);
	for (int i = 0; i < NT; i++) {
		free(t->param[i]);
		free(t->grad[i]);
	}
}

/* A new trainer of job with one step done and the next one open (a
 * gradient pushed, no StepEnd) asks its first snapshot: the undo swap's
 * spares are touched only in idle time or at the minimum rate, so 100 ms
 * later, with the step still open, they still are.  The request's fd. */
static int snapshot_preparing(struct trainer *t, const char *sock, const char *job)
{
	trainer_open(t, sock, job, AOQ_STATE_FP32);
	train(t, 1);
	CHECK_OK(aoq_push_grad(t->c, 0, 0, NULL));
	CHECK_OK(aoq_sync_param(t->c, 0));
	int fd = aoqt_snapshot_ask(sock, t->id);
	usleep(100000);
	return fd;
}

static int temp_files(const char *dir)
{
	DIR *d = opendir(dir);
	int n = 0;
	struct dirent *e;
	while (d && (e = readdir(d)))
		if (strncmp(e->d_name, ".snapshot-", 10) == 0)
			n++;
	if (d)
		closedir(d);
	return n;
}

static int roundtrip(const char *aoqd)
{
	struct aoqt_daemon d;
	char sd[200];
	char tmpl[] = "/tmp/aoq-snapdir-XXXXXX";
	CHECK(mkdtemp(tmpl), "mkdtemp");
	snprintf(sd, sizeof(sd), "%s", tmpl);
	const char *args[] = { "--threads", "2", "--state-dir", sd, NULL };
	CHECK_OK(aoqt_daemon_start(&d, aoqd, args));
	const enum aoq_precision precs[] = { AOQ_STATE_FP32, AOQ_STATE_BF16, AOQ_STATE_Q8, AOQ_STATE_BF16_ALL,
	                                     AOQ_STATE_Q4,   AOQ_STATE_BF16_Q4 };
	const char *names[] = { "fp32", "bf16", "q8", "bf16_all", "q4", "bf16_q4" };
	char path[4096];
	uint64_t step;
	/* Asked between steps, a capture with a lease waits for the next
	 * step's undo swap, and copies the state once the session stayed idle
	 * for 2-3 s (aoqd_snapshot_tick), where the undo swap can be taken:
	 * each tensor's undo copy on pages of its own (not these tensors'),
	 * and a state of AOQD_SNAPSHOT_SWAP_MIN or more (below). */
	struct trainer tp[6];
	int fds[6];
	for (int p = 0; p < 6; p++) {
		char job[64];
		snprintf(job, sizeof(job), "snap-%s", names[p]);
		trainer_open(&tp[p], d.socket, job, precs[p]);
		train(&tp[p], 4);
	}
	for (int p = 0; p < 6; p++)
		fds[p] = aoqt_snapshot_ask(d.socket, tp[p].id);
	for (int p = 0; p < 6; p++) {
		int r = aoqt_snapshot_wait(fds[p], path, sizeof(path), &step);
		CHECK(r == 0, "%s: snapshot refused: %s", names[p], path);
		CHECK(strncmp(path, sd, strlen(sd)) == 0, "%s: snapshot at %s, not in %s", names[p], path, sd);
		check_file(&tp[p], path, 4, names[p]);
	}
	/* A state under AOQD_SNAPSHOT_SWAP_MIN whose tensors could swap
	 * (their undo copies on pages of their own) is copied at once: an
	 * idle trainer's snapshot is written well within the 2 s the idle
	 * wait takes at least. */
	{
		uint64_t keep[NT];
		memcpy(keep, numel, sizeof(keep));
		numel[0] = 4096;
		numel[1] = 2048;
		numel[2] = 1024;
		struct trainer t;
		trainer_open(&t, d.socket, "snap-small", AOQ_STATE_FP32);
		train(&t, 2);
		double t0 = aoqt_now();
		CHECK(aoqt_snapshot(d.socket, t.id, path, sizeof(path), &step) == 0 && step == 2, "small: %s", path);
		double took = aoqt_now() - t0;
		printf("a small state's snapshot, trainer idle: %.3f s\n", took);
		CHECK(took < 2.0, "a small state's snapshot took %.2f s: it waited for an undo swap", took);
		check_file(&t, path, 2, "small");
		trainer_close(&t);
		memcpy(numel, keep, sizeof(keep));
	}
	{
		struct trainer *t = &tp[0];
		/* mid-step: one gradient of step 5 is in, no StepEnd yet */
		t->step++;
		fill(t, NT - 1);
		CHECK_OK(aoq_push_grad(t->c, NT - 1, 0, NULL));
		CHECK_OK(aoq_sync_param(t->c, NT - 1));
		int fd = aoqt_snapshot_ask(d.socket, t->id);
		for (int i = NT - 2; i >= 0; i--) {
			fill(t, i);
			CHECK_OK(aoq_push_grad(t->c, (uint32_t)i, 0, NULL));
		}
		CHECK_OK(aoq_step_end(t->c));
		struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_sync(t->c, &res));
		CHECK(aoqt_snapshot_wait(fd, path, sizeof(path), &step) == 0, "mid-step snapshot refused: %s", path);
		check_file(t, path, 5, "mid-step");
		/* the next step's updates waited for nothing they need */
		train(t, 3);
		CHECK(aoqt_snapshot(d.socket, t->id, path, sizeof(path), &step) == 0 && step == 8, "after: %s", path);
		check_file(t, path, 8, "after more steps");
	}
	for (int p = 0; p < 6; p++)
		trainer_close(&tp[p]);
	/* Overlap: the snapshot is asked between steps and the trainer goes
	 * on at once.  With a lease (rounds 0-3) the step after the boundary
	 * ends with the undo swap (snapshot.c); in round 3 that step skips
	 * tensor 2, whose state the swap copies from the live state.  Without
	 * (rounds 4-6) the updates meet the block copies (the writer's or the
	 * workers' own, snapshot.h's guard).  The file is the state at the
	 * boundary either way.  Each round is a session of its own, all open
	 * at once: the first snapshots of rounds 0-3 wait side by side. */
	numel[0] = 3u << 20;
	numel[1] = 1u << 20;
	struct trainer tr[7];
	for (int round = 0; round < 7; round++) {
		char job[64];
		snprintf(job, sizeof(job), "snap-overlap-%d", round);
		no_lease = round >= 4;
		trainer_open(&tr[round], d.socket, job, AOQ_STATE_FP32);
		no_lease = false;
		train(&tr[round], 1);
	}
	/* A session's first undo swap touches its spares before the capture
	 * is armed (aoqd_snapshot_prepare); asked while the trainer waits, it
	 * is still the state of the step asked at.  The overlap below is then
	 * the swap with its spares. */
	for (int round = 0; round < 4; round++)
		fds[round] = aoqt_snapshot_ask(d.socket, tr[round].id);
	for (int round = 0; round < 4; round++)
		CHECK(aoqt_snapshot_wait(fds[round], path, sizeof(path), &step) == 0 && step == 1, "first: %s", path);
	for (int round = 0; round < 7; round++) {
		struct trainer t = tr[round];
		train(&t, 1);
		float *want[NT][3];
		for (int i = 0; i < NT; i++)
			for (int k = 0; k < 3; k++) {
				want[i][k] = aoqt_xmalloc(numel[i] * 4);
				CHECK_OK(aoq_read_state(t.c, (uint32_t)i, (enum aoq_state_kind)k, AOQ_FP32, 0, numel[i], want[i][k]));
			}
		int fd = aoqt_snapshot_ask(d.socket, t.id);
		if (round == 3)
			step_but(&t, NT - 1);
		train(&t, 2);
		CHECK(aoqt_snapshot_wait(fd, path, sizeof(path), &step) == 0 && step == 2, "overlap: %s", path);
		struct aoqd_state st;
		struct aoqd_snap_key key;
		char why[512];
		CHECK(aoqd_snapshot_load(path, 0, &locked, &key, &step, &st, why, sizeof(why)) == 0, "overlap: %s", why);
		float *b = aoqt_xmalloc(numel[0] * 4);
		for (int i = 0; i < NT; i++) {
			CHECK(st.tensors[i].steps == 2, "overlap: tensor %d at %" PRIu64 " steps", i, st.tensors[i].steps);
			for (int k = 0; k < 3; k++) {
				aoqd_state_io(&st.tensors[i], k, false, b, 0, numel[i]);
				CHECK(memcmp(b, want[i][k], numel[i] * 4) == 0, "overlap round %d: tensor %d kind %d is not the "
				      "state at the boundary", round, i, k);
				free(want[i][k]);
			}
		}
		free(b);
		aoqd_state_free(&st, &locked);
		trainer_close(&t);
	}
	/* A first snapshot asked between steps while the trainer goes on at
	 * once: the spares are touched first, and the capture takes the step
	 * the session is at when it is armed, which SnapshotDone reports and
	 * the file holds. */
	{
		struct trainer t;
		trainer_open(&t, d.socket, "snap-first", AOQ_STATE_FP32);
		train(&t, 2);
		int fd = aoqt_snapshot_ask(d.socket, t.id);
		train(&t, 6);
		CHECK(aoqt_snapshot_wait(fd, path, sizeof(path), &step) == 0 && step >= 2 && step <= 8, "first, overlap: %s",
		      path);
		struct aoqd_state st;
		struct aoqd_snap_key key;
		char why[512];
		uint64_t fstep;
		CHECK(aoqd_snapshot_load(path, 0, &locked, &key, &fstep, &st, why, sizeof(why)) == 0, "first: %s", why);
		printf("first snapshot, asked at step 2: step %" PRIu64 "\n", step);
		CHECK(fstep == step, "first: the file is of step %" PRIu64 ", SnapshotDone said %" PRIu64, fstep, step);
		for (int i = 0; i < NT; i++)
			CHECK(st.tensors[i].steps == step, "first: tensor %d at %" PRIu64 " steps in a file of step %" PRIu64,
			      i, st.tensors[i].steps, step);
		aoqd_state_free(&st, &locked);
		trainer_close(&t);
	}
	/* A first snapshot whose spares are still being touched when its
	 * trainer goes: a step is open (one gradient pushed, no StepEnd), so
	 * the touching waits for its minimum rate (about 1 s for these 48
	 * MiB), and the trainer closes meanwhile.  The request fails with the
	 * cause; the next trainer of the job trains and snapshots. */
	{
		struct trainer t;
		int fd = snapshot_preparing(&t, d.socket, "snap-gone");
		/* Stats (aoqctl sessions' SNAPSHOT column) says what it does */
		Aoq__Envelope *env;
		CHECK_OK(aoqt_stats(d.socket, &env));
		const char *phase = "?";
		for (size_t k = 0; k < env->stats->n_sessions; k++)
			if (env->stats->sessions[k]->id == t.id)
				phase = env->stats->sessions[k]->snapshot_phase;
		CHECK(strcmp(phase, "preparing") == 0, "Stats: a snapshot whose spares are touched is '%s'", phase);
		aoq_envelope_free(env);
		trainer_close(&t);
		CHECK(aoqt_snapshot_wait(fd, path, sizeof(path), &step) < 0 && strstr(path, "closed before its snapshot began"),
		      "a snapshot whose trainer went during its preparation: %s", path);
		printf("snapshot asked while its spares were touched, trainer gone: %s\n", path);
		trainer_open(&t, d.socket, "snap-gone", AOQ_STATE_FP32);
		train(&t, 2);
		CHECK(aoqt_snapshot(d.socket, t.id, path, sizeof(path), &step) == 0, "after the cancelled one: %s", path);
		check_file(&t, path, step, "after a cancelled preparation");
		trainer_close(&t);
	}
	numel[0] = 1000;
	numel[1] = 777;

	/* a session that is not there */
	CHECK(aoqt_snapshot(d.socket, 999999, path, sizeof(path), &step) < 0 && strstr(path, "no training session"),
	      "snapshot of no session: %s", path);
	CHECK(temp_files(sd) == 0, "temp files left in %s", sd);
	/* aoqd stopped while a first snapshot's spares are touched (a step
	 * open, so the touching waits): it stops cleanly, the request fails. */
	numel[0] = 3u << 20;
	numel[1] = 1u << 20;
	struct trainer ts;
	int sfd = snapshot_preparing(&ts, d.socket, "snap-stop");
	CHECK(aoqt_daemon_stop(&d, 10000, true) == 0, "aoqd did not stop cleanly");
	/* the observer's connection closed with aoqd, or an Error came first */
	Aoq__Envelope *srep = NULL;
	int rr = aoq_recv_frame(sfd, &srep, NULL, 0, NULL);
	CHECK(rr < 0 || (srep && srep->msg_case == AOQ__ENVELOPE__MSG_ERROR),
	      "a snapshot asked before aoqd stopped was answered %d", srep ? (int)srep->msg_case : rr);
	printf("snapshot asked while its spares were touched, aoqd stopped: %s\n",
	       rr < 0 ? strerror(-rr) : srep->error->message);
	if (srep)
		aoq_envelope_free(srep);
	close(sfd);
	trainer_close(&ts);
	char cmd[300];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", sd);
	CHECK(system(cmd) == 0, "rm");
	return 0;
}

static int disk(const char *aoqd)
{
	char tmpl[] = "/tmp/aoq-snapdisk-XXXXXX";
	CHECK(mkdtemp(tmpl), "mkdtemp");
	if (mount("tmpfs", tmpl, "tmpfs", 0, "size=96k,mode=0700") < 0) {
		printf("SKIP: cannot mount a tmpfs (%s); the full-disk test needs root\n", strerror(errno));
		rmdir(tmpl);
		return AOQT_SKIP;
	}
	struct aoqt_daemon d;
	const char *args[] = { "--threads", "1", "--state-dir", tmpl, NULL };
	CHECK_OK(aoqt_daemon_start(&d, aoqd, args));
	struct trainer t;
	trainer_open(&t, d.socket, "snap-disk", AOQ_STATE_FP32);
	train(&t, 2);
	char path[4096], first[4096];
	uint64_t step;
	CHECK(aoqt_snapshot(d.socket, t.id, first, sizeof(first), &step) == 0 && step == 2, "first snapshot: %s", first);
	/* what the file must still hold after the failed snapshot */
	float *m0 = aoqt_xmalloc(numel[0] * 4);
	CHECK_OK(aoq_read_state(t.c, 0, AOQ_MASTER, AOQ_FP32, 0, numel[0], m0));
	/* fill the disk */
	char filler[300];
	snprintf(filler, sizeof(filler), "%s/filler", tmpl);
	int fd = open(filler, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	CHECK(fd >= 0, "filler: %s", strerror(errno));
	char buf[4096] = { 1 };
	while (write(fd, buf, sizeof(buf)) > 0)
		;
	while (write(fd, buf, 1) > 0)
		;
	close(fd);
	train(&t, 2);
	int r = aoqt_snapshot(d.socket, t.id, path, sizeof(path), &step);
	CHECK(r < 0 && strstr(path, "No space left"), "snapshot on a full disk: %d '%s'", r, path);
	CHECK(temp_files(tmpl) == 0, "a temp file was left on the full disk");
	/* the previous snapshot is intact */
	{
		struct aoqd_state st;
		struct aoqd_snap_key key;
		char why[512];
		CHECK(aoqd_snapshot_load(first, 0, &locked, &key, &step, &st, why, sizeof(why)) == 0, "old file: %s", why);
		CHECK(step == 2, "old file at step %" PRIu64, step);
		CHECK(memcmp(st.tensors[0].st.master, m0, numel[0] * 4) == 0, "old file's master changed");
		aoqd_state_free(&st, &locked);
	}
	/* the daemon serves on */
	train(&t, 2);
	unlink(filler);
	CHECK(aoqt_snapshot(d.socket, t.id, path, sizeof(path), &step) == 0 && step == 6, "after freeing space: %s", path);
	check_file(&t, path, 6, "after freeing space");
	trainer_close(&t);
	free(m0);
	CHECK(aoqt_daemon_stop(&d, 10000, true) == 0, "aoqd did not stop cleanly");
	umount(tmpl);
	rmdir(tmpl);
	return 0;
}

/* The file at path, once it holds step `want` (the writer is
 * asynchronous): true within timeout_s. */
static bool wait_file_step(const char *path, uint64_t want, double timeout_s)
{
	double end = aoqt_now() + timeout_s;
	while (aoqt_now() < end) {
		struct aoqd_state st;
		struct aoqd_snap_key key;
		uint64_t step;
		char why[512];
		if (aoqd_snapshot_load(path, 0, &locked, &key, &step, &st, why, sizeof(why)) == 0) {
			aoqd_state_free(&st, &locked);
			if (step == want)
				return true;
			if (getenv("AOQ_TEST_DEBUG"))
				fprintf(stderr, "%s: step %" PRIu64 "\n", path, step);
		} else if (getenv("AOQ_TEST_DEBUG")) {
			fprintf(stderr, "%s\n", why);
		}
		usleep(20000);
	}
	return false;
}

/* Stats says the session's last snapshot is at `want` (the daemon is done
 * with it: a periodic one is never skipped for it). */
static bool wait_stats_step(const char *sock, uint64_t id, uint64_t want, double timeout_s)
{
	double end = aoqt_now() + timeout_s;
	while (aoqt_now() < end) {
		Aoq__Envelope *env;
		CHECK_OK(aoqt_stats(sock, &env));
		bool ok = false;
		for (size_t i = 0; i < env->stats->n_sessions; i++)
			if (env->stats->sessions[i]->id == id)
				ok = env->stats->sessions[i]->snapshot_step == want &&
				     env->stats->sessions[i]->snapshot_unix_ns > 0;
		aoq_envelope_free(env);
		if (ok)
			return true;
		usleep(20000);
	}
	return false;
}

static void write_conf(const char *conf, const char *dir, unsigned every)
{
	FILE *f = fopen(conf, "w");
	CHECK(f, "%s: %s", conf, strerror(errno));
	fprintf(f, "state_dir = %s\nsnapshot_every_steps = %u\n", dir, every);
	fclose(f);
}

/* Mode "periodic": snapshot_every_steps from the config file, and SIGHUP
 * changing both the period and state_dir. */
static int periodic(const char *aoqd)
{
	char base[] = "/tmp/aoq-snapper-XXXXXX";
	CHECK(mkdtemp(base), "mkdtemp");
	char d1[100], d2[100], conf[100], p1[300], p2[300];
	snprintf(d1, sizeof(d1), "%s/a", base);
	snprintf(d2, sizeof(d2), "%s/b", base);
	snprintf(conf, sizeof(conf), "%s/aoqd.conf", base);
	mkdir(d1, 0700);
	mkdir(d2, 0700);
	write_conf(conf, d1, 3);
	struct aoqt_daemon d;
	const char *args[] = { "--threads", "1", "--config", conf, NULL };
	CHECK_OK(aoqt_daemon_start(&d, aoqd, args));
	struct trainer t;
	trainer_open(&t, d.socket, "periodic", AOQ_STATE_FP32);
	struct aoqd_snap_key key = { .uid = (uint32_t)getuid(), .rank = 2 };
	snprintf(key.job, sizeof(key.job), "periodic");
	aoqd_snapshot_path(d1, &key, p1, sizeof(p1));
	aoqd_snapshot_path(d2, &key, p2, sizeof(p2));
	/* a periodic snapshot still being written when the next is due is
	 * skipped: wait for each */
	train(&t, 3);
	CHECK(wait_stats_step(d.socket, t.id, 3, 20), "Stats shows no snapshot of step 3");
	CHECK(wait_file_step(p1, 3, 1), "no periodic snapshot of step 3 in %s", p1);
	train(&t, 3);
	CHECK(wait_file_step(p1, 6, 20), "no periodic snapshot of step 6 in %s", p1);
	check_file(&t, p1, 6, "periodic");
	/* SIGHUP: every 2 steps, into another directory */
	write_conf(conf, d2, 2);
	size_t sz = aoqt_daemon_log_size(&d);
	CHECK(kill(d.pid, SIGHUP) == 0, "kill");
	bool reloaded = false;
	for (int i = 0; i < 100 && !reloaded; i++) {
		aoqt_wait_log_growth(&d, sz, 200);
		char *log = aoqt_daemon_log(&d);
		reloaded = strstr(log, "reload: snapshot_every_steps 3 -> 2") && strstr(log, "reload: state_dir");
		free(log);
	}
	CHECK(reloaded, "SIGHUP did not change snapshot_every_steps and state_dir");
	train(&t, 2);
	CHECK(wait_file_step(p2, 8, 20), "no periodic snapshot of step 8 in %s after SIGHUP", p2);
	check_file(&t, p2, 8, "periodic after SIGHUP");
	CHECK(wait_file_step(p1, 6, 1), "the old directory's file changed");
	trainer_close(&t);
	CHECK(aoqt_daemon_stop(&d, 10000, true) == 0, "aoqd did not stop cleanly");
	char cmd[200];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", base);
	CHECK(system(cmd) == 0, "rm");
	return 0;
}

int main(int argc, char **argv)
{
	aoqt_init("snapshot");
	const char *aoqd = aoqt_aoqd_path(argc, argv);
	const char *mode = argc > 2 ? argv[2] : "roundtrip";
	if (strcmp(mode, "disk") == 0)
		return disk(aoqd);
	if (strcmp(mode, "periodic") == 0)
		return periodic(aoqd);
	return roundtrip(aoqd);
}
