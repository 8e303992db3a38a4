"""Media decoders: image, video and audio bytes into patches, tubes and frames (pure, picklable, no torch).

Names resolve lazily (PEP 562), so that text-only use of uform never imports Pillow, PyAV, soundfile or
soxr.
"""

import importlib
from typing import TYPE_CHECKING, Any

# The light modules load eagerly (numpy and the standard library only); note that `sniff` names both a
# submodule and its function, and the function wins here.
from .limits import MediaError, MediaLimits
from .sniff import ACCEPTED, expect, sniff
from .units import Units

_WHERE = {"audio_units": "audio", "image_units": "image", "video_units": "video"}

__all__ = [
    "ACCEPTED",
    "MediaError",
    "MediaLimits",
    "Units",
    "audio_units",
    "expect",
    "image_units",
    "sniff",
    "video_units",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:  # the package's one lazy import (PEP 562; why: the docstring)
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'uform.media' has no attribute {name!r}")


if TYPE_CHECKING:
    from .audio import audio_units
    from .image import image_units
    from .video import video_units
