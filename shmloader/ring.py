"""The shared-memory ring: its byte layout (defined only here), creation, attachment and slot states.

Segment layout (all integers little-endian, offsets in bytes):

    offset  size  field             meaning
    ------  ----  ----------------  ------------------------------------------------------
    0       8     magic             RING_MAGIC, "SHMLRING"
    8       4     version           RING_VERSION; a reader refuses any other
    12      4     slot_count        S, batch slots in the ring
    16      4     reader_count      R, reader records that follow the header
    20      4     field_count       F, data regions per slot
    24      4     trainer_pid       the creating process; readers exit when it is gone
    28      4     (reserved)
    32      8     batch_size        rows per batch
    40      8     slot_stride       bytes from one slot to the next (a multiple of 4096)
    48      8     slots_offset      offset of slot 0 (a multiple of 4096)
    56      8     stop              nonzero once the trainer closes: readers exit
    64      R*READER_RECORD_BYTES   reader records (below)
    table_offset + s*64             slot s's control line (below), table_offset = 64 + R*16384
    slots_offset + s*slot_stride    slot s's data (below)

Reader record r (READER_RECORD_BYTES, written only by reader r, read by the trainer):

    0       8     pid               the reader's pid
    8       8     busy_ns           time spent filling slots
    16      8     batches           slots filled
    24      4     error_bytes       length of the UTF-8 JSON error report that follows
    28      4     (reserved)
    32      ...   error             {"type", "message", "traceback", "step"}

Control line of slot s (SLOT_CONTROL_BYTES, one cache line so slots share none):

    0       8     state             SlotState in the low byte, the filling reader's index << 8
    8       8     step              the step this slot holds or is to hold
    16      48    (reserved)

The control lines sit together, apart from the data, so that the trainer's next() and
the readers' scans read one page of them rather than one page per slot: after a training
step every page touched is a TLB miss, and the data of the slots is megabytes apart.

Data of slot s:

    0       8*B   indices           uint64 row indices of the step
    ...           field regions     one per field, B * row_bytes each, 64-byte aligned

Slot s only ever holds steps k with k % S == s, so batches come out in step order.
State changes: the trainer sets REQUESTED (with the step) when a slot is free; a reader
takes it REQUESTED -> FILLING|reader by compare-and-swap, fills it, and stores READY (or
FAILED); the trainer takes READY -> HELD while the batch is alive, then requests the
slot's next step. Semaphores only wake waiters; the state word is the truth.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import mmap
import os
import re
import secrets
import struct

import posix_ipc

from ._native import ffi, lib
from .errors import SharedMemoryError
from .storage import FieldSpec

RING_MAGIC = 0x474E49524C4D4853  # b"SHMLRING" read as a little-endian u64.
RING_VERSION = 2  # 2: slot state and step moved from each slot's head to the control table.
HEADER_BYTES = 64
_HEADER_FORMAT = "<QIIIIIIQQQQ"
assert struct.calcsize(_HEADER_FORMAT) == HEADER_BYTES
OFFSET_STOP = 56

READER_RECORD_BYTES = 16384
READER_ERROR_OFFSET = 32
READER_ERROR_BYTES_MAX = READER_RECORD_BYTES - READER_ERROR_OFFSET

SLOT_CONTROL_BYTES = 64
CONTROL_OFFSET_STATE = 0
CONTROL_OFFSET_STEP = 8
REGION_ALIGNMENT = 64
PAGE_BYTES = 4096
STATE_MASK = 0xFF
OWNER_SHIFT = 8

NAME_PREFIX = "shml_"
_NAME_PATTERN = re.compile(r"^(?:sem\.)?shml_(\d+)_[0-9a-f]+")
SHM_DIRECTORY = "/dev/shm"
# Room left free in /dev/shm beyond the ring, so that other users of it do not fail.
_SHM_HEADROOM_BYTES = 64 << 20


class SlotState(enum.IntEnum):
    IDLE = 0
    REQUESTED = 1
    FILLING = 2
    READY = 3
    HELD = 4
    FAILED = 5


HELD_WORD = int(SlotState.HELD)  # The whole state word of a held slot (no owner).


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Byte offsets of everything in the segment, computed from the sizes alone."""

    slot_count: int
    reader_count: int
    batch_size: int
    field_row_bytes: tuple[int, ...]

    @functools.cached_property
    def indices_offset(self) -> int:
        return 0

    @functools.cached_property
    def field_offsets(self) -> tuple[int, ...]:
        offsets, cursor = [], _align(self.indices_offset + 8 * self.batch_size, REGION_ALIGNMENT)
        for row_bytes in self.field_row_bytes:
            offsets.append(cursor)
            cursor = _align(cursor + self.batch_size * row_bytes, REGION_ALIGNMENT)
        return tuple(offsets)

    @functools.cached_property
    def slot_stride(self) -> int:
        last = self.field_offsets[-1] + self.batch_size * self.field_row_bytes[-1] if self.field_row_bytes else 0
        return _align(max(last, self.indices_offset + 8 * self.batch_size), PAGE_BYTES)

    @functools.cached_property
    def table_offset(self) -> int:
        return HEADER_BYTES + self.reader_count * READER_RECORD_BYTES

    @functools.cached_property
    def slots_offset(self) -> int:
        return _align(self.table_offset + self.slot_count * SLOT_CONTROL_BYTES, PAGE_BYTES)

    @functools.cached_property
    def total_bytes(self) -> int:
        return self.slots_offset + self.slot_count * self.slot_stride

    def slot_offset(self, slot: int) -> int:
        return self.slots_offset + slot * self.slot_stride

    def control_offset(self, slot: int) -> int:
        return self.table_offset + slot * SLOT_CONTROL_BYTES

    def reader_offset(self, reader: int) -> int:
        return HEADER_BYTES + reader * READER_RECORD_BYTES


@dataclasses.dataclass(frozen=True)
class RingNames:
    """The POSIX names of one ring's segment and semaphores (pid and a random token)."""

    segment: str
    work: str
    ready: tuple[str, ...]

    @classmethod
    def new(cls, slot_count: int) -> RingNames:
        base = f"/{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        return cls(base, f"{base}_w", tuple(f"{base}_r{slot}" for slot in range(slot_count)))

    def to_dict(self) -> dict:
        return {"segment": self.segment, "work": self.work, "ready": list(self.ready)}

    @classmethod
    def from_dict(cls, data: dict) -> RingNames:
        return cls(data["segment"], data["work"], tuple(data["ready"]))

    def unlink_all(self) -> None:
        """Removes every name; missing ones are fine. Never raises."""
        for name in (self.work, *self.ready):
            try:
                posix_ipc.unlink_semaphore(name)
            except (posix_ipc.ExistentialError, OSError):
                pass
        try:
            posix_ipc.unlink_shared_memory(self.segment)
        except (posix_ipc.ExistentialError, OSError):
            pass


def wait(semaphore: posix_ipc.Semaphore, timeout_seconds: float) -> bool:
    """Waits at most `timeout_seconds` for a post; False on time-out or on an interrupting
    signal (SIGCHLD when a reader dies), which callers treat alike: re-check and wait again.
    A signal whose Python handler raises (Ctrl-C) still raises here."""
    try:
        semaphore.acquire(timeout_seconds)
        return True
    except (posix_ipc.BusyError, posix_ipc.SignalError):
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str = SHM_DIRECTORY) -> list[str]:
    """Unlinks segments and semaphores of rings whose creating process is dead. Returns them."""
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        match = _NAME_PATTERN.match(entry)
        if not match or _pid_alive(int(match.group(1))):
            continue
        try:
            if entry.startswith("sem."):
                posix_ipc.unlink_semaphore("/" + entry[4:])
            else:
                posix_ipc.unlink_shared_memory("/" + entry)
            removed.append(entry)
        except (posix_ipc.ExistentialError, OSError):
            pass
    return removed


def check_free_space(total_bytes: int, directory: str = SHM_DIRECTORY) -> None:
    try:
        stats = os.statvfs(directory)
    except OSError:
        return  # No /dev/shm to measure (not Linux); posix_fallocate still guards creation.
    free_bytes = stats.f_bavail * stats.f_frsize
    if free_bytes < total_bytes + _SHM_HEADROOM_BYTES:
        raise SharedMemoryError(
            f"not enough room in {directory} for the ring: it needs {total_bytes / 2**20:.1f} MiB "
            f"(+{_SHM_HEADROOM_BYTES >> 20} MiB headroom), {free_bytes / 2**20:.1f} MiB are free. "
            f"Use fewer slots or a smaller batch_size, free space in {directory}, or enlarge it "
            f"(mount -o remount,size=... {directory}; in Docker, --shm-size)."
        )


class Ring:
    """A mapped ring segment with its semaphores. The trainer creates; readers attach."""

    def __init__(self, names: RingNames, layout: RingLayout, memory: mmap.mmap, semaphores, created: bool) -> None:
        self.names = names
        self.layout = layout
        self.memory = memory
        self.work = semaphores[0]
        self.ready = semaphores[1:]
        self.created = created
        self.closed = False
        self._pointer = ffi.from_buffer("uint8_t[]", memory)
        self.base_address = int(ffi.cast("uintptr_t", self._pointer))
        # Plain reads and writes of u64 words: for values whose ordering an atomic access
        # next to them already provides (a step is written before, and read after, the
        # state word that publishes it), and for the stop flag, which readers poll.
        self._word_view = memoryview(memory).cast("B").cast("Q")
        self._step_indices = [(layout.control_offset(s) + CONTROL_OFFSET_STEP) // 8 for s in range(layout.slot_count)]
        self._state_pointers = [self._u64_pointer(layout.control_offset(s) + CONTROL_OFFSET_STATE) for s in range(layout.slot_count)]
        self._stop_pointer = self._u64_pointer(OFFSET_STOP)
        self._table_pointer = self._u64_pointer(layout.table_offset)

    def _u64_pointer(self, offset: int):
        return ffi.cast("uint64_t *", self.base_address + offset)

    @classmethod
    def create(cls, layout: RingLayout, trainer_pid: int) -> Ring:
        """Creates the segment (space reserved up front: ENOSPC here, never SIGBUS later)."""
        check_free_space(layout.total_bytes)
        names = RingNames.new(layout.slot_count)
        semaphores, memory = [], None
        try:
            segment = posix_ipc.SharedMemory(names.segment, posix_ipc.O_CREX, mode=0o600, size=0)
            try:
                # tmpfs allocates pages lazily; posix_fallocate reserves them now, so a
                # full /dev/shm is an error here instead of a SIGBUS on first touch.
                os.posix_fallocate(segment.fd, 0, layout.total_bytes)
                memory = mmap.mmap(segment.fd, layout.total_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            except OSError as error:
                raise SharedMemoryError(
                    f"cannot reserve {layout.total_bytes / 2**20:.1f} MiB in {SHM_DIRECTORY} for the ring "
                    f"({error.strerror}); use fewer slots or a smaller batch_size, or free space there"
                ) from None
            finally:
                segment.close_fd()
            struct.pack_into(
                _HEADER_FORMAT, memory, 0, RING_MAGIC, RING_VERSION, layout.slot_count, layout.reader_count,
                len(layout.field_row_bytes), trainer_pid, 0, layout.batch_size, layout.slot_stride,
                layout.slots_offset, 0,
            )
            for name in (names.work, *names.ready):
                semaphores.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0))
            return cls(names, layout, memory, semaphores, created=True)
        except BaseException:
            for semaphore in semaphores:
                semaphore.close()
            if memory is not None:
                memory.close()
            names.unlink_all()
            raise

    @classmethod
    def attach(cls, names: RingNames, layout: RingLayout) -> Ring:
        """Maps an existing ring and checks its header against the layout expected."""
        segment = posix_ipc.SharedMemory(names.segment)
        try:
            if segment.size != layout.total_bytes:
                raise SharedMemoryError(f"ring {names.segment} is {segment.size} bytes, expected {layout.total_bytes}")
            memory = mmap.mmap(segment.fd, layout.total_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            segment.close_fd()
        header = struct.unpack_from(_HEADER_FORMAT, memory, 0)
        expected = (RING_MAGIC, RING_VERSION, layout.slot_count, layout.reader_count, len(layout.field_row_bytes))
        if header[:5] != expected or header[7:10] != (layout.batch_size, layout.slot_stride, layout.slots_offset):
            memory.close()
            raise SharedMemoryError(f"ring {names.segment} has header {header[:10]}, expected {expected} and {layout}")
        semaphores = [posix_ipc.Semaphore(name) for name in (names.work, *names.ready)]
        return cls(names, layout, memory, semaphores, created=False)

    # Slot state, through atomics because several processes change it at once.

    def state(self, slot: int) -> tuple[SlotState, int]:
        """(state, owner reader index); raises SharedMemoryError on a value no process writes."""
        word = lib.shm_atomic_load(self._state_pointers[slot])
        try:
            return SlotState(word & STATE_MASK), word >> OWNER_SHIFT
        except ValueError:
            raise SharedMemoryError(f"slot {slot} of ring {self.names.segment} has invalid state word {word:#x}") from None

    def set_state(self, slot: int, state: SlotState, owner: int = 0) -> None:
        lib.shm_atomic_store(self._state_pointers[slot], int(state) | owner << OWNER_SHIFT)

    def compare_swap_state(self, slot: int, expected: SlotState, desired: SlotState, owner: int = 0) -> bool:
        expected_word = int(expected)
        found = lib.shm_atomic_compare_swap(self._state_pointers[slot], expected_word, int(desired) | owner << OWNER_SHIFT)
        return found == expected_word

    def step(self, slot: int) -> int:
        """The slot's step; read it after the state word that published it."""
        return self._word_view[self._step_indices[slot]]

    def set_step(self, slot: int, step: int) -> None:
        """Sets the slot's step; publish it with a state store afterwards."""
        self._word_view[self._step_indices[slot]] = step

    def claim(self, reader: int) -> int | None:
        """A reader takes the requested slot with the lowest step (REQUESTED -> FILLING|reader by
        compare-and-swap, natively: one scan of the control table). None if none is requested."""
        slot = lib.shm_claim_lowest(
            self._table_pointer, self.layout.slot_count, SLOT_CONTROL_BYTES // 8,
            int(SlotState.REQUESTED), int(SlotState.FILLING) | reader << OWNER_SHIFT,
        )
        return None if slot < 0 else slot

    def request(self, slot: int, step: int) -> None:
        """Asks the readers to fill `slot` with `step` (the trainer's side)."""
        self.set_step(slot, step)
        self.set_state(slot, SlotState.REQUESTED)
        self.work.release()

    @property
    def stopping(self) -> bool:
        return self._word_view[OFFSET_STOP // 8] != 0  # A plain read: readers poll it.

    def set_stopping(self) -> None:
        lib.shm_atomic_store(self._stop_pointer, 1)

    # Reader records.

    def write_reader_stats(self, reader: int, pid: int, busy_ns: int, batches: int) -> None:
        struct.pack_into("<QQQ", self.memory, self.layout.reader_offset(reader), pid, busy_ns, batches)

    def reader_stats(self, reader: int) -> tuple[int, int, int]:
        return struct.unpack_from("<QQQ", self.memory, self.layout.reader_offset(reader))

    def write_reader_error(self, reader: int, report: bytes) -> None:
        report = report[:READER_ERROR_BYTES_MAX]
        offset = self.layout.reader_offset(reader)
        self.memory[offset + READER_ERROR_OFFSET: offset + READER_ERROR_OFFSET + len(report)] = report
        struct.pack_into("<I", self.memory, offset + 24, len(report))

    def clear_reader_error(self, reader: int) -> None:
        struct.pack_into("<I", self.memory, self.layout.reader_offset(reader) + 24, 0)

    def reader_error(self, reader: int) -> bytes:
        offset = self.layout.reader_offset(reader)
        (length,) = struct.unpack_from("<I", self.memory, offset + 24)
        length = min(length, READER_ERROR_BYTES_MAX)  # Foreign input: never read past the record.
        return bytes(self.memory[offset + READER_ERROR_OFFSET: offset + READER_ERROR_OFFSET + length])

    # Regions.

    def slot_word_addresses(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Addresses of every slot's state word and step word, for the trainer's native next()."""
        lines = [self.base_address + self.layout.control_offset(slot) for slot in range(self.layout.slot_count)]
        return tuple(a + CONTROL_OFFSET_STATE for a in lines), tuple(a + CONTROL_OFFSET_STEP for a in lines)

    def close(self) -> None:
        """Closes this process's semaphore handles. Idempotent.

        The mapping is not unmapped here: zero-copy batch views may still point into it.
        It goes when the last reference to this Ring (held by every live batch) goes.
        """
        if self.closed:
            return
        self.closed = True
        for semaphore in (self.work, *self.ready):
            try:
                semaphore.close()
            except (posix_ipc.ExistentialError, OSError):
                pass


def layout_for(slot_count: int, reader_count: int, batch_size: int, fields: list[FieldSpec]) -> RingLayout:
    return RingLayout(slot_count, reader_count, batch_size, tuple(spec.row_bytes for spec in fields))
