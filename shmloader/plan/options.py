"""Every setting of a loader, checked once (LoaderOptions), and every limit as one named
constant that the loader, the samplers and the native side share.

The samplers check their arguments too (they are built from dicts in each reader), but
against these constants: a bound has one value wherever it is checked.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import numbers
import os

import numpy as np

from .._native import lib
from ..remote.pages import CACHE_PAGE_BYTES
from .defaults import cpu_budget_cap, default_readers, local_trainers, node_budget

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
# Rows a sampler may index: zig/permutation.zig's length_max (its Feistel domain, one bit above
# the row count, must fit the 64-bit round function), read from the library itself.
LENGTH_MAX = int(lib.shm_length_max())
# Steps are 64-bit everywhere (the ring's control words, the samplers' positions).
STEP_MAX = U64_MAX
# A batch's rows: the slot's index array and a row count per region are sized by it, and a
# ring of a few slots must fit /dev/shm; 16 M rows is far past any batch that does.
BATCH_SIZE_MAX = 1 << 24
# The most sources a mixture may have: zig/mixture.zig keeps a cache per source on its
# stack; read from the library.
SOURCES_MAX = int(lib.shm_sources_max())
# Shards are u32 in the sampler's configuration (zig/sampler.zig SamplerConfig).
SHARD_COUNT_MAX = U32_MAX
SEED_MAX = U64_MAX
# Reader processes per loader: each maps every field, and the ring keeps a record each.
READERS_MAX = 256
# Ray actors a loader may have (RayReaders); each takes a reader record after the readers'.
ACTORS_MAX = 4096 - READERS_MAX
READER_RECORDS_MAX = READERS_MAX + ACTORS_MAX
# Slots: two at least (the batch in use and the next); 4096 semaphores at most per ring.
SLOTS_MIN, SLOTS_MAX = 2, 4096
RESTARTS_MAX = 1 << 20
EPOCHS_MAX = 1 << 32
# The node cache needs a few fetch units of pages to make progress.
CACHE_BYTES_MIN = 16 * CACHE_PAGE_BYTES

MODES = {"sequential": 0, "random": 1, "shuffle": 2}
ON_ERROR = ("raise", "skip")


def check_integer(name: str, value, minimum: int, maximum: int) -> int:
    """Returns `value` as an int, or raises naming the argument, the value and the range."""
    if type(value) is int and minimum <= value <= maximum:
        return value  # The common case, without the slower abstract-class check below.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}")
    value = int(value)
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return value


def check_flag(name: str, value) -> bool:
    """A yes or no: a bool (numpy's too) or the integers 0 and 1. Anything else raises
    naming the setting: bool("False") is True, and a setting read from a configuration
    file as a string would silently mean its opposite."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r} of type {type(value).__name__}")


def check_seconds(name: str, value) -> float:
    """A positive number of seconds, or a ValueError naming the setting."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_mode(mode) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    return mode


def check_shard(shard_index, shard_count) -> tuple[int, int]:
    shard_count = check_integer("shard_count", shard_count, 1, SHARD_COUNT_MAX)
    shard_index = check_integer("shard_index", shard_index, 0, SHARD_COUNT_MAX)
    if shard_index >= shard_count:
        raise ValueError(f"shard_index must be in [0, shard_count - 1] = [0, {shard_count - 1}], got {shard_index}")
    return shard_index, shard_count


def check_window(shuffle_window, mode: str) -> int | None:
    if shuffle_window is None:
        return None
    shuffle_window = check_integer("shuffle_window", shuffle_window, 1, LENGTH_MAX)
    if mode != "shuffle":
        raise ValueError(f"shuffle_window applies to mode='shuffle' only, got mode={mode!r}")
    return shuffle_window


def _auto(name: str, value: str) -> dict:
    """Checks the one word a count setting takes besides a number; {} (AutoReaders' defaults)."""
    if value != "auto":
        raise TypeError(f"{name} must be an integer or \"auto\", got {value!r} of type str")
    return {}


# Readers past the node's budget an auto loader may earn (readers/earned.py): one, so that its
# ring keeps a record for it, and a trial at a time adds it where half a core sits idle.
EARNED_READERS_MOST = 1


@dataclasses.dataclass(frozen=True)
class AutoReaders:
    """readers="auto" with its bounds: the loader starts `start` readers and adds or retires
    them while it runs (readers/autotune.py), between `least` and `most`; the ring keeps a
    reader record for each of `most`. None: `most` the node's reader budget (plan/defaults.
    node_budget: the loaders of every rank share it, readers/node_budget.py; `start` where that
    is more) and one more, which a trial may earn past the budget where the node's measured
    CPU has room for it (readers/earned.py), at most READERS_MAX; `start` the fixed default
    (default_readers) or the budget's equal part among the node's trainers where that is
    less, at least `least`. The loader starts as many of `start` as the budget has room for
    beside the node's other loaders, and its `least` where there is none
    (readers/budget_record.NodeShare.join)."""

    start: int | None = None
    least: int = 1
    most: int | None = None

    def __post_init__(self) -> None:
        check_integer("AutoReaders.least", self.least, 1, READERS_MAX)
        if self.most is not None:
            check_integer("AutoReaders.most", self.most, self.least, READERS_MAX)
        if self.start is not None:
            check_integer("AutoReaders.start", self.start, self.least,
                          READERS_MAX if self.most is None else self.most)

    def resolve(self) -> tuple[int, int, int]:
        """(start, least, most) on this node."""
        budget = node_budget()
        earned = 0 if cpu_budget_cap() is not None else EARNED_READERS_MOST  # A cap the user set holds.
        # The budget is the node's (SHMLOADER_CPU_BUDGET, or 300 cores' less the trainers): one
        # loader's readers stay within READERS_MAX, the bound readers=N is held to.
        most = (min(READERS_MAX, max(self.least, self.start or 0, budget + earned)) if self.most is None
                else self.most)
        if self.start is None:  # Every rank starts at once: their starts together stay within the budget.
            equal_part = max(1, budget // local_trainers())
            return min(most, max(self.least, min(default_readers(), equal_part))), self.least, most
        return self.start, self.least, most


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """ShmDataLoader's settings past its fields, validated when made: each value normalised
    (ints as ints, seconds as floats) or a TypeError/ValueError naming the setting. What
    depends on the data (a window's blocks, the last step the sampler can compute) is
    checked by the plan; what depends on a library (a transform, pin_memory's backend,
    remote readers) where it is resolved."""

    batch_size: int = 256
    mode: str = "shuffle"
    seed: int = 0
    readers: object = None  # None: AutoReaders() (the default; with remote=, default_readers()); "auto", AutoReaders or a count
    slots: object = None  # None: plan/defaults.default_slots(); "auto": plan/defaults.auto_slots()
    start_step: int = 0
    shard_index: int = 0
    shard_count: int = 1
    max_reader_restarts: int = 3
    hold_timeout: float = 5.0
    warn_layout: bool = True
    verify: bool = True
    pin_memory: object = False
    transform: object = None
    transform_args: dict | None = None
    shuffle_window: int | None = None
    step_timeout: float | None = None
    epochs: int | None = None
    drop_last: bool = False
    on_error: str = "raise"
    remote: object = None
    cache_dir: object = None
    cache_bytes: int | None = None
    storage_options: dict | None = None
    audit_log: object = None  # a path (audit_log.py): what each rank delivered, for `shmloader audit`

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "batch_size", check_integer("batch_size", self.batch_size, 1, BATCH_SIZE_MAX))
        set_(self, "mode", check_mode(self.mode))
        set_(self, "seed", check_integer("seed", self.seed, 0, SEED_MAX))
        if self.readers is None and self.remote is None:  # The default: readers that size themselves.
            set_(self, "readers", AutoReaders())
        if isinstance(self.readers, str):
            set_(self, "readers", AutoReaders(**_auto("readers", self.readers)))
        elif self.readers is not None and not isinstance(self.readers, AutoReaders):
            set_(self, "readers", check_integer("readers", self.readers, 0, READERS_MAX))
        if isinstance(self.readers, AutoReaders) and self.remote is not None:
            raise ValueError("readers='auto' adds and retires local reader processes, and remote readers run where "
                             "their cluster places them, as many as the remote setting says: with remote readers give "
                             "readers= the number of local readers to run beside them (0 for none)")
        if isinstance(self.slots, str):
            _auto("slots", self.slots)
        elif self.slots is not None:
            set_(self, "slots", check_integer("slots", self.slots, SLOTS_MIN, SLOTS_MAX))
        set_(self, "start_step", check_integer("start_step", self.start_step, 0, STEP_MAX))
        shard_index, shard_count = check_shard(self.shard_index, self.shard_count)
        set_(self, "shard_index", shard_index)
        set_(self, "shard_count", shard_count)
        set_(self, "max_reader_restarts", check_integer("max_reader_restarts", self.max_reader_restarts, 0,
                                                        RESTARTS_MAX))
        set_(self, "hold_timeout", check_seconds("hold_timeout", self.hold_timeout))
        if self.step_timeout is not None:
            set_(self, "step_timeout", check_seconds("step_timeout", self.step_timeout))
        set_(self, "warn_layout", check_flag("warn_layout", self.warn_layout))
        set_(self, "verify", check_flag("verify", self.verify))
        if self.transform_args is not None:
            if self.transform is None:
                raise TypeError("transform_args given without a transform")
            if not isinstance(self.transform_args, collections.abc.Mapping):
                raise TypeError(f"transform_args must be a dict of the transform's keyword arguments, got "
                                f"{type(self.transform_args).__name__}")
        set_(self, "shuffle_window", check_window(self.shuffle_window, self.mode))
        if self.epochs is not None:
            set_(self, "epochs", check_integer("epochs", self.epochs, 1, EPOCHS_MAX))
        set_(self, "drop_last", check_flag("drop_last", self.drop_last))
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.remote is not None and not all(hasattr(self.remote, name) for name in ("start", "count", "capacity")):
            raise TypeError(f"remote must be remote readers such as shmloader.readers.ray.RayReaders(...), got "
                            f"{self.remote!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be a path, got {type(self.cache_dir).__name__}")
        if self.cache_bytes is not None and (isinstance(self.cache_bytes, bool) or
                                             not isinstance(self.cache_bytes, numbers.Integral) or
                                             self.cache_bytes < CACHE_BYTES_MIN):
            raise ValueError(f"cache_bytes must be an integer of at least {CACHE_BYTES_MIN} bytes (the node cache's "
                             f"budget), got {self.cache_bytes!r}")
        if self.audit_log is not None and not isinstance(self.audit_log, (str, os.PathLike)):
            raise TypeError(f"audit_log must be a path (\"{{rank}}\" in it is replaced by shard_index), got "
                            f"{type(self.audit_log).__name__}")
        if self.storage_options is not None and not isinstance(self.storage_options, collections.abc.Mapping):
            raise TypeError(f"storage_options must be a mapping of obstore S3 settings (endpoint, access_key_id, "
                            f"secret_access_key, region, ...), got {type(self.storage_options).__name__}")

    def __repr__(self) -> str:
        """The dataclass's repr with storage_options redacted (remote.redact_options): the
        options are printed in logs and errors, and credentials must never be."""
        from ..remote import redact_options

        shown = ", ".join(f"{field.name}={redact_options(value) if field.name == 'storage_options' else value!r}"
                          for field in dataclasses.fields(self) for value in (getattr(self, field.name),))
        return f"{type(self).__name__}({shown})"

    __str__ = __repr__
