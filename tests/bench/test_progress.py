"""benchmarks/progress.py: what crossover-bench and `make demo` show while trainings run.

Plain lines when not on a terminal (start, every interval, end); on a terminal a tqdm bar whose clock
starts at the first step, not at launch, and stops at the last step, not when the job exits.
"""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

from benchmarks.progress import ProgressDisplay, Reading, format_line, read_progress, write_progress


def _write(path: Path, step: int, total: int, t_first: float, t_last: float, loss: float = 1.0) -> None:
    write_progress(path, Reading(step, total, loss, t_first, t_last))


def test_progress_file_round_trip_and_nothing_before_the_first_step(tmp_path: Path) -> None:
    path = tmp_path / "progress"
    assert read_progress(path) is None
    path.write_text("3 10 0.5")  # not the trainer's format
    assert read_progress(path) is None
    _write(path, 4, 10, 100.0, 102.0, 0.25)
    r = read_progress(path)
    assert r == Reading(4, 10, 0.25, 100.0, 102.0) and r.elapsed == 2.0 and not r.done
    assert not list(tmp_path.glob("*.tmp"))


def test_plain_lines_at_start_every_interval_and_at_the_end(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    out = io.StringIO()
    shown = ProgressDisplay({"dense": a, "gravac": b}, stream=out, terminal=None, interval=10.0)
    assert not shown.terminal  # a StringIO is not a terminal
    shown.poll(now=0.0)
    assert out.getvalue() == ""  # no line before a training's first step (start-up is not training)
    t0 = 1000.0
    _write(a, 1, 100, t0, t0 + 0.5)
    shown.poll(now=1.0)
    _write(a, 5, 100, t0, t0 + 2.5)
    shown.poll(now=5.0)  # within the interval: no line
    _write(a, 20, 100, t0, t0 + 10.0)
    _write(b, 1, 50, t0, t0 + 1.0)
    shown.poll(now=11.0)
    _write(a, 100, 100, t0, t0 + 50.0, loss=0.125)
    shown.poll(now=12.0)  # the end is said at once
    shown.poll(now=40.0)
    shown.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "dense: step 1/100 (1%), 0.5 s training, 2.00 steps/s, loss 1.000",
        "dense: step 20/100 (20%), 10.0 s training, 2.00 steps/s, loss 1.000",
        "gravac: step 1/50 (2%), 1.0 s training, 1.00 steps/s, loss 1.000",
        "dense: done, 100/100 steps in 50.0 s (2.00 steps/s), loss 0.125",
        "gravac: stopped at step 1/50",
    ]


def test_periodic_lines_come_from_the_background_thread(tmp_path: Path) -> None:
    path = tmp_path / "progress"
    out = io.StringIO()
    t0 = time.time()
    with ProgressDisplay({"job": path}, stream=out, interval=0.0):
        for step in range(1, 4):
            _write(path, step, 3, t0, t0 + step)
            time.sleep(1.2)  # > POLL_S: each step is seen
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("job: step 1/3") and lines[-1].startswith("job: done, 3/3 steps in 3.0 s")
    assert any(line.startswith("job: step 2/3") for line in lines)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _elapsed_shown(text: str) -> list[str]:
    return re.findall(r"\[(\d\d:\d\d)<", text)


def test_bar_clock_starts_at_the_first_step_and_stops_at_the_last(tmp_path: Path) -> None:
    path = tmp_path / "progress"
    out = _Terminal()
    shown = ProgressDisplay({"job": path}, stream=out)
    assert shown.terminal
    now = time.time()
    # the first step began 2 s ago: the bar reads 2 s, whatever time went before (launch, data loading)
    _write(path, 1, 10, now - 2.0, now - 1.5)
    shown.poll()
    assert _elapsed_shown(out.getvalue())[-1] == "00:02"
    bar = shown._bars["job"].bar
    assert 1.9 < bar.format_dict["elapsed"] < 3.0
    # the last step ended 30 s ago, 5 s after the first began: the closed bar reads 5 s, not 35 s
    _write(path, 10, 10, now - 35.0, now - 30.0)
    shown.poll()
    final = out.getvalue().rsplit("\r", 1)[-1]
    assert "10/10" in final and _elapsed_shown(final) == ["00:05"], final
    assert shown._bars["job"].closed
    shown.close()


def test_format_line_long_runs() -> None:
    assert format_line("x", Reading(5, 10, 2.0, 0.0, 3725.0)) == \
        "x: step 5/10 (50%), 1:02:05 training, 0.00 steps/s, loss 2.000"
    assert format_line("x", Reading(10, 10, 2.0, 0.0, 125.0)).startswith("x: done, 10/10 steps in 2:05 (0.08 steps/s)")
