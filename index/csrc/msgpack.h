/*
 * msgpack.h - a bounds-checked msgpack reader: just what KV-event batches need (headers,
 * scalars, and skipping any value). Every reader returns -1 on a type it does not expect or on
 * running past the end; the cursor is then unspecified and the caller gives the reader up.
 */
#ifndef KVGATE_MSGPACK_H
#define KVGATE_MSGPACK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define MP_MAX_DEPTH 32

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

static inline uint64_t mp_be(const uint8_t *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

static inline int mp_left(const Reader *r, size_t n) { return (size_t)(r->end - r->p) >= n; }

/* An array header: its element count. */
static KV_UNUSED int mp_array(Reader *r, size_t *count)
{
    if (!mp_left(r, 1))
        return -1;
    uint8_t tag = *r->p;
    if ((tag & 0xF0) == 0x90) {
        *count = tag & 0x0F;
        r->p += 1;
    } else if (tag == 0xDC && mp_left(r, 3)) {
        *count = (size_t)mp_be(r->p + 1, 2);
        r->p += 3;
    } else if (tag == 0xDD && mp_left(r, 5)) {
        *count = (size_t)mp_be(r->p + 1, 4);
        r->p += 5;
    } else {
        return -1;
    }
    return 0;
}

/* A map header: its pair count. */
static KV_UNUSED int mp_map(Reader *r, size_t *count)
{
    if (!mp_left(r, 1))
        return -1;
    uint8_t tag = *r->p;
    if ((tag & 0xF0) == 0x80) {
        *count = tag & 0x0F;
        r->p += 1;
    } else if (tag == 0xDE && mp_left(r, 3)) {
        *count = (size_t)mp_be(r->p + 1, 2);
        r->p += 3;
    } else if (tag == 0xDF && mp_left(r, 5)) {
        *count = (size_t)mp_be(r->p + 1, 4);
        r->p += 5;
    } else {
        return -1;
    }
    return 0;
}

static inline int mp_is_nil(const Reader *r) { return mp_left(r, 1) && *r->p == 0xC0; }

/* A string: pointer and length into the buffer. */
static KV_UNUSED int mp_str(Reader *r, const uint8_t **s, size_t *len)
{
    if (!mp_left(r, 1))
        return -1;
    uint8_t tag = *r->p;
    size_t head;
    if ((tag & 0xE0) == 0xA0) {
        head = 1;
        *len = tag & 0x1F;
    } else if (tag == 0xD9 && mp_left(r, 2)) {
        head = 2;
        *len = (size_t)mp_be(r->p + 1, 1);
    } else if (tag == 0xDA && mp_left(r, 3)) {
        head = 3;
        *len = (size_t)mp_be(r->p + 1, 2);
    } else if (tag == 0xDB && mp_left(r, 5)) {
        head = 5;
        *len = (size_t)mp_be(r->p + 1, 4);
    } else {
        return -1;
    }
    if (!mp_left(r, head + *len))
        return -1;
    *s = r->p + head;
    r->p += head + *len;
    return 0;
}

static inline int mp_str_is(const uint8_t *s, size_t len, const char *want)
{
    return len == strlen(want) && memcmp(s, want, len) == 0;
}

static KV_UNUSED int mp_int_slow(Reader *r, uint64_t *value, int *negative);

/* An integer: *negative tells whether ``*value`` is a two's complement negative. Token ids
 * are mostly fixints and uint16s: those two are read inline. */
static inline int mp_int(Reader *r, uint64_t *value, int *negative)
{
    if (mp_left(r, 3)) {
        uint8_t tag = *r->p;
        if (tag <= 0x7F) {
            *value = tag;
            *negative = 0;
            r->p += 1;
            return 0;
        }
        if (tag == 0xCD) {
            *value = (uint64_t)r->p[1] << 8 | r->p[2];
            *negative = 0;
            r->p += 3;
            return 0;
        }
    }
    return mp_int_slow(r, value, negative);
}

static KV_UNUSED int mp_int_slow(Reader *r, uint64_t *value, int *negative)
{
    if (!mp_left(r, 1))
        return -1;
    uint8_t tag = *r->p;
    *negative = 0;
    if (tag <= 0x7F) {
        *value = tag;
        r->p += 1;
        return 0;
    }
    if (tag >= 0xE0) {
        *value = (uint64_t)(int64_t)(int8_t)tag;
        *negative = 1;
        r->p += 1;
        return 0;
    }
    size_t width;
    int is_signed = tag >= 0xD0;
    switch (tag) {
    case 0xCC: case 0xD0: width = 1; break;
    case 0xCD: case 0xD1: width = 2; break;
    case 0xCE: case 0xD2: width = 4; break;
    case 0xCF: case 0xD3: width = 8; break;
    default: return -1;
    }
    if (!mp_left(r, 1 + width))
        return -1;
    uint64_t v = mp_be(r->p + 1, width);
    if (is_signed && v >> (width * 8 - 1)) {
        if (width < 8)
            v |= ~(uint64_t)0 << (width * 8);
        *negative = 1;
    }
    *value = v;
    r->p += 1 + width;
    return 0;
}

/* A number (int or float) as a double. */
static KV_UNUSED int mp_number(Reader *r, double *out)
{
    if (!mp_left(r, 1))
        return -1;
    uint8_t tag = *r->p;
    if (tag == 0xCB && mp_left(r, 9)) {
        uint64_t bits = mp_be(r->p + 1, 8);
        memcpy(out, &bits, 8);
        r->p += 9;
        return 0;
    }
    if (tag == 0xCA && mp_left(r, 5)) {
        uint32_t bits = (uint32_t)mp_be(r->p + 1, 4);
        float f;
        memcpy(&f, &bits, 4);
        *out = f;
        r->p += 5;
        return 0;
    }
    uint64_t v;
    int negative;
    if (mp_int(r, &v, &negative) < 0)
        return -1;
    *out = negative ? (double)(int64_t)v : (double)v;
    return 0;
}

/* Skip one value of any type (nested up to MP_MAX_DEPTH). */
static KV_UNUSED int mp_skip_depth(Reader *r, int depth)
{
    if (!mp_left(r, 1) || depth > MP_MAX_DEPTH)
        return -1;
    uint8_t tag = *r->p;
    size_t n, len;
    const uint8_t *s;
    uint64_t v;
    int negative;
    if (tag <= 0x7F || tag >= 0xE0 || (tag >= 0xCC && tag <= 0xD3))
        return mp_int(r, &v, &negative);
    if ((tag & 0xE0) == 0xA0 || (tag >= 0xD9 && tag <= 0xDB))
        return mp_str(r, &s, &len);
    if ((tag & 0xF0) == 0x90 || tag == 0xDC || tag == 0xDD) {
        if (mp_array(r, &n) < 0)
            return -1;
        for (size_t i = 0; i < n; i++) {
            if (mp_int(r, &v, &negative) < 0 && mp_skip_depth(r, depth + 1) < 0)
                return -1; /* ints (token ids, hashes) first: they are nearly all there is */
        }
        return 0;
    }
    if ((tag & 0xF0) == 0x80 || tag == 0xDE || tag == 0xDF) {
        if (mp_map(r, &n) < 0)
            return -1;
        for (size_t i = 0; i < 2 * n; i++) {
            if (mp_skip_depth(r, depth + 1) < 0)
                return -1;
        }
        return 0;
    }
    size_t skip;
    switch (tag) {
    case 0xC0: case 0xC2: case 0xC3: skip = 1; break;                 /* nil, false, true */
    case 0xCA: skip = 5; break;                                        /* float32 */
    case 0xCB: skip = 9; break;                                        /* float64 */
    case 0xD4: skip = 3; break;                                        /* fixext 1..16 */
    case 0xD5: skip = 4; break;
    case 0xD6: skip = 6; break;
    case 0xD7: skip = 10; break;
    case 0xD8: skip = 18; break;
    case 0xC4: case 0xC7:                                              /* bin8, ext8 */
        if (!mp_left(r, 2))
            return -1;
        skip = 2 + (size_t)r->p[1] + (tag == 0xC7);
        break;
    case 0xC5: case 0xC8:                                              /* bin16, ext16 */
        if (!mp_left(r, 3))
            return -1;
        skip = 3 + (size_t)mp_be(r->p + 1, 2) + (tag == 0xC8);
        break;
    case 0xC6: case 0xC9:                                              /* bin32, ext32 */
        if (!mp_left(r, 5))
            return -1;
        skip = 5 + (size_t)mp_be(r->p + 1, 4) + (tag == 0xC9);
        break;
    default: return -1;                                                /* 0xC1: never used */
    }
    if (!mp_left(r, skip))
        return -1;
    r->p += skip;
    return 0;
}

static inline int mp_skip(Reader *r) { return mp_skip_depth(r, 0); }

/* Skip one value and return its bytes (a span of the buffer). */
static inline int mp_span(Reader *r, const uint8_t **start, size_t *len)
{
    const uint8_t *from = r->p;
    if (mp_skip(r) < 0)
        return -1;
    *start = from;
    *len = (size_t)(r->p - from);
    return 0;
}

#endif /* KVGATE_MSGPACK_H */
