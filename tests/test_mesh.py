"""The mesh in one process: options, job names, the file rendezvous (hosts as threads), deadlines naming
the missing hosts, stale files of earlier runs, a one-host world, and a trainer borrowing its mesh.

The multi-process worlds (bootstrap of 2 to 4 processes, torchrun, the world step) are in test_world.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same, make_config, snapshot, step_with

import uform
from uform import Executor, GPUClass, Mesh, MeshError, MeshOptions, MultimemTier, Trainer
from uform.runtime.mesh import _resolve
from uform.runtime.process_group import effective_tier
from uform.runtime.rendezvous import check_job, rendezvous

FACTS = {"devices": 1, "kind": "cpu", "capabilities": [], "multimem": 0, "nvls": "", "hostname": "h", "pid": 1}


def meet(root: Path, hosts: int, present: list[int], timeout: float, facts: dict[int, dict] | None = None) -> dict:
    """Runs `rendezvous` for the hosts in `present`, one thread each; answers each host's world or error."""
    out: dict[int, Any] = {}

    def host(h: int) -> None:
        try:
            out[h] = rendezvous(root, h, hosts, (facts or {}).get(h, FACTS), timeout, "file", "")
        except Exception as error:
            out[h] = error

    threads = [threading.Thread(target=host, args=(h,)) for h in present]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out


# --------------------------------------------------------------------------------------------------
# Names and options


@pytest.mark.parametrize("job", ["run-17", "a", "A.b_c-9", "x" * 128, "..a", "v1.2"])
def test_good_job_names(job: str) -> None:
    check_job(job)


@pytest.mark.parametrize("job", ["", ".", "..", "a/b", "a b", "x" * 129, "é", "run\n", "../up", "a\\b", "*"])
def test_bad_job_names_are_refused(job: str) -> None:
    with pytest.raises(ValueError, match="job"):
        check_job(job)


def test_a_job_name_must_be_a_str() -> None:
    with pytest.raises(TypeError, match="job"):
        check_job(b"run")


@pytest.mark.parametrize(
    ("options", "error", "field"),
    [
        (MeshOptions(host_domain_index=2, host_domain_count=2), ValueError, "host_domain_index"),
        (MeshOptions(host_domain_index=-1), ValueError, "host_domain_index"),
        (MeshOptions(host_domain_count=-2), ValueError, "host_domain_count"),
        (MeshOptions(host_domain_count=True), TypeError, "host_domain_count"),
        (MeshOptions(job="a/b"), ValueError, "job"),
        (MeshOptions(timeout_seconds=-1.0), ValueError, "timeout_seconds"),
        (MeshOptions(timeout_seconds=float("nan")), ValueError, "timeout_seconds"),
        (MeshOptions(store="redis"), ValueError, "store"),
        (MeshOptions(directory=3), TypeError, "directory"),
        (MeshOptions(multimem="everywhere"), ValueError, "multimem"),
    ],
)
def test_bad_options_are_refused(options: MeshOptions, error: type[Exception], field: str) -> None:
    with pytest.raises(error, match=field):
        _resolve(options)


def test_options_derive_their_zeros() -> None:
    resolved = _resolve(MeshOptions())
    assert resolved.host_domain_count == 1 and resolved.job == "uform" and resolved.store == "file"
    assert resolved.timeout_seconds == 600.0 and resolved.multimem == MultimemTier.Off


def test_several_hosts_need_a_directory(executor: Executor, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="directory"):
        Mesh.bootstrap(executor, MeshOptions(host_domain_count=2))


def test_from_env_outside_torchrun_says_so(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(MeshError, match="torchrun"):
        Mesh.from_env()


def test_mesh_is_made_by_its_constructors_only(executor: Executor) -> None:
    with pytest.raises(TypeError, match="bootstrap"):
        Mesh(executor, None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Enumerations


def test_gpu_classes_follow_compute_capability() -> None:
    table = {
        (6, 1): GPUClass.Legacy,
        (7, 0): GPUClass.Volta,
        (7, 5): GPUClass.Turing,
        (8, 0): GPUClass.Ampere,
        (8, 6): GPUClass.Ampere,
        (8, 9): GPUClass.Ada,
        (9, 0): GPUClass.Hopper,
        (10, 0): GPUClass.Blackwell,
        (12, 0): GPUClass.Ada,
    }
    for capability, expected in table.items():
        assert GPUClass.from_capability(*capability) is expected, capability
    assert GPUClass.CPU == 0 and str(GPUClass.Hopper) == "hopper" and GPUClass.parse("ampere") is GPUClass.Ampere


def test_multicast_stays_off_unless_asked(monkeypatch) -> None:
    assert MultimemTier.Off == 0 and [m.name for m in MultimemTier] == ["Off", "Host", "Domain"]
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert effective_tier(MultimemTier.Host, "nccl", GPUClass.Hopper, 2) is MultimemTier.Off
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert effective_tier(MultimemTier.Domain, "nccl", GPUClass.Hopper, 2) is MultimemTier.Domain
    assert effective_tier(MultimemTier.Domain, "nccl", GPUClass.Hopper, 1) is MultimemTier.Host
    assert effective_tier(MultimemTier.Host, "nccl", GPUClass.Ampere, 2) is MultimemTier.Off
    assert effective_tier(MultimemTier.Host, "gloo", GPUClass.CPU, 2) is MultimemTier.Off


def test_seed_names_are_exported() -> None:
    for name in ("Mesh", "MeshOptions", "MeshDescription", "MultimemTier", "GPUClass", "MeshError"):
        assert getattr(uform, name) is not None and name in uform.__all__


# --------------------------------------------------------------------------------------------------
# The file rendezvous


def test_hosts_meet_and_agree(tmp_path: Path) -> None:
    worlds = meet(tmp_path / "job", 3, [0, 1, 2], timeout=20)
    runs = {h: w["run"] for h, w in worlds.items()}
    assert len(set(runs.values())) == 1, worlds
    assert all(len(w["nonces"]) == 3 and w["error"] is None for w in worlds.values())


def test_a_host_that_never_arrives_is_named_on_every_other_host(tmp_path: Path) -> None:
    start = time.monotonic()
    worlds = meet(tmp_path / "job", 3, [0, 1], timeout=2.0)
    assert time.monotonic() - start < 10
    for h in (0, 1):
        error = worlds[h]
        assert isinstance(error, MeshError), error
        assert "hosts 2 of 3 never arrived" in str(error), error


def test_a_missing_host_zero_is_named_even_over_its_stale_files(tmp_path: Path) -> None:
    root = tmp_path / "job"
    meet(root, 3, [0, 1, 2], timeout=20)  # an earlier run, whose files stay behind
    worlds = meet(root, 3, [1, 2], timeout=2.5)
    for h in (1, 2):
        assert isinstance(worlds[h], MeshError), worlds[h]
        assert "hosts 0 of 3 never arrived" in str(worlds[h]), worlds[h]


def test_stale_files_of_a_killed_run_do_not_block_a_new_one(tmp_path: Path) -> None:
    root = tmp_path / "job"
    root.mkdir()
    # What a killed run leaves: its current.json, a run directory with host files, a world naming other
    # nonces, a half-written store file and heartbeats that no longer move.
    old = root / "20200101-000000-deadbeef0000"
    old.mkdir()
    (root / "current.json").write_text(json.dumps({"run": old.name, "hosts": 2}))
    for h in range(2):
        (old / f"host-{h}.json").write_text(json.dumps({"nonce": f"old{h}", **FACTS}))
        (root / f"beat-{h}.json").write_text(json.dumps({"nonce": f"old{h}", "beat": 7}))
    (old / "world.json").write_text(json.dumps({"run": old.name, "nonces": ["old0", "old1"], "error": None}))
    (old / "store").write_bytes(b"\x00garbage")
    (root / "current.json.partial").write_text("{")

    results: dict[int, Any] = {}

    def late_host_zero() -> None:
        time.sleep(1.0)  # host 1 arrives first and reads the stale current.json
        results.update(meet(root, 2, [0], timeout=20))

    thread = threading.Thread(target=late_host_zero)
    thread.start()
    results.update(meet(root, 2, [1], timeout=20))
    thread.join()
    assert not isinstance(results[0], Exception) and not isinstance(results[1], Exception), results
    assert results[0]["run"] == results[1]["run"] != old.name
    assert not old.exists(), "the killed run's directory is removed by the new host 0"


def test_hosts_that_disagree_fail_together_at_once(tmp_path: Path) -> None:
    two = dict(FACTS, devices=2)
    start = time.monotonic()
    worlds = meet(tmp_path / "job", 2, [0, 1], timeout=30, facts={1: two})
    assert time.monotonic() - start < 10
    for h in (0, 1):
        assert isinstance(worlds[h], MeshError) and "host 1 has devices 2 but host 0 has 1" in str(worlds[h])


# --------------------------------------------------------------------------------------------------
# A one-host world in this process


@pytest.fixture
def lone_mesh(executor: Executor):
    mesh = Mesh.bootstrap(executor, MeshOptions(timeout_seconds=30))
    try:
        yield mesh
    finally:
        for trainer in list(mesh._borrowers):
            trainer.close()
        mesh.close()


def test_a_one_host_world_describes_itself(lone_mesh: Mesh) -> None:
    d = lone_mesh.describe()
    assert (d.host_count, d.devices_per_host, d.world_size, d.ranks, d.host_index) == (1, 1, 1, (0,), 0)
    assert d.gpu_class is GPUClass.CPU and d.multimem_tier is MultimemTier.Off and d.backend == "gloo"
    assert isinstance(d, uform.MeshDescription)


def test_a_world_of_one_trains_as_one_process_alone(lone_mesh: Mesh, make_trainer, tmp_path: Path) -> None:
    alone = make_trainer()
    meshed = Trainer.init_vram(lone_mesh.executor, make_config(mesh=lone_mesh))
    for _ in range(2):
        a, _ = step_with(alone)
        b, _ = step_with(meshed)
        assert a == b
    assert_same(snapshot(alone), snapshot(meshed))
    meshed.save(tmp_path / "one.safetensors")  # process zero writes
    assert (tmp_path / "one.safetensors").exists()
    meshed.close()


def test_the_mesh_outlives_its_trainers(lone_mesh: Mesh) -> None:
    trainer = Trainer.init_vram(lone_mesh.executor, make_config(mesh=lone_mesh))
    with pytest.raises(ValueError, match="still open"):
        lone_mesh.close()
    trainer.close()
    lone_mesh.close()
    assert lone_mesh.closed
    with pytest.raises(ValueError, match="closed"):
        lone_mesh.describe()
    with pytest.raises(ValueError, match="closed"):
        Trainer.init_vram(lone_mesh.executor, make_config(mesh=lone_mesh))


def test_a_mesh_over_another_executor_is_refused(lone_mesh: Mesh) -> None:
    with pytest.raises(ValueError, match="mesh: it was made over"):
        Trainer.init_vram(Executor.cpu(), make_config(mesh=lone_mesh))


def test_one_mesh_per_process(lone_mesh: Mesh, executor: Executor) -> None:
    with pytest.raises(MeshError, match="already belongs"):
        Mesh.bootstrap(executor, MeshOptions(timeout_seconds=5))
    assert torch.distributed.is_initialized()


def test_a_rank_that_never_joins_the_store_is_named(tmp_path: Path) -> None:
    """Past the rendezvous, every rank announces itself in the run's store before the process group forms:
    one that never does is named with its host at the deadline (here rank 1 of host 1 never comes)."""
    from uform.runtime.process_group import join

    (tmp_path / "run-1").mkdir()
    world = {"run": "run-1", "root": str(tmp_path), "store": {"kind": "file"}}
    start = time.monotonic()
    with pytest.raises(MeshError, match=r"ranks \[1\] \(hosts \[1\]\) never joined"):
        join(world, 0, 2, torch.device("cpu"), 1.5, [0, 1])
    assert time.monotonic() - start < 10
    assert not torch.distributed.is_initialized()


def test_the_gradient_reducer_keeps_unused_parameters_gradless(lone_mesh: Mesh) -> None:
    """Buckets of one parameter each, backward reaching two of three: the sums land in .grad (a world of one
    sums to the gradient itself) and the parameter no process used keeps grad None, step after step."""
    from uform.runtime.world import GradientReducer

    world = lone_mesh.world
    assert world is not None
    a, b, c = (torch.nn.Parameter(torch.randn(5)) for _ in range(3))
    reducer = GradientReducer([c, b, a], world, bucket_bytes=1)
    assert len(reducer.buckets) == 3
    for scale in (1.0, 2.0):
        reducer.arm()
        (scale * (a * a).sum() + (b * 3).sum()).backward()
        reducer.finish()
        assert torch.allclose(a.grad, 2 * scale * a.detach()) and torch.allclose(b.grad, torch.full((5,), 3.0))
        assert c.grad is None
        a.grad = b.grad = None
    reducer.close()
