"""Model level: the tiny preset with kernels="triton" equals kernels="torch" (outputs and every
parameter gradient), for BertModel (Post-LN and Pre-LN, both GELUs) and BertForPreTraining's
sparse MLM + NSP loss. CPU runs use the Triton interpreter; the vocabulary is shrunk to keep the
decoder small there.
"""
import copy

import pytest
import torch

from fastbert.config import BertConfig
from fastbert.heads import BertForPreTraining
from fastbert.model import BertModel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-2, atol=2e-2)}


def make_batch(vocab, batch=3, seq=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    lengths = torch.tensor([seq, 7, 1])[:batch]
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    ids = ids * mask  # pad id 0 after each sequence
    types = (torch.arange(seq)[None] >= lengths[:, None] // 2).long() * mask
    labels = torch.where(torch.rand(batch, seq, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]  # at least one prediction
    labels = labels.masked_fill(mask == 0, -100)
    out = dict(input_ids=ids, attention_mask=mask, token_type_ids=types)
    return {k: v.to(DEVICE) for k, v in out.items()}, labels.to(DEVICE), torch.tensor([0, 1, 1])[:batch].to(DEVICE)


def twin_models(cls, dtype, **overrides):
    torch.manual_seed(0)
    cfg = BertConfig.preset("tiny", vocab_size=300, max_position_embeddings=32, **overrides)
    ref = cls(cfg).to(DEVICE, dtype).eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters and biases
        for name, p in ref.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    fused = copy.deepcopy(ref).set_kernels("triton")
    return ref, fused


def param_grads(model, loss):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for n, p in model.named_parameters() if p.requires_grad], allow_unused=True)
    return dict(zip(names, grads))


def compare_grads(g_ref, g_fused, tol):
    assert g_ref.keys() == g_fused.keys()
    for name in g_ref:
        a, b = g_ref[name], g_fused[name]
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b, a, **tol, msg=lambda m: f"grad of {name}: {m}")


def assert_within(name, out, same, ref, atol):
    """Kernel error vs the fp32 reference within 2x torch's own same-dtype error + atol."""
    ref = ref.double()
    err = (out.double() - ref).abs().max().item()
    err_same = (same.double() - ref).abs().max().item()
    atol = atol * max(1.0, ref.abs().max().item())
    assert err <= 2 * err_same + atol, f"{name}: triton err {err:.3g} > 2 * torch err {err_same:.3g} + {atol:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("prenorm,act", [(False, "gelu"), (True, "gelu_tanh")])
def test_bert_model_triton_equals_torch(prenorm, act, dtype):
    """fp32: triton == torch within fp32 rounding. fp16: both run in fp16 and are compared with
    the fp32 torch model; triton's error stays within 2x torch's own fp16 error + atol."""
    ref, _ = twin_models(BertModel, torch.float32, prenorm=prenorm, hidden_act=act)
    same = copy.deepcopy(ref).to(dtype)
    fused = copy.deepcopy(same).set_kernels("triton")
    batch, _, _ = make_batch(ref.config.vocab_size)
    real = batch["attention_mask"].bool()
    w = torch.randn(*real.shape, ref.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    results = []
    for model in (fused, same, ref):
        out = model(**batch)
        loss = (out.last_hidden_state.float() * w)[real].sum() + out.pooler_output.float().sum()
        results.append(([out.last_hidden_state[real], out.pooler_output], param_grads(model, loss)))
    atol = 1e-5 if dtype == torch.float32 else 2e-3
    for i, (a, b, c) in enumerate(zip(*(r[0] for r in results))):
        assert_within(f"output {i}", a, b, c, atol)
    g_fused, g_same, g_ref = (r[1] for r in results)
    assert g_fused.keys() == g_ref.keys()
    for name in g_ref:
        assert (g_fused[name] is None) == (g_ref[name] is None), name
        if g_ref[name] is not None:
            assert_within(f"grad of {name}", g_fused[name], g_same[name], g_ref[name], atol)


def test_pretraining_loss_triton_equals_torch():
    ref, fused = twin_models(BertForPreTraining, torch.float32, sparse_prediction=True)  # the fused sparse loss
    batch, labels, nsp = make_batch(ref.config.vocab_size)
    results = []
    for model in (ref, fused):
        out = model(**batch, labels=labels, next_sentence_label=nsp)
        results.append((out, param_grads(model, out.loss)))
    (o_ref, g_ref), (o_fused, g_fused) = results
    for key in ("loss", "mlm_loss", "seq_relationship_logits"):
        torch.testing.assert_close(o_fused[key], o_ref[key], **TOL[torch.float32])
    for key in ("mlm_correct", "mlm_count", "nsp_correct"):
        assert int(o_fused[key]) == int(o_ref[key]), key
    assert int(o_ref["mlm_count"]) == int((labels != -100).sum())
    # the decoder is tied to the word embeddings: one Parameter, one gradient with both contributions
    assert fused.cls.predictions.decoder.weight is fused.bert.embeddings.word_embeddings.weight
    compare_grads(g_ref, g_fused, TOL[torch.float32])


def test_sequence_classification_triton_equals_torch():
    """The pooled heads' padded calls, whose last layer computes each sequence's position 0 alone (a padding row
    where it is masked: left padding here), on the fused kernels: logits, loss and every gradient equal torch's."""
    from fastbert.heads import BertForSequenceClassification
    ref, fused = twin_models(BertForSequenceClassification, torch.float32, num_labels=3)
    batch, _, _ = make_batch(ref.config.vocab_size)
    mask = batch["attention_mask"]
    mask[1] = mask[1].flip(0)
    batch["input_ids"] = batch["input_ids"].clamp(min=1) * mask
    batch["token_type_ids"] = batch["token_type_ids"] * mask
    labels = torch.tensor([2, 0, 1], device=DEVICE)
    results = []
    for model in (ref, fused):
        out = model(**batch, labels=labels)
        results.append((out, param_grads(model, out.loss)))
    (o_ref, g_ref), (o_fused, g_fused) = results
    for key in ("loss", "logits"):
        torch.testing.assert_close(o_fused[key], o_ref[key], **TOL[torch.float32])
    compare_grads(g_ref, g_fused, TOL[torch.float32])


def test_training_mode_dropout_is_seeded_by_torch():
    """In train mode the fused path draws its dropout seeds from torch's CPU generator: the same
    torch.manual_seed gives the same loss, another gives a different one, and eval differs."""
    _, fused = twin_models(BertForPreTraining, torch.float32)
    batch, labels, nsp = make_batch(fused.config.vocab_size)
    fused.train()
    losses = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        losses.append(fused(**batch, labels=labels, next_sentence_label=nsp).loss.item())
    fused.eval()
    eval_loss = fused(**batch, labels=labels, next_sentence_label=nsp).loss.item()
    assert losses[0] == losses[1]
    assert losses[0] != losses[2] and losses[0] != eval_loss


def _hf_style_batch(vocab, lengths, labelled, seq=64, seed=0):
    """Right-padded rows of ``lengths`` real tokens, the first ``labelled`` of them labelled, NSP labels: a
    user's own batch."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=g) * mask
    labels = torch.where((mask.flatten().cumsum(0) <= labelled).view(mask.shape) & (mask == 1), ids, -100)
    batch = dict(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids), labels=labels,
                 next_sentence_label=torch.randint(0, 2, (len(lengths),), generator=g))
    return {k: v.cuda() for k, v in batch.items()}


@pytest.mark.gpu
def test_gpu_a_new_token_count_compiles_nothing():
    """HF-style padded batches have another token count every step. Once a step has run, a batch whose count
    is divisible by 16 (or whose labelled count is) must reuse the compiled kernels: Triton specializes integer
    arguments on divisibility by 16, and before the token-count arguments were left unspecialized the first such
    batch recompiled every kernel (a 7.5 s step, BERT-base on an H100)."""
    import triton
    torch.manual_seed(0)
    cfg = BertConfig.preset("tiny", vocab_size=1000, max_position_embeddings=64, kernels="triton")
    model = BertForPreTraining(cfg).cuda().train()

    def step(lengths, labelled, seed):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**_hf_style_batch(cfg.vocab_size, lengths, labelled, seed=seed)).loss
        loss.backward()
        return loss

    step([64, 37, 30, 9, 50, 64, 21, 40], 45, 0)  # 315 tokens, 45 labelled
    step([64, 33, 30, 9, 50, 64, 20, 40], 43, 1)  # 310 tokens, 43 labelled: the variants of the first step
    compiled = []
    hooks = triton.knobs.runtime
    previous, hooks.jit_post_compile_hook = hooks.jit_post_compile_hook, lambda **kw: compiled.append(kw["repr"])
    try:
        for seed, (lengths, labelled) in enumerate((([64, 38, 30, 9, 50, 64, 25, 40], 41),
                                                     ([64, 48, 32, 16, 64, 64, 32, 32], 48)), 2):
            assert sum(lengths) % 16 == 0
            assert torch.isfinite(step(lengths, labelled, seed))
        torch.cuda.synchronize()
    finally:
        hooks.jit_post_compile_hook = previous
    assert not compiled, f"{len(compiled)} kernels compiled for a new token count:\n" + "\n".join(compiled)
