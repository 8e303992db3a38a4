"""Where a profiled window's device time goes, read from the Chrome trace torch.profiler exports (a sibling module
of the bench scripts, not a package): the kernels' time summed, the time the device was busy (their union), the
window's span, the gaps between kernels by size, the longest gaps with the host calls that overlapped them, and
the kernels by total time. bench/profile_step.py and bench/pairs.py --profile print it.

A step whose kernels fill its span is bound by them; gaps mean the device waited for the host (a launch, a
synchronisation, a page-locked allocation that holds every thread's launches).

  python bench/kernel_trace.py TRACE.json[.gz] STEPS
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
from typing import Any

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_SIZES = ((20.0, "<20us"), (100.0, "<100us"), (500.0, "<500us"), (2000.0, "<2ms"), (float("inf"), ">=2ms"))


def load_events(path: str) -> list[dict[str, Any]]:
    """The trace's events (a .gz trace is read as it is)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict[str, Any]], steps: int, longest: int = 5, top: int = 12) -> dict[str, Any]:
    """Per-step figures (ms) of the device events: kernels, busy, span, gaps (and by size), the `longest` gaps
    (with the host calls that overlapped most of each) and the `top` kernels by total time."""
    device = sorted(
        (e["ts"], e["ts"] + e["dur"], e.get("name", "")) for e in events if e.get("cat") in DEVICE_KINDS and "dur" in e
    )
    if not device:
        raise ValueError("the trace holds no device events (was the profiler asked for CUDA activity?)")
    busy, gaps = 0.0, []
    start, end, before = device[0][0], device[0][1], device[0][2]
    for a, b, name in device[1:]:
        if a > end:
            busy += end - start
            gaps.append((a - end, end, a, before, name))
            start, end = a, b
        else:
            end = max(end, b)
        before = name
    busy += end - start
    by_size: collections.Counter[str] = collections.Counter()
    for gap in gaps:
        by_size[next(label for bound, label in GAP_SIZES if gap[0] < bound)] += gap[0]
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cpu_op") and "dur" in e]
    worst = []
    for length, a, b, after, next_kernel in sorted(gaps, reverse=True)[:longest]:
        during = sorted(
            (e for e in host if e["ts"] < b and e["ts"] + e["dur"] > a and e["dur"] > 0.3 * length),
            key=lambda e: -e["dur"],
        )
        worst.append(
            {
                "ms": length / 1e3,
                "after": after[:70],
                "before": next_kernel[:70],
                "host": [(e["name"][:60], e.get("tid"), e["dur"] / 1e3) for e in during[:4]],
            }
        )
    totals: collections.Counter[str] = collections.Counter()
    for a, b, name in device:
        totals[name[:90]] += b - a
    per = 1e3 * steps
    return {
        "kernels_ms": sum(b - a for a, b, _ in device) / per,
        "busy_ms": busy / per,
        "span_ms": (device[-1][1] - device[0][0]) / per,
        "gaps_ms": sum(g[0] for g in gaps) / per,
        "gaps_by_size_ms": {label: by_size[label] / per for _, label in GAP_SIZES if by_size[label]},
        "longest_gaps": worst,
        "top_kernels_ms": [(name, t / per) for name, t in totals.most_common(top)],
    }


def report(summary: dict[str, Any], label: str) -> str:
    """The summary as lines to print."""
    s = summary
    lines = [
        f"{label}, per step: kernels {s['kernels_ms']:.2f} ms, device busy {s['busy_ms']:.2f} ms of a "
        f"{s['span_ms']:.2f} ms span, gaps {s['gaps_ms']:.2f} ms "
        + " ".join(f"({k} {v:.2f})" for k, v in s["gaps_by_size_ms"].items())
    ]
    for gap in s["longest_gaps"]:
        lines.append(f"  gap {gap['ms']:.2f} ms after {gap['after']!r} before {gap['before']!r}")
        lines += [f"      host: {name} (thread {tid}) {ms:.2f} ms" for name, tid, ms in gap["host"]]
    lines += [f"  {ms:8.3f} ms  {name}" for name, ms in s["top_kernels_ms"]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(summarize(load_events(sys.argv[1]), int(sys.argv[2])), sys.argv[1]))
