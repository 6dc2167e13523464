/*
 * table_type.c - index._native.Table: the block table of table.h for Python, its cache
 * domains known as small integer slots (index/table/_native_table.py maps workers to them).
 */
#include "native.h"

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

/* prune_to(max_entries) -> int: the cap's pruning rule (table.h's table_prune_to) */
static PyObject *Table_prune_to(TableObject *self, PyObject *cap_obj)
{
    long long cap = PyLong_AsLongLong(cap_obj);
    if (cap == -1 && PyErr_Occurred())
        return NULL;
    long pruned = table_prune_to(&self->t, (int64_t)cap);
    return pruned < 0 ? PyErr_NoMemory() : PyLong_FromLong(pruned);
}

/* ingest(slot, payload, keymap, rank, block_size, root_seed, max_entries, max_blocks): see
 * ingest.c */
static PyObject *Table_ingest(TableObject *self, PyObject *args)
{
    return ingest_payload(&self->t, args);
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
    {"prune_to", (PyCFunction)Table_prune_to, METH_O,
     "prune_to(max_entries) -> int: evict least recently stored leaves of the largest slot "
     "(the lowest on ties) until at most max_entries entries are held; how many went"},
    {"ingest", (PyCFunction)Table_ingest, METH_VARARGS,
     "ingest(slot, payload, keymap, rank, block_size, root_seed, max_entries, max_blocks) -> "
     "counts, or None when the payload needs the general path"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "index._native.Table",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "kvgate's native block table (integer cache-domain slots).",
    .tp_new = Table_new,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
};

