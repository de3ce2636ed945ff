/*
 * The native cursor's shared declarations: the structs of the cursor, its slots and a
 * batch, and the functions one file of the extension calls in another. The extension is
 * four files, each calling only the ones below it (tests/test_cursor_c.py checks it):
 *
 *     _cursor_module.c   the module, and LoaderBase (the base of ShmDataLoader)
 *       -> _cursor_type.c    building the cursor, its methods, its type
 *       -> _cursor.c         next() and what it touches, one translation unit so that the
 *                            hot path inlines; the cursor's teardown (cursor_clear)
 *       -> _cursor_batch.c   BatchBase, the base of ring/batch.py's Batch
 *
 *     _cursor_seeds.c     a dataset sample's global generator states (fill/global_seeds.py),
 *                         apart from the ring: a vectorcall costs a sample less than cffi
 *
 * (_cursor_module.c also calls _cursor.c, _cursor_batch.c and _cursor_seeds.c, _cursor_type.c
 * _cursor_batch.c; _cursor.c, _cursor_batch.c and _cursor_seeds.c call no other file). See _cursor.c for
 * the design, and ring/transitions.py for the slot states the cursor writes.
 */
#ifndef SHMLOADER_CURSOR_H
#define SHMLOADER_CURSOR_H

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

/* What the next step's slot holds, as cursor_next decides it and supervise receives
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
    uint64_t check_every_ns;    /* ... or this long, whichever comes first: a slow trainer's loader is checked too */
    unsigned long long checked_ns; /* when the last periodic check was due */
    uint64_t wake_after;        /* wake readers once this many slots were handed back */
    uint64_t pending_posts;     /* slots handed back whose readers were not woken yet */
    uint64_t reader_count;      /* at most this many posts per wake-up; 0: readers=0, whose local reader
                                 * fills each step before next() (readers/local.py) */
    uint64_t trainer_slots;     /* slots the trainer's own references may hold (plan/defaults.TRAINER_SLOTS) */
    uint64_t wait_ahead_span_ns; /* how much longer than needed next() may sleep to sleep less often (wait_in_flight) */
    unsigned long long wait_mark_ns;       /* when the last wait for an in-flight step began (0: none yet) */
    unsigned long long wait_mark_batches;  /* batches handed out by then */
    unsigned long long batch_interval_ns;  /* readers' delivery interval between the last two waits (0: unknown) */
    unsigned long long next_step;
    unsigned long long batches;
    unsigned long long wait_ns;
    unsigned long long first_next_ns;
    unsigned long long waiting_since_ns; /* readers=0: when the local reader began filling next_step, else 0 */
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

/* How a wait ended (cursor_wait in _cursor.c). */
typedef enum { WAIT_CHANGED, WAIT_TIMED_OUT, WAIT_CLOSED, WAIT_ERROR } WaitResult;

/* Any step in cursor_wait: wait while the slot is REQUESTED or FILLING, whatever its step. */
#define ANY_STEP UINT64_MAX

/* What each file offers the files above it (see the first lines). */

/* _cursor.c */
PyObject *cursor_next(Cursor *self);
Py_ssize_t cursor_release(Cursor *self, int flush);
int cursor_wake(Cursor *self);
WaitResult cursor_wait(Cursor *self, Py_ssize_t index, uint64_t step, uint64_t timeout_ns);
StepState cursor_next_state(const Cursor *self);
int cursor_store_views(Cursor *self, Py_ssize_t index, PyObject *views);
Py_ssize_t cursor_snapshot_words(PyObject *views);
void cursor_clear(Cursor *self);
extern PyTypeObject *cursor_ndarray_type; /* numpy.ndarray, set when the module loads */

/* _cursor_batch.c */
extern PyTypeObject BatchBaseType;

/* _cursor_type.c */
extern PyTypeObject CursorType;

/* _cursor_seeds.c */
PyObject *seeds_write(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *seeds_words(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
int seeds_ready(void);
extern PyTypeObject SampleSeederType;

/* _cursor_module.c: only PyInit__cursor, which leaves the extension. */

/* An invariant of the cursor, or the precondition of a slot transition it makes
 * (ring/transitions.py): false only through a bug, in this code or in a process that
 * wrote the ring against the protocol. It raises AssertionError naming the file, the line
 * and the condition, and the function returns `failed`: an exception the trainer sees,
 * where abort() would take its process down. Never compiled out (NDEBUG does not touch
 * it), so each one costs a compare on a line next() has in cache: none runs per row. What
 * the ring may hold that no process of this loader wrote (a state word of no state) is
 * foreign input instead, with its own error (step_state's STEP_WRONG). assert() remains
 * only where no error can be returned (slot_of). */
#define CURSOR_ASSERT(condition, failed)                                                             \
    do {                                                                                             \
        if (__builtin_expect(!(condition), 0)) {                                                     \
            PyErr_Format(PyExc_AssertionError, "%s:%d: %s (an invariant of the slot protocol)",      \
                         __FILE_NAME__, __LINE__, #condition);                                       \
            return failed;                                                                           \
        }                                                                                            \
    } while (0)

/* -> REQUESTED with `step`: the one store by which the trainer requests a slot (the
 * release pass, and request() for the first ring of steps, a seek and a dead reader's
 * slot). The step word and the request time are published by the release store of the
 * state after them (ring/transitions.py). Its callers say which transition they make; the
 * state found must be one that may become REQUESTED. Returns -1 with AssertionError set
 * if not. */
static inline int request_slot(shm_control_line *control, uint64_t step, unsigned long long now_ns) {
    /* The sources of the table's X -> REQUESTED edges: never REQUESTED (one step requested
     * twice) nor FAILED (final: raised, never requested again). */
    uint64_t from = __atomic_load_n(&control->state, __ATOMIC_RELAXED) & SHM_STATE_MASK;
    CURSOR_ASSERT(from == SHM_SLOT_IDLE || from == SHM_SLOT_READY || from == SHM_SLOT_FILLING ||
                      from == SHM_SLOT_HELD, -1);
    control->step = step;
    control->requested_ns = now_ns;
    __atomic_store_n(&control->state, (uint64_t)SHM_SLOT_REQUESTED, __ATOMIC_RELEASE);
    return 0;
}

/* Whether `object` is numpy.ndarray itself: a slot's arrays are read as PyArrayObject, so
 * nothing else, however it is named, may pass for one. */
static inline int is_ndarray(PyObject *object) {
    return Py_TYPE(object) == cursor_ndarray_type;
}

/* One thread at a time steps the cursor: next(), and a seek (enter() .. leave()). Raises,
 * returning -1, when one is inside already: another thread, or code it runs (a transform
 * with readers=0, a finalizer, a gc callback), which would move the step under it. */
static inline int cursor_refuse_if_busy(Cursor *self) {
    if (!self->iterating) {
        return 0;
    }
    PyErr_SetString(PyExc_RuntimeError,
                    "next() or seek() of this loader is already running, in another thread or in code it runs "
                    "(a transform with readers=0, a finalizer, a gc callback); one thread iterates and seeks a "
                    "loader (batches may be used and dropped from any thread)");
    return -1;
}

#endif
