"""Pre-LN (the academic-budget recipe's layout) against a plain-PyTorch Pre-LN BERT written from its equations
on padded batches: outputs and every parameter gradient, for kernels="torch" and "triton" (the interpreter on
the CPU), three layers so that the LayerNorms the encoder chains into the residual adds (each layer's last add
applies the next layer's first LayerNorm, the last layer's the final one) sit between layers and at the end.
"""
import pytest
import torch
import torch.nn.functional as F

from fastbert.config import BertConfig
from fastbert.model import BertModel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _ln(x, norm):
    return F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, norm.eps)


def prenorm_reference(model: BertModel, input_ids, attention_mask, token_type_ids):
    """x = LN_emb(embeddings); per layer x += Attn(LN_1(x)), x += FFN(LN_2(x)); LN_final(x). ``(B, S, H)``."""
    cfg, emb = model.config, model.embeddings
    b, s = input_ids.shape
    pos = torch.arange(s, device=input_ids.device)[None].expand(b, s)
    x = _ln(emb.word_embeddings(input_ids) + emb.position_embeddings(pos) + emb.token_type_embeddings(token_type_ids),
            emb.LayerNorm)
    nh, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    keep = attention_mask.bool()[:, None, None, :]
    for layer in model.encoder.layer:
        att = layer.attention
        qkv = F.linear(_ln(x, att.output.LayerNorm), att.self.qkv.weight, att.self.qkv.bias)
        q, k, v = qkv.view(b, s, 3, nh, hd).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, s, nh * hd)
        x = x + att.output.dense(ctx)
        h = F.gelu(layer.intermediate.dense(_ln(x, layer.output.LayerNorm)))
        x = x + layer.output.dense(h)
    return _ln(x, model.encoder.final_layer_norm)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_prenorm_encoder_equals_plain_reference(kernels):
    torch.manual_seed(0)
    cfg = BertConfig.preset("tiny", vocab_size=300, max_position_embeddings=32, prenorm=True, num_hidden_layers=3,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertModel(cfg).to(DEVICE)
    with torch.no_grad():  # LayerNorms and biases away from their 1 / 0 start, so a swapped one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    model.set_kernels(kernels).train()  # training mode: the path pretraining takes (dropout 0 here)
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([11, 7, 1])
    mask = (torch.arange(11)[None] < lengths[:, None]).long()
    ids = torch.randint(1, 300, (3, 11), generator=g) * mask
    types = (torch.arange(11)[None] >= 3).long() * mask
    batch = {k: v.to(DEVICE) for k, v in dict(input_ids=ids, attention_mask=mask, token_type_ids=types).items()}
    real = batch["attention_mask"].bool()
    w = torch.randn(3, 11, cfg.hidden_size, generator=g).to(DEVICE)
    params = [p for p in model.parameters() if p.requires_grad and p is not model.pooler.dense.weight
              and p is not model.pooler.dense.bias]
    results = []
    for run in (lambda: model(**batch).last_hidden_state, lambda: prenorm_reference(model, **batch)):
        out = run()
        loss = (out * w)[real].sum()
        results.append((out[real], torch.autograd.grad(loss, params, allow_unused=True)))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    names = [n for n, p in model.named_parameters() if any(p is q for q in params)]
    for name, a, b in zip(names, grads, ref_grads):
        assert a is not None and b is not None, name
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m: f"grad of {name}: {m}")
