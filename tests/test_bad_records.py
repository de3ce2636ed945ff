"""Bad records: on_error="skip" replaces a record whose read or transform fails by the next
good record of its batch, the same for any reader count and on resume, counts and names
it; on_error="raise" names the record (and its original file) in the error."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from conftest import examples, float_rows

from shmloader import ShmDataLoader, SkippedRecordsWarning
from shmloader.transforms import compute_batch

CURSED = "transform_fixtures:fails_on_row_seven"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return float_rows(tmp_path_factory, "bad_records", 64)


@pytest.mark.parametrize("readers", [0, 1, 2])
def test_a_failing_record_is_replaced_by_the_next_good_one_and_named(rows, readers):
    path, data = rows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ShmDataLoader({"data": path}, transform=CURSED, batch_size=16, mode="sequential", readers=readers,
                           on_error="skip", epochs=2) as loader:  # A finite pass: no step is filled past it.
            batches = [(np.array(batch.indices), np.array(batch["x"])) for batch in loader]
            stats = loader.stats()
    indices, x = batches[0]
    expected = np.arange(16)
    expected[7] = 8  # Row 7 fails; the next good record of its batch takes its place.
    np.testing.assert_array_equal(indices, expected)
    np.testing.assert_array_equal(x, data[expected])
    for step, (indices, x) in enumerate(batches[1:4], start=1):  # Rows 16.. are sound: untouched.
        np.testing.assert_array_equal(indices, np.arange(16 * step, 16 * step + 16))
    assert len(batches) == 8 and stats["skipped"]["count"] == 2  # Row 7 comes again at step 4.
    first = stats["skipped"]["records"][0]
    assert (first["step"], first["position"], first["row"]) == (0, 7, 7)
    assert "data.npy record 7" in first["where"] and "row seven is cursed" in first["error"]
    assert any(issubclass(w.category, SkippedRecordsWarning) for w in caught)
    reference = compute_batch({"data": path}, 0, CURSED, batch_size=16, mode="sequential", on_error="skip")
    np.testing.assert_array_equal(reference["indices"], expected)


def test_under_raise_the_error_names_the_record(rows):
    path, _ = rows
    with ShmDataLoader({"data": path}, transform=CURSED, batch_size=16, mode="sequential", readers=1) as loader:
        with pytest.raises(ValueError, match=r"fails on record\(s\) .*data.npy record 7"):
            next(loader)


def test_a_batch_that_fails_for_every_record_is_not_skipped(rows):
    path, _ = rows
    with ShmDataLoader({"data": path}, transform="transform_fixtures:returns_wrong_shape", batch_size=16, readers=1,
                       on_error="skip") as loader:
        with pytest.raises(ValueError, match="shape"):
            next(loader)


def broken_tree(root, count: int = 24) -> dict:
    """An ImageFolder tree of `count` JPEGs, one truncated and one corrupt (headers intact:
    only decoding finds them)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    files = {}
    for index in range(count):
        directory = root / f"class{index % 2}"
        directory.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        data = buffer.getvalue()
        if index == 5:
            data = data[:len(data) // 2]
        elif index == 14:
            data = data[:400] + bytes(rng.integers(0, 255, len(data) - 400, dtype=np.uint8))
        path = directory / f"{index:03d}.jpg"
        path.write_bytes(data)
        files[index] = path
    return files


def test_broken_images_are_listed_by_check_skipped_with_their_paths_and_named_under_raise(tmp_path):
    pytest.importorskip("PIL")
    from shmloader.tools.imagefolder import check_images, convert_images

    files = broken_tree(tmp_path / "images")
    bad = check_images(tmp_path / "images", workers=2, progress=False)
    assert [path for path, _ in bad] == sorted([str(files[5]), str(files[14])])
    paths = convert_images(tmp_path / "images", tmp_path / "photos", progress=False)
    fields = {"image": paths["image"], "label": paths["label"]}
    options = dict(transform="shmloader.transforms.images:train", transform_args={"size": 16}, batch_size=12,
                   mode="sequential", epochs=1)
    results = []
    for readers in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedRecordsWarning)
            with ShmDataLoader(fields, readers=readers, on_error="skip", **options) as loader:
                results.append([(np.array(batch.indices), np.array(batch["image"]), np.array(batch["label"]))
                                for batch in loader])
                skipped = loader.stats()["skipped"]
        assert skipped["count"] == 2
        named = " ".join(record["where"] for record in skipped["records"])
        assert str(files[5].resolve()) in named and str(files[14].resolve()) in named
    for (indices, images, labels), (indices2, images2, labels2) in zip(*results):  # The same for any reader count.
        np.testing.assert_array_equal(indices, indices2)
        np.testing.assert_array_equal(images, images2)
        np.testing.assert_array_equal(labels, labels2)
    order = [str(path) for path in sorted(files.values(), key=lambda p: (p.parent.name, p.name))]
    broken = {order.index(str(files[5])), order.index(str(files[14]))}
    delivered = np.concatenate([indices for indices, _, _ in results[0]])
    assert not broken & set(delivered.tolist()) and len(delivered) == 24
    with ShmDataLoader(fields, readers=1, **options) as loader:
        with pytest.raises(Exception, match=str(files[14].resolve()).replace(".", r"\.")):  # In step 0.
            list(loader)


def test_a_bad_ragged_record_is_found_even_beside_a_long_one(tmp_path):
    """The search repeats records to fill its probes: a long record repeated must not look
    bad for overflowing a packed region sized for the batch's own records."""
    from shmloader.tools.convert import write_ragged

    records = [np.full(3, i, dtype=np.int32) for i in range(32)]
    records[0] = np.ones(5000, dtype=np.int32)  # Long, and sound.
    records[9] = np.array([1, -1, 2], dtype=np.int32)  # Bad.
    write_ragged(tmp_path / "docs.ragged", records)
    with ShmDataLoader({"tokens": str(tmp_path / "docs.ragged")}, transform="transform_fixtures:refuses_negative_records",
                       batch_size=16, mode="sequential", epochs=1, readers=1, on_error="skip") as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SkippedRecordsWarning)
            totals = np.concatenate([np.array(batch["total"]) for batch in loader])
            skipped = loader.stats()["skipped"]
    assert [record["row"] for record in skipped["records"]] == [9]
    expected = [int(record.sum()) for record in records]
    expected[9] = expected[10]
    np.testing.assert_array_equal(totals, expected)


@pytest.mark.parametrize("on_error", ["skip", "raise"])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_a_transform_that_fails_on_every_record_is_reported_as_such(rows, on_error, batch_size):
    """Before: on_error='skip' raised IndexError (no good record to replace the bad ones
    with), and 'raise' blamed the batch's records one by one."""
    path, _ = rows
    with pytest.raises(ValueError, match=r"fails on every batch") as raised:
        compute_batch({"data": path}, 0, "transform_fixtures:always_fails", batch_size=batch_size,
                      mode="sequential", on_error=on_error)
    assert "fails on every record, not on a few bad ones" in str(raised.value) + "".join(
        getattr(raised.value, "__notes__", []))


# What on_error="skip" reports is what was delivered: the truth below is computed from the
# batches' own indices and sequential order (position p of the stream is row p % rows),
# never from the loader's counters.
REFUSES = "skip_fixtures:refuses_rows"


def delivered_skips(batches: list, row_count: int, batch_size: int, bad: set) -> list:
    """(step, position, row) of each bad record among the rows delivered, from the batches
    alone; asserts each bad one was replaced by a good row and the others left as read."""
    expected = []
    for step, indices in batches:
        for position, delivered in enumerate(indices):
            row = (step * batch_size + position) % row_count
            if row in bad:
                expected.append((step, position, row))
                assert delivered not in bad, (step, position, delivered)
            else:
                assert delivered == row, (step, position, delivered)
    return expected


def run_skipping(path: str, bad, batch_size: int, readers: int, epochs: int = 1) -> tuple[list, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedRecordsWarning)
        with ShmDataLoader({"data": path}, transform=REFUSES, transform_args={"bad": sorted(bad)},
                           batch_size=batch_size, mode="sequential", readers=readers, on_error="skip",
                           epochs=epochs) as loader:
            batches = [(batch.step, np.array(batch.indices).tolist()) for batch in loader]
            return batches, loader.stats()["skipped"]


def check_skipped(skipped: dict, expected: list) -> None:
    """`skipped` lists exactly the `expected` records, once each, each with its own error."""
    records = skipped["records"]
    assert [(record["step"], record["position"], record["row"]) for record in records] == expected
    assert skipped["count"] == len(records)
    for record in records:
        assert f"row {record['row']} is refused" in record["error"], record
        assert f"data.npy record {record['row']}" in record["where"], record


@pytest.fixture(scope="module")
def ten_rows(tmp_path_factory):
    return float_rows(tmp_path_factory, "ten_rows", 10)


@pytest.mark.parametrize("readers", [0, 1, 2])
def test_skipped_lists_the_delivered_bad_records_once_each_with_its_own_error(ten_rows, readers):
    """10 rows in batches of 4: step 0 holds the bad rows 1 and 2 (two in one batch, each
    refused with its own message); the last step keeps rows 8 and 9 and is computed with
    the next epoch's rows 0 and 1 after them, which are never delivered. Before: a phantom
    record at step 2, and row 2's record carried row 1's message."""
    path, _ = ten_rows
    batches, skipped = run_skipping(path, {1, 2}, 4, readers)
    assert [len(indices) for _, indices in batches] == [4, 4, 2]
    expected = delivered_skips(batches, 10, 4, {1, 2})
    assert expected == [(0, 1, 1), (0, 2, 2)]
    check_skipped(skipped, expected)


def test_a_bad_record_delivered_last_is_replaced_by_a_delivered_row(ten_rows):
    """Row 9 is the last row of the pass; the computed batch goes on with the next epoch's
    rows 0 and 1, which are not delivered: the replacement comes from the delivered rows."""
    path, _ = ten_rows
    batches, skipped = run_skipping(path, {9}, 4, 0)
    assert batches[-1] == (2, [8, 8])
    check_skipped(skipped, [(2, 1, 9)])


@pytest.mark.parametrize("readers", [0, 1, 2])
def test_a_cut_last_step_whose_delivered_rows_are_all_bad_is_filled_from_the_step_before(tmp_path_factory, readers):
    """3 rows in batches of 2, one epoch: the last step delivers row 2 alone and is
    computed as [2, 2], so no record of its batch reads. Before: the step failed ("every
    record fails on its own"); now row 2 is skipped and replaced by the step before's
    first good record. Found by the long hypothesis profile."""
    path, _ = float_rows(tmp_path_factory, "three_rows", 3)
    batches, skipped = run_skipping(path, {2}, 2, readers)
    assert batches == [(0, [0, 1]), (1, [0])]
    check_skipped(skipped, [(1, 0, 2)])


@pytest.mark.parametrize("bad, expected", [({0, 1}, [(0, [2, 2]), (1, [2, 3])]),
                                           ({2, 3}, [(0, [0, 1]), (1, [0, 0])])])
def test_a_whole_batch_of_bad_records_is_filled_from_the_step_beside_it(tmp_path_factory, bad, expected):
    """4 rows in batches of 2: a step whose two records both fail takes the first good
    record of the step before (after, for step 0) in their place."""
    path, _ = float_rows(tmp_path_factory, "four_rows", 4)
    batches, skipped = run_skipping(path, bad, 2, 1)
    assert batches == expected
    check_skipped(skipped, delivered_skips(batches, 4, 2, bad))


if examples is not None:
    from hypothesis import given
    from hypothesis import strategies as st

    @st.composite
    def skipping_cases(draw):
        row_count = draw(st.integers(2, 13))
        batch_size = draw(st.integers(2, row_count))
        # Some good row is left; a batch may hold none (a short one, or a cut last step).
        bad = draw(st.sets(st.integers(0, row_count - 1), max_size=min(3, row_count - 1)))
        return row_count, batch_size, bad, draw(st.integers(1, 2)), draw(st.sampled_from([0, 1, 2]))

    @examples(15)
    @given(case=skipping_cases())
    def test_skipped_is_what_was_delivered_for_any_rows_batch_bad_records_and_readers(tmp_path_factory, case):
        """Rows, batch size, bad rows, epochs and readers drawn: the skipped records are the
        bad ones among the rows delivered, no more (a cut last step's tail), no fewer."""
        row_count, batch_size, bad, epochs, readers = case
        path, _ = float_rows(tmp_path_factory, "property_rows", row_count)
        batches, skipped = run_skipping(path, bad, batch_size, readers, epochs)
        assert sum(len(indices) for _, indices in batches) == row_count * epochs
        check_skipped(skipped, delivered_skips(batches, row_count, batch_size, bad))


def test_the_count_stays_true_where_a_readers_list_is_cut(ten_rows):
    """Twenty bad records for one reader: more than its 2 KiB report describes. The count
    is still every one delivered, and the list the first of them, in order."""
    path, _ = ten_rows
    batches, skipped = run_skipping(path, {1, 5}, 4, 1, epochs=10)
    expected = delivered_skips(batches, 10, 4, {1, 5})
    assert skipped["count"] == len(expected) == 20
    listed = [(record["step"], record["position"], record["row"]) for record in skipped["records"]]
    assert 0 < len(listed) < len(expected) and listed == expected[:len(listed)]
