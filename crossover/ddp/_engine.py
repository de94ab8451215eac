"""The engine an `AdaptiveState` holds (crossover/ddp/hook.py): one policy family's work per DDP bucket.

`_Engine` is the interface; `_CodecEngine` runs a step session (crossover/driver/session.py) per bucket:
pass-through of buckets that are not compressed, keys per bucket, the payload's reduction and the codec's own
collectives issued from the hook's body, deferred statistics fed in bucket order, state and reset.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from crossover.driver import check_min_numel
from crossover.driver.session import LowRankSession, SparseSession, StepSession, finite_probe

from ._buckets import BucketLayouts
from ._collectives import TorchDistCollectives

__all__ = ["GLOO_CUDA_SYNC", "Future", "allreduce_mean"]

log = logging.getLogger("crossover.ddp.hook")

Future = torch.futures.Future


#: Low rank: a bucket's pieces feed the driver in the order bucket index x this + piece (a bucket holds fewer).
_PIECES = 1 << 20

#: Gloo with CUDA tensors: synchronise the device around the codec's decode (see `_gloo_cuda`).
GLOO_CUDA_SYNC = True


def _gloo_cuda(t: torch.Tensor, group: Any) -> bool:
    """Whether `t` is a CUDA tensor reduced over Gloo (host-staged collectives, e.g. ranks sharing a GPU).

    There the codec's decode, run in a callback of collected futures on Gloo's thread, was seen reading
    gathered CUDA bytes that were not yet (or no longer) those of this step: QSGD's averaged gradients
    differed between 2 ranks on one GPU. A device-wide synchronisation before and after the decode keeps
    it ordered with the collectives' copies and with DDP's use of the result. NCCL's futures carry
    the right CUDA events; it needs none of this.
    """
    return GLOO_CUDA_SYNC and t.is_cuda and dist.get_backend(group) == "gloo"


def allreduce_mean(buf: torch.Tensor, group: Any) -> Future:
    """DDP's own reduction: divide by the world size, sum in place, hand back the same buffer."""
    buf.div_(dist.get_world_size(group))
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _raise_errors(fut: Future) -> None:
    """Re-raise the error of a future, or of any future it collected, and order the current CUDA stream
    after the collected ones.

    A callback of ``collect_all`` is synchronised with the collecting future only, which holds no CUDA
    events: without ``wait()`` on each collected future (completed: it returns at once, having made the
    current streams wait for its events) the callback could read a CUDA payload before the collective
    had written it. Seen on one GPU with Gloo: QSGD's decoded gradients differed between ranks.
    """
    value = fut.value()
    if isinstance(value, list):
        for f in value:
            if isinstance(f, torch.futures.Future):
                f.wait()


class _Engine:
    """One policy family's work per bucket; `AdaptiveState` holds one."""

    name = "base"

    def __init__(self, group: Any) -> None:
        self.group = group
        self.comm = TorchDistCollectives(group, equal_sizes=True)

    def run(self, bucket: dist.GradBucket) -> Future:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the step in flight."""


class _CodecEngine(_Engine):
    """A step session (crossover/driver/session.py: a step driver and a codec) run per DDP bucket: pass-through,
    keys per bucket, the payload's reduction and the codec's own collectives issued from the hook's body, the
    reduced statistics fed in bucket order at the next step (`session.decode(..., order=index)`), state and reset."""

    def __init__(self, group: Any, name: str, session: StepSession, *, min_compress_numel: int,
                 optimizer: Any = None) -> None:
        super().__init__(group)
        self.name = name
        self.session = session
        self.optimizer = optimizer  # the user's, when shown: its momentum (or beta1) and lr are read at each step
        self.min_compress_numel = check_min_numel(min_compress_numel)
        self.layouts = BucketLayouts(session.codec.memory)
        self._step_buckets: dict[str, int] = {}  # buckets of the step in flight: "large" or the dtype passed through
        self._passed: dict[int, torch.Tensor] = {}  # bucket index -> finite after the reduction (callbacks)
        self._rebuilds_seen = 0
        self._warned = False
        self._waiting: list[tuple] = []  # low rank: buckets whose Q allreduces have not begun

    @property
    def driver(self) -> Any:
        return self.session.driver

    # ------------------------------------------------------------------ per bucket
    def flush(self) -> None:
        """The last step is over: the session feeds its statistics in bucket order and settles inf/NaN."""
        passed, self._passed = self._passed, {}
        self.session.settle([passed[i] for i in sorted(passed)])

    def run(self, bucket: dist.GradBucket) -> Future:
        index = bucket.index()
        buf = bucket.buffer()
        if index == 0:
            self._say_uncompressed()
            self.flush()
            if self.session.family_open:  # compressor="auto": the family, agreed by the ranks at the first step
                self._use(self.session.for_optimizer(self.optimizer, self.comm, buf.device))
            self.session.begin_step(self.comm)
            self.session.optimizer_seen(self.optimizer)  # a DDP hook sees the optimizer only when shown it
        lowrank = isinstance(self.session, LowRankSession)
        if lowrank:
            if (buf.dtype == torch.float32 and not self.session.skips_all()
                    and any(self._factored(g) for g in bucket.gradients())):
                return self._run_lowrank(bucket)
        nbytes = buf.numel() * buf.element_size()
        small = buf.dtype != torch.float32 or buf.numel() < self.min_compress_numel
        kind = "large" if not small else str(buf.dtype).replace("torch.", "")
        self._step_buckets[kind] = self._step_buckets.get(kind, 0) + 1
        if small or lowrank or self.session.skips_all():  # low rank here: no matrix to factor, or compression off
            self.session.count(nbytes, nbytes)
            if small and self.layouts.memory.enabled:  # a residual left by a bucket rebuild goes out now
                res = self.layouts.memory.pop(self.layouts.key(index, bucket.parameters(), buf))
                if res is not None and res.dtype == buf.dtype:
                    buf.add_(res.view_as(buf))
            passed = self._passed

            def seen(f: Future) -> torch.Tensor:
                out = f.value()
                if out.is_floating_point():
                    passed[index] = finite_probe(out)  # read at the next step's flush
                return out

            fut = allreduce_mean(buf, self.group).then(seen)
            if lowrank and bucket.is_last():
                self._advance()  # the Q round of the buckets before this one
            return fut
        key = self.layouts.key(index, bucket.parameters(), buf)
        if self.layouts.rebuilds != self._rebuilds_seen:  # DDP regrouped its buckets: their agreed sets are moot
            self._rebuilds_seen = self.layouts.rebuilds
            forget = getattr(self.session.codec, "forget_agreed", None)
            if forget is not None:
                forget()
        payload, ctx = self.session.encode(key, buf, self.comm)
        payload.div_(self.comm.size())  # the sum over ranks becomes the average (stats[0] says so to decode)
        fut = dist.all_reduce(payload, group=self.group, async_op=True).get_future()
        handle = getattr(ctx, "handle", None)
        if handle is not None:  # the codec's own allgather, issued in encode just before
            fut = torch.futures.collect_all([fut, handle.future()])

        gloo_cuda = _gloo_cuda(payload, self.group)

        def finish(f: Future) -> torch.Tensor:
            _raise_errors(f)
            if gloo_cuda:
                torch.cuda.synchronize(payload.device)
            out = self.session.decode(payload, ctx, self.comm, order=index)
            if gloo_cuda:
                torch.cuda.synchronize(payload.device)
            return out

        return fut.then(finish)

    def _run_lowrank(self, bucket: dist.GradBucket) -> Future:
        """Low rank per parameter of the bucket: two rounds of allreduces, each issued from a hook body so that every
        rank issues them in the same order (on Gloo, collectives issued from callbacks interleave differently on
        each rank). The bucket's future completes once its Q factors are reduced, in one allreduce that the last
        bucket's hook body starts for every bucket of the step."""
        index, buf, world = bucket.index(), bucket.buffer(), self.comm.size()
        # 1. each large matrix is encoded (its P factor queued); the other gradients, every statistics vector and the
        #    P factors go in one payload, averaged by one allreduce
        dense, encoded = [], []
        for o, g in zip(self.layouts.ordinals(bucket.parameters()), bucket.gradients()):
            if self._factored(g):
                encoded.append((g, *self.session.encode(f"param{o}", g, self.comm)))
            else:
                dense.append(g)
                self.session.count(g.numel() * 4, g.numel() * 4)
        self._step_buckets["large" if encoded else "float32"] = 1
        payload = torch.cat([*(g.reshape(-1) for g in dense), *(p for _, p, _ in encoded)]).div_(world)
        fut = self.comm.flush(payload)
        result: Future = torch.futures.Future()
        self._waiting.append((index, buf, dense, encoded, fut, result))
        # 2. the last bucket of the step starts the Q round of every bucket: nothing comes after it
        if bucket.is_last():
            self._advance()
        return result

    def _factored(self, grad: torch.Tensor) -> bool:
        """Low rank factors this gradient: a matrix (or conv kernel) of at least min_compress_numel elements."""
        return grad.dim() >= 2 and grad.numel() >= self.min_compress_numel

    def _advance(self) -> None:
        """Finish the P allreduces begun, start one allreduce of every Q factor (the same order on every rank), and
        complete each waiting bucket's future once its payload and its Q factors are reduced."""
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        self.session.advance(self.comm)
        q_round = self.comm.flush()
        passed = self._passed
        for index, buf, dense, encoded, fut, result in waiting:
            factored = q_round is not None and any(ctx.q_handle is not None for _, _, ctx in encoded)
            handles = [q_round] if factored else []

            def finish(f: Future, index: int = index, buf: torch.Tensor = buf, dense: list = dense,
                       encoded: list = encoded, fut: Future = fut, result: Future = result) -> None:
                try:
                    _raise_errors(f)
                    reduced, off = fut.value()[0], 0
                    for g in dense:
                        g.copy_(reduced[off:off + g.numel()].view_as(g))
                        off += g.numel()
                    if dense:
                        passed[index] = finite_probe(reduced[:off])
                    for j, (g, p, ctx) in enumerate(encoded):
                        out = self.session.decode(reduced[off:off + p.numel()], ctx, self.comm,
                                                  order=index * _PIECES + j)
                        g.copy_(out.view_as(g))
                        off += p.numel()
                    result.set_result(buf)
                except Exception as exc:  # noqa: BLE001 - DDP re-raises it from the bucket's future
                    result.set_exception(exc)

            torch.futures.collect_all([fut, *handles]).then(finish)

    def _say_uncompressed(self) -> None:
        """Once: the last step compressed no bucket for its dtype (fp16/fp64 models) or its size."""
        seen, self._step_buckets = self._step_buckets, {}
        if self._warned or not seen or "large" in seen:
            return
        self._warned = True
        other = sorted(k for k in seen if k != "float32")
        why = (f"buckets of dtype {'/'.join(other)} (crossover compresses float32 gradients only)" if other else
               f"every float32 bucket is smaller than min_compress_numel={self.min_compress_numel} elements")
        log.warning("crossover: no gradient bucket was compressed in a step: %s; they went through DDP's dense "
                    "averaging, and stats() reports CF 1", why)

    # ------------------------------------------------------------------ state
    def stats(self) -> dict[str, Any]:
        self.flush()  # between steps: the last step's statistics (non-finite or not) count now
        return self.session.stats()

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return {"driver": self.session.state_dict(**self._agreed_kw()), "residuals": self._pieces()}

    def _pieces(self) -> dict[int, torch.Tensor]:
        """Residuals per parameter ordinal: the buckets' pieces, or the low-rank codec's own (one per matrix)."""
        if isinstance(self.session, LowRankSession):
            return {int(k[len("param"):]): t.clone() for k, t in self.session.codec.memory.state().items()}
        return self.layouts.pieces()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Residuals checked, then the session's state (checked whole before it applies any), then residuals.

        Agreed index sets are made per bucket and a restarted DDP groups its buckets anew: they are not
        checkpointed; each bucket's next set is drawn from the shared seed, on every rank alike."""
        if "driver" not in state:
            raise ValueError("not a valid compression state: no 'driver' entry")
        session = self.session.for_state(state["driver"])  # compressor="auto" before the first step: its family
        layouts = self.layouts if session is self.session else BucketLayouts(session.codec.memory)
        if "residuals" in state:
            layouts.validate(state["residuals"])
        session.load_state_dict(state["driver"], **self._agreed_kw(session))
        self.session, self.layouts = session, layouts
        self._passed.clear()
        if "residuals" in state and isinstance(self.session, LowRankSession):
            self.session.codec.memory.load({f"param{o}": t.detach().reshape(-1).clone()
                                            for o, t in state["residuals"].items()})
        elif "residuals" in state:
            self.layouts.load(state["residuals"])

    def _agreed_kw(self, session: StepSession | None = None) -> dict[str, bool]:
        return {"agreed": False} if isinstance(session or self.session, SparseSession) else {}

    def _use(self, session: StepSession) -> None:
        """Run `session` from now on (the family ``compressor="auto"`` chose: a new codec, so new residual layouts)."""
        if session is not self.session:
            self.session = session
            self.layouts = BucketLayouts(session.codec.memory)

    def reset(self) -> None:
        self.comm.discard()
        self._waiting.clear()
        self._step_buckets.clear()
        self._passed.clear()
        self.layouts.reset()
        self.session.reset()

    @property
    def bucket_rebuilds(self) -> int:
        return self.layouts.rebuilds
