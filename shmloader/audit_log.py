"""The audit log (audit_log=path): what a trainer's loader delivered, step by step, appended
to a file that `shmloader audit` reads back (tools/audit.py proves from it).

A log is a file of records that one writer (AuditWriter: mapped, locked) copies in per
delivered step, so a trainer killed with SIGKILL leaves every record it finished whole in
the page cache, then zeros (the reserve it had mapped). A record cut short by the kill has
no kind yet (it is stored last); the reader stops there, noting a torn last record unless
only zeros follow, and the next writer of the file (a resumed run) cuts both off. A bad
record followed by a whole one is damage, a problem: a kill leaves nothing whole after it.

Layout (little-endian):

    offset  size  field
    0       8     magic b"SHMAUDIT"          once, at the start of the file
    8       4     version (u32)              LOG_VERSION
    then records, each:
    0       4     kind b"SEGM" or b"STEP"
    4       4     payload_bytes (u32)
    8       ..    payload
    ..      4     CRC-32 of kind, payload_bytes and payload

A SEGM payload is JSON (spaces after it to a multiple of 4 bytes, so that a STEP's indices
are 4-byte aligned): where a run of deliveries starts (a new loader, a resume, a seek, a
new pass) and what it is: the pass (its settings and rows per epoch), the shard, batch
size, the stream position it starts at (`position`: a resume's checkpoint position) and
what turns a step into stream positions (global_batch, offset). A STEP payload:

    0       8     segment id (u64)          the SEGM it belongs to
    8       8     step (u64)
    16      4     rows (u32)                 rows delivered
    20      4     padded (u32)               of them, the last `padded` repeat a row (Batch.padding)
    24      4     flags (u32)                bit 0: row indices as u32 (else u64)
    28      ..    row indices                global row indices, in the batch's order
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import mmap
import os
import socket
import stat
import struct
import time
import zlib

import numpy as np

from .plan.checkpoint import position_of
from .plan.sampler import Sampler

LOG_MAGIC = b"SHMAUDIT"
LOG_VERSION = 1
_FILE_HEADER = struct.Struct("<8sI")
_RECORD_HEADER = struct.Struct("<4sI")
_CRC = _LENGTH = struct.Struct("<I")
_STEP = struct.Struct("<QQIII")
SEGMENT_KIND, STEP_KIND = b"SEGM", b"STEP"
_STEP_HEAD = struct.Struct("<IQQIII")  # payload_bytes, then the STEP payload's header
_STEP_KIND_CRC = zlib.crc32(STEP_KIND)
_FLAG_U32 = 1
# A record's payload is at most this: a batch of BATCH_SIZE_MAX u64 indices and its header;
# a larger length read back is damage, not a record (the reader never allocates past it).
PAYLOAD_BYTES_MAX = (1 << 24) * 8 + _STEP.size
# The mapped file grows by this much at a time (a few thousand steps of 256 rows).
_GROWTH_BYTES = 4 << 20
# How long opening waits for a killed writer's lock: its forked readers share the open
# file, and exit once they see the trainer gone.
_LOCK_WAIT_SECONDS = 10.0
# The settings of a sampler that do not change what a pass is: the shape a resume may
# change (plan/checkpoint.py ELASTIC_SETTINGS) and where its run started.
_NOT_THE_PASS = ("batch_size", "shard_index", "shard_count", "transition", "start_position")


def log_path(path, shard_index: int, shard_count: int) -> str:
    """The file rank `shard_index` writes: `path` with "{rank}" replaced by the shard index,
    or, without "{rank}" and with several shards, `path` + ".rank<index>"."""
    path = os.fspath(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(shard_index))
    return path if shard_count == 1 else f"{path}.rank{shard_index}"


def pass_of(sampler, sources: list[dict]) -> tuple[dict, str]:
    """(what the pass is, its id): the sampler's settings less the shape a resume may change,
    and the sources; a resumed or resharded run of the pass has the same id."""
    key = {name: value for name, value in sampler.to_dict().items() if name not in _NOT_THE_PASS}
    key["sources"] = sources
    text = json.dumps(key, sort_keys=True, default=str)
    return key, hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class AuditWriter:
    """Writes a loader's records into its log file: begin() at each placement (a segment),
    step() per delivered batch. Owned by the loader's Resources, which close() it; it
    refers to no session, cursor or loader.

    The file is mapped and grown _GROWTH_BYTES at a time (reserved with posix_fallocate, so
    a full disk is an OSError there, not a SIGBUS later), and a record is copied into the
    mapping: no system call per step, and a record is in the page cache, whatever becomes of
    the process, once copied. Its kind is stored last, so a record cut short by a kill reads
    as no record. One writer per file: an exclusive flock, held until close(), refuses a
    second. Opening cuts a killed writer's zeros and torn record off; close() cuts the unused
    reserve."""

    def __init__(self, path: str) -> None:
        self.path, self.fd, self._map, self._words = path, -1, None, None
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags, 0o644)
        except OSError as error:
            raise OSError(error.errno, f"audit_log: cannot open {path!r} to write to: {error.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise ValueError(f"audit_log: {path!r} is not a regular file")
            _lock(self.fd, path)
            self.end = _whole_end(self.fd, path)
            os.ftruncate(self.fd, self.end)
        except BaseException:
            self.close()
            raise
        self._map_start = self._map_end = self.end
        self.segment = 0
        self.pending = None  # A segment's header, written with its first step (a placement undone delivers none).
        self.padding_of = None  # finite.padding where the segment's pass pads, else None.
        self.small = True  # Row indices fit u32.
        self._counter = 0

    def begin(self, header: dict, padding_of, small: bool) -> None:
        """A new segment: `header` (see the module docstring) is written with its first step."""
        self._counter += 1
        digest = hashlib.blake2b(f"{os.getpid()}/{time.time_ns()}/{id(self)}/{self._counter}".encode(),
                                 digest_size=8).digest()
        self.segment = int.from_bytes(digest, "little")
        self.pending = {**header, "segment": self.segment, "started_ns": time.time_ns(), "pid": os.getpid(),
                        "host": socket.gethostname()}
        self.padding_of, self.small = padding_of, small

    def step(self, batch) -> None:
        """Writes the record of a delivered batch: its header packed and its indices copied
        straight into the mapping (cast to u32 where the rows fit), then its CRC, then its kind."""
        if self.pending is not None:
            payload = json.dumps(self.pending, sort_keys=True).encode()
            self.pending = None
            self._put(SEGMENT_KIND, payload + b" " * (-len(payload) % 4))  # Records stay 4-byte aligned.
        indices, step = batch.indices, batch.step
        rows = len(indices)
        padded = 0 if self.padding_of is None else self.padding_of(step)
        if not self.small:
            self._put(STEP_KIND, _STEP.pack(self.segment, step, rows, padded, 0) + indices.tobytes())
            return
        payload_bytes = _STEP.size + 4 * rows
        size = _RECORD_HEADER.size + payload_bytes + _CRC.size
        if self.end + size > self._map_end:
            self._grow(size)
        at = self.end - self._map_start
        mapping = self._map
        _STEP_HEAD.pack_into(mapping, at + 4, payload_bytes, self.segment, step, rows, padded, _FLAG_U32)
        first = (at + _RECORD_HEADER.size + _STEP.size) >> 2
        self._words[first:first + rows] = indices  # Records are 4-byte aligned (see _put).
        crc_at = at + size - _CRC.size
        _CRC.pack_into(mapping, crc_at, zlib.crc32(mapping[at + 4:crc_at], _STEP_KIND_CRC))
        mapping[at:at + 4] = STEP_KIND  # Last: the record is whole once its kind is there.
        self.end += size

    def _put(self, kind: bytes, payload: bytes) -> None:
        size = _RECORD_HEADER.size + len(payload) + _CRC.size
        assert size % 4 == 0, size  # Every record keeps the next one's indices 4-byte aligned.
        if self.end + size > self._map_end:
            self._grow(size)
        length = _LENGTH.pack(len(payload))
        at = self.end - self._map_start
        self._map[at + 4:at + size] = length + payload + _CRC.pack(zlib.crc32(payload, zlib.crc32(kind + length)))
        self._map[at:at + 4] = kind  # Last: the record is whole once its kind is there.
        self.end += size

    def _grow(self, size: int) -> None:
        """Maps the file from the page holding `end` on, reserved for `size` bytes and more."""
        if self._map is not None:
            self._words = None  # The view goes first: a mapping with views of it cannot close.
            self._map.close()
            self._map = None
        start = self.end - self.end % mmap.ALLOCATIONGRANULARITY
        length = max(_GROWTH_BYTES, self.end - start + size)
        try:
            os.posix_fallocate(self.fd, start, length)
        except OSError as error:
            raise OSError(error.errno, f"audit_log: cannot grow {self.path!r} by {length} bytes: "
                                       f"{error.strerror}") from None
        self._map = mmap.mmap(self.fd, length, offset=start)
        self._words = np.frombuffer(self._map, dtype=np.uint32)  # What step() copies indices into.
        self._map_start, self._map_end = start, start + length

    def close(self) -> None:
        """Unmaps the file, cuts the unused reserve, closes it (and so gives up the lock)."""
        mapping, fd, self._map, self.fd, self._words = self._map, self.fd, None, -1, None
        if mapping is not None:
            mapping.close()
        if fd >= 0:
            try:
                if hasattr(self, "end"):
                    os.ftruncate(fd, self.end)
            finally:
                os.close(fd)


def _lock(fd: int, path: str) -> None:
    """Takes the file's exclusive lock, waiting a bounded time for a killed writer's forked
    reader (it shares the lock) to notice and exit."""
    deadline = time.monotonic() + _LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ValueError(f"audit_log: {path!r} is being written by another loader (its lock held for "
                                 f"{_LOCK_WAIT_SECONDS:.0f} s); give each loader its own file (\"{{rank}}\" in the "
                                 f"path is replaced by shard_index)") from None
            time.sleep(0.05)


def _whole_end(fd: int, path: str) -> int:
    """Where the file's whole records end (its header written to an empty file): a killed
    writer's reserve and a torn record after them are cut off by the caller."""
    size = os.fstat(fd).st_size
    if size == 0:
        os.write(fd, _FILE_HEADER.pack(LOG_MAGIC, LOG_VERSION))
        return _FILE_HEADER.size
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
        if size < _FILE_HEADER.size or _FILE_HEADER.unpack_from(data) != (LOG_MAGIC, LOG_VERSION):
            raise ValueError(f"audit_log: {path!r} exists and is not a version-{LOG_VERSION} audit log; give a "
                             f"new path (it is not overwritten)")
        offset = _FILE_HEADER.size
        while offset < size:
            found = _record_at(data, offset)
            if isinstance(found, str):
                if _next_record(data, offset + 1) is not None:  # Damage, not a kill's cut: never cut off.
                    raise ValueError(f"audit_log: {path!r} has a damaged record at byte {offset} ({found}) with whole "
                                     f"records after it; `shmloader audit` it as it is, and give a new path")
                break
            offset = found[2]
    return offset


class AuditIterator:
    """The loader's iterator with audit_log: the session's own iterator (the cursor, or
    readers=0's LocalIterator), each batch recorded before it is handed out. It refers to
    the inner iterator and the writer only (the lifetimes in session.py hold)."""

    __slots__ = ("inner", "writer", "_step")

    def __init__(self, inner, writer: AuditWriter) -> None:
        self.inner, self.writer, self._step = inner, writer, writer.step

    def __iter__(self) -> AuditIterator:
        return self

    def __next__(self):
        batch = next(self.inner)
        self._step(batch)
        return batch


# Reading a log back.

@dataclasses.dataclass
class Segment:
    header: dict
    path: str
    order: int  # its place among the file's segments
    records: list = dataclasses.field(default_factory=list)  # (step, rows array, padded)


@dataclasses.dataclass
class LogFile:
    path: str
    segments: list
    notes: list  # a torn last record, left out
    problems: list  # damage inside the file: what follows it is not read


def read_log(path: str) -> LogFile:
    """Every segment of the log at `path` with its steps; a torn last record is left out
    (noted), damage before the end is a problem and ends the reading there."""
    with open(path, "rb") as file:
        data = file.read()
    log = LogFile(path, [], [], [])
    if len(data) < _FILE_HEADER.size or _FILE_HEADER.unpack_from(data)[0] != LOG_MAGIC:
        log.problems.append(f"{path}: not an audit log (no {LOG_MAGIC!r} header)")
        return log
    version = _FILE_HEADER.unpack_from(data)[1]
    if version != LOG_VERSION:
        log.problems.append(f"{path}: audit log version {version}, this shmloader reads {LOG_VERSION}")
        return log
    segments, offset = {}, _FILE_HEADER.size
    while offset < len(data):
        found = _record_at(data, offset)
        if isinstance(found, str) and not data[offset:].strip(b"\0"):
            break  # A killed writer's reserve: no record was begun there.
        if isinstance(found, str):
            following = _next_record(data, offset + 1)
            if following is None:  # Nothing whole after it: a write cut short by a kill.
                log.notes.append(f"{path}: a torn last record at byte {offset} (a writer stopped mid-write) left "
                                 f"out")
            else:
                log.problems.append(f"{path}: a damaged record at byte {offset} ({found}), followed by whole "
                                    f"records: its rows are not counted")
            if following is None:
                break
            offset = following
            continue
        kind, payload, offset = found
        if kind == SEGMENT_KIND:
            header = json.loads(payload)
            segments[header["segment"]] = segment = Segment(header, path, len(segments))
            log.segments.append(segment)
            continue
        segment_id, step, rows, padded, flags = _STEP.unpack_from(payload)
        dtype = np.uint32 if flags & _FLAG_U32 else np.uint64
        indices = np.frombuffer(payload, dtype=dtype, count=rows, offset=_STEP.size).astype(np.int64)
        segment = segments.get(segment_id)
        if segment is None:
            log.problems.append(f"{path}: step {step} names segment {segment_id:#x}, whose header the file lacks")
            continue
        segment.records.append((step, indices, padded))
    return log


def _next_record(data: bytes, offset: int) -> int | None:
    """Where the first whole record at or after `offset` starts, None where none does."""
    while offset < len(data):
        starts = [found for found in (data.find(SEGMENT_KIND, offset), data.find(STEP_KIND, offset)) if found >= 0]
        if not starts:
            return None
        offset = min(starts)
        if not isinstance(_record_at(data, offset), str):
            return offset
        offset += 1
    return None


def _record_at(data: bytes, offset: int):
    """(kind, payload, next offset) of the record at `offset`, or why there is none."""
    if offset + _RECORD_HEADER.size > len(data):
        return "a record header past the end"
    kind, size = _RECORD_HEADER.unpack_from(data, offset)
    if kind not in (SEGMENT_KIND, STEP_KIND):
        return f"unknown kind {kind!r}"
    if size > PAYLOAD_BYTES_MAX:
        return f"a payload of {size} bytes"
    end = offset + _RECORD_HEADER.size + size
    if end + _CRC.size > len(data):
        return "its payload runs past the end"
    payload = data[offset + _RECORD_HEADER.size:end]
    if _CRC.unpack_from(data, end)[0] != zlib.crc32(data[offset:end]):
        return "its CRC-32 disagrees"
    if kind == STEP_KIND:
        if size < _STEP.size:
            return "a step record shorter than its header"
        rows, flags = _STEP.unpack_from(payload)[2], _STEP.unpack_from(payload)[4]
        if _STEP.size + rows * (4 if flags & _FLAG_U32 else 8) != size:
            return f"a step record of {rows} rows in {size} bytes"
    else:
        try:
            header = json.loads(payload)
        except ValueError:
            return "a segment header that is not JSON"
        if not isinstance(header, dict) or not _SEGMENT_KEYS <= set(header):
            return "a segment header without the keys a writer records"
    return kind, payload, end + _CRC.size


_SEGMENT_KEYS = {"segment", "pass", "pass_id", "rows", "epochs", "drop_last", "shard_index", "shard_count",
                 "batch_size", "global_batch", "offset", "own_streams", "epoch_positions", "position", "reason",
                 "started_ns"}


def open_writer(path, sampler) -> AuditWriter:
    """The writer of audit_log=`path` for a loader filling with `sampler` (check_auditable)."""
    check_auditable(sampler)
    return AuditWriter(log_path(path, sampler.shard_index, sampler.shard_count))


def begin_segment(writer: AuditWriter, sampler, finite, sources: list[dict], step: int, reason: str,
                  position: int | None = None) -> None:
    """Starts `writer`'s segment of the steps from `step`, at stream `position` (by default
    where `step` starts: plan/checkpoint.py position_of)."""
    if position is None:
        position = position_of(sampler, step)[0]
    writer.begin(segment_header(sampler, finite, sources, step, position, reason),
                 finite.padding if finite is not None and finite.pads else None, sampler.length <= 1 << 32)


def segment_header(sampler, finite, sources: list[dict], step: int, position: int, reason: str) -> dict:
    """What a segment's SEGM record says (see the module docstring): the pass, the shard and
    how its steps map to stream positions, from `step` at stream `position` on."""
    key, pass_id = pass_of(sampler, sources)
    tail = None if finite is None else finite.tail
    return {"pass": key, "pass_id": pass_id, "rows": sampler.length, "mode": sampler.mode,
            "epochs": None if finite is None else finite.epochs, "drop_last": bool(finite and finite.drop_last),
            "shard_index": sampler.shard_index, "shard_count": sampler.shard_count, "batch_size": sampler.batch_size,
            "global_batch": sampler.global_batch, "offset": sampler.offset, "own_streams": sampler.shard_blocks,
            "epoch_positions": sampler.epoch_positions(), "position": position, "step": step, "reason": reason,
            "tail_first_step": None if tail is None else tail.first_step}


def check_auditable(sampler) -> None:
    """Refuses audit_log for a stream without the promise it proves: each row once an epoch."""
    if not isinstance(sampler, Sampler):
        raise ValueError(f"audit_log records the loader's own order over one source; this loader's batches come "
                         f"from a {type(sampler).__name__} (a mixture or an index_table), whose epochs it cannot "
                         f"check: leave audit_log unset")
    if sampler.mode == "random":
        raise ValueError("audit_log proves each row once an epoch; mode='random' draws rows with replacement, so "
                         "there is nothing to prove: use mode='shuffle' or 'sequential', or leave audit_log unset")
