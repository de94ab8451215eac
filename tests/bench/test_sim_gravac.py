"""Smoke test of benchmarks/sim_gravac.py: the CLI parses, rejects bad specs, and a tiny run writes its outputs.

A few steps of the smallest digits MLP (hidden 512) on one workload: well under 30 s on 2 cores.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import sim_gravac

REPO = Path(__file__).resolve().parents[2]


def test_help_runs_as_a_script() -> None:
    out = subprocess.run([sys.executable, "benchmarks/sim_gravac.py", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    assert "--workloads" in out.stdout and "--methods" in out.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "topk:0.5"], "topk CF must be > 1"),
        (["--methods", "gravac:epsilon=2"], "epsilon must be in"),
        (["--methods", "gravac:nonsense"], "gravac options are key=value"),
        (["--methods", "zip"], "unknown method"),
        (["--workloads", "resnet@1gbit"], "workload like mlp4@1gbit"),
        (["--workloads", "mlp4@1gbps"], "workload like mlp4@1gbit"),
    ],
)
def test_bad_specs_are_rejected(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sim_gravac.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_spec_parsing() -> None:
    m = sim_gravac.parse_method("eps=gravac:epsilon=0.8,window=8,gain=authors")
    assert (m.label, m.kind, dict(m.params)) == ("eps", "gravac", {"epsilon": 0.8, "window": 8, "gain": "authors"})
    assert sim_gravac.parse_method("topk:100").cf == 100.0
    w = sim_gravac.parse_workload("mlp4@10gbit:x8")
    assert (w.width, w.rate_bps, w.compute_scale, w.compute_ms) == (4.0, 10e9, 8.0, None)
    assert sim_gravac.parse_workload("mlp1@100mbit:45ms").compute_ms == 45.0


def test_tiny_run_writes_json_and_markdown(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    code = sim_gravac.main(["--workloads", "mlp1@100mbit", "--methods", "gravac", "old=gravac:search=paper",
                            "--steps", "12", "--eval-every", "4", "--no-plot", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]["mlp1@100mbit"]
    assert set(runs) == {"dense", "fp16", "topk:10", "topk:100", "topk:1000", "gravac", "old"}
    gravac = runs["gravac"][0]
    # the first search starts at cf_min (the cap until the momentum is in, here 0), then the whole ladder
    assert len(gravac["times"]) == 12 and gravac["cf_runs"][0][0] == 10.0
    assert max(cf for cf, _ in gravac["cf_runs"]) == 100.0
    assert runs["dense"][0]["bytes_ratio"] == pytest.approx(1.0, rel=1e-3)
    assert runs["topk:100"][0]["bytes_ratio"] > 10
    assert runs["fp16"][0]["bytes_ratio"] == pytest.approx(2.0, rel=1e-3)
    md = (out / "results.md").read_text()
    assert "## mlp1@100mbit" in md and "| gravac |" in md
    assert data["costs"]  # measured compute and compression costs are kept for re-use (--costs)


def test_gain_study_tabulates_every_definition(tmp_path: Path) -> None:
    code = sim_gravac.main(["--gain-study", "--workloads", "mlp1@1gbit", "--steps", "6", "--eval-every", "3",
                            "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "gain_study.json").read_text())
    assert set(data["sent"]) == {"1", "10", "100", "1000"}
    dense = data["sent"]["1"]["phases"]["0-5"]
    assert dense["10"]["residual_ratio"] == pytest.approx(1.0)  # dense: no residual
    assert 0 < dense["1000"]["delivered"] < dense["100"]["delivered"] < dense["10"]["delivered"] <= 1.0
    assert "| 10 | 0-5 | CF 10 |" in (tmp_path / "gain_study.md").read_text()


def test_the_allgather_is_priced_as_the_codec_sends_it() -> None:
    # Below CF 32 a rank's part is a bitmap and the values (wire.gather_bitmap), not (index, value) pairs: the
    # time model prices what the wire carries. 2 ranks, 8 Mbit/s (1 byte per microsecond), no compute, no latency.
    from benchmarks.sim_gravac import Simulator, Workload, _StepRecord

    sim = Simulator(sim_gravac.CostBook(), lr=0.1, momentum=0.0, min_compress_numel=1, eval_every=1, jitter=0.0,
                    latency_s=0.0, log_every=0)
    wl = Workload("w", 1.0, 8e6, compute_ms=0.0)

    def seconds(k: int, n: int) -> float:
        rec = _StepRecord(10.0, (), 0.0, 0, 4, [(k, n)], 0.0, 0.0)
        return sim.step_time(rec, wl, 0.0, 2, random.Random(0))

    n = 64_000
    assert seconds(n // 10, n) == pytest.approx((n // 8 + 4 * (n // 10)) * 1e-6)  # CF 10: bitmap + values
    assert seconds(n // 100, n) == pytest.approx(8 * (n // 100) * 1e-6)          # CF 100: pairs
