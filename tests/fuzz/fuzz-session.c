/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the message handlers.  Each input is one hostile
 * client of an aoqd running in this process (fuzz-daemon.c): frames and
 * raw bytes on a real socket go through conn.c and dispatch() in
 * message.c to every handler (Hello, Register, SetHyperparams, StepEnd,
 * LoadState, ReadState, TensorSteps, Stats, TraceRequest, Bye); once the
 * arena has come, records on its ring and bytes poked into it drive the
 * data plane and the workers.  Operations: fuzz-ops.h.
 */
#include <string.h>

#include "fuzz-daemon.h"
#include "fuzz-ops.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Reads n bytes at *i (fewer at the end of the input). */
static size_t take(const uint8_t *data, size_t size, size_t *i, size_t n)
{
	size_t left = size - *i;
	if (n > left)
		n = left;
	*i += n;
	return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct fz_client c;
	fz_connect(&c);
	size_t i = 0;
	while (i < size && fz_alive(&c)) {
		uint8_t op = data[i++] & 7;
		switch (op) {
		case FZS_FRAME:
		case FZS_RAW: {
			uint8_t l[2] = { 0, 0 };
			size_t ln = take(data, size, &i, op == FZS_FRAME ? 2 : 1);
			memcpy(l, data + i - ln, ln);
			size_t n = op == FZS_FRAME ? (size_t)l[0] | (size_t)l[1] << 8 : l[0];
			const uint8_t *p = data + i;
			n = take(data, size, &i, n);
			if (op == FZS_FRAME)
				fz_send_frame(&c, p, n);
			else
				fz_send_raw(&c, p, n);
			break;
		}
		case FZS_RECORD: {
			struct aoq_rec rec;
			memset(&rec, 0, sizeof(rec));
			size_t n = take(data, size, &i, sizeof(rec));
			memcpy(&rec, data + i - n, n);
			fz_push(&c, &rec);
			break;
		}
		case FZS_POP:
			fz_pop_all(&c);
			fz_settle(&c);
			break;
		case FZS_POKE: {
			uint8_t hdr[5] = { 0 };
			size_t hn = take(data, size, &i, 5);
			memcpy(hdr, data + i - hn, hn);
			uint32_t off = (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 |
			               (uint32_t)hdr[3] << 24;
			const uint8_t *p = data + i;
			size_t n = take(data, size, &i, hdr[4]);
			/* The client may write anywhere in its mapping; past the
			 * header, which only it reads. */
			if (c.base && c.size > sizeof(c.h)) {
				uint64_t o = sizeof(c.h) + off % (c.size - sizeof(c.h));
				if (n > c.size - o)
					n = (size_t)(c.size - o);
				memcpy(c.base + o, p, n);
			}
			break;
		}
		default:
			fz_settle(&c);
			break;
		}
	}
	fz_settle(&c);
	fz_close(&c);
	return 0;
}
