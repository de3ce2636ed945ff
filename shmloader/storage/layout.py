"""The layout cost model: which Blosc2 chunk and block shapes read random rows fast, and
what a given file's layout costs per random row by a model (which files layout_advice.py measures)."""

from __future__ import annotations

import math
import pathlib

from .spec import FieldSpec

# Blocks of about this many bytes: one row per block for image-sized rows, and enough
# small rows (labels) per block that the block header and call overhead stay negligible.
_BLOCK_BYTES_TARGET = 4096
# Chunks of at most this many bytes, so that converting needs little memory.
_CHUNK_BYTES_TARGET = 4 << 20
# libblosc2's getitem walks a chunk's blocks up to the one it needs, so a random row in a
# chunk of many one-row blocks pays for that walk; a few dozen blocks keep it short while
# chunks stay large enough for the frame's index to be small (bench/RESULTS.md).
_BLOCKS_PER_CHUNK_MAX = 64
# The model's parameters: rough single-core decompression rates (bytes per microsecond)
# and the fixed cost of one getitem call. Only their ratios matter: the model compares a
# layout with the one `convert` writes, it does not predict a machine's timings.
_DECOMPRESS_BYTES_PER_US = {"LZ4": 6000.0, "BLOSCLZ": 6000.0, "LZ4HC": 6000.0, "ZSTD": 700.0, "ZLIB": 300.0}
_UNKNOWN_CODEC_BYTES_PER_US = 300.0
_ROW_CALL_OVERHEAD_US = 1.0
# A layout is flagged when a random row costs this many times what a row-friendly file
# would, and at least this many microseconds.
_POOR_LAYOUT_RATIO = 4.0
_POOR_LAYOUT_MIN_US = 10.0


def choose_layout(row_count: int, row_bytes: int, rows_per_block: int | None = None) -> tuple[int, int]:
    """(rows per chunk, rows per block) for random row access."""
    if rows_per_block is None:
        rows_per_block = max(1, _BLOCK_BYTES_TARGET // max(row_bytes, 1))
    if rows_per_block < 1:
        raise ValueError(f"rows_per_block must be at least 1, got {rows_per_block}")
    rows_per_block = min(rows_per_block, row_count)
    blocks_per_chunk = max(1, min(_BLOCKS_PER_CHUNK_MAX, _CHUNK_BYTES_TARGET // max(rows_per_block * row_bytes, 1)))
    # Blosc2 chunks must stay below 2 GiB.
    blocks_per_chunk = min(blocks_per_chunk, max(1, (1 << 30) // max(rows_per_block * row_bytes, 1)))
    rows_per_chunk = min(rows_per_block * blocks_per_chunk, math.ceil(row_count / rows_per_block) * rows_per_block)
    return rows_per_chunk, rows_per_block


def estimate_row_cost_us(spec: FieldSpec) -> float:
    """A model of the cost of reading one random row, from the layout and codec alone."""
    if spec.kind == "npy":
        return _ROW_CALL_OVERHEAD_US / 4
    rate = _DECOMPRESS_BYTES_PER_US.get(spec.codec.upper(), _UNKNOWN_CODEC_BYTES_PER_US)
    if spec.clevel == 0:
        rate = 10000.0
    if not spec.row_contiguous:
        return 50.0 + math.prod(spec.blocks) * spec.numpy_dtype.itemsize / rate
    decompressed_bytes = max(spec.block_rows, 1) * spec.row_bytes
    return _ROW_CALL_OVERHEAD_US + decompressed_bytes / rate


def row_friendly_cost_us(spec: FieldSpec) -> float:
    """The same model for the layout `convert` would write, with LZ4."""
    _, block_rows = choose_layout(spec.row_count, spec.row_bytes)
    return _ROW_CALL_OVERHEAD_US + block_rows * spec.row_bytes / _DECOMPRESS_BYTES_PER_US["LZ4"]


def poor_layout(spec: FieldSpec) -> bool:
    """Whether the model says random rows of this file cost far more than after `shmloader
    convert`: the files worth measuring (layout_advice.py measures before anything is advised)."""
    if spec.kind != "b2nd":
        return False
    cost = estimate_row_cost_us(spec)
    return cost >= _POOR_LAYOUT_MIN_US and cost >= _POOR_LAYOUT_RATIO * row_friendly_cost_us(spec)


def convert_command(spec: FieldSpec) -> str:
    if spec.remote:  # convert reads local files and writes to a store: from a local copy of the source.
        stem, _, suffix = spec.remote.rpartition(".")
        return f"shmloader convert LOCAL_COPY.{suffix} {stem}.rows.{suffix}"
    path = pathlib.Path(spec.path)
    return f"shmloader convert {path} {path.with_name(path.stem + '.rows' + path.suffix)}"


def compression_params(codec: str, clevel: int, itemsize: int, threads: int):
    """Blosc2's CParams for codec "lz4", "blosclz", "zstd" or "none" (convert decides "auto" first), for fixed rows and
    ragged values alike. "none" is LZ4 at level 0: stored, with Blosc2's framing."""
    import blosc2

    return blosc2.CParams(
        codec={"lz4": blosc2.Codec.LZ4, "blosclz": blosc2.Codec.BLOSCLZ, "zstd": blosc2.Codec.ZSTD,
               "none": blosc2.Codec.LZ4}[codec],
        clevel=0 if codec == "none" else clevel,
        typesize=itemsize,
        nthreads=threads,
        # Byte shuffle helps multi-byte types compress; on 1-byte types it does nothing
        # but libblosc2 still runs a scalar byte loop over every decompressed block.
        filters=[blosc2.Filter.SHUFFLE] if itemsize > 1 else [blosc2.Filter.NOFILTER],
        filters_meta=[0],
    )
