"""Serving (issue 4): `uform.load` and the `Model` verbs on text, the checkpoint checks, batching, outputs.

Pins: `encode` answers what a Contrastive step's arena answered on the same items and weights (1e-4 on the
CPU), Matryoshka widths re-normalised; `load` refuses truncated, bit-flipped (data and header), foreign and
non-uform files with a `CheckpointError` naming the file, without ever unpickling; train -> save -> load ->
encode -> evaluate runs; many more items than a batch holds answer what each item alone answers; progress
reports and stops; every `Scalar`; refused calls name the field and change nothing; `text_choose` tapes
shaped like the choices, summing to one, against a direct forward; `tokens` counts per side and values
against a direct forward; `maxsim` against a brute-force loop. Media items: test_serve_media.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TEXTS, make_config, pair_relations, write_fresh_checkpoint

import uform
from uform import (
    Arena,
    BatchShape,
    CheckpointError,
    Contrastive,
    Executor,
    LateInteraction,
    LateInteractionSide,
    Modality,
    Objective,
    Scalar,
    Schedule,
    Stopped,
    Trainer,
    TrainerInitVramConfig,
    TrainerStepConfig,
    vocab,
)
from uform.config import resolve, to_json
from uform.data.items import parse_modalities
from uform.data.windows import packing_rows, plan_batches
from uform.evaluate import encode_texts, evaluate_retrieval, ranking_metrics, retrieval_metrics
from uform.model.attention import document_mask
from uform.model.inputs import DeviceBatch
from uform.model.network import Network
from uform.notices import CapacityWarning, Notices
from uform.replica.checkpoint import write_checkpoint
from uform.serve import Model, load
from uform.serve_stage import HostStage

torch.set_num_threads(2)

MANY = [f"item {i}: " + "lorem ipsum dolor sit amet " * (i % 5) + "x" * (i % 13) for i in range(45)]


# ---- helpers ---------------------------------------------------------------------------------------


def contrastive_config(**overrides: Any) -> TrainerInitVramConfig:
    return make_config(objective=Objective.Contrastive, **overrides)


def write_network(path: Path, config: TrainerInitVramConfig) -> Network:
    """A checkpoint written the way `Trainer.save` writes one, from a freshly initialised network (so runs
    the trainer does not train yet, such as late interaction, can be served); answers the network."""
    return write_fresh_checkpoint(path, config)


def direct_states(network: Network, prefix: list[int], content: bytes | list[int]) -> torch.Tensor:
    """Final-norm states [L, D] of one text segment alone in one row, built by hand (no packer)."""
    ids = torch.tensor([[*prefix, *content]])
    length = ids.shape[1]
    positions = torch.arange(length)[None, :, None].expand(1, length, 3)
    segments = torch.zeros(1, length, dtype=torch.long)
    cos, sin = network.rotary(positions, torch.float32)
    nothing = torch.zeros(1)  # what the states do not read: the objective's targets and pairs
    batch = DeviceBatch(
        tokens=ids,
        positions=positions,
        segments=segments,
        counts=torch.tensor([length]),
        target_index=nothing.long(),
        targets=nothing.long(),
        target_weight=nothing,
        slot_valid=nothing.bool(),
        slot_group=nothing.long(),
        z=nothing[None],
        w=nothing[None],
        mask=document_mask(segments, "dense"),
        cos=cos,
        sin=sin,
        media={},
    )
    with torch.no_grad():
        return network.states(batch)[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Contrastive run (Matryoshka widths 32 and 64) of three steps, saved; then the arena of its fourth
    step, scored on the saved weights; and the loaded model."""
    folder = tmp_path_factory.mktemp("trained")
    config = contrastive_config(contrastive=Contrastive(matryoshka_dimensions=(32, 64)))
    trainer = Trainer.init_vram(Executor.cpu(), config)
    relations = pair_relations(3)
    for _ in range(3):
        trainer.step(["text"] * 6, TEXTS, TrainerStepConfig(relations=relations))
    path = folder / "run.safetensors"
    trainer.save(path)
    arena = trainer.step(["text"] * 6, TEXTS, TrainerStepConfig(relations=relations, arena=Arena()))
    trainer.close()
    model = load(path)
    yield {"path": path, "arena": arena, "model": model, "config": config}
    model.close()


# ---- encode ----------------------------------------------------------------------------------------


def test_encode_equals_the_arena_of_a_contrastive_step(trained: dict[str, Any]) -> None:
    model = trained["model"]
    assert isinstance(model, uform.Model) and uform.load is load
    assert model.step == 3 and model.path == os.fsdecode(trained["path"])
    assert model.matryoshka_dimensions == (32, 64, 128)
    got = model.encode([Modality.Text] * len(TEXTS), TEXTS)
    assert got.shape == (6, 128) and got.dtype == torch.float32
    assert torch.allclose(got, trained["arena"], atol=1e-4, rtol=0)
    # The items in another order, as a tape, through bytes: the same rows.
    data = np.frombuffer("".join(TEXTS[::-1]).encode(), dtype=np.uint8)
    offsets = np.cumsum([0] + [len(t.encode()) for t in TEXTS[::-1]])
    assert torch.allclose(model.encode(["text"] * 6, (data, offsets)), got.flip(0), atol=1e-5)


def test_encode_equals_the_arena_from_the_first_step(make_trainer: Any, tmp_path: Path) -> None:
    """At initialisation too (a run saved before any step), served in batches of two items."""
    trainer = make_trainer(contrastive_config())
    path = tmp_path / "zero.safetensors"
    trainer.save(path)
    arena = trainer.step(["text"] * 6, TEXTS, TrainerStepConfig(relations=pair_relations(3), arena=Arena()))
    with load(path, Executor.cpu(), rows=1, segments=2) as model:
        assert torch.allclose(model.encode(["text"] * 6, TEXTS), arena, atol=1e-4, rtol=0)


def test_encode_matches_a_direct_forward(trained: dict[str, Any]) -> None:
    model = trained["model"]
    for text in ("", "x", TEXTS[0], "cut at the row's width " * 10):
        states = direct_states(model.network, [vocab.MODALITY_MARKER[Modality.Text]], text.encode()[:63])
        with torch.no_grad():
            pooled = model.network.pooled(
                states[None], torch.zeros(1, len(states), dtype=torch.long), torch.tensor([len(states)])
            )
        want = F.normalize(pooled.float(), dim=-1)
        assert torch.allclose(model.encode(["text"], [text]), want, atol=1e-5)


@pytest.mark.parametrize("width", [8, 32, 64, 100, 128])
def test_matryoshka_width_is_renormalised(trained: dict[str, Any], width: int) -> None:
    model = trained["model"]
    full = model.encode(["text"] * 6, TEXTS)
    cut = model.encode(["text"] * 6, TEXTS, width)
    assert cut.shape == (6, width)
    assert torch.allclose(cut.norm(dim=-1), torch.ones(6), atol=1e-5)
    assert torch.allclose(cut, F.normalize(full[:, :width], dim=-1), atol=1e-5)


def test_many_items_answer_what_each_alone_answers(trained: dict[str, Any]) -> None:
    model = load(trained["path"], rows=2, segments=3)  # 45 items: at least 15 batches
    together = model.encode(["text"] * len(MANY), MANY)
    alone = torch.cat([model.encode(["text"], [t]) for t in MANY])
    assert torch.allclose(together, alone, atol=1e-5, rtol=0)
    roomy = trained["model"].encode(["text"] * len(MANY), MANY)
    assert torch.allclose(together, roomy, atol=1e-5, rtol=0)
    assert model.encode([], []).shape == (0, 128)


def test_a_window_s_last_batch_is_filled_from_the_next_window(
    trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load(trained["path"], rows=1, segments=3)
    texts = [f"same length {i:03d}" for i in range(20)]  # 3 to a batch
    model.window = 4  # windows of 4 would leave 1 of 4 in a batch of its own in every window
    sizes: list[int] = []
    prepare = HostStage.prepare

    def counted(self: HostStage, job: Any, setting: Any, members: list[int], *args: Any) -> Any:
        sizes.append(len(members))
        return prepare(self, job, setting, members, *args)

    monkeypatch.setattr(HostStage, "prepare", counted)
    together = model.encode(["text"] * len(texts), texts)
    assert sizes == [3] * 6 + [2]
    alone = torch.cat([trained["model"].encode(["text"], [t]) for t in texts])
    assert torch.allclose(together, alone, atol=1e-5, rtol=0)


def test_modalities_parse_each_distinct_word_once_and_still_name_a_bad_item() -> None:
    """A call's modalities are parsed once per distinct (type, value): 1 and True stay apart (True is refused
    though 1 parsed), and a bad item is named by its index wherever it stands."""
    got = parse_modalities(["image", "TEXT ", 1, Modality.Audio, np.int64(2), "image", 1])
    image, text, video, audio = Modality.Image, Modality.Text, Modality.Video, Modality.Audio
    assert got == [image, text, image, audio, video, image, image]
    with pytest.raises(TypeError, match=r"^modalities\[1\]: .* got a bool"):
        parse_modalities([1, True])
    with pytest.raises(ValueError, match=r"^modalities\[2\]: unknown word 'txet'"):
        parse_modalities(["text", "text", "txet", "text"])
    with pytest.raises(TypeError, match=r"^modalities\[1\]: .* got list"):
        parse_modalities(["text", ["text"]])


def test_plan_batches_respects_capacity_and_packs_first_fit() -> None:
    rng = np.random.default_rng(0)
    lengths = {i: int(rng.integers(1, 70)) for i in range(200)}
    order = sorted(lengths, key=lambda i: (-lengths[i], i))
    seen = []
    for members, rows in plan_batches(order, lengths, rows=3, columns=64, segments=5):
        assert 1 <= len(members) <= 5 and 1 <= rows <= 3
        free = [64] * 3
        for i in members:  # first fit places every member
            need = min(lengths[i], 64)
            r = next(r for r in range(3) if free[r] >= need)
            free[r] -= need
        assert sum(f < 64 for f in free) == rows
        seen += members
    assert seen == order


def test_packing_rows_keeps_the_positions_in_wider_rows() -> None:
    assert packing_rows(64, 1024) == (8, 8192)  # the reference geometry: 31 images of 257 positions a row, not 3
    assert packing_rows(2, 64) == (1, 128)
    assert packing_rows(6, 1024, widest=4096) == (2, 3072)  # the largest divisor of the rows that fits
    assert packing_rows(7, 2048) == (7, 2048)  # no divisor but 1 keeps a row under the widest
    assert packing_rows(4, 16384) == (4, 16384)  # a run's rows wider than the widest stay as they are
    for rows, columns in [(64, 1024), (3, 100), (12, 512), (1, 8192)]:
        r, c = packing_rows(rows, columns)
        assert r * c == rows * columns and c % columns == 0


def test_wide_rows_answer_what_the_run_rows_answer(trained: dict[str, Any]) -> None:
    """FlexAttention serving packs into rows wider than the run's (`Model.packing`); forced here on the dense
    path, the answers are the run's rows' answers, items longer than a run's row cut where it cuts them."""
    texts = [*MANY, "a long text past one row of the run " * 4]
    narrow, wide = load(trained["path"], rows=2, segments=6), load(trained["path"], rows=2, segments=6)
    try:
        wide.packing = (1, 2 * wide.columns)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CapacityWarning)
            want, got = narrow.encode(["text"] * len(texts), texts), wide.encode(["text"] * len(texts), texts)
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
        cut = sum(len(t.encode()) > wide.columns - 1 for t in texts)
        assert cut > 0 and wide.notices.counts() == narrow.notices.counts() == {"capacity.truncated": cut}
    finally:
        narrow.close()
        wide.close()


def test_progress_reports_and_stops(trained: dict[str, Any]) -> None:
    model = load(trained["path"], rows=1, segments=2)
    calls: list[tuple[int, int]] = []
    model.encode(["text"] * len(MANY), MANY, progress=lambda done, total: calls.append((done, total)))
    assert 1 < len(calls) <= 10 and calls[-1] == (45, 45)
    assert all(a[0] < b[0] for a, b in itertools.pairwise(calls))
    calls.clear()
    model.encode(["text"] * len(MANY), MANY, progress=lambda d, t: calls.append((d, t)), progress_steps=3)
    assert len(calls) <= 3 and calls[-1] == (45, 45)

    arena = Arena()
    first = model.encode(["text"] * 6, TEXTS, arena=arena, outputs_scalar="f16").clone()
    with pytest.raises(Stopped, match=r"encode stopped at \d+ of 45 items"):
        model.encode(["text"] * len(MANY), MANY, arena=arena, progress=lambda d, t: False)
    with pytest.raises(Stopped, match=r"45 of 45"):  # stopping at the last report still lands nothing
        model.encode(["text"] * len(MANY), MANY, arena=arena, progress=lambda d, t: d < t)
    assert arena.scalar == Scalar.F16 and torch.equal(arena.embeddings, first)
    # The model works on after a stopped call.
    assert torch.allclose(model.encode(["text"] * 6, TEXTS), trained["arena"], atol=1e-4)


@pytest.mark.parametrize("scalar", list(Scalar))
def test_every_scalar_output(trained: dict[str, Any], scalar: Scalar) -> None:
    model = trained["model"]
    full = model.encode(["text"] * 6, TEXTS)
    got = model.encode(["text"] * 6, TEXTS, outputs_scalar=scalar)
    want = {
        Scalar.F32: full,
        Scalar.F16: full.half(),
        Scalar.BF16: full.bfloat16(),
        Scalar.I8: (full * 127).round().clamp(-127, 127).to(torch.int8),
    }[scalar]
    assert got.dtype == want.dtype and got.shape == (6, 128)
    assert torch.equal(got, want) if scalar != Scalar.I8 else (got.int() - want.int()).abs().max() <= 1
    arena = Arena()
    landed = model.encode(["text"] * 6, TEXTS, 64, arena=arena, outputs_scalar=str(scalar))
    assert arena.embeddings is landed and arena.scalar == scalar and landed.shape == (6, 64)
    assert arena.present is not None and bool(arena.present.all())
    if scalar == Scalar.I8:  # dot products / 127^2 approximate the cosine
        cosine = F.normalize(full[:, :64], dim=-1) @ F.normalize(full[:, :64], dim=-1).T
        assert torch.allclose(landed.float() @ landed.float().T / 127**2, cosine, atol=0.03)


@pytest.mark.parametrize(
    ("arguments", "error", "field"),
    [
        (dict(modalities=["txt"]), ValueError, "modalities[0]"),
        (dict(modalities=[True]), TypeError, "modalities[0]"),
        (dict(modalities="text"), TypeError, "modalities"),
        (dict(contents=["a", "b"]), ValueError, "contents"),
        (dict(contents=[1]), TypeError, "contents[0]"),
        (dict(modalities=["image"], contents=[b"\xff\xd8"]), ValueError, "modalities[0]"),
        (dict(width=0), ValueError, "width"),
        (dict(width=129), ValueError, "width"),
        (dict(width=True), TypeError, "width"),
        (dict(width=32.0), TypeError, "width"),
        (dict(sides=["query", "x"]), ValueError, "sides"),
        (dict(sides=["bogus"]), ValueError, "sides[0]"),
        (dict(arena="arena"), TypeError, "arena"),
        (dict(outputs_scalar="f64"), ValueError, "outputs_scalar"),
        (dict(progress=3), TypeError, "progress"),
        (dict(progress_steps=-1), ValueError, "progress_steps"),
    ],
)
def test_refused_calls_name_the_field_and_change_nothing(
    trained: dict[str, Any], arguments: dict[str, Any], error: type, field: str
) -> None:
    model = trained["model"]
    arena = Arena()
    before = model.encode(["text"], ["kept"], arena=arena).clone()
    weights = {k: v.clone() for k, v in model.network.state_dict().items()}
    call = {"modalities": ["text"], "contents": ["x"], "arena": arena, **arguments}
    with pytest.raises(error) as caught:
        model.encode(**call)
    assert str(caught.value).startswith(f"{field}:"), str(caught.value)
    assert torch.equal(arena.embeddings, before) and arena.scalar == Scalar.F32
    assert all(torch.equal(v, weights[k]) for k, v in model.network.state_dict().items())


def test_load_refuses_bad_arguments(trained: dict[str, Any]) -> None:
    path = trained["path"]
    for call, error, field in [
        (lambda: load(3), TypeError, "path"),
        (lambda: load(path, "cpu"), TypeError, "executor"),
        (lambda: load(path, rows=-1), ValueError, "rows"),
        (lambda: load(path, segments=1.5), TypeError, "segments"),
        (lambda: load(path, precision="fp8"), ValueError, "precision"),
        (lambda: load(path, compiled="yes"), TypeError, "compiled"),
        (lambda: load(path, media="strict"), TypeError, "media"),
    ]:
        with pytest.raises(error, match=rf"^{field}:"):
            call()
    with pytest.raises(TypeError, match=r"uform.load"):
        Model(None, None, None, rows=0, segments=0, media=None, bf16=False, compiled=False)  # type: ignore[arg-type]
    assert load(os.fsencode(path)).step == 3  # bytes paths cross as the OS's bytes


# ---- the checkpoint checks ---------------------------------------------------------------------------


@pytest.fixture
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any unpickling during the test fails it."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("unpickled a file")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def refused(path: Path, *, why: str | None = None) -> str:
    with pytest.raises(CheckpointError) as caught:
        load(path)
    message = str(caught.value)
    assert message.startswith(os.fsdecode(path)), message
    if why is not None:
        assert why in message, message
    return message


def test_load_refuses_truncated_files(trained: dict[str, Any], tmp_path: Path, no_pickle: None) -> None:
    data = trained["path"].read_bytes()
    for cut in (0, 4, 8, 9, 100, len(data) // 3, len(data) - 4096, len(data) - 1):
        path = tmp_path / f"cut-{cut}.safetensors"
        path.write_bytes(data[:cut])
        refused(path)


def test_load_refuses_bit_flips_in_the_tensor_data(trained: dict[str, Any], tmp_path: Path, no_pickle: None) -> None:
    data = trained["path"].read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    rng = np.random.default_rng(1)
    places = [start, len(data) - 1, *rng.integers(start, len(data), size=30).tolist()]
    for place in places:
        flipped = bytearray(data)
        flipped[place] ^= 1 << int(rng.integers(0, 8))
        path = tmp_path / "flip.safetensors"
        path.write_bytes(bytes(flipped))
        refused(path, why="digest mismatch")


def test_load_refuses_bit_flips_in_the_header(trained: dict[str, Any], tmp_path: Path, no_pickle: None) -> None:
    data = trained["path"].read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + size].decode()
    rng = np.random.default_rng(2)
    # Everywhere in the size field and the JSON, and on purpose in the stored config (its seed and depth
    # letters: the file still parses, only the digest can tell) and in a tensor's name and shape.
    places = list(range(8)) + rng.integers(8, 8 + size, size=120).tolist()
    for needle in ('seed\\"', 'depth\\"', "weights.pooled.projection.weight", '"shape":[128,128]'):
        places.append(8 + len(header[: header.index(needle)].encode()) + 2)
    messages = set()
    for place in places:
        flipped = bytearray(data)
        flipped[place] ^= 1 << int(rng.integers(0, 8))
        path = tmp_path / "flip.safetensors"
        path.write_bytes(bytes(flipped))
        messages.add(refused(path).split(": ", 1)[1][:20])
    assert len(messages) > 3  # caught by several different checks


def test_load_refuses_files_that_are_not_safetensors(tmp_path: Path, no_pickle: None) -> None:
    pickled = tmp_path / "weights.pt"
    with open(pickled, "wb") as f:
        torch.save({"weights": torch.zeros(3)}, f)  # a zip of pickles: must never be opened as one
    samples = {
        "empty.safetensors": b"",
        "text.safetensors": b"just some text, not a checkpoint\n" * 10,
        "random.bin": np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "json.safetensors": (18).to_bytes(8, "little") + b'{"a": [1, 2, 3]}  ',
    }
    for name, content in samples.items():
        (tmp_path / name).write_bytes(content)
        refused(tmp_path / name)
    refused(pickled)
    with pytest.raises(FileNotFoundError, match=r"missing.safetensors"):
        load(tmp_path / "missing.safetensors")


def test_load_refuses_safetensors_files_that_are_not_uform_checkpoints(tmp_path: Path, no_pickle: None) -> None:
    from safetensors.torch import save_file

    tensors = {"weight": torch.zeros(4, 4)}
    save_file(tensors, tmp_path / "plain.safetensors")
    refused(tmp_path / "plain.safetensors", why="not a uform checkpoint")
    save_file(tensors, tmp_path / "meta.safetensors", metadata={"format": "pt"})
    refused(tmp_path / "meta.safetensors", why="not a uform checkpoint")
    write_checkpoint(tmp_path / "other.safetensors", tensors, {"uform.format": "someone.else.1"})
    refused(tmp_path / "other.safetensors", why="not a uform trainer checkpoint")
    write_checkpoint(tmp_path / "none.safetensors", tensors, {})
    refused(tmp_path / "none.safetensors", why="not a uform trainer checkpoint")

    config = resolve(contrastive_config())
    base = {"uform.format": "uform.trainer.1", "uform.step": "1"}
    write_checkpoint(tmp_path / "noconfig.safetensors", tensors, base)
    refused(tmp_path / "noconfig.safetensors", why="stored config")
    write_checkpoint(tmp_path / "badconfig.safetensors", tensors, {**base, "uform.config": '{"depth": 0}'})
    refused(tmp_path / "badconfig.safetensors", why="stored config")
    write_checkpoint(tmp_path / "weights.safetensors", tensors, {**base, "uform.config": to_json(config)})
    refused(tmp_path / "weights.safetensors", why="do not match its config")
    network = Network(config)
    shapes = {f"weights.{k}": torch.zeros_like(v) for k, v in network.state_dict().items()}
    shapes["weights.pooled.projection.weight"] = torch.zeros(128, 64)
    write_checkpoint(tmp_path / "shape.safetensors", shapes, {**base, "uform.config": to_json(config)})
    refused(tmp_path / "shape.safetensors", why="'pooled.projection.weight'")


# ---- the whole loop ---------------------------------------------------------------------------------


def test_train_save_load_encode_evaluate(tmp_path: Path) -> None:
    pairs = [(f"question {i} about topic {i * 7 % 11}", f"answer {i}: topic {i * 7 % 11} in detail") for i in range(8)]
    texts = [q for q, _ in pairs] + [d for _, d in pairs]
    config = contrastive_config(
        batch=BatchShape(max_rows_per_device=4, max_segments_per_device=16, max_columns_per_row=64),
        schedule=Schedule(steps=6, warmup_steps=1, learning_rate=2e-3),
    )
    trainer = Trainer.init_vram(Executor.cpu(), config)
    try:
        for _ in range(6):
            trainer.step(["text"] * 16, texts, TrainerStepConfig(relations=pair_relations(8)))
        live = evaluate_retrieval(
            Model.from_trainer(trainer), [q for q, _ in pairs], [d for _, d in pairs], list(range(8))
        )
        path = tmp_path / "loop.safetensors"
        trainer.save(path)
        before = encode_texts(trainer, texts)
    finally:
        trainer.close()
    model = load(path)
    assert model.step == 6
    assert torch.allclose(model.encode(["text"] * 16, texts), before, atol=1e-5)
    queries = (["text"] * 8, [q for q, _ in pairs])
    documents = [d for _, d in pairs]
    metrics = evaluate_retrieval(model, queries, documents, list(range(8)), ks=(1, 3))
    assert set(metrics) == {"recall@1", "recall@3", "mrr"}
    assert 0 <= metrics["recall@1"] <= metrics["recall@3"] <= 1 and 0 < metrics["mrr"] <= 1
    want = retrieval_metrics(model.encode(*queries), model.encode(["text"] * 8, documents), list(range(8)), (1, 3))
    assert metrics == want
    assert live["mrr"] == pytest.approx(metrics["mrr"], abs=1e-6)
    narrow = evaluate_retrieval(model, queries, documents, list(range(8)), width=64)
    assert set(narrow) == {"recall@1", "recall@10", "mrr"}
    with pytest.raises(ValueError, match=r"^queries:"):
        evaluate_retrieval(model, "not items", documents, list(range(8)))
    with pytest.raises(ValueError, match=r"^tokens:"):  # a run without late interaction has no token vectors
        evaluate_retrieval(model, queries, documents, list(range(8)), late=True)


def test_ranking_metrics_agree_with_retrieval_metrics() -> None:
    g = torch.Generator().manual_seed(5)
    q, d = F.normalize(torch.randn(7, 16, generator=g), dim=-1), F.normalize(torch.randn(20, 16, generator=g), dim=-1)
    relevant = [[i, (i + 3) % 20] for i in range(7)]
    assert ranking_metrics(q @ d.T, relevant) == retrieval_metrics(q, d, relevant)
    with pytest.raises(ValueError, match=r"^scores:"):
        ranking_metrics(torch.zeros(3), relevant)
    with pytest.raises(ValueError, match=r"^scores:"):
        ranking_metrics(torch.full((7, 20), float("nan")), relevant)


# ---- text_choose -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def joint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Network]:
    path = tmp_path_factory.mktemp("joint") / "joint.safetensors"
    config = make_config(
        batch=BatchShape(
            max_rows_per_device=2, max_segments_per_device=8, max_columns_per_row=64, max_choices_per_item=6
        )
    )
    network = write_network(path, config)
    return load(path, rows=1, segments=3), network


def direct_choice(network: Network, text: bytes, legal: bytes, columns: int = 64) -> np.ndarray:
    """p over `legal` at a MASK after the text's last `columns - 2` bytes, one segment alone."""
    kept = text[len(text) - (columns - 2) :] if len(text) > columns - 2 else text
    states = direct_states(network, [vocab.MODALITY_MARKER[Modality.Text]], [*kept, vocab.MASK])
    with torch.no_grad():
        logits = network.text_head(states[-1]).double()
    return torch.softmax(logits[list(legal)], dim=0).numpy()


def test_text_choose_answers_a_tape_shaped_like_the_choices(joint: tuple[Model, Network]) -> None:
    model, network = joint
    texts = ["The answer is", "Pick one: A, B or C. I pick", "", "long context " * 20 + "so the answer is", "x"]
    choices = [b"AB", b"ABC", b" ", b"YN?", b"0123"]
    data, offsets = model.text_choose(texts, choices)
    assert data.dtype == np.float32 and offsets.dtype == np.int64
    assert offsets.tolist() == [0, 2, 5, 6, 9, 13] and len(data) == 13
    for i, (text, legal) in enumerate(zip(texts, choices, strict=True)):
        p = data[offsets[i] : offsets[i + 1]]
        assert p.sum() == pytest.approx(1.0, abs=1e-6) and (p > 0).all()
        assert np.allclose(p, direct_choice(network, text.encode(), legal), atol=1e-5)
    # A tape of choices answers the same; a text longer than the row only its tail matters.
    tape = (np.frombuffer(b"".join(choices), dtype=np.uint8), np.array(offsets))
    again, again_offsets = model.text_choose([t.encode() for t in texts], tape)
    assert np.allclose(again, data, atol=1e-6) and (again_offsets == offsets).all()
    head = model.text_choose(["HEAD " * 30 + texts[3]], [b"YN?"])[0]
    assert np.allclose(head, data[6:9], atol=1e-6)


@pytest.mark.parametrize(
    ("texts", "choices", "error", "field"),
    [
        (["a"], [b""], ValueError, "choices[0]"),
        (["a"], [b"AA"], ValueError, "choices[0]"),
        (["a"], [b"ABCDEFG"], ValueError, "choices[0]"),
        (["a", "b"], [b"A"], ValueError, "choices"),
        (["a"], [3], TypeError, "choices[0]"),
        (["a"], b"A", TypeError, "choices"),
        ("a", [b"A"], TypeError, "texts"),
        ([1], [b"A"], TypeError, "texts[0]"),
    ],
)
def test_text_choose_refuses_bad_calls(
    joint: tuple[Model, Network], texts: Any, choices: Any, error: type, field: str
) -> None:
    with pytest.raises(error) as caught:
        joint[0].text_choose(texts, choices)
    assert str(caught.value).startswith(f"{field}:"), str(caught.value)


def test_text_choose_warns_once_about_texts_whose_head_was_cut(joint: tuple[Model, Network]) -> None:
    model = joint[0]
    model.notices = Notices()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.text_choose(["HEAD " * 30, "short", "HEAD " * 40], [b"YN", b"YN", b"YN"])
        model.text_choose(["HEAD " * 30, "short", "HEAD " * 40], [b"YN", b"YN", b"YN"])
    shown = [str(w.message) for w in caught if issubclass(w.category, CapacityWarning)]
    assert len(shown) == 1 and shown[0].startswith("uform: text_choose cut 2 of 3 items (67%)"), shown
    assert "batch.max_columns_per_row (64 positions a row" in shown[0]
    assert model.notices.counts() == {"capacity.truncated": 4}


def test_text_choose_needs_a_trained_text_head(trained: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"^text_choose: .*Contrastive alone"):
        trained["model"].text_choose(["a"], [b"AB"])


# ---- tokens and maxsim ----------------------------------------------------------------------------------


SPAN = 5


@pytest.fixture(scope="module")
def late(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Network]:
    path = tmp_path_factory.mktemp("late") / "late.safetensors"
    config = contrastive_config(late_interaction=LateInteraction(weight=1.0, width=32, max_query_span=SPAN))
    network = write_network(path, config)
    return load(path, rows=1, segments=2), network


def test_tokens_counts_per_side(late: tuple[Model, Network]) -> None:
    model, _ = late
    texts = ["", "ab", "a query of many bytes", "z" * 100]
    content = [min(len(t), 64 - 2) for t in texts]
    for side, want in [
        (LateInteractionSide.Query, [min(c, SPAN) for c in content]),
        ("document", content),
        (LateInteractionSide.QueryAndDocument, content),
        (["query", "document", "query", "document"], [0, 2, SPAN, 62]),
    ]:
        data, offsets = model.tokens(["text"] * 4, texts, side)
        assert np.diff(offsets).tolist() == want and offsets[0] == 0 and data.shape == (offsets[-1], 32)
        assert torch.allclose(data.norm(dim=-1), torch.ones(len(data)), atol=1e-5)


def test_tokens_match_a_direct_forward(late: tuple[Model, Network]) -> None:
    model, network = late
    texts = [f"text number {i} " * (1 + i % 4) for i in range(9)]
    for side, limit in [(LateInteractionSide.Query, SPAN), (LateInteractionSide.Document, None)]:
        data, offsets = model.tokens(["text"] * 9, texts, side)
        for i, text in enumerate(texts):
            prefix = [vocab.MODALITY_MARKER[Modality.Text], vocab.SIDE_MARKER[side]]
            states = direct_states(network, prefix, text.encode())
            with torch.no_grad():
                want = network.token_head(states[2 : 2 + (limit or len(text))])
            assert torch.allclose(data[offsets[i] : offsets[i + 1]], want, atol=1e-5)
    # encode of a late run carries the side marker too: the default side is None.
    pooled = model.encode(["text"], [texts[0]])
    states = direct_states(
        network, [vocab.MODALITY_MARKER[Modality.Text], vocab.SIDE_MARKER[LateInteractionSide.None_]], texts[0].encode()
    )
    with torch.no_grad():
        want = F.normalize(
            network.pooled(states[None], torch.zeros(1, len(states), dtype=torch.long), torch.tensor([len(states)])),
            dim=-1,
        )
    assert torch.allclose(pooled, want, atol=1e-5)
    assert not torch.allclose(model.encode(["text"], [texts[0]], sides=["query"]), pooled, atol=1e-3)


def test_tokens_of_wide_rows_are_the_run_rows_tokens(late: tuple[Model, Network]) -> None:
    model, _ = late
    texts = [f"text number {i} " * (1 + i % 7) for i in range(9)]
    sides = ["query", "document"] * 4 + ["document"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CapacityWarning)
        want, want_offsets = model.tokens(["text"] * 9, texts, sides)
        packing, model.packing = model.packing, (1, 2 * model.columns)
        try:
            got, offsets = model.tokens(["text"] * 9, texts, sides)
        finally:
            model.packing = packing
    assert np.array_equal(offsets, want_offsets) and max(np.diff(offsets)) == model.columns - 2
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def brute_maxsim(q: torch.Tensor, qo: np.ndarray, d: torch.Tensor, do: np.ndarray) -> torch.Tensor:
    out = torch.zeros(len(qo) - 1, len(do) - 1)
    for i in range(len(qo) - 1):
        for j in range(len(do) - 1):
            total = 0.0
            for t in range(qo[i], qo[i + 1]):
                best = [float(q[t] @ d[u]) for u in range(do[j], do[j + 1])]
                total += max(best) if best else 0.0
            out[i, j] = total
    return out


def test_maxsim_matches_a_brute_force_loop(late: tuple[Model, Network]) -> None:
    model, _ = late
    queries = ["what is a cat", "", "bus stops", "rain"]
    documents = [*TEXTS, ""]
    q = model.tokens(["text"] * 4, queries, "query")
    d = model.tokens(["text"] * 7, documents, "document")
    scores = model.maxsim(q, d)
    assert scores.shape == (4, 7) and scores.dtype == torch.float32
    assert torch.allclose(scores, brute_maxsim(*q, *d), atol=1e-4)
    assert (scores[1] == 0).all() and (scores[:, 6] == 0).all()
    # Small blocks (many documents per query token budget) answer the same.
    import uform.maxsim as maxsim

    small = maxsim.maxsim_scores(q[0], q[1], d[0], d[1], torch.device("cpu"))
    old = maxsim.BLOCK
    maxsim.BLOCK = 40
    try:
        assert torch.allclose(maxsim.maxsim_scores(q[0], q[1], d[0], d[1], torch.device("cpu")), small, atol=1e-5)
    finally:
        maxsim.BLOCK = old
    # Random tapes, numpy data.
    g = torch.Generator().manual_seed(0)
    qd, dd = (
        F.normalize(torch.randn(11, 32, generator=g), dim=-1),
        F.normalize(torch.randn(17, 32, generator=g), dim=-1),
    )
    qo, do = np.array([0, 3, 3, 11]), np.array([0, 5, 6, 6, 17])
    assert torch.allclose(model.maxsim((qd.numpy(), qo), (dd, do)), brute_maxsim(qd, qo, dd, do), atol=1e-5)
    metrics = evaluate_retrieval(model, queries[:3], documents[:3], [[0], [1], [1]], late=True)
    assert metrics == ranking_metrics(
        model.maxsim(
            model.tokens(["text"] * 3, queries[:3], "query"), model.tokens(["text"] * 3, documents[:3], "document")
        ),
        [[0], [1], [1]],
    )


def test_tokens_and_maxsim_refuse_bad_calls(late: tuple[Model, Network], trained: dict[str, Any]) -> None:
    model, _ = late
    with pytest.raises(ValueError, match=r"^side: an item of side None"):
        model.tokens(["text"], ["a"], LateInteractionSide.None_)
    with pytest.raises(ValueError, match=r"^side\[1\]: an item of side None"):
        model.tokens(["text"] * 2, ["a", "b"], ["query", "none"])
    with pytest.raises(ValueError, match=r"^side:"):
        model.tokens(["text"] * 2, ["a", "b"], ["query"])
    with pytest.raises(ValueError, match=r"^side:"):
        model.tokens(["text"], ["a"], "sideways")
    with pytest.raises(TypeError, match=r"^side:"):
        model.tokens(["text"], ["a"], 1.5)
    with pytest.raises(ValueError, match=r"^tokens: .*late_interaction.weight 0"):
        trained["model"].tokens(["text"], ["a"], "query")
    tape = model.tokens(["text"] * 2, ["a", "bc"], "document")
    with pytest.raises(TypeError, match=r"^queries:"):
        model.maxsim(tape[0], tape)
    with pytest.raises(ValueError, match=r"^documents:"):
        model.maxsim(tape, (tape[0], np.array([0, 1, 2])))
    with pytest.raises(ValueError, match=r"^documents:"):
        model.maxsim(tape, (tape[0][:, :16], tape[1]))
    with pytest.raises(TypeError, match=r"^queries:"):
        model.maxsim((tape[0].long(), tape[1]), tape)


def test_from_trainer_shares_weights_and_restores_the_mode(make_trainer: Any) -> None:
    trainer = make_trainer(contrastive_config())
    model = Model.from_trainer(trainer, segments=2)
    first = model.encode(["text"] * 6, TEXTS)
    assert trainer.network.training
    arena = trainer.step(["text"] * 6, TEXTS, TrainerStepConfig(relations=pair_relations(3), arena=Arena()))
    assert torch.allclose(first, arena, atol=1e-4)
    moved = model.encode(["text"] * 6, TEXTS)  # the step moved the shared weights
    assert not torch.allclose(moved, first, atol=1e-6)
    assert model.segments == 2 and dataclasses.asdict(model.config) == dataclasses.asdict(trainer.config)
