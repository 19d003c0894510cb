"""Fused linear + bias + GELU, and the whole FFN (up-projection, GELU, down-projection), vs the
plain-PyTorch references.

Outputs and gradients are compared with an fp64 reference; the kernel's error must stay within 2x
torch's own same-dtype error plus a small atol. CPU runs use the Triton interpreter, hence the
small shapes; sizes are chosen off the tile grid (M, N, K not multiples of 32).
"""
import pytest
import torch

from fastbert.ops import cublaslt
from fastbert.ops.ffn import ffn, ffn_ref, gelu_bwd, gelu_grad_ref, linear_bias_gelu, linear_bias_gelu_ref
from ops_testing import DEVICE, assert_compiled_matches_eager, assert_within


def make_inputs(lead, k, n, dtype, has_bias=True):
    g = torch.Generator().manual_seed(k * 7 + n)
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if has_bias else None
    return [t.to(DEVICE, dtype) if t is not None else None for t in (x, w, b)]


def run(fn, inputs, dy, dtype, approximate):
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in inputs]
    y = fn(*leaves, approximate=approximate)
    live = [t for t in leaves if t is not None]
    return y, torch.autograd.grad((y.float() * dy.float()).sum(), live)


def check(lead, k, n, dtype, approximate, has_bias=True):
    inputs = make_inputs(lead, k, n, dtype, has_bias)
    dy = torch.randn(*lead, n, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    y, dk = run(linear_bias_gelu, inputs, dy, dtype, approximate)
    y_same, ds = run(linear_bias_gelu_ref, inputs, dy, dtype, approximate)
    y_ref, dr = run(linear_bias_gelu_ref, inputs, dy, torch.float64, approximate)
    assert y.dtype == dtype and y.shape == (*lead, n)
    assert_within("out", y, y_same, y_ref, dtype)
    for name, a, b, c in zip(("dx", "dweight", "dbias"), dk, ds, dr):
        assert_within(name, a, b, c, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead,k,n", [((1,), 1, 1), ((1,), 17, 33), ((37,), 64, 96), ((2, 5), 48, 40),
                                      ((70,), 40, 130)])
def test_matches_reference(lead, k, n, dtype, approximate):
    check(lead, k, n, dtype, approximate)


def test_no_bias():
    check((9,), 20, 50, torch.float32, "none", has_bias=False)


def test_inference_path_equals_training_path():
    """Without grad the kernel skips storing the pre-activation; the output must not change."""
    x, w, b = make_inputs((33,), 40, 70, torch.float32)
    with torch.no_grad():
        y_inf = linear_bias_gelu(x, w, b)
    y_train = linear_bias_gelu(x.requires_grad_(), w, b)
    assert torch.equal(y_inf, y_train.detach())


def test_gelu_tails():
    """Large |z|: erf / tanh saturate without inf or NaN, in the output and the derivative."""
    x = torch.tensor([[-30.0], [-8.0], [0.0], [8.0], [30.0], [1e4]], device=DEVICE, requires_grad=True)
    w = torch.ones(1, 1, device=DEVICE)
    for approximate in ("none", "tanh"):
        y = linear_bias_gelu(x, w, None, approximate)
        (dx,) = torch.autograd.grad(y.sum(), x)
        xr = x.detach().double().requires_grad_()
        yr = torch.nn.functional.gelu(xr, approximate=approximate)
        (dxr,) = torch.autograd.grad(yr.sum(), xr)
        torch.testing.assert_close(y.double(), yr, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(dx.double(), dxr, atol=1e-6, rtol=1e-6)


def test_rejects_bad_arguments():
    x, w, b = make_inputs((4,), 8, 16, torch.float32)
    with pytest.raises(ValueError, match="approximate"):
        linear_bias_gelu(x, w, b, approximate="sigmoid")
    with pytest.raises(ValueError, match="weight"):
        linear_bias_gelu(x[:, :4], w, b)
    with pytest.raises(TypeError, match="dtype|float"):
        linear_bias_gelu(x.half(), w, b)


def test_custom_op_and_torch_compile():
    x, w, b = make_inputs((5,), 24, 40, torch.float32)
    torch.library.opcheck(torch.ops.fastbert.linear_bias_gelu_fwd.default, (x, w, b, "tanh", True))

    def f(x, w, b):
        return (linear_bias_gelu(x, w, b, "tanh") ** 2).sum()

    assert_compiled_matches_eager(f, (x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,dtype", [(4096, 768, 3072, torch.bfloat16), (4096, 1024, 4096, torch.bfloat16),
                                         (1000, 3072, 768, torch.bfloat16), (2458, 1024, 1024, torch.float16)])
def test_gpu_bert_shapes(m, k, n, dtype):
    check((m,), k, n, dtype, "none")
    check((m,), k, n, dtype, "tanh")


# ------------------------------------------------------------------------------------------ the whole FFN
def check_ffn(lead, h, i, dtype, approximate, has_bias=True):
    g = torch.Generator().manual_seed(h * 5 + i)
    x = torch.randn(*lead, h, generator=g)
    w1 = torch.randn(i, h, generator=g) / h ** 0.5
    b1 = torch.randn(i, generator=g) if has_bias else None
    w2 = torch.randn(h, i, generator=g) / i ** 0.5
    dy = torch.randn(*lead, h, generator=g)
    inputs = [t.to(DEVICE) if t is not None else None for t in (x, w1, b1, w2)]
    dy = dy.to(DEVICE)

    def run(fn, dt):
        leaves = [t.detach().to(dt).requires_grad_() if t is not None else None for t in inputs]
        y = fn(*leaves, approximate=approximate)
        live = [t for t in leaves if t is not None]
        return y, torch.autograd.grad((y.float() * dy.float()).sum(), live)

    y, dk = run(ffn, dtype)
    y_same, ds = run(ffn_ref, dtype)
    y_ref, dr = run(ffn_ref, torch.float64)
    assert y.dtype == dtype and y.shape == (*lead, h)
    assert_within("out", y, y_same, y_ref, dtype)
    for name, a, b, c in zip(("dx", "dw1", "db1", "dw2") if has_bias else ("dx", "dw1", "dw2"), dk, ds, dr):
        assert_within(name, a, b, c, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead,h,i", [((1,), 1, 1), ((37,), 24, 40), ((2, 5), 17, 33)])
def test_ffn_matches_reference(lead, h, i, dtype, approximate):
    check_ffn(lead, h, i, dtype, approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_ffn_residual_gradient_joins_dx(approximate):
    """``residual=True``: the gradient reaching the returned x (a residual add's) is added to dx inside the
    backward; the result must equal autograd's sum of the two paths."""
    g = torch.Generator().manual_seed(1)
    x, w1, b1, w2, dy, dr = (torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE)
                             for s in ((11, 16), (24, 16), (24,), (16, 24), (11, 16), (11, 16)))

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
        out, passed = fn(*leaves, approximate=approximate, residual=True)
        return torch.autograd.grad((out * dy).sum() + (passed * dr).sum(), leaves)

    for a, e in zip(run(ffn), run(ffn_ref)):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)  # the kernels' GELU is fp32


@pytest.mark.parametrize("used", ["out", "passed"])
def test_ffn_unused_output_gets_no_zeros(monkeypatch, used):
    """An output nobody uses (Pre-LN drops the passed-through x; rarely the FFN's own output) reaches the
    backward as None, not as a materialized tensor of zeros the input-gradient GEMM would read; gradients equal
    the reference's."""
    import fastbert.ops.ffn as F
    seen = []
    real = F._ffn_bwd_op
    monkeypatch.setattr(F, "_ffn_bwd_op", lambda dout, dres, *a: seen.append(dres) or real(dout, dres, *a))
    g = torch.Generator().manual_seed(2)
    x, w1, b1, w2, dy = (torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE)
                         for s in ((9, 16), (24, 16), (24,), (16, 24), (9, 16)))

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
        out, passed = fn(*leaves, approximate="none", residual=True)
        return torch.autograd.grad(((out if used == "out" else passed) * dy).sum(), leaves, allow_unused=True)

    got, want = grads(ffn), grads(ffn_ref)
    assert seen == ([None] if used == "out" else [])  # only the passed-through x used: no FFN backward at all
    for a, e in zip(got, want):
        if e is None:  # w1, b1, w2 get no gradient through the passed-through x
            assert a is None
        else:
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_ffn_no_bias_inference_and_compile():
    check_ffn((9,), 16, 24, torch.float32, "tanh", has_bias=False)
    g = torch.Generator().manual_seed(0)
    x, w1, b1, w2 = (torch.randn(*s, generator=g).to(DEVICE) for s in ((7, 16), (24, 16), (24,), (16, 24)))
    with torch.no_grad():
        y_inf = ffn(x, w1, b1, w2, "tanh")
    torch.testing.assert_close(y_inf, ffn(x.requires_grad_(), w1, b1, w2, "tanh").detach())
    torch.library.opcheck(torch.ops.fastbert.ffn_fwd.default, (x.detach(), w1, b1, w2, "tanh", True))
    with pytest.raises(ValueError, match="chain"):
        ffn(x, w1, b1, w2.t())
    assert_compiled_matches_eager(lambda *t: (ffn(*t, "tanh") ** 2).sum(), (x.detach(), w1, b1, w2))


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("m,h,i,dtype", [(4096, 768, 3072, torch.bfloat16), (2000, 1024, 4096, torch.bfloat16),
                                         (1000, 384, 1536, torch.float16)])
def test_gpu_ffn_bert_shapes(m, h, i, dtype, approximate):
    check_ffn((m,), h, i, dtype, approximate)
    check_ffn((m,), h, i, dtype, approximate, has_bias=False)
    if approximate == "tanh":  # the GELU and its derivative ran inside cuBLASLt's GEMMs, not beside them
        ran = {key[3] for key, entry in cublaslt._lt().problems.items() if entry is not None}
        assert {"gelu_aux_bias", "gelu_aux", "dgelu"} <= ran, ran


def ffn_master_grads(fn, x, w1, b1, w2, dtype, approximate, device_type):
    """fp32 parameters under ``dtype`` autocast (x enters cast, as a layer's input does)."""
    leaves = [t.detach().float().requires_grad_() for t in (x, w1, b1, w2)]
    with torch.autocast(device_type, dtype=dtype):
        out = fn(leaves[0].to(dtype), *leaves[1:], approximate=approximate)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device)
    return (out, *torch.autograd.grad((out.float() * dy).sum(), leaves, allow_unused=True))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_ffn_master_weights_get_their_gradients_in_their_dtype(approximate):
    """fp32 parameters under 16-bit autocast: ffn and linear_bias_gelu cast them inside and return fp32
    gradients (no cast recorded by autograd), within 16-bit error of autocast's own (the reference's)."""
    g = torch.Generator().manual_seed(1)
    x, w1, b1, w2 = (torch.randn(*s, generator=g).to(DEVICE) / 4 for s in ((21, 16), (40, 16), (40,), (16, 40)))
    got = ffn_master_grads(ffn, x, w1, b1, w2, torch.float16, approximate, DEVICE)
    want = ffn_master_grads(ffn_ref, x, w1, b1, w2, torch.float16, approximate, DEVICE)
    assert [t.dtype for t in got] == [torch.float16] + [torch.float32] * 4
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-3, atol=2e-3)
    got = ffn_master_grads(lambda *t, approximate: linear_bias_gelu(*t[:3], approximate), x, w1, b1, w2,
                           torch.float16, approximate, DEVICE)
    assert [t.dtype for t in got[2:4]] == [torch.float32] * 2


def test_gelu_backward_from_the_kept_derivative():
    """Given gelu'(z) (what the forward keeps where the sm_90 library computes GELU) instead of z, the Triton GELU
    backward gives dz and d(bias) as from z."""
    g = torch.Generator().manual_seed(4)
    z, dy = (torch.randn(37, 70, generator=g).to(DEVICE) for _ in range(2))
    dz, db = gelu_bwd(dy, z, "none")
    dz_kept, db_kept = gelu_bwd(dy, gelu_grad_ref(z), "none", grad=True)
    torch.testing.assert_close(dz_kept, dz, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(db_kept, db, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dz, dy * gelu_grad_ref(z), rtol=1e-5, atol=1e-6)


def test_backward_ops_schema():
    g = torch.Generator().manual_seed(2)
    x, w1, b1, w2, dy = (torch.randn(*s, generator=g).to(DEVICE) for s in ((7, 16), (24, 16), (24,), (16, 24), (7, 16)))
    z = x @ w1.t() + b1
    y = torch.nn.functional.gelu(z)
    for wdtype in (torch.float32, torch.float64):
        torch.library.opcheck(torch.ops.fastbert.ffn_bwd.default, (dy, dy, x, w1, b1, w2, y, z, "none", wdtype,
                                                                         None, None))
        torch.library.opcheck(torch.ops.fastbert.linear_bias_gelu_bwd.default,
                              (y, x, w1, b1, z, "tanh", wdtype))


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gpu_ffn_master_weights(approximate):
    """bf16 autocast over fp32 parameters at a BERT shape: fp32 gradients within bf16 error of autocast's."""
    g = torch.Generator().manual_seed(3)
    x, w1, b1, w2 = (torch.randn(*s, generator=g).cuda() / 8 for s in ((4096, 1024), (4096, 1024), (4096,),
                                                                       (1024, 4096)))
    got = ffn_master_grads(ffn, x, w1, b1, w2, torch.bfloat16, approximate, "cuda")
    want = ffn_master_grads(ffn_ref, x, w1, b1, w2, torch.bfloat16, approximate, "cuda")
    assert [t.dtype for t in got[2:]] == [torch.float32] * 3
    for name, a, e in zip(("out", "dx", "dw1", "db1", "dw2"), got, want):
        scale = e.float().abs().max()
        assert (a.float() - e.float()).abs().max() <= 2e-2 * scale, name
