"""Fully masked rows never produce NaN: sequences of length zero (attention mask all 0) and batches
whose MLM labels are all ignored (-100), through the whole model with kernels="torch" and "triton"
(the interpreter on the CPU): the loss and every gradient are finite, and the two kernel paths agree."""
from __future__ import annotations

import pytest
import torch

import fastbert
from fastbert.config import BertConfig

VOCAB, SEQ = 64, 8


def _batch(case: str):
    g = torch.Generator().manual_seed(0)
    rows = 2 if case in ("last_row_empty", "all_rows_empty") else 3
    ids = torch.randint(5, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    labels = torch.full((rows, SEQ), -100)
    if case == "middle_row_empty":
        mask[1] = 0
        mask[2, 5:] = 0
    elif case == "last_row_empty":
        mask[1] = 0
    elif case == "all_rows_empty":
        mask[:] = 0
    if case != "no_labels" and case != "all_rows_empty":
        labels[0, 2] = ids[0, 2]
        labels[-1 if case == "middle_row_empty" else 0, 1] = ids[-1 if case == "middle_row_empty" else 0, 1]
    return ids, mask, labels


def _run(cls, kernels: str, case: str):
    torch.manual_seed(0)
    cfg = BertConfig.preset("tiny", vocab_size=VOCAB, kernels=kernels, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, sparse_prediction=True)  # fastbert pretrain's path
    model = cls(cfg)
    ids, mask, labels = _batch(case)
    kw = {"next_sentence_label": torch.arange(ids.shape[0]) % 2} if cls is fastbert.BertForPreTraining else {}
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


CASES = ["no_labels", "middle_row_empty", "last_row_empty", "all_rows_empty"]


def _params():
    for cls in (fastbert.BertForMaskedLM, fastbert.BertForPreTraining):
        for case in CASES:
            for kernels in ("torch", "triton"):
                yield pytest.param(cls, case, kernels, id=f"{cls.__name__}-{case}-{kernels}")


@pytest.mark.parametrize("cls,case,kernels", list(_params()))
def test_fully_masked_rows_give_finite_loss_and_grads(cls, case, kernels):
    loss, grads = _run(cls, kernels, case)
    assert torch.isfinite(loss), loss
    assert grads and all(torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if not torch.isfinite(g).all()]
    if case in ("no_labels", "all_rows_empty") and cls is fastbert.BertForMaskedLM:
        assert loss == 0.0                       # nothing to predict: a zero loss, not 0/0
    if kernels == "triton":
        ref_loss, ref_grads = _run(cls, "torch", case)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        for n in set(grads) | set(ref_grads):
            if n not in grads or n not in ref_grads:    # no gradient on one path = a zero one on the other
                assert not (grads.get(n, ref_grads.get(n))).any(), n
                continue
            # fp32 both ways; the fused kernels reassociate sums (tolerance as in tests/ops)
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-3, atol=1e-5, msg=n)
