"""The hosts of a run meeting in files (docs/design.md §6): every host's process calls `rendezvous` on the job's
folder of a directory every host sees, and the hosts agree on one world.json (`uform.runtime.mesh` forms the
process group from it, `uform.runtime.process_group`).

1. Host 0 picks a fresh run id, creates `job/<run>/`, and publishes the id in `job/current.json` (written
   whole and renamed into place). Run directories of earlier runs of the job are removed.
2. Every host writes `job/<run>/host-<h>.json`: a fresh nonce, its device count, kind and compute
   capabilities; while it waits it rewrites `job/beat-<h>.json` every half second (its heartbeat).
3. Once every host is there, host 0 writes `job/<run>/world.json` naming each host's nonce. A host is in
   when world.json names its own nonce; a world.json naming other nonces is an earlier run's. Under store
   'tcp' host 0 also serves a `TCPStore` and publishes its address there.

So files an earlier, killed run left behind never satisfy a new one (their nonces are not its, and their
heartbeats do not move), every wait has the deadline, and a host that never arrives makes every other host fail
with a `MeshError` naming the missing host indices.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .world import MeshError

__all__ = ["HEARTBEAT", "POLL", "check_job", "rendezvous"]

HEARTBEAT = 0.5
"""Seconds between the rewrites of a waiting host's file."""

POLL = 0.05
"""Seconds between looks at the exchange directory."""

_JOB = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_job(job: object) -> None:
    """A job names a directory on every host: letters, digits, '-', '_' and '.', not only dots."""
    if not isinstance(job, str):
        raise TypeError(f"job: expected a str, got {type(job).__name__}")
    if not _JOB.fullmatch(job) or set(job) == {"."}:
        raise ValueError(
            f"job: {job!r} is not a job name; use 1 to 128 letters, digits, '-', '_' and '.' (not only dots)"
        )


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
