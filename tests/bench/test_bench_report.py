"""The comparison report's final-accuracy figures and issue 33's two targets, on hand-made results (no Horovod).

"Final" is the mean of a run's evaluations over its last 10 % of steps (benchmarks.report.final_value); each
method's final is reported as the median over seeds with its min..max, beside dense's own seed-to-seed spread;
AdaptiveCompression() (`gravac`) is held to (a) a median final within that spread or 0.5 point of dense's, and
(b) a time to dense's final less 1 point at most 1.0x the oracle static's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import report

STEPS = 100  # per fake run: one evaluation every 10 steps


def fake(out: Path, label: str, seed: int, step_s: float, accs: list[float], metric: str = "accuracy",
         sent: int = 4000) -> Path:
    """A results.json as crossover-bench writes it: STEPS steps of ``step_s`` s, an evaluation every 10 steps
    (``accs``: 10 values), plus the epoch-end evaluation at step 50 that falls on an --eval-every step."""
    steps = [{"step": i, "epoch": 1, "t": i * step_s, "step_s": step_s, "data_s": 0.0, "loss": 1.0,
              "bytes_sent": sent, "bytes_dense": 4000, "cf": 4000 / sent, "bits": None, "lr": 0.1}
             for i in range(1, STEPS + 1)]
    evals = []
    for k, v in enumerate(accs, start=1):
        evals.append({"epoch": 1, "step": 10 * k, "train_s": 10 * k * step_s, "wall_s": 10 * k * step_s,
                      "eval_s": 0.1, "eval_loss": 1.0, metric: v, "eval_count": 360})
        if 10 * k == 50:
            evals.append(dict(evals[-1]))
    raw = {"meta": {"size": 2, "parameters": 1000, "text": metric == "perplexity", "metric": metric,
                    "finished": True, "job": "", "train_s": STEPS * step_s}, "steps": steps, "evals": evals}
    config = {"compression": label.split("@")[0], "label": label, "model": "mlp", "dataset": "digits",
              "data": None, "hosts": 2, "bandwidth": "300mbit", "batch_size": 32, "warmup": 2, "seed": seed}
    d = out / label.replace(":", "").replace("@", "-")
    report.write_run(raw, config, d, plots=False)
    return d / "results.json"


def curve(end: tuple[float, float], start: float = 0.5) -> list[float]:
    """10 evaluations rising from ``start`` to ``end[0]``, held there from step 70, then ``end[1]`` at step 100 (the
    final window: steps 90 and 100). Time to target reads the mean of 3 evaluations: reached at step 90 at the
    earliest, where the plateau's three evaluations reach it."""
    rise = [start + (end[0] - start) * k / 6 for k in range(6)]
    return [*rise, end[0], end[0], end[0], end[1]]


def test_final_is_the_mean_over_the_last_tenth_of_the_steps() -> None:
    evals = [{"step": s, "accuracy": a} for s, a in ((10, 0.5), (80, 0.9), (90, 0.95), (95, 0.97), (100, 0.96),
                                                     (100, 0.99))]
    value, n = report.final_value(evals, "accuracy")
    assert n == 3 and value == pytest.approx((0.95 + 0.97 + 0.99) / 3)  # step 100 evaluated twice: the later
    assert report.final_value([{"step": 7, "accuracy": 0.3}], "accuracy") == (0.3, 1)
    assert report.final_value([], "accuracy") == (None, 0)
    value, n = report.final_value(evals, "accuracy", window=0.5)
    assert n == 4


# dense on three seeds: finals 0.97, 0.96, 0.98 (spread 2 points); the statics' times to target
DENSE = {0: (0.96, 0.98), 1: (0.95, 0.97), 2: (0.97, 0.99)}


# gravac on those seeds: finals 0.962, 0.952, 0.972 (0.8 point under each seed's dense), reached at step 90
GOOD = {0: (0.962, 0.962), 1: (0.952, 0.952), 2: (0.972, 0.972)}


def matrix(tmp_path: Path, gravac_end: dict[int, tuple[float, float]], gravac_step_s: float) -> list[Path]:
    paths = []
    for seed, end in DENSE.items():
        rep = seed + 1
        paths.append(fake(tmp_path, f"none@{rep}", seed, 1.0, curve(end)))
        paths.append(fake(tmp_path, f"fp16@{rep}", seed, 0.6, curve(end), sent=2000))
        paths.append(fake(tmp_path, f"topk:100@{rep}", seed, 0.3, curve(end), sent=40))
        paths.append(fake(tmp_path, f"gravac@{rep}", seed, gravac_step_s, curve(gravac_end[seed]), sent=40))
    return paths


def test_final_columns_give_median_and_spread_over_seeds_and_dense_spread(tmp_path: Path) -> None:
    paths = matrix(tmp_path, GOOD, 0.25)
    res = report.compare(paths, tmp_path / "cmp")
    rows = {r["method"]: r for r in res["rows"]}
    d, g = rows["none"], rows["gravac"]
    assert d["finals"] == pytest.approx([0.97, 0.96, 0.98]) and d["final_evals"] == 2
    assert (d["final_metric"], d["final_min"], d["final_max"]) == pytest.approx((0.97, 0.96, 0.98))
    assert d["dense_spread"] == pytest.approx(0.02) and d["dense_seeds"] == 3 and d["final_last"] == pytest.approx(0.98)
    assert (g["final_metric"], g["final_min"], g["final_max"]) == pytest.approx((0.962, 0.952, 0.972))
    assert g["final_minus_dense"] == pytest.approx(-0.008)  # against each seed's own dense
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "final accuracy: the mean of its evaluations over the last 10 % of the steps" in md
    assert "dense's own seed-to-seed spread of its final accuracy: 2.00 points over 3 seeds" in md
    assert "| final accuracy: median (min..max) |" in md
    assert "| gravac | 3 |" in md and "| 0.962 (0.952..0.972) | -0.80 points |" in md
    assert "| none | 3 |" in md and "| 0.97 (0.96..0.98) | +0.00 points |" in md
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["final_window"] == 0.1 and len(saved["targets"]) == 2


def test_both_targets_pass_with_figures(tmp_path: Path) -> None:
    # gravac: 0.8 point under dense's median (within its 2-point spread), and faster than top-k 100 to the target
    paths = matrix(tmp_path, GOOD, 0.25)
    res = report.compare(paths, tmp_path / "cmp")
    acc, tta = res["targets"]
    assert acc["pass"] and acc["gap"] == pytest.approx(-0.008) and acc["bound"] == pytest.approx(0.02)
    assert acc["measured"] == ("0.962 (0.952..0.972) against dense 0.97 (0.96..0.98): -0.80 points, bound 2.00 "
                               "points, 3 seeds")
    assert "oracle static (topk:100)" in tta["target"] and tta["pass"]
    assert tta["ratio"] == pytest.approx(0.25 / 0.3)
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| AdaptiveCompression() median final accuracy within dense's seed-to-seed spread or 0.5 point |" in md
    assert "(PASS) |" in md and "(FAIL)" not in md


def test_both_targets_fail_with_figures(tmp_path: Path) -> None:
    # gravac: 3 points under dense (outside its 2-point spread); slower than top-k 100 (0.35 s against 0.3 s a step)
    paths = matrix(tmp_path, {0: (0.94, 0.94), 1: (0.95, 0.935), 2: (0.94, 0.94)}, 0.35)
    acc, tta = report.compare(paths, tmp_path / "cmp")["targets"]
    assert not acc["pass"] and acc["gap"] == pytest.approx(-0.03)
    assert "-3.00 points, bound 2.00 points" in acc["measured"]
    # each seed's target is its dense final less 1 point: 0.96, 0.95, 0.97; gravac reaches it on seed 1 only (its
    # plateau, at step 90)
    assert not tta["pass"] and tta["measured"] == "not reached in every run (1/3), fastest 31.5 s"
    paths = matrix(tmp_path / "slow", {0: (0.97, 0.97), 1: (0.96, 0.96), 2: (0.98, 0.98)}, 0.35)
    acc, tta = report.compare(paths, tmp_path / "slow" / "cmp")["targets"]
    assert acc["pass"] and not tta["pass"] and tta["measured"].startswith("1.17x (")
    assert "(FAIL) |" in (tmp_path / "slow" / "cmp" / "compare.md").read_text()


def test_a_tight_dense_spread_still_allows_half_a_point(tmp_path: Path) -> None:
    rows = [{"method": "none", "metric": "accuracy", "final_metric": 0.97, "final_min": 0.969, "final_max": 0.971,
             "dense_spread": 0.002, "seeds": 3, "oracle_static": "topk:100", "oracle_time_s": 3.0,
             "time_to_dense_final_s": 9.0, "reached_in": "3/3", "time_to_target_min_s": 8.0},
            {"method": "gravac", "metric": "accuracy", "final_metric": 0.966, "final_min": 0.96, "final_max": 0.97,
             "seeds": 3, "oracle_static": "topk:100", "oracle_time_s": 3.0, "time_to_dense_final_s": 3.0,
             "reached_in": "3/3", "time_to_target_min_s": 2.5}]
    acc, tta = report.method_targets(rows)
    assert acc["pass"] and acc["bound"] == pytest.approx(0.005)  # the floor, not the 0.2-point spread
    assert tta["pass"] and tta["ratio"] == pytest.approx(1.0)  # exactly the oracle's time passes (<= 1.0x)
    rows[1]["final_metric"] = 0.964
    assert not report.method_targets(rows)[0]["pass"]
    rows[1]["seeds"] = 2  # fewer than 3 seeds: no verdict can pass
    rows[1]["final_metric"] = 0.97
    acc = report.method_targets(rows)[0]
    assert not acc["pass"] and acc["measured"].endswith("2 seeds (needs >= 3)")


def test_perplexity_targets_are_relative(tmp_path: Path) -> None:
    paths = []
    for seed, end in {0: (10.0, 10.0), 1: (10.2, 10.2), 2: (9.8, 9.8)}.items():
        falling = [40.0 - 3 * k for k in range(8)]
        paths.append(fake(tmp_path, f"none@{seed + 1}", seed, 1.0, [*falling, *end], metric="perplexity"))
        paths.append(fake(tmp_path, f"topk:10@{seed + 1}", seed, 0.5, [*falling, *end], metric="perplexity"))
        g_end = (end[0] * 1.03, end[1] * 1.03)
        paths.append(fake(tmp_path, f"gravac@{seed + 1}", seed, 0.4, [*falling, *g_end], metric="perplexity"))
    res = report.compare(paths, tmp_path / "cmp")
    acc, tta = res["targets"]
    assert acc["target"].endswith("within dense's seed-to-seed spread or 0.5 %")
    assert acc["bound"] == pytest.approx(0.04) and acc["gap"] == pytest.approx(0.03) and acc["pass"]
    assert "+3.00 %, bound 4.00 %" in acc["measured"]
    # 3 % above dense never reaches dense + 1 %
    assert not tta["pass"] and "not reached" in tta["measured"]
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "spread of its final perplexity: 4.00 % over 3 seeds" in md and "| +3.00 % |" in md


def test_context_names_the_fastest_static_choice_that_kept_accuracy() -> None:
    # top-k 100 reached the target first but ended outside target (a)'s bound (compare's verdict): the context line
    # names it and compare's oracle, top-k 10, with gravac's time against it
    def row(method: str, kept: bool | None, t: float | None, oracle: str | None = "topk:10") -> dict:
        return {"method": method, "kept_accuracy": kept, "time_to_dense_final_s": t, "oracle_static": oracle,
                "oracle_time_s": 4.0 if oracle else None}

    rows = [row("none", True, 9.0), row("topk:10", True, 4.0), row("topk:100", False, 2.0), row("gravac", True, 5.0)]
    text = report.kept_accuracy_oracle(rows)
    assert text.endswith("the fastest that kept it: topk:10; AdaptiveCompression() took 1.25x (5.0 s against 4.0 s).")
    assert "outside that accuracy bound: topk:100;" in text
    rows = [dict(r, oracle_static=None, oracle_time_s=None) for r in rows]  # no static kept accuracy and reached it
    assert "no static choice both kept accuracy and reached the target" in report.kept_accuracy_oracle(rows)
    assert report.kept_accuracy_oracle(rows[:3]) is None  # no gravac row


def test_the_oracle_ratio_splits_into_the_path_and_the_speed(tmp_path: Path) -> None:
    # time / oracle = (steps to target / oracle's) x (seconds per step until then / oracle's), per seed against the
    # oracle (top-k 100) on the same seed. Seed 0: the oracle's path at 1.2x its step time; seed 1: its step time,
    # but the target first reached one evaluation later (step 100, not 90); seed 2: the oracle's twin
    paths = []
    for seed, end in DENSE.items():
        paths.append(fake(tmp_path, f"none@{seed + 1}", seed, 1.0, curve(end)))
        paths.append(fake(tmp_path, f"topk:100@{seed + 1}", seed, 0.3, curve(end), sent=40))
    paths.append(fake(tmp_path, "gravac@1", 0, 0.36, curve(DENSE[0]), sent=40))
    paths.append(fake(tmp_path, "gravac@2", 1, 0.3, curve((0.94, 0.97)), sent=40))
    paths.append(fake(tmp_path, "gravac@3", 2, 0.3, curve(DENSE[2]), sent=40))
    rows = {r["method"]: r for r in report.compare(paths, tmp_path / "cmp")["rows"]}
    parts = rows["gravac"]["oracle_parts"]
    assert [(p["seed"], p["steps"], p["oracle_steps"]) for p in parts] == [(0, 90, 90), (1, 100, 90), (2, 90, 90)]
    assert [p["path"] for p in parts] == pytest.approx([1.0, 100 / 90, 1.0])
    assert [p["speed"] for p in parts] == pytest.approx([1.2, 1.0, 1.0])
    for p in parts:
        assert p["time_s"] / p["oracle_time_s"] == pytest.approx(p["path"] * p["speed"])
    assert rows["none"]["oracle_parts"] == [] and rows["topk:100"]["oracle_parts"] == []
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert ("per seed against topk:100 on the same seed: steps to the target 90 vs 90, 100 vs 90, 90 vs 90 (the "
            "path: median 1.00x); training seconds per step until then 1.20x, 1.00x, 1.00x (the speed, search "
            "included: median 1.00x); the steps at the CF it sent most, the search's left out: 1.20x, 1.00x, 1.00x "
            "(median 1.00x).") in md
    # A search: 3 dense steps of 0.4 s among steps of 0.1 s at CF 10 count in the speed, not at the CF sent most
    trial = (5, 6, 7)
    steps = [{"step": i, "step_s": 0.4 if i in trial else 0.1, "data_s": 0.01, "cf": 1.0 if i in trial else 10.0}
             for i in range(1, 21)]
    assert report._settled_step_s(steps, 10) == pytest.approx(0.11)
    assert math.isnan(report._settled_step_s([{**x, "cf": None} for x in steps], 10))


def test_time_to_target_reads_a_moving_mean_of_three_evaluations() -> None:
    """A lucky evaluation on a small test set does not decide a time: the mean of it and the two before it must."""
    evals = [{"step": 10 * i, "train_s": float(i), "accuracy": a}
             for i, a in enumerate((0.5, 0.95, 0.6, 0.9, 0.92, 0.93, 0.96), start=1)]
    assert report.TTA_SMOOTH == 3
    assert report.first_reach(evals, "accuracy", 0.9)["step"] == 60  # mean(0.9, 0.92, 0.93); the spike at 20 is not
    assert report.first_reach(evals, "accuracy", 0.9, smooth=1)["step"] == 20
    assert report.time_to(evals, "accuracy", 0.99) is None
    ppl = [{"step": s, "train_s": float(s), "perplexity": p}
           for s, p in enumerate((9.0, 3.0, 9.0, 5.0, 4.0, 4.0), start=1)]
    assert report.first_reach(ppl, "perplexity", 5.0)["step"] == 6  # lower is better: mean(5, 4, 4) = 4.33
    assert report.first_reach(ppl, "perplexity", 5.0, smooth=1)["step"] == 2


def test_the_oracle_is_the_fastest_fixed_choice_that_kept_accuracy(tmp_path: Path) -> None:
    # top-k 100 reaches dense's final less 1 point first on every seed, but ends 2 points under dense, outside target
    # (a)'s bound (0.5 point: dense's spread here is 0): the oracle of target (b) is top-k 10, not top-k 100
    paths = []
    for seed in range(3):
        paths.append(fake(tmp_path, f"none@{seed + 1}", seed, 1.0, curve((0.97, 0.97))))
        paths.append(fake(tmp_path, f"topk:10@{seed + 1}", seed, 0.5, curve((0.97, 0.97)), sent=400))
        paths.append(fake(tmp_path, f"topk:100@{seed + 1}", seed, 0.2, curve((0.96, 0.94)), sent=40))
        paths.append(fake(tmp_path, f"gravac@{seed + 1}", seed, 0.5, curve((0.97, 0.97)), sent=400))
    res = report.compare(paths, tmp_path / "cmp")
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["topk:100"]["time_to_dense_final_s"] < rows["topk:10"]["time_to_dense_final_s"]
    assert rows["gravac"]["oracle_static"] == "topk:10" and rows["gravac"]["time_vs_oracle"] == pytest.approx(1.0)
    assert res["targets"][1]["pass"] and "oracle static (topk:10)" in res["targets"][1]["target"]
