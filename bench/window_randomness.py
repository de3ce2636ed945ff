"""What the block-local shuffle costs in randomness, on data stored sorted by class (as
ImageFolder trees and many real files are): the mean number of distinct labels in a batch
and the largest share one label takes of a batch, for several windows against the global
shuffle, over a whole epoch (its first and last phases, where the sliding window fills and
drains, included) and over its middle only. Pure sampler arithmetic: no files are read.

    python bench/window_randomness.py                       # 1,000,000 rows, 1,000 classes
    python bench/window_randomness.py --block-rows 5461,10922   # 16 and 32 MiB blocks of 3 KB rows
    python bench/window_randomness.py --rows 50000 --classes 10 --block-rows 100
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import table  # noqa: E402

from shmloader.plan.sampler import Sampler  # noqa: E402


def diversity(sampler: Sampler, classes: int, rows: int, steps: range) -> tuple[float, float]:
    labels_per_row = rows // classes
    distinct, top_share = [], []
    for step in steps:
        labels = sampler.fill(step) // labels_per_row
        counts = np.bincount(labels.astype(np.int64), minlength=classes)
        distinct.append(np.count_nonzero(counts))
        top_share.append(counts.max() / len(labels))
    return float(np.mean(distinct)), float(np.mean(top_share))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--block-rows", default="10922",
                        help="rows per block, comma-separated (10922: the loader's 32 MiB blocks of 3 KB rows)")
    parser.add_argument("--windows", default="16384,65536,262144")
    args = parser.parse_args()
    expected = args.classes * (1 - (1 - 1 / args.classes) ** args.batch_size)
    print(f"{args.rows:,} rows sorted into {args.classes:,} classes, batch {args.batch_size}, one epoch; a uniform "
          f"draw expects {expected:.1f} distinct labels a batch")
    epoch_steps = args.rows // args.batch_size
    middle = range(epoch_steps // 4, 3 * epoch_steps // 4)
    rows = []
    settings = [("global shuffle", None, 1)] + [
        (f"shuffle_window={int(window):,}", int(window), int(block_rows))
        for window in args.windows.split(",") for block_rows in args.block_rows.split(",")]
    done = set()
    for label, window, block_rows in settings:
        block_rows = block_rows if window is None else max(1, min(block_rows, window // 8))  # As the loader's.
        if (window, block_rows) in done:
            continue
        done.add((window, block_rows))
        sampler = Sampler(args.rows, args.batch_size, "shuffle", 0, shuffle_window=window, block_rows=block_rows)
        whole = diversity(sampler, args.classes, args.rows, range(epoch_steps))
        mid = diversity(sampler, args.classes, args.rows, middle)
        blocks = "-" if window is None else f"{sampler.blocks_per_window} x {block_rows:,}"
        rows.append([label, blocks, f"{whole[0]:.1f}", f"{mid[0]:.1f}", f"{whole[1]:.3f}"])
    print(table(rows, ["order", "blocks x rows", "distinct labels / batch (epoch)", "(middle half)",
                       "largest label share (epoch)"]))


if __name__ == "__main__":
    main()
