"""The FP8 linears' weight casts kept for an optimizer step (ops/fp8.weight_fp8 through ops/weight_casts.derived):
with a WeightCasts made with ``derived=True`` active (training's, when a step accumulates micro-batches) a weight's
codes, transpose and scale are made once and reused by later forwards, every refresh remakes them in the same
buffers from the weight's own amax of that moment, and nothing is kept otherwise (the cast then runs in every
forward, with the delayed scale)."""
import pytest
import torch
import torch.nn.functional as F

import fastbert.ops.fp8 as fp8
from fastbert.ops.fp8 import E4M3, FP8_MAX, HISTORY, AmaxHistory, fp8_ffn, fp8_linear
from fastbert.ops.weight_casts import WeightCasts

from ops_testing import DEVICE


def counting(monkeypatch, weights):
    """Count cast_fp8 calls on any of ``weights``."""
    calls = []
    real = fp8.cast_fp8

    def cast(x, *args, **kwargs):
        if any(x is w for w in weights):
            calls.append(x)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(fp8, "cast_fp8", cast)
    return calls


def linear_case(seed=3, t=32, k=64, n=48):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(DEVICE)
    w = torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.05).to(DEVICE))
    b = torch.nn.Parameter(torch.randn(n, generator=g).to(DEVICE))
    return x, w, b


def check_codes(made, w):
    """(w8, w8t, scale_inv) are w's e4m3 codes scaled by its own amax."""
    w8, w8t, sw = made
    amax = w.detach().abs().max()
    torch.testing.assert_close(sw, amax / FP8_MAX[E4M3])
    torch.testing.assert_close(w8.float() * sw, w.detach(), rtol=2 ** -3, atol=2 ** -9 * amax.item())
    assert torch.equal(w8t.view(torch.uint8), w8.view(torch.uint8).t().contiguous())


def test_kept_once_a_step_and_remade_by_refresh(monkeypatch):
    x, w, b = linear_case()
    h = AmaxHistory(3, DEVICE)
    casts = WeightCasts(derived=True)
    calls = counting(monkeypatch, [w])
    with casts.active():
        y1 = fp8_linear(x, w, b, h, 0)
        h.advance()
        y2 = fp8_linear(x, w, b, h, 0)
    assert len(calls) == 1 and torch.equal(y1, y2)          # the second forward reused the first's codes
    (made,) = [v[2] for v in casts._derived.values()]
    check_codes(made, w)
    buffers = [t.data_ptr() for t in made]
    with torch.no_grad():
        w.mul_(3.0)                                          # an optimizer step
    casts.refresh()
    assert len(calls) == 2 and [t.data_ptr() for t in made] == buffers   # remade in place
    check_codes(made, w)
    h.advance()
    with casts.active():
        y3 = fp8_linear(x, w, b, h, 0)
    assert len(calls) == 2
    torch.testing.assert_close(y3, F.linear(x, w, b), rtol=0.1, atol=0.1 * F.linear(x, w).abs().max().item())


def test_the_scale_outlives_the_history():
    """More micro-batches than HISTORY between refreshes: the forwards zero every slot of the weight's row, and the
    next refresh still scales by the weight's amax, not by 1."""
    x, w, b = linear_case(seed=5)
    h = AmaxHistory(3, DEVICE)
    casts = WeightCasts(derived=True)
    with casts.active():
        for _ in range(2 * HISTORY + 3):
            h.advance()
            fp8_linear(x, w, b, h, 0)
    assert h.amax[1].max() == 0                              # the weight's row: nothing since the first cast
    with torch.no_grad():
        w.mul_(0.5)
    casts.refresh()
    (made,) = [v[2] for v in casts._derived.values()]
    check_codes(made, w)


@pytest.mark.parametrize("derived", [False, True])
def test_nothing_kept_without_derived(monkeypatch, derived):
    """A WeightCasts without derived (one micro-batch a step), or none active: the cast in every forward, as before."""
    x, w, b = linear_case(seed=9)
    h = AmaxHistory(3, DEVICE)
    calls = counting(monkeypatch, [w])
    casts = WeightCasts(derived=False)
    with casts.active():
        fp8_linear(x, w, b, h, 0)
        fp8_linear(x, w, b, h, 0)
    fp8_linear(x, w, b, h, 0)
    assert len(calls) == 3 and not casts.keeps_derived
    if derived:   # an active derived WeightCasts does not keep a plain tensor's casts
        active = WeightCasts(derived=True)
        with active.active():
            fp8_linear(x, w.detach(), b, h, 0)
            fp8_linear(x, w.detach(), b, h, 0)
        assert not active._derived


def test_ffn_weights_kept_and_gradients_flow(monkeypatch):
    """The FFN's two weights are kept too, and with kept codes the gradients still reach x, W1, b1 and W2."""
    g = torch.Generator().manual_seed(11)
    t, hid, inner = 32, 64, 128
    x = torch.randn(t, hid, generator=g).to(DEVICE).requires_grad_()
    w1 = torch.nn.Parameter((torch.randn(inner, hid, generator=g) * hid ** -0.5).to(DEVICE))
    b1 = torch.nn.Parameter((torch.randn(inner, generator=g) * 0.1).to(DEVICE))
    w2 = torch.nn.Parameter((torch.randn(hid, inner, generator=g) * inner ** -0.5).to(DEVICE))
    h = AmaxHistory(6, DEVICE)
    casts = WeightCasts(derived=True)
    calls = counting(monkeypatch, [w1, w2])
    dy = torch.randn(t, hid, generator=g).to(DEVICE) * 1e-3
    grads = []
    with casts.active():
        for _ in range(2):
            h.advance()
            y = fp8_ffn(x, w1, b1, w2, h, 0)
            y.backward(dy)
            grads.append([p.grad.clone() for p in (x, w1, b1, w2)])
            for p in (x, w1, b1, w2):
                p.grad = None
    assert len(calls) == 2 and len(casts._derived) == 2       # each weight cast once
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    ref = [x.detach().clone().requires_grad_()] + [p.detach().clone().requires_grad_() for p in (w1, b1, w2)]
    F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2])), ref[3]).backward(dy)
    for got, want in zip(grads[1], [p.grad for p in ref]):
        assert (got - want).norm() <= 0.15 * want.norm(), ((got - want).norm(), want.norm())
