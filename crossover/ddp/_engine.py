"""The engine an `AdaptiveState` holds (crossover/ddp/hook.py): one policy family's work per DDP bucket.

`_Engine` is the interface; `_CodecEngine` is what the sparse and quantizing engines share: pass-through of
buckets that are not compressed, keys per bucket, the payload's reduction and the codec's own collectives
issued from the hook's body, deferred statistics fed to the driver in bucket order, state and reset.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from crossover.driver import check_min_numel

from ._buckets import BucketLayouts
from ._collectives import TorchDistCollectives

__all__ = ["GLOO_CUDA_SYNC", "Future", "allreduce_mean"]

log = logging.getLogger("crossover.ddp.hook")

Future = torch.futures.Future


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
    """What the sparse and the quantizing engines share: pass-through, keys, reduction, deferred statistics,
    and the state of their `driver` (a SparseStepDriver or QuantStepDriver the subclass sets)."""

    driver: Any

    def __init__(self, group: Any, *, min_compress_numel: int, memory: Any) -> None:
        super().__init__(group)
        self.min_compress_numel = check_min_numel(min_compress_numel)
        self.layouts = BucketLayouts(memory)
        self._reduced: dict[int, Any] = {}  # bucket index -> reduced statistics (written by callbacks)
        self._step_buckets: dict[str, int] = {}  # buckets of the step in flight: "large" or the dtype passed through
        self._passed: dict[int, torch.Tensor] = {}  # bucket index -> finite after the reduction (callbacks)
        self._step_keys: dict[int, str] = {}  # bucket index -> key, for the buckets compressed this step
        self._warned = False

    # the subclass's driver and codec
    def _begin_step(self) -> None:
        raise NotImplementedError

    def _feed(self, reduced: Any, world: int) -> None:
        raise NotImplementedError

    def _count(self, sent: int, dense: int) -> None:
        self.driver.count(sent, dense)

    def _skips_all(self) -> bool:
        return False

    def _mark_nonfinite(self) -> None:
        self.driver.mark_nonfinite()

    def _step_nonfinite(self) -> bool:
        raise NotImplementedError

    def _encode(self, key: str, buf: torch.Tensor) -> tuple[torch.Tensor, Any, int]:
        raise NotImplementedError

    def _decode(self, reduced: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    # ------------------------------------------------------------------ per bucket
    def flush(self) -> None:
        """Feed the reduced statistics of the last step to the driver, in bucket order (same on every rank).

        A bucket passed through (too small, not float32) reaches every rank with the same reduced values, so
        inf/NaN in it marks the step non-finite alike everywhere with no collective. A non-finite step leaves
        no trace in error feedback: a compressed bucket whose decode did not put its residual back (its own
        statistics were finite) has it reset to zeros.
        """
        passed, self._passed = self._passed, {}
        keys, self._step_keys = self._step_keys, {}
        undone = set()
        if self._reduced:
            world = self.comm.size()
            for index in sorted(self._reduced):
                reduced = self._reduced[index]
                if not all(math.isfinite(float(v)) for v in reduced):
                    undone.add(index)  # the codec put this bucket's residual back
                self._feed(reduced, world)
            self._reduced.clear()
        if passed and not bool(torch.stack(list(passed.values())).all()):  # one device per DDP process
            self._mark_nonfinite()
        if keys and self._step_nonfinite():
            for index, key in keys.items():
                res = self.layouts.memory.get(key)
                if res is not None and index not in undone:
                    res.zero_()

    def run(self, bucket: dist.GradBucket) -> Future:
        index = bucket.index()
        buf = bucket.buffer()
        if index == 0:
            self._say_uncompressed()
            self.flush()
            self._begin_step()
        nbytes = buf.numel() * buf.element_size()
        small = buf.dtype != torch.float32 or buf.numel() < self.min_compress_numel
        kind = "large" if not small else str(buf.dtype).replace("torch.", "")
        self._step_buckets[kind] = self._step_buckets.get(kind, 0) + 1
        if small or self._skips_all():
            self._count(nbytes, nbytes)
            if small and self.layouts.memory.enabled:  # a residual left by a bucket rebuild goes out now
                res = self.layouts.memory.pop(self.layouts.key(index, bucket.parameters(), buf))
                if res is not None and res.dtype == buf.dtype:
                    buf.add_(res.view_as(buf))
            passed = self._passed

            def seen(f: Future) -> torch.Tensor:
                out = f.value()
                if out.is_floating_point():
                    passed[index] = torch.isfinite(out).all()  # read at the next step's flush
                return out

            return allreduce_mean(buf, self.group).then(seen)
        key = self.layouts.key(index, bucket.parameters(), buf)
        self._step_keys[index] = key
        self._count(0, nbytes)
        payload, ctx, sent = self._encode(key, buf)
        self._count(sent, 0)
        payload.div_(self.comm.size())  # the sum over ranks becomes the average (stats[0] says so to decode)
        fut = dist.all_reduce(payload, group=self.group, async_op=True).get_future()
        handle = getattr(ctx, "handle", None)
        if handle is not None:  # the codec's own allgather, issued in _encode just before
            fut = torch.futures.collect_all([fut, handle.future()])

        gloo_cuda = _gloo_cuda(payload, self.group)

        def finish(f: Future) -> torch.Tensor:
            _raise_errors(f)
            if gloo_cuda:
                torch.cuda.synchronize(payload.device)
            out, reduced = self._decode(payload, ctx)
            if gloo_cuda:
                torch.cuda.synchronize(payload.device)
            self._reduced[index] = reduced
            return out

        return fut.then(finish)

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

    # ------------------------------------------------------------------ state (the subclass's `driver`)
    def stats(self) -> dict[str, Any]:
        self.flush()  # between steps: the last step's statistics (non-finite or not) count now
        return self.driver.stats()

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return {"driver": self.driver.state_dict(), "residuals": self.layouts.pieces()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Residuals checked, then the driver's state (checked whole before it applies any), then residuals."""
        if "driver" not in state:
            raise ValueError("not a valid compression state: no 'driver' entry")
        if "residuals" in state:
            self.layouts.validate(state["residuals"])
        self.driver.load_state_dict(state["driver"])
        self._reduced.clear()
        self._passed.clear()
        self._step_keys.clear()
        if "residuals" in state:
            self.layouts.load(state["residuals"])

    def reset(self) -> None:
        self._reduced.clear()
        self._step_buckets.clear()
        self._passed.clear()
        self._step_keys.clear()
        self.layouts.reset()
        self.driver.reset()

    @property
    def bucket_rebuilds(self) -> int:
        return self.layouts.rebuilds
