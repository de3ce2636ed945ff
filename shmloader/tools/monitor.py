"""`shmloader top`: a live, read-only view of every loader on this machine, from their rings.

Each ring in /dev/shm is read with pread (nothing is written or mapped, no lock is taken
but the shared probe of its owner lock; an entry whose header fails the layout's arithmetic
is listed as foreign and not read, see inspect) and sampled: its header, every slot's state, every reader
record (pid, busy and starved time, batches, skipped records). Rates come from two samples:
rows/s is batches filled times the batch size per second; a reader's busy and starved
shares are its busy_ns and starved_ns per elapsed ns, held within 0-100%: a reader adds a
fill's whole time to busy_ns when it publishes the batch, so a fill begun before the
earlier sample lands wholly in the later one (a 2.5 s fill read over 0.1 s would be 2,500%).

What top cannot know, because the ring does not hold it (loader.stats() does, in the
trainer's memory):
- Restarts before top began. A reader record whose pid changed between two samples is a
  restart, so top counts the restarts it saw, and says for how long it watched ("restarts
  seen 0 in 0.5 s" after --once); loader.stats()["reader_restarts"] counts them all.
- A replaced reader's work. When the trainer replaces a reader (readers/pool.py's
  _keep_stats) it moves the record's counters into its own memory and zeroes them, so the
  record, and top, shows the new process's batches and skipped records alone ("batches by
  this pid"); loader.stats()["readers"] adds the replaced processes' to them.
The ring would need a field for each (a restart count beside the trainer pid in
shm_ring_header, the replaced readers' batches in shm_reader_record) for top to show
them. The trainer's wait is there (ring.h's waited_ns, per slot), and what only the trainer
knows of its readers' work, which the counters cannot say (whether a transform or a
dataset runs, whether a field is compressed, the stored bytes of a row: a slot holds a
transform's outputs, a fraction of the row read), it writes once into the header
(row_bytes_bits, runs, auto_most): so top names the stage that limits each loader
(readers/bottleneck.py) as stats()["bottleneck"] does, the page cache's (memory) verdict
included, with the node cache's evictions from the ledger its local readers hold open. The
disks it compares disk reads with are those of the files a local reader holds open
(readers/disk_device.py).

The screen is drawn with rich where it is installed (pip install "shmloader[monitor]"),
else as plain text; `--once` prints one sample and exits.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import stat
import time

from .._native import ffi
from ..errors import SharedMemoryError
from ..ring import backing
from ..plan.cpu_quota import cpu_quota, quota_throttled, quota_used_ns
from ..plan.options import BATCH_SIZE_MAX, READER_RECORDS_MAX, SLOTS_MAX, SLOTS_MIN
from ..ring.layout import (
    HEADER_BYTES,
    OWNER_SHIFT,
    PAGE_BYTES,
    READER_RECORD_BYTES,
    READER_SKIP_OFFSET,
    RING_MAGIC,
    RING_VERSION,
    SHM_DIRECTORY,
    SLOT_CONTROL_BYTES,
    STATE_MASK,
    RingLayout,
    SlotState,
)
from ..readers.bottleneck import ReaderCounters, Reading, context_of_header, diagnose, trim_window, with_processes
from ..readers.disk_device import DiskRates, disk_counters, disks_of_reader
from ..readers.page_cache import memory_counters
from ..readers.proc_counters import child_of, cores_counters
from ..remote.node import evicted_bytes_of
from ..ring.stale import lock_free

_SEGMENT = re.compile(r"^shml_(\d{1,10})_[0-9a-f]{12}$")
# One letter per slot state on the screen.
STATE_LETTERS = {SlotState.IDLE: ".", SlotState.REQUESTED: "r", SlotState.FILLING: "F", SlotState.READY: "R",
                 SlotState.HELD: "H", SlotState.FAILED: "X"}
# Samples of rows/s kept for a ring's sparkline.
HISTORY_SAMPLES = 40
_SPARKS = "▁▂▃▄▅▆▇█"


@dataclasses.dataclass
class ReaderSample:
    pid: int
    busy_ns: int
    batches: int
    starved_ns: int
    skipped: int
    user_ns: int = 0
    read_ns: int = 0
    fetch_ns: int = 0


@dataclasses.dataclass
class RingSample:
    """One reading of a ring: taken at `at_ns` (CLOCK_MONOTONIC)."""

    name: str
    trainer_pid: int
    trainer_alive: bool
    batch_size: int
    states: list[tuple[SlotState | None, int, int]]  # (state, owner, step) per slot
    readers: list[ReaderSample]
    at_ns: int
    waited_ns: int = 0  # next()'s waits, summed over the slots' lines (ring.h)
    reading: Reading | None = None  # the same counters, with the readers' /proc ones, for diagnose()
    work: tuple[int, int, int] = (0, 0, 0)  # what the readers run: the header's (row_bytes_bits, runs, auto_most)


def ring_names(directory: str = SHM_DIRECTORY) -> list[str]:
    """The ring segments in `directory`, oldest trainer first."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    return sorted((entry for entry in entries if _SEGMENT.match(entry)), key=lambda entry: int(entry.split("_")[1]))


@dataclasses.dataclass
class Foreign:
    """An entry named like a ring that is not one this shmloader made or can read safely:
    listed by name and why, never read further."""

    name: str
    reason: str


# A foreign entry's bytes are read with pread of bounded size, never mapped: a mapping of a
# sparse file another user sized faults in tmpfs pages until /dev/shm is full (SIGBUS).
# What one entry may make top read: the header, the control table, each reader's counters.
_READ_BYTES_MAX = HEADER_BYTES + SLOTS_MAX * SLOT_CONTROL_BYTES + READER_RECORDS_MAX * READER_SKIP_OFFSET


def sample(name: str, directory: str = SHM_DIRECTORY) -> RingSample | None:
    """A reading of ring `name`, or None when it is gone, not ours to read, not (yet) a
    whole ring, or foreign (inspect says why)."""
    reading = inspect(name, directory)
    return reading if isinstance(reading, RingSample) else None


def inspect(name: str, directory: str = SHM_DIRECTORY) -> RingSample | Foreign | None:
    """A reading of ring `name`; Foreign where the entry is not a ring this shmloader made
    (its layout's arithmetic fails); None when it is gone, not ours to open, or mid-creation.
    Any local user can make an entry named like a ring: it is opened without following a
    link or blocking (a FIFO), read only if it is a regular file, its header checked against
    what a loader can make and the file's size before anything else is read, and read with
    pread, at most _READ_BYTES_MAX bytes. A ring in anonymous memory (ring/backing.py) is
    read through its trainer's /proc entry."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    data_fd = None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            return Foreign(name, "not a regular file")
        alive = not lock_free(fd, shared=True)
        stub = backing.read_stub(fd)
        if stub is not None:
            match = _SEGMENT.match(name)
            if not alive or match is None:
                return None  # A dead trainer's anonymous ring is gone with it.
            data_fd = backing.open_anonymous(name, int(match.group(1)), stub[0], writable=False)
            status = os.fstat(data_fd)
        source = fd if data_fd is None else data_fd
        size = status.st_size
        if size < HEADER_BYTES:
            return None  # Mid-creation: sized, then its header written.
        header = _pread(source, HEADER_BYTES, 0)
        if header is None:
            return None
        problem = layout_problem(header, size)
        if problem is not None:
            return None if problem == "" else Foreign(name, problem)
        return _read(name, source, header, alive)
    except (OSError, ValueError, SharedMemoryError):
        return None
    finally:
        for descriptor in (fd, data_fd):
            if descriptor is not None:
                os.close(descriptor)


def _pread(fd: int, length: int, offset: int) -> bytes | None:
    data = os.pread(fd, length, offset)
    return data if len(data) == length else None


def layout_problem(header_bytes: bytes, size: int) -> str | None:
    """What is wrong with a ring's header (HEADER_BYTES read from its start) for a file of
    `size` bytes: None if its counts are ones a loader makes and its layout's arithmetic
    gives exactly `size`; "" for an all-zero magic (a ring mid-creation); else the reason."""
    header = ffi.cast("shm_ring_header *", ffi.from_buffer("uint8_t[]", header_bytes))
    magic, version = int(header.magic), int(header.version)
    slots, readers = int(header.slot_count), int(header.reader_count)
    batch_size, stride, slots_offset = int(header.batch_size), int(header.slot_stride), int(header.slots_offset)
    checked_pages = int(header.checked_pages)
    del header
    if magic == 0:
        return ""
    if magic != RING_MAGIC:
        return f"magic {magic:#x}, not a ring's ({RING_MAGIC:#x})"
    if version != RING_VERSION:
        return f"ring version {version}, this shmloader reads {RING_VERSION}"
    if not 1 <= readers <= READER_RECORDS_MAX:
        return f"{readers:,} reader records, a loader makes 1-{READER_RECORDS_MAX:,}"
    if not SLOTS_MIN <= slots <= SLOTS_MAX:
        return f"{slots:,} slots, a loader makes {SLOTS_MIN}-{SLOTS_MAX}"
    if not 1 <= batch_size <= BATCH_SIZE_MAX:
        return f"batch size {batch_size:,}, a loader makes 1-{BATCH_SIZE_MAX:,}"
    layout = RingLayout(slots, readers, batch_size, stride, 0, checked_pages)
    if stride <= 0 or stride % PAGE_BYTES or slots_offset != layout.slots_offset or layout.total_bytes != size:
        return (f"layout (slots {slots}, readers {readers}, slot stride {stride}, slots offset {slots_offset}) "
                f"makes {layout.total_bytes:,} bytes, the file has {size:,}")
    return None


def _read(name: str, fd: int, header_bytes: bytes, alive: bool) -> RingSample | None:
    header = ffi.cast("shm_ring_header *", ffi.from_buffer("uint8_t[]", header_bytes))
    slot_count, reader_count = int(header.slot_count), int(header.reader_count)
    trainer_pid, batch_size = int(header.trainer_pid), int(header.batch_size)
    work = (int(header.row_bytes_bits), int(header.runs), int(header.auto_most))
    del header
    table_offset = HEADER_BYTES + reader_count * READER_RECORD_BYTES
    table = _pread(fd, slot_count * SLOT_CONTROL_BYTES, table_offset)
    if table is None:
        return None
    lines = ffi.cast("shm_control_line *", ffi.from_buffer("uint8_t[]", table))
    states, waited_ns = [], 0
    for slot in range(slot_count):
        waited_ns += int(lines[slot].waited_ns)
        word = int(lines[slot].state)
        try:
            state = SlotState(word & STATE_MASK)
        except ValueError:
            state = None
        states.append((state, word >> OWNER_SHIFT, int(lines[slot].step)))
    del lines
    readers = []
    for reader in range(reader_count):
        data = _pread(fd, READER_SKIP_OFFSET, HEADER_BYTES + reader * READER_RECORD_BYTES)
        if data is None:
            return None
        record = ffi.cast("shm_reader_record *", ffi.from_buffer("uint8_t[]", data))
        readers.append(ReaderSample(int(record.pid), int(record.busy_ns), int(record.batches),
                                    int(record.starved_ns), int(record.skipped), int(record.user_ns),
                                    int(record.read_ns), int(record.fetch_ns)))
        del record
    at_ns = time.monotonic_ns()
    return RingSample(name, trainer_pid, alive, batch_size, states, readers, at_ns, waited_ns,
                      _reading(at_ns, trainer_pid, waited_ns, states, readers), work)


def _reading(at_ns: int, trainer_pid: int, waited_ns: int, states, readers: list[ReaderSample]) -> Reading:
    """What readers/bottleneck.diagnose needs of a sample: the ring's counters, and /proc's
    of the readers that are the trainer's children (or its fork server's: a remote
    reader's pid names another node's process), with the evictions of the node cache they
    have open."""
    held = sum(1 for state, _, _ in states if state == SlotState.HELD)
    filling = {owner for state, owner, _ in states if state == SlotState.FILLING}
    counters = tuple(with_processes(
        ReaderCounters(reader.pid, reader.busy_ns, reader.batches, reader.user_ns, reader.read_ns, reader.fetch_ns,
                       index in filling), child_of(reader.pid, trainer_pid))
        for index, reader in enumerate(readers))
    idle_ns, total_ns, cores = cores_counters()
    local = [reader.pid for reader in counters if reader.cpu_ns is not None]
    evicted = evicted_bytes_of(local)
    quota = cpu_quota()  # top's own group: the trainer's where top runs beside it (the same pod).
    return Reading(at_ns, waited_ns, counters, len(states), held, idle_ns, total_ns, cores, evicted,
                   disk_counters(disks_of_reader(local[0]), local[0]) if local else (),
                   memory_counters(local[0]) if local else None, None if quota is None else quota.cores,
                   quota_used_ns(quota), quota_throttled(quota))


def _share(part_ns: int, elapsed_ns: int) -> float:
    """`part_ns` of `elapsed_ns`, within 0-1: the counters grow a whole fill (or sleep) at a
    time, when it ends (see the module's note)."""
    return min(1.0, max(0.0, part_ns / elapsed_ns))


@dataclasses.dataclass
class RingView:
    """What the screen shows of one ring: the last sample, rates since the one before, the
    restarts seen since `first_at_ns` (the first sample) and the rows/s history."""

    last: RingSample
    rows_per_s: float = 0.0
    busy: list[float] = dataclasses.field(default_factory=list)
    starved: list[float] = dataclasses.field(default_factory=list)
    restarts: int = 0
    history: list[float] = dataclasses.field(default_factory=list)
    first_at_ns: int = dataclasses.field(init=False, default=0)
    # readers/bottleneck.diagnose over the window of its readings, as stats() judges: the
    # screen's rates are the last second's, but the page cache's verdict needs a window of
    # seconds (page_cache.MEMORY_WINDOW_SECONDS_MIN), and each refresh of top is one.
    bottleneck: dict | None = None
    disk_rates: DiskRates = dataclasses.field(default_factory=DiskRates)  # the best seen from each disk
    readings: list[Reading] = dataclasses.field(default_factory=list)  # the window's (bottleneck.trim_window)

    def __post_init__(self) -> None:
        self.first_at_ns = self.last.at_ns
        if self.last.reading is not None:
            self.readings.append(self.last.reading)

    @property
    def watched_s(self) -> float:
        """How long top has sampled this ring: the span its restart count covers."""
        return (self.last.at_ns - self.first_at_ns) / 1e9

    def update(self, new: RingSample) -> None:
        elapsed = max(1, new.at_ns - self.last.at_ns)
        batches = 0
        self.busy, self.starved = [], []
        for index, reader in enumerate(new.readers):
            before = self.last.readers[index] if index < len(self.last.readers) else None
            # A record zeroed by the trainer (pid 0) then taken by the new reader counts once.
            if before is not None and before.pid and reader.pid != before.pid:
                self.restarts += 1
            same = before is not None and before.pid == reader.pid
            batches += reader.batches - before.batches if same else reader.batches
            self.busy.append(_share(reader.busy_ns - before.busy_ns, elapsed) if same else 0.0)
            self.starved.append(_share(reader.starved_ns - before.starved_ns, elapsed) if same else 0.0)
        self.rows_per_s = max(0, batches) * new.batch_size / (elapsed / 1e9)
        if new.reading is not None:
            if self.last.reading is not None:
                self.disk_rates.see(self.last.reading.disks, new.reading.disks, new.at_ns - self.last.at_ns)
            self.readings.append(new.reading)
            trim_window(self.readings, new.at_ns)
        if len(self.readings) > 1:
            # What the counters cannot say (a transform, a compressed field, the stored bytes of
            # a row) the trainer wrote into the ring's header: the verdict is stats()'s.
            local = sum(1 for reader in self.readings[-1].readers if reader.cpu_ns is not None)
            self.bottleneck = diagnose(self.readings[0], self.readings[-1],
                                       context_of_header(*new.work, local, new.batch_size), self.disk_rates.best)
        self.history = (self.history + [self.rows_per_s])[-HISTORY_SAMPLES:]
        self.last = new


class Monitor:
    """Samples the rings (all of them, or those named) and keeps a view of each."""

    def __init__(self, names: list[str] | None = None, directory: str = SHM_DIRECTORY) -> None:
        self.names, self.directory = names, directory
        self.views: dict[str, RingView] = {}
        self.foreign: dict[str, str] = {}  # Entries named like rings that are not (see inspect).

    def refresh(self) -> None:
        names = self.names if self.names else ring_names(self.directory)
        seen, self.foreign = {}, {}
        for name in names:
            reading = inspect(name.lstrip("/"), self.directory)
            if isinstance(reading, Foreign):
                self.foreign[reading.name] = reading.reason
                continue
            if reading is None:
                continue
            view = self.views.get(reading.name)
            if view is None:
                view = RingView(reading)
            else:
                view.update(reading)
            seen[reading.name] = view
        self.views = seen


def sparkline(values: list[float]) -> str:
    top = max(values, default=0.0)
    if top <= 0:
        return _SPARKS[0] * len(values)
    return "".join(_SPARKS[min(len(_SPARKS) - 1, int(value / top * (len(_SPARKS) - 1)))] for value in values)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# What the counts on the screen cover (the module's note says why the ring holds no more).
LEGEND = (
    "slots: . idle  r requested  F filling  R ready  H held  X failed\n"
    "restarts seen: readers top saw replaced while it watched; loader.stats()[\"reader_restarts\"] counts them all.\n"
    "batches, skipped: the reader process's own; loader.stats()[\"readers\"] adds those of the readers it replaced."
)


def _ranges(indices: list[int]) -> str:
    """"0, 3-7" for [0, 3, 4, 5, 6, 7] (sorted indices): a run shares index less position."""
    spans = [[index for _, index in run] for _, run in itertools.groupby(enumerate(indices), lambda at: at[1] - at[0])]
    return ", ".join(str(span[0]) if len(span) == 1 else f"{span[0]}-{span[-1]}" for span in spans)


def render_text(monitor: Monitor) -> str:
    """The screen as plain text (also what rich draws, line by line)."""
    foreign = [f"foreign (not read): {name}: {reason}" for name, reason in monitor.foreign.items()]
    if not monitor.views:
        return "\n".join(["no shmloader ring in /dev/shm", *foreign])
    lines = []
    for name, view in monitor.views.items():
        last = view.last
        states = "".join(STATE_LETTERS.get(state, "?") for state, _, _ in last.states)
        lines.append(f"{name}  trainer {last.trainer_pid} ({'alive' if last.trainer_alive else 'gone'})  batch "
                     f"{last.batch_size}  {view.rows_per_s:,.0f} rows/s  restarts seen {view.restarts} in "
                     f"{_duration(view.watched_s)}")
        lines.append(f"  slots [{states}]   rows/s {sparkline(view.history)}")
        if view.bottleneck is not None:
            lines.append(f"  {view.bottleneck['line']}")
        for index, reader in enumerate(last.readers):
            if not reader.pid:  # No process in the record: listed once below, not as a reader of pid 0.
                continue
            busy = view.busy[index] if index < len(view.busy) else 0.0
            starved = view.starved[index] if index < len(view.starved) else 0.0
            lines.append(f"  reader {index}: pid {reader.pid:>7}  busy {busy:4.0%}  starved {starved:4.0%}  "
                         f"batches by this pid {reader.batches:>9,}  skipped {reader.skipped:,}")
        empty = [index for index, reader in enumerate(last.readers) if not reader.pid]
        if empty:
            lines.append(f"  reader record{'s' if len(empty) > 1 else ''} {_ranges(empty)}: no reader now (under "
                         f"readers=\"auto\" room for readers it may add; else a reader still starting)")
    lines.extend(foreign)
    lines.append(LEGEND)
    return "\n".join(lines)


def run(names: list[str] | None = None, interval_s: float = 1.0, once: bool = False, samples: int | None = None) -> int:
    """Draws the view every `interval_s` until Ctrl-C (or `samples` times)."""
    monitor = Monitor(names)
    monitor.refresh()
    missing = [name for name in names or () if name.lstrip("/") not in monitor.views]
    if missing:
        import sys

        foreign = [f"{name.lstrip('/')} is foreign: {monitor.foreign[name.lstrip('/')]}" for name in missing
                   if name.lstrip("/") in monitor.foreign]
        print(f"shmloader top: no ring named {', '.join(missing)} in {SHM_DIRECTORY} (rings there: "
              f"{', '.join(ring_names()) or 'none'}; a loader's is loader.diagnostics.ring_name)"
              + "".join(f"; {line}" for line in foreign), file=sys.stderr)
        return 1
    if once:
        time.sleep(min(interval_s, 0.5))  # Two samples make the rates.
        monitor.refresh()
        print(render_text(monitor))
        return 0
    try:
        from rich.live import Live
        from rich.text import Text
    except ImportError:
        Live = None
    count = 0
    try:
        if Live is None:
            while samples is None or count < samples:
                time.sleep(interval_s)
                monitor.refresh()
                print("\x1b[H\x1b[2J" + render_text(monitor), flush=True)
                count += 1
            return 0
        with Live(Text(render_text(monitor)), refresh_per_second=4, screen=False) as live:
            while samples is None or count < samples:
                time.sleep(interval_s)
                monitor.refresh()
                live.update(Text(render_text(monitor)))
                count += 1
    except KeyboardInterrupt:
        pass
    return 0
