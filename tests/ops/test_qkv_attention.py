"""The QKV projection + attention op (fastbert/ops/qkv_attention.py), 16-bit and FP8: the attention backward's
own bias-gradient sums and FP8 output against the sums and the cast of its 16-bit output, and the op against
its unfused composition.

The backward kernels quantize the fp32 gradient they accumulated; the two-pass way rounds it to the input's
dtype first and casts that. With fp32 inputs the two casts take the same values: bit-equal codes on a GPU.
With 16-bit inputs a value rounded twice lands one fp8 step off now and then (``test_fp8.assert_same_cast``'s
rule). In the interpreter the e5m2 codes come from fp16's top byte (``fp8._fp8_codes``): equal to torch's
cast except where rounding twice meets a tie, so there too all but a few codes must match.
"""
import pytest
import torch
import torch.nn.functional as F

import fastbert.ops.qkv_attention as qkv_attention_module
from fastbert import BertConfig
from fastbert.ops import attention as A
from fastbert.ops._common import HAS_TRITON
from fastbert.ops.fp8 import E5M2, AmaxHistory, cast_fp8_ref, fp8_linear
from fastbert.ops.linear import linear_residual
from fastbert.ops.qkv_attention import qkv_attention
from ops_testing import DEVICE, assert_compiled_matches_eager
from test_fp8 import BWD_BOUND, FWD_BOUND, rel

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def packed(lens, nh, hd, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    qkv = torch.randn(int(cu[-1]), 3, nh, hd, generator=g).to(DEVICE, dtype)
    dout = (torch.randn(int(cu[-1]), nh, hd, generator=g) * 1e-3).to(DEVICE, dtype)
    return cu, qkv, dout


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens", [[5, 17, 32], [40, 100, 7], [150, 33]], ids=["short", "short-two-launches", "long"])
def test_backward_writes_the_cast_of_its_gradient(lens, dtype, p):
    """Codes, transposed codes, scale, amax and the bias gradient's column sums as ``cast_fp8`` makes them of the
    16-bit backward's ``dqkv`` (sequences up to 128 tokens: the fused short kernel, in one launch or two; longer:
    the dQ and dK/dV kernels)."""
    nh, hd = 2, 16
    cu, qkv, dout = packed(lens, nh, hd, dtype, seed=sum(lens))
    q, k, v = qkv.unbind(1)
    s, seed = hd ** -0.5, torch.tensor([3], device=DEVICE)
    out, lse, mask = A.varlen_attention_forward(q, k, v, cu, max(lens), p, s, seed)
    dqkv = A._backward_packed(dout, q, k, v, out, lse, mask, cu, max(lens), p, s).view(qkv.shape[0], -1)
    hk, hr = AmaxHistory(2, DEVICE), AmaxHistory(2, DEVICE)
    for h in (hk, hr):  # an earlier step's amax sets the scale; the current slot (1) records this one's
        h.advance()
        h.amax[1, 0] = dqkv.float().abs().max() * 0.8
    g8, g8t, sinv, db = A._backward_packed(dout, q, k, v, out, lse, mask, cu, max(lens), p, s, fp8=(hk, 1))
    r8, _, rs = cast_fp8_ref(dqkv, hr, 1, E5M2)
    assert g8.dtype == g8t.dtype == E5M2 and g8.shape == dqkv.shape and g8t.shape == dqkv.shape[::-1]
    assert torch.equal(g8t.view(torch.uint8), g8.view(torch.uint8).t())
    assert sinv.item() == pytest.approx(rs.item(), rel=1e-6)
    if DEVICE == "cuda" and dtype == torch.float32:
        assert torch.equal(g8.view(torch.uint8), r8.view(torch.uint8))
    else:  # fp16 also flushes values below its smallest subnormal (2^-24) to 0, which fp32 keeps
        assert_few_codes_differ(g8, r8, atol=2.0 ** -24 / sinv.item() if dtype == torch.float16 else 0.0)
    # the amax and column sums of the fp32 values (the 16-bit way: of the rounded ones)
    assert hk.amax[1, 1].item() == pytest.approx(hr.amax[1, 1].item(), rel=1e-3 if dtype != torch.float32 else 1e-6)
    torch.testing.assert_close(db, dqkv.float().sum(0), rtol=1e-3, atol=1e-5 if dtype != torch.float32 else 1e-7)
    assert hk.amax[0].eq(0).all() and hk.amax[1, 2:].eq(0).all()  # only the row's current slot was written


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens", [[5, 17, 32], [40, 100, 7], [150, 33], [9, 0, 140]],
                         ids=["short", "short-two-launches", "long", "long-with-empty"])
def test_backward_sums_the_bias_gradient(lens, dtype, p):
    """``colsums=True``: the same dqkv to the bit, and its column sums taken from the kernels' fp32 accumulators:
    within the rounding of dqkv to its dtype of dqkv's own column sums (each element moves at most half a unit
    in its last place: 2^-24 of its size in fp32, 2^-11 in fp16). Rows no program writes (an empty sequence,
    query blocks past a sequence's end) add nothing."""
    nh, hd = 2, 16
    cu, qkv, dout = packed(lens, nh, hd, dtype, seed=sum(lens) + 1)
    q, k, v = qkv.unbind(1)
    s, seed = hd ** -0.5, torch.tensor([3], device=DEVICE)
    out, lse, mask = A.varlen_attention_forward(q, k, v, cu, max(lens), p, s, seed)
    dqkv = A._backward_packed(dout, q, k, v, out, lse, mask, cu, max(lens), p, s)
    again, db = A._backward_packed(dout, q, k, v, out, lse, mask, cu, max(lens), p, s, colsums=True)
    assert torch.equal(again, dqkv) and db.dtype == torch.float32 and db.shape == (3 * nh * hd,)
    assert_sums_close(db, dqkv.view(dqkv.shape[0], -1), dtype)


def test_backward_extras_of_no_tokens():
    """A batch of no tokens: the sums are zeros, the FP8 codes and their transpose empty, as for any batch."""
    nh, hd = 2, 16
    cu, qkv, dout = packed([0, 0], nh, hd, torch.float32, seed=0)
    q, k, v = qkv.unbind(1)
    out, lse, mask = A.varlen_attention_forward(q, k, v, cu, 0, 0.0, hd ** -0.5, None)
    args = (dout, q, k, v, out, lse, mask, cu, 0, 0.0, hd ** -0.5)
    dqkv, db = A._backward_packed(*args, colsums=True)
    assert dqkv.shape == (0, 3, nh, hd) and torch.equal(db, torch.zeros(3 * nh * hd, device=DEVICE))
    hist = AmaxHistory(1, DEVICE)
    hist.advance()
    g8, g8t, _, db8 = A._backward_packed(*args, fp8=(hist, 0))
    assert g8.shape == (0, 3 * nh * hd) and g8t.shape == (3 * nh * hd, 0) and not db8.any()


def assert_sums_close(db, d2, dtype, rounded_sum=False):
    """``db`` (fp32 sums of unrounded values) against the float64 column sums of ``d2`` (those values rounded to
    ``dtype``): at most half an ulp of ``dtype`` a summed element, plus fp32 summation's rounding in the kernels' own
    order (at most the number of rows times 2^-24 of the column's sum of magnitudes: the classic bound, which holds
    under cancellation, where a bound relative to the sum itself does not), plus (``rounded_sum``: a reference itself
    rounded to ``dtype``) half an ulp of the sum. A row left out or added twice moves a sum by about 1 / rows of its
    magnitudes, far more."""
    ulp = torch.finfo(dtype).eps
    ref = d2.double().sum(0)
    bound = (ulp / 2 + d2.shape[0] * 2.0 ** -24) * d2.double().abs().sum(0) + 1e-12
    if rounded_sum:
        bound = bound + ulp / 2 * ref.abs()
    assert ((db.double() - ref).abs() <= bound).all(), ((db.double() - ref).abs() / bound).max()


def block_inputs(lens, nh, hd, dtype, seed=4):
    cu, _, _ = packed(lens, nh, hd, torch.float32, seed=1)
    g = torch.Generator().manual_seed(seed)
    tokens, hidden = int(cu[-1]), nh * hd
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    w = (torch.randn(3 * hidden, hidden, generator=g) * hidden ** -0.5).to(DEVICE, dtype)
    b = (torch.randn(3 * hidden, generator=g) * 0.1).to(DEVICE, dtype)
    return cu, x, w, b


def run_16bit_block(fused, x, w, b, cu, max_len, nh, p, bias_grad=True):
    """The context, the gradients of (x, w, b) and the projection's output gradient dqkv, through
    ``qkv_attention`` (fused) or ``linear_residual`` + ``varlen_attention_qkvpacked``; x also feeds a residual."""
    leaves = [t.detach().clone().requires_grad_(t is not b or bias_grad) for t in (x, w, b)]
    seen = []
    if fused:
        ctx, res = qkv_attention(*leaves, nh, cu, max_len, dropout_p=p, seed=7)
    else:
        qkv, res = linear_residual(*leaves)
        qkv.register_hook(seen.append)
        ctx = A.varlen_attention_qkvpacked(qkv.view(x.shape[0], 3, nh, x.shape[1] // nh), cu, max_len, p, seed=7)
    dctx = (torch.randn(ctx.shape, generator=torch.Generator().manual_seed(2)) * 1e-2).to(DEVICE, ctx.dtype)
    torch.autograd.backward([ctx, res], [dctx, torch.full_like(res, 1e-3)])
    return ctx, [t.grad for t in leaves], seen


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens", [[40, 100, 7], [150, 33, 9], [0, 0]], ids=["short", "long", "no-tokens"])
def test_qkv_attention_matches_its_composition(lens, dtype, p, monkeypatch):
    """16/32-bit: the context, dx and dW to the bit (the same GEMMs and kernels, dropout's seed drawn alike). d(bias):
    over 128 tokens the kernels' fp32 sums of dqkv (``assert_sums_close`` against the composition's dqkv; its own
    d(bias), a sum rounded to the dtype, too), else the composition's own to the bit. A frozen bias: no sums
    taken, no d(bias)."""
    nh, hd = 2, 16
    cu, x, w, b = block_inputs(lens, nh, hd, dtype)
    sums, real = [], A.bwd_colsums_op
    monkeypatch.setattr(A, "bwd_colsums_op", lambda *a: sums.append(1) or real(*a))
    ctx, grads, _ = run_16bit_block(True, x, w, b, cu, max(lens), nh, p)
    ctx_ref, grads_ref, (dqkv,) = run_16bit_block(False, x, w, b, cu, max(lens), nh, p)
    assert torch.equal(ctx, ctx_ref) and len(sums) == (max(lens) > 128)
    for name, a, r in zip(("dx", "dw"), grads, grads_ref):
        assert a.dtype == r.dtype and torch.equal(a, r), name
    assert grads[2].dtype == dtype
    if sums:
        assert_sums_close(grads[2], dqkv, dtype, rounded_sum=dtype != torch.float32)
        assert_sums_close(grads_ref[2], dqkv, dtype, rounded_sum=dtype != torch.float32)
    else:
        assert torch.equal(grads[2], grads_ref[2])
    ctx, grads, _ = run_16bit_block(True, x, w, b, cu, max(lens), nh, p, bias_grad=False)
    assert len(sums) == (max(lens) > 128) and grads[2] is None
    assert torch.equal(grads[0], grads_ref[0]) and torch.equal(grads[1], grads_ref[1])


@pytest.mark.parametrize("lens", [[20, 7], [150, 33]], ids=["short", "long"])
def test_qkv_attention_under_torch_compile(lens):
    """16-bit op (both backward ways: the bias GEMM, the kernels' sums) under ``torch.compile(fullgraph=True)``:
    the eager loss and gradients (no dropout: the eager and compiled calls draw no seed)."""
    nh, hd = 2, 16
    cu, x, w, b = block_inputs(lens, nh, hd, torch.float32)

    def f(x, w, b):
        ctx, res = qkv_attention(x, w, b, nh, cu, max(lens))
        return (ctx.float() ** 2).sum() + res.sum()

    assert_compiled_matches_eager(f, (x, w, b))


def test_qkv_attention_falls_back_outside_the_autocast_dtype(monkeypatch):
    """Under autocast an x not in its dtype goes through linear_residual + varlen_attention_qkvpacked (which then
    add the residual's gradient as autograd does): the fused op needs x itself in the GEMM's dtype."""
    calls = []
    monkeypatch.setattr(qkv_attention_module._QkvAttention, "apply", lambda *a: calls.append(a))
    cu, x, w, b = block_inputs([7, 9], 2, 16, torch.float32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        ctx, res = qkv_attention(x, w, b, 2, cu, 9)
    assert not calls and res is x and ctx.dtype == torch.bfloat16


def assert_few_codes_differ(k8, r8, atol):
    """At most 1% of the codes one e5m2 step off (a value rounded twice, or once, at a tie; ``atol``: what the
    16-bit way flushed to 0, in scaled units), the rest equal. Seen: 0.4% (fp16, interpreter)."""
    k, r = k8.float(), r8.float()
    assert ((k - r).abs() <= torch.maximum(k.abs(), r.abs()) * 2.0 ** -2 + atol).all()
    assert (k != r).float().mean() <= 1e-2


def spy_fused_backwards(monkeypatch):
    """The list that records each FP8-output backward (``_backward_packed(..., fp8=...)``) from now on."""
    calls, real = [], A._backward_packed
    monkeypatch.setattr(A, "_backward_packed", lambda *a, **k: (calls.append(k["fp8"]) if "fp8" in k else None)
                        or real(*a, **k))
    return calls


def run_block(fused, x, w, b, cu, max_len, nh, hist, p=0.0):
    """The attention context and the gradients of x, w, b through the fused op (fused) or fp8_linear +
    varlen_attention_qkvpacked; the context's gradient is fixed, and x also feeds a residual."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        if fused:
            ctx, res = qkv_attention(*leaves, nh, cu, max_len, dropout_p=p, seed=7, fp8=(hist, 0))
        else:
            qkv, res = fp8_linear(*leaves, hist, 0, residual=True)
            ctx = A.varlen_attention_qkvpacked(qkv.view(x.shape[0], 3, nh, -1), cu, max_len, p, seed=7)
    g = torch.Generator().manual_seed(2)
    dctx = (torch.randn(ctx.shape, generator=g) * 1e-3).to(DEVICE, ctx.dtype)
    torch.autograd.backward([ctx, res], [dctx, torch.full_like(res, 1e-4)])
    return ctx, [t.grad for t in leaves]


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_fp8_qkv_attention_matches_its_composition(p, monkeypatch):
    """The same forward to the bit (the same casts, GEMM and attention kernel); the gradients within a few
    percent of the composition's after the first backward (which takes the composition's way: it primes the
    gradient's history row), and both within the FP8 bounds of fp32 F.linear + the reference attention."""
    nh, hd, lens = 2, 16, [150, 33, 9]  # over 128 tokens: the fused backward's way (attention.extras_pay)
    cu, _, _ = packed(lens, nh, hd, torch.float32, seed=1)
    g = torch.Generator().manual_seed(4)
    tokens, hidden = int(cu[-1]), nh * hd
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w = (torch.randn(3 * hidden, hidden, generator=g) * hidden ** -0.5).to(DEVICE)
    b = (torch.randn(3 * hidden, generator=g) * 0.1).to(DEVICE)
    results, fused_backwards = {}, spy_fused_backwards(monkeypatch)
    for fused in (True, False):
        hist = AmaxHistory(3, DEVICE)
        for _ in range(2):  # step 1 primes every row; step 2 runs the fused backward
            hist.advance()
            results[fused] = run_block(fused, x, w, b, cu, max(lens), nh, hist, p)
        assert 2 in hist.primed
    assert len(fused_backwards) == 1  # the fused op's second backward
    (ctx, grads), (ctx_ref, grads_ref) = results[True], results[False]
    assert torch.equal(ctx, ctx_ref)
    # On the GPU (bf16 autocast) the composition rounds d(qkv) to bf16 before its e5m2 cast, where the fused
    # backward casts the kernel's fp32 values once: ~1.6% of the codes then sit one e5m2 step apart, a relative
    # difference of 2.0-2.4% by itself (simulated on random gradients); fp32 on the CPU has no second rounding.
    bound = 0.04 if DEVICE == "cuda" else 0.02
    for name, a, r in zip(("dx", "dw", "db"), grads, grads_ref):
        assert a.dtype == r.dtype and rel(a, r) < bound, name
    if p == 0.0:  # and both near fp32: F.linear, the reference attention
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        qkv = F.linear(*leaves).view(tokens, 3, nh, hd)
        ctx32 = A.varlen_attention_ref(*qkv.unbind(1), cu, max(lens))
        dctx = (torch.randn(ctx32.shape, generator=torch.Generator().manual_seed(2)) * 1e-3).to(DEVICE)
        torch.autograd.backward([ctx32, leaves[0]], [dctx, torch.full_like(leaves[0], 1e-4)])
        assert rel(ctx.float(), ctx32) < FWD_BOUND + 0.01 * (DEVICE == "cuda")  # + bf16's rounding on the GPU
        for name, a, r in zip(("dx", "dw", "db"), grads, [t.grad for t in leaves]):
            assert rel(a, r) < BWD_BOUND, name


def test_falls_back_where_the_kernels_cannot_run(monkeypatch):
    """Unaligned shapes go through fp8_linear + varlen_attention_qkvpacked (which run F.linear there)."""
    calls = []
    monkeypatch.setattr(qkv_attention_module._Fp8QkvAttention, "apply", lambda *a: calls.append(a))
    nh, hidden = 2, 32
    cu = torch.tensor([0, 7], dtype=torch.int32, device=DEVICE)
    x, w = torch.randn(7, hidden, device=DEVICE), torch.randn(3 * hidden, hidden, device=DEVICE) * 0.1
    hist = AmaxHistory(3, DEVICE)
    hist.advance()
    ctx, res = qkv_attention(x, w, None, nh, cu, 7, fp8=(hist, 0))
    ref = A.varlen_attention_ref(*F.linear(x, w).view(7, 3, nh, -1).unbind(1), cu, 7)
    assert not calls and res is x and not hist.primed
    torch.testing.assert_close(ctx, ref, rtol=1e-4, atol=1e-5)


def train_steps(cfg, steps):
    """(last loss, gradients) of ``steps`` training steps of a fresh ``BertForPreTraining(cfg)`` (seeded) on one
    batch of two rows, 144 and 32 tokens (176 tokens, one sequence over 128)."""
    from fastbert import BertForPreTraining
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 512, (2, 144), generator=g).to(DEVICE)
    mask = (torch.arange(144)[None] < torch.tensor([[144], [32]])).long().to(DEVICE)
    labels = torch.where(torch.rand(2, 144, generator=g).to(DEVICE) < 0.3, ids, -100).masked_fill(mask == 0, -100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels,
                 next_sentence_label=torch.tensor([0, 1], device=DEVICE))
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).to(DEVICE).train()
    for _ in range(steps):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prenorm", [False, True], ids=["post-ln", "pre-ln"])
def test_model_takes_the_16bit_fused_op_with_triton_kernels(prenorm, monkeypatch):
    """A 16/32-bit model with kernels="triton" runs each layer's QKV projection + attention through the fused op
    and gets the composition's loss (``get_ops`` without the fused op) and gradients (dropout on: the same masks):
    to the bit on the CPU, except the QKV biases' (a sequence over 128 tokens: the kernels' fp32 sums), within
    fp32 rounding; on a GPU all within fp32 rounding (atomic additions, as the embeddings' backward, add in
    another order each run)."""
    cfg = BertConfig.preset("tiny", vocab_size=512, kernels="triton", max_position_embeddings=160, prenorm=prenorm)
    applied = []
    real_apply = qkv_attention_module._QkvAttention.apply
    monkeypatch.setattr(qkv_attention_module._QkvAttention, "apply", lambda *a: applied.append(1) or real_apply(*a))
    loss, grads = train_steps(cfg, steps=1)
    assert len(applied) == cfg.num_hidden_layers
    monkeypatch.setattr(qkv_attention_module, "qkv_attention", None)  # what get_ops hands the model
    loss_ref, grads_ref = train_steps(cfg, steps=1)
    assert len(applied) == cfg.num_hidden_layers  # the composition did not take it
    exact = DEVICE != "cuda"
    assert grads.keys() == grads_ref.keys()
    assert loss.item() == loss_ref.item() if exact else loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
    biases = [n for n in grads if n.endswith("qkv.bias")]
    assert len(biases) == cfg.num_hidden_layers
    for name, g_ref in grads_ref.items():
        if exact and name not in biases:
            assert torch.equal(grads[name], g_ref), name
        else:
            torch.testing.assert_close(grads[name], g_ref, rtol=1e-5, atol=1e-7, msg=name)


def test_get_ops_composes_with_the_switch_off(monkeypatch):
    """``FASTBERT_QKV_ATTENTION=0``: get_ops hands the model no fused op (it composes the two); unset, the op."""
    from fastbert.ops import get_ops
    assert get_ops("triton").qkv_attention is qkv_attention
    monkeypatch.setenv("FASTBERT_QKV_ATTENTION", "0")
    assert get_ops("triton").qkv_attention is None and get_ops("torch").qkv_attention is None


def test_model_takes_the_fused_op_with_triton_kernels(monkeypatch):
    """An FP8 model with kernels="triton" runs its QKV projections + attention through the fused op (each
    layer, each training forward) and gets the loss and gradients of the composition (``get_ops`` without the
    fused op), within the fp8 rounding the two ways differ by (one rounding of the QKV gradient, not two)."""
    cfg = BertConfig.preset("tiny", vocab_size=512, fp8=True, kernels="triton", max_position_embeddings=160)
    applied = []
    real_apply = qkv_attention_module._Fp8QkvAttention.apply
    monkeypatch.setattr(qkv_attention_module._Fp8QkvAttention, "apply",
                        lambda *a: applied.append(a[4]) or real_apply(*a))
    fused_backwards = spy_fused_backwards(monkeypatch)
    # the first backward primes the gradients' history rows; the second is the fused one
    loss, grads = train_steps(cfg, steps=2)
    assert applied == [0, 12] * 2  # layers 0 and 1 (their first history rows), two forwards
    assert [row for _, row in fused_backwards] == [14, 2]  # the second backward, last layer first
    monkeypatch.setattr(qkv_attention_module, "qkv_attention", None)  # what get_ops hands the model
    loss_ref, grads_ref = train_steps(cfg, steps=2)
    assert len(applied) == 4 and len(fused_backwards) == 2  # the composition did not take it
    assert abs(loss.item() - loss_ref.item()) < 1e-3 * loss_ref.item()
    assert grads.keys() == grads_ref.keys()
    for name, g_ref in grads_ref.items():
        assert rel(grads[name], g_ref) < 0.03, name  # seen: 1.2% at most (CPU)


def test_backward_amax_leaves_out_non_finite_values():
    """An inf in the output gradient makes infs and NaNs in dq, dk and dv: the codes saturate or carry them as
    the cast does, and the recorded amax is the largest finite |value| (what ``cast_fp8_ref`` records), so the
    next steps' scales stay usable."""
    nh, hd, lens = 2, 16, [24, 40]
    cu, qkv, dout = packed(lens, nh, hd, torch.float32, seed=9)
    dout[3, 1, 5] = float("inf")
    q, k, v = qkv.unbind(1)
    out, lse, mask = A.varlen_attention_forward(q, k, v, cu, 40, 0.0, hd ** -0.5, None)
    dqkv = A._backward_packed(dout, q, k, v, out, lse, mask, cu, 40, 0.0, hd ** -0.5).view(qkv.shape[0], -1)
    assert not torch.isfinite(dqkv).all() and torch.isfinite(dqkv).any()
    hk, hr = AmaxHistory(1, DEVICE), AmaxHistory(1, DEVICE)
    for h in (hk, hr):
        h.advance()
        h.amax[0, 0] = 1e-2
    A._backward_packed(dout, q, k, v, out, lse, mask, cu, 40, 0.0, hd ** -0.5, fp8=(hk, 0))
    cast_fp8_ref(dqkv, hr, 0, E5M2)
    assert torch.isfinite(hk.amax).all() and hk.amax[0, 1].item() == pytest.approx(hr.amax[0, 1].item(), rel=1e-6)


def test_extras_pay_on_the_two_kernel_path():
    """The measured rule: the backward's own FP8 output or bias sums on the dQ + dK/dV path (sequences over 128
    tokens, over 64 at head_dim 128), the 16-bit backward + a pass on the fused short kernel."""
    assert not A.extras_pay(64, 128) and not A.extras_pay(64, 17)
    assert A.extras_pay(64, 129) and A.extras_pay(64, 512)
    assert A.extras_pay(128, 65) and not A.extras_pay(128, 64)
