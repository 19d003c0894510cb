"""FP8 linear layers (fastbert/ops/fp8.py): the cast kernel against its reference, delayed scaling, and
the three FP8 GEMMs against F.linear.

Tolerances follow from the formats. e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most
2^-4 of a value, ~2^-4/sqrt(3) = 3.6% rms over uniformly spread mantissas; e5m2 keeps 2 bits, 7.2% rms.
A GEMM output is a sum of products whose rounding errors are independent, so its relative error (as a
norm over the whole output) is about the rms error of one product: sqrt(0.036^2 + 0.036^2) = 5% for
the forward (both operands e4m3), sqrt(0.072^2 + 0.036^2) = 8% for the gradients (e5m2 x e4m3). The
bounds below are those with a margin (6% and 11%); a GEMM with a wrong operand or transpose is off
by ~100%. On the CPU the kernel runs in Triton's interpreter, whose own fp8 conversion may round to the
neighbouring fp8 value where the GPU (and torch) round to nearest-even, and loses the carry when
rounding up reaches the next power of two (125.2 -> 64 where torch gives 128): there the kernel computes
the codes from the bits instead (``fp8._fp8_codes``), e4m3 to torch's value, so e4m3 values are compared as
on a GPU; e5m2 values (fp16's top byte, rounded twice) by sign, and the kernel's scale, pre-op arithmetic
(through the amax and column sums), transposes and history are checked exactly.
"""
import pytest
import torch
import torch.nn.functional as F

import fastbert.ops.fp8 as fp8_module
from fastbert.ops._common import HAS_TRITON
from fastbert.ops.fp8 import (E4M3, E5M2, FP8_MAX, HISTORY, AmaxHistory, cast_fp8, cast_fp8_ref, cast_fp8_triton,
                              fp8_ffn, fp8_linear, pre_op_ref)
from ops_testing import DEVICE

FWD_BOUND, BWD_BOUND = 0.06, 0.11
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fresh_history(rows=3):
    h = AmaxHistory(rows, DEVICE)
    h.advance()
    return h


@needs_triton
@pytest.mark.parametrize("wide", [False, True], ids=["idx32", "idx64"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("src", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(37, 70), (64, 32), (1, 130)])
@pytest.mark.parametrize("looping", [False, True], ids=["tile_a_program", "one_program"])
def test_cast_kernel_matches_reference(shape, src, dtype, wide, looping, monkeypatch):
    """Also through the 64-bit indexing that tensors of 2**31 elements or more take (forced here), and with one
    program that walks every tile in its pipelined loop (the amax and column sums gathered across tiles). Both ways
    to the transpose (BYTE_T): the default launches here take bytes, the looping one words."""
    if wide:
        monkeypatch.setattr(fp8_module, "_WIDE", 0)
    launch = None
    if looping:
        monkeypatch.setattr(fp8_module, "num_sms", lambda device: 1)
        launch = (32, 32, 4, 2, 1, False)  # 32 x 32 tiles, 2 stages, 1 program an SM, words
    g = torch.Generator().manual_seed(shape[0] * 131 + shape[1])
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, src)
    x[0, 0] = float("inf")  # left out of the amax, saturates in the cast
    x[-1, 0] = -float("inf")  # (37, 70): in another program's tile than [0, 0] (the interpreter's 32-row tiles)
    hk, hr = fresh_history(), fresh_history()
    for h in (hk, hr):  # a history: scale from the previous slots, not this one
        h.amax[0, 0] = 5.0
        h.amax[0, 1] = 123.0  # the current slot's old value (advance zeroed it) must not count
        h.amax[0, 1] = 0.0
    k8, kt, ks, kcol = cast_fp8_triton(x, hk, 0, dtype, colsum=True, launch=launch)
    r8, rt, rs = cast_fp8_ref(x, hr, 0, dtype)
    assert k8.dtype == dtype and k8.shape == shape and kt.shape == shape[::-1]
    assert ks.item() == rs.item()  # IEEE division in both: the same scale to the bit, so the same fp8 values
    assert ks.item() == pytest.approx(5.0 / FP8_MAX[dtype])
    assert torch.equal(kt.view(torch.uint8), k8.view(torch.uint8).t())  # the transpose is the same cast
    # the bias-gradient column sums ride along (column 0 holds the inf)
    torch.testing.assert_close(kcol[1:], x.float().sum(0)[1:], rtol=1e-5, atol=1e-4)
    assert_same_cast(k8, r8)
    finite = x.float().abs()[torch.isfinite(x.float())].max()
    assert hk.amax[0, 1].item() == hr.amax[0, 1].item() == pytest.approx(finite.item())
    assert hk.amax[0, 0].item() == 5.0  # earlier slots untouched
    assert torch.equal(hk.amax[1:], torch.zeros_like(hk.amax[1:]))


def assert_same_cast(k8, r8, pre_op=False):
    """Bit-equal on a GPU, except that after a GELU pre-op Triton's erf / exp and torch's differ in the last
    fp32 bits, which moves a value across a rounding boundary now and then (seen: 50 of 524,288 elements, one
    fp8 step each): there at most 1% of the elements may differ, by one step (plus atol below). In the
    interpreter e4m3 likewise (its codes come from the bits, module docstring); e5m2 there by sign only (the
    pre-op's arithmetic is checked exactly through the amax and the column sums instead)."""
    if DEVICE == "cuda" or k8.dtype == E4M3:
        if not pre_op:
            assert torch.equal(k8.view(torch.uint8), r8.view(torch.uint8))
            return
        k, r = k8.float(), r8.float()
        # atol, in scaled fp8 units: e4m3 two subnormal steps; e5m2 (the tanh GELU's derivative, 0.5 (1 + t) +
        # ... at |z| ~ 5, is a difference of near-equal terms: Triton's tanh via exp and torch's differ there by
        # ~1e-6 absolute, all of the value; times |dy| <= 4e-3 and the scale 57344 / amax ~ 1.4e7 that is up to
        # ~0.06) 2^-3, two millionths of e5m2's range (CPU emulation of both formulas: 5 of 3,840 elements, at
        # most 0.023)
        bits, atol = (3, 2 * 2.0 ** -9) if k8.dtype == E4M3 else (2, 2.0 ** -3)
        one_step = (k - r).abs() <= torch.maximum(k.abs(), r.abs()) * 2.0 ** -bits + atol
        assert one_step.all() and (k != r).float().mean() <= 1e-2
        return
    k, r = k8.float(), r8.float()
    assert ((k * r >= 0) | (r.abs() < 2.0 ** -6)).all()


@needs_triton
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("backward", [False, True])
def test_cast_kernel_gelu_pre_ops(backward, approximate):
    """The FFN's fused casts: gelu(z) (forward) and dy * gelu'(z) with the bias-gradient sums (backward)."""
    g = torch.Generator().manual_seed(11)
    z = (torch.randn(40, 96, generator=g) * 2).to(DEVICE, torch.float16)
    dy = (torch.randn(40, 96, generator=g) * 1e-3).to(DEVICE, torch.float16)
    x, zz = (dy, z) if backward else (z, None)
    dtype = E5M2 if backward else E4M3
    hk, hr = fresh_history(), fresh_history()
    for h in (hk, hr):
        h.amax[0, 0] = pre_op_ref(x, approximate, zz).abs().max().item()
    k8, kt, ks, kcol = cast_fp8_triton(x, hk, 0, dtype, colsum=backward, gelu=approximate, z=zz)
    v = pre_op_ref(x, approximate, zz)
    r8, _, rs = cast_fp8_ref(v, hr, 0, dtype)
    torch.testing.assert_close(ks, rs)
    assert_same_cast(k8, r8, pre_op=True)
    assert torch.equal(kt.view(torch.uint8), k8.view(torch.uint8).t())
    assert hk.amax[0, 1].item() == pytest.approx(hr.amax[0, 1].item(), rel=1e-6)
    if backward:
        torch.testing.assert_close(kcol, v.sum(0), rtol=1e-5, atol=1e-7)
    # and the reference pre-ops are torch's GELU and its autograd derivative
    zr = z.float().requires_grad_()
    y = torch.nn.functional.gelu(zr, approximate=approximate)
    if backward:
        y.backward(dy.float())
        torch.testing.assert_close(v, zr.grad, rtol=1e-5, atol=1e-8)  # |values| ~ 1e-3
    else:
        torch.testing.assert_close(v, y.detach())


@needs_triton
@pytest.mark.parametrize("backward", [False, True])
def test_cast_gelu_matches_torch_over_its_range(backward):
    """The casts' exact GELU takes erf from ``ffn._half_erfc`` (Abramowitz & Stegun, |error| <= 1.5e-7): GELU and
    its derivative, read back through the column sums of a one-row cast (the pre-op's fp32 values themselves),
    stay within 1.5e-7 * (1 + |z|) + 1e-6 relative of torch's in float64 from z = -12 to 12. A wrong
    coefficient or sign is off by 1e-3 or more."""
    z = torch.linspace(-12, 12, 4801, dtype=torch.float64)
    zz = z.float().reshape(1, -1).to(DEVICE)
    x, zarg = (torch.ones_like(zz), zz) if backward else (zz, None)
    got = cast_fp8_triton(x, fresh_history(), 0, E5M2 if backward else E4M3, colsum=True, gelu="none", z=zarg)[3]
    zr = z.clone().requires_grad_()
    want = F.gelu(zr)
    if backward:
        want.backward(torch.ones_like(z))
        want = zr.grad
    want = want.detach()
    err = (got.double().cpu() - want).abs()
    assert (err <= 1.5e-7 * (1 + z.abs()) + 1e-6 * want.abs()).all(), float(err.max())


def test_delayed_scaling_follows_the_history():
    h = AmaxHistory(1, DEVICE)
    h.advance()
    x = torch.randn(32, 32, device=DEVICE)
    x8, _, s, _ = cast_fp8(x, h, 0, E4M3)
    # first cast: primed with its own amax, so its largest value lands on the fp8 maximum
    assert (x8.float().abs().max() * s).item() == pytest.approx(x.abs().max().item(), rel=2 ** -4)
    assert s.item() == pytest.approx(x.abs().max().item() / 448.0)
    h.advance()
    big = x * 10
    y8, _, s2, _ = cast_fp8(big, h, 0, E4M3)
    assert s2.item() == pytest.approx(s.item())  # delayed: the previous amax, not this tensor's
    assert y8.float().abs().max().item() == 448.0  # so the 10x larger tensor saturates this once
    h.advance()
    _, _, s3, _ = cast_fp8(big, h, 0, E4M3)
    assert s3.item() == pytest.approx(big.abs().max().item() / 448.0)  # the history's max now
    for _ in range(HISTORY - 1):  # the larger amax stays HISTORY - 1 forwards, then leaves the window
        h.advance()
        cast_fp8(x, h, 0, E4M3)
    h.advance()
    _, _, s4, _ = cast_fp8(x, h, 0, E4M3)
    assert s4.item() == pytest.approx(x.abs().max().item() / 448.0)
    nan = x.clone()
    nan[3, 3] = float("nan")
    h.advance()
    cast_fp8(nan, h, 0, E4M3)
    assert torch.isfinite(h.amax).all()


@needs_triton
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_scale_is_ieee_division_in_kernel_and_reference(dtype):
    """The scale, fp8_max over the history's max, is IEEE division in the kernel (``div_rn``) and in the reference:
    the same float to the bit for any amax. (torch's ``float / tensor`` multiplies by the reciprocal: for this amax
    the e4m3 scale came out 1 ulp high, 72.0837097 against 72.0837021, and the two casts' scales differed.)"""
    amax = 6.214996814727783
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    hk, hr = fresh_history(), fresh_history()
    for h in (hk, hr):
        h.amax[0, 0] = amax
    _, _, kernel_inv, _ = cast_fp8_triton(x, hk, 0, dtype)
    _, _, ref_inv = cast_fp8_ref(x, hr, 0, dtype)
    ieee = torch.tensor(FP8_MAX[dtype]) / torch.tensor(amax)
    assert kernel_inv.item() == ref_inv.item() == (torch.tensor(1.0) / ieee).item()


def run_linear(fn, x, w, b, dy, autocast=False):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return y, [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("has_bias", [True, False])
def test_fp8_linear_matches_linear(has_bias, autocast):
    g = torch.Generator().manual_seed(7)
    t, k, n = 96, 64, 80
    x = torch.randn(2, t // 2, k, generator=g).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.02).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if has_bias else None
    dy = (torch.randn(2, t // 2, n, generator=g) * 1e-4).to(DEVICE)  # gradients are small: e5m2's range
    h = fresh_history()
    y, grads = run_linear(lambda *a: fp8_linear(*a, h, 0), x, w, b, dy, autocast)
    y_ref, grads_ref = run_linear(F.linear, x, w, b, dy)
    assert y.shape == y_ref.shape and y.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert rel(y, y_ref) < FWD_BOUND
    assert rel(grads[0], grads_ref[0]) < BWD_BOUND and grads[0].dtype == x.dtype
    assert rel(grads[1], grads_ref[1]) < BWD_BOUND and grads[1].dtype == w.dtype
    if has_bias:  # d(bias) is a plain column sum of the gradient as it arrives (bf16 under autocast)
        # (fp32 partial sums per row tile on the GPU: another summation order, 2e-5 relative seen)
        torch.testing.assert_close(grads[2], dy.to(y.dtype).float().sum((0, 1)), rtol=1e-4, atol=1e-10)
    assert (h.amax[:, 1] > 0).all()  # input, weight and gradient amaxes recorded this step
    # the bounds can fail: the same GEMM with the weight transposed the wrong way is far off
    assert rel(F.linear(x, w.t().reshape(n, k)), y_ref) > 0.5


def ffn_tensors(seed, t, h, i, dy_cols):
    """(generator, x (t, h), w1 (i, h), b1 (i,), w2 (h, i), a small output gradient (t, dy_cols)) at the scales of a
    trained layer: unit inputs, weights of 1/sqrt(fan-in)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w1 = (torch.randn(i, h, generator=g) * h ** -0.5).to(DEVICE)
    b1 = (torch.randn(i, generator=g) * 0.1).to(DEVICE)
    w2 = (torch.randn(h, i, generator=g) * i ** -0.5).to(DEVICE)
    return g, x, w1, b1, w2, (torch.randn(t, dy_cols, generator=g) * 1e-3).to(DEVICE)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("autocast", [False, True])
def test_fp8_ffn_matches_torch(autocast, approximate):
    """Up-projection, GELU, down-projection: output and every gradient within the FP8 bounds (the FFN
    chains two GEMMs, so the forward errors of both and the backward errors of both add: 2x the bounds)."""
    _, x, w1, b1, w2, dy = ffn_tensors(9, 64, 32, 128, 32)
    hist = AmaxHistory(6, DEVICE)
    hist.advance()

    def run(fn, cast):
        leaves = [a.detach().clone().requires_grad_() for a in (x, w1, b1, w2)]
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=cast):
            out = fn(*leaves)
        out.backward(dy.to(out.dtype))
        return out, [a.grad for a in leaves]

    out, grads = run(lambda a, b, c, d: fp8_ffn(a, b, c, d, hist, 0, approximate), autocast)
    ref, grads_ref = run(lambda a, b, c, d: F.linear(F.gelu(F.linear(a, b, c), approximate=approximate), d), False)
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert rel(out, ref) < 2 * FWD_BOUND
    for name, a, r in zip(("dx", "dw1", "db1", "dw2"), grads, grads_ref):
        assert a.dtype == r.dtype and rel(a, r) < 2 * BWD_BOUND, name
    assert (hist.amax[:, 1] > 0).all()  # all six casts recorded this forward


@pytest.mark.parametrize("op", ["linear", "ffn"])
def test_residual_gradient_joins_the_input_gradient(op):
    """``residual=True`` hands x back for the residual connection: the gradient reaching it is added to the input
    gradient by the input-gradient GEMM (cuBLASLt on a GPU; after ``_scaled_mm`` elsewhere), so x's gradient is
    the one autograd gets when x itself feeds the residual (bitwise off the GPU: the same addition)."""
    t, k, n = 64, 32, 48
    g, x0, w1, b1, w2, dy = ffn_tensors(5, t, k, n, n if op == "linear" else k)
    dres = (torch.randn(t, k, generator=g) * 1e-3).to(DEVICE)

    def run(residual):
        x = x0.clone().requires_grad_()
        hist = AmaxHistory(6, DEVICE)
        hist.advance()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            f = (lambda *a: fp8_linear(x, w1, b1, hist, 0, *a)) if op == "linear" else \
                (lambda *a: fp8_ffn(x, w1, b1, w2, hist, 0, "none", *a))
            y, r = f(True) if residual else (f(), x)
        assert r.shape == x.shape and torch.equal(r, x)
        torch.autograd.backward([y, r], [dy.to(y.dtype), dres.to(r.dtype)])
        return x.grad

    fused, plain = run(True), run(False)
    if DEVICE == "cuda":  # one rounding of dx + dres instead of two
        torch.testing.assert_close(fused, plain, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(fused, plain)
    assert rel(fused, dres) > 0.05  # the GEMM's part is there too


def test_unaligned_shapes_run_linear():
    x, w = torch.randn(7, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    h = fresh_history()
    assert torch.equal(fp8_linear(x, w, None, h, 0), F.linear(x, w))
    assert not h.primed


@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])
def test_cpu_fp8_gemm_is_scaled_mm(a_dtype):
    """On the CPU the FP8 GEMMs multiply the FP8 values with a float32 torch.mm (torch's CPU ``_scaled_mm`` is ~450x
    slower): the same as ``torch._scaled_mm`` up to fp32 summation order, with and without the bias."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(48, 96, generator=g) * 4).to(a_dtype)
    b = (torch.randn(32, 96, generator=g) * 4).to(E4M3).t()  # column-major, as _scaled_mm takes it
    sa, sb = torch.tensor(0.37), torch.tensor(1.9)
    bias = torch.randn(32, generator=g).to(torch.bfloat16)
    for out_dtype, b_ in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, bias)):
        want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, bias=b_, out_dtype=out_dtype)
        got = fp8_module._mm8(a, b, sa, sb, out_dtype, bias=b_)
        assert got.dtype == out_dtype
        # fp32: summation order; bf16: at most one rounding of the fp32 result apart
        tol = 1e-5 if out_dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-4)
        assert not torch.equal(got.float(), torch.zeros_like(got.float()))


@pytest.mark.parametrize("prenorm", [False, True])
def test_model_fp8_training_forward(prenorm):
    """BertConfig.fp8 changes training forwards only: eval equals the 32-bit model, the training loss and
    gradients stay within the FP8 bounds, and training on a fixed batch lowers the loss (Post-LN and Pre-LN,
    whose LayerNorms run inside the residual additions)."""
    from fastbert import BertConfig, BertForPreTraining
    cfg = BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=512,
                            prenorm=prenorm)
    torch.manual_seed(0)
    ref = BertForPreTraining(cfg).to(DEVICE)
    model = BertForPreTraining(cfg.replace(fp8=True)).to(DEVICE)
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 512, (4, 32), generator=g).to(DEVICE)
    labels = torch.where(torch.rand(4, 32, generator=g).to(DEVICE) < 0.3, ids, -100)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                 next_sentence_label=torch.tensor([0, 1, 0, 1], device=DEVICE))
    model.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, ref(**batch).loss)
    model.train(), ref.train()
    loss, loss_ref = model(**batch).loss, ref(**batch).loss
    assert abs(loss.item() - loss_ref.item()) < 0.02 * loss_ref.item()
    loss.backward(), loss_ref.backward()
    w = model.bert.encoder.layer[0].intermediate.dense.weight
    w_ref = ref.bert.encoder.layer[0].intermediate.dense.weight
    assert rel(w.grad, w_ref.grad) < 2 * BWD_BOUND  # two layers of FP8 errors reach it
    history = model.bert.encoder._fp8_history
    assert history.amax.shape == (12 * cfg.num_hidden_layers, HISTORY) and (history.amax.amax(1) > 0).all()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = loss.item()
    for _ in range(20):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
    assert loss.item() < first - 0.5
    assert model.config.to_dict().get("fp8") is None  # runtime only: never written to config.json


@needs_triton
@pytest.mark.parametrize("shape", [(37, 70), (64, 96), (4, 1)])
def test_transpose_codes(shape):
    """The transpose of fp8 codes in one pass: every byte in place, rows of the source that are not a multiple of
    4 included (the transposed rows are padded to whole words)."""
    g = torch.Generator().manual_seed(shape[0])
    x8 = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(DEVICE).view(E5M2)
    t = fp8_module.transpose_codes(x8)
    assert t.dtype == E5M2 and t.shape == shape[::-1] and t.is_contiguous()
    assert torch.equal(t.view(torch.uint8), x8.view(torch.uint8).t())
