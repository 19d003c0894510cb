"""cuBLASLt GEMMs with epilogues (fastbert/ops/cublaslt.py).

On the CPU: the row-major -> column-major mapping (`plan`) is run through an emulation of cuBLASLt's
semantics (column-major storage read through the plan's transposes and leading dimensions; the bias, aux
and bias-gradient vectors as cuBLASLt's documentation defines them) and must give the row-major result,
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


def emulate(a, b, epilogue, bias=None, aux=None):
    """(D row-major, vector) as cuBLASLt computes them for the plan of ``a @ b``."""
    p = cublaslt.plan(a, b)
    A = colmajor(b, *((p.k, p.m) if p.trans_a else (p.m, p.k)), p.lda)  # cuBLASLt's A is b
    B = colmajor(a, *((p.n, p.k) if p.trans_b else (p.k, p.n)), p.ldb)  # and its B is a
    op_a, op_b = (A.t() if p.trans_a else A), (B.t() if p.trans_b else B)
    d = op_a @ op_b                                     # (m, n) column-major
    vector = None
    if epilogue in ("bias", "gelu_bias", "gelu_aux_bias"):
        d = d + bias[:, None]                           # bias: one value per row of column-major D
    if epilogue.startswith("gelu_aux"):
        colmajor(aux, p.m, p.n, p.ldd).copy_(d)         # aux: D's layout, leading dimension AUX_LD
    if epilogue.startswith("gelu"):
        d = F.gelu(d, approximate=TANH)
    if epilogue.startswith("dgelu"):
        d = d * gelu_grad_tanh(colmajor(aux, p.m, p.n, p.ldd))
        vector = d.sum(1)                               # bias gradient: reduce over D's columns
    if epilogue == "bgrad_a":
        vector = op_b.sum(0)                            # BGRADB: B reduced over the GEMM's k
    return d.t(), vector                                # column-major (m, n) is row-major (n, m)


def operand(rows, cols, transposed, g):
    """A (rows, cols) row-major view: contiguous, or the transpose of a contiguous (cols, rows) tensor,
    both inside a wider allocation (leading dimension > the minimum)."""
    if transposed:
        return torch.randn(cols, rows + 3, generator=g, dtype=torch.float64)[:, :rows].t()
    return torch.randn(rows, cols + 5, generator=g, dtype=torch.float64)[:, :cols]


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("epilogue", ["none", "bias", "gelu_bias", "gelu_aux_bias", "dgelu_bgrad", "bgrad_a"])
def test_plan_matches_row_major_math(ta, tb, epilogue):
    g = torch.Generator().manual_seed(7)
    m, k, n = 13, 9, 11
    a, b = operand(m, k, ta, g), operand(k, n, tb, g)
    bias = torch.randn(n, generator=g, dtype=torch.float64)
    aux = torch.randn(m, n, generator=g, dtype=torch.float64)
    aux_in = aux.clone()
    d, vector = emulate(a, b, epilogue, bias=bias, aux=aux)
    ab = a @ b
    if epilogue in ("none", "bgrad_a"):
        torch.testing.assert_close(d, ab)
    elif epilogue == "bias":
        torch.testing.assert_close(d, ab + bias)
    elif epilogue in ("gelu_bias", "gelu_aux_bias"):
        torch.testing.assert_close(d, F.gelu(ab + bias, approximate=TANH))
        if epilogue == "gelu_aux_bias":
            torch.testing.assert_close(aux, ab + bias)  # the pre-activation, row-major (M, N)
    elif epilogue == "dgelu_bgrad":
        want = ab * gelu_grad_tanh(aux_in)
        torch.testing.assert_close(d, want)
        torch.testing.assert_close(vector, want.sum(0))  # d(bias): one per column of row-major D
    if epilogue == "bgrad_a":
        torch.testing.assert_close(vector, a.sum(1))     # the weight-gradient GEMM's bias gradient


def test_plan_rejects_other_layouts():
    x = torch.randn(8, 16)
    assert cublaslt.plan(x[:, ::2], torch.randn(8, 8)) is None
    assert cublaslt.plan(x, torch.randn(8, 8)) is None  # inner sizes differ
    with pytest.raises(ValueError, match="row- or column-contiguous"):
        cublaslt.gemm(x[:, ::2], torch.randn(8, 8))


def test_not_eligible_off_gpu_or_off_rules():
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    assert not cublaslt.eligible(x, x)  # CPU tensors
    if torch.cuda.is_available():
        c = x.cuda()
        assert not cublaslt.eligible(c, c.float())   # mixed dtypes
        assert not cublaslt.eligible(c[:, :12], c)  # a size off the multiple of 8
        assert not cublaslt.eligible(c, sizes=(12,))


# ------------------------------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("ta,tb", [(False, True), (False, False), (True, False), (True, True)])
@pytest.mark.parametrize("epilogue", ["none", "bias", "gelu_bias", "gelu_aux_bias", "dgelu_bgrad", "bgrad_a"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_torch(ta, tb, epilogue, dtype):
    g = torch.Generator().manual_seed(3)
    m, k, n = 1000, 1024, 4096 if epilogue != "bgrad_a" else 1024

    def make(rows, cols, transposed, scale):
        t = torch.randn(cols, rows, generator=g).t() if transposed else torch.randn(rows, cols, generator=g)
        return (t * scale).to("cuda", dtype)

    a, b = make(m, k, ta, 1.0), make(k, n, tb, k ** -0.5)
    bias = torch.randn(n, generator=g).to("cuda", dtype)
    aux = torch.randn(m, n, generator=g).to("cuda", dtype)
    aux_in = aux.clone()
    vec = torch.empty(m if epilogue == "bgrad_a" else n, device="cuda", dtype=dtype)
    assert cublaslt.eligible(a, b, bias, aux)
    out = cublaslt.gemm(a, b, epilogue, bias=bias, aux=aux, bias_grad=vec)
    if out is None and epilogue == "bgrad_a" and not ta:
        return  # H100, cuBLAS 13: BGRADB only with cuBLASLt's B transposed (a column-contiguous, as d(out).t())
    assert out is not None, "cuBLASLt offered no algorithm"
    ab = a.double() @ b.double()
    tol = dict(atol=2e-2, rtol=2e-2)
    if epilogue in ("none", "bgrad_a"):
        torch.testing.assert_close(out.double(), ab, **tol)
    elif epilogue == "bias":
        torch.testing.assert_close(out.double(), ab + bias.double(), **tol)
    elif epilogue.startswith("gelu"):
        torch.testing.assert_close(out.double(), F.gelu(ab + bias.double(), approximate=TANH), **tol)
        if epilogue == "gelu_aux_bias":
            torch.testing.assert_close(aux.double(), ab + bias.double(), **tol)
    else:
        want = ab * gelu_grad_tanh(aux_in)
        torch.testing.assert_close(out.double(), want, **tol)
        torch.testing.assert_close(vec.double(), want.sum(0), atol=0.5, rtol=2e-2)  # 1000-term bf16 sums
    if epilogue == "bgrad_a":
        torch.testing.assert_close(vec.double(), a.double().sum(1), atol=0.5, rtol=2e-2)


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
