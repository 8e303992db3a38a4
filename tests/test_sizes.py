"""Item lengths from headers (`uform.sources.sizes`, issue 13 item 4) against what the decoders really make:
exact for MP4 video, FLAC and Ogg, an upper bound within its margin for MP3, a whole row where the header
cannot say (WebM video, bytes that do not read)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile

from tests.media_samples import encode_sound, recording, video
from uform import TrainerInitVramConfig
from uform.config import AudioShape, BatchShape, Schedule, VideoShape, resolve
from uform.enums import LateInteractionSide, Modality
from uform.media import audio_units, video_units
from uform.sources.sizes import MP3_MARGIN, clip_units, item_length, max_units, sound_units


@pytest.mark.parametrize(
    ("frames", "stride", "tube", "most"),
    [
        (12, 1, 2, 1000),
        (12, 2, 2, 1000),
        (11, 1, 2, 1000),
        (12, 1, 4, 40),
        (12, 3, 2, 13),
        (1, 1, 2, 1000),
        (12, 1, 2, 5),
    ],
)
def test_an_mp4_clip_is_counted_as_the_decoder_tiles_it(frames: int, stride: int, tube: int, most: int) -> None:
    data, _ = video("mp4", frames=frames)
    decoded = video_units(data, patch_side=8, tube_frames=tube, frame_stride=stride, channels=3, max_units=most)
    assert clip_units(data, 8, tube, stride, most) == decoded.values.shape[0]


def test_a_webm_clip_and_bad_bytes_have_no_header_count() -> None:
    data, _ = video("webm")
    assert clip_units(data, 8, 2, 1, 1000) is None
    mp4, _ = video("mp4")
    assert clip_units(mp4[: len(mp4) // 3], 8, 2, 1, 1000) is None  # PyAV writes the index (moov) last
    assert clip_units(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64, 8, 2, 1, 1000) is None


@pytest.mark.parametrize(("container", "subtype"), [("FLAC", None), ("OGG", "VORBIS")])
@pytest.mark.parametrize("rate", [16000, 22050])
def test_flac_and_ogg_are_counted_exactly(container: str, subtype: str | None, rate: int) -> None:
    samples, source_rate = recording()
    data = encode_sound(samples, source_rate, container, subtype)
    decoded = audio_units(data, chunk_samples=400, sample_rate=rate, max_units=100_000)
    assert sound_units(data, 400, rate, 100_000) == decoded.values.shape[0]
    cut = audio_units(data, chunk_samples=400, sample_rate=rate, max_units=7)
    assert sound_units(data, 400, rate, 7) == cut.values.shape[0] == 7


def test_an_mp3_is_counted_within_its_margin_never_short() -> None:
    if "MP3" not in soundfile.available_formats():
        pytest.skip("this libsndfile writes no MP3")
    samples, source_rate = recording()
    data = encode_sound(samples, source_rate, "MP3")
    decoded = audio_units(data, chunk_samples=400, sample_rate=16000, max_units=100_000).values.shape[0]
    counted = sound_units(data, 400, 16000, 100_000)
    assert counted is not None and decoded <= counted <= decoded * MP3_MARGIN + 2


def _config() -> TrainerInitVramConfig:
    return resolve(
        TrainerInitVramConfig(
            depth=1,
            hidden=128,
            schedule=Schedule(steps=1),
            batch=BatchShape(
                max_rows_per_device=2,
                max_segments_per_device=8,
                max_columns_per_row=256,
                video=VideoShape(patch_side=8, tube_frames=2),
                audio=AudioShape(chunk_samples=400),
            ),
        )
    )


def test_item_length_uses_the_headers_and_falls_back_to_a_row() -> None:
    config = _config()
    most = max_units(config)
    mp4, _ = video("mp4")
    webm, _ = video("webm")
    samples, rate = recording()
    flac = encode_sound(samples, rate, "FLAC")
    none = LateInteractionSide.None_
    clip = video_units(mp4, patch_side=8, tube_frames=2, frame_stride=1, channels=3, max_units=most)
    assert item_length(config, Modality.Video, mp4, none, False) == 1 + clip.values.shape[0] < 1 + most
    assert item_length(config, Modality.Video, webm, none, False) == 1 + most
    assert item_length(config, Modality.Audio, flac, none, False) == 1 + most  # a long recording fills a row
    short = encode_sound(np.zeros(4000, dtype=np.float32), 16000, "FLAC")
    assert item_length(config, Modality.Audio, short, none, False) == 1 + 10
    assert item_length(config, Modality.Audio, b"not audio at all", none, False) == 1 + most
