"""Serving's GPU decode of JPEGs (`load(jpeg="device")`, `uform.device_pictures`, `media.jpeg_plan`), on the CPU.

Pins: the plan takes only the JPEGs whose host decode is a plain decode (baseline, 8-bit YCbCr, upright, fitting a
row, within the limits, consistent) and leaves every other image to the host; with a decoder that decodes as the
host does (Pillow, standing in for nvJPEG, which this machine lacks), `encode` over a mix of deferred and host
images, sizes that are not whole patches, RGBA and RGB runs, answers bitwise what the host path answers, and the
decoder saw exactly the planned JPEGs, batched; a picture the decoder refuses goes to the host path, and one both
refuse raises `MediaError` naming it, or, under errors="mask", is answered invalid (NaN) and counted; `jpeg` is
checked. The nvJPEG path itself runs in tests/test_cuda.py.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_fresh_checkpoint
from media_samples import encode_image, forged_jpeg, photo
from PIL import Image

import uform.device_pictures
from uform import BatchShape, ImageShape, Objective, Schedule, TrainerInitVramConfig
from uform.cli import main
from uform.config import resolve
from uform.media.jpeg_plan import plain_size
from uform.media.limits import MediaError, MediaLimits
from uform.serve import load

torch.set_num_threads(2)

COLUMNS = 128
PLAN = {"patch_side": 16, "channels": 4, "max_units": COLUMNS - 1, "limits": MediaLimits()}


def jpeg(size: tuple[int, int], name: str = "astronaut.png", **options: Any) -> bytes:
    image = photo(name).convert("RGB").resize(size, Image.Resampling.BOX)
    return encode_image(image, "JPEG", quality=90, **options)


def with_orientation(data: bytes, orientation: int) -> bytes:
    image = Image.open(io.BytesIO(data))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode_image(image, "JPEG", quality=90, exif=exif.tobytes())


def test_the_plan_takes_plain_jpegs_only() -> None:
    assert plain_size(jpeg((64, 48)), **PLAN) == (64, 48)
    assert plain_size(jpeg((50, 37)), **PLAN) == (50, 37)  # not whole patches: padded as the host pads
    assert plain_size(with_orientation(jpeg((64, 48)), 1), **PLAN) == (64, 48)
    assert plain_size(jpeg((64, 48), subsampling=0), **PLAN) == (64, 48)  # 4:4:4 as well as 4:2:0
    refused = {
        "progressive": jpeg((64, 48), progressive=True),
        "rotated": with_orientation(jpeg((64, 48)), 6),
        "grey": encode_image(photo("camera.png").resize((64, 48)), "JPEG"),
        "cmyk": encode_image(photo("astronaut.png").convert("CMYK").resize((64, 48)), "JPEG"),
        "downscaled to fit a row": jpeg((400, 300)),
        "a PNG": encode_image(photo("astronaut.png").resize((64, 48)), "PNG"),
        "forged size": forged_jpeg(640, 640),
        "cut": jpeg((64, 48))[:300],
    }
    for why, data in refused.items():
        assert plain_size(data, **PLAN) is None, why
    assert plain_size(jpeg((64, 48)), **{**PLAN, "channels": 3}) == (64, 48)
    assert plain_size(jpeg((64, 48)), **{**PLAN, "channels": 1}) is None  # grey from colour is Pillow's
    assert plain_size(jpeg((64, 48)), **{**PLAN, "limits": MediaLimits(max_pixels=1000)}) is None


def pillow_decoder(calls: list[int], refuse: bytes | None = None) -> Any:
    """Decodes as the host path does a plain JPEG (Pillow, RGB, [3, H, W]); a batch holding `refuse` fails whole,
    as nvJPEG's batched call does, and `refuse` alone fails too."""

    def decode(sources: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(len(sources))
        out = []
        for source in sources:
            data = bytes(source.numpy())
            if data == refuse:
                raise RuntimeError("nvjpeg: the stand-in refuses this picture")
            rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            out.append(torch.from_numpy(rgb.copy()).permute(2, 0, 1))
        return out

    return decode


@pytest.fixture(scope="module", params=[4, 3], ids=["rgba", "rgb"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = resolve(
        TrainerInitVramConfig(
            depth=1,
            hidden=128,
            objective=Objective.Contrastive,
            batch=BatchShape(
                max_rows_per_device=4,
                max_segments_per_device=8,
                max_columns_per_row=COLUMNS,
                image=ImageShape(patch_side=16, channels=request.param),
            ),
            schedule=Schedule(steps=10, warmup_steps=1),
            seed=5,
        )
    )
    path = tmp_path_factory.mktemp("pictures") / "model.safetensors"
    write_fresh_checkpoint(path, config)
    return path


ITEMS = [
    ("image", jpeg((64, 48))),
    ("text", b"a caption between the pictures"),
    ("image", jpeg((50, 37), "coffee.png")),
    ("image", jpeg((64, 48), progressive=True)),  # the host's
    ("image", jpeg((64, 48), "chelsea.png")),  # the same size as the first: one stacked group
    ("image", encode_image(photo("coffee.png").resize((40, 30)), "PNG")),  # the host's
    ("image", jpeg((300, 200), "chelsea.png")),  # downscaled: the host's
    ("image", jpeg((33, 90))),
    ("image", with_orientation(jpeg((48, 64)), 8)),  # rotated: the host's
    ("image", jpeg((16, 16), subsampling=0)),
]
DEFERRED = [0, 2, 4, 7, 9]


def encode_both(path: Path, decoder: Any, errors: str = "raise") -> tuple[Any, Any]:
    modalities = [m for m, _ in ITEMS]
    contents = [c for _, c in ITEMS]
    host = load(path)
    device = load(path)
    device.jpeg_decoder = decoder  # what load(jpeg="device") sets on CUDA, here with the stand-in
    try:
        return host.encode(modalities, contents, errors=errors), device.encode(modalities, contents, errors=errors)
    finally:
        host.close()
        device.close()


def test_deferred_pictures_answer_bitwise_what_the_host_answers(checkpoint: Path) -> None:
    calls: list[int] = []
    host, device = encode_both(checkpoint, pillow_decoder(calls))
    assert torch.equal(host, device)
    assert sum(calls) == len(DEFERRED) and max(calls) > 1  # the planned pictures, a call a window
    assert bool(torch.isfinite(device).all())


def test_a_picture_the_decoder_refuses_goes_to_the_host_path(checkpoint: Path) -> None:
    calls: list[int] = []
    host, device = encode_both(checkpoint, pillow_decoder(calls, refuse=ITEMS[4][1]))
    assert torch.equal(host, device)
    # The call of the batch holding it failed, then each of that batch's pictures was decoded alone.
    assert sum(calls) > len(DEFERRED) and calls.count(1) >= 2


def raises_then_masks(model: Any, modalities: list[str], contents: list[bytes], bad: int, match: str) -> Any:
    """`encode` raises a MediaError matching `match` for item `bad`; under errors="mask" it warns and answers that
    item invalid (NaN) and every other finite. Answers (vectors, valid) of the masked call."""
    with pytest.raises(MediaError, match=match):
        model.encode(modalities, contents)
    with pytest.warns(UserWarning, match="could not be"):
        vectors, valid = model.encode(modalities, contents, errors="mask")
    assert valid.tolist() == [i != bad for i in range(len(contents))]
    assert bool(torch.isnan(vectors[bad]).all()) and bool(torch.isfinite(vectors[valid]).all())
    return vectors, valid


def test_a_picture_both_refuse_raises_naming_it_or_is_masked(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = ITEMS[7][1]
    real = uform.device_pictures.image_units

    def host_units(data: bytes, **kwargs: Any) -> Any:
        if data == bad:
            raise MediaError("cannot decode the JPEG image: the stand-in refuses it")
        return real(data, **kwargs)

    monkeypatch.setattr(uform.device_pictures, "image_units", host_units)
    model = load(checkpoint)
    model.jpeg_decoder = pillow_decoder([], refuse=bad)
    modalities = [m for m, _ in ITEMS]
    contents = [c for _, c in ITEMS]
    try:
        vectors, valid = raises_then_masks(
            model, modalities, contents, 7, r"contents\[7\]: cannot decode the JPEG image: the stand-in"
        )
        assert model.notices.counts()["media"] == 1
        host = load(checkpoint)
        expected = host.encode(modalities[:7] + modalities[8:], contents[:7] + contents[8:])
        host.close()
        # The others as the host answers them (packed with other neighbours, so to float noise).
        assert torch.allclose(vectors[valid], expected, atol=1e-5, rtol=0)
    finally:
        model.close()


def test_jpeg_is_checked(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for refused in ("gpu", "split"):  # "split" (shared with the host's decoders) was measured slower and removed
        with pytest.raises(ValueError, match=f'jpeg: must be "host" or "device", got {refused!r}'):
            load(checkpoint, jpeg=refused)
    with pytest.raises(ValueError, match='jpeg: "device" decodes on a CUDA device'):
        load(checkpoint, jpeg="device")
    assert load(checkpoint, jpeg="host").jpeg_decoder is None
    records = tmp_path / "records.jsonl"
    records.write_text('{"text": "a line"}\n')
    command = ["encode", str(checkpoint), "--input", str(records), "--output", str(tmp_path / "out.npy"), "--cpu"]
    assert main([*command, "--jpeg", "device"]) == 2
    assert 'jpeg: "device" decodes on a CUDA device' in capsys.readouterr().err
    assert main([*command, "--jpeg", "split"]) == 2
    assert "invalid choice: 'split'" in capsys.readouterr().err
    assert not (tmp_path / "out.npy").exists()
    assert main(command) == 0
