"""Image headers read without decoding: a JPEG's or PNG's size, and the pixel bound that
refuses a decompression bomb (the importers and the image transforms both check it)."""

from __future__ import annotations

import struct

from ..errors import StorageError

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (baseline, progressive, ...): all but DHT, JPG and DAC.
_JPEG_FRAME_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# The most pixels an image may declare: Pillow's MAX_IMAGE_PIXELS (a quarter GiB of 24-bit
# RGB). A 633-byte JPEG can declare 30000 x 30000, which OpenCV's full decode turns into 5 GB
# and seconds per record per reader: a decompression bomb, refused from the header.
IMAGE_PIXELS_MAX = 89_478_485


def check_pixels(height: int, width: int, name: str) -> None:
    """Raises StorageError for an image that declares more than IMAGE_PIXELS_MAX pixels."""
    if height * width > IMAGE_PIXELS_MAX:
        raise StorageError(f"{name}: declares {width} x {height} = {height * width:,} pixels, over the limit of "
                           f"{IMAGE_PIXELS_MAX:,} (Pillow's MAX_IMAGE_PIXELS): a decompression bomb, or an image "
                           f"to downscale before storing it")


# Segments a JPEG header walk visits before giving up (a frame header comes early).
_JPEG_SEGMENTS_MAX = 4096


def image_size(data: bytes, name: str) -> tuple[int, int]:
    """(height, width) from a JPEG's frame header or a PNG's IHDR, without decoding; other
    formats through Pillow when it is installed."""
    if data.startswith(_PNG_SIGNATURE) and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return height, width
    if data.startswith(b"\xff\xd8"):
        return _jpeg_size(data, name)
    try:
        import io

        from PIL import Image
    except ImportError:
        raise StorageError(f"{name}: neither JPEG nor PNG, and Pillow is not installed to read its size "
                           f"(pip install pillow)") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.height, image.width
    except Exception as error:  # Pillow raises many types for a bad file.
        raise StorageError(f"{name}: not a readable image ({type(error).__name__}: {error})") from None


def _jpeg_size(data: bytes, name: str) -> tuple[int, int]:
    position = 2
    for _ in range(_JPEG_SEGMENTS_MAX):
        while position < len(data) and data[position] == 0xFF and position + 1 < len(data) and data[position + 1] == 0xFF:
            position += 1  # Fill bytes.
        if position + 4 > len(data) or data[position] != 0xFF:
            break
        marker = data[position + 1]
        (length,) = struct.unpack(">H", data[position + 2:position + 4])
        if marker in _JPEG_FRAME_MARKERS:
            if position + 9 > len(data):
                break
            height, width = struct.unpack(">HH", data[position + 5:position + 9])
            return height, width
        position += 2 + length
    raise StorageError(f"{name}: a JPEG without a readable frame header (truncated or corrupted)")
