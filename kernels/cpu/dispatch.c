/* SPDX-License-Identifier: MIT */
/*
 * Run-time choice of the kernel variant: a best-first table of what was
 * compiled in, filtered by the CPU's features and the OS's saved vector
 * state (XCR0), ending in plain C.  Compiled without special flags.
 */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define AOQK_X86 1
#endif

#include "aoq-kernel.h"
#include "kernel-internal.h"

extern const struct aoqk_kernel aoqk_kernel_scalar;
#ifdef AOQK_HAVE_AVX2
extern const struct aoqk_kernel aoqk_kernel_avx2, aoqk_kernel_avx2_cached;
#endif
#ifdef AOQK_HAVE_AVX512
extern const struct aoqk_kernel aoqk_kernel_avx512, aoqk_kernel_avx512_cached;
#endif
#ifdef AOQK_HAVE_AVX512BF16
extern const struct aoqk_kernel aoqk_kernel_avx512bf16, aoqk_kernel_avx512bf16_cached;
#endif

enum feat { F_AVX2 = 1, F_AVX512 = 2, F_AVX512BF16 = 4 };

static unsigned cpu_features(void)
{
	unsigned f = 0;
#ifdef AOQK_X86
	unsigned a, b, c, d;

	if (!__get_cpuid(1, &a, &b, &c, &d))
		return 0;
	bool fma = c & (1u << 12), aes = c & (1u << 25), osxsave = c & (1u << 27),
	     avx = c & (1u << 28), f16c = c & (1u << 29);
	if (!osxsave || !avx)
		return 0;
	unsigned xlo, xhi;
	__asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
	bool os_avx = (xlo & 0x6) == 0x6;       /* SSE and AVX state */
	bool os_avx512 = (xlo & 0xe6) == 0xe6;  /* plus opmask, ZMM_Hi256, Hi16_ZMM */
	if (!os_avx || __get_cpuid_max(0, NULL) < 7)
		return 0;
	__cpuid_count(7, 0, a, b, c, d);
	bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512dq = b & (1u << 17), avx512bw = b & (1u << 30),
	     avx512vl = b & (1u << 31), vbmi = c & (1u << 1),
	     vaes = c & (1u << 9);
	unsigned sub_max = a;
	bool bf16 = false;
	if (sub_max >= 1) {
		__cpuid_count(7, 1, a, b, c, d);
		bf16 = a & (1u << 5);
	}
	/* AES-NI (q8's random bits: kernel-common.h) is on every x86 CPU with
	 * AVX2 but may be masked by a hypervisor */
	if (avx2 && fma && f16c && aes)
		f |= F_AVX2;
	if ((f & F_AVX2) && os_avx512 && avx512f && avx512bw && avx512vl)
		f |= F_AVX512;
	/* avx512bf16 also packs q8 codes with VBMI and draws their random
	 * bits with VAES: every CPU with BF16 but Cooper Lake has both, and
	 * Cooper Lake runs avx512; and classifies floats with DQ (the split
	 * master's pair loop), which every CPU with BF16 has */
	if ((f & F_AVX512) && avx512dq && bf16 && vbmi && vaes)
		f |= F_AVX512BF16;
#endif
	return f;
}

/* Best first; the "-cached" twins (plain stores of the parameter instead
 * of non-temporal ones) follow and are chosen only by name. */
static const struct {
	const struct aoqk_kernel *k;
	unsigned need;
	bool twin;
} table[] = {
#ifdef AOQK_HAVE_AVX512BF16
	{ &aoqk_kernel_avx512bf16, F_AVX512BF16, false },
#endif
#ifdef AOQK_HAVE_AVX512
	{ &aoqk_kernel_avx512, F_AVX512, false },
#endif
#ifdef AOQK_HAVE_AVX2
	{ &aoqk_kernel_avx2, F_AVX2, false },
#endif
	{ &aoqk_kernel_scalar, 0, false },
#ifdef AOQK_HAVE_AVX512BF16
	{ &aoqk_kernel_avx512bf16_cached, F_AVX512BF16, true },
#endif
#ifdef AOQK_HAVE_AVX512
	{ &aoqk_kernel_avx512_cached, F_AVX512, true },
#endif
#ifdef AOQK_HAVE_AVX2
	{ &aoqk_kernel_avx2_cached, F_AVX2, true },
#endif
};
#define NTABLE (sizeof(table) / sizeof(table[0]))

static pthread_once_t once = PTHREAD_ONCE_INIT;
static unsigned features;
static const struct aoqk_kernel *available[NTABLE + 1];
static struct aoqk_variant variants[NTABLE];

static void init(void)
{
	size_t na = 0;

	features = cpu_features();
	for (size_t i = 0; i < NTABLE; i++) {
		bool ok = (features & table[i].need) == table[i].need;
		variants[i].kernel = table[i].k;
		variants[i].runnable = ok;
		if (ok && !table[i].twin)
			available[na++] = table[i].k;
	}
	available[na] = NULL;
}

const struct aoqk_kernel *const *aoqk_available(void)
{
	pthread_once(&once, init);
	return available;
}

const struct aoqk_variant *aoqk_variants(size_t *n)
{
	pthread_once(&once, init);
	*n = NTABLE;
	return variants;
}

static bool known_name(const char *s)
{
	static const char *const names[] = { "scalar", "avx2", "avx512", "avx512bf16",
	                                     "avx2-cached", "avx512-cached", "avx512bf16-cached" };
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (!strcmp(s, names[i]))
			return true;
	return false;
}

const struct aoqk_kernel *aoqk_select(const char *force)
{
	pthread_once(&once, init);
	if (!force || !*force || !strcmp(force, "auto"))
		return available[0];
	for (size_t i = 0; i < NTABLE; i++) {
		if (strcmp(force, table[i].k->name))
			continue;
		if (!variants[i].runnable) {
			errno = ENOTSUP;
			return NULL;
		}
		return table[i].k;
	}
	/* a known variant that this build did not compile in */
	errno = known_name(force) ? ENOTSUP : ENOENT;
	return NULL;
}
