"""The scheduler daemon as a real process, with real clients (no Horovod): on-demand start, turns,
lease time-out, dead clients, a dead daemon, 10 000 malformed messages, and the round-trip time.

Runs in about 20 seconds."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import sched_harness
from sched_harness import ENV, daemons_for

from crossover.scheduler import paths
from crossover.scheduler.client import SchedulerClient
from crossover.scheduler.protocol import MAX_MESSAGE, encode


def daemon_pid(d: str) -> int | None:
    try:
        text = Path(d, paths.LOCK_NAME).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


@pytest.fixture
def sched_dir() -> Iterator[str]:
    yield from sched_harness.scratch_dir("xo-t-")


def start_daemon(d: str, *args: str) -> subprocess.Popen[bytes]:
    """A daemon for ``d`` that traces its decisions to ``d/trace.jsonl``."""
    return sched_harness.start_daemon(d, "--trace", os.path.join(d, "trace.jsonl"), *args, timeout=10)


def client(d: str, job: str, member: str = "r0", **kw: object) -> SchedulerClient:
    c = SchedulerClient(job, member, directory=d, **kw)  # type: ignore[arg-type]
    assert c.connect(wait=10)
    return c


def trace(d: str) -> list[dict]:
    return [json.loads(line) for line in Path(d, "trace.jsonl").read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- start and security


def test_started_on_demand_once_even_when_racing(sched_dir: str) -> None:
    code = textwrap.dedent(f"""
        from crossover.scheduler.client import SchedulerClient
        c = SchedulerClient("job", "m", directory={sched_dir!r})
        assert c.connect(wait=20)
        print(c.daemon_pid)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    pids = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(pids) == 1, pids  # every racer reached the same daemon
    (pid,) = pids
    time.sleep(0.3)  # the daemons that lost the race exit at once
    assert daemons_for(sched_dir) == [int(pid)]
    assert daemon_pid(sched_dir) == int(pid)
    assert stat.S_IMODE(os.stat(sched_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(paths.socket_path(sched_dir)).st_mode) == 0o600


# --------------------------------------------------------------------------- turns


def test_turns_never_overlap_between_processes(sched_dir: str) -> None:
    start_daemon(sched_dir)
    spans: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}

    def worker(job: str) -> None:
        c = client(sched_dir, job)
        for seq in range(30):
            assert c.acquire("cpu0", seq)
            t0 = time.time()
            time.sleep(0.003)
            t1 = time.time()
            c.release("cpu0")
            spans[job].append((t0, t1))
            time.sleep(0.004)  # "communication": the other job's turn
        c.close()

    threads = [threading.Thread(target=worker, args=(j,)) for j in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    merged = sorted([(a, b, "A") for a, b in spans["A"]] + [(a, b, "B") for a, b in spans["B"]])
    for (_, b0, _), (a1, _, _) in zip(merged, merged[1:]):
        assert b0 <= a1, "two jobs computed at once"
    switches = sum(x[2] != y[2] for x, y in zip(merged, merged[1:]))
    assert switches >= 40  # mostly alternating (60 turns)


def test_lease_timeout_hands_over(sched_dir: str) -> None:
    start_daemon(sched_dir, "--lease", "0.5")
    a, b = client(sched_dir, "A"), client(sched_dir, "B")
    assert a.acquire("cpu0", 0)
    t0 = time.monotonic()
    assert b.acquire("cpu0", 0)  # A never releases: B gets the device after the lease
    waited = time.monotonic() - t0
    assert 0.4 <= waited <= 3.0, waited
    a.release("cpu0")  # late: ignored, B keeps its turn
    state = a.status()
    assert state is not None and state["devices"]["cpu0"]["turn"]["job"] == "B"
    done = threading.Event()
    threading.Thread(target=lambda: (a.acquire("cpu0", 1), done.set()), daemon=True).start()
    assert not done.wait(0.2)  # A waits for B like anyone else
    b.release("cpu0")
    assert done.wait(5)
    assert "lease expired" in Path(sched_dir, "daemon.log").read_text()
    assert any(e["ev"] == "end" and e.get("why") == "lease expired" for e in trace(sched_dir))


def test_a_dead_client_releases_at_once(sched_dir: str) -> None:
    start_daemon(sched_dir, "--lease", "60")
    code = textwrap.dedent(f"""
        import time
        from crossover.scheduler.client import SchedulerClient
        c = SchedulerClient("A", "r0", directory={sched_dir!r})
        assert c.connect(wait=10) and c.acquire("cpu0", 0)
        print("held", flush=True)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        b = client(sched_dir, "B")
        got = threading.Event()
        threading.Thread(target=lambda: (b.acquire("cpu0", 0), got.set()), daemon=True).start()
        assert not got.wait(0.3)
        t0 = time.monotonic()
        holder.send_signal(signal.SIGKILL)
        assert got.wait(5)
        assert time.monotonic() - t0 < 2.0
    finally:
        holder.kill()
        holder.wait()


def test_daemon_death_then_reattach(sched_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="crossover.scheduler.client")
    os.environ["CROSSOVER_SCHED_TRACE"] = os.path.join(sched_dir, "trace.jsonl")
    try:
        c = client(sched_dir, "A", retry_s=0.2)  # starts the daemon itself
        first = c.daemon_pid
        assert first and c.acquire("cpu0", 0)
        c.release("cpu0")
        os.kill(first, signal.SIGKILL)
        time.sleep(0.2)
        assert c.acquire("cpu0", 1) is False  # goes on, uncoordinated
        assert "continuing uncoordinated" in caplog.text
        deadline = time.monotonic() + 15
        while not c.acquire("cpu0", 2):
            assert time.monotonic() < deadline, "never re-attached"
            time.sleep(0.1)
        assert c.daemon_pid not in (None, first)  # a new daemon, started by the client
        assert "re-attached" in caplog.text
        c.release("cpu0")
        c.close()
    finally:
        del os.environ["CROSSOVER_SCHED_TRACE"]
    starts = {e["daemon"] for e in trace(sched_dir) if e["ev"] == "start"}
    assert len(starts) == 2, (Path(sched_dir, "trace.jsonl").read_text(), Path(sched_dir, "daemon.log").read_text())


# --------------------------------------------------------------------------- hostile input


def _random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.randrange(-2 ** 60, 2 ** 60)
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-5, 300)
    if kind == 2:
        return "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(0, 40)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.choice(["hello", "acquire", "release", "ping", "status", "grant", ""])
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["op", "v", "job", "member", "weight", "pid", "id", "dev", "seq", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(6))}


def _bad_message(rng: random.Random) -> bytes:
    """One malformed or hostile message (possibly after a valid hello)."""
    hello = encode({"op": "hello", "v": 1, "job": "fuzz", "member": "f", "weight": 1.0, "pid": 1})
    kind = rng.randrange(7)
    if kind == 0:  # random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 1:  # a frame of random JSON
        body = json.dumps(_random_json(rng)).encode()[:MAX_MESSAGE]
        return struct.pack("!I", len(body)) + body
    if kind == 2:  # hello, then random JSON
        body = json.dumps(_random_json(rng)).encode()[:MAX_MESSAGE]
        return hello + struct.pack("!I", len(body)) + body
    if kind == 3:  # absurd length
        return struct.pack("!I", rng.choice([0, MAX_MESSAGE + 1, 2 ** 32 - 1])) + b"{}"
    if kind == 4:  # request before hello
        return encode({"op": "acquire", "id": 1, "dev": "cpu0", "seq": 0})
    if kind == 5:  # valid hello + acquire of a fuzz device, then a contradiction (acquire twice)
        a = encode({"op": "acquire", "id": 1, "dev": f"fz{rng.randrange(3)}", "seq": 0})
        return hello + a + a + a
    return hello + hello  # hello twice


def test_ten_thousand_malformed_messages(sched_dir: str) -> None:
    start_daemon(sched_dir, "--lease", "2")
    pid = daemon_pid(sched_dir)
    good = client(sched_dir, "good")
    stop = threading.Event()
    cycles = [0]
    failures: list[str] = []

    def good_loop() -> None:
        seq = 0
        while not stop.is_set():
            if not good.acquire("cpu0", seq):
                failures.append("acquire failed")
                return
            good.release("cpu0")
            seq += 1
            cycles[0] += 1

    t = threading.Thread(target=good_loop)
    t.start()
    rng = random.Random(1234)
    sock_path = paths.socket_path(sched_dir)
    slow = []
    for _ in range(50):  # slow-loris: half a frame, kept open during the storm
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        s.sendall(struct.pack("!I", 100) + b'{"op":')
        slow.append(s)
    sent = 0
    while sent < 10_000:
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        try:
            s.sendall(_bad_message(rng))
            s.shutdown(socket.SHUT_WR)
            s.settimeout(5)
            while s.recv(4096):
                pass  # the daemon answers with an error (or nothing) and closes
        except OSError:
            pass
        finally:
            s.close()
        sent += 1
    # a client that never reads its replies is cut off, others are not
    hog = socket.socket(socket.AF_UNIX)
    hog.connect(sock_path)
    hog.settimeout(10)
    hello = encode({"op": "hello", "v": 1, "job": "hog", "member": "h", "weight": 1.0, "pid": 1})
    with pytest.raises(OSError):
        hog.sendall(hello + encode({"op": "ping", "id": 1}) * 100_000)
        hog.sendall(encode({"op": "ping", "id": 1}) * 100_000)
    hog.close()
    for s in slow:
        s.close()
    time.sleep(0.2)
    stop.set()
    t.join(10)
    assert not failures and cycles[0] > 100, (failures, cycles)
    assert daemon_pid(sched_dir) == pid and daemons_for(sched_dir) == [pid]
    fresh = client(sched_dir, "fresh")
    assert fresh.acquire("cpu0", 0)
    fresh.release("cpu0")
    state = fresh.status()
    assert state is not None and state["connections"] == 2  # good + fresh: nothing leaked
    assert sorted(state["devices"]) == ["cpu0"]
    deadline = time.monotonic() + 10  # the count of rate-limited lines is written within a second or so
    while True:
        log_text = Path(sched_dir, "daemon.log").read_text()
        closed = len(re.findall(r"closing connection \d+", log_text))  # logged, or counted when rate-limited
        closed += sum(int(n) for n in re.findall(r"(\d+) more 'closing connection' messages suppressed", log_text))
        if closed >= 5_000 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert closed >= 5_000  # the rest were incomplete frames (EOF)
    assert log_text.count("\n") < 2_000  # rate-limited: no line per connection
    print(f"\n10 000 malformed messages sent; the good client did {cycles[0]} acquire/release cycles meanwhile; "
          f"{closed} connections closed with an error, in {log_text.count(chr(10))} log lines")


# --------------------------------------------------------------------------- glue (no Horovod job)


def test_crossover_turn_context_manager(sched_dir: str, tmp_path: Path) -> None:
    from horovod_ext import scheduling

    start_daemon(sched_dir)
    other = client(sched_dir, "other")
    s = scheduling.enable(job="mine", member="r0", device="cpu7", directory=sched_dir,
                          telemetry_dir=str(tmp_path))
    try:
        assert s.coordinated
        with scheduling.crossover_turn():
            state = other.status()
            assert state is not None and state["devices"]["cpu7"]["turn"]["job"] == "mine"
            with scheduling.crossover_turn():  # re-entrant
                pass
            assert s.held
        assert not s.held
        assert s.client is not None and s.client.ping() is not None  # our release is processed
        state = other.status()
        assert state is not None and state["devices"]["cpu7"]["turn"] is None
        assert other.acquire("cpu7", 0)  # the device is free for the other job
        got = threading.Event()
        threading.Thread(target=lambda: (scheduling.crossover_turn().__enter__(), got.set()), daemon=True).start()
        assert not got.wait(0.2)  # ours waits for the other job's turn
        other.release("cpu7")
        assert got.wait(5)
    finally:
        scheduling.disable()
    (stream,) = __import__("crossover.scheduler.telemetry", fromlist=["load"]).load(str(tmp_path))
    assert stream.job == "mine" and stream.dev == "cpu7" and len(stream.spans["compute"]) >= 2
    assert len(stream.steps) >= 1


def test_launcher_patches_horovod_torch_on_import(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import sys
        assert "horovod.torch" not in sys.modules  # nothing imported early
        import horovod.torch as hvd
        import horovod.torch.optimizer as o
        from horovod_ext import scheduling
        print(hvd.synchronize is scheduling._synchronize_handle,
              o._DistributedOptimizer.synchronize is scheduling._optimizer_synchronize,
              sys.argv[1:], __name__)
    """))
    r = subprocess.run([sys.executable, "-m", "horovod_ext.launch", str(script), "--x", "1"],
                       env={**ENV, "CROSSOVER_SCHED": "1"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True True ['--x', '1'] __main__"
    r = subprocess.run([sys.executable, "-m", "horovod_ext.launch", str(script)],
                       env={**ENV, "CROSSOVER_SCHED": "0"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("False False")


def test_a_forked_child_neither_holds_nor_writes(sched_dir: str, tmp_path: Path) -> None:
    from crossover.scheduler import telemetry
    from crossover.scheduler.telemetry import Recorder

    start_daemon(sched_dir)
    c = client(sched_dir, "A")
    rec = Recorder(str(tmp_path), "A", "r0", "h", "cpu0")
    rec.span("compute", 1.0, 2.0)
    assert c.acquire("cpu0", 0)
    pid = os.fork()
    if pid == 0:  # child: must not touch the parent's connection or telemetry
        ok = c.acquire("cpu0", 1) is False and c.ping() is None
        rec.span("compute", 5.0, 6.0)
        rec.close()
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
    b = client(sched_dir, "B")
    got = threading.Event()
    threading.Thread(target=lambda: (b.acquire("cpu0", 0), got.set()), daemon=True).start()
    assert not got.wait(0.3)  # the parent still holds the device after its child exited
    c.close()  # the parent "dies": released at once
    assert got.wait(5)
    rec.close()
    (stream,) = telemetry.load(str(tmp_path))
    assert stream.spans["compute"] == [(1.0, 2.0)]


def test_a_stop_that_arrives_while_a_message_is_handled_is_not_lost(sched_dir: str) -> None:
    """SIGTERM raised inside a client's message handler (the signal arriving mid-answer) used to be caught by the
    per-message error handler: the connection closed and the daemon ran on until its idle exit."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        from crossover.scheduler import daemon
        handle = daemon.Daemon._handle
        def signalled(self, c, msg):
            os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode: inside the handler
            return handle(self, c, msg)
        daemon.Daemon._handle = signalled
        sys.exit(daemon.main(["--dir", {sched_dir!r}, "--idle-exit", "30"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(paths.socket_path(sched_dir)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        c = SchedulerClient("job", "m", directory=sched_dir, autostart=False)
        c.connect(wait=5)  # its hello is the message during which the signal arrives
        assert proc.wait(timeout=5) == 0  # the stop took effect at once, not at the idle exit (30 s)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_stop_signal_while_the_daemon_stops_is_not_an_error(sched_dir: str) -> None:
    """SIGTERM twice (a second Ctrl-C, a process group signalled twice): the second one, arriving while the loop
    unwinds from the first, raised the stop again out of the event loop: a traceback and exit status 1."""
    code = textwrap.dedent(f"""
        import os, signal, sys
        from crossover.scheduler import daemon
        info = daemon.log.info
        def twice(msg, *args):
            if msg.startswith("signal received"):
                os.kill(os.getpid(), signal.SIGTERM)  # the second signal, delivered while the first is handled
            info(msg, *args)
        daemon.log.info = twice
        sys.exit(daemon.main(["--dir", {sched_dir!r}, "--idle-exit", "30"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(paths.socket_path(sched_dir)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=5)
        assert proc.returncode == 0 and "Traceback" not in err, err
        assert "stopped" in err  # and it cleaned up
        assert not os.path.exists(paths.socket_path(sched_dir))
    finally:
        if proc.poll() is None:
            proc.kill()
