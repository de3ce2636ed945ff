"""The trainer's configuration pipe into a reader (the reader's stdin), both ends, and what
crosses it (ReaderConfig).

The trainer writes one line of JSON per message and keeps its end open: the reader's
ReaderConfig when it starts, then a new filler whenever the loader fills with another
sampler (a finite pass started again under a new seed: the drop-in's next epoch; a
resharded checkpoint's dealing). A live reader takes the new filler in place, keeping its
interpreter, its imports and its loaded dataset; replacing the process cost about a second
per epoch (an interpreter importing torch and the dataset again).

The order that makes it exact: the trainer writes the new filler only once every slot is
taken back (no reader is filling), and requests slots only after the whole line is written;
a reader looks at the pipe after each claim, so the first step it fills after the change is
filled with the new filler. A line larger than the pipe's buffer waits for the reader to
drain it (an idle reader looks at the pipe every poll interval); a reader that does not
within ReaderPool.reconfigure_timeout_seconds (stopped, stuck) is replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import sys
import time

from ..fill.filler import FillerSpec
from ..ring.layout import RingLayout, RingNames

# What a trainer that gives up before configuring its readers sends them instead of a
# configuration: they exit at once. Plain EOF means the trainer may have died (reader.main).
STOP_MESSAGE = b"stop"
# What the trainer sends a configured reader it no longer needs (readers="auto" retiring
# one: readers/elastic.py): it finishes the step it has claimed, if any, and exits with 0.
RETIRE_MESSAGE = b"retire"
_CHUNK = 1 << 20

# How long a reader outlives a termination signal while its trainer lives on (by default:
# ReaderConfig.signal_grace_seconds, which ReaderPool.signal_grace_seconds sets).
SIGNAL_GRACE_SECONDS = 3.0


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    """Everything a reader is told, as the trainer sends it (JSON on the reader's stdin):
    its ring and what its step filler is built from."""

    reader_index: int
    trainer_pid: int
    names: RingNames
    layout: RingLayout
    filler: FillerSpec
    signal_grace_seconds: float = SIGNAL_GRACE_SECONDS
    # The loader's local readers: they share this machine's page cache, and the read-ahead's
    # dropping of finished blocks among them (storage/readahead.ReadAhead's `share`).
    local_readers: int = 1
    # The trainer's working directory and sys.path (absolute) when it made the loader: a
    # reader enters them before it loads anything (enter_trainer_context), so that a dataset
    # opening "data/text.txt" or importing a module beside the script finds what the trainer
    # would, as a worker forked by torch's DataLoader does. A reader starts in "/" (its
    # interpreter's own start-up must not import from a source checkout there).
    working_directory: str = "/"
    sys_path: tuple[str, ...] = ()

    def to_json(self, filler_json: str | None = None) -> str:
        """The JSON a reader reads; `filler_json` is json.dumps(self.filler.to_dict()) when
        the caller has it already (the same for every reader of a loader, and large for a
        field of many files)."""
        head = json.dumps({
            "reader_index": self.reader_index,
            "trainer_pid": self.trainer_pid,
            "names": self.names.to_dict(),
            "layout": self.layout.to_dict(),
            "signal_grace_seconds": self.signal_grace_seconds,
            "local_readers": self.local_readers,
            "working_directory": self.working_directory,
            "sys_path": list(self.sys_path),
        })
        filler = json.dumps(self.filler.to_dict()) if filler_json is None else filler_json
        return f'{head[:-1]}, "filler": {filler}}}'

    @classmethod
    def from_json(cls, text: str) -> ReaderConfig:
        data = json.loads(text)
        return cls(
            reader_index=data["reader_index"],
            trainer_pid=data["trainer_pid"],
            names=RingNames.from_dict(data["names"]),
            layout=RingLayout.from_dict(data["layout"]),
            filler=FillerSpec.from_dict(data["filler"]),
            signal_grace_seconds=float(data["signal_grace_seconds"]),
            local_readers=int(data["local_readers"]),
            working_directory=str(data.get("working_directory", "/")),
            sys_path=tuple(str(entry) for entry in data.get("sys_path", ())),
        )


def trainer_context() -> dict:
    """ReaderConfig's working_directory and sys_path, as this process has them now; "/"
    where its working directory is gone (deleted under it), as a reader had it before."""
    try:
        working_directory = os.getcwd()
    except OSError:
        working_directory = "/"
    return {"working_directory": working_directory,
            "sys_path": tuple(os.path.abspath(entry) for entry in sys.path)}


def enter_trainer_context(config: ReaderConfig) -> None:
    """Makes this reader's working directory and sys.path the trainer's (ReaderConfig). The
    trainer's entries come first, in its order, so that a module name resolves as it does
    there; the reader's own follow (where this package was found), but not "" (the working
    directory, which the trainer's path holds only where it held it)."""
    try:
        os.chdir(config.working_directory)
    except OSError as error:
        raise OSError(f"reader {config.reader_index} cannot enter the trainer's working directory "
                      f"{config.working_directory!r} ({error.strerror}): a dataset or transform opening a relative "
                      f"path would not find it; give the loader's process a working directory its readers may "
                      f"enter") from None
    trainer = list(config.sys_path)
    sys.path[:] = trainer + [entry for entry in sys.path if entry and entry not in trainer]


def send_line(stream, text: str) -> None:
    """Writes `text` as one message on a reader's pipe (`stream`: its stdin, ours to write),
    waiting as long as the reader takes to read it; raises BrokenPipeError when the reader
    is gone."""
    if send_to_all([stream], text, None):
        raise BrokenPipeError(f"the reader's pipe {stream.fileno()} is closed")


def send_to_all(streams: list, text: str, timeout_seconds: float | None) -> list[int]:
    """Writes `text` as one message on every pipe of `streams` at once; the positions of
    those not written whole within `timeout_seconds` (None: no limit) (a reader stopped, or
    stuck where it does not look at its pipe, while the line is longer than the pipe holds)
    or whose reader is gone. Their readers must be replaced: a part of a line is on their
    pipe."""
    assert "\n" not in text, "a message is one line (json.dumps writes none)"
    data = text.encode() + b"\n"
    written = {}
    for position, stream in enumerate(streams):
        stream.flush()
        os.set_blocking(stream.fileno(), False)
        written[stream.fileno()] = (position, 0)
    poller = select.poll()
    for descriptor in written:
        poller.register(descriptor, select.POLLOUT)
    failed = []
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    try:
        while written:
            for descriptor, (position, done) in list(written.items()):
                try:
                    done += os.write(descriptor, data[done:])
                except BlockingIOError:
                    pass
                except OSError:  # The reader is gone (EPIPE).
                    failed.append(position)
                    done = len(data)
                if done == len(data):
                    del written[descriptor]
                    poller.unregister(descriptor)
                else:
                    written[descriptor] = (position, done)
            remaining = None if deadline is None else deadline - time.monotonic()
            if written and remaining is not None and remaining <= 0:
                failed += [position for position, _ in written.values()]
                break
            if written:
                poller.poll(None if remaining is None else max(1, int(remaining * 1000)))
    finally:
        for stream in streams:
            with contextlib.suppress(OSError, ValueError):
                os.set_blocking(stream.fileno(), True)
    return sorted(failed)


class ConfigChannel:
    """The reader's end: its first message, then whether a newer one came."""

    def __init__(self, descriptor: int = 0) -> None:
        self.descriptor = descriptor
        self.open = True  # Until EOF: the trainer closed its end (it is closing, or died).
        self._pending: list[bytes] = []  # Whole messages read but not yet taken.
        self._poll = select.poll()
        self._poll.register(descriptor, select.POLLIN)

    def first(self) -> bytes:
        """The first message, waiting for it: the configuration, STOP_MESSAGE, or b"" at
        EOF (the trainer gave up, or died, before configuring this reader)."""
        self._pending += self._read_lines()
        return self._pending.pop(0) if self._pending else b""

    def latest(self) -> bytes | None:
        """The newest whole message sent since the last call, or None; never waits for a
        message that has not begun (one that has is read to its end)."""
        while self.open and self._poll.poll(0):
            self._pending += self._read_lines()
        newest = self._pending[-1] if self._pending else None
        self._pending.clear()
        return newest

    def _read_lines(self) -> list[bytes]:
        """Reads until the data ends a line, or to EOF; the whole lines read. The trainer
        writes each line in one piece, so a line begun is finished soon."""
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(self.descriptor, _CHUNK)
            if not chunk:  # EOF: a partial last line (a trainer that died writing it) is no message.
                self.open = False
                self._poll.unregister(self.descriptor)
                whole, _, rest = data.rpartition(b"\n")
                if not whole and rest == STOP_MESSAGE:
                    return [STOP_MESSAGE]
                return whole.split(b"\n") if whole else []
            data += chunk
        return data[:-1].split(b"\n")
