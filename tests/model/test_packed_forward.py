"""The static-shape pretraining step (``BertForPreTraining(packed=...)``, several sequences a row,
isolated by cu_seqlens, fixed MLM / NSP slots) gives the same loss and the same gradient of every
parameter as the HF-style padded call on one sequence a row, for both kernel paths."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastbert import BertConfig, BertForMaskedLM, BertForPreTraining
from fastbert.data.static_batch import build_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, SEQ = 97, 24


def sequences(seed: int, n: int):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(4, 13))
        ids = rng.integers(5, VOCAB, size=length)
        ids[0], ids[-1] = 1, 2
        b = int(rng.integers(2, length - 1)) if rng.random() < 0.7 else 0
        out.append((ids, b, int(rng.integers(0, 2))))
    return out


def both_layouts(seqs, per_row, rng, span=1):
    """(padded kwargs, packed kwargs) with the same masked tokens and labels; ``span`` rows a packing bin."""
    n = len(seqs)
    # Padded: one sequence a row (the layout of HF's call), labels -100 where nothing is predicted.
    padded = build_rows([[s] for s in seqs], SEQ, 1, 0, nsp=True)
    chosen = (rng.random(padded["input_ids"].shape) < 0.3) & (padded["attention_mask"] == 1)
    chosen[:, 0] = False
    labels = np.where(chosen, padded["input_ids"], -100)
    masked_ids = np.where(chosen, 3, padded["input_ids"])
    # Packed: the same sequences, several a row; the masked tokens follow their sequence.
    rows = []
    for i in range(0, n, per_row * span):
        rows.append(list(range(i, min(n, i + per_row * span))))
    rows = [r for r in rows if sum(len(seqs[i][0]) for i in r) <= span * SEQ] or [[i] for i in range(n)]
    packed = build_rows([[seqs[i] for i in r] for r in rows], SEQ, per_row, 0, nsp=True, span=span)
    p_ids = packed["input_ids"].reshape(-1).copy()
    positions, targets = [], []
    for r, row in enumerate(rows):
        at = r * span * SEQ
        for i in row:
            L = len(seqs[i][0])
            for j in np.nonzero(chosen[i, :L])[0]:
                p_ids[at + j] = 3
                positions.append(at + j)
                targets.append(int(padded["input_ids"][i, j]))
            at += L
    slots = len(positions) + 5                                 # a few unused slots, as the collator leaves
    positions += [0] * 5
    targets += [-100] * 5
    t = lambda a: torch.as_tensor(np.asarray(a), device=DEVICE)  # noqa: E731
    kw_padded = dict(input_ids=t(masked_ids), attention_mask=t(padded["attention_mask"]),
                     token_type_ids=t(padded["token_type_ids"]), labels=t(labels),
                     next_sentence_label=t(padded["next_sentence_label"]))
    kw_packed = {"packed": dict(input_ids=t(p_ids.reshape(-1, SEQ)), token_type_ids=t(packed["token_type_ids"]),
                                position_ids=t(packed["position_ids"]), cu_seqlens=t(packed["cu_seqlens"]),
                                max_seqlen=SEQ, mlm_positions=t(positions), mlm_targets=t(targets),
                                cls_positions=t(packed["cls_positions"]),
                                next_sentence_label=t(packed["next_sentence_label"]))}
    assert slots == len(positions)
    return kw_padded, kw_packed, sum(len(r) for r in rows)


def loss_and_grads(model, kw):
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("cls,span,prenorm", [(BertForPreTraining, 1, False), (BertForMaskedLM, 1, False),
                                              (BertForPreTraining, 2, False), (BertForPreTraining, 1, True)])
def test_packed_step_matches_padded_call(kernels, cls, span, prenorm):
    """span 2: bins of two rows, so sequences continue from one row into the next. The packed step's last
    layer computes only the rows its heads read (``test_last_layer_computes_only_the_rows_the_heads_read``);
    the padded call computes every token."""
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, kernels=kernels, prenorm=prenorm)
    model = cls(cfg).to(DEVICE).train()
    seqs = sequences(1, 9)
    kw_padded, kw_packed, n = both_layouts(seqs, per_row=3, rng=np.random.default_rng(2), span=span)
    assert n == len(seqs)
    if span > 1:  # some sequence crosses a row boundary
        cu = kw_packed["packed"]["cu_seqlens"].cpu().numpy()
        assert any(a // SEQ != (b - 1) // SEQ for a, b in zip(cu[:-1], cu[1:]) if b > a)
    if cls is BertForMaskedLM:
        kw_padded.pop("next_sentence_label")
        kw_packed["packed"].pop("next_sentence_label")
    ref, g_ref = loss_and_grads(model, kw_padded)
    out, g = loss_and_grads(model, kw_packed)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert int(out.mlm_count) == int((kw_padded["labels"] != -100).sum())
    if cls is BertForPreTraining:
        assert int(out.nsp_count) == len(seqs)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("head", ["pretraining", "mlm", "classification"])
@pytest.mark.parametrize("prenorm", [False, True])
def test_last_layer_computes_only_the_rows_the_heads_read(monkeypatch, head, prenorm):
    """In the packed steps the last layer runs everything after its attention (here: the FFN) on the rows the
    heads read alone, the MLM slots (then the NSP slots) or the pooled first tokens; the other layers on every
    token."""
    from fastbert import BertForSequenceClassification
    from fastbert.data.static_batch import pack_examples
    from fastbert.model import BertPreTrainedModel
    from fastbert.ops import get_ops
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ, kernels="torch", prenorm=prenorm)
    seqs = sequences(1, 9)
    if head == "classification":
        model = BertForSequenceClassification(cfg)
        packed = {k: torch.as_tensor(v) for k, v in pack_examples(
            [{"input_ids": ids.tolist(), "labels": label} for ids, _, label in seqs], SEQ, granularity=16).items()}
        packed["max_seqlen"] = SEQ
        read = len(seqs)
    else:
        model = (BertForPreTraining if head == "pretraining" else BertForMaskedLM)(cfg)
        _, kw, _ = both_layouts(seqs, per_row=3, rng=np.random.default_rng(2))
        packed = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kw["packed"].items()}
        read = len(packed["mlm_positions"]) + (len(packed["cls_positions"]) if head == "pretraining" else 0)
        if head == "mlm":
            packed.pop("next_sentence_label")
    ops, rows = get_ops("torch"), []

    def ffn(h, *args, **kwargs):
        rows.append(h.shape[0])
        return ops.ffn(h, *args, **kwargs)
    monkeypatch.setattr(BertPreTrainedModel, "ops", property(lambda self: ops._replace(ffn=ffn)))
    model.train()(packed=packed).loss.backward()
    tokens = packed["input_ids"].numel()
    assert read < tokens and rows == [tokens, tokens, read]


def test_packed_step_reads_nothing_back(monkeypatch):
    """Masking into fixed slots and the packed forward + backward on the fused kernels (the GPU path;
    the interpreter on CPU) never read a value from the device: Tensor.item / tolist / __bool__ /
    nonzero are forbidden while they run (what would stall a GPU step)."""
    from fastbert.data.masking import MaskingCollator
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ, kernels="triton")
    model = BertForPreTraining(cfg).to(DEVICE).train()
    seqs = sequences(3, 8)
    arrays = build_rows([seqs[i:i + 2] for i in range(0, 8, 2)], SEQ, 3, 0, nsp=True)
    batch = {k: torch.as_tensor(v, device=DEVICE) for k, v in arrays.items()}
    collator = MaskingCollator(VOCAB, [0, 1, 2, 3], 3, device=DEVICE)

    # Dropout seeds are drawn on the device too (ops/_common.dropout_seed): no exception here.
    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} reads a value back from the device inside a step")
        return call
    for name in ("item", "tolist", "__bool__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
    monkeypatch.setattr(torch, "nonzero", forbidden("torch.nonzero"))
    ids, positions, targets = collator.masked_slots(batch["input_ids"], batch["attention_mask"])
    packed = dict(input_ids=ids, token_type_ids=batch["token_type_ids"], position_ids=batch["position_ids"],
                  cu_seqlens=batch["cu_seqlens"], max_seqlen=SEQ, mlm_positions=positions, mlm_targets=targets,
                  cls_positions=batch["cls_positions"], next_sentence_label=batch["next_sentence_label"])
    out = model(packed=packed)
    out.loss.backward()
    monkeypatch.undo()
    assert torch.isfinite(out.loss) and int(out.mlm_count) > 0 and int(out.nsp_count) == 8


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("num_labels", [3, 1])  # classification, regression
def test_packed_finetune_batch_matches_padded_call(kernels, num_labels):
    """``fastbert finetune``'s static batches (examples back to back, padded to a token bucket in
    isolated segments) give HF's padded call's logits, loss and every gradient."""
    from fastbert import BertForSequenceClassification
    from fastbert.data.static_batch import pack_examples
    from fastbert.tasks.trainer import pad_batch
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=num_labels, kernels=kernels)
    model = BertForSequenceClassification(cfg).to(DEVICE).train()
    rng = np.random.default_rng(3)
    rows = []
    for ids, b, label in sequences(4, 7):
        types = [0] * len(ids) if not b else [0] * b + [1] * (len(ids) - b)
        rows.append({"input_ids": ids.tolist(), "token_type_ids": types, "attention_mask": [1] * len(ids),
                     "labels": float(rng.normal()) if num_labels == 1 else int(rng.integers(0, 3))})
    padded = {k: v.to(DEVICE) for k, v in pad_batch(rows, {}).items()}
    arrays = pack_examples(rows, SEQ, granularity=16)
    assert arrays["input_ids"].shape[0] > sum(len(r["input_ids"]) for r in rows)  # some padding segments
    packed = {k: torch.as_tensor(v, device=DEVICE) for k, v in arrays.items()}
    packed["max_seqlen"] = SEQ
    ref, g_ref = loss_and_grads(model, padded)
    out, g = loss_and_grads(model, {"packed": packed})
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_token_buckets_are_few_and_tight():
    from fastbert.data.static_batch import token_bucket
    sizes = [token_bucket(n) for n in range(1, 5000)]
    assert sorted(set(sizes)) == [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144]
    assert all(s >= n and (s <= 128 or s <= 1.5 * n) for n, s in zip(range(1, 5000), sizes))
