/* SPDX-License-Identifier: MIT */
/*
 * aoq_socket_path() precedence: the explicit path, else $AOQ_SOCKET, else
 * /run/aoq/aoqd.sock when it exists, else $XDG_RUNTIME_DIR/aoq/aoqd.sock,
 * else /tmp/aoq-UID/aoqd.sock; empty strings count as unset; a short buffer
 * is -ENAMETOOLONG.  aoq_socket_connect(): missing socket, over-long path,
 * and a real listener.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "wire.h"

#include "expect.h"

static void expect_path(const char *explicit_path, const char *want)
{
	char buf[256];
	int r = aoq_socket_path(explicit_path, buf, sizeof(buf));
	EXPECT(r == 0 && strcmp(buf, want) == 0, "explicit '%s', AOQ_SOCKET '%s', XDG_RUNTIME_DIR '%s': got %d '%s', want '%s'",
	       explicit_path ? explicit_path : "(null)", getenv("AOQ_SOCKET") ? getenv("AOQ_SOCKET") : "(unset)",
	       getenv("XDG_RUNTIME_DIR") ? getenv("XDG_RUNTIME_DIR") : "(unset)", r, r == 0 ? buf : "", want);
}

int main(void)
{
	struct stat st;
	bool system_socket = stat("/run/aoq/aoqd.sock", &st) == 0 && S_ISSOCK(st.st_mode);
	char fallback[128];
	snprintf(fallback, sizeof(fallback), "/tmp/aoq-%u/aoqd.sock", (unsigned)getuid());

	setenv("AOQ_SOCKET", "/env/aoq.sock", 1);
	setenv("XDG_RUNTIME_DIR", "/run/user/4242", 1);
	expect_path("/explicit/a.sock", "/explicit/a.sock");
	expect_path("", "/env/aoq.sock");
	expect_path(NULL, "/env/aoq.sock");

	setenv("AOQ_SOCKET", "", 1);
	const char *no_env = system_socket ? "/run/aoq/aoqd.sock" : "/run/user/4242/aoq/aoqd.sock";
	expect_path(NULL, no_env);
	unsetenv("AOQ_SOCKET");
	expect_path(NULL, no_env);
	expect_path("rel.sock", "rel.sock");

	unsetenv("XDG_RUNTIME_DIR");
	expect_path(NULL, system_socket ? "/run/aoq/aoqd.sock" : fallback);
	setenv("XDG_RUNTIME_DIR", "", 1);
	expect_path(NULL, system_socket ? "/run/aoq/aoqd.sock" : fallback);
	if (system_socket)
		printf("note: /run/aoq/aoqd.sock exists; the XDG_RUNTIME_DIR fallbacks were not reachable\n");

	/* Buffers: exactly enough, one byte short. */
	char small[17];
	EXPECT(aoq_socket_path("/0123456789abcde", small, sizeof(small)) == 0, "16 chars in 17 bytes");
	EXPECT(aoq_socket_path("/0123456789abcdef", small, sizeof(small)) == -ENAMETOOLONG, "17 chars in 17 bytes");

	/* Connecting. */
	char dir[] = "/tmp/aoq-unit-XXXXXX";
	EXPECT(mkdtemp(dir) != NULL, "mkdtemp");
	char path[64];
	snprintf(path, sizeof(path), "%s/missing.sock", dir);
	int r = aoq_socket_connect(path);
	EXPECT(r == -ENOENT, "connect to a missing socket: %d", r);
	char longp[sizeof(((struct sockaddr_un *)0)->sun_path) + 8];
	memset(longp, 'x', sizeof(longp) - 1);
	longp[0] = '/';
	longp[sizeof(longp) - 1] = 0;
	r = aoq_socket_connect(longp);
	EXPECT(r == -ENAMETOOLONG, "connect to an over-long path: %d", r);

	snprintf(path, sizeof(path), "%s/s.sock", dir);
	int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	EXPECT(bind(l, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(l, 4) == 0, "listen");
	r = aoq_socket_connect(path);
	EXPECT(r >= 0, "connect to a listener: %d", r);
	if (r >= 0) {
		EXPECT(fcntl(r, F_GETFD) & FD_CLOEXEC, "connected socket without CLOEXEC");
		int type = 0;
		socklen_t tl = sizeof(type);
		EXPECT(getsockopt(r, SOL_SOCKET, SO_TYPE, &type, &tl) == 0 && type == SOCK_STREAM, "not SOCK_STREAM");
		close(r);
	}
	close(l);
	unlink(path);
	rmdir(dir);

	if (failures) {
		fprintf(stderr, "%d failures\n", failures);
		return 1;
	}
	printf("ok\n");
	return 0;
}
