/* SPDX-License-Identifier: MIT */
/*
 * The one kernel body, written once against a small vector layer that each
 * variant defines before including this file (kernel-scalar.c,
 * kernel-avx2.c, kernel-avx512.c).  Every variant runs the same IEEE
 * operations in the same order, without FMA contraction, so all variants
 * give bit-identical state and parameters (README.md lists the two
 * exceptions: avx512bf16 flushes bf16 outputs below 2^-126 to zero, and
 * the AVX-512 variants' q8 update approximates its sqrt and division,
 * vf_q8_sqrt and vf_q8_div, which KQ8_APPROX names).
 *
 * The includer defines:
 *   W                     lanes per vector
 *   vf, vi, vh, vacc      float, int32, 16-bit and sum-of-squares vector types
 *   KVAR                  the variant's name token (scalar, avx2, ...)
 *   KQ8_APPROX            0: vf_q8_sqrt and vf_q8_div are IEEE's sqrt and
 *                         division; n: each within 2^-n of it
 *   KHAS_NT               1: the default table writes parameters with
 *                         non-temporal stores and a "-cached" twin with
 *                         plain stores is built too
 *   KHAS_CODES2           (optional) vb_store_codes2 exists: q8's encode
 *                         packs the codes of two vectors at once
 * and the vf_, vi_, vh_, vb_, vacc_ functions used below.
 */

#define KCAT2(a, b) a##b
#define KCAT(a, b) KCAT2(a, b)
#define KSTR2(a) #a
#define KSTR(a) KSTR2(a)

/* Benchmark-only builds that drop a stage of the q8 path (README.md,
 * "Where the time goes"); never in the library. */
#ifndef AOQK_DROP_DECODE
#define AOQK_DROP_DECODE 0
#endif
#ifndef AOQK_DROP_HASH
#define AOQK_DROP_HASH 0
#endif
#ifndef AOQK_DROP_ENCODE
#define AOQK_DROP_ENCODE 0
#endif
/* 1: the q8 step's sqrt becomes a multiply; 2: its division too (the
 * divider's share) */
#ifndef AOQK_DROP_DIV
#define AOQK_DROP_DIV 0
#endif

enum { PD_FP32 = AOQK_FP32, PD_BF16 = AOQK_BF16, PD_FP16 = AOQK_FP16, PD_NONE = 3 };

struct kptrs {
	const void *grad;
	float *acc;
	void *master;
	void *lo; /* the split master's low halves (aoqk_state.master_lo) */
	void *lo8; /* the 24-bit master's low bytes (aoqk_state.master_lo8) */
	void *m;
	void *v;
	void *param;
};

static AOQK_ALWAYS_INLINE vf load_grad(const void *p, size_t j, const int gd)
{
	if (gd == AOQK_FP32)
		return vf_loadu((const float *)p + j);
	if (gd == AOQK_BF16)
		return vh_bf16_to_f(vh_loadu((const uint16_t *)p + j));
	return vh_f16_to_f(vh_loadu((const uint16_t *)p + j));
}

static AOQK_ALWAYS_INLINE void store_param(void *p, size_t j, vf x, vh xb, const int pd,
                                           const int have_bf16, const int nt)
{
	if (pd == PD_FP32) {
		if (nt)
			vf_stream((float *)p + j, x);
		else
			vf_storeu((float *)p + j, x);
	} else if (pd == PD_BF16 || pd == PD_FP16) {
		vh h = pd == PD_FP16 ? vf_to_f16(x) : have_bf16 ? xb : vf_to_bf16(x);
		if (nt)
			vh_stream((uint16_t *)p + j, h);
		else
			vh_storeu((uint16_t *)p + j, h);
	}
}

/* The split master (aoq-kernel.h, aoqk_split_join and aoqk_split),
 * lane-wise: the fp32 value of (hi, lo) ... */
static AOQK_ALWAYS_INLINE vf split_join(vh hi, vh lo)
{
	return vi_as_vf(vi_add(vf_as_vi(vh_bf16_to_f(hi)), vh_to_vi_s(lo)));
}

/* ... and x's halves: *hi the top of x rounded to nearest even (a NaN
 * quiet), *lo the rest, x - *hi, a tie moved one ulp toward *hi.  Where
 * no lane is NaN or a tie (vf_split_plain: all but about one vector in
 * 4096), x - *hi is x's low 16 bits themselves: *hi only carries into the
 * top half (rounding up takes 2^16 from the difference, which its low 16
 * bits do not see), so the pair is the rounding sum's top half and x's
 * low half, one bit-select. */
static AOQK_ALWAYS_INLINE void split_halves(vf x, vh *hi, vh *lo)
{
	vi b = vf_as_vi(x);
	vi odd = vi_and(vi_srli(b, 16), vi_set1(1u));
	vi sum = vi_add(vi_add(b, vi_set1(0x7fffu)), odd);
	if (vf_split_plain(x)) {
		vi_halves(vi_bitsel(vi_set1(0xffff0000u), sum, b), lo, hi);
		return;
	}
	vi top = vi_and(sum, vi_set1(0xffff0000u));
	top = vi_select_nan(x, vi_and(vi_or(b, vi_set1(0x400000u)), vi_set1(0xffff0000u)), top);
	vi d = vi_max_s(vi_min_s(vi_sub(b, top), vi_set1(0x7fffu)), vi_set1((uint32_t)-0x7fff));
	vi_halves(vi_bitsel(vi_set1(0xffffu), d, top), lo, hi);
}

#if W >= 8
#ifdef KROUND_HI16_GENERIC
/* a and b rounded to nearest even bf16, 2 W in element order, where
 * vf_split_plain2 holds: the rounding sums' top halves */
static AOQK_ALWAYS_INLINE vi vi_round_hi16(vi a, vi b)
{
	vi sa = vi_add(vi_add(a, vi_set1(0x7fffu)), vi_and(vi_srli(a, 16), vi_set1(1u)));
	vi sb = vi_add(vi_add(b, vi_set1(0x7fffu)), vi_and(vi_srli(b, 16), vi_set1(1u)));
	return vi_pack_hi16(sa, sb);
}
#endif

/* 2 W bf16 parameters at p (the pair loops; pd PD_BF16, else none) */
static AOQK_ALWAYS_INLINE void store_param2(uint16_t *p, vi h2, const int pd, const int nt)
{
	if (pd != PD_BF16)
		return;
	if (nt)
		vi_stream((uint32_t *)(void *)p, h2);
	else
		vi_storeu((uint32_t *)(void *)p, h2);
}

/* split_halves for two vectors (bits a, then b; run_chunk's pair loop):
 * the high halves to hi (and the parameter), the low ones to lo.  Where
 * no lane of either is NaN, a tie or (AVX512_BF16) denormal, the low
 * halves are the bits' own and the high ones their rounding, 2 W of each
 * in one register: no per-vector halving. */
static AOQK_ALWAYS_INLINE void split_store2(vi a, vi b, uint16_t *hi, uint16_t *lo, uint16_t *param,
                                            const int pd, const int nt)
{
	vi h2;
	if (vf_split_plain2(vi_as_vf(a), vi_as_vf(b))) {
		h2 = vi_round_hi16(a, b);
		vi_storeu((uint32_t *)(void *)hi, h2);
		vi_storeu((uint32_t *)(void *)lo, vi_pack_lo16(a, b));
	} else {
		vh hh, ll;
		split_halves(vi_as_vf(a), &hh, &ll);
		vh_storeu(hi, hh);
		vh_storeu(lo, ll);
		split_halves(vi_as_vf(b), &hh, &ll);
		vh_storeu(hi + W, hh);
		vh_storeu(lo + W, ll);
		h2 = vi_loadu((const uint32_t *)(const void *)hi);
	}
	store_param2(param, h2, pd, nt);
}
#endif

/* The 24-bit master (aoq-kernel.h, aoqk_split8_join and aoqk_split8),
 * lane-wise: its fp32 value from hi and the low bytes at
 * p ... */
static AOQK_ALWAYS_INLINE vf split8_join(vh hi, const int8_t *p)
{
	return vi_as_vf(vi_add(vf_as_vi(vh_bf16_to_f(hi)), vi_slli(vb_load_i8(p), 8)));
}

/* ... x's bits b rounded to 24 bits with the random bits 16..23 of h
 * (b + r with its low 8 bits cleared: up with probability (b & 0xff) /
 * 256; a NaN quieted instead, as the sum could carry out of it) ... */
static AOQK_ALWAYS_INLINE vi sr24(vi b, vi h)
{
	return vi_and(vi_add_or_quiet(vi_as_vf(b), b, vi_and(vi_srli(h, 16), vi_set1(0xffu))), vi_set1(~0xffu));
}

/* ... and such bits t split: the high half returned (the top of t +
 * 0x8000, a NaN's quieted), t's second byte, which is the signed rest,
 * stored at lo8 (0 for a NaN) */
static AOQK_ALWAYS_INLINE vh split8_store(vi t, int8_t *lo8)
{
	vi top = vi_select_nan(vi_as_vf(t), t, vi_add(t, vi_set1(0x8000u)));
	vb_store_u8((uint8_t *)lo8, vi_select_nan(vi_as_vf(t), vi_zero(), vi_srli(t, 8)));
	return vi_to_vh(vi_srli(top, 16));
}

#if W >= 8
#ifndef KHAS_BYTE1X2
/* the second byte of each lane of a, then of b, to p (2 W bytes) */
static AOQK_ALWAYS_INLINE void vi_store_byte1x2(uint8_t *p, vi a, vi b)
{
	vb_store_u8(p, vi_srli(a, 8));
	vb_store_u8(p + W, vi_srli(b, 8));
}
#endif

/* split8_store for two vectors of bits a, b and their random words ha,
 * hb (run_chunk's pair loop): where neither has a NaN lane, the high
 * halves of both in one permute and the low bytes together */
static AOQK_ALWAYS_INLINE void split8_store2(vi a, vi ha, vi b, vi hb, uint16_t *hi, int8_t *lo8,
                                             uint16_t *param, const int pd, const int nt)
{
	vi ta = sr24(a, ha), tb = sr24(b, hb), h2;
	if (vf_nonan2(vi_as_vf(ta), vi_as_vf(tb))) {
		h2 = vi_pack_hi16(vi_add(ta, vi_set1(0x8000u)), vi_add(tb, vi_set1(0x8000u)));
		vi_storeu((uint32_t *)(void *)hi, h2);
		vi_store_byte1x2((uint8_t *)lo8, ta, tb);
	} else {
		vh_storeu(hi, split8_store(ta, lo8));
		vh_storeu(hi + W, split8_store(tb, lo8 + W));
		h2 = vi_loadu((const uint32_t *)(const void *)hi);
	}
	store_param2(param, h2, pd, nt);
}
#endif

/* Stochastic rounding of x to bf16 with the hash of global index i0 + lane. */
/* aoqk_fmix32 of (global index i0 + lane) + key, lane-wise. */
static AOQK_ALWAYS_INLINE vi sr_hash(uint32_t key, uint64_t i0)
{
	if (W > 1 && (uint32_t)i0 > UINT32_MAX - (W - 1)) {
		/* the vector crosses a multiple of 2^32 (a chunk of a huge
		 * tensor that does not start on a vector boundary): per lane */
		_Alignas(64) uint32_t t[W];
		for (unsigned l = 0; l < W; l++)
			t[l] = aoqk_fmix32((uint32_t)(i0 + l) + aoqk_sr_vkey(key, i0 + l));
		return vi_loadu(t);
	}
	vi h = vi_add(vi_iota((uint32_t)i0), vi_set1(aoqk_sr_vkey(key, i0)));
	h = vi_xor(h, vi_srli(h, 16));
	h = vi_mullo(h, vi_set1(0x85ebca6bu));
	h = vi_xor(h, vi_srli(h, 13));
	h = vi_mullo(h, vi_set1(0xc2b2ae35u));
	h = vi_xor(h, vi_srli(h, 16));
	return h;
}

/* q8 states' random bits (README.md, "bf16 master with stochastic
 * rounding"): per block, 16 words seeded from the index hash of the block's
 * first 16 elements, taken as four 128-bit AES states A; before each group
 * of 16 elements A = AESENC(A, RK1) (rng_step), and the group's second
 * word is B = AESENC(A, RK2) (rng_second).  One instruction each on
 * AVX-512 with VAES.  The same bits for every vector width: a variant
 * with W < 16 keeps 16 / W vectors and uses them in turn; plain C (W = 1)
 * steps a state's four words when it reaches the first of them. */
#define XS_N (16 / W)

static AOQK_ALWAYS_INLINE vi rng_step(vi *xs, unsigned slot)
{
#if W == 1
	if (slot % 4 == 0)
		aoqk_aesenc_soft(&xs[slot], aoqk_rk[0]);
	return xs[slot];
#else
	return xs[slot] = vi_aesenc(xs[slot], 1);
#endif
}

/* B for the W elements whose A is a; plain C: lane4 is the element's
 * 128-bit state (its four words of A), sub the element's word in it, and
 * the state's B is computed into bc at its first word (the encode loop
 * visits the words in order). */
static AOQK_ALWAYS_INLINE vi rng_second(vi a, const uint32_t *lane4, unsigned sub, uint32_t *bc)
{
#if W == 1
	(void)a;
	if (sub == 0) {
		memcpy(bc, lane4, 4 * sizeof(*bc));
		aoqk_aesenc_soft(bc, aoqk_rk[1]);
	}
	return bc[sub];
#else
	(void)lane4;
	(void)sub;
	(void)bc;
	return vi_aesenc(a, 2);
#endif
}

/* Stochastic rounding of x to bf16 with 16 random bits per lane in r;
 * NaN lanes: the top half quieted (as vcvtneps2bf16), not b + r, which
 * could carry out of the NaN. */
static AOQK_ALWAYS_INLINE vi sr_bf16(vf x, vi r)
{
	return vi_srli(vi_add_or_quiet(x, vf_as_vi(x), r), 16);
}

/* Format 2's code offsets have zero low bits, so c + C0 = c | C0: the
 * decode puts the code in with one and-or (vpternlogd), and the encode's
 * low 7 (m) or 8 (v) bits of the shifted pattern are the code itself. */
_Static_assert((AOQK_Q8_M_C0 & 0x7fu) == 0 && (AOQK_Q8_U_C0 & 0xffu) == 0, "q8 code offsets");

/* Decode q8 codes (format 2, aoq-convert.h): m = +-(F(c) - K) * sm,
 * u = sqrt(v) = (F(c) - K) * su, with sm, su = scale / TOP.  F - K is
 * exact, so this is aoqk_q8_m_decode / aoqk_q8_v_decode bit for bit.
 * fmadec (the fast loops): fma(F, s, nk) with nk = -K * s, one
 * operation less and the same bits where K * s is exact (K is a power of
 * two: s zero or a normal number whose product with K is normal, and F *
 * s finite), which run_chunk checks per block (q8_fma_ok). */
static AOQK_ALWAYS_INLINE int q8_fma_ok(float s)
{
	return s == 0.0f || (s >= 0x1p-100f && s <= 0x1p100f);
}

static AOQK_ALWAYS_INLINE vf q8_m_decode(const uint8_t *p, vf sm, vf nk, const int fmadec)
{
	/* sign-extended: bit 31 is the code's bit 7, the sign, which the mask
	 * keeps out of the pattern and the xor-and puts on x without a shift */
	vi b = vb_load_i8((const int8_t *)p);
	vi e = vi_andor(vi_slli(b, AOQK_Q8_M_SHIFT), vi_set1(0x7fu << AOQK_Q8_M_SHIFT),
	                vi_set1(AOQK_Q8_M_C0 << AOQK_Q8_M_SHIFT));
	vf x = fmadec ? vf_fma(vi_as_vf(e), sm, nk) : vf_mul(vf_sub(vi_as_vf(e), vf_set1(AOQK_Q8_M_K)), sm);
	return vi_as_vf(vi_xorand(vf_as_vi(x), b, vi_set1(0x80000000u)));
}

static AOQK_ALWAYS_INLINE vf q8_u_decode(const uint8_t *p, vf su, vf nk, const int fmadec)
{
	vi e = vi_add(vi_slli(vb_load_u8(p), AOQK_Q8_U_SHIFT), vi_set1(AOQK_Q8_U_C0 << AOQK_Q8_U_SHIFT));
	return fmadec ? vf_fma(vi_as_vf(e), su, nk) : vf_mul(vf_sub(vi_as_vf(e), vf_set1(AOQK_Q8_U_K)), su);
}

/* q4: the codes of the W elements from cj (an index in the codes at p),
 * each in the low 4 bits of its lane (vt_lookup reads no more): bytes
 * aoqk_q4_byte(cj) on, low nibbles for the first 16 elements of a group,
 * high nibbles for the rest. */
static AOQK_ALWAYS_INLINE vi q4_idx(const void *p, size_t cj)
{
	vi c = vb_load_u8((const uint8_t *)p + aoqk_q4_byte(cj));
	return cj & 16 ? vi_srli(c, 4) : c;
}

/* The per-call constants broadcast once, held in registers: a struct
 * passed by value into the always-inlined step, never through memory that
 * the state stores could alias. */
struct kvec {
	vf w1, w1c, b2, w2, nstep, bc2s, inv_bc2s, eps, decay, wd, gscale;
	vf b1, nlr, mom, damp1; /* SGD, Lion */
	int lerp_small, adamw, l2;
	int wd_on, mom_on, first, nesterov;
	uint32_t srkey;
};

static AOQK_ALWAYS_INLINE struct kvec kvec_make(const struct aoqk_consts *k)
{
	struct kvec c = {
		.w1 = vf_set1(k->w1),
		.w1c = vf_set1(k->w1c),
		.b2 = vf_set1(k->b2),
		.w2 = vf_set1(k->w2),
		.nstep = vf_set1(k->nstep),
		.bc2s = vf_set1(k->bc2s),
		.inv_bc2s = vf_set1(1.0f / k->bc2s),
		.eps = vf_set1(k->eps),
		.decay = vf_set1(k->decay),
		.wd = vf_set1(k->wd),
		.gscale = vf_set1(k->gscale),
		.b1 = vf_set1(k->b1),
		.nlr = vf_set1(k->nlr),
		.mom = vf_set1(k->mom),
		.damp1 = vf_set1(k->damp1),
		.wd_on = k->wd_on,
		.mom_on = k->mom_on,
		.first = k->first,
		.nesterov = k->nesterov,
		.lerp_small = k->lerp_small,
		.adamw = k->adamw,
		.l2 = k->l2,
		.srkey = k->srkey,
	};
	return c;
}

/* One vector of the update, elements [j, j + W) of the pointers in p.
 * q8: the new m and sqrt(v) go to bm/bu (block buffers), the maxima to
 * mx_m/mx_u; the codes are written by encode_block (run_chunk).
 * fast = 2 (bf16 master, run_chunk's pair loop): the master is neither
 * rounded nor stored; vstep returns bits(p) + r, whose top halves the
 * caller stores for two vectors at once. */
static AOQK_ALWAYS_INLINE vi vstep(const struct kvec kc, const struct kptrs *p,
                                     size_t j, uint64_t gi, const int prec, const int gd,
                                     const int pd, const int nt, int want_ss, vacc *ss,
                                     float *bm, float *bu, uint32_t *hb, vi *xs, unsigned slot,
                                     vf *sq, vf sm, vf su, vf nkm, vf nku, vf *mx_m, vf *mx_u,
                                     const int fast, size_t cj, const vi *q4c, vtab tm, vtab tv,
                                     const int split)
{
	/* q8: the blocked path (q8 or q4), whose moments go through the
	 * block buffers; q4 differs only in its codes (decoded here by table,
	 * cj the element's index in p->m's codes, and encoded by q4_encode) */
	const int q8 = aoqk_precision_blocked(prec);
	const int q4 = aoqk_precision_q4(prec);
	const int bfm = aoqk_precision_bf16_master(prec);
	const int bfmom = aoqk_precision_bf16_moments(prec);
	vf g = load_grad(p->grad, j, gd);
	vf pw, m, v, u;

	/* fast (a compile-time 1): the common case's flags are constants, no
	 * accumulator, the report wanted, no L2 weight decay, the small-weight
	 * lerp (the tests of the runtime flags cost q8's vector ports;
	 * run_chunk).  It multiplies by the decay also without weight decay,
	 * where the decay is exactly 1 and the product p itself. */
	if (!fast && p->acc) {
		g = vf_add(vf_loadu(p->acc + j), g);
		vf_storeu(p->acc + j, vf_zero());
	}
	g = vf_mul(g, kc.gscale);
	/* the report: fast sums g * g in fp32 lanes of at most 16 terms each
	 * (sq, added to the double sum once per block by run_chunk: a
	 * relative error below 16 * 2^-24), the rest in double */
	if (fast)
		*sq = vf_fma(g, g, *sq);
	else if (want_ss)
		vacc_add_sq(ss, g);

	if (split == 2)
		pw = split8_join(vh_loadu((const uint16_t *)p->master + j), (const int8_t *)p->lo8 + j);
	else if (split)
		pw = split_join(vh_loadu((const uint16_t *)p->master + j), vh_loadu((const uint16_t *)p->lo + j));
	else if (bfm)
		pw = vh_bf16_to_f(vh_loadu((const uint16_t *)p->master + j));
	else
		pw = vf_loadu((const float *)p->master + j);
	/* torch: grad + wd * param (_foreach_add, alpha) */
	if (!fast && kc.l2)
		g = vf_fma(kc.wd, pw, g);
	if (fast || kc.adamw)
		pw = vf_mul(pw, kc.decay);

	if (q8 && AOQK_DROP_DECODE) {
		m = sm;
		v = su;
	} else if (q4) {
		/* the codes of the W elements from cj (q4_idx), or q4c's (the
		 * pair loop loads a group's bytes once for both halves); the
		 * tables hold the block's 16 values of m and of v * beta2
		 * (run_chunk) */
		vi cm = q4c ? q4c[0] : q4_idx(p->m, cj);
		vi cu = q4c ? q4c[1] : q4_idx(p->v, cj);
		m = vt_lookup(tm, cm);
		v = vt_lookup(tv, cu);
	} else if (q8) {
		m = q8_m_decode((const uint8_t *)p->m + j, sm, nkm, fast);
		/* su carries sqrt(beta2) (run_chunk): u = sqrt(v * beta2),
		 * whose square is the v * beta2 below, one multiply less */
		u = q8_u_decode((const uint8_t *)p->v + j, su, nku, fast);
		v = vf_mul(u, u);
	} else if (bfmom) {
		m = vh_bf16_to_f(vh_loadu((const uint16_t *)p->m + j));
		v = vh_bf16_to_f(vh_loadu((const uint16_t *)p->v + j));
	} else {
		m = vf_loadu((const float *)p->m + j);
		v = vf_loadu((const float *)p->v + j);
	}

	/* The roundings of torch's foreach AdamW on CUDA, whose kernels
	 * contract a * b + c into one FMA (README.md, "Numerics").
	 * exp_avg.lerp_(grad, 1 - beta1): */
	if (fast || kc.lerp_small)
		m = vf_fma(kc.w1, vf_sub(g, m), m);
	else
		m = vf_fnma(vf_sub(g, m), kc.w1c, g);
	/* exp_avg_sq.mul_(beta2); .addcmul_(grad, grad, value=1 - beta2) */
	v = vf_fma(kc.w2, vf_mul(g, g), q8 ? v : vf_mul(v, kc.b2));
	u = q8 && AOQK_DROP_DIV ? vf_mul(v, kc.b2) : q8 ? vf_q8_sqrt(v) : vf_sqrt(v);
	/* denom = sqrt(v) / sqrt(bc2) + eps; param.addcdiv_(m, denom, -step_size).
	 * q8 is compute-bound, so it computes fma(sqrt(v), 1 / sqrt(bc2), eps)
	 * instead: one divider operation and one vector operation less, within
	 * about 1 ulp of torch's denom. */
	vf den = q8 ? vf_fma(u, kc.inv_bc2s, kc.eps) : vf_add(vf_div(u, kc.bc2s), kc.eps);
	pw = vf_fma(kc.nstep, q8 && AOQK_DROP_DIV == 2 ? vf_mul(m, den) : q8 ? vf_q8_div(m, den) : vf_div(m, den), pw);

	if (q8) {
		vf_storeu(bm, m);
		vf_storeu(bu, u);
		*mx_m = vf_max(vf_abs(m), *mx_m);
		*mx_u = vf_max(u, *mx_u); /* u = sqrt(v) >= 0 (or NaN, which max skips) */
	} else if (!bfmom) {
		vf_storeu((float *)p->m + j, m);
		vf_storeu((float *)p->v + j, v);
	}

	/* one hash per element: bits 16..31 round the bf16 master, bits 0..15
	 * the two bf16 moments (8 random bits each, the rest of the 16 at one
	 * half: P(up) within 2^-9 of exact).  q8: the word A of rng_step,
	 * whose bits 16..31 round a bf16 master and bits 0..7 the v code (in
	 * q8_encode, which draws m's from B); with an fp32 master q8_encode
	 * steps it, with a bf16 master this does and hands A on through hb. */
	vi h = vi_zero();
	if (q8 && (bfm || split == 2) && !AOQK_DROP_HASH)
		h = rng_step(xs, slot);
	else if (bfm && !q8 && !AOQK_DROP_HASH)
		h = sr_hash(kc.srkey, gi);
	if (q8 && (bfm || split == 2)) {
#if W == 1
		/* q8_encode's rng_second reads the state's four words */
		if (slot % 4 == 0)
			memcpy(hb, &xs[slot], 4 * sizeof(*hb));
#endif
		vi_storeu(hb, h);
	}
	if (bfmom) {
		vi rm = vi_or(vi_slli(vi_and(h, vi_set1(0xffu)), 8), vi_set1(0x80u));
		vi rv = vi_or(vi_and(h, vi_set1(0xff00u)), vi_set1(0x80u));
		vh_storeu((uint16_t *)p->m + j, vi_to_vh(sr_bf16(m, rm)));
		vh_storeu((uint16_t *)p->v + j, vi_to_vh(sr_bf16(v, rv)));
	}
	if (bfm && fast == 2)
		return vi_add(vf_as_vi(pw), vi_srli(h, 16));
	if (split && fast == 2)
		return vf_as_vi(pw); /* the pair loop splits two at once (split_store2, split8_store2) */
	if (bfm) {
		vi s = sr_bf16(pw, vi_srli(h, 16));
		vh sh = vi_to_vh(s);
		vh_storeu((uint16_t *)p->master + j, sh);
		if (pd != PD_NONE)
			store_param(p->param, j, vi_as_vf(vi_slli(s, 16)), sh, pd, 1, nt);
	} else if (split == 2) {
		vi t = sr24(vf_as_vi(pw), h);
		vh hh = split8_store(t, (int8_t *)p->lo8 + j);
		vh_storeu((uint16_t *)p->master + j, hh);
		if (pd != PD_NONE)
			store_param(p->param, j, vi_as_vf(t), hh, pd, 1, nt);
	} else if (split) {
		vh hh, lo;
		split_halves(pw, &hh, &lo);
		vh_storeu((uint16_t *)p->master + j, hh);
		vh_storeu((uint16_t *)p->lo + j, lo);
		if (pd != PD_NONE)
			store_param(p->param, j, pw, hh, pd, 1, nt);
	} else {
		vf_storeu((float *)p->master + j, pw);
		if (pd != PD_NONE)
			store_param(p->param, j, pw, vh_zero(), pd, 0, nt);
	}
	return vi_zero();
}

/* Encode W elements of the block buffers into q8 codes (format 2,
 * aoq-convert.h): the code of x * inv + K is the top bits of its fp32
 * pattern.  Stochastic rounding: 8 random bits (m: bits 11..18 of the
 * group's word B, v: bits 0..7 of A) at the top of the discarded bits,
 * the rest at one half, added before the shift, so P(up) is within 2^-9
 * of the discarded fraction (E[code] is the exact code position to that
 * much) and the moments do not stick (a step moves v by 1 - beta2 = 0.1%,
 * far below one code's spacing). */
static AOQK_ALWAYS_INLINE void q8_codes(const float *bm, const float *bu, vi a, vi b, vf inv_m, vf inv_u,
                                        vi *cmv, vi *cuv)
{
	/* r = 8 random bits at the top of the discarded ones, the rest at
	 * one half: m's are B's bits 11..18 in place (one vpternlogd), v's
	 * A's bits 0..7 shifted there */
	vi rm = vi_andor(b, vi_set1(0xffu << (AOQK_Q8_M_SHIFT - 8)), vi_set1(1u << (AOQK_Q8_M_SHIFT - 9)));
	vi ru = vi_andor(vi_slli(a, AOQK_Q8_U_SHIFT - 8), vi_set1(0xffu << (AOQK_Q8_U_SHIFT - 8)),
	                 vi_set1(1u << (AOQK_Q8_U_SHIFT - 9)));
	vf m = vf_loadu(bm);
	vf x = vf_fma(vf_abs(m), inv_m, vf_set1(AOQK_Q8_M_K));
	/* no clamp to the top code: |m| <= the block max s and inv = TOP / s
	 * rounded, so x <= TOP + K + 1 ulp, whose bits plus r stay below the
	 * next binade.  The shifted pattern is c | C0 (C0's low 7 bits are
	 * zero), shifted left so that the code is bits 24..30: the top byte
	 * is the code byte once bit 31 is m's sign, one bit-select with m.
	 * (A NaN m gives the bits of its out-of-range pattern that land
	 * there, alike in every variant.) */
	vi c = vi_slli(vi_add(vf_as_vi(x), rm), 24 - AOQK_Q8_M_SHIFT);
	c = vi_bitsel(vi_set1(0x7fu << 24), c, vf_as_vi(m));

	vf u = vf_loadu(bu);
	vf y = vf_fma(u, inv_u, vf_set1(AOQK_Q8_U_K));
	vi q = vi_srli(vi_add(vf_as_vi(y), ru), AOQK_Q8_U_SHIFT);
	/* q = code | C0, stored by its low 8 bits.  A non-zero v never
	 * becomes code 0: u = sqrt(v) >= 0, and a non-zero u is at least
	 * sqrt(2^-149), whose bits exceed C0 + 1, so max(q, min(bits(u),
	 * C0 + 1)) is q, or C0 + 1 (code 1) where u > 0 and q is code 0. */
	*cuv = vi_max_s(q, vi_min_u(vf_as_vi(u), vi_set1(AOQK_Q8_U_C0 + 1)));
	*cmv = c;
}

/* The m code of each lane is the top byte of c, the v code the low byte
 * of q (q8_codes). */
static AOQK_ALWAYS_INLINE void q8_encode(const float *bm, const float *bu, vi a, vi b,
                                         uint8_t *cm, uint8_t *cu, vf inv_m, vf inv_u)
{
	vi c, q;
	q8_codes(bm, bu, a, b, inv_m, inv_u, &c, &q);
	vb_store_codes(cm, cu, c, q);
}

/* q4 codes of W elements of the block buffers (aoq-convert.h): as
 * q8_codes with 4-bit codes.  m rounds to the nearest code (stochastic
 * rounding of a 4-bit m adds its noise to every step: kernels/README.md,
 * "q4 moments"), so only A's bits are drawn: v's 8 random bits, bits 0..7
 * of A shifted to the top of the discarded ones, the rest at one half.
 * cmv: m's code in bits 28..30 and its sign in bit 31; cuv: v's code in
 * bits 0..3, or with hi (the elements of a group's high nibbles) in bits
 * 4..7 where q4_merge wants it (C0's bits above, other bits below).  No
 * clamp, for q8_codes' reason. */
static AOQK_ALWAYS_INLINE void q4_codes(const float *bm, const float *bu, vi a, vf inv_m, vf inv_u,
                                        const int hi, vi *cmv, vi *cuv)
{
	vi rm = vi_set1(1u << (AOQK_Q4_M_SHIFT - 1));
	vi ru = vi_andor(vi_slli(a, AOQK_Q4_U_SHIFT - 8), vi_set1(0xffu << (AOQK_Q4_U_SHIFT - 8)),
	                 vi_set1(1u << (AOQK_Q4_U_SHIFT - 9)));
	vf m = vf_loadu(bm);
	vf x = vf_fma(vf_abs(m), inv_m, vf_set1(AOQK_Q4_M_K));
	/* the pattern's code bits to 28..30; C0's bit 3 lands in bit 31,
	 * which the bit-select replaces with m's sign */
	vi c = vi_slli(vi_add(vf_as_vi(x), rm), 28 - AOQK_Q4_M_SHIFT);
	*cmv = vi_bitsel(vi_set1(0x7u << 28), c, vf_as_vi(m));

	vf u = vf_loadu(bu);
	vf y = vf_fma(u, inv_u, vf_set1(AOQK_Q4_U_K));
	/* hi: 4 bits less shifted out, the same code 16 times over (the
	 * max below commutes with the shift) */
	const unsigned s = hi ? 4 : 0;
	vi q = vi_srli(vi_add(vf_as_vi(y), ru), AOQK_Q4_U_SHIFT - s);
	/* a non-zero v never becomes code 0 (q8_codes) */
	*cuv = vi_max_s(q, vi_min_u(vf_as_vi(u), vi_set1((AOQK_Q4_U_C0 + 1) << s)));
}

/* The codes of the W elements at l (c0, q0) and of the W at l + 16 (c1,
 * q1, hi) of a group as bytes: m's in the top byte of each lane of *x,
 * v's in the low byte of *y. */
static AOQK_ALWAYS_INLINE void q4_merge(vi c0, vi q0, vi c1, vi q1, vi *x, vi *y)
{
	*x = vi_bitsel(vi_set1(0xf0000000u), c1, vi_srli(c0, 4));
	*y = vi_bitsel(vi_set1(0xf0u), q1, q0);
}

/* Stores them: vb_store_codes' W bytes each. */
static AOQK_ALWAYS_INLINE void q4_store(uint8_t *cm, uint8_t *cu, vi c0, vi q0, vi c1, vi q1)
{
	vi x, y;
	q4_merge(c0, q0, c1, q1, &x, &y);
	vb_store_codes(cm, cu, x, y);
}

/* Encode a block of len elements from the buffers bm, bu (and hb: A with
 * a bf16 master) into its codes at cm, cu, with the factors im, iu =
 * TOP / the block's scales; e0 is the block's first element in the
 * tensor.  With an fp32 master (!upd_rng) the random words A are drawn
 * here (xs); q4 pads the buffers to whole groups. */
static AOQK_ALWAYS_INLINE void encode_block(const int prec, const int upd_rng, uint8_t *cm, uint8_t *cu,
                                            size_t len, float *bm, float *bu, uint32_t *hb, vi *xs, uint32_t *bc,
                                            uint32_t srkey, uint64_t e0, vf im, vf iu)
{
	const int q4 = aoqk_precision_q4(prec);

	if (!upd_rng)
		for (unsigned g = 0; g < XS_N; g++)
			xs[g] = sr_hash(srkey, e0 + g * W);
	/* the random bits: A is the update's with a bf16 or 24-bit master
	 * (it rounded the master with bits 16..31 or 16..23: upd_rng), else
	 * steps here; B is computed here */
#define Q8_A(e) \
	(upd_rng ? vi_loadu(hb + (e)) \
	 : AOQK_DROP_HASH ? vi_zero() : rng_step(xs, ((e) / W) % XS_N))
	/* plain C: the four words of the element's AES state */
#define Q8_LANE(e) \
	(upd_rng ? hb + ((e) & ~(size_t)3) \
	 : (const uint32_t *)(const void *)&xs[((e) / W) % XS_N & ~3u])
	if (q4) {
		/* whole groups: the last one's elements past the end
		 * encode zeros (code 0, whatever the random bits) */
		size_t lg = (len + AOQK_Q4_GROUP - 1) / AOQK_Q4_GROUP * AOQK_Q4_GROUP;
		for (size_t e = len; e < lg; e++) {
			bm[e] = 0.0f;
			bu[e] = 0.0f;
			hb[e] = 0;
		}
#if W == 1
		/* the AES states' words in element order (rng_step),
		 * then the nibbles paired */
		_Alignas(64) uint32_t tc[AOQK_Q4_BLOCK], tq[AOQK_Q4_BLOCK];
		for (size_t e = 0; e < lg && !AOQK_DROP_ENCODE; e++) {
			q4_codes(bm + e, bu + e, Q8_A(e), im, iu, (e & 16) != 0, &tc[e], &tq[e]);
		}
		for (size_t e = 0; e < lg && !AOQK_DROP_ENCODE; e += AOQK_Q4_GROUP)
			for (size_t l = 0; l < AOQK_Q4_GROUP / 2; l++)
				q4_store(cm + e / 2 + l, cu + e / 2 + l, tc[e + l], tq[e + l], tc[e + l + 16],
				         tq[e + l + 16]);
#else
		/* the vectors at l and l + 16 of a group together: each
		 * AES slot is still stepped in the order of its elements
		 * (slot (l / W) % XS_N is both's, l's first) */
		size_t e = 0;
#if defined(KHAS_CODES2) && 2 * W == AOQK_Q4_GROUP
		/* two groups at a time, their bytes stored together
		 * (vb_store_codes2) */
		for (; e + 2 * AOQK_Q4_GROUP <= lg && !AOQK_DROP_ENCODE; e += 2 * AOQK_Q4_GROUP) {
			vi c0, q0, c1, q1, c2, q2, c3, q3, x0, y0, x1, y1;
			q4_codes(bm + e, bu + e, Q8_A(e), im, iu, 0, &c0, &q0);
			q4_codes(bm + e + 16, bu + e + 16, Q8_A(e + 16), im, iu, 1, &c1, &q1);
			q4_codes(bm + e + 32, bu + e + 32, Q8_A(e + 32), im, iu, 0, &c2, &q2);
			q4_codes(bm + e + 48, bu + e + 48, Q8_A(e + 48), im, iu, 1, &c3, &q3);
			q4_merge(c0, q0, c1, q1, &x0, &y0);
			q4_merge(c2, q2, c3, q3, &x1, &y1);
			vb_store_codes2(cm + e / 2, cu + e / 2, x0, y0, x1, y1);
		}
#endif
		for (; e < lg && !AOQK_DROP_ENCODE; e += AOQK_Q4_GROUP)
			for (size_t l = 0; l < AOQK_Q4_GROUP / 2; l += W) {
				size_t lo = e + l, hi = e + l + 16;
				vi c0, q0, c1, q1;
				q4_codes(bm + lo, bu + lo, Q8_A(lo), im, iu, 0, &c0, &q0);
				q4_codes(bm + hi, bu + hi, Q8_A(hi), im, iu, 1, &c1, &q1);
				q4_store(cm + e / 2 + l, cu + e / 2 + l, c0, q0, c1, q1);
			}
#endif
	} else {
		size_t e = 0;
#ifdef KHAS_CODES2
		/* two vectors at a time, their codes packed together
		 * (vb_store_codes2) */
		for (; e + 2 * W <= len && !AOQK_DROP_ENCODE; e += 2 * W) {
			vi a0 = Q8_A(e);
			vi a1 = Q8_A(e + W);
			vi c0, q0, c1, q1;
			q8_codes(bm + e, bu + e, a0, rng_second(a0, Q8_LANE(e), (unsigned)(e % 4), bc), im, iu,
			         &c0, &q0);
			q8_codes(bm + e + W, bu + e + W, a1,
			         rng_second(a1, Q8_LANE(e + W), (unsigned)((e + W) % 4), bc), im, iu, &c1, &q1);
			vb_store_codes2(cm + e, cu + e, c0, q0, c1, q1);
		}
#endif
		for (; e + W <= len && !AOQK_DROP_ENCODE; e += W) {
			vi a = Q8_A(e);
			q8_encode(bm + e, bu + e, a, rng_second(a, Q8_LANE(e), (unsigned)(e % 4), bc),
			          cm + e, cu + e, im, iu);
		}
		if (e < len && !AOQK_DROP_ENCODE) {
			_Alignas(64) uint8_t tm[W];
			_Alignas(64) uint8_t tu[W];
			/* lanes past len hold zeros from the padded step */
			size_t rem = len - e < W ? len - e : W;
			vi a = Q8_A(e);
			q8_encode(bm + e, bu + e, a, rng_second(a, Q8_LANE(e), (unsigned)(e % 4), bc), tm,
			          tu, im, iu);
			memcpy(cm + e, tm, rem);
			memcpy(cu + e, tu, rem);
		}
	}
#undef Q8_A
#undef Q8_LANE
}

/* Bytes of element type for the tail copies. */
struct ksizes {
	size_t g, master, mom;
};

/* A q8 or q4 block updated and not yet encoded: its first element in the
 * chunk, its length and its encode factors (TOP / its scales). */
struct kblock {
	size_t j, len;
	float im, iu;
};

static double scan_sumsq(const void *grad, enum aoqk_dtype gd, const float *acc, float scale, size_t n);

/* The split master's table entries (chunk_sel): AOQK_STATE_Q8 and
 * AOQK_STATE_Q4 with aoqk_state.master_lo, then with master_lo8. */
#define PREC_SPLIT_Q8 7
#define PREC_SPLIT_Q4 8
#define PREC_SPLIT8_Q8 9
#define PREC_SPLIT8_Q4 10

static AOQK_ALWAYS_INLINE void run_chunk(const struct aoqk_consts *k, const struct aoqk_state *st,
                                         const struct aoqk_chunk *c, int want_ss, double *ssum,
                                         const int table_prec, const int gd, const int pd, const int nt)
{
	/* the split master: q8's or q4's update with the master in two
	 * halves, split 1 (16 + 16 bits) or 2 (16 + 8, the 24-bit master,
	 * whose random bits the update draws as a bf16 master's) */
	const int split = table_prec == PREC_SPLIT_Q8 || table_prec == PREC_SPLIT_Q4       ? 1
	                  : table_prec == PREC_SPLIT8_Q8 || table_prec == PREC_SPLIT8_Q4 ? 2
	                                                                                 : 0;
	const int prec = table_prec == PREC_SPLIT_Q8 || table_prec == PREC_SPLIT8_Q8   ? AOQK_STATE_Q8
	                 : table_prec == PREC_SPLIT_Q4 || table_prec == PREC_SPLIT8_Q4 ? AOQK_STATE_Q4
	                                                                               : table_prec;
	/* the update draws the random words A (a bf16 or 24-bit master):
	 * encode_block reads them from hb */
	const int upd_rng = aoqk_precision_bf16_master(prec) || split == 2;
	/* q8 or q4 (vstep); q4's codes are half a byte each */
	const int q8 = aoqk_precision_blocked(prec);
	const int q4 = aoqk_precision_q4(prec);
	const struct ksizes sz = {
		.g = gd == AOQK_FP32 ? 4 : 2,
		.master = split ? 2 : aoqk_master_size(prec),
		.mom = aoqk_moment_size(prec),
	};
	const size_t psz = pd == PD_FP32 ? 4 : 2;
	const size_t b0 = c->begin;
	const size_t n = c->count;
	struct kptrs d = {
		.grad = c->grad,
		.acc = c->acc,
		.master = (char *)st->master + b0 * sz.master,
		.lo = split == 1 ? (char *)st->master_lo + b0 * 2 : NULL,
		.lo8 = split == 2 ? (char *)st->master_lo8 + b0 : NULL,
		.m = (char *)st->m + (q4 ? b0 / 2 : b0 * sz.mom),
		.v = (char *)st->v + (q4 ? b0 / 2 : b0 * sz.mom),
		.param = c->param,
	};
	/* q8, q4: the update of a block writes its new m, sqrt(v) (and A with
	 * a bf16 master) to one half of these, in turn, and the block is
	 * encoded after the next block's update: its encode waits on a chain
	 * of dependent operations (the maxima, their inverses), which runs
	 * beside that update */
	_Alignas(64) float bm[2 * AOQK_Q8_BLOCK], bu[2 * AOQK_Q8_BLOCK];
	/* q4: the grids F(c) - K of m (signed) and sqrt(v), exact; per block
	 * times its scale / TOP (one multiply per vector), the block's 16
	 * values of m and of u = sqrt(v) * sqrt(beta2), and u * u: the
	 * update looks up v * beta2 as q8 computes it, the square of the
	 * decoded u, without the multiply per element */
	_Alignas(64) float tabm[16], tabu[16];
	for (unsigned q = 0; q < 8; q++) {
		tabm[q] = aoqk_u2f((q + AOQK_Q4_M_C0) << AOQK_Q4_M_SHIFT) - AOQK_Q4_M_K;
		tabm[q + 8] = -tabm[q];
	}
	for (unsigned q = 0; q < 16; q++)
		tabu[q] = aoqk_u2f((q + AOQK_Q4_U_C0) << AOQK_Q4_U_SHIFT) - AOQK_Q4_U_K;
	const vtab q4gm = vt_load(tabm), q4gu = vt_load(tabu);
	vtab q4m = q4gm, q4v = q4gu;
	_Alignas(64) uint32_t hb[2 * AOQK_Q8_BLOCK];
	struct kblock prev = { 0, 0, 0.0f, 0.0f };
	int pend = 0;
	uint32_t bc[4] = { 0, 0, 0, 0 }; /* plain C: the current state's B */
	vi xs[XS_N];
	vf sq[XS_N];
	vacc ss = vacc_zero();
	const struct kvec kc = kvec_make(k);
	const size_t blk = q8 ? aoqk_block(prec) : n;
	/* q8 is compute-bound: its update loop has a twin for the common
	 * case with the flags as constants */
	const int fast = q8 && !d.acc && want_ss && !kc.l2 && kc.lerp_small;
#if W >= 8
	/* bf16 master + q8 with bf16 gradients and bf16 or no parameters:
	 * the fast loop takes two vectors at a time and stores the top
	 * halves of both sums bits(p) + r with one permute (vi_pack_hi16),
	 * where sr_bf16 quiets NaNs, shifts and narrows each vector.  The
	 * quieting is not needed here: every NaN this loop can make has the
	 * low 16 bits zero (the gradient's and the master's are bf16, the
	 * codes decode to finite values, the rest are x86's default NaN) and
	 * is quiet (the result of arithmetic), so its sum with r < 2^16 has
	 * the same top half as sr_bf16's.  Unless a constant is itself NaN
	 * (with any payload): then the loop of one vector runs (a NaN block
	 * scale fails q8_fma_ok: its block takes the loop with the flags).
	 * The split master (q8 or q4) pairs its vectors too: split_store2
	 * halves both with two permutes (or one conversion) where each
	 * vector took three operations and two stores of each half. */
	const int pair = (prec == AOQK_STATE_BF16_Q8 || prec == AOQK_STATE_BF16_Q4 || split) && gd == AOQK_BF16 &&
	                 (pd == PD_BF16 || pd == PD_NONE);
	const int pair_ok = pair && fast && !isnan(k->gscale) && !isnan(k->decay) && !isnan(k->w1) &&
	                    !isnan(k->b2) && !isnan(k->w2) && !isnan(k->bc2s) && !isnan(k->eps) &&
	                    !isnan(k->nstep) &&
	                    (!nt || (uintptr_t)c->param % (2 * W * sizeof(uint16_t)) == 0);
#endif

	for (size_t jb = 0; jb < n; jb += blk) {
		size_t len = n - jb < blk ? n - jb : blk;
		size_t bidx = q8 ? (b0 + jb) / blk : 0;
		const size_t hoff = jb / blk % 2 * AOQK_Q8_BLOCK;
		float *bmh = bm + hoff, *buh = bu + hoff;
		uint32_t *hbh = hb + hoff;
		vf sm = vf_zero(), su = vf_zero(), mx_m = vf_zero(), mx_u = vf_zero();
		vf nkm = vf_zero(), nku = vf_zero();
		/* the fast loops decode with an FMA, which needs the block's
		 * scales in q8_fma_ok's range; other blocks take the loop with
		 * the runtime flags, which gives the same bits (a report of the
		 * block in double rather than in fp32 lanes) */
		int fast_blk = 0;

		if (q8) {
			/* with an fp32 master encode_block draws A */
			if (upd_rng)
				for (unsigned g = 0; g < XS_N; g++)
					xs[g] = sr_hash(kc.srkey, b0 + jb + g * W);
			/* fu: sqrt(v)'s decode times sqrt(beta2) (vstep) */
			float fm = st->m_scale[bidx] / (q4 ? AOQK_Q4_M_TOP : AOQK_Q8_M_TOP),
			      fu = st->v_scale[bidx] / (q4 ? AOQK_Q4_U_TOP : AOQK_Q8_U_TOP) * k->sb2;
			sm = vf_set1(fm);
			su = vf_set1(fu);
			/* q4 decodes by table, whose values are aoqk_q4_*_decode's
			 * bit for bit; the check keeps NaN and huge scales out of
			 * the fast loops (the pair loop's NaN rule) */
			fast_blk = fast && q8_fma_ok(fm) && q8_fma_ok(fu);
			if (q4) {
				/* (F(c) - K) * (scale / TOP): aoqk_q4_*_decode's
				 * arithmetic ((-x) * s is -(x * s) exactly) */
				q4m = vt_mul(q4gm, fm);
				q4v = vt_sq(vt_mul(q4gu, fu));
			}
			if (fast_blk) {
				nkm = vf_set1(-AOQK_Q8_M_K * fm);
				nku = vf_set1(-AOQK_Q8_U_K * fu);
			}
		}
		size_t t = 0;
		if (q8 && fast_blk) {
			/* a block is 16 vectors of 16 lanes: each sq lane sums at
			 * most 16 squares whatever W is */
			for (unsigned g = 0; g < XS_N; g++)
				sq[g] = vf_zero();
#if W >= 8
			if (pair_ok) {
				for (; t + 2 * W <= len; t += 2 * W) {
					unsigned s0 = (unsigned)(t / W) % XS_N, s1 = (unsigned)(t / W + 1) % XS_N;
					/* q4 with 16 lanes: the two vectors are the halves of a
					 * group (t is a multiple of 32), whose codes are the
					 * low and the high nibbles of the same 16 bytes */
					const int q4g = q4 && 2 * W == AOQK_Q4_GROUP;
					vi ca[2] = { vi_zero(), vi_zero() }, cb[2] = { vi_zero(), vi_zero() };
					if (q4g) {
						ca[0] = q4_idx(d.m, jb + t);
						ca[1] = q4_idx(d.v, jb + t);
						cb[0] = vi_srli(ca[0], 4);
						cb[1] = vi_srli(ca[1], 4);
					}
					vi a = vstep(kc, &d, jb + t, b0 + jb + t, prec, gd, pd, nt, want_ss, &ss,
					             bmh + t, buh + t, hbh + t, xs, s0, &sq[s0], sm, su, nkm, nku, &mx_m,
					             &mx_u, 2, jb + t, q4g ? ca : NULL, q4m, q4v, split);
					vi b = vstep(kc, &d, jb + t + W, b0 + jb + t + W, prec, gd, pd, nt, want_ss,
					             &ss, bmh + t + W, buh + t + W, hbh + t + W, xs, s1, &sq[s1], sm,
					             su, nkm, nku, &mx_m, &mx_u, 2, jb + t + W, q4g ? cb : NULL, q4m,
					             q4v, split);
					uint16_t *pm = (uint16_t *)d.master + jb + t;
					uint16_t *pp = pd == PD_BF16 ? (uint16_t *)d.param + jb + t : NULL;
					if (split == 2) {
						split8_store2(a, vi_loadu(hbh + t), b, vi_loadu(hbh + t + W), pm,
						              (int8_t *)d.lo8 + jb + t, pp, pd, nt);
						continue;
					}
					if (split) {
						split_store2(a, b, pm, (uint16_t *)d.lo + jb + t, pp, pd, nt);
						continue;
					}
					vi h2 = vi_pack_hi16(a, b);
					vi_storeu((uint32_t *)(void *)pm, h2);
					store_param2(pp, h2, pd, nt);
				}
			}
#endif
			for (; t + W <= len; t += W)
				vstep(kc, &d, jb + t, b0 + jb + t, prec, gd, pd, nt, want_ss, &ss, bmh + t,
				      buh + t, hbh + t, xs, (t / W) % XS_N, &sq[(t / W) % XS_N], sm, su, nkm,
				      nku, &mx_m, &mx_u, 1, jb + t, NULL, q4m, q4v, split);
			for (unsigned g = 0; g < XS_N; g++)
				vacc_add(&ss, sq[g]);
		} else {
			for (; t + W <= len; t += W)
				vstep(kc, &d, jb + t, b0 + jb + t, prec, gd, pd, nt, want_ss, &ss, bmh + t,
				      buh + t, hbh + t, xs, (t / W) % XS_N, &sq[0], sm, su, nkm, nku, &mx_m,
				      &mx_u, 0, jb + t, NULL, q4m, q4v, split);
		}
		if (t < len) {
			size_t j = jb + t;
			/* the tail: run the same step on zero-padded copies */
			size_t r = len - t < W ? len - t : W;
			_Alignas(64) unsigned char lg[W * 4], la[W * 4], lmst[W * 4], llo[W * 2], llo8[W], lm[W * 4],
				lv[W * 4], lp[W * 4];
			memset(lg, 0, sizeof(lg));
			memset(la, 0, sizeof(la));
			memset(lmst, 0, sizeof(lmst));
			memset(lm, 0, sizeof(lm));
			memset(lv, 0, sizeof(lv));
			memcpy(lg, (const char *)d.grad + j * sz.g, r * sz.g);
			if (d.acc)
				memcpy(la, d.acc + j, r * 4);
			memcpy(lmst, (char *)d.master + j * sz.master, r * sz.master);
			memset(llo, 0, sizeof(llo));
			memset(llo8, 0, sizeof(llo8));
			if (split == 1)
				memcpy(llo, (char *)d.lo + j * 2, r * 2);
			else if (split == 2)
				memcpy(llo8, (char *)d.lo8 + j, r);
			memcpy(lm, (char *)d.m + j * sz.mom, r * sz.mom);
			memcpy(lv, (char *)d.v + j * sz.mom, r * sz.mom);
			/* q4: a copy of the codes of j's group, the nibbles past the
			 * end zero (code 0 decodes to 0, as the padding of q8) */
			_Alignas(16) uint8_t lm4[AOQK_Q4_GROUP / 2], lv4[AOQK_Q4_GROUP / 2];
			size_t cj = 0;
			if (q4) {
				size_t gs = j - j % AOQK_Q4_GROUP;
				memcpy(lm4, (char *)d.m + gs / 2, sizeof(lm4));
				memcpy(lv4, (char *)d.v + gs / 2, sizeof(lv4));
				for (size_t e = jb + len; e < gs + AOQK_Q4_GROUP; e++) {
					aoqk_q4_put(lm4, e - gs, 0);
					aoqk_q4_put(lv4, e - gs, 0);
				}
				cj = j - gs;
			}
			struct kptrs l = {
				.grad = lg,
				.acc = d.acc ? (float *)(void *)la : NULL,
				.master = lmst,
				.lo = llo,
				.lo8 = llo8,
				.m = q4 ? (void *)lm4 : (void *)lm,
				.v = q4 ? (void *)lv4 : (void *)lv,
				.param = lp,
			};
			vstep(kc, &l, 0, b0 + j, prec, gd, pd, 0, want_ss, &ss, bmh + t, buh + t,
			      hbh + t, xs, (t / W) % XS_N, &sq[0], sm, su, nkm, nku, &mx_m, &mx_u, 0, cj, NULL, q4m, q4v, split);
			if (d.acc)
				memset(d.acc + j, 0, r * 4);
			memcpy((char *)d.master + j * sz.master, lmst, r * sz.master);
			if (split == 1)
				memcpy((char *)d.lo + j * 2, llo, r * 2);
			else if (split == 2)
				memcpy((char *)d.lo8 + j, llo8, r);
			if (!q8) {
				memcpy((char *)d.m + j * sz.mom, lm, r * sz.mom);
				memcpy((char *)d.v + j * sz.mom, lv, r * sz.mom);
			}
			if (pd != PD_NONE)
				memcpy((char *)d.param + j * psz, lp, r * psz);
		}
		if (q8) {
			struct kblock cur = { jb, len, 0.0f, 0.0f };
			float mm, mu;
			vf_hmax2(mx_m, mx_u, &mm, &mu);
			st->m_scale[bidx] = mm;
			st->v_scale[bidx] = mu;
			cur.im = aoqk_q8_inv(q4 ? AOQK_Q4_M_TOP : AOQK_Q8_M_TOP, mm);
			cur.iu = aoqk_q8_inv(q4 ? AOQK_Q4_U_TOP : AOQK_Q8_U_TOP, mu);
			/* the block before this one, then (the chunk's last
			 * block) this one */
			for (int i = !pend; i < 1 + (jb + blk >= n); i++) {
				const struct kblock *e = i ? &cur : &prev;
				const size_t eo = e->j / blk % 2 * AOQK_Q8_BLOCK;
				encode_block(prec, upd_rng, (uint8_t *)d.m + (q4 ? e->j / 2 : e->j),
				             (uint8_t *)d.v + (q4 ? e->j / 2 : e->j), e->len, bm + eo, bu + eo,
				             hb + eo, xs, bc, kc.srkey, b0 + e->j, vf_set1(e->im), vf_set1(e->iu));
			}
			prev = cur;
			pend = 1;
		}
	}
	if (want_ss) {
		*ssum = vacc_sum(ss);
		/* an fp32 lane can overflow where the double sum does not (g
		 * around 1e18 and up): such a chunk is counted again in double */
		if (fast && !isfinite(*ssum))
			*ssum = scan_sumsq(c->grad, (enum aoqk_dtype)gd, NULL, k->gscale, n);
	}
}

/* Sum of squares of (acc + grad) * scale, in double. */
static double scan_sumsq(const void *grad, enum aoqk_dtype gd, const float *acc, float scale,
                         size_t n)
{
	vacc ss = vacc_zero();
	vf s = vf_set1(scale);
	size_t j = 0;

#define SCAN_LOOP(GD)                                                        \
	for (; j + W <= n; j += W) {                                         \
		vf g = load_grad(grad, j, GD);                               \
		if (acc)                                                     \
			g = vf_add(vf_loadu(acc + j), g);                     \
		vacc_add_sq(&ss, vf_mul(g, s));                              \
	}                                                                    \
	if (j < n) {                                                         \
		_Alignas(64) unsigned char lg[W * 4], la[W * 4];             \
		size_t r = n - j, gs = GD == AOQK_FP32 ? 4 : 2;             \
		memset(lg, 0, sizeof(lg));                                   \
		memset(la, 0, sizeof(la));                                   \
		memcpy(lg, (const char *)grad + j * gs, r * gs);             \
		if (acc)                                                     \
			memcpy(la, acc + j, r * 4);                          \
		vf g = vf_add(vf_loadu((const float *)(void *)la),           \
		              load_grad(lg, 0, GD));                         \
		vacc_add_sq(&ss, vf_mul(g, s));                              \
	}

	if (gd == AOQK_FP32) {
		SCAN_LOOP(AOQK_FP32)
	} else if (gd == AOQK_BF16) {
		SCAN_LOOP(AOQK_BF16)
	} else {
		SCAN_LOOP(AOQK_FP16)
	}
#undef SCAN_LOOP
	return vacc_sum(ss);
}

static void k_sumsq(const void *grad, enum aoqk_dtype gd, const float *acc, float scale,
                    size_t n, struct aoqk_report *rep)
{
	double s = n ? scan_sumsq(grad, gd, acc, scale, n) : 0.0;
	rep->sumsq = s;
	rep->nonfinite = !isfinite(s);
}

static void k_accumulate(float *acc, const void *grad, enum aoqk_dtype gd, float scale, size_t n)
{
	vf s = vf_set1(scale);
	size_t j = 0;

#define ACC_LOOP(GD)                                                                    \
	for (; j + W <= n; j += W)                                                      \
		vf_storeu(acc + j, vf_add(vf_loadu(acc + j), vf_mul(load_grad(grad, j, GD), s))); \
	if (j < n) {                                                                    \
		_Alignas(64) unsigned char lg[W * 4];                                   \
		_Alignas(64) float la[W];                                               \
		size_t r = n - j, gs = GD == AOQK_FP32 ? 4 : 2;                        \
		memset(lg, 0, sizeof(lg));                                              \
		memset(la, 0, sizeof(la));                                              \
		memcpy(lg, (const char *)grad + j * gs, r * gs);                        \
		memcpy(la, acc + j, r * 4);                                             \
		vf_storeu(la, vf_add(vf_loadu(la), vf_mul(load_grad(lg, 0, GD), s)));   \
		memcpy(acc + j, la, r * 4);                                             \
	}

	if (!n)
		return;
	if (gd == AOQK_FP32) {
		ACC_LOOP(AOQK_FP32)
	} else if (gd == AOQK_BF16) {
		ACC_LOOP(AOQK_BF16)
	} else if (gd == AOQK_FP16) {
		ACC_LOOP(AOQK_FP16)
	}
#undef ACC_LOOP
}

/* One out-of-line function per (precision, gradient dtype, parameter
 * dtype, non-temporal stores) for each optimizer, reached through a table
 * indexed by chunk_sel(): the default and "-cached" tables share the
 * plain-store instances, and a non-temporal instance exists only where a
 * parameter is written.  Each instance is a whole chunk's loop, so the call
 * costs nothing measurable; inlining them all into one switch made each
 * SIMD translation unit compile for minutes (kernels/README.md). */
typedef void chunk_fn(const struct aoqk_consts *k, const struct aoqk_state *st,
                      const struct aoqk_chunk *c, int want_ss, double *ssum);

#define CHUNK_SEL(P, G, D) ((P) * 12 + (G) * 4 + (D))
#define CHUNK_SELS 132

/* X(P, G, D, NT, ...) for every gradient dtype G and parameter dtype D of
 * precision P: D = PD_NONE only without non-temporal stores */
#define FOR_PD(X, P, G, NT, ...) X(P, G, 0, NT, __VA_ARGS__) X(P, G, 1, NT, __VA_ARGS__) \
	X(P, G, 2, NT, __VA_ARGS__)
#define FOR_PD_NONE(X, P, G, NT, ...) FOR_PD(X, P, G, NT, __VA_ARGS__) X(P, G, 3, NT, __VA_ARGS__)
#define FOR_G(F, X, P, NT, ...) F(X, P, 0, NT, __VA_ARGS__) F(X, P, 1, NT, __VA_ARGS__) \
	F(X, P, 2, NT, __VA_ARGS__)
/* precisions 0..6 are AOQK_STATE_FP32 .. AOQK_STATE_BF16_Q4, 7 and 8 the
 * split master (PREC_SPLIT_Q8, PREC_SPLIT_Q4), 9 and 10 the 24-bit one
 * (PREC_SPLIT8_Q8, PREC_SPLIT8_Q4) (literals: they are pasted into names) */
#define FOR_ADAM_P(F, X, NT, ...) FOR_G(F, X, 0, NT, __VA_ARGS__) FOR_G(F, X, 1, NT, __VA_ARGS__) \
	FOR_G(F, X, 2, NT, __VA_ARGS__) FOR_G(F, X, 3, NT, __VA_ARGS__) FOR_G(F, X, 4, NT, __VA_ARGS__) \
	FOR_G(F, X, 5, NT, __VA_ARGS__) FOR_G(F, X, 6, NT, __VA_ARGS__) FOR_G(F, X, 7, NT, __VA_ARGS__) \
	FOR_G(F, X, 8, NT, __VA_ARGS__) FOR_G(F, X, 9, NT, __VA_ARGS__) FOR_G(F, X, 10, NT, __VA_ARGS__)
/* SGD and Lion: no q8 (precisions 1 and 3) */
#define FOR_SL_P(F, X, NT, ...) FOR_G(F, X, 0, NT, __VA_ARGS__) FOR_G(F, X, 2, NT, __VA_ARGS__) \
	FOR_G(F, X, 4, NT, __VA_ARGS__)

#define ADAM_FN(P, G, D, NT, _)                                                            \
	static __attribute__((noinline)) void adam_##P##_##G##_##D##_##NT(                  \
		const struct aoqk_consts *k, const struct aoqk_state *st,                  \
		const struct aoqk_chunk *c, int want_ss, double *ssum)                     \
	{                                                                                  \
		run_chunk(k, st, c, want_ss, ssum, P, G, D, NT);                           \
	}
#define ADAM_ENTRY(P, G, D, NT, _) [CHUNK_SEL(P, G, D)] = adam_##P##_##G##_##D##_##NT,

FOR_ADAM_P(FOR_PD_NONE, ADAM_FN, 0, _)
static chunk_fn *const adam_plain[CHUNK_SELS] = { FOR_ADAM_P(FOR_PD_NONE, ADAM_ENTRY, 0, _) };
#if KHAS_NT
FOR_ADAM_P(FOR_PD, ADAM_FN, 1, _)
static chunk_fn *const adam_nt[CHUNK_SELS] = { FOR_ADAM_P(FOR_PD, ADAM_ENTRY, 1, _) };
#endif

/* The chunk's table index; *nt_ok: a parameter is written and its pointer
 * is vector-aligned, so non-temporal stores may write it. */
static inline int chunk_sel(const struct aoqk_state *st, const struct aoqk_chunk *c, int *nt_ok)
{
	int pd = c->param ? (int)c->param_dtype : PD_NONE;

	*nt_ok = pd != PD_NONE && (uintptr_t)c->param % (W * (pd == PD_FP32 ? 4 : 2)) == 0;
	int p = (int)st->precision;
	if (st->master_lo)
		p = p == AOQK_STATE_Q4 ? PREC_SPLIT_Q4 : PREC_SPLIT_Q8;
	else if (st->master_lo8)
		p = p == AOQK_STATE_Q4 ? PREC_SPLIT8_Q4 : PREC_SPLIT8_Q8;
	return CHUNK_SEL(p, (int)c->grad_dtype, pd);
}

static AOQK_ALWAYS_INLINE int adam_common(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                                          const struct aoqk_chunk *c, struct aoqk_report *rep,
                                          const int nt)
{
	struct aoqk_consts k;
	double ss = 0.0;
	int want_ss = 1;
	int r = aoqk_check(hp, st, c, rep);

	if (rep) {
		rep->sumsq = 0.0;
		rep->nonfinite = false;
	}
	if (r < 0 || c->count == 0)
		return r;
	if (c->skip_nonfinite) {
		ss = scan_sumsq(c->grad, c->grad_dtype, c->acc, hp->grad_scale, c->count);
		rep->sumsq = ss;
		rep->nonfinite = !isfinite(ss);
		if (rep->nonfinite)
			return 0;
		want_ss = 0;
	}
	aoqk_consts_init(&k, hp, c->seed);
	int nt_ok, sel = chunk_sel(st, c, &nt_ok);

	(void)nt, (void)nt_ok;
#if KHAS_NT
	if (nt && nt_ok) {
		adam_nt[sel](&k, st, c, want_ss, &ss);
		vf_sfence();
	} else
#endif
		adam_plain[sel](&k, st, c, want_ss, &ss);
	if (want_ss) {
		rep->sumsq = ss;
		rep->nonfinite = !isfinite(ss);
	}
	return 0;
}

/* ------------------------------------------------------------------ */
/* SGD and Lion (README.md, "SGD and Lion"): master plus one moment in m,
 * no q8; the same loads, casts, report and stores as Adam's step. */

static AOQK_ALWAYS_INLINE void vstep_sl(const struct kvec kc, const struct kptrs *p, size_t j,
                                        uint64_t gi, const int prec, const int gd, const int pd,
                                        const int nt, int want_ss, vacc *ss, const int lion)
{
	const int bfm = aoqk_precision_bf16_master(prec);
	const int bfmom = aoqk_precision_bf16_moments(prec);
	const int keep_m = lion || kc.mom_on;
	vf g = load_grad(p->grad, j, gd);
	vf pw, m = vf_zero();

	if (p->acc) {
		g = vf_add(vf_loadu(p->acc + j), g);
		vf_storeu(p->acc + j, vf_zero());
	}
	g = vf_mul(g, kc.gscale);
	if (want_ss)
		vacc_add_sq(ss, g);

	if (bfm)
		pw = vh_bf16_to_f(vh_loadu((const uint16_t *)p->master + j));
	else
		pw = vf_loadu((const float *)p->master + j);
	/* SGD's first step does not read the buffer (torch: None, then a
	 * clone of the gradient) */
	if (keep_m && (lion || !kc.first)) {
		if (bfmom)
			m = vh_bf16_to_f(vh_loadu((const uint16_t *)p->m + j));
		else
			m = vf_loadu((const float *)p->m + j);
	}

	if (lion) {
		/* lion-pytorch: p.mul_(1 - lr * wd);
		 * update = (m * beta1).add(grad, alpha=1 - beta1).sign_();
		 * p.add_(update, alpha=-lr);
		 * m.mul_(beta2).add_(grad, alpha=1 - beta2) */
		if (kc.wd_on)
			pw = vf_mul(pw, kc.decay);
		vf c = vf_fma(kc.w1, g, vf_mul(m, kc.b1));
		pw = vf_fma(kc.nlr, vf_sign(c), pw);
		m = vf_fma(kc.w2, g, vf_mul(m, kc.b2));
	} else {
		/* torch.optim.SGD (foreach): grad.add(param, alpha=wd);
		 * buf.mul_(momentum).add_(grad, alpha=1 - dampening), or
		 * buf = grad on the first step; nesterov: grad.add(buf,
		 * alpha=momentum), else grad = buf; param.add_(grad, alpha=-lr) */
		if (kc.wd_on)
			g = vf_fma(kc.wd, pw, g);
		if (kc.mom_on) {
			m = kc.first ? g : vf_fma(kc.damp1, g, vf_mul(m, kc.mom));
			g = kc.nesterov ? vf_fma(kc.mom, m, g) : m;
		}
		pw = vf_fma(kc.nlr, g, pw);
	}

	/* the hash as Adam's: bits 16..31 round the bf16 master, bits 0..7
	 * the bf16 moment */
	vi h = vi_zero();
	if (bfm)
		h = sr_hash(kc.srkey, gi);
	if (keep_m) {
		if (bfmom) {
			vi rm = vi_or(vi_slli(vi_and(h, vi_set1(0xffu)), 8), vi_set1(0x80u));
			vh_storeu((uint16_t *)p->m + j, vi_to_vh(sr_bf16(m, rm)));
		} else {
			vf_storeu((float *)p->m + j, m);
		}
	}
	if (bfm) {
		vi s = sr_bf16(pw, vi_srli(h, 16));
		vh sh = vi_to_vh(s);
		vh_storeu((uint16_t *)p->master + j, sh);
		if (pd != PD_NONE)
			store_param(p->param, j, vi_as_vf(vi_slli(s, 16)), sh, pd, 1, nt);
	} else {
		vf_storeu((float *)p->master + j, pw);
		if (pd != PD_NONE)
			store_param(p->param, j, pw, vh_zero(), pd, 0, nt);
	}
}

static AOQK_ALWAYS_INLINE void run_chunk_sl(const struct aoqk_consts *k, const struct aoqk_state *st,
                                            const struct aoqk_chunk *c, int want_ss, double *ssum,
                                            const int prec, const int gd, const int pd, const int nt,
                                            const int lion)
{
	const size_t gsz = gd == AOQK_FP32 ? 4 : 2;
	const size_t msz = aoqk_master_size(prec), osz = aoqk_moment_size(prec);
	const size_t psz = pd == PD_FP32 ? 4 : 2;
	const size_t b0 = c->begin;
	const size_t n = c->count;
	const int keep_m = lion || k->mom_on;
	struct kptrs d = {
		.grad = c->grad,
		.acc = c->acc,
		.master = (char *)st->master + b0 * msz,
		.m = keep_m ? (char *)st->m + b0 * osz : NULL,
		.v = NULL,
		.param = c->param,
	};
	vacc ss = vacc_zero();
	const struct kvec kc = kvec_make(k);
	size_t j = 0;

	for (; j + W <= n; j += W)
		vstep_sl(kc, &d, j, b0 + j, prec, gd, pd, nt, want_ss, &ss, lion);
	if (j < n) {
		/* the tail: the same step on zero-padded copies */
		size_t r = n - j;
		_Alignas(64) unsigned char lg[W * 4], la[W * 4], lmst[W * 4], lm[W * 4], lp[W * 4];
		memset(lg, 0, sizeof(lg));
		memset(la, 0, sizeof(la));
		memset(lmst, 0, sizeof(lmst));
		memset(lm, 0, sizeof(lm));
		memcpy(lg, (const char *)d.grad + j * gsz, r * gsz);
		if (d.acc)
			memcpy(la, d.acc + j, r * 4);
		memcpy(lmst, (char *)d.master + j * msz, r * msz);
		if (keep_m)
			memcpy(lm, (char *)d.m + j * osz, r * osz);
		struct kptrs l = {
			.grad = lg,
			.acc = d.acc ? (float *)(void *)la : NULL,
			.master = lmst,
			.m = keep_m ? lm : NULL,
			.v = NULL,
			.param = lp,
		};
		vstep_sl(kc, &l, 0, b0 + j, prec, gd, pd, 0, want_ss, &ss, lion);
		if (d.acc)
			memset(d.acc + j, 0, r * 4);
		memcpy((char *)d.master + j * msz, lmst, r * msz);
		if (keep_m)
			memcpy((char *)d.m + j * osz, lm, r * osz);
		if (pd != PD_NONE)
			memcpy((char *)d.param + j * psz, lp, r * psz);
	}
	if (want_ss)
		*ssum = vacc_sum(ss);
}

#define SL_FN(P, G, D, NT, L)                                                              \
	static __attribute__((noinline)) void sl_##P##_##G##_##D##_##NT##_##L(               \
		const struct aoqk_consts *k, const struct aoqk_state *st,                  \
		const struct aoqk_chunk *c, int want_ss, double *ssum)                     \
	{                                                                                  \
		run_chunk_sl(k, st, c, want_ss, ssum, P, G, D, NT, L);                     \
	}
#define SL_ENTRY(P, G, D, NT, L) [CHUNK_SEL(P, G, D)] = sl_##P##_##G##_##D##_##NT##_##L,

/* [lion] */
FOR_SL_P(FOR_PD_NONE, SL_FN, 0, 0)
FOR_SL_P(FOR_PD_NONE, SL_FN, 0, 1)
static chunk_fn *const sl_plain[2][CHUNK_SELS] = {
	{ FOR_SL_P(FOR_PD_NONE, SL_ENTRY, 0, 0) },
	{ FOR_SL_P(FOR_PD_NONE, SL_ENTRY, 0, 1) },
};
#if KHAS_NT
FOR_SL_P(FOR_PD, SL_FN, 1, 0)
FOR_SL_P(FOR_PD, SL_FN, 1, 1)
static chunk_fn *const sl_nt[2][CHUNK_SELS] = {
	{ FOR_SL_P(FOR_PD, SL_ENTRY, 1, 0) },
	{ FOR_SL_P(FOR_PD, SL_ENTRY, 1, 1) },
};
#endif

static AOQK_ALWAYS_INLINE int sl_common(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                                        const struct aoqk_chunk *c, struct aoqk_report *rep,
                                        const int nt, const int lion)
{
	struct aoqk_consts k;
	double ss = 0.0;
	int want_ss = 1;
	int r = aoqk_check_sl(hp, st, c, rep, lion);

	if (rep) {
		rep->sumsq = 0.0;
		rep->nonfinite = false;
	}
	if (r < 0 || c->count == 0)
		return r;
	if (c->skip_nonfinite) {
		ss = scan_sumsq(c->grad, c->grad_dtype, c->acc, hp->grad_scale, c->count);
		rep->sumsq = ss;
		rep->nonfinite = !isfinite(ss);
		if (rep->nonfinite)
			return 0;
		want_ss = 0;
	}
	aoqk_consts_init(&k, hp, c->seed);
	int nt_ok, sel = chunk_sel(st, c, &nt_ok);

	(void)nt, (void)nt_ok;
#if KHAS_NT
	if (nt && nt_ok) {
		sl_nt[lion][sel](&k, st, c, want_ss, &ss);
		vf_sfence();
	} else
#endif
		sl_plain[lion][sel](&k, st, c, want_ss, &ss);
	if (want_ss) {
		rep->sumsq = ss;
		rep->nonfinite = !isfinite(ss);
	}
	return 0;
}

static int k_sgd(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                 const struct aoqk_chunk *c, struct aoqk_report *rep)
{
	return sl_common(hp, st, c, rep, KHAS_NT, 0);
}

static int k_lion(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                  const struct aoqk_chunk *c, struct aoqk_report *rep)
{
	return sl_common(hp, st, c, rep, KHAS_NT, 1);
}

/* The default table streams the parameter out with non-temporal stores
 * (when the param pointer is vector-aligned): measured faster on the
 * reference host for every precision (tests/bench/RESULTS.md).  The
 * "-cached" twin uses plain stores, for comparison. */
static int k_adam(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                  const struct aoqk_chunk *c, struct aoqk_report *rep)
{
	return adam_common(hp, st, c, rep, KHAS_NT);
}

const struct aoqk_kernel KCAT(aoqk_kernel_, KVAR) = {
	.name = KSTR(KVAR),
	.q8_approx = KQ8_APPROX,
	.adam = k_adam,
	.sgd = k_sgd,
	.lion = k_lion,
	.accumulate = k_accumulate,
	.sumsq = k_sumsq,
};

#if KHAS_NT
static int k_adam_cached(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                         const struct aoqk_chunk *c, struct aoqk_report *rep)
{
	return adam_common(hp, st, c, rep, 0);
}

static int k_sgd_cached(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                        const struct aoqk_chunk *c, struct aoqk_report *rep)
{
	return sl_common(hp, st, c, rep, 0, 0);
}

static int k_lion_cached(const struct aoqk_hparams *hp, const struct aoqk_state *st,
                         const struct aoqk_chunk *c, struct aoqk_report *rep)
{
	return sl_common(hp, st, c, rep, 0, 1);
}

const struct aoqk_kernel KCAT(KCAT(aoqk_kernel_, KVAR), _cached) = {
	.name = KSTR(KVAR) "-cached",
	.q8_approx = KQ8_APPROX,
	.adam = k_adam_cached,
	.sgd = k_sgd_cached,
	.lion = k_lion_cached,
	.accumulate = k_accumulate,
	.sumsq = k_sumsq,
};
#endif
