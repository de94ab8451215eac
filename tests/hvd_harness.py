"""Run real multi-process Horovod jobs from pytest and collect each rank's result.

`run_function(fn, np=2)` runs a module-level function of a test file on every rank under
`horovodrun -np N -H localhost:N --gloo` (Horovod is initialised first) and returns the JSON-able
values it returned, ordered by rank. `run_script(path, np=2)` does the same for a script that
calls `write_result(obj)`. A hang becomes a `HorovodJobError` after `timeout` seconds, carrying
every rank's output (horovodrun prefixes each line with its rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from crossover import procgroup

RESULT_DIR_ENV = "CROSSOVER_RESULT_DIR"
WORKER = Path(__file__).with_name("hvd_worker.py")
REPO = Path(__file__).resolve().parent.parent


class HorovodJobError(AssertionError):
    """A multi-rank job failed, hung or did not report from every rank; the message has all output."""


def horovodrun_bin() -> str:
    exe = Path(sys.executable).with_name("horovodrun")
    return str(exe) if exe.exists() else "horovodrun"


def load_test_module(path: str, name: str) -> Any:
    """Called inside a rank: the test file at `path` as module `name`, its folder on the path (it may import a sibling
    test module)."""
    import importlib.util

    sys.path.insert(0, str(Path(path).resolve().parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_result(obj: Any) -> None:
    """Called inside a rank: store this rank's JSON result for the harness."""
    import horovod.torch as hvd

    out = Path(os.environ[RESULT_DIR_ENV]) / f"rank{hvd.rank()}.json"
    out.write_text(json.dumps(obj))


def regression_step(model: Any, opt: Any, step: int) -> None:
    """Called inside a rank: one optimizer step of a 256 -> 128 `model` on this rank's batch of 32 for `step`
    (drawn from a generator seeded by `step` and the rank)."""
    import horovod.torch as hvd
    import numpy as np
    import torch

    rng = np.random.default_rng(1000 * step + hvd.rank())
    x = torch.from_numpy(rng.standard_normal((32, 256)).astype(np.float32))
    y = torch.from_numpy((rng.standard_normal((32, 128)) ** 3).astype(np.float32))
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def assert_as_accurate_as_dense(res: list[Any], key: str, tolerance: float, min_ratio: float) -> None:
    """Each rank's training run `key` ended within `tolerance` of the accuracy of its run "dense" (which itself
    learned) sending `min_ratio` times fewer bytes, and with the same weights on ranks 0 and 1."""
    for r in res:
        d, c = r["dense"], r[key]
        assert d["last3_accuracy"] > 0.9, "dense training itself must work for the comparison to mean anything"
        assert c["last3_accuracy"] >= d["last3_accuracy"] - tolerance, (c["history"], d["history"])
        assert c["dense_bytes"] / c["bytes_sent"] >= min_ratio, c["compression"]
    assert res[0][key]["weights_checksum"] == res[1][key]["weights_checksum"]


def _run(cmd: Sequence[str], np: int, timeout: float, env: dict[str, str] | None,
         result_dir: str) -> list[Any]:
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env[RESULT_DIR_ENV] = result_dir
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "tests"), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks on 2 cores: no oversubscription
    launch = [horovodrun_bin(), "-np", str(np), "-H", f"localhost:{np}", "--gloo", *cmd]
    try:
        res = procgroup.run(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=str(REPO), timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise HorovodJobError(f"Horovod job hung: killed after {timeout:.0f} s.\n"
                              f"command: {' '.join(launch)}\n--- output of all ranks ---\n{exc.output or ''}") from exc
    output = res.stdout
    if res.returncode != 0:
        raise HorovodJobError(f"Horovod job failed with exit code {res.returncode}.\n"
                              f"command: {' '.join(launch)}\n--- output of all ranks ---\n{output}")
    return read_rank_results(result_dir, np, HorovodJobError, f"--- output ---\n{output}")


def read_rank_results(folder: str, world: int, error: type[Exception], output: str) -> list[Any]:
    """Each rank's `rank<r>.json` in `folder`, in rank order; `error(... output)` for a rank that wrote none."""
    results = []
    for rank in range(world):
        path = Path(folder) / f"rank{rank}.json"
        if not path.exists():
            raise error(f"rank {rank} reported no result.\n{output}")
        results.append(json.loads(path.read_text()))
    return results


def run_function(fn: Callable[..., Any], np: int = 2, args: Sequence[Any] = (),
                 timeout: float = 120, env: dict[str, str] | None = None) -> list[Any]:
    """Run module-level `fn(*args)` on `np` Horovod ranks; return each rank's return value."""
    module_file = sys.modules[fn.__module__].__file__
    with tempfile.TemporaryDirectory(prefix="xo-hvd-") as tmp:
        cmd = [sys.executable, str(WORKER), str(module_file), fn.__name__, json.dumps(list(args))]
        return _run(cmd, np, timeout, env, tmp)


def run_script(script: str | os.PathLike[str], np: int = 2, args: Sequence[str] = (),
               timeout: float = 120, env: dict[str, str] | None = None) -> list[Any]:
    """Run a Python script on `np` ranks; each rank reports with `write_result`."""
    with tempfile.TemporaryDirectory(prefix="xo-hvd-") as tmp:
        return _run([sys.executable, str(script), *args], np, timeout, env, tmp)
