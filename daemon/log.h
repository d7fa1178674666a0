/* SPDX-License-Identifier: MIT */
#ifndef AOQD_LOG_H
#define AOQD_LOG_H

enum aoqd_log_level { AOQD_LOG_ERROR = 0, AOQD_LOG_WARN, AOQD_LOG_INFO, AOQD_LOG_DEBUG };

extern enum aoqd_log_level aoqd_log_level;

/* One line to stderr: "<level> <subsystem>: message".  Under systemd the
 * level becomes the sd-daemon "<N>" prefix, so journald keeps it. */
void aoqd_log(enum aoqd_log_level lvl, const char *subsys, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

#define aoqd_err(sub, ...) aoqd_log(AOQD_LOG_ERROR, sub, __VA_ARGS__)
#define aoqd_warn(sub, ...) aoqd_log(AOQD_LOG_WARN, sub, __VA_ARGS__)
#define aoqd_info(sub, ...) aoqd_log(AOQD_LOG_INFO, sub, __VA_ARGS__)
#define aoqd_debug(sub, ...)                                   \
	do {                                                   \
		if (aoqd_log_level >= AOQD_LOG_DEBUG)          \
			aoqd_log(AOQD_LOG_DEBUG, sub, __VA_ARGS__); \
	} while (0)

int aoqd_log_parse_level(const char *s);

#endif
