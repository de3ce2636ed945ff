"""`shmloader audit LOG...`: from the audit logs of every rank (audit_log.py), across resumes
and reshapes, proves that each row of each epoch was delivered once, or names the rows
missing or repeated, their epoch, and the ranks and steps that delivered them.

What a log proves is counted from what the trainers recorded, not asked of the sampler:

- Segments of one pass (the same data and settings, whatever the shard count or batch
  size) are read together. A run is the segments that start at one stream position with
  one shape, the n-th segment of each rank there being attempt n (a run resumed twice from
  one checkpoint is two attempts).
- A resume replays: what a run delivered at or past the position of the checkpoint a later
  run resumed from (its steps after the checkpoint, lost with the kill) is delivered again
  by the later run. Those records are *superseded*: counted as replayed, not as deliveries.
  Positions are the stream positions a checkpoint records (plan/checkpoint.py): a step's is
  where its global batch starts (or each shard's own batch, for a window split among shards).
- Rows marked padding (Batch.padding) are left out. A finite pass of E epochs then delivers
  each row E times; each epoch being one order of all rows dealt in turn, a row's k-th
  delivery is its epoch k's. With drop_last=True up to a global batch less one row of the
  last epoch may be left out (noted). An endless loader's epochs are those its positions
  have completed; its last, partial epoch is checked for repeats only.
- The epoch named for a row comes from its stream position (its step's position over the
  pass's rows per epoch): exact but for a pass's last dealt steps and a resharded dealing,
  where it is the epoch the step mostly holds.
"""

from __future__ import annotations

import collections
import dataclasses
import os

import numpy as np

from ..audit_log import read_log

# Rows named per pass and kind of problem; the rest are counted.
_ROWS_NAMED_MAX = 20


@dataclasses.dataclass
class _Delivery:
    rows: np.ndarray  # non-padding row indices
    epochs: np.ndarray  # each row's epoch, from its stream position
    shard: str  # "rank i/n"
    step: int
    where: str  # file and segment


def audit(paths: list[str], write=print) -> int:
    """Reads the logs at `paths`, writes the report line by line, returns the exit status:
    0 when every pass is proven, 1 when a row is missing or repeated or a log is damaged."""
    problems = 0
    passes: dict[str, list] = collections.defaultdict(list)
    # A file named twice (a glob and its name) is read once: its records are not deliveries twice.
    paths = list({os.path.realpath(path): path for path in reversed(paths)}.values())[::-1]
    for path in paths:
        try:
            log = read_log(path)
        except OSError as error:
            write(f"PROBLEM: cannot read {path}: {error.strerror}")
            problems += 1
            continue
        for note in log.notes:
            write(f"note: {note}")
        for problem in log.problems:
            write(f"PROBLEM: {problem}")
        problems += len(log.problems)
        for segment in log.segments:
            passes[segment.header["pass_id"]].append(segment)
    write(f"shmloader audit: {len(paths)} log(s), {len(passes)} pass(es)")
    for pass_id, segments in passes.items():
        problems += _audit_pass(pass_id, segments, write)
    write("OK: each row of each epoch delivered once" if not problems else f"{problems} problem(s)")
    return 1 if problems else 0


def _position(header: dict, step: int) -> int:
    """The stream position a checkpoint before `step` records (Sampler.step_position)."""
    return step * header["global_batch"] + header["offset"]


def _attempts(segments: list) -> list[tuple[int, int, list]]:
    """(start ns, position, segments) of each attempt, oldest first (see the module docstring)."""
    runs = collections.defaultdict(list)
    for segment in segments:
        header = segment.header
        runs[(header["position"], header["shard_count"], header["batch_size"])].append(segment)
    attempts = []
    for (position, _, _), members in runs.items():
        numbered = collections.defaultdict(list)
        seen = collections.Counter()
        for segment in sorted(members, key=lambda found: found.header["started_ns"]):
            index = segment.header["shard_index"]
            numbered[seen[index]].append(segment)
            seen[index] += 1
        for attempt in numbered.values():
            attempts.append((min(found.header["started_ns"] for found in attempt), position, attempt))
    attempts.sort(key=lambda attempt: attempt[0])
    return attempts


def _deliveries(attempts: list) -> tuple[list[_Delivery], int, int]:
    """The records no later resume replays, as deliveries; and the rows replayed, and padding."""
    deliveries, replayed, padding = [], 0, 0
    for number, (_, _, segments) in enumerate(attempts):
        later = [position for start, position, _ in attempts[number + 1:] if start > attempts[number][0]]
        replayed_from = min(later, default=None)
        for segment in segments:
            header = segment.header
            shard = f"rank {header['shard_index']}/{header['shard_count']}"
            where = f"{segment.path} segment {segment.order}"
            for step, indices, padded in segment.records:
                if replayed_from is not None and _position(header, step) >= replayed_from:
                    replayed += len(indices) - padded
                    continue
                kept = indices[:len(indices) - padded]
                padding += padded
                first = _position(header, step) + (0 if header["own_streams"] else
                                                   header["shard_index"] * header["batch_size"])
                epochs = (first + np.arange(len(kept))) // header["epoch_positions"]
                deliveries.append(_Delivery(kept, epochs, shard, step, where))
    return deliveries, replayed, padding


def _audit_pass(pass_id: str, segments: list, write) -> int:
    first = segments[0].header
    rows, epochs, drop_last = first["rows"], first["epochs"], first["drop_last"]
    attempts = _attempts(segments)
    settings = ", ".join(f"{key}={first['pass'].get(key)!r}" for key in ("mode", "seed", "shuffle_window"))
    write(f"pass {pass_id} ({rows} rows, epochs={epochs}, drop_last={drop_last}, {settings}):")
    for start, position, members in attempts:
        header = members[0].header
        write(f"  {header['reason']} at position {position}: {len(members)} of {header['shard_count']} rank(s), "
              f"batch_size {header['batch_size']}, {sum(len(found.records) for found in members)} step(s)")
    deliveries, replayed, padding = _deliveries(attempts)
    if replayed:
        write(f"  {replayed} row(s) delivered past a checkpoint and replayed by the run resumed from it: superseded")
    every = np.concatenate([found.rows for found in deliveries]) if deliveries else np.zeros(0, np.int64)
    every_epoch = np.concatenate([found.epochs for found in deliveries]) if deliveries else np.zeros(0, np.int64)
    outside = every[(every < 0) | (every >= rows)]
    if len(outside):
        write(f"  PROBLEM: {len(outside)} delivered row(s) outside the pass's {rows} rows, e.g. {outside[:5].tolist()}")
        return len(outside)
    counts = np.bincount(every, minlength=rows)
    if epochs is None:
        return _endless(counts, every, every_epoch, rows, deliveries, write)
    expected = np.full(rows, epochs)
    if drop_last:
        short = counts == epochs - 1
        allowed = attempts[-1][2][0].header["batch_size"] * attempts[-1][2][0].header["shard_count"] - 1
        if 0 < short.sum() <= allowed:
            write(f"  note: {int(short.sum())} row(s) of the last epoch not delivered (drop_last=True leaves out the "
                  f"last global batch's rest)")
            expected[short] = epochs - 1
    problems = _report(counts, expected, deliveries, range(epochs), write)
    if not problems:
        write(f"  OK: each row of each of its {epochs} epoch(s) once ({len(every)} rows delivered"
              f"{f', {padding} padding row(s) aside' if padding else ''})")
    return problems


def _endless(counts, every, every_epoch, rows: int, deliveries: list, write) -> int:
    """An endless loader: the epochs its positions completed, each row once in each; the
    last, partial one, no row twice."""
    complete = int(every_epoch.max()) if len(every_epoch) else 0
    in_complete = every_epoch < complete
    expected = np.full(rows, complete)
    problems = _report(np.bincount(every[in_complete], minlength=rows), expected, deliveries, range(complete),
                       write)
    partial = np.bincount(every[~in_complete], minlength=rows)
    problems += _report(partial, np.minimum(partial, 1), deliveries, [complete], write)
    if not problems:
        write(f"  OK: each row of each of its {complete} complete epoch(s) once, none twice in epoch {complete} "
              f"(endless: {len(every)} rows delivered)")
    return problems


def _report(counts, expected, deliveries: list, epochs, write) -> int:
    """Names the rows whose deliveries differ from `expected`, with epoch, ranks and steps."""
    wrong = np.flatnonzero(counts != expected)
    if not len(wrong):
        return 0
    named = set(wrong[:_ROWS_NAMED_MAX].tolist())
    found = collections.defaultdict(list)  # row -> [(epoch, delivery)]
    for delivery in deliveries:
        hits = np.flatnonzero(np.isin(delivery.rows, wrong[:_ROWS_NAMED_MAX]))
        for row, epoch in zip(delivery.rows[hits].tolist(), delivery.epochs[hits].tolist()):
            if epoch in epochs:
                found[row].append((epoch, delivery))
    for row in sorted(named):
        seen = found[row]
        by_epoch = collections.defaultdict(list)
        for epoch, delivery in seen:
            by_epoch[epoch].append(delivery)
        if counts[row] > expected[row]:
            twice = [epoch for epoch, items in by_epoch.items() if len(items) > 1] or [seen[-1][0]]
            for epoch in sorted(twice):
                where = "; ".join(f"{item.shard} step {item.step} ({item.where})" for item in by_epoch[epoch])
                write(f"  PROBLEM: epoch {epoch}: row {row} repeated ({len(by_epoch[epoch])} times): {where}")
        else:
            lacking = [epoch for epoch in epochs if epoch not in by_epoch] or [max(epochs)]
            others = "; ".join(f"epoch {epoch}: {item.shard} step {item.step}" for epoch, item in seen) or "none"
            for epoch in lacking:
                write(f"  PROBLEM: epoch {epoch}: row {row} missing (its other deliveries: {others})")
    if len(wrong) > len(named):
        write(f"  PROBLEM: {len(wrong) - len(named)} more row(s) missing or repeated")
    return len(wrong)
