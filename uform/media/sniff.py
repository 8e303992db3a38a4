"""Recognise a media container by its magic bytes, and refuse bytes that are not the declared modality's."""

from __future__ import annotations

from typing import Any

from .limits import MediaError, MediaLimits

ACCEPTED: dict[str, tuple[str, ...]] = {
    "image": ("jpeg", "png", "webp"),
    "video": ("mp4", "webm"),
    "audio": ("wav", "flac", "mp3", "ogg", "webm"),
}
"""The containers each modality decodes (WebM audio: Opus or Vorbis in Matroska)."""

_REFUSAL = {
    "image": "not a JPEG, PNG or WebP file",
    "video": "not an MP4 or WebM file",
    "audio": "not a WAV, FLAC, MP3, Ogg or WebM file",
}

# MPEG-1/2/2.5 audio bitrate index 1111 and sample-rate index 11 are invalid; layer 00 is reserved (AAC ADTS).
_MPEG_BAD_BITRATE = 0xF0
_MPEG_BAD_RATE = 0x0C


def as_bytes(data: Any) -> bytes:
    """`data` (bytes, bytearray, memoryview or a contiguous uint8 array) as bytes; TypeError for anything else."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        raise TypeError("media content must be bytes-like, got str")
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"media content must be bytes-like, got {type(data).__name__}") from None
    return view.tobytes()


def _id3_end(data: bytes) -> int:
    """Offset past a leading ID3v2 tag (10-byte header, syncsafe size, optional 10-byte footer)."""
    if len(data) < 10 or data[:3] != b"ID3" or any(b & 0x80 for b in data[6:10]):
        return 0
    size = (data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9]
    return 10 + size + (10 if data[5] & 0x10 else 0)


def _mpeg_audio_sync(data: bytes, at: int = 0) -> bool:
    """Whether `data[at:]` opens with a plausible MPEG audio (MP1/MP2/MP3) frame header."""
    if len(data) < at + 4 or data[at] != 0xFF or data[at + 1] & 0xE0 != 0xE0:
        return False
    version, layer = (data[at + 1] >> 3) & 0x3, (data[at + 1] >> 1) & 0x3
    return (
        version != 0x1
        and layer != 0
        and data[at + 2] & 0xF0 != _MPEG_BAD_BITRATE
        and data[at + 2] & 0x0C != _MPEG_BAD_RATE
    )


def sniff(data: Any) -> str | None:
    """The container of `data` by its magic bytes ("jpeg", "png", "webp", "mp4", "webm", "wav", "flac",
    "mp3", "ogg"), or None when none matches. A FLAC stream behind an ID3 tag sniffs as "flac"."""
    data = as_bytes(data)
    head = data[:16]
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:3] == b"ID3":
        end = _id3_end(data)
        return "flac" if data[end : end + 4] == b"fLaC" else "mp3"
    if _mpeg_audio_sync(data):
        return "mp3"
    return None


def expect(kind: str, data: Any, limits: MediaLimits | None = None) -> str:
    """The container of `data`, which must be one of `ACCEPTED[kind]`; MediaError for empty data, data over
    `limits.max_bytes`, or bytes of any other format."""
    if kind not in ACCEPTED:
        raise ValueError(f"kind must be one of {sorted(ACCEPTED)}, got {kind!r}")
    limits = MediaLimits() if limits is None else limits
    data = as_bytes(data)
    size = len(data)
    if size == 0:
        raise MediaError("empty content (zero bytes)")
    if size > limits.max_bytes:
        raise MediaError(f"{size} bytes is over the limit of {limits.max_bytes} bytes")
    found = sniff(data)
    if found not in ACCEPTED[kind]:
        raise MediaError(_REFUSAL[kind])
    return found


def check_complete(container: str, data: bytes) -> None:
    """MediaError when `data` ends before a length its container declares: a WAV data chunk, an MP4 top-level
    box, a WebM segment, an Ogg page, an MPEG audio frame. Lengths a streaming writer left open are not
    judged (nor a cut that falls exactly between pages or frames: that reads as a shorter file); JPEG, PNG,
    WebP and FLAC decoders refuse a cut file themselves."""
    check = _COMPLETENESS.get(container)
    if check is not None:
        missing = check(data)
        if missing:
            raise MediaError(f"truncated file: the {container.upper()} {missing}")


def _wav_missing(data: bytes) -> str | None:
    at = 12
    while at + 8 <= len(data):
        size = int.from_bytes(data[at + 4 : at + 8], "little")
        if data[at : at + 4] == b"data":
            if size not in (0, 0xFFFFFFFF) and at + 8 + size > len(data):
                return f"data chunk declares {size} bytes, {len(data) - at - 8} are present"
            return None
        at += 8 + size + (size & 1)
    return None


def _mp4_missing(data: bytes) -> str | None:
    at = 0
    while at < len(data):
        if at + 8 > len(data):
            return f"box at byte {at} is cut inside its header"
        size, header = int.from_bytes(data[at : at + 4], "big"), 8
        if size == 1:
            if at + 16 > len(data):
                return f"box at byte {at} is cut inside its header"
            size, header = int.from_bytes(data[at + 8 : at + 16], "big"), 16
        elif size == 0:  # the last box runs to the end of the file
            return None
        if size < header:
            return None  # malformed: the demuxer will say so
        if at + size > len(data):
            return (
                f"{data[at + 4 : at + 8].decode('latin-1')!r} box declares {size} bytes, {len(data) - at} are present"
            )
        at += size
    return None


def _ebml_number(data: bytes, at: int, *, marker: bool) -> tuple[int, int] | None:
    """(value, length) of the EBML variable-length number at `at`; value -1 when all its bits are ones
    (an unknown size); None when cut or invalid."""
    if at >= len(data) or data[at] == 0:
        return None
    length = 9 - data[at].bit_length()
    if at + length > len(data):
        return None
    value = int.from_bytes(data[at : at + length], "big")
    if marker:
        return value, length
    value &= (1 << (7 * length)) - 1
    return (-1 if value == (1 << (7 * length)) - 1 else value), length


def _webm_missing(data: bytes) -> str | None:
    header = _ebml_number(data, 4, marker=False)
    if header is None:
        return "EBML header is cut"
    at = 4 + header[1] + max(header[0], 0)
    element = _ebml_number(data, at, marker=True)
    if element is None:
        return "file ends before its segment" if at >= len(data) - 4 else None
    if element[0] != 0x18538067:  # not a Segment: leave the judgement to the demuxer
        return None
    size = _ebml_number(data, at + element[1], marker=False)
    if size is None:
        return "segment header is cut"
    start = at + element[1] + size[1]
    if size[0] >= 0 and start + size[0] > len(data):
        return f"segment declares {size[0]} bytes, {len(data) - start} are present"
    return None


def _ogg_missing(data: bytes) -> str | None:
    at = 0
    while at < len(data):
        if data[at : at + 4] != b"OggS":
            return None  # not a page boundary: leave the judgement to the decoder
        if at + 27 > len(data) or at + 27 + data[at + 26] > len(data):
            return f"page at byte {at} is cut inside its header"
        segments = data[at + 27 : at + 27 + data[at + 26]]
        end = at + 27 + len(segments) + sum(segments)
        if end > len(data):
            return f"page at byte {at} declares {end - at} bytes, {len(data) - at} are present"
        at = end
    return None


# Kilobits per second by bitrate index: MPEG-1 layers I, II, III; MPEG-2 and 2.5 layer I; their layers II and III.
_KBPS = {
    (1, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (1, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (1, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (2, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (2, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_HERTZ = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits


def _mpeg_frame_bytes(data: bytes, at: int) -> int:
    """Length of the MPEG audio frame whose (valid) header sits at `at`; 0 for a free-format frame."""
    version, layer = (data[at + 1] >> 3) & 0x3, 4 - ((data[at + 1] >> 1) & 0x3)
    kbps = _KBPS[(1, layer) if version == 3 else (2, min(layer, 2))][data[at + 2] >> 4]
    hertz = _HERTZ[version][(data[at + 2] >> 2) & 0x3]
    padding = (data[at + 2] >> 1) & 0x1
    if layer == 1:
        return (12 * kbps * 1000 // hertz + padding) * 4
    per_frame = 72 if layer == 3 and version != 3 else 144
    return per_frame * kbps * 1000 // hertz + padding


def _mp3_missing(data: bytes) -> str | None:
    at = _id3_end(data)
    while at + 4 <= len(data):
        if not _mpeg_audio_sync(data, at):
            return None  # a trailing tag (ID3v1, APE) or junk: the decoder judges
        size = _mpeg_frame_bytes(data, at)
        if size == 0:
            return None  # free format: frame lengths are not in the headers
        if at + size > len(data):
            return f"frame at byte {at} declares {size} bytes, {len(data) - at} are present"
        at += size
    if at < len(data) and data[at] == 0xFF:
        return f"frame at byte {at} is cut inside its header"
    return None


_COMPLETENESS = {
    "wav": _wav_missing,
    "mp4": _mp4_missing,
    "webm": _webm_missing,
    "ogg": _ogg_missing,
    "mp3": _mp3_missing,
}
