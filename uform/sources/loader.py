"""The loader a training loop drives: steps filled to the batch's capacity from a source, in an order that is
a pure function of (seed, step, devices), resumable from a small JSON-able state.

The global step. A run over `devices` devices in all (the whole world) reads `devices` shares
(`order.ShareStream`), each filled to one device's capacity; rank r of `world` ranks holds the shares
`r * devices // world` to `(r + 1) * devices // world` and reads only those. So the records of global step
k (the union over shares) are the same for any number of ranks: two ranks' steps together are one rank's
steps over the same `devices`.

Filling a share. Whole records (bags) are taken in the share's order while the step's room lasts: its
segments, bags, edges per set, and its positions (each item's length from `sizes.item_length`); then the
packer's own plan (`data.pack.plan`, with the draw the trainer's step will use) confirms that nothing
drops, and records are handed back, last first, until it does. A record handed back opens the next step.
A step ends with its share's epoch (so a small dataset never puts a record twice in one step): an epoch's
last step holds what is left of it.
A record too large for any step (more items than segments, more positions than a step's rows, more edges
or choices than the run allows) is skipped, warned about once with its id (`CapacityWarning`) and counted;
a record naming a missing file likewise (`MediaWarning`). With one device per rank the trainer's packer
then drops nothing (`TrainerStepStats.dropped == 0`) but where a downscaled image decodes a patch or two
off its header's estimate, or where one process drives several devices (the trainer routes its step's
bags to them itself, by size, and may group them otherwise).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import TrainerInitVramConfig, resolve
from ..data.batch import PACK_STREAM, late_room
from ..data.keyed import keyed_rng
from ..data.pack import plan
from ..notices import CapacityWarning, MediaWarning, Notices
from .fields import RecordItems, read_record
from .order import Position, ShareStream
from .record import Record
from .sizes import item_length
from .source import Source
from .step_input import StepInput, assemble, relations_of

COUNTS = ("records", "missing", "too_large", "empty")
"""What `Loader.counts` counts."""
STATE_VERSION = 1
"""The version of `Loader.state()`'s layout."""


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state from the ranks' `Loader.state()`s of one run (each holds its own shares' positions), which
    restores a loader over any number of ranks of the same `devices`; `ValueError` where they disagree on
    the step, seed, devices or shuffle buffer."""
    if not states:
        raise ValueError("data states: none to merge")
    first = states[0]
    merged = {**first, "shares": {}, "counts": {}}
    for state in states:
        for name in ("version", "seed", "devices", "shuffle_buffer", "step"):
            if state.get(name) != first.get(name):
                raise ValueError(
                    f"data states: {name} differs between ranks ({state.get(name)!r} vs {first.get(name)!r})"
                )
        merged["shares"].update(state["shares"])
        merged["counts"].update(state["counts"])
    return merged


class Loader:
    """Steps of `source` for rank `rank` of `world`, filled to one device's capacity per share (see the
    module's docstring).

    `config` is the run's (resolved here: `resolve` is idempotent); `seed` keys the order (default the
    run's seed); `devices` is the number of devices of the whole world (default `world`: one device per
    rank); `shuffle_buffer` is the records each share's shuffle buffer holds. `state` (from `state()`)
    continues exactly where it was taken.
    """

    def __init__(
        self,
        source: Source,
        config: TrainerInitVramConfig,
        *,
        seed: int | None = None,
        rank: int = 0,
        world: int = 1,
        devices: int | None = None,
        shuffle_buffer: int = 1024,
        state: dict[str, Any] | None = None,
    ) -> None:
        devices = world if devices is None else devices
        for name, value in (("world", world), ("devices", devices), ("shuffle_buffer", shuffle_buffer)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if not 0 <= rank < world:
            raise ValueError(f"rank: must lie in [0, world={world}), got {rank}")
        if devices % world:
            raise ValueError(f"devices: {devices} devices do not split evenly over {world} ranks")
        self.source, self.config = source, resolve(config)
        self.seed = self.config.seed if seed is None else int(seed)
        self.rank, self.world, self.devices = rank, world, devices
        self.shuffle_buffer = shuffle_buffer
        self.notices = Notices()
        """The loader's warnings (missing files, records too large), each shown once and counted."""
        held = range(rank * devices // world, (rank + 1) * devices // world)
        self.step = 1
        self._counts = {d: dict.fromkeys(COUNTS, 0) for d in held}
        at = {d: Position(0, 0) for d in held}
        if state is not None:
            at = self._restored(state, held)
        self._streams = {
            d: ShareStream(source, seed=self.seed, share=d, shares=devices, buffer=shuffle_buffer, at=at[d])
            for d in held
        }

    @classmethod
    def resume(cls, source: Source, config: TrainerInitVramConfig, state: dict[str, Any], **kwargs: Any) -> Loader:
        """The loader continuing at `state` (`Loader(source, config, state=state, **kwargs)`)."""
        return cls(source, config, state=state, **kwargs)

    # ---- the position ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The loader's position, JSON-able: the next step's number, each held share's next record
        position, and the counts. States of the ranks of one run merge by their `shares` dicts."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "devices": self.devices,
            "shuffle_buffer": self.shuffle_buffer,
            "step": self.step,
            "shares": {str(d): [s.position().epoch, s.position().index] for d, s in self._streams.items()},
            "counts": {str(d): dict(c) for d, c in self._counts.items()},
        }

    def _restored(self, state: dict[str, Any], held: range) -> dict[int, Position]:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"data state: expected a loader state of version {STATE_VERSION}")
        for name, mine in (("seed", self.seed), ("devices", self.devices), ("shuffle_buffer", self.shuffle_buffer)):
            if state.get(name) != mine:
                raise ValueError(
                    f"data state: {name} is {state.get(name)!r} in the state, {mine!r} here; the order would differ"
                )
        shares = state.get("shares", {})
        missing = [d for d in held if str(d) not in shares]
        if missing:
            raise ValueError(f"data state: holds no position for share(s) {missing} of rank {self.rank}")
        self.step = int(state["step"])
        counts = state.get("counts", {})
        for d in held:
            self._counts[d].update({k: int(v) for k, v in counts.get(str(d), {}).items()})
        return {d: Position(int(shares[str(d)][0]), int(shares[str(d)][1])) for d in held}

    # ---- steps -----------------------------------------------------------------------------------

    def next_step(self) -> StepInput:
        """This rank's next step: its shares' records, each share filled to one device's capacity."""
        records: list[RecordItems] = []
        counts = {d: dict(c) for d, c in self._counts.items()}
        consumed: dict[int, list[tuple[Position, Record]]] = {d: [] for d in self._streams}
        try:
            for d, stream in self._streams.items():
                records.extend(self._fill(stream, consumed[d]))
        except BaseException:  # a refused record (an unknown field, say) leaves the loader where it was
            for d, stream in self._streams.items():
                stream.give_back(consumed[d])
            self._counts = counts
            raise
        late = self.source.fields.late
        groups = any(r.kind == "group" for r in self.source.fields.roles.values())
        out = assemble(records, self.step, late=late, groups=groups)
        self.step += 1
        return out

    @property
    def counts(self) -> dict[str, int]:
        """Records taken into steps (`records`), and records skipped by why: a missing file (`missing`), too
        large for any step (`too_large`), no item at all (`empty`); over this rank's shares, across resumes."""
        return {kind: sum(c[kind] for c in self._counts.values()) for kind in COUNTS}

    def _read(self, record: Record, share: int) -> RecordItems | None:
        """The record's items, or None (counted, warned) for a record to skip."""
        items = read_record(record, self.source.fields)
        if items.missing is not None:
            self._counts[share]["missing"] += 1
            self.notices.warn(
                "missing",
                f"uform: record {items.id} names a missing file ({items.missing}); such records are skipped and "
                "counted (Loader.counts['missing'])",
                MediaWarning,
            )
            return None
        if not items.modalities:
            self._counts[share]["empty"] += 1
            return None
        return items

    def _fill(self, stream: ShareStream, consumed: list[tuple[Position, Record]]) -> list[RecordItems]:
        """One share's records for this step; every record taken from `stream` (kept or skipped) is appended
        to `consumed`, in order, so that a failing step can hand them all back."""
        b = self.config.batch
        room = b.max_rows_per_device * b.max_columns_per_row
        chosen: list[RecordItems] = []
        used = np.zeros(5, dtype=np.int64)  # positions, segments, bags, attract edges, repel edges
        limit = np.array(
            [room, b.max_segments_per_device, b.max_bags_per_device or 2**62]
            + [self.config.contrastive.max_edges_per_device] * 2,
            dtype=np.int64,
        )
        start = epoch = stream.peek()[0].epoch
        while True:
            at, record = stream.peek()
            if chosen and at.epoch > epoch:
                break  # a step ends with its epoch: a record never meets itself in one step
            if at.epoch > start + 1:
                raise ValueError("data: every record of a whole epoch was skipped (see Loader.counts)")
            items = self._read(record, stream.share)
            if items is None:
                consumed.append(stream.take())
                continue
            cost = self._cost(items)
            if not self._fits_alone(items, cost, limit, stream.share):
                consumed.append(stream.take())
                continue
            if np.any(used + cost > limit):
                break
            consumed.append(stream.take())
            chosen.append(items)
            epoch = at.epoch
            used += cost
        while len(chosen) > 1 and self._drops(chosen):
            stream.give_back([consumed.pop()])  # the last consumed is the last chosen
            chosen.pop()
        self._counts[stream.share]["records"] += len(chosen)
        return chosen

    def _lengths(self, records: list[RecordItems]) -> np.ndarray:
        for r in records:
            if r.lengths is None:  # measured once: an image's header is read here
                chooser = r.chooser
                r.lengths = [
                    item_length(self.config, m, c, s, i == chooser)
                    for i, (m, c, s) in enumerate(zip(r.modalities, r.contents, r.sides, strict=True))
                ]
        return np.array([n for r in records for n in r.lengths or ()], dtype=np.int64)

    def _cost(self, items: RecordItems) -> np.ndarray:
        """What one record takes of a step: positions (cut at a row), segments, a bag, attract and repel edges."""
        kept = np.minimum(self._lengths([items]), self.config.batch.max_columns_per_row)
        relations = relations_of([items])
        edges = [len(relations.attract.ids), len(relations.repel.ids)]
        return np.array([int(kept.sum()), len(items.modalities), 1, *edges], dtype=np.int64)

    def _fits_alone(self, items: RecordItems, cost: np.ndarray, limit: np.ndarray, share: int) -> bool:
        too_many = len(items.choices) > self.config.batch.max_choices_per_item
        if too_many or np.any(cost > limit) or (not self._fits_plainly(items) and self._drops([items])):
            self._counts[share]["too_large"] += 1
            self.notices.warn(
                "too large",
                f"uform: record {items.id} is too large for any step (its {len(items.modalities)} items take "
                f"{int(cost[0])} positions, {int(cost[3])} attract and {int(cost[4])} repel edges, "
                f"{len(items.choices)} choices, beyond what batch and contrastive allow a device's step); such "
                "records are skipped and counted (Loader.counts['too_large'])",
                CapacityWarning,
            )
            return False
        return True

    def _fits_plainly(self, items: RecordItems) -> bool:
        """Whether the packer surely keeps the record alone, without asking its plan: every item within a row,
        one row each at worst (no late-interaction rooms to count). Most records (a pair, a few texts) are."""
        b = self.config.batch
        return (
            self.config.late_interaction.weight <= 0
            and len(items.modalities) <= b.max_rows_per_device
            and max(items.lengths or (0,)) <= b.max_columns_per_row
        )

    def _drops(self, records: list[RecordItems]) -> bool:
        """Whether the packer would drop any item of `records` as step `self.step`'s one device share."""
        c, b = self.config, self.config.batch
        lengths = self._lengths(records)
        bags = np.array([k for k, r in enumerate(records) for _ in r.modalities], dtype=np.int64)
        late = None
        if c.late_interaction.weight > 0:
            sides = [s for r in records for s in r.sides]
            late = late_room(c, sides, np.full(len(sides), 2, dtype=np.int64))  # a late prefix: marker and side
        layout = plan(
            lengths,
            bags,
            rows=b.max_rows_per_device,
            columns=b.max_columns_per_row,
            segments=b.max_segments_per_device,
            max_bags=b.max_bags_per_device,
            rng=keyed_rng(c.seed, self.step, PACK_STREAM),
            late=late,
        )
        return layout.dropped > 0
