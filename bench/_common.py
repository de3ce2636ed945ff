"""Helpers shared by the benchmarks: timing, CPU accounting of a contender's processes, test
data that compresses like images, tables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np


def best_rate(function, items_per_call: int, repeats: int = 5, min_seconds: float = 0.2) -> float:
    """The best of `repeats` measurements of items per second (noise on a shared machine is one-sided)."""
    return best_rate_and_cpu(function, items_per_call, repeats, min_seconds)[0]


def best_rate_and_cpu(function, items_per_call: int, repeats: int = 5,
                      min_seconds: float = 0.2) -> tuple[float, float]:
    """(items per second, CPU seconds per item) of the best of `repeats` measurements of a
    function run in this process. The CPU is this process's user+system time over every
    thread (Blosc2's included), which is all a function that starts no process spends."""
    best, cpu_per_item = 0.0, 0.0
    for _ in range(repeats):
        calls, started, cpu_started = 0, time.perf_counter(), time.process_time()
        while True:
            function()
            calls += 1
            elapsed = time.perf_counter() - started
            if elapsed >= min_seconds:
                break
        cpu = time.process_time() - cpu_started
        if calls * items_per_call / elapsed > best:
            best, cpu_per_item = calls * items_per_call / elapsed, cpu / (calls * items_per_call)
    return best, cpu_per_item


# CPU accounting: what a contender's processes spend, its readers and workers included.
#
# Each contender runs in a child process of the benchmark (run_contender) that starts all it
# uses: the trainer, and its fork server and readers, or a peer's workers. The kernel adds
# a process's user+system time, and that of the children it reaped, to its parent when the
# parent reaps it; so the rusage that wait4 returns for the child covers every descendant
# reaped by its own parent before that parent was reaped. shmloader's readers are children
# of the fork server, which reaps each one (to report its exit code) before close()
# returns, and the server is the trainer's child, reaped by the trainer's atexit handler.
# PyTorch's workers under the default fork context are joined by the loader. A process
# group or session would not find these processes (the fork server and every reader call
# setsid), so the check below follows parent pids instead.
#
# Not every descendant is reaped by its parent: multiprocessing's forkserver (PyTorch's
# multiprocessing_context="forkserver") reaps the workers but outlives the trainer, which
# never waits for it; orphaned, it would go to init with its workers' CPU. So the benchmark
# makes itself a subreaper (PR_SET_CHILD_SUBREAPER): orphans of the child's tree come to it,
# and run_contender waits for them too and adds their rusage. A cgroup's cpuacct.usage would
# count them as well, but needs root and a cgroup-v1 cpuacct controller (or v2 cpu.stat);
# the subreaper needs neither.
#
# The check: the child reports, at its timed window's end, its tree's CPU from /proc
# (cpu_mark). rusage must be at least that; where it is not, a descendant escaped both its
# parent and the subreaper (one still running when run_contender stopped waiting), and
# run_contender says so and counts the /proc figure.
#
# The rates count rows from the start of a timed window, after imports and start-up (a
# torch import alone costs seconds of CPU); so does the CPU: the child reports the tree's
# CPU at the window's start too, and the figure is the rusage total less that: the window
# plus the loader's tear-down (close(), the workers' and the fork server's exit). The child
# ends through finish_child, so the interpreter's own finalization is not in it.

# The CPU /proc shows a process is in clock ticks, rounded down per field: how far the
# end-of-window total may sit above rusage (which is exact) with every descendant reaped.
_UNREAPED_SLACK_SECONDS = 0.05
# How often run_contender looks whether its child, or an orphan of its tree, has exited.
_CHILD_POLL_SECONDS = 0.05
# How long run_contender waits, after its child exited, for the orphans re-parented to the
# benchmark (a forkserver sees its trainer's end on a pipe and exits within milliseconds).
_ORPHAN_WAIT_SECONDS = 10.0
_PR_SET_CHILD_SUBREAPER = 36  # From <linux/prctl.h>.


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds of the process and of the children it reaped) for
    every process in /proc: utime + stime + cutime + cstime, every thread included."""
    tick = os.sysconf("SC_CLK_TCK")
    processes = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                # The command name (in parentheses) may hold spaces: fields count from its end.
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # It exited meanwhile.
        processes[int(name)] = (int(fields[1]), sum(int(value) for value in fields[11:15]) / tick)
    return processes


def tree_cpu_seconds(root_pid: int | None = None) -> float:
    """User+system CPU seconds spent so far by a process (this one by default) and all its
    live descendants, with the children each has reaped: from /proc, to clock ticks."""
    processes = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    total, pending = 0.0, [os.getpid() if root_pid is None else root_pid]
    for _ in range(len(processes) + 1):  # Each process once: parent pids form a tree.
        if not pending:
            break
        pid = pending.pop()
        total += processes.get(pid, (0, 0.0))[1]
        pending.extend(children.get(pid, ()))
    return total


def cpu_mark() -> dict[str, float]:
    """What a benchmark's child reports at its timed window's start and end, as "cpu_start"
    and "cpu_end" in its JSON line (see run_contender): its tree's CPU so far, and its own."""
    return {"tree_s": tree_cpu_seconds(), "trainer_s": time.process_time()}


def finish_child(result: dict) -> None:
    """Ends a benchmark's child: prints `result` (with its cpu_mark()s) as its last line, runs
    the atexit handlers (shmloader's ends its fork server and reaps it; multiprocessing's
    joins its children) and exits without the interpreter's finalization, which frees every
    module (most of a CPU second with torch imported) and is no loader's work."""
    import atexit

    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(0)


def _become_subreaper() -> bool:
    """Makes this process the one orphans of its descendants go to (Linux 3.4 on)."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children() -> set[int]:
    me = os.getpid()
    return {pid for pid, (parent, _) in _process_table().items() if parent == me}


def _reap_orphans(earlier_children: set[int]) -> tuple[float, list[int]]:
    """(CPU seconds, pids left running) of the processes re-parented to this subreaper
    since `earlier_children` was taken, each waited for until _ORPHAN_WAIT_SECONDS."""
    total, deadline = 0.0, time.monotonic() + _ORPHAN_WAIT_SECONDS
    while True:
        orphans = _children() - earlier_children  # An orphan's own orphans come here too.
        for pid in orphans:
            try:
                reaped, _, usage = os.wait4(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # Not ours after all (a process of this one's own, started meanwhile).
            if reaped:
                total += usage.ru_utime + usage.ru_stime
        if not orphans or time.monotonic() > deadline:
            return total, sorted(_children() - earlier_children)
        time.sleep(_CHILD_POLL_SECONDS)


def _wait_with_rusage(process: subprocess.Popen, timeout_s: float, what: str):
    """Reaps `process` by wait4 (its rusage with its descendants'), within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)  # Reaped here: Popen must not wait.
            return usage
        if time.monotonic() > deadline:
            process.kill()
            os.wait4(process.pid, 0)
            process.returncode = -9
            raise TimeoutError(f"{what}: still running after {timeout_s:g} s, killed")
        time.sleep(_CHILD_POLL_SECONDS)


def run_contender(command: list[str], timeout_s: float, what: str = "", **popen_options) -> dict:
    """Runs one contender as a child process and returns the JSON object that `command`
    prints as its last line, with the CPU its processes spent (see above):

    - cpu_s: user+system seconds of the child and every descendant, from its timed
      window's start to their exit (rusage from wait4, less the window's start mark);
    - trainer_cpu_s: the child's own process (every thread) within the window;
    - cpu_window_s: the tree's CPU within the window alone, from /proc (to clock ticks);
    - cpu_whole_life_s: the rusage total, start-up included;
    - cpu_orphans_s: the part of it from orphans of the tree, reaped by this subreaper;
    - cpu_unreaped_s: what the window's end mark saw that rusage lacks: 0 when every
      descendant was reaped; otherwise it is added to cpu_s and a warning is printed.

    The child's JSON must hold "cpu_start" and "cpu_end" (cpu_mark()), best printed by
    finish_child; `popen_options` go
    to subprocess.Popen (env, cwd, preexec_fn). Runs one child at a time. Raises
    RuntimeError naming `what` and the child's exit code and stderr where it fails,
    TimeoutError past `timeout_s`."""
    what = what or " ".join(command[1:4])
    subreaper = _become_subreaper()
    earlier_children = _children()
    with tempfile.TemporaryFile() as output_file, tempfile.TemporaryFile() as error_file:
        # Output to files, not pipes: the child is reaped by wait4 (for its rusage), not by
        # communicate(), and a full pipe would block it meanwhile.
        process = subprocess.Popen(command, stdout=output_file, stderr=error_file, **popen_options)
        usage = _wait_with_rusage(process, timeout_s, what)
        orphans_s, left_running = _reap_orphans(earlier_children) if subreaper else (0.0, [])
        output_file.seek(0)
        error_file.seek(0)
        stdout = output_file.read().decode(errors="replace")
        stderr = error_file.read().decode(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"{what}: exit {process.returncode}\n{stderr[-3000:]}")
    lines = stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{what}: printed nothing (a JSON line was expected last)\n{stderr[-3000:]}")
    result = json.loads(lines[-1])
    start, end = result.pop("cpu_start"), result.pop("cpu_end")
    whole_life = usage.ru_utime + usage.ru_stime + orphans_s
    unreaped = end["tree_s"] - whole_life
    unreaped = unreaped if unreaped > _UNREAPED_SLACK_SECONDS else 0.0
    if unreaped or left_running:
        print(f"warning: {what}: {unreaped:.2f} CPU s of its processes are missing from rusage (counted from /proc "
              f"instead); still running after {_ORPHAN_WAIT_SECONDS:g} s: {left_running or 'none'}", file=sys.stderr)
    result.update(cpu_s=whole_life + unreaped - start["tree_s"], trainer_cpu_s=end["trainer_s"] - start["trainer_s"],
                  cpu_window_s=end["tree_s"] - start["tree_s"], cpu_whole_life_s=whole_life, cpu_orphans_s=orphans_s,
                  cpu_unreaped_s=unreaped)
    return result


def per_million(seconds: float, count: float) -> str:
    """CPU seconds per million items, formatted ("-" for no items)."""
    return format_per_million(seconds / count * 1e6) if count > 0 else "-"


def format_per_million(seconds_per_million: float) -> str:
    """CPU seconds per million items to about three significant figures."""
    value = seconds_per_million
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def image_rows(rows: int, row_bytes: int, seed: int = 0) -> np.ndarray:
    """uint8 rows that compress like natural images (smooth gradients plus sensor noise),
    not like pure noise, nor like a constant: LZ4 gains little on them, ZSTD some."""
    rng = np.random.default_rng(seed)
    side = int(np.sqrt(row_bytes / 3))
    out = np.empty((rows, row_bytes), dtype=np.uint8)
    position = np.arange(row_bytes)
    for start in range(0, rows, 1024):
        stop = min(start + 1024, rows)
        count = stop - start
        slope = rng.uniform(0.02, 0.2, size=(count, 1))
        phase = rng.uniform(0, 255, size=(count, 1))
        pixel = position // 3
        smooth = phase + slope * (pixel % max(side, 1)) + slope * (pixel // max(side, 1)) * 0.5
        noise = rng.normal(0, 2, size=(count, row_bytes))
        out[start:stop] = np.clip(smooth + noise, 0, 255).astype(np.uint8)
    return out


def machine_line() -> str:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return f"{platform.machine()}, {cores} cores, Python {platform.python_version()}, numpy {np.__version__}"


def table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = [" | ".join(str(cell).ljust(width) for cell, width in zip(header, widths))]
    lines.append("-|-".join("-" * width for width in widths))
    lines += [" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(lines)


RESULTS_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def add_write_argument(parser) -> None:
    """--write: the only way a benchmark touches the checkout (bench/results/<name>.json)."""
    parser.add_argument("--write", action="store_true",
                        help="save this run's table in bench/results/ (tracked; bench/report.py turns it into the "
                             "README's and RESULTS.md's tables); without it nothing in the checkout changes")


def command_line(script: str) -> str:
    """How to rerun this benchmark: its own options, less --write."""
    return " ".join([f"python bench/{script}", *(item for item in sys.argv[1:] if item != "--write")])


def record(benchmark: str, command: str, header: list[str], rows: list[list], headline: list[list] = (),
           notes: list[str] = (), write: bool = False) -> str | None:
    """With `write`, saves bench/results/<benchmark>.json: the run's table, where and when it
    ran, and `headline`, its rows for the README's table ([what, rate, / single process,
    / PyTorch]); `python bench/report.py --write` turns these files into RESULTS.md's current
    table and the README's. Without it, says how to save and writes nothing (a run leaves the
    checkout as it was). Returns the path written, or None."""
    if not write:
        print(f"\n(not saved: rerun with --write to keep this run in bench/results/{benchmark}.json)")
        return None
    import datetime
    import json
    import subprocess

    root = os.path.dirname(RESULTS_DIRECTORY)
    try:  # The commit measured; "-dirty" where a file other than the results differs from it.
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  ":(exclude)bench/results"], cwd=root, capture_output=True, text=True,
                                 check=True).stdout.strip()
        commit += "-dirty" if changed else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    data = {"benchmark": benchmark, "command": command, "date": datetime.date.today().isoformat(), "commit": commit,
            "machine": machine_line(), "header": list(header), "rows": [[str(cell) for cell in row] for row in rows],
            "headline": [[str(cell) for cell in row] for row in headline], "notes": list(notes)}
    os.makedirs(RESULTS_DIRECTORY, exist_ok=True)
    path = os.path.join(RESULTS_DIRECTORY, f"{benchmark}.json")
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")
    print(f"\nsaved in {path}")
    return path
