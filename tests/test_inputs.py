"""The one device path (`uform.model.inputs`): training and serving put a batch on the device alike, a name
that is no batch tensor's is refused, and the typed batch traces as one graph."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import make_config

from uform import BatchShape, ImageShape, Modality, Objective, Trainer, TrainerStepConfig
from uform.config import resolve
from uform.data.batch import prepare
from uform.model.inputs import DeviceBatch, to_device
from uform.model.network import Network
from uform.serve import Model


def _tensors(batch: DeviceBatch) -> dict[str, torch.Tensor]:
    """Every tensor of a device batch by a dotted name, the dense mask's included."""
    out: dict[str, torch.Tensor] = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = value
    assert batch.mask.dense is not None
    out["mask.dense"] = batch.mask.dense
    for kind, parts in batch.media.items():
        out.update({f"{kind}.{f.name}": getattr(parts, f.name) for f in dataclasses.fields(parts)})
    for name, group in (("late", batch.late), ("choice", batch.choice)):
        if group is not None:
            out.update({f"{name}.{f.name}": getattr(group, f.name) for f in dataclasses.fields(group)})
    return out


def test_training_and_serving_put_the_same_batch_on_the_device(executor) -> None:
    """One text item in a step of one row and one slot (nothing corrupted under Contrastive, so the trainer's
    prepare stage and serving's packing make the same host batch): the device batch the network's states read
    is the same in the trainer's step and in `encode`, every tensor bitwise, images live (inert units)."""
    config = make_config(
        objective=Objective.Contrastive,
        batch=BatchShape(
            max_rows_per_device=1, max_segments_per_device=1, max_columns_per_row=64, image=ImageShape(patch_side=8)
        ),
    )
    trainer = Trainer.init_vram(executor, config)
    seen: list[DeviceBatch] = []
    states = trainer.network.states

    def recording(batch: DeviceBatch) -> torch.Tensor:
        seen.append(batch)
        return states(batch)

    try:
        trainer.network.states = recording  # type: ignore[method-assign]
        trainer.on(executor).step(["text"], ["a small cat sleeps"], TrainerStepConfig())  # blocking
        Model.from_trainer(trainer).encode(["text"], ["a small cat sleeps"])
    finally:
        trainer.close()
    assert len(seen) == 2
    training, serving = (_tensors(batch) for batch in seen)
    assert sorted(training) == sorted(serving)
    assert "image.values" in training and training["slot_valid"].all()
    for name, t in training.items():
        assert t.dtype == serving[name].dtype and torch.equal(t, serving[name]), name
    assert seen[0].mask.kind == seen[1].mask.kind == "dense"


def _host(config: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    resolved = resolve(config)
    texts = [b"a small cat sleeps", b"the red bus stops", b"rain on a window"]
    batch = prepare(resolved, [Modality.Text] * 3, texts, bags=None, groups=None, sides=None, relations=None, step=1)
    return resolved, batch.host_tensors(False)


def test_a_name_that_is_no_batch_tensor_is_refused() -> None:
    config, host = _host(make_config())
    network = Network(config)
    host["positons"] = host.pop("positions")
    with pytest.raises(ValueError, match="'positons' is not a batch tensor's name"):
        to_device(host, torch.device("cpu"), network.rotary, attention="dense", dtype=torch.float32, dynamic=False)


def test_the_typed_batch_traces_as_one_graph() -> None:
    """`Network.losses` over a `DeviceBatch` (media units marked dynamic, as on CUDA) compiles with no graph
    break (fullgraph) and answers the eager terms bitwise: nothing branches in Python on a tensor value."""
    config, host = _host(
        make_config(
            batch=BatchShape(
                max_rows_per_device=2, max_segments_per_device=4, max_columns_per_row=64, image=ImageShape(patch_side=8)
            )
        )
    )
    network = Network(config)
    network.initialize(config.seed)
    inputs = to_device(host, torch.device("cpu"), network.rotary, attention="dense", dtype=torch.float32, dynamic=True)
    eager = network.losses(inputs)
    compiled = torch.compile(network.losses, backend="aot_eager", dynamic=False, fullgraph=True)(inputs)
    assert sorted(compiled.terms) == sorted(eager.terms)
    for name, term in eager.terms.items():
        assert torch.equal(compiled.terms[name].sum, term.sum), name
        assert torch.equal(compiled.terms[name].count, term.count), name
    assert torch.equal(compiled.embeddings, eager.embeddings)
