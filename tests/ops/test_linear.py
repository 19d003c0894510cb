"""The linear layer that hands its input on for the residual (fastbert/ops/linear.py) vs F.linear.

Both outputs feed a loss, as in a Post-LN layer (the projection and the residual add), so the backward's
folded gradient (``addmm`` of the residual's gradient) must equal autograd's sum of the two; with only the
first output used it is F.linear's backward. fp64 on the CPU (the op has no Triton part), bf16 on the GPU.
"""
import pytest
import torch
import torch.nn.functional as F

from fastbert.ops import cublaslt
from fastbert.ops.linear import bias_grad, linear_residual, linear_residual_bwd, linear_residual_ref
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
    for wdtype in (torch.float32, torch.float64):
        torch.library.opcheck(torch.ops.fastbert.linear_residual_bwd.default, (dy, dres, x, w, True, wdtype,
                                                                                     None))
    dx, dw, db = linear_residual_bwd(dy, None, x, w, False, torch.float32)
    assert db.numel() == 0
    torch.testing.assert_close(dx, dy @ w)

    def f(x, w, b):
        y, passed = linear_residual(x, w, b)
        return (y ** 2).sum() + (passed * 3).sum()

    assert_compiled_matches_eager(f, (x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)))


def test_frozen_bias_gets_no_gradient_and_the_rest_is_unchanged(monkeypatch):
    """A bias that takes no gradient (frozen) is added but not reduced in the backward; x and the weight get
    the reference's gradients."""
    import fastbert.ops.linear as lin

    def no_reduction(*a):
        raise AssertionError("the backward reduced a frozen bias")
    monkeypatch.setattr(lin, "bias_grad", no_reduction)
    x, w, b, dy, dres = make(11, 16, 24)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    frozen = b.clone()
    y, passed = linear_residual(leaves[0], leaves[1], frozen)
    got = torch.autograd.grad((y * dy).sum() + (passed * dres).sum(), leaves)
    want = grads(linear_residual_ref, x, w, b, dy, dres, torch.float64)
    torch.testing.assert_close(y, want[0])
    for a, e in zip(got, want[1:3]):
        torch.testing.assert_close(a, e)
    assert frozen.grad is None


def test_cast_copy_never_stands_in_for_x():
    """Under autocast an fp32 x is cast for the GEMM; the residual must still get x itself (fp32)."""
    x, w, b, _, _ = make(8, 16, 24, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, passed = linear_residual(x.requires_grad_(), w, b)
    assert passed is x and y.dtype == torch.bfloat16


def master_weight_grads(fn, x, w, b, dy, dres, device_type, dtype):
    """Gradients of fp32 parameters (x too) through ``fn`` under ``dtype`` autocast; x enters as autocast's
    cast of it, as a layer's input does."""
    leaves = [t.detach().float().requires_grad_() for t in (x, w, b)]
    with torch.autocast(device_type, dtype=dtype):
        y, passed = fn(leaves[0].to(dtype), *leaves[1:])
    loss = (y.float() * dy.float()).sum() + (passed.float() * dres.float()).sum()
    return (y, *torch.autograd.grad(loss, leaves))


def test_master_weights_get_their_gradients_in_their_dtype():
    """fp32 parameters under bf16 autocast: the op casts them inside and hands back fp32 gradients, equal to
    autocast's (a bf16 GEMM, rounded, cast up: what the CPU runs too)."""
    x, w, b, dy, dres = make(24, 16, 40, torch.float32)
    got = master_weight_grads(linear_residual, x, w, b, dy, dres, "cpu", torch.bfloat16)
    want = master_weight_grads(linear_residual_ref, x, w, b, dy, dres, "cpu", torch.bfloat16)
    assert [g.dtype for g in got] == [torch.bfloat16] + [torch.float32] * 3
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)  # dweight: the same GEMM and rounding
    # dbias: summed into fp32 here, rounded to bf16 by autocast's sum; out; dx: the residual's gradient added
    # inside the GEMM, before its rounding: each within a bf16 rounding or two
    for a, e in zip((got[3], *got[:2]), (want[3], *want[:2])):
        torch.testing.assert_close(a.float(), e.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_master_weight_gradients_are_the_fp32_accumulator():
    """On CUDA the weight gradient is the GEMM's fp32 accumulator written out: closer to fp64 than autocast's
    (rounded to bf16 first), and never farther than a bf16 rounding."""
    x, w, b, dy, dres = make(4096, 1024, 3072, torch.float32, "cuda")
    got = master_weight_grads(linear_residual, x, w, b, dy, dres, "cuda", torch.bfloat16)
    amp = master_weight_grads(linear_residual_ref, x, w, b, dy, dres, "cuda", torch.bfloat16)
    leaves = [t.double().requires_grad_() for t in (x.bfloat16().float(), w, b)]
    y, passed = linear_residual_ref(*leaves)
    ref = torch.autograd.grad((y * dy.double()).sum() + (passed * dres.double()).sum(), leaves)
    for name, a, s, r in zip(("dweight", "dbias"), got[2:], amp[2:], ref[1:]):
        assert a.dtype == torch.float32, name
        err, amp_err = (a.double() - r).abs().max(), (s.double() - r).abs().max()
        assert err <= amp_err * 1.01 + 1e-6, (name, float(err), float(amp_err))
    assert (got[2].double() - ref[1]).abs().max() < 0.5 * (amp[2].double() - ref[1]).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_bias_grad_accumulates_in_fp32(dtype):
    """On CUDA the bias gradient is a GEMM with a row of ones: its fp32 accumulator, written in the bias's dtype.
    Column sums of 16384 N(0, 1) values are ~128 in size; fp32 accumulation lands within 1e-3 of fp64 (measured
    ~1e-4), where bf16 accumulation would be off by whole units."""
    dy = torch.randn(16384, 3072, device="cuda").bfloat16()
    ref = dy.double().sum(0)
    got = bias_grad(dy, dtype)
    assert got.dtype == dtype and got.shape == (3072,)
    if dtype == torch.float32:
        assert (got.double() - ref).abs().max() < 1e-3
    else:  # one bf16 rounding of the fp32 sum
        torch.testing.assert_close(got.double(), ref, rtol=2 ** -8, atol=1e-3)


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
