"""fastbert (kernels="torch") vs HF transformers: outputs and every gradient, fp32, on padded batches.

Tolerance 1e-5 absolute: both compute the same fp32 graph, differing only in summation order
(fused QKV matmul vs three, unpadded vs padded softmax); observed max differences are ~1e-7.
"""
import pytest
import torch
import transformers

import fastbert
from fastbert.hf import hf_to_fastbert, fastbert_to_hf, load_converted

ATOL = 1e-5


def hf_config(**kw):
    base = dict(vocab_size=211, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=97,
                max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    base.update(kw)
    cfg = transformers.BertConfig(**base)
    cfg._attn_implementation = "eager"  # SDPA cannot return attention maps
    return cfg


def batch(seed=0, b=4, s=13, vocab=211):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    lengths = torch.tensor([s, 1, 7, s - 3])[:b]
    mask = (torch.arange(s)[None] < lengths[:, None]).long()
    ids = ids * mask  # pad id 0 on padding
    types = (torch.arange(s)[None] >= (lengths[:, None] // 2)).long() * mask
    return ids, mask, types


def pair(hf_cls, fb_cls, **cfg):
    torch.manual_seed(0)
    hf = hf_cls(hf_config(**cfg)).eval()
    fb = fb_cls(fastbert.BertConfig.from_dict(hf.config.to_dict())).eval()
    load_converted(fb, hf.state_dict())
    return hf, fb


def grads_hf_layout(model):
    g = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return fastbert_to_hf(g)


def assert_grads_equal(hf, fb):
    gh = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    gf = grads_hf_layout(fb)
    gf.pop("cls.predictions.decoder.weight", None)
    gf.pop("cls.predictions.decoder.bias", None)
    assert set(gf) <= set(gh), set(gf) - set(gh)
    for k, v in gf.items():
        torch.testing.assert_close(v, gh[k], atol=ATOL, rtol=0, msg=lambda m: f"grad {k}: {m}")
    # every HF parameter that received a gradient has its fastbert twin
    assert {k for k, v in gh.items() if v.abs().sum() > 0} - set(gf) == set()


def test_pretraining_outputs_and_grads():
    hf, fb = pair(transformers.BertForPreTraining, fastbert.BertForPreTraining)
    ids, mask, types = batch()
    labels = torch.where((torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.3) & mask.bool(),
                         ids, torch.full_like(ids, -100))
    nsp = torch.tensor([0, 1, 1, 0])
    m = mask.bool()
    o_h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True,
             output_attentions=True)
    o_f = fb(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True,
             output_attentions=True)
    torch.testing.assert_close(o_f.prediction_logits[m], o_h.prediction_logits[m], atol=ATOL, rtol=0)
    torch.testing.assert_close(o_f.seq_relationship_logits, o_h.seq_relationship_logits, atol=ATOL, rtol=0)
    for a, b in zip(o_f.hidden_states, o_h.hidden_states, strict=True):
        torch.testing.assert_close(a[m], b[m], atol=ATOL, rtol=0)
    for a, b in zip(o_f.attentions, o_h.attentions, strict=True):
        qm = m[:, None, :, None].expand_as(b)
        torch.testing.assert_close(a[qm], b[qm], atol=ATOL, rtol=0)
    # loss: the sparse MLM path against HF's dense loss; gradients of every parameter
    l_h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp).loss
    l_f = fb(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels, next_sentence_label=nsp).loss
    torch.testing.assert_close(l_f, l_h, atol=ATOL, rtol=0)
    l_h.backward()
    l_f.backward()
    assert_grads_equal(hf, fb)


@pytest.mark.parametrize("num_labels", [3, 1])
def test_sequence_classification(num_labels):
    hf, fb = pair(transformers.BertForSequenceClassification, fastbert.BertForSequenceClassification,
                  num_labels=num_labels)
    ids, mask, types = batch(seed=2)
    labels = torch.tensor([0, 2, 1, 1]) if num_labels == 3 else torch.tensor([0.5, -1.0, 2.0, 0.0])
    o_h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    o_f = fb(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    torch.testing.assert_close(o_f.logits, o_h.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(o_f.loss, o_h.loss, atol=ATOL, rtol=0)
    o_h.loss.backward()
    o_f.loss.backward()
    assert_grads_equal(hf, fb)


def test_question_answering():
    hf, fb = pair(transformers.BertForQuestionAnswering, fastbert.BertForQuestionAnswering, num_labels=2)
    ids, mask, types = batch(seed=3)
    start, end = torch.tensor([3, 0, 2, 5]), torch.tensor([6, 0, 4, 9])
    o_h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, start_positions=start, end_positions=end)
    o_f = fb(input_ids=ids, attention_mask=mask, token_type_ids=types, start_positions=start, end_positions=end)
    m = mask.bool()
    torch.testing.assert_close(o_f.start_logits[m], o_h.start_logits[m], atol=ATOL, rtol=0)
    torch.testing.assert_close(o_f.end_logits[m], o_h.end_logits[m], atol=ATOL, rtol=0)
    # HF's span softmax also runs over the padding positions: the same loss and gradients on this
    # padded batch (tests/model/test_hf_modeling_port.py covers every mask), then without padding
    l_h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, start_positions=start, end_positions=end).loss
    l_f = fb(input_ids=ids, attention_mask=mask, token_type_ids=types, start_positions=start, end_positions=end).loss
    torch.testing.assert_close(l_f, l_h, atol=ATOL, rtol=0)
    ids, types = batch(seed=4)[0], batch(seed=4)[2]
    full = torch.ones_like(ids)
    ids = ids.clamp(min=1)
    l_h = hf(input_ids=ids, attention_mask=full, token_type_ids=types, start_positions=start, end_positions=end).loss
    l_f = fb(input_ids=ids, attention_mask=full, token_type_ids=types, start_positions=start, end_positions=end).loss
    torch.testing.assert_close(l_f, l_h, atol=ATOL, rtol=0)
    l_h.backward()
    l_f.backward()
    assert_grads_equal(hf, fb)


def test_token_classification():
    hf, fb = pair(transformers.BertForTokenClassification, fastbert.BertForTokenClassification, num_labels=5)
    ids, mask, types = batch(seed=5)
    labels = torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(6))
    labels = torch.where(mask.bool(), labels, torch.full_like(labels, -100))
    o_h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    o_f = fb(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    m = mask.bool()
    torch.testing.assert_close(o_f.logits[m], o_h.logits[m], atol=ATOL, rtol=0)
    torch.testing.assert_close(o_f.loss, o_h.loss, atol=ATOL, rtol=0)
    o_h.loss.backward()
    o_f.loss.backward()
    assert_grads_equal(hf, fb)


def test_multiple_choice_and_masked_lm():
    hf, fb = pair(transformers.BertForMultipleChoice, fastbert.BertForMultipleChoice)
    ids, mask, types = batch(seed=7)
    ids, mask, types = (t.view(2, 2, -1) for t in (ids, mask, types))
    o_h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=torch.tensor([1, 0]))
    o_f = fb(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=torch.tensor([1, 0]))
    torch.testing.assert_close(o_f.logits, o_h.logits, atol=ATOL, rtol=0)
    o_h.loss.backward()
    o_f.loss.backward()
    assert_grads_equal(hf, fb)

    hf, fb = pair(transformers.BertForMaskedLM, fastbert.BertForMaskedLM)
    ids, mask, types = batch(seed=8)
    m = mask.bool()
    torch.testing.assert_close(fb(input_ids=ids, attention_mask=mask).logits[m],
                               hf(input_ids=ids, attention_mask=mask).logits[m], atol=ATOL, rtol=0)


@pytest.mark.parametrize("head", ["classification", "multiple_choice", "next_sentence"])
def test_pooled_heads_last_layer_computes_position_0_alone(monkeypatch, head):
    """HF-style padded calls of the pooled heads: the last layer runs everything after its attention (here: the FFN)
    on each sequence's position 0 alone (a padding row where that position is masked: left padding), the other
    layers on every computed row; logits and every gradient are still HF's. With hidden states asked for (HF
    returns every position's) the last layer computes every row, and the logits are the same."""
    from fastbert.model import BertPreTrainedModel
    from fastbert.ops import get_ops
    classes = {"classification": "BertForSequenceClassification", "multiple_choice": "BertForMultipleChoice",
               "next_sentence": "BertForNextSentencePrediction"}[head]
    hf, fb = pair(getattr(transformers, classes), getattr(fastbert, classes))
    ids, mask, types = batch(seed=9)
    mask[1] = mask[1].flip(0)  # left padding: position 0 masked, HF pools it all the same
    ids, types = ids.clamp(min=1) * mask, types * mask
    computed = int(mask.sum()) + int((mask[:, 0] == 0).sum())
    labels = torch.tensor([0, 2, 1, 1]) if head == "classification" else torch.tensor([1, 0, 0, 1])
    if head == "multiple_choice":
        ids, mask, types = (t.view(2, 2, -1) for t in (ids, mask, types))
        labels = torch.tensor([1, 0])
    ops, rows = get_ops("torch"), []

    def ffn(h, *args, **kwargs):
        rows.append(h.shape[0])
        return ops.ffn(h, *args, **kwargs)
    monkeypatch.setattr(BertPreTrainedModel, "ops", property(lambda self: ops._replace(ffn=ffn)))
    o_h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    o_f = fb(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)
    assert rows == [computed, 4]  # 2 layers; 4 sequences (2 x 2 choices)
    torch.testing.assert_close(o_f.logits, o_h.logits, atol=ATOL, rtol=0)
    o_h.loss.backward()
    o_f.loss.backward()
    assert_grads_equal(hf, fb)
    rows.clear()
    o_all = fb(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    assert rows == [computed, computed] and len(o_all.hidden_states) == 3
    torch.testing.assert_close(o_all.logits, o_f.logits, atol=1e-6, rtol=0)


def test_state_dict_conversion_round_trip():
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(hf_config())
    state = hf.state_dict()
    back = fastbert_to_hf(hf_to_fastbert(state, prefix_encoder=True))
    for k, v in state.items():
        if k.endswith("position_ids") or k.startswith("cls.predictions.decoder."):  # tied: stored once, as HF
            continue
        torch.testing.assert_close(back[k], v, atol=0, rtol=0)


def test_padding_does_not_change_results():
    """The encoder result for a sequence is independent of how much padding its batch carries."""
    torch.manual_seed(0)
    model = fastbert.BertModel(fastbert.BertConfig.preset("tiny", vocab_size=100, hidden_dropout_prob=0.0,
                                                          attention_probs_dropout_prob=0.0)).eval()
    ids = torch.randint(1, 100, (1, 7))
    ref = model(input_ids=ids).last_hidden_state
    for extra in (1, 9, 25):
        padded = torch.cat([ids, torch.zeros(1, extra, dtype=torch.long)], dim=1)
        mask = (padded != 0).long()
        out = model(input_ids=padded, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(out[:, :7], ref, atol=1e-6, rtol=0)
        assert torch.all(out[:, 7:] == 0)


@pytest.mark.parametrize("prenorm", [False, True])
def test_prenorm_switch(prenorm):
    cfg = fastbert.BertConfig.preset("tiny", vocab_size=100, prenorm=prenorm)
    model = fastbert.BertForPreTraining(cfg)
    keys = set(model.state_dict())
    assert ("bert.encoder.final_layer_norm.weight" in keys) == prenorm
    ids = torch.randint(1, 100, (2, 11))
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if "seq_relationship" not in n
               and "pooler" not in n)
