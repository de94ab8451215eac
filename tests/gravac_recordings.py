"""Recorded GraVAC observation sequences for the replay test (``tests/unit/test_gravac_replay.py``).

Each scenario drives a :class:`GravacPolicy` in a closed loop against a small synthetic job (compute time,
communication shrinking with the CF, noise, pauses, a link that changes speed mid-run, gains that grow while a
residual builds, an occasional non-finite step) and records, per step, the plan the policy made and the
statistics it was then fed, plus its ``state_dict()`` and ``summary()`` at a few steps. The replay test feeds the
recorded statistics to today's policy (open loop) and asserts the same plans, states and summaries: a refactor
that changes any decision fails it.

Regenerate only when a decision change is intended (and say so in the commit):

    python tests/gravac_recordings.py          # writes tests/data/gravac_replay.json.gz
"""

from __future__ import annotations

import gzip
import json
import math
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "gravac_replay.json.gz"

#: (name, policy settings, job model, steps, lag): the job model's keys are read by ``_Job``.
SCENARIOS: list[tuple[str, dict[str, Any], dict[str, Any], int, int]] = [
    ("ladder-defaults-slow-link", {}, {"compute": 0.02, "comm": 0.5, "noise": 0.05}, 400, 1),
    ("ladder-defaults-fast-link", {}, {"compute": 0.10, "comm": 0.02, "noise": 0.08, "overhead": 0.01}, 400, 1),
    ("ladder-defaults-tie", {}, {"compute": 0.10, "comm": 0.03, "noise": 0.10, "overhead": 0.02}, 500, 1),
    ("ladder-defaults-drift", {}, {"compute": 0.03, "comm": 0.3, "noise": 0.05, "drift_at": 150,
                                   "drift": 0.1, "pause_p": 0.03}, 600, 1),
    ("ladder-defaults-lowgain", {}, {"compute": 0.02, "comm": 0.4, "noise": 0.05, "gain_k": 0.12,
                                     "gain_growth": 60.0, "nonfinite_p": 0.01}, 600, 1),
    ("ladder-cfmax1000-noisy", {"cf_max": 1000.0}, {"compute": 0.05, "comm": 0.4, "noise": 0.25,
                                                  "pause_p": 0.05, "drift_at": 300, "drift": 4.0}, 800, 2),
    ("ladder-window8-startcf", {"window": 8, "start_cf": 10.0, "cf_max": 1000.0},
     {"compute": 0.02, "comm": 0.6, "noise": 0.05, "gain_k": 0.3}, 400, 1),
    ("ladder-warmup-norm", {"warmup_steps": 20, "gain": "norm", "epsilon": 0.3},
     {"compute": 0.05, "comm": 0.2, "noise": 0.1}, 400, 0),
    ("ladder-authors-gain", {"gain": "authors", "epsilon": 0.7, "omega": 0.05},
     {"compute": 0.04, "comm": 0.25, "noise": 0.1, "drift_at": 200, "drift": 0.2}, 500, 1),
    ("paper-defaults", {"search": "paper", "gain": "norm", "epsilon": 0.9, "omega": 0.01, "window": 40,
                        "cf_max": 1000.0}, {"compute": 0.03, "comm": 0.3, "noise": 0.05}, 500, 1),
    ("paper-geometric-delivered", {"search": "paper", "scaling": "geometric", "window": 25, "cf_max": 2000.0,
                                   "warmup_steps": 10},
     {"compute": 0.02, "comm": 0.4, "noise": 0.1, "gain_k": 0.5, "nonfinite_p": 0.02}, 500, 2),
    ("paper-auto-authors", {"search": "paper", "gain": "authors", "epsilon": 0.75, "omega": 0.05},
     {"compute": 0.05, "comm": 0.2, "noise": 0.1}, 600, 1),
    ("paper-settles", {"search": "paper", "gain": "norm", "epsilon": 0.5, "omega": 0.1, "window": 20},
     {"compute": 0.2, "comm": 0.05, "noise": 0.05, "gain_k": 3.0}, 300, 1),
    ("ladder-top-slows", {}, {"compute": 0.02, "comm": 0.5, "noise": 0.03, "drift_at": 120, "drift": 6.0}, 400, 1),
    ("ladder-tie-gain-fails", {"epsilon": 0.8}, {"compute": 0.2, "comm": 0.02, "noise": 0.05, "gain_k": 0.4,
                                                "gain_growth": 200.0}, 500, 1),
]

#: Steps at which the state and the summary are recorded (besides the last one).
SNAPSHOTS = (1, 17, 64, 150, 333)


class _Job:
    """A synthetic job: step time and gradient norms for the CF the policy sends (deterministic per seed)."""

    def __init__(self, seed: int, compute: float, comm: float, noise: float, overhead: float = 0.002,
                 drift_at: int | None = None, drift: float = 1.0, pause_p: float = 0.0, gain_k: float = 1.0,
                 gain_growth: float = 20.0, nonfinite_p: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.compute, self.comm, self.noise, self.overhead = compute, comm, noise, overhead
        self.drift_at, self.drift, self.pause_p = drift_at, drift, pause_p
        self.gain_k, self.gain_growth, self.nonfinite_p = gain_k, gain_growth, nonfinite_p
        self.last_cf = 1.0
        self.since_switch = 0

    def step_time(self, t: int, cf: float) -> float:
        comm = self.comm * (self.drift if self.drift_at is not None and t >= self.drift_at else 1.0)
        base = self.compute + comm / cf + (self.overhead if cf > 1 else 0.0)
        jitter = math.exp(self.rng.gauss(0.0, self.noise))
        pause = 3.0 if self.rng.random() < self.pause_p else 1.0
        return base * jitter * pause

    def gain(self, cf: float) -> float:
        """Kept fraction of the norm at ``cf``, growing while the residual of a new CF builds."""
        if cf <= 1.0:
            return 1.0
        settled = min(1.0, self.gain_k * (10.0 / cf) ** 0.35 + 0.25)
        build = 1.0 - math.exp(-self.since_switch / self.gain_growth)
        return max(0.01, settled * (0.6 + 0.4 * build))

    def stats(self, t: int, plan: Any) -> dict[str, Any]:
        if plan.send_cf != self.last_cf:
            self.last_cf, self.since_switch = plan.send_cf, 0
        self.since_switch += 1
        g_sq = self.rng.uniform(0.5, 2.0)
        acc_sq = g_sq * self.rng.uniform(1.0, 1.6)
        probes = {cf: acc_sq * self.gain(cf) ** 2 * self.rng.uniform(0.9, 1.0) for cf in plan.probe_cfs}
        bad = self.rng.random() < self.nonfinite_p
        return {
            "sent_cf": plan.send_cf,
            "dense_sq_norm": math.nan if bad else acc_sq,
            "compressed_sq_norms": probes,
            "step_time_s": self.step_time(t, plan.send_cf),
            "samples": 64.0,
            "grad_sq_norm": g_sq,
            "grad_norm_sum": math.sqrt(g_sq) * 3.1,
            "dense_norm_sum": math.sqrt(acc_sq) * 3.1,
            "compressed_norm_sums": {cf: math.sqrt(v) * 3.3 for cf, v in probes.items()},
        }


def plan_json(plan: Any) -> list[Any]:
    return [plan.send_cf, list(plan.probe_cfs), plan.measure]


def stats_json(d: dict[str, Any]) -> dict[str, Any]:
    """JSON keys must be strings: float-keyed maps become [cf, value] pairs."""
    return {k: (sorted([float(cf), v] for cf, v in val.items()) if isinstance(val, dict) else val)
            for k, val in d.items()}


def stats_from_json(d: dict[str, Any]) -> dict[str, Any]:
    return {k: ({cf: v for cf, v in val} if isinstance(val, list) else val) for k, val in d.items()}


def _plain(x: Any) -> Any:
    """A summary with float dict keys as JSON can hold it (string keys, sorted)."""
    if isinstance(x, dict):
        return {repr(k) if isinstance(k, float) else str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def record(name: str, settings: dict[str, Any], job: dict[str, Any], steps: int, lag: int,
           seed: int = 0) -> dict[str, Any]:
    """Drive one scenario with the policy of the code in this checkout; return the recording."""
    from crossover.adaptive.gravac import GravacPolicy, StepStats

    policy = GravacPolicy(**settings)
    sim = _Job(seed, **job)
    plans, fed, snaps = [], [], {}
    queue: list[dict[str, Any]] = []
    for t in range(steps):
        plan = policy.plan()
        plans.append(plan_json(plan))
        queue.append(sim.stats(t, plan))
        fed.append(None)
        if len(queue) > lag:
            d = queue.pop(0)
            fed[-1] = stats_json(d)
            policy.observe(StepStats(**d))
        if t + 1 in SNAPSHOTS or t + 1 == steps:
            snaps[str(t + 1)] = {"state": policy.state_dict(), "summary": _plain(policy.summary())}
    return {"name": name, "settings": settings, "plans": plans, "fed": fed, "snapshots": snaps}


def scenarios() -> Iterator[dict[str, Any]]:
    for name, settings, job, steps, lag in SCENARIOS:
        yield record(name, settings, job, steps, lag)


def main() -> int:
    recs = list(scenarios())
    DATA.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(DATA, "wt", encoding="utf-8") as fh:
        json.dump(recs, fh, separators=(",", ":"))
    for r in recs:
        cfs = [p[0] for p in r["plans"]]
        print(f"{r['name']}: {len(cfs)} steps, CFs sent {sorted(set(cfs))}, "
              f"searches {r['snapshots'][str(len(cfs))]['summary'].get('searches')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    raise SystemExit(main())
