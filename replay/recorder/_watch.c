/* The state digest's watch (recorder/digest.py), its dict checks in one C loop each: after a training step most of
 * the dicts are out of the cache, and a tight loop keeps many of their misses in flight at once where Python's
 * iterators take them one after another. Read-only, and nothing is allocated. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* same_dicts(dicts, sizes, entries, leaf, nodes) -> bool: each dict still holds sizes[i] entries, and its entries
 * in order are those of `entries` (key, value, key, value, ...): the same key objects, and the same value objects
 * where the snapshot holds one, or, where it holds `leaf`, a value that is not an instance of `nodes`. */
static PyObject *same_dicts(PyObject *self, PyObject *args)
{
    PyObject *dicts, *sizes, *entries, *leaf, *nodes;
    if (!PyArg_ParseTuple(args, "O!O!O!OO", &PyList_Type, &dicts, &PyList_Type, &sizes, &PyList_Type, &entries,
                          &leaf, &nodes))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(dicts), at = 0, total = PyList_GET_SIZE(entries);
    if (PyList_GET_SIZE(sizes) != n) {
        PyErr_SetString(PyExc_ValueError, "one size per dict");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(dicts, i);
        if (!PyDict_Check(d) || PyDict_GET_SIZE(d) != PyLong_AsSsize_t(PyList_GET_ITEM(sizes, i)))
            Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(dicts, i), *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(d, &pos, &key, &value)) {
            if (at + 2 > total || key != PyList_GET_ITEM(entries, at))
                Py_RETURN_FALSE;
            PyObject *held = PyList_GET_ITEM(entries, at + 1);
            if (held == leaf) {
                int node = PyObject_IsInstance(value, nodes);
                if (node < 0)
                    return NULL;
                if (node)
                    Py_RETURN_FALSE;
            } else if (value != held) {
                Py_RETURN_FALSE;
            }
            at += 2;
        }
    }
    return PyBool_FromLong(at == total);
}

/* same_fields(dicts, names, objects) -> bool: dicts[i][names[i]] is objects[i], for every i. */
static PyObject *same_fields(PyObject *self, PyObject *args)
{
    PyObject *dicts, *names, *objects;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyList_Type, &dicts, &PyList_Type, &names, &PyList_Type, &objects))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(dicts);
    if (PyList_GET_SIZE(names) != n || PyList_GET_SIZE(objects) != n) {
        PyErr_SetString(PyExc_ValueError, "one name and one object per dict");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(dicts, i);
        if (!PyDict_Check(d))
            Py_RETURN_FALSE;
        PyObject *value = PyDict_GetItemWithError(d, PyList_GET_ITEM(names, i));   /* borrowed */
        if (value == NULL && PyErr_Occurred())
            return NULL;
        if (value != PyList_GET_ITEM(objects, i))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"same_dicts", same_dicts, METH_VARARGS,
     "same_dicts(dicts, sizes, entries, leaf, nodes) -> bool: each dict holds as many entries as before, the same "
     "keys in order, and the same values (`leaf` in `entries`: a value that is still not one of `nodes`)."},
    {"same_fields", same_fields, METH_VARARGS,
     "same_fields(dicts, names, objects) -> bool: dicts[i][names[i]] is objects[i], for every i."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_watch",
                                    "The state digest's watch: its dict checks in C (see _watch.c).", -1, methods};

PyMODINIT_FUNC PyInit__watch(void)
{
    return PyModule_Create(&module);
}
