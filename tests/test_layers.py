"""The import layers hold: core (crossover/) <- glue (horovod_ext/) <- tools (benchmarks/, tests/).

Read from the source (AST, imports inside functions included), so a lazy import cannot hide a
dependency. The public re-export modules, crossover/__init__.py, crossover/tensorflow.py and crossover/elastic.py, are
the only files under crossover/ allowed to name horovod_ext (docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REEXPORTS = {"crossover/__init__.py", "crossover/tensorflow.py", "crossover/elastic.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in ("crossover", "horovod_ext"):
        for path in (REPO / pkg).rglob("*.py"):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_core_never_imports_horovod_or_the_glue():
    bad = []
    for module, path in _modules().items():
        rel = str(path.relative_to(REPO))
        if not rel.startswith("crossover/") or rel in REEXPORTS:
            continue
        for name in _imports(path, module):
            if name.split(".")[0] in ("horovod", "horovod_ext"):
                bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    mods = _modules()
    graph = {}
    for module, path in mods.items():
        deps = set()
        for name in _imports(path, module):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
        graph[module] = deps
    # a package's __init__ re-exporting its submodules is not a cycle of logic: drop package -> child edges
    for module, deps in graph.items():
        graph[module] = {d for d in deps if not d.startswith(module + ".")}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)
