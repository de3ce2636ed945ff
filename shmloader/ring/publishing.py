"""A filled step made visible: the one path by which every filler (a reader process, the
trainer itself with readers=0, the Ray bridge for its actors) hands a slot to the trainer.

The order is the protocol's (ring.h): a record's skipped records and statistics are
written before READY is published, since the trainer may read them as soon as it sees
READY; READY is the last write.
"""

from __future__ import annotations

import json
import time

from .layout import READER_SKIP_BYTES_MAX, SlotState
from .segment import Ring


def skips_report(skipped: list[dict]) -> bytes:
    """JSON of the first skipped records (as dicts) that fit a reader record's skip area."""
    report = b"[]"
    for count in range(1, len(skipped) + 1):
        encoded = json.dumps(skipped[:count], separators=(",", ":")).encode()  # Compact: more records fit.
        if len(encoded) > READER_SKIP_BYTES_MAX:
            break
        report = encoded
    return report


class Publisher:
    """One reader record's counters and its side of the protocol."""

    def __init__(self, ring: Ring, record: int, pid: int) -> None:
        self.ring, self.record, self.pid = ring, record, pid
        self.busy_ns = self.batches = 0
        self.skipped: list[dict] = []

    def publish(self, slot: int, busy_ns: int, skipped: list[dict] = ()) -> None:
        """`slot`'s bytes are its step's: counts the fill (`busy_ns`, the records it
        skipped), writes them to the record, then publishes READY."""
        assert busy_ns >= 0, busy_ns
        if skipped:
            self.skipped += skipped
            self.ring.records.write_skips(self.record, len(self.skipped), skips_report(self.skipped))
        self.busy_ns += busy_ns
        self.batches += 1
        self.ring.records.write_stats(self.record, self.pid, self.busy_ns, self.batches)
        self.ring.publish(slot, SlotState.READY, self.record)


def fill_and_publish(publisher: Publisher, filler, step: int, outputs, slot: int, after_fill=None) -> None:
    """Fills `step` into `slot` (bound as `outputs`) with `filler` and publishes it; an
    exception leaves the slot unpublished (FILLING), for the caller to hand back.
    `after_fill`: called between the fill and the publication (a reader's fork check)."""
    started = time.perf_counter_ns()
    records = getattr(filler, "skipped", ())  # A test's stand-in filler may keep none.
    known = len(records)
    filler.fill(step, outputs)
    if after_fill is not None:
        after_fill()
    skipped = [record.to_dict() for record in records[known:]]
    publisher.publish(slot, time.perf_counter_ns() - started, skipped)
