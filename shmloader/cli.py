"""The `shmloader` command: demo, convert, inspect and bench."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(arguments) -> int:
    from .demo import run

    result = run(rows=arguments.rows, steps=arguments.steps, readers=arguments.readers, progress=not arguments.quiet)
    return 0 if result["accuracy"] > 2 * result["chance"] else 1


def _convert(arguments) -> int:
    from .convert import convert

    spec = convert(
        arguments.input, arguments.output, codec=arguments.codec, clevel=arguments.clevel,
        rows_per_block=arguments.rows_per_block, force=arguments.force, progress=not arguments.quiet,
    )
    ratio = spec.uncompressed_bytes / max(spec.compressed_bytes, 1)
    codec = "uncompressed" if spec.clevel == 0 else spec.codec
    print(f"wrote {spec.path}: {spec.row_count:,} rows of {spec.row_shape} {spec.numpy_dtype}, chunks {spec.chunks}, "
          f"blocks {spec.blocks}, {codec}, ratio {ratio:.2f}")
    return 0


def _inspect(arguments) -> int:
    from .convert import inspect

    report = inspect(arguments.file, sample=arguments.sample)
    if arguments.json:
        print(json.dumps(report, default=str))
        return 0
    width = max(len(key) for key in report)
    for key, value in report.items():
        print(f"{key.ljust(width)}  {value}")
    return 0


def _bench(arguments) -> int:
    from .benchmark import run_cli

    return run_cli(arguments)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmloader", description="Zero-copy shared-memory data loader.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small model on a generated dataset through the loader")
    demo.add_argument("--rows", type=int, default=20_000)
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--readers", type=int, default=2)
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(handler=_demo)

    convert = commands.add_parser("convert", help="write a .npy or .b2nd file as a Blosc2 file laid out for random rows")
    convert.add_argument("input")
    convert.add_argument("output")
    convert.add_argument("--codec", choices=["auto", "lz4", "blosclz", "zstd", "none"], default="auto",
                         help="auto: LZ4 if it saves at least 10%% on a sample, else uncompressed")
    convert.add_argument("--clevel", type=int, default=5)
    convert.add_argument("--rows-per-block", type=int, default=None)
    convert.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(handler=_convert)

    inspect = commands.add_parser("inspect", help="layout, compression and measured random-row cost of a file")
    inspect.add_argument("file")
    inspect.add_argument("--sample", type=int, default=64, help="random rows timed")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(handler=_inspect)

    bench = commands.add_parser("bench", help="run the loader on your files and report its speed")
    bench.add_argument("files", nargs="+", help="field files (.b2nd or .npy), one per field")
    bench.add_argument("--readers", type=int, default=None)
    bench.add_argument("--slots", type=int, default=None)
    bench.add_argument("--batch-size", type=int, default=256)
    bench.add_argument("--steps", type=int, default=500)
    bench.add_argument("--mode", choices=["sequential", "random", "shuffle"], default="shuffle")
    bench.add_argument("--sweep", action="store_true", help="try several reader and slot counts")
    bench.add_argument("--plot", metavar="PNG", help="with --sweep: draw throughput (needs matplotlib)")
    bench.add_argument("--compare", choices=["torch"], help="also run PyTorch's DataLoader on the same files")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")
    bench.set_defaults(handler=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        return arguments.handler(arguments)
    except (FileNotFoundError, FileExistsError, ValueError, TypeError, OSError) as error:
        print(f"shmloader {arguments.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
