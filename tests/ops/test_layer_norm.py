"""Fused residual + bias + dropout + LayerNorm vs the plain-PyTorch reference.

Every output and gradient is compared with an fp64 reference; the kernel's error must stay within
2x the error of torch's own same-dtype computation plus a small atol (flash-attn's rule), so the
tolerance follows from the dtype instead of being picked per test. CPU runs use the Triton
interpreter (tests/conftest.py), hence the small shapes.
"""
import pytest
import torch

from fastbert.ops._common import bwd_row_partition, dropout_mask
from fastbert.ops.layer_norm import dropout_add_layer_norm, dropout_add_layer_norm_ref
from ops_testing import DEVICE, assert_compiled_matches_eager, assert_within


def make_inputs(shape, dtype, has_res=True, has_xb=True, has_bias=True):
    n = shape[-1]
    g = torch.Generator().manual_seed(sum(shape) + n)
    t = {
        "x": torch.randn(shape, generator=g),
        "residual": torch.randn(shape, generator=g) if has_res else None,
        "weight": 1 + 0.5 * torch.randn(n, generator=g),
        "bias": torch.randn(n, generator=g) if has_bias else None,
        "x_bias": torch.randn(n, generator=g) if has_xb else None,
    }
    return {k: (v.to(DEVICE, dtype).requires_grad_() if v is not None else None) for k, v in t.items()}


def run(fn, inputs, grads, dtype=None, **kw):
    """Forward + backward of ``fn`` on copies of ``inputs`` cast to ``dtype``; returns (outs, grads)."""
    leaves = {k: (v.detach().to(dtype or v.dtype).requires_grad_() if v is not None else None)
              for k, v in inputs.items()}
    outs = fn(leaves["x"], leaves["residual"], leaves["weight"], leaves["bias"], 1e-5, x_bias=leaves["x_bias"], **kw)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.float() * g.float()).sum() for o, g in zip(outs, grads))
    names = [k for k, v in leaves.items() if v is not None]
    dl = torch.autograd.grad(loss, [leaves[k] for k in names])
    return outs, dict(zip(names, dl))


def check_against_reference(inputs, dtype, prenorm, mask=None, p=0.0, seed=0):
    shape = inputs["x"].shape
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=g).to(DEVICE, dtype) for _ in range(2 if prenorm else 1)]

    def ref(x, residual, weight, bias, eps, x_bias=None, **_):
        # The reference with the fused op's mask (the reference itself draws masks from torch's RNG).
        if mask is not None:
            x = (x + x_bias) * mask.view(shape) / (1 - p)
            x_bias = None
        return dropout_add_layer_norm_ref(x, residual, weight, bias, eps, x_bias=x_bias, prenorm=prenorm)

    outs, dk = run(dropout_add_layer_norm, inputs, grads, dropout_p=p, prenorm=prenorm, seed=seed)
    outs_same, ds = run(ref, inputs, grads)
    outs_ref, dr = run(ref, inputs, grads, dtype=torch.float64)
    for i, (o, s, r) in enumerate(zip(outs, outs_same, outs_ref)):
        assert o.dtype == dtype and o.shape == shape
        assert_within(f"out{i}", o, s, r, dtype)
    for k in dk:
        assert dk[k].dtype == inputs[k].dtype
        assert_within(f"d{k}", dk[k], ds[k], dr[k], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1023), (3, 7, 256), (5, 37), (2, 3, 768), (1, 2)])
def test_matches_reference(shape, dtype):
    check_against_reference(make_inputs(shape, dtype), dtype, prenorm=True)


@pytest.mark.parametrize("has_res,has_xb,has_bias,prenorm", [
    (False, False, True, False), (True, False, True, False), (False, True, False, True), (True, True, False, False)])
def test_optional_inputs(has_res, has_xb, has_bias, prenorm):
    inputs = make_inputs((9, 100), torch.float32, has_res, has_xb, has_bias)
    check_against_reference(inputs, torch.float32, prenorm=prenorm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_matches_masked_reference(dtype, p):
    """Forward and backward (which regenerates the mask from the seed) equal the reference with
    the same mask applied explicitly."""
    inputs = make_inputs((6, 130), dtype)
    mask = dropout_mask(1234, 6, 130, p, DEVICE)
    assert 0 < mask.sum() < mask.numel()
    check_against_reference(inputs, dtype, prenorm=True, mask=mask, p=p, seed=1234)


def test_dropout_mask_fraction_and_reproducibility():
    rows, n, p = 64, 1000, 0.3
    x = torch.ones(rows, n, device=DEVICE)
    w, b = torch.ones(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    _, s1 = dropout_add_layer_norm(x, None, w, b, 1e-5, dropout_p=p, prenorm=True, seed=42)
    _, s2 = dropout_add_layer_norm(x, None, w, b, 1e-5, dropout_p=p, prenorm=True, seed=42)
    _, s3 = dropout_add_layer_norm(x, None, w, b, 1e-5, dropout_p=p, prenorm=True, seed=43)
    kept = (s1 != 0).float().mean().item()
    sigma = (p * (1 - p) / s1.numel()) ** 0.5
    assert abs(kept - (1 - p)) < 5 * sigma
    assert torch.allclose(s1[s1 != 0], torch.full_like(s1[s1 != 0], 1 / (1 - p)))
    assert torch.equal(s1, s2)
    assert not torch.equal(s1, s3)
    assert torch.equal(s1 != 0, dropout_mask(42, rows, n, p, DEVICE))
    # seed=None draws from torch's CPU generator, so torch.manual_seed makes it reproducible.
    torch.manual_seed(0)
    _, a = dropout_add_layer_norm(x, None, w, b, 1e-5, dropout_p=p, prenorm=True)
    torch.manual_seed(0)
    _, c = dropout_add_layer_norm(x, None, w, b, 1e-5, dropout_p=p, prenorm=True)
    assert torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_post_ln_dropout_matches_masked_reference(dtype):
    """Post-LN with dropout recomputes the sum and draws the mask again in its backward (Pre-LN, above, reads
    the stored sum and the mask's bits); its forward and every gradient equal the masked reference."""
    inputs = make_inputs((7, 200), dtype)
    mask = dropout_mask(77, 7, 200, 0.1, DEVICE)
    check_against_reference(inputs, dtype, prenorm=False, mask=mask, p=0.1, seed=77)


@pytest.mark.parametrize("prenorm", [True, False])
def test_backward_walks_several_strips_a_program(prenorm):
    """The backward's programs walk several row strips each, loading the next strip during this one's math; 190
    rows of 96 columns give every program three strips of 8 rows (the last program 8, 8, 6: its prefetch past
    the end is masked). Every gradient equals the masked reference, Pre-LN (stored sum and bits) and Post-LN
    (recomputed sum, mask drawn again)."""
    block_m, _, _, programs, rows_per_program = bwd_row_partition(190, 96, torch.device(DEVICE),
                                                                  elems_per_program=1024)
    if DEVICE == "cpu":
        assert (block_m, programs, rows_per_program) == (8, 8, 24)
    inputs = make_inputs((5, 38, 96), torch.float32)
    mask = dropout_mask(5, 190, 96, 0.2, DEVICE)
    check_against_reference(inputs, torch.float32, prenorm=prenorm, mask=mask, p=0.2, seed=5)


@pytest.mark.parametrize("prenorm,p", [(True, 0.0), (True, 0.2), (False, 0.2)])
def test_backward_reads_the_stored_sum_not_x(prenorm, p):
    """Pre-LN keeps the pre-norm sum, not x, for the backward (x, a GEMM's output, can go), and its forward's
    statistics are those of the sum as stored: y is LayerNorm of the returned (rounded) s. Post-LN keeps x."""
    inputs = make_inputs((6, 96), torch.float16)
    # around 100 the sum's fp16 rounding (up to 0.03) moves the statistics well beyond y's own rounding
    inputs["residual"] = (inputs["residual"].detach() + 100).requires_grad_()
    args = [inputs[k] for k in ("x", "residual", "weight", "bias")]
    out = dropout_add_layer_norm(*args, 1e-5, x_bias=inputs["x_bias"], dropout_p=p, prenorm=prenorm, seed=3)
    y = out[0] if prenorm else out
    saved = y.grad_fn.saved_tensors
    assert (saved[0].data_ptr() == inputs["x"].data_ptr()) != prenorm
    if prenorm:
        s = out[1]
        assert saved[0].data_ptr() == s.data_ptr()
        w, b = inputs["weight"].detach().float(), inputs["bias"].detach().float()
        y_of_s = torch.nn.functional.layer_norm(s.detach().float(), (96,), w, b, 1e-5)
        torch.testing.assert_close(y.detach().float(), y_of_s, rtol=0, atol=2e-3)  # fp16 output rounding


def test_recomputed_backward_with_dropout_and_mixed_dtypes():
    """An fp16 x with an fp32 residual (autocast) keeps the recomputing backward, which draws the mask again."""
    inputs = make_inputs((5, 96), torch.float32)
    inputs["x"] = inputs["x"].detach().half().requires_grad_()
    mask = dropout_mask(11, 5, 96, 0.25, DEVICE).view(5, 96)
    grads = [torch.randn(5, 96, generator=torch.Generator().manual_seed(2)).to(DEVICE)]
    outs, dk = run(dropout_add_layer_norm, inputs, grads, dropout_p=0.25, seed=11)

    def masked_ref(x, residual, weight, bias, eps, x_bias=None):
        return dropout_add_layer_norm_ref((x + x_bias) * mask / 0.75, residual, weight, bias, eps)

    outs_ref, dr = run(masked_ref, {k: v.double() for k, v in inputs.items()}, grads)
    torch.testing.assert_close(outs[0].double(), outs_ref[0], rtol=2e-3, atol=2e-3)
    for k in dk:
        torch.testing.assert_close(dk[k].double(), dr[k].double(), rtol=2e-3, atol=2e-3)


def test_p_zero_is_exactly_no_dropout():
    inputs = make_inputs((4, 64), torch.float32)
    args = [inputs[k] for k in ("x", "residual", "weight", "bias")]
    y1, s1 = dropout_add_layer_norm(*args, 1e-5, x_bias=inputs["x_bias"], dropout_p=0.0, prenorm=True, seed=1)
    y2, s2 = dropout_add_layer_norm(*args, 1e-5, x_bias=inputs["x_bias"], dropout_p=0.0, prenorm=True, seed=999)
    assert torch.equal(y1, y2) and torch.equal(s1, s2)
    # No element dropped or rescaled: the pre-norm sum is exactly x + x_bias + residual in fp32.
    exact = (inputs["x"].detach() + inputs["x_bias"].detach()) + inputs["residual"].detach()
    assert torch.equal(s1.detach(), exact)
    dx, dres = torch.autograd.grad(y1.sum() + s1.sum(), (inputs["x"], inputs["residual"]))
    assert torch.equal(dx, dres)


def test_rejects_bad_arguments():
    x = torch.randn(2, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_add_layer_norm(x, None, w, None, 1e-5, dropout_p=1.0)
    with pytest.raises(ValueError, match="weight"):
        dropout_add_layer_norm(x, None, torch.ones(8, device=DEVICE), None, 1e-5)
    with pytest.raises(ValueError, match="8192"):
        dropout_add_layer_norm(torch.randn(1, 8200, device=DEVICE), None, torch.ones(8200, device=DEVICE), None, 1e-5)


def test_custom_op_and_torch_compile():
    """Registered ops pass torch's op checks, and a compiled graph around the op (forward and
    backward) gives the eager result."""
    inputs = make_inputs((3, 48), torch.float32)
    x, r, w, b, xb = (inputs[k].detach() for k in ("x", "residual", "weight", "bias", "x_bias"))
    torch.library.opcheck(torch.ops.fastbert.dropout_add_layer_norm_fwd.default,
                          (x, r, w, b, 1e-5, xb, 0.2, torch.tensor([7], device=DEVICE), True, True))
    y, s, mean, rstd, bits = torch.ops.fastbert.dropout_add_layer_norm_fwd(x, r, w, b, 1e-5, xb, 0.2,
                                                                           torch.tensor([7], device=DEVICE), True, True)
    torch.library.opcheck(torch.ops.fastbert.dropout_add_layer_norm_bwd.default,
                          (torch.randn_like(y), torch.randn_like(s), s, r, w, b, xb, mean, rstd, 0.2,
                           torch.tensor([7], device=DEVICE), bits, True))

    def f(x, r, w, b, xb):
        y, s = dropout_add_layer_norm(x, r, w, b, 1e-5, x_bias=xb, dropout_p=0.2, prenorm=True, seed=7)
        return (y * y).sum() + s.sum()

    assert_compiled_matches_eager(f, (x, r, w, b, xb))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8, 512, 768), (8, 512, 1024), (2, 64, 8192)])
def test_gpu_bert_shapes(shape, dtype):
    check_against_reference(make_inputs(shape, dtype), dtype, prenorm=True)
    mask = dropout_mask(5, shape[0] * shape[1], shape[2], 0.1, DEVICE)
    check_against_reference(make_inputs(shape, dtype), dtype, prenorm=False, mask=mask, p=0.1, seed=5)


def test_mixed_dtypes_like_autocast():
    """Under torch.autocast a block sees x in fp16 from a matmul but an fp32 residual and fp32
    parameters: output and pre-norm sum follow x's dtype, each gradient its input's dtype."""
    inputs = make_inputs((5, 96), torch.float32)
    inputs["x"] = inputs["x"].detach().half().requires_grad_()
    grads = [torch.randn(5, 96, generator=torch.Generator().manual_seed(2)).to(DEVICE) for _ in range(2)]
    outs, dk = run(dropout_add_layer_norm, inputs, grads, prenorm=True)
    outs_ref, dr = run(dropout_add_layer_norm_ref, {k: v.double() for k, v in inputs.items()}, grads, prenorm=True)
    assert [o.dtype for o in outs] == [torch.float16, torch.float16]
    assert dk["x"].dtype == torch.float16 and dk["residual"].dtype == torch.float32
    for o, r in zip(outs, outs_ref):
        torch.testing.assert_close(o.double(), r, rtol=2e-3, atol=2e-3)
    for k in dk:
        torch.testing.assert_close(dk[k].double(), dr[k].double(), rtol=2e-3, atol=2e-3)


def test_dropout_mask_has_no_pattern():
    """Each Philox call serves eight adjacent columns (16 random bits each; the attention kernels draw
    theirs the same way): neighbours at every distance within and across calls, and in the next row,
    must still be independent, and every column keeps about 1 - p. Wiring two columns to the same
    bits, or a biased half, fails here."""
    rows, n, p = 256, 203, 0.5
    keep = dropout_mask(9, rows, n, p, DEVICE).float()
    sigma = lambda count: 5 * (0.25 / count) ** 0.5  # noqa: E731
    pairs = [(keep[:, :-d], keep[:, d:]) for d in range(1, 17)] + [(keep[:-1], keep[1:])]
    for a, b in pairs:
        agree = (a == b).float().mean().item()
        assert abs(agree - 0.5) < sigma(a.numel()), agree
    per_col = keep.mean(0)
    assert (per_col - (1 - p)).abs().max().item() < 5 * (0.25 / rows) ** 0.5
