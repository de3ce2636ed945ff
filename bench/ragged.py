"""Variable-length token documents: shmloader's Padded and Packed layouts against PyTorch's
DataLoader, loaderx (where it installs) and a single process doing the same gather.

Run: python bench/ragged.py [--documents 200000] [--batches 4000]   (PyTorch rows need torch)
Data: documents of log-normal length (mean about 500 tokens) of Zipf-distributed int32
token ids, written once as a ragged field per codec; batch 64. Rates count real tokens
(padding excluded). It compares tokens/s with PyTorch's,
loaderx's and the single process's. Each run is a child process of its own; beside its rate, the
CPU seconds per billion tokens of all its processes (the trainer, readers or workers;
user+system) from the timed batches' start to their exit, and the trainer's own share
within them (bench/_common.py, run_contender, says how every process is counted).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from _common import add_write_argument, command_line, cpu_mark, finish_child, machine_line, per_million, record, run_contender, table
from gather import DATA_DIR, child_environment

from shmloader import Packed, Padded, Sampler, ShmDataLoader
from shmloader._native import ffi
from shmloader.storage.ragged import RaggedField, describe_ragged
from shmloader.tools.convert import write_ragged

BATCH = 64
MAX_LENGTH = 2048
VOCABULARY = 50_000


def documents(count: int, seed: int = 0):
    """Yields `count` documents; lengths log-normal with a mean of about 500 tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.9, 0.75, count), 1, 16 * MAX_LENGTH).astype(np.int64)
    for length in lengths:
        yield (rng.zipf(1.2, size=length) % VOCABULARY).astype(np.int32)


def make_corpus(count: int) -> dict[str, str]:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    paths = {}
    for codec in ("lz4", "zstd", "none"):
        path = DATA_DIR / f"docs{count}.{codec}.ragged"
        if not path.exists():
            print(f"writing {path} ...", file=sys.stderr)
            write_ragged(path, documents(count), codec=codec)
        paths[codec] = str(path)
    raw = DATA_DIR / f"docs{count}.raw"
    if not (raw / "values.npy").exists():
        raw.mkdir(exist_ok=True)
        spec = describe_ragged(paths["none"])
        import blosc2

        np.save(raw / "values.npy", blosc2.open(spec.values.path)[:])
        np.save(raw / "offsets.npy", blosc2.open(spec.offsets.path)[:])
    paths["raw"] = str(raw)
    return paths


def disk_bytes_per_token(path: str) -> float:
    spec = describe_ragged(path)
    total = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
    return total / spec.values.row_count


def run_shmloader(declaration, batches: int, readers: int = 2) -> dict:
    started = time.perf_counter()
    with ShmDataLoader({"tokens": declaration}, batch_size=BATCH, readers=readers, seed=1) as loader:
        next(loader)
        first_batch_s = time.perf_counter() - started
        cpu_start = cpu_mark()
        tokens, timed = 0, time.perf_counter()
        lengths_name = "tokens.lengths" if isinstance(declaration, Padded) else None
        for _, batch in zip(range(batches), loader):
            if lengths_name:
                tokens += int(batch[lengths_name].sum())
                int(batch["tokens"][:, 0].sum())
            else:
                offsets = batch["tokens.offsets"]
                tokens += int(offsets[-1])
                int(batch["tokens"][offsets[:-1]].sum())
        elapsed = time.perf_counter() - timed
        cpu_end = cpu_mark()
        wait = loader.stats()["wait_fraction"]
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "first_batch_s": first_batch_s, "wait_fraction": wait,
            "cpu_start": cpu_start, "cpu_end": cpu_end}


def run_single_process(path: str, batches: int) -> dict:
    """The same padded gather (this project's native code) in one process, one buffer."""
    field = RaggedField(describe_ragged(path))
    sampler = Sampler(field.spec.record_count, BATCH, "shuffle", seed=1)
    out = np.zeros((BATCH, MAX_LENGTH), dtype=np.int32)
    pointer = ffi.from_buffer("uint8_t[]", out)
    destinations = np.arange(BATCH, dtype=np.uint64) * np.uint64(MAX_LENGTH * 4)
    cpu_start = cpu_mark()
    tokens, started = 0, time.perf_counter()
    for step in range(batches):
        starts, lengths = field.starts_and_lengths(sampler.fill(step))
        counts = np.minimum(lengths, MAX_LENGTH)
        out[...] = 0
        field.values.gather_ranges(starts, counts, destinations, pointer, out.nbytes)
        tokens += int(counts.sum())
        int(out[:, 0].sum())
    elapsed = time.perf_counter() - started
    cpu_end = cpu_mark()
    field.close()
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "cpu_start": cpu_start, "cpu_end": cpu_end}


class TorchDocuments:
    """PyTorch's best shape for this: a map-style dataset over memory-mapped values and
    offsets whose __getitems__ returns a batch's documents as tensors."""

    def __init__(self, raw: str) -> None:
        self.raw, self.values, self.offsets = raw, None, np.load(os.path.join(raw, "offsets.npy"))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitems__(self, indices):
        import torch

        if self.values is None:
            self.values = np.load(os.path.join(self.raw, "values.npy"), mmap_mode="r")
        return [torch.from_numpy(np.array(self.values[self.offsets[i]:min(self.offsets[i + 1], self.offsets[i] + MAX_LENGTH)]))
                for i in indices]


def pad_batch(documents):
    import torch
    from torch.nn.utils.rnn import pad_sequence

    return pad_sequence(documents, batch_first=True), torch.tensor([len(document) for document in documents])


def run_torch(raw: str, batches: int, workers: int = 2) -> dict:
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    torch.set_num_threads(1)
    dataset = TorchDocuments(raw)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=RandomSampler(dataset, num_samples=(batches + 2) * BATCH),
                        num_workers=workers, collate_fn=pad_batch, persistent_workers=True, prefetch_factor=4,
                        multiprocessing_context="forkserver")
    iterator = iter(loader)
    next(iterator)
    cpu_start = cpu_mark()
    tokens, started = 0, time.perf_counter()
    for _ in range(batches):
        padded, lengths = next(iterator)
        tokens += int(lengths.sum())
        int(padded[:, 0].sum())
    elapsed = time.perf_counter() - started
    cpu_end = cpu_mark()
    del iterator  # Its workers end here, inside the figure (run_contender counts up to their exit).
    return {"tokens_per_s": tokens / elapsed, "tokens": tokens, "cpu_start": cpu_start, "cpu_end": cpu_end}


def run_child(arguments) -> None:
    """One run, in this child process (--child padded|packed|single|torch): its JSON line."""
    paths = make_corpus(arguments.documents)  # Made by the parent: here, found.
    if arguments.child == "padded":
        result = run_shmloader(Padded(paths[arguments.codec], max_length=MAX_LENGTH, overflow="truncate"),
                               arguments.batches)
    elif arguments.child == "packed":
        result = run_shmloader(Packed(paths[arguments.codec]), arguments.batches)
    elif arguments.child == "single":
        result = run_single_process(paths[arguments.codec], arguments.batches)
    else:
        result = run_torch(paths["raw"], arguments.batches)
    finish_child(result)


def contender(arguments, name: str, codec: str, batches: int) -> dict | None:
    """One run in a child process of its own (for its CPU, readers and workers included);
    None for PyTorch where it is not installed."""
    if name == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            return None
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--codec", codec, "--documents",
               str(arguments.documents), "--batches", str(batches)]
    return run_contender(command, 600, f"ragged.py --child {name} --codec {codec}", env=child_environment())


def run_loaderx() -> str:
    try:
        import loaderx  # noqa: F401
    except ImportError:
        return "not importable here (loaderx 2.8 needs numpy>=2.5): comparison skipped"
    return "installed, but its ragged store's API is not wired into this benchmark: comparison skipped"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--batches", type=int, default=4000)
    parser.add_argument("--child", choices=("padded", "packed", "single", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--codec", default="lz4", help=argparse.SUPPRESS)
    add_write_argument(parser)
    arguments = parser.parse_args()
    if arguments.child:
        run_child(arguments)
    paths = make_corpus(arguments.documents)
    spec = describe_ragged(paths["lz4"])
    print(f"# ragged benchmark ({machine_line()})")
    print(f"{spec.record_count:,} documents, {spec.values.row_count:,} int32 tokens "
          f"(mean {spec.values.row_count / spec.record_count:.0f}), batch {BATCH}, max_length {MAX_LENGTH}, "
          f"{arguments.batches} batches per run")
    print("bytes per token on disk: " + ", ".join(f"{codec} {disk_bytes_per_token(paths[codec]):.2f}"
                                                   for codec in ("lz4", "zstd", "none")))
    rows, rates, runs = [], {}, {}

    def row(what: str, codec: str, result: dict, notes: str) -> list:
        # CPU per billion tokens (a million thousands): per million, every figure starts 0.0.
        thousands = result["tokens"] / 1e3
        return [what, codec, f"{result['tokens_per_s'] / 1e6:.1f}", per_million(result["cpu_s"], thousands),
                per_million(result["trainer_cpu_s"], thousands), notes]

    for codec in ("lz4", "none"):
        for name in ("padded", "packed"):
            result = contender(arguments, name, codec, arguments.batches)
            rates[f"{name}-{codec}"] = result["tokens_per_s"]
            runs[f"{name}-{codec}"] = result
            rows.append(row(f"shmloader {name}, 2 readers", codec, result,
                            f"first batch {result['first_batch_s']:.2f} s, "
                            f"trainer waited {result['wait_fraction']:.0%}"))
    single = contender(arguments, "single", "lz4", arguments.batches)
    rows.append(row("single process, same padded gather", "lz4", single, ""))
    torch_result = contender(arguments, "torch", "raw", max(50, arguments.batches // 4))
    if torch_result:
        rows.append(row("PyTorch DataLoader, 2 workers, pad_sequence", "raw .npy", torch_result,
                        "__getitems__ over memory-mapped values"))
    header = ["loader", "codec", "M tokens/s", "CPU s / G tokens", "trainer CPU s / G tokens", "notes"]
    print(table(rows, header))
    print("\n## summary")
    ours = rates["padded-lz4"]
    if torch_result:
        ratio = ours / torch_result["tokens_per_s"]
        print(f"padded (lz4) / PyTorch DataLoader = {ratio:.1f}x")
    else:
        print("PyTorch not installed: comparison skipped")
    print(f"loaderx: {run_loaderx()}")
    ratio = ours / single["tokens_per_s"]
    print(f"padded (lz4) / single process = {ratio:.2f}x")
    cpu = [per_million(result["cpu_s"], result["tokens"] / 1e3) if result else "-"  # Per billion tokens.
           for result in (runs["padded-lz4"], torch_result)]
    headline = [["token documents, `Padded` (LZ4)", f"{ours / 1e6:.0f} M tokens/s", f"{ratio:.2f}x",
                 f"{ours / torch_result['tokens_per_s']:.1f}x" if torch_result else "n/a",
                 f"{cpu[0]} / {cpu[1]} per G tokens"]]
    record("ragged", command_line("ragged.py"), header, rows, headline,
           [f"{spec.record_count:,} documents, batch {BATCH}, max_length {MAX_LENGTH}, "
            f"{arguments.batches} batches a run",
            "CPU s / G tokens: all the run's processes (trainer, readers or workers) from the timed batches' start to "
            "their exit; trainer: its own process within the timed batches"], write=arguments.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
