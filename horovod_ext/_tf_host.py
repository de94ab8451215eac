"""What every horovod.tensorflow compression object of crossover shares: Horovod's side of the hook.

Horovod calls `compress(tensor)` and `decompress(tensor, ctx)` while *tracing* a `tf.function`
(once, not per step), around an allreduce inside a `tf.cond`. So nothing per step happens in
Python at trace time: per-step decisions come from a `tf.py_function` ("begin step") placed once
per traced step, outside Horovod's conds, whose output (the plan) every compress of that step
reads. It feeds the step driver (crossover/driver/) and returns its plan. State lives in
`tf.Variable`s: per-tensor error-feedback residuals, and an accumulator of the step's reduced
statistics that decompress adds to and the next "begin step" reads and clears.

Where compress is traced from (Horovod's op, its cond) is read in horovod_ext/_internals.py.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from crossover.compression.checks import check_flag, check_seed
from crossover.driver import check_min_numel
from crossover.driver.flat import user_stats
from horovod_ext._class_guard import CompressionType, guard_constructors
from horovod_ext._internals import ADASUM_ERROR, tf_hook_context

__all__ = ["INSIDE_FUNCTION_ERROR", "TFHookBase", "check_built_outside_function", "check_op", "safe_name",
           "hook_context", "tracing_function"]

# compression=AdaptiveCompression (the class) fails when the optimizer or tape is built
guard_constructors(hvd, ("DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape"))
log = logging.getLogger(__name__)
_INSTANCES = itertools.count()  # objects are created in the same order on every rank: a shared id
INSIDE_FUNCTION_ERROR = (
    "crossover's {name} was created inside a tf.function. It keeps state across steps (tf.Variables: "
    "error-feedback residuals, statistics; the policy's state in Python), and TensorFlow traces a function "
    "more than once, creating a new object each time (\"only supports singleton tf.Variables\"). Build it once, "
    "outside the tf.function (next to the model and optimizer), and pass that object to "
    "hvd.DistributedGradientTape(tape, compression=...) inside. (crossover's FP16Compression may be built "
    "inside, like hvd.Compression.fp16.)")


def tracing_function() -> bool:
    """Whether this runs while a tf.function is traced (not under its `tf.init_scope()`, not TF1 graph mode)."""
    return tf.inside_function() and not tf.executing_eagerly()


def check_built_outside_function(obj: Any) -> None:
    """Raise INSIDE_FUNCTION_ERROR when a stateful compression object is being built while tracing."""
    if tracing_function():
        name = type(getattr(obj, "_hook_owner", obj)).__name__
        raise RuntimeError(INSIDE_FUNCTION_ERROR.format(name=name))


def hook_context(compression: Any) -> tuple[bool, Any]:
    """(traced inside Horovod's allreduce cond, Horovod's op) for `compression.compress` (its caller)."""
    return tf_hook_context(getattr(compression, "_hook_owner", compression), depth=3)


def check_op(op: Any) -> None:
    """Refuse Adasum (it combines parameter deltas, not gradients)."""
    if op is not None and op == hvd.Adasum:
        raise ValueError(ADASUM_ERROR)


def step_graph(in_cond: bool) -> Any:
    """The graph that holds one step's "begin step" op: the one Horovod's cond is built in."""
    g = tf.compat.v1.get_default_graph()
    if in_cond and type(g).__name__ == "CondBranchFuncGraph" and getattr(g, "outer_graph", None) is not None:
        return g.outer_graph
    return g


def safe_name(key: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in key)


class TFHookBase(metaclass=CompressionType):
    """Plan-per-step plumbing shared by the sparsifying and the quantizing TF compressions."""

    _plan_len = 1
    _passthrough_all = False  # compression off (enabled=False): Horovod's dense path, only bytes are counted

    def __init__(self, *, min_compress_numel: int, error_feedback: bool, seed: int) -> None:
        check_built_outside_function(self)
        self.min_compress_numel = check_min_numel(min_compress_numel)
        self.error_feedback = check_flag("error_feedback", error_feedback)
        self.seed = check_seed(seed)
        self._uid = next(_INSTANCES)  # in collective names: two objects' tensors never share a name
        self._lock = threading.RLock()
        self._plans: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._residuals: dict[str, tf.Variable] = {}
        self._pending_residuals: dict[str, np.ndarray] = {}
        self._acc_var: tf.Variable | None = None
        self._eager_plan: tf.Tensor | None = None
        self._eager_phase = "idle"
        self._eager_ordinal = 0
        self._warned_dtype = False
        self.driver: Any = None  # the subclass's step driver (crossover/driver/)

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
        """Length of the in-graph accumulator; its last two slots are bytes sent and bytes dense."""
        raise NotImplementedError

    def _residual(self, key: str, numel: int) -> tf.Variable:
        var = self._residuals.get(key)
        if var is None or int(var.shape[0]) != numel:
            init = self._pending_residuals.pop(key, None)
            if init is None or init.size != numel:
                init = np.zeros(numel, np.float32)
            with tf.init_scope():
                var = tf.Variable(init, trainable=False, name="crossover_residual_" + safe_name(key))
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
        graph = step_graph(in_cond)
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

    # ------------------------------------------------------------------ Horovod interface (traced)
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Called by Horovod per gradient while tracing; returns the tensor to allreduce and a context."""
        in_cond, op = hook_context(self)
        check_op(op)
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
        raise NotImplementedError

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Called by Horovod (traced) with the reduced payload; returns the averaged gradient."""
        if ctx is None:
            self._mark_decompressed()
            return tensor
        return self._decompress_payload(tensor, ctx)

    def _decompress_payload(self, tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError

    def _passthrough(self, tensor: Any, plan: tf.Tensor | None) -> tuple[Any, None]:
        """Count a tensor that goes through untouched (it is Horovod's own dense path)."""
        if tensor.dtype in (tf.float16, tf.bfloat16, tf.float64) and not self._warned_dtype:
            self._warned_dtype = True  # said once, when the step is traced
            log.warning("crossover: gradients of dtype %s go through uncompressed (Horovod's dense path; crossover "
                        "compresses float32 gradients only, which is what Keras' mixed_float16 policy keeps)",
                        tensor.dtype.name)
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
        return self.driver.bytes_sent + int(acc[-2]), self.driver.bytes_dense + int(acc[-1])

    def reset(self) -> None:
        """Forget the step in flight (Horovod elastic reset); policy state stays."""
        with self._lock:
            if self._acc_var is not None:
                acc = self._read_and_clear()
                self.driver.count(int(acc[-2]), int(acc[-1]))
            self.driver.reset()
            self._eager_phase = "idle"

    def stats(self, debug: bool = False) -> dict[str, Any]:
        """Cumulative telemetry of this rank (the torch objects' keys): the driver's, with the bytes of
        the last step that no "begin step" has read yet; `debug`: the policy's internals too."""
        with self._lock:
            out = self.driver.stats()
            out["bytes_sent"], out["bytes_dense"] = self._bytes_now()
            return user_stats(out, debug)

    def close_tensorboard(self) -> None:
        """`tensorboard=`: log the step in flight, write everything, stop logging (done at exit anyway)."""
        with self._lock:
            self.driver.close_tensorboard()

    def _residuals_state(self) -> dict[str, np.ndarray]:
        out = {k: v.numpy().copy() for k, v in self._residuals.items()}
        out.update({k: v.copy() for k, v in self._pending_residuals.items() if k not in out})
        return out

    def _check_residuals(self, residuals: object) -> dict[str, np.ndarray]:
        """Saved residuals as flat float32 arrays, checked before anything is applied (as the torch objects):
        a mapping of str keys to finite numeric arrays, each of its variable's size when it exists."""
        if not isinstance(residuals, Mapping):
            raise ValueError(f"residuals must be a mapping of key -> array, got {type(residuals).__name__}")
        out = {}
        for key, value in residuals.items():
            if not isinstance(key, str) or isinstance(value, (str, bytes)) or value is None:
                raise ValueError(f"residual {key!r} must be a numeric array under a str key, "
                                 f"got {type(value).__name__}")
            try:
                arr = np.asarray(value, np.float32).reshape(-1)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"residual {key!r} is not a numeric array: {exc}") from None
            if not np.isfinite(arr).all():
                raise ValueError(f"residual {key!r} holds inf/NaN values")
            var = self._residuals.get(key)
            if var is not None and int(var.shape[0]) != arr.size:
                raise ValueError(f"residual {key!r} has {arr.size} elements; this run's tensor has {int(var.shape[0])}")
            out[key] = arr
        return out

    def _load_residuals(self, residuals: Mapping[str, np.ndarray]) -> None:
        """Assign residuals checked by `_check_residuals`."""
        for key, arr in residuals.items():
            var = self._residuals.get(key)
            if var is not None and int(var.shape[0]) == arr.size:
                var.assign(arr)
            else:
                self._pending_residuals[key] = arr  # assigned when the tensor is traced
