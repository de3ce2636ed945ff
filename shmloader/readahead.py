"""Reading ahead for the block-local shuffle: a reader asks the kernel for the blocks of the
window after the one it is filling from, so that the disk streams whole blocks while the
current window is served from the page cache.

The window a step reads from is a pure function of the step (sampler.py), so every reader
knows the next window's blocks without talking to the others; two readers that advise the
same window cost the kernel a look-up of pages it already has. The advice runs on a thread
of the reader (posix_fadvise releases the GIL and may block while the kernel queues the
reads), so a fill never waits for the disk it asks ahead of.

Memory: the kernel reads into the page cache, which it may reclaim: about two windows
(the current and the next) of all fields' stored bytes are wanted at once, so a window
should be well under half of the memory the loader can use for the page cache.
"""

from __future__ import annotations

import collections
import os
import queue
import threading

# Windows this reader remembers having advised: the current and the next, with room for
# the ones its other steps in flight still read.
_ADVISED_REMEMBERED = 8
# Windows waiting for the thread: the reader only ever needs the next one, so a full queue
# means the disk is behind and another request would only add to its backlog.
_PENDING_WINDOWS_MAX = 2


class ReadAhead:
    """Advises the kernel of the windows each step will read next (one per reader)."""

    def __init__(self, sampler, plan_readers) -> None:
        self.sampler = sampler
        self.plan_readers = list(plan_readers)
        self.window_rows = sampler.block_rows * sampler.blocks_per_window
        self._advised: collections.deque = collections.deque(maxlen=_ADVISED_REMEMBERED)
        self._pending: queue.Queue = queue.Queue(maxsize=_PENDING_WINDOWS_MAX)
        self._thread = threading.Thread(target=self._advise_loop, name="shmloader-readahead", daemon=True)
        self._thread.start()
        self.windows_advised = 0

    def note(self, step: int) -> None:
        """Called as a reader starts `step`: advises the step's own window (at the start
        of a run) and the one after it, each once."""
        sampler = self.sampler
        first = (step * sampler.shard_count + sampler.shard_index) * sampler.batch_size
        for position in (first, first + self.window_rows):
            key, blocks = sampler.window_blocks(position)
            if key in self._advised:
                continue
            ranges = self._ranges(blocks)
            try:
                self._pending.put_nowait(ranges)
            except queue.Full:
                return  # Try again at the next step.
            self._advised.append(key)
            self.windows_advised += 1

    def _ranges(self, blocks) -> list[tuple[str, int, int]]:
        """(path, offset, bytes) of every field's share of `blocks`, in file order."""
        block_rows, length = self.sampler.block_rows, self.sampler.length
        ranges = []
        for block in sorted(int(block) for block in blocks):
            first = block * block_rows
            count = min(block_rows, length - first)
            for reader in self.plan_readers:
                ranges.extend(reader.byte_ranges(first, count))
        return sorted(ranges)

    def _advise_loop(self) -> None:
        while True:
            ranges = self._pending.get()
            if ranges is None:
                return
            _advise(ranges)

    def close(self) -> None:
        try:
            self._pending.put_nowait(None)
        except queue.Full:
            pass  # A daemon thread: it ends with the reader.


def _advise(ranges: list[tuple[str, int, int]]) -> None:
    """posix_fadvise(WILLNEED) over each range: the kernel starts reading them into the page
    cache and returns. Errors are ignored: advice that fails costs speed, never data."""
    descriptors: dict[str, int] = {}
    try:
        for path, offset, size in ranges:
            descriptor = descriptors.get(path)
            if descriptor is None:
                try:
                    descriptor = descriptors[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
            try:
                os.posix_fadvise(descriptor, offset, size, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)
