"""The 16-bit copies of fp32 master weights kept per optimizer step (ops/weight_casts.py): a copy is the cast's
own value, made once and reused while active, rewritten in place by refresh(); a model trained with them (the
engine's rule: refresh before the first micro-batch of each optimizer step) gives bit-identical losses and
weights to one cast in every forward, and one that is not refreshed does not."""
from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch

from fastbert import BertConfig, BertForPreTraining
from fastbert.data.static_batch import build_rows
from fastbert.ops import weight_casts
from fastbert.ops._common import INTERPRET, autocast_inputs
from fastbert.ops.weight_casts import WeightCasts, cast


def test_a_parameter_is_cast_once_while_active_and_refreshed_in_place():
    p = torch.nn.Parameter(torch.randn(5, 3))
    plain = torch.randn(5, 3)
    casts = WeightCasts()
    with casts.active():
        a = weight_casts.cast(p, torch.float16)
        b = weight_casts.cast(p, torch.float16)
        assert a is b and not a.requires_grad and torch.equal(a, p.detach().half())
        assert weight_casts.cast(plain, torch.float16) is not weight_casts.cast(plain, torch.float16)  # not a parameter
        assert weight_casts.cast(p, torch.float32) is p                                               # no cast needed
    assert weight_casts.cast(p, torch.float16) is not a and len(casts) == 1                           # inactive: fresh
    with torch.no_grad():
        p.mul_(3.0)
    assert not torch.equal(a, p.detach().half())             # stale until refreshed
    ptr, version = a.data_ptr(), a._version
    casts.refresh()
    assert torch.equal(a, p.detach().half()) and a.data_ptr() == ptr and a._version == version
    p.data = torch.randn(4, 3)                               # replaced with another shape: a new copy at next use
    casts.refresh()
    with casts.active():
        c = weight_casts.cast(p, torch.float16)
    assert c is not a and torch.equal(c, p.detach().half())


def test_padded_copies_keep_their_zero_rows_through_refresh_and_optimizer_writes():
    """``cast(p, dtype, rows=...)`` (the MLM decoder's copy, padded to whole 64-column blocks): zeros past p's rows,
    the copy made once while active, refreshed in place, and the copy an optimizer may write is p's rows alone."""
    p = torch.nn.Parameter(torch.randn(5, 3))
    assert torch.equal(cast(p, torch.float16, rows=8), torch.cat((p.detach().half(), torch.zeros(3, 3).half())))
    assert cast(p, torch.float16, rows=5).shape == (5, 3)        # no padding asked: the plain cast
    casts = WeightCasts()
    with casts.active():
        first = cast(p, torch.float16, rows=8)
        assert cast(p, torch.float16, rows=8) is first and len(casts) == 1
    with torch.no_grad():
        p.mul_(2)
    casts.refresh()
    assert torch.equal(first[:5], p.detach().half()) and torch.count_nonzero(first[5:]) == 0
    (copy,) = casts.copies_of([p])
    assert copy.shape == p.shape and copy.data_ptr() == first.data_ptr()


def test_autocast_inputs_take_the_active_copies():
    w, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4))
    casts = WeightCasts()
    with torch.autocast("cpu", dtype=torch.float16), casts.active():
        w1, b1 = autocast_inputs(w, b)
        w2, b2 = autocast_inputs(w, b)
    assert w1 is w2 and b1 is b2 and w1.dtype == torch.float16 and len(casts) == 2
    with torch.autocast("cpu", dtype=torch.float16):
        w3, _ = autocast_inputs(w, b)
    assert w3 is not w1 and torch.equal(w3, w1)


def _train(model, batches, casts=None, refresh=True, steps=3, accum=2):
    """AdamW steps of ``accum`` micro-batches under fp16 autocast; with ``casts`` as TrainEngine runs them."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses = []
    for s in range(steps):
        for m in range(accum):
            with casts.active() if casts is not None else contextlib.nullcontext():
                if casts is not None and m == 0 and refresh:
                    casts.refresh()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(**batches[(s * accum + m) % len(batches)])
            (out.loss / accum).backward()
            losses.append(out.loss.detach().float())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def _batches(vocab, n=2, batch=3, seq=12):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(5, vocab, (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 8:] = 0
        labels = torch.where(torch.rand(batch, seq, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        labels[0, 1] = ids[0, 1]
        out.append(dict(input_ids=ids * mask, attention_mask=mask, labels=labels.masked_fill(mask == 0, -100),
                        next_sentence_label=torch.tensor([0, 1, 1])))
    return out


def _packed(batch):
    """``batch`` in the loader's static-shape ``packed=`` form (one sequence a row, MLM targets in fixed slots):
    what `fastbert pretrain` feeds, through the sparse MLM loss."""
    ids, mask, labels = (batch[k].numpy() for k in ("input_ids", "attention_mask", "labels"))
    rows = [[(ids[r, :n], n // 2, int(batch["next_sentence_label"][r]))] for r, n in enumerate(mask.sum(1))]
    arrays = build_rows(rows, ids.shape[1], per_row=1, pad_id=0, nsp=True)
    chosen = np.flatnonzero(labels.reshape(-1) != -100)
    targets = np.full(len(chosen) + 2, -100)
    targets[:len(chosen)] = labels.reshape(-1)[chosen]
    positions = np.zeros(len(chosen) + 2, dtype=np.int64)
    positions[:len(chosen)] = chosen
    keys = ("input_ids", "token_type_ids", "position_ids", "cu_seqlens", "cls_positions", "next_sentence_label")
    packed = {k: torch.as_tensor(arrays[k]) for k in keys}
    packed.update(max_seqlen=ids.shape[1], mlm_positions=torch.as_tensor(positions),
                  mlm_targets=torch.as_tensor(targets))
    return {"packed": packed}


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRET, reason="a CPU test (fp16 autocast on the CPU, the kernels in the interpreter)")
@pytest.mark.parametrize("form", ["padded", "packed"])
def test_training_with_the_copies_is_bit_identical_and_needs_the_refresh(form):
    torch.manual_seed(0)
    cfg = BertConfig.preset("tiny", vocab_size=120, max_position_embeddings=16, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, kernels="triton")
    base = BertForPreTraining(cfg).train()
    batches = _batches(cfg.vocab_size)
    batches = batches if form == "padded" else [_packed(b) for b in batches]
    ref_losses, ref_params = _train(copy.deepcopy(base), batches)
    casts, model = WeightCasts(), copy.deepcopy(base)
    losses, params = _train(model, batches, casts)
    taken = {key[:2] for key in casts._copies}  # (id(parameter), dtype[, rows])
    took = {n for n, p in model.named_parameters() if (id(p), torch.float16) in taken}
    # the fused ops took their copies: the second layer's QKV projection + attention, FFN, output projection
    assert {f"bert.encoder.layer.1.{k}" for k in ("attention.self.qkv.weight", "intermediate.dense.weight",
                                                   "output.dense.weight", "attention.output.dense.weight")} <= took
    if form == "packed":                                           # and the sparse MLM loss its tied decoder
        assert "bert.embeddings.word_embeddings.weight" in took
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    stale, _ = _train(copy.deepcopy(base), batches, WeightCasts(), refresh=False, steps=2)
    assert torch.equal(stale[:2], ref_losses[:2]) and not torch.equal(stale[2:], ref_losses[2:])
