/*
 * BatchBase, the native part of ring/batch.py's Batch: the field arrays of one held slot.
 * The cursor's release pass (_cursor.c) judges the slot free once neither a Batch nor any
 * array of its views tuple is referenced. The bottom of the extension: it calls no other
 * file (_cursor.h).
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
    .tp_name = "shmloader.ring._cursor.BatchBase",
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
