/* SPDX-License-Identifier: MIT */
/*
 * aoqctl's connection to aoqd: it speaks the control protocol directly
 * (proto/wire.h) as an observer: Hello{observer} -> Welcome, then one request
 * and its reply per call, Bye at the end.  A failure is said on stderr here.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aoq-version.h"
#include "aoqctl.h"

int ctl_fail_unreachable(const char *path, int err, const char *what, const char *msg)
{
	fprintf(stderr, "aoqctl: %s aoqd at %s: %s%s%s\n", what, path, strerror(-err),
	        msg ? ": " : "", msg ? msg : "");
	/* the hint only when the socket did not answer: an Error from a daemon
	 * (msg set) means it runs */
	if (!msg && (err == -ENOENT || err == -ECONNREFUSED))
		fprintf(stderr, "aoqctl: is aoqd running? (choose its socket with --socket or AOQ_SOCKET)\n");
	return EXIT_UNREACHABLE;
}

/* Connects and says Hello as an observer; *sock on success. */
int ctl_observer_connect(const char *path, int *sock_out)
{
	int sock = aoq_socket_connect(path);
	if (sock < 0)
		return ctl_fail_unreachable(path, sock, "cannot connect to", NULL);
	char *msg = NULL;
	Aoq__Envelope *rep = NULL;
	Aoq__Hello hello = AOQ__HELLO__INIT;
	hello.protocol_version = AOQ_PROTOCOL_VERSION;
	hello.version = (char *)aoq_full_version(); /* an observer maps no arena: arena_version 0 */
	hello.job = (char *)"aoqctl";
	hello.device = (char *)"";
	hello.observer = true;
	hello.pid = (uint32_t)getpid();
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_HELLO;
	env.hello = &hello;
	int ret = EXIT_UNREACHABLE;
	int r = aoq_call(sock, &env, &rep, &msg);
	if (r < 0) {
		ctl_fail_unreachable(path, r, "handshake failed with", msg);
	} else if (rep->msg_case != AOQ__ENVELOPE__MSG_WELCOME) {
		fprintf(stderr, "aoqctl: aoqd at %s answered Hello with message %d, not Welcome\n", path,
		        (int)rep->msg_case);
	} else {
		ret = EXIT_OK;
		*sock_out = sock;
		sock = -1;
	}
	free(msg);
	aoq_envelope_free(rep);
	if (sock >= 0)
		close(sock);
	return ret;
}

void ctl_say_bye(int sock)
{
	/* Polite goodbye; the daemon may or may not answer it. */
	Aoq__Bye bye = AOQ__BYE__INIT;
	Aoq__Envelope benv = AOQ__ENVELOPE__INIT;
	benv.msg_case = AOQ__ENVELOPE__MSG_BYE;
	benv.bye = &bye;
	(void)aoq_send_frame(sock, &benv, NULL, 0);
}

int ctl_request_stats(int sock, const char *path, bool all, Aoq__Envelope **out)
{
	char *msg = NULL;
	Aoq__Envelope *rep = NULL;
	Aoq__StatsRequest req = AOQ__STATS_REQUEST__INIT;
	req.all_sessions = all;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT;
	env.msg_case = AOQ__ENVELOPE__MSG_STATS_REQUEST;
	env.stats_request = &req;
	int r = aoq_call(sock, &env, &rep, &msg);
	if (r < 0) {
		ctl_fail_unreachable(path, r, "stats request failed at", msg);
		free(msg);
		return EXIT_UNREACHABLE;
	}
	if (rep->msg_case != AOQ__ENVELOPE__MSG_STATS || !rep->stats) {
		fprintf(stderr, "aoqctl: aoqd at %s answered StatsRequest with message %d, not Stats\n", path,
		        (int)rep->msg_case);
		aoq_envelope_free(rep);
		return EXIT_UNREACHABLE;
	}
	*out = rep;
	return EXIT_OK;
}

/* Connects as an observer, sends env and takes the reply, which must be a
 * `want` message: EXIT_OK with *rep (the caller frees it and closes
 * *sock), else the failure said on stderr (`what` names the request). */
int ctl_observer_request(const char *path, const Aoq__Envelope *env, Aoq__Envelope__MsgCase want,
                            const char *what, int *sock_out, Aoq__Envelope **rep)
{
	int sock;
	int ret = ctl_observer_connect(path, &sock);
	if (ret != EXIT_OK)
		return ret;
	char *msg = NULL;
	*rep = NULL;
	int r = aoq_call(sock, env, rep, &msg);
	ret = EXIT_UNREACHABLE;
	if (r < 0) {
		if (msg)
			fprintf(stderr, "aoqctl: %s failed: %s\n", what, msg);
		else
			ctl_fail_unreachable(path, r, "request failed at", msg);
	} else if ((*rep)->msg_case != want) {
		fprintf(stderr, "aoqctl: aoqd at %s answered the %s with message %d, not %d\n", path, what,
		        (int)(*rep)->msg_case, (int)want);
		aoq_envelope_free(*rep);
		*rep = NULL;
	} else {
		ret = EXIT_OK;
	}
	free(msg);
	if (ret != EXIT_OK) {
		close(sock);
		return ret;
	}
	*sock_out = sock;
	return EXIT_OK;
}
