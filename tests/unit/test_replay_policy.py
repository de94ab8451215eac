"""benchmarks/replay_policy.py: a policy CSV written by the real step driver replays to the same decisions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import replay_policy
from crossover.adaptive.gravac import GravacPolicy
from crossover.driver import SparseStepDriver


def _step_time(cf: float, t: int) -> float:
    """VGG-16-like step times (CF 100 1.26x CF 10's rate) with a slow phase from step 60 on."""
    base = {100.0: 0.182, 10.0: 0.230, 1.0: 0.375}[cf]
    return base * (1.4 if t >= 60 else 1.0) * (1.0 + 0.05 * math.sin(1.7 * t))


def record_run(path: Path, steps: int = 160, momentum: float = 0.0) -> list[float]:
    """Drive GravacPolicy through SparseStepDriver (one rank) as the glue does, with its CSV log; return the
    CFs sent. The residual of CF 100 builds over each stretch at that CF (its gain rises to 0.8)."""
    driver = SparseStepDriver(GravacPolicy(), compressor="topk", seed=0, log_csv=str(path))
    now, sent, since = 0.0, [], 0
    for t in range(steps):
        rec = driver.begin_step(now)
        cf = rec.sent_cf
        since = since + 1 if sent and sent[-1] == cf else 0
        sent.append(cf)
        gain = 1.0 if cf != 100.0 else min(0.8, 0.45 + 0.08 * since)
        probe_sq = [(2.0 * gain) ** 2 for _ in rec.probes]
        driver.add_reduced(driver.layout.local(step_time=driver.last_step_time, grad_sq=4.0, acc_sq=5.0,
                                               probe_sq=probe_sq, momentum=momentum), world=1)
        driver.count(1000 // int(cf), 1000)
        now += _step_time(cf, t)
    driver.begin_step(now)  # finishes the last step: its statistics reach the log
    return sent


def test_a_recorded_run_replays_to_the_same_decisions(tmp_path: Path) -> None:
    sent = record_run(tmp_path / "policy.csv")
    csv_path = tmp_path / "policy.rank0.csv"
    rows = replay_policy.read_rows(csv_path)
    result = replay_policy.replay(rows)
    assert result.diverges_at is None
    assert result.recorded == result.replayed == sent[:len(rows)]
    assert len(set(sent)) >= 2  # the run did move (a search, then a drift check in the slow phase)


def test_other_settings_diverge_where_they_decide_otherwise(tmp_path: Path) -> None:
    record_run(tmp_path / "policy.csv")
    rows = replay_policy.read_rows(tmp_path / "policy.rank0.csv")
    result = replay_policy.replay(rows, {"epsilon": 0.9})  # CF 100's gain (at most 0.8) now fails epsilon
    assert result.diverges_at is not None
    at = result.diverges_at
    assert result.recorded[:at] == result.replayed[:at] and result.recorded[at] != result.replayed[at]


def test_cli_reports_and_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record_run(tmp_path / "policy.csv")
    path = str(tmp_path / "policy.rank0.csv")
    assert replay_policy.main([path]) == 0
    assert "same decisions on all" in capsys.readouterr().out
    assert replay_policy.main(["--set", "epsilon=0.9", path]) == 1
    assert "decisions differ from step" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--set", "gain=authors"], "cannot be replayed"),
    (["--set", "omega=2"], "omega must be in"),
    (["--set", "nonsense"], "expected KEY=VALUE"),
])
def test_cli_rejects_what_it_cannot_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                           message: str) -> None:
    record_run(tmp_path / "policy.csv")
    with pytest.raises(SystemExit) as exc:
        replay_policy.main([*argv, str(tmp_path / "policy.rank0.csv")])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_file_that_is_not_a_policy_csv_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "steps.csv"
    bad.write_text("step,epoch,t\n1,1,0.3\n")
    with pytest.raises(ValueError, match="missing columns"):
        replay_policy.read_rows(bad)


def test_the_momentum_column_replays_the_cap_and_older_logs_still_load(tmp_path: Path) -> None:
    sent = record_run(tmp_path / "policy.csv", momentum=0.9)
    assert max(sent) == 10.0  # capped from the first step on: nothing above the cap is ever sent
    rows = replay_policy.read_rows(tmp_path / "policy.rank0.csv")
    assert {r["momentum"] for r in rows} == {repr(0.9)}
    result = replay_policy.replay(rows)
    assert result.diverges_at is None and result.replayed == sent[:len(rows)]
    # a log written before the column existed: it loads, and replays as a run that reported no momentum
    old = [{k: v for k, v in r.items() if k != "momentum"} for r in rows]
    assert max(replay_policy.replay(old).replayed) == 100.0
