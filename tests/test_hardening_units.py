"""Issue 27, compression side, in this process: hostile or careless values given to the compression
objects' settings, CSV log and saved states (the multi-rank halves are in tests/test_hardening_hvd.py
and tests/test_ddp_hook.py)."""

from __future__ import annotations

import copy
import errno
import logging
import os

import pytest

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
        drv.add_reduced([1.0, 0.1, 4.0, 2.0, 4.0, 2.0, 1.0, 1.0], 1)
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
    """ENOSPC in the middle of a run (the real full disk is in tests/test_hardening_hvd.py): the driver
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
        drv.add_reduced([1.0, 0.1, 4.0, 2.0, 4.0, 2.0, 1.0, 1.0], 1)
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
