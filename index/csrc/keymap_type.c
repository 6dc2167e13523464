/*
 * keymap_type.c - index._native.KeyMap: engine block hash -> kvgate block key, one per cache
 * domain (index/events/_translate.py), written in bulk by the batch ingestion (ingest.c).
 */
#include "native.h"

/* Map hashes[i] -> keys[i] (cells 8 ahead are fetched meanwhile). -1: no memory. */
int map_put_keys(U64Map *m, const uint64_t *hashes, const uint64_t *keys, size_t n)
{
    for (size_t i = 0; i < n && i < KV_PREFETCH_AHEAD; i++)
        U64Map_prefetch(m, hashes[i]);
    for (size_t i = 0; i < n; i++) {
        if (i + KV_PREFETCH_AHEAD < n)
            U64Map_prefetch(m, hashes[i + KV_PREFETCH_AHEAD]);
        int created;
        U64MapCell *cell = U64Map_insert(m, hashes[i], &created);
        if (cell == NULL)
            return -1;
        cell->val = keys[i];
    }
    return 0;
}

/* Remove the hashes present; their keys go to ``out`` in order (``out`` may be ``hashes``:
 * each key overwrites a hash already read). Returns how many were present. */
size_t map_take_keys(U64Map *m, const uint64_t *hashes, size_t n, uint64_t *out)
{
    size_t found = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t key;
        if (U64Map_remove(m, hashes[i], &key))
            out[found++] = key;
    }
    return found;
}

static PyObject *KeyMap_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "KeyMap() takes no arguments");
        return NULL;
    }
    KeyMapObject *self = (KeyMapObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    memset(&self->m, 0, sizeof(self->m));
    self->m.seed = kv_random_seed();
    self->array_type = import_array_type();
    if (self->array_type == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void KeyMap_dealloc(KeyMapObject *self)
{
    U64Map_free(&self->m);
    Py_XDECREF(self->array_type);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t KeyMap_len(KeyMapObject *self) { return (Py_ssize_t)self->m.len; }

static int KeyMap_contains(KeyMapObject *self, PyObject *key_obj)
{
    uint64_t key;
    if (!PyLong_Check(key_obj))
        return 0;
    if (as_u64(key_obj, &key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    return U64Map_find(&self->m, key) != NULL;
}

static PyObject *KeyMap_subscript(KeyMapObject *self, PyObject *key_obj)
{
    uint64_t key;
    if (as_u64(key_obj, &key) < 0)
        return NULL;
    const U64MapCell *cell = U64Map_find(&self->m, key);
    if (cell == NULL) {
        PyErr_SetObject(PyExc_KeyError, key_obj);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(cell->val);
}

static int KeyMap_ass_subscript(KeyMapObject *self, PyObject *key_obj, PyObject *value_obj)
{
    uint64_t key, value;
    if (as_u64(key_obj, &key) < 0)
        return -1;
    if (value_obj == NULL) {
        if (!U64Map_remove(&self->m, key, NULL)) {
            PyErr_SetObject(PyExc_KeyError, key_obj);
            return -1;
        }
        return 0;
    }
    if (as_u64(value_obj, &value) < 0)
        return -1;
    int created;
    U64MapCell *cell = U64Map_insert(&self->m, key, &created);
    if (cell == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    cell->val = value;
    return 0;
}

static PyObject *KeyMap_get(KeyMapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *fallback = nargs == 2 ? args[1] : Py_None;
    int found = KeyMap_contains(self, args[0]);
    if (found < 0)
        return NULL;
    if (!found)
        return Py_NewRef(fallback);
    return KeyMap_subscript(self, args[0]);
}

static PyObject *KeyMap_pop(KeyMapObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    uint64_t key, value;
    if (as_u64(args[0], &key) < 0)
        return NULL;
    if (U64Map_remove(&self->m, key, &value))
        return PyLong_FromUnsignedLongLong(value);
    if (nargs == 2)
        return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *KeyMap_clear(KeyMapObject *self, PyObject *Py_UNUSED(ignored))
{
    U64Map_free(&self->m);
    Py_RETURN_NONE;
}

/* put_many(hashes, keys): map each hash to the key at the same position. */
static PyObject *KeyMap_put_many(KeyMapObject *self, PyObject *args)
{
    PyObject *hashes_obj, *keys_obj;
    if (!PyArg_ParseTuple(args, "OO", &hashes_obj, &keys_obj))
        return NULL;
    KeyArray hashes, keys;
    if (key_array_open(hashes_obj, "hashes must be a sequence", &hashes) < 0)
        return NULL;
    if (key_array_open(keys_obj, "keys must be a sequence", &keys) < 0) {
        key_array_close(&hashes);
        return NULL;
    }
    PyObject *result = NULL;
    if (hashes.n != keys.n)
        PyErr_SetString(PyExc_ValueError, "hashes and keys differ in length");
    else if (map_put_keys(&self->m, hashes.items, keys.items, (size_t)hashes.n) < 0)
        PyErr_NoMemory();
    else
        result = Py_NewRef(Py_None);
    key_array_close(&hashes);
    key_array_close(&keys);
    return result;
}

/* take_many(hashes) -> array('Q'): the keys of the hashes present, in order, each removed. */
static PyObject *KeyMap_take_many(KeyMapObject *self, PyObject *hashes_obj)
{
    KeyArray hashes;
    if (key_array_open(hashes_obj, "hashes must be a sequence", &hashes) < 0)
        return NULL;
    PyObject *out = NULL;
    uint64_t *keys = (uint64_t *)PyMem_RawMalloc((size_t)hashes.n * 8 + 8);
    if (keys == NULL) {
        PyErr_NoMemory();
    } else {
        size_t found = map_take_keys(&self->m, hashes.items, (size_t)hashes.n, keys);
        out = new_u64_array(self->array_type, keys, found);
        PyMem_RawFree(keys);
    }
    key_array_close(&hashes);
    return out;
}

/* Keep the hashes that map to one of ``keys``; returns how many went. -1: no memory. */
static Py_ssize_t map_retain(U64Map *m, const uint64_t *keys, size_t n, uint64_t seed)
{
    KeySet wanted = {.seed = seed};
    U64Map kept = {.seed = m->seed};
    int created, rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++)
        rc = KeySet_insert(&wanted, keys[i], &created) ? 0 : -1;
    for (size_t i = 0; i < m->cap && rc == 0; i++) {
        const U64MapCell *cell = &m->cells[i];
        if (!cell->used || KeySet_find(&wanted, cell->val) == NULL)
            continue;
        U64MapCell *copy = U64Map_insert(&kept, cell->key, &created);
        if (copy == NULL)
            rc = -1;
        else
            copy->val = cell->val;
    }
    KeySet_free(&wanted);
    if (rc < 0) {
        U64Map_free(&kept);
        return -1;
    }
    Py_ssize_t gone = (Py_ssize_t)(m->len - kept.len);
    U64Map_free(m);
    *m = kept;
    return gone;
}

/* retain(keys) -> int: forget every hash whose key is not in ``keys``; how many went. */
static PyObject *KeyMap_retain(KeyMapObject *self, PyObject *keys_obj)
{
    KeyArray keys;
    if (key_array_open(keys_obj, "keys must be a sequence", &keys) < 0)
        return NULL;
    Py_ssize_t gone = map_retain(&self->m, keys.items, (size_t)keys.n, self->m.seed);
    key_array_close(&keys);
    return gone < 0 ? PyErr_NoMemory() : PyLong_FromSsize_t(gone);
}

static PyObject *KeyMap_memory_bytes(KeyMapObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(self->m.cap * sizeof(U64MapCell));
}

static PyMethodDef KeyMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyMap_get, METH_FASTCALL, "get(hash, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))KeyMap_pop, METH_FASTCALL, "pop(hash[, default])"},
    {"clear", (PyCFunction)KeyMap_clear, METH_NOARGS, "forget every hash (memory is freed)"},
    {"put_many", (PyCFunction)KeyMap_put_many, METH_VARARGS, "put_many(hashes, keys)"},
    {"take_many", (PyCFunction)KeyMap_take_many, METH_O,
     "take_many(hashes) -> array('Q') of the keys of the hashes present (they are removed)"},
    {"retain", (PyCFunction)KeyMap_retain, METH_O,
     "retain(keys) -> int: forget the hashes whose key is not in keys; how many went"},
    {"memory_bytes", (PyCFunction)KeyMap_memory_bytes, METH_NOARGS, "bytes allocated"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods KeyMap_as_mapping = {
    .mp_length = (lenfunc)KeyMap_len,
    .mp_subscript = (binaryfunc)KeyMap_subscript,
    .mp_ass_subscript = (objobjargproc)KeyMap_ass_subscript,
};

static PySequenceMethods KeyMap_as_sequence = {
    .sq_contains = (objobjproc)KeyMap_contains,
};

PyTypeObject KeyMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "index._native.KeyMap",
    .tp_basicsize = sizeof(KeyMapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Engine block hash -> kvgate block key (unsigned 64-bit ints both).",
    .tp_new = KeyMap_new,
    .tp_dealloc = (destructor)KeyMap_dealloc,
    .tp_methods = KeyMap_methods,
    .tp_as_mapping = &KeyMap_as_mapping,
    .tp_as_sequence = &KeyMap_as_sequence,
};
