"""fastbert without Triton: the package and the torch reference path (``kernels="torch"``) work, and
asking for the fused kernels gives one error that names the fix. Runs in a subprocess in which
``import triton`` raises ImportError, whether or not Triton is installed here."""
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None  # `import triton` (and triton.language) now raises ImportError

    import torch

    import fastbert
    from fastbert.ops import get_ops, resolve_kernels
    from fastbert.ops._common import HAS_TRITON

    assert not HAS_TRITON
    assert resolve_kernels("auto", "cuda") == "torch"  # auto never picks kernels that cannot run

    torch.manual_seed(0)
    config = fastbert.BertConfig.preset("tiny", vocab_size=64, kernels="torch")
    model = fastbert.BertForPreTraining(config)
    ids = torch.randint(5, 64, (2, 8))  # (B, S)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    labels = torch.full_like(ids, -100)
    labels[0, 1], labels[1, 2] = 7, 9
    out = model(input_ids=ids, attention_mask=mask, labels=labels, next_sentence_label=torch.tensor([0, 1]))
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(out.loss) and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0

    for ask in (lambda: get_ops("triton"), lambda: model.set_kernels("triton")(input_ids=ids, attention_mask=mask)):
        try:
            ask()
        except RuntimeError as e:
            assert "pip install triton" in str(e) and "kernels='torch'" in str(e), e
        else:
            raise AssertionError("kernels='triton' without Triton did not raise")
    print("ok")
""")


def test_torch_path_runs_and_triton_path_says_what_to_install_without_triton():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
