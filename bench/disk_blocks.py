"""How the disk reads a file in blocks taken in random order against the same blocks in
file order: what sizes the block-local shuffle's blocks (shmloader/plan.py,
_SHUFFLE_BLOCK_BYTES). Each measurement evicts the file from the page cache
(posix_fadvise DONTNEED), then `--threads` threads pread whole blocks, each taking the next
block of the order, until `--megabytes` are read; measurements of each setting alternate,
since a shared disk drifts.

    python bench/disk_blocks.py                     # the cold benchmark's 3 GB file
    python bench/disk_blocks.py --sizes 4,16,32,64 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_line, table  # noqa: E402


def read_rate(path: str, block_bytes: int, threads: int, megabytes: int, shuffled: bool, seed: int) -> float:
    """MB/s of `threads` threads reading `megabytes` of `path` in blocks, cold."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)
    blocks = list(range(os.path.getsize(path) // block_bytes))
    if shuffled:
        random.Random(seed).shuffle(blocks)
    pending = blocks[:max(1, (megabytes << 20) // block_bytes)][::-1]
    lock = threading.Lock()

    def work() -> None:
        handle = os.open(path, os.O_RDONLY)
        buffer = bytearray(block_bytes)
        try:
            while True:
                with lock:
                    if not pending:
                        return
                    block = pending.pop()
                os.preadv(handle, [buffer], block * block_bytes)
        finally:
            os.close(handle)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return min(megabytes << 20, len(blocks) * block_bytes) / 1e6 / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="/var/tmp/shmloader_larger_than_memory.npy",
                        help="a file on the disk to measure (bench/cold.py writes this one)")
    parser.add_argument("--sizes", default="16,32,64", help="block sizes in MiB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--megabytes", type=int, default=1500, help="read per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not os.path.exists(args.path):
        sys.exit(f"{args.path} does not exist: run bench/cold.py first, or pass --path")
    print(f"{machine_line()}; {args.path}, {args.threads} threads, {args.megabytes:,} MB a measurement, cold each")
    settings = [(size, shuffled) for size in map(int, args.sizes.split(",")) for shuffled in (False, True)]
    rates: dict[tuple[int, bool], list[float]] = {setting: [] for setting in settings}
    for round_index in range(args.rounds):
        for size, shuffled in settings:
            rates[(size, shuffled)].append(read_rate(args.path, size << 20, args.threads, args.megabytes, shuffled,
                                                     round_index))
    rows = []
    for size in map(int, args.sizes.split(",")):
        in_order, random_order = rates[(size, False)], rates[(size, True)]
        mean_in_order, mean_random = sum(in_order) / len(in_order), sum(random_order) / len(random_order)
        rows.append([f"{size} MiB", ", ".join(f"{rate:,.0f}" for rate in in_order),
                     ", ".join(f"{rate:,.0f}" for rate in random_order), f"{mean_random / mean_in_order:.0%}"])
    print(table(rows, ["block", "file order MB/s", "random order MB/s", "random / file order (means)"]))


if __name__ == "__main__":
    main()
