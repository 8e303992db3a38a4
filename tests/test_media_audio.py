"""Audio decoding (`uform.media.audio_units`) on pygame's recordings (WAV: 8-bit PCM and MS ADPCM; Ogg
Vorbis; MP3) and their transcodes made here (FLAC, Opus in Ogg and WebM, Yamaha ADPCM WAV).

Pins: every container decodes (soundfile first, PyAV for what it cannot read); resampling gives
duration x sample_rate samples; channels are mixed to mono; recordings are normalised (mean 0, std 1;
silence stays zeros); a long recording is cut and marked truncated; broken, hostile and wrong-format bytes
and limit breaches raise `MediaError` and nothing else.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import soundfile
import soxr
from media_samples import (
    cuts,
    encode_sound,
    mutations,
    opus_webm,
    pygame_file,
    recording,
    skimage_file,
    video,
    wav_by_pyav,
)

from uform.media import MediaError, MediaLimits, audio_units

RATE = 16000
HOUSE = recording("house_lo.wav")  # 7.1 s at 11025 Hz, mono


def decode(data: bytes, *, chunk_samples: int = 400, sample_rate: int = RATE, max_units: int = 10_000, **limits: Any):
    return audio_units(
        data, chunk_samples=chunk_samples, sample_rate=sample_rate, max_units=max_units, limits=MediaLimits(**limits)
    )


def unpadded(units, length: int) -> np.ndarray:
    return units.values.reshape(-1)[:length]


SAMPLES: dict[str, tuple[Callable[[], bytes], float]] = {
    "wav pcm u8 (house)": (lambda: pygame_file("house_lo.wav"), 7.105),
    "wav ms adpcm (secosmic)": (lambda: pygame_file("secosmic_lo.wav"), 3.265),
    "wav pcm u8 (boom)": (lambda: pygame_file("boom.wav"), 1.128),
    "ogg vorbis (house)": (lambda: pygame_file("house_lo.ogg"), 7.105),
    "mp3 (house)": (lambda: pygame_file("house_lo.mp3"), 7.105),
    "flac": (lambda: encode_sound(*HOUSE, "FLAC"), 7.105),
    "ogg opus": (lambda: encode_sound(soxr.resample(HOUSE[0], HOUSE[1], 48000), 48000, "OGG", "OPUS"), 7.105),
    "webm opus": (opus_webm, 7.105),
    "wav yamaha adpcm (pyav)": (wav_by_pyav, 7.105),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_container_decodes(name: str) -> None:
    make, seconds = SAMPLES[name]
    units = decode(make())
    count = units.values.shape[0]
    assert abs(count - seconds * RATE / 400) <= 0.03 * seconds * RATE / 400 + 2
    assert units.values.dtype == np.float32 and units.values.shape == (count, 400)
    assert units.grid == (count, 1, 1) and units.truncated is False
    steps = np.arange(count)
    np.testing.assert_array_equal(units.positions, np.stack([steps, steps, steps], axis=1))
    assert units.positions.dtype == np.int64
    assert np.isfinite(units.values).all() and abs(units.values.std() - 1) < 0.05


def test_pyav_fallback_matches_soundfile() -> None:
    with pytest.raises(soundfile.LibsndfileError):
        soundfile.info(io.BytesIO(wav_by_pyav()))
    direct, fallback = decode(pygame_file("house_lo.wav")), decode(wav_by_pyav())
    length = min(direct.values.size, fallback.values.size) - 400
    correlation = np.corrcoef(unpadded(direct, length), unpadded(fallback, length))[0, 1]
    assert correlation > 0.95  # lossy ADPCM of the same recording


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100])
def test_resampled_length_and_normalised(rate: int) -> None:
    samples, source_rate = HOUSE
    expected = len(samples) * rate / source_rate
    units = decode(pygame_file("house_lo.wav"), chunk_samples=1, sample_rate=rate, max_units=10**6)
    assert abs(len(units) - expected) <= 1
    values = units.values[:, 0].astype(np.float64)
    assert abs(values.mean()) < 1e-5 and abs(values.std() - 1) < 1e-3


def test_matching_rate_is_not_resampled() -> None:
    samples = soxr.resample(HOUSE[0], HOUSE[1], RATE)
    data = encode_sound(samples, RATE, "FLAC", "PCM_16")
    stored, _ = soundfile.read(io.BytesIO(data), dtype="float64")
    units = decode(data, chunk_samples=1, max_units=10**6)
    assert len(units) == len(stored)
    normalised = (stored - stored.mean()) / np.sqrt(stored.var() + 1e-7)
    np.testing.assert_allclose(units.values[:, 0], normalised, atol=2e-5)


def test_chunks_padded_with_zeros() -> None:
    samples, rate = HOUSE
    data = encode_sound(samples, rate, "WAV", "PCM_16")
    units = decode(data, chunk_samples=1000, sample_rate=rate)
    assert len(units) == -(-len(samples) // 1000)
    tail = len(units) * 1000 - len(samples)
    assert tail > 0 and not units.values[-1, 1000 - tail :].any()
    assert units.values[-1, : 1000 - tail].any()


def test_mixed_down_to_mono() -> None:
    samples, rate = HOUSE
    mono = decode(encode_sound(samples, rate, "FLAC"))
    same = decode(encode_sound(np.stack([samples, samples], axis=1), rate, "FLAC"))
    np.testing.assert_allclose(same.values, mono.values, atol=1e-5)
    one_side = decode(encode_sound(np.stack([samples, np.zeros_like(samples)], axis=1), rate, "FLAC"))
    np.testing.assert_allclose(one_side.values, mono.values, atol=1e-3)  # the mean halves it; normalising undoes that
    other, _ = recording("secosmic_lo.wav")
    both = np.zeros((len(samples), 2), np.float32)
    both[:, 0], both[: len(other), 1] = samples, other[: len(samples)]
    data = encode_sound(both, rate, "WAV", "FLOAT")
    mixed = decode(data, chunk_samples=1, sample_rate=rate, max_units=10**6).values[:, 0]
    expected = both.mean(axis=1).astype(np.float64)
    expected = (expected - expected.mean()) / np.sqrt(expected.var() + 1e-7)
    np.testing.assert_allclose(mixed, expected, atol=1e-4)


def test_silence_stays_zeros() -> None:
    samples, rate = HOUSE
    units = decode(encode_sound(samples * 0, rate, "WAV", "FLOAT"))
    assert len(units) > 0 and np.isfinite(units.values).all() and not units.values.any()
    # Opposite channels cancel in the mix (to 16-bit rounding): near-silence is not blown up to unit variance.
    units = decode(encode_sound(np.stack([samples, -samples], axis=1), rate, "FLAC"))
    assert np.isfinite(units.values).all() and units.values.std() < 0.05


@pytest.mark.parametrize("name", ["wav pcm u8 (house)", "mp3 (house)", "webm opus"])
def test_long_recording_cut_and_truncated(name: str) -> None:
    data = SAMPLES[name][0]()
    full = decode(data)
    cut = decode(data, max_units=25)
    assert full.truncated is False and cut.truncated is True
    assert cut.grid == (25, 1, 1) and cut.values.shape == (25, 400)
    values = cut.values.reshape(-1).astype(np.float64)
    assert abs(values.mean()) < 1e-5 and abs(values.std() - 1) < 1e-3  # normalised over what was kept
    # The kept part is the recording's beginning (up to the normalisation's scale and shift).
    assert np.corrcoef(values[:-400], full.values.reshape(-1)[: values.size - 400])[0, 1] > 0.999
    exact = decode(data, max_units=len(full))
    assert exact.truncated is False and len(exact) == len(full)


def test_non_finite_samples_refused() -> None:
    samples, rate = HOUSE
    broken = samples.copy()
    broken[1000] = np.nan
    with pytest.raises(MediaError, match="not finite"):
        decode(encode_sound(broken, rate, "WAV", "FLOAT"))


# Broken and hostile bytes: always MediaError, never another exception.


@pytest.mark.parametrize(
    "other",
    [
        lambda: skimage_file("astronaut.png"),
        lambda: skimage_file("rocket.jpg"),
        lambda: video("mp4")[0],
        lambda: pygame_file("blue.mpg"),
        lambda: b"just some text, not a recording",
    ],
    ids=["png", "jpeg", "mp4", "mpeg-ps", "text"],
)
def test_other_formats_refused(other) -> None:
    with pytest.raises(MediaError, match="not a WAV, FLAC, MP3, Ogg or WebM file"):
        decode(other())


def test_webm_without_audio_refused() -> None:
    with pytest.raises(MediaError, match="no audio stream"):
        decode(video("webm")[0])


def test_zero_bytes_refused() -> None:
    with pytest.raises(MediaError, match="empty"):
        decode(b"")


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_truncated_refused(name: str) -> None:
    for cut in cuts(SAMPLES[name][0]()):
        with pytest.raises(MediaError):
            decode(cut)


@pytest.mark.parametrize("name", ["wav pcm u8 (house)", "ogg vorbis (house)", "mp3 (house)", "flac", "webm opus"])
def test_random_and_corrupted_bytes_only_raise_media_error(name: str) -> None:
    data = SAMPLES[name][0]()
    rng = np.random.default_rng(13)
    for candidate in [rng.bytes(4096), data[:44] + rng.bytes(4096), *mutations(data, 10, seed=9, keep=44)]:
        try:
            units = decode(candidate, max_units=50)
        except MediaError:
            continue
        assert units.values.dtype == np.float32 and len(units) <= 50 and np.isfinite(units.values).all()


@pytest.mark.parametrize("name", ["wav pcm u8 (house)", "mp3 (house)", "flac", "webm opus"])
def test_limits(name: str) -> None:
    data = SAMPLES[name][0]()
    with pytest.raises(MediaError, match="lasts"):
        decode(data, max_seconds=5.0)
    with pytest.raises(MediaError, match="bytes"):
        decode(data, max_bytes=len(data) - 1)
    decode(data, max_seconds=8.0, max_bytes=len(data))


def test_forged_sample_rate_refused() -> None:
    # pygame's house (8-bit WAV at 11025 Hz) with its header claiming 200 MHz: 7 s become 0.4 ms, under any
    # duration limit, and every sample of the file would be read (as float32) to cover the kept length.
    data = bytearray(pygame_file("house_lo.wav"))
    assert data[12:16] == b"fmt " and int.from_bytes(data[24:28], "little") == 11025
    data[24:28] = (200_000_000).to_bytes(4, "little")
    data[28:32] = (200_000_000 * int.from_bytes(data[32:34], "little")).to_bytes(4, "little")
    with pytest.raises(MediaError, match="sample rate of 200000000 Hz is over the limit of 768000 Hz"):
        decode(bytes(data))
    # The highest admitted rate still decodes.
    data[24:28] = (768_000).to_bytes(4, "little")
    data[28:32] = (768_000 * int.from_bytes(data[32:34], "little")).to_bytes(4, "little")
    assert len(decode(bytes(data), max_units=4)) >= 1


def test_many_channels_mixed_down_as_read() -> None:
    # Eight channels, each the house recording scaled: the mix-down equals the mean, block by block.
    samples, rate = HOUSE
    scales = np.arange(1, 9, dtype=np.float32) / 8
    wide = samples[:, None] * scales[None, :]
    units = decode(encode_sound(wide, rate, "WAV", "FLOAT"), sample_rate=rate)
    reference = decode(encode_sound(wide.mean(axis=1, dtype=np.float32), rate, "WAV", "FLOAT"), sample_rate=rate)
    np.testing.assert_array_equal(units.values, reference.values)


def test_bad_arguments_are_value_errors() -> None:
    data = pygame_file("boom.wav")
    for arguments in ({"chunk_samples": 0}, {"sample_rate": 0}, {"max_units": -1}):
        with pytest.raises(ValueError) as raised:
            decode(data, **arguments)  # type: ignore[arg-type]
        assert not isinstance(raised.value, MediaError)
