"""The record of which blocks of a loader's Blosc2 files its readers have checked, kept in
the loader's ring so that each block is checked once per loader rather than once per reader.

The trainer lays the record out when it creates the ring (`record_pages`, `write_record`);
each reader process finds its files' bits there once it has attached the ring (`attach`),
and BloscField hands them to the native gather (zig/block_digests.zig, Checker), which
sets a block's bit only after the block matched its digest.

What makes a bit set by one reader worth trusting in another: both map the same file (its
device, inode, size and modification time, which each BloscField checked against its own
mapping), so the bytes one reader checked are the bytes the other reads (the page cache's);
the ring is the trainer's (created 0600, this user's), never another user's memory, and it
starts zeroed, so no loader trusts another loader's checks. A file no entry names (another
file, a file changed since the plan, a field in a store, a reader not started by this
loader) keeps a record of its own in its reader's memory, as before.

Record layout (at the ring's checked_offset; little-endian):

    offset          size              field           meaning
    --------------  ----------------  --------------  -------------------------------------------
    0               8                 magic           RECORD_MAGIC
    8               8                 file_count      entries that follow
    16 + 64*i       64                entry i         device, inode, size, mtime_ns of the file,
                                                      chunk_count, digest_stride, bits_offset
                                                      (from the record's start), word_count
    bits_offset     8 * word_count    file i's bits   what blosc_layout's own bits hold: one per
                                                      digest, then one per chunk
"""

from __future__ import annotations

import struct

import numpy as np

RECORD_MAGIC = int.from_bytes(b"SHMLCHKD", "little")
_HEAD = struct.Struct("<QQ")
_ENTRY = struct.Struct("<QQQqQQQQ")
_ENTRY_BYTES = 64
_PAGE_BYTES = 4096
# A record past this is not made (its files keep per-reader records): a ring is sized to
# fit in /dev/shm, and one bit per block of 3 KB rows is 4 MiB per 100 GB of data.
RECORD_BYTES_MAX = 64 << 20

# This process's record: {(device, inode, size, mtime_ns, chunk_count, digest_stride): bits}.
# A reader process serves one loader's ring, attached once (readers/reader.py); elsewhere
# (the trainer, readers=0, tools) it stays empty and every field keeps its own bits.
_attached: dict[tuple[int, ...], np.ndarray] = {}


def digest_stride(spec) -> int:
    """Digests per chunk of a converted file (tools/convert.block_digests): its head, then
    one per block."""
    return 1 + -(-spec.chunk_rows // max(spec.block_rows, 1))


def word_count(chunk_count: int, stride: int) -> int:
    """64-bit words of bits for a file (blosc_layout's own bits: one per digest, one per chunk)."""
    return -(-(chunk_count * stride + chunk_count) // 64)


def shareable(spec) -> bool:
    """Whether readers can share the checks of a field file: a local, row-contiguous .b2nd
    with block digests whose identity was taken (a store's copy has none: its pages are
    fetched into a cache other processes write)."""
    return (getattr(spec, "kind", None) == "b2nd" and bool(spec.row_contiguous) and bool(spec.block_digests)
            and len(spec.identity) == 4 and not spec.remote and spec.chunk_count > 0)


def shared_specs(plans) -> list:
    """The distinct shareable files of a loader's field plans (a ragged field's values too),
    in plan order."""
    found, seen = [], set()
    for plan in plans:
        for part in plan.parts:
            for spec in (part, getattr(part, "values", None)):
                if spec is not None and shareable(spec) and tuple(spec.identity) not in seen:
                    seen.add(tuple(spec.identity))
                    found.append(spec)
    return found


def _entries(specs) -> tuple[list[tuple[int, ...]], int]:
    """Each spec's entry and the record's bytes, or ([], 0) when it would pass RECORD_BYTES_MAX."""
    entries = []
    offset = -(-(_HEAD.size + _ENTRY_BYTES * len(specs)) // 64) * 64
    if not specs:
        return [], 0
    for spec in specs:
        stride = digest_stride(spec)
        words = word_count(spec.chunk_count, stride)
        entries.append((*spec.identity, spec.chunk_count, stride, offset, words))
        offset += -(-8 * words // 64) * 64  # Each file's bits on their own cache lines.
    if offset > RECORD_BYTES_MAX:
        return [], 0
    return entries, offset


def record_pages(specs) -> int:
    """4 KiB pages the ring reserves for the record of `specs` (shared_specs); 0 for none."""
    entries, total = _entries(specs)
    return -(-total // _PAGE_BYTES) if entries else 0


def write_record(memory, offset: int, pages: int, specs) -> None:
    """Writes the record's head and entries at `offset` of the trainer's ring `memory`
    (its bits are the ring's zeroed pages)."""
    entries, total = _entries(specs)
    if not entries:
        return
    assert total <= pages * _PAGE_BYTES, (total, pages)
    _HEAD.pack_into(memory, offset, RECORD_MAGIC, len(entries))
    for index, entry in enumerate(entries):
        _ENTRY.pack_into(memory, offset + _HEAD.size + _ENTRY_BYTES * index, *entry)


def attach(memory, offset: int, pages: int) -> None:
    """Finds this reader's shared bits in its loader's ring (`memory`, the record at
    `offset`, `pages` long). Entries that do not fit the record are ignored (their files
    keep per-reader bits); the ring is the trainer's, but an index is never followed
    unchecked."""
    _attached.clear()
    record_bytes = pages * _PAGE_BYTES
    if record_bytes < _HEAD.size or offset + record_bytes > len(memory):
        return
    magic, count = _HEAD.unpack_from(memory, offset)
    if magic != RECORD_MAGIC or count > (record_bytes - _HEAD.size) // _ENTRY_BYTES:
        return
    for index in range(count):
        *key, bits_offset, words = _ENTRY.unpack_from(memory, offset + _HEAD.size + _ENTRY_BYTES * index)
        device, inode, size, mtime_ns, chunk_count, stride = key
        if words != word_count(chunk_count, stride) or bits_offset % 64 or bits_offset + 8 * words > record_bytes:
            continue
        _attached[tuple(key)] = np.frombuffer(memory, dtype=np.uint64, count=words, offset=offset + bits_offset)


def detach() -> None:
    """Forgets the attached record (a reader's end; tests)."""
    _attached.clear()


def shared_bits(spec, chunk_count: int, stride: int) -> np.ndarray | None:
    """The loader's shared bits for a file whose digests a BloscField loaded (`chunk_count`
    rows of `stride`), or None: keep bits of its own."""
    if not _attached or not shareable(spec):
        return None
    return _attached.get((*spec.identity, chunk_count, stride))
