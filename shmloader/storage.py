"""Field files (.npy and Blosc2 .b2nd): describe them, and gather rows into a caller's buffer.

`describe_field` runs in the trainer and validates a file once; the resulting `FieldSpec`
is a small description that crosses to reader processes, which `open_field` it and call
`gather(indices, out)` to write rows straight into shared memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import mmap
import os
import pathlib
import re
import shutil
import stat
import struct
import typing
import zlib

import numpy as np

from . import _blosc2_capi
from ._filemap import FileMapping, map_file
from ._native import Status, ffi, lib, status_name
from .errors import StorageError
from .remote.cache import MARKER_SUFFIX

NPY_MAGIC = b"\x93NUMPY"
# A contiguous Blosc2 frame starts with a msgpack fixarray marker, then the fixstr
# "b2frame\0"; the frame's header length is a big-endian int32 after a 0xd2 marker.
B2FRAME_MAGIC = b"\xa8b2frame\x00"
_B2FRAME_MAGIC_OFFSET = 1
_B2FRAME_HEADER_LENGTH_OFFSET = 11
_CHUNK_HEADER_BYTES = 32
_CHUNK_CBYTES_OFFSET = 12
# The variable-length metalayer in which `shmloader convert` stores one CRC-32 per chunk
# (little-endian uint32, in chunk order, of the chunk's bytes as stored), packed as
# msgpack binary like every Blosc2 vlmeta value: blosc2.open(path).schunk.vlmeta[...]
# reads it back without shmloader.
CHECKSUM_META = "shmloader.crc32"


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
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise StorageError(
            f"{path}: dtype {dtype} is not supported; shmloader needs a plain numeric or bool "
            f"dtype (fixed-size, no objects, no structured fields). Store each field in its own file."
        )
    if dtype.itemsize == 0:
        raise StorageError(f"{path}: dtype {dtype} has zero-sized items")


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


@contextlib.contextmanager
def publishing(path: str | os.PathLike):
    """Yields a fresh directory beside `path` to write into; when the block ends it takes
    `path`'s place in one rename (replacing a file or directory there), and when the block
    raises it is removed: an interrupted write leaves nothing that looks finished."""
    path = pathlib.Path(path)
    temporary = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        yield temporary
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def check_output_directory(output: str | os.PathLike) -> None:
    """Raises FileNotFoundError naming `output` when its directory does not exist (writers
    stage under a hidden name beside it, whose error would name that instead)."""
    directory = os.path.dirname(os.path.abspath(os.fspath(output)))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{output}: its directory {directory} does not exist; create it first")


def check_output(output: str | os.PathLike, sources=(), force: bool = False, marker: str | None = None) -> pathlib.Path:
    """`output` as an absolute path once it is safe to write there: its directory exists;
    it is none of `sources` and holds none of them; it does not exist, or `force` is given
    and (where `marker` names one) it is an earlier output of the same kind, holding that
    file: force replaces what a writer wrote, never a directory of other files."""
    out = pathlib.Path(os.path.abspath(os.fspath(output)))
    check_output_directory(out)
    for source in sources:
        path = pathlib.Path(os.path.abspath(os.fspath(source)))
        if path == out or out in path.parents:
            raise ValueError(f"{output}: writing there would replace the source {source}; choose another output")
    if out.exists():
        if not force:
            raise FileExistsError(f"{out} exists; pass force=True (--force) to overwrite it")
        if marker is not None and (not out.is_dir() or not (out / marker).is_file()):
            raise FileExistsError(f"{out} exists and is not an earlier output of this command (no {marker} in it): "
                                  f"force replaces only such an output; remove it yourself, or choose another output")
    return out


def describe_field(path: str | os.PathLike, allow_empty: bool = False) -> FieldSpec:
    """Validates a field file and describes it. Raises FileNotFoundError or StorageError.
    `allow_empty`: zero rows are fine (a ragged field's values when every record is empty).

    The file's identity is taken after its description (for .npy, of the very file read), so
    that a file replaced while it was being described fails the readers' check instead of
    passing with another layout."""
    path = os.path.abspath(os.fspath(path))  # Readers run elsewhere: paths must not be relative.
    if os.path.exists(path + MARKER_SUFFIX):  # An object's copy in the node cache.
        return _describe_cached(path, allow_empty)
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"field file {path} does not exist") from None
    if stat.S_ISDIR(status.st_mode):
        raise StorageError(f"{path} is a directory; expected a .npy file or a contiguous Blosc2 .b2nd file")
    if not stat.S_ISREG(status.st_mode):
        # A FIFO or a device would block the open or the read below, or change under readers.
        raise StorageError(f"{path} is not a regular file; expected a .npy file or a contiguous Blosc2 .b2nd file")
    spec = _describe_file(path, allow_empty)
    if not spec.identity:  # .npy takes the identity of the very file it read; Blosc2 reopens by path.
        spec = dataclasses.replace(spec, identity=file_identity(os.stat(spec.path)))
    return spec


def _describe_cached(path: str, allow_empty: bool) -> FieldSpec:
    """An object's copy in the node cache, its header pages pinned while it is read."""
    from .remote.cache import cached_object

    cached = cached_object(path)
    try:
        with cached.pinned():
            spec = _describe_file(path, allow_empty)
    except StorageError as error:  # Named by its URL: the cache's path means nothing to the user.
        raise type(error)(str(error).replace(path, cached.url)) from None
    return dataclasses.replace(spec, remote=cached.url, identity=())


def _describe_file(path: str, allow_empty: bool) -> FieldSpec:
    with open(path, "rb") as handle:
        head = handle.read(16)
        if head.startswith(NPY_MAGIC):
            handle.seek(0)
            return _describe_npy(path, handle, allow_empty)
    if head[_B2FRAME_MAGIC_OFFSET:_B2FRAME_MAGIC_OFFSET + len(B2FRAME_MAGIC)] == B2FRAME_MAGIC:
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
        raise StorageError(f"{path}: a sparse (directory) Blosc2 frame; re-save it contiguous with `shmloader convert`")
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
    )


def _check_indices(spec: FieldSpec, indices) -> np.ndarray:
    indices = np.asarray(indices)
    if indices.ndim != 1:
        raise ValueError(f"indices must be one-dimensional, got shape {indices.shape}")
    if indices.dtype != np.uint64:
        if indices.size and indices.dtype.kind in "iu" and indices.min() < 0:
            position = int(np.argmax(indices < 0))
            raise IndexError(f"{spec.name}: index {int(indices[position])} at position {position} is negative")
        if indices.dtype.kind not in "iu" and indices.size:
            raise TypeError(f"indices must be integers, got dtype {indices.dtype}")
        indices = indices.astype(np.uint64)
    return np.ascontiguousarray(indices)


def _out_pointer(spec: FieldSpec, out, count: int):
    """A cdata pointer to `out`, after checking it is writable and exactly the batch's size."""
    expected_bytes = count * spec.row_bytes
    if isinstance(out, np.ndarray):
        if out.dtype != spec.numpy_dtype and out.dtype != np.uint8:
            raise TypeError(f"{spec.name}: out has dtype {out.dtype}, expected {spec.numpy_dtype} (or raw uint8 bytes)")
        if not out.flags.c_contiguous:
            raise ValueError(f"{spec.name}: out must be C-contiguous")
        if not out.flags.writeable:
            raise ValueError(f"{spec.name}: out is read-only; gather needs a writable buffer")
        actual_bytes = out.nbytes
    else:
        try:
            actual_bytes = memoryview(out).nbytes
        except TypeError:
            raise TypeError(f"{spec.name}: out must be a numpy array or a writable buffer, got {type(out).__name__}") from None
    if actual_bytes != expected_bytes:
        raise ValueError(
            f"{spec.name}: out holds {actual_bytes} bytes, expected {expected_bytes} "
            f"({count} rows of {spec.row_bytes} bytes)"
        )
    try:
        return ffi.from_buffer("uint8_t[]", out, require_writable=True)
    except (TypeError, BufferError):
        raise ValueError(f"{spec.name}: out is read-only; gather needs a writable buffer") from None


def _raise_index_error(spec: FieldSpec, indices: np.ndarray, position: int) -> None:
    raise IndexError(
        f"{spec.name}: index {int(indices[position])} at batch position {position} is out of range "
        f"for {spec.row_count} rows"
    )


def forget_mapped(mapping: FileMapping | None, offset: int, size: int) -> None:
    """Drops this process's page-table entries for bytes [offset, offset + size) of a file
    mapping (MADV_DONTNEED: the pages stay in the page cache, unmapped, so the kernel can
    reclaim them without an rmap walk, and fadvise DONTNEED can drop them). A later read
    maps them again: it costs a fault, never data."""
    if mapping is not None and size > 0:
        mapping.advise(mmap.MADV_DONTNEED, offset, size)


def _u64(array: np.ndarray):
    """A cffi pointer to a C-contiguous uint64 array; it keeps the array alive while it lives."""
    return ffi.from_buffer("uint64_t[]", array)


def check_gather(status: int, failure, path: str, what, out_of_range) -> None:
    """The one mapping of a native gather's status to an exception. `what(position)` names
    the row or range at the failing batch position; `out_of_range(position)` gives an
    IndexError's message (or None: out of range is then a corrupted layout)."""
    if status == Status.OK:
        return
    position = int(failure.position)
    if status == Status.INDEX_OUT_OF_RANGE and out_of_range is not None:
        raise IndexError(f"{path}: {out_of_range(position)}")
    if status == Status.DECOMPRESS_FAILED:
        raise StorageError(f"{path}: {what(position)} failed to decompress (libblosc2 error {int(failure.code)}); "
                           f"the file is corrupted")
    raise StorageError(f"{path}: gather of {what(position)} failed: {status_name(status)}")


def _check_range_status(spec: FieldSpec, status: int, starts, counts, failure) -> None:
    check_gather(status, failure, spec.name,
                 lambda k: f"the chunk holding element {int(starts[k])}",
                 lambda k: f"elements [{int(starts[k])}, {int(starts[k]) + int(counts[k])}) are out of range for "
                           f"{spec.row_count} elements")


def _check_row_status(spec: FieldSpec, status: int, indices, failure) -> None:
    check_gather(status, failure, spec.name,
                 lambda k: f"chunk {int(indices[k]) // max(spec.chunk_rows, 1)} (holding row {int(indices[k])})",
                 lambda k: f"index {int(indices[k])} at batch position {k} is out of range for {spec.row_count} rows")


def blosc_layout(getitem, context, addresses: np.ndarray, sizes: np.ndarray, row_count: int, chunk_rows: int,
                 block_rows: int, row_bytes: int, batch_size_max: int):
    """The native gather's view of chunked Blosc2 rows (shm_blosc_layout), built in one
    place for one file (BloscField) and for many joined (CombinedBlosc). Returns the
    struct and what its raw pointers point to, which the caller keeps alive with it."""
    block_bytes = block_rows * row_bytes if block_rows > 1 else 0
    block_buffer = np.empty(max(block_bytes, 1), dtype=np.uint8)
    order_count = batch_size_max if block_rows > 1 else 0
    order_buffer = np.empty(max(2 * order_count, 1), dtype=np.uint64)
    layout = ffi.new("shm_blosc_layout *")
    layout.getitem, layout.context = getitem, context
    layout.chunk_addresses = ffi.from_buffer("uint64_t[]", addresses)
    layout.chunk_bytes = ffi.from_buffer("uint64_t[]", sizes)
    layout.chunk_count = len(addresses)
    layout.row_count = row_count
    layout.rows_per_chunk = chunk_rows
    layout.rows_per_block = max(block_rows, 1)
    layout.row_bytes = row_bytes
    layout.block_buffer = ffi.from_buffer("uint8_t[]", block_buffer)
    layout.block_buffer_bytes = block_bytes
    layout.order_buffer = ffi.from_buffer("uint64_t[]", order_buffer)
    layout.order_buffer_count = order_count
    keepalive = (addresses, sizes, block_buffer, order_buffer, layout.chunk_addresses, layout.chunk_bytes,
                 layout.block_buffer, layout.order_buffer)
    return layout, keepalive


class NpyField:
    """A memory-mapped .npy field; gather is a native row copy."""

    remote = None  # The node cache's object, for a field read from a store (_open_cached).
    unit_pages = 1  # What its fills fetch around a needed page (remote.cache.set_fetch_unit).

    def __init__(self, spec: FieldSpec) -> None:
        self.spec = spec
        data_bytes = spec.row_count * spec.row_bytes
        def check(status: os.stat_result) -> None:
            check_identity(spec, status)
            if status.st_size < spec.data_offset + data_bytes:
                raise OSError("the file is shorter than the rows it was described with")

        try:
            # Mapped at the offset the trainer found: no header parsing per reader and file,
            # which matters for fields of thousands of shards. No descriptor stays open.
            self._mapping = map_file(spec.path, check)
        except OSError as error:
            size = os.path.getsize(spec.path) if os.path.exists(spec.path) else "no"
            raise StorageError(
                f"{spec.name}: cannot map the .npy file ({error}); it has {size} bytes now, "
                f"{spec.row_count} rows of {spec.row_bytes} bytes were described (truncated or replaced?)"
            ) from None
        self._map = self._mapping.buffer
        self._array = np.frombuffer(self._map, dtype=np.uint8, count=data_bytes, offset=spec.data_offset)
        self._table = ffi.from_buffer("uint8_t[]", self._array)
        self._failure = ffi.new("shm_gather_error *")

    def gather(self, indices, out) -> None:
        """Writes rows `indices` (in order, duplicates allowed) into `out` (len(indices) * row_bytes)."""
        indices = _check_indices(self.spec, indices)
        out_pointer = _out_pointer(self.spec, out, len(indices))
        self.gather_into(indices, ffi.from_buffer("uint64_t[]", indices), out_pointer, len(out_pointer))

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        """gather() for callers that checked their buffers once (the reader's slots)."""
        status = lib.shm_gather_rows(
            self._table, self.spec.row_count, self.spec.row_bytes,
            index_pointer, len(indices), out_pointer, out_bytes, self._failure,
        )
        _check_row_status(self.spec, status, indices, self._failure)

    def gather_ranges(self, starts: np.ndarray, counts: np.ndarray, destinations: np.ndarray, out_pointer,
                      out_bytes: int) -> None:
        """Copies element ranges of a 1-D field to byte offsets of `out` (uint64 arrays)."""
        status = lib.shm_gather_ranges_raw(
            self._table, self.spec.row_count, self.spec.row_bytes, _u64(starts), _u64(counts), _u64(destinations),
            len(starts), out_pointer, out_bytes, self._failure,
        )
        _check_range_status(self.spec, status, starts, counts, self._failure)

    def extents(self, starts: np.ndarray, counts: np.ndarray, wait: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(file offsets, bytes) under element ranges (starts, counts)."""
        row_bytes = self.spec.row_bytes
        return self.spec.data_offset + starts.astype(np.int64) * row_bytes, counts.astype(np.int64) * row_bytes

    def byte_ranges(self, first_row: int, row_count: int) -> list[tuple[int, int]]:
        """(file offset, bytes) holding rows [first_row, first_row + row_count)."""
        first_row = min(first_row, self.spec.row_count)
        row_count = min(row_count, self.spec.row_count - first_row)
        return [(self.spec.data_offset + first_row * self.spec.row_bytes, row_count * self.spec.row_bytes)]

    def forget(self, offset: int, size: int) -> None:
        forget_mapped(self._mapping, offset, size)

    def close(self) -> None:
        # The mapping goes with the last object that refers to it (a pointer still in use
        # keeps it): dropping this field's references is all closing takes.
        self._table = self._array = self._map = self._mapping = None


_WHOLE_CHUNK = "whole chunk"  # BloscField._block_table: read the chunk whole.


class BloscField:
    """A contiguous Blosc2 frame, mapped into memory; rows are decompressed natively.

    Chunk addresses are computed once from the frame's offset index, one decompression
    context is reused, and only the blocks holding the requested rows are decompressed,
    straight into `out` (one-row blocks) or through one block buffer (larger blocks, where
    rows sharing a block cost one decompression per batch).
    """

    remote = None  # The node cache's object, for a field read from a store (_open_cached).
    unit_pages = 1  # What its fills fetch around a needed page (remote.cache.set_fetch_unit).

    def __init__(self, spec: FieldSpec, batch_size_max: int = 1 << 16, share_blocks: bool = True,
                 verify: bool = False) -> None:
        """`share_blocks=False` decompresses a multi-row block once per row (for measurements).
        `verify=True` checks each chunk's CRC-32 the first time a gather touches it, when
        the file carries checksums (files without them load unchecked)."""
        if not spec.row_contiguous:
            raise StorageError(f"{spec.name}: layout {spec.chunks}/{spec.blocks} is not row-contiguous")
        self.spec = spec
        self._block_rows = spec.block_rows if share_blocks else 1
        self._chunk_blocks = -(-spec.chunk_rows // max(spec.block_rows, 1))  # Blocks per chunk (at most).
        self._capi_ffi, self._capi = _blosc2_capi.load()
        self._schunk = None
        self._context = None
        self._special_by_index = {}  # Chunks Blosc2 builds in memory (all zeros, etc.).
        self._mapping = map_file(spec.path, lambda status: check_identity(spec, status))
        self._map = self._mapping.buffer
        self._checksums = None  # Expected CRC-32 per chunk, until every chunk is verified.
        try:
            self._locate_chunks()
            self._create_context(batch_size_max)
            if verify and spec.checksums:
                self._load_checksums()
        except BaseException:
            self.close()
            raise

    def _locate_chunks(self) -> None:
        spec, capi, capi_ffi = self.spec, self._capi, self._capi_ffi
        file_bytes = len(self._map)
        (header_bytes,) = struct.unpack_from(">i", self._map, _B2FRAME_HEADER_LENGTH_OFFSET)
        if not 0 < header_bytes < file_bytes:
            raise StorageError(f"{spec.name}: corrupted frame header (header length {header_bytes}, file {file_bytes} bytes)")
        schunk = capi.blosc2_schunk_open(spec.path.encode())
        if schunk == capi_ffi.NULL:
            raise StorageError(f"{spec.name}: libblosc2 cannot open the frame (corrupted or truncated file)")
        self._schunk = schunk  # Only a real handle: close() must never free NULL.
        # libblosc2 opened the path again: it must still be the file mapped above, or its
        # offset table would not have the description's chunk count read below.
        check_identity(spec, os.stat(spec.path))
        offsets_pointer = capi.blosc2_frame_get_offsets(self._schunk)
        if offsets_pointer == capi_ffi.NULL:
            raise StorageError(f"{spec.name}: cannot read the frame's chunk offsets (corrupted or truncated file)")
        try:
            offsets = np.frombuffer(capi_ffi.buffer(offsets_pointer, 8 * spec.chunk_count), dtype=np.int64).copy()
        finally:
            capi.free(offsets_pointer)
        base_address = int(ffi.cast("uintptr_t", ffi.from_buffer("uint8_t[]", self._map)))
        self._addresses = np.zeros(spec.chunk_count, dtype=np.uint64)
        self._sizes = np.zeros(spec.chunk_count, dtype=np.uint64)
        in_file = np.flatnonzero(offsets >= 0)
        starts = header_bytes + offsets[in_file]
        if spec.remote and in_file.size:
            # A cached object's chunks are fetched as they are read: their headers cannot be
            # read here. Stored one after another, a chunk reaches to the next one's start
            # (the data's end for the last): a bound the gather accepts (libblosc2 reads each
            # chunk's own length from its header), and the range its pin fetches.
            data_end = min(header_bytes + spec.compressed_bytes, file_bytes)
            if np.any(np.diff(starts) <= 0) or int(starts[-1]) + _CHUNK_HEADER_BYTES > data_end:
                raise StorageError(f"{spec.remote}: its chunks are not stored in order, one after another; re-save "
                                   f"it with `shmloader convert` before uploading it")
            self._addresses[in_file] = base_address + starts
            self._sizes[in_file] = np.diff(np.append(starts, data_end))
        elif in_file.size:
            past_end = np.flatnonzero(starts + _CHUNK_HEADER_BYTES > file_bytes)
            if past_end.size:
                raise StorageError(f"{spec.name}: chunk {int(in_file[past_end[0]])} starts past the end of the file (truncated?)")
            raw = np.frombuffer(self._map, dtype=np.uint8)
            size_bytes = raw[(starts[:, None] + _CHUNK_CBYTES_OFFSET + np.arange(4)).ravel()]
            sizes = size_bytes.view("<i4").astype(np.int64)
            del raw, size_bytes
            bad = np.flatnonzero((sizes < _CHUNK_HEADER_BYTES) | (starts + sizes > file_bytes))
            if bad.size:
                chunk = int(in_file[bad[0]])
                raise StorageError(
                    f"{spec.name}: chunk {chunk} is corrupted or truncated: it claims {int(sizes[bad[0]])} "
                    f"bytes at offset {int(starts[bad[0]])} of a {file_bytes}-byte file"
                )
            self._addresses[in_file] = base_address + starts
            self._sizes[in_file] = sizes
        self._file_offsets = np.full(spec.chunk_count, -1, dtype=np.int64)
        self._file_offsets[in_file] = starts
        # Per chunk, the stored bytes from where it starts (or the next stored chunk, for
        # one Blosc2 builds in memory) and to where it ends (or the previous one's end):
        # the file range under any run of chunks (extents()).
        ends = np.zeros(spec.chunk_count, dtype=np.int64)
        ends[in_file] = starts + self._sizes[in_file].astype(np.int64)
        self._chunk_high = np.maximum.accumulate(np.maximum(ends, header_bytes)) if spec.chunk_count else ends
        low = np.full(spec.chunk_count, file_bytes, dtype=np.int64)
        low[in_file] = starts
        self._chunk_low = np.minimum.accumulate(low[::-1])[::-1]
        for chunk in np.flatnonzero(offsets < 0):
            self._load_special_chunk(int(chunk))

    def _load_special_chunk(self, chunk: int) -> None:
        capi, capi_ffi = self._capi, self._capi_ffi
        chunk_pointer = capi_ffi.new("uint8_t **")
        needs_free = capi_ffi.new("bool *")
        chunk_bytes = capi.blosc2_schunk_get_chunk(self._schunk, chunk, chunk_pointer, needs_free)
        if chunk_bytes < _CHUNK_HEADER_BYTES:
            raise StorageError(f"{self.spec.name}: chunk {chunk} is unreadable (libblosc2 error {chunk_bytes})")
        copy = np.frombuffer(capi_ffi.buffer(chunk_pointer[0], chunk_bytes), dtype=np.uint8).copy()
        if needs_free[0]:
            capi.free(chunk_pointer[0])
        self._special_by_index[chunk] = copy
        self._addresses[chunk] = int(ffi.cast("uintptr_t", ffi.from_buffer("uint8_t[]", copy)))
        self._sizes[chunk] = chunk_bytes

    def _create_context(self, batch_size_max: int) -> None:
        spec, capi, capi_ffi = self.spec, self._capi, self._capi_ffi
        dparams = capi_ffi.new("blosc2_dparams *")
        dparams.nthreads = 1  # One reader process is one core; parallelism comes from readers.
        dparams.typesize = 8
        context = capi.blosc2_create_dctx(dparams[0])
        if context == capi_ffi.NULL:
            raise StorageError(f"{spec.name}: libblosc2 could not create a decompression context")
        self._context = context
        self._getitem = capi_ffi.cast("void *", capi_ffi.addressof(capi, "blosc2_getitem_ctx"))
        self._layout, self._layout_keepalive = blosc_layout(
            ffi.cast("void *", int(capi_ffi.cast("uintptr_t", self._getitem))),
            ffi.cast("void *", int(capi_ffi.cast("uintptr_t", self._context))),
            self._addresses, self._sizes, spec.row_count, spec.chunk_rows, self._block_rows, spec.row_bytes,
            batch_size_max)
        self._failure = ffi.new("shm_gather_error *")

    def gather(self, indices, out) -> None:
        """Writes rows `indices` (in order, duplicates allowed) into `out` (len(indices) * row_bytes)."""
        indices = _check_indices(self.spec, indices)
        capacity = self._layout.order_buffer_count
        if len(indices) > capacity and self._block_rows > 1:
            raise ValueError(f"{self.spec.name}: a batch of {len(indices)} rows exceeds this reader's {capacity}")
        out_pointer = _out_pointer(self.spec, out, len(indices))
        self.gather_into(indices, ffi.from_buffer("uint64_t[]", indices), out_pointer, len(out_pointer))

    def _load_checksums(self) -> None:
        capi, capi_ffi = self._capi, self._capi_ffi
        content, length = capi_ffi.new("uint8_t **"), capi_ffi.new("int32_t *")
        if capi.blosc2_vlmeta_get(self._schunk, CHECKSUM_META.encode(), content, length) < 0:
            raise StorageError(f"{self.spec.name}: its chunk checksums ({CHECKSUM_META}) cannot be read")
        try:
            packed = bytes(capi_ffi.buffer(content[0], length[0]))
        finally:
            capi.free(content[0])
        payload = _msgpack_binary(packed, self.spec.name)
        if len(payload) % 4:
            raise StorageError(f"{self.spec.name}: its {CHECKSUM_META} metadata holds {len(payload)} bytes, not a whole "
                               f"number of 4-byte CRC-32s (corrupted metadata)")
        checksums = np.frombuffer(payload, dtype="<u4")
        if checksums.size != self.spec.chunk_count:
            raise StorageError(
                f"{self.spec.name}: {checksums.size} chunk checksums for {self.spec.chunk_count} chunks (corrupted metadata)"
            )
        self._checksums = checksums
        self._verified = np.zeros(self.spec.chunk_count, dtype=bool)
        self._unverified_count = self.spec.chunk_count

    def _verify_chunks(self, indices: np.ndarray) -> None:
        """Checks the CRC-32 of every chunk these rows touch that this reader has not checked yet."""
        chunks = np.unique(indices // self.spec.chunk_rows)
        chunks = chunks[chunks < self.spec.chunk_count]  # Bad indices are the gather's to report.
        for chunk in chunks[~self._verified[chunks]].tolist():
            found = zlib.crc32(self.chunk_bytes(chunk))
            expected = int(self._checksums[chunk])
            if found != expected:
                raise StorageError(
                    f"{self.spec.name}: chunk {chunk} fails its checksum (stored CRC-32 {expected:#010x}, read "
                    f"{found:#010x}): the file is corrupted. `shmloader verify "
                    f"{'LOCAL_COPY' if self.spec.remote else self.spec.path}` lists every bad chunk."
                )
            self._verified[chunk] = True
            self._unverified_count -= 1
        if self._unverified_count == 0:
            self._checksums = None  # Every chunk checked once: gathers skip this from now on.

    def gather_ranges(self, starts: np.ndarray, counts: np.ndarray, destinations: np.ndarray, out_pointer,
                      out_bytes: int) -> None:
        """Decompresses element ranges of a 1-D field to byte offsets of `out` (uint64
        arrays), touching only the blocks that hold them."""
        if self._checksums is not None and len(starts):
            first = starts.astype(np.int64)
            last = np.maximum(first + counts.astype(np.int64), first + 1) - 1
            first_chunk, last_chunk = first // self.spec.chunk_rows, last // self.spec.chunk_rows
            spans = last_chunk - first_chunk + 1
            chunks = np.repeat(first_chunk, spans) + (np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans))
            self._verify_chunks(chunks.astype(np.uint64) * np.uint64(self.spec.chunk_rows))
        status = lib.shm_gather_ranges_blosc(
            self._layout, _u64(starts), _u64(counts), _u64(destinations), len(starts), out_pointer, out_bytes,
            self._failure,
        )
        _check_range_status(self.spec, status, starts, counts, self._failure)

    def byte_ranges(self, first_row: int, row_count: int) -> list[tuple[int, int]]:
        """(file offset, bytes) of the stored chunks holding rows [first_row, first_row +
        row_count), one range (chunks are stored in order, one after another)."""
        rows = self.spec.chunk_rows
        first = min(first_row // rows, self.spec.chunk_count)
        last = min((first_row + max(row_count, 1) - 1) // rows, self.spec.chunk_count - 1)
        offsets = self._file_offsets[first:last + 1]
        stored = offsets >= 0  # Chunks Blosc2 builds in memory are not in the file.
        if not stored.any():
            return []
        starts, ends = offsets[stored], offsets[stored] + self._sizes[first:last + 1][stored].astype(np.int64)
        return [(int(starts.min()), int(ends.max() - starts.min()))]

    def forget(self, offset: int, size: int) -> None:
        forget_mapped(self._mapping, offset, size)

    def chunk_bytes(self, chunk: int):
        """The bytes of a chunk as stored (a view of the mapped file, or Blosc2's built copy)."""
        offset = int(self._file_offsets[chunk])
        if offset < 0:
            return self._special_by_index[chunk]
        size = int(self._sizes[chunk])
        if self.spec.remote:  # Its size was a bound (see _locate_chunks); its header, pinned now, knows.
            (size,) = struct.unpack_from("<i", self._map, offset + _CHUNK_CBYTES_OFFSET)
        return memoryview(self._map)[offset: offset + size]

    def extents(self, starts: np.ndarray, counts: np.ndarray, wait: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(file offsets, bytes) under element ranges (starts, counts): their whole chunks;
        for a range inside one chunk of a cached object, only the chunk's header and block
        table and the blocks holding it (a row read at random costs its block, not its
        chunk). The headers are pinned first to be read; with `wait` False (the
        read-ahead's call), a chunk whose header is not here yet gives its header alone."""
        starts, counts = starts.astype(np.int64), counts.astype(np.int64)
        last_chunk = self.spec.chunk_count - 1
        first = np.minimum(starts // self.spec.chunk_rows, last_chunk)
        last = np.minimum((starts + np.maximum(counts, 1) - 1) // self.spec.chunk_rows, last_chunk)
        low, high = self._chunk_low[first], self._chunk_high[last]
        sizes = np.where(counts > 0, np.maximum(high - low, 0), 0)
        if self.remote is None or self._checksums is not None or self.unit_pages > 1:
            return low, sizes  # Checksums cover whole chunks; a fetch unit of many pages takes them anyway.
        inside = np.flatnonzero((first == last) & (counts > 0) & (self._file_offsets[first] >= 0))
        if not len(inside):
            return low, sizes
        chunks = np.unique(first[inside])
        tables = (self._file_offsets[chunks], np.minimum(_CHUNK_HEADER_BYTES + 4 * self._chunk_blocks,
                                                          self._sizes[chunks].astype(np.int64)))
        if wait:
            self.remote.pin(*tables)
            ready = np.ones(len(chunks), dtype=bool)
        else:
            ready = self.remote.present(*tables)
        blocks = {int(chunk): self._block_table(int(chunk)) for chunk in chunks[ready]}
        row_bytes, chunk_rows = self.spec.row_bytes, self.spec.chunk_rows
        more_offsets, more_sizes = [tables[0]], [tables[1]]
        for k in inside.tolist():
            table = blocks.get(int(first[k]))
            if table is None:  # Its header is not here yet (read-ahead only): the header alone.
                low[k], sizes[k] = tables[0][chunks == first[k]][0], tables[1][chunks == first[k]][0]
            elif table is not _WHOLE_CHUNK:
                chunk_start, block_bytes, block_starts, block_ends = table
                inner = int(starts[k] % chunk_rows) * row_bytes
                first_block = inner // block_bytes
                last_block = (inner + int(counts[k]) * row_bytes - 1) // block_bytes
                low[k] = chunk_start + block_starts[first_block]
                sizes[k] = block_ends[first_block] - block_starts[first_block]
                if last_block > first_block:  # Blocks may be stored in any order (threads compress them).
                    more_offsets.append(chunk_start + block_starts[first_block + 1:last_block + 1])
                    more_sizes.append(block_ends[first_block + 1:last_block + 1] -
                                      block_starts[first_block + 1:last_block + 1])
        return np.concatenate([*more_offsets, low]), np.concatenate([*more_sizes, sizes])

    def _block_table(self, chunk: int):
        """(chunk start, uncompressed block bytes, each block's start and end in the chunk)
        from a chunk's header (pinned), or _WHOLE_CHUNK where its blocks cannot be told apart
        (a dictionary, a special value, blocks not stored in order)."""
        offset = int(self._file_offsets[chunk])
        header = bytes(memoryview(self._map)[offset: offset + _CHUNK_HEADER_BYTES])
        flags, flags2 = header[2], header[31]
        uncompressed, block_bytes, stored = struct.unpack_from("<iii", header, 4)
        if block_bytes <= 0 or uncompressed <= 0 or flags2 & 0x1 or (flags2 >> 4) & 0x7:
            return _WHOLE_CHUNK  # BLOSC2_USEDICT, or a special chunk (zeros, NaNs, a value).
        count = -(-uncompressed // block_bytes)
        if flags & 0x2:  # BLOSC_MEMCPYED: the blocks as they are, after the header.
            block_starts = _CHUNK_HEADER_BYTES + np.arange(count, dtype=np.int64) * block_bytes
        else:
            if count > self._chunk_blocks or _CHUNK_HEADER_BYTES + 4 * count > stored:
                return _WHOLE_CHUNK
            block_starts = np.frombuffer(self._map, dtype="<i4", count=count,
                                         offset=offset + _CHUNK_HEADER_BYTES).astype(np.int64)
        # A block ends where the next stored one starts: blocks compressed by several threads
        # are stored in the order they finished.
        order = np.argsort(block_starts, kind="stable")
        stored_order = block_starts[order]
        if np.any(np.diff(stored_order) <= 0) or stored_order[0] < _CHUNK_HEADER_BYTES or stored_order[-1] >= stored:
            return _WHOLE_CHUNK
        block_ends = np.empty_like(block_starts)
        block_ends[order] = np.append(stored_order[1:], stored)
        return offset, block_bytes, block_starts, block_ends

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        """gather() for callers that checked their buffers once (the reader's slots)."""
        if self._checksums is not None:
            self._verify_chunks(indices)
        status = lib.shm_gather_blosc(self._layout, index_pointer, len(indices), out_pointer, out_bytes, self._failure)
        _check_row_status(self.spec, status, indices, self._failure)

    def close(self) -> None:
        if self._context is not None:
            self._capi.blosc2_free_ctx(self._context)
            self._context = None
        if self._schunk is not None:
            self._capi.blosc2_schunk_free(self._schunk)
            self._schunk = None
        self._layout = self._layout_keepalive = None
        self._special_by_index = {}
        self._map = self._mapping = None  # Unmapped with the last pointer into it.


class CombinedBlosc:
    """Many row-friendly .b2nd files of one layout read as one: their chunk tables joined,
    so that a batch spread over hundreds of shards is one native gather. A file's row r
    is "virtual" row (its first chunk + r // chunk_rows) * chunk_rows + r % chunk_rows:
    Blosc2 stores every chunk at full size, so chunk c holds virtual rows from c * chunk_rows.
    The parts stay open (their mappings and in-memory chunks back the joined table)."""

    def __init__(self, parts: list[BloscField], batch_size_max: int) -> None:
        first = parts[0]
        for part in parts[1:]:
            if (part.spec.chunk_rows, part._block_rows, part.spec.row_bytes) != \
                    (first.spec.chunk_rows, first._block_rows, first.spec.row_bytes):
                raise ValueError(f"{part.spec.name}: another chunk layout than {first.spec.name}")
        self.parts = parts
        self.chunk_rows = first.spec.chunk_rows
        self.chunk_starts = np.concatenate([[0], np.cumsum([part.spec.chunk_count for part in parts])[:-1]]).astype(np.uint64)
        addresses = np.concatenate([part._addresses for part in parts])
        sizes = np.concatenate([part._sizes for part in parts])
        self._layout, self._layout_keepalive = blosc_layout(
            first._layout.getitem, first._layout.context, addresses, sizes, len(addresses) * self.chunk_rows,
            self.chunk_rows, first._block_rows, first.spec.row_bytes, batch_size_max)
        self._failure = ffi.new("shm_gather_error *")

    def virtual_rows(self, parts: np.ndarray, local: np.ndarray) -> np.ndarray:
        chunk_rows = np.uint64(self.chunk_rows)
        return (self.chunk_starts[parts] + local // chunk_rows) * chunk_rows + local % chunk_rows

    def gather_into(self, virtual_rows: np.ndarray, out_pointer, out_bytes: int) -> None:
        status = lib.shm_gather_blosc(self._layout, _u64(virtual_rows), len(virtual_rows), out_pointer, out_bytes,
                                      self._failure)
        if status != Status.OK:
            chunk = int(virtual_rows[int(self._failure.position)]) // self.chunk_rows
            part = int(np.searchsorted(self.chunk_starts, chunk, side="right")) - 1
            check_gather(status, self._failure, self.parts[part].spec.name,
                         lambda k: f"chunk {chunk - int(self.chunk_starts[part])}", None)


class BloscPythonField:
    """Any other Blosc2 layout, through blosc2's Python API: correct but slow (a warning says so)."""

    remote = None  # The node cache's object, for a field read from a store (_open_cached).
    unit_pages = 1  # What its fills fetch around a needed page (remote.cache.set_fetch_unit).

    def __init__(self, spec: FieldSpec) -> None:
        import blosc2

        self.spec = spec
        check_identity(spec, os.stat(spec.path))
        self._array = blosc2.open(spec.path, mode="r")
        check_identity(spec, os.stat(spec.path))
        if spec.whole_chunks and tuple(spec.chunks[1:]) != tuple(spec.row_shape):
            raise StorageError(f"{spec.name}: its chunks decode right only whole (the DELTA filter or a ZSTD "
                               f"dictionary) and split rows; re-save it with `shmloader convert`")

    def _rows(self, unique: np.ndarray) -> np.ndarray:
        """Rows `unique` (sorted), through blosc2: whole chunks where only those decode right."""
        if not self.spec.whole_chunks:
            return np.stack([self._array[int(index)] for index in unique])
        rows = np.empty((len(unique), *self.spec.row_shape), dtype=self.spec.numpy_dtype)
        chunk_of = unique // self.spec.chunk_rows
        for chunk in np.unique(chunk_of).tolist():
            where = np.flatnonzero(chunk_of == chunk)
            data = np.frombuffer(self._array.schunk.decompress_chunk(chunk), dtype=self.spec.numpy_dtype)
            data = data.reshape(-1, *self.spec.row_shape)
            rows[where] = data[unique[where] - chunk * self.spec.chunk_rows]
        return rows

    def gather(self, indices, out) -> None:
        indices = _check_indices(self.spec, indices)
        out_pointer = _out_pointer(self.spec, out, len(indices))
        self.gather_into(indices, None, out_pointer, len(out_pointer))

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        out = ffi.buffer(out_pointer, out_bytes)
        bad = np.flatnonzero(indices >= self.spec.row_count)
        if bad.size:
            _raise_index_error(self.spec, indices, int(bad[0]))
        target = np.frombuffer(out, dtype=self.spec.numpy_dtype).reshape(len(indices), *self.spec.row_shape)
        unique, inverse = np.unique(indices, return_inverse=True)
        try:
            rows = self._rows(unique) if unique.size else None
        except Exception as error:
            raise StorageError(f"{self.spec.name}: reading rows failed ({type(error).__name__}: {error})") from None
        if rows is not None:
            np.take(rows, inverse, axis=0, out=target)

    def gather_ranges(self, starts, counts, destinations, out_pointer, out_bytes: int) -> None:
        """Rows (ranges of one row each) to byte offsets of `out`, through a staging buffer."""
        if np.any(counts != 1):
            raise ValueError(f"{self.spec.name}: this layout reads whole rows only")
        staged = np.empty((len(starts), *self.spec.row_shape), dtype=self.spec.numpy_dtype)
        pointer = ffi.from_buffer("uint8_t[]", staged.reshape(-1).view(np.uint8))
        self.gather_into(np.ascontiguousarray(starts, dtype=np.uint64), None, pointer, staged.nbytes)
        out = np.frombuffer(ffi.buffer(out_pointer, out_bytes), dtype=np.uint8)
        row_bytes = self.spec.row_bytes
        flat = staged.reshape(len(starts), -1).view(np.uint8)
        for row, destination in enumerate(destinations.tolist()):
            out[destination: destination + row_bytes] = flat[row]

    def close(self) -> None:
        self._array = None


class EmptyRowsField:
    """Rows of zero bytes (shape (N, 0)), or no rows at all (the values of a ragged field whose
    records are all empty): nothing to read, but indices and ranges are still checked."""

    remote = None  # The node cache's object, for a field read from a store (_open_cached).
    unit_pages = 1  # What its fills fetch around a needed page (remote.cache.set_fetch_unit).

    def __init__(self, spec: FieldSpec) -> None:
        self.spec = spec

    def gather(self, indices, out) -> None:
        indices = _check_indices(self.spec, indices)
        self.gather_into(indices, None, _out_pointer(self.spec, out, len(indices)), 0)

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        bad = np.flatnonzero(indices >= self.spec.row_count)
        if bad.size:
            _raise_index_error(self.spec, indices, int(bad[0]))

    def gather_ranges(self, starts, counts, destinations, out_pointer, out_bytes: int) -> None:
        ends = np.asarray(starts, dtype=np.uint64) + np.asarray(counts, dtype=np.uint64)
        bad = np.flatnonzero(ends > self.spec.row_count)
        if bad.size:
            k = int(bad[0])
            raise StorageError(f"{self.spec.name}: elements [{int(starts[k])}, {int(ends[k])}) are out of range for "
                               f"{self.spec.row_count} elements")

    def close(self) -> None:
        pass


def _msgpack_binary(packed: bytes, path: str) -> bytes:
    """The payload of a msgpack bin 8/16/32 value (how Blosc2 stores a bytes vlmeta)."""
    sizes = {0xC4: 1, 0xC5: 2, 0xC6: 4}
    width = sizes.get(packed[0]) if packed else None
    if width is None or len(packed) < 1 + width:
        raise StorageError(f"{path}: its {CHECKSUM_META} metadata is not msgpack binary data")
    length = int.from_bytes(packed[1:1 + width], "big")
    payload = packed[1 + width: 1 + width + length]
    if len(payload) != length:
        raise StorageError(f"{path}: its {CHECKSUM_META} metadata is truncated")
    return payload


class Field(typing.Protocol):
    """What an opened field offers its readers (NpyField, BloscField, BloscPythonField,
    EmptyRowsField; ragged.RaggedField wraps one for its values). Rows and elements are
    uint64; `out_pointer` is a cffi pointer to `out_bytes` writable bytes."""

    spec: FieldSpec

    def gather(self, indices, out) -> None:
        """Rows `indices` into `out`, every argument checked (the public, slow path)."""

    def gather_into(self, indices: np.ndarray, index_pointer, out_pointer, out_bytes: int) -> None:
        """Rows `indices` (uint64, contiguous; `index_pointer` to them, or None) into a buffer
        the caller checked once: a slot's region. Bad rows still raise."""

    def gather_ranges(self, starts: np.ndarray, counts: np.ndarray, destinations: np.ndarray, out_pointer,
                      out_bytes: int) -> None:
        """Element ranges [starts, starts + counts) to byte offsets `destinations` of the output."""

    def close(self) -> None:
        """Drops this process's mapping and native state (idempotent)."""


def open_field(spec: FieldSpec, batch_size_max: int = 1 << 16, verify: bool = False,
               random_access: bool = False) -> Field:
    """Opens a described field for gathering, in whichever process calls it; `verify`
    checks each Blosc2 chunk's CRC-32 the first time it is read (files that carry them).
    `random_access` tells the kernel not to read ahead around a page fault (MADV_RANDOM):
    for rows read in random order, a fault's read-around (read_ahead_kb, up to megabytes)
    is mostly other rows, read for nothing and evicting the cache; the block-local shuffle
    reads ahead itself (readahead.py)."""
    if spec.row_bytes == 0 or spec.row_count == 0:
        return EmptyRowsField(spec)
    if spec.remote:
        return _open_cached(spec, batch_size_max, verify, random_access)
    if spec.kind == "npy":
        field = NpyField(spec)
    elif spec.row_contiguous:
        field = BloscField(spec, batch_size_max, verify=verify)
    else:
        return BloscPythonField(spec)
    if random_access:
        field._mapping.advise(mmap.MADV_RANDOM)
    return field


def _open_cached(spec: FieldSpec, batch_size_max: int, verify: bool, random_access: bool) -> Field:
    """A field over an object's copy in the node cache: opened with its header pages pinned;
    its gathers are pinned by their caller (StepFiller) through `field.remote`."""
    from .remote.cache import cached_object

    if spec.kind == "b2nd" and not spec.row_contiguous:
        raise StorageError(f"{spec.remote}: layout {spec.chunks}/{spec.blocks} is not row-contiguous, which a cached "
                           f"object needs; re-save it with `shmloader convert` before uploading it")
    cached = cached_object(spec.path, spec.remote)
    try:
        with cached.pinned():
            field = NpyField(spec) if spec.kind == "npy" else BloscField(spec, batch_size_max, verify=verify)
    except StorageError as error:  # Named by its URL: the cache's path means nothing to the user.
        raise type(error)(str(error).replace(spec.path, spec.remote)) from None
    field.remote = cached
    if random_access:
        field._mapping.advise(mmap.MADV_RANDOM)
    return field
