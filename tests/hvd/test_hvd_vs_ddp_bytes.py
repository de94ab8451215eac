"""The Horovod path sends what the DDP hook sends at the same static CF (issue 43), except the small tensors.

The same model (the issue's CNN: conv 32, conv 64, fc 1600-256, fc 256-10; tensors above and below the default
`min_compress_numel`) trains a few steps from the same weights on the same batches, once with
`hvd.DistributedOptimizer(compression=StaticCompression("topk", cf=CF))` in a 2-rank horovodrun job and once with
DDP + `adaptive_hook` (`AdaptiveState(policy="static", cf=CF)`) in a 2-rank torch.distributed job. Each rank counts
per step the collectives it hands to its framework and their bytes, and what the compression object says it sent
(`stats()["bytes_sent"]`). On 2 ranks a ring allreduce of M bytes and an allgather of M bytes per rank both move M
bytes through each worker, so the bytes handed to the collectives are the wire's payload bytes (no framing).
The hook compresses every tensor of a bucket; the Horovod path sends tensors under `min_compress_numel` (biases,
BatchNorm) dense, as DGC exempts them (compressed in buckets they cost ResNet-18 28 points: docs/compression.md),
so it may send those tensors' dense bytes more than the hook, and no more.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from ddp_harness import run_ddp
from hvd_harness import run_function

STEPS = 6
BOUND = 1.0  # issue 43 allows 1.05x the hook's bytes a step; for compressed tensors the Horovod path sends as many
DIRECTORY = 32  # bytes a group's allgather adds per rank (its directory: crossover/compression/grouped.py)
SMALL = 3210  # elements of the tensors under min_compress_numel (below): dense on the Horovod path
SMALL_TENSORS = 6


def _cnn() -> torch.nn.Module:
    """The issue's CNN on 28x28x1 inputs: 431 k parameters, of which conv1, every bias and fc2 (3 210 elements)
    are below the default min_compress_numel (16 384), conv2 (18 432) and fc1 (409 600) above it; DDP's buckets:
    fc2 and fc1 (1.6 MB, past the 1 MiB first bucket), then the convolutions; the Horovod path's: fc1 alone, then
    conv2 alone (each then on its own), the small tensors dense."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1600, 256), nn.ReLU(), nn.Linear(256, 10))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 1, 28, 28, generator=gen), torch.randint(0, 10, (16,), generator=gen)


class _Counter:
    """Calls and bytes of the collectives issued through the patched functions, per step."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes = 0

    def wrap(self, mod: Any, attr: str, kind: str, arg: int) -> None:
        fn = getattr(mod, attr)

        def call(*a: Any, **kw: Any) -> Any:
            t = a[arg]
            tensors = t if isinstance(t, (list, tuple)) else [t]
            self.calls["carrying"] += int(any(x.numel() for x in tensors))  # collectives that move bytes
            for x in tensors:
                self.calls[kind] += 1
                self.bytes += x.numel() * x.element_size()
            return fn(*a, **kw)

        setattr(mod, attr, call)

    def take(self) -> dict[str, Any]:
        out = {"calls": dict(self.calls), "bytes": self.bytes}
        self.calls.clear()
        self.bytes = 0
        return out


def _train(step_fn: Any, stats: Any, counter: _Counter) -> list[dict[str, Any]]:
    out = []
    for s in range(STEPS):
        before = stats()["bytes_sent"]
        step_fn(s)
        sent = stats()["bytes_sent"] - before
        out.append({**counter.take(), "sent": sent})
    return out


def hvd_job(cf: float) -> list[dict[str, Any]]:
    import horovod.torch as hvd
    import horovod.torch.optimizer as hopt

    from crossover import StaticCompression
    from crossover.compression.wire import k_for

    model = _cnn()
    comp = StaticCompression("topk", cf=cf)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=comp)
    counter = _Counter()
    counter.wrap(hopt, "allreduce_async_", "allreduce", 0)  # the optimizer's per-tensor allreduce
    counter.wrap(hopt, "grouped_allreduce_async_", "allreduce", 0)
    for attr, kind in (("allreduce_async", "allreduce"), ("allgather_async", "allgather"),
                       ("alltoall_async", "alltoall")):  # the glue's own (horovod_ext/_torch_host.py)
        counter.wrap(hvd, attr, kind, 0)

    params = list(model.parameters())
    check: dict[str, Any] = {}

    def step(s: int) -> None:
        x, y = _batch(s, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if s:
            opt.step()
            return
        # the first step: every compressed gradient is the average of what each rank sent of it, which error
        # feedback tells: the gradient less the residual it kept; the small tensors: the plain average
        large = {"7.weight": params[4], "3.weight": params[2]}  # fc1, then conv2
        grads = [p.grad.reshape(-1).clone() for p in large.values()]
        opt.synchronize()
        check["keys"] = sorted(comp.codec.memory.keys())
        for i, ((key, par), flat) in enumerate(zip(large.items(), grads)):
            b = [par]
            sent = flat - comp.codec.memory.get(key).reshape(-1)
            want = hvd.allreduce(sent, op=hvd.Average, name=f"test.want.{i}")
            got = torch.cat([p.grad.reshape(-1) for p in b])
            check[str(i)] = dict(numel=flat.numel(), nonzero=int((sent != 0).sum()), k=k_for(flat.numel(), cf),
                            err=float((got - want).abs().max()), scale=float(want.abs().max()))
        with opt.skip_synchronize():
            opt.step()

    return [check, *_train(step, comp.stats, counter)]


def ddp_job(cf: float) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from crossover.ddp import AdaptiveState, _collectives, adaptive_hook, hook

    model = _cnn()
    net = torch.nn.parallel.DistributedDataParallel(model)
    state = AdaptiveState(policy="static", cf=cf, compressor="topk")
    net.register_comm_hook(state, adaptive_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    counter = _Counter()
    counter.wrap(hook.dist, "all_reduce", "allreduce", 0)
    counter.wrap(_collectives, "_all_gather", "allgather", 1)

    def step(s: int) -> None:
        x, y = _batch(s, dist.get_rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    return _train(step, state.stats, counter)


@pytest.mark.parametrize("cf", [10.0, 100.0])
def test_horovod_sends_no_more_than_the_ddp_hook(cf: float) -> None:
    check, *hvd = run_function(hvd_job, np=2, args=(cf,), timeout=300)[0]
    ddp = run_ddp(ddp_job, world=2, args=(cf,), timeout=300)[0]
    # fc1 and conv2 went compressed, each on its own (no bucket, no residual for a small tensor), and decode to the
    # average of what the ranks sent
    assert check["keys"] == ["3.weight", "7.weight"], check
    assert [check[i]["numel"] for i in ("0", "1")] == [409600, 18432], check
    for i in ("0", "1"):
        assert 0 < check[i]["nonzero"] <= check[i]["k"], check
        assert check[i]["err"] <= 1e-6 * check[i]["scale"], check
    # DDP rebuilds its buckets after the first step: compare the steps after it
    for s in range(1, STEPS):
        h, d = hvd[s], ddp[s]
        assert d["sent"] > 0 and d["bytes"] > 0, d
        assert h["sent"] <= BOUND * d["sent"] + 4 * SMALL, (
            f"CF {cf:g}, step {s}: the Horovod path counted {h['sent']} bytes sent, the DDP hook {d['sent']} "
            f"({h['sent'] / d['sent']:.2f}x; bound {BOUND}x)\nhorovod {hvd}\nddp {ddp}")
        assert h["bytes"] <= BOUND * d["bytes"] + 4 * SMALL + DIRECTORY * h["calls"].get("allgather", 0), (
            f"CF {cf:g}, step {s}: {h['bytes']} bytes handed to Horovod's collectives, {d['bytes']} to the hook's "
            f"({h['bytes'] / d['bytes']:.4f}x; bound {BOUND}x and the groups' directories)\nhorovod {hvd}\nddp {ddp}")
        # one allgather per compressed tensor here, as the hook's per bucket, and as many collectives that move
        # bytes, plus one per small tensor
        assert h["calls"].get("allgather", 0) == d["calls"].get("allgather", 0), (h, d)
        assert h["calls"]["carrying"] <= d["calls"]["carrying"] + SMALL_TENSORS, (s, hvd, ddp)
