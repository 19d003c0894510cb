"""cuBLASLt GEMMs with epilogues (fastbert/ops/cublaslt.py).

On the CPU: the row-major -> column-major mapping (`plan`) is run through an emulation of cuBLASLt's
semantics (column-major storage read through the plan's transposes and leading dimensions; the bias and
aux as cuBLASLt's documentation defines them) and must give the row-major result,
for every mix of row- and column-contiguous operands. On the GPU: the real library against torch.
"""
import pytest
import torch
import torch.nn.functional as F

from fastbert.ops import cublaslt

TANH = "tanh"


def gelu_grad_tanh(z):
    z = z.detach().double().requires_grad_()
    (g,) = torch.autograd.grad(F.gelu(z, approximate=TANH).sum(), z)
    return g


def colmajor(t, rows, cols, ld):
    """The (rows, cols) column-major matrix with leading dimension ``ld`` at ``t``'s first element."""
    return torch.as_strided(t, (rows, cols), (1, ld), t.storage_offset())


def emulate(a, b, epilogue, bias=None, aux=None, c=None):
    """D row-major, as cuBLASLt computes it for the plan of ``a @ b`` (``aux`` written or read; ``c``
    added with beta = 1, in D's layout)."""
    p = cublaslt.plan(a, b)
    A = colmajor(b, *((p.k, p.m) if p.trans_a else (p.m, p.k)), p.lda)  # cuBLASLt's A is b
    B = colmajor(a, *((p.n, p.k) if p.trans_b else (p.k, p.n)), p.ldb)  # and its B is a
    d = (A.t() if p.trans_a else A) @ (B.t() if p.trans_b else B)      # (m, n) column-major
    if c is not None:
        d = d + colmajor(c, p.m, p.n, p.ldd)                            # C: D's layout
    if epilogue.endswith("_bias"):
        d = d + bias[:, None]                           # bias: one value per row of column-major D
    if epilogue.startswith("gelu_aux"):
        colmajor(aux, p.m, p.n, p.ldd).copy_(d)         # aux: D's layout, leading dimension AUX_LD
    if epilogue.startswith("gelu"):
        d = F.gelu(d, approximate=TANH)
    if epilogue == "dgelu":
        d = d * gelu_grad_tanh(colmajor(aux, p.m, p.n, p.ldd))
    return d.t()                                        # column-major (m, n) is row-major (n, m)


def operand(rows, cols, transposed, g):
    """A (rows, cols) row-major view: contiguous, or the transpose of a contiguous (cols, rows) tensor,
    both inside a wider allocation (leading dimension > the minimum)."""
    if transposed:
        return torch.randn(cols, rows + 3, generator=g, dtype=torch.float64)[:, :rows].t()
    return torch.randn(rows, cols + 5, generator=g, dtype=torch.float64)[:, :cols]


EPILOGUES = ["default", "gelu", "gelu_bias", "gelu_aux", "gelu_aux_bias", "dgelu"]


def expected(ab, epilogue, bias, aux_in, c=None):
    """(D, aux after the call) in plain row-major math."""
    if epilogue == "default":
        return (ab + c if c is not None else ab), aux_in
    z = ab + bias if epilogue.endswith("_bias") else ab
    if epilogue == "dgelu":
        return ab * gelu_grad_tanh(aux_in), aux_in
    return F.gelu(z, approximate=TANH), (z if epilogue.startswith("gelu_aux") else aux_in)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_plan_matches_row_major_math(ta, tb, epilogue):
    g = torch.Generator().manual_seed(7)
    m, k, n = 13, 9, 11
    a, b = operand(m, k, ta, g), operand(k, n, tb, g)
    bias = torch.randn(n, generator=g, dtype=torch.float64)
    aux = torch.randn(m, n, generator=g, dtype=torch.float64)
    c = torch.randn(m, n, generator=g, dtype=torch.float64) if epilogue == "default" else None
    want, want_aux = expected(a @ b, epilogue, bias, aux.clone(), c)
    torch.testing.assert_close(emulate(a, b, epilogue, bias=bias, aux=aux, c=c), want)
    torch.testing.assert_close(aux, want_aux)  # gelu_aux*: the pre-activation, row-major (M, N)


def test_plan_rejects_other_layouts():
    x = torch.randn(8, 16)
    assert cublaslt.plan(x[:, ::2], torch.randn(8, 8)) is None
    assert cublaslt.plan(x, torch.randn(8, 8)) is None  # inner sizes differ
    with pytest.raises(ValueError, match="row- or column-contiguous"):
        cublaslt.gemm(x[:, ::2], torch.randn(8, 8), "gelu")
    with pytest.raises(ValueError, match="c must be"):
        cublaslt.gemm(x, torch.randn(16, 8), "gelu", c=torch.randn(8, 8))
    torch.testing.assert_close(cublaslt.addmm(torch.ones(8, 8), x, torch.randn(16, 8, generator=None).fill_(1)),
                               1 + x.sum(1, keepdim=True).expand(8, 8))  # off the GPU: torch.addmm


def test_not_eligible_off_gpu_or_off_rules():
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    assert not cublaslt.eligible(x, x)  # CPU tensors
    if torch.cuda.is_available():
        c = x.cuda()
        assert not cublaslt.eligible(c, c.float())   # mixed dtypes
        assert not cublaslt.eligible(c[:, :12], c)  # a size off the multiple of 8
        assert not cublaslt.eligible(c, sizes=(12,))
        assert not cublaslt.eligible(c[:0], c)  # no tokens


# ------------------------------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("ta,tb", [(False, True), (False, False), (True, False), (True, True)])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_torch(ta, tb, epilogue, dtype):
    g = torch.Generator().manual_seed(3)
    m, k, n = 1000, 1024, 4096

    def make(rows, cols, transposed, scale):
        t = torch.randn(cols, rows, generator=g).t() if transposed else torch.randn(rows, cols, generator=g)
        return (t * scale).to("cuda", dtype)

    a, b = make(m, k, ta, 1.0), make(k, n, tb, k ** -0.5)
    bias = torch.randn(n, generator=g).to("cuda", dtype)
    aux = torch.randn(m, n, generator=g).to("cuda", dtype)
    c = torch.randn(m, n, generator=g).to("cuda", dtype) if epilogue == "default" else None
    want, want_aux = expected(a.double() @ b.double(), epilogue, bias.double(), aux.double(),
                              c.double() if c is not None else None)
    assert cublaslt.eligible(a, b, bias, aux)
    out = cublaslt.gemm(a, b, epilogue, bias=bias, aux=aux, c=c)
    assert out is not None, "cuBLASLt offered no algorithm"
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(aux.double(), want_aux, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_graph_capture_replays():
    """A captured cuBLASLt GEMM replays with the inputs' new values (descriptors made before capture)."""
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    aux = torch.empty(256, 768, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(aux)
    cublaslt.gemm(a, b, "gelu_aux_bias", bias=bias, aux=aux, out=out)  # warm: descriptors, algorithm
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        cublaslt.gemm(a, b, "gelu_aux_bias", bias=bias, aux=aux, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    z = a.float() @ b.float() + bias.float()
    torch.testing.assert_close(aux.float(), z, atol=0.3, rtol=2e-2)
    torch.testing.assert_close(out.float(), F.gelu(z, approximate=TANH), atol=0.3, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_gpu_scaled_addmm_matches_scaled_mm_plus_c(a_dtype):
    """The FP8 GEMM with the added matrix read by the GEMM: ``_scaled_mm``'s result plus c, within the one
    bf16 rounding the separate addition adds; the scales are read from the device at each call."""
    g = torch.Generator().manual_seed(4)
    m, k, n = 512, 1024, 768
    a = (torch.randn(m, k, generator=g) * 4).to("cuda", a_dtype)
    b = (torch.randn(n, k, generator=g) * 8).to("cuda", torch.float8_e4m3fn).t()  # column-major view, as W^T
    c = torch.randn(m, n, generator=g).to("cuda", torch.bfloat16)
    sa, sb = torch.tensor(0.01, device="cuda"), torch.tensor(0.02, device="cuda")
    out = cublaslt.scaled_addmm(c, a, b, sa, sb)
    assert out is not None, "cuBLASLt offered no algorithm"
    want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32) + c.float()
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    sb.fill_(0.04)  # same pointer, new value: the GEMM reads it
    want2 = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32) + c.float()
    torch.testing.assert_close(cublaslt.scaled_addmm(c, a, b, sa, sb).float(), want2, rtol=1e-2, atol=1e-2)
    assert cublaslt.scaled_addmm(c, a, b.t().contiguous(), sa, sb) is None  # b row-major: not cuBLASLt's FP8 TN
