"""The process group of a run's world: every rank meets in the store the rendezvous named
(`uform.runtime.rendezvous`: a `FileStore` in the job's folder, or host 0's `TCPStore`), then forms the default
group and a second one for the gradient buckets; and the library's NCCL settings and timeouts around them.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..enums import GPUClass, MultimemTier
from .world import MeshError, World

__all__ = [
    "ASYNC_ERROR_HANDLING",
    "GROUP_SLACK",
    "effective_tier",
    "group_timeout",
    "join",
    "nccl_defaults",
    "world_member",
]


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
    return world_member(backend, device, timeout)


def world_member(backend: str, device: torch.device, timeout: float) -> World:
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
