/* SPDX-License-Identifier: MIT */
/*
 * Writes the fuzz targets' seed corpus: gen-corpus DIR makes
 * DIR/frame, DIR/session and DIR/ring and fills them with well-formed
 * conversations (every message the daemon handles, each registration
 * option, records of whole steps), from which the fuzzers mutate.  The
 * files in tests/fuzz/corpus are this program's output plus the crashes
 * found so far (named crash-*, kept as regression seeds).
 *
 *   build-fuzz/tests/fuzz/gen-corpus tests/fuzz/corpus
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz-ops.h"
#include "wire.h"

struct buf {
	uint8_t *p;
	size_t n, cap;
};

static void put(struct buf *b, const void *p, size_t n)
{
	if (b->n + n > b->cap) {
		b->cap = (b->n + n) * 2;
		b->p = realloc(b->p, b->cap);
		if (!b->p) {
			perror("gen-corpus");
			exit(1);
		}
	}
	memcpy(b->p + b->n, p, n);
	b->n += n;
}

static void put8(struct buf *b, uint8_t v)
{
	put(b, &v, 1);
}

static void put16(struct buf *b, uint16_t v)
{
	uint8_t x[2] = { (uint8_t)v, (uint8_t)(v >> 8) };
	put(b, x, 2);
}

static void put32(struct buf *b, uint32_t v)
{
	uint8_t x[4] = { (uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24) };
	put(b, x, 4);
}

static const char *outdir;

static void save(const char *sub, const char *name, struct buf *b)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", outdir, sub);
	if (mkdir(path, 0755) < 0 && errno != EEXIST) {
		perror(path);
		exit(1);
	}
	snprintf(path, sizeof(path), "%s/%s/%s", outdir, sub, name);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(b->p, 1, b->n, f) != b->n || fclose(f) != 0) {
		perror(path);
		exit(1);
	}
	free(b->p);
	memset(b, 0, sizeof(*b));
}

/* ---- messages ---- */

/* One frame of env, length prefix included. */
static void frame(struct buf *b, Aoq__Envelope__MsgCase c, void *msg)
{
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = c;
	/* Every message field of the oneof is a pointer at the same place. */
	env.hello = msg;
	uint8_t *p;
	size_t n;
	if (aoq_frame_encode(&env, &p, &n) < 0) {
		fprintf(stderr, "gen-corpus: cannot encode\n");
		exit(1);
	}
	put(b, p, n);
	free(p);
}

static void hello_lease(struct buf *b, bool observer, uint32_t lease)
{
	Aoq__Hello h = AOQ__HELLO__INIT;
	h.protocol_version = AOQ_PROTOCOL_VERSION;
	h.arena_version = AOQ_ARENA_VERSION;
	h.job = observer ? "aoqctl" : "seed";
	h.device = "cpu";
	h.observer = observer;
	h.pid = 1;
	h.lease_seconds = lease;
	frame(b, AOQ__ENVELOPE__MSG_HELLO, &h);
}

static void hello(struct buf *b, bool observer)
{
	hello_lease(b, observer, 0);
}

struct reg_opts {
	Aoq__StatePrecision precision;
	uint64_t window;
	double max_grad_norm;
	bool skip, delayed, more;
	Aoq__OptimizerKind kind;
	Aoq__DType pdt, gdt;
	uint32_t first; /* name of the first tensor: t<first> */
};

static const uint64_t seed_numel[2] = { 300, 64 };

static void reg(struct buf *b, const struct reg_opts *o)
{
	Aoq__Hyperparams hp = AOQ__HYPERPARAMS__INIT;
	hp.lr = 1e-3;
	hp.beta1 = 0.9;
	hp.beta2 = 0.999;
	hp.eps = 1e-8;
	hp.weight_decay = 0.01;
	hp.momentum = 0.9;
	Aoq__Group g = AOQ__GROUP__INIT;
	g.kind = o->kind;
	g.hp = &hp;
	Aoq__Group *gp = &g;
	Aoq__TensorDesc td[2], *tdp[2];
	char names[2][16];
	for (int t = 0; t < 2; t++) {
		aoq__tensor_desc__init(&td[t]);
		snprintf(names[t], sizeof(names[t]), "t%u", o->first + (unsigned)t);
		td[t].name = names[t];
		td[t].numel = seed_numel[t];
		td[t].param_dtype = o->pdt;
		td[t].grad_dtype = o->gdt;
		tdp[t] = &td[t];
	}
	Aoq__Register r = AOQ__REGISTER__INIT;
	r.n_groups = 1;
	r.groups = &gp;
	r.n_tensors = 2;
	r.tensors = tdp;
	r.more = o->more;
	r.precision = o->precision;
	r.window = o->window;
	r.seed = 11;
	r.max_grad_norm = o->max_grad_norm;
	r.skip_nonfinite = o->skip;
	r.delayed = o->delayed;
	frame(b, AOQ__ENVELOPE__MSG_REGISTER, &r);
}

static void step_end(struct buf *b, uint64_t step)
{
	Aoq__StepEnd m = AOQ__STEP_END__INIT;
	m.step = step;
	frame(b, AOQ__ENVELOPE__MSG_STEP_END, &m);
}

static void set_hp(struct buf *b, uint64_t step)
{
	Aoq__Hyperparams hp = AOQ__HYPERPARAMS__INIT;
	hp.lr = 5e-4;
	hp.beta1 = 0.8;
	hp.beta2 = 0.99;
	hp.eps = 1e-6;
	Aoq__SetHyperparams m = AOQ__SET_HYPERPARAMS__INIT;
	m.group = 0;
	m.hp = &hp;
	m.step = step;
	frame(b, AOQ__ENVELOPE__MSG_SET_HYPERPARAMS, &m);
}

static void load_state(struct buf *b, uint32_t t, Aoq__StateKind what, Aoq__DType dt, uint64_t off, uint64_t n)
{
	Aoq__LoadState m = AOQ__LOAD_STATE__INIT;
	m.tensor = t;
	m.what = what;
	m.dtype = dt;
	m.offset = off;
	m.count = n;
	frame(b, AOQ__ENVELOPE__MSG_LOAD_STATE, &m);
}

static void read_state(struct buf *b, uint32_t t, Aoq__StateKind what, Aoq__DType dt, uint64_t off, uint64_t n)
{
	Aoq__ReadState m = AOQ__READ_STATE__INIT;
	m.tensor = t;
	m.what = what;
	m.dtype = dt;
	m.offset = off;
	m.count = n;
	frame(b, AOQ__ENVELOPE__MSG_READ_STATE, &m);
}

static void tensor_steps(struct buf *b, bool set)
{
	uint64_t steps[2] = { 5, 7 };
	Aoq__TensorSteps m = AOQ__TENSOR_STEPS__INIT;
	m.first = 0;
	m.set = set;
	if (set) {
		m.n_steps = 2;
		m.steps = steps;
	} else {
		m.count = 2;
	}
	frame(b, AOQ__ENVELOPE__MSG_TENSOR_STEPS, &m);
}

static void release(struct buf *b, uint32_t *tensors, size_t n)
{
	Aoq__ReleaseTensors m = AOQ__RELEASE_TENSORS__INIT;
	m.n_tensors = n;
	m.tensors = tensors;
	frame(b, AOQ__ENVELOPE__MSG_RELEASE_TENSORS, &m);
}

static void stats(struct buf *b)
{
	Aoq__StatsRequest m = AOQ__STATS_REQUEST__INIT;
	m.all_sessions = true;
	frame(b, AOQ__ENVELOPE__MSG_STATS_REQUEST, &m);
}

static void trace(struct buf *b, uint64_t session)
{
	Aoq__TraceRequest m = AOQ__TRACE_REQUEST__INIT;
	m.session = session;
	m.steps = 2;
	frame(b, AOQ__ENVELOPE__MSG_TRACE_REQUEST, &m);
}

static void bye(struct buf *b)
{
	Aoq__Bye m = AOQ__BYE__INIT;
	frame(b, AOQ__ENVELOPE__MSG_BYE, &m);
}

/* ---- fuzz-session operations ---- */

/* Wraps the frames in m (each with its prefix) as FZS_FRAME operations. */
static void s_frames(struct buf *b, struct buf *m)
{
	size_t i = 0;
	while (i + 4 <= m->n) {
		uint32_t len = aoq_frame_len(m->p + i);
		put8(b, FZS_FRAME);
		put16(b, (uint16_t)len);
		put(b, m->p + i + 4, len);
		i += 4 + len;
	}
	free(m->p);
	memset(m, 0, sizeof(*m));
}

static void s_record(struct buf *b, uint32_t t, uint32_t slot, uint64_t off, uint64_t n, uint64_t step, uint32_t flags)
{
	struct aoq_rec r = { .tensor = t, .slot = slot, .offset = off, .count = n, .step = step, .flags = flags };
	put8(b, FZS_RECORD);
	put(b, &r, sizeof(r));
}

static void s_op(struct buf *b, uint8_t op)
{
	put8(b, op);
}

/* Hello, Register, two steps of records, then every other request. */
static void session_train(const char *name, const struct reg_opts *o)
{
	struct buf b = { 0 }, m = { 0 };
	hello(&m, false);
	reg(&m, o);
	s_frames(&b, &m);
	s_op(&b, FZS_SETTLE);
	for (uint64_t step = 1; step <= 2; step++) {
		if (step == 2 && !o->window)
			s_record(&b, 1, 1, 0, seed_numel[1], step, 1); /* a micro-batch first */
		for (uint32_t t = 0; t < 2; t++)
			s_record(&b, t, o->window ? t : t, 0, seed_numel[t], step, 0);
		step_end(&m, step);
		s_frames(&b, &m);
		s_op(&b, FZS_POP);
		s_op(&b, FZS_POP);
	}
	set_hp(&m, 3);
	read_state(&m, 0, AOQ__STATE_KIND__MASTER, AOQ__DTYPE__FP32, 0, seed_numel[0]);
	load_state(&m, 1, AOQ__STATE_KIND__EXP_AVG, AOQ__DTYPE__BF16, 0, seed_numel[1]);
	load_state(&m, 0, AOQ__STATE_KIND__PARAM, AOQ__DTYPE__FP32, 0, 256);
	read_state(&m, 1, AOQ__STATE_KIND__EXP_AVG_SQ, AOQ__DTYPE__FP16, 0, seed_numel[1]);
	tensor_steps(&m, false);
	tensor_steps(&m, true);
	stats(&m);
	trace(&m, 1);
	s_frames(&b, &m);
	s_op(&b, FZS_SETTLE);
	/* a NaN into the first grad area the poke can reach, then a step */
	put8(&b, FZS_POKE);
	put32(&b, 4096);
	put8(&b, 4);
	put32(&b, 0x7fc00000u);
	s_record(&b, 0, 0, 0, 256, 3, 0);
	step_end(&m, 3);
	bye(&m);
	s_frames(&b, &m);
	s_op(&b, FZS_POP);
	save("session", name, &b);
}

static void session_corpus(void)
{
	struct reg_opts plain = { .kind = AOQ__OPTIMIZER_KIND__ADAMW, .pdt = AOQ__DTYPE__FP32, .gdt = AOQ__DTYPE__FP32 };
	session_train("train-fp32", &plain);
	struct reg_opts o = plain;
	o.precision = AOQ__STATE_PRECISION__STATE_Q8;
	o.pdt = AOQ__DTYPE__BF16;
	o.gdt = AOQ__DTYPE__BF16;
	session_train("train-q8-bf16", &o);
	o = plain;
	o.window = 4096;
	o.max_grad_norm = 1.0;
	session_train("train-window-clip", &o);
	o = plain;
	o.skip = true;
	o.delayed = true;
	o.kind = AOQ__OPTIMIZER_KIND__SGD;
	o.gdt = AOQ__DTYPE__FP16;
	session_train("train-skip-delayed-sgd", &o);
	o = plain;
	o.kind = AOQ__OPTIMIZER_KIND__LION;
	o.precision = AOQ__STATE_PRECISION__STATE_BF16_ALL;
	session_train("train-lion-bf16all", &o);

	/* No lease, q8 state: one step, then tensor 1 released (twice: the
	 * second ends the session), tensor 0 trains on, then a gradient of
	 * tensor 1. */
	{
		struct buf b = { 0 }, m = { 0 };
		uint32_t one = 1;
		o = plain;
		o.precision = AOQ__STATE_PRECISION__STATE_Q8;
		o.pdt = AOQ__DTYPE__BF16;
		o.gdt = AOQ__DTYPE__BF16;
		hello_lease(&m, false, 0xFFFFFFFFu);
		reg(&m, &o);
		s_frames(&b, &m);
		s_op(&b, FZS_SETTLE);
		for (uint32_t t = 0; t < 2; t++)
			s_record(&b, t, t, 0, seed_numel[t], 1, 0);
		step_end(&m, 1);
		s_frames(&b, &m);
		s_op(&b, FZS_POP);
		s_op(&b, FZS_POP);
		release(&m, &one, 1);
		stats(&m);
		s_frames(&b, &m);
		s_op(&b, FZS_SETTLE);
		s_record(&b, 0, 0, 0, seed_numel[0], 2, 0);
		step_end(&m, 2);
		s_frames(&b, &m);
		s_op(&b, FZS_POP);
		s_record(&b, 1, 1, 0, seed_numel[1], 3, 0);
		release(&m, &one, 1);
		s_frames(&b, &m);
		s_op(&b, FZS_SETTLE);
		save("session", "release", &b);
	}

	/* Register in two frames (more). */
	struct buf b = { 0 }, m = { 0 };
	hello(&m, false);
	o = plain;
	o.more = true;
	reg(&m, &o);
	o.more = false;
	o.first = 2;
	reg(&m, &o);
	stats(&m);
	s_frames(&b, &m);
	s_op(&b, FZS_SETTLE);
	s_record(&b, 3, 3, 0, seed_numel[1], 1, 0);
	step_end(&m, 1);
	s_frames(&b, &m);
	s_op(&b, FZS_POP);
	save("session", "register-more", &b);

	/* An observer: Stats, a trace of nobody, Bye. */
	hello(&m, true);
	stats(&m);
	trace(&m, 1);
	bye(&m);
	s_frames(&b, &m);
	save("session", "observer", &b);

	/* Messages out of order, then a frame cut in the middle (raw). */
	step_end(&m, 1);
	s_frames(&b, &m);
	save("session", "before-hello", &b);
	hello(&m, false);
	s_frames(&b, &m);
	reg(&m, &plain);
	put8(&b, FZS_RAW);
	put8(&b, 20);
	put(&b, m.p, 20);
	free(m.p);
	memset(&m, 0, sizeof(m));
	save("session", "truncated-register", &b);
}

/* ---- fuzz-frame ---- */

static void frame_corpus(void)
{
	struct buf b = { 0 };
	struct reg_opts plain = { .kind = AOQ__OPTIMIZER_KIND__ADAMW, .pdt = AOQ__DTYPE__FP32, .gdt = AOQ__DTYPE__FP32 };
	hello(&b, false);
	save("frame", "hello", &b);
	reg(&b, &plain);
	save("frame", "register", &b);
	struct reg_opts o = plain;
	o.precision = AOQ__STATE_PRECISION__STATE_Q8;
	o.window = 1 << 20;
	o.max_grad_norm = 0.5;
	o.skip = true;
	o.more = true;
	reg(&b, &o);
	save("frame", "register-options", &b);
	step_end(&b, 1);
	save("frame", "step-end", &b);
	set_hp(&b, 2);
	save("frame", "set-hyperparams", &b);
	load_state(&b, 1, AOQ__STATE_KIND__EXP_AVG, AOQ__DTYPE__BF16, 0, 64);
	save("frame", "load-state", &b);
	read_state(&b, 0, AOQ__STATE_KIND__MASTER, AOQ__DTYPE__FP32, 0, 300);
	save("frame", "read-state", &b);
	tensor_steps(&b, true);
	save("frame", "tensor-steps", &b);
	stats(&b);
	save("frame", "stats", &b);
	trace(&b, 1);
	save("frame", "trace", &b);
	bye(&b);
	save("frame", "bye", &b);
	/* A whole conversation in one buffer. */
	hello(&b, false);
	reg(&b, &plain);
	step_end(&b, 1);
	set_hp(&b, 2);
	tensor_steps(&b, false);
	stats(&b);
	bye(&b);
	save("frame", "conversation", &b);
	/* A length past the limit, and a frame cut short. */
	put32(&b, 0xffffffffu);
	put32(&b, 0);
	save("frame", "too-long", &b);
	hello(&b, false);
	b.n -= 3;
	save("frame", "truncated", &b);
}

/* ---- fuzz-ring ---- */

static void r_rec(struct buf *b, uint8_t t, uint8_t slot, uint16_t off, uint16_t n, int8_t dstep, uint8_t flags)
{
	put8(b, FZR_REC);
	put8(b, t);
	put8(b, slot);
	put16(b, off);
	put16(b, n);
	put8(b, (uint8_t)dstep);
	put8(b, flags);
}

static void r_step(struct buf *b, bool window, bool accumulate)
{
	for (uint8_t t = 0; t < FZR_TENSORS; t++) {
		if (accumulate && t == 1)
			r_rec(b, t, window ? 1 : t, 0, 0, 0, 1);
		r_rec(b, t, window ? t : t, 0, 0, 0, 0);
	}
	put8(b, FZR_STEP_END);
	put8(b, 0);
	put8(b, FZR_POP);
	put8(b, FZR_POP);
}

static void ring_corpus(void)
{
	static const uint8_t cfgs[] = {
		0, FZR_CFG_Q8, FZR_CFG_WINDOW, FZR_CFG_CLIP, FZR_CFG_CLIP | FZR_CFG_SKIP, FZR_CFG_DELAYED,
		FZR_CFG_BF16, FZR_CFG_SGD, FZR_CFG_SGD | FZR_CFG_BF16, FZR_CFG_Q8 | FZR_CFG_WINDOW | FZR_CFG_CLIP,
		FZR_CFG_SKIP | FZR_CFG_DELAYED | FZR_CFG_BF16,
	};
	for (size_t k = 0; k < sizeof(cfgs); k++) {
		struct buf b = { 0 };
		uint8_t c = cfgs[k];
		bool window = (c & FZR_CFG_WINDOW) != 0;
		put8(&b, c);
		r_step(&b, window, false);
		/* a gradient value: inf in tensor 0 */
		put8(&b, FZR_GRAD);
		put8(&b, 0);
		put16(&b, 5);
		put32(&b, 0x7f800000u);
		r_step(&b, window, true);
		/* a tensor in two pieces */
		r_rec(&b, 1, 1, 0, 2048, 0, 0);
		r_rec(&b, 1, 1, 2048, 2048, 0, 0);
		put8(&b, FZR_STEP_END);
		put8(&b, 0);
		put8(&b, FZR_POP);
		char name[32];
		snprintf(name, sizeof(name), "steps-cfg%02x", c);
		save("ring", name, &b);
	}
	/* Records the daemon must refuse, and counters scribbled on. */
	struct buf b = { 0 };
	put8(&b, 0);
	r_rec(&b, 0, 0, 0, 0, 0, 0);
	put8(&b, FZR_SCRIBBLE);
	put8(&b, 1);
	put8(&b, 0x40);
	put8(&b, FZR_POP);
	save("ring", "scribble-tail", &b);
	put8(&b, 0);
	put8(&b, FZR_SCRIBBLE);
	put8(&b, 0);
	put8(&b, 0x7f);
	put8(&b, FZR_POP);
	save("ring", "scribble-head", &b);
	put8(&b, 0);
	r_rec(&b, 3, 3, 0, 1, 0, 0);
	put8(&b, FZR_POP);
	save("ring", "bad-tensor", &b);
	put8(&b, FZR_CFG_Q8);
	r_rec(&b, 1, 1, 100, 256, 0, 0);
	put8(&b, FZR_POP);
	save("ring", "q8-unaligned", &b);
	put8(&b, 0);
	r_rec(&b, 0, 0, 0, 0, 0, 0);
	r_rec(&b, 0, 0, 0, 0, 0, 0);
	put8(&b, FZR_STEP_END);
	put8(&b, 0);
	put8(&b, FZR_POP);
	save("ring", "twice-final", &b);
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: gen-corpus DIR\n");
		return 2;
	}
	outdir = argv[1];
	if (mkdir(outdir, 0755) < 0 && errno != EEXIST) {
		perror(outdir);
		return 1;
	}
	frame_corpus();
	session_corpus();
	ring_corpus();
	return 0;
}
