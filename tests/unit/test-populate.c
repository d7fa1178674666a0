/* SPDX-License-Identifier: MIT */
/*
 * A new state faulted in on the pool (daemon/populate.h), with
 * MADV_POPULATE_WRITE and with the touching fallback:
 * 1. once the pool is idle every page of every tensor's arrays is resident
 *    (mincore), the masters memfd's and the private ones, and no page of
 *    an undo copy (the undo swap remaps those);
 * 2. what a writer stores into the arrays while they are populated stays
 *    (a LoadState running beside the chunks);
 * 3. a session closed (dead, or its populating stopped) while its chunks
 *    wait behind a gate: the chunks hold it, do nothing, and the last one
 *    frees it (ASan and valgrind see a use after free or a leak).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "populate.h"
#include "server.h"
#include "session.h"

#include "expect.h"

#define NT 4
static const uint64_t sizes[NT] = { 1, 4097, (3u << 20) + 13, 1u << 20 };

static struct aoqd_server srv;
static size_t page;

static struct aoqd_session *new_state(Aoq__StatePrecision prec, bool undo)
{
	struct aoqd_session *s = aoqd_session_new(&srv);
	if (!s)
		abort();
	struct aoqd_state *st = &s->st;
	st->precision = prec;
	st->undo = undo;
	st->groups = calloc(1, sizeof(*st->groups));
	st->tensors = calloc(NT, sizeof(*st->tensors));
	if (!st->groups || !st->tensors)
		abort();
	Aoq__Hyperparams h = AOQ__HYPERPARAMS__INIT;
	h.lr = 1e-3;
	h.beta1 = 0.9;
	h.beta2 = 0.999;
	h.eps = 1e-8;
	aoqd_group_set(&st->groups[0], AOQ__OPTIMIZER_KIND__ADAMW, &h);
	st->groups[0].moments = aoqd_group_moments(&st->groups[0]);
	st->ngroups = st->cap_groups = 1;
	for (int i = 0; i < NT; i++) {
		struct aoqd_tensor *x = &st->tensors[i];
		x->name = strdup("t");
		x->numel = sizes[i];
		x->param_dtype = AOQK_BF16; /* a bf16 master goes to the masters memfd */
		x->grad_dtype = AOQK_BF16;
	}
	st->ntensors = st->cap_tensors = NT;
	uint64_t failed = 0;
	int r = aoqd_state_alloc(st, 0, &srv.locked_bytes, &failed);
	EXPECT(r == 0, "aoqd_state_alloc: %d", r);
	if (r < 0)
		abort();
	return s;
}

/* Pages of [p, p + len) resident. */
static size_t resident(const void *p, size_t len)
{
	size_t n = (len + page - 1) / page, k = 0;
	unsigned char *v = malloc(n ? n : 1);
	if (!v || mincore((void *)p, len, v) != 0) {
		EXPECT(0, "mincore failed");
		free(v);
		return 0;
	}
	for (size_t i = 0; i < n; i++)
		k += v[i] & 1;
	free(v);
	return k;
}

static void wait_idle(void)
{
	EXPECT(aoqd_pool_wait_idle(srv.pool, 30ull * 1000000000u, NULL), "the pool did not finish in 30 s");
}

static void all_resident(Aoq__StatePrecision prec, bool undo, const char *how)
{
	struct aoqd_session *s = new_state(prec, undo);
	aoqd_populate_start(s);
	wait_idle();
	for (int i = 0; i < NT; i++) {
		const struct aoqd_tensor *t = &s->st.tensors[i];
		size_t end = t->undo_off ? t->undo_off : t->state_len;
		size_t want = (end + page - 1) / page, got = resident(t->state_mem, end);
		EXPECT(got == want, "%s, precision %d: tensor %d: %zu of %zu pages resident", how, (int)prec, i, got, want);
		/* the undo copy: not populated, but the large folios (THP,
		 * mTHP) that hold the arrays' end may reach into it */
		size_t spill = (4u << 20) / page, u;
		if (t->undo_off)
			EXPECT((u = resident((uint8_t *)t->state_mem + t->undo_off, t->state_len - t->undo_off)) <= spill,
			       "%s: tensor %d: %zu pages of its undo copy faulted in", how, i, u);
	}
	EXPECT(aoqd_session_refcount(s) == 1, "%s: %d references after the pool went idle", how,
	       aoqd_session_refcount(s));
	aoqd_session_unref(s);
}

/* ---- a writer beside the chunks ---- */

static uint8_t pattern(size_t i)
{
	return (uint8_t)(i * 131u + 7u) | 1u; /* never 0: a zero written over it shows */
}

static void *writer(void *arg)
{
	const struct aoqd_tensor *t = arg;
	uint8_t *p = t->state_mem;
	size_t end = t->undo_off ? t->undo_off : t->state_len;
	/* from the end backwards, so that writer and chunks meet */
	for (size_t o = end; o > 0;) {
		size_t n = o < 65536 ? o : 65536;
		o -= n;
		for (size_t i = o; i < o + n; i++)
			p[i] = pattern(i);
	}
	return NULL;
}

static void no_clobber(const char *how)
{
	struct aoqd_session *s = new_state(AOQ__STATE_PRECISION__STATE_BF16_Q8, false);
	struct aoqd_tensor *t = &s->st.tensors[2];
	pthread_t w;
	if (pthread_create(&w, NULL, writer, t) != 0)
		abort();
	aoqd_populate_start(s);
	pthread_join(w, NULL);
	wait_idle();
	const uint8_t *p = t->state_mem;
	size_t end = t->undo_off ? t->undo_off : t->state_len, bad = 0;
	for (size_t i = 0; i < end; i++)
		bad += p[i] != pattern(i);
	EXPECT(bad == 0, "%s: %zu bytes written beside the chunks changed", how, bad);
	aoqd_session_unref(s);
}

/* ---- closed while queued ---- */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static bool gate_open;
static unsigned entered;
static _Atomic int holds, releases;

static void run_gate(struct aoqd_task *t, unsigned worker)
{
	(void)t;
	(void)worker;
	pthread_mutex_lock(&lock);
	entered++;
	pthread_cond_broadcast(&cond);
	while (!gate_open)
		pthread_cond_wait(&cond, &lock);
	pthread_mutex_unlock(&lock);
}

static void hold(struct aoqd_session *s)
{
	atomic_fetch_add(&holds, 1);
	aoqd_session_ref(s);
}

static void release(struct aoqd_session *s)
{
	atomic_fetch_add(&releases, 1);
	aoqd_session_unref(s);
}

static const struct aoqd_steps_ops counting = { .hold = hold, .release = release };

static void closed_while_queued(bool stop)
{
	unsigned n = aoqd_pool_threads(srv.pool);
	struct aoqd_task gates[8];
	struct aoqd_queue gq = { 0 };
	memset(gates, 0, sizeof(gates));
	gate_open = false;
	entered = 0;
	for (unsigned i = 0; i < n; i++) {
		gates[i].run = run_gate;
		aoqd_pool_submit(srv.pool, &gq, (struct aoqd_key){ 0, 0 }, &gates[i], &gates[i], 1);
	}
	pthread_mutex_lock(&lock);
	while (entered < n)
		pthread_cond_wait(&cond, &lock);
	pthread_mutex_unlock(&lock);
	/* every worker held: the chunks wait in the queue */
	struct aoqd_session *s = new_state(AOQ__STATE_PRECISION__STATE_BF16_Q8, true);
	s->steps.ops = &counting;
	holds = releases = 0;
	aoqd_populate_start(s);
	EXPECT(holds == 1 && aoqd_pool_queued(srv.pool, &s->queue) > 0, "%d holds, %llu chunks queued", holds,
	       (unsigned long long)aoqd_pool_queued(srv.pool, &s->queue));
	if (stop)
		aoqd_populate_stop(s);
	else
		atomic_store(&s->dead, true); /* as aoqd_session_close */
	aoqd_session_unref(s); /* the chunks' reference is the last */
	pthread_mutex_lock(&lock);
	gate_open = true;
	pthread_cond_broadcast(&cond);
	pthread_mutex_unlock(&lock);
	wait_idle();
	EXPECT(holds == 1 && releases == 1, "%s: %d holds, %d releases", stop ? "stopped" : "dead", holds, releases);
}

int main(void)
{
	page = (size_t)sysconf(_SC_PAGESIZE);
	srv.pool = aoqd_pool_new(2, NULL, 0);
	if (!srv.pool)
		return 1;
	for (int touch = 0; touch < 2; touch++) {
		const char *how = touch ? "touching" : "madvise";
		aoqd_populate_touch(touch);
		all_resident(AOQ__STATE_PRECISION__STATE_BF16_Q8, false, how); /* masters memfd */
		all_resident(AOQ__STATE_PRECISION__STATE_Q8, true, how);       /* fp32 master, undo copies */
		all_resident(AOQ__STATE_PRECISION__STATE_BF16_Q4, true, how);
#if defined(__SANITIZE_THREAD__)
		/* TSan reports the fallback's compare-and-swap beside the
		 * writer's plain stores: the mixed access is the point */
		if (touch)
			continue;
#endif
		no_clobber(how);
	}
	aoqd_populate_touch(false);
	closed_while_queued(false);
	closed_while_queued(true);
	aoqd_pool_free(srv.pool);
	printf("%s\n", failures ? "FAILED" : "ok");
	return failures != 0;
}
