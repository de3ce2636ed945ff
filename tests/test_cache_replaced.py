"""A copy's files removed, replaced or made anew while some process of the node still has
the copy open: no loader reads bytes that the stamps it reads by did not vouch for (zeros
where a copy made anew had its bytes given back), and a loader that fails to start, or
whose cache directory was removed and made again, leaves no file of the cache open.
Every loader's rows are compared with the uploaded array, read back from its own .npy.
Against moto's S3 server on 127.0.0.1, as test_object_store.py."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("moto.server")
pytest.importorskip("obstore")
pytest.importorskip("boto3")

from conftest import child_environment  # noqa: E402
from test_object_store import serving  # noqa: E402

from shmloader import ShmDataLoader  # noqa: E402
from shmloader.errors import CacheError  # noqa: E402
from shmloader.remote.pages import CACHE_PAGE_BYTES  # noqa: E402

# Children run here, outside the checkout: its source would shadow an installed package (CI).
HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.xdist_group("object_store")

# Rows per batch: 20 batches of 1,000 rows, a pass of 160 KB, fetched whole by the first pass.
_BATCH_ROWS, _ROWS = 1000, 20_000
# A child trainer reads the object in well under this; past it the test fails, not hangs.
_CHILD_SECONDS = 60


@pytest.fixture(scope="module")
def server():
    with serving() as found:
        yield found


def _upload_rows(server, tmp_path, key: str) -> tuple[str, str]:
    """(the local .npy the rows are compared with, the URL of its upload)."""
    values = np.random.default_rng(len(key)).integers(0, 1 << 62, size=_ROWS, dtype=np.int64)
    reference = str(tmp_path / f"{os.path.basename(key)}.reference.npy")
    np.save(reference, values)
    return reference, server.upload(reference, key)


def _loader(url: str, cache, **kwargs) -> ShmDataLoader:
    return ShmDataLoader({"x": url}, cache_dir=cache, batch_size=_BATCH_ROWS, mode="sequential",
                         **{"readers": 0, "epochs": 1, **kwargs})


def _read_all(url: str, cache) -> np.ndarray:
    with _loader(url, cache) as loader:
        return np.concatenate([np.array(batch["x"]) for batch in loader])


def _copy_of(cache, url: str) -> str:
    (path,) = glob.glob(os.path.join(str(cache), "objects", "*", "*", os.path.basename(url)))
    return path


def _open_under(root) -> list[str]:
    """The files under `root` that this process holds open (removed ones too)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # The listing's own descriptor, closed since.
            continue
        if target.startswith(os.path.join(str(root), "")):
            found.append(target)
    return found


def _damage(path: str, what: str) -> None:
    """What an edit by hand does to one of a copy's files between runs."""
    if what == "pages file removed":
        os.unlink(path + ".pages")
    elif what == "marker damaged":
        with open(path + ".remote.json", "w") as handle:
            handle.write("{not json")
    else:
        raise AssertionError(what)


_CHILD_TRAINER = textwrap.dedent("""
    import sys
    import warnings
    from shmloader import ShmDataLoader
    url, cache = sys.argv[1:]
    warnings.simplefilter("ignore")  # A damaged marker is named in a warning: expected here.
    # Started, not iterated: the copy is made anew and its header fetched, and no more (a
    # pass over it would write every page again, the bytes the running loader needs).
    with ShmDataLoader({"x": url}, cache_dir=cache, batch_size=1000, mode="sequential", readers=0,
                       epochs=1) as loader:
        pass
""")


@pytest.mark.parametrize("what", ["pages file removed", "marker damaged"])
@pytest.mark.parametrize("readers", [0, 2])
def test_a_copy_made_anew_by_another_trainer_leaves_a_running_loader_reading_the_right_rows(
        server, tmp_path, readers, what):
    reference, url = _upload_rows(server, tmp_path, f"replaced/running-{readers}-{what.split()[0]}.npy")
    values, cache = np.load(reference), tmp_path / "cache"
    with _loader(url, cache, readers=readers, epochs=2) as loader:
        batches = iter(loader)
        first = np.concatenate([np.array(next(batches)["x"]) for _ in range(_ROWS // _BATCH_ROWS)])
        np.testing.assert_array_equal(first, values)  # Every page fetched and verified in this run.
        _damage(_copy_of(cache, url), what)
        # Another trainer of the node (its own process) makes the copy anew and reads it.
        child = subprocess.run([sys.executable, "-c", _CHILD_TRAINER, url, str(cache)],
                               env=child_environment(), cwd=HERE, capture_output=True, text=True,
                               timeout=_CHILD_SECONDS)
        assert child.returncode == 0, child.stderr[-3000:]
        # The copy it found vouched for nothing: made anew, its pages absent but the header's.
        path = _copy_of(cache, url)
        stamps = np.fromfile(path + ".pages", dtype=np.uint32, count=-(-os.path.getsize(path) // CACHE_PAGE_BYTES))
        assert (stamps == 0).sum() > len(stamps) // 2, stamps
        second = np.concatenate([np.array(batch["x"]) for batch in batches])
    np.testing.assert_array_equal(second, values)


def test_a_pages_file_removed_while_the_process_holds_the_cache_is_made_anew_and_read_right(server, tmp_path):
    reference, url = _upload_rows(server, tmp_path, "replaced/held.npy")
    other_reference, other_url = _upload_rows(server, tmp_path, "replaced/other.npy")
    cache = tmp_path / "cache"
    # Another loader of this process keeps its view of the cache (and the copies it opened) open.
    with _loader(other_url, cache) as keeper:
        np.testing.assert_array_equal(_read_all(url, cache), np.load(reference))
        os.unlink(_copy_of(cache, url) + ".pages")  # The remedy an error names for a bad pages file.
        np.testing.assert_array_equal(_read_all(url, cache), np.load(reference))
        np.testing.assert_array_equal(np.concatenate([np.array(batch["x"]) for batch in keeper]),
                                      np.load(other_reference))


@pytest.mark.parametrize("planted", [".pages", ""])
def test_a_loader_that_fails_to_start_leaves_no_file_of_the_cache_open(server, tmp_path, planted):
    reference, url = _upload_rows(server, tmp_path, f"replaced/failing{planted or '.data'}.npy")
    cache = tmp_path / "cache"
    np.testing.assert_array_equal(_read_all(url, cache), np.load(reference))
    assert not _open_under(cache)
    path = _copy_of(cache, url) + planted
    os.unlink(path)
    os.mkdir(path)
    with pytest.raises(CacheError, match="is a directory where the node cache keeps a file"):
        _loader(url, cache)
    assert not _open_under(cache)
    os.rmdir(path)
    np.testing.assert_array_equal(_read_all(url, cache), np.load(reference))
    assert not _open_under(cache)


def test_a_cache_directory_removed_and_made_again_under_a_loader_leaves_no_file_open(server, tmp_path):
    reference, url = _upload_rows(server, tmp_path, "replaced/removed.npy")
    values, cache = np.load(reference), tmp_path / "cache"
    with _loader(url, cache, epochs=2) as running:
        batches = iter(running)
        np.testing.assert_array_equal(np.array(next(batches)["x"]), values[:_BATCH_ROWS])
        shutil.rmtree(cache)
        np.testing.assert_array_equal(_read_all(url, cache), values)  # Its own copy, in the new directory.
        rest = np.concatenate([np.array(batch["x"]) for batch in batches])
    # The running loader read on from the copy it had open, its files removed.
    np.testing.assert_array_equal(rest, np.concatenate([values[_BATCH_ROWS:], values]))
    assert not _open_under(cache)
