"""Memory of a contender's processes while it runs: their proportional set size (PSS), summed,
sampled from the benchmark's own process.

PSS (Pss in /proc/PID/smaps_rollup, Linux 4.14 on) counts each page a process maps divided
by the number of processes mapping it: private memory whole, a fork's copy-on-write pages
and shared memory (a ring in /dev/shm, torch's shared tensors) split among their mappers, so
the sum over a set of processes counts every page they hold once. RSS would count a page
shared by a trainer and its two workers three times.

The sampler is a thread of the benchmark, not of the contender: a thread in the trainer
would cost the trainer CPU, and would make shmloader's drop-in refuse to fork the trainer
(it does not fork a process with other Python threads running) and fall back. It sums the
benchmark's descendants: run_contender runs one contender at a time, so they are that
contender's processes (the trainer, its workers or readers and fork server, and orphans
re-parented to the benchmark as subreaper).
"""

from __future__ import annotations

import os
import statistics
import threading
import time

from _common import _process_table

# How often the processes are sampled: often enough to see a start-up's peak (a first
# batch takes tenths of a second), seldom enough that reading /proc (every process's stat
# and its descendants' smaps_rollup) costs the 2 shared cores little.
_SAMPLE_INTERVAL_SECONDS = 0.2


def pss_bytes(pid: int) -> int:
    """The Pss of one process in bytes, or 0 where it exited (or is not readable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as handle:
            for line in handle:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024  # The kernel writes kB (KiB).
    except (OSError, ValueError):
        return 0
    return 0


def descendants(root_pid: int) -> list[int]:
    """The live descendants of `root_pid`, from /proc's parent pids."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in _process_table().items():
        children.setdefault(parent, []).append(pid)
    found, pending = [], list(children.get(root_pid, ()))
    for _ in range(len(children) + sum(len(pids) for pids in children.values())):  # Each pid once at most.
        if not pending:
            break
        pid = pending.pop()
        found.append(pid)
        pending.extend(children.get(pid, ()))
    return found


class PssSampler:
    """Samples the summed PSS of this process's descendants every _SAMPLE_INTERVAL_SECONDS
    while the `with` block runs; `peak_bytes` is the largest sum seen, `peak_processes` how
    many processes that sum covered, `samples` the (wall-clock time, sum) pairs taken."""

    def __init__(self) -> None:
        self.peak_bytes, self.peak_processes = 0, 0
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * _SAMPLE_INTERVAL_SECONDS + 5)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(_SAMPLE_INTERVAL_SECONDS):
            pids = descendants(me)
            total = sum(pss_bytes(pid) for pid in pids)
            self.samples.append((time.time(), total))
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_processes = total, len(pids)

    def median_between(self, start: float, end: float) -> int:
        """The median sum sampled between wall-clock times `start` and `end` (a timed
        window's: the loader running, start-up left out), or the peak where none was."""
        inside = [total for when, total in self.samples if start <= when <= end]
        return int(statistics.median(inside)) if inside else self.peak_bytes
