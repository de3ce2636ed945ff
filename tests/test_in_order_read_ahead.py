"""Sequential mode reads ahead as the block-local shuffle does (storage/readahead.InOrder):
its blocks are runs of steps, whose rows come from the sampler's own fill for any shard,
finite pass, resume or wrap; every step's rows are asked for before they are read and let
go of only after; the filler of a sequential loader reads ahead for every kind of field;
and the kernel really holds the pages of the steps ahead soon after the first batch."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import pytest
from conftest import ReadAheadLedger, block_ids_read_ahead, examples, write_b2nd
from hypothesis import given
from hypothesis import strategies as st

from shmloader import Packed, ShmDataLoader, Windows
from shmloader.errors import StorageError
from shmloader.fill.filler import StepFiller
from shmloader.plan.options import LoaderOptions
from shmloader.plan.planner import plan_loader
from shmloader.plan.sampler import Sampler
from shmloader.storage.readahead import LAG_STEPS, InOrder
from shmloader.tools.convert import write_ragged


@st.composite
def _in_order_samplers(draw):
    length = draw(st.integers(1, 3000))
    batch = draw(st.integers(1, 64))
    shards = draw(st.integers(1, 4))
    sampler = Sampler(length, batch, "sequential", draw(st.integers(0, 9)), draw(st.integers(0, shards - 1)), shards)
    if draw(st.booleans()):
        sampler = sampler.with_pass(draw(st.integers(1, 3)), draw(st.booleans()))
    if draw(st.booleans()):
        sampler = sampler.with_start(draw(st.integers(0, 3 * length)))
    return sampler


@examples(60)
@given(sampler=_in_order_samplers(), row_bytes=st.sampled_from([1, 8, 3072, 100_000]),
       block_bytes=st.integers(1, 1 << 16), block=st.integers(0, 5))
def test_a_blocks_runs_hold_exactly_the_rows_its_steps_read(sampler, row_bytes, block_bytes, block):
    """Against the sampler's own batches: every row of every step of a block lies in one of
    its runs, each run starts and ends at a row those steps read, and where no gap is small
    enough to join (rows of 64 KiB or more) the runs hold exactly the distinct rows of the
    steps."""
    view = InOrder(sampler, row_bytes * sampler.length)
    view.steps = max(1, block_bytes // (row_bytes * sampler.batch_size) or 1)  # Blocks of a few steps.
    first = block * view.steps
    end = sampler.step_max + 1 if sampler.tail is None else sampler.tail.end_step  # A finite pass ends there.
    steps = range(first, min(first + view.steps, end))
    rows = np.concatenate([sampler.fill(step) for step in steps]).astype(np.int64) if steps else np.zeros(0, np.int64)
    runs = view.row_runs(block)
    assert view.row_runs(block) == runs  # Kept, not found again, for the stages to come.
    starts = np.array([start for start, _ in runs], dtype=np.int64)
    ends = np.array([start + count for start, count in runs], dtype=np.int64)
    inside = ((rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :])).any(axis=1) if len(runs) else \
        np.zeros(len(rows), bool)
    assert inside.all(), rows[~inside][:5]
    read = set(rows.tolist())
    assert all(start in read and end - 1 in read for start, end in zip(starts.tolist(), ends.tolist()))
    if row_bytes >= 1 << 16:
        assert int((ends - starts).sum()) == len(read)  # Repeated rows (padding, wraps) once.


@pytest.mark.parametrize("shards, epochs, keep", [(1, None, 0), (3, None, 0), (2, 2, 0), (1, None, 300),
                                                  (3, 2, 500)])
def test_every_steps_rows_are_asked_for_before_they_are_read_and_let_go_only_after(shards, epochs, keep):
    """One reader of a sequential pass over three epochs: each step reads from blocks it has
    asked for and still maps, a block's mappings go before its pages, at most the blocks
    ahead and those of the last 2 * LAG_STEPS steps are held at once, and each block is
    let go of once, except those wholly within the first `keep` rows (kept cached)."""
    sampler = Sampler(1000 + 37, 20, "sequential", 3, shards - 1, shards)
    if epochs:
        sampler = sampler.with_pass(epochs, False)
    view = InOrder(sampler, 1)
    view.steps, view.ahead_blocks, view.keep_rows = 7, 4, keep
    kept = {block for block in range(200)
            if view.row_runs(block) and all(start + count <= keep for start, count in view.row_runs(block))}
    ledger = ReadAheadLedger()
    read_ahead = block_ids_read_ahead()(view, [], 0, advisor=ledger)
    read_ahead.release_blocks = True
    for step in range(3 * 1037 * shards // 20 if epochs is None else sampler.tail.end_step):
        read_ahead.note(step)
        ledger.settle()
        open_runs = [run for block in ledger.still_mapped() for run in view.row_runs(block)]
        for row in sampler.fill(step).tolist():
            assert any(start <= row < start + count for start, count in open_runs), \
                f"step {step}: row {row} read from a block not asked for"
        assert len(ledger.in_memory() - kept) <= view.ahead_blocks + 2 * LAG_STEPS // view.steps + 2
    lagging = 2 * LAG_STEPS // view.steps + 2  # Blocks closed too recently to be let go of yet.
    dropped = ledger.dropped
    assert not kept & set(dropped)
    finished = set(range(step // view.steps - lagging)) - kept
    assert sorted(dropped) == sorted(set(dropped)) and finished <= set(dropped)
    assert bool(kept) == bool(keep)

@pytest.mark.parametrize("limit, trainers, shards, batch, row_bytes", [
    (6 << 30, 1, 1, 256, 4096), (6 << 30, 3, 1, 256, 4096), (64 << 20, 1, 1, 256, 4096),
    (6 << 30, 4, 4, 256, 4096),  # Four shards on one machine: together they read every page.
    (6 << 30, 1, 8, 256, 4096),  # One shard of eight here: it reads one row in eight.
    (6 << 30, 1, 8, 16384, 4096),  # Its pieces of each global batch are one step a block.
    (6 << 30, 8, 8, 4, 64),  # Pieces within a page of each other: each trainer reads every page.
])
def test_the_rows_kept_cached_are_what_two_thirds_of_the_memory_leaves_beside_the_read_ahead(
        monkeypatch, limit, trainers, shards, batch, row_bytes):
    """Kept rows: IN_ORDER_KEPT_SHARE of the memory limit, less every trainer's read-ahead,
    over the share of each stretch's pages the machine's trainers read together; none where
    that leaves nothing. Pages are let go of exactly where the kept rows do not hold them
    all: data between the kept share and the whole memory too."""
    from shmloader.storage import readahead

    monkeypatch.setattr(readahead, "memory_limit_bytes", lambda: limit)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(trainers))
    sampler = Sampler(10**8, batch, "sequential", 0, shards - 1, shards)
    view = InOrder(sampler, row_bytes * sampler.length)
    block_bytes = view.steps * batch * row_bytes
    assert view.ahead_blocks * block_bytes <= max(2 * block_bytes, limit // 4 // trainers)
    far = (shards - 1) * batch * row_bytes > 64 << 10
    coverage = min(1.0, trainers / shards) if far else 1.0
    kept = max(0, readahead.IN_ORDER_KEPT_SHARE * limit - trainers * (view.ahead_blocks + 2) * block_bytes)
    assert view.keep_rows == int(kept / coverage // row_bytes)
    assert (view.keep_rows > 0) == (limit > 1 << 30) and view.release
    for fraction, released in [(0.9, False), (1.1, True)] if view.keep_rows else []:  # Of the rows kept.
        rows = int(fraction * view.keep_rows)
        smaller = InOrder(Sampler(rows, batch, "sequential", 0, shards - 1, shards), rows * row_bytes)
        assert smaller.keep_rows == view.keep_rows and smaller.release == released, (fraction, rows)


@pytest.mark.parametrize("limit", [24 << 30, 128 << 30], ids=["24GiB", "128GiB"])
def test_readers_whose_steps_lie_past_the_read_ahead_still_let_go_of_what_they_read(monkeypatch, limit):
    """Steps larger than a block: each reader's next step lies `readers` blocks on, past its
    read-ahead's depth; it goes on (the others advise those between) instead of starting
    afresh at every step and never letting go of anything. Between them, the readers drop
    every finished block once, except those the memory limit keeps cached (none at 24 GiB,
    the first rows at 128 GiB: IN_ORDER_KEPT_SHARE of it less the read-ahead), which none
    drops. The limit is set here, as the rule reads it, not taken from the machine."""
    from shmloader.storage import readahead

    monkeypatch.setattr(readahead, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(readahead, "_ranks_here", lambda: 1)
    readers = 4
    sampler = Sampler(100_000, 64, "sequential")
    view = InOrder(sampler, 100_000 * 64 << 20)  # Rows of 64 MiB: one step per block.
    assert view.steps == 1
    view.ahead_blocks = 2
    kept_bytes = readahead.IN_ORDER_KEPT_SHARE * limit - 4 * view.steps * 64 * (64 << 20)
    assert view.keep_rows == int(max(0, kept_bytes) // (64 << 20)) and view.release
    kept = {block for block in range(400) if all(start + count <= view.keep_rows for start, count in view.row_runs(block))}
    assert kept == set(range(view.keep_rows // 64)) and bool(kept) == (limit > 24 << 30)
    ledgers = []
    for index in range(readers):
        ledger = ReadAheadLedger(alone=False)
        read_ahead = block_ids_read_ahead()(view, [], 0, advisor=ledger, share=(index, readers))
        read_ahead.release_blocks = True
        for step in range(index, 400, readers):
            read_ahead.note(step)
            ledger.settle()
            assert step // view.steps in ledger.still_mapped()
        assert len(ledger.dropped) >= 80 - len(kept) // readers - 1
        ledgers.append(ledger)
    dropped = sorted(block for ledger in ledgers for block in ledger.dropped)
    assert dropped == sorted(set(dropped)) and not kept & set(dropped)
    assert set(range(400 - 2 * LAG_STEPS - 2 * readers)) - kept <= set(dropped)


@pytest.fixture
def files(tmp_path):
    rows = 3000
    data = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
    np.save(tmp_path / "rows.npy", data)
    write_b2nd(str(tmp_path / "rows.b2nd"), data, chunks=(128, 16), blocks=(32, 16))
    rng = np.random.default_rng(5)
    sequences = [np.arange(int(n), dtype=np.int32) + index for index, n in enumerate(rng.integers(0, 40, rows))]
    write_ragged(str(tmp_path / "docs.ragged"), sequences)
    np.save(tmp_path / "tokens.npy", np.arange(rows * 16 + 1, dtype=np.int32))
    return tmp_path


def _declaration(files, kind):
    return {"npy": str(files / "rows.npy"), "b2nd": str(files / "rows.b2nd"),
            "packed": Packed(str(files / "docs.ragged")),
            "windows": Windows(str(files / "tokens.npy"), length=16)}[kind]


@pytest.mark.parametrize("kind", ["npy", "b2nd", "packed", "windows"])
def test_a_sequential_loaders_filler_reads_ahead_the_bytes_of_its_next_steps(files, kind):
    """The filler of a sequential loader has an in-order read-ahead, and the byte ranges it
    asks for at the first step cover every row of the steps of its first blocks."""
    plan = plan_loader({"x": _declaration(files, kind)}, None, LoaderOptions(batch_size=32, mode="sequential"))
    filler = StepFiller(plan.fields, plan.slot, plan.sampler, None, False)
    try:
        [ahead] = filler.read_ahead
        assert isinstance(ahead.sampler, InOrder)
        ahead.sampler.steps = 5  # Small blocks, so that the test's data spans several.
        [reader] = filler.field_readers
        ranges = ahead._ranges(range(3))
        assert ranges and all(size > 0 for _, _, size in ranges)
        for step in range(15):
            for row in plan.sampler.fill(step).tolist():
                for field, offset, size in reader.byte_ranges(row, 1):
                    assert any(field is f and o <= offset and offset + size <= o + s for f, o, s in ranges), (step, row)
    finally:
        filler.close()


def _resident(path: str, first: int, end: int) -> float:
    """The share of a file's pages in [first, end) that the page cache holds (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        vector = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) == 0, ctypes.get_errno()
        flags = np.frombuffer(vector, dtype=np.uint8)[first // page:(end + page - 1) // page]
        del address
    return float(np.count_nonzero(flags & 1)) / max(1, len(flags))


def test_the_pages_of_the_steps_ahead_are_read_soon_after_the_first_batch(tmp_path):
    """On a real disk: after a sequential loader's first batch, the pages of the file well past
    what the kernel's own read-ahead of a fault takes (read_ahead_kb) come into the page cache
    without any further batch taken."""
    path = str(tmp_path / "cold.npy")
    rows, row_bytes = 24 * 1024, 2048  # 48 MiB
    np.save(path, np.arange(rows * row_bytes // 8, dtype=np.int64).reshape(rows, row_bytes // 8))
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if _resident(path, 0, os.path.getsize(path)) > 0.1:
        pytest.skip("the page cache cannot be emptied of this file here (tmpfs)")
    far = 32 << 20  # Past the first block (32 MiB of rows) and any read_ahead_kb in use.
    with ShmDataLoader({"x": path}, batch_size=64, readers=0, mode="sequential") as loader:
        batch = next(iter(loader))
        assert (batch["x"][:, 0] == batch.indices.astype(np.int64) * (row_bytes // 8)).all()
        batch.release()
        deadline = time.monotonic() + 30
        while _resident(path, far, os.path.getsize(path)) < 0.9 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _resident(path, far, os.path.getsize(path)) >= 0.9


def test_a_file_ahead_that_cannot_be_opened_fails_the_step_that_reads_it_not_an_earlier_one(tmp_path):
    """The read-ahead opens the files of the blocks ahead; one that changed since the loader
    described it fails the first step that reads its rows, naming it, and no step before
    (advice costs speed only)."""
    data = np.arange(1000 * 16, dtype=np.int64).reshape(1000, 16)
    np.save(tmp_path / "a.npy", data[:500])
    write_b2nd(str(tmp_path / "b.b2nd"), data[500:], chunks=(50, 16), blocks=(10, 16))
    with ShmDataLoader({"x": [str(tmp_path / "a.npy"), str(tmp_path / "b.b2nd")]}, batch_size=10, readers=0,
                       mode="sequential") as loader:
        os.truncate(tmp_path / "b.b2nd", 200)
        batches = iter(loader)
        for step in range(50):  # The rows of a.npy.
            batch = next(batches)
            np.testing.assert_array_equal(batch["x"], data[batch.indices])
            batch.release()
        with pytest.raises(StorageError, match="b.b2nd: the file changed"):
            next(batches)
