"""Weight gradients added into buffers by the GEMMs that compute them (fastbert/ops/grad_accum.py).

Inside ``accumulating({weight: buffer})`` a fused op's backward adds the weight's gradient into the buffer
and gives autograd none for it; everything else (x, the bias, weights without a buffer) is unchanged. The
buffer must end as ``before + the gradient the op would have returned``: on the CPU (and for fp32 operands)
the op adds its own gradient (bit for bit), on a GPU cuBLASLt's GEMM adds its fp32 accumulator to the buffer
in its epilogue (one rounding less than a separate addition, so equal within fp32 rounding of the sum).
"""
import pytest
import torch

from fastbert.config import BertConfig
from fastbert.heads import BertForMaskedLM
from fastbert.ops import cublaslt, grad_accum, mlm_loss
from fastbert.ops._common import HAS_TRITON
from fastbert.ops.embeddings import bert_embeddings
from fastbert.ops.ffn import ffn
from fastbert.ops.linear import linear_residual
from fastbert.ops.qkv_attention import qkv_attention
from ops_testing import DEVICE

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def leaves(*shapes, seed=0, device=DEVICE, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*s, generator=g) / s[-1] ** 0.5).to(device, dtype).requires_grad_() for s in shapes]


def grads_of(fn, params, buffers=None, cast=None):
    """``fn(*params)``'s gradients (None where autograd gave none), run inside ``accumulating(buffers)``."""
    ps = [p.detach().clone().requires_grad_() for p in params]
    mapped = {ps[i]: b for i, b in (buffers or {}).items()}
    autocast = torch.autocast(DEVICE, dtype=cast or torch.bfloat16, enabled=cast is not None)
    with grad_accum.accumulating(mapped), autocast:
        out = fn(*ps)
    torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    return [p.grad for p in ps]


def linear(x, w, b):
    """The layer as the model calls it: under autocast x arrives in the autocast dtype."""
    cast = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return linear_residual(x.to(cast), w, b)


@pytest.mark.parametrize("cast", [None, torch.bfloat16])
def test_linear_adds_its_weight_gradient_into_the_buffer(cast):
    x, w, b = leaves((37, 24), (40, 24), (40,))
    want = grads_of(linear, (x, w, b), cast=cast)
    before = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    buf = before.clone()
    got = grads_of(linear, (x, w, b), {1: buf}, cast=cast)
    assert got[1] is None                                     # autograd got no weight gradient
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # dx and the bias: unchanged
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    torch.testing.assert_close(buf, before + want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", [(1, 3), (3,)])
def test_ffn_adds_its_weight_gradients_into_the_buffers(which):
    x, w1, b1, w2 = leaves((21, 16), (40, 16), (40,), (16, 40))

    def f(*t):
        out, passed = ffn(*t, residual=True)
        return out, passed

    want = grads_of(f, (x, w1, b1, w2))
    buffers = {i: torch.full(want[i].shape, 0.5, device=DEVICE) for i in which}
    got = grads_of(f, (x, w1, b1, w2), buffers)
    for i in range(4):
        if i in which:
            assert got[i] is None
            torch.testing.assert_close(buffers[i], 0.5 + want[i], rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(got[i], want[i], rtol=0, atol=0)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the attention kernels)")
def test_qkv_attention_adds_its_weight_gradient_into_the_buffer():
    x, w, b = leaves((24, 32), (96, 32), (96,))
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=DEVICE)

    def f(*t):
        ctx, passed = qkv_attention(*t, 2, cu, 14)
        return ctx, passed

    want = grads_of(f, (x, w, b))
    buf = torch.full(w.shape, 0.5, device=DEVICE)
    got = grads_of(f, (x, w, b), {1: buf})
    assert got[1] is None
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # dx and the bias: unchanged
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    torch.testing.assert_close(buf, 0.5 + want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the embeddings kernels)")
def test_embeddings_add_their_tables_gradients_into_the_buffers():
    """The word and position tables' atomics add into their fp32 buffers; the token-type table and the LayerNorm
    get their gradients from autograd as before. Tolerance: the same fp32 atomics added into ``before`` one by
    one, against added into zeros and then to ``before`` (a few roundings of ~1-sized sums)."""
    g = torch.Generator().manual_seed(6)
    ids = [torch.randint(0, n, (29,), generator=g).to(DEVICE) for n in (50, 16, 2)]
    tables = leaves((50, 24), (16, 24), (2, 24), (24,), (24,), seed=7)

    def f(word, pos, typ, w, b):
        return (bert_embeddings(*ids, word, pos, typ, w, b, 1e-12, dropout_p=0.1, seed=3, padding_idx=0),)

    want = grads_of(f, tables)
    buffers = {i: torch.full(want[i].shape, 0.5, device=DEVICE) for i in (0, 1)}
    got = grads_of(f, tables, buffers)
    assert got[0] is None and got[1] is None
    for i in (0, 1):
        torch.testing.assert_close(buffers[i], 0.5 + want[i], rtol=1e-5, atol=1e-5)
    for i in (2, 3, 4):
        torch.testing.assert_close(got[i], want[i], rtol=0, atol=0)
    assert torch.all(buffers[0][0] == 0.5)  # the padding row: nothing added
    got = grads_of(f, tables, {0: torch.zeros(50, 24, dtype=torch.float64, device=DEVICE)})
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # not an fp32 buffer: autograd's gradient


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the MLM head's kernels)")
@pytest.mark.parametrize("dtype,keep_elems", [(torch.float32, None), (torch.float32, 40 * 64), (torch.float16, None)])
def test_decoder_adds_its_weight_gradient_into_the_buffer(monkeypatch, dtype, keep_elems):
    """The decoder's weight gradient (the vocabulary's rows, not the padded ones) added by its GEMM, also when the
    rows go in chunks recomputed in the backward; in fp16 (the mean's 1 / n applied after the GEMM) added after it."""
    if keep_elems is not None:
        monkeypatch.setattr(mlm_loss, "_KEEP_ELEMS", keep_elems)
    vocab = 70  # padded to 128 columns
    h, dw, db, lw, lb, decw, decb = leaves((97, 16), (16, 16), (16,), (16,), (16,), (vocab, 16), (vocab,), seed=8,
                                           dtype=dtype)
    labels = torch.randint(0, vocab, (97,), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    labels[::3] = -100

    def f(*t):
        return (mlm_loss.sparse_mlm_loss(t[0], labels, *t[1:5], 1e-12, *t[5:])[0],)

    params = (h, dw, db, lw, lb, decw, decb)
    want = grads_of(f, params)
    buf = torch.full((vocab, 16), 0.5, device=DEVICE)
    got = grads_of(f, params, {5: buf})
    assert got[5] is None
    tol = 1e-5 if dtype == torch.float32 else 1e-3  # fp16: want rounded to fp16 (half an ulp: 2^-12 relative)
    torch.testing.assert_close(buf, 0.5 + want[5].float(), rtol=tol, atol=tol)
    for i in (0, 1, 2, 3, 4, 6):
        torch.testing.assert_close(got[i], want[i], rtol=0, atol=0)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the model's kernels)")
def test_tied_word_table_and_decoder_add_into_one_buffer():
    """A whole MLM model with every parameter's buffer, as ``training/cuda_graphs.py`` captures it: the word table,
    tied to the decoder, gets both gradients added into its buffer and autograd hands back none for it (no zeroed
    table-sized gradient, no addition of the two, no pass adding their sum into the buffer); every buffer ends as
    ``before`` plus the gradient autograd gives without buffers."""
    torch.manual_seed(0)
    cfg = BertConfig.preset("tiny", vocab_size=100, max_position_embeddings=32, sparse_prediction=True)
    model = BertForMaskedLM(cfg).to(DEVICE).set_kernels("triton").train()
    g = torch.Generator().manual_seed(10)
    ids = torch.randint(1, 100, (3, 12), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = torch.where(torch.rand(3, 12, generator=g).to(DEVICE) < 0.3, ids, -100).masked_fill(mask == 0, -100)
    labels[0, 0] = ids[0, 0]
    params = [p for p in model.parameters() if p.requires_grad]
    word = model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.weight is word

    def loss():
        torch.manual_seed(1)  # the same dropout draws both times
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    want = torch.autograd.grad(loss(), params)
    before = [torch.randn(p.shape, generator=g).to(DEVICE) for p in params]
    buffers = [b.clone() for b in before]
    with grad_accum.accumulating(dict(zip(params, buffers))):
        out = loss()
    got = torch.autograd.grad(out, params, allow_unused=True)
    assert got[[i for i, p in enumerate(params) if p is word][0]] is None
    for p, w, b0, buf, gr in zip(params, want, before, buffers, got):
        if gr is not None:
            buf += gr
        torch.testing.assert_close(buf, b0 + w, rtol=1e-5, atol=1e-5)


def test_no_buffer_outside_the_context_and_for_other_tensors():
    w, other = leaves((4, 8), (4, 8))
    buf = torch.zeros_like(w)
    assert grad_accum.buffer_for(w) is None
    with grad_accum.accumulating({w: buf}):
        assert grad_accum.buffer_for(w) is buf
        assert grad_accum.buffer_for(w, buf.dtype) is buf and grad_accum.buffer_for(w, torch.float16) is None
        assert grad_accum.buffer_for(other) is None and grad_accum.buffer_for(None) is None
        assert grad_accum.buffer_for(w.detach()) is None   # the parameter itself, not a tensor sharing it
        with pytest.raises(RuntimeError, match="does not nest"):
            with grad_accum.accumulating({}):
                pass
    assert grad_accum.buffer_for(w) is None


def test_rejects_a_buffer_of_another_shape():
    (w,) = leaves((4, 8))
    with pytest.raises(ValueError, match=r"buffer of a \(4, 8\) parameter"):
        with grad_accum.accumulating({w: torch.zeros(8, 4, device=DEVICE)}):
            pass
    assert grad_accum.buffer_for(w) is None


def test_backward_ops_declare_the_buffer_written():
    g = torch.Generator().manual_seed(2)
    x, w1, b1, w2, dy = (torch.randn(*s, generator=g).to(DEVICE) for s in ((7, 16), (24, 16), (24,), (16, 24), (7, 16)))
    z = x @ w1.t() + b1
    y = torch.nn.functional.gelu(z)
    torch.library.opcheck(torch.ops.fastbert.ffn_bwd.default,
                          (dy, dy, x, w1, b1, w2, y, z, "none", torch.float32, torch.zeros_like(w1), None))
    torch.library.opcheck(torch.ops.fastbert.linear_residual_bwd.default,
                          (dy, None, y, w2, True, torch.float32, torch.zeros_like(w2)))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the kernels)")
def test_embedding_and_decoder_backward_ops_declare_the_buffers_written():
    g = torch.Generator().manual_seed(11)
    ids = [torch.randint(0, n, (9,), generator=g).to(DEVICE) for n in (20, 8, 2)]
    word, pos, typ = (torch.randn(n, 16, generator=g).to(DEVICE) for n in (20, 8, 2))
    ln_w, dy = torch.ones(16, device=DEVICE), torch.randn(9, 16, generator=g).to(DEVICE)
    mean, rstd = torch.zeros(9, device=DEVICE), torch.ones(9, device=DEVICE)
    torch.library.opcheck(torch.ops.fastbert.bert_embeddings_bwd.default,
                          (dy, *ids, word, pos, typ, ln_w, mean, rstd, 0.0, None, 0, torch.zeros_like(word),
                           torch.zeros_like(pos)))
    h, w = torch.randn(9, 16, generator=g).to(DEVICE), torch.randn(64, 16, generator=g).to(DEVICE)
    labels = torch.randint(0, 50, (9,), generator=g).to(DEVICE)
    _, _, dl = torch.ops.fastbert.linear_cross_entropy_fwd(h, w, torch.zeros(64, device=DEVICE), labels, 50)
    torch.library.opcheck(torch.ops.fastbert.linear_cross_entropy_bwd.default,
                          (torch.ones((), device=DEVICE), h, w, torch.zeros(64, device=DEVICE), labels, dl, 50,
                           torch.float32, torch.float32, torch.zeros(50, 16, device=DEVICE)))


# ------------------------------------------------------------------------------------------ on the GPU
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_accumulate_adds_in_the_gemm(dtype):
    """``c += a @ b`` in place, a (out, tokens) column-major view as a weight gradient's ``dyᵀ`` is."""
    g = torch.Generator().manual_seed(4)
    dy = torch.randn(4096, 768, generator=g).to("cuda", dtype)
    x = torch.randn(4096, 1024, generator=g).to("cuda", dtype)
    c = torch.randn(768, 1024, generator=g).cuda()
    want = c.double() + dy.double().t() @ x.double()
    ptr = c.data_ptr()
    assert cublaslt.accumulate(c, dy.t(), x)
    assert c.data_ptr() == ptr
    # fp32 accumulation over 4096 products of unit size: ~1e-5 relative; the result is ~64 in size
    torch.testing.assert_close(c.double(), want, rtol=1e-4, atol=1e-3)
    assert not cublaslt.accumulate(c.bfloat16(), dy.t(), x)   # the buffer must be fp32
    assert not cublaslt.accumulate(c.t(), dy.t(), x.t().contiguous().t()[:, :768])  # not contiguous / shapes


@gpu
@needs_cuda
def test_gpu_accumulate_fp8():
    """The FP8 weight-gradient GEMM (e5m2 gradient x e4m3 input, scales read from the device) adding into an
    fp32 buffer: ``torch._scaled_mm``'s fp32 result plus the buffer, within fp32 rounding."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89 or newer")
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(768, 4096, generator=g) * 4).to("cuda", torch.float8_e5m2)        # (out, tokens)
    b = torch.randn(1024, 4096, generator=g).to("cuda", torch.float8_e4m3fn).t()       # (tokens, in), col-major
    sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([0.25], device="cuda")
    c = torch.randn(768, 1024, generator=g).cuda()
    want = c + torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert cublaslt.accumulate(c, a, b, sa, sb)
    torch.testing.assert_close(c, want, rtol=1e-5, atol=1e-3)


@gpu
@needs_cuda
def test_gpu_linear_and_ffn_master_weights_accumulate():
    """fp32 parameters under bf16 autocast at a BERT shape, as the training step runs them: the buffers end as
    before + the gradients the ops return without them."""
    x, w, b = leaves((4096, 1024), (3072, 1024), (3072,), device="cuda")
    want = grads_of(linear, (x, w, b), cast=torch.bfloat16)
    buf = torch.ones_like(w)
    got = grads_of(linear, (x, w, b), {1: buf}, cast=torch.bfloat16)
    assert got[1] is None
    torch.testing.assert_close(buf, 1 + want[1], rtol=1e-5, atol=1e-5)
    x, w1, b1, w2 = leaves((4096, 1024), (4096, 1024), (4096,), (1024, 4096), device="cuda")

    def f(*t):
        return (ffn(*t),)

    want = grads_of(f, (x, w1, b1, w2), cast=torch.bfloat16)
    bufs = {1: torch.ones_like(w1), 3: torch.ones_like(w2)}
    got = grads_of(f, (x, w1, b1, w2), bufs, cast=torch.bfloat16)
    assert got[1] is None and got[3] is None
    for i in (1, 3):
        torch.testing.assert_close(bufs[i], 1 + want[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
