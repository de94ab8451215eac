"""Run a Horovod (Gloo) job with its ranks spread over the hosts of an :class:`EmulatedCluster`.

:func:`launch_horovod` does what ``horovodrun --gloo`` does internally, without ssh: Horovod's own
``RendezvousServer`` runs in a helper process inside host 0's namespace, and every rank is started
with ``ip netns exec <host ns>`` and the ``HOROVOD_*`` variables ``horovodrun`` would set, so all
traffic between hosts crosses the shaped links. Each rank runs in its own process group
(:mod:`crossover.procgroup`), killed on timeout, on a failed rank after a grace period, and on exit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import IO, Sequence

from crossover import procgroup

from .errors import NetemError
from .measure import helper_argv, read_first_line
from .namespaces import EmulatedCluster

log = logging.getLogger(__name__)

__all__ = ["HorovodTimeout", "format_rank_output", "launch_horovod"]


class HorovodTimeout(subprocess.TimeoutExpired):
    """A Horovod job launched by :func:`launch_horovod` did not finish in time.

    ``results`` holds every rank's :class:`subprocess.CompletedProcess` (killed ranks have a negative
    return code); the message contains every rank's output.
    """

    def __init__(self, cmd: Sequence[str], timeout: float,
                 results: list[subprocess.CompletedProcess[str]]) -> None:
        super().__init__(list(cmd), timeout)
        self.results = results

    def __str__(self) -> str:
        return (f"Horovod job {' '.join(map(str, self.cmd))!r} timed out after {self.timeout:g} s; "
                f"all ranks killed.\n{format_rank_output(self.results)}")


def format_rank_output(results: Sequence[subprocess.CompletedProcess[str]]) -> str:
    """Every rank's return code, stdout and stderr as one readable block."""
    parts = []
    for rank, r in enumerate(results):
        parts.append(f"--- rank {rank}: exit {r.returncode} ---\n"
                     f"[stdout]\n{r.stdout or ''}\n[stderr]\n{r.stderr or ''}")
    return "\n".join(parts)



class _Tail:
    """Echo new complete lines of a growing output file with a prefix (for ``echo=True``)."""

    def __init__(self, f: IO[bytes], prefix: str, out: IO[str]) -> None:
        self.f, self.prefix, self.out, self.pos, self.partial = f, prefix, out, 0, b""

    def poll(self, final: bool = False) -> None:
        data = os.pread(self.f.fileno(), 1 << 20, self.pos)
        while data:
            self.pos += len(data)
            self.partial += data
            data = os.pread(self.f.fileno(), 1 << 20, self.pos)
        *lines, self.partial = self.partial.split(b"\n")
        if final and self.partial:
            lines, self.partial = lines + [self.partial], b""
        for line in lines:
            self.out.write(f"{self.prefix}{line.decode('utf-8', 'replace')}\n")
        if lines:
            self.out.flush()


def _read_all(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")


def launch_horovod(cluster: EmulatedCluster, procs_per_host: int, cmd: Sequence[str],
                   env: dict[str, str] | None = None, timeout: float | None = None, *,
                   check: bool = False, echo: bool = False, python: str = sys.executable,
                   fail_grace: float = 5.0) -> list[subprocess.CompletedProcess[str]]:
    """Run a Horovod (Gloo) job with ``procs_per_host`` ranks on each host of ``cluster``.

    Ranks are numbered host by host (ranks 0..P-1 on host 0, ...), as ``horovodrun -H`` does. Horovod's
    ``RendezvousServer`` runs in a helper process (``python``) inside host 0's namespace, reachable at
    ``cluster.addresses[0]``; every rank runs ``ip netns exec <host ns> cmd...`` with the environment of
    this process, ``env`` on top, and the variables ``horovodrun --gloo`` sets: HOROVOD_RANK / SIZE /
    LOCAL_RANK / LOCAL_SIZE / CROSS_RANK / CROSS_SIZE / HOSTNAME, HOROVOD_CONTROLLER=gloo,
    HOROVOD_CPU_OPERATIONS=gloo, HOROVOD_GLOO_IFACE=eth0, HOROVOD_GLOO_RENDEZVOUS_ADDR / PORT.
    So all traffic between hosts crosses the shaped links. ``cmd[0]`` must be able to import Horovod
    (pass ``sys.executable``).

    Returns one :class:`subprocess.CompletedProcess` per rank (text stdout/stderr). When a rank fails,
    the others get ``fail_grace`` seconds, then are killed (as ``horovodrun`` does). ``check=True``
    raises :class:`subprocess.CalledProcessError` for the first failed rank, with all output in the
    message. After ``timeout`` seconds every rank is killed and :class:`HorovodTimeout` is raised with
    every rank's output. ``echo=True`` also copies rank output live to stdout/stderr as ``[rank]: ...``.
    """
    if procs_per_host < 1:
        raise ValueError("procs_per_host must be at least 1")
    n_hosts = len(cluster.hosts)
    size = n_hosts * procs_per_host
    plan = [{"hostname": cluster.hosts[h], "rank": h * procs_per_host + lr, "local_rank": lr,
             "cross_rank": h, "size": size, "local_size": procs_per_host, "cross_size": n_hosts}
            for h in range(n_hosts) for lr in range(procs_per_host)]
    cmd = list(cmd)
    start = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    files: list[tuple[IO[bytes], IO[bytes]]] = []
    tails: list[_Tail] = []
    rdv: subprocess.Popen[str] | None = None
    try:
        rdv = cluster.popen(0, helper_argv(python, "_rendezvous", json.dumps(plan)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
        port = read_first_line(rdv, 60.0, "Horovod rendezvous server")
        if not port.isdigit():
            raise NetemError(f"Horovod rendezvous server printed {port!r} instead of its port")
        base_env = dict(os.environ)
        base_env.update({
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.addresses[0],
            "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": cluster.iface,
            "NCCL_SOCKET_IFNAME": cluster.iface,
            "PYTHONUNBUFFERED": "1",
        })
        base_env.setdefault("OMP_NUM_THREADS", "1")
        base_env.update(env or {})
        for slot in plan:
            rank_env = dict(base_env)
            rank_env.update({
                "HOROVOD_HOSTNAME": str(slot["hostname"]),
                "HOROVOD_RANK": str(slot["rank"]),
                "HOROVOD_SIZE": str(size),
                "HOROVOD_LOCAL_RANK": str(slot["local_rank"]),
                "HOROVOD_LOCAL_SIZE": str(procs_per_host),
                "HOROVOD_CROSS_RANK": str(slot["cross_rank"]),
                "HOROVOD_CROSS_SIZE": str(n_hosts),
            })
            out_f, err_f = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            files.append((out_f, err_f))
            if echo:
                tails += [_Tail(out_f, f"[{slot['rank']}]: ", sys.stdout),
                          _Tail(err_f, f"[{slot['rank']}]: ", sys.stderr)]
            host = int(slot["cross_rank"])
            procs.append(cluster.popen(host, cmd, env=rank_env, stdin=subprocess.DEVNULL,
                                       stdout=out_f, stderr=err_f))
            log.debug("started rank %s on %s", slot["rank"], cluster.hosts[host])

        failed_at: float | None = None
        timed_out = False
        while True:
            codes = [p.poll() for p in procs]
            for t in tails:
                t.poll()
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(c for c in codes):
                failed_at = now
                log.info("a rank failed; stopping the others in %.0f s", fail_grace)
            if failed_at is not None and now - failed_at > fail_grace:
                for p in procs:
                    procgroup.terminate(p)
                continue
            if timeout is not None and now - start > timeout:
                timed_out = True
                for p in procs:
                    procgroup.terminate(p)
                break
            time.sleep(0.05)
        for t in tails:
            t.poll(final=True)
        results = [subprocess.CompletedProcess(p.args, p.wait(), _read_all(o), _read_all(e))
                   for p, (o, e) in zip(procs, files)]
        if timed_out:
            assert timeout is not None
            raise HorovodTimeout(cmd, timeout, results)
        if check:
            for r in results:
                if r.returncode:
                    raise subprocess.CalledProcessError(
                        r.returncode, r.args, output=format_rank_output(results), stderr=None)
        return results
    finally:
        for p in procs:
            procgroup.terminate(p, grace=0.5)
        if rdv is not None:
            with contextlib.suppress(OSError):
                if rdv.stdin is not None:
                    rdv.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                rdv.wait(timeout=5)
            procgroup.terminate(rdv, grace=0.5)
            for stream in (rdv.stdout, rdv.stderr):
                if stream is not None:
                    stream.close()
        for out_f, err_f in files:
            out_f.close()
            err_f.close()
