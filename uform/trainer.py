"""The trainer: one run on its executor, and its verbs.

`Trainer` is a façade over its backend: one `uform.replica.replica.Replica` in this process (an executor of one
device: the network, the optimizer and the step pipeline, whose module docstring tells how a step goes), or one
replica per device in the devices' worker processes (`uform.runtime.replicas.Replicas`, an executor of several
devices: this process checks and routes each step, each worker runs its device's replica as one rank of the
mesh). The verbs are the same either way: `on(executor)` answers the blocking ones, `deferred(executor)` those
that answer a `concurrent.futures.Future` at once; steps and saves apply in the order they were called.
`weights()` answers a copy of the network's weights from either backend (`Model.from_trainer` serves it).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch

from .config import TrainerInitVramConfig, TrainerSaveConfig, TrainerStepConfig, resolve
from .media.decode import MediaPolicy
from .model.network import Network
from .notices import MediaWarning as MediaWarning  # re-exported: where callers met it first
from .notices import Notices
from .replica.init_from import StartingWeights, plan_starting_weights
from .replica.optim import Optimizer
from .replica.replica import WORLD_COMPILES, Replica, Weights
from .replica.run_schema import data_slot
from .runtime.executor import Executor
from .runtime.mesh import Mesh
from .runtime.preparation import Preparation, default_host_processes
from .runtime.replicas import Replicas
from .runtime.world import World

__all__ = ["WORLD_COMPILES", "Deferred", "On", "Trainer", "default_host_processes", "save_config"]


class Trainer:
    """A training run on one executor; make it with `Trainer.init_vram`."""

    def __init__(
        self,
        executor: Executor,
        backend: Replica | Replicas,
        media: MediaPolicy,
        mesh: Mesh | None,
        *,
        host_processes: int,
        world_compile: str,
        init_from: StartingWeights | None = None,
        _token: object = None,
    ) -> None:
        if _token is not _PRIVATE:
            raise TypeError("Trainer: make one with Trainer.init_vram(executor, config)")
        self.executor = executor
        self._backend = backend
        self.config: TrainerInitVramConfig = backend.config
        """The resolved run."""
        self.media = media
        """The media policy every step's items are decoded under."""
        self.mesh = mesh
        """The mesh the run's world is formed over (None: one device alone)."""
        self.host_processes = host_processes
        """Preparer processes that prepare each replica's steps (`uform.runtime.preparers`); 0: the prepare stage runs
        on each replica's threads."""
        self.world_compile = world_compile
        """How a world's step compiles on CUDA (`Trainer.init_vram`)."""
        self.init_from = init_from
        """Which weights the run took from another run's checkpoint (`StartingWeights.summary()` says it in a
        line); None where it started from its seed alone or resumed."""
        self.closed = False
        if mesh is not None:
            mesh.borrow(self)

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def init_vram(
        cls,
        executor: Executor,
        config: TrainerInitVramConfig,
        *,
        media: MediaPolicy | None = None,
        host_processes: int | None = None,
        world_compile: str = "whole",
        init_from: str | os.PathLike | None = None,
    ) -> Trainer:
        """Builds the run on `executor`, from `config.seed` or resumed from `config.resume`.

        `media` bounds and reports the media items of every step (limits, strictness, decoding workers);
        the default skips a broken item with a warning and counts it in `TrainerStepStats.skipped`.

        `host_processes` says where each step's prepare stage runs (decode, pack, corrupt, pair; `uform.runtime.preparers`):
        0 on two threads of this process, N >= 1 in N processes of its own (started on the first step, each
        with its share of `media.workers` decoders), which leave this process only the device stage, so its
        interpreter lock is the device thread's. None (the default) is 2 on CUDA for a run with a media modality,
        1 for text alone, and 0 on the CPU (see `default_host_processes`).
        Where it runs changes no result: the batches, and so the training, are bitwise the same.

        `world_compile` says how the step of a world of several CUDA devices compiles: "whole" (the default)
        one graph, as one device alone compiles it, the gradients reduced after backward; "blocks" each tower
        block a graph of its own and the heads another, so the gradient buckets reduce while backward runs.
        On one host's NVLink the reduction is short and "whole" is faster (2 x H200: 95.9% weak scaling against
        89.1%, BENCHMARKS.md); "blocks" is for links slow enough that hiding the reduction pays. It changes
        nothing elsewhere (one device, the CPU).

        `init_from` starts a new run from another run's checkpoint of the same depth and hidden: the run takes
        the other's tower, and its embeddings and heads where they exist on both sides with the same shapes
        (never its temperatures), at step zero with a fresh optimizer and its own schedule, objective and seed
        (`uform.replica.init_from`; `trainer.init_from` says what was taken). It is refused with `resume`,
        which continues a run instead of starting one.
        """
        media = MediaPolicy() if media is None else media
        if not isinstance(media, MediaPolicy):
            raise TypeError(f"media: expected a MediaPolicy, got {type(media).__name__}")
        if host_processes is not None and (isinstance(host_processes, bool) or not isinstance(host_processes, int)):
            raise TypeError(f"host_processes: expected None or an int, got {type(host_processes).__name__}")
        if host_processes is not None and host_processes < 0:
            raise ValueError(f"host_processes: must not be negative, got {host_processes}")
        if not isinstance(world_compile, str):
            raise TypeError(f"world_compile: expected 'whole' or 'blocks', got {type(world_compile).__name__}")
        if world_compile not in WORLD_COMPILES:
            raise ValueError(f"world_compile: expected 'whole' or 'blocks', got {world_compile!r}")
        if not isinstance(executor, Executor):
            raise TypeError(f"executor: expected an Executor, got {type(executor).__name__}")
        if not isinstance(config, TrainerInitVramConfig):
            raise TypeError(f"config: expected a TrainerInitVramConfig, got {type(config).__name__}")
        if config.mesh is not None:
            _check_mesh(config.mesh, executor)
        start = None
        if init_from is not None:
            if config.resume is not None:
                raise ValueError(
                    "init_from: a new run starts from another run's weights, and resume continues a run; give one"
                )
            start = plan_starting_weights(init_from, resolve(config))
        backend: Replica | Replicas
        if executor.has_workers():
            backend = Replicas.start(executor, config, media, host_processes, world_compile, start)
            mesh: Mesh | None = backend.mesh
            hosts = default_host_processes(executor, config) if host_processes is None else host_processes
        else:
            mesh = config.mesh
            hosts = default_host_processes(executor, config) if host_processes is None else host_processes
            stage = Preparation.factory(media, executor.device, hosts)
            world = None if mesh is None else mesh.world
            backend = Replica.build(
                executor.device,
                config,
                world,
                stage,
                host_processes=hosts,
                world_compile=world_compile,
                init_from=start,
            )
        return cls(
            executor,
            backend,
            media,
            mesh,
            host_processes=hosts,
            world_compile=world_compile,
            init_from=start,
            _token=_PRIVATE,
        )

    # ---- receivers ---------------------------------------------------------------------------------

    def on(self, executor: Executor) -> On:
        """The receiver whose verbs block until done."""
        self._check_executor(executor)
        return On(self)

    def deferred(self, executor: Executor) -> Deferred:
        """The receiver whose verbs answer a `concurrent.futures.Future` at once."""
        self._check_executor(executor)
        return Deferred(self)

    def step(self, modalities: Any, contents: Any, config: TrainerStepConfig | None = None) -> torch.Tensor | None:
        """One optimizer step on the trainer's own executor, blocking; see `On.step`."""
        return self.on(self.executor).step(modalities, contents, config)

    def save(self, config: Any, *, data_state: dict[str, Any] | None = None) -> None:
        """Writes a checkpoint on the trainer's own executor, blocking; see `On.save`."""
        self.on(self.executor).save(config, data_state=data_state)

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied so far, across resumes (a step skipped as non-finite is not one)."""
        return self._backend.steps_taken

    def weights(self) -> Weights:
        """A copy of the network's weights after every step called so far (`replica.Weights`: the resolved
        config, the steps applied and the state dict on the CPU), on any executor: an executor of several
        devices sends its first worker's (every rank holds the same weights) over the worker's pipe, checked
        against the network the config builds. `Weights.network(device)` builds a network of them."""
        self._check_open()
        return self._backend.weights().result()

    def close(self) -> None:
        """Waits for queued calls and stops the trainer's threads and processes; a mesh it borrowed is free
        again. Later steps and saves are refused."""
        self.closed = True  # first, so that a call racing the shutdown is refused by name
        self._backend.close()
        if self.mesh is not None:
            self.mesh.release(self)

    # ---- the replica of one device ---------------------------------------------------------------

    @property
    def replica(self) -> Replica:
        """The replica of a trainer of one device (its network, optimizer and step pipeline, in this process);
        refused for a trainer over several devices, whose replicas live in its workers (see `weights`)."""
        if not isinstance(self._backend, Replica):
            raise ValueError(
                f"trainer: its replicas live in the worker processes of {self.executor}; this process holds no "
                "network (trainer.weights() answers a copy of its weights)"
            )
        return self._backend

    @property
    def network(self) -> Network:
        """The live network of a trainer of one device (`replica`)."""
        return self.replica.network

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer of a trainer of one device (`replica`)."""
        return self.replica.optimizer

    @property
    def device(self) -> torch.device:
        """The executor's first device (the only one of an executor that runs in this process)."""
        return self.executor.device

    @property
    def world(self) -> World | None:
        """This process's world (None without a mesh), for a trainer of one device."""
        return self.replica.world

    @property
    def attention(self) -> str:
        """The attention path of a trainer of one device: "flex" (compiled FlexAttention) or "dense"."""
        return self.replica.attention

    @property
    def notices(self) -> Notices:
        """The run's warnings (skipped media, items cut or dropped for room, steps past the schedule, steps
        skipped as non-finite), each kind shown once and counted over every device: `notices.counts()`."""
        return self._backend.notices

    @notices.setter
    def notices(self, notices: Notices) -> None:
        self._backend.notices = notices

    # ---- checks ------------------------------------------------------------------------------------

    def _check_executor(self, executor: Executor) -> None:
        if executor is not self.executor:
            raise ValueError(f"executor: this trainer runs on {self.executor}, not {executor}")

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(
                "trainer: this trainer was closed; make a new one with Trainer.init_vram (its resume goes on "
                "from a checkpoint)"
            )

    def _submit(self, modalities: Any, contents: Any, config: TrainerStepConfig | None, copy_buffers: bool) -> Future:
        self._check_open()
        return self._backend.submit(modalities, contents, config, copy_buffers, caller_depth=2)  # _submit, On.step

    def _save(self, config: Any, data_state: dict[str, Any] | None) -> Future:
        self._check_open()
        checked = save_config(config)
        return self._backend.save(checked, None if data_state is None else data_slot(data_state))


class On:
    """Blocking verbs of a trainer."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def step(self, modalities: Any, contents: Any, config: TrainerStepConfig | None = None) -> torch.Tensor | None:
        """Applies one optimizer step over the items; answers the arena's embeddings when one is named."""
        return self.trainer._submit(modalities, contents, config, copy_buffers=False).result()

    def save(self, config: Any, *, data_state: dict[str, Any] | None = None) -> None:
        """Writes the checkpoint; `config` is a path or a `TrainerSaveConfig`. `data_state` (a JSON-able dict,
        such as `uform.sources.Loader.state()`) is stored beside the run (the checkpoint's `uform.data`, at most
        `run_schema.MAX_DATA_BYTES`), for `stored_run.read_data_state` to hand a resume."""
        self.trainer._save(config, data_state).result()


class Deferred:
    """Verbs that check their arguments, copy them, and answer a `Future` of the blocking verb's answer."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def step(self, modalities: Any, contents: Any, config: TrainerStepConfig | None = None) -> Future:
        return self.trainer._submit(modalities, contents, config, copy_buffers=True)

    def save(self, config: Any, *, data_state: dict[str, Any] | None = None) -> Future:
        return self.trainer._save(config, data_state)


def save_config(config: Any) -> TrainerSaveConfig:
    """A save's argument checked: a path or a `TrainerSaveConfig` (refused by name otherwise)."""
    if isinstance(config, TrainerSaveConfig):
        saved = config
    elif isinstance(config, (str, bytes, os.PathLike)):
        saved = TrainerSaveConfig(path=config)
    else:
        raise TypeError(f"path: expected a str, bytes, os.PathLike or TrainerSaveConfig, got {type(config).__name__}")
    if not isinstance(saved.path, (str, bytes, os.PathLike)):
        raise TypeError(f"path: expected a str, bytes or os.PathLike, got {type(saved.path).__name__}")
    try:
        encoded = os.fsencode(saved.path)
    except UnicodeEncodeError as error:
        raise ValueError(f"path: {saved.path!r} has no file-system encoding ({error.reason})") from None
    if b"\0" in encoded:
        raise ValueError(f"path: {saved.path!r} holds a NUL byte, which no file name may")
    if isinstance(saved.progress_steps, bool) or not isinstance(saved.progress_steps, int):
        raise TypeError(f"progress_steps: expected an int, got {type(saved.progress_steps).__name__}")
    if saved.progress_steps < 0:
        raise ValueError(f"progress_steps: must not be negative, got {saved.progress_steps}")
    if saved.progress is not None and not callable(saved.progress):
        raise TypeError(
            f"progress: expected None or a callable progress(done, total), got {type(saved.progress).__name__}"
        )
    return saved


def _check_mesh(mesh: Any, executor: Executor) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a Mesh, got {type(mesh).__name__}")
    if mesh.closed:
        raise ValueError("mesh: this mesh was closed")
    if mesh.executor is not executor:
        raise ValueError(f"mesh: it was made over {mesh.executor}, not this trainer's executor {executor}")


_PRIVATE = object()
