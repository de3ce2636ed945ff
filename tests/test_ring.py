"""The ring's layout (ring/layout.py) and protocol (ring/segment.py, ring/transitions.py) agree with ring/ring.h, the one definition that ring/_cursor.c and
the Zig library also compile against: a drift in a value or an offset fails here."""

from __future__ import annotations

import os
import re
import struct

import numpy as np
import pytest

from shmloader import _native
from shmloader.ring.layout import (
    HEADER_BYTES,
    OWNER_SHIFT,
    READER_ERROR_OFFSET,
    SLOT_CONTROL_BYTES,
    STATE_MASK,
    RingLayout,
    SlotState,
)
from shmloader.ring.segment import Ring
from shmloader.ring.slot_layout import Region, SlotLayout

ffi, lib = _native.ffi, _native.lib


def header_defines() -> dict[str, int]:
    """The integer #defines of ring.h, read as text (independently of cffi)."""
    text = _native.RING_HEADER.read_text()
    return {name: int(value, 0) for name, value in re.findall(r"^#define\s+(SHM_\w+)\s+(0x[0-9A-Fa-f]+|\d+)\s*$", text, re.M)}


def test_every_define_of_the_header_reaches_python_unchanged():
    defines = header_defines()
    assert {"SHM_RING_MAGIC", "SHM_STATE_MASK", "SHM_OWNER_SHIFT", "SHM_SLOT_READY"} <= defines.keys()
    for name, value in defines.items():
        assert getattr(lib, name) == value, name


def test_slot_states_are_the_headers():
    defines = header_defines()
    assert {state.name: state.value for state in SlotState} == {
        name.removeprefix("SHM_SLOT_"): value for name, value in defines.items() if name.startswith("SHM_SLOT_")
    }
    assert STATE_MASK == defines["SHM_STATE_MASK"] and OWNER_SHIFT == defines["SHM_OWNER_SHIFT"]
    assert max(SlotState) <= STATE_MASK


def test_struct_layout_is_the_documented_one():
    assert HEADER_BYTES == 128 and SLOT_CONTROL_BYTES == 64 and READER_ERROR_OFFSET == 88 + 2048
    assert ffi.offsetof("shm_ring_header", "stop") == 56
    assert ffi.offsetof("shm_ring_header", "batch_size") == 32
    assert ffi.offsetof("shm_control_line", "step") == 8
    assert ffi.offsetof("shm_reader_record", "error_bytes") == 24
    assert ffi.offsetof("shm_reader_record", "skipped") == 56
    # Version 6: the fills' time by stage, and next()'s waits per slot (stats()["bottleneck"], top).
    assert ffi.offsetof("shm_reader_record", "user_ns") == 64 and ffi.offsetof("shm_reader_record", "fetch_ns") == 80
    assert ffi.offsetof("shm_control_line", "waited_ns") == 32
    # Version 8: what the readers run, for top's verdict (readers/bottleneck.header_words).
    assert ffi.offsetof("shm_ring_header", "row_bytes_bits") == 64
    assert ffi.offsetof("shm_ring_header", "auto_most") == 76


def request(ring, slot, step):
    """What the trainer's cursor does to request a slot (ring/_cursor.h request_slot): the step
    word, then the state."""
    line = ring.layout.table_offset + slot * SLOT_CONTROL_BYTES
    struct.pack_into("<Q", ring.memory, line + 8, step)
    struct.pack_into("<Q", ring.memory, line, SlotState.REQUESTED)


@pytest.fixture
def ring():
    slot = SlotLayout.of(4, (Region("x", (4, 12), "|u1"),), mixture=False)
    layout = RingLayout(slot_count=3, reader_count=2, batch_size=4, slot_bytes=slot.nbytes, field_count=1)
    created = Ring.create(layout, os.getpid())
    yield created
    created.names.unlink_all()
    created.close()


def test_ring_writes_land_at_the_offsets_the_layout_computes(ring):
    layout = ring.layout
    request(ring, 2, 77)
    line = layout.table_offset + 2 * SLOT_CONTROL_BYTES
    state, step = struct.unpack_from("<QQ", ring.memory, line)
    assert (state, step) == (SlotState.REQUESTED, 77)
    request(ring, 1, 5)
    assert ring.claim(reader=1) == 1  # A reader publishes only the slot it claimed (asserted).
    ring.publish(1, SlotState.FAILED, owner=1)
    (word,) = struct.unpack_from("<Q", ring.memory, layout.table_offset + SLOT_CONTROL_BYTES)
    assert word == SlotState.FAILED | 1 << OWNER_SHIFT and ring.state(1) == (SlotState.FAILED, 1)
    magic, version = struct.unpack_from("<QI", ring.memory, 0)
    assert (magic, version) == (lib.SHM_RING_MAGIC, lib.SHM_RING_VERSION)
    ring.set_stopping()
    assert struct.unpack_from("<Q", ring.memory, ffi.offsetof("shm_ring_header", "stop"))[0] == 1


def test_claim_takes_the_lowest_requested_step_and_withdraw_loses_to_it(ring):
    request(ring, 0, 9)
    request(ring, 1, 7)
    assert ring.claim(reader=1) == 1 and ring.state(1) == (SlotState.FILLING, 1)
    assert not ring.withdraw(1)  # Being filled: a seek must wait for it.
    assert ring.withdraw(0) and ring.state(0) == (SlotState.IDLE, 0)
    assert ring.claim(reader=0) is None


def own_ring(slot_count: int):
    """A ring of `slot_count` slots for two readers whose steps are their own (claim_own)."""
    slot = SlotLayout.of(4, (Region("x", (4, 12), "|u1"),), mixture=False)
    return Ring.create(RingLayout(slot_count=slot_count, reader_count=2, batch_size=4, slot_bytes=slot.nbytes,
                                  field_count=1), os.getpid())


class TrainerBetween:
    """segment.py's native library, with the trainer's `act` run once, just before the
    `count`-th call of `name`: an interleaving of the trainer and a reader's claim, made
    deterministic."""

    def __init__(self, name: str, count: int, act) -> None:
        self.name, self.count, self.act, self.calls = name, count, act, 0

    def __getattr__(self, name: str):
        function = getattr(lib, name)
        if name != self.name:
            return function

        def call(*arguments):
            self.calls += 1
            if self.calls == self.count:
                self.act()
            return function(*arguments)
        return call


@pytest.mark.parametrize("reached", [1, 3])
def test_claim_own_takes_the_lowest_step_where_a_new_pass_requests_during_its_scan(monkeypatch, reached):
    """Reader 0 looks at slot 0 while it is idle (the ring taken back for a new pass); the
    trainer then requests steps 0 to 5 as the scan reaches slot `reached`. Taking step 2 or
    4 first made the reader's iterator skip to it, then start again for step 0 (an
    IterableDataset's persistent copy iterated twice in one epoch)."""
    from shmloader.ring import segment

    ring = own_ring(6)
    try:
        def new_pass():
            for step in range(6):
                request(ring, step, step)
        monkeypatch.setattr(segment, "lib", TrainerBetween("shm_state_load", reached + 1, new_pass))
        claimed = []
        while (slot := ring.claim_own(0, 2)) is not None:
            assert ring.state(slot) == (SlotState.FILLING, 0)
            claimed.append(int(ring.step(slot)))
        assert claimed == [0, 2, 4]  # Reader 0's steps, in step order.
        assert [ring.state(slot)[0] for slot in (1, 3, 5)] == [SlotState.REQUESTED] * 3  # Reader 1's, untouched.
    finally:
        ring.names.unlink_all()
        ring.close()


def test_claim_own_gives_back_a_slot_requested_again_for_another_readers_step(monkeypatch):
    """Reader 0's scan finds step 4 in slot 1 (3 slots); before its compare-and-swap the
    trainer takes the ring back and requests steps 0 to 2: the swap still wins, slot 1 now
    holding step 1, reader 1's. Reader 0 gives it back and claims its own step 0."""
    from shmloader.ring import segment

    ring = own_ring(3)
    try:
        request(ring, 1, 4)

        def new_pass():
            assert ring.withdraw(1)
            for step in range(3):
                request(ring, step, step)
        monkeypatch.setattr(segment, "lib", TrainerBetween("shm_state_compare_swap", 1, new_pass))
        slot = ring.claim_own(0, 2)
        monkeypatch.undo()
        assert slot == 0 and ring.step(0) == 0 and ring.state(0) == (SlotState.FILLING, 0)
        assert ring.state(1) == (SlotState.REQUESTED, 0) and ring.step(1) == 1
        assert ring.claim_own(1, 2) == 1
    finally:
        ring.names.unlink_all()
        ring.close()


def test_a_state_word_no_process_writes_is_refused(ring):
    struct.pack_into("<Q", ring.memory, ring.layout.table_offset, 0x77)
    with pytest.raises(Exception, match="invalid state word 0x77"):
        ring.state(0)


def test_the_slot_layout_owns_offsets_and_view_order():
    regions = (Region("tokens", (4, 7), "<i4"), Region("tokens.lengths", (4,), "<u4"))
    slot = SlotLayout.of(4, regions, mixture=True)
    assert slot.names == ("tokens", "tokens.lengths", "source") and slot.mixture
    # In memory the indices come first, every region 64-byte aligned after them.
    assert slot.offsets == (64, 64 + 128, 64 + 128 + 64)
    assert slot.nbytes == 64 + 128 + 64 + 16
    assert SlotLayout.from_dict(slot.to_dict()) == slot
    memory = bytearray(4096)
    views = slot.views(memory, 1024)
    assert [view.shape for view in views] == [(4, 7), (4,), (4,), (4,)]
    assert views[-1].dtype == np.uint64
    views[-1][:] = 9
    assert struct.unpack_from("<Q", memory, 1024)[0] == 9  # The indices sit at the slot's start.
    views[2][:] = 5
    assert struct.unpack_from("<I", memory, 1024 + slot.offsets[2])[0] == 5
    with pytest.raises(ValueError, match="distinct names"):
        SlotLayout.of(4, (Region("indices", (4,), "<u4"),), mixture=False)
    with pytest.raises(ValueError, match="distinct names"):
        SlotLayout.of(4, (Region("source", (4,), "<u4"),), mixture=True)
