"""uform.sources (issue 13, items 2-5): each reader on real files, the record convention's CSR relations, steps
filled to capacity with nothing for the packer to drop, an exactly resumable order, and the same global records
per step for any number of ranks."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from uform.config import (
    BatchShape,
    ImageShape,
    Schedule,
    TrainerInitVramConfig,
    TrainerStepStats,
    resolve,
)
from uform.data.batch import prepare
from uform.enums import LateInteractionSide, Modality, Objective
from uform.media.image import image_units
from uform.notices import CapacityWarning, MediaWarning
from uform.relations import Edges
from uform.sources import Loader, merge_states, open_source
from uform.sources.fields import Fields, read_record
from uform.sources.manifest import read_csv
from uform.sources.shards import braces, expand
from uform.sources.sizes import item_length
from uform.sources.step_input import relations_of
from uform.sources.tar import read_tar, split_key


def jpeg(width: int, height: int, colour: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, "JPEG")
    return out.getvalue()


def run_config(**overrides: Any) -> TrainerInitVramConfig:
    fields: dict[str, Any] = dict(
        depth=1,
        hidden=128,
        objective=Objective.Contrastive,
        batch=BatchShape(
            max_rows_per_device=4, max_segments_per_device=8, max_columns_per_row=64, image=ImageShape(patch_side=8)
        ),
        schedule=Schedule(steps=10),
        seed=3,
    )
    fields.update(overrides)
    return resolve(TrainerInitVramConfig(**fields))


def texts(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Caption pairs of varied lengths, ids r0, r1, ..."""
    rng = np.random.default_rng(seed)
    return [
        {"id": f"r{i}", "q": "q" * int(rng.integers(1, 40)), "d": f"doc {i} " + "d" * int(rng.integers(1, 50))}
        for i in range(count)
    ]


PAIR = {"id": "id", "q": "text", "d": "text"}


# --------------------------------------------------------------------------------------------------
# Specs and readers


def test_brace_ranges_and_alternatives_expand_in_order(tmp_path: Path) -> None:
    assert braces("s/{000..002}.tar") == ["s/000.tar", "s/001.tar", "s/002.tar"]
    assert braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    for name in ("x.jsonl", "y.jsonl"):
        (tmp_path / name).write_text("")
    assert expand([str(tmp_path / "*.jsonl"), "z.tar"]) == [
        str(tmp_path / "x.jsonl"),
        str(tmp_path / "y.jsonl"),
        "z.tar",
    ]
    with pytest.raises(ValueError, match="matches no file"):
        expand(str(tmp_path / "*.parquet"))
    with pytest.raises(ValueError, match="runs backwards"):
        braces("{5..1}")


def test_a_jsonl_manifest_reads_media_relative_to_it_and_skips_a_missing_file_once(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    cat = jpeg(16, 16)
    (tmp_path / "img" / "cat.jpg").write_bytes(cat)
    rows = [
        {"image": "img/cat.jpg", "caption": "a cat"},
        {"image": "img/gone.jpg", "caption": "a missing dog"},
        {"image": "img/cat.jpg", "caption": "the cat again"},
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = open_source(str(tmp_path / "data.jsonl"), fields={"image": "image", "caption": "text"})
    loader = Loader(source, run_config(), shuffle_buffer=1)
    with pytest.warns(MediaWarning, match=r"data.jsonl:2 names a missing file .*gone.jpg") as shown:
        step = loader.next_step()
        loader.next_step()  # the second epoch meets the missing file again: counted, not shown again
    assert len([w for w in shown if issubclass(w.category, MediaWarning)]) == 1
    assert loader.counts["missing"] >= 2
    assert "img/gone.jpg" not in str(step.records)
    assert all(r.endswith((":1", ":3")) for r in step.records)
    assert step.modalities.count(Modality.Image) == step.modalities.count(Modality.Text)
    assert all(c == cat for c, m in zip(step.contents, step.modalities, strict=True) if m == Modality.Image)


def test_a_csv_manifest_keeps_quoted_commas_quotes_and_newlines(tmp_path: Path) -> None:
    captions = ["a cat, asleep", 'she said "hi"', "two\nlines"]
    with open(tmp_path / "m.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["query", "answer"])
        for c in captions:
            writer.writerow([c, c.upper()])
    records = list(read_csv(str(tmp_path / "m.csv"), frozenset()))
    assert [r["query"] for r in records] == captions
    assert [r["answer"] for r in records] == [c.upper() for c in captions]
    items = read_record(records[2], Fields.parse({"query": "text", "answer": "text"}))
    assert items.contents == [b"two\nlines", b"TWO\nLINES"]


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_a_webdataset_tar_groups_members_by_key_and_passes_a_corrupt_jpeg_undecoded(tmp_path: Path) -> None:
    good, corrupt = jpeg(24, 8), b"\xff\xd8\xff" + b"\x00" * 50  # a JPEG's magic, then garbage
    _tar(
        tmp_path / "000.tar",
        [
            ("a/x.jpg", good),
            ("a/x.txt", b"a wide red picture"),
            ("b.0.jpg", corrupt),
            ("b.0.txt", b"broken"),
            ("._junk", b"metadata"),
        ],
    )
    assert split_key("a/x.tar.gz") == ("a/x", "tar.gz") and split_key("cat.001.jpg") == ("cat", "001.jpg")
    records = list(read_tar(str(tmp_path / "000.tar")))
    assert records == [
        {"__key__": "a/x", "jpg": good, "txt": b"a wide red picture"},
        {"__key__": "b", "0.jpg": corrupt, "0.txt": b"broken"},
    ]
    source = open_source(
        str(tmp_path / "{000..000}.tar"), fields={"jpg": "image", "txt": "text", "0.jpg": "image", "0.txt": "text"}
    )
    step = Loader(source, run_config()).next_step()
    assert corrupt in step.contents and good in step.contents  # bytes as they are: the trainer's decoders judge
    config = run_config()
    # The corrupt one counts a whole row; the good one its 3 x 1 patch grid and the marker.
    assert item_length(config, Modality.Image, corrupt, LateInteractionSide.None_, False) == 64
    assert item_length(config, Modality.Image, good, LateInteractionSide.None_, False) == 1 + 3


def test_a_folder_groups_files_by_stem(tmp_path: Path) -> None:
    (tmp_path / "cat.jpg").write_bytes(jpeg(8, 8))
    (tmp_path / "cat.txt").write_bytes(b"a cat")
    (tmp_path / "dog.txt").write_bytes(b"a dog alone")
    source = open_source(str(tmp_path), fields={"jpg": "image", "txt": "text"})
    assert source.shards[0].reader == "folder"
    records = list(source.records(0))
    assert [r["__key__"] for r in records] == ["cat", "dog"]
    assert records[0]["txt"] == b"a cat" and records[0]["jpg"] == (tmp_path / "cat.jpg").read_bytes()
    assert set(records[1]) == {"__key__", "txt"}


def test_a_parquet_file_streams_bytes_and_path_columns(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="pyarrow (the Parquet extra) is not installed on this machine")
    import pyarrow.parquet as pq

    (tmp_path / "p.jpg").write_bytes(jpeg(8, 8))
    table = pa.table({"image": [jpeg(16, 8), None], "path": [None, "p.jpg"], "text": ["inline", "second"]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=1)
    source = open_source(str(tmp_path / "t.parquet"), fields={"image": "image", "path": "image", "text": "text"})
    records = list(source.records(0))
    assert records[0]["image"] == jpeg(16, 8) and records[0]["text"] == "inline" and "path" not in records[0]
    assert records[1]["path"] == (tmp_path / "p.jpg").read_bytes()


def test_fsspec_urls_read_through_the_memory_filesystem() -> None:
    fsspec = pytest.importorskip("fsspec", reason="fsspec (the URL extra) is not installed on this machine")
    fs = fsspec.filesystem("memory")
    fs.pipe("/uform-test/img/a.jpg", jpeg(8, 8))
    fs.pipe("/uform-test/one.jsonl", b'{"image": "img/a.jpg", "text": "a"}\n{"image": "img/b.jpg", "text": "b"}\n')
    source = open_source("memory://uform-test/*.jsonl", fields={"image": "image", "text": "text"})
    assert [s.name for s in source.shards] == ["memory://uform-test/one.jsonl"]
    records = list(source.records(0))
    assert records[0]["image"] == jpeg(8, 8)
    assert type(records[1]["image"]).__name__ == "Missing"


def test_an_unknown_field_is_an_error_naming_it_and_the_record_unless_ignored() -> None:
    rows = [{"id": "r0", "q": "a", "d": "b"}, {"id": "r1", "q": "a", "d": "b", "extra": 1}]
    loader = Loader(open_source(rows, fields=PAIR), run_config(), shuffle_buffer=1)
    before = loader.state()
    with pytest.raises(ValueError, match=r"record r1: field 'extra' is not in the field mapping"):
        loader.next_step()
    assert loader.state() == before  # the refused step took nothing: r0 comes first again
    with pytest.raises(ValueError, match=r"record r1: field 'extra'"):
        loader.next_step()
    rows = rows[1:]
    step = Loader(open_source(rows, fields={**PAIR, "extra": "ignore"}), run_config()).next_step()
    assert step.contents == [b"a", b"b"]
    with pytest.raises(ValueError, match=r"fields.q: 'txt' is no role"):
        open_source(rows, fields={"q": "txt"})
    with pytest.raises(TypeError, match="one-shot iterator"):
        open_source(iter(rows), fields=PAIR)


# --------------------------------------------------------------------------------------------------
# The record convention


def test_the_record_convention_gives_the_expected_csr_relations() -> None:
    fields = Fields.parse(
        {"img": "image", "cap": "text", "neg": "negative:text", "g": "group", "c": "choices", "t": "targets"}
    )
    records = [
        read_record(
            {"__key__": "a", "img": b"\xff\xd8\xff", "cap": ["a cat", "kitty"], "neg": "a dog", "g": 1}, fields
        ),
        read_record({"__key__": "b", "cap": "pick one", "c": "xy", "t": "[0.25, 0.75]"}, fields),
        read_record({"__key__": "c", "img": b"\xff\xd8\xff", "cap": "a bus"}, fields),
    ]
    relations = relations_of(records)
    # items: 0 img, 1 "a cat", 2 "kitty", 3 neg | 4 "pick one" | 5 img, 6 "a bus"
    assert relations.attract == Edges(offsets=[0, 2, 4, 6, 6, 6, 7, 8], ids=[1, 2, 0, 2, 0, 1, 6, 5])
    assert relations.repel == Edges(offsets=[0, 1, 2, 3, 6, 6, 6, 6], ids=[3, 3, 3, 0, 1, 2])
    from uform.sources.step_input import assemble

    step = assemble(records, 1, late=False, groups=True)
    assert step.config.bags == [0, 0, 0, 0, 1, 2, 2]
    assert step.config.temperature_groups == [1, 1, 1, 1, 0, 0, 0]
    assert step.config.choices == [b"", b"", b"", b"", b"xy", b"", b""]
    assert step.config.choice_targets[4] == [0.25, 0.75]
    late = Fields.parse({"q": "query:text", "d": "document:text"})
    step = assemble([read_record({"q": "who", "d": "me"}, late)], 1, late=True, groups=False)
    assert step.config.sides == [LateInteractionSide.Query, LateInteractionSide.Document]
    assert step.config.relations.attract == Edges(offsets=[0, 1, 2], ids=[1, 0])


# --------------------------------------------------------------------------------------------------
# Steps filled to capacity


def _units(step: Any, config: TrainerInitVramConfig) -> dict[int, Any]:
    b = config.batch
    return {
        i: image_units(c, patch_side=b.image.patch_side, channels=b.image.channels, max_units=b.max_columns_per_row - 1)
        for i, (m, c) in enumerate(zip(step.modalities, step.contents, strict=True))
        if m == Modality.Image
    }


def test_steps_are_filled_without_a_drop_and_a_record_too_large_is_skipped_once() -> None:
    config = run_config()
    rng = np.random.default_rng(1)
    rows: list[dict[str, Any]] = []
    for i in range(60):
        size = (int(rng.integers(8, 90)), int(rng.integers(8, 90)))
        rows.append({"id": f"r{i}", "img": jpeg(*size), "cap": "c" * int(rng.integers(1, 70))})
    rows.insert(7, {"id": "huge", "img": jpeg(8, 8), "cap": ["x"] * 9})  # 10 items: more than 8 segments
    loader = Loader(open_source(rows, fields={"id": "id", "img": "image", "cap": "text"}), config, shuffle_buffer=4)
    seen: list[str] = []
    with pytest.warns(CapacityWarning, match="record huge is too large"):
        while len(set(seen)) < 60:
            step = loader.next_step()
            bags = np.array(step.config.bags)
            batch = prepare(
                config, step.modalities, step.contents, bags=bags, groups=None, sides=None,
                relations=step.config.relations, step=step.step, units=_units(step, config),
            )  # fmt: skip
            assert batch.dropped == 0, step.records
            assert len(set(step.records)) >= 2  # more than one record: filled, not one at a time
            seen.extend(dict.fromkeys(step.records))
    assert "huge" not in seen and loader.counts["too_large"] == 1
    assert sorted(set(seen), key=lambda r: int(r[1:])) == [f"r{i}" for i in range(60)]  # nothing lost, once each


def test_a_real_trainer_step_on_cpu_drops_nothing(make_trainer) -> None:
    config = run_config(batch=BatchShape(max_rows_per_device=4, max_segments_per_device=8, max_columns_per_row=64))
    trainer = make_trainer(config)
    loader = Loader(open_source(texts(30), fields=PAIR), config, shuffle_buffer=8)
    for _ in range(2):
        step = loader.next_step()
        step.config.stats = TrainerStepStats()
        trainer.on(trainer.executor).step(*step)
        assert step.config.stats.dropped == 0 and step.config.stats.step == step.step
        assert len(set(step.records)) >= 2


# --------------------------------------------------------------------------------------------------
# Exact resume and world-size invariance


def _records(loader: Loader, steps: int) -> Iterator[tuple[list[str], list[bytes], list[int], Any]]:
    for _ in range(steps):
        s = loader.next_step()
        yield s.records, s.contents, list(s.config.bags), s.config.relations


def test_a_loader_resumed_from_its_state_reads_what_the_uninterrupted_one_reads(tmp_path: Path) -> None:
    config = run_config()
    for index in range(3):  # three JSONL shards, shuffled per epoch
        lines = [json.dumps(r) for r in texts(14, seed=index)]
        (tmp_path / f"s{index}.jsonl").write_text("\n".join(lines).replace('"r', f'"s{index}r') + "\n")
    source = open_source(str(tmp_path / "s{0..2}.jsonl"), fields=PAIR)
    straight = list(_records(Loader(source, config, shuffle_buffer=5), 16))  # into a second epoch
    first = Loader(source, config, shuffle_buffer=5)
    head = list(_records(first, 5))
    state = json.loads(json.dumps(first.state()))
    resumed = list(_records(Loader.resume(source, config, state, shuffle_buffer=5), 11))
    assert head + resumed == straight
    epochs = [r for step in straight for r in dict.fromkeys(step[0])]
    assert len(set(epochs[:42])) == 42 and len(epochs) > 42  # every record once an epoch, into the next
    assert epochs[:42] != sorted(epochs[:42])  # shuffled
    with pytest.raises(ValueError, match="seed is 3 in the state, 4 here"):
        Loader.resume(source, config, state, seed=4, shuffle_buffer=5)


@pytest.mark.parametrize("shards", [1, 4])
def test_two_ranks_steps_together_are_one_ranks_steps(tmp_path: Path, shards: int) -> None:
    config = run_config()
    for index in range(shards):
        lines = [json.dumps({**r, "id": f"s{index}{r['id']}"}) for r in texts(20, seed=index)]
        (tmp_path / f"s{index}.jsonl").write_text("\n".join(lines) + "\n")
    source = open_source(sorted(str(p) for p in tmp_path.glob("*.jsonl")), fields=PAIR)
    one = Loader(source, config, devices=2, shuffle_buffer=3)
    ranks = [Loader(source, config, rank=r, world=2, shuffle_buffer=3) for r in range(2)]
    for _ in range(8):
        whole = one.next_step()
        parts = [rank.next_step() for rank in ranks]
        assert whole.records == parts[0].records + parts[1].records
        assert whole.contents == parts[0].contents + parts[1].contents
        assert not set(parts[0].records) & set(parts[1].records)
    # A state merged from both ranks resumes a one-process run over the same two devices exactly.
    merged = merge_states([rank.state() for rank in ranks])
    assert sorted(merged["shares"]) == ["0", "1"]
    again = Loader.resume(source, config, merged, devices=2, shuffle_buffer=3)
    assert again.next_step().records == one.next_step().records


def test_a_step_keeps_each_edge_set_within_the_runs_limit() -> None:
    config = run_config()  # max_edges_per_device derives from the 8 segments
    rows = [{"id": f"r{i}", "a": "x" * (i + 1), "b": "y", "c": "z"} for i in range(6)]  # 6 attract edges each
    loader = Loader(open_source(rows, fields={"id": "id", "a": "text", "b": "text", "c": "text"}), config)
    from uform.relations import check_relations

    for _ in range(3):
        step = loader.next_step()
        assert len(step.config.relations.attract.ids) == 6  # one record: a second would make 12 > 8
        check_relations(step.config.relations, len(step.contents), config.contrastive.max_edges_per_device)


def test_a_wav_recordings_length_comes_from_its_header() -> None:
    import wave

    from uform.config import AudioShape
    from uform.media.audio import audio_units

    config = run_config(
        batch=BatchShape(
            max_rows_per_device=4,
            max_segments_per_device=8,
            max_columns_per_row=64,
            audio=AudioShape(chunk_samples=160, sample_rate=16000),
        )
    )
    for rate, frames in ((16000, 1000), (16000, 40000), (8000, 1234), (22050, 3000)):
        out = io.BytesIO()
        with wave.open(out, "wb") as file:
            file.setnchannels(2)
            file.setsampwidth(2)
            file.setframerate(rate)
            tone = (np.sin(np.arange(frames) / 7.0) * 8000).astype(np.int16)
            file.writeframes(np.repeat(tone, 2).tobytes())
        data = out.getvalue()
        decoded = len(audio_units(data, chunk_samples=160, sample_rate=16000, max_units=63))
        measured = item_length(config, Modality.Audio, data, LateInteractionSide.None_, False) - 1
        assert measured == decoded if rate == 16000 else decoded <= measured <= decoded + 1, (rate, frames)


def test_the_counts_travel_with_the_state_by_share() -> None:
    rows = [{"id": f"r{i}", "q": "a" * (i + 1), "d": "b"} for i in range(5)]
    rows.append({"id": "huge", "q": "x", "d": "y" * 10, "z": ["z"] * 9})
    source = open_source(rows, fields={**PAIR, "z": "text"})
    ranks = [Loader(source, run_config(), rank=r, world=2, shuffle_buffer=2) for r in range(2)]
    with pytest.warns(CapacityWarning):
        for _ in range(6):
            for rank in ranks:
                rank.next_step()
    merged = merge_states([rank.state() for rank in ranks])
    total = {k: ranks[0].counts[k] + ranks[1].counts[k] for k in ranks[0].counts}
    assert total["too_large"] >= 1 and total["records"] >= 10
    assert Loader.resume(source, run_config(), merged, devices=2, shuffle_buffer=2).counts == total


def test_a_run_stopped_and_resumed_with_its_loader_state_equals_the_straight_run(make_trainer, tmp_path: Path) -> None:
    import dataclasses

    import torch

    config = run_config(batch=BatchShape(max_rows_per_device=4, max_segments_per_device=8, max_columns_per_row=64))
    source = open_source(texts(24), fields=PAIR)

    def run(trainer: Any, loader: Loader, steps: int) -> list[list[str]]:
        seen = []
        for _ in range(steps):
            step = loader.next_step()
            trainer.on(trainer.executor).step(*step)
            seen.append(step.records)
        return seen

    straight_trainer = make_trainer(config)
    straight = run(straight_trainer, Loader(source, config, shuffle_buffer=4), 5)
    first = make_trainer(config)
    loader = Loader(source, config, shuffle_buffer=4)
    head = run(first, loader, 2)
    first.save(tmp_path / "run.safetensors")
    state = json.loads(json.dumps(loader.state()))  # what a checkpoint would carry beside the weights
    resumed = make_trainer(dataclasses.replace(config, resume=tmp_path / "run.safetensors"))
    tail = run(resumed, Loader.resume(source, config, state, shuffle_buffer=4), 3)
    assert head + tail == straight
    a, b = straight_trainer.weights().tensors, resumed.weights().tensors
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    before = first.weights().tensors  # after step 2: the three steps since moved the weights
    assert not all(torch.equal(before[k], b[k]) for k in b)


def test_a_step_ends_with_its_epoch_and_the_next_epoch_fills_its_first_step() -> None:
    rows = [{"id": f"r{i}", "q": "q", "d": "d"} for i in range(10)]  # 8 segments: 4 records a step
    loader = Loader(open_source(rows, fields=PAIR), run_config(), shuffle_buffer=3)
    sizes = [len(set(loader.next_step().records)) for _ in range(6)]
    assert sizes == [4, 4, 2, 4, 4, 2]


def test_a_dataset_like_iterable_is_a_source_with_image_cells_as_datasets_writes_them() -> None:
    class Rows:  # what `datasets.Dataset` offers a reader: len and a fresh iterator per pass
        def __init__(self, rows: list[dict[str, Any]]) -> None:
            self.rows = rows

        def __len__(self) -> int:
            return len(self.rows)

        def __iter__(self) -> Iterator[dict[str, Any]]:
            return iter(self.rows)

    picture = jpeg(16, 16)
    rows = Rows([{"image": {"bytes": picture, "path": None}, "text": f"caption {i}"} for i in range(3)])
    step = Loader(open_source(rows, fields={"image": "image", "text": "text"}), run_config()).next_step()
    assert step.contents.count(picture) == 3 and b"caption 2" in step.contents
    assert set(step.records) == {"Rows[0]", "Rows[1]", "Rows[2]"}
