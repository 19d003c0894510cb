"""Fused BERT embeddings (gather + sum + LayerNorm + dropout) vs the plain-PyTorch reference.

Outputs and the gradients of all five tables are compared with an fp64 reference; the kernel's
error must stay within 2x torch's own same-dtype error plus a small atol. CPU runs use the Triton
interpreter, hence the small shapes.
"""
import pytest
import torch

from fastbert.ops._common import dropout_mask
from fastbert.ops.embeddings import bert_embeddings, bert_embeddings_ref
from ops_testing import DEVICE, assert_compiled_matches_eager, assert_within

TABLES = ("word", "position", "type", "ln_weight", "ln_bias")


def make_inputs(tokens, hidden, vocab, max_pos, n_types, dtype, padding_idx=None):
    g = torch.Generator().manual_seed(tokens * 13 + hidden)
    ids = {
        "input_ids": torch.randint(0, vocab, (tokens,), generator=g),
        "position_ids": torch.randint(0, max_pos, (tokens,), generator=g),
        "token_type_ids": torch.randint(0, n_types, (tokens,), generator=g),
    }
    if padding_idx is not None:
        ids["input_ids"][::3] = padding_idx % vocab  # several pad tokens
    params = {
        "word": torch.randn(vocab, hidden, generator=g),
        "position": torch.randn(max_pos, hidden, generator=g),
        "type": torch.randn(n_types, hidden, generator=g),
        "ln_weight": 1 + 0.5 * torch.randn(hidden, generator=g),
        "ln_bias": torch.randn(hidden, generator=g),
    }
    return {k: v.to(DEVICE) for k, v in ids.items()}, {k: v.to(DEVICE, dtype) for k, v in params.items()}


def run(fn, ids, params, dy, dtype, **kw):
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in params.items()}
    y = fn(ids["input_ids"], ids["position_ids"], ids["token_type_ids"], *(leaves[k] for k in TABLES), 1e-12, **kw)
    grads = torch.autograd.grad((y.float() * dy.float()).sum(), [leaves[k] for k in TABLES])
    return y, dict(zip(TABLES, grads))


def check(tokens, hidden, vocab, max_pos, n_types, dtype, padding_idx=None, p=0.0, seed=0):
    ids, params = make_inputs(tokens, hidden, vocab, max_pos, n_types, dtype, padding_idx)
    dy = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    ref = bert_embeddings_ref
    if p > 0:
        mask = dropout_mask(seed, tokens, hidden, p, DEVICE)

        def ref(*args, **kw):  # the reference with the fused op's mask
            return bert_embeddings_ref(*args, **kw) * mask / (1 - p)
    y, dk = run(bert_embeddings, ids, params, dy, dtype, padding_idx=padding_idx, dropout_p=p, seed=seed)
    y_same, ds = run(ref, ids, params, dy, dtype, padding_idx=padding_idx)
    y_ref, dr = run(ref, ids, params, dy, torch.float64, padding_idx=padding_idx)
    assert y.dtype == dtype and y.shape == (tokens, hidden)
    assert_within("out", y, y_same, y_ref, dtype)
    for k in TABLES:
        assert dk[k].dtype == dtype
        assert_within(f"d{k}", dk[k], ds[k], dr[k], dtype)
    if padding_idx is not None:
        assert torch.count_nonzero(dk["word"][padding_idx]) == 0
    return dk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden,vocab,max_pos,n_types", [
    (1, 1023, 7, 3, 2), (7, 37, 11, 9, 2), (20, 300, 50, 16, 3), (9, 128, 10, 10, 1)])
def test_matches_reference(tokens, hidden, vocab, max_pos, n_types, dtype):
    check(tokens, hidden, vocab, max_pos, n_types, dtype)


def test_many_token_types_use_atomics():
    """More than 8 token types takes the atomic path for the type table too."""
    check(25, 64, 30, 12, 12, torch.float32)


@pytest.mark.parametrize("padding_idx", [0, 4, -1])
def test_padding_row_gets_no_gradient(padding_idx):
    dk = check(24, 48, 10, 8, 2, torch.float32, padding_idx=padding_idx)
    assert torch.count_nonzero(dk["word"][padding_idx]) == 0
    assert torch.count_nonzero(dk["word"]) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_matches_masked_reference(dtype):
    check(13, 100, 20, 16, 2, dtype, padding_idx=0, p=0.2, seed=77)


def test_dropout_fraction_reproducibility_and_p_zero():
    ids, params = make_inputs(64, 500, 30, 64, 2, torch.float32)
    args = (ids["input_ids"], ids["position_ids"], ids["token_type_ids"], *(params[k] for k in TABLES), 1e-12)
    p = 0.4
    y0 = bert_embeddings(*args, dropout_p=0.0, seed=1)
    y1 = bert_embeddings(*args, dropout_p=p, seed=11)
    y2 = bert_embeddings(*args, dropout_p=p, seed=11)
    y3 = bert_embeddings(*args, dropout_p=p, seed=12)
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)
    kept = (y1 != 0).float().mean().item()
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / y1.numel()) ** 0.5
    torch.testing.assert_close(y1[y1 != 0], (y0 / (1 - p))[y1 != 0])
    # p = 0: no element dropped or rescaled, whatever the seed.
    assert torch.equal(y0, bert_embeddings(*args, dropout_p=0.0, seed=999))
    assert torch.equal(y0, bert_embeddings(*args))


def test_rejects_bad_arguments():
    ids, params = make_inputs(4, 16, 10, 8, 2, torch.float32)
    tables = [params[k] for k in TABLES]
    with pytest.raises(ValueError, match="1-D"):
        bert_embeddings(ids["input_ids"][None], ids["position_ids"][None], ids["token_type_ids"][None], *tables, 1e-12)
    with pytest.raises(ValueError, match="dropout_p"):
        bert_embeddings(*ids.values(), *tables, 1e-12, dropout_p=-0.1)


def test_custom_op_and_torch_compile():
    ids, params = make_inputs(6, 32, 12, 8, 2, torch.float32)
    idv = list(ids.values())
    torch.library.opcheck(torch.ops.fastbert.bert_embeddings_fwd.default,
                          (*idv, *(params[k] for k in TABLES), 1e-12, 0.1, torch.tensor([3], device=DEVICE)))

    def f(*tables):
        return (bert_embeddings(*idv, *tables, 1e-12, dropout_p=0.1, seed=3, padding_idx=0) ** 2).sum()

    assert_compiled_matches_eager(f, [params[k] for k in TABLES])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [768, 1024])
def test_gpu_bert_shapes(hidden, dtype):
    check(8 * 512, hidden, 30522, 512, 2, dtype, padding_idx=0)
    check(8 * 512, hidden, 30522, 512, 2, dtype, padding_idx=0, p=0.1, seed=9)
