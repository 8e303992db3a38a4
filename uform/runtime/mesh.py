"""The mesh: every device of every host of a run, as one `torch.distributed` world (docs/design.md §6).

Each host's process calls `Mesh.bootstrap(executor, MeshOptions(host_domain_index=h, host_domain_count=n,
directory=..., job=...))`. The hosts meet in files under `directory/job` (a directory every host sees, as
the `/shared/exchange` of UForm 4's trainer API's example; `uform.runtime.rendezvous`: a fresh run id, each
host's nonce and heartbeat, one world.json), then every rank meets in the run's store and forms the process
group (`uform.runtime.process_group`). Files an earlier, killed run left behind never satisfy a new one, every
wait has the options' deadline, and a host that never arrives makes every other host fail with a `MeshError`
naming the missing host indices.

A process started by `torchrun` (one device per process) takes its mesh from the environment instead:
`Mesh.from_env()`, or `Mesh.bootstrap` with no directory, reads RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK and MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..enums import GPUClass, MultimemTier
from .executor import Executor
from .process_group import effective_tier, group_timeout, join, nccl_defaults, world_member
from .rendezvous import check_job, rendezvous
from .world import MeshError, World

__all__ = ["Mesh", "MeshDescription", "MeshError", "MeshOptions"]

DEFAULT_TIMEOUT = 600.0
"""Seconds any wait of the mesh takes at most (the rendezvous, the store, every collective), unless set."""

ABORT_SETTLE = 30.0
"""Seconds `Mesh.close` waits for the aborts of a failed NCCL world before it forgets its groups."""


@dataclass(kw_only=True)
class MeshOptions:
    """Where and how a run's hosts meet; every zero derives a default."""

    host_domain_index: int = 0
    """This host's index, in [0, host_domain_count)."""
    host_domain_count: int = 0
    """Hosts of the run; zero derives one (or the torchrun environment's count)."""
    directory: Any = None
    """A directory every host sees (str, bytes or os.PathLike), where the hosts meet under `job`; None reads
    the torchrun environment, or (one host) uses a private temporary directory."""
    job: str = ""
    """The run's name: letters, digits, '-', '_' and '.', at most 128; empty derives 'uform'."""
    timeout_seconds: float = 0.0
    """The deadline of every wait: the rendezvous, the store, and each collective; zero derives 600."""
    multimem: MultimemTier = MultimemTier.Off
    """NVLink multicast, off unless turned on here (or by NCCL_NVLS_ENABLE=1 in the environment)."""
    store: str = ""
    """'file' (a FileStore in the directory) or 'tcp' (host 0 serves a TCPStore and publishes its
    address in the directory); empty derives 'file'."""
    address: str = ""
    """The address host 0's TCPStore listens on, under store 'tcp'; empty derives this host's name."""


@dataclass(frozen=True, kw_only=True)
class MeshDescription:
    """What a mesh spans, as `Mesh.describe()` answers it."""

    host_count: int
    """Hosts of the run."""
    devices_per_host: int
    """Devices (processes) of every host."""
    world_size: int
    """Devices of the run: host_count x devices_per_host."""
    ranks: tuple[int, ...]
    """This process's ranks, one per device of its executor."""
    host_index: int
    """This host's index."""
    multimem_tier: MultimemTier
    """How far NVLink multicast reaches in the run's collectives."""
    gpu_class: GPUClass
    """The class every GPU of the run dispatches as (the lowest of them); `GPUClass.CPU` on the CPU."""
    backend: str
    """The collectives' backend: 'nccl' on CUDA, 'gloo' on the CPU."""


# --------------------------------------------------------------------------------------------------
# Options


def _resolve(options: MeshOptions) -> MeshOptions:
    if not isinstance(options, MeshOptions):
        raise TypeError(f"options: expected a MeshOptions, got {type(options).__name__}")
    for name in ("host_domain_index", "host_domain_count"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    count = options.host_domain_count or 1
    if count < 0 or options.host_domain_count < 0:
        raise ValueError(f"host_domain_count: must not be negative, got {options.host_domain_count}")
    if not 0 <= options.host_domain_index < count:
        raise ValueError(
            f"host_domain_index: must lie in [0, host_domain_count={count}), got {options.host_domain_index}"
        )
    job = options.job or "uform"
    check_job(job)
    timeout = options.timeout_seconds
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout_seconds: expected a number, got {type(timeout).__name__}")
    if not timeout >= 0 or timeout == float("inf"):
        raise ValueError(f"timeout_seconds: must be a finite number of seconds >= 0, got {timeout}")
    store = options.store or "file"
    if store not in ("file", "tcp"):
        raise ValueError(f"store: expected 'file' or 'tcp', got {options.store!r}")
    if not isinstance(options.address, str):
        raise TypeError(f"address: expected a str, got {type(options.address).__name__}")
    if options.directory is not None and not isinstance(options.directory, (str, bytes, os.PathLike)):
        raise TypeError(f"directory: expected a str, bytes or os.PathLike, got {type(options.directory).__name__}")
    return dataclasses.replace(
        options,
        host_domain_count=count,
        job=job,
        timeout_seconds=float(timeout or DEFAULT_TIMEOUT),
        multimem=MultimemTier.parse(options.multimem, "multimem"),
        store=store,
    )


def _host_facts(executor: Executor, multimem: MultimemTier) -> dict[str, Any]:
    devices = executor.devices
    kind = devices[0].type
    capabilities = [list(torch.cuda.get_device_capability(d)) for d in devices] if kind == "cuda" else []
    return {
        "devices": len(devices),
        "kind": kind,
        "capabilities": capabilities,
        "multimem": int(multimem),
        "nvls": os.environ.get("NCCL_NVLS_ENABLE", ""),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }


def _torchrun_environment() -> dict[str, int] | None:
    """The torchrun variables, or None outside torchrun."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if not all(name in os.environ for name in names):
        return None
    values: dict[str, int] = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        if name in os.environ:
            try:
                values[name] = int(os.environ[name])
            except ValueError:
                raise ValueError(f"{name}: the environment holds {os.environ[name]!r}, not an integer") from None
    values.setdefault("LOCAL_WORLD_SIZE", values["WORLD_SIZE"])
    values.setdefault("GROUP_RANK", values["RANK"] // values["LOCAL_WORLD_SIZE"])
    return values


# --------------------------------------------------------------------------------------------------
# The mesh


class Mesh:
    """Every device of every host of a run; make one with `Mesh.bootstrap` or `Mesh.from_env`.

    A trainer made over a mesh borrows it: the mesh must outlive every trainer made over it (`close`
    refuses while one is open).
    """

    def __init__(self, executor: Executor, description: MeshDescription, *, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise TypeError("Mesh: make one with Mesh.bootstrap(executor, options) or Mesh.from_env()")
        self.executor = executor
        self._description = description
        self.world: World | None = None
        """This process's membership when it is itself a rank (an executor of one in-process device)."""
        self._owns_group = False
        self._keep: list[Any] = []  # the TCP store server host 0 keeps alive
        self._borrowers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closed = False
        self._temporary: str | None = None

    @classmethod
    def bootstrap(cls, executor: Executor, options: MeshOptions | None = None) -> Mesh:
        """Meets every other host of the job and forms the run's world over `executor`'s devices.

        Every host's process calls it with its own `host_domain_index` and the same count, directory and
        job. Without a directory it reads the torchrun environment when there is one, and otherwise forms
        a one-host world in a private temporary directory.
        """
        options = MeshOptions() if options is None else options
        if not isinstance(executor, Executor):
            raise TypeError(f"executor: expected an Executor, got {type(executor).__name__}")
        resolved = _resolve(options)
        if options.directory is None or options.directory in ("", b""):
            if _torchrun_environment() is not None:
                return cls._from_torchrun(executor, resolved)
            if resolved.host_domain_count > 1:
                raise ValueError("directory: several hosts meet in a directory they all see; name one")
            temporary = tempfile.mkdtemp(prefix="uform-mesh-")
            try:
                mesh = cls._bootstrap(executor, dataclasses.replace(resolved, directory=temporary))
            except BaseException:
                shutil.rmtree(temporary, ignore_errors=True)
                raise
            mesh._temporary = temporary
            return mesh
        return cls._bootstrap(executor, resolved)

    @classmethod
    def from_env(cls, executor: Executor | None = None, *, timeout_seconds: float = 0.0) -> Mesh:
        """The mesh of a process started by torchrun (one device per process). Without an executor, one is
        made: CUDA device LOCAL_RANK where CUDA is available, else the CPU (`mesh.executor`)."""
        environment = _torchrun_environment()
        if environment is None:
            raise MeshError(
                "mesh: no torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); "
                "start the process with torchrun or use Mesh.bootstrap"
            )
        if executor is None:
            if torch.cuda.is_available():
                executor = Executor.for_vram([environment["LOCAL_RANK"]])
            else:
                executor = Executor.cpu()
        options = _resolve(MeshOptions(timeout_seconds=timeout_seconds))
        return cls._from_torchrun(executor, options)

    @staticmethod
    def under_torchrun() -> bool:
        """Whether this process was started by torchrun (its environment names a rank, a world and a master)."""
        return _torchrun_environment() is not None

    @classmethod
    def _from_torchrun(cls, executor: Executor, options: MeshOptions) -> Mesh:
        env = _torchrun_environment()
        assert env is not None
        if len(executor.devices) != 1 or executor.has_workers():
            raise ValueError("executor: under torchrun every process drives one device; use an executor of one")
        device = executor.device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            nccl_defaults(options.multimem)
            torch.cuda.set_device(device)
        owns = not dist.is_initialized()
        if owns:
            timeout = group_timeout(backend, options.timeout_seconds)
            dist.init_process_group(
                backend, init_method="env://", timeout=timeout, device_id=device if backend == "nccl" else None
            )
        world = world_member(backend, device, options.timeout_seconds)
        rank, size = world.rank, world.size
        # Every process's device class, gathered, so the run dispatches as the lowest.
        mine = 0
        if backend == "nccl":
            mine = int(GPUClass.from_capability(*torch.cuda.get_device_capability(device)))
        classes = world.all_gather(torch.tensor([mine], dtype=torch.int64, device=device))
        gpu_class = GPUClass(int(classes.min())) if backend == "nccl" else GPUClass.CPU
        if world.aborted:  # the gather was cut short: its answer is not the others' classes
            world.unwatch()
            raise MeshError(f"mesh: the processes could not gather their GPU classes ({world.aborted})")
        per_host = env["LOCAL_WORLD_SIZE"]
        hosts = max(1, size // per_host)
        description = MeshDescription(
            host_count=hosts,
            devices_per_host=per_host,
            world_size=size,
            ranks=(rank,),
            host_index=env["GROUP_RANK"],
            multimem_tier=effective_tier(options.multimem, backend, gpu_class, hosts),
            gpu_class=gpu_class,
            backend=backend,
        )
        mesh = cls(executor, description, _token=_PRIVATE)
        mesh.world = world
        mesh._owns_group = owns
        return mesh

    @classmethod
    def _bootstrap(cls, executor: Executor, options: MeshOptions) -> Mesh:
        if dist.is_initialized():
            raise MeshError("mesh: this process already belongs to a torch.distributed world; one mesh per process")
        root = Path(os.fsdecode(options.directory)) / options.job
        facts = _host_facts(executor, options.multimem)
        kind = facts["kind"]
        if kind == "cuda":
            nccl_defaults(options.multimem)
            facts["nvls"] = os.environ.get("NCCL_NVLS_ENABLE", "")
        hosts = options.host_domain_count
        world = rendezvous(
            root,
            options.host_domain_index,
            hosts,
            facts,
            options.timeout_seconds,
            options.store,
            options.address,
        )
        per_host = facts["devices"]
        size = hosts * per_host
        first = options.host_domain_index * per_host
        ranks = tuple(range(first, first + per_host))
        if kind == "cuda":
            gpu_class = min(GPUClass.from_capability(*c) for h in world["hosts"] for c in h["capabilities"])
        else:
            gpu_class = GPUClass.CPU
        backend = "nccl" if kind == "cuda" else "gloo"
        description = MeshDescription(
            host_count=hosts,
            devices_per_host=per_host,
            world_size=size,
            ranks=ranks,
            host_index=options.host_domain_index,
            multimem_tier=effective_tier(options.multimem, backend, gpu_class, hosts),
            gpu_class=gpu_class,
            backend=backend,
        )
        mesh = cls(executor, description, _token=_PRIVATE)
        if "_server" in world:
            mesh._keep.append(world["_server"])
        hosts_of = [r // per_host for r in range(size)]
        if executor.has_workers():
            spec = {k: v for k, v in world.items() if not k.startswith("_")}
            _join_workers(
                executor, (spec, ranks, size, options.timeout_seconds, hosts_of, description, options.multimem)
            )
        else:
            mesh.world = join(world, ranks[0], size, executor.device, options.timeout_seconds, hosts_of)
            mesh._owns_group = True
        return mesh

    @classmethod
    def _member(cls, executor: Executor, description: MeshDescription, world: World) -> Mesh:
        """The mesh of one worker process of an executor of several devices: its own rank of the world."""
        mesh = cls(executor, description, _token=_PRIVATE)
        mesh.world = world
        mesh._owns_group = True
        return mesh

    # ---- queries -------------------------------------------------------------------------------------

    def describe(self) -> MeshDescription:
        """The hosts, devices, ranks, multicast tier and GPU class of the run."""
        self._check_open()
        return self._description

    @property
    def closed(self) -> bool:
        return self._closed

    def exchange(self, data: bytes) -> list[bytes]:
        """Every process's `data` (bytes), one entry per process of the run in process order (host-major): what a
        training loop's processes tell each other between two steps (a loader's position, a count, the lead's
        verdict). Every process calls it, between steps only (it uses the step's collectives' group)."""
        self._check_open()
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"data: expected bytes, got {type(data).__name__}")
        description = self._description
        per_process = len(description.ranks)
        if self.world is not None:
            blobs = self.world.all_gather_bytes(bytes(data))
        elif self.executor.has_workers() and self.executor.joined:
            # each of this process's workers sends the same bytes; worker 0's answer holds every rank's
            blobs = self.executor.workers.everyone(_exchange_worker, bytes(data))[0]
        else:
            raise MeshError("mesh: this process holds no rank of the world to exchange through")
        return [blobs[rank] for rank in range(0, description.world_size, per_process)]

    # ---- borrowing -------------------------------------------------------------------------------------

    def borrow(self, trainer: Any) -> None:
        """Marks `trainer` (anything with a `closed` attribute: a trainer, or a worker's replica) as made over
        this mesh: `close` is refused while it is open. Refused on a closed mesh."""
        self._check_open()
        self._borrowers.add(trainer)

    def release(self, trainer: Any) -> None:
        """Forgets a borrower (its close); releasing one never borrowed does nothing."""
        self._borrowers.discard(trainer)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("mesh: this mesh was closed")

    def close(self) -> None:
        """Leaves the world. Refused while a trainer made over the mesh is still open (the mesh outlives
        its trainers)."""
        if self._closed:
            return
        open_trainers = [t for t in self._borrowers if not getattr(t, "closed", False)]
        if open_trainers:
            raise ValueError(
                f"mesh: {len(open_trainers)} trainer(s) made over this mesh are still open; close them first "
                "(a mesh outlives its trainers)"
            )
        self._closed = True
        if self.executor.has_workers():
            self.executor.joined = False
            with contextlib.suppress(Exception):  # a dead worker has left already
                self.executor.workers.everyone(_leave_worker)
        if self.world is not None:
            self.world.unwatch()
        done = False  # the groups of an aborted NCCL world are not destroyed (they would wait for the dead)
        if self.world is not None and self.world.aborted and dist.is_initialized():
            # torch's bail-out for failed groups instead (destroy_process_group is for normal exits; pytorch
            # PR #132291): it forgets them without waiting on them. Not while an abort still runs, whose
            # communicator it would wait for: such a process leaves its groups to its exit.
            done = not self.world.settle(min(self.world.timeout, ABORT_SETTLE))
            if not done:
                with contextlib.suppress(Exception):
                    abort = dist.distributed_c10d._abort_process_group
                    abort(None if self._owns_group else self.world.gradients)
                    done = True
        if self.world is not None and not done and dist.is_initialized():
            with contextlib.suppress(Exception):
                if self._owns_group:
                    dist.destroy_process_group()
                else:  # the user's own default group stays; the gradient group was ours
                    dist.destroy_process_group(self.world.gradients)
        self.world = None
        self._keep.clear()
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        d = self._description
        return (
            f"Mesh(hosts={d.host_count}, devices_per_host={d.devices_per_host}, ranks={list(d.ranks)}, "
            f"backend={d.backend})"
        )


_PRIVATE = object()


# --------------------------------------------------------------------------------------------------
# The worker processes of an executor of several devices: each joins the world as a rank of its own


def _join_workers(executor: Executor, world: tuple[Any, ...]) -> None:
    """Makes worker i the rank `ranks[i]` of the world a rendezvous formed (`world`: the spec, the ranks, the
    size, the timeout, each rank's host, the description and the multicast tier)."""
    if executor.joined:
        raise MeshError("mesh: this executor's devices already belong to a mesh; close it first")
    spec, ranks, size, timeout, hosts_of, description, tier = world
    workers = executor.workers
    futures = workers.call([(_join_worker, (spec, rank, size, timeout, hosts_of, description, tier)) for rank in ranks])
    errors = []
    for future in futures:
        try:
            future.result()
        except BaseException as error:
            errors.append(error)
    if errors:
        with contextlib.suppress(Exception):
            workers.everyone(_leave_worker)
        raise errors[0]
    executor.joined = True


def _join_worker(state: dict[str, Any], device: torch.device, argument: Any, progress: Any) -> None:
    """In a worker (a `uform.runtime.workers.Verb`): forms its rank of the world, its mesh an executor of its one device."""
    world_spec, rank, size, timeout, hosts_of, description, tier = argument
    if device.type == "cuda":
        nccl_defaults(tier)
        executor = Executor.for_vram([device.index or 0])
    else:
        executor = Executor.cpu()
    world = join(world_spec, rank, size, device, timeout, hosts_of)
    state["mesh"] = Mesh._member(executor, dataclasses.replace(description, ranks=(rank,)), world)


def _leave_worker(state: dict[str, Any], device: torch.device, argument: Any, progress: Any) -> None:
    """In a worker (a `uform.runtime.workers.Verb`): its trainer closes (it borrows the mesh), then it leaves the world."""
    if state["trainer"] is not None:
        state["trainer"].close()
        state["trainer"] = None
    if state["mesh"] is not None:
        state["mesh"].close()
        state["mesh"] = None


def _exchange_worker(state: dict[str, Any], device: torch.device, argument: bytes, progress: Any) -> list[bytes]:
    """In a worker (a `uform.runtime.workers.Verb`): every rank's bytes, gathered over the world it joined."""
    mesh = state["mesh"]
    if mesh is None or mesh.world is None:
        raise MeshError("mesh: this device's worker belongs to no world")
    return mesh.world.all_gather_bytes(argument)
