/* SPDX-License-Identifier: MIT */
/*
 * The input formats of the session and ring targets, shared with the seed
 * generator (gen-corpus.c).  An input is a list of operations, each a
 * byte naming it and its bytes; an operation cut short by the end of the
 * input is done with what there is.
 */
#ifndef AOQ_FUZZ_OPS_H
#define AOQ_FUZZ_OPS_H

/* fuzz-session: what a hostile client does on its socket and arena. */
enum {
	FZS_FRAME = 0,  /* u16 len, body: one frame (the prefix added) */
	FZS_RAW = 1,    /* u8 len, bytes: sent as they are */
	FZS_RECORD = 2, /* 40 bytes: a struct aoq_rec pushed on the to-daemon ring */
	FZS_POP = 3,    /* take the daemon's answers off the to-client ring */
	FZS_POKE = 4,   /* u32 offset, u8 len, bytes: written into the arena */
	FZS_SETTLE = 5, /* let the daemon catch up (so do 6 and 7) */
};

/*
 * fuzz-ring: the first byte picks the registration (FZR_CFG_*), then
 * operations on the rings of that session.
 */
enum {
	FZR_CFG_Q8 = 1 << 0,      /* q8 moments */
	FZR_CFG_WINDOW = 1 << 1,  /* staging slots instead of a slot per tensor */
	FZR_CFG_CLIP = 1 << 2,    /* max_grad_norm: updates wait for the step's norm */
	FZR_CFG_SKIP = 1 << 3,    /* skip_nonfinite */
	FZR_CFG_DELAYED = 1 << 4, /* two param buffers by step parity */
	FZR_CFG_BF16 = 1 << 5,    /* bf16 params and gradients */
	FZR_CFG_SGD = 1 << 6,     /* SGD (else AdamW; with BF16 and SGD: Lion) */
};

enum {
	FZR_REC = 0,     /* u8 tensor, u8 slot, u16 offset, u16 count (0: to the end), i8 step - current, u8 flags */
	FZR_STEP_END = 1, /* i8: StepEnd(current + i8); the current step moves on when it was the current one */
	FZR_POP = 2,     /* take the answers, then settle */
	FZR_SCRIBBLE = 3, /* u8 which, i8 delta: a ring counter the client can write */
	FZR_GRAD = 4,    /* u8 tensor, u16 element, u32 bits: one gradient value (fp32 bits, or bf16 in the low half) */
	FZR_RAWREC = 5,  /* 40 bytes: any record */
	FZR_SETTLE = 6,  /* settle without taking the answers (so does 7) */
};

/* Tensors of the ring target's session. */
#define FZR_TENSORS 3
static const unsigned long long fzr_numel[FZR_TENSORS] = { 300, 4096, 17 };

#endif
