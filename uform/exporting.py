"""`uform.export`: a trainer checkpoint made into a model folder others can use (`uform export`).

The folder (`replica.stored_model` pins its format) holds `model.safetensors` (weights only: the optimizer's
moments are dropped), `config.json` (the resolved run), a generated `README.md` model card (`model_card`) and,
with `onnx=True`, `model.onnx` (`onnx_export`). `uform.load(folder)` serves it as it serves the checkpoint: the
same weights under the same config, so the same vectors, bit for bit on the CPU.

The checkpoint is read through every check a resume makes (header, stored run, digest) before anything is written.
The folder is written whole into a temporary sibling and renamed into place, so `out_dir` holds a complete export
or nothing; an `out_dir` that exists and holds files is refused (`FileExistsError`) and left as it was.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil

from .config import to_json
from .model.network import Network
from .model_card import model_card
from .onnx_export import write_onnx
from .replica.run_schema import stored_weights
from .replica.stored_model import CONFIG_FILE, ONNX_FILE, write_model
from .replica.stored_run import read_run_tensors, read_stored_run
from .run_dir import CHECKPOINTS_NAME, CONFIG_NAME, METRICS_NAME, read_metrics

__all__ = ["CARD_FILE", "export", "last_evaluation"]

CARD_FILE = "README.md"


def last_evaluation(checkpoint: str) -> dict | None:
    """The last `kind: "eval"` record of the run folder holding `checkpoint` (`DIR/checkpoints/<file>`, where
    `DIR/config.toml` and `DIR/metrics.jsonl` exist), or None where it is not in a run folder or logged none."""
    folder = os.path.dirname(os.path.abspath(checkpoint))
    if os.path.basename(folder) != CHECKPOINTS_NAME:
        return None
    run = os.path.dirname(folder)
    metrics = os.path.join(run, METRICS_NAME)
    if not (os.path.isfile(os.path.join(run, CONFIG_NAME)) and os.path.isfile(metrics)):
        return None
    evals = [r for r in read_metrics(metrics) if r.get("kind") == "eval"]
    return evals[-1] if evals else None


def export(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, onnx: bool = False) -> str:
    """Writes the model folder of the trainer checkpoint `checkpoint` at `out_dir` (see the module docstring) and
    answers its path. `onnx=True` adds `model.onnx`, the encode forward for onnxruntime (needs the `onnx` extra).

    Raises `CheckpointError` for a checkpoint that is not whole and intact, `FileExistsError` for an `out_dir`
    that holds files (or is not a folder); a refused call writes nothing.
    """
    for field, value in (("checkpoint", checkpoint), ("out_dir", out_dir)):
        if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
            raise TypeError(f"{field}: expected a str path, got {type(value).__name__}")
    if not isinstance(onnx, bool):
        raise TypeError(f"onnx: expected a bool, got {type(onnx).__name__}")
    source, target = os.fspath(checkpoint), os.path.abspath(os.fspath(out_dir))
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise FileExistsError(f"out_dir: {target} exists and is not an empty folder; pick another")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"out_dir: its parent folder {parent} does not exist")

    stored = read_stored_run(source)
    weights = stored_weights(read_run_tensors(stored, None, 10, "cpu"))
    config = stored.config
    evaluation = last_evaluation(source)

    temp = os.path.join(parent, f".{os.path.basename(target)}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    os.mkdir(temp)
    try:
        with open(os.path.join(temp, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(json.loads(to_json(config)), indent=2) + "\n")
        companions = [CONFIG_FILE]
        if onnx:
            network = Network(config)
            network.load_state_dict(weights, strict=True)
            write_onnx(network.eval(), os.path.join(temp, ONNX_FILE))
            companions.append(ONNX_FILE)
        parameters = sum(math.prod(v.shape) for v in weights.values())
        card = model_card(
            config, stored.step, evaluation, parameters=parameters, onnx=onnx, name=os.path.basename(target)
        )
        with open(os.path.join(temp, CARD_FILE), "w", encoding="utf-8") as f:
            f.write(card)
        write_model(temp, config, stored.step, weights, companions)
        os.replace(temp, target)  # an empty `target` folder is replaced whole (POSIX rename)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return target
