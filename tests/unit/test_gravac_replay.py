"""Same decisions before and after: recorded observation sequences replayed through today's GravacPolicy.

The recordings (``tests/data/gravac_replay.json.gz``, made by ``tests/gravac_recordings.py``) hold, for several
synthetic workloads and both searches, every plan the policy made and the statistics it was fed, with its
state and summary at a few steps. Feeding the same statistics must give the same plans on every step, the same
``state_dict()`` (the current version, 6: the recordings were regenerated with the momentum cap) and the same
``summary()``; a saved state loaded mid-run must continue with the same plans.
"""

from __future__ import annotations

import gzip
import json

import pytest
from gravac_recordings import DATA, _plain, plan_json, stats_from_json

from crossover.adaptive.gravac import GravacPolicy, StepStats


def _recordings() -> list[dict]:
    with gzip.open(DATA, "rt", encoding="utf-8") as fh:
        return json.load(fh)


RECORDINGS = _recordings()


def _norm(x):
    """JSON round trip (tuples become lists, float keys strings) so states compare as saved."""
    return json.loads(json.dumps(x))


@pytest.mark.parametrize("rec", RECORDINGS, ids=[r["name"] for r in RECORDINGS])
def test_replay_gives_the_recorded_plans_states_and_summaries(rec):
    policy = GravacPolicy(**rec["settings"])
    for t, (want, fed) in enumerate(zip(rec["plans"], rec["fed"])):
        got = plan_json(policy.plan())
        assert got == want, f"{rec['name']}: step {t}: plan {got} != recorded {want}"
        if fed is not None:
            policy.observe(StepStats(**stats_from_json(fed)))
        snap = rec["snapshots"].get(str(t + 1))
        if snap is not None:
            assert _norm(policy.state_dict()) == snap["state"], f"{rec['name']}: state after step {t + 1}"
            summary = _norm(_plain(policy.summary()))
            assert summary == snap["summary"], f"{rec['name']}: summary after step {t + 1}"


@pytest.mark.parametrize("rec", RECORDINGS, ids=[r["name"] for r in RECORDINGS])
def test_a_recorded_state_loads_and_continues_the_same_schedule(rec):
    steps = sorted(int(k) for k in rec["snapshots"])
    at = steps[len(steps) // 2]
    policy = GravacPolicy.from_state_dict(rec["snapshots"][str(at)]["state"])
    for t in range(at, len(rec["plans"])):
        assert plan_json(policy.plan()) == rec["plans"][t], f"{rec['name']}: step {t} after loading step {at}"
        if rec["fed"][t] is not None:
            policy.observe(StepStats(**stats_from_json(rec["fed"][t])))
