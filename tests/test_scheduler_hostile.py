"""The scheduler against a hostile local user, descriptor exhaustion and a hung daemon (issue 15).

Real processes throughout: the daemon, clients, ``crossover-run`` (with a stand-in ``horovodrun`` that
writes one rank's telemetry, so no Horovod start-up) and, when the tests run as root, a second Unix user
created for the test (``useradd``) that plays the attacker; without root those tests are skipped with
that reason. About 20 seconds in all (18 s measured on the shared 2-core machine).
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import sched_harness
from sched_harness import ENV, daemons_for, start_daemon

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
    (d / "job.py").write_text("raise SystemExit('never run: the stand-in horovodrun does not start it')\n")
    fake = d / "horovodrun"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""
        import os, time
        from crossover.scheduler.telemetry import Recorder
        r = Recorder(os.environ["CROSSOVER_TELEMETRY_DIR"], os.environ["CROSSOVER_JOB"], "rank0", "localhost", "cpu")
        t = time.time()
        for i in range(3):
            r.span("compute", t + i, t + i + 0.5)
            r.span("wait_comm", t + i + 0.5, t + i + 1)
            r.step(i, t + i + 1, 0.5, 0.0, 0.5)
        r.close()
        time.sleep(0.5)  # two runs started together overlap
    """))
    fake.chmod(0o755)
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


def test_accept_backs_off_when_descriptors_run_out(sched_dir: str) -> None:
    """With a connection cap above the descriptor limit (a test-only option), accept fails with EMFILE once
    workers that said hello hold every descriptor: the daemon pauses accepting instead of spinning, logs a
    few lines, and serves the queued connections as soon as descriptors are free again."""
    proc = start_daemon(sched_dir, "--hello-timeout", "30", "--max-clients", "1000", nofile=64)
    hello = encode({"op": "hello", "v": 1, "job": "idle", "member": "m", "weight": 1.0, "pid": os.getpid()})
    conns = []
    for _ in range(80):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(paths.socket_path(sched_dir))
        s.sendall(hello)
        conns.append(s)
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
        assert {j: v["workers"] for j, v in summary["jobs"].items()} == {"job0": 1, "job1": 1}
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
