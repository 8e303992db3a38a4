"""A source spec into its shards' names: paths, globs, lists of them and WebDataset-style brace ranges.

`expand("shards/{000..099}.tar")` names a hundred shards, zero-padded as written (webdataset's brace
notation, read here and written anew; `{a,b}` lists alternatives). A glob (`*`, `?`, `[...]`) names the
files it matches, sorted; a name without either is taken as it is. A name with a scheme (`s3://`,
`memory://`, ...) goes through fsspec, an optional extra imported only then.
"""

from __future__ import annotations

import glob as globbing
import os
import re
from collections.abc import Iterator
from typing import IO, Any

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_CHOICE = re.compile(r"\{([^{}]*,[^{}]*)\}")
_GLOB = re.compile(r"[*?\[]")


def is_url(name: str) -> bool:
    """Whether `name` carries a scheme (`s3://...`), so that fsspec opens it; `file://` counts too."""
    return "://" in name


def braces(name: str) -> list[str]:
    """Every name a brace pattern spells, in order: `{000..002}` counts (padded to the wider bound as
    written), `{a,b}` alternates; the leftmost brace first, so later ones vary fastest."""
    found = _RANGE.search(name)
    choice = _CHOICE.search(name)
    if found is None and choice is None:
        return [name]
    if found is not None and (choice is None or found.start() < choice.start()):
        low, high = found.group(1), found.group(2)
        if int(high) < int(low):
            raise ValueError(f"spec {name!r}: the range {found.group(0)} runs backwards")
        width = len(low) if low.startswith("0") or len(low) == len(high) else 0
        options = [str(k).zfill(width) for k in range(int(low), int(high) + 1)]
        head, tail = name[: found.start()], name[found.end() :]
    else:
        assert choice is not None
        options = choice.group(1).split(",")
        head, tail = name[: choice.start()], name[choice.end() :]
    return [expanded for option in options for expanded in braces(head + option + tail)]


def _filesystem(name: str) -> Any:
    try:
        import fsspec  # local: an optional extra, imported only for a URL
    except ImportError:
        raise ValueError(
            f"spec {name!r}: a URL needs fsspec (pip install 'uform[sources]'), which is not installed"
        ) from None
    filesystem, _ = fsspec.core.url_to_fs(name)
    return filesystem


def _glob(name: str) -> list[str]:
    if is_url(name):
        filesystem = _filesystem(name)
        protocol = name.split("://", 1)[0]
        return sorted(f"{protocol}://{found.split('://', 1)[-1].lstrip('/')}" for found in filesystem.glob(name))
    return sorted(globbing.glob(name))


def expand(spec: str | os.PathLike | list | tuple) -> list[str]:
    """The shard names `spec` (a name, a glob, a brace pattern, or a list or tuple of them) spells, in the
    spec's order; `ValueError` for a spec naming nothing (a glob that matches no file, say)."""
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError("spec: an empty list names no shard")
        return [name for part in spec for name in expand(part)]
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"spec: expected a path, a glob, a URL or a list of them, got {type(spec).__name__}")
    out = []
    for name in braces(os.fspath(spec)):
        if _GLOB.search(name.split("://", 1)[-1]):
            matched = _glob(name)
            if not matched:
                raise ValueError(f"spec {name!r}: the glob matches no file")
            out.extend(matched)
        else:
            out.append(name)
    return out


def open_binary(name: str) -> IO[bytes]:
    """`name` opened for reading bytes: a local path directly, a URL through fsspec."""
    if is_url(name):
        return _filesystem(name).open(name, "rb")
    return open(name, "rb")


def exists(name: str) -> bool:
    """Whether `name` (a path or a URL) names a file."""
    if is_url(name):
        return bool(_filesystem(name).isfile(name))
    return os.path.isfile(name)


def is_folder(name: str) -> bool:
    """Whether `name` (a path or a URL) names a folder."""
    if is_url(name):
        return bool(_filesystem(name).isdir(name))
    return os.path.isdir(name)


def listing(name: str) -> list[str]:
    """The files directly in folder `name`, sorted, as full names."""
    if is_url(name):
        protocol = name.split("://", 1)[0]
        found = _filesystem(name).ls(name, detail=True)
        return sorted(f"{protocol}://{f['name'].lstrip('/')}" for f in found if f["type"] == "file")
    return sorted(os.path.join(name, f) for f in os.listdir(name) if os.path.isfile(os.path.join(name, f)))


def join(base: str, relative: str) -> str:
    """`relative` read against the folder of shard `base` (a manifest's media paths); absolute stays."""
    if is_url(relative) or os.path.isabs(relative):
        return relative
    if is_url(base):
        return base.rsplit("/", 1)[0] + "/" + relative
    return os.path.join(os.path.dirname(base), relative)


def read_bytes(name: str) -> bytes:
    """The whole file `name`."""
    with open_binary(name) as file:
        return file.read()


def lines(name: str) -> Iterator[bytes]:
    """`name`'s lines, streamed."""
    with open_binary(name) as file:
        yield from file
