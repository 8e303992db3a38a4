"""Limits every decoded item must respect, and the error that names a refused item's reason."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, frozen=True)
class MediaLimits:
    """Bounds on one media item; an item that breaks one raises `MediaError` instead of being decoded."""

    max_bytes: int = 256 * 2**20
    """Largest encoded item, in bytes."""

    max_pixels: int = 4000 * 4000
    """Largest width x height of an image (checked from the header before decoding).

    The default, 16 M pixels (4000 x 4000; a 12 M pixel phone photo fits), keeps one decoder process's peak
    memory under 256 MB: decoding takes up to about 16 bytes per pixel (a lossless WebP, measured at 244 MB
    at the limit; PNG 80-140 MB, JPEG less). Raising it raises that bound in proportion, per decoder."""

    max_frame_pixels: int = 2560 * 2560
    """Largest width x height of one video frame (from the header before decoding, and of every frame).

    Lower than `max_pixels` because a video decoder holds many frames at once (H.264 up to 16 references,
    1.5 bytes a pixel each): at the default 6.5 M pixels (2560 x 2560; 1440p and ultrawide 3440 x 1440 fit,
    4K UHD does not) one decoder's peak stays under 256 MB even for a stream that uses all 16 (measured
    248 MB; a common stream with a few references takes far less). 4K UHD needs 3840 * 2160 here: up to
    about 310 MB a decoder."""

    max_frames: int = 100_000
    """Most source frames of a video (from the header when it says, and while decoding)."""

    max_seconds: float = 3600.0
    """Longest audio or video duration, in seconds (from the header when it says, and while decoding)."""

    timeout_seconds: float = 30.0
    """Wall-clock budget to decode one item; enforced by the worker pool, not by the decoders."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_frame_pixels", "max_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MediaLimits.{name} must be a positive int, got {value!r}")
        for name in ("max_seconds", "timeout_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"MediaLimits.{name} must be a positive number of seconds, got {value!r}")


class MediaError(ValueError):
    """A media item that cannot be decoded or breaks a limit.

    `reason` says why in words; `item` is the item's index in the step's `contents`, set by the caller that
    knows it (then `str()` reads "contents[3]: not a JPEG, PNG or WebP file").
    """

    def __init__(self, reason: str, item: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.item = item

    def __str__(self) -> str:
        return self.reason if self.item is None else f"contents[{self.item}]: {self.reason}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses process boundaries (decoding runs in workers): keep both fields through pickling.
        return (type(self), (self.reason, self.item))


def describe(error: BaseException) -> str:
    """A one-line account of a decoding library's exception (FFmpeg's errors without their errno)."""
    strerror = getattr(error, "strerror", None)
    lines = (strerror if isinstance(strerror, str) and strerror else str(error)).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
