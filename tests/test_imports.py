"""Text-only use never loads the media libraries, and decode workers never load torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import uform


def _loaded(code: str, modules: tuple[str, ...]) -> list[str]:
    probe = f"import sys\n{code}\nprint(','.join(m for m in {modules!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [m for m in result.stdout.strip().split(",") if m]


def test_a_text_trainer_does_not_import_media_libraries() -> None:
    code = "import uform\nuform.Trainer\nimport uform.data.batch, uform.media.decode"
    assert _loaded(code, ("av", "soundfile", "soxr", "PIL")) == []


def test_the_decode_pool_module_does_not_import_torch() -> None:
    assert _loaded("import uform.runtime.decoders, uform.media.decode", ("torch",)) == []


# --------------------------------------------------------------------------------------------------
# The import graph: no loop among uform's modules, counting the imports inside functions too


PACKAGE = Path(uform.__file__).resolve().parent

ALLOWED_LOCAL_IMPORTS = {
    ("uform.data.batch", "torch"): "a preparer process packs batches without torch; only the trainer's makes tensors",
    ("uform.media.decode", "uform.media.audio"): "optional heavy decoders load in the decode workers, on need",
    ("uform.media.decode", "uform.media.image"): "optional heavy decoders load in the decode workers, on need",
    ("uform.media.decode", "uform.media.video"): "optional heavy decoders load in the decode workers, on need",
    ("uform.demo", "pydoc_data.topics"): "the demo's text (a megabyte of CPython's docs) loads when a demo runs",
    ("uform.sources.shards", "fsspec"): "an optional extra, imported only for a URL",
    ("uform.sources.parquet", "pyarrow.parquet"): "an optional extra, imported only for a Parquet shard",
    ("uform.sources.sizes", "PIL"): "Pillow loads where an image header is read, never for text-only data",
    ("uform.tensorboard", "torch.utils.tensorboard"): "an optional extra, imported only where a run writes its board",
    ("uform.plotting", "matplotlib.backends.backend_agg"): "an optional extra, imported only by uform plot",
    ("uform.plotting", "matplotlib.figure"): "an optional extra, imported only by uform plot",
    ("uform.sources.sizes", "soundfile"): "libsndfile loads where an audio header is read, never for text or images",
    ("uform.sources.sizes", "uform.media.video"): "PyAV loads where a video header is read, never for other data",
    ("uform.embedding_writer", "pyarrow"): "an optional extra, imported only for a Parquet output",
    ("uform.embedding_writer", "pyarrow.parquet"): "an optional extra, imported only for a Parquet output",
    ("uform.onnx_encoder", "onnxruntime"): "the onnx extra, imported only where an ONNX graph is run",
    ("uform.cli", "uform.server"): "the serve extra (starlette, uvicorn) loads for `uform serve` alone",
    ("uform.device_pictures", "torchvision.io"): 'the GPU JPEG decoder, imported only where load(jpeg="device") asks',
    ("uform.model.attention", "torch._inductor.template_heuristics.triton"): (
        "inductor's heuristics, not public API: looked up only on Hopper, where 64-wide tiles need a backward config"
    ),
}
"""Every import inside a function of uform, with why it is there: a new one (one that dodges a loop, say) fails
`test_no_import_inside_a_function_but_the_listed_ones` until it is listed here with its reason. The lazy names
of `uform` and `uform.media` (PEP 562) go through `importlib.import_module`, which is no import statement."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> set[str]:
    """The modules an import statement of module `name` names (for `from x import y`: x, and x.y in case y
    is a module)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        anchor = base[: len(base) - node.level + 1]
        target = ".".join(anchor + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return {target} | {f"{target}.{alias.name}" for alias in node.names}


def _imports() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """uform's import graph (module -> the uform modules it imports, anywhere in its text: at the top, under
    TYPE_CHECKING, inside functions) and the (module, target) pairs of the imports inside functions."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    local: set[tuple[str, str]] = set()
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found: set[str] = set()
        inside: set[int] = set()  # ids of the import statements within a function's body
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inside.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _targets(node, name, path.name == "__init__.py")
                found |= targets
                if id(node) in inside:  # the module it names: x of `from x import y`, each x of `import x`
                    named = _targets(node, name, path.name == "__init__.py") if isinstance(node, ast.Import) else None
                    local |= {(name, t) for t in (named or {min(targets, key=len)})}
        # A module's own package (`from . import vocab` names uform itself) is no edge of the graph.
        graph[name] = {t for t in found if t in files and t != name and not name.startswith(t + ".")}
    return graph, local


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    loops: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return loops


def test_the_graph_check_finds_a_loop_it_is_shown() -> None:
    """The check itself: a loop through a function-local import is one."""
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _loops({"a": {"b"}, "b": set()}) == []


def test_no_import_loop_among_uform_modules() -> None:
    graph, _ = _imports()
    assert "uform.trainer" in graph and "uform.runtime.replicas" in graph["uform.trainer"]  # the graph is uform's
    assert _loops(graph) == []


def test_no_import_inside_a_function_but_the_listed_ones() -> None:
    _, local = _imports()
    assert sorted(local - set(ALLOWED_LOCAL_IMPORTS)) == []
    assert sorted(set(ALLOWED_LOCAL_IMPORTS) - local) == []  # a reason for an import that is gone: drop it


def test_the_runtime_layers_only_point_down() -> None:
    """executor -> workers (the worker processes) knows nothing above; the mesh nothing of the trainer."""
    graph, _ = _imports()
    assert graph["uform.runtime.workers"] & {"uform.runtime.executor", "uform.runtime.mesh", "uform.trainer"} == set()
    assert graph["uform.runtime.executor"] & {"uform.runtime.mesh", "uform.trainer"} == set()
    assert "uform.trainer" not in graph["uform.runtime.mesh"]


def test_the_replica_uses_only_the_world_of_the_runtime_and_the_runtime_no_face() -> None:
    """face -> runtime -> replica -> pure: a replica is handed its world and its prepare stage, so of the runtime it
    imports the world's collectives alone; the runtime imports nothing of the face."""
    graph, _ = _imports()
    face = {
        "uform",
        "uform.trainer",
        "uform.serve",
        "uform.evaluate",
        "uform.cli",
        "uform.demo",
        "uform.demo_shapes",
        "uform.__main__",
    }
    for name, targets in graph.items():
        if name.startswith("uform.replica."):
            runtime = {t for t in targets if t.startswith("uform.runtime.")}
            assert runtime <= {"uform.runtime.world"}, (name, runtime)
            assert not targets & face, name
        if name.startswith("uform.runtime."):
            assert not targets & face, (name, targets & face)
    assert "uform.runtime.world" in graph["uform.replica.replica"]  # the check sees the arrow that exists
