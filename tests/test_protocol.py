"""The wake-up and claim protocol, with simulated readers (shmloader.testing.simulation: the real
ring, native next() and reader loop; readers are threads whose fill is a sleep): every step
is published once and delivered in order under reader deaths, no requested slot waits
while every reader sleeps, and readers stay busy while the trainer waits for them."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from shmloader.plan.defaults import auto_readers_most as _auto_readers_most, default_slots as _default_slots
from shmloader.ring.layout import POLL_INTERVAL_SECONDS, SlotState
from shmloader.testing.simulation import ReaderDied, simulated_loader


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("protocol") / "rows.npy"
    np.save(path, np.zeros((64, 4), np.float32))
    return str(path)


def uneven(fill_s: float, slow_every: int = 10, factor: float = 5.0):
    """Every slow_every-th step (by a fixed hash) takes `factor` times longer."""
    return lambda step, reader: fill_s * (factor if (step * 0x9E3779B1) % 2**32 % slow_every == 0 else 1)


class Watchdog(threading.Thread):
    """Samples the ring: the longest time some slot stayed REQUESTED while every reader slept."""

    def __init__(self, loader) -> None:
        super().__init__(daemon=True)
        self.loader, self.longest, self.done = loader, 0.0, threading.Event()

    def run(self) -> None:
        ring, pool, since = self.loader._session.ring, self.loader._session.pool, None
        while not self.done.wait(0.0005):
            requested = any(ring.state(slot)[0] == SlotState.REQUESTED for slot in range(self.loader.slots))
            if requested and pool.all_asleep():
                since = since or time.monotonic()
                self.longest = max(self.longest, time.monotonic() - since)
            else:
                since = None


def deliver(loader, batches: int) -> None:
    for step, batch in zip(range(batches), loader):
        assert int(batch.indices[0]) == step, f"step {step} got the slot of step {int(batch.indices[0])}"


def busy_and_starved(stats: dict, readers: int) -> tuple[float, float]:
    busy = float(np.mean([reader["busy_fraction"] for reader in stats["readers"]]))
    return busy, sum(reader["starved_s"] for reader in stats["readers"]) / (readers * stats["elapsed_s"])


@pytest.mark.parametrize("readers", [1, 3, 6])
def test_every_step_is_published_once_and_delivered_in_order_under_reader_deaths(rows, readers):
    died = set()

    def fill(step, reader):
        if step % 37 == 5 and step not in died:  # A reader dies mid-claim, once per such step.
            died.add(step)
            raise ReaderDied
        return 0.0005

    with simulated_loader(rows, readers, fill, batch_size=4) as loader:
        watchdog = Watchdog(loader)
        watchdog.start()
        deliver(loader, 400)
        watchdog.done.set()
        watchdog.join()
        published = list(loader._session.pool.published)
        assert loader.stats()["reader_restarts"] >= len([s for s in died if s < 400 - loader.slots])
    assert len(published) == len(set(published)), "a step was published twice"
    assert set(range(400)) <= set(published)
    assert watchdog.longest < POLL_INTERVAL_SECONDS, f"a request waited {watchdog.longest:.3f} s with all asleep"


def test_readers_stay_busy_while_the_trainer_waits(rows):
    """Uneven fills (one step in ten five times slower), a trainer faster than the readers:
    with the default slots the readers barely sleep while a slot waits for them."""
    with simulated_loader(rows, 6, uneven(0.002), batch_size=4) as loader:
        assert loader.slots == 4 * 6 + 2  # bench/protocol.py compares slot counts by their busy shares.
        watchdog = Watchdog(loader)
        watchdog.start()
        deliver(loader, 1200)
        watchdog.done.set()
        watchdog.join()
        stats = loader.stats()
    # No reader slept while a slot waited for it beyond a wake-up's latency (a lost or
    # deferred wake-up shows here), and no request waited a poll interval with all asleep.
    _, starved = busy_and_starved(stats, 6)
    assert starved < 0.05, starved
    assert watchdog.longest < POLL_INTERVAL_SECONDS


def test_default_slots_shrink_with_batch_bytes_but_not_below_two_per_reader():
    assert _default_slots(4, 1 << 20) == 18
    assert _default_slots(14, 1 << 20) == 58
    assert _default_slots(8, 64 << 20) == 18  # 1 GiB holds 16 slots of 64 MiB; the floor is 2 * 8 + 2.
    assert _default_slots(8, 40 << 20) == 25


def test_the_default_ring_keeps_to_a_small_memorys_share(tmp_path, monkeypatch):
    """In a pod or container whose memory is small, the default ring takes no more than an
    automatic ring's share of it (defaults.default_ring_bytes), never under two slots a
    reader: a ring's pages count against the memory group that touches them. Before, 1 GiB
    whatever the memory: ten 16 MiB slots here, in 512 MiB."""
    from shmloader import ShmDataLoader
    from shmloader.plan import defaults

    np.save(tmp_path / "x.npy", np.zeros((64, 1 << 20), dtype=np.uint8))  # 1 MiB rows: 16 MiB batches.
    # The rooms a ring has (/dev/shm's, memory's) large, as on any host this runs on: the limit decides.
    monkeypatch.setattr(defaults.backing, "free_bytes", lambda path: 64 << 30)
    monkeypatch.setattr(defaults.backing, "memory_room_bytes", lambda: 64 << 30)
    monkeypatch.setattr(defaults, "memory_limit_bytes", lambda: 512 << 20)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    assert defaults.default_ring_bytes() == 64 << 20  # An eighth of it.
    with ShmDataLoader({"x": str(tmp_path / "x.npy")}, batch_size=16, readers=2) as loader:
        assert loader.slots == 6  # 4 slots of 16 MiB fit; the floor is 2 * 2 + 2.
        assert next(iter(loader))["x"].shape == (16, 1 << 20)
    monkeypatch.setattr(defaults, "memory_limit_bytes", lambda: 64 << 30)
    assert defaults.default_ring_bytes() == 1 << 30  # A large node: the fixed bound, as before.


def test_an_auto_loaders_default_ring_is_sized_for_its_start_with_a_slot_for_each_reader_it_may_add():
    """readers="auto" sizes the ring for the readers it starts (8 on 16 cores) as the fixed
    default does, with a slot for each of the most it may reach besides the trainer's two
    and one where that stays under 1 GiB; auto adds no more readers than those slots feed."""
    assert _default_slots(8, 1 << 20, most=16) == _default_slots(8, 1 << 20) == 34
    assert _default_slots(2, 1 << 20, most=9) == 12  # One of 8 ranks on 16 cores: 10 for its start.
    assert _default_slots(8, 40 << 20, most=64) == 25  # 64 cores: 1 GiB, not 67 slots (2.6 GiB).
    assert _auto_readers_most(64, 8, 25) == 22
    for most in range(1, 70):
        for start in range(1, most + 1):
            for slot_bytes in (1 << 10, 1 << 20, 40 << 20, 160 << 20):
                fixed = _default_slots(start, slot_bytes)
                slots = _default_slots(start, slot_bytes, most=most)
                assert slots * slot_bytes <= max(1 << 30, fixed * slot_bytes)  # The fixed default's bound.
                assert slots >= fixed
                fed = _auto_readers_most(most, start, slots)
                assert start <= fed <= most and fed + 3 <= max(slots, start + 3)
                if (most + 3) * slot_bytes <= 1 << 30:
                    assert fed == most  # Where it fits, a slot for every reader auto may reach.
