"""A child process of ours: a fresh interpreter that runs one uform function and never imports the caller's main
module.

`multiprocessing`'s "spawn" and "forkserver" start methods prepare every child by importing the parent's
``__main__`` again (by path, or by module name: `multiprocessing.spawn.prepare`). For a script without
``if __name__ == "__main__":`` that re-runs the whole script in each child, which then fails to start processes
of its own; for ``python - < script.py`` it looks for a file named ``<stdin>`` and fails even with the guard.
A `Child` is started with `subprocess` as ``python -c <boot>``, whose boot imports this module and runs the
target: its ``__main__`` is that ``-c`` module, so nothing of the caller's script runs in it, whatever the
script's form (a file with or without the guard, stdin, ``-c``, a notebook). The boot first sets ``sys.path`` to
the caller's, so the child imports the same uform (and modules next to the script) as the caller.

The target and its arguments are pickled to the child through a pipe of their own. The descriptors they carry
cross by number: a `multiprocessing.connection.Connection` in the arguments, or an object whose class sets
``inherited_fd = True`` and holds its descriptor in ``fd`` (`uform.runtime.slab.SlabFile`), is inherited by the
child (`subprocess`'s ``pass_fds``) and rebuilt there around the same number (``cls(fd)``), so a pipe end or a
shared-memory file needs no name and no broker. Nothing crosses from the main module: the target, and every
class and function in its arguments, must be importable from a module by name (uform's own); one defined in
``__main__`` is refused here with a `TypeError`, since the child never imports the caller's script.

A `Child` answers the parts of `multiprocessing.Process` that uform's owners use (``start``, ``pid``,
``sentinel``, ``is_alive``, ``join``, ``kill``, ``terminate``, ``exitcode``, ``name``); its sentinel is the read
end of a pipe whose write end only the child holds (as `multiprocessing`'s own spawn does), so it is ready once
the child ended. Its standard output and error are the caller's; its standard input is /dev/null; its
environment is the caller's, its interpreter flags the defaults (none of the caller's ``-W``, ``-X``, ``-O``).
POSIX only.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
import time
import traceback
import types
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol

__all__ = ["START_METHOD", "Child", "Process", "context"]

START_METHOD = "uform"
"""The start method name of `Child` in `context` (beside multiprocessing's "spawn", "forkserver", "fork")."""

# The child's whole command line after the interpreter: standard library only until sys.path is the caller's.
_BOOT = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[3]); "
    "from uform.runtime.child import main; main(int(sys.argv[1]), int(sys.argv[2]))"
)


class Process(Protocol):
    """What uform's owners of worker processes use of one: `Child` and `multiprocessing.Process` both answer it."""

    @property
    def pid(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def name(self) -> str: ...
    def start(self) -> None: ...
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def kill(self) -> None: ...


class Child:
    """A process that runs ``target(*args)`` in a fresh interpreter started on this module (see the module's
    docstring). ``daemon`` is accepted for `multiprocessing.Process`'s signature and means nothing here: a child
    may start processes of its own, and its owner ends it (no child outlives its owner's pipe to it)."""

    def __init__(
        self,
        target: Callable[..., Any],
        args: Sequence[Any] = (),
        name: str = "uform-child",
        daemon: bool | None = None,
    ) -> None:
        self._target = target
        self._args = tuple(args)
        self._name = name
        self._popen: subprocess.Popen[bytes] | None = None
        self._sentinel = -1

    @property
    def name(self) -> str:
        return self._name

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def sentinel(self) -> int:
        """A descriptor that is ready (end of file) once the child ended; for `multiprocessing.connection.wait`."""
        if self._popen is None:
            raise ValueError(f"{self._name}: not started")
        return self._sentinel

    @property
    def exitcode(self) -> int | None:
        """None while it runs; else its exit code, or minus the signal that ended it (as multiprocessing's)."""
        return None if self._popen is None else self._popen.poll()

    def start(self) -> None:
        """Starts the child. Raises TypeError when the target or its arguments hold something of ``__main__``
        or do not pickle."""
        if self._popen is not None:
            raise ValueError(f"{self._name}: already started")
        fds: list[int] = []
        buffer = io.BytesIO()
        try:
            _Pickler(buffer, fds, self._name).dump((self._target, self._args))
        except TypeError:
            raise
        except Exception as exc:
            raise TypeError(f"{self._name}: its target and arguments must pickle: {exc}") from exc
        boot_read, boot_write = os.pipe()
        sentinel, held = os.pipe()  # the child holds `held` for life: `sentinel` reads end of file once it ended
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(boot_read), str(held), json.dumps(_search_path())],
                pass_fds=(boot_read, held, *fds),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (boot_write, sentinel):
                os.close(fd)
            raise
        finally:
            os.close(boot_read)
            os.close(held)
        self._sentinel = sentinel
        weakref.finalize(self, os.close, sentinel)
        try:
            rest = memoryview(buffer.getvalue())
            while rest:
                rest = rest[os.write(boot_write, rest) :]
        except BrokenPipeError:  # it died at once: that shows in its sentinel and exit code
            pass
        finally:
            os.close(boot_write)

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Waits until the child ended (and reaps it), or `timeout` seconds."""
        if self._popen is None:
            raise ValueError(f"{self._name}: not started")
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        if not multiprocessing.connection.wait([self._sentinel], timeout):
            return
        # It closed its descriptors; its exit status follows at once.
        left = None if deadline is None else max(0.05, deadline - time.monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(left)

    def kill(self) -> None:
        """SIGKILL, unless it was already reaped (so a reused pid is never signalled)."""
        if self._popen is not None:
            self._popen.kill()

    def terminate(self) -> None:
        if self._popen is not None:
            self._popen.terminate()

    def __repr__(self) -> str:
        state = "initial" if self._popen is None else ("started" if self.exitcode is None else "stopped")
        return f"<Child name={self._name!r} pid={self.pid} {state}>"


def _search_path() -> list[str]:
    """The caller's ``sys.path`` for the child (entries that are not strings are never searched: dropped)."""
    return [entry for entry in sys.path if isinstance(entry, str)]


class _Context:
    """`Child` in the shape of a `multiprocessing` context: ``Process`` and ``Pipe``."""

    Process = Child

    @staticmethod
    def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
        return multiprocessing.Pipe(duplex)


def context(method: str) -> Any:
    """The processes of start method `method`: `START_METHOD` for `Child`, else `multiprocessing`'s context (which
    raises ValueError for an unknown method)."""
    if method == START_METHOD:
        return _Context()
    return multiprocessing.get_context(method)


class _Pickler(pickle.Pickler):
    """Pickles a child's target and arguments: descriptors by number (collected in `fds`), never anything of
    the caller's main module."""

    def __init__(self, file: io.BytesIO, fds: list[int], name: str) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds = fds
        self.child = name

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, Connection):
            self.fds.append(obj.fileno())
            return ("connection", obj.fileno(), obj.readable, obj.writable)
        if getattr(type(obj), "inherited_fd", False) is True and isinstance(getattr(obj, "fd", None), int):
            self.fds.append(obj.fd)
            return ("descriptor", type(obj), obj.fd)
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            raise TypeError(
                f"{self.child}: {obj!r} is defined in the main module (__main__), which uform's processes never "
                "import (they start on a module of uform's, whatever the script's form); pass something "
                "importable from a module by name"
            )
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        fd = rest[1] if kind == "descriptor" else rest[0]
        os.set_inheritable(fd, False)  # ours alone: processes this child starts do not hold it
        if kind == "connection":
            return Connection(fd, readable=rest[1], writable=rest[2])
        if kind == "descriptor":
            return rest[0](fd)
        raise pickle.UnpicklingError(f"unknown descriptor kind {kind!r}")


def main(boot: int, held: int) -> None:
    """The child's side: read the target and its arguments from `boot`, then run it; `held` stays open for life
    (the parent's sentinel)."""
    os.set_inheritable(held, False)
    with open(boot, "rb") as source:
        data = source.read()
    try:
        target, args = _Unpickler(io.BytesIO(data)).load()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    del data
    target(*args)
