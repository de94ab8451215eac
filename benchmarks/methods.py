"""Compression objects for the ``--compression`` specs of the benchmark CLI (imported inside Horovod ranks).

``none`` and ``fp16`` are stock Horovod (``hvd.Compression.none`` / ``.fp16``); their bytes are counted
here (4 or 2 bytes per float gradient element per step) because they have no ``stats()``. The others are
crossover's objects, whose ``stats()`` count what each rank hands to Horovod.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .registry import Method

__all__ = ["CompressionOptions", "make_compression", "ByteCounter"]


@dataclass
class CompressionOptions:
    """Knobs of the adaptive methods and the static compressors (the CLI's --gravac-*, --min-compress-numel).

    None means "the library's default": a benchmark of `gravac` is `AdaptiveCompression()` as a user
    writes it unless a setting is given explicitly.
    """

    total_steps: int = 1
    gravac_epsilon: float | None = None
    gravac_window: int | None = None
    gravac_cf_min: float | None = None
    gravac_cf_max: float | None = None
    min_compress_numel: int | None = None
    error_feedback: bool = True
    seed: int = 0
    log_csv: str | None = None  # the crossover objects' per-step telemetry (policy decisions, norms)


def make_compression(method: Method, opts: CompressionOptions) -> Any:
    """The Horovod compression object for ``method`` (needs horovod.torch)."""
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, QSGDCompression, StaticCompression

    if method.kind == "none":
        return hvd.Compression.none
    if method.kind == "fp16":
        return hvd.Compression.fp16
    common = _given(min_compress_numel=opts.min_compress_numel, seed=opts.seed)
    if method.kind == "gravac":
        return AdaptiveCompression(error_feedback=opts.error_feedback, log_csv=opts.log_csv, **common,
                                   **_given(compressor=method.compressor),
                                   **_given(cf_min=opts.gravac_cf_min, cf_max=opts.gravac_cf_max,
                                            epsilon=opts.gravac_epsilon, window=opts.gravac_window))
    if method.kind == "dqsgd":
        return AdaptiveCompression(policy="dqsgd", total_steps=max(1, opts.total_steps), **common)
    if method.kind == "qsgd":
        return QSGDCompression(int(method.value or 8), **common)
    return StaticCompression(method.kind, cf=float(method.value or 100.0), error_feedback=opts.error_feedback,
                             log_csv=opts.log_csv, **common)


def _given(**settings: Any) -> dict[str, Any]:
    """The settings the user gave (not None): the rest stay the library's defaults."""
    return {k: v for k, v in settings.items() if v is not None}


class ByteCounter:
    """Per-step bytes sent / dense and the CF or bits in use, from ``stats()`` or counted for stock Horovod."""

    def __init__(self, method: Method, compression: Any, model: torch.nn.Module) -> None:
        self.method = method
        self.compression = compression
        params = [p for p in model.parameters() if p.requires_grad]
        self.dense_per_step = sum(p.numel() * 4 for p in params if p.is_floating_point())
        self.sent_per_step = self.dense_per_step // 2 if method.kind == "fp16" else self.dense_per_step
        self._has_stats = hasattr(compression, "stats")
        self._last_sent = 0
        self._last_dense = 0

    def step(self) -> tuple[int, int, float | None, int | None]:
        """(bytes sent, bytes dense, compression factor, bits) of the step that just finished."""
        if not self._has_stats:
            cf = 2.0 if self.method.kind == "fp16" else 1.0
            return self.sent_per_step, self.dense_per_step, cf, None
        st = self.compression.stats()
        sent, dense = int(st.get("bytes_sent") or 0), int(st.get("bytes_dense") or 0)
        d_sent, d_dense = sent - self._last_sent, dense - self._last_dense
        self._last_sent, self._last_dense = sent, dense
        cf = st.get("compression_factor")
        bits = st.get("bits")
        return d_sent, d_dense, (None if cf is None else float(cf)), (None if bits is None else int(bits))
