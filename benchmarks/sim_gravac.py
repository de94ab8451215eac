"""Simulated time to accuracy of GraVAC settings against dense, fp16 and static top-k (one process, N ranks).

Why a simulation: choosing GraVAC's defaults needs many runs (methods x settings x links x seeds), and a
real emulated-network run of the digits task takes minutes on the project's 2-core machine. Here one
process plays every rank of a synchronous data-parallel job:

* the model, data, shards, batch, learning rate and momentum are the benchmark's
  (``benchmarks/models.py`` MLP, ``benchmarks/datasets.py`` digits, as ``benchmarks/trainer.py``
  builds them; the time-to-accuracy section of ``BENCHMARKS.md`` uses SGD lr 0.2, no momentum);
* each rank computes its gradient on its own shard and holds what the Horovod glue holds: the library's
  codec (``crossover/compression/sparse_codec.py``: selection, multi-level probes, error feedback,
  transport) and step driver (``crossover/driver/``: plans, one-step-late observation) with its own policy;
  the ranks' collectives are ``SimulatedGroup``'s, tensors under ``--min-compress-numel`` go dense, and the
  "allreduce" is the exact average of the payloads, as Horovod's Average op returns it;
* so the policy sees exactly what the glue feeds it: reduced statistics (float32), one step late;
* simulated step time = compute time (measured once per model width: median of real forward + backward
  + update steps, optionally scaled or fixed) + communication time modeled from the bytes of
  ``crossover/compression/cost_model.py`` at the link rate (ring allreduce of the dense tensors fused
  into one collective, one allgather per sparse tensor of (index, value) pairs, or of a bitmap and the values
  below CF 32 as the codec sends them, ``--latency-us`` per collective) + the
  compression cost measured on this machine (median of the first measurements of each distinct plan,
  cached, so every method is charged the same for the same work), times a seeded random jitter.

Static methods train identically at every link rate, so each is trained once per seed and width and
timed at every workload; a GraVAC run is repeated per workload because its decisions depend on time.
Outputs: a JSON with every run (evaluations, CF per step, bytes), a markdown table per workload
(median and range over seeds) and optionally a PNG of accuracy against simulated time.

    python benchmarks/sim_gravac.py --seeds 0 1 2 --out results/sim_gravac
    python benchmarks/sim_gravac.py --methods dense topk:100 gravac "eps05=gravac:epsilon=0.5" --steps 100

Simulated is not measured: Horovod's own overheads (Python hooks, Gloo's allgather of varying sizes,
tensor fusion timing) are not in the model; see ``docs/gravac.md`` for what remains to validate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if not __package__:  # run as a file: its relative imports resolve in the package it belongs to
    __package__ = Path(__file__).resolve().parent.name

import torch  # noqa: E402

from crossover.adaptive.gravac import GravacPolicy, Plan, StepStats  # noqa: E402
from crossover.adaptive.static import StaticPolicy  # noqa: E402
from crossover.compression import cost_model, kernels, sparse_codec, wire  # noqa: E402
from crossover.compression.collectives import SimulatedGroup  # noqa: E402
from crossover.compression.sparse_codec import SparseCodec  # noqa: E402
from crossover.driver import SparseStepDriver, transport  # noqa: E402

from .report import TTA_SMOOTH, final_value, first_reach  # noqa: E402

__all__ = ["Method", "Workload", "parse_method", "parse_workload", "main"]

DEFAULT_METHODS = ("dense", "fp16", "topk:10", "topk:100", "topk:1000", "gravac")
DEFAULT_WORKLOADS = ("mlp4@1gbit", "mlp1@100mbit", "mlp4@100mbit", "mlp4@10gbit", "mlp4@10gbit:x8")
STATIC_KINDS = ("dense", "fp16", "topk")
_RATES = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


# ---------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class Method:
    """One training method: dense, fp16, static top-k at ``cf``, or GraVAC with ``params``."""

    label: str
    kind: str
    cf: float = 1.0
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def static(self) -> bool:
        return self.kind in STATIC_KINDS


def _value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_method(spec: str) -> Method:
    """``dense``, ``fp16``, ``topk:CF``, ``gravac`` or ``gravac:key=value,...``; ``LABEL=`` in front names it."""
    label = None
    head, sep, rest = spec.partition("=")
    if sep and ":" not in head and head not in ("gravac",):
        label, spec = head, rest
    kind, _, arg = spec.partition(":")
    if kind in ("dense", "none"):
        return Method(label or "dense", "dense")
    if kind == "fp16":
        return Method(label or "fp16", "fp16", 2.0)
    if kind == "topk":
        try:
            cf = float(arg or 100)
        except ValueError:
            raise ValueError(f"topk:CF needs a number, got {spec!r}") from None
        if not cf > 1:
            raise ValueError(f"topk CF must be > 1, got {spec!r}")
        return Method(label or f"topk:{cf:g}", "topk", cf)
    if kind == "gravac":
        params: list[tuple[str, Any]] = []
        for item in filter(None, arg.split(",")):
            key, eq, val = item.partition("=")
            if not eq:
                raise ValueError(f"gravac options are key=value, got {item!r} in {spec!r}")
            params.append((key.strip(), _value(val.strip())))
        GravacPolicy(**dict(params))  # reject bad settings before any training
        return Method(label or spec, "gravac", params=tuple(params))
    raise ValueError(f"unknown method {spec!r}: use dense, fp16, topk:CF or gravac[:key=value,...]")


def parse_rate(text: str) -> float:
    """Link rate in bit/s from tc units (100mbit, 1gbit, 10gbit)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", text.strip().lower())
    if not m:
        raise ValueError(f"link rate like 100mbit, 1gbit or 10gbit expected, got {text!r}")
    return float(m.group(1)) * _RATES[m.group(2)]


@dataclass(frozen=True)
class Workload:
    """Model width, link rate and compute: ``mlp4@1gbit``, ``mlp4@10gbit:x8`` (compute x8), ``mlp4@1gbit:45ms``."""

    name: str
    width: float
    rate_bps: float
    compute_scale: float = 1.0
    compute_ms: float | None = None


def parse_workload(spec: str) -> Workload:
    m = re.fullmatch(r"mlp(\d+(?:\.\d+)?)@([0-9.]+[kmg]bit)(?::(?:x([0-9.]+)|([0-9.]+)ms))?", spec.strip())
    if not m:
        raise ValueError(f"workload like mlp4@1gbit, mlp4@10gbit:x8 or mlp4@1gbit:45ms expected, got {spec!r}")
    return Workload(spec.strip(), float(m.group(1)), parse_rate(m.group(2)),
                    float(m.group(3)) if m.group(3) else 1.0, float(m.group(4)) if m.group(4) else None)


# ---------------------------------------------------------------------------------------------- costs
class CostBook:
    """Compute time per model width and compression cost per distinct plan, measured once and reused.

    A plan's cost is the minimum of its first ``samples`` measurements, then frozen: every method and
    seed is charged the same for the same work. The minimum, not the median: on a shared machine the
    load only ever adds time, so the fastest of several runs is the best estimate of the work itself.
    """

    def __init__(self, samples: int = 9, saved: dict[str, float] | None = None) -> None:
        self.samples = samples
        self._seen: dict[str, list[float]] = {}
        self._fixed: dict[str, float] = dict(saved or {})

    def charge(self, key: str, measure: float) -> float:
        if key in self._fixed:
            return self._fixed[key]
        seen = self._seen.setdefault(key, [])
        seen.append(measure)
        value = min(seen)
        if len(seen) >= self.samples:
            self._fixed[key] = value
        return value

    def frozen(self) -> dict[str, float]:
        """Costs that no longer change (measured often enough, or loaded)."""
        return dict(self._fixed)

    def known(self, key: str) -> float | None:
        return self._fixed.get(key)

    def set(self, key: str, value: float) -> None:
        self._fixed[key] = value

    def table(self) -> dict[str, float]:
        out = {k: min(v) for k, v in self._seen.items()}
        out.update(self._fixed)
        return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------- ranks
@dataclass
class _Task:
    """Model, data and evaluation set of one (seed, width): identical start for every method."""

    seed: int
    width: float
    world: int
    batch: int
    data: Any
    init_state: dict[str, torch.Tensor]
    x_eval: torch.Tensor
    y_eval: torch.Tensor
    steps_per_epoch: int


def _build_task(seed: int, width: float, world: int, batch: int) -> _Task:
    from .datasets import load_dataset
    from .models import build_model

    torch.manual_seed(seed)  # as benchmarks/trainer.py: seed, then data, then model
    data = load_dataset("digits", None, seed=seed)
    model = build_model("mlp", "digits", data.num_classes, width=width)
    xe = torch.cat([x for x, _ in data.eval_batches(0, 1, 512)])
    ye = torch.cat([y for _, y in data.eval_batches(0, 1, 512)])
    return _Task(seed, width, world, batch, data, {k: v.clone() for k, v in model.state_dict().items()}, xe, ye,
                 data.steps_per_epoch(world, batch))


def _new_model(task: _Task) -> torch.nn.Module:
    from .models import build_model

    model = build_model("mlp", "digits", task.data.num_classes, width=task.width)
    model.load_state_dict(task.init_state)
    return model


class _Rank:
    """One simulated rank: the library's codec and step driver (with its own policy), as the glue holds them."""

    def __init__(self, rank: int, group: SimulatedGroup, policy: Any) -> None:
        self.codec = SparseCodec("topk", error_feedback=True, seed=0,
                                 grad_norms=bool(getattr(policy, "needs_grad_norms", False)))
        self.driver = SparseStepDriver(policy, compressor="topk", seed=0)
        self.comm = group.rank_view(rank)


def _ranks(world: int, policies: Sequence[Any]) -> list[_Rank]:
    group = SimulatedGroup(world)
    return [_Rank(r, group, policies[r]) for r in range(world)]


@dataclass
class _StepRecord:
    """What one step cost, independent of the link: the time model is applied afterwards."""

    send_cf: float
    probes: tuple[float, ...]
    cost_s: float
    dense_elems: int  # elements of the fused allreduce (fp32, or fp16 when fp16)
    dense_width: int
    gather_elems: list[tuple[int, int]]  # per sparse tensor: (the largest count any rank contributed, its elements)
    bytes_sent: float  # per rank, as the glue counts it
    loss: float


@dataclass
class RunResult:
    method: str
    workload: str | None
    seed: int
    width: float
    records: list[_StepRecord]
    evals: list[tuple[int, float]]  # (step, test accuracy)
    dense_bytes_per_step: float
    policy_summary: dict[str, Any] | None = None


class Simulator:
    """Trains one method on one task, step by step, recording costs; GraVAC runs need the workload."""

    def __init__(self, costs: CostBook, *, lr: float, momentum: float, min_compress_numel: int, eval_every: int,
                 jitter: float, latency_s: float, log_every: int) -> None:
        self.costs = costs
        self.lr = lr
        self.momentum = momentum
        self.min_compress_numel = min_compress_numel
        self.eval_every = eval_every
        self.jitter = jitter
        self.latency_s = latency_s
        self.log_every = log_every
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    # ------------------------------------------------------------------ compute calibration
    def compute_s(self, task: _Task, repeat: int = 40) -> float:
        """Fastest wall time of one rank's forward + backward + update (batch ``task.batch``), cached per width."""
        key = f"compute:mlp{task.width:g}:b{task.batch}"
        known = self.costs.known(key)
        if known is not None:
            return known
        model = _new_model(task)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=self.momentum)
        batches = list(task.data.train_batches(0, 0, task.world, task.batch, task.seed))
        times = []
        for i in range(repeat + 3):
            x, y = batches[i % len(batches)]
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        value = min(times[3:])
        self.costs.set(key, value)
        return value

    def _fp16_buffer(self, key: str, numel: int) -> torch.Tensor:
        buf = self._buffers.get(("fp16", key))
        if buf is None or buf.numel() != numel:
            buf = self._buffers[("fp16", key)] = torch.empty(numel, dtype=torch.float16)
        return buf

    def _fp32_buffer(self, key: str, numel: int) -> torch.Tensor:
        buf = self._buffers.get(("fp32", key))
        if buf is None or buf.numel() != numel:
            buf = self._buffers[("fp32", key)] = torch.empty(numel, dtype=torch.float32)
        return buf

    def calibrate(self, task: _Task, rounds: int = 15) -> None:
        """Measure compute and the static / ladder plans' compression costs up front, interleaved.

        Round after round, one forward + backward + update and then every plan (fp16, top-k at each
        ladder CF) on the same gradients: load on the shared machine then hits every figure alike,
        and the minimum over rounds approximates the work itself. Plans met later (the paper search's
        many floor / candidate pairs) are measured while running (``CostBook``).
        """
        ckey = f"compute:mlp{task.width:g}:b{task.batch}"
        plans = [(Method("fp16", "fp16", 2.0), Plan(1.0, ()))]
        plans += [(Method(f"topk:{cf:g}", "topk", cf), Plan(cf, (cf,))) for cf in (10.0, 100.0, 1000.0)]
        model = _new_model(task)
        params = list(model.parameters())
        names = [n for n, _ in model.named_parameters()]
        opt = torch.optim.SGD(params, lr=1e-6, momentum=self.momentum)
        batches = [list(task.data.train_batches(0, r, task.world, task.batch, task.seed)) for r in range(task.world)]
        ranks = {m.label: _ranks(task.world, [_FixedPlan(plan.send_cf, plan.probe_cfs)] * task.world)
                 for m, plan in plans}
        compute: list[float] = []
        costs: dict[str, list[float]] = {}
        for i in range(rounds + 1):
            grads = []
            for r in range(task.world):
                x, y = batches[r][i % len(batches[r])]
                t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                compute.append(time.perf_counter() - t0)
                grads.append([p.grad.detach().reshape(-1).clone() for p in params])
            for m, plan in plans:
                for rk in ranks[m.label]:
                    rk.driver.begin_step(0.0)
                rec = self._exchange(m, grads, names, ranks[m.label], params, charge=False)
                key = ("cost:fp16" if m.kind == "fp16" else
                       f"cost:send={plan.send_cf:g}:probe={','.join(f'{c:g}' for c in plan.probe_cfs)}")
                if i > 0:  # the first round allocates the selectors' buffers
                    costs.setdefault(f"{key}:params={sum(p.numel() for p in params)}", []).append(rec.cost_s)
        if self.costs.known(ckey) is None:
            self.costs.set(ckey, min(compute[task.world:]))
        for key, values in costs.items():
            if self.costs.known(key) is None:
                self.costs.set(key, min(values))

    # ------------------------------------------------------------------ timing model
    def step_time(self, rec: _StepRecord, wl: Workload, compute_s: float, world: int, rng: random.Random) -> float:
        comp = wl.compute_ms / 1e3 if wl.compute_ms is not None else compute_s * wl.compute_scale
        nbytes = cost_model.allreduce_bytes(rec.dense_elems, world, rec.dense_width) if rec.dense_elems else 0.0
        # each rank's part as the codec sends it: (index, value) pairs, or a bitmap and the values below CF 32
        nbytes += sum(cost_model.ring_allgather(cost_model.gather_part_bytes(k, n, wire.gather_bitmap(k, n)),
                                                world).bytes for k, n in rec.gather_elems)
        collectives = (1 if rec.dense_elems else 0) + len(rec.gather_elems)
        t = comp + rec.cost_s + nbytes * 8.0 / wl.rate_bps + collectives * self.latency_s
        if self.jitter > 0:
            t *= math.exp(rng.gauss(0.0, self.jitter))
        return t

    # ------------------------------------------------------------------ one run
    def run(self, task: _Task, method: Method, total_steps: int, wl: Workload | None, label: str,
            policies: Sequence[Any] | None = None) -> RunResult:
        """Train ``method`` for ``total_steps``; a GraVAC run needs the workload (its decisions depend on
        time). ``policies`` (one per rank, anything with plan / observe / summary) replace the method's own."""
        world = task.world
        model = _new_model(task)
        params = [p for p in model.parameters()]
        names = [n for n, _ in model.named_parameters()]
        opt = torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)
        if policies is None and method.kind == "gravac":
            policies = [GravacPolicy(**dict(method.params)) for _ in range(world)]
        elif policies is None:
            policies = [StaticPolicy(cf=method.cf if method.kind == "topk" else 1.0) for _ in range(world)]
        ranks = _ranks(world, policies)
        compute_s = self.compute_s(task)
        rng = random.Random(task.seed * 7919 + 17)
        records: list[_StepRecord] = []
        evals: list[tuple[int, float]] = [(0, self._accuracy(model, task))]
        dense_bytes = sum(p.numel() * 4 for p in params)
        step = 0
        sim_t = 0.0
        started = time.perf_counter()
        epoch = 0
        while step < total_steps:
            iters = [task.data.train_batches(epoch, r, world, task.batch, task.seed) for r in range(world)]
            for batches in zip(*iters):
                if step >= total_steps:
                    break
                for rk in ranks:  # the first gradient of a step: the driver observes, then plans
                    rk.driver.begin_step(sim_t)
                plan = ranks[0].driver.current
                grads: list[list[torch.Tensor]] = []
                losses = []
                for x, y in batches:
                    model.zero_grad(set_to_none=False)
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    losses.append(loss.item())
                    grads.append([p.grad.detach().reshape(-1).clone() for p in params])
                rec = self._exchange(method, grads, names, ranks, params)
                rec.loss = statistics.fmean(losses)
                opt.step()
                step += 1
                records.append(rec)
                if wl is not None:
                    sim_t += self.step_time(rec, wl, compute_s, world, rng)
                if step % self.eval_every == 0 or step == total_steps:
                    evals.append((step, self._accuracy(model, task)))
                if self.log_every and step % self.log_every == 0:
                    acc = evals[-1][1]
                    print(f"  {label}: step {step}/{total_steps}, cf {plan.sent_cf:g}, loss {rec.loss:.3f}, "
                          f"acc {acc:.3f}, {time.perf_counter() - started:.0f}s", flush=True)
            epoch += 1
        for rk in ranks:  # the last step's duration: the driver observes the step before it
            rk.driver.begin_step(sim_t)
        summary = policies[0].summary() if method.kind == "gravac" else None
        return RunResult(label, wl.name if wl else None, task.seed, task.width, records, evals, dense_bytes, summary)

    def _accuracy(self, model: torch.nn.Module, task: _Task) -> float:
        with torch.no_grad():
            return float((model(task.x_eval).argmax(1) == task.y_eval).float().mean())

    def _exchange(self, method: Method, grads: list[list[torch.Tensor]], names: list[str], ranks: list[_Rank],
                  params: list[torch.nn.Parameter], charge: bool = True) -> _StepRecord:
        """Every rank compresses with its codec for the step its driver began; the average of the payloads is
        each rank's "allreduce", its decode the gradient (identical on every rank), set as each .grad.

        The record's cost is the plan's charged cost (``charge``), or this call's measurement."""
        world = len(ranks)
        plan = ranks[0].driver.current
        dense_elems = 0
        gather: list[int] = []
        sent = 0.0
        probes = tuple(plan.probes)
        passthrough = method.kind == "fp16" or ranks[0].driver.skips_all()
        measured = 0.0
        for i, (name, p) in enumerate(zip(names, params)):
            numel = p.numel()
            if method.kind == "fp16":  # each rank casts into a reused buffer, and back after the reduction
                halves = []
                for r in range(world):
                    buf = self._fp16_buffer(f"{r}:{name}", numel)
                    t0 = time.perf_counter()
                    buf.copy_(grads[r][i])
                    measured += (time.perf_counter() - t0) / world
                    halves.append(buf.float())
                _average_into(p.grad, halves)
                back = self._fp32_buffer(name, numel)
                t0 = time.perf_counter()
                back.copy_(halves[0].half())  # stands for the decompress cast of the reduced fp16 tensor
                measured += time.perf_counter() - t0
                dense_elems += numel
                sent += numel * 2
                continue
            if numel < self.min_compress_numel or passthrough:
                dense_elems += numel
                sent += numel * 4
                _average_into(p.grad, [grads[r][i] for r in range(world)])
                continue
            encoded = []
            for r, rk in enumerate(ranks):
                t0 = time.perf_counter()
                rec = rk.driver.current
                kind, _ = transport.sparse_route(numel, world, rec.sent_cf, rec.probes, rec.transport, False, False)
                encoded.append(rk.codec.encode(name, grads[r][i], rk.driver.current, rk.driver.last_step_time, rk.comm,
                                               kind, momentum=self.momentum))
                measured += (time.perf_counter() - t0) / world
            reduced = torch.stack([payload for payload, _, _ in encoded]).mean(0)
            ctx0 = encoded[0][1]
            if ctx0.kind == sparse_codec.ALLGATHER:
                gather.append((max(ctx.idx.numel() for _, ctx, _ in encoded), numel))
            dense_elems += reduced.numel()
            sent += statistics.fmean(nbytes for _, _, nbytes in encoded)
            for r, rk in reversed(list(enumerate(ranks))):  # rank 0 last: its decode is timed, its output kept
                t0 = time.perf_counter()
                out, stats = rk.codec.decode(reduced if r == 0 else reduced.clone(), encoded[r][1], rk.comm)
                if r == 0:
                    measured += time.perf_counter() - t0  # each rank decompresses the whole gather
                rk.driver.add_reduced(stats.tolist(), world)
            p.grad.copy_(out.view_as(p))
        if method.kind == "fp16":
            key = "cost:fp16"
            width = 2
        else:
            key = f"cost:send={plan.sent_cf:g}:probe={','.join(f'{c:g}' for c in probes)}"
            width = 4
        key = f"{key}:params={sum(p.numel() for p in params)}"
        if passthrough and method.kind != "fp16":
            cost = 0.0
        else:
            cost = self.costs.charge(key, measured) if charge else measured
        return _StepRecord(plan.sent_cf, probes, cost, dense_elems, width, gather, sent, 0.0)


def _average_into(out: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """out = mean of the flat ``parts`` (what an averaging allreduce returns), in place."""
    flat = out.view(-1)
    flat.copy_(parts[0])
    for part in parts[1:]:
        flat.add_(part)
    flat.mul_(1.0 / len(parts))


# ---------------------------------------------------------------------------------------------- analysis
def times_for(res: RunResult, sim: Simulator, wl: Workload, compute_s: float, world: int) -> list[float]:
    """Cumulative simulated time after each step of a static run, at this workload."""
    rng = random.Random(res.seed * 7919 + 17)
    out, t = [], 0.0
    for rec in res.records:
        t += sim.step_time(rec, wl, compute_s, world, rng)
        out.append(t)
    return out


def _as_evals(evals: list[tuple[int, float]], cum: list[float] | None = None) -> list[dict[str, Any]]:
    """(step, accuracy) pairs as the reports' evaluations, timed by the simulated clock `cum` (seconds per step,
    cumulated)."""
    return [{"step": step, "accuracy": acc, "train_s": cum[step - 1] if cum and step > 0 else 0.0}
            for step, acc in evals]


def final_accuracy(evals: list[tuple[int, float]]) -> float:
    """"Final" as every report means it (benchmarks/report.py, `final_value`)."""
    value, _ = final_value(_as_evals(evals), "accuracy")
    return float("nan") if value is None else value


def time_to(evals: list[tuple[int, float]], cum: list[float], target: float) -> tuple[float | None, float | None]:
    """(simulated time to ``target`` as every report reads it (benchmarks/report.py, `first_reach`: a moving mean of
    TTA_SMOOTH evaluations), time since the previous evaluation: the resolution of that figure)."""
    pts = _as_evals(evals, cum)
    hit = first_reach(pts, "accuracy", target)
    if hit is None:
        return None, None
    i = next(j for j, e in enumerate(pts) if e is hit)
    return hit["train_s"], hit["train_s"] - (pts[i - 1]["train_s"] if i else 0.0)


def summarize(res: RunResult, cum: list[float], target: float) -> dict[str, Any]:
    tta, res_s = time_to(res.evals, cum, target)
    sent = sum(r.bytes_sent for r in res.records)
    cfs = [r.send_cf for r in res.records]
    runs: list[list[float]] = []
    for cf in cfs:
        if runs and runs[-1][0] == cf:
            runs[-1][1] += 1
        else:
            runs.append([cf, 1])
    return {"method": res.method, "seed": res.seed, "tta_s": tta, "tta_resolution_s": res_s,
            "final_accuracy": final_accuracy(res.evals), "last_accuracy": res.evals[-1][1], "target": target,
            "total_s": cum[-1] if cum else 0.0,
            "bytes_ratio": res.dense_bytes_per_step * len(res.records) / sent if sent else float("inf"),
            "mean_step_ms": 1e3 * cum[-1] / len(cum) if cum else 0.0,
            "final_cf": cfs[-1] if cfs else None, "cf_runs": runs,
            "probe_steps": sum(1 for r in res.records if r.probes and r.probes != (r.send_cf,)),
            "evals": res.evals, "times": [round(t, 5) for t in cum],
            "policy": _plain(res.policy_summary)}


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _fmt_ratio(vals: list[float | None]) -> str:
    good = [v for v in vals if v is not None]
    if not good:
        return "-"
    missed = len(vals) - len(good)
    med = statistics.median(good)
    body = f"{med:.2f}" if len(good) == 1 else f"{med:.2f} [{min(good):.2f}-{max(good):.2f}]"
    return body + (f" ({missed} not reached)" if missed else "")


def mean_curve(runs: list[dict[str, Any]]) -> tuple[list[tuple[int, float]], list[float]]:
    """The seed-averaged learning curve: mean accuracy per evaluation and mean simulated time per step.

    Time to target on one seed is ill-conditioned here: the accuracy hovers around the target (dense's
    final accuracy - 1 point) for a hundred steps, so which evaluation first crosses it moves by tens
    of steps with any perturbation. Averaging the curves over seeds first, then crossing, is steadier.
    """
    n_steps = min(len(r["times"]) for r in runs)
    n_evals = min(len(r["evals"]) for r in runs)
    evals = [(runs[0]["evals"][i][0], statistics.fmean(r["evals"][i][1] for r in runs)) for i in range(n_evals)]
    times = [statistics.fmean(r["times"][j] for r in runs) for j in range(n_steps)]
    return evals, times


def analyse(rows: dict[str, dict[str, list[dict[str, Any]]]], methods: list[str]) -> dict[str, Any]:
    """Per workload and method: times to target on the seed-mean curve, and per-seed ratios to dense and to
    the best static method (dense, fp16, static top-k) of the same seed. Everything is recomputed from the
    recorded evaluations and step times, as every report reads them (benchmarks/report.py)."""
    out: dict[str, Any] = {}
    for wl, by_method in rows.items():
        seeds = sorted({r["seed"] for rs in by_method.values() for r in rs})
        statics = [x for x in by_method if x in _STATIC_LABELS]
        dense_final = {r["seed"]: final_accuracy(r["evals"]) for r in by_method["dense"]}
        target = statistics.fmean(dense_final.values()) - 0.01

        def seed_tta(r: dict[str, Any], finals: dict[int, float] = dense_final) -> float | None:
            return time_to(r["evals"], r["times"], finals[r["seed"]] - 0.01)[0]

        curve_tta = {}
        for m, rs in by_method.items():
            ev, times = mean_curve(rs)
            curve_tta[m] = time_to(ev, times, target)[0]
        best_static = min((curve_tta[x] for x in statics if curve_tta[x]), default=None)
        best_label = next((x for x in statics if curve_tta[x] == best_static), None)
        table = {}
        for m in methods:
            if m not in by_method:
                continue
            per = {r["seed"]: r for r in by_method[m]}
            vs_best, speedup, dacc, bytes_r, cf, ttas = [], [], [], [], [], []
            for s in seeds:
                r = per.get(s)
                if r is None:
                    continue
                best = min((t for x in statics for rr in by_method[x] if rr["seed"] == s
                            for t in [seed_tta(rr)] if t), default=None)
                dense = next((rr for rr in by_method["dense"] if rr["seed"] == s), None)
                t = seed_tta(r)
                td = seed_tta(dense) if dense else None
                ttas.append(t)
                vs_best.append(t / best if t and best else None)
                speedup.append(td / t if t and td else None)
                dacc.append(100 * (final_accuracy(r["evals"]) - dense_final[s]) if s in dense_final else None)
                bytes_r.append(r["bytes_ratio"])
                cf.append(r["final_cf"])
            c, cd = curve_tta[m], curve_tta["dense"]
            table[m] = {"curve_tta_s": c, "curve_vs_best_static": c / best_static if c and best_static else None,
                        "curve_vs_dense": c / cd if c and cd else None,
                        "curve_speedup_vs_dense": cd / c if c and cd else None,
                        "tta_s": ttas, "vs_best_static": vs_best,
                        "speedup_vs_dense": speedup, "acc_delta_points": dacc, "bytes_ratio": bytes_r,
                        "final_cf": cf, "mean_step_ms": statistics.fmean(r["mean_step_ms"] for r in by_method[m])}
        out[wl] = {"target": target, "best_static": best_label, "methods": table}
    return out


_STATIC_LABELS: set[str] = set()


def _fmt(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def check_targets(analysis: dict[str, Any], label: str) -> list[tuple[str, str, bool | None]]:
    """The issue's targets for method ``label``, on the seed-mean curves: (what, figure, met)."""
    out: list[tuple[str, str, bool | None]] = []
    for wl, a in analysis.items():
        r = a["methods"].get(label)
        if r is None:
            continue
        dense = a["methods"]["dense"]
        pays = a["best_static"] not in ("dense", "fp16", None)
        vs_best = r["curve_vs_best_static"]
        out.append((f"{wl}: time to target <= 1.10x the best static ({a['best_static']})",
                    f"{_fmt(vs_best)}x", None if vs_best is None else vs_best <= 1.10))
        if not pays or (dense["curve_vs_best_static"] or 99) <= 1.05:
            vd = r["curve_vs_dense"]
            out.append((f"{wl}: compression does not pay, time to target <= 1.05x dense", f"{_fmt(vd)}x",
                        None if vd is None else vd <= 1.05))
        d = [v for v in r["acc_delta_points"] if v is not None]
        worst = min(d) if d else None
        out.append((f"{wl}: final accuracy within 1 point of dense (worst seed)", f"{_fmt(worst, '{:+.1f}')} points",
                    None if worst is None else worst >= -1.0))
        if wl.startswith("mlp4@1gbit") or wl == "mlp1@100mbit":
            br = statistics.median(r["bytes_ratio"])
            out.append((f"{wl}: >= 10x fewer bytes than dense", f"{br:.1f}x", br >= 10.0))
        top10 = a["methods"].get("topk:10")
        if wl.startswith("mlp4@1gbit") and top10 and top10["curve_tta_s"] and r["curve_tta_s"]:
            sp = top10["curve_tta_s"] / r["curve_tta_s"]
            out.append((f"{wl}: stretch, >= 1.5x faster than static top-k 10x", f"{sp:.2f}x", sp >= 1.5))
    return out


def _steps_text(steps: Any) -> str:
    """'440 steps' for a step count; '20 epochs (22 steps each with 2 ranks)' style text is kept as is."""
    return f"{steps} steps" if isinstance(steps, int) else str(steps)


def markdown(analysis: dict[str, Any], info: dict[str, Any], check: str | None) -> str:
    lines = ["# GraVAC simulation", "", f"command: `{info['command']}`", "",
             f"{info['world']} simulated ranks, digits MLP, batch {info['batch']} per rank, SGD lr {info['lr']:g} "
             f"momentum {info['momentum']:g}, {_steps_text(info['steps'])}, "
             f"evaluation every {info['eval_every']} steps, "
             f"seeds {', '.join(map(str, info['seeds']))}; jitter {info['jitter']:g}, "
             f"tensors under {info['min_compress_numel']} elements dense, {info['latency_us']:g} us per collective.",
             "",
             "Final accuracy: the mean over the last 10 % of the steps; time to target: the first evaluation where "
             f"the mean of the last {info['smooth']} evaluations reaches dense's final accuracy - 1 point "
             "(mean over seeds). `curve`: time to target of the seed-averaged learning curve (mean accuracy per "
             "evaluation, mean simulated time per step); `vs best static` divides it by the best of dense, fp16 and "
             "static top-k 10/100/1000 (lower is better). `per seed`: the same ratio seed by seed, median "
             "[min-max]. `acc - dense`: final accuracy minus dense's, points, median [min..max] over seeds.", ""]
    for wl, a in analysis.items():
        comp = info["compute_ms"].get(wl)
        lines += [f"## {wl}" + (f" (compute {comp:.1f} ms/step)" if comp else ""), "",
                  f"target accuracy {a['target']:.3f}; best static: {a['best_static']}", "",
                  "| method | step ms | curve: time to target s | vs best static | speed-up vs dense "
                  "| per seed: vs best static | acc - dense | bytes dense/sent | final CF |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m, r in a["methods"].items():
            dacc = [v for v in r["acc_delta_points"] if v is not None]
            dacc_s = f"{statistics.median(dacc):+.1f} [{min(dacc):+.1f}..{max(dacc):+.1f}]" if dacc else "-"
            br = r["bytes_ratio"]
            cfs = ", ".join(f"{c:g}" for c in sorted({c for c in r["final_cf"] if c is not None}))
            lines.append(f"| {m} | {r['mean_step_ms']:.1f} | {_fmt(r['curve_tta_s'])} | "
                         f"{_fmt(r['curve_vs_best_static'])} | {_fmt(r['curve_speedup_vs_dense'])} | "
                         f"{_fmt_ratio(r['vs_best_static'])} | {dacc_s} | "
                         f"{statistics.median(br):.1f} [{min(br):.1f}-{max(br):.1f}] | {cfs} |")
        lines.append("")
    if check:
        lines += [f"## Targets for `{check}`", "", "| target | simulated | met |", "|---|---:|---|"]
        for what, fig, ok in check_targets(analysis, check):
            lines.append(f"| {what} | {fig} | {'-' if ok is None else 'yes' if ok else '**no**'} |")
        lines.append("")
    return "\n".join(lines)


def plot(path: Path, rows: dict[str, dict[str, list[dict[str, Any]]]], seed: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(rows)
    fig, axes = plt.subplots(2, n, figsize=(5 * n, 7), squeeze=False)
    for j, (wl, by_method) in enumerate(rows.items()):
        ax, ax2 = axes[0][j], axes[1][j]
        for m, rs in by_method.items():
            r = next((x for x in rs if x["seed"] == seed), None)
            if r is None:
                continue
            ts = [0.0] + r["times"]
            ax.plot([ts[s] for s, _ in r["evals"]], [a for _, a in r["evals"]], label=m, lw=1)
            if r["cf_runs"] and len(r["cf_runs"]) > 1:
                cfs = [cf for cf, n_ in r["cf_runs"] for _ in range(int(n_))]
                ax2.step(range(1, len(cfs) + 1), cfs, label=m, lw=1)
        ax.set_title(f"{wl} (seed {seed})")
        ax.set_xlabel("simulated time s")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.8, 1.0)
        ax.legend(fontsize=6)
        ax2.set_yscale("log")
        ax2.set_xlabel("step")
        ax2.set_ylabel("sent CF")
        ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sim_gravac", description=__doc__.splitlines()[0],
                                epilog="\n".join(__doc__.splitlines()[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help="dense, fp16, topk:CF, gravac, gravac:key=value,... (LABEL=SPEC names one); dense and "
                        "the static methods are always needed for the ratios and are added if missing "
                        f"(default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS),
                   help="mlpWIDTH@RATE[:xSCALE|:MSms]: model width (1: hidden 512), link rate, compute x SCALE or "
                        f"fixed MS ms per step (default: {' '.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (default 0)")
    p.add_argument("--ranks", type=int, default=2, help="simulated ranks (default 2)")
    p.add_argument("--batch-size", type=int, default=32, help="batch per rank (default 32)")
    p.add_argument("--epochs", type=int, default=20, help="epochs (default 20: 440 steps with 2 ranks)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: all epochs)")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (default 0.2, BENCHMARKS.md's)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0, BENCHMARKS.md's)")
    p.add_argument("--min-compress-numel", type=int, default=4096,
                   help="smaller tensors go dense (default 4096, BENCHMARKS.md's)")
    p.add_argument("--eval-every", type=int, default=4, help="evaluate every N steps (default 4)")
    p.add_argument("--jitter", type=float, default=0.05,
                   help="log-normal sigma of a random factor on every simulated step time (default 0.05)")
    p.add_argument("--latency-us", type=float, default=50.0, help="latency per collective in us (default 50)")
    p.add_argument("--costs", default=None, help="JSON of measured costs to reuse (a previous run's 'costs')")
    p.add_argument("--cache", default=None,
                   help="folder where static runs (dense, fp16, top-k) are kept and reused by later invocations "
                        "with the same settings; use it with --costs so that their costs match")
    p.add_argument("--out", default="results/sim_gravac", help="output folder (default results/sim_gravac)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--log-every", type=int, default=0, help="log a line every N steps of each run (default 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--gain-study", action="store_true",
                   help="instead of comparing methods: send dense, CF 10, 100 and 1000 for a whole run each (first "
                        "workload, first seed) while probing CF 10, 100 and 1000, and tabulate the gain definitions")
    p.add_argument("--check", default="gravac", help="method whose targets are checked (default gravac)")
    p.add_argument("--report-only", metavar="JSON", nargs="+", default=None,
                   help="re-render the tables (and PNG) of previous runs' results.json, training nothing; several "
                        "files (other workloads, or other methods on the same seeds) are merged")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.report_only:
        return report_only([Path(x) for x in a.report_only], a)
    torch.set_num_threads(a.threads)
    try:
        methods = [parse_method(s) for s in a.methods]
        workloads = [parse_workload(s) for s in a.workloads]
    except (ValueError, TypeError) as exc:
        p.error(str(exc))
    if a.ranks < 2:
        p.error("--ranks must be >= 2")
    labels = [m.label for m in methods]
    for need in ("dense", "fp16", "topk:10", "topk:100", "topk:1000"):
        if need not in labels:
            methods.insert(0, parse_method(need))
            labels.insert(0, need)
    if len(set(labels)) != len(labels):
        p.error(f"method labels must differ: {labels}")
    _STATIC_LABELS.clear()
    _STATIC_LABELS.update(m.label for m in methods if m.static)
    saved = json.loads(Path(a.costs).read_text())["costs"] if a.costs else {}
    cost_file = Path(a.cache) / "costs.json" if a.cache else None
    if cost_file is not None and cost_file.exists():
        saved = {**json.loads(cost_file.read_text()), **saved}
    costs = CostBook(saved=saved)
    sim = Simulator(costs, lr=a.lr, momentum=a.momentum, min_compress_numel=a.min_compress_numel,
                    eval_every=a.eval_every, jitter=a.jitter, latency_s=a.latency_us * 1e-6,
                    log_every=a.log_every)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.gain_study:
        return gain_study(a, sim, workloads[0], out)
    widths = sorted({w.width for w in workloads})
    statics = [m for m in methods if m.static]
    adaptive = [m for m in methods if not m.static]
    n_runs = len(a.seeds) * (len(widths) * len(statics) + len(workloads) * len(adaptive))
    done = 0
    begin = time.perf_counter()
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {w.name: {} for w in workloads}
    compute_ms: dict[str, float] = {}

    def tick(what: str, extra: str) -> None:
        nonlocal done
        done += 1
        if cost_file is not None:  # later invocations sharing the cache charge the same costs
            cost_file.parent.mkdir(parents=True, exist_ok=True)
            known = json.loads(cost_file.read_text()) if cost_file.exists() else {}
            tmp = cost_file.with_suffix(f".{os.getpid()}.tmp")  # several invocations may share the cache
            tmp.write_text(json.dumps({**costs.frozen(), **known}, indent=1, sort_keys=True))
            tmp.replace(cost_file)
        el = time.perf_counter() - begin
        eta = el / done * (n_runs - done)
        bar = "#" * int(20 * done / n_runs)
        print(f"[{bar:<20}] {done}/{n_runs} {what}: {extra} ({el:.0f}s, ~{eta:.0f}s left)", flush=True)

    for seed in a.seeds:
        for width in widths:
            task = _build_task(seed, width, a.ranks, a.batch_size)
            total = a.steps or task.steps_per_epoch * a.epochs
            sim.calibrate(task)
            comp = sim.compute_s(task)
            for wl in workloads:
                if wl.width == width:
                    compute_ms[wl.name] = 1e3 * (wl.compute_ms / 1e3 if wl.compute_ms else comp * wl.compute_scale)
            static_res = {}
            for m in statics:
                key = _cache_key(a, m, seed, width, total)
                res = _cache_load(a.cache, key)
                cached = res is not None
                if res is None:
                    res = sim.run(task, m, total, None, f"{m.label} seed {seed} mlp{width:g}")
                    _cache_save(a.cache, key, res)
                res.method = m.label
                static_res[m.label] = res
                tick(f"{m.label} seed {seed} mlp{width:g}",
                     f"final acc {res.evals[-1][1]:.3f}" + (" (cached)" if cached else ""))
            for wl in (w for w in workloads if w.width == width):
                target = final_accuracy(static_res["dense"].evals) - 0.01
                for label, res in static_res.items():
                    cum = times_for(res, sim, wl, comp, a.ranks)
                    rows[wl.name].setdefault(label, []).append(summarize(res, cum, target))
                for m in adaptive:
                    res = sim.run(task, m, total, wl, f"{m.label} seed {seed} {wl.name}")
                    cum = list(_cumsum(res, sim, wl, comp, a.ranks))
                    s = summarize(res, cum, target)
                    rows[wl.name].setdefault(m.label, []).append(s)
                    dense_tta = rows[wl.name]["dense"][-1]["tta_s"]
                    ratio = f"{dense_tta / s['tta_s']:.2f}x dense" if s["tta_s"] and dense_tta else "not reached"
                    tick(f"{m.label} seed {seed} {wl.name}",
                         f"final acc {s['final_accuracy']:.3f}, {ratio}, bytes /{s['bytes_ratio']:.1f}, "
                         f"final CF {s['final_cf']:g}")
    analysis = analyse(rows, [m.label for m in methods])
    info = {"command": " ".join(["python benchmarks/sim_gravac.py", *(argv if argv is not None else sys.argv[1:])]),
            "world": a.ranks, "batch": a.batch_size, "smooth": TTA_SMOOTH, "lr": a.lr, "momentum": a.momentum,
            "eval_every": a.eval_every, "steps": a.steps or f"{a.epochs} epochs ({total} steps)", "seeds": a.seeds,
            "jitter": a.jitter,
            "compute_ms": compute_ms, "latency_us": a.latency_us, "min_compress_numel": a.min_compress_numel,
            "methods": {m.label: {"kind": m.kind, "cf": m.cf, "params": dict(m.params)} for m in methods},
            "torch": torch.__version__, "kernels": kernels.kernels_available()}
    check = a.check if a.check in labels else None
    md = markdown(analysis, info, check)
    (out / "results.md").write_text(md + "\n")
    (out / "results.json").write_text(json.dumps({"info": info, "costs": costs.table(), "analysis": analysis,
                                                   "runs": rows}, indent=1, default=str) + "\n")
    print("\n" + md)
    print(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    if not a.no_plot:
        try:
            plot(out / "results.png", rows, a.seeds[0])
            print(f"wrote {out / 'results.png'}")
        except ImportError:
            print("matplotlib missing: no PNG")
    return 0


class _FixedPlan:
    """A stand-in policy for ``--gain-study`` and calibration: always the same plan; keeps every observation."""

    needs_grad_norms = True  # the gain study tabulates every gain definition

    def __init__(self, send_cf: float, probes: tuple[float, ...]) -> None:
        self._plan = Plan(send_cf=send_cf, probe_cfs=tuple(probes), measure=True)
        self.observed: list[StepStats] = []

    def plan(self) -> Plan:
        return self._plan

    def observe(self, stats: StepStats) -> None:
        self.observed.append(stats)

    def summary(self) -> dict[str, Any]:
        return {}


GAIN_STUDY_PHASES = ((0, 20), (20, 60), (60, 150), (150, None))


def gain_study(a: argparse.Namespace, sim: Simulator, workload: Workload, out: Path) -> int:
    """Send each CF of (dense, 10, 100, 1000) for a whole run while probing 10, 100 and 1000 every step;
    tabulate every gain definition per phase of training (what docs/gravac.md's gain table shows)."""
    probes = (10.0, 100.0, 1000.0)
    seed = a.seeds[0]
    task = _build_task(seed, workload.width, a.ranks, a.batch_size)
    total = a.steps or task.steps_per_epoch * a.epochs
    result: dict[str, Any] = {"workload": workload.name, "seed": seed, "steps": total, "sent": {}}
    lines = [f"# Gains on {workload.name}, seed {seed}, {total} steps", "",
             "| sent CF | steps | gain of | norm | authors | delivered (unclipped) | sum||g+e||^2 / sum||g||^2 |",
             "|---|---|---|---:|---:|---:|---:|"]
    for send in (1.0, *probes):
        fixed = [_FixedPlan(send, probes) for _ in range(a.ranks)]
        res = sim.run(task, Method(f"send {send:g}", "gravac"), total, workload, f"gain study, send {send:g}",
                      policies=fixed)
        obs = fixed[0].observed
        rows = {}
        for lo, hi in GAIN_STUDY_PHASES:
            seg = obs[lo:hi]
            if not seg:
                continue
            gsq = sum(o.grad_sq_norm for o in seg)
            gn = sum(o.grad_norm_sum for o in seg)
            dsq = sum(o.dense_sq_norm for o in seg)
            resid = dsq / gsq
            for cf in probes:
                norm = statistics.fmean(math.sqrt(o.compressed_sq_norms[cf] / o.dense_sq_norm) for o in seg)
                auth = sum(o.compressed_norm_sums[cf] for o in seg) / gn
                deliv = math.sqrt(sum(o.compressed_sq_norms[cf] for o in seg) / gsq)
                phase = f"{lo}-{min(hi, len(obs)) if hi is not None else len(obs)}"
                rows.setdefault(phase, {})[f"{cf:g}"] = {"norm": norm, "authors": auth, "delivered": deliv,
                                                         "residual_ratio": resid}
                lines.append(f"| {send:g} | {phase} | CF {cf:g} | {norm:.2f} | {auth:.2f} | {deliv:.2f} "
                             f"| {resid:.1f} |")
        result["sent"][f"{send:g}"] = {"phases": rows, "final_accuracy": final_accuracy(res.evals),
                                       "evals": res.evals}
        print(f"send {send:g}: final accuracy {final_accuracy(res.evals):.3f}", flush=True)
    lines += ["", "final accuracy (mean of the last evaluations): " + ", ".join(
        f"send {k}: {v['final_accuracy']:.3f}" for k, v in result["sent"].items())]
    out.mkdir(parents=True, exist_ok=True)
    (out / "gain_study.md").write_text("\n".join(lines) + "\n")
    (out / "gain_study.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'gain_study.md'} and {out / 'gain_study.json'}")
    return 0


def _cache_key(a: argparse.Namespace, m: Method, seed: int, width: float, total: int) -> str:
    """Everything a static run's trajectory and measured costs depend on (not the link: timed later)."""
    import hashlib

    text = json.dumps([m.kind, m.cf, seed, width, total, a.ranks, a.batch_size, a.lr, a.momentum,
                       a.min_compress_numel, a.eval_every, torch.__version__, 2])  # 2: gather entries (k, n)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _cache_load(folder: str | None, key: str) -> RunResult | None:
    if not folder:
        return None
    path = Path(folder) / f"{key}.json"
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    records = [_StepRecord(r[0], tuple(r[1]), r[2], r[3], r[4], [tuple(g) for g in r[5]], r[6], r[7])
               for r in d["records"]]
    return RunResult(d["method"], None, d["seed"], d["width"], records, [tuple(e) for e in d["evals"]],
                     d["dense_bytes"])


def _cache_save(folder: str | None, key: str, res: RunResult) -> None:
    """Static runs do not depend on the policy code, so later invocations may reuse them (``--cache``)."""
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    d = {"method": res.method, "seed": res.seed, "width": res.width, "evals": res.evals,
         "dense_bytes": res.dense_bytes_per_step,
         "records": [[r.send_cf, list(r.probes), r.cost_s, r.dense_elems, r.dense_width, r.gather_elems,
                      r.bytes_sent, r.loss] for r in res.records]}
    tmp = Path(folder) / f"{key}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(d))
    tmp.replace(Path(folder) / f"{key}.json")


def report_only(paths: list[Path], a: argparse.Namespace) -> int:
    """Re-analyse saved results.json files (merged), writing results.md (and a PNG) into ``--out``."""
    datas = [json.loads(p.read_text()) for p in paths]
    info = dict(datas[0]["info"])
    info["command"] = " ; ".join(d["info"]["command"] for d in datas)
    info["methods"] = {k: v for d in datas for k, v in d["info"]["methods"].items()}
    info["compute_ms"] = {k: v for d in datas for k, v in d["info"]["compute_ms"].items()}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for d in datas:
        for wl, by_method in d["runs"].items():
            for m, rs in by_method.items():
                have = rows.setdefault(wl, {}).setdefault(m, [])
                seen = {r["seed"] for r in have}
                have.extend(r for r in rs if r["seed"] not in seen)
    _STATIC_LABELS.clear()
    _STATIC_LABELS.update(k for k, v in info["methods"].items() if v["kind"] in STATIC_KINDS)
    methods = list(info["methods"])
    analysis = analyse(rows, methods)
    info = {**info, "smooth": TTA_SMOOTH}
    md = markdown(analysis, info, a.check if a.check in methods else None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out / 'results.md'}")
    if not a.no_plot:
        try:
            plot(out / "results.png", rows, info["seeds"][0])
            print(f"wrote {out / 'results.png'}")
        except ImportError:
            print("matplotlib missing: no PNG")
    return 0


def _cumsum(res: RunResult, sim: Simulator, wl: Workload, comp: float, world: int) -> list[float]:
    """The times a GraVAC run was simulated with (same jitter stream as during the run)."""
    return times_for(res, sim, wl, comp, world)


if __name__ == "__main__":
    sys.exit(main())
