"""One replica per device, each in its device's worker process: the backend of a trainer over an executor of
several devices (`Trainer.init_vram` makes it; `uform.runtime.workers` carries its commands and tells how a step
travels).

This process keeps no replica. A step is checked here once, whole (`checked_step.check_step`, with the limits a
split step must keep: a bag on one device, each device's edges within the run's limit), routed to the devices by
bag, each device's item bytes copied once into a shared-memory segment, and each worker handed its share as a
`CheckedStep` of the checked values, which its replica takes as it is (`Replica.submit_checked`: nothing is
rebuilt or checked again there). The verbs each worker runs (`_worker_init`, `_worker_step`, `_worker_save`,
`_worker_weights`, `_worker_close`) are at the end of this file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from concurrent.futures import Future
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from ..config import TrainerInitVramConfig, TrainerSaveConfig, TrainerStepConfig
from ..data.items import ChoiceTapes
from ..enums import Objective, Scalar
from ..media.decode import MediaPolicy
from ..model.network import Network
from ..notices import Notices
from ..relations import edge_limit, first_crossing, restrict
from ..replica.checked_step import CheckedStep, check_step
from ..replica.checkpoint import ProgressCallback
from ..replica.init_from import StartingWeights
from ..replica.replica import Replica, Weights
from ..replica.stored_run import resolve_run
from .executor import Executor
from .mesh import Mesh, MeshOptions
from .preparation import Preparation, default_host_processes
from .workers import (
    attach_segment,
    choice_share,
    first_failure,
    item_sizes,
    merge_answers,
    release_segments,
    route,
    share_items,
)
from .world import MeshError

__all__ = ["Replicas"]


class Replicas:
    """A run's replicas over an executor of several devices, one in each device's worker; make it with
    `Replicas.start`. The same verbs as one `Replica`'s, each answering a `Future`."""

    def __init__(
        self, executor: Executor, config: TrainerInitVramConfig, mesh: Mesh, owns_mesh: bool, steps: int
    ) -> None:
        self.executor = executor
        self.config = config
        """The resolved run (with the caller's mesh)."""
        self.mesh = mesh
        """The mesh the workers form (the caller's, or one of this executor's own)."""
        self._owns_mesh = owns_mesh
        self._workers = executor.workers
        self._steps = steps
        self.closed = False
        self._lock = threading.Lock()
        self.notices = Notices()
        """The run's warnings, each kind shown once here and counted over every device (the workers hold
        theirs back and send them with each step's answer)."""

    @classmethod
    def start(
        cls,
        executor: Executor,
        config: TrainerInitVramConfig,
        media: MediaPolicy,
        host_processes: int | None = None,
        world_compile: str = "whole",
        init_from: StartingWeights | None = None,
    ) -> Replicas:
        """Builds the run's replica in every worker of `executor` (arguments checked by `Trainer.init_vram`);
        without a mesh in `config`, the workers form one of their own, closed with these replicas."""
        resolved, _stored = resolve_run(config)
        mesh, owns = config.mesh, False
        if mesh is None:  # this process alone: a world of its own devices
            mesh, owns = Mesh.bootstrap(executor, MeshOptions(job="local")), True
        workers = executor.workers
        # The callback stays here (it need not pickle); every worker reads the checkpoint with a stand-in that
        # relays its reports, merged into one device's (see `uform.runtime.workers`'s docstring).
        shipped = dataclasses.replace(config, mesh=None, progress=None)
        relayed = config.progress is not None
        try:
            steps = workers.everyone(
                _worker_init,
                (shipped, media, host_processes, world_compile, relayed, init_from),
                workers.relay(config.progress),
            )
        except BaseException:
            with contextlib.suppress(BaseException):
                workers.everyone(_worker_close)
            if owns:
                mesh.close()
            raise
        return cls(executor, dataclasses.replace(resolved, mesh=config.mesh), mesh, owns, steps[0])

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied, as of the last step answered (every worker takes the same)."""
        return self._steps

    def close(self) -> None:
        """Closes every worker's replica (the workers stay, and so does a mesh the caller made); a mesh of
        this executor's own closes too."""
        if self.closed:
            return
        with contextlib.suppress(BaseException):
            self._workers.everyone(_worker_close)
        self.closed = True
        if self._owns_mesh:
            self.mesh.close()

    # ---- steps -----------------------------------------------------------------------------------------

    def submit(
        self,
        modalities: Any,
        contents: Any,
        config: TrainerStepConfig | None,
        copy_buffers: bool,
        *,
        caller_depth: int = 1,
    ) -> Future:
        """Checks the step once, whole, then sends each device its checked share; answers a `Future` of the
        merged answer. The items' bytes are copied into shared memory here, so `copy_buffers` needs no copy
        of its own (nor `caller_depth` a use: the workers' warnings are replayed here, on the reader's thread)."""
        if self.closed:
            raise ValueError("trainer: it was closed")
        devices = len(self._workers.devices)
        checked = check_step(self.config, modalities, contents, config, False, edge_factor=devices)
        count = len(checked.modalities)
        bags = checked.bags if checked.bags is not None else np.arange(count)
        if self.config.objective != Objective.Masked:
            crossing = first_crossing(checked.relations, count, bags)
            if crossing is not None:
                name, i, j = crossing
                raise ValueError(
                    f"relations.{name}: items {i} and {j} are in different bags; on an executor of several "
                    "devices an edge joins items of one bag (a bag is what lands on one device)"
                )
        sizes = item_sizes(checked.modalities, checked.contents, self.config.batch.max_columns_per_row)
        plan = route(sizes, bags, devices)
        limit, words = edge_limit(self.config)
        shares = [restrict(checked.relations, items, count) for items in plan]
        if self.config.objective != Objective.Masked:
            for d, relations in enumerate(shares):
                for name in ("attract", "repel", "ignore"):
                    edges = len(getattr(relations, name).ids)
                    if edges > limit:
                        raise ValueError(
                            f"relations.{name}: device {d} takes {edges} edges of the step, more than {words}"
                        )
        segments: list[shared_memory.SharedMemory] = []
        commands = []
        try:
            for items, relations in zip(plan, shares, strict=True):
                shared = share_items(segments, checked.contents, items)
                share = _share(checked, items, bags, relations)
                commands.append((_worker_step, {**shared, "checked": share}))
            futures = self._workers.call(commands)
        except BaseException:
            release_segments(segments)
            raise
        done = merge_answers(futures, plan, count, checked, self._count, self.notices)
        done.add_done_callback(lambda _: release_segments(segments))
        return done

    def _count(self, steps: int) -> None:
        with self._lock:
            self._steps = steps

    def save(self, config: TrainerSaveConfig, data: str | None = None) -> Future:
        """Every worker's replica saves (only rank 0's writes, `data` the data slot's text with it; its progress
        reports are the ones relayed)."""
        if self.closed:
            raise ValueError("trainer: it was closed")
        shipped = (dataclasses.replace(config, progress=None), config.progress is not None, data)
        relay = self._workers.relay(config.progress)
        futures = self._workers.call([(_worker_save, shipped)] * len(self._workers.devices), relay)
        done: Future = Future()
        done.set_running_or_notify_cancel()
        finished = threading.Lock()

        def all_done(_: Future) -> None:
            with finished:  # the last two workers may answer at once, on their readers
                if not all(f.done() for f in futures) or done.done():
                    return
                failure = first_failure(futures, relay)
                if failure is not None:
                    done.set_exception(failure)
                else:
                    done.set_result(None)

        for f in futures:
            f.add_done_callback(all_done)
        return done

    def weights(self) -> Future:
        """A `Future` of rank 0's `Weights` after every step called before it (every rank holds the same)."""
        if self.closed:
            raise ValueError("trainer: it was closed")
        (future,) = self._workers.call([(_worker_weights, None)])  # worker 0 is rank 0 of a mesh of its own devices
        out: Future = Future()
        out.set_running_or_notify_cancel()

        def landed(f: Future) -> None:
            try:
                out.set_result(_unpack_weights(self.config, f.result()))
            except BaseException as error:
                out.set_exception(error)

        future.add_done_callback(landed)
        return out


def _share(checked: CheckedStep, items: np.ndarray, bags: np.ndarray, relations: Any) -> CheckedStep:
    """Device's part of a checked step: the values of `items` (ascending), with `relations` restricted to them,
    no contents (they travel by shared memory) and a fresh arena and stats where the step has them (the worker
    fills its own, merged here)."""
    take = items.tolist()
    return CheckedStep(
        modalities=[checked.modalities[i] for i in take],
        contents=[],
        bags=bags[items],
        groups=None if checked.groups is None else checked.groups[items],
        sides=None if checked.sides is None else [checked.sides[i] for i in take],
        choices=None if checked.choices is None else ChoiceTapes(*choice_share(checked.choices, items)[:3]),
        relations=relations,
        arena=None if checked.arena is None else type(checked.arena)(),
        scalar=_WORKER_SCALAR,  # the worker's rows come back as they are; the caller lands them at its scalar
        stats=None if checked.stats is None else type(checked.stats)(),
        origin=items,
    )


_WORKER_SCALAR = Scalar.parse(TrainerStepConfig().outputs_scalar, "outputs_scalar")


def _pack_weights(weights: Weights) -> dict[str, Any]:
    """`Weights` as plain arrays for the pipe (bfloat16 has no numpy dtype: its bytes, and the dtype's name)."""
    tensors = {
        name: (str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy())
        for name, t in weights.tensors.items()
    }
    return {"step": weights.step, "tensors": tensors}


def _unpack_weights(config: TrainerInitVramConfig, packed: dict[str, Any]) -> Weights:
    """The `Weights` a worker packed, checked against the network `config` builds (names, dtypes, shapes)."""
    with torch.device("meta"):
        expected = {k: (v.dtype, tuple(v.shape)) for k, v in Network(config).state_dict().items()}
    tensors = {}
    for name, (dtype_name, shape, data) in packed["tensors"].items():
        dtype = getattr(torch, dtype_name)
        if name not in expected or expected[name] != (dtype, tuple(shape)):
            raise RuntimeError(f"weights: the worker's {name!r} ({dtype_name} {shape}) is not of this run's network")
        tensors[name] = torch.from_numpy(data.copy()).view(dtype).reshape(shape)
    if set(tensors) != set(expected):
        raise RuntimeError(f"weights: the worker sent {len(tensors)} tensors, the network has {len(expected)}")
    return Weights(dataclasses.replace(config, mesh=None), int(packed["step"]), tensors)


# --------------------------------------------------------------------------------------------------
# The verbs each device's worker runs (`uform.runtime.workers.Verb`): its replica, a rank of the mesh it joined


def _worker_init(state: dict[str, Any], device: torch.device, argument: Any, progress: ProgressCallback) -> int:
    """This device's replica, a rank of the mesh the worker joined; answers the steps it starts from."""
    config, media, host_processes, world_compile, relayed, init_from = argument
    mesh = state["mesh"]
    if mesh is None:
        raise MeshError("mesh: this device's worker belongs to no world; bootstrap a mesh over the executor first")
    if state["trainer"] is not None:  # dropped before the new one is made: a failed init leaves none behind
        _worker_close(state, device, None, progress)
    run = dataclasses.replace(config, mesh=mesh, progress=progress if relayed else None)
    executor = mesh.executor
    hosts = default_host_processes(executor, config) if host_processes is None else host_processes
    stage = Preparation.factory(media, executor.device, hosts)
    replica = Replica.build(
        executor.device, run, mesh.world, stage, host_processes=hosts, world_compile=world_compile, init_from=init_from
    )
    replica.notices = Notices(relay=True)  # the user is in the calling process: warnings go there, once
    mesh.borrow(replica)
    state["trainer"] = replica
    return replica.steps_taken


def _worker_close(state: dict[str, Any], device: torch.device, argument: Any, progress: Any) -> None:
    """Its replica closes (the mesh stays)."""
    replica = state["trainer"]
    if replica is not None:
        replica.close()
        state["mesh"].release(replica)
        state["trainer"] = None


def _worker_save(state: dict[str, Any], device: torch.device, argument: Any, progress: ProgressCallback) -> None:
    """Its replica saves (only rank 0's writes)."""
    replica = state["trainer"]
    if replica is None:
        raise ValueError("trainer: none was made on this executor")
    config, relayed, data = argument
    replica.save(dataclasses.replace(config, progress=progress if relayed else None), data).result()


def _worker_weights(state: dict[str, Any], device: torch.device, argument: Any, progress: Any) -> Future:
    """A future of its replica's weights, packed for the pipe, once the steps queued before are done."""
    replica = state["trainer"]
    if replica is None:
        raise ValueError("trainer: none was made on this executor")
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(_pack_weights(f.result()))
        except BaseException as error:
            out.set_exception(error)

    replica.weights().add_done_callback(done)
    return out


def _worker_step(state: dict[str, Any], device: torch.device, argument: dict[str, Any], progress: Any) -> Future:
    """Submits the step's checked share to its replica over the shared bytes (no copy, no check: the calling
    process checked the step); answers a future of the step's answer, resolved once the step is done (the
    next command need not wait for it)."""

    replica: Replica = state["trainer"]
    retired: list[shared_memory.SharedMemory] = state["retired"]
    for old in list(retired):  # segments of earlier steps, closed once nothing reads them any more
        with contextlib.suppress(BufferError):
            old.close()
            retired.remove(old)
    memory = attach_segment(argument["name"])
    offsets = argument["offsets"]
    view = memory.buf
    assert view is not None
    contents = [view[offsets[k] : offsets[k + 1]] for k in range(len(offsets) - 1)]

    def release() -> None:
        contents.clear()
        retired.append(memory)  # the calling process unlinks it; the mapping goes with its last view

    try:
        if replica is None:
            raise ValueError("trainer: none was made on this executor")
        replica.check_open()
        checked: CheckedStep = argument["checked"].with_contents(contents)
        future = replica.submit_checked(checked)
    except BaseException:
        release()
        raise
    out: Future = Future()
    stats, arena = checked.stats, checked.arena

    def done(f: Future) -> None:
        try:
            f.result()
            # The updates applied as far as this step (its answer resolved its skip): `steps_taken` would wait
            # for the device work of the steps queued behind it.
            value: dict[str, Any] = {"stats": None, "embeddings": None, "present": None, "steps": replica.steps_read}
            value["notices"] = replica.notices.drain()
            if stats is not None:
                value["stats"] = dataclasses.asdict(stats)
            if arena is not None and arena.embeddings is not None:
                value["embeddings"] = arena.embeddings.float().numpy()
                value["present"] = arena.present.numpy() if arena.present is not None else None
            release()
            out.set_result(value)
        except BaseException as error:
            release()
            out.set_exception(error)

    future.add_done_callback(done)
    return out
