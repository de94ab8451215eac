"""horovod.torch with CUDA gradients: 2 Horovod ranks (Gloo) on the one GPU, every compression object.

NCCL refuses two ranks of one communicator on one device, so on a single GPU the ranks' CUDA
tensors travel through host memory over Gloo: Horovod built with CUDA support but without NCCL for
allreduce/allgather/broadcast (`scripts/gpu_check.py` builds it so). Skipped without CUDA, without
Horovod, or with a Horovod built without CUDA support.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hvd_harness import run_function

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="needs Horovod")]


def job_cuda_compression(steps: int) -> dict:
    """The same MLP trained by one DistributedOptimizer per compression object, gradients on the GPU."""
    import copy

    import horovod.torch as hvd

    from crossover import AdaptiveCompression, FP16Compression, QSGDCompression, StaticCompression

    if not hvd.cuda_built():
        return {"cuda_built": False}
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(dev)
    objects = {"dense": None,
               "off": AdaptiveCompression(enabled=False, min_compress_numel=1024),
               "topk": StaticCompression("topk", cf=20, min_compress_numel=1024),
               "dgc": StaticCompression("dgc", cf=20, min_compress_numel=1024),
               "redsync": StaticCompression("redsync", cf=20, min_compress_numel=1024),
               "randomk": StaticCompression("randomk", cf=20, min_compress_numel=1024),
               "gravac": AdaptiveCompression(cf_min=4, epsilon=0.3, window=4, min_compress_numel=1024),
               "qsgd": QSGDCompression(bits=4, error_feedback=True, min_compress_numel=1024),
               "fp16": FP16Compression()}
    runs = {}
    for name, comp in objects.items():
        model = copy.deepcopy(base)
        kw = {} if comp is None else {"compression": comp}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()],
                                       **kw)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        runs[name] = (model, opt, comp)
    gen = torch.Generator().manual_seed(hvd.rank())
    equal_off, on_gpu, finite = 0, True, True
    sums: dict[str, float] = {}
    for _ in range(steps):
        x = torch.randn(64, 64, generator=gen).to(dev)
        y = torch.randint(0, 10, (64,), generator=gen).to(dev)
        for model, opt, _ in runs.values():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        grads = {name: [p.grad for p in m.parameters()] for name, (m, _, _) in runs.items()}
        equal_off += all(torch.equal(a, b) for a, b in zip(grads["dense"], grads["off"]))
        on_gpu &= all(g.device == dev for gs in grads.values() for g in gs)
        finite &= all(bool(torch.isfinite(g).all()) for gs in grads.values() for g in gs)
    for name, (model, _, _) in runs.items():
        sums[name] = float(sum(p.detach().double().sum() for p in model.parameters()))
    stats = {name: {k: v for k, v in comp.stats().items() if k in ("bytes_sent", "bytes_dense", "compression_factor")}
             for name, (_, _, comp) in runs.items() if comp is not None}
    return {"cuda_built": True, "equal_off": equal_off, "on_gpu": on_gpu, "finite": finite, "param_sums": sums,
            "stats": stats}


def test_horovod_two_ranks_on_one_gpu_every_compression():
    steps = 8
    r0, r1 = run_function(job_cuda_compression, np=2, args=(steps,), timeout=300)
    if not r0["cuda_built"]:
        pytest.skip("Horovod was built without CUDA support: it cannot reduce CUDA tensors")
    for r in (r0, r1):
        assert r["equal_off"] == steps and r["on_gpu"] and r["finite"]
        for name in ("topk", "dgc", "redsync", "randomk", "gravac", "qsgd", "fp16"):
            assert r["stats"][name]["bytes_sent"] < r["stats"][name]["bytes_dense"], name
    assert r0["param_sums"] == r1["param_sums"]  # every rank applied the same averaged updates
