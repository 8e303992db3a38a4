"""A run's curves as one PNG (`uform plot RUN_DIR`): its losses, learning rate, throughput and evaluations by step.

Read from the folder's `metrics.jsonl` alone, so it draws a run while it trains as well as after. One panel per
kind of figure: the loss (every term the objective trains, raw faint and smoothed bold, on a log scale where the
values allow), the learning rate, items per second, one panel per evaluated direction (`eval/text->image/...`:
its recall@k, MRR, nDCG as lines) and, where any were counted, the warnings. Drawn with matplotlib (the optional
extra `uform[plot]`) on its Agg canvas, so no display and no pyplot state are touched.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .config import TrainerStepStats
from .run_dir import METRICS_NAME, read_metrics

__all__ = ["PLOT_NAME", "plot_run"]

PLOT_NAME = "metrics.png"
"""The file `plot_run` writes into a folder it is given."""

_LOSSES = tuple(f.name for f in dataclasses.fields(TrainerStepStats) if f.name.endswith("loss"))
"""The loss terms a step record carries, as `TrainerStepStats` names them."""
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def plot_run(run_folder: str | os.PathLike, output: str | os.PathLike | None = None) -> str:
    """Draws the run of `run_folder` (a folder holding `metrics.jsonl`) into a PNG at `output` (a file, or a
    folder that gets `metrics.png`; default `RUN_DIR/metrics.png`); answers the path written. Raises
    `FileNotFoundError` without a `metrics.jsonl`, `ValueError` where it holds no step yet, and `ImportError`
    naming the extra where matplotlib is missing."""
    folder = os.fspath(run_folder)
    source = os.path.join(folder, METRICS_NAME)
    if not os.path.isfile(source):
        raise FileNotFoundError(f"plot: {folder} holds no {METRICS_NAME}; it is not a run's folder")
    records = read_metrics(source)
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not steps:
        raise ValueError(f"plot: {source} holds no step yet")
    target = os.path.join(folder, PLOT_NAME) if output is None else os.fspath(output)
    if os.path.isdir(target) or target.endswith(os.sep):
        target = os.path.join(target, PLOT_NAME)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("plot: needs matplotlib (pip install 'uform[plot]')") from error

    panels = _panels(steps, evals)
    columns = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6.4 * columns, 3.6 * rows + 0.6), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    last = steps[-1]
    figure.suptitle(
        f"{os.path.basename(os.path.abspath(folder))}: step {last['step']}, loss {last['loss']:.4g}",
        fontsize=13,
        fontweight="bold",
    )
    for index, (title, lines, options) in enumerate(panels):
        axes = figure.add_subplot(rows, columns, index + 1)
        _draw(axes, title, lines, options)
        axes.set_xlim(0, max(1, last["step"]) * 1.02)  # every panel on the training run's steps, to read across
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    figure.savefig(target, format="png")
    return target


Line = tuple[str, list[float], list[float]]


def _panels(steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> list[tuple[str, list[Line], dict[str, Any]]]:
    panels: list[tuple[str, list[Line], dict[str, Any]]] = []
    losses = [_series(steps, name) for name in _LOSSES]
    shown = [(name, x, y) for name, (x, y) in zip(_LOSSES, losses, strict=True) if any(v != 0 for v in y)]
    if len(shown) == 2:  # the total and its one term are the same curve
        shown = shown[:1]
    panels.append(("Loss", shown, {"ylabel": "loss", "smooth": True, "log": True}))
    panels.append(
        ("Learning rate", [("learning_rate", *_series(steps, "learning_rate"))], {"ylabel": "lr", "log": True})
    )
    panels.append(
        ("Throughput", [("items/s", *_series(steps, "items_per_second"))], {"ylabel": "items / s", "smooth": True})
    )
    groups: dict[str, list[str]] = {}
    for record in evals:
        for name, value in record.items():
            if name in ("kind", "step", "wall_time") or isinstance(value, (bool, str)):
                continue
            group = name.rpartition("/")[0]
            groups.setdefault(group or "eval", [])
            if name not in groups[group or "eval"]:
                groups[group or "eval"].append(name)
    for group, names in groups.items():
        lines = [(name.rpartition("/")[2], *_series(evals, name)) for name in names]
        unit = all(0 <= v <= 1 for _, _, y in lines for v in y if math.isfinite(v))
        panels.append(
            (f"Held out: {group.removeprefix('eval/')}", lines, {"ylabel": "score", "unit": unit, "marks": True})
        )
    warned = sorted({k for r in steps for k in r if k.startswith("warned/")})
    counted = [(k.removeprefix("warned/"), *_series(steps, k)) for k in warned]
    counted = [line for line in counted if any(v for v in line[2])]
    if counted:
        panels.append(("Warnings (counted, each shown once)", counted, {"ylabel": "count so far", "steps": True}))
    return panels


def _series(records: list[dict[str, Any]], name: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in records:
        value = record.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(float(record["step"]))
            ys.append(float(value))
    return xs, ys


def _smoothed(values: Sequence[float]) -> list[float]:
    """An exponential moving average whose span grows with the run (about a fiftieth of it), bias corrected."""
    alpha = 1.0 - math.exp(-1.0 / max(1.0, len(values) / 50.0))
    out, mean, weight = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            mean, weight = (1 - alpha) * mean + alpha * value, (1 - alpha) * weight + alpha
        out.append(mean / weight if weight > 0 else math.nan)
    return out


def _draw(axes: Any, title: str, lines: list[Line], options: Mapping[str, Any]) -> None:
    axes.set_title(title, fontsize=11, loc="left")
    axes.set_xlabel("step")
    axes.set_ylabel(options.get("ylabel", ""))
    axes.grid(True, alpha=0.3)
    axes.spines[["top", "right"]].set_visible(False)
    values = [v for _, _, y in lines for v in y if math.isfinite(v)]
    for (name, x, y), color in zip(lines, _COLORS * 4, strict=False):
        if options.get("steps"):
            axes.step(x, y, where="post", color=color, label=name, linewidth=1.6)
        elif options.get("smooth") and len(y) > 10:
            axes.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
            axes.plot(x, _smoothed(y), color=color, label=name, linewidth=1.8)
        else:
            axes.plot(x, y, color=color, label=name, linewidth=1.8, marker="o" if options.get("marks") else None)
    if options.get("log") and values and min(values) > 0 and max(values) / min(values) > 20:
        axes.set_yscale("log")
    if options.get("unit"):
        axes.set_ylim(0, 1.02)
    if len(lines) > 1 or options.get("marks"):
        axes.legend(fontsize=8, frameon=False, loc="best")
    if not lines:
        axes.text(0.5, 0.5, "nothing logged", ha="center", va="center", transform=axes.transAxes, color="gray")
