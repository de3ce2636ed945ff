"""Tokenize a text corpus into a ragged token field, then train-ready windows over it.

Run: python examples/tokenize_corpus.py [TEXT_OR_JSONL ...] [--out corpus.tokens]
     (needs `pip install 'shmloader[tokenizers]'`; without files it tokenizes the Python
     standard library's own sources, offline)

A byte-level BPE tokenizer (Hugging Face `tokenizers`) is trained on the corpus itself, so
nothing is downloaded. Documents are read lazily (a .jsonl line's "text", or one file per
document), tokenized in batches with the library's own threads (`encode_batch` runs in
Rust, in parallel), and streamed into a ragged int32 field: memory holds one batch of
documents and the offsets. It prints the conversion's tokens/s, then reads the field as
`Windows(..., separator=EOS)` rows with their document segments.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sysconfig
import time

import numpy as np

from shmloader import ShmDataLoader, Windows
from shmloader.convert import write_ragged

BATCH_DOCUMENTS = 256


def documents(paths: list[pathlib.Path]):
    """Each document's text: a line's "text" for .jsonl, else the whole file."""
    for path in paths:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as lines:
                for line in lines:
                    if line.strip():
                        yield json.loads(line)["text"]
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(paths: list[pathlib.Path], vocabulary: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocabulary, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents(paths), trainer=trainer)
    return tokenizer


def tokenize(paths: list[pathlib.Path], out: pathlib.Path, vocabulary: int = 8192) -> tuple[int, float, int]:
    """Writes `out` (a ragged int32 field, a document per record); returns (tokens,
    seconds spent encoding and writing, the <eos> id)."""
    tokenizer = train_tokenizer(paths, vocabulary)
    counted = [0]

    def records():
        texts = documents(paths)
        while batch := list(itertools.islice(texts, BATCH_DOCUMENTS)):
            for encoding in tokenizer.encode_batch(batch):  # In parallel, in Rust.
                ids = np.asarray(encoding.ids, dtype=np.int32)
                counted[0] += ids.size
                yield ids

    started = time.perf_counter()
    write_ragged(out, records(), codec="lz4", force=True)
    return counted[0], time.perf_counter() - started, tokenizer.token_to_id("<eos>")


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("corpus.tokens"))
    parser.add_argument("--limit", type=int, default=400, help="documents of the built-in corpus")
    arguments = parser.parse_args(argv)
    paths = arguments.files or sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:arguments.limit]
    tokens, seconds, eos = tokenize(paths, arguments.out)
    print(f"{len(paths)} files, {tokens:,} tokens in {seconds:.2f} s: {tokens / seconds:,.0f} tokens/s")
    with ShmDataLoader({"tokens": Windows(str(arguments.out), length=256, separator=eos)}, batch_size=8,
                       readers=1) as loader:
        batch = next(loader)
        print(f"a batch: tokens {batch['tokens'].shape}, documents in its first row: "
              f"{int(batch['tokens.segments'][0].max()) + 1}")
    return tokens / seconds


if __name__ == "__main__":
    main()
