"""One process's place in a run's world, and the collectives a world step needs.

Shape legend: S segment slots of one device's step, D hidden, W world size (processes, one per device).

- `World`: this process's rank, the world size, the process group the step's own collectives use
  (the embedding gather, the count and stats reductions) and a second group of the same ranks for the
  gradient buckets, so that buckets launched from backward hooks can never interleave with the step's
  collectives in a different order on different processes.
- `gather_with_grad`: every process's pooled embeddings, with a backward that sums the column gradients
  of every process and hands each its own slice (the all-gather whose adjoint is a reduce-scatter). A
  process scores its S rows against the world's W S columns, so memory grows as S x W S, never (W S)^2;
  past that, SigLIP's chunked ring (Zhai et al. 2023: each process passes its column block around a ring
  and scores one block at a time) is the way on.
- `GradientReducer`: sums every parameter's gradient over the world, in buckets launched from
  post-accumulate-grad hooks while backward is still running (PyTorch DDP's Reducer design, Li et al.
  2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"; written here from that
  description, with a SUM instead of DDP's mean because each process's loss is already divided by the
  world's counts).
- NCCL faults (`World.watch`, `World.mark`, `World.abort`, `wait_event`): a peer that dies leaves this
  process's NCCL kernels waiting for it forever, and torch's own handling of that (its watchdog, under
  TORCH_NCCL_ASYNC_ERROR_HANDLING, whose default ends the process) never reaches the trainer. So the world
  keeps its own deadline: every collective it launches is marked (a CUDA event and the launch time), and a
  watch thread aborts every communicator of the world, all at once, when a mark is still unfinished a
  deadline after its launch or torch reports an error; the abort lets every wait on the device return, and
  the trainer raises `MeshError` as it does for gloo's closed connection. The NCCL groups' own timeout is
  longer (`mesh.GROUP_SLACK`), so torch's watchdog finds the collectives aborted and finished rather than
  timed out, and torch is asked to clean up without ending the process should it see an error first
  (`mesh.nccl_defaults`). docs/decisions.md ("NCCL faults") has the sources.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..model.inputs import to_host

BUCKET_BYTES = 25 << 20
"""Gradient bytes per bucket (DDP's default): big enough to keep the link busy, small enough to start early."""

WATCH_SECONDS = 0.2
"""Seconds between two looks of the world's watch (a CUDA event query and two mutex reads)."""

GRACE_SECONDS = 5.0
"""A wait for a step's device work gives up this long after the world's deadline: the step's collectives
were marked before the wait began, so the watch aborts a stalled world first; the grace only matters for
device work of collectives the world did not launch."""

_ERRORS = {
    "TIMEOUT": "a collective waited past the {timeout:g} s deadline",
    "COMM_ERROR": "NCCL reported a communication error (a peer process exited or the network failed)",
    "REMOTE_ERROR": "another process of the world reported an NCCL failure",
}


class MeshError(RuntimeError):
    """The world could not be formed, or a process of it stopped or stalled: the message says which and how
    to go on (restart every process; `resume` continues the run)."""


class WorldAborted(RuntimeError):
    """This process aborted the world's NCCL communicators (the message says why): no collective of the
    world completes any more, and device results of the work in flight are not to be trusted. The trainer
    turns it into the step's `MeshError`."""


@dataclass
class World:
    """One process's membership of the run's world (one device per process)."""

    rank: int
    """This process's index in the world; the process of index zero writes checkpoints."""
    size: int
    """Processes (devices) in the world."""
    backend: str
    """`nccl` on CUDA devices, `gloo` on the CPU."""
    device: torch.device
    """This process's device."""
    timeout: float
    """Seconds any collective may wait for a peer before it fails."""
    group: Any = None
    """The step's own collectives (gather, counts, stats); None is the default group."""
    gradients: Any = None
    """The gradient buckets' group."""
    failed: list[str] = field(default_factory=list)
    """Why the world broke, once a collective failed (every later step refuses with it)."""
    aborted: str = ""
    """Why this process aborted the world's NCCL communicators; empty while it has not (always on gloo)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _aborts: list[threading.Thread] = field(default_factory=list, repr=False, compare=False)
    _stop: threading.Event | None = field(default=None, repr=False, compare=False)
    _marks: deque[tuple[Any, float, str]] = field(default_factory=deque, repr=False, compare=False)

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sums `tensor` over the world, in place; answers it."""
        self.check()
        dist.all_reduce(tensor, group=self.group)
        self.mark("an all-reduce of the step")
        return tensor

    def all_gather(self, tensor: Tensor) -> Tensor:
        """[n, ...] on every process -> [W * n, ...], rank-major."""
        self.check()
        tensor = tensor.contiguous()
        out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        _all_gather_single(out, tensor, group=self.group)
        self.mark("an all-gather of the step")
        return out

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every process's `data`, rank-major: small host values between two steps (a loader's position), never
        while a step's collectives are in flight (they share the step's group, whose calls every process must
        make in one order). Two gathers: the lengths, then the bytes padded to the longest."""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = [int(n) for n in self.all_gather(length).tolist()]
        most = max(lengths)
        padded = torch.zeros(most, dtype=torch.uint8)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = self.all_gather(padded.to(self.device)).cpu().view(self.size, most)
        return [gathered[r, :n].numpy().tobytes() for r, n in enumerate(lengths)]

    def gather(self, x: Tensor) -> Tensor:
        """x [S, ...] -> [W * S, ...] (rank-major), without gradient (`losses.peers.Peers`)."""
        return gather(x, self)

    def gather_with_grad(self, x: Tensor) -> Tensor:
        """x [S, ...] -> [W * S, ...] (rank-major), differentiable (`losses.peers.Peers`, `gather_with_grad`)."""
        return gather_with_grad(x, self)

    # ---- NCCL faults -------------------------------------------------------------------------------

    def check(self) -> None:
        """Raises `WorldAborted` once this process has aborted the world (a collective launched on an
        aborted communicator would only fail, or start a new one's rendezvous with peers that are gone)."""
        if self.aborted:
            raise WorldAborted(self.aborted)

    def groups(self) -> list[tuple[str, Any]]:
        """The world's process groups by their part: 'step' (the step's own collectives) and 'gradients'."""
        step = self.group
        if step is None:
            with contextlib.suppress(Exception):  # not initialized (any more): nothing to look at
                step = dist.distributed_c10d._get_default_group()
        return [(name, pg) for name, pg in (("step", step), ("gradients", self.gradients)) if pg is not None]

    def watch(self) -> None:
        """Starts the world's watch (a daemon thread; NCCL worlds of two or more only): every WATCH_SECONDS
        it looks at the oldest unfinished mark and at torch's error state of the groups, and aborts the
        world (`abort`) when the mark is past the deadline or torch reports an error."""
        if self.backend != "nccl" or self.size < 2 or self._stop is not None:
            return
        stop = self._stop = threading.Event()

        def look() -> None:
            while not stop.wait(WATCH_SECONDS):
                reason = self.errors() or self.overdue()
                if reason:
                    self.abort(reason)
                    return

        threading.Thread(target=look, name="uform-world-watch", daemon=True).start()

    def unwatch(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def mark(self, what: str) -> None:
        """Notes that collectives of the world were just launched, by a CUDA event on the current stream
        (after the launch, so it completes once they have): the watch aborts the world should it still be
        unfinished `timeout` seconds from now. A no-op where the world is not watched (gloo, one process,
        a closed mesh)."""
        if self._stop is None or self._stop.is_set():
            return
        event = torch.cuda.Event()
        event.record()
        self._marks.append((event, time.monotonic(), what))

    def overdue(self) -> str:
        """Why the world is stalled, from its marks (empty while it is not): marks finish in the order they
        were made on the one stream, so finished ones are dropped from the front and the first unfinished
        one is the oldest."""
        while self._marks:
            event, launched, what = self._marks[0]
            if event.query():
                self._marks.popleft()
                continue
            waited = time.monotonic() - launched
            if waited > self.timeout:
                return f"{what} has not finished {waited:.1f} s after its launch, past the {self.timeout:g} s deadline"
            break
        return ""

    def errors(self) -> str:
        """What torch's NCCL watchdog has seen go wrong in the world's groups, as a sentence; empty when
        nothing has (or this torch cannot say: `get_error` came with torch 2.6, pytorch PR #140087)."""
        found = []
        for name, pg in self.groups():
            try:
                state = pg._get_backend(torch.device("cuda")).get_error()
            except Exception:  # no NCCL backend, an older torch, a group already gone
                continue
            kind = getattr(state, "name", str(state))
            if kind in _ERRORS:  # the failures torch names (ErrorType); SUCCESS, or a name unknown here, is not
                found.append(f"{_ERRORS[kind].format(timeout=self.timeout)} ({kind} on the {name} group)")
        return "; ".join(found)

    def abort(self, reason: str) -> str:
        """Aborts every NCCL communicator of the world, once, and answers why it was (the first reason).

        The groups are aborted at the same time, each from a thread of its own, and this returns without
        waiting for them: `ncclCommAbort` of one communicator may wait for the whole device, which a kernel
        of another communicator still waiting for the dead peer never lets go of (NVIDIA/nccl#1013,
        pytorch#119797); concurrent aborts set every communicator's abort flag before any of them waits.
        `aborted` is set first, so a wait that polls it gives up at once even if an abort hangs."""
        with self._lock:
            if self.aborted:
                return self.aborted
            self.aborted = f"{reason}; this process aborted the world's NCCL communicators"
            for name, pg in self.groups():
                thread = threading.Thread(target=_abort_group, args=(pg,), name=f"uform-abort-{name}", daemon=True)
                thread.start()
                self._aborts.append(thread)
            return self.aborted

    def settle(self, seconds: float) -> bool:
        """Waits up to `seconds` for the aborts `abort` started; answers whether they all returned."""
        deadline = time.monotonic() + seconds
        with self._lock:  # `abort` sets `aborted` before it starts the threads, under this lock
            threads = list(self._aborts)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)


def _abort_group(pg: Any) -> None:
    with contextlib.suppress(Exception):  # a group whose backend cannot abort, or one already gone
        pg.abort()


def wait_event(event: Any, world: World, what: str, grace: float = GRACE_SECONDS) -> None:
    """Waits for a CUDA `event` recorded after device work of `world`'s collectives, polling it, so that the
    wait ends even where an abort does not release the device (`event.synchronize()` would wait forever).

    Raises `WorldAborted` when the world is aborted before the event completes (or when it completes but the
    watchdog reports an error: aborted collectives end early, with partial results), and aborts the world
    itself when `world.timeout + grace` seconds pass first. Polls at 50 us, doubling to 1 ms: a step's
    answer waits at most about a millisecond longer than `synchronize` would make it."""
    deadline = time.monotonic() + world.timeout + grace
    pause = 5e-5
    while not event.query():
        if world.aborted:
            raise WorldAborted(world.aborted)
        if time.monotonic() > deadline:
            raise WorldAborted(world.abort(f"{what} did not finish within {world.timeout + grace:g} s"))
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    reason = world.aborted or world.errors()
    if reason:
        raise WorldAborted(world.abort(reason))


_all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherWithGrad(torch.autograd.Function):
    """y = concat over ranks of x; dL/dx_r = sum over processes of their dL/dy, rows of rank r."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, world: World) -> Tensor:  # type: ignore[override]
        ctx.world = world
        ctx.rows = x.shape[0]
        return world.all_gather(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        world: World = ctx.world
        world.check()
        grad = grad.contiguous()
        if world.backend == "nccl":
            out = grad.new_empty((ctx.rows, *grad.shape[1:]))
            _reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM, group=world.group)
            world.mark("the reduce-scatter of the gathered embeddings' gradient")
            return out, None
        # gloo has no reduce-scatter: sum the whole (small: W x S x D) gradient, keep this rank's rows.
        total = grad.clone()
        dist.all_reduce(total, group=world.group)
        return total[world.rank * ctx.rows : (world.rank + 1) * ctx.rows].clone(), None


@torch.compiler.disable
def gather_with_grad(x: Tensor, world: World) -> Tensor:
    """x [S, ...] on every process -> [W * S, ...] (rank-major), differentiable: the gradient each process
    receives for its own rows sums every process's gradient of them. Runs eagerly (a compiled step breaks
    its graph around it)."""
    return _GatherWithGrad.apply(x, world)


@torch.compiler.disable
def gather(x: Tensor, world: World) -> Tensor:
    """x [S, ...] -> [W * S, ...] (rank-major), without gradient."""
    return world.all_gather(x.detach())


# --------------------------------------------------------------------------------------------------
# Gradients


def reduction_order(network: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters in about the order backward finishes them, the same on every process: the heads and
    temperatures (read last in the forward), the final norm, the blocks from last to first (each block's
    parameters from last to first), then the input side (token and media embeddings)."""
    named = list(network.named_parameters())
    tower_blocks: dict[int, list[tuple[str, nn.Parameter]]] = {}
    heads, norm, inputs = [], [], []
    for name, p in named:
        parts = name.split(".")
        if parts[0] == "tower" and parts[1] == "blocks":
            tower_blocks.setdefault(int(parts[2]), []).append((name, p))
        elif parts[0] == "tower":
            norm.append((name, p))
        elif parts[0] in ("embed", "media"):
            inputs.append((name, p))
        else:
            heads.append((name, p))
    blocks = [entry for index in sorted(tower_blocks, reverse=True) for entry in reversed(tower_blocks[index])]
    return heads + norm + blocks + list(reversed(inputs))


class _Bucket:
    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.parameters = parameters
        self.offsets: list[int] = []
        at = 0
        for p in parameters:
            self.offsets.append(at)
            at += p.numel()
        self.numel = at
        self.buffer: Tensor | None = None  # [numel + len(parameters)]: the gradients, then a used flag each
        self.views: list[Tensor] = []  # each parameter's slice of the buffer, flat
        self.fired = [False] * len(parameters)  # which parameters' gradients backward finished (host side)
        self.flags: dict[bytes, Tensor] = {}  # the used flags of each pattern of `fired` seen, on the device
        self.pending = 0
        self.work: Any = None


class GradientReducer:
    """Sums the gradients of `parameters` over the world's gradient group, bucket by bucket as backward
    produces them. Buckets launch strictly in their fixed order on every process (a ready bucket waits for
    its predecessors), so the collectives match whatever order backward finishes parameters in.

    A parameter that received no gradient on a process (or that `arm` names as not reached there: a media
    modality's modules in a step without its units, whose gradients are exact zeros) contributes zeros,
    with a used flag of zero; after the sum, a parameter no process used keeps `grad = None`, as it would in
    one process over the whole batch (AdamW then leaves it and its moments alone). The summed gradients stay
    in the buckets: each `.grad` is a view of its bucket until the optimizer's `zero_grad(set_to_none=True)`
    drops it.

    `variable` parameters are those whose use changes from step to step (the `optim.reach` parts: media modules,
    late interaction's head). On a GPU their
    flags are never held (see `_unused`): they always get their `.grad` view, and `used` answers their flag
    on the device, which the trainer hands to the fused AdamW as the skip of their parameter group, so that
    a parameter no process used is not written in the very step it was not used, without a host read.

    Nothing here reads the device from the host: which parameters backward reached is known on the host
    (the hooks fired), a bucket's gradients go in with one multi-tensor copy and its flags with one copy of
    a flag pattern kept on the device, so a step costs a few kernel launches per bucket and no stream
    synchronisation (H200 profile: one `buffer[k] = 1.0` per parameter, a pageable host copy that
    synchronises, cost 2-GPU weak scaling ~15 points).
    """

    def __init__(
        self,
        parameters: Iterable[nn.Parameter],
        world: World,
        bucket_bytes: int | None = None,
        variable: Iterable[nn.Parameter] = (),
    ) -> None:
        self.world = world
        self._variable = {id(p) for p in variable}
        self._unreached: set[int] = set()
        limit = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in parameters:
            if not p.requires_grad:
                continue
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        self._where: dict[int, tuple[_Bucket, int]] = {}
        for bucket in self.buckets:
            for index, p in enumerate(bucket.parameters):
                self._where[id(p)] = (bucket, index)
        self._armed = False
        self._next = 0
        self._lock = threading.Lock()
        self._exact = False
        self._held: set[int] | None = None
        self._pending_flags: tuple[Tensor, Any] | None = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._ready) for bucket in self.buckets for p in bucket.parameters
        ]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def arm(self, unreached: Iterable[nn.Parameter] = ()) -> None:
        """Before backward: every bucket waits for all its parameters again; `unreached` are parameters this
        process's step does not reach whatever backward gives them (they count as unused here)."""
        self._unreached = {id(p) for p in unreached}
        for bucket in self.buckets:
            if bucket.buffer is None:
                first = bucket.parameters[0]
                bucket.buffer = torch.zeros(
                    bucket.numel + len(bucket.parameters), dtype=first.dtype, device=first.device
                )
                bucket.views = [
                    bucket.buffer[at : at + p.numel()] for at, p in zip(bucket.offsets, bucket.parameters, strict=True)
                ]
            bucket.fired = [False] * len(bucket.parameters)
            bucket.pending = len(bucket.parameters)
            bucket.work = None
        self._next = 0
        self._armed = True

    def _ready(self, p: Tensor) -> None:
        if not self._armed:
            return
        bucket, index = self._where[id(p)]
        with self._lock:
            bucket.fired[index] = p.grad is not None and id(p) not in self._unreached
            bucket.pending -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        """The bucket's gradients (zeros for parameters backward did not reach) and used flags into its
        buffer, then its all-reduce, asynchronous."""
        self.world.check()
        assert bucket.buffer is not None
        used = [i for i, fired in enumerate(bucket.fired) if fired]
        if used:
            grads = [bucket.parameters[i].grad for i in used]
            torch._foreach_copy_([bucket.views[i] for i in used], [g.reshape(-1) for g in grads if g is not None])
        if len(used) < len(bucket.parameters):
            torch._foreach_zero_([view for view, fired in zip(bucket.views, bucket.fired, strict=True) if not fired])
        pattern = bytes(bucket.fired)
        flags = bucket.flags.get(pattern)
        if flags is None:  # once per pattern (in practice once per run): a small host-to-device copy
            flags = torch.tensor(bucket.fired, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
            bucket.flags[pattern] = flags
        bucket.buffer[bucket.numel :].copy_(flags)
        bucket.work = dist.all_reduce(bucket.buffer, group=self.world.gradients, async_op=True)

    def finish(self) -> None:
        """After backward: launch what is left (parameters backward never reached count as unused), wait,
        and point `.grad` at the world's sums."""
        with self._lock:
            self._armed = False
            for bucket in self.buckets[self._next :]:
                bucket.pending = 0
            self._launch_ready()
        for bucket in self.buckets:
            bucket.work.wait()
        self.world.mark("the gradient buckets' all-reduces")
        flags = torch.cat([b.buffer[b.numel :] for b in self.buckets if b.buffer is not None])
        unused = self._unused(flags)
        at = 0
        for bucket in self.buckets:
            for index, p in enumerate(bucket.parameters):
                p.grad = None if at + index in unused else bucket.views[index].view_as(p)
            at += len(bucket.parameters)

    def used(self, p: nn.Parameter) -> Tensor:
        """p's used flag of the last step, summed over the world (0-d, on the device; 0: no process used it).
        Read it after `finish` and before the next `arm`."""
        bucket, index = self._where[id(p)]
        assert bucket.buffer is not None
        return bucket.buffer[bucket.numel + index]

    def _unused(self, flags: Tensor) -> set[int]:
        """The parameters no process used this step. On the CPU read exactly every step. On a GPU reading
        them would stall the host until the device is done, so the set read on the first step is held (it
        follows from the objective and the config, not the data) and each step's flags are checked one step
        later; should they ever differ, every later step reads them exactly."""
        if flags.device.type == "cpu" or self._exact:
            return {i for i, used in enumerate(flags.tolist()) if used == 0}
        # The variable parameters' flags change with the data: never held, they keep their views (the
        # trainer skips their update on the device by `used`).
        fixed = self._fixed()
        if self._held is None:
            self._held = {i for i, used in enumerate(flags.tolist()) if used == 0 and i in fixed}
            return self._held
        if self._pending_flags is not None:
            host, event = self._pending_flags
            wait_event(event, self.world, "the previous step's gradient reduction")
            seen = {i for i, used in enumerate(host.tolist()) if used == 0 and i in fixed}
            if seen != self._held:
                warnings.warn(
                    "uform: the parameters no process uses changed between steps; reading them every step",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._exact = True
                return {i for i, used in enumerate(flags.tolist()) if used == 0}
        host = to_host(flags)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flags.device))
        self._pending_flags = (host, event)
        return self._held

    def _fixed(self) -> set[int]:
        """The indices (in `finish`'s flag order) of the parameters that are not variable."""
        out: set[int] = set()
        at = 0
        for bucket in self.buckets:
            out.update(at + i for i, p in enumerate(bucket.parameters) if id(p) not in self._variable)
            at += len(bucket.parameters)
        return out
