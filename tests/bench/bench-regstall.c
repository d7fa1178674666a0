/* SPDX-License-Identifier: MIT */
/*
 * bench-regstall: how long one large registration holds another trainer.
 * A victim job (1 tensor of 4,096 elements) steps as fast as it can while
 * another connection registers --tensors one-element tensors (libaoq, 256
 * a Register frame).  Printed: the victim's step latency alone (median,
 * max) and while the registration runs (max: the stall), and how long the
 * registration took.  A benchmark, not a test.
 *
 *   build/tests/bench/bench-regstall [--aoqd PATH] [--tensors 100000] [--threads N]
 */
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#ifndef AOQD_PATH
#define AOQD_PATH "aoqd"
#endif

static struct aoqt_daemon daemon_;
static _Atomic int phase; /* 0 alone, 1 registering, 2 stop */
static double worst[2], sum[2];
static int count[2];

static void *victim(void *arg)
{
	struct aoqt_job *j = arg;
	while (atomic_load(&phase) < 2) {
		int p = atomic_load(&phase);
		double t = aoqt_job_step(j);
		if (atomic_load(&phase) != p)
			continue; /* a step across the change counts for neither */
		if (t > worst[p])
			worst[p] = t;
		sum[p] += t;
		count[p]++;
	}
	return NULL;
}

int main(int argc, char **argv)
{
	const char *aoqd = AOQD_PATH, *threads = "2";
	uint32_t n = 100000;
	static const struct option lo[] = { { "aoqd", 1, NULL, 'a' }, { "tensors", 1, NULL, 't' },
		                            { "threads", 1, NULL, 'j' }, { 0 } };
	int c;
	while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		if (c == 'a')
			aoqd = optarg;
		else if (c == 't')
			n = (uint32_t)strtoul(optarg, NULL, 10);
		else if (c == 'j')
			threads = optarg;
		else
			return 2;
	}
	aoqt_init("bench-regstall");
	const char *args[] = { "--threads", threads, "--lock-memory", "no", NULL };
	CHECK_OK(aoqt_daemon_start(&daemon_, aoqd, args));
	struct aoqt_job v;
	aoqt_job_open(&v, daemon_.socket, "victim", 1, 4096);
	pthread_t t;
	pthread_create(&t, NULL, victim, &v);
	double t0 = aoqt_now();
	while (aoqt_now() - t0 < 1.0)
		;
	struct aoq_client *big;
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = daemon_.socket;
	o.job = "big";
	o.device = "cpu";
	o.lease_seconds = AOQ_LEASE_NONE;
	CHECK_OK(aoq_connect(&big, &o));
	struct aoq_group g = AOQ_GROUP_INIT;
	g.kind = AOQ_ADAMW;
	g.lr = 1e-3;
	g.beta1 = 0.9;
	g.beta2 = 0.999;
	g.eps = 1e-8;
	CHECK_OK(aoq_add_group(big, &g));
	float *p = aoqt_xcalloc(n, sizeof(float)), *gr = aoqt_xcalloc(n, sizeof(float));
	for (uint32_t i = 0; i < n; i++) {
		char name[24];
		snprintf(name, sizeof(name), "t%u", i);
		struct aoq_tensor d = AOQ_TENSOR_INIT;
		d.name = name;
		d.numel = 1;
		d.param_dtype = AOQ_FP32;
		d.grad_dtype = AOQ_FP32;
		d.param = p + i;
		d.grad = gr + i;
		CHECK_OK(aoq_add_tensor(big, &d));
	}
	atomic_store(&phase, 1);
	double r0 = aoqt_now();
	CHECK_OK(aoq_register(big));
	double reg = aoqt_now() - r0;
	atomic_store(&phase, 2);
	pthread_join(t, NULL);
	printf("bench-regstall: %u tensors registered in %.3f s; the victim's step alone: mean %.3f ms, max %.3f ms "
	       "(%d steps); during the registration: mean %.3f ms, max %.3f ms (%d steps)\n", n, reg,
	       count[0] ? 1e3 * sum[0] / count[0] : 0, 1e3 * worst[0], count[0],
	       count[1] ? 1e3 * sum[1] / count[1] : 0, 1e3 * worst[1], count[1]);
	aoq_close(big);
	aoqt_job_close(&v);
	free(p);
	free(gr);
	aoqt_daemon_stop(&daemon_, 10000, true);
	return 0;
}
