"""Issue 27, compression side, in this process: hostile or careless values given to the compression
objects' settings, CSV log and saved states (the multi-rank halves are in tests/hvd/test_hardening_hvd.py
and tests/ddp/test_ddp_hook.py)."""

from __future__ import annotations

import copy
import errno
import logging
import os

import pytest
import torch

from crossover.adaptive.static import StaticPolicy
from crossover.driver import SparseStepDriver, StepLog


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_of():
    """`warnings_of(name)`: the WARNING messages logger `name` emits from now on."""
    attached = []

    def attach(name: str) -> list[str]:
        h = _Records()
        logging.getLogger(name).addHandler(h)
        attached.append((name, h))
        return h.messages

    yield attach
    for name, h in attached:
        logging.getLogger(name).removeHandler(h)


# ------------------------------------------------------------------------------------------------
# item 4: log_csv is checked at construction and never stops training
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [123, b"x.csv", "", "{foo}.csv", "log-{}.csv", "log-{rank.x}.csv", "{rank", "d/"])
def test_log_csv_bad_pattern_refused_at_construction(bad):
    with pytest.raises(ValueError, match="log_csv"):
        StepLog(bad, lambda: 0)


def test_log_csv_missing_directory_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        StepLog(str(tmp_path / "nope" / "g.csv"), lambda: 0)
    (tmp_path / "r0").mkdir()
    StepLog(str(tmp_path / "r{rank}" / "g.csv"), lambda: 0)  # rank 0's directory exists
    with pytest.raises(ValueError, match=r"r1.*\(rank 1\) does not exist"):  # a missing per-rank directory
        StepLog(str(tmp_path / "r{rank}" / "g.csv"), lambda: 1)


def test_log_csv_rank_unknown_defers_a_per_rank_directory(tmp_path, warnings_of):
    """Horovod not initialised at construction: the per-rank directory is checked at the first step,
    where a missing one stops the log with a warning instead of raising."""
    said = warnings_of("crossover.driver")
    state = {"rank": None}

    def rank() -> int:
        if state["rank"] is None:
            raise ValueError("Horovod has not been initialized")
        return state["rank"]

    slog = StepLog(str(tmp_path / "r{rank}" / "g.csv"), rank)
    state["rank"] = 3
    slog.open()
    assert slog.path is None and slog.stopped and len(said) == 1 and "stops here" in said[0]


def test_log_csv_pathlike_and_the_mode(tmp_path):
    slog = StepLog(tmp_path / "g-{rank}.csv", lambda: 2)
    slog.open()
    assert slog.path == str(tmp_path / "g-2.csv")
    assert os.stat(slog.path).st_mode & 0o777 == 0o600
    slog.close()


def test_log_csv_never_writes_through_a_planted_symlink(tmp_path, warnings_of):
    said = warnings_of("crossover.driver")
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    os.symlink(target, tmp_path / "g.rank0.csv")  # planted where rank 0's log goes
    os.symlink(tmp_path / "missing", tmp_path / "g.rank0.1.csv")  # a dangling one next: O_CREAT would follow it
    drv = SparseStepDriver(StaticPolicy(cf=4.0), compressor="topk", seed=0, log_csv=str(tmp_path / "g.csv"))
    for step in range(5):
        drv.begin_step(float(step))
        drv.add_reduced([1.0, 0.1, 4.0, 2.0, 4.0, 2.0, 0.0, 1.0, 1.0], 1)
    assert target.read_text() == "keep me\n" and not (tmp_path / "missing").exists()
    assert drv.log.path == str(tmp_path / "g.rank0.2.csv")
    assert (tmp_path / "g.rank0.2.csv").read_text().startswith("step,sent_cf")
    assert len(said) == 1 and "exists" in said[0]


def test_log_csv_gives_up_on_a_directory_full_of_decoys(tmp_path, warnings_of, monkeypatch):
    from crossover.driver import steplog

    said = warnings_of("crossover.driver")
    monkeypatch.setattr(steplog, "MAX_NAME_TRIES", 3)
    for name in ("g.rank0.csv", "g.rank0.1.csv", "g.rank0.2.csv", "g.rank0.3.csv"):
        (tmp_path / name).write_text("decoy\n")
    slog = StepLog(str(tmp_path / "g.csv"), lambda: 0)
    slog.open()
    assert slog.path is None and slog.stopped and len(said) == 1


def test_log_csv_io_error_stops_the_log_with_one_warning(tmp_path, warnings_of):
    """ENOSPC in the middle of a run (the real full disk is in tests/hvd/test_hardening_hvd.py): the driver
    keeps stepping and observing, one warning, later rows are not attempted."""
    said = warnings_of("crossover.driver")
    drv = SparseStepDriver(StaticPolicy(cf=4.0), compressor="topk", seed=0, log_csv=str(tmp_path / "g.csv"))
    calls = {"n": 0}

    class FillingDisk:  # the open file, full after the header and three rows
        def __init__(self, f):
            self.f = f

        def write(self, data):
            calls["n"] += 1
            if calls["n"] > 4:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def close(self):
            self.f.close()

    drv.log.open()
    drv.log._file = FillingDisk(drv.log._file)
    calls["n"] = 1  # the header went out at open
    for step in range(20):
        drv.begin_step(float(step))
        drv.add_reduced([1.0, 0.1, 4.0, 2.0, 4.0, 2.0, 0.0, 1.0, 1.0], 1)
    assert drv.step == 20 and drv.policy.step == 18  # observed one step late, nothing skipped
    assert calls["n"] == 5 and len(said) == 1 and "No space left" in said[0] and drv.log.stopped
    with open(drv.log.path) as fh:
        assert len(fh.read().splitlines()) == 4  # the header and three rows


def test_log_csv_copy_never_shares_the_open_file(tmp_path):
    drv = SparseStepDriver(StaticPolicy(cf=4.0), compressor="topk", seed=0, log_csv=str(tmp_path / "g.csv"))
    drv.begin_step(0.0)
    twin = copy.deepcopy(drv)
    assert twin.log.path is None and twin.log._file is None
    twin.begin_step(1.0)
    assert twin.log.path == str(tmp_path / "g.rank0.1.csv")
    drv.log.close()
    twin.log.close()


# ------------------------------------------------------------------------------------------------
# item 6: the DDP state checks a checkpoint before it applies any of it (no process group needed here;
# the real 2-process job is tests/ddp/test_hardening_ddp.py)
# ------------------------------------------------------------------------------------------------
def _ddp_state_with_params():
    from crossover.ddp import AdaptiveState

    st = AdaptiveState(policy="gravac", cf_min=4, min_compress_numel=1)
    params = [torch.nn.Parameter(torch.zeros(5, 4)), torch.nn.Parameter(torch.zeros(3))]
    layouts = st._engine.layouts
    layouts.key(0, params, torch.zeros(23))  # the hook saw one bucket holding both parameters
    layouts.memory.get("bucket0")[:] = 0.5
    return st


@pytest.mark.parametrize("what", ["nan residual", "inf residual", "wrong size", "bool key", "str key", "list",
                                  "int tensor", "None", "list state", "no driver", "policy nan", "missing step"])
def test_ddp_load_state_dict_refuses_and_changes_nothing(what):
    st = _ddp_state_with_params()
    good = st.state_dict()
    res = good["residuals"]
    drv = good["driver"]
    bad = {
        "nan residual": {**good, "residuals": {0: torch.full((20,), float("nan")), 1: res[1]}},
        "inf residual": {**good, "residuals": {0: res[0], 1: torch.tensor([0.0, float("inf"), 0.0])}},
        "wrong size": {**good, "residuals": {0: torch.zeros(21), 1: res[1]}},
        "bool key": {**good, "residuals": {True: res[1]}},
        "str key": {**good, "residuals": {"0": res[0]}},
        "list": {**good, "residuals": [res[0], res[1]]},
        "int tensor": {**good, "residuals": {0: torch.zeros(20, dtype=torch.int32)}},
        "None": None,
        "list state": [good],
        "no driver": {k: v for k, v in good.items() if k != "driver"},
        "policy nan": {**good, "driver": {**drv, "policy": {**drv["policy"], "ref_time": float("nan")}}},
        "missing step": {**good, "driver": {k: v for k, v in drv.items() if k != "step"}},
    }[what]
    # a valid policy state that differs from the current one rides along: it must not load either
    if isinstance(bad, dict) and "driver" in bad and what not in ("policy nan", "missing step"):
        bad["driver"] = {**drv, "step": drv["step"] + 7}
    with pytest.raises(ValueError):
        st.load_state_dict(bad)
    after = st.state_dict()
    assert after["driver"] == drv
    assert after["residuals"].keys() == res.keys() and all(torch.equal(after["residuals"][k], res[k]) for k in res)
    st.load_state_dict(good)


def test_ddp_fp16_state_counters_checked():
    from crossover.ddp import AdaptiveState

    st = AdaptiveState(policy="fp16")
    good = st.state_dict()
    for bad in ({**good, "step": "3"}, {**good, "step": 2.5}, {**good, "bytes_sent": -1}, {**good, "step": None},
                {k: v for k, v in good.items() if k != "bytes_dense"}):
        with pytest.raises(ValueError):
            st.load_state_dict(bad)
        assert st.state_dict() == good


# ------------------------------------------------------------------------------------------------
# weak item: saved policy and driver states are read strictly (no NaN, negative, string or missing field)
# ------------------------------------------------------------------------------------------------
def _gravac_state(search: str) -> dict:
    from crossover.adaptive.gravac import GravacPolicy, StepStats

    pol = GravacPolicy(cf_min=4, cf_max=64, window=4, search=search)
    for i in range(12):
        plan = pol.plan()
        pol.observe(StepStats(sent_cf=plan.send_cf, dense_sq_norm=1.0,
                              compressed_sq_norms={cf: 0.9 / cf ** 0.1 for cf in plan.probe_cfs},
                              step_time_s=0.1 + 0.01 * i, samples=32.0, grad_sq_norm=1.0))
    return pol.state_dict()


@pytest.mark.parametrize("search", ["ladder", "paper"])
@pytest.mark.parametrize("field,value", [("settled", "x"), ("settled", 1), ("step", -1), ("step", float("nan")),
                                         ("step", "3"), ("windows", -2), ("floor", float("nan")), ("floor", "20"),
                                         ("candidate", -4.0), ("ref_time", float("inf")), ("best_rate", -1.0),
                                         ("gains", [[4.0, float("nan"), 1, 0.5, 0.5]]), ("recent", ["0.1"]),
                                         ("scale", float("nan")), ("window_step", -1), ("direction", 0),
                                         ("reason", "bored"), ("throughput", [[4.0, -1.0, 1.0, 1.0, 1]])])
def test_gravac_state_fields_refused(search, field, value):
    from crossover.adaptive.gravac import GravacPolicy

    good = _gravac_state(search)
    pol = GravacPolicy(cf_min=4, cf_max=64, window=4, search=search)
    pol.load_state_dict(good)
    with pytest.raises(ValueError, match="state"):
        pol.load_state_dict({**good, field: value})
    assert pol.state_dict() == good


@pytest.mark.parametrize("search", ["ladder", "paper"])
def test_gravac_state_missing_fields_refused(search):
    from crossover.adaptive.gravac import GravacPolicy

    good = _gravac_state(search)
    pol = GravacPolicy(cf_min=4, cf_max=64, window=4, search=search)
    for field in good:
        if field == "version":
            continue
        with pytest.raises(ValueError):
            pol.load_state_dict({k: v for k, v in good.items() if k != field})
    with pytest.raises(ValueError):
        pol.load_state_dict(None)
    pol.load_state_dict(good)
    assert pol.state_dict() == good


def _dq_policy_state() -> dict:
    from crossover.adaptive.dqsgd import DqsgdPolicy, DqsgdStats

    pol = DqsgdPolicy(total_steps=100, error_budget=0.01)
    for t in range(3):
        pol.observe(DqsgdStats(grad_sq_norm=2.0, numel=1000, lr=0.1, step=t))
    return pol.state_dict()


@pytest.mark.parametrize("field,value", [("next_step", -1), ("next_step", "2"), ("next_step", 2.5),
                                         ("total_steps", 0), ("grad_sq_norm", float("nan")), ("grad_sq_norm", -1.0),
                                         ("lr", 0.0), ("lr", "0.1"), ("numel", 0), ("observations", -1),
                                         ("ignored", True), ("budget_spent", float("inf")), ("budget_spent", None),
                                         ("lr", None)])
def test_dqsgd_policy_state_fields_refused(field, value):
    from crossover.adaptive.dqsgd import DqsgdPolicy

    good = _dq_policy_state()
    pol = DqsgdPolicy(total_steps=100, error_budget=0.01)
    pol.load_state_dict(good)
    with pytest.raises(ValueError, match="DqsgdPolicy state"):
        pol.load_state_dict({**good, field: value})
    assert pol.state_dict() == good
    for missing in good:
        if missing != "version":
            with pytest.raises(ValueError):
                pol.load_state_dict({k: v for k, v in good.items() if k != missing})
    assert pol.state_dict() == good


def test_driver_states_missing_fields_refused():
    """sparse.py and quant.py no longer read a missing field as 0 (a silent reset of a counter, or of the
    step that seeds the shared random choices)."""
    from crossover.driver import QuantStepDriver, dqsgd_settings

    drv = SparseStepDriver(StaticPolicy(cf=4.0), compressor="topk", seed=3)
    for step in range(3):
        drv.begin_step(float(step))
        drv.add_reduced([1.0, 0.1, 4.0, 2.0, 4.0, 2.0, 0.0, 1.0, 1.0], 1)
    good = drv.state_dict()
    for field in good:
        with pytest.raises(ValueError):
            drv.load_state_dict({k: v for k, v in good.items() if k != field})
    for rec in ("current", "pending"):
        partial = {k: v for k, v in good[rec].items() if k != "tensors"}
        with pytest.raises(ValueError, match="missing fields"):
            drv.load_state_dict({**good, rec: partial})
        with pytest.raises(ValueError):
            drv.load_state_dict({**good, rec: {**good[rec], "probes": ["4"]}})
    for seed in (1.5, "0", 2 ** 70, True):
        with pytest.raises(ValueError, match="seed"):
            drv.load_state_dict({**good, "seed": seed})
    assert drv.state_dict() == good

    settings = dqsgd_settings(total_steps=50, lr=0.1, error_budget=0.01, target_bits=6, b_min=2, b_max=8, decay=0.999)
    qd = QuantStepDriver(bits=6, dqsgd=settings)
    good = qd.state_dict()
    for field in good:
        with pytest.raises(ValueError):
            qd.load_state_dict({k: v for k, v in good.items() if k != field})
    other = QuantStepDriver(bits=6, dqsgd={**settings, "total_steps": 60}).state_dict()
    with pytest.raises(ValueError, match="total_steps"):  # another run's DQ-SGD settings
        qd.load_state_dict(other)
    with pytest.raises(ValueError, match="fixed-bits"):
        QuantStepDriver(bits=6).load_state_dict(good)
    assert qd.state_dict() == good


# ------------------------------------------------------------------------------------------------
# weak item: every setting of every compression object is checked at construction (no coercion)
# ------------------------------------------------------------------------------------------------
_BAD_SETTINGS = [("enabled", "False"), ("enabled", 0), ("enabled", None), ("error_feedback", "False"),
                 ("error_feedback", 1), ("seed", 1.5), ("seed", "0"), ("seed", 2 ** 70), ("seed", True),
                 ("seed", None), ("log_csv", 123), ("log_csv", "{foo}.csv"), ("log_csv", "")]


def _torch_objects() -> dict:
    from crossover import AdaptiveCompression, StaticCompression
    from horovod_ext.torch_compression import GravacCompression
    from horovod_ext.torch_quantization import QSGDCompression

    return {
        "AdaptiveCompression": lambda **kw: AdaptiveCompression("topk", **kw),
        "GravacCompression": lambda **kw: GravacCompression("randomk", **kw),
        "StaticCompression": lambda **kw: StaticCompression("randomk", **kw),
        "AdaptiveCompression(dqsgd)": lambda **kw: AdaptiveCompression(policy="dqsgd", total_steps=10, lr=0.1, **kw),
        "QSGDCompression": lambda **kw: QSGDCompression(4, **kw),
    }


def _ddp_objects() -> dict:
    from crossover.ddp import AdaptiveState

    return {
        "gravac": lambda **kw: AdaptiveState(**kw),
        "static": lambda **kw: AdaptiveState(policy="static", **kw),
        "dqsgd": lambda **kw: AdaptiveState(policy="dqsgd", total_steps=10, lr=0.1, **kw),
        "qsgd": lambda **kw: AdaptiveState(policy="qsgd", **kw),
    }


def _takes(make, name: str) -> bool:
    """Whether the object takes setting `name` at all (a good value builds it)."""
    good = {"enabled": False, "error_feedback": True, "seed": 7, "log_csv": None}[name]
    try:
        make(**{name: good})
        return True
    except (ValueError, TypeError):  # "unknown setting": DDP's ValueError, the Horovod objects' TypeError
        return False


@pytest.mark.parametrize("name,value", _BAD_SETTINGS)
@pytest.mark.parametrize("family", ["torch", "ddp"])
def test_settings_are_not_coerced(family, name, value):
    """`enabled="False"` was read as true, `seed=1.5` truncated, `seed="0"`, `2**70`, `log_csv=123` accepted."""
    objects = _torch_objects() if family == "torch" else _ddp_objects()
    tried = 0
    for make in objects.values():
        if not _takes(make, name):
            continue
        tried += 1
        with pytest.raises(ValueError, match=name):
            make(**{name: value})
    assert tried, f"no {family} object takes {name}"


def test_good_settings_still_build():
    import numpy as np

    from crossover import StaticCompression
    from crossover.ddp import AdaptiveState

    assert StaticCompression("randomk", seed=np.int64(5), error_feedback=np.bool_(False)).seed == 5
    assert StaticCompression("topk", seed=-(2 ** 63)).seed == -(2 ** 63)
    assert AdaptiveState(enabled=False, seed=2 ** 63 - 1).driver.seed == 2 ** 63 - 1


# ------------------------------------------------------------------------------------------------
# weak item: a loaded fp16 (or 2-D, or float64) residual is converted, not replaced by zeros
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_loaded_residual_of_another_dtype_is_converted(dtype):
    from crossover import StaticCompression

    comp = StaticCompression("topk", cf=4)
    saved = torch.linspace(-1, 1, 12).reshape(3, 4).to(dtype)
    state = comp.state_dict()
    comp.load_state_dict({**state, "residuals": {"w": saved}})
    got = comp.codec.memory.residual("w", torch.zeros(12))  # what the next compress of "w" starts from
    assert got.dtype == torch.float32 and got.shape == (12,)
    assert torch.equal(got, saved.reshape(-1).float())


def test_residual_of_a_resized_tensor_is_dropped_with_a_warning(warnings_of):
    from crossover.compression.memory import ErrorFeedback

    said = warnings_of("crossover.compression.memory")
    mem = ErrorFeedback()
    mem.load({"w": torch.ones(5)})
    assert bool((mem.residual("w", torch.zeros(6)) == 0).all()) and len(said) == 1 and "dropped" in said[0]


# ------------------------------------------------------------------------------------------------
# weak item: the seed fingerprint that rides in random-k's statistics
# ------------------------------------------------------------------------------------------------
def _reduce32(v: torch.Tensor, pre: float, post: float) -> float:
    """A float32 reduction: each value times `pre`, sequential partial sums (the worst order for rounding),
    the sum times `post`."""
    acc = torch.zeros((), dtype=torch.float32)
    for x in v:
        acc = acc + x * torch.tensor(pre, dtype=torch.float32)
    return float(acc * torch.tensor(post, dtype=torch.float32))


@pytest.mark.parametrize("world", [2, 3, 8, 64, 250])
def test_seed_fingerprint_survives_float32_reductions(world):
    """Equal seeds never look different, one differing seed always does, after the float32 reductions the
    hosts apply (Horovod: sum, then x 1/world; DDP: x 1/world, then sum), on every rank alike."""
    from crossover.compression.wire import SEED_CHECK_SPAN, seed_fingerprint, seeds_disagree

    span = SEED_CHECK_SPAN // world
    for seeds in ([span - 1] * world, [0] * world, [5] * world, list(range(world)),
                  [0] * (world - 1) + [1], [span - 1] * (world - 1) + [span - 2]):
        f = torch.tensor([seed_fingerprint(s, world) for s in seeds], dtype=torch.float32)
        one = torch.ones(world, dtype=torch.float32)
        for pre, post in ((1.0, 1.0 / world), (1.0 / world, 1.0)):
            scale = _reduce32(one, pre, post)
            sum_f, sum_f2 = _reduce32(f, pre, post) * world / scale, _reduce32(f * f, pre, post) * world / scale
            assert seeds_disagree(sum_f, sum_f2, world) == (len(set(seeds)) > 1), (seeds, pre, post)


# ------------------------------------------------------------------------------------------------
# issue 44: settings are checked at construction whatever the import order
# ------------------------------------------------------------------------------------------------
_CONSTRUCT = """
import json, sys, time
{first}
from crossover import AdaptiveCompression, DqsgdCompression, FP16Compression, QSGDCompression, StaticCompression
out = []
for expr in json.loads(sys.argv[1]):
    try:
        obj = eval(expr)
    except Exception as exc:
        out.append([type(exc).__name__, str(exc)])
    else:
        out.append(["built", type(obj).__module__])
print(json.dumps({{"results": out, "frameworks": sorted({{"torch", "tensorflow", "horovod"}} & set(sys.modules))}}))
"""

# (expression, the exception's type, a piece of its message)
_BAD_CONSTRUCTIONS = [
    ('AdaptiveCompression(policy="foo")', "ValueError", "policy must be one of gravac, dqsgd"),
    ("AdaptiveCompression(cf_min=0)", "ValueError", "cf_min"),
    ("AdaptiveCompression(momentum=1.5)", "ValueError", "momentum must be None"),
    ("AdaptiveCompression(cf_max=5, cf_min=10)", "ValueError", "cf_min must be <= cf_max"),
    ("AdaptiveCompression(window=0)", "ValueError", "window"),
    ("AdaptiveCompression(bogus=1)", "ValueError", "unknown GraVAC setting(s) bogus"),
    ('AdaptiveCompression("topk", seed=1.5)', "ValueError", "seed"),
    ('AdaptiveCompression(enabled="False")', "ValueError", "enabled"),
    ("AdaptiveCompression(error_feedback=1)", "ValueError", "error_feedback"),
    ("AdaptiveCompression(min_compress_numel=0)", "ValueError", "min_compress_numel"),
    ('AdaptiveCompression(log_csv="{foo}.csv")', "ValueError", "log_csv"),
    ("AdaptiveCompression(clock=5)", "ValueError", "clock"),
    ('AdaptiveCompression(policy="dqsgd")', "ValueError", "total_steps"),
    ('AdaptiveCompression(policy="dqsgd", total_steps=0)', "ValueError", "total_steps"),
    ('AdaptiveCompression(policy="dqsgd", total_steps=10, target_bits=9)', "ValueError", "target_bits"),
    ('AdaptiveCompression(policy="dqsgd", total_steps=10, bogus=1)', "ValueError", "bogus"),
    ('AdaptiveCompression("topk", policy="dqsgd", total_steps=10)', "ValueError", "takes no compressor name"),
    ("StaticCompression(cf=0.5)", "ValueError", "cf"),
    ('StaticCompression("topk", transport="nope")', "ValueError", "transport"),
    ("QSGDCompression(99)", "ValueError", "bits"),
    ("QSGDCompression(4, seed=None)", "ValueError", "seed"),
    ("DqsgdCompression(total_steps=10, decay=2)", "ValueError", "decay"),
    ("DqsgdCompression(total_steps=10, lr=-1)", "ValueError", "lr"),
    ("FP16Compression(1)", "TypeError", "FP16Compression"),
]
_GOOD_CONSTRUCTIONS = ["AdaptiveCompression()", 'AdaptiveCompression("randomk", cf_min=5, momentum=1.0, seed=3)',
                       'AdaptiveCompression(transport="scatter", clock=time.perf_counter)',
                       'AdaptiveCompression(policy="dqsgd", total_steps=10, lr=0.1)',
                       'StaticCompression("topk", cf=10)', "QSGDCompression(4)", "DqsgdCompression(total_steps=10)",
                       "FP16Compression()"]


def _construct(first: str, exprs: list[str]) -> dict:
    """Evaluate `exprs` in a fresh interpreter that runs `first`, then imports crossover's names."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _CONSTRUCT.format(first=first), json.dumps(exprs)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_settings_are_checked_at_construction_when_crossover_is_imported_first():
    """With crossover imported before any framework, the objects are horovod_ext/_dispatch.py's lazy ones: a bad
    setting was accepted and failed at the first step. Now the same error comes at construction, as with horovod.torch
    imported first, and nothing imports a framework."""
    exprs = [e for e, _, _ in _BAD_CONSTRUCTIONS] + _GOOD_CONSTRUCTIONS
    lazy = _construct("", exprs)
    assert lazy["frameworks"] == []
    eager = _construct("import horovod.torch", exprs)
    for (expr, kind, piece), got, torch_got in zip(_BAD_CONSTRUCTIONS, lazy["results"], eager["results"]):
        assert got[0] == kind and piece in got[1], (expr, got)
        assert torch_got[0] == kind, (expr, torch_got)  # the framework's own object refuses it alike
    for expr, got, torch_got in zip(_GOOD_CONSTRUCTIONS, lazy["results"][len(_BAD_CONSTRUCTIONS):],
                                    eager["results"][len(_BAD_CONSTRUCTIONS):]):
        assert got == ["built", "horovod_ext._dispatch"], (expr, got)
        assert torch_got[0] == "built", (expr, torch_got)


def test_finite_probe_is_true_exactly_when_every_value_is_finite() -> None:
    from crossover.driver.session import finite_probe

    top = torch.finfo(torch.float32).max  # a sum of these would overflow; min and max do not
    assert bool(finite_probe(torch.full((1000,), top))) and bool(finite_probe(torch.full((9,), -top)))
    assert bool(finite_probe(torch.empty(0)))
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for bad in (float("inf"), -float("inf"), float("nan")):
            t = torch.randn(4097).to(dtype)
            t[1234] = bad
            assert not bool(finite_probe(t)), (dtype, bad)
        assert bool(finite_probe(torch.randn(4097).to(dtype)))
