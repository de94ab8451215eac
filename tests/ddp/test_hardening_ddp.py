"""Issue 27 (DDP hook): a hostile or damaged checkpoint in a real 2-process Gloo job (tests/ddp_harness.py).

`AdaptiveState.load_state_dict` checks everything before it applies anything, as the Horovod objects
do: a NaN or wrong-size residual, a state that is not a mapping, a policy state no run could reach all
raise ValueError and change nothing; the good state then loads and training continues exactly as a run
that never saw the bad ones.
"""

from __future__ import annotations

import io
import math

import torch
from ddp_harness import run_ddp

from crossover.ddp import AdaptiveState, adaptive_hook

DDP = torch.nn.parallel.DistributedDataParallel


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _step(ddp: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def _build(**settings):
    d = DDP(_model(), bucket_cap_mb=0.02)
    st = AdaptiveState(**settings)
    d.register_comm_hook(st, adaptive_hook)
    return d, torch.optim.SGD(d.parameters(), lr=0.05), st


def _same(a: dict, b: dict) -> bool:
    """Two AdaptiveState.state_dict()s are equal (residual tensors compared exactly)."""
    ra, rb = a.get("residuals", {}), b.get("residuals", {})
    rest = {k: v for k, v in a.items() if k != "residuals"} == {k: v for k, v in b.items() if k != "residuals"}
    return rest and ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra)


def _corruptions(good: dict) -> dict[str, object]:
    res = good["residuals"]
    first = min(res)
    drv = good["driver"]
    nan = {**res, first: res[first].clone()}
    nan[first][0] = float("nan")
    return {
        "nan residual": {**good, "residuals": nan},
        "wrong-size residual": {**good, "residuals": {**res, first: torch.zeros(res[first].numel() + 3)}},
        "residual not a tensor": {**good, "residuals": {**res, first: res[first].tolist()}},
        "residual key not an ordinal": {**good, "residuals": {**res, "w": res[first]}},
        "residuals a list": {**good, "residuals": list(res.values())},
        "None": None,
        "a list": [good],
        "no driver": {k: v for k, v in good.items() if k != "driver"},
        "driver None": {**good, "driver": None},
        "negative step": {**good, "driver": {**drv, "step": -1}},
        "step a string": {**good, "driver": {**drv, "step": "7"}},
        "missing counter": {**good, "driver": {k: v for k, v in drv.items() if k != "nonfinite_steps"}},
        "policy step NaN": {**good, "driver": {**drv, "policy": {**drv["policy"], "step": float("nan")}}},
        # the policy state is good, the residual bad: nothing of the policy may load (no half-load)
        "good policy, bad residual": {**good, "driver": {**drv, "step": drv["step"] + 100}, "residuals": nan},
    }


def job_bad_checkpoints(steps: int) -> dict:
    """Static top-k (deterministic): `steps` steps straight; again with a save half-way, every corruption
    refused (state unchanged), the good state loaded, and the rest of the steps."""
    settings = {"policy": "static", "compressor": "topk", "cf": 8, "min_compress_numel": 64}
    d, o, st = _build(**settings)
    for step in range(steps):
        _step(d, o, step)
    straight = [p.detach().clone() for p in d.parameters()]

    d, o, st = _build(**settings)
    for step in range(steps // 2):
        _step(d, o, step)
    buf = io.BytesIO()
    torch.save(st.state_dict(), buf)
    buf.seek(0)
    good = torch.load(buf, weights_only=False)
    refused, unchanged = {}, {}
    before = st.state_dict()
    for what, bad in _corruptions(good).items():
        try:
            st.load_state_dict(bad)
            refused[what] = "accepted"
        except ValueError as exc:
            refused[what] = str(exc)
        unchanged[what] = _same(st.state_dict(), before)
    st.load_state_dict(good)
    for step in range(steps // 2, steps):
        _step(d, o, step)
    resumed = list(d.parameters())
    return {"refused": refused, "unchanged": unchanged,
            "identical": all(torch.equal(a, b) for a, b in zip(straight, resumed)),
            "finite": all(math.isfinite(float(p.sum())) for p in resumed),
            "residuals": len(good["residuals"])}


def test_bad_checkpoints_are_refused_and_change_nothing():
    """Item 6: every corruption raises ValueError on every rank and leaves the state as it was; the good
    state loads afterwards and training continues bit for bit as without the attempts."""
    res = run_ddp(job_bad_checkpoints, args=(10,), timeout=240)
    for r in res:
        assert r["residuals"] >= 2
        for what, msg in r["refused"].items():
            assert msg != "accepted", what
        assert all(r["unchanged"].values()), r["unchanged"]
        assert r["identical"] and r["finite"]


def job_fp64_model(steps: int) -> dict:
    """An fp64 model: DDP's buckets are float64, nothing is compressed: said once, stats() reports CF 1."""
    import logging

    import torch.distributed as dist

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("crossover.ddp").addHandler(Keep())
    out = {}
    for policy in ("static", "qsgd"):
        said.clear()
        settings = {"policy": policy, "min_compress_numel": 1, **({"cf": 4} if policy == "static" else {})}
        d = DDP(_model().double(), bucket_cap_mb=0.02)
        st = AdaptiveState(**settings)
        d.register_comm_hook(st, adaptive_hook)
        o = torch.optim.SGD(d.parameters(), lr=0.05)
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
            x, y = torch.randn(32, 64, generator=gen).double(), torch.randint(0, 10, (32,), generator=gen)
            o.zero_grad()
            torch.nn.functional.cross_entropy(d(x), y).backward()
            o.step()
        s = st.stats()
        out[policy] = {"cf": s["compression_factor"], "sent": s["bytes_sent"], "dense": s["bytes_dense"],
                       "said": [m for m in said if "no gradient bucket was compressed" in m]}
    return out


def test_fp64_model_said_once_and_stats_honest():
    for r in run_ddp(job_fp64_model, args=(4,), timeout=180):
        for policy, got in r.items():
            assert got["cf"] == 1.0 and got["sent"] == got["dense"], (policy, got)
            assert len(got["said"]) == 1 and "float64" in got["said"][0], (policy, got["said"])


SMALL_BUCKET = 50_000  # min_compress_numel of the job below


def job_small_bucket_inf(steps: int, poison_step: int) -> dict:
    """Only rank 1, only at `poison_step`, puts inf into the last layer's bias, whose bucket is below
    min_compress_numel (passed through to DDP's averaging); the first layer's weight is compressed."""
    import torch.distributed as dist

    out = {}
    for policy in ("static", "qsgd"):
        settings = {"policy": policy, "min_compress_numel": SMALL_BUCKET,
                    **({"cf": 4} if policy == "static" else {"bits": 4, "error_feedback": True})}
        torch.manual_seed(0)
        # after DDP's rebuild (step 2 on) the last layer (1 MiB weight) fills DDP's first bucket, compressed; the
        # two small layers share the next one (1312 elements), passed through
        model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 16384))
        d = DDP(model, bucket_cap_mb=0.02)
        st = AdaptiveState(**settings)
        d.register_comm_hook(st, adaptive_hook)
        o = torch.optim.SGD(d.parameters(), lr=0.05)
        skipped, zeroed, small = [], None, None
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 16384, (32,), generator=gen)
            o.zero_grad()
            hook = None
            if step == poison_step and dist.get_rank() == 1:
                hook = model[2].bias.register_hook(
                    lambda g: g.index_put((torch.tensor(1),), torch.tensor(float("inf"))))
            torch.nn.functional.cross_entropy(d(x), y).backward()
            if hook is not None:
                hook.remove()
            if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
                o.step()
            else:
                skipped.append(step)
            if step == poison_step:
                nonfinite_then = st.stats()["nonfinite_steps"]  # between steps: the step is settled here
                zeroed = all(bool((r == 0).all()) for r in st.state_dict()["residuals"].values())
                layouts = st._engine.layouts
                owner = layouts._owner[layouts._ordinal[id(model[2].bias)]]
                small = layouts._layouts[owner].numel < SMALL_BUCKET
        out[policy] = {"skipped": skipped, "zeroed": zeroed, "small": small, "nonfinite_then": nonfinite_then,
                       "nonfinite_steps": st.stats()["nonfinite_steps"],
                       "observed": st.stats(debug=True).get("policy/step"),
                       "params": [float(p.detach().double().sum()) for p in model.parameters()]}
    return out


def test_inf_in_a_passed_through_bucket_counts_and_leaves_no_trace():
    """As with Horovod (tests/hvd/test_hardening_hvd.py): skipped on every rank, counted once on every rank,
    not observed by the policy, the compressed buckets' residuals forget the step; same weights everywhere."""
    steps, poison = 8, 3
    r0, r1 = run_ddp(job_small_bucket_inf, args=(steps, poison), timeout=240)
    for r in (r0, r1):
        for policy, got in r.items():
            assert got["small"], "the poisoned bias must sit in a passed-through bucket"
            assert got["skipped"] == [poison] and got["zeroed"], (policy, got)
            assert got["nonfinite_then"] == got["nonfinite_steps"] == 1, (policy, got)
        assert r["static"]["observed"] == steps - 1 - 2
    for policy in r0:
        assert r0[policy]["params"] == r1[policy]["params"], policy


def job_randomk_seed_per_rank(steps: int) -> dict:
    """random-k with seed=rank: refused on every rank by the seed fingerprint in the statistics."""
    import torch.distributed as dist

    d, o, st = _build(policy="static", compressor="randomk", cf=4, min_compress_numel=64, seed=dist.get_rank())
    try:
        for step in range(steps):
            _step(d, o, step)
        return {"rank": f"trained {st.stats()['step']}"}
    except Exception as exc:  # noqa: BLE001 - DDP may wrap the hook's error; the message is what counts
        return {"rank": f"{type(exc).__name__}: {exc}"}


def test_randomk_seed_per_rank_refused():
    for r in run_ddp(job_randomk_seed_per_rank, args=(4,), timeout=180):
        assert "different seeds" in r["rank"], r


def test_randomk_same_seed_trains():
    res = run_ddp(job_randomk_same_seed, args=(4,), timeout=180)
    assert [r["same"] for r in res] == ["trained 4", "trained 4"]


def job_randomk_same_seed(steps: int) -> dict:
    d, o, st = _build(policy="static", compressor="randomk", cf=4, min_compress_numel=64, seed=3)
    for step in range(steps):
        _step(d, o, step)
    return {"same": f"trained {st.stats()['step']}"}
