"""A trainer process for the fault tests: builds a loader, reports its pids and ring, then
behaves as told (iterate forever, exit without closing, ...). Not a test module."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from child_guard import die_with_parent

from shmloader import ShmDataLoader
from shmloader.readers.pool import ReaderPool


def main() -> None:
    die_with_parent()
    behaviour, fields = sys.argv[1], json.loads(sys.argv[2])
    if behaviour in ("stall", "close-while-waiting"):
        # Their close() joins readers stopped by SIGSTOP, then kills them: no need to wait 2 s.
        ReaderPool.join_timeout_seconds = 0.3
    if behaviour == "close-with-stopped-readers":
        ReaderPool.join_timeout_seconds = 1.0  # Still longer than the test's two Ctrl-C, 0.3 s apart.
    if behaviour == "stuck-transform":
        # Every reader's transform sleeps forever: next() waits, and the test kills this trainer.
        loader = ShmDataLoader(fields, batch_size=4, readers=2, slots=4, transform="transform_fixtures:hangs")
        print(json.dumps({"readers": loader.diagnostics.reader_pids, "segment": loader.diagnostics.ring_name}), flush=True)
        next(loader)
        return
    if behaviour == "die-after-build":
        # SIGKILLed as soon as its loader exists: its fork server may still be starting,
        # and no reader may have been forked yet.
        loader = ShmDataLoader(fields, batch_size=16, readers=2, slots=4)
        print(json.dumps({"readers": [], "segment": loader.diagnostics.ring_name}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    loader = ShmDataLoader(fields, batch_size=16, readers=2, slots=4)
    next(loader)
    print(json.dumps({"readers": loader.diagnostics.reader_pids, "segment": loader.diagnostics.ring_name}), flush=True)
    if behaviour == "exit-without-close":
        return
    if behaviour == "iterate":
        with loader:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                next(loader)
                time.sleep(0.001)
    if behaviour == "sleep":
        time.sleep(60)
    if behaviour == "close-while-waiting":
        # One thread blocks in next() (readers stopped) while another closes the loader.
        for pid in loader.diagnostics.reader_pids:
            os.kill(pid, signal.SIGSTOP)
        outcome = []

        def iterate() -> None:
            try:
                while True:
                    next(loader)
            except RuntimeError as error:
                outcome.append(str(error))

        thread = threading.Thread(target=iterate)
        thread.start()
        time.sleep(0.5)
        loader.close()
        thread.join(10)
        print(json.dumps({"alive": thread.is_alive(), "outcome": outcome}), flush=True)
    if behaviour == "close-with-stopped-readers":
        # close() then waits for its stopped readers; the test interrupts it meanwhile.
        for pid in loader.diagnostics.reader_pids:
            os.kill(pid, signal.SIGSTOP)
        print("closing", flush=True)
        loader.close()
        print("closed", flush=True)
        time.sleep(60)
    if behaviour == "exec":
        # The same pid runs another program: ppid checks alone would never notice.
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"])
    if behaviour == "stall":
        # Readers stopped: once the ring's ready batches are used up, next() blocks in its wait.
        for pid in loader.diagnostics.reader_pids:
            os.kill(pid, signal.SIGSTOP)
        print("stalled", flush=True)
        with loader:
            while True:
                next(loader)


if __name__ == "__main__":
    main()
