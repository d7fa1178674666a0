/* SPDX-License-Identifier: MIT */
/*
 * aoqctl snapshot SESSION and aoqctl drop SESSION: one request, one answer.
 */
#include <inttypes.h>
#include <stdio.h>
#include <unistd.h>

#include "aoqctl.h"

/* ---- snapshot ---------------------------------------------------------- */

int ctl_run_snapshot(const char *path, uint64_t session)
{
	Aoq__SnapshotRequest req = AOQ__SNAPSHOT_REQUEST__INIT;
	req.session = session;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep;
	env.msg_case = AOQ__ENVELOPE__MSG_SNAPSHOT_REQUEST;
	env.snapshot_request = &req;
	char what[64];
	snprintf(what, sizeof(what), "snapshot of session %" PRIu64, session);
	int sock;
	int ret = ctl_observer_request(path, &env, AOQ__ENVELOPE__MSG_SNAPSHOT_DONE, what, &sock, &rep);
	if (ret != EXIT_OK)
		return ret;
	printf("%s\n", rep->snapshot_done->path);
	fprintf(stderr, "aoqctl: session %" PRIu64 " at step %" PRIu64 " written in %.3f s\n", session,
	        rep->snapshot_done->step, rep->snapshot_done->seconds);
	aoq_envelope_free(rep);
	close(sock);
	return EXIT_OK;
}

/* ---- drop -------------------------------------------------------------- */

int ctl_run_drop(const char *path, uint64_t session)
{
	Aoq__DropRequest req = AOQ__DROP_REQUEST__INIT;
	req.session = session;
	Aoq__Envelope env = AOQ__ENVELOPE__INIT, *rep;
	env.msg_case = AOQ__ENVELOPE__MSG_DROP_REQUEST;
	env.drop_request = &req;
	char what[64];
	snprintf(what, sizeof(what), "drop of session %" PRIu64, session);
	int sock;
	int ret = ctl_observer_request(path, &env, AOQ__ENVELOPE__MSG_DONE, what, &sock, &rep);
	if (ret != EXIT_OK)
		return ret;
	printf("session %" PRIu64 " dropped\n", session);
	aoq_envelope_free(rep);
	ctl_say_bye(sock);
	close(sock);
	return EXIT_OK;
}
