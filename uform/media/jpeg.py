"""The JPEG consistency check: entropy-coded data enough for the pixels the frame header declares.

libjpeg answers a scan that ends early (its data cut, then an end-of-image marker) with a warning and
zero-filled blocks, and Pillow reports no warning: a 1.5 KB file whose header claims 8000 x 8000 would decode
as a grey picture of 64 M pixels. Pillow's own truncation check (`ImageFile.LOAD_TRUNCATED_IMAGES`, left
False) only catches a file that ends without the marker. So before decoding, the markers are walked and each
scan's coded bytes are compared with the fewest a Huffman coder can spend on the blocks it declares: two
bits per block of a sequential scan (a DC code and an end-of-block code, each at least one bit), one bit per
block of a progressive DC scan (first or refinement); progressive AC scans can code a run of empty blocks in
a few bits and bound nothing. A component that no scan codes (no DC scan, when progressive) is refused too.
Arithmetic-coded and lossless frames are left to libjpeg: no such bound holds for them.
"""

from __future__ import annotations

import re

from .limits import MediaError

# The markers, as this check and `media.jpeg_plan` read them.
SOF_HUFFMAN = {0xC0: "sequential", 0xC1: "sequential", 0xC2: "progressive"}  # Huffman-coded frames, by mode
SOF_OTHER = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # lossless and arithmetic-coded frames
SOS, EOI = 0xDA, 0xD9
STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM and RSTn carry no length


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _blocks(frame: dict, ids: list[int]) -> int:
    """8x8 blocks a scan over component `ids` codes (whole MCUs when interleaved, as libjpeg counts)."""
    width, height, sampling = frame["width"], frame["height"], frame["sampling"]
    h_max = max(h for h, _ in sampling.values())
    v_max = max(v for _, v in sampling.values())
    if len(ids) == 1:
        h, v = sampling[ids[0]]
        return _ceil(_ceil(width * h, h_max), 8) * _ceil(_ceil(height * v, v_max), 8)
    mcus = _ceil(width, 8 * h_max) * _ceil(height, 8 * v_max)
    return mcus * sum(sampling[i][0] * sampling[i][1] for i in ids)


# An FF that begins a marker: not a stuffed FF00, a restart marker RSTn, or a fill byte before another FF.
_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def _scan_end(data: bytes, at: int) -> int:
    """Offset of the marker that ends the entropy-coded data starting at `at` (stuffed FF00, RSTn and fill
    bytes skipped), or len(data) when none does."""
    found = _MARKER.search(data, at)
    return len(data) if found is None else found.start()


def check_jpeg(data: bytes) -> None:
    """MediaError when a Huffman-coded JPEG's scans hold fewer bytes than the blocks its header declares
    need, or leave a component uncoded; nothing for a consistent file (libjpeg judges everything else)."""
    frame: dict | None = None
    needed_bits: list[tuple[int, int]] = []  # (bits at least, bytes present) per scan
    coded: set[int] = set()
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return  # not at a marker: the decoder judges
        marker = data[at + 1]
        if marker == 0xFF:
            at += 1
            continue
        if marker == EOI:
            break
        if marker in STANDALONE:
            at += 2
            continue
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        segment = data[at + 4 : at + 2 + length]
        if length < 2 or len(segment) != length - 2:
            return  # cut inside a segment: Pillow's truncation check refuses it
        if marker in SOF_OTHER:
            return
        if marker in SOF_HUFFMAN and frame is None and len(segment) >= 6:
            count = segment[5]
            if len(segment) < 6 + 3 * count or count == 0:
                return
            sampling = {
                segment[6 + 3 * k]: (max(segment[7 + 3 * k] >> 4, 1), max(segment[7 + 3 * k] & 15, 1))
                for k in range(count)
            }
            frame = {
                "mode": SOF_HUFFMAN[marker],
                "height": int.from_bytes(segment[1:3], "big"),
                "width": int.from_bytes(segment[3:5], "big"),
                "sampling": sampling,
            }
        at += 2 + length
        if marker == SOS:
            end = _scan_end(data, at)
            if frame is not None and segment and len(segment) >= 1 + 2 * segment[0] + 3:
                ids = [segment[1 + 2 * k] for k in range(segment[0])]
                if all(i in frame["sampling"] for i in ids):
                    start_band = segment[1 + 2 * len(ids)]
                    if frame["mode"] == "sequential":
                        needed_bits.append((2 * _blocks(frame, ids), end - at))
                        coded.update(ids)
                    elif start_band == 0:  # a progressive DC scan: one bit per block at least
                        needed_bits.append((_blocks(frame, ids), end - at))
                        coded.update(ids)
            at = end
    if frame is None or frame["width"] == 0 or frame["height"] == 0:
        return
    missing = sorted(set(frame["sampling"]) - coded)
    if missing:
        raise MediaError(f"inconsistent JPEG: no scan codes component {missing[0]} of its frame")
    for bits, present in needed_bits:
        if present * 8 < bits:
            raise MediaError(
                f"inconsistent JPEG: a scan holds {present} bytes, fewer than the {-(-bits // 8)} its header's "
                f"{frame['width']} x {frame['height']} pixels need (truncated, or a forged size)"
            )
