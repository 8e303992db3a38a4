"""Shared helpers of the trainer's behaviour tests (test_trainer.py, test_resume.py, test_schedule.py).

Every run here is tiny (depth 1, hidden 128, two rows of 64 columns, 8 segments) so the whole set runs in
seconds on a couple of CPU cores. Comparisons are bitwise: `torch.equal` on weights and optimizer moments,
`==` on the stats dataclass (exact floats).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

import uform
from uform import (
    Arena,
    AudioShape,
    BatchShape,
    Edges,
    Executor,
    ImageShape,
    Objective,
    Relations,
    Schedule,
    Trainer,
    TrainerInitVramConfig,
    TrainerStepConfig,
    TrainerStepStats,
)
from uform.config import resolve, to_json
from uform.model.network import Network
from uform.replica.checkpoint import write_checkpoint

torch.set_num_threads(2)

ROWS, COLUMNS, SEGMENTS = 2, 64, 8

# Six short captions that fit one step (two rows of 64 columns, eight segments): three pairs.
TEXTS = [
    "a small cat sleeps",
    "the red bus stops",
    "rain on a window",
    "a kitten is napping",
    "a bus halts in town",
    "drops on the glass",
]


def make_config(**overrides: Any) -> TrainerInitVramConfig:
    """A tiny Joint run; keyword arguments replace top-level fields."""
    fields: dict[str, Any] = dict(
        depth=1,
        hidden=128,
        objective=Objective.Joint,
        batch=BatchShape(max_rows_per_device=ROWS, max_segments_per_device=SEGMENTS, max_columns_per_row=COLUMNS),
        schedule=Schedule(steps=10, warmup_steps=2, learning_rate=1e-3),
        seed=7,
    )
    fields.update(overrides)
    return TrainerInitVramConfig(**fields)


def write_fresh_checkpoint(path: Any, config: TrainerInitVramConfig) -> Network:
    """A trainer checkpoint at `path` of a freshly initialised network of `config` (resolved here), written the way
    `Trainer.save` writes one, so runs the trainer does not train yet can be served; answers the network, in eval."""
    resolved = resolve(config)
    network = Network(resolved)
    network.initialize(resolved.seed)
    tensors = {f"weights.{k}": v for k, v in network.state_dict().items()}
    metadata = {"uform.format": "uform.trainer.1", "uform.config": to_json(resolved), "uform.step": "0"}
    write_checkpoint(path, tensors, metadata)
    return network.eval()


def pair_relations(pairs: int, count: int | None = None) -> Relations:
    """Item i attracts item pairs + i and back, for i < pairs, over `count` items (default 2 * pairs)."""
    count = 2 * pairs if count is None else count
    ids = [pairs + i for i in range(pairs)] + list(range(pairs))
    offsets = [*range(2 * pairs + 1), *([2 * pairs] * (count - 2 * pairs))]
    return Relations(attract=Edges(offsets=offsets, ids=ids))


def overfull_texts(count: int = 12) -> list[str]:
    """More items than the step has segments for: some are dropped."""
    return [f"overfull item {i}" for i in range(count)]


def step_with(
    trainer: Trainer,
    texts: list[str] | None = None,
    *,
    relations: Relations | None = None,
    stats: bool = True,
    arena: bool = True,
    **config: Any,
) -> tuple[TrainerStepStats | None, torch.Tensor | None]:
    """One blocking step over `texts` (default TEXTS with their pairs); answers (stats, embeddings)."""
    texts = TEXTS if texts is None else texts
    if relations is None and texts is TEXTS:
        relations = pair_relations(3)
    st = TrainerStepStats() if stats else None
    out = trainer.on(trainer.executor).step(
        ["text"] * len(texts),
        texts,
        TrainerStepConfig(relations=relations, stats=st, arena=Arena() if arena else None, **config),
    )
    return st, out


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every weight and every optimizer moment (and moment step) of a trainer, cloned, by name."""
    out = {f"weights.{k}": v.detach().clone() for k, v in trainer.network.state_dict().items()}
    for name, p in trainer.network.named_parameters():
        state = trainer.optimizer.state.get(p, {})
        for key, value in state.items():
            out[f"moments.{key}.{name}"] = torch.as_tensor(value).detach().clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bitwise equality of two snapshots: the same names, dtypes, shapes and values."""
    assert sorted(a) == sorted(b), set(a) ^ set(b)
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different}"


def assert_same_output(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)


GoodStep = Callable[[Trainer], tuple[TrainerStepStats, torch.Tensor]]


def two_good_steps(trainer: Trainer, good_step: GoodStep) -> tuple[Any, Any, TrainerStepStats, torch.Tensor]:
    """The reference of the refusal tests: a snapshot after one good step, and the snapshot, stats and
    output of a second."""
    good_step(trainer)
    first = snapshot(trainer)
    stats, out = good_step(trainer)
    return first, snapshot(trainer), stats, out


def assert_refusal_changes_nothing(
    trainer: Trainer,
    reference: Any,
    good_step: GoodStep,
    verb: str,
    modalities: Any,
    contents: Any,
    config: Any,
    error: type[Exception],
    field: str,
) -> None:
    """`trainer`, fresh, takes a good step; then `trainer.<verb>(executor).step(modalities, contents, config)`
    must raise `error` naming `field` (a deferred refusal may come through its future) and change nothing: the
    trainer still matches the reference's first snapshot, and its next good step is the reference's second,
    bitwise (`two_good_steps`)."""
    first, second, reference_stats, reference_out = reference
    good_step(trainer)
    assert_same(snapshot(trainer), first)
    receiver = getattr(trainer, verb)(trainer.executor)
    with pytest.raises(error) as caught:
        answer = receiver.step(modalities, contents, config)
        if isinstance(answer, Future):
            answer.result(timeout=60)
    assert field in str(caught.value), f"{caught.value!r} does not name {field}"
    assert trainer.steps_taken == 1
    assert_same(snapshot(trainer), first)
    stats, out = good_step(trainer)
    assert stats == reference_stats
    assert stats.step == 2
    assert_same_output(out, reference_out)
    assert_same(snapshot(trainer), second)


def direct_terms(trainer: Trainer, texts: list[str], relations: Relations | None, step: int = 1) -> tuple[Any, dict]:
    """The batch and `network.losses` of a step, computed directly (outside the trainer's verbs).

    Prepares the host arrays as the trainer's prepare stage does and puts them on the device as its step does
    (`model.inputs.to_device`); answers (batch, `Network.losses`'s answer: terms and embeddings).
    """
    from uform.data.batch import prepare
    from uform.model.inputs import to_device

    network = trainer.network
    batch = prepare(
        trainer.config,
        [uform.Modality.Text] * len(texts),
        [t.encode() for t in texts],
        bags=None,
        groups=None,
        sides=None,
        relations=relations,
        step=step,
    )
    inputs = to_device(
        batch.host_tensors(False), trainer.device, network.rotary, attention="dense", dtype=torch.float32, dynamic=False
    )
    return batch, network.losses(inputs, None, batch.positives)


@pytest.fixture(scope="session")
def executor() -> Executor:
    return Executor.cpu()


@pytest.fixture
def make_trainer(executor: Executor) -> Iterator[Callable[..., Trainer]]:
    """A factory of trainers on the shared CPU executor, closed at the end of the test."""
    made: list[Trainer] = []

    def make(config: TrainerInitVramConfig | None = None, **overrides: Any) -> Trainer:
        trainer = Trainer.init_vram(executor, config if config is not None else make_config(**overrides))
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.close()


def stats_dict(stats: TrainerStepStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)


def naive_row_loss(
    positives: list[tuple[torch.Tensor, float]], negatives: list[tuple[torch.Tensor, float]], form: Any
) -> torch.Tensor | None:
    """One row's pair loss as docs/design.md §5 writes it, scalar by scalar, from its scored cells as
    (logit, weight) pairs; None when the row is not an anchor (no scored cell; for Ranked, no positive and
    negative both). The loss tests (pooled and late interaction) share it."""

    def sp(x: torch.Tensor) -> torch.Tensor:  # written out, not F.softplus: no code shared with the module
        return torch.log1p(torch.exp(-x.abs())) + x.clamp_min(0)

    if form == uform.PairLossForm.Sigmoid:
        if not positives and not negatives:
            return None
        total = sum((weight * sp(-logit) for logit, weight in positives), torch.zeros(()))
        return total + sum((weight * sp(logit) for logit, weight in negatives), torch.zeros(()))
    if form == uform.PairLossForm.Balanced:
        if not positives and not negatives:
            return None
        total = torch.zeros(())
        if positives:
            total = total + sum(w * sp(-lg) for lg, w in positives) / sum(w for _, w in positives)
        if negatives:
            total = total + sum(w * sp(lg) for lg, w in negatives) / sum(w for _, w in negatives)
        return total
    if not positives or not negatives:
        return None
    numerator = sum(wp * wn * sp(ln - lp) for lp, wp in positives for ln, wn in negatives)
    return numerator / sum(wp * wn for _, wp in positives for _, wn in negatives)  # type: ignore[no-any-return]


def within(seconds: float, call: Callable[[], Any]) -> BaseException | None:
    """What `call` raised (None: it returned), or a TimeoutError if it still runs after `seconds` (a read blocked
    on a named pipe would be; the caller then unblocks it). The call runs in a daemon thread."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return TimeoutError(f"still running after {seconds} s") if thread.is_alive() else outcome[0]


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: set[int], seconds: float = 10.0) -> set[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return {p for p in pids if alive(p)}


def record_mask_kinds(model: Any) -> list[str]:
    """The attention kind (`model.attention.DocumentMask.kind`) of every batch a served `model` launches from now on,
    appended to the list answered, with " +tables" after it where the batch came with FlexAttention's block tables
    from the host stage: its pipeline's `_inputs` wrapped on this instance (`serve_pipeline.Pipeline`)."""
    kinds: list[str] = []
    pipeline = model._pipeline
    inputs = pipeline._inputs

    def recorded(prepared: Any) -> Any:
        batch = inputs(prepared)
        tables = any(name.startswith("block.") for name in prepared.tensors)
        kinds.append(batch.mask.kind + (" +tables" if tables else ""))
        return batch

    pipeline._inputs = recorded
    return kinds


def media_batch(columns: int = 128) -> BatchShape:
    """The serving tests' tiny media batch: 4 rows of `columns`, 8 segments, images in 16-pixel patches, audio in
    320-sample chunks."""
    return BatchShape(
        max_rows_per_device=4,
        max_segments_per_device=8,
        max_columns_per_row=columns,
        image=ImageShape(patch_side=16),
        audio=AudioShape(chunk_samples=320),
    )


def pytest_ignore_collect(collection_path: Path, config: Any) -> bool | None:
    """Test files named in UFORM_TESTS_IN_LEGS (space-separated paths from the repository root) are left out:
    `.ci/run` names its decoder tests there, which it runs in legs of their own at both ends of the media
    dependencies (without this conftest), so its main run need not run them a third time."""
    named = os.environ.get("UFORM_TESTS_IN_LEGS", "").split()
    root = Path(__file__).resolve().parent.parent
    return True if any(collection_path.resolve() == (root / name).resolve() for name in named) else None


MYPY_TEST = "tests/test_style.py::test_mypy"
MYPY_RUN: pytest.StashKey[subprocess.Popen[str]] = pytest.StashKey()
"""The mypy run that `test_mypy` reads, started once the session has collected that test."""


def mypy_command() -> list[str]:
    """What `test_mypy` runs from the repository root: mypy over the package, pyproject.toml's settings."""
    return [sys.executable, "-m", "mypy", "uform"]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Starts `test_mypy`'s mypy run in the background where the session runs that test: ~30 s of one core on a
    fresh clone (no cache), which CI's two cores absorb beside the tests before it (mostly one core's worth);
    `test_mypy` then waits for its answer, the same command's, over the same tree."""
    root = Path(__file__).resolve().parent.parent
    wanted = any(item.nodeid == MYPY_TEST for item in session.items)
    if wanted and not session.config.option.collectonly and importlib.util.find_spec("mypy") is not None:
        session.config.stash[MYPY_RUN] = subprocess.Popen(
            mypy_command(), cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    """A session that ends before `test_mypy` has read its run (stopped, -x) leaves no mypy behind."""
    run = config.stash.get(MYPY_RUN, None)
    if run is not None and run.poll() is None:
        run.kill()
        run.wait()
