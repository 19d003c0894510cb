"""fastbert.patch on random-init HF BERT models: outputs and every gradient equal HF's, unpatch restores.

Tolerance (fp32): the patched model does HF's math in another order (one concatenated QKV GEMM,
online softmax, LayerNorm with fused residual, padding removed), so results differ by rounding
only: ~1e-7 observed on these O(1) activations after two layers. atol 1e-5 / rtol 1e-4 leaves a
wide margin over that while any real error (a wrong mask, bias, scale or position id) moves
values by 1e-2 or more. Outputs are compared on real tokens: at padding positions HF computes
values that no loss uses, the patched model returns 0. (Masks other than right padding and labels on
padding: tests/model/test_hf_modeling_port.py.)
"""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForPreTraining, BertForSequenceClassification, BertModel  # noqa: E402

import fastbert.hf_patch as fp  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-5)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # kernels="triton" needs CUDA or the interpreter
LENGTHS = [17, 9, 1]


def tiny_config(**overrides):
    kw = dict(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
              max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, attn_implementation="eager")  # eager: HF returns attention maps
    kw.update(overrides)
    return BertConfig(**kw)


def make_model(cls, **overrides):
    torch.manual_seed(0)
    kwargs = {"num_labels": 3} if cls is BertForSequenceClassification else {}
    return cls(tiny_config(**overrides, **kwargs)).to(DEVICE).train()


def make_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    batch, seq = len(LENGTHS), max(LENGTHS)
    mask = (torch.arange(seq)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.randint(1, 99, (batch, seq), generator=g) * mask          # pad id 0 at padding, as tokenizers do
    types = torch.randint(0, 2, (batch, seq), generator=g) * mask
    return {k: v.to(DEVICE) for k, v in dict(input_ids=ids, attention_mask=mask, token_type_ids=types).items()}


def loss_and_outputs(model, batch, g_seed=2):
    """A scalar touching every output at real tokens (weights random, fixed), and the outputs."""
    g = torch.Generator().manual_seed(g_seed)
    real = batch["attention_mask"].bool()
    if isinstance(model, BertForPreTraining):
        pick = torch.rand(real.shape, generator=g).to(DEVICE) < 0.5
        labels = torch.where(real & pick, batch["input_ids"], -100)
        out = model(**batch, labels=labels, next_sentence_label=torch.tensor([0, 1, 0], device=DEVICE))
        return out.loss, [out.prediction_logits[real], out.seq_relationship_logits]
    if isinstance(model, BertForSequenceClassification):
        out = model(**batch, labels=torch.tensor([0, 2, 1], device=DEVICE))
        return out.loss, [out.logits]
    out = model(**batch, output_hidden_states=True, output_attentions=True)
    w = torch.randn(out.last_hidden_state.shape, generator=g).to(DEVICE)
    loss = (out.last_hidden_state * w)[real].sum() + out.pooler_output.sum()
    qmask = real[:, None, :, None].expand(-1, model.config.num_attention_heads, -1, real.shape[1])
    return loss, ([out.last_hidden_state[real], out.pooler_output]
                  + [h[real] for h in out.hidden_states] + [a[qmask] for a in out.attentions])


def grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("cls", [BertModel, BertForPreTraining, BertForSequenceClassification])
def test_patched_outputs_and_gradients_match_hf(cls, kernels):
    model, batch = make_model(cls), make_batch()
    loss_ref, outs_ref = loss_and_outputs(model, batch)
    grads_ref = grads(model, loss_ref)
    keys = list(model.state_dict())

    fp.patch(model, kernels=kernels)
    assert list(model.state_dict()) == keys
    loss, outs = loss_and_outputs(model, batch)
    assert len(outs) == len(outs_ref)
    torch.testing.assert_close(loss, loss_ref, **TOL)
    for got, want in zip(outs, outs_ref):
        torch.testing.assert_close(got, want, **TOL)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, got, want in zip(names, grads(model, loss), grads_ref):
        assert (got is None) == (want is None), name
        if got is not None:
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"grad of {name}: {m}")


def test_unpatch_restores_original_forward():
    model, batch = make_model(BertForPreTraining), make_batch()
    model.eval()
    before = model(**batch).prediction_logits
    signature = inspect.signature(model.forward)
    assert fp.patch(model) is model and fp.is_patched(model)
    assert "forward" in model.bert.__dict__ and "forward" in model.__dict__  # the head passes its labels on
    assert inspect.signature(model.forward) == signature  # HF Trainer picks input columns from it
    patched = model(**batch).prediction_logits
    assert not torch.equal(patched, before)  # padding positions differ: the patched path really ran
    assert fp.unpatch(model) is model and not fp.is_patched(model)
    assert "forward" not in model.bert.__dict__ and not hasattr(model.bert, fp._STATE)
    assert "forward" not in model.__dict__
    assert model.bert.forward.__func__ is type(model.bert).forward
    torch.testing.assert_close(model(**batch).prediction_logits, before, rtol=0, atol=0)
    fp.unpatch(model)  # unpatching twice is a no-op


def test_deepcopy_of_a_patched_model_runs_on_its_own_weights():
    """copy.deepcopy (EMA copies, model soups) gives a patched copy whose forwards are bound to the
    copy: its loss is HF's for the copy's weights, not the original's."""
    model, batch = make_model(BertForPreTraining).eval(), make_batch()
    labels = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    twin = copy.deepcopy(fp.patch(model, kernels="torch"))
    with torch.no_grad():
        twin.bert.embeddings.word_embeddings.weight.mul_(1.5)
        twin.cls.predictions.transform.dense.bias.add_(0.5)
    got = twin(**batch, labels=labels, next_sentence_label=torch.tensor([0, 1, 0], device=DEVICE)).loss
    want = fp.unpatch(copy.deepcopy(twin))(**batch, labels=labels,
                                          next_sentence_label=torch.tensor([0, 1, 0], device=DEVICE)).loss
    torch.testing.assert_close(got, want, **TOL)
    assert fp.is_patched(twin) and fp.is_patched(model)
    assert not torch.allclose(got, model(**batch, labels=labels, next_sentence_label=torch.tensor([0, 1, 0],
                                                                                                   device=DEVICE)).loss)


def test_default_kernels_follow_the_input_device(monkeypatch):
    seen = []
    real_get_ops = fp.get_ops
    monkeypatch.setattr(fp, "get_ops", lambda k: seen.append(k) or real_get_ops(k))
    model = fp.patch(make_model(BertModel))
    model(**make_batch())
    assert seen == ["triton" if DEVICE == "cuda" else "torch"]
    fp.patch(model, kernels="triton")  # re-patching only switches kernels
    assert fp._find_bert(model)._fastbert_patch["kernels"] == "triton"


def test_return_tuple_inputs_embeds_and_position_ids():
    model, batch = make_model(BertModel), make_batch()
    real = batch["attention_mask"].bool()
    embeds = model.embeddings.word_embeddings(batch["input_ids"]).detach()
    pos = torch.arange(17, device=DEVICE).flip(0).expand(3, 17)  # explicit, non-default position ids
    ref = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"], position_ids=pos)
    ref_ids = model(**batch, position_ids=pos, return_dict=False)
    fp.patch(model, kernels="torch")
    out = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"], position_ids=pos)
    out_ids = model(**batch, position_ids=pos, return_dict=False)
    assert isinstance(out_ids, tuple)
    torch.testing.assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], **TOL)
    torch.testing.assert_close(out_ids[0][real], ref_ids[0][real], **TOL)
    torch.testing.assert_close(out_ids[1], ref_ids[1], **TOL)


def test_gradient_checkpointing_gives_the_same_gradients():
    model, batch = make_model(BertForSequenceClassification), make_batch()
    fp.patch(model, kernels="torch")
    loss, _ = loss_and_outputs(model, batch)
    want = grads(model, loss)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()  # transformers >= 5.2x renamed it
    assert all(layer.gradient_checkpointing for layer in model.bert.encoder.layer)
    loss, _ = loss_and_outputs(model, batch)
    for got, w in zip(grads(model, loss), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_dropout_in_training_is_seeded_by_torch(kernels):
    model = make_model(BertForSequenceClassification, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    batch = make_batch()
    fp.patch(model, kernels=kernels)
    torch.manual_seed(5)
    a = model(**batch).logits
    torch.manual_seed(5)
    b = model(**batch).logits
    torch.manual_seed(6)
    c = model(**batch).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c)
    model.eval()  # eval turns every dropout off: the patched model equals HF's again
    want = fp.unpatch(model)(**batch).logits
    torch.testing.assert_close(fp.patch(model, kernels=kernels)(**batch).logits, want, **TOL)


def test_refuses_unsupported_models_and_inputs():
    with pytest.raises(fp.UnsupportedModelError, match="decoder"):
        fp.patch(make_model(BertModel, is_decoder=True))
    model = make_model(BertModel)
    model.config.position_embedding_type = "relative_key"
    with pytest.raises(fp.UnsupportedModelError, match="relative position"):
        fp.patch(model)
    with pytest.raises(fp.UnsupportedModelError, match="BertModel or BertFor"):
        fp.patch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="kernels"):
        fp.patch(make_model(BertModel), kernels="cuda")

    model, batch = fp.patch(make_model(BertModel)), make_batch()
    with pytest.raises(fp.UnsupportedModelError, match="head_mask"):
        model(**batch, head_mask=torch.ones(2, 2, device=DEVICE))
    with pytest.raises(fp.UnsupportedModelError, match="past_key_values"):
        model(**batch, past_key_values=object())
    with pytest.raises(fp.UnsupportedModelError, match="attention_mask must be a"):
        model(batch["input_ids"], attention_mask=batch["attention_mask"][:, None, None, :])


def test_real_minilm_checkpoint(minilm_dir):
    """A real pre-trained BERT (all-MiniLM-L6-v2, 6 layers, hidden 384, 12 heads of 32)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir).to(DEVICE).eval()
    batch = tok(["fastbert patches HF BERT in place.", "Padding costs nothing inside the encoder.", "x"],
                padding=True, return_tensors="pt").to(DEVICE)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        want = model(**batch)
        got = fp.patch(model)(**batch)
    torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], **TOL)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, **TOL)


def test_one_rule_resolves_kernels():
    """`auto` / unset mean Triton on CUDA and torch elsewhere, wherever a command leaves it open."""
    from fastbert.ops import resolve_kernels
    assert resolve_kernels(None, "cpu") == resolve_kernels("auto", torch.device("cpu")) == "torch"
    assert resolve_kernels("auto", "cuda") == resolve_kernels(None, torch.device("cuda:0")) == "triton"
    assert resolve_kernels("torch", "cuda") == "torch" and resolve_kernels("triton", "cpu") == "triton"
    assert resolve_kernels(None) == ("triton" if torch.cuda.is_available() else "torch")
    with pytest.raises(ValueError, match="use 'auto', 'torch' or 'triton'"):
        resolve_kernels("cuda", "cpu")
