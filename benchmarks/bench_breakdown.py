"""Per-step breakdown of the Horovod path and the DDP hook at the same compression, side by side in one job.

    python -m benchmarks.bench_breakdown                      # 2 emulated hosts at 300 Mbit/s (root), small CNN
    python -m benchmarks.bench_breakdown --model mlp --rate 1gbit --rounds 20
    python -m benchmarks.bench_breakdown --no-netem           # plain loopback via horovodrun (no root)
    python -m benchmarks.bench_breakdown --own-jobs --model cnn,cnn-large,mlp --methods compute,hvd-topk:10,...

Every method trains the same model from the same weights on the same batches in the same two processes (one
per emulated host): each process runs Horovod and torch.distributed (Gloo) side by side, so the Horovod path
and the DDP hook cross the same links in the same job. Methods take turns of --block steps, in an order that
rotates every round, so that a slow phase of a shared machine falls on all of them alike.

  compute          the model with no communication at all: the floor of every step
  hvd-none         stock Horovod, hvd.Compression.none (dense fp32)
  hvd-off          Horovod with AdaptiveCompression(enabled=False): the hook with compression off
  hvd-topk:CF      Horovod with StaticCompression("topk", cf=CF) (hvd-powersgd:CF: low rank)
  hvd-adaptive     Horovod with AdaptiveCompression() (defaults); compared with hvd-topk at the CF it settles on
  hvd-warmup       Horovod with AdaptiveCompression(warmup_steps=10**9): every step dense and measured (what
                   the statistics cost on GraVAC's dense steps)
  METHOD/VARIANT   a Horovod method with the transport of before issue 30: /pertensor (one allgather per
                   tensor, sizes that vary, Horovod's spinning wait), /fixed (one allgather per tensor of
                   exactly k pairs), /spin (grouped, with Horovod's spinning wait), /pairs (pairs where the
                   allgather sends a bitmap and values, below CF 32); or /groups1 (Horovod's own
                   DistributedOptimizer(groups=1): one grouped allreduce at the end of backward)
  ddp-none         PyTorch DDP, no hook
  ddp-topk:CF      DDP with crossover's adaptive_hook, AdaptiveState(policy="static", cf=CF) (ddp-powersgd:CF)
  ddp-adaptive     DDP with adaptive_hook, AdaptiveState() (defaults)
  hvd-floor:CF     stock Horovod allreducing each gradient's first 1/CF (crossover's quiet wait), no codec: what
                   Horovod itself costs to move CF's bytes from the backward hooks (ddp-floor:CF: the same per
                   DDP bucket by a plain hook); the step a codec on either path cannot go below

Per method the table gives the median step and its phases: forward, backward (with the hooks' work; DDP also
waits for its buckets there), wait (Horovod: synchronize() less decompress), the optimizer step, and inside
them the crossover work: compress (the glue's compress / the hook body), of which encode (the codec),
decompress (of which decode) and the policy (the driver's planning and statistics). Then an
attribution pass (a few steps per method) counts per step the collectives submitted
and those that ran after Horovod's fusion, their bytes, Horovod's negotiation time and cycles (from
Horovod's timeline, rank 0), and the bytes each host sent on its link. The Horovod counts come from a second,
short job: with HOROVOD_TIMELINE=DYNAMIC set Horovod spends CPU all along, so the timed job runs without it.

--own-jobs (issue 43): each method runs as its own job instead, as users run them: fresh processes, its own
warm-up, only its own framework initialised (a DDP job never starts Horovod), its steps back to back; the same
columns, per model of --model (a comma-separated list there). A user's wall clock counts what the step's own
clock does not (the loop between steps): column "wall", the timed steps' elapsed time over their number. The
attribution pass stays one job per model (counts per step, not times). The two modes differ: rotating, every
method shares two processes that run Horovod's background thread all along (its cycles poll during the DDP
methods' turns too), Horovod's caches and the allocator hold every method's tensors, and each round's blocks run
back to back, so that a drift of the shared machine cancels in the per-round ratios; own jobs, every job starts
cold, and a method's rounds are split into jobs of OWN_JOB_ROUNDS rounds that alternate with the other methods'
jobs (each with its own warm-up), so that the blocks a "round" pairs ran seconds, not minutes, apart; drift within
a pass stays in the ratios.

The ratios of the issue's targets are taken round by round (the medians of the two methods' blocks in the
same round) and summarised by their median, min and max over the rounds. --md writes the whole report as
markdown (default reports/hvd-breakdown.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_METHODS = "compute,hvd-none,hvd-off,ddp-none,hvd-topk:100,ddp-topk:100,hvd-adaptive,hvd-topk:10,hvd-warmup"
PHASES = ("step", "cpu", "fwd", "bwd", "wait", "opt", "compress", "encode", "decompress", "decode", "policy", "agree")
#: the issue's targets: (name, numerator method, denominator method, bound)
TARGETS = (("Horovod {family} vs DDP hook {family}, same CF", "hvd-{family}:{cf}", "ddp-{family}:{cf}", 1.10),
           ("AdaptiveCompression() settled at CF c vs StaticCompression at c", "hvd-adaptive@{cf}", "hvd-topk:{cf}",
            1.03),
           ("compression off vs stock Horovod", "hvd-off", "hvd-none", 1.02))
CI_LEVEL = 0.90  # the bracket given beside each verdict: a 10-step block's median moves by tens of percent
BOOTSTRAP_RESAMPLES = 2000  # enough for the 5th and 95th percentiles of the median to be stable to 0.001
OWN_JOB_ROUNDS = 4  # --own-jobs: timed rounds per job; a method's jobs alternate with the others' (drift falls alike)


# --------------------------------------------------------------------------- workload


MODELS = {"cnn": "small CNN (conv 16, conv 32, fc 256, fc 10) on MNIST-like synthetic images",
          "cnn-large": "CNN of issue 43 (conv 32, conv 64, fc 1600-256, fc 256-10) on MNIST-like synthetic images",
          "mlp": "digits MLP 64-512-512-10"}


def build_model(name: str) -> Any:
    """The small CNN (28x28x1 inputs, ~420 k parameters, most in one fully connected layer), the larger CNN of
    issue 43 (3x3 convolutions without padding, ~431 k parameters) or the digits MLP."""
    from torch import nn

    if name == "cnn-large":
        return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 5 * 5, 256), nn.ReLU(),
                             nn.Linear(256, 10))
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(32 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 10))
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def make_data(name: str, n: int, seed: int) -> tuple[Any, Any]:
    """Learnable data of the model's shape: the digits set (mlp), or 10 class templates plus noise (the CNNs)."""
    import torch

    if name == "mlp":
        from .datasets import load_dataset

        data = load_dataset("digits", None, seed=seed)
        xs, ys = zip(*data.train_batches(1, 0, 1, 32, seed))  # the training set, normalized, in batches of 32
        return torch.cat(xs), torch.cat(ys)
    gen = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    x = templates[y] + 1.5 * torch.randn(n, 1, 28, 28, generator=gen)
    return x, y


# --------------------------------------------------------------------------- timing of one method


class _Timer:
    """Seconds accumulated by wrapped functions during the step in flight."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        """Replace ``obj.attr`` (an instance attribute) by a timed call of the original."""
        fn = getattr(obj, attr)
        acc = self.acc
        clock = time.perf_counter

        def timed(*a: Any, **kw: Any) -> Any:
            t = clock()
            try:
                return fn(*a, **kw)
            finally:
                acc[phase] += clock() - t

        object.__setattr__(obj, attr, timed)  # on the object itself (AdaptiveCompression forwards setattr)

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        self.acc.clear()
        return out


_RUNNING: list[_Timer | None] = [None]  # the timer of the method whose step is running


def _time_agreement() -> None:
    """Time the agreement checks (issue 45: they must cost under 2 % of a step) as the phase "agree" of the
    method whose step runs: what every codec does for them, wrapped where it is defined (class-level, once)."""
    from crossover.compression import sparse_codec, wire

    clock = time.perf_counter

    def timed(fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            t = clock()
            try:
                return fn(*a, **kw)
            finally:
                timer = _RUNNING[0]
                if timer is not None:
                    timer.acc["agree"] += clock() - t
        return call

    for cls, attr in ((wire.Agreement, "values"), (wire.Agreement, "check"),
                      (sparse_codec.SparseCodec, "_agreement")):
        setattr(cls, attr, timed(getattr(cls, attr)))


class _FloorCompressor:
    """Horovod compression that sends each gradient's first 1/cf elements and hands back the gradient: the bytes
    of CF cf through Horovod's own path, without any codec work (the result is not the average)."""

    def __init__(self, cf: float) -> None:
        self.cf = cf

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        return tensor.view(-1)[:max(1, int(tensor.numel() / self.cf))], tensor

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return ctx


def _floor_hook(cf, bucket):  # type: ignore[no-untyped-def]  # DDP refuses a bucket annotated other than GradBucket
    """DDP hook twin of :class:`_FloorCompressor`: allreduce the bucket's first 1/cf, hand back the bucket."""
    import torch.distributed as dist

    flat = bucket.buffer()
    fut = dist.all_reduce(flat[:max(1, int(flat.numel() / cf))], async_op=True).get_future()
    return fut.then(lambda _: flat)


class Method:
    """One method: model, optimizer, compression object / hook state, and its records."""

    def __init__(self, name: str, model: Any, cf_default: float, lr: float) -> None:
        import torch

        self.name = name
        name, _, self.variant = name.partition("/")
        self.kind, _, arg = name.partition("-")
        self.timer = _Timer()
        self.comp: Any = None
        self.state: Any = None
        self.records: list[dict[str, float]] = []
        self.blocks: list[tuple[int, int]] = []  # (first record, end) of each timed block, in rounds
        self.settled: list[float | None] = []  # the adaptive policy's settled CF at each timed step
        self.wire: list[tuple[int, int]] = []  # (tx bytes, steps) per timed block
        self.walls: list[float] = []  # elapsed seconds of each timed block (a user's wall clock)
        self._own, self._since = 0.0, None  # seconds in this method's finished steps; start of the one running
        self.model = model
        if name == "compute":
            self.opt = torch.optim.SGD(model.parameters(), lr=lr)
            return
        if self.kind == "hvd":
            self._horovod(arg, lr)
        else:
            self._ddp(arg, lr)

    def _horovod(self, arg: str, lr: float) -> None:
        import horovod.torch as hvd
        import torch

        from crossover import AdaptiveCompression, StaticCompression

        if arg == "none":
            comp = hvd.Compression.none
        elif arg == "off":
            comp = AdaptiveCompression(enabled=False)
        elif arg == "adaptive":  # on its own steps' clock: the other methods' turns are not its step time
            comp = AdaptiveCompression(clock=self.own_clock)
        elif arg == "warmup":  # every step dense and measured (GraVAC's warm-up): the statistics' own cost
            comp = AdaptiveCompression(warmup_steps=10**9, clock=self.own_clock)
        elif arg.startswith("floor:"):
            comp = _FloorCompressor(float(arg.partition(":")[2]))
        else:
            cname, _, cf = arg.partition(":")
            comp = StaticCompression(cname, cf=float(cf))
        self.comp = comp
        if self.variant in ("pertensor", "fixed"):  # the transport before grouping (pertensor: and variable sizes)
            comp.grouped = False
            comp.codec.fixed_gather = self.variant == "fixed"
        if self.variant in ("pertensor", "spin"):  # Horovod's own (spinning) wait in step()
            comp.quiet_wait = False
        if self.variant == "pairs":  # (index, value) pairs where the bitmap format would go (below CF 32)
            comp.codec.gather_bitmap = False
        self.opt = hvd.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=lr),
                                            named_parameters=[(f"{self.name}.{n}", p)
                                                              for n, p in self.model.named_parameters()],
                                            compression=comp, groups=1 if self.variant == "groups1" else None)
        if isinstance(comp, _FloorCompressor):
            from horovod_ext._internals import torch_quiet_synchronize

            torch_quiet_synchronize(self.opt)
        if hasattr(comp, "codec"):
            t = self.timer
            t.wrap(comp, "compress", "compress")  # Horovod calls the instance's attribute
            t.wrap(comp, "decompress", "decompress")
            t.wrap(comp.codec, "encode", "encode")
            t.wrap(comp.codec, "decode", "decode")
            t.wrap(comp.driver, "begin_step", "policy")
            t.wrap(comp.driver, "add_reduced", "policy")

    def _ddp(self, arg: str, lr: float) -> None:
        import torch

        from crossover.ddp import AdaptiveState, adaptive_hook

        net = torch.nn.parallel.DistributedDataParallel(self.model)
        if arg.startswith("floor:"):
            net.register_comm_hook(float(arg.partition(":")[2]), _floor_hook)
        elif arg != "none":
            if arg == "adaptive":
                # the optimizer's momentum (plain SGD), as a DDP user says it; its own steps' clock, as hvd-adaptive
                self.state = AdaptiveState(momentum=0.0, clock=self.own_clock)
            else:
                cname, _, cf = arg.partition(":")
                self.state = AdaptiveState(policy="static", cf=float(cf), compressor=cname)
            net.register_comm_hook(self.state, adaptive_hook)
            eng = self.state._engine
            t = self.timer
            t.wrap(eng, "run", "compress")
            t.wrap(eng.session, "decode", "decompress")
            t.wrap(eng.session.codec, "encode", "encode")
            t.wrap(eng.session.codec, "decode", "decode")
            t.wrap(eng.session.driver, "begin_step", "policy")
            t.wrap(eng.session.driver, "add_reduced", "policy")
        self.net = net
        self.opt = torch.optim.SGD(net.parameters(), lr=lr)

    @property
    def policy(self) -> Any:
        obj = self.comp if self.comp is not None else self.state
        return getattr(obj, "policy", None)

    def settled_cf(self) -> float | None:
        """The CF the adaptive policy is settled on (None while it searches, or for a fixed method)."""
        from crossover.adaptive.gravac import GravacPolicy

        p = self.policy
        return float(p.send_cf) if isinstance(p, GravacPolicy) and p.settled else None

    def own_clock(self) -> float:
        """Seconds spent in this method's own steps: the clock its adaptive policy sees (the methods take turns,
        and another method's turn is not this method's step time)."""
        return self._own + (time.perf_counter() - self._since if self._since is not None else 0.0)

    def step(self, x: Any, y: Any, record: bool) -> None:
        import torch

        f = torch.nn.functional.cross_entropy
        clock = time.perf_counter
        before = self.settled_cf()
        c0 = time.process_time()
        _RUNNING[0] = self.timer
        t0 = self._since = clock()
        self.opt.zero_grad()
        if self.kind == "ddp":
            loss = f(self.net(x), y)
            t1 = clock()
            loss.backward()
            t2 = t3 = clock()
            self.opt.step()
        else:
            loss = f(self.model(x), y)
            t1 = clock()
            loss.backward()
            t2 = clock()
            if self.kind == "hvd":
                self.opt.synchronize()
                t3 = clock()
                with self.opt.skip_synchronize():
                    self.opt.step()
            else:
                t3 = t2
                self.opt.step()
        t4 = clock()
        self._own += t4 - t0
        self._since = None
        _RUNNING[0] = None
        acc = self.timer.take()
        if not record:
            return
        rec = {"step": t4 - t0, "cpu": time.process_time() - c0, "fwd": t1 - t0, "bwd": t2 - t1, "opt": t4 - t3, **acc}
        if self.kind == "ddp":  # backward = hook bodies + compute + waiting for the buckets' futures
            rec["wait"] = 0.0
        else:
            rec["wait"] = t3 - t2 - acc.get("decompress", 0.0)
        self.records.append(rec)
        after = self.settled_cf()
        self.settled.append(after if before is not None and after == before else None)


# --------------------------------------------------------------------------- attribution


def _wire_tx() -> int:
    iface = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("HOROVOD_GLOO_IFACE") or "lo"
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except OSError:
        return 0


class _DistCounter:
    """Counts the torch.distributed collectives the DDP hook issues (calls and bytes), while installed."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> _DistCounter:
        import torch.distributed as dist

        from crossover.ddp import _collectives, hook

        def counting(kind: str, fn: Any, arg: int) -> Any:
            def call(*a: Any, **kw: Any) -> Any:
                t = a[arg]
                self.calls[kind] += 1
                self.bytes[kind] += t.numel() * t.element_size()
                return fn(*a, **kw)
            return call

        for mod, attr, kind, arg in ((hook.dist, "all_reduce", "allreduce", 0),
                                     (_collectives, "_all_gather", "allgather", 1)):
            orig = getattr(mod, attr)
            self._undo.append((mod, attr, orig))
            setattr(mod, attr, counting(kind, orig, arg))
        assert hook.dist is dist
        return self

    def __exit__(self, *exc: object) -> None:
        for mod, attr, orig in reversed(self._undo):
            setattr(mod, attr, orig)


def parse_timeline(path: str) -> dict[str, Any]:
    """Counts from a Horovod timeline (Chrome trace JSON, possibly unterminated) of `steps` steps.

    Submitted: one NEGOTIATE_* per tensor. Ran: clusters of GLOO_* activity starts (the tensors fused into one
    operation start together). Negotiation: from a tensor's first rank ready to the last (the span of
    NEGOTIATE_*). Cycles: CYCLE_START marks."""
    text = Path(path).read_text().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    try:
        events = json.loads(text)
    except json.JSONDecodeError:
        return {}
    submitted: dict[str, int] = defaultdict(int)
    ran: dict[str, set[int]] = defaultdict(set)
    neg_us = 0.0
    cycles = 0
    open_neg: dict[int, float] = {}
    for e in events:
        name, ph = e.get("name"), e.get("ph")
        if ph == "i" and name == "CYCLE_START":
            cycles += 1
        elif ph == "B" and name and name.startswith("NEGOTIATE_"):
            submitted[name[len("NEGOTIATE_"):].lower()] += 1
            open_neg[e["pid"]] = e["ts"]
        elif ph == "E" and e.get("pid") in open_neg:
            neg_us += e["ts"] - open_neg.pop(e["pid"])
        elif ph == "B" and name and name.startswith("GLOO_"):
            ran[name[len("GLOO_"):].lower()].add(e["ts"])
    return {"submitted": dict(submitted), "ran": {k: _clusters(v) for k, v in ran.items()},
            "negotiate_ms": neg_us / 1e3, "cycles": cycles}


def _clusters(starts: set[int], gap_us: int = 20) -> int:
    """Operations among per-tensor start times: Horovod marks each tensor of a fused operation in a loop, a few
    microseconds apart, and one operation over the network takes longer than `gap_us`."""
    n, last = 0, None
    for ts in sorted(starts):
        if last is None or ts - last > gap_us:
            n += 1
        last = ts
    return n


# --------------------------------------------------------------------------- one rank


def worker(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    names = cfg["methods"]
    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])  # both launchers set them
    if any(n.startswith("hvd-") for n in names):  # a job without a Horovod method never starts Horovod (--own-jobs)
        import horovod.torch as hvd

        hvd.init()
    torch.set_num_threads(1)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(size))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    _time_agreement()
    x_all, y_all = make_data(cfg["model"], 5000, cfg["seed"])
    batch = cfg["batch"]
    methods = []
    for name in names:
        torch.manual_seed(cfg["seed"])
        model = build_model(cfg["model"])
        methods.append(Method(name, model, cfg["cf"], cfg["lr"]))
    nparams = sum(p.numel() for p in methods[0].model.parameters())
    offset = [0]

    def batch_at(i: int) -> tuple[Any, Any]:
        n = x_all.shape[0] // (batch * size)
        j = (i % n) * batch * size + rank * batch
        return x_all[j:j + batch], y_all[j:j + batch]

    dist.barrier()
    for i in range(cfg["warmup"]):  # every method warms up (and the adaptive ones search) before the rounds
        for m in methods:
            m.step(*batch_at(i), record=False)
    offset[0] = cfg["warmup"]
    if cfg["timeline"]:  # the attribution job: Horovod's timeline costs CPU all along, so it has a job of its own
        _timeline_pass(cfg, methods, batch_at, offset[0], rank)
    else:
        _timed(cfg, methods, batch_at, offset, rank, size, nparams)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13 + Gloo sometimes aborts in interpreter teardown; the result is written


def _timeline_pass(cfg: dict[str, Any], methods: list[Method], batch_at: Any, offset: int, rank: int) -> None:
    """Per Horovod method, `attrib_steps` steps under Horovod's timeline (rank 0 writes it): counts per step."""
    import horovod.torch as hvd
    import torch

    attrib: dict[str, Any] = {}
    steps = cfg["attrib_steps"]
    for m in methods:
        if m.kind != "hvd":
            continue
        path = str(Path(cfg["timeline_dir"]) / f"{m.name.replace(':', '_').replace('/', '_')}.json")
        hvd.start_timeline(path, mark_cycles=True)
        for s in range(steps):
            m.step(*batch_at(offset + s), record=False)
        hvd.stop_timeline()
        hvd.allreduce(torch.zeros(1), name="bench.tl")
        if rank == 0:
            attrib[m.name] = {"horovod": parse_timeline(path) if Path(path).is_file() else {}, "steps": steps}
    if rank == 0:
        Path(cfg["result"]).write_text(json.dumps(attrib))


def _timed(cfg: dict[str, Any], methods: list[Method], batch_at: Any, offset: list[int], rank: int, size: int,
           nparams: int) -> None:
    """The timed rounds, then the DDP methods' collectives counted (a few steps each)."""
    rounds = cfg["rounds"]
    for r in range(rounds):
        k = r % len(methods)
        for m in methods[k:] + methods[:k]:
            first = len(m.records)
            tx = _wire_tx()
            t0 = time.perf_counter()
            for s in range(cfg["block"]):
                m.step(*batch_at(offset[0] + s), record=True)
            m.walls.append(time.perf_counter() - t0)
            m.wire.append((_wire_tx() - tx, cfg["block"]))
            m.blocks.append((first, len(m.records)))
        offset[0] += cfg["block"]
    attrib: dict[str, Any] = {}
    steps = cfg["attrib_steps"]
    for m in methods:
        if m.kind == "ddp":
            with _DistCounter() as c:
                for s in range(steps):
                    m.step(*batch_at(offset[0] + s), record=False)
            attrib[m.name] = {"dist": {"calls": dict(c.calls), "bytes": dict(c.bytes)}, "steps": steps}
    if rank == 0:
        out = {"params": nparams, "size": size, "methods": {}}
        for m in methods:
            st = m.comp.stats() if hasattr(m.comp, "stats") else (m.state.stats() if m.state is not None else {})
            out["methods"][m.name] = {
                "records": m.records, "blocks": m.blocks, "settled": m.settled, "wire": m.wire, "walls": m.walls,
                "attrib": attrib.get(m.name), "stats": {k: v for k, v in st.items() if k != "policy"},
            }
        Path(cfg["result"]).write_text(json.dumps(out))


# --------------------------------------------------------------------------- summary


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(res: dict[str, Any], cf: float) -> dict[str, Any]:
    """Median phases per method, per-round paired ratios for the targets, attribution per step."""
    rows = {}
    for name, m in res["methods"].items():
        recs = m["records"]
        row = {p: _med([r.get(p, 0.0) for r in recs]) for p in PHASES}
        row["steps"] = len(recs)
        if name.startswith("ddp"):
            row["wait"] = None  # DDP waits for its buckets inside backward
        compute = res["methods"].get("compute")
        row["beyond"] = row["step"] - _med([r["step"] for r in compute["records"]]) if compute else None
        tx = sum(b for b, _ in m["wire"])
        n = sum(s for _, s in m["wire"])
        row["wire_bytes_per_step"] = tx / n if n else None
        row["wall"] = sum(m.get("walls", ())) / n if n and m.get("walls") else None
        st = m.get("stats") or {}
        row["bytes_sent_per_step"] = None
        if st.get("bytes_sent") is not None and st.get("step"):
            row["bytes_sent_per_step"] = st["bytes_sent"] / st["step"]
        settled = [c for c in m["settled"] if c is not None]
        if settled:
            c = statistics.mode(settled)
            row["settled_cf"] = c
            row["settled_steps"] = sum(1 for s in m["settled"] if s == c)
        a = m.get("attrib")
        if a:
            k = a["steps"]
            if "horovod" in a and a["horovod"]:
                h = a["horovod"]
                row["submitted"] = {op: v / k for op, v in h["submitted"].items()}
                row["ran"] = {op: v / k for op, v in h["ran"].items()}
                row["negotiate_ms"] = h["negotiate_ms"] / k
                row["cycles"] = h["cycles"] / k
            if "dist" in a:
                row["submitted"] = row["ran"] = {op: v / k for op, v in a["dist"]["calls"].items()}
                row["collective_bytes"] = {op: v / k for op, v in a["dist"]["bytes"].items()}
        rows[name] = row
    targets = []
    # the first target for every codec family and CF with both hosts in the run (top-k and low rank, CF 10 and CF
    # 100 side by side), the others at `cf`
    pairs = sorted({(n[4:].split(":")[0], float(n.split(":")[1])) for n in res["methods"]
                    if n.startswith("hvd-") and ":" in n and "/" not in n and f"ddp-{n[4:]}" in res["methods"]})
    first = TARGETS[0]
    shown = {"topk": "top-k", "powersgd": "low rank"}
    floor = "Horovod vs DDP moving the CF's bytes with no codec (Horovod's own cost; context, not a target)"
    expanded = [(floor if f == "floor" else first[0].format(family=shown.get(f, f)), first[1].replace("{family}", f),
                 first[2].replace("{family}", f), first[3], c) for f, c in pairs] + [(*t, cf) for t in TARGETS[1:]]
    for title, num, den, bound, at in expanded:
        a_name, b_name = num.format(cf=_g(at)), den.format(cf=_g(at))
        settled_only = "@" in a_name
        if settled_only:
            base = a_name.split("@")[0]
            if base not in res["methods"]:
                continue
            c = rows[base].get("settled_cf")
            if c is None:
                targets.append({"target": title, "a": base, "b": None, "bound": bound, "ratio": None,
                                "note": "did not settle in the timed rounds"})
                continue
            # settled dense: StaticCompression at CF 1 compresses nothing, as compression off does
            a_name, b_name = base, den.format(cf=_g(c)) if c > 1 else "hvd-off"
        if a_name not in res["methods"] or b_name not in res["methods"]:
            if settled_only:
                targets.append({"target": title, "a": a_name, "b": b_name, "bound": bound, "ratio": None,
                                "note": f"settled at CF {_g(c)}: no {b_name} row in this run"})
            continue
        ratios = _paired(res["methods"][a_name], res["methods"][b_name], settled_only)
        t = {"target": title, "a": a_name, "b": b_name, "bound": bound, "ratio": _med(ratios) if ratios else None,
             "min": min(ratios) if ratios else None, "max": max(ratios) if ratios else None, "rounds": len(ratios),
             "of_medians": _of_medians(res["methods"][a_name], res["methods"][b_name], settled_only),
             "ci": median_ci(ratios)}
        wa, wb = rows[a_name].get("wall"), rows[b_name].get("wall")
        t["wall"] = wa / wb if wa and wb else None  # the ratio a user's wall clock gives
        if t["ratio"] is not None and not a_name.startswith("hvd-floor"):
            t["pass"] = t["ratio"] <= bound
        targets.append(t)
    return {"rows": rows, "targets": targets}


def median_ci(xs: list[float], level: float = CI_LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
              seed: int = 0) -> tuple[float, float] | None:
    """A percentile-bootstrap interval of the median of `xs` (the rounds' ratios), with a fixed seed so that the
    same records give the same report. None under 5 values (no interval worth printing)."""
    if len(xs) < 5:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return meds[int(tail * (resamples - 1))], meds[int(round((1.0 - tail) * (resamples - 1)))]


def _g(x: float) -> str:
    return f"{x:g}"


def _of_medians(a: dict[str, Any], b: dict[str, Any], settled_only: bool) -> float | None:
    """Median step of a (its settled steps only) / median step of b, over the whole run."""
    sa = [r["step"] for r, c in zip(a["records"], a["settled"]) if not settled_only or c is not None]
    sb = [r["step"] for r in b["records"]]
    return statistics.median(sa) / statistics.median(sb) if sa and sb else None


def _paired(a: dict[str, Any], b: dict[str, Any], settled_only: bool) -> list[float]:
    """Per round: median step of a's block / median step of b's block (a: its settled steps only)."""
    out = []
    for (fa, ea), (fb, eb) in zip(a["blocks"], b["blocks"]):
        sa = [a["records"][i]["step"] for i in range(fa, ea) if not settled_only or a["settled"][i] is not None]
        sb = [b["records"][i]["step"] for i in range(fb, eb)]
        if sa and sb:
            out.append(statistics.median(sa) / statistics.median(sb))
    return out


def format_report(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    """Markdown: how it was run, the targets, the phase table, the attribution table."""
    rows = summary["rows"]
    ms = lambda v: "-" if v is None or v != v else f"{1000 * v:.2f}"  # noqa: E731
    lines = [
        "# Horovod path vs DDP hook: per-step breakdown" + (f" ({meta['model']}, each method its own job)"
                                                            if meta.get("own_jobs") else ""),
        "",
        "Generated by `" + meta["command"] + "`; every figure below comes from that one run "
        f"({meta['date']}, commit {meta['commit']}, load average {meta['load']:.2f} at the start).",
        "",
        f"- workload: {meta['model_desc']}, {meta['params'] / 1e3:.0f} k parameters, batch {meta['batch']} per rank, "
        f"{meta['size']} ranks, link {meta['rate']}",
        (f"- each method its own jobs (--own-jobs): {meta['rounds']} blocks of {meta['block']} steps, in jobs of "
         f"{OWN_JOB_ROUNDS} blocks back to back after {meta['warmup']} warm-up steps (not timed), the methods' jobs "
         "taking turns; a 'round' below pairs the blocks of the same position in the two methods' jobs of one turn"
         if meta.get("own_jobs") else
         f"- {meta['rounds']} rounds; in each, every method runs {meta['block']} steps, in an order that rotates every "
         f"round; {meta['warmup']} warm-up steps per method before (not timed)"),
        "- a shared machine: absolute times move with its load; ratios are taken round by round "
        "(median of the rounds, min and max in brackets)",
        *(["- why this differs from the rotating mode (one job, methods taking turns): there every method shares "
           "two processes that run Horovod's background thread all along (its cycles poll during the DDP methods' "
           "turns too), Horovod's caches and the allocator hold every method's tensors, and a round's blocks run "
           "back to back, so machine drift cancels in its ratios; here every job starts cold and alone (a DDP job "
           "never starts Horovod), and drift between two jobs of a turn stays in the ratios. Wall: what a user's "
           "clock counts"]
          if meta.get("own_jobs") else []),
        "",
        "## Targets (issues 30 and 43)",
        "",
        ("The verdict reads the median of the per-round ratios (here a 'round' pairs the blocks of the same position "
         "in two jobs of one turn, seconds apart: drift of the machine between them stays in). Beside it:"
         if meta.get("own_jobs") else
         "The verdict reads the median of the per-round ratios (each round's two blocks ran back to back, so the "
         "machine's drift cancels). Beside it:") + f" a {CI_LEVEL:.0%} bootstrap interval of that median (where it "
        "contains the bound, this run cannot tell the two apart at that bound), and the ratio of the two whole-run "
        "medians; wall ratio: of the two methods' wall clock per step (column wall below).",
        "",
        f"| target | A / B | median ratio [min, max] over rounds | {CI_LEVEL:.0%} interval | ratio of medians "
        "| wall ratio | bound | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in summary["targets"]:
        if t["ratio"] is None:
            lines.append(f"| {t['target']} | {t['a']} | {t.get('note', 'no rounds')} | - | - | - | {t['bound']:.2f}x "
                         "| - |")
            continue
        verdict = "-" if "pass" not in t else "PASS" if t["pass"] else "FAIL"
        om = "-" if t.get("of_medians") is None else f"{t['of_medians']:.3f}x"
        ci = "-" if t.get("ci") is None else f"[{t['ci'][0]:.3f}, {t['ci'][1]:.3f}]"
        wall = "-" if t.get("wall") is None else f"{t['wall']:.3f}x"
        lines.append(f"| {t['target']} | {t['a']} / {t['b']} | {t['ratio']:.3f}x [{t['min']:.3f}, {t['max']:.3f}] "
                     f"({t['rounds']} rounds) | {ci} | {om} | {wall} | {t['bound']:.2f}x | {verdict} |")
    lines += [
        "",
        "## Median step and its phases (ms)",
        "",
        "Step: wall time of zero_grad, forward, backward and the optimizer step; beyond compute: the step less "
        "the `compute` method's (no communication at all); cpu: CPU time of the whole process (all threads) per "
        "step. Phases: fwd, bwd (backward, with the hooks' work; DDP also waits for its buckets there), wait "
        "(Horovod: `synchronize()` less decompress), opt (optimizer step). Crossover's own work inside them: "
        "compress (Horovod: the glue's `compress` over all tensors; DDP: the hook bodies, collectives issued), "
        "encode (the codec's part), decompress (Horovod: the glue's; DDP: the decode callbacks), decode (the "
        "codec's part, with its wait for the allgather) and the policy (the step driver). Each column is its own "
        "median over the steps, so the columns do not add up to the step. Wall: the timed blocks' elapsed time "
        "over their steps (a user's wall clock: a mean, with the loop between steps).",
        "",
        "| method | step | wall | beyond compute | cpu | fwd | bwd | wait | opt | compress | encode | decompress "
        "| decode | policy | agree | settled CF |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        settled = f"{r['settled_cf']:g} ({r['settled_steps']} steps)" if "settled_cf" in r else ""
        cells = [ms(r["step"]), ms(r.get("wall")), ms(r["beyond"]) if name != "compute" else "-"] + [
            ms(r[p]) for p in PHASES[1:]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {settled} |")
    agree = [f"{name} {ms(r['agree'])} ms ({100 * r['agree'] / r['step']:.2f} %)" for name, r in rows.items()
             if r.get("agree") and r["step"]]
    if agree:
        lines += ["", "Agreement checks (median per step, share of the method's median step; bound 2 %): "
                  + ", ".join(agree) + "."]
    lines += [
        "",
        "## Collectives and bytes per step",
        "",
        "Submitted: collectives the framework was asked for (Horovod: one per tensor, and the glue's allgathers; "
        "DDP: the hook's calls). Ran: after Horovod's fusion (tensors negotiated in one cycle run as one "
        "operation). Negotiation: summed over tensors, the time from the first rank ready to the last "
        "(Horovod timeline, rank 0). Wire: what this host sent on its link per step (headers and Horovod's "
        "control traffic included). Sent: what the compression object counted.",
        "",
        "| method | submitted | ran | negotiation ms | cycles | wire KB | sent KB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if name == "compute":
            continue
        fmt = lambda d: ", ".join(f"{k} {v:.1f}" for k, v in sorted(d.items())) if d else "-"  # noqa: E731
        kb = lambda v: "-" if v is None else f"{v / 1e3:.1f}"  # noqa: E731
        neg = f"{r['negotiate_ms']:.2f}" if "negotiate_ms" in r else "-"
        cyc = f"{r['cycles']:.1f}" if "cycles" in r else "-"
        lines.append(f"| {name} | {fmt(r.get('submitted'))} | {fmt(r.get('ran'))} | {neg} | {cyc} | "
                     f"{kb(r['wire_bytes_per_step'])} | {kb(r['bytes_sent_per_step'])} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- launching


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _meta(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    shown = [".../" + os.path.basename(a) if os.path.isabs(a) else a for a in argv]  # no path of this machine
    return {"command": shlex.join(["python", "-m", f"{__package__}.bench_breakdown", *shown]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "load": os.getloadavg()[0], "rounds": args.rounds, "block": args.block, "warmup": args.warmup,
            "batch": args.batch, "rate": "loopback (unshaped)" if args.no_netem else args.rate,
            "own_jobs": args.own_jobs}


def _job(args: argparse.Namespace, cfg: dict[str, Any], extra_env: dict[str, str]) -> str:
    """Run one worker job (netem hosts, or loopback via horovodrun); return the result file's text."""
    cmd = [sys.executable, "-m", f"{__package__}.bench_breakdown", "--worker", json.dumps(cfg)]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_free_port()), **extra_env}
    if args.cycle_time_ms:
        env["HOROVOD_CYCLE_TIME"] = f"{args.cycle_time_ms:g}"
    result = Path(cfg["result"])
    if args.no_netem:
        hr = Path(sys.executable).with_name("horovodrun")
        env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
        proc = subprocess.run([str(hr), "-np", str(args.hosts), "-H", f"localhost:{args.hosts}", "--gloo", *cmd],
                              env=dict(os.environ, **env), cwd=REPO, capture_output=True, text=True,
                              timeout=args.timeout)
        if proc.returncode or not result.is_file():
            raise SystemExit(f"the job failed ({proc.returncode}):\n{proc.stdout[-20000:]}\n{proc.stderr[-4000:]}")
    else:
        from .netem import EmulatedCluster, format_rank_output, launch_horovod

        with EmulatedCluster(hosts=args.hosts, rate=args.rate) as cluster:
            env.update(MASTER_ADDR=cluster.addresses[0], GLOO_SOCKET_IFNAME=cluster.iface)
            procs = launch_horovod(cluster, 1, cmd, env=env, timeout=args.timeout)
        if any(p.returncode for p in procs) or not result.is_file():
            raise SystemExit(f"the job failed:\n{format_rank_output(procs)[-8000:]}")
    return result.read_text()


def _append_job(methods: dict[str, Any], job: dict[str, Any], name: str) -> None:
    """Add one job's timed blocks of method `name` after those of its earlier jobs."""
    if name not in methods:
        methods[name] = job
        return
    m, offset = methods[name], len(methods[name]["records"])
    m["blocks"] += [(a + offset, b + offset) for a, b in job["blocks"]]
    for key in ("records", "settled", "wire", "walls"):
        m[key] += job[key]
    m["stats"] = job["stats"]


def run(args: argparse.Namespace, argv: list[str], model: str) -> dict[str, Any]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    meta = dict(_meta(args, argv), model=model, model_desc=MODELS[model])
    with tempfile.TemporaryDirectory(prefix="bench-breakdown-") as tmp:
        os.chmod(tmp, 0o755)
        cfg = {"methods": methods, "model": model, "batch": args.batch, "lr": args.lr, "seed": args.seed,
               "warmup": args.warmup, "rounds": args.rounds, "block": args.block, "cf": args.cf,
               "attrib_steps": args.attrib_steps, "timeline_dir": args.timelines or tmp, "timeline": False,
               "result": str(Path(tmp) / "result.json")}
        if args.own_jobs:  # fresh jobs per method, as users run them, in passes that alternate the methods
            res: dict[str, Any] = {"methods": {}}
            for first in range(0, args.rounds, OWN_JOB_ROUNDS):
                k = first // OWN_JOB_ROUNDS % len(methods)
                for name in methods[k:] + methods[:k]:
                    rounds = min(OWN_JOB_ROUNDS, args.rounds - first)
                    one = json.loads(_job(args, dict(cfg, methods=[name], rounds=rounds), {}))
                    res.update(params=one["params"], size=one["size"])
                    _append_job(res["methods"], one["methods"][name], name)
        else:
            res = json.loads(_job(args, cfg, {}))
        hvd_methods = [m for m in methods if m.startswith("hvd-")]
        if hvd_methods and not args.no_timeline:  # a second job: Horovod records only between start and stop
            tl = dict(cfg, methods=hvd_methods, warmup=min(args.warmup, 30), timeline=True,
                      result=str(Path(tmp) / "timeline.json"))
            for name, a in json.loads(_job(args, tl, {"HOROVOD_TIMELINE": "DYNAMIC"})).items():
                res["methods"][name]["attrib"] = a
    meta.update(params=res["params"], size=res["size"])
    summary = summarize(res, args.cf)
    return {"meta": meta, "summary": summary, "raw": res}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated (see below; default %(default)s)")
    p.add_argument("--model", default="cnn",
                   help="cnn: small CNN on MNIST-like images (default); cnn-large: the CNN of issue 43; mlp: the "
                   "digits MLP; with --own-jobs a comma-separated list (one section each)")
    p.add_argument("--own-jobs", action="store_true",
                   help="each method its own job (fresh processes, its own warm-up), as users run them")
    p.add_argument("--cf", type=float, default=100.0, help="the CF the targets compare at (default 100)")
    p.add_argument("--batch", type=int, default=32, help="batch per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=60, help="untimed steps per method first (default 60: the "
                   "adaptive methods search and settle)")
    p.add_argument("--rounds", type=int, default=40,
                   help="timed rounds (default 40: with 12 the per-round ratios' median moved by 0.2 between runs)")
    p.add_argument("--block", type=int, default=10, help="steps per method per round (default 10)")
    p.add_argument("--attrib-steps", type=int, default=10, help="steps per method of the attribution pass")
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts, one rank each (default 2)")
    p.add_argument("--rate", default="300mbit", help="link rate of the emulated hosts (default 300mbit)")
    p.add_argument("--no-netem", action="store_true",
                   help="plain loopback via horovodrun (no root needed; wire bytes then count all loopback traffic)")
    p.add_argument("--cycle-time-ms", type=float, default=None, help="HOROVOD_CYCLE_TIME of the job (Horovod: 1 ms)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--no-timeline", action="store_true",
                   help="no Horovod timeline in the attribution pass (no negotiation / fused-collective counts)")
    p.add_argument("--timelines", default=None, help="keep the Horovod timelines of the attribution pass here")
    p.add_argument("--md", default="reports/hvd-breakdown.md", help="markdown report to write ('' for none)")
    p.add_argument("--json", default=None, help="write summary and raw records here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    argv = list(sys.argv[1:] if argv is None else argv)
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models) or (len(models) > 1 and not args.own_jobs):
        p.error(f"--model: one of {', '.join(MODELS)} (a comma-separated list with --own-jobs), got {args.model!r}")
    outs = [run(args, argv, m) for m in models]
    text = "\n".join(format_report(o["summary"], o["meta"]) for o in outs)
    out = outs[0] if len(outs) == 1 else {"runs": outs}
    print(text)
    if args.md:
        path = REPO / args.md if not os.path.isabs(args.md) else Path(args.md)
        path.write_text(text)
        print(f"wrote {args.md}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
