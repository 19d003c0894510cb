"""Helpers shared by the fused-op tests (test_ffn, test_layer_norm, test_embeddings, test_mlm_loss):
the device, the per-dtype tolerance rule, and the torch.compile check of a custom op.

The tolerance rule (flash-attn's): the kernel's error against an fp64 reference must stay within
2x the error of torch's own same-dtype computation plus a small atol, so the tolerance follows from
the dtype instead of being picked per test.
"""
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def assert_within(name, out, same, ref, dtype):
    """|out - ref| <= 2 |same - ref| + atol * max(1, |ref|), elementwise maxima."""
    ref = ref.double()
    err = (out.double() - ref).abs().max().item()
    err_same = (same.double() - ref).abs().max().item()
    atol = ATOL[dtype] * max(1.0, ref.abs().max().item())
    assert err <= 2 * err_same + atol, f"{name}: kernel err {err:.3g} > 2 * torch err {err_same:.3g} + {atol:.3g}"


def assert_compiled_matches_eager(f, tensors):
    """``f(*tensors)`` (a scalar loss) under ``torch.compile(fullgraph=True)`` must give the eager
    loss and the eager gradient of every tensor. Returns the eager loss (for further checks)."""
    eager = [t.clone().requires_grad_() for t in tensors]
    comp = [t.clone().requires_grad_() for t in tensors]
    le = f(*eager)
    lc = torch.compile(f, backend="aot_eager", fullgraph=True)(*comp)
    torch.testing.assert_close(lc, le)
    for a, c in zip(torch.autograd.grad(le, eager), torch.autograd.grad(lc, comp)):
        torch.testing.assert_close(c, a)
    return le
