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
 * Each session's state lives in a memfd that the store holds from its
 * registration to its end.
 *
 *   term: SIGTERM mid-step; the state comes back from the store, mapped in
 *         place (the stored memfd's header is cleared and the trained
 *         state is read in the memfd the supervisor holds: no copy), with
 *         four hostile fds beside it (unsealed, damaged descriptor, cut
 *         short, a pipe), each refused with its reason and removed from
 *         the store (with q8, a masters memfd without a state too); no
 *         snapshot exists to read.
 *   kill: SIGKILL mid-step, with periodic snapshots; the state's memfd is
 *         in the store with its journal, which the restart replays: the
 *         trainer resumes at step 5 bit for bit, no snapshot read.
 *   nostore: the same kill under a supervisor that keeps no fd (a unit
 *         without FileDescriptorStoreMax=): the restart falls back to the
 *         periodic snapshots, as without systemd.
 *   oldmasters (with q8): term, with the stored masters memfd replaced by
 *         a copy sealed F_SEAL_FUTURE_WRITE, as an older aoqd stored them:
 *         it cannot be trained in place, so it is copied into a new one
 *         (the log says so) and the trainer resumes bit for bit.
 *   nomasters (with q8): SIGTERM mid-step with periodic snapshots, and the
 *         supervisor loses the stored masters memfd before the restart:
 *         the stop left the masters there (none in the state's memfd), so
 *         the state is refused, never taken with zeros for masters, and
 *         the trainer resumes from its snapshot.
 *
 *   flood: the supervisor itself: a sender stores more fds, one datagram
 *         each, than the notify socket queues (net.unix.max_dgram_qlen,
 *         10 where systemd did not raise it, or the sender's send buffer)
 *         while the test reads none,
 *         as aoqd does storing the masters memfds of a session of more
 *         than 640 MiB of them inside a Register; every send must return
 *         (a supervisor that drained the socket only when the test asked
 *         left aoqd's loop and the trainer waiting for each other) and the
 *         store must hold every fd, in order.
 *
 *   unit-term, unit-kill: the same job against the real aoqd.service and
 *         aoqd.socket under systemd (tests/ops/unit-ns.sh runs this inside
 *         a namespace whose PID 1 is systemd; $AOQ_SOCKET and $AOQ_UNIT_LOG
 *         name the socket and aoqd's output): `systemctl restart
 *         aoqd.service`, or `systemctl kill --signal=SIGKILL` and the
 *         unit's Restart=on-failure, mid-step.  systemd's store must hold
 *         the job's fds (NFileDescriptorStore) and give them back: the
 *         state is taken back (the journal replayed after the kill), no
 *         snapshot read, the trainer resumes at step 5 bit for bit, and
 *         the store is empty once every trainer said Bye.
 *
 *   release (with q8): a trainer without a lease under the store releases
 *         its last tensor after two steps (ReleaseTensors): the tensor's
 *         slot in the stored memfd is punched (the memfd's blocks fall by
 *         at least the bytes released), the other three train on, and its
 *         Bye takes the memfd out of the store.
 *
 * A third argument "q8" (or "q4") trains q8 (q4) state instead of fp32
 * (the default, or "fp32"): the bf16 tensor's master is then split
 * (kernels/README.md, "The split master"), its high half the parameter in
 * a masters memfd, which the store keeps beside the state's from the
 * registration on (aoq-masters-<n>-0): left there at a stop as after a kill
 * (the journal's stop mark says so), sealed against resizing but not
 * against writes, of mode 0400, and taken back at the restart as it is:
 * the same memfd (its inode) holds the trained master at the end, no copy
 * made.  "q8m24" is q8 with the 24-bit master (master_bits 24: the low
 * halves 8 bits).
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
#include "supervisor.h"

#define NT 4
#define STEPS 10
#define KILL_AT 6 /* the step in progress when aoqd goes */
static const uint64_t sizes[NT] = { 1000, 4097, 33, 70001 };
static const enum aoq_dtype pdt[NT] = { AOQ_FP32, AOQ_FP32, AOQ_BF16, AOQ_FP32 };
static enum aoq_precision precision = AOQ_STATE_FP32;
static uint32_t master_bits; /* 24: "q8m24" */
static uint32_t lease_opt;   /* the trainer's lease_seconds (0: the daemon's) */

/* q8 and q4 state split their fp32 masters: the high halves are the
 * parameters, in a masters memfd of their own */
static bool split_master(void)
{
	return precision == AOQ_STATE_Q8 || precision == AOQ_STATE_Q4;
}

/* The stored fds whose names start with prefix; *at: the last one's index. */
static int stored(const struct sup *s, const char *prefix, int *at)
{
	int n = 0;
	for (int i = 0; i < s->nstored; i++)
		if (strncmp(s->stored_name[i], prefix, strlen(prefix)) == 0) {
			n++;
			if (at)
				*at = i;
		}
	return n;
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
	o.precision = precision;
	o.master_bits = master_bits;
	o.lease_seconds = lease_opt;
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

static void image_free(struct image *im)
{
	for (int i = 0; i < NT; i++)
		for (int k = 0; k < 4; k++) {
			free(im->v[i][k]);
			im->v[i][k] = NULL;
		}
}

static void trainer_close(struct trainer *t)
{
	if (t->c)
		aoq_close(t->c);
	t->c = NULL;
}

static void trainer_free(struct trainer *t)
{
	trainer_close(t);
	for (int i = 0; i < NT; i++) {
		free(t->param[i]);
		free(t->grad[i]);
		t->param[i] = t->grad[i] = NULL;
	}
}

/* A trained split master (the bf16 tensor's) keeps 16 low bits, or 8
 * with master_bits 24: its values read as fp32 have their low 8 bits zero
 * then, and not all of them their low 16. */
static void check_master_bits(const struct image *im)
{
	for (int i = 0; i < NT; i++) {
		if (pdt[i] != AOQ_BF16 || !split_master())
			continue;
		size_t low8 = 0, low16 = 0;
		for (uint64_t e = 0; e < sizes[i]; e++) {
			uint32_t b;
			memcpy(&b, &im->v[i][1][e], 4);
			low8 += (b & 0xffu) != 0;
			low16 += (b & 0xffffu) != 0;
		}
		CHECK(low16 > 0, "tensor %d: the master keeps no low bits", i);
		CHECK(master_bits == 24 ? low8 == 0 : low8 > 0, "tensor %d: %zu of %" PRIu64 " masters with low 8 bits "
		      "(master_bits %u)", i, low8, sizes[i], master_bits);
	}
}

/* The undisturbed run of the job, and its image after every step. */
static void undisturbed(const char *sock, struct image at[STEPS + 1])
{
	struct trainer ref = { 0 };
	CHECK(trainer_open(&ref, sock, "undisturbed", true) == 0, "a fresh job resumed");
	for (uint64_t k = 1; k <= STEPS; k++) {
		CHECK_OK(trainer_step(&ref, k, false));
		image_take(&ref, &at[k]);
	}
	check_master_bits(&at[STEPS]);
	/* Stats report the session's master bits (aoqctl's "q8-bf24") */
	Aoq__Envelope *e = NULL;
	CHECK_OK(aoqt_stats(sock, &e));
	bool seen = false;
	for (size_t i = 0; i < e->stats->n_sessions; i++)
		if (strcmp(e->stats->sessions[i]->job, "undisturbed") == 0) {
			seen = true;
			CHECK(e->stats->sessions[i]->master_bits == (master_bits ? master_bits : 32),
			      "stats: master_bits %u, registered %u", e->stats->sessions[i]->master_bits, master_bits);
		}
	CHECK(seen, "stats: no session of job 'undisturbed'");
	aoq_envelope_free(e);
	trainer_free(&ref);
}

/* The trainer meets its daemon gone in the rest of the open step, and
 * lets go of its session. */
static void gone(struct trainer *run)
{
	int r = aoq_push_grad(run->c, 2, 0, NULL);
	if (r >= 0)
		r = aoq_step_end(run->c);
	if (r >= 0)
		r = aoq_sync(run->c, NULL);
	CHECK(r < 0, "a step went through a dead daemon");
	trainer_close(run);
}

/* The resumed job: bit for bit the undisturbed run's at its resumed step,
 * then trained to the end and so again. */
static void finish(struct trainer *run, uint64_t resumed, struct image at[STEPS + 1])
{
	struct image now;
	image_take(run, &now);
	image_same(&now, &at[resumed], "at the resume");
	image_free(&now);
	for (uint64_t k = resumed + 1; k <= STEPS; k++)
		CHECK_OK(trainer_step(run, k, false));
	image_take(run, &now);
	image_same(&now, &at[STEPS], "at the end");
	image_free(&now);
}

/* ---- hostile fds beside the real ones ---- */

static int sealed_copy(int src, off_t cut, off_t flip, bool seal)
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
	CHECK(!seal || fcntl(fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) == 0, "seal");
	return fd;
}

/* ---- the real unit ---- */

/* `systemctl ARGS` (the test runs in the namespace of unit-ns.sh's systemd). */
static void systemctl(const char *args)
{
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "systemctl --no-pager %s", args);
	int r = system(cmd);
	CHECK(r == 0, "'%s' exited %d", cmd, r);
}

/* How many fds systemd's store holds for aoqd.service. */
static int unit_stored(void)
{
	FILE *p = popen("systemctl show --property=NFileDescriptorStore --value aoqd.service", "r");
	CHECK(p, "popen: %s", strerror(errno));
	int n = -1;
	if (fscanf(p, "%d", &n) != 1)
		n = -1;
	pclose(p);
	CHECK(n >= 0, "systemctl show NFileDescriptorStore: no count");
	return n;
}

/* aoqd's output from byte `from` of the unit's log (a static buffer). */
static const char *unit_log(const char *path, long from)
{
	static char buf[1 << 16];
	FILE *f = fopen(path, "re");
	CHECK(f, "%s: %s", path, strerror(errno));
	fseek(f, from, SEEK_SET);
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = '\0';
	fclose(f);
	return buf;
}

static long unit_log_size(const char *path)
{
	struct stat st;
	return stat(path, &st) == 0 ? (long)st.st_size : 0;
}

static int unit_main(const char *mode)
{
	const char *sock = getenv("AOQ_SOCKET"), *logp = getenv("AOQ_UNIT_LOG");
	CHECK(sock && logp, "%s runs under tests/ops/unit-ns.sh ($AOQ_SOCKET and $AOQ_UNIT_LOG)", mode);
	bool term = strcmp(mode, "unit-term") == 0;
	CHECK(term || strcmp(mode, "unit-kill") == 0, "mode '%s': unit-term or unit-kill", mode);
	int nmasters = split_master() ? 1 : 0;

	static struct image at[STEPS + 1];
	undisturbed(sock, at);

	struct trainer run = { 0 };
	CHECK(trainer_open(&run, sock, "restarted", true) == 0, "a fresh job resumed");
	for (uint64_t k = 1; k < KILL_AT; k++)
		CHECK_OK(trainer_step(&run, k, false));
	int held = unit_stored();
	CHECK(held == 1 + nmasters, "systemd's store holds %d fd(s) while the job trains, want %d", held, 1 + nmasters);
	CHECK_OK(trainer_step(&run, KILL_AT, true));
	long before = unit_log_size(logp);
	if (term) {
		systemctl("restart aoqd.service"); /* returns once the new aoqd sent READY=1 */
	} else {
		systemctl("kill --signal=SIGKILL aoqd.service");
		/* Restart=on-failure starts it again (RestartSec= 100 ms) */
		bool back = false;
		for (int i = 0; i < 300 && !back; i++) {
			usleep(100000);
			back = strstr(unit_log(logp, before), "taken back from the fd store") != NULL;
		}
		CHECK(back, "aoqd did not take the state back within 30 s of the kill:\n%s", unit_log(logp, before));
	}
	gone(&run);

	uint64_t resumed = trainer_open(&run, sock, "restarted", false);
	const char *log = unit_log(logp, before);
	printf("--- aoqd's output from the %s on ---\n%s---\n", term ? "restart" : "kill", log);
	if (term)
		CHECK(strstr(log, "kept in the fd store"), "no 'kept in the fd store' at the stop");
	else
		CHECK(strstr(log, "journal replayed"), "the killed aoqd's journal was not replayed");
	CHECK(strstr(log, "taken back from the fd store") && strstr(log, "mapped in place"),
	      "the stored state was not taken back in place");
	CHECK(!strstr(log, "refused") && !strstr(log, "from its snapshot") && !strstr(log, "restored uid"),
	      "a refusal or a snapshot read");
	CHECK(resumed == KILL_AT - 1, "resumed at step %" PRIu64 ", want %d", resumed, KILL_AT - 1);
	finish(&run, resumed, at);
	held = unit_stored();
	CHECK(held == 1 + nmasters, "systemd's store holds %d fd(s) after the restart, want %d", held, 1 + nmasters);
	trainer_free(&run);
	for (int k = 0; k <= STEPS; k++)
		image_free(&at[k]);
	/* the Bye took the state out of the store */
	for (int i = 0; i < 50 && (held = unit_stored()) != 0; i++)
		usleep(100000);
	CHECK(held == 0, "systemd's store holds %d fd(s) after every trainer said Bye", held);
	printf("ok: %s%s, resumed at step %" PRIu64 ", bit-exact after %d steps\n", mode,
	       !nmasters ? "" : precision == AOQ_STATE_Q4 ? " q4" : master_bits ? " q8 (24-bit master)" : " q8", resumed,
	       STEPS);
	return 0;
}

/* flood (above): FLOOD datagrams of FDSTORE=1 with a memfd each, from a
 * socket whose send buffer holds a few unread ones (its datagrams count
 * against it until they are read), so that the sender blocks at a few
 * unread datagrams whatever net.unix.max_dgram_qlen is. */
#define FLOOD 48 /* < SUP_RING */
static int flood_main(void)
{
	struct sup s;
	sup_init(&s, false, NULL);
	pid_t pid = fork();
	CHECK(pid >= 0, "fork: %s", strerror(errno));
	if (pid == 0) {
		int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
		int small = 1; /* the kernel's least */
		setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
		struct sockaddr_un sa = { .sun_family = AF_UNIX };
		snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", s.notify);
		for (int i = 0; i < FLOOD; i++) {
			char msg[64];
			int n = snprintf(msg, sizeof(msg), "FDSTORE=1\nFDNAME=flood-%d", i);
			int mfd = memfd_create("flood", MFD_CLOEXEC);
			union {
				char buf[CMSG_SPACE(sizeof(int))];
				struct cmsghdr align;
			} cm;
			struct iovec iov = { msg, (size_t)n };
			struct msghdr mh = { .msg_name = &sa, .msg_namelen = sizeof(sa), .msg_iov = &iov, .msg_iovlen = 1,
					     .msg_control = cm.buf, .msg_controllen = sizeof(cm.buf) };
			struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
			c->cmsg_level = SOL_SOCKET;
			c->cmsg_type = SCM_RIGHTS;
			c->cmsg_len = CMSG_LEN(sizeof(int));
			memcpy(CMSG_DATA(c), &mfd, sizeof(int));
			if (fd < 0 || mfd < 0 || sendmsg(fd, &mh, 0) != n) /* blocks while the queue is full */
				_exit(1);
			close(mfd);
		}
		_exit(0);
	}
	int st = 0;
	pid_t w = 0;
	for (int t = 0; t < 300 && w == 0; t++) { /* reads nothing meanwhile */
		w = waitpid(pid, &st, WNOHANG);
		if (w == 0)
			usleep(20000);
	}
	if (w == 0) {
		kill(pid, SIGKILL);
		waitpid(pid, &st, 0);
	}
	CHECK(w == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0,
	      "the sender of %d FDSTORE datagrams did not finish within 6 s (status %#x): the notify socket is not drained",
	      FLOOD, st);
	while (sup_recv(&s, 0))
		;
	CHECK(s.nstored == FLOOD, "%d fds stored of %d sent", s.nstored, FLOOD);
	for (int i = 0; i < FLOOD; i++) {
		char want[32];
		snprintf(want, sizeof(want), "flood-%d", i);
		CHECK(strcmp(s.stored_name[i], want) == 0, "stored fd %d is '%s', want '%s'", i, s.stored_name[i], want);
	}
	printf("ok: flood, %d fds stored in order while the test read none\n", FLOOD);
	return 0;
}

/* release: a session without a lease gives its last tensor's state back;
 * its slot of the stored memfd goes back to the system. */
static int release_main(const char *exe)
{
	struct sup s;
	sup_init(&s, false, NULL);
	sup_start(&s, exe, NULL, NULL, 0);
	lease_opt = AOQ_LEASE_NONE;
	struct trainer run = { 0 };
	CHECK(trainer_open(&run, s.sock, "released", true) == 0, "a fresh job resumed");
	for (uint64_t k = 1; k <= 2; k++)
		CHECK_OK(trainer_step(&run, k, false));
	while (sup_recv(&s, 200))
		;
	int si = 0;
	CHECK(stored(&s, "aoq-state-", &si) == 1, "%d state memfds in the store", stored(&s, "aoq-state-", NULL));
	struct stat st0, st1;
	CHECK(fstat(s.stored_fd[si], &st0) == 0, "fstat: %s", strerror(errno));
	const uint32_t last = NT - 1;
	uint64_t bytes = 0;
	CHECK_OK(aoq_release_tensors(run.c, &last, 1, &bytes));
	CHECK(fstat(s.stored_fd[si], &st1) == 0, "fstat: %s", strerror(errno));
	uint64_t fell = (uint64_t)(st0.st_blocks - st1.st_blocks) * 512;
	printf("released tensor %u: %" PRIu64 " bytes; the stored memfd's blocks fell %" PRIu64 " bytes (%" PRIu64
	       " -> %" PRIu64 ")\n", last, bytes, fell, (uint64_t)st0.st_blocks * 512, (uint64_t)st1.st_blocks * 512);
	CHECK(bytes >= sizes[last] * 6 && st1.st_blocks < st0.st_blocks && fell >= bytes,
	      "released %" PRIu64 " bytes, the memfd fell %" PRIu64, bytes, fell);
	for (uint64_t k = 3; k <= 4; k++) {
		for (uint32_t g = 0; g < 2; g++) {
			struct aoq_group h = group(g, k);
			CHECK_OK(aoq_set_hyperparams(run.c, g, &h));
		}
		for (int i = 0; i < NT - 1; i++) {
			fill_grad(&run, i, k);
			CHECK_OK(aoq_push_grad(run.c, (uint32_t)i, 0, NULL));
		}
		struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_step_end(run.c));
		CHECK_OK(aoq_sync(run.c, &res));
		CHECK(res.step == k && res.tensors_updated == NT - 1, "step %" PRIu64 ": %" PRIu64 " tensors updated", k,
		      res.tensors_updated);
	}
	trainer_close(&run);
	trainer_free(&run);
	for (int w = 0; w < 50 && stored(&s, "aoq-state-", NULL) > 0; w++)
		sup_recv(&s, 100);
	CHECK(stored(&s, "aoq-state-", NULL) == 0, "the state memfd stayed in the store after Bye");
	sup_kill(&s, SIGTERM);
	printf("ok\n");
	return 0;
}

int main(int argc, char **argv)
{
	aoqt_init("integration-fdstore");
	const char *exe = aoqt_aoqd_path(argc, argv);
	const char *mode = argc > 2 ? argv[2] : "term";
	if (argc > 3 && strcmp(argv[3], "q8m24") == 0)
		precision = AOQ_STATE_Q8, master_bits = 24;
	else if (argc > 3 && strcmp(argv[3], "q8") == 0)
		precision = AOQ_STATE_Q8;
	else if (argc > 3 && strcmp(argv[3], "q4") == 0)
		precision = AOQ_STATE_Q4;
	else if (argc > 3)
		CHECK(strcmp(argv[3], "fp32") == 0, "precision '%s': fp32, q8, q8m24 or q4", argv[3]);
	signal(SIGPIPE, SIG_IGN);
	if (strncmp(mode, "unit-", 5) == 0)
		return unit_main(mode);
	if (strcmp(mode, "flood") == 0)
		return flood_main();
	if (strcmp(mode, "release") == 0)
		return release_main(exe);
	bool nomasters = strcmp(mode, "nomasters") == 0, oldmasters = strcmp(mode, "oldmasters") == 0;
	bool term = strcmp(mode, "term") == 0 || oldmasters, nostore = strcmp(mode, "nostore") == 0;
	bool sigterm = term || nomasters, snapshots = !term, from_snapshot = nostore || nomasters;
	CHECK(term || nostore || nomasters || strcmp(mode, "kill") == 0,
	      "mode '%s': term, kill, nostore, nomasters or oldmasters", mode);
	CHECK((!nomasters && !oldmasters) || split_master(), "%s needs q8 or q4 (a master that is a parameter)",
	      mode);

	struct sup s;
	sup_init(&s, snapshots, NULL);
	s.nostore = nostore;
	sup_start(&s, exe, NULL, NULL, 0);
	/* under the store aoqd says at start when shmem gets no huge pages
	 * (the host's setting: never and deny refuse them) */
	char thp[128] = "";
	FILE *tf = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "re");
	if (tf) {
		if (!fgets(thp, sizeof(thp), tf))
			thp[0] = '\0';
		fclose(tf);
	}
	bool huge_off = strstr(thp, "[never]") || strstr(thp, "[deny]");
	CHECK(count(sup_log(&s), "run on 4 KiB pages") == (huge_off ? 1 : 0),
	      "shmem_enabled '%s': aoqd's start says %d time(s) that its memfds run on 4 KiB pages", thp,
	      count(sup_log(&s), "run on 4 KiB pages"));

	static struct image at[STEPS + 1];
	undisturbed(s.sock, at);

	/* The same job, with aoqd going mid-step. */
	struct trainer run = { 0 };
	CHECK(trainer_open(&run, s.sock, "restarted", true) == 0, "a fresh job resumed");
	int ino = inotify_init1(IN_CLOEXEC);
	CHECK(ino >= 0 && inotify_add_watch(ino, s.state, IN_MOVED_TO) >= 0, "inotify: %s", strerror(errno));
	for (uint64_t k = 1; k < KILL_AT; k++) {
		CHECK_OK(trainer_step(&run, k, false));
		if (snapshots && k == 2) {
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
	sup_kill(&s, sigterm ? SIGTERM : SIGKILL);
	const char *log = sup_log(&s) + before;
	printf("--- aoqd's log from the kill on ---\n%s---\n", log);
	/* The undisturbed job said Bye: its memfd left the store.  The other
	 * one's is there, with its header (written at registration). */
	char stored_name[256] = "";
	/* q8: the bf16 tensor's master is its parameter, in a masters memfd
	 * the store keeps beside the state's */
	int nmasters = split_master() ? 1 : 0, si = 0;
	if (nostore) {
		CHECK(s.nstored == 0, "%d states kept by a supervisor that keeps none", s.nstored);
	} else {
		CHECK(stored(&s, "aoq-state-", &si) == 1 && stored(&s, "aoq-masters-", NULL) == nmasters &&
		      s.nstored == 1 + nmasters, "%d fds in the store after %s, want the job's state and %d masters memfd(s)",
		      s.nstored, term ? "SIGTERM" : "SIGKILL", nmasters);
		snprintf(stored_name, sizeof(stored_name), "%s", s.stored_name[si]);
		uint8_t magic[8];
		CHECK(pread(s.stored_fd[si], magic, 8, 0) == 8 && memcmp(magic, "AOQFDST3", 8) == 0,
		      "no stored-form header after %s", sigterm ? "SIGTERM" : "SIGKILL");
		/* the journal's stop mark (daemon/state.h, struct aoqd_journal):
		 * 0 after a kill; after a stop 1, or 2 when the masters that are
		 * parameters stayed in their stored memfds (none copied) */
		uint32_t mark = 9;
		CHECK(pread(s.stored_fd[si], &mark, 4, 4096 + 24) == 4, "pread");
		uint32_t want = !sigterm ? 0 : nmasters ? 2 : 1;
		CHECK(mark == want, "stop mark %u after %s, want %u", mark, sigterm ? "SIGTERM" : "SIGKILL", want);
	}
	if (term)
		CHECK(strstr(log, "kept in the fd store"), "no 'kept in the fd store' in the log");
	/* the stored masters memfd: resizing sealed, writes not (the next
	 * aoqd trains it in place), readable by aoqd's uid alone */
	ino_t masters_ino = 0;
	int mi = -1;
	if (nmasters && !nostore) {
		CHECK(stored(&s, "aoq-masters-", &mi) == 1, "no stored masters memfd");
		struct stat sb;
		int seals = fcntl(s.stored_fd[mi], F_GET_SEALS);
		CHECK(fstat(s.stored_fd[mi], &sb) == 0 && (sb.st_mode & 07777) == 0400, "stored masters of mode %o",
		      (unsigned)(sb.st_mode & 07777));
		CHECK(seals == (F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL), "stored masters sealed %#x", (unsigned)seals);
		masters_ino = sb.st_ino;
	}
	if (oldmasters) {
		/* as an older aoqd stored them: sealed against writes too */
		int old = sealed_copy(s.stored_fd[mi], 0, -1, false);
		CHECK(fcntl(old, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) == 0,
		      "seal: %s", strerror(errno));
		close(s.stored_fd[mi]);
		s.stored_fd[mi] = old;
	}
	/* The trainer sees its daemon gone. */
	gone(&run);

	int extra[6] = { -1, -1, -1, -1, -1, -1 };
	/* q8: a masters memfd without a state (removed) */
	const char *const extra_names[6] = { "aoq-state-900001", "aoq-state-900002", "aoq-state-900003",
	                                     "aoq-state-900004", "aoq-masters-900009-0" };
	int nextra = 0, pipefd[2] = { -1, -1 };
	if (term) {
		extra[0] = sealed_copy(s.stored_fd[si], 0, -1, false); /* unsealed */
		uint64_t doff;
		CHECK(pread(s.stored_fd[si], &doff, 8, 32) == 8, "pread");
		extra[1] = sealed_copy(s.stored_fd[si], 0, (off_t)doff + 100, true); /* a descriptor byte flipped */
		extra[2] = sealed_copy(s.stored_fd[si], 4096, -1, true); /* cut short */
		CHECK(pipe2(pipefd, O_CLOEXEC) == 0, "pipe");
		extra[3] = pipefd[0];
		nextra = 4;
		for (int i = 0; i < nmasters; i++) {
			extra[nextra] = memfd_create("hostile-masters", MFD_CLOEXEC);
			CHECK(extra[nextra] >= 0 && ftruncate(extra[nextra], 4096) == 0, "memfd: %s", strerror(errno));
			nextra++;
		}
	}
	if (nomasters) {
		/* the stored masters memfd lost (a store that was full, say) */
		int k = 0;
		for (int i = 0; i < s.nstored; i++) {
			if (strncmp(s.stored_name[i], "aoq-masters-", 12) == 0) {
				close(s.stored_fd[i]);
				continue;
			}
			s.stored_fd[k] = s.stored_fd[i];
			memcpy(s.stored_name[k], s.stored_name[i], sizeof(s.stored_name[k]));
			k++;
		}
		CHECK(s.nstored - k == nmasters, "%d masters memfds dropped, want %d", s.nstored - k, nmasters);
		s.nstored = k;
	}
	int removes = s.removes;
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
		const char *reasons[4] = { "not sealed against growth and shrinking", "checksum mismatch", "not the",
		                           "not a memfd of the stored form" };
		for (int i = 0; i < 4; i++)
			CHECK(strstr(log, reasons[i]), "no '%s' among the refusals:\n%s", reasons[i], log);
		CHECK(strstr(log, "taken back from the fd store"), "the stored state was not taken back:\n%s", log);
		CHECK(strstr(log, "mapped in place"), "the stored state was not mapped in place:\n%s", log);
		if (nmasters)
			CHECK(strstr(log, oldmasters ? "its masters: 0 stored memfd(s) in place, 1 copied"
			                             : "its masters: 1 stored memfd(s) in place, 0 copied"),
			      "the stored masters were not %s:\n%s", oldmasters ? "copied" : "taken in place", log);
		/* the hostile fds left the store; the state's memfd stays, now the
		 * live state's, its header cleared */
		if (nmasters)
			CHECK(strstr(log, "aoq-masters-900009-0 without their state"), "the stray masters memfd stayed:\n%s",
			      log);
		CHECK(s.removes - removes == nextra + nmasters && s.nstored == 1 + nmasters &&
		      stored(&s, "aoq-state-", &si) == 1 && strcmp(s.stored_name[si], stored_name) == 0,
		      "%d FDSTOREREMOVE for %d hostile fds and %d old masters; %d left", s.removes - removes, nextra,
		      nmasters, s.nstored);
		CHECK(!strstr(log, "from its snapshot") && !strstr(log, "restored uid"), "a snapshot was read:\n%s", log);
	} else if (!from_snapshot) {
		/* the killed aoqd's state: its journal replayed, mapped in place */
		CHECK(strstr(log, "journal replayed") && strstr(log, "taken back from the fd store"),
		      "the killed aoqd's state was not taken back:\n%s", log);
		CHECK(!nmasters || strstr(log, "its masters: 1 stored memfd(s) in place, 0 copied"),
		      "the stored masters were not taken in place:\n%s", log);
		CHECK(!strstr(log, "refused"), "a refusal:\n%s", log);
		CHECK(s.removes - removes == nmasters && s.nstored == 1 + nmasters && stored(&s, "aoq-state-", &si) == 1 &&
		      strcmp(s.stored_name[si], stored_name) == 0, "%d FDSTOREREMOVE (the old masters: %d); %d stored",
		      s.removes - removes, nmasters, s.nstored);
		CHECK(!strstr(log, "from its snapshot") && !strstr(log, "restored uid"), "a snapshot was read:\n%s", log);
	} else if (nomasters) {
		CHECK(strstr(log, "written at a stop that left its masters in their memfds, and its masters that are "
		                  "parameters did not come back from the store"),
		      "the state without its masters was not refused for it:\n%s", log);
		CHECK(!strstr(log, "taken back from the fd store"), "the state was taken back without its masters:\n%s",
		      log);
		CHECK(strstr(log, "from its snapshot"), "no snapshot restored:\n%s", log);
	} else {
		CHECK(strstr(log, "from its snapshot"), "no snapshot restored after SIGKILL:\n%s", log);
	}

	/* The trainer comes back and resumes at its last completed step. */
	uint64_t resumed = trainer_open(&run, s.sock, "restarted", false);
	if (!from_snapshot)
		CHECK(resumed == KILL_AT - 1, "resumed at step %" PRIu64 ", want %d", resumed, KILL_AT - 1);
	else
		CHECK(resumed >= 1 && resumed < KILL_AT, "resumed at step %" PRIu64 " from the snapshots", resumed);
	finish(&run, resumed, at);
	if (!from_snapshot) {
		/* No copy: the state trained since the restart is the stored
		 * memfd's (tensor 0's fp32 master heads the first slot, at the
		 * data's offset). */
		size_t mb = sizes[0] * sizeof(float);
		float *m = aoqt_xcalloc(sizes[0], sizeof(float));
		uint64_t data_off = 0;
		CHECK(stored(&s, "aoq-state-", &si) == 1, "the state left the store");
		CHECK(pread(s.stored_fd[si], &data_off, 8, 16) == 8, "pread");
		CHECK(pread(s.stored_fd[si], m, mb, (off_t)data_off) == (ssize_t)mb, "pread");
		CHECK(memcmp(m, at[STEPS].v[0][1], mb) == 0, "the live state is not the stored memfd's");
		free(m);
		if (nmasters) {
			/* the bf16 tensor's parameter, the masters' first bytes:
			 * trained in the stored memfd itself, unless it had to
			 * be copied (oldmasters) */
			struct stat sb;
			uint16_t p[64];
			size_t pb = sizes[2] * 2;
			CHECK(stored(&s, "aoq-masters-", &mi) == 1 && fstat(s.stored_fd[mi], &sb) == 0, "no stored masters");
			CHECK((sb.st_ino == masters_ino) == !oldmasters, "the stored masters memfd is %s one",
			      sb.st_ino == masters_ino ? "the old" : "a new");
			CHECK(pb <= sizeof(p) && pread(s.stored_fd[mi], p, pb, 0) == (ssize_t)pb, "pread");
			CHECK(memcmp(p, at[STEPS].v[2][0], pb) == 0, "the live masters are not the stored memfd's");
		}
	}
	trainer_free(&run);
	for (int k = 0; k <= STEPS; k++)
		image_free(&at[k]);

	/* Every session ended with a Bye: the next stop stores nothing. */
	sup_kill(&s, SIGTERM);
	CHECK(s.nstored == 0, "%d states stored after every trainer said Bye", s.nstored);
	printf("ok: %s%s, resumed at step %" PRIu64 ", bit-exact after %d steps\n", mode,
	       !split_master() ? "" : precision == AOQ_STATE_Q4 ? " q4" : master_bits ? " q8 (24-bit master)" : " q8", resumed, STEPS);
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s.dir);
	if (system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", s.dir);
	return 0;
}
