"""Built-in image transforms: decode + random resized crop + flip (and evaluation's resize
+ center crop) in readers equal a one-process reference, and a corrupt image names its record."""

from __future__ import annotations

import io

import numpy as np
import pytest

from shmloader import Packed, ReaderError, ShmDataLoader
from shmloader.tools.convert import write_ragged
from shmloader.tools.imagefolder import convert_images
from shmloader.transforms import sample_rng
from shmloader.transforms.images import center_crop_box, random_resized_crop_box

Image = pytest.importorskip("PIL.Image")
TRAIN = "shmloader.transforms.images:train"


def photo(rng, height, width):
    """Smooth colour gradients with a little noise: JPEG-friendly, every image distinct."""
    y, x = np.mgrid[0:height, 0:width]
    phase = rng.uniform(0, 6, 3)
    channels = [127 + 100 * np.sin(x / rng.uniform(5, 20) + y / rng.uniform(5, 20) + p) for p in phase]
    image = np.stack(channels, axis=-1) + rng.normal(0, 3, (height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """30 JPEGs of 40-90 px in 3 class directories, one PNG and one greyscale JPEG, converted."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for index in range(32):
        directory = root / "images" / f"class{index % 3}"
        directory.mkdir(parents=True, exist_ok=True)
        picture = Image.fromarray(photo(rng, int(rng.integers(40, 90)), int(rng.integers(40, 90))))
        if index == 30:
            picture.save(directory / f"{index:03d}.png")
        elif index == 31:
            picture.convert("L").save(directory / f"{index:03d}.jpg", quality=90)
        else:
            picture.save(directory / f"{index:03d}.jpg", quality=90)
    paths = convert_images(root / "images", root / "photos", progress=False)
    records = [(root / "images" / name).read_bytes() for name in __import__("json").load(open(paths["classes"]))["files"]]
    return {"image": paths["image"], "label": paths["label"]}, records, np.load(paths["label"])


def pillow_reference(data: bytes, rng, size: int) -> np.ndarray:
    """torchvision's order of operations, spelled out with Pillow: decode, crop box, resize, flip."""
    flipped = rng.random() < 0.5
    image = Image.open(io.BytesIO(data))
    top, left, h, w = random_resized_crop_box(image.height, image.width, rng)
    resized = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if flipped:
        resized = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(resized)


@pytest.mark.parametrize("readers", [1, 2, 4])
def test_pillow_train_equals_a_one_process_reference(photos, readers):
    fields, records, labels = photos
    with ShmDataLoader(fields, transform=TRAIN, transform_args={"size": 24, "decoder": "pillow"}, batch_size=8,
                       readers=readers, seed=4) as loader:
        assert loader.field_names == ("image", "label")
        for step, batch in zip(range(8), loader):
            assert batch["image"].shape == (8, 24, 24, 3) and batch["image"].dtype == np.uint8
            np.testing.assert_array_equal(batch["label"], labels[batch.indices])
            for i, row in enumerate(batch.indices.tolist()):
                rng = sample_rng(4, step * 8 + i, TRAIN)
                np.testing.assert_array_equal(batch["image"][i], pillow_reference(records[row], rng, 24),
                                              err_msg=f"step {step} row {row}")


@pytest.mark.parametrize("shard_count", [1, 2])
def test_fast_train_is_deterministic_and_crops_what_pillow_crops(photos, shard_count):
    pytest.importorskip("simplejpeg")
    pytest.importorskip("cv2")
    fields, _, _ = photos
    batches = {}
    for decoder, readers in (("fast", 1), ("fast", 3), ("pillow", 2)):
        images = []
        for shard in range(shard_count):
            with ShmDataLoader(fields, transform=TRAIN, transform_args={"size": 32, "decoder": decoder},
                               batch_size=16 // shard_count, readers=readers, shard_index=shard,
                               shard_count=shard_count) as loader:
                images.append([np.array(batch["image"]) for _, batch in zip(range(6), loader)])
        batches[decoder, readers] = [np.concatenate(parts) for parts in zip(*images)]
    for one, three in zip(batches["fast", 1], batches["fast", 3]):
        np.testing.assert_array_equal(one, three)
    # The fast path decodes at a DCT scale and resamples with OpenCV (no antialiasing): the
    # same crop and flip give nearly the same pixels; another crop or the mirror image
    # differs by tens of levels.
    for fast, pillow in zip(batches["fast", 1], batches["pillow", 2]):
        difference = np.abs(fast.astype(np.int16) - pillow.astype(np.int16)).mean(axis=(1, 2, 3))
        mismatched = np.abs(fast.astype(np.int16) - pillow[::-1].astype(np.int16)).mean(axis=(1, 2, 3))
        flipped = np.abs(fast.astype(np.int16) - pillow[:, :, ::-1].astype(np.int16)).mean(axis=(1, 2, 3))
        assert difference.max() < 15 and (difference < np.minimum(mismatched, flipped) / 3).all(), \
            (difference, mismatched, flipped)


def test_evaluate_resizes_the_shorter_side_and_center_crops(photos):
    fields, records, _ = photos
    with ShmDataLoader(fields, transform="shmloader.transforms.images:evaluate", batch_size=8, mode="sequential",
                       transform_args={"size": 24, "resize": 28, "decoder": "pillow", "label": None},
                       readers=2) as loader:
        assert loader.field_names == ("image",)
        batch = next(loader)
        for i, row in enumerate(batch.indices.tolist()):
            image = Image.open(io.BytesIO(records[row]))
            top, left, h, w = center_crop_box(image.height, image.width, 24, 28)
            expected = image.convert("RGB").resize((24, 24), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
            np.testing.assert_array_equal(batch["image"][i], np.asarray(expected))
            # Two-step reference (resize then crop): the one-step crop keeps the same region.
            scale = 28 / min(image.height, image.width)
            two_step = image.convert("RGB").resize((round(image.width * scale), round(image.height * scale)),
                                                   Image.Resampling.BILINEAR)
            top2, left2 = (two_step.height - 24) // 2, (two_step.width - 24) // 2
            two_step = np.asarray(two_step)[top2:top2 + 24, left2:left2 + 24]
            assert np.abs(two_step.astype(int) - batch["image"][i].astype(int)).mean() < 8


def test_random_resized_crop_box_stays_inside_and_within_scale():
    rng = np.random.default_rng(1)
    for _ in range(2000):
        height, width = (int(x) for x in rng.integers(1, 600, 2))
        top, left, h, w = random_resized_crop_box(height, width, rng, (0.08, 1.0), (3 / 4, 4 / 3))
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h >= 1 and w >= 1
    # A square image: ten tries almost never fail, and the areas follow the scale range.
    areas = [np.prod(random_resized_crop_box(400, 400, rng)[2:]) / 160000 for _ in range(500)]
    assert 0.07 < min(areas) and max(areas) <= 1.0 and 0.4 < np.mean(areas) < 0.65


def _first_batch_with_a_bad_record(directory, decoder: str, bad: bytes, count: int, position: int, seed: int):
    """Loads `count` good JPEGs with `bad` at `position` through the train transform."""
    if decoder == "fast":
        pytest.importorskip("simplejpeg")
        pytest.importorskip("cv2")
    good = io.BytesIO()
    Image.fromarray(photo(np.random.default_rng(seed), 40, 50)).save(good, format="JPEG")
    records = [np.frombuffer(good.getvalue(), np.uint8)] * count
    records[position] = np.frombuffer(bad, np.uint8)
    write_ragged(directory / "images", records)
    with ShmDataLoader({"image": str(directory / "images")}, transform=TRAIN, mode="sequential", batch_size=count,
                       transform_args={"size": 16, "decoder": decoder, "label": None}, readers=1) as loader:
        next(loader)


@pytest.mark.parametrize("decoder", ["pillow", "fast"])
def test_a_corrupt_image_names_its_record(tmp_path, decoder):
    with pytest.raises(ReaderError, match=r"field 'image': record 3 \(step 0, batch row 3\) is not a readable "
                                          r"image \(204 bytes"):
        # A JPEG start, then nothing valid.
        _first_batch_with_a_bad_record(tmp_path, decoder, b"\xff\xd8\xff\xe0" + bytes(200), 5, 3, seed=2)


def _bomb(rng) -> bytes:
    """A small real JPEG whose frame header is patched to declare 30000 x 30000 pixels."""
    buffer = io.BytesIO()
    Image.fromarray(photo(rng, 16, 16)).save(buffer, format="JPEG")
    data = bytearray(buffer.getvalue())
    frame = data.index(b"\xff\xc0")  # Baseline SOF0: length (2), precision (1), height (2), width (2).
    data[frame + 5:frame + 9] = (30000).to_bytes(2, "big") * 2
    return bytes(data)


@pytest.mark.parametrize("decoder", ["pillow", "fast"])
def test_a_decompression_bomb_is_refused_from_its_header_before_decoding(tmp_path, decoder):
    """It passed convert-images, and decoder="auto" decoded it fully with OpenCV: 8.9 s and
    5.2 GB per record per reader, then a grey image as a valid sample."""
    with pytest.raises(ReaderError, match=r"record 2 \(step 0, batch row 2\).*30000 x 30000 = 900,000,000 pixels"):
        _first_batch_with_a_bad_record(tmp_path, decoder, _bomb(np.random.default_rng(3)), 4, 2, seed=3)


def test_convert_images_refuses_a_decompression_bomb_naming_its_file(tmp_path):
    directory = tmp_path / "tree" / "cats"
    directory.mkdir(parents=True)
    (directory / "bomb.jpg").write_bytes(_bomb(np.random.default_rng(4)))
    from shmloader import StorageError

    with pytest.raises(StorageError, match=r"bomb\.jpg: declares 30000 x 30000"):
        convert_images(tmp_path / "tree", tmp_path / "out", progress=False)
    assert not list(tmp_path.glob("out*"))  # Nothing that looks finished.


@pytest.mark.parametrize("args, message", [
    ({"decoder": "turbo"}, "decoder must be one of"),
    ({"interpolation": "cubic"}, "interpolation must be one of"),
    ({"size": 0}, "size must be a positive integer"),
    ({"scale": [0.5, 2.0]}, "scale must be"),
])
def test_bad_image_transform_arguments_are_refused_at_construction(photos, args, message):
    from shmloader import TransformError

    fields, _, _ = photos
    with pytest.raises(TransformError, match=message):
        ShmDataLoader(fields, transform=TRAIN, transform_args=args, batch_size=8, readers=1)


def test_convert_images_names_a_file_it_cannot_read(tmp_path):
    """An EIO surfaced without the file's name. /proc/self/mem reads as EIO from offset 0."""
    from shmloader import StorageError

    directory = tmp_path / "tree" / "cats"
    directory.mkdir(parents=True)
    (directory / "broken.jpg").symlink_to("/proc/self/mem")
    with pytest.raises(StorageError, match=r"broken\.jpg: cannot be read \(Input/output error\)"):
        convert_images(tmp_path / "tree", tmp_path / "out", progress=False)


def test_convert_images_skip_bad_leaves_out_empty_and_non_image_files_and_lists_them(tmp_path, capsys):
    """--check advised converting and skipping at load time, but the conversion stopped at
    the first empty or non-image file: --skip-bad converts the others and lists those."""
    from shmloader import StorageError
    from shmloader.tools.cli import main

    rng = np.random.default_rng(8)
    tree = tmp_path / "tree"
    for label in ("cats", "dogs"):
        (tree / label).mkdir(parents=True)
    good = {}
    for index in range(6):
        label = ("cats", "dogs")[index % 2]
        path = tree / label / f"{index}.png"
        image = rng.integers(0, 255, (8 + index, 9, 3), dtype=np.uint8)
        Image.fromarray(image).save(path)
        good[str(path.resolve())] = (index % 2, image.shape[:2])
    (tree / "cats" / "empty.jpg").write_bytes(b"")
    (tree / "dogs" / "notes.png").write_bytes(b"these are not pixels" * 10)
    with pytest.raises(StorageError, match=r"empty.jpg: an empty file; convert with skip_bad=True \(--skip-bad\)"):
        convert_images(tree, tmp_path / "out", progress=False)
    assert main(["convert-images", str(tree), str(tmp_path / "out"), "--skip-bad", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "skipped" in printed and "empty.jpg" in printed and "notes.png" in printed
    import json

    listing = json.loads((tmp_path / "out.classes.json").read_text())
    assert sorted(entry["file"].rsplit("/", 1)[1] for entry in listing["skipped"]) == ["empty.jpg", "notes.png"]
    paths = {"image": Packed(f"{tmp_path}/out.image"), "label": f"{tmp_path}/out.label",
             "size": f"{tmp_path}/out.size", "path": Packed(f"{tmp_path}/out.path")}
    with ShmDataLoader(paths, batch_size=6, mode="sequential", readers=0) as loader:
        batch = next(loader)
        for row, name in enumerate(batch.strings("path")):
            label, shape = good[name]
            assert batch["label"][row] == label and tuple(batch["size"][row]) == shape


def test_a_jpeg_with_libjpeg_warnings_is_decoded_without_printing_them(tmp_path, capfd):
    """Extraneous bytes before a marker: libjpeg warns. Before: the fast path fell back to
    OpenCV's decoder, which printed "Corrupt JPEG data: ..." from every reader."""
    pytest.importorskip("simplejpeg")
    rng = np.random.default_rng(6)
    buffer = io.BytesIO()
    Image.fromarray(photo(rng, 48, 40)).save(buffer, format="JPEG", quality=90)
    data = buffer.getvalue()
    warned = data[:-2] + b"\x00\x11\x22" + data[-2:]
    tree = tmp_path / "tree" / "a"
    tree.mkdir(parents=True)
    (tree / "0.jpg").write_bytes(warned)
    paths = convert_images(tmp_path / "tree", tmp_path / "out", progress=False)
    capfd.readouterr()
    with ShmDataLoader({"image": paths["image"], "label": paths["label"]}, transform="shmloader.transforms.images:evaluate",
                       transform_args={"size": 16, "resize": 16, "decoder": "fast"}, batch_size=1, readers=1) as loader:
        image = np.array(next(loader)["image"][0])
    assert "Corrupt JPEG data" not in capfd.readouterr().err
    assert image.std() > 0  # Decoded, not blank.
