"""Writes Blosc2 files laid out for random row access (what a file's layout costs: inspection.py)."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import zlib
from collections.abc import Iterable

import numpy as np

from ..errors import StorageError
from ..plan.defaults import usable_cores
from ..storage.layout import choose_layout, compression_params
from ..storage.layout_advice import DEFAULT_BATCH_SIZE
from ..storage.layout_advice import measure as measure_layout
from ..storage.ragged import (
    OFFSETS_NAME,
    SHAPES_NAME,
    VALUES_NAME,
    RaggedSpec,
    describe_ragged,
)
from ..storage.spec import (
    BLOCK_DIGESTS_META,
    CHECKSUM_META,
    FieldSpec,
    check_dtype,
    check_rows,
    describe_field,
)
from .convert_inputs import Member, member_outputs, open_input
from .output import check_output, publishing

__all__ = ["CODECS", "auto_codec", "block_digests", "chunk_checksums", "convert", "split_fields", "verify", "write_checksums",
           "write_ragged"]

CODECS = ("auto", "lz4", "blosclz", "zstd", "none")
# "auto" stores data uncompressed when LZ4 would shrink a sample by less than this: noisy
# pixels gain almost nothing from LZ4 yet pay for its decoding on every read, so
# compression must save enough to pay for itself.
_AUTO_MIN_RATIO = 1.1
# "auto" compresses this many evenly spaced pieces of this many bytes to decide.
_AUTO_SAMPLE_PIECES = 8
_AUTO_SAMPLE_PIECE_BYTES = 256 << 10
# Compression threads: each holds its own buffers, so the converter's memory would grow
# with the core count; a few threads already outrun the input's reading.
_COMPRESS_THREADS_MAX = 4
# Conversion reads its input in pieces of about this many bytes (at least one chunk).
_PIECE_BYTES_TARGET = 64 << 20


def _input_chunk_rows(array) -> int:
    chunks = getattr(array, "chunks", None)
    return int(chunks[0]) if chunks else 1


def convert(
    source,
    output: str | os.PathLike,
    *,
    codec: str = "auto",
    clevel: int = 5,
    rows_per_block: int | None = None,
    force: bool = False,
    progress: bool = True,
    piece_bytes: int = _PIECE_BYTES_TARGET,
    batch_size: int = DEFAULT_BATCH_SIZE,
    notes: list[str] | None = None,
) -> FieldSpec:
    """Writes `source` (a .npy or .b2nd path, or a numpy array) to `output` as a row-friendly .b2nd.

    `codec="auto"` (the default) samples the data and uses LZ4 where it compresses by at
    least 10%, and stores it uncompressed otherwise (faster to read, hardly larger).

    Reads the input in pieces, so inputs larger than memory work; writes to a temporary
    name beside `output` and renames it at the end, so an interrupted conversion never
    leaves a partial file at `output`. About `piece_bytes` of input (at least one chunk of
    input and output) is held in memory at a time. Returns the new file's description.

    A .b2nd input converted with the defaults (codec "auto", no rows_per_block) is first
    measured against convert's layout on a sample, in batches of `batch_size`: where
    convert's would read random rows slower, the output keeps the input's chunks, blocks
    and compression (with checksums added), and says so in `notes`.
    """
    import blosc2

    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    if not isinstance(clevel, int) or not 0 <= clevel <= 9:
        raise ValueError(f"clevel must be an integer in [0, 9], got {clevel!r}")
    if pathlib.Path(output).suffix.lower() == ".npy":
        raise ValueError(f"{output}: convert writes a Blosc2 frame, which a .npy name would misdescribe; name it .b2nd")
    output = check_output(output, (source,) if isinstance(source, (str, os.PathLike)) else (), force)
    if output.is_dir():
        raise FileExistsError(f"{output} is a directory; convert writes a .b2nd file: choose another output")
    from_path = isinstance(source, (str, os.PathLike))
    if not from_path:  # An array, or one field of a structured input (convert_inputs.Member).
        array, source_name = source, getattr(source, "name", "array")
    else:
        source_name = os.fspath(source)
        if not os.path.exists(source_name):
            raise FileNotFoundError(f"input file {source_name} does not exist")
        array = open_input(source_name)
    shape, dtype = tuple(int(extent) for extent in array.shape), np.dtype(array.dtype)
    check_dtype(source_name, dtype)
    check_rows(source_name, shape)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    threads = min(usable_cores(), _COMPRESS_THREADS_MAX)
    kept = None
    if codec == "auto" and rows_per_block is None and from_path and os.path.isfile(source_name) \
            and not isinstance(array, np.ndarray):
        kept = _faster_input_layout(source_name, array, batch_size, threads, notes)
    if kept is not None:
        rows_per_chunk, chunks, blocks, cparams = kept
    else:
        rows_per_chunk, block_rows = choose_layout(shape[0], row_bytes, rows_per_block)
        if codec == "auto":
            codec = auto_codec(array, block_rows * row_bytes, clevel)
        chunks = (rows_per_chunk, *shape[1:])
        blocks = (block_rows, *shape[1:])
        cparams = compression_params(codec, clevel, dtype.itemsize, threads)
    temporary = output.with_name(f".{output.name}.partial-{os.getpid()}")
    piece_rows = rows_per_chunk * max(
        math.ceil(_input_chunk_rows(array) / rows_per_chunk),
        piece_bytes // max(rows_per_chunk * row_bytes, 1),
        1,
    )
    try:
        try:
            target = blosc2.empty(shape, dtype=dtype, chunks=chunks, blocks=blocks, urlpath=str(temporary), mode="w",
                                  cparams=cparams)
        except RuntimeError as error:  # libblosc2 names neither the file nor the reason.
            raise OSError(f"{output}: cannot create the file beside it ({temporary.name}): Blosc2 says "
                          f"{error}; is the directory writable, with room?") from None
        bar = _progress_bar(shape[0] * row_bytes, f"convert {pathlib.Path(source_name).name}", progress)
        for start in range(0, shape[0], piece_rows):
            stop = min(start + piece_rows, shape[0])
            target[start:stop] = np.ascontiguousarray(array[start:stop])
            bar.update((stop - start) * row_bytes)
        bar.close()
        write_checksums(target.schunk)
        del target
        os.replace(temporary, output)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return describe_field(output)


def split_fields(source, output: str | os.PathLike, **options) -> dict[str, FieldSpec]:
    """A structured .npy or .b2nd (or a sparse frame of one) written as one row-friendly
    .b2nd per field, OUTPUT.<field>.b2nd; `options` as convert's. Returns each field's
    description, by field name."""
    source_name = os.fspath(source)
    if not os.path.exists(source_name):
        raise FileNotFoundError(f"input file {source_name} does not exist")
    array = open_input(source_name)
    dtype = np.dtype(array.dtype)
    if dtype.fields is None:
        raise ValueError(f"{source_name}: dtype {dtype} has no fields to split; convert it as it is")
    for name in dtype.names:
        if dtype.fields[name][0].fields is not None:
            raise StorageError(f"{source_name}: field {name!r} is itself structured ({dtype.fields[name][0]}); "
                               f"split it with numpy first")
    paths = member_outputs(os.fspath(output), dtype.names)
    for path in paths.values():
        check_output(path, (source,), options.get("force", False))
    return {name: convert(Member(array, name), path, **options) for name, path in paths.items()}


def is_structured(source) -> bool:
    """Whether `source` (a path) holds a structured array, which convert splits into fields."""
    if not os.path.exists(os.fspath(source)):
        raise FileNotFoundError(f"input file {os.fspath(source)} does not exist")
    return np.dtype(open_input(os.fspath(source)).dtype).fields is not None


def _faster_input_layout(source_name: str, array, batch_size: int, threads: int, notes: list[str] | None):
    """(rows per chunk, chunks, blocks, cparams) of a .b2nd input whose own layout reads
    random rows faster than convert's would (measured on a sample); None otherwise."""
    import dataclasses

    spec = describe_field(source_name)
    if spec.kind != "b2nd" or not spec.row_contiguous:
        return None
    advice = measure_layout(spec, batch_size)
    if advice is None or advice.gain >= 1.0:
        return None
    if notes is not None:
        notes.append(f"kept the input's layout (chunks {spec.chunks}, blocks {spec.blocks}, {spec.codec}): convert's "
                     f"would read random rows at {advice.gain:.2f}x its rate in batches of {batch_size:,} "
                     f"({advice.converted_rows_per_s:,.0f} against {advice.rows_per_s:,.0f} rows/s on a sample); "
                     f"--codec or --rows-per-block writes convert's layout anyway")
    cparams = dataclasses.replace(array.schunk.cparams, nthreads=threads)
    return spec.chunk_rows, spec.chunks, spec.blocks, cparams


def chunk_checksums(schunk) -> np.ndarray:
    """The CRC-32 of every chunk's bytes as stored (little-endian uint32, chunk order)."""
    return np.array([zlib.crc32(schunk.get_chunk(chunk)) for chunk in range(schunk.nchunks)], dtype="<u4")


def block_digests(schunk) -> np.ndarray | None:
    """The digest of every part of every chunk as stored (zig/block_digests.zig: each
    chunk's head, then its blocks; the same count per chunk, unused entries 0), in chunk
    order, or None where a chunk's blocks cannot be told apart (readers then check whole
    chunks against their CRC-32)."""
    from .._native import Status, ffi, lib

    stride = 1 + -(-int(schunk.chunksize) // max(int(schunk.blocksize), 1))
    digests = np.zeros((schunk.nchunks, stride), dtype="<u4")
    parts = ffi.new("uint64_t *")
    for chunk in range(schunk.nchunks):
        stored = schunk.get_chunk(chunk)
        status = lib.shm_chunk_digests(ffi.from_buffer("uint8_t[]", stored), len(stored),
                                       ffi.from_buffer("uint32_t[]", digests[chunk]), stride, parts)
        if status != Status.OK:
            return None
    return digests.reshape(-1)


def write_checksums(schunk) -> None:
    """Stores every chunk's CRC-32 (storage/spec.CHECKSUM_META) and every block's digest
    (BLOCK_DIGESTS_META, where its blocks can be told apart) in the frame's own metadata."""
    schunk.vlmeta[CHECKSUM_META] = chunk_checksums(schunk).tobytes()
    digests = block_digests(schunk)
    if digests is not None:
        schunk.vlmeta[BLOCK_DIGESTS_META] = digests.tobytes()


def verify(path: str | os.PathLike, progress: bool = True) -> list[int]:
    """Checks every chunk of a converted .b2nd against its stored CRC-32 and, where the file
    has them, its blocks' digests (what readers check: a chunk whose bytes match its CRC-32
    but not its stored digests, damaged metadata, would be refused by every reader); returns
    the bad chunks (empty when the file is sound). Raises StorageError for a file without
    checksums."""
    import blosc2

    spec = describe_field(path)
    if spec.kind != "b2nd" or not spec.checksums:
        raise StorageError(
            f"{spec.path} carries no chunk checksums ({CHECKSUM_META}); files written by "
            f"`shmloader convert` do: convert it to add them"
        )
    array = blosc2.open(spec.path, mode="r")  # Keep it: its schunk lives only as long as it does.
    schunk = array.schunk
    expected = np.frombuffer(schunk.vlmeta[CHECKSUM_META], dtype="<u4")
    if expected.size != schunk.nchunks:
        raise StorageError(f"{spec.path}: {expected.size} checksums for {schunk.nchunks} chunks (corrupted metadata)")
    bad = []
    bar = _progress_bar(spec.compressed_bytes, f"verify {pathlib.Path(spec.path).name}", progress)
    for chunk in range(schunk.nchunks):
        try:
            stored = schunk.get_chunk(chunk)
        except Exception:  # A chunk libblosc2 cannot even locate is as bad as a wrong one.
            bad.append(chunk)
            continue
        if zlib.crc32(stored) != int(expected[chunk]):
            bad.append(chunk)
        bar.update(len(stored))
    bar.close()
    if spec.block_digests:
        bad = sorted(set(bad) | set(_chunks_off_their_digests(spec.path, schunk)))
    return bad


def _chunks_off_their_digests(path: str, schunk) -> list[int]:
    """The chunks whose stored blocks do not hash to the digests the file carries."""
    stored = np.frombuffer(schunk.vlmeta[BLOCK_DIGESTS_META], dtype="<u4")
    found = block_digests(schunk)
    if found is None or found.size != stored.size:
        raise StorageError(f"{path}: its block digests ({BLOCK_DIGESTS_META}, {stored.size} entries) do not fit its "
                           f"{schunk.nchunks} chunks (corrupted metadata); convert the file again")
    differs = (found.reshape(schunk.nchunks, -1) != stored.reshape(schunk.nchunks, -1)).any(axis=1)
    return np.flatnonzero(differs).tolist()


def auto_codec(array, block_bytes: int, clevel: int) -> str:
    """What `--codec auto` picks for this data: "lz4" if it pays for its decoding, else "none"."""
    return "lz4" if _lz4_ratio(array, block_bytes, clevel) >= _AUTO_MIN_RATIO else "none"


def _lz4_ratio(array, block_bytes: int, clevel: int) -> float:
    """LZ4's compression ratio on evenly spaced pieces of `array`, in blocks of `block_bytes`."""
    import blosc2

    rows = array.shape[0]
    row_bytes = max(1, array.dtype.itemsize * math.prod(array.shape[1:]))
    piece_rows = max(1, _AUTO_SAMPLE_PIECE_BYTES // row_bytes)
    starts = np.linspace(0, max(rows - piece_rows, 0), _AUTO_SAMPLE_PIECES).astype(int)
    raw_bytes = compressed_bytes = 0
    for start in sorted(set(starts.tolist())):
        piece = np.ascontiguousarray(array[start:start + piece_rows])
        packed = blosc2.compress2(
            piece.tobytes(), codec=blosc2.Codec.LZ4, clevel=max(clevel, 1), typesize=array.dtype.itemsize,
            blocksize=block_bytes, filters=[blosc2.Filter.SHUFFLE if array.dtype.itemsize > 1 else blosc2.Filter.NOFILTER],
        )
        raw_bytes += piece.nbytes
        compressed_bytes += len(packed)
    return raw_bytes / max(compressed_bytes, 1)


def _progress_bar(total_bytes: int, description: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total_bytes, desc=description, unit="B", unit_scale=True, disable=not enabled, leave=False)


# ---- Ragged fields (the reading side is storage/ragged.py) ---------------------------------------

# Blocks of about half a typical record: a record then spans two or three blocks, so
# reading it decodes little beyond its own bytes, while per-block overhead stays small
# against the record. Bounded so that tiny records still share a block of a few KiB and
# huge ones (photos) do not decode megabytes for a crop.
_BLOCK_BYTES_MIN = 4 << 10
_BLOCK_BYTES_MAX = 64 << 10
_BLOCKS_PER_CHUNK = 64
# The converter decides block size and codec from the first records, up to this much.
_SAMPLE_BYTES = 4 << 20
_SAMPLE_RECORDS = 4096


def _choose_block_elements(sizes: np.ndarray, itemsize: int) -> int:
    median_bytes = float(np.median(sizes)) * itemsize if len(sizes) else _BLOCK_BYTES_MIN
    block_bytes = 1 << max(0, math.ceil(math.log2(max(median_bytes / 2, 1))))
    block_bytes = min(max(block_bytes, _BLOCK_BYTES_MIN), _BLOCK_BYTES_MAX)
    return max(1, block_bytes // itemsize)


@dataclasses.dataclass(frozen=True)
class RecordChunk:
    """Many 1-D records back to back, for write_ragged: record i is
    values[sum(lengths[:i]):sum(lengths[:i + 1])]. Importers hand whole row groups over
    this way instead of one Python object per record."""

    values: np.ndarray
    lengths: np.ndarray


def write_ragged(path: str | os.PathLike, records: Iterable, *, codec: str = "auto", clevel: int = 5,
                 force: bool = False) -> RaggedSpec:
    """Writes an iterable of arrays (all of one dtype and one number of dimensions), or of
    RecordChunks of 1-D records, as a ragged field directory. Streams: only the offsets
    (and shapes) stay in memory. Written under a temporary name and renamed at the end, so
    an interrupted write leaves nothing at `path`. `codec="auto"` keeps LZ4 where it saves
    10% on the first records, else stores values uncompressed (encoded images gain nothing)."""
    import blosc2

    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    path = check_output(path, force=force)
    if path.exists() and not (path / VALUES_NAME).is_file():  # force replaces a ragged field, nothing else.
        raise FileExistsError(f"{path} exists and is not a ragged field (no {VALUES_NAME} in it): force replaces only "
                              f"one; remove it yourself, or choose another output")
    iterator = iter(records)
    sample, sample_bytes, sample_records, first = [], 0, 0, None
    for item in iterator:
        item = _as_chunk(item, sample_records, first) if isinstance(item, RecordChunk) else \
            _as_record(item, sample_records, first)
        first = first if first is not None else (item.values if isinstance(item, RecordChunk) else item)
        sample.append(item)
        sample_records += len(item.lengths) if isinstance(item, RecordChunk) else 1
        sample_bytes += item.values.nbytes if isinstance(item, RecordChunk) else item.nbytes
        if sample_bytes >= _SAMPLE_BYTES or sample_records >= _SAMPLE_RECORDS:
            break
    if not sample_records:
        raise ValueError(f"{path}: no records to write")
    dtype, ndim = first.dtype, first.ndim
    check_dtype(str(path), dtype)
    sizes = np.concatenate([item.lengths if isinstance(item, RecordChunk) else [item.size] for item in sample])
    block_elements = _choose_block_elements(sizes, dtype.itemsize)
    chunk_elements = block_elements * _BLOCKS_PER_CHUNK
    if codec == "auto":
        flat = [item.values if isinstance(item, RecordChunk) else item.ravel() for item in sample]
        codec = auto_codec(np.concatenate(flat), block_elements * dtype.itemsize, clevel)
    cparams = compression_params(codec, clevel, dtype.itemsize, 1)
    with publishing(path) as temporary:
        values = blosc2.empty((0,), dtype=dtype, chunks=(chunk_elements,), blocks=(block_elements,),
                              urlpath=str(temporary / VALUES_NAME), mode="w", cparams=cparams)
        offsets, shapes, pending, pending_elements, written = [0], [], [], 0, 0

        def flush(final: bool) -> None:
            nonlocal pending, pending_elements, written
            if not pending:
                return
            flat = np.concatenate(pending)
            keep = len(flat) if final else len(flat) // chunk_elements * chunk_elements
            if keep:
                values.resize((written + keep,))
                values[written:written + keep] = flat[:keep]
                written += keep
            pending, pending_elements = ([flat[keep:]] if keep < len(flat) else []), len(flat) - keep

        def add(item) -> None:
            nonlocal pending_elements
            if isinstance(item, RecordChunk):
                offsets.extend((offsets[-1] + np.cumsum(item.lengths, dtype=np.int64)).tolist())
                values_of = item.values
            else:
                offsets.append(offsets[-1] + item.size)
                shapes.append(item.shape)
                values_of = item.ravel()
            pending.append(values_of)
            pending_elements += values_of.size
            if pending_elements >= 4 * chunk_elements:
                flush(final=False)

        for item in sample:
            add(item)
        for item in iterator:
            index = len(offsets) - 1
            add(_as_chunk(item, index, first) if isinstance(item, RecordChunk) else _as_record(item, index, first))
        flush(final=True)
        write_checksums(values.schunk)
        values = None  # Closes the frame before the directory is renamed.
        _write_small(temporary / OFFSETS_NAME, np.asarray(offsets, dtype=np.uint64))
        if ndim != 1:
            _write_small(temporary / SHAPES_NAME, np.asarray(shapes, dtype=np.uint64).reshape(len(shapes), ndim))
    return describe_ragged(path)


def _as_chunk(chunk: RecordChunk, index: int, first: np.ndarray | None) -> RecordChunk:
    values = np.ascontiguousarray(chunk.values).reshape(-1)
    lengths = np.asarray(chunk.lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths < 0).any() or int(lengths.sum()) != values.size:
        raise ValueError(f"records from {index}: a RecordChunk's lengths must be non-negative and sum to its "
                         f"{values.size} values, got {lengths.size} lengths summing to {int(lengths.sum())}")
    if first is not None and (values.dtype != first.dtype or first.ndim != 1):
        raise ValueError(f"records from {index} are {values.dtype} 1-D records; the first record was {first.dtype} "
                         f"with {first.ndim} dimensions: every record needs the same dtype and dimensions")
    return RecordChunk(values, lengths)


def _as_record(record, index: int, first: np.ndarray | None) -> np.ndarray:
    array = np.ascontiguousarray(record)
    if array.ndim == 0:
        raise ValueError(f"record {index} is a scalar; records are arrays (of one or more dimensions, empty ones included)")
    if first is not None and (array.dtype != first.dtype or array.ndim != first.ndim):
        raise ValueError(f"record {index} is {array.dtype} with {array.ndim} dimensions; the first record was "
                         f"{first.dtype} with {first.ndim}: every record needs the same dtype and dimensions")
    return array


def _write_small(path: pathlib.Path, array: np.ndarray) -> None:
    """Offsets or shapes: small, uncompressed-friendly, read whole by every reader."""
    convert(array, path, codec="lz4", progress=False)
