"""What the bench scripts share: their text corpus and the Joint run they time (a sibling module, not a package)."""

from __future__ import annotations

from typing import Any


def topic_text() -> bytes:
    """CPython's pydoc topics, whitespace collapsed: a corpus every Python installation ships."""
    import pydoc_data.topics

    return " ".join(" ".join(v.split()) for v in pydoc_data.topics.topics.values()).encode()


def joint_config(args: Any, *, batch: dict[str, Any] | None = None, **fields: Any) -> Any:
    """The `Objective.Joint` run of `args.depth` x `args.hidden` over `args.rows` x `args.columns` with
    `args.segments` segments (seed 42, a 10,000-step schedule), `batch` adding BatchShape fields and
    `fields` TrainerInitVramConfig ones."""
    import uform as u

    return u.TrainerInitVramConfig(
        depth=args.depth,
        hidden=args.hidden,
        objective=u.Objective.Joint,
        batch=u.BatchShape(
            max_rows_per_device=args.rows,
            max_segments_per_device=args.segments,
            max_columns_per_row=args.columns,
            **(batch or {}),
        ),
        schedule=u.Schedule(steps=10_000),
        seed=42,
        **fields,
    )
