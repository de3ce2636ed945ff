"""Data larger than memory (cold cache): rows/s of a plain read() of the file (one process,
8 MiB at a time, no read-ahead overlap), the loader's sequential mode, its global shuffle, its block-local shuffle
(shuffle_window) at several sizes, PyTorch's DataLoader (shuffle, 2 workers) over a
memory-mapped .npy, and litdata (the same rows optimized into 64 MB chunks, its shuffle:
chunk order, then rows within the chunks its workers hold), over a file that does not fit
the memory the loader may use. Every delivered row is checked against its index.

Each contender runs --rounds times (3). The disk here is a virtio device that its host
caches, so a run's rate moves with what ran before it. Each round therefore starts with
the plain read() and ends with it again (the one sequential reader, the round's reference:
the mean of the two), and the contenders between them are rotated one place per round, so
that none always follows the same run. The table gives each contender's median rows/s over
the rounds and their spread (min-max); ratios are taken within a round (sequential mode /
window, sequential mode / the read(), window / the read()), then their median and spread.

Beside each rate: the CPU seconds per million rows of all the contender's processes (the
trainer, the loader's fork server and readers, a peer's workers; user+system) from the start
of its timed run to their exit, and the trainer's own share within the run, each the median
over the rounds (bench/_common.py, run_contender, says how every process is counted).

A cgroup-v1 memory group (page cache counts against it) confines the loader and its
readers to --limit-gib, below the file's size; the file is evicted from the page cache
(posix_fadvise DONTNEED) before each run, so every run starts cold. Needs root and
/sys/fs/cgroup/memory; the group is removed at the end. The file is written once to
--path (a disk, not tmpfs) and kept for later runs unless --remove.

    python bench/cold.py                                    # 1,000,000 rows of 3,072 B (3 GB), 2 GiB
    python bench/cold.py --rows 300000 --limit-gib 0.5 --seconds 10 --rounds 2
    python bench/cold.py --rows 11000000 --limit-gib 0 --skip litdata   # 33 GB, larger than the machine
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    add_write_argument,
    command_line,
    cpu_mark,
    finish_child,
    format_per_million,
    machine_line,
    per_million,
    record,
    run_contender,
    table,
)

_CGROUP_ROOT = "/sys/fs/cgroup/memory"


def write_file(path: str, rows: int, row_bytes: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) > rows * row_bytes:
        header = np.load(path, mmap_mode="r")
        if header.shape == (rows, row_bytes):
            return
    print(f"writing {rows:,} rows of {row_bytes} bytes to {path} ...", flush=True)
    array = np.lib.format.open_memmap(path + ".partial", mode="w+", dtype=np.uint8, shape=(rows, row_bytes))
    piece = 65536
    for start in range(0, rows, piece):
        stop = min(rows, start + piece)
        # Each row starts with its own index, so that a wrong row would be caught below.
        block = np.random.default_rng(start).integers(0, 256, (stop - start, row_bytes), dtype=np.uint8)
        block[:, :8] = np.arange(start, stop, dtype=np.uint64)[:, None].view(np.uint8)
        array[start:stop] = block
    array.flush()
    del array
    os.replace(path + ".partial", path)


def evict(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def _disk_rate(args) -> dict:
    """The file read front to back in 8 MiB reads by one process (one request at a time:
    a floor for the disk, not its ceiling; the kernel's read-ahead under mmap does more)."""
    rows_total = np.load(args.path, mmap_mode="r").shape[0]
    buffer = bytearray(8 << 20)
    cpu_start = cpu_mark()
    started, read = time.perf_counter(), 0
    with open(args.path, "rb", buffering=0) as handle:
        while time.perf_counter() - started < args.seconds:
            count = handle.readinto(buffer)
            if not count:
                break
            read += count
    elapsed = time.perf_counter() - started
    return {"rows": read * rows_total // os.path.getsize(args.path), "seconds": elapsed, "wrong_rows": 0,
            "block_rows": 0, "window_blocks": 0, "cpu_start": cpu_start, "cpu_end": cpu_mark()}


def _torch_rate(args) -> dict:
    """PyTorch's DataLoader over np.load(mmap_mode="r"): shuffle, 2 workers, batched
    __getitems__ (one fancy index per batch), as a user would write it."""
    import torch

    class Rows(torch.utils.data.Dataset):
        def __init__(self, path):
            self.path, self.array = path, None

        def __len__(self):
            return np.load(self.path, mmap_mode="r").shape[0]

        def __getitems__(self, indices):
            if self.array is None:
                self.array = np.load(self.path, mmap_mode="r")
            order = np.asarray(indices)
            return torch.from_numpy(self.array[order]), torch.from_numpy(order)

    loader = torch.utils.data.DataLoader(Rows(args.path), batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.readers, collate_fn=lambda batch: batch)
    cpu_start = cpu_mark()
    rows, wrong, started = 0, 0, time.perf_counter()
    for data, order in loader:
        wrong += int(np.count_nonzero(data[:, :8].numpy().copy().view(np.uint64).ravel() != order.numpy()))
        rows += len(order)
        if time.perf_counter() - started > args.seconds:
            break
    return {"rows": rows, "seconds": time.perf_counter() - started, "wrong_rows": wrong, "block_rows": 0,
            "window_blocks": 0, "cpu_start": cpu_start, "cpu_end": cpu_mark()}


class _LitdataRows:
    """litdata's fn: the first row of a piece in, its rows out with their indices."""

    def __init__(self, path: str, piece: int) -> None:
        self.path, self.piece = path, piece

    def __call__(self, first: int):
        array = np.load(self.path, mmap_mode="r")
        for index in range(first, min(first + self.piece, array.shape[0])):
            yield {"index": index, "row": np.array(array[index])}


def litdata_directory(path: str) -> str:
    return path.removesuffix(".npy") + ".litdata"


def write_litdata(path: str) -> None:
    """The file's rows optimized by litdata into 64 MB chunks, once."""
    import litdata

    directory = litdata_directory(path)
    if os.path.exists(os.path.join(directory, "index.json")):
        return
    rows, piece = np.load(path, mmap_mode="r").shape[0], 65536
    print(f"optimizing {rows:,} rows with litdata into {directory} ...", flush=True)
    litdata.optimize(fn=_LitdataRows(path, piece), inputs=list(range(0, rows, piece)), output_dir=directory,
                     chunk_bytes="64MB", num_workers=1, mode="overwrite")


def _litdata_rate(args) -> dict:
    """litdata's StreamingDataLoader over the optimized chunks: shuffle, `readers` workers."""
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(litdata_directory(args.path), shuffle=True, seed=1)
    loader = StreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=args.readers)
    cpu_start = cpu_mark()
    rows, wrong, started = 0, 0, time.perf_counter()
    for batch in loader:
        order, data = batch["index"].numpy(), batch["row"].numpy()
        wrong += int(np.count_nonzero(data[:, :8].copy().view(np.uint64).ravel() != order.astype(np.uint64)))
        rows += len(order)
        if time.perf_counter() - started > args.seconds:
            break
    return {"rows": rows, "seconds": time.perf_counter() - started, "wrong_rows": wrong, "block_rows": 0,
            "window_blocks": 0, "cpu_start": cpu_start, "cpu_end": cpu_mark()}


def run_child(args) -> None:
    """One measurement, inside the memory group: prints a JSON line and exits."""
    if args.mode in ("disk", "torch", "litdata"):
        rate = {"disk": _disk_rate, "torch": _torch_rate, "litdata": _litdata_rate}[args.mode]
        finish_child(rate(args))
    from shmloader import ShmDataLoader

    window = None if args.window == 0 else args.window
    mode = "sequential" if args.mode == "sequential" else "shuffle"
    with ShmDataLoader({"x": args.path}, batch_size=args.batch_size, readers=args.readers, mode=mode, seed=1,
                       shuffle_window=window) as loader:
        cpu_start = cpu_mark()
        rows, wrong, started = 0, 0, time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            batch = next(loader)
            wrong += int(np.count_nonzero(batch["x"][:, :8].copy().view(np.uint64).ravel() != batch.indices))
            rows += len(batch.indices)
            del batch
        elapsed = time.perf_counter() - started
        cpu_end = cpu_mark()
        sampler = loader.sampler
    finish_child({"rows": rows, "seconds": elapsed, "wrong_rows": wrong, "block_rows": sampler.block_rows,
                  "window_blocks": sampler.blocks_per_window, "cpu_start": cpu_start, "cpu_end": cpu_end})


def run_in_group(command: list[str], limit_bytes: int, timeout: float) -> dict:
    """Runs `command` (a child that ends with _common.finish_child) in a new cgroup-v1 memory
    group of `limit_bytes` (0: no group, for a file larger than the machine's memory), and
    returns its JSON with the CPU of its processes (_common.run_contender) and the group's
    peak usage; removes the group."""
    what = " ".join(command[2:])
    if not limit_bytes:
        return {**run_contender(command, timeout, what), "peak_bytes": 0}
    group = f"{_CGROUP_ROOT}/shmloader_bench_{os.getpid()}"
    os.makedirs(group, exist_ok=True)
    try:
        with open(f"{group}/memory.limit_in_bytes", "w") as handle:
            handle.write(str(limit_bytes))

        def enter_group() -> None:
            with open(f"{group}/cgroup.procs", "w") as handle:
                handle.write(str(os.getpid()))

        measured = run_contender(command, timeout, what, preexec_fn=enter_group)
        with open(f"{group}/memory.max_usage_in_bytes") as handle:
            measured["peak_bytes"] = int(handle.read())
        return measured
    finally:
        for _ in range(50):
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)  # The group's last process is still exiting.


def measure(args, mode: str, window: int) -> dict:
    evict(args.path)
    if mode == "litdata":
        directory = litdata_directory(args.path)
        for name in os.listdir(directory):
            evict(os.path.join(directory, name))
    command = [sys.executable, os.path.abspath(__file__), "--child", "--path", args.path, "--mode", mode,
               "--window", str(window), "--seconds", str(args.seconds), "--readers", str(args.readers),
               "--batch-size", str(args.batch_size)]
    return run_in_group(command, int(args.limit_gib * 2**30), args.seconds + 120)


def add_run_arguments(parser: argparse.ArgumentParser, batch_size: int) -> None:
    """The settings every cold benchmark shares: the memory group and the loader's run."""
    parser.add_argument("--limit-gib", type=float, default=2.0,
                        help="the memory group's limit (0: no group, for a file larger than the machine)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each run lasts")
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def parse_or_run_child(parser: argparse.ArgumentParser, run_child) -> argparse.Namespace | None:
    """The parsed arguments of the parent run (root and a memory controller checked), or
    None once `run_child` has run this process as one measurement (--child)."""
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return None
    if args.limit_gib and (not os.path.isdir(_CGROUP_ROOT) or os.geteuid() != 0):
        sys.exit(f"needs root and a cgroup-v1 memory controller at {_CGROUP_ROOT}")
    return args


_DISK_LABEL = "read() of the file, 8 MiB at a time"
_SEQUENTIAL_LABEL = "sequential"


def contenders(args) -> tuple[list[tuple[str, str, int]], bool]:
    """The runs between a round's two read()s, as (label, mode, window), and whether the
    read() runs at all (--skip disk)."""
    skip = set(filter(None, args.skip.split(",")))
    runs = [(_SEQUENTIAL_LABEL, "sequential", 0)]
    runs += [("shuffle (global)", "shuffle", 0)] * ("global" not in skip)
    runs += [(f"shuffle_window={int(window):,}", "shuffle", int(window)) for window in args.windows.split(",") if window]
    try:
        if "torch" not in skip:
            import torch  # noqa: F401
            runs.append(("PyTorch DataLoader, memmap, shuffle", "torch", 0))
    except ImportError:
        print("PyTorch is not installed: its row is left out")
    try:
        if "litdata" not in skip:
            write_litdata(args.path)
            runs.append(("litdata, 64 MB chunks, shuffle", "litdata", 0))
    except ImportError:
        print("litdata is not installed: its row is left out")
    try:
        import streaming  # noqa: F401
        print("MosaicML streaming is installed but not a contender here yet")
    except Exception as error:  # noqa: BLE001 (it fails in many ways beside other packages)
        print(f"MosaicML streaming cannot run here: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
    return runs, "disk" not in skip


def round_order(runs: list, disk: bool, round_index: int) -> list:
    """A round: the read() first and last, the other runs between, rotated by the round's
    index (see the module's docstring)."""
    shift = round_index % len(runs)
    bracket = [(_DISK_LABEL, "disk", 0)] if disk else []
    return bracket + runs[shift:] + runs[:shift] + bracket


def run_rounds(args, runs: list, disk: bool) -> list[dict[str, list[dict]]]:
    """Per round, each label's measurements (two for the read(), one for any other)."""
    rounds = []
    for round_index in range(args.rounds):
        measured: dict[str, list[dict]] = {}
        for label, mode, window in round_order(runs, disk, round_index):
            result = measure(args, mode, window)
            result["rate"] = result["rows"] / result["seconds"]
            measured.setdefault(label, []).append(result)
            print(f"round {round_index + 1}/{args.rounds}: {label}: {result['rate']:,.0f} rows/s, "
                  f"{per_million(result['cpu_s'], result['rows'])} CPU s / M rows "
                  f"(trainer {per_million(result['trainer_cpu_s'], result['rows'])})", flush=True)
        rounds.append(measured)
    return rounds


def _median_per_million(results: list[dict], key: str) -> str:
    """The median over `results` of CPU seconds (`key`) per million rows delivered."""
    values = [result[key] / result["rows"] * 1e6 for result in results if result["rows"]]
    return format_per_million(statistics.median(values)) if values else "-"


def summary_rows(args, runs: list, disk: bool, rounds: list) -> list[list]:
    """One row per contender: rows/s median and spread over its runs, and its CPU."""
    windows = {label: window for label, _, window in runs}
    rows = []
    for label in [_DISK_LABEL] * disk + [label for label, _, _ in runs]:
        results = [result for measured in rounds for result in measured[label]]
        rates = [result["rate"] for result in results]
        median = statistics.median(rates)
        block = f"{results[-1]['block_rows']:,} x {results[-1]['window_blocks']}" if windows.get(label) else "-"
        rows.append([label, f"{median:,.0f}", f"{min(rates):,.0f}-{max(rates):,.0f}",
                     f"{median * args.row_bytes / 1e6:,.0f}", block,
                     f"{max(result['peak_bytes'] for result in results) / 2**30:.2f}",
                     _median_per_million(results, "cpu_s"), _median_per_million(results, "trainer_cpu_s"),
                     sum(result["wrong_rows"] for result in results)])
    return rows


def ratio_rows(runs: list, disk: bool, rounds: list) -> list[list]:
    """The ratios the issue asks for, each taken within a round (a round's read() rate is
    the mean of its two), then their median and spread over the rounds."""
    def rate(measured: dict, label: str) -> float:
        return statistics.fmean(result["rate"] for result in measured[label])

    windows = [label for label, _, window in runs if window]
    pairs = [(_SEQUENTIAL_LABEL, window) for window in windows]
    if disk:
        pairs += [(_SEQUENTIAL_LABEL, _DISK_LABEL)] + [(window, _DISK_LABEL) for window in windows]
    pairs += [(label, _SEQUENTIAL_LABEL) for label, _, window in runs if label != _SEQUENTIAL_LABEL and not window]
    rows = []
    for top, bottom in pairs:
        ratios = [rate(measured, top) / rate(measured, bottom) for measured in rounds]
        bottom_name = "one sequential reader (read())" if bottom == _DISK_LABEL else bottom
        rows.append([f"{top} / {bottom_name}", f"{statistics.median(ratios):.3g}",
                     f"{min(ratios):.3g}-{max(ratios):.3g}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="/var/tmp/shmloader_larger_than_memory.npy")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--row-bytes", type=int, default=3072)
    add_run_arguments(parser, batch_size=256)
    parser.add_argument("--windows", default="262144,65536,16384", help="shuffle_window values to measure")
    parser.add_argument("--rounds", type=int, default=3, help="how many times each contender runs (see above)")
    parser.add_argument("--remove", action="store_true", help="delete the file at the end")
    parser.add_argument("--skip", default="", help="contenders left out: any of disk,global,torch,litdata")
    parser.add_argument("--mode", default="shuffle", help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=0, help=argparse.SUPPRESS)
    add_write_argument(parser)
    args = parse_or_run_child(parser, run_child)
    if args is None:
        return
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    write_file(args.path, args.rows, args.row_bytes)
    size_gib = os.path.getsize(args.path) / 2**30
    group = f"memory group {args.limit_gib:g} GiB" if args.limit_gib else "no memory group"
    setting = (f"file {size_gib:.2f} GiB, {group}, {args.readers} readers, batch {args.batch_size}, "
               f"{args.seconds:g} s a run, {args.rounds} rounds, cold cache each run")
    print(f"{machine_line()}; {setting}")
    runs, disk = contenders(args)
    try:
        rounds = run_rounds(args, runs, disk)
    finally:
        if args.remove:
            os.unlink(args.path)
    header = ["order", "rows/s (median)", "min-max", "MB/s", "block rows x blocks", "group peak GiB",
              "CPU s / M rows", "trainer CPU s / M rows", "wrong rows"]
    rows = summary_rows(args, runs, disk, rounds)
    print(table(rows, header))
    ratios = ratio_rows(runs, disk, rounds)
    print(f"\nratios within a round, over {args.rounds} rounds")
    print(table(ratios, ["ratio", "median", "min-max"]))
    record("cold", command_line("cold.py"), header, rows, write=args.write,
           notes=[setting, "CPU: all the contender's processes from its timed run's start to their exit; trainer: its "
                           "own process within the run; medians over the rounds",
                  *(f"{name}: {median} ({spread})" for name, median, spread in ratios)])


if __name__ == "__main__":
    main()
