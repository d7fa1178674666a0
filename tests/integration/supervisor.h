/* SPDX-License-Identifier: MIT */
/*
 * A small supervisor that does for aoqd what systemd does for
 * aoqd.service (tests/integration/test-fdstore.c, tests/bench/bench-restart.c):
 * the listening socket, the notify datagram socket (NOTIFY_SOCKET), READY=1
 * and the file-descriptor store (FDSTORE=1 / FDSTOREREMOVE=1 with FDNAME=,
 * the fds by SCM_RIGHTS), and a start with LISTEN_FDS, LISTEN_PID and
 * LISTEN_FDNAMES: the socket at fd 3, then the stored fds.  Fails the test
 * on any error.
 */
#ifndef AOQ_TEST_SUPERVISOR_H
#define AOQ_TEST_SUPERVISOR_H

#include <pthread.h>
#include <stdbool.h>
#include <sys/types.h>

#define MAX_STORED 64 /* aoqd.service: FileDescriptorStoreMax=4096 */
#define SUP_RING 64    /* datagrams received, not yet read */
struct sup {
	char dir[64], sock[108], notify[108], log[128], state[128], conf[128];
	int lfd, nfd;
	pid_t pid;
	int nstored;
	int stored_fd[MAX_STORED];
	char stored_name[MAX_STORED][256];
	int removes; /* FDSTOREREMOVE=1 seen */
	bool ready;
	bool nostore; /* keeps no fd (a unit without FileDescriptorStoreMax=) */
	const char *kernel; /* aoqd's AOQ_KERNEL: "scalar" (sup_init) for the tests */
	/* datagrams taken off the socket by sup_init's receiver thread, not
	 * yet read by sup_recv (the only user of the fields above) */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	unsigned head, count;
	struct sup_note {
		ssize_t n;
		int flags, nf;
		int fds[32];
		char data[4096];
	} ring[SUP_RING];
};

/* A temp dir with the sockets and aoqd.conf (threads, lease_seconds,
 * state_dir; snapshot_every_steps = 1 with snapshots; `extra` appended
 * when not NULL). */
void sup_init(struct sup *s, bool snapshots, const char *extra);
/* The next notify datagram (waits up to timeout_ms): false when none came.
 * A thread sup_init starts takes each off the socket as it comes. */
bool sup_recv(struct sup *s, int timeout_ms);
/* Starts aoqd --config: the socket at fd 3, then the stored fds and
 * `extra` with their names; waits for READY=1. */
void sup_start(struct sup *s, const char *exe, const int *extra, const char *const *extra_names, int nextra);
/* Kills aoqd with sig and waits for it, taking what it stored. */
void sup_kill(struct sup *s, int sig);
/* The log so far (a static buffer). */
char *sup_log(struct sup *s);

#endif
