/* SPDX-License-Identifier: MIT */
/*
 * aoqctl -o FILE: the output is written to FILE.tmp.PID and renamed over
 * FILE when complete, so a reader (node_exporter's textfile collector) never
 * sees half a file.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aoqctl.h"

int ctl_out_open(struct out *o, const char *path)
{
	o->path = path;
	if (!path) {
		o->f = stdout;
		return 0;
	}
	int n = snprintf(o->tmp, sizeof(o->tmp), "%s.tmp.%d", path, (int)getpid());
	if (n < 0 || (size_t)n >= sizeof(o->tmp)) {
		fprintf(stderr, "aoqctl: --output: path too long\n");
		return -ENAMETOOLONG;
	}
	o->f = fopen(o->tmp, "w");
	if (!o->f) {
		int e = errno;
		fprintf(stderr, "aoqctl: --output: cannot create %s: %s\n", o->tmp, strerror(e));
		return -e;
	}
	return 0;
}

/* ok: the content is complete.  Returns 0 or a negative errno (printed). */
int ctl_out_close(struct out *o, bool ok)
{
	if (!o->path) {
		if (fflush(stdout) != 0) {
			fprintf(stderr, "aoqctl: cannot write output: %s\n", strerror(errno));
			return -EIO;
		}
		return ok ? 0 : -EIO;
	}
	bool good = ok && fflush(o->f) == 0 && !ferror(o->f) && fsync(fileno(o->f)) == 0;
	int e = errno;
	if (fclose(o->f) != 0)
		good = false;
	if (good && rename(o->tmp, o->path) < 0) {
		e = errno;
		good = false;
	}
	if (!good) {
		if (ok)
			fprintf(stderr, "aoqctl: cannot write %s: %s\n", o->path, strerror(e));
		unlink(o->tmp);
		return -EIO;
	}
	return 0;
}
