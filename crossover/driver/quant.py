"""The step driver of quantization (DQ-SGD / QSGD): bits per step instead of a compression factor, statistics
``[1, ||x||^2]`` (``crossover.compression.wire.QUANT_STATS_LEN``), and DQ-SGD's budget calibration on the first
usable step. Plain numbers in and out, like the sparse driver (``sparse.py``)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from crossover.adaptive.dqsgd import DqsgdPolicy, DqsgdStats, error_budget_for_bits
from crossover.compression.checks import check_int
from crossover.compression.wire import MAX_BITS, MIN_BITS
from crossover.driver.flat import flat_stats
from crossover.driver.tboard import TensorBoardLog

__all__ = ["QUANT_STATE_VERSION", "QuantStepDriver"]

log = logging.getLogger("crossover.driver")

QUANT_STATE_VERSION = 1


class QuantStepDriver:
    """Bits per step: fixed (QSGD) or from DQ-SGD, fed the reduced ||x||^2 one step later.

    `dqsgd`: None for fixed `bits`; else the DQ-SGD settings (`total_steps`, `b_min`, `b_max`, `decay`,
    `target_bits`, `error_budget` (None: calibrated on the first usable step)). `tensorboard`: see
    `attach_tensorboard` (`rank` says which rank writes to a directory).
    """

    def __init__(self, *, bits: int, dqsgd: Mapping[str, Any] | None = None, tensorboard: Any = None,
                 rank: Callable[[], int] = lambda: 0) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(f"bits must be an int in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
        self.fixed_bits = bits
        self.step = 0
        self.bytes_sent = 0
        self.bytes_dense = 0
        self.nonfinite_steps = 0
        self.policy: DqsgdPolicy | None = None
        self._dq = dict(dqsgd) if dqsgd is not None else None
        if self._dq is not None:
            kw = self._policy_kw()
            budget = self._dq.get("error_budget")
            # validates the settings now (construction), not on the first step
            probe = DqsgdPolicy(error_budget=1.0 if budget is None else budget, **kw)
            self.policy = probe if budget is not None else None
            self._summary_keys = tuple(probe.summary())  # stats() has them (None) before calibration too
        self.bits = self._plan_bits()
        self.tensorboard: TensorBoardLog | None = None
        self._tb_mark: tuple[float, int, int] = (0.0, 0, 0)  # (start time, bytes sent, bytes dense) of this step
        if tensorboard is not None:
            self.attach_tensorboard(tensorboard, rank)
        self._prev_numel = 0  # elements quantized in the step before the one in flight (stats())
        self.reset()

    def _policy_kw(self) -> dict[str, Any]:
        dq = self._dq or {}
        return {"total_steps": dq["total_steps"], "b_min": dq["b_min"], "b_max": dq["b_max"],
                "decay": dq["decay"], "initial_bits": dq["target_bits"]}

    @property
    def adaptive(self) -> bool:
        return self._dq is not None

    def reset(self) -> None:
        """Forget the step in flight (elastic reset); policy state stays."""
        self._sq = 0.0
        self._have_sq = False
        self._nonfinite = False
        self._numel = 0
        self.lr: float | None = None

    def begin_step(self, world: int) -> int:
        """A new step begins: observe the last one (DQ-SGD; not a non-finite one), return this step's bits."""
        if self.step > 0 and self._have_sq and not self._nonfinite:
            self._observe(self._sq, world)
        if self.tensorboard is not None:
            self._tb_step(time.perf_counter())
        self.step += 1
        self._prev_numel = self._numel
        self._sq, self._have_sq, self._nonfinite, self._numel = 0.0, False, False, 0
        self.bits = self._plan_bits()
        return self.bits

    # ------------------------------------------------------------------ TensorBoard
    def attach_tensorboard(self, target: Any, rank: Callable[[], int]) -> None:
        """Log per-step scalars to `target` (a directory: rank 0 writes; or a SummaryWriter); ValueError if bad."""
        self.tensorboard = TensorBoardLog(target, rank, final=self._tb_final)

    def close_tensorboard(self) -> None:
        """Log the step in flight, write everything queued and stop logging (also done at exit)."""
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _tb_step(self, now: float | None) -> None:
        """The step in flight ends (`now`; None at close: no duration): its bits, bytes and duration."""
        start, sent0, dense0 = self._tb_mark
        if self.step > 0:
            dense = self.bytes_dense - dense0
            self.tensorboard.scalars(self.step, (  # type: ignore[union-attr]
                ("bits", self.bits), ("bytes_sent_over_dense", (self.bytes_sent - sent0) / dense if dense else None),
                ("step_time_s", now - start if now is not None and start else None)))
        self._tb_mark = (now or 0.0, self.bytes_sent, self.bytes_dense)

    def _tb_final(self) -> None:
        self._tb_step(None)

    def _plan_bits(self) -> int:
        if self._dq is None:
            return self.fixed_bits
        return int(self._dq["target_bits"]) if self.policy is None else self.policy.plan().bits

    def _observe(self, sq_norm: float, world: int) -> None:
        """Feed one finished step to DQ-SGD, calibrating the budget on the first usable step.

        `sq_norm` is the rank-summed ||x||^2; the variance bound wants the average over `world`
        independently quantized ranks.
        """
        if self._dq is None:
            return
        g = sq_norm / (world * world)
        lr = self.lr
        if self.policy is None:
            if not (g > 0 and lr):
                return
            budget = error_budget_for_bits(int(self._dq["target_bits"]), grad_sq_norm=g, numel=self._numel, lr=lr,
                                           total_steps=int(self._dq["total_steps"]))
            self.policy = DqsgdPolicy(error_budget=budget, **self._policy_kw())
        self.policy.observe(DqsgdStats(grad_sq_norm=g, numel=self._numel, lr=lr if lr else float("nan"),
                                       step=self.step - 1, bits=self.bits))

    def add_tensor(self, numel: int) -> None:
        """A compressed tensor of `numel` elements joins the step in flight."""
        self._numel += numel

    def add_reduced_sq(self, reduced_one: float, reduced_sq: float, world: int) -> None:
        """One tensor's reduced `[1, ||x||^2]` (as the reduction left it)."""
        if math.isfinite(reduced_one) and reduced_one > 0:
            self.add_sq_sum(reduced_sq * world / reduced_one)

    @property
    def step_nonfinite(self) -> bool:
        """Whether the step in flight was found non-finite (it will not be observed)."""
        return self._nonfinite

    def mark_nonfinite(self) -> None:
        """The step in flight is non-finite though its norms were not (a tensor passed through untouched)."""
        self.add_sq_sum(float("nan"))

    def add_sq_sum(self, sq_sum: float) -> None:
        """||x||^2 summed over ranks (and tensors), for the step in flight; inf/NaN marks it non-finite."""
        if not math.isfinite(sq_sum):
            if not self._nonfinite:
                self.nonfinite_steps += 1
                log.warning("crossover: step %d has a non-finite gradient norm (inf/NaN on some rank): "
                            "DQ-SGD skips it", self.step)
            self._nonfinite = True
            return
        self._sq += sq_sum
        self._have_sq = True

    def count(self, sent: int, dense: int) -> None:
        self.bytes_sent += sent
        self.bytes_dense += dense

    def stats(self) -> dict[str, Any]:
        """Cumulative telemetry of this rank, with the bits of the step in flight; flat (crossover/driver/flat.py):
        DQ-SGD's summary under `policy/` keys (None until its budget is calibrated)."""
        # what was sent: CF 1 when the latest steps quantized nothing (fp16/fp64 or small tensors went dense)
        quantized = self.step == 0 or self._numel > 0 or self._prev_numel > 0
        out: dict[str, Any] = {"step": self.step, "bits": self.bits,
                               "compression_factor": 32.0 / self.bits if quantized else 1.0,
                               "gain": None, "bytes_sent": self.bytes_sent, "bytes_dense": self.bytes_dense,
                               "nonfinite_steps": self.nonfinite_steps}
        if self.policy is not None:
            return flat_stats(out, policy=self.policy.summary())
        if self.adaptive:
            out.update({f"policy/{k}": None for k in self._summary_keys})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"version": QUANT_STATE_VERSION, "step": self.step, "bits": self.bits,
                "policy": None if self.policy is None else self.policy.state_dict(),
                "bytes_sent": self.bytes_sent, "bytes_dense": self.bytes_dense,
                "nonfinite_steps": self.nonfinite_steps}

    def _check_policy_config(self, saved: Mapping[str, Any]) -> None:
        """A saved DQ-SGD policy must have been built from this driver's settings (its error budget too, unless
        this run calibrates it): a fixed-bits driver takes none."""
        if self._dq is None:
            raise ValueError("state holds a DQ-SGD policy; this is fixed-bits QSGD")
        want = {**self._policy_kw(), "error_budget": self._dq.get("error_budget")}
        diff = sorted(k for k, v in want.items() if not (k == "error_budget" and v is None) and saved.get(k) != v)
        if diff:
            detail = ", ".join(f"{k}: saved {saved.get(k)!r} vs {want[k]!r}" for k in diff)
            raise ValueError(f"state's DQ-SGD settings differ from this compression's: {detail}")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`; validated first, ValueError and no change on bad state."""
        try:
            if not isinstance(state, Mapping) or state.get("version") != QUANT_STATE_VERSION:
                raise ValueError(f"unsupported quantized compression state version "
                                 f"{getattr(state, 'get', lambda _: None)('version')!r}")
            pol = state["policy"]  # None only before DQ-SGD calibrated its budget; a missing one is refused
            policy = None if pol is None else DqsgdPolicy.from_state_dict(pol)
            if policy is not None:
                self._check_policy_config(policy.config)
            step = check_int("step", state["step"], 0)
            bits = check_int("bits", state["bits"], MIN_BITS)
            if bits > MAX_BITS:
                raise ValueError(f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {bits}")
            counters = [check_int(n, state[n], 0) for n in ("bytes_sent", "bytes_dense", "nonfinite_steps")]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a valid quantized compression state: {type(exc).__name__}: {exc}") from exc
        self.policy, self.step, self.bits = policy, step, bits
        self.bytes_sent, self.bytes_dense, self.nonfinite_steps = counters
        self._tb_mark = (0.0, self.bytes_sent, self.bytes_dense)
        self.reset()
