"""Data larger than memory (cold cache): rows/s of a plain read() of the file (one process,
8 MiB at a time, no read-ahead overlap), the loader's sequential mode, its global shuffle, its block-local shuffle
(shuffle_window) at several sizes, PyTorch's DataLoader (shuffle, 2 workers) over a
memory-mapped .npy, and litdata (the same rows optimized into 64 MB chunks, its shuffle:
chunk order, then rows within the chunks its workers hold), over a file that does not fit
the memory the loader may use. Every delivered row is checked against its index.

A cgroup-v1 memory group (page cache counts against it) confines the loader and its
readers to --limit-gib, below the file's size; the file is evicted from the page cache
(posix_fadvise DONTNEED) before each run, so every run starts cold. Needs root and
/sys/fs/cgroup/memory; the group is removed at the end. The file is written once to
--path (a disk, not tmpfs) and kept for later runs unless --remove.

    python bench/cold.py                                    # 1,000,000 rows of 3,072 B (3 GB), 2 GiB
    python bench/cold.py --rows 300000 --limit-gib 0.5 --seconds 10
    python bench/cold.py --rows 11000000 --limit-gib 0 --skip litdata   # 33 GB, larger than the machine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, table  # noqa: E402

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
    started, read = time.perf_counter(), 0
    with open(args.path, "rb", buffering=0) as handle:
        while time.perf_counter() - started < args.seconds:
            count = handle.readinto(buffer)
            if not count:
                break
            read += count
    elapsed = time.perf_counter() - started
    return {"rows": read * rows_total // os.path.getsize(args.path), "seconds": elapsed, "wrong_rows": 0,
            "block_rows": 0, "window_blocks": 0}


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
    rows, wrong, started = 0, 0, time.perf_counter()
    for data, order in loader:
        wrong += int(np.count_nonzero(data[:, :8].numpy().copy().view(np.uint64).ravel() != order.numpy()))
        rows += len(order)
        if time.perf_counter() - started > args.seconds:
            break
    return {"rows": rows, "seconds": time.perf_counter() - started, "wrong_rows": wrong, "block_rows": 0,
            "window_blocks": 0}


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
    rows, wrong, started = 0, 0, time.perf_counter()
    for batch in loader:
        order, data = batch["index"].numpy(), batch["row"].numpy()
        wrong += int(np.count_nonzero(data[:, :8].copy().view(np.uint64).ravel() != order.astype(np.uint64)))
        rows += len(order)
        if time.perf_counter() - started > args.seconds:
            break
    return {"rows": rows, "seconds": time.perf_counter() - started, "wrong_rows": wrong, "block_rows": 0,
            "window_blocks": 0}


def run_child(args) -> None:
    """One measurement, inside the memory group: prints a JSON line."""
    if args.mode in ("disk", "torch", "litdata"):
        rate = {"disk": _disk_rate, "torch": _torch_rate, "litdata": _litdata_rate}[args.mode]
        print(json.dumps(rate(args)))
        return
    from shmloader import ShmDataLoader

    window = None if args.window == 0 else args.window
    mode = "sequential" if args.mode == "sequential" else "shuffle"
    with ShmDataLoader({"x": args.path}, batch_size=args.batch_size, readers=args.readers, mode=mode, seed=1,
                       shuffle_window=window) as loader:
        rows, wrong, started = 0, 0, time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            batch = next(loader)
            wrong += int(np.count_nonzero(batch["x"][:, :8].copy().view(np.uint64).ravel() != batch.indices))
            rows += len(batch.indices)
            del batch
        elapsed = time.perf_counter() - started
        sampler = loader.sampler
    print(json.dumps({"rows": rows, "seconds": elapsed, "wrong_rows": wrong,
                      "block_rows": sampler.block_rows, "window_blocks": sampler.blocks_per_window}))


def run_in_group(command: list[str], limit_bytes: int, timeout: float) -> dict:
    """Runs `command` (which prints a JSON line last) in a new cgroup-v1 memory group of
    `limit_bytes` (0: no group, for a file larger than the machine's memory), and returns
    that JSON with the group's peak usage; removes the group."""
    if not limit_bytes:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command[2:])}: exit {result.returncode}\n{result.stderr[-3000:]}")
        return {**json.loads(result.stdout.strip().splitlines()[-1]), "peak_bytes": 0}
    group = f"{_CGROUP_ROOT}/shmloader_bench_{os.getpid()}"
    os.makedirs(group, exist_ok=True)
    try:
        with open(f"{group}/memory.limit_in_bytes", "w") as handle:
            handle.write(str(limit_bytes))

        def enter_group() -> None:
            with open(f"{group}/cgroup.procs", "w") as handle:
                handle.write(str(os.getpid()))

        result = subprocess.run(command, capture_output=True, text=True, preexec_fn=enter_group, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command[2:])}: exit {result.returncode}\n{result.stderr[-3000:]}")
        with open(f"{group}/memory.max_usage_in_bytes") as handle:
            peak = int(handle.read())
        measured = json.loads(result.stdout.strip().splitlines()[-1])
        measured["peak_bytes"] = peak
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="/var/tmp/shmloader_larger_than_memory.npy")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--row-bytes", type=int, default=3072)
    add_run_arguments(parser, batch_size=256)
    parser.add_argument("--windows", default="262144,65536,16384", help="shuffle_window values to measure")
    parser.add_argument("--remove", action="store_true", help="delete the file at the end")
    parser.add_argument("--skip", default="", help="contenders left out: any of disk,global,torch,litdata")
    parser.add_argument("--mode", default="shuffle", help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=0, help=argparse.SUPPRESS)
    args = parse_or_run_child(parser, run_child)
    if args is None:
        return
    write_file(args.path, args.rows, args.row_bytes)
    size_gib = os.path.getsize(args.path) / 2**30
    group = f"memory group {args.limit_gib:g} GiB" if args.limit_gib else "no memory group"
    print(f"{machine_line()}; file {size_gib:.2f} GiB, {group}, "
          f"{args.readers} readers, batch {args.batch_size}, {args.seconds:g} s a run, cold cache each run")
    skip = set(filter(None, args.skip.split(",")))
    runs = [("read() of the file, 8 MiB at a time", "disk", 0)] * ("disk" not in skip) + [("sequential", "sequential", 0)]
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
    rows = []
    try:
        for label, mode, window in runs:
            measured = measure(args, mode, window)
            rate = measured["rows"] / measured["seconds"]
            block = f"{measured['block_rows']:,} x {measured['window_blocks']}" if window else "-"
            rows.append([label, f"{rate:,.0f}", f"{rate * args.row_bytes / 1e6:,.0f}", block,
                         f"{measured['peak_bytes'] / 2**30:.2f}", measured["wrong_rows"]])
            print(" | ".join(str(cell) for cell in rows[-1]), flush=True)
    finally:
        if args.remove:
            os.unlink(args.path)
    print(table(rows, ["order", "rows/s", "MB/s", "block rows x blocks", "group peak GiB", "wrong rows"]))
    rates = {row[0]: float(row[1].replace(",", "")) for row in rows}
    sequential = rates["sequential"]
    print("\n".join(f"{label}: {rate / sequential:.1%} of shmloader's sequential rate"
                    for label, rate in rates.items() if label != "sequential"))


if __name__ == "__main__":
    main()
