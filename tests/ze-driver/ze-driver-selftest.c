/*
 * Self-test of the aoq Level Zero test driver through the real loader.
 *
 *   ze-driver-selftest               copies through immediate lists, queues,
 *                                    events and fences; no violations
 *   ze-driver-selftest --violations  unordered copies are detected, ordered
 *                                    ones are not
 *   ze-driver-selftest --no-driver   ZE_ENABLE_ALT_DRIVERS names no driver
 *
 * ZE_ENABLE_ALT_DRIVERS must name the driver (meson sets it).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <ze_api.h>

#include "aoq-ze-testdriver.h"

#define SIZE ((size_t)(1 << 20) + 13)   /* odd on purpose */
#define THREADS 4

static void fail(int line, const char *what, ze_result_t r)
{
	fprintf(stderr, "ze-driver-selftest:%d: %s failed (0x%x)\n", line, what, (unsigned)r);
	exit(1);
}

#define ZE_OK(call)                                                           \
	do {                                                                  \
		ze_result_t r_ = (call);                                      \
		if (r_ != ZE_RESULT_SUCCESS)                                  \
			fail(__LINE__, #call, r_);                            \
	} while (0)

#define EXPECT(cond)                                                          \
	do {                                                                  \
		if (!(cond))                                                  \
			fail(__LINE__, #cond, ZE_RESULT_SUCCESS);             \
	} while (0)

struct env {
	ze_driver_handle_t driver;
	ze_device_handle_t device;
	ze_context_handle_t ctx;
	ze_event_pool_handle_t pool;
};

static const ze_command_queue_desc_t queue_desc = {
	.stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
	.mode = ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS,
};

static void fill_random(unsigned char *p, size_t n, unsigned int *seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)rand_r(seed);
}

static ze_event_handle_t event_new(const struct env *env, uint32_t index)
{
	ze_event_desc_t desc = {
		.stype = ZE_STRUCTURE_TYPE_EVENT_DESC,
		.index = index,
		.signal = ZE_EVENT_SCOPE_FLAG_HOST,
		.wait = ZE_EVENT_SCOPE_FLAG_HOST,
	};
	ze_event_handle_t ev;

	ZE_OK(zeEventCreate(env->pool, &desc, &ev));
	return ev;
}

static void *alloc_device(const struct env *env, size_t size)
{
	ze_device_mem_alloc_desc_t desc = { .stype = ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC };
	void *p;

	ZE_OK(zeMemAllocDevice(env->ctx, &desc, size, 64, env->device, &p));
	return p;
}

static void *alloc_host(const struct env *env, size_t size)
{
	ze_host_mem_alloc_desc_t desc = { .stype = ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC };
	void *p;

	ZE_OK(zeMemAllocHost(env->ctx, &desc, size, 0, &p));
	return p;
}

static ze_command_list_handle_t immediate_new(const struct env *env)
{
	ze_command_list_handle_t l;

	ZE_OK(zeCommandListCreateImmediate(env->ctx, env->device, &queue_desc, &l));
	return l;
}

static void setup(struct env *env)
{
	uint32_t n = 0;

	ZE_OK(zeInit(ZE_INIT_FLAG_GPU_ONLY));
	ZE_OK(zeInit(0));
	ZE_OK(zeDriverGet(&n, NULL));
	EXPECT(n == 1);
	ZE_OK(zeDriverGet(&n, &env->driver));

	ze_api_version_t version;
	ZE_OK(zeDriverGetApiVersion(env->driver, &version));
	EXPECT(ZE_MAJOR_VERSION(version) == 1);
	ze_driver_properties_t dprops = { .stype = ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES };
	ZE_OK(zeDriverGetProperties(env->driver, &dprops));
	n = 1;
	ZE_OK(zeDriverGetExtensionProperties(env->driver, &n, NULL));
	EXPECT(n == 0);

	n = 0;
	ZE_OK(zeDeviceGet(env->driver, &n, NULL));
	EXPECT(n == 1);
	ZE_OK(zeDeviceGet(env->driver, &n, &env->device));
	ze_device_properties_t props = { .stype = ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES };
	ZE_OK(zeDeviceGetProperties(env->device, &props));
	EXPECT(props.type == ZE_DEVICE_TYPE_GPU);
	EXPECT(strcmp(props.name, "aoq host test device") == 0);
	EXPECT(props.stype == ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES);

	n = 0;
	ZE_OK(zeDeviceGetCommandQueueGroupProperties(env->device, &n, NULL));
	EXPECT(n == 1);
	ze_command_queue_group_properties_t group = {
		.stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES,
	};
	ZE_OK(zeDeviceGetCommandQueueGroupProperties(env->device, &n, &group));
	EXPECT(group.flags & ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE);
	EXPECT(group.flags & ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY);
	EXPECT(group.numQueues >= 1);

	n = 0;
	ZE_OK(zeDeviceGetMemoryProperties(env->device, &n, NULL));
	EXPECT(n == 1);
	ze_device_memory_properties_t mem = { .stype = ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES };
	ZE_OK(zeDeviceGetMemoryProperties(env->device, &n, &mem));
	EXPECT(mem.totalSize > 0);

	ze_context_desc_t cdesc = { .stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC };
	ZE_OK(zeContextCreate(env->driver, &cdesc, &env->ctx));

	ze_event_pool_desc_t pdesc = {
		.stype = ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
		.flags = ZE_EVENT_POOL_FLAG_HOST_VISIBLE,
		.count = 16,
	};
	ZE_OK(zeEventPoolCreate(env->ctx, &pdesc, 1, &env->device, &env->pool));
}

static void teardown(struct env *env)
{
	ZE_OK(zeEventPoolDestroy(env->pool));
	ZE_OK(zeContextDestroy(env->ctx));
}

static void check_memory_queries(const struct env *env, void *dev, void *host)
{
	ze_memory_allocation_properties_t props = {
		.stype = ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES,
	};
	ze_device_handle_t owner = NULL;

	ZE_OK(zeMemGetAllocProperties(env->ctx, (char *)dev + 5, &props, &owner));
	EXPECT(props.type == ZE_MEMORY_TYPE_DEVICE);
	EXPECT(owner == env->device);
	ZE_OK(zeMemGetAllocProperties(env->ctx, host, &props, NULL));
	EXPECT(props.type == ZE_MEMORY_TYPE_HOST);

	ze_device_mem_alloc_desc_t ddesc = { .stype = ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC };
	ze_host_mem_alloc_desc_t hdesc = { .stype = ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC };
	void *shared;
	ZE_OK(zeMemAllocShared(env->ctx, &ddesc, &hdesc, 100, 0, env->device, &shared));
	ZE_OK(zeMemGetAllocProperties(env->ctx, shared, &props, NULL));
	EXPECT(props.type == ZE_MEMORY_TYPE_SHARED);
	ZE_OK(zeMemFree(env->ctx, shared));

	int on_stack = 0;
	ZE_OK(zeMemGetAllocProperties(env->ctx, &on_stack, &props, NULL));
	EXPECT(props.type == ZE_MEMORY_TYPE_UNKNOWN);

	void *base = NULL;
	size_t size = 0;
	ZE_OK(zeMemGetAddressRange(env->ctx, (char *)dev + SIZE - 1, &base, &size));
	EXPECT(base == dev && size == SIZE);
	EXPECT(zeMemGetAddressRange(env->ctx, &on_stack, &base, &size) != ZE_RESULT_SUCCESS);
	EXPECT(zeMemAllocHost(env->ctx, &hdesc, 64, 3, &base) ==
	       ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT);
	EXPECT(zeMemFree(env->ctx, NULL) == ZE_RESULT_ERROR_INVALID_NULL_POINTER);
	EXPECT(zeContextDestroy(NULL) == ZE_RESULT_ERROR_INVALID_NULL_HANDLE);
}

static void *signal_later(void *arg)
{
	struct timespec ts = { 0, 20 * 1000 * 1000 };

	nanosleep(&ts, NULL);
	ZE_OK(zeEventHostSignal(arg));
	return NULL;
}

static void check_event_waits(const struct env *env)
{
	ze_event_handle_t ev = event_new(env, 15);
	pthread_t thread;

	EXPECT(zeEventQueryStatus(ev) == ZE_RESULT_NOT_READY);
	EXPECT(zeEventHostSynchronize(ev, 0) == ZE_RESULT_NOT_READY);
	EXPECT(zeEventHostSynchronize(ev, 1000 * 1000) == ZE_RESULT_NOT_READY);
	EXPECT(pthread_create(&thread, NULL, signal_later, ev) == 0);
	ZE_OK(zeEventHostSynchronize(ev, UINT64_MAX));
	EXPECT(pthread_join(thread, NULL) == 0);
	ZE_OK(zeEventQueryStatus(ev));
	ZE_OK(zeEventHostReset(ev));
	EXPECT(zeEventQueryStatus(ev) == ZE_RESULT_NOT_READY);
	ZE_OK(zeEventDestroy(ev));
}

/* host -> device -> host through one immediate list. */
static void copy_immediate(const struct env *env, unsigned char *src, unsigned char *dst,
			   void *dev, unsigned int *seed)
{
	ze_command_list_handle_t l = immediate_new(env);
	ze_event_handle_t up = event_new(env, 0), down = event_new(env, 1);

	fill_random(src, SIZE, seed);
	memset(dst, 0, SIZE);
	ZE_OK(zeCommandListAppendMemoryCopy(l, dev, src, SIZE, up, 0, NULL));
	ZE_OK(zeCommandListAppendMemoryCopy(l, dst, dev, SIZE, down, 1, &up));
	ZE_OK(zeEventHostSynchronize(down, UINT64_MAX));
	ZE_OK(zeEventQueryStatus(up));
	EXPECT(memcmp(src, dst, SIZE) == 0);

	/* Fill, barrier, event reset on the device side. */
	const uint32_t pattern = 0x01020304;
	ZE_OK(zeEventHostReset(down));
	ZE_OK(zeCommandListAppendEventReset(l, up));
	ZE_OK(zeCommandListAppendMemoryFill(l, dev, &pattern, sizeof(pattern), SIZE, NULL, 0, NULL));
	ZE_OK(zeCommandListAppendBarrier(l, NULL, 0, NULL));
	ZE_OK(zeCommandListAppendMemoryCopy(l, dst, dev, SIZE, NULL, 0, NULL));
	ZE_OK(zeCommandListAppendSignalEvent(l, down));
	ZE_OK(zeEventHostSynchronize(down, UINT64_MAX));
	EXPECT(zeEventQueryStatus(up) == ZE_RESULT_NOT_READY);
	for (size_t i = 0; i < SIZE; i++)
		EXPECT(dst[i] == ((const unsigned char *)&pattern)[i % 4]);

	ZE_OK(zeEventDestroy(up));
	ZE_OK(zeEventDestroy(down));
	ZE_OK(zeCommandListDestroy(l));
}

/* host -> device -> host through a queue and a regular list, twice. */
static void copy_queue(const struct env *env, unsigned char *src, unsigned char *dst, void *dev,
		       unsigned int *seed)
{
	ze_command_queue_handle_t q;
	ze_command_list_handle_t l;
	ze_fence_handle_t fence;
	ze_command_list_desc_t ldesc = { .stype = ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC };
	ze_fence_desc_t fdesc = { .stype = ZE_STRUCTURE_TYPE_FENCE_DESC };
	ze_event_handle_t up = event_new(env, 2), down = event_new(env, 3);

	ZE_OK(zeCommandQueueCreate(env->ctx, env->device, &queue_desc, &q));
	ZE_OK(zeCommandListCreate(env->ctx, env->device, &ldesc, &l));
	ZE_OK(zeFenceCreate(q, &fdesc, &fence));
	EXPECT(zeFenceQueryStatus(fence) == ZE_RESULT_NOT_READY);

	for (int round = 0; round < 2; round++) {
		fill_random(src, SIZE, seed);
		memset(dst, 0, SIZE);
		ZE_OK(zeCommandListReset(l));
		ZE_OK(zeCommandListAppendMemoryCopy(l, dev, src, SIZE, up, 0, NULL));
		ZE_OK(zeCommandListAppendWaitOnEvents(l, 1, &up));
		ZE_OK(zeCommandListAppendMemoryCopy(l, dst, dev, SIZE, down, 0, NULL));
		ZE_OK(zeCommandListAppendEventReset(l, up));
		ZE_OK(zeCommandListClose(l));
		ZE_OK(zeCommandQueueExecuteCommandLists(q, 1, &l, fence));
		ZE_OK(zeFenceHostSynchronize(fence, UINT64_MAX));
		ZE_OK(zeEventHostSynchronize(down, UINT64_MAX));
		EXPECT(memcmp(src, dst, SIZE) == 0);
		EXPECT(zeEventQueryStatus(up) == ZE_RESULT_NOT_READY);
		ZE_OK(zeCommandQueueSynchronize(q, UINT64_MAX));
		ZE_OK(zeFenceReset(fence));
		ZE_OK(zeEventHostReset(down));
	}

	/* An open list is refused. */
	ZE_OK(zeCommandListReset(l));
	EXPECT(zeCommandQueueExecuteCommandLists(q, 1, &l, NULL) != ZE_RESULT_SUCCESS);

	ZE_OK(zeFenceDestroy(fence));
	ZE_OK(zeCommandListDestroy(l));
	ZE_OK(zeCommandQueueDestroy(q));
	ZE_OK(zeEventDestroy(up));
	ZE_OK(zeEventDestroy(down));
}

/* Upload on an immediate list, download on a queue that waits for it. */
static void copy_across(const struct env *env, unsigned char *src, unsigned char *dst, void *dev,
			unsigned int *seed)
{
	ze_command_list_handle_t imm = immediate_new(env), l;
	ze_command_queue_handle_t q;
	ze_fence_handle_t fence;
	ze_command_list_desc_t ldesc = { .stype = ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC };
	ze_fence_desc_t fdesc = { .stype = ZE_STRUCTURE_TYPE_FENCE_DESC };
	ze_event_handle_t up = event_new(env, 4);

	ZE_OK(zeCommandQueueCreate(env->ctx, env->device, &queue_desc, &q));
	ZE_OK(zeCommandListCreate(env->ctx, env->device, &ldesc, &l));
	ZE_OK(zeFenceCreate(q, &fdesc, &fence));
	fill_random(src, SIZE, seed);
	memset(dst, 0, SIZE);
	ZE_OK(zeCommandListAppendMemoryCopy(l, dst, dev, SIZE, NULL, 1, &up));
	ZE_OK(zeCommandListClose(l));
	ZE_OK(zeCommandQueueExecuteCommandLists(q, 1, &l, fence));
	ZE_OK(zeCommandListAppendMemoryCopy(imm, dev, src, SIZE, up, 0, NULL));
	ZE_OK(zeFenceHostSynchronize(fence, UINT64_MAX));
	EXPECT(memcmp(src, dst, SIZE) == 0);

	ZE_OK(zeFenceDestroy(fence));
	ZE_OK(zeCommandListDestroy(l));
	ZE_OK(zeCommandQueueDestroy(q));
	ZE_OK(zeCommandListDestroy(imm));
	ZE_OK(zeEventDestroy(up));
}

struct worker_arg {
	const struct env *env;
	uint32_t index;
	bool ok;
};

/* Each thread round-trips its own buffers through its own immediate list. */
static void *worker(void *p)
{
	struct worker_arg *arg = p;
	const struct env *env = arg->env;
	const size_t size = 4096 + 7;
	unsigned int seed = arg->index;
	ze_command_list_handle_t l = immediate_new(env);
	ze_event_handle_t done = event_new(env, 8 + arg->index);
	unsigned char *src = alloc_host(env, size), *dst = alloc_host(env, size);
	void *dev = alloc_device(env, size);

	arg->ok = true;
	for (int i = 0; i < 20; i++) {
		fill_random(src, size, &seed);
		ZE_OK(zeCommandListAppendMemoryCopy(l, dev, src, size, NULL, 0, NULL));
		ZE_OK(zeCommandListAppendMemoryCopy(l, dst, dev, size, done, 0, NULL));
		ZE_OK(zeEventHostSynchronize(done, UINT64_MAX));
		ZE_OK(zeEventHostReset(done));
		if (memcmp(src, dst, size) != 0)
			arg->ok = false;
	}
	ZE_OK(zeMemFree(env->ctx, dev));
	ZE_OK(zeMemFree(env->ctx, dst));
	ZE_OK(zeMemFree(env->ctx, src));
	ZE_OK(zeEventDestroy(done));
	ZE_OK(zeCommandListDestroy(l));
	return NULL;
}

static void copy_threads(const struct env *env)
{
	pthread_t threads[THREADS];
	struct worker_arg args[THREADS];

	for (uint32_t i = 0; i < THREADS; i++) {
		args[i] = (struct worker_arg){ .env = env, .index = i };
		EXPECT(pthread_create(&threads[i], NULL, worker, &args[i]) == 0);
	}
	for (uint32_t i = 0; i < THREADS; i++) {
		EXPECT(pthread_join(threads[i], NULL) == 0);
		EXPECT(args[i].ok);
	}
}

static int run_copies(void)
{
	struct env env;
	unsigned int seed = (unsigned int)time(NULL);

	setup(&env);
	EXPECT(aoq_ze_testdriver_violations_loaded() == 0);

	unsigned char *src = alloc_host(&env, SIZE);
	unsigned char *dst = alloc_host(&env, SIZE);
	void *dev = alloc_device(&env, SIZE);

	check_memory_queries(&env, dev, src);
	check_event_waits(&env);
	copy_immediate(&env, src, dst, dev, &seed);
	copy_queue(&env, src, dst, dev, &seed);
	copy_across(&env, src, dst, dev, &seed);
	copy_threads(&env);

	ZE_OK(zeMemFree(env.ctx, dev));
	ZE_OK(zeMemFree(env.ctx, dst));
	ZE_OK(zeMemFree(env.ctx, src));
	teardown(&env);

	int64_t v = aoq_ze_testdriver_violations_loaded();
	printf("violations: %" PRId64 "\n", v);
	EXPECT(v == 0);
	return 0;
}

/* With AOQ_ZE_DELAY_US set, unordered copies must be caught; ordered ones not. */
static int run_violations(void)
{
	const size_t size = 64 * 1024;
	struct env env;
	unsigned int seed = (unsigned int)time(NULL);

	setup(&env);
	unsigned char *src = alloc_host(&env, size), *dst = alloc_host(&env, size);
	void *dev = alloc_device(&env, size);
	ze_command_list_handle_t a = immediate_new(&env), b = immediate_new(&env);
	ze_event_handle_t ea = event_new(&env, 0), eb = event_new(&env, 1);

	for (int i = 0; i < 20; i++) {
		fill_random(src, size, &seed);
		/* read after write: b waits for a's upload */
		ZE_OK(zeCommandListAppendMemoryCopy(a, dev, src, size, ea, 0, NULL));
		ZE_OK(zeCommandListAppendMemoryCopy(b, dst, dev, size, eb, 1, &ea));
		ZE_OK(zeEventHostSynchronize(eb, UINT64_MAX));
		EXPECT(memcmp(src, dst, size) == 0);
		ZE_OK(zeEventHostReset(ea));
		ZE_OK(zeEventHostReset(eb));
		/* write after read: a's upload waits for b's download */
		ZE_OK(zeCommandListAppendMemoryCopy(a, dev, src, size, ea, 1, &eb));
		ZE_OK(zeCommandListAppendMemoryCopy(b, dst, dev, size, eb, 0, NULL));
		ZE_OK(zeEventHostSynchronize(ea, UINT64_MAX));
		ZE_OK(zeEventHostReset(ea));
		ZE_OK(zeEventHostReset(eb));
	}
	EXPECT(aoq_ze_testdriver_violations_loaded() == 0);

	/* No ordering at all: with random delays one of these races is seen
	 * with overwhelming probability. */
	int tries = 0;
	while (aoq_ze_testdriver_violations_loaded() == 0 && tries++ < 500) {
		ZE_OK(zeCommandListAppendMemoryCopy(a, dev, src, size, ea, 0, NULL));
		ZE_OK(zeCommandListAppendMemoryCopy(b, dst, dev, size, eb, 0, NULL));
		ZE_OK(zeEventHostSynchronize(ea, UINT64_MAX));
		ZE_OK(zeEventHostSynchronize(eb, UINT64_MAX));
		ZE_OK(zeEventHostReset(ea));
		ZE_OK(zeEventHostReset(eb));
	}
	int64_t v = aoq_ze_testdriver_violations_loaded();
	printf("violations after %d unordered tries: %" PRId64 "\n", tries, v);
	EXPECT(v > 0);

	ZE_OK(zeEventDestroy(ea));
	ZE_OK(zeEventDestroy(eb));
	ZE_OK(zeCommandListDestroy(a));
	ZE_OK(zeCommandListDestroy(b));
	ZE_OK(zeMemFree(env.ctx, dev));
	ZE_OK(zeMemFree(env.ctx, dst));
	ZE_OK(zeMemFree(env.ctx, src));
	teardown(&env);
	return 0;
}

/* The loader finds no driver: zeInit fails, and nothing else may be called
 * then (the loader can crash); if it succeeds, there must be no driver. */
static int run_no_driver(void)
{
	ze_result_t r = zeInit(ZE_INIT_FLAG_GPU_ONLY);

	if (r != ZE_RESULT_SUCCESS) {
		printf("zeInit: 0x%x (no driver)\n", (unsigned)r);
		return 0;
	}
	uint32_t n = 0;
	r = zeDriverGet(&n, NULL);
	printf("zeInit succeeded; zeDriverGet: 0x%x, %" PRIu32 " drivers\n", (unsigned)r, n);
	EXPECT(r != ZE_RESULT_SUCCESS || n == 0);
	EXPECT(aoq_ze_testdriver_violations_loaded() == -1);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[1], "--violations") == 0)
		return run_violations();
	if (argc == 2 && strcmp(argv[1], "--no-driver") == 0)
		return run_no_driver();
	if (argc != 1) {
		fprintf(stderr, "usage: %s [--violations | --no-driver]\n", argv[0]);
		return 2;
	}
	return run_copies();
}
