"""What each item takes of a step before it is decoded: its length in positions, as the packer counts it.

Text: its prefix and bytes (cut at a row by the packer, as the seed cuts it), plus the appended MASK of an
item making a choice. An image: its prefix and patch grid, read from the header alone (Pillow opens an
image lazily: it reads the size and the EXIF orientation, not the pixels), downscaled as the decoder
downscales it to fit a row (`media.grid.fit_size`; where libjpeg's draft scale applies first, a patch or
two may differ). A WAV recording: its frames from the `fmt ` and `data` chunks. FLAC, Ogg and MP3: the
frames libsndfile's header read gives (FLAC's STREAMINFO, Ogg's last granule position: exact; MP3's from a
Xing/Info header or the bit rate: an estimate, so it is counted with a margin). An MP4 video: its stream's
frame count and size from the container's index (PyAV demuxes the header, nothing is decoded), sampled,
grouped into tube-times and downscaled as the decoder does. A WebM video (no frame count in its header) and
any item whose header does not read are counted a whole row, the most a decoded item takes (the decoder
downscales and cuts to fit one): never overfull, at the price of the room a short item leaves unused. The
trainer's decoders skip and count an item that does not decode.
"""

from __future__ import annotations

import io
import math

from .. import vocab
from ..config import TrainerInitVramConfig
from ..enums import LateInteractionSide, Modality
from ..media.grid import fit_size, grid_of
from ..media.sniff import sniff

_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that turn an image by a quarter turn
_EXIF_ORIENTATION = 0x0112


def max_units(config: TrainerInitVramConfig) -> int:
    """Units a media item keeps at most: a row less its prefix (as the trainer's decoders are asked)."""
    return config.batch.max_columns_per_row - (2 if config.late_interaction.weight > 0 else 1)


def image_units(data: bytes, patch_side: int, most: int) -> int | None:
    """Patches an image decodes into (after the decoder's downscale to `most`), from its header; None when
    the header does not read as a JPEG, PNG or WebP image."""
    if sniff(data) not in ("jpeg", "png", "webp"):
        return None
    from PIL import Image  # local: Pillow loads where images are read, never for text-only data

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            try:
                orientation = int(image.getexif().get(_EXIF_ORIENTATION, 1))
            except Exception:  # a broken EXIF block leaves the image as stored, as the decoder does
                orientation = 1
    except Exception:  # Pillow answers hostile headers with many exception types
        return None
    if width < 1 or height < 1:
        return None
    upright = (height, width) if orientation in _SWAPS_SIDES else (width, height)
    rows, columns = grid_of(*fit_size(*upright, patch_side, most), patch_side)
    return rows * columns


def wav_units(data: bytes, chunk_samples: int, sample_rate: int, most: int) -> int | None:
    """Frames a WAV recording decodes into (resampled to `sample_rate`, cut to `most` frames), from its `fmt `
    and `data` chunk headers; an upper bound where it is resampled (the resampler's length rounds). None
    when the chunks do not read."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    at, rate, block = 12, 0, 0
    while at + 8 <= len(data):
        kind, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        if kind == b"fmt " and size >= 16:
            rate = int.from_bytes(data[at + 12 : at + 16], "little")
            block = int.from_bytes(data[at + 20 : at + 22], "little")
        elif kind == b"data":
            if not rate or not block or size in (0, 0xFFFFFFFF):
                return None  # an open-ended stream or an odd layout: the decoder says
            frames = min(size, len(data) - at - 8) // block
            return _audio_units(frames, rate, chunk_samples, sample_rate, most)
        at += 8 + size + (size & 1)
    return None


MP3_MARGIN = 1.05
"""An MP3's header frame count is an estimate where no Xing/Info header says: counted 5% long (and a
chunk more), so that the step it lands in is not overfull."""


def sound_units(data: bytes, chunk_samples: int, sample_rate: int, most: int) -> int | None:
    """Frames a FLAC, Ogg or MP3 recording decodes into (resampled to `sample_rate`, cut to `most`), from the
    header libsndfile reads; None where it does not read (the decoder then says) or gives no length."""
    kind = sniff(data)
    if kind not in ("flac", "ogg", "mp3"):
        return None
    import soundfile  # local: libsndfile loads where audio is read, never for text or image data

    try:
        info = soundfile.info(io.BytesIO(data))
        rate, frames = int(info.samplerate), int(info.frames)
    except Exception:  # libsndfile answers hostile headers with several exception types
        return None
    if rate < 1 or frames < 1:
        return None
    if kind == "mp3":
        frames = math.ceil(frames * MP3_MARGIN) + chunk_samples
    return _audio_units(frames, rate, chunk_samples, sample_rate, most)


def _audio_units(frames: int, rate: int, chunk_samples: int, sample_rate: int, most: int) -> int:
    """Frames of `chunk_samples` that `frames` source samples at `rate` make once resampled to `sample_rate`
    (rounded up, as the resampler's length may be) and cut to `most`."""
    samples = frames if rate == sample_rate else -(-frames * sample_rate // rate)
    return min(most, -(-samples // chunk_samples))


def clip_units(data: bytes, patch_side: int, tube_frames: int, frame_stride: int, most: int) -> int | None:
    """Tubes an MP4 video decodes into (`media.video.video_units`' sampling, tube-times and downscale), from
    its first video stream's frame count and size in the container's header; None where the header does not
    read or gives no frame count (WebM keeps none)."""
    if sniff(data) != "mp4":
        return None
    from ..media.video import header_frames  # local: PyAV loads where video is read

    header = header_frames(data)
    if header is None:
        return None
    width, height, frames = header
    rows, columns = grid_of(*fit_size(width, height, patch_side, most), patch_side)
    keep_times = most // (rows * columns)
    complete = max(1, -(-frames // frame_stride) // tube_frames)  # one short group repeats its last frame
    return min(complete, keep_times) * rows * columns


def item_length(
    config: TrainerInitVramConfig, modality: Modality, content: bytes, side: LateInteractionSide, chooses: bool
) -> int:
    """The positions one item takes (prefix + content), as `data.batch.prepare` counts it: not yet cut at a
    row for text (the packer cuts it), at most a row for media."""
    late = config.late_interaction.weight > 0
    prefix = len(vocab.prefix(modality, side if late else None))
    if modality == Modality.Text:
        return prefix + len(content) + int(chooses)
    most = max_units(config)
    if modality == Modality.Image:
        units = image_units(content, config.batch.image.patch_side, most)
        return prefix + (most if units is None else units)
    if modality == Modality.Audio:
        audio = config.batch.audio
        units = wav_units(content, audio.chunk_samples, audio.sample_rate, most)
        if units is None:
            units = sound_units(content, audio.chunk_samples, audio.sample_rate, most)
        return prefix + (most if units is None else units)
    if modality == Modality.Video:
        video = config.batch.video
        units = clip_units(content, video.patch_side, video.tube_frames, video.frame_stride, most)
        return prefix + (most if units is None else units)
    return prefix + most
