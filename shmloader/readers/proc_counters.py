"""What /proc says of a loader's reader processes and of the cores this process may use,
read at a bottleneck reading (readers/bottleneck.py) only: never per batch.
"""

from __future__ import annotations

import os

_CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc files are small; a bound on what one read takes (foreign input: any process's).
_PROC_BYTES_MAX = 4096


def process_counters(pid: int) -> tuple[int | None, int | None, int | None]:
    """(ns on a CPU, ns waiting for one, bytes read from storage) of process `pid`, None for
    what cannot be read. The times are its main thread's (schedstat: the thread that fills,
    not the read-ahead's), or without schedstat the whole process's CPU time (stat)."""
    cpu_ns = queued_ns = read_bytes = None
    fields = (read_text(f"/proc/{pid}/schedstat") or "").split()
    if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
        cpu_ns, queued_ns = int(fields[0]), int(fields[1])
    else:
        text = read_text(f"/proc/{pid}/stat")
        fields = text[text.rfind(")") + 2:].split() if text else []  # After the command, which may hold spaces.
        if len(fields) > 12 and fields[11].isdigit() and fields[12].isdigit():
            cpu_ns = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // _CLOCK_TICKS_PER_SECOND
    text = read_text(f"/proc/{pid}/io")
    for line in (text or "").splitlines():
        name, _, value = line.partition(":")
        if name == "read_bytes" and value.strip().isdigit():
            read_bytes = int(value)
    return cpu_ns, queued_ns, read_bytes


def cores_counters() -> tuple[int | None, int | None, int]:
    """(idle ns, total ns, cores) summed over the cores this process may run on, from
    /proc/stat (idle and I/O wait count as idle)."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    text = read_text("/proc/stat", 1 << 16)
    idle = total = 0
    for line in (text or "").splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit() or int(name[3:]) not in allowed:
            continue
        ticks = [int(value) for value in values[:8] if value.isdigit()]
        if len(ticks) >= 5:
            idle, total = idle + ticks[3] + ticks[4], total + sum(ticks)
    if total == 0:
        return None, None, len(allowed)
    scale = 1_000_000_000 // _CLOCK_TICKS_PER_SECOND
    return idle * scale, total * scale, len(allowed)


def child_of(pid: int, trainer_pid: int) -> bool:
    """Whether `pid` runs on this node as the trainer's child or grandchild (a forked reader)."""
    parent = parent_of(pid)
    return parent is not None and parent > 0 and (parent == trainer_pid or parent_of(parent) == trainer_pid)


def parent_of(pid: int) -> int | None:
    text = read_text(f"/proc/{pid}/stat") or ""
    fields = text[text.rfind(")") + 2:].split()  # After the command, which may hold spaces.
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def read_text(path: str, limit: int = _PROC_BYTES_MAX) -> str | None:
    """At most `limit` bytes of a /proc, /sys or cgroup file, as ASCII; None where unreadable."""
    try:
        with open(path, "rb") as file:
            return file.read(limit).decode("ascii", "replace")
    except OSError:
        return None
