"""Video (MP4, WebM through PyAV) into tubes of `tube_frames` sampled frames x `patch_side`² pixels."""

from __future__ import annotations

import functools
from typing import Any

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from ._pyav import open_input
from .grid import check_arguments, fit_size, grid_of, positions, tile
from .limits import MediaError, MediaLimits, describe
from .sniff import as_bytes, check_complete, expect
from .units import Units

# The demuxer is forced from the sniffed container (see _pyav.open_input).
_DEMUXER = {"mp4": "mp4", "webm": "webm"}
_NAME = {"mp4": "MP4", "webm": "WebM"}
_PIXEL_FORMAT = {1: "gray", 3: "rgb24", 4: "rgba"}


@functools.cache
def _scale_options() -> dict[str, Any]:
    """`reformat`'s keyword for a one-threaded scale where this PyAV takes it (17 and later, whose default lets
    swscale start a thread per core for every frame: 61 us to scale a 64 x 48 frame against 3.4 us on one thread,
    PyAV 19 on the 2-core dev machine). The decoders are one process per core already."""
    try:
        VideoReformatter().reformat(av.VideoFrame(16, 16, "yuv420p"), format="rgb24", threads=1)
    except TypeError:  # before PyAV 17: no such keyword, and one thread already
        return {}
    return {"threads": 1}


def video_units(
    data: Any,
    *,
    patch_side: int,
    tube_frames: int,
    frame_stride: int,
    channels: int,
    max_units: int,
    limits: MediaLimits = MediaLimits(),  # noqa: B008 (frozen, so a shared default is safe)
) -> Units:
    """Decode an MP4 or WebM video's first video stream into tubes (its audio is never decoded).

    Every `frame_stride`-th frame (from the first) is sampled, converted to `channels` (1 grey, 3 RGB,
    4 RGBA; alpha is opaque) and, when one tube-time's patch grid would exceed `max_units`, downscaled with
    the aspect ratio kept to the largest size whose grid fits (never upscaled). `tube_frames` consecutive
    sampled frames form a tube-time; a final incomplete group is dropped unless it is the only one, which
    repeats its last frame. At most `max_units // (rows * columns)` tube-times are kept: a clip with more
    is cut in time and marked `truncated` (decoding stops there). Values are [T * rows * columns,
    tube_frames * patch_side² * channels] uint8, each tube laid out [tube_frames, patch_side, patch_side,
    channels], zero-padded right and bottom; positions (time, row, column); grid (T, rows, columns).

    Raises MediaError for bytes that are not MP4 or WebM, that hold no decodable video stream, or that
    break `limits` (bytes; frame pixels, duration and frame count from the header before decoding, and again
    while decoding). What is held is bounded: the decoder's own frames (by `MediaLimits.max_frame_pixels`)
    and the kept frames, already downscaled to the row; the tube-time past them is only counted.
    """
    check_arguments(patch_side=patch_side, tube_frames=tube_frames, frame_stride=frame_stride, max_units=max_units)
    if channels not in (1, 3, 4):
        raise ValueError(f"channels must be 1, 3 or 4, got {channels!r}")
    data = as_bytes(data)
    container = expect("video", data, limits)
    check_complete(container, data)
    try:
        with open_input(data, _DEMUXER[container], "video") as media:
            frames, grid, truncated = _decode(
                media, container, patch_side, tube_frames, frame_stride, channels, max_units, limits
            )
    except MediaError:
        raise
    except Exception as error:  # FFmpeg and PyAV answer hostile bytes with many exception types.
        raise MediaError(f"cannot decode the {_NAME[container]} video: {describe(error)}") from error
    times, rows, columns = grid
    values = np.concatenate(
        [tile(frames[t * tube_frames : (t + 1) * tube_frames], patch_side) for t in range(times)], axis=0
    )
    return Units(values=values, positions=positions(times, rows, columns), grid=grid, truncated=truncated)


def header_frames(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, frames) of an MP4's first video stream from its header (the `moov` index; no frame is
    decoded), or None where the header does not read or counts no frames."""
    try:
        with open_input(as_bytes(data), "mp4", "video") as media:
            if not media.streams.video:
                return None
            stream = media.streams.video[0]
            width, height, frames = stream.codec_context.width, stream.codec_context.height, stream.frames
    except Exception:  # a header that does not read: the decoder says why when it decodes
        return None
    if width < 1 or height < 1 or not frames or frames < 1:
        return None
    return int(width), int(height), int(frames)


def _seconds(value: int | None, time_base: Any) -> float | None:
    return None if value is None or time_base is None else float(value * time_base)


def _decode(
    media: Any,
    container: str,
    patch_side: int,
    tube_frames: int,
    frame_stride: int,
    channels: int,
    max_units: int,
    limits: MediaLimits,
) -> tuple[np.ndarray, tuple[int, int, int], bool]:
    if not media.streams.video:
        raise MediaError(f"the {_NAME[container]} file holds no video stream")
    stream = media.streams.video[0]
    _check_pixels(stream.codec_context.width, stream.codec_context.height, limits)
    duration = _seconds(stream.duration, stream.time_base)
    if duration is None and media.duration is not None:
        duration = media.duration / av.time_base
    if duration is not None and duration > limits.max_seconds:
        raise MediaError(f"the video lasts {duration:.1f} s, over the limit of {limits.max_seconds} s")
    if stream.frames and stream.frames > limits.max_frames:
        raise MediaError(f"the video has {stream.frames} frames, over the limit of {limits.max_frames}")

    # One thread: the decoders are one process per core already, and FFmpeg's default starts a thread per core
    # for every clip it opens.
    stream.codec_context.thread_count = 1
    reformatter = VideoReformatter()  # one scaler for the clip (`to_ndarray` makes one a frame)
    sampled: list[np.ndarray] = []
    size: tuple[int, int] | None = None
    keep_times = wanted = count = 0
    start: float | None = None
    for index, frame in enumerate(media.decode(stream)):
        if index >= limits.max_frames:
            raise MediaError(f"the video has more than {limits.max_frames} frames, the limit")
        _check_pixels(frame.width, frame.height, limits)
        if frame.time is not None:
            start = frame.time if start is None else start
            if frame.time - start > limits.max_seconds:
                raise MediaError(f"the video lasts over {limits.max_seconds} s, the limit")
        if index % frame_stride:
            continue
        if size is None:
            size = fit_size(frame.width, frame.height, patch_side, max_units)
            rows, columns = grid_of(*size, patch_side)
            keep_times = max_units // (rows * columns)
            # One tube-time past what is kept tells whether the clip is cut; then decoding stops.
            wanted = (keep_times + 1) * tube_frames
        count += 1
        if count <= keep_times * tube_frames:  # the tube-time past them is only counted, never converted
            converted = reformatter.reformat(
                frame,
                width=size[0],
                height=size[1],
                format=_PIXEL_FORMAT[channels],
                interpolation="AREA",
                **_scale_options(),
            )
            sampled.append(_pixels(converted, channels))
        if count >= wanted:
            break
    if size is None:
        raise MediaError(f"the {_NAME[container]} file holds no decodable video frame")
    complete = count // tube_frames
    if complete == 0:
        sampled.extend([sampled[-1]] * (tube_frames - len(sampled)))
        complete = 1
    times = min(complete, keep_times)
    frames = np.stack(sampled[: times * tube_frames])
    rows, columns = grid_of(*size, patch_side)
    return frames, (times, rows, columns), complete > keep_times


def _check_pixels(width: int, height: int, limits: MediaLimits) -> None:
    if width * height > limits.max_frame_pixels:
        raise MediaError(
            f"a {width} x {height} = {width * height} pixel frame is over the limit of {limits.max_frame_pixels} "
            "pixels (MediaLimits.max_frame_pixels)"
        )


def _pixels(frame: Any, channels: int) -> np.ndarray:
    """[H, W, channels] uint8, a copy of a packed gray / rgb24 / rgba frame's one plane (its rows are padded to
    `line_size`); what `to_ndarray` answers, without the scaler it makes for every frame."""
    plane = frame.planes[0]
    rows = np.frombuffer(plane, dtype=np.uint8).reshape(frame.height, plane.line_size)
    return rows[:, : frame.width * channels].reshape(frame.height, frame.width, channels).copy()
