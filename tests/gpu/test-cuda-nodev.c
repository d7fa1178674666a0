/* SPDX-License-Identifier: MIT */
/*
 * "cuda:N" without a GPU (docs/design.md, Client backends): aoq_connect fails
 * with -ENODEV and "no CUDA device (cudaErrorXxx)", never a crash, also
 * when asked twice and for another index.  Needs no daemon: the backend
 * opens before the socket.  On a machine with a CUDA device the backend
 * opens, the connection to the (absent) daemon fails instead, and the test
 * is skipped (77).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <aoq/aoq.h>

static int attempt(const char *device)
{
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.device = device;
	o.job = "cuda-no-device";
	o.socket = "/nonexistent/aoq-cuda-no-device.sock";
	struct aoq_client *c = NULL;
	int r = aoq_connect(&c, &o);
	const char *msg = aoq_last_error();
	printf("aoq_connect(\"%s\") = %d (%s): %s\n", device, r, r < 0 ? strerror(-r) : "ok", msg);
	if (r == 0) {
		aoq_close(c);
		printf("FAIL: connected to a daemon that cannot exist\n");
		return 1;
	}
	if (r == -ENODEV && strstr(msg, "no CUDA device"))
		return 0;
	if (strstr(msg, "cannot connect to aoqd"))
		return 77; /* the device opened: this machine has a GPU */
	printf("FAIL: want -ENODEV and \"no CUDA device\"\n");
	return 1;
}

int main(void)
{
	int r = attempt("cuda:0");
	if (r == 77) {
		printf("SKIP: a CUDA device is present\n");
		return 77;
	}
	if (r)
		return r;
	if ((r = attempt("cuda:0")) || (r = attempt("cuda:3")) || (r = attempt("cuda")))
		return r == 77 ? 1 : r;
	/* A malformed index is the library's -EINVAL, before any CUDA call. */
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.device = "cuda:x";
	struct aoq_client *c;
	int e = aoq_connect(&c, &o);
	if (e != -EINVAL) {
		printf("FAIL: aoq_connect(\"cuda:x\") = %d, want -EINVAL\n", e);
		return 1;
	}
	printf("ok: cuda:N fails cleanly with -ENODEV without a CUDA device\n");
	return 0;
}
