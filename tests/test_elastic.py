"""Elastic resume: a checkpoint taken under one (shard_count, batch_size) continues under
another from the global position it names. Every row of the interrupted epoch comes once
across the old and new runs, the next epoch is whole, any shard's checkpoint names the
same position, a resumed run resumes again, mixtures and finite passes too. A window split
among shards under another shard count: test_reshard.py."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from shmloader import ShmDataLoader, Source

ROWS = 1000


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    directory = tmp_path_factory.mktemp("elastic")
    np.save(directory / "x.npy", np.arange(ROWS, dtype=np.int64))
    np.save(directory / "small.npy", np.arange(ROWS, ROWS + 300, dtype=np.int64))
    return {"x": str(directory / "x.npy")}, str(directory / "small.npy")


def run(fields, shards: int, batch: int, steps: int, readers: int, state=None, **options):
    """Every shard of a run for `steps` steps: {global position: row} of what it delivered,
    and each shard's checkpoint at the end. A resumed run's stream is shifted so that its
    first step starts at the checkpoint's position (no step is cut, no batch empty)."""
    delivered, states = {}, []
    for shard in range(shards):
        with ShmDataLoader(fields, batch_size=batch, shard_index=shard, shard_count=shards, readers=readers, seed=5,
                           **options) as loader:
            if state is not None:
                loader.load_state_dict(state)
            for batch_data in (next(loader) for _ in range(steps)):
                values = batch_data["x"].tolist()
                # The sampler's stream position: a resumed run's stream is shifted to start at its position.
                start = loader.sampler.stream_position(batch_data.step) + batch - len(values)
                for offset, value in enumerate(values):
                    assert start + offset not in delivered
                    delivered[start + offset] = value
            states.append(loader.state_dict())
    return delivered, states


def check_epochs(delivered: dict, epochs: int) -> None:
    """Positions [0, epochs * ROWS) were all delivered, each epoch every row once."""
    for epoch in range(epochs):
        rows = [delivered.get(position) for position in range(epoch * ROWS, (epoch + 1) * ROWS)]
        assert None not in rows, f"epoch {epoch}: {rows.count(None)} positions never delivered"
        assert sorted(rows) == list(range(ROWS)), f"epoch {epoch}: rows repeated or missing"


@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("after", [(2, 32), (2, 64), (3, 20), (5, 7)], ids=lambda value: f"{value[0]}x{value[1]}")
def test_four_shards_of_32_continue_under_other_shard_counts_and_batch_sizes(rows, readers, after):
    fields, _ = rows
    before, states = run(fields, 4, 32, 5, 0 if readers == 3 else readers)  # 640 positions delivered.
    assert {state["position"] for state in states} == {640}  # Any shard's checkpoint names it.
    shards, batch = after
    steps = -(-(2 * ROWS - 640) // (shards * batch)) + 1
    continued, _ = run(fields, shards, batch, steps, readers, state=states[0])
    assert not set(before) & set(continued)
    check_epochs({**before, **continued}, 2)


def test_a_resumed_run_resumes_again_and_a_same_shape_resume_is_the_old_path(rows):
    fields, _ = rows
    first, states = run(fields, 4, 32, 3, 0)               # to 384
    second, states = run(fields, 3, 50, 2, 0, states[1])    # 2 whole steps from 384 (shifted): to 684
    assert {state["position"] for state in states} == {684}
    third, states = run(fields, 2, 64, 12, 0, states[2])    # 684 on, across the epoch end
    check_epochs({**first, **second, **third}, 2)
    with ShmDataLoader(fields, batch_size=64, shard_index=1, shard_count=2, readers=0, seed=5) as loader:
        loader.load_state_dict(states[1])  # Its own shape: the same shifted stream, no step cut.
        assert len(next(loader)["x"]) == 64


def test_a_checkpoint_taken_before_a_resumed_first_step_names_the_resumed_position(rows):
    fields, _ = rows
    _, states = run(fields, 4, 32, 5, 0)  # 640
    with ShmDataLoader(fields, batch_size=100, shard_count=1, readers=0, seed=5) as loader:
        loader.load_state_dict(states[0])
        assert loader.state_dict()["position"] == 640  # Not 600, the start of step 6.
        assert len(next(loader)["x"]) == 100  # Step 6 of the stream shifted to start at 640: whole.
        assert loader.state_dict()["position"] == 740


@pytest.mark.parametrize("readers", [0, 2])
def test_a_mixture_continues_under_another_shard_count(rows, readers):
    fields, small = rows
    sources = lambda: [Source(fields, weight=3), Source({"x": small}, weight=1)]
    counts = collections.Counter()

    def deliver(shards, batch, steps, state=None):
        result = []
        for shard in range(shards):
            with ShmDataLoader(sources(), batch_size=batch, shard_index=shard, shard_count=shards, readers=readers,
                               seed=2) as loader:
                if state is not None:
                    loader.load_state_dict(state)
                for _ in range(steps):
                    counts.update(next(loader)["x"].tolist())
                result.append(loader.state_dict())
        return result

    states = deliver(4, 16, 6)                                    # 384 positions: 288 of x, 96 of small
    deliver(3, 16, -(-(1200 - 384) // 48), states[0])             # from 384 up to position 1200
    # Positions [0, 1200) of the mixture stream: 900 draws of x (the first 900 of its first
    # shuffled epoch: 900 rows once) and 300 of small (its whole first epoch: each row once).
    assert [counts[value] for value in range(ROWS, ROWS + 300)] == [1] * 300
    assert sum(counts[value] for value in range(ROWS)) == 900 and max(counts[value] for value in range(ROWS)) == 1


def test_a_finite_pass_continues_with_the_rows_it_has_left(rows):
    fields, _ = rows
    delivered = collections.Counter()
    with ShmDataLoader(fields, batch_size=32, shard_index=0, shard_count=1, readers=0, seed=5, epochs=1) as loader:
        for _ in range(10):
            delivered.update(next(loader)["x"].tolist())
        state = loader.state_dict()
    with ShmDataLoader(fields, batch_size=100, readers=0, seed=5, epochs=1) as loader:
        loader.load_state_dict(state)
        assert len(loader) == 10 and loader.state_dict()["step"] == 3  # Steps 3..9 of the new numbering remain.
        for batch in loader:
            delivered.update(batch["x"].tolist())
    assert sorted(delivered) == list(range(ROWS)) and set(delivered.values()) == {1}


def test_a_finished_pass_checkpoint_resumes_as_finished(rows):
    fields, _ = rows
    with ShmDataLoader(fields, batch_size=64, readers=0, seed=5, epochs=1) as loader:
        assert sum(1 for _ in loader) == 16
        state = loader.state_dict()
    with ShmDataLoader(fields, batch_size=100, readers=0, seed=5, epochs=1) as loader:
        loader.load_state_dict(state)  # Position 1,000: the pass's end, step 10 of 10 here.
        assert loader.state_dict()["step"] == len(loader) == 10
        with pytest.raises(RuntimeError, match="has ended"):
            next(iter(loader))


def test_a_windowed_loader_whose_shards_read_their_own_blocks_continues_another_batch_size(rows):
    """Another batch size under the same shards continues each shard's own stream; another
    shard count deals the rows left (test_reshard.py)."""
    fields, _ = rows
    with ShmDataLoader(fields, batch_size=16, shard_index=0, shard_count=2, shuffle_window=200, readers=0) as loader:
        next(loader)
        state = loader.state_dict()
    with ShmDataLoader(fields, batch_size=8, shard_index=0, shard_count=2, shuffle_window=200, readers=0) as loader:
        loader.load_state_dict(state)
        assert loader.state_dict()["position"] == 16 and loader.sampler.transition is None


hypothesis = pytest.importorskip("hypothesis")
from conftest import examples  # noqa: E402
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st


@examples(30)
@example(before=(1, 1), after=(2, 1), steps=1, mode="shuffle", seed=0, finite=True)  # One row and one repeat.
@given(before=st.tuples(st.integers(1, 5), st.integers(1, 40)), after=st.tuples(st.integers(1, 5), st.integers(1, 40)),
       steps=st.integers(0, 30), mode=st.sampled_from(["shuffle", "sequential"]), seed=st.integers(0, 1000),
       finite=st.booleans())
def test_any_resharding_delivers_each_row_of_the_epoch_once(rows, before, after, steps, mode, seed, finite):
    """Drawn shapes before and after, checkpoint anywhere (even past the epoch's end), the
    pass endless or of two epochs: positions [0, 2 * ROWS) are delivered exactly once. A
    finite pass's last steps deal their rows evenly among the shards (passes.py), so there
    rows are counted (each twice, among the rows not marked padding), not positions; no
    batch is empty."""
    fields, _ = rows
    options = {"mode": mode, "epochs": 2} if finite else {"mode": mode}
    (shards, batch), (new_shards, new_batch) = before, after
    delivered, counts, states = {}, collections.Counter(), []
    for run_shards, run_batch, run_steps, state in ((shards, batch, steps, None),
                                                    (new_shards, new_batch, None, "resume")):
        resumed = states[0] if state else None
        states = []
        for shard in range(run_shards):
            with ShmDataLoader(fields, batch_size=run_batch, shard_index=shard, shard_count=run_shards, readers=0,
                               seed=seed, **options) as loader:
                if resumed is not None:
                    try:
                        loader.load_state_dict(resumed)
                    except ValueError as error:  # A checkpoint within its pass's dealt tail keeps its shape.
                        assert finite and "within the last" in str(error)
                        return
                count = run_steps if run_steps is not None else (
                    len(loader) - loader.state_dict()["step"] if finite else
                    -(-(2 * ROWS - resumed["position"]) // (run_shards * run_batch)) + 1)
                for _ in range(max(0, count)):
                    try:
                        got = next(loader)
                    except StopIteration:
                        break
                    values = got["x"][~got.padding].tolist()
                    assert len(got["x"]) or not finite, ("an empty batch", got.step)
                    counts.update(values)
                    start = loader.sampler.stream_position(got.step)  # Shifted to the resumed position.
                    assert resumed is None or start >= resumed["position"]
                    for offset, value in enumerate(values):
                        assert start + offset not in delivered, (start + offset, "twice")
                        delivered[start + offset] = value
                states.append(loader.state_dict())
    if finite:  # Where fewer rows than shards are left, a tail repeats one, marked padding (passes.py).
        assert set(counts.values()) == {2} and len(counts) == ROWS, counts
        return
    for epoch in range(2):  # Sequential or shuffled, an epoch is every row once.
        epoch_rows = [delivered.get(position) for position in range(epoch * ROWS, (epoch + 1) * ROWS)]
        assert None not in epoch_rows and sorted(epoch_rows) == list(range(ROWS)), epoch


def test_a_windowed_shards_rows_keep_their_transform_draws_under_another_batch_size(rows):
    """ctx.rng(i) is keyed by the row's stream position: before, where each shard reads its
    own stream it was keyed by a formula of batch_size, and 8 of 32 rows drew differently
    after a resume under another batch size."""
    fields, _ = rows
    options = dict(seed=4, readers=0, shuffle_window=80, shard_count=2, shard_index=0,
                   transform="transform_fixtures:draws_per_row")

    def run_rows(batch, steps, state=None):
        with ShmDataLoader(fields, batch_size=batch, **options) as loader:
            if state is not None:
                loader.load_state_dict(state)
            got = []
            for _ in range(steps):
                batch_data = next(loader)
                got += list(zip(batch_data["x"].tolist(), batch_data["draw"].tolist()))
            return got, loader.state_dict()

    reference, _ = run_rows(8, 4)
    first, state = run_rows(8, 2)
    rest, _ = run_rows(4, 4, state)
    assert first + rest == reference


def test_a_checkpoint_past_the_end_of_its_pass_ends_the_pass_under_another_shape(rows):
    """5 shards of 21 for 20 steps run past a 2-epoch pass (2,100 of 2,000 positions): under
    1 shard of 1 the pass has ended (the load's step check refused it as step 2100 > 2000)."""
    fields, _ = rows
    with ShmDataLoader(fields, batch_size=21, shard_index=0, shard_count=5, readers=0, seed=0, epochs=2) as before:
        before.seek(20)
        state = before.state_dict()
    with ShmDataLoader(fields, batch_size=1, shard_index=0, shard_count=1, readers=0, seed=0, epochs=2) as after:
        after.load_state_dict(state)
        with pytest.raises(RuntimeError, match="has ended"):
            iter(after)
