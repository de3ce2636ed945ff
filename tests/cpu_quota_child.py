"""A trainer for test_cpu_quota.py's real CPU quota: it joins the cgroups it is given (its fork
server and readers, its descendants, join them too), then reads a .npy as fast as readers
give it, with readers="auto" (the default), for SECONDS, and prints one JSON line: the cores
the loader's defaults count, the reader count at the start and at each look, and the idle
cores the bottleneck verdict saw. Not a test module.

Usage: cpu_quota_child.py CGROUP_PROCS_PATHS DATA_PATH SECONDS
(CGROUP_PROCS_PATHS: one or more, joined by commas.)
"""

from __future__ import annotations

import json
import os
import sys
import time

from child_guard import die_with_parent

from shmloader import ShmDataLoader
from shmloader.plan import defaults

_LOOK_SECONDS = 0.5


def main() -> None:
    die_with_parent()
    procs_paths, data_path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    for path in procs_paths.split(","):  # Before the loader asks for its quota (found once a process).
        with open(path, "w") as procs:
            procs.write(str(os.getpid()))
    counts, idle = [], []
    with ShmDataLoader({"x": data_path}, batch_size=256) as loader:
        start = loader.stats()["reader_count"]
        end = look_at = time.monotonic() + _LOOK_SECONDS
        end += seconds
        for batch in loader:
            del batch
            now = time.monotonic()
            if now < look_at:
                continue
            look_at = now + _LOOK_SECONDS
            stats = loader.stats()
            counts.append(stats["reader_count"])
            idle.append(stats["bottleneck"].get("detail", {}).get("idle_cores"))
            if now >= end:
                break
        changes = loader.stats().get("reader_changes")
    print(json.dumps({"cores": defaults._affinity_cores(), "start": start, "counts": counts, "idle": idle,
                      "changes": changes}, default=str))


if __name__ == "__main__":
    main()
