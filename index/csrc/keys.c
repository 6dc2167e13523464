/*
 * keys.c - kvgate's chained block keys (docs/block-keys.md): key[i] = xxh3_64(block i's token
 * ids as uint32-LE bytes, seed = key[i-1]), from packed ids or straight from the msgpack
 * array of a KV event's token_ids (no Python int per token), and xxh3_64 itself (the tests
 * check it against the xxhash package).
 */
#include "native.h"
#include "wire.h"
#include "xxh3.h"
static PyObject *chain(const uint8_t *data, size_t blocks, size_t step, uint64_t prev)
{
    PyObject *out = PyList_New((Py_ssize_t)blocks);
    if (out == NULL)
        return NULL;
    for (size_t i = 0; i < blocks; i++) {
        prev = kv_xxh3_64(data + i * step, step, prev);
        PyObject *key = PyLong_FromUnsignedLongLong(prev);
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, key);
    }
    return out;
}

int block_size_arg(Py_ssize_t block_size)
{
    if (block_size <= 0 || block_size > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "block_size must be in 1..2**20, got %zd", block_size);
        return -1;
    }
    return 0;
}

/* chain_keys(packed, block_size, prev): keys of the full blocks of uint32-LE token bytes. */
PyObject *chain_keys(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer view;
    Py_ssize_t block_size;
    PyObject *prev_obj;
    if (!PyArg_ParseTuple(args, "y*nO", &view, &block_size, &prev_obj))
        return NULL;
    uint64_t prev;
    PyObject *out = NULL;
    if (block_size_arg(block_size) == 0 && as_u64(prev_obj, &prev) == 0) {
        size_t step = (size_t)block_size * 4;
        out = chain((const uint8_t *)view.buf, (size_t)view.len / step, step, prev);
    }
    PyBuffer_Release(&view);
    return out;
}

void chain_into(const uint8_t *packed, size_t blocks, size_t step, uint64_t prev,
                       uint64_t *keys)
{
    for (size_t i = 0; i < blocks; i++)
        keys[i] = prev = kv_xxh3_64(packed + i * step, step, prev);
}

/* chain_keys_msgpack(raw, block_size, prev, blocks) -> array('Q'): ``raw`` is the msgpack
 * array of an event's token ids; it must hold exactly ``blocks`` full blocks of uint32 ids. */
PyObject *chain_keys_msgpack(PyObject *module, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t block_size, blocks;
    PyObject *prev_obj, *out = NULL;
    if (!PyArg_ParseTuple(args, "y*nOn", &view, &block_size, &prev_obj, &blocks))
        return NULL;
    uint64_t prev;
    if (block_size_arg(block_size) == 0 && as_u64(prev_obj, &prev) == 0) {
        uint8_t *packed = NULL;
        uint64_t *keys = NULL;
        size_t n = blocks < 0 ? 0 : (size_t)blocks, step = (size_t)block_size * 4;
        /* every id takes a byte or more: a count past the buffer cannot be right (and n times
         * block_size cannot overflow below it) */
        int rc = blocks < 0 || n > (size_t)view.len ? WIRE_MALFORMED
                            : read_tokens((const uint8_t *)view.buf, (size_t)view.len,
                                          n * (size_t)block_size, &packed);
        if (rc == WIRE_OK) {
            keys = (uint64_t *)malloc(n * 8 + 8);
            rc = keys == NULL ? WIRE_NO_MEMORY : WIRE_OK;
        }
        if (rc == WIRE_OK) {
            chain_into(packed, n, step, prev, keys);
            ModuleState *state = (ModuleState *)PyModule_GetState(module);
            out = new_u64_array(state->array_type, keys, n);
        } else {
            wire_error(rc, "token_ids is not a msgpack array of uint32 ids filling the blocks");
        }
        free(keys);
        free(packed);
    }
    PyBuffer_Release(&view);
    return out;
}

PyObject *xxh3_64(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer view;
    PyObject *seed_obj;
    if (!PyArg_ParseTuple(args, "y*O", &view, &seed_obj))
        return NULL;
    uint64_t seed;
    PyObject *out = NULL;
    if (as_u64(seed_obj, &seed) == 0)
        out = PyLong_FromUnsignedLongLong(kv_xxh3_64(view.buf, (size_t)view.len, seed));
    PyBuffer_Release(&view);
    return out;
}

