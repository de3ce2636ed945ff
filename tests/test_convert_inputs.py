"""Any Blosc2 array gets in: a sparse frame (a directory, blosc2's contiguous=False) and a
`blosc2.save` file load equal to numpy, directly or through `shmloader convert`, whose exact
command the loader gives; a structured dtype is split by convert into one file per field,
each equal to numpy's field, and the loader refuses it with that command."""

from __future__ import annotations

import numpy as np
import pytest

from shmloader import ShmDataLoader
from shmloader.errors import StorageError
from shmloader.tools.cli import main

blosc2 = pytest.importorskip("blosc2")


def _load_all(fields: dict) -> dict:
    """Every row of every field, in order, through the loader."""
    with ShmDataLoader(fields, batch_size=128, readers=1, slots=3, mode="sequential", epochs=1) as loader:
        parts = {name: [] for name in fields}
        for batch in loader:
            for name in fields:
                parts[name].append(batch[name].copy())
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}


@pytest.fixture
def rows():
    return np.random.default_rng(3).integers(-50, 50, (1000, 5)).astype(np.int16)


@pytest.mark.parametrize("name,suggested", [("frame", "frame.b2nd"), ("frame.b2nd", "frame.contiguous.b2nd")])
def test_a_sparse_frame_is_refused_with_the_convert_command_that_makes_it_load(tmp_path, rows, capsys, name,
                                                                               suggested):
    frame = tmp_path / name
    blosc2.asarray(rows, urlpath=str(frame), mode="w", contiguous=False, chunks=(300, 5), blocks=(50, 5))
    command = f"shmloader convert {frame} {tmp_path / suggested}"
    with pytest.raises(StorageError, match=f"sparse Blosc2 frame.*{command}"):
        ShmDataLoader({"rows": str(frame)}, batch_size=8, readers=1)
    assert main(command.split()[1:] + ["--quiet"]) == 0
    assert f"wrote {tmp_path / suggested}" in capsys.readouterr().out
    np.testing.assert_array_equal(_load_all({"rows": str(tmp_path / suggested)})["rows"], rows)


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "sparse"])
def test_a_blosc2_save_file_loads_equal_to_numpy(tmp_path, rows, contiguous):
    path = tmp_path / "saved.b2nd"
    blosc2.save(blosc2.asarray(rows), str(path), contiguous=contiguous)
    if not contiguous:
        assert main(["convert", str(path), str(tmp_path / "saved.contiguous.b2nd"), "--quiet"]) == 0
        path = tmp_path / "saved.contiguous.b2nd"
    np.testing.assert_array_equal(_load_all({"rows": str(path)})["rows"], rows)


@pytest.fixture
def structured():
    data = np.zeros(700, dtype=[("image", "u1", (2, 3)), ("label", "<i8"), ("keep", "?"), ("weight", "<f4")])
    rng = np.random.default_rng(4)
    data["image"] = rng.integers(0, 255, (700, 2, 3))
    data["label"] = np.arange(700) * 7
    data["keep"] = data["label"] % 3 == 0
    data["weight"] = rng.random(700)
    return data


@pytest.mark.parametrize("kind", ["npy", "b2nd", "sparse"])
def test_a_structured_array_is_split_into_one_file_per_field(tmp_path, structured, capsys, kind):
    source = tmp_path / f"table.{kind if kind != 'sparse' else 'dir'}"
    if kind == "npy":
        np.save(source, structured)
    else:
        blosc2.asarray(structured, urlpath=str(source), mode="w", contiguous=kind == "b2nd")
    if kind != "sparse":
        with pytest.raises(StorageError, match=f"structured.*shmloader convert {source} {tmp_path / 'table.b2nd'}"):
            ShmDataLoader({"table": str(source)}, batch_size=8, readers=1)
    assert main(["convert", str(source), str(tmp_path / "table.b2nd"), "--quiet"]) == 0
    out = capsys.readouterr().out
    fields = {name: str(tmp_path / f"table.{name}.b2nd") for name in structured.dtype.names}
    assert f"load them with: ShmDataLoader({{'image': {fields['image']!r}" in out
    loaded = _load_all(fields)
    for name in structured.dtype.names:
        np.testing.assert_array_equal(loaded[name], structured[name])
        assert loaded[name].dtype == structured.dtype.fields[name][0].base


def test_splitting_refuses_to_overwrite_a_field_file_and_names_a_missing_input(tmp_path, structured, capsys):
    np.save(tmp_path / "table.npy", structured)
    (tmp_path / "table.label.b2nd").write_bytes(b"mine")
    assert main(["convert", str(tmp_path / "table.npy"), str(tmp_path / "table.b2nd"), "--quiet"]) == 2
    assert "table.label.b2nd exists" in capsys.readouterr().err
    assert (tmp_path / "table.label.b2nd").read_bytes() == b"mine"
    assert main(["convert", str(tmp_path / "none.npy"), str(tmp_path / "x.b2nd"), "--quiet"]) == 2
    assert "none.npy does not exist" in capsys.readouterr().err
