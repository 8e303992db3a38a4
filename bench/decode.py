"""Media decode throughput, and the prepare stage's time per step, of uform's trainer.

Two measurements:

  decode        items per second that `uform.runtime.decoders.DecodePool` decodes with `decode_item`, on one worker
                process and on N (default: one per core), per modality, with the per-core rate beside it; and
                `decode_item` called in this process, the pool's baseline. Samples are built here from files
                other people made: 256 x 256 JPEGs cut from scikit-image's photographs (patch 16, channels 4),
                short MP4 clips panning over them (H.264 where PyAV's wheel has it; patch 16, tubes of 2,
                channels 3) and pygame's house recording as WAV and MP3 (7 s at 11025 Hz; resampled to 16 kHz,
                frames of 320).
  prepare       `Replica.prepare` (the prepare stage of a step: decode in the pool, pack, corrupt, pair, host
                tensors, and the flex block tables on CUDA; in process unless `--host-processes`) per step, for
                a batch of 256 x 256 JPEGs beside text at a given geometry, with its decode part
                (`Replica.decode`, always in process) alone. Run it on the GPU
                machine (`--executor cuda`) beside bench/step.py's step time: the prepare stage runs ahead of
                the device stage on its own thread, so the data wait of a step is whatever of this time the
                device stage does not cover.

With `--jpeg-variants`, only `media.image_units` in this process over 256² sequential and progressive JPEGs and
1024 x 768 ones shrunk to fit a row (run it in two trees to compare their decoders).

With `--core-scaling 1,8,16`, only this host's cores: for each count N, N forked processes each call
`decode_item` on the 256² JPEGs (patch 16, channels 3, as serving's bench) in a loop for `--seconds`, all started
together, with nothing between them (no pool, no shared memory, no parent reading answers): the most JPEGs a
second that N decoders could give on this host; beside it, a `DecodePool` of N decoding the same JPEGs through
`decode_items` (chunks a job, as serving and the trainer decode) for as long, so the pool's own cost reads off
the same run.

With `--keys N`, only a `DecodePool` of N decoding the 256² JPEGs through `decode_items` with the items' keys
(`keyed=True`: the digest a step that masks media draws by) and without (`keyed=False`: contrastive steps and
serving), in turn, `--repeats` rounds of `--seconds` each: what the digest costs the decoders.

Prints a table and writes bench-decode.json under $OUT (or the current folder). Usage:
  python bench/decode.py --core-scaling 1,2,4,8,16 [--seconds 3]
  python bench/decode.py --keys 1 [--seconds 3 --repeats 3]
  python bench/decode.py [--workers N] [--items 256] [--clips 48] [--recordings 48]
                         [--executor cpu|cuda] [--rows 64 --columns 1024 --segments 256 --images 128
                          --texts 128 --steps 10]
"""

from __future__ import annotations

import argparse
import functools
import importlib.resources
import io
import os
import pathlib
import platform
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import add_geometry, bench_config, decode_in_pool, topic_text, write_json  # a sibling module

os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # pygame greets on import otherwise

PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png", "hubble_deep_field.jpg")

# ---- samples ------------------------------------------------------------------------------------------------


def sample_folder(package: str) -> Any:
    """scikit-image's or pygame's data folder, or its copy under $UFORM_SAMPLE_MEDIA (bench/sample_media.py)."""
    copies = os.environ.get("UFORM_SAMPLE_MEDIA")
    if copies:
        return pathlib.Path(copies) / package
    return importlib.resources.files(package) / ("data" if package == "skimage" else "examples/data")


@functools.cache
def photo(name: str) -> Any:
    from PIL import Image

    data = (sample_folder("skimage") / name).read_bytes()
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


def square(name: str, side: int) -> Any:
    """The photograph's centre square, scaled to `side` x `side`."""
    from PIL import Image

    image = photo(name)
    short = min(image.size)
    left, top = (image.width - short) // 2, (image.height - short) // 2
    return image.crop((left, top, left + short, top + short)).resize((side, side), Image.Resampling.LANCZOS)


def jpegs(side: int = 256) -> list[bytes]:
    out = []
    for name in PHOTOS:
        buffer = io.BytesIO()
        square(name, side).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def clip(name: str, size: tuple[int, int], frames: int, fps: int = 12) -> tuple[bytes, str]:
    """An MP4 panning a window across the photograph, left to right; answers (bytes, codec)."""
    import av
    from PIL import Image

    image = photo(name)
    width, height = size
    window = (min(image.width // 2, width * 3), min(image.height, height * 3))
    window = (window[0], round(window[0] * height / width))
    step = (image.width - window[0]) // max(1, frames - 1)
    top = (image.height - window[1]) // 2
    pixels = [
        np.asarray(
            image.crop((i * step, top, i * step + window[0], top + window[1])).resize(size, Image.Resampling.BOX)
        )
        for i in range(frames)
    ]
    failures = []
    for codec in ("libx264", "h264", "mpeg4"):
        out = io.BytesIO()
        try:
            with av.open(out, mode="w", format="mp4") as container:
                stream: Any = container.add_stream(codec, rate=fps)
                stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
                stream.options = {"preset": "veryfast", "crf": "20"} if codec != "mpeg4" else {"qscale": "3"}
                for index, frame_pixels in enumerate(pixels):
                    frame = av.VideoFrame.from_ndarray(frame_pixels, format="rgb24")
                    frame.pts = index
                    container.mux(stream.encode(frame))
                container.mux(stream.encode(None))
            return out.getvalue(), codec
        except Exception as error:  # the codec is absent from PyAV's wheel: try the next one
            failures.append(f"{codec}: {error}")
    raise RuntimeError(f"no MP4 encoder in PyAV's wheel: {failures}")


def recordings() -> list[tuple[str, bytes]]:
    data = sample_folder("pygame")
    return [("wav", (data / "house_lo.wav").read_bytes()), ("mp3", (data / "house_lo.mp3").read_bytes())]


# ---- decode throughput ----------------------------------------------------------------------------------------


def decode_rates(args: argparse.Namespace) -> list[dict[str, Any]]:
    from uform.media.decode import decode_item
    from uform.media.limits import MediaLimits
    from uform.runtime.decoders import DecodePool, decode_parallelism

    limits = MediaLimits()
    image = {"patch_side": 16, "channels": 4}
    video = {"patch_side": 16, "tube_frames": 2, "frame_stride": 1, "channels": 3}
    audio = {"chunk_samples": 320, "sample_rate": 16000}
    size = tuple(int(v) for v in args.video_size.split("x"))
    clips = [clip(name, size, args.video_frames) for name in PHOTOS[:3]]
    kinds = [
        ("image", "jpeg 256x256", image, jpegs(256), args.items),
        (
            "video",
            f"mp4 {args.video_size} x{args.video_frames} ({clips[0][1]})",
            video,
            [c for c, _ in clips],
            args.clips,
        ),
        # `--recordings 0` leaves audio out, and with it pygame (not installed on every machine).
        *(
            ("audio", f"{name} 7.1 s 11025 Hz", audio, [data], args.recordings)
            for name, data in (recordings() if args.recordings else [])
        ),
    ]
    counts = sorted({1, args.workers or decode_parallelism()})
    rows = []
    for kind, label, geometry, samples, count in kinds:
        if count == 0:  # `--items 0` / `--clips 0` leave that modality out
            continue
        jobs = [((kind, samples[i % len(samples)], geometry, args.max_units, limits), {}) for i in range(count)]
        units = len(decode_item(*jobs[0][0]))
        inline_count = min(count, 64)
        started = time.perf_counter()
        for job, _ in jobs[:inline_count]:
            decode_item(*job)
        inline = inline_count / (time.perf_counter() - started)
        row: dict[str, Any] = {"modality": kind, "sample": label, "units": units, "items": count, "inline": inline}
        for workers in counts:
            with DecodePool(workers, limits.timeout_seconds) as pool:
                pool.map(decode_item, jobs[: 2 * workers])  # start and warm every worker
                started = time.perf_counter()
                outcomes = pool.map(decode_item, jobs)
                seconds = time.perf_counter() - started
            failed = [o.error for o in outcomes if not o.ok]
            if failed:
                raise RuntimeError(f"{label}: {len(failed)} items failed to decode: {failed[0]}")
            row[f"workers_{workers}"] = {"items_s": count / seconds, "items_s_per_core": count / seconds / workers}
        rows.append(row)
        print_decode_row(row, counts)
    return rows


def jpeg_variants(args: argparse.Namespace) -> dict[str, float]:
    """ms an image of `media.image_units` in this process (best of `--repeats` passes, the variants interleaved)
    for JPEGs of the kinds a training set holds: 256² sequential and progressive (native size), and 1024 x 768
    shrunk to fit 1023 and 255 units (Lanczos after libjpeg's reduced-scale decode). Run it in two trees to
    compare their decoders side by side."""
    from uform.media import image_units

    def encoded(image: Any, **options: Any) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=90, **options)
        return buffer.getvalue()

    small = [square(name, 256) for name in PHOTOS]
    large = [square(name, 1024).crop((0, 128, 1024, 896)) for name in PHOTOS[:3]]
    variants = {
        "256² sequential": ([encoded(image) for image in small], 1023),
        "256² progressive": ([encoded(image, progressive=True) for image in small], 1023),
        "1024x768 to 1023 units": ([encoded(image) for image in large], 1023),
        "1024x768 to 255 units": ([encoded(image) for image in large], 255),
    }
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.repeats):
        for name, (samples, max_units) in variants.items():
            started = time.perf_counter()
            for data in samples * 4:
                image_units(data, patch_side=16, channels=4, max_units=max_units)
            best[name] = min(best[name], (time.perf_counter() - started) * 1e3 / (4 * len(samples)))
    for name, ms in best.items():
        print(f"{name:24s} {ms:8.3f} ms an image (image_units, in process, best of {args.repeats})")
    return best


def print_decode_row(row: dict[str, Any], counts: list[int]) -> None:
    if not hasattr(print_decode_row, "header"):
        columns = "".join(f" {f'{w} worker' + ('s' if w > 1 else ''):>20}" for w in counts)
        print(f"{'modality':<8} {'sample':<34} {'units':>6} {'in-process':>11}{columns}   (items/s; per core)")
        print_decode_row.header = True  # type: ignore[attr-defined]
    cells = "".join(
        f" {row[f'workers_{w}']['items_s']:>9.1f}; {row[f'workers_{w}']['items_s_per_core']:>8.1f}" for w in counts
    )
    print(f"{row['modality']:<8} {row['sample']:<34} {row['units']:>6} {row['inline']:>11.1f}{cells}")


# ---- the prepare stage of a step ---------------------------------------------------------------------------------


def host_prepare_seconds(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per step of `Replica.prepare` (and of its decode, `Replica.decode`) for `args.images` 256 x 256
    JPEGs beside `args.texts` captions, on a trainer of the given geometry; the first step (pool start) is left
    out. This is the host-side work a step's device stage may wait on."""
    import uform as u
    from uform.media.decode import MediaPolicy

    executor = u.Executor.for_vram([0]) if args.executor == "cuda" else u.Executor.cpu()
    config = bench_config(args, batch={"image": u.ImageShape(patch_side=16, channels=4)})
    media = MediaPolicy(workers=args.workers)
    trainer = u.Trainer.init_vram(executor, config, media=media, host_processes=args.host_processes)
    text = topic_text()
    images = jpegs(256)
    modalities = [u.Modality.Image] * args.images + [u.Modality.Text] * args.texts
    contents = [images[i % len(images)] for i in range(args.images)]
    contents += [text[i * args.text_bytes : (i + 1) * args.text_bytes] for i in range(args.texts)]
    pairs = min(args.images, args.texts)
    ids = [[args.images + i] if i < pairs else [] for i in range(args.images)]
    ids += [[i] if i < pairs else [] for i in range(args.texts)]
    offsets = np.cumsum([0] + [len(x) for x in ids]).tolist()
    relations = u.Relations(attract=u.Edges(offsets=offsets, ids=[j for x in ids for j in x]))
    replica = trainer.replica  # one device's pipeline, in this process
    checked = replica.check_step(modalities, contents, u.TrainerStepConfig(relations=relations), copy_buffers=False)
    try:
        batch, _ = replica.prepare(checked, 1)  # starts the decode pool
        prepare, decode = [], []
        for step in range(2, args.steps + 2):
            started = time.perf_counter()
            replica.decode(checked)
            decode.append(time.perf_counter() - started)
            started = time.perf_counter()
            batch, _ = replica.prepare(checked, step)
            prepare.append(time.perf_counter() - started)
    finally:
        trainer.close()
    result = {
        "executor": args.executor,
        "attention": trainer.attention,
        "geometry": {"rows": args.rows, "columns": args.columns, "segments": args.segments},
        "items": {"images": args.images, "texts": args.texts, "text_bytes": args.text_bytes},
        "decode_workers": replica.stage.decode_workers,
        "placed": int(batch.layout.placed.sum()),
        "dropped": batch.dropped,
        "image_units": int(batch.media["image"]["valid"].sum()),
        "prepare_ms": float(np.median(prepare) * 1e3),
        "decode_ms": float(np.median(decode) * 1e3),
        "rest_ms": float((np.median(prepare) - np.median(decode)) * 1e3),
        "images_s": args.images / float(np.median(prepare)),
    }
    print(
        f"\nprepare: {args.images} JPEGs 256x256 + {args.texts} texts of {args.text_bytes} B into {args.rows} x "
        f"{args.columns} ({args.segments} segments; {result['placed']} placed, {result['dropped']} dropped), "
        f"{result['decode_workers']} decoders, {args.executor}/{result['attention']}:\n"
        f"  Replica.prepare {result['prepare_ms']:.1f} ms/step = decode {result['decode_ms']:.1f} ms + pack, "
        f"corrupt, pair, tensors {result['rest_ms']:.1f} ms; {result['images_s']:.0f} images/s (median of {args.steps})"
    )
    return result


_LOOP: dict[str, Any] = {}  # what a forked `--core-scaling` process decodes, set before the fork
_GEOMETRY = {"patch_side": 16, "channels": 3}  # of the 256² JPEGs that --core-scaling and --keys decode


def _decode_loop(start: float, answers: Any) -> None:
    """Puts the JPEGs decoded from `start` (a time.time() all processes share) for `_LOOP["seconds"]`."""
    from uform.media.decode import decode_item

    samples, geometry, limits, seconds = _LOOP["samples"], _LOOP["geometry"], _LOOP["limits"], _LOOP["seconds"]
    time.sleep(max(0.0, start - time.time()))
    done, end = 0, start + seconds
    while time.time() < end:
        decode_item("image", samples[done % len(samples)], geometry, 1023, limits)
        done += 1
    answers.put(done)


def core_scaling(args: argparse.Namespace) -> list[dict[str, Any]]:
    import multiprocessing

    from uform.media.limits import MediaLimits

    counts = [int(n) for n in args.core_scaling.split(",")]
    if not counts or min(counts) < 1:
        raise SystemExit("--core-scaling: give process counts of at least 1, comma-separated")
    _LOOP.update(
        samples=jpegs(256),
        geometry=_GEOMETRY,
        limits=MediaLimits(),
        seconds=args.seconds,
    )
    context = multiprocessing.get_context("fork")  # forked: the loop and its samples need no pickling
    rows = []
    print(f"{'processes':>9}  {'JPEGs/s':>9}  {'per process':>11}  {'against one':>11}  {'pool, JPEGs/s':>12}")
    for n in counts:
        answers = context.Queue()
        start = time.time() + 0.5
        processes = [context.Process(target=_decode_loop, args=(start, answers)) for _ in range(n)]
        for process in processes:
            process.start()
        done = [answers.get(timeout=60 + args.seconds) for _ in processes]
        for process in processes:
            process.join()
        rate = sum(done) / args.seconds
        pooled = _pool_rate(n, args.seconds)
        rows.append({"processes": n, "images_s": rate, "per_process": rate / n, "pool_images_s": pooled})
        first = rows[0]["per_process"]
        print(f"{n:>9}  {rate:>9,.0f}  {rate / n:>11,.0f}  {rate / n / first:>10.0%}  {pooled:>12,.0f}", flush=True)
    return rows


def _pool_rate(workers: int, seconds: float) -> float:
    """JPEGs/s of a `DecodePool` of `workers` through `decode_items` (chunks of images a decoder job, as serving
    and the trainer decode them), the same samples over and over for about `seconds`, after one warm-up pass."""
    from uform.runtime.decoders import DecodePool

    contents = _pool_load(_LOOP["samples"], workers)
    with DecodePool(workers) as pool:
        decode_in_pool(pool, contents, _LOOP["geometry"])
        return _rate(pool, contents, _LOOP["geometry"], seconds)


def _pool_load(samples: list[bytes], workers: int) -> list[bytes]:
    """64 JPEGs a decoder, `samples` over and over: one `decode_in_pool` call of a pool of `workers`."""
    return [samples[i % len(samples)] for i in range(64 * workers)]


def _rate(pool: Any, contents: list[bytes], geometry: dict[str, int], seconds: float, keyed: bool = True) -> float:
    """JPEGs/s of `decode_in_pool` over `contents`, called again and again for about `seconds`."""
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        decode_in_pool(pool, contents, geometry, keyed)
        done += len(contents)
    return done / (time.perf_counter() - started)


def key_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    """JPEGs/s of a pool of `args.keys` decoders, keyed and unkeyed in turn (`--keys`), one row a round."""
    from uform.runtime.decoders import DecodePool

    contents = _pool_load(jpegs(256), args.keys)
    rows = []
    print(f"{'decoders':>8}  {'keyed, JPEGs/s':>14}  {'unkeyed':>9}  {'gain':>6}")
    with DecodePool(args.keys) as pool:
        decode_in_pool(pool, contents, _GEOMETRY)  # the decoders' start and first imports, untimed
        for _ in range(args.repeats):
            keyed, unkeyed = (_rate(pool, contents, _GEOMETRY, args.seconds, k) for k in (True, False))
            rows.append({"decoders": args.keys, "keyed_images_s": keyed, "unkeyed_images_s": unkeyed})
            print(f"{args.keys:>8}  {keyed:>14,.0f}  {unkeyed:>9,.0f}  {unkeyed / keyed - 1:>+6.1%}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workers", type=int, default=0, help="decoder processes for the N-worker runs; 0: one per core"
    )
    parser.add_argument("--items", type=int, default=256, help="images decoded per measurement")
    parser.add_argument("--clips", type=int, default=48, help="clips decoded per measurement")
    parser.add_argument("--recordings", type=int, default=48, help="recordings decoded per measurement")
    parser.add_argument("--video-size", default="128x96", help="clip width x height")
    parser.add_argument("--video-frames", type=int, default=24)
    parser.add_argument("--max-units", type=int, default=1023, help="units one item may fill (a row's columns - 1)")
    parser.add_argument("--skip-decode", action="store_true", help="only the prepare measurement")
    parser.add_argument("--skip-prepare", action="store_true", help="only the decode measurement")
    parser.add_argument(
        "--jpeg-variants", action="store_true", help="only image_units over JPEG kinds in this process (no pool)"
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="passes of --jpeg-variants (the best kept), rounds of --keys"
    )
    parser.add_argument(
        "--core-scaling", default="", help="only N forked decoders' JPEGs/s and a pool of N's, for each N listed"
    )
    parser.add_argument("--keys", type=int, default=0, help="only a pool of N decoding keyed and unkeyed in turn")
    parser.add_argument("--seconds", type=float, default=3.0, help="--core-scaling, --keys: seconds each rate runs")
    parser.add_argument("--executor", choices=("cpu", "cuda"), default="cpu")
    add_geometry(parser, depth=2, hidden=128)
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--text-bytes", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--host-processes", type=int, default=0, help="where Replica.prepare runs (0: in process, decode timed apart)"
    )
    args = parser.parse_args(argv)

    report: dict[str, Any] = {
        "machine": {"cores": len(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine()},
        "python": sys.version.split()[0],
    }
    if args.jpeg_variants:
        report["jpeg_variants"] = jpeg_variants(args)
        args.skip_decode = args.skip_prepare = True
    if args.core_scaling:
        report["core_scaling"] = core_scaling(args)
        args.skip_decode = args.skip_prepare = True
    if args.keys:
        report["keys"] = key_cost(args)
        args.skip_decode = args.skip_prepare = True
    if not args.skip_decode:
        report["decode"] = decode_rates(args)
    if not args.skip_prepare:
        report["prepare"] = host_prepare_seconds(args)
    path = write_json("bench-decode.json", report)
    print(f"\nwrote {path}")
    return report


if __name__ == "__main__":
    main()
