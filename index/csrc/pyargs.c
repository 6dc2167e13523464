/*
 * pyargs.c - Python arguments to C and back: ints as uint64 and sizes, keys given as a list or
 * as a uint64 buffer (array('Q'): no Python int per key), keys returned as array('Q').
 */
#include "native.h"

int as_size(PyObject *obj, size_t *out)
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

int keys_open(PyObject *obj, Keys *k, const char *what)
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

void keys_close(Keys *k)
{
    if (k->has_view)
        PyBuffer_Release(&k->view);
    Py_XDECREF(k->fast);
    k->has_view = 0;
    k->fast = NULL;
}

int key_array_open(PyObject *obj, const char *what, KeyArray *a)
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

void key_array_close(KeyArray *a)
{
    keys_close(&a->keys);
    PyMem_RawFree(a->heap);
    a->heap = NULL;
}

/* An array('Q') holding ``items``. */
PyObject *new_u64_array(PyObject *array_type, const uint64_t *items, size_t n)
{
    PyObject *packed = PyBytes_FromStringAndSize((const char *)items, (Py_ssize_t)(n * 8));
    if (packed == NULL)
        return NULL;
    PyObject *out = PyObject_CallFunction(array_type, "sO", "Q", packed);
    Py_DECREF(packed);
    return out;
}

/* array.array, the type keys are returned as. */
PyObject *import_array_type(void)
{
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL)
        return NULL;
    PyObject *array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    return array_type;
}
