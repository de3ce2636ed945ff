"""Silent corruption is caught: `shmloader convert` stores a CRC-32 per chunk in the file's
own metadata (readable with Blosc2 alone), `shmloader verify` names every bad chunk, and
readers check each chunk the first time they read it; files without checksums still load."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from shmloader import ReaderError, ShmDataLoader
from shmloader.storage.opening import open_field
from shmloader.storage.spec import CHECKSUM_META, describe_field
from shmloader.tools.cli import main
from shmloader.tools.convert import convert, verify


@pytest.fixture
def stored(tmp_path):
    """Uncompressed rows (Blosc2 cannot notice a flipped byte in them) in 4 chunks."""
    rows = np.arange(256 * 4096, dtype=np.uint8).reshape(256, 4096)
    np.save(tmp_path / "rows.npy", rows)
    spec = convert(tmp_path / "rows.npy", tmp_path / "rows.b2nd", codec="none", progress=False)
    assert spec.checksums and spec.chunk_count == 4
    return rows, spec


def flip_a_byte_in_chunk(spec, chunk: int) -> None:
    field = open_field(spec)
    offset = int(field._file_offsets[chunk]) + int(field._sizes[chunk]) // 2
    field.close()
    before = os.stat(spec.path)
    with open(spec.path, "r+b") as handle:
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0xFF]))
    # Bit rot leaves the modification time alone (a write would move it, and readers would
    # refuse the file as changed before any checksum is read).
    os.utime(spec.path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_checksums_are_blosc2_metadata_over_the_stored_chunk_bytes(stored):
    import blosc2

    _, spec = stored
    array = blosc2.open(spec.path)
    expected = [zlib.crc32(array.schunk.get_chunk(chunk)) for chunk in range(array.schunk.nchunks)]
    assert np.frombuffer(array.schunk.vlmeta[CHECKSUM_META], dtype="<u4").tolist() == expected
    assert verify(spec.path, progress=False) == []


def test_a_flipped_byte_is_read_as_data_without_verification_and_caught_with_it(stored):
    rows, spec = stored
    flip_a_byte_in_chunk(spec, 2)
    indices = np.arange(128, 192, dtype=np.uint64)  # Chunk 2 holds rows 128..191.
    unchecked = open_field(spec, verify=False)
    out = np.empty((64, 4096), dtype=np.uint8)
    unchecked.gather(indices, out)
    unchecked.close()
    assert not np.array_equal(out, rows[128:192])  # Silent corruption: why checksums exist.
    checked = open_field(spec, verify=True)
    checked.gather(np.arange(0, 64, dtype=np.uint64), out)  # A sound chunk reads fine.
    with pytest.raises(Exception, match=r"rows\.b2nd: chunk 2 fails its checksum.*shmloader verify"):
        checked.gather(indices, out)
    checked.close()


def test_the_loader_reports_the_bad_chunk_through_its_reader(stored):
    rows, spec = stored
    flip_a_byte_in_chunk(spec, 1)
    with ShmDataLoader({"rows": spec.path}, batch_size=64, readers=2, slots=3, mode="sequential", verify=True) as loader:
        with pytest.raises(ReaderError) as raised:
            for _ in range(8):
                batch = next(loader)
                assert np.array_equal(batch["rows"], rows[batch.indices])
    assert raised.value.original_type == "StorageError" and "chunk 1 fails its checksum" in str(raised.value)


def test_verify_command_names_bad_chunks(stored, capsys):
    _, spec = stored
    assert main(["verify", spec.path, "--quiet"]) == 0
    assert "every chunk matches" in capsys.readouterr().out
    flip_a_byte_in_chunk(spec, 3)
    assert main(["verify", spec.path, "--quiet"]) == 1
    assert "1 bad chunks: 3" in capsys.readouterr().out


def test_files_without_checksums_still_load_and_verify_says_so(tmp_path, capsys):
    from conftest import write_b2nd

    rows = np.arange(4000, dtype=np.int32).reshape(400, 10)
    path = write_b2nd(tmp_path / "plain.b2nd", rows, chunks=(100, 10), blocks=(10, 10))
    assert not describe_field(path).checksums
    with ShmDataLoader({"rows": path}, batch_size=16, readers=1, slots=2, warn_layout=False) as loader:
        batch = next(loader)
        assert np.array_equal(batch["rows"], rows[batch.indices])
    assert main(["verify", path, "--quiet"]) == 2
    assert "carries no chunk checksums" in capsys.readouterr().err
