"""A worker's turns on its device: hold it while computing, give it back while communicating.

:class:`DeviceTurns` is framework-free; :mod:`horovod_ext.scheduling` drives it from horovod.torch
(acquire when the optimizer is built, release inside ``synchronize()`` before blocking on the
allreduce handles, re-acquire when they are done) and from ``crossover_turn()`` in custom loops.

Step ``k`` of a worker runs from the grant that ends step ``k - 1``'s communication wait to the grant
that ends its own. Every acquire carries the step number (``seq``), which is how the daemon lets the
ranks of one job that share a device compute together and keeps turn order the same on every host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, Iterator

from crossover.scheduler.client import SchedulerClient
from crossover.scheduler.telemetry import Recorder

__all__ = ["DeviceTurns", "cpu_device"]

log = logging.getLogger(__name__)


def cpu_device() -> str:
    """``cpuN`` when this process is pinned to the single core ``N``, else ``cpu`` (the whole CPU)."""
    try:
        cores = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return "cpu"
    return f"cpu{next(iter(cores))}" if len(cores) == 1 else "cpu"


class DeviceTurns:
    """Turn state of one worker process.

    ``client`` is None for observe-only use (telemetry without coordination). ``device`` is the device
    id or a function that returns it (resolved at the first acquire, after the script has pinned
    itself or picked its GPU). ``before_release`` runs before every release (e.g. CUDA synchronize, so
    the device really is free when the next job gets it). ``make_recorder(device)`` creates the
    telemetry recorder once the device is known.
    """

    def __init__(self, client: SchedulerClient | None, device: str | Callable[[], str], *,
                 make_recorder: Callable[[str], Recorder | None] | None = None,
                 before_release: Callable[[str], None] | None = None, hold_grace_s: float = 0.001) -> None:
        self.client = client
        self._device = device
        self._make_recorder = make_recorder
        self.recorder: Recorder | None = None
        self.before_release = before_release
        self.hold_grace_s = hold_grace_s
        self.held = False
        self.seq = 0
        self._depth = 0
        self._since = 0.0
        self._acc = {"compute": 0.0, "wait_device": 0.0, "wait_comm": 0.0}
        self._closed = False

    @property
    def device(self) -> str:
        """The device id (resolved on first use)."""
        if callable(self._device):
            self._device = self._device()
            if self._make_recorder is not None:
                self.recorder = self._make_recorder(self._device)
            log.info("crossover: taking turns on device %s", self._device)
        return self._device

    @property
    def coordinated(self) -> bool:
        """Whether turns currently go through a daemon."""
        return self.client is not None and self.client.connected

    def _span(self, name: str, t0: float, t1: float) -> None:
        self._acc[name] += t1 - t0
        if self.recorder is not None:
            self.recorder.span(name, t0, t1)

    def acquire(self) -> None:
        """Wait for this worker's turn on the device (no-op when already held)."""
        if self.held or self._closed:
            return
        dev = self.device
        t0 = time.time()
        if self.client is not None:
            self.client.acquire(dev, self.seq)
        t1 = time.time()
        self._span("wait_device", t0, t1)
        self.held = True
        self._since = t1

    def release(self) -> None:
        """Give the device back (no-op when not held)."""
        if not self.held:
            return
        dev = self.device
        if self.before_release is not None:
            self.before_release(dev)
        t = time.time()
        self._span("compute", self._since, t)
        self.held = False
        if self.client is not None:
            self.client.release(dev)

    def end_step(self) -> None:
        """Close the current step: write its record and count the next one."""
        if self.recorder is not None:
            self.recorder.step(self.seq, time.time(), **self._acc)
        self._acc = dict.fromkeys(self._acc, 0.0)
        self.seq += 1

    @contextlib.contextmanager
    def communicating(self, new_step: bool = False) -> Iterator[None]:
        """Release the device for the block (a wait on communication), then take it back.

        With ``new_step`` the step ends inside (the re-acquire asks for the next step's turn). If the
        block raises, the device is not taken back (the job is failing or recovering).
        """
        was_held = self.held
        self.release()
        t0 = time.time()
        yield
        self._span("wait_comm", t0, time.time())
        if new_step:
            self.end_step()
        if was_held or new_step:
            self.acquire()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the device for the block (re-entrant; a custom loop's compute phase), then release."""
        outer = self._depth == 0 and not self.held
        self._depth += 1
        self.acquire()
        try:
            yield
        finally:
            self._depth -= 1
            if outer:
                self.release()
                self.end_step()

    def close(self) -> None:
        """Release, flush telemetry and disconnect. Idempotent."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            self.release()
        self._closed = True
        if self.recorder is not None:
            self.recorder.close()
        if self.client is not None:
            self.client.close()
