"""What the block-local shuffle costs in randomness, on data stored sorted by class (as
ImageFolder trees and many real files are): the mean number of distinct labels in a batch
and the largest share one label takes of a batch, for several windows against the global
shuffle. Pure sampler arithmetic: no files are read.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--block-rows", type=int, default=5461, help="the loader's for 3 KB rows (16 MiB blocks)")
    parser.add_argument("--windows", default="16384,65536,262144")
    parser.add_argument("--steps", type=int, default=2000)
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
        rows.append([label, blocks, f"{mean_distinct:.1f}", f"{mean_top:.3f}"])
    print(table(rows, ["order", "blocks per window x rows", "distinct labels / batch", "largest label share"]))


if __name__ == "__main__":
    main()
