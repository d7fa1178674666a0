/* SPDX-License-Identifier: MIT */
/*
 * The test harness's own numerics, which every integration and hostile
 * verdict rests on: dtype rounding (known values, every bf16/fp16 bit
 * pattern round-trips, agreement with the compiler's _Float16 conversion
 * and with integer bf16 rounding of floats), the double Adam/AdamW
 * reference against a second formulation written the way torch writes it,
 * and the tolerance checks (they accept what they must and reject what
 * they must).
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "harness.h"

#include "expect.h"

static void expect_bits(double x, enum aoq_dtype t, uint32_t want)
{
	uint32_t got = aoqt_encode(x, t);
	EXPECT(got == want, "%s(%.17g) = 0x%x, want 0x%x", aoq_dtype_name(t), x, got, want);
}

static void test_known(void)
{
	expect_bits(1.0, AOQ_BF16, 0x3f80);
	expect_bits(1.0 + 0x1p-8, AOQ_BF16, 0x3f80);        /* tie: to even */
	expect_bits(1.0 + 3 * 0x1p-8, AOQ_BF16, 0x3f82);    /* tie: to even (up) */
	expect_bits(1.0 + 0x1p-8 + 0x1p-30, AOQ_BF16, 0x3f81);
	expect_bits(-2.5, AOQ_BF16, 0xc020);
	expect_bits(0x1.fep127, AOQ_BF16, 0x7f7f);          /* bf16 max */
	expect_bits(0x1.ffp127, AOQ_BF16, 0x7f80);          /* halfway above max: inf */
	expect_bits(0x1p-133, AOQ_BF16, 0x0001);            /* smallest subnormal */
	expect_bits(0x1p-134, AOQ_BF16, 0x0000);            /* tie with 0: even */
	expect_bits(-0.0, AOQ_BF16, 0x8000);
	expect_bits(65504, AOQ_FP16, 0x7bff);
	expect_bits(65519, AOQ_FP16, 0x7bff);
	expect_bits(65520, AOQ_FP16, 0x7c00);               /* tie above max: inf */
	expect_bits(-INFINITY, AOQ_FP16, 0xfc00);
	expect_bits(0x1p-14, AOQ_FP16, 0x0400);
	expect_bits(0x1p-24, AOQ_FP16, 0x0001);
	expect_bits(0x1p-25, AOQ_FP16, 0x0000);             /* tie with 0: even */
	expect_bits(0x1.8p-25, AOQ_FP16, 0x0001);
	expect_bits(3 * 0x1p-25, AOQ_FP16, 0x0002);         /* tie 1.5 quanta: even */
	expect_bits(1.0 / 3, AOQ_FP16, 0x3555);
	expect_bits(0.1, AOQ_FP16, 0x2e66);
	expect_bits(0.1, AOQ_FP32, 0x3dcccccd);
	expect_bits(-0.0, AOQ_FP32, 0x80000000);
	EXPECT(aoqt_ulp_dist(0x8000, 0x0000, AOQ_BF16) == 0, "-0 and +0");
	EXPECT(aoqt_ulp_dist(0x8001, 0x0001, AOQ_BF16) == 2, "across zero");
	EXPECT(aoqt_ulp_dist(0x3f80, 0x3f81, AOQ_BF16) == 1, "one ulp");
	EXPECT(aoqt_ulp_dist(0x7fc0, 0x3f80, AOQ_BF16) == UINT64_MAX, "NaN");
}

static void test_all_patterns(void)
{
	size_t bad = 0;
	for (uint32_t b = 0; b < 65536; b++)
		for (int t = AOQ_BF16; t <= AOQ_FP16; t++) {
			double x = aoqt_decode(b, (enum aoq_dtype)t);
			if (isnan(x))
				continue;
			if (aoqt_encode(x, (enum aoq_dtype)t) != b)
				bad++;
		}
	EXPECT(bad == 0, "%zu bf16/fp16 bit patterns do not round-trip", bad);
}

#ifdef __FLT16_MAX__
__extension__ typedef _Float16 f16;
#endif

static void test_against_compiler(void)
{
	srand(12345);
	size_t bad16 = 0, badbf = 0;
	for (int i = 0; i < 200000; i++) {
		/* Random doubles over the fp16 range, subnormals included. */
		double x = ldexp((double)rand() / RAND_MAX + (double)rand() / RAND_MAX * 0x1p-31,
		                 rand() % 44 - 28) * (rand() & 1 ? -1 : 1);
#ifdef __FLT16_MAX__
		f16 h = (f16)x;
		uint16_t hb;
		memcpy(&hb, &h, 2);
		if (aoqt_encode(x, AOQ_FP16) != hb)
			bad16++;
#endif
		/* bf16 of a float by integer rounding (one rounding only). */
		float f = (float)x;
		uint32_t fb;
		memcpy(&fb, &f, 4);
		uint32_t want = (fb + 0x7fffu + ((fb >> 16) & 1)) >> 16;
		if (aoqt_encode(f, AOQ_BF16) != want)
			badbf++;
	}
	EXPECT(bad16 == 0, "%zu fp16 roundings differ from the compiler's _Float16", bad16);
	EXPECT(badbf == 0, "%zu bf16 roundings differ from integer rounding", badbf);
}

/* The reference again, written as torch.optim.Adam(W) writes it. */
static double torch_step(int kind, double *p, double *m, double *v, double g, uint64_t k, double lr, double b1,
                         double b2, double eps, double wd)
{
	if (kind == AOQ_ADAMW)
		*p *= 1 - lr * wd;
	else
		g = g + wd * *p;
	*m += (g - *m) * (1 - b1); /* lerp */
	*v = *v * b2 + (1 - b2) * g * g;
	double bc1 = 1 - pow(b1, (double)k), bc2 = 1 - pow(b2, (double)k);
	double step_size = lr / bc1;
	double denom = sqrt(*v) / sqrt(bc2) + eps;
	*p -= step_size * *m / denom;
	return *p;
}

static void test_reference(void)
{
	/* One hand-checked AdamW step: p 1, g 0.5, lr 0.1, wd 0:
	 * mhat = g, vhat = g^2 exactly, so p = 1 - lr * 0.5 / (0.5 + eps). */
	struct aoqt_ref r;
	aoqt_ref_init(&r, 1);
	r.p[0] = 1;
	struct aoq_group g = { .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8 };
	float grad = 0.5f;
	aoqt_ref_step(&r, &g, &grad);
	double want = 1 - 0.1 * 0.5 / (0.5 + 1e-8);
	EXPECT(fabs(r.p[0] - want) < 1e-15, "one AdamW step: %.17g, want %.17g", r.p[0], want);
	aoqt_ref_free(&r);

	/* 30 steps of random inputs for both kinds against torch_step. */
	for (int kind = 0; kind < 2; kind++) {
		const size_t n = 257;
		aoqt_ref_init(&r, n);
		double *p = calloc(n, sizeof(double)), *m = calloc(n, sizeof(double)), *v = calloc(n, sizeof(double));
		float *gr = calloc(n, sizeof(float));
		struct aoqt_rng rng = { 42 };
		for (size_t i = 0; i < n; i++)
			r.p[i] = p[i] = aoqt_uniform(&rng);
		double worst = 0;
		for (uint64_t k = 1; k <= 30; k++) {
			struct aoq_group h = { .size = sizeof(struct aoq_group), .kind = kind ? AOQ_ADAM : AOQ_ADAMW, .lr = 1e-2 * (1 + 0.1 * (double)k),
			                       .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1 };
			for (size_t i = 0; i < n; i++)
				gr[i] = (float)aoqt_uniform(&rng);
			aoqt_ref_step(&r, &h, gr);
			for (size_t i = 0; i < n; i++) {
				double t = torch_step(h.kind, &p[i], &m[i], &v[i], gr[i], k, h.lr, h.beta1,
				                      h.beta2, h.eps, h.weight_decay);
				double e = fabs(t - r.p[i]) / (fabs(t) + 1e-3);
				if (e > worst)
					worst = e;
			}
		}
		EXPECT(worst < 1e-12, "%s: reference and torch-style formulation differ by %.3g",
		       kind ? "Adam" : "AdamW", worst);
		aoqt_ref_free(&r);
		free(p);
		free(m);
		free(v);
		free(gr);
	}
}

static void test_checks(void)
{
	struct aoqt_ref r;
	aoqt_ref_init(&r, 4);
	r.k = 1;
	double vals[4] = { 1.0, -3.25, 1e-3, 0.75 };
	for (int i = 0; i < 4; i++) {
		r.p[i] = vals[i];
		r.err[i] = 1e-6 * fabs(vals[i]);
	}
	float f[4], g[4];
	for (int i = 0; i < 4; i++)
		f[i] = g[i] = (float)vals[i];
	EXPECT(aoqt_check_param("exact", &r, f, AOQ_FP32) == 0, "exact fp32 rejected");
	g[1] = nextafterf(g[1], 0);
	g[2] = g[2] * (1 + 8e-7f);
	EXPECT(aoqt_check_param("near", &r, g, AOQ_FP32) == 0, "fp32 within 1e-6 rejected");
	g[0] = 1.0f + 2e-6f;
	g[3] = NAN;
	fprintf(stderr, "(two mismatches expected next)\n");
	EXPECT(aoqt_check_param("far", &r, g, AOQ_FP32) == 2, "fp32 2e-6 off or NaN accepted");

	uint16_t b[4];
	for (int i = 0; i < 4; i++)
		b[i] = (uint16_t)aoqt_encode(vals[i], AOQ_BF16);
	EXPECT(aoqt_check_param("bf16", &r, b, AOQ_BF16) == 0, "exact bf16 rejected");
	b[0]++;
	b[1]--;
	EXPECT(aoqt_check_param("bf16 1ulp", &r, b, AOQ_BF16) == 0, "bf16 1 ulp off rejected");
	b[0]++;
	fprintf(stderr, "(one mismatch expected next)\n");
	EXPECT(aoqt_check_param("bf16 2ulp", &r, b, AOQ_BF16) == 1, "bf16 2 ulp off accepted");
	aoqt_ref_free(&r);
}

int main(void)
{
	aoqt_init("unit-reference");
	test_known();
	test_all_patterns();
	test_against_compiler();
	test_reference();
	test_checks();
	if (failures) {
		fprintf(stderr, "%d failures\n", failures);
		return 1;
	}
	printf("ok\n");
	return 0;
}
