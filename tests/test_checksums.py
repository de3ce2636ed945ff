"""Silent corruption is caught: `shmloader convert` stores a CRC-32 per chunk and a digest per
block in the file's own metadata (readable with Blosc2 alone), `shmloader verify` names every
bad chunk, and readers check what they read the first time they read it (on by default): a
block and its chunk's head where the file has block digests, once per loader (its readers
share a record of checked blocks in its ring, for that file alone), else the whole chunk;
files without checksums still load."""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import zlib

import numpy as np
import pytest

from shmloader import ReaderError, ShmDataLoader
from shmloader.errors import StorageError
from shmloader.storage import checked_blocks
from shmloader.storage.opening import open_field
from shmloader.storage.spec import BLOCK_DIGESTS_META, CHECKSUM_META, CHUNK_HEADER_BYTES, describe_field
from shmloader.tools.cli import main
from shmloader.tools.convert import convert, verify

from conftest import examples


@pytest.fixture
def stored(tmp_path):
    """Uncompressed rows (Blosc2 cannot notice a flipped byte in them) in 4 chunks."""
    rows = np.arange(256 * 4096, dtype=np.uint8).reshape(256, 4096)
    np.save(tmp_path / "rows.npy", rows)
    spec = convert(tmp_path / "rows.npy", tmp_path / "rows.b2nd", codec="none", progress=False)
    assert spec.checksums and spec.chunk_count == 4
    return rows, spec


def flip_a_byte_in_chunk(spec, chunk: int, at: int | None = None) -> None:
    """Flips byte `at` of a chunk as stored (its middle byte by default)."""
    field = open_field(spec)
    offset = int(field._file_offsets[chunk]) + (int(field._sizes[chunk]) // 2 if at is None else at)
    field.close()
    flip_a_byte_at(spec, offset)


def flip_a_byte_at(spec, offset: int) -> None:
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


def block_extents(chunk: bytes) -> list[tuple[int, int]]:
    """The reference for zig/block_digests.zig's parts, from Blosc2's chunk format: the head
    (every byte before the first stored block), then each block from its start to the next
    stored block's start or the chunk's end."""
    uncompressed, block_bytes, stored = np.frombuffer(chunk[4:16], dtype="<u4").tolist()
    assert stored == len(chunk) and not chunk[31] & 0x70  # No special (one-value) chunks here.
    count = -(-uncompressed // block_bytes)
    if chunk[2] & 0x2:  # Stored as they are, after the header.
        starts = [CHUNK_HEADER_BYTES + block * block_bytes for block in range(count)]
    else:
        starts = np.frombuffer(chunk[CHUNK_HEADER_BYTES:CHUNK_HEADER_BYTES + 4 * count], dtype="<u4").tolist()
    ordered = sorted(starts)
    ends = {start: end for start, end in zip(ordered, [*ordered[1:], stored])}
    return [(0, ordered[0])] + [(start, ends[start]) for start in starts]


@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_block_digests_are_xxh3_of_each_blocks_stored_bytes(tmp_path, codec):
    """Against the xxhash package and the extents above, on blocks that LZ4 compresses to
    different sizes and compression threads may store out of order."""
    import blosc2

    xxhash = pytest.importorskip("xxhash")
    rows = np.random.default_rng(1).integers(0, 8, size=(1000, 3000), dtype=np.uint8)
    spec = convert(rows, tmp_path / "rows.b2nd", codec=codec, progress=False)
    assert spec.block_digests and spec.chunk_count > 1
    schunk = blosc2.open(spec.path).schunk
    digests = np.frombuffer(schunk.vlmeta[BLOCK_DIGESTS_META], dtype="<u4").reshape(spec.chunk_count, -1)
    for chunk in range(spec.chunk_count):
        stored = schunk.get_chunk(chunk)
        expected = [xxhash.xxh3_64_intdigest(stored[start:end]) & 0xFFFFFFFF for start, end in block_extents(stored)]
        assert digests[chunk, :len(expected)].tolist() == expected
        assert not digests[chunk, len(expected):].any()


def test_a_flipped_byte_is_caught_in_the_block_read_and_nowhere_else(stored):
    """Where the file has block digests, a fill checks the blocks it reads: a sound block of
    a chunk with a bad one reads fine, the bad block raises (a whole-chunk check would
    refuse both), and so does a changed header or block table."""
    rows, spec = stored
    assert spec.block_rows == 1 and spec.chunk_rows == 64
    field = open_field(spec)
    chunk = bytes(field.chunk_bytes(2))
    field.close()
    start, end = block_extents(chunk)[1 + 5]  # Chunk 2's block 5: row 133.
    flip_a_byte_in_chunk(spec, 2, at=(start + end) // 2)
    checked = open_field(spec, verify=True)
    out = np.empty((2, 4096), dtype=np.uint8)
    checked.gather(np.array([130, 140], dtype=np.uint64), out)
    assert np.array_equal(out, rows[[130, 140]])
    with pytest.raises(StorageError, match=r"rows\.b2nd: chunk 2 fails its checksum \(its block 5, .*shmloader verify"):
        checked.gather(np.array([140, 133], dtype=np.uint64), out)
    with pytest.raises(StorageError, match=r"chunk 2 fails its checksum \(its block 5"):  # Not marked as checked.
        checked.gather(np.array([133, 0], dtype=np.uint64), out)
    checked.close()
    flip_a_byte_in_chunk(spec, 1, at=22)  # Chunk 1's header (its codec's byte): a block read reads it too.
    checked = open_field(spec, verify=True)
    with pytest.raises(StorageError, match=r"chunk 1 fails its checksum \(its header and block table"):
        checked.gather(np.array([64, 65], dtype=np.uint64), out)
    checked.close()


def test_a_shard_field_read_through_one_joined_table_names_the_bad_file(tmp_path):
    """Shards with block digests keep the joined chunk table under verify: the error names
    the shard and its own chunk, not the joined table's."""
    rows = np.random.default_rng(0).integers(0, 255, size=(300, 4096), dtype=np.uint8)
    for shard in range(3):
        convert(rows[shard * 100:(shard + 1) * 100], tmp_path / f"img-{shard}.b2nd", codec="none", progress=False)
    spec = describe_field(str(tmp_path / "img-2.b2nd"))
    flip_a_byte_in_chunk(spec, 1)  # Rows 64..99 of shard 2: 264..299.
    with ShmDataLoader({"x": str(tmp_path / "img-*.b2nd")}, batch_size=100, readers=1, slots=2, mode="sequential",
                       warn_layout=False) as loader:
        assert loader.plan.fields[0].parts[0].block_digests
        with pytest.raises(ReaderError) as raised:
            for _ in range(3):
                batch = next(loader)
                assert np.array_equal(batch["x"], rows[batch.indices])
    assert "img-2.b2nd: chunk 1 fails its checksum" in str(raised.value)


def test_checks_are_on_by_default(stored):
    rows, spec = stored
    flip_a_byte_in_chunk(spec, 3)
    with ShmDataLoader({"rows": spec.path}, batch_size=64, readers=1, slots=2, mode="sequential") as loader:
        assert loader.options.verify is True
        with pytest.raises(ReaderError, match="chunk 3 fails its checksum"):
            for _ in range(4):
                next(loader)


def test_block_digest_metadata_of_the_wrong_length_names_the_file(stored):
    import blosc2

    _, spec = stored
    array = blosc2.open(spec.path, mode="a")
    array.schunk.vlmeta[BLOCK_DIGESTS_META] = b"\x01\x02\x03\x04\x05"
    del array
    with pytest.raises(StorageError, match=r"rows\.b2nd: its shmloader\.block_xxh3 metadata holds 5 bytes"):
        open_field(describe_field(spec.path), verify=True)


def test_a_file_converted_before_block_digests_is_checked_chunk_by_chunk(stored):
    import blosc2

    rows, spec = stored
    array = blosc2.open(spec.path, mode="a")
    del array.schunk.vlmeta[BLOCK_DIGESTS_META]
    del array
    spec = describe_field(spec.path)
    assert spec.checksums and not spec.block_digests
    flip_a_byte_in_chunk(spec, 2, at=CHUNK_HEADER_BYTES + 5 * 4096 + 7)  # Block 5 of chunk 2 (stored as is).
    checked = open_field(spec, verify=True)
    out = np.empty((1, 4096), dtype=np.uint8)
    with pytest.raises(StorageError, match=r"chunk 2 fails its checksum \(stored CRC-32"):
        checked.gather(np.array([130], dtype=np.uint64), out)  # Another block of the chunk: the whole is checked.
    checked.close()


def test_verify_checks_the_block_digests_readers_check(stored, capsys):
    """A chunk whose bytes match its CRC-32 but not the block digests the file carries
    (damaged metadata) is refused by every reader: `shmloader verify` names it too."""
    import blosc2

    rows, spec = stored
    array = blosc2.open(spec.path, mode="a")
    digests = np.frombuffer(array.schunk.vlmeta[BLOCK_DIGESTS_META], dtype="<u4").copy()
    stride = digests.size // spec.chunk_count
    digests[2 * stride + 1] ^= 1  # Chunk 2's first block's digest.
    array.schunk.vlmeta[BLOCK_DIGESTS_META] = digests.tobytes()
    del array
    assert verify(spec.path, progress=False) == [2]
    field = open_field(describe_field(spec.path), verify=True)
    with pytest.raises(Exception, match="chunk 2"):
        field.gather(np.arange(128, 130, dtype=np.uint64), np.empty((2, 4096), np.uint8))
    field.close()
    assert main(["verify", spec.path, "--quiet"]) == 1
    assert "1 bad chunks: 2" in capsys.readouterr().out


def a_loaders_record(specs) -> tuple[mmap.mmap, int]:
    """The record of checked blocks a loader keeps in its ring for `specs`, in memory of its
    own (a reader's view of it: checked_blocks.attach)."""
    pages = checked_blocks.record_pages(specs)
    memory = mmap.mmap(-1, pages * 4096)
    checked_blocks.write_record(memory, 0, pages, specs)
    return memory, pages


def set_bits(memory, record_offset: int, entry: int) -> set[int]:
    """The bits set for file `entry` of a record, read by the layout table of checked_blocks.py."""
    *_, bits_offset, words = struct.unpack_from("<QQQqQQQQ", memory, record_offset + 16 + 64 * entry)
    bits = np.frombuffer(memory, dtype="<u8", count=words, offset=record_offset + bits_offset)
    found = {64 * word + bit for word, value in enumerate(bits.tolist()) for bit in range(64) if value >> bit & 1}
    del bits
    return found


@pytest.fixture
def attached():
    """Leaves this process without a loader's record after the test (as a trainer is)."""
    yield
    checked_blocks.detach()


def test_the_readers_of_one_loader_check_a_block_once_and_another_loader_checks_it_again(stored, attached):
    """A block one reader checked is not hashed again by another reader of the same loader
    (which then reads it as it is now, as the first reader would); a new loader's record
    starts empty, so it checks the block itself and finds the byte flipped since."""
    rows, spec = stored
    stride = 1 + spec.chunk_rows  # One digest for the head, one per one-row block.
    memory, pages = a_loaders_record([spec])
    checked_blocks.attach(memory, 0, pages)
    out = np.empty((1, 4096), dtype=np.uint8)
    first = open_field(spec, verify=True)
    first.gather(np.array([130], dtype=np.uint64), out)  # Chunk 2, block 2.
    blocks = {bit for bit in set_bits(memory, 0, 0) if bit < spec.chunk_count * stride and bit % stride}
    assert blocks == {2 * stride + 1 + 2} and 2 * stride in set_bits(memory, 0, 0)
    field = open_field(spec)
    chunk = bytes(field.chunk_bytes(2))
    field.close()
    start, end = block_extents(chunk)[1 + 2]
    flip_a_byte_in_chunk(spec, 2, at=(start + end) // 2)
    second = open_field(spec, verify=True)  # Another reader of the same loader.
    second.gather(np.array([130, 131], dtype=np.uint64), np.empty((2, 4096), dtype=np.uint8))
    assert 2 * stride + 1 + 3 in set_bits(memory, 0, 0)  # Its own first read, checked and shared.
    for field in (first, second):
        field.close()
    memory, pages = a_loaders_record([spec])  # The next loader's ring.
    checked_blocks.attach(memory, 0, pages)
    third = open_field(spec, verify=True)
    with pytest.raises(StorageError, match=r"chunk 2 fails its checksum \(its block 2,"):
        third.gather(np.array([130], dtype=np.uint64), out)
    assert 2 * stride + 1 + 2 not in set_bits(memory, 0, 0)
    third.close()


def test_a_record_vouches_only_for_the_file_it_names(tmp_path, attached):
    """A copy of a file (another inode: same layout, same digests) with a flipped byte is
    checked by its readers although the record holds every block of the original; so is a
    file changed since the record was made, and an entry that points outside its record."""
    rows = np.arange(128 * 4096, dtype=np.uint8).reshape(128, 4096)
    original = convert(rows, tmp_path / "a.b2nd", codec="none", progress=False)
    shutil.copyfile(original.path, tmp_path / "b.b2nd")
    copy = describe_field(tmp_path / "b.b2nd")
    memory, pages = a_loaders_record([original])
    checked_blocks.attach(memory, 0, pages)
    everything = open_field(original, verify=True)
    everything.gather(np.arange(128, dtype=np.uint64), np.empty((128, 4096), dtype=np.uint8))
    everything.close()
    flip_a_byte_in_chunk(copy, 1)
    reader = open_field(copy, verify=True)
    with pytest.raises(StorageError, match=r"b\.b2nd: chunk 1 fails its checksum"):
        reader.gather(np.arange(64, 128, dtype=np.uint64), np.empty((64, 4096), dtype=np.uint8))
    reader.close()
    os.utime(original.path, ns=(original.identity[3], original.identity[3] + 1))
    changed = describe_field(original.path)
    assert checked_blocks.shared_bits(changed, changed.chunk_count, 1 + changed.chunk_rows) is None
    assert checked_blocks.shared_bits(original, original.chunk_count, 1 + original.chunk_rows) is not None
    struct.pack_into("<Q", memory, 16 + 48, pages * 4096)  # The entry's bits_offset: past the record.
    checked_blocks.attach(memory, 0, pages)
    assert checked_blocks.shared_bits(original, original.chunk_count, 1 + original.chunk_rows) is None


@pytest.mark.parametrize("bad_row", [3, 70, 133, 250], ids=lambda row: f"row{row}")
def test_a_flipped_byte_is_caught_whichever_reader_reads_it_first(stored, bad_row):
    rows, spec = stored
    field = open_field(spec)
    chunk = bytes(field.chunk_bytes(bad_row // 64))
    field.close()
    start, end = block_extents(chunk)[1 + bad_row % 64]
    flip_a_byte_in_chunk(spec, bad_row // 64, at=(start + end) // 2)
    with ShmDataLoader({"rows": spec.path}, batch_size=16, readers=2, slots=4, seed=bad_row,
                       warn_layout=False) as loader:
        with pytest.raises(ReaderError, match=rf"chunk {bad_row // 64} fails its checksum \(its block {bad_row % 64},"):
            for _ in range(256 // 16):
                batch = next(loader)
                assert np.array_equal(batch["rows"], rows[batch.indices])


@pytest.mark.parametrize("readers", [1, 2])
def test_a_loaders_readers_keep_one_record_of_checked_blocks_in_its_ring(stored, readers):
    """Readers read an epoch between them: the ring's record holds every block (whichever
    reader read it) and every chunk's head, and nothing else. A bit is set by a plain load and
    store (storage/checked_blocks.py): two readers storing into one word at the same moment
    may lose one of the bits, which costs only a check redone, so with two readers the record
    may miss a few (a loaded CI host lost one)."""
    rows, spec = stored
    stride = 1 + spec.chunk_rows
    with ShmDataLoader({"rows": spec.path}, batch_size=16, readers=readers, slots=4, warn_layout=False) as loader:
        for _ in range(256 // 16):
            batch = next(loader)
            assert np.array_equal(batch["rows"], rows[batch.indices])
        layout, memory = loader._session.layout, loader._session.ring.memory
        assert layout.checked_pages > 0
        found = set_bits(memory, layout.checked_offset, 0)
    parts = {bit for bit in found if bit < spec.chunk_count * stride}
    every = {chunk * stride + part for chunk in range(spec.chunk_count) for part in range(stride)}
    assert parts <= every
    assert parts == every if readers == 1 else len(parts) >= 0.9 * len(every)


def stored_as_is(blocks: list[bytes]) -> bytes:
    """A Blosc2 chunk of `blocks` stored as they are (BLOSC_MEMCPYED), each but the last of
    the first one's length: its block parts are exactly those bytes."""
    block_bytes, uncompressed = len(blocks[0]), sum(map(len, blocks))
    assert all(len(block) == block_bytes for block in blocks[:-1]) and 0 < len(blocks[-1]) <= block_bytes
    header = bytearray(CHUNK_HEADER_BYTES)
    header[0], header[2], header[3] = 2, 0x2, 1  # Version, stored as is, one-byte items.
    struct.pack_into("<III", header, 4, uncompressed, block_bytes, CHUNK_HEADER_BYTES + uncompressed)
    return bytes(header) + b"".join(blocks)


if examples is not None:
    from hypothesis import given
    from hypothesis import strategies as st

    @examples(60)
    @given(first=st.integers(1, 5000), second=st.integers(1, 5000), seed=st.integers(0, 2**32 - 1))
    def test_the_digest_is_xxh3_at_any_length_and_alignment(first, second, seed):
        """The library's digests (the widest vector loop this CPU runs: AVX-512, AVX2 or
        128-bit) against the xxhash package, over lengths around every switch of XXH3's
        long loop and at every alignment (the second block starts `first` bytes later)."""
        import xxhash

        from shmloader._native import Status, ffi, lib

        data = np.random.default_rng(seed).integers(0, 256, first + min(first, second), dtype=np.uint8).tobytes()
        blocks = [data[:first], data[first:]]
        chunk = stored_as_is(blocks)
        digests, parts = np.zeros(3, dtype=np.uint32), ffi.new("uint64_t *")
        status = lib.shm_chunk_digests(ffi.from_buffer("uint8_t[]", chunk), len(chunk),
                                       ffi.from_buffer("uint32_t[]", digests), 3, parts)
        assert status == Status.OK and parts[0] == 3
        expected = [xxhash.xxh3_64_intdigest(part) & 0xFFFFFFFF for part in (chunk[:CHUNK_HEADER_BYTES], *blocks)]
        assert digests.tolist() == expected
