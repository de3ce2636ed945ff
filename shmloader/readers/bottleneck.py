"""What limits a loader now, in one line: stats()["bottleneck"], `shmloader top` and the stall
warning all call diagnose() on two readings of the counters the trainer and readers keep anyway.

A reading (Reading) holds, cumulative since the ring was made: how long next() waited
(the ring's control lines' waited_ns, which the trainer adds at each take), each reader's
fill time and its part in the user's code, in reading fields and in waiting for a store's
pages (its record in the ring), the slots batches hold now, and from /proc, read only when a
reading is taken: each local reader's CPU time and the bytes it read from storage, and the
idle time of the cores this process may run on. Nothing here runs per batch: the counters
are written where a fill or a take writes its record or line already (ring.h).

diagnose() takes the difference of two readings (the window) and names one stage, in this
order: the trainer, when next() hardly waited (the loader is ahead); held batches, when
the batches the trainer holds leave fewer slots to fill than there are readers; a stalled
fill, when readers filled nothing in the window while the trainer waited; else the
readers' largest share of time: the store's link or the node cache's budget (waiting for
pages; the cache when it evicted meanwhile), the user's code, reading fields (the page
cache's memory when the readers read again what their memory group evicted,
readers/page_cache.py; disk when readers block on storage reads, with how busy the device
was against its best rate seen, readers/disk_device.py; decompression for compressed
fields, else reader CPU), and
the rest (the sampler, copies, the protocol) as reader CPU. Each verdict says how busy the
stage was and the one change that would help; for the stages that need CPU, whether the
node has an idle core for another reader.
"""

from __future__ import annotations

import dataclasses
import struct
import time

from ..errors import SharedMemoryError
from ..plan.cpu_quota import cpu_quota, quota_throttled, quota_used_ns
from ..remote.pages import CACHE_PAGE_BYTES
from ..ring.layout import RUNS_COMPRESSED, RUNS_DATASET, RUNS_TRANSFORM, SlotState
from .disk_device import DiskCounters, DiskRates, disk_advice, disk_counters, disk_window, rotational
from .page_cache import MemoryCounters, memory_advice, memory_counters, memory_window
from .proc_counters import cores_counters, process_counters

# Below this share of the window spent waiting in next(), the trainer is what limits:
# the loader is ahead. A tenth leaves room for the waits that any pipeline has (a first
# batch after a seek, a reader's restart) without calling a loader that keeps up the limit.
TRAINER_WAIT_SHARE_MAX = 0.1
# A reading taken less than this after the one before reuses it: stats() called at every
# step reads /proc at most a few times a second.
SAMPLE_INTERVAL_SECONDS = 0.25
# The window diagnose() looks at: the readings of about the last this many seconds.
WINDOW_SECONDS = 10.0
# Readers blocked (busy, off the CPU) for at least this share of their reading time, while
# reading from storage, are waiting for the disk rather than decompressing or copying.
BLOCKED_SHARE_MIN = 0.5
# A fill in progress for this many times a reader's usual fill, with no other fill ended
# meanwhile, has stalled (a stopped reader, a transform that does not return).
STALL_FILLS = 4
# The stall warning diagnoses the wait it warns of when it has lasted this long, else the
# meter's window: a shorter span holds too few fills to judge by.
SINCE_SECONDS_MIN = 0.5
# Readers busy less than this share of the window while next() waits are kept from
# working (by the CPU others hold, or slow wake-ups), not short of readers.
READERS_SATURATED = 0.7
# Readers that wait this share of their fill time for a core (runnable, not running) are
# short of CPU: another reader would only wait too.
QUEUED_SHARE_MIN = 0.3
# At least this many idle cores make "another reader would help" true.
IDLE_CORES_MIN = 1.0

@dataclasses.dataclass(frozen=True)
class ReaderCounters:
    """One reader record's cumulative counters (ns), and from /proc its main thread's (the
    one that fills) time on a CPU and waiting for one (ns), and its process's bytes read
    from storage (None where unknown: a remote reader, no /proc)."""

    pid: int
    busy_ns: int
    batches: int
    user_ns: int = 0
    read_ns: int = 0
    fetch_ns: int = 0
    filling: bool = False  # A slot is FILLING by this reader at the reading.
    cpu_ns: int | None = None
    queued_ns: int | None = None
    storage_read_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Reading:
    """The loader's counters at `at_ns` (CLOCK_MONOTONIC), cumulative."""

    at_ns: int
    waited_ns: int
    readers: tuple[ReaderCounters, ...]
    slots: int
    held_slots: int
    cores_idle_ns: int | None = None  # summed over the cores this process may use
    cores_total_ns: int | None = None
    cores: int = 1
    evicted_bytes: int | None = None  # the node cache's, where the loader reads from one
    disks: tuple[DiskCounters, ...] = ()  # those the loader's files are on (disk_device.py)
    memory: MemoryCounters | None = None  # the local readers' memory group's (page_cache.py)
    quota_cores: float | None = None  # the CPU quota of this process's group (plan/cpu_quota.py)
    quota_used_ns: int | None = None  # that group's CPU time, cumulative
    quota_throttled: int | None = None  # the periods that group ran out of its quota, cumulative


@dataclasses.dataclass(frozen=True)
class Context:
    """What the readings cannot say: what the readers run. `user_code`: "the transform",
    "the dataset's __getitem__", or None for fields read as they are; `compressed`: whether
    a field is compressed (reading it is decompression); `local_readers`: reader processes
    on this node (readers=0: none, the trainer fills); `batch_size`, and `row_bytes`: the
    stored bytes a row's fields take, which the readers' reads are compared with
    (page_cache.py); `auto_most`, where readers="auto" sizes the readers, the most it may
    reach; None: unknown, for the reason `row_bytes_missing` (the memory verdict is
    then not given, and the detail says why)."""

    user_code: str | None = None
    compressed: bool = False
    local_readers: int = 0
    batch_size: int = 0
    row_bytes: float | None = None
    row_bytes_missing: str = "a dataset's rows have no stored bytes to compare the readers' reads with"
    auto_most: int | None = None  # readers="auto": the most it may reach (advice then names no fixed count)


def zero_reading(at_ns: int, slots: int, readers: int, disks: tuple[str, ...] = ()) -> Reading:
    """The counters of a ring just made, with its `disks`' (which count since boot): the
    baseline of a first diagnosis."""
    return Reading(at_ns, 0, tuple(ReaderCounters(0, 0, 0) for _ in range(readers)), slots, 0,
                   disks=disk_counters(disks))


# /proc, read at a reading only.

def with_processes(counters: ReaderCounters, local: bool) -> ReaderCounters:
    """`counters` with its process's CPU time and storage reads, for a reader on this node."""
    if not local or counters.pid <= 0:
        return counters
    cpu_ns, queued_ns, read_bytes = process_counters(counters.pid)
    return dataclasses.replace(counters, cpu_ns=cpu_ns, queued_ns=queued_ns, storage_read_bytes=read_bytes)


def ring_reading(ring, local_readers: int, node_cache=None, processes: bool = True,
                 disks: tuple[str, ...] = ()) -> Reading:
    """A reading of `ring` (ring/segment.Ring) from its trainer's process: the first
    `local_readers` records are reader processes on this node; `node_cache` the cache the
    loader reads a store's objects through (its evictions), or None; `disks` those its files
    are on. `processes=False` leaves /proc unread (no CPU, storage, core or disk counters):
    the stall warning's cheap reading at the start of each long wait."""
    layout = ring.layout
    held, filling = 0, set()
    for slot in range(layout.slot_count):
        try:
            state, owner = ring.state(slot)
        except SharedMemoryError:
            continue  # Foreign input; the trainer's own checks raise on it at next().
        if state == SlotState.HELD:
            held += 1
        elif state == SlotState.FILLING:
            filling.add(owner)
    readers = []
    for index in range(layout.reader_count):
        pid, busy_ns, batches = ring.records.stats(index)
        user_ns, read_ns, fetch_ns = ring.records.stages(index)
        counters = ReaderCounters(pid, busy_ns, batches, user_ns, read_ns, fetch_ns, index in filling)
        readers.append(with_processes(counters, processes and index < local_readers))
    idle_ns, total_ns, cores = cores_counters() if processes else (None, None, 1)
    local = [reader.pid for reader in readers if reader.storage_read_bytes is not None]
    evicted = None
    if node_cache is not None:
        try:
            # The ledger counts pages; a Reading, bytes (the advice says how many MB went).
            evicted = node_cache.counters()["evicted"] * CACHE_PAGE_BYTES
        except (OSError, ValueError, KeyError):
            evicted = None  # A cache closed meanwhile: its evictions are not this window's to tell.
    quota = cpu_quota() if processes else None
    return Reading(time.monotonic_ns(), ring.waited_ns(), tuple(readers), layout.slot_count, held, idle_ns,
                   total_ns, cores, evicted, disk_counters(disks, local[0] if local else 0) if processes else (),
                   memory_counters(local[0]) if processes and local else None,
                   None if quota is None else quota.cores, quota_used_ns(quota), quota_throttled(quota))


def plan_context(plan, dataset: bool, local_readers: int, auto_most: int | None = None) -> Context:
    """What a loader's plan says its readers run (see Context)."""
    user_code = "the dataset's __getitem__" if dataset else "the transform" if plan.transform is not None else None
    compressed = any(getattr(part, "codec", "none") not in ("", "none") and getattr(part, "clevel", 0) > 0
                     for field in plan.fields for part in field.parts)
    row_bytes = stored_bytes_per_row(plan) if plan.plans else None  # A dataset's rows are not stored.
    return Context(user_code, compressed, local_readers, plan.sampler.batch_size, row_bytes, auto_most=auto_most)


# Context.user_code by the ring header's `runs` bit (header_words).
_RUNS_USER_CODE = {RUNS_TRANSFORM: "the transform", RUNS_DATASET: "the dataset's __getitem__"}
_U32_MAX, _U64_MAX = (1 << 32) - 1, (1 << 64) - 1
# A row's stored bytes a foreign header may say (context_of_header): a subnormal or huge one
# would make the readers' read amplification print as inf or 0.
_ROW_BYTES_MIN, _ROW_BYTES_MAX = 1e-3, float(1 << 50)


def header_words(context: Context) -> tuple[int, int, int]:
    """(row_bytes_bits, runs, auto_most): what `context` says the readers run, as the ring's
    header holds it (ring.h), for `shmloader top` (context_of_header); local_readers and
    batch_size top reads from the ring itself."""
    runs = RUNS_COMPRESSED if context.compressed else 0
    runs |= next((bit for bit, words in _RUNS_USER_CODE.items() if words == context.user_code), 0)
    row = struct.unpack("<Q", struct.pack("<d", float(context.row_bytes or 0.0)))[0]  # 0.0: unknown, as None.
    return row, runs, min(context.auto_most or 0, _U32_MAX)


def context_of_header(row_bytes_bits: int, runs: int, auto_most: int, local_readers: int,
                      batch_size: int) -> Context:
    """The Context a ring's header describes (header_words), read as foreign input: a row's
    bytes that are not a positive finite number are unknown, bits it does not know are left
    out, and both user-code bits at once name neither."""
    row_bytes = struct.unpack("<d", struct.pack("<Q", row_bytes_bits & _U64_MAX))[0]
    row_bytes = row_bytes if _ROW_BYTES_MIN <= row_bytes <= _ROW_BYTES_MAX else None  # NaN fails both.
    user_code = _RUNS_USER_CODE.get(runs & (RUNS_TRANSFORM | RUNS_DATASET))
    missing = Context.row_bytes_missing if row_bytes is not None or runs & RUNS_DATASET else \
        "the ring's header gives no stored bytes per row to compare the readers' reads with"
    return Context(user_code, bool(runs & RUNS_COMPRESSED), local_readers, batch_size, row_bytes, missing,
                   auto_most or None)


def readers_setting(count: int, auto_most: int | None) -> str:
    """The setting that would run `count` readers: readers=count for a loader of fixed readers;
    under readers="auto" (auto_most: the most it may reach), a fixed count would end the
    sizing, so: auto's own adds where `count` is within its most (it adds them while the
    trainer waits and a core is idle, as far as the node's budget has room), else its bound."""
    if auto_most is None:
        return f"readers={count}"
    if count <= auto_most:
        return f"{count} readers, which auto adds as cores and the node's budget (SHMLOADER_CPU_BUDGET) allow"
    return f"{count} readers, past auto's most ({auto_most}): AutoReaders(most={count}) with SHMLOADER_CPU_BUDGET"


def stored_bytes_per_row(plan) -> float:
    """The stored bytes of a row the readers deliver, on average: a mixture's rows come from
    each source at its weight's share of every block of sum(weights) positions
    (plan/sources.py), whatever its size or fraction, so each source's bytes per row count
    at that share (a source of 1% of the rows at half the weight is half of what is read)."""
    counts = next(iter(plan.plans.values())).row_counts
    weights = getattr(plan.sampler, "weights", None) if getattr(plan.sampler, "has_sources", False) else None
    if weights is None or len(weights) != len(counts):
        return sum(field.stored_bytes for field in plan.fields) / max(1, sum(counts))
    per_row = [sum(field.source_bytes(source) for field in plan.fields) / max(1, count)
               for source, count in enumerate(counts)]
    return sum(weight * row_bytes for weight, row_bytes in zip(weights, per_row)) / sum(weights)


# The diagnosis.

_WORDS = {
    "trainer": "the training step",
    "held": "batches the trainer holds",
    "stalled": "a fill that has not ended",
    "link": "the object store's link",
    "cache": "the node cache's budget",
    "user_code": "the user's code",
    "disk": "disk reads",
    "memory": "the page cache's memory",
    "decompression": "decompression",
    "reader_cpu": "reader CPU",
    "unknown": "nothing yet",
}
STAGES = tuple(_WORDS)


def diagnose(before: Reading, after: Reading, context: Context, disk_best: dict[str, float] | None = None) -> dict:
    """What limited the loader between two readings: {"stage", "utilisation" (0-1, how busy
    that stage was), "advice", "line" (the one-line form), "window_s", "detail"}.
    `disk_best`: the best read rate seen from each disk in earlier windows (DiskRates.best)."""
    window_ns = after.at_ns - before.at_ns
    if window_ns <= 0:
        return _verdict("unknown", 0.0, "read stats() again after some steps", 0.0, {})
    window_s = window_ns / 1e9
    waited = _share(after.waited_ns - before.waited_ns, window_ns)
    changes = [reader_change(old, new)
               for old, new in zip(_padded(before.readers, len(after.readers)), after.readers)]
    count = max(1, len(changes))
    busy_ns = sum(change["busy_ns"] for change in changes)
    busy = _share(busy_ns, window_ns * count)
    detail = {"trainer_wait": round(waited, 3), "readers_busy": round(busy, 3), "readers": len(changes),
              "held_slots": after.held_slots, "slots": after.slots}
    idle_cores = idle_cores_between(before, after)
    if idle_cores is not None:
        detail["idle_cores"] = round(idle_cores, 1)
    if waited < TRAINER_WAIT_SHARE_MAX:
        return _trainer(waited, busy, len(changes), window_s, detail, context.auto_most)
    free = after.slots - after.held_slots
    if after.held_slots and free < max(1, context.local_readers, len(changes)) and busy < READERS_SATURATED:
        advice = (f"the trainer holds {after.held_slots} of {after.slots} slots' batches, so readers have {free} to "
                  f"fill: let go of batches sooner (del batch, batch.release()) or give slots="
                  f"{after.held_slots + max(2, len(changes)) * 2}")
        return _verdict("held", after.held_slots / after.slots, advice, window_s, detail)
    stalled = _stalled(changes, after.readers, window_ns)
    if stalled and waited >= 0.5:
        advice = (f"reader {stalled[0]} (pid {after.readers[stalled[0]].pid}) has filled one step for {window_s:.1f} "
                  f"s, far longer than its fills take: a transform or __getitem__ that does not return, a reader "
                  f"stopped (by a signal, a debugger) or a stalled file system; "
                  f"shmloader.transforms.compute_batch runs one step alone")
        return _verdict("stalled", waited, advice, window_s, detail)
    return _readers(changes, busy_ns, busy, waited, idle_cores, before, after, context, window_s, detail, disk_best)


def _trainer(waited: float, busy: float, readers: int, window_s: float, detail: dict,
             auto_most: int | None = None) -> dict:
    advice = f"the loader is ahead (next() waited {waited:.0%} of the time): nothing to do"
    if readers > 1 and busy < 0.3:
        fewer = max(1, round(readers * busy / 0.7 + 0.5))
        advice += (f"; readers are {busy:.0%} busy, readers={fewer} would keep up too" if auto_most is None else
                   f"; readers are {busy:.0%} busy: auto retires those {fewer} do not need after three calm windows")
    return _verdict("trainer", 1.0 - waited, advice, window_s, detail)


def _readers(changes: list[dict], busy_ns: int, busy: float, waited: float, idle_cores: float | None,
             before: Reading, after: Reading, context: Context, window_s: float, detail: dict,
             disk_best: dict[str, float] | None) -> dict:
    """The readers limit: which part of their fills takes most of their time."""
    parts = {name: sum(change[name] for change in changes) for name in ("user_ns", "read_ns", "fetch_ns")}
    if not any(parts.values()) and context.user_code is None:
        parts["read_ns"] = busy_ns  # Fills of local fields alone keep no stages: they are all reading (fill/filler.py).
    parts["other_ns"] = max(0, busy_ns - sum(parts.values()))
    shares = {name[:-3]: _share(value, busy_ns) for name, value in parts.items()}
    detail["shares"] = {name: round(value, 3) for name, value in shares.items()}
    cpu = [change["cpu_ns"] for change in changes if change["cpu_ns"] is not None]
    queued_ns = sum(change["queued_ns"] for change in changes if change["queued_ns"] is not None)
    blocked = queued = None
    if cpu and busy_ns:
        # Off a CPU and not waiting for one: asleep, or waiting for I/O.
        blocked = max(0.0, 1.0 - (sum(cpu) + queued_ns) / busy_ns)
        queued = _share(queued_ns, busy_ns)
        detail["readers_blocked"], detail["readers_queued"] = round(blocked, 3), round(queued, 3)
    storage = [change["storage_read_bytes"] for change in changes if change["storage_read_bytes"] is not None]
    storage_rate = sum(storage) / window_s if storage else None
    if storage_rate is not None:
        detail["storage_read_bytes_per_s"] = round(storage_rate)
    evicted = None
    if after.evicted_bytes is not None and before.evicted_bytes is not None:
        evicted = max(0, after.evicted_bytes - before.evicted_bytes)
        detail["cache_evicted_bytes"] = evicted
    largest = max(shares, key=shares.get)
    readers = context.local_readers
    if largest == "fetch":
        if evicted:
            advice = (f"the node cache evicted {evicted / 1e6:,.0f} MB in {window_s:.1f} s and readers waited for "
                      f"pages {shares['fetch']:.0%} of their time: a larger cache_bytes (with cache_dir on a disk "
                      f"with the room) keeps what the next steps read")
            return _verdict("cache", busy * shares["fetch"], advice, window_s, detail)
        advice = (f"readers waited for the object store {shares['fetch']:.0%} of their time: a faster link to it, "
                  f"or the data kept in the node cache (cache_bytes at least its size) from the second epoch on")
        return _verdict("link", busy * shares["fetch"], advice, window_s, detail)
    if largest == "user":
        who = context.user_code or "the user's code (a transform or __getitem__)"
        advice = f"{who} takes {shares['user']:.0%} of the readers' time: " + _cpu_advice(
            readers, idle_cores, f"make {who} cheaper", blocked, queued, context.auto_most)
        result = _verdict("user_code", busy * shares["user"], advice, window_s, detail)
        result["line"] = f"bottleneck: {who} at {busy * shares['user']:.0%}: {advice}"
        return result
    rows = sum(change["batches"] for change in changes) * context.batch_size
    memory = memory_window(before.memory, after.memory, sum(storage) if storage else None,
                           rows * context.row_bytes if context.row_bytes else None, window_s)
    if memory is not None:
        detail.update(memory)
    elif context.row_bytes is None and after.memory is not None:
        detail["page_cache"] = f"not judged: {context.row_bytes_missing}"
    # Before the disk and CPU verdicts: a group short of memory reads again (the disk works) and
    # reclaims (readers wait for a core), and neither a disk nor more readers would help.
    if largest == "read" and memory is not None and memory["page_cache_short"]:
        return _verdict("memory", busy * shares["read"], memory_advice(memory), window_s, detail)
    if largest == "read" and blocked is not None and blocked >= BLOCKED_SHARE_MIN and storage_rate:
        disk = disk_window(before.disks, after.disks, after.at_ns - before.at_ns, disk_best)
        detail.update(disk or {})
        more = readers_setting(max(readers * 2, readers + 1), context.auto_most)
        remedy = disk_advice(disk, more, rotational(disk["device"]), storage_rate) if disk else (
            "data in the page cache (memory for it), faster storage, or fewer bytes to read "
            "(shmloader convert compresses)")
        advice = (f"readers read {storage_rate / 1e6:,.0f} MB/s from storage and wait for it {blocked:.0%} of their "
                  f"time: {remedy}")
        return _verdict("disk", busy * shares["read"], advice, window_s, detail)
    if largest == "read" and context.compressed:
        advice = (f"decompression takes {shares['read']:.0%} of the readers' time: " + _cpu_advice(
            readers, idle_cores, "a faster codec (shmloader convert --codec lz4, or --clevel 1)", None, queued,
            context.auto_most))
        return _verdict("decompression", busy * shares["read"], advice, window_s, detail)
    if busy < READERS_SATURATED and idle_cores is not None and idle_cores < IDLE_CORES_MIN:
        advice = (f"readers are only {busy:.0%} busy while next() waits, and no core is idle: they wait for a CPU "
                  f"that other processes (the trainer's included) hold, so more readers would not help; fewer "
                  f"processes on the node would")
    else:
        advice = f"readers are {busy:.0%} busy: " + _cpu_advice(readers, idle_cores, "a smaller batch or fewer columns",
                                                                  None, queued, context.auto_most)
    return _verdict("reader_cpu", busy, advice, window_s, detail)


def _cpu_advice(readers: int, idle_cores: float | None, otherwise: str, blocked: float | None = None,
                queued: float | None = None, auto_most: int | None = None) -> str:
    """Whether another reader would help: not where readers wait for a core already; where
    they spend most of their time off the CPU (sleeping or waiting in the user's code),
    which more readers overlap without a core of their own; where a core is idle."""
    if queued is not None and queued >= QUEUED_SHARE_MIN:
        return (f"readers wait for a core {queued:.0%} of their time (the node's CPU is taken, the trainer's "
                f"included), so more readers would not help: {otherwise}")
    if blocked is not None and blocked >= BLOCKED_SHARE_MIN:
        return (f"readers wait off the CPU {blocked:.0%} of their time, so more readers overlap those waits: "
                f"{readers_setting(max(readers * 2, readers + 1), auto_most)}")
    if idle_cores is not None and idle_cores >= IDLE_CORES_MIN:
        more = readers + int(idle_cores)
        return f"{idle_cores:.1f} cores are idle, {readers_setting(more, auto_most)} would use them; else {otherwise}"
    if idle_cores is None:
        return f"more readers where cores are idle, else {otherwise}"
    return f"no core is idle for another reader, so {otherwise}"


def _verdict(stage: str, utilisation: float, advice: str, window_s: float, detail: dict) -> dict:
    utilisation = min(1.0, max(0.0, utilisation))
    return {"stage": stage, "utilisation": round(utilisation, 3), "advice": advice,
            "line": f"bottleneck: {_WORDS[stage]} at {utilisation:.0%}: {advice}",
            "window_s": round(window_s, 3), "detail": detail}


def reader_change(old: ReaderCounters, new: ReaderCounters) -> dict:
    """A reader's counters over the window; a new process in the record (a restart, its
    counters cleared) counts from zero."""
    same = old.pid == new.pid
    change = {"busy_ns": new.busy_ns, "batches": new.batches, "user_ns": new.user_ns, "read_ns": new.read_ns,
              "fetch_ns": new.fetch_ns}
    if same:
        change = {name: max(0, value - getattr(old, name)) for name, value in change.items()}
    for name in ("cpu_ns", "queued_ns", "storage_read_bytes"):
        value, earlier = getattr(new, name), getattr(old, name)
        change[name] = None if value is None else value - earlier if same and earlier is not None else \
            None if same else value
    return change


def _stalled(changes: list[dict], readers: tuple[ReaderCounters, ...], window_ns: int) -> list[int]:
    """The readers filling a step now that finished none in the window, where the window
    is STALL_FILLS times as long as their usual fill (busy_ns per batch so far)."""
    found = []
    for index, (change, reader) in enumerate(zip(changes, readers)):
        usual_ns = reader.busy_ns / reader.batches if reader.batches else None
        if reader.filling and change["batches"] == 0 and usual_ns is not None and window_ns > STALL_FILLS * usual_ns:
            found.append(index)
    return found


def _padded(readers: tuple[ReaderCounters, ...], count: int) -> list[ReaderCounters]:
    return list(readers[:count]) + [ReaderCounters(0, 0, 0)] * (count - len(readers))


def _share(part: float, whole: float) -> float:
    return min(1.0, max(0.0, part / whole)) if whole > 0 else 0.0


def idle_cores_between(before: Reading, after: Reading) -> float | None:
    """The cores idle between two readings, of those this process may run on: what the
    cores' idle time says, and no more than a CPU quota left unused (its group's time
    against the quota's cores: a container with a CPU limit on an idle machine has only
    its limit to give another reader). Where the group's time is not known for the window
    (its counter unreadable, set or reset within it), none where the group ran out of its
    quota in the window (throttled), else no more than the quota's cores."""
    idle = None
    if None not in (before.cores_idle_ns, before.cores_total_ns, after.cores_idle_ns, after.cores_total_ns):
        total = after.cores_total_ns - before.cores_total_ns
        idle = after.cores * _share(after.cores_idle_ns - before.cores_idle_ns, total) if total > 0 else None
    if after.quota_cores is None:
        return idle
    left = after.quota_cores
    elapsed = after.at_ns - before.at_ns
    if None not in (before.quota_used_ns, after.quota_used_ns) and elapsed > 0 and \
            after.quota_used_ns >= before.quota_used_ns:
        left = max(0.0, left - (after.quota_used_ns - before.quota_used_ns) / elapsed)
    elif None not in (before.quota_throttled, after.quota_throttled) and after.quota_throttled > before.quota_throttled:
        left = 0.0
    return left if idle is None else min(idle, left)


def trim_window(readings: list[Reading], now_ns: int) -> None:
    """Drops from `readings` (oldest first) those before the window of WINDOW_SECONDS to
    `now_ns` but one: the reading at least as old as the window stays, the baseline of the
    next diagnosis (a verdict such as the page cache's needs a window of seconds:
    page_cache.MEMORY_WINDOW_SECONDS_MIN)."""
    while len(readings) > 2 and readings[1].at_ns <= now_ns - WINDOW_SECONDS * 1e9:
        readings.pop(0)


class Meter:
    """Readings taken when asked (not more often than SAMPLE_INTERVAL_SECONDS); a diagnosis
    looks from the oldest kept to the newest: the first from `baseline` (the ring's start),
    later ones from the reading before (or, asked often, from about WINDOW_SECONDS ago), so
    that a start-up's waits leave the window as soon as a second reading is taken.
    `read()` takes a reading; `context` is the loader's."""

    def __init__(self, read, context: Context, baseline: Reading) -> None:
        self.read, self.context = read, context
        self.readings = [baseline]
        self.disk_rates = DiskRates()
        self._from_start = True
        self.last = diagnose(baseline, baseline, context)  # What a closed loader's stats() repeats.

    def diagnosis(self) -> dict:
        now = time.monotonic_ns()
        # The second reading is taken whenever asked: the first window is the start-up's.
        if self._from_start or now - self.readings[-1].at_ns >= SAMPLE_INTERVAL_SECONDS * 1e9:
            self.readings.append(self.read())
            before, after = self.readings[-2:]
            self.disk_rates.see(before.disks, after.disks, after.at_ns - before.at_ns)
        if self._from_start and len(self.readings) > 2:
            self._from_start = False
            self.readings.pop(0)
        trim_window(self.readings, now)
        self.last = diagnose(self.readings[0], self.readings[-1], self.context, self.disk_rates.best)
        return self.last

    def since(self, reading: Reading) -> dict:
        """The diagnosis from `reading` (a cheap one, read(processes=False)) to now, read the
        same way: the stall warning's, over the wait it warns of, which next() has spent
        waiting throughout (a wait is added to waited_ns only when it ends, at the take);
        where that wait is shorter than SINCE_SECONDS_MIN (a warning set to come early),
        diagnosis()'s."""
        now = self.read(processes=False)
        if now.at_ns - reading.at_ns < SINCE_SECONDS_MIN * 1e9:
            return self.diagnosis()
        now = dataclasses.replace(now, waited_ns=reading.waited_ns + now.at_ns - reading.at_ns)
        return diagnose(reading, now, self.context, self.disk_rates.best)
