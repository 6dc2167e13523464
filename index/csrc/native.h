/*
 * native.h - index._native: what its translation units share (see module.c for the map).
 *
 *   pyargs.c       Python arguments <-> C (keys as lists or uint64 buffers, array('Q'))
 *   table_type.c   the Table type: the block table of table.h, integer cache-domain slots
 *   keymap_type.c  the KeyMap type: engine block hash -> kvgate block key
 *   keys.c         kvgate's chained block keys (from packed ids or a msgpack array) and xxh3
 *   wire.c         the KV-event msgpack reader: token ids, block hashes, events, batches
 *   ingest.c       a whole KV-event payload applied to a Table slot and its KeyMap
 *   module.c       the module: its functions, types and state
 */
#ifndef KVGATE_NATIVE_H
#define KVGATE_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define KV_MALLOC(n) malloc(n)
#define KV_FREE(p) free(p)

#include "maps.h"
#include "table.h"

MAP_DEFINE(U64Map, uint64_t)

/* The module's state: its one reference (array.array, to return keys as array('Q')). */
typedef struct {
    PyObject *array_type;
} ModuleState;

typedef struct {
    PyObject_HEAD
    Table t;
} TableObject;

typedef struct {
    PyObject_HEAD
    U64Map m;
    PyObject *array_type; /* array.array, for take_many's result */
} KeyMapObject;

extern PyTypeObject TableType;
extern PyTypeObject KeyMapType;

/* ---------------------------------------------------------------- pyargs.c */
static inline int as_u64(PyObject *obj, uint64_t *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "expected an int key, got %.80s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)value;
    return 0;
}

int as_size(PyObject *obj, size_t *out);

/* Keys given as a list/tuple of ints or as a buffer of uint64 (``array('Q')``, what the
 * event path passes: no Python int per key). */
typedef struct {
    Py_buffer view;
    int has_view;
    PyObject *fast;
    const uint64_t *u64;
    PyObject **items;
    Py_ssize_t n;
} Keys;

int keys_open(PyObject *obj, Keys *k, const char *what);
void keys_close(Keys *k);

static inline int keys_get(const Keys *k, Py_ssize_t i, uint64_t *out)
{
    if (k->u64 != NULL) {
        *out = k->u64[i];
        return 0;
    }
    return as_u64(k->items[i], out);
}

#define STACK_KEYS 256

/* Keys as a C array of uint64: the caller's buffer itself, or a converted copy (on the stack
 * up to STACK_KEYS, else on the heap). */
typedef struct {
    Keys keys;
    uint64_t stack[STACK_KEYS];
    uint64_t *heap;
    const uint64_t *items;
    Py_ssize_t n;
} KeyArray;

int key_array_open(PyObject *obj, const char *what, KeyArray *a);
void key_array_close(KeyArray *a);
PyObject *new_u64_array(PyObject *array_type, const uint64_t *items, size_t n);
PyObject *import_array_type(void);

/* ---------------------------------------------------------------- keymap_type.c */
int map_put_keys(U64Map *m, const uint64_t *hashes, const uint64_t *keys, size_t n);
size_t map_take_keys(U64Map *m, const uint64_t *hashes, size_t n, uint64_t *out);

/* ---------------------------------------------------------------- keys.c */
int block_size_arg(Py_ssize_t block_size);
void chain_into(const uint8_t *packed, size_t blocks, size_t step, uint64_t prev, uint64_t *keys);
PyObject *chain_keys(PyObject *module, PyObject *args);
PyObject *chain_keys_msgpack(PyObject *module, PyObject *args);
PyObject *xxh3_64(PyObject *module, PyObject *args);

/* ---------------------------------------------------------------- wire.c */
PyObject *fold_hashes(PyObject *module, PyObject *raw);
PyObject *repeats_a_key(PyObject *module, PyObject *payload);

/* ---------------------------------------------------------------- ingest.c */
PyObject *ingest_payload(Table *table, PyObject *args);

#endif /* KVGATE_NATIVE_H */
