"""The import graph of src/fedax follows docs/design.md: imports only go downward between
layers, and no two modules import each other, directly or through others. Lazy imports
inside functions count as well (they tie the layers just the same)."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
# Lowest first (docs/design.md, "Layers"); a layer may import only layers listed before it.
# A dotted name is a module that sits above the rest of its package. experiments, the
# driver of every engine, stands above runtime (the network engine), which builds from the
# spec and the builder below it.
LAYERS = ["_version", "_lazy", "io", "checkpoint", "federated", "data", "models", "client",
          "aggregators", "privacy", "algorithms", "attacks", "hyper", "simulation",
          "spec", "builder", "runtime", "experiments", "reproduce", "cli"]
SAME_LEVEL = [{"aggregators", "privacy"}]


def _modules() -> dict[str, pathlib.Path]:
    files = {}
    for path in (SRC / "fedax").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        files[name] = path
    return files


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:`` (annotations only: they never
    run, so they tie no modules at import time, though they still count as a layer's use)."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body for inner in ast.walk(stmt)}


def _imports(name: str, path: pathlib.Path, known: set[str], types: bool = True) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    skip = set() if types else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            candidates = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for candidate in candidates:
            if candidate in known and candidate != name:
                found.add(candidate)
                break
    return found


@pytest.fixture(scope="module")
def full_graph():
    files = _modules()
    return {m: _imports(m, p, set(files)) for m, p in files.items()}


@pytest.fixture(scope="module")
def graph(full_graph):
    # The package root loads its layers lazily (PEP 562) and is nobody's dependency.
    return {m: deps - {"fedax"} for m, deps in full_graph.items() if m != "fedax"}


def test_nothing_runs_back_up_through_the_package_face(full_graph):
    """No module imports ``fedax`` itself (``from fedax import __version__`` would load the
    package face, which exports every layer, from below): each imports what it needs from
    the module that defines it (``fedax._version``)."""
    assert sorted(m for m, deps in full_graph.items() if "fedax" in deps and m != "fedax") == []


def _layer(module: str) -> str:
    parts = module.split(".")[1:]
    dotted = ".".join(parts[:2])
    return dotted if dotted in LAYERS else parts[0]


def test_every_layer_is_known(graph):
    assert {_layer(m) for m in graph} - set(LAYERS) <= {"configs"}


def test_imports_only_go_down(graph):
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    for group in SAME_LEVEL:
        low = min(rank[g] for g in group)
        rank.update(dict.fromkeys(group, low))
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    if _layer(m) != _layer(d) and rank[_layer(d)] >= rank[_layer(m)])
    assert upward == []


@pytest.fixture(scope="module")
def runtime_graph():
    """The imports that run: without those under ``if TYPE_CHECKING:``."""
    files = _modules()
    return {m: _imports(m, p, set(files), types=False) - {"fedax"}
            for m, p in files.items() if m != "fedax"}


def test_no_module_cycles(runtime_graph):
    # A package importing its own children is not a cycle.
    edges = {m: {d for d in deps if not d.startswith(m + ".")}
             for m, deps in runtime_graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    assert cycles == []
