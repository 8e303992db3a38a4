"""The processes of the multi-process tests (test_world.py): each runs as one process of a world.

    python tests/world_cases.py SCENARIO REPORTS [--directory D --job J --host H --hosts N] [--torchrun]

Every process writes what it saw under REPORTS: `<name>.json` (stats, descriptions, errors and times) and
`<name>.npz` (weights and optimizer moments), which the test compares with a run of one process.

    python tests/world_cases.py forks SPEC

runs several such processes, each forked from this one once it has imported torch and uform (`forks`).

The global batch: BAGS bags of four captions, two pairs each (attract a1 <-> b1 and a2 <-> b2 at weights
1 and 2, repel a1 <-> b2 and a2 <-> b1 at 0.5); process r of W takes a contiguous share of the bags, so
every edge stays inside one process and the world's step is the one-process step split by bag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

torch.set_num_threads(1)

import uform  # noqa: E402
from uform import (  # noqa: E402
    BatchShape,
    Contrastive,
    Edges,
    Executor,
    Negatives,
    Objective,
    PairLossForm,
    Relations,
    Schedule,
    Trainer,
    TrainerInitVramConfig,
    TrainerStepConfig,
    TrainerStepStats,
)
from uform.media.decode import MediaPolicy  # noqa: E402

BAGS = 4
WORDS = ["cat", "bus", "rain", "tree", "boat", "lamp", "bird", "road", "moon", "desk", "fish", "hill"]

CASES: list[tuple[str, Objective, PairLossForm, Negatives]] = [
    (f"{form.name.lower()}-{negatives.name.lower()}", Objective.Contrastive, form, negatives)
    for form in (PairLossForm.Sigmoid, PairLossForm.Balanced, PairLossForm.Ranked)
    for negatives in (Negatives.Ambient, Negatives.Named)
] + [("joint-sigmoid-ambient", Objective.Joint, PairLossForm.Sigmoid, Negatives.Ambient)]
"""Every pair-loss form under both negatives (the contrastive objective), and a joint run whose text
corruption must not depend on the split either."""

GPU_CASES = ("sigmoid-ambient", "ranked-named", "joint-sigmoid-ambient")
"""The cases the NCCL test runs (each compiles its step on the GPU, which takes a while)."""

GPU_TOLERANCE = 2e-2
"""On GPUs the step runs under bf16 autocast, whose noise moves with where an item is packed: relative."""


def config(
    objective: Objective, form: PairLossForm, negatives: Negatives, bags: int = BAGS, **overrides: Any
) -> TrainerInitVramConfig:
    """The run every process of a world builds (and one process alone, for the reference): room for the global
    batch of `bags` bags on one device."""
    room = -(-bags // BAGS)
    fields: dict[str, Any] = dict(
        depth=1,
        hidden=128,
        objective=objective,
        batch=BatchShape(max_rows_per_device=6 * room, max_segments_per_device=16 * room, max_columns_per_row=64),
        contrastive=Contrastive(
            pair_loss=form,
            negatives=negatives,
            temperature_groups=2,
            matryoshka_dimensions=(64, 128),
            ambient_repulsion_weight=0.7,
        ),
        schedule=Schedule(steps=10, warmup_steps=2, learning_rate=1e-3),
        seed=11,
    )
    fields.update(overrides)
    return TrainerInitVramConfig(**fields)


def bag_items(bag: int, step: int) -> list[str]:
    """Bag `bag`'s four captions at `step`: a1, b1, a2, b2 (a pair shares its word)."""
    out = []
    for pair in range(2):
        word = WORDS[(4 * bag + 2 * pair + step) % len(WORDS)]
        out.append(f"a {word} seen at noon {bag}{pair}")
    for pair in range(2):
        word = WORDS[(4 * bag + 2 * pair + step) % len(WORDS)]
        out.append(f"the {word}, photo {step}")
    # Reorder to a1, b1, a2, b2.
    return [out[0], out[2], out[1], out[3]]


def share(rank: int, size: int, bags: int = BAGS) -> list[int]:
    """The bags process `rank` of `size` takes: a contiguous share, as even as can be."""
    return [int(b) for b in np.array_split(np.arange(bags), size)[rank]]


def step_inputs(bags: list[int], step: int) -> tuple[list[str], TrainerStepConfig]:
    """The items of `bags` with their relations, groups and bag ids, as one process's step."""
    texts: list[str] = []
    attract: list[list[tuple[int, float]]] = []
    repel: list[list[tuple[int, float]]] = []
    for bag in bags:
        base = len(texts)
        texts += bag_items(bag, step)
        a1, b1, a2, b2 = range(base, base + 4)
        attract += [[(b1, 1.0)], [(a1, 1.0)], [(b2, 2.0)], [(a2, 2.0)]]
        repel += [[(b2, 0.5)], [(a2, 0.5)], [(b1, 0.5)], [(a1, 0.5)]]

    def edges(runs: list[list[tuple[int, float]]]) -> Edges:
        offsets, ids, weights = [0], [], []
        for run in runs:
            for j, weight in sorted(run):
                ids.append(j)
                weights.append(weight)
            offsets.append(len(ids))
        return Edges(offsets=offsets, ids=ids, weights=weights)

    relations = Relations(attract=edges(attract), repel=edges(repel))
    groups = [i % 2 for i in range(len(texts))]
    bag_ids = [bag for bag in bags for _ in range(4)]
    return texts, TrainerStepConfig(relations=relations, temperature_groups=groups, bags=bag_ids)


def snapshot(trainer: Trainer) -> dict[str, np.ndarray]:
    out = {f"weights.{k}": v.detach().float().cpu().numpy().copy() for k, v in trainer.network.state_dict().items()}
    for name, p in trainer.network.named_parameters():
        for key, value in trainer.optimizer.state.get(p, {}).items():
            out[f"moments.{key}.{name}"] = torch.as_tensor(value).detach().float().cpu().numpy().copy()
    return out


def run_steps(trainer: Trainer, bags: list[int], steps: list[int]) -> list[dict[str, Any]]:
    out = []
    for step in steps:
        texts, step_config = step_inputs(bags, step)
        stats = TrainerStepStats()
        step_config.stats = stats
        trainer.on(trainer.executor).step(["text"] * len(texts), texts, step_config)
        out.append({k: getattr(stats, k) for k in ("step", "loss", "contrastive_loss", "masked_text_loss")})
    return out


# --------------------------------------------------------------------------------------------------
# Scenarios


def mesh_of(args: argparse.Namespace, executor: Executor | None = None) -> uform.Mesh:
    if args.torchrun:  # process 0 asks for the environment's mesh, the others bootstrap without a directory
        if os.environ["RANK"] == "0":
            return uform.Mesh.from_env()
        local = int(os.environ["LOCAL_RANK"])
        return uform.Mesh.bootstrap(Executor.for_vram([local]) if args.cuda else Executor.cpu(), uform.MeshOptions())
    options = uform.MeshOptions(
        host_domain_index=args.host,
        host_domain_count=args.hosts,
        directory=args.directory,
        job=args.job,
        timeout_seconds=args.timeout,
        store=args.store,
    )
    return uform.Mesh.bootstrap(executor or Executor.cpu(), options)


def cases(args: argparse.Namespace) -> list[tuple[str, Objective, PairLossForm, Negatives]]:
    return [c for c in CASES if c[0] in GPU_CASES] if args.cuda else CASES


def invariance(args: argparse.Namespace, reports: Path) -> None:
    """Every case: two steps of this process's share; then a save that only process zero writes."""
    import uform.runtime.world

    uform.runtime.world.BUCKET_BYTES = 64 << 10  # several buckets even for the tiny tower
    mesh = mesh_of(args, Executor.for_vram([args.host]) if args.cuda and not args.torchrun else None)
    description = mesh.describe()
    rank, size = description.ranks[0], description.world_size
    report: dict[str, Any] = {"description": _describe(description), "cases": {}}
    arrays: dict[str, np.ndarray] = {}
    bags = share(rank, size, args.bags)
    for name, objective, form, negatives in cases(args):
        trainer = Trainer.init_vram(mesh.executor, config(objective, form, negatives, args.bags, mesh=mesh))
        first = run_steps(trainer, bags, [1])
        arrays.update({f"{name}/{k}": v for k, v in snapshot(trainer).items()})  # step 1's gradients and update
        report["cases"][name] = first + run_steps(trainer, bags, [2])
        if name == cases(args)[-1][0]:
            trainer.save(reports / f"saved-{size}-{rank}.safetensors")
        trainer.close()
    mesh.close()
    _write(reports, f"invariance-{size}-{rank}", report, arrays)


def attempt(report: dict[str, Any], key: str, call: Any, seconds: str | None = None) -> None:
    """Runs `call`; notes in `report[key]` its error as "Type: message" (None if it raised none) and, when
    `seconds` names a key, how long it took there."""
    start = time.monotonic()
    try:
        call()
        report[key] = None
    except Exception as error:
        report[key] = f"{type(error).__name__}: {error}"
    if seconds is not None:
        report[seconds] = time.monotonic() - start


def survive_a_dead_peer(
    trainer: Trainer, bags: list[int], rank: int, reports: Path, name: str, report: dict[str, Any]
) -> None:
    """Steps 1 and 2 and a save to `<name>.safetensors`; then process 1 dies, as a killed process, and every
    other tries step 3 (`error`, `seconds`) and once more (`again`, `again_seconds`)."""
    report["stats"] = run_steps(trainer, bags, [1, 2])
    trainer.save(reports / f"{name}.safetensors")
    _write(reports, f"{name}-{rank}", report, {})
    if rank == 1:
        os._exit(9)
    attempt(report, "error", lambda: run_steps(trainer, bags, [3]), "seconds")
    attempt(report, "again", lambda: run_steps(trainer, bags, [3]), "again_seconds")


def fault(args: argparse.Namespace, reports: Path) -> None:
    """A world of four: a process that builds another run is refused on every process; then two steps, a
    save, and process 1 dies before step 3, which the others must report clearly within the deadline."""
    mesh = mesh_of(args)
    rank = mesh.describe().ranks[0]
    report: dict[str, Any] = {}
    start = time.monotonic()
    try:  # process 2 resumes a checkpoint that is not there: its init_vram raises, the others' must too
        missing = str(reports / "missing.safetensors") if rank == 2 else None
        Trainer.init_vram(
            mesh.executor,
            config(Objective.Contrastive, PairLossForm.Sigmoid, Negatives.Ambient, mesh=mesh, resume=missing),
        )
        report["failed_init"] = None
    except Exception as error:
        report["failed_init"] = f"{type(error).__name__}: {error}"
    report["failed_init_seconds"] = time.monotonic() - start
    seed = 12 if rank == 2 else 11
    try:
        Trainer.init_vram(
            mesh.executor, config(Objective.Contrastive, PairLossForm.Sigmoid, Negatives.Ambient, mesh=mesh, seed=seed)
        )
        report["mismatch"] = None
    except ValueError as error:
        report["mismatch"] = str(error)
    trainer = Trainer.init_vram(
        mesh.executor, config(Objective.Contrastive, PairLossForm.Sigmoid, Negatives.Ambient, mesh=mesh)
    )
    survive_a_dead_peer(trainer, share(rank, mesh.describe().world_size), rank, reports, "fault", report)
    _write(reports, f"fault-{rank}", report, {})
    os._exit(0)  # the world is broken: leave without the collective teardown


def kill(args: argparse.Namespace, reports: Path) -> None:
    """A world of `--hosts` processes (NCCL with --cuda, a GPU each): two steps and a save, then process 1 dies
    before step 3, which every other process must report as a MeshError within the deadline; every later step
    refuses at once, the aborted world saves nothing, each survivor outlives torch's own handling of the timeout
    (--linger seconds) and its trainer and mesh close."""
    mesh = mesh_of(args, Executor.for_vram([args.host]) if args.cuda else None)
    description = mesh.describe()
    rank, size = description.ranks[0], description.world_size
    report: dict[str, Any] = {
        "description": _describe(description),
        "error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    }
    trainer = Trainer.init_vram(
        mesh.executor, config(Objective.Contrastive, PairLossForm.Sigmoid, Negatives.Ambient, args.bags, mesh=mesh)
    )
    survive_a_dead_peer(trainer, share(rank, size, args.bags), rank, reports, "kill", report)
    attempt(report, "save", lambda: trainer.save(reports / "after.safetensors"))
    _write(reports, f"kill-{rank}", report, {})
    time.sleep(args.linger)  # torch's watchdog handles the timed-out collective meanwhile; it must not end us
    report["lingered"] = args.linger
    _write(reports, f"kill-{rank}", report, {})
    start = time.monotonic()

    def leave() -> None:
        trainer.close()
        mesh.close()

    closing = threading.Thread(target=leave, daemon=True)
    closing.start()
    closing.join(60)
    report["closed_seconds"] = None if closing.is_alive() else time.monotonic() - start
    _write(reports, f"kill-{rank}", report, {})
    os._exit(0)


def resume_alone(args: argparse.Namespace, reports: Path) -> None:
    """The reference of a resume: one process, one device, resumes the checkpoint and takes step 3 over the
    whole global batch."""
    executor = Executor.for_vram([0]) if args.cuda else Executor.cpu()
    resumed = config(
        Objective.Contrastive, PairLossForm.Sigmoid, Negatives.Ambient, args.bags, resume=str(reports / args.checkpoint)
    )
    trainer = Trainer.init_vram(executor, resumed)
    stats = run_steps(trainer, list(range(args.bags)), [3])
    trainer.close()
    _write(reports, "resume-alone", {"stats": stats}, {})


def alone(args: argparse.Namespace, reports: Path) -> None:
    """The reference of the GPU test: one process, one device, the whole global batch."""
    executor = Executor.for_vram([0]) if args.cuda else Executor.cpu()
    report: dict[str, Any] = {"cases": {}}
    arrays: dict[str, np.ndarray] = {}
    for name, objective, form, negatives in cases(args):
        trainer = Trainer.init_vram(executor, config(objective, form, negatives, args.bags))
        first = run_steps(trainer, list(range(args.bags)), [1])
        arrays.update({f"{name}/{k}": v for k, v in snapshot(trainer).items()})
        report["cases"][name] = first + run_steps(trainer, list(range(args.bags)), [2])
        trainer.close()
    _write(reports, "alone", report, arrays)


def resume(args: argparse.Namespace, reports: Path) -> None:
    """After the fault: every process restarts with resume (in another world size) and takes step 3."""
    mesh = mesh_of(args, Executor.for_vram([args.host]) if args.cuda else None)
    description = mesh.describe()
    rank, size = description.ranks[0], description.world_size
    trainer = Trainer.init_vram(
        mesh.executor,
        config(
            Objective.Contrastive,
            PairLossForm.Sigmoid,
            Negatives.Ambient,
            args.bags,
            mesh=mesh,
            resume=str(reports / args.checkpoint),
        ),
    )
    stats = run_steps(trainer, share(rank, size, args.bags), [3])
    arrays = snapshot(trainer)
    trainer.close()
    mesh.close()
    _write(reports, f"resume-{size}-{rank}", {"stats": stats, "description": _describe(description)}, arrays)


def image_bytes(seed: int) -> bytes:
    """A 32 x 32 PNG of noise (two 16-pixel patches a side)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def nonfinite(args: argparse.Namespace, reports: Path) -> None:
    """Two processes. A text run: step 1; step 2 with a NaN put into one gradient on process 1 alone (its
    loss finite); step 3. Then a run with images: step 1 with images on process 0 alone, step 2 text only on
    both. Each process reports its stats and `steps_taken`, and its state after every step."""
    import uform.runtime.world

    uform.runtime.world.BUCKET_BYTES = 64 << 10  # several buckets even for the tiny tower
    mesh = mesh_of(args, Executor.for_vram([args.host]) if args.cuda else None)
    rank, size = mesh.describe().ranks[0], mesh.describe().world_size
    bags = share(rank, size)
    report: dict[str, Any] = {"text": [], "image": []}
    arrays: dict[str, np.ndarray] = {}
    trainer = Trainer.init_vram(
        mesh.executor, config(Objective.Contrastive, PairLossForm.Sigmoid, Negatives.Ambient, mesh=mesh)
    )
    poisoned = trainer.network.tower.blocks[0].qkv.weight
    for step in (1, 2, 3):
        hook = None
        if step == 2 and rank == 1:
            hook = poisoned.register_hook(lambda g: g * float("nan"))
        texts, step_config = step_inputs(bags, step)
        stats = TrainerStepStats()
        step_config.stats = stats
        trainer.on(trainer.executor).step(["text"] * len(texts), texts, step_config)
        if hook is not None:
            hook.remove()
        report["text"].append(
            {"step": stats.step, "nonfinite": stats.nonfinite, "steps_taken": trainer.steps_taken, "loss": stats.loss}
        )
        arrays.update({f"text-{step}/{k}": v for k, v in snapshot(trainer).items()})
    trainer.close()
    images = config(
        Objective.Joint,
        PairLossForm.Sigmoid,
        Negatives.Ambient,
        mesh=mesh,
        batch=BatchShape(
            max_rows_per_device=6,
            max_segments_per_device=16,
            max_columns_per_row=64,
            image=uform.ImageShape(patch_side=16),
        ),
    )
    trainer = Trainer.init_vram(mesh.executor, images, media=MediaPolicy(workers=1))
    for step in (1, 2):
        texts, step_config = step_inputs(bags, step)
        modalities = ["text"] * len(texts)
        contents: list[Any] = list(texts)
        if step == 1 and rank == 0:  # process 0's b-sides are images in the first step
            for i in range(1, len(contents), 2):
                modalities[i], contents[i] = "image", image_bytes(i)
        trainer.on(trainer.executor).step(modalities, contents, step_config)
        report["image"].append({"steps_taken": trainer.steps_taken})
        arrays.update({f"image-{step}/{k}": v for k, v in snapshot(trainer).items()})
    trainer.close()
    mesh.close()
    _write(reports, f"nonfinite-{rank}", report, arrays)


def _describe(description: uform.MeshDescription) -> dict[str, Any]:
    return {
        "host_count": description.host_count,
        "devices_per_host": description.devices_per_host,
        "world_size": description.world_size,
        "ranks": list(description.ranks),
        "host_index": description.host_index,
        "multimem_tier": str(description.multimem_tier),
        "gpu_class": str(description.gpu_class),
        "backend": description.backend,
    }


def _write(reports: Path, name: str, report: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    if arrays:
        np.savez(reports / f"{name}.npz", **arrays)
    temporary = reports / f".{name}.json"
    temporary.write_text(json.dumps(report))
    os.replace(temporary, reports / f"{name}.json")


SCENARIOS = {
    "invariance": invariance,
    "fault": fault,
    "resume": resume,
    "alone": alone,
    "kill": kill,
    "resume_alone": resume_alone,
    "nonfinite": nonfinite,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("reports", type=Path)
    parser.add_argument("--directory", default=None)
    parser.add_argument("--job", default="test")
    parser.add_argument("--host", type=int, default=0)
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--store", default="file")
    parser.add_argument("--torchrun", action="store_true")
    parser.add_argument("--cuda", action="store_true", help="one CUDA device per process (NCCL)")
    parser.add_argument("--checkpoint", default="fault.safetensors", help="what resume resumes, in REPORTS")
    parser.add_argument("--linger", type=float, default=0.0, help="seconds the survivor of kill stays after")
    parser.add_argument("--bags", type=int, default=BAGS, help="the global batch's bags (invariance, kill, resume)")
    args = parser.parse_args()
    try:
        SCENARIOS[args.scenario](args, args.reports)
    except BaseException:
        name = f"crash-{args.scenario}-{os.environ.get('RANK', args.host)}"
        (args.reports / f"{name}.txt").write_text(traceback.format_exc())
        raise


def forks(spec: Path) -> None:
    """Runs the processes of a world as children forked from this process, which imports torch and uform once
    for all of them: a fresh interpreter spends ~3.5 s of CPU on those imports, most of what a process of these
    tiny worlds costs on the CPU. SPEC (JSON): `commands`, each process's arguments to this script (after its
    path); `logs`, where each one's output goes; `codes`, where their exit statuses land, in order, once every
    child has exited (as `subprocess.Popen.returncode`: -N for a signal). A child runs `main` on its arguments
    and exits as a process started with them does: through the interpreter's own shutdown, or `os._exit`."""
    plan = json.loads(spec.read_text())
    import uform.runtime.mesh  # noqa: F401  (uform.Mesh, imported before the fork as uform.Trainer is above)

    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for command, log in zip(plan["commands"], plan["logs"], strict=True):
        pid = os.fork()
        if pid == 0:  # the child: its output to its log, its own arguments; it never returns into this loop
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
            sys.argv = [sys.argv[0], *command]
            main()
            sys.exit(0)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    Path(plan["codes"]).write_text(json.dumps(codes))


if __name__ == "__main__":
    if sys.argv[1:2] == ["forks"]:
        forks(Path(sys.argv[2]))
    else:
        main()
