"""The encoder's linear layer on cuBLASLt (fastbert/ops/linear.py) vs F.linear.

On the CPU the op is F.linear itself, and its backward's fallback (used where cuBLASLt cannot take the
operands) is checked against autograd's; on the GPU the cuBLASLt path at BERT's shapes, with and without
a bias, in bf16 and fp16, against an fp64 reference within 2x torch's own same-dtype error.
"""
import pytest
import torch
import torch.nn.functional as F

from fastbert.ops import cublaslt
from fastbert.ops.linear import linear, linear_bwd
from ops_testing import DEVICE, assert_compiled_matches_eager, assert_within


def make(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g),
            torch.randn(m, n, generator=g))


def test_backward_fallback_matches_autograd():
    x, w, b, dy = make(37, 24, 40)
    leaves = [t.clone().double().requires_grad_() for t in (x, w, b)]
    want = torch.autograd.grad(F.linear(*leaves), leaves, dy.double())
    got = linear_bwd(dy.double(), x.double(), w.double(), True)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
    dx, dw, db = linear_bwd(dy.double(), x.double(), w.double(), False)
    torch.testing.assert_close((dx, dw), want[:2])
    assert db.numel() == 0
    torch.library.opcheck(torch.ops.fastbert.linear_bwd.default, (dy, x, w, True))
    torch.library.opcheck(torch.ops.fastbert.linear_fwd.default, (x, w, b))


def test_is_f_linear_off_cuda_and_compiles():
    x, w, b, _ = make(9, 16, 24)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))
    assert_compiled_matches_eager(lambda *t: (linear(*t) ** 2).sum(), tuple(t.to(DEVICE) for t in (x, w, b)))


@pytest.mark.gpu
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("m,k,n,dtype", [(16384, 1024, 3072, torch.bfloat16), (4000, 768, 2304, torch.bfloat16),
                                         (1000, 384, 1152, torch.float16)])
def test_gpu_matches_reference(m, k, n, dtype, has_bias):
    x, w, b, dy = (t.cuda() for t in make(m, k, n))
    b = b if has_bias else None

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (x, w, b) if t is not None]
        y = fn(*leaves)
        return y, torch.autograd.grad((y.float() * dy).sum(), leaves)

    y, grads = run(linear, dtype)
    y_same, same = run(F.linear, dtype)
    y_ref, ref = run(F.linear, torch.float64)
    assert_within("out", y, y_same, y_ref, dtype)
    for name, a, s, r in zip(("dx", "dweight", "dbias"), grads, same, ref):
        assert_within(name, a, s, r, dtype)
    ran = {key[3] for key, entry in cublaslt._lt().problems.items() if entry is not None}
    assert {"bgrad_a" if has_bias else "none", "bias" if has_bias else "none"} <= ran, ran  # cuBLASLt ran them
