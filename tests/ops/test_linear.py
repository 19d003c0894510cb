"""The linear layer that hands its input on for the residual (fastbert/ops/linear.py) vs F.linear.

Both outputs feed a loss, as in a Post-LN layer (the projection and the residual add), so the backward's
folded gradient (``addmm`` of the residual's gradient) must equal autograd's sum of the two; with only the
first output used it is F.linear's backward. fp64 on the CPU (the op has no Triton part), bf16 on the GPU.
"""
import pytest
import torch
import torch.nn.functional as F

from fastbert.ops import cublaslt
from fastbert.ops.linear import linear_residual, linear_residual_bwd, linear_residual_ref
from ops_testing import DEVICE, assert_compiled_matches_eager, assert_within


def make(m, k, n, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g),
          torch.randn(m, n, generator=g), torch.randn(m, k, generator=g))
    return [t.to(device, dtype) for t in ts]


def grads(fn, x, w, b, dy, dres, dtype, use_residual=True):
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (x, w, b)]
    y, passed = fn(*leaves)
    loss = (y.float() * dy.float()).sum() + ((passed.float() * dres.float()).sum() if use_residual else 0)
    return (y, *torch.autograd.grad(loss, [t for t in leaves if t is not None]))


@pytest.mark.parametrize("use_residual", [True, False])
@pytest.mark.parametrize("has_bias", [True, False])
def test_matches_reference(use_residual, has_bias):
    x, w, b, dy, dres = make(37, 24, 40)
    b = b if has_bias else None
    got = grads(linear_residual, x, w, b, dy, dres, torch.float64, use_residual)
    want = grads(linear_residual_ref, x, w, b, dy, dres, torch.float64, use_residual)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_backward_op_and_compile():
    x, w, b, dy, dres = make(9, 16, 24, torch.float32)
    torch.library.opcheck(torch.ops.fastbert.linear_residual_bwd.default, (dy, dres, x, w, True))
    dx, dw, db = linear_residual_bwd(dy, None, x, w, False)
    assert db.numel() == 0
    torch.testing.assert_close(dx, dy @ w)

    def f(x, w, b):
        y, passed = linear_residual(x, w, b)
        return (y ** 2).sum() + (passed * 3).sum()

    assert_compiled_matches_eager(f, (x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)))


def test_cast_copy_never_stands_in_for_x():
    """Under autocast an fp32 x is cast for the GEMM; the residual must still get x itself (fp32)."""
    x, w, b, _, _ = make(8, 16, 24, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, passed = linear_residual(x.requires_grad_(), w, b)
    assert passed is x and y.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(16384, 1024, 3072), (4000, 768, 2304)])
def test_gpu_bert_shapes(m, k, n):
    x, w, b, dy, dres = make(m, k, n, torch.float32, "cuda")
    got = grads(linear_residual, x, w, b, dy, dres, torch.bfloat16)
    same = grads(linear_residual_ref, x, w, b, dy, dres, torch.bfloat16)
    ref = grads(linear_residual_ref, x, w, b, dy, dres, torch.float64)
    for name, a, s, r in zip(("out", "dx", "dweight", "dbias"), got, same, ref):
        assert_within(name, a, s, r, torch.bfloat16)
    ran = {key[3] for key, entry in cublaslt._lt().problems.items() if entry is not None and key[4]}
    assert "default" in ran, ran  # dx = dres + dy @ W came from cuBLASLt reading dres, not torch.addmm
