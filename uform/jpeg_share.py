"""Serving's JPEGs shared between the GPU decoder and the host's decoders (`uform.load(..., jpeg="split")`).

With `jpeg="device"` the GPU takes every JPEG it can decode and the host's decoder processes sit idle; with
`jpeg="host"` the processes take them all and the GPU decoder is never used. Split, each window of a call gives the
first part of its images to the GPU decoder and the rest to the host's decoders, and both decode at once (serving's
decoding thread plans and decodes the GPU's part while a helper thread waits for the processes). The part is
each side's share of the images a second both showed on the windows before, so that the two finish together: a
side that finished early gets more next time. Nothing here decodes; `Model._decode` times the two sides and tells
`JpegShare.learn`. (The same idea as DALI's mixed decoding, whose host and device stages split a JPEG's work; here
the split is by whole pictures.)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

__all__ = ["JpegShare"]

LEAST = 0.05
"""A side's share never falls below this (nor rises above 1 - LEAST), so that both keep being measured."""

MEMORY = 0.5
"""Weight of the rate a side showed before, against its newest window's (an average that forgets)."""


class JpegShare:
    """The GPU decoder's share of a window's images, learnt from how fast each side decoded its part."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates = {"host": 0.0, "device": 0.0}  # images a second, 0: not measured yet

    @property
    def device_share(self) -> float:
        """The part of a window's images the GPU decoder takes next: half until both sides were measured."""
        with self._lock:
            host, device = self._rates["host"], self._rates["device"]
        if host <= 0.0 or device <= 0.0:
            return 0.5
        return min(1.0 - LEAST, max(LEAST, device / (host + device)))

    def split(self, images: Sequence[int]) -> tuple[list[int], list[int]]:
        """(the GPU's part, the host's part) of a window's images, in their order: the first
        round(share * count) to the GPU decoder."""
        count = round(self.device_share * len(images))
        return list(images[:count]), list(images[count:])

    def learn(self, side: str, images: int, seconds: float) -> None:
        """`side` ("host" or "device") decoded `images` in `seconds`; a side with nothing to decode teaches
        nothing."""
        if side not in self._rates:
            raise ValueError(f'side: must be "host" or "device", got {side!r}')
        if images <= 0 or seconds <= 0.0:
            return
        rate = images / seconds
        with self._lock:
            old = self._rates[side]
            self._rates[side] = rate if old <= 0.0 else MEMORY * old + (1.0 - MEMORY) * rate

    def rates(self) -> dict[str, float]:
        """Images a second each side showed, as averaged so far (0: not measured yet)."""
        with self._lock:
            return dict(self._rates)
