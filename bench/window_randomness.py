"""What the block-local shuffle costs in randomness, on data stored sorted by class (as
ImageFolder trees and many real files are): the mean number of distinct labels in a batch
and the largest share one label takes of a batch, for several windows against the global
shuffle. Pure sampler arithmetic: no files are read.

Beside the loader's orders it models one it does not have yet (--sliding), to weigh it
before building it: a sliding window, where block i of the epoch's block order is dealt
over phases i..i+B-1 (cyclically), a phase being the rows of the B blocks open in it,
shuffled. A batch then draws from B blocks as a window of B blocks does, but the memory
is B+1 blocks instead of the window shuffle's 2B (the window being served and the next
one read ahead): the table gives both orders at equal memory.

    python bench/window_randomness.py                       # 1,000,000 rows, 1,000 classes
    python bench/window_randomness.py --rows 50000 --classes 10 --block-rows 100
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import table  # noqa: E402

from shmloader.sampler import Sampler  # noqa: E402


def diversity(sampler: Sampler, classes: int, rows: int, steps: int) -> tuple[float, float]:
    labels_per_row = rows // classes
    distinct, top_share = [], []
    for step in range(steps):
        labels = sampler.fill(step) // labels_per_row
        counts = np.bincount(labels.astype(np.int64), minlength=classes)
        distinct.append(np.count_nonzero(counts))
        top_share.append(counts.max() / len(labels))
    return float(np.mean(distinct)), float(np.mean(top_share))


def sliding_stream(rows: int, block_rows: int, blocks: int, positions: int, seed: int = 0) -> np.ndarray:
    """The first `positions` rows of epoch 0 of the sliding-window order (see the module).
    Each block's rows are split at random into `blocks` groups; phase p takes group k of
    the block at place (p - k) mod F of the block order, for k = 0..blocks-1, and shuffles
    them. (The tail past the last full block is left out: it does not change a batch.)"""
    rng = np.random.default_rng(seed)
    full = rows // block_rows
    order = rng.permutation(full)
    cuts = [k * block_rows // blocks for k in range(blocks + 1)]
    splits: dict[int, np.ndarray] = {}
    stream, phase = [], 0
    while sum(len(part) for part in stream) < positions:
        parts = []
        for k in range(blocks):
            place = (phase - k) % full
            if place not in splits:
                splits[place] = order[place] * block_rows + rng.permutation(block_rows)
            parts.append(splits[place][cuts[k]:cuts[k + 1]])
        stream.append(rng.permutation(np.concatenate(parts)))
        phase += 1
    return np.concatenate(stream)[:positions]


def stream_diversity(stream: np.ndarray, batch_size: int, classes: int, rows: int) -> tuple[float, float]:
    labels_per_row = rows // classes
    distinct, top_share = [], []
    for start in range(0, len(stream) - batch_size + 1, batch_size):
        counts = np.bincount((stream[start:start + batch_size] // labels_per_row).astype(np.int64), minlength=classes)
        distinct.append(np.count_nonzero(counts))
        top_share.append(counts.max() / batch_size)
    return float(np.mean(distinct)), float(np.mean(top_share))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--block-rows", type=int, default=5461, help="the loader's for 3 KB rows (16 MiB blocks)")
    parser.add_argument("--windows", default="16384,65536,262144")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--sliding", action="store_true", help="also the sliding-window model, at equal memory")
    args = parser.parse_args()
    expected = args.classes * (1 - (1 - 1 / args.classes) ** args.batch_size)
    print(f"{args.rows:,} rows sorted into {args.classes:,} classes, batch {args.batch_size}, blocks of "
          f"{args.block_rows:,} rows; a uniform draw expects {expected:.1f} distinct labels a batch")
    rows = []
    settings = [("global shuffle", None)] + [(f"shuffle_window={int(w):,}", int(w)) for w in args.windows.split(",")]
    for label, window in settings:
        block_rows = args.block_rows if window is None else max(1, min(args.block_rows, window // 8))
        sampler = Sampler(args.rows, args.batch_size, "shuffle", 0, shuffle_window=window, block_rows=block_rows)
        mean_distinct, mean_top = diversity(sampler, args.classes, args.rows, args.steps)
        blocks = "-" if window is None else f"{sampler.blocks_per_window} x {block_rows:,}"
        memory = "-" if window is None else f"{2 * sampler.blocks_per_window}"
        rows.append([label, blocks, memory, f"{mean_distinct:.1f}", f"{mean_top:.3f}"])
        if args.sliding and window is not None:
            for open_blocks in (sampler.blocks_per_window, 2 * sampler.blocks_per_window - 1):
                stream = sliding_stream(args.rows, block_rows, open_blocks, args.steps * args.batch_size)
                mean_distinct, mean_top = stream_diversity(stream, args.batch_size, args.classes, args.rows)
                rows.append([f"  sliding, {open_blocks} blocks open", f"{open_blocks} x {block_rows:,}",
                             f"{open_blocks + 1}", f"{mean_distinct:.1f}", f"{mean_top:.3f}"])
    print(table(rows, ["order", "blocks x rows", "blocks in memory", "distinct labels / batch",
                       "largest label share"]))


if __name__ == "__main__":
    main()
