"""The mesh: every device of every host of a run, as one `torch.distributed` world (docs/design.md §6).

Each host's process calls `Mesh.bootstrap(executor, MeshOptions(host_domain_index=h, host_domain_count=n,
directory=..., job=...))`. The hosts meet in files under `directory/job` (a directory every host sees, as
the `/shared/exchange` of UForm 4's trainer API's example):

1. Host 0 picks a fresh run id, creates `job/<run>/`, and publishes the id in `job/current.json` (written
   whole and renamed into place). Run directories of earlier runs of the job are removed.
2. Every host writes `job/<run>/host-<h>.json`: a fresh nonce, its device count, kind and compute
   capabilities; while it waits it rewrites `job/beat-<h>.json` every half second (its heartbeat).
3. Once every host is there, host 0 writes `job/<run>/world.json` naming each host's nonce. A host is in
   when world.json names its own nonce; a world.json naming other nonces is an earlier run's.
4. Every rank then meets in the run's store (a `FileStore` at `job/<run>/store`, or a `TCPStore` whose
   address world.json publishes) and forms the process group.

So files an earlier, killed run left behind never satisfy a new one (their nonces are not its, and their
heartbeats do not move), every wait has the options' deadline, and a host that never arrives makes every
other host fail with a `MeshError` naming the missing host indices.

A process started by `torchrun` (one device per process) takes its mesh from the environment instead:
`Mesh.from_env()`, or `Mesh.bootstrap` with no directory, reads RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK and MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..enums import GPUClass, MultimemTier
from .executor import Executor
from .world import MeshError, World

__all__ = ["Mesh", "MeshDescription", "MeshError", "MeshOptions"]

DEFAULT_TIMEOUT = 600.0
"""Seconds any wait of the mesh takes at most (the rendezvous, the store, every collective), unless set."""

HEARTBEAT = 0.5
"""Seconds between the rewrites of a waiting host's file."""

POLL = 0.05
"""Seconds between looks at the exchange directory."""

ABORT_SETTLE = 30.0
"""Seconds `Mesh.close` waits for the aborts of a failed NCCL world before it forgets its groups."""

_JOB = re.compile(r"[A-Za-z0-9._-]{1,128}")


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


def check_job(job: object) -> None:
    """A job names a directory on every host: letters, digits, '-', '_' and '.', not only dots."""
    if not isinstance(job, str):
        raise TypeError(f"job: expected a str, got {type(job).__name__}")
    if not _JOB.fullmatch(job) or set(job) == {"."}:
        raise ValueError(
            f"job: {job!r} is not a job name; use 1 to 128 letters, digits, '-', '_' and '.' (not only dots)"
        )


# --------------------------------------------------------------------------------------------------
# Files of the exchange directory


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Writes `path` whole: a temporary name in the same directory, then a rename over it."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    with open(temporary, "w") as f:
        json.dump(value, f)
    os.replace(temporary, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


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


def _missing(hosts: range, present: set[int]) -> str:
    missing = [h for h in hosts if h not in present]
    return ", ".join(str(h) for h in missing)


def rendezvous(
    root: Path, host: int, hosts: int, facts: dict[str, Any], timeout: float, store: str, address: str
) -> dict[str, Any]:
    """Meets the other hosts of the job whose directory is `root`; answers world.json's contents.

    Raises `MeshError` naming the missing hosts when the deadline passes first, or host 0's complaint when
    the hosts disagree (device counts, kinds, options)."""
    deadline = time.monotonic() + timeout
    nonce = secrets.token_hex(8)
    root.mkdir(parents=True, exist_ok=True)
    if host == 0:
        return _lead(root, hosts, facts, nonce, deadline, timeout, store, address)
    return _follow(root, host, hosts, facts, nonce, deadline, timeout)


class _Beat:
    """This host's heartbeat, `root/beat-<h>.json`, rewritten every HEARTBEAT seconds while it waits; and
    the others': a host is alive when its beat file changes while this one watches (a file an earlier run
    left behind never does)."""

    def __init__(self, root: Path, host: int, hosts: int, nonce: str) -> None:
        self.root, self.host, self.hosts, self.nonce = root, host, hosts, nonce
        self.count = 0
        self.last = -HEARTBEAT
        self.first: dict[int, Any] = {}
        self.alive = {host}

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last < HEARTBEAT:
            return
        self.last = now
        with contextlib.suppress(OSError):
            _write_json(self.root / f"beat-{self.host}.json", {"nonce": self.nonce, "beat": self.count})
        self.count += 1
        for h in range(self.hosts):
            if h in self.alive:
                continue
            record = _read_json(self.root / f"beat-{h}.json")
            value = None if record is None else (record.get("nonce"), record.get("beat"))
            if h not in self.first:
                self.first[h] = value
            elif value is not None and value != self.first[h]:
                self.alive.add(h)


def _lead(
    root: Path,
    hosts: int,
    facts: dict[str, Any],
    nonce: str,
    deadline: float,
    timeout: float,
    store: str,
    address: str,
) -> dict[str, Any]:
    run = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(6)}"
    here = root / run
    here.mkdir()
    for entry in root.iterdir():  # earlier runs of this job: their files can only confuse a late host
        if entry.is_dir() and entry.name != run:
            shutil.rmtree(entry, ignore_errors=True)
    beat = _Beat(root, 0, hosts, nonce)
    beat.tick()
    _write_json(here / "host-0.json", {"nonce": nonce, **facts})
    _write_json(root / "current.json", {"run": run, "hosts": hosts})
    arrived: dict[int, dict[str, Any]] = {0: {"nonce": nonce, **facts}}
    while len(arrived) < hosts:
        for h in range(1, hosts):
            if h not in arrived:
                record = _read_json(here / f"host-{h}.json")
                if record is not None and "nonce" in record:
                    arrived[h] = record
        if len(arrived) == hosts:
            break
        if time.monotonic() > deadline:
            raise MeshError(
                f"mesh: hosts {_missing(range(hosts), set(arrived))} of {hosts} never arrived in "
                f"{os.fsdecode(root)} within {timeout:g} s (host 0 waited for them)"
            )
        beat.tick()
        time.sleep(POLL)
    world: dict[str, Any] = {
        "run": run,
        "nonces": [arrived[h]["nonce"] for h in range(hosts)],
        "hosts": [{k: v for k, v in arrived[h].items() if k != "nonce"} for h in range(hosts)],
        "error": _disagreement(arrived, hosts),
        "store": {"kind": store},
    }
    if store == "tcp" and world["error"] is None:
        host_name = address or socket.gethostname()
        server = dist.TCPStore(
            host_name, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
        )
        world["store"] = {"kind": "tcp", "address": host_name, "port": server.port}
        world["_server"] = server
    _write_json(here / "world.json", {k: v for k, v in world.items() if not k.startswith("_")})
    if world["error"] is not None:
        raise MeshError(world["error"])
    world["root"] = str(root)
    return world


def _disagreement(arrived: dict[int, dict[str, Any]], hosts: int) -> str | None:
    first = arrived[0]
    for h in range(1, hosts):
        other = arrived[h]
        for key, what in (
            ("devices", "devices"),
            ("kind", "device kind"),
            ("multimem", "multimem option"),
            ("nvls", "NCCL_NVLS_ENABLE"),
        ):
            if other.get(key) != first.get(key):
                return (
                    f"mesh: host {h} has {what} {other.get(key)!r} but host 0 has {first.get(key)!r}; every host "
                    "of a run needs the same number and kind of devices and the same options"
                )
    return None


def _follow(
    root: Path, host: int, hosts: int, facts: dict[str, Any], nonce: str, deadline: float, timeout: float
) -> dict[str, Any]:
    joined: str | None = None
    beat = _Beat(root, host, hosts, nonce)
    while True:
        beat.tick()
        current = _read_json(root / "current.json")
        run = current.get("run") if current else None
        if isinstance(run, str) and re.fullmatch(r"[A-Za-z0-9-]+", run):
            if run != joined:
                with contextlib.suppress(OSError):  # host 0 may be removing a stale run's directory
                    (root / run).mkdir(exist_ok=True)
                    _write_json(root / run / f"host-{host}.json", {"nonce": nonce, **facts})
                    joined = run
            world = _read_json(root / run / "world.json")
            nonces = None if world is None else world.get("nonces")
            if isinstance(nonces, list) and len(nonces) == hosts and nonces[host] == nonce:
                assert world is not None
                if world.get("error"):
                    raise MeshError(world["error"])
                world["root"] = str(root)
                return world
        if time.monotonic() > deadline:
            raise MeshError(
                f"mesh: hosts {_missing(range(hosts), beat.alive)} of {hosts} never arrived in "
                f"{os.fsdecode(root)} within {timeout:g} s (host {host} waited for them)"
            )
        time.sleep(POLL)


# --------------------------------------------------------------------------------------------------
# The process group


def _store(world: dict[str, Any], ranks: int, timeout: float) -> Any:
    spec = world["store"]
    if spec["kind"] == "tcp":
        if "_server" in world:
            return world["_server"]
        return dist.TCPStore(
            spec["address"], int(spec["port"]), is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
    path = Path(world["root"]) / world["run"] / "store"
    store = dist.FileStore(str(path), ranks)
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


GROUP_SLACK = 90.0
"""Seconds an NCCL process group's own timeout exceeds the mesh's deadline. The world's watch aborts a
collective still unfinished at the deadline (`World.mark`); after the abort torch's watchdog finds it
finished. Were the group's timeout the deadline itself, the watchdog would time out every collective then
in flight, and for each one sleep 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (60 s at its default; pytorch PR
#150652) holding the group's work list, which any later destruction of the group waits for. 90 s is that
60 s and a margin: a communication error torch sees first costs one such sleep, after which the works
still listed must not yet have timed out."""


def group_timeout(backend: str, timeout: float) -> datetime.timedelta:
    """The process groups' own timeout for a mesh deadline of `timeout` seconds: the deadline on gloo (its
    collectives raise by themselves); on NCCL the deadline and GROUP_SLACK (the world's watch keeps the
    deadline)."""
    return datetime.timedelta(seconds=timeout + (GROUP_SLACK if backend == "nccl" else 0.0))


ASYNC_ERROR_HANDLING = "2"
"""The library's TORCH_NCCL_ASYNC_ERROR_HANDLING: 2, torch's CleanUpOnly (abort the communicators of a failed
or timed-out collective, leave the process alive). torch's default, 3 (SkipCleanUp), ends the whole process
from its watchdog thread when a collective times out, so a survivor of a dead peer would die instead of
raising `MeshError`, should torch see a failure before the world's own watch does (`World.watch`: a
communication error torch reads from NCCL, a collective the world did not launch); 0 would leave such a
collective's kernels waiting. Sources: docs/decisions.md ("NCCL faults")."""


def nccl_defaults(tier: MultimemTier) -> None:
    """The library's NCCL settings, each only where the user did not set the variable: NVLink multicast
    off unless asked for (NCCL_NVLS_ENABLE=0), and failed collectives cleaned up without ending the process
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=2). torch reads the latter when a process group is made, so this runs
    before every `init_process_group` / `new_group` of an NCCL world."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "1" if tier != MultimemTier.Off else "0")
    if tier == MultimemTier.Domain:
        os.environ.setdefault("NCCL_MNNVL_ENABLE", "1")
    if "NCCL_ASYNC_ERROR_HANDLING" not in os.environ:  # torch's older spelling, which it still reads
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", ASYNC_ERROR_HANDLING)


def effective_tier(requested: MultimemTier, backend: str, gpu_class: GPUClass, hosts: int) -> MultimemTier:
    """The tier the run's collectives use: none off CUDA or below Hopper, none when NCCL_NVLS_ENABLE is 0;
    the environment turning it on reaches one host; a one-host run's Domain is its Host."""
    if backend != "nccl" or gpu_class < GPUClass.Hopper:
        return MultimemTier.Off
    setting = os.environ.get("NCCL_NVLS_ENABLE", "0")
    if setting == "0":
        return MultimemTier.Off
    tier = requested if requested != MultimemTier.Off else MultimemTier.Host
    if hosts == 1:
        tier = min(tier, MultimemTier.Host)
    return tier


def join(
    world: dict[str, Any], rank: int, ranks: int, device: torch.device, timeout: float, hosts_of: list[int]
) -> World:
    """Forms (in this process) the process group of the rendezvous `world` as `rank` of `ranks`, on
    `device`; answers this process's `World`. Waits for every rank in the store first, so that a rank that
    never comes is named (with its host) instead of timing out anonymously."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    store = _store(world, ranks, timeout)
    prefixed = dist.PrefixStore(f"uform/{world['run']}/", store)
    prefixed.set(f"arrived/{rank}", "1")
    keys = [f"arrived/{r}" for r in range(ranks)]
    try:
        prefixed.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as error:
        missing = [r for r in range(ranks) if not prefixed.check([f"arrived/{r}"])]
        hosts = sorted({hosts_of[r] for r in missing})
        raise MeshError(
            f"mesh: ranks {missing} (hosts {hosts}) never joined the world within {timeout:g} s ({error})"
        ) from None
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg/", prefixed),
        rank=rank,
        world_size=ranks,
        timeout=group_timeout(backend, timeout),
        device_id=device if backend == "nccl" else None,
    )
    return _world_member(backend, device, timeout)


def _world_member(backend: str, device: torch.device, timeout: float) -> World:
    """This process's `World` over the default process group just formed: a second group of the same ranks for
    the gradient buckets, and its watch started (NCCL only)."""
    gradients = dist.new_group(backend=backend, timeout=group_timeout(backend, timeout))
    member = World(
        rank=dist.get_rank(),
        size=dist.get_world_size(),
        backend=backend,
        device=device,
        timeout=timeout,
        group=None,
        gradients=gradients,
    )
    member.watch()
    return member


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
        world = _world_member(backend, device, options.timeout_seconds)
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
