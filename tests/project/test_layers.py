"""The import layers hold: core (crossover/) <- glue (horovod_ext/) <- tools (benchmarks/, tests/).

Read from the source (AST, imports inside functions and `importlib.import_module("literal")` included),
so a lazy import cannot hide a dependency. The public re-export modules, crossover/__init__.py,
crossover/tensorflow.py and crossover/elastic.py, are the only files under crossover/ allowed to name
horovod or horovod_ext, and the glue never imports them back (docs/architecture.md). The lazy ones
(crossover/__init__.py, crossover/elastic.py) import nothing heavy until a name is used.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REEXPORTS = {"crossover/__init__.py", "crossover/tensorflow.py", "crossover/elastic.py"}
LAZY_REEXPORTS = {"crossover/__init__.py", "crossover/elastic.py"}
PUBLIC_MODULES = {"crossover", "crossover.tensorflow", "crossover.elastic"}  # the modules of REEXPORTS
HEAVY = ("horovod", "horovod_ext", "torch", "tensorflow")


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


def _dynamic_import(node: ast.AST) -> str | None:
    """The module named by `importlib.import_module("x")` / `__import__("x")` with a literal name."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func, arg = node.func, node.args[0]
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))
    if named and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def _imports(path: Path, module: str, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if (dynamic := _dynamic_import(node)) is not None:
            names.add(dynamic)
        elif isinstance(node, ast.Import):
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


def _resolve(name: str, mods: dict[str, Path]) -> str:
    """The module of `mods` an imported name lives in ("" when outside the repository's packages)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name


def test_glue_never_imports_the_public_face():
    """horovod_ext/ uses the core's own modules, never crossover/__init__.py, tensorflow.py or elastic.py."""
    mods = _modules()
    bad = []
    for module, path in mods.items():
        if not module.startswith("horovod_ext"):
            continue
        for name in _imports(path, module):
            if _resolve(name, mods) in PUBLIC_MODULES:
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_lazy_reexports_import_nothing_heavy_at_import():
    """crossover/__init__.py and crossover/elastic.py reach the glue only inside their __getattr__."""
    bad = []
    for rel in sorted(LAZY_REEXPORTS):
        path = REPO / rel
        module = ".".join(Path(rel).with_suffix("").parts).removesuffix(".__init__")
        for name in _imports(path, module, top_level_only=True):
            if name.split(".")[0] in HEAVY:
                bad.append(f"{rel} imports {name} at import time")
    assert not bad, "\n".join(bad)


def test_lazy_reexports_are_cheap_silent_and_resolve():
    """In a fresh interpreter: importing them loads no framework and prints nothing; the names resolve."""
    code = (
        "import sys\n"
        "import crossover, crossover.elastic\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "assert not heavy, heavy\n"
        "from crossover.elastic import TorchState\n"
        "from horovod_ext import torch_elastic\n"
        "assert crossover.elastic.TorchState is TorchState is torch_elastic.TorchState\n"
        "assert crossover.elastic.CompressionStateHandler is torch_elastic.CompressionStateHandler\n"
        "try:\n"
        "    crossover.elastic.Nope\n"
        "except AttributeError as exc:\n"
        "    assert 'Nope' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    head = subprocess.run([sys.executable, "-c", "import crossover, crossover.elastic"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert head.returncode == 0 and head.stdout == "" and head.stderr == "", head
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_compression_never_imports_adaptive():
    """The kernels layer (crossover/compression/) does not depend on the layer that drives it."""
    bad = []
    for module, path in _modules().items():
        if not module.startswith("crossover.compression"):
            continue
        for name in _imports(path, module):
            if name == "crossover.adaptive" or name.startswith("crossover.adaptive."):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    mods = _modules()
    graph = {}
    for module, path in mods.items():
        deps = set()
        for name in _imports(path, module):
            name = _resolve(name, mods)
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
