"""Compression hot paths on a CUDA gradient, as multiples of one GPU read pass, measured in one run.

The GPU counterpart of bench_compressors.py and bench_quantize.py: a 25 M-element float32 gradient
(a ResNet-50's) on the current CUDA device. Each row is the median wall time of --repeat calls, each
bracketed by ``torch.cuda.synchronize()`` (so launch gaps and the host syncs a call makes are
counted), divided by the read pass ``g.sum()`` timed with CUDA events (device time only: the
strictest denominator; its synchronised wall time is printed too). Every row runs twice: with the
Triton kernels (``[triton]``) and with the pure-torch fallbacks (``[torch]``,
``kernels.use_gpu_kernels(False)``), the path CUDA tensors took before the Triton kernels.
Target: top-k class compress + decompress <= 10x a read pass.

    python benchmarks/bench_gpu.py --json out.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not __package__:  # run as a file: its relative imports resolve in the package it belongs to
    __package__ = os.path.basename(os.path.dirname(os.path.abspath(__file__)))

from crossover.compression import kernels as K  # noqa: E402
from crossover.compression import quantize as Q  # noqa: E402
from crossover.compression.quant_codec import QuantCodec  # noqa: E402
from crossover.compression.sparse_codec import SparseCodec  # noqa: E402
from crossover.driver import StepRecord, transport  # noqa: E402

from . import kernel_table  # noqa: E402
from .bench_compressors import topk_calls  # noqa: E402

TOPK_TARGET = 10.0
_CUDA = True  # False with --device cpu (a dry run of this script on a machine without a GPU)


def sync() -> None:
    if _CUDA:
        torch.cuda.synchronize()


def wall(fn: Callable[[], object], setup: Callable[[], object] | None, repeat: int, warmup: int) -> list[float]:
    """Synchronised wall times (s) of `repeat` calls after `warmup` ones; setup (untimed) before each."""
    out = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def device_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median device time (ms) of fn between two CUDA events (wall time on the CPU)."""
    if not _CUDA:
        return 1e3 * statistics.median(wall(fn, None, repeat, 3))
    times = []
    for _ in range(repeat + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[3:])


def profile(g, r0, residual, dense, sbuf, oi, ov, m: int, density: float, read_dev: float) -> None:
    """Where the time of the top-k class and quantizer paths goes, and ef_select's launch settings swept."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from crossover.compression import _triton as T

    n = g.numel()

    def restore() -> None:
        residual.copy_(r0)

    def trace(name: str, fn: Callable[[], object], setup: Callable[[], object] | None = None) -> None:
        for _ in range(3):
            if setup is not None:
                setup()
            fn()
        sync()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(10):
                if setup is not None:
                    setup()
                fn()
            sync()
        print(f"\n=== {name} (10 calls)")
        try:
            table = p.key_averages().table(sort_by="device_time_total", row_limit=16, max_name_column_width=70)
        except Exception:  # older torch: the CUDA column's old name
            table = p.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70)
        print(table, flush=True)

    k_s = min(m, max(1, int(round(density * m))))
    thr = torch.kthvalue(g[:: n // m].abs().cpu(), m - k_s + 1).values.reshape(1).to(g.device)
    state = {"c": 0}

    def topk(res=None) -> None:
        K.sample_abs(g, res, m, sbuf)
        t = K.threshold_tensor(sbuf, density)
        state["c"] = K.ef_select(g, res, t, oi, ov)[0]
        K.zero_scatter(dense, oi[:state["c"]], ov[:state["c"]])

    trace("top-k class compress + decompress [triton]", topk)
    trace("top-k class + EF compress + decompress [triton]", lambda: topk(residual), restore)
    trace("sample_abs + kthvalue", lambda: (K.sample_abs(g, None, m, sbuf), torch.kthvalue(sbuf, m - k_s + 1)))
    trace("sample_abs + sort", lambda: (K.sample_abs(g, None, m, sbuf), torch.sort(sbuf)))
    trace("sample_abs + topk(k_s)", lambda: (K.sample_abs(g, None, m, sbuf), torch.topk(sbuf, k_s, sorted=False)))
    s = Q.levels_for_bits(4)
    packed = torch.empty(Q.packed_nbytes(n, 4), dtype=torch.uint8, device=g.device)

    def quant() -> None:
        scale = Q.absmax(g)
        Q.quantize_pack(g, scale, s, 4, 11, packed)
        Q.unpack_dequantize(packed, n, scale, s, 4, dense)

    trace("b=4 absmax + quantize_pack + unpack_dequantize [triton]", quant)

    tiny = torch.ones(4096, device=g.device)
    launch = 1e3 * statistics.median(wall(lambda: T.sumsq(tiny), None, 200, 20))
    torch_op = 1e3 * statistics.median(wall(lambda: tiny.sum(), None, 200, 20))
    item = 1e3 * statistics.median(wall(lambda: float(tiny.sum()), None, 200, 20))
    print(f"\nsmall calls, synchronised wall time: Triton sumsq of 4096 elements (1 Triton launch + sum + float) "
          f"{launch * 1e3:.1f} us; torch sum {torch_op * 1e3:.1f} us; torch sum + float() {item * 1e3:.1f} us")

    print("\nef_select (no EF, threshold given): block size and warps (the writing pass in chunks of "
          f"{T.SELECT_CHUNK}, then other chunks); device time of 20 calls' median, and "
          "synchronised wall time")
    saved = T.SELECT_BLOCK, T.SELECT_WARPS, T.SELECT_CHUNK
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            if warps * 32 > block:
                continue
            T.SELECT_BLOCK, T.SELECT_WARPS = block, warps
            try:
                dev_ms = device_ms(lambda: T.ef_select(g, None, thr, oi, ov), 20)
                wall_ms = 1e3 * statistics.median(wall(lambda: T.ef_select(g, None, thr, oi, ov), None, 20, 3))
                print(f"  block {block:6d} warps {warps:2d}: device {dev_ms * 1e3:7.1f} us  "
                      f"wall {wall_ms * 1e3:7.1f} us  ({wall_ms / read_dev:.2f}x read)", flush=True)
            except Exception as e:  # a setting that does not compile: say so, go on
                print(f"  block {block:6d} warps {warps:2d}: {type(e).__name__}: {str(e)[:120]}")
    for block, chunk in ((4096, 512), (4096, 2048), (4096, 4096), (8192, 2048)):
        T.SELECT_BLOCK, T.SELECT_WARPS, T.SELECT_CHUNK = block, 4, chunk
        dev_ms = device_ms(lambda: T.ef_select(g, None, thr, oi, ov), 20)
        wall_ms = 1e3 * statistics.median(wall(lambda: T.ef_select(g, None, thr, oi, ov), None, 20, 3))
        print(f"  block {block:6d} warps  4 chunk {chunk}: device {dev_ms * 1e3:7.1f} us  "
              f"wall {wall_ms * 1e3:7.1f} us  ({wall_ms / read_dev:.2f}x read)", flush=True)
    print("ef_select with error feedback (threshold given), the same way:")
    for block, warps in ((4096, 4), (8192, 4), (16384, 4), (16384, 8)):
        T.SELECT_BLOCK, T.SELECT_WARPS, T.SELECT_CHUNK = block, warps, 1024
        dev_ms = device_ms(lambda: T.ef_select(g, residual, thr, oi, ov), 20)
        wall_ms = 1e3 * statistics.median(wall(lambda: T.ef_select(g, residual, thr, oi, ov), restore, 20, 3))
        print(f"  block {block:6d} warps {warps:2d}: device {dev_ms * 1e3:7.1f} us  "
              f"wall {wall_ms * 1e3:7.1f} us  ({wall_ms / read_dev:.2f}x read)", flush=True)
    T.SELECT_BLOCK, T.SELECT_WARPS, T.SELECT_CHUNK = saved


class _Twin:
    """Collectives of rank 0 in a world of 2 whose peer sends exactly what this rank sends."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0

    def allgather_async(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor.clone()

    def wait(self, handle: torch.Tensor) -> torch.Tensor:
        return torch.cat([handle, handle])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--sample", type=float, default=0.001, help="fraction sampled for the top-k threshold")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    ap.add_argument("--profile", action="store_true",
                    help="instead of the table: per-kernel device times (torch.profiler) of the top-k and quantizer "
                         "paths, Triton's launch overhead, and ef_select's block size and warps swept")
    args = ap.parse_args(argv)
    global _CUDA
    dev = torch.device(args.device)
    _CUDA = dev.type == "cuda"
    if _CUDA and not torch.cuda.is_available():
        print("no CUDA device")
        return 2

    n, rep, wu = args.numel, args.repeat, args.warmup
    k = max(1, int(round(args.density * n)))
    m = max(1, int(round(args.sample * n)))
    cap = 2 * k
    gen = torch.Generator(device=dev).manual_seed(0)
    g = torch.randn(n, device=dev, generator=gen)
    r0 = torch.randn(n, device=dev, generator=gen) * 0.5
    residual = r0.clone()
    half = torch.empty(n, dtype=torch.float16, device=dev)
    dense = torch.zeros(n, device=dev)
    copy_dst = torch.empty_like(g)
    sbuf = torch.empty(m, device=dev)
    oi = torch.zeros(cap, dtype=torch.int32, device=dev)
    ov = torch.zeros(cap, device=dev)
    ri = torch.empty(k, dtype=torch.int32, device=dev)
    rv = torch.empty(k, device=dev)

    have_triton = _CUDA and K.gpu_kernels_available()
    name = torch.cuda.get_device_name(dev) if _CUDA else platform.machine()
    kernel_table.print_header(
        f"device: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}",
        f"numel {n:,}  density {args.density} (k = {k:,})  threshold sample {m:,}  repeat {rep}  "
        f"Triton kernels: {'yes' if have_triton else 'NO (torch fallbacks only)'}")

    read_dev = device_ms(lambda: g.sum(), 50)
    read_wall = 1e3 * statistics.median(wall(lambda: g.sum(), None, 50, 5))
    copy_dev = device_ms(lambda: copy_dst.copy_(g), 50)
    print(f"read pass g.sum(): {read_dev * 1e3:.1f} us device time ({4 * n / read_dev / 1e6:.0f} GB/s), "
          f"{read_wall * 1e3:.1f} us synchronised wall time; copy: {copy_dev * 1e3:.1f} us "
          f"({8 * n / copy_dev / 1e6:.0f} GB/s read + write)\n")
    if args.profile:
        profile(g, r0, residual, dense, sbuf, oi, ov, m, args.density, read_dev)
        return 0

    rows: list[dict] = []

    def row(name: str, fn: Callable[[], object], group: str, setup: Callable[[], object] | None = None,
            target: float | None = None, note: Callable[[], str] | None = None, repeat: int = rep) -> None:
        ts = wall(fn, setup, repeat, wu)
        ms = 1e3 * statistics.median(ts)
        r = {"name": name, "group": group, "ms": ms, "ms_min": 1e3 * min(ts), "ratio": ms / read_dev,
             "ratio_wall": ms / read_wall, "target": target, "note": note() if note else ""}
        if target is not None:
            r["pass"] = r["ratio"] <= target
        rows.append(r)
        print(f"  {name:<78} {ms:8.3f} ms  {r['ratio']:7.2f}x read", flush=True)

    def restore() -> None:
        residual.copy_(r0)

    row("fp16 compress + decompress (preallocated)", lambda: (half.copy_(g), dense.copy_(half)), "fp16")
    row(f"torch.topk(g.abs(), {k:,}) baseline", lambda: torch.topk(g.abs(), k, sorted=False), "baseline",
        repeat=5)

    def run_impl(impl: str) -> None:
        K.use_gpu_kernels(impl == "triton")
        sfx = f" [{impl}]"
        for ef in (False, True):
            res = residual if ef else None
            setup = restore if ef else None
            # as the top-k selectors do it (threshold on the device)
            compress, decompress, state = topk_calls(g, res, sbuf, oi, ov, dense,
                                                     K.threshold_tensor if _CUDA else K.threshold_for_density,
                                                     args.density)
            tag = "top-k class" + (" + EF" if ef else "")
            row(f"{tag} compress: sample_abs + threshold + ef_select{sfx}", compress, "topk", setup)
            row(f"{tag} decompress: zero_scatter{sfx}", decompress, "topk")
            row(f"{tag} compress + decompress{sfx}", kernel_table.calls(compress, decompress), "topk", setup,
                target=TOPK_TARGET,
                note=lambda state=state: f"selected {state['c']:,} = {state['c'] / n:.3%}")

        thr_fixed = torch.kthvalue(g[:: n // m].abs().cpu(), m - int(m * args.density)).values.reshape(1).to(dev)

        def threshold_gpu() -> None:
            K.sample_abs(g, None, m, sbuf)
            K.threshold_for_density(sbuf, args.density)

        def threshold_dev() -> None:
            K.sample_abs(g, None, m, sbuf)
            K.threshold_tensor(sbuf, args.density)

        def threshold_host() -> None:
            K.sample_abs(g, None, m, sbuf)
            K.threshold_for_density(sbuf.cpu(), args.density)

        def threshold_sort() -> None:  # the same order statistic through a sort
            K.sample_abs(g, None, m, sbuf)
            kk = min(m, max(1, int(round(args.density * m))))
            float(torch.sort(sbuf).values[m - kk])

        row(f"sample_abs {m:,} + threshold_tensor (stays on the GPU){sfx}", threshold_dev, "parts")
        row(f"sample_abs {m:,} + threshold_for_density on the GPU (to a float){sfx}", threshold_gpu, "parts")
        row(f"sample_abs {m:,} + threshold by torch.sort on the GPU{sfx}", threshold_sort, "parts")
        row(f"sample_abs {m:,} + threshold_for_density on a host copy{sfx}", threshold_host, "parts")
        row(f"ef_select alone (threshold given){sfx}", lambda: K.ef_select(g, None, thr_fixed, oi, ov), "parts")
        row(f"ef_select + EF alone (threshold given){sfx}", lambda: K.ef_select(g, residual, thr_fixed, oi, ov),
            "parts", restore)
        row(f"ef_accumulate (residual += g, sumsq){sfx}", lambda: K.ef_accumulate(g, residual), "parts", restore)
        row(f"sumsq{sfx}", lambda: K.sumsq(g), "parts")

        seed = [0]

        def rk_both() -> None:
            seed[0] += 1
            K.random_indices(n, k, seed[0], ri)
            K.gather_take(g, ri, rv, False)
            K.zero_scatter(dense, ri, rv)

        def rk_ef_both() -> None:
            seed[0] += 1
            K.random_indices(n, k, seed[0], ri)
            K.ef_accumulate(g, residual)
            K.gather_take(residual, ri, rv, True)
            K.zero_scatter(dense, ri, rv)

        row(f"random-k compress + decompress{sfx}", rk_both, "randk")
        row(f"random-k + EF compress + decompress{sfx}", rk_ef_both, "randk", restore)

        for bits in (2, 4, 8):
            s = Q.levels_for_bits(bits)
            packed = torch.empty(Q.packed_nbytes(n, bits), dtype=torch.uint8, device=dev)

            def q_both(s=s, bits=bits, packed=packed) -> None:
                scale = Q.absmax(g)
                Q.quantize_pack(g, scale, s, bits, 11, packed)
                Q.unpack_dequantize(packed, n, scale, s, bits, dense)

            def q_ef(s=s, bits=bits, packed=packed) -> None:
                K.ef_accumulate(g, residual)
                scale = Q.absmax(residual)
                Q.quantize_pack(residual, scale, s, bits, 11, packed, residual_out=residual)
                Q.unpack_dequantize(packed, n, scale, s, bits, dense)

            row(f"b={bits} absmax + quantize_pack + unpack_dequantize{sfx}", q_both, "quant")
            row(f"b={bits} + EF: ef_accumulate + absmax + quantize_pack(residual) + unpack{sfx}", q_ef, "quant",
                restore)

        # whole codecs, rank 0 of 2 whose peer sent the same: encode + decode as a host calls them
        grp = _Twin()
        for comp in ("topk", "dgc", "redsync", "randomk"):
            codec = SparseCodec(comp, error_feedback=True, seed=1, grad_norms=True)
            rec = StepRecord(step=1, sent_cf=1 / args.density, probes=(1 / args.density,))

            kind, _ = transport.sparse_route(g.numel(), grp.size(), rec.sent_cf, rec.probes, rec.transport,
                                             codec.selector.shared_indices, False)

            def sc(codec=codec, rec=rec, kind=kind) -> None:
                payload, ctx, _ = codec.encode("w", g, rec, 0.1, grp, kind)
                codec.decode(payload, ctx, grp)

            row(f"SparseCodec({comp}, EF) encode + decode at CF {1 / args.density:g}{sfx}", sc, "codec")
        for bits in (4, 8):
            qc = QuantCodec(error_feedback=True, seed=1)

            def qcd(qc=qc, bits=bits) -> None:
                payload, ctx, _ = qc.encode("w", g, bits, 1, grp, "allgather")
                qc.decode(payload, ctx, grp)

            row(f"QuantCodec(bits={bits}, EF, allgather) encode + decode{sfx}", qcd, "codec")

    if have_triton:
        run_impl("triton")
    run_impl("torch")
    K.use_gpu_kernels(True)

    # the full-size gradient selects the same elements on the GPU as on the CPU (C kernels)
    gc, rc = g.cpu(), r0.cpu()
    thr = K.threshold_for_density(sbuf.cpu(), args.density)
    oic, ovc = torch.zeros(cap, dtype=torch.int32), torch.zeros(cap)
    rcc = rc.clone()
    a = K.ef_select(gc, rcc, thr, oic, ovc)
    residual.copy_(r0)
    b = K.ef_select(g, residual, thr, oi, ov)
    same = (a.count == b.count and torch.equal(oic[:a.count], oi[:b.count].cpu())
            and torch.equal(ovc[:a.count], ov[:b.count].cpu()) and torch.equal(rcc, residual.cpu()))
    print(f"\n{n:,}-element ef_select with error feedback, GPU vs CPU: {a.count:,} selected on both; indices, "
          f"values and residuals identical: {same}")

    print(f"\nread pass: {read_dev * 1e3:.1f} us device time (the ratios' denominator), {read_wall * 1e3:.1f} us "
          "synchronised wall time\n")
    kernel_table.print_table(rows, [("ms", "ms", "8.3f"), ("min ms", "ms_min", "8.3f"), ("x read", "ratio", "7.2f"),
                                    ("x wall read", "ratio_wall", "11.2f")], 54)
    targets = [r for r in rows if r["target"] is not None and "[triton]" in r["name"]]
    ok = kernel_table.verdict(f"top-k class compress + decompress with the Triton kernels <= {TOPK_TARGET:g}x a "
                              "read pass", [r["name"] for r in targets if not r["pass"]], bool(targets))
    kernel_table.write_json(args.json, {
        "command": sys.argv, "device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "numel": n,
        "density": args.density, "k": k, "sample": m, "repeat": rep, "triton": have_triton,
        "read_pass_device_ms": read_dev, "read_pass_wall_ms": read_wall, "copy_device_ms": copy_dev, "rows": rows,
        "target_pass": ok, "full_size_selection_equal": same})
    return 0


if __name__ == "__main__":
    sys.exit(main())
