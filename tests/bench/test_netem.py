"""Tests of benchmarks.netem: shaped namespaces, an emulated cluster, and Horovod over it.

The checks that build namespaces need root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and skip with
`netem_unavailable_reason()` otherwise. Rates are checked with real TCP streams; total runtime is
about half a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import netem

REPO = Path(__file__).resolve().parents[2]
RATE = "200mbit"
RATE_BITS = 200e6


@pytest.fixture
def need_netem() -> None:
    reason = netem.netem_unavailable_reason()
    if reason:
        pytest.skip(reason)


def ours(pid: int | None = None) -> list[str]:
    """Namespaces created by this test process (or by process ``pid``)."""
    return netem.list_namespaces(f"{netem.NS_PREFIX}{pid or os.getpid()}-")


def assert_clean(pid: int | None = None) -> None:
    assert ours(pid) == []
    prefix = f"{netem.NS_PREFIX}{pid or os.getpid()}-"
    if os.path.isdir("/etc/netns"):
        assert [d for d in os.listdir("/etc/netns") if d.startswith(prefix)] == []


def assert_dead(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} is still alive")


# --------------------------------------------------------------------------- no root needed


def test_parse_units() -> None:
    assert netem.parse_rate("200mbit") == 200e6
    assert netem.parse_rate("1gbit") == 1e9
    assert netem.parse_rate("10mbps") == 80e6  # tc: bps = bytes per second
    assert netem.parse_rate("1.5Gbit") == 1.5e9
    assert netem.parse_time("1ms") == pytest.approx(1e-3)
    assert netem.parse_time("250us") == pytest.approx(250e-6)
    assert netem.parse_time(0.5) == 0.5
    for bad in ("fast", "10 parsecs", "-1mbit"):
        with pytest.raises(ValueError):
            netem.parse_rate(bad)
    with pytest.raises(ValueError):
        netem.parse_time("soon")


def test_unavailable_reason_is_none_or_text() -> None:
    reason = netem.netem_unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason)


def test_cli_help() -> None:
    res = subprocess.run([sys.executable, "-m", "benchmarks.netem", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for flag in ("--rate", "--delay", "--hosts", "-np", "--procs-per-host", "--measure", "--version"):
        assert flag in res.stdout
    assert res.stdout.startswith("usage: crossover-netem ") and "python -m benchmarks" not in res.stdout


def test_cli_version_and_np() -> None:
    import crossover
    from benchmarks.netem import cli

    res = subprocess.run([sys.executable, "-m", "benchmarks.netem", "--version"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"crossover-netem {crossover.__version__}", res
    for flag in ("-np", "--np", "--procs-per-host"):
        assert cli._build_parser().parse_args([flag, "3", "--", "true"]).procs_per_host == 3


# --------------------------------------------------------------------------- shaped loopback


@pytest.mark.netem
def test_run_shaped_tcp_rate(need_netem: None) -> None:
    code = ("from benchmarks.netem import measure_tcp_throughput as m; "
            "print(m([([], [], '127.0.0.1')], seconds=2.0)[0])")
    res = netem.run_shaped([sys.executable, "-c", code], rate=RATE, timeout=60,
                           capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    rate = float(res.stdout.strip().splitlines()[-1])
    print(f"run_shaped loopback at {RATE}: {rate / 1e6:.1f} Mbit/s")
    assert 0.90 * RATE_BITS <= rate <= 1.05 * RATE_BITS
    assert_clean()


@pytest.mark.netem
def test_run_shaped_passes_exit_code_and_cleans_up(need_netem: None) -> None:
    res = netem.run_shaped(["sh", "-c", "ip -o link show lo; exit 3"], rate=RATE,
                           capture_output=True, text=True)
    assert res.returncode == 3
    assert "mtu 9000" in res.stdout and "tbf" in res.stdout  # really ran inside the shaped namespace
    assert_clean()
    with pytest.raises(subprocess.CalledProcessError):
        netem.run_shaped(["false"], check=True)
    assert_clean()


@pytest.mark.netem
def test_run_shaped_timeout_kills_group_and_cleans_up(need_netem: None) -> None:
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        netem.run_shaped(["sh", "-c", "sleep 60 & echo $!; echo $$; wait"], timeout=1.5,
                         capture_output=True, text=True)
    assert time.monotonic() - start < 15
    pids = [int(tok) for tok in info.value.output.split()]
    assert len(pids) == 2
    for pid in pids:  # the shell and its background child
        assert_dead(pid)
    assert_clean()


@pytest.mark.netem
def test_keyboard_interrupt_cleans_up(need_netem: None) -> None:
    # SIGINT may be ignored when inherited from a non-interactive parent (CI): restore Python's handler
    code = ("import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from benchmarks.netem import run_shaped\n"
            "try:\n    run_shaped(['sleep', '60'])\nexcept KeyboardInterrupt:\n    raise SystemExit(130)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        deadline = time.monotonic() + 20
        while not ours(proc.pid):
            assert time.monotonic() < deadline, "namespace never appeared"
            assert proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_clean(proc.pid)


CONNECT_TIME = (
    "import socket, sys, time\n"
    "addr = sys.argv[1]\n"
    "best = 1e9\n"
    "for _ in range(5):\n"
    "    t0 = time.perf_counter()\n"
    "    s = socket.create_connection((addr, int(sys.argv[2])), timeout=10)\n"
    "    best = min(best, time.perf_counter() - t0)\n"
    "    s.close()\n"
    "print(best)\n"
)
LOOPBACK_CONNECT_TIME = (
    "import socket, time\n"
    "srv = socket.create_server(('127.0.0.1', 0), backlog=16)\n"
    "best = 1e9\n"
    "for _ in range(5):\n"
    "    t0 = time.perf_counter()\n"
    "    s = socket.create_connection(srv.getsockname(), timeout=10)\n"
    "    best = min(best, time.perf_counter() - t0)\n"
    "    s.close()\n"
    "    srv.accept()[0].close()\n"
    "print(best)\n"
)
LISTEN = (
    "import socket\n"
    "srv = socket.create_server(('0.0.0.0', 0), backlog=16)\n"
    "print(srv.getsockname()[1], flush=True)\n"
    "while True:\n"
    "    srv.accept()[0].close()\n"
)


@pytest.mark.netem
def test_delay(need_netem: None) -> None:
    """delay= adds that one-way latency (a TCP connect takes one round trip = 2 x delay)."""
    reason = netem.netem_unavailable_reason(delay=True)
    if reason:  # this kernel has no netem: asking for a delay must fail cleanly
        with pytest.raises(netem.NetemError, match="netem"):
            netem.EmulatedCluster(2, RATE, delay="5ms")
        with pytest.raises(netem.NetemError, match="netem"):
            netem.run_shaped(["true"], delay="5ms")
        assert_clean()
        pytest.skip(reason)
    res = netem.run_shaped([sys.executable, "-c", LOOPBACK_CONNECT_TIME], rate="1gbit", delay="5ms",
                           timeout=60, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert 0.009 <= float(res.stdout.split()[-1]) <= 0.05
    with netem.EmulatedCluster(2, "1gbit", delay="5ms") as cluster:
        srv = cluster.popen(1, [sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
        assert srv.stdout is not None
        port = srv.stdout.readline().strip()
        res = cluster.run(0, [sys.executable, "-c", CONNECT_TIME, cluster.addresses[1], port],
                          timeout=60, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert 0.009 <= float(res.stdout.split()[-1]) <= 0.05
    assert_clean()


# --------------------------------------------------------------------------- emulated cluster


@pytest.mark.netem
def test_cluster_rate_and_full_duplex(need_netem: None) -> None:
    with netem.EmulatedCluster(2, RATE) as cluster:
        assert len(cluster.hosts) == 2 and len(set(cluster.hosts)) == 2
        assert cluster.addresses == ["10.77.0.1", "10.77.0.2"]
        assert cluster.exec_prefix(1) == ["ip", "netns", "exec", cluster.hosts[1]]
        assert set(cluster.hosts) <= set(ours())
        res = cluster.run(0, ["ip", "-o", "addr", "show", "dev", "eth0"], capture_output=True, text=True)
        assert "10.77.0.1/24" in res.stdout

        (one,) = netem.measure_tcp_throughput([cluster.flow(0, 1)], seconds=2.0)
        fwd, back = netem.measure_tcp_throughput([cluster.flow(0, 1), cluster.flow(1, 0)], seconds=2.0)
        print(f"cluster at {RATE}: host0->host1 {one / 1e6:.1f} Mbit/s; both directions at once "
              f"{fwd / 1e6:.1f} and {back / 1e6:.1f} Mbit/s")
        assert 0.90 * RATE_BITS <= one <= 1.05 * RATE_BITS
        # full duplex: each direction gets the full rate while the other one is busy
        assert 0.85 * RATE_BITS <= fwd <= 1.05 * RATE_BITS
        assert 0.85 * RATE_BITS <= back <= 1.05 * RATE_BITS
    assert_clean()


@pytest.mark.netem
def test_cluster_cleans_up_on_error(need_netem: None) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with netem.EmulatedCluster(3, "1gbit") as cluster:
            proc = cluster.popen(2, ["sleep", "60"])
            assert len(ours()) == 4  # 3 hosts + the switch
            raise RuntimeError("boom")
    assert_dead(proc.pid)
    assert_clean()


# --------------------------------------------------------------------------- Horovod over the cluster


ALLREDUCE = textwrap.dedent("""
    import json, sys, time
    import torch
    import horovod.torch as hvd

    hvd.init()
    n = int(sys.argv[1])
    x = torch.full((n,), float(hvd.rank() + 1))
    hvd.allreduce(torch.ones(16), op=hvd.Sum, name="warmup")
    t0 = time.perf_counter()
    y = hvd.allreduce(x, op=hvd.Sum, name="big")
    seconds = time.perf_counter() - t0
    expected = hvd.size() * (hvd.size() + 1) / 2
    print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "cross_size": hvd.cross_size(),
                      "ok": bool((y == expected).all()), "seconds": seconds, "bytes": 4 * n}))
""")


@pytest.mark.netem
def test_horovod_allreduce_crosses_shaped_links(need_netem: None, tmp_path: Path) -> None:
    pytest.importorskip("horovod.torch")
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    n = 6_250_000  # 25 MB of float32: about 1 s at 200 Mbit/s with 2 ranks
    with netem.EmulatedCluster(2, RATE) as cluster:
        results = netem.launch_horovod(cluster, 1, [sys.executable, str(script), str(n)], timeout=120)
        link_bytes = [cluster.link_bytes(i) for i in range(2)]
    assert_clean()
    assert [r.returncode for r in results] == [0, 0], netem.format_rank_output(results)
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    assert [rep["rank"] for rep in reports] == [0, 1]
    assert all(rep["ok"] and rep["size"] == 2 and rep["cross_size"] == 2 for rep in reports)
    # the whole 25 MB buffer went up and down each host's shaped link (tc counters)
    for up, down in link_bytes:
        assert 4 * n <= up < 1.2 * 4 * n + 5e6 and 4 * n <= down < 1.2 * 4 * n + 5e6, link_bytes
    # A 2-rank ring allreduce sends the whole buffer once over each direction of the link, so
    # bytes / time is close to the link rate when the traffic really crosses the shaped links
    # (unshaped loopback does several Gbit/s here).
    seconds = max(rep["seconds"] for rep in reports)
    algbw = reports[0]["bytes"] * 8 / seconds
    print(f"Horovod 2-rank allreduce of 25 MB over {RATE}: {seconds:.2f} s = {algbw / 1e6:.0f} Mbit/s")
    assert 0.5 * RATE_BITS <= algbw <= 1.05 * RATE_BITS


@pytest.mark.netem
def test_launch_horovod_timeout_and_failure(need_netem: None) -> None:
    hang = [sys.executable, "-c",
            "import os, time; print('hello from rank', os.environ['HOROVOD_RANK'], "
            "os.environ['HOROVOD_HOSTNAME']); time.sleep(60)"]
    fail = [sys.executable, "-c",
            "import os, sys, time; r = int(os.environ['HOROVOD_RANK']); print('rank', r, 'up'); "
            "time.sleep(60) if r == 0 else sys.exit(3)"]
    with netem.EmulatedCluster(2, RATE) as cluster:
        start = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired) as info:
            netem.launch_horovod(cluster, 1, hang, timeout=3)
        assert time.monotonic() - start < 20
        message = str(info.value)
        assert isinstance(info.value, netem.HorovodTimeout)
        for rank in (0, 1):
            assert f"hello from rank {rank} {cluster.hosts[rank]}" in message
        assert len(info.value.results) == 2

        start = time.monotonic()
        results = netem.launch_horovod(cluster, 1, fail, timeout=60, fail_grace=1.0)
        assert time.monotonic() - start < 20  # rank 0 was stopped after rank 1 failed
        assert results[1].returncode == 3 and results[0].returncode != 0
        assert "rank 0 up" in results[0].stdout
        with pytest.raises(subprocess.CalledProcessError):
            netem.launch_horovod(cluster, 1, fail, timeout=60, fail_grace=1.0, check=True)
    assert_clean()


@pytest.mark.netem
def test_cli_runs_command_in_shaped_namespace(need_netem: None) -> None:
    res = subprocess.run([sys.executable, "-m", "benchmarks.netem", "--rate", RATE, "--",
                          "sh", "-c", "ip -o link show lo | grep -q tbf && exit 7"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 7, res.stderr
