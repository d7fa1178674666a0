/* SPDX-License-Identifier: MIT */
/*
 * Hostile clients against one aoqd while a well-behaved trainer trains.
 *
 * The trainer (a libaoq client in a thread) runs from before the first
 * attack until after the last; each step is checked against the double
 * reference, and at the end its parameters must equal, bit for bit, those
 * of a second session fed the same inputs alone.  The attacks, one after
 * the other from the main thread:
 *   random bytes; a body that does not decode; a 4 GiB (0xffffffff) and a
 *   1 MiB + 1 length prefix; truncated frames then close; messages wrong
 *   in the current state (StepEnd before Hello and before Register,
 *   Register twice, Hello twice, a reply sent as a request, a bad protocol
 *   version); oversized names and impossible registrations; fds attached
 *   to a Hello; ring records with a tensor index out of range, an
 *   offset+count that overflows or runs past the tensor, a wrong step, a
 *   wrong slot, unknown flags, an impossible ring counter; TraceSpans
 *   reports with a span out of range, of a daemon-side kind, in the future
 *   or too many of them; disconnects
 *   mid-step; clients killed with SIGKILL mid-step; 200 connections opened
 *   and closed at once.
 * After each, the daemon must still run, must have closed the offending
 * connection (after an Error where one is possible) and must have logged
 * it.  At the end a new client trains, an observer gets Stats, the daemon
 * holds no leaked fds, and it exits 0 on SIGTERM.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "aoq-version.h"
#include "harness.h"

static struct aoqt_daemon daemon_;
static int log_wait_ms = 10000;

/* ---- the well-behaved trainer ------------------------------------------ */

#define TT 4
static const struct aoqt_tdesc tdesc[TT] = {
	{ 4097, AOQ_FP32, AOQ_FP32, 0 },
	{ 65539, AOQ_BF16, AOQ_BF16, 1 },
	{ 1000, AOQ_FP16, AOQ_FP32, 0 },
	{ 3, AOQ_FP32, AOQ_FP16, 1 },
};

struct trainer {
	const char *job;
	uint64_t steps;          /* run exactly this many, or 0: until stop */
	atomic_bool *stop;       /* with steps == 0 */
	uint64_t min_steps;
	atomic_uint_fast64_t done; /* steps completed */
	pthread_mutex_t lock;    /* with cond: signalled after each step */
	pthread_cond_t cond;
	void *param[TT];
	uint64_t final_steps;
};

static void *trainer_run(void *arg)
{
	struct trainer *tr = arg;
	struct aoqt_victim v;
	aoqt_victim_open(&v, daemon_.socket, tr->job, 0, tdesc, TT, 0x1111, 0x2222, tr->param);
	uint64_t k = 0;
	for (;;) {
		if (tr->steps ? k >= tr->steps : (atomic_load(tr->stop) && k >= tr->min_steps))
			break;
		k++;
		CHECK(k < 100000, "trainer: runaway");
		aoqt_victim_step(&v, k);
		pthread_mutex_lock(&tr->lock);
		atomic_store(&tr->done, k);
		pthread_cond_broadcast(&tr->cond);
		pthread_mutex_unlock(&tr->lock);
	}
	tr->final_steps = k;
	aoqt_victim_close(&v);
	return NULL;
}

/* ---- helpers ------------------------------------------------------------ */

static int connect_raw(void)
{
	int fd = aoqt_raw_connect(daemon_.socket);
	CHECK(fd >= 0, "connect to aoqd: %s", strerror(-fd));
	return fd;
}

static uint64_t hello(int fd, const char *job)
{
	uint64_t id = 0;
	CHECK_OK(aoqt_raw_hello(fd, job, 0, false, &id));
	return id;
}

static void send_raw(int fd, const void *p, size_t n)
{
	const uint8_t *b = p;
	while (n) {
		ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			return; /* the daemon may close while we write: fine */
		b += w;
		n -= (size_t)w;
	}
}

/*
 * The connection must end: an Error frame with code `want` (-1: any code,
 * -2: no Error required) and then EOF.
 */
static void expect_closed(const char *what, int fd, int want)
{
	char msg[256];
	int code = aoqt_raw_expect_close(fd, 20000, msg, sizeof(msg));
	CHECK(code != -2, "%s: the daemon kept the connection open", what);
	CHECK(code != -3, "%s: receive failed", what);
	if (want >= 0)
		CHECK(code == want, "%s: got %s (%d) '%s', want Error %s then EOF", what,
		      code >= 0 ? aoq_error_name(code) : "EOF without Error", code, msg, aoq_error_name(want));
	else if (want == -1)
		CHECK(code >= 0, "%s: EOF without an Error frame", what);
	printf("  %-48s -> %s%s%s\n", what, code >= 0 ? aoq_error_name(code) : "closed", msg[0] ? ": " : "", msg);
	close(fd);
}

static void check_alive(const char *what)
{
	CHECK(aoqt_daemon_alive(&daemon_), "aoqd died after: %s", what);
}

static void check_logged_session(const char *what, uint64_t id)
{
	/* The Hello line plus at least one about what ended the session. */
	CHECK(aoqt_wait_log_session(&daemon_, id, 2, log_wait_ms),
	      "%s: the daemon's log has fewer than 2 lines about session %" PRIu64, what, id);
}

static void check_logged_growth(const char *what, size_t before)
{
	CHECK(aoqt_wait_log_growth(&daemon_, before, log_wait_ms), "%s: the daemon logged nothing", what);
}

static void frame_bytes(Aoq__Envelope *env, uint8_t **buf, size_t *len)
{
	CHECK_OK(aoq_frame_encode(env, buf, len));
}

static void hello_env(Aoq__Envelope *env, Aoq__Hello *h, const char *job)
{
	aoq__hello__init(h);
	h->protocol_version = AOQ_PROTOCOL_VERSION;
	h->arena_version = AOQ_ARENA_VERSION;
	h->job = (char *)job;
	h->device = (char *)"cpu";
	h->pid = (uint32_t)getpid();
	aoq__envelope__init(env);
	env->msg_case = AOQ__ENVELOPE__MSG_HELLO;
	env->hello = h;
}

/* ---- attacks ------------------------------------------------------------ */

static void attack_random_bytes(void)
{
	size_t before = aoqt_daemon_log_size(&daemon_);
	struct aoqt_rng rng = aoqt_rng_for(0xbad, 1, 0);
	uint8_t buf[65536];
	for (size_t i = 0; i < sizeof(buf); i += 8) {
		uint64_t v = aoqt_next(&rng);
		memcpy(buf + i, &v, 8);
	}
	int fd = connect_raw();
	send_raw(fd, buf, sizeof(buf));
	/* With a length prefix under the cap (1 in 4096) the daemon would
	 * rightly wait for the rest: our EOF ends that. */
	shutdown(fd, SHUT_WR);
	expect_closed("random bytes", fd, -2);
	check_alive("random bytes");
	check_logged_growth("random bytes", before);

	/* A frame of a sane length whose body is no protobuf: an 11-byte
	 * varint tag is invalid whatever follows. */
	before = aoqt_daemon_log_size(&daemon_);
	fd = connect_raw();
	uint8_t f[4 + 64];
	f[0] = 64;
	f[1] = f[2] = f[3] = 0;
	memset(f + 4, 0xff, 16);
	memcpy(f + 20, buf, 48);
	send_raw(fd, f, sizeof(f));
	expect_closed("undecodable frame", fd, AOQ__ERROR_CODE__PROTOCOL);
	check_alive("undecodable frame");
	check_logged_growth("undecodable frame", before);

	/* The same after a good Hello. */
	fd = connect_raw();
	uint64_t id = hello(fd, "hostile-garbage");
	send_raw(fd, f, sizeof(f));
	expect_closed("undecodable frame after Hello", fd, AOQ__ERROR_CODE__PROTOCOL);
	check_logged_session("undecodable frame after Hello", id);
}

static void attack_huge_length(void)
{
	static const uint8_t huge[] = { 0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4 };
	size_t before = aoqt_daemon_log_size(&daemon_);
	int fd = connect_raw();
	send_raw(fd, huge, sizeof(huge));
	expect_closed("length prefix 0xffffffff", fd, AOQ__ERROR_CODE__PROTOCOL);
	check_alive("length prefix 0xffffffff");
	check_logged_growth("length prefix 0xffffffff", before);

	fd = connect_raw();
	uint64_t id = hello(fd, "hostile-huge");
	send_raw(fd, huge, sizeof(huge));
	expect_closed("length prefix 0xffffffff after Hello", fd, AOQ__ERROR_CODE__PROTOCOL);
	check_logged_session("length prefix 0xffffffff after Hello", id);

	uint32_t over = AOQ_MAX_FRAME + 1;
	uint8_t p[4] = { over & 0xff, (over >> 8) & 0xff, (over >> 16) & 0xff, over >> 24 };
	fd = connect_raw();
	id = hello(fd, "hostile-over");
	send_raw(fd, p, 4);
	expect_closed("length prefix 1 MiB + 1", fd, AOQ__ERROR_CODE__PROTOCOL);
	check_logged_session("length prefix 1 MiB + 1", id);
	check_alive("length prefix 1 MiB + 1");
}

static void attack_truncated(void)
{
	Aoq__Envelope env;
	Aoq__Hello h;
	uint8_t *buf;
	size_t len;
	hello_env(&env, &h, "hostile-trunc");
	frame_bytes(&env, &buf, &len);

	/* Half a Hello, then close. */
	size_t before = aoqt_daemon_log_size(&daemon_);
	int fd = connect_raw();
	send_raw(fd, buf, len / 2);
	close(fd);
	/* Only the length prefix and one byte. */
	fd = connect_raw();
	send_raw(fd, buf, 5);
	close(fd);
	free(buf);
	check_logged_growth("truncated Hello then close", before);
	check_alive("truncated Hello then close");

	/* Hello, then half a Register, then close. */
	fd = connect_raw();
	uint64_t id = hello(fd, "hostile-trunc2");
	Aoq__Register reg = AOQ__REGISTER__INIT;
	Aoq__Hyperparams hp = AOQ__HYPERPARAMS__INIT;
	hp.lr = 1e-3;
	Aoq__Group g = AOQ__GROUP__INIT, *gp = &g;
	g.hp = &hp;
	Aoq__TensorDesc td = AOQ__TENSOR_DESC__INIT, *tdp = &td;
	td.name = (char *)"x";
	td.numel = 1000;
	reg.n_groups = 1;
	reg.groups = &gp;
	reg.n_tensors = 1;
	reg.tensors = &tdp;
	aoq__envelope__init(&env);
	env.msg_case = AOQ__ENVELOPE__MSG_REGISTER;
	env.register_ = &reg;
	frame_bytes(&env, &buf, &len);
	send_raw(fd, buf, len - 3);
	free(buf);
	close(fd);
	check_logged_session("truncated Register then close", id);
	check_alive("truncated Register then close");
	printf("  %-48s -> closed by us\n", "truncated frames");
}

static void attack_wrong_state(void)
{
	Aoq__StepEnd se = AOQ__STEP_END__INIT;
	se.step = 1;

	size_t before = aoqt_daemon_log_size(&daemon_);
	int fd = connect_raw();
	CHECK_OK(aoqt_send_msg(fd, AOQ__ENVELOPE__MSG_STEP_END, &se));
	expect_closed("StepEnd before Hello", fd, AOQ__ERROR_CODE__PROTOCOL);
	check_logged_growth("StepEnd before Hello", before);

	fd = connect_raw();
	uint64_t id = hello(fd, "hostile-state1");
	CHECK_OK(aoqt_send_msg(fd, AOQ__ENVELOPE__MSG_STEP_END, &se));
	expect_closed("StepEnd before Register", fd, AOQ__ERROR_CODE__PROTOCOL);
	check_logged_session("StepEnd before Register", id);

	fd = connect_raw();
	id = hello(fd, "hostile-state2");
	Aoq__Envelope env;
	Aoq__Hello h;
	hello_env(&env, &h, "again");
	CHECK_OK(aoqt_send_env(fd, &env));
	expect_closed("Hello twice", fd, AOQ__ERROR_CODE__PROTOCOL);
	check_logged_session("Hello twice", id);

	fd = connect_raw();
	id = hello(fd, "hostile-state3");
	Aoq__Welcome w = AOQ__WELCOME__INIT;
	CHECK_OK(aoqt_send_msg(fd, AOQ__ENVELOPE__MSG_WELCOME, &w));
	expect_closed("a Welcome sent to the daemon", fd, AOQ__ERROR_CODE__PROTOCOL);
	check_logged_session("a Welcome sent to the daemon", id);

	before = aoqt_daemon_log_size(&daemon_);
	fd = connect_raw();
	hello_env(&env, &h, "hostile-version");
	h.protocol_version = 99;
	CHECK_OK(aoqt_send_env(fd, &env));
	expect_closed("protocol version 99", fd, AOQ__ERROR_CODE__VERSION);
	check_logged_growth("protocol version 99", before);

	/* A client of another release is refused at Hello, the refusal naming
	 * both sides' protocol and arena versions and the client's version
	 * made printable: an arena version that is not this daemon's (a
	 * trainer's Hello without one too), a protocol before versions were
	 * sent (1), and a version string of control characters. */
	static const struct {
		uint32_t proto, arena;
		const char *version, *want;
		bool observer;
		const char *what;
	} bad[] = {
		{ AOQ_PROTOCOL_VERSION, AOQ_ARENA_VERSION + 1, "9.9.9+hostile", "client 9.9.9+hostile", false,
		  "arena version +1" },
		{ AOQ_PROTOCOL_VERSION, 0, "9.9.9+hostile", "arena 0;", false, "a trainer without an arena version" },
		{ 1, 0, "", "(no version sent)", false, "protocol 1, no versions" },
		{ 1, 0, "", "(no version sent)", true, "an observer of protocol 1" },
		{ 3, AOQ_ARENA_VERSION, "\x1b[2J\x7f" "9", "client ?[2J?9", false, "a version of control characters" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		fd = connect_raw();
		hello_env(&env, &h, "hostile-version");
		h.protocol_version = bad[i].proto;
		h.arena_version = bad[i].arena;
		h.version = (char *)bad[i].version;
		h.observer = bad[i].observer;
		CHECK_OK(aoqt_send_env(fd, &env));
		char msg[512], ours[128], theirs[64];
		int code = aoqt_raw_expect_close(fd, 20000, msg, sizeof(msg));
		close(fd);
		snprintf(ours, sizeof(ours), "aoqd %s speaks protocol %u, arena %u", aoq_full_version(), AOQ_PROTOCOL_VERSION,
		         AOQ_ARENA_VERSION);
		snprintf(theirs, sizeof(theirs), "protocol %u, arena %u", bad[i].proto, bad[i].arena);
		printf("  %-48s -> %s: %s\n", bad[i].what, code >= 0 ? aoq_error_name(code) : "closed", msg);
		CHECK(code == AOQ__ERROR_CODE__VERSION, "%s: got %d '%s', want Error VERSION", bad[i].what, code, msg);
		CHECK(strstr(msg, ours) && strstr(msg, theirs) && strstr(msg, bad[i].want),
		      "%s: the refusal '%s' names '%s', '%s' and '%s'", bad[i].what, msg, ours, theirs, bad[i].want);
		CHECK(!strchr(msg, 0x1b) && !strchr(msg, 0x7f), "%s: a control character in '%s'", bad[i].what, msg);
	}
	check_alive("Hellos of other versions");

	/* Register twice: the second, valid in itself, is wrong now. */
	struct aoqt_raw s;
	uint64_t n1[1] = { 100 };
	CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "hostile-reg2", n1, 1));
	Aoq__Register reg = AOQ__REGISTER__INIT;
	Aoq__Hyperparams hp = AOQ__HYPERPARAMS__INIT;
	hp.lr = 1e-3;
	Aoq__Group g = AOQ__GROUP__INIT, *gp = &g;
	g.hp = &hp;
	Aoq__TensorDesc td = AOQ__TENSOR_DESC__INIT, *tdp = &td;
	td.name = (char *)"x";
	td.numel = 10;
	reg.n_groups = 1;
	reg.groups = &gp;
	reg.n_tensors = 1;
	reg.tensors = &tdp;
	CHECK_OK(aoqt_send_msg(s.sock, AOQ__ENVELOPE__MSG_REGISTER, &reg));
	expect_closed("Register twice", s.sock, AOQ__ERROR_CODE__PROTOCOL);
	s.sock = -1;
	check_logged_session("Register twice", s.id);
	aoqt_raw_close(&s);
	check_alive("wrong-state messages");
}

static void attack_bad_registration(void)
{
	/* A job name filling most of a frame. */
	size_t n = AOQ_MAX_FRAME - 64;
	char *job = aoqt_xmalloc(n + 1);
	memset(job, 'j', n);
	job[n] = 0;
	Aoq__Envelope env;
	Aoq__Hello h;
	hello_env(&env, &h, job);
	size_t before = aoqt_daemon_log_size(&daemon_);
	int fd = connect_raw();
	CHECK_OK(aoqt_send_env(fd, &env));
	expect_closed("Hello with a 1 MiB job name", fd, -1);
	free(job);
	check_logged_growth("Hello with a 1 MiB job name", before);

	/* Impossible tensors: every one must be refused with an Error; the
	 * daemon may keep the connection or not. */
	struct {
		const char *what;
		uint64_t numel;
		uint32_t group;
	} bad[] = {
		{ "Register numel 2^62", 1ull << 62, 0 },
		{ "Register numel UINT64_MAX", UINT64_MAX, 0 },
		{ "Register group index out of range", 10, 7 },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		fd = connect_raw();
		uint64_t id = hello(fd, "hostile-reg");
		Aoq__Register reg = AOQ__REGISTER__INIT;
		/* Valid hyperparameters: the one bad field is the tensor's. */
		Aoq__Hyperparams hp = AOQ__HYPERPARAMS__INIT;
		hp.lr = 1e-3;
		hp.beta1 = 0.9;
		hp.beta2 = 0.999;
		hp.eps = 1e-8;
		Aoq__Group g = AOQ__GROUP__INIT, *gp = &g;
		g.hp = &hp;
		Aoq__TensorDesc td = AOQ__TENSOR_DESC__INIT, *tdp = &td;
		td.name = (char *)"x";
		td.numel = bad[i].numel;
		td.group = bad[i].group;
		reg.n_groups = 1;
		reg.groups = &gp;
		reg.n_tensors = 1;
		reg.tensors = &tdp;
		CHECK_OK(aoqt_send_msg(fd, AOQ__ENVELOPE__MSG_REGISTER, &reg));
		Aoq__Envelope *rep = NULL;
		int fds[AOQ_MAX_FDS], nfds = 0;
		int r = aoq_recv_frame(fd, &rep, fds, AOQ_MAX_FDS, &nfds);
		for (int j = 0; j < nfds; j++)
			close(fds[j]);
		CHECK(r == 0, "%s: no reply (%s)", bad[i].what, strerror(-r));
		CHECK(rep->msg_case == AOQ__ENVELOPE__MSG_ERROR, "%s: reply %d, want Error", bad[i].what,
		      (int)rep->msg_case);
		printf("  %-48s -> %s: %s\n", bad[i].what, aoq_error_name((int)rep->error->code), rep->error->message);
		aoq_envelope_free(rep);
		close(fd);
		check_logged_session(bad[i].what, id);
		check_alive(bad[i].what);
	}
}

static void attack_spoofed_fds(void)
{
	int before_fds = aoqt_count_fds(daemon_.pid);
	for (int round = 0; round < 10; round++) {
		int fd = connect_raw();
		Aoq__Envelope env;
		Aoq__Hello h;
		hello_env(&env, &h, "hostile-fds");
		int extra[AOQ_MAX_FDS];
		for (int i = 0; i < AOQ_MAX_FDS; i++)
			extra[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
		/* aoq_send_frame attaches the fds to the first byte. */
		int r = aoq_send_frame(fd, &env, extra, AOQ_MAX_FDS);
		for (int i = 0; i < AOQ_MAX_FDS; i++)
			close(extra[i]);
		if (r < 0) {
			close(fd);
			continue;
		}
		/* Either refused (Error, close) or the fds ignored (Welcome). */
		Aoq__Envelope *rep = NULL;
		r = aoq_recv_frame(fd, &rep, NULL, 0, NULL);
		if (r == 0 && round == 0)
			printf("  %-48s -> %s\n", "Hello with 4 fds attached",
			       rep->msg_case == AOQ__ENVELOPE__MSG_ERROR ? aoq_error_name((int)rep->error->code)
			                                                 : "accepted, fds ignored");
		aoq_envelope_free(r == 0 ? rep : NULL);
		close(fd);
	}
	/* A round trip, so the daemon has seen the closes. */
	Aoq__Envelope *st = NULL;
	CHECK_OK(aoqt_stats(daemon_.socket, &st));
	aoq_envelope_free(st);
	int after_fds = aoqt_count_fds(daemon_.pid);
	CHECK(after_fds < before_fds + 8, "aoqd holds %d fds after 10 Hellos with 4 fds each, %d before: it keeps "
	      "the fds a client attached", after_fds, before_fds);
	check_alive("fds attached to a Hello");
}

static void bad_record(const char *what, struct aoq_rec rec, int want)
{
	struct aoqt_raw s;
	uint64_t numel[2] = { 4097, 100 };
	CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "hostile-rec", numel, 2));
	CHECK_OK(aoqt_raw_push(&s, &rec));
	expect_closed(what, s.sock, want);
	s.sock = -1;
	check_logged_session(what, s.id);
	aoqt_raw_close(&s);
	check_alive(what);
}

static void attack_records(void)
{
	/* The control: a valid record gets its param record back, so every
	 * failure below is due to the one bad field. */
	struct aoqt_raw s;
	uint64_t numel[2] = { 4097, 100 };
	CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "hostile-rec-ok", numel, 2));
	struct aoq_rec ok = { .tensor = 0, .slot = 0, .offset = 0, .count = 4097, .step = 1, .flags = 0 };
	CHECK_OK(aoqt_raw_push(&s, &ok));
	struct aoq_rec back;
	int r = aoqt_raw_pop(&s, &back, 20000);
	CHECK(r == 1, "valid raw record: no param record came back (%d)", r);
	CHECK(back.tensor == 0 && back.step == 1 && back.status == AOQ_REC_UPDATED && back.offset == 0 &&
	      back.count == 4097,
	      "valid raw record: got {tensor %u, step %" PRIu64 ", status %d, offset %" PRIu64 ", count %" PRIu64 "}",
	      back.tensor, back.step, back.status, back.offset, back.count);
	Aoq__StepEnd se = AOQ__STEP_END__INIT;
	se.step = 1;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep = NULL;
	env.msg_case = AOQ__ENVELOPE__MSG_STEP_END;
	env.step_end = &se;
	CHECK_OK(aoq_call(s.sock, &env, &rep, NULL));
	CHECK(rep->msg_case == AOQ__ENVELOPE__MSG_STEP_ENDED && rep->step_ended->step == 1 &&
	      rep->step_ended->tensors_updated == 1,
	      "raw StepEnd: reply %d", (int)rep->msg_case);
	aoq_envelope_free(rep);
	aoqt_raw_close(&s);
	printf("  %-48s -> updated, StepEnded\n", "valid raw record (control)");

	const int BR = AOQ__ERROR_CODE__BAD_RECORD;
	bad_record("record: tensor index = tensors", (struct aoq_rec){ .tensor = 2, .slot = 2, .count = 1, .step = 1 }, BR);
	bad_record("record: tensor index 0xffffffff",
	           (struct aoq_rec){ .tensor = UINT32_MAX, .slot = UINT32_MAX, .count = 1, .step = 1 }, BR);
	bad_record("record: offset+count overflows",
	           (struct aoq_rec){ .tensor = 0, .offset = UINT64_MAX - 1, .count = 4, .step = 1 }, BR);
	bad_record("record: count overflows",
	           (struct aoq_rec){ .tensor = 0, .offset = 1, .count = UINT64_MAX, .step = 1 }, BR);
	bad_record("record: offset+count past the tensor",
	           (struct aoq_rec){ .tensor = 0, .offset = 4000, .count = 98, .step = 1 }, BR);
	bad_record("record: step 0", (struct aoq_rec){ .tensor = 1, .slot = 1, .count = 100, .step = 0 }, BR);
	bad_record("record: step current+2", (struct aoq_rec){ .tensor = 1, .slot = 1, .count = 100, .step = 3 }, BR);
	bad_record("record: step 2^63", (struct aoq_rec){ .tensor = 1, .slot = 1, .count = 100, .step = 1ull << 63 }, BR);
	bad_record("record: unknown flags",
	           (struct aoq_rec){ .tensor = 1, .slot = 1, .count = 100, .step = 1, .flags = 0x80 }, BR);
	bad_record("record: slot of another tensor", (struct aoq_rec){ .tensor = 0, .slot = 1, .count = 10, .step = 1 }, BR);

	/* An impossible producer counter: head far past what the ring holds. */
	CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "hostile-ring", numel, 2));
	atomic_store(&s.prod.ring->head, (uint64_t)s.hdr.ring_capacity * 3 + 5);
	uint64_t one = 1;
	CHECK(write(s.to_daemon, &one, 8) == 8, "doorbell");
	expect_closed("ring head beyond capacity", s.sock, -1);
	s.sock = -1;
	check_logged_session("ring head beyond capacity", s.id);
	aoqt_raw_close(&s);
	check_alive("ring head beyond capacity");
}

/* The masters memfd (aoq-arena.h, the master as the parameter): a client
 * gets it with a bf16 master and bf16 parameters, and can only read it:
 * a read-only description of a memfd of mode 0400.  Writing through
 * write(2), a writable shared mapping, mprotect, a resize, a punched hole
 * or a seal must all fail; the master the daemon keeps must be unchanged
 * (its update comes back as usual).  Another uid's reopen through /proc
 * is test-shared-node's (requests). */
static void attack_masters(void)
{
	struct aoqt_raw s;
	uint64_t numel[2] = { 4097, 100 };
	CHECK_OK(aoqt_raw_open_bf16(&s, daemon_.socket, "hostile-masters", numel, 2));
	CHECK(s.hdr.masters_size >= 2 * 4096, "masters memfd of %" PRIu64 " bytes", (uint64_t)s.hdr.masters_size);
	const struct aoq_arena_tensor *tt = (const void *)(s.arena + s.hdr.tensor_table_off);
	CHECK(tt[0].master_off == 0 && tt[1].master_off == 3 * 4096, "master offsets %" PRIu64 " %" PRIu64,
	      (uint64_t)tt[0].master_off, (uint64_t)tt[1].master_off);
	size_t len = (size_t)s.hdr.masters_size;
	int fl = fcntl(s.masters_fd, F_GETFL);
	struct stat sb;
	CHECK(fl >= 0 && (fl & O_ACCMODE) == O_RDONLY, "the masters came as a %s description",
	      fl < 0 ? "bad" : (fl & O_ACCMODE) == O_RDWR ? "read-write" : "write-only");
	CHECK(fstat(s.masters_fd, &sb) == 0 && (sb.st_mode & 07777) == 0400, "the masters memfd has mode %o, want 0400",
	      (unsigned)(sb.st_mode & 07777));
	int e[AOQT_MW_N];
	aoqt_masters_write_attempts(s.masters_fd, len, e);
	CHECK(e[AOQT_MW_MAP] == EACCES || e[AOQT_MW_MAP] == EPERM, "a writable shared mapping of the masters: %s",
	      e[AOQT_MW_MAP] ? strerror(e[AOQT_MW_MAP]) : "mapped");
	for (int i = AOQT_MW_WRITE; i < AOQT_MW_N; i++)
		CHECK(e[i] != 0, "the masters memfd allowed %s", aoqt_mw_names[i]);
	const uint16_t *r = mmap(NULL, len, PROT_READ, MAP_SHARED, s.masters_fd, 0);
	CHECK(r != MAP_FAILED, "a read-only mapping of the masters: %s", strerror(errno));
	CHECK(mprotect((void *)r, len, PROT_READ | PROT_WRITE) < 0 && errno == EACCES,
	      "mprotect made the masters writable");
	/* One update: the parameter comes back in the master, not the arena. */
	uint16_t *grad = (uint16_t *)(s.arena + ((const struct aoq_arena_slot *)(s.arena + s.hdr.slot_table_off))[0].grad_off);
	for (int i = 0; i < 4097; i++)
		grad[i] = 0x3f80; /* 1.0 */
	uint16_t before = r[7];
	struct aoq_rec rec = { .tensor = 0, .slot = 0, .offset = 0, .count = 4097, .step = 1 };
	CHECK_OK(aoqt_raw_push(&s, &rec));
	struct aoq_rec back;
	CHECK(aoqt_raw_pop(&s, &back, 20000) == 1 && back.status == AOQ_REC_UPDATED, "masters: no update came back");
	CHECK(r[7] != before, "masters: the update did not reach the shared master (%04x)", r[7]);
	munmap((void *)r, len);
	aoqt_raw_close(&s);
	printf("  %-48s -> refused; updates land\n", "masters memfd: write, map writable, resize, punch, seal");
	check_alive("masters memfd");
}

/* A TraceSpans report that breaks one rule fails its session (INVALID);
 * a valid one is taken without a reply, and the session goes on. */
static void bad_trace_span(const char *what, Aoq__TraceSpan sp, size_t n)
{
	struct aoqt_raw s;
	uint64_t numel[2] = { 4097, 100 };
	CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "hostile-trace", numel, 2));
	Aoq__TraceSpan **spp = aoqt_xcalloc(n, sizeof(*spp));
	for (size_t i = 0; i < n; i++)
		spp[i] = &sp;
	Aoq__TraceSpans m = AOQ__TRACE_SPANS__INIT;
	m.n_spans = n;
	m.spans = spp;
	CHECK_OK(aoqt_send_msg(s.sock, AOQ__ENVELOPE__MSG_TRACE_SPANS, &m));
	free(spp);
	expect_closed(what, s.sock, AOQ__ERROR_CODE__INVALID);
	s.sock = -1;
	check_logged_session(what, s.id);
	aoqt_raw_close(&s);
	check_alive(what);
}

/* LoadState's `at` (the byte in the transfer area its data starts at):
 * a value not a multiple of 64, or one that puts the data past the area,
 * fails the session (INVALID); a good one loads from there. */
static void bad_transfer_at(const char *what, uint64_t at, uint64_t count)
{
	struct aoqt_raw s;
	uint64_t numel[2] = { 4097, 100 };
	CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "hostile-xfer-at", numel, 2));
	Aoq__LoadState m = AOQ__LOAD_STATE__INIT;
	m.tensor = 0;
	m.what = AOQ__STATE_KIND__PARAM;
	m.dtype = AOQ__DTYPE__FP32;
	m.offset = 0;
	m.count = count;
	/* UINT64_MAX: the first multiple of 64 from which count values pass the area's end */
	m.at = at == UINT64_MAX ? ((s.hdr.xfer_bytes - count * 4) / 64 + 1) * 64 : at;
	CHECK_OK(aoqt_send_msg(s.sock, AOQ__ENVELOPE__MSG_LOAD_STATE, &m));
	expect_closed(what, s.sock, AOQ__ERROR_CODE__INVALID);
	s.sock = -1;
	check_logged_session(what, s.id);
	aoqt_raw_close(&s);
	check_alive(what);
}

static void attack_transfer_at(void)
{
	/* the control: 100 values loaded from byte 128 of the area, read back
	 * from byte 64 */
	struct aoqt_raw s;
	uint64_t numel[2] = { 4097, 100 };
	CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "hostile-xfer-at-ok", numel, 2));
	float *area = (float *)(void *)(s.arena + s.hdr.xfer_off);
	for (int i = 0; i < 100; i++)
		area[32 + i] = 0.25f * (float)i;
	Aoq__LoadState l = AOQ__LOAD_STATE__INIT;
	l.tensor = 1;
	l.what = AOQ__STATE_KIND__PARAM;
	l.dtype = AOQ__DTYPE__FP32;
	l.count = 100;
	l.at = 128;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep = NULL;
	env.msg_case = AOQ__ENVELOPE__MSG_LOAD_STATE;
	env.load_state = &l;
	CHECK_OK(aoq_call(s.sock, &env, &rep, NULL));
	CHECK(rep->msg_case == AOQ__ENVELOPE__MSG_DONE, "LoadState at byte 128: reply %d", (int)rep->msg_case);
	aoq_envelope_free(rep);
	Aoq__ReadState rd = AOQ__READ_STATE__INIT;
	rd.tensor = 1;
	rd.what = AOQ__STATE_KIND__MASTER;
	rd.dtype = AOQ__DTYPE__FP32;
	rd.count = 100;
	rd.at = 64;
	env.msg_case = AOQ__ENVELOPE__MSG_READ_STATE;
	env.read_state = &rd;
	CHECK_OK(aoq_call(s.sock, &env, &rep, NULL));
	CHECK(rep->msg_case == AOQ__ENVELOPE__MSG_DONE, "ReadState at byte 64: reply %d", (int)rep->msg_case);
	aoq_envelope_free(rep);
	for (int i = 0; i < 100; i++)
		CHECK(area[16 + i] == 0.25f * (float)i, "value %d read back at byte 64: %g", i, (double)area[16 + i]);
	aoqt_raw_close(&s);
	bad_transfer_at("LoadState: at not a multiple of 64", 32, 100);
	bad_transfer_at("LoadState: at puts the data past the area", UINT64_MAX, 100);
	bad_transfer_at("LoadState: at past the area", 1ull << 62, 1);
	printf("  %-48s -> loaded and read back where asked\n", "LoadState/ReadState at bytes 128 and 64");
}

static void attack_trace_spans(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	uint64_t now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
	Aoq__TraceSpan ok = AOQ__TRACE_SPAN__INIT;
	ok.step = 1;
	ok.tensor = 1;
	ok.kind = AOQ__TRACE_SPAN_KIND__SPAN_D2H;
	ok.start_ns = now - 1000;
	ok.duration_ns = 500;
	ok.offset = 0;
	ok.count = 100;
	/* The control: valid spans, no reply, the session still answers. */
	struct aoqt_raw s;
	uint64_t numel[2] = { 4097, 100 };
	CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "hostile-trace-ok", numel, 2));
	Aoq__TraceSpan *okp[2] = { &ok, &ok };
	Aoq__TraceSpans m = AOQ__TRACE_SPANS__INIT;
	m.n_spans = 2;
	m.spans = okp;
	CHECK_OK(aoqt_send_msg(s.sock, AOQ__ENVELOPE__MSG_TRACE_SPANS, &m));
	Aoq__TensorSteps q = AOQ__TENSOR_STEPS__INIT;
	q.first = 0;
	q.count = 2;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep = NULL;
	env.msg_case = AOQ__ENVELOPE__MSG_TENSOR_STEPS;
	env.tensor_steps = &q;
	CHECK_OK(aoq_call(s.sock, &env, &rep, NULL));
	CHECK(rep->msg_case == AOQ__ENVELOPE__MSG_TENSOR_STEPS, "valid TraceSpans: the next request got %d",
	      (int)rep->msg_case);
	aoq_envelope_free(rep);
	aoqt_raw_close(&s);

	Aoq__TraceSpan x = ok;
	x.tensor = 2;
	bad_trace_span("TraceSpans: tensor out of range", x, 1);
	x = ok;
	x.count = 101;
	bad_trace_span("TraceSpans: range past the tensor", x, 1);
	x = ok;
	x.offset = UINT64_MAX - 10;
	x.count = 20;
	bad_trace_span("TraceSpans: offset + count overflows", x, 1);
	x = ok;
	x.kind = AOQ__TRACE_SPAN_KIND__SPAN_CPU_UPDATE;
	bad_trace_span("TraceSpans: a daemon-side kind", x, 1);
	x = ok;
	x.start_ns = now + 60000000000ull;
	bad_trace_span("TraceSpans: a span in the future", x, 1);
	x = ok;
	x.duration_ns = UINT64_MAX;
	bad_trace_span("TraceSpans: start + duration overflows", x, 1);
	bad_trace_span("TraceSpans: too many spans", ok, AOQ_TRACE_SPANS_MAX + 1);
}

static void attack_disconnect_mid_step(void)
{
	for (int variant = 0; variant < 3; variant++) {
		struct aoqt_raw s;
		uint64_t numel[2] = { (1u << 20) + 13, 4097 };
		CHECK_OK(aoqt_raw_open(&s, daemon_.socket, "hostile-gone", numel, 2));
		struct aoq_rec rec = { .tensor = 0, .slot = 0, .count = numel[0], .step = 1 };
		CHECK_OK(aoqt_raw_push(&s, &rec));
		if (variant == 1) {
			rec = (struct aoq_rec){ .tensor = 1, .slot = 1, .count = numel[1], .step = 1 };
			CHECK_OK(aoqt_raw_push(&s, &rec));
			Aoq__StepEnd se = AOQ__STEP_END__INIT;
			se.step = 1;
			CHECK_OK(aoqt_send_msg(s.sock, AOQ__ENVELOPE__MSG_STEP_END, &se));
		}
		if (variant == 2) {
			/* Unmap and go, leaving the fds open a moment longer. */
			munmap(s.arena, s.arena_size);
			s.arena = NULL;
			shutdown(s.sock, SHUT_RDWR);
		}
		uint64_t id = s.id;
		aoqt_raw_close(&s);
		check_logged_session("disconnect mid-step", id);
		check_alive("disconnect mid-step");
	}
	printf("  %-48s -> closed by us (3 ways)\n", "disconnect mid-step");
}

/* The child of attack_kill9: trains forever, one byte on stdout per push. */
static int kill9_child(const char *sock)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = sock;
	char job[48];
	snprintf(job, sizeof(job), "hostile-kill9-%d", (int)getpid());
	o.job = job;
	o.device = "cpu";
	struct aoq_client *c = NULL;
	if (aoq_connect(&c, &o) < 0)
		return 1;
	struct aoq_group g = { .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	if (aoq_add_group(c, &g) < 0)
		return 1;
	uint64_t n[2] = { (1u << 20) + 13, 4097 };
	void *p[2], *gr[2];
	for (int t = 0; t < 2; t++) {
		p[t] = calloc(n[t], 4);
		gr[t] = calloc(n[t], 4);
		if (!p[t] || !gr[t])
			return 1;
		struct aoq_tensor td = { .size = sizeof(struct aoq_tensor), .name = t ? "k1" : "k0", .numel = n[t], .param = p[t], .grad = gr[t] };
		if (aoq_add_tensor(c, &td) < 0)
			return 1;
	}
	if (aoq_register(c) < 0)
		return 1;
	for (;;) {
		for (uint32_t t = 0; t < 2; t++) {
			if (aoq_push_grad(c, t, 0, NULL) < 0)
				return 1;
			if (write(STDOUT_FILENO, "k", 1) != 1)
				return 1;
		}
		if (aoq_step_end(c) < 0 || aoq_sync(c, NULL) < 0)
			return 1;
	}
}

static void attack_kill9(void)
{
	for (int round = 0; round < 3; round++) {
		size_t before = aoqt_daemon_log_size(&daemon_);
		int pfd[2];
		CHECK(pipe2(pfd, O_CLOEXEC) == 0, "pipe2");
		char self[4096];
		ssize_t sl = readlink("/proc/self/exe", self, sizeof(self) - 1);
		CHECK(sl > 0, "readlink /proc/self/exe");
		self[sl] = 0;
		char *const argv[] = { self, (char *)"--kill9-child", daemon_.socket, NULL };
		pid_t pid = fork();
		CHECK(pid >= 0, "fork");
		if (pid == 0) {
			dup2(pfd[1], STDOUT_FILENO);
			execv(self, argv);
			_exit(127);
		}
		close(pfd[1]);
		/* Kill after 1, 2 or 5 pushes: mid-step, at different points. */
		int want = round == 0 ? 1 : round == 1 ? 2 : 5, got = 0;
		while (got < want) {
			struct pollfd pf = { .fd = pfd[0], .events = POLLIN };
			CHECK(poll(&pf, 1, 30000) == 1, "kill -9 child: no push within 30 s");
			char b[8];
			ssize_t r = read(pfd[0], b, (size_t)(want - got) < sizeof(b) ? (size_t)(want - got) : sizeof(b));
			CHECK(r > 0, "kill -9 child exited before pushing (%zd)", r);
			got += (int)r;
		}
		kill(pid, SIGKILL);
		int st;
		waitpid(pid, &st, 0);
		close(pfd[0]);
		CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "kill -9 child ended otherwise (status 0x%x)", st);
		check_logged_growth("kill -9 mid-step", before);
		check_alive("kill -9 mid-step");
	}
	printf("  %-48s -> killed 3 times\n", "kill -9 mid-step");
}

static void attack_connection_flood(void)
{
	Aoq__Envelope env;
	Aoq__Hello h;
	uint8_t *buf;
	size_t len;
	hello_env(&env, &h, "hostile-flood");
	frame_bytes(&env, &buf, &len);
	int base = aoqt_count_fds(daemon_.pid);
	double t0 = aoqt_now();
	for (int i = 0; i < 200; i++) {
		int fd = aoq_socket_connect(daemon_.socket);
		CHECK(fd >= 0, "connection %d of 200: %s", i, strerror(-fd));
		if (i % 3 == 1)
			send_raw(fd, buf, len / 2);
		else if (i % 3 == 2)
			send_raw(fd, buf, len);
		close(fd);
	}
	free(buf);
	double dt = aoqt_now() - t0;
	/* Round trips until the daemon has closed its ends (bounded). */
	int now = -1;
	for (int i = 0; i < 500; i++) {
		Aoq__Envelope *st = NULL;
		/* QUOTA while the daemon still counts the closed connections
		 * against our uid's cap (max_connections_per_uid); a refusal at
		 * accept may close the socket before the request is written
		 * (EPIPE, ECONNRESET). */
		int r = aoqt_stats(daemon_.socket, &st);
		if (r != -EDQUOT && r != -EPIPE && r != -ECONNRESET)
			CHECK_OK(r);
		aoq_envelope_free(r == 0 ? st : NULL);
		now = aoqt_count_fds(daemon_.pid);
		if (now <= base + 4)
			break;
	}
	CHECK(now <= base + 4, "aoqd holds %d fds after 200 closed connections, %d before", now, base);
	check_alive("200 connections");
	printf("  %-48s -> ok (%.0f ms; daemon fds %d -> %d)\n", "200 connections opened and closed", dt * 1e3, base,
	       now);
}

int main(int argc, char **argv)
{
	if (argc > 2 && strcmp(argv[1], "--kill9-child") == 0)
		return kill9_child(argv[2]);
	aoqt_init("hostile");
	const char *exe = aoqt_aoqd_path(argc, argv);
	if (getenv("AOQ_TEST_SLOW"))
		log_wait_ms = 60000;
	static const char *const args[] = { "--threads", "2", NULL };
	CHECK_OK(aoqt_daemon_start(&daemon_, exe, args));
	int fds0 = -1;

	atomic_bool stop = false;
	char job[48];
	snprintf(job, sizeof(job), "hostile-trainer-%d", (int)getpid());
	struct trainer tr = { .job = job, .stop = &stop, .min_steps = 10, .lock = PTHREAD_MUTEX_INITIALIZER,
	                      .cond = PTHREAD_COND_INITIALIZER };
	pthread_t th;
	CHECK(pthread_create(&th, NULL, trainer_run, &tr) == 0, "pthread_create");
	/* Start the attacks once the trainer is mid-training. */
	pthread_mutex_lock(&tr.lock);
	while (atomic_load(&tr.done) < 2)
		pthread_cond_wait(&tr.cond, &tr.lock);
	pthread_mutex_unlock(&tr.lock);
	fds0 = aoqt_count_fds(daemon_.pid);
	uint64_t steps_before = atomic_load(&tr.done);
	printf("attacks (trainer at step %" PRIu64 "):\n", steps_before);
	attack_random_bytes();
	attack_huge_length();
	attack_truncated();
	attack_wrong_state();
	attack_bad_registration();
	attack_spoofed_fds();
	attack_records();
	attack_masters();
	attack_transfer_at();
	attack_trace_spans();
	attack_disconnect_mid_step();
	attack_kill9();
	attack_connection_flood();
	uint64_t steps_after = atomic_load(&tr.done);
	tr.min_steps = steps_after + 3;
	atomic_store(&stop, true);
	pthread_join(th, NULL);
	printf("trainer: %" PRIu64 " steps, %" PRIu64 " of them during the attacks\n", tr.final_steps,
	       steps_after - steps_before);
	CHECK(steps_after > steps_before, "the trainer made no progress during the attacks");

	/* A new client after all that: the same inputs alone, bit-exact. */
	char job2[48];
	snprintf(job2, sizeof(job2), "hostile-solo-%d", (int)getpid());
	struct trainer solo = { .job = job2, .steps = tr.final_steps, .lock = PTHREAD_MUTEX_INITIALIZER,
	                        .cond = PTHREAD_COND_INITIALIZER };
	trainer_run(&solo);
	for (int t = 0; t < TT; t++) {
		size_t bytes = tdesc[t].n * aoqt_dtype_size(tdesc[t].pd);
		CHECK(memcmp(tr.param[t], solo.param[t], bytes) == 0,
		      "tensor %d: the trainer under attack and the same run alone differ after %" PRIu64 " steps", t,
		      tr.final_steps);
	}
	printf("trainer under attack == trainer alone, bit for bit, after %" PRIu64 " steps\n", tr.final_steps);

	/* An observer still gets Stats, listing a session opened now. */
	struct aoqt_raw last;
	uint64_t last_n[2] = { 4097, 3 };
	char job3[48];
	snprintf(job3, sizeof(job3), "hostile-last-%d", (int)getpid());
	CHECK_OK(aoqt_raw_open(&last, daemon_.socket, job3, last_n, 2));
	Aoq__Envelope *st = NULL;
	CHECK_OK(aoqt_stats(daemon_.socket, &st));
	CHECK(st->stats->threads == 2, "stats: %u threads, want 2", st->stats->threads);
	bool listed = false;
	for (size_t i = 0; i < st->stats->n_sessions; i++) {
		Aoq__SessionStats *ss = st->stats->sessions[i];
		if (strcmp(ss->job, job3) != 0)
			continue;
		listed = true;
		CHECK(ss->id == last.id && ss->tensors == 2 && ss->parameters == 4100 && ss->pid == (uint32_t)getpid(),
		      "stats of the last session: id %" PRIu64 " tensors %u parameters %" PRIu64 " pid %u", ss->id,
		      ss->tensors, ss->parameters, ss->pid);
	}
	CHECK(listed, "stats: the session opened last is not listed (%zu sessions)", st->stats->n_sessions);
	aoqt_raw_close(&last);
	printf("stats: %u threads, kernel %s, %zu sessions listed, rss %" PRIu64 " MiB\n", st->stats->threads,
	       st->stats->kernel, st->stats->n_sessions, st->stats->rss_bytes >> 20);
	aoq_envelope_free(st);

	int fds1 = aoqt_count_fds(daemon_.pid);
	printf("daemon fds: %d mid-training before the attacks, %d after\n", fds0, fds1);

	int rc = aoqt_daemon_stop(&daemon_, 30000, true);
	CHECK(rc == 0, "aoqd exit status %d after SIGTERM, want 0", rc);
	for (int t = 0; t < TT; t++) {
		free(tr.param[t]);
		free(solo.param[t]);
	}
	printf("ok\n");
	return 0;
}
