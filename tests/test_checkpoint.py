"""Checkpoint files: round trips, format compatibility, progress, atomicity, and refusing anything not intact."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import pytest
import safetensors
import safetensors.torch
import torch
from conftest import within

from uform.replica import checkpoint
from uform.replica.checkpoint import CheckpointError, Stopped, read_checkpoint, read_metadata, write_checkpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent

INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bit pattern, so NaN payloads and signed zeros compare exactly."""
    t = t.detach().cpu().contiguous()
    return t.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(bits(a[name]), bits(b[name])), name


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    raw16 = torch.randint(-(2**15), 2**15, (5, 7), generator=g, dtype=torch.int16)  # every bf16/f16 bit pattern
    return {
        "f32": torch.tensor([0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e-45]),
        "f16": raw16.view(torch.float16),
        "bf16": raw16.flip(0).contiguous().view(torch.bfloat16),
        "f64": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0]),
        "i32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
        "i16": torch.tensor([-(2**15), 2**15 - 1], dtype=torch.int16),
        "i8": torch.arange(-128, 128, dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8).reshape(16, 16),
        "bool": torch.tensor([[True, False], [False, True]]),
        "scalar_f32": torch.tensor(3.25),
        "scalar_bf16": torch.tensor(-2.5, dtype=torch.bfloat16),
        "scalar_bool": torch.tensor(True),
        "empty": torch.empty(0),
        "empty_2d_i64": torch.empty(3, 0, dtype=torch.int64),
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "ünï/cödé.name": torch.tensor([1, 2], dtype=torch.int32),
    }


METADATA = {"config": json.dumps({"hidden": 64, "name": "tiny"}), "note": "ünïcödé ✓", "empty": ""}


def small_tensors() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 2, 3], dtype=torch.int8)}


@pytest.fixture
def saved(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "model.safetensors"
    write_checkpoint(path, small_tensors(), {"k": "v"})
    return path


def header_span(path: pathlib.Path) -> tuple[int, int]:
    raw = path.read_bytes()
    return 8, 8 + int.from_bytes(raw[:8], "little")


# --------------------------------------------------------------------------------------------------
# Round trips and format


def test_round_trip_every_dtype_bit_exact(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "ckpt.safetensors"
    write_checkpoint(path, tensors, METADATA)
    loaded, metadata = read_checkpoint(path)
    assert_same(loaded, tensors)
    assert {k: v for k, v in metadata.items() if k != checkpoint.DIGEST_KEY} == METADATA
    assert len(metadata[checkpoint.DIGEST_KEY]) == 64
    assert read_metadata(path) == metadata
    assert all(t.device.type == "cpu" for t in loaded.values())
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]


def test_every_supported_dtype_is_covered():
    assert {t.dtype for t in sample_tensors().values()} == set(checkpoint._DTYPE_NAMES)


def test_format_compatible_with_safetensors_library(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "ckpt.safetensors"
    write_checkpoint(path, tensors, METADATA)
    assert_same(safetensors.torch.load_file(path), tensors)
    assert_same(safetensors.torch.load(path.read_bytes()), tensors)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == read_metadata(path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    for name, info in header.items():
        if name != "__metadata__":  # every tensor starts aligned to its element size
            assert info["data_offsets"][0] % checkpoint._ITEMSIZE[info["dtype"]] == 0, name


def test_empty_checkpoint_and_deterministic_bytes(tmp_path):
    write_checkpoint(tmp_path / "empty", {}, {})
    assert read_checkpoint(tmp_path / "empty")[0] == {}
    write_checkpoint(tmp_path / "one", sample_tensors(), METADATA)
    loaded, metadata = read_checkpoint(tmp_path / "one")
    write_checkpoint(tmp_path / "two", loaded, metadata)  # the stale digest passed back in is recomputed
    assert (tmp_path / "one").read_bytes() == (tmp_path / "two").read_bytes()


def test_digest_covers_names_dtypes_and_metadata(tmp_path):
    a = {"x": torch.zeros(2, dtype=torch.int16)}
    write_checkpoint(tmp_path / "a", a, {"m": "1"})
    digests = {
        read_metadata(tmp_path / "a")[checkpoint.DIGEST_KEY],
    }
    write_checkpoint(tmp_path / "b", {"y": torch.zeros(2, dtype=torch.int16)}, {"m": "1"})
    write_checkpoint(tmp_path / "c", {"x": torch.zeros(2, dtype=torch.float16)}, {"m": "1"})
    write_checkpoint(tmp_path / "d", {"x": torch.zeros(1, 2, dtype=torch.int16)}, {"m": "1"})
    write_checkpoint(tmp_path / "e", a, {"m": "2"})
    for name in "bcde":
        digests.add(read_metadata(tmp_path / name)[checkpoint.DIGEST_KEY])
    assert len(digests) == 5


def test_paths_as_bytes_and_pathlike(tmp_path):
    tensors = small_tensors()
    as_bytes = os.fsencode(tmp_path / "bytes.safetensors")
    write_checkpoint(as_bytes, tensors, {"k": "v"})
    assert_same(read_checkpoint(as_bytes)[0], tensors)
    assert read_metadata(as_bytes)["k"] == "v"
    as_path = tmp_path / "path.safetensors"
    write_checkpoint(as_path, tensors, {"k": "v"})
    assert_same(read_checkpoint(as_path)[0], tensors)
    assert read_metadata(as_path)["k"] == "v"
    assert sorted(os.listdir(tmp_path)) == ["bytes.safetensors", "path.safetensors"]


def test_relative_path_in_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_checkpoint("rel.safetensors", small_tensors(), {})
    write_checkpoint(b"relb.safetensors", small_tensors(), {})
    assert_same(read_checkpoint("rel.safetensors")[0], read_checkpoint(b"relb.safetensors")[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_round_trip(tmp_path):
    tensors = {k: v.cuda() for k, v in sample_tensors().items()}
    write_checkpoint(tmp_path / "gpu", tensors, METADATA)
    loaded, _ = read_checkpoint(tmp_path / "gpu", device="cuda")
    assert all(t.is_cuda for t in loaded.values())
    assert_same(loaded, tensors)


# --------------------------------------------------------------------------------------------------
# Progress and stopping


@pytest.mark.parametrize(("count", "steps"), [(0, 10), (1, 10), (5, 10), (10, 10), (23, 10), (23, 1), (7, 3)])
def test_progress_reports(tmp_path, count, steps):
    tensors = {f"t{i:02d}": torch.full((2,), float(i)) for i in range(count)}
    calls: list[tuple[int, int]] = []
    write_checkpoint(tmp_path / "p", tensors, {}, progress=lambda d, t: calls.append((d, t)), progress_steps=steps)
    assert 1 <= len(calls) <= steps
    assert calls[-1] == (count, count)
    assert all(t == count for _, t in calls)
    assert [d for d, _ in calls] == sorted({d for d, _ in calls})
    assert len(calls) == min(steps, max(count, 1))

    calls.clear()
    read_checkpoint(tmp_path / "p", progress=lambda d, t: calls.append((d, t)) or True, progress_steps=steps)
    assert 1 <= len(calls) <= steps and calls[-1] == (count, count)
    assert [d for d, _ in calls] == sorted({d for d, _ in calls})


def test_progress_steps_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="progress_steps"):
        write_checkpoint(tmp_path / "x", {}, {}, progress_steps=0)
    assert os.listdir(tmp_path) == []


def stop_at(which: str):
    def progress(done: int, total: int) -> bool | None:
        if which == "first" or done == total:
            return False
        return None

    return progress


@pytest.mark.parametrize("which", ["first", "last"])
def test_stopped_write_leaves_earlier_file_untouched(saved, which):
    before = saved.read_bytes()
    tensors = {f"t{i}": torch.randn(4) for i in range(5)}
    with pytest.raises(Stopped):
        write_checkpoint(saved, tensors, {"new": "yes"}, progress=stop_at(which))
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name]


@pytest.mark.parametrize("which", ["first", "last"])
def test_stopped_write_leaves_no_file(tmp_path, which):
    with pytest.raises(Stopped):
        write_checkpoint(tmp_path / "new", small_tensors(), {}, progress=stop_at(which))
    assert os.listdir(tmp_path) == []


def test_write_unsupported_dtype_after_good_ones(saved):
    before = saved.read_bytes()
    tensors = {**small_tensors(), "z_complex": torch.zeros(2, dtype=torch.complex64)}
    with pytest.raises(TypeError, match="z_complex"):
        write_checkpoint(saved, tensors, {})
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name]


def test_write_failing_midway_leaves_nothing(saved, monkeypatch):
    before = saved.read_bytes()
    real = checkpoint._raw_bytes
    seen = []

    def flaky(t):
        seen.append(t)
        if len(seen) == 3:
            raise RuntimeError("device lost")
        return real(t)

    monkeypatch.setattr(checkpoint, "_raw_bytes", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        write_checkpoint(saved, {f"t{i}": torch.randn(3) for i in range(5)}, {})
    assert len(seen) == 3
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name]


def test_callback_raising_leaves_nothing(saved):
    before = saved.read_bytes()

    def boom(done, total):
        if done >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(saved, {f"t{i}": torch.randn(3) for i in range(5)}, {}, progress=boom)
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name]


def test_bad_inputs_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match="metadata"):
        write_checkpoint(tmp_path / "x", small_tensors(), {"k": 1})
    with pytest.raises(TypeError, match="'n'"):
        write_checkpoint(tmp_path / "x", {"n": [1, 2]}, {})
    with pytest.raises(ValueError, match="__metadata__"):
        write_checkpoint(tmp_path / "x", {"__metadata__": torch.zeros(1)}, {})
    assert os.listdir(tmp_path) == []


def test_missing_parent_folder(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError) as info:
        write_checkpoint(missing / "c.safetensors", small_tensors(), {})
    assert str(missing) in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("which", ["first", "last"])
def test_stopped_read(saved, which):
    with pytest.raises(Stopped):
        read_checkpoint(saved, progress=stop_at(which))


# --------------------------------------------------------------------------------------------------
# Refusing files that are not whole, intact uform checkpoints


def refused(path: pathlib.Path, match: str | None = None) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path)
    message = str(info.value)
    assert str(path) in message
    if match is not None:
        assert match in message, message
    return info.value


def test_truncated_file_refused_everywhere(saved, tmp_path):
    raw = saved.read_bytes()
    _, end = header_span(saved)
    cuts = [0, 1, 7, 8, 9, end // 2, end - 1, end, end + 1, len(raw) - 5, len(raw) - 1]
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(raw[:cut])
        refused(bad)
        with pytest.raises(CheckpointError):
            read_metadata(bad)
    padded = tmp_path / "padded.safetensors"
    padded.write_bytes(raw + b"\0")
    refused(padded, "trailing")


def test_every_data_bit_flip_is_a_digest_mismatch(saved, tmp_path):
    raw = saved.read_bytes()
    _, start = header_span(saved)
    bad = tmp_path / "flip.safetensors"
    for at in range(start, len(raw)):
        for bit in (0, 3, 7):
            flipped = bytearray(raw)
            flipped[at] ^= 1 << bit
            bad.write_bytes(flipped)
            refused(bad, "corrupted: digest mismatch")


def test_every_header_bit_flip_is_refused(saved, tmp_path):
    raw = saved.read_bytes()
    _, end = header_span(saved)
    bad = tmp_path / "flip.safetensors"
    for at in range(end):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[at] ^= 1 << bit
            bad.write_bytes(flipped)
            refused(bad)


def test_consistent_header_edits_are_digest_mismatches(saved, tmp_path):
    raw = saved.read_bytes()
    start, end = header_span(saved)
    header = raw[start:end]
    for old, new in [(b'"I8"', b'"U8"'), (b'"k":"v"', b'"k":"w"'), (b'"a":', b'"c":')]:
        assert old in header
        bad = tmp_path / "edited.safetensors"
        bad.write_bytes(raw[:start] + header.replace(old, new) + raw[end:])
        refused(bad, "digest mismatch")


def test_torch_save_files_refused_without_unpickling(tmp_path):
    sentinel = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(sentinel),))

    for name, save in [
        ("zip.pt", lambda p: torch.save({"w": torch.ones(3), "x": Evil()}, p)),
        ("legacy.pt", lambda p: torch.save({"w": Evil()}, p, _use_new_zipfile_serialization=False)),
        ("raw.pkl", lambda p: p.write_bytes(pickle.dumps(Evil()))),
    ]:
        path = tmp_path / name
        save(path)
        refused(path)
        with pytest.raises(CheckpointError):
            read_metadata(path)
    assert not sentinel.exists()


def test_other_files_refused(tmp_path):
    cases = {
        "text.txt": b"hello, this is just a text file with a few lines\nand some more\n" * 4,
        "empty.bin": b"",
        "json_only": (2).to_bytes(8, "little") + b"[]",
        "not_json": (4).to_bytes(8, "little") + b"{abc",
        "huge_header": (2**40).to_bytes(8, "little") + b"{}",
        "random.bin": bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1)).tolist()),
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        refused(path)


def test_plain_safetensors_file_is_not_a_uform_checkpoint(tmp_path):
    for name, metadata in [("bare.safetensors", None), ("meta.safetensors", {"format": "pt"})]:
        path = tmp_path / name
        safetensors.torch.save_file(small_tensors(), path, metadata=metadata)
        refused(path, "not a uform checkpoint")
        with pytest.raises(CheckpointError, match="not a uform checkpoint"):
            read_metadata(path)


def test_overlapping_and_gapped_offsets_refused(saved, tmp_path):
    raw = saved.read_bytes()
    start, end = header_span(saved)
    header = json.loads(raw[start:end])
    data = raw[end:]

    def write(name: str, h: dict, payload: bytes) -> pathlib.Path:
        text = json.dumps(h).encode()
        text += b" " * (-len(text) % 8)
        path = tmp_path / name
        path.write_bytes(len(text).to_bytes(8, "little") + text + payload)
        return path

    overlap = json.loads(json.dumps(header))
    overlap["b"]["data_offsets"] = [20, 23]  # a spans [0, 24)
    refused(write("overlap", overlap, data[:24]), "overlaps")
    gap = json.loads(json.dumps(header))
    gap["b"]["data_offsets"] = [25, 28]
    refused(write("gap", gap, data + b"\0"), "gap")
    wrong = json.loads(json.dumps(header))
    wrong["b"]["shape"] = [4]
    refused(write("wrong", wrong, data), "needs")


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_checkpoint(tmp_path / "absent.safetensors")
    with pytest.raises(FileNotFoundError):
        read_metadata(tmp_path / "absent.safetensors")


# --------------------------------------------------------------------------------------------------
# Hostile files: forged with a digest recomputed (anyone can), named pipes, absurd sizes


def forge(path: pathlib.Path, entries: dict[str, tuple[str, list[int], bytes]], metadata: dict[str, str]) -> None:
    """A file laid out as our writer lays one out, with any dtype, shape and bytes, and a correct digest."""
    header: dict = {}
    records, offset, payload = {}, 0, b""
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        records[name] = checkpoint._tensor_record(name, dtype, shape, memoryview(raw))
        offset += len(raw)
        payload += raw
    header["__metadata__"] = {**metadata, checkpoint.DIGEST_KEY: checkpoint._combine(records, metadata)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + payload)


def test_forge_helper_makes_files_the_reader_accepts(tmp_path):
    path = tmp_path / "forged.safetensors"
    forge(path, {"a": ("I8", [2, 2], bytes([1, 2, 3, 4])), "e": ("F32", [0, 3], b"")}, {"k": "v"})
    tensors, metadata = read_checkpoint(path)
    assert tensors["a"].tolist() == [[1, 2], [3, 4]] and tensors["e"].shape == (0, 3)
    assert metadata["k"] == "v"


@pytest.mark.parametrize(
    "shape",
    [[0, 2**62, 4], [2**40, 0, 2**40], [0, 2**63], [0] + [2] * 70],
    ids=["stride_overflow", "empty_of_2^80", "dim_past_int64", "rank_71"],
)
def test_absurd_shapes_with_a_recomputed_digest_are_refused(tmp_path, shape):
    path = tmp_path / "absurd.safetensors"
    forge(path, {"ok": ("F32", [2], bytes(8)), "absurd": ("F32", shape, b"")}, {})
    refused(path, "'absurd'")
    with pytest.raises(CheckpointError, match="'absurd'"):
        read_metadata(path)


def test_boolean_bytes_other_than_zero_and_one_are_refused(tmp_path):
    path = tmp_path / "bool.safetensors"
    forge(path, {"flags": ("BOOL", [3], bytes([0, 1, 2]))}, {})
    refused(path, "'flags'")
    forge(path, {"flags": ("BOOL", [3], bytes([0, 1, 1]))}, {})
    assert read_checkpoint(path)[0]["flags"].tolist() == [False, True, True]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_is_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    try:
        for name in ("read_checkpoint", "read_metadata", "read_layout"):
            error = within(30, lambda name=name: getattr(checkpoint, name)(fifo))
            assert isinstance(error, CheckpointError), error
            assert str(fifo) in str(error) and "named pipe" in str(error)
    finally:
        # A reader still blocked in open() (the unfixed code) is released: a writer appears, then goes.
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_folder_is_refused_naming_it(tmp_path):
    with pytest.raises(CheckpointError, match="folder") as info:
        read_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value)


# --------------------------------------------------------------------------------------------------
# Saves that fail or were killed


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_out_of_space_names_the_path_and_leaves_nothing(saved, monkeypatch, where):
    before = saved.read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as the kernel reports it: no file named

    if where == "fsync":
        monkeypatch.setattr(checkpoint.os, "fsync", full)
    else:
        real_fdopen = os.fdopen

        class Full(io.RawIOBase):
            """The temp file, answering ENOSPC once its first bytes are in (a disk that filled mid-save)."""

            def __init__(self, fd):
                self.inner = real_fdopen(fd, "wb")
                self.written = 0

            def write(self, data):
                if self.written:
                    full()
                self.written += len(data)
                return self.inner.write(data)

            def fileno(self):
                return self.inner.fileno()

            def close(self):
                self.inner.close()
                super().close()

        monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, mode: Full(fd))
    with pytest.raises(OSError) as info:
        write_checkpoint(saved, {f"t{i}": torch.randn(4) for i in range(3)}, {})
    assert info.value.errno == errno.ENOSPC
    assert str(saved) in str(info.value), str(info.value)
    assert saved.read_bytes() == before
    assert os.listdir(saved.parent) == [saved.name]


SAVER = """
import sys, time, torch
from uform.replica.checkpoint import write_checkpoint

def wait(done, total):
    print("writing", flush=True)
    time.sleep(600)

write_checkpoint(sys.argv[1], {f"t{i}": torch.zeros(1000) for i in range(4)}, {}, progress=wait)
"""


def start_saver(path: pathlib.Path) -> subprocess.Popen:
    """A process saving to `path`, stopped inside the save with its temporary file written in part."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None and child.stdout.readline().strip() == "writing"
    return child


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def backdate(path: pathlib.Path, seconds: float = 3600) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def temps_of(folder: pathlib.Path, pid: int) -> list[str]:
    return sorted(n for n in os.listdir(folder) if f".tmp-{pid}-" in n)


@pytest.mark.skipif(os.name != "posix", reason="process ids are checked on POSIX only")
def test_the_next_save_removes_temporary_files_of_killed_saves_only(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    killed, live = start_saver(folder / "a.safetensors"), start_saver(folder / "b.safetensors")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        stale, writing = temps_of(folder, killed.pid), temps_of(folder, live.pid)
        assert len(stale) == 1 and len(writing) == 1
        for name in stale + writing:
            backdate(folder / name)  # both idle past the grace: only the dead writer's may go

        gone = dead_pid()
        fresh = f".c.safetensors.tmp-{gone}-{'0' * 12}"  # a dead writer's, but touched just now: kept
        (folder / fresh).write_bytes(b"x")
        similar = [
            f".a.safetensors.tmp-{gone}-{'ab' * 6}.bak",
            f"a.safetensors.tmp-{gone}-{'ab' * 6}",
            f".a.safetensors.tmp-{gone}-{'AB' * 6}",
            f".a.safetensors.tmp-{gone}-{'ab' * 5}a",
            f".a.safetensors.tmp-x{gone}-{'ab' * 6}",
            f".a.safetensors.tmp--{gone}-{'ab' * 6}",
            f".tmp-{gone}-{'ab' * 6}",
        ]
        for name in similar:
            (folder / name).write_bytes(b"user data")
            backdate(folder / name)
        mine = folder / "mine.txt"
        mine.write_bytes(b"keep me")
        link = folder / f".d.safetensors.tmp-{gone}-{'cd' * 6}"
        link.symlink_to(mine)
        hidden_dir = folder / f".e.safetensors.tmp-{gone}-{'ef' * 6}"
        hidden_dir.mkdir()
        for path in (link, hidden_dir):
            then = time.time() - 3600
            os.utime(path, (then, then), follow_symlinks=False)

        write_checkpoint(folder / "a.safetensors", small_tensors(), {})

        names = set(os.listdir(folder))
        assert not set(stale) & names  # the killed save's temporary file is gone
        assert set(writing) <= names  # the live save's is left to it
        assert {fresh, *similar, link.name, hidden_dir.name, "mine.txt", "a.safetensors"} <= names
        assert mine.read_bytes() == b"keep me"
        assert_same(read_checkpoint(folder / "a.safetensors")[0], small_tensors())
    finally:
        for child in (killed, live):
            if child.poll() is None:
                child.kill()
            child.wait()


TRUNCATING_READER = """
import os, sys
from uform.replica.checkpoint import CheckpointError, read_checkpoint

path = sys.argv[1]

def truncate(done, total):
    if done == 1:  # another process cuts the file while this one reads it
        os.truncate(path, os.path.getsize(path) // 2)

try:
    read_checkpoint(path, progress=truncate, progress_steps=1000)
    print("read a file cut in half")
except CheckpointError as error:
    print("refused:", error)
"""


def test_a_file_cut_while_being_read_is_refused_not_a_crash(tmp_path):
    # A reader that maps the file (safe_open) dies of SIGBUS on the first page past the new end; ours reads.
    path = tmp_path / "cut.safetensors"
    write_checkpoint(path, {f"t{i}": torch.randn(4096) for i in range(4)}, {})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run(
        [sys.executable, "-c", TRUNCATING_READER, str(path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.startswith("refused:") and "shrank" in child.stdout, child.stdout
