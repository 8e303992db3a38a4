"""What the bench scripts share: their text corpus, its pairs and the Joint run they time (a sibling module, not a
package)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any


def topic_text() -> bytes:
    """CPython's pydoc topics, whitespace collapsed: a corpus every Python installation ships."""
    import pydoc_data.topics

    return " ".join(" ".join(v.split()) for v in pydoc_data.topics.topics.values()).encode()


def topic_slices(count: int, length: int, offset: int = 0) -> list[bytes]:
    """`count` slices of `length` bytes of `topic_text`, starting `offset` slices in (the corpus repeats, a space
    between copies, where more is asked for than it holds)."""
    text = topic_text()
    need = (offset + count) * length
    text = (text + b" ") * (1 + need // len(text))
    return [text[(offset + i) * length : (offset + i + 1) * length] for i in range(count)]


def pair_relations(count: int) -> Any:
    """Relations over `count` items in which items 2k and 2k + 1 attract each other."""
    import uform as u

    return u.Relations(attract=u.Edges(offsets=list(range(count + 1)), ids=[i ^ 1 for i in range(count)]))


def decode_in_pool(
    pool: Any, images: list[bytes], geometry: dict[str, int], keyed: bool = True, window: int = 0
) -> None:
    """`images` (JPEG bytes) through `media.decode.decode_items` on `pool` (a `DecodePool`), in chunks of images a
    decoder job as serving and the trainer decode them, at the image `geometry` (patch_side, channels), with the
    items' keys or without (`keyed`); `window` items at a time (0: all at once), as a serving call decodes its
    windows. The units, views of the decoders' slabs, are dropped after each window so the next reuses those
    bytes: held for every image at once, they overflowed the decoders' 64 MiB result slabs past 256 RGBA images a
    decoder, the rest crossed the pipe, and the same JPEGs decoded 25-35% slower on two cores."""
    import uform as u
    from uform.media.decode import MediaPolicy, decode_items

    shape = u.BatchShape(image=u.ImageShape(**geometry))
    policy = MediaPolicy(workers=pool.workers)
    step = window or max(1, len(images))
    for first in range(0, len(images), step):
        items = range(first, min(first + step, len(images)))
        units, _ = decode_items(pool, policy, shape, ["image"] * len(images), images, items, 1023, keyed)
        del units


def bench_config(args: Any, *, objective: Any = None, batch: dict[str, Any] | None = None, **fields: Any) -> Any:
    """The run of `args.depth` x `args.hidden` over `args.rows` x `args.columns` with `args.segments` segments the
    benches train: `objective` (default `Objective.Joint`), seed 42, a 10,000-step schedule, `batch` adding
    BatchShape fields and `fields` TrainerInitVramConfig ones (a `schedule` or `seed` among them replaces the
    default)."""
    import uform as u

    settings: dict[str, Any] = {"schedule": u.Schedule(steps=10_000), "seed": 42, **fields}
    return u.TrainerInitVramConfig(
        depth=args.depth,
        hidden=args.hidden,
        objective=u.Objective.Joint if objective is None else objective,
        batch=u.BatchShape(
            max_rows_per_device=args.rows,
            max_segments_per_device=args.segments,
            max_columns_per_row=args.columns,
            **(batch or {}),
        ),
        **settings,
    )


def add_geometry(
    parser: argparse.ArgumentParser,
    *,
    depth: int = 12,
    hidden: int = 512,
    rows: int = 64,
    columns: int = 1024,
    segments: int = 256,
) -> None:
    """--depth, --hidden, --rows, --columns and --segments, defaulting to the reference geometry (docs/design.md §1) unless given."""
    for name, default in (
        ("depth", depth),
        ("hidden", hidden),
        ("rows", rows),
        ("columns", columns),
        ("segments", segments),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)


def add_channels(parser: argparse.ArgumentParser) -> None:
    """--channels: an image pixel's channels in uform's run (0: the seed's four, RGBA; 3: RGB, as open_clip's)."""
    parser.add_argument(
        "--channels",
        type=int,
        default=0,
        help="an image pixel's channels in uform's run (0: the seed's 4, RGBA; 3: RGB)",
    )


def write_json(name: str, data: Any, folder: str | None = None) -> str:
    """Writes `data` as `name` under `folder` (default: $OUT, else the current folder, made if missing); answers
    the path. A dict gains "uform_from", the folder of the uform package the bench ran (where it imported one):
    a bench imports the checkout it sits in, whatever PYTHONPATH says, so an A/B of two builds runs each from a
    tree of its own, and this says which one ran."""
    folder = folder or os.environ.get("OUT") or "."
    package = sys.modules.get("uform")
    if isinstance(data, dict) and package is not None and getattr(package, "__file__", None):
        data = {**data, "uform_from": os.path.dirname(os.path.abspath(package.__file__))}
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def in_flight(submit: Callable[[int], Future], indices: Iterable[int], pending: int) -> None:
    """Calls `submit(k)` for each of `indices` (deferred steps), waiting for the oldest answer whenever more than
    `pending` are unanswered, then for every answer (0: one step at a time)."""
    waiting: list[Future] = []
    for k in indices:
        waiting.append(submit(k))
        if len(waiting) > pending:
            waiting.pop(0).result()
    for future in waiting:
        future.result()


def random_checkpoint(
    args: Any, path: str, *, patch_side: int = 16, channels: int = 0, widths: tuple[int, ...] = ()
) -> str:
    """Writes a trainer checkpoint of a freshly initialised Contrastive network (seed 42) at `path` and answers it:
    `args.depth` x `args.hidden` over `args.rows` x `args.columns` with `args.segments` segments, images in patches
    of `patch_side` with `channels` a pixel (0: the seed's four, RGBA), Matryoshka `widths`."""
    import uform as u
    from uform.config import resolve, to_json
    from uform.model.network import Network
    from uform.replica.checkpoint import write_checkpoint

    config = resolve(
        bench_config(
            args,
            objective=u.Objective.Contrastive,
            batch={"image": u.ImageShape(patch_side=patch_side, channels=channels)},
            contrastive=u.Contrastive(matryoshka_dimensions=widths),
            schedule=u.Schedule(steps=1),
        )
    )
    network = Network(config)
    network.initialize(config.seed)
    tensors = {f"weights.{k}": v for k, v in network.state_dict().items()}
    write_checkpoint(path, tensors, {"uform.format": "uform.trainer.1", "uform.config": to_json(config)})
    return path


def bert_config(depth: int, hidden: int, vocab: int, positions: int) -> Any:
    """transformers' `BertConfig` of a tower shaped like uform's: `depth` layers of `hidden` (heads of 64, MLP 4x),
    SDPA attention, `vocab` token ids and `positions` positions."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=depth,
        num_attention_heads=hidden // 64,
        intermediate_size=4 * hidden,
        max_position_embeddings=positions,
        attn_implementation="sdpa",
    )


def stat_cpu_seconds(path: str) -> float:
    """User + system CPU seconds from a Linux `/proc/<pid>/stat` or `/proc/<pid>/task/<tid>/stat` file (utime and
    stime, the 14th and 15th fields, read after the parenthesised name, which may hold spaces). Raises OSError
    where there is no such file (the process or thread ended; not Linux)."""
    fields = _stat_fields(path)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[str]:
    """The fields of a Linux `/proc/.../stat` file after the parenthesised name (the state first, then the parent)."""
    with open(path) as handle:
        return handle.read().rsplit(")", 1)[1].split()


def host_cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all this host's CPUs since boot (the "cpu" line of Linux's /proc/stat: busy is
    everything but idle and iowait); None where there is no such file."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(f) for f in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def family_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` and every live process under it (read from /proc; 0 for those
    that ended meanwhile, and elsewhere than Linux)."""
    parents: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0.0
    for entry in entries:
        if entry.isdigit():
            try:
                parent = int(_stat_fields(f"/proc/{entry}/stat")[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(parent, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += stat_cpu_seconds(f"/proc/{current}/stat")
        except (OSError, IndexError, ValueError):
            continue
        todo.extend(parents.get(current, []))
    return total


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process's live threads by name (`/proc/self/task/*/comm`; threads of
    one name summed), Linux only ({} elsewhere). PyTorch's autograd runs a CUDA backward's launches on a thread
    of its own ("pt_autograd_0"), which this tells apart from the thread that called `backward()`."""
    out: dict[str, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                name = handle.read().strip()
            seconds = stat_cpu_seconds(f"/proc/self/task/{task}/stat")
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def thread_cpu_per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """ms of CPU a step of each thread name between two `thread_cpu_seconds` readings, largest first."""
    spent = {name: (after[name] - before.get(name, 0.0)) / steps * 1e3 for name in after}
    return dict(sorted(((k, v) for k, v in spent.items() if v > 0), key=lambda kv: -kv[1]))


class Fed:
    """A replica's `Stage` that answers one prepared step for every step (the prepare stage taken away)."""

    def __init__(self, batch: Any, tensors: Any) -> None:
        self.answer = (batch, tensors, [])

    def prepare(self, checked: Any, step: int) -> Any:
        return self.answer

    def decode(self, checked: Any) -> Any:
        return {}, []

    def close(self) -> None:
        pass

    @classmethod
    def install(cls, trainer: Any, modalities: list, contents: list, step_config: Any) -> Any:
        """Feeds `trainer`'s replica one prepared step (of these items) for every step from now; answers the stage
        it replaced, to put back."""
        replica = trainer.replica
        checked = replica.check_step(modalities, contents, step_config, False)
        real, replica.stage = replica.stage, cls(*replica.prepare(checked, 10_000))
        return real
