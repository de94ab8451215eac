"""The foundation works: real 2-rank Horovod jobs average exactly, and the harness reports failures."""

import pytest
import torch
from hvd_harness import HorovodJobError, run_function


def allreduce_job():
    import horovod.torch as hvd

    r = hvd.rank()
    x = torch.arange(10, dtype=torch.float32) * (r + 1) + 0.25 * r
    avg = hvd.allreduce(x, op=hvd.Average, name="avg")
    total = hvd.allreduce(x, op=hvd.Sum, name="sum")
    # float16 at a length that is no multiple of 8 (Gloo's F16C sums take 8 at a time, the tail apart), two
    # tensors fused into one buffer at an odd offset
    halves = [torch.randn(n, generator=torch.Generator().manual_seed(7 * r + n)).half() for n in (1003, 517)]
    handles = [hvd.allreduce_async(h, op=hvd.Sum, name=f"half.{i}") for i, h in enumerate(halves)]
    half_sums = [hvd.synchronize(h) for h in handles]
    return {"rank": r, "size": hvd.size(), "x": x.tolist(), "avg": avg.tolist(), "sum": total.tolist(),
            "halves": [h.tolist() for h in halves], "half_sums": [s.tolist() for s in half_sums]}


def test_allreduce_two_ranks_exact():
    res = run_function(allreduce_job, np=2)
    assert [r["rank"] for r in res] == [0, 1] and all(r["size"] == 2 for r in res)
    x0, x1 = (torch.tensor(r["x"]) for r in res)
    for r in res:
        assert torch.equal(torch.tensor(r["sum"]), x0 + x1)
        assert torch.equal(torch.tensor(r["avg"]), (x0 + x1) / 2)
        for i, got in enumerate(r["half_sums"]):  # each element summed in float32, rounded once to float16
            a, b = (torch.tensor(q["halves"][i], dtype=torch.float16) for q in res)
            assert torch.equal(torch.tensor(got, dtype=torch.float16), (a.float() + b.float()).half())


def optimizer_step_job(lr):
    import horovod.torch as hvd

    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Linear(8, 3)
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(100 + hvd.rank())  # each rank its own data
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
    # Local gradient, computed without Horovod, to compare against what the optimizer averaged.
    ref = torch.nn.Linear(8, 3)
    ref.load_state_dict(model.state_dict())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    local = [p.grad.tolist() for p in ref.parameters()]

    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    averaged = [p.grad.tolist() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    return {"w0": [w.tolist() for w in w0], "local": local, "averaged": averaged,
            "w1": [p.detach().tolist() for p in model.parameters()]}


def test_distributed_optimizer_step_averages_gradients():
    lr = 0.5
    res = run_function(optimizer_step_job, np=2, args=[lr])
    for i in range(2):  # weight and bias
        g0, g1 = torch.tensor(res[0]["local"][i]), torch.tensor(res[1]["local"][i])
        assert not torch.equal(g0, g1), "ranks must see different data for the test to mean anything"
        expect = (g0 + g1) / 2
        for r in res:
            assert torch.equal(torch.tensor(r["averaged"][i]), expect)
            w_expect = torch.tensor(r["w0"][i]) - lr * expect
            torch.testing.assert_close(torch.tensor(r["w1"][i]), w_expect, rtol=0, atol=1e-7)
        assert res[0]["w1"][i] == res[1]["w1"][i]


def hanging_job():
    import time

    import horovod.torch as hvd

    print(f"rank {hvd.rank()} alive", flush=True)
    if hvd.rank() == 1:
        time.sleep(600)
    return hvd.allreduce(torch.ones(1), name="never").item()


def test_hang_becomes_failure_with_every_ranks_output():
    with pytest.raises(HorovodJobError) as err:
        run_function(hanging_job, np=2, timeout=20)
    msg = str(err.value)
    assert "hung" in msg and "rank 0 alive" in msg and "rank 1 alive" in msg


def failing_job():
    import horovod.torch as hvd

    if hvd.rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    return 0


def test_failing_rank_fails_the_job():
    with pytest.raises(HorovodJobError, match="deliberate failure on rank 1"):
        run_function(failing_job, np=2, timeout=60)
