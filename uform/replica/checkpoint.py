"""Checkpoints as safetensors files: written atomically by our own writer, read after our own integrity checks.

Nothing here ever unpickles: `torch.load` and pickle are never called, and a file that is not a whole, intact
uform checkpoint is refused with `CheckpointError` before any of its data is trusted.

File layout (the safetensors format): an 8-byte little-endian header size N, N bytes of UTF-8 JSON header
(padded with spaces to a multiple of 8 bytes), then the tensors' raw little-endian bytes, contiguous. Our writer
orders the data by element size (largest first) and then by name, so every tensor starts at an offset that is a
multiple of its element size, exactly as the reference writer does.

The digest stored in the `"uform.digest"` metadata key is the hex SHA-256 of::

    b"uform.replica.checkpoint.v1\\0" || u64(tensor count)
      || for each tensor, in name order: SHA-256(field(name) || field(dtype string) || u64(ndim) || u64(dim)...
                                                 || u64(byte count) || raw bytes)
      || u64(metadata count) || for each metadata key other than "uform.digest", in key order: field(key) || field(value)

where u64 is 8 bytes little-endian and field(s) is u64(len(utf8(s))) || utf8(s). Hashing each tensor on its own
keeps the digest independent of file order and lets the writer hash while writing (one pass, one tensor in host
memory at a time); covering the metadata too means the stored configuration cannot change silently either.

The digest detects damage, not forgery: anyone who edits a file can recompute it. So the reader trusts no size
in a header because the digest matched: every shape, offset and count is bounded by the file's own length before
anything is allocated, and only regular files are opened. What a trainer checkpoint's metadata says (its config,
step and counters) is checked against its tensors in `stored_run`.

The trainer checkpoint's schema, every key a save writes and a resume or a load reads, is `run_schema`.

Temporary files: a save writes ".<name>.tmp-<pid>-<12 hex>" beside the target and renames it into place. A save
killed part-way leaves its temporary file; the next save into that folder removes those of dead processes that
have gone unmodified for `STALE_TEMP_SECONDS` (`remove_stale_temps`), and nothing else.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import io
import json
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "DIGEST_KEY",
    "CheckpointError",
    "Layout",
    "ProgressCallback",
    "Stopped",
    "no_constants",
    "read_checkpoint",
    "read_layout",
    "read_metadata",
    "remove_stale_temps",
    "report_points",
    "write_checkpoint",
]

ProgressCallback = Callable[[int, int], "bool | None"]
"""Called as `progress(done, total)`; answering exactly `False` stops the call (`None` or `True` go on)."""

DIGEST_KEY = "uform.digest"
"""The metadata key holding the checkpoint's hex SHA-256 digest."""

MAX_HEADER_BYTES = 100_000_000
"""Largest JSON header we will read (the safetensors library's own limit)."""

MAX_DIMS = 64
"""Most dimensions a tensor's shape may have: it bounds the work of checking one (our files have at most two)."""

MAX_ELEMENTS = 2**62
"""Most elements a tensor may count, every dimension taken as at least one (well inside torch's int64)."""

_DIGEST_DOMAIN = b"uform.replica.checkpoint.v1\0"
_METADATA_KEY = "__metadata__"
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
_ITEMSIZE: dict[str, int] = {name: torch.empty((), dtype=dtype).element_size() for dtype, name in _DTYPE_NAMES.items()}


class Stopped(Exception):
    """A progress callback answered False and the call stopped; nothing it would have changed was changed."""


class CheckpointError(ValueError):
    """A file that is not a whole, intact uform checkpoint; the message names the file and what is wrong."""


# --------------------------------------------------------------------------------------------------
# Shared helpers


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def _field(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _u64(len(raw)) + raw


def _raw_bytes(tensor: torch.Tensor) -> Any:
    """The little-endian bytes of a CPU tensor, as a flat uint8 numpy array (a view where possible)."""
    flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _tensor_record(name: str, dtype: str, shape: tuple[int, ...] | list[int], data: Any) -> bytes:
    """SHA-256 of one tensor's name, dtype string, shape and raw bytes (see the module docstring)."""
    h = hashlib.sha256()
    h.update(_field(name))
    h.update(_field(dtype))
    h.update(_u64(len(shape)))
    for dim in shape:
        h.update(_u64(dim))
    h.update(_u64(data.nbytes))
    h.update(data)
    return h.digest()


def _combine(records: Mapping[str, bytes], metadata: Mapping[str, str]) -> str:
    """The checkpoint digest from per-tensor records and the metadata (its own digest key left out)."""
    h = hashlib.sha256(_DIGEST_DOMAIN)
    h.update(_u64(len(records)))
    for name in sorted(records):
        h.update(records[name])
    keys = sorted(k for k in metadata if k != DIGEST_KEY)
    h.update(_u64(len(keys)))
    for key in keys:
        h.update(_field(key))
        h.update(_field(metadata[key]))
    return h.hexdigest()


def report_points(total: int, steps: int) -> set[int]:
    """The `done` values at which to report: at most `steps` of them, evenly spread, always ending at `total`."""
    if total == 0:
        return {0}
    count = min(steps, total)
    return {(k * total) // count for k in range(1, count + 1)}


def _check_steps(progress_steps: int) -> None:
    if isinstance(progress_steps, bool) or not isinstance(progress_steps, int) or progress_steps < 1:
        raise ValueError(f"progress_steps must be a positive int, got {progress_steps!r}")


def _display(path: str | bytes) -> str:
    return os.fsdecode(path)


# --------------------------------------------------------------------------------------------------
# Writing


_Planned = tuple[str, torch.Tensor, str, tuple[int, ...], int]
"""One tensor to write: (name, tensor, dtype string, shape, byte count)."""


def _plan(tensors: Mapping[str, torch.Tensor]) -> list[_Planned]:
    """Validate every tensor up front and lay them out: (name, tensor, dtype string, shape, byte count)."""
    plan = []
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if name == _METADATA_KEY:
            raise ValueError(f"{_METADATA_KEY!r} is reserved and cannot name a tensor")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.layout != torch.strided:
            raise TypeError(f"tensor {name!r} has layout {tensor.layout}; only dense (strided) tensors are saved")
        dtype = _DTYPE_NAMES.get(tensor.dtype)
        if dtype is None:
            supported = ", ".join(str(d) for d in _DTYPE_NAMES)
            raise TypeError(f"tensor {name!r} has unsupported dtype {tensor.dtype} (supported: {supported})")
        shape = tuple(int(d) for d in tensor.shape)
        plan.append((name, tensor, dtype, shape, math.prod(shape) * _ITEMSIZE[dtype]))
    plan.sort(key=lambda item: (-_ITEMSIZE[item[2]], item[0]))
    return plan


def _header_bytes(plan: list[_Planned], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {_METADATA_KEY: dict(metadata)}
    offset = 0
    for name, _, dtype, shape, nbytes in plan:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


_TEMP_PATTERN = r"\..+\.tmp-([0-9]{1,10})-[0-9a-f]{12}"
"""The name `_create_temp` gives: "." + the target's name + ".tmp-" + the writer's pid + "-" + 12 hex digits."""
_TEMP_NAME = re.compile(_TEMP_PATTERN, re.DOTALL)

STALE_TEMP_SECONDS = 600
"""How long a temporary file of ours must have gone unmodified before a later save may remove it."""


def _create_temp(folder: str | bytes, base: str | bytes) -> tuple[int, str | bytes]:
    """Create a fresh temporary file beside the target (mode 0o666 less the umask, like any new file)."""
    for _ in range(100):
        suffix = f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
        temp: str | bytes
        if isinstance(base, bytes):
            temp = os.path.join(os.fsencode(folder), b"." + base + os.fsencode(suffix))
        else:
            temp = os.path.join(os.fsdecode(folder), "." + base + suffix)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue
        return fd, temp
    raise FileExistsError(errno.EEXIST, "could not create a unique temporary file", _display(folder))


def _pid_alive(pid: int) -> bool:
    """Whether a process of that id runs on this machine (True when it cannot be told)."""
    if os.name != "posix" or not 0 < pid < 2**31:
        return True  # off POSIX, os.kill(pid, 0) would end the process: never ask there
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: it runs, as another user
    return True


def remove_stale_temps(folder: str | bytes) -> list[str]:
    """Removes from `folder` the temporary files that killed saves left behind; answers the paths removed.

    A file is removed only when all of these hold: its name is exactly the pattern `write_checkpoint` gives
    (".<name>.tmp-<pid>-<12 lowercase hex>"), it is a regular file (not a link) owned by this user, the process
    whose id it names is not alive on this machine, and it has not been modified for `STALE_TEMP_SECONDS`. The
    pid rule keeps a save that another process of this machine is writing right now; the age rule keeps one that
    a process elsewhere (another host or pid namespace sharing the folder, whose pid means nothing here) is
    writing, since a live write touches the file with every tensor. A file that cannot be removed is left.
    """
    removed: list[str] = []
    now = time.time()
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    try:
        entries = list(os.scandir(os.fsdecode(folder)))  # str names; undecodable bytes kept as surrogates
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode) or (uid is not None and info.st_uid != uid):
            continue
        if now - info.st_mtime < STALE_TEMP_SECONDS or _pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(entry.path)
    return removed


def _fsync_folder(folder: str | bytes) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_checkpoint(
    path: str | bytes | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    progress: ProgressCallback | None = None,
    progress_steps: int = 10,
) -> None:
    """Write `tensors` and `metadata` to `path` as a safetensors file, atomically.

    The file appears at `path` whole or not at all: it is written to a temporary file in the same folder, flushed
    and fsynced, then renamed onto `path`. `metadata` gains the `"uform.digest"` key (any value the caller passed
    for it is replaced). Tensors may live on any device; each is copied to host memory on its own as it is written.

    `progress(done, total)` is called at most `progress_steps` times with total the number of tensors, the last
    call at done == total just before the rename. Answering `False` raises `Stopped`; as with any other failure,
    the temporary file is removed and whatever was at `path` before is left untouched. An `OSError` while writing
    (a full disk: ENOSPC) is raised again with its errno, naming `path`.

    Temporary files that earlier, killed saves left in the folder are removed first (`remove_stale_temps`).
    """
    _check_steps(progress_steps)
    target = os.fspath(path)
    folder, base = os.path.split(target)
    if not base:
        raise IsADirectoryError(errno.EISDIR, "checkpoint path names a folder", _display(target))
    if not folder:
        folder = b"." if isinstance(target, bytes) else "."
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, "checkpoint folder does not exist", _display(folder))

    meta: dict[str, str] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata must map str to str, got {key!r}: {type(value).__name__}")
        if key != DIGEST_KEY:
            meta[key] = value
    plan = _plan(tensors)
    total = len(plan)
    points = report_points(total, progress_steps)

    # The digest is a fixed 64 hex characters, so the header can be written with a placeholder and rewritten in
    # place once the data (hashed as it is written) is known.
    header = _header_bytes(plan, {**meta, DIGEST_KEY: "0" * 64})

    remove_stale_temps(folder)
    fd, temp = _create_temp(folder, base)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(_u64(len(header)))
            out.write(header)
            records: dict[str, bytes] = {}
            for done, (name, tensor, dtype, shape, nbytes) in enumerate(plan, start=1):
                host = tensor.detach().to("cpu")
                data = _raw_bytes(host)
                if data.nbytes != nbytes:
                    raise RuntimeError(f"tensor {name!r} changed size while being written")
                out.write(memoryview(data))
                records[name] = _tensor_record(name, dtype, shape, data)
                del host, data
                if progress is not None and done < total and done in points and progress(done, total) is False:
                    raise Stopped(f"writing {_display(target)} stopped at {done} of {total} tensors")
            final = _header_bytes(plan, {**meta, DIGEST_KEY: _combine(records, meta)})
            if len(final) != len(header):
                raise RuntimeError("checkpoint header changed length; this is a bug")
            out.seek(8)
            out.write(final)
            out.flush()
            os.fsync(out.fileno())
        if progress is not None and progress(total, total) is False:
            raise Stopped(f"writing {_display(target)} stopped at {total} of {total} tensors")
        os.replace(temp, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(error, OSError) and error.errno is not None:
            # A full disk surfaces in write or fsync with no file named; say which checkpoint failed.
            raise OSError(
                error.errno,
                f"{error.strerror or error}: checkpoint not written (whatever was at the path is unchanged)",
                _display(target),
            ) from error
        raise
    _fsync_folder(folder)


# --------------------------------------------------------------------------------------------------
# Reading


class _Header:
    """A validated header: metadata, tensor entries in file order, and where the data starts."""

    def __init__(self, metadata: dict[str, str], entries: list[tuple[str, str, list[int], int, int]], start: int):
        self.metadata = metadata
        self.entries = entries
        self.start = start


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def no_constants(name: str) -> Any:
    """`json.loads`' `parse_constant`: NaN and the infinities are not JSON."""
    raise ValueError(f"non-standard JSON constant {name}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _open_regular(target: str | bytes) -> io.FileIO:
    """The file at `target`, opened for reading only if it is a regular file.

    O_NONBLOCK makes opening a FIFO (or a device that would wait for a peer) return at once instead of blocking
    until a writer appears; the fstat then refuses it. On a regular file the flag changes nothing.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(target, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a named pipe" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "a special file"
            raise CheckpointError(
                f"{_display(target)}: is {kind}, not a regular file; a checkpoint is read only from a regular file"
            )
        return io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def _read_exactly(f: io.FileIO, offset: int, out: memoryview) -> int:
    """Fills `out` from `offset` of `f`; answers the bytes read (fewer only when the file ended)."""
    f.seek(offset)
    done = 0
    while done < len(out):
        got = f.readinto(out[done:])
        if not got:
            break
        done += got
    return done


def _read_header(f: io.FileIO, shown: str) -> _Header:
    """The header of the open file `f`, every size, shape and offset in it bounded by the file's own length.

    The checks are those of the safetensors loader (`safetensors/src/tensor.rs`, `Metadata::validate`: a header
    length within the file and its 100 MB cap, known dtypes, byte spans that match their shapes, data that is
    one contiguous run to the file's end), and more: a bounded rank and element count, so no size is trusted,
    and nothing allocated, before it is known to fit the file.
    """

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"{shown}: {what}")

    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise fail(f"file is {size} bytes, too short to hold a safetensors header")
    prefix = bytearray(8)
    if _read_exactly(f, 0, memoryview(prefix)) != 8:
        raise fail("file shrank while its header was being read")
    n = int.from_bytes(prefix, "little")
    if n > size - 8 or n > MAX_HEADER_BYTES:
        raise fail(f"header size {n} is absurd for a {size}-byte file; not a safetensors checkpoint")
    raw = bytearray(n)
    if _read_exactly(f, 8, memoryview(raw)) != n:
        raise fail("file shrank while its header was being read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"header is not UTF-8 ({e.reason} at byte {e.start}); not a safetensors checkpoint") from None
    del raw
    if not text.startswith("{"):
        raise fail("header is not a JSON object; not a safetensors checkpoint")
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise fail(f"header is not valid JSON ({e}); not a safetensors checkpoint") from None
    if not isinstance(header, dict):
        raise fail("header is not a JSON object; not a safetensors checkpoint")

    metadata = header.pop(_METADATA_KEY, None)
    if metadata is None:
        raise fail("not a uform checkpoint: the header has no __metadata__")
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise fail("__metadata__ is not a JSON object of strings")
    digest = metadata.get(DIGEST_KEY)
    if digest is None:
        raise fail(f"not a uform checkpoint: no {DIGEST_KEY!r} in its metadata")
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise fail(f"corrupted: {DIGEST_KEY!r} is not a 64-digit lowercase hex SHA-256")

    data_len = size - 8 - n
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != _ENTRY_KEYS:
            raise fail(f"tensor {name!r} header entry is malformed (needs exactly dtype, shape, data_offsets)")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _DTYPES:
            raise fail(f"tensor {name!r} has unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
            raise fail(f"tensor {name!r} has a malformed shape {shape!r} (at most {MAX_DIMS} dimensions, each >= 0)")
        # The count grows one dimension at a time and stops past the limit: no huge product is ever computed,
        # and an empty tensor's other dimensions are bounded too (torch.empty refuses counts past int64).
        elements = 1
        for d in shape:
            elements *= max(d, 1)
            if elements > MAX_ELEMENTS:
                raise fail(f"tensor {name!r} has shape {shape}, of more than 2^62 elements")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise fail(f"tensor {name!r} has malformed data_offsets {offsets!r}")
        begin, end = offsets
        if end > data_len:
            raise fail(f"truncated: tensor {name!r} ends at data byte {end} but the file holds only {data_len}")
        need = math.prod(shape) * _ITEMSIZE[dtype]
        if end - begin != need:
            raise fail(f"tensor {name!r} spans {end - begin} bytes but its {dtype} shape {shape} needs {need}")
        entries.append((name, dtype, shape, begin, end))

    entries.sort(key=lambda e: (e[3], e[4]))
    expected = 0
    for name, _, _, begin, end in entries:
        if begin < expected:
            raise fail(f"tensor {name!r} overlaps the tensor before it (data byte {begin} < {expected})")
        if begin > expected:
            raise fail(f"gap of {begin - expected} unaccounted bytes before tensor {name!r}")
        expected = end
    if expected != data_len:
        raise fail(f"{data_len - expected} trailing bytes after the last tensor (file padded or appended to)")
    return _Header(metadata, entries, 8 + n)


Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""Every tensor of a checkpoint as name -> (dtype, shape), read from its header."""


def read_layout(path: str | bytes | os.PathLike) -> tuple[dict[str, str], Layout]:
    """The checkpoint's metadata (with its digest) and its tensors' dtypes and shapes, from the header alone,
    after the header checks: what a caller checks against what it expects before any data is read."""
    target = os.fspath(path)
    with _open_regular(target) as f:
        header = _read_header(f, _display(target))
    return dict(header.metadata), {e[0]: (_DTYPES[e[1]], tuple(e[2])) for e in header.entries}


def read_metadata(path: str | bytes | os.PathLike) -> dict[str, str]:
    """The checkpoint's metadata (with its `"uform.digest"`), from the header alone, after the header checks.

    The data is not read, so a bit flip in it is not detected here; `read_checkpoint` detects it.
    """
    return read_layout(path)[0]


def read_checkpoint(
    path: str | bytes | os.PathLike,
    progress: ProgressCallback | None = None,
    progress_steps: int = 10,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a checkpoint written by `write_checkpoint`: (tensors on `device`, metadata with its digest).

    Only a regular file is opened (a named pipe is refused at once, never waited on). The header is validated
    before anything else is trusted; each tensor is then allocated at its checked size (all of them together
    span exactly the file's data, so a file allocates at most its own length) and read straight from the same
    open file, and the digest is verified over everything read before anything is returned. Any failure is a
    `CheckpointError` naming the file. `progress(done, total)` is called at most `progress_steps` times, the
    last at done == total once the digest checks out; answering `False` raises `Stopped` and nothing is returned.
    """
    _check_steps(progress_steps)
    target = os.fspath(path)
    shown = _display(target)
    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    records: dict[str, bytes] = {}
    with _open_regular(target) as f:
        header = _read_header(f, shown)
        total = len(header.entries)
        points = report_points(total, progress_steps)
        for done, (name, dtype, shape, begin, end) in enumerate(header.entries, start=1):
            tensor = torch.empty(shape, dtype=_DTYPES[dtype])  # [shape]: end - begin bytes
            data = tensor.reshape(-1).view(torch.uint8).numpy()  # [end - begin] uint8, the tensor's own memory
            if _read_exactly(f, header.start + begin, data.data) != end - begin:
                raise CheckpointError(f"{shown}: file shrank while being read")
            if dtype == "BOOL" and data.size and int(data.max()) > 1:
                raise CheckpointError(f"{shown}: tensor {name!r} holds bytes other than 0 and 1 for booleans")
            records[name] = _tensor_record(name, dtype, shape, data)
            out[name] = tensor if device.type == "cpu" else tensor.to(device)
            del tensor, data
            if progress is not None and done < total and done in points and progress(done, total) is False:
                raise Stopped(f"reading {shown} stopped at {done} of {total} tensors")
    if not hmac.compare_digest(_combine(records, header.metadata), header.metadata[DIGEST_KEY]):
        raise CheckpointError(f"{shown}: corrupted: digest mismatch")
    if progress is not None and progress(total, total) is False:
        raise Stopped(f"reading {shown} stopped at {total} of {total} tensors")
    return dict(sorted(out.items())), dict(header.metadata)
