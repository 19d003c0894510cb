"""Fused sparse MLM loss (gather + transform + decoder + chunked cross-entropy) vs the reference.

Loss and the gradients of the hidden states and all seven weights are compared with an fp64
reference; the kernel's error must stay within 2x torch's own same-dtype error plus a small atol.
The counts (num_correct, num_predicted) must match exactly. CPU runs use the Triton interpreter.
"""
import pytest
import torch
import torch.nn.functional as F

import fastbert.ops.mlm_loss as mlm
from fastbert.ops.mlm_loss import mlm_transform_ref, sparse_mlm_loss, sparse_mlm_loss_ref
from ops_testing import DEVICE, assert_compiled_matches_eager, assert_within

PARAMS = ("hidden", "dense_weight", "dense_bias", "ln_weight", "ln_bias", "decoder_weight", "decoder_bias")


def make_inputs(tokens, hidden, vocab, dtype, frac=0.4, ignore_index=-100, hit=True):
    g = torch.Generator().manual_seed(tokens * 31 + hidden + vocab)
    p = {
        "hidden": torch.randn(tokens, hidden, generator=g),
        "dense_weight": torch.randn(hidden, hidden, generator=g) / hidden ** 0.5,
        "dense_bias": 0.1 * torch.randn(hidden, generator=g),
        "ln_weight": 1 + 0.2 * torch.randn(hidden, generator=g),
        "ln_bias": 0.1 * torch.randn(hidden, generator=g),
        "decoder_weight": torch.randn(vocab, hidden, generator=g) / hidden ** 0.5,
        "decoder_bias": 0.1 * torch.randn(vocab, generator=g),
    }
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[torch.rand(tokens, generator=g) >= frac] = ignore_index
    labels = labels.to(DEVICE)
    if hit:
        # Make about half of the predicted labels the model's argmax, so num_correct is not trivially 0.
        with torch.no_grad():
            d = {k: v.to(DEVICE, torch.float64) for k, v in p.items()}
            h = mlm_transform_ref(d["hidden"], d["dense_weight"], d["dense_bias"], d["ln_weight"], d["ln_bias"], 1e-12)
            top2 = F.linear(h, d["decoder_weight"], d["decoder_bias"]).topk(2, dim=-1)
            # only rows whose top-1 clearly beats top-2, so rounding cannot flip the argmax
            clear = (top2.values[:, 0] - top2.values[:, 1]) > 0.05
            flip = (labels != ignore_index) & clear & (torch.arange(tokens, device=DEVICE) % 2 == 0)
            labels[flip] = top2.indices[flip, 0]
    return labels, {k: v.to(DEVICE, dtype) for k, v in p.items()}


def run(fn, labels, params, dtype, **kw):
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in params.items()}
    a = [leaves[k] for k in PARAMS]
    loss, correct, n = fn(a[0], labels, a[1], a[2], a[3], a[4], 1e-12, a[5], a[6], **kw)
    grads = torch.autograd.grad(loss, a, allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(a, grads)]
    return (loss, correct, n), dict(zip(PARAMS, grads))


def check(tokens, hidden, vocab, dtype, approximate="none", **kw):
    labels, params = make_inputs(tokens, hidden, vocab, dtype, **kw)
    extra = {"ignore_index": kw["ignore_index"]} if "ignore_index" in kw else {}
    (loss, correct, n), dk = run(sparse_mlm_loss, labels, params, dtype, approximate=approximate, **extra)
    (loss_s, _, _), ds = run(sparse_mlm_loss_ref, labels, params, dtype, approximate=approximate, **extra)
    (loss_r, correct_r, n_r), dr = run(sparse_mlm_loss_ref, labels, params, torch.float64,
                                       approximate=approximate, **extra)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_within("loss", loss, loss_s, loss_r, dtype)
    assert n.item() == n_r.item()
    if dtype == torch.float32:
        assert correct.item() == correct_r.item()
    else:  # a near-tie may round either way in 16-bit
        assert abs(correct.item() - correct_r.item()) <= max(1, n_r.item() // 20)
    for k in PARAMS:
        assert dk[k].dtype == dtype
        assert_within(f"d{k}", dk[k], ds[k], dr[k], dtype)
    return correct_r.item(), n_r.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden,vocab", [(5, 16, 33), (40, 40, 300), (23, 32, 1000)])
def test_matches_reference(tokens, hidden, vocab, dtype):
    correct, n = check(tokens, hidden, vocab, dtype)
    assert n > 0 and (correct > 0 or tokens < 10)


def test_tanh_and_custom_ignore_index():
    check(30, 24, 100, torch.float32, approximate="tanh", ignore_index=-1)


@pytest.mark.parametrize("keep_elems", [1, 7 * 1024])
def test_rows_in_chunks_recomputed_in_the_backward(monkeypatch, keep_elems):
    """Shrink the kept buffer so the rows go in chunks (one row, or seven of 1,024 padded columns: the last chunk
    partial) whose logits the backward recomputes."""
    monkeypatch.setattr(mlm, "_KEEP_ELEMS", keep_elems)
    check(20, 32, 1000, torch.float32)


def test_all_predicted_and_none_predicted():
    check(12, 16, 50, torch.float32, frac=1.1)
    labels, params = make_inputs(12, 16, 50, torch.float32, frac=-1.0, hit=False)
    (loss, correct, n), grads = run(sparse_mlm_loss, labels, params, torch.float32)
    assert loss.item() == 0.0 and correct.item() == 0 and n.item() == 0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_rejects_out_of_range_labels():
    labels, params = make_inputs(6, 16, 20, torch.float32, frac=1.1, hit=False)
    labels[2] = 20
    with pytest.raises(ValueError, match="labels"):
        run(sparse_mlm_loss, labels, params, torch.float32)


def test_custom_op_and_torch_compile():
    labels, params = make_inputs(10, 16, 70, torch.float32, frac=1.1)
    h = params["hidden"]
    w, b = params["decoder_weight"], params["decoder_bias"]
    vp = mlm.padded_vocab(70)
    padded = mlm.weight_casts.padded
    torch.library.opcheck(torch.ops.fastbert.linear_cross_entropy_fwd.default,
                          (h, padded(w, w.dtype, vp), padded(b, b.dtype, vp), labels, 70))

    def f(h, w, b):
        loss, correct = mlm.LinearCrossEntropyFn.apply(h, w, b, labels)
        return loss

    le = assert_compiled_matches_eager(f, (h, w, b))
    torch.testing.assert_close(le, F.cross_entropy(F.linear(h, w, b), labels))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_kernel_ties_padding_and_unlabelled_rows(dtype):
    """``_logit_grads`` on logits set through the bias (h = 0): the log-sum-exp, the label's logit, the argmax at
    the first of tied maxima (also when the tie spans two column blocks of the kernel), softmax - onehot in the
    real columns, zeros in the padding and in rows without a label."""
    v, k = 300, 16
    vp = mlm.padded_vocab(v)
    assert vp % 64 == 0 and vp >= v
    bias = torch.randn(v, generator=torch.Generator().manual_seed(3)).clamp(-2, 2)
    bias[[7, 40, 290]] = 5.0                                     # three tied maxima, across column blocks
    h = torch.zeros((5, k), dtype=dtype, device=DEVICE)
    w = mlm.weight_casts.padded(torch.randn(v, k), dtype, vp).to(DEVICE)
    b = mlm.weight_casts.padded(bias, dtype, vp).to(DEVICE)
    labels = torch.tensor([7, -1, 299, 0, 40], device=DEVICE)
    dl, lse, lab, arg = mlm._logit_grads(h, w, b, labels, v)
    logits = b[:v].float()
    assert dl.shape == (5, vp) and dl.dtype == dtype
    assert arg.tolist() == [7] * 5
    torch.testing.assert_close(lse, torch.logsumexp(logits, 0).expand(5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lab, torch.where(labels >= 0, logits[labels.clamp(min=0)], 0.0))
    want = torch.softmax(logits, 0).expand(5, v) - F.one_hot(labels.clamp(min=0), v).float()
    want[1] = 0.0
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(dl[:, :v].float(), want, rtol=0, atol=tol)
    assert torch.count_nonzero(dl[:, v:]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [768, 1024])
def test_gpu_bert_shapes(hidden, dtype):
    # batch 32 x seq 128 tokens, 15% predicted, BERT's vocabulary
    check(32 * 128, hidden, 30522, dtype, frac=0.15)


def run_static(fn, positions, slot_labels, params, dtype, **kw):
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in params.items()}
    a = [leaves[k] for k in PARAMS]
    loss, correct, n = fn(a[0], slot_labels, a[1], a[2], a[3], a[4], 1e-12, a[5], a[6], positions=positions, **kw)
    grads = torch.autograd.grad(loss, a, allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(a, grads)]
    return (loss, correct, n), dict(zip(PARAMS, grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden,vocab,slots", [(40, 40, 300, 24), (23, 32, 1000, 23), (9, 16, 33, 6)])
def test_static_slots_match_the_dynamic_gather(tokens, hidden, vocab, slots, dtype):
    """Fixed slots (positions + labels with -100 in unused slots, as the static-shape pretraining batch
    has them) give the loss, counts and every gradient of the dynamic path over the same rows."""
    labels, params = make_inputs(tokens, hidden, vocab, dtype)
    predicted = (labels != -100).nonzero().flatten()[:slots]
    dense = torch.full_like(labels, -100)
    dense[predicted] = labels[predicted]
    # slots: the predicted rows first, then padding slots that point anywhere (row 0) with label -100
    positions = torch.zeros(slots, dtype=torch.long, device=labels.device)
    positions[:predicted.numel()] = predicted
    slot_labels = torch.full((slots,), -100, dtype=torch.long, device=labels.device)
    slot_labels[:predicted.numel()] = labels[predicted]
    (loss, correct, n), dk = run_static(sparse_mlm_loss, positions, slot_labels, params, dtype)
    (loss_s, _, n_s), ds = run_static(sparse_mlm_loss_ref, positions, slot_labels, params, dtype)
    (loss_r, correct_r, n_r), dr = run(sparse_mlm_loss_ref, dense, params, torch.float64)
    assert n.item() == n_s.item() == n_r.item() == predicted.numel()
    assert_within("loss", loss, loss_s, loss_r, dtype)
    if dtype == torch.float32:
        assert correct.item() == correct_r.item()
    for k in PARAMS:
        assert_within(f"d{k}", dk[k], ds[k], dr[k], dtype)


def test_static_slots_all_unused_give_zero_loss_and_gradients():
    labels, params = make_inputs(12, 16, 33, torch.float32)
    positions = torch.arange(4, device=labels.device)
    slot_labels = torch.full((4,), -100, dtype=torch.long, device=labels.device)
    for fn in (sparse_mlm_loss, sparse_mlm_loss_ref):
        (loss, correct, n), grads = run_static(fn, positions, slot_labels, params, torch.float32)
        assert loss.item() == 0.0 and correct.item() == 0 and n.item() == 0
        assert all(torch.isfinite(g).all() and g.abs().max() == 0 for g in grads.values())
