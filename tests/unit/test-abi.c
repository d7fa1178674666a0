/* SPDX-License-Identifier: MIT */
/*
 * libaoq's versioning: the library reports the version and ABI of the
 * header it was built with and the size of every public struct, and
 * refuses a struct whose size field it does not know (before it does
 * anything with it).
 */
#include <errno.h>
#include <string.h>

#include <aoq/aoq.h>

#include "expect.h"

int main(void)
{
	/* the release of the header, then '+' and the build when known */
	size_t rl = strlen(AOQ_VERSION_STRING);
	EXPECT(strncmp(aoq_version(), AOQ_VERSION_STRING, rl) == 0 &&
	               (aoq_version()[rl] == 0 || (aoq_version()[rl] == '+' && aoq_version()[rl + 1])),
	       "version %s (header %s)", aoq_version(), AOQ_VERSION_STRING);
	EXPECT(aoq_abi_version() == AOQ_ABI_VERSION, "ABI %d", aoq_abi_version());
	EXPECT(aoq_struct_size("aoq_options") == sizeof(struct aoq_options), "aoq_options");
	EXPECT(aoq_struct_size("aoq_group") == sizeof(struct aoq_group), "aoq_group");
	EXPECT(aoq_struct_size("aoq_tensor") == sizeof(struct aoq_tensor), "aoq_tensor");
	EXPECT(aoq_struct_size("aoq_step_result") == sizeof(struct aoq_step_result), "aoq_step_result");
	EXPECT(aoq_struct_size("aoq_client") == 0 && aoq_struct_size(NULL) == 0, "unknown names");

	/* Options without their size, or with another size: refused before
	 * any connection is tried (the socket does not exist). */
	struct aoq_client *c = NULL;
	struct aoq_options o = AOQ_OPTIONS_INIT;
	o.socket = "/nonexistent/aoq-test-abi.sock";
	o.size = 0;
	EXPECT(aoq_connect(&c, &o) == -EINVAL, "size 0 accepted");
	EXPECT(strstr(aoq_last_error(), "aoq_options") != NULL, "message: %s", aoq_last_error());
	o.size = sizeof(o) + 8;
	EXPECT(aoq_connect(&c, &o) == -EINVAL, "a larger size accepted");
	o.size = sizeof(o);
	int r = aoq_connect(&c, &o);
	EXPECT(r != -EINVAL && r < 0, "the right size: %d (%s)", r, aoq_last_error());
	EXPECT(c == NULL, "no client");
	return failures != 0;
}
