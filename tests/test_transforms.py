"""Transforms in the readers: outputs equal a one-process reference, augmentation is a pure
function of (seed, global position, transform name), and errors name what went wrong."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmloader import ReaderError, ShmDataLoader, Source
from shmloader.tools.convert import write_ragged
from shmloader.transforms import (
    TransformError,
    batch_rng,
    check_determinism,
    compute_batch,
    sample_rng,
)

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "transform_fixtures:scaled"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    directory = tmp_path_factory.mktemp("transform_rows")
    data = np.arange(300 * 4, dtype=np.float32).reshape(300, 4)
    np.save(directory / "data.npy", data)
    np.save(directory / "label.npy", np.arange(300, dtype=np.int64))
    return str(directory / "data.npy"), data


def expected_scaled(data, indices, step, seed, batch_size, shard_index=0, shard_count=1, scale=3):
    """The specification, spelled out: x from the rows; noise from sample i's generator keyed
    by (seed, global position, name); draw from the step's generator."""
    first = (step * shard_count + shard_index) * batch_size
    positions = np.arange(first, first + batch_size, dtype=np.uint64)
    noise = np.stack([sample_rng(seed, int(p), NAME).integers(0, 1 << 40, 3) for p in positions])
    draw = np.full(batch_size, batch_rng(seed, step, NAME).integers(0, 1 << 40))
    return {"x": data[indices] * scale, "noise": noise, "position": positions, "draw": draw}


@pytest.mark.parametrize("readers", [1, 2, 4])
def test_outputs_equal_the_reference_for_any_reader_count(rows, readers):
    path, data = rows
    with ShmDataLoader({"data": path}, transform=NAME, transform_args={"scale": 3}, batch_size=16, readers=readers,
                       seed=5) as loader:
        assert loader.field_names == ("x", "noise", "position", "draw")  # The input never enters the slot.
        for step, batch in zip(range(25), loader):
            assert batch.step == step
            expected = expected_scaled(data, batch.indices, step, 5, 16)
            for name, array in expected.items():
                np.testing.assert_array_equal(batch[name], array, err_msg=f"{name} of step {step}")
            reference = compute_batch({"data": path}, step, NAME, {"scale": 3}, batch_size=16, seed=5)
            np.testing.assert_array_equal(batch.indices, reference["indices"])
            np.testing.assert_array_equal(batch["noise"], reference["noise"])


def test_a_samples_augmentation_does_not_depend_on_the_shard_count(rows):
    """Two shards of 8 give exactly the rows and augmentations of one shard of 16."""
    path, _ = rows
    whole = {}
    with ShmDataLoader({"data": path}, transform=NAME, transform_args={"scale": 3}, batch_size=16, readers=2) as loader:
        for step, batch in zip(range(6), loader):
            whole[step] = {name: np.array(batch[name]) for name in ("x", "noise", "position")}
    halves = {}
    for shard in (0, 1):
        with ShmDataLoader({"data": path}, transform=NAME, transform_args={"scale": 3}, batch_size=8, readers=1,
                           shard_index=shard, shard_count=2) as loader:
            for step, batch in zip(range(6), loader):
                halves[step, shard] = {name: np.array(batch[name]) for name in ("x", "noise", "position")}
    for step in range(6):
        for name in ("x", "noise", "position"):
            joined = np.concatenate([halves[step, 0][name], halves[step, 1][name]])
            np.testing.assert_array_equal(joined, whole[step][name], err_msg=f"{name} of step {step}")


def test_resume_gives_the_identical_augmented_batches(rows):
    path, _ = rows
    options = dict(transform=NAME, transform_args={"scale": 3}, batch_size=16, readers=2, seed=9)
    with ShmDataLoader({"data": path}, **options) as loader:
        first = [{name: np.array(array) for name, array in batch.items()} for _, batch in zip(range(12), loader)]
    with ShmDataLoader({"data": path}, **options) as loader:
        for _, batch in zip(range(7), loader):
            pass
        del batch
        state = loader.state_dict()
    with ShmDataLoader({"data": path}, **options) as loader:
        loader.load_state_dict(state)
        for expected, batch in zip(first[7:], loader):
            for name, array in expected.items():
                np.testing.assert_array_equal(batch[name], array)
    with ShmDataLoader({"data": path}, **{**options, "transform_args": {"scale": 2}}) as loader:
        with pytest.raises(ValueError, match="transform"):
            loader.load_state_dict(state)


def test_ragged_records_reach_the_transform_as_arrays(tmp_path):
    rng = np.random.default_rng(3)
    documents = [rng.integers(1, 1000, size=rng.integers(1, 40)).astype(np.int32) for _ in range(120)]
    write_ragged(tmp_path / "docs", documents)
    with ShmDataLoader({"tokens": str(tmp_path / "docs")}, transform="transform_fixtures:summarise", batch_size=8,
                       readers=2) as loader:
        for _, batch in zip(range(20), loader):
            for i, row in enumerate(batch.indices.tolist()):
                document = documents[row]
                assert (batch["total"][i], batch["length"][i], batch["first"][i]) == \
                    (document.sum(), document.size, document[0])


def test_a_mixture_with_a_transform_gives_the_sources(rows, tmp_path):
    path, data = rows
    np.save(tmp_path / "other.npy", -data[:100])
    sources = [Source({"data": path}, weight=3), Source({"data": str(tmp_path / "other.npy")}, weight=1)]
    with ShmDataLoader(sources, transform=NAME, transform_args={"scale": 3}, batch_size=16, readers=2) as loader:
        for _, batch in zip(range(5), loader):
            assert np.bincount(batch["source"], minlength=2).tolist() == [12, 4]
            for i, (row, source) in enumerate(zip(batch.indices.tolist(), batch["source"].tolist())):
                expected = data[row] * 3 if source == 0 else -data[row] * 3
                np.testing.assert_array_equal(batch["x"][i], expected)


def test_check_determinism_finds_global_randomness(rows):
    path, _ = rows
    check_determinism({"data": path}, NAME, {"scale": 3}, batch_size=8)
    for name in ("uses_numpy_global", "uses_python_global"):
        with pytest.raises(TransformError, match="not deterministic: output 'x' of step 0"):
            check_determinism({"data": path}, f"transform_fixtures:{name}", batch_size=8)


def test_global_randomness_is_at_least_reproducible_across_readers(rows):
    path, _ = rows
    batches = []
    for readers in (1, 3):
        with ShmDataLoader({"data": path}, transform="transform_fixtures:uses_numpy_global", batch_size=8,
                           readers=readers) as loader:
            batches.append([np.array(batch["x"]) for _, batch in zip(range(8), loader)])
    for one, three in zip(*batches):
        np.testing.assert_array_equal(one, three)


@pytest.mark.parametrize("transform, args, message", [
    ("transform_fixtures", None, "import path 'module:function'"),
    ("no_such_module_xyz:f", None, "cannot import module 'no_such_module_xyz'"),
    ("transform_fixtures:missing", None, "has no attribute 'missing'"),
    ("transform_fixtures:undeclared", None, "not declared as one"),
    ("__main__:train", None, "cannot import __main__"),
    (NAME, {"scale": 3, "colour": "red"}, "cannot be called"),
    (NAME, {"scale": {1, 2}}, "JSON"),  # A set; tuples are taken as lists.
])
def test_unusable_transforms_are_refused_at_construction(rows, transform, args, message):
    path, _ = rows
    with pytest.raises(TransformError, match=message):
        ShmDataLoader({"data": path}, transform=transform, transform_args=args, batch_size=8, readers=1)


def test_a_transform_defined_in_main_is_refused_with_a_fix(rows, tmp_path):
    path, _ = rows
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import shmloader
        from shmloader import ShmDataLoader

        @shmloader.transform(outputs={{"x": ((4,), "float32")}})
        def train(batch, out, ctx):
            out["x"][:] = batch["data"]

        ShmDataLoader({{"data": {path!r}}}, transform=train, batch_size=8, readers=1)
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert "is defined in __main__" in result.stderr and "transform='my_transforms:train'" in result.stderr


def test_a_transform_passed_as_an_importable_function_works(rows):
    import transform_fixtures

    path, data = rows
    with ShmDataLoader({"data": path}, transform=transform_fixtures.returns_arrays, batch_size=8, readers=1) as loader:
        batch = next(loader)
        np.testing.assert_array_equal(batch["x"], data[batch.indices] + 1)


def test_a_transform_that_raises_names_step_rows_and_traceback(rows):
    path, _ = rows
    with ShmDataLoader({"data": path}, transform="transform_fixtures:fails_on_row_seven", batch_size=4,
                       mode="sequential", readers=2) as loader:
        next(loader)
        with pytest.raises(ReaderError) as caught:
            next(loader)
    error = caught.value
    assert error.step == 1 and error.original_type == "ValueError"
    assert isinstance(error, ValueError)  # The transform's own type: `except ValueError` catches it.
    assert "raised ValueError at step 1 on rows [4, 5, 6, 7] (4 rows): row seven is cursed" in str(error)
    assert "fails_on_row_seven" in error.traceback_text and 'raise ValueError("row seven is cursed")' in str(error)


@pytest.mark.parametrize("name, message", [
    ("returns_wrong_dtype", r"output 'x' at step 0 is float64 of shape \(8, 4\); it declares float32 of shape \(8, 4\)"),
    ("returns_wrong_shape", r"output 'x' at step 0 is float32 of shape \(8, 5\); it declares float32 of shape \(8, 4\)"),
])
def test_an_output_of_the_wrong_shape_or_dtype_is_caught_before_publishing(rows, name, message):
    path, _ = rows
    with ShmDataLoader({"data": path}, transform=f"transform_fixtures:{name}", batch_size=8, readers=1) as loader:
        with pytest.raises(ReaderError, match=message):
            next(loader)


def test_padded_and_windows_inputs_reach_the_transform_as_their_arrays(tmp_path):
    from shmloader import Padded, Windows

    rng = np.random.default_rng(4)
    documents = [rng.integers(1, 100, size=rng.integers(1, 30)).astype(np.int32) for _ in range(50)]
    write_ragged(tmp_path / "docs", documents)
    stream = np.arange(50 * 6 + 1, dtype=np.int64)
    np.save(tmp_path / "stream.npy", stream)
    fields = {"tokens": Padded(str(tmp_path / "docs"), max_length=20, overflow="truncate"),
              "stream": Windows(str(tmp_path / "stream.npy"), length=6)}
    with ShmDataLoader(fields, transform="transform_fixtures:padded_and_windows", batch_size=8, readers=2) as loader:
        assert loader.field_names == ("total", "length", "window_sum")
        for _, batch in zip(range(10), loader):
            for i, row in enumerate(batch.indices.tolist()):
                kept = documents[row][:20]
                assert (batch["total"][i], batch["length"][i]) == (kept.sum(), kept.size)
                assert batch["window_sum"][i] == stream[row * 6: row * 6 + 7].sum()


def test_transform_args_take_tuples_as_the_built_in_defaults_are(rows):
    """transform_args={"scale": (0.5, 1.0)} was refused ("changes in a JSON round trip")."""
    from shmloader.transforms.core import resolve

    spec = resolve("shmloader.transforms.images:train", {"scale": (0.5, 1.0), "ratio": (0.75, 1.25)}, 8)
    assert spec.args == {"scale": [0.5, 1.0], "ratio": [0.75, 1.25]}


@pytest.mark.parametrize("name, kind", [("raises_key_error", KeyError), ("raises_own_error", "CustomError")])
def test_a_transforms_exception_keeps_its_type_in_the_trainer(rows, name, kind):
    """It arrived as ReaderError only: `except ValueError` around the loop caught nothing."""
    import transform_fixtures

    path, _ = rows
    kind = getattr(transform_fixtures, kind) if isinstance(kind, str) else kind
    with ShmDataLoader({"data": path}, transform=f"transform_fixtures:{name}", batch_size=4, readers=1) as loader:
        with pytest.raises(kind) as caught:
            next(loader)
    assert isinstance(caught.value, ReaderError) and caught.value.step == 0
    assert "--- reader traceback ---" in str(caught.value)


def test_an_error_type_the_trainer_has_not_imported_stays_a_plain_reader_error():
    from shmloader.errors import reader_error_type

    assert reader_error_type("no_such_module_here", "Boom") is ReaderError
    assert reader_error_type("builtins", "len") is ReaderError  # Not an exception type: a report is foreign input.
    assert issubclass(reader_error_type("builtins", "ValueError"), ValueError)


def test_sys_exit_in_a_transform_is_reported_with_its_step_and_traceback(rows):
    path, _ = rows
    with ShmDataLoader({"data": path}, transform="transform_fixtures:exits", batch_size=4, readers=1,
                       max_reader_restarts=0) as loader:
        with pytest.raises(ReaderError, match=r"raised SystemExit at step 0") as caught:
            next(loader)
    assert "sys.exit(0)" in caught.value.traceback_text


def test_a_readers_key_error_reads_as_its_message_with_its_lines():
    """KeyError's own str() is the repr of its argument: the whole report, traceback and
    all, came out on one line of \\n escapes (torch's KeyErrorMessage fixes the same)."""
    from shmloader.errors import reader_error_type

    error = reader_error_type("builtins", "KeyError")("reader 0 raised KeyError: 'x'\n--- reader traceback ---\nline")
    assert isinstance(error, KeyError) and isinstance(error, ReaderError)
    assert str(error) == "reader 0 raised KeyError: 'x'\n--- reader traceback ---\nline"
