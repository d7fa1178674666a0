/* SPDX-License-Identifier: MIT */
/*
 * Snapshot files in the safetensors format (docs/snapshots.md): the header
 * and the atomic write.  Loading them is snapload.c; the consistent capture
 * of a live state and the writer thread are snapshot.c.
 *
 * The file: header = JSON object with one entry per array
 * ("<key>.master", "<key>.exp_avg", "<key>.exp_avg_sq", and for q8 and q4
 * "<key>.exp_avg.scale", "<key>.exp_avg_sq.scale") and a __metadata__ map of
 * strings.  Arrays are laid out by element size (4-byte dtypes first, then
 * 2, then 1), each class in tensor order, contiguous, so every array is
 * aligned to its element.  The checksum is zlib's CRC-32 of the data
 * section; arrays may be written in any order (a capture takes tensors as
 * they are needed), so each array's CRC is kept and they are combined in
 * file order at the end (crc32_combine), then written into the header's
 * fixed-width field.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "aoq-arena.h"
#include "aoq-config.h"
#include "convert.h"
#include "log.h"
#include "snapfile.h"
#include "snapshot.h"

/* ---- arrays of a tensor ---- */

const char *const snap_arr_suffix[A_N] = { "master", "exp_avg", "exp_avg_sq", "exp_avg.scale", "exp_avg_sq.scale" };

const char *const snap_prec_names[SNAP_NPREC] = { "fp32", "q8", "bf16", "bf16_q8", "bf16_all", "q4", "bf16_q4" };
const char *const snap_kind_names[SNAP_NKIND] = { "adamw", "adam", "sgd", "lion" };
const char *const snap_dtype_names[SNAP_NDTYPE] = { "fp32", "bf16", "fp16" };

/* Array k of a tensor of n elements: false when it has none; else its
 * safetensors dtype, element count and element size. */
bool snap_arr_info(enum aoqk_precision p, uint64_t n, unsigned moments, int k, const char **dtype,
                   uint64_t *elems, unsigned *esize)
{
	/* q8 and q4: U8 codes (q4: two a byte, aoqk_moment_bytes of them) and
	 * an F32 scale per block */
	bool q8 = aoqk_precision_blocked(p);
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
		*esize = q8 ? 1u : (unsigned)aoqk_moment_size(p);
		*elems = aoqk_moment_bytes(p, n) / *esize;
		return true;
	default:
		if (!q8 || moments < (k == A_MS ? 1u : 2u))
			return false;
		*dtype = "F32";
		*esize = 4;
		*elems = aoqk_scale_count(p, n);
		return true;
	}
}

const void *snap_arr_ptr(const struct aoqk_state *a, int k)
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
uint32_t snap_crc(uint32_t crc, const void *p, uint64_t n)
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

#define Q8_FORMAT "blockwise-256, code format 2: exp_avg uint8 codes, bit 7 the sign, bits 0-6 an e3m4 float c: " \
                  "|m| = (u2f((c + 1920) << 19) - u2f(1920 << 19)) * (scale / TOP_M); exp_avg_sq uint8 codes c (e3m5): " \
                  "sqrt(v) = (u2f((c + 3840) << 18) - u2f(3840 << 18)) * (scale / TOP_U); u2f reads the bits as fp32 " \
                  "(docs/snapshots.md)"
#define Q4_FORMAT "blockwise-128, q4 format 1: two codes a byte, element i of each 32 in byte i % 16 of their 16, " \
                  "bits 4-7 for i % 32 >= 16; exp_avg nibbles, bit 3 the sign, bits 0-2 an e1m2 float c: " \
                  "|m| = (u2f((c + 504) << 21) - u2f(504 << 21)) * (scale / TOP_M); exp_avg_sq nibbles c (e2m2): " \
                  "sqrt(v) = (u2f((c + 496) << 21) - u2f(496 << 21)) * (scale / TOP_U); u2f reads the bits as fp32 " \
                  "(docs/snapshots.md)"

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

uint64_t aoqd_snapfile_data_bytes(const struct aoqd_snapfile *f)
{
	return f->data_len;
}

uint32_t aoqd_snapfile_tensors(const struct aoqd_snapfile *f)
{
	return f->n;
}

/* The job's part of a file name: its bytes, escaped (%XX) but for
 * [A-Za-z0-9._-]; one that would be longer than JOB_NAME_MAX is cut (never
 * inside an escape) and followed by '~' and a hash of the whole job, so
 * that every job of 128 bytes, whatever its bytes, has a name that fits
 * NAME_MAX with the uid and rank around it. */
#define JOB_NAME_MAX 160

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
	if (k > JOB_NAME_MAX) {
		size_t cut = JOB_NAME_MAX - 17;
		while (cut > 0 && (job[cut - 1] == '%' || (cut > 1 && job[cut - 2] == '%')))
			cut--; /* not inside an escape */
		uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
		for (const unsigned char *p = (const unsigned char *)key->job; *p; p++)
			h = (h ^ *p) * 0x100000001b3ull;
		snprintf(job + cut, sizeof(job) - cut, "~%016" PRIx64, h);
	}
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
				if (asprintf(&keys[nk], "%s.%s", pre[i], snap_arr_suffix[k]) < 0) {
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
	if ((unsigned)st->precision >= SNAP_NPREC) {
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
		if ((unsigned)gr->kind >= SNAP_NKIND) {
			err = EINVAL;
			goto fail;
		}
		json_object_object_add(o, "kind", json_object_new_string(snap_kind_names[gr->kind]));
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
		json_object_object_add(o, "param_dtype", json_object_new_string(snap_dtype_names[t->param_dtype]));
		json_object_object_add(o, "grad_dtype", json_object_new_string(snap_dtype_names[t->grad_dtype]));
		json_object_object_add(o, "group", json_object_new_int64(t->group));
		json_object_object_add(o, "steps",
		                       json_object_new_int64((int64_t)(tensor_steps ? tensor_steps[i] : t->steps)));
		f->moments[i] = st->groups[t->group].moments;
	}
	/* metadata */
	if (add_str(meta, "format", AOQD_SNAPSHOT_FORMAT) < 0 || add_u64(meta, "format_version", AOQD_SNAPSHOT_VERSION) < 0 ||
	    add_str(meta, "aoq_version", AOQ_VERSION) < 0 || add_u64(meta, "uid", key->uid) < 0 ||
	    add_str(meta, "job", key->job) < 0 || add_u64(meta, "rank", key->rank) < 0 || add_u64(meta, "step", step) < 0 ||
	    add_str(meta, "precision", snap_prec_names[st->precision]) < 0 || add_u64(meta, "seed", st->seed) < 0 ||
	    add_u64(meta, "window", st->window) < 0 ||
	    (key->local_world > 1 && add_u64(meta, "local_world", key->local_world) < 0) ||
	    add_str(meta, "skip_nonfinite", st->skip_nonfinite ? "true" : "false") < 0 ||
	    add_str(meta, "delayed_update", st->delayed ? "true" : "false") < 0 ||
	    (st->master24 && add_u64(meta, "master_bits", 24) < 0) ||
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
	if (aoqk_precision_q4(f->prec) && add_str(meta, "q4_format", Q4_FORMAT) < 0)
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
				if (!snap_arr_info(f->prec, t->numel, f->moments[i], k, &dt, &elems, &esize) || esize != es)
					continue;
				struct arr *a = &f->arrs[i][k];
				a->present = true;
				a->off = off;
				a->len = elems * esize;
				off += a->len;
				json_object *e = json_object_new_object(), *shape = json_object_new_array(),
				            *offs = json_object_new_array();
				char *kname = NULL;
				if (!e || !shape || !offs || asprintf(&kname, "%s.%s", pre[i], snap_arr_suffix[k]) < 0) {
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

int snap_pio(int fd, void *p, uint64_t n, uint64_t off, bool write)
{
	uint8_t *b = p;
	while (n) {
		size_t k = n > (1u << 30) ? (1u << 30) : (size_t)n;
		ssize_t w = write ? pwrite(fd, b, k, (off_t)off) : pread(fd, b, k, (off_t)off);
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

/* snap_pio's write, for the const data it writes */
static int pwrite_all(int fd, const void *p, uint64_t n, uint64_t off)
{
	return snap_pio(fd, (void *)(uintptr_t)p, n, off, true);
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
	if (asprintf(&f->tmp, "%s/" AOQD_SNAPSHOT_TEMP "XXXXXX", dir) < 0) {
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
		const void *p = snap_arr_ptr(a, k);
		if (!p)
			return AOQD_REFUSE(err, INTERNAL, "snapshot: tensor %u has no %s", i, snap_arr_suffix[k]);
		/* a split master (aoqk_state.master_lo, master_lo8) goes out
		 * as the fp32 master it is, joined a piece at a time */
		bool join = k == A_MASTER && aoqd_lo(a);
		uint32_t *joined = NULL;
		uint64_t step = join ? 1u << 20 : f->chunk;
		if (join && !(joined = malloc(step)))
			return AOQD_REFUSE(err, NO_MEMORY, "snapshot: no memory to join a split master");
		/* chunk by chunk: the checksum and the write of each in one
		 * go (the chunk still in the cache for the write), paced by
		 * f->before */
		uint32_t crc = (uint32_t)crc32(0, Z_NULL, 0);
		for (uint64_t at = 0; at < x->len;) {
			uint64_t n = x->len - at < step ? x->len - at : step;
			if (f->before)
				f->before(f->before_arg, n);
			const uint8_t *q = (const uint8_t *)p + at;
			if (join) {
				aoqd_master_join(joined, (const uint16_t *)p + at / 4,
				                 (const uint8_t *)aoqd_lo(a) + at / 4 * aoqd_lo_size(a), aoqd_lo_size(a), n / 4);
				q = (const uint8_t *)joined;
			}
			crc = snap_crc(crc, q, n);
			int r = pwrite_all(f->fd, q, n, base + x->off + at);
			if (r == 0)
				r = write_behind(f, base + x->off + at, n);
			if (r < 0) {
				free(joined);
				return AOQD_REFUSE(err, INTERNAL, "snapshot: writing %s: %s", f->tmp, strerror(-r));
			}
			at += n;
		}
		free(joined);
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
