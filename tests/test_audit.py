"""audit_log and `shmloader audit`: a run of 2 ranks killed with SIGKILL past its checkpoint,
resumed on 3 ranks at another batch size, then on 1, is proven each row of each epoch once
(and the children's own notes of what they delivered agree); a planted duplicate row, a
removed step, a torn last record and a damaged record are named. The logs are edited with
this file's own reader of the layout documented in shmloader/audit_log.py."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from child_guard import WORKER_VARIABLE
from conftest import free_port
from shmloader import ShmDataLoader
from shmloader.tools.cli import main

HERE = Path(__file__).parent
ROWS = 60
EPOCHS = 2  # audit_child.py's pass


@pytest.fixture()
def data(tmp_path):
    np.save(tmp_path / "rows.npy", np.arange(ROWS, dtype=np.int64))
    return str(tmp_path / "rows.npy")


def run_ranks(tmp_path, data, name, shards, batch, resume_from, checkpoint_after, stop_after, kill, window=None):
    """Starts `shards` ranks of audit_child.py; with `kill`, SIGKILLs each once it is past
    its checkpoint and stopped, as a node failure would."""
    children = []
    for rank in range(shards):
        children.append(subprocess.Popen(
            [sys.executable, str(HERE / "audit_child.py"), data, str(tmp_path / "audit-{rank}.log"),
             str(tmp_path / f"notes-{name}-{rank}.jsonl"), str(rank), str(shards), str(batch),
             str(resume_from) if resume_from else "-", str(tmp_path / f"checkpoint-{name}.json"),
             str(checkpoint_after), str(stop_after), "kill" if kill else "close", str(window or "-")],
            cwd=HERE, stdout=subprocess.PIPE, text=True))
    try:
        for child in children:
            if kill:
                assert child.stdout.readline().strip() == "ready"
                os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=120) == (-signal.SIGKILL if kill else 0)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdout.close()
    return tmp_path / f"checkpoint-{name}.json"


def run_torchrun_ranks(tmp_path, data, name, shards, batch, checkpoint_after, stop_after):
    """`shards` ranks of audit_child.py under torchrun (rank and shard count from its
    environment), SIGKILLed with torchrun once every rank is past its checkpoint and stopped."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    command = [torchrun, f"--nproc_per_node={shards}", "--monitor-interval=0.1", "--master_addr=127.0.0.1",
               f"--log-dir={tmp_path / 'torchrun'}",  # Not a torchelastic_* directory of its own in /tmp.
               f"--master_port={free_port()}", str(HERE / "audit_child.py"), data, str(tmp_path / "audit-{rank}.log"),
               str(tmp_path / f"notes-{name}-{{rank}}.jsonl"), "env", str(shards), str(batch), "-",
               str(tmp_path / f"checkpoint-{name}.json"), str(checkpoint_after), str(stop_after), "kill", "-"]
    # The ranks' parent is torchrun's agent, not this worker (child_guard.py's check).
    environment = {key: value for key, value in os.environ.items() if key != WORKER_VARIABLE}
    launch = subprocess.Popen(command, cwd=HERE, env={**environment, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        # The ranks share torchrun's stdout: their lines may come interleaved ("readyready").
        ready = ""
        while ready.count("ready") < shards:
            line = launch.stdout.readline()
            if not line:
                break
            ready += line
        assert ready.count("ready") == shards and not ready.replace("ready", "").strip(), ready
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)  # torchrun and its ranks, as a node failure would.
        launch.wait(timeout=60)
        launch.stdout.close()
    return tmp_path / f"checkpoint-{name}.json"


def notes(tmp_path, name):
    return [json.loads(line) for path in sorted(tmp_path.glob(f"notes-{name}-*.jsonl")) for line in open(path)]


def audit(paths, capsys) -> tuple[int, str]:
    status = main(["audit", *map(str, paths)])
    return status, capsys.readouterr().out


# A shuffle window smaller than the data: each shard reads its own blocks, and another
# shard count deals the rows left (plan/reshard.py), its positions those of its own streams.
@pytest.mark.parametrize("window,launcher", [(None, "subprocess"), (20, "subprocess"), (None, "torchrun")],
                         ids=["global", "window", "torchrun"])
def test_a_killed_run_resumed_on_3_ranks_at_another_batch_size_then_on_1_is_each_row_of_each_epoch_once(
        tmp_path, data, capsys, window, launcher):
    # 2 ranks at batch 4: a checkpoint after 4 steps, killed after 7 (3 steps replayed).
    if launcher == "torchrun":
        first = run_torchrun_ranks(tmp_path, data, "first", 2, 4, 4, 7)
    else:
        first = run_ranks(tmp_path, data, "first", 2, 4, None, 4, 7, kill=True, window=window)
    # 3 ranks at batch 3 from it: a checkpoint after 3 steps (5 with a window: past the
    # dealing of the rows the 2 ranks left, before which no other shard count continues), 2 more.
    checkpoint = 3 if window is None else 5
    second = run_ranks(tmp_path, data, "second", 3, 3, first, checkpoint, checkpoint + 2, kill=False, window=window)
    # 1 rank at batch 5 from that, to the end of the pass.
    run_ranks(tmp_path, data, "third", 1, 5, second, -1, -1, kill=False, window=window)
    # The model of the promise, from the children's own notes: what each run delivered
    # before the checkpoint the next resumed from, and all of the last, is every row twice.
    kept = collections.Counter()
    for name in ("first", "second", "third"):
        for note in notes(tmp_path, name):
            if name == "third" or not note["after_checkpoint"]:
                kept.update(row for row, padded in zip(note["rows"], note["padding"]) if not padded)
    assert kept == {row: EPOCHS for row in range(ROWS)}
    replayed = sum(note["after_checkpoint"] for name in ("first", "second") for note in notes(tmp_path, name))
    assert replayed > 0
    status, out = audit(sorted(tmp_path.glob("audit-*.log")), capsys)
    assert status == 0, out
    assert "OK: each row of each of its 2 epoch(s) once" in out
    assert "superseded" in out
    print(out)



# Editing logs: this file's reader of the documented layout.
HEADER = struct.Struct("<8sI")
RECORD = struct.Struct("<4sI")
STEP = struct.Struct("<QQIII")


def records(path):
    """[(kind, payload)] of a log, in order."""
    data = Path(path).read_bytes()
    offset, found = HEADER.size, []
    while offset < len(data):
        kind, size = RECORD.unpack_from(data, offset)
        found.append((kind, data[offset + RECORD.size:offset + RECORD.size + size]))
        offset += RECORD.size + size + 4
    return found


def write_records(path, found):
    with open(path, "wb") as file:
        file.write(HEADER.pack(b"SHMAUDIT", 1))
        for kind, payload in found:
            head = RECORD.pack(kind, len(payload))
            file.write(head + payload + struct.pack("<I", zlib.crc32(head + payload)))


def step_rows(payload):
    """(step, row indices) of a STEP payload."""
    _, step, rows, _, flags = STEP.unpack_from(payload)
    return step, np.frombuffer(payload, np.uint32 if flags & 1 else np.uint64, rows, STEP.size)


def with_rows(payload, rows):
    segment, step, count, padded, flags = STEP.unpack_from(payload)
    return STEP.pack(segment, step, count, padded, flags) + np.asarray(rows, np.uint32).tobytes()


@pytest.fixture()
def logs(tmp_path, data):
    """A whole pass of 2 epochs on 2 ranks at batch 4, in one process: (log paths, {(rank, step): rows})."""
    delivered = {}
    for rank in range(2):
        with ShmDataLoader(data, batch_size=4, shard_index=rank, shard_count=2, readers=0, seed=3, epochs=EPOCHS,
                           audit_log=tmp_path / "pass.log") as loader:
            for batch in loader:
                delivered[(rank, batch.step)] = batch["data"].tolist()
    return [tmp_path / "pass.log.rank0", tmp_path / "pass.log.rank1"], delivered


def test_a_whole_pass_is_proven(logs, capsys):
    paths, delivered = logs
    assert sorted(collections.Counter(row for rows in delivered.values() for row in rows).values()) == [2] * ROWS
    status, out = audit(paths, capsys)
    assert status == 0 and "OK: each row of each of its 2 epoch(s) once (120 rows delivered)" in out, out


def test_a_planted_duplicate_names_the_row_epoch_ranks_and_steps(logs, capsys):
    paths, delivered = logs
    # Rank 1's step 9 (epoch 1: positions 72-79 of 60-row epochs) gets rank 0's step 8's first row.
    found = records(paths[1])
    for number, (kind, payload) in enumerate(found):
        if kind == b"STEP" and step_rows(payload)[0] == 9:
            rows = step_rows(payload)[1].copy()
            lost, rows[0] = int(rows[0]), delivered[(0, 8)][0]
            found[number] = (kind, with_rows(payload, rows))
    write_records(paths[1], found)
    twice = delivered[(0, 8)][0]
    status, out = audit(paths, capsys)
    assert status == 1, out
    assert f"epoch 1: row {twice} repeated (2 times): rank 0/2 step 8" in out and "rank 1/2 step 9" in out, out
    assert f"epoch 1: row {lost} missing" in out, out


def test_a_removed_step_names_its_rows_missing_in_its_epoch(logs, capsys):
    paths, delivered = logs
    found = [(kind, payload) for kind, payload in records(paths[0])
             if kind != b"STEP" or step_rows(payload)[0] != 2]
    write_records(paths[0], found)
    status, out = audit(paths, capsys)
    assert status == 1, out
    for row in delivered[(0, 2)]:  # Positions 16-19: epoch 0.
        assert f"epoch 0: row {row} missing" in out, out


def test_a_torn_last_record_is_noted_and_left_out(logs, capsys):
    paths, delivered = logs
    data = paths[1].read_bytes()
    last = records(paths[1])[-1]
    paths[1].write_bytes(data[:-7])  # The last step's record cut short, as a SIGKILL mid-write would.
    status, out = audit(paths, capsys)
    assert "note:" in out and "torn last record" in out, out
    step, rows = step_rows(last[1])
    assert status == 1 and all(f"row {row} missing" in out for row in rows.tolist()), out


def test_a_killed_writers_torn_record_and_reserve_are_cut_by_the_resumed_run(tmp_path, data, capsys):
    log = tmp_path / "run.log"
    with ShmDataLoader(data, batch_size=4, readers=0, seed=3, epochs=1, audit_log=log) as loader:
        for _ in range(3):
            next(loader)
        state = loader.state_dict()
        next(loader)
    kind, payload = records(log)[-1]
    with open(log, "ab") as file:  # A record the kill cut short (its kind not stored yet), then zeros.
        file.write(b"\0" * 4 + (RECORD.pack(kind, len(payload)) + payload)[4:30] + b"\0" * 4096)
    status, out = audit([log], capsys)
    assert "torn last record" in out, out
    with ShmDataLoader(data, batch_size=6, readers=0, seed=3, epochs=1, audit_log=log) as loader:
        loader.load_state_dict(state)
        for _ in loader:
            pass
    status, out = audit([log], capsys)
    assert status == 0 and "torn" not in out and "OK: each row" in out, out


def test_a_second_writer_of_one_file_is_refused(tmp_path, data, monkeypatch):
    import shmloader.audit_log

    monkeypatch.setattr(shmloader.audit_log, "_LOCK_WAIT_SECONDS", 0.1)
    with ShmDataLoader(data, batch_size=4, readers=0, audit_log=tmp_path / "one.log"):
        with pytest.raises(ValueError, match="being written by another loader"):
            ShmDataLoader(data, batch_size=4, readers=0, audit_log=tmp_path / "one.log")
    (tmp_path / "other.txt").write_text("not a log")
    with pytest.raises(ValueError, match="is not a version-1 audit log"):
        ShmDataLoader(data, batch_size=4, readers=0, audit_log=tmp_path / "other.txt")
    assert (tmp_path / "other.txt").read_text() == "not a log"


def test_a_damaged_record_inside_a_log_is_a_problem_and_is_kept(logs, data, capsys):
    paths, _ = logs
    damaged = bytearray(paths[0].read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    paths[0].write_bytes(bytes(damaged))
    status, out = audit(paths, capsys)
    assert status == 1 and "damaged record" in out, out
    with pytest.raises(ValueError, match="damaged record"):  # Never cut off by the next writer.
        ShmDataLoader(data, batch_size=4, shard_count=2, readers=0, seed=3, epochs=EPOCHS,
                      audit_log=paths[0].parent / "pass.log")
    assert paths[0].read_bytes() == bytes(damaged)


def test_audit_log_refuses_what_it_cannot_prove(data, tmp_path):
    with pytest.raises(ValueError, match="mode='random'"):
        ShmDataLoader(data, batch_size=4, readers=0, mode="random", audit_log=tmp_path / "x.log")
    with pytest.raises(TypeError, match="audit_log must be a path"):
        ShmDataLoader(data, batch_size=4, readers=0, audit_log=3)


def test_the_drop_in_records_each_epoch_as_a_pass_and_refuses_a_callers_sampler(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from shmloader.torch import DataLoader

    dataset = torch.arange(ROWS)
    for rank in range(2):
        loader = DataLoader(dataset, batch_size=4, shuffle=True, seed=5, shard_index=rank, shard_count=2,
                            audit_log=tmp_path / "drop-in-{rank}.log")
        for _ in range(2):
            for _ in loader:
                pass
        loader.close()
    status, out = audit(sorted(tmp_path.glob("drop-in-*.log")), capsys)
    assert status == 0 and out.count("OK: each row of each of its 1 epoch(s) once") == 2, out
    with pytest.raises(ValueError, match="sampler= or batch_sampler="):
        DataLoader(dataset, batch_size=4, sampler=range(ROWS), audit_log=tmp_path / "no.log")


def test_a_checkpoint_resumed_twice_replays_the_first_attempts_steps(tmp_path, data, capsys):
    log = tmp_path / "twice.log"
    with ShmDataLoader(data, batch_size=4, readers=0, seed=2, epochs=1, audit_log=log) as loader:
        for _ in range(3):
            next(loader)
        state = loader.state_dict()
        next(loader)  # Past the checkpoint: replayed.
    for steps in (2, None):  # The first resume dies after 2 steps; the second, from the same checkpoint, ends the pass.
        with ShmDataLoader(data, batch_size=4, readers=0, seed=2, epochs=1, audit_log=log) as loader:
            loader.load_state_dict(state)
            for _, _ in zip(range(steps or len(loader)), loader):
                pass
    status, out = audit([log], capsys)
    assert status == 0 and "12 row(s) delivered past a checkpoint" in out, out
