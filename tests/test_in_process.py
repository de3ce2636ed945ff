"""readers=0: the trainer fills each step itself, with the same StepFiller as reader
processes, so its batches equal theirs for every field kind, mixtures and transforms;
nothing is started, and a transform's exception reaches the caller as raised."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import assert_same, batches, declarations

from shmloader import ShmDataLoader, Source
from shmloader.transforms import TransformError, compute_batch


@pytest.mark.parametrize("kind", ["rows npy", "rows b2nd", "many files", "padded", "packed", "windows"])
def test_in_process_batches_equal_reader_batches_for_every_field_kind(kinds, kind):
    fields = declarations(kinds)[kind]
    in_process = batches(fields, 0)
    assert_same(in_process, batches(fields, 1))
    assert_same(in_process, batches(fields, 4))


def test_in_process_mixtures_and_windows_equal_readers(kinds):
    mixture = [Source({"x": str(kinds / "rows.npy")}, weight=3), Source({"x": str(kinds / "part1.npy")}, weight=1)]
    in_process = batches(mixture, 0)
    assert {int(x) for batch in in_process for x in batch["source"]} == {0, 1}
    assert_same(in_process, batches(mixture, 2))
    windowed = {"x": str(kinds / "rows.npy")}
    assert_same(batches(windowed, 0, shuffle_window=64), batches(windowed, 3, shuffle_window=64))
    assert_same(batches(mixture, 0, shuffle_window=64), batches(mixture, 2, shuffle_window=64))


def test_in_process_transform_runs_in_this_process_and_equals_readers(kinds):
    fields = {"data": str(kinds / "data.npy")}
    in_process = batches(fields, 0, transform="transform_fixtures:records_pid")
    assert all((batch["pid"] == os.getpid()).all() for batch in in_process)
    with_readers = batches(fields, 2, transform="transform_fixtures:records_pid")
    assert all((batch["pid"] != os.getpid()).all() for batch in with_readers)
    for one, other in zip(in_process, with_readers):
        np.testing.assert_array_equal(one["x"], other["x"])
        np.testing.assert_array_equal(one["indices"], other["indices"])
    scaled = batches(fields, 0, transform="transform_fixtures:scaled")
    for batch in scaled[:3]:
        reference = compute_batch(fields, batch["step"], "transform_fixtures:scaled", batch_size=16, seed=7)
        for name in ("x", "noise", "position", "draw", "indices"):
            np.testing.assert_array_equal(batch[name], reference[name])


def test_in_process_transform_errors_raise_here_with_their_type_and_the_step_is_retried(kinds):
    fields = {"data": str(kinds / "data.npy")}
    with ShmDataLoader(fields, readers=0, batch_size=16, mode="sequential",
                       transform="transform_fixtures:fails_on_row_seven") as loader:
        with pytest.raises(ValueError, match="row seven is cursed") as caught:
            next(loader)
        assert isinstance(caught.value, TransformError) and isinstance(caught.value.__cause__, ValueError)
        assert "step 0" in str(caught.value)
        with pytest.raises(ValueError, match="row seven"):  # The same step again: not skipped, not wrong.
            next(loader)
        loader.seek(1)
        assert next(loader).step == 1


def test_in_process_resume_seek_and_held_batches(kinds):
    fields = {"x": str(kinds / "rows.npy")}
    reference = batches(fields, 0, steps=20)
    with ShmDataLoader(fields, readers=0, batch_size=16, seed=7, start_step=5) as loader:
        kept = [next(loader) for _ in range(2)]  # Two held batches: the default ring has room.
        assert [batch.step for batch in kept] == [5, 6]
        np.testing.assert_array_equal(kept[0]["x"], reference[5]["x"])
        del kept
        state = loader.state_dict()
        loader.seek(15)
        np.testing.assert_array_equal(next(loader)["x"], reference[15]["x"])
        loader.load_state_dict(state)
        np.testing.assert_array_equal(next(loader)["x"], reference[7]["x"])
        assert loader.stats()["batches"] == 4
