"""The field mapping: which field of a record is which modality and role, and one record read into its
items (the record convention, README "Train on your own data").

A mapping is a plain dict, field name to role word:

- `"text"`, `"image"`, `"video"`, `"audio"`: the record's positives, items that attract each other;
- `"negative:<modality>"`: named negatives, items that repel every positive of the record (and it them);
- `"query:<modality>"`, `"document:<modality>"`: positives with a late-interaction side;
- `"group"`: the temperature group of every item of the record (an int);
- `"choices"` and `"targets"`: the legal bytes the record's one text positive chooses from (a str) and
  their target probabilities (a list of numbers, or its JSON in a CSV cell or a tar member);
- `"id"`: the record's id, named in messages; `"ignore"`: a field read and left alone.

A field the mapping does not name is an error naming the field and the record (no silent wrong answer).
A list value gives one item per element (several captions, several negatives).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..enums import LateInteractionSide, Modality
from .record import KEY, Missing, Record, record_id

MODALITIES = {"text": Modality.Text, "image": Modality.Image, "video": Modality.Video, "audio": Modality.Audio}
KINDS = {"": "positive", "negative": "negative", "query": "query", "document": "document"}
SCALARS = ("group", "choices", "targets", "id", "ignore")
INTERNAL = frozenset({KEY, "__url__", "__local_path__"})
"""Fields readers and webdataset's tools add, never an error."""


@dataclass(frozen=True)
class Role:
    """What one field gives: an item of `modality` as `kind` ("positive", "negative", "query",
    "document"), or a record-wide value (`scalar`: "group", "choices", "targets", "id", "ignore")."""

    kind: str
    modality: Modality | None = None


def parse_role(name: str, word: Any) -> Role:
    """The `Role` of mapping entry `name = word`; `ValueError` naming the field for a word it is not."""
    if not isinstance(word, str):
        raise TypeError(f"fields.{name}: expected a role word (a str), got {type(word).__name__}")
    if word in SCALARS:
        return Role(word)
    prefix, colon, modality = word.rpartition(":")
    if modality in MODALITIES and (not colon or prefix in KINDS):
        return Role(KINDS[prefix], MODALITIES[modality])
    raise ValueError(
        f"fields.{name}: {word!r} is no role; expected one of {sorted(MODALITIES)}, negative:/query:/document: "
        f"before a modality, or one of {list(SCALARS)}"
    )


@dataclass
class Fields:
    """A checked field mapping (see the module's docstring)."""

    roles: dict[str, Role]

    @classmethod
    def parse(cls, mapping: Mapping[str, Any]) -> Fields:
        """Checks `mapping`; `ValueError` naming the field for a bad role, or for a mapping naming no item."""
        if not isinstance(mapping, Mapping):
            raise TypeError(f"fields: expected a mapping of field names to roles, got {type(mapping).__name__}")
        roles = {str(name): parse_role(str(name), word) for name, word in mapping.items()}
        if not any(r.modality is not None for r in roles.values()):
            raise ValueError("fields: the mapping names no item field (text, image, video or audio)")
        if ("choices" in {r.kind for r in roles.values()}) != ("targets" in {r.kind for r in roles.values()}):
            raise ValueError("fields: choices and targets come together; the mapping names only one")
        return cls(roles)

    @property
    def media(self) -> frozenset[str]:
        """The fields holding media (a manifest's paths to read)."""
        return frozenset(n for n, r in self.roles.items() if r.modality not in (None, Modality.Text))

    @property
    def late(self) -> bool:
        """Whether the mapping gives late-interaction sides."""
        return any(r.kind in ("query", "document") for r in self.roles.values())


@dataclass
class RecordItems:
    """One record's items, as the loader packs them: a bag."""

    id: str
    modalities: list[Modality] = field(default_factory=list)
    contents: list[bytes] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    """Each item's kind: "positive", "negative", "query" or "document"."""
    group: int = 0
    choices: bytes = b""
    """The legal bytes the record's text positive offers (empty: none)."""
    targets: list[float] = field(default_factory=list)
    missing: str | None = None
    """The first missing file a media field named; such a record is skipped."""
    lengths: list[int] | None = None
    """Each item's length in positions, once the loader measured it (`sizes.item_length`)."""

    @property
    def sides(self) -> list[LateInteractionSide]:
        """Each item's late-interaction side: Query, Document, or None_ for every other kind."""
        side = {"query": LateInteractionSide.Query, "document": LateInteractionSide.Document}
        return [side.get(k, LateInteractionSide.None_) for k in self.kinds]

    @property
    def chooser(self) -> int:
        """The item that makes the record's choice (its one text positive), or -1 without choices."""
        if not self.choices:
            return -1
        texts = [
            i
            for i, (m, k) in enumerate(zip(self.modalities, self.kinds, strict=True))
            if m == Modality.Text and k != "negative"
        ]
        if len(texts) != 1:
            raise ValueError(f"record {self.id}: choices need exactly one text positive to make them, got {len(texts)}")
        return texts[0]


def _content(value: Any, name: str, record: Record, modality: Modality) -> bytes:
    if isinstance(value, dict) and isinstance(value.get("bytes"), bytes):  # a `datasets` Image(decode=False) cell
        value = value["bytes"]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) and modality == Modality.Text:
        return value.encode("utf-8")
    raise TypeError(
        f"record {record_id(record)}: field {name!r} ({modality.name.lower()}) expected bytes"
        f"{' or str' if modality == Modality.Text else ''}, got {type(value).__name__}"
    )


def _scalar_text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else value


def read_record(record: Record, fields: Fields) -> RecordItems:
    """`record`'s items by `fields`. `ValueError` names the record and the field for a field the mapping
    does not name, a bad group, choices or targets; a record whose media file is missing answers with
    `missing` set (the loader skips it)."""
    rid = record_id(record)
    for name, role in fields.roles.items():
        if role.kind == "id" and name in record:
            rid = str(_scalar_text(record[name]))
    for name in record:
        if name not in fields.roles and name not in INTERNAL:
            raise ValueError(
                f'record {rid}: field {name!r} is not in the field mapping; map it to a role, or to "ignore"'
            )
    out = RecordItems(id=rid)
    for name, role in fields.roles.items():
        if name not in record:
            continue
        value = record[name]
        if role.modality is not None:
            for element in value if isinstance(value, list) else [value]:
                if isinstance(element, Missing):
                    out.missing = out.missing or element.path
                    continue
                out.modalities.append(role.modality)
                out.contents.append(_content(element, name, record, role.modality))
                out.kinds.append(role.kind)
        elif role.kind == "group":
            try:
                out.group = int(_scalar_text(value))
            except (TypeError, ValueError):
                raise ValueError(f"record {rid}: field {name!r} (group) must be an int, got {value!r}") from None
            if out.group < 0:
                raise ValueError(f"record {rid}: field {name!r} (group) must not be negative, got {out.group}")
        elif role.kind == "choices":
            text = _scalar_text(value)
            out.choices = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        elif role.kind == "targets":
            text = _scalar_text(value)
            try:
                targets = json.loads(text) if isinstance(text, str) else text
                out.targets = [float(t) for t in targets]
            except (TypeError, ValueError):
                raise ValueError(
                    f"record {rid}: field {name!r} (targets) must be a list of numbers, got {value!r}"
                ) from None
    if len(out.targets) != len(out.choices):
        raise ValueError(
            f"record {rid}: {len(out.choices)} choices but {len(out.targets)} targets; each choice needs its target"
        )
    return out
