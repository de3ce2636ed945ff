"""The exceptions and warnings shmloader raises, in one place so users can catch them."""

from __future__ import annotations

import builtins
import functools
import os
import sys

_PACKAGE_DIRECTORY = os.path.dirname(os.path.abspath(__file__))


class ShmLoaderError(Exception):
    """Base class of every error shmloader raises on purpose."""


class StorageError(ShmLoaderError, ValueError):
    """A data file is unusable: wrong format, corrupted, truncated, or of an unsupported dtype."""


class RemoteError(StorageError):
    """An object in a store cannot be read: missing, refused, unreachable past the retries,
    or changed since the loader described it. Never a bad record: on_error="skip" does not
    replace it."""


class CacheError(RemoteError):
    """The node cache cannot hold or vouch for an object: its directory is not its user's
    own (another owner, writable by others, a link planted in it), or its file system is
    full. A RemoteError, so on_error="skip" never takes it for a bad record."""


class ReaderError(ShmLoaderError, RuntimeError):
    """A reader process failed: it raised (original type, message and traceback are kept) or died.

    Attributes: reader_index, pid, exit_code (negative: killed by that signal), step (or
    None), original_type (the reader's exception class name, or None), traceback_text.
    """

    def __init__(
        self,
        message: str,
        *,
        reader_index: int | None = None,
        pid: int | None = None,
        exit_code: int | None = None,
        step: int | None = None,
        original_type: str | None = None,
        traceback_text: str = "",
    ) -> None:
        super().__init__(message)
        self.reader_index = reader_index
        self.pid = pid
        self.exit_code = exit_code
        self.step = step
        self.original_type = original_type
        self.traceback_text = traceback_text


@functools.cache
def reader_error_type(module: str, name: str) -> type:
    """The class the trainer raises for a reader's exception of type `module.name`: a
    ReaderError that is also that type where it can be had, so that a ValueError raised in
    a transform is caught by `except ValueError` (as PyTorch's ExceptionWrapper.reraise
    keeps the worker's type) and still by `except ReaderError`. Only builtins and classes
    of modules the trainer has imported already: a report read from shared memory must not
    make the trainer import code. A type that cannot be combined with RuntimeError (an
    instance layout conflict) stays plain ReaderError, with its name in original_type."""
    if module == "builtins":
        candidate = getattr(builtins, name, None)
    else:
        candidate = getattr(sys.modules.get(module), name, None) if module in sys.modules else None
    if not isinstance(candidate, type) or not issubclass(candidate, Exception) or issubclass(candidate, ReaderError):
        return ReaderError
    try:
        # The message as it is written: KeyError's own str() is the repr of its argument
        # (the report's newlines as \n on one line), others format attributes it lacks.
        return type(name, (ReaderError, candidate), {"__module__": "shmloader.errors", "__str__": BaseException.__str__,
                                                     "__qualname__": f"ReaderError.{name}"})
    except TypeError:  # An instance layout conflict.
        return ReaderError


class TransformError(ShmLoaderError, ValueError):
    """A transform that cannot be used as given (refused at construction), or one whose
    call failed in a reader (the loader raises ReaderError carrying it)."""


class SlotsExhaustedError(ShmLoaderError, RuntimeError):
    """The trainer holds the slot the next batch needs and did not release it in time."""


class StepTimeoutError(ShmLoaderError, TimeoutError):
    """A step stayed in flight past the loader's step_timeout (a stuck transform, a stalled
    file system). Attributes: step, reader_index and pid of the reader filling it (or None)."""

    def __init__(self, message: str, step: int, reader_index: int | None = None, pid: int | None = None) -> None:
        super().__init__(message)
        self.step, self.reader_index, self.pid = step, reader_index, pid


class SharedMemoryError(ShmLoaderError, OSError):
    """The shared-memory ring cannot be created (no room in /dev/shm) or is corrupted."""


class DeviceError(ShmLoaderError, RuntimeError):
    """The GPU path is unavailable (no CUDA here) or a device call failed."""


class NodeBudgetError(ShmLoaderError, OSError):
    """The node's reader budget record in /dev/shm cannot be used: not a regular file of
    this user, not one this shmloader wrote, full, or its lock held past the wait. The loader
    runs on without the budget (NodeBudgetWarning, stats()["node_budget"]["error"])."""


class NodeBudgetWarning(RuntimeWarning):
    """A loader runs without the node's reader budget: the record's error says why."""


class PerformanceWarning(UserWarning):
    """A file's layout makes random row reads much slower than it needs to be."""


class SkippedRecordsWarning(UserWarning):
    """on_error="skip" replaced records that failed to read or transform (once per loader;
    stats()["skipped"] counts and names them)."""


class ReaderStallWarning(RuntimeWarning):
    """One step has been in flight for a long time: a reader is stopped or its files stall."""


class ReaderRestartWarning(RuntimeWarning):
    """A reader died (a signal, an exit) and was restarted: names the signal, the step it was
    filling and its restart count against max_reader_restarts."""


def user_stacklevel() -> int:
    """The stacklevel that makes a warning point at the first frame outside this package."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _in_package(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def _in_package(filename: str) -> bool:
    directory = os.path.dirname(os.path.abspath(filename))
    return directory == _PACKAGE_DIRECTORY or directory.startswith(_PACKAGE_DIRECTORY + os.sep)
