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
	char raw[1024], line[4 * sizeof(raw)];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(raw, sizeof(raw), fmt, ap);
	va_end(ap);
	/* Lines carry names clients chose: a control byte (a newline that
	 * would forge a line, a terminal escape) is written as \xNN. */
	size_t o = 0;
	for (const unsigned char *p = (const unsigned char *)raw; *p; p++) {
		if (*p < 0x20 || *p == 0x7f || *p == '\\')
			o += (size_t)snprintf(line + o, sizeof(line) - o, "\\x%02x", *p);
		else
			line[o++] = (char)*p;
	}
	line[o] = '\0';
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
