/* SPDX-License-Identifier: MIT */
/*
 * A new session's state faulted in by aoqd's workers ahead of its use
 * (daemon/populate.h), seen from outside:
 * 1. bf16 master (the masters memfd) + q8 moments, tensors of 1, 4097 and
 *    8 Mi + 13 elements: once aoqd logs the state faulted in, its RSS has
 *    grown by the state's arrays, the moments too, which no load wrote;
 *    the masters read back are the parameters loaded beside the chunks,
 *    both aoqd's and libaoq's mappings of the arena ask for huge pages
 *    (MADV_HUGEPAGE, taken where shmem_enabled allows), and a step trains;
 * 2. fp32 master + q8 moments (private pages), the same;
 * 3. 4100 tensors, a registration built off the loop (register.c): its
 *    state is faulted in as well;
 * 4. sessions closed right after their registration, while their chunks
 *    run: aoqd goes on, a new session trains a step, nothing fails to
 *    fault in, and aoqd stops at once with status 0.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"

#define DONE "bytes of state faulted in"

static const struct aoq_group adamw = { .size = sizeof(struct aoq_group), .kind = AOQ_ADAMW, .lr = 1e-2,
                                        .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01 };

struct run {
	struct aoq_client *c;
	uint32_t n;
	uint64_t *numel;
	uint16_t **param, **grad; /* bf16 */
};

static int count(struct aoqt_daemon *d, const char *needle)
{
	char *log = aoqt_daemon_log(d);
	CHECK(log, "cannot read the daemon's log");
	int n = 0;
	for (const char *p = log; (p = strstr(p, needle)); p++)
		n++;
	free(log);
	return n;
}

/* Waits until the log holds `want` lines with needle (30 s at most). */
static void wait_count(struct aoqt_daemon *d, const char *needle, int want)
{
	for (int i = 0; i < 300 && count(d, needle) < want; i++)
		aoqt_wait_log_growth(d, aoqt_daemon_log_size(d), 100);
	CHECK(count(d, needle) >= want, "%d lines with '%s' in aoqd's log, expected %d", count(d, needle), needle, want);
}

static void open_run(struct run *r, struct aoqt_daemon *d, const char *job, enum aoq_precision prec, uint32_t n,
                     const uint64_t *numel)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = d->socket;
	o.job = job;
	o.device = "cpu";
	o.precision = prec;
	CHECK_OK(aoq_connect(&r->c, &o));
	CHECK_OK(aoq_add_group(r->c, &adamw));
	r->n = n;
	r->numel = aoqt_xmalloc(n * sizeof(uint64_t));
	r->param = aoqt_xmalloc(n * sizeof(uint16_t *));
	r->grad = aoqt_xmalloc(n * sizeof(uint16_t *));
	for (uint32_t t = 0; t < n; t++) {
		r->numel[t] = numel[t];
		r->param[t] = aoqt_xmalloc(numel[t] * 2);
		r->grad[t] = aoqt_xmalloc(numel[t] * 2);
		struct aoqt_rng g = aoqt_rng_for(7, t, 0);
		for (uint64_t i = 0; i < numel[t]; i++)
			aoqt_store(r->param[t], i, AOQ_BF16, aoqt_uniform(&g));
		char name[24];
		snprintf(name, sizeof(name), "w%u", t);
		struct aoq_tensor x = AOQ_TENSOR_INIT;
		x.name = name;
		x.numel = numel[t];
		x.param_dtype = AOQ_BF16;
		x.grad_dtype = AOQ_BF16;
		x.param = r->param[t];
		x.grad = r->grad[t];
		CHECK(aoq_add_tensor(r->c, &x) == (int)t, "tensor index");
	}
	CHECK_OK(aoq_register(r->c));
}

static void close_run(struct run *r)
{
	aoq_close(r->c);
	for (uint32_t t = 0; t < r->n; t++) {
		free(r->param[t]);
		free(r->grad[t]);
	}
	free(r->param);
	free(r->grad);
	free(r->numel);
}

/* The masters read back equal the parameters loaded; one step changes
 * the largest tensor. */
static void check_and_step(struct run *r, const char *what)
{
	uint32_t big = 0;
	for (uint32_t t = 0; t < r->n; t++) {
		if (r->numel[t] > r->numel[big])
			big = t;
		if (r->n > 8 && t % 97 != 0 && t != r->n - 1)
			continue; /* many tensors: a sample */
		uint16_t *m = aoqt_xmalloc(r->numel[t] * 2);
		CHECK_OK(aoq_read_state(r->c, t, AOQ_MASTER, AOQ_BF16, 0, r->numel[t], m));
		CHECK(memcmp(m, r->param[t], r->numel[t] * 2) == 0, "%s: tensor %u: the master read back is not the "
		      "parameter loaded", what, t);
		free(m);
	}
	uint16_t *before = aoqt_xmalloc(r->numel[big] * 2);
	memcpy(before, r->param[big], r->numel[big] * 2);
	for (uint32_t t = r->n; t-- > 0;) {
		struct aoqt_rng g = aoqt_rng_for(8, t, 1);
		for (uint64_t i = 0; i < r->numel[t]; i++)
			aoqt_store(r->grad[t], i, AOQ_BF16, aoqt_uniform(&g) * 0.1);
		CHECK_OK(aoq_push_grad(r->c, t, 0, NULL));
		CHECK_OK(aoq_grad_copied(r->c, t));
	}
	CHECK_OK(aoq_step_end(r->c));
	CHECK_OK(aoq_sync(r->c, NULL));
	size_t moved = 0;
	for (uint64_t i = 0; i < r->numel[big]; i++)
		moved += before[i] != r->param[big][i];
	CHECK(moved > r->numel[big] / 2, "%s: a step moved %zu of %llu parameters", what, moved,
	      (unsigned long long)r->numel[big]);
	free(before);
}

/* aoqd's resident bytes from its page tables (smaps_rollup), not VmRSS:
 * kernels before 6.2 keep each thread's count of recent faults apart and
 * fold it in only every 64 faults, so a worker that faulted in a few huge
 * pages and went to sleep is missing from VmRSS (CI saw 34 of 50 MB). */
static uint64_t rss_exact(pid_t pid)
{
	char p[64], line[256];
	snprintf(p, sizeof(p), "/proc/%d/smaps_rollup", (int)pid);
	FILE *f = fopen(p, "re");
	uint64_t kb = 0;
	if (!f)
		return aoqt_rss_bytes(pid);
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "Rss: %" SCNu64, &kb) == 1)
			break;
	fclose(f);
	return kb ? kb * 1024 : aoqt_rss_bytes(pid); /* no Rss line read (CI saw one): VmRSS */
}

/* aoqd's RSS once it has stopped falling for half a second (5 s at most):
 * a session closed just before frees its state after aoq_close returns,
 * later on a loaded machine, and would hide what the next one faults in. */
static uint64_t settled_rss(pid_t pid)
{
	uint64_t low = rss_exact(pid);
	for (int i = 0, still = 0; i < 100 && still < 10; i++) {
		usleep(50 * 1000);
		uint64_t r = rss_exact(pid);
		if (!r)
			continue; /* a failed read is not a fall */
		if (!low)
			low = r;
		still = r < low ? 0 : still + 1;
		low = r < low ? r : low;
	}
	return low;
}

/* The mappings of memfd `name` (aoq-arena, aoq-masters) in pid's smaps
 * (0: ours): how many, and how many ask for huge pages (VmFlags "hg",
 * MADV_HUGEPAGE), which both aoqd and libaoq do, so that
 * shmem_enabled=advise gives the arena and the masters huge pages. */
static void memfd_hints(pid_t pid, const char *name, int *maps, int *hinted)
{
	char tag[64];
	snprintf(tag, sizeof(tag), "memfd:%s", name);
	char p[64], line[512];
	if (pid)
		snprintf(p, sizeof(p), "/proc/%d/smaps", (int)pid);
	else
		snprintf(p, sizeof(p), "/proc/self/smaps");
	FILE *f = fopen(p, "re");
	CHECK(f, "%s: cannot open", p);
	*maps = *hinted = 0;
	bool arena = false;
	while (fgets(line, sizeof(line), f)) {
		if (strncmp(line, "VmFlags:", 8) == 0) {
			if (arena && strstr(line, " hg"))
				(*hinted)++;
			arena = false;
		} else if (strchr(line, '-') && strstr(line, tag)) {
			arena = true;
			(*maps)++;
		}
	}
	fclose(f);
}

/* Registers, waits for the state faulted in, checks aoqd's RSS grew by
 * `bytes_per_elem` per element, checks and trains. */
static void populated(struct aoqt_daemon *d, const char *what, enum aoq_precision prec, double bytes_per_elem)
{
	static const uint64_t numel[3] = { 1, 4097, (8u << 20) + 13 };
	int done = count(d, DONE);
	wait_count(d, " closed (job", count(d, ": hello from")); /* every earlier session ended */
	uint64_t rss0 = settled_rss(d->pid);
	struct run r;
	open_run(&r, d, what, prec, 3, numel);
	wait_count(d, DONE, done + 1);
	uint64_t rss1 = rss_exact(d->pid), want = (uint64_t)(numel[2] * bytes_per_elem);
	CHECK(rss0 && rss1 >= rss0 + want, "%s: aoqd's RSS grew by %lld bytes with the state faulted in, expected at "
	      "least %llu", what, (long long)(rss1 - rss0), (unsigned long long)want);
	int maps, hinted;
	memfd_hints(0, "aoq-arena", &maps, &hinted);
	CHECK(maps == 1 && hinted == 1, "%s: libaoq maps the arena %d time(s), %d with MADV_HUGEPAGE; 1 and 1 expected",
	      what, maps, hinted);
	memfd_hints(d->pid, "aoq-arena", &maps, &hinted);
	CHECK(maps >= 1 && hinted == maps, "%s: aoqd maps arenas %d time(s), %d with MADV_HUGEPAGE", what, maps, hinted);
	/* the masters (the bf16 parameters are the masters' high halves in
	 * both precisions): libaoq maps them whole, aoqd tensor by tensor,
	 * and asks for huge pages where a tensor's masters reach 2 MiB */
	memfd_hints(0, "aoq-masters", &maps, &hinted);
	CHECK(maps >= 1 && hinted == maps, "%s: libaoq maps the masters %d time(s), %d with MADV_HUGEPAGE", what, maps,
	      hinted);
	memfd_hints(d->pid, "aoq-masters", &maps, &hinted);
	CHECK(maps >= 3 && hinted >= 1, "%s: aoqd maps masters %d time(s), %d with MADV_HUGEPAGE (the 8 Mi tensor's)",
	      what, maps, hinted);
	check_and_step(&r, what);
	close_run(&r);
	printf("%s: ok (RSS +%.1f MiB)\n", what, (double)(rss1 - rss0) / (1 << 20));
}

int main(int argc, char **argv)
{
	aoqt_init("populate");
	const char *exe = aoqt_aoqd_path(argc, argv);
	struct aoqt_daemon d;
	const char *args[] = { "--threads", "2", "--log-level", "debug", NULL };
	CHECK_OK(aoqt_daemon_start(&d, exe, args));

	/* run by hand (no fd store) aoqd says nothing of shmem's huge pages,
	 * whatever the host's setting (test-fdstore checks it under the store) */
	wait_count(&d, "listening on", 1);
	CHECK(count(&d, "run on 4 KiB pages") == 0, "aoqd without the fd store spoke of shmem's huge pages");

	/* bf16 master 2 bytes, q8 moments 1 + 1 */
	populated(&d, "bf16-q8", AOQ_STATE_BF16_Q8, 4.0);
	/* fp32 master 4 bytes, q8 moments 1 + 1 */
	populated(&d, "q8", AOQ_STATE_Q8, 6.0);

	/* off the loop (more tensors than one Register frame holds) */
	uint32_t many = 4100;
	uint64_t *numel = aoqt_xmalloc(many * sizeof(uint64_t));
	for (uint32_t t = 0; t < many; t++)
		numel[t] = 64 + t % 512;
	int done = count(&d, DONE);
	struct run r;
	open_run(&r, &d, "many", AOQ_STATE_BF16_Q8, many, numel);
	wait_count(&d, DONE, done + 1);
	check_and_step(&r, "many");
	close_run(&r);
	free(numel);
	printf("many: ok (%u tensors)\n", many);

	/* closed while their chunks run */
	static const uint64_t big[1] = { 32u << 20 };
	for (int k = 0; k < 4; k++) {
		char job[16];
		snprintf(job, sizeof(job), "gone%d", k);
		open_run(&r, &d, job, k % 2 ? AOQ_STATE_Q8 : AOQ_STATE_BF16_Q8, 1, big);
		close_run(&r);
	}
	CHECK(aoqt_daemon_alive(&d), "aoqd died after sessions closed while their state was faulted in");
	static const uint64_t small[2] = { 3, 70000 };
	open_run(&r, &d, "after", AOQ_STATE_BF16_Q8, 2, small);
	check_and_step(&r, "after");
	close_run(&r);
	CHECK(count(&d, "cannot fault in") == 0, "aoqd could not fault a state in");
	printf("closed while faulting in: ok (%d states faulted in whole of %d)\n", count(&d, DONE), 8);
	int st = aoqt_daemon_stop(&d, 10000, true);
	CHECK(st == 0, "aoqd exited with %d", st);
	printf("ok\n");
	return 0;
}
