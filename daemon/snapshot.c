/* SPDX-License-Identifier: MIT */
/*
 * Snapshots of optimizer state in the safetensors format (docs/snapshots.md),
 * the consistent capture of a live state, and the writer thread.
 *
 * The file: header = JSON object with one entry per array
 * ("<key>.master", "<key>.exp_avg", "<key>.exp_avg_sq", and for q8
 * "<key>.exp_avg.scale", "<key>.exp_avg_sq.scale") and a __metadata__ map of
 * strings.  Arrays are laid out by element size (4-byte dtypes first, then
 * 2, then 1), each class in tensor order, contiguous, so every array is
 * aligned to its element.  The checksum is zlib's CRC-32 of the data
 * section; arrays may be written in any order (a capture takes tensors as
 * they are needed), so each array's CRC is kept and they are combined in
 * file order at the end (crc32_combine), then written into the header's
 * fixed-width field.
 *
 * The capture: docs/design.md, "Snapshots".
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "aoq-arena.h"
#include "aoq-config.h"
#include "log.h"
#include "pool.h"
#include "snapshot.h"

/* ---- arrays of a tensor ---- */

enum { A_MASTER, A_M, A_V, A_MS, A_VS, A_N };
static const char *const arr_suffix[A_N] = { "master", "exp_avg", "exp_avg_sq", "exp_avg.scale", "exp_avg_sq.scale" };

static const char *const prec_names[] = { "fp32", "q8", "bf16", "bf16_q8", "bf16_all" };
static const char *const kind_names[] = { "adamw", "adam", "sgd", "lion" };
static const char *const dtype_names[] = { "fp32", "bf16", "fp16" };

#define Q8_FORMAT "blockwise-256, code format 2: exp_avg uint8 codes, bit 7 the sign, bits 0-6 an e3m4 float c: " \
                  "|m| = (u2f((c + 1920) << 19) - u2f(1920 << 19)) * (scale / TOP_M); exp_avg_sq uint8 codes c (e3m5): " \
                  "sqrt(v) = (u2f((c + 3840) << 18) - u2f(3840 << 18)) * (scale / TOP_U); u2f reads the bits as fp32 " \
                  "(docs/snapshots.md)"

/* Array k of a tensor of n elements: false when it has none; else its
 * safetensors dtype, element count and element size. */
static bool arr_info(enum aoqk_precision p, uint64_t n, unsigned moments, int k, const char **dtype,
                     uint64_t *elems, unsigned *esize)
{
	bool q8 = aoqk_precision_q8(p);
	switch (k) {
	case A_MASTER:
		*dtype = aoqk_precision_bf16_master(p) ? "BF16" : "F32";
		*esize = (unsigned)aoqk_master_size(p);
		*elems = n;
		return true;
	case A_M:
	case A_V:
		if (moments < (k == A_M ? 1u : 2u))
			return false;
		*dtype = q8 ? "U8" : aoqk_precision_bf16_moments(p) ? "BF16" : "F32";
		*esize = (unsigned)aoqk_moment_size(p);
		*elems = n;
		return true;
	default:
		if (!q8 || moments < (k == A_MS ? 1u : 2u))
			return false;
		*dtype = "F32";
		*esize = 4;
		*elems = (n + AOQK_Q8_BLOCK - 1) / AOQK_Q8_BLOCK;
		return true;
	}
}

static const void *arr_ptr(const struct aoqk_state *a, int k)
{
	switch (k) {
	case A_MASTER: return a->master;
	case A_M: return a->m;
	case A_V: return a->v;
	case A_MS: return a->m_scale;
	default: return a->v_scale;
	}
}

/* zlib's crc32 takes 32-bit lengths */
static uint32_t crc_update(uint32_t crc, const void *p, uint64_t n)
{
	const uint8_t *b = p;
	while (n) {
		uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
		crc = (uint32_t)crc32(crc, b, k);
		b += k;
		n -= k;
	}
	return crc;
}

/* ---- the file ---- */

struct arr {
	uint64_t off, len; /* in the data section */
	uint32_t crc;
	bool present, written;
};

struct aoqd_snapfile {
	char *header;      /* padded JSON, hlen bytes */
	size_t hlen;
	size_t csum_pos;   /* the 8 hex digits of the checksum in header */
	uint32_t n;
	struct arr (*arrs)[A_N];
	uint64_t data_len;
	enum aoqk_precision prec;
	unsigned *moments; /* per tensor */
	char *dir, *name, *tmp;
	int fd;
	uint32_t put;
	/* The data goes out in chunks (aoqd_snapfile_pace) and each chunk's
	 * pages leave the page cache once on disk (write_behind). */
	uint64_t chunk;
	void (*before)(void *arg, uint64_t bytes);
	void *before_arg;
	bool wb_unsupported;
};

void aoqd_snapfile_free(struct aoqd_snapfile *f)
{
	if (!f)
		return;
	if (f->fd >= 0) {
		close(f->fd);
		if (f->tmp)
			unlink(f->tmp);
	}
	free(f->header);
	free(f->arrs);
	free(f->moments);
	free(f->dir);
	free(f->name);
	free(f->tmp);
	free(f);
}

uint32_t aoqd_snapfile_tensors(const struct aoqd_snapfile *f)
{
	return f->n;
}

int aoqd_snapshot_path(const char *dir, const struct aoqd_snap_key *key, char *path, size_t len)
{
	char job[3 * sizeof(key->job) + 1];
	size_t k = 0;
	for (const unsigned char *p = (const unsigned char *)key->job; *p && k + 4 < sizeof(job); p++) {
		if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '.' ||
		    *p == '_' || *p == '-')
			job[k++] = (char)*p;
		else
			k += (size_t)snprintf(job + k, sizeof(job) - k, "%%%02X", *p);
	}
	job[k] = 0;
	char rank[16];
	if (key->local_world > 1)
		snprintf(rank, sizeof(rank), "group"); /* a replica group's state */
	else
		snprintf(rank, sizeof(rank), "%u", key->rank);
	int r = snprintf(path, len, "%s%s%u-%s-%s%s", dir ? dir : "", dir && *dir ? "/" : "", key->uid, job, rank,
	                 AOQD_SNAPSHOT_SUFFIX);
	return r < 0 || (size_t)r >= len ? -ENAMETOOLONG : 0;
}

static json_object *jdouble(double d)
{
	char b[40];
	snprintf(b, sizeof(b), "%.17g", d);
	return json_object_new_double_s(d, b);
}

static int add_str(json_object *o, const char *k, const char *v)
{
	json_object *s = json_object_new_string(v);
	if (!s || json_object_object_add(o, k, s) < 0) {
		json_object_put(s);
		return -ENOMEM;
	}
	return 0;
}

static int add_u64(json_object *o, const char *k, uint64_t v)
{
	char b[24];
	snprintf(b, sizeof(b), "%" PRIu64, v);
	return add_str(o, k, b);
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Each tensor's key prefix: its name, unless two arrays' keys would then
 * collide (or a name is empty): then "<index>:<name>" for every tensor. */
static char **make_prefixes(const struct aoqd_state *st)
{
	uint32_t n = st->ntensors;
	char **pre = calloc(n ? n : 1, sizeof(*pre));
	char **keys = calloc((size_t)n * A_N + 1, sizeof(*keys));
	if (!pre || !keys)
		goto fail;
	for (int indexed = 0; indexed < 2; indexed++) {
		size_t nk = 0;
		bool bad = false;
		for (uint32_t i = 0; i < n; i++) {
			const char *nm = st->tensors[i].name ? st->tensors[i].name : "";
			free(pre[i]);
			if (indexed)
				pre[i] = (asprintf(&pre[i], "%u:%s", i, nm) < 0) ? NULL : pre[i];
			else
				pre[i] = strdup(nm);
			if (!pre[i])
				goto fail;
			if (!*nm)
				bad = true;
			for (int k = 0; k < A_N; k++) {
				if (asprintf(&keys[nk], "%s.%s", pre[i], arr_suffix[k]) < 0) {
					keys[nk] = NULL;
					goto fail;
				}
				nk++;
			}
		}
		qsort(keys, nk, sizeof(*keys), cmp_str);
		for (size_t k = 1; k < nk; k++)
			if (strcmp(keys[k - 1], keys[k]) == 0)
				bad = true;
		for (size_t k = 0; k < nk; k++) {
			free(keys[k]);
			keys[k] = NULL;
		}
		if (!bad)
			break;
	}
	free(keys);
	return pre;
fail:
	if (keys)
		for (size_t k = 0; k < (size_t)n * A_N; k++)
			free(keys[k]);
	free(keys);
	if (pre)
		for (uint32_t i = 0; i < n; i++)
			free(pre[i]);
	free(pre);
	return NULL;
}

struct aoqd_snapfile *aoqd_snapfile_prepare(const struct aoqd_snap_key *key, uint64_t step,
                                            const struct aoqd_state *st, const uint64_t *tensor_steps)
{
	struct aoqd_snapfile *f = calloc(1, sizeof(*f));
	json_object *root = NULL, *meta = NULL, *groups = NULL, *tens = NULL;
	char **pre = NULL;
	int err = ENOMEM;
	if (!f)
		return NULL;
	f->fd = -1;
	f->chunk = AOQD_SNAPSHOT_CHUNK;
	f->n = st->ntensors;
	f->prec = (enum aoqk_precision)st->precision;
	f->arrs = calloc(f->n ? f->n : 1, sizeof(*f->arrs));
	f->moments = calloc(f->n ? f->n : 1, sizeof(*f->moments));
	pre = make_prefixes(st);
	root = json_object_new_object();
	meta = json_object_new_object();
	groups = json_object_new_array();
	tens = json_object_new_array();
	if (!f->arrs || !f->moments || !pre || !root || !meta || !groups || !tens)
		goto fail;
	if ((unsigned)st->precision >= sizeof(prec_names) / sizeof(prec_names[0])) {
		err = EINVAL;
		goto fail;
	}
	/* groups and tensors, as JSON text in metadata strings */
	for (uint32_t g = 0; g < st->ngroups; g++) {
		const struct aoqd_group *gr = &st->groups[g];
		json_object *o = json_object_new_object();
		if (!o || json_object_array_add(groups, o) < 0) {
			json_object_put(o);
			goto fail;
		}
		if ((unsigned)gr->kind >= sizeof(kind_names) / sizeof(kind_names[0])) {
			err = EINVAL;
			goto fail;
		}
		json_object_object_add(o, "kind", json_object_new_string(kind_names[gr->kind]));
		json_object_object_add(o, "lr", jdouble(gr->hp.lr));
		json_object_object_add(o, "beta1", jdouble(gr->hp.beta1));
		json_object_object_add(o, "beta2", jdouble(gr->hp.beta2));
		json_object_object_add(o, "eps", jdouble(gr->hp.eps));
		json_object_object_add(o, "weight_decay", jdouble(gr->hp.weight_decay));
		json_object_object_add(o, "momentum", jdouble(gr->hp.momentum));
		json_object_object_add(o, "dampening", jdouble(gr->hp.dampening));
		json_object_object_add(o, "nesterov", json_object_new_boolean(gr->hp.nesterov));
		json_object_object_add(o, "moments", json_object_new_int((int)gr->moments));
	}
	for (uint32_t i = 0; i < f->n; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		json_object *o = json_object_new_object();
		if (!o || json_object_array_add(tens, o) < 0) {
			json_object_put(o);
			goto fail;
		}
		json_object_object_add(o, "name", json_object_new_string(t->name ? t->name : ""));
		json_object_object_add(o, "key", json_object_new_string(pre[i]));
		json_object_object_add(o, "numel", json_object_new_int64((int64_t)t->numel));
		json_object_object_add(o, "param_dtype", json_object_new_string(dtype_names[t->param_dtype]));
		json_object_object_add(o, "grad_dtype", json_object_new_string(dtype_names[t->grad_dtype]));
		json_object_object_add(o, "group", json_object_new_int64(t->group));
		json_object_object_add(o, "steps",
		                       json_object_new_int64((int64_t)(tensor_steps ? tensor_steps[i] : t->steps)));
		f->moments[i] = st->groups[t->group].moments;
	}
	/* metadata */
	if (add_str(meta, "format", AOQD_SNAPSHOT_FORMAT) < 0 || add_u64(meta, "format_version", AOQD_SNAPSHOT_VERSION) < 0 ||
	    add_str(meta, "aoq_version", AOQ_VERSION) < 0 || add_u64(meta, "uid", key->uid) < 0 ||
	    add_str(meta, "job", key->job) < 0 || add_u64(meta, "rank", key->rank) < 0 || add_u64(meta, "step", step) < 0 ||
	    add_str(meta, "precision", prec_names[st->precision]) < 0 || add_u64(meta, "seed", st->seed) < 0 ||
	    add_u64(meta, "window", st->window) < 0 ||
	    (key->local_world > 1 && add_u64(meta, "local_world", key->local_world) < 0) ||
	    add_str(meta, "skip_nonfinite", st->skip_nonfinite ? "true" : "false") < 0 ||
	    add_str(meta, "delayed_update", st->delayed ? "true" : "false") < 0 ||
	    add_str(meta, "groups", json_object_to_json_string_ext(groups, JSON_C_TO_STRING_PLAIN)) < 0 ||
	    add_str(meta, "tensors", json_object_to_json_string_ext(tens, JSON_C_TO_STRING_PLAIN)) < 0)
		goto fail;
	{
		char b[40];
		snprintf(b, sizeof(b), "%.17g", st->max_grad_norm);
		if (add_str(meta, "max_grad_norm", b) < 0)
			goto fail;
	}
	if (aoqk_precision_q8(f->prec) && add_str(meta, "q8_format", Q8_FORMAT) < 0)
		goto fail;
	if (add_str(meta, "checksum", "crc32:00000000") < 0)
		goto fail;
	json_object_object_add(root, "__metadata__", meta);
	meta = NULL;
	/* layout: by element size, then tensor order */
	uint64_t off = 0;
	for (unsigned es = 4; es >= 1; es /= 2) {
		for (uint32_t i = 0; i < f->n; i++) {
			const struct aoqd_tensor *t = &st->tensors[i];
			for (int k = 0; k < A_N; k++) {
				const char *dt;
				uint64_t elems;
				unsigned esize;
				if (!arr_info(f->prec, t->numel, f->moments[i], k, &dt, &elems, &esize) || esize != es)
					continue;
				struct arr *a = &f->arrs[i][k];
				a->present = true;
				a->off = off;
				a->len = elems * esize;
				off += a->len;
				json_object *e = json_object_new_object(), *shape = json_object_new_array(),
				            *offs = json_object_new_array();
				char *kname = NULL;
				if (!e || !shape || !offs || asprintf(&kname, "%s.%s", pre[i], arr_suffix[k]) < 0) {
					json_object_put(e);
					json_object_put(shape);
					json_object_put(offs);
					goto fail;
				}
				json_object_array_add(shape, json_object_new_int64((int64_t)elems));
				json_object_array_add(offs, json_object_new_int64((int64_t)a->off));
				json_object_array_add(offs, json_object_new_int64((int64_t)(a->off + a->len)));
				json_object_object_add(e, "dtype", json_object_new_string(dt));
				json_object_object_add(e, "shape", shape);
				json_object_object_add(e, "data_offsets", offs);
				json_object_object_add(root, kname, e);
				free(kname);
			}
		}
		if (es == 1)
			break;
	}
	f->data_len = off;
	{
		char nm[PATH_MAX];
		if (aoqd_snapshot_path(NULL, key, nm, sizeof(nm)) < 0 || !(f->name = strdup(nm)))
			goto fail;
	}
	const char *js = json_object_to_json_string_ext(root, JSON_C_TO_STRING_PLAIN);
	const char *cs = js ? strstr(js, "\"checksum\":\"crc32:00000000\"") : NULL;
	if (!cs)
		goto fail;
	size_t jl = strlen(js);
	if (jl > AOQD_SNAPSHOT_MAX_HEADER - 8) {
		err = EFBIG;
		goto fail;
	}
	f->hlen = aoq_align_up(jl, 8);
	f->header = malloc(f->hlen);
	if (!f->header)
		goto fail;
	memcpy(f->header, js, jl);
	memset(f->header + jl, ' ', f->hlen - jl);
	f->csum_pos = (size_t)(cs - js) + strlen("\"checksum\":\"crc32:");
	json_object_put(root);
	json_object_put(groups);
	json_object_put(tens);
	for (uint32_t i = 0; i < f->n; i++)
		free(pre[i]);
	free(pre);
	return f;
fail:
	json_object_put(root);
	json_object_put(meta);
	json_object_put(groups);
	json_object_put(tens);
	if (pre)
		for (uint32_t i = 0; i < f->n; i++)
			free(pre[i]);
	free(pre);
	aoqd_snapfile_free(f);
	errno = err;
	return NULL;
}

static int pwrite_all(int fd, const void *p, uint64_t n, uint64_t off)
{
	const uint8_t *b = p;
	while (n) {
		size_t k = n > (1u << 30) ? (1u << 30) : (size_t)n;
		ssize_t w = pwrite(fd, b, k, (off_t)off);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		if (w == 0)
			return -EIO;
		b += w;
		off += (uint64_t)w;
		n -= (uint64_t)w;
	}
	return 0;
}

static int write_header(struct aoqd_snapfile *f)
{
	uint8_t len[8];
	for (int i = 0; i < 8; i++)
		len[i] = (uint8_t)((uint64_t)f->hlen >> (8 * i));
	int r = pwrite_all(f->fd, len, 8, 0);
	return r < 0 ? r : pwrite_all(f->fd, f->header, f->hlen, 8);
}

int aoqd_snapfile_open(struct aoqd_snapfile *f, const char *dir, struct aoqd_error *err)
{
	f->dir = strdup(dir);
	if (!f->dir)
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	if (asprintf(&f->tmp, "%s/.snapshot-XXXXXX", dir) < 0) {
		f->tmp = NULL;
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	}
	f->fd = mkostemp(f->tmp, O_CLOEXEC);
	if (f->fd < 0) {
		int e = errno;
		free(f->tmp);
		f->tmp = NULL;
		return aoqd_error_set(err, e == ENOMEM ? AOQ__ERROR_CODE__NO_MEMORY : AOQ__ERROR_CODE__INTERNAL, true,
		                      "snapshot: cannot create a file in %s: %s", dir, strerror(e)) ;
	}
	fchmod(f->fd, 0600);
	/* Room for everything now: a full disk fails here, not half way. */
	int r = posix_fallocate(f->fd, 0, (off_t)(8 + f->hlen + f->data_len));
	if (r == 0)
		r = -write_header(f);
	if (r != 0 && r != EOPNOTSUPP && r != EINVAL)
		return AOQD_REFUSE(err, INTERNAL, "snapshot: writing %s: %s", f->tmp, strerror(r));
	if (r != 0) {
		r = write_header(f);
		if (r < 0)
			return AOQD_REFUSE(err, INTERNAL, "snapshot: writing %s: %s", f->tmp, strerror(-r));
	}
	return 0;
}

void aoqd_snapfile_pace(struct aoqd_snapfile *f, uint64_t chunk, void (*before)(void *arg, uint64_t bytes), void *arg)
{
	f->chunk = chunk ? chunk : AOQD_SNAPSHOT_CHUNK;
	f->before = before;
	f->before_arg = arg;
}

/* After a chunk [off, off + len) of the file is written: its writeback is
 * done now, and its pages dropped from the page cache, before the writer
 * looks at the workers again.  So the disk's work (and its interrupts and
 * completions, which land on any core, a worker's too) happens in the idle
 * window the chunk was written in, not under the next step; a snapshot
 * leaves no dirty file for fsync to flush and does not fill the page cache
 * (reclaim on the workers' page faults).  Measured on the H200 host (1 G
 * parameters, 150 ms gaps): with the writeback of a chunk overlapping the
 * next chunk, steps while writing took +14 ms (mean) over the baseline
 * and +45 ms over the steps right after.  An error of the writeback fails
 * the snapshot here: sync_file_range reports it once, and the fsync of the
 * commit would not see it again.  Filesystems without it (EINVAL, ENOSYS,
 * ESPIPE) write as before. */
static int write_behind(struct aoqd_snapfile *f, uint64_t off, uint64_t len)
{
	if (f->wb_unsupported)
		return 0;
	int r = sync_file_range(f->fd, (off64_t)off, (off64_t)len,
	                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
	if (r == 0) {
		posix_fadvise(f->fd, (off_t)off, (off_t)len, POSIX_FADV_DONTNEED);
	} else {
		if (errno == EINVAL || errno == ENOSYS || errno == ESPIPE || errno == EOPNOTSUPP) {
			f->wb_unsupported = true;
			return 0;
		}
		return -errno;
	}
	return 0;
}

int aoqd_snapfile_put(struct aoqd_snapfile *f, uint32_t i, const struct aoqk_state *a, struct aoqd_error *err)
{
	if (i >= f->n)
		return AOQD_REFUSE(err, INTERNAL, "snapshot: tensor %u of %u", i, f->n);
	uint64_t base = 8 + f->hlen;
	for (int k = 0; k < A_N; k++) {
		struct arr *x = &f->arrs[i][k];
		if (!x->present || x->written)
			continue;
		const void *p = arr_ptr(a, k);
		if (!p)
			return AOQD_REFUSE(err, INTERNAL, "snapshot: tensor %u has no %s", i, arr_suffix[k]);
		/* chunk by chunk: the checksum and the write of each in one
		 * go (the chunk still in the cache for the write), paced by
		 * f->before */
		uint32_t crc = (uint32_t)crc32(0, Z_NULL, 0);
		for (uint64_t at = 0; at < x->len;) {
			uint64_t n = x->len - at < f->chunk ? x->len - at : f->chunk;
			if (f->before)
				f->before(f->before_arg, n);
			const uint8_t *q = (const uint8_t *)p + at;
			crc = crc_update(crc, q, n);
			int r = pwrite_all(f->fd, q, n, base + x->off + at);
			if (r == 0)
				r = write_behind(f, base + x->off + at, n);
			if (r < 0)
				return AOQD_REFUSE(err, INTERNAL, "snapshot: writing %s: %s", f->tmp, strerror(-r));
			at += n;
		}
		x->crc = crc;
		x->written = true;
	}
	f->put++;
	return 0;
}

struct arr_ref {
	uint64_t off;
	const struct arr *a;
};

static int cmp_off(const void *x, const void *y)
{
	uint64_t a = ((const struct arr_ref *)x)->off, b = ((const struct arr_ref *)y)->off;
	return a < b ? -1 : a > b;
}

int aoqd_snapfile_commit(struct aoqd_snapfile *f, char *path, size_t len, struct aoqd_error *err)
{
	/* the data's CRC: every array's, combined in file order (the layout
	 * is contiguous, so order by offset is enough) */
	size_t na = 0;
	for (uint32_t i = 0; i < f->n; i++)
		for (int k = 0; k < A_N; k++)
			if (f->arrs[i][k].present) {
				if (!f->arrs[i][k].written)
					return AOQD_REFUSE(err, INTERNAL, "snapshot: tensor %u not written", i);
				na++;
			}
	struct arr_ref *refs = calloc(na ? na : 1, sizeof(*refs));
	if (!refs)
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	na = 0;
	for (uint32_t i = 0; i < f->n; i++)
		for (int k = 0; k < A_N; k++)
			if (f->arrs[i][k].present)
				refs[na++] = (struct arr_ref){ f->arrs[i][k].off, &f->arrs[i][k] };
	qsort(refs, na, sizeof(*refs), cmp_off);
	uint32_t crc = (uint32_t)crc32(0, Z_NULL, 0);
	for (size_t k = 0; k < na; k++)
		crc = (uint32_t)crc32_combine(crc, refs[k].a->crc, (z_off_t)refs[k].a->len);
	free(refs);
	char hex[9];
	snprintf(hex, sizeof(hex), "%08x", crc);
	memcpy(f->header + f->csum_pos, hex, 8);
	int r = pwrite_all(f->fd, f->header + f->csum_pos, 8, 8 + f->csum_pos);
	if (r == 0 && fsync(f->fd) < 0)
		r = -errno;
	if (r < 0)
		return AOQD_REFUSE(err, INTERNAL, "snapshot: writing %s: %s", f->tmp, strerror(-r));
	if (snprintf(path, len, "%s/%s", f->dir, f->name) >= (int)len)
		return AOQD_REFUSE(err, INVALID, "snapshot: path too long");
	if (rename(f->tmp, path) < 0)
		return AOQD_REFUSE(err, INTERNAL, "snapshot: rename %s to %s: %s", f->tmp, path, strerror(errno));
	free(f->tmp);
	f->tmp = NULL;
	close(f->fd);
	f->fd = -1;
	int d = open(f->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (d < 0 || fsync(d) < 0) {
		int e = errno;
		if (d >= 0)
			close(d);
		return AOQD_REFUSE(err, INTERNAL, "snapshot: fsync of %s: %s", f->dir, strerror(e));
	}
	close(d);
	return 0;
}

int aoqd_snapshot_write(const char *dir, const struct aoqd_snap_key *key, uint64_t step,
                        const struct aoqd_state *st, char *path, size_t len, struct aoqd_error *err)
{
	struct aoqd_snapfile *f = aoqd_snapfile_prepare(key, step, st, NULL);
	if (!f)
		return AOQD_REFUSE(err, NO_MEMORY, "snapshot: header: %s", strerror(errno));
	int r = aoqd_snapfile_open(f, dir, err);
	for (uint32_t i = 0; r == 0 && i < st->ntensors; i++)
		r = aoqd_snapfile_put(f, i, &st->tensors[i].st, err);
	if (r == 0)
		r = aoqd_snapfile_commit(f, path, len, err);
	aoqd_snapfile_free(f);
	return r;
}

/* ---- loading (hostile input) ---- */

#define FAIL(...) do { snprintf(why, wlen, __VA_ARGS__); r = -EINVAL; goto out; } while (0)

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

static int read_all(int fd, void *p, uint64_t n, uint64_t off)
{
	uint8_t *b = p;
	while (n) {
		size_t k = n > (1u << 30) ? (1u << 30) : (size_t)n;
		ssize_t g = pread(fd, b, k, (off_t)off);
		if (g < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		if (g == 0)
			return -EIO;
		b += g;
		off += (uint64_t)g;
		n -= (uint64_t)g;
	}
	return 0;
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

int aoqd_snapshot_load(const char *path, int lock_memory, _Atomic uint64_t *locked_total, struct aoqd_snap_key *key,
                       uint64_t *step, struct aoqd_state *st, char *why, size_t wlen)
{
	int r = 0;
	char *hdr = NULL;
	json_object *root = NULL, *groups = NULL, *tens = NULL;
	struct load_arr *la = NULL;
	bool allocated = false;
	memset(st, 0, sizeof(*st));
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		snprintf(why, wlen, "%s: %s", path, strerror(errno));
		return -errno;
	}
	struct stat sb;
	if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode))
		FAIL("%s: not a regular file", path);
	uint64_t fsize = (uint64_t)sb.st_size;
	uint8_t lb[8];
	if (fsize < 8 || read_all(fd, lb, 8, 0) < 0)
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
	if (read_all(fd, hdr, hlen, 8) < 0)
		FAIL("%s: cannot read the header", path);
	hdr[hlen] = 0;
	if (strlen(hdr) != hlen)
		FAIL("%s: NUL byte in the header", path);
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
	json_object_object_foreach(meta, mk, mv) {
		(void)mk;
		if (!json_object_is_type(mv, json_type_string))
			FAIL("%s: metadata %s is not a string", path, mk);
	}
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
	int prec = word(meta_str(meta, "precision"), prec_names, 5);
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
	st->max_grad_norm = maxnorm;
	st->defer = st->skip_nonfinite || maxnorm > 0;
	st->options_set = true;
	/* groups */
	const char *gs = meta_str(meta, "groups"), *ts = meta_str(meta, "tensors");
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
		                   ? word(json_object_get_string(kv), kind_names, 4) : -1;
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
			FAIL("%s: group %zu: %s does not run in precision %s", path, g, kind_names[kind], prec_names[prec]);
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
		int pdt = json_object_object_get_ex(o, "param_dtype", &pd) ? word(json_object_get_string(pd), dtype_names, 3) : -1;
		int gdt = json_object_object_get_ex(o, "grad_dtype", &gd) ? word(json_object_get_string(gd), dtype_names, 3) : -1;
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
			if (!arr_info((enum aoqk_precision)prec, numel, moments, k, &dt, &elems, &esize))
				continue;
			char kname[4200];
			snprintf(kname, sizeof(kname), "%s.%s", pre, arr_suffix[k]);
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
		void *dst = (void *)arr_ptr(&st->tensors[la[k].t].st, la[k].k);
		uint64_t n = la[k].e - la[k].b;
		if (read_all(fd, dst, n, 8 + hlen + la[k].b) < 0)
			FAIL("%s: cannot read the data", path);
		crc = crc_update(crc, dst, n);
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
	free(hdr);
	close(fd);
	return r;
}
#undef FAIL

int aoqd_snapshot_restore_all(const char *dir, int lock_memory, _Atomic uint64_t *locked_total,
                              aoqd_snapshot_restore_fn fn, void *arg)
{
	DIR *d = opendir(dir);
	if (!d)
		return -errno;
	int taken = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		size_t l = strlen(e->d_name), sl = strlen(AOQD_SNAPSHOT_SUFFIX);
		if (e->d_name[0] == '.' || l <= sl || strcmp(e->d_name + l - sl, AOQD_SNAPSHOT_SUFFIX) != 0)
			continue;
		char path[PATH_MAX], why[512];
		if (snprintf(path, sizeof(path), "%s/%s", dir, e->d_name) >= (int)sizeof(path))
			continue;
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
		if (fn(&key, step, st, arg) < 0) {
			aoqd_state_free(st, locked_total);
			free(st);
			continue;
		}
		aoqd_info("snapshot", "restored uid %u job '%s' rank %u at step %" PRIu64 " from %s", key.uid, key.job,
		          key.rank, step, path);
		taken++;
	}
	closedir(d);
	return taken;
}

/* ---- the capture ---- */

enum { T_PENDING, T_COPYING, T_DONE };

/* The capture copies a tensor in blocks of this many elements (a multiple
 * of AOQK_Q8_BLOCK), each before its first update after the boundary: the
 * workers that update a block copy it, in parallel, and only what they
 * touch; a whole tensor at a time made every other worker wait for one
 * copy of it (0.8-0.96 s added to the first step after a request at 64 Mi
 * parameters in 16 tensors on the H200 host). */
#define CAPTURE_BLOCK (1u << 18)

/*
 * The undo swap.  A session that may be leased keeps an undo copy of its
 * state (state.h): before its first update in a step, every range of the
 * state is saved there, on its own pages after the state's.  So when the
 * step after the boundary ends, the undo copy holds the state at the
 * boundary for every range that step updated.  Such a capture copies
 * nothing while training goes on: at that step's end (the loop thread,
 * nothing in flight, the next step's records held) it moves the undo
 * copy's pages out to the capture (mremap: page tables, no data), maps
 * fresh pages in their place for the next step's saves, and copies from
 * the live state only the ranges that step did not update (none when every
 * tensor took the whole step); then the writer writes.  Without an undo
 * copy the capture copies blocks (above).
 */

struct aoqd_capture {
	pthread_mutex_t lock;   /* ts[], and snap_after's changes */
	pthread_cond_t cond;    /* a block's copy is done */
	struct aoqd_state *st;
	struct aoqd_snapshotter *w;
	uint32_t n;
	uint64_t nblocks;
	uint64_t *first;        /* per tensor: its first block's index in ts[] */
	uint8_t *ts;            /* per block: T_* */
	void **copy;            /* per tensor: a copy of its state mapping (mapped at arm) */
	size_t *copy_len;       /* per tensor: its length */
	bool swap;              /* the undo swap (above) */
	bool swap_wait;         /* undo swap: at the boundary, waits for the next step's end */
	unsigned idle_ticks;    /* swap_wait: sampler ticks the session was idle at (aoqd_snapshot_tick) */
	bool swapped;           /* copy[] holds moved undo pages: kept as spares after the write */
	/* Per tensor: the pages of the last undo swap's capture, kept after
	 * its write to be the next swap's fresh undo pages (MADV_FREE: the
	 * kernel may take them back under pressure).  Fresh anonymous pages
	 * cost a first touch on the step path (a page fault and zeroing, far
	 * dearer in a VM); these were touched already.  Loop thread; freed
	 * with the state. */
	void **spare;
	size_t *spare_len;
	/* aoqd_snapshot_prepare: the writer is touching the spares (loop
	 * thread; the writer owns spare[] meanwhile), its stop and outcome */
	bool prep;
	_Atomic bool prep_cancel;
	int prep_result;
	aoqd_snapshot_prep_fn prep_fn;
	void *prep_arg;
	uint64_t *steps;        /* per tensor: steps at the boundary */
	/* for Stats: array bytes the writer has passed to the file (writer
	 * thread), of data_bytes (set when the file is prepared) */
	_Atomic uint64_t written;
	uint64_t data_bytes;
	uint64_t boundary;
	bool armed, ready;      /* loop thread */
	struct aoqd_snapfile *file;
	char *dir;
	struct aoqd_snap_key key;
	aoqd_snapshot_done_fn done;
	void *arg;
	int result;
	char why[512];
	char path[PATH_MAX];
	struct aoqd_capture *next; /* the writer's queue, then its done list */
};

struct aoqd_snapshotter {
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct aoqd_capture *queue, **qtail;
	struct aoqd_capture *done_list;
	bool busy, stop;
	uv_async_t async;
	bool pinned;
	cpu_set_t cpus;
	struct aoqd_pool *pool;   /* whose idle times the writes wait for (NULL: none) */
	struct aoqd_snap_pace pace; /* under lock */
	_Atomic bool hurry;       /* stopping: the write in progress goes on without waiting */
	_Atomic uint64_t chunks, forced, waited_ns; /* aoqd_snapshotter_pace_stats */
	_Atomic uint64_t overlap_ns;                /* writer time beside updates (pacer) */
};

/* Takes block k of tensor i unless it is taken (with c->lock held; may
 * wait for a copy in progress): true when the caller copies it. */
static bool block_take(struct aoqd_capture *c, uint64_t k)
{
	while (c->ts[k] == T_COPYING)
		pthread_cond_wait(&c->cond, &c->lock);
	if (c->ts[k] == T_DONE)
		return false;
	c->ts[k] = T_COPYING;
	return true;
}

/* Copies block b of tensor i (called with c->lock not held), then marks it
 * done. */
static void block_copy(struct aoqd_capture *c, uint32_t i, uint64_t b)
{
	const struct aoqd_tensor *t = &c->st->tensors[i];
	uint64_t e = b * CAPTURE_BLOCK;
	uint64_t n = t->numel - e < CAPTURE_BLOCK ? t->numel - e : CAPTURE_BLOCK;
	aoqd_state_copy_out(t, e, n, c->copy[i]);
	pthread_mutex_lock(&c->lock);
	c->ts[c->first[i] + b] = T_DONE;
	pthread_cond_broadcast(&c->cond);
	pthread_mutex_unlock(&c->lock);
}

void aoqd_snapshot_capture(struct aoqd_state *st, uint32_t i, uint64_t step, uint64_t begin, uint64_t count)
{
	struct aoqd_capture *c = st->snap;
	if (count == 0)
		return;
	uint64_t b0 = begin / CAPTURE_BLOCK, b1 = (begin + count - 1) / CAPTURE_BLOCK;
	for (uint64_t b = b0; b <= b1; b++) {
		pthread_mutex_lock(&c->lock);
		uint64_t after = atomic_load_explicit(&st->snap_after, memory_order_relaxed);
		bool mine = after && step >= after && i < c->n && c->first[i] + b < c->first[i + 1] &&
		            block_take(c, c->first[i] + b);
		pthread_mutex_unlock(&c->lock);
		if (mine)
			block_copy(c, i, b);
	}
}

/* Ends the guards: no update waits for this capture any more; waits for
 * copies in progress. */
static void capture_disarm(struct aoqd_capture *c)
{
	pthread_mutex_lock(&c->lock);
	atomic_store_explicit(&c->st->snap_after, 0, memory_order_release);
	for (uint64_t k = 0; k < c->nblocks; k++)
		while (c->ts[k] == T_COPYING)
			pthread_cond_wait(&c->cond, &c->lock);
	pthread_mutex_unlock(&c->lock);
}

static void capture_release(struct aoqd_capture *c)
{
	for (uint32_t i = 0; c->copy && i < c->n; i++)
		if (c->copy[i])
			munmap(c->copy[i], c->copy_len[i]);
	free(c->copy);
	free(c->copy_len);
	c->copy_len = NULL;
	c->swap = c->swap_wait = c->swapped = false;
	free(c->ts);
	free(c->first);
	free(c->steps);
	free(c->dir);
	aoqd_snapfile_free(c->file);
	c->copy = NULL;
	c->ts = NULL;
	c->first = NULL;
	c->nblocks = 0;
	c->steps = NULL;
	c->dir = NULL;
	c->file = NULL;
	c->n = 0;
}

/* The spare table for n tensors, if there is none. */
static bool spares_alloc(struct aoqd_capture *c, uint32_t n)
{
	if (c->spare)
		return true;
	c->spare = calloc(n ? n : 1, sizeof(void *));
	c->spare_len = calloc(n ? n : 1, sizeof(size_t));
	if (c->spare && c->spare_len)
		return true;
	free(c->spare);
	free(c->spare_len);
	c->spare = NULL;
	c->spare_len = NULL;
	return false;
}

/* The swap's copies become the spares (loop thread; the writer is done with
 * them). */
static void keep_spares(struct aoqd_capture *c)
{
	if (!spares_alloc(c, c->n))
		return;
	for (uint32_t i = 0; i < c->n; i++) {
		if (!c->copy[i])
			continue;
		if (c->spare[i])
			munmap(c->spare[i], c->spare_len[i]);
		c->spare[i] = c->copy[i];
		c->spare_len[i] = c->copy_len[i];
		c->copy[i] = NULL;
	}
}

/* Loop thread: hands the outcome to its owner; the capture may be armed
 * again from then on. */
static void capture_finish(struct aoqd_capture *c)
{
	aoqd_snapshot_done_fn done = c->done;
	void *arg = c->arg;
	int r = c->result;
	char path[PATH_MAX], why[512];
	snprintf(path, sizeof(path), "%s", c->path);
	snprintf(why, sizeof(why), "%s", c->why);
	if (c->swapped)
		keep_spares(c);
	capture_release(c);
	c->armed = c->ready = false;
	done(arg, r, path, why); /* may free the state, and c with it */
}

/* The block copies (no undo swap): the block table, and each tensor's copy
 * mapped now (pages come as blocks are copied), so that no update finds it
 * missing.  0 or -ENOMEM (what was mapped stays for capture_release). */
static int capture_blocks(struct aoqd_capture *c)
{
	const struct aoqd_state *st = c->st;
	c->first[0] = 0;
	for (uint32_t i = 0; i < c->n; i++)
		c->first[i + 1] = c->first[i] + (st->tensors[i].numel + CAPTURE_BLOCK - 1) / CAPTURE_BLOCK;
	c->nblocks = c->first[c->n];
	free(c->ts);
	c->ts = calloc(c->nblocks ? c->nblocks : 1, 1);
	if (!c->ts) {
		c->nblocks = 0;
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < c->n; i++) {
		size_t len = st->tensors[i].state_len;
		void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			return -ENOMEM;
		/* Huge pages: the workers fault the copy in during the first
		 * step after the boundary, 4 KiB faults from 15 threads at once
		 * were most of that step's added time. */
		if (len >= (2u << 20))
			madvise(p, len, MADV_HUGEPAGE);
		c->copy[i] = p;
		c->copy_len[i] = len;
	}
	return 0;
}

/* The state's capture, made on first use (NULL: no memory). */
static struct aoqd_capture *capture_get(struct aoqd_state *st)
{
	if (!st->snap) {
		struct aoqd_capture *c = calloc(1, sizeof(*c));
		if (!c)
			return NULL;
		pthread_mutex_init(&c->lock, NULL);
		pthread_cond_init(&c->cond, NULL);
		c->st = st;
		st->snap = c;
	}
	return st->snap;
}

/* Whether a capture of st can be an undo swap: every tensor has its undo
 * copy on pages of its own. */
static bool swap_possible(const struct aoqd_state *st)
{
	long page = sysconf(_SC_PAGESIZE);
	bool swap = st->undo && st->ntensors > 0;
	for (uint32_t i = 0; i < st->ntensors && swap; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		swap = t->undo_off && t->undo_off % (uint64_t)page == 0 && t->state_len > t->undo_off;
	}
	return swap;
}

int aoqd_snapshot_arm(struct aoqd_snapshotter *w, struct aoqd_state *st, const struct aoqd_snap_key *key,
                      const char *dir, uint64_t boundary, bool ready, aoqd_snapshot_done_fn done, void *arg,
                      struct aoqd_error *err)
{
	if (!dir || !*dir)
		return AOQD_REFUSE(err, INVALID, "snapshots are off (no state_dir)");
	struct aoqd_capture *c = capture_get(st);
	if (!c)
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	if (c->armed || c->prep)
		return AOQD_REFUSE(err, BUSY, "a snapshot of this session is being taken");
	uint32_t n = st->ntensors;
	c->first = calloc((size_t)n + 1, sizeof(uint64_t));
	c->copy = calloc(n ? n : 1, sizeof(void *));
	c->copy_len = calloc(n ? n : 1, sizeof(size_t));
	c->steps = calloc(n ? n : 1, sizeof(uint64_t));
	c->dir = strdup(dir);
	if (!c->first || !c->copy || !c->copy_len || !c->steps || !c->dir) {
		capture_release(c);
		return AOQD_REFUSE(err, NO_MEMORY, "out of memory");
	}
	c->n = n;
	c->swap = swap_possible(st);
	if (!c->swap && capture_blocks(c) < 0) {
		capture_release(c);
		return AOQD_REFUSE(err, NO_MEMORY, "snapshot: no memory for a copy of the state");
	}
	c->w = w;
	c->boundary = boundary;
	c->key = *key;
	c->done = done;
	c->arg = arg;
	c->result = 0;
	c->why[0] = c->path[0] = 0;
	c->armed = true;
	c->ready = false;
	c->swap_wait = false;
	c->idle_ticks = 0;
	/* The undo swap needs no guard: UINT64_MAX only keeps loads and step
	 * changes out (aoqd_snapshot_capturing) until the swap. */
	atomic_store_explicit(&st->snap_after, c->swap ? UINT64_MAX : boundary + 1, memory_order_release);
	if (ready)
		aoqd_snapshot_ready(st, boundary);
	return 0;
}

static void capture_fail_now(struct aoqd_capture *c, int r, const char *why)
{
	capture_disarm(c);
	c->result = r;
	snprintf(c->why, sizeof(c->why), "%s", why);
	capture_finish(c);
}

/* Moves tensor i's undo copy out to the capture and maps fresh pages in its
 * place (the undo swap; loop thread, nothing in flight).  If the move
 * fails, copies it instead. */
static int undo_take(struct aoqd_capture *c, uint32_t i)
{
	struct aoqd_tensor *t = &c->st->tensors[i];
	size_t len = t->state_len - t->undo_off;
	uint8_t *undo = (uint8_t *)t->state_mem + t->undo_off;
	void *dst = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (dst == MAP_FAILED)
		return -errno;
	void *out = mremap(undo, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, dst);
	void *in = MAP_FAILED;
	if (out != MAP_FAILED && c->spare && c->spare[i] && c->spare_len[i] == len) {
		in = mremap(c->spare[i], len, len, MREMAP_MAYMOVE | MREMAP_FIXED, undo);
		if (in != MAP_FAILED)
			c->spare[i] = NULL;
	}
	if (out != MAP_FAILED && in == MAP_FAILED) {
		in = mmap(undo, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
		if (in == MAP_FAILED && mremap(out, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, undo) == MAP_FAILED) {
			/* the state has a hole where its undo copy was: cannot
			 * be (the range was just freed); the session must not go on */
			aoqd_err("snapshot", "undo swap: cannot put the undo copy back: %s", strerror(errno));
			abort();
		}
	}
	if (in == MAP_FAILED) {
		/* the copy, then (on this thread: a stall, but a snapshot) */
		if (out == MAP_FAILED)
			munmap(dst, len);
		dst = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (dst == MAP_FAILED)
			return -errno;
		memcpy(dst, undo, len);
		c->copy[i] = dst;
		c->copy_len[i] = len;
		return 0;
	}
	if (len >= (2u << 20))
		madvise(undo, len, MADV_HUGEPAGE);
	if (t->locked) {
		/* the moved pages stay locked: unlocked, and the new ones
		 * locked as they fault (the locked total does not change) */
		munlock(out, len);
		if (mlock2(undo, len, MLOCK_ONFAULT) != 0) {
			static bool warned;
			if (!warned)
				aoqd_warn("snapshot", "undo swap: cannot lock the new undo pages (%s): they run unlocked",
				          strerror(errno));
			warned = true;
		}
	}
	c->copy[i] = out; /* laid out as the state mapping (state.c, range_copy) */
	c->copy_len[i] = len;
	c->swapped = true;
	return 0;
}

/* The undo swap at the end of the step after the boundary: every tensor's
 * undo copy becomes its capture, and the ranges that step did not update
 * (still at the boundary's values in the live state) are copied in.
 * 0, or -errno with why set. */
static int undo_swap(struct aoqd_capture *c, uint64_t step, char *why, size_t len)
{
	struct aoqd_state *st = c->st;
	for (uint32_t i = 0; i < c->n; i++) {
		struct aoqd_tensor *t = &st->tensors[i];
		int r = undo_take(c, i);
		if (r < 0) {
			snprintf(why, len, "undo swap: tensor %u: %s", i, strerror(-r));
			return r;
		}
		/* the ranges of tensor i that step did not update */
		uint64_t b = 0;
		bool updated = t->cur_step == step;
		for (uint32_t k = 0; updated && k < t->ndone; k++) {
			if (t->done[k].b > b)
				aoqd_state_copy_out(t, b, t->done[k].b - b, c->copy[i]);
			b = t->done[k].e;
		}
		if (b < t->numel)
			aoqd_state_copy_out(t, b, t->numel - b, c->copy[i]);
	}
	return 0;
}

static void capture_enqueue(struct aoqd_capture *c)
{
	struct aoqd_snapshotter *w = c->w;
	pthread_mutex_lock(&w->lock);
	c->next = NULL;
	*w->qtail = c;
	w->qtail = &c->next;
	pthread_cond_signal(&w->cond);
	pthread_mutex_unlock(&w->lock);
}

void aoqd_snapshot_ready(struct aoqd_state *st, uint64_t step_ended)
{
	struct aoqd_capture *c = st->snap;
	if (c && c->armed && c->swap_wait && step_ended > c->boundary) {
		char why[256];
		int r = undo_swap(c, c->boundary + 1, why, sizeof(why));
		c->swap_wait = false;
		if (r < 0) {
			capture_fail_now(c, r, why);
			return;
		}
		atomic_store_explicit(&st->snap_after, 0, memory_order_release);
		aoqd_debug("snapshot", "'%s' rank %u: step %" PRIu64 "'s undo copy taken as the snapshot at step %" PRIu64,
		           c->key.job, c->key.rank, c->boundary + 1, c->boundary);
		capture_enqueue(c);
		return;
	}
	if (!c || !c->armed || c->ready || step_ended < c->boundary)
		return;
	c->ready = true;
	/* A tensor whose first record of the next step came already counted
	 * that step (dataplane.c, accept_record): one less at the boundary. */
	for (uint32_t i = 0; i < c->n; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		c->steps[i] = t->cur_step > c->boundary && t->steps ? t->steps - 1 : t->steps;
	}
	c->file = aoqd_snapfile_prepare(&c->key, c->boundary, st, c->steps);
	atomic_store(&c->written, 0);
	c->data_bytes = c->file ? c->file->data_len : 0;
	if (!c->file) {
		char why[128];
		snprintf(why, sizeof(why), "snapshot header: %s", strerror(errno));
		capture_fail_now(c, -errno, why);
		return;
	}
	if (c->swap) {
		c->swap_wait = true; /* until the next step's end */
		return;
	}
	capture_enqueue(c);
}

void aoqd_snapshot_tick(struct aoqd_state *st, bool idle)
{
	struct aoqd_capture *c = st->snap;
	if (!c || !c->armed || !c->swap_wait)
		return;
	if (!idle) {
		c->idle_ticks = 0;
		return;
	}
	if (++c->idle_ticks < 3)
		return;
	/* Idle at three ticks in a row (2-3 s: longer than a forward pass),
	 * the step the swap waits for has not begun: the state is still the
	 * boundary's, and the blocks are copied instead (as without an undo
	 * copy). */
	if (capture_blocks(c) < 0) {
		capture_fail_now(c, -ENOMEM, "snapshot: no memory for a copy of the state");
		return;
	}
	c->swap = c->swap_wait = false;
	atomic_store_explicit(&st->snap_after, c->boundary + 1, memory_order_release);
	aoqd_debug("snapshot", "'%s' rank %u: idle after step %" PRIu64 ": the snapshot copies the state", c->key.job,
	           c->key.rank, c->boundary);
	capture_enqueue(c);
}

/* Boundary of st's capture waiting to be ready, or UINT64_MAX. */
static uint64_t pending_boundary(const struct aoqd_state *st)
{
	const struct aoqd_capture *c = st->snap;
	if (!c || !c->armed)
		return UINT64_MAX;
	return c->swap_wait ? c->boundary + 1 : !c->ready ? c->boundary : UINT64_MAX;
}

void aoqd_snapshot_cancel(struct aoqd_state *st, const char *gone)
{
	struct aoqd_capture *c = st->snap;
	if (c && c->prep) {
		snprintf(c->why, sizeof(c->why), "%s before its snapshot began", gone);
		atomic_store(&c->prep_cancel, true); /* prep_fn follows */
		return;
	}
	uint64_t boundary = pending_boundary(st);
	if (boundary == UINT64_MAX)
		return; /* none, or writing already */
	char why[sizeof(c->why)];
	snprintf(why, sizeof(why), "%s before step %" PRIu64 " ended", gone, boundary);
	capture_fail_now(c, -ECANCELED, why);
}

bool aoqd_snapshot_busy(const struct aoqd_state *st)
{
	return st->snap && (st->snap->armed || st->snap->prep);
}

const char *aoqd_snapshot_phase(const struct aoqd_state *st, uint64_t *written, uint64_t *total)
{
	const struct aoqd_capture *c = st->snap;
	*written = *total = 0;
	if (!c || (!c->prep && !c->armed))
		return "";
	if (c->prep)
		return "preparing";
	if (!c->ready || c->swap_wait)
		return "armed";
	*written = atomic_load_explicit(&c->written, memory_order_relaxed);
	*total = c->data_bytes;
	return "writing";
}

int aoqd_snapshot_prepare(struct aoqd_snapshotter *w, struct aoqd_state *st, aoqd_snapshot_prep_fn fn, void *arg)
{
	if (!swap_possible(st))
		return 0;
	struct aoqd_capture *c = capture_get(st);
	if (!c || !spares_alloc(c, st->ntensors))
		return -ENOMEM;
	if (c->armed || c->prep)
		return -EBUSY;
	bool missing = false;
	for (uint32_t i = 0; i < st->ntensors && !missing; i++)
		missing = !c->spare[i] || c->spare_len[i] != st->tensors[i].state_len - st->tensors[i].undo_off;
	if (!missing)
		return 0;
	c->w = w;
	c->prep = true;
	atomic_store(&c->prep_cancel, false);
	c->prep_result = 0;
	c->why[0] = 0;
	c->prep_fn = fn;
	c->prep_arg = arg;
	capture_enqueue(c);
	return 1;
}

void aoqd_snapshot_state_free(struct aoqd_state *st)
{
	struct aoqd_capture *c = st->snap;
	if (!c)
		return;
	capture_release(c);
	for (uint32_t i = 0; c->spare && i < st->ntensors; i++)
		if (c->spare[i])
			munmap(c->spare[i], c->spare_len[i]);
	free(c->spare);
	free(c->spare_len);
	pthread_mutex_destroy(&c->lock);
	pthread_cond_destroy(&c->cond);
	free(c);
	st->snap = NULL;
}

/* ---- the writer thread ---- */

/*
 * Pacing (docs/snapshots.md, "Writing"): the writer writes the file in
 * chunks (AOQD_SNAPSHOT_CHUNK) and before each waits until no update is
 * queued or running in the worker pool: in training the workers are idle
 * during the forward pass and between steps, and the checksum, the copy
 * into the page cache and the writeback then take no memory bandwidth or
 * core from an update.  So that a trainer that keeps the workers busy all
 * the time cannot hold a snapshot back for ever, the wait ends at the time
 * a minimum rate says the chunk is due: chunk k (B bytes before it) is
 * written at the latest slack + B / min_rate after the write began, busy
 * workers or not.  Time written in idle windows counts towards that
 * schedule: a writer ahead of it never writes while the workers run.
 */

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

struct pacer {
	struct aoqd_snapshotter *w;
	struct aoqd_snap_pace cfg;
	uint64_t start_ns, bytes;       /* bytes: before the chunk to come */
	uint64_t started;               /* the pool's tasks started when it was last seen idle */
	uint64_t chunks, forced, waited_ns;
	uint64_t gapped; /* due chunks written in a step's idle gap (no task running) */
	_Atomic uint64_t *progress; /* when set: bytes before the chunk to come, for Stats */
	/* Exposure: chunks during which an update ran (the pool was busy when
	 * the chunk began, or a task started before it ended) and their time:
	 * what the writer did beside the workers, measured, not estimated. */
	uint64_t chunk_t0, chunk_started;
	bool chunk_busy;
	uint64_t overlapped, overlap_ns;
};

/* When the next chunk is due at the latest (the minimum rate). */
static uint64_t pace_due(const struct pacer *p)
{
	return p->start_ns + p->cfg.slack_ns +
	       (uint64_t)((double)p->bytes / (double)(p->cfg.min_rate ? p->cfg.min_rate : 1) * 1e9);
}

/* The chunk before now (if any) was written beside an update? */
static void pace_account(struct pacer *p)
{
	if (!p->w->pool || !p->chunk_t0)
		return;
	uint64_t started;
	aoqd_pool_wait_idle(p->w->pool, 0, &started);
	if (p->chunk_busy || started != p->chunk_started) {
		p->overlapped++;
		p->overlap_ns += mono_ns() - p->chunk_t0;
	}
	p->chunk_t0 = 0;
}

/* Waits for idle workers or the due time (pace_chunk); returns whether
 * the pool is busy as the caller goes on. */
static bool pace_wait(struct pacer *p, uint64_t due)
{
	struct aoqd_snapshotter *w = p->w;
	uint64_t t0 = mono_ns();
	bool busy = false;
	for (uint64_t t = t0;; t = mono_ns()) {
		if (atomic_load_explicit(&w->hurry, memory_order_relaxed)) {
			busy = !aoqd_pool_idle(w->pool);
			break;
		}
		uint64_t left = due > t ? due - t : 0, started;
		bool idle = aoqd_pool_wait_idle(w->pool, left < 50000000u ? left : 50000000u, &started);
		if (idle && (started == p->started || left == 0)) {
			p->started = started;
			break;
		}
		if (idle) { /* newly idle: settles */
			p->started = started;
			uint64_t ns = left < p->cfg.settle_ns ? left : p->cfg.settle_ns;
			struct timespec ts = { (time_t)(ns / 1000000000u), (long)(ns % 1000000000u) };
			nanosleep(&ts, NULL);
			continue;
		}
		if (left == 0) {
			/* Due while a step is open or a task runs: a step's
			 * idle gap (the workers waiting for the trainer's next
			 * gradient) costs the trainer less than a chunk beside
			 * running updates; wait a little for one, up to a
			 * fixed time past the due time (so the minimum rate
			 * holds, 20 ms late at most). */
			uint64_t until = due + AOQD_SNAPSHOT_GAP_WAIT_MS * 1000000ull, now = mono_ns();
			bool gap = aoqd_pool_wait_gap(w->pool, until > now ? until - now : 0);
			if (gap) {
				p->gapped++;
			} else {
				p->forced++;
				atomic_fetch_add(&w->forced, 1);
			}
			busy = true;
			break;
		}
	}
	p->waited_ns += mono_ns() - t0;
	return busy;
}

/* Before work of the writer's that is not a chunk of the file (releasing a
 * written copy's pages: page-table work and TLB shootdowns that would
 * interrupt every core running aoqd's threads): idle workers too, up to
 * the next chunk's due time. */
static void pace_idle(struct pacer *p)
{
	if (!p->w->pool)
		return;
	pace_account(p);
	pace_wait(p, pace_due(p));
}

/* aoqd_snapfile_pace's callback: waits for idle workers (a newly idle pool
 * after settle_ns with no task started: AOQD_SNAPSHOT_SETTLE_US) or the
 * chunk's due time ("Pacing"), whichever comes first; at once when aoqd is
 * stopping.  Chunks follow each other at once while no task starts in
 * between.  Waits in slices of 50 ms at most, to notice the stop. */
static void pace_chunk(void *arg, uint64_t bytes)
{
	struct pacer *p = arg;
	struct aoqd_snapshotter *w = p->w;
	uint64_t due = pace_due(p);
	if (p->progress)
		atomic_store_explicit(p->progress, p->bytes, memory_order_relaxed);
	p->bytes += bytes;
	p->chunks++;
	if (w->pool) {
		pace_account(p);
		p->chunk_busy = pace_wait(p, due);
		p->chunk_started = p->started; /* the count when last seen idle */
		p->chunk_t0 = mono_ns();
	}
	atomic_fetch_add(&w->chunks, 1);
}

/* Writer thread: copies every tensor, lets updates go, then writes the
 * copies.  It copies in registration order, the reverse of the order the
 * next step's gradients come (backward, last tensor first): the workers
 * copy the first tensors they need themselves and the writer works from
 * the other end, so neither waits for the other until they meet (in the
 * same order, a worker would keep waiting for the tensor the writer holds,
 * and a starved writer stalls the step). */
static void capture_write(struct aoqd_capture *c)
{
	struct aoqd_error err;
	struct aoqd_state *st = c->st;
	for (uint32_t i = 0; i < c->n; i++) {
		for (uint64_t b = 0; c->first[i] + b < c->first[i + 1]; b++) {
			pthread_mutex_lock(&c->lock);
			bool mine = block_take(c, c->first[i] + b);
			pthread_mutex_unlock(&c->lock);
			if (mine)
				block_copy(c, i, b);
		}
	}
	capture_disarm(c);
	struct pacer pace = { .w = c->w, .started = UINT64_MAX, .progress = &c->written };
	pthread_mutex_lock(&c->w->lock);
	pace.cfg = c->w->pace;
	pthread_mutex_unlock(&c->w->lock);
	pace.start_ns = mono_ns();
	aoqd_snapfile_pace(c->file, pace.cfg.chunk, pace_chunk, &pace);
	int r = aoqd_snapfile_open(c->file, c->dir, &err);
	for (uint32_t i = 0; r == 0 && i < c->n; i++) {
		const struct aoqd_tensor *t = &st->tensors[i];
		uint8_t *base = c->copy[i];
		const uint8_t *mem = t->state_mem;
#define REBASE(p) ((p) ? (void *)(base + ((const uint8_t *)(p) - mem)) : NULL)
		struct aoqk_state a = t->st;
		a.master = REBASE(t->st.master);
		a.m = REBASE(t->st.m);
		a.v = REBASE(t->st.v);
		a.m_scale = REBASE(t->st.m_scale);
		a.v_scale = REBASE(t->st.v_scale);
#undef REBASE
		r = aoqd_snapfile_put(c->file, i, &a, &err);
		pace_idle(&pace);
		if (c->swapped) {
			/* kept for the next swap (capture_finish) */
			madvise(c->copy[i], c->copy_len[i], MADV_FREE);
		} else {
			munmap(c->copy[i], c->copy_len[i]);
			c->copy[i] = NULL;
		}
	}
	if (r == 0)
		r = aoqd_snapfile_commit(c->file, c->path, sizeof(c->path), &err);
	if (r < 0) {
		c->result = r;
		snprintf(c->why, sizeof(c->why), "%s", err.msg);
	}
	pace_account(&pace);
	atomic_fetch_add(&c->w->waited_ns, pace.waited_ns);
	atomic_fetch_add(&c->w->overlap_ns, pace.overlap_ns);
	aoqd_debug("snapshot",
	           "'%s' rank %u: %.1f MiB written in %.2f s, %" PRIu64 " chunks; waited %.1f ms for idle workers, "
	           "%" PRIu64 " chunks written while they were busy (due by the minimum rate), %" PRIu64 " more due "
	           "in a step's idle gap; %" PRIu64 " chunks overlapped by updates, %.1f ms of writer time beside them",
	           c->key.job, c->key.rank, (double)pace.bytes / (1u << 20), (double)(mono_ns() - pace.start_ns) / 1e9,
	           pace.chunks, (double)pace.waited_ns / 1e6, pace.forced, pace.gapped, pace.overlapped,
	           (double)pace.overlap_ns / 1e6);
	aoqd_snapfile_free(c->file); /* removes the temp file if it is still there */
	c->file = NULL;
}

/* Writer thread (aoqd_snapshot_prepare): maps the spares the state lacks
 * and writes a byte to each of their pages, a chunk at a time, paced like
 * the file's chunks (idle workers, or the minimum rate).  A spare is not
 * in use until a swap moves it in, and an undo copy is read only where the
 * step saved into it, so what is written there does not matter.  Tensors
 * last first: the order of the next step's gradients. */
static void capture_prep(struct aoqd_capture *c)
{
	struct aoqd_snapshotter *w = c->w;
	const struct aoqd_state *st = c->st;
	struct pacer pace = { .w = w, .started = UINT64_MAX };
	pthread_mutex_lock(&w->lock);
	pace.cfg = w->pace;
	pthread_mutex_unlock(&w->lock);
	pace.start_ns = mono_ns();
	size_t page = (size_t)sysconf(_SC_PAGESIZE), chunk = pace.cfg.chunk ? pace.cfg.chunk : AOQD_SNAPSHOT_CHUNK;
	int r = 0;
	for (uint32_t i = st->ntensors; r == 0 && i-- > 0;) {
		const struct aoqd_tensor *t = &st->tensors[i];
		size_t len = t->state_len - t->undo_off;
		if (c->spare[i] && c->spare_len[i] != len) {
			munmap(c->spare[i], c->spare_len[i]);
			c->spare[i] = NULL;
		}
		if (!c->spare[i]) {
			void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			if (p == MAP_FAILED) {
				r = -errno;
				break;
			}
			if (len >= (2u << 20))
				madvise(p, len, MADV_HUGEPAGE);
			c->spare[i] = p;
			c->spare_len[i] = len;
		}
		volatile uint8_t *p = c->spare[i];
		for (size_t off = 0; off < len; off += chunk) {
			if (atomic_load(&c->prep_cancel) || atomic_load_explicit(&w->hurry, memory_order_relaxed)) {
				r = atomic_load(&c->prep_cancel) ? -ECANCELED : -ESHUTDOWN;
				break;
			}
			if (w->pool) {
				pace_account(&pace);
				pace.chunk_busy = pace_wait(&pace, pace_due(&pace));
				pace.chunk_started = pace.started;
				pace.chunk_t0 = mono_ns();
			}
			size_t end = len - off < chunk ? len : off + chunk;
			for (size_t q = off; q < end; q += page)
				p[q] = 0;
			pace.bytes += end - off;
			pace.chunks++;
		}
	}
	pace_account(&pace);
	atomic_fetch_add(&w->overlap_ns, pace.overlap_ns);
	c->prep_result = r;
	aoqd_debug("snapshot",
	           "spares prepared for the undo swap: %.1f MiB touched in %.2f s, %" PRIu64 " chunks (%s); idle-worker "
	           "waits %.1f ms, %" PRIu64 " chunks due by the minimum rate (%" PRIu64 " more in a step's idle gap), "
	           "%" PRIu64 " overlapped by updates, %.1f ms beside them",
	           (double)pace.bytes / (1u << 20), (double)(mono_ns() - pace.start_ns) / 1e9, pace.chunks,
	           r == 0 ? "done" : strerror(-r), (double)pace.waited_ns / 1e6, pace.forced, pace.gapped,
	           pace.overlapped, (double)pace.overlap_ns / 1e6);
}

static void *writer_main(void *arg)
{
	struct aoqd_snapshotter *w = arg;
	/* Niced below the workers (10: about a tenth of a core's time when
	 * every core is busy): the checksum and the file writes would
	 * otherwise take a core from a worker, and the whole step waits for
	 * its slowest worker.  A worker that waits for a block the writer is
	 * copying waits for one block (CAPTURE_BLOCK), not a tensor, so the
	 * priority inversion seen with whole-tensor copies (4 s steps on a
	 * loaded 2-core host) is bounded. */
	if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10) < 0)
		aoqd_debug("snapshot", "writer thread: setpriority: %s", strerror(errno));
	/* and off the workers' cores when they are pinned: even at nice 10 it
	 * took about a tenth of the core it shared with a worker, and every
	 * step waits for its slowest worker */
	if (w->pinned && pthread_setaffinity_np(pthread_self(), sizeof(w->cpus), &w->cpus) != 0)
		aoqd_debug("snapshot", "writer thread: cannot set its cores");
	pthread_mutex_lock(&w->lock);
	for (;;) {
		while (!w->queue && !w->stop)
			pthread_cond_wait(&w->cond, &w->lock);
		struct aoqd_capture *c = w->queue;
		if (!c)
			break;
		w->queue = c->next;
		if (!w->queue)
			w->qtail = &w->queue;
		w->busy = true;
		bool stop = w->stop;
		pthread_mutex_unlock(&w->lock);
		if (stop && c->prep) {
			c->prep_result = -ESHUTDOWN;
		} else if (stop) {
			capture_disarm(c);
			c->result = -ECANCELED;
			snprintf(c->why, sizeof(c->why), "aoqd is stopping");
		} else if (c->prep) {
			capture_prep(c);
		} else {
			capture_write(c);
		}
		pthread_mutex_lock(&w->lock);
		w->busy = false;
		c->next = w->done_list;
		w->done_list = c;
		uv_async_send(&w->async);
	}
	pthread_mutex_unlock(&w->lock);
	return NULL;
}

static void writer_done(uv_async_t *h)
{
	struct aoqd_snapshotter *w = h->data;
	pthread_mutex_lock(&w->lock);
	struct aoqd_capture *c = w->done_list;
	w->done_list = NULL;
	pthread_mutex_unlock(&w->lock);
	while (c) {
		struct aoqd_capture *next = c->next;
		if (c->prep) {
			char why[512];
			/* c->why: the loop thread's (aoqd_snapshot_cancel) */
			snprintf(why, sizeof(why), "%s",
			         c->prep_result == -ESHUTDOWN ? "aoqd is stopping"
			         : c->prep_result == -ECANCELED && c->why[0] ? c->why : strerror(-c->prep_result));
			c->prep = false;
			c->prep_fn(c->prep_arg, c->prep_result, why); /* may free the state, and c with it */
		} else {
			capture_finish(c);
		}
		c = next;
	}
}

static void writer_closed(uv_handle_t *h)
{
	struct aoqd_snapshotter *w = h->data;
	pthread_mutex_destroy(&w->lock);
	pthread_cond_destroy(&w->cond);
	free(w);
}

struct aoqd_snapshotter *aoqd_snapshotter_new(uv_loop_t *loop, const cpu_set_t *cpus, struct aoqd_pool *pool)
{
	struct aoqd_snapshotter *w = calloc(1, sizeof(*w));
	if (!w)
		return NULL;
	w->pool = pool;
	w->pace = (struct aoqd_snap_pace){ AOQD_SNAPSHOT_CHUNK, AOQD_SNAPSHOT_MIN_RATE, AOQD_SNAPSHOT_SLACK_MS * 1000000ull,
		                           AOQD_SNAPSHOT_SETTLE_US * 1000ull };
	pthread_mutex_init(&w->lock, NULL);
	pthread_cond_init(&w->cond, NULL);
	w->qtail = &w->queue;
	int r = uv_async_init(loop, &w->async, writer_done);
	if (r < 0) {
		free(w);
		errno = -r;
		return NULL;
	}
	w->async.data = w;
	w->pinned = cpus != NULL;
	if (cpus)
		w->cpus = *cpus;
	r = pthread_create(&w->thread, NULL, writer_main, w);
	if (r != 0) {
		uv_close((uv_handle_t *)&w->async, writer_closed);
		errno = r;
		return NULL;
	}
	return w;
}

bool aoqd_snapshotter_idle(struct aoqd_snapshotter *w)
{
	pthread_mutex_lock(&w->lock);
	bool idle = !w->queue && !w->busy && !w->done_list;
	pthread_mutex_unlock(&w->lock);
	return idle;
}

void aoqd_snapshotter_free(struct aoqd_snapshotter *w)
{
	if (!w)
		return;
	atomic_store(&w->hurry, true);
	pthread_mutex_lock(&w->lock);
	w->stop = true;
	pthread_cond_signal(&w->cond);
	pthread_mutex_unlock(&w->lock);
	pthread_join(w->thread, NULL);
	writer_done(&w->async);
	uv_close((uv_handle_t *)&w->async, writer_closed);
}

void aoqd_snapshotter_set_pace(struct aoqd_snapshotter *w, const struct aoqd_snap_pace *pace)
{
	pthread_mutex_lock(&w->lock);
	w->pace = *pace;
	if (!w->pace.chunk)
		w->pace.chunk = AOQD_SNAPSHOT_CHUNK;
	pthread_mutex_unlock(&w->lock);
}

void aoqd_snapshotter_pace_stats(struct aoqd_snapshotter *w, uint64_t *chunks, uint64_t *forced, uint64_t *waited_ns)
{
	*chunks = atomic_load(&w->chunks);
	*forced = atomic_load(&w->forced);
	*waited_ns = atomic_load(&w->waited_ns);
}
