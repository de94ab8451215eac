#!/usr/bin/env python3
"""The GPU checks in one command, for a bare GPU machine with PyTorch + CUDA and no package index.

    python3 scripts/gpu_check.py OUT                       # every stage, results under OUT/
    python3 scripts/gpu_check.py OUT --stages env,tests,bench --deadline 500

Stages (each writes what it saw; a failing stage does not stop the next):

* ``env``: GPU, driver, torch / CUDA / Triton versions, C compiler, whether crossover's C kernels
  built and whether its Triton kernels for CUDA tensors compiled and passed their check;
* ``tests``: the CUDA tests (tests/unit/test_cuda.py, tests/unit/test_triton_kernels.py, the CUDA cases of
  tests/unit/test_kernels.py and tests/unit/test_quantizer.py, the DDP hook with 2 Gloo ranks on one GPU), and
  a probe of NCCL with two ranks on the one GPU (NCCL refuses that);
* ``bench``: benchmarks/bench_gpu.py (compress + decompress of a 25 M-element CUDA gradient as
  multiples of a GPU read pass);
* ``profile`` (not in the default list): ``bench_gpu.py --profile``, per-kernel device times and
  ef_select's launch settings swept, into profile.txt;
* ``horovod``: builds Horovod 0.28.1 with CUDA from the sdist (``--sdist``, no download) with the
  project's fixes (scripts/build_horovod.py), started in the background at the beginning on cores
  of its own (Horovod's setup needs ``cffi``: ``--wheels DIR`` installs it from wheels in DIR),
  then ``horovodrun --check-build`` and tests/hvd/test_cuda_hvd.py (2 Horovod ranks on the one GPU,
  every compression object). The build has CUDA support and uses NCCL for alltoall only, so
  CUDA tensors' allreduce, allgather and broadcast go through host memory over Gloo: two ranks can
  share one GPU, which NCCL refuses.
* ``crossover`` (needs the ``horovod`` stage): ``benchmarks/bench_crossover.py --local``, two 2-rank Horovod
  jobs whose four ranks share the one GPU, one after the other, at once uncoordinated and at once under the
  crossover scheduler; into crossover.txt and crossover.json. Earlier stages leave it CROSSOVER_S seconds.

Files written under OUT: summary.md, results.json, tests.txt, bench_gpu.txt, bench_gpu.json,
profile.txt, horovod.txt, crossover.txt, crossover.json. ``--deadline`` (seconds from the start) stops the build
and skips stages that would start after it, so that the command ends inside a time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STAGES = ("env", "tests", "bench", "profile", "horovod", "crossover")
CROSSOVER_S = 260  # the crossover stage: batch probe, calibration, 3 modes x 2 runs of 2 jobs (~200 s on an H200)
TEST_GROUPS = ("cuda_unit", "ddp_one_gpu", "ddp_diagnosis")
T0 = time.monotonic()


def elapsed() -> float:
    return time.monotonic() - T0


def log(msg: str) -> None:
    print(f"[gpu_check {elapsed():6.1f}s] {msg}", flush=True)


def run(cmd: list[str], out: Path, timeout: float, env: dict[str, str] | None = None,
        cores: str | None = None) -> dict[str, Any]:
    """Run cmd (pinned to `cores` if given), append its output to `out`; rc, seconds and the last lines."""
    if cores and shutil.which("taskset"):
        cmd = ["taskset", "-c", cores, *cmd]
    t = time.monotonic()
    with open(out, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = out.read_text(errors="replace").splitlines()[-3:]
    return {"cmd": " ".join(cmd), "rc": rc, "s": round(time.monotonic() - t, 1), "tail": tail}


def cores(spec: str) -> str:
    """`spec` ("0-5") limited to the cores this machine has."""
    n = os.cpu_count() or 1
    lo, _, hi = spec.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    return f"{min(lo_i, n - 1)}-{min(hi_i, n - 1)}"


# ------------------------------------------------------------------------------------------- env

def stage_env() -> dict[str, Any]:
    import torch

    from crossover.compression import kernels as K
    from crossover.compression import quantize as Q

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                            "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpus=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
                    memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip()
        info["nvcc"] = version.splitlines()[-1] if version else None
    info["cc"] = shutil.which(os.environ.get("CC", "") or "cc") or shutil.which("gcc")
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["c_kernels"] = K.kernels_available()
    info["c_quantizer"] = Q.quantize_kernels_available()
    info["triton_kernels"] = K.gpu_kernels_available()
    return info


# ------------------------------------------------------------------------------------------- tests

_NCCL_PROBE = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=int(os.environ["RANK"]), world_size=2)
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print("rank", dist.get_rank(), "all_reduce ->", x.tolist(), flush=True)
    dist.destroy_process_group()
""")


def nccl_probe(out: Path) -> dict[str, Any]:
    """Two torch.distributed NCCL ranks on the one GPU: what happens (expected: NCCL refuses)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    with open(out, "a") as f:
        f.write("\n$ NCCL probe: 2 torch.distributed ranks, both on cuda:0\n")
        f.flush()
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "NCCL_DEBUG": "WARN"}
            procs.append(subprocess.Popen([sys.executable, "-c", _NCCL_PROBE], stdout=f, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True))
        rcs = []
        for p in procs:
            try:
                rcs.append(p.wait(timeout=90))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rcs.append("timeout")
    text = out.read_text(errors="replace")
    probe = text[text.rindex("$ NCCL probe"):]
    lines = [ln for ln in probe.splitlines() if re.search(r"Duplicate GPU|invalid usage|all_reduce ->|Error", ln)]
    return {"rcs": rcs, "lines": lines[:6]}


_DDP_DIAGNOSIS = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    from ddp_harness import run_ddp
    import test_ddp_hook as t
    for sync, env in ((True, {}), (False, {}), (False, {"CUDA_LAUNCH_BLOCKING": "1"}),
                      (False, {"CROSSOVER_NO_TRITON": "1"})):
        r0, r1 = run_ddp(t.job_gloo_one_gpu, args=(10, ["qsgd", "dqsgd", "topk"], sync), env=env, timeout=200)
        same = {k: r0["checksums"][k] == r1["checksums"][k] for k in r0["checksums"]}
        print("DIAG", json.dumps({"gloo_cuda_sync": sync, "env": env, "ranks_equal": same}), flush=True)
""")


def stage_tests(out: Path, deadline: float, cpu: str, which: list[str]) -> dict[str, Any]:
    py = sys.executable
    xdist = ["-n", "4"] if _has_module("xdist") else []
    res: dict[str, Any] = {}
    groups = {
        "cuda_unit": ["tests/unit/test_cuda.py", "tests/unit/test_triton_kernels.py", "tests/unit/test_kernels.py",
                      "tests/unit/test_quantizer.py", *xdist],
        "ddp_one_gpu": ["tests/ddp/test_ddp_hook.py", "-k", "gloo_two_ranks_on_one_gpu or nccl"],
    }
    for name, args in groups.items():
        if name not in which:
            continue
        left = deadline - elapsed()
        if left < 60:
            res[name] = {"rc": "skipped: deadline"}
            continue
        log(f"tests: {name}")
        r = run([py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args], out, min(left, 420), cores=cpu)
        r["summary"] = next((ln for ln in reversed(r["tail"]) if re.search(r"passed|failed|error|skipped", ln)), "")
        res[name] = r
    if "ddp_diagnosis" in which and deadline - elapsed() > 120:
        log("tests: ddp_diagnosis (the hook's Gloo + CUDA synchronisation on and off)")
        r = run([py, "-c", _DDP_DIAGNOSIS], out, min(deadline - elapsed(), 300), cores=cpu)
        text = out.read_text(errors="replace")
        r["lines"] = [ln[5:] for ln in text.splitlines() if ln.startswith("DIAG ")][-4:]
        res["ddp_diagnosis"] = r
    if deadline - elapsed() > 60:
        log("tests: NCCL probe")
        res["nccl_two_ranks_one_gpu"] = nccl_probe(out)
    return res


def _has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


# ------------------------------------------------------------------------------------------- bench

def stage_bench(outdir: Path, deadline: float, cpu: str) -> dict[str, Any]:
    left = deadline - elapsed()
    if left < 60:
        return {"rc": "skipped: deadline"}
    log("bench: benchmarks/bench_gpu.py")
    js = outdir / "bench_gpu.json"
    r = run([sys.executable, "benchmarks/bench_gpu.py", "--json", str(js)], outdir / "bench_gpu.txt", left, cores=cpu)
    if js.exists():
        data = json.loads(js.read_text())
        r["read_pass_device_us"] = round(1e3 * data["read_pass_device_ms"], 1)
        r["target_pass"] = data["target_pass"]
        r["full_size_selection_equal"] = data["full_size_selection_equal"]
        r["rows"] = {row["name"]: round(row["ratio"], 2) for row in data["rows"]}
    return r


def stage_profile(outdir: Path, deadline: float, cpu: str) -> dict[str, Any]:
    left = deadline - elapsed()
    if left < 60:
        return {"rc": "skipped: deadline"}
    log("profile: benchmarks/bench_gpu.py --profile")
    return run([sys.executable, "benchmarks/bench_gpu.py", "--profile"], outdir / "profile.txt", left, cores=cpu)


# ------------------------------------------------------------------------------------------- horovod

def _nccl_paths() -> tuple[str, str] | None:
    """(include dir, library file) of the NCCL that the nvidia-nccl wheel installed next to torch."""
    for base in map(Path, sys.path):
        root = base / "nvidia"
        if not root.is_dir():
            continue
        headers = sorted(root.glob("**/nccl.h"))
        libs = sorted(root.glob("**/libnccl.so*"))
        if headers and libs:
            return str(headers[0].parent), str(libs[0])
    return None


def start_horovod_build(outdir: Path, sdist: Path, work: Path, cpu: str, jobs: int,
                        wheels: str | None) -> tuple[subprocess.Popen | None, dict[str, Any]]:
    import torch

    info: dict[str, Any] = {}
    if not _has_module("cffi"):  # Horovod's setup_requires; with no index it must come from wheels
        if wheels is None:
            info["error"] = "cffi is missing (Horovod's setup needs it): pass --wheels DIR holding its wheel"
            return None, info
        info["cffi"] = run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels,
                            "cffi"], outdir / "horovod.txt", 120)
    if not sdist.is_file():
        info["error"] = f"no sdist at {sdist.name} (pass --sdist)"
        return None, info
    nccl = _nccl_paths()
    if nccl is None:
        info["error"] = "no NCCL (nvidia-nccl wheel) found next to torch"
        return None, info
    (work / "sdist").mkdir(parents=True, exist_ok=True)
    shutil.copy(sdist, work / "sdist" / "horovod-0.28.1.tar.gz")
    libdir = work / "nccl-lib"  # Horovod's CMake links "libnccl.so"; the wheel ships libnccl.so.2
    libdir.mkdir(exist_ok=True)
    link = libdir / "libnccl.so"
    if not link.exists():
        link.symlink_to(nccl[1])
    cap = torch.cuda.get_device_capability(0)
    env = {**os.environ, "CROSSOVER_CACHE": str(work), "PIP_NO_INDEX": "1", "HOROVOD_GPU_ALLTOALL": "NCCL",
           "HOROVOD_NCCL_INCLUDE": nccl[0], "HOROVOD_NCCL_LIB": str(libdir), "HOROVOD_NCCL_LINK": "SHARED",
           "HOROVOD_BUILD_CUDA_CC_LIST": f"{cap[0]}{cap[1]}", "HOROVOD_WITHOUT_MPI": "1",
           "HOROVOD_WITHOUT_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1", "MAKEFLAGS": f"-j{jobs}"}
    if not shutil.which("nvcc") and Path("/usr/local/cuda/bin/nvcc").exists():
        env["PATH"] = f"/usr/local/cuda/bin:{env['PATH']}"
    info["env"] = {k: v for k, v in env.items() if k.startswith("HOROVOD_") or k == "MAKEFLAGS"}
    cmd = [sys.executable, "scripts/build_horovod.py"]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", cpu, *cmd]
    f = open(outdir / "horovod.txt", "a")  # noqa: SIM115 - closed by finish_horovod
    f.write(f"$ {' '.join(cmd)}\n  with {json.dumps(info['env'])}\n")
    f.flush()
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
    proc._xo_log = f  # type: ignore[attr-defined]
    info["started_s"] = round(elapsed(), 1)
    log(f"horovod: build started in the background (cores {cpu}, -j{jobs})")
    return proc, info


def stage_crossover(outdir: Path, deadline: float) -> dict[str, Any]:
    left = deadline - elapsed()
    if left < 120:
        return {"rc": "skipped: deadline"}
    log("crossover: two 2-rank jobs on the one GPU (sequential, uncoordinated, crossover)")
    r = run([sys.executable, "benchmarks/bench_crossover.py", "--local", "--params", "25000000", "--repeat", "2",
             "--steps", "20", "--warmup", "5", "--rtt-cycles", "1000", "--timeout", str(int(left / 4)),
             "--json", str(outdir / "crossover.json")], outdir / "crossover.txt", left - 5)
    if (outdir / "crossover.json").is_file():
        runs = json.loads((outdir / "crossover.json").read_text())["runs"]
        r["aggregate_steps_per_s"] = {m: [round(e["aggregate_steps_per_s"], 3) for e in v] for m, v in runs.items()}
    return r


def finish_horovod(proc: subprocess.Popen | None, info: dict[str, Any], outdir: Path, deadline: float,
                   cpu: str, hvd_tests: bool = True) -> dict[str, Any]:
    if proc is None:
        return info
    left = deadline - elapsed()
    try:
        rc = proc.wait(timeout=max(1.0, left - 90))  # leave time for the checks below
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "stopped at the deadline"
    proc._xo_log.close()  # type: ignore[attr-defined]
    info["build_rc"] = rc
    info["build_s"] = round(elapsed() - info["started_s"], 1)
    log(f"horovod: build ended ({rc}) after {info['build_s']} s")
    text = (outdir / "horovod.txt").read_text(errors="replace").splitlines()
    info["build_tail"] = text[-8:]
    if rc != 0:
        return info
    hvdrun = Path(sys.executable).with_name("horovodrun")
    info["check_build"] = run([str(hvdrun) if hvdrun.exists() else "horovodrun", "--check-build"],
                              outdir / "horovod.txt", 60)
    left = deadline - elapsed()
    if hvd_tests and left > 45:
        r = run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/hvd/test_cuda_hvd.py"],
                outdir / "horovod.txt", left - 15, cores=cpu)
        r["summary"] = next((ln for ln in reversed(r["tail"]) if re.search(r"passed|failed|error|skipped", ln)), "")
        info["test_cuda_hvd"] = r
    return info


# ------------------------------------------------------------------------------------------- main

def write_summary(outdir: Path, results: dict[str, Any]) -> None:
    lines = ["# GPU check", "", f"command: `{' '.join(results['argv'])}`", f"took {results['took_s']} s", ""]
    env = results.get("env", {})
    if env:
        lines += ["## machine", "", "```", json.dumps(env, indent=1), "```", ""]
    tests = results.get("tests", {})
    if tests:
        lines += ["## tests", ""]
        for name, r in tests.items():
            lines.append(f"* {name}: rc {r.get('rc')}; {r.get('summary', '')} {r.get('lines', '')}")
        lines.append("")
    bench = results.get("bench", {})
    if bench.get("rows"):
        lines += ["## bench (x a GPU read pass, device time "
                  f"{bench.get('read_pass_device_us')} us)", ""]
        lines += [f"* {k}: {v}" for k, v in bench["rows"].items()]
        lines += ["", f"target met: {bench.get('target_pass')}; 25 M selection equal to the CPU's: "
                      f"{bench.get('full_size_selection_equal')}", ""]
    xo = results.get("crossover", {})
    if xo:
        lines += ["## crossover (aggregate steps/s of two jobs on one GPU)", "", "```", json.dumps(xo, indent=1),
                  "```", ""]
    hv = results.get("horovod", {})
    if hv:
        lines += ["## horovod", "", "```", json.dumps(hv, indent=1)[:6000], "```", ""]
    (outdir / "summary.md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder for the results (created)")
    ap.add_argument("--stages", default="env,tests,bench,horovod",
                    help="comma-separated subset of " + ", ".join(STAGES))
    ap.add_argument("--sdist", default=None, help="Horovod 0.28.1 sdist (default: $CROSSOVER_CACHE/sdist or "
                                                  "~/.cache/crossover/sdist)")
    ap.add_argument("--wheels", default=None, help="folder of wheels for what the Horovod build needs (cffi)")
    ap.add_argument("--test-groups", default=",".join(TEST_GROUPS), help="comma-separated subset of "
                    + ", ".join(TEST_GROUPS))
    ap.add_argument("--deadline", type=float, default=540, help="seconds from the start (default %(default)s)")
    ap.add_argument("--test-cores", default="0-5", help="cores for tests and benchmarks (default %(default)s)")
    ap.add_argument("--build-cores", default="6-15", help="cores for the Horovod build (default %(default)s)")
    args = ap.parse_args()
    stages = [s for s in args.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        ap.error(f"unknown stages: {', '.join(sorted(unknown))}")
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    test_cpu, build_cpu = cores(args.test_cores), cores(args.build_cores)
    results: dict[str, Any] = {"argv": [Path(sys.argv[0]).name, *sys.argv[1:]]}

    proc, hinfo = None, {}
    work = Path(tempfile.mkdtemp(prefix="xo-gpu-"))
    if "horovod" in stages:
        cache = Path(os.environ.get("CROSSOVER_CACHE", Path.home() / ".cache" / "crossover"))
        sdist = Path(args.sdist) if args.sdist else cache / "sdist" / "horovod-0.28.1.tar.gz"
        lo, _, hi = build_cpu.partition("-")
        proc, hinfo = start_horovod_build(outdir, sdist, work, build_cpu, max(1, int(hi) - int(lo) + 1),
                                          args.wheels)
    try:
        if "env" in stages:
            log("env")
            try:
                results["env"] = stage_env()
            except Exception as e:  # keep going: the other stages say more
                results["env"] = {"error": f"{type(e).__name__}: {e}"}
            log(json.dumps(results["env"]))
        before = args.deadline - (CROSSOVER_S if "crossover" in stages else 0)  # what the stages below may use
        if "tests" in stages:
            results["tests"] = stage_tests(outdir / "tests.txt", before, test_cpu, args.test_groups.split(","))
        if "bench" in stages:
            results["bench"] = stage_bench(outdir, before, test_cpu)
        if "profile" in stages:
            results["profile"] = stage_profile(outdir, before, test_cpu)
        if "horovod" in stages:
            # crossover next: the build may run until `before`, and tests/hvd/test_cuda_hvd.py is left out
            xo = "crossover" in stages
            results["horovod"] = finish_horovod(proc, hinfo, outdir, before + (90 if xo else 0), test_cpu, not xo)
        if "crossover" in stages:
            if results.get("horovod", {}).get("build_rc") == 0:
                results["crossover"] = stage_crossover(outdir, args.deadline)
            else:
                results["crossover"] = {"rc": "skipped: no Horovod (the horovod stage builds it)"}
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
        results["took_s"] = round(elapsed(), 1)
        (outdir / "results.json").write_text(json.dumps(results, indent=1))
        write_summary(outdir, results)
        log(f"wrote {outdir}/summary.md and results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
