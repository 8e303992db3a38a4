"""Token ids of the tower's input: a byte per text token (0..255) and the special ids above them.

Every segment opens with a prefix: its modality marker, then (where late interaction is on) its side
marker. `MASK` stands in for a corrupted byte and is the state a choice reads; `PAD` fills the end of a
row and belongs to no segment.
"""

from __future__ import annotations

from .enums import LateInteractionSide, Modality

BYTES = 256
"""Byte values 0..255: the text tokens and the masked text head's classes."""
MASK = 256
PAD = 257
MODALITY_MARKER = {Modality.Text: 258, Modality.Image: 259, Modality.Video: 260, Modality.Audio: 261}
SIDE_MARKER = {
    LateInteractionSide.None_: 262,
    LateInteractionSide.Query: 263,
    LateInteractionSide.Document: 264,
    LateInteractionSide.QueryAndDocument: 265,
}
VOCAB = 272
"""The embedding table's rows: 266 ids in use, rounded up to a multiple of 16."""


def prefix(modality: Modality, side: LateInteractionSide | None) -> list[int]:
    """The prefix ids of a segment: its modality marker, then its side marker when `side` is given."""
    ids = [MODALITY_MARKER[modality]]
    if side is not None:
        ids.append(SIDE_MARKER[side])
    return ids
