/* SPDX-License-Identifier: MIT */
/*
 * The loop's spin (loop_spin_us; daemon/events.c, spin_start) and its
 * Stats figures, on aoqd with one pinned worker and a 10 ms spin:
 *
 *  1. A small job steps one tensor at a time, each step answered before
 *     the next push: nothing waits for the worker, so after a doorbell the
 *     loop polls the ring, and the next step's push, within the 10 ms, goes
 *     in without one (Stats loop_spin_takes > 0, loop_spin_seconds > 0).
 *  2. A large job's push (4 Mi elements: records of 1 Mi, each several
 *     chunk tasks) leaves tasks waiting for the one worker, so the doorbell
 *     that brought it must not start a spin (loop_spin_busy grows).  This
 *     is the rule that keeps a polling loop off the trainer's core while
 *     the update is the step's limit.  The small job then steps again and
 *     spins as before once the queue has drained.
 *
 *  3. Four sessions step one small tensor each from their own threads at
 *     once, so the spin starts and stops while pushes race it (how often
 *     depends on the pace, and is printed); every session must end equal,
 *     bit for bit, to one that stepped alone (same gradients, same start).
 *
 * The checks count events, not times, so a loaded machine does not make
 * them flaky: where an event depends on the pace (a poll taking a push
 * within the spin), the job steps on until it happens, up to a bound.
 * On one core aoqd does not pin and never spins: skipped.
 */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "harness.h"

static struct aoqt_daemon d;

#define CONC 4
#define CONC_STEPS 40

static void *conc_main(void *arg)
{
	struct aoqt_job *j = arg;
	for (int k = 0; k < CONC_STEPS; k++)
		aoqt_job_step(j);
	return NULL;
}

static Aoq__Stats *stats(Aoq__Envelope **env)
{
	CHECK_OK(aoqt_stats(d.socket, env));
	return (*env)->stats;
}

/* Steps j, `batch` steps at a time, until a poll of the spinning loop has
 * taken a push (Stats loop_spin_takes above `since`), at most `most`
 * steps: an event that a step's pace can postpone (a trainer slower than
 * the 10 ms spin on a loaded machine, under tsan) but, with the spin
 * working, not prevent.  Returns the Stats of the last call (*env holds
 * it). */
static Aoq__Stats *step_until_take(struct aoqt_job *j, uint64_t since, int batch, int most, Aoq__Envelope **env)
{
	Aoq__Stats *s = NULL;
	*env = NULL;
	for (int k = 0; k < most; k += batch) {
		for (int i = 0; i < batch; i++)
			aoqt_job_step(j);
		if (*env)
			aoq_envelope_free(*env);
		s = stats(env);
		if (s->loop_spin_takes > since)
			break;
	}
	return s;
}

int main(int argc, char **argv)
{
	aoqt_init("loop-spin");
	const char *exe = aoqt_aoqd_path(argc, argv);
	char conf[] = "/tmp/aoq-loop-spin-XXXXXX";
	int fd = mkstemp(conf);
	CHECK(fd >= 0 && dprintf(fd, "loop_spin_us = 10000\n") > 0, "config file");
	close(fd);
	const char *args[] = { "--threads", "1", "--config", conf, NULL };
	CHECK_OK(aoqt_daemon_start(&d, exe, args));
	cpu_set_t cs;
	CHECK(sched_getaffinity(0, sizeof(cs), &cs) == 0, "sched_getaffinity");
	Aoq__Envelope *e0 = NULL;
	Aoq__Stats *s0 = stats(&e0);
	if (CPU_COUNT(&cs) < 2) {
		CHECK(s0->loop_spin_us == 0, "one core: Stats loop_spin_us %u, expected 0 (no pinning)", s0->loop_spin_us);
		printf("one core: aoqd does not pin, and its loop never spins\n");
		aoq_envelope_free(e0);
		aoqt_daemon_stop(&d, 30000, true);
		unlink(conf);
		return AOQT_SKIP;
	}
	CHECK(s0->loop_spin_us == 10000, "Stats loop_spin_us %u, configured 10000 (one worker, pinned)",
	      s0->loop_spin_us);
	CHECK(s0->loop_spin_takes == 0 && s0->loop_spin_busy == 0, "spin counters start at 0");
	aoq_envelope_free(e0);

	/* 1. one small tensor at a time */
	static struct aoqt_job small, big;
	aoqt_job_open(&small, d.socket, "small", 1, 4096);
	Aoq__Envelope *e1 = NULL;
	Aoq__Stats *s1 = step_until_take(&small, 0, 50, 250, &e1);
	printf("small steps: spun %.3f s, %llu polls took records, %llu doorbells with tasks waiting\n",
	       s1->loop_spin_seconds, (unsigned long long)s1->loop_spin_takes, (unsigned long long)s1->loop_spin_busy);
	CHECK(s1->loop_spin_takes > 0, "the spinning loop took no push without a doorbell");
	CHECK(s1->loop_spin_seconds > 0, "the loop never spun");
	uint64_t busy1 = s1->loop_spin_busy, takes1 = s1->loop_spin_takes;
	aoq_envelope_free(e1);

	/* 2. a large push keeps the worker busy with tasks waiting */
	aoqt_job_open(&big, d.socket, "big", 1, 4u << 20);
	aoqt_job_step(&big);
	Aoq__Envelope *e2 = NULL;
	Aoq__Stats *s2 = stats(&e2);
	printf("large step: %llu doorbells with tasks waiting\n", (unsigned long long)s2->loop_spin_busy);
	CHECK(s2->loop_spin_busy > busy1, "a doorbell with tasks waiting started a spin");
	aoq_envelope_free(e2);
	Aoq__Envelope *e3 = NULL;
	Aoq__Stats *s3 = step_until_take(&small, takes1, 20, 200, &e3);
	printf("small steps after it: %llu more polls took records\n",
	       (unsigned long long)(s3->loop_spin_takes - takes1));
	CHECK(s3->loop_spin_takes > takes1, "the loop did not spin again once the queue drained (200 small steps)");

	aoqt_job_close(&big);
	aoqt_job_close(&small);

	/* 3. concurrent small sessions race the spin */
	static struct aoqt_job conc[CONC], alone;
	pthread_t th[CONC];
	for (int i = 0; i < CONC; i++) {
		char job[16];
		snprintf(job, sizeof(job), "conc%d", i);
		aoqt_job_open(&conc[i], d.socket, job, 1, 4096);
	}
	for (int i = 0; i < CONC; i++)
		CHECK(pthread_create(&th[i], NULL, conc_main, &conc[i]) == 0, "pthread_create");
	for (int i = 0; i < CONC; i++)
		pthread_join(th[i], NULL);
	aoqt_job_open(&alone, d.socket, "alone", 1, 4096);
	conc_main(&alone);
	for (int i = 0; i < CONC; i++)
		CHECK(memcmp(conc[i].p[0], alone.p[0], 4096 * sizeof(float)) == 0,
		      "session conc%d differs from one that stepped alone", i);
	Aoq__Envelope *e4 = NULL;
	Aoq__Stats *s4 = stats(&e4);
	printf("%d concurrent sessions x %d steps: %llu more polls took records, %llu more doorbells with tasks "
	       "waiting; each equals one stepped alone\n",
	       CONC, CONC_STEPS, (unsigned long long)(s4->loop_spin_takes - s3->loop_spin_takes),
	       (unsigned long long)(s4->loop_spin_busy - s3->loop_spin_busy));
	aoq_envelope_free(e4);
	aoq_envelope_free(e3);
	for (int i = 0; i < CONC; i++)
		aoqt_job_close(&conc[i]);
	aoqt_job_close(&alone);
	char *log = aoqt_daemon_log(&d);
	CHECK(log && !strstr(log, "ThreadSanitizer") && !strstr(log, "AddressSanitizer") && !strstr(log, "runtime error"),
	      "the daemon's log has a sanitizer report");
	free(log);
	int rc = aoqt_daemon_stop(&d, 30000, true);
	CHECK(rc == 0, "aoqd exit status %d", rc);
	unlink(conf);
	printf("ok\n");
	return 0;
}
