"""How an exception raised in a helper process crosses back to its owner: its type and its traceback's text.

A helper packs the exception it caught (`pack_error`): its type's qualified name, its message, its traceback as
text and, where it pickles and comes back whole (the same type, the same message), the exception itself. The
owner rebuilds it (`unpack_error`): the same exception where its type is importable here and an `Exception`
(``KeyboardInterrupt`` and ``SystemExit`` are the helper's, never re-raised as the owner's own), else a
`RemoteError`, a `RuntimeError` that names the original type. Either way the remote traceback is attached as the
exception's ``__cause__``, a `RemoteTraceback` whose text is the helper's traceback, as
`concurrent.futures.ProcessPoolExecutor` does: the message stays exactly the one raised in the helper (a caller
that compares it with one process's sees no difference), and a printed traceback shows where it happened.

Standard library only: the decode pool's workers import it.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

__all__ = ["RemoteError", "RemoteTraceback", "describe", "pack_error", "unpack_error"]


class RemoteError(RuntimeError):
    """An exception raised in a helper process whose type cannot be rebuilt here (not importable, not
    picklable, or not an `Exception`): its message is ``"<type name>: <message>"``; `remote_type` is the
    original type's qualified name (``module.QualName``)."""

    def __init__(self, message: str, remote_type: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.remote_type)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a helper process, as text (the rebuilt exception's cause)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def describe(error: BaseException) -> str:
    """``"ValueError: <message>"``, or just the type name when the message is empty; a `RemoteError` as its
    own message (which already names the original type)."""
    try:
        message = str(error)
    except Exception:
        message = "<unprintable message>"
    if isinstance(error, RemoteError):
        return message
    name = type(error).__name__
    return f"{name}: {message}" if message else name


def pack_error(error: BaseException) -> bytes:
    """`error` (with the traceback it was raised with) as bytes for `unpack_error` in the owner's process."""
    kind = type(error)
    name = f"{kind.__module__}.{kind.__qualname__}"
    try:
        message = str(error)
    except Exception:
        message = "<unprintable message>"
    text = "".join(traceback.format_exception(error)).rstrip()
    whole = None
    if isinstance(error, Exception):
        try:
            whole = pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
            back = pickle.loads(whole)
            if type(back) is not kind or str(back) != message:
                whole = None  # it would not come back as itself
        except Exception:
            whole = None
    return pickle.dumps((name, message, text, whole), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_error(payload: bytes | memoryview, where: str) -> BaseException:
    """The exception `pack_error` packed, raised in `where` (a helper process, in words): itself where it comes
    back whole, else a `RemoteError`; its ``__cause__`` the remote traceback."""
    name, message, text, whole = pickle.loads(payload)
    error: BaseException | None = None
    if whole is not None:
        try:
            error = pickle.loads(whole)
        except Exception:  # its type does not import here
            error = None
    if not isinstance(error, Exception):
        short = name.rpartition(".")[2]
        error = RemoteError(f"{short}: {message}" if message else short, name)
    error.__cause__ = RemoteTraceback(f"raised in {where}:\n{text}")
    return error
