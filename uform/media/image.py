"""Images (JPEG, PNG, WebP) into patches at native resolution, downscaled only to fit a row.

Pillow decodes every image but plain JPEGs that fit a row at their native size (`jpeg_plan.plain_size`: most of
what a training set holds), which simplejpeg decodes straight into an RGB array: the same libjpeg-turbo decode
Pillow's path makes of them, bitwise (tests/test_media_image.py holds it to that), at about half the cost, since
Pillow loads a JPEG in chunks into its own four-byte pixels, copies them twice more on the way and `np.asarray`
copies them out (BENCHMARKS.md, "Issue 12, twelfth day"). A JPEG that must shrink stays on Pillow's path, whose
Lanczos resize is most of its cost.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import simplejpeg
from PIL import Image, ImageOps, UnidentifiedImageError

from .grid import check_arguments, fit_size, grid_of, positions, tile
from .jpeg import check_jpeg
from .jpeg_plan import plain_size
from .limits import MediaError, MediaLimits, describe
from .sniff import as_bytes, expect
from .units import Units

# Each sniffed container opens with its own Pillow plugin only: no other plugin ever sees the bytes.
_PLUGIN = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
_NAME = {"jpeg": "JPEG", "png": "PNG", "webp": "WebP"}
_WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that rotate by a quarter turn
_EXIF_ORIENTATION = 0x0112
_STRIP_VALUES = 1 << 18  # pixels of a 16-bit image scaled to 8 bits at a time


def image_units(
    data: Any,
    *,
    patch_side: int,
    channels: int,
    max_units: int,
    limits: MediaLimits = MediaLimits(),  # noqa: B008 (frozen, so a shared default is safe)
) -> Units:
    """Decode a JPEG, PNG or WebP image into `patch_side`² patches of `channels` (4 RGBA, 3 RGB, 1 grey).

    The image keeps its native resolution (EXIF orientation applied) unless its patch grid would exceed
    `max_units`: then it is downscaled, aspect ratio kept, to the largest size whose grid fits; it is never
    upscaled. Right and bottom edges are zero-padded to whole patches. Values are [rows * columns,
    patch_side² * channels] uint8, each patch laid out [patch_side, patch_side, channels]; positions
    (0, row, column); grid (1, rows, columns). Where the channels drop an alpha channel, colours are
    composited over black (premultiplied), as transparent as the zero padding. 16-bit images are scaled to
    8 bits, palette and CMYK images converted.

    Raises MediaError for bytes that are not a JPEG, PNG or WebP file, that cannot be decoded, that are
    truncated or inconsistent (Pillow's truncation checks stay on; a JPEG whose scans are too short for the
    size its header declares is refused, see `jpeg.check_jpeg`), or that break `limits` (bytes; pixels,
    checked from the header before decoding, which bounds the decoder's memory).
    """
    check_arguments(patch_side=patch_side, max_units=max_units)
    if channels not in (1, 3, 4):
        raise ValueError(f"channels must be 1, 3 or 4, got {channels!r}")
    data = as_bytes(data)
    container = expect("image", data, limits)
    pixels = _plain_jpeg(data, patch_side, channels, max_units, limits) if container == "jpeg" else None
    if pixels is None:
        try:
            pixels = _decode(data, container, patch_side, channels, max_units, limits)
        except MediaError:
            raise
        except UnidentifiedImageError as error:
            raise MediaError(f"not a valid {_NAME[container]} file") from error
        except Exception as error:  # Pillow answers hostile bytes with many exception types: name them all here.
            raise MediaError(f"cannot decode the {_NAME[container]} image: {describe(error)}") from error
    rows, columns = grid_of(pixels.shape[1], pixels.shape[0], patch_side)
    return Units(
        values=tile(pixels, patch_side),
        positions=positions(1, rows, columns),
        grid=(1, rows, columns),
        truncated=False,
    )


def _plain_jpeg(data: bytes, patch_side: int, channels: int, max_units: int, limits: MediaLimits) -> np.ndarray | None:
    """[H, W, channels] pixels of a plain JPEG that fits a row at its native size, decoded by simplejpeg (RGBA:
    libjpeg-turbo's opaque alpha, as Pillow's `convert("RGBA")` gives), or None for Pillow's path: a JPEG that is
    not plain or must shrink (where Pillow's Lanczos resize costs the time, and decoding it here saved nothing:
    `python bench/decode.py --jpeg-variants`), or one whose decode libjpeg warns about (`strict`), which Pillow's
    path then decodes or refuses as it always has."""
    size = plain_size(
        data, patch_side=patch_side, channels=channels, max_units=max_units, limits=limits, progressive=True
    )
    if size is None:
        return None
    width, height = size
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGBA" if channels == 4 else "RGB", strict=True)
    except ValueError:
        return None
    return pixels if pixels.shape == (height, width, channels) else None


def _decode(
    data: bytes, container: str, patch_side: int, channels: int, max_units: int, limits: MediaLimits
) -> np.ndarray:
    with warnings.catch_warnings():
        # Our own pixel limit decides; Pillow's bomb warning would only be noise (its error is caught).
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image: Image.Image = Image.open(io.BytesIO(data), formats=[_PLUGIN[container]])
        except Image.DecompressionBombError as error:
            raise MediaError(f"decompression bomb refused: {describe(error)}") from error
        width, height = image.size
        if width < 1 or height < 1:
            raise MediaError(f"the {_NAME[container]} image has no pixels ({width} x {height})")
        if width * height > limits.max_pixels:
            raise MediaError(
                f"{width} x {height} = {width * height} pixels is over the limit of {limits.max_pixels} pixels"
            )
        if container == "jpeg":
            check_jpeg(data)
            _draft(image, patch_side, max_units)
        image.load()
    image = _upright(image)
    image = _common_mode(image)
    size = fit_size(*image.size, patch_side, max_units)
    if size != image.size:
        image = image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
    return _to_channels(image, channels)


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(_EXIF_ORIENTATION, 1))
    except Exception:  # a broken EXIF block leaves the image as stored
        return 1


def _draft(image: Image.Image, patch_side: int, max_units: int) -> None:
    """Let libjpeg decode at 1/2, 1/4 or 1/8 scale when the image will be downscaled at least that much."""
    width, height = image.size
    swap = _orientation(image) in _SWAPS_SIDES
    upright = (height, width) if swap else (width, height)
    target = fit_size(*upright, patch_side, max_units)
    if target != upright:
        image.draft(image.mode, (target[1], target[0]) if swap else target)


def _upright(image: Image.Image) -> Image.Image:
    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # a broken EXIF block leaves the image as stored
        return image


def _common_mode(image: Image.Image) -> Image.Image:
    """The image in L, LA, RGB or RGBA: 16-bit scaled to 8, palette expanded, transparency as alpha."""
    mode = image.mode
    if mode in _WIDE_MODES:
        wide = np.asarray(image)  # [H, W] of 2 or 4 bytes per pixel
        narrow = np.empty(wide.shape, dtype=np.uint8)
        # In strips of rows, so that the int64 arithmetic never holds more than a few MB beside the image.
        step = max(1, _STRIP_VALUES // max(1, wide.shape[1]))
        for top in range(0, wide.shape[0], step):
            strip = np.clip(wide[top : top + step].astype(np.int64), 0, 65535)
            narrow[top : top + step] = (strip * 255 + 32767) // 65535
        return Image.fromarray(narrow, "L")
    transparent = "transparency" in image.info
    if mode in ("1", "L"):
        return image.convert("LA" if transparent else "L")
    if mode in ("LA", "La"):
        return image.convert("LA") if mode == "La" else image
    if mode == "P":
        return image.convert("RGBA" if transparent else "RGB")
    if mode in ("PA", "RGBa"):
        return image.convert("RGBA")
    if mode == "RGBA":
        return image
    if mode == "RGB":
        return image.convert("RGBA") if transparent else image
    return image.convert("RGB")  # CMYK, YCbCr, LAB, HSV, RGBX


def _to_channels(image: Image.Image, channels: int) -> np.ndarray:
    """[H, W, channels] uint8 from an L, LA, RGB or RGBA image."""
    if channels == 4:
        return np.asarray(image.convert("RGBA"))
    colour = np.asarray(image.convert("L" if channels == 1 else "RGB"))
    if colour.ndim == 2:
        colour = colour[:, :, None]
    if image.mode in ("LA", "RGBA"):
        alpha = np.asarray(image.getchannel("A")).astype(np.uint16)[:, :, None]
        colour = ((colour.astype(np.uint16) * alpha + 127) // 255).astype(np.uint8)
    return colour
