"""Media decoders: image, video and audio bytes into patches, tubes and frames (pure, picklable, no torch)."""

from .audio import audio_units
from .image import image_units
from .limits import MediaError, MediaLimits
from .sniff import ACCEPTED, expect, sniff
from .units import Units
from .video import video_units

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
