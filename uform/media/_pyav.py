"""Opening media bytes with PyAV: the demuxer forced, no other file ever opened, metadata never fatal."""

from __future__ import annotations

import io
from typing import Any

import av
import av.container

from .limits import MediaError

# PyAV up to 18 decodes metadata strictly unless `av.open(metadata_errors=...)` says otherwise (a tag that is
# not UTF-8 then fails the whole file); PyAV 19 dropped the keyword and always decodes with
# "surrogateescape". Feature-detected from the container class, which lost its `metadata_errors` with it.
_OPEN_OPTIONS: dict[str, Any] = (
    {"metadata_errors": "ignore"} if hasattr(av.container.Container, "metadata_errors") else {}
)


def open_input(data: bytes, demuxer: str, what: str) -> Any:
    """An input container over `data` read with `demuxer` only: FFmpeg never probes, so never reads a
    playlist, a concat list or another format that opens further files; one that asks to open a file
    raises MediaError naming `what` ("video", "audio")."""

    def no_files(url: str, flags: int, options: dict[str, Any]) -> Any:
        raise MediaError(f"the {what} refers to another file ({url!r})")

    return av.open(io.BytesIO(data), mode="r", format=demuxer, io_open=no_files, **_OPEN_OPTIONS)
