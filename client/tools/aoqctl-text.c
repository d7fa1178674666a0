/* SPDX-License-Identifier: MIT */
/*
 * aoqctl's text for a terminal: numbers with units, uptimes and times, the
 * names of state precisions, UTF-8 validated and control characters made
 * safe (job and device names come from other processes), and a small
 * table printer.
 */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>

#include "aoqctl.h"

/* ---- formatting helpers ------------------------------------------------ */

/* v in units of base (1024: "1.50 GiB", "512 B"; 1000: "12.3k", "999"):
 * three significant digits past the first unit. */
static void fmt_scaled(char *buf, size_t len, uint64_t v, double base, const char *const unit[7], const char *sep)
{
	double d = (double)v;
	unsigned u = 0;
	while (d >= base && u + 1 < 7) {
		d /= base;
		u++;
	}
	if (u == 0)
		snprintf(buf, len, "%" PRIu64 "%s%s", v, sep, unit[0]);
	else
		snprintf(buf, len, "%.*f%s%s", d < 10.0 ? 2 : d < 100.0 ? 1 : 0, d, sep, unit[u]);
}

void ctl_fmt_bytes(char *buf, size_t len, uint64_t v)
{
	static const char *const unit[7] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB" };
	fmt_scaled(buf, len, v, 1024.0, unit, " ");
}

/* The rank of a replica group's state (a group leased after a member's
 * trainer went away): shown as "group". */

void ctl_fmt_rank(char *buf, size_t len, const Aoq__SessionStats *s)
{
	if (s->rank == GROUP_RANK && s->local_world >= 2)
		snprintf(buf, len, "group");
	else
		snprintf(buf, len, "%" PRIu32, s->rank);
}

void ctl_fmt_count(char *buf, size_t len, uint64_t v)
{
	static const char *const unit[7] = { "", "k", "M", "G", "T", "P", "E" };
	fmt_scaled(buf, len, v, 1000.0, unit, "");
}

/* "3d 04:05:06", "04:05:06". */
void ctl_fmt_uptime(char *buf, size_t len, double s)
{
	if (!isfinite(s) || s < 0)
		s = 0;
	uint64_t t = (uint64_t)s;
	uint64_t d = t / 86400, h = t / 3600 % 24, m = t / 60 % 60, sec = t % 60;
	if (d)
		snprintf(buf, len, "%" PRIu64 "d %02" PRIu64 ":%02" PRIu64 ":%02" PRIu64, d, h, m, sec);
	else
		snprintf(buf, len, "%02" PRIu64 ":%02" PRIu64 ":%02" PRIu64, h, m, sec);
}

void ctl_fmt_double(char *buf, size_t len, double v, int prec)
{
	if (!isfinite(v))
		snprintf(buf, len, "-");
	else
		snprintf(buf, len, "%.*f", prec, v);
}

const char *ctl_precision_name(int p, uint32_t master_bits)
{
	/* the 24-bit master (Register.master_bits) beside q8 or q4 moments */
	if (master_bits == 24 && p == AOQ__STATE_PRECISION__STATE_Q8)
		return "q8-bf24";
	if (master_bits == 24 && p == AOQ__STATE_PRECISION__STATE_Q4)
		return "q4-bf24";
	switch (p) {
	case AOQ__STATE_PRECISION__STATE_FP32: return "fp32";
	case AOQ__STATE_PRECISION__STATE_Q8: return "q8";
	case AOQ__STATE_PRECISION__STATE_BF16: return "bf16";
	case AOQ__STATE_PRECISION__STATE_BF16_Q8: return "bf16-q8";
	case AOQ__STATE_PRECISION__STATE_BF16_ALL: return "bf16-all";
	case AOQ__STATE_PRECISION__STATE_Q4: return "q4";
	case AOQ__STATE_PRECISION__STATE_BF16_Q4: return "bf16-q4";
	default: return "unknown";
	}
}

const char *ctl_str_or(const char *s, const char *dflt)
{
	return s && *s ? s : dflt;
}
/* ---- UTF-8 ---------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when invalid; *cp
 * its code point. */
static size_t utf8_decode(const unsigned char *s, uint32_t *cp_out)
{
	unsigned c = s[0];
	size_t n;
	uint32_t cp;
	*cp_out = c;
	if (c < 0x80)
		return 1;
	else if ((c & 0xe0) == 0xc0)
		n = 2, cp = c & 0x1f;
	else if ((c & 0xf0) == 0xe0)
		n = 3, cp = c & 0x0f;
	else if ((c & 0xf8) == 0xf0)
		n = 4, cp = c & 0x07;
	else
		return 0;
	for (size_t i = 1; i < n; i++) {
		if ((s[i] & 0xc0) != 0x80)
			return 0;
		cp = cp << 6 | (s[i] & 0x3f);
	}
	if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
	    cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
		return 0;
	*cp_out = cp;
	return n;
}

/* Characters that change how a terminal shows what follows rather than
 * showing themselves: C0 and C1 controls, DEL, and Unicode's bidirectional
 * and other format characters (general category Cf: the embeddings,
 * overrides and isolates U+202A..U+202E and U+2066..U+2069, the marks
 * U+200E/U+200F/U+061C, zero-width characters, the BOM, soft hyphen,
 * interlinear annotation, tags), and the line and paragraph separators. */
static bool unsafe_char(uint32_t cp)
{
	return cp < 0x20 || (cp >= 0x7f && cp <= 0x9f) || cp == 0xad || cp == 0x061c || (cp >= 0x0600 && cp <= 0x0605) ||
	       cp == 0x06dd || cp == 0x070f || cp == 0x180e || (cp >= 0x200b && cp <= 0x200f) ||
	       (cp >= 0x2028 && cp <= 0x202e) || (cp >= 0x2060 && cp <= 0x206f) || cp == 0xfeff ||
	       (cp >= 0xfff9 && cp <= 0xfffb) || cp == 0x110bd || cp == 0x110cd || (cp >= 0x1bca0 && cp <= 0x1bca3) ||
	       (cp >= 0x1d173 && cp <= 0x1d17a) || cp == 0xe0001 || (cp >= 0xe0020 && cp <= 0xe007f);
}

/* The length of the character at s when it is valid UTF-8 and safe to show
 * (1..4), else 0 with *skip the bytes to replace by one mark: the whole
 * character when it is valid but unsafe, one byte when invalid. */
static size_t utf8_safe(const unsigned char *s, size_t *skip)
{
	uint32_t cp;
	size_t n = utf8_decode(s, &cp);
	*skip = n ? n : 1;
	return n && !unsafe_char(cp) ? n : 0;
}

/* ---- a small table printer --------------------------------------------- */

/* Sanitises a cell for a terminal: each control or format character (see
 * unsafe_char) and each invalid byte becomes '?'; a long text is cut at a
 * character boundary. */
void ctl_cell_set(char *cell, const char *str)
{
	const unsigned char *s = (const unsigned char *)str;
	size_t o = 0;
	while (*s) {
		size_t skip, n = utf8_safe(s, &skip);
		if (o + (n ? n : 1) + 1 > CELL_LEN)
			break;
		if (n)
			memcpy(cell + o, s, n);
		else
			cell[o] = '?';
		o += n ? n : 1;
		s += skip;
	}
	cell[o] = 0;
}

/* Display width: characters, not bytes (cells hold valid UTF-8). */
static size_t cell_width(const char *s)
{
	size_t w = 0;
	for (; *s; s++)
		w += ((unsigned char)*s & 0xc0) != 0x80;
	return w;
}

static void print_padded(FILE *f, const char *s, size_t width, bool right)
{
	size_t w = cell_width(s);
	if (right)
		for (; w < width; w++)
			fputc(' ', f);
	fputs(s, f);
	if (!right)
		for (; w < width; w++)
			fputc(' ', f);
}

int ctl_table_print(const struct table *t, FILE *f)
{
	size_t w[TABLE_MAX_COLS];
	for (size_t c = 0; c < t->ncols; c++) {
		w[c] = cell_width(t->head[c]);
		for (size_t r = 0; r < t->nrows; r++) {
			size_t l = cell_width(t->cells[r][c]);
			if (l > w[c])
				w[c] = l;
		}
	}
	for (size_t r = 0; r <= t->nrows; r++) {
		for (size_t c = 0; c < t->ncols; c++) {
			const char *s = r == 0 ? t->head[c] : t->cells[r - 1][c];
			bool last = c + 1 == t->ncols;
			print_padded(f, s, last && !t->right[c] ? 0 : w[c], t->right[c]);
			if (!last)
				fputs("  ", f);
		}
		fputc('\n', f);
	}
	return ferror(f) ? -EIO : 0;
}

/* ---- strings from the daemon ------------------------------------------- */

/* A copy of str as valid UTF-8 without control or format characters (each
 * becomes U+FFFD, as each invalid byte does): job and device names come
 * from other processes. */
char *ctl_clean_utf8(const char *str)
{
	const unsigned char *s = (const unsigned char *)(str ? str : "");
	size_t len = strlen((const char *)s);
	char *out = malloc(len * 3 + 1), *o = out;
	if (!out)
		return NULL;
	while (*s) {
		size_t skip, n = utf8_safe(s, &skip);
		if (n == 0) {
			memcpy(o, "\xef\xbf\xbd", 3);
			o += 3;
			s += skip;
			continue;
		}
		memcpy(o, s, n);
		o += n;
		s += n;
	}
	*o = '\0';
	return out;
}

/* "2026-11-30T17:20:01.250Z" */
void ctl_fmt_time(char *buf, size_t len, double t)
{
	time_t sec = (time_t)t;
	struct tm tm;
	gmtime_r(&sec, &tm);
	int ms = (int)((t - (double)sec) * 1000);
	if (ms < 0 || ms > 999)
		ms = 0;
	snprintf(buf, len, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
	         tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}
