"""The trainer: one run's network, optimizer and step counter on its executor, and its verbs.

A step goes: check every argument (nothing changes if one is refused) -> prepare the host arrays
(`host.py`: decode the media, then `data/batch.py`: pack, corrupt, pair; in a host process of the trainer's
own on CUDA, on the trainer's host threads on the CPU) -> copy them to the device -> forward and losses (compiled on
CUDA, with FlexAttention document masks and bf16 autocast) -> backward -> AdamW at the scheduled rate, whole
or not at all (`_update`: a step whose loss or gradients are not finite anywhere in the world is skipped on
every process and counted) -> stats and the arena. The blocking and the deferred receivers queue onto one
worker thread per trainer, so steps and saves apply in the order they were called.

On an executor of several devices `Trainer.init_vram` answers a `FleetTrainer` (at the end of this file): this
process routes each step to the devices' worker processes (`uform.runtime.workers`), each of which runs a `Trainer` of its
own device as one rank of the mesh.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from .arena import Arena
from .config import (
    TrainerInitVramConfig,
    TrainerSaveConfig,
    TrainerStepConfig,
    TrainerStepStats,
    resolve,
    to_dict,
    to_json,
)
from .data.batch import MEDIA_KINDS, Batch, media_features
from .data.items import ChoiceTapes, parse_choices, parse_contents, parse_modalities, parse_sides, per_item_integers
from .enums import LateInteractionSide, Modality, Objective, Scalar
from .losses.peers import Peers
from .losses.term import Term, world_counts
from .media.decode import MediaPolicy, warn_skipped
from .media.units import Units
from .model.attention import compiled_flex_available
from .model.inputs import DeviceBatch, to_device
from .model.network import Losses, Network
from .notices import MediaWarning as MediaWarning  # re-exported: where callers met it first
from .notices import NonFiniteWarning, Notices, ScheduleWarning
from .relations import check_relations, edge_limit, first_crossing, restrict
from .replica.capacity import warn_step_capacity
from .replica.checkpoint import ProgressCallback, write_checkpoint
from .replica.memory import check_memory
from .replica.optim import LATE, Optimizer, build_optimizer, learning_rate, nonfinite, rate_overflows, reach
from .replica.stored_run import FORMAT, RNG_DRAWS, StoredRun, read_run_tensors, read_stored_run
from .runtime.decoders import DecodePool
from .runtime.executor import Executor
from .runtime.mesh import Mesh, MeshOptions
from .runtime.preparers import HostJob, HostProcesses, decode_media, host_stage
from .runtime.workers import (
    attach_segment,
    choice_share,
    first_failure,
    item_sizes,
    merge_answers,
    release_segments,
    route,
    share_items,
)
from .runtime.world import GradientReducer, MeshError, World, WorldAborted, reduction_order, wait_event

WORLD_COMPILES = ("whole", "blocks")
"""How a world's step may compile on CUDA (`Trainer.init_vram`'s `world_compile`)."""


@dataclass
class _Checked:
    """A step's arguments after every check, owned by the trainer (copies of the caller's buffers)."""

    modalities: list[Modality]
    contents: list[bytes | memoryview]
    bags: np.ndarray | None
    groups: np.ndarray | None
    sides: list[LateInteractionSide] | None
    choices: ChoiceTapes | None
    relations: Any
    arena: Arena | None
    scalar: Scalar
    stats: TrainerStepStats | None
    origin: np.ndarray | None = None  # [N] the caller's index of each item, where a fleet split the step


class Trainer:
    """A training run on one executor; make it with `Trainer.init_vram`."""

    def __init__(
        self,
        executor: Executor,
        config: TrainerInitVramConfig,
        *,
        host_processes: int = 0,
        world_compile: str = "whole",
        _token: object = None,
    ) -> None:
        if _token is not _PRIVATE:
            raise TypeError("Trainer: make one with Trainer.init_vram(executor, config)")
        self.executor = executor
        self.config = config
        self.device = executor.device
        self.network = Network(config)
        self._parts: dict[str, list[torch.nn.Parameter]] = {}
        """The parameters of each part only some steps reach (`optim.reach`), found once: `_unreached` runs every step."""
        for name, p in self.network.named_parameters():
            if (part := reach(name)) is not None:
                self._parts.setdefault(part, []).append(p)
        self.mesh = config.mesh
        self.world: World | None = None if config.mesh is None else config.mesh.world
        self.closed = False
        self._reducer: GradientReducer | None = None
        self.optimizer: Optimizer
        self._step_count = 0
        """Updates applied, across resumes (`steps_taken`); where the device decides a skip, as far as read."""
        self._calls = 0
        """The number of the last step whose device stage ran, applied or skipped (the draws' key)."""
        self._nonfinite_total = 0
        """Steps skipped as non-finite, across resumes (as far as read)."""
        self._skips: list[int] = []
        """The numbers of the skipped steps no step's stats have reported yet."""
        self._pending: deque[tuple[int, torch.Tensor, Any]] = deque()
        """CUDA: (step, host flag, event) of the steps whose skip only the device knows yet, oldest first."""
        self._torn = ""
        """Why an update failed part-way (then every later step and save refuses)."""
        self._counting = threading.Lock()
        self._dropped = 0
        self._skipped = 0
        self.media = MediaPolicy()
        self.notices = Notices()
        """The run's warnings (skipped media, items cut or dropped for room, steps past the schedule, steps
        skipped as non-finite), each kind shown once and counted: `notices.counts()`."""
        self._decoders: DecodePool | None = None
        self.host_processes = host_processes
        """Host processes that prepare the steps (`uform.runtime.preparers`); 0: the host stage runs on this process's threads."""
        self._hosts: HostProcesses | None = None
        # Two stages: the host stage packs and corrupts step n + 1 while the device stage runs step n, so the
        # GPU never waits on Python (the draws are keyed by the step number, which is fixed when the step is
        # called, so preparing ahead changes nothing). The host stage has two threads: while one waits for its
        # step's media in the decode pool, the other packs the step before (with 128 JPEGs beside text at the
        # reference geometry each half is about as long as the other; bench/data_wait.py). With host processes the
        # threads only send each step to a host process and copy its answer (each process prepares two at once).
        # Every thread of the trainer starts on the trainer's device: CUDA's current device is per thread
        # and a new thread's is device 0, so on any other device an event recorded or a stream read there
        # would be device 0's (2-GPU profile: rank 1's completion events and gradient flags were read off
        # device 0, the flags "changed" and every step synchronised, 67% weak scaling).
        device = (self.device,)
        self._queue = ThreadPoolExecutor(1, "uform-device", initializer=_bind_device, initargs=device)
        self._host = ThreadPoolExecutor(
            max(2, 2 * host_processes), "uform-host", initializer=_bind_device, initargs=device
        )
        self._completion = ThreadPoolExecutor(1, "uform-completion", initializer=_bind_device, initargs=device)
        self._lock = threading.Lock()
        self._next_step = 1
        self._reported = 0  # the last step whose stats were read (the skips reported are those after it)
        self._resolving = threading.Lock()
        cuda = self.device.type == "cuda"
        self.attention = "flex" if compiled_flex_available(self.device) else "dense"
        self._losses: Callable[..., Losses] = self.network.losses
        self.world_compile = world_compile
        """How a world's step compiles on CUDA (`Trainer.init_vram`)."""
        if cuda and self.world is not None and self.world.size > 1 and world_compile == "blocks":
            # 'blocks': each block compiled on its own (one graph, reused by every block), so backward
            # finishes the blocks' gradients one block at a time and the gradient buckets reduce while earlier
            # blocks still differentiate; the heads and losses compile as a graph of their own (broken around
            # the embedding gather); the embedding lookup and the loop over the blocks run eagerly. Not the
            # default: on one host's NVLink the whole step's all-reduce takes ~1 ms, less than what the eager
            # loop costs the host (2 x H200, reference geometry: 89.1% weak scaling against 95.9% for 'whole').
            for block in self.network.tower.blocks:
                block.compile(dynamic=False)
            self._losses = _split_step(self.network, torch.compile(self.network.heads, dynamic=False))
        elif cuda:
            self._losses = torch.compile(self.network.losses, dynamic=False)

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
    ) -> Trainer:
        """Builds the run on `executor`, from `config.seed` or resumed from `config.resume`.

        `media` bounds and reports the media items of every step (limits, strictness, decoding workers);
        the default skips a broken item with a warning and counts it in `TrainerStepStats.skipped`.

        `host_processes` says where each step's host stage runs (decode, pack, corrupt, pair; `uform.runtime.preparers`):
        0 on two threads of this process, N >= 1 in N processes of its own (started on the first step, each
        with its share of `media.workers` decoders), which leave this process only the device stage, so its
        interpreter lock is the device thread's. None (the default) is 1 on CUDA and 0 on the CPU (see
        `default_host_processes`).
        Where it runs changes no result: the batches, and so the training, are bitwise the same.

        `world_compile` says how the step of a world of several CUDA devices compiles: "whole" (the default)
        one graph, as one device alone compiles it, the gradients reduced after backward; "blocks" each tower
        block a graph of its own and the heads another, so the gradient buckets reduce while backward runs.
        On one host's NVLink the reduction is short and "whole" is faster (2 x H200: 95.9% weak scaling against
        89.1%, BENCHMARKS.md); "blocks" is for links slow enough that hiding the reduction pays. It changes
        nothing elsewhere (one device, the CPU).
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
        if executor.has_workers():
            return FleetTrainer.start(executor, config, media, host_processes, world_compile)
        world = None if config.mesh is None else config.mesh.world
        try:
            resolved, stored = resolve_run(config)
            check_memory(resolved, executor.device)  # before any allocation: refuses on CUDA, warns on the CPU
            # Digest verified, every tensor read (at most the file's own length) before anything is built.
            loaded = (
                None
                if stored is None
                else read_run_tensors(stored, resolved.progress, resolved.progress_steps, executor.device)
            )
            hosts = default_host_processes(executor) if host_processes is None else host_processes
            trainer = cls(executor, resolved, host_processes=hosts, world_compile=world_compile, _token=_PRIVATE)
            trainer.media = media
            trainer.network.initialize(resolved.seed)
            trainer.network.to(trainer.device)
            trainer.optimizer = build_optimizer(trainer.network, trainer.device)
            if stored is not None and loaded is not None:
                trainer._resume(stored, loaded)
        except BaseException:
            if world is not None:  # the others wait to compare runs: tell them this process has none
                with contextlib.suppress(Exception):
                    _compare_runs(world, None, 0)
            raise
        if trainer.world is not None:
            trainer._join_world()
        return trainer

    def _join_world(self) -> None:
        """Every process of the run checks that it builds the same run (a digest of the resolved config and
        the step it starts from, all-gathered), then borrows the mesh and arms the gradient reduction."""
        world = self.world
        assert world is not None and self.mesh is not None
        record = to_dict(self.config)
        record.pop("progress_steps", None)  # how often this process reports is its own business
        try:
            _compare_runs(world, json.dumps(record, sort_keys=True), self._step_count)
        except BaseException:
            self.close()
            raise
        self.mesh._borrow(self)
        if world.size > 1:
            variable = [p for params in self._parts.values() for p in params]
            self._reducer = GradientReducer([p for _, p in reduction_order(self.network)], world, variable=variable)

    def _resume(self, stored: StoredRun, tensors: dict[str, torch.Tensor]) -> None:
        # read_stored_run checked the names, dtypes and shapes against this network, read_run_tensors the digest.
        weights = {k.removeprefix("weights."): v for k, v in tensors.items() if k.startswith("weights.")}
        self.network.load_state_dict(weights, strict=True)
        fused = self.device.type == "cuda"
        for name, p in self.network.named_parameters():
            if f"moments.exp_avg.{name}" in tensors:
                step = tensors[f"moments.step.{name}"]
                self.optimizer.state[p] = {
                    "step": step.to(self.device if fused else "cpu", torch.float32),
                    "exp_avg": tensors[f"moments.exp_avg.{name}"].clone(),
                    "exp_avg_sq": tensors[f"moments.exp_avg_sq.{name}"].clone(),
                }
        self._step_count = stored.step
        self._nonfinite_total = stored.nonfinite
        self._calls = self._reported = self._step_count + self._nonfinite_total
        self._next_step = self._calls + 1
        self._dropped = stored.dropped
        self._skipped = stored.skipped

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

    def save(self, config: Any) -> None:
        """Writes a checkpoint on the trainer's own executor, blocking; see `On.save`."""
        self.on(self.executor).save(config)

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied so far, across resumes (a step skipped as non-finite is not one)."""
        self._resolve(None)
        return self._step_count

    def close(self) -> None:
        """Waits for queued calls and stops the trainer's threads; a mesh it borrowed is free again. Later
        steps and saves are refused."""
        self.closed = True  # first, so that a call racing the shutdown is refused by name, not by the pool
        self._queue.shutdown(wait=True)
        self._host.shutdown(wait=True)
        self._completion.shutdown(wait=True)
        if self._hosts is not None:
            self._hosts.close()
        if self._decoders is not None:
            self._decoders.close()
        if self._reducer is not None:
            self._reducer.close()
        if self.mesh is not None:
            self.mesh._release(self)

    def _submit_step(self, checked: _Checked) -> Future:
        if self.world is not None and self.world.failed:
            # A broken world refuses at once, here rather than behind the device thread, which may still be
            # held by the failed step's device work while an NCCL abort lets go of it.
            refused: Future = Future()
            refused.set_running_or_notify_cancel()
            refused.set_exception(MeshError(self.world.failed[0]))
            return refused
        with self._lock:
            step = self._next_step
            self._next_step += 1
            host = self._host.submit(self._prepare, checked, step)
            done: Future = Future()
            done.set_running_or_notify_cancel()  # a queued step is not cancelled: its draws are numbered
            self._queue.submit(self._device_stage, checked, host, step, done)
        self._warn_past_schedule(step)  # in the caller's thread, where its warning filters apply
        return done

    def _check_executor(self, executor: Executor) -> None:
        if executor is not self.executor:
            raise ValueError(f"executor: this trainer runs on {self.executor}, not {executor}")

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(
                "trainer: this trainer was closed; make a new one with Trainer.init_vram (its resume goes on "
                "from a checkpoint)"
            )

    def _warn_past_schedule(self, step: int) -> None:
        """A step past schedule.steps runs at the floor rate: said once, every such step counted."""
        steps = self.config.schedule.steps
        if step > steps:
            self.notices.warn(
                "schedule",
                f"uform: step {step} is past schedule.steps ({steps}): it and every later step run at the floor "
                f"learning rate schedule.min_learning_rate ({self.config.schedule.min_learning_rate:g}); to go "
                "on along a cosine, resume with a larger schedule.steps",
                ScheduleWarning,
                stacklevel=4,
            )

    # ---- checks ------------------------------------------------------------------------------------

    def _check_step(
        self, modalities: Any, contents: Any, config: TrainerStepConfig | None, copy_buffers: bool
    ) -> _Checked:
        self._check_open()
        # In a world a process may have no items this step; it still takes its part in the collectives.
        alone = self.world is None or self.world.size == 1
        return check_step(self.config, modalities, contents, config, copy_buffers, allow_empty=not alone)

    # ---- the work ----------------------------------------------------------------------------------

    def _prepare(self, checked: _Checked, step: int, notify: bool = True) -> tuple[Batch, dict[str, torch.Tensor]]:
        """The host stage (`host.host_stage`: decode, pack, corrupt and pair, block tables), here or in a host
        process, then page-locked tensors for the copy; a media item that did not decode is warned about here."""
        job = HostJob(
            modalities=checked.modalities,
            contents=checked.contents,
            bags=checked.bags,
            groups=checked.groups,
            sides=checked.sides,
            choices=checked.choices,
            relations=checked.relations,
        )
        pin = self.device.type == "cuda"
        if self.host_processes:
            with self._lock:
                if self._hosts is None:
                    self._hosts = HostProcesses(self.host_processes, self.config, self.media, self.attention, pin)
            batch, host, failed = self._hosts.prepare(job, step)
        else:
            answer = host_stage(self.config, self.media, self.attention, self._decode_pool, job, step)
            batch, failed = answer.batch, answer.failed
            host = batch.host_tensors(pin, tables=answer.tables)
        if notify:  # once per step: not again where a renumbered step is prepared anew (`_apply_step`)
            warn_skipped(self.notices, failed, checked.modalities, "TrainerStepStats.skipped", checked.origin)
            warn_step_capacity(self.notices, batch, len(checked.modalities), self.config.batch.max_columns_per_row)
        return batch, host

    def _decode_pool(self) -> DecodePool:
        """This process's decoder pool (the in-process host stage's), started on first need."""
        with self._lock:
            if self._decoders is None:
                self._decoders = DecodePool(self.media.workers, self.media.limits.timeout_seconds)
            return self._decoders

    def _decode(self, checked: _Checked) -> tuple[dict[int, Units], list[tuple[int, str]]]:
        """Decodes the step's media items in this process's pool (the host stage's first half, for the benches);
        answers the units of those that decoded and (index, reason) of those that did not."""
        job = HostJob(modalities=checked.modalities, contents=checked.contents)
        return decode_media(self.config, self.media, self._decode_pool, job)

    def _device_stage(self, checked: _Checked, host: Future, step: int, done: Future) -> None:
        """Copy, forward, backward, update; the readback is left to the completion thread, so this
        thread goes on to launch the next step while the device still runs this one."""
        try:
            finish = self._apply_step(checked, host, step)
        except BaseException as error:
            with self._lock:  # the step was not taken: the numbers of later calls move back by one
                self._next_step -= 1
            done.set_exception(error)
            return
        self._completion.submit(_complete, finish, done)

    def _apply_step(self, checked: _Checked, host: Future, step: int) -> Callable[[], torch.Tensor | None]:
        r = self.config
        if self._torn:
            host.cancel()
            raise RuntimeError(self._torn)
        if step != self._calls + 1:  # an earlier queued step failed: its successors' draws move up
            ran = not host.cancel()  # a host stage that ran (or runs) has warned already
            step = self._calls + 1
            batch, tensors = self._prepare(checked, step, notify=not ran)
        else:
            batch, tensors = host.result()
        cuda = self.device.type == "cuda"
        dtype = torch.bfloat16 if cuda else torch.float32
        inputs = to_device(
            tensors, self.device, self.network.rotary, attention=self.attention, dtype=dtype, dynamic=cuda
        )
        rate = learning_rate(r.schedule, step)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        self.network.train()
        world = self.world if self.world is not None and self.world.size > 1 else None
        if world is not None and world.failed:
            raise MeshError(world.failed[0])
        try:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda):
                terms, embeddings = self._losses(inputs, world, batch.positives, batch.late_positives)
            if world is not None:  # every process divides its sums by the world's counts
                terms = _world_counts(terms, world)
            totals = self.network.total(terms)
            unreached = self._unreached(batch)
            if self._reducer is not None:
                self._reducer.arm(unreached)
            totals["loss"].backward()
            if self._reducer is not None:
                self._reducer.finish()  # the gradients of the world's loss, summed over its processes
            world_stats = None
            if world is not None:  # the world's means: each process's share, summed
                zero = totals["loss"].new_zeros(())
                world_stats = torch.stack([totals.get(k, zero).detach().float() for k in _STAT_TERMS])
                world.all_reduce(world_stats)
        except Exception as error:
            if world is not None:
                raise _broken(world, error, step) from error
            raise
        loss = totals["loss"] if world_stats is None else world_stats[0]  # the world's, where there is one
        skip = self._update(rate, loss, unreached)
        self._calls = step
        if isinstance(skip, bool):
            self._record(step, skip, rate)
        self._dropped += batch.dropped
        self._skipped += batch.skipped

        # Everything the caller reads lands in host buffers through asynchronous copies; `finish` waits
        # for them on the completion thread.
        readback: dict[str, torch.Tensor] = {}
        if checked.stats is not None:
            zero = totals["loss"].new_zeros(())
            readback["stats"] = (
                world_stats
                if world_stats is not None
                else torch.stack([totals.get(k, zero).detach().float() for k in _STAT_TERMS])
            )
            dropped, self._dropped = self._dropped, 0
            skipped, self._skipped = self._skipped, 0
            since, self._reported = self._reported, step  # this report counts the skips of steps (since, step]
        if not isinstance(skip, bool):  # the device decided: read on the completion thread, or by a save
            readback["skip"] = skip
        if checked.arena is not None:
            slot = torch.from_numpy(batch.layout.slot).to(self.device, non_blocking=True)
            present = slot >= 0
            readback["arena"] = embeddings.float()[slot.clamp_min(0)] * present.unsqueeze(1)
        host_copies = {k: _to_host(v) for k, v in readback.items()}
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        if "skip" in host_copies:
            with self._counting:
                self._pending.append((step, host_copies["skip"], event))

        def finish() -> torch.Tensor | None:
            if event is not None and world is not None:
                try:  # in a world, a peer that died leaves this event unfinished: a wait with a deadline
                    wait_event(event, world, f"step {step}'s device work")
                except WorldAborted as error:
                    raise _broken(world, error, step) from error
            elif event is not None:
                event.synchronize()
            self._resolve(step)
            if checked.stats is not None:
                stats = checked.stats
                for f in dataclasses.fields(TrainerStepStats):
                    setattr(stats, f.name, 0 if f.type == "int" else 0.0)
                for name, value in zip(_STAT_TERMS, host_copies["stats"].tolist(), strict=True):
                    setattr(stats, name, float(value))
                stats.step = step
                stats.learning_rate = rate
                stats.truncated = batch.truncated
                stats.dropped = dropped
                stats.skipped = skipped
                stats.nonfinite = self._reported_skips(since, step)
            if checked.arena is None:
                return None
            return checked.arena.land(host_copies["arena"], torch.from_numpy(batch.layout.slot >= 0), checked.scalar)

        return finish

    def _unreached(self, batch: Batch) -> list[torch.nn.Parameter]:
        """The parameters this process's step does not reach (`optim.reach`): the media modules of every kind
        the step holds no units of, and late interaction's head where the step holds no query or no document
        tokens. They run over inert padding only, so their gradients are exact zeros that must not move AdamW's
        decay or moments."""
        absent = {
            f"{part}.{kind}"
            for kind, parts in batch.media.items()
            if not parts["valid"].any()
            for part in ("media", "reconstruct")
        }
        if batch.late:
            slots, documents = batch.late["z"].shape  # padding: query_slot == S, document_of == Dd
            queries = (batch.late["query_slot"] < slots).any()
            if not (queries and (batch.late["document_of"] < documents).any()):
                absent.add(LATE)
        return [p for part in sorted(absent) for p in self._parts.get(part, ())]

    def _update(self, rate: float, loss: torch.Tensor, unreached: list[torch.nn.Parameter]) -> bool | torch.Tensor:
        """AdamW at `rate`, whole or not at all, then the gradients cleared whatever happened. The update is
        skipped when `rate` would carry it out of float32, or when `loss` (the world's, in a world) or a
        gradient (the world's sums, in a world: the same on every process, so every process decides alike
        with no collective of its own) is not finite. Parameters no process's gradient reached are left
        alone. Answers whether it was skipped: a bool where the host decides (the for-each AdamW of the CPU, or
        the rate), else the device's flag (the fused AdamW of CUDA: a 0-d float32 tensor its kernel read, which
        nothing here waits for)."""
        optimizer = self.optimizer
        try:
            if rate_overflows(rate):
                return True
            grads = [p.grad for p in self.network.parameters() if p.grad is not None]
            flag = nonfinite(grads, loss)
            fused = bool(optimizer.defaults.get("fused"))  # the fused kernel reads the flag itself
            if not fused and bool(flag):
                return True
            if self._reducer is None:  # (a world's reducer already dropped what no process used, or flags it)
                for p in unreached:
                    p.grad = None
            try:
                if not fused:
                    optimizer.step()
                    return False
                skips = [flag] * len(optimizer.param_groups)
                if self._reducer is not None:  # a media part no process used skips on its world flag
                    for g, group in enumerate(optimizer.param_groups):
                        if group["reach"] is not None:
                            unused = (self._reducer.used(group["params"][0]) == 0).float()
                            skips[g] = torch.maximum(flag, unused)
                optimizer.step_unless(skips)
                return flag
            except Exception as error:
                self._torn = (
                    f"trainer: an update failed part-way ({type(error).__name__}: {error}); the weights may hold "
                    "part of a step, so this trainer takes no more steps and saves none: init_vram with resume "
                    "continues the run from its last checkpoint"
                )
                raise RuntimeError(self._torn) from error
        finally:
            optimizer.zero_grad(set_to_none=True)

    def _record(self, step: int, skipped: bool, rate: float) -> None:
        """Counts step `step` as applied or skipped (and warns, once, of a skip)."""
        with self._counting:
            if skipped:
                self._nonfinite_total += 1
                self._skips.append(step)
            else:
                self._step_count += 1
        if not skipped:
            return
        if rate_overflows(rate):
            why = f"its learning rate {rate:g} would carry AdamW's update out of float32"
        else:
            why = "its loss or gradients were not finite somewhere in the world"
        self.notices.warn(
            "non-finite",
            f"uform: step {step} was skipped on every process: {why}. The weights, the optimizer's moments and "
            "steps_taken are as before it; every such step is counted in TrainerStepStats.nonfinite (this "
            "warning is shown once). Look for a huge loss weight, relation weight, inverse temperature or "
            "learning rate.",
            NonFiniteWarning,
        )

    def _resolve(self, upto: int | None) -> None:
        """Counts the steps up to `upto` (None: every one) whose skip only the device knew, in order, waiting
        for their device work (CUDA)."""
        with self._resolving:
            while True:
                with self._counting:
                    if not self._pending or (upto is not None and self._pending[0][0] > upto):
                        return
                    step, flag, event = self._pending.popleft()
                world = self.world if self.world is not None and self.world.size > 1 else None
                if event is not None and world is not None:
                    try:
                        wait_event(event, world, f"step {step}'s update")
                    except WorldAborted as error:
                        raise _broken(world, error, step) from error
                elif event is not None:  # (None: the CPU, whose flag was final when written)
                    event.synchronize()
                self._record(step, bool(flag.item()), 0.0)

    def _reported_skips(self, since: int, step: int) -> int:
        """The skipped steps in (since, step], taken off the list (each is reported once)."""
        with self._counting:
            mine = [s for s in self._skips if since < s <= step]
            self._skips = [s for s in self._skips if not since < s <= step]
        return len(mine)

    def _run_save(self, config: TrainerSaveConfig) -> None:
        if self.world is not None and self.world.aborted:
            # The abort may have cut a step's collectives short after its update was launched: the weights
            # may hold part of a step, so they are not written (the last checkpoint is the one to resume).
            raise MeshError(
                (self.world.failed or [f"mesh: the world failed ({self.world.aborted})"])[0]
                + "; this process's weights may hold part of a step, so it saves none"
            )
        if self._torn:
            raise RuntimeError(self._torn)
        self._resolve(None)
        if self.world is not None and self.world.rank != 0:
            return  # only the process of index zero writes; every process holds the same weights
        broken = [k for k, v in self.network.state_dict().items() if v.is_floating_point() and not v.isfinite().all()]
        if broken:
            raise ValueError(
                f"save: the weights {broken[:3]}{' and more' if len(broken) > 3 else ''} hold NaN or infinite "
                f"values; refusing to write {os.fsdecode(config.path)} (a checkpoint of them would serve NaN "
                "embeddings). The last checkpoint written is the one to resume from"
            )
        names = dict(self.network.named_parameters())
        tensors: dict[str, torch.Tensor] = {f"weights.{k}": v.detach() for k, v in self.network.state_dict().items()}
        for name, p in names.items():
            state = self.optimizer.state.get(p)
            if state:
                tensors[f"moments.step.{name}"] = torch.as_tensor(state["step"]).float().reshape(())
                tensors[f"moments.exp_avg.{name}"] = state["exp_avg"]
                tensors[f"moments.exp_avg_sq.{name}"] = state["exp_avg_sq"]
        metadata = {
            "uform.format": FORMAT,
            "uform.config": to_json(self.config),
            "uform.step": str(self._step_count),
            "uform.dropped": str(self._dropped),
            "uform.skipped": str(self._skipped),
            "uform.nonfinite": str(self._nonfinite_total),
            "uform.rng": json.dumps({"draws": RNG_DRAWS, "seed": self.config.seed}),
        }
        write_checkpoint(config.path, tensors, metadata, config.progress, config.progress_steps or 10)


def check_step(
    run: TrainerInitVramConfig,
    modalities: Any,
    contents: Any,
    config: TrainerStepConfig | None,
    copy_buffers: bool,
    *,
    allow_empty: bool = False,
    edge_factor: int = 1,
) -> _Checked:
    """Every check of a step's arguments against the run `run` (nothing changes when one fails); answers
    them owned by the trainer when `copy_buffers`. `edge_factor` devices share the step's edges."""
    config = TrainerStepConfig() if config is None else config
    if not isinstance(config, TrainerStepConfig):
        raise TypeError(f"config: expected a TrainerStepConfig, got {type(config).__name__}")
    mods = parse_modalities(modalities)
    items = parse_contents(contents, len(mods))
    live = media_features(run)
    for i, m in enumerate(mods):
        if m != Modality.Text and MEDIA_KINDS[m] not in live:
            slice_field = "chunk_samples" if m == Modality.Audio else "patch_side"
            raise ValueError(f"modalities[{i}]: {m} items are out of this run (its batch.{m}.{slice_field} is zero)")
    n = len(mods)
    if n == 0 and not allow_empty:
        raise ValueError("modalities: a step needs at least one item")
    bags = per_item_integers(config.bags, n, "bags", below=2**32)
    groups = per_item_integers(config.temperature_groups, n, "temperature_groups", run.contrastive.temperature_groups)
    sides = parse_sides(config.sides, n)
    choices = None
    if run.choices.weight > 0:  # read only where the run trains choices (always a copy)
        choices = parse_choices(config.choices, config.choice_targets, mods, run.batch.max_choices_per_item)
    if run.objective != Objective.Masked or run.late_interaction.weight > 0:  # late pairs resolve through them
        check_relations(config.relations, n, *edge_limit(run, edge_factor))
    if config.arena is not None and not isinstance(config.arena, Arena):
        raise TypeError(f"arena: expected an Arena, got {type(config.arena).__name__}")
    if config.stats is not None and not isinstance(config.stats, TrainerStepStats):
        raise TypeError(f"stats: expected a TrainerStepStats, got {type(config.stats).__name__}")
    scalar = Scalar.parse(config.outputs_scalar, "outputs_scalar")
    relations = config.relations
    if copy_buffers:
        items = [bytes(c) for c in items]
        relations = copy.deepcopy(relations)
    return _Checked(mods, items, bags, groups, sides, choices, relations, config.arena, scalar, config.stats)  # type: ignore[arg-type]


def default_host_processes(executor: Executor) -> int:
    """Host processes of a trainer that does not say (`Trainer.init_vram`): one on CUDA, none on the CPU.

    On CUDA the device thread needs the interpreter lock to launch kernels and the in-process host stage's
    Python holds it. Measured on the H200 machine (`python bench/data_wait.py --executor cuda --host-processes
    N`, 128 JPEGs beside 128 texts at the reference geometry, fed instantly 57.8 ms/step): 92.3 ms/step in
    process, 75.1 ms/step through one host process. On the CPU the device stage's kernels run without the
    lock and a process would only cost its start."""
    return 1 if executor.device.type == "cuda" else 0


def resolve_run(config: TrainerInitVramConfig) -> tuple[TrainerInitVramConfig, StoredRun | None]:
    """The resolved run of an init config (the stored run's, with what the caller set, on a resume alone),
    checked against the checkpoint it resumes, whose header is checked whole (`read_stored_run`); answers it
    and the stored run."""
    stored = None
    if config.resume is not None:
        stored = read_stored_run(config.resume)
        if config.depth == 0 and config.hidden == 0:  # resume alone: the stored run's config,
            config = _over_stored(config, stored.config)  # and what was set
    resolved = resolve(config)
    if stored is not None:
        _same_run(resolved, stored.config)
    return resolved, stored


def _compare_runs(world: World, text: str | None, step: int) -> None:
    """Every process of a world calls this in init_vram with its resolved run as JSON (None: this process
    could not build one) and the step it starts from; raises on every process when they differ."""
    digest = np.zeros(2, dtype=np.int64)
    if text is not None:
        digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:16], dtype=np.int64)
    mine = torch.tensor([int(text is not None), *digest.tolist(), step], dtype=torch.int64, device=world.device)
    try:
        every = world.all_gather(mine[None]).cpu().tolist()  # [W, 4]
        world.check()  # an NCCL world aborted while this process waited: `every` is not the others' rows
        texts: list[Any] = [None] * world.size
        if all(row[0] for row in every) and any(row[1:3] != every[0][1:3] for row in every):
            torch.distributed.all_gather_object(texts, text, group=world.group)
            world.check()
    except Exception as error:
        raise MeshError(f"mesh: the processes of the run could not compare their runs ({error})") from error
    if text is None:
        return
    failed = [rank for rank, row in enumerate(every) if not row[0]]
    if failed:
        raise MeshError(
            f"mesh: processes {failed} could not build the run (their init_vram raised; see their errors); "
            "every process of a run builds it, or none does"
        )
    for rank, row in enumerate(every):
        if row[1:3] != every[0][1:3]:
            field, ours, theirs = _first_difference(json.loads(texts[0]), json.loads(texts[rank]))
            raise ValueError(
                f"config: process {rank} builds another run than process 0: its {field} is {theirs!r}, "
                f"process 0's {ours!r}; every process of a run calls init_vram with the same geometry, "
                "objective, seed and schedule"
            )
    for rank, row in enumerate(every):
        if row[3] != every[0][3]:
            raise ValueError(
                f"resume: process {rank} starts at step {row[3]}, process 0 at step {every[0][3]}; every "
                "process of a run resumes the same checkpoint"
            )


def _bind_device(device: torch.device) -> None:
    """A thread's initializer: its CUDA current device becomes `device` (nothing to do off CUDA)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _split_step(network: Network, heads: Callable[..., Losses]) -> Callable[..., Losses]:
    """`network.losses` with the heads' part run by `heads` (a world's step: the tower eager around its
    separately compiled blocks)."""

    def losses(
        batch: DeviceBatch, world: Peers | None = None, positives: int | None = None, late_positives: int | None = None
    ) -> Losses:
        return heads(network.states(batch), batch, world, positives, late_positives)

    return losses


def _world_counts(terms: dict[str, Term], world: World) -> dict[str, Term]:
    """The terms with every count summed over the world (`losses.term.world_counts`: the counts told by
    their type, `Term.count`, never by a name)."""
    return world_counts(terms, world)


def _broken(world: World, error: BaseException, step: int) -> MeshError:
    """A step of the world failed mid-way: no process can know where the others stopped, so the world is
    done; this and every later step raise the same error."""
    message = (
        f"mesh: step {step} failed on process {world.rank} of {world.size}: a peer process stopped, stalled "
        f"past the {world.timeout:g} s deadline or failed ({type(error).__name__}: {error}); restart every "
        "process, and init_vram with resume continues the run from its last checkpoint"
    )
    world.failed.append(message)
    return MeshError(message)


def _check_mesh(mesh: Any, executor: Executor) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a Mesh, got {type(mesh).__name__}")
    if mesh.closed:
        raise ValueError("mesh: this mesh was closed")
    if mesh.executor is not executor:
        raise ValueError(f"mesh: it was made over {mesh.executor}, not this trainer's executor {executor}")


def _first_difference(ours: Any, theirs: Any, name: str = "") -> tuple[str, Any, Any]:
    """The first field (dotted) where two config records differ, with both values."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                return _first_difference(ours.get(key), theirs.get(key), f"{name}.{key}" if name else key)
    return name or "config", ours, theirs


_STAT_TERMS = (
    "loss",
    "contrastive_loss",
    "masked_text_loss",
    "masked_image_loss",
    "masked_video_loss",
    "masked_audio_loss",
    "late_interaction_loss",
    "choices_loss",
)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy into page-locked host memory (a plain reference on the CPU)."""
    if tensor.device.type == "cpu":
        return tensor.detach()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor.detach(), non_blocking=True)
    return host


def _complete(finish: Callable[[], Any], done: Future) -> None:
    try:
        done.set_result(finish())
    except BaseException as error:
        done.set_exception(error)


class On:
    """Blocking verbs of a trainer."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def step(self, modalities: Any, contents: Any, config: TrainerStepConfig | None = None) -> torch.Tensor | None:
        """Applies one optimizer step over the items; answers the arena's embeddings when one is named."""
        t = self.trainer
        checked = t._check_step(modalities, contents, config, copy_buffers=False)
        return t._submit_step(checked).result()

    def save(self, config: Any) -> None:
        """Writes the checkpoint; `config` is a path or a `TrainerSaveConfig`."""
        t = self.trainer
        t._check_open()
        return t._queue.submit(t._run_save, save_config(config)).result()


class Deferred:
    """Verbs that check their arguments, copy them, and answer a `Future` of the blocking verb's answer."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def step(self, modalities: Any, contents: Any, config: TrainerStepConfig | None = None) -> Future:
        t = self.trainer
        checked = t._check_step(modalities, contents, config, copy_buffers=True)
        return t._submit_step(checked)

    def save(self, config: Any) -> Future:
        t = self.trainer
        t._check_open()
        return t._queue.submit(t._run_save, save_config(config))


def save_config(config: Any) -> TrainerSaveConfig:
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


_RESUMABLE = {"progress_steps", "schedule"}
_NOT_STORED = {"resume", "mesh", "progress", "progress_steps"}


def _over_stored(given: TrainerInitVramConfig, stored: TrainerInitVramConfig) -> TrainerInitVramConfig:
    """The stored run's config with every field the caller set (left non-default) laid over it; `_same_run`
    then refuses whatever of that contradicts the stored run."""
    default = TrainerInitVramConfig()
    changes = {
        f.name: getattr(given, f.name)
        for f in dataclasses.fields(TrainerInitVramConfig)
        if f.name in _NOT_STORED or getattr(given, f.name) != getattr(default, f.name)
    }
    return dataclasses.replace(stored, **changes)


def _same_run(config: TrainerInitVramConfig, stored: TrainerInitVramConfig) -> None:
    """A resume continues the stored run: every field but the schedule and progress must agree."""

    def compare(mine: Any, theirs: Any, name: str) -> None:
        if isinstance(mine, dict) and isinstance(theirs, dict):
            for key in sorted(set(mine) | set(theirs)):
                if not name and key in _RESUMABLE:
                    continue
                compare(mine.get(key), theirs.get(key), f"{name}.{key}" if name else key)
        elif mine != theirs:
            raise ValueError(
                f"{name}: the checkpoint's run has {theirs!r}, this config {mine!r}; "
                "a resume must keep the run's geometry, objective and seed"
            )

    compare(to_dict(config), to_dict(stored), "")


_PRIVATE = object()


# --------------------------------------------------------------------------------------------------
# A trainer over several devices: this process routes each step, each device's worker runs a Trainer


class FleetTrainer(Trainer):
    """A trainer over an executor of several devices: the same verbs, each device's replica in its worker.

    Made by `Trainer.init_vram` when its executor has several devices. It lives beside `Trainer` because each
    worker runs a `Trainer` of its own (`_worker_init`): the two are one layer, above the processes that carry
    their commands (`uform.runtime.workers`, whose docstring tells how a step travels).
    """

    def __init__(self, executor: Any, config: TrainerInitVramConfig, mesh: Any, owns_mesh: bool) -> None:
        # No replica here: Trainer.__init__ (a network, threads) is not for the calling process.
        self.executor = executor
        self.config = config
        self.mesh = mesh
        self._owns_mesh = owns_mesh
        self._fleet = executor.workers
        self._steps = 0
        self.closed = False
        self._lock = threading.Lock()
        self.notices = Notices()
        """The run's warnings, each kind shown once here and counted over every device (the workers hold
        theirs back and send them with each step's answer)."""

    @classmethod
    def start(
        cls,
        executor: Any,
        config: TrainerInitVramConfig,
        media: Any,
        host_processes: int | None = None,
        world_compile: str = "whole",
    ) -> Any:
        resolved, _stored = resolve_run(config)
        mesh, owns = config.mesh, False
        if mesh is None:  # this process alone: a world of its own devices
            mesh, owns = Mesh.bootstrap(executor, MeshOptions(job="local")), True
        fleet = executor.workers
        # The callback stays here (it need not pickle); every worker reads the checkpoint with a stand-in that
        # relays its reports, merged into one device's (see `uform.runtime.workers`'s docstring).
        shipped = dataclasses.replace(config, mesh=None, progress=None)
        relayed = config.progress is not None
        try:
            steps = fleet.everyone(
                _worker_init, (shipped, media, host_processes, world_compile, relayed), fleet.relay(config.progress)
            )
        except BaseException:
            with contextlib.suppress(BaseException):
                fleet.everyone(_worker_close_trainer)
            if owns:
                mesh.close()
            raise
        trainer = cls(executor, dataclasses.replace(resolved, mesh=config.mesh), mesh, owns)
        trainer._steps = steps[0]
        mesh._borrow(trainer)
        return trainer

    # ---- the verbs -----------------------------------------------------------------------------------

    def on(self, executor: Any) -> _FleetOn:  # type: ignore[override]
        self._check_executor(executor)
        return _FleetOn(self)

    def deferred(self, executor: Any) -> _FleetDeferred:  # type: ignore[override]
        self._check_executor(executor)
        return _FleetDeferred(self)

    @property
    def steps_taken(self) -> int:
        return self._steps

    def close(self) -> None:
        if self.closed:
            return
        with contextlib.suppress(BaseException):
            self._fleet.everyone(_worker_close_trainer)
        self.closed = True
        if self.mesh is not None:
            self.mesh._release(self)
            if self._owns_mesh:
                self.mesh.close()

    def _check_executor(self, executor: Any) -> None:
        if executor is not self.executor:
            raise ValueError(f"executor: this trainer runs on {self.executor}, not {executor}")

    # ---- steps -----------------------------------------------------------------------------------------

    def _submit(self, modalities: Any, contents: Any, config: TrainerStepConfig | None) -> Future:
        if self.closed:
            raise ValueError("trainer: it was closed")
        devices = len(self._fleet.devices)
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
                commands.append(
                    (
                        _worker_step,
                        {
                            **shared,
                            "modalities": [int(checked.modalities[i]) for i in items],
                            "bags": bags[items],
                            "groups": None if checked.groups is None else checked.groups[items],
                            "sides": None if checked.sides is None else [int(checked.sides[i]) for i in items],
                            "choices": None if checked.choices is None else choice_share(checked.choices, items),
                            "relations": relations,
                            "items": items,
                            "stats": checked.stats is not None,
                            "arena": checked.arena is not None,
                        },
                    )
                )
            futures = self._fleet.call(commands)
        except BaseException:
            release_segments(segments)
            raise
        done = merge_answers(futures, plan, count, checked, self._count, self.notices)
        done.add_done_callback(lambda _: release_segments(segments))
        return done

    def _count(self, steps: int) -> None:
        with self._lock:
            self._steps = steps

    def _save(self, config: Any) -> Future:
        if self.closed:
            raise ValueError("trainer: it was closed")
        saved = save_config(config)
        # Only the worker of rank 0 writes, so its reports are the ones relayed (the others make none).
        shipped = (dataclasses.replace(saved, progress=None), saved.progress is not None)
        relay = self._fleet.relay(saved.progress)
        futures = self._fleet.call([(_worker_save, shipped)] * len(self._fleet.devices), relay)
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


class _FleetOn(On):
    trainer: FleetTrainer

    def step(self, modalities: Any, contents: Any, config: TrainerStepConfig | None = None) -> torch.Tensor | None:
        return self.trainer._submit(modalities, contents, config).result()

    def save(self, config: Any) -> None:
        self.trainer._save(config).result()


class _FleetDeferred(Deferred):
    trainer: FleetTrainer

    def step(self, modalities: Any, contents: Any, config: TrainerStepConfig | None = None) -> Future:
        return self.trainer._submit(modalities, contents, config)

    def save(self, config: Any) -> Future:
        return self.trainer._save(config)


def _worker_init(state: dict[str, Any], device: torch.device, argument: Any, progress: ProgressCallback) -> int:
    """In a worker (a `uform.runtime.workers.Verb`): this device's trainer, a rank of the mesh the worker joined."""
    config, media, host_processes, world_compile, relayed = argument
    mesh = state["mesh"]
    if mesh is None:
        raise MeshError("mesh: this device's worker belongs to no world; bootstrap a mesh over the executor first")
    if state["trainer"] is not None:  # dropped before the new one is made: a failed init leaves none behind
        state["trainer"].close()
        state["trainer"] = None
    run = dataclasses.replace(config, mesh=mesh, progress=progress if relayed else None)
    trainer = Trainer.init_vram(
        mesh.executor, run, media=media, host_processes=host_processes, world_compile=world_compile
    )
    trainer.notices = Notices(relay=True)  # the user is in the calling process: warnings go there, once
    state["trainer"] = trainer
    return trainer.steps_taken


def _worker_close_trainer(state: dict[str, Any], device: torch.device, argument: Any, progress: Any) -> None:
    """In a worker: its trainer closes (the mesh stays)."""
    if state["trainer"] is not None:
        state["trainer"].close()
        state["trainer"] = None


def _worker_save(state: dict[str, Any], device: torch.device, argument: Any, progress: ProgressCallback) -> None:
    """In a worker: its trainer saves (only rank 0's writes)."""
    trainer = state["trainer"]
    if trainer is None:
        raise ValueError("trainer: none was made on this executor")
    config, relayed = argument
    trainer.save(dataclasses.replace(config, progress=progress if relayed else None))


def _worker_step(state: dict[str, Any], device: torch.device, argument: dict[str, Any], progress: Any) -> Future:
    """In a worker: submits the step to its trainer over the shared bytes (no copy); answers a future of the
    step's answer, resolved once the step is done (the next command need not wait for it)."""

    trainer: Trainer = state["trainer"]
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
        if trainer is None:
            raise ValueError("trainer: none was made on this executor")
        stats = TrainerStepStats() if argument["stats"] else None
        arena = Arena() if argument["arena"] else None
        config = TrainerStepConfig(
            bags=argument["bags"],
            temperature_groups=[] if argument["groups"] is None else argument["groups"],
            sides=[] if argument["sides"] is None else argument["sides"],
            choices=((), ()) if argument["choices"] is None else argument["choices"][:2],
            choice_targets=((), ()) if argument["choices"] is None else argument["choices"][2:],
            relations=argument["relations"],
            stats=stats,
            arena=arena,
        )
        checked = trainer._check_step(argument["modalities"], contents, config, copy_buffers=False)
        checked.origin = argument["items"]  # warnings name the caller's items
        future = trainer._submit_step(checked)
    except BaseException:
        release()
        raise
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            f.result()
            # The updates applied as far as this step (its answer resolved its skip): `steps_taken` would wait
            # for the device work of the steps queued behind it.
            steps = trainer._step_count
            value: dict[str, Any] = {"stats": None, "embeddings": None, "present": None, "steps": steps}
            value["notices"] = trainer.notices.drain()
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
