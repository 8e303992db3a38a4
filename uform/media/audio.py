"""Audio (WAV, FLAC, MP3, Ogg through soundfile; PyAV for the rest) into normalised mono frames."""

from __future__ import annotations

import io
import math
from typing import Any

import av
import numpy as np
import soundfile
import soxr

from ._pyav import open_input
from .grid import check_arguments
from .limits import MediaError, MediaLimits, describe
from .sniff import as_bytes, check_complete, expect
from .units import Units

_DEMUXER = {"wav": "wav", "flac": "flac", "mp3": "mp3", "ogg": "ogg", "webm": "webm"}
_NAME = {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "ogg": "Ogg", "webm": "WebM"}
# Source samples decoded past the kept length, so that the resampler's filter sees real context at the cut.
_CONTEXT = 1024
# The highest source sample rate decoded (studio formats top out at 768 kHz); the source samples held before
# resampling are at most `MAX_SOURCE_RATE / sample_rate` times the kept ones.
MAX_SOURCE_RATE = 768_000
_BLOCK_FRAMES = 1 << 16  # source frames (all channels) read by soundfile at a time
# wav2vec 2.0's feature extractor divides by sqrt(variance + 1e-7): silence stays zeros, never NaN.
_EPSILON = 1e-7


def audio_units(
    data: Any,
    *,
    chunk_samples: int,
    sample_rate: int,
    max_units: int,
    limits: MediaLimits = MediaLimits(),  # noqa: B008 (frozen, so a shared default is safe)
) -> Units:
    """Decode a WAV, FLAC, MP3, Ogg or WebM recording into frames of `chunk_samples` at `sample_rate`.

    soundfile decodes first; what it cannot read (Opus in WebM, odd WAV codecs) goes to PyAV (first audio
    stream). Channels are mixed down to mono (their mean), resampled with soxr (skipped when the rates
    match), cut to `max_units * chunk_samples` samples (then `truncated`; decoding stops there),
    normalised over the kept recording (mean 0, variance 1 up to wav2vec 2.0's epsilon; silence stays
    zeros) and zero-padded to whole frames. Values are [N, chunk_samples] float32; frame n sits at position
    (n, n, n); grid (N, 1, 1).

    Raises MediaError for bytes that are not one of those containers, that hold no decodable audio, whose
    samples are not finite, whose sample rate is over `MAX_SOURCE_RATE`, or that break `limits` (bytes;
    duration from the header before decoding, and while decoding where the header does not say). What is
    held is bounded by the kept length, not the file: at most `max_units * chunk_samples` samples times the
    source-to-target rate ratio, mono (channels are mixed down as they are read).
    """
    check_arguments(chunk_samples=chunk_samples, sample_rate=sample_rate, max_units=max_units)
    data = as_bytes(data)
    container = expect("audio", data, limits)
    check_complete(container, data)
    wanted = max_units * chunk_samples
    try:
        decoded = None
        if container != "webm":  # libsndfile reads no Matroska
            try:
                decoded = _with_soundfile(data, wanted, sample_rate, limits)
            except MediaError:
                raise
            except Exception:  # a codec or a file layout libsndfile cannot read: PyAV's turn
                decoded = None
        if decoded is None:
            decoded = _with_pyav(data, container, wanted, sample_rate, limits)
    except MediaError:
        raise
    except Exception as error:  # the decoders answer hostile bytes with many exception types
        raise MediaError(f"cannot decode the {_NAME[container]} audio: {describe(error)}") from error
    mono, rate, more = decoded
    if not np.isfinite(mono).all():
        raise MediaError(f"the {_NAME[container]} audio holds samples that are not finite")
    if rate != sample_rate and mono.size:
        mono = soxr.resample(mono, rate, sample_rate, quality="HQ")
    if mono.size == 0:
        raise MediaError(f"the {_NAME[container]} file holds no audio samples")
    truncated = more or mono.size > wanted
    kept = mono[:wanted].astype(np.float64)
    kept -= kept.mean()
    kept /= math.sqrt(float(np.mean(kept * kept)) + _EPSILON)
    count = -(-kept.size // chunk_samples)
    values = np.zeros(count * chunk_samples, dtype=np.float32)
    values[: kept.size] = kept
    steps = np.arange(count, dtype=np.int64)
    return Units(
        values=values.reshape(count, chunk_samples),
        positions=np.stack([steps, steps, steps], axis=1),
        grid=(count, 1, 1),
        truncated=bool(truncated),
    )


def _budget(wanted: int, rate: int, sample_rate: int) -> int:
    """Source samples that cover `wanted` samples at `sample_rate`, with resampling context."""
    return wanted if rate == sample_rate else math.ceil(wanted * rate / sample_rate) + _CONTEXT


def _check_rate(rate: int) -> None:
    # What is decoded before resampling grows with the source rate: a forged rate must not multiply it.
    if rate > MAX_SOURCE_RATE:
        raise MediaError(f"the audio's sample rate of {rate} Hz is over the limit of {MAX_SOURCE_RATE} Hz")


def _check_seconds(samples: float, rate: float, limits: MediaLimits, where: str) -> None:
    if samples / rate > limits.max_seconds:
        raise MediaError(f"the audio lasts {where}{samples / rate:.1f} s, over the limit of {limits.max_seconds} s")


def _with_soundfile(data: bytes, wanted: int, sample_rate: int, limits: MediaLimits) -> tuple[np.ndarray, int, bool]:
    """(mono float32, source rate, whether samples remain past what was read)."""
    with soundfile.SoundFile(io.BytesIO(data)) as sound:
        rate, frames = int(sound.samplerate), int(sound.frames)
        if rate < 1 or sound.channels < 1:
            raise MediaError(f"the audio header is invalid ({rate} Hz, {sound.channels} channels)")
        if frames > 0:
            _check_seconds(frames, rate, limits, "")
        _check_rate(rate)
        budget = _budget(wanted, rate, sample_rate)
        # Mixed down block by block: a header's channel count never multiplies what is held.
        pieces: list[np.ndarray] = []
        total = 0
        while total <= budget:
            block = sound.read(frames=min(_BLOCK_FRAMES, budget + 1 - total), dtype="float32", always_2d=True)
            if block.shape[0] == 0:
                break
            pieces.append(block.mean(axis=1, dtype=np.float32))
            total += block.shape[0]
    mono = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    return mono[:budget], rate, mono.size > budget


def _with_pyav(
    data: bytes, container: str, wanted: int, sample_rate: int, limits: MediaLimits
) -> tuple[np.ndarray, int, bool]:
    with open_input(data, _DEMUXER[container], "audio") as media:
        if not media.streams.audio:
            raise MediaError(f"the {_NAME[container]} file holds no audio stream")
        stream = media.streams.audio[0]
        if stream.duration is not None and stream.time_base is not None:
            _check_seconds(float(stream.duration * stream.time_base), 1.0, limits, "")
        elif media.duration is not None:
            _check_seconds(media.duration, av.time_base, limits, "")
        # Planar float keeps the source's channels and rate: the mix-down and soxr do the rest.
        resampler = av.AudioResampler(format="fltp")
        pieces: list[np.ndarray] = []
        total, rate, budget = 0, 0, 0
        for frame in media.decode(stream):
            if not rate:
                rate = int(frame.sample_rate)
                if rate < 1:
                    raise MediaError(f"the audio header is invalid ({rate} Hz)")
                _check_rate(rate)
                budget = _budget(wanted, rate, sample_rate)
            for planar in resampler.resample(frame):
                pieces.append(planar.to_ndarray().mean(axis=0, dtype=np.float32))
                total += pieces[-1].size
            _check_seconds(total, rate, limits, "over ")
            if total > budget:
                break
    if not pieces:
        raise MediaError(f"the {_NAME[container]} file holds no decodable audio")
    mono = np.concatenate(pieces)
    return mono[:budget], rate, mono.size > budget
