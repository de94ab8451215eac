"""What `pip install .` puts into site-packages: crossover, horovod_ext and the tools as crossover_bench, nothing
with a generic top-level name; the console scripts point at the installed name, and the tools run under it.

A wheel is built from a copy of the project (so the checkout gets no build/ folder) and unpacked into a folder
that is the only place the subprocesses import from: a tiny crossover-bench run there proves that the tools'
imports and the module names they start workers with follow the installed name.
"""

from __future__ import annotations

import configparser
import email
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("setup.py", "pyproject.toml", "README.md", "LICENSE", "crossover", "horovod_ext", "benchmarks")
TOP_LEVEL = {"crossover", "crossover_bench", "horovod_ext"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "--disable-pip-version-check", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("crossover-*.whl")
    return whl


@pytest.fixture(scope="module")
def unpacked(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site


def _dist_info(site: Path) -> Path:
    (info,) = site.glob("crossover-*.dist-info")
    return info


def test_the_wheel_holds_no_generic_top_level_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == TOP_LEVEL, f"top-level names in site-packages: {sorted(tops)}"


def test_metadata_names_the_license_and_the_authors(unpacked: Path) -> None:
    info = _dist_info(unpacked)
    meta = email.message_from_string((info / "METADATA").read_text(encoding="utf-8"))
    assert meta["License"] == "MIT" and meta["Author"] == "the crossover developers"
    assert "Operating System :: POSIX :: Linux" in meta.get_all("Classifier")
    assert (info / "licenses" / "LICENSE").read_text().startswith("MIT License")


def test_torch_and_tensorboard_are_extras(unpacked: Path) -> None:
    """Issue 44: torch was a hard requirement although the TensorFlow path imports none; tensorboard= had no extra."""
    meta = email.message_from_string((_dist_info(unpacked) / "METADATA").read_text(encoding="utf-8"))
    requires = meta.get_all("Requires-Dist")
    always = {r.split(";")[0].strip() for r in requires if "extra ==" not in r}
    assert always == {"numpy", "psutil"}
    assert {"torch", "tensorboard", "tensorflow", "benchmarks", "test"} <= set(meta.get_all("Provides-Extra"))
    by_extra = {(r.split(";")[0].strip(), r.split("extra ==")[1].strip().strip("'\"")) for r in requires
                if "extra ==" in r}
    assert {("torch", "torch"), ("tensorboard", "tensorboard"), ("torch", "benchmarks"), ("torch", "test")} <= by_extra


# What the TensorFlow path imports of this project (its own TensorFlow modules aside); torch must not be among them.
TF_PATH = ("crossover/tensorflow.py", "horovod_ext/tf_compression.py", "horovod_ext/tf_quantization.py",
           "horovod_ext/_tf_host.py", "horovod_ext/keras_guard.py")
BLOCK_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError("No module named 'torch' (blocked)", name=name)
sys.meta_path.insert(0, NoTorch())
for name in sys.argv[1:]:
    __import__(name)
"""


def _project_imports(path: Path) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.split(".")[0] in ("crossover", "horovod_ext")}


def test_the_tensorflow_path_and_crossover_run_need_no_torch(tmp_path: Path) -> None:
    """Every project module the TensorFlow glue imports (at the top or inside functions), the lazy names of
    `crossover`, and crossover-run import with torch absent (TensorFlow itself is not needed to check that)."""
    own = {p[:-3].replace("/", ".") for p in TF_PATH}
    modules = set().union(*(_project_imports(REPO / p) for p in TF_PATH)) - own
    modules |= {"crossover", "horovod_ext._dispatch", "crossover.scheduler.run", "horovod_ext.launch"}
    assert {"crossover.driver", "horovod_ext._facade"} <= modules
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *sorted(modules)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    code = BLOCK_TORCH + "from crossover import AdaptiveCompression\nAdaptiveCompression(cf_min=4)\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for script in ("a.py", "b.py"):
        (tmp_path / script).write_text("pass\n")
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "from crossover.scheduler import run\n"
                           "sys.exit(run.main(['--dry-run', 'a.py', 'b.py']))"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "horovodrun" in proc.stdout, proc.stdout + proc.stderr


def test_console_scripts_point_at_the_installed_names(unpacked: Path) -> None:
    ep = configparser.ConfigParser()
    ep.read(_dist_info(unpacked) / "entry_points.txt")
    scripts = dict(ep["console_scripts"])
    assert scripts == {"crossover-bench": "crossover_bench.cli:main",
                       "crossover-netem": "crossover_bench.netem.cli:main",
                       "crossover-run": "crossover.scheduler.run:main"}


def _run_installed(site: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` importing the project only from ``site`` (the checkout is neither the cwd nor on the path)."""
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_tools_run_under_the_installed_name(unpacked: Path, tmp_path: Path) -> None:
    for module in ("crossover_bench.netem", "crossover_bench.cli", "crossover_bench.demo"):
        proc = _run_installed(unpacked, ["-m", module, "--help"], tmp_path)
        assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr
    code = "import crossover, crossover_bench.trainer as t; print(crossover.__file__, t.__file__)"
    proc = _run_installed(unpacked, ["-c", code], tmp_path)
    assert proc.returncode == 0 and proc.stdout.count(str(unpacked)) == 2, proc.stdout + proc.stderr
    out = tmp_path / "run"
    proc = _run_installed(unpacked, ["-m", "crossover_bench.cli", "--model", "mlp", "--dataset", "digits", "--width",
                                     "1", "--epochs", "1", "--steps-per-epoch", "3", "--compression", "topk:10",
                                     "--no-plots", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "results.json").exists()
