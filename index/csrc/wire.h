/*
 * wire.h - reading KV-event payloads (msgpack, vLLM and SGLang shapes; docs/block-keys.md):
 * token ids, engine block hashes (folded to uint64 as index/events/_wire.py's fold_hash does),
 * events as spans of their fields, and whole batches in the shape the native ingestion takes.
 * Everything is bounds-checked (msgpack.h): a malformed payload is an answer, never a crash.
 */
#ifndef KVGATE_WIRE_H
#define KVGATE_WIRE_H

#include "msgpack.h"
#include "native.h"

enum { WIRE_OK = 0, WIRE_MALFORMED = -1, WIRE_NO_MEMORY = -2 };

enum { EV_STORED = 1, EV_REMOVED = 2 };
enum { F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
       F_EXTRA_KEYS, F_COUNT };

/* One event: its kind and each field's bytes (NULL: absent). */
typedef struct {
    int kind;
    const uint8_t *field[F_COUNT];
    size_t len[F_COUNT];
} WireEvent;

static inline int field_is_nil(const WireEvent *ev, int f)
{
    return ev->field[f] == NULL || (ev->len[f] == 1 && ev->field[f][0] == 0xC0);
}

/* A msgpack array of exactly ``expect`` token ids as uint32-LE bytes in ``*packed`` (malloc'd;
 * the caller frees it). */
int read_tokens(const uint8_t *buf, size_t len, size_t expect, uint8_t **packed);
/* One engine block hash, folded. */
int read_hash(Reader *r, uint64_t *out);
/* A msgpack array of block hashes, folded, into ``*hashes`` (malloc'd; the caller frees it). */
int read_hashes(const uint8_t *buf, size_t len, uint64_t **hashes, size_t *count);
/* Parse and check a payload for the native ingestion (see ingest.c); the events go to
 * ``*events`` (malloc'd). 0: in that shape, for ``rank`` and ``block_size``. */
int parse_batch(const uint8_t *buf, size_t len, int64_t rank, uint64_t block_size,
                size_t max_blocks, double *ts, WireEvent **events, size_t *count);
/* Raise the Python error of a reader's answer (``what``: a malformed value). */
PyObject *wire_error(int rc, const char *what);

#endif /* KVGATE_WIRE_H */
