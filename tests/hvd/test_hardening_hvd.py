"""Issue 14 (horovod.torch): what an unlucky user meets, in real 2-rank Horovod jobs (Gloo, CPU).

Two jobs cover the items that need Horovod (each job is run once per module, several tests read it):
* `amp_job`: non-finite gradients with the GradScaler pattern (item 1) and huge finite gradients from
  `GradScaler(init_scale=2**120)` (item 2), with stock Horovod, StaticCompression and GraVAC;
* `misuse_job`: one object shared by two optimizers (3), ranks with different shapes under one name (4),
  per-rank CSV files with a fixed header and a step count with pass-through tensors (6), an optimizer
  on a process set (7), Horovod's `test_dynamic_requires_grad` pattern at min_compress_numel=1 (8),
  Adasum (10) and a small model below min_compress_numel (12).
Item 5 (`load_state_dict`) needs no job: it is checked in this process.
"""

from __future__ import annotations

import math

import pytest
import torch
from codec_calls import quant_encode, sparse_encode
from hvd_harness import run_function

STEPS = 30
POISON = {3: (1, float("inf")), 10: (0, float("nan"))}  # step -> (rank, value put into one gradient)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.ReLU(), torch.nn.Linear(100, 1))


def _make(kind: str):
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, StaticCompression

    if kind == "none":
        return hvd.Compression.none
    if kind == "static":
        return StaticCompression("topk", cf=4)
    return AdaptiveCompression("topk", cf_min=4, cf_max=64, epsilon=0.2, window=4)


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 200, generator=gen)
    return x, x[:, :3].sum(dim=1, keepdim=True)


def _steps(model: torch.nn.Module, opt, steps: int, dtype: torch.dtype = torch.float32) -> None:
    """`steps` plain training steps on this rank's batches (seeded by the rank)."""
    import horovod.torch as hvd

    gen = torch.Generator().manual_seed(hvd.rank())
    for _ in range(steps):
        x, y = _batch(gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()


def _train(kind: str, scaler_scale: float | None, poison: dict) -> dict:
    """GradScaler pattern: backward, synchronize, skip the step if a gradient is inf/NaN, else step."""
    import horovod.torch as hvd

    comp = _make(kind)
    model = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02),
                                   named_parameters=model.named_parameters(), compression=comp)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale) if scaler_scale else None
    gen = torch.Generator().manual_seed(hvd.rank())
    skipped, scales = [], []
    for step in range(STEPS):
        x, y = _batch(gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        hook = None
        if step in poison and poison[step][0] == hvd.rank():  # in backward, before Horovod's hook sees it
            hook = model[0].weight.register_hook(lambda g, v=poison[step][1]: g.index_put((torch.tensor(5),
                                                                                           torch.tensor(7)),
                                                                                          torch.tensor(v)))
        (scaler.scale(loss) if scaler else loss).backward()
        if hook is not None:
            hook.remove()
        opt.synchronize()
        if scaler:
            scaler.unscale_(opt)
            before = scaler.get_scale()
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if scaler.get_scale() < before:
                skipped.append(step)
        elif all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            with opt.skip_synchronize():
                opt.step()
        else:
            skipped.append(step)
    x, y = _batch(torch.Generator().manual_seed(99))
    out = {"skipped": skipped, "scales": scales,
           "loss": float(torch.nn.functional.mse_loss(model(x), y)),
           "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
    if kind != "none":
        st = comp.stats(debug=True)
        out["stats"] = {k: st.get(k) for k in ("step", "nonfinite_steps", "saturated_steps")}
        out["residuals_finite"] = all(bool(torch.isfinite(r).all()) for r in comp.codec.memory._residuals.values())
        out["observed"] = st.get("policy/step")
        out["gains_finite"] = all(math.isfinite(g) for k, g in st.items() if k.startswith("policy/gains/")
                                  and g is not None)
    return out


def amp_job() -> dict:
    res = {}
    for kind in ("none", "static", "adaptive"):
        res[f"manual-{kind}"] = _train(kind, None, POISON)
        res[f"amp-{kind}"] = _train(kind, 2.0 ** 16, POISON)
        res[f"huge-{kind}"] = _train(kind, 2.0 ** 120, {})
    return res


@pytest.fixture(scope="module")
def amp_results():
    return run_function(amp_job, timeout=400)


def test_nonfinite_gradient_is_skipped_alike_and_leaves_no_trace(amp_results):
    """Item 1: one inf (rank 1, step 3) and one NaN (rank 0, step 10): both skipped on every rank,
    exactly like stock Horovod; residuals stay finite; GraVAC keeps observing; counted in stats()."""
    for r in amp_results:
        assert r["manual-none"]["skipped"] == [3, 10]
        for kind in ("static", "adaptive"):
            for mode in ("manual", "amp"):
                got = r[f"{mode}-{kind}"]
                assert got["skipped"] == [3, 10], (mode, kind, got["skipped"])
                assert got["residuals_finite"] and got["params_finite"] and got["gains_finite"]
                assert got["stats"]["nonfinite_steps"] == 2 and got["stats"]["step"] == STEPS
        # the policy observed every finished step but the two non-finite ones (observations lag 2 steps)
        assert r["manual-adaptive"]["observed"] == STEPS - 2 - 2
        # AMP trains as with stock Horovod: the same loss-scale trace, a loss of the same order
        assert r["amp-static"]["scales"] == r["amp-adaptive"]["scales"] == r["amp-none"]["scales"]
        for kind in ("static", "adaptive"):
            assert r[f"amp-{kind}"]["loss"] < 2 * r["amp-none"]["loss"] + 0.05
    assert amp_results[0]["manual-static"]["loss"] == amp_results[1]["manual-static"]["loss"]


def test_huge_finite_gradients_train_like_stock(amp_results):
    """Item 2: GradScaler(init_scale=2**120) makes ||g||^2 overflow float32; training must go on as with
    stock Horovod (same loss-scale trace, nothing skipped), the statistics marked saturated."""
    for r in amp_results:
        assert r["huge-none"]["skipped"] == []
        for kind in ("static", "adaptive"):
            got = r[f"huge-{kind}"]
            assert got["skipped"] == [] and got["scales"] == r["huge-none"]["scales"]
            assert got["params_finite"] and got["residuals_finite"]
            assert got["stats"]["nonfinite_steps"] == 0 and got["stats"]["saturated_steps"] == STEPS
            assert got["loss"] < 2 * r["huge-none"]["loss"] + 0.05


# ------------------------------------------------------------------------------------------------
# misuse_job: items 3, 4, 6, 7, 8, 10, 12
# ------------------------------------------------------------------------------------------------
def _shared_object() -> dict:
    """Item 3: two models with the same layer names, one compression object."""
    import horovod.torch as hvd

    from crossover import FP16Compression, StaticCompression

    out = {}
    for name, comp in (("static", StaticCompression("topk", cf=4, min_compress_numel=1)), ("fp16", FP16Compression())):
        models = [_net(), _net()]
        opts = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.02),
                                         named_parameters=m.named_parameters(), compression=comp) for m in models]
        gen = torch.Generator().manual_seed(hvd.rank())
        try:
            for _ in range(3):
                x, y = _batch(gen)
                for m, o in zip(models, opts):
                    o.zero_grad()
                    torch.nn.functional.mse_loss(m(x), y).backward()
                    o.step()
            out[name] = "ok"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _mismatched_shapes() -> str:
    """Item 4: the same parameter name with a different shape on each rank."""
    import horovod.torch as hvd

    from crossover import StaticCompression

    shape = (250, 200) if hvd.rank() == 0 else (200, 250)
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("w", p)],
                                   compression=StaticCompression("topk", cf=100))
    try:
        (p * torch.randn(shape)).sum().backward()
        opt.step()
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def _csv_files(tmp: str) -> dict:
    """Item 6: a pattern without {rank}, an existing file, CFs that change; fp16 pass-through steps."""
    import csv
    import os

    import horovod.torch as hvd

    from crossover import AdaptiveCompression

    own = os.path.join(tmp, f"log.rank{hvd.rank()}.csv")
    with open(own, "w") as fh:
        fh.write("user data\n")
    comp = AdaptiveCompression("topk", cf_min=4, cf_max=64, epsilon=0.2, window=4, min_compress_numel=1,
                               log_csv=os.path.join(tmp, "log.csv"))
    model = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02),
                                   named_parameters=model.named_parameters(), compression=comp)
    _steps(model, opt, 40)
    with open(own) as fh:
        untouched = fh.read() == "user data\n"
    with open(comp.driver.log.path) as fh:
        rows = list(csv.reader(fh))
    # fp16 parameters: every gradient passes through; steps are still counted
    half = AdaptiveCompression(min_compress_numel=1)
    hm = _net().half()
    hopt = hvd.DistributedOptimizer(torch.optim.SGD(hm.parameters(), lr=0.01),
                                    named_parameters=hm.named_parameters(), compression=half)
    for _ in range(4):
        hopt.zero_grad()
        hm(torch.randn(4, 200).half()).float().sum().backward()
        hopt.step()
    head = rows[0]
    col = {name: head.index(name) for name in ("probe1_cf", "probe1_gain", "skipped", "grad_sq", "acc_sq", "probe1_sq")}
    probed = [r for r in rows[1:] if r[col["probe1_cf"]] and r[col["skipped"]] == "0"]
    # the logged norms give the logged gain: probe1_gain = sqrt(probe1_sq / acc_sq)
    norms_ok = bool(probed) and all(
        float(r[col["grad_sq"]]) > 0 and float(r[col["acc_sq"]]) > 0
        and abs(float(r[col["probe1_gain"]]) - (float(r[col["probe1_sq"]]) / float(r[col["acc_sq"]])) ** 0.5) < 1e-6
        for r in probed)
    return {"path": os.path.basename(comp.driver.log.path), "untouched": untouched, "header": rows[0],
            "norms_ok": norms_ok,
            "widths": sorted({len(r) for r in rows}), "rows": len(rows) - 1,
            "cfs": sorted({r[5] for r in rows[1:]} | {r[7] for r in rows[1:]}), "half_step": half.stats()["step"]}


def _process_set() -> dict:
    """Item 7: optimizers on process sets (HOROVOD_DYNAMIC_PROCESS_SETS=1), top-k by allgather: Horovod's
    test_optimizer_process_sets pattern (every rank passes the even set, {0}), then each rank its own set."""
    import horovod.torch as hvd

    from crossover import StaticCompression

    out = {}
    even, odd = hvd.add_process_set([0]), hvd.add_process_set([1])
    for name, ps in (("even", even), ("own", even if hvd.rank() == 0 else odd)):
        model = _net()
        comp = StaticCompression("topk", cf=100, min_compress_numel=1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02),
                                       named_parameters=model.named_parameters(), compression=comp, process_set=ps)
        _steps(model, opt, 3)
        out[name] = {"bytes": comp.stats()["bytes_sent"], "world": comp.comm.size()}
    hvd.remove_process_set(odd)
    hvd.remove_process_set(even)
    return out


def _dynamic_requires_grad() -> bool:
    """Item 8: Horovod's test_dynamic_requires_grad, with our compression at min_compress_numel=1."""
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, StaticCompression

    for comp in (StaticCompression("topk", min_compress_numel=1), AdaptiveCompression(min_compress_numel=1)):
        comp2 = type(comp)("topk", min_compress_numel=1)
        gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
        inp = torch.rand([1, 1, 100, 100])
        gopt = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                        named_parameters=gen.named_parameters(), compression=comp)
        dopt = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                        named_parameters=disc.named_parameters(), compression=comp2)
        for _ in range(10):
            for train_gen in (True, False):
                for p in gen.parameters():
                    p.requires_grad_(train_gen)
                for p in disc.parameters():
                    p.requires_grad_(not train_gen)
                gopt.zero_grad()
                dopt.zero_grad()
                disc(gen(inp)).sum().backward()
                (gopt if train_gen else dopt).step()
    return True


def _adasum() -> str:
    """Item 10: op=hvd.Adasum is refused with the documented error."""
    import horovod.torch as hvd

    from crossover import StaticCompression

    model = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02),
                                   named_parameters=model.named_parameters(),
                                   compression=StaticCompression("topk", min_compress_numel=1), op=hvd.Adasum)
    x, y = _batch(torch.Generator().manual_seed(hvd.rank()))
    try:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        return "no error"
    except ValueError as exc:
        return str(exc)


def _small_model() -> dict:
    """Item 12: Horovod's MNIST network (every tensor < 16384 elements) with the defaults."""
    import logging

    import horovod.torch as hvd

    from crossover import AdaptiveCompression

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, 10, kernel_size=5)
            self.conv2 = torch.nn.Conv2d(10, 20, kernel_size=5)
            self.fc1 = torch.nn.Linear(320, 50)
            self.fc2 = torch.nn.Linear(50, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(torch.max_pool2d(self.conv1(x), 2))
            x = torch.relu(torch.max_pool2d(self.conv2(x), 2))
            return self.fc2(torch.relu(self.fc1(x.view(-1, 320))))

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("horovod_ext").addHandler(Keep())
    comp = AdaptiveCompression()
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=comp)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 1, 28, 28)).sum().backward()
        opt.step()
    return {"step": comp.stats()["step"], "said": [m for m in records if "min_compress_numel" in m]}


def misuse_job(tmp: str) -> dict:
    return {"requires_grad": _dynamic_requires_grad(), "csv": _csv_files(tmp), "process_set": _process_set(),
            "small": _small_model(), "shared": _shared_object(), "adasum": _adasum(),
            "shapes": _mismatched_shapes()}


@pytest.fixture(scope="module")
def misuse_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misuse")
    return run_function(misuse_job, args=[str(tmp)], timeout=300, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})


def test_one_object_shared_by_two_optimizers_is_refused(misuse_results):
    """Item 3: a stateful object raises a clear error at the second optimizer's first step; fp16 shares."""
    for r in misuse_results:
        assert "already used by another DistributedOptimizer" in r["shared"]["static"]
        assert r["shared"]["fp16"] == "ok"


def test_mismatched_shapes_under_one_name_raise(misuse_results):
    """Item 4: as stock Horovod's 'Mismatched ALLREDUCE tensor shapes' (a RuntimeError), on every rank: the
    agreement checks in the statistics name the parameter and each rank's own shape (issue 45)."""
    for rank, r in enumerate(misuse_results):
        assert "the ranks disagree on the shape of 'w'" in r["shapes"] and f"this rank ({rank})" in r["shapes"]
        assert ("shape (250, 200)" if rank == 0 else "shape (200, 250)") in r["shapes"]


def test_csv_per_rank_never_mixed_stable_header_and_step_count(misuse_results):
    """Item 6: one file per rank, an existing file is left alone, a header that does not depend on the
    CFs of step 1, and steps counted when every gradient passes through (fp16 parameters)."""
    for rank, r in enumerate(misuse_results):
        c = r["csv"]
        assert c["untouched"] and c["path"] == f"log.rank{rank}.1.csv"
        assert c["header"] == ["step", "sent_cf", "step_time_s", "bytes_sent", "bytes_dense", "probe1_cf",
                               "probe1_gain", "probe2_cf", "probe2_gain", "skipped", "grad_sq", "acc_sq",
                               "probe1_sq", "probe2_sq", "momentum"]
        assert c["widths"] == [15] and c["rows"] == 38 and len(set(c["cfs"]) - {""}) >= 2  # the CF changed
        assert c["norms_ok"]  # the squared norms behind each gain are logged too
        assert c["half_step"] == 4


def test_optimizer_on_a_process_set_does_not_hang(misuse_results):
    """Item 7: top-k's allgather and world size follow the optimizer's process set."""
    r0, r1 = misuse_results
    assert r0["process_set"]["even"]["bytes"] > 0 and r0["process_set"]["even"]["world"] == 1
    assert r1["process_set"]["even"]["bytes"] == 0  # rank 1 is not in the set: Horovod reduces nothing
    for r in misuse_results:
        assert r["process_set"]["own"]["bytes"] > 0 and r["process_set"]["own"]["world"] == 1


def test_dynamic_requires_grad_at_min_numel_1(misuse_results):
    """Item 8: Horovod's test_dynamic_requires_grad pattern with StaticCompression and GraVAC."""
    assert [r["requires_grad"] for r in misuse_results] == [True, True]


def test_adasum_is_refused(misuse_results):
    """Item 10: the documented refusal fires under op=hvd.Adasum."""
    for r in misuse_results:
        assert "does not support op=hvd.Adasum" in r["adasum"]


def test_small_model_is_said_once_and_steps_counted(misuse_results):
    """Item 12: a model whose tensors are all below min_compress_numel: one log line, steps counted."""
    for r in misuse_results:
        assert r["small"]["step"] == 5 and len(r["small"]["said"]) == 1


# ------------------------------------------------------------------------------------------------
# item 5: load_state_dict validates everything before applying anything (no Horovod job needed)
# ------------------------------------------------------------------------------------------------
def _bad_states(state: dict) -> list[tuple[str, dict]]:
    def with_(**kw):
        return {**state, **kw}

    pol = state["policy"]
    return [
        ("nan residual", with_(residuals={"w": torch.tensor([1.0, float("nan"), 0.0, 0.0])})),
        ("wrong-shape residual", with_(residuals={"w": torch.zeros(7)})),
        ("non-tensor residual", with_(residuals={"w": [0.0] * 4})),
        ("negative step", with_(step=-3)),
        ("negative bytes", with_(bytes_sent=-1)),
        ("nan step time", with_(last_step_time=float("nan"))),
        ("absurd floor", with_(policy={**pol, "floor": 1e300})),
        ("floor below 1", with_(policy={**pol, "floor": 0.0})),
        ("garbage policy", with_(policy={"version": pol.get("version")})),
        ("garbage record", with_(current={"step": 1})),
        ("missing seed", {k: v for k, v in state.items() if k != "seed"}),
    ]


def test_load_state_dict_validates_first_and_changes_nothing_on_error():
    from crossover import AdaptiveCompression

    comp = AdaptiveCompression("topk", cf_min=4)
    comp.codec.memory.residual("w", torch.zeros(4))[:] = 1.0  # this run has a 4-element tensor "w"
    good = comp.state_dict()
    for what, bad in _bad_states(good):
        with pytest.raises(ValueError):
            comp.load_state_dict(bad)
        after = comp.state_dict()
        assert torch.equal(after.pop("residuals")["w"], torch.ones(4)), what
        assert after == {k: v for k, v in good.items() if k != "residuals"}, what
    comp.load_state_dict(good)  # the good state still loads


def test_statistics_of_huge_gradients_stay_finite_in_float32():
    """Item 2: ||g||^2 of a gradient of 1e36 per element is finite in float64 and must stay finite
    (clamped, marked saturated) in the float32 vector summed over ranks; inf/NaN stay non-finite."""
    from crossover.adaptive.static import StaticPolicy
    from crossover.compression import kernels
    from crossover.compression.wire import STAT_MAX, SparseStatsLayout
    from crossover.driver import SparseStepDriver

    g = torch.full((1000,), 1e36)
    sq = kernels.sumsq(g)
    assert math.isfinite(sq) and sq > 1e74
    layout = SparseStatsLayout(1)
    vec = torch.tensor(layout.local(step_time=0.1, grad_sq=sq, acc_sq=sq, probe_sq=[sq]), dtype=torch.float32)
    assert bool(torch.isfinite(vec).all()) and bool(torch.isfinite(vec * 64).all())
    bad = layout.local(step_time=0.1, grad_sq=float("inf"), acc_sq=float("nan"), probe_sq=[1.0])
    assert math.isinf(bad[layout.GRAD_SQ]) and math.isnan(bad[layout.ACC_SQ])
    drv = SparseStepDriver(StaticPolicy(cf=4.0), compressor="topk", seed=0)
    drv.begin_step(0.0)
    drv.add_reduced((vec * 2).tolist(), 2)  # a Sum over two ranks
    assert drv.current.saturated and not drv.current.nonfinite and drv.saturated_steps == 1
    drv.add_reduced(bad, 1)
    assert drv.current.nonfinite and drv.nonfinite_steps == 1
    assert STAT_MAX * 2 ** 27 < torch.finfo(torch.float32).max


@pytest.mark.parametrize("transport", ["allgather", "allreduce"])
def test_quant_codec_survives_a_nonfinite_gradient(transport):
    """Item 1 for DQ-SGD/QSGD: an inf on one rank does not crash that rank's encode (the other would hang);
    every rank decodes NaN and resets the tensor's residual."""
    from crossover.compression.collectives import SimulatedGroup
    from crossover.compression.quant_codec import QuantCodec

    grp = SimulatedGroup(2)
    codecs = [QuantCodec(error_feedback=True) for _ in range(2)]
    gs = [torch.randn(5000), torch.randn(5000)]
    gs[1][3] = float("inf")
    enc = [quant_encode(c, "w", g, 4, 1, grp.rank_view(r), transport) for r, (c, g) in enumerate(zip(codecs, gs))]
    reduced = (enc[0][0].float() + enc[1][0].float()) / 2
    for r, c in enumerate(codecs):
        out, (_, sq) = c.decode(reduced.to(enc[r][0].dtype).clone(), enc[r][1], grp.rank_view(r))
        assert not math.isfinite(sq) and bool(torch.isnan(out).all())
        assert bool((c.memory._residuals["w"] == 0).all())


def test_sparse_codec_restores_residuals_of_a_nonfinite_step():
    """Item 1, codec level: after a step with a NaN on rank 1, rank 0's residual is what it was before
    the step (up to rounding), rank 1's is reset, both decode NaN and both drivers count the step."""
    from crossover.adaptive.static import StaticPolicy
    from crossover.compression.collectives import SimulatedGroup
    from crossover.compression.sparse_codec import SparseCodec
    from crossover.driver import SparseStepDriver

    grp = SimulatedGroup(2)
    codecs = [SparseCodec("topk") for _ in range(2)]
    drivers = [SparseStepDriver(StaticPolicy(cf=10.0), compressor="topk", seed=0) for _ in range(2)]
    for step in range(2):
        gs = [torch.randn(50000), torch.randn(50000)]
        if step == 1:
            gs[1][3] = float("nan")
        before = [c.memory._residuals.get("w", torch.zeros(50000)).clone() for c in codecs]
        for d in drivers:
            d.begin_step(float(step))
        enc = [sparse_encode(c, "w", g, d.current, 0.0, grp.rank_view(r))
               for r, (c, g, d) in enumerate(zip(codecs, gs, drivers))]
        reduced = (enc[0][0] + enc[1][0]) / 2
        for r, c in enumerate(codecs):
            out, stats = c.decode(reduced.clone(), enc[r][1], grp.rank_view(r))
            drivers[r].add_reduced(stats.tolist(), 2)
            assert bool(torch.isnan(out).all()) == (step == 1)
    res0, res1 = (c.memory._residuals["w"] for c in codecs)
    assert torch.allclose(res0, before[0], atol=1e-5) and bool((res1 == 0).all())
    assert [d.nonfinite_steps for d in drivers] == [1, 1]


# ------------------------------------------------------------------------------------------------
# Issue 27 item 4: log_csv never stops training (a full disk in a real 2-rank job)
# ------------------------------------------------------------------------------------------------
PAGE = 4096


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs with two free pages (one per rank's log): rows fail with ENOSPC after ~30 steps."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / "full"
    d.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        (d / "filler").write_bytes(b"\0" * (64 * 1024 - 2 * PAGE))
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


def _train_logged(log_csv: object, steps: int) -> tuple:
    """Static top-k at CF 4 (deterministic): a digest of the weights after `steps` steps."""
    import hashlib

    import horovod.torch as hvd

    from crossover import StaticCompression

    comp = StaticCompression("topk", cf=4, min_compress_numel=1, log_csv=log_csv)
    model = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02),
                                   named_parameters=model.named_parameters(), compression=comp)
    _steps(model, opt, steps)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    assert comp.stats()["step"] == steps
    return digest.hexdigest(), comp.driver.log


def full_disk_job(folder: str, steps: int) -> dict:
    import logging
    import os

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("crossover").addHandler(Keep())
    plain, _ = _train_logged(None, steps)
    logged, slog = _train_logged(os.path.join(folder, "g-{rank}.csv"), steps)
    with open(slog.path) as fh:
        rows = len(fh.read().splitlines()) - 1
    refused = {}
    for bad in ("{foo}.csv", os.path.join(folder, "missing-{rank}", "g.csv"), 123):
        try:
            _train_logged(bad, 1)
            refused[str(bad)] = "accepted"
        except ValueError as exc:
            refused[str(bad)] = str(exc)
    return {"same_weights": plain == logged, "rows": rows, "stopped": slog.stopped,
            "said": [m for m in said if "log_csv" in m], "refused": refused}


def test_full_disk_stops_the_log_not_training(full_disk):
    """Item 4 (issue 27): rows stop with ENOSPC part-way; every rank trains to the end with the weights
    of a run without log_csv and says so once; a bad pattern or a missing per-rank directory is refused
    at construction on every rank (ValueError naming log_csv)."""
    steps = 80
    results = run_function(full_disk_job, args=[str(full_disk), steps], timeout=300)
    for r in results:
        assert r["same_weights"]
        assert 0 < r["rows"] < steps - 2 and "No space left" in r["stopped"], r
        assert len(r["said"]) == 1 and "training goes on" in r["said"][0], r["said"]
        assert all("log_csv" in msg for msg in r["refused"].values()), r["refused"]
        assert "does not exist" in r["refused"][str(full_disk / "missing-{rank}" / "g.csv")]


# ------------------------------------------------------------------------------------------------
# Issue 27, weak items: fp16/fp64 models are said once and stats() reports what was sent (CF 1)
# ------------------------------------------------------------------------------------------------
class _Heard:
    """The messages logged under "horovod_ext" while in the block (`said`)."""

    def __enter__(self) -> list[str]:
        import logging

        said: list[str] = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("horovod_ext").addHandler(self.handler)
        return said

    def __exit__(self, *exc: object) -> None:
        import logging

        logging.getLogger("horovod_ext").removeHandler(self.handler)


def _train_with(comp, dtype: torch.dtype = torch.float32, steps: int = 4) -> None:
    import horovod.torch as hvd

    model = _net().to(dtype)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=comp)
    _steps(model, opt, steps, dtype)


def _dtype_run(make, dtype: torch.dtype, steps: int = 4) -> dict:
    with _Heard() as said:
        comp = make()
        _train_with(comp, dtype, steps)
    st = comp.stats()
    return {"cf": st["compression_factor"], "step": st["step"], "sent": st["bytes_sent"], "dense": st["bytes_dense"],
            "said": [m for m in said if "no gradient was compressed" in m]}


def dtype_job() -> dict:
    from crossover import AdaptiveCompression, StaticCompression
    from horovod_ext.torch_quantization import QSGDCompression

    makers = {"gravac": lambda: AdaptiveCompression("topk", cf_min=4, min_compress_numel=1),
              "static": lambda: StaticCompression("topk", cf=4, min_compress_numel=1),
              "qsgd": lambda: QSGDCompression(4, min_compress_numel=1)}
    return {f"{name}-{str(dtype)[6:]}": _dtype_run(make, dtype)
            for name, make in makers.items() for dtype in (torch.float16, torch.float64, torch.float32)}


def test_fp16_fp64_models_said_once_and_stats_honest():
    for r in run_function(dtype_job, timeout=300):
        for name, got in r.items():
            assert got["step"] == 4, (name, got)
            if name.endswith("float32"):  # the control: compressed, said nothing
                assert got["cf"] > 1 and got["sent"] < got["dense"] and not got["said"], (name, got)
            else:
                assert got["cf"] == 1.0 and got["sent"] == got["dense"], (name, got)
                assert len(got["said"]) == 1 and name.split("-")[1] in got["said"][0], (name, got["said"])


def threads_job() -> list[int]:
    """Three objects in one process: 1 torch thread a rank, then as many as the cores (2 ranks oversubscribe
    them), then again: the warning is said at the second object's first step, and once per process."""
    import os

    from crossover import StaticCompression

    counts = []
    with _Heard() as said:
        for threads in (1, len(os.sched_getaffinity(0)), len(os.sched_getaffinity(0))):
            torch.set_num_threads(threads)
            _train_with(StaticCompression("topk", cf=4, min_compress_numel=1), steps=2)
            counts.append(len([m for m in said if "oversubscribe" in m and "OMP_NUM_THREADS=" in m]))
    return counts


def test_oversubscribed_cpu_said_once():
    """horovodrun leaves torch's threads at the core count in every rank (torchrun sets 1): on CPU tensors the
    Horovod objects say so once, naming OMP_NUM_THREADS."""
    for r in run_function(threads_job, timeout=300):
        assert r == [0, 1, 1], r


# ------------------------------------------------------------------------------------------------
# Issue 27, weak item: inf only in a tensor too small to compress (passed through untouched)
# ------------------------------------------------------------------------------------------------
SMALL_POISON_STEP = 3


def _train_small_poison(kind: str) -> dict:
    """Only rank 1, only at SMALL_POISON_STEP, puts inf into model[0].bias (100 elements: passed through);
    model[0].weight (20 000) is compressed. Manual GradScaler-style skip."""
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, StaticCompression
    from horovod_ext.torch_quantization import QSGDCompression

    comp = {"static": lambda: StaticCompression("topk", cf=4),
            "adaptive": lambda: AdaptiveCompression("topk", cf_min=4, cf_max=64, epsilon=0.2, window=4),
            "qsgd": lambda: QSGDCompression(4, error_feedback=True)}[kind]()
    model = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02),
                                   named_parameters=model.named_parameters(), compression=comp)
    gen = torch.Generator().manual_seed(hvd.rank())
    skipped, zeroed = [], None
    for step in range(STEPS):
        x, y = _batch(gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        hook = None
        if step == SMALL_POISON_STEP and hvd.rank() == 1:
            hook = model[0].bias.register_hook(lambda g: g.index_put((torch.tensor(2),), torch.tensor(float("inf"))))
        loss.backward()
        if hook is not None:
            hook.remove()
        opt.synchronize()
        if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            with opt.skip_synchronize():
                opt.step()
        else:
            skipped.append(step)
        if step == SMALL_POISON_STEP:
            st = comp.stats()  # between steps: the step is settled here
            zeroed = bool((comp.codec.memory._residuals["0.weight"] == 0).all())
            nonfinite_then = st["nonfinite_steps"]
    st = comp.stats(debug=True)
    return {"skipped": skipped, "nonfinite_steps": st["nonfinite_steps"], "nonfinite_then": nonfinite_then,
            "zeroed": zeroed, "observed": st.get("policy/step"),
            "params": [float(p.detach().double().sum()) for p in model.parameters()],
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def small_poison_job() -> dict:
    return {kind: _train_small_poison(kind) for kind in ("static", "adaptive", "qsgd")}


def test_inf_in_a_passed_through_tensor_counts_and_leaves_no_trace():
    """The step is skipped on every rank (Horovod's reduced small tensor, dense, is inf everywhere), counted in
    nonfinite_steps on every rank, not observed by the policy, and the compressed tensor's residual forgets
    it (it was keeping the skipped step's gradient). Every rank ends with the same weights."""
    r0, r1 = run_function(small_poison_job, timeout=300)
    for r in (r0, r1):
        for kind, got in r.items():
            assert got["skipped"] == [SMALL_POISON_STEP], (kind, got)
            assert got["nonfinite_steps"] == got["nonfinite_then"] == 1, (kind, got)
            assert got["zeroed"] and got["finite"], (kind, got)
        assert r["static"]["observed"] == STEPS - 1 - 2  # one step late, plus the step in flight
        assert r["adaptive"]["observed"] == STEPS - 1 - 2
    for kind in r0:
        assert r0[kind]["params"] == r1[kind]["params"], kind


# ------------------------------------------------------------------------------------------------
# Issue 27, weak item: random-k with a different seed on each rank is refused, the same on every rank
# ------------------------------------------------------------------------------------------------
def _randomk_run(seed: int, tag: str, steps: int = 4) -> list[str]:
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, StaticCompression

    out = []
    for i, make in enumerate((lambda: StaticCompression("randomk", cf=4, seed=seed, min_compress_numel=1),
                              lambda: AdaptiveCompression("randomk", cf_min=4, seed=seed, min_compress_numel=1))):
        comp = make()
        model = _net()
        # fresh names per run: a refused step leaves its other allreduces unsynchronized under the old names
        named = [(f"{tag}{i}.{n}", p) for n, p in model.named_parameters()]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02), named_parameters=named,
                                       compression=comp)
        gen = torch.Generator().manual_seed(hvd.rank())
        try:
            for _ in range(steps):
                x, y = _batch(gen)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            out.append(f"trained {comp.stats()['step']}")
        except ValueError as exc:
            out.append(str(exc))
    return out


def seed_job() -> dict:
    import horovod.torch as hvd

    return {"rank_seeds": _randomk_run(hvd.rank(), "a"), "far_seeds": _randomk_run(1000 * hvd.rank() + 7, "b"),
            "same_seed": _randomk_run(11, "c")}


def test_randomk_with_a_seed_per_rank_is_refused_on_every_rank():
    """`StaticCompression("randomk", seed=hvd.rank())` summed values drawn at different indices (replicas
    silently diverged): the seed's fingerprint in the reduced statistics now stops it at the first step,
    with the same error on every rank; equal seeds train as before."""
    for r in run_function(seed_job, timeout=300):
        for case in ("rank_seeds", "far_seeds"):
            for msg in r[case]:
                assert "different seeds" in msg and "same seed on every rank" in msg, (case, msg)
        assert r["same_seed"] == ["trained 4", "trained 4"]
