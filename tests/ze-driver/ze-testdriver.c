/*
 * aoq Level Zero test driver: one GPU-typed device whose memory is host
 * memory, loaded by the real loader through ZE_ENABLE_ALT_DRIVERS.
 *
 * Every command queue and immediate command list is an "engine": a FIFO of
 * commands run in order by one thread. All state is guarded by one mutex;
 * every state change broadcasts one condition variable and every waiter
 * re-checks its own predicate, so nothing spins.
 *
 * Only the *ProcAddrTable getters and aoq_ze_testdriver_violations() are
 * exported; the API functions are static and reached through the tables.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ze_api.h>
#include <ze_ddi.h>
#include <zes_ddi.h>
#include <zet_ddi.h>

#include "aoq-ze-testdriver.h"

#define EXPORT __attribute__((visibility("default")))

#define DEVICE_NAME "aoq host test device"
#define NUM_QUEUES 4           /* queues in the single queue group */
#define MAX_PATTERN 128        /* maxMemoryFillPatternSize */
#define MIN_ALIGN 64
#define MAX_ALLOC (UINT64_C(4) << 30)
#define DEVICE_GARBAGE 0xa5    /* fresh device memory is not zero */

enum magic {
	MAGIC_DRIVER = 0x61647276,
	MAGIC_DEVICE,
	MAGIC_CONTEXT,
	MAGIC_QUEUE,
	MAGIC_LIST,
	MAGIC_POOL,
	MAGIC_EVENT,
	MAGIC_FENCE,
	MAGIC_DEAD = 0x64656164,
};

enum cmd_type { CMD_COPY, CMD_FILL, CMD_WAIT, CMD_SIGNAL, CMD_RESET, CMD_FENCE };

struct cmd {
	struct cmd *next;
	enum cmd_type type;
	void *dst;                      /* COPY, FILL */
	const void *src;                /* COPY */
	size_t size;                    /* COPY, FILL */
	ze_event_handle_t event;        /* WAIT, SIGNAL, RESET */
	ze_fence_handle_t fence;        /* FENCE */
	size_t pattern_size;            /* FILL */
	unsigned char pattern[MAX_PATTERN];
};

struct cmd_fifo {
	struct cmd *head;
	struct cmd *tail;
};

/* An in-order engine: the commands in fifo run one after another on thread;
 * the command being run stays at the head until it is done. */
struct engine {
	struct engine *next;            /* in g.engines */
	struct cmd_fifo fifo;
	pthread_t thread;
	bool stop;
	bool synchronous;
	unsigned int seed;
};

/* The loader's handle types are incomplete structs; complete them here. */
struct _ze_driver_handle_t {
	enum magic magic;
};

struct _ze_device_handle_t {
	enum magic magic;
};

struct _ze_context_handle_t {
	enum magic magic;
};

struct _ze_command_queue_handle_t {
	enum magic magic;
	struct engine engine;
};

struct _ze_command_list_handle_t {
	enum magic magic;
	bool immediate;
	bool closed;                    /* regular lists */
	struct cmd_fifo cmds;           /* regular lists: recorded commands */
	struct engine engine;           /* immediate lists */
};

struct _ze_event_pool_handle_t {
	enum magic magic;
	uint32_t count;
};

struct _ze_event_handle_t {
	enum magic magic;
	bool signaled;
};

struct _ze_fence_handle_t {
	enum magic magic;
	bool signaled;
	ze_command_queue_handle_t queue;
};

struct alloc {
	struct alloc *next;
	void *base;
	size_t size;
	ze_memory_type_t type;
	uint64_t id;
};

static struct {
	pthread_mutex_t lock;
	pthread_cond_t cond;            /* broadcast on every state change */
	struct engine *engines;
	struct alloc *allocs;
	uint64_t next_alloc_id;
	uint64_t violations;
	unsigned long delay_us;         /* AOQ_ZE_DELAY_US */
} g = {
	.lock = PTHREAD_MUTEX_INITIALIZER,
};

static struct _ze_driver_handle_t the_driver = { MAGIC_DRIVER };
static struct _ze_device_handle_t the_device = { MAGIC_DEVICE };

__attribute__((constructor)) static void global_init(void)
{
	pthread_condattr_t attr;

	/* Timed waits use CLOCK_MONOTONIC. Nothing here can fail in practice;
	 * if it did, the default-clock condvar would still work. */
	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_init(&g.cond, &attr);
	pthread_condattr_destroy(&attr);

	const char *s = getenv("AOQ_ZE_DELAY_US");
	if (s && *s) {
		char *end;
		errno = 0;
		unsigned long v = strtoul(s, &end, 10);
		if (!errno && !*end && v <= 10 * 1000 * 1000)
			g.delay_us = v;
	}
}

/* ---- helpers ------------------------------------------------------------ */

#define CHECK_HANDLE(h, m)                                                    \
	do {                                                                  \
		if (!(h))                                                     \
			return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;           \
		if ((h)->magic != (m))                                        \
			return ZE_RESULT_ERROR_INVALID_ARGUMENT;              \
	} while (0)

#define CHECK_PTR(p)                                                          \
	do {                                                                  \
		if (!(p))                                                     \
			return ZE_RESULT_ERROR_INVALID_NULL_POINTER;          \
	} while (0)

static void lock(void)
{
	pthread_mutex_lock(&g.lock);
}

static void unlock(void)
{
	pthread_mutex_unlock(&g.lock);
}

static void changed(void)
{
	pthread_cond_broadcast(&g.cond);
}

typedef bool (*done_fn)(const void *obj);

/* Wait with g.lock held until done(obj); timeout in ns, UINT64_MAX = none. */
static ze_result_t wait_done(done_fn done, const void *obj, uint64_t timeout)
{
	if (done(obj))
		return ZE_RESULT_SUCCESS;
	if (timeout == 0)
		return ZE_RESULT_NOT_READY;
	if (timeout == UINT64_MAX) {
		while (!done(obj))
			pthread_cond_wait(&g.cond, &g.lock);
		return ZE_RESULT_SUCCESS;
	}

	struct timespec deadline;
	clock_gettime(CLOCK_MONOTONIC, &deadline);
	deadline.tv_sec += (time_t)(timeout / 1000000000u);
	deadline.tv_nsec += (long)(timeout % 1000000000u);
	if (deadline.tv_nsec >= 1000000000L) {
		deadline.tv_sec++;
		deadline.tv_nsec -= 1000000000L;
	}
	while (!done(obj)) {
		if (pthread_cond_timedwait(&g.cond, &g.lock, &deadline) == ETIMEDOUT)
			return done(obj) ? ZE_RESULT_SUCCESS : ZE_RESULT_NOT_READY;
	}
	return ZE_RESULT_SUCCESS;
}

static bool ranges_overlap(const void *a, size_t na, const void *b, size_t nb)
{
	uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;

	return na && nb && pa < pb + nb && pb < pa + na;
}

static void fifo_push(struct cmd_fifo *f, struct cmd *c)
{
	c->next = NULL;
	if (f->tail)
		f->tail->next = c;
	else
		f->head = c;
	f->tail = c;
}

static void fifo_splice(struct cmd_fifo *f, struct cmd_fifo *batch)
{
	if (!batch->head)
		return;
	if (f->tail)
		f->tail->next = batch->head;
	else
		f->head = batch->head;
	f->tail = batch->tail;
	batch->head = batch->tail = NULL;
}

static void fifo_clear(struct cmd_fifo *f)
{
	struct cmd *c = f->head;

	while (c) {
		struct cmd *next = c->next;
		free(c);
		c = next;
	}
	f->head = f->tail = NULL;
}

static struct cmd *cmd_new(struct cmd_fifo *batch, enum cmd_type type)
{
	struct cmd *c = calloc(1, sizeof(*c));

	if (c) {
		c->type = type;
		fifo_push(batch, c);
	}
	return c;
}

/* ---- engines ------------------------------------------------------------ */

static void delay(struct engine *e)
{
	uint64_t r = ((uint64_t)rand_r(&e->seed) << 31) ^ (uint64_t)rand_r(&e->seed);
	uint64_t us = r % (g.delay_us + 1);
	struct timespec ts = {
		.tv_sec = (time_t)(us / 1000000u),
		.tv_nsec = (long)(us % 1000000u) * 1000,
	};

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

/*
 * Called with g.lock held just before a copy on engine self reads
 * [src, src + size). A write queued on another engine is unordered with this
 * read unless it sits behind a wait on an event that is not signaled yet (the
 * event might be signaled after this read); count one violation if any such
 * unordered pending write overlaps the read.
 */
static void check_read(const struct engine *self, const void *src, size_t size)
{
	for (const struct engine *e = g.engines; e; e = e->next) {
		if (e == self)
			continue;
		for (const struct cmd *c = e->fifo.head; c; c = c->next) {
			if (c->type == CMD_WAIT && !c->event->signaled)
				break;
			if ((c->type == CMD_COPY || c->type == CMD_FILL) &&
			    ranges_overlap(c->dst, c->size, src, size)) {
				g.violations++;
				return;
			}
		}
	}
}

static void fill(void *dst, size_t size, const unsigned char *pattern, size_t n)
{
	unsigned char *d = dst;

	for (size_t i = 0; i < size; i += n)
		memcpy(d + i, pattern, size - i < n ? size - i : n);
}

/* Runs c with g.lock held (dropped around memory traffic). Returns false
 * when the engine is being stopped while c waits. */
static bool run_cmd(struct engine *e, struct cmd *c)
{
	switch (c->type) {
	case CMD_COPY:
		check_read(e, c->src, c->size);
		unlock();
		memcpy(c->dst, c->src, c->size);
		lock();
		break;
	case CMD_FILL:
		unlock();
		fill(c->dst, c->size, c->pattern, c->pattern_size);
		lock();
		break;
	case CMD_WAIT:
		while (!e->stop && !c->event->signaled)
			pthread_cond_wait(&g.cond, &g.lock);
		if (e->stop)
			return false;
		break;
	case CMD_SIGNAL:
		c->event->signaled = true;
		break;
	case CMD_RESET:
		c->event->signaled = false;
		break;
	case CMD_FENCE:
		c->fence->signaled = true;
		break;
	}
	return true;
}

static void *engine_main(void *arg)
{
	struct engine *e = arg;

	lock();
	for (;;) {
		while (!e->stop && !e->fifo.head)
			pthread_cond_wait(&g.cond, &g.lock);
		if (e->stop)
			break;
		struct cmd *c = e->fifo.head;
		if (g.delay_us) {
			unlock();
			delay(e);
			lock();
			if (e->stop)
				break;
		}
		if (!run_cmd(e, c))
			break;
		e->fifo.head = c->next;
		if (!e->fifo.head)
			e->fifo.tail = NULL;
		free(c);
		changed();
	}
	unlock();
	return NULL;
}

static ze_result_t engine_start(struct engine *e, bool synchronous)
{
	memset(e, 0, sizeof(*e));
	e->synchronous = synchronous;
	e->seed = (unsigned int)time(NULL) ^ (unsigned int)(uintptr_t)e;

	lock();
	e->next = g.engines;
	g.engines = e;
	unlock();
	if (pthread_create(&e->thread, NULL, engine_main, e) == 0)
		return ZE_RESULT_SUCCESS;

	lock();
	for (struct engine **p = &g.engines; *p; p = &(*p)->next) {
		if (*p == e) {
			*p = e->next;
			break;
		}
	}
	unlock();
	return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
}

/* Stops the thread; commands still queued (an application error) are dropped. */
static void engine_stop(struct engine *e)
{
	lock();
	e->stop = true;
	changed();
	unlock();
	pthread_join(e->thread, NULL);

	lock();
	for (struct engine **p = &g.engines; *p; p = &(*p)->next) {
		if (*p == e) {
			*p = e->next;
			break;
		}
	}
	fifo_clear(&e->fifo);
	changed();
	unlock();
}

static bool engine_idle(const void *obj)
{
	const struct engine *e = obj;

	return !e->fifo.head || e->stop;
}

/* Takes ownership of batch. */
static void engine_submit(struct engine *e, struct cmd_fifo *batch)
{
	lock();
	fifo_splice(&e->fifo, batch);
	changed();
	if (e->synchronous)
		wait_done(engine_idle, e, UINT64_MAX);
	unlock();
}

/* ---- driver and device -------------------------------------------------- */

static ze_result_t ZE_APICALL init(ze_init_flags_t flags)
{
	/* The loader calls this more than once; there is nothing to set up. */
	if (flags & ~(ze_init_flags_t)(ZE_INIT_FLAG_GPU_ONLY | ZE_INIT_FLAG_VPU_ONLY))
		return ZE_RESULT_ERROR_INVALID_ENUMERATION;
	if (flags && !(flags & ZE_INIT_FLAG_GPU_ONLY))
		return ZE_RESULT_ERROR_UNINITIALIZED;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL driver_get(uint32_t *count, ze_driver_handle_t *drivers)
{
	CHECK_PTR(count);
	if (*count && drivers)
		drivers[0] = &the_driver;
	*count = 1;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL driver_get_api_version(ze_driver_handle_t drv,
						    ze_api_version_t *version)
{
	CHECK_HANDLE(drv, MAGIC_DRIVER);
	CHECK_PTR(version);
	*version = ZE_API_VERSION_CURRENT;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL driver_get_properties(ze_driver_handle_t drv,
						   ze_driver_properties_t *props)
{
	static const char uuid[ZE_MAX_DRIVER_UUID_SIZE] = "aoq-ze-testdrv";

	CHECK_HANDLE(drv, MAGIC_DRIVER);
	CHECK_PTR(props);
	memcpy(props->uuid.id, uuid, sizeof(props->uuid.id));
	props->driverVersion = 1;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL driver_get_extension_properties(ze_driver_handle_t drv,
							     uint32_t *count,
							     ze_driver_extension_properties_t *props)
{
	(void)props;
	CHECK_HANDLE(drv, MAGIC_DRIVER);
	CHECK_PTR(count);
	*count = 0;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL device_get(ze_driver_handle_t drv, uint32_t *count,
					 ze_device_handle_t *devices)
{
	CHECK_HANDLE(drv, MAGIC_DRIVER);
	CHECK_PTR(count);
	if (*count && devices)
		devices[0] = &the_device;
	*count = 1;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL device_get_sub_devices(ze_device_handle_t dev, uint32_t *count,
						     ze_device_handle_t *subs)
{
	(void)subs;
	CHECK_HANDLE(dev, MAGIC_DEVICE);
	CHECK_PTR(count);
	*count = 0;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL device_get_properties(ze_device_handle_t dev,
						   ze_device_properties_t *p)
{
	static const char uuid[ZE_MAX_DEVICE_UUID_SIZE] = "aoq-ze-testdev";

	CHECK_HANDLE(dev, MAGIC_DEVICE);
	CHECK_PTR(p);
	/* stype and pNext belong to the caller. */
	p->type = ZE_DEVICE_TYPE_GPU;
	p->vendorId = 0;
	p->deviceId = 0;
	p->flags = 0;
	p->subdeviceId = 0;
	p->coreClockRate = 1000;
	p->maxMemAllocSize = MAX_ALLOC;
	p->maxHardwareContexts = 64;
	p->maxCommandQueuePriority = 0;
	p->numThreadsPerEU = 1;
	p->physicalEUSimdWidth = 8;
	p->numEUsPerSubslice = 1;
	p->numSubslicesPerSlice = 1;
	p->numSlices = 1;
	p->timerResolution = 1;
	p->timestampValidBits = 64;
	p->kernelTimestampValidBits = 64;
	memcpy(p->uuid.id, uuid, sizeof(p->uuid.id));
	memset(p->name, 0, sizeof(p->name));
	memcpy(p->name, DEVICE_NAME, sizeof(DEVICE_NAME));
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL device_get_queue_groups(ze_device_handle_t dev, uint32_t *count,
						      ze_command_queue_group_properties_t *p)
{
	CHECK_HANDLE(dev, MAGIC_DEVICE);
	CHECK_PTR(count);
	if (*count == 0 || !p) {
		*count = 1;
		return ZE_RESULT_SUCCESS;
	}
	p[0].flags = ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE |
		     ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY;
	p[0].maxMemoryFillPatternSize = MAX_PATTERN;
	p[0].numQueues = NUM_QUEUES;
	*count = 1;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL device_get_memory_properties(ze_device_handle_t dev,
							  uint32_t *count,
							  ze_device_memory_properties_t *p)
{
	static const char name[] = "host memory";

	CHECK_HANDLE(dev, MAGIC_DEVICE);
	CHECK_PTR(count);
	if (*count == 0 || !p) {
		*count = 1;
		return ZE_RESULT_SUCCESS;
	}
	long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
	p[0].flags = 0;
	p[0].maxClockRate = 1000;
	p[0].maxBusWidth = 64;
	p[0].totalSize = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : MAX_ALLOC;
	memset(p[0].name, 0, sizeof(p[0].name));
	memcpy(p[0].name, name, sizeof(name));
	*count = 1;
	return ZE_RESULT_SUCCESS;
}

/* ---- contexts and memory ------------------------------------------------ */

static ze_result_t ZE_APICALL context_create(ze_driver_handle_t drv, const ze_context_desc_t *desc,
					     ze_context_handle_t *out)
{
	CHECK_HANDLE(drv, MAGIC_DRIVER);
	CHECK_PTR(desc);
	CHECK_PTR(out);
	ze_context_handle_t ctx = calloc(1, sizeof(*ctx));
	if (!ctx)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	ctx->magic = MAGIC_CONTEXT;
	*out = ctx;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL context_destroy(ze_context_handle_t ctx)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	ctx->magic = MAGIC_DEAD;
	free(ctx);
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL context_get_status(ze_context_handle_t ctx)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	return ZE_RESULT_SUCCESS;
}

/* With g.lock held: the allocation containing ptr, or NULL. */
static struct alloc *alloc_find(const void *ptr)
{
	uintptr_t p = (uintptr_t)ptr;

	for (struct alloc *a = g.allocs; a; a = a->next) {
		if (p >= (uintptr_t)a->base && p - (uintptr_t)a->base < a->size)
			return a;
	}
	return NULL;
}

static ze_result_t mem_alloc(ze_context_handle_t ctx, ze_memory_type_t type, size_t size,
			     size_t alignment, void **out)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	CHECK_PTR(out);
	if (size == 0 || size > MAX_ALLOC)
		return ZE_RESULT_ERROR_UNSUPPORTED_SIZE;
	if (alignment & (alignment - 1))
		return ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT;

	struct alloc *a = calloc(1, sizeof(*a));
	if (!a)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	if (posix_memalign(&a->base, alignment > MIN_ALIGN ? alignment : MIN_ALIGN, size)) {
		free(a);
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	}
	/* Make reads of never-written device memory visible in tests. */
	if (type == ZE_MEMORY_TYPE_DEVICE)
		memset(a->base, DEVICE_GARBAGE, size);
	a->size = size;
	a->type = type;

	lock();
	a->id = ++g.next_alloc_id;
	a->next = g.allocs;
	g.allocs = a;
	unlock();
	*out = a->base;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_alloc_device(ze_context_handle_t ctx,
					       const ze_device_mem_alloc_desc_t *desc, size_t size,
					       size_t alignment, ze_device_handle_t dev, void **out)
{
	CHECK_PTR(desc);
	CHECK_HANDLE(dev, MAGIC_DEVICE);
	return mem_alloc(ctx, ZE_MEMORY_TYPE_DEVICE, size, alignment, out);
}

static ze_result_t ZE_APICALL mem_alloc_host(ze_context_handle_t ctx,
					     const ze_host_mem_alloc_desc_t *desc, size_t size,
					     size_t alignment, void **out)
{
	CHECK_PTR(desc);
	return mem_alloc(ctx, ZE_MEMORY_TYPE_HOST, size, alignment, out);
}

static ze_result_t ZE_APICALL mem_alloc_shared(ze_context_handle_t ctx,
					       const ze_device_mem_alloc_desc_t *ddesc,
					       const ze_host_mem_alloc_desc_t *hdesc, size_t size,
					       size_t alignment, ze_device_handle_t dev, void **out)
{
	CHECK_PTR(ddesc);
	CHECK_PTR(hdesc);
	/* A NULL device is allowed for shared allocations. */
	if (dev && dev->magic != MAGIC_DEVICE)
		return ZE_RESULT_ERROR_INVALID_ARGUMENT;
	return mem_alloc(ctx, ZE_MEMORY_TYPE_SHARED, size, alignment, out);
}

static ze_result_t ZE_APICALL mem_free(ze_context_handle_t ctx, void *ptr)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	CHECK_PTR(ptr);

	lock();
	for (struct alloc **p = &g.allocs; *p; p = &(*p)->next) {
		struct alloc *a = *p;
		if (a->base == ptr) {
			*p = a->next;
			unlock();
			free(a->base);
			free(a);
			return ZE_RESULT_SUCCESS;
		}
	}
	unlock();
	return ZE_RESULT_ERROR_INVALID_ARGUMENT;
}

static ze_result_t ZE_APICALL mem_get_alloc_properties(ze_context_handle_t ctx, const void *ptr,
						      ze_memory_allocation_properties_t *props,
						      ze_device_handle_t *dev)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	CHECK_PTR(ptr);
	CHECK_PTR(props);

	lock();
	const struct alloc *a = alloc_find(ptr);
	props->type = a ? a->type : ZE_MEMORY_TYPE_UNKNOWN;
	props->id = a ? a->id : 0;
	props->pageSize = a ? (uint64_t)sysconf(_SC_PAGESIZE) : 0;
	if (dev)
		*dev = a && a->type != ZE_MEMORY_TYPE_HOST ? &the_device : NULL;
	unlock();
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_get_address_range(ze_context_handle_t ctx, const void *ptr,
						   void **base, size_t *size)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	CHECK_PTR(ptr);

	lock();
	const struct alloc *a = alloc_find(ptr);
	if (a) {
		if (base)
			*base = a->base;
		if (size)
			*size = a->size;
	}
	unlock();
	return a ? ZE_RESULT_SUCCESS : ZE_RESULT_ERROR_INVALID_ARGUMENT;
}

/* ---- command queues and lists ------------------------------------------- */

static ze_result_t check_queue_desc(const ze_command_queue_desc_t *desc)
{
	CHECK_PTR(desc);
	if (desc->ordinal != 0 || desc->index >= NUM_QUEUES)
		return ZE_RESULT_ERROR_INVALID_ARGUMENT;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL queue_create(ze_context_handle_t ctx, ze_device_handle_t dev,
					   const ze_command_queue_desc_t *desc,
					   ze_command_queue_handle_t *out)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	CHECK_HANDLE(dev, MAGIC_DEVICE);
	CHECK_PTR(out);
	ze_result_t r = check_queue_desc(desc);
	if (r != ZE_RESULT_SUCCESS)
		return r;

	ze_command_queue_handle_t q = calloc(1, sizeof(*q));
	if (!q)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	r = engine_start(&q->engine, desc->mode == ZE_COMMAND_QUEUE_MODE_SYNCHRONOUS);
	if (r != ZE_RESULT_SUCCESS) {
		free(q);
		return r;
	}
	q->magic = MAGIC_QUEUE;
	*out = q;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL queue_destroy(ze_command_queue_handle_t q)
{
	CHECK_HANDLE(q, MAGIC_QUEUE);
	engine_stop(&q->engine);
	q->magic = MAGIC_DEAD;
	free(q);
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL queue_execute(ze_command_queue_handle_t q, uint32_t n,
					    ze_command_list_handle_t *lists, ze_fence_handle_t fence)
{
	CHECK_HANDLE(q, MAGIC_QUEUE);
	CHECK_PTR(lists);
	if (n == 0)
		return ZE_RESULT_ERROR_INVALID_SIZE;
	if (fence && (fence->magic != MAGIC_FENCE || fence->queue != q))
		return ZE_RESULT_ERROR_INVALID_ARGUMENT;

	struct cmd_fifo batch = { NULL, NULL };
	ze_result_t r = ZE_RESULT_SUCCESS;

	lock();
	for (uint32_t i = 0; i < n && r == ZE_RESULT_SUCCESS; i++) {
		ze_command_list_handle_t l = lists[i];
		if (!l) {
			r = ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
			break;
		}
		if (l->magic != MAGIC_LIST || l->immediate || !l->closed) {
			r = ZE_RESULT_ERROR_INVALID_ARGUMENT;
			break;
		}
		for (const struct cmd *c = l->cmds.head; c; c = c->next) {
			struct cmd *copy = malloc(sizeof(*copy));
			if (!copy) {
				r = ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
				break;
			}
			*copy = *c;
			fifo_push(&batch, copy);
		}
	}
	unlock();
	if (r == ZE_RESULT_SUCCESS && fence) {
		struct cmd *c = cmd_new(&batch, CMD_FENCE);
		if (c)
			c->fence = fence;
		else
			r = ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	}
	if (r != ZE_RESULT_SUCCESS) {
		fifo_clear(&batch);
		return r;
	}
	engine_submit(&q->engine, &batch);
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL queue_synchronize(ze_command_queue_handle_t q, uint64_t timeout)
{
	CHECK_HANDLE(q, MAGIC_QUEUE);
	lock();
	ze_result_t r = wait_done(engine_idle, &q->engine, timeout);
	unlock();
	return r;
}

static ze_result_t ZE_APICALL list_create(ze_context_handle_t ctx, ze_device_handle_t dev,
					  const ze_command_list_desc_t *desc,
					  ze_command_list_handle_t *out)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	CHECK_HANDLE(dev, MAGIC_DEVICE);
	CHECK_PTR(desc);
	CHECK_PTR(out);
	if (desc->commandQueueGroupOrdinal != 0)
		return ZE_RESULT_ERROR_INVALID_ARGUMENT;

	ze_command_list_handle_t l = calloc(1, sizeof(*l));
	if (!l)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	l->magic = MAGIC_LIST;
	*out = l;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL list_create_immediate(ze_context_handle_t ctx,
						    ze_device_handle_t dev,
						    const ze_command_queue_desc_t *desc,
						    ze_command_list_handle_t *out)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	CHECK_HANDLE(dev, MAGIC_DEVICE);
	CHECK_PTR(out);
	ze_result_t r = check_queue_desc(desc);
	if (r != ZE_RESULT_SUCCESS)
		return r;

	ze_command_list_handle_t l = calloc(1, sizeof(*l));
	if (!l)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	r = engine_start(&l->engine, desc->mode == ZE_COMMAND_QUEUE_MODE_SYNCHRONOUS);
	if (r != ZE_RESULT_SUCCESS) {
		free(l);
		return r;
	}
	l->magic = MAGIC_LIST;
	l->immediate = true;
	*out = l;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL list_destroy(ze_command_list_handle_t l)
{
	CHECK_HANDLE(l, MAGIC_LIST);
	if (l->immediate)
		engine_stop(&l->engine);
	fifo_clear(&l->cmds);
	l->magic = MAGIC_DEAD;
	free(l);
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL list_close(ze_command_list_handle_t l)
{
	CHECK_HANDLE(l, MAGIC_LIST);
	lock();
	l->closed = true;
	unlock();
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL list_reset(ze_command_list_handle_t l)
{
	CHECK_HANDLE(l, MAGIC_LIST);
	lock();
	if (!l->immediate) {
		fifo_clear(&l->cmds);
		l->closed = false;
	}
	unlock();
	return ZE_RESULT_SUCCESS;
}

/*
 * Appends [waits...] op [signal] to l, in that order; op may be NULL. Takes
 * ownership of op. Immediate lists start running them at once.
 */
static ze_result_t append(ze_command_list_handle_t l, struct cmd *op, ze_event_handle_t signal,
			  uint32_t nwait, const ze_event_handle_t *waits)
{
	struct cmd_fifo batch = { NULL, NULL };
	ze_result_t r = ZE_RESULT_SUCCESS;

	if (!l)
		r = ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
	else if (l->magic != MAGIC_LIST)
		r = ZE_RESULT_ERROR_INVALID_ARGUMENT;
	else if (nwait && !waits)
		r = ZE_RESULT_ERROR_INVALID_SIZE;
	else if (signal && signal->magic != MAGIC_EVENT)
		r = ZE_RESULT_ERROR_INVALID_ARGUMENT;

	for (uint32_t i = 0; i < nwait && r == ZE_RESULT_SUCCESS; i++) {
		struct cmd *c;
		if (!waits[i])
			r = ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
		else if (waits[i]->magic != MAGIC_EVENT)
			r = ZE_RESULT_ERROR_INVALID_ARGUMENT;
		else if (!(c = cmd_new(&batch, CMD_WAIT)))
			r = ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
		else
			c->event = waits[i];
	}
	if (op && r == ZE_RESULT_SUCCESS)
		fifo_push(&batch, op);
	else
		free(op);
	if (signal && r == ZE_RESULT_SUCCESS) {
		struct cmd *c = cmd_new(&batch, CMD_SIGNAL);
		if (c)
			c->event = signal;
		else
			r = ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	}
	if (r != ZE_RESULT_SUCCESS) {
		fifo_clear(&batch);
		return r;
	}

	if (l->immediate) {
		engine_submit(&l->engine, &batch);
		return ZE_RESULT_SUCCESS;
	}
	lock();
	if (l->closed)
		r = ZE_RESULT_ERROR_INVALID_ARGUMENT;
	else
		fifo_splice(&l->cmds, &batch);
	unlock();
	fifo_clear(&batch);
	return r;
}

static struct cmd *op_new(enum cmd_type type)
{
	struct cmd *c = calloc(1, sizeof(*c));

	if (c)
		c->type = type;
	return c;
}

static ze_result_t ZE_APICALL list_append_copy(ze_command_list_handle_t l, void *dst,
					       const void *src, size_t size,
					       ze_event_handle_t signal, uint32_t nwait,
					       ze_event_handle_t *waits)
{
	CHECK_PTR(dst);
	CHECK_PTR(src);
	if (ranges_overlap(dst, size, src, size))
		return ZE_RESULT_ERROR_OVERLAPPING_REGIONS;
	struct cmd *c = op_new(CMD_COPY);
	if (!c)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	c->dst = dst;
	c->src = src;
	c->size = size;
	return append(l, c, signal, nwait, waits);
}

static ze_result_t ZE_APICALL list_append_fill(ze_command_list_handle_t l, void *dst,
					       const void *pattern, size_t pattern_size,
					       size_t size, ze_event_handle_t signal,
					       uint32_t nwait, ze_event_handle_t *waits)
{
	CHECK_PTR(dst);
	CHECK_PTR(pattern);
	if (pattern_size == 0 || pattern_size > MAX_PATTERN ||
	    (pattern_size & (pattern_size - 1)))
		return ZE_RESULT_ERROR_INVALID_SIZE;
	struct cmd *c = op_new(CMD_FILL);
	if (!c)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	c->dst = dst;
	c->size = size;
	c->pattern_size = pattern_size;
	memcpy(c->pattern, pattern, pattern_size);
	return append(l, c, signal, nwait, waits);
}

static ze_result_t ZE_APICALL list_append_barrier(ze_command_list_handle_t l,
						  ze_event_handle_t signal, uint32_t nwait,
						  ze_event_handle_t *waits)
{
	/* Engines run in order, so a barrier is just its waits and signal. */
	return append(l, NULL, signal, nwait, waits);
}

static ze_result_t ZE_APICALL list_append_signal(ze_command_list_handle_t l,
						 ze_event_handle_t ev)
{
	CHECK_HANDLE(ev, MAGIC_EVENT);
	return append(l, NULL, ev, 0, NULL);
}

static ze_result_t ZE_APICALL list_append_wait(ze_command_list_handle_t l, uint32_t n,
					       ze_event_handle_t *events)
{
	CHECK_PTR(events);
	return append(l, NULL, NULL, n, events);
}

static ze_result_t ZE_APICALL list_append_event_reset(ze_command_list_handle_t l,
						      ze_event_handle_t ev)
{
	CHECK_HANDLE(ev, MAGIC_EVENT);
	struct cmd *c = op_new(CMD_RESET);
	if (!c)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	c->event = ev;
	return append(l, c, NULL, 0, NULL);
}

/* ---- events and fences -------------------------------------------------- */

static ze_result_t ZE_APICALL pool_create(ze_context_handle_t ctx, const ze_event_pool_desc_t *desc,
					  uint32_t ndev, ze_device_handle_t *devs,
					  ze_event_pool_handle_t *out)
{
	CHECK_HANDLE(ctx, MAGIC_CONTEXT);
	CHECK_PTR(desc);
	CHECK_PTR(out);
	if (desc->count == 0 || (ndev && !devs))
		return ZE_RESULT_ERROR_INVALID_SIZE;
	for (uint32_t i = 0; i < ndev; i++)
		CHECK_HANDLE(devs[i], MAGIC_DEVICE);

	ze_event_pool_handle_t pool = calloc(1, sizeof(*pool));
	if (!pool)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	pool->magic = MAGIC_POOL;
	pool->count = desc->count;
	*out = pool;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL pool_destroy(ze_event_pool_handle_t pool)
{
	CHECK_HANDLE(pool, MAGIC_POOL);
	pool->magic = MAGIC_DEAD;
	free(pool);
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL event_create(ze_event_pool_handle_t pool, const ze_event_desc_t *desc,
					   ze_event_handle_t *out)
{
	CHECK_HANDLE(pool, MAGIC_POOL);
	CHECK_PTR(desc);
	CHECK_PTR(out);
	if (desc->index >= pool->count)
		return ZE_RESULT_ERROR_INVALID_ARGUMENT;

	ze_event_handle_t ev = calloc(1, sizeof(*ev));
	if (!ev)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	ev->magic = MAGIC_EVENT;
	*out = ev;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL event_destroy(ze_event_handle_t ev)
{
	CHECK_HANDLE(ev, MAGIC_EVENT);
	ev->magic = MAGIC_DEAD;
	free(ev);
	return ZE_RESULT_SUCCESS;
}

static ze_result_t set_event(ze_event_handle_t ev, bool signaled)
{
	CHECK_HANDLE(ev, MAGIC_EVENT);
	lock();
	ev->signaled = signaled;
	changed();
	unlock();
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL event_host_signal(ze_event_handle_t ev)
{
	return set_event(ev, true);
}

static ze_result_t ZE_APICALL event_host_reset(ze_event_handle_t ev)
{
	return set_event(ev, false);
}

static bool event_signaled(const void *obj)
{
	return ((const struct _ze_event_handle_t *)obj)->signaled;
}

static ze_result_t ZE_APICALL event_host_synchronize(ze_event_handle_t ev, uint64_t timeout)
{
	CHECK_HANDLE(ev, MAGIC_EVENT);
	lock();
	ze_result_t r = wait_done(event_signaled, ev, timeout);
	unlock();
	return r;
}

static ze_result_t ZE_APICALL event_query_status(ze_event_handle_t ev)
{
	return event_host_synchronize(ev, 0);
}

static ze_result_t ZE_APICALL fence_create(ze_command_queue_handle_t q, const ze_fence_desc_t *desc,
					   ze_fence_handle_t *out)
{
	CHECK_HANDLE(q, MAGIC_QUEUE);
	CHECK_PTR(desc);
	CHECK_PTR(out);

	ze_fence_handle_t f = calloc(1, sizeof(*f));
	if (!f)
		return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
	f->magic = MAGIC_FENCE;
	f->signaled = desc->flags & ZE_FENCE_FLAG_SIGNALED;
	f->queue = q;
	*out = f;
	return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL fence_destroy(ze_fence_handle_t f)
{
	CHECK_HANDLE(f, MAGIC_FENCE);
	f->magic = MAGIC_DEAD;
	free(f);
	return ZE_RESULT_SUCCESS;
}

static bool fence_signaled(const void *obj)
{
	return ((const struct _ze_fence_handle_t *)obj)->signaled;
}

static ze_result_t ZE_APICALL fence_host_synchronize(ze_fence_handle_t f, uint64_t timeout)
{
	CHECK_HANDLE(f, MAGIC_FENCE);
	lock();
	ze_result_t r = wait_done(fence_signaled, f, timeout);
	unlock();
	return r;
}

static ze_result_t ZE_APICALL fence_query_status(ze_fence_handle_t f)
{
	return fence_host_synchronize(f, 0);
}

static ze_result_t ZE_APICALL fence_reset(ze_fence_handle_t f)
{
	CHECK_HANDLE(f, MAGIC_FENCE);
	lock();
	f->signaled = false;
	unlock();
	return ZE_RESULT_SUCCESS;
}

/* ---- exported ----------------------------------------------------------- */

EXPORT uint64_t aoq_ze_testdriver_violations(void)
{
	lock();
	uint64_t n = g.violations;
	unlock();
	return n;
}

/* ---- DDI tables --------------------------------------------------------- */

static ze_result_t ZE_APICALL unsupported(void)
{
	return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE;
}

/*
 * Points every entry of a DDI table at unsupported(). The tables hold nothing
 * but function pointers; the callers' arguments are ignored, which the C
 * calling conventions of the supported platforms tolerate.
 */
static void fill_unsupported(void *table, size_t size)
{
	ze_result_t (*fn)(void) = unsupported;

	for (size_t off = 0; off + sizeof(fn) <= size; off += sizeof(fn))
		memcpy((char *)table + off, &fn, sizeof(fn));
}

static ze_result_t check_table(ze_api_version_t version, void *table, size_t size)
{
	const ze_api_version_t ours = ZE_API_VERSION_CURRENT;

	CHECK_PTR(table);
	/* An older loader's table could be smaller than ours. */
	if (ZE_MAJOR_VERSION(version) != ZE_MAJOR_VERSION(ours) ||
	    ZE_MINOR_VERSION(version) < ZE_MINOR_VERSION(ours))
		return ZE_RESULT_ERROR_UNSUPPORTED_VERSION;
	fill_unsupported(table, size);
	return ZE_RESULT_SUCCESS;
}

#define TABLE(name, type)                                                     \
	ze_result_t ZE_APICALL name(ze_api_version_t version, type *t)        \
	{                                                                     \
		return check_table(version, t, sizeof(*t));                   \
	}

#define TABLE_BEGIN(name, type)                                               \
	ze_result_t ZE_APICALL name(ze_api_version_t version, type *t)        \
	{                                                                     \
		ze_result_t r = check_table(version, t, sizeof(*t));          \
		if (r != ZE_RESULT_SUCCESS)                                   \
			return r;

#define TABLE_END                                                             \
		return ZE_RESULT_SUCCESS;                                     \
	}

TABLE_BEGIN(zeGetGlobalProcAddrTable, ze_global_dditable_t)
	t->pfnInit = init;
TABLE_END

TABLE_BEGIN(zeGetDriverProcAddrTable, ze_driver_dditable_t)
	t->pfnGet = driver_get;
	t->pfnGetApiVersion = driver_get_api_version;
	t->pfnGetProperties = driver_get_properties;
	t->pfnGetExtensionProperties = driver_get_extension_properties;
TABLE_END

TABLE_BEGIN(zeGetDeviceProcAddrTable, ze_device_dditable_t)
	t->pfnGet = device_get;
	t->pfnGetSubDevices = device_get_sub_devices;
	t->pfnGetProperties = device_get_properties;
	t->pfnGetCommandQueueGroupProperties = device_get_queue_groups;
	t->pfnGetMemoryProperties = device_get_memory_properties;
TABLE_END

TABLE_BEGIN(zeGetContextProcAddrTable, ze_context_dditable_t)
	t->pfnCreate = context_create;
	t->pfnDestroy = context_destroy;
	t->pfnGetStatus = context_get_status;
TABLE_END

TABLE_BEGIN(zeGetCommandQueueProcAddrTable, ze_command_queue_dditable_t)
	t->pfnCreate = queue_create;
	t->pfnDestroy = queue_destroy;
	t->pfnExecuteCommandLists = queue_execute;
	t->pfnSynchronize = queue_synchronize;
TABLE_END

TABLE_BEGIN(zeGetCommandListProcAddrTable, ze_command_list_dditable_t)
	t->pfnCreate = list_create;
	t->pfnCreateImmediate = list_create_immediate;
	t->pfnDestroy = list_destroy;
	t->pfnClose = list_close;
	t->pfnReset = list_reset;
	t->pfnAppendBarrier = list_append_barrier;
	t->pfnAppendMemoryCopy = list_append_copy;
	t->pfnAppendMemoryFill = list_append_fill;
	t->pfnAppendSignalEvent = list_append_signal;
	t->pfnAppendWaitOnEvents = list_append_wait;
	t->pfnAppendEventReset = list_append_event_reset;
TABLE_END

TABLE_BEGIN(zeGetFenceProcAddrTable, ze_fence_dditable_t)
	t->pfnCreate = fence_create;
	t->pfnDestroy = fence_destroy;
	t->pfnHostSynchronize = fence_host_synchronize;
	t->pfnQueryStatus = fence_query_status;
	t->pfnReset = fence_reset;
TABLE_END

TABLE_BEGIN(zeGetEventPoolProcAddrTable, ze_event_pool_dditable_t)
	t->pfnCreate = pool_create;
	t->pfnDestroy = pool_destroy;
TABLE_END

TABLE_BEGIN(zeGetEventProcAddrTable, ze_event_dditable_t)
	t->pfnCreate = event_create;
	t->pfnDestroy = event_destroy;
	t->pfnHostSignal = event_host_signal;
	t->pfnHostSynchronize = event_host_synchronize;
	t->pfnQueryStatus = event_query_status;
	t->pfnHostReset = event_host_reset;
TABLE_END

TABLE_BEGIN(zeGetMemProcAddrTable, ze_mem_dditable_t)
	t->pfnAllocShared = mem_alloc_shared;
	t->pfnAllocDevice = mem_alloc_device;
	t->pfnAllocHost = mem_alloc_host;
	t->pfnFree = mem_free;
	t->pfnGetAllocProperties = mem_get_alloc_properties;
	t->pfnGetAddressRange = mem_get_address_range;
TABLE_END

/* Core tables with nothing implemented. */
TABLE(zeGetDeviceExpProcAddrTable, ze_device_exp_dditable_t)
TABLE(zeGetImageProcAddrTable, ze_image_dditable_t)
TABLE(zeGetImageExpProcAddrTable, ze_image_exp_dditable_t)
TABLE(zeGetEventExpProcAddrTable, ze_event_exp_dditable_t)
TABLE(zeGetModuleProcAddrTable, ze_module_dditable_t)
TABLE(zeGetModuleBuildLogProcAddrTable, ze_module_build_log_dditable_t)
TABLE(zeGetKernelProcAddrTable, ze_kernel_dditable_t)
TABLE(zeGetKernelExpProcAddrTable, ze_kernel_exp_dditable_t)
TABLE(zeGetSamplerProcAddrTable, ze_sampler_dditable_t)
TABLE(zeGetPhysicalMemProcAddrTable, ze_physical_mem_dditable_t)
TABLE(zeGetVirtualMemProcAddrTable, ze_virtual_mem_dditable_t)
TABLE(zeGetFabricVertexExpProcAddrTable, ze_fabric_vertex_exp_dditable_t)
TABLE(zeGetFabricEdgeExpProcAddrTable, ze_fabric_edge_exp_dditable_t)

/* Tools (zet) tables. */
TABLE(zetGetDeviceProcAddrTable, zet_device_dditable_t)
TABLE(zetGetContextProcAddrTable, zet_context_dditable_t)
TABLE(zetGetCommandListProcAddrTable, zet_command_list_dditable_t)
TABLE(zetGetModuleProcAddrTable, zet_module_dditable_t)
TABLE(zetGetKernelProcAddrTable, zet_kernel_dditable_t)
TABLE(zetGetMetricGroupProcAddrTable, zet_metric_group_dditable_t)
TABLE(zetGetMetricGroupExpProcAddrTable, zet_metric_group_exp_dditable_t)
TABLE(zetGetMetricProcAddrTable, zet_metric_dditable_t)
TABLE(zetGetMetricStreamerProcAddrTable, zet_metric_streamer_dditable_t)
TABLE(zetGetMetricQueryPoolProcAddrTable, zet_metric_query_pool_dditable_t)
TABLE(zetGetMetricQueryProcAddrTable, zet_metric_query_dditable_t)
TABLE(zetGetTracerExpProcAddrTable, zet_tracer_exp_dditable_t)
TABLE(zetGetDebugProcAddrTable, zet_debug_dditable_t)

/* Sysman (zes) tables. */
TABLE(zesGetDriverProcAddrTable, zes_driver_dditable_t)
TABLE(zesGetDeviceProcAddrTable, zes_device_dditable_t)
TABLE(zesGetSchedulerProcAddrTable, zes_scheduler_dditable_t)
TABLE(zesGetPerformanceFactorProcAddrTable, zes_performance_factor_dditable_t)
TABLE(zesGetPowerProcAddrTable, zes_power_dditable_t)
TABLE(zesGetFrequencyProcAddrTable, zes_frequency_dditable_t)
TABLE(zesGetEngineProcAddrTable, zes_engine_dditable_t)
TABLE(zesGetStandbyProcAddrTable, zes_standby_dditable_t)
TABLE(zesGetFirmwareProcAddrTable, zes_firmware_dditable_t)
TABLE(zesGetMemoryProcAddrTable, zes_memory_dditable_t)
TABLE(zesGetFabricPortProcAddrTable, zes_fabric_port_dditable_t)
TABLE(zesGetTemperatureProcAddrTable, zes_temperature_dditable_t)
TABLE(zesGetPsuProcAddrTable, zes_psu_dditable_t)
TABLE(zesGetFanProcAddrTable, zes_fan_dditable_t)
TABLE(zesGetLedProcAddrTable, zes_led_dditable_t)
TABLE(zesGetRasProcAddrTable, zes_ras_dditable_t)
TABLE(zesGetDiagnosticsProcAddrTable, zes_diagnostics_dditable_t)
