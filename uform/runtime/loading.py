"""A `uform.sources.Loader` in a helper process of its own, reading steps ahead of the training loop.

The loader's work is interpreter work (tar headers, JSON lines, image headers through Pillow, the packer's plan
of each step, the step's relations): at the reference geometry some 15 to 40 ms of one core a step, all of it
under the calling process's interpreter lock, where the trainer's own threads launch the device's work and hand
steps to its preparer process. In a process of its own it takes none of that lock; the training loop only
unpickles each step's input (its media bytes undecoded) and submits it.

    loader = LoaderProcess(spec, fields, config, devices=1)     # spec: paths, globs, URLs (what a run file names)
    step_input = loader.next_step()                              # the step `Loader.next_step` would answer
    state = loader.state()                                       # the position after the last step answered

The process reads `AHEAD` steps beyond the last one answered; `state()` is the position after the last step the
loop took, never after a step read ahead, so a checkpoint's data slot continues exactly where the loop was.
The order is the `Loader`'s, a pure function of (seed, step, devices): the same steps as in process (tested).
A step the loader refuses (a record with an unknown field, say) raises its error here, as in process. The
loader's warnings are shown once by the process (on the same standard error) and counted in its state.
"""

from __future__ import annotations

import os
import signal
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from ..config import TrainerInitVramConfig
from ..sources import Loader, StepInput, open_source
from .helper import BOOT_SECONDS, Helper, Link, close_all

__all__ = ["AHEAD", "LoaderProcess", "by_path"]

AHEAD = 3
"""Steps the process reads beyond the last one answered: two in flight on the device and one more ready."""


def by_path(spec: Any) -> bool:
    """Whether `spec` names its data by path, glob or URL (a str, a path, or a list of them), which a process of
    its own can open again; any other source (an iterable of records, a `datasets` dataset) is read in process."""
    if isinstance(spec, (str, os.PathLike)):
        return True
    return isinstance(spec, (list, tuple)) and bool(spec) and all(isinstance(s, (str, os.PathLike)) for s in spec)


class LoaderProcess:
    """`Loader(open_source(spec, fields=fields), config, **shares, state=state)` in a process of its own; see the
    module's docstring. `shares` are the Loader's `rank`, `world` and `devices`."""

    def __init__(
        self,
        spec: Any,
        fields: Mapping[str, Any],
        config: TrainerInitVramConfig,
        *,
        state: dict[str, Any] | None = None,
        **shares: int,
    ) -> None:
        if not by_path(spec):
            raise TypeError("spec: a loader process reads data named by path, glob or URL; read others in process")
        paths = [os.fspath(spec)] if isinstance(spec, (str, os.PathLike)) else [os.fspath(s) for s in spec]
        self._helper = Helper(
            _loader_main, (paths, dict(fields), config, state, shares), name="uform-loader", daemon=True
        )
        self._ahead: deque[Future] = deque()
        self._closed = False
        self.step = 1
        """The number of the next step `next_step` answers."""
        self._state: dict[str, Any] = {}
        self._helper.start()
        try:
            self._helper.ready.result(BOOT_SECONDS)
            # The process opens the loader once (a resumed position is replayed there alone); its refusal (a
            # bad state, an unknown field) raises here, now, as an in-process Loader's would.
            self.step, self._state = self._helper.submit(_OPEN).result()
            for _ in range(AHEAD):
                self._ahead.append(self._helper.submit(_NEXT))
        except BaseException:
            self.close()
            raise

    def next_step(self) -> StepInput:
        """The next step, read by the process (its error, where the loader refused it)."""
        if self._closed:
            raise ValueError("loader: it was closed")
        step_input, state = self._ahead.popleft().result()  # a refused step: the ones read after it fail alike
        self._ahead.append(self._helper.submit(_NEXT))
        self._state = state
        self.step = step_input.step + 1
        return step_input

    def state(self) -> dict[str, Any]:
        """The loader's position after the last step `next_step` answered (`Loader.state()`)."""
        return self._state

    def close(self) -> None:
        """Stops the process (steps read ahead are dropped)."""
        if self._closed:
            return
        self._closed = True
        close_all([self._helper])
        self._helper.release()

    def __enter__(self) -> LoaderProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_OPEN, _NEXT = "open", "next"  # the calls a loader process answers


def _loader_main(
    link: Link,
    paths: list[str],
    fields: dict[str, Any],
    config: TrainerInitVramConfig,
    state: dict[str, Any] | None,
    shares: dict[str, int],
) -> None:
    """The process: open the loader when asked (answering its position, or its refusal), then answer each call
    with the next step and the position after it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training loop's to handle
    endpoint = link.open()
    if not endpoint.ready():
        return
    loader: Loader | None = None
    refused: BaseException | None = None
    while True:
        try:
            frame = endpoint.receive()
        except (EOFError, OSError):  # the training loop's process is gone
            break
        if frame is None:
            break
        try:
            if frame.load() == _OPEN:
                try:
                    loader = Loader(open_source(paths, fields=fields), config, state=state, **shares)
                except BaseException as error:
                    refused = error
                    raise
                answer: Any = (loader.step, loader.state())
            elif loader is None:
                raise RuntimeError(f"loader: it could not be opened ({refused!r})")
            else:
                step_input = loader.next_step()
                answer = (step_input, loader.state())
        except BaseException as error:  # the loop raises it for this call
            endpoint.fail(frame.ident, error)
            continue
        if not endpoint.reply(frame.ident, answer):
            break
    endpoint.close()
