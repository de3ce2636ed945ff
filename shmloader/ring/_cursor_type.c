/*
 * The Cursor type: building a cursor from its settings and callables, the methods the
 * session (shmloader/session.py) calls, garbage collection and weak references. What
 * next() does, and the cursor's teardown, are _cursor.c's; this file calls it and
 * _cursor_batch.c (BatchBase), and neither calls back (_cursor.h).
 */
#include "_cursor.h"

/* ---- Cursor methods (the API session.py uses) --------------------------------------- */

/* An O& converter: a Python int in [0, 2**64) (negative values raise, not wrap). */
static int u64_of(PyObject *value, void *out) {
    unsigned long long number = PyLong_AsUnsignedLongLong(value);
    if (number == (unsigned long long)-1 && PyErr_Occurred()) {
        return 0;
    }
    *(unsigned long long *)out = number;
    return 1;
}

/* Opens the named semaphores (the work semaphore and one ready per slot). */
static int open_semaphores(Cursor *self, PyObject *work_name, PyObject *ready_names) {
    const char *name = PyUnicode_AsUTF8(work_name);
    if (name == NULL) {
        return -1;
    }
    self->work = sem_open(name, 0);
    if (self->work == SEM_FAILED) {
        self->work = NULL;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        return -1;
    }
    self->ready_semaphores = PyMem_Calloc((size_t)self->slot_count, sizeof(sem_t *));
    if (self->ready_semaphores == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t s = 0; s < self->slot_count; s++) {
        name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(ready_names, s));
        if (name == NULL) {
            return -1;
        }
        sem_t *semaphore = sem_open(name, 0);
        if (semaphore == SEM_FAILED) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
            return -1;
        }
        self->ready_semaphores[s] = semaphore;
    }
    return 0;
}

/* Allocates the slot table and the snapshot block, and points each slot at its control
 * line and arrays. */
static int set_up_slots(Cursor *self, unsigned long long control_table, PyObject *views) {
    self->view_count = PyTuple_GET_SIZE(self->names) + 1;
    PyObject *first = PyTuple_GET_ITEM(views, 0);
    if (!PyTuple_Check(first) || PyTuple_GET_SIZE(first) != self->view_count) {
        PyErr_Format(PyExc_ValueError, "slot 0: expected a tuple of %zd arrays", self->view_count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->view_count; i++) {
        if (!is_ndarray(PyTuple_GET_ITEM(first, i))) {
            PyErr_SetString(PyExc_TypeError, "slot 0: expected numpy arrays");
            return -1;
        }
    }
    self->snapshot_words = cursor_snapshot_words(first);
    self->slots = PyMem_Calloc((size_t)self->slot_count, sizeof(Slot));
    self->snapshots = PyMem_Calloc((size_t)(self->slot_count * self->snapshot_words), sizeof(intptr_t));
    if (self->slots == NULL || self->snapshots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    shm_control_line *table = (shm_control_line *)(uintptr_t)control_table;
    for (Py_ssize_t s = 0; s < self->slot_count; s++) {
        Slot *slot = &self->slots[s];
        slot->snapshot = self->snapshots + s * self->snapshot_words;
        slot->control = &table[s];
        if (cursor_store_views(self, s, PyTuple_GET_ITEM(views, s)) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Cursor(control_table_address=..., ...): every setting as an argument of one fixed
 * signature (a missing, unknown or negative one raises here); the protocol's own values come
 * from ring.h. The cursor is active once built. */
static int cursor_init(Cursor *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"control_table_address", "slot_count", "work_semaphore", "ready_semaphores",
                               "field_names", "batch_type", "views", "next_step", "check_every_batches",
                               "check_every_ns", "wake_after_slots", "reader_count", "trainer_slots",
                               "poll_interval_ns", "wait_ahead_span_ns", "end_step", "partial_from", "supervise",
                               "views_of", "partial",
                               NULL};
    if (self->slots != NULL || self->supervise != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the cursor is already set up");
        return -1;
    }
    unsigned long long control_table, slot_count, next_step, check_every, check_every_ns, wake_after, reader_count,
        trainer_slots, poll_ns, wait_ahead_span_ns, end_step, partial_from;
    PyObject *work, *ready, *names, *batch_type, *views, *supervise, *views_of, *partial;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&O&UO!O!OO!O&O&O&O&O&O&O&O&O&O&OOO:Cursor", keywords, u64_of,
                                     &control_table, u64_of, &slot_count, &work, &PyTuple_Type, &ready,
                                     &PyTuple_Type, &names, &batch_type, &PyTuple_Type, &views, u64_of, &next_step,
                                     u64_of, &check_every, u64_of, &check_every_ns, u64_of, &wake_after, u64_of,
                                     &reader_count, u64_of, &trainer_slots, u64_of, &poll_ns, u64_of,
                                     &wait_ahead_span_ns, u64_of, &end_step, u64_of, &partial_from,
                                     &supervise, &views_of, &partial)) {
        return -1;
    }
    if (!PyCallable_Check(supervise) || !PyCallable_Check(views_of) || !PyCallable_Check(partial)) {
        PyErr_SetString(PyExc_TypeError, "supervise, views_of and partial must be callables");
        return -1;
    }
    if (slot_count < 1 || control_table == 0 || PyTuple_GET_SIZE(ready) != (Py_ssize_t)slot_count ||
        PyTuple_GET_SIZE(views) != (Py_ssize_t)slot_count) {
        PyErr_SetString(PyExc_ValueError,
                        "a cursor needs a control table, and one ready semaphore and one views tuple per slot");
        return -1;
    }
    if (check_every < 1 || check_every_ns < 1 || wake_after < 1 || poll_ns < 1) {
        PyErr_SetString(PyExc_ValueError, "check_every_batches, check_every_ns, wake_after_slots and "
                                          "poll_interval_ns must be at least 1");
        return -1;
    }
    if (!PyType_Check(batch_type) || !PyType_IsSubtype((PyTypeObject *)batch_type, &BatchBaseType)) {
        PyErr_SetString(PyExc_TypeError, "batch_type must subclass BatchBase");
        return -1;
    }
    self->slot_count = (Py_ssize_t)slot_count;
    self->supervise = Py_NewRef(supervise);
    self->views_of = Py_NewRef(views_of);
    self->partial = Py_NewRef(partial);
    self->names = Py_NewRef(names);
    self->batch_type = (PyTypeObject *)Py_NewRef(batch_type);
    if (set_up_slots(self, control_table, views) < 0 || open_semaphores(self, work, ready) < 0) {
        cursor_clear(self);
        return -1;
    }
    self->next_step = next_step;
    self->check_every = check_every;
    self->check_every_ns = check_every_ns;
    self->checked_ns = monotonic_ns();
    self->wake_after = wake_after;
    self->reader_count = reader_count;
    self->trainer_slots = trainer_slots;
    self->end_step = end_step;
    self->partial_from = partial_from;
    self->poll_interval_ns = poll_ns;
    self->wait_ahead_span_ns = wait_ahead_span_ns;
    self->pending_posts = 0;
    self->active = 1;
    return 0;
}

static PyObject *cursor_release_unused(Cursor *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->active) {
        return PyLong_FromLong(0);
    }
    Py_ssize_t released = cursor_release(self, 1);
    return released < 0 ? NULL : PyLong_FromSsize_t(released);
}

/* Slot `index` of an open cursor, or NULL with the error set (closed, or no such slot). */
static Slot *slot_at(Cursor *self, Py_ssize_t index) {
    if (!self->active) {
        PyErr_SetString(PyExc_RuntimeError, "the loader is closed");
        return NULL;
    }
    if (self->slots == NULL || index < 0 || index >= self->slot_count) {
        PyErr_Format(PyExc_IndexError, "no slot %zd", index);
        return NULL;
    }
    return &self->slots[index];
}

/* request(slot, step): IDLE, READY (a seek discards it) or FILLING (its filler is dead or
 * gave up: the caller knows) -> REQUESTED, then wakes a reader. HELD is cursor_release's
 * to hand back, REQUESTED is a request already, FAILED must be raised first. */
static PyObject *cursor_request(Cursor *self, PyObject *args) {
    Py_ssize_t index;
    unsigned long long step;
    if (!PyArg_ParseTuple(args, "nO&", &index, u64_of, &step)) {
        return NULL;
    }
    Slot *slot = slot_at(self, index);
    if (slot == NULL) {
        return NULL;
    }
    uint64_t state = __atomic_load_n(&slot->control->state, __ATOMIC_ACQUIRE) & SHM_STATE_MASK;
    if (slot->held || (state != SHM_SLOT_IDLE && state != SHM_SLOT_READY && state != SHM_SLOT_FILLING)) {
        PyErr_Format(PyExc_RuntimeError, "slot %zd cannot be requested for step %llu from state %llu%s", index, step,
                     (unsigned long long)state, slot->held ? " (held by a batch)" : "");
        return NULL;
    }
    if ((unsigned long long)index != step % (unsigned long long)self->slot_count) {
        PyErr_Format(PyExc_ValueError, "step %llu belongs to slot %llu, not %zd", step,
                     step % (unsigned long long)self->slot_count, index);
        return NULL;
    }
    if (step >= self->end_step) {
        PyErr_Format(PyExc_ValueError, "step %llu is past the pass's end (%llu steps)", step, self->end_step);
        return NULL;
    }
    /* transition: IDLE -> REQUESTED, READY -> REQUESTED, FILLING -> REQUESTED */
    if (request_slot(slot->control, step, monotonic_ns()) < 0) {
        return NULL;
    }
    self->pending_posts++;
    if (cursor_wake(self) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* detach(slot, views): a seek's way past a slot a batch still holds. The caller
 * (Session.take_back_all) has given that batch's pages memory of their own at the same
 * address (Ring.detach_slot), so the batch's arrays keep their values and are the cursor's
 * no more, and has mapped the slot's shared pages anew: `views` are the slot's arrays over
 * that mapping. The slot becomes IDLE, free for the seek's requests. */
static PyObject *cursor_detach(Cursor *self, PyObject *args) {
    Py_ssize_t index;
    PyObject *views;
    if (!PyArg_ParseTuple(args, "nO", &index, &views)) {
        return NULL;
    }
    Slot *slot = slot_at(self, index);
    if (slot == NULL) {
        return NULL;
    }
    uint64_t word = __atomic_load_n(&slot->control->state, __ATOMIC_ACQUIRE);
    if (!slot->held || word != SHM_SLOT_HELD) {
        PyErr_Format(PyExc_RuntimeError, "slot %zd is not held by a batch (held %d, state word %#llx)", index,
                     slot->held, (unsigned long long)word);
        return NULL;
    }
    if (cursor_store_views(self, index, views) < 0) {
        return NULL;
    }
    slot->held = 0;
    /* transition: HELD -> IDLE */
    __atomic_store_n(&slot->control->state, (uint64_t)SHM_SLOT_IDLE, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* wait_filled(slot, timeout_seconds): a seek's wait for a reader to finish the slot it
 * fills; True once the slot is neither REQUESTED nor FILLING (or the cursor closed), False
 * after the time-out. A signal whose handler raises (Ctrl-C) raises here. */
static PyObject *cursor_wait_filled(Cursor *self, PyObject *args) {
    Py_ssize_t index;
    double timeout_seconds;
    if (!PyArg_ParseTuple(args, "nd", &index, &timeout_seconds)) {
        return NULL;
    }
    if (!self->active || index < 0 || index >= self->slot_count) {
        PyErr_Format(PyExc_IndexError, "no slot %zd in an active cursor", index);
        return NULL;
    }
    if (!(timeout_seconds >= 0.0 && timeout_seconds < 1e9)) {
        PyObject *given = PyFloat_FromDouble(timeout_seconds);
        if (given != NULL) {
            PyErr_Format(PyExc_ValueError, "timeout_seconds must be in [0, 1e9), got %R", given);
            Py_DECREF(given);
        }
        return NULL;
    }
    WaitResult waited = cursor_wait(self, index, ANY_STEP, (uint64_t)(timeout_seconds * 1e9));
    if (waited == WAIT_ERROR) {
        return NULL;
    }
    return PyBool_FromLong(waited != WAIT_TIMED_OUT);
}

/* batch_of(views, step): a Batch of the cursor's batch type over `views` (a partial batch's
 * cut arrays), with the loader's names. */
static PyObject *cursor_batch_of(Cursor *self, PyObject *args) {
    PyObject *views;
    unsigned long long step;
    if (!PyArg_ParseTuple(args, "O!O&", &PyTuple_Type, &views, u64_of, &step)) {
        return NULL;
    }
    if (self->batch_type == NULL || self->names == NULL ||
        PyTuple_GET_SIZE(views) != PyTuple_GET_SIZE(self->names) + 1) {
        PyErr_SetString(PyExc_ValueError, "batch_of needs a set-up cursor and one array per name, then the indices");
        return NULL;
    }
    /* Our own references first: the allocation may collect garbage, whose finalizers may
     * close the cursor and clear its names. */
    PyObject *names = Py_NewRef(self->names);
    PyTypeObject *batch_type = (PyTypeObject *)Py_NewRef((PyObject *)self->batch_type);
    BatchBase *batch = (BatchBase *)batch_type->tp_alloc(batch_type, 0);
    Py_DECREF(batch_type);
    if (batch == NULL) {
        Py_DECREF(names);
        return NULL;
    }
    batch->views = Py_NewRef(views);
    batch->names = names;
    batch->step = step;
    return (PyObject *)batch;
}

static PyObject *cursor_held(Cursor *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *held = PyDict_New();
    if (held == NULL || self->slots == NULL) {
        return held;
    }
    for (Py_ssize_t s = 0; s < self->slot_count; s++) {
        if (!self->slots[s].held) {
            continue;
        }
        PyObject *key = PyLong_FromSsize_t(s), *value = PyLong_FromUnsignedLongLong(self->slots[s].held_step);
        int failed = key == NULL || value == NULL || PyDict_SetItem(held, key, value) < 0;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (failed) {
            Py_DECREF(held);
            return NULL;
        }
    }
    return held;
}

static PyObject *cursor_deactivate(Cursor *self, PyObject *Py_UNUSED(ignored)) {
    cursor_clear(self);
    Py_RETURN_NONE;
}

/* enter(), leave(): a seek holds the cursor as next() does, so that neither runs inside
 * the other; a close meanwhile is deferred to leave(), as to the end of next(). */
static PyObject *cursor_enter(Cursor *self, PyObject *Py_UNUSED(ignored)) {
    if (cursor_refuse_if_busy(self) < 0) {
        return NULL;
    }
    self->iterating = 1;
    Py_RETURN_NONE;
}

static PyObject *cursor_leave(Cursor *self, PyObject *Py_UNUSED(ignored)) {
    self->iterating = 0;
    if (self->clear_deferred && self->waiting == 0) {
        cursor_clear(self);
    }
    Py_RETURN_NONE;
}

/* forget_in_child(): a forked child's copy. No thread of the parent came along, so none
 * is inside next() or a wait here, whatever the copied flags say: clear at once. */
static PyObject *cursor_forget_in_child(Cursor *self, PyObject *Py_UNUSED(ignored)) {
    self->iterating = 0;
    self->waiting = 0;
    cursor_clear(self);
    Py_RETURN_NONE;
}

static PyObject *cursor_now_ns(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(monotonic_ns());
}

static PyObject *cursor_iter(PyObject *self) {
    Py_INCREF(self);
    return self;
}

/* The callables may refer (through a session's objects) to what refers to the cursor: the
 * collector sees them, and the slots' arrays. */
static int cursor_traverse(Cursor *self, visitproc visit, void *arg) {
    Py_VISIT(self->supervise);
    Py_VISIT(self->views_of);
    Py_VISIT(self->partial);
    Py_VISIT(self->names);
    Py_VISIT(self->batch_type);
    if (self->slots != NULL) {
        for (Py_ssize_t s = 0; s < self->slot_count; s++) {
            Py_VISIT(self->slots[s].views);
        }
    }
    return 0;
}

static int cursor_tp_clear(Cursor *self) {
    cursor_clear(self);
    Py_CLEAR(self->supervise); /* Kept past cursor_clear: a closed loader's next() still asks supervise. */
    Py_CLEAR(self->views_of);
    Py_CLEAR(self->partial);
    return 0;
}

static void cursor_dealloc(Cursor *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self); /* The session's finalizer runs here. */
    }
    cursor_tp_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef cursor_methods[] = {
    {"request", (PyCFunction)cursor_request, METH_VARARGS,
     "Requests `step` in its slot (from IDLE, READY or a FILLING whose filler is gone) and wakes a reader."},
    {"release_unused", (PyCFunction)cursor_release_unused, METH_NOARGS,
     "Requests the next step of every held slot nothing refers to and wakes readers for all pending "
     "requests; returns how many slots were handed back."},
    {"held", (PyCFunction)cursor_held, METH_NOARGS, "{slot: step} of the slots held by batches."},
    {"detach", (PyCFunction)cursor_detach, METH_VARARGS,
     "Lets go of a held slot whose batch has memory of its own now (Ring.detach_slot): the slot takes the "
     "given arrays over its new mapping and becomes IDLE."},
    {"wait_filled", (PyCFunction)cursor_wait_filled, METH_VARARGS,
     "Waits at most timeout_seconds for a slot to leave REQUESTED and FILLING; False on time-out."},
    {"batch_of", (PyCFunction)cursor_batch_of, METH_VARARGS, "A Batch over the given arrays (a partial batch)."},
    {"deactivate", (PyCFunction)cursor_deactivate, METH_NOARGS,
     "Closes the cursor: drops every slot's arrays and semaphores; next() raises through supervise."},
    {"enter", (PyCFunction)cursor_enter, METH_NOARGS,
     "Holds the cursor for a seek (refused while next() or another seek runs); leave() ends it."},
    {"leave", (PyCFunction)cursor_leave, METH_NOARGS, "Ends enter(); clears a cursor closed meanwhile."},
    {"forget_in_child", (PyCFunction)cursor_forget_in_child, METH_NOARGS,
     "Closes a forked child's copy of the cursor (no thread of the parent is inside it here)."},
    {"now_ns", (PyCFunction)cursor_now_ns, METH_NOARGS | METH_STATIC, "The clock next() timing uses (CLOCK_MONOTONIC)."},
    {NULL},
};

static PyMemberDef cursor_members[] = {
    {"next_step", T_ULONGLONG, offsetof(Cursor, next_step), 0, "the step next() delivers next"},
    {"partial_from", T_ULONGLONG, offsetof(Cursor, partial_from), 0,
     "the first step handed to partial() (the end of a finite pass, or a resumed first step)"},
    {"end_step", T_ULONGLONG, offsetof(Cursor, end_step), 0,
     "a finite pass's end (set anew only while every slot is taken back: a resharded resume)"},
    {"batches", T_ULONGLONG, offsetof(Cursor, batches), READONLY, "batches delivered"},
    {"wait_ns", T_ULONGLONG, offsetof(Cursor, wait_ns), READONLY, "time next() spent waiting for data, ns"},
    {"first_next_ns", T_ULONGLONG, offsetof(Cursor, first_next_ns), READONLY,
     "the clock when next() first delivered or began waiting for the first batch, 0 before"},
    {"active", T_INT, offsetof(Cursor, active), READONLY, "set up and not closed"},
    {"pending_posts", T_ULONGLONG, offsetof(Cursor, pending_posts), READONLY,
     "slots handed back whose readers were not woken yet"},
    {"waiting_since_ns", T_ULONGLONG, offsetof(Cursor, waiting_since_ns), 0,
     "readers=0: when the local reader began filling next_step (now_ns's clock), for the next next() to count "
     "as its wait; that next() resets it to 0"},
    {NULL},
};

static PyObject *cursor_get_next_state(Cursor *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong((long)cursor_next_state(self));
}

static PyGetSetDef cursor_getset[] = {
    {"next_state", (getter)cursor_get_next_state, NULL,
     "the STEP code next() would find at next_step now, before its release pass (CLOSED once closed)", NULL},
    {NULL},
};

PyTypeObject CursorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader.ring._cursor.Cursor",
    .tp_doc = "The trainer's iterator over the ring: next() natively (see ring/_cursor.c). Built by "
              "shmloader/session.py.",
    .tp_basicsize = sizeof(Cursor),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)cursor_init,
    .tp_dealloc = (destructor)cursor_dealloc,
    .tp_traverse = (traverseproc)cursor_traverse,
    .tp_clear = (inquiry)cursor_tp_clear,
    .tp_weaklistoffset = offsetof(Cursor, weakreflist),
    .tp_iter = cursor_iter,
    .tp_iternext = (iternextfunc)cursor_next,
    .tp_methods = cursor_methods,
    .tp_members = cursor_members,
    .tp_getset = cursor_getset,
};
