"""Horovod compression objects for `horovod.tensorflow`: adaptive (GraVAC) and static sparsification.

Use:  tape = hvd.DistributedGradientTape(tape, compression=AdaptiveCompression())
      opt = hvd.DistributedOptimizer(opt, compression=AdaptiveCompression())   # horovod.tensorflow.keras

How it fits Horovod's TensorFlow hook (docs/tensorflow.md):
* Horovod calls `compress(tensor)` and `decompress(tensor, ctx)` while *tracing* a `tf.function`
  (once, not per step), around an allreduce inside a `tf.cond`. So nothing per step happens in
  Python at trace time: per-step decisions come from a `tf.py_function` ("begin step") placed once
  per traced step, outside Horovod's conds, whose output (the plan) every compress of that step
  reads. It feeds the pure-Python policy (crossover/adaptive, not copied) and returns its plan.
* State lives in `tf.Variable`s: per-tensor error-feedback residuals, and an accumulator of the
  step's reduced statistics that decompress adds to and the next "begin step" reads and clears.
* Every rank decides the same: compressed payloads carry `[1, step time, ||g+e||^2, ||C_floor||^2,
  ||C_candidate||^2]`; the allreduce sums it over ranks, and the policy is fed only those global
  numbers, one step late (same scheme as horovod_ext/torch_compression.py).
* Rank-specific top-k selections travel by an in-graph `hvd.allgather` issued inside `compress`
  (the stock allreduce then carries only the statistics); random-k values at shared indices and
  dense sends go in the allreduced payload. The payload's length changes with the plan: Horovod's
  TF ops take the runtime shape, and all ranks change it on the same step.
"""

from __future__ import annotations

import csv
import itertools
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from crossover.adaptive.gravac import StepStats
from crossover.adaptive.static import StaticPolicy
from horovod_ext._policies import dqsgd_instead, gravac_or_dense

__all__ = ["AdaptiveCompression", "FP16Compression", "StaticCompression"]

log = logging.getLogger(__name__)
_STATE_VERSION = 1
COMPRESSORS = ("topk", "randomk")  # the TF kernels; dgc/redsync exist for horovod.torch only
_NSTATS = 5  # [1, step time, ||acc||^2, ||C_floor(acc)||^2, ||C_candidate(acc)||^2]
# accumulator slots: tensors, step-time sum, dense sq, floor sq, candidate sq, bytes sent, bytes dense
_ACC = 7
_MODE_DENSE, _MODE_ALLGATHER, _MODE_ALLREDUCE = 0, 1, 2
_INSTANCES = itertools.count()  # objects are created in the same order on every rank: a shared id


# ---------------------------------------------------------------------------------------------
# Where compress is called from
# ---------------------------------------------------------------------------------------------
def _horovod_context(compression: Any) -> tuple[bool, Any]:
    """(called inside Horovod's `_allreduce_cond` / `_grouped_allreduce_cond`, the reduction op).

    Reads the calling frames (Horovod 0.28.1): `hvd.allreduce` / `hvd.grouped_allreduce` hold `op`
    next to `compression`, and run inside the cond's `allreduce_fn`. Under autograph (tf.function
    converts Horovod's code) the frames live in generated files and nested helpers, hence the search.
    """
    frame = sys._getframe(2)
    op, found_op, in_cond = None, False, False
    for _ in range(48):
        if frame is None:
            break
        name = frame.f_code.co_name
        if name in ("allreduce_fn", "tf__allreduce_fn"):
            in_cond = True
            break
        if name in ("allreduce_grads", "tf__allreduce_grads"):
            break
        if not found_op:
            loc = frame.f_locals
            if loc.get("compression") is compression and "op" in loc:
                op, found_op = loc["op"], True
        frame = frame.f_back
    return in_cond, op


def _step_graph(in_cond: bool) -> Any:
    """The graph that holds one step's "begin step" op: the one Horovod's cond is built in."""
    g = tf.compat.v1.get_default_graph()
    if in_cond and type(g).__name__ == "CondBranchFuncGraph" and getattr(g, "outer_graph", None) is not None:
        return g.outer_graph
    return g


def _check_op(op: Any) -> None:
    if op is not None and op == hvd.Adasum:
        raise ValueError("crossover compression does not support op=hvd.Adasum (Adasum combines parameter "
                         "deltas, not gradients): use op=hvd.Average or hvd.Sum, or "
                         "compression=hvd.Compression.none with Adasum")


def _mix(seed: int, key: str) -> int:
    """A 31-bit seed shared by all ranks for a tensor (FNV-1a of seed and key)."""
    h = 1469598103934665603
    for ch in f"{seed}:{key}".encode():
        h = ((h ^ ch) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFF


def _safe_name(key: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in key)


def _k_for(numel: int, cf: tf.Tensor) -> tf.Tensor:
    """Elements kept at compression factor cf, as crossover.compression.selectors.k_for: ceil(n / cf) in [1, n]."""
    k = tf.math.ceil(tf.constant(float(numel), tf.float64) / cf)
    return tf.cast(tf.clip_by_value(k, 1.0, float(numel)), tf.int32)


def _transport(numel: int, k: tf.Tensor, world: int, shared: bool) -> tf.Tensor:
    """crossover.compression.cost_model.choose_transport in graph (k is known at run time only).

    Shared indices allreduce; rank-specific ones allgather (index + value, 8 bytes) while that sends
    fewer bytes than a ring allreduce of the dense fp32 tensor, i.e. while (n-1) k 8 < 2 (n-1)/n numel 4.
    """
    if shared:
        return tf.where(k >= numel, _MODE_DENSE, _MODE_ALLREDUCE)
    ag = float(world - 1) * tf.cast(k, tf.float64) * 8.0
    ar = 2.0 * (world - 1) / world * numel * 4.0
    return tf.where(tf.logical_and(k < numel, ag < ar), _MODE_ALLGATHER, _MODE_DENSE)


def _stratified_indices(numel: int, k: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """k sorted distinct indices < numel, one per stratum [j n // k, (j+1) n // k), from a shared seed."""
    j = tf.range(tf.cast(k, tf.int64), dtype=tf.int64)
    k64 = tf.cast(k, tf.int64)
    lo = j * numel // k64
    width = (j + 1) * numel // k64 - lo
    u = tf.random.stateless_uniform(tf.shape(j), seed=seed, dtype=tf.float64)
    off = tf.minimum(tf.cast(tf.floor(u * tf.cast(width, tf.float64)), tf.int64), width - 1)
    return tf.cast(lo + off, tf.int32)


# ---------------------------------------------------------------------------------------------
# Shared base: one "begin step" op per traced step, variables, byte counters
# ---------------------------------------------------------------------------------------------
class _TFBase:
    """Plan-per-step plumbing shared by the sparsifying and the quantizing TF compressions."""

    _plan_len = 1

    def __init__(self, *, min_compress_numel: int, error_feedback: bool, seed: int) -> None:
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) \
                or min_compress_numel < 1:
            raise ValueError(f"min_compress_numel must be an int >= 1, got {min_compress_numel!r}")
        self.min_compress_numel = min_compress_numel
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self._uid = next(_INSTANCES)  # in collective names: two objects' tensors never share a name
        self._lock = threading.RLock()
        self._plans: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._residuals: dict[str, tf.Variable] = {}
        self._pending_residuals: dict[str, np.ndarray] = {}
        self._acc_var: tf.Variable | None = None
        self._eager_plan: tf.Tensor | None = None
        self._eager_phase = "idle"
        self._eager_ordinal = 0
        self._bytes_sent = 0
        self._bytes_dense = 0
        self._step = 0

    # Horovod hashes the compression (its cached allreduce function is keyed by it): keep identity hashing.
    __hash__ = object.__hash__

    # ------------------------------------------------------------------ variables
    def _acc(self) -> tf.Variable:
        if self._acc_var is None:
            with tf.init_scope():
                self._acc_var = tf.Variable(tf.zeros([self._acc_len()], tf.float64), trainable=False,
                                            name="crossover_step_stats")
        return self._acc_var

    def _acc_len(self) -> int:
        return _ACC

    def _residual(self, key: str, numel: int) -> tf.Variable:
        var = self._residuals.get(key)
        if var is None or int(var.shape[0]) != numel:
            init = self._pending_residuals.pop(key, None)
            if init is None or init.size != numel:
                init = np.zeros(numel, np.float32)
            with tf.init_scope():
                var = tf.Variable(init, trainable=False, name="crossover_residual_" + _safe_name(key))
            self._residuals[key] = var
        return var

    def _read_and_clear(self) -> np.ndarray:
        var = self._acc()
        acc = var.numpy()
        var.assign(tf.zeros_like(var))
        return acc

    # ------------------------------------------------------------------ the plan of a step
    def _plan(self, in_cond: bool) -> tuple[tf.Tensor, str]:
        """(this step's plan tensor, an ordinal key for the next compressed tensor of this trace)."""
        if tf.executing_eagerly():  # direct eager hvd.allreduce calls: first compress after a decompress
            if self._eager_phase != "compress" or self._eager_plan is None:
                self._eager_plan = tf.constant(self._rt_begin())
                self._eager_phase = "compress"
                self._eager_ordinal = 0
            key = f"#{self._eager_ordinal}"
            self._eager_ordinal += 1
            return self._eager_plan, key
        graph = _step_graph(in_cond)
        entry = self._plans.get(graph)
        if entry is None:
            self._acc()
            with graph.as_default():
                plan = tf.py_function(self._rt_begin, [], tf.float64, name="crossover_begin_step")
                plan.set_shape([self._plan_len])
            entry = {"plan": plan, "ordinal": 0}
            self._plans[graph] = entry
        key = f"#{entry['ordinal']}"
        entry["ordinal"] += 1
        return entry["plan"], key

    def _rt_begin(self) -> np.ndarray:
        raise NotImplementedError

    def _passthrough(self, tensor: Any, plan: tf.Tensor | None) -> tuple[Any, None]:
        """Count a tensor that goes through untouched (it is Horovod's own dense path)."""
        nbytes = tf.cast(tf.size(tensor), tf.float64) * tensor.dtype.size
        vec = tf.concat([tf.zeros([self._acc_len() - 2], tf.float64), tf.stack([nbytes, nbytes])], 0)
        # after this step's "begin step" (which reads and clears the accumulator); with no plan
        # (compression off) nothing ever clears it, so it simply accumulates
        with tf.control_dependencies([plan] if plan is not None else []):
            upd = self._acc().assign_add(vec)
        with tf.control_dependencies([upd]):
            return tf.identity(tensor), None

    def _mark_decompressed(self) -> None:
        if tf.executing_eagerly():
            self._eager_phase = "decompress"

    def _bytes_now(self) -> tuple[int, int]:
        """Cumulative bytes including the last step, whose statistics no "begin step" has read yet."""
        acc = self._acc_var.numpy() if self._acc_var is not None else np.zeros(self._acc_len())
        return self._bytes_sent + int(acc[-2]), self._bytes_dense + int(acc[-1])

    def reset(self) -> None:
        """Forget the step in flight (Horovod elastic reset); policy state stays."""
        with self._lock:
            if self._acc_var is not None:
                acc = self._read_and_clear()
                self._bytes_sent += int(acc[-2])
                self._bytes_dense += int(acc[-1])
            self._reset_step_state()
            self._eager_phase = "idle"

    def _reset_step_state(self) -> None:
        pass

    def _residuals_state(self) -> dict[str, np.ndarray]:
        out = {k: v.numpy().copy() for k, v in self._residuals.items()}
        out.update({k: v.copy() for k, v in self._pending_residuals.items() if k not in out})
        return out

    def _load_residuals(self, residuals: Mapping[str, Any]) -> None:
        for key, value in residuals.items():
            arr = np.asarray(value, np.float32).reshape(-1)
            var = self._residuals.get(key)
            if var is not None and int(var.shape[0]) == arr.size:
                var.assign(arr)
            else:
                self._pending_residuals[key] = arr  # assigned when the tensor is traced


# ---------------------------------------------------------------------------------------------
# Sparsification (GraVAC / static)
# ---------------------------------------------------------------------------------------------
@dataclass
class _StepAccum:
    """Global statistics of one step (as in torch_compression)."""

    sent_cf: float
    probes: tuple[float, ...]
    dense_sq: float = 0.0
    probe_sq: list[float] = field(default_factory=list)
    prev_step_time: float | None = None
    bytes_sent: int = 0
    bytes_dense: int = 0
    tensors: int = 0


@dataclass
class _Ctx:
    mode: tf.Tensor
    numel: int
    shape: tf.TensorShape
    gathered: tf.Tensor
    idx: tf.Tensor
    k: tf.Tensor
    sent_bytes: tf.Tensor
    dense_bytes: float


class _SparseCompressionBase(_TFBase):
    """Selection (top-k, random-k), error feedback, transport and telemetry for horovod.tensorflow."""

    _plan_len = 5  # [send_cf, floor_cf, candidate_cf, step, previous step time]

    def __init__(self, compressor: str, policy: Any, *, error_feedback: bool, min_compress_numel: int,
                 seed: int, log_csv: str | None, passthrough: bool = False) -> None:
        if compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {', '.join(COMPRESSORS)} with horovod.tensorflow "
                             f"(dgc and redsync have torch kernels only); got {compressor!r}")
        super().__init__(min_compress_numel=min_compress_numel, error_feedback=error_feedback, seed=seed)
        self.compressor = compressor
        self.shared_indices = compressor == "randomk"
        self.policy = policy
        self.log_csv = log_csv
        self._passthrough_all = passthrough  # compression off: Horovod's dense path, untouched
        self._reset_step_state()

    def _reset_step_state(self) -> None:
        self._cur: _StepAccum | None = None
        self._pending: _StepAccum | None = None
        self._step_start: float | None = None
        self._last_step_time = 0.0

    # ------------------------------------------------------------------ run time (py_function)
    def _rt_begin(self) -> np.ndarray:
        """Once per step, before any compress of it runs: read the last step, observe, plan."""
        with self._lock:
            acc = self._read_and_clear()
            self._bytes_sent += int(acc[5])
            self._bytes_dense += int(acc[6])
            now = time.perf_counter()
            if self._step_start is not None:
                self._last_step_time = now - self._step_start
            self._step_start = now
            self._step += 1
            cur = self._cur
            if cur is not None:
                cur.tensors = int(acc[0])
                if cur.tensors:
                    cur.prev_step_time = float(acc[1]) / cur.tensors
                cur.dense_sq = float(acc[2])
                cur.probe_sq = [float(acc[3]), float(acc[4])][:len(cur.probes)]
                cur.bytes_sent, cur.bytes_dense = int(acc[5]), int(acc[6])
                self._finish_step(cur)
            plan = self.policy.plan()
            probes = tuple(float(p) for p in plan.probe_cfs)
            send = float(plan.send_cf)
            floor = probes[0] if probes else send
            cand = probes[-1] if probes else send
            if send not in (1.0, floor, cand):
                raise RuntimeError(f"policy plan {plan!r}: send_cf must be 1 or a probed CF")
            self._cur = _StepAccum(sent_cf=send, probes=probes, probe_sq=[0.0] * len(probes))
            return np.array([send, floor, cand, float(self._step), self._last_step_time], np.float64)

    def _finish_step(self, acc: _StepAccum) -> None:
        """Step t's gains are known now; its time arrives with step t+1: observe one step late."""
        if self._pending is not None and acc.prev_step_time is not None:
            p = self._pending
            self.policy.observe(StepStats(
                sent_cf=p.sent_cf, dense_sq_norm=p.dense_sq,
                compressed_sq_norms=dict(zip(p.probes, p.probe_sq)),
                step_time_s=acc.prev_step_time, samples=1.0))
            self._write_csv(p, acc.prev_step_time)
        self._pending = acc if acc.tensors else None

    # ------------------------------------------------------------------ Horovod interface (traced)
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Called by Horovod per gradient while tracing; returns the tensor to allreduce and a context."""
        in_cond, op = _horovod_context(self)
        _check_op(op)
        if isinstance(tensor, tf.IndexedSlices):  # Horovod allgathers these itself; never compressed
            return tensor, None
        if self._passthrough_all:  # compression off: only count bytes (no plan, no step bookkeeping)
            return self._passthrough(tensor, None)
        plan, key = self._plan(in_cond)
        numel = tensor.shape.num_elements()
        if tensor.dtype != tf.float32 or numel is None or numel < self.min_compress_numel:
            return self._passthrough(tensor, plan)
        return self._compress_float(tensor, plan, key, numel)

    def _compress_float(self, tensor: tf.Tensor, plan: tf.Tensor, key: str, numel: int) -> tuple[Any, Any]:
        world = hvd.size()
        send, floor, cand = plan[0], plan[1], plan[2]
        step = tf.cast(plan[3], tf.int64)
        x = tf.reshape(tensor, [-1])
        residual = self._residual(key, numel) if self.error_feedback else None
        acc = x + residual.read_value() if residual is not None else x
        dense_sq = tf.reduce_sum(tf.square(acc))
        k_floor, k_cand = _k_for(numel, floor), _k_for(numel, cand)
        k_send = tf.where(send > 1.0, _k_for(numel, tf.maximum(send, 1.0)), numel)
        mode = tf.where(send > 1.0, _transport(numel, k_send, world, self.shared_indices), _MODE_DENSE)
        seed = tf.stack([tf.constant(_mix(self.seed, key), tf.int64), step])
        if self.shared_indices:
            # floor: stratified shared indices; candidate: a shared random subset of them (multi-level)
            idx_floor = _stratified_indices(numel, k_floor, seed)
            vals_floor = tf.gather(acc, idx_floor)
            sub = tf.sort(tf.random.experimental.stateless_shuffle(
                tf.range(k_floor), seed=seed + tf.constant([0, 0x5DEECE66D], tf.int64))[:k_cand])
            sq_floor = tf.reduce_sum(tf.square(vals_floor))
            sq_cand = tf.reduce_sum(tf.square(tf.gather(vals_floor, sub)))
            idx_send = tf.cond(k_send >= k_floor, lambda: idx_floor, lambda: tf.gather(idx_floor, sub))
        else:
            # exact top-k of |acc| at the floor, sorted: the candidate and the sent set are prefixes of it
            _, idx_floor = tf.math.top_k(tf.abs(acc), k_floor, sorted=True)
            cum = tf.cumsum(tf.square(tf.gather(acc, idx_floor)))
            sq_floor, sq_cand = cum[k_floor - 1], cum[k_cand - 1]
            idx_send = idx_floor[:tf.minimum(k_send, k_floor)]
        stats = tf.stack([tf.constant(1.0), tf.cast(plan[4], tf.float32), dense_sq, sq_floor, sq_cand])
        name = f"crossover.allgather.{self._uid}.{_safe_name(key)}"

        def dense_branch():
            return (tf.concat([acc, stats], 0), tf.zeros([0, 2], tf.int32), tf.zeros([0], tf.int32),
                    tf.zeros_like(acc))

        def allgather_branch():
            vals = tf.gather(acc, idx_send)
            packed = tf.stack([idx_send, tf.bitcast(vals, tf.int32)], axis=1)
            gathered = hvd.allgather(packed, name=name)
            left = tf.tensor_scatter_nd_update(acc, idx_send[:, None], tf.zeros_like(vals))
            return stats, gathered, idx_send, left

        def allreduce_branch():
            vals = tf.gather(acc, idx_send)
            left = tf.tensor_scatter_nd_update(acc, idx_send[:, None], tf.zeros_like(vals))
            return tf.concat([vals, stats], 0), tf.zeros([0, 2], tf.int32), idx_send, left

        payload, gathered, idx, left = tf.switch_case(mode, [dense_branch, allgather_branch, allreduce_branch])
        payload.set_shape([None])
        deps = []
        if residual is not None:
            deps.append(residual.assign(left))
        sent = tf.cast(tf.size(payload) * 4, tf.float64)  # what this rank hands to Horovod, in bytes
        sent += tf.where(tf.equal(mode, _MODE_ALLGATHER), tf.cast(k_send, tf.float64) * 8.0, 0.0)
        with tf.control_dependencies(deps):
            payload = tf.identity(payload)
        ctx = _Ctx(mode=mode, numel=numel, shape=tensor.shape, gathered=gathered, idx=idx,
                   k=tf.minimum(k_send, numel), sent_bytes=sent, dense_bytes=float(numel * 4))
        return payload, ctx

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Called by Horovod (traced) with the reduced payload; returns the averaged gradient."""
        if ctx is None:
            self._mark_decompressed()
            return tensor
        world = hvd.size()
        stats = tf.cast(tensor[-_NSTATS:], tf.float64)
        scale = stats[0]  # 1 for Average, world size for Sum (times any pre/postscale)
        ok = scale > 0
        safe = tf.where(ok, scale, 1.0)
        to_sum = world / safe  # turns a reduced statistic into the sum over ranks
        vec = tf.stack([tf.constant(1.0, tf.float64), stats[1] / safe, stats[2] * to_sum, stats[3] * to_sum,
                        stats[4] * to_sum, ctx.sent_bytes, tf.constant(ctx.dense_bytes, tf.float64)])
        vec = tf.where(ok, vec, tf.constant([0, 0, 0, 0, 0, 1, 1], tf.float64) * vec)
        upd = self._acc().assign_add(vec)
        n = ctx.numel
        factor = tf.cast(safe / world, tf.float32)

        def dense():
            return tensor[:n]

        def gathered():
            idx = ctx.gathered[:, 0]
            vals = tf.bitcast(ctx.gathered[:, 1], tf.float32) * factor
            return tf.scatter_nd(idx[:, None], vals, [n])  # overlapping indices add up

        def shared():
            return tf.scatter_nd(ctx.idx[:, None], tensor[:ctx.k], [n])

        out = tf.switch_case(ctx.mode, [dense, gathered, shared])
        with tf.control_dependencies([upd]):
            out = tf.reshape(tf.identity(out), ctx.shape)
        self._mark_decompressed()
        return out

    # ------------------------------------------------------------------ telemetry and state
    def stats(self) -> dict[str, Any]:
        """Cumulative telemetry of this rank: step, CF in use, gain, bytes sent vs dense (torch keys)."""
        with self._lock:
            summary = self.policy.summary()
            cf = summary.get("send_cf", 1.0)
            gains = summary.get("gains", {}) or {}
            gain = gains.get(cf, 1.0 if cf == 1.0 else None)
            sent, dense = self._bytes_now()
            return {"step": self._step, "compression_factor": cf, "gain": gain, "bytes_sent": sent,
                    "bytes_dense": dense, "compressor": self.compressor, "policy": summary}

    def _write_csv(self, p: _StepAccum, step_time: float) -> None:
        if not self.log_csv:
            return
        path = self.log_csv.format(rank=hvd.rank())
        new = not os.path.exists(path)
        with open(path, "a", newline="") as fh:
            w = csv.writer(fh)
            if new:
                w.writerow(["step", "sent_cf", "step_time_s", "bytes_sent", "bytes_dense"]
                           + [f"gain_cf{cf:g}" for cf in p.probes])
            gains = [math.sqrt(sq / p.dense_sq) if p.dense_sq > 0 else "" for sq in p.probe_sq]
            w.writerow([self._step - 2, p.sent_cf, f"{step_time:.6f}", p.bytes_sent, p.bytes_dense] + gains)

    def state_dict(self, include_residuals: bool = True) -> dict[str, Any]:
        """Everything a resumed run needs to continue the same schedule (residuals as numpy arrays)."""
        with self._lock:
            sent, dense = self._bytes_now()
            state = {"version": _STATE_VERSION, "compressor": self.compressor, "seed": self.seed,
                     "policy": self.policy.state_dict(), "bytes_sent": sent, "bytes_dense": dense,
                     "step": self._step, "current": _accum_to_dict(self._cur),
                     "pending": _accum_to_dict(self._pending), "last_step_time": self._last_step_time}
            if include_residuals:
                state["residuals"] = self._residuals_state()
            return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()` (between steps); the step in flight, if any, is dropped."""
        if state.get("version") != _STATE_VERSION or state.get("compressor") != self.compressor:
            raise ValueError(f"state is for compressor {state.get('compressor')!r} version "
                             f"{state.get('version')!r}; this is {self.compressor!r} v{_STATE_VERSION}")
        with self._lock:
            self.policy.load_state_dict(state["policy"])
            self.seed = int(state["seed"])
            if self._acc_var is not None:
                self._read_and_clear()
            self._bytes_sent = int(state.get("bytes_sent", 0))
            self._bytes_dense = int(state.get("bytes_dense", 0))
            self._step = int(state.get("step", 0))
            if "residuals" in state:
                self._load_residuals(state["residuals"])
            self._reset_step_state()
            self._cur = _accum_from_dict(state.get("current"))
            self._pending = _accum_from_dict(state.get("pending"))
            self._last_step_time = float(state.get("last_step_time", 0.0))
            if self._cur is not None:  # its statistics were in the accumulator: they are lost
                self._cur.tensors = 0

    def sync(self, root_rank: int = 0) -> None:
        """Make every rank's policy state equal to `root_rank`'s (elastic reset, resume); residuals stay."""
        state = hvd.broadcast_object(self.state_dict(include_residuals=False), root_rank=root_rank,
                                     name="crossover.compression.sync")
        self.load_state_dict(state)


class AdaptiveCompression(_SparseCompressionBase):
    """GraVAC for horovod.tensorflow: sparsify with `compressor`, adapting the compression factor.

    Same parameters as the torch object (docs/compression.md); `compressor` is "topk" (exact top-k,
    allgather) or "randomk" (shared seed, allreduce). `enabled=False`: Horovod's dense path, untouched.
    `policy="dqsgd"` returns a DqsgdCompression (quantization bits per step) instead.
    """

    def __new__(cls, *args: Any, policy: str = "gravac", **kwargs: Any) -> Any:
        """policy="dqsgd" gives a tf_quantization.DqsgdCompression instead of GraVAC."""
        if policy == "dqsgd":
            from .tf_quantization import DqsgdCompression

            return dqsgd_instead(DqsgdCompression, args, kwargs)
        return super().__new__(cls)

    def __init__(self, compressor: str = "topk", *, cf_min: float = 10.0, cf_max: float = 1000.0,
                 epsilon: float = 0.9, omega: float = 0.01, window: int = 500,
                 scaling: str = "exponential", warmup_steps: int = 0, ewma_alpha: float = 0.1,
                 error_feedback: bool = True, min_compress_numel: int = 16384, enabled: bool = True,
                 seed: int = 0, log_csv: str | None = None, policy: str = "gravac") -> None:
        pol = gravac_or_dense(enabled, policy, cf_min=cf_min, cf_max=cf_max, epsilon=epsilon, omega=omega,
                              window=window, scaling=scaling, warmup_steps=warmup_steps, ewma_alpha=ewma_alpha)
        super().__init__(compressor, pol, error_feedback=error_feedback, min_compress_numel=min_compress_numel,
                         seed=seed, log_csv=log_csv, passthrough=not enabled)
        self.enabled = bool(enabled)


class StaticCompression(_SparseCompressionBase):
    """A fixed compression factor: `StaticCompression("topk", cf=100)` is static top-k at 1 %."""

    def __init__(self, compressor: str = "topk", *, cf: float = 100.0, error_feedback: bool = True,
                 min_compress_numel: int = 16384, seed: int = 0, log_csv: str | None = None) -> None:
        pol = StaticPolicy(cf=cf)
        super().__init__(compressor, pol, error_feedback=error_feedback, min_compress_numel=min_compress_numel,
                         seed=seed, log_csv=log_csv, passthrough=pol.plan().send_cf == 1.0)


class FP16Compression:
    """fp16 casts (like hvd.Compression.fp16) with byte counters; summable, so plain allreduce."""

    __hash__ = object.__hash__

    def __init__(self) -> None:
        self._counts: tf.Variable | None = None

    def _var(self) -> tf.Variable:
        if self._counts is None:
            with tf.init_scope():
                self._counts = tf.Variable(tf.zeros([2], tf.int64), trainable=False, name="crossover_fp16_bytes")
        return self._counts

    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Cast float32/float64 to float16 (others untouched) and count bytes."""
        _check_op(_horovod_context(self)[1])
        if isinstance(tensor, tf.IndexedSlices):
            return tensor, None
        n = tf.cast(tf.size(tensor), tf.int64)
        if tensor.dtype in (tf.float32, tf.float64):
            out, ctx = tf.cast(tensor, tf.float16), tensor.dtype
            sent = n * 2
        else:
            out, ctx = tensor, None
            sent = n * tensor.dtype.size
        upd = self._var().assign_add(tf.stack([sent, n * tensor.dtype.size]))
        with tf.control_dependencies([upd]):
            return tf.identity(out), ctx

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Cast back to the gradient's dtype."""
        return tensor if ctx is None else tf.cast(tensor, ctx)

    def stats(self) -> dict[str, Any]:
        """Bytes handed to Horovod vs the dense bytes (same keys as the other compressions)."""
        sent, dense = (int(v) for v in self._var().numpy())
        return {"step": None, "compression_factor": 2.0, "gain": None, "bytes_sent": sent, "bytes_dense": dense}


def _accum_to_dict(acc: _StepAccum | None) -> dict[str, Any] | None:
    return None if acc is None else {**asdict(acc), "probes": list(acc.probes)}


def _accum_from_dict(d: Mapping[str, Any] | None) -> _StepAccum | None:
    if d is None:
        return None
    return _StepAccum(**{**d, "probes": tuple(d["probes"]), "probe_sq": list(d["probe_sq"])})
