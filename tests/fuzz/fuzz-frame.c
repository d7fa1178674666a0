/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the daemon's frame decoder.  The input is what a
 * client wrote on its socket, already in the connection's read buffer:
 * aoqd_conn_frame() (conn.c) cuts it into frames and decodes each with
 * protobuf-c (wire.c), then aoqd_conn_consume() drops what was handled, as
 * message.c does.  Every decoded Envelope must encode again, and that
 * encoding must decode and encode to the same bytes (what the daemon
 * accepts, it can also answer in kind).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conn.h"
#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/*
 * Drops the unknown fields of m and of every message inside it.
 * protobuf-c keeps an unknown field's bytes and writes them back behind a
 * canonical tag: an over-long varint tag of field 0 decodes, but field 0
 * written plainly does not (the first crash this target found, kept as
 * corpus/frame/crash-unknown-field-0).  The daemon never sends back what
 * it received, so the property is checked on the known fields.
 */
static void strip_unknown(ProtobufCMessage *m)
{
	if (!m)
		return;
	for (unsigned i = 0; i < m->n_unknown_fields; i++)
		free(m->unknown_fields[i].data);
	free(m->unknown_fields);
	m->unknown_fields = NULL;
	m->n_unknown_fields = 0;
	const ProtobufCMessageDescriptor *d = m->descriptor;
	for (unsigned i = 0; i < d->n_fields; i++) {
		const ProtobufCFieldDescriptor *f = &d->fields[i];
		if (f->type != PROTOBUF_C_TYPE_MESSAGE)
			continue;
		char *field = (char *)m + f->offset;
		if (f->label == PROTOBUF_C_LABEL_REPEATED) {
			size_t n = *(size_t *)((char *)m + f->quantifier_offset);
			ProtobufCMessage **v = *(ProtobufCMessage ***)field;
			for (size_t k = 0; k < n; k++)
				strip_unknown(v[k]);
		} else if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
			if (*(uint32_t *)((char *)m + f->quantifier_offset) == f->id)
				strip_unknown(*(ProtobufCMessage **)field);
		} else {
			strip_unknown(*(ProtobufCMessage **)field);
		}
	}
}

static void roundtrip(Aoq__Envelope *env)
{
	strip_unknown(&env->base);
	uint8_t *a, *b;
	size_t alen, blen;
	if (aoq_frame_encode(env, &a, &alen) < 0)
		return; /* larger than a frame once re-encoded: never sent */
	Aoq__Envelope *again = aoq_envelope_decode(a + 4, alen - 4);
	if (!again) {
		fprintf(stderr, "fuzz-frame: an encoded Envelope does not decode\n");
		abort();
	}
	if (aoq_frame_encode(again, &b, &blen) < 0 || blen != alen || memcmp(a, b, alen) != 0) {
		fprintf(stderr, "fuzz-frame: encode(decode(encode(x))) differs from encode(x)\n");
		abort();
	}
	free(b);
	aoq_envelope_free(again);
	free(a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct aoqd_conn c;
	memset(&c, 0, sizeof(c));
	/* An exact-size buffer, so ASan sees any read past what arrived. */
	c.rbuf = malloc(size ? size : 1);
	if (!c.rbuf)
		return 0;
	memcpy(c.rbuf, data, size);
	c.rlen = c.rcap = size;
	size_t off = 0;
	for (;;) {
		Aoq__Envelope *env = NULL;
		struct aoqd_error err;
		memset(&err, 0, sizeof(err));
		int r = aoqd_conn_frame(&c, &off, &env, &err);
		if (r < 0) {
			if (env || err.msg[0] == '\0') {
				fprintf(stderr, "fuzz-frame: a failed frame must leave an error and no message\n");
				abort();
			}
			break;
		}
		if (r == 0)
			break;
		if (!env || off > c.rlen) {
			fprintf(stderr, "fuzz-frame: a frame past the buffer\n");
			abort();
		}
		roundtrip(env);
		aoq_envelope_free(env);
	}
	aoqd_conn_consume(&c, off > c.rlen ? c.rlen : off);
	aoqd_conn_free(&c);
	return 0;
}
