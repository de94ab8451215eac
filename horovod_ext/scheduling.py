"""Crossover scheduling for horovod.torch: jobs sharing a device take turns on it.

While one job's workers wait on their gradient allreduce, another job's workers compute on the same
device (CrossoverScheduler, docs/scheduler.md). This module connects horovod.torch to the node-local
daemon (:mod:`crossover.scheduler`):

* **Stock ``hvd.DistributedOptimizer``, no code change**: under ``crossover-run`` (or
  ``python -m horovod_ext.launch script.py``) :func:`install` patches horovod.torch when it is
  imported. Building a ``DistributedOptimizer`` takes the device. ``synchronize()`` (called by
  ``step()``) first submits the allreduces backward did not start, then (on CUDA after
  ``torch.cuda.synchronize()``) releases the device, waits for every allreduce handle, and takes the
  device back for the next step before the gradients are unpacked and the update runs.
  Other blocking collectives (``hvd.allreduce``, ``broadcast_parameters``, ``barrier``, ``join``, ...)
  release the device too when they have not finished within ``hold_grace`` (1 ms): a worker never
  sits on the device while it waits for a peer, which is what could otherwise deadlock two jobs
  across hosts.
* **Custom loops**: ``with crossover_turn(): ...`` holds the device for the block;
  ``with communicating(): ...`` gives it back for a block that waits on communication.

Only the environment turns it on (``CROSSOVER_SCHED=1``, set by ``crossover-run``); otherwise every
function here is a no-op and horovod.torch is left alone. Settings (all optional):
``CROSSOVER_JOB`` (job name, the same on every host; default: the Gloo rendezvous address),
``CROSSOVER_JOB_WEIGHT``, ``CROSSOVER_DEVICE`` (device id; default: the current CUDA device, else
``cpuN`` for a process pinned to core N, else ``cpu``), ``CROSSOVER_SCHED_DIR``,
``CROSSOVER_TELEMETRY_DIR``, ``CROSSOVER_HOLD_GRACE_MS``, ``CROSSOVER_POLL_MS``.

While its device is released a worker waits on its allreduce handles by polling with short sleeps
(at most ``CROSSOVER_POLL_MS``, 0.5 ms): Horovod's own wait busy-spins a CPU core, which on a machine
where the device *is* a core would take it from the job whose turn it is.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import time
from typing import Any, Iterator, Sequence

from crossover.scheduler import paths, settings
from crossover.scheduler.client import SchedulerClient
from crossover.scheduler.telemetry import Recorder
from crossover.scheduler.turns import DeviceTurns, cpu_device
from horovod_ext._internals import TorchPatch, torch_handle_pending, torch_replace_handles, torch_submit_missing

__all__ = ["install", "enabled_by_env", "enable", "disable", "session", "crossover_turn", "communicating",
           "patch_horovod_torch", "unpatch_horovod_torch", "resolve_device"]

log = logging.getLogger(__name__)

ENV_ENABLE = "CROSSOVER_SCHED"
_TRUE = ("1", "on", "true", "yes")

_session: DeviceTurns | None = None
_session_lock = threading.Lock()
_patch = TorchPatch()  # Horovod's internals are touched in horovod_ext/_internals.py only
_poll_max = 5e-4  # seconds; CROSSOVER_POLL_MS, read when the session is created
_orig = _patch.orig  # Horovod's own synchronize / poll / optimizer __init__ / synchronize


def enabled_by_env() -> bool:
    """Whether ``$CROSSOVER_SCHED`` asks for crossover scheduling."""
    return os.environ.get(ENV_ENABLE, "").strip().lower() in _TRUE


# --------------------------------------------------------------------------- the session


def resolve_device() -> str:
    """This worker's device id: ``$CROSSOVER_DEVICE``, the current CUDA device, ``cpuN`` or ``cpu``."""
    env = os.environ.get("CROSSOVER_DEVICE", "").strip()
    if env and env != "auto":
        return env
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        with contextlib.suppress(Exception):
            return f"cuda-{torch.cuda.get_device_properties(index).uuid}"  # physical GPU, whatever the mask
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [x.strip() for x in visible.split(",") if x.strip()]
        return f"cuda{ids[index] if index < len(ids) else index}"
    return cpu_device()


def _cuda_sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def _default_job() -> str:
    addr, port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if addr and port:
        return f"hvd-{addr}:{port}"
    return f"ppid{os.getppid()}"


def _default_member() -> str:
    rank = os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK")
    return f"rank{rank}" if rank is not None else f"pid{os.getpid()}"


def enable(job: str | None = None, member: str | None = None, device: str | None = None, *,
           weight: float | None = None, directory: str | None = None, telemetry_dir: str | None = None,
           coordinate: bool = True, hold_grace_s: float | None = None) -> DeviceTurns:
    """Create this process's turn session explicitly (environment values fill what is not given).

    ``coordinate=False`` records telemetry without talking to a daemon. If the scheduler directory is
    unusable, a warning is logged and the session runs uncoordinated. A setting that is not a number in its
    range (``weight``, ``CROSSOVER_JOB_WEIGHT``, ``CROSSOVER_HOLD_GRACE_MS``, ``CROSSOVER_POLL_MS`` and the
    daemon's ``CROSSOVER_LEASE_S``, ``CROSSOVER_ALIGN_MS``, ``CROSSOVER_SCHED_IDLE_EXIT``,
    ``CROSSOVER_SCHED_NICE``, which a daemon started by this worker would refuse) raises ValueError here.
    """
    global _session, _poll_max
    with _session_lock:
        if _session is not None:
            return _session
        try:
            settings.check_env(settings.DAEMON_ENV)
            if weight is None:
                weight = settings.from_env("CROSSOVER_JOB_WEIGHT", settings.WEIGHT, 1.0)
            weight = settings.WEIGHT.parse(weight, "weight")
            if hold_grace_s is None:
                hold_grace_s = settings.from_env("CROSSOVER_HOLD_GRACE_MS", settings.HOLD_GRACE_MS, 1.0) / 1e3
            settings.HOLD_GRACE_MS.parse(hold_grace_s * 1e3, "hold_grace_s (in ms)")
            _poll_max = settings.from_env("CROSSOVER_POLL_MS", settings.POLL_MS, 0.5) / 1e3
        except settings.SettingError as exc:
            raise ValueError(f"crossover scheduling: {exc}") from None
        job = job or os.environ.get("CROSSOVER_JOB") or _default_job()
        member = member or _default_member()
        telemetry_dir = telemetry_dir or os.environ.get("CROSSOVER_TELEMETRY_DIR") or None
        client = None
        if coordinate:
            try:
                client = SchedulerClient(job, member, weight, directory)
                client.connect(wait=5.0)
            except (paths.SchedulerDirError, OSError) as exc:
                log.warning("crossover scheduler unusable (%s); running uncoordinated", exc)
                client = None
        host = paths.host_name()

        def make_recorder(dev: str) -> Recorder | None:
            if not telemetry_dir:
                return None
            try:
                return Recorder(telemetry_dir, job, member, host, dev)
            except (OSError, paths.SchedulerDirError) as exc:
                log.warning("crossover telemetry disabled: %s", exc)
                return None

        _session = DeviceTurns(client, (lambda: device) if device else resolve_device,
                               make_recorder=make_recorder, before_release=_cuda_sync, hold_grace_s=hold_grace_s)
        atexit.register(_session.close)
        return _session


def disable() -> None:
    """Close the session (release, flush telemetry, disconnect); later calls create a new one."""
    global _session
    with _session_lock:
        s, _session = _session, None
    if s is not None:
        atexit.unregister(s.close)
        s.close()


def session(create: bool = True) -> DeviceTurns | None:
    """The process's session; created from the environment on first use when ``CROSSOVER_SCHED`` is on."""
    if _session is None and create and enabled_by_env():
        return enable()
    return _session


@contextlib.contextmanager
def crossover_turn() -> Iterator[None]:
    """Hold the device for the block (compute of a custom training loop); no-op when scheduling is off."""
    s = session()
    if s is None:
        yield
        return
    with s.turn():
        yield


@contextlib.contextmanager
def communicating() -> Iterator[None]:
    """Give the device back for the block (a wait on communication); no-op when scheduling is off."""
    s = session()
    if s is None or not s.held:
        yield
        return
    with s.communicating():
        yield


# --------------------------------------------------------------------------- horovod.torch patches


class _Done:
    """An allreduce handle already waited for: its output, for Horovod's own ``synchronize`` loop."""

    __slots__ = ("output",)

    def __init__(self, output: Any) -> None:
        self.output = output


def _wait_quietly(handle: Any) -> Any:
    """Wait for ``handle`` by polling with short sleeps, then return its output.

    Horovod's own wait (``mpi_ops.synchronize``) busy-spins in C++ (measured: 2.8 s of CPU for a 3 s
    wait); a worker that has given its device (a CPU core) to another job must not burn it meanwhile.
    The sleep grows from 50 us to ``CROSSOVER_POLL_MS`` (0.5 ms): at most that much added latency.
    """
    if torch_handle_pending(handle):
        poll = _orig["poll"]
        delay, top = 5e-5, _poll_max
        while not poll(handle):
            time.sleep(delay)
            delay = min(2 * delay, top)
    return _orig["sync"](handle)


def _wait_briefly(handle: int, grace: float) -> bool:
    """Poll ``handle`` for up to ``grace`` seconds; True when it is done."""
    poll = _orig["poll"]
    if poll(handle):
        return True
    deadline = time.perf_counter() + grace
    while time.perf_counter() < deadline:
        time.sleep(0.0001)
        if poll(handle):
            return True
    return False


def _synchronize_handle(handle: Any) -> Any:
    """Replacement of ``horovod.torch.mpi_ops.synchronize``: give the device back while blocked."""
    if isinstance(handle, _Done):
        return handle.output
    s = _session
    if s is None or not s.coordinated:
        return _orig["sync"](handle)
    if not s.held:
        return _wait_quietly(handle)  # e.g. a custom loop waiting between two crossover_turn() blocks
    if not torch_handle_pending(handle) or _wait_briefly(handle, s.hold_grace_s):
        return _orig["sync"](handle)
    with s.communicating():
        return _wait_quietly(handle)


def _optimizer_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _orig["init"](self, *args, **kwargs)
    s = session()
    if s is not None:
        s.acquire()


def _optimizer_synchronize(self: Any) -> None:
    s = session()
    if s is None or not self.process_set.included():
        return _orig["opt_sync"](self)
    torch_submit_missing(self)  # compute (compression) on the device, before giving it away
    with s.communicating(new_step=True):
        torch_replace_handles(self, lambda h: None if h is None or callable(h) or isinstance(h, _Done)
                              else _Done(_wait_quietly(h)))
    return _orig["opt_sync"](self)


def patch_horovod_torch() -> None:
    """Patch horovod.torch (imports it) so that the stock DistributedOptimizer takes turns. Idempotent."""
    if _patch.active:
        return
    if _patch.apply(synchronize=_synchronize_handle, optimizer_init=_optimizer_init,
                    optimizer_synchronize=_optimizer_synchronize,
                    feature="crossover scheduling (jobs run uncoordinated)"):
        log.info("crossover: horovod.torch patched (DistributedOptimizer takes turns on the device)")


def unpatch_horovod_torch() -> None:
    """Undo :func:`patch_horovod_torch` (optimizers built meanwhile keep the patched methods)."""
    _patch.undo()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Meta-path hook: patch horovod.torch right after it is first imported."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != "horovod.torch":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            try:
                patch_horovod_torch()
            except Exception:  # never break the user's import
                log.exception("crossover: could not patch horovod.torch; running without crossover")

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(force: bool = False) -> bool:
    """Turn crossover on for this process if ``CROSSOVER_SCHED`` is set (or ``force``).

    Patches horovod.torch now if it is imported, else as soon as it is. Returns whether it is on.
    """
    if not (force or enabled_by_env()):
        return False
    os.environ[ENV_ENABLE] = "1"
    if "horovod.torch" in sys.modules:
        patch_horovod_torch()
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    return True
