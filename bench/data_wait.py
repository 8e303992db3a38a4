"""The share of a training step spent waiting for data, with 256 x 256 JPEGs beside text.

A trainer at the reference geometry of docs/design.md §1 (default depth 12 x hidden 512, 64 rows x 1024 columns, 256 segments,
image patch 16, RGBA) takes `--steps` Joint steps of `--images` JPEGs (cut from scikit-image's photographs,
each a different crop so no two items are the same bytes) beside `--texts` captions, submitted through
`Trainer.deferred` with as many steps in flight as `uform.fit` keeps (two, or one more than the preparer processes, so
each has a step while the device runs one; `--in-flight` to choose), the way a data loader drives it. Two runs:

  pipeline   the real thing: every step decodes its JPEGs in the worker pool, packs, corrupts and pins on
             the host thread while the device runs the step before.
  fed        the same steps with the prepare stage's answer computed once ahead and handed over at once, so
             the device never waits: the step time of a data loader that is infinitely fast.

The data wait is the difference: wait share = 1 - fed / pipeline (per step, medians over the timed
steps). The prepare stage's time alone (`Replica.prepare`, decode included) is printed beside it.

Interpreter-lock pressure, measured on any executor (the CPU proxy of the data wait, since the wait itself
needs a GPU that runs the device stage without the interpreter):

  main CPU   CPU seconds per step this process spends outside its device thread (every thread's CPU time,
             `CLOCK_PROCESS_CPUTIME_ID`, less the device thread's and the probe's own, read through
             `time.pthread_getcpuclockid`); children (the decoders, a preparer process) are not counted. On the
             CPU executor run it with `--threads 1`, so the device stage's kernels run on the device thread.
  probe      a thread that sleeps 1e-4 s in a loop and records how late it wakes: beyond the timer's own
             slack (the `idle` row), that is how long a thread waits to take the interpreter back, so how long
             the device thread would wait to launch its next kernel. p50 / p99 in microseconds.

  host       the prepare stage alone: `Replica.prepare` of `--host-steps` steps, `--in-flight` at a time (as
             many as `uform.fit` keeps unfinished, all of them in the prepare stage when it is the one that holds the
             run up), nothing else running: the stage's own period and the cleanest reading of its pressure.
             Read with the probe running; the JSON also holds a reading without it (`without_probe`), which
             on a small virtual machine bills more CPU to every thread's wake-up from an idle core.

`--host-only` skips the two trained runs (the prepare stage at the reference geometry needs no device).

Video and audio steps (issue 12): `--clips N` adds N MP4 clips (`--clip-size` WxH, `--clip-frames` frames, panning
over the photographs as bench/decode.py makes them; H.264 where PyAV's wheel has it; tubes of 2 x 16², RGB) and
`--recordings N` adds N recordings of pygame's sample sound (`--audio` mp3, flac or wav; 16 kHz frames of 320), each
paired with one of the texts as the JPEGs are. The reference video and audio steps:

  python bench/data_wait.py --images 0 --clips 64 --texts 64 --text-bytes 200
  python bench/data_wait.py --images 0 --recordings 128 --audio mp3 --texts 128 --text-bytes 100
  python bench/data_wait.py --images 0 --recordings 128 --audio flac --texts 128 --text-bytes 100

Prints a table and writes bench-data-wait.json under $OUT (or the current folder). Usage:
  python bench/data_wait.py [--executor cuda] [--images 128 --texts 128 --steps 20 --warmup 5 --workers 0]
  python bench/data_wait.py --executor cpu --threads 1 --host-only --host-steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from common import (  # sibling scripts, not a package
    Fed,
    add_geometry,
    bench_config,
    in_flight,
    stat_cpu_seconds,
    topic_text,
    write_json,
)
from decode import PHOTOS, photo


def crops(count: int, side: int = 256) -> list[bytes]:
    """`count` distinct side x side JPEGs: sliding square crops of the sample photographs."""
    from PIL import Image

    out = []
    for i in range(count):
        image = photo(PHOTOS[i % len(PHOTOS)])
        short = min(image.size)
        window = short * 3 // 4
        offset = (i // len(PHOTOS)) * 7 % max(1, short - window)
        box = (offset, offset, offset + window, offset + window)
        buffer = io.BytesIO()
        image.crop(box).resize((side, side), Image.Resampling.BILINEAR).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def clips(args: argparse.Namespace) -> list[bytes]:
    """`args.clips` MP4s cycling over as many distinct pans as there are photographs."""
    from decode import clip

    width, height = (int(v) for v in args.clip_size.split("x"))
    made = [clip(name, (width, height), args.clip_frames)[0] for name in PHOTOS[: min(len(PHOTOS), args.clips)]]
    return [made[i % len(made)] for i in range(args.clips)]


def recordings(args: argparse.Namespace) -> list[bytes]:
    """`args.recordings` copies of pygame's sample sound as `args.audio` (FLAC encoded here from the WAV)."""
    from decode import recordings as samples

    found = dict(samples())
    if args.audio == "flac":
        import soundfile

        samples_, rate = soundfile.read(io.BytesIO(found["wav"]), dtype="int16")
        buffer = io.BytesIO()
        soundfile.write(buffer, samples_, rate, format="FLAC")
        data = buffer.getvalue()
    else:
        data = found[args.audio]
    return [data] * args.recordings


def step_items(args: argparse.Namespace) -> tuple[list[Any], list[bytes], Any]:
    import uform as u

    text = topic_text()
    media = (
        [(u.Modality.Image, c) for c in crops(args.images)]
        + [(u.Modality.Video, c) for c in (clips(args) if args.clips else [])]
        + [(u.Modality.Audio, c) for c in (recordings(args) if args.recordings else [])]
    )
    count = len(media)
    modalities = [m for m, _ in media] + [u.Modality.Text] * args.texts
    contents = [c for _, c in media] + [
        text[i * args.text_bytes : (i + 1) * args.text_bytes] for i in range(args.texts)
    ]
    pairs = min(count, args.texts)
    ids = [[count + i] if i < pairs else [] for i in range(count)]
    ids += [[i] if i < pairs else [] for i in range(args.texts)]
    offsets = np.cumsum([0] + [len(x) for x in ids]).tolist()
    relations = u.Relations(attract=u.Edges(offsets=offsets, ids=[j for x in ids for j in x]))
    return modalities, contents, relations


class Probe:
    """A thread that sleeps `period` seconds in a loop and records how late each wake-up is (seconds)."""

    def __init__(self, period: float = 1e-4) -> None:
        self.period = period
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)
        self.cpu = 0.0

    def _run(self) -> None:
        clock = time.pthread_getcpuclockid(threading.get_ident())
        first = time.clock_gettime(clock)
        period, late = self.period, self.late
        while not self._stop.is_set():
            started = time.perf_counter()
            time.sleep(period)
            late.append(time.perf_counter() - started - period)
        self.cpu = time.clock_gettime(clock) - first

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        late = np.asarray(self.late) * 1e6
        return {
            "wakeups": len(late),
            "p50_us": float(np.percentile(late, 50)),
            "p99_us": float(np.percentile(late, 99)),
            "p999_us": float(np.percentile(late, 99.9)),
            "max_us": float(late.max()),
        }


def thread_cpu(name_prefix: str) -> float:
    """CPU seconds of this process's live threads whose name starts with `name_prefix`."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith(name_prefix) and thread.ident is not None:
            with contextlib.suppress(OSError):  # it ended meanwhile
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


def process_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread's, dead ones too) of the processes `pids`, from /proc (0 where
    there is none): what a preparer process spends of its own, its decoders (processes of their own) apart."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += stat_cpu_seconds(f"/proc/{pid}/stat")
    return total


def preparer_pids(trainer: Any) -> list[int]:
    """The trainer's preparer processes' pids (none when it prepares in process)."""
    preparers = getattr(trainer.replica.stage, "preparers", None)
    return [] if preparers is None else [p.pid for p in preparers.processes]


class Pressure:
    """The interpreter-lock pressure of a stretch of work: this process's CPU time outside the device thread
    (and the probe) per step, and the probe's lateness; and the CPU time of processes `pids` (the preparers)."""

    def __init__(self, steps: int, probe: bool = True, pids: list[int] | None = None) -> None:
        self.steps = steps
        self.probe = Probe() if probe else None
        self.pids = pids or []

    def __enter__(self) -> Pressure:
        self.preparers = process_cpu(self.pids)
        self.cpu = time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)
        self.device = thread_cpu("uform-device")
        self.wall = time.perf_counter()
        if self.probe is not None:
            self.probe.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.probe is not None:
            self.probe.__exit__()
        self.wall = time.perf_counter() - self.wall
        device = thread_cpu("uform-device") - self.device
        total = time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID) - self.cpu
        probe_cpu = 0.0 if self.probe is None else self.probe.cpu
        self.result = {
            "ms_per_step": self.wall / self.steps * 1e3,
            "main_cpu_ms_per_step": (total - device - probe_cpu) / self.steps * 1e3,
            "device_cpu_ms_per_step": device / self.steps * 1e3,
            "preparer_cpu_ms_per_step": (process_cpu(self.pids) - self.preparers) / self.steps * 1e3,
        }
        if self.probe is not None:
            self.result["probe"] = self.probe.summary()


def timed_steps(trainer: Any, modalities: list[Any], contents: list[bytes], relations: Any, args: argparse.Namespace):
    """Seconds per step over the timed steps (`args.in_flight` in flight), after `args.warmup` untimed ones; the stats of
    the last step and the pressure of the timed ones."""
    import uform as u

    verbs = trainer.deferred(trainer.executor)
    stats = u.TrainerStepStats()

    def step(_: int) -> Future:
        return verbs.step(modalities, contents, u.TrainerStepConfig(relations=relations, stats=stats))

    def run(count: int) -> float:
        started = time.perf_counter()
        in_flight(step, range(count), args.in_flight - 1)
        return (time.perf_counter() - started) / count

    run(args.warmup)
    with Pressure(args.steps, pids=preparer_pids(trainer)) as pressure:
        seconds = run(args.steps)
    return seconds, stats, pressure.result


def prepare_step(trainer: Any, checked: Any, args: argparse.Namespace) -> dict[str, Any]:
    """`Replica.prepare` of `args.host_steps` numbered steps, `args.in_flight` at a time, after six untimed ones. Each
    answer is dropped at once, as the trainer drops a step's host tensors after its copy (page-locked blocks go back
    to the allocator's cache instead of a fresh allocation for every step held)."""

    def prepare(step: int) -> None:
        trainer.replica.prepare(checked, step)

    with ThreadPoolExecutor(args.in_flight, thread_name_prefix="bench-host") as pool:
        list(pool.map(prepare, range(20_000, 20_006)))
        first = 20_006
        pids = preparer_pids(trainer)
        with Pressure(args.host_steps, probe=False, pids=pids) as quiet:
            list(pool.map(prepare, range(first, first + args.host_steps)))
        first += args.host_steps
        with Pressure(args.host_steps, pids=pids) as probed:
            list(pool.map(prepare, range(first, first + args.host_steps)))
    return {**probed.result, "without_probe": quiet.result}


def idle_probe() -> dict[str, float]:
    """The probe's lateness with nothing else running: the timer's own slack."""
    with Probe() as probe:
        time.sleep(0.5)
    return probe.summary()


def describe(name: str, row: dict[str, Any]) -> str:
    probe = row["probe"]
    return (
        f"  {name:<9} {row['ms_per_step']:6.1f} ms/step  main CPU outside the device thread "
        f"{row['main_cpu_ms_per_step']:5.1f} ms/step  preparers' CPU {row['preparer_cpu_ms_per_step']:5.1f} ms/step  probe late p50 {probe['p50_us']:5.0f} us, p99 "
        f"{probe['p99_us']:5.0f} us, p99.9 {probe['p999_us']:5.0f} us"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executor", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--workers", type=int, default=0, help="decoder processes; 0: one per core")
    add_geometry(parser)
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--clips", type=int, default=0, help="MP4 clips a step")
    parser.add_argument("--clip-size", default="128x96")
    parser.add_argument("--clip-frames", type=int, default=24)
    parser.add_argument("--recordings", type=int, default=0, help="recordings a step")
    parser.add_argument("--audio", choices=("mp3", "flac", "wav"), default="mp3")
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--text-bytes", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--switch-interval", type=float, default=0.0, help="sys.setswitchinterval seconds (0: Python's 5 ms)"
    )
    parser.add_argument(
        "--host-processes", type=int, default=None, help="Trainer.init_vram(host_processes=); default: the trainer's"
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="deferred steps submitted and not yet answered (0: as uform.fit keeps them, max(2, host processes + 1))",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    parser.add_argument("--host-steps", type=int, default=20, help="steps of the prepare stage measured alone")
    parser.add_argument("--host-only", action="store_true", help="measure the prepare stage alone, no training")
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    import uform as u
    from uform.media.decode import MediaPolicy

    executor = u.Executor.for_vram([0]) if args.executor == "cuda" else u.Executor.cpu()
    shapes: dict[str, Any] = {"image": u.ImageShape(patch_side=16, channels=4)}
    if args.clips:
        shapes["video"] = u.VideoShape(patch_side=16, tube_frames=2, channels=3)
    if args.recordings:
        shapes["audio"] = u.AudioShape(chunk_samples=320)
    config = bench_config(args, batch=shapes)
    modalities, contents, relations = step_items(args)
    media = MediaPolicy(workers=args.workers)
    trainer = u.Trainer.init_vram(executor, config, media=media, host_processes=args.host_processes)
    if not args.in_flight:  # as uform.fit drives it: every preparer process busy while the device runs a step
        from uform.fitting import steps_in_flight

        args.in_flight = steps_in_flight(trainer)
    pressure: dict[str, Any] = {"idle": idle_probe()}
    try:
        replica = trainer.replica  # one device's pipeline, in this process
        checked = replica.check_step(modalities, contents, u.TrainerStepConfig(relations=relations), False)
        pressure["host"] = prepare_step(trainer, checked, args)
        if not args.host_only:
            pipeline, stats, pressure["pipeline"] = timed_steps(trainer, modalities, contents, relations, args)
        prepare = []
        for step in range(3):
            started = time.perf_counter()
            prepared = replica.prepare(checked, 10_000 + step)
            prepare.append(time.perf_counter() - started)
        if not args.host_only:
            real_stage = replica.stage
            replica.stage = Fed(*prepared)  # the device stage fed instantly: every step the same prepared one
            fed, _, pressure["fed"] = timed_steps(trainer, modalities, contents, relations, args)
            replica.stage = real_stage
        workers = replica.stage.decode_workers or args.workers
    finally:
        trainer.close()
    batch = prepared[0]
    tokens = int((batch.segments < args.segments).sum())
    result = {
        "device": torch.cuda.get_device_name(0) if args.executor == "cuda" else "cpu",
        "cores": len(os.sched_getaffinity(0)),
        "decode_workers": workers,
        "torch_threads": torch.get_num_threads(),
        "host_processes": trainer.host_processes,
        "in_flight": args.in_flight,
        "geometry": {"depth": args.depth, "hidden": args.hidden, "rows": args.rows, "columns": args.columns},
        "items": {
            "images": args.images,
            "clips": args.clips,
            "recordings": args.recordings,
            "audio": args.audio if args.recordings else None,
            "texts": args.texts,
            "text_bytes": args.text_bytes,
        },
        "placed": int(batch.layout.placed.sum()),
        "dropped": batch.dropped,
        "tokens_per_step": tokens,
        "prepare_ms": float(np.median(prepare) * 1e3),
        "switch_interval_s": sys.getswitchinterval(),
        "pressure": pressure,
    }
    print(
        f"{args.images} JPEGs 256x256 + {args.clips} MP4 clips + {args.recordings} {args.audio} recordings + "
        f"{args.texts} texts of {args.text_bytes} B, {result['placed']} placed, "
        f"{result['dropped']} dropped, {tokens} tokens/step, {workers} decoders on {result['cores']} cores, "
        f"{trainer.host_processes} preparer processes, {args.in_flight} steps in flight, {result['device']}:"
    )
    if not args.host_only:
        result.update(
            pipeline_ms=pipeline * 1e3,
            fed_ms=fed * 1e3,
            wait_share=max(0.0, 1 - fed / pipeline),
            loss=stats.loss,
            masked_image_loss=stats.masked_image_loss,
        )
        print(
            f"  pipeline {result['pipeline_ms']:.1f} ms/step, fed {result['fed_ms']:.1f} ms/step -> data wait "
            f"{100 * result['wait_share']:.1f}% of the step; prepare stage alone {result['prepare_ms']:.1f} ms/step; "
            f"loss {stats.loss:.3f} (image {stats.masked_image_loss:.3f})"
        )
    idle = pressure["idle"]
    print(f"  interpreter-lock pressure (probe idle: p50 {idle['p50_us']:.0f} us, p99 {idle['p99_us']:.0f} us):")
    for name in ("host", "pipeline", "fed"):
        if name in pressure:
            print(describe(name, pressure[name]))
    path = write_json("bench-data-wait.json", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
