/*
 * index._native - the index layer's hot paths in C (see docs/block-keys.md, "Native core").
 *
 *   Table      the block table (index/csrc/table.h) with integer cache-domain slots;
 *              index/native_table.py wraps it in the same interface as index/table.py.
 *   KeyMap     engine block hash -> kvgate block key, one per cache domain (index/translate.py).
 *   chain_keys / chain_keys_msgpack
 *              kvgate's chained block keys from packed uint32 token ids, or straight from the
 *              msgpack array of a KV event's ``token_ids`` (no Python int per token).
 *   ingest_batch
 *              a whole KV-event payload applied to a Table and a KeyMap (the common shape).
 *   fold_hashes
 *              a KV event's msgpack array of engine block hashes as array('Q'), folded.
 *   xxh3_64    the hash itself (tests check it against the xxhash package).
 *
 * The module has no global mutable state (its one reference, array.array, is module state).
 * Tables and maps allocate with malloc/mmap, which tracemalloc does not see: memory_bytes()
 * tells what they hold.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define KV_MALLOC(n) malloc(n)
#define KV_FREE(p) free(p)

#include "msgpack.h"
#include "table.h"
#include "xxh3.h"

MAP_DEFINE(U64Map, uint64_t)

/* ======================================================================= helpers */
static int as_u64(PyObject *obj, uint64_t *out)
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

static int as_size(PyObject *obj, size_t *out)
{
    Py_ssize_t value = PyLong_AsSsize_t(obj);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < 0) {
        PyErr_SetString(PyExc_ValueError, "slot must not be negative");
        return -1;
    }
    *out = (size_t)value;
    return 0;
}

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

static int keys_open(PyObject *obj, Keys *k, const char *what)
{
    memset(k, 0, sizeof(*k));
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &k->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        k->has_view = 1;
        const char *f = k->view.format ? k->view.format : "B";
        if (k->view.itemsize != 8 || (strcmp(f, "Q") != 0 && strcmp(f, "=Q") != 0 &&
                                      strcmp(f, "<Q") != 0 && strcmp(f, "L") != 0)) {
            PyErr_Format(PyExc_TypeError, "%s: a buffer must hold uint64 items", what);
            PyBuffer_Release(&k->view);
            k->has_view = 0;
            return -1;
        }
        k->u64 = (const uint64_t *)k->view.buf;
        k->n = k->view.len / 8;
        return 0;
    }
    k->fast = PySequence_Fast(obj, what);
    if (k->fast == NULL)
        return -1;
    k->items = PySequence_Fast_ITEMS(k->fast);
    k->n = PySequence_Fast_GET_SIZE(k->fast);
    return 0;
}

static inline int keys_get(const Keys *k, Py_ssize_t i, uint64_t *out)
{
    if (k->u64 != NULL) {
        *out = k->u64[i];
        return 0;
    }
    return as_u64(k->items[i], out);
}

static void keys_close(Keys *k)
{
    if (k->has_view)
        PyBuffer_Release(&k->view);
    Py_XDECREF(k->fast);
    k->has_view = 0;
    k->fast = NULL;
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

static int key_array_open(PyObject *obj, const char *what, KeyArray *a)
{
    a->heap = NULL;
    if (keys_open(obj, &a->keys, what) < 0)
        return -1;
    a->n = a->keys.n;
    if (a->keys.u64 != NULL) {
        a->items = a->keys.u64;
        return 0;
    }
    uint64_t *items = a->stack;
    if (a->n > STACK_KEYS) {
        items = a->heap = (uint64_t *)PyMem_RawMalloc((size_t)a->n * sizeof(uint64_t));
        if (items == NULL) {
            keys_close(&a->keys);
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < a->n; i++) {
        if (keys_get(&a->keys, i, &items[i]) < 0) {
            PyMem_RawFree(a->heap);
            keys_close(&a->keys);
            return -1;
        }
    }
    a->items = items;
    return 0;
}

static void key_array_close(KeyArray *a)
{
    keys_close(&a->keys);
    PyMem_RawFree(a->heap);
    a->heap = NULL;
}

/* An array('Q') holding ``items``. */
static PyObject *new_u64_array(PyObject *array_type, const uint64_t *items, size_t n)
{
    PyObject *packed = PyBytes_FromStringAndSize((const char *)items, (Py_ssize_t)(n * 8));
    if (packed == NULL)
        return NULL;
    PyObject *out = PyObject_CallFunction(array_type, "sO", "Q", packed);
    Py_DECREF(packed);
    return out;
}

/* ======================================================================= Table */
typedef struct {
    PyObject_HEAD
    Table t;
} TableObject;

static PyObject *Table_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Table() takes no arguments");
        return NULL;
    }
    TableObject *self = (TableObject *)type->tp_alloc(type, 0);
    if (self != NULL)
        table_init(&self->t);
    return (PyObject *)self;
}

static void Table_dealloc(TableObject *self)
{
    table_free(&self->t);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* store(slot, keys, tier, parent, stamp) */
static PyObject *Table_store(TableObject *self, PyObject *args)
{
    PyObject *slot_obj, *keys_obj, *parent_obj;
    int tier;
    double stamp;
    if (!PyArg_ParseTuple(args, "OOiOd", &slot_obj, &keys_obj, &tier, &parent_obj, &stamp))
        return NULL;
    size_t slot;
    if (as_size(slot_obj, &slot) < 0)
        return NULL;
    if (tier < 0 || tier > 2) {
        PyErr_SetString(PyExc_ValueError, "tier must be 0, 1 or 2");
        return NULL;
    }
    uint64_t parent = 0;
    int has_parent = parent_obj != Py_None;
    if (has_parent && as_u64(parent_obj, &parent) < 0)
        return NULL;
    KeyArray keys;
    if (key_array_open(keys_obj, "keys must be a sequence", &keys) < 0)
        return NULL;
    int rc = table_store(&self->t, slot, keys.items, (size_t)keys.n, tier, has_parent, parent,
                         stamp);
    key_array_close(&keys);
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* remove(slot, keys, tier_bits) */
static PyObject *Table_remove(TableObject *self, PyObject *args)
{
    PyObject *slot_obj, *keys_obj;
    int tier_bits;
    if (!PyArg_ParseTuple(args, "OOi", &slot_obj, &keys_obj, &tier_bits))
        return NULL;
    size_t slot;
    if (as_size(slot_obj, &slot) < 0)
        return NULL;
    KeyArray keys;
    if (key_array_open(keys_obj, "keys must be a sequence", &keys) < 0)
        return NULL;
    int rc = 0;
    if (slot < self->t.nslots && self->t.slots[slot].used)
        rc = table_remove(&self->t, &self->t.slots[slot], keys.items, (size_t)keys.n,
                          (uint8_t)(tier_bits & KV_ALL_TIERS));
    key_array_close(&keys);
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Table_clear_slot(TableObject *self, PyObject *slot_obj)
{
    size_t slot;
    if (as_size(slot_obj, &slot) < 0)
        return NULL;
    if (table_clear(&self->t, slot) < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Table_oldest(TableObject *self, PyObject *slot_obj)
{
    size_t slot;
    if (as_size(slot_obj, &slot) < 0)
        return NULL;
    const Slot *s = table_slot_if(&self->t, slot);
    if (s == NULL || !s->has_lru)
        Py_RETURN_NONE;
    const NodeMapCell *cell = NodeMap_find(&s->nodes, s->head);
    return Py_BuildValue("(Kd)", (unsigned long long)s->head, cell->val.stamp);
}

static PyObject *Table_evict(TableObject *self, PyObject *args)
{
    PyObject *slot_obj, *key_obj;
    if (!PyArg_ParseTuple(args, "OO", &slot_obj, &key_obj))
        return NULL;
    size_t slot;
    uint64_t key;
    if (as_size(slot_obj, &slot) < 0 || as_u64(key_obj, &key) < 0)
        return NULL;
    if (slot < self->t.nslots && self->t.slots[slot].used &&
        table_drop(&self->t, &self->t.slots[slot], key, KV_ALL_TIERS) < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *Table_prune_leaf(TableObject *self, PyObject *args)
{
    PyObject *slot_obj;
    long second_chances;
    if (!PyArg_ParseTuple(args, "Ol", &slot_obj, &second_chances))
        return NULL;
    size_t slot;
    if (as_size(slot_obj, &slot) < 0)
        return NULL;
    if (second_chances < 0)
        second_chances = 0;
    int rc = table_prune_leaf(&self->t, slot, second_chances);
    if (rc < 0)
        return PyErr_NoMemory();
    return PyBool_FromLong(rc);
}

typedef struct {
    const Keys *keys;
    int failed;
} QueryKeys;

static uint64_t query_key_at(void *ctx, size_t i)
{
    QueryKeys *q = (QueryKeys *)ctx;
    uint64_t key = 0;
    if (!q->failed && keys_get(q->keys, (Py_ssize_t)i, &key) < 0)
        q->failed = 1;
    return key;
}

/* find_matches(keys) -> [(slot, gpu_end, cpu_end, any_end), ...] for slots holding keys[0] */
static PyObject *Table_find_matches(TableObject *self, PyObject *keys_obj)
{
    Keys k;
    if (keys_open(keys_obj, &k, "keys must be a sequence") < 0)
        return NULL;
    QueryKeys ctx = {&k, 0};
    KeySource q = {query_key_at, &ctx, (size_t)k.n};
    PyObject *out = PyList_New(0);
    if (out == NULL || q.n == 0) {
        keys_close(&k);
        return out;
    }
    Search *found = (Search *)malloc((self->t.nslots + 1) * sizeof(Search));
    if (found == NULL) {
        keys_close(&k);
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    size_t count = table_find(&self->t, &q, found);
    for (size_t i = 0; i < count && !ctx.failed; i++) {
        const Search *x = &found[i];
        PyObject *row = Py_BuildValue("(nnnn)", (Py_ssize_t)x->index, (Py_ssize_t)x->ends[0],
                                      (Py_ssize_t)x->ends[1], (Py_ssize_t)x->ends[2]);
        if (row == NULL || PyList_Append(out, row) < 0) {
            Py_XDECREF(row);
            Py_DECREF(out);
            free(found);
            keys_close(&k);
            return NULL;
        }
        Py_DECREF(row);
    }
    free(found);
    keys_close(&k);
    if (ctx.failed) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *Table_entry_count(TableObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong(self->t.entries);
}

static PyObject *Table_block_count(TableObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSize_t(self->t.links.len);
}

static PyObject *Table_slot_info(TableObject *self, PyObject *slot_obj)
{
    size_t slot;
    if (as_size(slot_obj, &slot) < 0)
        return NULL;
    const Slot *s = table_slot_if(&self->t, slot);
    if (s == NULL)
        return Py_BuildValue("(nLLLn)", (Py_ssize_t)0, 0LL, 0LL, 0LL, (Py_ssize_t)0);
    size_t orphans = s->orphans[0].len + s->orphans[1].len + s->orphans[2].len;
    return Py_BuildValue("(nLLLn)", (Py_ssize_t)s->nodes.len, (long long)s->counts[0],
                         (long long)s->counts[1], (long long)s->counts[2], (Py_ssize_t)orphans);
}

static PyObject *Table_memory_bytes(TableObject *self, PyObject *Py_UNUSED(ignored))
{
    const Table *t = &self->t;
    size_t total = t->links.cap * sizeof(LinkMapCell) + t->nslots * sizeof(Slot);
    for (size_t i = 0; i < t->nslots; i++) {
        const Slot *s = &t->slots[i];
        total += s->nodes.cap * sizeof(NodeMapCell);
        for (int c = 0; c < 3; c++)
            total += s->orphans[c].cap * sizeof(DepthMapCell);
    }
    total += t->cap_more * sizeof(KeySet) + t->cap_free_more * sizeof(uint32_t);
    for (uint32_t i = 1; i < t->nmore; i++)
        total += t->more[i].cap * sizeof(KeySetCell);
    return PyLong_FromSize_t(total);
}

/* holds(slot, key) -> bool: the slot holds the key in some tier */
static PyObject *Table_holds(TableObject *self, PyObject *args)
{
    PyObject *slot_obj, *key_obj;
    if (!PyArg_ParseTuple(args, "OO", &slot_obj, &key_obj))
        return NULL;
    size_t slot;
    uint64_t key;
    if (as_size(slot_obj, &slot) < 0 || as_u64(key_obj, &key) < 0)
        return NULL;
    const Slot *s = table_slot_if(&self->t, slot);
    return PyBool_FromLong(s != NULL && slot_tiers(s, key) != 0);
}

/* held_keys(slot) -> bytes: the keys the slot holds, as uint64 in native byte order */
static PyObject *Table_held_keys(TableObject *self, PyObject *slot_obj)
{
    size_t slot;
    if (as_size(slot_obj, &slot) < 0)
        return NULL;
    const Slot *s = table_slot_if(&self->t, slot);
    size_t n = s == NULL ? 0 : s->nodes.len;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 8));
    if (out == NULL)
        return NULL;
    uint64_t *keys = (uint64_t *)PyBytes_AS_STRING(out);
    size_t k = 0;
    for (size_t i = 0; s != NULL && i < s->nodes.cap && k < n; i++) {
        if (s->nodes.cells[i].val.used)
            memcpy(&keys[k++], &s->nodes.cells[i].key, 8);
    }
    return out;
}

static PyObject *Table_largest_slot(TableObject *self, PyObject *Py_UNUSED(ignored))
{
    size_t slot;
    if (!table_largest(&self->t, &slot))
        Py_RETURN_NONE;
    return PyLong_FromSize_t(slot);
}

static PyMethodDef Table_methods[] = {
    {"store", (PyCFunction)Table_store, METH_VARARGS,
     "store(slot, keys, tier, parent, stamp): hold a chain of keys in a tier"},
    {"remove", (PyCFunction)Table_remove, METH_VARARGS,
     "remove(slot, keys, tier_bits): the keys leave those tiers"},
    {"clear_slot", (PyCFunction)Table_clear_slot, METH_O, "forget every block of a slot"},
    {"oldest", (PyCFunction)Table_oldest, METH_O, "(key, stamp) least recently stored, or None"},
    {"evict", (PyCFunction)Table_evict, METH_VARARGS, "evict(slot, key): drop from every tier"},
    {"prune_leaf", (PyCFunction)Table_prune_leaf, METH_VARARGS,
     "prune_leaf(slot, second_chances) -> bool: evict the least recently stored leaf"},
    {"find_matches", (PyCFunction)Table_find_matches, METH_O,
     "find_matches(keys) -> [(slot, gpu_end, cpu_end, any_end)]"},
    {"entry_count", (PyCFunction)Table_entry_count, METH_NOARGS, "(block, slot) entries"},
    {"block_count", (PyCFunction)Table_block_count, METH_NOARGS, "distinct block records"},
    {"slot_info", (PyCFunction)Table_slot_info, METH_O,
     "(entries, gpu, cpu, disk, orphans) of a slot"},
    {"memory_bytes", (PyCFunction)Table_memory_bytes, METH_NOARGS, "bytes allocated"},
    {"holds", (PyCFunction)Table_holds, METH_VARARGS,
     "holds(slot, key) -> bool: the slot holds the key in some tier"},
    {"held_keys", (PyCFunction)Table_held_keys, METH_O,
     "held_keys(slot) -> bytes: the keys the slot holds (uint64, native byte order)"},
    {"largest_slot", (PyCFunction)Table_largest_slot, METH_NOARGS,
     "the slot with the most entries (the lowest on ties), or None"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "index._native.Table",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "kvgate's native block table (integer cache-domain slots).",
    .tp_new = Table_new,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
};

/* ======================================================================= KeyMap */
/* Map hashes[i] -> keys[i] (cells 8 ahead are fetched meanwhile). -1: no memory. */
static int map_put_keys(U64Map *m, const uint64_t *hashes, const uint64_t *keys, size_t n)
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
static size_t map_take_keys(U64Map *m, const uint64_t *hashes, size_t n, uint64_t *out)
{
    size_t found = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t key;
        if (U64Map_remove(m, hashes[i], &key))
            out[found++] = key;
    }
    return found;
}

typedef struct {
    PyObject_HEAD
    U64Map m;
    PyObject *array_type; /* array.array, for take_many's result */
} KeyMapObject;

static PyObject *import_array_type(void)
{
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL)
        return NULL;
    PyObject *array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    return array_type;
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

static PyTypeObject KeyMapType = {
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

/* ======================================================================= block keys */
typedef struct {
    PyObject *array_type; /* array.array, to return keys without a Python int each */
} ModuleState;

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

static int block_size_arg(Py_ssize_t block_size)
{
    if (block_size <= 0 || block_size > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "block_size must be in 1..2**20, got %zd", block_size);
        return -1;
    }
    return 0;
}

/* chain_keys(packed, block_size, prev): keys of the full blocks of uint32-LE token bytes. */
static PyObject *chain_keys(PyObject *Py_UNUSED(module), PyObject *args)
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

/* ---------------------------------------------------------------- wire readers */
enum { WIRE_OK = 0, WIRE_MALFORMED = -1, WIRE_NO_MEMORY = -2 };

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

/* A msgpack array of exactly ``expect`` token ids as uint32-LE bytes in ``*packed`` (malloc'd;
 * the caller frees it). */
static int read_tokens(const uint8_t *buf, size_t len, size_t expect, uint8_t **packed)
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

/* One engine block hash folded like index/events.py's fold_hash: ints modulo 2**64 (SGLang's
 * signed hashes), raw bytes by their last 8 bytes read big-endian (vLLM, int hashes off). */
static int read_hash(Reader *r, uint64_t *out)
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

/* A msgpack array of block hashes, folded, into ``*hashes`` (malloc'd; the caller frees it). */
static int read_hashes(const uint8_t *buf, size_t len, uint64_t **hashes, size_t *count)
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

static void chain_into(const uint8_t *packed, size_t blocks, size_t step, uint64_t prev,
                       uint64_t *keys)
{
    for (size_t i = 0; i < blocks; i++)
        keys[i] = prev = kv_xxh3_64(packed + i * step, step, prev);
}

static PyObject *wire_error(int rc, const char *what)
{
    if (rc == WIRE_NO_MEMORY)
        return PyErr_NoMemory();
    PyErr_SetString(PyExc_ValueError, what);
    return NULL;
}

/* chain_keys_msgpack(raw, block_size, prev, blocks) -> array('Q'): ``raw`` is the msgpack
 * array of an event's token ids; it must hold exactly ``blocks`` full blocks of uint32 ids. */
static PyObject *chain_keys_msgpack(PyObject *module, PyObject *args)
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

/* fold_hashes(raw) -> array('Q'): a msgpack array of block hashes, each folded to uint64. */
static PyObject *fold_hashes(PyObject *module, PyObject *raw)
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

/* ======================================================================= batch ingestion */
/* A whole KV-event payload applied in C, for the shape engines send nearly always: GPU-tier
 * BlockStored / BlockRemoved events without LoRA or cache salt, for the feed's own data-parallel
 * rank and block size. The batch is parsed and checked in full first; anything else (another
 * tier, LoRA, a salt, AllBlocksCleared, another rank or block size, a malformed payload) leaves
 * everything untouched and returns None: index/ingest.py then takes its general path, which
 * gives the same result (tests/test_native_ingest.py checks the two against each other). */

enum { EV_STORED = 1, EV_REMOVED = 2 };
enum { F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
       F_EXTRA_KEYS, F_COUNT };

static const char *const FIELD_NAMES[F_COUNT] = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size",
    "lora_id",      "medium",            "lora_name", "extra_keys",
};
static const int STORED_ORDER[] = {F_HASHES, F_PARENT,    F_TOKENS,    F_BLOCK_SIZE,
                                   F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA_KEYS};
static const int REMOVED_ORDER[] = {F_HASHES, F_MEDIUM};

typedef struct {
    int kind;
    const uint8_t *field[F_COUNT]; /* each field's bytes (NULL: absent) */
    size_t len[F_COUNT];
} WireEvent;

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

static int field_is_nil(const WireEvent *ev, int f)
{
    return ev->field[f] == NULL || (ev->len[f] == 1 && ev->field[f][0] == 0xC0);
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

/* Everything about one batch: counts reported back to Python. */
typedef struct {
    Table *table;
    size_t slot;
    U64Map *known;
    uint64_t block_size, root_seed;
    int64_t max_entries;
    size_t max_blocks;
    Py_ssize_t stored_events, stored_blocks, removed_events, removed_blocks;
    Py_ssize_t malformed, unknown_parent, pruned, pruned_parent;
} Batch;

/* EventIndex's cap: prune least recently stored leaves of the largest domain. */
static int prune_to_cap(Batch *b)
{
    size_t slot;
    while (b->table->entries > b->max_entries && table_largest(b->table, &slot)) {
        int rc = table_prune_leaf(b->table, slot, KV_SECOND_CHANCES);
        if (rc <= 0)
            return rc;
        b->pruned++;
    }
    return 0;
}

static int apply_stored(Batch *b, const WireEvent *ev)
{
    uint64_t *hashes = NULL, *keys = NULL, prev = b->root_seed;
    uint8_t *packed = NULL;
    size_t n;
    int has_parent = !field_is_nil(ev, F_PARENT), rc;
    if (has_parent) {
        Reader r = {ev->field[F_PARENT], ev->field[F_PARENT] + ev->len[F_PARENT]};
        uint64_t parent_hash;
        read_hash(&r, &parent_hash); /* checked by event_supported */
        const U64MapCell *cell = U64Map_find(b->known, parent_hash);
        if (cell == NULL) {
            b->unknown_parent++;
            return 0;
        }
        prev = cell->val;
        const Slot *s = table_slot_if(b->table, b->slot);
        if (s == NULL || !slot_tiers(s, prev)) { /* the cap pruned it: skipped, counted */
            b->pruned_parent++;
            return 0;
        }
    }
    rc = read_hashes(ev->field[F_HASHES], ev->len[F_HASHES], &hashes, &n);
    if (rc == WIRE_OK)
        rc = read_tokens(ev->field[F_TOKENS], ev->len[F_TOKENS], n * b->block_size, &packed);
    if (rc == WIRE_OK && (keys = (uint64_t *)malloc(n * 8 + 8)) == NULL)
        rc = WIRE_NO_MEMORY;
    if (rc == WIRE_OK) {
        uint64_t parent = prev;
        chain_into(packed, n, b->block_size * 4, prev, keys);
        if (map_put_keys(b->known, hashes, keys, n) < 0)
            rc = WIRE_NO_MEMORY;
        if (rc == WIRE_OK &&
            table_store(b->table, b->slot, keys, n, 0, has_parent, parent, 0.0) < 0)
            rc = WIRE_NO_MEMORY;
        if (rc == WIRE_OK && prune_to_cap(b) < 0)
            rc = WIRE_NO_MEMORY;
        if (rc == WIRE_OK) {
            b->stored_events++;
            b->stored_blocks += (Py_ssize_t)n;
        }
    } else if (rc == WIRE_MALFORMED) {
        b->malformed++;
        rc = WIRE_OK;
    }
    free(hashes);
    free(packed);
    free(keys);
    return rc;
}

static int apply_removed(Batch *b, const WireEvent *ev)
{
    uint64_t *hashes;
    size_t n;
    int rc = read_hashes(ev->field[F_HASHES], ev->len[F_HASHES], &hashes, &n);
    if (rc != WIRE_OK)
        return rc; /* checked by event_supported: only memory can fail here */
    size_t gone = map_take_keys(b->known, hashes, n, hashes);
    if (gone && b->slot < b->table->nslots && b->table->slots[b->slot].used &&
        table_remove(b->table, &b->table->slots[b->slot], hashes, gone, 1) < 0)
        rc = WIRE_NO_MEMORY;
    b->removed_events++;
    b->removed_blocks += (Py_ssize_t)gone;
    free(hashes);
    return rc;
}

/* The first hash an event looks up: a removal's first block, a store's parent. */
static int first_lookup(const WireEvent *ev, uint64_t *hash)
{
    if (ev->kind == EV_REMOVED) {
        Reader r = {ev->field[F_HASHES], ev->field[F_HASHES] + ev->len[F_HASHES]};
        size_t n;
        return mp_array(&r, &n) == 0 && n > 0 && read_hash(&r, hash) == 0;
    }
    if (field_is_nil(ev, F_PARENT))
        return 0;
    Reader r = {ev->field[F_PARENT], ev->field[F_PARENT] + ev->len[F_PARENT]};
    return read_hash(&r, hash) == 0;
}

/* Software pipeline over a batch of small events (removals come one block per event): the
 * engine-hash cell of event i+4 is fetched, then the block cells of event i+2. */
static void prefetch_hash(const Batch *b, const WireEvent *ev)
{
    uint64_t hash;
    if (first_lookup(ev, &hash))
        U64Map_prefetch(b->known, hash);
}

static void prefetch_blocks(const Batch *b, const WireEvent *ev)
{
    uint64_t hash;
    if (ev->kind != EV_REMOVED || !first_lookup(ev, &hash) || b->slot >= b->table->nslots)
        return;
    const U64MapCell *cell = U64Map_find(b->known, hash);
    if (cell != NULL) {
        NodeMap_prefetch(&b->table->slots[b->slot].nodes, cell->val);
        LinkMap_prefetch(&b->table->links, cell->val);
    }
}

/* Parse and check a payload; the events go to ``*events`` (malloc'd). 0: supported. */
static int parse_batch(const uint8_t *buf, size_t len, int64_t rank, const Batch *b,
                       double *ts, WireEvent **events, size_t *count)
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
            !event_supported(&evs[i], b->block_size, b->max_blocks)) {
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

/* ingest_batch(payload, table, slot, keymap, rank, block_size, root_seed, max_entries,
 *              max_blocks)
 *   -> (ts, events, stored_events, stored_blocks, removed_events, removed_blocks, malformed,
 *       unknown_parent, pruned, pruned_parent), or None when the payload is not for this
 *   path. */
static PyObject *ingest_batch(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer view;
    PyObject *table_obj, *keymap_obj, *seed_obj;
    Py_ssize_t slot, rank, block_size, max_entries, max_blocks;
    if (!PyArg_ParseTuple(args, "y*O!nO!nnOnn", &view, &TableType, &table_obj, &slot,
                          &KeyMapType, &keymap_obj, &rank, &block_size, &seed_obj,
                          &max_entries, &max_blocks))
        return NULL;
    Batch b = {0};
    b.table = &((TableObject *)table_obj)->t;
    b.known = &((KeyMapObject *)keymap_obj)->m;
    b.slot = (size_t)slot;
    b.block_size = (uint64_t)block_size;
    b.max_entries = max_entries;
    b.max_blocks = max_blocks < 0 ? 0 : (size_t)max_blocks;
    PyObject *out = NULL;
    WireEvent *events = NULL;
    size_t count = 0;
    double ts = 0;
    if (slot < 0 || block_size_arg(block_size) < 0 || as_u64(seed_obj, &b.root_seed) < 0)
        goto done;
    if (parse_batch((const uint8_t *)view.buf, (size_t)view.len, rank, &b, &ts, &events,
                    &count) < 0) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    for (size_t i = 0; i < count; i++) {
        if (i + 4 < count)
            prefetch_hash(&b, &events[i + 4]);
        if (i + 2 < count)
            prefetch_blocks(&b, &events[i + 2]);
        int rc = events[i].kind == EV_STORED ? apply_stored(&b, &events[i])
                                             : apply_removed(&b, &events[i]);
        if (rc == WIRE_NO_MEMORY) {
            PyErr_NoMemory();
            goto done;
        }
    }
    out = Py_BuildValue("(dnnnnnnnnn)", ts, (Py_ssize_t)count, b.stored_events,
                        b.stored_blocks, b.removed_events, b.removed_blocks, b.malformed,
                        b.unknown_parent, b.pruned, b.pruned_parent);
done:
    free(events);
    PyBuffer_Release(&view);
    return out;
}

/* repeats_a_key(payload) -> bool: a map event of the batch holds a known key twice */
static PyObject *repeats_a_key(PyObject *Py_UNUSED(module), PyObject *payload)
{
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int found = batch_repeats_a_key((const uint8_t *)view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyBool_FromLong(found);
}

static PyObject *xxh3_64(PyObject *Py_UNUSED(module), PyObject *args)
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

/* ======================================================================= module */
static PyMethodDef module_methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(packed, block_size, prev) -> keys of the full blocks of uint32-LE token ids"},
    {"chain_keys_msgpack", chain_keys_msgpack, METH_VARARGS,
     "chain_keys_msgpack(raw, block_size, prev, blocks) -> array('Q') of keys from a msgpack "
     "id array"},
    {"fold_hashes", fold_hashes, METH_O,
     "fold_hashes(raw) -> array('Q'): a msgpack array of block hashes folded to uint64"},
    {"ingest_batch", ingest_batch, METH_VARARGS,
     "ingest_batch(payload, table, slot, keymap, rank, block_size, root_seed, max_entries, "
     "max_blocks) -> counts, or None when the payload needs the general path"},
    {"repeats_a_key", repeats_a_key, METH_O,
     "repeats_a_key(payload) -> bool: a map event of the KV-event batch holds a key twice"},
    {"xxh3_64", xxh3_64, METH_VARARGS, "xxh3_64(data, seed) -> int"},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module)
{
    ModuleState *state = (ModuleState *)PyModule_GetState(module);
    state->array_type = import_array_type();
    if (state->array_type == NULL)
        return -1;
    if (PyType_Ready(&TableType) < 0 || PyType_Ready(&KeyMapType) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "Table", (PyObject *)&TableType) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "KeyMap", (PyObject *)&KeyMapType);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    ModuleState *state = (ModuleState *)PyModule_GetState(module);
    Py_VISIT(state->array_type);
    return 0;
}

static int module_clear(PyObject *module)
{
    ModuleState *state = (ModuleState *)PyModule_GetState(module);
    Py_CLEAR(state->array_type);
    return 0;
}

static void module_free(void *module) { (void)module_clear((PyObject *)module); }

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "index._native",
    .m_doc = "kvgate's index hot paths in C: block table, engine-hash map, chained block keys.",
    .m_size = sizeof(ModuleState),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&native_module); }
