"""Where a held-out evaluation runs (`uform.held_out`): on the replica of a trainer of one device, or split over
the device workers of a trainer of several (the fleet), each scoring its share with its own replica's network.

Shape legend: N items of a share, D hidden, T token vectors, W token width.

A job is what one evaluation computes, the same every time: the pooled embeddings of some items, the token
vectors of query-side and document-side items, the choices of some texts, and the masked terms of some
held-out steps. `answer_work` computes it on a replica's device thread (`Replica.queued`: after every step
called before, and with no step beside it), over a serving model of the replica's live network
(`Model.from_trainer` or `Model.from_replica`, made once; its media decoded once, `Model.keep_decoded`).

Over several devices, worker d takes the d-th contiguous part of each list of items and every D-th step. Its
share travels to it once, with the first evaluation (`_worker_held_out` keeps it, its checked steps and its
model in the worker's state), and later evaluations send only the job's key; the answers come back as arrays
and are put back in order here, so the figures are those one device computes (an item's embedding never
depends on its neighbours, and the terms are summed in step order).
"""

from __future__ import annotations

import contextlib
import itertools
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np
import torch

from .maxsim import maxsim_scores
from .media.decode import MediaPolicy
from .runtime.workers import first_failure
from .serve import Model

__all__ = ["FleetWork", "LocalWork", "Work", "answer_work"]

_KEYS = itertools.count()


class Work(Protocol):
    """One evaluation's job on a trainer, built once and run at every evaluation."""

    def run(self) -> dict[str, Any]:
        """{"pooled": [N, D] embeddings, "maxsim": [Q, M] scores (all late queries against all late
        documents, or None), "choose": each choice's probabilities, "terms": each step's {term: (sum, count)}}."""
        ...

    def close(self) -> None: ...


def answer_work(model: Model, replica: Any, job: dict[str, Any]) -> dict[str, Any]:
    """`job` computed with `model` (over `replica`'s live network) and `replica.held_out_terms`; run it on the
    replica's device thread. Tensors and tapes on the host."""
    out: dict[str, Any] = {}
    modalities, contents, sides = job["pooled"]
    hidden = model.hidden
    out["pooled"] = model.encode(modalities, contents, sides=sides) if modalities else torch.zeros(0, hidden)
    width = model.config.late_interaction.width
    empty = (torch.zeros(0, width), np.zeros(1, dtype=np.int64))
    out["tokens"] = [model.tokens(m, c, side) if m else empty for m, c, side in job["tokens"]]
    texts, legal = job["choose"]
    out["choose"] = []
    if texts:
        data, offsets = model.text_choose(texts, legal)
        out["choose"] = [data[a:b].astype(np.float64) for a, b in itertools.pairwise(offsets.tolist())]
    out["terms"] = [replica.held_out_terms(checked, key) for checked, key in job["steps"]]
    return out


def _maxsim(tokens: list[Any], device: torch.device) -> torch.Tensor | None:
    if not tokens:
        return None
    (q, q_offsets), (d, d_offsets) = tokens
    return maxsim_scores(q, q_offsets, d, d_offsets, device)


class LocalWork:
    """The job on the replica of a trainer of one device, in this process."""

    def __init__(self, trainer: Any, job: dict[str, Any], segments: int) -> None:
        self.replica = trainer.replica
        self.model = Model.from_trainer(trainer, segments=segments)
        self.model.keep_decoded = True
        steps = [(self.replica.check_step(m, c, config, False), key) for m, c, config, key in job["steps"]]
        self.job = {**job, "steps": steps}

    def run(self) -> dict[str, Any]:
        answers = self.replica.queued(lambda: answer_work(self.model, self.replica, self.job)).result()
        answers["maxsim"] = _maxsim(answers.pop("tokens"), self.model.device)
        return answers

    def close(self) -> None:
        self.model.close()


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    """`items` in `parts` contiguous runs of lengths that differ by one at most."""
    bounds = np.linspace(0, len(items), parts + 1).round().astype(int)
    return [items[a:b] for a, b in itertools.pairwise(bounds.tolist())]


def _share(job: dict[str, Any], d: int, devices: int) -> dict[str, Any]:
    """Device d's part of `job` (see the module's docstring)."""

    def part(triple: tuple[list, list, Any]) -> tuple[list, list, Any]:
        modalities, contents, sides = triple
        at = _split(list(range(len(modalities))), devices)[d]
        picked_sides = sides if not isinstance(sides, (list, tuple)) or not sides else [sides[i] for i in at]
        return [modalities[i] for i in at], [contents[i] for i in at], picked_sides

    texts, legal = job["choose"]
    at = _split(list(range(len(texts))), devices)[d]
    return {
        "pooled": part(job["pooled"]),
        "tokens": [part(t) for t in job["tokens"]],
        "choose": ([texts[i] for i in at], [legal[i] for i in at]),
        "steps": job["steps"][d::devices],
    }


class FleetWork:
    """The job split over the device workers of a trainer of several devices (see the module's docstring)."""

    def __init__(self, trainer: Any, job: dict[str, Any], segments: int) -> None:
        self.trainer = trainer
        self.workers = trainer.executor.workers
        self.devices = len(self.workers.devices)
        self.key = f"held-out-{next(_KEYS)}"
        self.media: MediaPolicy = trainer.media
        self.segments = segments
        self.steps = len(job["steps"])
        self._shares: list[dict[str, Any]] | None = [_share(job, d, self.devices) for d in range(self.devices)]

    def run(self) -> dict[str, Any]:
        shares: list[dict[str, Any] | None] = [None] * self.devices
        if self._shares is not None:
            shares = list(self._shares)
        futures = self.workers.call(
            [(_worker_held_out, (self.key, self.media, self.segments, share)) for share in shares]
        )
        for f in futures:
            with contextlib.suppress(BaseException):
                f.result()
        failure = first_failure(futures)
        if failure is not None:
            raise failure
        self._shares = None  # sent: the workers keep them
        answers = [f.result() for f in futures]
        for answer in answers:
            self.trainer.notices.replay(answer["notices"])
        out: dict[str, Any] = {
            "pooled": torch.cat([torch.from_numpy(a["pooled"]) for a in answers]),
            "choose": [p for a in answers for p in a["choose"]],
            "terms": [None] * self.steps,
        }
        for d, answer in enumerate(answers):
            out["terms"][d :: self.devices] = answer["terms"]
        sides = [[a["tokens"][k] for a in answers] for k in range(len(answers[0]["tokens"]))]
        out["maxsim"] = _maxsim([_joined(tapes) for tapes in sides], torch.device("cpu"))
        return out

    def close(self) -> None:
        """The workers drop this job's shares and models."""
        if self._shares is None:
            futures = self.workers.call([(_worker_drop, self.key)] * self.devices)
            for f in futures:
                with contextlib.suppress(BaseException):
                    f.result()
        self._shares = None


def _joined(tapes: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, np.ndarray]:
    """One (data [T, W], offsets) tape of the devices' tapes, in device order."""
    data = torch.cat([torch.from_numpy(t[0]) for t in tapes])
    counts = np.concatenate([np.diff(t[1]) for t in tapes])
    return data, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


# --------------------------------------------------------------------------------------------------
# The verbs each device's worker runs (`uform.runtime.workers.Verb`)


def _worker_held_out(state: dict[str, Any], device: torch.device, argument: Any, progress: Any) -> Future:
    """This device's share of an evaluation (kept from the first call), queued after the steps before it;
    answers a future of its arrays."""
    key, media, segments, share = argument
    replica = state["trainer"]
    if replica is None:
        raise ValueError("trainer: none was made on this executor")
    kept = state.setdefault("held_out", {})
    if share is not None:
        model = Model.from_replica(replica, media, segments=segments)
        model.keep_decoded = True
        steps = [(replica.check_step(m, c, config, True), k) for m, c, config, k in share["steps"]]
        kept[key] = (replica, model, {**share, "steps": steps})
    if key not in kept:
        raise ValueError(f"held out: this worker keeps no share of evaluation {key!r}")
    owner, model, job = kept[key]
    if owner is not replica:
        raise ValueError("held out: this worker's trainer is not the one the evaluation was built for")
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            value = f.result()
            out.set_result(
                {
                    "pooled": value["pooled"].float().numpy(),
                    "tokens": [(t[0].float().numpy(), t[1]) for t in value["tokens"]],
                    "choose": value["choose"],
                    "terms": value["terms"],
                    "notices": replica.notices.drain(),
                }
            )
        except BaseException as error:
            out.set_exception(error)

    replica.queued(lambda: answer_work(model, replica, job)).add_done_callback(done)
    return out


def _worker_drop(state: dict[str, Any], device: torch.device, argument: Any, progress: Any) -> None:
    """The worker lets go of evaluation `argument`'s share and model."""
    kept = state.get("held_out", {})
    entry = kept.pop(argument, None)
    if entry is not None:
        entry[1].close()
