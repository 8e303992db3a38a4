"""Images go to the decoders in chunks (`media.decode.decode_items`): the same units as one job an item, a
broken image failing only itself, and a chunk whose process died retried image by image so that only the image
that killed it is lost."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.media_samples import encode_image, photo, video
from uform.config import BatchShape, ImageShape, VideoShape
from uform.enums import Modality
from uform.media import MediaError
from uform.media.decode import CHUNK_MOST, MediaPolicy, decode_chunk, decode_item, decode_items
from uform.runtime.decoders import DecodePool, Outcome

POISON = b"\xff\xd8poison"


class InProcess:
    """A stand-in pool: runs each job here, except that a job holding POISON 'dies' like a killed decoder."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.jobs: list[int] = []

    def map(self, function: Any, jobs: list[tuple[tuple, dict]]) -> list[Outcome]:
        out = []
        for args, kwargs in jobs:
            self.jobs.append(len(args[0]))
            if any(bytes(job[1]) == POISON for job in args[0]):  # a job carries its bytes as a PickleBuffer
                out.append(Outcome(None, "the decoder process died (killed by SIGKILL)", 0.0))
            else:
                out.append(Outcome(function(*args, **kwargs), None, 0.0))
        return out


def batch() -> BatchShape:
    return BatchShape(
        max_rows_per_device=4,
        max_segments_per_device=64,
        max_columns_per_row=256,
        image=ImageShape(patch_side=16, channels=4),
        video=VideoShape(patch_side=8, tube_frames=2, frame_stride=1, channels=3),
    )


def images(count: int) -> list[bytes]:
    picture = photo("astronaut.png").convert("RGB")
    return [encode_image(picture.crop((i, i, 64 + 3 * i, 64 + 3 * i)), "JPEG") for i in range(count)]


def test_chunks_give_the_units_of_one_job_an_item_and_a_broken_image_fails_alone() -> None:
    contents: list[bytes] = images(40)
    contents[7] = b"\xff\xd8\xff\xe0 not really a jpeg"
    clip, _ = video("mp4")
    contents.append(clip)
    modalities = [Modality.Image] * 40 + [Modality.Video]
    pool = InProcess(workers=2)
    units, failed = decode_items(pool, MediaPolicy(), batch(), modalities, contents, range(41), 255)
    geometry = {"image": vars(batch().image), "video": vars(batch().video)}
    with pytest.raises(MediaError) as broken:
        decode_item("image", contents[7], dict(geometry["image"]), 255, MediaPolicy().limits)
    assert failed == [(7, str(broken.value))]
    assert pool.jobs == [10, 10, 10, 10, 1]  # 40 images in two chunks a decoder, the video alone
    for i in range(41):
        if i == 7:
            continue
        kind = "video" if i == 40 else "image"
        expected = decode_item(kind, contents[i], dict(geometry[kind]), 255, MediaPolicy().limits)
        assert np.array_equal(units[i].values, expected.values) and units[i].grid == expected.grid


def test_a_chunk_whose_process_died_is_retried_image_by_image() -> None:
    contents = images(12)
    contents[5] = POISON
    pool = InProcess(workers=1)
    units, failed = decode_items(pool, MediaPolicy(), batch(), [Modality.Image] * 12, contents, range(12), 255)
    assert failed == [(5, "the decoder process died (killed by SIGKILL)")]
    assert sorted(units) == [i for i in range(12) if i != 5]
    with pytest.raises(Exception, match="died"):
        decode_items(pool, MediaPolicy(strict=True), batch(), [Modality.Image] * 12, contents, range(12), 255)


def test_decode_chunk_reports_each_items_error_as_the_pool_does() -> None:
    limits = MediaPolicy().limits
    good = images(1)[0]
    geometry = dict(vars(batch().image))
    answers = decode_chunk([("image", b"garbage", geometry, 255, limits), ("image", good, geometry, 255, limits)])
    assert answers[0][0] is None and answers[0][1] is not None and answers[0][1].startswith("MediaError: ")
    assert answers[1][1] is None and answers[1][0].values.shape[1] == 16 * 16 * 4


def test_a_real_pool_decodes_chunks_alike() -> None:
    contents = images(2 * 2 * CHUNK_MOST + 3)  # chunks of CHUNK_MOST, and a short one
    with DecodePool(2) as pool:
        units, failed = decode_items(
            pool, MediaPolicy(), batch(), [Modality.Image] * len(contents), contents, range(len(contents)), 255
        )
    assert failed == [] and sorted(units) == list(range(len(contents)))
    alone = decode_item("image", contents[13], dict(vars(batch().image)), 255, MediaPolicy().limits)
    assert np.array_equal(units[13].values, alone.values)


def test_the_decoder_keys_each_item_as_the_packer_would() -> None:
    # The packer keys an item's media mask by item_key(modality, bytes); the decoder now computes it where the
    # bytes already are, so the preparing thread need not: the two must be the very same number.
    from uform.media.units import item_key

    data = images(1)[0]
    units = decode_item("image", data, dict(vars(batch().image)), 255, MediaPolicy().limits)
    assert units.key == item_key(Modality.Image, data) and units.key != item_key(Modality.Video, data)
    clip, _ = video("mp4")
    assert decode_item("video", clip, dict(vars(batch().video)), 255, MediaPolicy().limits).key == item_key(
        Modality.Video, clip
    )


def test_unkeyed_decoding_gives_the_same_units_without_the_key() -> None:
    """A step that masks no media (contrastive training, serving) decodes `keyed=False`: the units bitwise those
    of a keyed decode, the key left for the packer (None), through `decode_chunk` and through a real pool."""
    contents = images(CHUNK_MOST + 3)
    geometry = dict(vars(batch().image))
    limits = MediaPolicy().limits
    keyed = decode_item("image", contents[2], geometry, 255, limits)
    bare = decode_item("image", contents[2], geometry, 255, limits, keyed=False)
    assert bare.key is None and keyed.key is not None
    assert np.array_equal(bare.values, keyed.values) and np.array_equal(bare.positions, keyed.positions)
    assert (bare.grid, bare.truncated) == (keyed.grid, keyed.truncated)
    [(chunked, error)] = decode_chunk([("image", contents[2], geometry, 255, limits)], keyed=False)
    assert error is None and chunked.key is None and np.array_equal(chunked.values, keyed.values)
    modalities = [Modality.Image] * len(contents)
    with DecodePool(2) as pool:
        for flag in (False, True):
            units, failed = decode_items(
                pool, MediaPolicy(), batch(), modalities, contents, range(len(contents)), 255, keyed=flag
            )
            assert failed == [] and sorted(units) == list(range(len(contents)))
            assert all((u.key is not None) == flag for u in units.values()), flag
            assert np.array_equal(units[2].values, keyed.values)
            del units  # views of the pool's slabs


@pytest.mark.parametrize("objective", ["Joint", "Masked", "Contrastive"])
def test_the_prepare_stage_keys_its_media_only_where_the_step_masks_media(objective: str) -> None:
    from uform.config import Schedule, TrainerInitVramConfig, resolve
    from uform.enums import Objective
    from uform.runtime.preparers import PrepareJob, decode_media

    config = resolve(
        TrainerInitVramConfig(
            depth=1, hidden=128, objective=Objective[objective], batch=batch(), schedule=Schedule(steps=10)
        )
    )
    contents = images(3)
    job = PrepareJob(modalities=[Modality.Image] * 3, contents=contents)
    units, failed = decode_media(config, MediaPolicy(), lambda: InProcess(2), job)
    assert failed == [] and sorted(units) == [0, 1, 2]
    assert all((u.key is not None) == (objective != "Contrastive") for u in units.values())


def test_an_image_decodes_where_the_audio_and_video_libraries_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder loads only the library of the kind it decodes: with PyAV and libsndfile unloadable (an install
    missing cffi's backend, as the H200's first run found), images still decode, and an audio item fails alone,
    naming what is missing."""
    import sys

    image = encode_image(photo("astronaut.png").convert("RGB").resize((64, 48)), "JPEG", quality=90)
    geometry = {"patch_side": 16, "channels": 3}
    want = decode_item("image", image, geometry, 64, MediaPolicy().limits)
    for name in ("uform.media.audio", "uform.media.video"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    got = decode_item("image", image, geometry, 64, MediaPolicy().limits)
    assert np.array_equal(got.values, want.values) and np.array_equal(got.positions, want.positions)
    ((units, error),) = decode_chunk(
        [("audio", b"RIFF....", {"chunk_samples": 320, "sample_rate": 16000}, 8, MediaPolicy().limits)]
    )
    assert units is None and error is not None and "uform.media.audio" in error
