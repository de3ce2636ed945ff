"""Reading ahead for the block-local shuffle and for passes in order (sequential mode, seen
as blocks of steps by InOrder): as a reader moves through an epoch it asks the kernel for
the blocks that open next and lets go of those whose rows are all dealt, so the disk
streams whole blocks while the rows being served come from the page cache.

Where a step reads is a pure function of the step (plan/sampler.py, SlidingShuffle in
zig/permutation.zig): at each step a reader learns its position's places, `closed` <= the
places being dealt from < `opened`, and keeps the kernel asked for the places up to
`closed + blocks_per_window + LOOKAHEAD_BLOCKS` (crossing into the next epoch where this
one ends, so the next epoch's first blocks stream in while this one's last drain). Blocks
whose rows are all dealt are let go of in two stages: LAG_STEPS steps after they closed
a reader drops its own mappings of them (MADV_DONTNEED), and LAG_STEPS steps later, when
every reader has done the same, one reader advises the kernel that they are not needed
(POSIX_FADV_DONTNEED): the reader of index place % readers (the page cache is the
machine's, so one call per block is enough). A page still mapped by another reader cannot
be dropped, and the kernel answers such a failure by draining every CPU's page lists and
waiting for them (in one stage, perf showed the readers' threads waiting there); every
reader dropping every block stalled both readers on each other that way, and cold in a
2 GiB group the window served a third fewer rows than with one call per block (RESULTS).
Pages a failed call leaves are reclaimed by the kernel like any cached page.
Without letting go, the pages read ahead were the first the kernel reclaimed under memory
pressure (new pages, never referenced) while finished blocks, mapped and referenced,
stayed: the disk read each block several times. The calls run on a thread of the reader
(posix_fadvise releases the GIL and may block while the kernel queues reads), so a fill
never waits for the disk it reads ahead of. Advice that fails costs speed only.

Memory: about blocks_per_window + LOOKAHEAD_BLOCKS blocks of all fields' stored bytes,
plus the blocks closed in the last 2 * LAG_STEPS steps (one window, where the former
window-by-window order held two). Blocks are let go only when the fields are larger than
half the memory the loader may use (the machine's, or its memory cgroup's limit): data
that fits stays cached for the next epochs.
"""

from __future__ import annotations

import collections
import os
import queue
import threading

import numpy as np

from ..errors import StorageError
from ..plan.defaults import local_trainers, memory_limit_bytes
from ..plan.sampler import Places
from ..remote.pages import CACHE_PAGE_BYTES

# posix_fadvise is called on pieces of at most this size (see _fadvise); the kernel's own
# read-ahead works in pieces of 2 MiB too.
_ADVICE_PIECE_BYTES = 2 << 20
# An in-order pass (InOrder) is read ahead in blocks of the steps holding about this many
# bytes, the block-local shuffle's size (plan/planner._SHUFFLE_BLOCK_BYTES).
IN_ORDER_BLOCK_BYTES = 32 << 20
# ...and kept asked for this far ahead (16 blocks): an in-order pass has no window, and in
# alternated cold runs it read more with this deeper queue than with LOOKAHEAD_BLOCKS's.
IN_ORDER_AHEAD_BYTES = 512 << 20
# ...and keeps the first rows of the data cached in this share of the memory limit, less
# what it reads ahead (InOrder): cold, in alternated rounds, 2/3 to 3/4 served more rows
# than half (bench/RESULTS.md); the rest is the trainer's and the readers' own memory.
IN_ORDER_KEPT_SHARE = 2 / 3
# Its places are counted from the start of the stream, never by epoch.
_IN_ORDER_PLACES = 1 << 62
# A block's runs are found step by step (in the filling thread, at the step that first asks
# for it): at most this many steps per block, and this many blocks ahead, so that a first
# step costs a few thousand steps' worth where batches are small (and rows so small that
# 32 MiB would be hundreds of thousands of steps).
_IN_ORDER_STEPS_MAX = 256
_IN_ORDER_AHEAD_BLOCKS_MAX = 16
# Runs of rows closer than this are read ahead as one (InOrder.row_runs).
_IN_ORDER_GAP_BYTES = 64 << 10
# The blocks whose runs InOrder keeps (each is asked for once, then let go of in two stages).
_IN_ORDER_RUNS_KEPT = 64
# Blocks asked for beyond the window being dealt from (blocks are about 32 MiB of rows,
# plan/planner.shuffle_block_rows): the disk's queue while the next block is being waited for.
LOOKAHEAD_BLOCKS = 4
# A reader drops its mappings of a block this many steps after the block's last rows were
# dealt, and the block's pages this many steps later again: readers fill steps a little
# apart (by up to the ring's slots), and a reader still filling an earlier step would
# otherwise read dropped pages again, one row at a time.
LAG_STEPS = 8
# Requests waiting for the thread: a full queue means the disk is behind and another
# request would only add to its backlog (the caller asks again at its next step).
PENDING_MAX = 8
# What a reader of fields from a store without windows keeps asked for ahead (StepAhead):
# the pages of the next steps up to AHEAD_BYTES (a link's worth of a fraction of a second),
# at least STEPS_AHEAD steps per reader, at most STEPS_AHEAD_MAX.
AHEAD_BYTES = 64 << 20
STEPS_AHEAD = 2
STEPS_AHEAD_MAX = 256
# ...and never more than this share of the node cache's budget, split among the readers:
# pages fetched ahead past what the budget holds would evict each other (and the pages of
# the steps being filled) before they are read, and be fetched again.
AHEAD_BUDGET_SHARE = 1 / 4


class ReadAhead:
    """Advises the kernel of the blocks each step will read (one per reader and source)."""

    def __init__(self, sampler, plan_readers, stored_bytes: int, source: int = 0, advisor: Advisor | None = None,
                 share: tuple[int, int] = (0, 1)) -> None:
        """`sampler`: a windowed Sampler, or one source of a mixture (plan/sources.SourceWindows),
        whose rows are `source`'s. `stored_bytes`: the fields' bytes on disk. Blocks are let
        go only when they cannot all stay cached (more than half the memory limit): data
        that fits keeps its pages, and later epochs read from memory. `advisor`: the thread
        that makes the calls, shared by a mixture's sources (one of its own if None).
        `share`: (this reader's index, the readers on this machine): the pages of the
        blocks at places p with p % readers == index are this reader's to drop. An in-order
        pass (InOrder) reads ahead its own depth and never drops its kept first rows."""
        self.sampler, self.source = sampler, source
        self.share_index, self.share_count = share
        self.plan_readers = list(plan_readers)
        self.release_blocks = stored_bytes > memory_limit_bytes() // 2
        self.ahead = sampler.blocks_per_window + LOOKAHEAD_BLOCKS
        self.keep_rows = 0
        if isinstance(sampler, InOrder):  # No window: its depth stands in for one, and it keeps rows.
            self.ahead, self.keep_rows, self.release_blocks = sampler.ahead_blocks, sampler.keep_rows, sampler.release
        # Places counted across epochs (epoch * places per epoch + place): the next to
        # advise, and the next to let go of at each stage; None before the first step and
        # after a jump.
        self._advised: int | None = None
        self._step: int | None = None  # the step of the last call
        self._key, self._stream = None, sampler  # the stream being read ahead (see Sampler.window_stream)
        self._released: dict[str, int | None] = {"forget": None, "drop": None}
        self._own_advisor = advisor is None
        self.advisor = Advisor() if advisor is None else advisor
        self.blocks_advised = self.blocks_released = 0

    def note(self, step: int) -> None:
        """Called as a reader starts `step`: asks for the places from the ones being dealt
        from to `ahead` past the first of them, and lets go of those closed LAG_STEPS and
        2 * LAG_STEPS steps ago (its mappings, then the pages), each once (a request the
        full queue refused is made again at the next step)."""
        key, stream, position = self.sampler.window_stream(step)
        places = stream.places(position)
        needed = places.epoch * places.total + places.closed
        # Readers fill steps in turn, so a reader's next step may lie past what it advised
        # (steps that span more places than it reads ahead): a move forward by up to two
        # rounds of the readers' steps goes on, asking only for what lies ahead of the
        # step (the places it skips are being dealt, by the others' steps or its own); a
        # seek, a jump back or further, or another stream (a resharded dealing's pieces,
        # then the shard's own stream) starts afresh.
        moved = None if self._step is None else step - self._step
        goes_on = needed <= self._advised <= needed + self.ahead if self._advised is not None else False
        goes_on = goes_on or (moved is not None and 0 < moved <= 2 * self.share_count and self._advised <= needed)
        if self._advised is None or key != self._key or not goes_on:
            self._advised, self._key, self._stream = needed, key, stream
            self._released = {"forget": None, "drop": None}
        self._step = step
        start, end = max(self._advised, needed), needed + self.ahead
        if start < end and self._submit("advise", self._blocks(start, end, places.total)):
            self.blocks_advised += end - start
            self._advised = end
        if not self.release_blocks or step < LAG_STEPS:
            return
        # Its own mappings of the blocks closed LAG_STEPS steps ago, then the pages of those
        # closed twice as long ago (every reader has let go of its mappings by then).
        for stage, lag in (("forget", LAG_STEPS), ("drop", 2 * LAG_STEPS)):
            if step < lag:
                continue
            lagged_key, _, lagged_position = self.sampler.window_stream(step - lag)
            if lagged_key != key:
                continue  # Blocks of a stream left behind: the kernel reclaims them as any cached page.
            lagged = stream.places(lagged_position)
            done = min(needed, lagged.epoch * lagged.total + lagged.closed)
            if self._released[stage] is None:
                self._released[stage] = done  # Nothing before the first step was read by this reader.
            if self._released[stage] < done and self._submit(stage, self._blocks(self._released[stage], done,
                                                                                   places.total, stage == "drop")):
                if stage == "drop":
                    self.blocks_released += done - self._released[stage]
                self._released[stage] = done

    def _blocks(self, first: int, end: int, total: int, own_share: bool = False) -> list[int]:
        """The block ids of places [first, end), counted across epochs of `total` places
        (with `own_share`, only those of the places that are this reader's share)."""
        blocks, start = [], first
        while first < end:
            epoch, place = divmod(first, total)
            count = min(end - first, total - place)
            blocks.extend(int(block) for block in self._stream.place_blocks(epoch, place, count))
            first += count
        if own_share and self.share_count > 1:
            blocks = [block for offset, block in enumerate(blocks)
                      if (start + offset) % self.share_count == self.share_index]
        return blocks

    def _submit(self, what: str, blocks) -> bool:
        try:
            ranges = self._ranges(blocks, self.keep_rows if what == "drop" else 0)
        except (OSError, StorageError):
            # A file ahead that cannot be opened (changed, removed): the fill of a step that
            # reads it reports it, naming it; a step before it must not fail for advice.
            return False
        return self.advisor.submit(what, ranges)

    def _ranges(self, blocks, kept_rows: int = 0) -> list[tuple]:
        """(opened file, offset, bytes) of every field's share of `blocks`, in their order
        (the kernel queues reads in the order it is asked: the block needed first, first),
        less rows [0, kept_rows)."""
        ranges = []
        for block in dict.fromkeys(blocks):
            for first, count in self.sampler.row_runs(block):
                if first + count > kept_rows:
                    start = max(first, kept_rows)
                    ranges.extend(self._run_ranges(block, start, first + count - start))
        return ranges

    def _run_ranges(self, block: int, first: int, count: int) -> list[tuple]:
        """(opened file, offset, bytes) of rows [first, first + count) of block `block`."""
        return [extent for reader in self.plan_readers for extent in reader.byte_ranges(first, count, self.source)]

    def close(self) -> None:
        """Stops its advisor if it is its own (a shared one is its owner's to close)."""
        if self._own_advisor:
            self.advisor.close()


class InOrder:
    """A sampler whose steps read rows in order (mode="sequential"), seen as ReadAhead sees a
    windowed one, so that an in-order pass over data larger than memory gets the window's
    read-ahead (large reads in flight ahead of need, finished pages let go of, the data's
    first rows kept) instead of page faults and the kernel's read-ahead of them: block b
    is the rows of steps [b * steps, (b + 1) * steps), about IN_ORDER_BLOCK_BYTES of them,
    and the one block being dealt from is the one that holds the step. Which rows those are
    the sampler says (Sampler.step_runs from a step's stream position, its fill for a finite
    pass's tail: a shard's share of each global batch, a resumed offset, the wrap into the
    next epoch), merged into runs: nothing of the stream's geometry is derived here."""

    blocks_per_window = 1

    def __init__(self, sampler, stored_bytes: int) -> None:
        """`stored_bytes`: the fields' bytes on disk. The read-ahead's depth is up to
        IN_ORDER_AHEAD_BYTES, and at most a quarter of the memory each trainer on this
        machine may use (its limit, shared by the trainers a launcher says run here)."""
        self.sampler, self.length = sampler, sampler.length
        row_bytes = stored_bytes / max(1, sampler.length)
        step_bytes = max(1.0, sampler.batch_size * row_bytes)
        self.steps = max(1, min(_IN_ORDER_STEPS_MAX, int(IN_ORDER_BLOCK_BYTES // step_bytes)))
        block_bytes = self.steps * sampler.batch_size * max(1.0, row_bytes)
        limit, trainers = memory_limit_bytes(), _ranks_here()
        self.ahead_blocks = max(2, min(_IN_ORDER_AHEAD_BLOCKS_MAX,
                                       int(min(IN_ORDER_AHEAD_BYTES, limit / trainers / 4) // block_bytes)))
        self._indices = np.zeros(sampler.batch_size, dtype=np.uint64)
        from .._native import ffi

        self._pointer = ffi.from_buffer("uint64_t[]", self._indices)
        self._runs: dict[int, list[tuple[int, int]]] = {}
        self._gap_rows = int(_IN_ORDER_GAP_BYTES // max(1.0, row_bytes))
        tail = sampler.tail  # A finite pass's: nothing past its end is read ahead.
        self._end_step = sampler.step_max + 1 if tail is None else tail.end_step
        # A pass in order over data larger than memory reads every page again each pass
        # whatever the kernel keeps (its least recently used page is always the next one
        # needed): the data's first rows are kept cached instead (never let go of), in what
        # IN_ORDER_KEPT_SHARE of the memory leaves beside the trainers' read-ahead, and each
        # pass reads them from memory. The machine's trainers (shards of the same data) read
        # `coverage` of the pages of any stretch of rows together: all of them unsharded, or
        # where a shard's pieces of each global batch lie within pages of each other; one
        # shard's share per trainer where they lie far apart. Kept pages are mapped without
        # recency (MADV_SEQUENTIAL), so under memory pressure the kernel reclaims them first.
        coverage = min(1.0, self._share() * trainers)
        kept = IN_ORDER_KEPT_SHARE * limit - trainers * (self.ahead_blocks + 2) * block_bytes
        self.keep_rows = int(max(0.0, kept) / coverage // max(1.0, row_bytes))
        # Pages are let go of only where the kept rows do not hold all of them: data that
        # fits stays cached for later passes, as without read-ahead.
        self.release = self.keep_rows < sampler.length

    def _share(self) -> float:
        """The share of the rows of a stretch that this shard reads: the rows of a step over
        the distance to the next step's (1 unsharded; 1 / shard_count where the shards'
        pieces of a global batch lie further apart than _IN_ORDER_GAP_BYTES; 1, the
        cautious answer, where the sampler cannot say without a fill)."""
        first, second = self.sampler.step_runs(0), self.sampler.step_runs(1)
        if not first or not second or len(first) != 1 or len(second) != 1:
            return 1.0
        stride = second[0][0] - first[0][0]
        rows = first[0][1]
        return rows / stride if stride > rows + self._gap_rows else 1.0

    def window_stream(self, step: int) -> tuple:
        return None, self, step

    def places(self, step: int) -> Places:
        block = step // self.steps
        return Places(0, block + 1, block, _IN_ORDER_PLACES)

    def place_blocks(self, epoch: int, first: int, count: int) -> np.ndarray:
        return np.arange(first, first + count, dtype=np.uint64)

    def row_runs(self, block: int) -> list[tuple[int, int]]:
        """(first row, rows) of the runs of rows the steps of `block` read, by first row: a
        step's rows and the next step's join into one run; a shard's share of each global
        batch, or the wrap into the next epoch, starts another; repeated rows (a finite
        pass's padding, a batch larger than the data) count once. Runs less than
        _IN_ORDER_GAP_BYTES apart are joined (the kernel reads whole pages, and its own
        read-ahead would read such gaps too)."""
        runs = self._runs.get(block)
        if runs is None:
            # A block is asked for, then let go of in two stages: kept for the stages to come.
            runs = self._runs[block] = self._find_runs(block)
            while len(self._runs) > _IN_ORDER_RUNS_KEPT:
                del self._runs[next(iter(self._runs))]
        return runs

    def _find_runs(self, block: int) -> list[tuple[int, int]]:
        first = block * self.steps
        end = min(first + self.steps, self._end_step)
        pieces = []
        for step in range(first, end):
            runs = self.sampler.step_runs(step)  # Without filling the step, where the sampler can say.
            if runs is None:  # A finite pass's tail step: its fill says.
                self.sampler.fill_unchecked(step, self._pointer)
                runs = _runs_of(self._indices, self._gap_rows)
            pieces.extend(runs)
        return _union(pieces, self._gap_rows)


def _runs_of(rows: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """(first, count) runs covering the distinct `rows`, runs closer than `gap` rows joined.
    Rows in any order and repeated (a finite pass's padding, a batch larger than the data)."""
    if not len(rows):
        return []
    distinct = np.sort(rows.astype(np.int64))
    breaks = np.flatnonzero(np.diff(distinct) > 1 + gap) + 1
    starts, ends = np.append(0, breaks), np.append(breaks, len(distinct))
    return [(int(distinct[start]), int(distinct[stop - 1]) + 1 - int(distinct[start]))
            for start, stop in zip(starts.tolist(), ends.tolist())]


def _union(runs: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Runs merged where they overlap or lie within `gap` rows of each other, by first row."""
    merged: list[tuple[int, int]] = []
    for first, count in sorted(runs):
        if merged and first <= merged[-1][0] + merged[-1][1] + gap:
            end = max(merged[-1][0] + merged[-1][1], first + count)
            merged[-1] = (merged[-1][0], end - merged[-1][0])
        else:
            merged.append((first, count))
    return merged


def _ranks_here() -> int:
    """The trainers on this machine (plan/defaults.local_trainers: torchrun's or Slurm's
    count), 1 where none is said or it cannot be read (the loader reports that itself)."""
    try:
        return local_trainers()
    except ValueError:
        return 1


class Advisor:
    """The thread that makes the read-ahead's calls (posix_fadvise releases the GIL and may
    block while the kernel queues reads, so a fill never waits for the disk it reads ahead
    of). One per filler: a mixture's sources share it."""

    def __init__(self, pending_max: int = PENDING_MAX) -> None:
        self._pending: queue.Queue = queue.Queue(maxsize=pending_max)
        self._thread = threading.Thread(target=self._loop, name="shmloader-readahead", daemon=True)
        self._thread.start()

    def submit(self, what: str, ranges: list[tuple]) -> bool:
        """Queues "advise" (read ahead), "forget" (drop this process's mappings) or "drop"
        (drop the pages) of `ranges`, or "fetch" (from a store into the node cache); False if
        the queue is full (the disk is behind: the caller asks again later)."""
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
            if what in ("advise", "fetch"):
                ranges = fetch_remote(ranges)
            if what == "fetch":
                continue
            if what == "forget":
                for field, offset, size in ranges:
                    field.forget(offset, size)
            elif what == "drop":
                _fadvise(ranges, os.POSIX_FADV_DONTNEED)
            else:
                _fadvise(ranges, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        """Stops the thread after the request it is making: what is still queued is dropped
        (from a store, a window's blocks are seconds of the link; the fields stay open until
        the thread is done)."""
        while True:
            try:
                self._pending.get_nowait()
            except queue.Empty:
                break
        while True:
            try:
                self._pending.put(None, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    return
        self._thread.join(timeout=5.0)


def fetch_remote(ranges: list[tuple], throttled: bool = True) -> list[tuple]:
    """Fetches the ranges of fields from a store into the node cache (all of a field's at
    once, so that their requests are in flight together; CachedObject.prefetch, with its
    `throttled`); returns the other ranges. A failure is left to the fill that needs the
    pages: it raises it, naming the URL."""
    local, remote = [], {}
    for field, offsets, sizes in ranges:
        if getattr(field, "remote", None) is None:
            local.append((field, offsets, sizes))
        else:
            remote.setdefault(id(field), (field, [], []))
            remote[id(field)][1].append(np.atleast_1d(offsets))
            remote[id(field)][2].append(np.atleast_1d(sizes))
    for field, offsets, sizes in remote.values():
        try:
            field.remote.prefetch(np.concatenate(offsets), np.concatenate(sizes), field.unit_pages, throttled)
        except Exception:  # noqa: BLE001 - the pin of the fill reports it.
            pass
    return local


class StepAhead:
    """Fetches the pages of the next steps' rows into the node cache before a reader needs
    them, for fields from a store read without windows (whose blocks ReadAhead fetches):
    rows at random are many small ranges, and only many requests in flight fill a link.
    A reader keeps the steps after its own asked for up to AHEAD_BYTES of pages (at least
    STEPS_AHEAD per reader of the machine, at most STEPS_AHEAD_MAX), and at most its share
    of AHEAD_BUDGET_SHARE of the cache's budget (a step at least): readers fill steps in
    turn, so each one's next steps are mostly the others', and the cache's fetch locks make
    sure that a page is downloaded once."""

    def __init__(self, filler, readers: int) -> None:
        self.filler, self.sampler = filler, filler.sampler
        self.least = STEPS_AHEAD * max(1, readers)
        self.readers = max(1, readers)
        self._limit = AHEAD_BYTES  # What it keeps asked for ahead (_budget_share).
        self._next: int | None = None
        self._asked: collections.deque = collections.deque()  # (step, bytes of its pages) asked for
        self._asked_bytes = 0
        batch = filler.slot.batch_size
        self._indices = np.zeros(batch, dtype=np.uint64)
        self._sources = np.zeros(batch, dtype=np.uint32) if filler.mixture else None
        from .._native import ffi

        self._index_pointer = ffi.from_buffer("uint64_t[]", self._indices)
        self._source_pointer = None if self._sources is None else ffi.from_buffer("uint32_t[]", self._sources)
        self.advisor = Advisor(STEPS_AHEAD_MAX)

    def note(self, step: int) -> None:
        if self._next is None or not step < self._next <= step + STEPS_AHEAD_MAX + 1:
            self._next = step + 1  # A first step, a seek or a jump.
            self._asked.clear()
            self._asked_bytes = 0
        while self._asked and self._asked[0][0] <= step:
            self._asked_bytes -= self._asked.popleft()[1]
        end = min(step + 1 + STEPS_AHEAD_MAX, self.sampler.step_max)
        while self._next < end and self._asked_bytes < self._limit and (
                self._next <= step + self.least or self._asked_bytes < AHEAD_BYTES):
            if self._sources is None:
                self.sampler.fill_unchecked(self._next, self._index_pointer)
            else:
                self.sampler.fill_unchecked(self._next, self._index_pointer, self._source_pointer)
            ranges = [extent for reader in self.filler.field_readers for extent in
                      reader.extents(self._indices, self._sources, wait=False)]
            self._limit = self._budget_share(ranges)  # The budget is the last loader's: read each time.
            if not self.advisor.submit("fetch", ranges):
                break  # The fetches are behind: asked again at the next step.
            size = sum(_page_bytes(offsets, sizes) for _, offsets, sizes in ranges)
            self._asked.append((self._next, size))
            self._asked_bytes += size
            self._next += 1

    def _budget_share(self, ranges: list[tuple]) -> int:
        """This reader's share of what the caches of `ranges`' fields may hold fetched ahead."""
        budgets = [field.remote.cache.budget() for field, _, _ in ranges]
        budgets = [budget for budget in budgets if budget]  # 0: no budget set (yet).
        if not budgets:
            return AHEAD_BYTES
        return min(AHEAD_BYTES, int(min(budgets) * AHEAD_BUDGET_SHARE) // self.readers)

    def close(self) -> None:
        self.advisor.close()


def _page_bytes(offsets: np.ndarray, sizes: np.ndarray) -> int:
    """The bytes of the distinct cache pages under byte ranges (what fetching them costs, at
    most). Counted once each: rows of a few KiB share a page, and counting a page per row
    made a step of sequential rows look several times its size, so the read-ahead asked
    for a fraction of AHEAD_BYTES and kept one or two requests in flight."""
    from ..remote.cache import pages_of

    return len(pages_of(np.asarray(offsets, np.int64), np.asarray(sizes, np.int64))) * CACHE_PAGE_BYTES


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
