/* SPDX-License-Identifier: MIT */
/*
 * bench-snapshot: the step time a snapshot adds while it is written
 * (docs/snapshots.md; the design's target is under 5 ms per step at 1 G
 * parameters).  Host backend ("cpu"), its own aoqd with --state-dir.
 *
 *   1. --steps N steps without a snapshot: the baseline step time;
 *   2. a SnapshotRequest (as aoqctl snapshot) sent between two steps, the
 *      trainer going on at once; steps until SnapshotDone arrives (at least
 *      N): their step times, the first one after the request (where the
 *      workers copy tensors the writer has not reached) apart;
 *   3. N steps after it;
 *   2 and 3 again for each further --snapshots (default 1): with the undo
 *      swap (a session with a lease, as here) the second snapshot finds the
 *      first one's pages to reuse.
 * Prints the baseline, the steps during the write (mean, median, max), the
 * added time (mean during - mean baseline; and, since the host's step time
 * drifts between windows, against the mean of the no-snapshot windows on
 * both sides of the write, +- two standard errors), the snapshot's seconds and
 * bytes, and the writer's pacing from aoqd's debug log (chunks, time waited
 * for idle workers, chunks the minimum rate forced beside busy ones), and
 * for the first snapshot the touching of the undo swap's spares that came
 * before it (aoqd_snapshot_prepare).
 * Step = every tensor's push (backward order), each parameter landed as
 * its update is answered (aoq_sync_param in the same order), StepEnd,
 * sync.
 *
 * --gap MS sleeps that long before each step's first push: the GPU's forward
 * pass, during which the workers are idle and the writer copies (0: the
 * worst case, every copy on the step path).
 *
 * --probe N (default 1 Mi elements, 0: none) adds a small tensor that each
 * step pushes first and waits for alone before it pushes the rest: its
 * latency is the step's start, the one moment the writer can be caught
 * mid-chunk (it starts chunks only in idle windows).  A step time is
 * hundreds of milliseconds whose spread from the host's memory bandwidth
 * is tens of them; the probe's is about a millisecond, so its difference
 * with and without a snapshot shows in wall-clock time what the writer
 * adds where it can add anything.
 *
 * --alternate K measures the writer's cost against the host's drift: the
 * run's steps go in blocks of K, and blocks alternate between "on" (the
 * writer may use the gap before each step, as always) and "off" (a second,
 * tiny session holds a step open through the gap, so the writer, which
 * writes only while no step is open, waits).  The trainer's own steps are
 * the same in both; only the writer's access to the gaps differs.  Blocks
 * pair up (on, off), then (off, on), and so on, so a linear drift cancels
 * within every two pairs; each window (baseline, while written, after)
 * prints on - off over its whole pairs, +- two standard errors.  Without a
 * snapshot that difference is the method's zero; while one is written it
 * is the writer's cost per step, free of the drift between windows that
 * dominates the whole-window comparison (tests/bench/RESULTS.md,
 * "Snapshots").  A chunk the minimum rate forces (counted in the writer's
 * line) can still land in an off gap.
 *
 *   bench-snapshot [--elems N] [--tensors T] [--steps N] [--threads N] [--gap MS] [--snapshots K]
 *                  [--probe N] [--alternate K] [--precision fp32|q8|bf16_all] [--dir DIR] [--aoqd PATH]
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#ifndef AOQD_PATH
#define AOQD_PATH "aoqd"
#endif

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* The writer's line about the last snapshot in aoqd's log: its chunks, its
 * wait for idle workers and its time beside updates (daemon/snapshot.c,
 * "Pacing"); that time over the steps the write spanned is the writer's
 * exposure per step, a bound measured without the step times' noise. */
static void writer_log(const char *log, int steps, bool first)
{
	FILE *f = fopen(log, "r");
	char line[1024], last[1024] = "", prep[1024] = "";
	while (f && fgets(line, sizeof(line), f)) {
		if (strstr(line, "for idle workers"))
			snprintf(last, sizeof(last), "%s", line);
		if (strstr(line, "spares prepared"))
			snprintf(prep, sizeof(prep), "%s", line);
	}
	if (f)
		fclose(f);
	/* the first snapshot's undo swap: its spares touched before it is armed */
	const char *sp = strstr(prep, "spares prepared");
	if (first && sp)
		printf("before it, %s", sp);
	const char *m = strstr(last, " rank ");
	m = m ? strchr(m, ':') : NULL;
	if (m)
		printf("writer:%s", m + 1);
	const char *o = strstr(last, "overlapped by updates, ");
	double ms;
	if (o && sscanf(o, "overlapped by updates, %lf ms", &ms) == 1 && steps > 0)
		printf("writer time beside updates: %.2f ms per step over the %d steps of the write (target of the "
		       "added step time: < 5 ms)\n", ms / steps, steps);
}

static double median(const double *t, int n)
{
	if (n <= 0)
		return 0;
	double *s = aoqt_xmalloc((size_t)n * sizeof(double));
	memcpy(s, t, (size_t)n * sizeof(double));
	qsort(s, (size_t)n, sizeof(double), cmp_d);
	double m = s[n / 2];
	free(s);
	return m;
}

static void summary(const char *what, double *t, int n)
{
	if (n <= 0)
		return;
	double sum = 0, mx = 0;
	for (int i = 0; i < n; i++) {
		sum += t[i];
		mx = t[i] > mx ? t[i] : mx;
	}
	printf("%-28s steps %3d  mean %8.2f ms  median %8.2f ms  max %8.2f ms\n", what, n, sum / n * 1e3,
	       median(t, n) * 1e3, mx * 1e3);
}

static double mean(const double *t, int n)
{
	double s = 0;
	for (int i = 0; i < n; i++)
		s += t[i];
	return n ? s / n : 0;
}

/* Variance of the mean of t[0..n) (the squared standard error). */
static double var_mean(const double *t, int n)
{
	if (n < 2)
		return 0;
	double m = mean(t, n), ss = 0;
	for (int i = 0; i < n; i++)
		ss += (t[i] - m) * (t[i] - m);
	return ss / (n - 1) / n;
}

/* --alternate: the step's block is on (the writer may use its gap) or off.
 * Blocks pair up as (on, off), (off, on), ...: block b's pair is b / 2. */
static bool block_on(unsigned step, unsigned k)
{
	unsigned b = step / k, pair = b / 2;
	return (b % 2 == 0) == (pair % 2 == 0);
}

/* on - off over the whole pairs of blocks inside steps [lo, hi) of the run
 * (step times t[i] of run step lo + i), +- two standard errors. */
static void alternation(const char *what, const double *t, unsigned lo, unsigned hi, unsigned k)
{
	unsigned first = (lo + 2 * k - 1) / (2 * k); /* the first pair that starts at or after lo */
	double d[4096];
	int n = 0;
	for (unsigned p = first; (p + 1) * 2 * k <= hi && n < 4096; p++) {
		double on = 0, off = 0;
		for (unsigned i = p * 2 * k; i < (p + 1) * 2 * k; i++) {
			if (block_on(i, k))
				on += t[i - lo];
			else
				off += t[i - lo];
		}
		d[n++] = (on - off) / k;
	}
	if (n < 2) {
		printf("alternation, %s: fewer than two whole pairs of %u-step blocks\n", what, k);
		return;
	}
	printf("alternation, %s: writer on - off %+.2f +- %.2f ms per step (2 standard errors, %d pairs of %u-step "
	       "blocks)\n", what, mean(d, n) * 1e3, 2 * sqrt(var_mean(d, n)) * 1e3, n, k);
}

/* The other session of --alternate: holds a step open (one tiny push, no
 * StepEnd yet) through the off blocks. */
static void keeper_set(struct aoq_client *kp, bool *open, bool want)
{
	if (!kp || *open == want)
		return;
	if (want) {
		CHECK_OK(aoq_push_grad(kp, 0, 0, NULL));
	} else {
		CHECK_OK(aoq_step_end(kp));
		CHECK_OK(aoq_sync(kp, NULL));
	}
	*open = want;
}

/* One step (every tensor's push, last first; StepEnd; sync): its seconds.
 * With a probe (tensor index `tensors`), it goes first, alone, and *probe
 * gets the seconds until its parameter is back. */
static double timed_step(struct aoq_client *cl, unsigned tensors, bool with_probe, double *probe)
{
	double t0 = aoqt_now();
	if (with_probe) {
		CHECK_OK(aoq_push_grad(cl, tensors, 0, NULL));
		CHECK_OK(aoq_sync_param(cl, tensors));
		*probe = aoqt_now() - t0;
	}
	for (unsigned i = tensors; i-- > 0;)
		CHECK_OK(aoq_push_grad(cl, i, 0, NULL));
	/* Each parameter lands as its update is answered, in the order they
	 * come, the way a GPU's copy stream takes them during the step: the
	 * host backend otherwise lands every copy in aoq_sync, one memcpy of
	 * the whole model after StepEnded, which no device trainer has. */
	for (unsigned i = tensors; i-- > 0;)
		CHECK_OK(aoq_sync_param(cl, i));
	CHECK_OK(aoq_step_end(cl));
	CHECK_OK(aoq_sync(cl, NULL));
	return aoqt_now() - t0;
}

/* The run's steps in order, for --alternate. */
struct run {
	struct aoq_client *cl, *keeper;
	unsigned tensors, gap_ms, alt;
	bool with_probe, keeper_open;
	unsigned n; /* steps so far */
	double *t;  /* their times */
};

/* The gap (the keeper holding a step open through it in an off block),
 * then one timed step. */
static double run_step(struct run *r, double *probe)
{
	if (r->alt)
		keeper_set(r->keeper, &r->keeper_open, !block_on(r->n, r->alt));
	if (r->gap_ms)
		usleep(r->gap_ms * 1000u);
	double dt = timed_step(r->cl, r->tensors, r->with_probe, probe);
	r->t[r->n++] = dt;
	return dt;
}

int main(int argc, char **argv)
{
	uint64_t elems = 1ull << 27;
	unsigned tensors = 64, steps = 10, threads = 0, gap_ms = 0, nsnap = 1, alt = 0;
	uint64_t probe_elems = 1u << 20;
	const char *aoqd = AOQD_PATH, *dir = NULL, *prec_name = "fp32";
	static const struct option opts[] = {
		{ "elems", required_argument, NULL, 'e' }, { "tensors", required_argument, NULL, 't' },
		{ "steps", required_argument, NULL, 'n' }, { "threads", required_argument, NULL, 'j' },
		{ "precision", required_argument, NULL, 'p' }, { "dir", required_argument, NULL, 'd' },
		{ "aoqd", required_argument, NULL, 'a' }, { "gap", required_argument, NULL, 'g' },
		{ "snapshots", required_argument, NULL, 's' }, { "probe", required_argument, NULL, 'b' },
		{ "alternate", required_argument, NULL, 'k' },
		{ NULL, 0, NULL, 0 },
	};
	int c;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'e': elems = strtoull(optarg, NULL, 0); break;
		case 't': tensors = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'n': steps = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'j': threads = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'p': prec_name = optarg; break;
		case 'd': dir = optarg; break;
		case 'a': aoqd = optarg; break;
		case 'g': gap_ms = (unsigned)strtoul(optarg, NULL, 0); break;
		case 's': nsnap = (unsigned)strtoul(optarg, NULL, 0); break;
		case 'b': probe_elems = strtoull(optarg, NULL, 0); break;
		case 'k': alt = (unsigned)strtoul(optarg, NULL, 0); break;
		default: fprintf(stderr, "usage: see the comment at the top of bench-snapshot.c\n"); return 2;
		}
	}
	enum aoq_precision prec = strcmp(prec_name, "q8") == 0 ? AOQ_STATE_Q8
	                          : strcmp(prec_name, "bf16_all") == 0 ? AOQ_STATE_BF16_ALL : AOQ_STATE_FP32;
	aoqt_init("bench-snapshot");
	char tmpl[] = "/var/tmp/aoq-bench-snap-XXXXXX";
	if (!dir) {
		if (!mkdtemp(tmpl))
			return 1;
		dir = tmpl;
	} else if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
		fprintf(stderr, "bench-snapshot: --dir %s: %s\n", dir, strerror(errno));
		return 1;
	}
	char th[16];
	snprintf(th, sizeof(th), "%u", threads);
	/* debug: the writer logs its pacing per snapshot (writer_log) */
	const char *args[] = { "--state-dir", dir, "--log-level", "debug", threads ? "--threads" : NULL, th, NULL };
	struct aoqt_daemon d;
	CHECK_OK(aoqt_daemon_start(&d, aoqd, args));
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = d.socket;
	o.device = "cpu";
	o.job = "bench-snapshot";
	o.precision = prec;
	struct aoq_client *cl;
	CHECK_OK(aoq_connect(&cl, &o));
	struct aoq_group g = AOQ_GROUP_INIT;
	g.kind = AOQ_ADAMW;
	g.lr = 1e-4;
	g.beta1 = 0.9;
	g.beta2 = 0.999;
	g.eps = 1e-8;
	g.weight_decay = 0.01;
	CHECK_OK(aoq_add_group(cl, &g));
	uint64_t per = elems / tensors;
	bool with_probe = probe_elems > 0;
	for (unsigned i = 0; i < tensors + with_probe; i++) {
		struct aoq_tensor t = AOQ_TENSOR_INIT;
		char name[32];
		snprintf(name, sizeof(name), i < tensors ? "layers.%u.weight" : "probe", i);
		t.name = name;
		t.numel = i < tensors ? per : probe_elems;
		t.param_dtype = AOQ_BF16;
		t.grad_dtype = AOQ_BF16;
		uint16_t *p = aoqt_xmalloc(t.numel * 2), *gr = aoqt_xmalloc(t.numel * 2);
		for (uint64_t k = 0; k < t.numel; k++) {
			p[k] = 0x3f80 ^ (uint16_t)(k & 0x7f);      /* about 1 */
			gr[k] = 0x3c00 ^ (uint16_t)((k * 7) & 0xff); /* about 0.01 */
		}
		t.param = p;
		t.grad = gr;
		CHECK_OK(aoq_add_tensor(cl, &t));
	}
	CHECK_OK(aoq_register(cl));
	Aoq__Envelope *env;
	CHECK_OK(aoqt_stats(d.socket, &env));
	uint64_t id = env->stats->sessions[0]->id, state_bytes = env->stats->sessions[0]->state_bytes;
	aoq_envelope_free(env);
	/* --alternate's keeper: another session of one small tensor */
	struct aoq_client *kp = NULL;
	if (alt) {
		struct aoq_options ko = AOQ_OPTIONS_INIT;
		ko.socket = d.socket;
		ko.device = "cpu";
		ko.job = "bench-snapshot-keeper";
		CHECK_OK(aoq_connect(&kp, &ko));
		CHECK_OK(aoq_add_group(kp, &g));
		static uint16_t kparam[4096], kgrad[4096];
		struct aoq_tensor t = AOQ_TENSOR_INIT;
		t.name = "keeper";
		t.numel = 4096;
		t.param_dtype = AOQ_BF16;
		t.grad_dtype = AOQ_BF16;
		t.param = kparam;
		t.grad = kgrad;
		CHECK_OK(aoq_add_tensor(kp, &t));
		CHECK_OK(aoq_register(kp));
	}
	printf("aoqd %s, %" PRIu64 " parameters in %u tensors (+ a probe of %" PRIu64 "), %s state (%.2f GiB), "
	       "state dir %s, gap %u ms (not in the step times)\n", aoqd, per * tensors, tensors, probe_elems, prec_name,
	       (double)state_bytes / (1u << 30), dir, gap_ms);

	int cap = 10000;
	double *base = aoqt_xmalloc(sizeof(double) * cap), *during = aoqt_xmalloc(sizeof(double) * cap),
	       *after = aoqt_xmalloc(sizeof(double) * cap), *before = aoqt_xmalloc(sizeof(double) * cap);
	/* probe latencies: pb baseline, pd during, pa after; pq the steps
	 * without a snapshot (baseline and after) */
	double *pb = aoqt_xmalloc(sizeof(double) * cap), *pd = aoqt_xmalloc(sizeof(double) * cap),
	       *pa = aoqt_xmalloc(sizeof(double) * cap), *pq = aoqt_xmalloc(sizeof(double) * 2 * cap);
	int nb = 0, nd = 0, na = 0, nbf = 0;
	double first = 0, pt = 0;
	struct run run = { .cl = cl, .keeper = kp, .tensors = tensors, .gap_ms = gap_ms, .alt = alt,
		           .with_probe = with_probe, .t = aoqt_xmalloc(sizeof(double) * (size_t)(cap + 2) * (nsnap + 1)) };
	if (alt)
		printf("alternating blocks of %u steps: the writer may use the gaps of \"on\" blocks only (a second "
		       "session holds a step open through the \"off\" ones)\n", alt);
	for (unsigned s = 0; s < steps + 2; s++) {
		double dt = run_step(&run, &pt);
		if (s >= 2) { /* warm-up */
			pb[nb] = pt;
			base[nb++] = dt;
		}
	}
	memcpy(before, base, sizeof(double) * (size_t)nb);
	nbf = nb;
	if (alt)
		alternation("baseline (no snapshot)", run.t + 2, 2, run.n, alt);
	for (unsigned k = 0; k < nsnap; k++) {
		if (k > 0) { /* the window before this write: the last one's after */
			memcpy(before, after, sizeof(double) * (size_t)na);
			nbf = na;
		}
		nd = na = 0;
		first = 0;
		int fd = aoqt_raw_connect(d.socket);
		uint64_t oid;
		CHECK_OK(aoqt_raw_hello(fd, "aoqctl", 0, true, &oid));
		Aoq__SnapshotRequest q = AOQ__SNAPSHOT_REQUEST__INIT;
		q.session = id;
		double ts = aoqt_now();
		struct timespec wall0, wall1;
		clock_gettime(CLOCK_REALTIME, &wall0);
		CHECK_OK(aoqt_send_msg(fd, AOQ__ENVELOPE__MSG_SNAPSHOT_REQUEST, &q));
		bool done = false;
		double snap_s = 0;
		Aoq__Envelope *rep = NULL;
		unsigned d_lo = run.n, a_lo = 0;
		while (na < (int)steps && nd + na < cap) {
			double dt = run_step(&run, &pt);
			if (!done) {
				if (nd == 0)
					first = dt;
				pd[nd] = pt;
				during[nd++] = dt;
				struct pollfd p = { .fd = fd, .events = POLLIN };
				if (poll(&p, 1, 0) == 1) {
					CHECK(aoq_recv_frame(fd, &rep, NULL, 0, NULL) >= 0, "no SnapshotDone");
					CHECK(rep->msg_case == AOQ__ENVELOPE__MSG_SNAPSHOT_DONE, "snapshot failed: %s",
					      rep->msg_case == AOQ__ENVELOPE__MSG_ERROR ? rep->error->message : "?");
					snap_s = aoqt_now() - ts;
					clock_gettime(CLOCK_REALTIME, &wall1);
					done = true;
					a_lo = run.n;
				}
			} else {
				pa[na] = pt;
				after[na++] = dt;
			}
		}
		CHECK(done, "the snapshot did not finish within %d steps", cap);
		struct stat sb;
		CHECK(stat(rep->snapshot_done->path, &sb) == 0, "stat %s", rep->snapshot_done->path);
		/* wall-clock times, to line the write up with system samples */
		printf("snapshot %u of %u (step %" PRIu64 "; asked at %.3f, on disk at %.3f, CLOCK_REALTIME):\n", k + 1, nsnap,
		       rep->snapshot_done->step, (double)wall0.tv_sec + wall0.tv_nsec / 1e9,
		       (double)wall1.tv_sec + wall1.tv_nsec / 1e9);
		summary("baseline", base, nb);
		summary("while the snapshot is written", during, nd);
		summary("after it", after, na);
		printf("first step after the request %.2f ms (baseline mean %.2f ms)\n", first * 1e3, mean(base, nb) * 1e3);
		printf("added step time while writing: %+.2f ms per step (mean), %+.2f ms excluding the first step\n",
		       (mean(during, nd) - mean(base, nb)) * 1e3,
		       nd > 1 ? (mean(during + 1, nd - 1) - mean(base, nb)) * 1e3 : 0.0);
		/* The host's step time drifts by tens of ms between windows of
		 * the same run, both ways: against the mean of the windows on
		 * both sides the drift over the write cancels to first order.
		 * +- two standard errors of that difference. */
		double side = (mean(before, nbf) + mean(after, na)) / 2;
		double se = sqrt(var_mean(during, nd) + (var_mean(before, nbf) + var_mean(after, na)) / 4);
		printf("added step time while writing, against the windows on both sides (%d and %d steps without a "
		       "snapshot): %+.2f +- %.2f ms per step (2 standard errors)\n",
		       nbf, na, (mean(during, nd) - side) * 1e3, 2 * se * 1e3);
		printf("snapshot: %.3f s request to file on disk, %.2f GiB, %.2f GiB/s, %s\n", snap_s,
		       (double)sb.st_size / (1u << 30), (double)sb.st_size / (1u << 30) / snap_s, rep->snapshot_done->path);
		if (with_probe) {
			summary("probe, baseline", pb, nb);
			summary("probe, while written", pd, nd);
			summary("probe, after it", pa, na);
			memcpy(pq, pb, sizeof(double) * (size_t)nb);
			memcpy(pq + nb, pa, sizeof(double) * (size_t)na);
			printf("probe added while writing (the step's start, wall clock): mean %+.3f ms, median %+.3f ms "
			       "against the %d steps without a snapshot (target of the added step time: < 5 ms)\n",
			       (mean(pd, nd) - mean(pq, nb + na)) * 1e3, (median(pd, nd) - median(pq, nb + na)) * 1e3,
			       nb + na);
		}
		if (alt) {
			/* without the first step after the request (the undo capture's) */
			alternation("while written", run.t + d_lo + 1, d_lo + 1, a_lo, alt);
			alternation("after it (no snapshot)", run.t + a_lo, a_lo, run.n, alt);
		}
		writer_log(d.log, nd, k == 0);
		unlink(rep->snapshot_done->path);
		aoq_envelope_free(rep);
		close(fd);
	}
	if (kp) {
		keeper_set(kp, &run.keeper_open, false);
		aoq_close(kp);
	}
	free(run.t);
	aoq_close(cl);
	aoqt_daemon_stop(&d, 60000, true);
	if (dir == tmpl)
		rmdir(tmpl);
	return 0;
}
