/*
 * wire.c - the KV-event msgpack reader (wire.h), and the module's functions on raw payloads:
 * fold_hashes (an event's block hashes as array('Q')) and repeats_a_key (the duplicate-key rule
 * both decode paths share, docs/security-events.md).
 */
#include "native.h"
#include "wire.h"

/* ---------------------------------------------------------------- token ids and hashes */
/* One token id (a msgpack int in 0..2**32-1). */
static int read_token(Reader *r, uint32_t *out)
{
    uint64_t v;
    int negative;
    if (mp_int(r, &v, &negative) < 0 || negative || v > 0xFFFFFFFFULL)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

int read_tokens(const uint8_t *buf, size_t len, size_t expect, uint8_t **packed)
{
    Reader r = {buf, buf + len};
    size_t count;
    *packed = NULL;
    if (mp_array(&r, &count) < 0 || count != expect || !mp_left(&r, count))
        return WIRE_MALFORMED;
    uint8_t *out = (uint8_t *)malloc(count * 4 + 1);
    if (out == NULL)
        return WIRE_NO_MEMORY;
    for (size_t i = 0; i < count; i++) {
        uint32_t t;
        if (read_token(&r, &t) < 0) {
            free(out);
            return WIRE_MALFORMED;
        }
        out[4 * i] = (uint8_t)t;
        out[4 * i + 1] = (uint8_t)(t >> 8);
        out[4 * i + 2] = (uint8_t)(t >> 16);
        out[4 * i + 3] = (uint8_t)(t >> 24);
    }
    if (r.p != r.end) {
        free(out);
        return WIRE_MALFORMED;
    }
    *packed = out;
    return WIRE_OK;
}

/* One engine block hash folded like index/events/_wire.py's fold_hash: ints modulo 2**64 (SGLang's
 * signed hashes), raw bytes by their last 8 bytes read big-endian (vLLM, int hashes off). */
int read_hash(Reader *r, uint64_t *out)
{
    if (!mp_left(r, 1))
        return -1;
    uint8_t tag = *r->p;
    if (tag >= 0xC4 && tag <= 0xC6) { /* bin 8/16/32 */
        size_t width = (size_t)1 << (tag - 0xC4);
        if (!mp_left(r, 1 + width))
            return -1;
        size_t len = (size_t)mp_be(r->p + 1, width);
        if (!mp_left(r, 1 + width + len))
            return -1;
        const uint8_t *bytes = r->p + 1 + width;
        size_t take = len < 8 ? len : 8;
        *out = mp_be(bytes + len - take, take);
        r->p = bytes + len;
        return 0;
    }
    int negative;
    return mp_int(r, out, &negative); /* a negative int is already its value modulo 2**64 */
}

int read_hashes(const uint8_t *buf, size_t len, uint64_t **hashes, size_t *count)
{
    Reader r = {buf, buf + len};
    *hashes = NULL;
    if (mp_array(&r, count) < 0 || !mp_left(&r, *count))
        return WIRE_MALFORMED;
    uint64_t *out = (uint64_t *)malloc(*count * 8 + 8);
    if (out == NULL)
        return WIRE_NO_MEMORY;
    for (size_t i = 0; i < *count; i++) {
        if (read_hash(&r, &out[i]) < 0) {
            free(out);
            return WIRE_MALFORMED;
        }
    }
    if (r.p != r.end) {
        free(out);
        return WIRE_MALFORMED;
    }
    *hashes = out;
    return WIRE_OK;
}

PyObject *wire_error(int rc, const char *what)
{
    if (rc == WIRE_NO_MEMORY)
        return PyErr_NoMemory();
    PyErr_SetString(PyExc_ValueError, what);
    return NULL;
}

/* ---------------------------------------------------------------- events and batches */
static const char *const FIELD_NAMES[F_COUNT] = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size",
    "lora_id",      "medium",            "lora_name", "extra_keys",
};
static const int STORED_ORDER[] = {F_HASHES, F_PARENT,    F_TOKENS,    F_BLOCK_SIZE,
                                   F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA_KEYS};
static const int REMOVED_ORDER[] = {F_HASHES, F_MEDIUM};

static int event_kind(const uint8_t *tag, size_t len)
{
    if (mp_str_is(tag, len, "BlockStored"))
        return EV_STORED;
    if (mp_str_is(tag, len, "BlockRemoved"))
        return EV_REMOVED;
    return 0; /* AllBlocksCleared (rare) or unknown: the general path */
}

static int field_index(const uint8_t *name, size_t len)
{
    for (int f = 0; f < F_COUNT; f++) {
        if (mp_str_is(name, len, FIELD_NAMES[f]))
            return f;
    }
    return -1;
}

static int read_field(Reader *r, WireEvent *ev, int f)
{
    return f < 0 ? mp_skip(r) : mp_span(r, &ev->field[f], &ev->len[f]);
}

/* The key of a map event's next pair: a field index, F_TYPE, or -1 (a key kvgate ignores).
 * ``seen`` collects the keys read so far: a key met twice fails (both paths reject a batch
 * with such an event: tests/test_native_ingest.py). */
enum { F_TYPE = F_COUNT };

static int map_key(Reader *r, unsigned *seen, int *key)
{
    const uint8_t *name;
    size_t len;
    if (mp_str(r, &name, &len) < 0)
        return -1;
    *key = mp_str_is(name, len, "type") ? F_TYPE : field_index(name, len);
    if (*key < 0)
        return 0;
    if (*seen >> *key & 1)
        return -1;
    *seen |= 1u << *key;
    return 0;
}

static int parse_map_event(Reader *r, WireEvent *ev)
{
    size_t pairs;
    unsigned seen = 0;
    if (mp_map(r, &pairs) < 0)
        return -1;
    for (size_t i = 0; i < pairs; i++) {
        const uint8_t *tag;
        size_t tag_len;
        int key;
        if (map_key(r, &seen, &key) < 0)
            return -1;
        if (key == F_TYPE) {
            if (mp_str(r, &tag, &tag_len) < 0 || !(ev->kind = event_kind(tag, tag_len)))
                return -1;
        } else if (read_field(r, ev, key) < 0) {
            return -1;
        }
    }
    return ev->kind ? 0 : -1;
}

/* Does a map event of the batch hold a known key twice? 0 when none does or the batch cannot
 * be read this far (the decoder then gives its own answer). */
static int batch_repeats_a_key(const uint8_t *buf, size_t len)
{
    Reader r = {buf, buf + len};
    size_t fields, count, pairs;
    double ts;
    if (mp_array(&r, &fields) < 0 || fields < 2 || mp_number(&r, &ts) < 0 ||
        mp_array(&r, &count) < 0)
        return 0;
    for (size_t i = 0; i < count; i++) {
        if (!mp_left(&r, 1) || !((*r.p & 0xF0) == 0x80 || *r.p == 0xDE || *r.p == 0xDF)) {
            if (mp_skip(&r) < 0)
                return 0;
            continue;
        }
        unsigned seen = 0;
        if (mp_map(&r, &pairs) < 0)
            return 0;
        for (size_t j = 0; j < pairs; j++) {
            int key;
            const uint8_t *name;
            size_t name_len;
            Reader at = r;
            if (map_key(&r, &seen, &key) < 0)
                return mp_str(&at, &name, &name_len) == 0; /* a string read twice: repeated */
            if (mp_skip(&r) < 0)
                return 0;
        }
    }
    return 0;
}

static int parse_array_event(Reader *r, WireEvent *ev)
{
    size_t n, tag_len;
    const uint8_t *tag;
    if (mp_array(r, &n) < 0 || n == 0 || mp_str(r, &tag, &tag_len) < 0)
        return -1;
    if (!(ev->kind = event_kind(tag, tag_len)))
        return -1;
    const int *order = ev->kind == EV_STORED ? STORED_ORDER : REMOVED_ORDER;
    size_t known = ev->kind == EV_STORED ? F_COUNT : 2;
    for (size_t i = 1; i < n; i++) {
        if (read_field(r, ev, i - 1 < known ? order[i - 1] : -1) < 0)
            return -1;
    }
    return 0;
}

static int valid_hashes(const uint8_t *buf, size_t len, size_t max_blocks)
{
    Reader r = {buf, buf + len};
    size_t count;
    uint64_t h;
    if (mp_array(&r, &count) < 0 || count > max_blocks)
        return 0; /* past the bound: the general path clears the domain */
    for (size_t i = 0; i < count; i++) {
        if (read_hash(&r, &h) < 0)
            return 0;
    }
    return r.p == r.end;
}

/* Is the event in the shape this path takes (and well-formed where the general path would
 * reject the whole batch)? */
static int event_supported(const WireEvent *ev, uint64_t block_size, size_t max_blocks)
{
    if (ev->field[F_HASHES] == NULL ||
        !valid_hashes(ev->field[F_HASHES], ev->len[F_HASHES], max_blocks))
        return 0;
    if (!field_is_nil(ev, F_MEDIUM)) {
        Reader r = {ev->field[F_MEDIUM], ev->field[F_MEDIUM] + ev->len[F_MEDIUM]};
        const uint8_t *medium;
        size_t len;
        if (mp_str(&r, &medium, &len) < 0 || !mp_str_is(medium, len, "GPU"))
            return 0;
    }
    if (ev->kind == EV_REMOVED)
        return 1;
    if (ev->field[F_PARENT] == NULL || ev->field[F_TOKENS] == NULL ||
        ev->field[F_BLOCK_SIZE] == NULL)
        return 0;
    if (!field_is_nil(ev, F_PARENT)) {
        Reader r = {ev->field[F_PARENT], ev->field[F_PARENT] + ev->len[F_PARENT]};
        uint64_t h;
        if (read_hash(&r, &h) < 0 || r.p != r.end)
            return 0;
    }
    Reader r = {ev->field[F_BLOCK_SIZE], ev->field[F_BLOCK_SIZE] + ev->len[F_BLOCK_SIZE]};
    uint64_t size;
    int negative;
    if (mp_int(&r, &size, &negative) < 0 || negative || size != block_size)
        return 0;
    if (!field_is_nil(ev, F_LORA_ID) || !field_is_nil(ev, F_LORA_NAME))
        return 0;
    if (!field_is_nil(ev, F_EXTRA_KEYS)) {
        Reader x = {ev->field[F_EXTRA_KEYS], ev->field[F_EXTRA_KEYS] + ev->len[F_EXTRA_KEYS]};
        size_t n;
        if (mp_array(&x, &n) < 0)
            return 0;
        /* a root block's extra keys may carry a cache salt: only a first entry that is not
         * an array is known to carry none */
        if (field_is_nil(ev, F_PARENT) && n > 0 && mp_left(&x, 1) &&
            ((*x.p & 0xF0) == 0x90 || *x.p == 0xDC || *x.p == 0xDD))
            return 0;
    }
    return 1;
}

int parse_batch(const uint8_t *buf, size_t len, int64_t rank, uint64_t block_size,
                size_t max_blocks, double *ts, WireEvent **events, size_t *count)
{
    Reader r = {buf, buf + len};
    size_t fields;
    *events = NULL;
    if (mp_array(&r, &fields) < 0 || fields < 2 || fields > 3 || mp_number(&r, ts) < 0 ||
        mp_array(&r, count) < 0 || !mp_left(&r, *count))
        return -1;
    WireEvent *evs = (WireEvent *)calloc(*count + 1, sizeof(WireEvent));
    if (evs == NULL)
        return -1;
    int form = -1; /* 1: map-tagged, 0: array-tagged; one batch never mixes them */
    for (size_t i = 0; i < *count; i++) {
        int is_map = mp_left(&r, 1) && ((*r.p & 0xF0) == 0x80 || *r.p == 0xDE || *r.p == 0xDF);
        if ((form >= 0 && form != is_map) ||
            (is_map ? parse_map_event(&r, &evs[i]) : parse_array_event(&r, &evs[i])) < 0 ||
            !event_supported(&evs[i], block_size, max_blocks)) {
            free(evs);
            return -1;
        }
        form = is_map;
    }
    if (fields == 3 && !mp_is_nil(&r)) {
        uint64_t batch_rank;
        int negative;
        if (mp_int(&r, &batch_rank, &negative) < 0 || negative || (int64_t)batch_rank != rank) {
            free(evs);
            return -1;
        }
    } else if (fields == 3) {
        r.p++;
    }
    if (r.p != r.end) {
        free(evs);
        return -1;
    }
    *events = evs;
    return 0;
}

/* ---------------------------------------------------------------- Python functions */
/* fold_hashes(raw) -> array('Q'): a msgpack array of block hashes, each folded to uint64. */
PyObject *fold_hashes(PyObject *module, PyObject *raw)
{
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t *hashes;
    size_t count;
    PyObject *out = NULL;
    int rc = read_hashes((const uint8_t *)view.buf, (size_t)view.len, &hashes, &count);
    if (rc == WIRE_OK) {
        ModuleState *state = (ModuleState *)PyModule_GetState(module);
        out = new_u64_array(state->array_type, hashes, count);
        free(hashes);
    } else {
        wire_error(rc, "block_hashes is not a msgpack array of ints or bytes");
    }
    PyBuffer_Release(&view);
    return out;
}

/* repeats_a_key(payload) -> bool: a map event of the batch holds a known key twice */
PyObject *repeats_a_key(PyObject *Py_UNUSED(module), PyObject *payload)
{
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int found = batch_repeats_a_key((const uint8_t *)view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyBool_FromLong(found);
}
