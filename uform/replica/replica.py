"""One device's replica of a run: its network, optimizer and step counts (`ledger.StepLedger`), and the pipeline
of its steps.

A step goes: prepare the host arrays (the replica's `Stage`, given by the runtime: decode the media, then
`data/batch.py`: pack, corrupt, pair; on the replica's host threads or in preparer processes) -> copy them to the
device -> forward and losses (compiled on CUDA, with FlexAttention document masks and bf16 autocast) ->
backward -> AdamW at the scheduled rate, whole or not at all (`_update`: a step whose loss or gradients are not
finite anywhere in the world is skipped on every process and counted) -> stats and the arena. Steps and saves
queue onto one device thread per replica, so they apply in the order they were called.

A replica takes its steps already checked (`checked_step.check_step`, by whoever called: `check_step` here
for a trainer of one device, the calling process for a worker's share of a step over several devices). In a
world of several processes it is one rank: its world (`uform.runtime.world.World`, passed in, the one thing of the
runtime a replica uses) sums its gradients, counts and stats with the others'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..config import TrainerInitVramConfig, TrainerSaveConfig, TrainerStepConfig, TrainerStepStats, to_dict
from ..data.batch import Batch
from ..data.blocks import BLOCK
from ..losses.peers import Peers
from ..losses.term import Term, world_counts
from ..media.decode import warn_skipped
from ..media.units import Units
from ..model import cublaslt
from ..model.attention import compiled_flex_available, flex_block
from ..model.inputs import DeviceBatch, to_device, to_host
from ..model.network import Losses, Network
from ..notices import Notices, ScheduleWarning
from ..runtime.world import GradientReducer, MeshError, World, WorldAborted, reduction_order, wait_event
from .agreement import compare_runs
from .capacity import warn_step_capacity
from .checked_step import CheckedStep, check_step
from .checkpoint import write_checkpoint
from .init_from import StartingWeights, load_starting_weights
from .ledger import StepLedger
from .memory import check_memory
from .optim import LATE, Optimizer, build_optimizer, learning_rate, nonfinite, rate_overflows, reach
from .run_schema import restore_moments, run_metadata, run_tensors, stored_weights
from .stored_run import StoredRun, read_run_tensors, resolve_run

__all__ = ["WORLD_COMPILES", "Replica", "Stage", "Weights"]

WORLD_COMPILES = ("whole", "blocks")
"""How a world's step may compile on CUDA (`Trainer.init_vram`'s `world_compile`)."""


class Stage(Protocol):
    """Where a replica's prepare stage runs (the runtime gives one: `uform.runtime.preparation.Preparation`)."""

    def prepare(self, checked: CheckedStep, step: int) -> tuple[Batch, dict[str, torch.Tensor], list[tuple[int, str]]]:
        """Step `step`'s batch, its host tensors (page-locked on CUDA) and the media items that did not decode."""
        ...

    def decode(self, checked: CheckedStep) -> tuple[dict[int, Units], list[tuple[int, str]]]:
        """The step's media items decoded: the units of those that did, (index, reason) of those that did not."""
        ...

    def close(self) -> None:
        """Stops whatever processes it started."""
        ...


StageFactory = Callable[[TrainerInitVramConfig, int], Stage]
"""Makes a replica's stage from the resolved run and the side of the block tables its steps carry (the flex
attention path's; 0 for none, the dense path)."""


@dataclass(frozen=True)
class Weights:
    """A copy of a replica's network as it stood after every step called before it (rank 0's, in a world)."""

    config: TrainerInitVramConfig
    """The resolved run (the network it builds is `Network(config)`)."""
    step: int
    """Optimizer steps applied by then."""
    tensors: dict[str, torch.Tensor]
    """The network's state dict, on the CPU."""

    def network(self, device: torch.device) -> Network:
        """A network of these weights on `device`, in eval mode, no gradients (for serving)."""
        network = Network(self.config)
        network.load_state_dict(self.tensors, strict=True)
        network.requires_grad_(False)
        network.eval()
        return network.to(device)


class Replica:
    """One device's replica of a run; make one with `Replica.build` (a trainer does, or a device's worker)."""

    def __init__(
        self,
        device: torch.device,
        config: TrainerInitVramConfig,
        world: World | None,
        stage: StageFactory,
        *,
        host_processes: int = 0,
        world_compile: str = "whole",
        _token: object = None,
    ) -> None:
        if _token is not _PRIVATE:
            raise TypeError("Replica: make one with Replica.build(device, config, world, stage)")
        self.device = device
        self.config = config
        self.network = Network(config)
        self._parts: dict[str, list[torch.nn.Parameter]] = {}
        """The parameters of each part only some steps reach (`optim.reach`), found once: `_unreached` runs every step."""
        for name, p in self.network.named_parameters():
            if (part := reach(name)) is not None:
                self._parts.setdefault(part, []).append(p)
        self.world = world
        """This replica's world (None: it runs alone); its collectives sum what every rank's step adds up."""
        self.init_from: StartingWeights | None = None
        """The weights it took from another run's checkpoint at build (None: its seed's alone)."""
        self.closed = False
        self._reducer: GradientReducer | None = None
        self.optimizer: Optimizer
        self._calls = 0
        """The number of the last step whose device stage ran, applied or skipped (the draws' key)."""
        self._torn = ""
        """Why an update failed part-way (then every later step and save refuses)."""
        self._dropped = 0
        self._skipped = 0
        self.notices = Notices()
        """The run's warnings (skipped media, items cut or dropped for room, steps past the schedule, steps
        skipped as non-finite), each kind shown once and counted: `notices.counts()`."""
        self._ledger = StepLedger(self.notices)
        """Steps applied and skipped, across resumes, and the skips only the device knows yet."""
        self.host_processes = host_processes
        """Preparer processes that prepare the steps (`uform.runtime.preparers`); 0: the prepare stage runs on this process's threads."""
        # Two stages: the prepare stage packs and corrupts step n + 1 while the device stage runs step n, so the
        # GPU never waits on Python (the draws are keyed by the step number, which is fixed when the step is
        # called, so preparing ahead changes nothing). The prepare stage has two threads: while one waits for its
        # step's media in the decode pool, the other packs the step before (with 128 JPEGs beside text at the
        # reference geometry each half is about as long as the other; bench/data_wait.py). With preparer processes the
        # threads only send each step to a preparer process and copy its answer (each process prepares two at once).
        # Every thread of the replica starts on the replica's device: CUDA's current device is per thread
        # and a new thread's is device 0, so on any other device an event recorded or a stream read there
        # would be device 0's (2-GPU profile: rank 1's completion events and gradient flags were read off
        # device 0, the flags "changed" and every step synchronised, 67% weak scaling).
        bound = (self.device,)
        self._queue = ThreadPoolExecutor(1, "uform-device", initializer=_bind_device, initargs=bound)
        self._host = ThreadPoolExecutor(
            max(2, 2 * host_processes), "uform-host", initializer=_bind_device, initargs=bound
        )
        self._completion = ThreadPoolExecutor(1, "uform-completion", initializer=_bind_device, initargs=bound)
        self._lock = threading.Lock()
        self._next_step = 1
        self._reported = 0  # the last step whose stats were read (the skips reported are those after it)
        cuda = self.device.type == "cuda"
        self.attention = "flex" if compiled_flex_available(self.device) else "dense"
        self.mlp = "cublaslt" if cuda and cublaslt.available(self.device) else "separate"
        """How a training step's MLP runs GELU: in cuBLASLt's epilogues (`model.mlp.FusedMLP`) or kernels of its own."""
        self.network.tower.fuse_mlp(self.mlp == "cublaslt")
        self.block = flex_block(self.device) if self.attention == "flex" else BLOCK
        """The side of the flex block mask's sparse tiles (`model.attention.flex_block`)."""
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None  # a step's inputs cross on it
        self.stage = stage(config, self.block if self.attention == "flex" else 0)
        """Where this replica's prepare stage runs (`Stage`)."""
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
    def build(
        cls,
        device: torch.device,
        config: TrainerInitVramConfig,
        world: World | None,
        stage: StageFactory,
        *,
        host_processes: int = 0,
        world_compile: str = "whole",
        init_from: StartingWeights | None = None,
    ) -> Replica:
        """The replica of `config` on `device`, from `config.seed` or resumed from `config.resume` (every check
        of the checkpoint and of the memory it needs before anything is allocated), its seeded weights overlaid
        by those `init_from` plans to take from another run (`uform.replica.init_from`); in a world, every rank
        checks that it builds the same run as the others (raising on every rank when one differs or fails).
        Its arguments are taken as checked (`Trainer.init_vram` checks them)."""
        try:
            resolved, stored = resolve_run(config)
            check_memory(resolved, device)  # before any allocation: refuses on CUDA, warns on the CPU
            # Digest verified, every tensor read (at most the file's own length) before anything is built.
            loaded = (
                None if stored is None else read_run_tensors(stored, resolved.progress, resolved.progress_steps, device)
            )
            replica = cls(
                device,
                resolved,
                world,
                stage,
                host_processes=host_processes,
                world_compile=world_compile,
                _token=_PRIVATE,
            )
            replica.network.initialize(resolved.seed)
            replica.network.to(device)
            if init_from is not None:
                load_starting_weights(init_from, replica.network, device)
            replica.init_from = init_from
            replica.optimizer = build_optimizer(replica.network, device)
            if stored is not None and loaded is not None:
                replica._resume(stored, loaded)
        except BaseException:
            if world is not None:  # the others wait to compare runs: tell them this process has none
                with contextlib.suppress(Exception):
                    compare_runs(world, None, 0)
            raise
        if world is not None:
            replica._join_world()
        return replica

    def _join_world(self) -> None:
        """Every process of the run checks that it builds the same run (a digest of the resolved config and
        the step it starts from, all-gathered), then arms the gradient reduction."""
        world = self.world
        assert world is not None
        record = to_dict(self.config)
        record.pop("progress_steps", None)  # how often this process reports is its own business
        if self.init_from is not None:  # a rank started from other weights would train another run
            record["init_from"] = self.init_from.digest
        try:
            compare_runs(world, json.dumps(record, sort_keys=True), self._ledger.applied)
        except BaseException:
            self.close()
            raise
        if world.size > 1:
            variable = [p for params in self._parts.values() for p in params]
            self._reducer = GradientReducer([p for _, p in reduction_order(self.network)], world, variable=variable)

    def _resume(self, stored: StoredRun, tensors: dict[str, torch.Tensor]) -> None:
        # read_stored_run checked the names, dtypes and shapes against this network, read_run_tensors the digest.
        self.network.load_state_dict(stored_weights(tensors), strict=True)
        restore_moments(self.network, self.optimizer, tensors, fused=self.device.type == "cuda")
        self._ledger.restore(stored.step, stored.nonfinite)
        self._calls = self._reported = stored.step + stored.nonfinite
        self._next_step = self._calls + 1
        self._dropped = stored.dropped
        self._skipped = stored.skipped

    # ---- the verbs ---------------------------------------------------------------------------------

    def check_step(
        self, modalities: Any, contents: Any, config: TrainerStepConfig | None, copy_buffers: bool
    ) -> CheckedStep:
        """Every check of a step's arguments (`checked_step.check_step`) against this replica's run; refused on a
        closed replica. Answers them owned by the replica when `copy_buffers`."""
        self.check_open()
        # In a world a process may have no items this step; it still takes its part in the collectives.
        alone = self.world is None or self.world.size == 1
        return check_step(self.config, modalities, contents, config, copy_buffers, allow_empty=not alone)

    def submit(
        self,
        modalities: Any,
        contents: Any,
        config: TrainerStepConfig | None,
        copy_buffers: bool,
        *,
        caller_depth: int = 1,
    ) -> Future:
        """Checks a step (`check_step`) and queues it (`submit_checked`); `caller_depth` as there."""
        checked = self.check_step(modalities, contents, config, copy_buffers)
        return self.submit_checked(checked, caller_depth=caller_depth + 1)

    def submit_checked(self, checked: CheckedStep, *, caller_depth: int = 1) -> Future:
        """Queues a step whose arguments passed `check_step` already (they are not checked again: a device's
        worker takes its share of a step checked in the calling process this way); answers a `Future` of its
        arena's rows (None without an arena), resolved once its device work is done. `caller_depth`: the frames
        between this call and the user's, so that a warning names the user's line."""
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
            host = self._host.submit(self.prepare, checked, step)
            done: Future = Future()
            done.set_running_or_notify_cancel()  # a queued step is not cancelled: its draws are numbered
            self._queue.submit(self._device_stage, checked, host, step, done)
        self._warn_past_schedule(step, 3 + caller_depth)  # in the caller's thread, where its warning filters apply
        return done

    def save(self, config: TrainerSaveConfig, data: str | None = None) -> Future:
        """Queues a checkpoint of the run after every step called before it (only rank 0 writes, in a world);
        `config` is taken as checked (`trainer.save_config`), `data` is the data slot's text
        (`run_schema.data_slot`) or None."""
        self.check_open()
        return self._queue.submit(self._run_save, config, data)

    def weights(self) -> Future:
        """A `Future` of the network's `Weights` after every step called before it, resolved after those steps'
        own futures (so a caller holding the weights holds answered steps)."""
        self.check_open()

        def copy() -> Weights:
            self._resolve(None)
            tensors = {k: v.detach().to("cpu", copy=True) for k, v in self.network.state_dict().items()}
            return Weights(self.config, self._ledger.applied, tensors)

        copied = self._queue.submit(copy)
        answered: Future = Future()
        answered.set_running_or_notify_cancel()

        def relay(_: Future) -> None:  # on the device thread, after it queued every earlier step's completion
            try:
                self._completion.submit(_pass_on, copied, answered)  # in order: behind those completions
            except RuntimeError:  # the completion thread is shut down: nothing is left behind it
                _pass_on(copied, answered)

        copied.add_done_callback(relay)
        return answered

    def queued(self, work: Callable[[], Any]) -> Future:
        """A `Future` of `work()`, run on the device thread after every step and save called before it and
        before any called after: evaluation between steps sees the weights as they stand there, and no step
        runs under it."""
        self.check_open()
        return self._queue.submit(work)

    def held_out_terms(self, checked: CheckedStep, key: int) -> dict[str, tuple[float, float]]:
        """Every term of the objective over `checked` (held-out items) under the current weights, each as
        (sum, count): the prepare stage with the draws of step number `key` (so that every evaluation masks the
        same positions), then one forward without gradients and without the world (each sum over this
        replica's items alone). Nothing of the replica changes: no update, no step counted or numbered, no
        warning. Run it on the device thread (`queued`), where no step runs beside it."""
        batch, tensors, _failed = self.stage.prepare(checked, key)
        cuda = self.device.type == "cuda"
        inputs = to_device(
            tensors,
            self.device,
            self.network.rotary,
            attention=self.attention,
            dtype=torch.bfloat16 if cuda else torch.float32,
            dynamic=cuda,
            block=self.block,
        )
        was_training = self.network.training
        self.network.eval()
        try:
            with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cuda):
                terms, _ = self.network.losses(inputs, None, batch.positives, batch.late_positives)
        finally:
            self.network.train(was_training)
        return {name: (float(term.sum), float(term.count)) for name, term in terms.items()}

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied so far, across resumes (a step skipped as non-finite is not one)."""
        self._resolve(None)
        return self._ledger.applied

    @property
    def steps_read(self) -> int:
        """Optimizer steps applied as far as read, without waiting for the device work of queued steps."""
        return self._ledger.applied

    def close(self) -> None:
        """Waits for queued calls and stops the replica's threads and processes. Later steps and saves are
        refused."""
        self.closed = True  # first, so that a call racing the shutdown is refused by name, not by the pool
        self._queue.shutdown(wait=True)
        self._host.shutdown(wait=True)
        self._completion.shutdown(wait=True)
        self.stage.close()
        if self._reducer is not None:
            self._reducer.close()

    def check_open(self) -> None:
        """Refuses a call on a closed replica."""
        if self.closed:
            raise ValueError(
                "trainer: this trainer was closed; make a new one with Trainer.init_vram (its resume goes on "
                "from a checkpoint)"
            )

    def _warn_past_schedule(self, step: int, stacklevel: int) -> None:
        """A step past schedule.steps runs at the floor rate: said once, every such step counted."""
        steps = self.config.schedule.steps
        if step > steps:
            self.notices.warn(
                "schedule",
                f"uform: step {step} is past schedule.steps ({steps}): it and every later step run at the floor "
                f"learning rate schedule.min_learning_rate ({self.config.schedule.min_learning_rate:g}); to go "
                "on along a cosine, resume with a larger schedule.steps",
                ScheduleWarning,
                stacklevel=stacklevel,
            )

    # ---- the work ----------------------------------------------------------------------------------

    def prepare(self, checked: CheckedStep, step: int, notify: bool = True) -> tuple[Batch, dict[str, torch.Tensor]]:
        """Step `step`'s prepare stage (the replica's `stage`: decode, pack, corrupt and pair, block tables): its
        batch and host tensors (page-locked on CUDA, ready for the copy). With `notify`, a media item that did
        not decode and an item cut or dropped for room are warned about here (once per kind)."""
        batch, host, failed = self.stage.prepare(checked, step)
        if notify:  # once per step: not again where a renumbered step is prepared anew (`_apply_step`)
            warn_skipped(self.notices, failed, checked.modalities, "TrainerStepStats.skipped", checked.origin)
            warn_step_capacity(self.notices, batch, len(checked.modalities), self.config.batch.max_columns_per_row)
        return batch, host

    def decode(self, checked: CheckedStep) -> tuple[dict[int, Units], list[tuple[int, str]]]:
        """Decodes the step's media items (the prepare stage's first half, for the benches); answers the units of
        those that decoded and (index, reason) of those that did not."""
        return self.stage.decode(checked)

    def _device_stage(self, checked: CheckedStep, host: Future, step: int, done: Future) -> None:
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

    def _apply_step(self, checked: CheckedStep, host: Future, step: int) -> Callable[[], torch.Tensor | None]:
        r = self.config
        if self._torn:
            host.cancel()
            raise RuntimeError(self._torn)
        if step != self._calls + 1:  # an earlier queued step failed: its successors' draws move up
            ran = not host.cancel()  # a prepare stage that ran (or runs) has warned already
            step = self._calls + 1
            batch, tensors = self.prepare(checked, step, notify=not ran)
        else:
            batch, tensors = host.result()
        cuda = self.device.type == "cuda"
        dtype = torch.bfloat16 if cuda else torch.float32
        inputs = to_device(
            tensors,
            self.device,
            self.network.rotary,
            attention=self.attention,
            dtype=dtype,
            dynamic=cuda,
            block=self.block,
            copy_stream=self._copy_stream,
            # Training steps only: a second compiled graph for such steps is worth its compile there (BENCHMARKS.md,
            # "Issue 12, eleventh day"); evaluation and serving keep one graph.
            uniform=True,
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
            items = len(checked.modalities)  # summed with the means: the world's items, no collective of its own
            if world is not None:  # the world's means: each process's share, summed
                world_stats = _stat_vector(totals, items)
                world.all_reduce(world_stats)
        except Exception as error:
            if world is not None:
                raise _broken(world, error, step) from error
            raise
        loss = totals["loss"] if world_stats is None else world_stats[0]  # the world's, where there is one
        skip = self._update(rate, loss, unreached)
        self._calls = step
        if isinstance(skip, bool):
            self._ledger.record(step, skip, rate)
        self._dropped += batch.dropped
        self._skipped += batch.skipped

        # Everything the caller reads lands in host buffers through asynchronous copies; `finish` waits
        # for them on the completion thread.
        readback: dict[str, torch.Tensor] = {}
        if checked.stats is not None:
            readback["stats"] = world_stats if world_stats is not None else _stat_vector(totals, items)
            dropped, self._dropped = self._dropped, 0
            skipped, self._skipped = self._skipped, 0
            since, self._reported = self._reported, step  # this report counts the skips of steps (since, step]
        if not isinstance(skip, bool):  # the device decided: read on the completion thread, or by a save
            readback["skip"] = skip
        if checked.arena is not None:
            slot = torch.from_numpy(batch.layout.slot)
            if cuda:  # from page-locked memory, so the copy waits for none of the step launched before it
                slot = slot.pin_memory()
            slot = slot.to(self.device, non_blocking=True)
            present = slot >= 0
            readback["arena"] = embeddings.float()[slot.clamp_min(0)] * present.unsqueeze(1)
        host_copies = {k: to_host(v) for k, v in readback.items()}
        event = None
        if cuda:
            # A blocking event: the completion thread sleeps in `synchronize` rather than spinning a core through
            # the whole step (py-spy on the H200: ~40 ms of CPU a reference step, a core the decoders could use).
            event = torch.cuda.Event(blocking=True)
            event.record(torch.cuda.current_stream(self.device))
        if "skip" in host_copies:
            self._ledger.defer(step, host_copies["skip"], event)

        def finish() -> torch.Tensor | None:
            self._wait(step, event, "device work")
            self._resolve(step)
            if checked.stats is not None:
                stats = checked.stats
                for f in dataclasses.fields(TrainerStepStats):
                    setattr(stats, f.name, 0 if f.type == "int" else 0.0)
                *means, world_items = host_copies["stats"].tolist()
                for name, value in zip(_STAT_TERMS, means, strict=True):
                    setattr(stats, name, float(value))
                stats.items = round(world_items)
                stats.step = step
                stats.learning_rate = rate
                stats.truncated = batch.truncated
                stats.dropped = dropped
                stats.skipped = skipped
                stats.nonfinite = self._ledger.reported(since, step)
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

    def _resolve(self, upto: int | None) -> None:
        """Counts the steps up to `upto` (None: every one) whose skip only the device knew, waiting for their
        device work (`StepLedger.resolve`)."""
        self._ledger.resolve(upto, lambda step, event: self._wait(step, event, "update"))

    def _wait(self, step: int, event: Any, what: str) -> None:
        """Waits for step `step`'s device work up to `event` (None: the CPU, done when written). In a world a peer
        that died leaves the event unfinished, so the wait has the world's deadline and then breaks the world."""
        world = self.world if self.world is not None and self.world.size > 1 else None
        if event is not None and world is not None:
            try:
                wait_event(event, world, f"step {step}'s {what}")
            except WorldAborted as error:
                raise _broken(world, error, step) from error
        elif event is not None:
            event.synchronize()

    def _run_save(self, config: TrainerSaveConfig, data: str | None = None) -> None:
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
        tensors = run_tensors(self.network, self.optimizer)
        counters = (self._ledger.applied, self._dropped, self._skipped, self._ledger.nonfinite)
        metadata = run_metadata(self.config, *counters, data=data)
        write_checkpoint(config.path, tensors, metadata, config.progress, config.progress_steps or 10)


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


_STAT_TERMS = tuple(f.name for f in dataclasses.fields(TrainerStepStats) if f.name.endswith("loss"))
"""The loss terms a step reports, by their `TrainerStepStats` names (reduced over the world as means)."""


def _stat_vector(totals: dict[str, torch.Tensor], items: int) -> torch.Tensor:
    """[len(_STAT_TERMS) + 1] float32: the step's loss terms, then its item count (exact in float32 below 2^24)."""
    zero = totals["loss"].new_zeros(())
    terms = [totals.get(k, zero).detach().float() for k in _STAT_TERMS]
    return torch.stack([*terms, zero.float() + items])


def _pass_on(source: Future, target: Future) -> None:
    """Resolves `target` as `source` resolved."""
    if source.cancelled():
        target.set_exception(CancelledError())
        return
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())


def _complete(finish: Callable[[], Any], done: Future) -> None:
    try:
        done.set_result(finish())
    except BaseException as error:
        done.set_exception(error)


_PRIVATE = object()
