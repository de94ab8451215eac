"""Low-rank compression (compressor="powersgd") in real 2-rank Horovod jobs: momentum SGD trains to dense's
accuracy at a fraction of the bytes, every rank applies the same update, and the DDP hook refuses it clearly."""

from __future__ import annotations

import pytest
from hvd_harness import run_function


def momentum_job(epochs):
    import horovod.torch as hvd
    import torch

    from benchmarks.digits import train_digits
    from crossover import StaticCompression

    dense = train_digits(None, epochs=epochs, lr=0.02, momentum=0.9)
    lowrank = train_digits(StaticCompression("powersgd", cf=10), epochs=epochs, lr=0.02, momentum=0.9)
    summed = StaticCompression("powersgd", cf=10)  # the optimizer's op is a sum: the factor follows it
    model = torch.nn.Linear(64, 256, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), compression=summed, op=hvd.Sum)
    model.weight.grad = torch.full_like(model.weight, float(hvd.rank() + 1))  # a rank-1 gradient: exact
    opt.synchronize()
    return {"dense": dense, "lowrank": lowrank, "summed": float(model.weight.grad.mean())}


def test_momentum_sgd_keeps_dense_accuracy_with_identical_updates():
    res = run_function(momentum_job, args=[10], timeout=600)
    for r in res:
        d, lr = r["dense"], r["lowrank"]
        assert d["last3_accuracy"] > 0.9, "dense training itself must work for the comparison to mean anything"
        assert lr["last3_accuracy"] >= d["last3_accuracy"] - 0.02, (lr["history"], d["history"])
        assert lr["dense_bytes"] / lr["bytes_sent"] >= 5, lr["compression"]
        assert r["summed"] == pytest.approx(3.0, rel=1e-4)  # 1 + 2 on two ranks
    assert res[0]["lowrank"]["weights_checksum"] == res[1]["lowrank"]["weights_checksum"]


def test_ddp_hook_and_the_adaptive_policy_refuse_it_with_a_reason():
    from crossover import AdaptiveCompression
    from crossover.ddp import AdaptiveState

    with pytest.raises(ValueError, match="not on the DDP hook yet"):
        AdaptiveState(policy="static", compressor="powersgd", cf=10)
    with pytest.raises(ValueError, match="fixed CF"):
        AdaptiveCompression("powersgd")
