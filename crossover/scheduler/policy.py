"""Turn-taking policy of the scheduler daemon: who computes on a device next.

Pure state machine, no sockets and no clock: every call gets ``now`` (seconds) and returns the
:class:`Grant` messages to send. The daemon (:mod:`crossover.scheduler.daemon`) drives it.

Rules (docs/scheduler.md has the reasoning):

* A device is in one **turn** at a time, owned by one job and one step number (``seq``). Every worker
  of that job on this host that asks for the same ``seq`` joins the turn (ranks of one job that share
  a device compute together); a worker that has already left the turn may rejoin only while no other
  job waits. The turn ends when its last holder releases (or disconnects).
* The next turn goes to the waiting job with the smallest **virtual time** (steps that had a turn on
  this device, divided by the job's weight), ties broken by job name. Two jobs therefore strictly alternate, more
  jobs go round-robin, and a job of weight 2 gets two turns for every one of a weight-1 job when they
  compete. A job new to a device starts at the smallest virtual time of the jobs already there.
  Because the order depends only on turn counts and names, every host's daemon makes the same choice,
  which keeps a job's ranks on different hosts in phase.
* **Alignment**: when the device is idle and the waiter is not the job that should go next (another
  job that recently used the device has a smaller virtual time and is not waiting yet), the grant is
  held back for at most ``align_s`` (default 2 ms) for that job to arrive. This keeps the turn order
  the same on every host when two jobs finish communicating at about the same time.
* **Lease**: no waiter waits more than ``lease_s`` for a turn to end. When that bound is hit the turn
  is expired (logged as a warning) and the device goes to the next job; the old holders keep running
  uncoordinated until they release (their late release is ignored).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from crossover.scheduler import settings

__all__ = ["Grant", "Scheduler", "StateError"]

log = logging.getLogger(__name__)

MAX_DEVICES = 1024
MAX_DEVICES_PER_CONN = 64
ALIGN_RECENT_S = 30.0  # only hold a grant back for jobs that used the device this recently


class StateError(Exception):
    """A request that contradicts the connection's state (acquire twice, no hello, too many devices)."""


@dataclass
class Grant:
    """Tell connection ``conn`` that its request ``req_id`` for ``dev`` is granted."""

    conn: int
    req_id: int
    dev: str
    turn: int
    waited: float


@dataclass
class _Request:
    conn: int
    job: str
    seq: int
    req_id: int
    since: float


@dataclass
class _Turn:
    job: str
    seq: int
    number: int
    started: float
    holders: set[int]
    joined: set[int]


@dataclass
class _Device:
    name: str
    turn: _Turn | None = None
    waiters: list[_Request] = field(default_factory=list)
    users: set[int] = field(default_factory=set)
    vtime: dict[str, float] = field(default_factory=dict)
    last_end: dict[str, float] = field(default_factory=dict)
    charged: dict[str, int] = field(default_factory=dict)  # job -> seq of its last turn counted in vtime
    expired: set[int] = field(default_factory=set)
    idle_since: float | None = None  # device idle with waiters held back for alignment since
    turns: int = 0
    expiries: int = 0
    busy_s: float = 0.0


@dataclass
class _Conn:
    job: str
    member: str
    weight: float
    pid: int
    devices: set[str] = field(default_factory=set)


class Scheduler:
    """Per-host turn-taking state over all devices and connections (see the module docstring)."""

    def __init__(self, lease_s: float = 10.0, align_s: float = 0.002,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.lease_s = settings.LEASE_S.parse(lease_s, "lease_s")
        self.align_s = settings.ALIGN_MS.parse(align_s * 1e3, "align_s (in ms)") / 1e3
        self.on_event = on_event
        self._conns: dict[int, _Conn] = {}
        self._devices: dict[str, _Device] = {}
        self._weights: dict[str, float] = {}

    # ------------------------------------------------------------------ connection life cycle

    def hello(self, conn: int, job: str, member: str, weight: float, pid: int) -> None:
        """Register connection ``conn`` as worker ``member`` of ``job``."""
        if conn in self._conns:
            raise StateError("hello sent twice")
        try:
            weight = settings.WEIGHT.parse(weight)
        except settings.SettingError as exc:
            raise StateError(str(exc)) from None
        self._conns[conn] = _Conn(job, member, weight, pid)
        self._weights[job] = weight

    def known(self, conn: int) -> bool:
        """Whether ``conn`` has said hello."""
        return conn in self._conns

    def drop(self, conn: int, now: float) -> list[Grant]:
        """Forget ``conn`` (it closed or misbehaved): cancel its waits, end turns it alone held."""
        c = self._conns.pop(conn, None)
        if c is None:
            return []
        grants: list[Grant] = []
        for name in sorted(c.devices):
            d = self._devices[name]
            d.users.discard(conn)
            d.expired.discard(conn)
            d.waiters = [r for r in d.waiters if r.conn != conn]
            if d.turn is not None and conn in d.turn.holders:
                d.turn.holders.discard(conn)
                self._emit("leave", d, d.turn.job, now, member=c.member, why="disconnected")
                if not d.turn.holders:
                    grants += self._end(d, now, "holder disconnected")
            elif d.turn is None:
                grants += self._schedule(d, now)
            if not any(self._conns[u].job == c.job for u in d.users):
                d.vtime.pop(c.job, None)
                d.last_end.pop(c.job, None)
                d.charged.pop(c.job, None)
            if not d.users and d.turn is None and not d.waiters:
                del self._devices[name]
        if not any(x.job == c.job for x in self._conns.values()):
            self._weights.pop(c.job, None)
        return grants

    # ------------------------------------------------------------------ requests

    def acquire(self, conn: int, dev: str, seq: int, req_id: int, now: float) -> list[Grant]:
        """Connection ``conn`` asks for ``dev`` for step ``seq``; grants now or queues the request."""
        c = self._conn(conn)
        d = self._devices.get(dev)
        if d is None:
            if len(self._devices) >= MAX_DEVICES:
                raise StateError(f"too many devices (max {MAX_DEVICES})")
            d = self._devices[dev] = _Device(dev)
        if dev not in c.devices:
            if len(c.devices) >= MAX_DEVICES_PER_CONN:
                raise StateError(f"too many devices on one connection (max {MAX_DEVICES_PER_CONN})")
            c.devices.add(dev)
            d.users.add(conn)
            if c.job not in d.vtime:
                others = [v for j, v in d.vtime.items() if j != c.job]
                d.vtime[c.job] = min(others, default=0.0)
        t = d.turn
        if t is not None and conn in t.holders:
            return [Grant(conn, req_id, dev, t.number, 0.0)]
        if any(r.conn == conn for r in d.waiters):
            raise StateError(f"acquire for {dev!r} while already waiting for it")
        d.expired.discard(conn)
        if t is not None and t.job == c.job and t.seq == seq and (
                conn not in t.joined or not any(r.job != c.job for r in d.waiters)):
            t.holders.add(conn)
            t.joined.add(conn)
            self._emit("join", d, c.job, now, member=c.member)
            return [Grant(conn, req_id, dev, t.number, 0.0)]
        d.waiters.append(_Request(conn, c.job, seq, req_id, now))
        return self._schedule(d, now) if t is None else []

    def release(self, conn: int, dev: str, now: float) -> list[Grant]:
        """Connection ``conn`` is done computing on ``dev`` (or no longer wants it)."""
        c = self._conn(conn)
        d = self._devices.get(dev)
        if d is None:
            return []
        t = d.turn
        if t is not None and conn in t.holders:
            t.holders.discard(conn)
            self._emit("leave", d, t.job, now, member=c.member, why="released")
            return self._end(d, now, "released") if not t.holders else []
        if conn in d.expired:
            d.expired.discard(conn)
            self._emit("late_release", d, c.job, now, member=c.member)
            return []
        before = len(d.waiters)
        d.waiters = [r for r in d.waiters if r.conn != conn]
        if len(d.waiters) != before and t is None:
            return self._schedule(d, now)
        return []

    def tick(self, now: float) -> list[Grant]:
        """Apply lease expiries and alignment time-outs that are due at ``now``."""
        grants: list[Grant] = []
        for d in list(self._devices.values()):
            t = d.turn
            if t is not None and d.waiters and now >= self._lease_deadline(d):
                waiter = min(d.waiters, key=self._key(d))
                log.warning("lease expired: job %s held %s for %.3f s (turn %d) while job %s waited "
                            "%.3f s; handing the device over", t.job, d.name, now - t.started, t.number,
                            waiter.job, now - waiter.since)
                d.expired |= t.holders
                d.expiries += 1
                grants += self._end(d, now, "lease expired")
            elif t is None and d.waiters:
                grants += self._schedule(d, now)
        return grants

    def next_deadline(self) -> float | None:
        """The earliest ``now`` at which :meth:`tick` has something to do, or None."""
        times = []
        for d in self._devices.values():
            if d.waiters:
                if d.turn is not None:
                    times.append(self._lease_deadline(d))
                elif d.idle_since is not None:
                    times.append(d.idle_since + self.align_s)
        return min(times, default=None)

    def snapshot(self, now: float) -> dict[str, Any]:
        """JSON-able view of the state (for ``status`` and tests)."""
        devices = {}
        for name, d in sorted(self._devices.items()):
            t = d.turn
            devices[name] = {
                "turn": None if t is None else {
                    "job": t.job, "seq": t.seq, "number": t.number, "held_s": round(now - t.started, 6),
                    "holders": sorted(self._conns[h].member for h in t.holders if h in self._conns)},
                "waiting": [{"job": r.job, "seq": r.seq, "member": self._conns[r.conn].member,
                             "waited_s": round(now - r.since, 6)} for r in d.waiters],
                "turns": d.turns, "expiries": d.expiries,
                "busy_s": round(d.busy_s + (now - t.started if t else 0.0), 6),
                "vtime": dict(sorted(d.vtime.items())),
            }
        jobs: dict[str, list[str]] = {}
        for c in self._conns.values():
            jobs.setdefault(c.job, []).append(c.member)
        return {"devices": devices, "jobs": {j: sorted(m) for j, m in sorted(jobs.items())},
                "connections": len(self._conns), "lease_s": self.lease_s, "align_s": self.align_s}

    def check(self) -> None:
        """Assert the invariants of the state (after an unexpected error: is it still safe to go on?)."""
        for cid, c in self._conns.items():
            for name in c.devices:
                assert name in self._devices and cid in self._devices[name].users, f"conn {cid} lost device {name}"
            assert c.job in self._weights, f"job {c.job} has no weight"
        for name, d in self._devices.items():
            assert d.name == name, f"device {name} filed as {d.name}"
            for cid in d.users | d.expired | {r.conn for r in d.waiters}:
                assert cid in self._conns and name in self._conns[cid].devices, f"{name}: unknown conn {cid}"
            if d.turn is not None:
                assert d.turn.holders <= d.users, f"{name}: a holder is not a user"
            assert all(math.isfinite(v) for v in d.vtime.values()), f"{name}: virtual time not finite"

    # ------------------------------------------------------------------ internals

    def _conn(self, conn: int) -> _Conn:
        c = self._conns.get(conn)
        if c is None:
            raise StateError("request before hello")
        return c

    def _key(self, d: _Device) -> Callable[[_Request], tuple[float, str, float]]:
        return lambda r: (d.vtime.get(r.job, 0.0), r.job, r.since)

    def _lease_deadline(self, d: _Device) -> float:
        assert d.turn is not None
        return max(d.turn.started, min(r.since for r in d.waiters)) + self.lease_s

    def _expected_first(self, d: _Device, job: str, now: float) -> str | None:
        """A job that should go before ``job`` on idle ``d`` and may arrive any moment, or None."""
        mine = (d.vtime.get(job, 0.0), job)
        waiting = {r.job for r in d.waiters}
        for other, vt in d.vtime.items():
            if other == job or other in waiting or (vt, other) >= mine:
                continue
            last = d.last_end.get(other)
            if last is not None and now - last <= ALIGN_RECENT_S:
                return other
        return None

    def _schedule(self, d: _Device, now: float) -> list[Grant]:
        """Start the next turn on idle ``d`` if someone waits (maybe after the alignment hold)."""
        if d.turn is not None:
            return []
        if not d.waiters:
            d.idle_since = None
            return []
        best = min(d.waiters, key=self._key(d))
        if self.align_s > 0:
            if d.idle_since is None:
                d.idle_since = now
            if now < d.idle_since + self.align_s:
                first = self._expected_first(d, best.job, now)
                if first is not None:
                    self._emit("hold", d, best.job, now, for_job=first)
                    return []
        d.idle_since = None
        group = [r for r in d.waiters if r.job == best.job and r.seq == best.seq]
        d.waiters = [r for r in d.waiters if not (r.job == best.job and r.seq == best.seq)]
        d.turns += 1
        conns = {r.conn for r in group}
        d.turn = _Turn(best.job, best.seq, d.turns, now, set(conns), set(conns))
        self._emit("start", d, best.job, now, members=sorted(self._conns[r.conn].member for r in group))
        return [Grant(r.conn, r.req_id, d.name, d.turns, now - r.since) for r in group]

    def _end(self, d: _Device, now: float, why: str) -> list[Grant]:
        t = d.turn
        assert t is not None
        self._emit("end", d, t.job, now, why=why, held_s=round(now - t.started, 6))
        d.turn = None
        d.busy_s += now - t.started
        if d.charged.get(t.job) != t.seq:  # ranks of a job that came one after another: one step, one charge
            d.vtime[t.job] = d.vtime.get(t.job, 0.0) + 1.0 / self._weights.get(t.job, 1.0)
            d.charged[t.job] = t.seq
        d.last_end[t.job] = now
        return self._schedule(d, now)

    def _emit(self, ev: str, d: _Device, job: str, now: float, **extra: Any) -> None:
        if self.on_event is None:
            return
        t = d.turn
        rec: dict[str, Any] = {"ev": ev, "dev": d.name, "job": job, "now": now}
        if t is not None:
            rec.update(seq=t.seq, turn=t.number)
        rec.update(extra)
        self.on_event(rec)
