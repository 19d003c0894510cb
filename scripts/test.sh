#!/usr/bin/env bash
# Install (idempotent, into .venv/) and run the test suite inside that venv: exactly what CI runs.
# Extra arguments go to pytest. Without CUDA, Triton kernels run in the interpreter and @pytest.mark.gpu
# tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source "${FASTBERT_VENV:-.venv}/bin/activate"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
# Two workers (pytest-xdist), each taking whole files (module fixtures run once), one CPU thread each:
# two workers of two OpenMP threads on CI's two cores spin against each other (a fine-tuning test ran 3.4x
# slower). `-n 0` (or `-n N`) in the arguments overrides the workers; OMP_NUM_THREADS=N the threads.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --no-loadscope-reorder: files start in tests/conftest.py's order (longest first; xdist would otherwise sort them
# by their number of tests, which put the 5-minute Quick start test last). --durations=25: the slowest tests, to
# keep that order current.
exec python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=25 "$@" tests
