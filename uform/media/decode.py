"""One entry point for the decode workers: a media item's bytes and the run's geometry in, units out.

`decode_item` is a module-level function so that it pickles by reference into the worker processes of
`pool.DecodePool`; `MediaPolicy` is how a caller bounds and reports media (limits, strictness, workers).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..enums import Modality
from ..notices import MediaWarning, Notices
from .limits import MediaError, MediaLimits
from .units import Units, item_key

_NAMED = 8
"""Skipped items a media warning names one by one; the rest it counts."""


@dataclass(kw_only=True, frozen=True)
class MediaPolicy:
    """How a trainer treats media items: their limits, what a broken one does, and how many decoders run."""

    limits: MediaLimits = field(default_factory=MediaLimits)
    """Bounds on every item (bytes, pixels, frames, seconds) and the time one item may take to decode."""
    strict: bool = False
    """Training: False skips an item that cannot be decoded (counted in `TrainerStepStats.skipped` and
    `Trainer.notices`, with one `MediaWarning` per trainer naming the first step's); True makes the step raise
    `MediaError` naming the item, leaving the trainer unchanged. Serving: each call's `errors` decides
    (raise by default, or answer a mask), and True makes every call raise."""
    workers: int = 0
    """Decoding processes; zero derives one per core this process may use."""

    def __post_init__(self) -> None:
        if not isinstance(self.limits, MediaLimits):
            raise TypeError(f"media.limits: expected a MediaLimits, got {type(self.limits).__name__}")
        if not isinstance(self.strict, bool):
            raise TypeError(f"media.strict: expected a bool, got {type(self.strict).__name__}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"media.workers: must be a non-negative int, got {self.workers!r}")


def decode_item(
    kind: str, data: bytes, geometry: dict[str, Any], max_units: int, limits: MediaLimits, keyed: bool = True
) -> Units:
    """Decodes one item of `kind` ("image", "video" or "audio") into at most `max_units` units. With `keyed`,
    the units carry the key of their draws (`Units.key`, the digest of their bytes), computed here, in the
    decoder, where the bytes already are; without it (a step that masks no media, serving) the key is left None,
    for the packer to compute should it ever need one (`data.batch`): the digest is ~5% of a 256 x 256 JPEG's
    decode (30 of 550 µs, 21 KB).

    `geometry` holds the run's shape slice of that modality (patch_side, channels, tube_frames,
    frame_stride, chunk_samples, sample_rate, as the reference API's ImageShape / VideoShape / AudioShape name them).
    """
    units = _decoded(kind, data, geometry, max_units, limits)
    if keyed:
        units.key = item_key(_MODALITY[kind], data)
    return units


_MODALITY = {"image": Modality.Image, "video": Modality.Video, "audio": Modality.Audio}


def _decoded(kind: str, data: bytes, geometry: dict[str, Any], max_units: int, limits: MediaLimits) -> Units:
    # Local, and only the kind's own: the decoding libraries (heavy) load here, in the worker processes, not where
    # a trainer is merely built; text-only use never needs them, and images never need PyAV or libsndfile (a
    # broken audio install must not fail every image).
    if kind == "image":
        from .image import image_units

        return image_units(
            data, patch_side=geometry["patch_side"], channels=geometry["channels"], max_units=max_units, limits=limits
        )
    if kind == "video":
        from .video import video_units

        return video_units(
            data,
            patch_side=geometry["patch_side"],
            tube_frames=geometry["tube_frames"],
            frame_stride=geometry["frame_stride"],
            channels=geometry["channels"],
            max_units=max_units,
            limits=limits,
        )
    if kind == "audio":
        from .audio import audio_units

        return audio_units(
            data,
            chunk_samples=geometry["chunk_samples"],
            sample_rate=geometry["sample_rate"],
            max_units=max_units,
            limits=limits,
        )
    raise ValueError(f"decode_item: unknown media kind {kind!r}")


CHUNK_MOST = 16
"""Images one decoder job carries at most: a job is a round trip through the pool (pickling, a pipe, a reader
thread, a dispatch), about as long as decoding one 256 x 256 JPEG, so images go in chunks; video and audio,
each long enough to be worth its trip and bounded only by the job's time limit, go one a job."""


def decode_chunk(
    jobs: Sequence[tuple[str, Any, dict[str, Any], int, MediaLimits]], keyed: bool = True
) -> list[tuple[Any, str | None]]:
    """`decode_item` of each job in turn, in one decoder job: (units, None) or (None, why) for each, an item's
    error caught as the pool would report it ("MediaError: ...") so that one broken image fails only itself. An
    item's bytes may be any buffer (`_job_bytes`: a view of the decoder's input area, which the next job takes)."""
    out: list[tuple[Any, str | None]] = []
    for kind, data, geometry, max_units, limits in jobs:
        try:
            owned = data if isinstance(data, bytes) else bytes(data)
            out.append((decode_item(kind, owned, geometry, max_units, limits, keyed), None))
        except Exception as error:  # the decoders answer hostile bytes with many exception types
            message = str(error)
            out.append((None, f"{type(error).__name__}: {message}" if message else type(error).__name__))
    return out


def _chunks(images: list[int], workers: int) -> list[list[int]]:
    """`images` split into chunks of at most `CHUNK_MOST`, two a decoder at least while there are enough."""
    size = max(1, min(CHUNK_MOST, -(-len(images) // (2 * max(1, workers)))))
    return [images[at : at + size] for at in range(0, len(images), size)]


def _job_bytes(content: bytes | memoryview) -> Any:
    """An item's bytes as a decoder job carries them: a `pickle.PickleBuffer` of the caller's buffer (no copy here),
    which the pool writes into the decoder's input area of shared memory rather than down the pipe, or pickles in
    place where there is none (it loads as bytes); bytes of their own where the buffer is not contiguous."""
    view = memoryview(content)
    return pickle.PickleBuffer(view) if view.c_contiguous else view.tobytes()


def decode_items(
    pool: Any,
    policy: MediaPolicy,
    batch: Any,
    modalities: Sequence[Any],
    contents: Sequence[bytes | memoryview],
    items: Sequence[int],
    max_units: int,
    keyed: bool = True,
) -> tuple[dict[int, Units], list[tuple[int, str]]]:
    """Decodes `items` (indices of media items) in `pool` (a `DecodePool`) at the run's shape slices
    (`batch`, a `BatchShape`); answers the units of those that decoded and (index, reason) of those that did
    not, or raises `MediaError` naming the first of them under a strict `policy`. The trainer and the
    serving model both decode through here; `keyed` as `decode_item` says (a step that masks media wants it)."""
    geometry = {"image": vars(batch.image), "video": vars(batch.video), "audio": vars(batch.audio)}

    def job(i: int) -> tuple[str, Any, dict[str, Any], int, MediaLimits]:
        kind = str(modalities[i])  # a Modality prints as its word: "image", "video", "audio"
        return (kind, _job_bytes(contents[i]), dict(geometry[kind]), max_units, policy.limits)

    images = [i for i in items if str(modalities[i]) == "image"]
    chunks = _chunks(images, getattr(pool, "workers", 1)) + [[i] for i in items if str(modalities[i]) != "image"]
    outcomes: dict[int, tuple[Any, str | None]] = {}
    while chunks:
        retry: list[list[int]] = []
        answers = pool.map(decode_chunk, [(([job(i) for i in c],), {"keyed": keyed}) for c in chunks])
        for chunk, answer in zip(chunks, answers, strict=True):
            if answer.error is None:
                outcomes.update(zip(chunk, answer.value, strict=True))
            elif len(chunk) > 1:  # its process died or ran past its time: each image alone, to find the one
                retry.extend([i] for i in chunk)
            else:
                outcomes[chunk[0]] = (None, answer.error)
        chunks = retry
    units: dict[int, Units] = {}
    failed: list[tuple[int, str]] = []
    for i in items:
        value, error = outcomes[i]
        if error is None:
            units[i] = value
            continue
        reason = error.removeprefix("MediaError: ")
        if policy.strict:
            raise MediaError(reason, item=i)
        failed.append((i, reason))
    return units, failed


def warn_skipped(
    notices: Notices,
    failed: Sequence[tuple[int, str]],
    modalities: Sequence[Any],
    counted: str,
    origin: Any = None,
    stacklevel: int = 2,
) -> None:
    """Counts the (index, reason) items of `failed` under the kind "media" of `notices` and, the first time,
    shows one `MediaWarning` naming them (`origin[i]`, where given, is the caller's index of item i);
    `counted` says where the user finds every later one counted."""
    if not failed:
        return
    named = "; ".join(
        f"contents[{i if origin is None else int(origin[i])}] ({modalities[i]}): {reason}"
        for i, reason in sorted(failed)[:_NAMED]
    )
    more = f"; and {len(failed) - _NAMED} more" if len(failed) > _NAMED else ""
    notices.warn(
        "media",
        f"uform: skipped {len(failed)} media item{'s' if len(failed) > 1 else ''} that could not be decoded or "
        f"broke a limit: {named}{more}. This warning shows once; every skipped item is counted in {counted}",
        MediaWarning,
        count=len(failed),
        stacklevel=stacklevel + 1,
    )
