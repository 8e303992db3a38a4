"""A bench's own threads sampled by py-spy while it runs steps it has already compiled (`--spy SECONDS` of
bench/step.py and bench/pairs.py), and the samples read back per thread: where each thread's time goes, waiting
included (`--idle`). The question it answers is the one the image-text step's profile left (BENCHMARKS.md, "Issue 12,
fifteenth day"): which thread launched the kernels that came late, and what it was doing instead.

py-spy (https://github.com/benfred/py-spy) is not a dependency: install it (`pip install py-spy`; on the GPU
machine carry its wheel). It attaches to this very process (`--pid`, which needs ptrace rights over it: root, or
`kernel.yama.ptrace_scope` 0) and samples without pausing it (`--nonblocking`), so the steps it watches run at
nearly their own pace; their rate is not the bench's figure, which comes from the unwatched steps before.

With ``gil`` (`--spy-gil SECONDS`) py-spy keeps only the samples of the thread that holds the interpreter lock
(`--gil`), and the report states each thread's share of all the sample slots (the rate times the seconds): how much
of the wall each thread held the lock, and whether the threads together left it free at all (a share near 100%
says the process is bound by its lock, not by any one thread).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

RATE = 250  # samples a second


@contextlib.contextmanager
def sampling(
    seconds: float, name: str, folder: str | None = None, gil: bool = False, pid: int | None = None
) -> Iterator[None]:
    """Samples this process's threads (or process `pid`'s: a helper process of this one) for `seconds` from entry
    (nothing when `seconds` is 0), then waits for py-spy, writes its raw samples to `folder`/spy-`name`.txt ($OUT or
    the current folder) and prints `report` of them; with `gil`, only the samples of the thread holding the
    interpreter lock (`report`'s shares are then of every sample slot)."""
    if seconds <= 0:
        yield
        return
    binary = shutil.which("py-spy")
    if binary is None:
        raise SystemExit("--spy: py-spy is not installed (pip install py-spy; on the GPU machine carry its wheel)")
    folder = folder or os.environ.get("OUT", ".")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"spy-{name}.txt")
    duration = max(1, round(seconds))
    command = [
        binary,
        "record",
        "--pid",
        str(pid or os.getpid()),
        "--threads",
        "--gil" if gil else "--idle",
        "--nonblocking",
    ]
    command += ["--rate", str(RATE), "--duration", str(duration), "--format", "raw", "--output", path]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield
    finally:
        output = process.communicate()[0].decode(errors="replace")
    if process.returncode != 0 or not os.path.exists(path):
        raise SystemExit(f"--spy: py-spy failed (exit {process.returncode}): {output.strip()[-500:]}")
    print(report(summarize(path, slots=RATE * duration if gil else None)))


def summarize(path: str, top: int = 10, least_share: float = 0.05, slots: int | None = None) -> dict[str, Any]:
    """Per thread of py-spy's raw samples (lines "thread (id): name;frame;...;frame count"): its samples, the
    frames its samples stood in last (self) and anywhere but on every sample (inclusive), each as a share of the
    thread's samples, the `top` of each; threads with fewer than `least_share` of the busiest thread's samples are
    left out. With `slots` (samples of the interpreter lock's holder, `--gil`), also each thread's samples as a
    share of the slots ("held") and all threads' together ("held_total")."""
    totals: collections.Counter[str] = collections.Counter()
    own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    anywhere: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(path) as samples:
        for line in samples:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            thread, *frames = stack.split(";")
            n = int(count)
            totals[thread] += n
            own[thread][frames[-1] if frames else "(no Python frame)"] += n
            for frame in set(frames):
                anywhere[thread][frame] += n
    most = max(totals.values(), default=0)
    threads = {}
    for thread, n in totals.most_common():
        if n < least_share * most:
            continue
        threads[thread] = {
            "samples": n,
            **({"held": n / slots} if slots else {}),
            "self": [(frame, c / n) for frame, c in own[thread].most_common(top)],
            # A frame on every sample's stack (the thread's entry) says nothing: left out.
            "inclusive": [(frame, c / n) for frame, c in anywhere[thread].most_common() if c < n][:top],
        }
    held = {"held_total": sum(totals.values()) / slots, "slots": slots} if slots else {}
    return {"path": path, "threads": threads, **held}


def report(summary: dict[str, Any], width: int = 110) -> str:
    if "held_total" in summary:
        lines = [
            f"py-spy samples of the interpreter lock's holder by thread ({summary['path']}): the lock held in "
            f"{summary['held_total']:.1%} of {summary['slots']} sample slots"
        ]
    else:
        lines = [f"py-spy samples by thread ({summary['path']}; waiting included):"]
    for thread, t in summary["threads"].items():
        held = f", holding the lock {t['held']:.1%} of the slots" if "held" in t else ""
        lines.append(f"  {thread}: {t['samples']} samples{held}")
        for kind in ("self", "inclusive"):
            for frame, share in t[kind]:
                lines.append(f"    {kind:<9} {share:6.1%}  {frame[:width]}")
    return "\n".join(lines)
