"""Compressor hot-path costs as multiples of one read pass over the gradient, measured in one run.

Every row is the median wall time of --repeat calls (after one warm-up call) divided by the median
time of a read pass ``g.sum()`` timed right before each of those calls, so the ratios stay
comparable across machines and runs while absolute times drift. Buffers are
preallocated, as a compressor would keep them between steps. Targets: top-k-class compress +
decompress at the given density <= 6x a read pass, fp16 compress + decompress <= 2x.

    taskset -c 0 python benchmarks/bench_compressors.py                 # 25 M float32, 1 %
    python benchmarks/bench_compressors.py --numel 1000000 --json out.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not __package__:  # run as a file: its relative imports resolve in the package it belongs to
    __package__ = os.path.basename(os.path.dirname(os.path.abspath(__file__)))

from crossover.compression import kernels as K  # noqa: E402

from . import kernel_table  # noqa: E402

TOPK_TARGET = 6.0
FP16_TARGET = 2.0


def timed(fn: Callable[[], object], read: Callable[[], object], repeat: int,
          setup: Callable[[], object] | None = None, warmup: int = 1) -> Dict[str, float]:
    """A row's times of `repeat` calls of fn, each right after a timed read pass, after `warmup` rounds: ``ms``
    and ``ms_min``, the median and fastest call; ``read_ms``, the median read pass; ``ratio``, ms over read_ms.

    setup (untimed) runs before each call of fn. Interleaving the reference with the operation keeps
    each row's ratio meaningful when the machine's speed drifts during the run.
    """
    ops, reads = [], []
    for i in range(warmup + repeat):
        t0 = time.perf_counter()
        read()
        t1 = time.perf_counter()
        if setup is not None:
            setup()
        t2 = time.perf_counter()
        fn()
        t3 = time.perf_counter()
        if i >= warmup:
            reads.append(t1 - t0)
            ops.append(t3 - t2)
    ms, read_ms = 1e3 * statistics.median(ops), 1e3 * statistics.median(reads)
    return {"ms": ms, "ms_min": 1e3 * min(ops), "read_ms": read_ms, "ratio": ms / read_ms}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def start_cpu_run(threads: int, spec: str) -> None:
    """Set torch's threads and seed, then print the header: the command line, the machine and ``spec``."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kernel_table.print_header(f"machine: {cpu_name()} ({platform.machine()}), torch {torch.__version__}, "
                              f"torch threads {torch.get_num_threads()}, python {platform.python_version()}", spec)


def topk_calls(g: torch.Tensor, res: torch.Tensor | None, sbuf: torch.Tensor, oi: torch.Tensor, ov: torch.Tensor,
               dense: torch.Tensor, threshold: Callable[[torch.Tensor, float], object], density: float
               ) -> Tuple[Callable[[], None], Callable[[], None], Dict[str, int]]:
    """The top-k class path on preallocated buffers: compress (sample_abs into sbuf, ``threshold``, ef_select into
    oi and ov; res: the error-feedback residual or None), decompress (zero_scatter into dense), and the state whose
    ``"c"`` is the count compress selected."""
    state = {"c": 0}

    def compress() -> None:
        K.sample_abs(g, res, sbuf.numel(), sbuf)
        state["c"] = K.ef_select(g, res, threshold(sbuf, density), oi, ov)[0]

    def decompress() -> None:
        K.zero_scatter(dense, oi[:state["c"]], ov[:state["c"]])

    return compress, decompress, state


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=25_000_000, help="gradient elements (float32)")
    ap.add_argument("--density", type=float, default=0.01, help="fraction of elements kept by sparsifiers")
    ap.add_argument("--repeat", type=int, default=9, help="timed calls per row (median reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--sample", type=float, default=0.001,
                    help="fraction of elements sampled to estimate the top-k threshold")
    ap.add_argument("--no-fallback", action="store_true", help="skip the (slow) pure-torch fallback rows")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)

    n, rep = args.numel, args.repeat
    k = max(1, int(round(args.density * n)))
    m = max(1, int(round(args.sample * n)))
    cap = 2 * k  # room for the threshold estimate overshooting

    have_c = K.kernels_available()
    start_cpu_run(args.threads, f"numel {n:,}  density {args.density}  (k = {k:,})  threshold sample {m:,}  "
                  f"repeat {rep}  C kernels: {'yes' if have_c else 'NO (fallbacks only)'}")

    g = torch.randn(n)
    r0 = torch.randn(n) * 0.5  # an error-feedback residual of the gradient's order of magnitude
    residual = r0.clone()
    half = torch.empty(n, dtype=torch.float16)
    dense = torch.empty(n)
    sbuf = torch.empty(m)
    oi = torch.empty(cap, dtype=torch.int32)
    ov = torch.empty(cap)
    ri = torch.empty(k, dtype=torch.int32)
    rv = torch.empty(k)
    dense.zero_()
    half.zero_()
    oi.zero_()
    ov.zero_()

    def restore() -> None:
        residual.copy_(r0)

    def read() -> None:
        g.sum()

    rows: List[Dict] = []

    def row(name: str, fn: Callable[[], object], group: str, setup: Callable[[], object] | None = None,
            target: float | None = None, note: Callable[[], str] | None = None, repeat: int = rep,
            warmup: int = 1) -> None:
        rows.append({"name": name, "group": group, **timed(fn, read, repeat, setup, warmup), "target": target,
                     "note": note() if note else ""})

    # fp16: cast into a preallocated half buffer and back.
    def fp16_both() -> None:
        half.copy_(g)
        dense.copy_(half)

    row("fp16 compress (float32 -> half, preallocated)", lambda: half.copy_(g), "fp16")
    row("fp16 decompress (half -> float32)", lambda: dense.copy_(half), "fp16")
    row("fp16 compress + decompress", fp16_both, "fp16", target=FP16_TARGET)

    # torch.topk baseline: one call, it is slow.
    row(f"torch.topk(g.abs(), {k:,}) baseline (1 call)", lambda: torch.topk(g.abs(), k, sorted=False),
        "baseline", repeat=1, warmup=0)

    def run_impl(impl: str) -> None:
        """All sparsifier rows with the C kernels (impl "C") or the torch fallbacks."""
        K.use_kernels(impl == "C")
        sfx = f" [{impl}]"
        for ef in (False, True):  # top-k class, without and with error feedback
            res = residual if ef else None
            setup = restore if ef else None
            compress, decompress_fused, state = topk_calls(g, res, sbuf, oi, ov, dense, K.threshold_for_density,
                                                           args.density)

            def decompress(state=state) -> None:
                c = state["c"]
                dense.zero_()
                K.scatter_add(dense, oi[:c], ov[:c])

            tag = "top-k class" + (" + EF" if ef else "")
            row(f"{tag} compress: sample_abs + threshold + ef_select{sfx}", compress, "topk", setup)
            row(f"{tag} decompress: zero_ + scatter_add{sfx}", decompress, "topk")
            row(f"{tag} decompress: zero_scatter (one call){sfx}", decompress_fused, "topk")
            row(f"{tag} compress + decompress (zero_ + scatter_add){sfx}", kernel_table.calls(compress, decompress),
                "topk", setup, target=TOPK_TARGET,
                note=lambda state=state: f"selected {state['c']:,} = {state['c'] / n:.3%}")
            row(f"{tag} compress + decompress (zero_scatter){sfx}", kernel_table.calls(compress, decompress_fused),
                "topk", setup, target=TOPK_TARGET)

        def threshold_only() -> None:
            K.sample_abs(g, None, m, sbuf)
            K.threshold_for_density(sbuf, args.density)

        row(f"sample_abs {m:,} + threshold_for_density{sfx}", threshold_only, "parts")
        row(f"ef_accumulate (residual += g, sumsq){sfx}", lambda: K.ef_accumulate(g, residual), "parts",
            restore)
        row(f"sumsq{sfx}", lambda: K.sumsq(g), "parts")

        seed = [0]  # random-k: the indices are shared through the seed, only values travel

        def rk_compress() -> None:
            seed[0] += 1
            K.random_indices(n, k, seed[0], ri)
            K.gather_take(g, ri, rv, False)

        def rk_ef_compress() -> None:
            seed[0] += 1
            K.random_indices(n, k, seed[0], ri)
            K.ef_accumulate(g, residual)
            K.gather_take(residual, ri, rv, True)

        def rk_decompress() -> None:
            dense.zero_()
            K.scatter_add(dense, ri, rv)

        row(f"random-k compress: random_indices + gather_take{sfx}", rk_compress, "randk")
        row(f"random-k decompress: zero_ + scatter_add{sfx}", rk_decompress, "randk")
        row(f"random-k compress + decompress{sfx}", kernel_table.calls(rk_compress, rk_decompress), "randk")
        row(f"random-k + EF (ef_accumulate + zeroing gather_take) + decompress{sfx}",
            kernel_table.calls(rk_ef_compress, rk_decompress), "randk", restore)

    if have_c:
        run_impl("C")
    if not args.no_fallback:
        run_impl("torch fallback")
    K.use_kernels(True)

    read_ms = kernel_table.print_read_pass([r["read_ms"] for r in rows], "; min ms is the fastest call")
    kernel_table.print_table(rows, [("ms", "ms", "9.2f"), ("min ms", "ms_min", "8.2f"), ("read ms", "read_ms", "7.2f"),
                                    ("x read", "ratio", "7.2f")], 50)
    targets = [r for r in rows if r["target"] is not None and "fallback" not in r["name"]]
    ok = kernel_table.verdict("C kernels and fp16", [r["name"] for r in targets if not r["pass"]], bool(targets))
    kernel_table.write_json(args.json, {
        "command": sys.argv, "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_name(),
        "machine": platform.machine(), "numel": n, "density": args.density, "k": k, "sample": m, "repeat": rep,
        "c_kernels": have_c, "read_pass_ms": read_ms, "rows": rows, "targets_pass": ok})
    return 0


if __name__ == "__main__":
    sys.exit(main())
