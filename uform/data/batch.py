"""One device's step, prepared on the host: packed rows, corruption, targets and pair matrices.

Shape legend: N items, R rows, C columns, S segment slots, P covered-position capacity, U units of one
media modality in the step, F values per unit; late interaction's Qt query token rows, Dd document
columns and Dt document token rows; K legal bytes per choice (`max_choices_per_item`).

Every array but the media units has a shape fixed by the run's capacities (never by the step's content),
so the compiled step sees the same shapes every time; the media arrays' first axis U varies and is
compiled as a dynamic size (padded to at least two units, so it never hits the sizes 0 and 1 that
torch.compile specialises). Every draw comes from a generator keyed by (seed, step, stream), and an item's
corruption and media mask by its own digest too (`item_key`), so they do not depend on its neighbours.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .. import vocab
from ..config import TrainerInitVramConfig
from ..enums import LateInteractionSide, Modality, Objective
from ..media.units import Units, item_key
from ..relations import pair_targets
from .corrupt import corrupt_text
from .items import ChoiceTapes
from .keyed import keyed_rng, keyed_states, words
from .pack import LateRoom, Layout, Rows, fill_media, fill_state, fill_texts, plan
from .row_copy import copy_rows

if TYPE_CHECKING:  # torch loads where host tensors are made, never in the preparer process that prepares steps
    import torch

PACK_STREAM = 1
CORRUPT_STREAM = 2
MEDIA_STREAM = 3

MEDIA_KINDS = {Modality.Image: "image", Modality.Video: "video", Modality.Audio: "audio"}
UNIT_DTYPES: dict[str, type[np.generic]] = {"image": np.uint8, "video": np.uint8, "audio": np.float32}
"""The dtype of each modality's unit values, as the decoders answer them (`media.units.Units`)."""

Alloc = Callable[[tuple[int, ...], type[np.generic]], np.ndarray]
"""Makes an array of a shape and dtype whose contents the caller overwrites whole (`np.empty`'s contract): where
`prepare` builds a step's media arrays, the largest of its answer (a preparer process's builds them straight into
the shared memory its answer crosses in)."""


def draws_media_masks(config: TrainerInitVramConfig) -> bool:
    """Whether a step of the run masks its media units (every objective but `Contrastive`): only such a step draws
    by the items' keys (`Units.key`), so only its decoders need compute them."""
    return config.objective != Objective.Contrastive


def media_features(config: TrainerInitVramConfig) -> dict[str, int]:
    """F of every live media modality (a zero patch_side or chunk_samples leaves it out of the run)."""
    b = config.batch
    out = {}
    if b.image.patch_side:
        out["image"] = b.image.patch_side**2 * b.image.channels
    if b.video.patch_side:
        out["video"] = b.video.tube_frames * b.video.patch_side**2 * b.video.channels
    if b.audio.chunk_samples:
        out["audio"] = b.audio.chunk_samples
    return out


_MODALITY_OF = {kind: modality for modality, kind in MEDIA_KINDS.items()}
"""Each media kind's modality ("image" -> Modality.Image)."""


def mask_media(
    kinds: Sequence[str], items: Sequence[Units], ratios: Sequence[float], keys: np.ndarray
) -> list[np.ndarray]:
    """Each media item's [N] bool mask: round(ratio * N) units of an image or audio item; for video round(ratio *
    rows * columns) spatial positions masked in every tube-time of the clip (VideoMAE's tube masking, Tong et al.
    2022). Each unit (each spatial position of a clip) is ranked by a word of its item's keyed stream (`keys`
    [I, 2], `keyed.words`) and the lowest are masked: every unit equally likely, an item's mask its key's alone,
    and the items of one size drawn in a few array calls for all of them (one generator and a choice an item
    cost ~15 us each, 128 images a reference step)."""
    sizes = [math.prod(u.grid[1:]) if kind == "video" else len(u) for kind, u in zip(kinds, items, strict=True)]
    counts = [round(ratio * size) for ratio, size in zip(ratios, sizes, strict=True)]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(zip(sizes, counts, strict=True)):
        groups.setdefault(shape, []).append(i)
    out: list[np.ndarray] = [np.zeros(0, dtype=bool)] * len(items)
    for (size, count), members in groups.items():
        chosen = np.zeros((len(members), size), dtype=bool)  # [I, size]
        if count >= size:
            chosen[:] = True
        elif count > 0:
            ranked = words(keys[members][:, None, :], 0, np.arange(size))  # [I, size]
            np.put_along_axis(chosen, np.argpartition(ranked, count - 1, axis=1)[:, :count], True, axis=1)
        for row, i in zip(chosen, members, strict=True):
            out[i] = np.tile(row, len(items[i]) // size) if kinds[i] == "video" else row
    return out


def covered_capacity(config: TrainerInitVramConfig) -> int:
    """P: every text segment covers round(p * n) <= p * n + 1/2 positions, so this always suffices."""
    b = config.batch
    if config.objective == Objective.Contrastive:
        return 1
    positions = b.max_rows_per_device * b.max_columns_per_row
    return min(positions, math.ceil(config.masking.token_mask_probability * positions) + b.max_segments_per_device)


@dataclass
class Batch:
    """Host arrays of one device's step, fixed shapes."""

    tokens: np.ndarray  # [R, C] int64, corrupted where the objective masks
    positions: np.ndarray  # [R, C, 3] int64
    segments: np.ndarray  # [R, C] int64 slot ids, padding = S
    counts: np.ndarray  # [S] int64 positions per slot
    target_index: np.ndarray  # [P] int64 flat (row * C + column) covered positions
    targets: np.ndarray  # [P] int64 original bytes there
    target_weight: np.ndarray  # [P] float32, 1 covered / 0 capacity padding
    slot_valid: np.ndarray  # [S] bool
    slot_group: np.ndarray  # [S] int64
    z: np.ndarray  # [S, S] float32 +1 / -1 / 0
    w: np.ndarray  # [S, S] float32
    layout: Layout = field(repr=False)
    media: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """Per live media modality: values [U, F], index [U] (flat positions), masked [U] bool, valid [U]."""
    late: dict[str, np.ndarray] = field(default_factory=dict)
    """Where late interaction is on: query_index [Qt] (flat positions of the query tokens), query_slot
    [Qt] (their slot, S for padding), document_index [Dt], document_of [Dt] (their document column, Dd
    for padding), z and w [S, Dd] (the pair targets of every query slot and document column)."""
    choice: dict[str, np.ndarray] = field(default_factory=dict)
    """Where choices are trained: index [S] (flat position of each slot's appended MASK), bytes [S, K]
    (its legal bytes), legal [S, K] bool, targets [S, K] float32, valid [S] float32 (1: made a choice)."""
    positives: int = 1
    """A power of two at least the most positives any slot's row holds (the ranked form's static bound)."""
    late_positives: int = 1
    """The same bound over the late-interaction rows."""
    truncated: int = 0
    dropped: int = 0
    skipped: int = 0

    TENSORS = (
        "tokens",
        "positions",
        "segments",
        "counts",
        "target_index",
        "targets",
        "target_weight",
        "slot_valid",
        "slot_group",
        "z",
        "w",
    )

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array the device stage reads, by its host tensor's name ("tokens", "image.values", "late.z"...)."""
        arrays = {name: getattr(self, name) for name in self.TENSORS}
        for kind, parts in self.media.items():
            arrays.update({f"{kind}.{part}": array for part, array in parts.items()})
        arrays.update({f"late.{part}": array for part, array in self.late.items()})
        arrays.update({f"choice.{part}": array for part, array in self.choice.items()})
        return arrays

    def host_tensors(
        self, pin: bool, copy: bool = False, tables: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, torch.Tensor]:
        """The arrays as host tensors (the one batch -> host tensor conversion, of training and serving; the
        device's is `model.inputs.to_device`), page-locked when `pin` (so the copy to a GPU runs
        asynchronously); unpinned tensors share the arrays' memory unless `copy`. `tables`, FlexAttention's
        block tables (`data.blocks.block_tables`) where the step takes that path, join as "block.<name>"."""
        import torch  # local: a preparer process packs batches without torch; only the trainer's makes tensors

        arrays = self.arrays()
        arrays.update({f"block.{name}": table for name, table in (tables or {}).items()})
        out = {}
        for name, array in arrays.items():
            if copy and not pin:  # numpy's copy: about three times torch's clone into fresh memory, measured
                array = np.array(array, order="C", copy=True)
            t = torch.from_numpy(np.ascontiguousarray(array))
            out[name] = t.pin_memory() if pin else t
        return out

    def adopt(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Makes the batch hold its own memory: every array becomes a view of its tensor in `tensors` (as
        `host_tensors` named them, copies), and the layout a deep copy. The batch then keeps nothing of the
        buffers it was unpickled from (a preparer process's shared slab, which the next step reuses)."""
        for name in self.TENSORS:
            setattr(self, name, tensors[name].numpy())
        for kind, parts in self.media.items():
            self.media[kind] = {part: tensors[f"{kind}.{part}"].numpy() for part in parts}
        self.late = {part: tensors[f"late.{part}"].numpy() for part in self.late}
        self.choice = {part: tensors[f"choice.{part}"].numpy() for part in self.choice}
        self.layout = deepcopy(self.layout)


def prepare(
    config: TrainerInitVramConfig,
    modalities: list[Modality],
    contents: Sequence[bytes | memoryview],
    *,
    bags: np.ndarray | None,
    groups: np.ndarray | None,
    sides: list[LateInteractionSide] | None,
    relations: object,
    step: int,
    units: Mapping[int, Units] | None = None,
    skipped: np.ndarray | None = None,
    choices: ChoiceTapes | None = None,
    alloc: Alloc = np.empty,
) -> Batch:
    """Packs, corrupts and pairs one step's items for one device. Inputs were checked by the caller.

    `units` holds the decoded units of every media item that decoded; `skipped` [N] marks the media
    items that did not (they take no room, score no pair, and are counted apart from `dropped`).
    `choices` (read where the run trains them) gives the text items that make a choice: each becomes
    its state, its bytes with a MASK appended (the head cut where the row is too short), and is left
    uncorrupted, so the choice reads the state exactly as `text_choose` will. `alloc` makes the media
    arrays (`Batch.media`), each written whole here: the answer is the same wherever they lie.
    """
    b = config.batch
    R, C, S = b.max_rows_per_device, b.max_columns_per_row, b.max_segments_per_device
    n = len(contents)
    late = config.late_interaction.weight > 0
    side_of = sides if sides is not None else [LateInteractionSide.None_] * n
    prefixes = [vocab.prefix(m, side_of[i] if late else None) for i, m in enumerate(modalities)]
    units = units or {}
    choosing = config.choices.weight > 0 and b.max_choices_per_item > 0
    chooses = np.zeros(n, dtype=bool)
    if choosing and choices is not None:
        chooses = np.diff(choices.offsets) > 0
    lengths = np.array(
        [len(p) + len(units.get(i, c)) for i, (p, c) in enumerate(zip(prefixes, contents, strict=True))],
        dtype=np.int64,
    )
    lengths += chooses  # the appended MASK
    room = late_room(config, side_of, np.array([len(p) for p in prefixes], dtype=np.int64)) if late else None
    layout = plan(
        lengths,
        bags if bags is not None else np.arange(n),
        skip=skipped,
        rows=R,
        columns=C,
        segments=S,
        max_bags=b.max_bags_per_device,
        rng=keyed_rng(config.seed, step, PACK_STREAM),
        late=room,
    )
    rows = Rows.empty(R, C)
    features = media_features(config)
    gathered: dict[str, list[tuple[np.ndarray | None, int, np.ndarray]]] = {kind: [] for kind in features}
    media_of: dict[str, list[int]] = {kind: [] for kind in features}  # each modality's placed items, in order
    masking = draws_media_masks(config)
    span_items: list[int] = []
    truncated = layout.truncated.copy()
    mask_at = np.zeros(n, dtype=np.int64)
    placed_items = np.flatnonzero(layout.placed).tolist()
    media_masks: dict[int, np.ndarray] = {}
    if masking:  # every media item's mask, drawn at once
        media_items = [i for i in placed_items if not chooses[i] and modalities[i] != Modality.Text]
        digests = [_media_key(units[i], modalities[i], contents[i]) for i in media_items]
        kinds = [MEDIA_KINDS[modalities[i]] for i in media_items]
        ratios = [getattr(config.masking, f"{kind}_mask_ratio") for kind in kinds]
        keys = keyed_states(config.seed, step, MEDIA_STREAM, digests)[:, :2]
        drawn = mask_media(kinds, [units[i] for i in media_items], ratios, keys)
        media_masks = dict(zip(media_items, drawn, strict=True))
    for i in placed_items:
        p = len(prefixes[i])
        if chooses[i]:
            mask_at[i] = fill_state(rows, layout, i, prefixes[i], contents[i])
            continue
        if modalities[i] == Modality.Text:
            span_items.append(i)
            continue
        kind, item = MEDIA_KINDS[modalities[i]], units[i]
        media_of[kind].append(i)
        masked = media_masks[i] if masking else np.zeros(len(item), dtype=bool)
        gathered[kind].append((None if item.source is not None else item.values, int(layout.length[i]) - p, masked))
        truncated[i] |= item.truncated
    spans = fill_texts(rows, layout, span_items, [prefixes[i] for i in span_items], [contents[i] for i in span_items])
    media = {}
    for kind, f in features.items():
        chosen = media_of[kind]
        marker = vocab.MODALITY_MARKER[_MODALITY_OF[kind]]
        positions = [units[i].positions for i in chosen]
        index = fill_media(rows, layout, chosen, [prefixes[i] for i in chosen], marker, positions)
        media[kind] = _stack_units(gathered[kind], index, f, UNIT_DTYPES[kind], alloc)

    capacity = covered_capacity(config)
    target_index = np.zeros(capacity, dtype=np.int64)
    targets = np.zeros(capacity, dtype=np.int64)
    target_weight = np.zeros(capacity, dtype=np.float32)
    tokens = rows.tokens
    if config.objective != Objective.Contrastive:
        text_keys = [item_key(modalities[i], contents[i]) for i in span_items]
        states = keyed_states(config.seed, step, CORRUPT_STREAM, text_keys)[:, :2]
        tokens, covered = corrupt_text(rows.tokens, spans, config.masking, states)
        where = np.flatnonzero(covered.reshape(-1))
        target_index[: len(where)] = where
        targets[: len(where)] = rows.tokens.reshape(-1)[where]
        target_weight[: len(where)] = 1.0

    segments = np.where(rows.segments < 0, S, rows.segments)
    counts = np.bincount(segments.reshape(-1), minlength=S + 1)[:S].astype(np.int64)
    placed = np.flatnonzero(layout.placed)
    slots = layout.slot[placed]
    slot_valid = np.zeros(S, dtype=bool)
    slot_valid[slots] = True
    slot_group = np.zeros(S, dtype=np.int64)
    if groups is not None:
        slot_group[slots] = groups[placed]
    z = np.zeros((S, S), dtype=np.float32)
    w = np.zeros((S, S), dtype=np.float32)
    z_items = w_items = np.zeros((0, 0), dtype=np.float32)
    if config.objective != Objective.Masked or late:  # late pairs resolve through the relations too
        c = config.contrastive
        z_items, w_items = pair_targets(relations, n, c.negatives, c.ambient_repulsion_weight)  # type: ignore[arg-type]
    if config.objective != Objective.Masked:
        z[np.ix_(slots, slots)] = z_items[np.ix_(placed, placed)]
        w[np.ix_(slots, slots)] = w_items[np.ix_(placed, placed)]
    late_arrays: dict[str, np.ndarray] = {}
    if room is not None:
        late_arrays = _late_arrays(config, layout, room, z_items, w_items)
    choice_arrays: dict[str, np.ndarray] = {}
    if choosing:
        choice_arrays = _choice_arrays(S, b.max_choices_per_item, layout, chooses, mask_at, choices)
    return Batch(
        positives=_bound(z),
        late_positives=_bound(late_arrays["z"]) if late_arrays else 1,
        late=late_arrays,
        choice=choice_arrays,
        tokens=tokens,
        positions=rows.positions,
        segments=segments,
        counts=counts,
        target_index=target_index,
        targets=targets,
        target_weight=target_weight,
        slot_valid=slot_valid,
        slot_group=slot_group,
        z=z,
        w=w,
        layout=layout,
        media=media,
        truncated=int(truncated.sum()),
        dropped=layout.dropped,
        skipped=0 if skipped is None else int(np.asarray(skipped).sum()),
    )


_QUERY_SIDES = (LateInteractionSide.Query, LateInteractionSide.QueryAndDocument)
_DOCUMENT_SIDES = (LateInteractionSide.Document, LateInteractionSide.QueryAndDocument)


def late_room(config: TrainerInitVramConfig, sides: Sequence[LateInteractionSide], prefix: np.ndarray) -> LateRoom:
    """The late-interaction room the packer plans a step's items in: which are queries and documents (by their
    `sides`), their prefix lengths, and the run's bounds on query spans, tokens and documents."""
    li = config.late_interaction
    return LateRoom(
        query=np.array([s in _QUERY_SIDES for s in sides], dtype=bool),
        document=np.array([s in _DOCUMENT_SIDES for s in sides], dtype=bool),
        prefix=prefix,
        span=li.max_query_span,
        query_tokens=li.max_query_tokens_per_device,
        documents=li.max_documents_per_device,
        document_tokens=li.max_document_tokens_per_device,
    )


def _media_key(units: Units, modality: Modality, content: bytes | memoryview) -> int:
    """A media item's `item_key`: its decoder's, mostly (computed there, in parallel)."""
    return item_key(modality, content) if units.key is None else units.key


def _bound(z: np.ndarray) -> int:
    """A power of two at least the most positives any row of `z` holds (1 for none)."""
    most = int((z > 0).sum(axis=1).max()) if z.size else 0
    return 1 << max(0, most - 1).bit_length()


def _late_arrays(
    config: TrainerInitVramConfig, layout: Layout, room: LateRoom, z_items: np.ndarray, w_items: np.ndarray
) -> dict[str, np.ndarray]:
    """Late interaction's index arrays, padded to the run's capacities (see `Batch.late`).

    Slots are visited in order: a query slot's first `max_query_span` positions past its prefix become
    query token rows, a document slot takes the next document column and all its positions past its
    prefix. `plan` already dropped whatever would not fit, so the capacities always hold.
    """
    li = config.late_interaction
    S, C = config.batch.max_segments_per_device, config.batch.max_columns_per_row
    Qt, Dd, Dt = li.max_query_tokens_per_device, li.max_documents_per_device, li.max_document_tokens_per_device
    query_index = np.zeros(Qt, dtype=np.int64)
    query_slot = np.full(Qt, S, dtype=np.int64)
    document_index = np.zeros(Dt, dtype=np.int64)
    document_of = np.full(Dt, Dd, dtype=np.int64)
    query_items: list[int] = []
    query_slots: list[int] = []
    document_items: list[int] = []
    at_query = at_document = 0
    for slot, item in enumerate(layout.item_of_slot.tolist()):
        if item < 0:
            continue
        p = int(room.prefix[item])
        tokens = int(layout.length[item]) - p
        if tokens <= 0:
            continue
        first = int(layout.row[item]) * C + int(layout.column[item]) + p
        if room.query[item]:
            k = min(tokens, room.span)
            query_index[at_query : at_query + k] = first + np.arange(k)
            query_slot[at_query : at_query + k] = slot
            at_query += k
            query_items.append(item)
            query_slots.append(slot)
        if room.document[item]:
            document_index[at_document : at_document + tokens] = first + np.arange(tokens)
            document_of[at_document : at_document + tokens] = len(document_items)
            at_document += tokens
            document_items.append(item)
    z = np.zeros((S, Dd), dtype=np.float32)
    w = np.zeros((S, Dd), dtype=np.float32)
    if query_items and document_items:
        rows, columns = np.array(query_slots), np.arange(len(document_items))
        mine, theirs = np.array(query_items), np.array(document_items)
        z[np.ix_(rows, columns)] = z_items[np.ix_(mine, theirs)]
        w[np.ix_(rows, columns)] = w_items[np.ix_(mine, theirs)]
    return {
        "query_index": query_index,
        "query_slot": query_slot,
        "document_index": document_index,
        "document_of": document_of,
        "z": z,
        "w": w,
    }


def _choice_arrays(
    slots: int,
    width: int,
    layout: Layout,
    chooses: np.ndarray,
    mask_at: np.ndarray,
    choices: ChoiceTapes | None,
) -> dict[str, np.ndarray]:
    """The choices' arrays [S] / [S, K] (see `Batch.choice`), over the placed items that make one."""
    index = np.zeros(slots, dtype=np.int64)
    legal_bytes = np.zeros((slots, width), dtype=np.int64)
    legal = np.zeros((slots, width), dtype=bool)
    targets = np.zeros((slots, width), dtype=np.float32)
    valid = np.zeros(slots, dtype=np.float32)
    for item in np.flatnonzero(chooses & layout.placed).tolist():
        assert choices is not None
        slot = int(layout.slot[item])
        data, q = choices.of(item)
        k = len(data)
        index[slot] = mask_at[item]
        legal_bytes[slot, :k] = data
        legal[slot, :k] = True
        targets[slot, :k] = q
        valid[slot] = 1.0
    return {"index": index, "bytes": legal_bytes, "legal": legal, "targets": targets, "valid": valid}


def _stack_units(
    parts: list[tuple[np.ndarray | None, int, np.ndarray]],
    flat: np.ndarray,
    features: int,
    dtype: type[np.generic],
    alloc: Alloc,
) -> dict[str, np.ndarray]:
    """One modality's units of the step, padded with inert units (zero values, valid 0, never masked) to at
    least two; values in the modality's own dtype even when the step has none of its units (a stable dtype for
    the compiled step). `parts` are each item's (values, units kept, masked), `flat` every unit's flat position
    (`pack.fill_media`). Each unit is copied once, into arrays of `alloc` written whole, but for the rows of a
    part without values (units a GPU decoder fills, `Units.source`), which are left unwritten."""
    count = len(flat)
    padded = max(2, count)
    values = alloc((padded, features), dtype)  # [U, F]
    index = alloc((padded,), np.int64)
    masked = alloc((padded,), np.bool_)
    valid = alloc((padded,), np.float32)
    if parts:
        copy_rows(values, [None if v is None else v[:n] for v, n, _ in parts], [n for _, n, _ in parts])
        index[:count] = flat
        np.concatenate([m[:n] for _, n, m in parts], out=masked[:count], casting="unsafe")
    values[count:] = 0
    index[count:] = 0
    masked[count:] = False
    valid[:count] = 1.0
    valid[count:] = 0.0
    return {"values": values, "index": index, "masked": masked, "valid": valid}
