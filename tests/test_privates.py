"""No module uses another module's private members (issue 11, item 7), benches included: a name with one
leading underscore is its own file's business. Read from the source with `ast`: every `something._name` whose
`_name` is defined in a different file of uform (as a function, class, method, module-level name or `self._name`
attribute), every `from uform... import _name`, and every import from another package's private module
(`from ..media._x import ...`; a package's own `from ._x import` is its business). Privates of other libraries (`torch._dynamo`, `os._exit`)
are theirs to judge and are not counted."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "uform"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """The private names a file defines: module-level and class-level names, functions and methods, and the
    attributes it assigns on `self` / `cls`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _private(node.target.id):
            names.add(node.target.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
            and _private(node.attr)
        ):
            names.add(node.attr)
    return names


def _sources() -> dict[pathlib.Path, ast.AST]:
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    return {path: ast.parse(path.read_text(encoding="utf-8"), str(path)) for path in files}


def test_no_module_reaches_into_another_modules_privates() -> None:
    sources = _sources()
    defined = {path: _defined(tree) for path, tree in sources.items() if path.is_relative_to(PACKAGE)}
    everywhere: dict[str, set[pathlib.Path]] = {}
    for path, names in defined.items():
        for name in names:
            everywhere.setdefault(name, set()).add(path)
    found = []
    for path, tree in sources.items():
        own = defined.get(path, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr in own or node.attr not in everywhere:
                    continue  # its own file's, or another library's
                owners = ", ".join(str(p.relative_to(ROOT)) for p in sorted(everywhere[node.attr]))
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)} (defined in {owners})")
            elif isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] == "uform"):
                hidden = [part for part in (node.module or "").split(".") if _private(part)]
                if hidden and (node.level == 0 or node.level > 1):  # a private module of another package
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports from private module {node.module}")
                for alias in node.names:
                    if _private(alias.name) and alias.name not in own:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {alias.name}")
    assert found == [], "private members used across files:\n" + "\n".join(found)
