"""A newcomer's corpus, row for row: the Python standard library's sources as token
documents (bytes as uint16 tokens, one document per file), written with write_ragged and
as one converted .b2nd stream, read through Padded(4096, "truncate"), Packed and
Windows(2047), each row compared with numpy's slice of the documents. The round-4 report
found 1,038 of 1,790 Padded rows and 31 of 32 Windows rows wrong on this corpus.

Run: python bench/corpus_check.py [--readers 2] [--steps 400]
Prints rows checked and rows wrong per layout; exits 1 on any wrong row.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import sysconfig
import tempfile

import numpy as np

from shmloader import Packed, Padded, ShmDataLoader, Windows
from shmloader.tools.convert import convert, write_ragged


def documents() -> list[np.ndarray]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        if data:
            found.append(np.frombuffer(data, dtype=np.uint8).astype(np.uint16))
    return found


def check(loader, steps: int, expected) -> tuple[int, int]:
    rows = wrong = 0
    for _, batch in zip(range(steps), loader):
        for row, index in enumerate(batch.indices.tolist()):
            rows += 1
            wrong += not expected(batch, row, index)
    return rows, wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    arguments = parser.parse_args()
    docs = documents()
    stream = np.concatenate(docs)
    failed = False
    with tempfile.TemporaryDirectory(prefix="shmloader-corpus-") as directory:
        ragged = write_ragged(pathlib.Path(directory) / "stdlib.ragged", docs).path
        np.save(pathlib.Path(directory) / "stream.npy", stream)
        tokens = convert(pathlib.Path(directory) / "stream.npy", pathlib.Path(directory) / "stream.b2nd",
                         progress=False).path
        print(f"{len(docs):,} documents, {stream.size:,} tokens")
        length = 2047

        def padded(batch, row, index):
            kept = int(batch["x.lengths"][row])
            return kept == min(4096, len(docs[index])) and np.array_equal(batch["x"][row][:kept], docs[index][:kept])

        def packed(batch, row, index):
            offsets = batch["x.offsets"]
            return np.array_equal(batch["x"][offsets[row]:offsets[row + 1]], docs[index])

        def windows(batch, row, index):
            return np.array_equal(batch["x"][row], stream[index * length:index * length + length + 1])

        runs = [("Padded(4096, truncate)", Padded(ragged, max_length=4096, overflow="truncate"), padded),
                ("Packed", Packed(ragged), packed),
                ("Windows(2047) over .b2nd", Windows(tokens, length=length), windows)]
        for name, declaration, expected in runs:
            with ShmDataLoader({"x": declaration}, batch_size=16, readers=arguments.readers, seed=1) as loader:
                rows, wrong = check(loader, arguments.steps, expected)
            print(f"{name:26s} {rows:7,} rows checked, {wrong:,} wrong")
            failed |= wrong > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
