#!/usr/bin/env python3
"""Build (or fetch from cache) a Horovod 0.28.1 wheel that works on today's PyTorch/CMake/TF.

Horovod 0.28.1 is the newest release and its sdist does not compile unmodified on the current
stack. This script downloads the sdist, applies the small fixes documented in docs/horovod-build.md,
builds a wheel with the frameworks found in *this* interpreter, caches the wheel under a key made of
the Python, torch and TensorFlow versions plus the build flags, and installs it.

Run it with the interpreter of the environment that should get Horovod (scripts/setup.sh does).
Environment:
  CROSSOVER_CACHE          cache root (default: $XDG_CACHE_HOME/crossover or ~/.cache/crossover)
  CROSSOVER_REBUILD=1      ignore a cached wheel and build again
  HOROVOD_WITH_MPI=1 / HOROVOD_GPU_OPERATIONS=NCCL / ...  passed through to Horovod's build
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
PATCH_LEVEL = 6  # bump when patch_sources changes what gets built: a cached wheel is then rebuilt


def log(msg: str) -> None:
    print(f"[build_horovod] {msg}", flush=True)


def die(msg: str) -> None:
    print(f"[build_horovod] ERROR: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def cache_root() -> Path:
    if os.environ.get("CROSSOVER_CACHE"):
        return Path(os.environ["CROSSOVER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "crossover"


def module_version(name: str) -> str | None:
    """Version of an importable module, or None; imported in a subprocess to keep this one clean."""
    if importlib.util.find_spec(name) is None:
        return None
    out = subprocess.run(
        [sys.executable, "-c", f"import {name}; print({name}.__version__)"],
        capture_output=True, text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else None


GPU_OP_KEYS = ("HOROVOD_GPU_OPERATIONS", "HOROVOD_GPU_ALLREDUCE", "HOROVOD_GPU_ALLGATHER", "HOROVOD_GPU_BROADCAST",
               "HOROVOD_GPU_ALLTOALL", "HOROVOD_GPU_REDUCESCATTER")


def build_env(with_tf: bool) -> dict[str, str]:
    """Horovod build variables: Gloo always; MPI/NCCL only when the user or machine asks for them."""
    env = dict(os.environ)
    env.setdefault("HOROVOD_WITH_PYTORCH", "1")
    env.setdefault("HOROVOD_WITHOUT_MXNET", "1")
    env.setdefault("HOROVOD_WITH_GLOO", "1")
    if with_tf:
        env.setdefault("HOROVOD_WITH_TENSORFLOW", "1")
    else:
        env.setdefault("HOROVOD_WITHOUT_TENSORFLOW", "1")
    if "HOROVOD_WITH_MPI" not in env and "HOROVOD_WITHOUT_MPI" not in env:
        # Build MPI support only when an MPI compiler wrapper is on PATH.
        env["HOROVOD_WITH_MPI" if shutil.which("mpicxx") else "HOROVOD_WITHOUT_MPI"] = "1"
    if not any(k in env for k in GPU_OP_KEYS):
        # NCCL only when CUDA and NCCL are both visible and no GPU operation was chosen by the user
        # (HOROVOD_GPU_ALLTOALL=NCCL alone, say, builds CUDA support with CUDA tensors' allreduce,
        # allgather and broadcast staged through host memory over Gloo: several ranks can then share
        # one GPU, which NCCL refuses); otherwise CPU ops through Gloo.
        nccl = os.environ.get("HOROVOD_NCCL_HOME") or Path("/usr/include/nccl.h").exists()
        if shutil.which("nvcc") and nccl and torch_has_cuda():
            env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
    env.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")
    # Fix 5: GCC >= 13 no longer pulls <string>/<stdexcept>/<cstdint> in through other headers, and
    # Horovod's sources relied on that (group_table.h: "'string' is not a member of 'std'").
    if gcc_major() >= 13:
        env["CXXFLAGS"] = " ".join(x for x in (env.get("CXXFLAGS", ""), "-include cstdint -include string "
                                                                         "-include stdexcept") if x)
    # Fix 2: CMake >= 4 refuses the cmake_minimum_required(<3.5) in Horovod's bundled gloo.
    env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
    env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 2}")
    return env


def gcc_major() -> int:
    """Major version of the C++ compiler when it is GCC ($CXX, else g++), else 0."""
    cxx = shutil.which(os.environ.get("CXX") or "g++")
    if not cxx:
        return 0
    out = subprocess.run([cxx, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True)
    ident = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    if out.returncode != 0 or "clang" in ident.lower():
        return 0
    try:
        return int(out.stdout.strip().split(".")[0])
    except ValueError:
        return 0


def torch_has_cuda() -> bool:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda or '')"],
                         capture_output=True, text=True)
    return bool(out.stdout.strip())


FLAG_KEYS = ("HOROVOD_WITH_MPI", "HOROVOD_WITHOUT_MPI", *GPU_OP_KEYS, "HOROVOD_WITH_TENSORFLOW",
             "HOROVOD_CPU_OPERATIONS", "HOROVOD_BUILD_CUDA_CC_LIST")


def cache_key(torch_v: str | None, tf_v: str | None, env: dict[str, str]) -> str:
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    flags = ",".join(f"{k}={env[k]}" for k in FLAG_KEYS if k in env)
    digest = hashlib.sha256(f"{flags};patch={PATCH_LEVEL}".encode()).hexdigest()[:8]
    return f"horovod-{HOROVOD_VERSION}-{py}-torch{torch_v or 'none'}-tf{tf_v or 'none'}-{digest}"


def _edit(path: Path, edit: Callable[[str], str], failure: str) -> None:
    """Rewrite `path` with `edit`, or stop with `failure` when it changes nothing: a different sdist is never
    half-patched silently."""
    text = path.read_text()
    new = edit(text)
    if new == text:
        die(failure)
    path.write_text(new)


def _insert_once(anchor: str, before: str = "", after: str = "") -> Callable[[str], str]:
    """An edit that puts text around `anchor` when the file holds it exactly once (else changes nothing)."""
    return lambda text: text.replace(anchor, before + anchor + after) if text.count(anchor) == 1 else text


def patch_sources(src: Path, with_tf: bool, with_cuda: bool = False) -> None:
    """Apply the fixes that make 0.28.1 build on today's stack (see docs/horovod-build.md)."""
    # Fix 1: PyTorch >= 2.1 headers need C++17; Horovod pins C++14 in two places.
    for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        _edit(src / rel, lambda t: t.replace("set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"),
              f"patch 'C++17' found nothing to change in {rel}: is this Horovod {HOROVOD_VERSION}?")
    # Fix 4 (CUDA builds): Horovod compiles its CUDA kernels as C++11; the CUDA 13 toolkit's headers
    # need C++17.
    if with_cuda:
        _edit(src / "horovod/common/ops/cuda/CMakeLists.txt",
              lambda t: t.replace("set(CMAKE_CUDA_STANDARD 11)", "set(CMAKE_CUDA_STANDARD 17)"),
              "patch 'CUDA C++17' found nothing to change")
    # Fix 6: Horovod builds its Gloo without USE_AVX and Gloo's CMake omits math.cc, so float16 sums run in
    # software (2.5-4x slower than float32). Turn on Gloo's F16C/AVX sums when Horovod's arch flags allow them.
    avx = ('    if("${HOROVOD_BUILD_ARCH_FLAGS}" MATCHES "-mavx" AND "${HOROVOD_BUILD_ARCH_FLAGS}" MATCHES "-mf16c")\n'
           '        set(USE_AVX ON CACHE BOOL "" FORCE)\n'
           '        add_definitions(-DGLOO_USE_AVX=1)\n'
           '    endif()\n')
    _edit(src / "CMakeLists.txt", _insert_once("    add_subdirectory(third_party/gloo)\n", before=avx),
          "patch 'Gloo AVX' found no single add_subdirectory(third_party/gloo)")
    add_math = _insert_once('  "${CMAKE_CURRENT_SOURCE_DIR}/gather.cc"\n',
                            after='  "${CMAKE_CURRENT_SOURCE_DIR}/math.cc"\n')
    _edit(src / "third_party/gloo/gloo/CMakeLists.txt", lambda t: t if "/math.cc" in t else add_math(t),
          "patch 'Gloo math.cc' found nothing to change")
    # Fix 3: TF 2.21 headers lack what xla_mpi_ops.cc includes; the XLA ops are optional.
    if with_tf:
        _edit(src / "horovod/tensorflow/CMakeLists.txt",
              lambda t: re.sub(r"list\(APPEND TF_SOURCES [^)]*xla_mpi_ops\.cc\"\)\n", "", t),
              "patch 'drop xla_mpi_ops.cc' found nothing to change")


def fetch_sdist(dest: Path) -> Path:
    sdist_dir = cache_root() / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    sdist = sdist_dir / f"horovod-{HOROVOD_VERSION}.tar.gz"
    if not sdist.exists():
        log(f"downloading the horovod {HOROVOD_VERSION} sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"horovod=={HOROVOD_VERSION}", "-d", str(sdist_dir)], check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    return dest / f"horovod-{HOROVOD_VERSION}"


def build_wheel(with_tf: bool, env: dict[str, str], out_dir: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="horovod-build-") as tmp:
        src = fetch_sdist(Path(tmp))
        patch_sources(src, with_tf, with_cuda=any(env.get(k) for k in GPU_OP_KEYS))
        log("building the Horovod wheel (takes about 5 minutes on 2 cores, only the first time)")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        "-w", str(out_dir), str(src)], check=True, env=env)
    wheels = sorted(out_dir.glob("horovod-*.whl"))
    if not wheels:
        die("pip wheel finished but produced no horovod wheel")
    return wheels[0]


#: Written into the installed horovod package: the cache key of the wheel this script installed there.
MARKER = ".crossover-build"


def installed_marker(imports: str = "") -> Path | None:
    """The marker's path in the installed horovod package, or None when horovod (or `imports`, a comma-separated list
    of its framework modules) does not import; imported in a subprocess to keep this one clean."""
    code = f"import os, horovod{imports}; print(os.path.join(os.path.dirname(horovod.__file__), {MARKER!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return Path(out.stdout.strip()) if out.returncode == 0 else None


def installed_key(with_tf: bool) -> str | None:
    """The key in the installed Horovod's marker, or None when Horovod (or a framework's ops) does not import or
    was not installed by this script (a stock Horovod 0.28.1 lacks the Gloo fixes of docs/horovod-build.md)."""
    marker = installed_marker(", horovod.torch" + (", horovod.tensorflow" if with_tf else ""))
    if marker is None or marker.is_symlink() or not marker.is_file():
        return None
    return marker.read_text().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-tensorflow", action="store_true",
                        help="build the TensorFlow ops too (TensorFlow must be importable)")
    parser.add_argument("--rebuild", action="store_true", default=os.environ.get("CROSSOVER_REBUILD") == "1",
                        help="ignore the cached wheel and build again")
    parser.add_argument("--check", action="store_true",
                        help="build nothing: exit 0 when the installed Horovod is the wheel this script would "
                             "install now (same patches, Python, torch, TensorFlow and flags), else 1")
    args = parser.parse_args()

    torch_v = module_version("torch")
    if torch_v is None:
        die("torch is not importable in this environment: install it first (scripts/setup.sh does)")
    tf_v = module_version("tensorflow") if args.with_tensorflow else None
    if args.with_tensorflow and tf_v is None:
        die("--with-tensorflow given but tensorflow is not importable: pip install tensorflow tf-keras")

    env = build_env(args.with_tensorflow)
    key = cache_key(torch_v, tf_v, env)
    if args.check:
        sys.exit(0 if installed_key(args.with_tensorflow) == key else 1)
    wheel_dir = cache_root() / "wheels" / key
    cached = sorted(wheel_dir.glob("horovod-*.whl")) if wheel_dir.exists() else []
    if cached and not args.rebuild:
        wheel = cached[0]
        log(f"using cached wheel {wheel}")
    else:
        if wheel_dir.exists():
            shutil.rmtree(wheel_dir)
        wheel_dir.mkdir(parents=True)
        try:
            wheel = build_wheel(args.with_tensorflow, env, wheel_dir)
        except BaseException:
            shutil.rmtree(wheel_dir, ignore_errors=True)  # never leave a half-built cache entry
            raise
        log(f"cached wheel {wheel}")
    subprocess.run([sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", str(wheel)],
                   check=True)
    # Horovod's own runtime requirements (installed separately because of --no-deps above).
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "cffi", "cloudpickle", "psutil", "pyyaml",
                    "packaging"], check=True)
    marker = installed_marker()
    if marker is None:
        die("the Horovod wheel installed but does not import")
    marker.unlink(missing_ok=True)  # never write through a link left there
    marker.write_text(key + "\n")


if __name__ == "__main__":
    main()
