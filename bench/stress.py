"""Stress: kill a random reader every few hundred batches for minutes; every batch must be right.

Run: python bench/stress.py [--seconds 180] [--signal-rounds 30]
Prints batches delivered, readers killed, batches lost or duplicated (must be 0), batches with
wrong contents (must be 0) and entries left in /dev/shm (must be 0). Then it starts trainers
in their own process groups and ends each one the way users and operators do (SIGTERM,
SIGHUP or SIGQUIT to the group, SIGKILL of the trainer, a double Ctrl-C while close() waits
for stopped readers): nothing of theirs may be left in /dev/shm nor among the processes.
Then readers="auto" under the same faults while readers join and leave: every few hundred
batches one of add a reader, retire one, kill an active one, retire one and kill it, retire
one and stop it a moment, stop an active one a moment (SIGSTOP, then SIGCONT). Then two
faults that once gave wrong data: a file replaced under a running loader (and a
reader restart, which reopens it) must end in an error naming the change, never a wrong
batch; a transform that forks children which return into the reader must deliver every
step once and right. Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

from shmloader import ReaderRestartWarning, Sampler, ShmDataLoader
from shmloader.tools.convert import convert


def shm_entries(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.removeprefix("sem.").startswith(f"shml_{pid}_")]


# A trainer that iterates until it is ended; on "close" it stops its readers and closes,
# so that close() waits for them while the double Ctrl-C arrives.
_CHILD = """
import json, os, signal, sys, time
from shmloader import ShmDataLoader
loader = ShmDataLoader({"label": sys.argv[1]}, batch_size=32, readers=2, slots=4)
next(loader)
print(json.dumps(loader.diagnostics.reader_pids), flush=True)
if sys.argv[2] == "close":
    for pid in loader.diagnostics.reader_pids:
        os.kill(pid, signal.SIGSTOP)
    print("closing", flush=True)
    loader.close()
while True:
    next(loader)
    time.sleep(0.0005)
"""
_ENDINGS = ("SIGTERM to the group", "SIGHUP to the group", "SIGQUIT to the group", "SIGKILL of the trainer",
            "double Ctrl-C during close")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


_FORKING_TRANSFORM = """
import os
import shmloader


@shmloader.transform(outputs={"x": ((768,), "uint8")})
def forks(batch, out, ctx):
    out["x"][:] = batch["image"]
    if ctx.step % 7 == 3:
        pid = os.fork()  # The child returns into the reader: it must be ended, never publish.
        if pid:
            os.waitpid(pid, 0)
"""


def replaced_file(directory: str, labels: np.ndarray) -> tuple[int, bool]:
    """(wrong batches, whether the error named the change) for a .npy replaced by one of
    the same size and another dtype, then its readers SIGKILLed so that they reopen it."""
    from shmloader import ReaderError

    path = f"{directory}/replaced.npy"
    np.save(path, labels)
    wrong, named = 0, False
    with ShmDataLoader({"label": path}, batch_size=64, readers=2, slots=6, seed=3) as loader:
        sampler = Sampler(len(labels), 64, "shuffle", seed=3)
        try:
            for count, batch in enumerate(loader):
                wrong += not np.array_equal(batch["label"], labels[sampler.fill(batch.step)])
                if count == 50:
                    np.save(f"{directory}/other.npy", labels.astype(np.float64))
                    os.replace(f"{directory}/other.npy", path)
                    for pid in loader.diagnostics.reader_pids:  # Every reader reopens the file.
                        os.kill(pid, signal.SIGKILL)
                    deadline = time.monotonic() + 30
                if count > 50 and time.monotonic() > deadline:
                    break
        except ReaderError as error:
            named = "changed since the loader described it" in str(error)
    return wrong, named


def forking_transform(directory: str, images: np.ndarray, batches: int) -> tuple[int, int]:
    """(wrong batches, batches out of order) with a transform whose children return."""
    with open(f"{directory}/stress_transforms.py", "w") as handle:
        handle.write(_FORKING_TRANSFORM)
    sys.path.insert(0, directory)
    sampler = Sampler(len(images), 32, "shuffle", seed=9)
    wrong = out_of_order = 0
    with ShmDataLoader({"image": f"{directory}/images.npy"}, batch_size=32, readers=2, slots=6, seed=9,
                       transform="stress_transforms:forks") as loader:
        for step, batch in zip(range(batches), loader):
            out_of_order += batch.step != step
            indices = sampler.fill(batch.step)
            wrong += not (np.array_equal(batch.indices, indices) and np.array_equal(batch["x"], images[indices]))
    return wrong, out_of_order


_ELASTIC_ACTIONS = ("add", "retire", "kill an active reader", "retire and kill it", "retire and stop it a moment",
                    "stop an active reader a moment")


def _signal(pid: int, number: int) -> bool:
    try:
        os.kill(pid, number)
        return True
    except ProcessLookupError:  # It exited meanwhile (a retired reader with no step to finish).
        return False


def _stop_a_moment(pid: int, rng: random.Random) -> None:
    if _signal(pid, signal.SIGSTOP):
        time.sleep(rng.uniform(0.02, 0.2))
        _signal(pid, signal.SIGCONT)


def _elastic_action(loader, action: str, rng: random.Random) -> bool:
    """Does `action` to the auto loader's readers (the pool its tuner drives, driven here by
    hand as well); whether it did anything."""
    pool = loader._session.pool
    if action == "add":
        return pool.add_reader() is not None
    if action.startswith("retire"):
        leaving = pool.retire_reader()
        if leaving is None:
            return False
        if action == "retire and kill it":
            _signal(pool.processes[leaving].pid, signal.SIGKILL)
        elif action == "retire and stop it a moment":
            _stop_a_moment(pool.processes[leaving].pid, rng)
        return True
    active = pool.active()
    if not active:
        return False
    pid = pool.processes[rng.choice(active)].pid
    if action == "kill an active reader":
        return _signal(pid, signal.SIGKILL)
    _stop_a_moment(pid, rng)
    return True


def elastic(fields: dict, labels: np.ndarray, images: np.ndarray, seconds: float, most: int,
            rng: random.Random) -> dict:
    """readers="auto" whose readers join and leave, killed and stopped meanwhile: counts of
    the actions done, batches delivered, out of order and wrong, and the restarts seen."""
    from shmloader.plan.options import AutoReaders

    sampler = Sampler(len(labels), 64, "shuffle", seed=7)
    done = {action: 0 for action in _ELASTIC_ACTIONS}
    delivered = wrong = out_of_order = 0
    next_action = rng.randint(100, 300)
    deadline = time.monotonic() + seconds
    with ShmDataLoader(fields, batch_size=64, readers=AutoReaders(start=2, most=most), slots=3 * most + 2, seed=7,
                       max_reader_restarts=1 << 20) as loader:
        for batch in loader:
            out_of_order += batch.step != delivered
            indices = sampler.fill(batch.step)
            wrong += not (np.array_equal(batch.indices, indices) and np.array_equal(batch["label"], labels[indices])
                          and np.array_equal(batch["image"], images[indices]))
            delivered += 1
            if delivered == next_action:
                action = rng.choice(_ELASTIC_ACTIONS)
                done[action] += _elastic_action(loader, action, rng)
                next_action += rng.randint(100, 300)
            if time.monotonic() > deadline:
                break
        restarts = loader.stats()["reader_restarts"]
    return {"actions": done, "delivered": delivered, "wrong": wrong, "out_of_order": out_of_order,
            "restarts": restarts}


def signal_rounds(label_path: str, rounds: int, rng: random.Random) -> dict[str, int]:
    """Ends `rounds` trainers in the ways of _ENDINGS; counts the endings that left anything."""
    leaks = {ending: 0 for ending in _ENDINGS}
    for round_index in range(rounds):
        ending = _ENDINGS[round_index % len(_ENDINGS)]
        mode = "close" if ending.startswith("double") else "iterate"
        child = subprocess.Popen([sys.executable, "-c", _CHILD, label_path, mode], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        readers = json.loads(child.stdout.readline())
        if mode == "close":
            child.stdout.readline()
            time.sleep(0.2)
            child.send_signal(signal.SIGINT)
            time.sleep(rng.uniform(0.05, 0.5))
            child.send_signal(signal.SIGINT)
        else:
            time.sleep(rng.uniform(0.1, 0.6))
            if ending == "SIGKILL of the trainer":
                child.kill()
            else:
                os.killpg(child.pid, getattr(signal, ending.split()[0]))
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        for pid in readers:  # Readers stopped by the test itself must run to exit.
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (shm_entries(child.pid) or any(_alive(pid) for pid in readers)):
            time.sleep(0.05)
        if shm_entries(child.pid) or any(_alive(pid) for pid in readers):
            leaks[ending] += 1
    return leaks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--readers", type=int, default=3)
    parser.add_argument("--signal-rounds", type=int, default=30, help="trainers ended by signals afterwards")
    parser.add_argument("--elastic-seconds", type=float, default=60,
                        help='readers="auto" with readers joining and leaving under kills and stops, afterwards')
    arguments = parser.parse_args()
    warnings.simplefilter("ignore", ReaderRestartWarning)  # Restarts are counted: one line per kill would bury the counts.
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as directory:
        rows = 20_000
        images = np.random.default_rng(1).integers(0, 255, size=(rows, 768), dtype=np.uint8)
        labels = np.arange(rows, dtype=np.int64)
        np.save(f"{directory}/images.npy", images)
        np.save(f"{directory}/labels.npy", labels)
        convert(f"{directory}/images.npy", f"{directory}/images.b2nd", progress=False)
        fields = {"image": f"{directory}/images.b2nd", "label": f"{directory}/labels.npy"}
        sampler = Sampler(rows, 64, "shuffle", seed=5)
        delivered, killed, wrong, out_of_order = 0, 0, 0, 0
        expected_step = 0
        next_kill = rng.randint(200, 400)
        deadline = time.monotonic() + arguments.seconds
        with ShmDataLoader(fields, batch_size=64, readers=arguments.readers, slots=6, seed=5,
                           max_reader_restarts=1 << 20) as loader:
            for batch in loader:
                if batch.step != expected_step:
                    out_of_order += 1
                expected_step = batch.step + 1
                indices = sampler.fill(batch.step)
                if not (np.array_equal(batch.indices, indices) and np.array_equal(batch["label"], labels[indices])
                        and np.array_equal(batch["image"], images[indices])):
                    wrong += 1
                delivered += 1
                if delivered == next_kill:
                    victim = rng.choice(loader.diagnostics.reader_pids)
                    try:
                        os.kill(victim, signal.SIGKILL)
                        killed += 1
                    except ProcessLookupError:
                        pass
                    next_kill += rng.randint(200, 400)
                if time.monotonic() > deadline:
                    break
            restarts = loader.stats()["reader_restarts"]
        time.sleep(0.5)
        left = shm_entries(os.getpid())
        leaks = signal_rounds(fields["label"], arguments.signal_rounds, rng)
        joined = elastic(fields, labels, images, arguments.elastic_seconds, arguments.readers, rng)
        replaced_wrong, replaced_named = replaced_file(directory, labels)
        forked_wrong, forked_out_of_order = forking_transform(directory, images, 700)
        left += shm_entries(os.getpid())
    print(f"ran {arguments.seconds:.0f} s with {arguments.readers} readers")
    print(f"batches delivered: {delivered}")
    print(f"readers killed: {killed} (restarts seen by the loader: {restarts})")
    print(f"batches lost or duplicated: {out_of_order}")
    print(f"batches with wrong contents: {wrong}")
    print(f"entries left in /dev/shm: {len(left)} {left if left else ''}")
    print(f"trainers ended by signals: {arguments.signal_rounds}; endings that left anything behind:")
    for ending, count in leaks.items():
        print(f"  {ending}: {count}")
    print(f'readers="auto" for {arguments.elastic_seconds:.0f} s, readers joining and leaving: '
          f"{joined['delivered']} batches, {joined['out_of_order']} lost or duplicated, {joined['wrong']} wrong, "
          f"{joined['restarts']} restarts; actions done: "
          + ", ".join(f"{action} {count}" for action, count in joined["actions"].items()))
    print(f"file replaced under the loader: {replaced_wrong} wrong batches, the error named the change: "
          f"{replaced_named}")
    print(f"forking transform (700 batches, 100 forks): {forked_wrong} wrong, {forked_out_of_order} out of order")
    clean = out_of_order == wrong == len(left) == sum(leaks.values()) == 0 and replaced_named and \
        replaced_wrong == forked_wrong == forked_out_of_order == joined["wrong"] == joined["out_of_order"] == 0 and \
        joined["delivered"] > 0 and all(joined["actions"].values())  # Every kind of join, leave and fault done.
    return 0 if clean and restarts >= killed - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
