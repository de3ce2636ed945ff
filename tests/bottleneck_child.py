"""A trainer for test_bottleneck.py's throttled disk: it joins the cgroups it is given (so its
fork server and readers, its descendants, are in them too), reads a .npy with two readers
(and the loader's OPTIONS, a JSON object, where given) and a trainer that does nothing, and asks stats()["bottleneck"] and `top`'s view of its ring
(tools/monitor.py, as `shmloader top` draws it) what limits it, until both name the stage
it is told to expect (and, where given, both lines hold WORDS; OPTIONS' top_expected and
top_words are top's where they differ) or a deadline passes. Prints
one JSON line: the last verdicts (stats()'s and top's), top's screen, and the stages seen.
Not a test module.

Usage: bottleneck_child.py CGROUP_PROCS_PATHS DATA_PATH EXPECTED_STAGE DEADLINE_SECONDS [WORDS [OPTIONS]]
(CGROUP_PROCS_PATHS: one or more, joined by commas.)
"""

from __future__ import annotations

import json
import os
import sys
import time

from child_guard import die_with_parent

from shmloader import ShmDataLoader
from shmloader.tools.monitor import Monitor, render_text

# stats() and top are asked this often: two of the meter's readings (SAMPLE_INTERVAL_SECONDS
# apart at least), a window that holds a few fills even when each waits for the disk.
_LOOK_SECONDS = 0.5
# Rows of 4 KiB, 64 a batch: a step reads 256 KiB, a fraction of a second at the test's rate.
_BATCH_ROWS = 64


def main() -> None:
    die_with_parent()
    procs_path, data_path, expected, deadline_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    words = sys.argv[5] if len(sys.argv) > 5 else ""
    options = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    # Looking on for this long at least: a verdict that must hold past a point (a group's limit reached).
    at_least = time.monotonic() + options.pop("look_seconds_min", 0.0)
    # What top must name where it cannot name stats()'s stage (top judges no memory), and its words.
    top_expected, top_words = options.pop("top_expected", expected), options.pop("top_words", words)
    # Joined after the imports: the interpreter's own files are not the reads under test.
    for path in procs_path.split(","):
        with open(path, "w") as procs:
            procs.write(str(os.getpid()))
    seen, verdict, screen, top = [], None, "", None
    deadline = time.monotonic() + deadline_s
    with ShmDataLoader({"x": data_path}, **{"batch_size": _BATCH_ROWS, "readers": 2, **options}) as loader:
        monitor = Monitor([loader.diagnostics.ring_name])
        monitor.refresh()
        look_at = time.monotonic() + _LOOK_SECONDS
        for batch in loader:
            del batch
            if time.monotonic() < look_at:
                continue
            look_at = time.monotonic() + _LOOK_SECONDS
            verdict = loader.stats()["bottleneck"]
            monitor.refresh()
            views = list(monitor.views.values())
            top = views[0].bottleneck if views else None
            screen = render_text(monitor)
            seen.append([verdict["stage"], top["stage"] if top else None])
            print(verdict["line"], verdict["detail"], file=sys.stderr, flush=True)  # For a failure's message.
            said = words in verdict["line"] and top is not None and top_words in top["line"]
            if (seen[-1] == [expected, top_expected] and said and time.monotonic() > at_least) or \
                    time.monotonic() > deadline:
                break
    print(json.dumps({"verdict": verdict, "top": screen, "top_verdict": top, "seen": seen}), flush=True)


if __name__ == "__main__":
    main()
