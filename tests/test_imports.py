"""The import graph of evict/ (every import statement, at module or function level, read with ast): no cycle between
modules, and no layer importing a higher one (CPU, fast: no module is imported)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "evict"

# Lowest first. A module may import its own package and the packages of lower layers, nothing else: not a higher
# layer, and not another package of its own layer.
LAYERS = [
    # utilities (flag types, JSON, tables, devices, host -> device copies)
    {"cli_args", "jsonfile", "report", "plots", "distributed", "host_copy"},
    {"data"},  # corpora on disk: text, JSONL, parquet, datasets, token .bin files
    {"ops", "cache"},  # the memory op and the kernels; the decode cache, a data structure the layers fill
    {"layers", "stories"},  # model layers; the lesson's stories (ops on hand-made keys)
    {"models", "tasks"},  # the LM, its presets and sampling; the tasks
    {"hf", "convert"},  # interop with transformers / fla folders
    {"runfolder"},  # a run folder: its lock, its metrics file
    {"train", "finetune"},  # the one training loop; the weights a fine-tune starts from
    {"serve", "lab", "explore", "demo"},  # what is built on models and train
    {"bench"},  # benchmarks may time anything below them; nothing imports a benchmark
    {"commands"},  # `evict …` commands: flags and dispatch
    {"cli"},  # the console entry
    {"__main__"},
]
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = ("evict", *f.relative_to(ROOT).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The evict module that `import name` loads last (a function or class name resolves to its module)."""
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in mods else None


def import_graph() -> dict[str, set[str]]:
    """module -> the evict modules it imports. `from evict.p import m` with m a module is an edge to m (and not to
    evict.p, whose __init__ runs too but is counted where it imports)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                names = subs if len(subs) == len(node.names) else [base, *subs]
            else:
                continue
            edges |= {t for t in (_resolve(n, mods) for n in names if n.split(".")[0] == "evict") if t and t != mod}
        graph[mod] = edges
    return graph


def _package(mod: str) -> str:
    """evict.models.lm -> models; evict.cli -> cli; evict (the root, which re-exports LM, ModelConfig, presets) -> models."""
    return mod.split(".")[1] if "." in mod else "models"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


GRAPH = import_graph()


def test_the_graph_is_read():
    """The reader sees the imports it must (so the checks below cannot pass on an empty graph)."""
    assert "evict.models.lm" in GRAPH["evict.models"] and "evict.models.generate" in GRAPH["evict.models.lm"]
    assert "evict.commands.train" in GRAPH["evict.cli"] and "evict.train" in GRAPH["evict.commands.train"]
    assert "evict.ops.memory" in GRAPH["evict.stories"]  # `from evict.ops.memory import X`


def test_no_import_cycle():
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH) or [])


def test_every_package_has_a_layer():
    assert {_package(m) for m in GRAPH} <= set(LEVEL), sorted({_package(m) for m in GRAPH} - set(LEVEL))


def test_no_layer_imports_a_higher_one():
    bad = sorted(f"{a} -> {b}" for a, bs in GRAPH.items() for b in bs
                 if _package(a) != _package(b) and not LEVEL[_package(b)] < LEVEL[_package(a)])
    assert not bad, bad


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set(), "c": {"c2"}, "c2": {"c"}}, ["c", "c2", "c"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
])
def test_the_cycle_finder(graph, cycle):
    assert _cycle(graph) == cycle
