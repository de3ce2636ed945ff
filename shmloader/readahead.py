"""Reading ahead for the block-local shuffle: as a reader enters a window it asks the kernel
for the next window's blocks and lets go of the previous window's, so the disk streams
whole blocks while the current window is served from the page cache, and the cache holds
about two windows.

The window a step reads from is a pure function of the step (sampler.py), so every reader
knows the windows without talking to the others. Each reader, at its first step in window
j: drops its own mappings of window j-1's blocks and advises the kernel that they are not
needed (POSIX_FADV_DONTNEED drops pages no reader maps any more: the last reader to leave
the window frees it), then advises WILLNEED for window j+1 (and for j itself at the start
of a run). Without the drop, the pages read ahead were the first the kernel reclaimed
under memory pressure (new pages, never referenced) while the finished window, mapped and
referenced, stayed: the disk read each block several times. The advice runs on a thread of
the reader (posix_fadvise releases the GIL and may block while the kernel queues reads),
so a fill never waits for the disk it reads ahead of. Advice that fails costs speed only.

Memory: two windows of all fields' stored bytes (the one being served and the next); a
window should stay under half of the memory the loader may use for the page cache.
Windows are let go only when the fields are larger than half that memory (the machine's,
or its memory cgroup's limit): data that fits stays cached for the next epochs.
"""

from __future__ import annotations

import collections
import os
import queue
import threading

# posix_fadvise is called on pieces of at most this size (see _fadvise); the kernel's own
# read-ahead works in pieces of 2 MiB too.
_ADVICE_PIECE_BYTES = 2 << 20
# Windows this reader remembers having entered or advised.
_WINDOWS_REMEMBERED = 8
# Requests waiting for the thread: the reader only ever needs the next window, so a full
# queue means the disk is behind and another request would only add to its backlog.
PENDING_MAX = 8


def memory_limit_bytes() -> int:
    """The memory this process may use for the page cache: the machine's, or its memory
    cgroup's limit (v1 or v2) where that is lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return limit
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates = [f"/sys/fs/cgroup{path}/memory.max"]
        elif "memory" in controllers.split(","):
            candidates = [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"]
        else:
            continue
        for candidate in candidates:
            try:
                with open(candidate) as handle:
                    text = handle.read().strip()
            except OSError:
                continue
            if text.isdigit():
                limit = min(limit, int(text))
    return limit


class ReadAhead:
    """Advises the kernel of the windows each step will read (one per reader)."""

    def __init__(self, sampler, plan_readers, stored_bytes: int, source: int = 0, advisor: Advisor | None = None) -> None:
        """`sampler`: a windowed Sampler, or one source of a mixture (sources.SourceWindows),
        whose rows are `source`'s. `stored_bytes`: the fields' bytes on disk. Windows are let
        go only when they cannot all stay cached (more than half the memory limit): data
        that fits keeps its pages, and later epochs read from memory. `advisor`: the thread
        that makes the calls, shared by a mixture's sources (one of its own if None)."""
        self.sampler, self.source = sampler, source
        self.plan_readers = list(plan_readers)
        self.release_windows = stored_bytes > memory_limit_bytes() // 2
        self.window_rows = sampler.block_rows * sampler.blocks_per_window
        self._entered: collections.deque = collections.deque(maxlen=_WINDOWS_REMEMBERED)
        self._advised: collections.deque = collections.deque(maxlen=_WINDOWS_REMEMBERED)
        self._own_advisor = advisor is None
        self.advisor = Advisor() if advisor is None else advisor
        self.windows_advised = self.windows_released = 0

    def note(self, step: int) -> None:
        """Called as a reader starts `step`: at its first step in a window, releases the
        previous window; then advises this window and the next, each once (a request the
        full queue refused is made again at the next step)."""
        sampler = self.sampler
        key, blocks = sampler.window_blocks(sampler.stream_position(step))
        start = self._window_start(key)
        if key not in self._entered:
            self._entered.append(key)
            if self.release_windows and start > 0 and self._submit("release", sampler.window_blocks(start - 1)[1]):
                self.windows_released += 1
        self._advise(key, blocks)
        following = start + self.window_rows
        if following >= (key[0] + 1) * sampler.epoch_length or sampler.window_blocks(following)[0] == key:
            following = (key[0] + 1) * sampler.epoch_length  # The last window of an epoch may be longer.
        next_key, next_blocks = sampler.window_blocks(following)
        self._advise(next_key, next_blocks)

    def _window_start(self, key: tuple[int, int]) -> int:
        epoch, window = key
        return epoch * self.sampler.epoch_length + window * self.window_rows

    def _advise(self, key, blocks) -> None:
        if key not in self._advised and self._submit("advise", blocks):
            self._advised.append(key)
            self.windows_advised += 1

    def _submit(self, what: str, blocks) -> bool:
        return self.advisor.submit(what, self._ranges(blocks))

    def _ranges(self, blocks) -> list[tuple]:
        """(opened file, offset, bytes) of every field's share of `blocks`, in file order."""
        block_rows, length = self.sampler.block_rows, self.sampler.length
        ranges = []
        for block in sorted(int(block) for block in blocks):
            first = block * block_rows
            count = min(block_rows, length - first)
            for reader in self.plan_readers:
                ranges.extend(reader.byte_ranges(first, count, self.source))
        return ranges

    def close(self) -> None:
        """Stops its advisor if it is its own (a shared one is its owner's to close)."""
        if self._own_advisor:
            self.advisor.close()


class Advisor:
    """The thread that makes the read-ahead's calls (posix_fadvise releases the GIL and may
    block while the kernel queues reads, so a fill never waits for the disk it reads ahead
    of). One per filler: a mixture's sources share it."""

    def __init__(self, pending_max: int = PENDING_MAX) -> None:
        self._pending: queue.Queue = queue.Queue(maxsize=pending_max)
        self._thread = threading.Thread(target=self._loop, name="shmloader-readahead", daemon=True)
        self._thread.start()

    def submit(self, what: str, ranges: list[tuple]) -> bool:
        """Queues "advise" or "release" of `ranges`; False if the queue is full (the disk
        is behind: the caller asks again later)."""
        try:
            self._pending.put_nowait((what, ranges))
            return True
        except queue.Full:
            return False

    def _loop(self) -> None:
        while True:
            request = self._pending.get()
            if request is None:
                return
            what, ranges = request
            if what == "release":
                for field, offset, size in ranges:
                    field.forget(offset, size)
                _fadvise(ranges, os.POSIX_FADV_DONTNEED)
            else:
                _fadvise(ranges, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        """Stops the thread after what it has queued (the fields stay open until it is done)."""
        while True:
            try:
                self._pending.put(None, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    return
        self._thread.join(timeout=5.0)


def _fadvise(ranges: list[tuple], advice: int) -> None:
    """posix_fadvise over each range, one descriptor per file for the call."""
    descriptors: dict[str, int] = {}
    try:
        for field, offset, size in ranges:
            path = field.spec.path
            descriptor = descriptors.get(path)
            if descriptor is None:
                try:
                    descriptor = descriptors[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
            # One call per piece: the kernel reads at most its read-ahead size (read_ahead_kb,
            # or the device's largest request) per WILLNEED call and drops the rest.
            for piece in range(offset, offset + size, _ADVICE_PIECE_BYTES):
                try:
                    os.posix_fadvise(descriptor, piece, min(_ADVICE_PIECE_BYTES, offset + size - piece), advice)
                except OSError:
                    break
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)
