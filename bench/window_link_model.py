"""A model, not a measurement: how much of a store's link the block-local shuffle can use
over its first N batches, and what it costs in randomness, for today's order and for
candidate orders (the first batches of a window over a store). Pure arithmetic: no network, no files.

The link's share over N batches, counted from the constructor, is at most

    D / (rate * t0 + fetched(N))

with D the bytes of the N batches' rows, t0 the start-up before the first request (the
link idle), and fetched(N) the bytes that must have arrived before batch N can be
delivered: every page some row of batches 0 .. N - 1 lies on (the pages' first need,
"order" below), or what the fetch policy asks for by then ("policy"). The orders are
re-implemented here in numpy (zig/permutation.zig SlidingShuffle's geometry: places,
shares C(k) = floor((k + 1) R / B), the tail in the drain, a rotation per place, each phase
permuted), with numpy's generator in place of the Feistel permutations; "today" is also
checked against the real sampler. Candidates:

  stripes:S       a block's own order deals whole stripes of S rows (a share is ~R / (B S)
                  random stripes) instead of random rows: a phase needs only its shares' pages
  stripes:S+      the same, stratified: a share takes one stripe of each stratum of B
                  consecutive stripes, so that it lies evenly over the block as random rows do
  stripes:S/G     and each phase dealt in G sub-phases (each 1/G of every share), permuted
                  within the sub-phase only: the rows fetched ahead shrink to a sub-phase
  ramp:S+         stripes for the first window's places only (random rows after)
  geometry:R/W    today's order with blocks of R rows and a window of W (the real sampler):
                  small blocks from anywhere in the data, and a small window

Randomness as bench/window_randomness.py measures it (distinct labels per batch on data
sorted by class; whole epoch and middle half).

    python bench/window_link_model.py
    python bench/window_link_model.py --orders today,stripes:16,stripes:16/4 --t0 0.11
    python bench/window_link_model.py --sweep      # geometry:R/W over R x W: the frontier
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import table  # noqa: E402

PAGE_BYTES = 1 << 14  # shmloader/remote/pages.py CACHE_PAGE_BYTES
NPY_HEADER_BYTES = 128
LOOKAHEAD_BLOCKS = 4  # shmloader/storage/readahead.py


def shares(rows: int, windows: int) -> np.ndarray:
    """C(k) for k = -1 .. B - 1: the block's order positions its shares end at."""
    k = np.arange(windows + 1, dtype=np.int64)
    return np.minimum(rows, k * rows // windows)


def within_order(kind: str, block_rows: int, windows: int, rng: np.random.Generator) -> np.ndarray:
    """A block's own order (position q -> row within the block) for one epoch: random rows,
    or whole stripes of S rows in random order ("S"), or stratified ("S+": the block's
    stripes in strata of B consecutive ones, and the order takes one stripe of each stratum
    in turn, so that a share's stripes lie evenly over the block as random rows would)."""
    if kind == "random":
        return rng.permutation(block_rows)
    stripe = int(kind.rstrip("+"))
    full = block_rows // stripe
    if kind.endswith("+"):
        stratum, offset = np.divmod(np.arange(full), windows)
        turns = np.argsort(rng.random((stratum[-1] + 1, windows)), axis=1)  # A permutation per stratum.
        stripes = np.lexsort((stratum, turns[stratum, offset]))
    else:
        stripes = rng.permutation(full)
    order = (stripes[:, None] * stripe + np.arange(stripe)[None, :]).ravel()
    return np.concatenate([order, np.arange(full * stripe, block_rows)])  # The partial stripe last.


def epoch_order(length: int, block_rows: int, windows: int, within: str, groups: int, seed: int,
                ramp_only: bool = False) -> tuple:
    """(rows of the epoch in order, the pool of each position: the phase, or sub-phase,
    whose rows are permuted together and so must all be fetched before its first batch)."""
    rng = np.random.default_rng(seed)
    full_blocks = length // block_rows
    tail = length - full_blocks * block_rows
    blocks = rng.permutation(full_blocks)
    own = within_order(within, block_rows, windows, rng)
    random_own = rng.permutation(block_rows)
    rotation = rng.integers(0, block_rows, full_blocks)
    ends = shares(block_rows, windows)
    tail_rotation = int(rng.integers(0, tail)) if tail else 0
    out, phase_of = [], []
    for phase in range(full_blocks + windows - 1):
        pieces = [[] for _ in range(groups)]
        for place in range(max(0, phase - windows + 1), min(phase, full_blocks - 1) + 1):
            share = phase - place
            q = np.arange(ends[share], ends[share + 1])
            # ramp_only: the stripes for the places of the first window only (random rows after).
            order = random_own if ramp_only and place >= windows else own
            rows = blocks[place] * block_rows + (order[q] + rotation[place]) % block_rows
            for group, piece in enumerate(np.array_split(rows, groups)):
                pieces[group].append(piece)
        if phase >= full_blocks and tail:
            index = phase - full_blocks
            first, end = index * tail // (windows - 1), (index + 1) * tail // (windows - 1)
            rows = full_blocks * block_rows + (np.arange(first, end) + tail_rotation) % tail
            for group, piece in enumerate(np.array_split(rows, groups)):
                pieces[group].append(piece)
        for group in pieces:
            rows = np.concatenate(group) if group else np.zeros(0, np.int64)
            out.append(rng.permutation(rows))
            phase_of.append(np.full(len(rows), len(phase_of)))
    return np.concatenate(out).astype(np.int64), np.concatenate(phase_of)


def real_order(length: int, block_rows: int, window: int, batch: int) -> np.ndarray:
    from shmloader.plan.sampler import Sampler

    sampler = Sampler(length, batch, "shuffle", 0, shuffle_window=window, block_rows=block_rows)
    steps = length // batch
    return np.concatenate([sampler.fill(step) for step in range(steps)]).astype(np.int64)


def page_first_need(order: np.ndarray, row_bytes: int, pages: int) -> np.ndarray:
    """The first position of the stream that needs each page (a row's bytes may span two)."""
    need = np.full(pages, np.iinfo(np.int64).max)
    positions = np.arange(len(order))
    first = (NPY_HEADER_BYTES + order * row_bytes) // PAGE_BYTES
    last = (NPY_HEADER_BYTES + (order + 1) * row_bytes - 1) // PAGE_BYTES
    for page_index in (first, last, (first + last) // 2):
        np.minimum.at(need, page_index, positions)
    return need


def requests_of(pages: np.ndarray, pools: np.ndarray, request_pages: int) -> int:
    """Ranged GETs for `pages`, each fetched with the pool (phase or sub-phase) that first
    needs it: runs of consecutive pages of one pool, at most request_pages each."""
    if not len(pages):
        return 0
    index = np.lexsort((pages, pools))
    pages, pools = pages[index], pools[index]
    breaks = np.flatnonzero((np.diff(pages) != 1) | (np.diff(pools) != 0)) + 1
    starts, ends = np.append(0, breaks), np.append(breaks, len(pages))
    return int(np.sum(-(-(ends - starts) // request_pages)))


def link_rows(args, label: str, order: np.ndarray, pools: np.ndarray, policy_blocks=None) -> list[list[str]]:
    """The rows of the link table for one order."""
    pages = -(-(NPY_HEADER_BYTES + args.rows * args.row_bytes) // PAGE_BYTES)
    need = page_first_need(order, args.row_bytes, pages)
    out = []
    for batches in args.batches:
        count = min(len(order), batches * args.batch_size)
        delivered = count * args.row_bytes
        needed_pages = np.flatnonzero(need < count)
        fetched = len(needed_pages) * PAGE_BYTES
        bound = delivered / (args.rate * args.t0 + fetched)
        # The GETs the order costs at least where each pool's pages are fetched together.
        requests = requests_of(needed_pages, pools[need[needed_pages]], (8 << 20) // PAGE_BYTES)
        row = [label, f"{count // args.batch_size:,}", f"{delivered / 1e6:,.0f}", f"{fetched / 1e6:,.0f}",
               f"{(fetched - delivered) / 1e6:,.1f}", f"{bound:.3f}", f"{requests:,}"]
        if policy_blocks is not None:
            policy = policy_blocks(count) * args.block_rows * args.row_bytes
            row.append(f"{delivered / (args.rate * args.t0 + policy):.3f}")
        else:
            row.append("-")
        out.append(row)
    return out


def today_policy(args):
    """Blocks ReadAhead has asked for by position `count`: closed + B + LOOKAHEAD_BLOCKS of
    the position's phase (whole blocks)."""
    from shmloader.plan.sampler import Sampler

    sampler = Sampler(args.rows, args.batch_size, "shuffle", 0, shuffle_window=args.window,
                      block_rows=args.block_rows)

    def blocks(count: int) -> int:
        places = sampler.places(max(0, count - 1))
        return min(places.total, places.closed + sampler.blocks_per_window + LOOKAHEAD_BLOCKS)

    return blocks


def diversity(order: np.ndarray, classes: int, rows: int, batch: int) -> tuple[float, float]:
    steps = len(order) // batch
    labels = (order[:steps * batch] // (rows // classes)).reshape(steps, batch)
    distinct = np.array([len(np.unique(row)) for row in labels])
    middle = distinct[steps // 4: 3 * steps // 4]
    return float(distinct.mean()), float(middle.mean())


def parse_order(text: str) -> tuple[str, int, bool]:
    """(within order, sub-phases per phase, stripes in the first window's places only)."""
    if text == "today":
        return "random", 1, False
    kind, _, stripes = text.partition(":")
    assert kind in ("stripes", "ramp"), text
    stripe, _, groups = stripes.partition("/")
    return stripe, int(groups or 1), kind == "ramp"


def sweep(args) -> None:
    """Today's order over blocks of R rows and windows of M blocks: each one's link share
    bound at every N and its randomness, the frontier that smaller blocks and windows give."""
    pages = -(-(NPY_HEADER_BYTES + args.rows * args.row_bytes) // PAGE_BYTES)
    out = []
    for block_rows in (16, 32, 64, 128, 341, 683):
        for blocks in (16, 32, 64, 128, 256, 512):
            window = block_rows * blocks
            need = page_first_need(real_order(args.rows, block_rows, window, args.batch_size), args.row_bytes, pages)
            bounds = []
            for batches in args.batches:
                count = min(args.rows, batches * args.batch_size)
                fetched = np.count_nonzero(need < count) * PAGE_BYTES
                bounds.append(f"{count * args.row_bytes / (args.rate * args.t0 + fetched):.3f}")
            figures = diversity(real_order(args.random_rows, block_rows, window, args.batch_size), args.classes,
                                args.random_rows, args.batch_size)
            out.append([f"{block_rows} ({block_rows * args.row_bytes >> 10} KiB)", f"{blocks}", f"{window:,}",
                        *bounds, f"{figures[0]:.1f}", f"{figures[1]:.1f}",
                        f"{args.batches[0] * args.batch_size // block_rows:,}"])
    print(table(out, ["block rows", "window blocks", "window rows", *(f"bound, {n:,} batches" for n in args.batches),
                      "distinct labels (epoch)", "(middle half)", f"blocks (GETs) in {args.batches[0]:,} batches"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=524_288, help="the store bench's rows")
    parser.add_argument("--row-bytes", type=int, default=3072)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--window", type=int, default=262_144)
    parser.add_argument("--block-rows", type=int, default=10_922)
    parser.add_argument("--batches", default="600,1100,2048", help="N (2048: the store bench's whole pass)")
    parser.add_argument("--rate", type=float, default=124.8e6, help="the link's bytes/s (the bench's obstore GETs)")
    parser.add_argument("--t0", type=float, default=0.11, help="seconds from the constructor to the first request")
    parser.add_argument("--orders", default="today,stripes:16,stripes:16+,stripes:32+,stripes:16+/4,ramp:16+")
    parser.add_argument("--random-rows", type=int, default=1_000_000, help="window_randomness.py's data")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--random-block-rows", default="10922,5461")
    parser.add_argument("--sweep", action="store_true", help="the frontier of today's order over smaller blocks")
    args = parser.parse_args()
    args.batches = [int(value) for value in args.batches.split(",")]
    if args.sweep:
        sweep(args)
        return
    windows = -(-args.window // args.block_rows)
    link, randomness = [], []
    for text in args.orders.split(","):
        if text.startswith("geometry:"):  # Today's order with other blocks: geometry:BLOCK_ROWS/WINDOW.
            block_rows, window = map(int, text.split(":")[1].split("/"))
            order = real_order(args.rows, block_rows, window, args.batch_size)
            pools = np.arange(len(order)) // block_rows  # Phases are a block's rows where the window is full.
            link += link_rows(args, text, order, pools)
            random_order = real_order(args.random_rows, block_rows, window, args.batch_size)
            figures = diversity(random_order, args.classes, args.random_rows, args.batch_size)
            randomness.append([text, f"{-(-window // block_rows)} x {block_rows:,}", f"{figures[0]:.1f}",
                               f"{figures[1]:.1f}"])
            continue
        within, groups, ramp_only = parse_order(text)
        order, pools = epoch_order(args.rows, args.block_rows, windows, within, groups, 1, ramp_only)
        link += link_rows(args, f"{text} (model)", order, pools, today_policy(args) if text == "today" else None)
        if text == "today":  # Its pools as the model's (the sampler's phases have the same geometry).
            link += link_rows(args, "today (the sampler)", real_order(args.rows, args.block_rows, args.window,
                                                                      args.batch_size), pools, today_policy(args))
        for block_rows in map(int, args.random_block_rows.split(",")):
            block_rows = max(1, min(block_rows, args.window // 8))
            random_windows = -(-args.window // block_rows)
            figures = diversity(epoch_order(args.random_rows, block_rows, random_windows, within, groups, 0,
                                            ramp_only)[0], args.classes, args.random_rows, args.batch_size)
            randomness.append([text, f"{random_windows} x {block_rows:,}", f"{figures[0]:.1f}", f"{figures[1]:.1f}"])
    print(f"link: {args.rows:,} rows of {args.row_bytes} B, batch {args.batch_size}, window {args.window:,} "
          f"({windows} blocks of {args.block_rows:,}), {args.rate / 1e6:.1f} MB/s, t0 {args.t0} s")
    print(table(link, ["order", "batches", "delivered MB", "pages needed MB", "ahead MB", "link share bound (order)",
                       "GETs (runs of needed pages)", "bound (whole blocks ahead, today's policy)"]))
    print(f"\nrandomness: {args.random_rows:,} rows sorted into {args.classes:,} classes, window {args.window:,}")
    print(table(randomness, ["order", "blocks x rows", "distinct labels / batch (epoch)", "(middle half)"]))


if __name__ == "__main__":
    main()
