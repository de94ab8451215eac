"""Issue 30, grouped transport in real Horovod jobs (3 ranks, Gloo, CPU): the codec's allgathers travelling in
groups give bit for bit the averaged gradients and residuals of one allgather per tensor.

One job trains pairs of identical models side by side on the same batches, one optimizer with `grouped=True`
(several groups: small caps), its twin with `grouped=False`, and compares after every step: a model with mixed
dtypes (a float64 parameter passes through) and tensors below `min_compress_numel`, top-k (int32 pairs) and
QSGD (uint8 codes), on the global set (3 ranks) and on a process set {0, 1}, with an inf on one rank at one
step (every rank decodes NaN for that tensor, skips the step, and the residuals are restored alike).
The compressed tensors must match bit for bit. The tensors that pass through go by Horovod's own fused
allreduce, whose summation order over 3 ranks follows how the tensors of a cycle were fused (1 ulp apart
between two optimizers): they are compared to 1e-6 relative (1e-5 of the tensor's largest entry where the
ranks' terms cancel), and the twin restarts every step from the grouped model's weights so that an ulp cannot
grow into a different top-k selection.
"""

from __future__ import annotations

import pytest
import torch
from hvd_harness import run_function

STEPS = 8
POISON_STEP = 4  # rank 1 puts an inf into one compressed gradient
COMPRESSED = ("a.weight", "b.weight")


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[3, 5] = float("inf")
    return grad


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal but for the summation order of a 3-rank sum: within 1e-6 relative, or 1e-5 of the tensor's largest
    entry where the ranks' terms cancel (an ulp of the terms, not of their small sum)."""
    scale = float(torch.nan_to_num(a, 0.0, 0.0, 0.0).abs().max()) if a.numel() else 0.0
    return torch.allclose(a, b, rtol=1e-6, atol=max(1e-9, 1e-5 * scale), equal_nan=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 96)  # 6144 weights: compressed
        self.b = torch.nn.Linear(96, 64)  # compressed
        self.c = torch.nn.Linear(64, 8)  # 512 weights: below min_compress_numel (dense)
        self.scale = torch.nn.Parameter(torch.ones(8, dtype=torch.float64))  # float64: passes through

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))) * self.scale.float()


def _compression(kind: str):
    from crossover import QSGDCompression, StaticCompression

    if kind == "topk":
        return StaticCompression("topk", cf=10, min_compress_numel=1000)
    return QSGDCompression(bits=4, error_feedback=True, min_compress_numel=1000, transport="allgather")


def _pair_job(kind: str, on_process_set: bool, switch: str = "grouped") -> dict:
    """`switch`: what differs between the twins, "grouped" (one allgather per group or per tensor) or "bitmap"
    (top-k's allgather as a bitmap and values, or as pairs; both grouped)."""
    import horovod.torch as hvd

    ps = hvd.add_process_set([0, 1]) if on_process_set else None
    if ps is not None and not ps.included():  # rank 2: only takes part in creating and removing the set
        hvd.remove_process_set(ps)
        return {"excluded": True}
    kw = {} if ps is None else {"process_set": ps}
    runs = []
    for on in (True, False):  # the same names: the shared seeds (QSGD's rounding) follow them
        model = _Net()
        comp = _compression(kind)
        if switch == "bitmap":
            comp.codec.gather_bitmap = on
        else:
            comp.grouped = on
        if on_process_set:  # caps of 24 kB of dense gradient: "b" alone, then "a"; else both in one group
            comp.comm.first_bytes = comp.comm.group_bytes = 4 * 6000
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), compression=comp, **kw)
        runs.append((model, comp, opt))
    gen = torch.Generator().manual_seed(hvd.rank())
    out: dict = {"equal_grads": [], "close_grads": [], "nan_at": [], "equal_params": True, "groups": None,
                 "at_first_wait": []}
    import horovod_ext._internals as internals

    real_wait, waiting = internals.torch_wait_quietly, {}

    def wait(handle, *a, **kw):  # synchronize()'s waits: is everything of the step's own already on its way?
        comp = waiting.pop("comp", None)
        if comp is not None:
            out["at_first_wait"].append([comp._phase, not comp._open])
        return real_wait(handle, *a, **kw)

    internals.torch_wait_quietly = wait
    for step in range(STEPS):
        x = torch.randn(16, 64, generator=gen)
        y = torch.randn(16, 8, generator=gen)
        grads = []
        for model, _comp, opt in runs:
            opt.zero_grad()
            hook = model.b.weight.register_hook(_poison) if step == POISON_STEP and hvd.rank() == 1 else None
            torch.nn.functional.mse_loss(model(x), y).backward()  # Horovod compresses in backward
            if hook is not None:
                hook.remove()
            waiting["comp"] = _comp
            opt.synchronize()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
                with opt.skip_synchronize():
                    opt.step()
        g0, g1 = grads
        out["equal_grads"].append(all(_same(g0[n], g1[n]) for n in COMPRESSED))
        out["close_grads"].append(all(_close(g0[n], g1[n]) for n in g0))
        out["nan_at"].append(sorted(n for n in g0 if bool(g0[n].isnan().any())))
        out["dtypes"] = sorted({str(g.dtype) for g in g0.values()})
        (m0, _, _), (m1, _, _) = runs
        out["equal_params"] &= all(_close(p.detach(), q.detach()) for p, q in zip(m0.parameters(), m1.parameters()))
        with torch.no_grad():  # the next step starts from the same weights (see the module doc)
            for p, q in zip(m0.parameters(), m1.parameters()):
                q.copy_(p)
    internals.torch_wait_quietly = real_wait
    (m0, c0, _), (m1, c1, _) = runs
    r0, r1 = c0.codec.memory._residuals, c1.codec.memory._residuals
    out["equal_residuals"] = r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)
    out["residual_keys"] = sorted(r0)
    out["groups"] = [len(g.members) for g in c0.comm._groups]
    out["world"] = c0.comm.size()
    out["sent"] = [c0.stats()["bytes_sent"], c1.stats()["bytes_sent"]]
    hvd.allreduce(torch.zeros(1), name="grouped.done", **kw)
    if ps is not None:
        hvd.remove_process_set(ps)
    return out


def _dense_measured() -> dict:
    """GraVAC's dense measured steps (warm-up): the gradient goes as it is, its statistics by an allreduce of
    their own; the averages are stock Horovod's and the statistics reach the driver."""
    import horovod.torch as hvd

    from crossover import AdaptiveCompression

    runs = []
    for comp in (AdaptiveCompression(warmup_steps=100, min_compress_numel=1000), hvd.Compression.none):
        model = _Net()
        runs.append((model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                                     named_parameters=model.named_parameters(), compression=comp)))
    gen = torch.Generator().manual_seed(hvd.rank())
    close = []
    for _ in range(3):
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)
        grads = []
        for model, opt in runs:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.synchronize()
            grads.append([p.grad.clone() for p in model.parameters()])
        close.append(all(_close(a, b) for a, b in zip(*grads)))
        with torch.no_grad():
            for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()):
                q.copy_(p)
    comp = runs[0][1]._compression
    rec = comp.driver.current
    return {"close": close, "tensors": rec.tensors, "acc_sq": rec.acc_sq, "sent_cf": rec.sent_cf,
            "measure": rec.measure}


def grouped_job() -> dict:
    out = {f"{kind}-{'ps' if ps else 'global'}": _pair_job(kind, ps)
           for kind in ("topk", "qsgd") for ps in (False, True)}
    out["dense"] = _dense_measured()
    out["bitmap-global"] = _pair_job("topk", False, "bitmap")
    return out


@pytest.fixture(scope="module")
def results():
    # 3 ranks: an odd world for the global set, and a process set {0, 1} that leaves rank 2 out
    return run_function(grouped_job, np=3, timeout=400, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})


CASES = ["topk-global", "topk-ps", "qsgd-global", "qsgd-ps"]


def _members(results, case):
    return [r[case] for r in results if not r[case].get("excluded")]


@pytest.mark.parametrize("case", CASES)
def test_grouped_transport_is_bit_exact(results, case):
    members = _members(results, case)
    assert len(members) == (2 if case.endswith("-ps") else 3)
    for c in members:
        assert all(c["equal_grads"]), c["equal_grads"]
        assert all(c["close_grads"]) and c["equal_params"] and c["equal_residuals"]
        # top-k: the float32 gradients of min_compress_numel elements travel in DDP's buckets (reverse registration
        # order, cut at the groups' caps: one bucket on the global set; on the process set's 24 kB, "b" and "a"
        # alone, each then on its own), a residual each; "c" and the biases go dense
        buckets = (0 if case.endswith("-ps") else 1) if case.startswith("topk") else 0
        keys = {0: sorted(COMPRESSED), 1: ["crossover.bucket000[a.weight..b.weight]"]}[buckets]
        assert c["residual_keys"] == keys
        assert c["dtypes"] == ["torch.float32", "torch.float64"]
        assert c["world"] == len(members)
        groups = [1] * (buckets or 2) if case.endswith("-ps") else [buckets or 2]  # a bucket: one group
        assert c["groups"] == groups, "planned groups and their sizes"
        # the buckets and the open groups have left when synchronize() begins, before its first wait
        assert c["at_first_wait"] == [["submitted", True]] * (2 * STEPS), c["at_first_wait"]


def _nan_at(case: str) -> list[str]:
    """What decodes NaN when rank 1's b.weight holds an inf: its bucket (top-k on the global set), the tensor (QSGD,
    and top-k on the process set, where b.weight travels alone)."""
    if case.startswith("qsgd") or case.endswith("-ps"):
        return ["b.weight"]
    return ["a.weight", "b.weight"]


@pytest.mark.parametrize("case", CASES)
def test_nonfinite_step_decodes_nan_everywhere_in_both_transports(results, case):
    members = _members(results, case)
    for c in members:
        assert c["nan_at"][POISON_STEP] == _nan_at(case), c["nan_at"]
        assert all(not n for i, n in enumerate(c["nan_at"]) if i != POISON_STEP), c["nan_at"]
    assert all(c["nan_at"] == members[0]["nan_at"] for c in members)


def test_bitmaps_give_the_pairs_averages_bit_for_bit_in_fewer_bytes(results):
    """CF 10: the allgather carries a bitmap of each tensor and its values (wire.gather_bitmap); the twin
    sends pairs. The same averaged gradients, residuals and NaN step on 3 ranks whose gradients differ."""
    members = _members(results, "bitmap-global")
    assert len(members) == 3
    for c in members:
        assert all(c["equal_grads"]) and all(c["close_grads"]) and c["equal_params"] and c["equal_residuals"]
        assert c["nan_at"][POISON_STEP] == _nan_at("topk-global")
        bitmap, pairs = c["sent"]
        assert bitmap < 0.8 * pairs, c["sent"]


def test_dense_measured_steps_average_like_stock(results):
    for r in results:
        d = r["dense"]
        assert all(d["close"]) and d["sent_cf"] == 1.0 and d["measure"]
        assert d["tensors"] == 1 and d["acc_sq"] > 0, "the bucket's statistics reached the driver"
