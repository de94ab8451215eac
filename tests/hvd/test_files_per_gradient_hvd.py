"""One gradient on the Horovod path passes at most 10 of this repository's files (issue 42).

A 2-rank `horovodrun --gloo` job trains an MLP (256-512-256-10) for some steps, then profiles one optimizer step
(`sys.setprofile`) and records the files of this repository entered while one 131 k-element gradient passes
`TorchHookBase.compress` and, later, its `decompress`: the per-gradient path a reader follows, not the per-step
work at the step's first gradient. Two paths: static top-k (plain SGD) and the defaults under momentum (low rank).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from hvd_harness import run_function

MAX_FILES = 10  # issue 42's target


def _files_one_gradient(mode: str) -> dict[str, Any]:
    import horovod.torch as hvd
    import torch

    from crossover import AdaptiveCompression, StaticCompression

    hvd.init()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10))
    if mode == "topk":
        comp, opt = StaticCompression("topk", cf=10), torch.optim.SGD(m.parameters(), lr=0.01)
    else:
        comp, opt = AdaptiveCompression(), torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters(), compression=comp)
    root = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["crossover"].__file__)))
    numel = m[2].weight.numel()
    files: set[str] = set()
    state: dict[str, Any] = {"frame": None, "ctx": None}

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if state["frame"] is None:  # outside: wait for this gradient's compress, or its decompress
            if event != "call" or not code.co_filename.endswith("_torch_host.py"):
                return
            loc = frame.f_locals
            if code.co_name == "compress" and getattr(loc.get("tensor"), "numel", lambda: 0)() == numel:
                state["frame"] = frame
            elif code.co_name == "decompress" and state["ctx"] is not None and loc.get("ctx") is state["ctx"]:
                state["frame"] = frame
            else:
                return
        if event == "return" and frame is state["frame"]:
            if code.co_name == "compress":
                state["ctx"] = arg[1]
            state["frame"] = None
        elif event == "call" and code.co_filename.startswith(root) and os.sep + ".venv" not in code.co_filename:
            files.add(os.path.relpath(code.co_filename, root))

    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    steps = 31
    for i in range(steps):
        if i == steps - 1:
            sys.setprofile(profile)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        sys.setprofile(None)
    return {"files": sorted(files), "decoded": state["ctx"] is not None and state["frame"] is None,
            "compressor": comp.stats().get("compressor")}


@pytest.mark.parametrize("mode,codec", [("topk", "sparse_codec.py"), ("defaults", "lowrank_codec.py")])
def test_one_gradient_passes_at_most_ten_files(mode: str, codec: str) -> None:
    for r in run_function(_files_one_gradient, args=[mode], timeout=180):
        files = r["files"]
        assert r["decoded"], "the profiled gradient's decompress was not seen"
        assert f"crossover/compression/{codec}" in files, files  # the profile saw the codec's work
        assert "horovod_ext/_torch_host.py" in files and "crossover/driver/session.py" in files, files
        assert len(files) <= MAX_FILES, f"{len(files)} files on one gradient's path: {files}"
