"""LoaderOptions: every setting checked once, each limit at its boundary, the error naming
the setting; the samplers share the same limits."""

from __future__ import annotations

import numpy as np
import pytest

from shmloader import ShmDataLoader
from shmloader.plan import options as limits
from shmloader.plan.options import LoaderOptions
from shmloader.plan.sampler import Sampler
from shmloader.plan.sources import MixtureSampler

INTEGER_BOUNDS = [
    ("batch_size", 1, limits.BATCH_SIZE_MAX),
    ("seed", 0, limits.SEED_MAX),
    ("readers", 0, limits.READERS_MAX),
    ("slots", limits.SLOTS_MIN, limits.SLOTS_MAX),
    ("start_step", 0, limits.STEP_MAX),
    ("shard_count", 1, limits.SHARD_COUNT_MAX),
    ("max_reader_restarts", 0, limits.RESTARTS_MAX),
    ("epochs", 1, limits.EPOCHS_MAX),
    ("shuffle_window", 1, limits.LENGTH_MAX),
]


@pytest.mark.parametrize("name,low,high", INTEGER_BOUNDS, ids=[bound[0] for bound in INTEGER_BOUNDS])
def test_each_integer_setting_is_taken_at_its_bounds_and_refused_past_them(name, low, high):
    for value in (low, high):
        assert getattr(LoaderOptions(**{name: value}), name) == value
        assert type(getattr(LoaderOptions(**{name: np.int64(value) if value < 1 << 63 else value}), name)) is int
    for value in (low - 1, high + 1):
        with pytest.raises(ValueError, match=name):
            LoaderOptions(**{name: value})
    for value in (True, 1.0, "1"):
        with pytest.raises(TypeError, match=name):
            LoaderOptions(**{name: value})


def test_the_other_settings_are_refused_by_name():
    cases = [
        (dict(mode="shufle"), ValueError, "mode"),
        (dict(shard_index=2, shard_count=2), ValueError, "shard_index"),
        (dict(shuffle_window=10, mode="random"), ValueError, "shuffle_window applies"),
        (dict(hold_timeout=0), ValueError, "hold_timeout"),
        (dict(step_timeout=-1.0), ValueError, "step_timeout"),
        (dict(hold_timeout=True), ValueError, "hold_timeout"),
        (dict(on_error="ignore"), ValueError, "on_error"),
        (dict(transform_args={"a": 1}), TypeError, "transform_args given without a transform"),
        (dict(transform="x:y", transform_args=[1]), TypeError, "transform_args must be a dict"),
        (dict(remote=object()), TypeError, "remote must be remote readers"),
        (dict(cache_dir=3), TypeError, "cache_dir"),
        (dict(cache_bytes=limits.CACHE_BYTES_MIN - 1), ValueError, "cache_bytes"),
        (dict(cache_bytes=True), ValueError, "cache_bytes"),
        (dict(storage_options=[("a", "b")]), TypeError, "storage_options"),
    ]
    for settings, error, match in cases:
        with pytest.raises(error, match=match):
            LoaderOptions(**settings)
    assert LoaderOptions(cache_bytes=limits.CACHE_BYTES_MIN).cache_bytes == limits.CACHE_BYTES_MIN
    assert LoaderOptions(hold_timeout=1).hold_timeout == 1.0


def test_the_loader_refuses_a_setting_before_reading_any_file(tmp_path):
    with pytest.raises(ValueError, match="cache_bytes"):  # Even for local files, which use no cache.
        ShmDataLoader(str(tmp_path / "missing.npy"), cache_bytes=1)
    with pytest.raises(ValueError, match="batch_size"):
        ShmDataLoader(str(tmp_path / "missing.npy"), batch_size=limits.BATCH_SIZE_MAX + 1)


def test_the_samplers_share_the_loaders_limits():
    assert limits.LENGTH_MAX == 1 << 62  # zig/permutation.zig's length_max, read from the library.
    Sampler(limits.LENGTH_MAX, limits.BATCH_SIZE_MAX, "shuffle", limits.SEED_MAX)
    for settings in (dict(length=limits.LENGTH_MAX + 1), dict(batch_size=limits.BATCH_SIZE_MAX + 1),
                     dict(seed=limits.SEED_MAX + 1), dict(shard_count=limits.SHARD_COUNT_MAX + 1)):
        arguments = {"length": 10, "batch_size": 2, **settings}
        with pytest.raises(ValueError, match=next(iter(settings))):
            Sampler(**arguments)
    with pytest.raises(ValueError, match="batch_size"):
        MixtureSampler([10, 10], [1, 1], [1.0, 1.0], [False, False], limits.BATCH_SIZE_MAX + 1)


def test_a_mixture_takes_as_many_sources_as_the_native_fill_holds():
    assert limits.SOURCES_MAX == 256  # zig/mixture.zig's sources_max, read from the library.
    for count, fits in ((limits.SOURCES_MAX, True), (limits.SOURCES_MAX + 1, False)):
        arguments = ([10] * count, [1] * count, [1.0] * count, [False] * count, 8)
        if fits:
            MixtureSampler(*arguments).fill(0)
        else:
            with pytest.raises(ValueError, match="a mixture has 1 to 256 sources"):
                MixtureSampler(*arguments)


@pytest.mark.parametrize("name", ["drop_last", "verify", "warn_layout"])
def test_a_yes_or_no_setting_refuses_what_is_not_a_bool_naming_it(name):
    """bool("False") is True: a flag read from a configuration file as a string would
    silently mean its opposite (drop_last="False" dropped the last partial batch)."""
    for value, expected in ((True, True), (False, False), (np.bool_(True), True), (1, True), (0, False)):
        assert getattr(LoaderOptions(**{name: value}), name) is expected
    for value in ("False", "no", "", None, [0], 2, 0.0):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            LoaderOptions(**{name: value})


@pytest.mark.parametrize("files", [[], ()])
def test_a_field_of_an_empty_list_is_refused_as_empty(files, tmp_path):
    np.save(tmp_path / "y.npy", np.arange(4))
    with pytest.raises(ValueError, match="field 'x': an empty list of files"):
        ShmDataLoader({"x": files, "y": str(tmp_path / "y.npy")}, batch_size=2, readers=0)
