"""crossover-run end to end, with real `horovodrun -np 2 -H localhost:2 --gloo` jobs.

Two 2-rank jobs under the scheduler train to exactly the weights they reach alone, and their compute
turns on the shared device ("cpu") never overlap; a job killed with SIGKILL mid-run lets the other one
finish; a daemon killed mid-run is replaced and both jobs finish; Ctrl-C stops everything; bad command
lines are usage errors (exit 2); the bare form `crossover-run first.py second.py` runs two jobs named
after their scripts, with progress lines, a turns plot and TensorBoard scalars read back with
TensorBoard's reader; on a terminal the progress is one redrawn line. With a stand-in horovodrun (no
Horovod start-up, a second or so each): bad job names and bad output paths are refused before any job
starts, a report output that fails at the end costs only itself, one rank per job is said to leave nothing
to overlap, and a job that never took a turn is named in the summary (also with real jobs, one without
Horovod). Each Horovod launch takes 10-40 s here (startup dominates), about 1.5-3 minutes in all on an
idle 2-core machine (84 s measured before the stand-in tests; 193 s with them on a busy one, load 5-7).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest
from sched_harness import TELEMETRY_OF_THREE_STEPS, stand_in_horovodrun

from crossover.scheduler import telemetry

REPO = Path(__file__).resolve().parents[2]
RUN = [sys.executable, "-m", "crossover.scheduler.run"]
HVD = ["-np", "2", "-H", "localhost:2", "--gloo"]

JOB = textwrap.dedent("""
    import argparse, hashlib, json, os, time
    from pathlib import Path

    import torch
    import horovod.torch as hvd

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--out", required=True)
    p.add_argument("--gate", help="wait until this folder holds N files (N = ranks of all jobs) to start together")
    p.add_argument("--gate-n", type=int, default=4)
    a = p.parse_args()
    hvd.init()
    if a.gate:  # before the optimizer exists, so no device is held while waiting
        Path(a.gate).mkdir(parents=True, exist_ok=True)
        (Path(a.gate) / f"{os.getpid()}").write_text("")
        while len(list(Path(a.gate).iterdir())) < a.gate_n:
            time.sleep(0.01)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    r = hvd.rank()
    (out / f"pid.rank{r}").write_text(str(os.getpid()))
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    g = torch.Generator().manual_seed(100 + r)
    x, y = torch.randn(256, 256, generator=g), torch.randint(0, 10, (256,), generator=g)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(a.steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if a.sleep:
            time.sleep(a.sleep)  # more "compute" while holding the device
        opt.step()
        if a.gate and step == 0:  # and after the first step, device given back: no job starts ahead
            from horovod_ext.scheduling import communicating

            after = Path(a.gate + "-step1")
            with communicating():
                after.mkdir(parents=True, exist_ok=True)
                (after / f"{os.getpid()}").write_text("")
                while len(list(after.iterdir())) < a.gate_n:
                    time.sleep(0.01)
        (out / f"progress.rank{r}").write_text(str(step + 1))
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.numpy().tobytes())
    (out / f"result.rank{r}.json").write_text(json.dumps({"sha": h.hexdigest(), "loss": loss.item()}))
    print(f"rank {r}: {a.steps} steps, loss {loss.item():.4f}")
""")


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="xo-run-", dir="/tmp"))
    (d / "job.py").write_text(JOB)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sched(work: Path) -> Iterator[Path]:
    """A fresh scheduler directory (short path) whose daemons are killed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="xo-s-", dir="/tmp"))
    try:
        yield d
    finally:
        pid = _daemon_pid(d)
        if pid:
            _kill(pid)
        shutil.rmtree(d, ignore_errors=True)


def _env(sched_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    env["CROSSOVER_SCHED_IDLE_EXIT"] = "20"
    if sched_dir is not None:
        env["CROSSOVER_SCHED_TRACE"] = str(sched_dir / "trace.jsonl")
    return env


def _daemon_pid(d: Path) -> int | None:
    try:
        text = (d / "daemon.lock").read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _progress(out: Path) -> int:
    try:
        return min(int((out / f"progress.rank{r}").read_text() or 0) for r in range(2))
    except (FileNotFoundError, ValueError):
        return 0


def _result(out: Path) -> str:
    shas = {json.loads((out / f"result.rank{r}.json").read_text())["sha"] for r in range(2)}
    assert len(shas) == 1, "ranks disagree"
    return shas.pop()


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(RUN + args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(log.parent),
                                start_new_session=True)


def _wait(proc: subprocess.Popen[bytes], log: Path, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
        raise AssertionError(f"crossover-run hung; output:\n{log.read_text()}") from None


def _until(cond, timeout: float, what: str, log: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; output:\n{log.read_text()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def alone_sha(work: Path) -> str:
    """The weights one 2-rank job reaches alone (no scheduler)."""
    out = work / "alone"
    log = work / "alone.log"
    proc = _start(["--no-crossover", *HVD, "job.py", "--out", str(out)], _env(), log)
    assert _wait(proc, log) == 0, log.read_text()
    return _result(out)


# --------------------------------------------------------------------------- command line


@pytest.mark.parametrize("argv", [[], ["-np", "2"], ["-np", "2", "--bogus", "job.py"], ["-np", "2", "nosuch.py"],
                                  ["-np", "2", "job.py", "--", "--", "job.py"]],
                         ids=["nothing", "no-job", "unknown-option", "missing-script", "empty-job"])
def test_bad_command_lines_are_usage_errors(argv: list[str], work: Path) -> None:
    r = subprocess.run(RUN + argv, env=_env(), cwd=str(work), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    assert "usage: crossover-run" in r.stderr and "error:" in r.stderr


STAND_IN = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    Path(f"started.{os.environ['CROSSOVER_JOB']}").write_text("")  # which jobs ran
    if os.environ["CROSSOVER_JOB"] in os.environ.get("STAND_IN_QUIET", "").split(","):
        sys.exit(0)  # a job that never takes a turn: no telemetry
""") + TELEMETRY_OF_THREE_STEPS


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    """A folder with job.py and a stand-in horovodrun (no Horovod start-up: one rank's telemetry, written at
    once) that leaves ``started.<job>`` behind, so a test sees which jobs ran."""
    d = tmp_path / "run"
    d.mkdir()
    stand_in_horovodrun(d, STAND_IN)
    return d


def _run_stand_in(d: Path, *args: str, np: int = 1, quiet: str = "") -> subprocess.CompletedProcess[str]:
    """crossover-run of two jobs job-1 and job-2 with the stand-in horovodrun; the ``quiet`` ones (comma-separated)
    write no telemetry."""
    return subprocess.run(RUN + ["--horovodrun", str(d / "horovodrun"), "-np", str(np), "--no-progress", *args,
                                 "job.py", "job.py"], env={**_env(), "STAND_IN_QUIET": quiet}, cwd=str(d),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("names", ["..,b", ".,b", "-x,b", ".hidden,b", "a/b,c", ",b", "a,a"])
def test_job_names_that_are_not_plain_file_names_are_refused(stand_in: Path, names: str) -> None:
    """Job names become folder names (--tensorboard DIR/<job>) and file names (telemetry): `--names ..,b`
    wrote job '..''s TensorBoard run into DIR's parent. Now such a name is a usage error before any job runs."""
    r = _run_stand_in(stand_in, f"--names={names}", "--tensorboard", str(stand_in / "tb"))
    assert r.returncode == 2, r
    assert "usage: crossover-run" in r.stderr and "--names:" in r.stderr
    assert not list(stand_in.glob("started.*")), "a job ran"
    assert not list(stand_in.rglob("events.out.tfevents.*"))
    if names != "a,a":
        assert f"bad job name {names.split(',')[0]!r}" in r.stderr


def _bad_outputs(d: Path, case: str) -> list[str]:
    """The command-line options of one bad output case, with what it needs made in ``d``."""
    (d / "existing").mkdir()
    (d / "mine.png").write_text("mine\n")
    (d / "elsewhere").mkdir()
    if case == "plot-is-a-folder":
        return ["--plot", str(d / "existing"), "--tensorboard", str(d / "tb")]
    if case == "timeline-is-a-folder":
        return ["--timeline", str(d / "existing"), "--tensorboard", str(d / "tb")]
    if case == "plot-ends-with-a-slash":
        return ["--plot", str(d / "new") + "/"]
    if case == "plot-is-a-link":
        (d / "link.png").symlink_to(d / "mine.png")
        return ["--plot", str(d / "link.png"), "--tensorboard", str(d / "tb")]
    if case == "plot-is-the-timeline":
        return ["--plot", str(d / "out.json"), "--timeline", str(d / "." / "out.json")]
    if case == "tensorboard-run-is-a-link":
        (d / "tb").mkdir()
        (d / "tb" / "job-2").symlink_to(d / "elsewhere")
        return ["--tensorboard", str(d / "tb")]
    if case == "tensorboard-run-is-a-file":
        (d / "tb").mkdir()
        (d / "tb" / "job-1").write_text("")
        return ["--tensorboard", str(d / "tb")]
    assert case == "telemetry-dir-is-a-file"
    return ["--telemetry-dir", str(d / "mine.png"), "--tensorboard", str(d / "tb")]


@pytest.mark.parametrize("case", ["plot-is-a-folder", "timeline-is-a-folder", "plot-ends-with-a-slash",
                                  "plot-is-a-link", "plot-is-the-timeline", "tensorboard-run-is-a-link",
                                  "tensorboard-run-is-a-file", "telemetry-dir-is-a-file"])
def test_every_output_path_is_checked_before_any_job_starts(stand_in: Path, case: str) -> None:
    """`--plot EXISTING_DIR --tensorboard DIR` ran the jobs, failed on the plot at the end and lost the TensorBoard
    scalars (exit 0). Now every path crossover-run writes is checked at start: a usage error (exit 2) naming it,
    no job started, nothing written, a symbolic link never written through."""
    r = _run_stand_in(stand_in, *_bad_outputs(stand_in, case))
    assert r.returncode == 2, r
    assert "usage: crossover-run" in r.stderr and "error:" in r.stderr
    assert not list(stand_in.glob("started.*")), f"a job ran: {r}"
    assert not list(stand_in.rglob("events.out.tfevents.*")) and not (stand_in / "out.json").exists()
    assert (stand_in / "mine.png").read_text() == "mine\n" and list((stand_in / "elsewhere").iterdir()) == []
    said = {"plot-is-a-folder": "is a folder", "timeline-is-a-folder": "is a folder",
            "plot-ends-with-a-slash": "names a folder", "plot-is-a-link": "is a symbolic link",
            "plot-is-the-timeline": "name the same file", "tensorboard-run-is-a-link": "is a symbolic link",
            "tensorboard-run-is-a-file": "is a symbolic link or a file", "telemetry-dir-is-a-file": "not a directory"}
    assert said[case] in r.stderr, r.stderr


def test_an_output_that_fails_at_the_end_does_not_cost_the_others(stand_in: Path) -> None:
    """The --plot file, checked at start, is replaced by a folder while the jobs run: the plot fails with a
    message, and the timeline and the TensorBoard scalars are still written."""
    (stand_in / "turns.png").write_text("")
    swap = stand_in / "horovodrun"
    swap.write_text(swap.read_text() + textwrap.dedent("""
        if os.environ["CROSSOVER_JOB"] == "job-1":
            os.unlink("turns.png")
            os.mkdir("turns.png")
    """))
    r = _run_stand_in(stand_in, "--plot", "turns.png", "--tensorboard", "tb", "--timeline", "t.json")
    assert r.returncode == 0, r
    assert "could not write the turns plot" in r.stdout, r.stdout
    assert (stand_in / "t.json").exists() and f"TensorBoard scalars in {stand_in / 'tb'}" in r.stdout
    assert {p.parent.name for p in (stand_in / "tb").rglob("events.out.tfevents.*")} == {"job-1", "job-2"}


NEVER = "never took a turn (did it call hvd.init() and train with hvd.DistributedOptimizer?)"


def test_a_job_that_never_took_a_turn_is_named_in_the_summary(stand_in: Path) -> None:
    """A job without telemetry (it never called hvd.init(), or trained without hvd.DistributedOptimizer) used to
    vanish from the summary; now it has its row, and summary.json lists it."""
    r = _run_stand_in(stand_in, "--telemetry-dir", str(stand_in / "tel"), quiet="job-2")
    assert r.returncode == 0, r
    assert re.search(r"^job-1 +1 +3 ", r.stdout, re.M) and f"job-2          {NEVER}" in r.stdout, r.stdout
    (run,) = (stand_in / "tel").iterdir()
    assert json.loads((run / "summary.json").read_text())["never_took_a_turn"] == ["job-2"]

    r = _run_stand_in(stand_in, quiet="job-1,job-2")  # no telemetry at all
    assert r.returncode == 0, r
    assert "no job took a turn" in r.stdout and f"job-1 {NEVER}" in r.stdout and f"job-2 {NEVER}" in r.stdout


def test_one_rank_per_job_is_said_to_leave_nothing_to_overlap(stand_in: Path) -> None:
    """`crossover-run job1.py job2.py` on a CPU machine runs one rank per job: no allreduce wait, overlap 0 %,
    and nothing said so. Now a note at start and under the summary; none with several ranks per job."""
    r = _run_stand_in(stand_in)
    assert r.returncode == 0, r
    assert "crossover-run: note: one rank per job: nothing to overlap" in r.stderr and "-np 2" in r.stderr, r.stderr
    assert "(one rank per job: no allreduce wait to hide, hence overlap 0 %; try -np 2)" in r.stdout, r.stdout
    r = _run_stand_in(stand_in, np=2)
    assert r.returncode == 0, r
    assert "one rank per job" not in r.stdout + r.stderr


def test_help_and_dry_run(work: Path) -> None:
    r = subprocess.run(RUN + ["--help"], env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for opt in ("-np", "--hostfile", "--gloo", "--mpi", "--network-interfaces", "--no-crossover", "--dry-run",
                "--fail-fast", "--weights", "--lease", "--timeline"):
        assert opt in r.stdout
    r = subprocess.run(RUN + ["--dry-run", "-np", "2", "-H", "h1:1,h2:1", "job.py", "--lr", "0.1", "--",
                              "job.py", "--epochs", "5"], env=_env(), cwd=str(work), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2
    assert "CROSSOVER_JOB=job-1" in lines[0] and "horovodrun -np 2 -H h1:1,h2:1" in lines[0]
    assert lines[0].endswith("-m horovod_ext.launch job.py --lr 0.1")
    assert lines[1].endswith("-m horovod_ext.launch job.py --epochs 5")


# --------------------------------------------------------------------------- real jobs


def test_two_jobs_take_turns_and_match_running_alone(work: Path, sched: Path, alone_sha: str) -> None:
    tel = work / "tel-ok"
    outs = [work / "ok0", work / "ok1"]
    log = work / "ok.log"
    proc = _start([*HVD, "--sched-dir", str(sched), "--telemetry-dir", str(tel), "--lease", "30",
                   "job.py", "--out", str(outs[0]), "--gate", str(work / "gate-ok"), "--",
                   "job.py", "--out", str(outs[1]), "--gate", str(work / "gate-ok")], _env(sched), log)
    assert _wait(proc, log) == 0, log.read_text()
    assert _result(outs[0]) == alone_sha and _result(outs[1]) == alone_sha
    text = log.read_text()
    (tel,) = [p for p in tel.iterdir() if p.name.startswith("run-")]  # this run's own sub-directory
    assert f"telemetry in {tel}" in text
    assert "[job-1]" in text and "[job-2]" in text and "busy" in text and (tel / "timeline.json").exists()

    # The daemon's log: turns on the device follow one another, never two at once, both jobs served.
    events = [json.loads(x) for x in (sched / "trace.jsonl").read_text().splitlines()]
    open_turn: dict[str, str] = {}
    turns = []
    for e in events:
        if e["ev"] == "start":
            assert e["dev"] not in open_turn, f"turn of {e['job']} started during one of {open_turn[e['dev']]}"
            open_turn[e["dev"]] = e["job"]
            turns.append(e["job"])
        elif e["ev"] == "end":
            assert open_turn.pop(e["dev"]) == e["job"]
        assert e.get("why") != "lease expired"
    assert turns.count("job-1") >= 20 and turns.count("job-2") >= 20
    # They alternate while both have steps to run (the jobs wait for each other after their first step:
    # one CI run, without that, saw 3 switches in 80 turns, one job having started far ahead); a job that
    # finishes first leaves the last turns to the other: count the switches where both had turns to come.
    first = max(turns.index("job-1"), turns.index("job-2"))
    last = min(len(turns) - 1 - turns[::-1].index(j) for j in ("job-1", "job-2"))
    both = turns[first:last + 1]
    switches = sum(a != b for a, b in zip(both, both[1:]))
    assert switches >= 20 and switches >= len(both) // 2, f"turns: {''.join(t[-1] for t in turns)}"

    # The ranks' own clocks: compute spans of the two jobs on the device never intersect.
    streams = telemetry.load(str(tel))
    assert len(streams) == 4 and {s.device_key for s in streams} == {"localhost/cpu"}
    compute = {j: telemetry.merge_intervals(iv for s in streams if s.job == j for iv in s.spans["compute"])
               for j in ("job-1", "job-2")}
    assert sum(len(v) for v in compute.values()) >= 40
    assert telemetry.intersect_length(compute["job-1"], compute["job-2"]) == 0.0
    summary = json.loads((tel / "summary.json").read_text())
    assert summary["devices"]["localhost/cpu"]["compute_collision_s"] == 0.0
    assert summary["jobs"]["job-1"]["steps"] == 40


def test_sigkill_one_job_the_other_finishes(work: Path, sched: Path, alone_sha: str) -> None:
    outs = [work / "k0", work / "k1"]
    log = work / "kill-job.log"
    proc = _start([*HVD, "--sched-dir", str(sched), "--lease", "60",
                   "job.py", "--out", str(outs[0]), "--steps", "400", "--sleep", "0.02", "--",
                   "job.py", "--out", str(outs[1]), "--sleep", "0.02"], _env(sched), log)
    try:
        _until(lambda: _progress(outs[0]) >= 5 and _progress(outs[1]) >= 5, 180, "both jobs running", log)
        before = _progress(outs[1])
        for r in range(2):
            _kill(int((outs[0] / f"pid.rank{r}").read_text()))
        code = _wait(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code != 0  # job0 failed
    assert _progress(outs[1]) > before
    assert _result(outs[1]) == alone_sha and not (outs[0] / "result.rank0.json").exists()
    text = log.read_text()
    assert "job-2 exited with 0" in text and "job-1=0" not in text
    # the killed job's turn ended when its sockets closed, not by the 60 s lease
    events = [json.loads(x) for x in (sched / "trace.jsonl").read_text().splitlines()]
    assert not any(e.get("why") == "lease expired" for e in events)


def test_daemon_killed_mid_run_both_finish_and_a_new_one_takes_over(work: Path, sched: Path,
                                                                    alone_sha: str) -> None:
    outs = [work / "d0", work / "d1"]
    log = work / "kill-daemon.log"
    # 0.2 s of "compute" per step: after the kill, each job has several seconds of steps left, so that a new
    # daemon (started and re-attached to at most every second) is up before either job ends, even on a busy host
    proc = _start([*HVD, "--sched-dir", str(sched), "job.py", "--out", str(outs[0]), "--sleep", "0.2", "--",
                   "job.py", "--out", str(outs[1]), "--sleep", "0.2"], _env(sched), log)
    try:
        _until(lambda: _progress(outs[0]) >= 5 and _progress(outs[1]) >= 5, 180, "both jobs running", log)
        first = _daemon_pid(sched)
        assert first is not None
        _kill(first)
        code = _wait(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text
    assert _result(outs[0]) == alone_sha and _result(outs[1]) == alone_sha
    assert "continuing uncoordinated" in text and "re-attached" in text
    events = [json.loads(x) for x in (sched / "trace.jsonl").read_text().splitlines()]
    later = {e["job"] for e in events if e["ev"] == "start" and e["daemon"] != first}
    assert later == {"job-1", "job-2"}, "the new daemon did not coordinate both jobs"


def test_ctrl_c_stops_every_job(work: Path, sched: Path) -> None:
    outs = [work / "c0", work / "c1"]
    log = work / "ctrl-c.log"
    proc = _start([*HVD, "--sched-dir", str(sched), "--grace", "5", "job.py", "--out", str(outs[0]),
                   "--steps", "100000", "--", "job.py", "--out", str(outs[1]), "--steps", "100000"],
                  _env(sched), log)
    try:
        _until(lambda: _progress(outs[0]) >= 2 and _progress(outs[1]) >= 2, 180, "both jobs running", log)
        pids = [int((o / f"pid.rank{r}").read_text()) for o in outs for r in range(2)]
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"ranks still alive after Ctrl-C: {[p for p in pids if _alive(p)]}"
        time.sleep(0.1)


# --------------------------------------------------------------------------- the bare form, progress, plot, TensorBoard

TINY = textwrap.dedent("""
    import sys, time
    import torch
    import horovod.torch as hvd

    steps = int(sys.argv[1])
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(256, 128), torch.randint(0, 8, (256,))
    for step in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        time.sleep(0.02)  # a little more compute while holding the device
        opt.step()
    print(f"{sys.argv[0]} done after {steps} steps", flush=True)
""")


def test_the_bare_form_runs_each_script_as_a_job(work: Path, sched: Path) -> None:
    """`crossover-run first.py second.py`, exactly the usage line: two jobs named after their scripts, -np
    chosen and said, a progress line per job while they run, then the turns as a PNG and as TensorBoard
    scalars (read back with TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = work / "bare"
    d.mkdir()
    (d / "first.py").write_text(TINY)
    (d / "second.py").write_text(TINY)
    log = d / "bare.log"
    # a bare-form job takes its own arguments up to the next .py argument
    proc = _start(["--sched-dir", str(sched), "--telemetry-dir", str(d / "tel"), "--progress-every", "1",
                   "--plot", str(d / "turns.png"), "--tensorboard", str(d / "tb"), "first.py", "60", "second.py", "40"],
                  _env(sched), log)
    assert _wait(proc, log) == 0, log.read_text()
    text = log.read_text()
    assert "-np not given: 1 rank per job (no CUDA device found)" in text
    assert "2 jobs (first, second), 1 rank(s) each" in text
    assert "[first]" in text and "[second]" in text
    assert "first.py done after 60 steps" in text and "second.py done after 40 steps" in text
    progress = [x for x in text.splitlines() if x.startswith("crossover-run: progress at")]
    assert any("first: step" in x and "turns" in x and "steps/s" in x for x in progress), progress
    assert "first=0, second=0" in text

    (run,) = (d / "tel").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert {j: v["steps"] for j, v in summary["jobs"].items()} == {"first": 60, "second": 40}
    starts = [json.loads(x) for x in (sched / "trace.jsonl").read_text().splitlines()]
    assert {e["job"] for e in starts if e["ev"] == "start"} == {"first", "second"}

    assert (d / "turns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for job, steps in (("first", 60), ("second", 40)):
        acc = EventAccumulator(str(d / "tb" / job))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        assert {"crossover/busy", "crossover/overlap", "crossover/wait_for_turn_s"} <= set(tags), tags
        busy = acc.Scalars("crossover/busy")
        assert len(busy) == steps and [e.step for e in busy] == list(range(steps))
        assert all(0.0 <= e.value <= 1.0 for e in busy + acc.Scalars("crossover/overlap"))
        assert all(e.value >= 0.0 for e in acc.Scalars("crossover/wait_for_turn_s"))


def test_a_job_without_horovod_is_named_and_one_rank_per_job_is_said(work: Path, sched: Path) -> None:
    """Real jobs, one rank each (as `crossover-run a.py b.py` gives on a CPU machine): the start says there is
    nothing to overlap, and plain.py, which never calls hvd.init(), has its row in the summary instead of
    vanishing from it."""
    d = work / "never"
    d.mkdir()
    (d / "first.py").write_text(TINY)
    (d / "plain.py").write_text("print('no Horovod here', flush=True)\n")
    log = d / "never.log"
    proc = _start(["--sched-dir", str(sched), "-np", "1", "--no-progress", "first.py", "5", "plain.py"],
                  _env(sched), log)
    assert _wait(proc, log) == 0, log.read_text()
    text = log.read_text()
    assert "crossover-run: note: one rank per job: nothing to overlap" in text
    assert "no Horovod here" in text and "first=0, plain=0" in text
    assert re.search(r"^first +1 +5 ", text, re.M) and f"plain          {NEVER}" in text, text
    assert "hence overlap 0 %" in text


FAKE_HOROVODRUN = textwrap.dedent("""
    import os, time
    from crossover.scheduler.telemetry import Recorder
    r = Recorder(os.environ["CROSSOVER_TELEMETRY_DIR"], os.environ["CROSSOVER_JOB"], "rank0", "localhost", "cpu")
    for i in range(12):
        t = time.time()
        r.span("compute", t, t + 0.05)
        r.step(i, t + 0.1, 0.05, 0.0, 0.05)
        print("line", i, flush=True)
        time.sleep(0.1)
    r.close()
""")


def test_progress_is_one_redrawn_line_on_a_terminal(work: Path) -> None:
    """On a terminal the progress is one line redrawn in place (cleared before a job's output line, drawn
    again after); the jobs' lines stay intact."""
    import pty

    d = work / "tty"
    d.mkdir()
    fake = stand_in_horovodrun(d, FAKE_HOROVODRUN)
    master, slave = pty.openpty()
    proc = subprocess.Popen(RUN + ["--horovodrun", str(fake), "-np", "1", "job.py", "job.py"], env=_env(), cwd=str(d),
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child side closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0
    text = out.decode(errors="replace")
    assert "\r\x1b[2K[" in text and "job-1: step" in text and "turns" in text  # the redrawn status line
    assert "[job-1] line 11" in text and "[job-2] line 11" in text
    assert "crossover-run: progress at" not in text  # no plain lines on a terminal
