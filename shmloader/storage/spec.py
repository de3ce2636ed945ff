"""Field files described (the trainer's side): what a .npy or Blosc2 .b2nd file holds,
validated once into a FieldSpec, the small description that crosses to the readers."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import stat
import struct

import numpy as np

from ..errors import StorageError
from ..remote.pages import MARKER_SUFFIX

NPY_MAGIC = b"\x93NUMPY"
# A contiguous Blosc2 frame starts with a msgpack fixarray marker, then the fixstr
# "b2frame\0"; the frame's header length is a big-endian int32 after a 0xd2 marker.
B2FRAME_MAGIC = b"\xa8b2frame\x00"
B2FRAME_MAGIC_OFFSET = 1
B2FRAME_HEADER_LENGTH_OFFSET = 11
CHUNK_HEADER_BYTES = 32
CHUNK_CBYTES_OFFSET = 12
# The variable-length metalayer in which `shmloader convert` stores one CRC-32 per chunk
# (little-endian uint32, in chunk order, of the chunk's bytes as stored), packed as
# msgpack binary like every Blosc2 vlmeta value: blosc2.open(path).schunk.vlmeta[...]
# reads it back without shmloader.
CHECKSUM_META = "shmloader.crc32"
# Beside it, the digest of every part of every chunk (zig/block_digests.zig: a chunk's head,
# then each block's stored bytes; the low 32 bits of XXH3-64, little-endian uint32), the same
# number per chunk, in chunk order: what readers check, a part the first time they read it,
# so that a row costs a hash of the bytes it decompresses, not of its whole chunk.
BLOCK_DIGESTS_META = "shmloader.block_xxh3"


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """What a reader needs to open a field: refers to the data, never carries it."""

    path: str
    kind: str  # "npy" or "b2nd"
    row_count: int
    row_shape: tuple[int, ...]
    dtype: str  # numpy's dtype.str, e.g. "<f4"
    # Blosc2 only:
    chunk_rows: int = 0
    block_rows: int = 0
    chunk_count: int = 0
    chunks: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()
    codec: str = ""
    clevel: int = 0
    compressed_bytes: int = 0
    # True when a row is one contiguous byte range of its decompressed chunk, which the
    # native gather needs; other layouts go through blosc2's Python API (slow, correct).
    row_contiguous: bool = False
    # True when the file carries a CRC-32 per chunk (CHECKSUM_META).
    checksums: bool = False
    # True when it also carries a digest per block (BLOCK_DIGESTS_META).
    block_digests: bool = False
    # True when a chunk decodes right only whole (the DELTA filter, a ZSTD dictionary):
    # libblosc2 reads a range of such a chunk wrong (tests/test_upstream_blosc2.py).
    whole_chunks: bool = False
    # .npy only: where the data starts, so that readers map it without parsing the header.
    data_offset: int = 0
    # (device, inode, size, mtime_ns) of the file as described: a reader refuses a file that
    # no longer matches (replaced, rewritten in place), since its layout may differ too.
    identity: tuple[int, ...] = ()
    # An object in a store: its URL. `path` is then its copy in the node's cache
    # (remote/cache.py), whose pages a gather pins first; `identity` is empty (the ETag
    # the copy is named by stands for it).
    remote: str = ""
    # An object in a store: where its loader's storage_options are (remote/cache.hold_options),
    # so that a reader fetches with its own trainer's, whoever else shares the cache.
    access: str = ""

    # Cached: a reader reads them on every gather (a frozen dataclass still has a __dict__).
    @functools.cached_property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @functools.cached_property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.numpy_dtype.itemsize

    @property
    def uncompressed_bytes(self) -> int:
        return self.row_count * self.row_bytes

    @property
    def name(self) -> str:
        """What names the file to the user: its URL for an object in a store, else its path."""
        return self.remote or self.path

    def to_dict(self) -> dict:
        # Not dataclasses.asdict, which deep-copies every value: a field of 10,000 files was
        # a second of serialisation per reader configured.
        return {name: getattr(self, name) for name in _FIELD_SPEC_KEYS}

    @classmethod
    def from_dict(cls, data: dict) -> FieldSpec:
        data = dict(data)
        for key in ("row_shape", "chunks", "blocks", "identity"):
            data[key] = tuple(data[key])
        return cls(**data)


_FIELD_SPEC_KEYS = tuple(field.name for field in dataclasses.fields(FieldSpec))


def check_dtype(path: str, dtype: np.dtype) -> None:
    if dtype.fields is not None and not dtype.hasobject:
        stem = _stem(path)
        raise StorageError(
            f"{path}: dtype {dtype} is structured (fields {', '.join(dtype.names)}); the loader reads one plain "
            f"dtype per file. Split it once into one file per field with: shmloader convert {path} {stem}.b2nd "
            f"(writes {stem}.{dtype.names[0]}.b2nd and the others beside it)"
        )
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise StorageError(
            f"{path}: dtype {dtype} is not supported; shmloader needs a plain numeric or bool "
            f"dtype (fixed-size, no objects, no structured fields). Store each field in its own file."
        )
    if dtype.itemsize == 0:
        raise StorageError(f"{path}: dtype {dtype} has zero-sized items")


def _stem(path: str) -> str:
    """A path without its trailing slash and .npy/.b2nd suffix, for naming what convert writes."""
    path = path.rstrip(os.sep) or path
    return re.sub(r"\.(npy|b2nd)$", "", path)


# A sparse Blosc2 frame (blosc2's contiguous=False) is a directory holding this index file
# beside one file per chunk.
SPARSE_FRAME_INDEX = "chunks.b2frame"


def is_sparse_frame(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), SPARSE_FRAME_INDEX))


def contiguous_name(path: str) -> str:
    """Where convert's contiguous copy of a sparse frame at `path` goes, by default."""
    stem = _stem(path)
    return f"{stem}.contiguous.b2nd" if stem != path.rstrip(os.sep) else f"{stem}.b2nd"


def check_rows(path: str, shape: tuple[int, ...], allow_empty: bool = False) -> None:
    if len(shape) == 0:
        raise StorageError(f"{path}: a 0-d array has no rows; expected an array of shape (rows, ...)")
    if any(extent < 0 for extent in shape):
        raise StorageError(f"{path}: its header declares the shape {tuple(shape)}, with a negative extent; expected "
                           f"non-negative extents (a corrupted or hand-edited header)")
    if shape[0] == 0 and not allow_empty:
        raise StorageError(f"{path}: the array has zero rows; expected at least one")


def file_identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one version of a file from another: a replacement changes the inode, a
    write in place the size or the modification time."""
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def check_identity(spec: FieldSpec, status: os.stat_result) -> None:
    """Raises StorageError when the file at spec.path is not the one that was described."""
    if spec.identity and file_identity(status) != tuple(spec.identity):
        device, inode, size, mtime_ns = spec.identity
        raise StorageError(
            f"{spec.name}: the file changed since the loader described it (inode {inode} of {size} bytes, modified "
            f"at {mtime_ns} ns; now inode {status.st_ino} of {status.st_size} bytes, modified at "
            f"{status.st_mtime_ns} ns). Its rows may be other rows now: restart the loader to read the new file, or "
            f"write new data to new paths"
        )


def describe_field(path: str | os.PathLike, allow_empty: bool = False) -> FieldSpec:
    """Validates a field file and describes it. Raises FileNotFoundError or StorageError.
    `allow_empty`: zero rows are fine (a ragged field's values when every record is empty).

    The file's identity is taken after its description (for .npy, of the very file read), so
    that a file replaced while it was being described fails the readers' check instead of
    passing with another layout."""
    path = os.path.abspath(os.fspath(path))  # Readers run elsewhere: paths must not be relative.
    if os.path.exists(path + MARKER_SUFFIX):  # An object's copy in the node cache.
        return describe_cached(path, allow_empty)
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"field file {path} does not exist") from None
    if stat.S_ISDIR(status.st_mode) and is_sparse_frame(path):
        raise StorageError(f"{path} is a sparse Blosc2 frame (a directory of chunk files, as blosc2 writes with "
                           f"contiguous=False); the loader maps contiguous .b2nd files. Copy it once into one with: "
                           f"shmloader convert {path} {contiguous_name(path)}")
    if stat.S_ISDIR(status.st_mode):
        raise StorageError(f"{path} is a directory; expected a .npy file or a contiguous Blosc2 .b2nd file")
    if not stat.S_ISREG(status.st_mode):
        # A FIFO or a device would block the open or the read below, or change under readers.
        raise StorageError(f"{path} is not a regular file; expected a .npy file or a contiguous Blosc2 .b2nd file")
    spec = _describe_file(path, allow_empty)
    if not spec.identity:  # .npy takes the identity of the very file it read; Blosc2 reopens by path.
        spec = dataclasses.replace(spec, identity=file_identity(os.stat(spec.path)))
    return spec


def describe_cached(path: str, allow_empty: bool) -> FieldSpec:
    """An object's copy in the node cache, its header pages pinned while it is read."""
    from ..remote.cache import access_for, cached_object

    cached = cached_object(path)
    with cached.reading_header():
        spec = _describe_file(path, allow_empty)
    return dataclasses.replace(spec, remote=cached.url, identity=(), access=access_for(path))


def _describe_file(path: str, allow_empty: bool) -> FieldSpec:
    with open(path, "rb") as handle:
        head = handle.read(16)
        if head.startswith(NPY_MAGIC):
            handle.seek(0)
            return _describe_npy(path, handle, allow_empty)
    if head[B2FRAME_MAGIC_OFFSET:B2FRAME_MAGIC_OFFSET + len(B2FRAME_MAGIC)] == B2FRAME_MAGIC:
        return _describe_b2nd(path, allow_empty)
    raise StorageError(f"{path} is neither a .npy file nor a Blosc2 frame (.b2nd): its first bytes are {head[:8]!r}")


# The header np.save writes for a plain dtype, e.g. "{'descr': '<f4', 'fortran_order': False,
# 'shape': (600, 3, 8, 8), }": matched instead of numpy's ast.literal_eval of it, which was
# a third of describing a field of many small files.
_NPY_HEADER = re.compile(rb"\{'descr': '([<>|=][a-zA-Z][0-9]*)', 'fortran_order': (True|False), "
                         rb"'shape': \(((?:[0-9]+, ?)*[0-9]*)\), \} *\n")
_NPY_LENGTH_FIELD = {1: "<H", 2: "<I", 3: "<I"}


def _simple_npy_header(handle) -> tuple | None:
    """(shape, fortran_order, dtype, data_offset) of a .npy header as np.save writes it for a
    plain dtype, or None for any other (numpy parses those)."""
    prefix = handle.read(len(NPY_MAGIC) + 2)
    length_format = _NPY_LENGTH_FIELD.get(prefix[len(NPY_MAGIC)]) if len(prefix) == len(NPY_MAGIC) + 2 else None
    if length_format is None:
        return None
    length_bytes = handle.read(struct.calcsize(length_format))
    if len(length_bytes) != struct.calcsize(length_format):
        return None
    (length,) = struct.unpack(length_format, length_bytes)
    header = handle.read(length)
    match = _NPY_HEADER.fullmatch(header)
    if match is None:
        return None
    shape = tuple(int(size) for size in match.group(3).split(b",") if size.strip())
    return shape, match.group(2) == b"True", np.dtype(match.group(1).decode()), handle.tell()


def _describe_npy(path: str, handle, allow_empty: bool = False) -> FieldSpec:
    """`handle`: the file, open at its start."""
    try:
        found = _simple_npy_header(handle)
        if found is None:  # Not what np.save writes for a plain dtype: numpy's own parser.
            handle.seek(0)
            version = np.lib.format.read_magic(handle)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran_order, dtype = read_header(handle)
            data_offset = handle.tell()
        else:
            shape, fortran_order, dtype, data_offset = found
    except (ValueError, OSError, SyntaxError, TypeError) as error:
        raise StorageError(f"{path}: unreadable .npy header ({error})") from None
    check_dtype(path, dtype)
    check_rows(path, shape, allow_empty)
    if fortran_order and len(shape) > 1:
        raise StorageError(
            f"{path}: the array is stored in Fortran order, so its rows are not contiguous; "
            f"rewrite it with np.save(path, np.ascontiguousarray(array))"
        )
    expected_bytes = data_offset + math.prod(shape) * dtype.itemsize
    status = os.fstat(handle.fileno())  # After the description: the identity of the file read.
    actual_bytes = status.st_size
    if actual_bytes < expected_bytes:
        raise StorageError(
            f"{path}: truncated .npy file: {actual_bytes} bytes, the header promises {expected_bytes}"
        )
    return FieldSpec(path=path, kind="npy", row_count=shape[0], row_shape=tuple(shape[1:]), dtype=dtype.str,
                     data_offset=data_offset, identity=file_identity(status))


def row_contiguous_layout(shape, chunks, blocks) -> bool:
    """Whether each row is one contiguous byte range of its decompressed chunk.

    Blosc2 stores a chunk block after block (blocks in C order over the block grid),
    each block in C order. With k the last axis a block splits, the chunk is plain C
    order exactly when every axis before k is one element thick in the block and k is
    split evenly: e.g. blocks (1, 112, 224, 3) in chunks (50, 224, 224, 3). Chunks must
    span whole rows for a row to lie in one chunk.
    """
    if tuple(chunks[1:]) != tuple(shape[1:]):
        return False
    split_axes = [axis for axis in range(1, len(chunks)) if blocks[axis] < chunks[axis]]
    if not split_axes:
        return True
    last = split_axes[-1]
    return all(blocks[axis] == 1 for axis in range(last)) and chunks[last] % blocks[last] == 0


def _blocks_depend(cparams) -> bool:
    """Whether a Blosc2 frame's blocks cannot be decoded one by one: the DELTA filter, or a
    dictionary (such files are read through Blosc2's Python API, whole chunks at a time)."""
    filters = [getattr(item, "name", str(item)) for item in getattr(cparams, "filters", [])]
    return "DELTA" in filters or bool(getattr(cparams, "use_dict", False))


def _describe_b2nd(path: str, allow_empty: bool = False) -> FieldSpec:
    import blosc2  # Only the trainer describes files; readers never import blosc2.

    try:
        array = blosc2.open(path, mode="r")
    except Exception as error:  # blosc2 raises many types for a bad file.
        raise StorageError(f"{path}: not a readable Blosc2 file ({type(error).__name__}: {error})") from None
    if not hasattr(array, "blocks") or not hasattr(array, "chunks"):
        raise StorageError(f"{path}: a Blosc2 super-chunk but not an NDArray; write it with blosc2.asarray")
    dtype = np.dtype(array.dtype)
    shape = tuple(int(extent) for extent in array.shape)
    check_dtype(path, dtype)
    check_rows(path, shape, allow_empty)
    schunk = array.schunk
    if not schunk.contiguous:
        raise StorageError(f"{path}: a sparse Blosc2 frame; copy it once into a contiguous one with: "
                           f"shmloader convert {path} {contiguous_name(path)}")
    chunks = tuple(int(extent) for extent in array.chunks)
    blocks = tuple(int(extent) for extent in array.blocks)
    chunk_count = int(schunk.nchunks)
    # Rows of zero bytes (shape (N, 0)) hold no data: any chunk count will do.
    expected_chunks = math.prod(-(-extent // max(chunk, 1)) for extent, chunk in zip(shape, chunks))
    if chunk_count != expected_chunks and math.prod(shape[1:]) > 0:
        raise StorageError(
            f"{path}: the frame holds {chunk_count} chunks, its shape {shape} and chunks {chunks} "
            f"need {expected_chunks}; the file is truncated or corrupted"
        )
    cparams = schunk.cparams
    return FieldSpec(
        path=path,
        kind="b2nd",
        row_count=shape[0],
        row_shape=shape[1:],
        dtype=dtype.str,
        chunk_rows=chunks[0],
        block_rows=blocks[0],
        chunk_count=chunk_count,
        chunks=chunks,
        blocks=blocks,
        # Level 0 stores blocks as they are, whatever codec the file names.
        codec="none" if int(cparams.clevel) == 0 else getattr(cparams.codec, "name", str(cparams.codec)),
        clevel=int(cparams.clevel),
        compressed_bytes=int(schunk.cbytes),
        # DELTA stores each block against its chunk's first, and a ZSTD dictionary sits in
        # the chunk: a block decoded alone (the native gather) would be wrong or fail.
        row_contiguous=row_contiguous_layout(shape, chunks, blocks) and not _blocks_depend(cparams),
        whole_chunks=_blocks_depend(cparams),
        checksums=CHECKSUM_META in schunk.vlmeta,
        block_digests=BLOCK_DIGESTS_META in schunk.vlmeta,
    )


