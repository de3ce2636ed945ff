"""ring/step_codes.py is the one map from the STEP code next() reports to the trainer's action:
its codes are the extension's (ring/_cursor.h), each goes to its own action, and the
supervisor (readers/supervision.py) provides every action."""

from __future__ import annotations

import os
import pathlib
import re
import struct
from types import SimpleNamespace

import pytest

from shmloader.errors import SharedMemoryError
from shmloader.readers.supervision import Supervisor
from shmloader.ring.layout import SLOT_CONTROL_BYTES, RingLayout, SlotState
from shmloader.ring.segment import Ring
from shmloader.ring.slot_layout import Region, SlotLayout
from shmloader.ring.step_codes import StepActions, StepCode

HEADER = pathlib.Path(__file__).resolve().parent.parent / "shmloader" / "ring" / "_cursor.h"
ACTIONS = ("raise_if_closed", "due", "in_flight", "held", "failed")


def test_the_codes_are_the_headers():
    declared = {name: int(value) for name, value in re.findall(r"\bSTEP_(\w+)\s*=\s*(\d+)", HEADER.read_text())}
    assert {code.name: code.value for code in StepCode} == declared
    assert set(declared) == {"READY", "IN_FLIGHT", "HELD", "FAILED", "WRONG", "CLOSED"}


class Recorder(StepActions):
    """Each action records its call."""

    def __init__(self, ring=None, slots=3) -> None:
        self.ring, self.slots, self.calls = ring, slots, []

    def raise_if_closed(self, cursor) -> None:
        if not cursor.active:
            raise RuntimeError("the loader is closed")

    def due(self, cursor, step):
        self.calls.append(("due", step))

    def in_flight(self, cursor, step):
        self.calls.append(("in_flight", step))

    def held(self, cursor, step):
        self.calls.append(("held", step))

    def failed(self, owner):
        self.calls.append(("failed", owner))


@pytest.mark.parametrize("code, call", [
    (StepCode.READY, ("due", 7)),
    (StepCode.IN_FLIGHT, ("in_flight", 7)),
    (StepCode.HELD, ("held", 7)),
    (StepCode.FAILED, ("failed", 2)),
], ids=["ready-and-due", "in-flight", "held", "failed"])
def test_each_code_goes_to_its_own_action(code, call):
    recorder = Recorder()
    recorder.supervise(SimpleNamespace(active=1), int(code), 2, 7)
    assert recorder.calls == [call]


def test_a_closed_loader_raises_whatever_the_code():
    for code in StepCode:
        with pytest.raises(RuntimeError, match="closed"):
            Recorder().supervise(SimpleNamespace(active=0), int(code), 0, 0)


def test_a_code_the_extension_never_reports_is_an_assertion():
    with pytest.raises(AssertionError):
        Recorder().supervise(SimpleNamespace(active=1), max(StepCode) + 1, 0, 0)
    with pytest.raises(AssertionError):
        Recorder().supervise(SimpleNamespace(active=1), int(StepCode.CLOSED), 0, 0)  # CLOSED with an active cursor.


def test_a_wrong_step_raises_naming_the_slot_what_it_holds_and_the_step_expected():
    slot = SlotLayout.of(4, (Region("x", (4,), "<u4"),), mixture=False)
    layout = RingLayout(slot_count=3, reader_count=1, batch_size=4, slot_bytes=slot.nbytes, field_count=1)
    ring = Ring.create(layout, os.getpid())
    try:
        struct.pack_into("<QQ", ring.memory, layout.table_offset + SLOT_CONTROL_BYTES, SlotState.READY, 9)
        with pytest.raises(SharedMemoryError, match=r"slot 1 of ring .* is READY with step 9 while step 4 was "
                                                     r"expected; another process wrote to the ring"):
            Recorder(ring).supervise(SimpleNamespace(active=1), int(StepCode.WRONG), 0, 4)
    finally:
        ring.names.unlink_all()
        ring.close()


def test_the_supervisor_provides_every_action():
    assert issubclass(Supervisor, StepActions)
    for name in ACTIONS:
        assert getattr(Supervisor, name) is not getattr(StepActions, name), name
    assert Supervisor.supervise is StepActions.supervise  # The map stays ring/step_codes.py's.
