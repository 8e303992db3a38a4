"""The layering of docs/architecture.md, read from the source with `ast`: the pure layers import nothing above
them, and the page names every module file of the package (so neither can drift from the code)."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "uform"
PAGE = ROOT / "docs" / "architecture.md"

# The pure layers, lowest first (docs/architecture.md, "Layers"). A module may import its own layer and the
# layers listed as beneath it, nothing else of uform: not the replica, the runtime or the face.
VOCABULARY = {
    "uform.enums",
    "uform.notices",
    "uform.vocab",
    "uform.config",
    "uform.relations",
    "uform.arena",
    "uform.run_config",
}
BENEATH = {
    "vocabulary": set(),
    "media": {"vocabulary"},
    "losses": {"vocabulary"},
    "data": {"vocabulary", "media"},
    "model": {"vocabulary", "media", "data", "losses"},
    "sources": {"vocabulary", "media", "data"},
}
# `uform/runtime/decoders.py` is the decode pool, a process runtime that lives in the media folder today; it is
# runtime, not media (docs/architecture.md, "Known violations").
RUNTIME_IN_PURE_FOLDERS = {"uform.runtime.decoders"}
# Imports from a pure layer upward that exist today, each named in docs/architecture.md ("Known violations").
# One that disappears must leave this list (and the page) too, so the list stays exact.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The uform modules `name` imports anywhere in its file: at module level, under `TYPE_CHECKING` or
    inside a function (an import dodging a loop is still an arrow)."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from uform import vocab` is an arrow to uform.vocab; `from uform import Trainer` one to uform.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import uform.media.units as u`, `uform.x.name`
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer(name: str) -> str | None:
    """The pure layer a module belongs to, or None for the replica, the runtime and the face."""
    if name in VOCABULARY:
        return "vocabulary"
    if name in RUNTIME_IN_PURE_FOLDERS:
        return None
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in BENEATH and parts[1] != "vocabulary":
        return parts[1]
    return None


def test_the_import_parser_sees_every_kind_of_import() -> None:
    # The parser itself, on arrows known to exist: relative, function-local, `from .. import module`.
    assert "uform.runtime.workers" in imports("uform.runtime.executor")  # function-local today
    assert "uform.vocab" in imports("uform.data.pack")  # `from .. import vocab`
    assert "uform.media.units" in imports("uform.data.batch")
    assert "uform.runtime.child" in imports("uform.runtime.decoders")  # at module level (relative)
    assert "uform" not in imports("uform.data.pack")  # `from .. import vocab` names no package-level name


def test_the_pure_layers_import_nothing_above_them() -> None:
    pure = {name: layer(name) for name in MODULES if layer(name)}
    assert set(BENEATH) == set(pure.values())  # every layer is populated
    upward = set()
    for name, own in pure.items():
        allowed = BENEATH[own] | {own}
        for target in imports(name):
            if layer(target) not in allowed:
                upward.add((name, target))
    assert upward - KNOWN_VIOLATIONS == set(), "a pure layer imports above itself (docs/architecture.md)"
    assert KNOWN_VIOLATIONS - upward == set(), "a known violation is gone: drop it here and from the page"


def test_the_page_names_every_module_file_and_only_those() -> None:
    text = PAGE.read_text(encoding="utf-8")
    files = {str(path.relative_to(ROOT)) for path in MODULES.values()}
    named = set(re.findall(r"uform/[\w/]+\.py", text))
    assert files - named == set(), "docs/architecture.md does not name these module files"
    assert named - files == set(), "docs/architecture.md names files that do not exist"


def test_the_page_names_each_known_violation() -> None:
    text = PAGE.read_text(encoding="utf-8")
    for source, target in KNOWN_VIOLATIONS:
        assert f"`{source}` -> `{target}`" in text
