"""Shared fixtures: small data files in every supported format, and a /dev/shm leak check."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from shmloader import Packed, Padded, ShmDataLoader, Windows

SHM_DIRECTORY = "/dev/shm"
# The pid child trainers check that they were started by (child_guard.py).
os.environ["SHMLOADER_TEST_WORKER_PID"] = str(os.getpid())
# Loaders of this test run share a node reader budget of their own (readers/budget_record.py):
# another run on the host, or a training job, neither counts against it nor sees its loaders.
os.environ["SHMLOADER_BUDGET_SCOPE"] = f"test{os.getpid()}"

# A suite started in the background by a shell without job control (or under nohup)
# inherits SIGINT and SIGQUIT (or SIGHUP) ignored, and every process it starts would too:
# the tests that signal a child trainer need their default actions.
for _number, _action in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, signal.SIG_DFL),
                         (signal.SIGHUP, signal.SIG_DFL)):
    if signal.getsignal(_number) == signal.SIG_IGN:
        signal.signal(_number, _action)


def our_shm_entries(pid: int | None = None) -> set[str]:
    """Entries of /dev/shm that belong to shmloader rings (of one creating pid, if given)."""
    prefix = f"shml_{pid}_" if pid is not None else "shml_"
    return {name for name in os.listdir(SHM_DIRECTORY) if name.removeprefix("sem.").startswith(prefix)}


@pytest.fixture
def harness_threads_not_counted(monkeypatch):
    """Threads the test harness runs (pytest-timeout's timer, a pytest-xdist worker's) are
    not the trainer's: the drop-in's fork check (readers/trainer_fork.fork_hazard) then
    sees only those a test starts, as it would a script's. Use with
    pytest.mark.timeout(..., method="signal"), which starts no thread."""
    harness = {thread for thread in threading.enumerate() if thread is not threading.current_thread()}
    if not harness:
        return
    enumerate_all = threading.enumerate
    monkeypatch.setattr(threading, "enumerate", lambda: [thread for thread in enumerate_all()
                                                         if thread not in harness])
    monkeypatch.setattr(threading, "active_count", lambda: len(threading.enumerate()))


@pytest.fixture(autouse=True)
def torch_only_where_the_test_uses_it(request, monkeypatch):
    """torch imported into this test worker by another module (collecting test_torch*.py
    imports it) is not this test's: a loader it plans over a dataset would have each reader
    import torch (DatasetSpec.torch), which a script of the test never pays. A test whose
    module imports torch at its top level, or whose own source names torch, sees it as it
    is (harness_torch.py)."""
    if "torch" not in sys.modules or request.function is None:
        return
    from harness_torch import SysWithoutTorch, uses_torch

    if not uses_torch(request.function, request.module):
        from shmloader.plan import dataset

        monkeypatch.setattr(dataset, "sys", SysWithoutTorch())


def kill_this_process_while_kills_left(kills: str) -> None:
    """SIGKILLs the calling process (a reader) where the count in file `kills` is above 0,
    taking one from it first: a test's dataset dies that many times in all, whichever
    process runs it (a replacement reads the count its predecessor left)."""
    with open(kills, "r+") as file:
        left = int(file.read())
        if left > 0:
            file.seek(0)
            file.write(f"{left - 1}\n")
            file.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def child_environment() -> dict:
    """os.environ for a child Python that must import the shmloader this test imported: the
    checkout where it is built in place (pip install -e), the installed copy where the
    checkout is only its source (CI's pip install .). Run the child outside the checkout
    (cwd), or its source shadows the installed package."""
    import shmloader

    where = os.path.dirname(os.path.dirname(os.path.abspath(shmloader.__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))}


def budget_entries() -> list:
    """The live entries of this test run's node budget record (its scope is the session's,
    SHMLOADER_BUDGET_SCOPE), as a loader sees them: dead loaders' entries reclaimed."""
    from shmloader.readers import budget_record

    path = budget_record.record_path()
    if not os.path.exists(path):
        return []
    with open(path, "rb") as handle:
        entries = budget_record.parse(handle.read(), path)
    budget_record.reclaim(entries)
    return [entry for entry in entries if entry.pid]


def no_earned_readers(monkeypatch) -> None:
    """Keeps auto's loaders within the node's count budget: a test of the budget's own rules
    whose readers sleep leaves cores idle, where an earned reader past the budget
    (readers/earned.py, tests/test_earned_readers.py) would come before what it tests."""
    from shmloader.readers import earned

    monkeypatch.setattr(earned, "EARN_IDLE_CORES_MIN", float("inf"))


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Polls `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def torch_queue_threads_ended(timeout: float = 10.0) -> bool:
    """Waits until the queue threads that a torch DataLoader's workers left in this process
    have ended (torch closes its queues without joining their threads). A drop-in made
    while they run finds other threads in the trainer and takes its spawn path (a fresh
    interpreter importing torch per reader, seconds each) instead of the fork a script's
    loop takes; past `timeout` it still runs, on that path."""
    return wait_until(lambda: not any(thread.name == "QueueFeederThread" for thread in threading.enumerate()),
                      timeout)


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone). A reader forked by its fork server is
    reaped at once: /proc/PID can vanish between the open and the read (ESRCH)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[-1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def image_like(rows: int, row_shape: tuple[int, ...], seed: int = 0, dtype=np.uint8) -> np.ndarray:
    """Smooth, compressible rows (like images), each distinct so that a wrong row is caught."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(row_shape))
    base = (np.arange(size) * 7 % 251).astype(np.int64)
    offsets = rng.integers(0, 256, size=(rows, 1))
    noise = rng.integers(0, 4, size=(rows, size))
    data = (base[None, :] + offsets + noise) % 256
    return data.astype(dtype).reshape(rows, *row_shape)


def write_b2nd(path, array, *, chunks=None, blocks=None, codec="LZ4", clevel=5):
    import blosc2

    kwargs = {}
    if chunks is not None:
        kwargs.update(chunks=chunks, blocks=blocks)
    cparams = blosc2.CParams(codec=getattr(blosc2.Codec, codec), clevel=clevel, typesize=array.dtype.itemsize)
    blosc2.asarray(array, urlpath=str(path), mode="w", cparams=cparams, **kwargs)
    return str(path)


def _processes() -> tuple[dict[int, list[int]], dict[int, bytes]]:
    """Every process's children, and the command line of each reader (a forked reader has
    its fork server's command line: its name, /proc/PID/comm, says what it is)."""
    children: dict[int, list[int]] = {}
    commands: dict[int, bytes] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                name, rest = handle.read().split(" (", 1)[1].rsplit(") ", 1)
            parent = int(rest.split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read()
        except (OSError, IndexError, ValueError):
            continue
        if name == "shml-reader" or b"shmloader.readers.reader" in command:
            commands[int(entry)] = command
        children.setdefault(parent, []).append(int(entry))
    return children, commands


def reader_descendants() -> list[int]:
    """Pids of the reader processes descended from this process (their command line runs
    shmloader.readers.reader), however deep (a test's child trainer's readers too)."""
    children, commands = _processes()
    found, frontier = [], [os.getpid()]
    while frontier:
        for child in children.get(frontier.pop(), []):
            frontier.append(child)
            if child in commands:
                found.append(child)
    return found


def orphaned_readers() -> list[int]:
    """Pids of reader processes whose trainer (the pid their command line ends with) is
    gone: a test's child trainer killed while its readers were stopped (SIGSTOP) leaves
    them reparented away from this process, and stopped, they cannot act on their
    trainer's death."""
    _, commands = _processes()
    found = []
    for pid, command in commands.items():
        arguments = command.rstrip(b"\0").split(b"\0")
        if arguments[-1].isdigit() and not process_alive(int(arguments[-1])):
            found.append(pid)
    return found


def pytest_sessionfinish(session, exitstatus):
    """The run's node budget record goes with its last loader; one whose last loader was a
    child trainer killed by a test is left with dead entries only, and removed here."""
    from shmloader.readers.budget_record import record_path, sweep

    sweep(record_path())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item.shmloader_failed = True
    return report


@pytest.fixture(autouse=True)
def no_leaked_rings(request):
    """Every test must leave nothing of its own process's rings in /dev/shm. A test that
    failed may have left readers behind (stopped by SIGSTOP, or of a loader it never
    closed): they are killed, so that they cannot slow or confuse the tests after it."""
    yield
    if getattr(request.node, "shmloader_failed", False):
        for pid in reader_descendants() + orphaned_readers():
            for number in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, number)
                except ProcessLookupError:
                    pass
    pid = os.getpid()
    assert wait_until(lambda: not our_shm_entries(pid), timeout=30), f"leaked: {our_shm_entries(pid)}"


def float_rows(tmp_path_factory, name: str, count: int) -> tuple[str, np.ndarray]:
    """A .npy of `count` rows of 4 float32 (row i holds 4i..4i+3): a transform's input."""
    directory = tmp_path_factory.mktemp(name)
    data = np.arange(count * 4, dtype=np.float32).reshape(count, 4)
    np.save(directory / "data.npy", data)
    return str(directory / "data.npy"), data


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """600 rows of (3, 8, 8) uint8 images and int64 labels, as .npy and as converted .b2nd."""
    from shmloader.tools.convert import convert

    directory = tmp_path_factory.mktemp("dataset")
    images = image_like(600, (3, 8, 8), seed=1)
    labels = np.arange(600, dtype=np.int64) * 3 + 1
    paths = {}
    np.save(directory / "images.npy", images)
    np.save(directory / "labels.npy", labels)
    paths["images_npy"] = str(directory / "images.npy")
    paths["labels_npy"] = str(directory / "labels.npy")
    convert(paths["images_npy"], directory / "images.b2nd", rows_per_block=1, progress=False)
    convert(paths["labels_npy"], directory / "labels.b2nd", progress=False)
    paths["images_b2nd"] = str(directory / "images.b2nd")
    paths["labels_b2nd"] = str(directory / "labels.b2nd")
    # Blosc2's own defaults, the way most users write files (multi-row ZSTD blocks).
    paths["images_default"] = write_b2nd(directory / "images_default.b2nd", images, codec="ZSTD")
    return {"images": images, "labels": labels, "paths": paths, "directory": directory}


# Every field kind, small, and how to compare loaders over them (test_in_process, test_ray).

@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    """Small files of every field kind: rows (.npy, .b2nd, two parts), float rows, a token
    stream and ragged documents."""
    from shmloader.tools.convert import convert, write_ragged

    directory = tmp_path_factory.mktemp("in_process")
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 255, size=(400, 6), dtype=np.uint8)
    np.save(directory / "rows.npy", rows)
    np.save(directory / "part0.npy", rows[:150])
    np.save(directory / "part1.npy", rows[150:])
    convert(directory / "rows.npy", directory / "rows.b2nd", progress=False)
    np.save(directory / "data.npy", rows[:, :4].astype(np.float32))
    np.save(directory / "stream.npy", rng.integers(0, 50_000, size=40_000, dtype=np.int32))
    documents = [rng.integers(0, 1000, size=int(n), dtype=np.int32) for n in rng.integers(1, 40, size=400)]
    write_ragged(directory / "docs.ragged", documents)
    return directory


def declarations(directory):
    return {
        "rows npy": {"x": str(directory / "rows.npy")},
        "rows b2nd": {"x": str(directory / "rows.b2nd")},
        "many files": {"x": [str(directory / "part0.npy"), str(directory / "part1.npy")]},
        "padded": {"tokens": Padded(str(directory / "docs.ragged"), max_length=16, overflow="random")},
        "packed": {"tokens": Packed(str(directory / "docs.ragged"))},
        "windows": {"tokens": Windows(str(directory / "stream.npy"), length=32)},
    }


def batches(fields, readers, steps=12, **options):
    with ShmDataLoader(fields, readers=readers, batch_size=16, seed=7, warn_layout=False, **options) as loader:
        if readers == 0:
            assert loader.diagnostics.reader_pids == []
        return [{"step": batch.step, "indices": batch.indices.copy(), **{k: np.array(v) for k, v in batch.items()}}
                for _, batch in zip(range(steps), loader)]


def assert_same(expected, found):
    assert len(expected) == len(found)
    for one, other in zip(expected, found):
        assert one.keys() == other.keys()
        assert one["step"] == other["step"]
        for name in set(one) - {"step"}:
            end = None  # A packed field's elements past offsets[-1] are whatever the slot held before.
            if f"{name}.offsets" in one:
                end = int(one[f"{name}.offsets"][-1])
            np.testing.assert_array_equal(one[name][:end], other[name][:end], err_msg=f"{name} of step {one['step']}")


# Property tests (test_reference.py): bounded for the suite; `--hypothesis-profile=long`
# before a stop. No example database: CI runs on a clean checkout, and a run must not
# depend on what an earlier one found.
try:
    from hypothesis import HealthCheck
    from hypothesis import settings as _hypothesis_settings

    # The suite's examples are derived from each test (derandomize): a run of the suite does
    # not pass or fail by chance. The long profile draws afresh each run, to explore.
    _hypothesis_settings.register_profile("default", deadline=None, database=None, print_blob=True, derandomize=True,
                                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    _hypothesis_settings.register_profile("long", parent=_hypothesis_settings.get_profile("default"),
                                          max_examples=1000, derandomize=False)
    _hypothesis_settings.load_profile("default")

    def examples(count: int):
        """`count` examples in the suite's profile, twenty times as many in the long one."""
        long = _hypothesis_settings.default.max_examples >= 1000
        return _hypothesis_settings(max_examples=count * (20 if long else 1))
except ImportError:
    examples = None


class ReadAheadLedger:
    """Takes a read-ahead's requests as block ids (with BlockIds as the read-ahead) and checks
    the order they keep as they are settled: a block's mappings are let go of only after it
    was asked for, and its pages only once no mapping of it is left."""

    def __init__(self, alone: bool = True) -> None:
        """`alone`: the only reader, whose order is checked; one of several may let go of a
        block only another asked for (its forget then drops no mapping; its drop, pages the
        other read), so its requests are only recorded."""
        self.alone = alone
        self.requests: list[tuple[str, list[int]]] = []
        self.held: dict[int, int] = {}  # Block -> times asked for and not dropped.
        self.mapped: dict[int, int] = {}  # Block -> times asked for and not forgotten.
        self.dropped: list[int] = []

    def submit(self, what, blocks) -> bool:
        self.requests.append((what, list(blocks)))
        return True

    def settle(self) -> list[tuple[str, list[int]]]:
        """Applies the requests made since the last call, checking their order; returns them."""
        requests, self.requests = self.requests, []
        requests = [(what, list(dict.fromkeys(blocks))) for what, blocks in requests]  # A block's runs once.
        for what, blocks in requests:
            for block in blocks:
                if what == "advise":
                    self.held[block] = self.held.get(block, 0) + 1
                    self.mapped[block] = self.mapped.get(block, 0) + 1
                elif not self.alone:
                    self.dropped.extend([block] * (what == "drop"))
                elif what == "forget":
                    self.mapped[block] -= 1
                    assert self.mapped[block] >= 0, f"block {block} forgotten before it was asked for"
                else:
                    self.held[block] -= 1
                    assert self.held[block] >= self.mapped[block], f"block {block} dropped while still mapped"
                    self.dropped.append(block)
        return requests

    def in_memory(self) -> set[int]:
        return {block for block, count in self.held.items() if count > 0}

    def still_mapped(self) -> set[int]:
        return {block for block, count in self.mapped.items() if count > 0}


def block_ids_read_ahead():
    """A ReadAhead whose requests name blocks instead of byte ranges (see ReadAheadLedger)."""
    from shmloader.storage.readahead import ReadAhead

    class BlockIds(ReadAhead):
        def _run_ranges(self, block, first, count):
            return [block]

    return BlockIds


def _splitmix64_finaliser(value: int) -> int:
    value &= (1 << 64) - 1
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return value ^ (value >> 31)


def sample_generator_words(value: int, domain: int) -> list[int]:
    """The 624 Mersenne Twister words a sample with seed `value` starts from, as documented
    in shmloader/ring/_cursor_seeds.c, rebuilt here in plain Python integers: splitmix64's
    sequence from its finaliser of value ^ domain, each output's low then high half, word 0
    0x80000000."""
    base = _splitmix64_finaliser(value ^ domain)
    words = []
    for j in range(1, 313):
        output = _splitmix64_finaliser(base + j * 0x9E3779B97F4A7C15)
        words += [output & 0xFFFFFFFF, output >> 32]
    words[0] = 0x80000000
    return words


def seed_sample_generators(value: int) -> None:
    """What a reader does before a sample with seed `value`, through the generators' public
    calls: random, np.random and torch's CPU generator to their documented states (an
    independent reference for the native write, fill/global_seeds.py)."""
    import random

    import numpy as np

    random.setstate((3, (*sample_generator_words(value, 0x7079_7468_6F6E_0001), 624), None))
    np.random.set_state(("MT19937", np.array(sample_generator_words(value, 0x6E75_6D70_7900_0002), np.uint32),
                         624, 0, 0.0))
    try:
        import torch
    except ImportError:
        return
    # Torch's: a fresh seeding's state tensor with the initial seed and the 624 key words
    # (64 bits each, after left, seeded and next) replaced.
    generator = torch.Generator()
    generator.manual_seed(1)
    state = generator.get_state()
    raw = state.numpy()
    raw[:8] = np.frombuffer((value & ((1 << 63) - 1)).to_bytes(8, "little"), np.uint8)
    raw[24:24 + 8 * 624] = np.array(sample_generator_words(value, 0x746F_7263_6800_0003), "<u8").view(np.uint8)
    torch.default_generator.set_state(state)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for torchrun's store: tests use loopback only)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
