"""Fields in object storage, cold, through a capped link: rows/s of shmloader (a shuffle
window, the global shuffle over .b2nd, sequential; raw, LZ4 and ZSTD fields), litdata
and MosaicML streaming, from one S3-compatible server, against the link's own rate (four
ranged downloads at once, with obstore and with s3fs) measured in the same run.

The server is npm's s3rver (filesystem-backed; moto, in Python, serves far less than the
link) on 127.0.0.1 inside a network namespace this script makes, whose loopback is capped
with `tc qdisc ... tbf` (this kernel has tbf but no netem: the cap is a rate, with no
added latency). Every client runs inside the namespace; nothing leaves loopback. Every
delivered row is checked: its first 8 bytes are its index. Each run starts cold (a new
cache directory, for the peers too) and lasts one pass, or --seconds where it is slower,
or with --batches N up to its Nth batch (the link's runs then download the bytes of N
batches' rows, so that each ratio compares the same bytes: a window's start-up and first
blocks weigh more in a short run); rows/s count from the loader's construction (its
start-up and first window included).
Beside each rate: the CPU seconds per million rows of all the run's processes (the trainer,
shmloader's fork server and readers, a peer's workers; user+system), from the same start to
their exit, and the trainer's own share up to its last row (bench/_common.py,
run_contender, says how every process is counted; the server's CPU is not in it).

Needs root (ip netns, tc), node with s3rver, and for the peers a Python with litdata,
mosaicml-streaming and s3fs (--peer-python; their rows are left out without it):

    cd /tmp/objstore && npm install s3rver@3
    python3 -m venv /tmp/objstore/venv && /tmp/objstore/venv/bin/pip install torch==2.14.1 torchvision==0.29.1 litdata mosaicml-streaming s3fs obstore
    python bench/object_store.py --s3rver /tmp/objstore/node_modules/.bin/s3rver --peer-python /tmp/objstore/venv/bin/python
    python bench/object_store.py ... --rate 1gbit --rows 524288 --seconds 30 --skip litdata

--server files serves the data files themselves with bench/_range_server.py (HEAD and
ranged GET, sendfile; no node, no upload), in the capped namespace, or with --rate none on
this network's 127.0.0.1 uncapped: no root needed, and the runs are bound by the client's
CPU, which is what --rounds N (the link and the raw window alternated N times) measures:

    python bench/object_store.py --server files --rate none --rows 524288 --rounds 3 --skip lz4,zstd,global,sequential

--small-cache runs one case alone: the global shuffle of raw rows through a cache of
--cache-mib (8 MiB) over data several times larger (--rows 17408 of 3072 B: 53 MB), against
the store's own rate of random ranged GETs of one cache page each at the loader's
concurrency (its readers' fetch threads), measured in the same run: the loader's rows/s
over the store's GETs/s is the share of the store's request rate it reaches (a row is a
request where the cache cannot hold the data). --server moto
runs it against moto in this process's network, without a namespace or a cap, to check
that the case works (moto serves a few dozen ranged GETs a second):

    python bench/object_store.py --small-cache --rows 17408 --cache-mib 8
    python bench/object_store.py --small-cache --rows 2048 --cache-mib 2 --server moto --seconds 10
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    add_write_argument,
    command_line,
    cpu_mark,
    finish_child,
    image_rows,
    machine_line,
    per_million,
    record,
    run_contender,
    table,
)

BUCKET = "bench"
PORT = 4599
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_REGION": "us-east-1"}
ENDPOINT = f"http://127.0.0.1:{PORT}"
PIECE = 8 << 20  # The link measurement's request size.


# The data, written once under --data.

def write_data(args, codecs=("lz4", "zstd")) -> None:
    os.makedirs(args.data, exist_ok=True)
    raw = os.path.join(args.data, "x.npy")
    if not (os.path.exists(raw) and np.load(raw, mmap_mode="r").shape == (args.rows, args.row_bytes)):
        print(f"writing {args.rows:,} rows of {args.row_bytes} B ...", flush=True)
        out = np.lib.format.open_memmap(raw + ".tmp", mode="w+", dtype=np.uint8, shape=(args.rows, args.row_bytes))
        for start in range(0, args.rows, 65536):
            stop = min(start + 65536, args.rows)
            piece = image_rows(stop - start, args.row_bytes, seed=start)
            piece[:, :8] = np.arange(start, stop, dtype=np.uint64)[:, None].view(np.uint8)
            out[start:stop] = piece
        out.flush()
        del out
        os.replace(raw + ".tmp", raw)
    from shmloader.tools.convert import convert

    for codec in codecs:
        path = os.path.join(args.data, f"x-{codec}.b2nd")
        if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(raw):
            print(f"converting to {codec} ...", flush=True)
            convert(raw, path, codec=codec, force=True, progress=False)


# Children: one measurement each, inside the namespace; a JSON line out.

def _check(indices: np.ndarray, rows: np.ndarray) -> int:
    found = np.ascontiguousarray(rows[:, :8]).view(np.uint64).ravel()
    return int(np.count_nonzero(found != indices.astype(np.uint64)))


def child_link(args) -> dict:
    """Four ranged downloads at once, PIECE bytes each, through obstore (or s3fs)."""
    size = os.path.getsize(os.path.join(args.data, "x.npy"))
    if args.batches:  # The bytes of the loaders' rows over as many batches.
        size = min(size, args.batches * args.batch_size * args.row_bytes)
    pieces = iter(range(0, size, PIECE))
    lock, total = threading.Lock(), [0]
    deadline = time.perf_counter() + args.seconds
    if args.mode == "link-s3fs":
        import s3fs

        fs = s3fs.S3FileSystem(key=CREDENTIALS["AWS_ACCESS_KEY_ID"], secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                               client_kwargs={"endpoint_url": ENDPOINT, "region_name": "us-east-1"})

        def get(start):
            return len(fs.cat_file(f"{BUCKET}/x.npy", start=start, end=min(start + PIECE, size)))
    else:
        import obstore
        from obstore.store import S3Store

        store = S3Store(BUCKET, endpoint=ENDPOINT, access_key_id="S3RVER", secret_access_key="S3RVER",
                        region="us-east-1", client_options={"allow_http": True})

        def get(start):
            return len(memoryview(obstore.get_range(store, "x.npy", start=start, end=min(start + PIECE, size))))

    def worker():
        while time.perf_counter() < deadline:
            with lock:
                start = next(pieces, None)
            if start is None:
                return
            got = get(start)
            with lock:
                total[0] += got

    cpu_start = cpu_mark()
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(worker) for _ in range(4)]:
            future.result()
    seconds = time.perf_counter() - started
    return {"rows": total[0] / args.row_bytes, "seconds": seconds, "wrong": 0, "bytes": total[0],
            "cpu_start": cpu_start, "cpu_end": cpu_mark()}


def child_random_get(args) -> dict:
    """Random ranged GETs of one cache page each, --concurrency at once, for --seconds:
    the store's request rate at the loader's concurrency."""
    import obstore
    from obstore.store import S3Store

    from shmloader.remote.pages import CACHE_PAGE_BYTES

    store = S3Store(BUCKET, endpoint=ENDPOINT, access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                    secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
                    client_options={"allow_http": True})
    pages = os.path.getsize(os.path.join(args.data, "x.npy")) // CACHE_PAGE_BYTES
    lock, counts = threading.Lock(), [0, 0]  # requests, bytes
    deadline = time.perf_counter() + args.seconds

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while time.perf_counter() < deadline:
            start = int(rng.integers(0, pages)) * CACHE_PAGE_BYTES
            got = len(memoryview(obstore.get_range(store, "x.npy", start=start, end=start + CACHE_PAGE_BYTES)))
            with lock:
                counts[0] += 1
                counts[1] += got

    cpu_start = cpu_mark()
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for future in [pool.submit(worker, seed) for seed in range(args.concurrency)]:
            future.result()
    return {"requests": counts[0], "bytes": counts[1], "seconds": time.perf_counter() - started,
            "cpu_start": cpu_start, "cpu_end": cpu_mark()}


def child_shmloader(args) -> dict:
    from shmloader import ShmDataLoader

    name = {"raw": "x.npy", "lz4": "x-lz4.b2nd", "zstd": "x-zstd.b2nd"}[args.codec]
    cache = os.path.join(args.data, "cache", f"{args.mode}-{args.codec}")
    shutil.rmtree(cache, ignore_errors=True)  # Cold.
    options = {"window": {"shuffle_window": args.window}, "global": {}, "sequential": {"mode": "sequential"}}[args.mode]
    cpu_start = cpu_mark()
    started = time.perf_counter()
    with ShmDataLoader({"x": f"s3://{BUCKET}/{name}"}, batch_size=args.batch_size, readers=args.readers, epochs=1,
                       cache_dir=cache, cache_bytes=(args.cache_mib << 20) or (args.cache_gib << 30),
                       **options) as loader:
        rows = wrong = batches = 0
        first_batch_s = None
        for batch in loader:
            wrong += _check(np.asarray(batch.indices), np.asarray(batch["x"]))
            rows += len(batch.indices)
            batches += 1
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - started
            if batches == args.batches or time.perf_counter() - started > args.seconds:
                break
        seconds = time.perf_counter() - started
        cpu_end = cpu_mark()
        cache_stats = loader.stats()["cache"]
    return {"rows": rows, "seconds": seconds, "first_batch_s": first_batch_s, "wrong": wrong,
            "requests": cache_stats["requests"],
            "bytes": cache_stats["bytes"], "retries": cache_stats["retries"], "cpu_start": cpu_start,
            "cpu_end": cpu_end}


def child_litdata(args) -> dict:
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    # litdata's obstore client passes client options of its own, which drop AWS_ALLOW_HTTP:
    # without this a plain-http endpoint fails ("BadScheme"). Its defaults otherwise.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    if os.environ.get("BENCH_LITDATA_SDK"):  # Its boto3 client instead of obstore.
        downloader._OBSTORE_AVAILABLE = False

    cache = os.path.join(args.data, "cache", "litdata")
    shutil.rmtree(cache, ignore_errors=True)
    cpu_start = cpu_mark()
    started = time.perf_counter()
    dataset = StreamingDataset(f"s3://{BUCKET}/litdata", shuffle=True, seed=1, cache_dir=cache,
                               storage_options={"endpoint_url": ENDPOINT, "aws_access_key_id": "S3RVER",
                                                "aws_secret_access_key": "S3RVER", "region_name": "us-east-1"})
    loader = StreamingDataLoader(dataset, batch_size=args.batch_size, num_workers=args.readers)
    result = _consume(loader, started, args, lambda batch: (batch["index"].numpy(), batch["row"].numpy()))
    return {**result, "cpu_start": cpu_start}


def _consume(loader, started: float, args, rows_of) -> dict:
    """Iterates a peer's loader until its end, --seconds or --batches, checking every row."""
    rows = wrong = batches = 0
    for batch in loader:
        indices, data = rows_of(batch)
        wrong += _check(indices, data)
        rows += len(indices)
        batches += 1
        if batches == args.batches or time.perf_counter() - started > args.seconds:
            break
    return {"rows": rows, "seconds": time.perf_counter() - started, "wrong": wrong, "cpu_end": cpu_mark()}


def child_mosaic(args) -> dict:
    import torch
    from streaming import StreamingDataset

    local = os.path.join(args.data, "cache", "mosaic")
    shutil.rmtree(local, ignore_errors=True)
    cpu_start = cpu_mark()
    started = time.perf_counter()
    dataset = StreamingDataset(remote=f"s3://{BUCKET}/mds", local=local, shuffle=True, shuffle_seed=1,
                               batch_size=args.batch_size)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=args.readers)
    result = _consume(loader, started, args, lambda batch: (
        batch["index"].numpy(), np.stack([np.frombuffer(row, dtype=np.uint8) for row in batch["row"]])))
    return {**result, "cpu_start": cpu_start}


def child_make_peers(args) -> dict:
    """litdata chunks and MDS shards of x.npy (64 MB each), written once."""
    raw = np.load(os.path.join(args.data, "x.npy"), mmap_mode="r")
    mds = os.path.join(args.data, "mds")
    if not os.path.exists(os.path.join(mds, "index.json")):
        from streaming import MDSWriter

        with MDSWriter(out=mds, columns={"index": "int64", "row": "bytes"}, size_limit="64mb") as writer:
            for index in range(raw.shape[0]):
                writer.write({"index": index, "row": raw[index].tobytes()})
    lit = os.path.join(args.data, "litdata")
    if not os.path.exists(os.path.join(lit, "index.json")):
        import litdata

        litdata.optimize(fn=_LitdataRows(os.path.join(args.data, "x.npy")), inputs=list(range(0, raw.shape[0], 65536)),
                         output_dir=lit, chunk_bytes="64MB", num_workers=1, mode="overwrite")
    return {}


class _LitdataRows:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, first: int):
        array = np.load(self.path, mmap_mode="r")
        for index in range(first, min(first + 65536, array.shape[0])):
            yield {"index": index, "row": np.array(array[index])}


def child_upload(args) -> dict:
    """Every object the runs read, put once (before the cap): the fields and the peers' files."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=ENDPOINT, access_key_id="S3RVER", secret_access_key="S3RVER",
                    region="us-east-1", client_options={"allow_http": True, "timeout": "600s"})
    files = [name for name in ("x.npy", "x-lz4.b2nd", "x-zstd.b2nd") if os.path.exists(os.path.join(args.data, name))]
    for directory in ("litdata", "mds"):
        if os.path.isdir(os.path.join(args.data, directory)):
            files += [f"{directory}/{name}" for name in sorted(os.listdir(os.path.join(args.data, directory)))]
    for name in files:
        path = os.path.join(args.data, name)
        try:
            if obstore.head(store, name)["size"] == os.path.getsize(path):
                continue
        except FileNotFoundError:
            pass
        obstore.put(store, name, path)
    return {"objects": len(files)}


CHILDREN = {"random-get": child_random_get, "link": child_link, "link-s3fs": child_link, "window": child_shmloader,
            "global": child_shmloader,
            "sequential": child_shmloader, "litdata": child_litdata, "mosaic": child_mosaic,
            "make-peers": child_make_peers, "upload": child_upload}


# The namespace, the server and the runs.

def server_command(args) -> list[str]:
    """The store's command line: s3rver over its own directory, or (--server files) this
    directory's own range server over the data files (nothing to upload)."""
    if args.server == "files":
        return [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_range_server.py"),
                args.data, "--bucket", BUCKET, "--port", str(PORT)]
    directory = os.path.join(args.data, "s3rver")
    os.makedirs(directory, exist_ok=True)
    return [args.s3rver, "-d", directory, "-a", "127.0.0.1", "-p", str(PORT), "--silent", "--configure-bucket", BUCKET]


class Namespace:
    """A network namespace whose loopback is capped at `rate` (tc's units), with the store in it."""

    def __init__(self, rate: str) -> None:
        self.name, self.rate = f"shmloader-bench-{os.getpid()}", rate
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self.run(["ip", "link", "set", "lo", "up"])
        self.server = None

    @property
    def prefix(self) -> list[str]:
        """What runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def run(self, command, **kwargs):
        return subprocess.run([*self.prefix, *command], check=True, **kwargs)

    def cap(self) -> None:
        # A burst of at least the loopback MTU (64 KiB): tbf drops any packet larger than it.
        self.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", self.rate, "burst", "1mb",
                  "latency", "50ms"])

    def start_server(self, command: list[str]) -> None:
        self.server = subprocess.Popen([*self.prefix, *command], start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            probe = subprocess.run([*self.prefix, sys.executable, "-c",
                                    f"import socket; socket.create_connection(('127.0.0.1', {PORT}), 1)"],
                                   capture_output=True)
            if probe.returncode == 0:
                return
            time.sleep(0.3)
        raise RuntimeError(f"the store did not start: {' '.join(command)}")

    def close(self) -> None:
        if self.server is not None:
            os.killpg(self.server.pid, signal.SIGTERM)
            self.server.wait(timeout=10)
        subprocess.run(["ip", "netns", "del", self.name], check=False)


class Loopback(Namespace):
    """The store on this network's 127.0.0.1, uncapped (--rate none): no namespace, no root.
    Rates then say little; CPU per row is what such a run is for."""

    prefix: list[str] = []

    def __init__(self, rate: str) -> None:
        self.server = None

    def cap(self) -> None:
        pass

    def close(self) -> None:
        if self.server is not None:
            os.killpg(self.server.pid, signal.SIGTERM)
            self.server.wait(timeout=10)


class MotoServer:
    """moto's S3 server on 127.0.0.1:PORT, in this network (no namespace, no cap): --server
    moto, to check the --small-cache case where s3rver or root is not at hand."""

    prefix: list[str] = []

    def __init__(self, rate: str) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=PORT, verbose=False)

    def cap(self) -> None:
        pass  # moto serves far less than any cap.

    def start_server(self, command: list[str]) -> None:
        import boto3

        self.server.start()
        boto3.client("s3", endpoint_url=ENDPOINT, region_name="us-east-1",
                     aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=BUCKET)

    def close(self) -> None:
        self.server.stop()


def make_store(args):
    """Where the store runs: moto in this process, else a capped namespace, or (--rate none)
    this network's loopback."""
    if args.server == "moto":
        return MotoServer(args.rate)
    return Loopback(args.rate) if args.rate == "none" else Namespace(args.rate)


def measure(namespace: Namespace, python: str, args, mode: str, pythonpath: str | None = None, **extra) -> dict:
    command = [python, os.path.abspath(__file__), "--child", mode, "--data", args.data, "--rows", str(args.rows),
               "--row-bytes", str(args.row_bytes), "--seconds", str(args.seconds), "--batch-size",
               str(args.batch_size), "--readers", str(args.readers), "--window", str(args.window),
               "--cache-gib", str(args.cache_gib), "--cache-mib", str(args.cache_mib),
               "--concurrency", str(args.concurrency), "--batches", str(args.batches)]
    for key, value in extra.items():
        if f"--{key}" in command:
            del command[command.index(f"--{key}"):command.index(f"--{key}") + 2]
        command += [f"--{key}", str(value)]
    environment = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": ENDPOINT, "S3_ENDPOINT_URL": ENDPOINT,
                   "AWS_ALLOW_HTTP": "true"}
    if pythonpath:  # Another checkout's shmloader (--baseline), this script's children all the same.
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, environment.get("PYTHONPATH")]))
    # `ip netns exec` execs the command in its own process (no fork): the child is the run.
    try:
        return run_contender([*namespace.prefix, *command], args.seconds * 4 + 300, f"{mode} failed",
                             env=environment, cwd=args.data)
    finally:
        # The run's cache removed here, once its processes are gone: emptying a node cache is no
        # loader's work (it cost the trainer 0.1-0.2 CPU s a run on 1.6 GB), so it is in no CPU figure.
        shutil.rmtree(os.path.join(args.data, "cache"), ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--codec", default="raw", help=argparse.SUPPRESS)
    parser.add_argument("--data", default="/tmp/shmloader-object-store")
    parser.add_argument("--rows", type=int, default=524_288)
    parser.add_argument("--row-bytes", type=int, default=3072)
    parser.add_argument("--rate", default="1gbit",
                        help="the cap on the link (tc's units); none: the store on this network's 127.0.0.1, uncapped")
    parser.add_argument("--seconds", type=float, default=60.0, help="each run's length at most (else one pass)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=0,
                        help="each run up to its Nth batch (the link's: the same bytes), counted from its start; "
                             "0: one pass or --seconds")
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--window", type=int, default=262_144)
    parser.add_argument("--cache-gib", type=int, default=8)
    parser.add_argument("--cache-mib", type=int, default=0, help="the cache's budget in MiB (in place of --cache-gib)")
    parser.add_argument("--small-cache", action="store_true",
                        help="only the case of a cache smaller than the data (see above; --cache-mib 8 by default)")
    parser.add_argument("--server", choices=("s3rver", "moto", "files"), default="s3rver",
                        help="files: bench/_range_server.py over --data (sendfile; no node needed)")
    parser.add_argument("--concurrency", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--s3rver", default="/tmp/objstore/node_modules/.bin/s3rver")
    parser.add_argument("--peer-python", default=None, help="a Python with litdata, mosaicml-streaming and s3fs")
    parser.add_argument("--skip", default="",
                        help="runs left out: any of litdata,mosaic,s3fs,global,sequential,lz4,zstd (the window's "
                             "compressed fields)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the link and the window raw run this many times, alternated (CPU per row)")
    parser.add_argument("--baseline", default=None,
                        help="a checkout of another version of shmloader: its raw window runs in every round too")
    add_write_argument(parser)
    args = parser.parse_args()
    args.data = os.path.abspath(args.data)
    if args.child:
        # The uploads and the peers' files have no timed window: their marks span the call.
        cpu_start = cpu_mark()
        result = CHILDREN[args.child](argparse.Namespace(**{**vars(args), "mode": args.child}))
        finish_child({"cpu_start": cpu_start, "cpu_end": cpu_mark(), **result})
    if args.small_cache:
        small_cache(args)
        return
    skip = set(filter(None, args.skip.split(",")))
    peers = args.peer_python if args.peer_python and os.path.exists(args.peer_python) else None
    write_data(args, codecs=tuple(codec for codec in ("lz4", "zstd")
                                   if codec not in skip or (codec == "lz4" and "global" not in skip)))
    if peers and not {"litdata", "mosaic"} <= skip:
        print("writing litdata chunks and MDS shards ...", flush=True)
        subprocess.run([peers, os.path.abspath(__file__), "--child", "make-peers", "--data", args.data], check=True,
                       cwd=args.data)
    namespace = make_store(args)
    try:
        namespace.start_server(server_command(args))
        measure(namespace, sys.executable, args, "upload")
        namespace.cap()
        results = []

        def run(label, python, mode, pythonpath=None, **extra):
            try:
                result = measure(namespace, python, args, mode, pythonpath, **extra)
            except RuntimeError as error:  # A peer that fails is a row that says so.
                print(f"{label}: {error}", flush=True)
                reason = str(error).strip().splitlines()[-1][:80]
                results.append((label, {"rows_per_s": 0.0, "wrong": "-", "failed": reason}))
                return False
            result["rows_per_s"] = result["rows"] / result["seconds"]
            print(f"{label}: {result['rows_per_s']:,.0f} rows/s {json.dumps(result)}", flush=True)
            results.append((label, result))
            return True

        # The link and the raw window alternate over --rounds (the first link is the table's reference).
        for round_index in range(args.rounds):
            suffix = f", round {round_index + 1}" if args.rounds > 1 else ""
            run(f"link: 4 ranged GETs (obstore){suffix}", sys.executable, "link")
            if round_index == 0 and peers and "s3fs" not in skip:
                run("link: 4 ranged GETs (s3fs)", peers, "link-s3fs")
            run(f"shmloader shuffle_window={args.window:,}, raw{suffix}", sys.executable, "window", codec="raw")
            if args.baseline:
                run(f"baseline shmloader shuffle_window={args.window:,}, raw{suffix}", sys.executable, "window",
                    pythonpath=args.baseline, codec="raw")
        for codec in [codec for codec in ("lz4", "zstd") if codec not in skip]:
            run(f"shmloader shuffle_window={args.window:,}, {codec}", sys.executable, "window", codec=codec)
        if "global" not in skip:
            run("shmloader global shuffle, lz4 .b2nd", sys.executable, "global", codec="lz4")
            # Rows at random from data larger than the cache: each row's block by range.
            small = max(1, (args.rows * args.row_bytes >> 30) // 2)
            run(f"shmloader global shuffle, lz4 .b2nd, cache {small} GiB < data", sys.executable, "global",
                codec="lz4", **{"cache-gib": small})
        if "sequential" not in skip:
            run("shmloader sequential, raw", sys.executable, "sequential", codec="raw")
        if peers and "mosaic" not in skip:
            label = "MosaicML streaming, MDS 64 MB shards, shuffle"
            if not run(f"{label}, {args.readers} workers", peers, "mosaic") and args.readers > 1:
                run(f"{label}, 1 worker", peers, "mosaic", readers=1)
        if peers and "litdata" not in skip:
            run("litdata, 64 MB chunks, shuffle", peers, "litdata")
    finally:
        namespace.close()
    link = results[0][1]["rows_per_s"]
    name = {"files": "bench/_range_server.py", "s3rver": "s3rver", "moto": "moto"}[args.server]
    server = (f"{name} on 127.0.0.1, no cap" if args.server == "moto" or args.rate == "none" else
              f"link capped at {args.rate} (tbf), {name} on 127.0.0.1 in a namespace")
    setting = (f"{server}; {args.rows:,} rows of "
               f"{args.row_bytes} B, batch {args.batch_size}, {args.readers} readers, cold, "
               f"at most {args.seconds:g} s each" + (f", up to batch {args.batches:,}" if args.batches else ""))
    print(f"\n{machine_line()}; {setting}\n")
    header = ["run", "rows/s", "x link (raw rows)", "first batch s", "CPU s / M rows", "trainer CPU s / M rows",
              "wrong rows"]
    rows = [[label, f"{result['rows_per_s']:,.0f}" if "failed" not in result else f"failed: {result['failed']}",
             f"{result['rows_per_s'] / link:.2f}",
             "-" if result.get("first_batch_s") is None else f"{result['first_batch_s']:.2f}",
             per_million(result.get("cpu_s", 0.0), result.get("rows", 0)),
             per_million(result.get("trainer_cpu_s", 0.0), result.get("rows", 0)), result["wrong"]]
            for label, result in results]
    print(table(rows, header))
    if args.rounds > 1:
        print(cpu_per_row_summary(results))
    record("object_store", command_line("object_store.py"), header, rows, write=args.write,
           notes=[setting, "CPU: all the run's processes from its start (the loader's construction) to their exit; "
                           "trainer: its own process up to its last row; the server's CPU is in neither"])


def cpu_per_row_summary(results: list[tuple[str, dict]]) -> str:
    """The medians over --rounds of CPU s per million rows of the link and of each raw
    window run (this version's, and --baseline's), with each window's over the link's."""
    kinds: dict[str, list[float]] = {}
    for label, result in results:
        if "round" not in label or not result.get("rows"):
            continue
        kind = label.rsplit(", round", 1)[0]
        kinds.setdefault(kind, []).append(result["cpu_s"] / result["rows"] * 1e6)
    link = next((statistics.median(values) for kind, values in kinds.items() if kind.startswith("link")), None)
    lines = []
    for kind, values in kinds.items():
        median = statistics.median(values)
        versus = "" if link is None or kind.startswith("link") else f", {median / link:.2f}x the link's"
        lines.append(f"{kind}: CPU s / M rows median {median:.2f} (min {min(values):.2f}, max {max(values):.2f}, "
                     f"{len(values)} rounds){versus}")
    return "\n".join(lines)


def small_cache(args) -> None:
    """The --small-cache case: the loader's rows/s and the store's random GETs/s at the
    same concurrency (the readers' fetch threads for the pages the fills wait for)."""
    from shmloader.remote.pages import IN_FLIGHT

    args.cache_mib = args.cache_mib or 8
    args.concurrency = args.readers * IN_FLIGHT
    write_data(args, codecs=())
    namespace = make_store(args)
    try:
        namespace.start_server(server_command(args))
        measure(namespace, sys.executable, args, "upload")
        namespace.cap()
        store = measure(namespace, sys.executable, args, "random-get")
        loader = measure(namespace, sys.executable, args, "global", codec="raw")
    finally:
        namespace.close()
    gets_per_s, rows_per_s = store["requests"] / store["seconds"], loader["rows"] / loader["seconds"]
    data_mb = args.rows * args.row_bytes / 1e6
    print(f"\n{machine_line()}; {args.server} on 127.0.0.1; {args.rows:,} rows of {args.row_bytes} B "
          f"({data_mb:.0f} MB), cache_bytes {args.cache_mib} MiB, global shuffle, batch {args.batch_size}, "
          f"{args.readers} readers, cold, at most {args.seconds:g} s each\n")
    # CPU per million of the rate's own unit (GETs for the store's row, rows for the loader's).
    print(table([[f"store: random GETs of one page, {args.concurrency} at once", f"{gets_per_s:,.1f} GETs/s", "",
                  per_million(store["cpu_s"], store["requests"]),
                  per_million(store["trainer_cpu_s"], store["requests"]), "-"],
                 [f"shmloader, cache {args.cache_mib} MiB < data", f"{rows_per_s:,.1f} rows/s",
                  f"{rows_per_s / gets_per_s:.2f}", per_million(loader["cpu_s"], loader["rows"]),
                  per_million(loader["trainer_cpu_s"], loader["rows"]), loader["wrong"]]],
                ["run", "rate", "rows/s / GETs/s", "CPU s / M", "trainer CPU s / M", "wrong rows"]))
    print(f"loader: {loader['requests']:,} requests for {loader['rows']:,} rows "
          f"({loader['requests'] / max(1, loader['rows']):.2f} a row), {loader['bytes'] / 1e6:.1f} MB fetched")


if __name__ == "__main__":
    main()
