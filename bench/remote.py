"""Remote readers on Ray: how fast the bridge moves batches into the ring, what
it costs per batch against a local reader, and a JPEG pipeline with and without actors.

1. The bridge's ceiling: fixed rows cached in memory, readers=0 and actors only, whose fill
   is a gather: 3 KB rows and 224x224x3 images, batch 256. GB/s and batches/s the trainer
   receives, in steady state (timed after the first ring of batches).
2. Per-batch overhead: the JPEG pipeline (decode + random resized crop 224 + flip, batch
   256, fast decoder) with one local reader against one actor and no local reader.
3. The JPEG pipeline with `--readers` local readers against the same plus `--actors`
   actors. On one machine the actors share its cores with the readers: this shows the
   bridge's overhead, not scaling, and the run says so.
4. An estimate of how many actors one trainer node can absorb: the bridge's ceiling in
   batches/s (image batches) over one actor's JPEG batches/s.

Run: python bench/remote.py [--images 3000] [--batches 20] [--actors 2] [--readers 2]
Needs the ray and images extras. Ray runs locally, bound to 127.0.0.1
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0). It reports the bridge's cost per
batch against a local reader on the JPEG pipeline, and its rate into the ring.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
from _common import image_rows, machine_line, table  # noqa: E402
from gather import DATA_DIR  # noqa: E402
from images import BATCH, SIZE, make_images  # noqa: E402


def rate(loader, batches: int) -> tuple[float, float]:
    """(batches/s, bytes/s) the trainer receives in steady state: after a ring's worth of
    batches (the first ring is filled while the actors start), over at least two rings."""
    for _ in range(loader.slots):
        next(loader).release()
    batches = max(batches, 2 * loader.slots)
    started = time.perf_counter()
    for _ in range(batches):
        next(loader).release()
    elapsed = time.perf_counter() - started
    return batches / elapsed, batches * loader.plan.slot.row_bytes * loader.batch_size / elapsed


def cached_rows(name: str, rows: int, row_bytes: int, shape: tuple[int, ...]) -> str:
    path = DATA_DIR / f"remote_{name}.npy"
    if not path.exists():
        DATA_DIR.mkdir(parents=True, exist_ok=True)
        np.save(path, image_rows(rows, row_bytes).reshape(rows, *shape))
    return str(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=3000, help="JPEGs generated (default 3000)")
    parser.add_argument("--batches", type=int, default=20, help="JPEG batches timed per run (default 20)")
    parser.add_argument("--actors", type=int, default=2, help="actors beside the local readers (default 2)")
    parser.add_argument("--readers", type=int, default=2, help="local readers of part 3 (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement, the best kept (default 3)")
    args = parser.parse_args(argv)

    import ray

    from shmloader import ShmDataLoader
    from shmloader.readers.ray import RayReaders

    ray.init(num_cpus=os.cpu_count(), object_store_memory=1 << 30, include_dashboard=False, log_to_driver=False)
    print(machine_line(), f"ray {ray.__version__}")

    def best(make, batches):
        results = []
        for _ in range(args.repeats):
            with make() as loader:
                results.append(rate(loader, batches))
        return max(results)

    # 1. The bridge's ceiling.
    rows = [["3 KB rows", cached_rows("rows", 100_000, 3072, (3072,)), 256],
            ["224x224x3 images", cached_rows("images", 2_000, SIZE * SIZE * 3, (SIZE, SIZE, 3)), BATCH]]
    ceiling_rows, ceiling = [], {}
    for name, path, batch in rows:
        local = best(lambda: ShmDataLoader(path, batch_size=batch, readers=1, warn_layout=False), 100)
        ceiling_rows.append([f"{name}, 1 local reader", batch, f"{local[0]:,.0f}", f"{local[1] / 1e9:.2f}"])
        for actors in (1, 2):
            remote = best(lambda: ShmDataLoader(path, batch_size=batch, readers=0, warn_layout=False,
                                                remote=RayReaders(actors=actors)), 100)
            ceiling[name, actors] = remote
            ceiling_rows.append([f"{name}, {actors} actor(s), no local reader", batch, f"{remote[0]:,.0f}",
                                 f"{remote[1] / 1e9:.2f}"])
    print("\n1. Into the ring, cached fixed rows (the actors' fill is a gather)")
    print(table(ceiling_rows, ["contender", "batch", "batches/s", "GB/s"]))
    into_ring = max(value[1] for value in ceiling.values())
    print(f"bridge into the ring: {into_ring / 1e9:.2f} GB/s")

    # 2 and 3. JPEGs.
    _, made = make_images(args.images, max(1, os.cpu_count() or 1))
    jpeg = dict(transform="shmloader.transforms.images:train", batch_size=BATCH,
                transform_args={"size": SIZE, "decoder": "fast"}, warn_layout=False)
    fields = made["fields"]
    # Interleaved pairs, so that the machine's drift hits both alike; the fill time per batch
    # (stats) tells the decoding's own noise from what the bridge adds.
    pairs = []
    for _ in range(args.repeats + 2):
        pair = []
        for make in (lambda: ShmDataLoader(fields, readers=1, **jpeg),
                     lambda: ShmDataLoader(fields, readers=0, remote=RayReaders(actors=1), **jpeg)):
            with make() as loader:
                batches_per_s = rate(loader, args.batches)[0]
                reader = loader.stats()["readers"][0]
            pair.append((batches_per_s, reader["busy_s"] / reader["batches"]))
        pairs.append(pair)
    one_local = max(pair[0][0] for pair in pairs)
    one_actor = max(pair[1][0] for pair in pairs)
    overhead = 1 - one_actor / one_local
    ratios = sorted(pair[1][0] / pair[0][0] for pair in pairs)
    fills = [(pair[0][1] * 1e3, pair[1][1] * 1e3) for pair in pairs]
    local_only = best(lambda: ShmDataLoader(fields, readers=args.readers, **jpeg), args.batches)[0]
    with_actors = best(lambda: ShmDataLoader(fields, readers=args.readers, remote=RayReaders(actors=args.actors), **jpeg),
                       args.batches)[0]
    print(f"\n2-3. JPEG pipeline ({args.images} JPEGs, {'photographs' if made['photographs'] else 'SYNTHETIC'}, "
          f"batch {BATCH}, fast decoder)")
    print(table([
        ["1 local reader", f"{one_local * BATCH:,.0f}"],
        ["1 actor, no local reader", f"{one_actor * BATCH:,.0f}"],
        [f"{args.readers} local readers", f"{local_only * BATCH:,.0f}"],
        [f"{args.readers} local readers + {args.actors} actors (same {os.cpu_count()} cores)", f"{with_actors * BATCH:,.0f}"],
    ], ["contender", "images/s"]))
    print(f"per-batch overhead of an actor against a local reader: {overhead:.1%} (best of {len(pairs)} each)")
    print(f"  actor/local per interleaved pair: {', '.join(f'{ratio:.3f}' for ratio in ratios)}; fill ms per batch "
          f"(local, actor): {', '.join(f'({a:.0f}, {b:.0f})' for a, b in fills)}")
    print("on one machine, actors share the readers' cores: part 3 shows the bridge's overhead, not scaling")

    # 4. The estimate.
    image_ceiling = max(ceiling["224x224x3 images", 1][0], ceiling["224x224x3 images", 2][0]) * BATCH
    print(f"\n4. One trainer node's bridge takes {image_ceiling:,.0f} images/s of 224x224x3 (cached gather); one actor "
          f"decodes {one_actor * BATCH:,.0f} JPEGs/s on a core here: about {image_ceiling / (one_actor * BATCH):.0f} "
          f"actor cores' worth before the bridge is the limit")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
