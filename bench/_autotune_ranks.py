"""bench/autotune.py's torchrun case: 2 and 4 ranks on this node, each a loader of the computing
Dataset whose training step costs a different time (rank r sleeps r / (ranks - 1) of
--rank-step-ms a batch), readers="auto" on every rank against a sweep of fixed splits of
readers among the ranks; the total rows/s of all ranks, and whether a rank waited while
another's readers idled.

Each contender is one launch of `python -m torch.distributed.run` (gloo on 127.0.0.1): the ranks
build their loaders, meet at a barrier, iterate for --warmup seconds, meet again and are timed
for --seconds together; each writes its rows, its trainer's wait and its readers' busy time over
the timed window (from two stats()) to a file the launcher reads. The fixed splits: the faster
half of the ranks (the smaller steps) with each of --rank-readers readers, the slower half with
each of them too, slots 4 * readers + 2 (the default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

# "A rank waits": its trainer waited at least this share of the timed window (the tuner's
# ADD_WAIT_SHARE: a twentieth of the step rate lost).
_WAITING_SHARE = 0.05
# "Readers idle": a rank's readers past its least that its fills did not need, each counted
# as needed up to half busy (the tuner's RETIRE_BUSY_SHARE: a reader less would not be missed).
_NEEDED_BUSY_SHARE = 0.5
_RANK_BATCH = 64
# A launch: torch imported by every rank on a shared 2-core host, the loaders built, the run.
_LAUNCH_OVERHEAD_S = 180


# ---- One rank, under torchrun ----------------------------------------------------------------


def _rank_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one rank of bench/autotune.py's torchrun case")
    parser.add_argument("--out", required=True, help="the directory each rank writes rank-<r>.json to")
    parser.add_argument("--readers", required=True, help='"auto", or the readers of each rank, comma-separated')
    parser.add_argument("--steps-ms", required=True, help="each rank's training step (a sleep), comma-separated")
    parser.add_argument("--warmup", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    return parser


def _window(before: dict, after: dict, seconds: float) -> dict:
    """The trainer's wait share and the readers' busy time (in readers) between two stats()."""
    busy = sum(reader["busy_s"] for reader in after["readers"]) - sum(reader["busy_s"] for reader in before["readers"])
    return {"wait_share": (after["wait_s"] - before["wait_s"]) / seconds, "readers_busy": busy / seconds}


def last_decision(loader) -> str | None:
    """Auto's last decision, in words (a change or not; stats() gives only the last change)."""
    tuner = getattr(loader._session, "tuner", None)
    return None if tuner is None or tuner.decision is None else tuner.decision.why


def rank_child(dataset_type, argv: list[str]) -> None:
    """A rank's run (module note): writes rank-<RANK>.json and exits."""
    import torch.distributed as distributed

    from shmloader import ShmDataLoader

    arguments = _rank_parser().parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    step_s = float(arguments.steps_ms.split(",")[rank]) / 1e3
    readers = "auto" if arguments.readers == "auto" else int(arguments.readers.split(",")[rank])
    slots = "auto" if readers == "auto" else 4 * readers + 2
    distributed.init_process_group("gloo")
    with ShmDataLoader.from_dataset(dataset_type(), batch_size=_RANK_BATCH, readers=readers, slots=slots,
                                    shard_index=rank, shard_count=world, seed=rank) as loader:
        iterator = iter(loader)
        distributed.barrier()  # Every rank's loader built: the warm-up starts together.
        end = time.perf_counter() + arguments.warmup
        while time.perf_counter() < end:
            next(iterator)
            time.sleep(step_s)
        distributed.barrier()
        before, started, cpu_started = loader.stats(), time.perf_counter(), time.process_time()
        batches, end = 0, started + arguments.seconds
        while time.perf_counter() < end:
            next(iterator)
            time.sleep(step_s)
            batches += 1
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        after = loader.stats()
        result = {"rank": rank, "rows": batches * loader.batch_size, "seconds": elapsed, "step_ms": step_s * 1e3,
                  "trainer_ms": 1e3 * cpu / max(1, batches), "readers": after["reader_count"],
                  "least": after.get("readers_least", after["reader_count"]), "slots": loader.slots,
                  "change": after["reader_change"], "decision": last_decision(loader),
                  "trial": after.get("reader_trial"),
                  "budget": (after["node_budget"] or {}).get("budget"), "earned": after.get("readers_earned", 0),
                  **_window(before, after, elapsed)}
    with open(os.path.join(arguments.out, f"rank-{rank}.json"), "w") as handle:
        json.dump(result, handle)
    distributed.barrier()  # No rank ends (and frees its readers' cores) while another is timed.
    distributed.destroy_process_group()
    sys.exit(0)


# ---- The launcher ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(script: str, world: int, readers: str, steps_ms: list[float], warmup_s: float, seconds: float) -> list[dict]:
    """One torchrun launch of `world` ranks; each rank's result, by rank."""
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--monitor-interval=0.1",
                   "--master_addr=127.0.0.1", f"--master_port={_free_port()}", f"--log-dir={directory}/torchrun",
                   script, "--rank-child", "--out", directory, "--readers", readers,
                   "--steps-ms", ",".join(f"{step:g}" for step in steps_ms), "--warmup", str(warmup_s),
                   "--seconds", str(seconds)]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        launch = subprocess.Popen(command, env=environment, start_new_session=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = launch.communicate(timeout=_LAUNCH_OVERHEAD_S + warmup_s + seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launch.pid, signal.SIGKILL)  # Ranks left behind by a failed launch.
        if launch.returncode != 0:
            raise RuntimeError(f"torchrun, {world} ranks, readers {readers}: exit {launch.returncode}\n{log[-3000:]}")
        results = []
        for rank in range(world):
            with open(os.path.join(directory, f"rank-{rank}.json")) as handle:
                results.append(json.load(handle))
        return results


def spare_readers(rank: dict) -> int:
    """A rank's readers past its least that its fills did not need (_NEEDED_BUSY_SHARE)."""
    needed = max(rank["least"], math.ceil(rank["readers_busy"] / _NEEDED_BUSY_SHARE - 1e-9))
    return max(0, rank["readers"] - needed)


def waits_beside_idle_readers(ranks: list[dict]) -> list[str]:
    """Each rank that waited while another rank had spare readers, in words (none: [])."""
    found = []
    for waiting in ranks:
        if waiting["wait_share"] < _WAITING_SHARE:
            continue
        for other in ranks:
            if other is not waiting and spare_readers(other):
                found.append(f"rank {waiting['rank']} waited {waiting['wait_share']:.0%} while rank {other['rank']}'s "
                             f"{other['readers']} readers were {other['readers_busy']:.2f} busy")
    return found


def _splits(world: int, counts: list[int]) -> list[str]:
    """The fixed splits: the faster half's readers each, then the slower half's (module note)."""
    faster = world // 2
    return [",".join([str(fast)] * faster + [str(slow)] * (world - faster)) for fast in counts for slow in counts]


def _describe(ranks: list[dict]) -> str:
    return ", ".join(f"rank {rank['rank']} ({rank['step_ms']:g} ms) {rank['rows'] / rank['seconds']:,.0f} rows/s, "
                     f"waited {rank['wait_share']:.0%}, {rank['readers']} readers {rank['readers_busy']:.2f} busy"
                     + (f" ({rank['earned']} earned)" if rank.get("earned") else "")
                     for rank in ranks)


def measure_ranks(script: str, arguments, notes: list[str]) -> list[list]:
    """The torchrun case's table rows, for each of --ranks; its notes appended to `notes`."""
    rows = []
    counts = [int(count) for count in arguments.rank_readers.split(",")]
    for world in (int(count) for count in arguments.ranks.split(",")):
        steps_ms = [arguments.rank_step_ms * rank / max(1, world - 1) for rank in range(world)]
        contenders = ["auto", *_splits(world, counts)]
        runs: dict[str, list[list[dict]]] = {name: [] for name in contenders}
        for round_index in range(arguments.rounds):
            shift = round_index % len(contenders)
            for name in contenders[shift:] + contenders[:shift]:
                ranks = _launch(script, world, name, steps_ms, arguments.warmup, arguments.seconds)
                runs[name].append(ranks)
                total = sum(rank["rows"] / rank["seconds"] for rank in ranks)
                print(f"torchrun {world} ranks round {round_index}: readers {name}: {total:,.0f} rows/s: "
                      f"{_describe(ranks)}", flush=True)
                if name == "auto":  # What auto did in this round (the notes keep the last round's only).
                    for rank in ranks:
                        print(f"  rank {rank['rank']}: last change {rank['change']}; last trial: {rank.get('trial')}",
                              flush=True)
        rows += _world_rows(world, runs, notes)
    return rows


def _world_rows(world: int, runs: dict[str, list[list[dict]]], notes: list[str]) -> list[list]:
    case = f"torchrun {world} ranks"
    totals = {name: [sum(rank["rows"] / rank["seconds"] for rank in ranks) for ranks in found]
              for name, found in runs.items()}
    medians = {name: statistics.median(values) for name, values in totals.items()}
    best = max((name for name in medians if name != "auto"), key=medians.get)
    rows = []
    for name, found in runs.items():
        trainer_ms = statistics.median(statistics.mean(rank["trainer_ms"] for rank in ranks) for ranks in found)
        rows.append([case, "auto" if name == "auto" else f"readers {name}",
                     f"{medians[name]:,.0f} ({min(totals[name]):,.0f}-{max(totals[name]):,.0f})",
                     f"{medians[name] / medians[best]:.2f}", f"{trainer_ms:.3f}",
                     "/".join("+".join(str(rank["readers"]) for rank in ranks) for ranks in found),
                     "+".join(str(rank["slots"]) for rank in found[0])])
    waits = [found for ranks in runs["auto"] for found in waits_beside_idle_readers(ranks)]
    notes.append(f"{case}: best fixed split readers {best}; auto, rank waits while another's readers idled: "
                 f"{'; '.join(waits) or 'none'}; auto's last round: {_describe(runs['auto'][-1])}; node budget "
                 f"{runs['auto'][-1][0]['budget']}")
    for ranks in runs["auto"][-1:]:
        changes = [f"rank {rank['rank']}: {rank['change']}" for rank in ranks if rank["change"] is not None]
        decisions = [f"rank {rank['rank']}: {rank['decision']}" for rank in ranks if rank["decision"] is not None]
        notes.append(f"{case}: auto's last changes: {'; '.join(changes) or 'none'}; last decisions: "
                     f"{'; '.join(decisions) or 'none'}")
    return rows
