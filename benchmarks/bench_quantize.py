"""Stochastic quantizer costs as multiples of one read pass over the gradient, and its wire bytes, in one run.

Every timed row is the median wall time of --repeat calls (after one warm-up call) divided by the
median time of a read pass ``g.sum()`` timed right before each of those calls (the method of
bench_compressors.py), so ratios stay comparable while absolute times drift. Buffers are
preallocated, as a compressor keeps them between steps. Per bits b (s = 2**(b-1) - 1 levels):

* levels path (allreduce of int32 levels on a shared scale): absmax + quantize_levels + dequantize_levels
* packed path (allgather of b-bit codes): absmax + quantize_pack + unpack_dequantize
* the naive torch quantizer (abs, max, div, rand, floor, sign, cast, new tensors; one call)
* the pure-torch fallback of the packed path (one call; --no-fallback skips it)

Targets: each round trip (the scale computation included) <= 6x a read pass; packed bytes per element
within 10% of b/8 plus one float32 scale per tensor.

    taskset -c 0 python benchmarks/bench_quantize.py                  # 25 M float32, bits 2,4,8
    python benchmarks/bench_quantize.py --numel 1000000 --bits 2,3,8 --json out.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not __package__:  # run as a file: its relative imports resolve in the package it belongs to
    __package__ = os.path.basename(os.path.dirname(os.path.abspath(__file__)))

from crossover.compression import quantize as Q  # noqa: E402

from . import kernel_table  # noqa: E402
from .bench_compressors import cpu_name, start_cpu_run, timed  # noqa: E402

ROUND_TRIP_TARGET = 6.0
BYTES_TOLERANCE = 0.10
SCALE_BYTES = 4  # one float32 scale per tensor travels with the codes


def parse_bits(text: str) -> List[int]:
    try:
        bits = [int(b) for b in text.split(",") if b.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--bits must be comma-separated ints, got {text!r}") from e
    if not bits or any(not Q.MIN_BITS <= b <= Q.MAX_BITS for b in bits):
        raise argparse.ArgumentTypeError(f"--bits must be in [{Q.MIN_BITS}, {Q.MAX_BITS}], got {text!r}")
    return bits


def naive_quantize_dequantize(g: torch.Tensor, s: int) -> torch.Tensor:
    """The straightforward torch stochastic quantizer (fresh tensors everywhere), for comparison."""
    a = g.abs()
    scale = a.max()
    level = torch.floor(a / scale * s + torch.rand_like(a))
    q = (torch.sign(g) * level).to(torch.int8)
    return q.to(torch.float32) * (scale / s)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=25_000_000, help="gradient elements (float32)")
    ap.add_argument("--bits", type=parse_bits, default=[2, 4, 8], help="comma-separated bits per element, 2..8")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (the C kernels use one thread)")
    ap.add_argument("--repeat", type=int, default=9, help="timed calls per row (median reported)")
    ap.add_argument("--no-fallback", action="store_true", help="skip the pure-torch fallback rows")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive torch quantizer rows")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)

    n, rep = args.numel, args.repeat
    have_c = Q.quantize_kernels_available()
    start_cpu_run(args.threads, f"numel {n:,}  bits {','.join(map(str, args.bits))}  repeat {rep}  "
                  f"C quantizer: {'yes' if have_c else 'NO (fallbacks only)'}")

    g = torch.randn(n)
    g0 = g.clone()
    lev = torch.zeros(n, dtype=torch.int32)
    packed = torch.zeros(Q.packed_nbytes(n, Q.MAX_BITS), dtype=torch.uint8)
    dense = torch.zeros(n)
    residual = torch.zeros(n)

    def read() -> None:
        g.sum()

    rows: List[Dict] = []

    def row(name: str, fn: Callable[[], object], group: str, bits: int | None = None,
            target: float | None = None, repeat: int = rep, warmup: int = 1,
            setup: Callable[[], object] | None = None) -> None:
        rows.append({"name": name, "group": group, "bits": bits, **timed(fn, read, repeat, setup, warmup),
                     "target": target, "repeat": repeat})

    row("absmax(g) (the max-norm scale)", lambda: Q.absmax(g), "scale")
    scale = Q.absmax(g)
    seed = [0]

    bytes_rows: List[Dict] = []
    for bits in args.bits:
        s = Q.levels_for_bits(bits)
        tag = f"b={bits} s={s}"

        def q_levels(s=s) -> None:
            seed[0] += 1
            Q.quantize_levels(g, scale, s, seed[0], lev)

        def dq_levels(s=s) -> None:
            Q.dequantize_levels(lev, scale, s, dense, 1.0)

        def rt_levels(s=s) -> None:
            seed[0] += 1
            sc = Q.absmax(g)
            Q.quantize_levels(g, sc, s, seed[0], lev)
            Q.dequantize_levels(lev, sc, s, dense, 1.0)

        def q_pack(s=s, bits=bits) -> None:
            seed[0] += 1
            Q.quantize_pack(g, scale, s, bits, seed[0], packed)

        def dq_pack(s=s, bits=bits) -> None:
            Q.unpack_dequantize(packed, n, scale, s, bits, dense, False, 1.0)

        def dq_pack_acc(s=s, bits=bits) -> None:
            Q.unpack_dequantize(packed, n, scale, s, bits, dense, True, 0.5)

        def rt_pack(s=s, bits=bits) -> None:
            seed[0] += 1
            sc = Q.absmax(g)
            Q.quantize_pack(g, sc, s, bits, seed[0], packed)
            Q.unpack_dequantize(packed, n, sc, s, bits, dense, False, 1.0)

        def restore() -> None:
            residual.copy_(g0)

        def q_pack_ef(s=s, bits=bits) -> None:
            seed[0] += 1
            Q.quantize_pack(residual, Q.absmax(residual), s, bits, seed[0], packed, residual_out=residual)

        row(f"{tag} levels: quantize_levels (scale given)", q_levels, "levels", bits)
        row(f"{tag} levels: dequantize_levels", dq_levels, "levels", bits)
        row(f"{tag} levels: absmax + quantize + dequantize", rt_levels, "levels", bits, ROUND_TRIP_TARGET)
        row(f"{tag} packed: quantize_pack (scale given)", q_pack, "packed", bits)
        row(f"{tag} packed: unpack_dequantize", dq_pack, "packed", bits)
        row(f"{tag} packed: unpack_dequantize accumulate (per extra rank)", dq_pack_acc, "packed", bits)
        row(f"{tag} packed: absmax + quantize_pack + unpack_dequantize", rt_pack, "packed", bits,
            ROUND_TRIP_TARGET)
        row(f"{tag} packed + EF: absmax + quantize_pack(residual_out=in place)", q_pack_ef, "packed", bits,
            setup=restore)
        if not args.no_naive:
            row(f"{tag} naive torch quantize + dequantize (1 call)", lambda s=s: naive_quantize_dequantize(g, s),
                "naive", bits, repeat=1, warmup=0)
        if not args.no_fallback:
            def fb(rt_pack=rt_pack) -> None:
                Q.use_kernels(False)
                try:
                    rt_pack()
                finally:
                    Q.use_kernels(True)

            row(f"{tag} packed round trip, torch fallback (1 call)", fb, "fallback", bits, repeat=1, warmup=0)

        nbytes = Q.packed_nbytes(n, bits)
        expected = bits / 8 + SCALE_BYTES / n
        per_elem = (nbytes + SCALE_BYTES) / n
        bytes_rows.append({"bits": bits, "levels": s, "path": "packed (allgather)", "bytes": nbytes + SCALE_BYTES,
                           "bytes_per_element": per_elem, "expected": expected,
                           "pass": abs(per_elem - expected) <= BYTES_TOLERANCE * expected})
        bytes_rows.append({"bits": bits, "levels": s, "path": "int32 levels (allreduce)", "bytes": 4 * n,
                           "bytes_per_element": 4.0, "expected": expected, "pass": None})

    read_ms = kernel_table.print_read_pass([r["read_ms"] for r in rows if r["repeat"] > 1])
    kernel_table.print_table(rows, [("ms", "ms", "9.2f"), ("read ms", "read_ms", "7.2f"), ("x read", "ratio", "7.2f")],
                             44)

    print(f"\nbytes on the wire per element (scale: {SCALE_BYTES} bytes per tensor; target: within "
          f"{BYTES_TOLERANCE:.0%} of b/8 + scale)")
    print(f"{'bits':>4}  {'s':>4}  {'path':<26}  {'bytes/elem':>10}  {'b/8+scale':>10}  check")
    for b in bytes_rows:
        if b["pass"] is None:
            check = "n/a: Horovod allreduce has no int8, int32 levels are not smaller than fp32"
        else:
            check = "PASS" if b["pass"] else "FAIL"
        print(f"{b['bits']:>4}  {b['levels']:>4}  {b['path']:<26}  {b['bytes_per_element']:10.6f}  "
              f"{b['expected']:10.6f}  {check}")

    targets = [r for r in rows if r["target"] is not None]
    failed = [r["name"] for r in targets if not r["pass"]] + [
        f"bytes b={b['bits']}" for b in bytes_rows if b["pass"] is False]
    ok = kernel_table.verdict(f"round trips <= {ROUND_TRIP_TARGET:g}x a read pass, packed bytes", failed,
                              bool(targets))
    kernel_table.write_json(args.json, {
        "command": sys.argv, "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_name(),
        "machine": platform.machine(), "numel": n, "bits": args.bits, "repeat": rep, "c_kernels": have_c,
        "read_pass_ms": read_ms, "rows": rows, "bytes": bytes_rows, "targets_pass": ok})
    return 0


if __name__ == "__main__":
    sys.exit(main())
