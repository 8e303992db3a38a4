"""The model card an export writes as `README.md`: YAML front matter the Hugging Face hub reads (library_name,
tags, pipeline_tag), then what the model is, read from its resolved config, its step and its run's last eval.

Everything on the card is derived (nothing is typed in by hand), so a card never claims what the run did not do:
the modalities are those whose geometry is non-zero, the objective's terms those whose weight is, and the eval
figures are the last `kind: "eval"` record of the run folder's `metrics.jsonl`, with its step, or a line saying
the run logged none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .config import TrainerInitVramConfig, to_json
from .enums import Objective

__all__ = ["modalities_of", "model_card"]


def modalities_of(config: TrainerInitVramConfig) -> list[str]:
    """The modalities the run embeds: text always, each medium whose geometry is non-zero."""
    b = config.batch
    found = ["text"]
    if b.image.patch_side:
        found.append("image")
    if b.video.patch_side:
        found.append("video")
    if b.audio.chunk_samples:
        found.append("audio")
    return found


def _geometry(config: TrainerInitVramConfig) -> list[str]:
    b = config.batch
    lines = [f"- text: UTF-8 bytes, at most {b.max_columns_per_row - 1} per item past its one-position prefix"]
    if b.image.patch_side:
        i = b.image
        lines.append(f"- image: {i.patch_side}x{i.patch_side} patches of {i.channels} channels, one position each")
    if b.video.patch_side:
        v = b.video
        lines.append(
            f"- video: tubes of {v.tube_frames} frames (every {v.frame_stride}th) x {v.patch_side}x{v.patch_side} "
            f"pixels of {v.channels} channels, one position each"
        )
    if b.audio.chunk_samples:
        a = b.audio
        lines.append(f"- audio: frames of {a.chunk_samples} samples at {a.sample_rate} Hz, one position each")
    lines.append(f"- one item spans at most {b.max_columns_per_row} positions (longer items are cut, as in training)")
    return lines


def _terms(config: TrainerInitVramConfig) -> list[str]:
    c, m, li = config.contrastive, config.masking, config.late_interaction
    lines = []
    if config.objective != Objective.Masked:
        lines.append(
            f"- contrastive: pair loss {c.pair_loss.name}, negatives {c.negatives.name}, "
            f"{c.temperature_groups} temperature group(s), Matryoshka widths "
            f"{list(c.matryoshka_dimensions) or 'none but the full width'}"
        )
    if config.objective != Objective.Contrastive:
        lines.append(
            f"- masked text: weight {m.text_weight}, token mask probability {m.token_mask_probability}, "
            f"mean span {m.token_mean_span}"
        )
        for kind in modalities_of(config)[1:]:
            lines.append(
                f"- masked {kind}: weight {getattr(m, kind + '_weight')}, mask ratio {getattr(m, kind + '_mask_ratio')}"
            )
    if li.weight > 0:
        lines.append(
            f"- late interaction: weight {li.weight}, token vectors of width {li.width}, "
            f"queries of at most {li.max_query_span} positions, pair loss {li.pair_loss.name}"
        )
    if config.choices.weight > 0:
        lines.append(f"- calibrated choices: weight {config.choices.weight}")
    return lines


def _evaluation(evaluation: Mapping[str, Any] | None) -> list[str]:
    if evaluation is None:
        return ['The run logged no evaluation (no `kind: "eval"` record in its `metrics.jsonl`).']
    figures = {k: v for k, v in evaluation.items() if k not in ("kind", "step", "wall_time")}
    lines = [f"The run's last evaluation, at step {evaluation.get('step')}:", "", "| metric | value |", "|---|---|"]
    for name, value in figures.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"| {name} | {shown} |")
    return lines


def model_card(
    config: TrainerInitVramConfig,
    step: int,
    evaluation: Mapping[str, Any] | None,
    *,
    parameters: int,
    onnx: bool,
    name: str = "model",
) -> str:
    """The card's Markdown: front matter, architecture, modalities and their geometry, the objective's terms,
    the steps trained, `parameters` (the weights' element count), the last `evaluation` record (None: none logged), the Matryoshka widths, and how to load
    the folder (`uform.load`, and onnxruntime where `onnx`)."""
    modalities = modalities_of(config)
    widths = sorted({*config.contrastive.matryoshka_dimensions, config.hidden})
    tags = ["uform", "embeddings", "matryoshka", *modalities]
    if config.late_interaction.weight > 0:
        tags.append("late-interaction")
    pipeline = "feature-extraction"
    front = [
        "---",
        "library_name: uform",
        f"pipeline_tag: {pipeline}",
        "tags:",
        *[f"- {tag}" for tag in tags],
        "---",
    ]
    body = [
        f"# {name}",
        "",
        f"A uform tower over {', '.join(modalities)}: one transformer for every modality, trained for {step} "
        "optimizer steps and exported weights-only (no optimizer state) by `uform export`.",
        "",
        "## Architecture",
        "",
        f"- {config.depth} pre-norm blocks of hidden width {config.hidden} ({config.hidden // 64} heads of 64), "
        "RMSNorm, GELU MLP of width 4x, axial rotary positions, bidirectional attention within each item",
        f"- {parameters:,} weights; pooled embeddings of width {config.hidden}, mean-pooled "
        "then projected, L2-normalised",
        "",
        "## Modalities and their geometry",
        "",
        *_geometry(config),
        "",
        "## Objective",
        "",
        f"Objective `{config.objective.name}`, terms:",
        "",
        *_terms(config),
        "",
        "## Training",
        "",
        f"{step} optimizer steps of a {config.schedule.steps}-step schedule (peak learning rate "
        f"{config.schedule.learning_rate}, seed {config.seed}).",
        "",
        *_evaluation(evaluation),
        "",
        "## Matryoshka widths",
        "",
        f"Embeddings may be cut to their first {', '.join(str(w) for w in widths)} values and re-normalised "
        "(`encode(..., width=N)`, `uform encode --width N`); those are the widths the run trained.",
        "",
        "## How to load",
        "",
        "```python",
        "import uform",
        "",
        'model = uform.load("path/to/this/folder")  # checks the digest of weights and config first',
        'vectors = model.encode(["text"], [b"a photo of a cat"])  # [1, hidden] f32, L2-normalised',
        "```",
        "",
        "Batch encoding of a manifest (JSONL, CSV or Parquet, media by path):",
        "",
        "```bash",
        "uform encode path/to/this/folder --input records.jsonl --output vectors.parquet --width "
        f"{widths[0]} --dtype f16",
        "```",
    ]
    if onnx:
        body += [
            "",
            "`model.onnx` holds the encode forward (dense attention) over packed rows; the packing and the media "
            "patching stay in Python (`uform.onnx_encoder.OnnxEncoder(folder).encode(...)`, with onnxruntime).",
        ]
    body += [
        "",
        "## Files",
        "",
        "- `model.safetensors`: the weights and, in its metadata, the resolved config, the step and the SHA-256 "
        "of `config.json` (and `model.onnx`), all under one digest: a changed file is refused on load",
        "- `config.json`: the resolved run config",
        "",
        "<details><summary>config.json</summary>",
        "",
        "```json",
        json.dumps(json.loads(to_json(config)), indent=2),
        "```",
        "",
        "</details>",
    ]
    return "\n".join(front + body) + "\n"
