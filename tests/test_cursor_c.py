"""The cursor's C (shmloader/ring/_cursor*.c): its files call one another one way, from the
module down to next() and BatchBase, never back; and its invariants, broken on purpose,
raise AssertionError from next() instead of handing a batch out or crashing."""

from __future__ import annotations

import os
import pathlib
import re
import struct

import pytest

from shmloader.ring.batch import Batch, cursor_module
from shmloader.ring.layout import OWNER_SHIFT, SLOT_CONTROL_BYTES, RingLayout, SlotState
from shmloader.ring.publishing import Publisher
from shmloader.ring.segment import Ring
from shmloader.ring.slot_layout import Region, SlotLayout

RING_DIRECTORY = pathlib.Path(__file__).resolve().parent.parent / "shmloader" / "ring"
# Who may call whom: each file, the files whose functions or types it uses.
LAYERS = {
    "_cursor_module.c": {"_cursor_type.c", "_cursor.c", "_cursor_batch.c", "_cursor_seeds.c"},
    "_cursor_type.c": {"_cursor.c", "_cursor_batch.c"},
    "_cursor.c": set(),
    "_cursor_batch.c": set(),
    "_cursor_seeds.c": set(),
}
# A definition at file scope that other files may use: a function, or a global object.
EXPORT = re.compile(r"^(?!static\b|typedef\b|#)[A-Za-z][\w\s\*]*?\b(\w+)\s*(?:\([^;]*\)\s*\{|=)", re.M)


def exports() -> dict[str, set[str]]:
    """File name -> the names it defines for other files (not static)."""
    return {path.name: set(EXPORT.findall(path.read_text())) for path in sorted(RING_DIRECTORY.glob("_cursor*.c"))}


def uses() -> dict[str, set[str]]:
    """File name -> the other files whose exported names it mentions (comments stripped)."""
    defined = exports()
    found = {}
    for name in defined:
        code = re.sub(r"/\*.*?\*/", "", (RING_DIRECTORY / name).read_text(), flags=re.S)
        words = set(re.findall(r"\b\w+\b", code))
        found[name] = {other for other, names in defined.items() if other != name and names & words}
    return found


def test_each_cursor_file_calls_only_the_files_below_it():
    assert set(exports()) == set(LAYERS), "a new file of the cursor: give it its place in LAYERS and _cursor.h"
    assert exports()["_cursor_module.c"] == {"PyInit__cursor"}  # The one name that leaves the extension.
    assert {"cursor_next", "cursor_clear", "cursor_ndarray_type"} <= exports()["_cursor.c"]
    assert exports()["_cursor_batch.c"] == {"BatchBaseType"} and exports()["_cursor_type.c"] == {"CursorType"}
    assert exports()["_cursor_seeds.c"] == {"seeds_write", "seeds_words", "seeds_ready", "SampleSeederType"}
    assert uses() == LAYERS


def test_the_header_declares_each_export_under_its_file():
    header = (RING_DIRECTORY / "_cursor.h").read_text()
    for name, names in exports().items():
        section = re.search(r"/\* " + re.escape(name) + r"\b[^*]*\*/\n(.*?)(?:\n\n|\n#endif)", header, re.S)
        assert section, name
        if name == "_cursor_module.c":
            continue  # Declared by Python.h's PyMODINIT_FUNC, not here.
        declared = set(re.findall(r"\b(\w+)\s*(?:\(|;)", section.group(1)))
        assert names <= declared, (name, names - declared)


@pytest.fixture
def ring():
    slot = SlotLayout.of(4, (Region("x", (4,), "<u4"),), mixture=False)
    layout = RingLayout(slot_count=3, reader_count=1, batch_size=4, slot_bytes=slot.nbytes, field_count=1)
    created = Ring.create(layout, os.getpid())
    created.slot = slot
    yield created
    created.names.unlink_all()
    created.close()


def unexpected(*arguments):
    raise RuntimeError(f"supervise was called: {arguments}")


def cursor_over(ring, poll_interval_ns: int = 10**7, wait_ahead_span_ns: int = 0):
    """A cursor over `ring` as session.py builds one, with one reader (this test) and no
    periodic supervision."""
    layout = ring.layout
    return cursor_module.Cursor(
        control_table_address=ring.control_table_address, slot_count=layout.slot_count,
        work_semaphore=ring.names.work, ready_semaphores=tuple(ring.names.ready), field_names=("x",),
        batch_type=Batch, views=tuple(ring.slot.views(ring.memory, layout.slot_offset(slot))
                                      for slot in range(layout.slot_count)),
        next_step=0, check_every_batches=2**40, check_every_ns=2**63, wake_after_slots=1, reader_count=1,
        trainer_slots=1,
        poll_interval_ns=poll_interval_ns, wait_ahead_span_ns=wait_ahead_span_ns, end_step=2**64 - 1,
        partial_from=2**64 - 1,
        supervise=unexpected, views_of=unexpected, partial=unexpected)


def fill_requested(ring, publisher):
    """Reader 0's part: claims every requested slot and publishes it."""
    while (slot := ring.claim(0)) is not None:
        publisher.publish(slot, 0)


def test_a_slot_the_cursor_holds_is_never_handed_out_again(ring):
    """A reader that publishes into a slot it never claimed (one whose batch the trainer
    still holds) would have next() hand the same arrays out twice, changing under the
    holder: take() asserts the slot is not held, and next() raises."""
    cursor, publisher = cursor_over(ring), Publisher(ring, 0, os.getpid())
    try:
        for step in range(3):
            cursor.request(step, step)
        fill_requested(ring, publisher)
        kept = next(cursor)
        assert kept.step == 0 and ring.state(0) == (SlotState.HELD, 0)
        for step in (1, 2):
            assert next(cursor).step == step
        # The faulty reader: READY with step 3 in slot 0, which batch 0 still holds.
        line = ring.layout.table_offset
        struct.pack_into("<QQ", ring.memory, line, SlotState.READY | 0 << OWNER_SHIFT, 3)
        with pytest.raises(AssertionError, match=r"_cursor\.c:\d+: !slot->held \(an invariant of the slot protocol\)"):
            next(cursor)
        assert cursor.next_step == 3 and cursor.held() == {0: 0} and not kept.released
    finally:
        cursor.deactivate()


def test_the_cursor_keeps_to_the_table_where_the_ring_is_right(ring):
    """The same cursor, with the reader keeping to the protocol: no assertion fires over
    several rings of steps, and each slot goes HELD -> REQUESTED once its batch is dropped."""
    cursor, publisher = cursor_over(ring), Publisher(ring, 0, os.getpid())
    try:
        for step in range(3):
            cursor.request(step, step)
        for step in range(12):
            fill_requested(ring, publisher)
            batch = next(cursor)
            assert batch.step == step and ring.state(step % 3) == (SlotState.HELD, 0)
            del batch
        assert cursor.release_unused() == 1 and ring.state(11 % 3)[0] == SlotState.REQUESTED
        assert struct.unpack_from("<Q", ring.memory, ring.layout.table_offset + 2 * SLOT_CONTROL_BYTES + 8)[0] == 14
    finally:
        cursor.deactivate()


@pytest.mark.parametrize("span_ns, sleeps_on", [(60 * 10**9, 5), (0, 3)])
def test_a_trainer_that_outruns_fast_readers_sleeps_until_the_third_step_after_is_filled(span_ns, sleeps_on):
    """next() that finds its step in flight sleeps on the next step's slot; once it has
    measured that the readers deliver within the span, on the third step after its own
    while those are in flight: the readers fill the lowest steps first, so those before are
    ready by then, and the trainer pays one sleep and wake-up (a costly round trip on a
    small or virtual machine) per four batches instead of one per two. Publishing the steps
    before it wakes nobody. Slower readers (span 0 here) keep it on the next step's slot."""
    import threading
    import time

    slot = SlotLayout.of(4, (Region("x", (4,), "<u4"),), mixture=False)
    layout = RingLayout(slot_count=8, reader_count=1, batch_size=4, slot_bytes=slot.nbytes, field_count=1)
    ring = Ring.create(layout, os.getpid())
    ring.slot = slot
    cursor = cursor_over(ring, poll_interval_ns=60 * 10**9, wait_ahead_span_ns=span_ns)
    publisher, delivered, trainer = Publisher(ring, 0, os.getpid()), [], None

    def next_in_a_thread() -> threading.Thread:
        thread = threading.Thread(target=lambda: delivered.append(next(cursor).step))
        thread.start()
        deadline = time.monotonic() + 30
        while not any(ring._lines[index].waiter for index in range(8)) and time.monotonic() < deadline:
            time.sleep(0.001)
        return thread

    def armed() -> list[int]:
        return [index for index in range(8) if ring._lines[index].waiter]

    try:
        for step in range(8):
            cursor.request(step, step)
        assert [ring.claim(0) for _ in range(5)] == [0, 1, 2, 3, 4]  # Steps 0-4 FILLING, 5-7 REQUESTED.
        trainer = next_in_a_thread()
        assert armed() == [1]  # No delivery interval measured yet: the next step's slot.
        publisher.publish(0, 0)
        trainer.join(0.2)
        assert trainer.is_alive()
        publisher.publish(1, 0)
        trainer.join(30)
        assert delivered == [0] and next(cursor).step == 1  # Ready: no wait.
        trainer = next_in_a_thread()  # Step 2 in flight, and 3-5 with it.
        assert armed() == [sleeps_on]
        for index in range(2, sleeps_on):
            publisher.publish(index, 0)
        trainer.join(0.2)
        assert trainer.is_alive() and delivered == [0]  # The steps before ready, the trainer still asleep.
        if sleeps_on == 5:
            assert ring.claim(0) == 5
        publisher.publish(sleeps_on, 0)
        trainer.join(30)
        assert delivered == [0, 2] and not armed()
    finally:
        cursor.deactivate()  # A next() still waiting returns (its supervise raises in its thread).
        if trainer is not None:
            trainer.join(30)
        ring.names.unlink_all()
        ring.close()
