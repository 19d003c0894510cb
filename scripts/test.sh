#!/usr/bin/env bash
# Install (idempotent) and run the test suite: exactly what CI runs. Extra arguments go to pytest.
# Without CUDA, Triton kernels run in the interpreter and @pytest.mark.gpu tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
exec python3 -m pytest -q -p no:cacheprovider "$@" tests
