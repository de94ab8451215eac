"""The agreed index set transport inside real 3-rank Horovod jobs (Gloo, CPU): the averaged gradient is the exact
average of what each rank sent and residuals are exact, with gradients that differ on purpose per rank. The
agreed set is opt-in on Horovod (transport="agreed"); transport="auto" there is tested in test_scatter_hvd.py."""

import torch
from hvd_harness import run_function

N = 50_000  # elements of the test parameter (above min_compress_numel)
CF = 200.0  # k = 250 of 50 000: the set takes proposals (CF >= 100)


def _param_opt(compression):
    import horovod.torch as hvd

    p = torch.nn.Parameter(torch.zeros(N))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("w", p)],
                                   compression=compression)
    return p, opt


def _rank_grad(step):
    """Each rank its own scale and distribution: rank 1 heavy-tailed and 100x larger."""
    import horovod.torch as hvd

    gen = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    g = torch.randn(N, generator=gen)
    return 100 * g ** 3 if hvd.rank() == 1 else g * (1 + hvd.rank())


def _step(p, opt, g):
    opt.zero_grad()
    (p * g).sum().backward()
    opt.synchronize()
    return p.grad.detach().clone()


def exact_job(steps):
    import horovod.torch as hvd

    from crossover import StaticCompression

    comp = StaticCompression("topk", cf=CF, transport="agreed")
    p, opt = _param_opt(comp)
    worst_avg, residual_exact, same_set, set_sizes = 0.0, True, True, set()
    for step in range(steps):
        before = comp.codec.memory._residuals["w"].clone() if "w" in comp.codec.memory._residuals else torch.zeros(N)
        g = _rank_grad(step)
        out = _step(p, opt, g)
        after = comp.codec.memory._residuals["w"]
        acc = g + before
        sent_at = after == 0  # acc is non-zero everywhere (continuous): zeros are exactly the set
        residual_exact &= bool(torch.equal(after[~sent_at], acc[~sent_at]))
        sent = torch.where(sent_at, acc, torch.zeros_like(acc))
        every = hvd.allgather(sent.unsqueeze(0), name="test.sent")
        worst_avg = max(worst_avg, float((every.mean(0) - out).abs().max() / every.abs().max()))
        masks = hvd.allgather(sent_at.to(torch.int32).unsqueeze(0), name="test.mask")
        same_set &= bool((masks == masks[0]).all())
        set_sizes.add(int(sent_at.sum()))
    return {"worst_avg": worst_avg, "residual_exact": residual_exact, "same_set": same_set,
            "set_sizes": sorted(set_sizes), "stats": {k: v for k, v in comp.stats().items()
                                                      if k in ("bytes_sent", "bytes_dense", "transport")}}


def test_agreed_average_is_exact_and_residuals_are_exact():
    res = run_function(exact_job, np=3, args=[12], timeout=240)
    k = -(-N // int(CF))
    for r in res:
        assert r["worst_avg"] < 1e-6, r
        assert r["residual_exact"] and r["same_set"], r
        assert r["set_sizes"] == [k], r
        assert r["stats"]["transport"] == "agreed"
        # k values + checks + statistics by allreduce, ceil(k / 9) proposals by allgather, per step
        assert r["stats"]["bytes_sent"] * 150 < r["stats"]["bytes_dense"], r["stats"]
