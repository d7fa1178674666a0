/* SPDX-License-Identifier: MIT */
/*
 * ReleaseTensors (proto/aoq.proto; aoq_release_tensors): a trainer that
 * steps some tensors itself (the PyTorch binding's GPU share) gives their
 * state back to aoqd.
 *
 * One daemon with leases on.  Two sessions without a lease train the same
 * four tensors (q8 moments, bf16 parameters: the master split, its high
 * half the parameter in the masters memfd) with the same seed and the same
 * gradients; after two steps one of them releases two tensors.  Its stats
 * row then counts them (tensors_released) and its state_bytes falls by
 * the bytes the call returned; aoqd's RSS falls; the other two tensors go on
 * training bit for bit as in the twin.  libaoq refuses a push of a
 * released tensor and a second release of it; aoqd refuses a snapshot of
 * the session and, in a leased session, the release itself (that session
 * goes on training).  A state read of a released tensor fails that session
 * alone: the twin trains on.  With the delayed update, a released
 * tensor's pending update never lands on its parameter (aoq_flush).
 *
 * A second daemon with lease_seconds = 0 takes raw clients' bad requests:
 * a tensor named twice, out of range, released before, an empty list, and
 * a gradient record of a released tensor; each ends its session with
 * INVALID (or BAD_RECORD) and a message that names the fault.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

#define NT 4
/* tensor 2: 4.03 bytes of state per element given back, past
 * AOQD_RELEASE_OFF_LOOP_BYTES (64 MiB): its pages go on a thread */
static const uint64_t sizes[NT] = { 3, 4097, (1u << 24) + (1u << 20) + 13, 1u << 16 };
static struct aoqt_daemon d, d2;

struct run {
	struct aoq_client *c;
	uint16_t *param[NT], *grad[NT];
};

static bool delayed; /* open_run: the delayed update */

static void open_run(struct run *r, const char *job, enum aoq_precision prec, uint32_t lease)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = d.socket;
	o.job = job;
	o.device = "cpu";
	o.precision = prec;
	o.seed = 0x5eed;
	o.lease_seconds = lease;
	o.delayed_update = delayed;
	CHECK_OK(aoq_connect(&r->c, &o));
	struct aoq_group g = aoqt_adamw(1e-3);
	CHECK_OK(aoq_add_group(r->c, &g));
	for (int t = 0; t < NT; t++) {
		r->param[t] = aoqt_xmalloc(sizes[t] * 2);
		r->grad[t] = aoqt_xmalloc(sizes[t] * 2);
		struct aoqt_rng g0 = aoqt_rng_for(7, (uint64_t)t, 0);
		for (size_t i = 0; i < sizes[t]; i++)
			aoqt_store(r->param[t], i, AOQ_BF16, aoqt_uniform(&g0) - 0.5);
		char name[16];
		snprintf(name, sizeof(name), "t%d", t);
		struct aoq_tensor td = AOQ_TENSOR_INIT;
		td.name = name;
		td.numel = sizes[t];
		td.param_dtype = AOQ_BF16;
		td.grad_dtype = AOQ_BF16;
		td.param = r->param[t];
		td.grad = r->grad[t];
		CHECK(aoq_add_tensor(r->c, &td) == t, "tensor index");
	}
	CHECK_OK(aoq_register(r->c));
}

static void close_run(struct run *r)
{
	if (r->c)
		aoq_close(r->c);
	r->c = NULL;
	for (int t = 0; t < NT; t++) {
		free(r->param[t]);
		free(r->grad[t]);
	}
}

/* One step pushing the tensors whose bit is set in `mask`, gradients drawn
 * from (step, tensor). */
static int step(struct run *r, uint64_t k, unsigned mask)
{
	for (int t = 0; t < NT; t++) {
		if (!(mask & (1u << t)))
			continue;
		struct aoqt_rng g = aoqt_rng_for(11, k, (uint64_t)t);
		for (size_t i = 0; i < sizes[t]; i++)
			aoqt_store(r->grad[t], i, AOQ_BF16, (aoqt_uniform(&g) - 0.5) / 10);
		int e = aoq_push_grad(r->c, (uint32_t)t, 0, NULL);
		if (e < 0)
			return e;
	}
	int e = aoq_step_end(r->c);
	return e < 0 ? e : aoq_sync(r->c, NULL);
}

static bool same_param(const struct run *a, const struct run *b, int t)
{
	return memcmp(a->param[t], b->param[t], sizes[t] * 2) == 0;
}

/* The stats row of `job` (a copy of the fields used), and the daemon's
 * locked bytes. */
struct row {
	bool found;
	uint64_t state_bytes;
	uint32_t tensors, released;
	uint64_t locked;
};

static struct row row_of(const char *job)
{
	Aoq__Envelope *env = NULL;
	CHECK_OK(aoqt_stats(d.socket, &env));
	struct row w = { .locked = env->stats->locked_bytes };
	for (size_t i = 0; i < env->stats->n_sessions; i++) {
		const Aoq__SessionStats *s = env->stats->sessions[i];
		if (strcmp(s->job, job) == 0) {
			w.found = true;
			w.state_bytes = s->state_bytes;
			w.tensors = s->tensors;
			w.released = s->tensors_released;
		}
	}
	aoq_envelope_free(env);
	CHECK(w.found, "no stats row for job %s", job);
	return w;
}

static void trained(void)
{
	static struct run a, b, c;
	open_run(&a, "rel-a", AOQ_STATE_Q8, AOQ_LEASE_NONE);
	open_run(&b, "rel-b", AOQ_STATE_Q8, AOQ_LEASE_NONE);
	open_run(&c, "rel-c", AOQ_STATE_FP32, 30);
	for (uint64_t k = 1; k <= 2; k++) {
		CHECK_OK(step(&a, k, 0xf));
		CHECK_OK(step(&b, k, 0xf));
		CHECK_OK(step(&c, k, 0xf));
	}
	for (int t = 0; t < NT; t++)
		CHECK(same_param(&a, &b, t), "tensor %d differs between the twins before any release", t);

	struct row r0 = row_of("rel-a");
	uint64_t rss0 = aoqt_rss_bytes(d.pid);
	CHECK(r0.released == 0 && r0.tensors == NT, "before: %u of %u released", r0.released, r0.tensors);
	const uint32_t gone[2] = { 2, 0 };
	uint64_t bytes = 0;
	CHECK_OK(aoq_release_tensors(a.c, gone, 2, &bytes));
	struct row r1 = row_of("rel-a");
	/* the pages go on a thread of their own (more than 64 MiB) */
	uint64_t rss1 = aoqt_rss_bytes(d.pid);
	for (int w = 0; w < 100 && rss1 + bytes / 2 >= rss0; w++) {
		usleep(50000);
		rss1 = aoqt_rss_bytes(d.pid);
	}
	{
		char *log = aoqt_daemon_log(&d);
		CHECK(log && strstr(log, "its pages go on a thread of their own"), "the release's pages were freed on the loop");
		free(log);
	}
	printf("released tensors 2 and 0: %llu bytes; state_bytes %llu -> %llu; aoqd RSS %.1f -> %.1f MiB; "
	       "locked %llu -> %llu\n", (unsigned long long)bytes, (unsigned long long)r0.state_bytes,
	       (unsigned long long)r1.state_bytes, rss0 / 1048576.0, rss1 / 1048576.0, (unsigned long long)r0.locked,
	       (unsigned long long)r1.locked);
	/* tensor 2's low halves (2 B), q8 moments (2 B) and scales: its master
	 * (the parameter, 2 B) stays in the masters memfd */
	CHECK(bytes >= sizes[2] * 4 && bytes < sizes[2] * 5, "released %llu bytes for %llu + 3 elements",
	      (unsigned long long)bytes, (unsigned long long)sizes[2]);
	CHECK(r1.state_bytes == r0.state_bytes - bytes, "state_bytes %llu -> %llu, released %llu",
	      (unsigned long long)r0.state_bytes, (unsigned long long)r1.state_bytes, (unsigned long long)bytes);
	CHECK(r1.released == 2 && r1.tensors == NT, "after: %u of %u released", r1.released, r1.tensors);
	CHECK(rss1 + bytes / 2 < rss0, "aoqd's RSS fell %.1f MiB for %.1f MiB released", (rss0 - rss1) / 1048576.0,
	      bytes / 1048576.0);
	if (r0.locked > 0)
		CHECK(r0.locked - r1.locked >= bytes, "locked bytes fell %llu for %llu released",
		      (unsigned long long)(r0.locked - r1.locked), (unsigned long long)bytes);

	/* the client's own checks */
	CHECK(aoq_push_grad(a.c, 2, 0, NULL) == -EINVAL, "push of a released tensor: %s", aoq_last_error());
	CHECK(aoq_release_tensors(a.c, gone, 1, NULL) == -EINVAL, "a second release: %s", aoq_last_error());
	const uint32_t none[1] = { NT };
	CHECK(aoq_release_tensors(a.c, none, 1, NULL) == -EINVAL, "a tensor out of range: %s", aoq_last_error());

	/* the rest trains as in the twin, bit for bit */
	for (uint64_t k = 3; k <= 5; k++) {
		CHECK_OK(step(&a, k, 0xa));
		CHECK_OK(step(&b, k, 0xf));
		CHECK(same_param(&a, &b, 1) && same_param(&a, &b, 3), "step %llu: tensors 1 and 3 differ from the twin's",
		      (unsigned long long)k);
	}
	printf("ok: tensors 1 and 3 trained 3 more steps, bit for bit as the twin's\n");

	/* no snapshot of a session with released tensors */
	char msg[256];
	uint64_t id = 0, at = 0;
	{
		Aoq__Envelope *env = NULL;
		CHECK_OK(aoqt_stats(d.socket, &env));
		for (size_t i = 0; i < env->stats->n_sessions; i++)
			if (strcmp(env->stats->sessions[i]->job, "rel-a") == 0)
				id = env->stats->sessions[i]->id;
		aoq_envelope_free(env);
	}
	int e = aoqt_snapshot(d.socket, id, msg, sizeof(msg), &at);
	CHECK(e < 0 && strstr(msg, "released"), "snapshot of a session with released tensors: %d %s", e, msg);
	printf("ok: snapshot refused: %s\n", msg);

	/* a leased session keeps its state whole, and trains on */
	e = aoq_release_tensors(c.c, gone, 1, NULL);
	CHECK(e < 0 && strstr(aoq_last_error(), "lease"), "release in a leased session: %d %s", e, aoq_last_error());
	printf("ok: refused in a leased session: %s\n", aoq_last_error());
	CHECK_OK(step(&c, 3, 0xf));
	CHECK(row_of("rel-c").released == 0, "the leased session released a tensor");

	/* a state read of a released tensor ends that session only */
	uint16_t buf[3];
	e = aoq_read_state(a.c, 0, AOQ_MASTER, AOQ_BF16, 0, 3, buf);
	CHECK(e < 0 && strstr(aoq_last_error(), "released"), "ReadState of a released tensor: %d %s", e,
	      aoq_last_error());
	printf("ok: ReadState of a released tensor: %s\n", aoq_last_error());
	CHECK_OK(step(&b, 6, 0xf));
	CHECK_OK(step(&c, 4, 0xf));
	close_run(&a);
	close_run(&b);
	close_run(&c);
}

/* The delayed update: a released tensor's pending update never lands on
 * its parameter (the trainer read it with the state), aoq_flush or not. */
static void pending(void)
{
	static struct run a;
	delayed = true;
	open_run(&a, "rel-delayed", AOQ_STATE_Q8, AOQ_LEASE_NONE);
	delayed = false;
	for (uint64_t k = 1; k <= 2; k++)
		CHECK_OK(step(&a, k, 0xf));
	uint16_t *was = aoqt_xmalloc(sizes[2] * 2), *kept = aoqt_xmalloc(sizes[1] * 2);
	memcpy(was, a.param[2], sizes[2] * 2);
	memcpy(kept, a.param[1], sizes[1] * 2);
	const uint32_t two = 2;
	CHECK_OK(aoq_release_tensors(a.c, &two, 1, NULL));
	CHECK_OK(aoq_flush(a.c));
	CHECK(memcmp(was, a.param[2], sizes[2] * 2) == 0, "aoq_flush wrote a released tensor's parameter");
	CHECK(memcmp(kept, a.param[1], sizes[1] * 2) != 0, "aoq_flush left the pending update of a kept tensor");
	free(kept);
	printf("ok: the delayed update: a released tensor's pending update does not land, a kept one's does\n");
	free(was);
	close_run(&a);
}

/* A raw session of two fp32 tensors of n elements on the lease-free daemon
 * sends ReleaseTensors of tensors[0..k); returns the reply's case (Done's
 * value in *value) or the Error's code with its message, and leaves the
 * session open. */
static int raw_release(struct aoqt_raw *s, const uint32_t *tensors, size_t k, uint64_t *value, char *msg, size_t len)
{
	Aoq__ReleaseTensors m = AOQ__RELEASE_TENSORS__INIT;
	m.n_tensors = k;
	m.tensors = (uint32_t *)tensors;
	CHECK_OK(aoqt_send_msg(s->sock, AOQ__ENVELOPE__MSG_RELEASE_TENSORS, &m));
	Aoq__Envelope *rep = NULL;
	int fds[AOQ_MAX_FDS], nfds = 0;
	int r = aoq_recv_frame(s->sock, &rep, fds, AOQ_MAX_FDS, &nfds);
	CHECK(r >= 0 && nfds == 0, "ReleaseTensors: no reply (%d)", r);
	r = -1;
	if (rep->msg_case == AOQ__ENVELOPE__MSG_DONE) {
		*value = rep->done->value;
		r = 0;
	} else if (rep->msg_case == AOQ__ENVELOPE__MSG_ERROR) {
		snprintf(msg, len, "%s", rep->error->message ? rep->error->message : "");
		r = (int)rep->error->code;
	}
	aoq_envelope_free(rep);
	return r;
}

static void hostile(void)
{
	static const uint64_t n[2] = { 1000, 70000 };
	struct {
		const char *what;
		uint32_t tensors[2];
		size_t k;
		const char *says;
	} bad[] = {
		{ "a tensor named twice", { 1, 1 }, 2, "named twice" },
		{ "a tensor out of range", { 5, 0 }, 1, "tensor 5 of 2" },
		{ "no tensor", { 0, 0 }, 0, "0 tensors" },
	};
	char msg[256];
	uint64_t v = 0;
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct aoqt_raw s;
		CHECK_OK(aoqt_raw_open(&s, d2.socket, "rel-raw", n, 2));
		int code = raw_release(&s, bad[i].tensors, bad[i].k, &v, msg, sizeof(msg));
		CHECK(code == AOQ__ERROR_CODE__INVALID && strstr(msg, bad[i].says), "%s: code %d, %s", bad[i].what, code,
		      msg);
		CHECK(aoqt_raw_expect_close(s.sock, 5000, NULL, 0) == -1, "%s: the session stayed open", bad[i].what);
		printf("ok: %s: %s\n", bad[i].what, msg);
		aoqt_raw_close(&s);
	}
	/* released before */
	struct aoqt_raw s;
	CHECK_OK(aoqt_raw_open(&s, d2.socket, "rel-raw", n, 2));
	const uint32_t one[1] = { 1 };
	CHECK(raw_release(&s, one, 1, &v, msg, sizeof(msg)) == 0 && v >= n[1] * 12, "release: %llu bytes",
	      (unsigned long long)v);
	int code = raw_release(&s, one, 1, &v, msg, sizeof(msg));
	CHECK(code == AOQ__ERROR_CODE__INVALID && strstr(msg, "released before"), "released twice: %d %s", code, msg);
	printf("ok: released twice: %s\n", msg);
	aoqt_raw_close(&s);
	/* a gradient of a released tensor */
	CHECK_OK(aoqt_raw_open(&s, d2.socket, "rel-raw", n, 2));
	CHECK(raw_release(&s, one, 1, &v, msg, sizeof(msg)) == 0, "release: %s", msg);
	struct aoq_rec rec = { .tensor = 1, .slot = 1, .offset = 0, .count = n[1], .step = 1 };
	CHECK_OK(aoqt_raw_push(&s, &rec));
	code = aoqt_raw_expect_close(s.sock, 5000, msg, sizeof(msg));
	CHECK(code >= 0 && strstr(msg, "released"), "a gradient of a released tensor: %d %s", code, msg);
	printf("ok: a gradient of a released tensor: %s\n", msg);
	aoqt_raw_close(&s);
	CHECK(aoqt_daemon_alive(&d2), "aoqd died");
}

int main(int argc, char **argv)
{
	aoqt_init("release");
	const char *exe = aoqt_aoqd_path(argc, argv);
	char sd[] = "/tmp/aoq-release-state-XXXXXX";
	CHECK(mkdtemp(sd), "mkdtemp");
	const char *args[] = { "--threads", "2", "--state-dir", sd, NULL };
	CHECK_OK(aoqt_daemon_start(&d, exe, args));
	trained();
	pending();
	CHECK(aoqt_daemon_alive(&d), "aoqd died");
	aoqt_daemon_stop(&d, 30000, true);
	rmdir(sd);

	char conf[] = "/tmp/aoq-release-conf-XXXXXX";
	int fd = mkstemp(conf);
	CHECK(fd >= 0 && dprintf(fd, "lease_seconds = 0\n") > 0, "config file");
	close(fd);
	const char *args2[] = { "--threads", "2", "--config", conf, NULL };
	CHECK_OK(aoqt_daemon_start(&d2, exe, args2));
	hostile();
	aoqt_daemon_stop(&d2, 30000, true);
	unlink(conf);
	printf("ok\n");
	return 0;
}
