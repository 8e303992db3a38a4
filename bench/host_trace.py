"""A cross-process timeline of the prepare stage, for `bench/profile_host.py --timeline`: where one step's wall time
goes between the trainer's process, its preparer process and the decoders, function by function.

`install()` wraps the functions of `WRAPPED` (module, name or (class, method)) so that each call appends one line
``pid thread name start end`` (CLOCK_MONOTONIC, shared by every process) to ``events-<pid>.txt`` in the folder named
by $UFORM_BENCH_TRACE. `trace_preparers()`, in the trainer's process before its first step, wraps these functions
there and makes every preparer process start through `traced_preparer_main`, which wraps them in that process and
hands its decoders `timed_decode_chunk` (a module-level function of this module, so it pickles by reference into
the decoders, whose fork server has this folder on its path). `timeline(folder)` reads the lines back and answers,
for each traced `Preparers.prepare` call, its events relative to the call's start. A bench module: the wrappers
cost about 2 us a call, so the many-call rows (per item) read a little high.
"""

from __future__ import annotations

import functools
import glob
import os
import threading
import time
from typing import Any

WRAPPED: dict[str, list[Any]] = {
    "uform.runtime.preparers": [
        "decode_media",
        "prepare",
        "block_tables",
        "adopt",
        ("Preparers", "_send"),
        ("Preparers", "prepare"),
        ("_PreparerState", "run"),
    ],
    "uform.runtime.helper": [("Endpoint", "reply"), ("Helper", "_receive"), ("Helper", "submit")],
    "uform.data.batch": [
        "_stack_units",
        "keyed_states",
        "mask_media",
        "corrupt_text",
        "pair_targets",
        "plan",
    ],
}
"""What is timed: module -> functions (module-level names as the callers look them up) and (class, method)."""

_out: Any = None
_lock = threading.Lock()


def _write(name: str, start: float, end: float) -> None:
    global _out
    folder = os.environ.get("UFORM_BENCH_TRACE")
    if not folder:
        return
    with _lock:
        if _out is None:
            _out = open(os.path.join(folder, f"events-{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115
        _out.write(f"{os.getpid()} {threading.current_thread().name} {name} {start:.6f} {end:.6f}\n")


def _timed(name: str, function: Any) -> Any:
    if getattr(function, "_bench_timed", False):
        return function

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return function(*args, **kwargs)
        finally:
            _write(name, start, time.monotonic())

    timed._bench_timed = True  # type: ignore[attr-defined]
    return timed


def install() -> None:
    """Wraps `WRAPPED` in this process (importing their modules)."""
    import importlib

    for module_name, names in WRAPPED.items():
        module = importlib.import_module(module_name)
        for item in names:
            if isinstance(item, tuple):
                owner = getattr(module, item[0])
                setattr(owner, item[1], _timed(".".join(item), getattr(owner, item[1])))
            else:
                setattr(module, item, _timed(item, getattr(module, item)))
    from uform.media import decode

    if decode.decode_chunk is not timed_decode_chunk:
        decode.untimed_decode_chunk = decode.decode_chunk  # type: ignore[attr-defined]
        decode.decode_chunk = timed_decode_chunk  # what decode_items hands the pool, looked up at each call


def timed_decode_chunk(jobs: Any, **options: Any) -> Any:
    """`media.decode.decode_chunk`, timed in the decoder that runs it."""
    from uform.media import decode

    real = getattr(decode, "untimed_decode_chunk", decode.decode_chunk)  # a decoder never installed the wrappers
    start = time.monotonic()
    try:
        return real(jobs, **options)
    finally:
        _write("decode_chunk", start, time.monotonic())


def traced_preparer_main(target: Any, *args: Any) -> None:
    """A preparer process's life (`target`, the preparer processes' own entry), its functions timed."""
    install()
    target(*args)


def trace_preparers(folder: str) -> None:
    """Times the prepare stage in this process and in every preparer process started from now on: their helper
    (`runtime.helper.Helper`, as `runtime.preparers` names it) starts them through `traced_preparer_main`."""
    os.environ["UFORM_BENCH_TRACE"] = folder  # inherited by the preparer processes and their decoders
    from uform.runtime import helper, preparers

    class TracedHelper(helper.Helper):
        def __init__(self, target: Any, args: Any = (), **options: Any) -> None:
            if str(options.get("name", "")).startswith("uform-host-"):
                target = functools.partial(traced_preparer_main, target)  # pickles by reference, both parts
            super().__init__(target, args, **options)

    install()
    preparers.Helper = TracedHelper  # type: ignore[misc]


def timeline(folder: str) -> list[list[tuple[int, str, str, float, float]]]:
    """Per traced `Preparers.prepare` call, in order: its events (pid, thread, name, start, end), seconds from the
    call's start, every process's that lie within the call."""
    events = []
    for path in glob.glob(os.path.join(folder, "events-*.txt")):
        with open(path) as lines:
            for line in lines:
                parts = line.split()
                if len(parts) == 5:
                    events.append((int(parts[0]), parts[1], parts[2], float(parts[3]), float(parts[4])))
    events.sort(key=lambda e: e[3])
    calls = [e for e in events if e[2] == "Preparers.prepare"]
    out = []
    for call in calls:
        start, end = call[3], call[4]
        out.append(
            [
                (p, t, n, a - start, b - start)
                for p, t, n, a, b in events
                if a >= start and b <= end and (p, t, n, a, b) != call
            ]
            + [(call[0], call[1], call[2], 0.0, end - start)]
        )
    return out


def summary(calls: list[list[tuple[int, str, str, float, float]]], roles: dict[int, str]) -> list[dict[str, Any]]:
    """One row per (role, thread kind, function): medians over `calls` of its call count, its summed time, its
    first start and its last end (ms from the step's start); `roles` names pids (the rest are "decoder")."""
    import numpy as np

    rows: dict[tuple[str, str, str], list[tuple[int, float, float, float]]] = {}
    for events in calls:
        seen: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
        for pid, thread, name, start, end in events:
            kind = thread.rstrip("0123456789_").removesuffix("-") if roles.get(pid) != "decoder" else "decoder"
            seen.setdefault((roles.get(pid, "decoder"), kind, name), []).append((start, end))
        for key, spans in seen.items():
            rows.setdefault(key, []).append(
                (len(spans), sum(b - a for a, b in spans), min(a for a, _ in spans), max(b for _, b in spans))
            )
    out = []
    for (role, thread, name), values in rows.items():
        array = np.array(values)
        out.append(
            {
                "role": role,
                "thread": thread,
                "name": name,
                "calls": float(np.median(array[:, 0])),
                "sum_ms": float(np.median(array[:, 1]) * 1e3),
                "first_ms": float(np.median(array[:, 2]) * 1e3),
                "last_ms": float(np.median(array[:, 3]) * 1e3),
            }
        )
    return sorted(out, key=lambda r: (r["first_ms"], -r["last_ms"]))
