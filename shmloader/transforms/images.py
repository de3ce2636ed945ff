"""Built-in image transforms, run in the readers and written into the slot: decode a stored
image's bytes (JPEG, PNG, anything Pillow reads), random resized crop + horizontal flip for
training, resize + center crop for evaluation, with explicit interpolation.

Use them by name: ShmDataLoader({"image": "photos.image", "label": "photos.label"},
transform="shmloader.transforms.images:train", transform_args={"size": 224}). The output is
"image" (B, size, size, 3) uint8 RGB and "label" (B,) int64 (label=None leaves it out).

Two decoders (the `images` extra brings them):
- "pillow": Pillow decodes the whole image, then crops and resizes in one call (the
  decode and resampling of torchvision's ImageFolder pipeline);
- "fast": libjpeg-turbo through simplejpeg decodes a JPEG at the smallest of its 1/1, 1/2,
  1/4, 1/8 DCT scales that still covers the crop at the output size (a random crop that
  ends at 224 px rarely needs full resolution), and OpenCV resizes the crop straight into
  the slot. Pixels differ slightly from the full decode (a DCT-domain downscale first).
  Non-JPEG bytes go through OpenCV's decoder.
"auto" picks "fast" when simplejpeg and OpenCV import, else "pillow".
"""

from __future__ import annotations

import io
import math

import numpy as np

from ..errors import TransformError
from ..storage.image_headers import check_pixels, image_size
from .core import transform

DECODERS = ("auto", "fast", "pillow")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "area", "lanczos")
_JPEG_MAGIC = b"\xff\xd8"


class ImageDecodeError(TransformError):
    """A stored record that is not a readable image."""


def _import_fast():
    try:
        import cv2
        import simplejpeg
    except ImportError:
        return None
    cv2.setNumThreads(1)  # One reader is one core: OpenCV's own thread pool would fight the others.
    return cv2, simplejpeg


def _import_pillow():
    try:
        from PIL import Image
    except ImportError:
        raise TransformError("the 'pillow' image decoder needs Pillow: pip install 'shmloader[images]'") from None
    return Image


def choose_decoder(decoder: str) -> str:
    if decoder not in DECODERS:
        raise TransformError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    if decoder == "auto":
        return "fast" if _import_fast() is not None else "pillow"
    if decoder == "fast" and _import_fast() is None:
        raise TransformError("the 'fast' image decoder needs simplejpeg and OpenCV: pip install 'shmloader[images]'")
    return decoder


def random_resized_crop_box(height: int, width: int, rng: np.random.Generator, scale=(0.08, 1.0),
                            ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """(top, left, crop height, crop width): a crop covering a random share `scale` of the
    area with an aspect ratio drawn log-uniformly from `ratio`; ten tries, then the largest
    centred crop within the ratio range (the Inception-style crop torchvision uses)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_crop_box(height: int, width: int, size: int, resize: int) -> tuple[int, int, int, int]:
    """The region that resizing the shorter side to `resize` and taking the centred
    `size` x `size` crop keeps, in the original image's pixels."""
    side = min(height, width, max(1, int(round(size * min(height, width) / resize))))
    return (height - side) // 2, (width - side) // 2, side, side


def _to_rgb(Image, image):
    """RGB at 8 bits. Pillow's convert("RGB") clips 16- and 32-bit greyscale ("I;16", "I") at
    255, so a 16-bit PNG would come out white: scale it to 8 bits first (value >> 8, as
    OpenCV's 8-bit decode of the fast path does)."""
    if image.mode.startswith("I;16") or image.mode == "I":
        values = np.asarray(image).astype(np.int64)
        image = Image.fromarray((np.clip(values, 0, 65535) >> 8).astype(np.uint8))  # 2-D uint8: mode "L"
    return image.convert("RGB")


class ImageWriter:
    """Decodes one record and writes its crop, resized and maybe flipped, into an output row."""

    def __init__(self, decoder: str, interpolation: str) -> None:
        if interpolation not in INTERPOLATIONS:
            raise TransformError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        self.decoder = choose_decoder(decoder)
        if self.decoder == "fast":
            self.cv2, self.simplejpeg = _import_fast()
            self.flag = {"nearest": self.cv2.INTER_NEAREST, "bilinear": self.cv2.INTER_LINEAR,
                         "bicubic": self.cv2.INTER_CUBIC, "area": self.cv2.INTER_AREA,
                         "lanczos": self.cv2.INTER_LANCZOS4}[interpolation]
        else:
            self.Image = _import_pillow()
            resampling = self.Image.Resampling
            self.flag = {"nearest": resampling.NEAREST, "bilinear": resampling.BILINEAR,
                         "bicubic": resampling.BICUBIC, "area": resampling.BOX, "lanczos": resampling.LANCZOS}[interpolation]

    def write(self, data: np.ndarray, target: np.ndarray, choose_box, flip: bool) -> None:
        """`choose_box(height, width)` gives the crop once the image's size is known. An
        image that declares more than IMAGE_PIXELS_MAX pixels is refused from its header,
        before any decoder allocates for it."""
        height, width = image_size(data.tobytes(), "the record")
        check_pixels(height, width, "the record")
        if self.decoder == "fast":
            self._write_fast(data, target, choose_box, flip)
        else:
            self._write_pillow(data, target, choose_box, flip)

    def _write_pillow(self, data, target, choose_box, flip) -> None:
        image = self.Image.open(io.BytesIO(data))
        top, left, h, w = choose_box(image.height, image.width)
        image = _to_rgb(self.Image, image)
        resized = image.resize(target.shape[1::-1], self.flag, box=(left, top, left + w, top + h))
        if flip:
            resized = resized.transpose(self.Image.Transpose.FLIP_LEFT_RIGHT)
        target[...] = np.asarray(resized)

    def _write_fast(self, data, target, choose_box, flip) -> None:
        cv2 = self.cv2
        size_h, size_w = target.shape[:2]
        decoded = self._decode_jpeg_scaled(data, choose_box, size_h, size_w) if bytes(data[:2]) == _JPEG_MAGIC else None
        if decoded is None:  # Not a JPEG, or one libjpeg-turbo's fast path refuses (CMYK, ...).
            image = cv2.imdecode(np.asarray(data), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
            if image is None:
                raise ValueError("OpenCV cannot decode it")
            image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
            top, left, h, w = choose_box(*image.shape[:2])
        else:
            image, (top, left, h, w) = decoded
        result = cv2.resize(image[top:top + h, left:left + w], (size_w, size_h), dst=target, interpolation=self.flag)
        if result is not target:
            target[...] = result
        if flip:
            cv2.flip(target, 1, dst=target)

    def _decode_jpeg_scaled(self, data, choose_box, size_h: int, size_w: int):
        """(image, crop box in its pixels), decoded at the smallest DCT scale that keeps the
        crop at least the output size; None where simplejpeg cannot read the JPEG. The box
        is chosen once, from the header's size, whichever decoder then runs."""
        try:
            height, width, _, _ = self.simplejpeg.decode_jpeg_header(data)
        except ValueError:
            return None
        top, left, h, w = box = choose_box(height, width)
        scale = dict(colorspace="RGB", min_height=math.ceil(height * size_h / h), min_width=math.ceil(width * size_w / w))
        try:
            image = self.simplejpeg.decode_jpeg(data, **scale)
        except ValueError as error:
            if "premature end" in str(error).lower():  # Truncated: a bad record, whichever decoder.
                return self._decode_with_box(data, box)
            try:
                # Another warning of libjpeg's (extraneous bytes before a marker) fails the
                # strict decode: libjpeg-turbo decodes it leniently, as Pillow does, silently,
                # where OpenCV's decoder would print "Corrupt JPEG data" lines from every reader.
                image = self.simplejpeg.decode_jpeg(data, strict=False, **scale)
            except ValueError:
                return self._decode_with_box(data, box)
        scale_y, scale_x = image.shape[0] / height, image.shape[1] / width
        top, left = int(top * scale_y), int(left * scale_x)
        return image, (top, left, max(1, int(round(h * scale_y))), max(1, int(round(w * scale_x))))

    def _decode_with_box(self, data, box):
        """OpenCV's full decode, keeping a box already drawn (the generator has moved on)."""
        image = self.cv2.imdecode(np.asarray(data), self.cv2.IMREAD_COLOR | self.cv2.IMREAD_IGNORE_ORIENTATION)
        if image is None:
            raise ValueError("neither libjpeg-turbo's fast path nor OpenCV can decode it")
        return self.cv2.cvtColor(image, self.cv2.COLOR_BGR2RGB), box


def _decode_error(field: str, data: np.ndarray, ctx, i: int, error: Exception) -> ImageDecodeError:
    head = bytes(data[:8])
    return ImageDecodeError(f"field {field!r}: record {int(ctx.indices[i])} (step {ctx.step}, batch row {i}) is not "
                            f"a readable image ({data.size} bytes, starting {head!r}): {type(error).__name__}: {error}")


def _outputs(size=224, label="label", decoder="auto", interpolation="bilinear", scale=(0.08, 1.0),
             ratio=(3 / 4, 4 / 3), resize=256, **_):
    """The declared outputs, and the arguments checked at construction rather than in a reader."""
    for name, value in (("size", size), ("resize", resize)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TransformError(f"{name} must be a positive integer, got {value!r}")
    if interpolation not in INTERPOLATIONS:
        raise TransformError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
    choose_decoder(decoder)  # Unknown, or its libraries missing: said now.
    for name, pair in (("scale", scale), ("ratio", ratio)):
        if len(pair) != 2 or not 0 < pair[0] <= pair[1] or (name == "scale" and pair[1] > 1):
            raise TransformError(f"{name} must be [low, high] with 0 < low <= high{' <= 1' if name == 'scale' else ''}, "
                                 f"got {pair!r}")
    outputs = {"image": ((size, size, 3), "uint8")}
    if label:
        outputs["label"] = ((), "int64")
    return outputs


def _each_image(batch, out, ctx, image: str, label, writer: ImageWriter, box_and_flip) -> None:
    if image not in batch:
        raise TransformError(f"no input field {image!r} (fields: {sorted(batch)}); pass transform_args={{'image': ...}}")
    records, targets = batch[image], out["image"]
    for i in range(len(records)):
        data = records[i]
        choose_box, flip = box_and_flip(i)
        try:
            writer.write(data, targets[i], choose_box, flip)
        except Exception as error:
            raise _decode_error(image, data, ctx, i, error) from error
    if label:
        if label not in batch:
            raise TransformError(f"no input field {label!r} for the labels (fields: {sorted(batch)}); pass "
                                 f"transform_args={{'label': None}} to leave labels out")
        out["label"][...] = batch[label]


_writers: dict[tuple[str, str], ImageWriter] = {}


def _writer(decoder: str, interpolation: str) -> ImageWriter:
    writer = _writers.get((decoder, interpolation))
    if writer is None:
        writer = _writers[decoder, interpolation] = ImageWriter(decoder, interpolation)
    return writer


@transform(outputs=_outputs)
def train(batch, out, ctx, *, image="image", label="label", size=224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
          flip=0.5, decoder="auto", interpolation="bilinear"):
    """Random resized crop to size x size and a horizontal flip with probability `flip`,
    both drawn from the sample's own generator: the flip first, then the crop."""
    writer = _writer(decoder, interpolation)

    def box_and_flip(i):
        rng = ctx.rng(i)
        flipped = bool(rng.random() < flip)
        return (lambda height, width: random_resized_crop_box(height, width, rng, scale, ratio)), flipped

    _each_image(batch, out, ctx, image, label, writer, box_and_flip)


@transform(outputs=_outputs)
def evaluate(batch, out, ctx, *, image="image", label="label", size=224, resize=256, decoder="auto",
             interpolation="bilinear"):
    """Resize the shorter side to `resize`, keep the centred size x size (one resampling)."""
    writer = _writer(decoder, interpolation)
    _each_image(batch, out, ctx, image, label, writer,
                lambda i: ((lambda height, width: center_crop_box(height, width, size, resize)), False))
