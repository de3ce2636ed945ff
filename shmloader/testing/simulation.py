"""The slot protocol with simulated readers: the real ring, the real native next() and the
real reader loop (Reader.run: claim, sleep, wake-ups, starvation counters), with readers
as threads of this process whose fill is a sleep of a controlled duration instead of I/O.

It isolates the wake-up and claim protocol from everything else a real reader does, on
any machine: a sleeping fill needs no core, so four simulated readers behave like four
readers on four free cores, even on two. Used by tests/test_protocol.py and
bench/protocol.py; not part of the loader's API.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

from ..loader import ShmDataLoader
from ..readers.pool import ReaderPool
from ..readers.reader import Reader


class ReaderDied(Exception):
    """Raised by fill_seconds to make a simulated reader die mid-claim, as a killed one would:
    its slot stays FILLING, nothing is published, and the pool must restart it."""


class _SleepFiller:
    """A step filler whose fill writes the step into the indices and sleeps for
    fill_seconds(step, reader) instead of reading: the reader loop around it is the real one."""

    def __init__(self, fill_seconds, reader_index: int, published: list) -> None:
        self.fill_seconds, self.reader_index, self.published = fill_seconds, reader_index, published

    def bind(self, views):
        return views[-1]  # The indices: what the trainer checks is the step it was given.

    def fill(self, step: int, indices) -> None:
        indices[:] = step
        time.sleep(self.fill_seconds(step, self.reader_index))
        self.published.append(step)  # list.append is atomic under the GIL; published right after.

    def close(self) -> None:
        pass


class _SimulatedReader(Reader):
    def __init__(self, config, ring, fill_seconds, published: list) -> None:
        super().__init__(config, ring, _SleepFiller(fill_seconds, config.reader_index, published))
        self.asleep = False

    def trainer_alive(self) -> bool:
        return True  # A thread of the trainer: it lives exactly as long.

    def _sleep(self) -> None:
        self.asleep = True
        try:
            super()._sleep()
        finally:
            self.asleep = False

    def run(self) -> int:
        try:
            return super().run()
        except ReaderDied:
            return 17


class SimulatedPool(ReaderPool):
    """A ReaderPool whose readers are threads running the real reader loop."""

    def __init__(self, count: int, max_restarts: int, fill_seconds) -> None:
        super().__init__(count, max_restarts)
        self.fill_seconds = fill_seconds
        self.readers: list[_SimulatedReader] = []
        self.threads: list[threading.Thread] = []
        self.published: list[int] = []  # Every step published READY, in order of publication.

    def start(self) -> None:
        pass

    def _start_thread(self, index: int) -> None:
        reader = _SimulatedReader(dataclasses.replace(self._config, reader_index=index), self.ring, self.fill_seconds,
                                  self.published)
        thread = threading.Thread(target=reader.run, name=f"simulated reader {index}", daemon=True)
        if index < len(self.readers):
            self.readers[index], self.threads[index] = reader, thread
        else:
            self.readers.append(reader)
            self.threads.append(thread)
        thread.start()

    def all_asleep(self) -> bool:
        """Every reader alive and waiting for work (a dead one is the restart's business)."""
        return all(reader.asleep and thread.is_alive() for reader, thread in zip(self.readers, self.threads))

    @property
    def pids(self) -> list[int]:
        return [os.getpid()] * self.count

    def skipped(self) -> tuple[int, list]:
        return 0, []

    def configure(self, ring, config) -> None:
        self.ring, self._config = ring, config
        for index in range(self.count):
            self._start_thread(index)

    def _failed(self, reader_index: int) -> bool:
        """Whether a reader thread reported an error (a dead one is restarted by check, with no budget)."""
        return bool(self.ring.records.error(reader_index))

    def check(self, request, awaited: int | None = None) -> None:
        """Restarts a reader thread that died, as ReaderPool restarts a dead process."""
        for index, thread in enumerate(self.threads):
            if not thread.is_alive() and not self.ring.stopping:
                self.retire(index, request)
                self._start_thread(index)

    def stop(self) -> None:
        if self.ring is not None and not self.ring.closed:
            for _ in self.threads:
                self.ring.work_semaphore.release()
        for thread in self.threads:
            thread.join(5.0)


def simulated_loader(path: str, readers: int, fill_seconds, **options) -> ShmDataLoader:
    """A loader over `path` (any small .npy: its rows are not read) whose readers are
    threads filling each step in fill_seconds(step, reader) seconds; batch.indices holds
    the step each slot was filled for."""

    class _Loader(ShmDataLoader):
        @staticmethod
        def _pool_type(count: int, max_restarts: int, remote) -> ReaderPool:
            return SimulatedPool(count, max_restarts, fill_seconds)

    return _Loader(path, readers=readers, warn_layout=False, **options)
