"""`uform.replica.memory`: a run's memory estimate against measured memory, and `init_vram`'s check against the device."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import uform
import uform.replica.memory as memory
import uform.replica.replica
from uform import (
    BatchShape,
    Edges,
    Executor,
    ImageShape,
    LateInteraction,
    MemoryWarning,
    Objective,
    Relations,
    Schedule,
    Trainer,
    TrainerInitVramConfig,
    TrainerStepConfig,
    resolve,
)
from uform.model.network import Network
from uform.notices import Notices

torch.set_num_threads(2)

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def geometry(depth: int, hidden: int, rows: int, columns: int, segments: int, **extra) -> TrainerInitVramConfig:
    return TrainerInitVramConfig(
        depth=depth,
        hidden=hidden,
        objective=Objective.Joint,
        batch=BatchShape(max_rows_per_device=rows, max_segments_per_device=segments, max_columns_per_row=columns),
        schedule=Schedule(steps=10),
        seed=1,
        **extra,
    )


REFERENCE = geometry(12, 512, 64, 1024, 256)
"""The reference geometry (docs/design.md §1; the README's training run, which a 24 GB CPU machine's kernel killed)."""


def full_step(segments: int, columns: int, rows: int) -> tuple[list[str], list[bytes], TrainerStepConfig]:
    """Items that fill every row of a step, in attracting pairs."""
    length = columns // (segments // rows) - 8
    texts = [("ab cd " * columns)[:length].encode()] * segments
    relations = Relations(attract=Edges(offsets=list(range(segments + 1)), ids=[i ^ 1 for i in range(segments)]))
    return ["text"] * segments, texts, TrainerStepConfig(relations=relations)


@pytest.mark.parametrize(
    "config",
    [
        geometry(1, 128, 2, 64, 8),
        geometry(3, 256, 2, 64, 8, late_interaction=LateInteraction(weight=0.5, width=64)),
        dataclasses.replace(
            geometry(2, 128, 2, 64, 8),
            batch=BatchShape(
                max_rows_per_device=2, max_segments_per_device=8, max_columns_per_row=64, image=ImageShape(patch_side=8)
            ),
        ),
    ],
)
def test_parameter_count_is_the_networks(config: TrainerInitVramConfig) -> None:
    resolved = resolve(config)
    assert memory.parameter_count(resolved) == sum(p.numel() for p in Network(resolved).parameters())
    estimate = memory.estimate_memory(resolved, "cpu")
    assert estimate.moments == 2 * estimate.parameters == 2 * estimate.gradients


def test_cpu_activations_hold_what_autograd_saves() -> None:
    """Counted with saved_tensors_hooks over a step at a geometry the constants were not measured at: the
    estimate covers the saved tensors and stays within 1.5 times them (the rest is backward's transients)."""
    depth, hidden, rows, columns, segments = 3, 256, 4, 384, 12
    executor = Executor.cpu()
    trainer = Trainer.init_vram(executor, geometry(depth, hidden, rows, columns, segments))
    try:
        weights = {p.untyped_storage().data_ptr() for p in trainer.network.parameters()}
        saved: dict[int, int] = {}

        def pack(x: torch.Tensor) -> torch.Tensor:
            storage = x.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return x

        losses = trainer.replica._losses

        def counted(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                return losses(*args, **kwargs)

        trainer.replica._losses = counted
        trainer.on(executor).step(*full_step(segments, columns, rows))
    finally:
        trainer.close()
    measured = sum(saved.values())
    estimate = memory.estimate_memory(trainer.config, "cpu").activations
    assert measured <= estimate <= 1.5 * measured, (measured, estimate)


_PEAK = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import test_memory as t
from uform import Executor, Trainer
torch.set_num_threads(2)
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
config = t.geometry(2, 256, 8, 512, 16)
executor = Executor.cpu()
trainer = Trainer.init_vram(executor, config)
before = status("VmRSS:")
trainer.on(executor).step(*t.full_step(16, 512, 8))
print(json.dumps({"peak": status("VmHWM:") - before}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak resident set from /proc")
def test_cpu_estimate_is_a_steps_peak_memory_within_a_factor() -> None:
    """A fresh process's peak resident memory over its first step (weights' gradients and moments, activations,
    backward) against the estimate of what that step adds to the built network: within a factor of 1.5."""
    result = subprocess.run(
        [sys.executable, "-c", _PEAK, str(ROOT / "tests")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    peak = json.loads(result.stdout.strip().splitlines()[-1])["peak"]
    estimate = memory.estimate_memory(resolve(geometry(2, 256, 8, 512, 16)), "cpu")
    added = estimate.total - estimate.parameters
    assert added / 1.5 <= peak <= added * 1.5, (peak, added)


def test_reference_geometry_is_tens_of_gib_on_the_cpu_and_fits_an_h200() -> None:
    reference = resolve(REFERENCE)
    cpu, cuda = memory.estimate_memory(reference, "cpu"), memory.estimate_memory(reference, "cuda")
    assert cpu.total > 24 * GIB  # what killed the README's snippet on a 24 GB machine
    # Measured on an H200 (torch 2.11, compiled): 0.53 GB of weights and moments, 17.38 GB more at its peak.
    assert 0.9 * 17.91e9 <= cuda.total <= 1.1 * 17.91e9
    assert cpu.activations > cuda.activations  # float32 and the dense path's C x C masks


def test_the_reference_geometry_warns_on_a_small_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's old snippet, on a CPU machine with 8 GiB available: a MemoryWarning naming the fields to
    shrink, once (a second run counts without showing it again), and the run is still built."""
    monkeypatch.setattr(memory, "available_memory", lambda device: 8 * GIB)
    monkeypatch.setattr(memory, "_NOTICES", Notices())
    executor = Executor.cpu()
    with pytest.warns(MemoryWarning, match=r"batch\.max_rows_per_device \(64\) or batch\.max_columns_per_row") as shown:
        trainer = Trainer.init_vram(executor, REFERENCE)
    trainer.close()
    assert "8.0 GiB available" in str(shown[0].message) and "out-of-memory killer" in str(shown[0].message)
    small = geometry(12, 512, 60, 1024, 240)  # still too large, overshooting less: counted, not shown
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryWarning)
        memory.check_memory(resolve(small), torch.device("cpu"))
    assert memory._NOTICES.count("memory") == 2


def test_a_fake_cuda_budget_refuses_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """init_vram on a CUDA device with 8 GiB free: ValueError naming the fields, raised before a network
    exists (nothing allocated, nothing to undo)."""
    monkeypatch.setattr(memory, "available_memory", lambda device: 8 * GIB)
    executor = Executor.cpu()
    monkeypatch.setattr(executor, "devices", (torch.device("cuda", 0),))

    def built(*args, **kwargs):
        raise AssertionError("the network was built before the memory check refused")

    monkeypatch.setattr(uform.replica.replica, "Network", built)
    with pytest.raises(ValueError, match=r"^memory: .* on cuda:0 .* 8\.0 GiB available; shrink batch\.max_rows"):
        Trainer.init_vram(executor, REFERENCE)
    # Weights dominate a deep, wide run with a small batch: depth and hidden come first.
    wide = resolve(geometry(48, 4096, 1, 64, 2))
    with pytest.raises(ValueError, match=r"shrink depth \(48\) or hidden \(4096\), then batch"):
        memory.check_memory(wide, torch.device("cuda", 0), available=8 * GIB)


def test_a_run_that_fits_passes_silently() -> None:
    config = resolve(geometry(1, 128, 2, 64, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        estimate = memory.check_memory(config, torch.device("cpu"), available=64 * GIB, notices=Notices())
    assert 0 < estimate.total < 64 * GIB


def test_media_buffers_count_at_capacity() -> None:
    text = resolve(geometry(1, 128, 2, 64, 8))
    images = resolve(
        dataclasses.replace(text, batch=dataclasses.replace(text.batch, image=ImageShape(patch_side=16, channels=4)))
    )
    assert memory.estimate_memory(text, "cpu").media == 0
    assert memory.estimate_memory(images, "cpu").media == 2 * 64 * 16 * 16 * 4 * memory.MEDIA_UNIT_BYTES


def test_available_memory_on_this_machine() -> None:
    have = memory.available_memory(torch.device("cpu"))
    if not os.path.exists("/proc/meminfo"):
        assert have is None
        return
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert have is not None and 0 < have <= total


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_refuses_a_run_larger_than_the_device() -> None:
    _free, total = torch.cuda.mem_get_info(0)
    rows = int(total // (1024 * 512 * 42 * 12)) + 64  # a row of 1024 columns holds ~42 B x 512 x 12 blocks a column
    with pytest.raises(ValueError, match=r"^memory: .*shrink batch\.max_rows_per_device"):
        Trainer.init_vram(Executor.for_vram([0]), geometry(12, 512, rows, 1024, rows * 4))
