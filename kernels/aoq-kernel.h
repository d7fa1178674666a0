/* SPDX-License-Identifier: MIT */
/*
 * aoq CPU optimizer kernel interface.
 *
 * A kernel updates one chunk of one tensor: elements [begin, begin + count)
 * of the tensor's optimizer state.  It reads the gradient chunk (any dtype,
 * optionally plus an fp32 accumulator), updates master weights and moments in
 * place, and writes the new parameter in the device dtype.  One pass over
 * memory: the casts are fused into the update.
 *
 * The daemon owns the state and calls the kernel from its worker threads; a
 * kernel call never allocates and never blocks.  Every variant (plain C,
 * AVX2, AVX-512, AVX-512+BF16) implements the same table, chosen once at
 * start by aoq_kernel_select().
 */
#ifndef AOQ_KERNEL_H
#define AOQ_KERNEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Values match enum aoq_dtype in <aoq/aoq.h> and the protocol's DType. */
enum aoqk_dtype {
	AOQK_FP32 = 0,
	AOQK_BF16 = 1,
	AOQK_FP16 = 2,
};

/* Values match the protocol's StatePrecision. */
enum aoqk_precision {
	AOQK_STATE_FP32 = 0,    /* fp32 master, fp32 m, fp32 v */
	AOQK_STATE_Q8 = 1,      /* fp32 master, q8 m and v */
	AOQK_STATE_BF16 = 2,    /* bf16 master (stochastic rounding), fp32 m, v */
	AOQK_STATE_BF16_Q8 = 3, /* bf16 master (stochastic rounding), q8 m, v */
	AOQK_STATE_BF16_ALL = 4, /* bf16 master, m and v (all stochastic rounding) */
	AOQK_STATE_Q4 = 5,      /* fp32 master, q4 m and v */
	AOQK_STATE_BF16_Q4 = 6, /* bf16 master (stochastic rounding), q4 m, v */
};

/* q8 moments are quantized in blocks of this many elements, one fp32 scale
 * per block.  Chunks handed to a kernel start on a block boundary. */
#define AOQK_Q8_BLOCK 256

/* q4 moments: blocks of 128 elements, one fp32 scale per block; the codes
 * of each 32 elements (a group) fill 16 bytes, byte l holding element l in
 * its low nibble and element l + 16 in its high nibble (kernels/README.md,
 * "q4 moments").  Chunks start on a block boundary. */
#define AOQK_Q4_BLOCK 128
#define AOQK_Q4_GROUP 32

static inline size_t aoqk_dtype_size(enum aoqk_dtype t)
{
	return t == AOQK_FP32 ? 4 : 2;
}

static inline bool aoqk_precision_q8(enum aoqk_precision p)
{
	return p == AOQK_STATE_Q8 || p == AOQK_STATE_BF16_Q8;
}

static inline bool aoqk_precision_q4(enum aoqk_precision p)
{
	return p == AOQK_STATE_Q4 || p == AOQK_STATE_BF16_Q4;
}

/* q8 or q4: moments as codes with a scale per block */
static inline bool aoqk_precision_blocked(enum aoqk_precision p)
{
	return aoqk_precision_q8(p) || aoqk_precision_q4(p);
}

/* Elements per scale block (0: no blocks). */
static inline size_t aoqk_block(enum aoqk_precision p)
{
	return aoqk_precision_q8(p) ? AOQK_Q8_BLOCK : aoqk_precision_q4(p) ? AOQK_Q4_BLOCK : 0;
}

static inline bool aoqk_precision_bf16_master(enum aoqk_precision p)
{
	return p == AOQK_STATE_BF16 || p == AOQK_STATE_BF16_Q8 || p == AOQK_STATE_BF16_ALL ||
	       p == AOQK_STATE_BF16_Q4;
}

static inline bool aoqk_precision_bf16_moments(enum aoqk_precision p)
{
	return p == AOQK_STATE_BF16_ALL;
}

/* Bytes per element of the master and of each moment. */
static inline size_t aoqk_master_size(enum aoqk_precision p)
{
	return aoqk_precision_bf16_master(p) ? 2 : 4;
}

/* Bytes per element of each moment; 0 for q4 (half a byte: use
 * aoqk_moment_bytes). */
static inline size_t aoqk_moment_size(enum aoqk_precision p)
{
	return aoqk_precision_q4(p) ? 0 : aoqk_precision_q8(p) ? 1 : aoqk_precision_bf16_moments(p) ? 2 : 4;
}

/* Bytes of one moment array of n elements (q4: 16 per group of 32, the
 * last group whole). */
static inline size_t aoqk_moment_bytes(enum aoqk_precision p, size_t n)
{
	if (aoqk_precision_q4(p))
		return (n / AOQK_Q4_GROUP + (n % AOQK_Q4_GROUP != 0)) * (AOQK_Q4_GROUP / 2);
	return n * aoqk_moment_size(p);
}

/* Scale blocks of n elements (0 without blocks). */
static inline size_t aoqk_scale_count(enum aoqk_precision p, size_t n)
{
	size_t b = aoqk_block(p);
	return b ? n / b + (n % b != 0) : 0;
}

/* Hyperparameters of one update, fixed for the whole step. */
struct aoqk_hparams {
	/* double, as torch holds them: the per-call constants are derived in
	 * double and rounded to float once, the way torch's foreach AdamW passes
	 * its Python-float scalars to its kernels */
	double lr;
	double beta1;
	double beta2;
	double eps;
	double weight_decay;
	bool decoupled;   /* true: AdamW (decoupled decay); false: Adam (L2 into grad) */
	uint64_t step;    /* this tensor's step, 1-based, for bias correction */
	float grad_scale; /* every gradient is multiplied by this (unscale, clip); 1 = none */
	/* SGD only (torch.optim.SGD's arguments; 0 and false when unused).
	 * Adam and Lion ignore them, and SGD and Lion ignore `decoupled`
	 * and `eps` (SGD's weight decay is always L2 into the gradient,
	 * Lion's always decoupled).  step == 1 is SGD's first step: the
	 * momentum buffer is set to the gradient (kernels/README.md). */
	double momentum;
	double dampening;
	bool nesterov; /* needs momentum > 0 and dampening == 0, else -EINVAL */
};

/*
 * One tensor's state.  Element i of the tensor lives at index i of every
 * array.  fp32 state: master, m, v are float[n].  bf16 master: master is
 * uint16_t[n] (bf16 bits).  q8: m is int8_t[n], v is uint8_t[n], with
 * m_scale and v_scale float[ceil(n / AOQK_Q8_BLOCK)].  q4: m and v are
 * uint8_t[aoqk_moment_bytes(p, n)] (two codes a byte), m_scale and v_scale
 * float[ceil(n / AOQK_Q4_BLOCK)].
 */
struct aoqk_state {
	enum aoqk_precision precision;
	size_t n;
	void *master;
	void *m;
	void *v;
	float *m_scale;
	float *v_scale;
	/* AOQK_STATE_Q8 and AOQK_STATE_Q4 only, NULL otherwise: the fp32
	 * master split in two (kernels/README.md, "The split master"):
	 * master is then uint16_t[n], the master rounded to nearest bf16 (the
	 * parameter), and master_lo uint16_t[n] its low 16 bits, never
	 * exactly 0x8000.  The update is the precision's with an fp32 master
	 * bit for bit: same moments, same random bits, the same master but
	 * where its low half would be 0x8000 (it moves one ulp toward the
	 * side it rounds to). */
	void *master_lo;
	/* AOQK_STATE_Q8 and AOQK_STATE_Q4 only, instead of master_lo: a
	 * master of 24 bits split in two (kernels/README.md, "The 24-bit
	 * master"): master uint16_t[n], the master rounded half away from
	 * zero to bf16 (the parameter), master_lo8 int8_t[n] the master less
	 * it in units of 2^8 fp32 ulps (aoqk_split8_join, aoqk_split8).  The
	 * update is the precision's with an fp32 master, whose result is
	 * rounded to 24 bits stochastically (8 random bits, bits 16..23 of
	 * the word A that rounds a bf16 master) before the split: same
	 * moments, same random bits. */
	void *master_lo8;
};

/* The split master: the fp32 bits of a (hi, lo) pair: hi's, plus lo as a
 * signed 16-bit difference (b's low half; a pair rounded up has it
 * negative), and back. */
static inline uint32_t aoqk_split_join(uint16_t hi, uint16_t lo)
{
	return ((uint32_t)hi << 16) + (uint32_t)(int32_t)(int16_t)lo;
}

/* hi: b rounded to nearest even bf16 (a NaN stays a quiet NaN); lo: the
 * difference b - hi, a tie (+-0x8000) moved to +-0x7fff, that is one ulp
 * toward hi.  Otherwise lo is b's low half. */
static inline void aoqk_split(uint32_t b, uint16_t *hi, uint16_t *lo)
{
	bool nan = (b & 0x7f800000u) == 0x7f800000u && (b & 0x7fffffu);
	uint32_t top = (nan ? b | 0x400000u : b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
	int32_t d = (int32_t)(b - top);
	*hi = (uint16_t)(top >> 16);
	*lo = (uint16_t)(d > 0x7fff ? 0x7fff : d < -0x7fff ? -0x7fff : d);
}

/* The 24-bit master: the fp32 bits of (hi, lo8), hi's plus lo8 * 2^8,
 * and back.  b (whose low 8 bits are zero but for a NaN) splits exactly:
 * hi is b rounded half away from zero to bf16 (the top of b + 0x8000; a
 * NaN stays a quiet NaN), lo8 the difference in units of 2^8, which is
 * b's second byte taken as signed (-128..127; 0 for a NaN).  Unlike the
 * 16-bit split (aoqk_split), whose ties +0x8000 cannot be held, no
 * master moves: a tie rounds the parameter up instead of to even. */
static inline uint32_t aoqk_split8_join(uint16_t hi, int8_t lo8)
{
	return ((uint32_t)hi << 16) + (uint32_t)((int32_t)lo8 * 256);
}

static inline void aoqk_split8(uint32_t b, uint16_t *hi, int8_t *lo8)
{
	bool nan = (b & 0x7f800000u) == 0x7f800000u && (b & 0x7fffffu);
	*hi = (uint16_t)((nan ? b | 0x400000u : b + 0x8000u) >> 16);
	*lo8 = nan ? 0 : (int8_t)(uint8_t)(b >> 8);
}

/* The chunk to update and where its data is. */
struct aoqk_chunk {
	size_t begin; /* first element; a multiple of aoqk_block() for q8, q4 state */
	size_t count; /* elements; begin + count <= state->n */
	const void *grad;          /* grad of element begin; aligned to its element
	                            * type, any vector alignment */
	enum aoqk_dtype grad_dtype;
	float *acc;                /* optional fp32 accumulator of element begin: the
	                            * gradient used is acc[i] + grad[i], and acc[i]
	                            * is set to 0; NULL when there is none */
	void *param;               /* param out of element begin, or NULL */
	enum aoqk_dtype param_dtype;
	uint64_t seed;             /* stochastic rounding: seed for this step */
	bool skip_nonfinite;       /* if any gradient value in the chunk is not
	                            * finite, change nothing and report it */
};

/* What a chunk pass saw. */
/* The stochastic-rounding seed of one tensor's chunks: the session's seed
 * with the tensor's index mixed in.  The random bits are a function of
 * (seed, step, element index); with one seed for a whole session every
 * tensor would round its element i with the same bits at a step, and the
 * rounding errors of same-shaped tensors would move together: a deep
 * model's norm gains, all near 1.0 where a step is a small fraction of a
 * bf16 ulp, then jump up or down by an ulp in every layer at once
 * (kernels/README.md, "bf16 master with stochastic rounding"). */
static inline uint64_t aoqk_tensor_seed(uint64_t seed, uint32_t tensor)
{
	uint64_t z = ((uint64_t)tensor + 1) * 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return seed ^ z ^ (z >> 31);
}

struct aoqk_report {
	double sumsq;   /* sum of squares of the (scaled) gradient */
	bool nonfinite; /* some gradient value was inf or nan */
};

struct aoqk_kernel {
	const char *name; /* "scalar", "avx2", "avx512", "avx512bf16" */
	/* 0: every result is plain C's, bit for bit (but avx512bf16's bf16
	 * flush below 2^-126).  n > 0: the q8 and q4 precisions' update computes
	 * sqrt(v) and m / den within 2^-n of IEEE's (kernels/README.md, "q8:
	 * the approximate divider"); other precisions are still plain C's. */
	int q8_approx;
	/* Update one chunk.  Returns 0, or -EINVAL for arguments that violate
	 * the contract above (the daemon validates before calling). */
	int (*adam)(const struct aoqk_hparams *hp, const struct aoqk_state *st,
	            const struct aoqk_chunk *c, struct aoqk_report *rep);
	/* SGD (momentum, dampening, nesterov, L2 weight decay) and Lion, with
	 * the same chunk, dtype, report and skip conventions.  State: master and
	 * one moment in st->m (the momentum buffer; Lion's m); st->v and the q8
	 * scales are never touched and may be NULL, and so may st->m for SGD
	 * with momentum 0.  Precisions FP32, BF16 and BF16_ALL (bf16 m); Q8 and
	 * BF16_Q8, Q4 and BF16_Q4 return -EINVAL (kernels/README.md, "SGD and Lion"). */
	int (*sgd)(const struct aoqk_hparams *hp, const struct aoqk_state *st,
	           const struct aoqk_chunk *c, struct aoqk_report *rep);
	int (*lion)(const struct aoqk_hparams *hp, const struct aoqk_state *st,
	            const struct aoqk_chunk *c, struct aoqk_report *rep);
	/* acc[i] += grad[i] * scale for i < n (non-final micro-batch). */
	void (*accumulate)(float *acc, const void *grad, enum aoqk_dtype grad_dtype,
	                   float scale, size_t n);
	/* Added by the kernels: the report of a chunk without updating it, for
	 * a norm pass before updates that need the global norm (clipping) or a
	 * whole-step non-finite check.  sumsq of (acc[i] + grad[i]) * scale in
	 * double (acc may be NULL); nonfinite if any such value is inf or nan. */
	void (*sumsq)(const void *grad, enum aoqk_dtype grad_dtype, const float *acc,
	              float scale, size_t n, struct aoqk_report *rep);
};

/*
 * The best kernel this CPU runs, or the one named by `force` ("scalar",
 * "avx2", "avx512", "avx512bf16"; NULL or "auto" = best).  Returns NULL with
 * errno = ENOENT for an unknown name, ENOTSUP when the CPU lacks the
 * instructions of the forced variant.
 */
const struct aoqk_kernel *aoqk_select(const char *force);

/* Every variant compiled in and runnable here, best first, NULL-terminated. */
const struct aoqk_kernel *const *aoqk_available(void);

#ifdef __cplusplus
}
#endif

#endif
