/*
 * index._native - the index layer's hot paths in C (see docs/block-keys.md, "Native core").
 * This file is the module itself: its functions, its two types, its state. The parts:
 *
 *   Table      table_type.c over table.h: the block table with integer cache-domain slots;
 *              index/table/_native_table.py wraps it in the table protocol of index/table/.
 *              Table.ingest (ingest.c) applies a whole KV-event payload to a slot and its
 *              KeyMap; Table.prune_to keeps a cap (table.h's one pruning rule).
 *   KeyMap     keymap_type.c: engine block hash -> kvgate block key, one per cache domain
 *              (index/events/_translate.py).
 *   chain_keys / chain_keys_msgpack / xxh3_64
 *              keys.c: kvgate's chained block keys from packed uint32 token ids, or straight
 *              from the msgpack array of a KV event's ``token_ids`` (no Python int per token).
 *   fold_hashes / repeats_a_key
 *              wire.c (the msgpack reader of KV events): an event's block hashes as
 *              array('Q'), folded; the duplicate-key rule both decode paths apply.
 *
 * Header-only parts: maps.h (keyed hash maps), table.h (the table), msgpack.h (a bounded
 * reader), xxh3.h (the hash). The module has no global mutable state (its one reference,
 * array.array, is module state). Tables and maps allocate with malloc/mmap, which tracemalloc
 * does not see: memory_bytes() tells what they hold.
 */
#include "native.h"

static PyMethodDef module_methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(packed, block_size, prev) -> keys of the full blocks of uint32-LE token ids"},
    {"chain_keys_msgpack", chain_keys_msgpack, METH_VARARGS,
     "chain_keys_msgpack(raw, block_size, prev, blocks) -> array('Q') of keys from a msgpack "
     "id array"},
    {"fold_hashes", fold_hashes, METH_O,
     "fold_hashes(raw) -> array('Q'): a msgpack array of block hashes folded to uint64"},
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
    .m_name = "kvgate.index._native",
    .m_doc = "kvgate's index hot paths in C: block table, engine-hash map, chained block keys.",
    .m_size = sizeof(ModuleState),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&native_module); }
