/* SPDX-License-Identifier: MIT */
/*
 * What aoqd reads from the file system is hostile too: the state directory
 * and the config file (docs/snapshots.md; aoqd.conf(5)).  Each case starts
 * its own daemon (--case NAME; run one by hand with
 *   build/tests/hostile/test-state-dir build/daemon/aoqd --case NAME):
 *
 *   temp     a full-size ".snapshot-XXXXXX" temp file, left by a write a
 *            crash cut short, is removed at start;
 *   files    a FIFO and a symbolic link (to a file of secrets) named like
 *            snapshots: aoqd starts at once, refuses both by name, never
 *            logs the link's bytes, and answers Stats;
 *   config   a FIFO, /dev/zero and a symbolic link as the config file: aoqd
 *            exits with a clear error within 5 s (it used to hang), and a
 *            SIGHUP after the file became a FIFO keeps the settings and the
 *            loop running;
 *   header   a snapshot whose 3 MiB header is all "{}," (json-c's objects
 *            would cost some 800 MiB): refused before it is parsed, aoqd's
 *            peak RSS stays under 64 MiB;
 *   jobname  a session whose job name is 128 bytes of UTF-8 (the escaped
 *            file name would pass NAME_MAX) is snapshotted.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "aoq/aoq.h"
#include "harness.h"
#include "snapshot.h"
#include "wire.h"

static const char *aoqd;
static struct aoqt_daemon daemon_;
static char sd[200]; /* the state directory */

static void start(const char *const *extra)
{
	const char *args[16] = { "--threads", "1", "--state-dir", sd };
	int n = 4;
	for (int i = 0; extra && extra[i] && n < 15; i++)
		args[n++] = extra[i];
	args[n] = NULL;
	CHECK_OK(aoqt_daemon_start(&daemon_, aoqd, args));
}

static void stop(void)
{
	CHECK(aoqt_daemon_stop(&daemon_, 10000, true) == 0, "aoqd did not stop cleanly");
}

static bool log_has(const char *what)
{
	char *log = aoqt_daemon_log(&daemon_);
	bool r = strstr(log, what) != NULL;
	free(log);
	return r;
}

/* Stats answers (the daemon is up and its loop runs). */
static void stats_ok(const char *what)
{
	Aoq__Envelope *e = NULL;
	double t0 = aoqt_now();
	CHECK_OK(aoqt_stats(daemon_.socket, &e));
	aoq_envelope_free(e);
	CHECK(aoqt_now() - t0 < 5, "%s: Stats took %.1f s", what, aoqt_now() - t0);
}

static void write_file(const char *path, const void *p, size_t n)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	CHECK(fd >= 0, "%s: %s", path, strerror(errno));
	CHECK(write(fd, p, n) == (ssize_t)n, "write %s", path);
	close(fd);
}

static bool exists(const char *path)
{
	struct stat sb;
	return lstat(path, &sb) == 0;
}

/* ---- temp ---- */

static void case_temp(void)
{
	char tmp[300];
	snprintf(tmp, sizeof(tmp), "%s/" AOQD_SNAPSHOT_TEMP "a1B2c3", sd);
	size_t n = 4u << 20;
	char *buf = aoqt_xcalloc(1, n);
	write_file(tmp, buf, n);
	free(buf);
	start(NULL);
	stats_ok("temp");
	CHECK(!exists(tmp), "temp: %s survived the start", tmp);
	CHECK(log_has("left by a write that did not finish"), "temp: the removal is not logged");
	stop();
	printf("temp: a cut write's temp file is removed at start\n");
}

/* ---- files ---- */

static void case_files(void)
{
	char fifo[300], link[300], secret[300];
	snprintf(fifo, sizeof(fifo), "%s/0-fifo-0" AOQD_SNAPSHOT_SUFFIX, sd);
	snprintf(link, sizeof(link), "%s/0-link-0" AOQD_SNAPSHOT_SUFFIX, sd);
	snprintf(secret, sizeof(secret), "%s.secret", sd);
	write_file(secret, "SECRET-BYTES-0123456789", 23);
	CHECK(mkfifo(fifo, 0600) == 0, "mkfifo: %s", strerror(errno));
	CHECK(symlink(secret, link) == 0, "symlink: %s", strerror(errno));
	double t0 = aoqt_now();
	start(NULL);
	stats_ok("files");
	CHECK(aoqt_now() - t0 < 10, "files: the start took %.1f s", aoqt_now() - t0);
	CHECK(log_has("0-fifo-0" AOQD_SNAPSHOT_SUFFIX ": not a regular file"), "files: the FIFO is not refused by name");
	CHECK(log_has("0-link-0" AOQD_SNAPSHOT_SUFFIX ": a symbolic link (not followed)"),
	      "files: the link is not refused by name");
	CHECK(!log_has("SECRET"), "files: the log shows the link's target's bytes");
	stop();
	unlink(secret);
	printf("files: a FIFO and a symbolic link in state_dir are refused by name, at once\n");
}

/* ---- config ---- */

/* aoqd with --config path: it must exit non-zero within 5 s, saying why. */
static void bad_config(const char *path, const char *why)
{
	const char *extra[] = { "--config", path, NULL };
	start(extra);
	double t0 = aoqt_now();
	bool exited = false;
	while (!exited && aoqt_now() - t0 < 5) {
		siginfo_t si = { 0 };
		exited = waitid(P_PID, (id_t)daemon_.pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == daemon_.pid;
		if (!exited)
			usleep(10000);
	}
	char *log = aoqt_daemon_log(&daemon_);
	printf("config %s: %s", path, log);
	CHECK(exited, "config %s: aoqd still runs after 5 s", path);
	CHECK(strstr(log, why), "config %s: the log does not say '%s'", path, why);
	free(log);
	int st = aoqt_daemon_stop(&daemon_, 1000, false);
	CHECK(st > 0, "config %s: exit status %d", path, st);
	char cmd[200];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", daemon_.dir);
	CHECK(system(cmd) == 0, "rm");
}

static void case_config(void)
{
	char fifo[300], link[300], good[300];
	snprintf(fifo, sizeof(fifo), "%s/conf.fifo", sd);
	snprintf(link, sizeof(link), "%s/conf.link", sd);
	snprintf(good, sizeof(good), "%s/aoqd.conf", sd);
	CHECK(mkfifo(fifo, 0600) == 0, "mkfifo: %s", strerror(errno));
	write_file(good, "lease_seconds = 30\n", 19);
	CHECK(symlink(good, link) == 0, "symlink: %s", strerror(errno));
	bad_config(fifo, "not a regular file");
	bad_config("/dev/zero", "not a regular file");
	bad_config(link, "a symbolic link");
	/* A reload that finds a FIFO keeps the settings and the loop. */
	const char *extra[] = { "--config", good, NULL };
	start(extra);
	stats_ok("config");
	CHECK(unlink(good) == 0 && mkfifo(good, 0600) == 0, "mkfifo: %s", strerror(errno));
	size_t sz = aoqt_daemon_log_size(&daemon_);
	CHECK(kill(daemon_.pid, SIGHUP) == 0, "kill");
	for (int i = 0; i < 50 && !log_has("keeping the settings in use"); i++)
		aoqt_wait_log_growth(&daemon_, sz, 100);
	CHECK(log_has("keeping the settings in use"), "config: the reload from a FIFO is not refused");
	stats_ok("config after SIGHUP");
	stop();
	printf("config: a FIFO, /dev/zero and a symbolic link are refused at once\n");
}

/* ---- header ---- */

static uint64_t peak_rss(pid_t pid)
{
	char path[64], line[256];
	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	FILE *f = fopen(path, "r");
	uint64_t kb = 0;
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "VmHWM: %" SCNu64, &kb) == 1)
			break;
	if (f)
		fclose(f);
	return kb << 10;
}

static void case_header(void)
{
	const char *head = "{\"__metadata__\":{\"format\":\"aoq-optimizer-state\"},\"x\":[";
	size_t n = 3u << 20, hl = strlen(head);
	char *h = aoqt_xmalloc(n + 8 + 16);
	memcpy(h + 8, head, hl);
	size_t k = 8 + hl;
	while (k + 6 < n + 8) {
		memcpy(h + k, "{},", 3);
		k += 3;
	}
	memcpy(h + k, "{}]}", 4);
	k += 4;
	uint64_t len = k - 8;
	for (int i = 0; i < 8; i++)
		h[i] = (char)(len >> (8 * i));
	memset(h + k, 0, 16);
	char path[300], rejected[320];
	snprintf(path, sizeof(path), "%s/0-dense-0" AOQD_SNAPSHOT_SUFFIX, sd);
	snprintf(rejected, sizeof(rejected), "%s.rejected", path);
	write_file(path, h, k + 16);
	free(h);
	start(NULL);
	stats_ok("header");
	uint64_t peak = peak_rss(daemon_.pid);
	printf("header: aoqd's peak RSS %.1f MiB\n", (double)peak / (1 << 20));
	CHECK(log_has("denser than any aoqd writes"), "header: not refused before parsing");
	CHECK(exists(rejected), "header: the file was not renamed aside");
	CHECK(peak < (64u << 20), "header: aoqd's peak RSS %.1f MiB", (double)peak / (1 << 20));
	stop();
}

/* ---- jobname ---- */

static void case_jobname(void)
{
	char job[129];
	for (int i = 0; i < 128; i += 2) {
		job[i] = (char)0xc3; /* 64 times U+00E9 */
		job[i + 1] = (char)0xa9;
	}
	job[128] = 0;
	start(NULL);
	struct aoq_client *c;
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = daemon_.socket;
	o.device = "cpu";
	o.job = job;
	CHECK_OK(aoq_connect(&c, &o));
	struct aoq_group g = AOQ_GROUP_INIT;
	g.kind = AOQ_ADAMW;
	g.lr = 1e-3;
	g.beta1 = 0.9;
	g.beta2 = 0.999;
	g.eps = 1e-8;
	CHECK_OK(aoq_add_group(c, &g));
	float param[64] = { 0 }, grad[64] = { 0 };
	struct aoq_tensor d = AOQ_TENSOR_INIT;
	d.name = "w";
	d.numel = 64;
	d.param_dtype = AOQ_FP32;
	d.grad_dtype = AOQ_FP32;
	d.param = param;
	d.grad = grad;
	CHECK_OK(aoq_add_tensor(c, &d));
	CHECK_OK(aoq_register(c));
	CHECK_OK(aoq_push_grad(c, 0, 0, NULL));
	CHECK_OK(aoq_step_end(c));
	CHECK_OK(aoq_sync(c, NULL));
	Aoq__Envelope *e = NULL;
	CHECK_OK(aoqt_stats(daemon_.socket, &e));
	uint64_t id = 0;
	for (size_t i = 0; i < e->stats->n_sessions; i++)
		if (strcmp(e->stats->sessions[i]->job, job) == 0)
			id = e->stats->sessions[i]->id;
	aoq_envelope_free(e);
	CHECK(id, "jobname: no session");
	char path[512];
	uint64_t step = 0;
	int r = aoqt_snapshot(daemon_.socket, id, path, sizeof(path), &step);
	printf("jobname: %d %s (step %" PRIu64 ")\n", r, path, step);
	CHECK(r == 0 && step == 1, "jobname: the snapshot failed: %d %s", r, path);
	const char *base = strrchr(path, '/');
	CHECK(base && strlen(base + 1) <= 255 && exists(path), "jobname: file %s", path);
	aoq_close(c);
	stop();
}

int main(int argc, char **argv)
{
	aoqt_init("state-dir");
	aoqd = aoqt_aoqd_path(argc, argv);
	const char *c = "all";
	for (int i = 2; i + 1 < argc; i++)
		if (strcmp(argv[i], "--case") == 0)
			c = argv[i + 1];
	snprintf(sd, sizeof(sd), "/tmp/aoqt-sd-%d", (int)getpid());
	CHECK(mkdir(sd, 0700) == 0, "mkdir %s: %s", sd, strerror(errno));
	bool all = strcmp(c, "all") == 0;
	if (all || strcmp(c, "temp") == 0)
		case_temp();
	if (all || strcmp(c, "files") == 0)
		case_files();
	if (all || strcmp(c, "config") == 0)
		case_config();
	if (all || strcmp(c, "header") == 0)
		case_header();
	if (all || strcmp(c, "jobname") == 0)
		case_jobname();
	char cmd[256];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", sd);
	CHECK(system(cmd) == 0, "rm");
	printf("ok\n");
	return 0;
}
