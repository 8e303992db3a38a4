"""`uform train` under torchrun (issue 13, item 7): every process reads only its own share of the records, the
lead alone writes the run's folder, and the checkpoint holds every process's data position merged, so a run
stopped and resumed under torchrun equals the straight one bitwise, and an executor of two devices in one
process continues from it. Worlds of two gloo processes on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import uform
from uform import Executor
from uform.replica.checkpoint import read_checkpoint
from uform.replica.stored_run import read_data_state
from uform.run_config import read_run_config
from uform.run_dir import read_metrics
from uform.sources import Loader, open_source

ROOT = Path(__file__).resolve().parents[1]
PAIRS = str(ROOT / "examples" / "text_pairs.toml")
STEPS = ["--set", "trainer.schedule.steps=4"]


def torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    environment["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return subprocess.run(
        [*command, "-m", "uform", "train", PAIRS, *STEPS, *args],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(str(path), None, 10, "cpu")[0]


def last(run: Path) -> Path:
    return run / "checkpoints" / "step-00000004.safetensors"


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """The module's runs (under the folder answered): straight, and split by a stop after step 2 and a resume; and
    the stopped launch, whose output shows that the lead alone prints (one launch fewer than a run of its own)."""
    root = tmp_path_factory.mktemp("torchrun")
    straight = torchrun(root, "--output", "straight")
    assert straight.returncode == 0, straight.stderr[-4000:]
    first = torchrun(root, "--output", "split", "--stop-after", "2")
    assert first.returncode == 0, first.stderr[-4000:]
    rest = torchrun(root, "--output", "split", "--resume", "latest")
    assert rest.returncode == 0, rest.stderr[-4000:]
    return root, first


@pytest.fixture(scope="module")
def runs(launches: tuple[Path, subprocess.CompletedProcess]) -> Path:
    return launches[0]


def test_stopped_and_resumed_under_torchrun_equals_the_straight_run_bitwise(runs: Path) -> None:
    straight, split = tensors(last(runs / "straight")), tensors(last(runs / "split"))
    assert sorted(straight) == sorted(split)
    for name in straight:
        assert torch.equal(straight[name], split[name]), name

    def losses(run: str) -> list[tuple[int, float]]:  # the step records (the example's evaluations beside them)
        return [(r["step"], r["loss"]) for r in read_metrics(runs / run / "metrics.jsonl") if r["kind"] == "step"]

    assert losses("split") == losses("straight")
    assert [step for step, _ in losses("split")] == [1, 2, 3, 4]  # one writer: the lead's records, once each
    evaluated = [r["step"] for r in read_metrics(runs / "split" / "metrics.jsonl") if r["kind"] == "eval"]
    assert evaluated == [2, 4]  # each call's last step, every process evaluating, the lead writing


def test_the_checkpoint_holds_both_processes_positions_merged(runs: Path) -> None:
    state = read_data_state(str(runs / "split" / "checkpoints" / "step-00000002.safetensors"))
    assert state is not None and sorted(state["shares"]) == ["0", "1"]
    # What two rank loaders hold after two steps, merged: the very position the checkpoint stores.
    run = read_run_config(PAIRS, ["trainer.schedule.steps=4"])
    assert run.data is not None
    source = open_source(list(run.data.train), fields=dict(run.data.fields))
    ranks = [Loader(source, run.trainer, rank=r, world=2, devices=2) for r in range(2)]
    items = 0
    for loader in ranks:
        for _ in range(2):
            items += len(loader.next_step().contents)
    expected = uform.sources.merge_states([loader.state() for loader in ranks])
    assert state == expected
    # Items are the world's: both processes' items each step, counted once in the lead's records.
    logged = read_metrics(runs / "split" / "metrics.jsonl")
    assert sum(r["items"] for r in logged if r["kind"] == "step" and r["step"] <= 2) == items


def test_a_torchrun_checkpoint_resumes_on_an_executor_of_two_devices(runs: Path, tmp_path: Path) -> None:
    # The same world of two, in one process: its steps route bags by size, so agreement is to fp32 noise.
    copy = tmp_path / "copy"
    (copy / "checkpoints").mkdir(parents=True)
    for name in ("config.toml", "metrics.jsonl"):
        (copy / name).write_bytes((runs / "split" / name).read_bytes())
    middle = "step-00000002.safetensors"
    (copy / "checkpoints" / middle).write_bytes((runs / "split" / "checkpoints" / middle).read_bytes())
    executor = Executor.cpu(workers=2)
    try:
        summary = uform.fit(PAIRS, copy, overrides=STEPS[1:], resume="latest", devices=executor, log=None)
    finally:
        executor.close()
    assert (summary.step, summary.taken) == (4, 2)
    straight = tensors(last(runs / "straight"))
    resumed = tensors(last(copy))
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-4)
    assert read_data_state(str(last(copy))) == read_data_state(str(last(runs / "straight")))


def test_only_the_lead_prints_and_devices_are_refused_under_torchrun(
    launches: tuple[Path, subprocess.CompletedProcess], tmp_path: Path
) -> None:
    refused = torchrun(tmp_path, "--output", "x", "--devices", "cpu:2")
    assert refused.returncode != 0
    assert "--devices: under torchrun" in refused.stderr
    assert not (tmp_path / "x").exists()
    stopped = launches[1]  # the split run's first launch: `--stop-after 2`, exit status 0 (the fixture checks it)
    assert stopped.returncode == 0, stopped.stderr[-4000:]
    assert stopped.stdout.count("uform train: stopped at step 2 of 4") == 1


def test_a_lead_refusal_stops_every_process(runs: Path) -> None:
    # The folder holds a run already: the lead refuses it, and so does the other process, instead of waiting.
    clash = torchrun(runs, "--output", "straight")
    assert clash.returncode != 0
    assert clash.stderr.count("already holds files") == 2
