"""TensorBoard output (`tensorboard=`) and flat `stats()`: real 2-rank Horovod and DDP jobs whose event files are
read back with tensorboard's own reader, and the refusals, failures and per-step bookkeeping in one process."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_harness import run_ddp
from hvd_harness import run_function

from crossover.adaptive.gravac import GravacPolicy, Plan
from crossover.adaptive.static import StaticPolicy
from crossover.driver import QuantStepDriver, SparseStepDriver
from crossover.driver import tboard as tbmod

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

STEPS = 24
OTHER_UID = 65534  # nobody: the "other user" of the symlink and ownership checks


def _read(path: str | Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _steps(acc: EventAccumulator, tag: str) -> list[int]:
    return [e.step for e in acc.Scalars(tag)]


def _event_files(path: str | Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if "tfevents" in n)


# ---------------------------------------------------------------------------------------------
# jobs (run inside the ranks)
# ---------------------------------------------------------------------------------------------
def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))


def hvd_tensorboard_job(root: str, steps: int) -> dict[str, Any]:
    """GraVAC logging to a directory (both ranks pass it), DQ-SGD to each rank's own SummaryWriter, and the
    documented flat stats() loop into that writer."""
    import horovod.torch as hvd
    from torch.utils.tensorboard import SummaryWriter

    from crossover import AdaptiveCompression

    gravac = AdaptiveCompression("topk", window=4, cf_min=4, cf_max=64, tensorboard=os.path.join(root, "dir"))
    writer = SummaryWriter(os.path.join(root, "user", f"rank{hvd.rank()}"))
    dqsgd = AdaptiveCompression(policy="dqsgd", total_steps=steps, min_compress_numel=1024, tensorboard=writer)
    a, b = _mlp(0), _mlp(1)
    opt_a = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.01), named_parameters=a.named_parameters(),
                                     compression=gravac)
    opt_b = hvd.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.01), named_parameters=b.named_parameters(),
                                     compression=dqsgd)
    types = set()
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(1000 * step + hvd.rank())
        x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        for comp, prefix in ((gravac, "gravac/"), (dqsgd, "dqsgd/")):
            for k, v in comp.stats().items():  # the loop docs/compression.md shows
                types.add(type(v).__name__)
                if isinstance(v, (int, float)):
                    writer.add_scalar(prefix + k, v, step)
    dqsgd.close_tensorboard()  # before closing our own writer: its last step goes in
    writer.close()
    return {"pid": os.getpid(), "types": sorted(types), "gravac_keys": sorted(gravac.stats()),
            "gravac_debug_keys": sorted(gravac.stats(debug=True))}


def ddp_tensorboard_job(root: str, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from crossover.ddp import AdaptiveState, adaptive_hook

    ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
    state = AdaptiveState(window=4, cf_min=4, cf_max=64, min_compress_numel=1024, tensorboard=os.path.join(root, "d"))
    ddp.register_comm_hook(state, adaptive_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(torch.randn(32, 64, generator=gen)), torch.randn(32, 64, generator=gen)
                                     ).backward()
        opt.step()
    state.close_tensorboard()  # the harness ends the ranks with os._exit (no atexit): close ourselves
    stats = state.stats()
    return {"pid": os.getpid(), "numeric": all(isinstance(v, (int, float, str)) or v is None for v in stats.values()),
            "policy_keys": any(k.startswith("policy/") for k in state.stats(debug=True))
            and not any(k.startswith("policy/") for k in stats)}


# ---------------------------------------------------------------------------------------------
# real jobs
# ---------------------------------------------------------------------------------------------
def test_horovod_job_writes_rank0_scalars_and_uses_the_callers_writer(tmp_path: Path) -> None:
    res = run_function(hvd_tensorboard_job, args=[str(tmp_path), STEPS], timeout=300)
    every = list(range(1, STEPS + 1))
    # directory form: one event file, rank 0's (its pid in the name); rank 1 wrote nothing
    files = _event_files(tmp_path / "dir")
    assert len(files) == 1 and f".{res[0]['pid']}." in files[0], files
    acc = _read(tmp_path / "dir")
    scalars = acc.Tags()["scalars"]
    assert all(t.startswith("crossover/") for t in scalars), scalars
    assert _steps(acc, "crossover/compression_factor") == every  # one value per step, the last one at exit
    assert _steps(acc, "crossover/bytes_sent_over_dense") == every
    assert _steps(acc, "crossover/step_time_s") == every[:-1]  # the last step has no successor to time it
    # a measured dense step (the policy times dense too, on a busy machine it may settle there) also sends each
    # tensor's few statistics: a little over 1
    assert all(0 < e.value <= 1.01 for e in acc.Scalars("crossover/bytes_sent_over_dense"))
    assert all(e.value >= 1.0 for e in acc.Scalars("crossover/compression_factor"))
    assert [(e.step, e.value) for e in acc.Scalars("crossover/searches")][0] == (1, 1.0)
    assert "crossover/gain" in scalars
    assert "crossover/decisions" in acc.Tags()["tensors"]
    # writer form: the caller's SummaryWriter on each rank gets crossover/ scalars and the flat stats() loop
    for r in range(2):
        user = _read(tmp_path / "user" / f"rank{r}")
        assert _steps(user, "crossover/bits") == every
        assert _steps(user, "crossover/bytes_sent_over_dense") == every
        assert _steps(user, "gravac/bytes_sent") == every and _steps(user, "dqsgd/bits") == every
        assert _steps(user, "gravac/settled") == every and _steps(user, "gravac/max_cf") == every
        assert not any("policy/" in t for t in user.Tags()["scalars"])  # stats() shows no internals
    for r in res:
        assert set(r["types"]) <= {"int", "float", "bool", "str", "NoneType"}, r["types"]
        assert {"step", "compression_factor", "gain", "bytes_sent", "bytes_dense", "nonfinite_steps",
                "compressor", "transport", "settled", "settled_reason", "max_cf", "momentum"} == set(r["gravac_keys"])
        assert {"policy/settled", "policy/searches"} <= set(r["gravac_debug_keys"])


def test_ddp_job_writes_rank0_scalars(tmp_path: Path) -> None:
    res = run_ddp(ddp_tensorboard_job, args=[str(tmp_path), STEPS], timeout=240)
    files = _event_files(tmp_path / "d")
    assert len(files) == 1 and f".{res[0]['pid']}." in files[0], files
    acc = _read(tmp_path / "d")
    every = list(range(1, STEPS + 1))
    assert _steps(acc, "crossover/compression_factor") == every
    assert _steps(acc, "crossover/bytes_sent_over_dense") == every
    assert _steps(acc, "crossover/step_time_s") == every[:-1]
    assert all(r["numeric"] and r["policy_keys"] for r in res)


# ---------------------------------------------------------------------------------------------
# one process: refusals, failures, bookkeeping
# ---------------------------------------------------------------------------------------------
class _Recorder:
    """A writer with add_scalar/add_text/flush that remembers calls (or raises, for the failure test)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.texts: list[tuple[str, str, int]] = []
        self.flushes = 0
        self.closed = False
        self.fail = fail

    def add_scalar(self, tag: str, value: float, step: int, walltime: float | None = None) -> None:
        if self.fail is not None:
            raise self.fail
        self.scalars.append((tag, value, step))

    def add_text(self, tag: str, text: str, step: int, walltime: float | None = None) -> None:
        self.texts.append((tag, text, step))

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def _drive(driver: SparseStepDriver, steps: int, sent: int = 100, dense: int = 400) -> None:
    for i in range(steps):
        driver.begin_step(0.01 * i)
        driver.count(sent, dense)


class _Tf:
    def as_default(self) -> None: ...


@pytest.mark.parametrize("bad, says", [
    (123, "must be a directory"), (True, "must be a directory"), ("", "must be a directory"),
    (object(), "must be a directory"), (_Tf(), "tf.summary writer is not supported"),
    (_Recorder, "pass an instance"),
])
def test_bad_values_are_refused_at_construction(bad: Any, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SparseStepDriver(StaticPolicy(cf=10), compressor="topk", seed=0, tensorboard=bad)
    with pytest.raises(ValueError, match=says):
        QuantStepDriver(bits=4, tensorboard=bad)


def test_bad_paths_are_refused_at_construction(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        SparseStepDriver(StaticPolicy(cf=10), compressor="topk", seed=0, tensorboard=str(afile))
    if os.geteuid() != 0:
        pytest.skip("the other-user checks need root to give a file to another uid")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(ValueError, match="belongs to uid"):
        SparseStepDriver(StaticPolicy(cf=10), compressor="topk", seed=0, tensorboard=theirs)
    mine = tmp_path / "mine"
    mine.mkdir()
    link = tmp_path / "planted"
    link.symlink_to(mine)
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(ValueError, match="symbolic link owned by uid"):
        SparseStepDriver(StaticPolicy(cf=10), compressor="topk", seed=0, tensorboard=link)


def test_facades_refuse_bad_values() -> None:
    pytest.importorskip("horovod.torch")
    from crossover import AdaptiveCompression, StaticCompression
    from crossover.ddp import AdaptiveState

    for make in (lambda: AdaptiveCompression(tensorboard=42), lambda: StaticCompression(tensorboard=42),
                 lambda: AdaptiveCompression(policy="dqsgd", total_steps=10, tensorboard=42),
                 lambda: AdaptiveState(tensorboard=42)):
        with pytest.raises(ValueError, match="tensorboard= must be"):
            make()
    with pytest.raises(ValueError, match="policy='fp16' has none"):
        AdaptiveState(policy="fp16", tensorboard=_Recorder())


def test_symlink_planted_after_construction_is_never_written_through(tmp_path: Path, caplog) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the link to another uid")
    target = tmp_path / "victim"
    target.mkdir()
    path = tmp_path / "tb"
    drv = SparseStepDriver(StaticPolicy(cf=10), compressor="topk", seed=0, tensorboard=path)
    path.symlink_to(target)  # another user plants a link where the directory is to be created
    os.lchown(path, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING, logger="crossover.driver"):
        _drive(drv, 5)
        drv.close_tensorboard()
    assert os.listdir(target) == []
    assert [r for r in caplog.records if "TensorBoard" in r.getMessage() and "symbolic link" in r.getMessage()]


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    drv = SparseStepDriver(StaticPolicy(cf=10), compressor="topk", seed=0, tensorboard=tmp_path / "tb",
                           rank=lambda: 1)
    _drive(drv, 5)
    drv.close_tensorboard()
    assert not (tmp_path / "tb").exists()


def test_io_error_warns_once_and_training_goes_on(tmp_path: Path, caplog, monkeypatch) -> None:
    drv = SparseStepDriver(StaticPolicy(cf=10), compressor="topk", seed=0,
                           tensorboard=_Recorder(fail=OSError(28, "No space left on device")))
    with caplog.at_level(logging.WARNING, logger="crossover.driver"):
        _drive(drv, 5)
        drv.tensorboard._sink.drain()  # what the timer does
        _drive(drv, 5)
        drv.tensorboard._sink.drain()
        drv.close_tensorboard()
    said = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(said) == 1 and "No space left" in said[0].getMessage() and "training goes on" in said[0].getMessage()
    assert drv.step == 10
    # a directory on a full disk: /dev/full answers every write with ENOSPC
    caplog.clear()

    def full_disk(self: Any) -> None:
        self._fh = open("/dev/full", "wb")  # noqa: SIM115 - closed by the sink
        self._records = self._protos[4](self._fh)

    monkeypatch.setattr(tbmod._EventFile, "open", full_disk)
    drv = SparseStepDriver(StaticPolicy(cf=10), compressor="topk", seed=0, tensorboard=tmp_path / "full")
    with caplog.at_level(logging.WARNING, logger="crossover.driver"):
        _drive(drv, 5)
        drv.tensorboard._sink.drain()
        _drive(drv, 5)
        drv.close_tensorboard()
    said = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(said) == 1 and "No space left" in said[0].getMessage(), [r.getMessage() for r in said]


def test_callers_writer_is_flushed_never_closed_and_gets_every_step() -> None:
    rec = _Recorder()
    drv = SparseStepDriver(StaticPolicy(cf=10), compressor="topk", seed=0, tensorboard=rec, rank=lambda: 1)
    _drive(drv, 6)
    drv.close_tensorboard()
    assert not rec.closed and rec.flushes >= 1
    cf = [(s, v) for t, v, s in rec.scalars if t == "crossover/compression_factor"]
    assert cf == [(s, 10.0) for s in range(1, 7)]  # any rank: the caller chose where the writer lives
    ratio = [v for t, v, s in rec.scalars if t == "crossover/bytes_sent_over_dense"]
    assert ratio == [0.25] * 6
    _drive(drv, 2)  # after close: nothing more
    drv.close_tensorboard()
    assert len([1 for t, _, _ in rec.scalars if t == "crossover/compression_factor"]) == 6


class _Scripted:
    """A CF policy whose searches and settles follow a script: {observations: (searches, settled, cf)}."""

    def __init__(self, script: dict[int, tuple[int, bool, float]]) -> None:
        self.script, self.n = script, 0
        self.searches, self.settled, self.cf = 1, False, 8.0

    def plan(self) -> Plan:
        return Plan(send_cf=self.cf, probe_cfs=(self.cf,), measure=True)

    def observe(self, stats: Any) -> None:
        self.n += 1
        if self.n in self.script:
            self.searches, self.settled, self.cf = self.script[self.n]

    @property
    def gains(self) -> dict[float, float]:
        return {8.0: 0.9, 16.0: 0.8}

    def summary(self) -> dict[str, Any]:
        return {"send_cf": self.cf, "settled": self.settled, "gains": self.gains}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None: ...


def test_searches_and_settles_are_logged_as_they_happen() -> None:
    from crossover.compression.wire import SparseStatsLayout

    rec = _Recorder()
    drv = SparseStepDriver(_Scripted({3: (1, True, 16.0), 6: (2, False, 8.0), 8: (2, True, 8.0)}),
                           compressor="topk", seed=0, tensorboard=rec)
    layout = SparseStatsLayout(1)
    for i in range(14):
        drv.begin_step(0.01 * i)
        drv.count(100, 400)
        drv.add_sums([1.0, 0.01, 4.0, 2.0, 4.0, 2.0, 0.0, 1.0, 1.0], 1, layout)  # ..., momentum, probe
    drv.close_tensorboard()
    events = [(s, t, v) for t, v, s in rec.scalars if t in ("crossover/searches", "crossover/settled_cf")]
    # observations lag two steps: the policy's n-th observation happens as step n + 2 begins
    assert events == [(1, "crossover/searches", 1), (5, "crossover/settled_cf", 16.0),
                      (8, "crossover/searches", 2), (10, "crossover/settled_cf", 8.0)]
    assert [t for _, t, _ in rec.texts] == [
        "step 1: search 1 begins, sending CF 8", "step 5: settled on CF 16", "step 8: search 2 begins, sending CF 8",
        "step 10: settled on CF 8"]
    gains = [(s, v) for t, v, s in rec.scalars if t == "crossover/gain"]
    assert gains[:4] == [(1, 0.9), (2, 0.9), (3, 0.9), (4, 0.9)] and (5, 0.8) in gains


def test_quant_driver_logs_bits_and_step_time() -> None:
    rec = _Recorder()
    drv = QuantStepDriver(bits=4, tensorboard=rec)
    for _ in range(5):
        drv.begin_step(2)
        drv.count(50, 400)
    drv.close_tensorboard()
    by = {}
    for tag, v, s in rec.scalars:
        by.setdefault(tag, []).append((s, v))
    assert by["crossover/bits"] == [(s, 4) for s in range(1, 6)]
    assert by["crossover/bytes_sent_over_dense"] == [(s, 0.125) for s in range(1, 6)]
    assert [s for s, _ in by["crossover/step_time_s"]] == [1, 2, 3, 4]


def test_flat_stats_loop_feeds_a_summary_writer(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    drv = SparseStepDriver(GravacPolicy(window=4, cf_min=4, cf_max=64), compressor="topk", seed=0)
    q = QuantStepDriver(bits=6, dqsgd={"total_steps": 10, "error_budget": None, "target_bits": 6, "b_min": 2,
                                       "b_max": 8, "decay": 0.999})
    before = sorted(q.stats())
    q.lr = 0.1
    for _ in range(3):
        q.begin_step(2)
        q.add_tensor(1000)
        q.add_sq_sum(4.0)
    assert sorted(q.stats()) == before, "DQ-SGD's keys are the same before and after calibration"
    assert q.stats()["policy/bits"] is not None
    _drive(drv, 5)
    writer = SummaryWriter(str(tmp_path))
    for obj in (drv, q):
        stats = obj.stats()
        assert all(v is None or isinstance(v, (int, float, bool, str)) for v in stats.values()), stats
        for k, v in stats.items():
            if isinstance(v, (int, float)):
                writer.add_scalar(k, v, 1)
    writer.close()
    tags = _read(tmp_path).Tags()["scalars"]
    assert {"step", "bytes_sent", "policy/settled", "policy/searches", "policy/send_cf", "policy/bits"} <= set(tags)
    assert drv.stats()["policy/settled"] is False and isinstance(drv.stats()["policy/search"], str)


def test_flatten_names_nested_values() -> None:
    from crossover.driver.flat import flat_stats

    out = flat_stats({"step": 3}, policy={"gains": {10.0: 0.5, 12.5: 0.25}, "list": [1, 2], "none": None,
                                          "nan": math.nan, "sub": {"a": {"b": True}}}, absent=None)
    assert out == {"step": 3, "policy/gains/10": 0.5, "policy/gains/12.5": 0.25, "policy/list/0": 1,
                   "policy/list/1": 2, "policy/none": None, "policy/nan": out["policy/nan"], "policy/sub/a/b": True}
    assert math.isnan(out["policy/nan"])


def test_user_stats_show_what_a_user_reads_and_debug_shows_everything() -> None:
    from crossover.driver.flat import USER_KEYS, user_stats

    drv = SparseStepDriver(GravacPolicy(cf_min=4, cf_max=64, window=2), compressor="topk", seed=0)
    _drive(drv, 3)
    full = drv.stats()
    assert "policy/momentum" in full and "policy/max_cf" in full
    full["policy/momentum"] = float(torch.tensor(0.9))  # as an optimizer's float32 momentum reads
    shown = user_stats(full)
    assert not any("/" in k for k in shown) and "saturated_steps" not in shown
    assert set(shown) == {k for k in USER_KEYS if k in full} | {"settled", "settled_reason", "max_cf", "momentum"}
    assert shown["momentum"] == 0.9 and full["policy/momentum"] != 0.9  # float32's 0.9 shown as 0.9
    assert shown["settled"] is full["policy/settled"] and shown["max_cf"] == full["policy/max_cf"]
    assert user_stats(full, debug=True) is full
