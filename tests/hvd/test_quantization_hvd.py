"""DQ-SGD / QSGD compression in real 2-rank Horovod jobs."""

import pytest
import torch
from hvd_harness import run_function
from test_compression_hvd import N, _grad_step, _param_opt, _rank_grad


def paths_job():
    from crossover import QSGDCompression

    g = _rank_grad(3)
    out = {"local": g.tolist()}
    for transport in ("allgather", "allreduce"):
        comp = QSGDCompression(8, transport=transport)
        p, opt = _param_opt(comp)
        out[transport] = _grad_step(p, opt, g).tolist()
        out[transport + "_bytes"] = comp.stats()["bytes_sent"]
    return out


def test_allgather_and_allreduce_paths_give_the_same_average():
    res = run_function(paths_job)
    ag0, ag1 = (torch.tensor(r["allgather"]) for r in res)
    ar = torch.tensor(res[0]["allreduce"])
    assert torch.equal(ag0, ag1) and torch.equal(ar, torch.tensor(res[1]["allreduce"]))
    # same seeds, same levels: the paths differ only by the fp16 rounding of the allreduced values
    torch.testing.assert_close(ar, ag0, rtol=2e-3, atol=1e-3)
    avg = (torch.tensor(res[0]["local"]) + torch.tensor(res[1]["local"])) / 2
    scale = max(torch.tensor(r["local"]).abs().max() for r in res)
    # each element: an average of two roundings, each off by at most scale/127
    assert (ag0 - avg).abs().max() <= scale / 127 + 1e-6
    for r in res:  # 8-bit codes + 4-byte scale vs fp32; fp16 values vs fp32
        assert r["allgather_bytes"] < N * 4 / 3.9 and r["allreduce_bytes"] < N * 4 / 1.99


def bits_job(steps):
    from crossover import AdaptiveCompression

    comp = AdaptiveCompression(policy="dqsgd", total_steps=steps, target_bits=5, decay=0.97)
    p, opt = _param_opt(comp)
    bits = []
    for step in range(steps):
        _grad_step(p, opt, _rank_grad(step, heavy=True) * (1 + step / 10))
        bits.append(comp.stats()["bits"])
    return {"bits": bits, "stats": {k: v for k, v in comp.stats().items() if not k.startswith("policy/")}}


def test_identical_bits_when_ranks_differ():
    res = run_function(bits_job, args=[60], timeout=300)
    assert res[0]["bits"] == res[1]["bits"]
    assert len(set(res[0]["bits"])) >= 2, res[0]["bits"]
    assert res[0]["bits"][-1] >= res[0]["bits"][5], "bits grow toward the end (and with the gradient norm)"
    for r in res:
        assert r["stats"]["bytes_sent"] * 3 < r["stats"]["bytes_dense"]


def digits_dqsgd_job(epochs):
    from benchmarks.digits import train_digits
    from crossover import AdaptiveCompression

    dense = train_digits(None, epochs=epochs)
    steps = dense["steps"]
    dq = train_digits(AdaptiveCompression(policy="dqsgd", total_steps=steps, min_compress_numel=4096),
                      epochs=epochs)
    return {"dense": dense, "dqsgd": dq}


def test_digits_dqsgd_within_one_point_with_4x_fewer_bytes():
    res = run_function(digits_dqsgd_job, args=[20], timeout=600)
    for r in res:
        d, q = r["dense"], r["dqsgd"]
        assert q["last3_accuracy"] >= d["last3_accuracy"] - 0.01, (q["history"], d["history"])
        assert q["dense_bytes"] / q["bytes_sent"] >= 4, q["compression"]
    assert res[0]["dqsgd"]["weights_checksum"] == res[1]["dqsgd"]["weights_checksum"]


@pytest.mark.parametrize("kwargs, match", [
    ({}, "total_steps"),
    ({"total_steps": 0}, "total_steps"),
    ({"total_steps": 10, "lr": 0}, "lr"),
    ({"total_steps": 10, "b_min": 6, "b_max": 3}, "b_min must be <= b_max"),
    ({"total_steps": 10, "error_budget": -1.0}, "error_budget"),
    ({"total_steps": 10, "transport": "carrier-pigeon"}, "transport"),
])
def test_dqsgd_bad_settings(kwargs, match):
    from crossover import AdaptiveCompression

    with pytest.raises(ValueError, match=match):
        AdaptiveCompression(policy="dqsgd", **kwargs)
