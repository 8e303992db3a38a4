"""Image decoding (`uform.media.image_units`) on real photographs from scikit-image and pygame.

Pins: every container (JPEG, PNG, WebP) decodes; grids, padding and positions for known sizes; channels
1/3/4; 16-bit, palette, grey, CMYK and EXIF-rotated images; downscaling keeps the aspect ratio, fits
`max_units` and never upscales; broken, hostile and wrong-format bytes raise `MediaError` and nothing else;
plain JPEGs (simplejpeg's path) decode bitwise as Pillow's path does, every other image and any JPEG libjpeg warns
about goes to Pillow's path.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from media_samples import (
    content_size,
    cuts,
    encode_image,
    flat_png,
    forged_jpeg,
    mutations,
    photo,
    pictures,
    png_16bit,
    png_palette,
    pygame_file,
    skimage_file,
    video,
)
from PIL import Image

import uform.media.image
from uform.media import MediaError, MediaLimits, image_units, jpeg
from uform.media.grid import fit_size, grid_of
from uform.media.jpeg_plan import plain_size


def decode(data: bytes, patch_side: int = 16, channels: int = 4, max_units: int = 100_000, **limits: Any):
    return image_units(
        data, patch_side=patch_side, channels=channels, max_units=max_units, limits=MediaLimits(**limits)
    )


def crop_png(name: str, width: int, height: int, mode: str = "RGB") -> bytes:
    return encode_image(photo(name).convert(mode).crop((0, 0, width, height)), "PNG")


SAMPLES: dict[str, Callable[[], bytes]] = {
    "png rgb (astronaut)": lambda: skimage_file("astronaut.png"),
    "png rgba (logo)": lambda: skimage_file("logo.png"),
    "png rgba (pygame midikeys)": lambda: pygame_file("midikeys.png"),
    "png grey (camera)": lambda: skimage_file("camera.png"),
    "png grey small (microaneurysms)": lambda: skimage_file("microaneurysms.png"),
    "png 16-bit": png_16bit,
    "png palette": png_palette,
    "png palette (pygame chimp)": lambda: pygame_file("chimp.png"),
    "png palette transparent (pygame alien)": lambda: pygame_file("alien1.png"),
    "jpeg (rocket)": lambda: skimage_file("rocket.jpg"),
    "jpeg (hubble)": lambda: skimage_file("hubble_deep_field.jpg"),
    "jpeg (pygame alien)": lambda: pygame_file("alien1.jpg"),
    "webp (pygame scarlet)": lambda: pygame_file("scarlet.webp"),
    "webp lossy": lambda: encode_image(photo("chelsea.png"), "WEBP", quality=80),
    "webp lossless rgba": lambda: encode_image(photo("horse.png"), "WEBP", lossless=True),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
@pytest.mark.parametrize("channels", [1, 3, 4])
def test_every_container_decodes_at_native_resolution(name: str, channels: int) -> None:
    data = SAMPLES[name]()
    with Image.open(io.BytesIO(data)) as source:
        width, height = source.size
    units = decode(data, channels=channels)
    rows, columns = math.ceil(height / 16), math.ceil(width / 16)
    assert units.grid == (1, rows, columns)
    assert units.values.dtype == np.uint8 and units.values.shape == (rows * columns, 16 * 16 * channels)
    assert units.positions.dtype == np.int64 and units.positions.shape == (rows * columns, 3)
    assert units.truncated is False
    assert units.values.any()


def test_known_size_grid_padding_and_positions() -> None:
    data = crop_png("astronaut.png", 100, 60)
    units = decode(data, channels=3)
    assert units.grid == (1, 4, 7) and units.values.shape == (28, 16 * 16 * 3)
    expected = [(0, r, c) for r in range(4) for c in range(7)]
    assert units.positions.tolist() == [list(p) for p in expected]
    # One read-only positions array per grid, shared by every item of that grid: nothing may write it.
    assert not units.positions.flags.writeable and decode(data, channels=3).positions is units.positions
    picture = pictures(units, 16, 3)[0]
    assert picture.shape == (64, 112, 3)
    source = np.asarray(photo("astronaut.png"))[:60, :100]
    np.testing.assert_array_equal(picture[:60, :100], source)
    assert not picture[60:].any() and not picture[:, 100:].any()  # zero padding right and bottom
    # Each unit is laid out [p, p, C]: the first patch is the top-left 16 x 16 block.
    np.testing.assert_array_equal(units.values[0].reshape(16, 16, 3), source[:16, :16])
    np.testing.assert_array_equal(units.values[7].reshape(16, 16, 3), source[16:32, :16])


@pytest.mark.parametrize("patch_side", [1, 7, 32])
def test_other_patch_sides(patch_side: int) -> None:
    units = decode(crop_png("coffee.png", 45, 30), patch_side=patch_side, channels=1)
    assert units.grid == (1, math.ceil(30 / patch_side), math.ceil(45 / patch_side))
    assert units.values.shape[1] == patch_side * patch_side


def test_channels_conversions() -> None:
    data = crop_png("astronaut.png", 64, 48)
    source = photo("astronaut.png").crop((0, 0, 64, 48))
    rgba = pictures(decode(data, channels=4), 16, 4)[0]
    np.testing.assert_array_equal(rgba[:, :, :3], np.asarray(source))
    assert (rgba[:, :, 3] == 255).all()
    rgb = pictures(decode(data, channels=3), 16, 3)[0]
    np.testing.assert_array_equal(rgb, np.asarray(source))
    grey = pictures(decode(data, channels=1), 16, 1)[0, :, :, 0]
    np.testing.assert_array_equal(grey, np.asarray(source.convert("L")))


def test_grey_source_replicates_into_colour() -> None:
    units = decode(skimage_file("camera.png"), channels=3)
    picture = pictures(units, 16, 3)[0]
    assert (picture[:, :, 0] == picture[:, :, 1]).all() and (picture[:, :, 1] == picture[:, :, 2]).all()
    np.testing.assert_array_equal(picture[:, :, 0], np.asarray(photo("camera.png")))


def test_alpha_kept_in_rgba_and_composited_over_black_otherwise() -> None:
    data = pygame_file("midikeys.png")  # 840 x 160 RGBA, partly transparent
    source = np.asarray(Image.open(io.BytesIO(data))).astype(np.uint16)
    assert source.shape == (160, 840, 4) and (source[:, :, 3] == 0).any() and (source[:, :, 3] == 255).any()
    rgba = pictures(decode(data, channels=4), 16, 4)[0, :160, :840]
    np.testing.assert_array_equal(rgba, source)
    rgb = pictures(decode(data, channels=3), 16, 3)[0, :160, :840]
    premultiplied = (source[:, :, :3] * source[:, :, 3:] + 127) // 255
    np.testing.assert_array_equal(rgb, premultiplied)
    assert not rgb[source[:, :, 3] == 0].any()  # fully transparent reads as the (black) padding


def test_16_bit_scaled_not_clipped() -> None:
    data = png_16bit()
    with Image.open(io.BytesIO(data)) as wide:
        assert wide.mode.startswith("I")
        assert np.asarray(wide).max() > 255
    grey = pictures(decode(data, channels=1), 16, 1)[0, :, :, 0]
    np.testing.assert_array_equal(grey, np.asarray(photo("camera.png")))  # v * 257 comes back as v
    rgb = pictures(decode(data, channels=3), 16, 3)[0]
    np.testing.assert_array_equal(rgb[:, :, 1], grey)


def test_palette_expanded() -> None:
    data = png_palette()
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(pictures(decode(data, channels=3), 16, 3)[0], expected)
    for transparent in (png_palette(transparent=True), pygame_file("alien1.png")):
        with Image.open(io.BytesIO(transparent)) as source:
            assert source.mode == "P" and source.info["transparency"] == 0
            indices = np.asarray(source)
        alpha = pictures(decode(transparent, channels=4), 16, 4)[0, : indices.shape[0], : indices.shape[1], 3]
        assert (indices == 0).any()
        np.testing.assert_array_equal(alpha == 0, indices == 0)


def test_cmyk_jpeg_converted() -> None:
    source = photo("chelsea.png").convert("RGB").crop((0, 0, 128, 96))
    data = encode_image(source.convert("CMYK"), "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    rgb = pictures(decode(data, channels=3), 16, 3)[0].astype(int)
    assert np.abs(rgb - np.asarray(source)).mean() < 8


@pytest.mark.parametrize("orientation, upright", [(1, (96, 64)), (3, (96, 64)), (6, (64, 96)), (8, (64, 96))])
def test_exif_orientation_applied(orientation: int, upright: tuple[int, int]) -> None:
    source = photo("rocket.jpg").crop((200, 100, 296, 164))  # 96 x 64
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode_image(source, "JPEG", quality=95, exif=exif.tobytes())
    units = decode(data, channels=4)
    assert units.grid == (1, math.ceil(upright[1] / 16), math.ceil(upright[0] / 16))
    picture = pictures(units, 16, 4)[0]
    assert content_size(picture) == upright
    if orientation == 6:  # the stored picture turned a quarter clockwise
        expected = np.asarray(Image.open(io.BytesIO(data)).transpose(Image.Transpose.ROTATE_270))
        assert np.abs(picture[:96, :64, :3].astype(int) - expected).mean() < 3


@pytest.mark.parametrize("name", ["rocket.jpg", "hubble_deep_field.jpg", "coffee.png", "logo.png"])
@pytest.mark.parametrize("max_units", [1, 6, 40, 150])
def test_downscale_keeps_aspect_and_fits(name: str, max_units: int) -> None:
    data = skimage_file(name)
    width, height = photo(name).size
    units = decode(data, channels=4, max_units=max_units)
    _, rows, columns = units.grid
    assert rows * columns <= max_units
    picture = pictures(units, 16, 4)[0]
    if name == "logo.png":  # transparent corners: measure through a fully opaque copy instead
        units = decode(encode_image(photo(name).convert("RGB"), "PNG"), channels=4, max_units=max_units)
        picture = pictures(units, 16, 4)[0]
    new_width, new_height = content_size(picture)
    assert (new_width, new_height) == fit_size(width, height, 16, max_units)
    assert new_width < width and new_height < height
    # Aspect kept up to the rounding of one side to whole pixels.
    assert abs(new_width / new_height - width / height) <= (width / height) / min(new_width, new_height) + 1e-9
    # The largest such size: one pixel more on the long side no longer fits.
    long_side = max(new_width, new_height) + 1
    bigger = (long_side, max(1, round(min(width, height) * long_side / max(width, height))))
    rows, columns = grid_of(*bigger, 16)
    assert rows * columns > max_units


def test_jpeg_reduced_decoding_matches_full_decoding() -> None:
    data = skimage_file("hubble_deep_field.jpg")
    units = decode(data, channels=3, max_units=12)
    width, height = fit_size(1000, 872, 16, 12)
    full = photo("hubble_deep_field.jpg").resize((width, height), Image.Resampling.LANCZOS)
    picture = pictures(units, 16, 3)[0, :height, :width].astype(int)
    assert np.abs(picture - np.asarray(full)).mean() < 6


def test_never_upscaled() -> None:
    units = decode(pygame_file("scarlet.webp"), channels=4, max_units=10**6)
    assert units.grid == (1, 2, 2)
    assert content_size(pictures(units, 16, 4)[0]) == (32, 32)
    units = decode(crop_png("astronaut.png", 3, 2), channels=4, max_units=10**6)
    assert units.grid == (1, 1, 1) and content_size(pictures(units, 16, 4)[0]) == (3, 2)


def test_extreme_aspect_ratio_fits() -> None:
    data = encode_image(photo("coffee.png").crop((0, 0, 600, 2)), "PNG")
    units = decode(data, channels=3, max_units=4)
    assert units.grid == (1, 1, 4)


# Broken and hostile bytes: always MediaError, never another exception.


@pytest.mark.parametrize(
    "other",
    [
        lambda: pygame_file("alien1.gif"),
        lambda: pygame_file("arraydemo.bmp"),
        lambda: pygame_file("teal.svg"),
        lambda: pygame_file("yellow.tga"),
        lambda: skimage_file("multipage.tif"),
        lambda: pygame_file("house_lo.wav"),
        lambda: pygame_file("house_lo.mp3"),
        lambda: video("mp4")[0],
        lambda: b"hello, world: plain text is no image",
    ],
    ids=["gif", "bmp", "svg", "tga", "tiff", "wav", "mp3", "mp4", "text"],
)
def test_other_formats_refused(other) -> None:
    with pytest.raises(MediaError, match="not a JPEG, PNG or WebP file"):
        decode(other())


def test_zero_bytes_refused() -> None:
    with pytest.raises(MediaError, match="empty"):
        decode(b"")


@pytest.mark.parametrize("name", ["png rgb (astronaut)", "jpeg (rocket)", "webp lossy", "png 16-bit", "png palette"])
def test_truncated_refused(name: str) -> None:
    for cut in cuts(SAMPLES[name]()):
        with pytest.raises(MediaError):
            decode(cut)


@pytest.mark.parametrize("name", ["png rgb (astronaut)", "jpeg (rocket)", "webp lossy"])
def test_random_and_corrupted_bytes_only_raise_media_error(name: str) -> None:
    data = SAMPLES[name]()
    rng = np.random.default_rng(7)
    candidates = [rng.bytes(4096), data[:16] + rng.bytes(4096), *mutations(data, 12, seed=3)]
    for candidate in candidates:
        try:
            units = decode(candidate, channels=3, max_units=64)
        except MediaError:
            continue
        assert units.values.dtype == np.uint8 and units.grid[1] * units.grid[2] <= 64


def lying_png(width: int, height: int) -> bytes:
    """scikit-image's astronaut with its IHDR rewritten to claim `width` x `height` (CRC fixed)."""
    data = bytearray(skimage_file("astronaut.png"))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_pixel_limit_checked_from_the_header() -> None:
    with pytest.raises(MediaError, match="pixels"):
        decode(skimage_file("astronaut.png"), max_pixels=512 * 512 - 1)
    decode(skimage_file("astronaut.png"), max_pixels=512 * 512, max_units=1)
    # A header that claims 60000 x 60000 (3.6 G pixels) is refused before any pixel is decoded.
    with pytest.raises(MediaError, match="pixels"):
        decode(lying_png(60_000, 60_000))
    # Past Pillow's own decompression-bomb guard, even where our limit would allow it.
    with pytest.raises(MediaError, match="bomb"):
        decode(lying_png(60_000, 60_000), max_pixels=10**10)


def test_forged_jpeg_size_refused() -> None:
    # A 1.5 KB JPEG whose header claims 8000 x 8000: libjpeg would zero-fill the missing blocks without
    # an error, and a grey 64 M pixel picture would be trained on. Refused under any pixel limit.
    forged = forged_jpeg(8000, 8000)
    assert len(forged) < 2000
    with pytest.raises(MediaError, match="pixels is over the limit"):  # the default limit is lower now
        decode(forged, channels=3, max_units=256)
    for claim, max_pixels in ((forged, 10**8), (forged_jpeg(3000, 3000), MediaLimits().max_pixels)):
        with pytest.raises(MediaError, match=r"inconsistent JPEG: a scan holds \d+ bytes, fewer than"):
            decode(claim, channels=3, max_units=256, max_pixels=max_pixels)
    # A real JPEG cut inside its scan and closed with an end-of-image marker is the same lie.
    data = encode_image(photo("astronaut.png"), "JPEG", quality=90)
    scan = data.index(b"\xff\xda")
    with pytest.raises(MediaError, match="inconsistent JPEG"):
        decode(data[: scan + 300] + b"\xff\xd9")
    # Progressive: the DC scans bound it the same way.
    progressive = encode_image(photo("astronaut.png"), "JPEG", quality=90, progressive=True)
    scan = progressive.index(b"\xff\xda")
    with pytest.raises(MediaError, match="inconsistent JPEG"):
        decode(progressive[: scan + 300] + b"\xff\xd9")


def naive_scan_end(data: bytes, at: int) -> int:
    """The end of entropy-coded data, byte by byte: the first FF followed by neither 00 (stuffing), a restart
    marker D0-D7 nor another FF (fill), or the end of the data."""
    while at < len(data):
        if data[at] == 0xFF and at + 1 < len(data):
            following = data[at + 1]
            if not (following == 0x00 or 0xD0 <= following <= 0xD7 or following == 0xFF):
                return at
        at += 1
    return len(data)


def test_the_scan_end_is_the_first_marker_past_stuffing_restarts_and_fill() -> None:
    rng = np.random.default_rng(3)
    alphabet = np.array([0xFF, 0x00, 0xD0, 0xD7, 0xD8, 0xD9, 0xDA, 0x12, 0xC4], dtype=np.uint8)
    cases = [b"", b"\xff", b"\xff\xff", b"\xff\x00\xff\xd0\xff\xff\xd9", b"\x12\xff\xd7\xff\xc4"]
    cases += [bytes(rng.choice(alphabet, size=int(rng.integers(1, 40)))) for _ in range(3000)]
    for data in cases:
        for at in range(len(data) + 1):
            assert jpeg._scan_end(data, at) == naive_scan_end(data, at), (data.hex(), at)
    real = encode_image(photo("astronaut.png"), "JPEG", quality=90)
    scan = real.index(b"\xff\xda")
    start = scan + 2 + int.from_bytes(real[scan + 2 : scan + 4], "big")
    assert jpeg._scan_end(real, start) == naive_scan_end(real, start) == len(real) - 2  # the end-of-image marker


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("mode", ["L", "RGB", "CMYK"])
def test_consistent_jpegs_pass_the_scan_check(mode: str, progressive: bool) -> None:
    # The tightest honest JPEGs: one flat colour at the lowest quality, optimised Huffman tables.
    for size in ((1, 1), (17, 9), (2000, 8), (1024, 1024)):
        flat = encode_image(Image.new(mode, size), "JPEG", quality=1, optimize=True, progressive=progressive)
        assert decode(flat, max_units=64).grid[0] == 1
    photo_jpeg = encode_image(photo("astronaut.png").convert(mode), "JPEG", quality=75, progressive=progressive)
    assert decode(photo_jpeg, max_units=64).grid[0] == 1


def test_truncation_checks_stay_on() -> None:
    from PIL import ImageFile

    # Pillow's own check refuses a file that ends without its end marker; nothing may turn it off.
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    data = skimage_file("rocket.jpg")
    with pytest.raises(MediaError, match="truncated"):
        decode(data[: len(data) - 200])


def pillows_path(data: bytes, monkeypatch: pytest.MonkeyPatch, **options: Any) -> Any:
    """The units of `data` as Pillow's path alone decodes them (no image is plain)."""
    with monkeypatch.context() as patch:
        patch.setattr(uform.media.image, "_plain_jpeg", lambda *_: None)
        return decode(data, **options)


def same_units(a: Any, b: Any) -> bool:
    return a.grid == b.grid and np.array_equal(a.values, b.values) and np.array_equal(a.positions, b.positions)


PLAIN_SIZES = [(256, 256), (250, 237), (17, 9), (1, 1), (640, 48), (48, 640)]


@pytest.mark.parametrize("channels", [3, 4])
@pytest.mark.parametrize("subsampling", [0, 1, 2], ids=["4:4:4", "4:2:2", "4:2:0"])
def test_plain_jpegs_decode_bitwise_as_pillows_path(
    subsampling: int, channels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # simplejpeg and Pillow both run libjpeg-turbo's accurate integer DCT and fancy upsampling: the same pixels.
    cases = [skimage_file("rocket.jpg"), skimage_file("retina.jpg"), pygame_file("alien1.jpg")]  # camera-made
    for size in PLAIN_SIZES:
        for quality, optimize, progressive in ((95, False, False), (40, True, False), (90, False, True)):
            image = photo("astronaut.png").convert("RGB").resize(size, Image.Resampling.BOX)
            options = {"quality": quality, "optimize": optimize, "progressive": progressive}
            cases.append(encode_image(image, "JPEG", subsampling=subsampling, **options))
    for data in cases:
        options = {"channels": channels, "max_units": 8192}
        plan = {"patch_side": 16, "channels": channels, "max_units": 8192, "limits": MediaLimits()}
        assert plain_size(data, **plan, progressive=True) is not None
        taken = uform.media.image._plain_jpeg(data, 16, channels, 8192, MediaLimits())
        assert taken is not None and taken.shape[2] == channels  # the fast path answered, not Pillow's
        assert same_units(decode(data, **options), pillows_path(data, monkeypatch, **options))


def test_damaged_plain_jpegs_decode_as_pillows_path_or_go_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Bytes of the scans overwritten at random: where simplejpeg decodes without a warning, it answers; everything
    # else is Pillow's path's to decode or refuse (only MediaError escapes). Where Pillow's libjpeg-turbo is of
    # simplejpeg's major version (3; simplejpeg >= 1.8 bundles 3.x), the damaged pixels are Pillow's too; libjpeg-
    # turbo 2.1 (Pillow 10.0) reads some damage differently, as it did before this path between Pillow releases.
    from PIL import features

    turbo = features.version("libjpeg_turbo") or "0"
    alike = int(turbo.split(".")[0]) >= 3
    rng = np.random.default_rng(2)
    image = photo("astronaut.png").convert("RGB").resize((64, 48), Image.Resampling.BOX)
    sources = [encode_image(image, "JPEG", quality=90), encode_image(image, "JPEG", quality=70, progressive=True)]
    answered = 0
    for trial in range(300):
        data = bytearray(sources[trial % 2])
        scan = data.index(b"\xff\xda")
        for at in rng.integers(scan + 2, len(data), size=int(rng.integers(1, 4))):
            data[int(at)] = int(rng.integers(0, 256))
        taken = uform.media.image._plain_jpeg(bytes(data), 16, 4, 4096, MediaLimits())
        if taken is None:
            with contextlib.suppress(MediaError):
                decode(bytes(data))
            continue
        answered += 1
        units = decode(bytes(data))
        assert units.grid == (1, 3, 4) and taken.shape == (48, 64, 4)
        if alike:
            assert same_units(units, pillows_path(bytes(data), monkeypatch))
    assert answered > 50  # the damage left many files decodable: the comparison ran


def test_jpegs_that_are_not_plain_never_reach_simplejpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    image = photo("astronaut.png").convert("RGB").resize((64, 48), Image.Resampling.BOX)
    exif = Image.Exif()
    exif[0x0112] = 6
    others = {  # (bytes, channels, max_units): each not plain for one reason only
        "rotated": (encode_image(image, "JPEG", exif=exif.tobytes()), 4, 4096),
        "grey": (encode_image(image.convert("L"), "JPEG"), 4, 4096),
        "cmyk": (encode_image(image.convert("CMYK"), "JPEG"), 4, 4096),
        "grey from colour": (encode_image(image, "JPEG"), 1, 4096),
        "a PNG": (encode_image(image, "PNG"), 4, 4096),
        "shrunk to fit a row": (encode_image(image, "JPEG"), 4, 4),
        "progressive, shrunk to fit a row": (encode_image(image, "JPEG", progressive=True), 4, 4),
    }
    assert uform.media.image._plain_jpeg(encode_image(image, "JPEG"), 16, 4, 4096, MediaLimits()) is not None

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("simplejpeg was asked to decode a JPEG that is not plain")

    expected = {why: decode(data, channels=c, max_units=m) for why, (data, c, m) in others.items()}
    monkeypatch.setattr(uform.media.image.simplejpeg, "decode_jpeg", refuse)
    for why, (data, channels, max_units) in others.items():
        assert same_units(decode(data, channels=channels, max_units=max_units), expected[why]), why


def test_a_jpeg_libjpeg_warns_about_is_judged_by_pillows_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # A scan a few bytes short of its blocks, closed by its end marker: more than the consistency check's bound,
    # so the header walk passes it, and libjpeg warns ("premature end of data segment") and decodes. simplejpeg's
    # strict mode refuses it, so Pillow's path answers for it, as it did before the fast path existed.
    clean = encode_image(photo("astronaut.png").convert("RGB").resize((64, 48)), "JPEG", quality=90)
    warned = clean[:-40] + b"\xff\xd9"
    assert plain_size(warned, patch_side=16, channels=4, max_units=4096, limits=MediaLimits()) == (64, 48)
    with pytest.raises(ValueError, match="premature end"):
        uform.media.image.simplejpeg.decode_jpeg(warned, colorspace="RGB", strict=True)
    assert uform.media.image._plain_jpeg(warned, 16, 4, 4096, MediaLimits()) is None
    assert same_units(decode(warned), pillows_path(warned, monkeypatch))
    # A plain JPEG cut before its end marker is refused as Pillow's path refuses it.
    with pytest.raises(MediaError, match="truncated"):
        decode(clean[: len(clean) - 40])


def test_default_pixel_limit_refuses_a_flat_8000_square_png() -> None:
    # 200 KB of PNG that would take 64 M pixels (over 700 MB in one decoder) is refused from its header.
    huge = flat_png(8000, 8000)
    assert len(huge) < 256_000
    with pytest.raises(MediaError, match="64000000 pixels is over the limit of 16000000 pixels"):
        decode(huge, channels=3, max_units=256)
    assert decode(flat_png(4000, 4000), channels=3, max_units=256).grid == (1, 16, 16)


# VmHWM, not ru_maxrss: Linux carries a process's ru_maxrss across exec, so a child of a large pytest process
# would start at its parent's peak; the high-water mark of a fresh address space starts at its own.
_PEAK = """
import sys
from uform.media import image_units

def high_water():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

data = open(sys.argv[1], "rb").read()
image_units(open(sys.argv[2], "rb").read(), patch_side=16, channels=4, max_units=4)  # imports, warm
base = high_water()
image_units(data, patch_side=16, channels=4, max_units=4096)
print(high_water() - base)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak from Linux's /proc")
@pytest.mark.parametrize("kind", ["png rgb", "png rgba", "png palette", "png 16-bit", "jpeg", "webp"])
def test_one_decoder_stays_under_256_mb_at_the_pixel_limit(kind: str, tmp_path: Any) -> None:
    # Peak resident growth of a fresh process decoding one image at the default pixel limit (4000 x 4000).
    side = math.isqrt(MediaLimits().max_pixels)
    picture = Image.new("RGBA" if kind in ("png rgba", "webp") else "RGB", (side, side), (9, 99, 199, 100))
    if kind == "png palette":
        picture = picture.quantize(4)
    elif kind == "png 16-bit":
        picture = Image.fromarray(np.full((side, side), 40000, np.uint16))
    format, options = {"jpeg": ("JPEG", {}), "webp": ("WEBP", {"lossless": True})}.get(kind, ("PNG", {}))
    path, small = tmp_path / "big", tmp_path / "small"
    path.write_bytes(encode_image(picture, format, **options))
    small.write_bytes(encode_image(picture.resize((8, 8)), format, **options))
    del picture
    run = subprocess.run(
        [sys.executable, "-c", _PEAK, str(path), str(small)], capture_output=True, text=True, check=True
    )
    peak = int(run.stdout)
    print(f"{kind}: {peak / 2**20:.0f} MB")
    assert 0 < peak < 256 * 2**20, f"{kind}: {peak / 2**20:.0f} MB"


def test_byte_limit() -> None:
    data = skimage_file("rocket.jpg")
    with pytest.raises(MediaError, match="bytes"):
        decode(data, max_bytes=len(data) - 1)
    decode(data, max_bytes=len(data), max_units=4)


def test_bad_arguments_are_value_errors() -> None:
    data = skimage_file("rocket.jpg")
    for arguments in ({"channels": 2}, {"patch_side": 0}, {"max_units": 0}):
        with pytest.raises(ValueError) as raised:
            decode(data, **arguments)  # type: ignore[arg-type]
        assert not isinstance(raised.value, MediaError)


@pytest.mark.parametrize("shape", [(32, 48, 4), (30, 45, 3), (16, 16, 1), (2, 32, 16, 3), (3, 17, 33, 3)])
def test_tile_lays_patches_and_tubes_out_as_a_loop_over_them_does(shape: tuple[int, ...]) -> None:
    """`tile` against a plain loop over the zero-padded picture: whole-patch sizes (which skip the padded copy)
    and ragged ones, pictures [H, W, C] and frames [T, H, W, C], a read-only input as Pillow's arrays are."""
    from uform.media.grid import tile

    side = 16
    pixels = np.random.default_rng(len(shape)).integers(0, 256, size=shape, dtype=np.uint8)
    pixels.setflags(write=False)
    frames = pixels if pixels.ndim == 4 else pixels[None]
    count, height, width, channels = frames.shape
    rows, columns = -(-height // side), -(-width // side)
    padded = np.zeros((count, rows * side, columns * side, channels), dtype=np.uint8)
    padded[:, :height, :width] = frames
    expected = [
        padded[:, r * side : (r + 1) * side, c * side : (c + 1) * side].reshape(-1)
        for r in range(rows)
        for c in range(columns)
    ]
    got = tile(pixels, side)
    assert got.shape == (rows * columns, count * side * side * channels) and got.flags.c_contiguous
    assert got.flags.writeable and not np.shares_memory(got, pixels)  # the decoder's own array, never the input
    assert np.array_equal(got, np.stack(expected))
