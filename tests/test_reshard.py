"""Resharding a shuffle window split among shards (reshard.py): a checkpoint of S shards,
each reading its own share of the blocks, continued under another shard count. Every row
of the interrupted epoch comes once across the old and the new run, the next epoch is
whole, a resumed run resumes again, and a finite pass ends where it should. Rows are
counted, not positions: each shard's stream is its own, so only the multiset of rows
delivered says whether an epoch was whole."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from shmloader import ShmDataLoader
from shmloader.plan.reshard import transition_from
from shmloader.plan.sampler import Sampler

ROWS = 1000
WINDOW = 200


@pytest.fixture(scope="module")
def fields(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reshard")
    np.save(directory / "x.npy", np.arange(ROWS, dtype=np.int64))
    return {"x": str(directory / "x.npy")}


def loader(fields, shard, shards, batch, readers=0, **options):
    return ShmDataLoader(fields, batch_size=batch, shard_index=shard, shard_count=shards, readers=readers, seed=3,
                         shuffle_window=WINDOW, **options)


def old_run(fields, shards, batch, steps, **options):
    """Each shard's rows over `steps` steps, and its checkpoint."""
    rows, states = [], []
    for shard in range(shards):
        with loader(fields, shard, shards, batch, **options) as each:
            rows.append([value for _ in range(steps) for value in next(each)["x"].tolist()])
            states.append(each.state_dict())
    return rows, states


def resumed_run(fields, shards, batch, state, readers=0, epochs_after=1, **options):
    """Each new shard's rows from `state`: (its piece of the interrupted epochs, then
    `epochs_after` epochs of its own stream), and its checkpoint at the end; and the epochs
    the old streams complete with the pieces."""
    pieces, later, states = [], [], []
    for shard in range(shards):
        with loader(fields, shard, shards, batch, readers, **options) as each:
            each.load_state_dict(state)
            dealing = each.sampler.dealing  # Only to know where the piece ends; the rows are the batches'.
            wanted = dealing.piece_rows + epochs_after * each.sampler.epoch_length
            got = []
            while len(got) < wanted:
                got += next(each)["x"].tolist()
            pieces.append(got[:dealing.piece_rows])
            later.append(got[dealing.piece_rows:wanted])
            states.append(each.state_dict())
            completed = each.sampler.transition.through_epoch + 1
    return pieces, later, states, completed


def whole_epochs(rows: list, epochs: int) -> None:
    counts = collections.Counter(rows)
    assert len(counts) == ROWS and set(counts.values()) == {epochs}, collections.Counter(counts.values())


@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("before,after", [((2, 16), (3, 16)), ((4, 32), (2, 32)), ((4, 32), (2, 64)), ((1, 24), (2, 8)),
                                          ((3, 20), (1, 20))], ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_a_window_split_among_shards_continues_under_another_shard_count(fields, readers, before, after):
    old, states = old_run(fields, *before, steps=9)
    assert len({state["position"] for state in states}) == 1  # Every shard's checkpoint names one position.
    pieces, later, _, completed = resumed_run(fields, *after, states[-1], readers=readers)
    assert completed == (9 * before[1] - 1) // (ROWS // before[0]) + 1  # The epoch some old shard had begun.
    # The interrupted epoch (and any the old shards completed): every row once each.
    whole_epochs([row for rows in old + pieces for row in rows], completed)
    whole_epochs([row for rows in later for row in rows], 1)  # The next epoch, in the new shards' order.
    # Each new shard reads about its share of what was left.
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_a_resumed_run_resumes_again_under_a_third_shard_count_and_under_its_own(fields):
    old, (original, _) = old_run(fields, 2, 16, steps=10)
    pieces, _, ends, _ = resumed_run(fields, 3, 16, original, epochs_after=0)  # Checkpoints at the pieces' ends.
    with loader(fields, 0, 3, 16) as same:  # Its own shard count: the dealing goes on as it was.
        same.load_state_dict(ends[1])
        assert same.sampler.transition is not None
    whole_epochs([row for group in old + pieces for row in group], 1)
    # A checkpoint of the 3-shard run once every shard is past its piece, continued by 2.
    with loader(fields, 0, 3, 16) as run:
        run.load_state_dict(original)
        first = run.state_dict()["step"]
        end = max(run.sampler.of_shard(j, 3).with_transition(run.sampler.transition).dealing.piece_end_position
                  for j in range(3))
        run.seek(-(-end // 16) + 3)
        state = run.state_dict()
    rows = []
    for shard in range(3):  # What the 3-shard run delivered from its piece's end to that checkpoint.
        with loader(fields, shard, 3, 16) as each:
            each.load_state_dict(original)
            got = [row for step in range(first, state["step"]) for row in next(each)["x"].tolist()]
            rows += got[each.sampler.dealing.piece_rows:]
    third, _, _, completed = resumed_run(fields, 2, 24, state, epochs_after=0)
    assert completed == 2  # The 3-shard streams' epoch 1 (their first after the dealing), completed by 2 shards.
    whole_epochs(rows + [row for group in third for row in group], 1)


def test_a_checkpoint_in_the_middle_of_a_dealing_is_refused_under_yet_another_shard_count(fields):
    _, states = old_run(fields, 2, 16, steps=10)
    with loader(fields, 1, 3, 16) as run:
        run.load_state_dict(states[0])
        next(run)
        state = run.state_dict()
    with loader(fields, 0, 4, 16) as other:
        with pytest.raises(ValueError, match="still dealing the rows an earlier shard count"):
            other.load_state_dict(state)
    with loader(fields, 2, 3, 16) as same:
        same.load_state_dict(state)  # Its own shard count goes on.
        assert next(same).step == state["step"]


def test_a_finite_pass_resharded_ends_with_every_row_of_each_epoch(fields):
    old, states = old_run(fields, 2, 16, steps=40, epochs=2)  # 640 of each shard's ~500-row share epochs.
    rows = [row for group in old for row in group]
    lengths = []
    for shard in range(3):
        with loader(fields, shard, 3, 16, epochs=2) as each:
            each.load_state_dict(states[shard % 2])
            lengths.append(len(each))
            rows += [row for batch in each for row in batch["x"].tolist()]
    whole_epochs(rows, 2)
    assert len(set(lengths)) == 1  # Every shard has the same number of steps (some end with short batches).


def test_a_dealing_keeps_the_interrupted_runs_transform_draws(fields):
    """ctx.rng(i) of a dealt row is keyed as the old run keyed it: the rows of the
    interrupted epoch draw what an uninterrupted run would have drawn for them."""
    options = {"transform": "transform_fixtures:draws_per_row"}
    reference = set()
    for shard in range(2):
        with loader(fields, shard, 2, 16, **options) as each:
            for _ in range(32):  # Past the end of each shard's first share epoch.
                batch = next(each)
                reference.update(zip(batch["x"].tolist(), batch["draw"].tolist()))
    with loader(fields, 0, 2, 16, **options) as early:
        for _ in range(5):
            next(early)
        state = early.state_dict()
    dealt = []
    for shard in range(3):
        with loader(fields, shard, 3, 16, **options) as each:
            each.load_state_dict(state)
            piece, got = each.sampler.dealing.piece_rows, []
            while len(got) < piece:
                batch = next(each)
                got += list(zip(batch["x"].tolist(), batch["draw"].tolist()))
            dealt += got[:piece]
    assert len(dealt) == ROWS - 2 * 5 * 16
    assert set(dealt) <= reference


def test_the_sampler_deals_every_drawn_shape_exactly(fields):
    """The dealing as a pure function, over drawn shapes (data, blocks, windows, shard
    counts and batches before and after, a checkpoint anywhere in the first epochs)."""
    generator = np.random.default_rng(12)
    cases = 0
    while cases < 60:
        length = int(generator.integers(20, 2000))
        block_rows, window = int(generator.integers(1, 50)), int(generator.integers(1, length))
        old_count, new_count = (int(value) for value in generator.integers(1, 6, size=2))
        if old_count == new_count:
            continue
        try:
            for shard in range(max(old_count, new_count)):
                Sampler(length, 1, "shuffle", 0, shard, max(old_count, new_count), window, block_rows)
        except ValueError:
            continue  # More shards than blocks.
        old_batch, new_batch = (int(value) for value in generator.integers(1, 40, size=2))
        steps = int(generator.integers(0, 3 * length // old_batch + 2))
        counts, later = collections.Counter(), collections.Counter()
        for shard in range(old_count):
            old = Sampler(length, old_batch, "shuffle", cases, shard, old_count, window, block_rows)
            for step in range(steps):
                counts.update(old.fill(step).tolist())
        first = steps * old_batch // new_batch
        template = Sampler(length, new_batch, "shuffle", cases, 0, new_count, window, block_rows)
        transition = transition_from(template, [steps * old_batch] * old_count, first * new_batch, None)
        for shard in range(new_count):
            new = Sampler(length, new_batch, "shuffle", cases, shard, new_count, window, block_rows, transition)
            dealing, got, step = new.dealing, [], first
            while len(got) < dealing.piece_rows + new.epoch_length:
                got += new.fill(step).tolist()
                step += 1
            counts.update(got[:dealing.piece_rows])
            later.update(got[dealing.piece_rows:dealing.piece_rows + new.epoch_length])
        epochs = transition.through_epoch + 1
        assert (not counts and epochs == 0) or (len(counts) == length and set(counts.values()) == {epochs})
        assert len(later) == length and set(later.values()) == {1}
        cases += 1


def test_a_windowed_mixture_continues_its_position_under_another_shard_count(fields, tmp_path):
    """A mixture's shards share one global stream: no dealing (an outside attack found it
    sent to the dealing, which mixtures do not have)."""
    from shmloader import Source

    np.save(tmp_path / "small.npy", np.arange(ROWS, ROWS + 300, dtype=np.int64))
    sources = [Source(fields, weight=3), Source({"x": str(tmp_path / "small.npy")}, weight=1)]
    with loader(sources, 0, 2, 16) as before:
        for _ in range(5):
            next(before)
        state = before.state_dict()
    with loader(sources, 0, 3, 16) as after:
        after.load_state_dict(state)
        assert after.sampler.transition is None and after.state_dict()["position"] == state["position"]


def test_a_refused_checkpoint_changes_nothing(fields):
    """The new sampler, its pass and the step are all checked before readers are replaced:
    a load that raises leaves the loader as it was (it was left with the dealing's sampler
    and no slot requested)."""
    _, states = old_run(fields, 2, 16, steps=3)
    state = dict(states[0], step=1 << 59, position=(1 << 59) * 16)  # Past the last step 3 shards can compute.
    for readers in (0, 1):
        with loader(fields, 0, 3, 16, readers) as each, loader(fields, 0, 3, 16, readers) as fresh:
            with pytest.raises(ValueError, match="step"):
                each.load_state_dict(state)
            assert each.sampler.transition is None and each.state_dict() == fresh.state_dict()
            assert next(each)["x"].tolist() == next(fresh)["x"].tolist()


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_finished_pass_stays_finished_under_another_shard_count(fields, drop_last):
    """The last checkpoint of a pass, resharded or not, under other shapes: no step left
    (before, a larger batch was refused as 'drop_last drops it', a pass that ended during
    its dealing was refused as 'still dealing', and a drop_last pass dealt its dropped rows)."""
    options = {"epochs": 1, "drop_last": drop_last}
    _, states = old_run(fields, 2, 16, steps=10, **options)
    ended = []
    for shard in range(3):  # Resharded, then run to the end of the pass.
        with loader(fields, shard, 3, 16, **options) as each:
            each.load_state_dict(states[shard % 2])
            assert sum(1 for _ in each) or drop_last
            ended.append(each.state_dict())
    with loader(fields, 0, 2, 16, **options) as before:
        assert sum(1 for _ in before)
        ended.append(before.state_dict())
    for state in ended:
        for shards, batch in ((2, 16), (4, 16), (1, 300), (2, 300)):
            with loader(fields, 0, shards, batch, **options) as after:
                after.load_state_dict(state)
                with pytest.raises(RuntimeError, match="has ended"):
                    iter(after)


def test_the_end_of_a_pass_under_a_batch_larger_than_its_position(fields):
    """4 shards of 64 to the end of one epoch (position 256), then 2 shards of 300: the pass
    has ended (it was refused as 'the pass holds 0 positions ... drop_last=True drops it',
    without drop_last)."""
    _, states = old_run(fields, 4, 64, steps=4, epochs=1)
    with loader(fields, 1, 2, 300, epochs=1) as after:
        after.load_state_dict(states[3])
        with pytest.raises(RuntimeError, match="has ended"):
            iter(after)


hypothesis = pytest.importorskip("hypothesis")
from conftest import examples  # noqa: E402
from hypothesis import assume, example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@examples(15)
@example(rows=8, window=None, batch=1, old=1, new=3, new_batch=3, resume=1.0, epochs=1)  # Found by the suite.
@example(rows=34, window=16, batch=16, old=2, new=2, new_batch=1, resume=0.5, epochs=1)  # Streams of 18 and 16 rows.
@example(rows=8, window=None, batch=1, old=1, new=3, new_batch=3, resume=0.75, epochs=1)  # 2 rows left, 3 shards.
@example(rows=8, window=1, batch=1, old=1, new=3, new_batch=2, resume=0.75, epochs=1)  # The tail reached before it.
@given(rows=st.integers(8, 300), window=st.one_of(st.none(), st.integers(1, 299)), batch=st.integers(1, 24),
       old=st.integers(1, 4), new=st.integers(1, 4), new_batch=st.integers(1, 24), resume=st.floats(0, 1),
       epochs=st.integers(1, 2))
def test_a_resharded_resume_gives_no_rank_an_empty_batch(tmp_path_factory, rows, window, batch, old, new, new_batch,
                                                         resume, epochs):
    """Drawn data, window (or none), shapes before and after, a checkpoint anywhere in a
    finite pass: after the resume every rank gets the same number of steps and rows in each
    (before: ranks whose part of the resumed step lay before the position, or whose stream
    ended first, got empty batches: a NaN loss in DDP); every row of the pass comes its
    epochs' times across both runs among the rows not marked padding (before: but for fewer
    rows than ranks, left out where they could not be dealt)."""
    directory = tmp_path_factory.mktemp("empty")
    np.save(directory / "x.npy", np.arange(rows, dtype=np.int64))
    fields = {"x": str(directory / "x.npy")}
    options = dict(readers=0, seed=rows, epochs=epochs, shuffle_window=window if window and window < rows else None)

    def shard_loader(shard, shards, size):
        return ShmDataLoader(fields, batch_size=size, shard_index=shard, shard_count=shards, **options)

    counts = collections.Counter()
    try:
        with shard_loader(0, max(old, new), 1):
            pass  # Every shard of either count has rows.
        runs = []
        for shard in range(old):
            with shard_loader(shard, old, batch) as each:
                steps = int(resume * len(each))
                runs.append([row for _, got in zip(range(steps), each) for row in got["x"][~got.padding].tolist()])
                state = each.state_dict()
    except ValueError as error:
        assume("gets no rows" not in str(error) and "nothing to deliver" not in str(error))
        raise
    for rows_of_shard in runs:
        counts.update(rows_of_shard)
    lengths = set()
    for shard in range(new):
        with shard_loader(shard, new, new_batch) as each:
            try:
                each.load_state_dict(state)
            except ValueError as error:  # Within its pass's dealt tail: it continues only in its own shape.
                assert "within the last" in str(error) and (old, batch) != (new, new_batch)
                return
            ended = each.state_dict()["step"] >= len(each)  # The checkpoint's pass had ended: so has this one.
            sizes = [] if ended else [len(got["x"]) for got in each
                                      if counts.update(got["x"][~got.padding].tolist()) or True]
            assert all(sizes), ("an empty batch", shard, sizes)
            lengths.add(len(sizes))
    assert len(lengths) <= 1, lengths  # The same number of steps on every rank.
    assert set(counts.values()) == {epochs} and len(counts) == rows, counts
