/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the ring-record validator and what runs behind it.
 * The harness registers a fixed session (the input's first byte picks its
 * options: q8, window, clipping, step skipping, delayed update, dtypes,
 * optimizer; fuzz-ops.h), then the input drives what a client can do to
 * the shared memory: records of its choice on the to-daemon ring (built
 * near the valid ones, or any 40 bytes), StepEnds, gradient values, and
 * writes to the ring counters.  The daemon must refuse every bad record
 * with BAD_RECORD (rec_valid, aoqd_drain in dataplane.c), never touch
 * memory outside the arena and its state, and never hang.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "fuzz-daemon.h"
#include "fuzz-ops.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static size_t take(const uint8_t *data, size_t size, size_t *i, void *out, size_t n)
{
	memset(out, 0, n);
	size_t left = size - *i;
	if (n > left)
		n = left;
	memcpy(out, data + *i, n);
	*i += n;
	return n;
}

static void send_register(struct fz_client *c, uint8_t cfg)
{
	Aoq__Hello h = AOQ__HELLO__INIT;
	h.protocol_version = AOQ_PROTOCOL_VERSION;
	h.arena_version = AOQ_ARENA_VERSION;
	h.job = "fuzz-ring";
	h.device = "cpu";
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_HELLO;
	env.hello = &h;
	fz_send_env(c, &env);

	Aoq__Hyperparams hp = AOQ__HYPERPARAMS__INIT;
	hp.lr = 1e-3;
	hp.beta1 = 0.9;
	hp.beta2 = 0.999;
	hp.eps = 1e-8;
	hp.weight_decay = 0.01;
	hp.momentum = 0.9;
	Aoq__Group g = AOQ__GROUP__INIT;
	g.kind = !(cfg & FZR_CFG_SGD) ? AOQ__OPTIMIZER_KIND__ADAMW
	         : (cfg & FZR_CFG_BF16) ? AOQ__OPTIMIZER_KIND__LION : AOQ__OPTIMIZER_KIND__SGD;
	g.hp = &hp;
	Aoq__Group *gp = &g;
	Aoq__TensorDesc td[FZR_TENSORS], *tdp[FZR_TENSORS];
	char names[FZR_TENSORS][8];
	for (int t = 0; t < FZR_TENSORS; t++) {
		aoq__tensor_desc__init(&td[t]);
		snprintf(names[t], sizeof(names[t]), "t%d", t);
		td[t].name = names[t];
		td[t].numel = fzr_numel[t];
		td[t].param_dtype = (cfg & FZR_CFG_BF16) ? AOQ__DTYPE__BF16 : AOQ__DTYPE__FP32;
		td[t].grad_dtype = (cfg & FZR_CFG_BF16) && t != 1 ? AOQ__DTYPE__BF16 : AOQ__DTYPE__FP32;
		tdp[t] = &td[t];
	}
	Aoq__Register reg = AOQ__REGISTER__INIT;
	reg.n_groups = 1;
	reg.groups = &gp;
	reg.n_tensors = FZR_TENSORS;
	reg.tensors = tdp;
	reg.precision = (cfg & FZR_CFG_Q8) ? AOQ__STATE_PRECISION__STATE_Q8 : AOQ__STATE_PRECISION__STATE_FP32;
	reg.window = (cfg & FZR_CFG_WINDOW) ? 2 * 1024 * 4 : 0;
	reg.seed = 7;
	reg.max_grad_norm = (cfg & FZR_CFG_CLIP) ? 1.0 : 0.0;
	reg.skip_nonfinite = (cfg & FZR_CFG_SKIP) != 0;
	reg.delayed = (cfg & FZR_CFG_DELAYED) != 0;
	env.msg_case = AOQ__ENVELOPE__MSG_REGISTER;
	env.register_ = &reg;
	fz_send_env(c, &env);
}

/* The element size of tensor t's gradient. */
static size_t grad_size(uint8_t cfg, unsigned t)
{
	return (cfg & FZR_CFG_BF16) && t != 1 ? 2 : 4;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 1)
		return 0;
	uint8_t cfg = data[0];
	if ((cfg & FZR_CFG_WINDOW) && (cfg & FZR_CFG_DELAYED))
		cfg &= (uint8_t)~FZR_CFG_DELAYED; /* the daemon refuses both (INVALID) */
	if (cfg & FZR_CFG_SGD)
		cfg &= (uint8_t)~FZR_CFG_Q8; /* SGD and Lion have no q8 moments (INVALID) */
	struct fz_client c;
	fz_connect(&c);
	send_register(&c, cfg);
	fz_settle(&c);
	if (!c.to_daemon) {
		/* Every configuration is one the daemon takes. */
		fprintf(stderr, "fuzz-ring: configuration 0x%02x was not registered\n", cfg);
		abort();
	}
	uint64_t step = 1;
	size_t i = 1;
	while (i < size && fz_alive(&c)) {
		uint8_t op = data[i++] & 7;
		switch (op) {
		case FZR_REC: {
			uint8_t b[8];
			take(data, size, &i, b, sizeof(b));
			struct aoq_rec rec;
			memset(&rec, 0, sizeof(rec));
			rec.tensor = b[0] % (FZR_TENSORS + 1);
			unsigned t = rec.tensor < FZR_TENSORS ? rec.tensor : 0;
			rec.slot = (cfg & FZR_CFG_WINDOW) ? b[1] % 4 : (b[1] & 0x80 ? b[1] & 3 : rec.tensor);
			rec.offset = ((uint64_t)b[2] | (uint64_t)b[3] << 8) % (fzr_numel[t] + 1);
			uint64_t count = (uint64_t)b[4] | (uint64_t)b[5] << 8;
			rec.count = count ? count : fzr_numel[t] - (rec.offset < fzr_numel[t] ? rec.offset : 0);
			rec.step = step + (uint64_t)(int64_t)(int8_t)b[6];
			rec.flags = b[7];
			fz_push(&c, &rec);
			break;
		}
		case FZR_STEP_END: {
			int8_t d;
			take(data, size, &i, &d, 1);
			Aoq__StepEnd se = AOQ__STEP_END__INIT;
			se.step = step + (uint64_t)(int64_t)d;
			Aoq__Envelope env = AOQ__ENVELOPE__INIT;
			env.msg_case = AOQ__ENVELOPE__MSG_STEP_END;
			env.step_end = &se;
			fz_send_env(&c, &env);
			if (d == 0)
				step++;
			break;
		}
		case FZR_POP:
			fz_pop_all(&c);
			fz_settle(&c);
			break;
		case FZR_SCRIBBLE: {
			uint8_t b[2];
			take(data, size, &i, b, sizeof(b));
			int64_t d = (int8_t)b[1];
			switch (b[0] & 3) {
			case 0: /* our head, as the daemon reads it */
				atomic_store(&c.to_daemon->head, c.head + (uint64_t)d);
				atomic_store(&c.to_daemon->producer_waiting, 1);
				break;
			case 1: /* our tail of its ring */
				atomic_store(&c.to_client->tail, c.tail + (uint64_t)d);
				break;
			case 2: /* counters only the daemon writes */
				atomic_store(&c.to_daemon->tail, (uint64_t)d);
				atomic_store(&c.to_client->head, (uint64_t)d);
				break;
			default:
				atomic_store(&c.to_client->producer_waiting, 1);
				break;
			}
			uint8_t one = 1;
			ssize_t n = send(c.bell_out, &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
			(void)n;
			break;
		}
		case FZR_GRAD: {
			uint8_t b[7];
			take(data, size, &i, b, sizeof(b));
			unsigned t = b[0] % FZR_TENSORS;
			/* Without a window tensor t's grad area is slot t's; with
			 * one, any slot's (b[0] picks it). */
			unsigned slot = (cfg & FZR_CFG_WINDOW) ? (unsigned)(b[0] >> 2) % c.h.slots : t;
			struct aoq_arena_slot sl;
			memcpy(&sl, c.base + c.h.slot_table_off + slot * sizeof(sl), sizeof(sl));
			size_t es = grad_size(cfg, t);
			uint64_t e = ((uint64_t)b[1] | (uint64_t)b[2] << 8) % (sl.grad_bytes / es ? sl.grad_bytes / es : 1);
			if ((e + 1) * es <= sl.grad_bytes && aoq_range_ok(sl.grad_off, sl.grad_bytes, c.size))
				memcpy(c.base + sl.grad_off + e * es, b + 3, es);
			break;
		}
		case FZR_RAWREC: {
			struct aoq_rec rec;
			take(data, size, &i, &rec, sizeof(rec));
			fz_push(&c, &rec);
			break;
		}
		default:
			fz_settle(&c);
			break;
		}
	}
	fz_settle(&c);
	fz_close(&c);
	return 0;
}
