"""The order records are read in: a pure function of (seed, epoch, share, shares), resumable from a position.

A run's global step is `shares` device shares (one per device of the whole world); share d reads its own
stream of records, every epoch anew:

1. the shards are shuffled by a keyed draw of (seed, epoch) (docs/design.md §4: a generator keyed by its
   purpose, so the same on any machine);
2. with at least as many shards as shares, share d reads shards d, d + shares, ... of that order (each
   reads only its own files); with fewer, every share reads every shard and keeps the records whose index
   in the epoch is d modulo shares;
3. its records pass a shuffle buffer of `buffer` records, drawn from by a generator keyed by (seed,
   epoch, share): once full, each draw emits a uniformly chosen record and refills its place.

A record's `Position` is (epoch, index): it is the index-th record share d emits in that epoch. A stream
restored at a position replays that epoch's emission up to it (reading, not stepping: O(index) records)
and goes on exactly as the uninterrupted stream would. Nothing depends on the number of ranks: a rank
reads the shares it holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..data.keyed import keyed_rng
from .record import Record
from .source import Source

SHARD_STREAM = 0x5A4D
"""The keyed draw of an epoch's shard order (apart from the trainer's PACK/CORRUPT/MEDIA streams)."""
BUFFER_STREAM = 0x5B0F
"""The keyed draw of a share's shuffle buffer."""


@dataclass(frozen=True)
class Position:
    """A record's place in its share's stream: the `index`-th record emitted in `epoch`."""

    epoch: int
    index: int


def shard_order(count: int, seed: int, epoch: int) -> np.ndarray:
    """[count] the epoch's shard order, a keyed permutation."""
    return keyed_rng(seed, epoch, SHARD_STREAM).permutation(count)


class ShareStream:
    """Share `share`'s records, epoch after epoch, each with its `Position`; `peek` / `take` / `give_back`
    let a step take whole records and hand back the ones that did not fit."""

    def __init__(self, source: Source, *, seed: int, share: int, shares: int, buffer: int, at: Position) -> None:
        if buffer < 1:
            raise ValueError(f"shuffle_buffer: must be at least 1, got {buffer}")
        self.source, self.seed, self.share, self.shares, self.buffer = source, seed, share, shares, buffer
        self._ahead: deque[tuple[Position, Record]] = deque()
        self._start(at.epoch)
        for _ in range(at.index):
            if self._emit() is None:
                raise ValueError(f"data position: epoch {at.epoch} of share {share} has fewer than {at.index} records")

    def _records(self, epoch: int) -> Iterator[Record]:
        order = shard_order(len(self.source.shards), self.seed, epoch)
        if len(order) >= self.shares:
            for shard in order[self.share :: self.shares].tolist():
                yield from self.source.records(shard)
            return
        index = 0
        for shard in order.tolist():
            for record in self.source.records(shard):
                if index % self.shares == self.share:
                    yield record
                index += 1

    def _start(self, epoch: int) -> None:
        self._epoch, self._emitted = epoch, 0
        self._reading = self._records(epoch)
        self._pool: list[Record] = []
        self._rng = keyed_rng(self.seed, epoch, BUFFER_STREAM, self.share)
        for record in self._reading:
            self._pool.append(record)
            if len(self._pool) >= self.buffer:
                break

    def _emit(self) -> tuple[Position, Record] | None:
        """The epoch's next record and its position, or None at the epoch's end."""
        if not self._pool:
            return None
        pick = int(self._rng.integers(len(self._pool)))
        record = self._pool[pick]
        refill = next(self._reading, None)
        if refill is not None:
            self._pool[pick] = refill
        else:
            self._pool[pick] = self._pool[-1]
            self._pool.pop()
        at = Position(self._epoch, self._emitted)
        self._emitted += 1
        return at, record

    def peek(self) -> tuple[Position, Record]:
        """The next record to take, moving into the next epoch where this one ended; `ValueError` when an
        epoch holds no record for this share."""
        if not self._ahead:
            emitted = self._emit()
            if emitted is None:
                empty = self._emitted == 0
                self._start(self._epoch + 1)
                emitted = self._emit()
                if emitted is None or empty:
                    raise ValueError(
                        f"data: share {self.share} of {self.shares} reads no record in an epoch (fewer records or "
                        "shards than devices?)"
                    )
            self._ahead.append(emitted)
        return self._ahead[0]

    def take(self) -> tuple[Position, Record]:
        """The next record, taken."""
        self.peek()
        return self._ahead.popleft()

    def give_back(self, taken: list[tuple[Position, Record]]) -> None:
        """Hands back records taken last (in the order taken): they come next again."""
        self._ahead.extendleft(reversed(taken))

    def position(self) -> Position:
        """The position of the next record to take."""
        return self._ahead[0][0] if self._ahead else Position(self._epoch, self._emitted)
