"""A filled step made visible, or its failure: the one path by which every filler (a reader
process, readers=0's local reader in the trainer, the Ray bridge for its actors) hands a
slot it claimed back to the trainer (FILLING|r -> READY|r or FAILED|r, ring/transitions.py).
The fill itself is driven from above (readers/filling.py); nothing here calls a filler.

The order is the protocol's (ring.h): a record's skipped records, statistics and error
report are written before READY or FAILED is published, since the trainer may read them
as soon as it sees the state; the state is the last write.
"""

from __future__ import annotations

import json

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


# A filler that keeps no time by stage (a Ray actor's, a test's stand-in).
NO_STAGES = (0, 0, 0)


class Publisher:
    """One reader record's counters and its side of the protocol."""

    def __init__(self, ring: Ring, record: int, pid: int) -> None:
        self.ring, self.record, self.pid = ring, record, pid
        self.busy_ns = self.batches = 0
        # (user_ns, read_ns, fetch_ns) of ring.h's record: the current filler's sums (its
        # stage_ns, read at each publication) plus those of the fillers before it.
        self._stages, self._stage_base = NO_STAGES, (0, 0, 0)
        self.skipped: list[dict] = []

    def publish(self, slot: int, busy_ns: int, skipped: list[dict] = (), stage_ns=NO_STAGES) -> None:
        """`slot`'s bytes are its step's: counts the fill (`busy_ns`; `stage_ns`, the
        filler's time in the user's code, reading fields and waiting for a store's pages,
        summed over its fills; the records it skipped), writes them to the record, then
        publishes READY."""
        assert busy_ns >= 0, busy_ns
        if skipped:
            self.skipped += skipped
            self.ring.records.write_skips(self.record, len(self.skipped), skips_report(self.skipped))
        self.busy_ns += busy_ns
        self.batches += 1
        if stage_ns is NO_STAGES:  # A fill of local fields alone: its stages stay zero, unwritten.
            self.ring.records.write_stats(self.record, self.pid, self.busy_ns, self.batches)
            self.ring.publish(slot, SlotState.READY, self.record)
            return
        if stage_ns is not self._stages:  # Another filler (a new epoch's): its sums start from zero.
            self._stage_base = tuple(a + b for a, b in zip(self._stage_base, self._stages))
            self._stages = stage_ns
        base = self._stage_base
        self.ring.records.write_stats(self.record, self.pid, self.busy_ns, self.batches, stage_ns[0] + base[0],
                                      stage_ns[1] + base[1], stage_ns[2] + base[2])
        self.ring.publish(slot, SlotState.READY, self.record)

    def fail(self, report: bytes, slots=()) -> None:
        """The filler failed: writes the record's statistics and `report` (an encoded
        readers.reader.ErrorReport), then publishes FAILED for each of `slots`, the ones it
        was filling (none when it failed before it claimed one: the trainer then finds the
        report when it checks the readers). The trainer raises the report at that step."""
        assert report, "a failure is published with its report: the trainer reads it at FAILED"
        records = self.ring.records
        records.write_stats(self.record, self.pid, self.busy_ns, self.batches)
        records.write_error(self.record, report)
        for slot in slots:
            self.ring.publish(slot, SlotState.FAILED, self.record)

