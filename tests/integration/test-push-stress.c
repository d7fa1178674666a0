/* SPDX-License-Identifier: MIT */
/*
 * Many threads pushing through one libaoq client, several all-bf16 sessions
 * at once: the producer side's stress test (a bf16-all session was once
 * closed with "the to-daemon ring's head counter is corrupt").  Built with
 * -Db_sanitize=thread this is the ThreadSanitizer run of the push paths,
 * grad_copied and the progress thread.
 *
 * SESSIONS sessions train at once, each from its own thread; in each,
 * PUSHERS threads push disjoint sets of tensors every step, concurrently,
 * then the session's thread ends the step and syncs.  One session streams
 * through a window of staging slots, one has a tensor larger than
 * AOQ_PUSH_CHUNK_ELEMS (several records per push); the rings (256 records)
 * wrap many times.
 * Every session must end its STEPS steps without an error, and its
 * parameters must equal, bit for bit, those of the same session (same
 * seed) pushed from a single thread afterwards.
 *
 * "spin" (second argument): aoqd with one pinned worker and loop_spin_us =
 * 20, so that its loop polls the rings after a doorbell that finds no
 * backlog and libaoq skips the doorbell meanwhile; the spin starts and
 * stops while pushes race it, in half the steps (how often depends on the
 * pace: a slower, sanitized worker has a backlog more of the time).  A lost wake-up hangs a session
 * (the test's timeout); on one core aoqd does not pin, and the run is the
 * plain one.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "harness.h"

#define SESSIONS 3
#define PUSHERS 6
#define NT 48
#define STEPS_DEFAULT 60

static struct aoqt_daemon daemon_;
static unsigned steps = STEPS_DEFAULT;

struct sess {
	int id;
	bool threaded;
	uint64_t window;
	uint64_t numel[NT];
	void *param[NT];
	void *grad[NT];
	struct aoq_client *c;
	pthread_barrier_t go, done;
	uint64_t k;
	atomic_int err;
};

static void fill_grads(struct sess *s, int t, uint64_t k)
{
	struct aoqt_rng rng = aoqt_rng_for(0x77 + k, (uint64_t)s->id * 1000 + (uint64_t)t, 0);
	for (uint64_t i = 0; i < s->numel[t]; i++)
		aoqt_store(s->grad[t], i, AOQ_BF16, 0.05 * aoqt_uniform(&rng));
}

struct pusher {
	struct sess *s;
	int index;
};

static void *pusher_main(void *arg)
{
	struct pusher *p = arg;
	struct sess *s = p->s;
	for (;;) {
		pthread_barrier_wait(&s->go);
		if (s->k == 0)
			return NULL;
		for (int t = p->index; t < NT; t += PUSHERS) {
			fill_grads(s, t, s->k);
			int r = aoq_push_grad(s->c, (uint32_t)t, 0, NULL);
			if (r < 0 && !atomic_load(&s->err)) {
				atomic_store(&s->err, r);
				fprintf(stderr, "session %d step %" PRIu64 " tensor %d: push: %s\n", s->id, s->k, t,
				        aoq_last_error());
			}
		}
		pthread_barrier_wait(&s->done);
	}
}

static void *session_main(void *arg)
{
	struct sess *s = arg;
	struct aoq_options o = AOQ_OPTIONS_INIT;
	char job[48];
	snprintf(job, sizeof(job), "stress-%d-%s-%d", s->id, s->threaded ? "mt" : "st", (int)getpid());
	o.socket = daemon_.socket;
	o.job = job;
	o.precision = AOQ_STATE_BF16_ALL;
	o.seed = 0x1234 + (uint64_t)s->id;
	o.window = s->window;
	CHECK_OK(aoq_connect(&s->c, &o));
	struct aoq_group g = { .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8,
	                       .weight_decay = 0.01 };
	CHECK_OK(aoq_add_group(s->c, &g));
	for (int t = 0; t < NT; t++) {
		s->param[t] = aoqt_xmalloc(s->numel[t] * 2);
		s->grad[t] = aoqt_xmalloc(s->numel[t] * 2);
		struct aoqt_rng rng = aoqt_rng_for(0x99, (uint64_t)s->id, (uint64_t)t);
		for (uint64_t i = 0; i < s->numel[t]; i++)
			aoqt_store(s->param[t], i, AOQ_BF16, aoqt_uniform(&rng));
		char name[16];
		snprintf(name, sizeof(name), "p%d", t);
		struct aoq_tensor td = { .size = sizeof(struct aoq_tensor), .name = name, .numel = s->numel[t], .param_dtype = AOQ_BF16,
		                         .grad_dtype = AOQ_BF16, .param = s->param[t], .grad = s->grad[t] };
		CHECK_OK(aoq_add_tensor(s->c, &td));
	}
	CHECK_OK(aoq_register(s->c));
	pthread_t th[PUSHERS];
	struct pusher ps[PUSHERS];
	if (s->threaded) {
		pthread_barrier_init(&s->go, NULL, PUSHERS + 1);
		pthread_barrier_init(&s->done, NULL, PUSHERS + 1);
		for (int i = 0; i < PUSHERS; i++) {
			ps[i] = (struct pusher){ s, i };
			CHECK(pthread_create(&th[i], NULL, pusher_main, &ps[i]) == 0, "pthread_create");
		}
	}
	for (uint64_t k = 1; k <= steps; k++) {
		if (s->threaded) {
			s->k = k;
			pthread_barrier_wait(&s->go);
			pthread_barrier_wait(&s->done);
			CHECK(atomic_load(&s->err) == 0, "session %d: a push failed", s->id);
		} else {
			for (int t = NT - 1; t >= 0; t--) {
				fill_grads(s, t, k);
				CHECK_OK(aoq_push_grad(s->c, (uint32_t)t, 0, NULL));
			}
		}
		CHECK_OK(aoq_step_end(s->c));
		struct aoq_step_result res = AOQ_STEP_RESULT_INIT;
		CHECK_OK(aoq_sync(s->c, &res));
		CHECK(res.step == k && res.tensors_updated == NT, "session %d: step %" PRIu64 " updated %" PRIu64
		      " tensors", s->id, res.step, res.tensors_updated);
	}
	if (s->threaded) {
		s->k = 0;
		pthread_barrier_wait(&s->go);
		for (int i = 0; i < PUSHERS; i++)
			pthread_join(th[i], NULL);
		pthread_barrier_destroy(&s->go);
		pthread_barrier_destroy(&s->done);
	}
	aoq_close(s->c);
	s->c = NULL;
	return NULL;
}

static void layout(struct sess *s, int id, bool threaded)
{
	memset(s, 0, sizeof(*s));
	s->id = id;
	s->threaded = threaded;
	s->window = id == 1 ? (uint64_t)8 * 65536 * 4 : 0;
	struct aoqt_rng rng = aoqt_rng_for(0x55, (uint64_t)id, 0);
	for (int t = 0; t < NT; t++)
		s->numel[t] = 1 + aoqt_next(&rng) % 40000;
	if (id == 2)
		s->numel[0] = AOQ_PUSH_CHUNK_ELEMS + 4099;
}

int main(int argc, char **argv)
{
	aoqt_init("push-stress");
	const char *exe = aoqt_aoqd_path(argc, argv);
	const char *e = getenv("AOQ_STRESS_STEPS");
	if (e && *e)
		steps = (unsigned)strtoul(e, NULL, 0);
	else if (getenv("AOQ_TEST_SLOW"))
		steps = 15;
	static const char *args[] = { "--threads", "2", NULL, NULL, NULL };
	bool spin = argc > 2 && strcmp(argv[2], "spin") == 0;
	char conf[] = "/tmp/aoq-push-stress-XXXXXX";
	if (spin) {
		steps = (steps + 1) / 2; /* the race is in every step: half as many (CI's time) */
		int fd = mkstemp(conf);
		CHECK(fd >= 0 && dprintf(fd, "loop_spin_us = 20\n") > 0, "config file");
		close(fd);
		args[1] = "1";
		args[2] = "--config";
		args[3] = conf;
	}
	CHECK_OK(aoqt_daemon_start(&daemon_, exe, args));

	static struct sess mt[SESSIONS], st[SESSIONS];
	pthread_t th[SESSIONS];
	double t0 = aoqt_now();
	for (int i = 0; i < SESSIONS; i++) {
		layout(&mt[i], i, true);
		CHECK(pthread_create(&th[i], NULL, session_main, &mt[i]) == 0, "pthread_create");
	}
	for (int i = 0; i < SESSIONS; i++)
		pthread_join(th[i], NULL);
	printf("%d bf16-all sessions x %d pushing threads x %u steps: %.1f s\n", SESSIONS, PUSHERS, steps,
	       aoqt_now() - t0);
	for (int i = 0; i < SESSIONS; i++) {
		layout(&st[i], i, false);
		session_main(&st[i]);
		for (int t = 0; t < NT; t++) {
			CHECK(memcmp(mt[i].param[t], st[i].param[t], mt[i].numel[t] * 2) == 0,
			      "session %d tensor %d: threaded pushes and a single thread differ", i, t);
			free(mt[i].param[t]);
			free(mt[i].grad[t]);
			free(st[i].param[t]);
			free(st[i].grad[t]);
		}
	}
	printf("threaded == single-threaded, bit for bit\n");
	char *log = aoqt_daemon_log(&daemon_);
	CHECK(log && !strstr(log, "corrupt"), "the daemon's log reports a corrupt ring");
	if (spin) {
		unlink(conf);
		/* one worker is pinned (and the loop spins) with 2 cores or more */
		cpu_set_t cs;
		CHECK(sched_getaffinity(0, sizeof(cs), &cs) == 0, "sched_getaffinity");
		Aoq__Envelope *env = NULL;
		CHECK_OK(aoqt_stats(daemon_.socket, &env));
		uint32_t us = env->stats->loop_spin_us;
		uint64_t takes = env->stats->loop_spin_takes, busy = env->stats->loop_spin_busy;
		aoq_envelope_free(env);
		CHECK(CPU_COUNT(&cs) < 2 || us == 20, "Stats loop_spin_us %u, configured 20 (one worker, pinned)", us);
		/* How often it spun depends on the pace: 18 pushing threads keep
		 * the one worker's queue long, and the loop does not spin over a
		 * backlog (integration-loop-spin checks that rule by itself). */
		printf("loop spin: %u us, %llu polls took records, %llu doorbells with tasks waiting\n", us,
		       (unsigned long long)takes, (unsigned long long)busy);
	}
	/* A sanitizer build of the daemon reports into its log. */
	CHECK(!strstr(log, "ThreadSanitizer") && !strstr(log, "AddressSanitizer") && !strstr(log, "runtime error"),
	      "the daemon's log has a sanitizer report");
	free(log);
	int rc = aoqt_daemon_stop(&daemon_, 30000, true);
	CHECK(rc == 0, "aoqd exit status %d", rc);
	printf("ok\n");
	return 0;
}
