/*
 * The trainer's side of the slot protocol: next() on the ring, natively.
 *
 * Why native: after a training step the trainer's caches and TLB are cold, and every line
 * of code or data next() touches costs a miss; a next() in Python touches the interpreter,
 * numpy's array constructor and cffi. This file decides, in one function (cursor_next),
 * what the next step's slot holds: ready, in flight (requested or being filled), held by a
 * user's views, failed by its reader, or wrong. It takes a ready slot, waits for one in
 * flight (one poll interval at a time, without the GIL), and counts the time it waited in
 * one place (take). Python is called, through the `supervise` callable it was built with
 * (ring/step_codes.py maps its codes to actions), only to supervise readers and to raise
 * errors. With readers=0 nothing here fills a step either: the loader's iterator
 * (readers/local.py) lets its local reader fill the step before it calls next(), which
 * finds it ready like any reader's.
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
 * shared with ring/layout.py and the Zig library; the state changes it makes, and their
 * orderings, are tabled in ring/transitions.py.
 *
 * This file is next() and everything it touches, one translation unit so that the hot path
 * inlines (the reason it is longer than the others), and the cursor's teardown, which only
 * next() and its wait know when to run. It calls no other file of the extension: building
 * the cursor and its other methods are _cursor_type.c's, the base type of Batch
 * _cursor_batch.c's, the module and the base type of ShmDataLoader _cursor_module.c's,
 * their shared structs _cursor.h's.
 */
#include "_cursor.h"

PyTypeObject *cursor_ndarray_type = NULL; /* Set by PyInit__cursor (_cursor_module.c). */

/* ---- Teardown ----------------------------------------------------------------------- */

/* Closes the cursor: drops every slot's arrays and the semaphores, or, while a thread is
 * inside next() or a wait, marks them for that thread to drop when it leaves. */
void cursor_clear(Cursor *self) {
    self->active = 0;
    if (self->waiting > 0 || self->iterating) {
        /* A thread is inside next() (its callbacks and allocations can run any Python code,
         * a close from another thread included) or waits on a semaphore of ours: the slot
         * table and the semaphores stay until it leaves, and it clears them then. */
        self->clear_deferred = 1;
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

/* ---- Snapshots ---------------------------------------------------------------------- */

Py_ssize_t cursor_snapshot_words(PyObject *views) {
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
int cursor_wake(Cursor *self) {
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
 * readers are ahead the trainer wakes them once per wake_after slots; cursor_next
 * wakes them at once when they are not (the low-watermark rule of pipes and sockets).
 * Returns how many slots were handed back, or -1 with an exception set. */
Py_ssize_t cursor_release(Cursor *self, int flush) {
    Py_ssize_t released = 0;
    unsigned long long now_ns = 0; /* Read once, and only when a slot goes back. */
    for (Py_ssize_t s = 0; s < self->slot_count; s++) {
        Slot *slot = &self->slots[s];
        if (!slot->held) {
            continue;
        }
        CURSOR_ASSERT(slot->views != NULL, -1); /* A held slot keeps its arrays until it goes back. */
        if (slot_in_use(slot)) {
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
        /* Slot s only ever holds steps k with k % slot_count == s. */
        CURSOR_ASSERT(slot->held_step % (uint64_t)self->slot_count == (uint64_t)s, -1);
        slot->held = 0;
        /* Checked now, while the arrays' lines are in cache from the reference counts. */
        slot->damaged = !snapshot_matches(slot->snapshot, slot->views);
        uint64_t step = slot->held_step + (uint64_t)self->slot_count;
        if (step >= self->end_step) { /* Past a finite pass: nothing to fill. */
            /* transition: HELD -> IDLE */
            __atomic_store_n(&slot->control->state, (uint64_t)SHM_SLOT_IDLE, __ATOMIC_RELEASE);
            continue;
        }
        /* transition: HELD -> REQUESTED */
        if (request_slot(slot->control, step, now_ns) < 0) {
            return -1;
        }
        released++;
    }
    self->pending_posts += (uint64_t)released;
    if ((flush || self->pending_posts >= self->wake_after) && cursor_wake(self) < 0) {
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

/* What next_step's slot holds now, before next()'s release pass (STEP_CLOSED for a closed
 * cursor): the Cursor's next_state, by which readers=0's iterator knows whether to fill. */
StepState cursor_next_state(const Cursor *self) {
    uint64_t owner;
    return self->active ? step_state(self, self->next_step, &owner) : STEP_CLOSED;
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

/* Hands out the slot of next_step, which the caller found ready. The only place where
 * time spent waiting for data is counted: from `started_ns` (0: next() did not wait). */
static int supervise(Cursor *self, StepState state, uint64_t owner);

static PyObject *take(Cursor *self, unsigned long long started_ns) {
    Py_ssize_t index = (Py_ssize_t)(self->next_step % (unsigned long long)self->slot_count);
    Slot *slot = &self->slots[index];
    /* A slot this loader still holds is never handed out again (its batch's arrays would
     * change under whoever holds them): a reader published into a slot it had not claimed. */
    CURSOR_ASSERT(!slot->held, NULL);
    CURSOR_ASSERT(self->next_step < self->end_step, NULL);
    /* READY -> HELD's precondition, as step_state found it: only the trainer leaves READY. */
    CURSOR_ASSERT((__atomic_load_n(&slot->control->state, __ATOMIC_RELAXED) & SHM_STATE_MASK) == SHM_SLOT_READY, NULL);
    CURSOR_ASSERT(slot->control->step == self->next_step, NULL);
    if (slot->damaged) {
        /* A user changed one of its arrays in place (shape, dtype, ...) and has let go of
         * it since: the slot gets fresh arrays. Rare; Python builds them. */
        PyObject *number = PyLong_FromSsize_t(index);
        PyObject *views = number == NULL ? NULL : PyObject_CallOneArg(self->views_of, number);
        Py_XDECREF(number);
        if (views != NULL && !self->active) {
            /* Closed meanwhile (another thread, or a fork in that code: the child's copy is
             * cleared at once), so the slot table may be gone: deliver nothing. */
            Py_DECREF(views);
            supervise(self, STEP_CLOSED, 0);
            return NULL;
        }
        int failed = views == NULL || cursor_store_views(self, index, views) < 0;
        Py_XDECREF(views);
        if (failed) {
            return NULL;
        }
    }
    BatchBase *batch = (BatchBase *)self->batch_type->tp_alloc(self->batch_type, 0);
    if (batch == NULL) {
        return NULL;
    }
    if (!self->active) {
        /* Closed by the code that ran meanwhile (views_of, or finalizers the allocation
         * collected): the slot table stays until next() leaves, but nothing is delivered. */
        Py_DECREF(batch);
        supervise(self, STEP_CLOSED, 0); /* Raises that the loader is closed; else iteration ends. */
        return NULL;
    }
    Py_INCREF(slot->views);
    batch->views = slot->views;
    Py_INCREF(self->names);
    batch->names = self->names;
    batch->step = self->next_step;
    /* transition: READY -> HELD. Relaxed: only the trainer reads HELD, and it publishes nothing. */
    __atomic_store_n(&slot->control->state, (uint64_t)SHM_SLOT_HELD, __ATOMIC_RELAXED);
    slot->held = 1;
    slot->held_step = self->next_step;
    self->next_step++;
    self->batches++;
    if (self->first_next_ns == 0) {
        self->first_next_ns = started_ns != 0 ? started_ns : monotonic_ns();
    }
    if (started_ns != 0) {
        unsigned long long waited_ns = monotonic_ns() - started_ns;
        self->wait_ns += waited_ns;
        /* The trainer alone writes the line's waited_ns (ring.h), so a plain sum; relaxed, since
         * its readers (top, stats()) only sample it. */
        __atomic_store_n(&slot->control->waited_ns, slot->control->waited_ns + waited_ns, __ATOMIC_RELAXED);
    }
    if (batch->step >= self->partial_from) { /* The end of a finite pass, or a resumed first step: Python cuts it. */
        PyObject *cut = PyObject_CallFunctionObjArgs(self->partial, (PyObject *)self, (PyObject *)batch, NULL);
        Py_DECREF(batch);
        return cut;
    }
    return (PyObject *)batch;
}

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
WaitResult cursor_wait(Cursor *self, Py_ssize_t index, uint64_t step, uint64_t timeout_ns) {
    CURSOR_ASSERT(self->slots != NULL, WAIT_ERROR);
    CURSOR_ASSERT(index >= 0 && index < self->slot_count, WAIT_ERROR);
    CURSOR_ASSERT(step == ANY_STEP || step % (uint64_t)self->slot_count == (uint64_t)index, WAIT_ERROR);
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
            if (self->clear_deferred && self->waiting == 0 && !self->iterating) {
                cursor_clear(self); /* A seek's wait (next()'s clears when it leaves next()). */
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

/* How many steps past next_step the trainer may sleep on at most (see wait_ahead). */
#define WAIT_AHEAD_MAX 3

/* How many steps past next_step the trainer sleeps on, given the readers' delivery
 * interval measured between its last two waits: one, as long as the ring has room for it;
 * WAIT_AHEAD_MAX while that many more steps come within wait_ahead_span_ns (the trainer
 * then takes its own step at most that much later than it could have, and sleeps once per
 * four batches, not per two), never so far that the readers are left without a requested
 * step: the ring less the trainer's slots, one step being filled per reader, and one. Slow
 * steps (or none measured yet) keep to one: the trainer would sleep through whole poll
 * intervals (one step after another of a single reader) while its own step waited ready. */
static uint64_t wait_ahead(const Cursor *self) {
    uint64_t slots = (uint64_t)self->slot_count;
    if (slots <= 3) {
        return 0;
    }
    uint64_t reserved = self->trainer_slots + self->reader_count + 1;
    uint64_t room = slots > reserved ? slots - reserved : 0;
    uint64_t interval = self->batch_interval_ns;
    if (room <= 1 || interval == 0 || interval > self->wait_ahead_span_ns / (WAIT_AHEAD_MAX + 1)) {
        return 1;
    }
    return room < WAIT_AHEAD_MAX ? room : WAIT_AHEAD_MAX;
}

/* next()'s wait: at most one poll interval for next_step's slot (or a later one's, see
 * below) to leave the in-flight states, the common wait of a trainer that outruns its
 * readers. */
static WaitResult wait_in_flight(Cursor *self) {
    unsigned long long step = self->next_step;
    /* The readers' delivery interval: the batches handed out since the last wait began, over
     * the time since (a wait that handed out none leaves it unknown). */
    unsigned long long now_ns = monotonic_ns();
    if (self->wait_mark_ns != 0) {
        unsigned long long delivered = self->batches - self->wait_mark_batches;
        self->batch_interval_ns = delivered > 0 ? (now_ns - self->wait_mark_ns) / delivered : 0;
    }
    self->wait_mark_ns = now_ns;
    self->wait_mark_batches = self->batches;
    /* While the steps after this one are in flight too, sleep until the last of up to
     * wait_ahead() of them is published: readers claim the lowest step first, so this one
     * and those between are normally ready by then, and the trainer pays fewer sleeps and
     * wake-ups (a futex round trip and a context switch that preempts a reader: a fifth of
     * a core on a small or virtual machine). Readers lose nothing: the requests ahead keep
     * them busy. The caller looks at next_step again after any wake-up, so a failed or
     * stuck step is still seen within a poll interval. */
    uint64_t ahead_owner;
    uint64_t ahead = wait_ahead(self);
    while (ahead-- > 0 && step + 1 < self->end_step && step_state(self, step + 1, &ahead_owner) == STEP_IN_FLIGHT) {
        step += 1;
    }
    if (cursor_wake(self) < 0) {
        return WAIT_ERROR; /* Readers asleep with pending requests would cost a whole poll. */
    }
    /* A sleep past the step after the trainer's lasts at most the span four times over: readers
     * that slowed down since the interval was measured would otherwise keep a ready step
     * waiting a whole poll interval. Then next() looks again, with the interval measured
     * anew (no batch since: one step ahead), and no supervision is due yet. */
    uint64_t timeout_ns = self->poll_interval_ns;
    int beyond = step > self->next_step + 1;
    if (beyond && 4 * self->wait_ahead_span_ns < timeout_ns) {
        timeout_ns = 4 * self->wait_ahead_span_ns;
    }
    WaitResult waited = cursor_wait(self, (Py_ssize_t)(step % (unsigned long long)self->slot_count), step, timeout_ns);
    return waited == WAIT_TIMED_OUT && beyond ? WAIT_CHANGED : waited;
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
    /* Not 0 only where readers=0's local reader filled this step just before (the time it
     * began): that fill is this next()'s wait for data, as a reader's would be. */
    unsigned long long started_ns = self->waiting_since_ns;
    self->waiting_since_ns = 0;
    CURSOR_ASSERT(started_ns == 0 || started_ns <= monotonic_ns(), NULL); /* A time that has come, of now_ns's clock. */
    if (!self->active) {
        supervise(self, STEP_CLOSED, 0);
        return NULL; /* supervise raises for a closed loader; if it did not, end iteration. */
    }
    if (cursor_release(self, 0) < 0) {
        return NULL;
    }
    if (self->next_step >= self->end_step) {
        return NULL; /* The end of a finite pass: StopIteration. */
    }
    /* Due every check_every batches, or once check_every_ns passed since the last: a trainer
     * whose steps are slow still has its readers checked and its tuner run (its entry in the
     * node's reader budget record stays fresh: readers/budget_record.py's idle rule). */
    unsigned long long now_ns = monotonic_ns();
    int due = (self->batches + 1) % self->check_every == 0 || now_ns - self->checked_ns >= self->check_every_ns;
    if (due) {
        self->checked_ns = now_ns;
    }
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
            if (started_ns == 0 && self->pending_posts > 0 && !readers_ahead(self) && cursor_wake(self) < 0) {
                return NULL;
            }
            return take(self, started_ns);
        }
        if (started_ns == 0) {
            started_ns = monotonic_ns(); /* Not ready at once: from here on, next() waits. */
        }
        if (state == STEP_IN_FLIGHT) {
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
PyObject *cursor_next(Cursor *self) {
    if (cursor_refuse_if_busy(self) < 0) {
        return NULL;
    }
    self->iterating = 1;
    PyObject *batch = next_batch(self);
    self->iterating = 0;
    if (self->clear_deferred && self->waiting == 0) {
        cursor_clear(self); /* Closed while this thread was inside: cleared now that it left. */
    }
    return batch;
}


/* Stores `views` (a tuple of view_count numpy arrays) as slot `index`'s arrays. */
int cursor_store_views(Cursor *self, Py_ssize_t index, PyObject *views) {
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
    if (cursor_snapshot_words(views) != self->snapshot_words) {
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
