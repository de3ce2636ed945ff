"""The readers' records in the ring (ring.h's shm_reader_record, and beside it each record's
skip and error reports): what a reader writes of its work, and the trainer and
`shmloader top` read."""

from __future__ import annotations

import mmap

from .._native import ffi
from .layout import READER_ERROR_BYTES_MAX, READER_ERROR_OFFSET, READER_SKIP_BYTES_MAX, READER_SKIP_OFFSET, RingLayout


class ReaderRecords:
    """Reader `reader`'s counters and reports, by index (the remote readers' records follow
    the local readers')."""

    def __init__(self, memory: mmap.mmap, layout: RingLayout, base_address: int) -> None:
        self.memory, self.layout = memory, layout
        self._records = [ffi.cast("shm_reader_record *", base_address + layout.reader_offset(reader))
                         for reader in range(layout.reader_count)]

    def write_stats(self, reader: int, pid: int, busy_ns: int, batches: int, user_ns: int | None = None,
                    read_ns: int = 0, fetch_ns: int = 0) -> None:
        """A reader's counters; with `user_ns`, its time by stage too (else those stay)."""
        record = self._records[reader]
        record.pid, record.busy_ns, record.batches = pid, busy_ns, batches
        if user_ns is not None:
            record.user_ns, record.read_ns, record.fetch_ns = user_ns, read_ns, fetch_ns

    def stats(self, reader: int) -> tuple[int, int, int]:
        record = self._records[reader]
        return record.pid, record.busy_ns, record.batches

    def stages(self, reader: int) -> tuple[int, int, int]:
        """(user_ns, read_ns, fetch_ns): a reader's fill time by stage (see ring.h)."""
        record = self._records[reader]
        return record.user_ns, record.read_ns, record.fetch_ns

    def write_sleeps(self, reader: int, starved_ns: int, sleeps: int, wakeups: int) -> None:
        record = self._records[reader]
        record.starved_ns, record.sleeps, record.wakeups = starved_ns, sleeps, wakeups

    def sleeps(self, reader: int) -> tuple[int, int, int]:
        """(starved_ns, sleeps, wakeups) of a reader (see ring.h)."""
        record = self._records[reader]
        return record.starved_ns, record.sleeps, record.wakeups

    def write_error(self, reader: int, report: bytes) -> None:
        if len(report) > READER_ERROR_BYTES_MAX:
            raise ValueError(f"an error report holds at most {READER_ERROR_BYTES_MAX} bytes, got {len(report)}")
        offset = self.layout.reader_offset(reader) + READER_ERROR_OFFSET
        self.memory[offset: offset + len(report)] = report
        self._records[reader].error_bytes = len(report)

    def write_skips(self, reader: int, count: int, report: bytes) -> None:
        """How many records the reader skipped, and JSON describing the first of them."""
        report = report[:READER_SKIP_BYTES_MAX]
        offset = self.layout.reader_offset(reader) + READER_SKIP_OFFSET
        self.memory[offset: offset + len(report)] = report
        record = self._records[reader]
        record.skip_bytes, record.skipped = len(report), count

    def skips(self, reader: int) -> tuple[int, bytes]:
        record = self._records[reader]
        length = min(record.skip_bytes, READER_SKIP_BYTES_MAX)  # Foreign input.
        offset = self.layout.reader_offset(reader) + READER_SKIP_OFFSET
        return record.skipped, bytes(self.memory[offset: offset + length])

    def clear_error(self, reader: int) -> None:
        self._records[reader].error_bytes = 0

    def error(self, reader: int) -> bytes:
        length = min(self._records[reader].error_bytes, READER_ERROR_BYTES_MAX)  # Foreign input.
        offset = self.layout.reader_offset(reader) + READER_ERROR_OFFSET
        return bytes(self.memory[offset: offset + length])
