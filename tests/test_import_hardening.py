"""Importers read only what they were given: a path inside an Image() or struct<bytes, path>
column is read only under the image_root the user names, regular files only, bounded in
size, never through a link or `..` out of it, never a FIFO or a device; class labels outside
their names are refused by name; the import's progress bar ends at 100%."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmloader import StorageError
from shmloader.tools.cli import main
from shmloader.tools.formats import from_arrow, from_parquet

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
# A child that could hang on a FIFO or fill memory from /dev/zero is given this long.
CHILD_TIMEOUT_SECONDS = 60


def image_table(rows: list[dict]):
    return pa.table({"id": pa.array(range(len(rows)), type=pa.int64()), "image": pa.array(rows, type=IMAGE_TYPE)})


def ragged_records(path: str) -> list[bytes]:
    import blosc2

    values = blosc2.open(os.path.join(path, "values.b2nd"))[...].tobytes()
    offsets = blosc2.open(os.path.join(path, "offsets.b2nd"))[...].tolist()
    return [values[start:stop] for start, stop in zip(offsets, offsets[1:])]


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_bytes(b"the password is hunter2\n")
    return path


def test_a_path_only_image_is_refused_without_image_root_naming_row_column_path_and_fix(tmp_path, secret):
    table = image_table([{"bytes": b"stored", "path": "a.png"}, {"bytes": None, "path": str(secret)}])
    pq.write_table(table, tmp_path / "images.parquet")
    for run in (lambda: from_arrow(table, tmp_path / "out", progress=False),
                lambda: from_parquet(tmp_path / "images.parquet", tmp_path / "out", progress=False)):
        with pytest.raises(StorageError) as raised:
            run()
        message = str(raised.value)
        assert "column 'image'" in message and "row 1" in message and str(secret) in message, message
        assert "image_root=" in message and "--image-root" in message, message
    assert not [entry for entry in os.listdir(tmp_path) if "out" in entry]  # Nothing written, nothing half-written.


def test_files_under_image_root_are_read_and_equal_the_files(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    rng = np.random.default_rng(3)
    names = ["sub/0.png", "sub/1.png", "2.png", "sub/../3.png"]  # A `..` that stays under the root is fine.
    for name in ("sub/0.png", "sub/1.png", "2.png", "3.png"):
        (root / name).write_bytes(rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8).tobytes())
    os.symlink(root / "2.png", root / "link.png")  # A link that stays under the root is fine too.
    rows = [{"bytes": None, "path": str(root / names[0])},  # Absolute, under the root.
            {"bytes": None, "path": names[1]},  # Relative: to the root.
            {"bytes": b"embedded", "path": "/etc/hostname"},  # Bytes stored: the path is never read.
            {"bytes": None, "path": names[3]},
            {"bytes": None, "path": "link.png"}]
    pq.write_table(image_table(rows), tmp_path / "images.parquet", row_group_size=2)
    paths = from_parquet(tmp_path / "images.parquet", tmp_path / "out", image_root=root, progress=False)
    with open(root / "sub" / "0.png", "rb") as a, open(root / "sub" / "1.png", "rb") as b, \
            open(root / "3.png", "rb") as c, open(root / "2.png", "rb") as d:
        expected = [a.read(), b.read(), b"embedded", c.read(), d.read()]
    assert ragged_records(paths["image"]) == expected
    assert [path.decode() for path in ragged_records(paths["image_path"])] == [row["path"] for row in rows]


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "symlinked_directory"])
def test_a_path_escaping_the_image_root_is_refused(tmp_path, secret, how):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "fine.png").write_bytes(b"fine")
    if how == "symlink":
        os.symlink(secret, root / "sub" / "evil.png")
        path = "sub/evil.png"
    elif how == "symlinked_directory":
        os.symlink(tmp_path, root / "outside")
        path = str(root / "outside" / "secret.txt")
    else:
        path = "sub/../../secret.txt" if how == "dotdot" else str(secret)
    table = image_table([{"bytes": None, "path": "sub/fine.png"}, {"bytes": None, "path": path}])
    with pytest.raises(StorageError) as raised:
        from_arrow(table, tmp_path / "out", image_root=root, progress=False)
    message = str(raised.value)
    assert "column 'image'" in message and "row 1" in message and path in message and str(root) in message, message
    assert not (tmp_path / "out").exists()


def run_child(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a child held to a few GiB of address space and a deadline, so that an
    import that hangs on a FIFO or reads /dev/zero for ever fails this test, not the suite."""
    prelude = "import resource\nresource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_SECONDS, cwd=os.path.dirname(os.path.abspath(__file__)))


def test_a_fifo_a_device_or_a_directory_is_refused_at_once(tmp_path):
    """Before: a FIFO hung the import for ever, /dev/zero was read until memory ran out.
    One child runs every case (a child costs a second or two to start)."""
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "pipe.png")
    (root / "folder.png").mkdir()
    cases = {"fifo": (str(root), "pipe.png", "not a regular file"),
             "dev_zero": ("/dev", "/dev/zero", "not a regular file"),
             "directory": (str(root), "folder.png", "not a regular file"),
             "dev_zero_without_a_root": (None, "/dev/zero", "image_root=")}
    result = run_child(f"""
        import pyarrow as pa
        from shmloader import StorageError
        from shmloader.tools.formats import from_arrow
        for case, (root, path, _) in {cases!r}.items():
            table = pa.table({{"image": pa.array([{{"bytes": None, "path": path}}],
                                                 type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))}})
            try:
                from_arrow(table, {str(tmp_path / "out")!r}, image_root=root, progress=False)
            except StorageError as error:
                print(case, "refused:", error, flush=True)
        """)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" refused: ", 1) for line in result.stdout.splitlines())
    assert sorted(lines) == sorted(cases), result.stdout
    for case, (_, path, expected) in cases.items():
        assert expected in lines[case] and path in lines[case], (case, lines[case])
    assert not (tmp_path / "out").exists()


def test_a_file_over_the_size_bound_is_refused_naming_the_bound(tmp_path, monkeypatch):
    from shmloader.tools import formats

    root = tmp_path / "root"
    root.mkdir()
    (root / "big.png").write_bytes(b"x" * 1001)
    (root / "small.png").write_bytes(b"x" * 1000)
    monkeypatch.setattr(formats, "IMAGE_FILE_BYTES_MAX", 1000)
    paths = from_arrow(image_table([{"bytes": None, "path": "small.png"}]), tmp_path / "ok", image_root=root,
                       progress=False)
    assert ragged_records(paths["image"]) == [b"x" * 1000]
    with pytest.raises(StorageError, match=r"row 1.*big\.png.*1,001 bytes.*IMAGE_FILE_BYTES_MAX"):
        from_arrow(image_table([{"bytes": None, "path": "small.png"}, {"bytes": None, "path": "big.png"}]),
                   tmp_path / "out", image_root=root, progress=False)


def test_the_import_command_takes_image_root(tmp_path, capsys):
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.png").write_bytes(b"picture")
    pq.write_table(image_table([{"bytes": None, "path": "a.png"}]), tmp_path / "in.parquet")
    assert main(["import", "parquet", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--quiet"]) == 2
    assert "--image-root" in capsys.readouterr().err
    assert main(["import", "parquet", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--quiet",
                 "--image-root", str(root)]) == 0
    assert ragged_records(str(tmp_path / "out" / "image.ragged")) == [b"picture"]


def class_label_table(values, sequence: bool):
    names = ["cat", "dog", "owl"]
    feature = {"_type": "ClassLabel", "names": names}
    if sequence:
        feature = {"_type": "Sequence", "feature": feature}
    column = pa.array(values, type=pa.list_(pa.int64()) if sequence else pa.int64())
    metadata = {b"huggingface": json.dumps({"info": {"features": {"label": feature}}}).encode()}
    return pa.table({"label": column}).replace_schema_metadata(metadata)


@pytest.mark.parametrize("sequence", [False, True], ids=["class_label", "sequence_of_class_labels"])
@pytest.mark.parametrize("value", [3, -2, 1 << 40])
def test_a_class_label_outside_its_names_is_refused_by_name(tmp_path, sequence, value):
    values = [[0, 1], [2], [], [1, value]] if sequence else [0, 1, 2, value]
    table = class_label_table(values, sequence)
    pq.write_table(table, tmp_path / "labels.parquet", row_group_size=2)
    with pytest.raises(StorageError) as raised:
        from_parquet(tmp_path / "labels.parquet", tmp_path / "out", progress=False)
    message = str(raised.value)
    assert "column 'label'" in message and "row 3" in message and f"{value:,}" in message, message
    assert "3 names" in message, message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sequence", [False, True], ids=["class_label", "sequence_of_class_labels"])
def test_class_labels_within_their_names_and_minus_one_import(tmp_path, sequence):
    """-1 is Hugging Face's own "no label" (its ClassLabel accepts -1 .. names - 1)."""
    values = [[0, 2], [-1], [], [1]] if sequence else [0, 2, -1, 1]
    paths = from_arrow(class_label_table(values, sequence), tmp_path / "out", progress=False)
    if not sequence:
        assert np.load(paths["label"]).tolist() == values
    assert json.loads((tmp_path / "out" / "classes.json").read_text()) == {"label": ["cat", "dog", "owl"]}


def test_the_import_progress_bar_ends_at_100_percent(tmp_path, monkeypatch, capsys):
    """Before: the bar was cleared where it stood (often 0% or 5%), and its count was bumped
    from several threads without a lock."""
    import tqdm

    bars = []

    class Recorded(tqdm.tqdm):
        def __init__(self, *arguments, **options):
            super().__init__(*arguments, **options)
            if not options.get("disable"):  # Not the disabled bars of the writers.
                bars.append(self)

    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    rows = 50_000
    table = pa.Table.from_batches([pa.record_batch({"a": np.arange(start, start + 500), "b": np.ones(500),
                                                    "c": pa.array([[1, 2]] * 500)})
                                   for start in range(0, rows, 500)])
    from_arrow(table, tmp_path / "out", progress=True, threads=3)
    assert len(bars) == 1 and bars[0].total == rows * 3 and bars[0].n == bars[0].total
    last = capsys.readouterr().err.rstrip().split("\r")[-1]
    assert "100%" in last and f"{rows * 3}/{rows * 3}" in last, repr(last)
