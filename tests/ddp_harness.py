"""Run real multi-process torch.distributed (Gloo) jobs from pytest and collect each rank's result.

`run_ddp(fn, world=2)` starts `world` Python processes on localhost (MASTER_ADDR=127.0.0.1, a free
port; RANK / WORLD_SIZE set), each of which joins a Gloo process group, calls the module-level
function `fn(*args)` of a test file and stores its JSON-able return value. A hang becomes a
`DdpJobError` after `timeout` seconds carrying every rank's output; so does a failed rank (the
others are killed shortly after, as they would wait forever for it). `prefix` runs every rank under
a command prefix (`ip netns exec NS`: a private network namespace).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hvd_harness import read_rank_results

RESULT_DIR_ENV = "CROSSOVER_RESULT_DIR"
WORKER = Path(__file__).with_name("ddp_worker.py")
REPO = Path(__file__).resolve().parent.parent


class DdpJobError(AssertionError):
    """A multi-rank job failed, hung or did not report from every rank; the message has all output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_ddp(fn: Callable[..., Any], world: int = 2, args: Sequence[Any] = (), timeout: float = 120,
            env: dict[str, str] | None = None, prefix: Sequence[str] = (), fail_grace: float = 5.0) -> list[Any]:
    """Run module-level `fn(*args)` on `world` Gloo ranks; return each rank's return value, by rank."""
    module_file = sys.modules[fn.__module__].__file__
    with tempfile.TemporaryDirectory(prefix="xo-ddp-") as tmp:
        base = dict(os.environ)
        base.update(env or {})
        base.update({RESULT_DIR_ENV: tmp, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                     "WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1"})
        base["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), base.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
        base.setdefault("OMP_NUM_THREADS", "1")
        cmd = [*prefix, sys.executable, str(WORKER), str(module_file), fn.__name__, json.dumps(list(args))]
        procs, logs = [], []
        for rank in range(world):
            log = open(Path(tmp) / f"rank{rank}.log", "w+")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env={**base, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=str(REPO), start_new_session=True))
        start, failed_at, why = time.monotonic(), None, None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > fail_grace:
                    why = "a rank failed; the others were killed"
                    break
                if now - start > timeout:
                    why = f"hung: killed after {timeout:.0f} s"
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                _kill(p)
        outputs = []
        for rank, log in enumerate(logs):
            log.seek(0)
            outputs.append(f"--- rank {rank} (exit {procs[rank].returncode}) ---\n{log.read()}")
            log.close()
        text = "\n".join(outputs)
        if why is None and any(p.returncode for p in procs):
            why = "failed"
        if why is not None:
            raise DdpJobError(f"torch.distributed job {why}.\ncommand: {' '.join(cmd)}\n{text}")
        return read_rank_results(tmp, world, DdpJobError, text)


def _lo_bytes() -> int | None:
    """Bytes sent on this network namespace's loopback (only meaningful in a private namespace)."""
    if not os.environ.get("CROSSOVER_COUNT_WIRE"):
        return None
    return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())


def digits_run(state: Any, epochs: int, hidden: int, on_step: Any = None, show_optimizer: bool = False, *,
               lr: float = 0.2, momentum: float = 0.0, bucket_cap_mb: float | None = None,
               hook: Any = None) -> dict:
    """Inside a torch.distributed rank: the digits MLP (`hidden` wide) trained `epochs` epochs by DDP on this rank's
    shard, through `state` with crossover's hook (or `hook`; no hook with state None). Its test accuracy, the
    hook's stats (dense bytes without a hook), loopback bytes (CROSSOVER_COUNT_WIRE), steps, and a digest of the
    weights (every rank applies the same update: the same digest)."""
    import hashlib

    import torch
    import torch.distributed as dist

    from benchmarks.digits import load_digits_split, make_model
    from crossover.ddp import adaptive_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    xtr, ytr, xte, yte = load_digits_split(0)
    xtr, ytr = xtr[rank::world], ytr[rank::world]
    torch.manual_seed(0)
    kw = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(hidden), **kw)
    if state is not None:
        ddp.register_comm_hook(state, hook or adaptive_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    if show_optimizer:
        state.optimizer = opt  # its momentum is read at each step
    gen = torch.Generator().manual_seed(1)
    dist.barrier()
    wire0 = _lo_bytes()
    steps = 0
    for _ in range(epochs):
        order = torch.randperm(len(xtr), generator=gen)
        for i in range(0, len(order) - 31, 32):
            idx = order[i:i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
            opt.step()
            steps += 1
            if on_step is not None:
                on_step()
    dist.barrier()
    wire = _lo_bytes() - wire0 if wire0 is not None else None
    with torch.no_grad():
        acc = (ddp.module(xte).argmax(1) == yte).float().mean().item()
    dense = sum(p.numel() * 4 for p in ddp.parameters()) * steps
    st = state.stats() if state is not None else {"bytes_sent": dense, "bytes_dense": dense}
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in ddp.parameters())).hexdigest()
    return {"accuracy": acc, "stats": st, "wire_bytes": wire, "steps": steps, "digest": digest}
