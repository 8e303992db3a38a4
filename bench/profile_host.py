"""Where the host stage of a step goes, function by function: `Replica.prepare` of the reference geometry's JPEG
Joint step (128 JPEGs 256 x 256 + 128 texts of 200 B; docs/design.md §1), in process, under cProfile.

Prints: one image's decode alone (`media.image_units`, no pool), the pool's decode of a step's images
(`Replica.decode`), the whole prepare stage, the prepare stage with decoding excluded (`data.batch.prepare` of the
step's units decoded once: its media arrays in fresh memory, as in process, and in memory reused every step, as a
preparer process builds them in its slab), then cProfile's top functions by own time and by cumulative time
over `--steps` prepare calls. No device is used (the CPU executor's prepare is the CUDA one's but for the block
tables, counted apart with `--flex`).

  python bench/profile_host.py [--steps 8 --workers 0 --images 128 --texts 128]

`--timeline` instead times one step at a time through `--host-processes` preparer processes (on `--executor`, so on
CUDA with the page-locked copy and the block tables) and prints, per process and function, the medians over the
steps of its calls, their summed time and when the first began and the last ended, in ms from the step's call
(`bench/host_trace.py`: the trainer's process, its preparer and every decoder append their calls' times to files):

  python bench/profile_host.py --timeline [--executor cuda --host-processes 2 --steps 10]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pathlib
import pstats
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import add_geometry, bench_config, topic_text  # sibling scripts, not a package
from decode import jpegs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_geometry(parser)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workers", type=int, default=0, help="decoder processes (0: one per core)")
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--timeline", action="store_true", help="time each stage of a step across the processes")
    parser.add_argument("--executor", choices=("cpu", "cuda"), default="cpu", help="with --timeline")
    parser.add_argument("--host-processes", type=int, default=1, help="preparer processes, with --timeline")
    args = parser.parse_args()
    if args.timeline:
        timeline(args)
        return

    import uform as u
    from uform.data.batch import prepare as pack
    from uform.media import image_units
    from uform.media.decode import MediaPolicy

    images = jpegs(256)
    started = time.perf_counter()
    for i in range(100):
        image_units(images[i % len(images)], patch_side=16, channels=4, max_units=1023)
    one = (time.perf_counter() - started) / 100

    config = bench_config(args, batch={"image": u.ImageShape(patch_side=16, channels=4)})
    executor = u.Executor.cpu()
    trainer = u.Trainer.init_vram(executor, config, media=MediaPolicy(workers=args.workers), host_processes=0)
    modalities, contents, relations = step_of(u, images, args)
    replica = trainer.replica
    checked = replica.check_step(modalities, contents, u.TrainerStepConfig(relations=relations), copy_buffers=False)
    try:
        replica.prepare(checked, 1)  # the pool starts
        decode = []
        for _ in range(args.steps):
            started = time.perf_counter()
            replica.decode(checked)
            decode.append(time.perf_counter() - started)
        prepare = []
        profiler = cProfile.Profile()
        for step in range(2, args.steps + 2):
            started = time.perf_counter()
            profiler.enable()
            replica.prepare(checked, step)
            profiler.disable()
            prepare.append(time.perf_counter() - started)
        workers = replica.stage.decode_workers
        units, _ = replica.decode(checked)
        units = {i: dataclasses.replace(x, values=np.array(x.values)) for i, x in units.items()}  # off the slabs
    finally:
        trainer.close()
    reused: dict[tuple, np.ndarray] = {}

    def same_memory(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        return reused.setdefault((shape, np.dtype(dtype).str), np.empty(shape, dtype))

    alone = {}
    for name, alloc in (("fresh", np.empty), ("reused", same_memory)):
        took = []
        for step in range(args.steps + 2):
            started = time.perf_counter()
            pack(
                replica.config,  # the trainer's, its zeros derived (the bench's leaves text masking off)
                checked.modalities,
                checked.contents,
                bags=checked.bags,
                groups=checked.groups,
                sides=checked.sides,
                relations=checked.relations,
                step=step,
                units=units,
                choices=checked.choices,
                alloc=alloc,
            )
            took.append(time.perf_counter() - started)
        alone[name] = np.median(took[2:]) * 1e3
    print(
        f"one image alone {one * 1e3:.2f} ms ({args.images} of them: {one * args.images * 1e3:.0f} ms of one core); "
        f"the pool's decode of a step {np.median(decode) * 1e3:.1f} ms over {workers} decoders (ideal "
        f"{one * args.images / workers * 1e3:.1f}); prepare {np.median(prepare) * 1e3:.1f} ms/step (profiled); "
        f"decoding excluded {alone['fresh']:.1f} ms/step with fresh media arrays, {alone['reused']:.1f} in reused memory"
    )
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


def step_of(u: Any, images: list[bytes], args: argparse.Namespace) -> tuple[list[Any], list[bytes], Any]:
    """The bench step: `args.images` JPEGs then `args.texts` captions of 200 B, image i paired with caption i."""
    text = topic_text()
    n = min(args.images, args.texts)
    modalities = [u.Modality.Image] * args.images + [u.Modality.Text] * args.texts
    contents = [images[i % len(images)] for i in range(args.images)]
    contents += [text[i * 200 : (i + 1) * 200] for i in range(args.texts)]
    ids = [[args.images + i] if i < n else [] for i in range(args.images)]
    ids += [[i] if i < n else [] for i in range(args.texts)]
    offsets = np.cumsum([0] + [len(x) for x in ids]).tolist()
    return modalities, contents, u.Relations(attract=u.Edges(offsets=offsets, ids=[j for x in ids for j in x]))


def timeline(args: argparse.Namespace) -> None:
    """`--timeline`: see the module's docstring."""
    import host_trace

    import uform as u
    from uform.media.decode import MediaPolicy

    folder = tempfile.mkdtemp(prefix="uform-host-trace-")
    host_trace.trace_preparers(folder)
    executor = u.Executor.for_vram([0]) if args.executor == "cuda" else u.Executor.cpu()
    config = bench_config(args, batch={"image": u.ImageShape(patch_side=16, channels=4)})
    media = MediaPolicy(workers=args.workers)
    trainer = u.Trainer.init_vram(executor, config, media=media, host_processes=args.host_processes)
    modalities, contents, relations = step_of(u, jpegs(256), args)
    replica = trainer.replica
    checked = replica.check_step(modalities, contents, u.TrainerStepConfig(relations=relations), copy_buffers=False)
    try:
        for step in range(3):  # the processes start, their slabs' pages are reached
            replica.prepare(checked, step)
        warm = len(host_trace.timeline(folder))
        for step in range(3, 3 + args.steps):
            replica.prepare(checked, step)
        roles = {os.getpid(): "trainer"} | {p.pid: "preparer" for p in replica.stage.preparers.processes}
    finally:
        trainer.close()
    rows = host_trace.summary(host_trace.timeline(folder)[warm:], roles)
    print(
        f"one step at a time, {args.steps} steps, {args.host_processes} preparer processes, {args.executor}; ms from the call"
    )
    print(f"  {'process':<9} {'thread':<22} {'function':<26} {'calls':>6} {'sum ms':>8} {'first':>8} {'last':>8}")
    for row in rows:
        print(
            f"  {row['role']:<9} {row['thread'][:22]:<22} {row['name'][:26]:<26} {row['calls']:6.0f} {row['sum_ms']:8.2f} "
            f"{row['first_ms']:8.2f} {row['last_ms']:8.2f}"
        )


if __name__ == "__main__":
    main()
