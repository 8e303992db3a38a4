"""`uform train` from WebDataset shards against the library-level loop of the same steps (issue 13's GPU figure).

Writes `--records` image-caption records (256 x 256 JPEGs cut from scikit-image's photographs, each crop its own
bytes, with ~60-byte captions from CPython's pydoc topics) into `--shards` tar shards on local disk, and a run
file at the reference geometry (docs/design.md §1: 12 x 512, 64 rows x 1024 columns, 256 segments, patch 16),
objective contrastive. Then, in one process on one device, one after the other:

  library   the steps a `Loader` fills from those shards, read into memory first, then submitted through
            `Trainer.deferred` as many in flight as fit keeps: the trainer's own rate on these very steps.
  fit       `uform.fit` on the run file (what `uform train` calls): the shards read, records shuffled and
            filled into steps while the device runs, metrics written, a checkpoint at the end.

pairs/s is the median over the timed steps (after `--warmup`) of items per step / 2 over seconds per step (fit:
from its metrics.jsonl, the time between two completions). Prints both and their ratio; writes
bench-train-shards.json under $OUT (or the current folder).

  python bench/train_shards.py [--steps 40 --warmup 10 --records 8192 --shards 16]
  python bench/train_shards.py --depth 2 --hidden 128 --rows 8 --columns 640 --segments 32 --records 256 --steps 6 --warmup 2 --cpu
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import statistics
import sys
import tarfile
import tempfile
import time
from collections import deque
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import add_geometry, topic_slices, write_json  # sibling scripts, not a package
from decode import PHOTOS, photo

RUN_FILE = """\
[trainer]
depth = {depth}
hidden = {hidden}
objective = "contrastive"
seed = 42

[trainer.batch]
max_rows_per_device = {rows}
max_segments_per_device = {segments}
max_columns_per_row = {columns}

[trainer.batch.image]
patch_side = 16

[trainer.schedule]
steps = {steps}

[data]
train = "shards/{{{first}..{last}}}.tar"
fields = {{ jpg = "image", txt = "text" }}
"""


def jpeg(index: int, side: int = 256) -> bytes:
    """A distinct side x side JPEG: photograph `index % 6`, a window whose size and corner move with `index`."""
    from PIL import Image

    image = photo(PHOTOS[index % len(PHOTOS)])
    short = min(image.size)
    turn = index // len(PHOTOS)
    window = short // 2 + (turn * 13) % (short // 2)
    room = max(1, short - window)
    left, top = (turn * 7) % room, (turn * 11) % room
    buffer = io.BytesIO()
    crop = image.crop((left, top, left + window, top + window)).resize((side, side), Image.Resampling.BILINEAR)
    crop.save(buffer, format="JPEG", quality=85 + turn % 10)
    return buffer.getvalue()


def write_shards(folder: pathlib.Path, records: int, shards: int) -> int:
    """`records` records over `shards` tars in `folder/shards/`; answers the bytes written."""
    (folder / "shards").mkdir(parents=True)
    captions = topic_slices(records, 60)
    per = -(-records // shards)
    written = 0
    for shard in range(shards):
        path = folder / "shards" / f"{shard:03d}.tar"
        with tarfile.open(path, "w") as archive:
            for index in range(shard * per, min(records, (shard + 1) * per)):
                for field, data in (("jpg", jpeg(index)), ("txt", captions[index])):
                    member = tarfile.TarInfo(f"{index:08d}.{field}")
                    member.size = len(data)
                    archive.addfile(member, io.BytesIO(data))
        written += path.stat().st_size
    return written


def library_rates(run: Any, executor: Any, args: argparse.Namespace) -> list[float]:
    """pairs/s of each step the loader fills, read ahead into memory, submitted as many in flight as fit keeps."""
    import uform as u
    from uform.sources import Loader, open_source

    source = open_source(list(run.data.train), fields=dict(run.data.fields))
    loader = Loader(source, run.trainer, devices=1)
    steps = [loader.next_step() for _ in range(args.steps)]
    from uform.fitting import steps_in_flight

    trainer = u.Trainer.init_vram(executor, run.trainer)
    try:
        depth = steps_in_flight(trainer)  # as fit keeps them
        deferred = trainer.deferred(executor)
        in_flight: deque = deque()
        rates = []
        finished = time.perf_counter()
        for step_input in [*steps, *[None] * depth]:
            if step_input is not None:
                in_flight.append((len(step_input.contents), deferred.step(*step_input)))
                if len(in_flight) < depth:
                    continue
            if not in_flight:
                break
            items, future = in_flight.popleft()
            future.result()
            now = time.perf_counter()
            rates.append(items / 2 / (now - finished))
            finished = now
    finally:
        trainer.close()
    return rates


def loader_seconds(run: Any, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds per step of the loader alone, reading the shards."""
    from uform.sources import Loader, open_source

    loader = Loader(open_source(list(run.data.train), fields=dict(run.data.fields)), run.trainer, devices=1)
    loader.next_step()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loader.next_step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def fit_rates(config: pathlib.Path, output: pathlib.Path, executor: Any, profile: bool = False) -> list[float]:
    import uform as u
    from uform.run_dir import read_metrics

    if profile:  # the main thread's own time: reading, submitting, waiting
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(u.fit, str(config), output, devices=executor, log=None)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    else:
        u.fit(str(config), output, devices=executor, log=None)
    return [r["items_per_second"] / 2 for r in read_metrics(output / "metrics.jsonl") if r["kind"] == "step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_geometry(parser)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--records", type=int, default=8192)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile the fit call's main thread")
    parser.add_argument("--skip-library", action="store_true")
    args = parser.parse_args()

    import torch

    import uform as u
    from uform.run_config import read_run_config

    folder = pathlib.Path(tempfile.mkdtemp(prefix="uform-shards-"))
    started = time.perf_counter()
    size = write_shards(folder, args.records, args.shards)
    print(
        f"{args.records} records in {args.shards} shards, {size / 2**20:.1f} MiB, {time.perf_counter() - started:.1f} s"
    )
    config = folder / "run.toml"
    geometry = {k: getattr(args, k) for k in ("depth", "hidden", "rows", "columns", "segments")}
    config.write_text(RUN_FILE.format(**geometry, steps=args.steps, first="000", last=f"{args.shards - 1:03d}"))
    run = read_run_config(config)
    executor = u.Executor.cpu() if args.cpu or not torch.cuda.is_available() else u.Executor.for_vram([0])
    try:
        wall, cpu = loader_seconds(run, 10)
        print(f"loader alone: {wall * 1e3:.1f} ms/step wall, {cpu * 1e3:.1f} ms/step CPU")
        library = [float("nan")] * args.steps if args.skip_library else library_rates(run, executor, args)
        fitted = fit_rates(config, folder / "run", executor, args.profile)
    finally:
        executor.close()
    timed = slice(args.warmup, None)
    result = {
        "geometry": geometry,
        "records": args.records,
        "shards": args.shards,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.cpu else "cpu",
        "cpus": os.cpu_count(),
        "library_pairs_per_second": statistics.median(library[timed]),
        "fit_pairs_per_second": statistics.median(fitted[timed]),
        "loader_ms_per_step": wall * 1e3,
        "loader_cpu_ms_per_step": cpu * 1e3,
    }
    result["ratio"] = result["fit_pairs_per_second"] / result["library_pairs_per_second"]
    print(f"library (deferred, as fit keeps them): {result['library_pairs_per_second']:,.0f} pairs/s")
    print(f"uform.fit from the shards:         {result['fit_pairs_per_second']:,.0f} pairs/s")
    print(f"ratio: {result['ratio']:.3f}")
    print(write_json("bench-train-shards.json", result))


if __name__ == "__main__":
    main()
