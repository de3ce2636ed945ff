"""The shared-memory ring: creating and attaching its segment, its semaphores and the slot states.

The protocol's values and fixed structs are defined once, in ring.h (beside this file),
which _cursor.c includes, the Zig build translates and cffi parses: layout.py reads them
as lib.SHM_... and ffi.sizeof(...), and the offsets below are computed by its RingLayout
alone.

Segment layout (all integers little-endian, offsets in bytes):

    offset          size                  what                    meaning
    --------------  --------------------  ----------------------  ------------------------------------------
    0               128                   shm_ring_header         magic, version, counts, trainer pid, batch
                                                                  size, slot stride, slots offset, stop flag,
                                                                  what the readers run (for top's verdict)
    128 + r*16384   16384                 reader r's record       shm_reader_record (pid, busy_ns, batches,
                                                                  error_bytes, skipped, busy time by stage),
                                                                  2048 bytes of JSON on the records it
                                                                  skipped, its JSON error report
    table_offset    slot_count * 64       control table           one shm_control_line per slot: state, step,
                                                                  waiter, requested_ns, next()'s waits
    slots_offset    slot_count * stride   slot data               per slot: its SlotLayout (slot_layout.py):
                                                                  uint64 indices (8*B), then each region, 64-byte
                                                                  aligned: a field's rows, a ragged field's
                                                                  padded or packed values and its lengths or
                                                                  offsets
    checked_offset  checked_pages * 4096  checked blocks          which blocks of the loader's Blosc2 files its
                                                                  readers have checked, one bit each, shared by
                                                                  them (storage/checked_blocks.py has its table)

table_offset = 128 + reader_count*16384; slots_offset and slot_stride are multiples of 4096;
checked_offset = slots_offset + slot_count*stride.
The control lines sit together, apart from the data, so that the trainer's next() and
the readers' scans read one page of them rather than one page per slot: after a training
step every page touched is a TLB miss, and the data of the slots is megabytes apart.

Slot s only ever holds steps k with k % slot_count == s, so batches come out in step order.
A slot's state word holds the state in its low byte (SHM_STATE_MASK) and the filling
reader's index above it (SHM_OWNER_SHIFT). Every change of it, with who makes it, where,
and its memory ordering, is tabled in transitions.py (TRANSITIONS), checked against the
code by tests/test_transitions.py; the Ring's methods below make the Python side's.

Liveness of a ring's owner: the creating trainer holds an exclusive flock on the segment
for the ring's lifetime (the kernel drops it when the process dies or execs, whatever
PID namespace looks at it). Readers test it to learn that their trainer is gone; the
stale sweep of a new loader removes only segments whose lock it can take.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import posix_ipc

from .._native import ffi, lib
from ..errors import SharedMemoryError
from .layout import (
    OWNER_SHIFT,
    RING_MAGIC,
    RING_VERSION,
    SHM_DIRECTORY,
    STATE_MASK,
    RingLayout,
    RingNames,
    SlotState,
)
from .records import ReaderRecords
from . import backing, janitor
from .stale import lock_free


def wait(semaphore: posix_ipc.Semaphore, timeout_seconds: float) -> bool:
    """Waits at most `timeout_seconds` for a post; False on time-out or on an interrupting
    signal (SIGCHLD when a reader dies), which callers treat alike: re-check and wait again.
    A signal whose Python handler raises (Ctrl-C) still raises here."""
    try:
        semaphore.acquire(timeout_seconds)
        return True
    except (posix_ipc.BusyError, posix_ipc.SignalError):
        return False


def _map(fd: int, total_bytes: int) -> mmap.mmap:
    return mmap.mmap(fd, total_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


class Ring:
    """A mapped ring segment with its semaphores. The trainer creates; readers attach.

    Only the trainer's process creates and unlinks the names (RingNames.unlink_all);
    readers attach and close. close() releases this process's semaphore handles; the
    mapping goes with the last reference to the Ring (batch views keep it)."""

    def __init__(self, names: RingNames, layout: RingLayout, memory: mmap.mmap, semaphores, segment_fd: int,
                 data_fd: int | None = None) -> None:
        self.names = names
        # The creator holds its owner lock on this descriptor; a reader probes the lock.
        self.segment_fd = segment_fd
        # The anonymous memory the ring lives in where /dev/shm could not hold it (backing.py),
        # else None: the segment's file is the memory.
        self.data_fd = data_fd
        self.layout = layout
        self.memory = memory
        self.work_semaphore = semaphores[0]
        self.ready_semaphores = semaphores[1:]
        self.closed = False
        self._pointer = ffi.from_buffer("uint8_t[]", memory)
        self.base_address = int(ffi.cast("uintptr_t", self._pointer))
        self.header = ffi.cast("shm_ring_header *", self.base_address)
        self.control_table_address = self.base_address + layout.table_offset
        self._lines = ffi.cast("shm_control_line *", self.control_table_address)
        self._state_pointers = [ffi.addressof(self._lines[slot], "state") for slot in range(layout.slot_count)]
        self.records = ReaderRecords(memory, layout, self.base_address)
        self.janitor: janitor.Janitor | None = None
        # Slots whose pages in `memory` a held batch kept (detach_slot): each mapped anew.
        self._slot_maps: dict[int, object] = {}

    def slot_memory(self, slot: int) -> tuple[object, int]:
        """(mapping, offset) through which this process reaches slot `slot`'s shared bytes:
        the ring's mapping, or the slot's own since detach_slot. Every array over a slot in
        the trainer is built from here (session.views_of, the local reader, the Ray bridge)."""
        own = self._slot_maps.get(slot)
        return (self.memory, self.layout.slot_offset(slot)) if own is None else (own, 0)

    def map_slot(self, slot: int):
        """A new mapping of slot `slot`'s shared pages (the trainer's side only), for
        detach_slot: a buffer, unmapped once nothing refers to it. OSError where the kernel
        refuses."""
        length = self.layout.slot_stride  # Whole pages: slots start on page boundaries.
        mapped = lib.shm_map_shared(self.segment_fd if self.data_fd is None else self.data_fd,
                                    self.layout.slot_offset(slot), length)
        if mapped < 0:
            raise OSError(-mapped, f"slot {slot} of {self.names.segment} could not be mapped anew: "
                                   f"{os.strerror(-mapped)}")
        # The buffer keeps the pointer, each array the buffer; the pointer's finalizer unmaps.
        return ffi.buffer(ffi.gc(ffi.cast("uint8_t *", mapped), lambda pointer: lib.shm_unmap(pointer, length)),
                          length)

    def detach_slot(self, slot: int, fresh) -> None:
        """Lets a seek, or next() (kept.py), go past slot `slot` while a batch still holds it: the batch's pages
        become memory of its own, at the same address and with the same bytes
        (shm_private_copy), so its arrays, and any tensor or pointer made of them, keep their
        values; the slot's shared pages, which the readers fill next, are reached through
        `fresh` (map_slot) from now on (slot_memory). Costs a slot of memory while the batch
        lives, or, for the first batch of a slot so kept (whose copy lies within the ring's
        mapping), until the ring is unmapped: a ring's worth at most. A thread writing into
        the batch during the copy may lose what it writes. OSError, with nothing changed,
        where the kernel refuses."""
        memory, offset = self.slot_memory(slot)
        address = int(ffi.cast("uintptr_t", ffi.from_buffer("uint8_t[]", memory))) + offset
        result = lib.shm_private_copy(ffi.cast("uint8_t *", address), self.layout.slot_stride)
        if result < 0:
            raise OSError(-result, f"slot {slot} of {self.names.segment}: a held batch's pages could not be given "
                                   f"memory of their own: {os.strerror(-result)}")
        self._slot_maps[slot] = fresh

    @classmethod
    def create(cls, layout: RingLayout, trainer_pid: int, watched: bool = True) -> Ring:
        """Creates the segment (space reserved up front: ENOSPC here, never SIGBUS later), in
        /dev/shm where it has room, else in anonymous memory that a stub there names
        (backing.py). A ring no fork server watches (`watched` False: readers=0) gets a
        janitor that removes its names if this process dies (janitor.py)."""
        where = backing.place(layout.total_bytes, SHM_DIRECTORY)
        names = RingNames.new(layout.slot_count)
        semaphores, memory, segment_fd, data_fd = [], None, None, None
        try:
            segment = posix_ipc.SharedMemory(names.segment, posix_ipc.O_CREX, mode=0o600, size=0)
            segment_fd = os.dup(segment.fd)  # O_CLOEXEC is not inherited by dup: set it back.
            segment.close_fd()
            os.set_inheritable(segment_fd, False)
            fcntl.flock(segment_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # The owner lock, for the ring's lifetime.
            try:
                if where == "anonymous":
                    data_fd = backing.create_anonymous(names.segment, segment_fd, layout.total_bytes)
                else:
                    # tmpfs allocates pages lazily; posix_fallocate reserves them now, so a
                    # full /dev/shm is an error here instead of a SIGBUS on first touch.
                    os.posix_fallocate(segment_fd, 0, layout.total_bytes)
                memory = _map(segment_fd if data_fd is None else data_fd, layout.total_bytes)
            except OSError as error:
                place = SHM_DIRECTORY if where == "dev-shm" else "anonymous shared memory"
                raise SharedMemoryError(
                    f"cannot reserve {layout.total_bytes / 2**20:.1f} MiB in {place} for the ring "
                    f"({error.strerror}); use fewer slots or a smaller batch_size, or free memory or space there "
                    f"(a container: --shm-size in Docker, an emptyDir with medium: Memory in Kubernetes)"
                ) from None
            header = ffi.cast("shm_ring_header *", ffi.from_buffer("uint8_t[]", memory))
            header.magic, header.version = RING_MAGIC, RING_VERSION
            header.slot_count, header.reader_count = layout.slot_count, layout.reader_count
            header.field_count, header.trainer_pid = layout.field_count, trainer_pid
            header.batch_size, header.slot_stride = layout.batch_size, layout.slot_stride
            header.slots_offset, header.stop = layout.slots_offset, 0
            header.checked_pages = layout.checked_pages
            del header
            try:
                for name in (names.work, *names.ready):
                    semaphores.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0))
            except OSError as error:
                raise SharedMemoryError(
                    f"the ring's {layout.total_bytes / 2**20:.1f} MiB were reserved, but its "
                    f"{1 + layout.slot_count} semaphores (a page each of {SHM_DIRECTORY}) did not fit "
                    f"({error.strerror}); free space there or use fewer slots"
                ) from None
            ring = cls(names, layout, memory, semaphores, segment_fd=segment_fd, data_fd=data_fd)
            if not watched:
                ring.janitor = janitor.start(names)
            return ring
        except BaseException:
            for semaphore in semaphores:
                semaphore.close()
            if memory is not None:
                memory.close()
            names.unlink_all()
            for fd in (segment_fd, data_fd):
                if fd is not None:
                    os.close(fd)
            raise

    @classmethod
    def attach(cls, names: RingNames, layout: RingLayout, trainer_pid: int) -> Ring:
        """Maps an existing ring and checks its header against the layout and the trainer
        (its creator) expected."""
        segment = posix_ipc.SharedMemory(names.segment)
        segment_fd = os.dup(segment.fd)
        segment.close_fd()
        os.set_inheritable(segment_fd, False)
        data_fd = None
        try:
            stub = backing.read_stub(segment_fd)
            if stub is not None:
                data_fd = backing.open_anonymous(names.segment, trainer_pid, stub[0], writable=True)
            size = os.fstat(segment_fd if data_fd is None else data_fd).st_size
            if size != layout.total_bytes:
                raise SharedMemoryError(f"ring {names.segment} is {size} bytes, expected {layout.total_bytes}")
            memory = _map(segment_fd if data_fd is None else data_fd, layout.total_bytes)
        except BaseException:
            for fd in (segment_fd, data_fd):
                if fd is not None:
                    os.close(fd)
            raise
        header = ffi.cast("shm_ring_header *", ffi.from_buffer("uint8_t[]", memory))
        found = (header.magic, header.version, header.slot_count, header.reader_count, header.field_count,
                 header.batch_size, header.slot_stride, header.slots_offset, header.trainer_pid, header.checked_pages)
        del header
        expected = (RING_MAGIC, RING_VERSION, layout.slot_count, layout.reader_count, layout.field_count,
                    layout.batch_size, layout.slot_stride, layout.slots_offset, trainer_pid, layout.checked_pages)
        if found != expected:
            memory.close()
            for fd in (segment_fd, data_fd):
                if fd is not None:
                    os.close(fd)
            raise SharedMemoryError(
                f"ring {names.segment} has header (magic, version, slots, readers, fields, batch size, slot "
                f"stride, slots offset, trainer pid, checked pages) = {found}, expected {expected}"
            )
        semaphores = [posix_ipc.Semaphore(name) for name in (names.work, *names.ready)]
        return cls(names, layout, memory, semaphores, segment_fd=segment_fd, data_fd=data_fd)

    def forget_descriptors_in_child(self) -> None:
        """In a process forked from this ring's owner: points every descriptor of the ring's
        segment (the owner-lock one and the mapping's own) at /dev/null, so that the child
        neither holds the owner lock (a dead trainer's ring would look alive) nor keeps the
        unlinked segment's file (or the anonymous memory) open. dup2 rather than close: the objects that own those
        numbers close them later, which must not close another file that took the number.
        The mapping itself stays until the child exits or execs (a batch view there may
        still point into it)."""
        segment = SHM_DIRECTORY + self.names.segment
        anonymous = f"/memfd:{self.names.segment.lstrip('/')} (deleted)"
        try:
            entries = os.listdir("/proc/self/fd")
            devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            for entry in entries:
                try:
                    link = os.readlink(f"/proc/self/fd/{entry}")
                except OSError:
                    continue
                if link in (segment, segment + " (deleted)", anonymous):
                    os.dup2(devnull, int(entry), inheritable=False)
        finally:
            os.close(devnull)

    def describe_work(self, row_bytes_bits: int, runs: int, auto_most: int) -> None:
        """Writes what the readers run into the header (ring.h: row_bytes_bits, runs,
        auto_most; readers/bottleneck.header_words), once, by the trainer: what `shmloader
        top` needs to judge a stall as stats() does."""
        header = self.header
        header.row_bytes_bits, header.runs, header.auto_most = row_bytes_bits, runs, auto_most

    def owner_alive(self) -> bool:
        """Whether the ring's creator still holds its owner lock (a reader's question)."""
        return not lock_free(self.segment_fd, shared=True)

    # Slot state: the changes and their orderings are transitions.py's table.

    def state(self, slot: int) -> tuple[SlotState, int]:
        """(state, owner reader index), by an acquire load; raises SharedMemoryError on a
        value no process writes (foreign input: another process wrote it)."""
        word = lib.shm_state_load(self._state_pointers[slot])
        try:
            return SlotState(word & STATE_MASK), word >> OWNER_SHIFT
        except ValueError:
            raise SharedMemoryError(f"slot {slot} of ring {self.names.segment} has invalid state word {word:#x}") from None

    def publish(self, slot: int, state: SlotState, owner: int) -> None:
        """A reader publishes READY or FAILED (sequentially consistent: what it wrote before
        is visible to whoever acquires the word), and posts the slot's ready semaphore if
        the trainer waits on it."""
        layout = self.layout
        assert 0 <= slot < layout.slot_count, (slot, layout.slot_count)
        assert 0 <= owner < layout.reader_count, (owner, layout.reader_count)
        assert state in (SlotState.READY, SlotState.FAILED), state
        # Only the reader that claimed the slot publishes it, once: FILLING by `owner` now.
        word = lib.shm_state_load(self._state_pointers[slot])
        assert word & STATE_MASK == SlotState.FILLING, (slot, word, state)
        assert word >> OWNER_SHIFT == owner, (slot, word, owner)
        # transition: FILLING -> READY, FILLING -> FAILED
        if lib.shm_publish(self._lines + slot, int(state) | owner << OWNER_SHIFT):
            self.ready_semaphores[slot].release()

    def withdraw(self, slot: int) -> bool:
        """REQUESTED -> IDLE unless a reader claimed it first (the trainer's seek)."""
        assert 0 <= slot < self.layout.slot_count, (slot, self.layout.slot_count)
        requested = int(SlotState.REQUESTED)
        # transition: REQUESTED -> IDLE
        return lib.shm_state_compare_swap(self._state_pointers[slot], requested, int(SlotState.IDLE)) == requested

    def give_back(self, slot: int, owner: int) -> bool:
        """FILLING by `owner` -> REQUESTED, the step word unchanged, and the readers woken:
        the claimer hands a step it cannot fill back to the others (the Ray bridge, for a
        lost actor). False if the slot was not FILLING by `owner`."""
        assert 0 <= slot < self.layout.slot_count, (slot, self.layout.slot_count)
        assert 0 <= owner < self.layout.reader_count, (owner, self.layout.reader_count)
        filling = int(SlotState.FILLING) | owner << OWNER_SHIFT
        requested = int(SlotState.REQUESTED)
        # transition: FILLING -> REQUESTED
        if lib.shm_state_compare_swap(self._state_pointers[slot], filling, requested) != filling:
            return False
        self.work_semaphore.release()
        return True

    def waited_ns(self) -> int:
        """How long next() has waited for steps, summed over the slots' lines (ring.h's
        waited_ns, which the trainer adds at each take)."""
        return sum(int(self._lines[slot].waited_ns) for slot in range(self.layout.slot_count))

    def requested_ns(self, slot: int) -> int:
        """When the trainer requested the slot (CLOCK_MONOTONIC); read after claiming it."""
        return self._lines[slot].requested_ns

    def step(self, slot: int) -> int:
        """The slot's step; read it after the state word that published it."""
        return self._lines[slot].step

    def renew_failed(self, slot: int, owner: int) -> bool:
        """FAILED or FILLING by `owner`, a reader that has exited, -> IDLE: a new pass drops
        what the pass before left of it (ReaderPool.renew_failed). False if the slot was
        neither."""
        assert 0 <= slot < self.layout.slot_count, (slot, self.layout.slot_count)
        idle = int(SlotState.IDLE)
        for state in (SlotState.FAILED, SlotState.FILLING):
            word = int(state) | owner << OWNER_SHIFT
            # transition: FAILED -> IDLE, FILLING -> IDLE
            if lib.shm_state_compare_swap(self._state_pointers[slot], word, idle) == word:
                return True
        return False

    def slots_filled_by(self, reader: int) -> list[int]:
        """The slots in FILLING by `reader` (a dead or failing reader's: restarted or failed)."""
        return [slot for slot in range(self.layout.slot_count) if self.state(slot) == (SlotState.FILLING, reader)]

    def claim(self, reader: int) -> int | None:
        """A reader takes the requested slot with the lowest step (natively: one scan of
        the control table and a compare-and-swap). None if none is requested."""
        assert 0 <= reader < self.layout.reader_count, (reader, self.layout.reader_count)
        slot = lib.shm_claim_lowest(self._lines, self.layout.slot_count, reader)  # REQUESTED -> FILLING|reader
        assert slot < self.layout.slot_count, (slot, self.layout.slot_count)
        return None if slot < 0 else slot

    def claim_own(self, reader: int, readers: int) -> int | None:
        """A reader takes the requested slot with the lowest step among its own: the steps
        k with k % readers == reader (a ring whose steps belong to readers: an
        IterableDataset's, each reader's batches from its own iterator; DatasetSpec.by_reader).
        A scan in Python, for that path alone; the shared claim stays native. None if none
        of its steps is requested (or a seek took it back meanwhile). A second scan after the
        claim sees every step requested before it (in step order): where requests landed
        during the first (slot 0 looked at before step 0 came: step 4 first; a slot requested
        again with another reader's step), the slot goes back and the claim is made again (a
        pass's first step out of order restarts the reader's iterator: IterableBatches.batch_of)."""
        assert 0 <= reader < readers <= self.layout.reader_count, (reader, readers, self.layout.reader_count)
        requested, filling = int(SlotState.REQUESTED), int(SlotState.FILLING) | reader << OWNER_SHIFT
        for _ in range(self.layout.slot_count + 1):  # A retry needs requests made meanwhile: bounded.
            best = self._lowest_own(reader, readers)
            # transition: REQUESTED -> FILLING
            if best is None or lib.shm_state_compare_swap(self._state_pointers[best[0]], requested,
                                                          filling) != requested:
                return None
            slot, step, lower = best[0], int(self._lines[best[0]].step), self._lowest_own(reader, readers)
            if step % readers == reader and (lower is None or lower[1] > step):
                return slot
            # transition: FILLING -> REQUESTED (its own claim: nobody moves a live reader's FILLING)
            swapped = lib.shm_state_compare_swap(self._state_pointers[slot], filling, requested)
            assert swapped == filling, (slot, swapped, filling)
            self.work_semaphore.release()  # The step's reader, where it is another's, wakes.
        return None

    def _lowest_own(self, reader: int, readers: int) -> tuple[int, int] | None:
        """(slot, step) of the requested slot with the lowest of `reader`'s steps, or None."""
        best = None
        for slot in range(self.layout.slot_count):
            if lib.shm_state_load(self._state_pointers[slot]) & STATE_MASK != int(SlotState.REQUESTED):
                continue
            step = int(self._lines[slot].step)  # Ordered by the acquire load above (claim's note).
            if step % readers == reader and (best is None or step < best[1]):
                best = (slot, step)
        return best

    @property
    def stopping(self) -> bool:
        return self.header.stop != 0  # A plain read: readers poll it.

    def set_stopping(self) -> None:
        # transition: none (the header's stop flag, not a slot's state)
        lib.shm_state_store(ffi.addressof(self.header[0], "stop"), 1)

    # Reader records: written only by their reader (and cleared by the trainer before
    # that reader starts), read by the trainer.

    def close(self) -> None:
        """Closes this process's semaphore handles. Idempotent.

        The mapping is not unmapped here: zero-copy batch views may still point into it.
        It goes when the last reference to this Ring (held by every live batch) goes.
        """
        if self.closed:
            return
        self.closed = True
        for semaphore in (self.work_semaphore, *self.ready_semaphores):
            try:
                semaphore.close()
            except (posix_ipc.ExistentialError, OSError):
                pass
        os.close(self.segment_fd)  # The creator's owner lock goes with it.
        if self.data_fd is not None:
            os.close(self.data_fd)  # The memory stays while a batch view maps it.
        if self.janitor is not None:
            self.janitor.stop()
        # Drop this object's references to the mapping: it is unmapped (and tmpfs frees
        # the pages of the unlinked segment) once no batch array refers to it either.
        self.header = self._lines = self._state_pointers = self._pointer = None
        self.memory = self.records = None
        self._slot_maps = {}  # Each unmapped once no batch array refers to it either.


