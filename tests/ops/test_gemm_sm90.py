"""The FFN's GEMMs with the exact GELU in CUTLASS sm_90a epilogues (fastbert/ops/gemm_sm90.py).

On the CPU: when the library is not eligible (CPU tensors, disabled, another dtype, a last size that is not a
multiple of 8) nothing calls it and the FFN is unchanged. On an sm_90 GPU with the library built: every launch
shape's y = gelu(z), g = gelu'(z) (what the forward keeps for the backward), dz = (d @ w2) * g and d(bias)
against float64, within 1.5x the error torch's bf16 GEMM + F.gelu make on the same inputs (the kernels apply GELU
and its derivative to the fp32 accumulator, where torch rounds z to bf16 first, so their error is at most torch's;
1.5x leaves room for a different summation order) plus 2^-9 of the largest |value| (one bf16 rounding); the FFN's
output and every gradient with and without the library, and the model's FFN backward when the library's
derivative meets a backward that cannot use it; a CUDA graph replaying the kernels with new inputs. The library
built from an older csrc (it stored z) is refused, not misread.
"""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastbert.ops import gemm_sm90
from fastbert.ops.ffn import ffn, ffn_ref, gelu_grad_ref, linear_bias_gelu, linear_bias_gelu_ref


def close(out, torch_out, ref):
    ref = ref.double()
    err = (out.double() - ref).abs().max().item()
    err_torch = (torch_out.double() - ref).abs().max().item()
    assert err <= 1.5 * err_torch + 2 ** -9 * ref.abs().max().item(), (err, err_torch)


def test_not_eligible_on_the_cpu_or_when_disabled(monkeypatch):
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    assert not gemm_sm90.eligible(x, x)
    assert not gemm_sm90.eligible()
    assert not gemm_sm90.eligible(x, None)
    monkeypatch.setattr(gemm_sm90, "ENABLED", False)
    assert not gemm_sm90.eligible(x, x)
    assert gemm_sm90.ready() == "FASTBERT_GEMM_SM90=0"


def test_library_path_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTBERT_GEMM_SM90", str(tmp_path / "lib.so"))
    assert gemm_sm90.library_path() == tmp_path / "lib.so"
    monkeypatch.setenv("FASTBERT_GEMM_SM90", "0")  # "0" switches it off; it is not a path
    assert gemm_sm90.library_path().name.startswith("_gemm_sm90")


def test_a_library_of_another_abi_is_refused():
    class Old:  # built before fb_sm90_abi existed: its bias_gelu stored z
        pass

    class New:
        def fb_sm90_abi(self):
            return gemm_sm90.ABI

    with pytest.warns(UserWarning, match="rebuild it"):
        assert not gemm_sm90._abi_ok(Old(), Path("old.so"))
    assert gemm_sm90._abi_ok(New(), Path("new.so"))


def test_the_up_projection_launch_shape_follows_k(monkeypatch):
    """v2 from K = 1,024 on, v0 below (measured in the step, gemm_sm90.VARIANT); a set VARIANT wins; bias_gelu passes
    the library the shape for its own K."""
    monkeypatch.setitem(gemm_sm90.VARIANT, "bias_gelu", None)
    assert [gemm_sm90.forward_variant(k) for k in (64, 768, 1023, 1024, 4096)] == [0, 0, 0, 2, 2]
    monkeypatch.setitem(gemm_sm90.VARIANT, "bias_gelu", 4)
    assert gemm_sm90.forward_variant(768) == gemm_sm90.forward_variant(1024) == 4

    class Lib:
        def fb_sm90_bias_gelu(self, *args):
            self.variant = args[-2]
            return 0

    lib = Lib()
    monkeypatch.setitem(gemm_sm90._LIB, "lib", lib)
    monkeypatch.setattr(gemm_sm90, "raw_stream", lambda device: 0)
    monkeypatch.setitem(gemm_sm90.VARIANT, "bias_gelu", None)
    for k, v in ((768, 0), (1024, 2)):
        gemm_sm90.bias_gelu(torch.zeros(8, k, dtype=torch.bfloat16), torch.zeros(16, k, dtype=torch.bfloat16),
                            torch.zeros(16, dtype=torch.bfloat16))
        assert lib.variant == v


def _sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    why = gemm_sm90.ready()
    if why:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1000, 1024, 4096), (96, 40, 72), (4096, 768, 3072)])
def test_gpu_every_variant_matches_float64(m, k, n):
    _sm90()
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", torch.bfloat16)
    b = (torch.randn(n, generator=g) * 0.1).to("cuda", torch.bfloat16)
    d = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
    w2 = (torch.randn(k, n, generator=g) * n ** -0.5).to("cuda", torch.bfloat16)
    z_ref = F.linear(x.double(), w.double(), b.double())
    z_t = F.linear(x, w, b)
    g_t = gelu_grad_ref(z_t).bfloat16()  # gelu'(z) as the backward reads it
    dz_ref = (d.double() @ w2.double()) * g_t.double()
    dz_t = ((d @ w2).float() * g_t.float()).bfloat16()
    default = dict(gemm_sm90.VARIANT)
    try:
        for v in range(gemm_sm90.variants()):
            gemm_sm90.VARIANT.update(bias_gelu=v, dgelu=v)
            y, gz = gemm_sm90.bias_gelu(x, w, b)
            close(y, F.gelu(z_t), F.gelu(z_ref))
            close(gz, g_t, gelu_grad_ref(z_ref))
            dz, db = gemm_sm90.dgelu(d, w2, g_t)
            close(dz, dz_t, dz_ref)
            close(db, dz_t.float().sum(0), dz_ref.sum(0))
    finally:
        gemm_sm90.VARIANT.update(default)


@pytest.mark.gpu
def test_gpu_ffn_with_and_without_the_library(monkeypatch):
    """The FFN's output and every gradient: with the library against float64 within the tolerance above, the
    bf16 path without it as the torch-side error."""
    _sm90()
    g = torch.Generator().manual_seed(5)
    m, k, n = 2048, 1024, 4096
    base = [torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5,
            torch.randn(n, generator=g) * 0.1, torch.randn(k, n, generator=g) * n ** -0.5]
    dy = torch.randn(m, k, generator=g).cuda()
    with_and_without(monkeypatch, ffn, ffn_ref, base, dy)


def with_and_without(monkeypatch, fn, fn_ref, base, dy):
    """``fn``'s output and every input gradient on bf16 copies of ``base`` with the library against ``fn_ref`` in
    float64, within ``close``'s tolerance of the bf16 run without the library."""
    def run(dtype, enabled):
        monkeypatch.setattr(gemm_sm90, "ENABLED", enabled)
        ins = [t.to("cuda", dtype).requires_grad_() for t in base]
        out = (fn if dtype != torch.float64 else fn_ref)(*ins)
        return [out, *torch.autograd.grad(out, ins, dy.to(dtype))]

    ref = run(torch.float64, False)
    without, with_ = run(torch.bfloat16, False), run(torch.bfloat16, True)
    for a, b, r in zip(with_, without, ref):
        close(a, b, r)


@pytest.mark.gpu
def test_gpu_linear_bias_gelu_with_and_without_the_library(monkeypatch):
    """The up-projection alone (its backward is the Triton GELU pass, reading the derivative the library's forward
    kept): output and every gradient as in the FFN test."""
    _sm90()
    g = torch.Generator().manual_seed(6)
    base = [torch.randn(1536, 768, generator=g), torch.randn(3072, 768, generator=g) * 768 ** -0.5,
            torch.randn(3072, generator=g) * 0.1]
    dy = torch.randn(1536, 3072, generator=g).cuda()
    with_and_without(monkeypatch, linear_bias_gelu, linear_bias_gelu_ref, base, dy)


@pytest.mark.gpu
def test_gpu_ffn_backward_that_cannot_take_the_library_reads_the_kept_derivative():
    """The forward keeps gelu'(z) (the library's epilogue); a backward whose operands the library cannot take (here
    an upstream gradient at an odd address) multiplies by it in the Triton pass: the same gradients within bf16
    rounding, and the kept tensor is gelu'(z), not z."""
    _sm90()
    g = torch.Generator().manual_seed(7)
    m, k, n = 1024, 1024, 4096
    x, w1, b1, w2 = (t.to("cuda", torch.bfloat16) for t in (
        torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5,
        torch.randn(n, generator=g) * 0.1, torch.randn(k, n, generator=g) * n ** -0.5))
    out, y, kept = torch.ops.fastbert.ffn_fwd(x, w1, b1, w2, "none", True)
    z = F.linear(x.double(), w1.double(), b1.double())
    close(kept, gelu_grad_ref(F.linear(x, w1, b1)).bfloat16(), gelu_grad_ref(z))
    flat = torch.randn(m * k + 1, generator=g).to("cuda", torch.bfloat16)
    dout, odd = flat[:-1].view(m, k), flat[1:].view(m, k)  # odd: 2 bytes past 16-byte alignment
    odd_copy = odd.clone()
    assert gemm_sm90.eligible(dout, w2, kept) and not gemm_sm90.eligible(odd, w2, kept)
    args = (None, x, w1, b1, w2, y, kept, "none", torch.float32, None, None)
    fused = torch.ops.fastbert.ffn_bwd(odd_copy, *args)
    fallback = torch.ops.fastbert.ffn_bwd(odd, *args)
    for a, b in zip(fallback, fused):
        scale = b.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= 2 ** -6 * scale


@pytest.mark.gpu
def test_gpu_graph_capture_replays():
    _sm90()
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    gemm_sm90.bias_gelu(x, w, b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y, g = gemm_sm90.bias_gelu(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    z = F.linear(x, w, b).float()
    torch.testing.assert_close(y, F.gelu(z).bfloat16(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g, gelu_grad_ref(z).bfloat16(), rtol=2e-2, atol=2e-2)
