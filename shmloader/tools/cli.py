"""The `shmloader` command (also `python -m shmloader`): demo, convert, import, inspect, verify,
bench, top and audit."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from .. import __version__

# The exit status of a command stopped by Ctrl-C, as shells report it (128 + SIGINT).
_EXIT_INTERRUPTED = 130


def _demo(arguments) -> int:
    from .demo import run

    result = run(rows=arguments.rows, steps=arguments.steps, readers=arguments.readers, progress=not arguments.quiet)
    if result["accuracy"] > 2 * result["chance"]:
        return 0
    print(f"shmloader demo: the model reached {result['accuracy']:.1%}, not twice chance ({2 * result['chance']:.0%}); "
          f"give it more --rows or --steps", file=sys.stderr)
    return 1


def _convert(arguments) -> int:
    from .convert import convert, is_structured
    from .inspection import io_advice
    from .upload import named, staged_output

    if is_structured(arguments.input):
        return _split(arguments)
    notes: list[str] = []
    with staged_output(arguments.output, arguments.force) as output:  # An s3:// output: uploaded once written.
        spec = convert(
            arguments.input, output, codec=arguments.codec, clevel=arguments.clevel,
            rows_per_block=arguments.rows_per_block, force=arguments.force, progress=not arguments.quiet,
            batch_size=arguments.batch_size, notes=notes,
        )
        advice = io_advice(spec)  # It reads the file written: before a staged one goes.
    ratio = spec.uncompressed_bytes / max(spec.compressed_bytes, 1)
    codec = "uncompressed" if spec.clevel == 0 else spec.codec
    print(named(f"wrote {spec.path}: {spec.row_count:,} rows of {spec.row_shape} {spec.numpy_dtype}, chunks "
                f"{spec.chunks}, blocks {spec.blocks}, {codec}, ratio {ratio:.2f}", arguments.output, output))
    print(named(advice, arguments.output, output))
    for note in notes:
        print(note)
    return 0


def _split(arguments) -> int:
    """A structured input: one file per field, and the loader's dict that reads them."""
    from .convert import split_fields

    if arguments.output.startswith("s3://"):
        raise ValueError(f"{arguments.input} is structured: split it into local files first, then upload each")
    specs = split_fields(arguments.input, arguments.output, codec=arguments.codec, clevel=arguments.clevel,
                         rows_per_block=arguments.rows_per_block, force=arguments.force,
                         progress=not arguments.quiet, batch_size=arguments.batch_size)
    for name, spec in specs.items():
        print(f"wrote {spec.path}: field {name!r}, {spec.row_count:,} rows of {spec.row_shape} {spec.numpy_dtype}")
    fields = ", ".join(f"{name!r}: {spec.path!r}" for name, spec in specs.items())
    print(f"load them with: ShmDataLoader({{{fields}}}, ...)")
    return 0


def _inspect(arguments) -> int:
    from ..storage.ragged import describe_ragged, is_ragged, record_lengths
    from .inspection import inspect

    if is_ragged(arguments.file):  # A ragged field: its records, then its values file.
        spec = describe_ragged(arguments.file)
        lengths = record_lengths(spec)
        report = {"path": spec.path, "format": "ragged", "records": spec.record_count, "dtype": spec.dtype,
                  "record_ndim": spec.record_ndim, "elements_min": int(lengths.min()),
                  "elements_mean": round(float(lengths.mean()), 1), "elements_max": int(lengths.max())}
        report.update({f"values_{key}": value for key, value in inspect(spec.values.path, sample=arguments.sample,
                                                                         batch_size=arguments.batch_size).items()
                       if key not in ("path", "format")})
    else:
        report = inspect(arguments.file, sample=arguments.sample, batch_size=arguments.batch_size)
    if arguments.json:
        print(json.dumps(report, default=str))
        return 0
    width = max(len(key) for key in report)
    for key, value in report.items():
        print(f"{key.ljust(width)}  {value}")
    return 0


def _convert_images(arguments) -> int:
    from .imagefolder import check_images, convert_images

    bad = []
    if arguments.check:
        bad = check_images(arguments.directory, progress=not arguments.quiet)
        for path, error in bad:
            print(f"{path}: {error}")
        if bad and not arguments.skip_bad:
            print(f"{len(bad)} image(s) do not decode: nothing written. Remove or replace them, or add --skip-bad "
                  f"to convert the others", file=sys.stderr)
            return 1
    from .upload import named, staged_output

    with staged_output(arguments.output, arguments.force) as output:  # An s3:// output: uploaded once written.
        paths = convert_images(arguments.directory, output, force=arguments.force, progress=not arguments.quiet,
                               skip_bad=arguments.skip_bad, skip=[path for path, _ in bad])
        with open(paths["classes"]) as handle:
            skipped = json.load(handle)["skipped"]
    paths = {name: named(path, arguments.output, output) for name, path in paths.items()}
    for entry in skipped:
        print(f"skipped {entry['file']}: {entry['reason']}")
    if skipped:
        print(f"{len(skipped)} file(s) left out; {paths['classes']} lists them under \"skipped\"")
    print("wrote " + ", ".join(paths.values()))
    print(f"load them with: ShmDataLoader({{'image': Packed({paths['image']!r}), 'label': {paths['label']!r}}}, ...)")
    return 0


def _import(arguments) -> int:
    from .upload import named, staged_output

    columns = arguments.columns.split(",") if arguments.columns else None
    if arguments.format == "webdataset" and (columns is not None or arguments.nulls or arguments.fixed or
                                             arguments.skip_columns or arguments.image_root is not None):
        print("--columns, --nulls, --fixed, --skip-columns and --image-root apply to parquet and arrow; a WebDataset "
              "import takes every extension, from the shards alone", file=sys.stderr)
        return 2
    options = dict(columns=columns, nulls=_nulls(arguments.nulls), force=arguments.force, progress=not arguments.quiet,
                   fixed=arguments.fixed.split(",") if arguments.fixed else None,
                   skip_unsupported=arguments.skip_columns, image_root=arguments.image_root)
    with staged_output(arguments.output, arguments.force) as output:  # An s3:// output: uploaded once written.
        paths = _import_into(arguments, output, options)
        for name, path in paths.items():
            print(f"{name}: {named(path, arguments.output, output)}")
        _print_import_notes(output)
    return 0


def _import_into(arguments, output: str, options: dict) -> dict:
    from . import formats
    from .webdataset import from_webdataset

    if arguments.format == "parquet":
        return formats.from_parquet(arguments.source, output, **options)
    if arguments.format == "webdataset":
        return from_webdataset(arguments.source, output, force=arguments.force, progress=not arguments.quiet)
    import pyarrow as pa

    with pa.memory_map(arguments.source, "r") as source:
        try:
            table = pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:
            try:
                source.seek(0)
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid as error:
                raise ValueError(f"{arguments.source}: neither an Arrow IPC file nor an Arrow stream "
                                 f"({error})") from None
    return formats.from_arrow(table, output, **options)


def _print_import_notes(output: str) -> None:
    """What columns.json says a user may want to know: skipped columns, and list columns
    of one length that --fixed would store as arrays."""
    import os

    from .formats import COLUMNS_FILE

    path = os.path.join(output, COLUMNS_FILE)
    if not os.path.exists(path):
        return
    with open(path) as handle:
        description = json.load(handle)
    for column, reason in description.get("skipped", {}).items():
        print(f"skipped column {column!r}: {reason}")
    for field, notes in description.get("fields", {}).items():
        if "one_length" in notes:
            print(f"column {field!r}: every list holds {notes['one_length']} items; --fixed {field} stores it as an "
                  f"(N, {notes['one_length']}) array instead of a ragged field")


def _nulls(items: list[str] | None) -> dict | None:
    """--nulls COLUMN=VALUE (repeatable): VALUE is a number, or "empty" for lists and text."""
    if not items:
        return None
    nulls = {}
    for item in items:
        column, equals, text = item.partition("=")
        if not equals or not column:
            raise ValueError(f"--nulls takes COLUMN=VALUE (VALUE a number, or 'empty' for lists and text), got {item!r}")
        if text == "empty":
            nulls[column] = text
            continue
        try:
            nulls[column] = int(text)
        except ValueError:
            try:
                nulls[column] = float(text)
            except ValueError:
                raise ValueError(f"--nulls {item}: {text!r} is neither a number nor 'empty'") from None
    return nulls


def _verify(arguments) -> int:
    from ..storage.ragged import describe_ragged, is_ragged
    from .convert import verify

    if is_ragged(arguments.file):  # Each of its files that carries checksums.
        spec = describe_ragged(arguments.file)
        parts = [part for part in (spec.values, spec.offsets, spec.shapes) if part is not None and part.checksums]
        if not parts:
            print(f"{arguments.file}: none of its files carries chunk checksums (write_ragged stores none); nothing "
                  f"to verify")
            return 1
        failed = 0
        for part in parts:
            bad = verify(part.path, progress=not arguments.quiet)
            print(f"{part.path}: {len(bad)} bad chunks" if bad else f"{part.path}: every chunk matches its checksum")
            failed += bool(bad)
        return 1 if failed else 0
    bad = verify(arguments.file, progress=not arguments.quiet)
    if bad:
        shown = ", ".join(str(chunk) for chunk in bad[:20]) + (" ..." if len(bad) > 20 else "")
        print(f"{arguments.file}: {len(bad)} bad chunks: {shown}")
        return 1
    print(f"{arguments.file}: every chunk matches its checksum")
    return 0


def _top(arguments) -> int:
    from .monitor import run

    return run(arguments.rings or None, interval_s=arguments.interval, once=arguments.once)


def _audit(arguments) -> int:
    from .audit import audit

    return audit(arguments.logs)


def _bench(arguments) -> int:
    from .benchmark import run_cli

    return run_cli(arguments)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it or there
    is none to say (None, a flag's False)."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def _positive_fraction(text: str) -> float:
    """An argparse type: a share above 0 (0.03 is 3%)."""
    value = float(text)
    if not 0 < value < 10:
        raise argparse.ArgumentTypeError(f"must be a share above 0 such as 0.03 (3%), got {text}")
    return value


def _non_negative(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _command(commands, name: str, help_text: str, handler) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=help_text, description=help_text, formatter_class=_Formatter)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmloader", description="Zero-copy shared-memory data loader.",
                                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"shmloader {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _command(commands, "demo", "train a small model on a generated dataset through the loader", _demo)
    demo.add_argument("--rows", type=_positive, default=20_000, help="rows in the generated dataset (at least 2,000)")
    demo.add_argument("--steps", type=_positive, default=300, help="training steps")
    demo.add_argument("--readers", type=int, default=2, help="reader processes")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")

    convert = _command(commands, "convert", "write a .npy or .b2nd file as a Blosc2 .b2nd laid out for random rows",
                       _convert)
    convert.add_argument("input", help="a .npy or Blosc2 file, or a sparse Blosc2 frame (a directory); a structured "
                                       "dtype is split into one file per field, OUTPUT.<field>.b2nd")
    convert.add_argument("output", help="the .b2nd file to write")
    convert.add_argument("--codec", choices=["auto", "lz4", "blosclz", "zstd", "none"], default="auto",
                         help="auto: LZ4 if it saves at least 10%% on a sample, else uncompressed")
    convert.add_argument("--clevel", type=int, default=5, help="compression level, 0-9 (ignored by --codec none)")
    convert.add_argument("--rows-per-block", type=int, default=None,
                         help="rows per Blosc2 block (default: about 4 KB of rows, at least one)")
    convert.add_argument("--batch-size", type=_positive, default=256,
                         help="the batch size you train with: a .b2nd input whose own layout reads random rows faster "
                              "in batches like it keeps that layout (unless --codec or --rows-per-block is given)")
    convert.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")

    images = _command(commands, "convert-images",
                      "store an ImageFolder directory (DIR/CLASS/IMAGE) as OUT.image, OUT.label, OUT.size and OUT.path",
                      _convert_images)
    images.add_argument("directory", help="one subdirectory per class, image files inside")
    images.add_argument("output", help="the stem of the files to write")
    images.add_argument("--force", action="store_true", help="overwrite existing outputs")
    images.add_argument("--quiet", action="store_true", help="no progress bar")
    images.add_argument("--check", action="store_true",
                        help="decode every image first (in parallel) and list those that fail, writing nothing then "
                             "(unless --skip-bad)")
    images.add_argument("--skip-bad", action="store_true",
                        help="leave out files that are empty, unreadable or not images (and, with --check, those that "
                             "do not decode), listing them")

    imports = _command(commands, "import", "import Parquet, an Arrow file or WebDataset shards as fields", _import)
    imports.add_argument("format", choices=("parquet", "arrow", "webdataset"), help="what SOURCE holds")
    imports.add_argument("source", help="Parquet or WebDataset tar shards: a file or a glob (quote it); Arrow: an "
                                        "IPC file or stream")
    imports.add_argument("output", help="the directory to write, one field per column")
    imports.add_argument("--columns", help="comma-separated columns to import (default: all)")
    imports.add_argument("--fixed", metavar="COLUMNS",
                         help="comma-separated list columns of one length throughout, stored as (N, length) arrays")
    imports.add_argument("--skip-columns", action="store_true",
                         help="skip (and name) columns with no field form, such as decimals, instead of stopping")
    imports.add_argument("--nulls", action="append", metavar="COLUMN=VALUE",
                         help="what a null of COLUMN becomes: a number, or 'empty' for lists, strings and binaries "
                              "(repeat for more columns; default: nulls are refused)")
    imports.add_argument("--image-root", metavar="DIR",
                         help="the directory under which images stored by path alone (an Image() row without bytes) "
                              "are read; a relative path is taken relative to it, and no path resolving outside it is "
                              "read (default: such rows are refused)")
    imports.add_argument("--force", action="store_true", help="overwrite an existing output")
    imports.add_argument("--quiet", action="store_true", help="no progress bar")

    inspect = _command(commands, "inspect", "layout, compression and measured random-row cost of a file", _inspect)
    inspect.add_argument("file", help="a .npy or .b2nd file, or a ragged field directory")
    inspect.add_argument("--sample", type=_positive, default=64, help="random rows timed")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--batch-size", type=_positive, default=256,
                         help="the batch size you train with: a .b2nd file's layout is measured against convert's "
                              "in batches like it")

    verify = _command(commands, "verify", "check every chunk of a converted .b2nd against its stored CRC-32",
                      _verify)
    verify.add_argument("file", help="a .b2nd file written by shmloader convert, or a ragged field directory")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")

    top = _command(commands, "top", "a live view of every loader on this machine (or of the rings named), read "
                                    "from their rings: slots, readers, rows/s", _top)
    top.add_argument("rings", nargs="*", help="ring names (loader.diagnostics.ring_name) to show; default: all")
    top.add_argument("--interval", type=_positive_seconds, default=1.0, help="seconds between samples")
    top.add_argument("--once", action="store_true", help="print one sample and exit")

    audit = _command(commands, "audit", "prove from the audit logs of every rank (audit_log=PATH), across resumes "
                                        "and reshapes, that each row of each epoch was delivered once, or name the "
                                        "rows missing or repeated; exit status 1 on a problem", _audit)
    audit.add_argument("logs", nargs="+", help="every rank's log files, of every run of the training")

    bench = _command(commands, "bench", "run the loader on your files and report its speed", _bench)
    bench.add_argument("files", nargs="+", help="one per field: a .b2nd or .npy file, a quoted glob of them, or a "
                       "ragged directory (read as Packed)")
    bench.add_argument("--readers", type=_non_negative, default=None,
                       help="reader processes, 0 to fill steps in the trainer (default: the loader's, \"auto\")")
    bench.add_argument("--slots", type=_positive, default=None, help="batch slots (default: the loader's, 4 * readers + 2, for readers=\"auto\" of the most it "
                       "may reach, fewer past 1 GiB)")
    bench.add_argument("--batch-size", type=_positive, default=256, help="rows per batch")
    bench.add_argument("--seconds", type=_positive_seconds, default=20.0,
                       help="the most seconds one measurement lasts: after a 1 s warm-up it runs rounds of 0.5 s "
                            "until 5 in a row agree within --tolerance (and at least 2.5 s), or until this")
    bench.add_argument("--tolerance", type=_positive_fraction, default=0.03,
                       help="the spread ((max - min) / median of the last 5 rounds) at which a figure counts as "
                            "stable")
    bench.add_argument("--steps", type=_positive, default=None,
                       help="time exactly this many batches instead, as one round, without warm-up or spread (a "
                            "quick check, not a figure to trust)")
    bench.add_argument("--mode", choices=["sequential", "random", "shuffle"], default="shuffle", help="sampler mode")
    bench.add_argument("--sweep", action="store_true", help="try several reader and slot counts")
    bench.add_argument("--seconds-per-point", type=float, default=2.0,
                       help="with --sweep: the time each run is measured, after a warm-up of up to 1 s")
    bench.add_argument("--repeats", type=_positive, default=2, help="with --sweep: runs of each setting")
    bench.add_argument("--plot", metavar="PNG", default=None, help="with --sweep: draw throughput (needs matplotlib)")
    bench.add_argument("--compare", choices=["torch"], default=None, help="also run PyTorch's DataLoader on the files")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _interrupt_once(signum, frame) -> None:
    """SIGINT: a KeyboardInterrupt the first time, nothing after it. The command then closes
    what it opened (a loader's readers and ring, bounded waits) and exits with one line; a
    second Ctrl-C during that clean-up printed an internal traceback and could leave it
    half done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, _interrupt_once)
    try:
        return _run(arguments)
    finally:
        # Restored unless a Ctrl-C came: then it stays ignored while the process exits (the
        # loaders' finalizers run at exit too).
        if previous is not None and signal.getsignal(signal.SIGINT) is _interrupt_once:
            signal.signal(signal.SIGINT, previous)


def _run(arguments) -> int:
    try:
        return arguments.handler(arguments)
    except KeyboardInterrupt:
        print(f"shmloader {arguments.command}: interrupted", file=sys.stderr)
        return _EXIT_INTERRUPTED
    except (FileNotFoundError, FileExistsError, ValueError, TypeError, OSError) as error:
        print(f"shmloader {arguments.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
