/* SPDX-License-Identifier: MIT */
/*
 * Loading snapshot files (snapfile.c writes them): every byte is hostile
 * until validated, a file that does not hold up is refused with the reason.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "aoq-arena.h"
#include "aoq-config.h"
#include "convert.h"
#include "fdstore.h"
#include "log.h"
#include "snapfile.h"
#include "snapshot.h"

/* ---- loading (hostile input) ---- */

#define FAIL(...) do { snprintf(why, wlen, __VA_ARGS__); r = -EINVAL; goto out; } while (0)
/* Bytes of an fp32 master read at a time into a split one. */
#define SPLIT_PIECE (1u << 20)

static const char *meta_str(json_object *meta, const char *k)
{
	json_object *v;
	if (!json_object_object_get_ex(meta, k, &v) || !json_object_is_type(v, json_type_string))
		return NULL;
	return json_object_get_string(v);
}

/* A metadata number: decimal digits only, at most max. */
static bool meta_u64(json_object *meta, const char *k, uint64_t max, uint64_t *out)
{
	const char *s = meta_str(meta, k);
	if (!s || !*s || strlen(s) > 20)
		return false;
	uint64_t v = 0;
	for (const char *p = s; *p; p++) {
		if (*p < '0' || *p > '9' || __builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, (uint64_t)(*p - '0'), &v))
			return false;
	}
	if (v > max)
		return false;
	*out = v;
	return true;
}

static int word(const char *s, const char *const *words, int n)
{
	for (int i = 0; s && i < n; i++)
		if (strcmp(s, words[i]) == 0)
			return i;
	return -1;
}

static bool jnum(json_object *o, const char *k, double *out)
{
	json_object *v;
	if (!json_object_object_get_ex(o, k, &v) ||
	    !(json_object_is_type(v, json_type_double) || json_object_is_type(v, json_type_int)))
		return false;
	*out = json_object_get_double(v);
	return true;
}

static bool jint(json_object *o, const char *k, uint64_t max, uint64_t *out)
{
	json_object *v;
	if (!json_object_object_get_ex(o, k, &v) || !json_object_is_type(v, json_type_int))
		return false;
	int64_t x = json_object_get_int64(v);
	if (x < 0 || (uint64_t)x > max)
		return false;
	*out = (uint64_t)x;
	return true;
}

struct load_arr {
	uint64_t b, e;
	uint32_t t;
	int k;
};

static int cmp_load(const void *x, const void *y)
{
	uint64_t a = ((const struct load_arr *)x)->b, b = ((const struct load_arr *)y)->b;
	return a < b ? -1 : a > b;
}

/*
 * What json-c may cost to parse n bytes of JSON text, bounded before it is
 * parsed: each value is an allocation (an object or array some 100 to 800
 * bytes), so text of tiny values ("{},{}," or "0,0,") would cost hundreds
 * of times its length.  What aoqd writes spends 8 bytes of text or more
 * per value and 16 or more per object or array (a tensor's array entry is
 * some 60 bytes for seven values, three of them containers): text denser
 * than 4 bytes a value or 12 a container is not a snapshot aoqd wrote.
 */
static bool json_affordable(const char *s, size_t n)
{
	uint64_t values = 1, containers = 0;
	bool str = false;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (str) {
			if (c == '\\')
				i++;
			else if (c == '"')
				str = false;
		} else if (c == '"') {
			str = true;
		} else if (c == '{' || c == '[') {
			containers++;
			values++;
		} else if (c == ',') {
			values++;
		}
	}
	return values * 4 <= n + 64 && containers * 12 <= n + 64;
}

int aoqd_snapshot_load(const char *path, int lock_memory, _Atomic uint64_t *locked_total, struct aoqd_snap_key *key,
                       uint64_t *step, struct aoqd_state *st, char *why, size_t wlen)
{
	int r = 0;
	char *hdr = NULL;
	json_object *root = NULL, *groups = NULL, *tens = NULL;
	struct load_arr *la = NULL;
	uint32_t *split_buf = NULL;
	bool allocated = false;
	memset(st, 0, sizeof(*st));
	/* A regular file only: a symbolic link is not followed, and a FIFO
	 * or a device opens without blocking, then is refused. */
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
	if (fd < 0) {
		int e = errno;
		snprintf(why, wlen, "%s: %s", path, e == ELOOP ? "a symbolic link (not followed)" : strerror(e));
		return e == ELOOP ? -EINVAL : -e;
	}
	struct stat sb;
	if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode))
		FAIL("%s: not a regular file", path);
	uint64_t fsize = (uint64_t)sb.st_size;
	uint8_t lb[8];
	if (fsize < 8 || snap_pio(fd, lb, 8, 0, false) < 0)
		FAIL("%s: truncated (%" PRIu64 " bytes, no header length)", path, fsize);
	uint64_t hlen = 0;
	for (int i = 0; i < 8; i++)
		hlen |= (uint64_t)lb[i] << (8 * i);
	if (hlen < 2 || hlen > AOQD_SNAPSHOT_MAX_HEADER || hlen > fsize - 8)
		FAIL("%s: bad header length %" PRIu64 " (file of %" PRIu64 " bytes, at most %u)", path, hlen, fsize,
		     AOQD_SNAPSHOT_MAX_HEADER);
	hdr = malloc(hlen + 1);
	if (!hdr) {
		snprintf(why, wlen, "out of memory");
		r = -ENOMEM;
		goto out;
	}
	if (snap_pio(fd, hdr, hlen, 8, false) < 0)
		FAIL("%s: cannot read the header", path);
	hdr[hlen] = 0;
	if (strlen(hdr) != hlen)
		FAIL("%s: NUL byte in the header", path);
	if (!json_affordable(hdr, hlen))
		FAIL("%s: the header is denser than any aoqd writes (refused before it is parsed)", path);
	{
		json_tokener *tok = json_tokener_new();
		if (!tok) {
			r = -ENOMEM;
			snprintf(why, wlen, "out of memory");
			goto out;
		}
		json_tokener_set_flags(tok, JSON_TOKENER_STRICT);
		root = json_tokener_parse_ex(tok, hdr, (int)hlen);
		enum json_tokener_error je = json_tokener_get_error(tok);
		size_t used = json_tokener_get_parse_end(tok);
		json_tokener_free(tok);
		if (!root || je != json_tokener_success)
			FAIL("%s: the header is not JSON (%s)", path, json_tokener_error_desc(je));
		for (size_t i = used; i < hlen; i++)
			if (hdr[i] != ' ' && hdr[i] != '\n' && hdr[i] != '\t' && hdr[i] != '\r')
				FAIL("%s: bytes after the header's JSON", path);
	}
	if (!json_object_is_type(root, json_type_object))
		FAIL("%s: the header is not a JSON object", path);
	json_object *meta;
	if (!json_object_object_get_ex(root, "__metadata__", &meta) || !json_object_is_type(meta, json_type_object))
		FAIL("%s: no __metadata__ object", path);
	/* the iterator, not json_object_object_foreach: that macro is a GNU
	 * statement expression, which clang's -Wpedantic reports */
	struct json_object_iterator it = json_object_iter_begin(meta), it_end = json_object_iter_end(meta);
	for (; !json_object_iter_equal(&it, &it_end); json_object_iter_next(&it))
		if (!json_object_is_type(json_object_iter_peek_value(&it), json_type_string))
			FAIL("%s: metadata %s is not a string", path, json_object_iter_peek_name(&it));
	const char *fmt = meta_str(meta, "format");
	if (!fmt || strcmp(fmt, AOQD_SNAPSHOT_FORMAT) != 0)
		FAIL("%s: not an aoq snapshot (format '%s')", path, fmt ? fmt : "");
	uint64_t ver;
	if (!meta_u64(meta, "format_version", UINT32_MAX, &ver))
		FAIL("%s: no format_version", path);
	if (ver != AOQD_SNAPSHOT_VERSION)
		FAIL("%s: format version %" PRIu64 ", this aoqd reads version %u", path, ver, AOQD_SNAPSHOT_VERSION);
	uint64_t uid, rank, seed, window;
	const char *job = meta_str(meta, "job");
	if (!meta_u64(meta, "uid", UINT32_MAX - 1, &uid) || !meta_u64(meta, "rank", UINT32_MAX, &rank) ||
	    !meta_u64(meta, "step", AOQD_MAX_TENSOR_STEPS, step) || !meta_u64(meta, "seed", UINT64_MAX, &seed) ||
	    !meta_u64(meta, "window", UINT64_MAX, &window) || !job || strlen(job) > 128)
		FAIL("%s: metadata uid, rank, step, seed, window or job missing or out of range", path);
	memset(key, 0, sizeof(*key));
	key->uid = (uint32_t)uid;
	key->rank = (uint32_t)rank;
	if (meta_str(meta, "local_world")) {
		/* a replica group's state (rank 4294967295) */
		uint64_t lw;
		if (!meta_u64(meta, "local_world", AOQ_MAX_LOCAL_WORLD, &lw) || lw < 2 || rank != UINT32_MAX)
			FAIL("%s: metadata local_world out of range (2 to %u, with rank %u)", path, AOQ_MAX_LOCAL_WORLD,
			     UINT32_MAX);
		key->local_world = (uint32_t)lw;
	}
	memcpy(key->job, job, strlen(job) + 1);
	int prec = word(meta_str(meta, "precision"), snap_prec_names, SNAP_NPREC);
	if (prec < 0)
		FAIL("%s: unknown precision '%s'", path, meta_str(meta, "precision") ? meta_str(meta, "precision") : "");
	const char *skip = meta_str(meta, "skip_nonfinite"), *del = meta_str(meta, "delayed_update"),
	           *mgn = meta_str(meta, "max_grad_norm");
	int skipw = word(skip, (const char *const[]){ "false", "true" }, 2),
	    delw = word(del, (const char *const[]){ "false", "true" }, 2);
	char *end = NULL;
	double maxnorm = mgn ? strtod(mgn, &end) : -1;
	if (skipw < 0 || delw < 0 || !mgn || !*mgn || *end || !(maxnorm >= 0) || maxnorm > 1e300)
		FAIL("%s: metadata skip_nonfinite, delayed_update or max_grad_norm missing or bad", path);
	/* master_bits: 24 for the 24-bit master (split masters keep 8 low
	 * bits); absent: 32 */
	uint64_t mbits = 32;
	if (meta_str(meta, "master_bits") && (!meta_u64(meta, "master_bits", 32, &mbits) || (mbits != 24 && mbits != 32)))
		FAIL("%s: metadata master_bits '%s': 24 or 32", path, meta_str(meta, "master_bits"));
	const char *csum = meta_str(meta, "checksum");
	uint32_t want_crc = 0;
	if (!csum || strlen(csum) != 14 || strncmp(csum, "crc32:", 6) != 0)
		FAIL("%s: no checksum (crc32:XXXXXXXX)", path);
	for (int i = 6; i < 14; i++) {
		char c = csum[i];
		int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
		if (d < 0)
			FAIL("%s: bad checksum '%s'", path, csum);
		want_crc = want_crc << 4 | (uint32_t)d;
	}
	st->precision = (Aoq__StatePrecision)prec;
	st->seed = seed;
	st->window = window;
	st->skip_nonfinite = skipw == 1;
	st->delayed = delw == 1;
	st->master24 = mbits == 24;
	st->max_grad_norm = maxnorm;
	st->defer = st->skip_nonfinite || maxnorm > 0;
	st->options_set = true;
	/* groups */
	const char *gs = meta_str(meta, "groups"), *ts = meta_str(meta, "tensors");
	if ((gs && !json_affordable(gs, strlen(gs))) || (ts && !json_affordable(ts, strlen(ts))))
		FAIL("%s: metadata groups or tensors is denser than any aoqd writes (refused before it is parsed)", path);
	groups = gs ? json_tokener_parse(gs) : NULL;
	tens = ts ? json_tokener_parse(ts) : NULL;
	if (!groups || !json_object_is_type(groups, json_type_array) || !tens || !json_object_is_type(tens, json_type_array))
		FAIL("%s: metadata groups or tensors is not a JSON array", path);
	size_t ng = json_object_array_length(groups), nt = json_object_array_length(tens);
	if (ng == 0 || ng > 65536 || nt == 0 || nt > (1u << 24))
		FAIL("%s: %zu groups and %zu tensors", path, ng, nt);
	st->groups = calloc(ng, sizeof(*st->groups));
	st->tensors = calloc(nt, sizeof(*st->tensors));
	if (!st->groups || !st->tensors) {
		snprintf(why, wlen, "out of memory");
		r = -ENOMEM;
		goto out;
	}
	st->cap_groups = st->ngroups = (uint32_t)ng;
	st->cap_tensors = (uint32_t)nt;
	for (size_t g = 0; g < ng; g++) {
		json_object *o = json_object_array_get_idx(groups, g), *nv;
		if (!json_object_is_type(o, json_type_object))
			FAIL("%s: group %zu is not an object", path, g);
		json_object *kv;
		int kind = json_object_object_get_ex(o, "kind", &kv) && json_object_is_type(kv, json_type_string)
		                   ? word(json_object_get_string(kv), snap_kind_names, SNAP_NKIND) : -1;
		Aoq__Hyperparams h = AOQ__HYPERPARAMS__INIT;
		uint64_t moments;
		if (kind < 0 || !jnum(o, "lr", &h.lr) || !jnum(o, "beta1", &h.beta1) || !jnum(o, "beta2", &h.beta2) ||
		    !jnum(o, "eps", &h.eps) || !jnum(o, "weight_decay", &h.weight_decay) || !jnum(o, "momentum", &h.momentum) ||
		    !jnum(o, "dampening", &h.dampening) || !json_object_object_get_ex(o, "nesterov", &nv) ||
		    !json_object_is_type(nv, json_type_boolean) || !jint(o, "moments", 2, &moments))
			FAIL("%s: group %zu: kind or hyperparameters missing", path, g);
		h.nesterov = json_object_get_boolean(nv);
		char hw[256];
		if (!aoqd_hp_valid(kind, &h, hw, sizeof(hw)))
			FAIL("%s: group %zu: %s", path, g, hw);
		if (!aoqd_kind_precision_ok(kind, st->precision))
			FAIL("%s: group %zu: %s does not run in precision %s", path, g, snap_kind_names[kind], snap_prec_names[prec]);
		aoqd_group_set(&st->groups[g], (Aoq__OptimizerKind)kind, &h);
		st->groups[g].moments = aoqd_group_moments(&st->groups[g]);
		if (moments != st->groups[g].moments)
			FAIL("%s: group %zu: %" PRIu64 " moments, its kind keeps %u", path, g, moments, st->groups[g].moments);
	}
	/* tensors and their arrays */
	la = calloc(nt * A_N, sizeof(*la));
	if (!la) {
		snprintf(why, wlen, "out of memory");
		r = -ENOMEM;
		goto out;
	}
	size_t nla = 0;
	uint64_t data_len = fsize - 8 - hlen;
	for (size_t i = 0; i < nt; i++) {
		json_object *o = json_object_array_get_idx(tens, i), *nm, *kv;
		struct aoqd_tensor *t = &st->tensors[i];
		uint64_t numel, group, steps;
		if (!json_object_is_type(o, json_type_object) || !json_object_object_get_ex(o, "name", &nm) ||
		    !json_object_is_type(nm, json_type_string) || !json_object_object_get_ex(o, "key", &kv) ||
		    !json_object_is_type(kv, json_type_string) || !jint(o, "numel", 1ull << 48, &numel) || numel == 0 ||
		    !jint(o, "group", ng - 1, &group) || !jint(o, "steps", AOQD_MAX_TENSOR_STEPS, &steps))
			FAIL("%s: tensor %zu: name, key, numel, group or steps missing or out of range", path, i);
		json_object *pd, *gd;
		int pdt = json_object_object_get_ex(o, "param_dtype", &pd) ? word(json_object_get_string(pd), snap_dtype_names, SNAP_NDTYPE) : -1;
		int gdt = json_object_object_get_ex(o, "grad_dtype", &gd) ? word(json_object_get_string(gd), snap_dtype_names, SNAP_NDTYPE) : -1;
		if (pdt < 0 || gdt < 0)
			FAIL("%s: tensor %zu: bad param_dtype or grad_dtype", path, i);
		if (json_object_get_string_len(nm) > 4096)
			FAIL("%s: tensor %zu: name too long", path, i);
		t->name = strdup(json_object_get_string(nm));
		if (!t->name) {
			snprintf(why, wlen, "out of memory");
			r = -ENOMEM;
			goto out;
		}
		st->ntensors = (uint32_t)i + 1;
		t->numel = numel;
		t->group = (uint32_t)group;
		t->steps = steps;
		t->param_dtype = (enum aoqk_dtype)pdt;
		t->grad_dtype = (enum aoqk_dtype)gdt;
		st->parameters += numel;
		unsigned moments = st->groups[group].moments;
		const char *pre = json_object_get_string(kv);
		for (int k = 0; k < A_N; k++) {
			const char *dt;
			uint64_t elems;
			unsigned esize;
			if (!snap_arr_info((enum aoqk_precision)prec, numel, moments, k, &dt, &elems, &esize))
				continue;
			char kname[4200];
			snprintf(kname, sizeof(kname), "%s.%s", pre, snap_arr_suffix[k]);
			json_object *e, *dv, *sv, *ov;
			if (!json_object_object_get_ex(root, kname, &e) || !json_object_is_type(e, json_type_object))
				FAIL("%s: tensor '%s': no entry %s", path, t->name, kname);
			if (!json_object_object_get_ex(e, "dtype", &dv) || !json_object_is_type(dv, json_type_string) ||
			    strcmp(json_object_get_string(dv), dt) != 0)
				FAIL("%s: %s: dtype is not %s", path, kname, dt);
			if (!json_object_object_get_ex(e, "shape", &sv) || !json_object_is_type(sv, json_type_array) ||
			    json_object_array_length(sv) != 1 ||
			    !json_object_is_type(json_object_array_get_idx(sv, 0), json_type_int) ||
			    json_object_get_int64(json_object_array_get_idx(sv, 0)) != (int64_t)elems)
				FAIL("%s: %s: shape is not [%" PRIu64 "]", path, kname, elems);
			if (!json_object_object_get_ex(e, "data_offsets", &ov) || !json_object_is_type(ov, json_type_array) ||
			    json_object_array_length(ov) != 2 ||
			    !json_object_is_type(json_object_array_get_idx(ov, 0), json_type_int) ||
			    !json_object_is_type(json_object_array_get_idx(ov, 1), json_type_int))
				FAIL("%s: %s: bad data_offsets", path, kname);
			int64_t b = json_object_get_int64(json_object_array_get_idx(ov, 0));
			int64_t en = json_object_get_int64(json_object_array_get_idx(ov, 1));
			if (b < 0 || en < b || (uint64_t)en > data_len || (uint64_t)(en - b) != elems * esize)
				FAIL("%s: %s: data_offsets [%" PRId64 ", %" PRId64 "] do not hold %" PRIu64 " x %u bytes within "
				     "the data (%" PRIu64 " bytes)", path, kname, b, en, elems, esize, data_len);
			la[nla++] = (struct load_arr){ (uint64_t)b, (uint64_t)en, (uint32_t)i, k };
		}
	}
	if ((size_t)json_object_object_length(root) != nla + 1)
		FAIL("%s: %d entries in the header, %zu expected", path, json_object_object_length(root) - 1, nla);
	qsort(la, nla, sizeof(*la), cmp_load);
	uint64_t pos = 0;
	for (size_t k = 0; k < nla; k++) {
		if (la[k].b != pos)
			FAIL("%s: arrays overlap or leave a hole at byte %" PRIu64 " of the data", path, pos);
		pos = la[k].e;
	}
	if (pos != data_len)
		FAIL("%s: %" PRIu64 " bytes of data, the arrays hold %" PRIu64, path, data_len, pos);
	/* everything is checked but the data: now allocate and read */
	uint64_t failed;
	int a = aoqd_state_alloc(st, lock_memory, locked_total, &failed);
	allocated = true;
	if (a < 0) {
		snprintf(why, wlen, "%s: cannot allocate %" PRIu64 " bytes of state: %s", path, failed, strerror(-a));
		r = a;
		goto out;
	}
	for (uint32_t i = 0; i < st->ntensors; i++)
		st->state_bytes += st->tensors[i].state_len;
	uint32_t crc = (uint32_t)crc32(0, Z_NULL, 0);
	for (size_t k = 0; k < nla; k++) {
		const struct aoqk_state *as = &st->tensors[la[k].t].st;
		void *dst = (void *)snap_arr_ptr(as, la[k].k);
		uint64_t n = la[k].e - la[k].b;
		if (la[k].k == A_MASTER && aoqd_lo(as)) {
			/* an fp32 master into a split one, a piece at a time */
			if (!split_buf && !(split_buf = malloc(SPLIT_PIECE)))
				FAIL("%s: out of memory", path);
			for (uint64_t at = 0; at < n; at += SPLIT_PIECE) {
				uint64_t len = n - at < SPLIT_PIECE ? n - at : SPLIT_PIECE;
				if (snap_pio(fd, split_buf, len, 8 + hlen + la[k].b + at, false) < 0)
					FAIL("%s: cannot read the data", path);
				crc = snap_crc(crc, split_buf, len);
				aoqd_master_split((uint16_t *)dst + at / 4, (uint8_t *)aoqd_lo(as) + at / 4 * aoqd_lo_size(as),
				                  aoqd_lo_size(as), split_buf, len / 4);
			}
			continue;
		}
		if (snap_pio(fd, dst, n, 8 + hlen + la[k].b, false) < 0)
			FAIL("%s: cannot read the data", path);
		crc = snap_crc(crc, dst, n);
	}
	if (crc != want_crc)
		FAIL("%s: checksum mismatch (data crc32 %08x, header says %08x): the file is damaged", path, crc, want_crc);
out:
	if (r < 0) {
		if (allocated || st->tensors)
			aoqd_state_free(st, locked_total);
		free(st->groups);
		st->groups = NULL;
		memset(st, 0, sizeof(*st));
	}
	json_object_put(root);
	json_object_put(groups);
	json_object_put(tens);
	free(la);
	free(split_buf);
	free(hdr);
	close(fd);
	return r;
}
#undef FAIL

/* A write's temp file (snapfile.c: AOQD_SNAPSHOT_TEMP and mkostemp's six
 * characters).  At start no write is under way: one left is from a write
 * that a crash cut short. */
static bool is_temp(const char *name)
{
	size_t n = strlen(AOQD_SNAPSHOT_TEMP);
	return strncmp(name, AOQD_SNAPSHOT_TEMP, n) == 0 && strlen(name) == n + 6;
}

static void remove_temp(int dfd, const char *dir, const char *name)
{
	struct stat sb;
	if (fstatat(dfd, name, &sb, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISREG(sb.st_mode)) {
		aoqd_warn("snapshot", "%s/%s: not a regular file; left in place", dir, name);
		return;
	}
	if (unlinkat(dfd, name, 0) < 0)
		aoqd_warn("snapshot", "cannot remove %s/%s, left by a write that did not finish: %s", dir, name,
		          strerror(errno));
	else
		aoqd_info("snapshot", "removed %s/%s (%" PRIu64 " bytes), left by a write that did not finish", dir, name,
		          (uint64_t)sb.st_size);
}

/* A directory entry to restore, newest first. */
struct entry {
	char *name;
	int64_t mtime_ns;
};

static int cmp_newest(const void *x, const void *y)
{
	int64_t a = ((const struct entry *)x)->mtime_ns, b = ((const struct entry *)y)->mtime_ns;
	return a > b ? -1 : a < b;
}

int aoqd_snapshot_restore_all(const char *dir, int lock_memory, _Atomic uint64_t *locked_total,
                              aoqd_snapshot_restore_fn fn, void *arg)
{
	DIR *d = opendir(dir);
	if (!d)
		return -errno;
	/* Temp files go; the snapshots are restored newest first, so that a
	 * uid past its limits keeps its latest states (docs/snapshots.md,
	 * "Retention"). */
	struct entry *ents = NULL;
	size_t n = 0, cap = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (is_temp(e->d_name)) {
			remove_temp(dirfd(d), dir, e->d_name);
			continue;
		}
		size_t l = strlen(e->d_name), sl = strlen(AOQD_SNAPSHOT_SUFFIX);
		if (e->d_name[0] == '.' || l <= sl || strcmp(e->d_name + l - sl, AOQD_SNAPSHOT_SUFFIX) != 0)
			continue;
		struct stat sb;
		int64_t t = fstatat(dirfd(d), e->d_name, &sb, AT_SYMLINK_NOFOLLOW) == 0
		                    ? (int64_t)sb.st_mtim.tv_sec * 1000000000 + sb.st_mtim.tv_nsec : 0;
		if (n == cap) {
			size_t nc = cap ? 2 * cap : 64;
			struct entry *p = realloc(ents, nc * sizeof(*p));
			if (!p)
				break;
			ents = p;
			cap = nc;
		}
		if (!(ents[n].name = strdup(e->d_name)))
			break;
		ents[n++].mtime_ns = t;
	}
	closedir(d);
	if (n)
		qsort(ents, n, sizeof(*ents), cmp_newest);
	int taken = 0;
	for (size_t i = 0; i < n; i++) {
		const char *name = ents[i].name;
		char path[PATH_MAX], why[512];
		if (snprintf(path, sizeof(path), "%s/%s", dir, name) >= (int)sizeof(path))
			continue;
		if (aoqd_fdstore_taken(name)) {
			/* systemd's fd store gave this key's state back, newer */
			aoqd_info("snapshot", "%s not read: its session came back from the fd store", path);
			continue;
		}
		struct aoqd_snap_key key;
		uint64_t step;
		struct aoqd_state *st = calloc(1, sizeof(*st));
		if (!st)
			break;
		int r = aoqd_snapshot_load(path, lock_memory, locked_total, &key, &step, st, why, sizeof(why));
		if (r == -EINVAL) {
			/* The file itself is refused (damaged, another format):
			 * renamed aside, kept for inspection, so that the key's
			 * next snapshot does not replace it and the next start
			 * does not try it again (docs/snapshots.md). */
			char aside[PATH_MAX + 16];
			snprintf(aside, sizeof(aside), "%s.rejected", path);
			if (renameat2(AT_FDCWD, path, AT_FDCWD, aside, RENAME_NOREPLACE) == 0)
				aoqd_warn("snapshot", "not restored: %s; renamed to %s", why, aside);
			else
				aoqd_warn("snapshot", "not restored: %s; left in place (rename to %s: %s)", why, aside,
				          strerror(errno));
			free(st);
			continue;
		}
		if (r < 0) {
			aoqd_warn("snapshot", "not restored: %s (tried again at the next start)", why);
			free(st);
			continue;
		}
		r = fn(&key, step, st, arg);
		if (r < 0) {
			aoqd_state_free(st, locked_total);
			free(st);
			/* past the uid's limits: a state it could not hold live */
			if (r == -EDQUOT && unlink(path) == 0)
				aoqd_warn("snapshot", "%s removed: past uid %u's limits for a registration (max_sessions_per_uid, "
				          "max_state_bytes_per_uid, max_tensors, max_tensor_elems)", path, key.uid);
			continue;
		}
		aoqd_info("snapshot", "restored uid %u job '%s' rank %u at step %" PRIu64 " from %s", key.uid, key.job,
		          key.rank, step, path);
		taken++;
	}
	for (size_t i = 0; i < n; i++)
		free(ents[i].name);
	free(ents);
	return taken;
}
