"""The block-local shuffle (shuffle_window, for data larger than memory): every epoch covers
every row once, each row comes from a block open at its position (about one window of
them), batches equal a reference read for every field kind and reader count, resume is
exact, and the read-ahead asks for the bytes of every block before it is read and lets go
of blocks only once they are done."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ReadAheadLedger, block_ids_read_ahead, write_b2nd

from shmloader import Packed, Padded, PerformanceWarning, ShmDataLoader, Windows
from shmloader.fill.inputs import field_reader
from shmloader.plan.fields import plan_field
from shmloader.plan.sampler import Sampler
from shmloader.plan.sources import MixtureSampler
from shmloader.storage.readahead import LAG_STEPS, LOOKAHEAD_BLOCKS, ReadAhead
from shmloader.tools.convert import write_ragged


@pytest.mark.parametrize("length, window, block_rows", [(1000, 64, 16), (1024, 64, 16), (10, 64, 16), (5000, 700, 9)])
def test_every_epoch_covers_every_row_once(length, window, block_rows):
    sampler = Sampler(length, 7, "shuffle", 3, shuffle_window=window, block_rows=block_rows)
    positions = np.concatenate([sampler.fill(step) for step in range(-(-3 * length // 7))])
    for epoch in range(3):
        rows = positions[epoch * length:(epoch + 1) * length]
        np.testing.assert_array_equal(np.sort(rows), np.arange(length), err_msg=f"epoch {epoch}")
    assert not np.array_equal(positions[:length], positions[length:2 * length])  # Epochs differ.


def _open_blocks(sampler, position: int) -> set[int]:
    """The blocks being dealt from at stream `position`."""
    places = sampler.places(position)
    return set(sampler.place_blocks(places.epoch, places.closed, places.opened - places.closed).tolist())


def test_each_row_comes_from_an_open_block_and_each_block_is_dealt_within_its_window():
    sampler = Sampler(10_050, 32, "shuffle", 1, shuffle_window=1000, block_rows=100)  # 100 blocks, 50 tail rows.
    rows = np.concatenate([sampler.fill(step) for step in range(2 * 10_050 // 32)])
    for position in range(0, len(rows), 7):
        places = sampler.places(position)
        assert places.total == 101 and places.opened - places.closed <= 10
        assert rows[position] // 100 in _open_blocks(sampler, position), position
    epoch = rows[10_050:20_100]  # Epoch 1.
    first, last = np.full(101, len(epoch)), np.zeros(101, dtype=np.int64)
    np.minimum.at(first, epoch // 100, np.arange(len(epoch)))
    np.maximum.at(last, epoch // 100, np.arange(len(epoch)))
    # A block's rows are spread over its ten phases (of 100 rows where the window is full),
    # so a reader holds it for about one window: never more than eleven phases' rows.
    assert (last - first < 1100).all() and (last[:100] - first[:100] > 500).mean() > 0.8
    # The tail's 50 rows are dealt where the window drains (its last 9 phases), among the
    # rows of the blocks still open there, not in a batch of their own.
    assert 9_000 < first[100] and last[100] - first[100] > 300
    tail_positions = np.flatnonzero(epoch >= 10_000)
    assert len(np.unique(epoch[tail_positions[0]:tail_positions[-1]] // 100)) > 5


def test_the_order_of_a_phase_is_shuffled_not_block_by_block():
    sampler = Sampler(100_000, 256, "shuffle", 0, shuffle_window=10_000, block_rows=500)
    batch = sampler.fill(200)  # Mid-epoch: the window is full.
    assert len(np.unique(batch // 500)) >= 15  # 20 blocks in the window: a batch draws from most.
    assert len(np.unique(sampler.fill(0) // 500)) >= 4  # An epoch's first phases fill the window.


def test_window_settings_are_checked():
    with pytest.raises(ValueError, match="mode='shuffle' only"):
        Sampler(100, 4, "sequential", shuffle_window=10)
    with pytest.raises(ValueError, match="shuffle_window"):
        Sampler(100, 4, "shuffle", shuffle_window=0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("window_shuffle")
    rows = np.arange(3000 * 6, dtype=np.int32).reshape(3000, 6)
    np.save(directory / "rows.npy", rows)
    write_b2nd(directory / "rows.b2nd", rows, chunks=(64, 6), blocks=(8, 6))
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 1000, rng.integers(1, 40)).astype(np.int32) for _ in range(3000)]
    write_ragged(directory / "docs.ragged", documents)
    tokens = np.arange(20_000, dtype=np.int32)
    np.save(directory / "tokens.npy", tokens)
    np.save(directory / "a.npy", rows[:1200])
    np.save(directory / "b.npy", rows[1200:])
    return {"dir": directory, "rows": rows, "documents": documents, "tokens": tokens}


def _check(batch, files, kind):
    indices = batch.indices
    if kind in ("npy", "b2nd", "shards"):
        np.testing.assert_array_equal(batch["x"], files["rows"][indices])
    elif kind == "packed":
        expected = np.concatenate([files["documents"][i] for i in indices])
        np.testing.assert_array_equal(batch["x"][:int(batch["x.offsets"][-1])], expected)
    elif kind == "padded":
        for row, index in enumerate(indices):
            document = files["documents"][index]
            np.testing.assert_array_equal(batch["x"][row, :len(document)], document)
    elif kind == "windows":
        expected = np.stack([files["tokens"][i * 16:i * 16 + 17] for i in indices])
        np.testing.assert_array_equal(batch["x"], expected)


def _declaration(files, kind):
    directory = files["dir"]
    return {"npy": str(directory / "rows.npy"), "b2nd": str(directory / "rows.b2nd"),
            "shards": [str(directory / "a.npy"), str(directory / "b.npy")],
            "packed": Packed(str(directory / "docs.ragged")),
            "padded": Padded(str(directory / "docs.ragged"), max_length=40),
            "windows": Windows(str(directory / "tokens.npy"), length=16)}[kind]


@pytest.mark.parametrize("kind", ["npy", "b2nd", "shards", "packed", "padded", "windows"])
def test_batches_equal_the_reference_and_do_not_depend_on_the_reader_count(files, kind):
    fields = {"x": _declaration(files, kind)}
    seen = {}
    for readers in (1, 3):
        with ShmDataLoader(fields, batch_size=32, readers=readers, seed=4, shuffle_window=400) as loader:
            assert loader.sampler.blocks_per_window > 4  # Eight blocks, unless a Blosc2 chunk is larger.
            indices = []
            for step, batch in zip(range(40), loader):
                _check(batch, files, kind)
                indices.append(np.array(batch.indices))
                del batch
            seen[readers] = np.concatenate(indices)
    np.testing.assert_array_equal(seen[1], seen[3])


def test_resume_from_a_checkpoint_is_exact(files):
    fields = {"x": _declaration(files, "npy")}
    with ShmDataLoader(fields, batch_size=32, readers=2, seed=4, shuffle_window=400) as loader:
        for _ in range(17):
            del _
            next(loader)
        state = loader.state_dict()
        expected = [np.array(next(loader).indices) for _ in range(30)]
    assert state["shuffle_window"] == 400
    with ShmDataLoader(fields, batch_size=32, readers=1, seed=4, shuffle_window=400) as loader:
        loader.load_state_dict(state)
        for indices in expected:
            np.testing.assert_array_equal(next(loader).indices, indices)
        # A checkpoint of the order that dealt whole windows (before "shuffle_order") names other rows.
        before_sliding = {key: value for key, value in state.items() if key != "shuffle_order"}
        with pytest.raises(ValueError, match="dealt whole windows one after another"):
            loader.load_state_dict(before_sliding)
    with ShmDataLoader(fields, batch_size=32, readers=1, seed=4) as loader:
        with pytest.raises(ValueError, match="shuffle_window"):
            loader.load_state_dict(state)


@pytest.mark.parametrize("missing", [("shuffle_window",), ("shuffle_window", "block_rows"), ("epochs",)])
def test_a_checkpoint_from_before_a_setting_existed_is_refused_where_the_setting_is_used(files, missing):
    """A checkpoint without a key was made before the setting existed, at the setting's
    old behaviour; a loader that uses the setting must refuse it (before: a missing key
    matched anything, and a windowed loader resumed at other rows)."""
    fields = {"x": _declaration(files, "npy")}
    with ShmDataLoader(fields, batch_size=32, readers=0, seed=4) as loader:
        next(loader)
        old = {key: value for key, value in loader.state_dict().items() if key not in missing}
    windowed = {"shuffle_window": 400} if "shuffle_window" in missing else {"epochs": 1}
    with ShmDataLoader(fields, batch_size=32, readers=0, seed=4, **windowed) as loader:
        with pytest.raises(ValueError, match=f"{missing[0]}: checkpoint"):
            loader.load_state_dict(old)
    with ShmDataLoader(fields, batch_size=32, readers=0, seed=4) as loader:
        loader.load_state_dict(old)  # Where the setting keeps its old behaviour, it still loads.
        assert next(loader).step == 1


@pytest.mark.parametrize("fractions, shards", [((1.0, 1.0), 1), ((1.0, 0.4), 1), ((0.7, 1.0), 3)])
def test_each_source_of_a_windowed_mixture_covers_its_rows_once_per_its_epoch(fractions, shards):
    """Windowed sources beside each other: each runs its own block-local epochs (over its
    first ceil(fraction * rows) positions), the union of shards' positions being the
    source's stream; each row comes from a block open at its position."""
    lengths, weights, block_rows, window = [1000, 333], [3, 1], [16, 9], 64
    samplers = [MixtureSampler(lengths, weights, list(fractions), [False, False], 7, 2, shard, shards, window,
                               block_rows) for shard in range(shards)]
    streams = [[], []]
    for step in range(-(-700 // shards)):  # Over 3 epochs of each source.
        for sampler in samplers:
            rows, sources = sampler.fill(step)
            for source in (0, 1):
                streams[source].append(rows[sources == source])
    views = samplers[0].window_views()
    assert [view.source for view in views] == [0, 1]
    for source, view in enumerate(views):
        stream, take = np.concatenate(streams[source]), samplers[0].takes[source]
        assert view.epoch_length == take and view.blocks_per_window == -(-window // block_rows[source])
        for epoch in range(3):
            rows = stream[epoch * take:(epoch + 1) * take]
            assert len(np.unique(rows)) == take, f"source {source} epoch {epoch} repeats a row"
            if take == lengths[source]:
                np.testing.assert_array_equal(np.sort(rows), np.arange(take))
        for position in range(take, 2 * take, 5):  # Epoch 1.
            assert stream[position] // block_rows[source] in _open_blocks(view, position)
    # A step's position in a source's stream: the draws of that source in the steps before.
    for step in (0, 11, 57):
        before = sum(len(part) for part in streams[1][:step * shards])
        assert views[1].stream_position(step) == before


def test_a_windowed_mixture_gives_the_rows_it_names_for_any_reader_count_and_resumes(files):
    from shmloader import Source

    sources = [Source({"x": _declaration(files, "npy")}, weight=2),
               Source({"x": _declaration(files, "shards")}, weight=1, fraction=0.5)]
    seen = {}
    for readers in (1, 3):
        with ShmDataLoader(sources, batch_size=32, readers=readers, seed=4, shuffle_window=400) as loader:
            assert loader.sampler.window_blocks[0] > 4 and loader.sampler.window_blocks[1] > 4
            indices = []
            for step, batch in zip(range(60), loader):
                _check(batch, files, "npy")  # Both sources hold the same rows.
                assert set(np.unique(batch["source"]).tolist()) == {0, 1}
                indices.append(np.array(batch.indices))
                del batch
            state = loader.state_dict() if readers == 1 else None
            seen[readers] = np.concatenate(indices)
        if readers == 1:
            resumed_state = state
    np.testing.assert_array_equal(seen[1], seen[3])
    with ShmDataLoader(sources, batch_size=32, readers=1, seed=4, shuffle_window=400) as loader:
        loader.load_state_dict(resumed_state)
        assert next(loader).step == 60
    with pytest.raises(ValueError, match="a fixed subset"):
        ShmDataLoader([sources[0], Source({"x": _declaration(files, "npy")}, fraction=0.5, fixed=True)],
                      batch_size=8, readers=1, shuffle_window=100)


def test_a_windowed_mixture_reads_ahead_each_sources_own_files(files):
    from shmloader import Source
    from shmloader.fill.filler import StepFiller
    from shmloader.plan.options import LoaderOptions
    from shmloader.plan.planner import plan_loader

    sources = [Source({"x": _declaration(files, "b2nd")}), Source({"x": _declaration(files, "shards")})]
    plan = plan_loader(sources, None, LoaderOptions(batch_size=32, seed=4, shuffle_window=400))
    import threading

    before = {thread for thread in threading.enumerate() if thread.name == "shmloader-readahead"}
    filler = StepFiller(plan.fields, plan.slot, plan.sampler, None, False)
    try:
        assert [ahead.source for ahead in filler.read_ahead] == [0, 1]
        started = {thread for thread in threading.enumerate() if thread.name == "shmloader-readahead"} - before
        assert len(started) == 1  # The sources share one advisor thread.
        for ahead, names in zip(filler.read_ahead, [{"rows.b2nd"}, {"a.npy", "b.npy"}]):
            ranges = ahead._ranges(_open_blocks(ahead.sampler, ahead.sampler.stream_position(0)))
            assert ranges and {field.spec.path.rsplit("/", 1)[1] for field, _, _ in ranges} <= names
            ahead.note(0)
            assert ahead.blocks_advised == ahead.sampler.blocks_per_window + LOOKAHEAD_BLOCKS
    finally:
        filler.close()


@pytest.mark.parametrize("kind", ["npy", "b2nd", "packed", "windows"])
def test_readahead_asks_for_the_bytes_of_the_windows_blocks(files, kind):
    plan = plan_field("x", _declaration(files, kind), 32)
    rows = plan.row_count
    sampler = Sampler(rows, 32, "shuffle", 2, shuffle_window=rows // 4, block_rows=rows // 32)
    reader = field_reader(plan, 32, False, sampler)
    read_ahead = ReadAhead(sampler, [reader], plan.stored_bytes)
    try:
        blocks = sampler.place_blocks(0, 0, 12)
        ranges = read_ahead._ranges(blocks)
        assert ranges and all(size > 0 for _, _, size in ranges)
        # Every row of the window lies in an advised range of its file.
        part = reader.part(0)
        for block in blocks.tolist():
            first = block * sampler.block_rows
            for row in (first, min(rows, first + sampler.block_rows) - 1):
                for field, offset, size in reader.byte_ranges(row, 1):
                    assert any(field is f and o <= offset and offset + size <= o + s for f, o, s in ranges), (row, kind)
        assert part is not None
        read_ahead.note(0)
        ahead = sampler.blocks_per_window + LOOKAHEAD_BLOCKS
        assert read_ahead.blocks_advised == ahead  # The first window and the blocks ahead of it.
        read_ahead.note(1)
        assert read_ahead.blocks_advised == ahead  # Still in the first phases: nothing new.
    finally:
        read_ahead.close()
        reader.close()


@pytest.mark.parametrize("shard_count, tail", [(1, 0), (1, 37), (2, 37)])
def test_every_block_is_asked_for_before_its_rows_are_read_and_let_go_only_after(shard_count, tail):
    """One reader through three epochs: each step's rows lie in blocks it has asked for and
    still maps, a block's mappings go before its pages, at most a window and the blocks
    ahead (and those closed in the last 2 * LAG_STEPS steps) are held at once, and every
    block is let go of once per epoch."""
    block_rows, window = 50, 400
    sampler = Sampler(100 * block_rows + tail, 20, "shuffle", 3, 0, shard_count, shuffle_window=window,
                      block_rows=block_rows)
    ledger = ReadAheadLedger()
    read_ahead = block_ids_read_ahead()(sampler, [], 0, advisor=ledger)
    read_ahead.release_blocks = True
    step_rows = sampler.batch_size
    for step in range(3 * sampler.epoch_length // step_rows):
        read_ahead.note(step)
        ledger.settle()
        mapped = ledger.still_mapped()
        for row in sampler.fill(step).tolist():
            assert row // block_rows in mapped, f"step {step}: row {row} read from a block not asked for"
        # Held: the window, the blocks ahead, and those closed in the last 2 * LAG_STEPS steps.
        now, then = sampler.places(step * step_rows), sampler.places(max(0, step - 2 * LAG_STEPS) * step_rows)
        lagging = (now.epoch - then.epoch) * now.total + now.closed - then.closed
        assert len(ledger.in_memory()) <= sampler.blocks_per_window + LOOKAHEAD_BLOCKS + lagging + 1, step
    assert len(ledger.dropped) >= 2 * (sampler.epoch_length // block_rows)


@pytest.mark.parametrize("readers", [2, 3])
def test_the_readers_drop_each_finished_block_once_between_them_when_one_reader_would(readers):
    """The page cache is the machine's: of the readers of one loader, the reader of index
    place % readers drops a finished block's pages, at the step a lone reader would, and
    each still reads ahead and lets go of its own mappings of every block."""
    sampler = Sampler(100 * 50 + 37, 20, "shuffle", 3, shuffle_window=400, block_rows=50)

    def requests(share):
        ledger = ReadAheadLedger()
        read_ahead = block_ids_read_ahead()(sampler, [], 0, advisor=ledger, share=share)
        read_ahead.release_blocks = True
        found = {"advise": [], "forget": [], "drop": []}
        for step in range(3 * sampler.epoch_length // sampler.batch_size):
            read_ahead.note(step)
            for what, blocks in ledger.settle():
                found[what] += [(step, block) for block in blocks]
        return found

    alone = requests((0, 1))
    shared = [requests((index, readers)) for index in range(readers)]
    for found in shared:
        assert found["advise"] == alone["advise"] and found["forget"] == alone["forget"]
    drops = [drop for found in shared for drop in found["drop"]]  # (step, block) of each reader's drops
    assert sorted(drops) == sorted(alone["drop"]) and len(alone["drop"]) >= 2 * 100
    assert all(len(found["drop"]) >= len(alone["drop"]) // readers - 2 for found in shared)  # Shared evenly.


@pytest.mark.parametrize("shard_count", [1, 2, 3])
def test_shards_read_disjoint_shares_that_cover_every_row_once_per_epoch(shard_count):
    """Each host reads its own share of the blocks (about 1/shard_count of the bytes)."""
    length, batch, block_rows = 999, 9, 13
    shares = []
    for shard in range(shard_count):
        sampler = Sampler(length, batch, "shuffle", 5, shard, shard_count, shuffle_window=120, block_rows=block_rows)
        share = sampler.epoch_length
        steps = -(-2 * share // batch)
        stream = np.concatenate([sampler.fill(step) for step in range(steps)])
        epochs = [stream[:share], stream[share:2 * share]]
        assert len(np.unique(epochs[0])) == share  # No row twice within a shard's epoch.
        for position in range(0, 2 * share, 3):  # Its rows come from its own open blocks.
            assert stream[position] // block_rows in _open_blocks(sampler, position)
        shares.append(epochs)
    for epoch in range(2):
        together = np.concatenate([epochs[epoch] for epochs in shares])
        np.testing.assert_array_equal(np.sort(together), np.arange(length))  # A partition, every epoch.
    if shard_count > 1:
        assert abs(shares[0][0].size - shares[1][0].size) <= block_rows


def test_two_shard_loaders_read_disjoint_halves_and_give_the_rows_they_name(files):
    fields = {"x": _declaration(files, "npy")}
    seen = []
    for shard in range(2):
        with ShmDataLoader(fields, batch_size=30, readers=1, seed=4, shuffle_window=400, shard_index=shard,
                           shard_count=2) as loader:
            rows = []
            for _, batch in zip(range(loader.sampler.epoch_length // 30), loader):
                _check(batch, files, "npy")
                rows.append(np.array(batch.indices))
                del batch
            seen.append(np.concatenate(rows))
    assert not set(seen[0].tolist()) & set(seen[1].tolist())
    assert len(seen[0]) + len(seen[1]) > 0.95 * 3000


def test_a_reader_killed_mid_window_costs_no_batch(files):
    import os
    import signal

    from conftest import process_alive, wait_until

    fields = {"x": _declaration(files, "b2nd")}
    with ShmDataLoader(fields, batch_size=32, readers=2, seed=6, shuffle_window=400) as reference:
        expected = [np.array(next(reference).indices) for _ in range(150)]
    with ShmDataLoader(fields, batch_size=32, readers=2, seed=6, shuffle_window=400) as loader:
        # The trainer checks its readers at least every 64 batches: the death is seen by 150.
        for step in range(150):
            if step == 20:
                victim = loader.diagnostics.reader_pids[0]
                os.kill(victim, signal.SIGKILL)
                assert wait_until(lambda: not process_alive(victim), timeout=30)
            batch = next(loader)
            assert batch.step == step
            np.testing.assert_array_equal(batch.indices, expected[step])
            _check(batch, files, "b2nd")
            del batch
        assert loader.stats()["reader_restarts"] == 1


def test_a_window_too_large_for_the_memory_is_warned_about_with_one_that_fits(files, monkeypatch):
    """A window and the blocks read ahead of it must fit in the page cache the loader may use."""
    import warnings

    from shmloader import PerformanceWarning

    fields = {"x": _declaration(files, "npy")}  # 3,000 rows of 24 bytes: 72 KB.
    monkeypatch.setattr("shmloader.plan.planner.memory_limit_bytes", lambda: 100_000)
    # shuffle_window=2000: 8 blocks of 250 rows and 4 ahead, 72 KB, over half the 100 KB.
    with pytest.warns(PerformanceWarning, match=r"shuffle_window=2,000: the window and the blocks read ahead of it "
                                                r"take .* at most about 1,083 rows"):
        ShmDataLoader(fields, batch_size=8, readers=0, shuffle_window=2000).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        ShmDataLoader(fields, batch_size=8, readers=0, shuffle_window=1083).close()  # 13 blocks of 135 rows: 42 KB.
        monkeypatch.setattr("shmloader.plan.planner.memory_limit_bytes", lambda: 1_000_000)  # The data stays cached.
        ShmDataLoader(fields, batch_size=8, readers=0, shuffle_window=2000).close()


def test_a_memory_too_small_for_any_window_says_so_instead_of_advising_one_row(files, monkeypatch):
    """Before: "a shuffle_window of at most about 1 rows" when the blocks read ahead alone
    took more than half of the memory."""
    fields = {"x": _declaration(files, "npy")}
    monkeypatch.setattr("shmloader.plan.planner.memory_limit_bytes", lambda: 20_000)
    with pytest.warns(PerformanceWarning, match=r"read ahead alone take .* no window fits") as caught:
        ShmDataLoader(fields, batch_size=8, readers=0, shuffle_window=2000).close()
    assert not any("at most about" in str(warning.message) for warning in caught)


@pytest.mark.parametrize("window, shards", [(1000, 1), (5000, 1), (1000, 3)])
def test_a_window_that_covers_the_data_is_the_global_shuffle(window, shards):
    """Before: shuffle_window=262144 over 100,000 rows stored sorted by class still dealt
    blocks in a block order, 51.7 distinct classes a batch against 92.0 for the global
    shuffle (bench/window_randomness.py); a window holding all the data is its global order."""
    for shard in range(shards):
        windowed = Sampler(1000, 32, "shuffle", 3, shard, shards, shuffle_window=window, block_rows=10)
        plain = Sampler(1000, 32, "shuffle", 3, shard, shards)
        assert windowed.window_views() == [] and not windowed.shard_blocks
        for step in range(70):
            np.testing.assert_array_equal(windowed.fill(step), plain.fill(step))
    mixture = MixtureSampler([1000, 50], [3, 1], [1.0, 1.0], [False, False], 32, 3, 0, 1, 100, [10, 5])
    assert [view.source for view in mixture.window_views()] == [0]  # Only the source the window does not cover.


def test_a_checkpoint_of_a_covering_window_from_before_the_global_fallback_is_refused(files):
    """A window at least as large as the data dealt blocks in a sliding order before it
    became the global shuffle: such a checkpoint names other rows now."""
    fields = {"x": _declaration(files, "npy")}  # 3,000 rows.
    with ShmDataLoader(fields, batch_size=32, readers=0, seed=4, shuffle_window=5000) as loader:
        next(loader)
        state = loader.state_dict()
    assert state["shuffle_order"] == "global"
    with ShmDataLoader(fields, batch_size=32, readers=0, seed=4, shuffle_window=5000) as loader:
        loader.load_state_dict(state)
        with pytest.raises(ValueError, match=r"whose order was 'sliding'.*covers the data is the global shuffle"):
            loader.load_state_dict({**state, "shuffle_order": "sliding"})


def test_closing_the_read_ahead_drops_what_it_has_queued():
    """A loader from a store closes without waiting for the window's blocks it had queued
    (seconds of the link each): the request in progress ends, the queued ones are dropped."""
    import threading

    from shmloader.storage.readahead import Advisor

    started, release, fetched = threading.Event(), threading.Event(), []

    class Remote:
        def prefetch(self, offsets, sizes, unit_pages, throttled=True):
            fetched.append(int(offsets[0]))
            started.set()
            release.wait(10)

    class Field:
        remote, unit_pages = Remote(), 1

    advisor = Advisor(8)
    for block in range(5):
        assert advisor.submit("fetch", [(Field, block, 1)])
    assert started.wait(10)
    closing = threading.Thread(target=advisor.close)
    closing.start()
    for _ in range(500):  # Until drained, with the thread's stop request left (5 s at most).
        if advisor._pending.qsize() <= 1:
            break
        closing.join(0.01)
    release.set()
    closing.join(10)
    assert not closing.is_alive() and fetched == [0]


@pytest.mark.parametrize("settings, flag", [({"mode": "sequential"}, "sr"), ({}, "rr"),
                                            ({"shuffle_window": 64}, None)])
def test_the_kernel_is_told_how_each_order_reads_the_mapping(tmp_path, settings, flag):
    """Sequential mode maps its files for reading ahead of each fault (MADV_SEQUENTIAL: the
    mapping's VmFlags show `sr`), the global shuffle for no read-ahead (`rr`), the
    block-local shuffle with the kernel's read-around (neither): /proc's own record."""
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(4096 * 64, dtype=np.int64).reshape(4096, 64))
    with ShmDataLoader({"x": str(path)}, batch_size=32, readers=0, **settings) as loader:
        next(iter(loader)).release()
        with open("/proc/self/smaps") as smaps:
            blocks = smaps.read().split("\n")
        flags = [blocks[index + offset].split(":", 1)[1].split() for index, line in enumerate(blocks)
                 if line.endswith(str(path)) for offset in range(1, 40)
                 if index + offset < len(blocks) and blocks[index + offset].startswith("VmFlags:")][:1]
    assert flags, "the file is not mapped"
    for known in ("sr", "rr"):
        assert (known in flags[0]) == (known == flag), (known, flags[0])


@pytest.mark.parametrize("readers, batch", [(4, 64), (8, 16)])
def test_readers_whose_steps_span_more_places_than_they_read_ahead_still_let_go_of_blocks(readers, batch):
    """Readers filling steps in turn, each reader's next step further on than it asks for
    ahead (small blocks, large batches): each goes on from step to step instead of starting
    afresh at each (which let go of nothing, ever), and between them every finished block
    is let go of once an epoch."""
    sampler = Sampler(5000, batch, "shuffle", 3, shuffle_window=40, block_rows=4)
    ledgers = []
    steps = 3 * sampler.epoch_length // batch
    for index in range(readers):
        ledger = ReadAheadLedger(alone=False)
        read_ahead = block_ids_read_ahead()(sampler, [], 0, advisor=ledger, share=(index, readers))
        read_ahead.release_blocks = True
        assert read_ahead.ahead < readers * batch // sampler.block_rows  # Its steps lie past its read-ahead.
        for step in range(index, steps, readers):
            read_ahead.note(step)
            ledger.settle()
        ledgers.append(ledger)
    dropped = [block for ledger in ledgers for block in ledger.dropped]
    blocks = sampler.length // sampler.block_rows
    assert len(dropped) >= 2 * blocks  # Each epoch's blocks, but for the last steps' (lagging).
    assert all(count <= 3 for count in np.bincount(dropped))  # Once an epoch.
