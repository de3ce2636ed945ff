/*
 * The module shmloader.ring._cursor, and LoaderBase, the base of ShmDataLoader, which
 * makes next(loader) native. The top of the extension: it calls the other files
 * (_cursor_type.c, _cursor.c, _cursor_batch.c, _cursor_seeds.c), and none calls it (_cursor.h).
 */
#include "_cursor.h"

/* ---- LoaderBase --------------------------------------------------------------------- */

/* The base of ShmDataLoader, for one thing: next(loader) in C. A step-based trainer calls
 * next(loader) once per step, with its caches cold; a Python __next__ forwarding to the
 * cursor would add an interpreter frame to every one. The loader is not the cursor: it
 * holds the session's iterator, the cursor itself, or with readers=0 the iterator that
 * lets the local reader fill each step before the cursor takes it (readers/local.py), and
 * this forwards to it. */
typedef struct {
    PyObject_HEAD
    PyObject *cursor; /* the session's iterator (a Cursor, or any iterator); NULL until the loader is built */
} LoaderBase;

static PyObject *loader_next(LoaderBase *self) {
    PyObject *iterator = self->cursor;
    if (iterator == NULL || !PyIter_Check(iterator)) {
        PyErr_SetString(PyExc_RuntimeError, "the loader was never set up");
        return NULL;
    }
    Py_INCREF(iterator); /* Held across next(): code it runs may replace the attribute. */
    PyObject *batch = Py_TYPE(iterator) == &CursorType ? cursor_next((Cursor *)iterator)
                                                        : Py_TYPE(iterator)->tp_iternext(iterator);
    Py_DECREF(iterator);
    return batch;
}

static int loader_traverse(LoaderBase *self, visitproc visit, void *arg) {
    Py_VISIT(self->cursor);
    return 0;
}

static int loader_clear(LoaderBase *self) {
    Py_CLEAR(self->cursor);
    return 0;
}

static void loader_dealloc(LoaderBase *self) {
    PyObject_GC_UnTrack(self);
    loader_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef loader_members[] = {
    {"_cursor", T_OBJECT, offsetof(LoaderBase, cursor), 0,
     "the iterator next(loader) forwards to: the session's cursor, or readers=0's iterator over it"},
    {NULL},
};

static PyTypeObject LoaderBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader.ring._cursor.LoaderBase",
    .tp_doc = "The base of ShmDataLoader: next(loader) forwarded to its cursor in C.",
    .tp_basicsize = sizeof(LoaderBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)loader_dealloc,
    .tp_traverse = (traverseproc)loader_traverse,
    .tp_clear = (inquiry)loader_clear,
    .tp_iternext = (iternextfunc)loader_next,
    .tp_members = loader_members,
};

/* ---- Module ------------------------------------------------------------------------- */

static PyMethodDef cursor_functions[] = {
    {"write_generator_states", (PyCFunction)(void (*)(void))seeds_write, METH_FASTCALL,
     "write_generator_states(seed, addresses): a sample's MT19937 states written at the 7 addresses "
     "(_cursor_seeds.c)"},
    {"generator_words", (PyCFunction)(void (*)(void))seeds_words, METH_FASTCALL,
     "generator_words(seed, domain, width=0): the 624 state words of (seed, domain) as bytes, by one loop"},
    {NULL},
};

static struct PyModuleDef cursor_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmloader.ring._cursor",
    .m_doc = "The trainer's native next() (see the comment at the top of ring/_cursor.c), and a dataset "
             "sample's generator states (_cursor_seeds.c).",
    .m_size = -1,
    .m_methods = cursor_functions,
};

PyMODINIT_FUNC PyInit__cursor(void) {
    if (cursor_ndarray_type == NULL) { /* The one type a slot's arrays may have (is_ndarray). */
        PyObject *numpy = PyImport_ImportModule("numpy");
        PyObject *ndarray = numpy == NULL ? NULL : PyObject_GetAttrString(numpy, "ndarray");
        Py_XDECREF(numpy);
        if (ndarray == NULL) {
            return NULL;
        }
        if (!PyType_Check(ndarray)) {
            Py_DECREF(ndarray);
            PyErr_SetString(PyExc_ImportError, "numpy.ndarray is not a type");
            return NULL;
        }
        cursor_ndarray_type = (PyTypeObject *)ndarray; /* Kept for the process's lifetime. */
    }
    if (PyType_Ready(&CursorType) < 0 || PyType_Ready(&LoaderBaseType) < 0 ||
        PyType_Ready(&BatchBaseType) < 0 || seeds_ready() < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&cursor_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Cursor", (PyObject *)&CursorType) < 0 ||
        PyModule_AddObjectRef(module, "LoaderBase", (PyObject *)&LoaderBaseType) < 0 ||
        PyModule_AddObjectRef(module, "BatchBase", (PyObject *)&BatchBaseType) < 0 ||
        PyModule_AddObjectRef(module, "SampleSeeder", (PyObject *)&SampleSeederType) < 0 ||
        PyModule_AddIntConstant(module, "STEP_READY", STEP_READY) < 0 ||
        PyModule_AddIntConstant(module, "STEP_IN_FLIGHT", STEP_IN_FLIGHT) < 0 ||
        PyModule_AddIntConstant(module, "STEP_HELD", STEP_HELD) < 0 ||
        PyModule_AddIntConstant(module, "STEP_FAILED", STEP_FAILED) < 0 ||
        PyModule_AddIntConstant(module, "STEP_WRONG", STEP_WRONG) < 0 ||
        PyModule_AddIntConstant(module, "STEP_CLOSED", STEP_CLOSED) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
