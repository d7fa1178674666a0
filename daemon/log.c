/* SPDX-License-Identifier: MIT */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

enum aoqd_log_level aoqd_log_level = AOQD_LOG_INFO;

void aoqd_log(enum aoqd_log_level lvl, const char *subsys, const char *fmt, ...)
{
	static const char *const names[] = { "error", "warn", "info", "debug" };
	static const int sd_prio[] = { 3, 4, 6, 7 };
	if (lvl > aoqd_log_level)
		return;
	char line[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	/* Under journald, the "<N>" prefix carries the priority. */
	if (getenv("JOURNAL_STREAM"))
		fprintf(stderr, "<%d>%s: %s\n", sd_prio[lvl], subsys, line);
	else
		fprintf(stderr, "aoqd %s %s: %s\n", names[lvl], subsys, line);
}

int aoqd_log_parse_level(const char *s)
{
	static const char *const names[] = { "error", "warn", "info", "debug" };
	for (int i = 0; i < 4; i++)
		if (strcmp(s, names[i]) == 0)
			return i;
	return -1;
}
