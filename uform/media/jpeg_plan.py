"""Which JPEGs are plain, read from their headers alone: those whose units are a bare decode to RGB, tiled.

Pillow's path (`media.image`) orients, converts, downscales and composites; for most JPEGs it does none of that,
and a bare libjpeg-turbo decode gives the same pixels at about half the cost. A plain JPEG (`plain_size`) is an
8-bit, three-component YCbCr JPEG, Huffman-coded (sequential or progressive), upright (no EXIF orientation, or
orientation 1), within the limits, and consistent (`jpeg.check_jpeg`); the host decodes one that fits a row at
its native size through simplejpeg (`media.image`); a GPU decoder (nvJPEG, serving's `jpeg="device"`,
`uform.device_pictures`) takes the sequential ones only (`plain_size`'s default). Anything else (grey, CMYK, Adobe
RGB, rotated, to be downscaled, broken) takes Pillow's path, which decodes it or refuses it with its own error.
This module reads bytes only: no decoder, no torch.
"""

from __future__ import annotations

from typing import Literal

from .grid import fit_size
from .jpeg import EOI, SOF_HUFFMAN, SOF_OTHER, SOS, STANDALONE, check_jpeg
from .limits import MediaError, MediaLimits
from .sniff import expect

# Huffman-coded frames are sequential (extended sequential allows 8-bit too) or progressive; the others (SOF_OTHER)
# are lossless or arithmetic-coded.
_PROGRESSIVE = {marker for marker, mode in SOF_HUFFMAN.items() if mode == "progressive"}
_APP1, _APP14 = 0xE1, 0xEE
_RGB_IDS = (ord("R"), ord("G"), ord("B"))  # libjpeg reads components named R, G, B as RGB, not YCbCr
_ORIENTATION = 0x0112


def plain_size(
    data: bytes, *, patch_side: int, channels: int, max_units: int, limits: MediaLimits, progressive: bool = False
) -> tuple[int, int] | None:
    """(width, height) of a plain JPEG (see the module's docstring) whose patch grid fits `max_units` at its native
    size, so that a bare decode gives Pillow's path's very units; a progressive frame counts only with
    `progressive` (the host's simplejpeg takes it, the GPU decoder's plan does not). None when Pillow's path must
    take it. Never raises for bad bytes: those are Pillow's path's."""
    if channels not in (3, 4):  # grey from colour is Pillow's own conversion, not libjpeg's
        return None
    try:
        if expect("image", data, limits) != "jpeg":
            return None
        frame = _frame(data)
        if frame is None or (frame[2] and not progressive):
            return None
        width, height, _ = frame
        if width * height > limits.max_pixels or fit_size(width, height, patch_side, max_units) != (width, height):
            return None
        check_jpeg(data)
    except MediaError:
        return None
    return width, height


def _frame(data: bytes) -> tuple[int, int, bool] | None:
    """(width, height, progressive) of a Huffman-coded, three-component YCbCr frame read upright, walking the
    markers up to the first scan; None for any other frame, an Adobe or EXIF segment that changes how it reads,
    or bad markers."""
    size: tuple[int, int, bool] | None = None
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:
            at += 1
            continue
        if marker in STANDALONE:
            at += 2
            continue
        if marker in (SOS, EOI):
            return size
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        segment = data[at + 4 : at + 2 + length]
        if length < 2 or len(segment) != length - 2:
            return None
        if marker in SOF_OTHER or marker == _APP14:  # lossless, arithmetic; Adobe colour transforms
            return None
        if marker == _APP1 and segment.startswith(b"Exif\x00\x00") and _orientation(segment[6:]) != 1:
            return None
        if marker == _APP1 and not segment.startswith(b"Exif") and b"Orientation" in segment:
            return None  # Pillow reads an XMP packet's tiff:Orientation where EXIF has none
        if marker in SOF_HUFFMAN:
            if size is not None or len(segment) < 15 or segment[0] != 8 or segment[5] != 3:
                return None
            if tuple(segment[6 + 3 * k] for k in range(3)) == _RGB_IDS:
                return None
            height, width = int.from_bytes(segment[1:3], "big"), int.from_bytes(segment[3:5], "big")
            if width == 0 or height == 0:
                return None
            size = (width, height, marker in _PROGRESSIVE)
        at += 2 + length
    return None


def _orientation(tiff: bytes) -> int:
    """The EXIF orientation tag of IFD0 (1 when absent); 0 for a TIFF block that does not parse, which the host
    path reads as Pillow does."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 0
    order: Literal["little", "big"] = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 0
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for k in range(count):
        entry = tiff[ifd + 2 + 12 * k : ifd + 14 + 12 * k]
        if len(entry) < 12:
            return 0
        if int.from_bytes(entry[:2], order) == _ORIENTATION:
            return int.from_bytes(entry[8:10], order)
    return 1
