"""Real media for the decoder tests (test_media_*.py), built at test time, never committed.

Sources are files that ship inside PyPI packages, made by other people: scikit-image's `skimage/data`
photographs and pygame's `examples/data` sounds. The containers no one ships (WebP, FLAC, Opus in WebM,
MP4 and WebM video) are transcoded from them here, in memory. Each builder is cached, so a sample is built
once per test session.
"""

from __future__ import annotations

import functools
import importlib.resources
import io
import os
import pathlib
from collections.abc import Callable
from typing import Any

import av
import numpy as np
import pytest
import soundfile
import soxr
from PIL import Image

os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # pygame greets on import otherwise
# On a machine without the test extra (the GPU machine), UFORM_SAMPLE_MEDIA may name a folder holding copies
# of the two data folders as skimage/ and pygame/ (bench/sample_media.py makes one).
_COPIES = os.environ.get("UFORM_SAMPLE_MEDIA")
if _COPIES:
    SKIMAGE_DATA: Any = pathlib.Path(_COPIES) / "skimage"
    PYGAME_DATA: Any = pathlib.Path(_COPIES) / "pygame"
else:
    pytest.importorskip("skimage", reason="scikit-image (test extra) ships the sample photographs")
    pytest.importorskip("pygame", reason="pygame (test extra) ships the sample recordings")
    SKIMAGE_DATA = importlib.resources.files("skimage") / "data"
    PYGAME_DATA = importlib.resources.files("pygame") / "examples/data"

# Encoders tried in order for each video container; the first one PyAV's wheel can run wins.
VIDEO_ENCODERS = {"mp4": ("libx264", "h264", "mpeg4"), "webm": ("libvpx-vp9", "libvpx")}
VIDEO_SIZE = (64, 48)  # width, height of the sample clips
VIDEO_FRAMES = 12


@functools.cache
def skimage_file(name: str) -> bytes:
    """The bytes of a file of scikit-image's data directory (e.g. "astronaut.png")."""
    return (SKIMAGE_DATA / name).read_bytes()


@functools.cache
def pygame_file(name: str) -> bytes:
    """The bytes of a file of pygame's examples/data directory (e.g. "house_lo.wav")."""
    return (PYGAME_DATA / name).read_bytes()


def photo(name: str) -> Image.Image:
    """A scikit-image photograph, loaded."""
    image = Image.open(io.BytesIO(skimage_file(name)))
    image.load()
    return image


def encode_image(image: Image.Image, format: str, **options: object) -> bytes:
    """`image` saved by Pillow in `format` ("PNG", "JPEG", "WEBP")."""
    out = io.BytesIO()
    image.save(out, format=format, **options)
    return out.getvalue()


@functools.cache
def png_16bit() -> bytes:
    """scikit-image's camera (8-bit grey) widened to a 16-bit grey PNG (v * 257, so 8 bits come back exact)."""
    wide = np.asarray(photo("camera.png")).astype(np.uint16) * 257
    return encode_image(Image.fromarray(wide), "PNG")


@functools.cache
def png_palette(transparent: bool = False) -> bytes:
    """scikit-image's astronaut quantised to a 256-colour palette PNG (one colour transparent if asked)."""
    image = photo("astronaut.png").convert("P")
    return encode_image(image, "PNG", **({"transparency": 0} if transparent else {}))


@functools.cache
def recording(name: str = "house_lo.wav") -> tuple[np.ndarray, int]:
    """A pygame recording as (float32 mono samples, sample rate)."""
    samples, rate = soundfile.read(io.BytesIO(pygame_file(name)), dtype="float32", always_2d=True)
    return samples.mean(axis=1), rate


def encode_sound(samples: np.ndarray, rate: int, format: str, subtype: str | None = None) -> bytes:
    """`samples` ([n] or [n, channels] float) written by soundfile ("FLAC", "WAV", "OGG")."""
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=format, subtype=subtype)
    return out.getvalue()


def _add_audio(output: av.container.OutputContainer, codec: str, samples: np.ndarray, rate: int) -> Callable[[], None]:
    """Adds a mono audio stream to `output`; answers the function that encodes and muxes it."""
    stream: Any = output.add_stream(codec, rate=rate)
    stream.layout = "mono"

    def write() -> None:
        frame = av.AudioFrame.from_ndarray(samples.astype(np.float32)[None, :], format="fltp", layout="mono")
        frame.sample_rate = rate
        frame.pts = 0
        output.mux(stream.encode(frame))
        output.mux(stream.encode(None))

    return write


@functools.cache
def opus_webm(name: str = "house_lo.wav") -> bytes:
    """A pygame recording transcoded by PyAV to Opus (48 kHz) in WebM, a container soundfile cannot read."""
    samples, rate = recording(name)
    samples = soxr.resample(samples, rate, 48000)
    out = io.BytesIO()
    with av.open(out, mode="w", format="webm") as output:
        _add_audio(output, "libopus", samples, 48000)()
    return out.getvalue()


def pan_frames(
    name: str = "coffee.png", frames: int = VIDEO_FRAMES, size: tuple[int, int] = VIDEO_SIZE
) -> list[np.ndarray]:
    """[H, W, 3] uint8 frames panning a window across a scikit-image photograph, left to right."""
    image = photo(name).convert("RGB")
    width, height = size
    window = (width * 3, height * 3)
    step = (image.width - window[0]) // max(1, frames - 1)
    top = (image.height - window[1]) // 2
    return [
        np.asarray(
            image.crop((i * step, top, i * step + window[0], top + window[1])).resize(size, Image.Resampling.BOX)
        )
        for i in range(frames)
    ]


def _encode_video(container: str, codec: str, frames: list[np.ndarray], fps: int) -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as output:
        stream: Any = output.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        if codec in ("libx264", "h264"):
            stream.options = {"preset": "veryfast", "crf": "18"}
        elif codec.startswith("libvpx"):
            stream.options = {"deadline": "realtime", "cpu-used": "8", "crf": "10", "b": "0"}
        else:
            stream.options = {"qscale": "2"}
        for index, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = index
            output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return out.getvalue()


def _add_audio_track(data: bytes, container: str, audio: tuple[np.ndarray, int]) -> bytes:
    """`data`'s video packets copied as they are beside a new audio track: the video bitstream stays
    bit-identical (a second encode may not be, e.g. under threaded x264), so decoders must give equal frames."""
    out = io.BytesIO()
    with av.open(io.BytesIO(data)) as source, av.open(out, mode="w", format=container) as output:
        video_in = source.streams.video[0]
        from_template = getattr(output, "add_stream_from_template", None)  # PyAV 13+; 12 takes template=
        stream: Any = from_template(video_in) if from_template else output.add_stream(template=video_in)
        write_audio = _add_audio(output, "aac" if container == "mp4" else "libopus", *audio)
        for packet in source.demux(video_in):
            if packet.dts is None:  # the demuxer's flush packet
                continue
            packet.stream = stream
            output.mux(packet)
        write_audio()
    return out.getvalue()


def video(container: str, frames: int = VIDEO_FRAMES, with_audio: bool = False) -> tuple[bytes, str]:
    """(a clip panning over a real photograph, the encoder that made it) in "mp4" or "webm"; skips the test
    with the reason when PyAV's wheel carries no encoder for the container. One encode per (container, frames),
    however the arguments are spelled: the clip with audio carries the very packets of the silent one."""
    return _video(container, frames, with_audio)


@functools.cache
def _video(container: str, frames: int, with_audio: bool) -> tuple[bytes, str]:
    if with_audio:
        silent, codec = _video(container, frames, False)
        samples, rate = recording("boom.wav")
        rate_out = 48000 if container == "webm" else 44100
        return _add_audio_track(silent, container, (soxr.resample(samples, rate, rate_out), rate_out)), codec
    failures = []
    for codec in VIDEO_ENCODERS[container]:
        try:
            return _encode_video(container, codec, pan_frames(frames=frames), 12), codec
        except Exception as error:  # the codec is absent or cannot run here: try the next one
            failures.append(f"{codec}: {type(error).__name__}: {error}")
    pytest.skip(f"no {container} video encoder in PyAV's wheel ({'; '.join(failures)})")


def pictures(units: object, patch_side: int, channels: int, tube_frames: int = 1) -> np.ndarray:
    """The padded pictures back from image or video units: [times * tube_frames, rows * p, columns * p, C]."""
    times, rows, columns = units.grid  # type: ignore[attr-defined]
    values = units.values.reshape(times, rows, columns, tube_frames, patch_side, patch_side, channels)  # type: ignore[attr-defined]
    return values.transpose(0, 3, 1, 4, 2, 5, 6).reshape(
        times * tube_frames, rows * patch_side, columns * patch_side, channels
    )


def content_size(picture: np.ndarray) -> tuple[int, int]:
    """(width, height) of the opaque part of an RGBA picture (its alpha is 255, the padding's 0)."""
    opaque = picture[:, :, 3] > 0
    return int(opaque.any(axis=0).sum()), int(opaque.any(axis=1).sum())


def mutations(data: bytes, count: int, seed: int, keep: int = 16) -> list[bytes]:
    """`count` copies of `data` with a few random bytes overwritten past the first `keep` (the magic stays)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        copy = np.frombuffer(data, dtype=np.uint8).copy()
        where = rng.integers(keep, len(data), size=8)
        copy[where] = rng.integers(0, 256, size=8)
        out.append(copy.tobytes())
    return out


def cuts(data: bytes, fractions: tuple[float, ...] = (0.002, 0.05, 0.3, 0.6, 0.9, 0.98)) -> list[bytes]:
    """`data` cut at several points (never empty)."""
    return [data[: max(1, int(len(data) * fraction))] for fraction in fractions]


@functools.cache
def wav_by_pyav(codec: str = "adpcm_yamaha", name: str = "house_lo.wav") -> bytes:
    """A pygame recording in a WAV whose codec libsndfile cannot read (Yamaha ADPCM), written by PyAV."""
    samples, rate = recording(name)
    out = io.BytesIO()
    with av.open(out, mode="w", format="wav") as output:
        stream: Any = output.add_stream(codec, rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray((samples * 32767).astype(np.int16)[None, :], format="s16", layout="mono")
        frame.sample_rate, frame.pts = rate, 0
        output.mux(stream.encode(frame))
        output.mux(stream.encode(None))
    return out.getvalue()


def forged_jpeg(width: int, height: int, source: tuple[int, int] = (40, 40)) -> bytes:
    """scikit-image's camera as a small real JPEG (`source` pixels) whose frame header is patched to claim
    `width` x `height`: the scan is far too short for the size its header declares."""
    data = bytearray(encode_image(photo("camera.png").resize(source), "JPEG", quality=90, subsampling=0))
    at = 2
    while data[at + 1] not in (0xC0, 0xC1, 0xC2):  # walk the marker segments to the frame header
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    data[at + 5 : at + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


@functools.cache
def flat_png(width: int, height: int) -> bytes:
    """A one-colour RGB PNG of `width` x `height`: 8000 x 8000 compresses to about 200 KB."""
    return encode_image(Image.new("RGB", (width, height), (120, 30, 200)), "PNG")


def photo_jpeg(name: str, size: tuple[int, int]) -> bytes:
    """A scikit-image photograph resized (box filter) to `size` and saved as an RGB JPEG of quality 90."""
    return encode_image(photo(name).convert("RGB").resize(size, Image.Resampling.BOX), "JPEG", quality=90)


def photo_png(name: str, size: tuple[int, int]) -> bytes:
    """A scikit-image photograph resized (box filter) to `size` and saved as an RGBA PNG."""
    return encode_image(photo(name).convert("RGBA").resize(size, Image.Resampling.BOX), "PNG")


def recording_wav(seconds: float, offset: float = 0.0) -> bytes:
    """`seconds` of pygame's house recording from `offset`, as a float WAV."""
    samples, rate = recording("house_lo.wav")
    start = int(offset * rate)
    return encode_sound(samples[start : start + int(seconds * rate)], rate, "WAV", "FLOAT")


def mixed_items() -> tuple[list[str], list[bytes]]:
    """Eight items of a serving call: three images (a JPEG, a PNG, pygame's JPEG), two recordings, three texts."""
    items: list[tuple[str, bytes]] = [
        ("image", photo_jpeg("astronaut.png", (64, 48))),
        ("text", b"an astronaut in a white suit"),
        ("audio", recording_wav(0.2)),
        ("text", b"a house, recorded"),
        ("image", photo_png("chelsea.png", (48, 64))),
        ("text", b"a cat looks up"),
        ("image", pygame_file("alien1.jpg")),
        ("audio", recording_wav(0.35, 0.1)),
    ]
    return [m for m, _ in items], [c for _, c in items]
