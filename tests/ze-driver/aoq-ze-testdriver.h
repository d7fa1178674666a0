/* Test-side interface of the aoq Level Zero test driver (see README.md). */
#ifndef AOQ_ZE_TESTDRIVER_H
#define AOQ_ZE_TESTDRIVER_H

#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define AOQ_ZE_TESTDRIVER_SONAME "libaoq-ze-testdriver.so"

/*
 * Exported by the driver: how many executed copies read bytes that a copy
 * (or fill) queued on another engine, and not ordered before the reader, was
 * still about to write.
 */
uint64_t aoq_ze_testdriver_violations(void);

/*
 * For tests linked against the loader: read the counter of the driver copy
 * the loader has loaded. Returns -1 when the driver is not loaded (yet).
 */
static inline int64_t aoq_ze_testdriver_violations_loaded(void)
{
	void *lib = dlopen(AOQ_ZE_TESTDRIVER_SONAME, RTLD_NOW | RTLD_NOLOAD);
	if (!lib)
		return -1;
	void *sym = dlsym(lib, "aoq_ze_testdriver_violations");
	uint64_t (*fn)(void);
	int64_t n = -1;
	if (sym) {
		memcpy(&fn, &sym, sizeof(fn));
		n = (int64_t)fn();
	}
	dlclose(lib);
	return n;
}

#endif
