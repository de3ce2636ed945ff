"""Import speed: shmloader.tools.formats.from_parquet against pyarrow's own read of the same file,
litdata's `optimize` and MosaicML streaming's `MDSWriter` writing the same rows, in one run.

Run: python bench/ingest.py [--rows 200000]   (litdata and mosaicml-streaming are optional)
Data: a Parquet file of `rows` rows: an int64 id, a list<int32> of tokens (mean 128), a
string caption; row groups of 16,384. Each importer runs in a child process, so that its
peak resident memory (ru_maxrss) is its own; rates are rows and Parquet bytes per second.
It compares shmloader's import with litdata's and MDSWriter's, and states each one's peak
memory.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import machine_line, table

HERE = pathlib.Path(__file__).resolve().parent


def make_parquet(path: pathlib.Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 256, size=rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = rng.integers(0, 50_000, size=int(offsets[-1]), dtype=np.int32)
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    captions = pa.array([f"caption {i}: a short sentence about sample {i}" for i in range(rows)])
    table = pa.table({"id": pa.array(np.arange(rows, dtype=np.int64)), "tokens": tokens, "caption": captions})
    pq.write_table(table, path, row_group_size=16_384)


def child(kind: str, source: str, output: str) -> dict:
    """Runs one importer in this process and reports its time and peak memory."""
    started = time.perf_counter()
    if kind == "pyarrow read":
        import pyarrow.parquet as pq

        table = pq.read_table(source)
        rows = table.num_rows
    elif kind == "shmloader from_parquet":
        from shmloader.tools.formats import from_parquet

        paths = from_parquet(source, output, progress=False)
        rows = len(np.load(paths["id"], mmap_mode="r"))
    elif kind == "MDSWriter":
        import pyarrow.parquet as pq
        from streaming import MDSWriter

        parquet, rows = pq.ParquetFile(source), 0
        columns = {"id": "int64", "tokens": "ndarray:int32", "caption": "str"}
        with MDSWriter(out=output, columns=columns, size_limit="64mb") as writer:
            for batch in parquet.iter_batches(batch_size=16_384):
                ids, captions = batch.column("id").to_numpy(), batch.column("caption").to_pylist()
                tokens = batch.column("tokens")
                offsets, values = tokens.offsets.to_numpy(), tokens.values.to_numpy()
                for i in range(len(ids)):
                    writer.write({"id": int(ids[i]), "tokens": values[offsets[i]:offsets[i + 1]],
                                  "caption": captions[i]})
                rows += len(ids)
    elif kind == "litdata optimize":
        import litdata
        import pyarrow.parquet as pq

        groups = list(range(pq.ParquetFile(source).num_row_groups))
        litdata.optimize(fn=_litdata_rows(source), inputs=groups, output_dir=output, chunk_bytes="64MB",
                         num_workers=1, mode="overwrite")
        rows = pq.ParquetFile(source).metadata.num_rows
    else:
        raise ValueError(kind)
    seconds = time.perf_counter() - started
    return {"rows": rows, "seconds": seconds, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class _litdata_rows:
    """litdata's fn: a row group index in, its rows out (a class: workers pickle it)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __call__(self, group: int):
        import pyarrow.parquet as pq

        batch = pq.ParquetFile(self.source).read_row_group(group)
        ids, captions = batch.column("id").to_numpy(), batch.column("caption").to_pylist()
        tokens = batch.column("tokens").combine_chunks()
        offsets, values = tokens.offsets.to_numpy(), tokens.values.to_numpy()
        for i in range(len(ids)):
            yield {"id": int(ids[i]), "tokens": values[offsets[i]:offsets[i + 1]], "caption": captions[i]}


def run(kind: str, source: str, output: str) -> dict | None:
    shutil.rmtree(output, ignore_errors=True)
    done = subprocess.run([sys.executable, __file__, "--child", kind, source, output], capture_output=True, text=True,
                          cwd=HERE, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        print(f"{kind}: failed or not installed ({done.stderr.strip().splitlines()[-1] if done.stderr else ''})",
              file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "SOURCE", "OUTPUT"))
    arguments = parser.parse_args()
    if arguments.child:
        print(json.dumps(child(*arguments.child)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        source = scratch / "data.parquet"
        make_parquet(source, arguments.rows)
        megabytes = os.path.getsize(source) / 1e6
        print(f"# ingest benchmark ({machine_line()})")
        print(f"{arguments.rows:,} rows (int64 id, list<int32> tokens of mean 128, string caption), Parquet "
              f"{megabytes:.1f} MB, row groups of 16,384; each importer in its own process")
        results = {}
        for kind in ("pyarrow read", "shmloader from_parquet", "MDSWriter", "litdata optimize"):
            result = run(kind, str(source), str(scratch / kind.replace(" ", "_")))
            if result is not None:
                results[kind] = result
        rows = [[kind, f"{r['rows'] / r['seconds']:,.0f}", f"{megabytes / r['seconds']:,.1f}", f"{r['seconds']:.2f}",
                 f"{r['peak_mib']:,.0f}"] for kind, r in results.items()]
        print(table(rows, ["importer", "rows/s", "Parquet MB/s", "seconds", "peak RSS MiB"]))
        ours = results.get("shmloader from_parquet")
        for peer in ("MDSWriter", "litdata optimize"):
            if ours and peer in results:
                ratio = results[peer]["seconds"] / ours["seconds"]
                print(f"shmloader from_parquet / {peer}: {ratio:.2f}x as fast")


if __name__ == "__main__":
    main()
