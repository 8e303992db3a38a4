"""Packing invariants (docs/design.md §2) on random item sets: `plan` + `fill_texts`, and `prepare`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from uform import vocab
from uform.config import BatchShape, LateInteraction, Masking, TrainerInitVramConfig, resolve
from uform.config import Schedule as ScheduleConfig
from uform.data.batch import Batch, covered_capacity, prepare
from uform.data.items import tape_items
from uform.data.pack import NO_SEGMENT, Layout, Rows, fill_media, fill_texts, plan
from uform.enums import LateInteractionSide, Modality, Objective
from uform.model.attention import document_mask

TEXT = vocab.MODALITY_MARKER[Modality.Text]


# --------------------------------------------------------------------------------------------------
# Random item sets


def random_case(rng: np.random.Generator) -> dict:
    """A random capacity (tight or loose) and a random item set, lengths from a bare prefix to past a row."""
    rows = int(rng.integers(1, 5))
    columns = int(rng.integers(4, 48))
    segments = int(rng.integers(1, 14))
    max_bags = int(rng.choice([0, 0, 1, 2, 3, 6]))
    count = int(rng.integers(0, 20))
    prefix = int(rng.integers(1, 3))
    content = rng.integers(0, int(1.6 * columns), size=count)
    content[rng.random(count) < 0.15] = 0  # bare prefixes
    content[rng.random(count) < 0.1] = columns - prefix  # exactly a row
    bags = rng.integers(0, max(1, count // 2 + 1), size=count) if rng.random() < 0.6 else np.arange(count)
    return {
        "rows": rows,
        "columns": columns,
        "segments": segments,
        "max_bags": max_bags,
        "prefix": prefix,
        "lengths": (prefix + content).astype(np.int64),
        "bags": bags.astype(np.int64),
    }


def check_layout(
    layout: Layout, lengths: np.ndarray, bags: np.ndarray, rows: int, columns: int, segments: int, max_bags: int
) -> None:
    n = len(lengths)
    placed = layout.placed
    # Placed and dropped are one partition of the items; a dropped item has no place at all.
    assert placed.sum() + layout.dropped == n
    assert np.all((layout.row >= 0) == placed)
    assert np.all((layout.column >= 0) == placed)
    assert np.all(layout.length[~placed] == 0)
    assert not np.any(layout.truncated[~placed])
    # Capacity: rows, segments, bags.
    assert placed.sum() <= segments
    assert np.all(layout.row[placed] < rows)
    if max_bags > 0:
        assert len(np.unique(bags[placed])) <= max_bags
    # Every placed segment lies inside its row; a long one is cut at exactly the row's width.
    assert np.all(layout.column[placed] >= 0)
    assert np.all(layout.column[placed] + layout.length[placed] <= columns)
    assert np.all(layout.length[placed] == np.minimum(lengths[placed], columns))
    assert np.array_equal(layout.truncated, placed & (lengths > columns))
    # No two segments overlap, and every row is filled from column 0 with no gap (padding last).
    occupancy = np.zeros((rows, columns), dtype=np.int64)
    for i in np.flatnonzero(placed):
        occupancy[layout.row[i], layout.column[i] : layout.column[i] + layout.length[i]] += 1
    assert occupancy.max(initial=0) <= 1
    used = occupancy.sum(axis=1)
    for r in range(rows):
        assert np.all(occupancy[r, : used[r]] == 1) and np.all(occupancy[r, used[r] :] == 0)
    # Slots: 0..placed-1, numbered in (row, column) order, the inverse of item_of_slot.
    items = np.flatnonzero(placed)
    by_position = items[np.lexsort((layout.column[items], layout.row[items]))]
    assert np.array_equal(layout.slot[by_position], np.arange(len(items)))
    assert np.all(layout.slot[~placed] == -1)
    assert layout.item_of_slot.shape == (segments,)
    assert np.array_equal(layout.item_of_slot[: len(items)], by_position)
    assert np.all(layout.item_of_slot[len(items) :] == -1)
    # A dropped item had no room: the segments were all used, or its bag was refused at the cap, or no
    # row had (even at the end, and rows only fill up) the positions it needs.
    free = columns - used
    taken = set(bags[placed].tolist())
    for i in np.flatnonzero(~placed):
        need = min(int(lengths[i]), columns)
        no_segments = placed.sum() == segments
        bag_refused = max_bags > 0 and bags[i] not in taken and len(taken) == max_bags
        no_room = bool(np.all(free < need))
        assert no_segments or bag_refused or no_room, f"item {i} (need {need}) dropped with room: free {free}"


def one_text(rows: Rows, layout: Layout, item: int, prefix: list[int], content: bytes | memoryview) -> None:
    """The naive reference of `fill_texts`: one placed text item, slice by slice."""
    r, c0, n = int(layout.row[item]), int(layout.column[item]), int(layout.length[item])
    p = len(prefix)
    body = np.frombuffer(content, dtype=np.uint8, count=max(0, min(len(content), n - p)))
    rows.tokens[r, c0 : c0 + p] = prefix
    rows.tokens[r, c0 + p : c0 + n] = body
    rows.positions[r, c0 : c0 + n, :] = np.arange(n, dtype=np.int64)[:, None]
    rows.segments[r, c0 : c0 + n] = layout.slot[item]
    rows.content[r, c0 + p : c0 + n] = True


def fill(layout: Layout, rows: int, columns: int, prefixes: list[list[int]], contents: list) -> Rows:
    out = Rows.empty(rows, columns)
    placed = np.flatnonzero(layout.placed).tolist()
    fill_texts(out, layout, placed, [prefixes[i] for i in placed], [contents[i] for i in placed])
    return out


def check_rows(out: Rows, layout: Layout, prefixes: list[list[int]], contents: list, padding: int) -> None:
    """Tokens, positions and segment ids of filled rows; `padding` is the segment id of padding."""
    rows, columns = out.tokens.shape
    expected_segment = np.full((rows, columns), padding, dtype=np.int64)
    expected_content = np.zeros((rows, columns), dtype=bool)
    for i in np.flatnonzero(layout.placed):
        r, c0, n = int(layout.row[i]), int(layout.column[i]), int(layout.length[i])
        p = len(prefixes[i])
        body = bytes(contents[i])[: n - p]
        assert len(body) == n - p
        assert out.tokens[r, c0 : c0 + p].tolist() == prefixes[i]
        assert out.tokens[r, c0 + p : c0 + n].tolist() == list(body)
        # Positions restart at 0 in every segment and are the same on the three axes for text.
        assert np.array_equal(out.positions[r, c0 : c0 + n], np.repeat(np.arange(n)[:, None], 3, axis=1))
        expected_segment[r, c0 : c0 + n] = layout.slot[i]
        expected_content[r, c0 + p : c0 + n] = True
    assert np.array_equal(out.segments, expected_segment)
    pad = expected_segment == padding
    assert np.all(out.tokens[pad] == vocab.PAD)
    assert np.all(out.positions[pad] == 0)
    assert np.array_equal(out.content, expected_content)


def check_order(segments: np.ndarray, padding: int) -> None:
    """Slot ids never decrease along a row, padding last; read row after row they count 0, 1, 2, ..."""
    assert np.all(np.diff(segments, axis=1) >= 0)
    real = segments[segments != padding]
    assert np.all(np.diff(real) >= 0)
    assert np.array_equal(np.unique(real), np.arange(len(np.unique(real))))


# --------------------------------------------------------------------------------------------------
# plan + fill_texts


@pytest.mark.parametrize("seed", range(300))
def test_plan_invariants(seed: int) -> None:
    rng = np.random.default_rng(seed)
    case = random_case(rng)
    kwargs = {k: case[k] for k in ("rows", "columns", "segments")}
    layout = plan(
        case["lengths"], case["bags"], max_bags=case["max_bags"], rng=np.random.default_rng(seed + 1), **kwargs
    )
    check_layout(layout, case["lengths"], case["bags"], max_bags=case["max_bags"], **kwargs)
    # Same generator key, same layout.
    again = plan(
        case["lengths"], case["bags"], max_bags=case["max_bags"], rng=np.random.default_rng(seed + 1), **kwargs
    )
    for name in ("row", "column", "length", "slot", "truncated", "item_of_slot"):
        assert np.array_equal(getattr(layout, name), getattr(again, name))

    prefixes = [[TEXT] + [int(rng.integers(258, 266))] * (case["prefix"] - 1) for _ in case["lengths"]]
    contents = [rng.integers(0, 256, size=int(n) - case["prefix"], dtype=np.uint8).tobytes() for n in case["lengths"]]
    out = fill(layout, case["rows"], case["columns"], prefixes, contents)
    check_rows(out, layout, prefixes, contents, padding=NO_SEGMENT)
    check_order(np.where(out.segments == NO_SEGMENT, case["segments"], out.segments), case["segments"])


def test_plan_loose_capacity_places_everything() -> None:
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 10, size=12)
    layout = plan(lengths, np.arange(12), rows=4, columns=128, segments=12, max_bags=0, rng=rng)
    check_layout(layout, lengths, np.arange(12), 4, 128, 12, 0)
    assert layout.dropped == 0 and not layout.truncated.any()
    assert np.array_equal(layout.length, lengths)
    # First fit in the lowest row with room: everything lands in row 0 while it has room.
    assert np.all(layout.row == 0) and layout.item_of_slot[:12].tolist() == np.argsort(layout.column).tolist()


def test_plan_long_segment_cut_and_counted() -> None:
    rng = np.random.default_rng(0)
    layout = plan(np.array([5, 40, 16, 17]), np.arange(4), rows=4, columns=16, segments=8, max_bags=0, rng=rng)
    assert layout.dropped == 0
    assert layout.truncated.tolist() == [False, True, False, True]
    assert layout.length.tolist() == [5, 16, 16, 16]
    check_layout(layout, np.array([5, 40, 16, 17]), np.arange(4), 4, 16, 8, 0)


def test_plan_no_room_drops_whole() -> None:
    # One row of 8: a 6 and a 5 cannot both land; whichever comes second is dropped whole (not cut to 2).
    for seed in range(10):
        layout = plan(
            np.array([6, 5]), np.arange(2), rows=1, columns=8, segments=4, max_bags=0, rng=np.random.default_rng(seed)
        )
        assert layout.dropped == 1
        assert sorted(layout.length.tolist()) == [0, int(layout.length.max())]
        assert not layout.truncated.any()
    # A truncated item that finds no empty row is dropped, and then not counted as truncated.
    layout = plan(
        np.array([3, 30]),
        np.zeros(2, dtype=np.int64),
        rows=1,
        columns=8,
        segments=4,
        max_bags=0,
        rng=np.random.default_rng(0),
    )
    assert layout.placed.tolist() == [True, False] and not layout.truncated.any()


def test_plan_segment_cap() -> None:
    layout = plan(
        np.ones(10, dtype=np.int64),
        np.arange(10),
        rows=2,
        columns=64,
        segments=3,
        max_bags=0,
        rng=np.random.default_rng(0),
    )
    assert layout.placed.sum() == 3 and layout.dropped == 7
    check_layout(layout, np.ones(10, dtype=np.int64), np.arange(10), 2, 64, 3, 0)


def test_plan_bag_cap_drops_whole_bags() -> None:
    bags = np.repeat(np.arange(6), 3)  # six bags of three small items
    for seed in range(20):
        layout = plan(
            np.full(18, 2), bags, rows=4, columns=32, segments=64, max_bags=2, rng=np.random.default_rng(seed)
        )
        taken = np.unique(bags[layout.placed])
        assert len(taken) == 2
        # Taken bags are whole (there is room), the others dropped entirely.
        assert np.array_equal(layout.placed, np.isin(bags, taken))


def test_plan_shuffle_is_keyed() -> None:
    # 20 one-item bags, room for 5: which 5 land depends on the generator's key, and is fair.
    lengths = np.full(20, 4)
    chosen = []
    for seed in range(40):
        layout = plan(
            lengths, np.arange(20), rows=1, columns=64, segments=5, max_bags=0, rng=np.random.default_rng(seed)
        )
        chosen.append(tuple(np.flatnonzero(layout.placed)))
    assert len(set(chosen)) > 30
    hits = np.bincount(np.concatenate(chosen), minlength=20)
    assert hits.min() > 0  # every item lands in some step


def test_fill_text_from_tape_views() -> None:
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=100, dtype=np.uint8)
    offsets = np.array([0, 0, 10, 60, 100])
    contents = tape_items(data, offsets, "contents")
    lengths = np.array([1 + len(c) for c in contents])
    layout = plan(lengths, np.arange(4), rows=3, columns=32, segments=4, max_bags=0, rng=rng)
    prefixes = [[TEXT]] * 4
    out = fill(layout, 3, 32, prefixes, contents)
    check_rows(out, layout, prefixes, contents, padding=NO_SEGMENT)
    assert layout.truncated.sum() == 2  # 50 and 40 bytes do not fit 32


# --------------------------------------------------------------------------------------------------
# prepare, with a resolved config


def make_config(
    rows: int, columns: int, segments: int, bags: int, *, late: bool = False, seed: int = 5
) -> TrainerInitVramConfig:
    return resolve(
        TrainerInitVramConfig(
            depth=1,
            hidden=128,
            batch=BatchShape(
                max_rows_per_device=rows,
                max_segments_per_device=segments,
                max_columns_per_row=columns,
                max_bags_per_device=bags,
            ),
            objective=Objective.Joint,
            masking=Masking(token_mask_probability=0.3, token_mean_span=3.0),
            late_interaction=LateInteraction(weight=1.0 if late else 0.0),
            schedule=ScheduleConfig(steps=10),
            seed=seed,
        )
    )


def random_items(rng: np.random.Generator, columns: int, count: int) -> list:
    contents: list = []
    for _ in range(count):
        n = int(rng.choice([0, rng.integers(0, columns), rng.integers(columns, 2 * columns)]))
        raw = rng.integers(0, 256, size=n, dtype=np.uint8)
        contents.append(raw.tobytes() if rng.random() < 0.7 else memoryview(raw))
    return contents


def run_prepare(config: TrainerInitVramConfig, contents: list, bags, sides, step: int):
    n = len(contents)
    return prepare(
        config,
        [Modality.Text] * n,
        contents,
        bags=bags,
        groups=None,
        sides=sides,
        relations=None,
        step=step,
    )


def check_batch(config: TrainerInitVramConfig, batch, contents: list, bags: np.ndarray | None, sides) -> None:
    b = config.batch
    R, C, S = b.max_rows_per_device, b.max_columns_per_row, b.max_segments_per_device
    n = len(contents)
    late = config.late_interaction.weight > 0
    prefixes = [
        vocab.prefix(Modality.Text, (sides[i] if sides is not None else LateInteractionSide.None_) if late else None)
        for i in range(n)
    ]
    lengths = np.array([len(p) + len(c) for p, c in zip(prefixes, contents, strict=True)], dtype=np.int64)
    layout = batch.layout
    check_layout(layout, lengths, bags if bags is not None else np.arange(n), R, C, S, b.max_bags_per_device)
    assert batch.truncated == int((layout.placed & (lengths > C)).sum())
    assert batch.dropped == n - int(layout.placed.sum())

    # Fixed shapes.
    P = covered_capacity(config)
    assert batch.tokens.shape == (R, C) and batch.positions.shape == (R, C, 3) and batch.segments.shape == (R, C)
    assert batch.counts.shape == (S,) and batch.slot_valid.shape == (S,) and batch.z.shape == (S, S)
    assert batch.target_index.shape == batch.targets.shape == batch.target_weight.shape == (P,)

    # Segment ids explicit, (row, column) order, padding S last; the uncorrupted rows as one text at a time writes them.
    check_order(batch.segments, S)
    clean = Rows.empty(R, C)
    for i in np.flatnonzero(layout.placed):
        one_text(clean, layout, int(i), prefixes[i], contents[i])
    segments_with_s = np.where(clean.segments == NO_SEGMENT, S, clean.segments)
    assert np.array_equal(batch.segments, segments_with_s)
    assert np.array_equal(batch.positions, clean.positions)
    check_rows(
        Rows(tokens=clean.tokens, positions=batch.positions, segments=batch.segments, content=clean.content),
        layout,
        prefixes,
        contents,
        padding=S,
    )
    assert np.array_equal(batch.counts, np.bincount(segments_with_s.reshape(-1), minlength=S + 1)[:S])
    assert np.array_equal(batch.slot_valid, np.isin(np.arange(S), layout.slot[layout.placed]))

    # Covered targets: exactly in the content part of a text segment, round(p * n) per segment.
    live = batch.target_weight > 0
    assert np.all(batch.target_weight[~live] == 0) and np.all(batch.target_weight[live] == 1)
    count = int(live.sum())
    assert np.all(live[:count]) and not np.any(live[count:])
    where = batch.target_index[live]
    assert len(np.unique(where)) == len(where)
    flat_clean = clean.tokens.reshape(-1)
    assert np.all(clean.content.reshape(-1)[where]), "a target lies on a prefix or on padding"
    assert np.array_equal(batch.targets[live], flat_clean[where])
    assert np.all(batch.targets[live] < vocab.BYTES)
    p = config.masking.token_mask_probability
    per_slot = np.bincount(batch.segments.reshape(-1)[where], minlength=S + 1)
    assert per_slot[S] == 0
    for i in np.flatnonzero(layout.placed):
        n_content = int(layout.length[i]) - len(prefixes[i])
        assert per_slot[layout.slot[i]] == round(p * n_content)
    # Outside the covered positions the tokens are untouched; covered ones show MASK, a byte, or the byte.
    covered = np.zeros(R * C, dtype=bool)
    covered[where] = True
    flat = batch.tokens.reshape(-1)
    assert np.array_equal(flat[~covered], flat_clean[~covered])
    assert np.all((flat[covered] == vocab.MASK) | (flat[covered] < vocab.BYTES))

    # The attention mask never lets a position see another segment, and a segment sees all of itself.
    mask = document_mask(torch.from_numpy(batch.segments), "dense").dense
    assert mask is not None and mask.shape == (R, 1, C, C)
    same = batch.segments[:, :, None] == batch.segments[:, None, :]
    assert np.array_equal(mask[:, 0].numpy(), same)
    # Every target's row of the mask reaches only its own segment's positions.
    rows_of, cols_of = np.divmod(where, C)
    for r, c in zip(rows_of, cols_of, strict=True):
        visible = mask[r, 0, c].numpy()
        assert np.all(batch.segments[r, visible] == batch.segments[r, c])


@pytest.mark.parametrize("seed", range(60))
def test_prepare_invariants(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    R, C, S = int(rng.integers(1, 4)), int(rng.integers(8, 40)), int(rng.integers(1, 12))
    max_bags = int(rng.choice([0, 0, 1, 3]))
    late = bool(rng.random() < 0.3)
    config = make_config(R, C, S, max_bags, late=late, seed=seed)
    count = int(rng.integers(1, 16))
    contents = random_items(rng, C, count)
    bags = rng.integers(0, count, size=count).astype(np.int64) if rng.random() < 0.5 else None
    sides = [LateInteractionSide(int(s)) for s in rng.integers(0, 4, size=count)] if late else None
    step = int(rng.integers(1, 1000))
    batch = run_prepare(config, contents, bags, sides, step)
    check_batch(config, batch, contents, bags, sides)

    # Same (seed, step): identical arrays.
    again = run_prepare(config, contents, bags, sides, step)
    for name in Batch.TENSORS:
        assert np.array_equal(getattr(batch, name), getattr(again, name)), name


def test_prepare_step_changes_shuffle_and_corruption() -> None:
    config = make_config(2, 32, 6, 0, seed=11)
    rng = np.random.default_rng(0)
    # Twenty items for six slots: the shuffle decides which land.
    contents = [rng.integers(0, 256, size=9, dtype=np.uint8).tobytes() for _ in range(20)]
    first = run_prepare(config, contents, None, None, step=1)
    second = run_prepare(config, contents, None, None, step=2)
    assert not np.array_equal(first.layout.placed, second.layout.placed)
    # Items that always fit: same layout, different corruption.
    few = contents[:3]
    a = run_prepare(config, few, None, None, step=1)
    b = run_prepare(config, few, None, None, step=2)
    assert np.array_equal(a.segments, b.segments)
    assert not np.array_equal(a.target_index, b.target_index) or not np.array_equal(a.tokens, b.tokens)
    # A different seed also changes the draws.
    other = run_prepare(make_config(2, 32, 6, 0, seed=12), contents, None, None, step=1)
    assert not np.array_equal(first.layout.placed, other.layout.placed) or not np.array_equal(
        first.tokens, other.tokens
    )


def test_prepare_truncates_and_drops() -> None:
    config = make_config(2, 16, 8, 0)
    contents = [b"x" * 40, b"y" * 15, b"z" * 14]  # 41 (cut to 16), 16 (exactly a row), 15
    outcomes = set()
    for step in range(1, 13):
        batch = run_prepare(config, contents, None, None, step=step)
        check_batch(config, batch, contents, None, None)
        # Each needs a row of its own and there are two: the shuffle decides which one is dropped whole.
        assert batch.dropped == 1
        assert batch.truncated == int(batch.layout.placed[0])
        if batch.layout.placed[0]:
            assert batch.layout.length[0] == 16 and batch.counts[batch.layout.slot[0]] == 16
        outcomes.add(tuple(batch.layout.placed.tolist()))
    assert len(outcomes) == 3


def test_prepare_bags_capped() -> None:
    config = make_config(4, 64, 32, 2)
    contents = [bytes([i]) * 5 for i in range(12)]
    bags = np.repeat(np.arange(4), 3).astype(np.int64)
    for step in range(1, 6):
        batch = run_prepare(config, contents, bags, None, step)
        check_batch(config, batch, contents, bags, None)
        taken = np.unique(bags[batch.layout.placed])
        assert len(taken) == 2 and np.array_equal(batch.layout.placed, np.isin(bags, taken))
        assert batch.dropped == 6


def test_prepare_empty_and_bare_items() -> None:
    config = make_config(1, 8, 4, 0)
    contents = [b"", b"", b"ab"]
    batch = run_prepare(config, contents, None, None, step=3)
    check_batch(config, batch, contents, None, None)
    assert batch.dropped == 0
    assert sorted(batch.counts[:3].tolist()) == [1, 1, 3] and batch.counts[3] == 0


# ---- fill_media against one item at a time ------------------------------------------------------------


def one_by_one(
    rows: Rows, layout: Layout, item: int, prefix: list[int], marker: int, positions: np.ndarray
) -> np.ndarray:
    """The naive reference of `fill_media`: one placed media item, slice by slice."""
    r, c0, n = int(layout.row[item]), int(layout.column[item]), int(layout.length[item])
    p = len(prefix)
    rows.tokens[r, c0 : c0 + p] = prefix
    rows.tokens[r, c0 + p : c0 + n] = marker
    rows.positions[r, c0 : c0 + p, :] = np.arange(p)[:, None]
    rows.positions[r, c0 + p : c0 + n, :] = positions[: n - p] + p
    rows.segments[r, c0 : c0 + n] = layout.slot[item]
    return r * rows.tokens.shape[1] + c0 + p + np.arange(n - p)


def twelve_rows(lengths: np.ndarray, columns: int, seed: int) -> Layout:
    """Items of `lengths`, one bag each, planned into 12 rows of `columns` and 32 segments (some dropped)."""
    rng = np.random.default_rng(seed)
    return plan(lengths, np.arange(len(lengths)), rows=12, columns=columns, segments=32, max_bags=0, rng=rng)


@pytest.mark.parametrize("seed", range(6))
def test_fill_media_writes_what_one_item_at_a_time_writes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, columns = 40, 96
    prefixes = [[5, 9][: int(rng.integers(1, 3))] if seed % 2 else [5] for _ in range(n)]
    counts = rng.integers(1, 120, n)  # some longer than a row: cut there
    positions = [rng.integers(0, 50, (int(k), 3)) for k in counts]
    layout = twelve_rows(counts + [len(p) for p in prefixes], columns, seed)
    placed = np.flatnonzero(layout.row >= 0).tolist()
    assert 0 < len(placed) < n  # some items dropped for room, some cut
    want, got = Rows.empty(12, columns), Rows.empty(12, columns)
    index = [one_by_one(want, layout, i, prefixes[i], 7, positions[i]) for i in placed]
    flat = fill_media(got, layout, placed, [prefixes[i] for i in placed], 7, [positions[i] for i in placed])
    assert np.array_equal(flat, np.concatenate(index))
    for field in ("tokens", "positions", "segments", "content"):
        assert np.array_equal(getattr(got, field), getattr(want, field)), field
    assert fill_media(got, layout, [], [], 7, []).shape == (0,)


@pytest.mark.parametrize("seed", range(6))
def test_fill_texts_writes_what_one_item_at_a_time_writes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, columns = 40, 96
    prefixes = [[5, 9][: int(rng.integers(1, 3))] if seed % 2 else [5] for _ in range(n)]
    data = rng.integers(0, 256, size=int(n * 60), dtype=np.uint8)
    offsets = np.concatenate([[0], np.sort(rng.integers(0, len(data), n - 1)), [len(data)]])
    contents: list = tape_items(data, offsets, "contents")  # memoryviews, some empty, some longer than a row
    if seed % 3 == 0:
        contents = [bytes(c) for c in contents]
    layout = twelve_rows(np.array([len(p) + len(c) for p, c in zip(prefixes, contents, strict=True)]), columns, seed)
    placed = np.flatnonzero(layout.row >= 0).tolist()
    assert 0 < len(placed) < n and layout.truncated.any()  # some items dropped for room, some cut
    want, got = Rows.empty(12, columns), Rows.empty(12, columns)
    for i in placed:
        one_text(want, layout, i, prefixes[i], contents[i])
    spans = fill_texts(got, layout, placed, [prefixes[i] for i in placed], [contents[i] for i in placed])
    for field in ("tokens", "positions", "segments", "content"):
        assert np.array_equal(getattr(got, field), getattr(want, field)), field
    p = [len(prefixes[i]) for i in placed]  # each item's content span, as corrupt_text takes it
    assert spans == [
        (layout.row[i], layout.column[i] + q, layout.length[i] - q) for i, q in zip(placed, p, strict=True)
    ]
    assert fill_texts(got, layout, [], [], []) == []  # nothing placed: nothing written
    assert np.array_equal(got.tokens, want.tokens)
