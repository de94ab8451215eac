"""The scheduler against a hostile local user, descriptor exhaustion and a hung daemon (issue 15), and
against parseable-but-hostile values, stalled clients and paths swapped mid-run (issue 27).

Real processes throughout: the daemon, clients, ``crossover-run`` (with a stand-in ``horovodrun`` that
writes one rank's telemetry, so no Horovod start-up) and, when the tests run as root, a second Unix user
created for the test (``useradd``) that plays the attacker; without root those tests are skipped with
that reason. Links "of another user" are made by root and handed to an unused uid with ``os.lchown``.
About 40 seconds in all (41 s measured on the shared 2-core machine).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import sched_harness
from sched_harness import ENV, TELEMETRY_OF_THREE_STEPS, daemons_for, stand_in_horovodrun, start_daemon

from crossover.scheduler import paths
from crossover.scheduler.client import SchedulerClient
from crossover.scheduler.protocol import encode

RUN = [sys.executable, "-m", "crossover.scheduler.run"]


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def sched_dir() -> Iterator[str]:
    yield from sched_harness.scratch_dir("xo-h-")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def log_lines(d: str) -> list[str]:
    return Path(d, "daemon.log").read_text(errors="replace").splitlines()


@dataclass
class User:
    name: str
    uid: int
    gid: int
    python: str  # an interpreter this user may run (the test's own may live under /root)

    def run(self, code: str, **kw: object) -> subprocess.CompletedProcess[str]:
        """Run Python ``code`` as this user (stdlib only; cwd /)."""
        return subprocess.run([self.python, "-c", textwrap.dedent(code)], user=self.uid, group=self.gid,
                              extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                              text=True, timeout=60, check=True, **kw)  # type: ignore[call-overload]

    def popen(self, code: str) -> subprocess.Popen[str]:
        return subprocess.Popen([self.python, "-c", textwrap.dedent(code)], user=self.uid, group=self.gid,
                                extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def attacker() -> Iterator[User]:
    """A second Unix user, created for these tests and deleted afterwards (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test creates a second Unix user to play the attacker")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("needs useradd/userdel to create a second Unix user")
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if python is None:
        pytest.skip("needs a system python3 that a second user can run")
    name = f"xo_attacker_{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
                   check=True, capture_output=True, timeout=60)
    try:
        pw = pwd.getpwnam(name)
        yield User(name, pw.pw_uid, pw.pw_gid, python)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)
        subprocess.run(["groupdel", name], capture_output=True, timeout=60)  # if userdel left it


# --------------------------------------------------------------------------- 1. symlinks in writable places


def test_symlinks_planted_in_the_scheduler_dir_are_never_written_through(attacker: User, sched_dir: str,
                                                                          tmp_path: Path) -> None:
    """The directory was once left world-writable; another user planted daemon.lock and daemon.log links to
    files of ours; the owner has made it private again since. Neither the daemon nor a worker that starts
    one writes through the links: they refuse, name the file and say to remove it."""
    lock_target, log_target = tmp_path / "precious-1", tmp_path / "precious-2"
    lock_target.write_text("precious 1\n")
    log_target.write_text("precious 2\n")
    os.chmod(sched_dir, 0o777)
    attacker.run(f"""
        import os
        os.symlink({str(lock_target)!r}, {os.path.join(sched_dir, "daemon.lock")!r})
        os.symlink({str(log_target)!r}, {os.path.join(sched_dir, "daemon.log")!r})
    """)
    os.chmod(sched_dir, 0o700)

    r = subprocess.run([sys.executable, "-m", "crossover.scheduler.daemon", "--dir", sched_dir, "--idle-exit", "1"],
                       env=ENV, capture_output=True, text=True, timeout=60)
    code = f"""
        import logging
        logging.basicConfig(level=logging.WARNING)
        from crossover.scheduler.client import SchedulerClient
        print(SchedulerClient("victim", "r0", directory={sched_dir!r}).connect(wait=1))
    """
    w = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=ENV, capture_output=True, text=True,
                       timeout=60)
    time.sleep(0.5)  # a daemon started on demand would have written by now
    assert lock_target.read_text() == "precious 1\n" and log_target.read_text() == "precious 2\n"
    assert r.returncode == 2, r.stderr
    assert "daemon.lock is a symbolic link" in r.stderr and "remove it" in r.stderr
    assert w.returncode == 0 and w.stdout.strip() == "False", w.stderr  # runs uncoordinated
    assert "daemon.log is a symbolic link" in w.stderr
    assert all(os.path.islink(os.path.join(sched_dir, n)) for n in ("daemon.lock", "daemon.log"))


@pytest.fixture
def fake_run() -> Iterator[Path]:
    """A folder with job.py and a stand-in horovodrun that writes one rank's telemetry and exits 0."""
    d = Path(tempfile.mkdtemp(prefix="xo-fr-", dir="/tmp"))
    overlapping = TELEMETRY_OF_THREE_STEPS + "time.sleep(0.5)  # two runs started together overlap\n"
    stand_in_horovodrun(d, overlapping, job="raise SystemExit('never run: the stand-in horovodrun does not run it')\n")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _crossover_run(fake_run: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(RUN + ["--horovodrun", str(fake_run / "horovodrun"), "-np", "1", *args,
                                   "job.py", "--", "job.py"], env=ENV, cwd=str(fake_run), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_crossover_run_as_root_refuses_a_telemetry_dir_another_user_prepared(attacker: User, fake_run: Path,
                                                                             tmp_path: Path) -> None:
    """Another user pre-created the telemetry directory with summary.json and timeline.json pointing at
    files of root's: crossover-run refuses the directory (exit 2, naming its owner) and writes nothing."""
    shared = Path(tempfile.mkdtemp(prefix="xo-sh-", dir="/tmp"))
    try:
        shared.chmod(0o1777)  # a shared, sticky place like /tmp
        tel = shared / "tel"
        targets = [tmp_path / "root-file-1", tmp_path / "root-file-2"]
        for t in targets:
            t.write_text("root's data\n")
        attacker.run(f"""
            import os
            os.mkdir({str(tel)!r}, 0o755)
            os.symlink({str(targets[0])!r}, {str(tel / "summary.json")!r})
            os.symlink({str(targets[1])!r}, {str(tel / "timeline.json")!r})
        """)
        proc = _crossover_run(fake_run, "--telemetry-dir", str(tel))
        out, err = proc.communicate(timeout=120)
        assert all(t.read_text() == "root's data\n" for t in targets)
        assert proc.returncode == 2, out + err
        assert f"belongs to uid {attacker.uid}" in err and str(tel) in err
        assert sorted(p.name for p in tel.iterdir()) == ["summary.json", "timeline.json"]  # nothing added
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# --------------------------------------------------------------------------- 2. the client checks the daemon's uid


def test_a_listener_planted_by_another_user_is_not_trusted(attacker: User, sched_dir: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Another user planted a listening socket while the directory was open. A worker does not even say
    hello to it (SO_PEERCRED), runs uncoordinated at once without autostart, and with autostart starts a
    daemon of its own, which replaces the planted socket."""
    caplog.set_level(logging.INFO, logger="crossover.scheduler.client")
    os.chmod(sched_dir, 0o777)
    impostor = attacker.popen(f"""
        import json, os, socket, struct, sys
        s = socket.socket(socket.AF_UNIX)
        s.bind({paths.socket_path(sched_dir)!r})
        os.chmod({paths.socket_path(sched_dir)!r}, 0o777)
        s.listen(16)
        print("ready", flush=True)
        while True:  # answer a hello like a daemon would, then never grant anything
            c, _ = s.accept()
            c.settimeout(1.0)
            try:
                data = c.recv(4096)
            except OSError:
                data = b""
            if data:
                print("got", data[4:].decode(errors="replace"), flush=True)
                body = json.dumps({{"op": "welcome", "v": 1, "pid": 4242, "lease": 1.0}}).encode()
                c.sendall(struct.pack("!I", len(body)) + body)
            else:
                print("nothing", flush=True)
    """)
    try:
        assert impostor.stdout is not None and impostor.stdout.readline().strip() == "ready"
        os.chmod(sched_dir, 0o700)

        c = SchedulerClient("victim", "r0", directory=sched_dir, autostart=False)
        t0 = time.monotonic()
        assert c.connect(wait=1) is False and c.daemon_pid != 4242
        assert c.acquire("cpu0", 0) is False  # uncoordinated at once
        assert time.monotonic() - t0 < 5
        assert f"uid {attacker.uid}" in caplog.text and "ignoring it" in caplog.text

        c2 = SchedulerClient("victim", "r1", directory=sched_dir)  # autostart: our own daemon takes over
        assert c2.connect(wait=15), Path(sched_dir, "daemon.log").read_text()
        (ours,) = daemons_for(sched_dir)
        assert c2.daemon_pid == ours
        assert c2.acquire("cpu0", 0)
        c2.release("cpu0")
        c2.close()
    finally:
        impostor.kill()
        out, _ = impostor.communicate(timeout=30)
    assert "got" not in out, out  # the impostor never saw a hello: no job or member name leaked


# --------------------------------------------------------------------------- 3. descriptor exhaustion


def test_idle_connections_beyond_the_descriptor_limit(sched_dir: str) -> None:
    """Under `ulimit -n 128`, 200 connections that never say hello: the daemon does not spin or flood its
    log, a real worker is served at once (an idle connection makes room for it), and every idle one is
    closed at its hello deadline."""
    proc = start_daemon(sched_dir, "--hello-timeout", "3", nofile=128)
    idle = []
    for _ in range(200):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        try:
            s.connect(paths.socket_path(sched_dir))
        except OSError:
            s.close()
            continue
        idle.append(s)
    real = SchedulerClient("real", "r0", directory=sched_dir, autostart=False)
    try:
        assert real.connect(wait=10), log_lines(sched_dir)[-20:]
        assert real.acquire("cpu0", 0)
        real.release("cpu0")
        cpu0 = cpu_seconds(proc.pid)
        time.sleep(1.5)
        cpu = cpu_seconds(proc.pid) - cpu0
        assert cpu < 0.5, f"the daemon used {cpu:.2f} s of CPU in 1.5 s with idle connections open"
        deadline = time.monotonic() + 20
        for s in idle:  # closed by the daemon: evicted for the real client or past the hello deadline
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            s.close()
        assert real.ping() is not None  # a worker that said hello is never evicted
    finally:
        for s in idle:
            s.close()
        real.close()
    lines = log_lines(sched_dir)
    assert len(lines) < 150, "\n".join(lines[-30:])
    assert any("suppressed" in x for x in lines)  # rate-limited, and says how much was left out


def _sent(d: str, n: int, data: bytes, timeout: float = 5) -> list[socket.socket]:
    """``n`` new connections to the daemon of ``d`` (socket timeout ``timeout``), each of which has sent ``data``."""
    conns = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        s.connect(paths.socket_path(d))
        s.sendall(data)
        conns.append(s)
    return conns


def test_accept_backs_off_when_descriptors_run_out(sched_dir: str) -> None:
    """With a connection cap above the descriptor limit (a test-only option), accept fails with EMFILE once
    workers that said hello hold every descriptor: the daemon pauses accepting instead of spinning, logs a
    few lines, and serves the queued connections as soon as descriptors are free again."""
    proc = start_daemon(sched_dir, "--hello-timeout", "30", "--max-clients", "1000", nofile=64)
    hello = encode({"op": "hello", "v": 1, "job": "idle", "member": "m", "weight": 1.0, "pid": os.getpid()})
    conns = _sent(sched_dir, 80, hello)
    try:
        time.sleep(0.5)
        cpu0 = cpu_seconds(proc.pid)
        time.sleep(1.5)
        cpu = cpu_seconds(proc.pid) - cpu0
        assert cpu < 0.5, f"the daemon used {cpu:.2f} s of CPU in 1.5 s while out of descriptors"
        failures = [x for x in log_lines(sched_dir) if "accept failed" in x]
        assert 1 <= len(failures) <= 40, failures[-5:]
        for s in conns[:30]:  # workers leave: descriptors are free again
            s.close()
        for s in conns[30:]:  # every queued worker gets its welcome
            s.settimeout(15)
            head = s.recv(4, socket.MSG_WAITALL)
            body = s.recv(struct.unpack("!I", head)[0], socket.MSG_WAITALL)
            assert json.loads(body)["op"] == "welcome"
    finally:
        for s in conns:
            s.close()


# --------------------------------------------------------------------------- 4. a hung daemon


def test_a_stopped_daemon_costs_one_probe_then_the_job_runs_at_full_speed(sched_dir: str,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """SIGSTOP the daemon: the acquire in flight gives up after an unanswered ping (not the 8 s time-out),
    the following steps run uncoordinated at full speed (not one per 5 s), re-attaching is tried in the
    background, and after SIGCONT the worker is coordinated again."""
    caplog.set_level(logging.INFO, logger="crossover.scheduler.client")
    proc = start_daemon(sched_dir, "--lease", "10")
    c = SchedulerClient("A", "r0", directory=sched_dir, autostart=False, retry_s=0.2, acquire_timeout=8)
    assert c.connect(wait=10)
    assert c.acquire("cpu0", 0)
    c.release("cpu0")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert c.acquire("cpu0", 1) is False
        first = time.monotonic() - t0
        assert first < 7, f"the acquire in flight took {first:.1f} s to give up"
        assert "does not answer" in caplog.text
        steps = []
        for seq in range(2, 40):
            t0 = time.monotonic()
            assert c.acquire("cpu0", seq) is False
            c.release("cpu0")
            time.sleep(0.02)  # "compute"
            steps.append(time.monotonic() - t0)
        assert max(steps) < 1.0, f"steps under a stopped daemon: max {max(steps):.2f} s"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    seq = 100
    while not c.acquire("cpu0", seq):
        assert time.monotonic() < deadline, "never re-attached after SIGCONT"
        seq += 1
        time.sleep(0.05)
    c.release("cpu0")
    assert "re-attached" in caplog.text
    c.close()


def test_a_long_wait_for_a_turn_is_not_taken_for_a_hung_daemon(sched_dir: str) -> None:
    """The ping probe does not cut a legitimate wait: a holder stopped with SIGSTOP keeps the device until
    the lease (3 s, longer than probe + reply time-out); the waiter stays coordinated and gets its turn."""
    start_daemon(sched_dir, "--lease", "3")
    code = f"""
        import time
        from crossover.scheduler.client import SchedulerClient
        c = SchedulerClient("A", "r0", directory={sched_dir!r}, autostart=False)
        assert c.connect(wait=10) and c.acquire("cpu0", 0)
        print("held", flush=True)
        time.sleep(600)
    """
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=ENV, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGSTOP)
        b = SchedulerClient("B", "r0", directory=sched_dir, autostart=False, probe_s=0.5, reply_timeout=1.0)
        assert b.connect(wait=10)
        t0 = time.monotonic()
        assert b.acquire("cpu0", 0)  # granted at lease expiry, not given up as "hung"
        assert time.monotonic() - t0 >= 2.0 and b.connected
        b.release("cpu0")
        b.close()
    finally:
        holder.kill()
        holder.wait()


# --------------------------------------------------------------------------- 5. runs sharing a telemetry dir


def test_two_runs_sharing_a_telemetry_dir_stay_apart(fake_run: Path) -> None:
    """Two crossover-run at once with the same --telemetry-dir: each gets its own run sub-directory with only
    its own workers in the summary and its own timeline."""
    tel = fake_run / "tel"
    procs = [_crossover_run(fake_run, "--telemetry-dir", str(tel)) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    runs = sorted(p for p in tel.iterdir() if p.is_dir())
    assert len(runs) == 2, sorted(os.listdir(tel))
    announced = {re.search(r"telemetry in (\S+)", out).group(1) for out, _ in outs}  # type: ignore[union-attr]
    assert announced == {str(r) for r in runs}
    for r in runs:
        summary = json.loads((r / "summary.json").read_text())
        assert {j: v["workers"] for j, v in summary["jobs"].items()} == {"job-1": 1, "job-2": 1}
        trace = json.loads((r / "timeline.json").read_text())
        assert len({e["pid"] for e in trace["traceEvents"]}) == 2


# --------------------------------------------------------------------------- 6. an existing shared directory


def test_an_existing_shared_directory_is_refused_not_chmodded(tmp_path: Path) -> None:
    """CROSSOVER_SCHED_DIR pointing at an existing shared directory: the daemon refuses it (exit 2, a message
    naming it and what to do) and a worker runs uncoordinated with a warning; its mode is left alone."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    env = {**ENV, "CROSSOVER_SCHED_DIR": str(shared)}
    r = subprocess.run([sys.executable, "-m", "crossover.scheduler.daemon", "--idle-exit", "1"], env=env,
                       capture_output=True, text=True, timeout=60)
    code = """
        import logging
        logging.basicConfig(level=logging.WARNING)
        from horovod_ext import scheduling
        print(scheduling.enable(job="j", member="m", device="cpu0").coordinated)
    """
    w = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert r.returncode == 2, r.stderr
    assert str(shared) in r.stderr and "does not change a directory it did not create" in r.stderr
    assert f"chmod 700 {shared}" in r.stderr
    assert w.returncode == 0 and w.stdout.strip() == "False", w.stderr
    assert "running uncoordinated" in w.stderr and str(shared) in w.stderr
    assert os.listdir(shared) == []


# --------------------------------------------------------------------------- 7. parseable but hostile values


def _raw_frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def _exchange(d: str, frames: list[bytes], timeout: float = 10.0) -> list[dict]:
    """Send ``frames`` on one new connection, return every message the daemon sends back until it closes
    the connection or goes quiet for a second."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(paths.socket_path(d))
    for f in frames:
        s.sendall(f)
    data = b""
    s.settimeout(1.0)
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    s.close()
    out = []
    while len(data) >= 4:
        (n,) = struct.unpack("!I", data[:4])
        out.append(json.loads(data[4:4 + n]))
        data = data[4 + n:]
    return out


def _hello_body(weight: str) -> bytes:
    return b'{"op":"hello","v":1,"job":"evil","member":"m","weight":' + weight.encode() + b',"pid":1}'


def test_a_hello_with_a_huge_integer_weight_only_closes_its_connection(sched_dir: str) -> None:
    """A 462-byte hello whose weight is a 400-digit integer: JSON parses it, and checking it once raised
    OverflowError out of the daemon. Now that connection gets an error and is closed; the daemon serves on."""
    proc = start_daemon(sched_dir)
    body = _hello_body("1" + "0" * 399)
    assert len(_raw_frame(body)) > 400
    replies = _exchange(sched_dir, [_raw_frame(body)])
    assert [m["op"] for m in replies] == ["error"] and "weight" in replies[0]["msg"], replies
    assert proc.poll() is None, log_lines(sched_dir)[-10:]
    c = SchedulerClient("real", "r0", directory=sched_dir, autostart=False)
    assert c.connect(wait=10) and c.acquire("cpu0", 0)
    c.release("cpu0")
    c.close()


@pytest.mark.parametrize("weight", ["5e-324", "1e-300", "0.0009", "1000.5", "1e308"])
def test_a_weight_outside_the_sane_range_is_refused(sched_dir: str, weight: str) -> None:
    """Weight 5e-324 passed the (0, 1000] check; one turn later the job's virtual time was inf, the next
    status reply could not be encoded and the daemon exited. Weights are refused outside [1e-3, 1e3]; at the
    bounds, turns and status replies keep working (virtual times stay finite)."""
    proc = start_daemon(sched_dir)
    replies = _exchange(sched_dir, [_raw_frame(_hello_body(weight))])
    assert [m["op"] for m in replies] == ["error"] and "weight" in replies[0]["msg"], replies
    for w in (1e-3, 1e3):
        c = SchedulerClient(f"w{w:g}", "r0", weight=w, directory=sched_dir, autostart=False)
        assert c.connect(wait=10)
        for seq in range(3):
            assert c.acquire("cpu0", seq)
            c.release("cpu0")
        state = c.status()
        assert state is not None and all(v < 1e6 for v in state["devices"]["cpu0"]["vtime"].values()), state
        c.close()
    assert proc.poll() is None, log_lines(sched_dir)[-10:]


@pytest.mark.parametrize("weight", [5e-324, float("nan"), float("inf"), 0.0, 1e4])
def test_a_client_refuses_a_bad_weight_at_construction(sched_dir: str, weight: float) -> None:
    with pytest.raises(ValueError, match=r"weight.*between 0\.001 and 1000"):
        SchedulerClient("j", "m", weight=weight, directory=sched_dir, autostart=False)


def test_job_weight_nan_in_the_environment_is_refused_at_start(tmp_path: Path) -> None:
    """CROSSOVER_JOB_WEIGHT=nan crashed the job with "Out of range float values are not JSON compliant";
    now the session refuses it at start, naming the variable and the range."""
    code = f"""
        from horovod_ext import scheduling
        scheduling.enable(job="j", member="m", device="cpu0", directory={str(tmp_path / "s")!r})
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**ENV, "CROSSOVER_JOB_WEIGHT": "nan"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "CROSSOVER_JOB_WEIGHT" in r.stderr and "between 0.001 and 1000" in r.stderr, r.stderr
    assert "JSON compliant" not in r.stderr


@pytest.mark.parametrize("argv,env", [
    (["--lease", "inf"], {}), (["--lease", "nan"], {}), (["--lease", "0"], {}), (["--align-ms", "inf"], {}),
    (["--align-ms", "-1"], {}), (["--idle-exit", "nan"], {}), (["--hello-timeout", "inf"], {}),
    (["--nice", "99"], {}), ([], {"CROSSOVER_LEASE_S": "nan"}), ([], {"CROSSOVER_ALIGN_MS": "inf"}),
    ([], {"CROSSOVER_SCHED_IDLE_EXIT": "-5"}), ([], {"CROSSOVER_LEASE_S": "ten"}),
    ([], {"CROSSOVER_SCHED_NICE": "1e400"})],
    ids=["lease-inf", "lease-nan", "lease-0", "align-inf", "align-neg", "idle-nan", "hello-inf", "nice-99",
         "env-lease-nan", "env-align-inf", "env-idle-neg", "env-lease-word", "env-nice-huge"])
def test_every_numeric_daemon_setting_is_checked(sched_dir: str, argv: list[str], env: dict[str, str]) -> None:
    """--lease inf|nan, --align-ms inf and CROSSOVER_LEASE_S=nan started a daemon that crashed on its first
    welcome (or in select). Every numeric setting, on the command line or in the environment, is refused at
    start: exit 2 and a message naming the setting and its range."""
    idle = [] if "CROSSOVER_SCHED_IDLE_EXIT" in env else ["--idle-exit", "1"]  # the command line would win
    r = subprocess.run([sys.executable, "-m", "crossover.scheduler.daemon", "--dir", sched_dir, *idle, *argv],
                       env={**ENV, **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    name = argv[0] if argv else next(iter(env))
    assert name in r.stderr and "between" in r.stderr, r.stderr[-2000:]
    assert not daemons_for(sched_dir)


@pytest.mark.parametrize("opt,value", [("--lease", "inf"), ("--lease", "nan"), ("--align-ms", "inf"),
                                       ("--weights", "5e-324,1"), ("--weights", "nan,1"), ("--grace", "inf"),
                                       ("--cycle-time-ms", "nan"), ("-np", "0")])
def test_crossover_run_refuses_non_finite_settings(fake_run: Path, opt: str, value: str) -> None:
    r = subprocess.run(RUN + ["--dry-run", "-np", "1", opt, value, "job.py", "--", "job.py"], env=ENV,
                       cwd=str(fake_run), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "usage: crossover-run" in r.stderr and opt in r.stderr, r.stderr


def test_crossover_run_refuses_bad_scheduler_variables_in_its_environment(fake_run: Path) -> None:
    r = subprocess.run(RUN + ["--dry-run", "-np", "1", "job.py"], env={**ENV, "CROSSOVER_LEASE_S": "nan"},
                       cwd=str(fake_run), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "CROSSOVER_LEASE_S" in r.stderr, r.stdout + r.stderr


def test_a_daemon_that_dies_at_start_is_not_respawned_in_a_tight_loop(sched_dir: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A daemon that cannot start (here: a planted daemon.lock link) was started again every second by every
    worker while the jobs ran uncoordinated. Now the worker backs off (doubling the wait) and says why."""
    caplog.set_level(logging.INFO, logger="crossover.scheduler.client")
    os.symlink("/nonexistent-target", os.path.join(sched_dir, "daemon.lock"))
    c = SchedulerClient("j", "r0", directory=sched_dir, retry_s=0.1)
    assert c.connect(wait=1) is False
    t_end = time.monotonic() + 6
    seq = 0
    while time.monotonic() < t_end:
        assert c.acquire("cpu0", seq) is False  # uncoordinated, never blocked
        c.release("cpu0")
        seq += 1
        time.sleep(0.05)
    c.close()
    starts = Path(sched_dir, "daemon.log").read_text().count("cannot serve")
    assert 1 <= starts <= 4, f"{starts} daemons started in 7 s"
    assert "exited with status 2" in caplog.text and "daemon.lock is a symbolic link" in caplog.text
    assert "not starting another for" in caplog.text


def test_an_unexpected_error_in_one_message_closes_only_that_connection(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Whatever one client's message raises closes that connection (logged with its traceback) and the daemon
    serves on; only when the error left the scheduler's own state inconsistent does the daemon stop."""
    from crossover.scheduler import daemon as daemon_mod
    from crossover.scheduler.policy import _Device

    caplog.set_level(logging.INFO, logger="crossover.scheduler.daemon")
    d = daemon_mod.Daemon(str(tmp_path / "s"), idle_exit_s=0)
    assert d.start()
    socks = []
    try:
        def connect() -> tuple[socket.socket, object]:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(d.sock_path)
            socks.append(s)
            before = set(d._clients)
            d._accept()
            (cid,) = set(d._clients) - before
            return s, d._clients[cid]

        hello = encode({"op": "hello", "v": 1, "job": "j", "member": "m", "weight": 1.0, "pid": 1})
        real_hello = d.sched.hello
        s, c = connect()
        d.sched.hello = lambda *a: 1 / 0  # type: ignore[method-assign]
        s.sendall(hello)
        d._read(c)  # type: ignore[arg-type]
        assert c.cid not in d._clients  # type: ignore[attr-defined]
        (n,) = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))
        assert json.loads(s.recv(n, socket.MSG_WAITALL)) == {"op": "error", "msg": "internal error: ZeroDivisionError"}
        assert "ZeroDivisionError" in caplog.text and "Traceback" in caplog.text

        d.sched.hello = real_hello  # type: ignore[method-assign]
        s2, c2 = connect()
        s2.sendall(hello)
        d._read(c2)  # type: ignore[arg-type]
        assert d.sched.known(c2.cid)  # type: ignore[attr-defined]  # the daemon serves on

        def corrupting(*a: object) -> None:
            d.sched._devices["gpu9"] = _Device("elsewhere")  # a bug that leaves the state inconsistent
            raise KeyError("gpu9")

        s3, c3 = connect()
        d.sched.hello = corrupting  # type: ignore[method-assign]
        s3.sendall(hello)
        with pytest.raises(daemon_mod.InternalError, match="inconsistent"):
            d._read(c3)  # type: ignore[arg-type]
    finally:
        for s in socks:
            s.close()
        d.close()


def _flood(path: str, stop: threading.Event, first: bytes, then: bytes) -> None:
    """Until ``stop``: connect to the daemon, send ``first``, then ``then`` over and over (reading and dropping
    the replies); a new connection whenever the daemon closes one."""
    while not stop.is_set():
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1.0)
        try:
            s.connect(path)
            s.sendall(first)
            while not stop.is_set():
                if then:
                    s.sendall(then)
                s.recv(1 << 20)
        except OSError:
            time.sleep(0.001)  # closed by the daemon (or the daemon is gone): connect again
        finally:
            s.close()


def test_a_stop_signal_that_arrives_while_the_daemon_answers_clients_is_not_lost(sched_dir: str) -> None:
    """SIGTERM to a daemon busy answering clients: a pipelined stream of pings, hostile hellos (a 400-digit
    weight, an unknown op), a half hello frame left hanging. The stop, raised by the signal handler inside a
    client's message handler, used to be caught by the per-message 'unexpected error' handler: that connection
    was closed and the daemon ran on until its idle exit (60 s here). Now it exits at once."""
    proc = start_daemon(sched_dir, "--idle-exit", "60")
    path = paths.socket_path(sched_dir)
    hello = encode({"op": "hello", "v": 1, "job": "busy", "member": "m", "weight": 1.0, "pid": os.getpid()})
    pings = encode({"op": "ping", "id": 1}) * 2000
    half_hello = _raw_frame(_hello_body("1.0"))[:20]  # then nothing: the connection is left mid-message
    stop = threading.Event()
    floods = [threading.Thread(target=_flood, args=(path, stop, first, then), daemon=True)
              for first, then in ((hello, pings), (hello, pings), (_raw_frame(_hello_body("1" + "0" * 399)), b""),
                                  (_raw_frame(b'{"op":"nope"}'), b""), (half_hello, b""))]
    try:
        for t in floods:
            t.start()
        time.sleep(1.0)  # the daemon is busy with their messages
        assert proc.poll() is None, log_lines(sched_dir)[-10:]
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the daemon ran on after SIGTERM: {log_lines(sched_dir)[-5:]}") from None
    finally:
        stop.set()
        for t in floods:
            t.join(10)
    assert code == 0 and time.monotonic() - t0 < 2.0, (code, log_lines(sched_dir)[-5:])
    assert any("signal received: exiting" in x for x in log_lines(sched_dir))
    assert not any("internal error" in x or "unexpected error" in x for x in log_lines(sched_dir))


def test_clients_stalled_mid_message_neither_lock_workers_out_nor_stay(sched_dir: str) -> None:
    """Same-user clients that say hello and then stop in the middle of a message filled the daemon for good.
    Now a newcomer takes the place of the oldest stalled one when the daemon is full, and a stalled
    connection is closed after --read-timeout anyway."""
    start_daemon(sched_dir, "--max-clients", "20", "--read-timeout", "30")
    hello = encode({"op": "hello", "v": 1, "job": "stall", "member": "m", "weight": 1.0, "pid": os.getpid()})
    stalled = _sent(sched_dir, 20, hello + b"\x00\x00")  # half of the next frame's header, then nothing
    try:
        time.sleep(0.5)
        real = SchedulerClient("real", "r0", directory=sched_dir, autostart=False)
        assert real.connect(wait=10), log_lines(sched_dir)[-5:]
        assert real.acquire("cpu0", 0)
        real.release("cpu0")
        real.close()
        assert any("stopped in the middle of a message and the daemon is full" in x for x in log_lines(sched_dir))
    finally:
        for s in stalled:
            s.close()

    sched_harness.kill_daemons(sched_dir)
    os.unlink(paths.socket_path(sched_dir))
    start_daemon(sched_dir, "--read-timeout", "0.5")
    (s,) = _sent(sched_dir, 1, hello + b"\x00\x00\x00", timeout=10)
    t0 = time.monotonic()
    (n,) = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))
    assert json.loads(s.recv(n, socket.MSG_WAITALL))["op"] == "welcome"
    (n,) = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))
    assert "stopped in the middle of a message" in json.loads(s.recv(n, socket.MSG_WAITALL))["msg"]
    assert s.recv(10) == b"" and time.monotonic() - t0 < 5
    s.close()


def test_the_daemon_runs_on_every_allowed_cpu_whoever_started_it(sched_dir: str) -> None:
    """A daemon started on demand by a worker pinned to one core kept that core only (docs: all cores)."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    code = f"""
        import os
        os.sched_setaffinity(0, {{{min(allowed)}}})
        from crossover.scheduler.client import SchedulerClient
        c = SchedulerClient("pinned", "r0", directory={sched_dir!r})
        assert c.connect(wait=20)
        print(c.daemon_pid)
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=ENV, capture_output=True, text=True,
                       timeout=60, check=True)
    pid = int(r.stdout.strip())
    assert os.sched_getaffinity(pid) == allowed


# --------------------------------------------------------------------------- 8. paths swapped while a run goes on

OTHER_UID = 4242  # stands for another user: the owner of the planted links (os.lchown), no account needed


@pytest.fixture
def shared() -> Iterator[Path]:
    """A shared, sticky folder like /tmp, removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="xo-sh-", dir="/tmp"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _planted_link(link: Path, target: Path) -> None:
    os.symlink(target, link)
    os.lchown(link, OTHER_UID, OTHER_UID)


def test_a_telemetry_dir_through_another_users_link_is_refused(fake_run: Path, shared: Path, tmp_path: Path) -> None:
    """--telemetry-dir through a link another user made in a sticky folder: the old owner check resolved the
    real path first (root's folder: fine) and never saw the link, which its owner can re-point at any time."""
    target = tmp_path / "roots-folder"
    target.mkdir()
    _planted_link(shared / "tel", target)
    proc = _crossover_run(fake_run, "--telemetry-dir", str(shared / "tel"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    assert f"symbolic link that belongs to uid {OTHER_UID}" in err and str(shared / "tel") in err
    assert list(target.iterdir()) == []


def test_a_timeline_link_swapped_mid_run_never_redirects_the_report(fake_run: Path, shared: Path,
                                                                      tmp_path: Path) -> None:
    """--timeline LINK/timeline.json, LINK another user's: it pointed at a harmless folder when the run
    started and at a folder with root's timeline.json by the end; the report overwrote root's file. Now
    the folder is opened and checked at start: refused, and nothing is written."""
    harmless, precious = tmp_path / "harmless", tmp_path / "precious"
    harmless.mkdir()
    precious.mkdir()
    (precious / "timeline.json").write_text("root's data\n")
    link = shared / "out"
    _planted_link(link, harmless)
    swap = fake_run / "horovodrun-swap"
    swap.write_text((fake_run / "horovodrun").read_text() + textwrap.dedent(f"""
        os.unlink({str(link)!r})  # the other user re-points the link while the job runs
        os.symlink({str(precious)!r}, {str(link)!r})
        os.lchown({str(link)!r}, {OTHER_UID}, {OTHER_UID})
    """))
    swap.chmod(0o755)
    proc = subprocess.Popen(RUN + ["--horovodrun", str(swap), "-np", "1", "--telemetry-dir", str(fake_run / "tel"),
                                   "--timeline", str(link / "timeline.json"), "job.py"], env=ENV, cwd=str(fake_run),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert (precious / "timeline.json").read_text() == "root's data\n"
    assert proc.returncode == 2, out + err
    assert f"belongs to uid {OTHER_UID}" in err
    assert list(harmless.iterdir()) == []


def test_the_daemon_trace_never_goes_through_another_users_link(sched_dir: str, shared: Path,
                                                                tmp_path: Path) -> None:
    target = tmp_path / "roots-folder"
    target.mkdir()
    _planted_link(shared / "trace", target)
    r = subprocess.run([sys.executable, "-m", "crossover.scheduler.daemon", "--dir", sched_dir, "--idle-exit", "1"],
                       env={**ENV, "CROSSOVER_SCHED_TRACE": str(shared / "trace" / "events.jsonl")},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"belongs to uid {OTHER_UID}" in r.stderr
    assert list(target.iterdir()) == []


def test_a_worker_never_writes_telemetry_through_another_users_link(shared: Path, tmp_path: Path) -> None:
    from crossover.scheduler.telemetry import Recorder

    target = tmp_path / "roots-folder"
    target.mkdir()
    _planted_link(shared / "tel", target)
    with pytest.raises(paths.SchedulerDirError, match=f"belongs to uid {OTHER_UID}"):
        Recorder(str(shared / "tel"), "j", "r0", "h", "cpu0")
    assert list(target.iterdir()) == []


def test_run_files_are_private_and_the_temporary_folder_is_removed(fake_run: Path) -> None:
    """Telemetry was world-readable (0644 files in a 0755 folder) and /tmp/crossover-run-* folders stayed."""
    proc = _crossover_run(fake_run, "--telemetry-dir", str(fake_run / "tel"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    (run,) = (fake_run / "tel").iterdir()
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    files = list(run.iterdir())
    assert {p.suffix for p in files} == {".jsonl", ".json"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), [(p.name, oct(p.stat().st_mode)) for p in files]

    proc = _crossover_run(fake_run)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    tmp = re.search(r"telemetry in (\S+)", out).group(1)  # type: ignore[union-attr]
    assert os.path.basename(tmp).startswith("crossover-run-") and not os.path.exists(tmp)
    assert "busy" in out  # the summary was printed before the folder went
