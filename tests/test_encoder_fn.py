"""fastbert has one encoder: ``BertModel`` and an HF ``BertModel`` under ``fastbert.patch`` both run
``fastbert.encoder_fn``, so on the same weights they give the same outputs and gradients, bit for bit
(not only within HF-parity tolerance)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastbert  # noqa: E402
from fastbert.hf import fastbert_to_hf, load_converted  # noqa: E402


def twins(act):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=128, max_position_embeddings=32, hidden_act=act,
                                  attn_implementation="eager")
    hf = transformers.BertModel(cfg).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorm parameters
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    native = fastbert.BertModel(fastbert.BertConfig.from_dict(cfg.to_dict())).eval()
    load_converted(native, hf.state_dict())
    return fastbert.patch(copy.deepcopy(hf), kernels="torch"), native


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_native_and_patched_models_are_one_encoder(act):
    patched, native = twins(act)
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(9)[None, :] < torch.tensor([9, 4, 1])[:, None]).long()
    mask[1, 0] = 0  # a masked position 0: the pooler reads it, so it is computed as a padding row
    batch = dict(input_ids=torch.randint(1, 99, (3, 9), generator=g), attention_mask=mask,
                 token_type_ids=torch.randint(0, 2, (3, 9), generator=g))
    weight = torch.randn(3, 9, 64, generator=g)
    results = []
    for model in (patched, native):
        out = model(**batch, output_hidden_states=True, output_attentions=True)
        loss = (out.last_hidden_state * weight).sum() + out.pooler_output.sum()
        params = dict(model.named_parameters())
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        results.append((out, grads if model is patched else fastbert_to_hf(grads)))
    (hf_out, hf_grads), (fb_out, fb_grads) = results
    for name in ("last_hidden_state", "pooler_output"):
        assert torch.equal(hf_out[name], fb_out[name]), name
    for i, (a, b) in enumerate(zip(hf_out.hidden_states + hf_out.attentions, fb_out.hidden_states + fb_out.attentions)):
        assert torch.equal(a, b), i
    assert hf_grads.keys() == fb_grads.keys()
    for name in hf_grads:
        assert torch.equal(hf_grads[name], fb_grads[name]), name
