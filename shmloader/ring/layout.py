"""The ring's layout and names: its constants (from ring.h), the slot states, where each
part of the segment sits (RingLayout; the table in segment.py), and the POSIX names of its
segment and semaphores (RingNames)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import secrets

import posix_ipc

from .._native import ffi, lib
from .slot_layout import align

RING_MAGIC = lib.SHM_RING_MAGIC
RING_VERSION = lib.SHM_RING_VERSION
HEADER_BYTES = ffi.sizeof("shm_ring_header")
SLOT_CONTROL_BYTES = ffi.sizeof("shm_control_line")
STATE_MASK = lib.SHM_STATE_MASK
# shm_ring_header.runs: what the readers run (readers/bottleneck.Context, for top).
RUNS_COMPRESSED, RUNS_TRANSFORM, RUNS_DATASET = lib.SHM_RUNS_COMPRESSED, lib.SHM_RUNS_TRANSFORM, lib.SHM_RUNS_DATASET
OWNER_SHIFT = lib.SHM_OWNER_SHIFT
# A reader's record: the fixed struct, then room for its error report.
READER_RECORD_BYTES = 16384
READER_SKIP_OFFSET = ffi.sizeof("shm_reader_record")
READER_SKIP_BYTES_MAX = lib.SHM_READER_SKIP_BYTES
READER_ERROR_OFFSET = READER_SKIP_OFFSET + READER_SKIP_BYTES_MAX
READER_ERROR_BYTES_MAX = READER_RECORD_BYTES - READER_ERROR_OFFSET
PAGE_BYTES = 4096
# How long one wait of the trainer lasts before it checks that its readers live (a dead
# reader is noticed within about this long); the native next() waits in units of it.
POLL_INTERVAL_SECONDS = 0.05
# How much later than it could, at most, a trainer that outruns its readers takes its step
# so that it sleeps and wakes less often (ring/_cursor.c, wait_ahead): only while the readers
# deliver a batch in under a quarter of this.
WAIT_AHEAD_SPAN_SECONDS = 0.002

NAME_PREFIX = "shml_"
SHM_DIRECTORY = "/dev/shm"


class SlotState(enum.IntEnum):
    """The low byte of a slot's state word (values from ring.h)."""

    IDLE = lib.SHM_SLOT_IDLE
    REQUESTED = lib.SHM_SLOT_REQUESTED
    FILLING = lib.SHM_SLOT_FILLING
    READY = lib.SHM_SLOT_READY
    HELD = lib.SHM_SLOT_HELD
    FAILED = lib.SHM_SLOT_FAILED


@dataclasses.dataclass(frozen=True)
class RingLayout:
    """Byte offsets of everything in the segment, computed from the sizes alone (a slot's
    own layout is slot_layout.SlotLayout's: here only its size and array count)."""

    slot_count: int
    reader_count: int  # reader records; at least one (with readers=0 the trainer fills as reader 0)
    batch_size: int
    slot_bytes: int  # SlotLayout.nbytes
    field_count: int  # regions of a slot, indices excluded (checked by readers against the header)
    # Pages of the record of the blocks the readers have checked (storage/checked_blocks.py),
    # after the slots; 0: none (verify=False, or no file whose checks can be shared).
    checked_pages: int = 0

    @functools.cached_property
    def slot_stride(self) -> int:
        return align(self.slot_bytes, PAGE_BYTES)

    @functools.cached_property
    def table_offset(self) -> int:
        return HEADER_BYTES + self.reader_count * READER_RECORD_BYTES

    @functools.cached_property
    def slots_offset(self) -> int:
        return align(self.table_offset + self.slot_count * SLOT_CONTROL_BYTES, PAGE_BYTES)

    @functools.cached_property
    def checked_offset(self) -> int:
        return self.slots_offset + self.slot_count * self.slot_stride

    @functools.cached_property
    def total_bytes(self) -> int:
        return self.checked_offset + self.checked_pages * PAGE_BYTES

    def slot_offset(self, slot: int) -> int:
        return self.slots_offset + slot * self.slot_stride

    def reader_offset(self, reader: int) -> int:
        return HEADER_BYTES + reader * READER_RECORD_BYTES

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RingLayout:
        return cls(**data)


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
