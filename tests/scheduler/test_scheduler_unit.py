"""Unit tests of the crossover scheduler's pieces, without processes: protocol, policy, paths, telemetry,
and crossover-run's command-line planning."""

from __future__ import annotations

import json
import os
import stat
import struct

import pytest

from crossover.scheduler import paths, protocol, run, telemetry
from crossover.scheduler.policy import Scheduler, StateError
from crossover.scheduler.protocol import CLIENT_OPS, SERVER_OPS, Decoder, ProtocolError, encode

# --------------------------------------------------------------------------- protocol


def frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def test_roundtrip_and_partial_frames() -> None:
    msgs = [{"op": "hello", "v": 1, "job": "job0", "member": "rank0", "weight": 1.0, "pid": 42},
            {"op": "acquire", "id": 1, "dev": "cpu0", "seq": 0},
            {"op": "release", "dev": "cpu0"}, {"op": "ping", "id": 7}, {"op": "status", "id": 8}]
    data = b"".join(encode(m, CLIENT_OPS) for m in msgs)
    d = Decoder(CLIENT_OPS)
    out = []
    for i in range(len(data)):  # one byte at a time
        out += d.feed(data[i:i + 1])
    assert out == msgs and d.pending == 0
    assert Decoder(CLIENT_OPS).feed(data) == msgs  # all at once
    grant = {"op": "grant", "id": 3, "dev": "cuda0", "turn": 9, "waited_us": 120}
    assert Decoder(SERVER_OPS).feed(encode(grant, SERVER_OPS)) == [grant]


BAD_BODIES = [
    b"not json", b"[1, 2]", b'"text"', b"{}", b'{"op": 5}', b'{"op": "fly"}', b'{"op": "grant", "id": 1}',
    b'{"op": "ping"}', b'{"op": "ping", "id": 1, "x": 2}', b'{"op": "ping", "id": true}',
    b'{"op": "ping", "id": 1.5}', b'{"op": "ping", "id": -1}', b'{"op": "ping", "id": 9007199254740992}',
    b'{"op": "ping", "id": "1"}', b'{"op": "ping", "id": 1, "id": 2}', b'{"op": "ping", "id": NaN}',
    b'{"op": "release", "dev": ""}', b'{"op": "release", "dev": "a\\u0000b"}', b'{"op": "release", "dev": ["x"]}',
    b'{"op": "release", "dev": "' + b"x" * 201 + b'"}',
    b'{"op": "hello", "v": 2, "job": "j", "member": "m", "weight": 1, "pid": 1}',
    b'{"op": "hello", "v": 1, "job": "j", "member": "m", "weight": 0, "pid": 1}',
    b'{"op": "hello", "v": 1, "job": "j", "member": "m", "weight": 1e400, "pid": 1}',
    b'{"op": "hello", "v": 1, "job": "j", "member": "m", "weight": Infinity, "pid": 1}',
    b'{"op": "hello", "v": 1, "job": "j", "member": "m", "weight": 1' + b"0" * 399 + b', "pid": 1}',
    b'{"op": "hello", "v": 1, "job": "j", "member": "m", "weight": 5e-324, "pid": 1}',
    b'{"op": "hello", "v": 1, "job": "j", "member": "m", "weight": 0.0009, "pid": 1}',
    b'{"op": "ping", "id": 1' + b"0" * 4000 + b"}",
    b"\xff\xfe{}", b"[" * 3000 + b"]" * 3000, b'{"op": "acquire", "id": 1, "dev": "c", "seq": null}',
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_rejects_invalid_messages(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        Decoder(CLIENT_OPS).feed(frame(body))


def test_encode_refuses_non_finite_numbers() -> None:
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode({"op": "status", "id": 1, "state": {"vtime": float("inf")}})


def test_scheduler_refuses_non_finite_settings_and_weights() -> None:
    for kw in ({"lease_s": float("inf")}, {"lease_s": float("nan")}, {"align_s": float("inf")}, {"align_s": -1.0}):
        with pytest.raises(ValueError):
            Scheduler(**kw)  # type: ignore[arg-type]
    s = Scheduler()
    with pytest.raises(StateError, match="between 0.001 and 1000"):
        s.hello(1, "A", "a0", 5e-324, 1)
    s.check()


def test_rejects_bad_lengths() -> None:
    with pytest.raises(ProtocolError):
        Decoder(CLIENT_OPS).feed(struct.pack("!I", 0))
    with pytest.raises(ProtocolError):
        Decoder(CLIENT_OPS).feed(struct.pack("!I", protocol.MAX_MESSAGE + 1) + b"{")
    with pytest.raises(ProtocolError):
        encode({"op": "error", "msg": "x" * (protocol.MAX_MESSAGE + 10)})
    assert Decoder(CLIENT_OPS).feed(struct.pack("!I", 10) + b"{") == []  # incomplete: waits


def test_server_messages_do_not_pass_as_client_ones() -> None:
    with pytest.raises(ProtocolError):
        Decoder(CLIENT_OPS).feed(encode({"op": "pong", "id": 1}))


# --------------------------------------------------------------------------- policy


def sched(*members: tuple[str, str], **kw: object) -> tuple[Scheduler, list[dict]]:
    """A scheduler and the events it emits; connection i (from 1) has said hello as ``members[i - 1]``, a (job,
    member) of weight 1 and pid i."""
    events: list[dict] = []
    s = Scheduler(on_event=events.append, **kw)  # type: ignore[arg-type]
    for conn, (job, member) in enumerate(members, 1):
        s.hello(conn, job, member, 1.0, conn)
    return s, events


def granted(grants: list, conn: int | None = None) -> list[int]:
    return sorted(g.conn for g in grants if conn is None or g.conn == conn)


def test_two_jobs_alternate_strictly() -> None:
    s, _ = sched(("A", "a0"), ("B", "b0"), align_s=0)
    now = 0.0
    assert granted(s.acquire(1, "cpu", 0, 1, now)) == [1]
    assert s.acquire(2, "cpu", 0, 1, now) == []
    order = []
    seq = {1: 0, 2: 0}
    holder = 1
    for _ in range(10):  # the holder releases, then asks again at once: the other one must go first
        now += 1
        order.append(holder)
        grants = s.release(holder, "cpu", now)
        seq[holder] += 1
        assert s.acquire(holder, "cpu", seq[holder], 2, now) == []
        (g,) = grants
        holder = g.conn
    assert order == [1, 2] * 5


def test_three_jobs_round_robin_and_weights() -> None:
    s, _ = sched(align_s=0)
    for c, j in ((1, "A"), (2, "B"), (3, "C")):
        s.hello(c, j, f"{j}0", 2.0 if j == "A" else 1.0, c)
    now, seq = 0.0, {1: 0, 2: 0, 3: 0}
    s.acquire(1, "gpu0", 0, 0, now)
    s.acquire(2, "gpu0", 0, 0, now)
    s.acquire(3, "gpu0", 0, 0, now)
    holder, order = 1, []
    for _ in range(12):
        now += 1
        order.append("ABC"[holder - 1])
        (g,) = s.release(holder, "gpu0", now)
        seq[holder] += 1
        s.acquire(holder, "gpu0", seq[holder], 0, now)
        holder = g.conn
    # weight 2 for A: A gets two turns for each turn of B and of C
    assert order.count("A") == 6 and order.count("B") == 3 and order.count("C") == 3


def test_members_of_one_job_share_a_turn() -> None:
    s, events = sched(("A", "a0"), ("A", "a1"), ("B", "b0"), align_s=0)
    assert granted(s.acquire(1, "cpu", 0, 1, 0.0)) == [1]
    assert granted(s.acquire(2, "cpu", 0, 1, 0.1)) == [2]  # same job, same step: joins
    assert s.acquire(3, "cpu", 0, 1, 0.2) == []
    assert s.release(1, "cpu", 0.3) == []  # a1 still computes
    assert s.acquire(1, "cpu", 1, 2, 0.4) == []  # next step of A waits for B
    assert granted(s.release(2, "cpu", 0.5)) == [3]
    assert s.acquire(2, "cpu", 1, 2, 0.6) == []
    assert granted(s.release(3, "cpu", 0.7)) == [1, 2]  # both A ranks at once
    assert [e["ev"] for e in events if e["ev"] in ("start", "end")] == ["start", "end", "start", "end", "start"]


def test_rejoin_only_when_nobody_else_waits() -> None:
    s, _ = sched(("A", "a0"), ("A", "a1"), ("B", "b0"), align_s=0)
    s.acquire(1, "cpu", 5, 1, 0.0)
    s.acquire(2, "cpu", 5, 1, 0.0)
    s.release(1, "cpu", 0.1)
    assert granted(s.acquire(1, "cpu", 5, 2, 0.2)) == [1]  # same step again, no one waits: fine
    s.release(1, "cpu", 0.3)
    s.acquire(3, "cpu", 0, 1, 0.4)
    assert s.acquire(1, "cpu", 5, 3, 0.5) == []  # B waits now: a0 must queue behind it


def test_lease_expiry_hands_over_and_ignores_late_release() -> None:
    s, events = sched(("A", "a0"), ("B", "b0"), lease_s=2.0, align_s=0)
    s.acquire(1, "cpu", 0, 1, 0.0)
    assert s.tick(100.0) == []  # nobody waits: the holder may keep the device
    assert s.acquire(2, "cpu", 0, 1, 100.0) == []
    assert s.next_deadline() == pytest.approx(102.0)
    assert s.tick(101.9) == []
    assert granted(s.tick(102.0)) == [2]  # a waiter waits at most lease_s
    assert any(e["ev"] == "end" and e["why"] == "lease expired" for e in events)
    assert s.release(1, "cpu", 103.0) == []  # late release of the expired turn: ignored
    assert s.snapshot(103.0)["devices"]["cpu"]["turn"]["job"] == "B"
    assert s.acquire(1, "cpu", 1, 2, 103.0) == []  # A waits for B like anyone
    assert granted(s.release(2, "cpu", 104.0)) == [1]


def test_disconnect_releases_and_cancels() -> None:
    s, _ = sched(("A", "a0"), ("B", "b0"), ("C", "c0"), align_s=0)
    s.acquire(1, "cpu", 0, 1, 0.0)
    s.acquire(2, "cpu", 0, 1, 0.0)
    s.acquire(3, "cpu", 0, 1, 0.0)
    assert s.drop(2, 0.1) == []  # a waiter leaves
    assert granted(s.drop(1, 0.2)) == [3]  # the holder dies: the next one goes at once
    assert granted(s.drop(3, 0.3)) == []
    assert s.snapshot(0.3)["devices"] == {}


def test_alignment_holds_an_idle_device_briefly_for_the_job_due_next() -> None:
    s, events = sched(("A", "a0"), ("B", "b0"), align_s=0.002)
    s.acquire(1, "cpu", 0, 1, 0.0)
    s.acquire(2, "cpu", 0, 1, 0.0)
    s.release(1, "cpu", 1.0)  # A's turn ends, B's starts
    s.release(2, "cpu", 2.0)  # B's ends: device idle, both communicate; A is due next (A < B)
    assert s.acquire(2, "cpu", 1, 2, 3.0) == []  # B is back first: held for A
    assert any(e["ev"] == "hold" for e in events)
    assert granted(s.acquire(1, "cpu", 1, 2, 3.001)) == [1]  # A arrives within the window
    s.release(1, "cpu", 4.0)
    s.release(2, "cpu", 4.5)
    assert s.acquire(2, "cpu", 2, 3, 5.0) == []  # B waits again ...
    assert s.next_deadline() == pytest.approx(5.002)
    assert granted(s.tick(5.0021)) == [2]  # ... but at most align_s


def test_new_job_starts_level_and_state_errors() -> None:
    s, _ = sched(("A", "a0"), align_s=0)
    for i in range(5):
        s.acquire(1, "cpu", i, i, float(i))
        s.release(1, "cpu", i + 0.5)
    s.hello(2, "B", "b0", 1.0, 2)
    s.acquire(2, "cpu", 0, 1, 10.0)
    assert s.snapshot(10.0)["devices"]["cpu"]["vtime"] == {"A": 5.0, "B": 5.0}
    with pytest.raises(StateError):
        s.acquire(3, "cpu", 0, 1, 10.0)  # no hello
    s.hello(3, "C", "c0", 1.0, 3)
    s.acquire(3, "cpu", 0, 1, 10.0)
    with pytest.raises(StateError):
        s.acquire(3, "cpu", 0, 2, 10.0)  # already waiting
    with pytest.raises(StateError):
        s.hello(3, "C", "c0", 1.0, 3)


# --------------------------------------------------------------------------- paths


def test_secure_dir(tmp_path, monkeypatch) -> None:
    d = str(tmp_path / "s")
    assert paths.secure_dir(d) == d
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(d, 0o755)
    with pytest.raises(paths.SchedulerDirError, match="chmod 700"):
        paths.secure_dir(d)  # an existing open directory is refused, never tightened
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
    os.chmod(d, 0o700)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(paths.SchedulerDirError, match="can be written by other users"):
        paths.secure_dir(str(open_dir / "s"))  # others could replace it
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(paths.SchedulerDirError):
        paths.secure_dir(str(link))
    with pytest.raises(paths.SchedulerDirError):
        paths.secure_dir(str(tmp_path / ("x" * 120)))  # socket path too long
    if os.geteuid() == 0:
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 65534, 65534)
        with pytest.raises(paths.SchedulerDirError):
            paths.secure_dir(str(other))
    monkeypatch.setenv("CROSSOVER_SCHED_DIR", str(tmp_path / "h-{host}-{uid}"))
    monkeypatch.setenv("HOROVOD_HOSTNAME", "node7")
    assert paths.default_dir() == str(tmp_path / f"h-node7-{os.geteuid()}")


# --------------------------------------------------------------------------- telemetry


def test_intervals() -> None:
    x = telemetry.merge_intervals([(0, 1), (0.5, 2), (3, 4)])
    assert x == [(0, 2), (3, 4)]
    assert telemetry.intersect_length(x, [(1, 3.5)]) == pytest.approx(1.5)


def test_summary_and_trace(tmp_path) -> None:
    # job A computes [0,1) [2,3); job B computes [1,2) [3,4); each waits on communication meanwhile
    for job, offset in (("A", 0.0), ("B", 1.0)):
        r = telemetry.Recorder(str(tmp_path), job, "rank0", "h", "cpu0")
        for k in range(2):
            t = offset + 2 * k
            r.span("compute", t, t + 1)
            r.span("wait_comm", t + 1, t + 2)
            r.step(k, t + 2, 1.0, 0.0, 1.0)
        r.close()
    streams = telemetry.load(str(tmp_path))
    s = telemetry.summarize(streams)
    dev = s["devices"]["h/cpu0"]
    assert dev["busy_fraction"] == pytest.approx(0.8)  # busy 4 s of a 5 s span
    assert dev["compute_collision_s"] == 0
    assert dev["overlap"] == pytest.approx(3 / 4)  # B's last wait and A's... see intervals
    assert s["jobs"]["A"]["step_s"] == pytest.approx(2.0)
    trace = telemetry.chrome_trace(streams)
    json.dumps(trace)
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"compute", "wait_comm"}
    assert "A" in telemetry.format_summary(s)
    assert "never_took_a_turn" not in s  # only when the expected jobs are given
    s = telemetry.summarize(streams, ["A", "idle", "B"])
    assert s["never_took_a_turn"] == ["idle"] and set(s["jobs"]) == {"A", "B"}
    assert f"idle           {telemetry.NEVER_TOOK_A_TURN}" in telemetry.format_summary(s).splitlines()


def _alternating(tmp_path, steps: int = 8) -> list:
    """Jobs A and B on h/cpu0: each computes 1 s then communicates 1 s, B one second behind A."""
    for job, offset in (("A", 0.0), ("B", 1.0)):
        r = telemetry.Recorder(str(tmp_path), job, "rank0", "h", "cpu0")
        for k in range(steps):
            t = 100 + offset + 2 * k
            r.span("compute", t, t + 1)
            r.span("wait_comm", t + 1, t + 2)
            r.step(k, t + 2, 1.0, 0.0, 1.0)
        r.close()
    return telemetry.load(str(tmp_path))


def test_step_figures(tmp_path) -> None:
    rows = telemetry.step_figures(_alternating(tmp_path))
    assert [r["step"] for r in rows["A"]] == list(range(8))
    later = rows["A"][1:-1]  # both jobs running: the device always busy, A's waits fully hidden behind B
    assert all(r["busy"] == pytest.approx(1.0) and r["overlap"] == pytest.approx(1.0) for r in later), later
    assert rows["A"][0]["step_s"] == pytest.approx(2.0) and rows["A"][0]["wait_for_turn_s"] == 0.0
    assert rows["B"][-1]["overlap"] == pytest.approx(0.0)  # A has finished: nobody computes during B's last wait


def test_plot_timeline(tmp_path) -> None:
    from crossover.scheduler import plot

    streams = _alternating(tmp_path / "tel", steps=12)
    out = tmp_path / "turns.png"
    drawn = plot.plot_timeline(streams, str(out))
    assert out.read_bytes()[:4] == b"\x89PNG" and drawn["devices"] == ["h/cpu0"] and drawn["jobs"] == ["A", "B"]
    t0, t1 = drawn["window"]
    assert t0 == pytest.approx(100 + 1 + 2 * 3 + 2) and t1 - t0 == pytest.approx(12.0)  # 6 steps after 3


def test_telemetry_tail_follows_growing_files(tmp_path) -> None:
    from crossover.scheduler.progress import TelemetryTail, format_jobs

    r = telemetry.Recorder(str(tmp_path), "A", "rank0", "h", "cpu0")
    os.symlink("/etc/passwd", tmp_path / "planted.jsonl")  # never followed
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    tail = TelemetryTail(fd)
    try:
        assert tail.poll() == {}  # the meta line is not flushed before the first step
        for k in range(3):
            r.span("compute", 10 + k, 10.5 + k)
            r.step(k, 11 + k, 0.5, 0.0, 0.5)
        got = tail.poll()["A"]
        assert (got.steps, got.turns, got.steps_per_s) == (3, 3, pytest.approx(1.0))
        r.span("compute", 13, 13.5)
        r.step(3, 13.25, 0.5, 0.0, 0.0)
        assert tail.poll()["A"].steps == 4
        assert format_jobs({"A": tail.poll()["A"], "B": "starting"}) == "A: step 4, 4 turns, 1.33 steps/s; B: starting"
    finally:
        tail.close()
        os.close(fd)
        r.close()


# --------------------------------------------------------------------------- crossover-run planning


def test_plan_jobs(tmp_path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("")
    b.write_text("")
    args, jobs = run.plan_jobs(["-np", "2", "-H", "h1:1,h2:1", "--gloo", str(a), "--lr", "0.1", "--",
                                str(b), "--epochs", "5", "--", "-m", "pkg.mod", "-x"])
    assert [j.name for j in jobs] == ["a", "b", "pkg.mod"]  # named after their scripts
    hvd = jobs[0].argv[:6]
    assert hvd[1:] == ["-np", "2", "-H", "h1:1,h2:1", "--gloo"]
    assert jobs[0].argv[6:] == [jobs[0].argv[6], "-m", "horovod_ext.launch", str(a), "--lr", "0.1"]
    assert jobs[2].argv[-5:] == ["-m", "horovod_ext.launch", "-m", "pkg.mod", "-x"]
    assert jobs[1].env["CROSSOVER_JOB"] == "b" and jobs[1].env["CROSSOVER_SCHED"] == "1"
    _, plain = run.plan_jobs(["-np", "2", "--no-crossover", str(a)])
    assert "horovod_ext.launch" not in plain[0].argv and plain[0].env["CROSSOVER_SCHED"] == "0"


def test_plan_the_bare_form(tmp_path, monkeypatch) -> None:
    """`crossover-run job1.py job2.py` (the project's usage line): each .py argument is a job, -np defaults."""
    from crossover.scheduler import plan

    for name in ("job1.py", "job2.py", "cfg.py"):
        (tmp_path / name).write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan, "default_np", lambda: (1, "1 rank per job (no CUDA device found)"))
    args, jobs = run.plan_jobs(["job1.py", "job2.py"])
    assert [j.name for j in jobs] == ["job1", "job2"] and args.np == 1 and "no CUDA" in args.np_reason
    assert [j.user_cmd for j in jobs] == [["job1.py"], ["job2.py"]]
    assert jobs[0].argv[1:3] == ["-np", "1"] and jobs[0].argv[-3:] == ["-m", "horovod_ext.launch", "job1.py"]
    assert jobs[0].argv[3] == jobs[1].argv[3]  # the same python for both
    args, jobs = run.plan_jobs(["-np", "3", "job1.py", "--lr", "0.1", "--config", "cfg.py", "job1.py", "--seed", "2"])
    assert [j.user_cmd for j in jobs] == [["job1.py", "--lr", "0.1", "--config", "cfg.py"], ["job1.py", "--seed", "2"]]
    assert [j.name for j in jobs] == ["job1-1", "job1-2"] and args.np == 3 and args.np_reason == "given"


def test_split_bare_and_job_names() -> None:
    from crossover.scheduler.plan import job_names, split_bare

    assert split_bare(["a.py", "b.py", "python3", "c.py", "-x", "1", "d.py", "--opt", "e.py"]) == [
        ["a.py"], ["b.py"], ["python3", "c.py", "-x", "1"], ["d.py", "--opt", "e.py"]]
    assert job_names([["t.py"], ["x/t.py"], ["-m", "pkg.mod"], ["python3", "u v.py"], ["t-1.py"]]) == [
        "t-1", "t-2", "pkg.mod", "u_v", "t-1-1"]


@pytest.mark.parametrize("names", ["..,b", ".,b", "a/b,c", "a\0b,c", ",b", "-x,b", "a," + "x" * 65])
def test_plan_refuses_job_names_that_are_not_plain_file_names(names, tmp_path, capsys) -> None:
    script = tmp_path / "a.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exc:
        run.plan_jobs(["-np", "1", f"--names={names}", str(script), "--", str(script)])
    assert exc.value.code == 2
    assert "--names: bad job name" in capsys.readouterr().err


def test_job_names_from_scripts_are_plain_file_names() -> None:
    from crossover.scheduler.plan import job_names

    assert job_names([["..py"], ["-m", ".."], ["-m", "-x.y"], [".hidden.py"]]) == ["py", "job", "x.y", "hidden"]


def test_tensorboard_runs_stay_inside_their_folder_whatever_the_job_name_in_the_telemetry() -> None:
    from crossover.scheduler.tboard import _safe

    for name in ("..", ".", "", "-x", "a/../..", ".hidden"):
        safe = _safe(name)
        assert "/" not in safe and safe[0] not in ".-" and os.path.basename(safe) == safe, (name, safe)
    assert _safe("train-1") == "train-1"


def test_default_np_says_what_it_chose(monkeypatch) -> None:
    import torch

    from crossover.scheduler.plan import default_np

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert default_np() == (4, "4 rank(s) per job, one per local GPU (torch.cuda.device_count())")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_np() == (1, "1 rank per job (no CUDA device found)")


@pytest.mark.parametrize("argv", [[], ["-np", "2"], ["-np", "2", "--bogus", "a.py"], ["-np", "2", "missing.py"],
                                  ["a.py"], ["-np", "2", "A", "--", ""], ["-np", "2", "A", "--", "--"],
                                  ["-np", "2", "--weights", "1,x", "A"], ["-np", "2", "--gloo", "--mpi", "A"],
                                  ["-np", "2", "A", "--", "-m"]])
def test_plan_usage_errors(argv, tmp_path, capsys) -> None:
    script = tmp_path / "a.py"
    script.write_text("")
    argv = [str(script) if x == "A" else x for x in argv]
    with pytest.raises(SystemExit) as exc:
        run.plan_jobs(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err
