"""A checkpoint is checked whole before a loader continues it: a resharded checkpoint's
`transition` block against the checkpoint's own step, position, shard counts and the
origin it records, and every scalar setting for its type, each refused by name; genuine
checkpoints still load and give exact passes."""

from __future__ import annotations

import collections
import copy

import numpy as np
import pytest

from shmloader import ShmDataLoader

ROWS = 1000
WINDOW = 200
EPOCHS = 2


@pytest.fixture(scope="module")
def fields(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoint_checks")
    np.save(directory / "x.npy", np.arange(ROWS, dtype=np.int64))
    return {"x": str(directory / "x.npy")}


def loader(fields, shard, shards, batch=16, **options):
    return ShmDataLoader(fields, batch_size=batch, shard_index=shard, shard_count=shards, readers=0, seed=3,
                         shuffle_window=WINDOW, epochs=EPOCHS, **options)


@pytest.fixture(scope="module")
def resharded(fields):
    """Rows 2 shards delivered in 10 steps, and the checkpoint of a 3-shard run that
    continued them (its transition) after one step of its own, with the rows of that step."""
    old = collections.Counter()
    for shard in range(2):
        with loader(fields, shard, 2) as each:
            for _ in range(10):
                old.update(next(each)["x"].tolist())
            state = each.state_dict()
    first, states = collections.Counter(), []
    for shard in range(3):
        with loader(fields, shard, 3) as each:
            each.load_state_dict(state)
            first.update(next(each)["x"].tolist())
            states.append(each.state_dict())
    assert states[0]["transition"] is not None
    return old + first, states


def rest_of_pass(fields, states) -> collections.Counter:
    rows = collections.Counter()
    for shard, state in enumerate(states):
        with loader(fields, shard, 3) as each:
            each.load_state_dict(state)
            for batch in each:
                rows.update(batch["x"].tolist())
    return rows


def test_a_genuine_resharded_checkpoint_loads_and_its_pass_is_exact(fields, resharded):
    before, states = resharded
    rows = before + rest_of_pass(fields, states)
    assert len(rows) == ROWS and set(rows.values()) == {EPOCHS}


def tampered(state: dict, key: str, value) -> dict:
    """`state` with transition[key] set to `value` (removed where `value` is KeyError)."""
    state = copy.deepcopy(state)
    if key == "(whole)":
        del state["transition"]
    elif value is KeyError:
        del state["transition"][key]
    else:
        state["transition"][key] = value
    return state


TAMPERED = [
    ("through_epoch", 50), ("through_epoch", -1), ("through_epoch", 1), ("through_epoch", "0"),
    ("positions", [0, 0]), ("positions", [10 ** 9, 10 ** 9]), ("positions", [150, 160]), ("positions", [160]),
    ("positions", [160, 160, 160]), ("positions", [160.0, 160]),
    ("start", 0), ("start", 10 ** 9), ("start", 144), ("start", 176), ("start", True),
    ("shard_count", 3), ("shard_count", 1), ("shard_count", 0),
    ("through_epoch", KeyError), ("positions", KeyError), ("start", KeyError), ("shard_count", KeyError),
    ("origin", KeyError), ("origin", None), ("(whole)", None),
]


@pytest.mark.parametrize("key,value", TAMPERED, ids=[f"{key}={value!r}" for key, value in TAMPERED])
def test_a_tampered_transition_is_refused_by_name(fields, resharded, key, value):
    """Before, each of these loaded (an outside attack: a 2-epoch pass then delivered rows
    0 to 3 times, or ran ~10^8 steps)."""
    _, states = resharded
    state = tampered(states[0], key, value)
    with loader(fields, 0, 3) as each, loader(fields, 0, 3) as fresh:
        with pytest.raises(ValueError, match="transition"):
            each.load_state_dict(state)
        assert each.sampler.transition is None and each.state_dict() == fresh.state_dict()  # Nothing changed.


ORIGIN_TAMPERED = [("position", 0), ("position", 10 ** 6), ("position", -1), ("shard_count", 3), ("shard_count", 5),
                   ("batch_size", 100), ("batch_size", 0), ("transition", {"shard_count": 2}), ("extra", 1)]


@pytest.mark.parametrize("key,value", ORIGIN_TAMPERED, ids=[f"{key}={value!r}" for key, value in ORIGIN_TAMPERED])
def test_a_transition_whose_origin_deals_otherwise_is_refused(fields, resharded, key, value):
    _, states = resharded
    state = copy.deepcopy(states[0])
    state["transition"]["origin"][key] = value
    with loader(fields, 0, 3) as each:
        with pytest.raises(ValueError, match="transition"):
            each.load_state_dict(state)


def test_a_checkpoint_before_its_dealings_first_step_is_refused(fields, resharded):
    """A position before the dealing's start was never delivered by the run that dealt it."""
    _, states = resharded
    state = dict(states[0], step=3, position=48)
    with loader(fields, 0, 3) as each:
        with pytest.raises(ValueError, match="transition.start"):
            each.load_state_dict(state)


hypothesis = pytest.importorskip("hypothesis")
from conftest import examples  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@examples(40)
@given(key=st.sampled_from(["through_epoch", "start", "shard_count", "positions"]),
       delta=st.integers(-10 ** 6, 10 ** 6).filter(bool), index=st.integers(0, 1))
def test_any_changed_value_of_a_transition_is_refused(fields, resharded, key, delta, index):
    _, states = resharded
    state = copy.deepcopy(states[0])
    if key == "positions":
        state["transition"]["positions"][index] += delta
    else:
        state["transition"][key] += delta
    with loader(fields, 0, 3) as each:
        with pytest.raises(ValueError, match="transition"):
            each.load_state_dict(state)


# Scalar settings of a checkpoint: each of the wrong types or ranges a hand-edited or
# foreign checkpoint may hold, refused naming the key and what was expected (before: a
# raw TypeError from a comparison, or a float step taken as an int).
SCALARS = [("step", "7"), ("step", 7.0), ("step", True), ("step", -1), ("step", None),
           ("position", "16"), ("position", -16), ("position", 16.5), ("position_kind", "rows"),
           ("batch_size", 0), ("batch_size", 16.0), ("batch_size", "16"), ("shard_count", 0), ("shard_count", False),
           ("shard_index", -1), ("shard_index", 2), ("length", 1000.0), ("seed", -3), ("seed", "3"),
           ("mode", 1), ("shuffle_window", 0), ("shuffle_window", "200"), ("block_rows", 0), ("epochs", 0),
           ("epochs", "2"), ("drop_last", 0), ("drop_last", "no")]


@pytest.mark.parametrize("key,value", SCALARS, ids=[f"{key}={value!r}" for key, value in SCALARS])
def test_a_scalar_of_the_wrong_type_or_range_is_refused_naming_it(fields, key, value):
    with ShmDataLoader(fields, batch_size=16, shard_index=1, shard_count=2, readers=0, seed=3, epochs=1) as each:
        next(each)
        state = dict(each.state_dict(), **{key: value})
        with pytest.raises(ValueError, match=f"checkpoint's {key} "):
            each.load_state_dict(state)


def test_a_checkpoint_inside_a_dealt_tail_resumes_in_its_own_shape_only(fields):
    """The last steps of a pass deal the shards' rows evenly (plan/passes.py): a checkpoint
    inside them resumes exactly under its own shape and is refused, naming why, under
    another (no single position says which rows are left)."""
    options = dict(readers=0, seed=3, shuffle_window=WINDOW, epochs=1)
    with ShmDataLoader(fields, batch_size=4, shard_count=3, **options) as probe:
        tail = probe.finite.tail
    assert tail.steps >= 2  # Shares of 350, 325 and 325 rows: 28 rows left after step 81, over 3 steps.
    rows, states = collections.Counter(), []
    for shard in range(3):
        with ShmDataLoader(fields, batch_size=4, shard_index=shard, shard_count=3, **options) as each:
            for _, got in zip(range(tail.first_step + 1), each):
                rows.update(got["x"].tolist())
            states.append(each.state_dict())
    with ShmDataLoader(fields, batch_size=4, shard_count=2, **options) as other:
        with pytest.raises(ValueError, match="within the last 3 steps of its pass"):
            other.load_state_dict(states[0])
    for shard in range(3):
        with ShmDataLoader(fields, batch_size=4, shard_index=shard, shard_count=3, **options) as each:
            each.load_state_dict(states[shard])
            sizes = [len(got["x"]) for got in each if rows.update(got["x"].tolist()) or True]
            assert len(sizes) == tail.steps - 1 and min(sizes) >= 1
    assert len(rows) == ROWS and set(rows.values()) == {1}


@pytest.mark.parametrize("edit", [{"step": 1}, {"step": -1}, {"position": 16}, {"position": -16}])
def test_a_step_and_position_that_disagree_are_refused_under_the_same_settings(fields, edit):
    """Under the same batch size and shard count the step alone used to be read, so an
    edited step skipped rows (or repeated them) where the position said otherwise."""
    with loader(fields, 0, 1) as first:
        for _ in range(9):
            next(first)
        state = first.state_dict()
    edited = {**state, **{key: state[key] + delta for key, delta in edit.items()}}
    with loader(fields, 0, 1) as resumed, pytest.raises(ValueError, match="disagree"):
        resumed.load_state_dict(edited)
    with loader(fields, 0, 1) as resumed:  # The checkpoint as it was still loads.
        resumed.load_state_dict(copy.deepcopy(state))
        next(resumed)
