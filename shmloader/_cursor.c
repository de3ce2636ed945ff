/*
 * The trainer's hot path: next() on the ring without running Python code.
 *
 * Why native: after a training step the trainer's caches and TLB are cold, and every
 * line of code or data next() touches costs a miss. A next() written in Python touches
 * the interpreter, numpy's array constructor and cffi: 38-93 us on the development
 * machine after a simulated step; this path costs 7-23 us there (median of a run, over six
 * runs, with the interpreter's call), where next() of a bare C iterator costs 2-7 us.
 *
 * Nothing is allocated per batch except one small Batch object: each slot's arrays are
 * built once (by loader.py, as views of the mapped ring whose base is the mapping, so
 * every view of them, torch.from_numpy included, references them). A slot is held while
 * any of its arrays has a reference beyond the loader's own, or while a Batch that was
 * not released is alive; the release pass at each next() hands such slots back once
 * nothing refers to them. The ring's layout and state values come from ring.py at setup:
 * this file defines none of them.
 *
 * A batch that is requested or being filled is waited for here too, with the GIL
 * released, for at most one poll interval. Everything else (reader supervision, errors,
 * slots a user still holds, a closed or forked loader) is Python: Cursor.__next__ calls
 * self._next_slow().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>

#include <errno.h>
#include <fcntl.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* What a handed-out array looked like when it was built: a user can change an array's
 * shape, strides, dtype or writeable flag in place, and the next batch in its slot must
 * not inherit that. Per array, in a slot's run of words: data, descr, ndim, writeable,
 * then ndim dimensions and ndim strides. Every slot's run sits in one block beside the
 * slot table, so the check at release time touches a few lines of one page. */
#define SNAPSHOT_FIXED_WORDS 4

typedef struct {
    PyObject *views;           /* tuple: one array per field, then the indices array */
    intptr_t *snapshot;        /* this slot's words in the cursor's snapshot block */
    uint64_t *state_word;      /* the slot's state word in the ring */
    uint64_t *step_word;       /* the slot's step word */
    uint64_t held_step;
    int held;
    int damaged;               /* an array was changed in place: rebuild before reuse */
} Slot;

typedef struct {
    PyObject_HEAD
    int active;
    int waiting;               /* threads inside a native wait (GIL released) */
    int clear_deferred;        /* _deactivate came while one waited: the last waiter clears */
    Py_ssize_t slot_count;
    Py_ssize_t view_count;
    Slot *slots;
    intptr_t *snapshots;       /* one block: each slot's snapshot words, in slot order */
    Py_ssize_t snapshot_words; /* words per slot */
    PyObject *names;           /* tuple of field names, in view order */
    PyTypeObject *batch_type;  /* a subclass of BatchBase */
    sem_t *work;               /* readers wait on it for requested slots */
    sem_t **ready_semaphores;  /* one per slot: posted when a reader publishes it */
    uint64_t ready, held_word, requested, filling, state_mask;
    uint64_t wait_ns_max;      /* one native wait lasts at most this long; then Python checks readers */
    uint64_t check_every;      /* batches between reader checks (in Python) */
    uint64_t wake_after;       /* wake readers once this many slots were handed back */
    uint64_t pending_posts;    /* slots handed back whose readers were not woken yet */
    uint64_t reader_count;     /* at most this many posts per wake-up */
    unsigned long long next_step;
    unsigned long long batches;
    unsigned long long wait_ns;
    unsigned long long first_next_ns;
} Cursor;

typedef struct {
    PyObject_HEAD
    PyObject *views;  /* NULL once released */
    PyObject *names;
    unsigned long long step;
} BatchBase;

static PyObject *str_next_slow;
static PyObject *str_rebuild_views;

static inline unsigned long long monotonic_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (unsigned long long)now.tv_sec * 1000000000ull + (unsigned long long)now.tv_nsec;
}

/* ---- Snapshots ---------------------------------------------------------------------- */

static Py_ssize_t snapshot_words_of(PyObject *views) {
    Py_ssize_t words = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(views); i++) {
        words += SNAPSHOT_FIXED_WORDS + 2 * PyArray_NDIM((PyArrayObject *)PyTuple_GET_ITEM(views, i));
    }
    return words;
}

static void snapshot_take(intptr_t *words, PyObject *views) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(views); i++) {
        PyArrayObject *array = (PyArrayObject *)PyTuple_GET_ITEM(views, i);
        int ndim = PyArray_NDIM(array);
        words[0] = (intptr_t)PyArray_DATA(array);
        words[1] = (intptr_t)PyArray_DESCR(array);
        words[2] = ndim;
        words[3] = (PyArray_FLAGS(array) & NPY_ARRAY_WRITEABLE) != 0;
        memcpy(words + SNAPSHOT_FIXED_WORDS, PyArray_DIMS(array), sizeof(npy_intp) * (size_t)ndim);
        memcpy(words + SNAPSHOT_FIXED_WORDS + ndim, PyArray_STRIDES(array), sizeof(npy_intp) * (size_t)ndim);
        words += SNAPSHOT_FIXED_WORDS + 2 * ndim;
    }
}

static int snapshot_matches(const intptr_t *words, PyObject *views) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(views); i++) {
        PyArrayObject *array = (PyArrayObject *)PyTuple_GET_ITEM(views, i);
        int ndim = PyArray_NDIM(array);
        if (words[0] != (intptr_t)PyArray_DATA(array) || words[1] != (intptr_t)PyArray_DESCR(array) ||
            words[2] != ndim || words[3] != ((PyArray_FLAGS(array) & NPY_ARRAY_WRITEABLE) != 0) ||
            memcmp(words + SNAPSHOT_FIXED_WORDS, PyArray_DIMS(array), sizeof(npy_intp) * (size_t)ndim) != 0 ||
            memcmp(words + SNAPSHOT_FIXED_WORDS + ndim, PyArray_STRIDES(array), sizeof(npy_intp) * (size_t)ndim) != 0) {
            return 0;
        }
        words += SNAPSHOT_FIXED_WORDS + 2 * ndim;
    }
    return 1;
}

/* ---- Release pass ------------------------------------------------------------------- */

/* A held slot is in use while its views tuple is referenced by a Batch (not released)
 * or any of its arrays is referenced by anything but that tuple. */
static inline int slot_in_use(const Slot *slot) {
    if (Py_REFCNT(slot->views) > 1) {
        return 1;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(slot->views);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (Py_REFCNT(PyTuple_GET_ITEM(slot->views, i)) > 1) {
            return 1;
        }
    }
    return 0;
}

/* One post per slot handed back since the last wake-up, but no more than there are
 * readers: a woken reader claims every requested slot before it sleeps again, so further
 * posts would only wake readers to find nothing. */
static int wake_readers(Cursor *self) {
    uint64_t posts = self->pending_posts < self->reader_count ? self->pending_posts : self->reader_count;
    self->pending_posts = 0;
    for (; posts > 0; posts--) {
        if (sem_post(self->work) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
    }
    return 0;
}

/* Requests the next step of every held slot nothing refers to any more, then wakes the
 * readers if `flush` or once wake_after slots wait for them. Waking is the costly part (a
 * futex system call, and an interrupt to the core of a sleeping reader), so while the
 * readers are ahead the trainer wakes them once per wake_after slots; cursor_iternext
 * wakes them at once when they are not (the low-watermark rule of pipes and sockets).
 * Returns how many slots were handed back, or -1 with an exception set. */
static Py_ssize_t release_unused(Cursor *self, int flush) {
    Py_ssize_t released = 0;
    for (Py_ssize_t s = 0; s < self->slot_count; s++) {
        Slot *slot = &self->slots[s];
        if (!slot->held || slot_in_use(slot)) {
            continue;
        }
        slot->held = 0;
        /* Checked now, while the arrays' lines are in cache from the reference counts. */
        slot->damaged = !snapshot_matches(slot->snapshot, slot->views);
        /* The step is published by the release store of the state word after it. */
        *slot->step_word = slot->held_step + (uint64_t)self->slot_count;
        __atomic_store_n(slot->state_word, self->requested, __ATOMIC_RELEASE);
        released++;
    }
    self->pending_posts += (uint64_t)released;
    if ((flush || self->pending_posts >= self->wake_after) && wake_readers(self) < 0) {
        return -1;
    }
    return released;
}

/* ---- Taking a ready slot ------------------------------------------------------------ */

/* Hands out the slot of next_step, which the caller found READY with the right step. */
static PyObject *take(Cursor *self) {
    Py_ssize_t index = (Py_ssize_t)(self->next_step % (unsigned long long)self->slot_count);
    Slot *slot = &self->slots[index];
    if (slot->damaged) {
        /* A user changed one of its arrays in place (shape, dtype, ...) and has let go of
         * it since: the loader builds fresh arrays for the slot. Rare; Python does it. */
        PyObject *number = PyLong_FromSsize_t(index);
        PyObject *result = number == NULL ? NULL : PyObject_CallMethodObjArgs((PyObject *)self, str_rebuild_views, number, NULL);
        Py_XDECREF(number);
        if (result == NULL) {
            return NULL;
        }
        Py_DECREF(result);
    }
    BatchBase *batch = (BatchBase *)self->batch_type->tp_alloc(self->batch_type, 0);
    if (batch == NULL) {
        return NULL;
    }
    Py_INCREF(slot->views);
    batch->views = slot->views;
    Py_INCREF(self->names);
    batch->names = self->names;
    batch->step = self->next_step;
    /* READY -> HELD: only the trainer reads HELD, so a plain store suffices. */
    __atomic_store_n(slot->state_word, self->held_word, __ATOMIC_RELAXED);
    slot->held = 1;
    slot->held_step = self->next_step;
    self->next_step++;
    self->batches++;
    if (self->first_next_ns == 0) {
        self->first_next_ns = monotonic_ns();
    }
    return (PyObject *)batch;
}

static void cursor_clear(Cursor *self);

static inline int step_ready(const Cursor *self, unsigned long long step) {
    const Slot *slot = &self->slots[step % (unsigned long long)self->slot_count];
    uint64_t word = __atomic_load_n(slot->state_word, __ATOMIC_ACQUIRE);
    return (word & self->state_mask) == self->ready && *slot->step_word == step;
}

/* Waits, without the GIL, for the step next() needs while a reader has it requested or
 * in hand: the common wait of a trainer that outruns its readers, kept out of Python.
 * Returns 1 once the step is ready, 0 to let Python decide (time-out: it checks the
 * readers; another state; a signal without a Python exception), -1 with an exception set
 * (a handler raised, e.g. KeyboardInterrupt). */
static int wait_in_flight(Cursor *self) {
    unsigned long long step = self->next_step;
    Slot *slot = &self->slots[step % (unsigned long long)self->slot_count];
    sem_t *semaphore = self->ready_semaphores[step % (unsigned long long)self->slot_count];
    if (wake_readers(self) < 0) {
        return -1; /* Readers asleep with pending requests would cost a whole poll. */
    }
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_nsec += (long)(self->wait_ns_max % 1000000000ull);
    deadline.tv_sec += (time_t)(self->wait_ns_max / 1000000000ull) + deadline.tv_nsec / 1000000000L;
    deadline.tv_nsec %= 1000000000L;
    for (;;) {
        uint64_t word = __atomic_load_n(slot->state_word, __ATOMIC_ACQUIRE);
        uint64_t state = word & self->state_mask;
        if (*slot->step_word != step || (state != self->requested && state != self->filling)) {
            return step_ready(self, step);
        }
        int result, error;
        self->waiting++;
        Py_BEGIN_ALLOW_THREADS
        result = sem_timedwait(semaphore, &deadline);
        error = errno;
        Py_END_ALLOW_THREADS
        self->waiting--;
        /* Without the GIL, another thread may have closed the loader (its slots and
         * semaphores are freed only once no thread waits on them) or taken this step. */
        if (!self->active || self->next_step != step) {
            if (self->clear_deferred && self->waiting == 0) {
                cursor_clear(self);
            }
            return 0;
        }
        if (result != 0) {
            if (error == EINTR) {
                return PyErr_CheckSignals() < 0 ? -1 : 0;
            }
            return step_ready(self, step); /* ETIMEDOUT: Python checks the readers. */
        }
        /* A post: this step, or a stale one from an earlier fill; look again. */
    }
}

/* The fast path touches no clock: its cost is not waiting. stats() counts the native
 * wait and the slow path as waiting for data. */
static PyObject *cursor_iternext(Cursor *self) {
    if (self->active) {
        if (release_unused(self, 0) < 0) {
            return NULL;
        }
        int due = (self->batches + 1) % self->check_every == 0;
        if (step_ready(self, self->next_step) && !due) {
            /* Readers not ahead (the batch after this one is not ready): wake them now. */
            if (self->pending_posts > 0 && !step_ready(self, self->next_step + 1) && wake_readers(self) < 0) {
                return NULL;
            }
            return take(self);
        }
        if (!due) {
            unsigned long long started_ns = monotonic_ns();
            int ready = wait_in_flight(self);
            if (ready < 0) {
                return NULL;
            }
            if (ready) {
                if (self->first_next_ns == 0) {
                    self->first_next_ns = started_ns;
                }
                PyObject *batch = take(self);
                self->wait_ns += monotonic_ns() - started_ns;
                return batch;
            }
        }
    }
    /* Not ready, due for a reader check, closed or not set up: Python decides. */
    return PyObject_CallMethodObjArgs((PyObject *)self, str_next_slow, NULL);
}

/* ---- Cursor methods (the private API loader.py uses) -------------------------------- */

static void cursor_clear(Cursor *self) {
    self->active = 0;
    if (self->waiting > 0) {
        self->clear_deferred = 1; /* A thread waits on a semaphore of ours: it clears after. */
        return;
    }
    self->clear_deferred = 0;
    if (self->slots != NULL) {
        for (Py_ssize_t s = 0; s < self->slot_count; s++) {
            Py_CLEAR(self->slots[s].views);
        }
        PyMem_Free(self->slots);
        self->slots = NULL;
    }
    PyMem_Free(self->snapshots);
    self->snapshots = NULL;
    if (self->work != NULL) {
        sem_close(self->work);
        self->work = NULL;
    }
    if (self->ready_semaphores != NULL) {
        for (Py_ssize_t s = 0; s < self->slot_count; s++) {
            if (self->ready_semaphores[s] != NULL) {
                sem_close(self->ready_semaphores[s]);
            }
        }
        PyMem_Free(self->ready_semaphores);
        self->ready_semaphores = NULL;
    }
    Py_CLEAR(self->names);
    Py_CLEAR(self->batch_type);
}

static int is_ndarray(PyObject *object) {
    return strcmp(Py_TYPE(object)->tp_name, "numpy.ndarray") == 0;
}

/* Stores `views` (a tuple of view_count numpy arrays) as slot `index`'s arrays. */
static int set_views(Cursor *self, Py_ssize_t index, PyObject *views) {
    if (!PyTuple_Check(views) || PyTuple_GET_SIZE(views) != self->view_count) {
        PyErr_Format(PyExc_ValueError, "slot %zd: expected a tuple of %zd arrays", index, self->view_count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->view_count; i++) {
        if (!is_ndarray(PyTuple_GET_ITEM(views, i))) {
            PyErr_Format(PyExc_TypeError, "slot %zd, view %zd: expected numpy.ndarray, got %s", index, i,
                         Py_TYPE(PyTuple_GET_ITEM(views, i))->tp_name);
            return -1;
        }
    }
    if (snapshot_words_of(views) != self->snapshot_words) {
        PyErr_Format(PyExc_ValueError, "slot %zd: its arrays have other dimensions than the other slots'", index);
        return -1;
    }
    Slot *slot = &self->slots[index];
    snapshot_take(slot->snapshot, views);
    Py_INCREF(views);
    Py_XSETREF(slot->views, views);
    slot->damaged = 0;
    return 0;
}

static PyTypeObject BatchBaseType;

static PyObject *cursor_setup(Cursor *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"state_addresses", "step_addresses", "work_semaphore", "ready_semaphores", "names",
                               "batch_type", "views", "next_step", "check_every", "wake_after", "reader_count",
                               "wait_ns_max", "ready", "held_word", "requested", "filling", "state_mask", NULL};
    PyObject *state_addresses, *step_addresses, *ready_names, *names, *views;
    PyTypeObject *batch_type;
    const char *semaphore_name;
    unsigned long long next_step, check_every, wake_after, reader_count, wait_ns_max, ready, held_word, requested,
        filling, state_mask;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!sO!O!O!O!KKKKKKKKKK", keywords, &PyTuple_Type,
                                     &state_addresses, &PyTuple_Type, &step_addresses, &semaphore_name, &PyTuple_Type,
                                     &ready_names, &PyTuple_Type, &names, &PyType_Type, &batch_type, &PyTuple_Type,
                                     &views, &next_step, &check_every, &wake_after, &reader_count, &wait_ns_max,
                                     &ready, &held_word, &requested, &filling, &state_mask)) {
        return NULL;
    }
    Py_ssize_t slot_count = PyTuple_GET_SIZE(state_addresses);
    if (self->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the cursor is already set up");
        return NULL;
    }
    if (slot_count < 1 || PyTuple_GET_SIZE(step_addresses) != slot_count || PyTuple_GET_SIZE(views) != slot_count ||
        PyTuple_GET_SIZE(ready_names) != slot_count) {
        PyErr_SetString(PyExc_ValueError,
                        "setup needs one state address, step address, ready semaphore and views tuple per slot");
        return NULL;
    }
    if (check_every < 1 || wake_after < 1 || reader_count < 1 || wait_ns_max < 1) {
        PyErr_SetString(PyExc_ValueError, "check_every, wake_after and reader_count must be at least 1");
        return NULL;
    }
    if (!PyType_IsSubtype(batch_type, &BatchBaseType)) {
        PyErr_Format(PyExc_TypeError, "batch_type must subclass BatchBase, got %s", batch_type->tp_name);
        return NULL;
    }
    self->view_count = PyTuple_GET_SIZE(names) + 1;
    PyObject *first = PyTuple_GET_ITEM(views, 0);
    if (!PyTuple_Check(first) || PyTuple_GET_SIZE(first) != self->view_count) {
        PyErr_Format(PyExc_ValueError, "slot 0: expected a tuple of %zd arrays", self->view_count);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->view_count; i++) {
        if (!is_ndarray(PyTuple_GET_ITEM(first, i))) {
            PyErr_SetString(PyExc_TypeError, "slot 0: expected numpy arrays");
            return NULL;
        }
    }
    self->snapshot_words = snapshot_words_of(first);
    self->slots = PyMem_Calloc((size_t)slot_count, sizeof(Slot));
    self->snapshots = PyMem_Calloc((size_t)(slot_count * self->snapshot_words), sizeof(intptr_t));
    if (self->slots == NULL || self->snapshots == NULL) {
        PyMem_Free(self->slots);
        self->slots = NULL;
        PyMem_Free(self->snapshots);
        self->snapshots = NULL;
        return PyErr_NoMemory();
    }
    self->slot_count = slot_count;
    for (Py_ssize_t s = 0; s < slot_count; s++) {
        Slot *slot = &self->slots[s];
        slot->snapshot = self->snapshots + s * self->snapshot_words;
        slot->state_word = (uint64_t *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(state_addresses, s));
        slot->step_word = (uint64_t *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(step_addresses, s));
        if (PyErr_Occurred() || set_views(self, s, PyTuple_GET_ITEM(views, s)) < 0) {
            cursor_clear(self);
            return NULL;
        }
    }
    self->work = sem_open(semaphore_name, 0);
    if (self->work == SEM_FAILED) {
        self->work = NULL;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, semaphore_name);
        cursor_clear(self);
        return NULL;
    }
    self->ready_semaphores = PyMem_Calloc((size_t)slot_count, sizeof(sem_t *));
    if (self->ready_semaphores == NULL) {
        cursor_clear(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t s = 0; s < slot_count; s++) {
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(ready_names, s));
        sem_t *semaphore = name == NULL ? SEM_FAILED : sem_open(name, 0);
        if (semaphore == SEM_FAILED) {
            if (name != NULL) {
                PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
            }
            cursor_clear(self);
            return NULL;
        }
        self->ready_semaphores[s] = semaphore;
    }
    Py_INCREF(names);
    self->names = names;
    Py_INCREF(batch_type);
    self->batch_type = batch_type;
    self->next_step = next_step;
    self->check_every = check_every;
    self->wake_after = wake_after;
    self->reader_count = reader_count;
    self->pending_posts = 0;
    self->ready = ready;
    self->held_word = held_word;
    self->requested = requested;
    self->filling = filling;
    self->state_mask = state_mask;
    self->wait_ns_max = wait_ns_max;
    self->active = 1;
    Py_RETURN_NONE;
}

static PyObject *cursor_set_views(Cursor *self, PyObject *args) {
    Py_ssize_t index;
    PyObject *views;
    if (!PyArg_ParseTuple(args, "nO", &index, &views)) {
        return NULL;
    }
    if (self->slots == NULL || index < 0 || index >= self->slot_count) {
        PyErr_Format(PyExc_IndexError, "no slot %zd", index);
        return NULL;
    }
    if (self->slots[index].held) {
        PyErr_Format(PyExc_RuntimeError, "slot %zd is held; its arrays cannot be replaced", index);
        return NULL;
    }
    if (set_views(self, index, views) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *cursor_release_unused(Cursor *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->active) {
        return PyLong_FromLong(0);
    }
    Py_ssize_t released = release_unused(self, 1);
    return released < 0 ? NULL : PyLong_FromSsize_t(released);
}

static PyObject *cursor_take(Cursor *self, PyObject *args) {
    unsigned long long started_ns;
    if (!PyArg_ParseTuple(args, "K", &started_ns)) {
        return NULL;
    }
    if (!self->active) {
        PyErr_SetString(PyExc_RuntimeError, "the cursor is not active");
        return NULL;
    }
    if (!step_ready(self, self->next_step)) {
        PyErr_Format(PyExc_RuntimeError, "step %llu is not ready", self->next_step);
        return NULL;
    }
    if (self->first_next_ns == 0) {
        self->first_next_ns = started_ns; /* The wait for the first batch counts as time elapsed. */
    }
    PyObject *batch = take(self);
    if (batch != NULL) {
        self->wait_ns += monotonic_ns() - started_ns;
    }
    return batch;
}

static PyObject *cursor_wait_in_flight(Cursor *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->active) {
        Py_RETURN_FALSE;
    }
    int ready = wait_in_flight(self);
    if (ready < 0) {
        return NULL;
    }
    return PyBool_FromLong(ready);
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

static PyObject *cursor_now_ns(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(monotonic_ns());
}

static PyObject *cursor_iter(PyObject *self) {
    Py_INCREF(self);
    return self;
}

static void cursor_dealloc(Cursor *self) {
    cursor_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef cursor_methods[] = {
    {"_cursor_setup", (PyCFunction)(void (*)(void))cursor_setup, METH_VARARGS | METH_KEYWORDS,
     "Points the cursor at the ring's slots and gives it each slot's arrays; activates it."},
    {"_set_views", (PyCFunction)cursor_set_views, METH_VARARGS, "Replaces a free slot's arrays."},
    {"_release_unused", (PyCFunction)cursor_release_unused, METH_NOARGS,
     "Requests the next step of every held slot nothing refers to and wakes readers for all pending "
     "requests; returns how many slots were handed back."},
    {"_take", (PyCFunction)cursor_take, METH_VARARGS,
     "Hands out the ready slot of the next step; adds the time since started_ns to the wait."},
    {"_held", (PyCFunction)cursor_held, METH_NOARGS, "{slot: step} of the slots held by batches."},
    {"_wait_in_flight", (PyCFunction)cursor_wait_in_flight, METH_NOARGS,
     "Waits at most one poll interval, without the GIL, for the next step while it is requested or being "
     "filled; True once it is ready."},
    {"_deactivate", (PyCFunction)cursor_deactivate, METH_NOARGS, "Drops every slot's arrays; next() goes to Python."},
    {"_now_ns", (PyCFunction)cursor_now_ns, METH_NOARGS | METH_STATIC, "The clock next() timing uses (CLOCK_MONOTONIC)."},
    {NULL},
};

static PyMemberDef cursor_members[] = {
    {"_next_step", T_ULONGLONG, offsetof(Cursor, next_step), 0, "the step next() delivers next"},
    {"_batches", T_ULONGLONG, offsetof(Cursor, batches), READONLY, "batches delivered"},
    {"_wait_ns", T_ULONGLONG, offsetof(Cursor, wait_ns), READONLY, "time next() spent off the fast path, ns"},
    {"_first_next_ns", T_ULONGLONG, offsetof(Cursor, first_next_ns), READONLY,
     "the clock when the first batch was delivered, 0 before"},
    {"_active", T_INT, offsetof(Cursor, active), READONLY, "set up and not closed"},
    {"_pending_wakes", T_ULONGLONG, offsetof(Cursor, pending_posts), READONLY,
     "slots handed back whose readers were not woken yet"},
    {NULL},
};

static PyTypeObject CursorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader._cursor.Cursor",
    .tp_doc = "The native part of ShmDataLoader: next() on the ring (see _cursor.c).",
    .tp_basicsize = sizeof(Cursor),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)cursor_dealloc,
    .tp_iter = cursor_iter,
    .tp_iternext = (iternextfunc)cursor_iternext,
    .tp_methods = cursor_methods,
    .tp_members = cursor_members,
};

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

static PyTypeObject BatchBaseType = {
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

/* ---- Module ------------------------------------------------------------------------- */

static struct PyModuleDef cursor_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmloader._cursor",
    .m_doc = "The trainer's native next() (see the comment at the top of _cursor.c).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__cursor(void) {
    str_next_slow = PyUnicode_InternFromString("_next_slow");
    str_rebuild_views = PyUnicode_InternFromString("_rebuild_views");
    if (str_next_slow == NULL || str_rebuild_views == NULL || PyType_Ready(&CursorType) < 0 ||
        PyType_Ready(&BatchBaseType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&cursor_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Cursor", (PyObject *)&CursorType) < 0 ||
        PyModule_AddObjectRef(module, "BatchBase", (PyObject *)&BatchBaseType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
