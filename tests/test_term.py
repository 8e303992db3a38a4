"""Loss terms as typed (sum, count) pairs (`uform.losses.term`): the world reduction sums exactly the counts,
told by their type whatever the terms are named, and anything else offered as a term is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import make_config

import uform.model.network as network_module
from uform import Modality
from uform.config import resolve
from uform.data.batch import prepare
from uform.losses.term import Term, world_counts
from uform.model.inputs import to_device
from uform.model.network import Network


class TwinWorld:
    """A world of two processes whose other process answers exactly what this one does (`Peers`): an
    all-reduce doubles, a gather repeats."""

    rank = 0
    size = 2

    def __init__(self) -> None:
        self.reduced: list[torch.Tensor] = []

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.reduced.append(tensor.clone())
        return tensor.mul_(2)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.detach(), x.detach()])

    def gather_with_grad(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x])


def test_the_world_sums_exactly_the_counts_whatever_the_terms_are_named() -> None:
    """Terms named without `_sum` (which the naming rule of before would have all-reduced as counts, sums
    and all): every count is the world's, every sum is this process's own, and one all-reduce carries the
    counts alone."""
    terms = {
        "agreement_total": Term(torch.tensor(7.0, requires_grad=True), torch.tensor(1.0)),
        "tokens": Term(torch.tensor(5.0), torch.tensor(4.0)),
        "masked_text": Term(torch.tensor(3.0), torch.tensor(2.0)),
    }
    world = TwinWorld()
    out = world_counts(terms, world)
    assert sorted(out) == sorted(terms)
    for name, term in terms.items():
        assert out[name].sum is term.sum, name  # the very tensor, its gradient kept
        assert float(out[name].count) == 2 * float(term.count), name
    assert len(world.reduced) == 1
    assert sorted(world.reduced[0].tolist()) == sorted(float(t.count) for t in terms.values())


def test_the_network_in_a_world_divides_its_sums_by_the_worlds_counts() -> None:
    """Through `Network.losses` and `Network.total` with the world as an argument: the per-term means are the
    process's sums over twice its counts (the twin's counts added), the pooled term scored against the
    gathered columns."""
    config = resolve(make_config())
    texts = [b"a small cat sleeps", b"the red bus stops", b"rain on a window"]
    batch = prepare(config, [Modality.Text] * 3, texts, bags=None, groups=None, sides=None, relations=None, step=1)
    network = Network(config)
    network.initialize(config.seed)
    inputs = to_device(
        batch.host_tensors(False),
        torch.device("cpu"),
        network.rotary,
        attention="dense",
        dtype=torch.float32,
        dynamic=False,
    )
    world = TwinWorld()
    terms, _ = network.losses(inputs, world)
    alone, _ = network.losses(inputs)
    assert torch.equal(terms["masked_text"].sum, alone["masked_text"].sum)
    # The anchors are this process's rows, alone or in the world.
    assert float(terms["contrastive"].count) == float(alone["contrastive"].count) > 0
    means = network.total(world_counts(terms, world))
    text = terms["masked_text"]
    assert float(text.count) > 0
    assert torch.equal(means["masked_text_loss"], text.sum / (2 * text.count).clamp_min(1))


def test_a_loss_that_answers_no_term_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss answering a bare (sum, count) tuple would leave the world reduction unable to tell its count:
    `Network.losses`, `world_counts` and `Network.total` each refuse it with a TypeError naming the term."""
    config = resolve(make_config())
    batch = prepare(
        config, [Modality.Text] * 2, [b"a cat", b"a bus"], bags=None, groups=None, sides=None, relations=None, step=1
    )
    network = Network(config)
    inputs = to_device(
        batch.host_tensors(False),
        torch.device("cpu"),
        network.rotary,
        attention="dense",
        dtype=torch.float32,
        dynamic=False,
    )
    masked_text_sum = network_module.masked_text_sum
    monkeypatch.setattr(network_module, "masked_text_sum", lambda *a: tuple(masked_text_sum(*a)))
    with pytest.raises(TypeError, match=r"loss term 'masked_text': expected a uform\.losses\.term\.Term"):
        network.losses(inputs)
    bare = {"masked_text": (torch.tensor(1.0), torch.tensor(2.0))}
    with pytest.raises(TypeError, match="loss term 'masked_text'"):
        world_counts(bare, TwinWorld())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loss term 'masked_text'"):
        network.total(bare)  # type: ignore[arg-type]
