"""The run file: a TOML description of a training run (`[trainer]`, `[data]`, `[eval]`), read, checked and written
back.

`[trainer]` mirrors `TrainerInitVramConfig` field by field, its structs as nested tables (`[trainer.batch.image]`,
`[trainer.schedule]`, ...) and its enums as their lower-case words; it goes through `config.resolve()`, so a file
is refused by the same rules as the library call, each error naming the key path (`trainer.schedule.steps`).
Beside the struct's fields `[trainer]` takes `init_from`, the checkpoint whose weights a new run starts from
(`Trainer.init_vram(init_from=...)`); `resume`, `mesh` and `progress` belong to an invocation, not to a file.
`[data]` names the records (`train`, `held_out`) and maps their fields to modalities (`fields`); only its shape is
checked here, the readers (`uform.sources`) check what it names. `[eval]` mirrors `EvalConfig` key by key (when
and how the held-out records are scored, `uform.held_out`), checked against the trainer's table by `check_eval`.
`[log]` (`LogConfig`: the console, TensorBoard) and `[checkpoint]` (`CheckpointConfig`: how often a run saves,
which checkpoints it keeps) mirror their dataclasses key by key. Any other table is refused by name.

Relative local paths (`init_from`, `data.train`, `data.held_out`) are relative to the folder of the file that
names them, and are held joined to it, so that the `config.toml` a run writes elsewhere names the same files.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .config import TrainerInitVramConfig, resolve, to_dict

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "LogConfig",
    "RunConfig",
    "RunConfigError",
    "apply_overrides",
    "check_eval",
    "dump_run_config",
    "load_run_config",
    "read_run_config",
]


class RunConfigError(ValueError):
    """A run file (or a `--set` override) that breaks a rule; the message starts with the key path."""


@dataclass(frozen=True)
class DataConfig:
    """The `[data]` table: which records a run reads and how their fields map to modalities (shape checked)."""

    train: tuple[str, ...]
    """The training records: paths, globs, fsspec URLs or WebDataset brace ranges (`shards/{000..099}.tar`),
    as one string or a list in the file; relative local ones joined to the file's folder."""
    fields: tuple[tuple[str, str], ...] = ()
    """Each record field and the modality word it is read as (`("jpg", "image")`), in the file's order."""
    held_out: tuple[str, ...] = ()
    """Records kept for evaluation, written like `train`; empty holds none out."""


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """The `[log]` table: what a run shows while it runs (`metrics.jsonl` is always written)."""

    every: int = 25
    """Steps between two plain console lines when the stream is not a terminal (a terminal gets a progress bar);
    the last step of a call always has one."""
    tensorboard: bool | None = None
    """TensorBoard scalars in `DIR/tensorboard`: True writes them (refused at the start when the `tensorboard`
    package is missing), False never, None (the key left out) writes them when the package is installed."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"log.every: expected a positive int (steps between console lines), got {self.every!r}")
        if self.tensorboard is not None and not isinstance(self.tensorboard, bool):
            raise ValueError(
                f"log.tensorboard: expected true or false (or no key: when installed), got {self.tensorboard!r}"
            )


MODES = ("max", "min")
_MORE_IS_BETTER = ("recall", "mrr", "ndcg", "accuracy", "precision", "map")
_LESS_IS_BETTER = ("loss", "kl", "error", "perplexity")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The `[checkpoint]` table: when a run saves and which of its checkpoints it keeps (`uform.rotation`).

    A call of `fit` always saves at its last step (the schedule's end, `stop_after`, a signal); `every` adds a save
    each `every` steps. After each save the folder keeps the `keep_last` newest checkpoints and, with `best`, the
    one whose evaluation scored best; others are deleted, and only once the new one is whole on disk."""

    every: int = 0
    """Steps between two saves; 0 saves only at the end of each call."""
    keep_last: int = 0
    """The newest checkpoints kept; 0 keeps every one."""
    best: str | None = None
    """An evaluation result's name (`"eval/text->image/recall@10"`): the checkpoint of the step that scored best by
    it is kept too, and a step that scores a new best is saved."""
    mode: str | None = None
    """"max" or "min": whether more of `best` is better; left out, it is told from the name (recall, mrr, ndcg,
    accuracy: max; loss, kl, error: min). None where `best` is None."""

    def __post_init__(self) -> None:
        for name in ("every", "keep_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"checkpoint.{name}: expected a non-negative int, got {value!r}")
        if self.best is None:
            if self.mode is not None:
                raise ValueError(f"checkpoint.mode: {self.mode!r} needs checkpoint.best (the result it orders by)")
            return
        if not isinstance(self.best, str) or not self.best:
            raise ValueError(f"checkpoint.best: expected an evaluation result's name, got {self.best!r}")
        if self.mode is None:
            object.__setattr__(self, "mode", _mode_of(self.best))
        elif self.mode not in MODES:
            raise ValueError(f"checkpoint.mode: expected 'max' or 'min', got {self.mode!r}")


def _mode_of(name: str) -> str:
    """Whether more of the result `name` is better, from its last part (`recall@10` of `eval/text->image/recall@10`)."""
    last = name.rsplit("/", 1)[-1].lower()
    if any(word in last for word in _LESS_IS_BETTER):
        return "min"
    if any(word in last for word in _MORE_IS_BETTER):
        return "max"
    raise ValueError(f'checkpoint.mode: cannot tell from {name!r} whether more is better; set mode = "max" or "min"')


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The `[eval]` table: when a run scores its held-out records (`[data] held_out`) and at what
    (`uform.held_out.HeldOut`); checked against the run's trainer by `check_eval`."""

    every: int = 0
    """Steps between two evaluations (at steps `every`, `2 every`, ...); the last step of every `fit` call is
    evaluated too. 0: only after the last step."""
    records: int = 1024
    """The most held-out records read (in the source's order, once, when the run starts)."""
    widths: Sequence[int] = ()
    """The Matryoshka widths pooled retrieval is scored at; empty: the run's `contrastive.matryoshka_dimensions`
    and the full `hidden`."""
    batch: int = 0
    """Items one forward of the retrieval and choice scoring carries at most; 0: the run's
    `batch.max_segments_per_device` (the masked terms take steps of one device's room, as training does)."""


@dataclass(frozen=True)
class RunConfig:
    """A run file, checked: the resolved trainer config, the weights it starts from, and its data."""

    trainer: TrainerInitVramConfig
    """The `[trainer]` table, resolved (`config.resolve`); its `resume`, `mesh` and `progress` are None."""
    init_from: str | None = None
    """`trainer.init_from`: the checkpoint whose tower a new run starts from; None starts from the seed."""
    data: DataConfig | None = None
    """The `[data]` table; None where the file has none (the library call passes its records itself)."""
    log: LogConfig = dataclasses.field(default_factory=LogConfig, kw_only=True)
    """The `[log]` table."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig, kw_only=True)
    """The `[checkpoint]` table."""

    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig, kw_only=True)
    """The `[eval]` table (its defaults where the file has none)."""

    def __post_init__(self) -> None:
        if not isinstance(self.eval, EvalConfig):
            raise TypeError(f"eval: expected an EvalConfig, got {type(self.eval).__name__}")
        if not isinstance(self.log, LogConfig):
            raise TypeError(f"log: expected a LogConfig, got {type(self.log).__name__}")
        if not isinstance(self.checkpoint, CheckpointConfig):
            raise TypeError(f"checkpoint: expected a CheckpointConfig, got {type(self.checkpoint).__name__}")


def check_eval(config: EvalConfig, trainer: TrainerInitVramConfig) -> EvalConfig:
    """`config` checked against the resolved `trainer` and with its derived values filled in (`widths` from the
    run's Matryoshka dimensions); `RunConfigError` naming the key path (`eval.widths[1]`) and the rule."""
    if not isinstance(config, EvalConfig):
        raise TypeError(f"eval: expected an EvalConfig, got {type(config).__name__}")
    for key in ("every", "records", "batch"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise RunConfigError(f"eval.{key}: expected an int, got {_shown(value)}")
        least = 1 if key == "records" else 0
        if value < least:
            rule = "must be positive" if least else "must not be negative"
            raise RunConfigError(f"eval.{key}: {rule}, got {value}")
    if isinstance(config.widths, (str, bytes)) or not isinstance(config.widths, Sequence):
        raise RunConfigError(f"eval.widths: expected an array of ints, got {_shown(config.widths)}")
    for i, width in enumerate(config.widths):
        if isinstance(width, bool) or not isinstance(width, int):
            raise RunConfigError(f"eval.widths[{i}]: expected an int, got {_shown(width)}")
        if not 1 <= width <= trainer.hidden:
            raise RunConfigError(f"eval.widths[{i}]: must lie in [1, trainer.hidden = {trainer.hidden}], got {width}")
        if width in config.widths[:i]:
            raise RunConfigError(f"eval.widths[{i}]: {width} is named twice")
    widths = tuple(config.widths) or tuple(sorted({*trainer.contrastive.matryoshka_dimensions, trainer.hidden}))
    return dataclasses.replace(config, widths=widths)


# --------------------------------------------------------------------------------------------------
# Reading


_INVOCATION_KEYS = {
    "resume": "a run resumes from the command line (--resume PATH|latest), not from its file",
    "mesh": "a mesh is made by the process that runs (--devices, torchrun), not named in a file",
    "progress": "a progress callback is a library argument, not a file key",
}
_DATA_KEYS = ("train", "fields", "held_out")
_TOP_KEYS = ("trainer", "data", "eval", "log", "checkpoint")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def read_run_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> RunConfig:
    """The run file at `path`, with `overrides` (`["trainer.schedule.steps=500", ...]`) laid over it, checked;
    raises `RunConfigError` naming the key path and the rule, or `OSError` where the file cannot be read."""
    shown = os.fspath(path)
    with open(shown, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RunConfigError(f"{shown}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    return load_run_config(text, overrides, base=os.path.dirname(os.path.abspath(shown)), source=shown)


def load_run_config(
    text: str, overrides: Sequence[str] = (), *, base: str | None = None, source: str = "config"
) -> RunConfig:
    """The run file `text`, with `overrides` laid over it, checked (see `read_run_config`). The file's relative
    local paths are joined to `base` where given (kept as written otherwise); an override's are kept as written,
    relative to the current folder as any path on a command line. `source` names the text in a TOML syntax error."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise RunConfigError(f"{source}: not valid TOML ({error})") from None
    return _build(apply_overrides(_rebased(table, base), overrides))


def apply_overrides(table: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of a parsed run file's `table` with each `KEY=VALUE` of `overrides` laid over it, in order.

    KEY is a dotted path of bare keys (`trainer.batch.image.patch_side`); VALUE is parsed as a TOML value
    (`500`, `1e-4`, `true`, `[64, 128]`, `"text"`), and where it is not one it is taken as a plain string
    (`contrastive`, `shards/{000..009}.tar`), which a number's or a bool's key then refuses by name. Missing
    tables on the path are created; the keys themselves are checked when the table is read.
    """
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Sequence):
        raise TypeError(f"overrides: expected a sequence of 'KEY=VALUE' strings, got {type(overrides).__name__}")
    out = _copy_tables(table)
    for entry in overrides:
        if not isinstance(entry, str):
            raise TypeError(f"overrides: expected 'KEY=VALUE' strings, got {type(entry).__name__}")
        key, sep, value = entry.partition("=")
        key = key.strip()
        if not sep:
            raise RunConfigError(f"--set {entry}: expected KEY=VALUE (trainer.schedule.steps=500)")
        parts = key.split(".")
        if not all(_BARE_KEY.fullmatch(p) for p in parts):
            raise RunConfigError(f"--set {entry}: {key!r} is not a dotted path of bare keys (trainer.schedule.steps)")
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RunConfigError(f"{'.'.join(parts[: depth + 1])}: not a table, so {key} cannot be set")
            node = child
        node[parts[-1]] = _override_value(value.strip())
    return out


def _override_value(text: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _copy_tables(value: Any) -> Any:
    return {k: _copy_tables(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def _rebased(table: dict[str, Any], base: str | None) -> dict[str, Any]:
    """A copy of the parsed file with its relative local paths joined to `base`; values of the wrong type are left
    for `_build` to refuse by key path."""
    out = _copy_tables(table)
    if base is None:
        return out
    trainer, data = out.get("trainer"), out.get("data")
    if isinstance(trainer, dict) and isinstance(trainer.get("init_from"), str):
        trainer["init_from"] = _path(trainer["init_from"], base)
    for key in ("train", "held_out"):
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, str):
            data[key] = _path(value, base)  # type: ignore[index]
        elif isinstance(value, list):
            data[key] = [_path(v, base) if isinstance(v, str) else v for v in value]  # type: ignore[index]
    return out


def _build(table: dict[str, Any]) -> RunConfig:
    for key, value in table.items():
        if key not in _TOP_KEYS:
            fields = {f.name for f in dataclasses.fields(TrainerInitVramConfig)} | {"init_from"}
            hint = f"trainer.{key}" if key in fields else _suggest(key, _TOP_KEYS, "")
            raise RunConfigError(f"{key}: unknown key ({_hint(hint, _TOP_KEYS)})")
        if not isinstance(value, dict):
            raise RunConfigError(f"{key}: expected a table ([{key}]), got {_shown(value)}")
    if "trainer" not in table:
        raise RunConfigError("trainer: missing; a run file needs a [trainer] table (depth, hidden, batch, schedule)")
    trainer = dict(table["trainer"])
    init_from = trainer.pop("init_from", None)
    if init_from is not None:
        init_from = _string(init_from, "trainer.init_from")
    for key, why in _INVOCATION_KEYS.items():
        if key in trainer:
            raise RunConfigError(f"trainer.{key}: not a run file key ({why})")
    config = _struct(TrainerInitVramConfig, trainer, "trainer")
    try:
        resolved = resolve(config)
    except (ValueError, TypeError) as error:
        raise RunConfigError(f"trainer.{error}") from None
    data = None if "data" not in table else _data(table["data"])
    log = _keyed(LogConfig, table.get("log", {}), "log", {"every": int, "tensorboard": bool})
    checkpoint = _keyed(
        CheckpointConfig,
        table.get("checkpoint", {}),
        "checkpoint",
        {"every": int, "keep_last": int, "best": str, "mode": str},
    )
    evaluation = EvalConfig()
    if "eval" in table:
        evaluation = _struct(EvalConfig, table["eval"], "eval")
        check_eval(evaluation, resolved)  # checked, kept as written (empty widths stay derived)
    return RunConfig(trainer=resolved, init_from=init_from, data=data, eval=evaluation, log=log, checkpoint=checkpoint)


def _keyed(kind: type, table: dict[str, Any], prefix: str, types: dict[str, type]) -> Any:
    """A small table's dataclass, each key known and of its TOML type, then the dataclass's own checks."""
    for key, value in table.items():
        if key not in types:
            known = list(types)
            raise RunConfigError(
                f"{prefix}.{key}: unknown key ({_hint(_suggest(key, known, prefix + '.'), known, prefix)})"
            )
        want = types[key]
        if (want is int and (isinstance(value, bool) or not isinstance(value, int))) or not isinstance(value, want):
            word = {int: "an int", bool: "true or false", str: "a string"}[want]
            raise RunConfigError(f"{prefix}.{key}: expected {word}, got {_shown(value)}")
    try:
        return kind(**table)
    except ValueError as error:
        raise RunConfigError(str(error)) from None


def _struct(kind: type, values: dict[str, Any], prefix: str) -> Any:
    """The dataclass `kind` from its TOML table, every key known and every value of its field's type."""
    hints = typing.get_type_hints(kind)
    known = [
        f.name for f in dataclasses.fields(kind) if not (kind is TrainerInitVramConfig and f.name in _INVOCATION_KEYS)
    ]
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}.{key}"
        if key not in known:
            extra = ["init_from"] if kind is TrainerInitVramConfig else []
            raise RunConfigError(
                f"{path}: unknown key ({_hint(_suggest(key, known + extra, prefix + '.'), known, prefix)})"
            )
        kwargs[key] = _value(hints[key], value, path)
    return kind(**kwargs)


def _value(hint: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise RunConfigError(f"{path}: expected a table ([{path}]), got {_shown(value)}")
        return _struct(typing.cast(type, hint), value, path)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if not isinstance(value, str):
            raise RunConfigError(f"{path}: expected one of the words {hint.words()}, got {_shown(value)}")  # type: ignore[attr-defined]
        try:
            return hint.parse(value, path)  # type: ignore[attr-defined]
        except ValueError as error:
            raise RunConfigError(str(error)) from None
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RunConfigError(f"{path}: expected an int, got {_shown(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RunConfigError(f"{path}: expected a number, got {_shown(value)}")
        return float(value)
    if typing.get_origin(hint) is Sequence and typing.get_args(hint) == (int,):
        if not isinstance(value, list):
            raise RunConfigError(f"{path}: expected an array of ints, got {_shown(value)}")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int):
                raise RunConfigError(f"{path}[{i}]: expected an int, got {_shown(item)}")
        return tuple(value)
    raise RunConfigError(f"{path}: not a run file key")  # a field of a type no file spells (none today)


def _data(table: dict[str, Any]) -> DataConfig:
    for key in table:
        if key not in _DATA_KEYS:
            raise RunConfigError(
                f"data.{key}: unknown key ({_hint(_suggest(key, _DATA_KEYS, 'data.'), _DATA_KEYS, 'data')})"
            )
    if "train" not in table:
        raise RunConfigError("data.train: missing; [data] names its training records (a path, a glob or a list)")
    train = _paths(table["train"], "data.train")
    if not train:
        raise RunConfigError("data.train: an empty list names no records")
    held_out = _paths(table.get("held_out", []), "data.held_out")
    fields = table.get("fields", {})
    if not isinstance(fields, dict):
        raise RunConfigError(f'data.fields: expected a table ({{ jpg = "image", txt = "text" }}), got {_shown(fields)}')
    pairs = tuple((name, _string(role, f"data.fields.{name}")) for name, role in fields.items())
    return DataConfig(train=train, fields=pairs, held_out=held_out)


def _paths(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (_string(value, path),)
    if not isinstance(value, list):
        raise RunConfigError(f"{path}: expected a string or an array of strings, got {_shown(value)}")
    return tuple(_string(v, f"{path}[{i}]") for i, v in enumerate(value))


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise RunConfigError(f"{path}: expected a string, got {_shown(value)}")
    if not value:
        raise RunConfigError(f"{path}: must not be empty")
    return value


def _path(text: str, base: str) -> str:
    if not text or "://" in text or os.path.isabs(text):
        return text
    return os.path.join(base, text)


def _suggest(key: str, known: Sequence[str], prefix: str) -> str | None:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"{prefix}{close[0]}" if close else None


def _hint(suggestion: str | None, known: Sequence[str], prefix: str = "") -> str:
    if suggestion is not None:
        return f"did you mean {suggestion}?"
    where = f"{prefix}: " if prefix else ""
    return f"{where}known keys are {', '.join(known)}"


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


# --------------------------------------------------------------------------------------------------
# Writing: a TOML writer for the values a run file holds (tables, strings, ints, floats, bools, arrays)


def dump_run_config(config: RunConfig) -> str:
    """`config` as a run file that `load_run_config` reads back to an equal `RunConfig` (the trainer table
    resolved, every derived value written out)."""
    if not isinstance(config, RunConfig):
        raise TypeError(f"config: expected a RunConfig, got {type(config).__name__}")
    trainer: dict[str, Any] = {}
    if config.init_from is not None:
        trainer["init_from"] = config.init_from
    trainer.update(to_dict(config.trainer))
    table: dict[str, Any] = {"trainer": trainer}
    if config.data is not None:
        data: dict[str, Any] = {"train": list(config.data.train)}
        if config.data.held_out:
            data["held_out"] = list(config.data.held_out)
        data["fields"] = dict(config.data.fields)
        table["data"] = data
    if config.eval != EvalConfig() or (config.data is not None and config.data.held_out):
        table["eval"] = {f.name: getattr(config.eval, f.name) for f in dataclasses.fields(EvalConfig)}
    table["log"] = {k: v for k, v in dataclasses.asdict(config.log).items() if v is not None}
    table["checkpoint"] = {k: v for k, v in dataclasses.asdict(config.checkpoint).items() if v is not None}
    lines: list[str] = []
    _write_table(table, (), lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _write_table(table: Mapping[str, Any], path: tuple[str, ...], lines: list[str]) -> None:
    plain = [(k, v) for k, v in table.items() if not isinstance(v, Mapping)]
    nested = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    if path and (plain or not nested):
        lines.append("")
        lines.append(f"[{'.'.join(_key(p) for p in path)}]")
    for key, value in plain:
        lines.append(f"{_key(key)} = {_toml_value(value, '.'.join((*path, key)))}")
    for key, value in nested:
        _write_table(value, (*path, key), lines)


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_value(value: Any, path: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: {value} has no place in a run file")
        return repr(value)  # the shortest text that reads back to the same double
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, f"{path}[{i}]") for i, v in enumerate(value)) + "]"
    raise TypeError(f"{path}: a {type(value).__name__} has no TOML form here")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped (DEL too, which TOML bars)."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
