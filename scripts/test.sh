#!/usr/bin/env bash
# Install (idempotent, into .venv/) and run the test suite inside that venv: exactly what CI runs.
# Extra arguments go to pytest. Without CUDA, Triton kernels run in the interpreter and @pytest.mark.gpu
# tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source "${FASTBERT_VENV:-.venv}/bin/activate"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
exec python -m pytest -q -p no:cacheprovider "$@" tests
