"""Video decoding (`uform.media.video_units`) on clips panned over a real photograph (scikit-image's coffee),
encoded at test time by PyAV into MP4 (H.264) and WebM (VP9).

Pins: both containers decode; `frame_stride` and `tube_frames` pick the right source frames into the right
tubes; a clip longer than `max_units` is cut in time and marked truncated; frames are downscaled like images
(aspect kept, never upscaled); channels 1/3/4; the audio track is ignored; broken, hostile and
wrong-format bytes and limit breaches raise `MediaError` and nothing else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from media_samples import (
    VIDEO_ENCODERS,
    VIDEO_FRAMES,
    VIDEO_SIZE,
    _encode_video,
    content_size,
    cuts,
    mutations,
    opus_webm,
    pan_frames,
    pictures,
    pygame_file,
    skimage_file,
    video,
)

from uform.media import MediaError, MediaLimits, video_units
from uform.media.grid import fit_size

CONTAINERS = ["mp4", "webm"]
WIDTH, HEIGHT = VIDEO_SIZE  # 64 x 48: a 3 x 4 grid of 16-pixel patches


def decode(
    data: bytes,
    *,
    patch_side: int = 16,
    tube_frames: int = 2,
    frame_stride: int = 1,
    channels: int = 3,
    max_units: int = 10_000,
    **limits: Any,
):
    return video_units(
        data,
        patch_side=patch_side,
        tube_frames=tube_frames,
        frame_stride=frame_stride,
        channels=channels,
        max_units=max_units,
        limits=MediaLimits(**limits),
    )


def nearest_source_frame(picture: np.ndarray) -> int:
    """Index of the panned source frame closest to a decoded RGB frame (the pan moves ~45 px per frame)."""
    errors = [np.abs(picture.astype(int) - frame).mean() for frame in pan_frames()]
    return int(np.argmin(errors))


@pytest.mark.parametrize("container", CONTAINERS)
def test_every_container_decodes(container: str) -> None:
    data, _ = video(container)
    units = decode(data)
    assert units.grid == (VIDEO_FRAMES // 2, 3, 4)
    assert units.values.dtype == np.uint8 and units.values.shape == (6 * 12, 2 * 16 * 16 * 3)
    expected = [[t, r, c] for t in range(6) for r in range(3) for c in range(4)]
    assert units.positions.dtype == np.int64 and units.positions.tolist() == expected
    assert units.truncated is False
    # Tubes are laid out [tube_frames, p, p, C]: the frames come back in order and close to the source.
    frames = pictures(units, 16, 3, tube_frames=2)
    source = pan_frames()
    for index in range(VIDEO_FRAMES):
        assert np.abs(frames[index].astype(int) - source[index]).mean() < 8
    np.testing.assert_array_equal(units.values[0].reshape(2, 16, 16, 3)[1], frames[1, :16, :16])


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize(
    "frame_stride, tube_frames, sampled",
    [
        (2, 2, [0, 2, 4, 6, 8, 10]),
        (3, 2, [0, 3, 6, 9]),
        (5, 2, [0, 5]),  # frames 0, 5, 10: the incomplete last group is dropped
        (1, 5, list(range(10))),
        (4, 3, [0, 4, 8]),
        (12, 3, [0, 0, 0]),  # one sampled frame only: the only group repeats it
        (1, 14, [*range(12), 11, 11]),
    ],
)
def test_stride_and_tube_frames(container: str, frame_stride: int, tube_frames: int, sampled: list[int]) -> None:
    data, _ = video(container)
    units = decode(data, frame_stride=frame_stride, tube_frames=tube_frames)
    assert units.grid == (len(sampled) // tube_frames, 3, 4)
    assert units.values.shape[1] == tube_frames * 16 * 16 * 3
    assert units.truncated is False
    frames = pictures(units, 16, 3, tube_frames=tube_frames)[:, :HEIGHT, :WIDTH]
    assert [nearest_source_frame(frame) for frame in frames] == sampled


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("max_units, times, truncated", [(12, 1, True), (24, 2, True), (71, 5, True), (72, 6, False)])
def test_cut_in_time(container: str, max_units: int, times: int, truncated: bool) -> None:
    data, _ = video(container)
    units = decode(data, max_units=max_units)
    assert units.grid == (times, 3, 4) and units.truncated is truncated
    assert len(units) == times * 12
    full = decode(data)
    np.testing.assert_array_equal(units.values, full.values[: times * 12])


def test_decoding_stops_once_enough_frames_are_collected() -> None:
    data, _ = video("webm")  # WebM headers give no frame count: only decoding could break the limit
    units = decode(data, max_units=12, max_frames=6)
    assert units.grid == (1, 3, 4) and units.truncated
    with pytest.raises(MediaError, match="frames"):
        decode(data, max_frames=6)


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("max_units", [1, 4, 6, 11])
def test_frames_downscaled_to_fit_a_row(container: str, max_units: int) -> None:
    data, _ = video(container)
    units = decode(data, channels=4, max_units=max_units)
    times, rows, columns = units.grid
    assert rows * columns <= max_units and times == max_units // (rows * columns)
    assert units.truncated is (times < VIDEO_FRAMES // 2)
    frames = pictures(units, 16, 4, tube_frames=2)
    assert content_size(frames[0]) == fit_size(WIDTH, HEIGHT, 16, max_units)
    width, height = content_size(frames[0])
    assert width < WIDTH and abs(width / height - WIDTH / HEIGHT) <= (WIDTH / HEIGHT) / height


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_channels(channels: int) -> None:
    data, _ = video("mp4")
    units = decode(data, channels=channels, patch_side=8, tube_frames=3)
    assert units.grid == (4, 6, 8) and units.values.shape == (4 * 48, 3 * 8 * 8 * channels)
    frames = pictures(units, 8, channels, tube_frames=3)
    if channels == 4:
        assert (frames[:, :, :, 3] == 255).all()  # no padding at 64 x 48 with 8-pixel patches
    if channels == 1:
        colour = pictures(decode(data, patch_side=8, tube_frames=3), 8, 3, tube_frames=3).astype(float)
        luma = colour @ np.array([0.299, 0.587, 0.114])
        assert np.abs(frames[:, :, :, 0] - luma).mean() < 4


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("channels", [1, 3, 4])
@pytest.mark.parametrize("max_units", [1, 6, 40, 1023])  # 4 x 3, 11 x 8, 27 x 20, 64 x 48: odd widths pad rows
def test_frames_are_what_pyav_converts_them_to(container: str, channels: int, max_units: int) -> None:
    """The decoder scales each frame with one scaler a clip and reads its plane itself: the pixels are those of
    PyAV's own `to_ndarray` at the same size, format and interpolation, padded rows and all."""
    import io

    import av

    data, _ = video(container)
    units = decode(data, channels=channels, max_units=max_units, patch_side=4, tube_frames=1)
    width, height = fit_size(WIDTH, HEIGHT, 4, max_units)
    with av.open(io.BytesIO(data)) as media:
        expected = [
            frame.to_ndarray(
                width=width, height=height, format={1: "gray", 3: "rgb24", 4: "rgba"}[channels], interpolation="AREA"
            )
            for frame in media.decode(media.streams.video[0])
        ]
    frames = pictures(units, 4, channels)[:, :height, :width]
    assert len(frames) == min(VIDEO_FRAMES, units.grid[0])
    for got, want in zip(frames, expected, strict=False):
        np.testing.assert_array_equal(got, want.reshape(height, width, channels))


def test_scaling_asks_pyav_for_one_thread_where_it_can() -> None:
    """From PyAV 17 swscale may start a thread per core for every frame unless told otherwise; before it, the
    keyword does not exist and must not be passed."""
    import av

    from uform.media.video import _scale_options

    major = int(av.__version__.split(".")[0])
    assert _scale_options() == ({"threads": 1} if major >= 17 else {})


def test_larger_patches_than_the_frame_pad() -> None:
    units = decode(video("webm")[0], patch_side=80, tube_frames=4)
    assert units.grid == (3, 1, 1)
    frames = pictures(units, 80, 3, tube_frames=4)
    assert not frames[:, HEIGHT:].any() and not frames[:, :, WIDTH:].any()


@pytest.mark.parametrize("container", CONTAINERS)
def test_audio_track_ignored(container: str) -> None:
    with_audio, _ = video(container, with_audio=True)
    silent, _ = video(container)
    assert len(with_audio) > len(silent) + 1000
    units, reference = decode(with_audio), decode(silent)
    assert units.grid == reference.grid and units.truncated is reference.truncated
    np.testing.assert_array_equal(units.values, reference.values)  # the same video packets, muxed with audio


# Broken and hostile bytes: always MediaError, never another exception.


@pytest.mark.parametrize(
    "other",
    [
        lambda: skimage_file("astronaut.png"),
        lambda: skimage_file("rocket.jpg"),
        lambda: pygame_file("house_lo.wav"),
        lambda: pygame_file("house_lo.ogg"),
        lambda: pygame_file("blue.mpg"),
        lambda: b"\x00" * 64,
    ],
    ids=["png", "jpeg", "wav", "ogg", "mpeg-ps", "zeros"],
)
def test_other_formats_refused(other) -> None:
    with pytest.raises(MediaError, match="not an MP4 or WebM file"):
        decode(other())


def test_webm_without_video_refused() -> None:
    with pytest.raises(MediaError, match="no video stream"):
        decode(opus_webm())


def test_zero_bytes_refused() -> None:
    with pytest.raises(MediaError, match="empty"):
        decode(b"")


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("with_audio", [False, True])
def test_truncated_refused(container: str, with_audio: bool) -> None:
    for cut in cuts(video(container, with_audio=with_audio)[0]):
        with pytest.raises(MediaError):
            decode(cut)


@pytest.mark.parametrize("container", CONTAINERS)
def test_random_and_corrupted_bytes_only_raise_media_error(container: str) -> None:
    data, _ = video(container)
    rng = np.random.default_rng(11)
    for candidate in [rng.bytes(4096), data[:40] + rng.bytes(4096), *mutations(data, 12, seed=5, keep=40)]:
        try:
            units = decode(candidate, max_units=64)
        except MediaError:
            continue
        assert units.values.dtype == np.uint8 and len(units) <= 64


@pytest.mark.parametrize("container", CONTAINERS)
def test_limits(container: str) -> None:
    data, _ = video(container)
    with pytest.raises(MediaError, match="pixels"):
        decode(data, max_frame_pixels=WIDTH * HEIGHT - 1)
    with pytest.raises(MediaError, match="frames"):
        decode(data, max_frames=VIDEO_FRAMES - 1)
    with pytest.raises(MediaError, match="lasts"):
        decode(data, max_seconds=0.5)  # 12 frames at 12 per second
    with pytest.raises(MediaError, match="bytes"):
        decode(data, max_bytes=len(data) - 1)
    decode(data, max_frame_pixels=WIDTH * HEIGHT, max_frames=VIDEO_FRAMES, max_seconds=1.5, max_bytes=len(data))


def flat_clip(width: int, height: int, frames: int = 2) -> bytes:
    """A flat grey MP4 clip of `frames` frames of `width` x `height`, by the first encoder PyAV's wheel runs."""
    pixels = [np.full((height, width, 3), 90 + 10 * i, dtype=np.uint8) for i in range(frames)]
    for codec in VIDEO_ENCODERS["mp4"]:
        try:
            return _encode_video("mp4", codec, pixels, 12)
        except Exception:  # absent or unable to run here: the next one
            continue
    pytest.skip("no mp4 video encoder in PyAV's wheel")


@pytest.mark.slow
def test_default_frame_pixel_limit() -> None:
    # A decoder holds up to 17 frames (H.264's 16 references and one more): frames past 2560 x 2560 are
    # refused from the header, so that one decoder's peak stays under 256 MB; 2560 x 2560 itself decodes.
    with pytest.raises(MediaError, match="a 3840 x 2160 = 8294400 pixel frame is over the limit of 6553600"):
        decode(flat_clip(3840, 2160), max_units=64)
    assert decode(flat_clip(2560, 2560), max_units=64).grid[0] == 1
    assert decode(flat_clip(3840, 2160), max_units=64, max_frame_pixels=3840 * 2160).grid[0] == 1


def test_bad_arguments_are_value_errors() -> None:
    data, _ = video("mp4")
    for arguments in ({"channels": 2}, {"tube_frames": 0}, {"frame_stride": 0}, {"max_units": 0}):
        with pytest.raises(ValueError) as raised:
            decode(data, **arguments)  # type: ignore[arg-type]
        assert not isinstance(raised.value, MediaError)
