"""`uform.encode_file` / `uform encode` (issue 15, item 2): a JSONL of text and image records, a broken image and a
missing one among them, embedded into Parquet and `.npy` at a Matryoshka width and each scalar type; a broken
record is a null row reported by its id, never a zero vector; the reading streams a batch at a time."""

from __future__ import annotations

import json
import math
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from export_cases import manifest, trained_run

import uform
from uform import MediaWarning, Scalar, encoding
from uform.cli import main
from uform.embedding_writer import sidecars
from uform.encoding import DEFAULT_FIELDS, encode_records
from uform.media.decode import MediaPolicy
from uform.sources.fields import Fields

torch.set_num_threads(2)
ONE = MediaPolicy(workers=1)  # one decoder process: the tests' images are few and small


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("encode")
    folder = base / "model"
    uform.export(trained_run(base / "run"), folder)
    path, records = manifest(base / "data")
    model = uform.load(folder, media=ONE)
    yield {"base": base, "folder": folder, "manifest": path, "records": records, "model": model}
    model.close()


def expected(setup: dict[str, Any], width: int | None, scalar: Scalar) -> tuple[list[str], torch.Tensor]:
    """The ids and vectors `Model.encode` answers for the good records, one call."""
    folder = setup["manifest"].parent
    ids, mods, contents = [], [], []
    for r in setup["records"]:
        if r["id"] in ("broken", "missing"):
            continue
        ids.append(r["id"])
        mods.append("text" if "text" in r else "image")
        contents.append(r["text"].encode() if "text" in r else (folder / r["image"]).read_bytes())
    return ids, setup["model"].encode(mods, contents, width, outputs_scalar=scalar)


def test_parquet_holds_every_record_in_order_and_null_rows_for_the_broken(
    setup: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "vectors.parquet"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = uform.encode_file(setup["model"], setup["manifest"], out, width=64, dtype="f32", batch=3)
    assert summary.records == len(setup["records"]) and summary.failed == 2 and summary.width == 64
    assert [i for i, _ in summary.failures] == ["broken", "missing"]
    assert "missing file" in summary.failures[1][1] and "nowhere.png" in summary.failures[1][1]
    assert summary.failures[0][1]  # the decoder's reason, in words
    ours = [w for w in caught if issubclass(w.category, MediaWarning) and "encode: record" in str(w.message)]
    assert len(ours) == 1 and "record broken" in str(ours[0].message)  # shown once, every one counted
    assert setup["model"].notices.count("encode.failed") >= 2

    table = pq.read_table(out)
    assert table.schema.metadata[b"uform.dtype"] == b"f32" and table.schema.metadata[b"uform.width"] == b"64"
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [r["id"] for r in setup["records"]]
    by_id = {r["id"]: r["embedding"] for r in rows}
    assert by_id["broken"] is None and by_id["missing"] is None  # null, never a zero vector
    ids, vectors = expected(setup, 64, Scalar.F32)
    got = torch.tensor([by_id[i] for i in ids])
    assert torch.allclose(got, vectors, atol=1e-6, rtol=0)
    assert torch.allclose(got.norm(dim=1), torch.ones(len(ids)), atol=1e-5)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "i8"])
def test_npy_holds_the_rows_ids_and_valid_mask_in_each_scalar(
    setup: dict[str, Any], tmp_path: Path, dtype: str
) -> None:
    out = tmp_path / "vectors.npy"
    summary = uform.encode_file(setup["model"], setup["manifest"], out, dtype=dtype, batch=4)
    ids_path, valid_path = sidecars(str(out))
    array, valid = np.load(out), np.load(valid_path)
    ids = [json.loads(line) for line in Path(ids_path).read_text().splitlines()]
    assert ids == [r["id"] for r in setup["records"]] and array.shape == (summary.records, 128)
    assert valid.tolist() == [i not in ("broken", "missing") for i in ids]
    scalar = {"f16": Scalar.F16, "bf16": Scalar.BF16, "i8": Scalar.I8}[dtype]
    rows = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16) if dtype == "bf16" else torch.from_numpy(array)
    good, vectors = expected(setup, None, scalar)
    index = [ids.index(i) for i in good]
    assert torch.allclose(rows[index].float(), vectors.float(), atol=1.5 if dtype == "i8" else 2e-3, rtol=0)
    bad = rows[~torch.from_numpy(valid)]
    if dtype == "i8":
        assert (bad == -128).all()
    else:
        assert bad.float().isnan().all()
    assert not (rows[torch.from_numpy(valid)].float() == 0).all(dim=1).any()


def test_reading_streams_a_batch_at_a_time(setup: dict[str, Any]) -> None:
    pulled = 0

    def records() -> Iterator[dict[str, Any]]:
        nonlocal pulled
        for k in range(11):
            if k == 9:
                raise RuntimeError("the source broke at record 9")
            pulled += 1
            yield {"id": f"r{k}", "text": f"record number {k}"}

    class Writer:
        def __init__(self) -> None:
            self.rows = 0
            self.seen: list[tuple[int, int]] = []  # (records pulled when a batch was written, rows before it)

        def write(self, ids: list[str], embeddings: torch.Tensor, valid: torch.Tensor) -> None:
            self.seen.append((pulled, self.rows))
            self.rows += len(ids)

    writer = Writer()
    with pytest.raises(RuntimeError, match="record 9"):
        encode_records(setup["model"], records(), writer, Fields.parse(DEFAULT_FIELDS), 128, Scalar.F32, 4)
    # Two batches were written before the source broke (its error comes after them, as without the reading
    # thread), each when its own records and at most the next two batches' had been pulled (one in the model's
    # pipeline, one being read): three batches held at most.
    assert [rows for _, rows in writer.seen] == [0, 4]
    assert all(rows + 4 <= at <= rows + 12 for at, rows in writer.seen), writer.seen
    assert not [t for t in threading.enumerate() if t.name == "uform-encode-reader"]


def test_records_are_read_on_a_thread_of_their_own(setup: dict[str, Any]) -> None:
    pulled_on: list[str] = []

    def records() -> Iterator[dict[str, Any]]:
        for k in range(8):
            pulled_on.append(threading.current_thread().name)
            yield {"id": f"r{k}", "text": f"record number {k}"}

    class Writer:
        rows = 0

        def write(self, ids: list[str], embeddings: torch.Tensor, valid: torch.Tensor) -> None:
            self.rows += len(ids)

    writer = Writer()
    total, failed, _ = encode_records(
        setup["model"], records(), writer, Fields.parse(DEFAULT_FIELDS), 128, Scalar.F32, 3
    )
    assert (total, failed, writer.rows) == (8, 0, 8)
    # Neither the caller's thread nor the model's preparing thread reads files: each keeps to its own work.
    assert set(pulled_on) == {"uform-encode-reader"}


def test_a_batch_closes_early_at_its_byte_budget_and_a_failed_write_stops_the_reader(
    setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(encoding, "BATCH_BYTES", 40)  # two of these 20-byte texts reach it
    closed = []

    def records() -> Iterator[dict[str, Any]]:
        try:
            for k in range(100):
                yield {"id": f"r{k}", "text": f"record number {k:06d}"}
        finally:
            closed.append(threading.current_thread().name)

    class Writer:
        def __init__(self) -> None:
            self.sizes: list[int] = []

        def write(self, ids: list[str], embeddings: torch.Tensor, valid: torch.Tensor) -> None:
            self.sizes.append(len(ids))
            if len(self.sizes) == 3:
                raise OSError("the disk is full")

    writer = Writer()
    with pytest.raises(OSError, match="disk is full"):
        encode_records(setup["model"], records(), writer, Fields.parse(DEFAULT_FIELDS), 128, Scalar.F32, 8)
    assert writer.sizes == [2, 2, 2]
    # The reading thread stopped (its source closed on it, not left mid-file) and was joined.
    assert closed == ["uform-encode-reader"]
    assert not [t for t in threading.enumerate() if t.name == "uform-encode-reader"]


def test_a_record_of_two_items_or_an_unmapped_field_is_refused(setup: dict[str, Any], tmp_path: Path) -> None:
    two = tmp_path / "two.jsonl"
    two.write_text(json.dumps({"id": "both", "text": "a caption", "image": "x.png"}) + "\n")
    with pytest.raises(ValueError, match="record both: 2 items"):
        uform.encode_file(setup["model"], two, tmp_path / "out.parquet")
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"id": "odd", "text": "a caption", "colour": "red"}) + "\n")
    with pytest.raises(ValueError, match="field 'colour' is not in the field mapping"):
        uform.encode_file(setup["model"], odd, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
    with pytest.raises(ValueError, match=r"output: .* must end in \.parquet or \.npy"):
        uform.encode_file(setup["model"], odd, tmp_path / "out.csv")
    with pytest.raises(ValueError, match="dtype: expected one of"):
        uform.encode_file(setup["model"], odd, tmp_path / "out.npy", dtype="f64")
    with pytest.raises(ValueError, match=r"^width: must lie in \[1, hidden = 128\], got 129$"):
        uform.encode_file(setup["model"], odd, tmp_path / "out.npy", width=129)
    with pytest.raises(TypeError, match=r"^width: expected an int or None, got float$"):  # as Model.encode says it
        uform.encode_file(setup["model"], odd, tmp_path / "out.npy", width=32.0)
    with pytest.raises(ValueError, match=r"fields\.colour: 'group' plays no part"):
        uform.encode_file(setup["model"], odd, tmp_path / "out.npy", fields={"text": "text", "colour": "group"})


def test_the_cli_encodes_a_manifest_by_its_fields(setup: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    data = tmp_path / "captions.csv"
    data.write_text('key,caption,note\nk1,"a red circle, small",x\nk2,a blue square,y\n')
    out = tmp_path / "captions.parquet"
    argv = ["encode", str(setup["folder"]), "--input", str(data), "--output", str(out), "--cpu", "--quiet"]
    argv += ["--field", "key=id", "--field", "caption=text", "--field", "note=ignore", "--width", "32"]
    assert main([*argv, "--dtype", "f16"]) == 0, capsys.readouterr().err
    assert "2 records, 0 not embedded" in capsys.readouterr().out
    table = pq.read_table(out).to_pylist()
    assert [r["id"] for r in table] == ["k1", "k2"] and len(table[0]["embedding"]) == 32
    direct = setup["model"].encode(["text", "text"], ["a red circle, small", "a blue square"], 32, outputs_scalar="f16")
    assert torch.allclose(torch.tensor([r["embedding"] for r in table]), direct.float(), atol=2e-3)
    assert main(["encode", str(setup["folder"]), "--input", str(data), "--output", str(out), "--field", "bad"]) == 2
    assert "--field: expected NAME=ROLE" in capsys.readouterr().err
    assert main(["encode", str(setup["folder"]), "--input", str(data), "--output", str(out), "--cpu"]) == 2
    assert "field 'key' is not in the field mapping" in capsys.readouterr().err
    assert not math.isnan(table[1]["embedding"][0])


def test_the_cli_names_each_broken_record(setup: dict[str, Any], tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "vectors.npy"
    argv = ["encode", str(setup["folder"]), "--input", str(setup["manifest"]), "--output", str(out), "--cpu"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MediaWarning)
        assert main([*argv, "--quiet", "--dtype", "i8"]) == 0
    captured = capsys.readouterr()
    assert f"{len(setup['records'])} records, 2 not embedded" in captured.out
    assert "record broken not embedded" in captured.err and "record missing not embedded (missing file" in captured.err
    assert np.load(out).dtype == np.int8
