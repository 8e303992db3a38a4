"""Container sniffing, modality checks, limits and the error type shared by the media decoders
(`uform.media`): magic bytes of real files, refusals by modality, pickling across worker processes."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
from media_samples import encode_image, encode_sound, opus_webm, photo, pygame_file, recording, skimage_file, video

from uform.media import (
    ACCEPTED,
    MediaError,
    MediaLimits,
    Units,
    audio_units,
    expect,
    image_units,
    sniff,
    video_units,
)
from uform.media.sniff import check_complete

REAL = {
    "jpeg": lambda: skimage_file("rocket.jpg"),
    "png": lambda: skimage_file("astronaut.png"),
    "webp": lambda: pygame_file("scarlet.webp"),
    "mp4": lambda: video("mp4")[0],
    "webm": lambda: video("webm")[0],
    "wav": lambda: pygame_file("house_lo.wav"),
    "flac": lambda: encode_sound(*recording(), "FLAC"),
    "mp3": lambda: pygame_file("house_lo.mp3"),
    "ogg": lambda: pygame_file("house_lo.ogg"),
}


@pytest.mark.parametrize("container", sorted(REAL))
def test_sniff_real_files(container: str) -> None:
    data = REAL[container]()
    assert sniff(data) == container
    check_complete(container, data)  # whole files pass the truncation check
    for kind, containers in ACCEPTED.items():
        if container in containers:
            assert expect(kind, data) == container
        else:
            with pytest.raises(MediaError, match=r"^not a"):
                expect(kind, data)


def test_sniff_other_and_odd_bytes() -> None:
    for data in (
        pygame_file("alien1.gif"),
        pygame_file("arraydemo.bmp"),
        skimage_file("multipage.tif"),
        pygame_file("blue.mpg"),
        b"",
        b"\xff",
        b"\xff\xf1\x50\x80",  # AAC ADTS: layer bits 00, not MPEG audio
        b"\xff\xfb\xf0\x00",  # MP3 sync with the invalid bitrate index 1111
        b"RIFF\x00\x00\x00\x00AVI ",
    ):
        assert sniff(data) is None
    assert sniff(b"\xff\xfb\x90\x64" + bytes(40)) == "mp3"
    id3 = b"ID3\x04\x00\x00\x00\x00\x00\x0a" + bytes(10)
    assert sniff(id3 + b"\xff\xfb\x90\x64") == "mp3"
    assert sniff(id3 + encode_sound(*recording(), "FLAC")) == "flac"  # FLAC behind an ID3 tag


def test_expect_refusals_name_the_modality() -> None:
    wav = pygame_file("boom.wav")
    with pytest.raises(MediaError, match="not a JPEG, PNG or WebP file"):
        expect("image", wav)
    with pytest.raises(MediaError, match="not an MP4 or WebM file"):
        expect("video", wav)
    with pytest.raises(MediaError, match="not a WAV, FLAC, MP3, Ogg or WebM file"):
        expect("audio", skimage_file("rocket.jpg"))
    assert expect("audio", opus_webm()) == "webm"
    with pytest.raises(MediaError, match="empty"):
        expect("audio", b"")
    with pytest.raises(MediaError, match="bytes is over the limit"):
        expect("audio", wav, MediaLimits(max_bytes=len(wav) - 1))
    with pytest.raises(ValueError, match="kind"):
        expect("text", wav)


def test_bytes_like_contents() -> None:
    data = encode_image(photo("coffee.png").crop((0, 0, 40, 30)), "PNG")
    reference = image_units(data, patch_side=8, channels=3, max_units=100)
    for like in (bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)):
        units = image_units(like, patch_side=8, channels=3, max_units=100)
        np.testing.assert_array_equal(units.values, reference.values)
    with pytest.raises(TypeError):
        image_units("not bytes", patch_side=8, channels=3, max_units=100)


def test_media_error() -> None:
    error = MediaError("not a JPEG, PNG or WebP file")
    assert isinstance(error, ValueError) and error.reason == "not a JPEG, PNG or WebP file" and error.item is None
    assert str(error) == "not a JPEG, PNG or WebP file"
    error.item = 3
    assert str(error) == "contents[3]: not a JPEG, PNG or WebP file"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is MediaError and copy.reason == error.reason and copy.item == 3 and str(copy) == str(error)
    assert str(MediaError("empty content (zero bytes)", item=0)) == "contents[0]: empty content (zero bytes)"


def test_media_limits() -> None:
    limits = MediaLimits()
    assert (limits.max_bytes, limits.max_pixels, limits.max_frames) == (256 * 2**20, 4000 * 4000, 100_000)
    assert limits.max_frame_pixels == 2560 * 2560
    assert (limits.max_seconds, limits.timeout_seconds) == (3600.0, 30.0)
    assert [field.name for field in dataclasses.fields(MediaLimits)] == [
        "max_bytes",
        "max_pixels",
        "max_frame_pixels",
        "max_frames",
        "max_seconds",
        "timeout_seconds",
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.max_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        MediaLimits(1)  # type: ignore[misc]
    for bad in (
        {"max_bytes": 0},
        {"max_pixels": -1},
        {"max_frame_pixels": 0},
        {"max_frames": 1.5},
        {"max_seconds": 0},
        {"timeout_seconds": -1.0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MediaLimits(**bad)  # type: ignore[arg-type]
    assert pickle.loads(pickle.dumps(MediaLimits(max_seconds=2.5))) == MediaLimits(max_seconds=2.5)


def test_decoders_and_units_pickle() -> None:
    for function in (image_units, video_units, audio_units, sniff, expect):
        assert pickle.loads(pickle.dumps(function)) is function
    units = audio_units(pygame_file("boom.wav"), chunk_samples=160, sample_rate=8000, max_units=20)
    assert isinstance(units, Units) and units.truncated
    copy = pickle.loads(pickle.dumps(units))
    np.testing.assert_array_equal(copy.values, units.values)
    np.testing.assert_array_equal(copy.positions, units.positions)
    assert copy.grid == units.grid == (20, 1, 1) and copy.truncated
