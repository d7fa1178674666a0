/* SPDX-License-Identifier: MIT */
/*
 * Frames (proto/wire.h): encode/decode round trips, the 1 MiB cap on both
 * sides (exactly 1 MiB passes, one byte more fails), length prefixes up to
 * 0xffffffff, truncated and undecodable frames, empty envelopes, frames
 * arriving a byte at a time, fds passed with a frame (and too many fds:
 * refused with none leaked), aoq_call's Error mapping.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <dirent.h>
#include <unistd.h>

#include "wire.h"

#include "expect.h"

static int count_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	int n = 0;
	struct dirent *e;
	while (d && (e = readdir(d)))
		if (e->d_name[0] != '.')
			n++;
	if (d)
		closedir(d);
	return n - 1;
}

static void pair(int sv[2])
{
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		abort();
}

static void write_all(int fd, const void *p, size_t n)
{
	const uint8_t *b = p;
	while (n) {
		ssize_t w = write(fd, b, n);
		if (w <= 0)
			return;
		b += w;
		n -= (size_t)w;
	}
}

static void test_round_trip(void)
{
	Aoq__Hyperparams hp[2] = { AOQ__HYPERPARAMS__INIT, AOQ__HYPERPARAMS__INIT };
	hp[0].lr = 1e-3;
	hp[0].beta1 = 0.9;
	hp[0].beta2 = 0.999;
	hp[0].eps = 1e-8;
	hp[0].weight_decay = 0.01;
	hp[1].lr = 3.5;
	Aoq__Group g[2] = { AOQ__GROUP__INIT, AOQ__GROUP__INIT }, *gp[2] = { &g[0], &g[1] };
	g[0].kind = AOQ__OPTIMIZER_KIND__ADAMW;
	g[0].hp = &hp[0];
	g[1].kind = AOQ__OPTIMIZER_KIND__ADAM;
	g[1].hp = &hp[1];
	Aoq__TensorDesc t[3], *tp[3];
	static char *names[3] = { "layer.0.weight", "", "x" };
	for (int i = 0; i < 3; i++) {
		aoq__tensor_desc__init(&t[i]);
		t[i].name = names[i];
		t[i].numel = (uint64_t)1 << (20 * i);
		t[i].param_dtype = (Aoq__DType)i;
		t[i].grad_dtype = (Aoq__DType)(2 - i);
		t[i].group = (uint32_t)i % 2;
		tp[i] = &t[i];
	}
	Aoq__Register reg = AOQ__REGISTER__INIT;
	reg.n_groups = 2;
	reg.groups = gp;
	reg.n_tensors = 3;
	reg.tensors = tp;
	reg.more = true;
	reg.precision = AOQ__STATE_PRECISION__STATE_BF16_Q8;
	reg.window = 12345;
	reg.seed = UINT64_MAX;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_REGISTER;
	env.register_ = &reg;
	uint8_t *buf;
	size_t len;
	EXPECT(aoq_frame_encode(&env, &buf, &len) == 0, "encode");
	EXPECT(aoq_frame_len(buf) == len - 4, "length prefix %u for %zu bytes", aoq_frame_len(buf), len);
	Aoq__Envelope *d = aoq_envelope_decode(buf + 4, len - 4);
	EXPECT(d && d->msg_case == AOQ__ENVELOPE__MSG_REGISTER, "decode");
	if (d && d->msg_case == AOQ__ENVELOPE__MSG_REGISTER) {
		const Aoq__Register *r = d->register_;
		EXPECT(r->n_groups == 2 && r->n_tensors == 3 && r->more && r->window == 12345 &&
		       r->seed == UINT64_MAX && r->precision == AOQ__STATE_PRECISION__STATE_BF16_Q8, "register fields");
		EXPECT(r->groups[0]->hp->lr == 1e-3 && r->groups[0]->hp->eps == 1e-8 &&
		       r->groups[0]->hp->weight_decay == 0.01 && r->groups[1]->kind == AOQ__OPTIMIZER_KIND__ADAM &&
		       r->groups[1]->hp->lr == 3.5, "hyperparameters");
		for (int i = 0; i < 3; i++)
			EXPECT(strcmp(r->tensors[i]->name, names[i]) == 0 && r->tensors[i]->numel == t[i].numel &&
			       r->tensors[i]->param_dtype == t[i].param_dtype &&
			       r->tensors[i]->grad_dtype == t[i].grad_dtype && r->tensors[i]->group == t[i].group,
			       "tensor %d", i);
	}
	aoq_envelope_free(d);
	free(buf);

	/* An envelope with no message set does not decode. */
	Aoq__Envelope empty = AOQ__ENVELOPE__INIT;
	EXPECT(aoq_frame_encode(&empty, &buf, &len) == 0 && len == 4, "empty envelope encodes to %zu bytes", len);
	EXPECT(aoq_envelope_decode(buf + 4, 0) == NULL, "empty envelope decodes");
	free(buf);
	/* Neither does garbage. */
	static const uint8_t junk[16] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
	                                  0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
	EXPECT(aoq_envelope_decode(junk, sizeof(junk)) == NULL, "junk decodes");
}

/* An Error envelope whose packed size is exactly `size`. */
static char *error_of_size(Aoq__Envelope *env, Aoq__Error *e, size_t size)
{
	aoq__error__init(e);
	aoq__envelope__init(env);
	env->msg_case = AOQ__ENVELOPE__MSG_ERROR;
	env->error = e;
	e->code = AOQ__ERROR_CODE__INTERNAL;
	size_t n = size - 16;
	char *s = malloc(size + 1);
	if (!s)
		abort();
	for (int tries = 0; tries < 64; tries++) {
		memset(s, 'a', n);
		s[n] = 0;
		e->message = s;
		size_t got = aoq__envelope__get_packed_size(env);
		if (got == size)
			return s;
		if (got > size)
			n -= got - size;
		else
			n += size - got;
	}
	abort();
}

struct sender {
	int fd;
	const Aoq__Envelope *env;
	int r;
	const uint8_t *bytes;
	size_t nbytes;
	bool slowly;
};

static void *send_thread(void *arg)
{
	struct sender *s = arg;
	if (s->env)
		s->r = aoq_send_frame(s->fd, s->env, NULL, 0);
	else if (s->slowly)
		for (size_t i = 0; i < s->nbytes; i++)
			write_all(s->fd, s->bytes + i, 1);
	else
		write_all(s->fd, s->bytes, s->nbytes);
	return NULL;
}

static void test_cap(void)
{
	Aoq__Envelope env;
	Aoq__Error e;
	char *s = error_of_size(&env, &e, AOQ_MAX_FRAME);
	uint8_t *buf;
	size_t len;
	EXPECT(aoq_frame_encode(&env, &buf, &len) == 0 && len == 4 + AOQ_MAX_FRAME, "a frame of exactly 1 MiB");
	free(buf);

	/* Through a socket (larger than its buffer: a thread sends). */
	int sv[2];
	pair(sv);
	struct sender snd = { .fd = sv[0], .env = &env };
	pthread_t th;
	pthread_create(&th, NULL, send_thread, &snd);
	Aoq__Envelope *got = NULL;
	int r = aoq_recv_frame(sv[1], &got, NULL, 0, NULL);
	pthread_join(th, NULL);
	EXPECT(snd.r == 0 && r == 0, "send %d recv %d of a 1 MiB frame", snd.r, r);
	EXPECT(r == 0 && got->msg_case == AOQ__ENVELOPE__MSG_ERROR && strcmp(got->error->message, s) == 0,
	       "1 MiB frame content");
	if (r == 0)
		aoq_envelope_free(got);
	free(s);

	s = error_of_size(&env, &e, AOQ_MAX_FRAME + 1);
	EXPECT(aoq_frame_encode(&env, &buf, &len) == -EMSGSIZE, "a frame of 1 MiB + 1 must not encode");
	EXPECT(aoq_send_frame(sv[0], &env, NULL, 0) == -EMSGSIZE, "nor be sent");
	free(s);

	/* Length prefixes past the cap on the receiving side. */
	static const uint32_t lens[] = { AOQ_MAX_FRAME + 1, 0x7fffffffu, 0xffffffffu };
	for (int i = 0; i < 3; i++) {
		uint8_t p[8] = { lens[i] & 0xff, (lens[i] >> 8) & 0xff, (lens[i] >> 16) & 0xff, lens[i] >> 24, 1, 2, 3, 4 };
		write_all(sv[0], p, sizeof(p));
		r = aoq_recv_frame(sv[1], &got, NULL, 0, NULL);
		EXPECT(r == -EMSGSIZE, "length prefix 0x%x: %d, want -EMSGSIZE", lens[i], r);
		/* Drain the 4 bytes after it for the next round. */
		uint8_t sink[4];
		EXPECT(read(sv[1], sink, 4) == 4, "drain");
	}
	close(sv[0]);
	close(sv[1]);
}

static void test_bad_frames(void)
{
	int sv[2];
	Aoq__Envelope *got = NULL;
	int r;

	/* Truncated: a prefix for 100 bytes, 10 of them, EOF. */
	pair(sv);
	uint8_t p[14] = { 100, 0, 0, 0 };
	write_all(sv[0], p, sizeof(p));
	close(sv[0]);
	r = aoq_recv_frame(sv[1], &got, NULL, 0, NULL);
	EXPECT(r == -ECONNRESET, "truncated body: %d", r);
	close(sv[1]);

	/* Truncated in the prefix. */
	pair(sv);
	write_all(sv[0], p, 2);
	close(sv[0]);
	r = aoq_recv_frame(sv[1], &got, NULL, 0, NULL);
	EXPECT(r == -ECONNRESET, "truncated prefix: %d", r);
	close(sv[1]);

	/* Undecodable body, and an empty one. */
	pair(sv);
	uint8_t u[4 + 16] = { 16, 0, 0, 0 };
	memset(u + 4, 0xff, 16);
	write_all(sv[0], u, sizeof(u));
	r = aoq_recv_frame(sv[1], &got, NULL, 0, NULL);
	EXPECT(r == -EBADMSG, "undecodable body: %d", r);
	uint8_t z[4] = { 0 };
	write_all(sv[0], z, 4);
	r = aoq_recv_frame(sv[1], &got, NULL, 0, NULL);
	EXPECT(r == -EBADMSG, "empty body: %d", r);

	/* A valid frame one byte at a time. */
	Aoq__StepEnd se = AOQ__STEP_END__INIT;
	se.step = 0x123456789ull;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_STEP_END;
	env.step_end = &se;
	uint8_t *buf;
	size_t len;
	aoq_frame_encode(&env, &buf, &len);
	struct sender snd = { .fd = sv[0], .bytes = buf, .nbytes = len, .slowly = true };
	pthread_t th;
	pthread_create(&th, NULL, send_thread, &snd);
	r = aoq_recv_frame(sv[1], &got, NULL, 0, NULL);
	pthread_join(th, NULL);
	EXPECT(r == 0 && got->msg_case == AOQ__ENVELOPE__MSG_STEP_END && got->step_end->step == se.step,
	       "frame in 1-byte pieces: %d", r);
	if (r == 0)
		aoq_envelope_free(got);
	free(buf);
	close(sv[0]);
	close(sv[1]);
}

static bool same_file(int a, int b)
{
	struct stat sa, sb;
	return fstat(a, &sa) == 0 && fstat(b, &sb) == 0 && sa.st_ino == sb.st_ino && sa.st_dev == sb.st_dev;
}

static void test_fds(void)
{
	int sv[2];
	pair(sv);
	int before = count_fds();
	int mine[4];
	mine[0] = memfd_create("aoq-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	mine[1] = eventfd(0, EFD_CLOEXEC);
	mine[2] = eventfd(0, EFD_CLOEXEC);
	mine[3] = open("/dev/null", O_RDONLY | O_CLOEXEC);
	Aoq__Registered rg = AOQ__REGISTERED__INIT;
	rg.arena_size = 4096;
	rg.fds = 3;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_REGISTERED;
	env.registered = &rg;
	EXPECT(aoq_send_frame(sv[0], &env, mine, 3) == 0, "send with 3 fds");
	Aoq__Envelope *got = NULL;
	int fds[AOQ_MAX_FDS], n = -1;
	int r = aoq_recv_frame(sv[1], &got, fds, 3, &n);
	EXPECT(r == 0 && n == 3, "recv with fds: %d, %d fds", r, n);
	if (r == 0) {
		EXPECT(got->msg_case == AOQ__ENVELOPE__MSG_REGISTERED && got->registered->arena_size == 4096,
		       "frame with fds");
		for (int i = 0; i < n; i++) {
			EXPECT(same_file(fds[i], mine[i]), "fd %d is not the one sent", i);
			EXPECT(fcntl(fds[i], F_GETFD) & FD_CLOEXEC, "received fd %d without CLOEXEC", i);
			close(fds[i]);
		}
		aoq_envelope_free(got);
	}

	EXPECT(aoq_send_frame(sv[0], &env, mine, AOQ_MAX_FDS + 1) == -EINVAL, "more than AOQ_MAX_FDS to send");
	close(sv[0]);
	close(sv[1]);

	/* More fds than the receiver takes: refused, none leaked (a pair
	 * each: the refused frame's body stays unread). */
	pair(sv);
	EXPECT(aoq_send_frame(sv[0], &env, mine, 4) == 0, "send with 4 fds");
	int mid = count_fds();
	r = aoq_recv_frame(sv[1], &got, fds, 3, &n);
	EXPECT(r == -EPROTO && n == 0, "4 fds for a receiver of 3: %d, %d fds", r, n);
	EXPECT(count_fds() == mid, "fds leaked: %d, want %d", count_fds(), mid);
	close(sv[0]);
	close(sv[1]);
	/* Fds to a receiver that takes none. */
	pair(sv);
	EXPECT(aoq_send_frame(sv[0], &env, mine, 1) == 0, "send with 1 fd");
	r = aoq_recv_frame(sv[1], &got, NULL, 0, NULL);
	EXPECT(r == -EPROTO, "1 fd for a receiver of 0: %d", r);
	EXPECT(count_fds() == mid, "fds leaked: %d, want %d", count_fds(), mid);
	close(sv[0]);
	close(sv[1]);

	for (int i = 0; i < 4; i++)
		close(mine[i]);
	EXPECT(count_fds() == before - 2, "fds at the end: %d, want %d", count_fds(), before - 2);
}

static void test_call(void)
{
	int sv[2];
	pair(sv);
	Aoq__Error e = AOQ__ERROR__INIT;
	e.code = AOQ__ERROR_CODE__BUSY;
	e.message = (char *)"step in flight";
	Aoq__Envelope err = AOQ__ENVELOPE__INIT;
	err.msg_case = AOQ__ENVELOPE__MSG_ERROR;
	err.error = &e;
	/* The peer's reply is queued before the call: the socket buffers it. */
	EXPECT(aoq_send_frame(sv[1], &err, NULL, 0) == 0, "queue Error");
	Aoq__Bye bye = AOQ__BYE__INIT;
	Aoq__Envelope req = AOQ__ENVELOPE__INIT;
	req.msg_case = AOQ__ENVELOPE__MSG_BYE;
	req.bye = &bye;
	Aoq__Envelope *rep = NULL;
	char *msg = NULL;
	int r = aoq_call(sv[0], &req, &rep, &msg);
	EXPECT(r == -EBUSY, "aoq_call on Error BUSY: %d", r);
	EXPECT(msg && strcmp(msg, "step in flight") == 0, "error text '%s'", msg ? msg : "(null)");
	free(msg);
	Aoq__Envelope *seen = NULL;
	EXPECT(aoq_recv_frame(sv[1], &seen, NULL, 0, NULL) == 0 && seen->msg_case == AOQ__ENVELOPE__MSG_BYE,
	       "the request reached the peer");
	aoq_envelope_free(seen);

	/* A normal reply comes back as is. */
	Aoq__Done dn = AOQ__DONE__INIT;
	dn.value = 42;
	Aoq__Envelope done = AOQ__ENVELOPE__INIT;
	done.msg_case = AOQ__ENVELOPE__MSG_DONE;
	done.done = &dn;
	aoq_send_frame(sv[1], &done, NULL, 0);
	r = aoq_call(sv[0], &req, &rep, NULL);
	EXPECT(r == 0 && rep->msg_case == AOQ__ENVELOPE__MSG_DONE && rep->done->value == 42, "aoq_call reply");
	if (r == 0)
		aoq_envelope_free(rep);
	close(sv[0]);
	close(sv[1]);

	/* Every error code maps to a distinct negative errno and has a name. */
	int seen_err[16] = { 0 };
	EXPECT(aoq_error_to_errno(AOQ__ERROR_CODE__OK) == 0, "OK maps to 0");
	for (int c = 1; c <= AOQ__ERROR_CODE__INTERNAL; c++) {
		int en = aoq_error_to_errno(c);
		EXPECT(en < 0, "code %d maps to %d", c, en);
		for (int j = 1; j < c; j++)
			EXPECT(seen_err[j] != en, "codes %d and %d both map to %d", j, c, en);
		seen_err[c] = en;
		EXPECT(strcmp(aoq_error_name(c), "UNKNOWN") != 0, "code %d has no name", c);
	}
	EXPECT(strcmp(aoq_error_name(AOQ__ERROR_CODE__BAD_RECORD), "BAD_RECORD") == 0, "BAD_RECORD name");
	EXPECT(aoq_error_to_errno(999) < 0, "unknown code maps to %d", aoq_error_to_errno(999));
}

/* aoq_grow: doubling from 16, new entries zeroed, old ones kept. */
static void test_grow(void)
{
	uint32_t cap = 0;
	uint64_t *a = aoq_grow(NULL, &cap, 5, sizeof(*a));
	EXPECT(a && cap == 16, "cap %u", cap);
	bool zero = true;
	for (uint32_t i = 0; a && i < cap; i++)
		zero &= a[i] == 0;
	EXPECT(zero, "new entries not zeroed");
	for (uint32_t i = 0; a && i < cap; i++)
		a[i] = i + 1;
	uint64_t *b = aoq_grow(a, &cap, 17, sizeof(*b));
	EXPECT(b && cap == 32, "cap %u", cap);
	bool kept = true;
	for (uint32_t i = 0; b && i < 32; i++)
		kept &= b[i] == (i < 16 ? i + 1 : 0);
	EXPECT(kept, "entries lost or not zeroed after growing");
	EXPECT(aoq_grow(b, &cap, 20, sizeof(*b)) == b && cap == 32, "no growth needed");
	free(b ? b : a);
}

int main(void)
{
	signal(SIGPIPE, SIG_IGN);
	test_grow();
	test_round_trip();
	test_cap();
	test_bad_frames();
	test_fds();
	test_call();
	if (failures) {
		fprintf(stderr, "%d failures\n", failures);
		return 1;
	}
	printf("ok\n");
	return 0;
}
