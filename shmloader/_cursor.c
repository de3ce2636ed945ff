/*
 * The trainer's side of the slot protocol: next() on the ring, natively.
 *
 * Why native: after a training step the trainer's caches and TLB are cold, and every line
 * of code or data next() touches costs a miss; a next() in Python touches the interpreter,
 * numpy's array constructor and cffi. This file decides, in one function (cursor_iternext),
 * what the next step's slot holds: ready, in flight (requested or being filled), held by a
 * user's views, failed by its reader, or wrong. It takes a ready slot, waits for one in
 * flight (one poll interval at a time, without the GIL), and counts the time it waited in
 * one place (take). Python is called, through the `supervise` callable it was built with
 * (readers/supervision.py), only to supervise readers and to raise errors.
 *
 * The Cursor is the loader's iterator, not the loader: shmloader/session.py builds it with
 * plain callables and settings, keeps it, and hands it to `for` loops, so that a loop over
 * a temporary loader keeps the cursor (and, through the session's finalizer, the ring)
 * alive without any reference back to the loader.
 *
 * Nothing is allocated per batch except one small Batch object: each slot's arrays are
 * built once (by the session, as views of the mapped ring whose base is the mapping, so
 * every view of them, torch.from_numpy included, references them). A slot is held while
 * any of its arrays has a reference beyond the loader's own, or while a Batch that was not
 * released is alive; the release pass at each next() hands such slots back once nothing
 * refers to them. The protocol's values and the control line's layout come from ring.h,
 * shared with ring/layout.py and the Zig library; its orderings are tabled in ring/segment.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "ring.h"

/* What the next step's slot holds, as cursor_iternext decides it and supervise receives
 * it (exported to Python as STEP_* constants). */
typedef enum {
    STEP_READY = 0,     /* published by a reader with the right step */
    STEP_IN_FLIGHT = 1, /* requested, or being filled */
    STEP_HELD = 2,      /* still holds an older batch that something refers to */
    STEP_FAILED = 3,    /* its reader failed while filling it (owner: the reader) */
    STEP_WRONG = 4,     /* a state or step this trainer never wrote there */
    STEP_CLOSED = 5,    /* the loader is closed (or was never set up) */
} StepState;

/* What a handed-out array looked like when it was built: a user can change an array's
 * shape, strides, dtype or writeable flag in place, and the next batch in its slot must
 * not inherit that. Per array, in a slot's run of words: data, descr, ndim, writeable,
 * then ndim dimensions and ndim strides. Every slot's run sits in one block beside the
 * slot table, so the check at release time touches a few lines of one page. */
#define SNAPSHOT_FIXED_WORDS 4

typedef struct {
    PyObject *views;            /* tuple: one array per field, then the indices array */
    intptr_t *snapshot;         /* this slot's words in the cursor's snapshot block */
    shm_control_line *control;  /* the slot's control line in the ring */
    uint64_t held_step;
    int held;
    int damaged;                /* an array was changed in place: rebuild before reuse */
} Slot;

typedef struct {
    PyObject_HEAD
    PyObject *weakreflist;      /* the session's finalizer watches the cursor */
    int active;                 /* set up and not closed: the loader's one closed flag */
    int iterating;              /* a thread is inside next(): a second one is refused */
    int waiting;                /* threads inside a native wait (GIL released) */
    int clear_deferred;         /* deactivate() came while one waited: the last waiter clears */
    Py_ssize_t slot_count;
    Py_ssize_t view_count;
    Slot *slots;
    intptr_t *snapshots;        /* one block: each slot's snapshot words, in slot order */
    Py_ssize_t snapshot_words;  /* words per slot */
    PyObject *names;            /* tuple of field names, in view order */
    PyTypeObject *batch_type;   /* a subclass of BatchBase */
    sem_t *work;                /* readers wait on it for requested slots */
    sem_t **ready_semaphores;   /* one per slot: posted when a reader publishes it */
    uint64_t poll_interval_ns;  /* one native wait lasts at most this long; then Python supervises */
    uint64_t check_every;       /* batches between reader checks when next() never waits */
    uint64_t wake_after;        /* wake readers once this many slots were handed back */
    uint64_t pending_posts;     /* slots handed back whose readers were not woken yet */
    uint64_t reader_count;      /* at most this many posts per wake-up; 0: the trainer fills (readers=0) */
    uint64_t trainer_slots;     /* slots the trainer's own references may hold (plan/defaults.TRAINER_SLOTS) */
    unsigned long long next_step;
    unsigned long long batches;
    unsigned long long wait_ns;
    unsigned long long first_next_ns;
    /* A finite pass: next() ends (StopIteration) at end_step, and hands batches from
     * partial_from on to partial(cursor, batch), which returns them cut to their rows.
     * Both are UINT64_MAX for the endless loader. */
    unsigned long long end_step;
    unsigned long long partial_from;
    /* Plain callables given to the constructor: supervise(cursor, state, owner, step),
     * views_of(slot) -> the slot's arrays built afresh, and partial(cursor, batch) -> the
     * batch cut to its rows. None of them refers to the cursor (no cycle). */
    PyObject *supervise;
    PyObject *views_of;
    PyObject *partial;
} Cursor;

typedef struct {
    PyObject_HEAD
    PyObject *views;  /* NULL once released */
    PyObject *names;
    unsigned long long step;
} BatchBase;


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

/* -> REQUESTED with `step`: the one place the trainer requests a slot (release_unused
 * below, and request() for the first ring of steps, a seek and a dead reader's slot). The
 * step word and the request time are published by the release store of the state after
 * them (ring/segment.py's table). */
static inline void request_slot(shm_control_line *control, uint64_t step, unsigned long long now_ns) {
    assert(control != NULL);
    control->step = step;
    control->requested_ns = now_ns;
    __atomic_store_n(&control->state, (uint64_t)SHM_SLOT_REQUESTED, __ATOMIC_RELEASE);
}

/* Requests the next step of every held slot nothing refers to any more, then wakes the
 * readers if `flush` or once wake_after slots wait for them. Waking is the costly part (a
 * futex system call, and an interrupt to the core of a sleeping reader), so while the
 * readers are ahead the trainer wakes them once per wake_after slots; cursor_iternext
 * wakes them at once when they are not (the low-watermark rule of pipes and sockets).
 * Returns how many slots were handed back, or -1 with an exception set. */
static Py_ssize_t release_unused(Cursor *self, int flush) {
    Py_ssize_t released = 0;
    unsigned long long now_ns = 0; /* Read once, and only when a slot goes back. */
    for (Py_ssize_t s = 0; s < self->slot_count; s++) {
        Slot *slot = &self->slots[s];
        if (!slot->held || slot_in_use(slot)) {
            continue;
        }
        if (now_ns == 0) {
            now_ns = monotonic_ns();
        }
        uint64_t word = __atomic_load_n(&slot->control->state, __ATOMIC_ACQUIRE);
        if (word != SHM_SLOT_HELD) { /* Only the trainer writes HELD, and only it leaves it. */
            PyErr_Format(PyExc_RuntimeError, "slot %zd is held by this loader but its state word is %#llx, not HELD: "
                         "another process wrote to the ring", s, (unsigned long long)word);
            return -1;
        }
        assert(slot->views != NULL);
        slot->held = 0;
        /* Checked now, while the arrays' lines are in cache from the reference counts. */
        slot->damaged = !snapshot_matches(slot->snapshot, slot->views);
        uint64_t step = slot->held_step + (uint64_t)self->slot_count;
        if (step >= self->end_step) { /* Past a finite pass: nothing to fill (HELD -> IDLE). */
            __atomic_store_n(&slot->control->state, (uint64_t)SHM_SLOT_IDLE, __ATOMIC_RELEASE);
            continue;
        }
        request_slot(slot->control, step, now_ns); /* HELD -> REQUESTED */
        released++;
    }
    self->pending_posts += (uint64_t)released;
    if ((flush || self->pending_posts >= self->wake_after) && wake_readers(self) < 0) {
        return -1;
    }
    return released;
}


/* ---- Deciding and taking the next step ---------------------------------------------- */

static inline Slot *slot_of(const Cursor *self, unsigned long long step) {
    assert(self->slots != NULL && self->slot_count > 0); /* Set up, and not cleared. */
    return &self->slots[step % (unsigned long long)self->slot_count];
}

/* What `step`'s slot holds (acquire load of its state word, then its step word). */
static StepState step_state(const Cursor *self, unsigned long long step, uint64_t *owner) {
    const Slot *slot = slot_of(self, step);
    uint64_t word = __atomic_load_n(&slot->control->state, __ATOMIC_ACQUIRE);
    uint64_t state = word & SHM_STATE_MASK;
    *owner = word >> SHM_OWNER_SHIFT;
    if (state == SHM_SLOT_HELD) {
        return STEP_HELD;
    }
    if (slot->control->step != step) {
        return STEP_WRONG;
    }
    switch (state) {
    case SHM_SLOT_READY:
        return STEP_READY;
    case SHM_SLOT_REQUESTED:
    case SHM_SLOT_FILLING:
        return STEP_IN_FLIGHT;
    case SHM_SLOT_FAILED:
        return STEP_FAILED;
    default:
        return STEP_WRONG;
    }
}

/* Whether the readers are far enough ahead that waking them can wait: the batch one
 * reader count past this one is ready. Each reader fills one batch at a time, so with
 * fewer ready ahead, the trainer could reach an unfilled step before a deferred wake-up
 * has all readers busy again (a low watermark that grows with the readers, as a pipe's
 * would with its number of producers). */
static int readers_ahead(const Cursor *self) {
    uint64_t room = (uint64_t)self->slot_count > self->trainer_slots + 1 ? (uint64_t)self->slot_count - self->trainer_slots
                                                                           : 1; /* Past the trainer's own. */
    uint64_t lookahead = self->reader_count < room ? self->reader_count : room;
    uint64_t owner;
    return step_state(self, self->next_step + lookahead, &owner) == STEP_READY;
}

static void cursor_clear(Cursor *self);
static int set_views(Cursor *self, Py_ssize_t index, PyObject *views);

/* Hands out the slot of next_step, which the caller found ready. The only place where
 * time spent waiting for data is counted: from `started_ns` (0: next() did not wait). */
static PyObject *take(Cursor *self, unsigned long long started_ns) {
    Py_ssize_t index = (Py_ssize_t)(self->next_step % (unsigned long long)self->slot_count);
    Slot *slot = &self->slots[index];
    if (slot->damaged) {
        /* A user changed one of its arrays in place (shape, dtype, ...) and has let go of
         * it since: the slot gets fresh arrays. Rare; Python builds them. */
        PyObject *number = PyLong_FromSsize_t(index);
        PyObject *views = number == NULL ? NULL : PyObject_CallOneArg(self->views_of, number);
        Py_XDECREF(number);
        int failed = views == NULL || set_views(self, index, views) < 0;
        Py_XDECREF(views);
        if (failed) {
            return NULL;
        }
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
    /* READY -> HELD: relaxed; only the trainer reads HELD, and it publishes nothing. */
    __atomic_store_n(&slot->control->state, (uint64_t)SHM_SLOT_HELD, __ATOMIC_RELAXED);
    slot->held = 1;
    slot->held_step = self->next_step;
    self->next_step++;
    self->batches++;
    if (self->first_next_ns == 0) {
        self->first_next_ns = started_ns != 0 ? started_ns : monotonic_ns();
    }
    if (started_ns != 0) {
        self->wait_ns += monotonic_ns() - started_ns;
    }
    if (batch->step >= self->partial_from) { /* The end of a finite pass, or a resumed first step: Python cuts it. */
        PyObject *cut = PyObject_CallFunctionObjArgs(self->partial, (PyObject *)self, (PyObject *)batch, NULL);
        Py_DECREF(batch);
        return cut;
    }
    return (PyObject *)batch;
}

typedef enum { WAIT_CHANGED, WAIT_TIMED_OUT, WAIT_CLOSED, WAIT_ERROR } WaitResult;

/* Any step in wait_slot: wait while the slot is REQUESTED or FILLING, whatever its step. */
#define ANY_STEP UINT64_MAX

/* Whether slot `index` is still in flight: with `step` (its step word must match, so any
 * other state or step ends the wait), or with any step. */
static int still_in_flight(const Cursor *self, Py_ssize_t index, uint64_t step) {
    uint64_t owner;
    if (step != ANY_STEP) {
        return step_state(self, step, &owner) == STEP_IN_FLIGHT;
    }
    uint64_t state = __atomic_load_n(&self->slots[index].control->state, __ATOMIC_ACQUIRE) & SHM_STATE_MASK;
    return state == SHM_SLOT_REQUESTED || state == SHM_SLOT_FILLING;
}

/* Waits, without the GIL, at most `timeout_ns` for slot `index` to leave the in-flight
 * states (see still_in_flight). The slot's waiter flag is armed for the wait, so that
 * readers post its semaphore only while someone waits (ring.h): the semaphore's count
 * stays bounded, and a stale post left by an earlier wait is consumed here and looked
 * past. The one wait of the protocol on the trainer's side: next()'s and a seek's. */
static WaitResult wait_slot(Cursor *self, Py_ssize_t index, uint64_t step, uint64_t timeout_ns) {
    assert(self->slots != NULL && index >= 0 && index < self->slot_count);
    assert(step == ANY_STEP || step % (uint64_t)self->slot_count == (uint64_t)index);
    Slot *slot = &self->slots[index];
    sem_t *semaphore = self->ready_semaphores[index];
    unsigned long long deadline_ns = monotonic_ns() + timeout_ns;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_nsec += (long)(timeout_ns % 1000000000ull);
    deadline.tv_sec += (time_t)(timeout_ns / 1000000000ull) + deadline.tv_nsec / 1000000000L;
    deadline.tv_nsec %= 1000000000L;
    __atomic_store_n(&slot->control->waiter, 1, __ATOMIC_SEQ_CST);
    WaitResult outcome = WAIT_TIMED_OUT;
    /* Bounded by the deadline, checked on every turn whatever the semaphore holds. */
    for (;;) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST); /* The waiter store is visible before the state is read. */
        if (!still_in_flight(self, index, step)) {
            outcome = WAIT_CHANGED;
            break;
        }
        if (monotonic_ns() >= deadline_ns) {
            break;
        }
        int result, error;
        self->waiting++;
        Py_BEGIN_ALLOW_THREADS
        result = sem_timedwait(semaphore, &deadline);
        error = errno;
        Py_END_ALLOW_THREADS
        self->waiting--;
        /* Without the GIL, another thread may have closed the loader: its slots and
         * semaphores are freed only once no thread waits on them. */
        if (!self->active) {
            if (self->clear_deferred && self->waiting == 0) {
                cursor_clear(self);
            }
            return WAIT_CLOSED;
        }
        if (result != 0 && error == EINTR) {
            outcome = PyErr_CheckSignals() < 0 ? WAIT_ERROR : WAIT_CHANGED;
            break;
        }
        if (result != 0) {
            break; /* ETIMEDOUT, or an error of the semaphore: Python supervises. */
        }
        /* A post: this step, or a stale one from an earlier wait; look again. */
    }
    __atomic_store_n(&slot->control->waiter, 0, __ATOMIC_RELAXED);
    return outcome;
}

/* next()'s wait: at most one poll interval for next_step's slot (or the next one's, see
 * below) to leave the in-flight states, the common wait of a trainer that outruns its
 * readers. */
static WaitResult wait_in_flight(Cursor *self) {
    unsigned long long step = self->next_step;
    /* When the step after this one is in flight too, sleep until that one is published:
     * readers claim the lowest step first, so this one is normally ready by then, and the
     * trainer pays one sleep and wake-up (a futex round trip, a fifth of a core on a small
     * machine) per two batches. Readers lose nothing: the requests ahead keep them busy.
     * The caller looks at next_step again after any wake-up, so a failed or stuck step is
     * still seen within a poll interval. */
    uint64_t ahead_owner;
    if (self->slot_count > 3 && step_state(self, step + 1, &ahead_owner) == STEP_IN_FLIGHT) {
        step += 1;
    }
    if (wake_readers(self) < 0) {
        return WAIT_ERROR; /* Readers asleep with pending requests would cost a whole poll. */
    }
    return wait_slot(self, (Py_ssize_t)(step % (unsigned long long)self->slot_count), step, self->poll_interval_ns);
}

/* Calls supervise(cursor, state, owner, step): reader checks and errors. */
static int supervise(Cursor *self, StepState state, uint64_t owner) {
    if (self->supervise == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the loader was never set up");
        return -1;
    }
    PyObject *state_number = PyLong_FromLong((long)state);
    PyObject *owner_number = PyLong_FromUnsignedLongLong((unsigned long long)owner);
    PyObject *step_number = PyLong_FromUnsignedLongLong(self->next_step);
    PyObject *result = NULL;
    if (state_number != NULL && owner_number != NULL && step_number != NULL) {
        result = PyObject_CallFunctionObjArgs(self->supervise, (PyObject *)self, state_number, owner_number,
                                              step_number, NULL);
    }
    Py_XDECREF(state_number);
    Py_XDECREF(owner_number);
    Py_XDECREF(step_number);
    if (result == NULL) {
        return -1;
    }
    Py_DECREF(result);
    return 0;
}

static PyObject *next_batch(Cursor *self) {
    if (!self->active) {
        supervise(self, STEP_CLOSED, 0);
        return NULL; /* supervise raises for a closed loader; if it did not, end iteration. */
    }
    if (release_unused(self, 0) < 0) {
        return NULL;
    }
    if (self->next_step >= self->end_step) {
        return NULL; /* The end of a finite pass: StopIteration. */
    }
    int due = (self->batches + 1) % self->check_every == 0;
    unsigned long long started_ns = 0;
    /* Each turn takes the batch, waits at most one poll interval, or lets supervise check
     * the readers, which raises once a bound is passed (restarts, hold_timeout). */
    for (;;) {
        uint64_t owner = 0;
        StepState state = self->active ? step_state(self, self->next_step, &owner) : STEP_CLOSED;
        if (state == STEP_READY && due) {
            due = 0; /* Ready, but due for the periodic reader check: not a wait. */
            if (supervise(self, state, owner) < 0) {
                return NULL;
            }
            continue;
        }
        if (state == STEP_READY) {
            if (started_ns == 0 && self->pending_posts > 0 && !readers_ahead(self) && wake_readers(self) < 0) {
                return NULL;
            }
            return take(self, started_ns);
        }
        if (started_ns == 0) {
            started_ns = monotonic_ns(); /* Not ready at once: from here on, next() waits. */
        }
        /* With no reader processes (readers=0) nobody else fills it: supervise fills the
         * step in this thread, and the next turn takes it. */
        if (state == STEP_IN_FLIGHT && self->reader_count > 0) {
            WaitResult waited = wait_in_flight(self);
            if (waited == WAIT_ERROR) {
                return NULL;
            }
            if (waited == WAIT_CHANGED) {
                continue;
            }
            if (waited == WAIT_CLOSED) {
                state = STEP_CLOSED;
            }
        }
        if (supervise(self, state, owner) < 0) {
            return NULL;
        }
        if (state == STEP_CLOSED) {
            return NULL; /* supervise returned for a closed loader: end the iteration. */
        }
    }
}

/* tp_iternext: one thread at a time (the slot states are not the other's to change). */
static PyObject *cursor_iternext(Cursor *self) {
    if (self->iterating) {
        PyErr_SetString(PyExc_RuntimeError,
                        "another thread is inside next() of this loader; one thread iterates a loader "
                        "(batches may be used and dropped from any thread)");
        return NULL;
    }
    self->iterating = 1;
    PyObject *batch = next_batch(self);
    self->iterating = 0;
    return batch;
}

/* ---- Cursor methods (the API session.py uses) --------------------------------------- */

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
    self->snapshot_words = snapshot_words_of(first);
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
        if (set_views(self, s, PyTuple_GET_ITEM(views, s)) < 0) {
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
                               "wake_after_slots", "reader_count", "trainer_slots", "poll_interval_ns",
                               "end_step", "partial_from", "supervise", "views_of", "partial", NULL};
    if (self->slots != NULL || self->supervise != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the cursor is already set up");
        return -1;
    }
    unsigned long long control_table, slot_count, next_step, check_every, wake_after, reader_count, trainer_slots,
        poll_ns, end_step, partial_from;
    PyObject *work, *ready, *names, *batch_type, *views, *supervise, *views_of, *partial;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&O&UO!O!OO!O&O&O&O&O&O&O&O&OOO:Cursor", keywords, u64_of,
                                     &control_table, u64_of, &slot_count, &work, &PyTuple_Type, &ready,
                                     &PyTuple_Type, &names, &batch_type, &PyTuple_Type, &views, u64_of, &next_step,
                                     u64_of, &check_every, u64_of, &wake_after, u64_of, &reader_count, u64_of,
                                     &trainer_slots, u64_of, &poll_ns, u64_of, &end_step, u64_of, &partial_from,
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
    if (check_every < 1 || wake_after < 1 || poll_ns < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "check_every_batches, wake_after_slots and poll_interval_ns must be at least 1");
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
    self->wake_after = wake_after;
    self->reader_count = reader_count;
    self->trainer_slots = trainer_slots;
    self->end_step = end_step;
    self->partial_from = partial_from;
    self->poll_interval_ns = poll_ns;
    self->pending_posts = 0;
    self->active = 1;
    return 0;
}

static PyObject *cursor_release_unused(Cursor *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->active) {
        return PyLong_FromLong(0);
    }
    Py_ssize_t released = release_unused(self, 1);
    return released < 0 ? NULL : PyLong_FromSsize_t(released);
}

/* request(slot, step): IDLE, READY (a seek discards it) or FILLING (its filler is dead or
 * gave up: the caller knows) -> REQUESTED, then wakes a reader. HELD is release_unused's
 * to hand back, REQUESTED is a request already, FAILED must be raised first. */
static PyObject *cursor_request(Cursor *self, PyObject *args) {
    Py_ssize_t index;
    unsigned long long step;
    if (!PyArg_ParseTuple(args, "nK", &index, &step)) {
        return NULL;
    }
    if (self->slots == NULL || index < 0 || index >= self->slot_count) {
        PyErr_Format(PyExc_IndexError, "no slot %zd", index);
        return NULL;
    }
    Slot *slot = &self->slots[index];
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
    request_slot(slot->control, step, monotonic_ns());
    self->pending_posts++;
    if (wake_readers(self) < 0) {
        return NULL;
    }
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
        PyErr_Format(PyExc_ValueError, "timeout_seconds must be in [0, 1e9), got %g", timeout_seconds);
        return NULL;
    }
    WaitResult waited = wait_slot(self, index, ANY_STEP, (uint64_t)(timeout_seconds * 1e9));
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
    if (!PyArg_ParseTuple(args, "O!K", &PyTuple_Type, &views, &step)) {
        return NULL;
    }
    if (self->batch_type == NULL || self->names == NULL ||
        PyTuple_GET_SIZE(views) != PyTuple_GET_SIZE(self->names) + 1) {
        PyErr_SetString(PyExc_ValueError, "batch_of needs a set-up cursor and one array per name, then the indices");
        return NULL;
    }
    BatchBase *batch = (BatchBase *)self->batch_type->tp_alloc(self->batch_type, 0);
    if (batch == NULL) {
        return NULL;
    }
    batch->views = Py_NewRef(views);
    batch->names = Py_NewRef(self->names);
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
    {"wait_filled", (PyCFunction)cursor_wait_filled, METH_VARARGS,
     "Waits at most timeout_seconds for a slot to leave REQUESTED and FILLING; False on time-out."},
    {"batch_of", (PyCFunction)cursor_batch_of, METH_VARARGS, "A Batch over the given arrays (a partial batch)."},
    {"deactivate", (PyCFunction)cursor_deactivate, METH_NOARGS,
     "Closes the cursor: drops every slot's arrays and semaphores; next() raises through supervise."},
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
    {NULL},
};

static PyTypeObject CursorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader._cursor.Cursor",
    .tp_doc = "The trainer's iterator over the ring: next() natively (see _cursor.c). Built by "
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
    if (PyType_Ready(&CursorType) < 0 ||
        PyType_Ready(&BatchBaseType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&cursor_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Cursor", (PyObject *)&CursorType) < 0 ||
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
