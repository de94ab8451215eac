"""Numeric settings of the scheduler: each one finite and inside its range, or refused with a message.

One :class:`Setting` per knob, shared by the daemon's and ``crossover-run``'s command lines (argparse
``type=``, so a bad value is a usage error, exit 2), the environment variables a worker or a daemon reads
(:func:`from_env`, :class:`SettingError` naming the variable) and the job weight a client sends.
``nan``, ``inf``, numbers too large for a float and words are refused everywhere.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["Setting", "SettingError", "WEIGHT", "LEASE_S", "ALIGN_MS", "IDLE_EXIT_S", "HELLO_TIMEOUT_S",
           "READ_TIMEOUT_S", "NICE", "HOLD_GRACE_MS", "POLL_MS", "GRACE_S", "CYCLE_TIME_MS", "DAEMON_ENV",
           "WORKER_ENV", "from_env", "check_env"]


class SettingError(ValueError):
    """A setting that is not a finite number inside its range (the message names it and the range)."""


@dataclass(frozen=True)
class Setting:
    """A numeric setting: ``name`` (as the user wrote it: option or variable), inclusive ``[lo, hi]``."""

    name: str
    lo: float
    hi: float
    integer: bool = False

    def range_text(self) -> str:
        return f"between {self.lo:g} and {self.hi:g}" + (" (an integer)" if self.integer else "")

    def parse(self, value: object, name: str | None = None) -> float:
        """``value`` (a string or a number) as a float inside the range; :class:`SettingError` otherwise."""
        label = name or self.name
        if isinstance(value, bool):
            raise SettingError(f"{label}: {value!r} is not a number; use a number {self.range_text()}")
        try:
            number = float(value.strip()) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            raise SettingError(f"{label}: {value!r} is not a number; use a number {self.range_text()}") from None
        if not math.isfinite(number) or not self.lo <= number <= self.hi:
            raise SettingError(f"{label}: {value!r} is out of range; use a number {self.range_text()}")
        if self.integer and number != int(number):
            raise SettingError(f"{label}: {value!r} is not an integer; use an integer {self.range_text()}")
        return float(int(number)) if self.integer else number

    def arg_type(self) -> Callable[[str], float]:
        """An argparse ``type=``: a bad value becomes a usage error naming the option and the range."""
        def convert(text: str) -> float:
            try:
                value = self.parse(text)
            except SettingError as exc:
                raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None
            return int(value) if self.integer else value  # type: ignore[return-value]

        convert.__name__ = self.name  # argparse names the type in some messages
        return convert


# Job weights are relative shares; a ratio of 10^6 between two jobs is beyond any use, and with 1/weight <= 1000
# added per turn a job's virtual time stays finite and exact to the turn for 10^12 turns (< 2**53 / 1000).
WEIGHT = Setting("weight", 1e-3, 1e3)
# below 10 ms no turn could even start (a round trip is ~0.1 ms); a day is longer than any training step
LEASE_S = Setting("--lease", 0.01, 86400.0)
# 0 turns the hold off; holding an idle device for more than a second would waste more than aligning saves
ALIGN_MS = Setting("--align-ms", 0.0, 1000.0)
IDLE_EXIT_S = Setting("--idle-exit", 0.0, 1e7)  # 0: never; 1e7 s (~4 months) stays well inside select()'s range
HELLO_TIMEOUT_S = Setting("--hello-timeout", 0.01, 3600.0)  # a worker says hello microseconds after connecting
READ_TIMEOUT_S = Setting("--read-timeout", 0.01, 3600.0)  # a frame (<= 4 KiB) goes in one send: it never stalls
NICE = Setting("--nice", -40.0, 40.0, integer=True)  # the widest increment setpriority can apply (result clamped)
HOLD_GRACE_MS = Setting("CROSSOVER_HOLD_GRACE_MS", 0.0, 60000.0)  # a collective held a minute is a hang, not a step
POLL_MS = Setting("CROSSOVER_POLL_MS", 0.01, 1000.0)  # the longest sleep between two polls of an allreduce handle
GRACE_S = Setting("--grace", 0.0, 3600.0)  # seconds between SIGTERM and SIGKILL when stopping jobs
CYCLE_TIME_MS = Setting("--cycle-time-ms", 0.01, 10000.0)  # Horovod's background cycle; 10 s would stall every step

# environment variable -> setting: what a daemon started on demand reads, and what a worker reads
DAEMON_ENV: dict[str, Setting] = {"CROSSOVER_LEASE_S": LEASE_S, "CROSSOVER_ALIGN_MS": ALIGN_MS,
                                  "CROSSOVER_SCHED_IDLE_EXIT": IDLE_EXIT_S, "CROSSOVER_SCHED_NICE": NICE}
WORKER_ENV: dict[str, Setting] = {"CROSSOVER_JOB_WEIGHT": WEIGHT, "CROSSOVER_HOLD_GRACE_MS": HOLD_GRACE_MS,
                                  "CROSSOVER_POLL_MS": POLL_MS}


def from_env(var: str, setting: Setting, default: float, environ: Mapping[str, str] | None = None) -> float:
    """The value of environment variable ``var`` (``default`` when unset or empty); :class:`SettingError`
    naming the variable when it is set to anything but a number in range."""
    text = (os.environ if environ is None else environ).get(var, "")
    if not text.strip():
        return default
    return setting.parse(text, var)


def check_env(variables: Mapping[str, Setting], environ: Mapping[str, str] | None = None) -> None:
    """Check every variable of ``variables`` that is set; :class:`SettingError` for the first bad one."""
    for var, setting in variables.items():
        from_env(var, setting, 0.0, environ)
