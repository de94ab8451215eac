"""pytest plugin for Horovod's own test/parallel/test_torch.py with crossover compression injected.

Loaded with `-p hvd_suite_plugin` inside each rank of a `horovodrun` job (tests/hvd/test_horovod_suite.py).
`CROSSOVER_SUITE_COMPRESSION` picks what every `hvd.DistributedOptimizer` gets where the test leaves
the default (`hvd.Compression.none`): `none` (stock, nothing patched), `static`
(`StaticCompression("topk", cf=4, min_compress_numel=1)`) or `adaptive` (`AdaptiveCompression(
min_compress_numel=1)`); one new object per optimizer. Each rank writes `{test: outcome}` to
`$CROSSOVER_SUITE_OUT/rank<r>.json` at the end of the session.

In every mode, `torch.optim.Muon` (PyTorch >= 2.9, newer than Horovod 0.28.1's tests, and only for
2-D parameters) is hidden from the tests that build one optimizer of every `torch.optim` class.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import unittest.mock
from pathlib import Path
from typing import Any

_outcomes: dict[str, str] = {}


def _factory(mode: str) -> Any:
    from crossover import AdaptiveCompression, StaticCompression

    if mode == "static":
        return lambda: StaticCompression("topk", cf=4, min_compress_numel=1)
    if mode == "adaptive":
        return lambda: AdaptiveCompression(min_compress_numel=1)
    raise ValueError(f"CROSSOVER_SUITE_COMPRESSION must be none, static or adaptive, got {mode!r}")


def _inject(mode: str) -> None:
    import horovod.torch as hvd

    make = _factory(mode)
    original = hvd.DistributedOptimizer
    sig = inspect.signature(original)

    def distributed_optimizer(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        if bound.arguments.get("compression", hvd.Compression.none) is hvd.Compression.none:
            bound.arguments["compression"] = make()
        return original(*bound.args, **bound.kwargs)

    hvd.DistributedOptimizer = distributed_optimizer


def pytest_configure(config: Any) -> None:
    # Horovod's test/utils/common.py imports the `mock` backport; the standard library's is the same
    if importlib.util.find_spec("mock") is None:
        sys.modules["mock"] = unittest.mock
    import torch

    def known_subclasses(cls: type) -> list[type]:
        return [c for c in type.__subclasses__(cls) if c.__name__ != "Muon"]

    torch.optim.Optimizer.__subclasses__ = classmethod(known_subclasses)  # type: ignore[method-assign]
    mode = os.environ.get("CROSSOVER_SUITE_COMPRESSION", "none")
    if mode != "none":
        _inject(mode)


def pytest_runtest_logreport(report: Any) -> None:
    name = report.nodeid.split("::")[-1]
    if report.when == "call" or report.outcome != "passed":
        if _outcomes.get(name) in (None, "passed"):
            _outcomes[name] = report.outcome


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    out = os.environ.get("CROSSOVER_SUITE_OUT")
    if out:
        rank = os.environ.get("HOROVOD_RANK", "0")
        Path(out, f"rank{rank}.json").write_text(json.dumps(_outcomes))
