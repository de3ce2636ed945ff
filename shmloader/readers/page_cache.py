"""Whether the page cache holds what the readers read: the evidence of the "memory" verdict
(readers/bottleneck.py), from the readers' reads and their memory group's refaults.

When the memory the page cache may use (a memory cgroup's limit, else the machine's) is
smaller than what the readers keep asked for (a shuffle_window and the blocks read ahead of
it, or a global shuffle's rows over data larger than memory), the kernel reclaims pages read
ahead before their rows are dealt and the readers read them again: the disk works, the
readers wait for it, and the group is busy reclaiming, so the readers' time looks like disk
reads or, on a loaded node, like waiting for a core, while neither a faster disk nor more
readers would help. Two signals, both needed, say so:
- read amplification: the bytes the readers read from storage in the window (/proc/PID/io
  read_bytes, which counts the read-ahead their threads ask for too) against the stored
  bytes of the rows they delivered (batches x batch size x stored bytes per row). A healthy
  cold pass reads each byte about once; but over a window of a few seconds the read-ahead
  runs ahead of the rows (a window's blocks at the start, a block at a time later), so
  amplification alone is no proof;
- refaults: the file pages read again after reclaim evicted them (workingset_refault_file:
  v1's memory.stat total_, v2's memory.stat, the machine's /proc/vmstat where the readers
  are in no group), against the readers' reads. A page read for the first time (a cold
  pass, the read-ahead of a start) is no refault, and pages the loader lets go of itself
  (POSIX_FADV_DONTNEED, storage/readahead.py) leave no trace to refault on; a refault is a
  page the cache held and could not keep.
Warm data reads nothing, a healthy cold pass refaults nothing, a second pass over data
larger than memory refaults but reads each byte once: only a cache that cannot hold what
is read gives both. Both are judged over a window of MEMORY_WINDOW_SECONDS_MIN at least: at
an epoch start the window's blocks are read ahead before their rows are dealt, and on a
second pass over data larger than memory nearly all of that is refaults, so a short window
(the stall warning's can be half a second) at a start shows both for a moment. No verdict
either from counters the readers share with others (shared_group): /proc/vmstat, a v1 or v2
root group, or a login session's scope count every job's refaults, and a job that thrashes
beside a loader whose reads are healthy would have the loader's verdict say memory. Not
used: the group's failcnt or memory.events max, which count every reclaim at the limit, and
a healthy pass over data larger than the group reclaims at every page; major faults, which
any read not yet read ahead takes; PSI, which v1 has not.
"""

from __future__ import annotations

import dataclasses
import os

from .proc_counters import read_text

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# memory.stat, /proc/vmstat and /proc/PID/cgroup are small; a bound on what one read takes.
_STAT_BYTES_MAX = 1 << 16
# A limit at least this large is "none" (v1 writes 2^63 rounded down to a page).
_UNLIMITED_BYTES = 1 << 60
# Groups above the readers' own looked at for a v2 limit (cgroup trees are shallow).
_CGROUP_DEPTH_MAX = 16
# Readers that read at least this many times the stored bytes of the rows they delivered...
# (a cache short of memory reads a page twice at least: once read ahead, once when its row
# is dealt after reclaim took it; a healthy pass reads about once; the kernel turns its own
# read-around off for a file that misses often, so a thrashing reader may not read more)
AMPLIFICATION_MIN = 1.5
# ...of which at least this share were pages read again after reclaim evicted them, read
# what the page cache could not keep. A quarter: thrashing grows its share over a few
# windows, while a cold pass, warm data and the read-ahead of a start refault none.
REFAULT_SHARE_MIN = 0.25
# Windows shorter than this are not judged: an epoch start's read-ahead passes in about a
# second (a window's blocks at the disk's rate), and the meter's windows grow to 10 s.
MEMORY_WINDOW_SECONDS_MIN = 2.0


@dataclasses.dataclass(frozen=True)
class MemoryCounters:
    """The readers' memory group at a reading: file pages refaulted since it was made
    (bytes, cumulative), its limit (the lowest of it and the groups above it; None: none
    below the machine's) and its name ("/a/b", or "" for the machine)."""

    refault_bytes: int
    limit_bytes: int | None
    group: str


def memory_counters(pid: int, root: str = "/") -> MemoryCounters | None:
    """The counters of the memory group process `pid` is in: a cgroup v1 memory controller's
    or v2's where it has one, else the machine's; None where none can be read."""
    text = _read(os.path.join(root, "proc", str(pid), "cgroup")) or ""
    for line in text.splitlines():
        _, controllers, group = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            found = _v1(os.path.join(root, "sys/fs/cgroup/memory"), group)
        elif line.startswith("0::"):
            found = _v2(os.path.join(root, "sys/fs/cgroup"), group)
        else:
            continue
        if found is not None:
            return found
    refaults = _field(_read(os.path.join(root, "proc/vmstat")), "workingset_refault_file")
    return None if refaults is None else MemoryCounters(refaults * _PAGE_BYTES, None, "")


def _v1(mount: str, group: str) -> MemoryCounters | None:
    """v1: memory.stat's hierarchical counters (total_, the group's and those below it) and
    limit (the lowest on the way up); the root group's are the machine's."""
    text = _read(os.path.join(mount, group.strip("/"), "memory.stat"))
    refaults = _field(text, "total_workingset_refault_file")
    if refaults is None:
        return None
    limit = _field(text, "hierarchical_memory_limit")
    return MemoryCounters(refaults * _PAGE_BYTES, limit if limit is not None and limit < _UNLIMITED_BYTES else None,
                          "/" + group.strip("/") if group.strip("/") else "")


def _v2(mount: str, group: str) -> MemoryCounters | None:
    """v2 (at /sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host): memory.stat is
    hierarchical; the limit is the lowest memory.max on the way up."""
    parts = [part for part in group.split("/") if part and part != ".."][:_CGROUP_DEPTH_MAX]
    for base in (mount, os.path.join(mount, "unified")):
        refaults = _field(_read(os.path.join(base, *parts, "memory.stat")), "workingset_refault_file")
        if refaults is None:
            continue
        limits = [_number(_read(os.path.join(base, *parts[:depth], "memory.max")))
                  for depth in range(len(parts), 0, -1)]
        limits = [limit for limit in limits if limit is not None and limit < _UNLIMITED_BYTES]
        return MemoryCounters(refaults * _PAGE_BYTES, min(limits) if limits else None,
                              "/" + "/".join(parts) if parts else "")
    return None


def shared_group(group: str) -> bool:
    """Whether memory group `group` ("/a/b", "" for the machine) counts other jobs' pages
    too: the machine's, a top-level slice of systemd's, or a login session's scope."""
    parts = [part for part in group.split("/") if part]
    return not parts or (len(parts) == 1 and parts[0].endswith(".slice")) or \
        (parts[-1].startswith("session-") and parts[-1].endswith(".scope"))


def memory_window(before: MemoryCounters | None, after: MemoryCounters | None, storage_bytes: int | None,
                  needed_bytes: float | None, window_s: float = MEMORY_WINDOW_SECONDS_MIN) -> dict | None:
    """What the window (of `window_s`) says of the page cache: {"read_amplification"
    (storage_bytes, what the readers read, over needed_bytes, the stored bytes of the rows
    they delivered), "refaulted_share" (of storage_bytes), "memory_group",
    "memory_limit_bytes" where one is set, "page_cache_short" (both signals past their
    bounds, over a window long enough, in a group of the readers' own; where not judged,
    "page_cache" says why)}; None where either signal is unknown."""
    refaulted = refaulted_share(before, after, storage_bytes)
    if refaulted is None or not needed_bytes:
        return None
    found = {"read_amplification": round(storage_bytes / needed_bytes, 2),
             "refaulted_share": round(refaulted, 3), "memory_group": after.group}
    if after.limit_bytes is not None:
        found["memory_limit_bytes"] = after.limit_bytes
    found["page_cache_short"] = False
    if shared_group(after.group):
        found["page_cache"] = (f"not judged: the readers' memory group ({after.group or 'the machine'}) counts "
                               f"other jobs' refaults too")
    elif window_s < MEMORY_WINDOW_SECONDS_MIN:
        found["page_cache"] = (f"not judged: a window of {window_s:.1f} s (at least {MEMORY_WINDOW_SECONDS_MIN:.0f} s: "
                               f"an epoch start reads ahead before it deals)")
    else:
        found["page_cache_short"] = (found["read_amplification"] >= AMPLIFICATION_MIN
                                     and found["refaulted_share"] >= REFAULT_SHARE_MIN)
    return found


def refaulted_share(before: MemoryCounters | None, after: MemoryCounters | None,
                    storage_bytes: int | None) -> float | None:
    """The share of `storage_bytes` (what the readers read from storage between the two
    counters) that their memory group refaulted; None where either is unknown."""
    if before is None or after is None or before.group != after.group or not storage_bytes:
        return None
    return min(1.0, max(0, after.refault_bytes - before.refault_bytes) / storage_bytes)


def memory_advice(memory: dict) -> str:
    """The memory verdict's words, from memory_window's dict."""
    limit = memory.get("memory_limit_bytes")
    where = (f"the memory group {memory['memory_group']}'s limit of {limit / 2**20:,.0f} MiB" if limit is not None
             else f"the memory group {memory['memory_group']}'s" if memory["memory_group"] else "the machine's memory")
    return (f"readers read {memory['read_amplification']:.1f}x the stored bytes of the rows they delivered, "
            f"{memory['refaulted_share']:.0%} of it pages the kernel had read and evicted before their rows were "
            f"dealt: the page cache ({where}) cannot hold what the readers read ahead, so faster storage or more "
            f"readers would not help; a smaller shuffle_window (its window and the blocks read ahead of it in about "
            f"half that memory; one, for a global shuffle), more memory for the group, or fewer bytes (shmloader "
            f"convert compresses)")


def _field(text: str | None, name: str) -> int | None:
    """The value of line "NAME VALUE" in memory.stat or /proc/vmstat (foreign input: a
    value that is not a number is none)."""
    for line in (text or "").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == name and fields[1].isdigit():
            return int(fields[1])
    return None


def _number(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None  # "max" (no limit) and garbage alike.


def _read(path: str) -> str | None:
    return read_text(path, _STAT_BYTES_MAX)
