/*
 * The module, and the two base types Python subclasses: BatchBase, the native part of
 * ring/batch.py's Batch (the field arrays of one held slot: the cursor's release pass
 * judges the slot free once neither a Batch nor any array of its views tuple is
 * referenced, _cursor.c), and LoaderBase, which makes next(loader) native.
 */
#include "_cursor.h"

/* ---- BatchBase ---------------------------------------------------------------------- */

static PyObject *batch_released_error(BatchBase *self) {
    PyErr_Format(PyExc_RuntimeError, "batch %llu was released; its arrays are no longer available", self->step);
    return NULL;
}

static PyObject *batch_subscript(BatchBase *self, PyObject *name) {
    if (self->views == NULL) {
        return batch_released_error(self);
    }
    Py_ssize_t count = PyTuple_GET_SIZE(self->names);
    for (Py_ssize_t i = 0; i < count; i++) { /* Identity first: field names are usually interned. */
        if (PyTuple_GET_ITEM(self->names, i) == name) {
            return Py_NewRef(PyTuple_GET_ITEM(self->views, i));
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        int equal = PyObject_RichCompareBool(PyTuple_GET_ITEM(self->names, i), name, Py_EQ);
        if (equal < 0) {
            return NULL;
        }
        if (equal) {
            return Py_NewRef(PyTuple_GET_ITEM(self->views, i));
        }
    }
    PyErr_SetObject(PyExc_KeyError, name);
    return NULL;
}

static Py_ssize_t batch_length(BatchBase *self) {
    return self->views == NULL ? 0 : PyTuple_GET_SIZE(self->names);
}

static PyObject *batch_iter(BatchBase *self) {
    if (self->views == NULL) {
        PyObject *empty = PyTuple_New(0);
        PyObject *iterator = empty == NULL ? NULL : PyObject_GetIter(empty);
        Py_XDECREF(empty);
        return iterator;
    }
    return PyObject_GetIter(self->names);
}

static PyObject *batch_release(BatchBase *self, PyObject *Py_UNUSED(ignored)) {
    Py_CLEAR(self->views);
    Py_RETURN_NONE;
}

static PyObject *batch_get_indices(BatchBase *self, void *Py_UNUSED(closure)) {
    if (self->views == NULL) {
        Py_RETURN_NONE;
    }
    return Py_NewRef(PyTuple_GET_ITEM(self->views, PyTuple_GET_SIZE(self->views) - 1));
}

static PyObject *batch_get_released(BatchBase *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->views == NULL);
}

static void batch_dealloc(BatchBase *self) {
    Py_CLEAR(self->views);
    Py_CLEAR(self->names);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMappingMethods batch_mapping = {
    .mp_length = (lenfunc)batch_length,
    .mp_subscript = (binaryfunc)batch_subscript,
};

static PyMethodDef batch_methods[] = {
    {"release", (PyCFunction)batch_release, METH_NOARGS,
     "Gives up this Batch's references; the slot is reused once no array view of it remains."},
    {NULL},
};

static PyMemberDef batch_members[] = {
    {"step", T_ULONGLONG, offsetof(BatchBase, step), READONLY, "the step this batch is"},
    {NULL},
};

static PyGetSetDef batch_getset[] = {
    {"indices", (getter)batch_get_indices, NULL, "the step's row indices (uint64), None once released", NULL},
    {"released", (getter)batch_get_released, NULL, "whether release() was called", NULL},
    {NULL},
};

PyTypeObject BatchBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader._cursor.BatchBase",
    .tp_doc = "The native part of Batch: field arrays of one held slot.",
    .tp_basicsize = sizeof(BatchBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = NULL, /* Batches come from the loader only. */
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_as_mapping = &batch_mapping,
    .tp_iter = (getiterfunc)batch_iter,
    .tp_methods = batch_methods,
    .tp_members = batch_members,
    .tp_getset = batch_getset,
};

/* ---- LoaderBase --------------------------------------------------------------------- */

/* The base of ShmDataLoader, for one thing: next(loader) in C. A step-based trainer calls
 * next(loader) once per step, with its caches cold; a Python __next__ forwarding to the
 * cursor would add an interpreter frame to every one. The loader is not the cursor: it
 * holds one (the session's), and this forwards to it. */
typedef struct {
    PyObject_HEAD
    PyObject *cursor; /* the session's Cursor; NULL until the loader is built */
} LoaderBase;

static PyObject *loader_next(LoaderBase *self) {
    PyObject *cursor = self->cursor;
    if (cursor == NULL || Py_TYPE(cursor) != &CursorType) {
        PyErr_SetString(PyExc_RuntimeError, "the loader was never set up");
        return NULL;
    }
    Py_INCREF(cursor); /* Held across next(): code it runs may replace the attribute. */
    PyObject *batch = cursor_next((Cursor *)cursor);
    Py_DECREF(cursor);
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
    {"_cursor", T_OBJECT, offsetof(LoaderBase, cursor), 0, "the cursor next(loader) forwards to"},
    {NULL},
};

PyTypeObject LoaderBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader._cursor.LoaderBase",
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

static struct PyModuleDef cursor_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmloader._cursor",
    .m_doc = "The trainer's native next() (see the comment at the top of _cursor.c).",
    .m_size = -1,
};

PyTypeObject *cursor_ndarray_type = NULL;

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
        PyType_Ready(&BatchBaseType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&cursor_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Cursor", (PyObject *)&CursorType) < 0 ||
        PyModule_AddObjectRef(module, "LoaderBase", (PyObject *)&LoaderBaseType) < 0 ||
        PyModule_AddObjectRef(module, "BatchBase", (PyObject *)&BatchBaseType) < 0 ||
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
