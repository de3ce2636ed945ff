"""Does the layout advice hold? Files as python-blosc2 writes them (made here, in a temporary
directory removed at exit): for each, what the loader advises, then the loader's own rate on
the file and on what `shmloader convert` writes from it, alternated in one run.

    python bench/layout_advice.py [--batch-size 256] [--seconds 3] [--rounds 2] [--only WORD]

An advised file should gain at least 1.5x once converted; a file not advised should not lose
by keeping its layout; and convert's output should never load slower than its input (convert
keeps an input's layout where its own would be slower). Rates are the median of `--rounds`
alternated runs, each measured as `shmloader bench` does (warm-up, rounds until stable or
--seconds). Nothing is written outside the temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_line, table  # noqa: E402

from shmloader.storage import layout_advice  # noqa: E402
from shmloader.storage.layout import poor_layout  # noqa: E402
from shmloader.storage.spec import describe_field  # noqa: E402
from shmloader.tools.benchmark import run_loader  # noqa: E402
from shmloader.tools.convert import convert  # noqa: E402
from shmloader.tools.measuring import StopRule  # noqa: E402


def layouts(directory: str, batch_size: int) -> dict[str, str]:
    import blosc2

    rng = np.random.default_rng(0)
    lz4 = blosc2.CParams(codec=blosc2.Codec.LZ4)
    made = {
        "int64 labels, one LZ4 chunk": (rng.integers(0, 1000, 2_000_000), dict(chunks=(2_000_000,), cparams=lz4)),
        "int64 labels, defaults": (rng.integers(0, 1000, 2_000_000), {}),
        "200k int64 labels, one LZ4 chunk": (rng.integers(0, 1000, 200_000), dict(chunks=(200_000,), cparams=lz4)),
        "bool rows of 64, defaults": (rng.random((500_000, 64)) > 0.5, {}),
        "3 KB uint8 rows, defaults": (rng.integers(0, 16, (50_000, 3072), dtype=np.uint8), {}),
        "float32 rows of 32, DELTA": (rng.random((200_000, 32), dtype=np.float32),
                                      dict(cparams=blosc2.CParams(filters=[blosc2.Filter.DELTA], filters_meta=[0]))),
        "uint8 images, blocks split rows": (rng.integers(0, 16, (20_000, 32, 32), dtype=np.uint8),
                                            dict(chunks=(500, 32, 32), blocks=(50, 16, 32))),
    }
    paths = {}
    for index, (name, (data, options)) in enumerate(made.items()):
        paths[name] = os.path.join(directory, f"layout{index}.b2nd")
        blosc2.asarray(data, urlpath=paths[name], mode="w", **options)
    # Files already laid out well (what convert writes): the advice must stay silent on them.
    for name in ("int64 labels, defaults", "3 KB uint8 rows, defaults"):
        target = os.path.join(directory, f"converted{len(paths)}.b2nd")
        paths[name.replace("defaults", "as convert writes them")] = convert(
            paths[name], target, progress=False, batch_size=batch_size).path
    return paths


def loader_rate(path: str, batch_size: int, rule: StopRule) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The advice is looked at separately.
        return run_loader({"x": path}, batch_size, None, None, "shuffle", False, rule)["rows_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=3.0, help="the most one loader measurement lasts")
    parser.add_argument("--rounds", type=int, default=2, help="alternated runs of each file and its conversion")
    parser.add_argument("--only", default="", help="only the files whose description holds this text")
    arguments = parser.parse_args()
    rule = StopRule(warmup_s=0.5, min_s=1.0, max_s=arguments.seconds)
    rows = []
    with tempfile.TemporaryDirectory(prefix="shmloader-layout-bench-") as directory:
        for name, path in layouts(directory, arguments.batch_size).items():
            if arguments.only not in name:
                continue
            spec = describe_field(path)
            advice = layout_advice.measure(spec, arguments.batch_size)
            advised = poor_layout(spec) and advice.worth_it  # What the loader warns of.
            notes: list[str] = []
            converted = convert(path, path + ".converted.b2nd", progress=False, batch_size=arguments.batch_size,
                                notes=notes)
            ours, theirs = [], []
            for _ in range(arguments.rounds):
                ours.append(loader_rate(path, arguments.batch_size, rule))
                theirs.append(loader_rate(converted.path, arguments.batch_size, rule))
            ratio = statistics.median(theirs) / statistics.median(ours)
            rows.append([name, f"{spec.chunks}/{spec.blocks} {spec.codec}", "yes" if advised else "no",
                         f"{advice.gain:.2f}x", "kept" if notes else "convert's", f"{statistics.median(ours):,.0f}",
                         f"{statistics.median(theirs):,.0f}", f"{ratio:.2f}x"])
            print(rows[-1], flush=True)
    print(f"\n{machine_line()}; batch {arguments.batch_size}, {arguments.rounds} alternated runs each, medians\n")
    print(table(rows, ["file", "chunks/blocks codec", "advised", "sample gain", "convert wrote",
                       "loader rows/s as is", "after convert", "after / as is"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
