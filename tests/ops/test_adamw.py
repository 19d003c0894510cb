"""The one-launch AdamW that writes the weights' 16-bit copies (fastbert/ops/adamw.py) and the optimizer around it
(fastbert/training/optim.AdamW) against torch.optim.AdamW's for-loop step, in fp32.

Tolerances: the update (new weight minus old) is compared, not the weight, so that an error in the update's size
is not hidden by the weight's magnitude. The kernel takes the bias corrections as exp2(t log2 b) in fp32 where
torch's for-loop step takes b ** t in double, and orders its few fp32 operations differently: the updates agree
to ~10 fp32 ulps of the update (rtol 2e-5) plus the rounding of the new weight itself (atol: two ulps of the
largest weight, ~5e-5 of a typical update at lr 1e-2); a wrong decay, moment or bias correction is off by
~1e-3 of the update or more. The moments are the same two multiply-adds, rounded once or twice: rtol 4e-6 plus
two ulps of the largest (a first moment can cancel to near zero). A copy is the new weight cast to
its dtype by round to nearest even, as ``Tensor.to``: bit-equal (on the GPU; the CPU interpreter truncates to bf16,
the arithmetic the brief warns of, so there a bf16 copy is checked to within one bf16 step)."""
from __future__ import annotations

import copy
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastbert.ops import weight_casts
from fastbert.ops.adamw import CHUNK, adamw_reference_, adamw_step_
from fastbert.ops.weight_casts import WeightCasts
from fastbert.training.optim import AdamW
from ops_testing import DEVICE

SHAPES = [(1,), (7,), (3, 700), (CHUNK + 5,), (2, CHUNK + 1)]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-6, weight_decay=0.01)


def _tensors(seed=0, step=0.0, copies=(torch.bfloat16, None, torch.float16, torch.bfloat16, None)):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g).to(DEVICE) for s in SHAPES]
    grads = [torch.randn(s, generator=g).to(DEVICE) * 0.1 for s in SHAPES]
    m = [torch.randn(s, generator=g).to(DEVICE) * 0.01 for s in SHAPES]
    v = [torch.rand(s, generator=g).to(DEVICE) * 1e-3 for s in SHAPES]
    steps = [torch.full((), step, device=DEVICE) for _ in SHAPES]
    cs = [torch.zeros(s, dtype=d, device=DEVICE) if d is not None else None for s, d in zip(SHAPES, copies)]
    return [params, grads, m, v, steps, cs]


def _assert_copy(c, p):
    """``c`` is ``p`` cast to ``c``'s dtype (see the module docstring for bf16 on the CPU)."""
    if DEVICE == "cuda" or c.dtype != torch.bfloat16:
        assert torch.equal(c, p.detach().to(c.dtype))
    else:
        p = p.detach()
        assert ((c.float() - p).abs() <= p.abs() * 2.0 ** -7).all()


def _clone(ts):
    return [[t.clone() if t is not None else None for t in row] for row in ts]


def _assert_updates_match(got, want, before):
    """``got`` and ``want`` (weights) moved alike from ``before``."""
    for p, q, p0 in zip(got, want, before):
        ulp = torch.finfo(torch.float32).eps * float(p0.abs().max())
        torch.testing.assert_close(p.detach() - p0, q.detach() - p0, rtol=2e-5, atol=2 * ulp)


def _assert_step_matches(got, want, before):
    _assert_updates_match(got[0], want[0], before[0])
    for row in (2, 3):
        for a, b in zip(got[row], want[row]):
            torch.testing.assert_close(a, b, rtol=4e-6, atol=2 * torch.finfo(torch.float32).eps * float(b.abs().max()))
    for a, b in zip(got[4], want[4]):
        assert float(a) == float(b)


@pytest.mark.parametrize("step", [0.0, 999.0])
def test_kernel_matches_the_reference_and_writes_the_copies(step):
    ts = _tensors(step=step)
    before = _clone(ts)
    want = _clone(ts)
    for _ in range(3):
        adamw_step_(*ts, **HYPER)
        adamw_reference_(*want, **HYPER)
    _assert_step_matches(ts, want, before)
    for p, c in zip(ts[0], ts[5]):
        if c is not None:
            _assert_copy(c, p)
    assert all(float(s) == step + 3 for s in ts[4])


def test_the_reference_is_torch_adamw():
    ts = _tensors(copies=(None,) * len(SHAPES))
    params = [torch.nn.Parameter(p.clone()) for p in ts[0]]
    opt = torch.optim.AdamW(params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)
    before = _clone(ts)
    ts[2] = [torch.zeros_like(p) for p in ts[0]]
    ts[3] = [torch.zeros_like(p) for p in ts[0]]
    for _ in range(3):
        for p, g in zip(params, ts[1]):
            p.grad = g.clone()
        opt.step()
        adamw_reference_(*ts, **HYPER)
    _assert_updates_match(ts[0], params, before[0])


def test_found_inf_leaves_everything_as_it_was():
    ts = _tensors(step=4.0)
    before = _clone(ts)
    adamw_step_(*ts, **HYPER, found_inf=torch.ones((), device=DEVICE))
    for row, row0 in zip(ts, before):
        for a, b in zip(row, row0):
            assert a is None or torch.equal(a, b)
    want = _clone(ts)
    adamw_step_(*ts, **HYPER, found_inf=torch.zeros((), device=DEVICE))
    adamw_reference_(*want, **HYPER)
    _assert_step_matches(ts, want, before)


def test_bad_tensors_are_refused_with_the_reason():
    ts = _tensors()
    ts[1][2] = ts[1][2].t()                       # a transposed gradient
    with pytest.raises(ValueError, match="contiguous fp32"):
        adamw_step_(*ts, **HYPER)
    ts = _tensors()
    ts[5][0] = torch.zeros(SHAPES[0], dtype=torch.float32, device=DEVICE)   # not a 16-bit copy
    with pytest.raises(ValueError, match="bf16 or fp16"):
        adamw_step_(*ts, **HYPER)


def _model_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE)) for s in [(5, 4), (4,), (3, 700), (2,)]]


def _grads(params, i):
    g = torch.Generator().manual_seed(100 + i)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(DEVICE)


def _groups(params, lr):
    return [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2], "weight_decay": 0.0, "lr": lr}]


def _casts(params):
    """A WeightCasts holding fp16 copies of ``params`` (fp16: the interpreter's bf16 rounding is not Tensor.to's)."""
    casts = WeightCasts()
    with casts.active():
        for p in params:
            weight_casts.cast(p, torch.float16)
    return casts


def test_optimizer_trains_as_torch_adamw_and_its_state_dict_is_torchs():
    mine, ref = _model_params(), _model_params()
    opt = AdamW(_groups(mine, 3e-2), lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    opt.weight_casts = _casts(mine[:3])           # copies to write: the kernel's step
    assert opt._plans() == []                     # (before the first gradients: nothing to step)
    opt_ref = torch.optim.AdamW(_groups(ref, 3e-2), lr=1e-2, betas=(0.9, 0.98), eps=1e-6, foreach=False)
    for i in range(3):
        before = [p.detach().clone() for p in mine]
        _grads(mine, i), _grads(ref, i)
        assert opt._plans() is not None
        opt.step(), opt_ref.step()
        _assert_updates_match(mine, ref, before)
    # the state moves to torch's fused AdamW and back, and both continue alike
    torch_fused = torch.optim.AdamW(_groups([torch.nn.Parameter(p.detach().clone()) for p in mine], 3e-2), lr=1e-2,
                                    fused=True)
    torch_fused.load_state_dict(opt.state_dict())
    again = AdamW(_groups(mine, 3e-2), lr=1e-2)
    again.weight_casts = opt.weight_casts
    again.load_state_dict(torch_fused.state_dict())
    assert [float(again.state[p]["step"]) for p in mine] == [3.0] * 4
    assert again.state[mine[0]]["step"].device == mine[0].device
    before = [p.detach().clone() for p in mine]
    _grads(mine, 3), _grads(ref, 3)
    again.step(), opt_ref.step()
    _assert_updates_match(mine, ref, before)


def test_optimizer_keeps_its_plan_and_takes_each_steps_new_gradients():
    """Gradients are new tensors every step (set to None between steps): the plan built at the first step is kept
    and pointed at them (its tables rewritten where they moved); a weight whose storage was replaced gets a new
    plan; a gradient the kernel cannot read sends the step to torch's kernel."""
    mine, ref = _model_params(), _model_params()
    opt = AdamW(mine, lr=1e-2)
    opt.weight_casts = _casts(mine)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    held = []                                     # old gradients kept alive: the new ones cannot take their place
    for i in range(4):
        if i == 2:                                # as module.to() or a .data assignment would
            with torch.no_grad():
                mine[0].data, ref[0].data = mine[0].data.clone(), ref[0].data.clone()
        held.append([p.grad for p in mine])
        before = [p.detach().clone() for p in mine]
        _grads(mine, i), _grads(ref, i)
        opt.step(), opt_ref.step()
        _assert_updates_match(mine, ref, before)
        plan = opt._kernel_plans[0][0]
        if i == 1:
            assert plan is first and plan.grad_ptrs == [p.grad.data_ptr() for p in mine]
        elif i == 2:
            assert plan is not first
        first = plan
    mine[1].grad = torch.randn(8, device=DEVICE)[::2]   # (4,), strided
    assert opt._plans() is None


def test_optimizer_takes_its_plans_without_the_lookups_until_copies_or_state_change():
    """After a group's first step its plan is taken at once while its weights and the copies are unchanged (no
    copy lookups, no per-tensor checks: fine-tuning's short steps wait for the host); a new copy, or a state dict
    loaded into the same optimizer, sends every group through the full lookup again, and the step then writes the
    new copy and updates the loaded moments."""
    mine, ref = _model_params(), _model_params()
    opt = AdamW(_groups(mine, 3e-2), lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    casts = _casts(mine[:2])
    opt.weight_casts = casts
    opt_ref = torch.optim.AdamW(_groups(ref, 3e-2), lr=1e-2, betas=(0.9, 0.98), eps=1e-6, foreach=False)
    lookups = []
    real = casts.copies_of
    casts.copies_of = lambda params: (lookups.append(len(params)), real(params))[1]

    def step(i):
        before = [p.detach().clone() for p in mine]
        _grads(mine, i), _grads(ref, i)
        opt.step(), opt_ref.step()
        _assert_updates_match(mine, ref, before)

    step(0)
    assert sorted(lookups) == [2, 2]              # both groups looked up once
    step(1), step(2)
    assert len(lookups) == 2                      # then taken at once
    with casts.active():
        new_copy = weight_casts.cast(mine[2], torch.float16)
    step(3)
    assert len(lookups) == 4                      # the new copy: both groups again
    _assert_copy(new_copy, mine[2])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # new moment and step-count tensors
    step(4)
    assert len(lookups) == 6
    for p, r in zip(mine, ref):                   # the loaded moments were the ones updated
        torch.testing.assert_close(opt.state[p]["exp_avg"], opt_ref.state[r]["exp_avg"], rtol=1e-5, atol=1e-7)
        assert float(opt.state[p]["step"]) == 5.0


def test_optimizer_writes_the_copies_and_the_refresh_skips_them():
    params = _model_params()
    casts = WeightCasts()
    with casts.active():
        copies = [weight_casts.cast(p, torch.bfloat16) for p in params[:3]]   # params[3] never cast
    opt = AdamW(params, lr=1e-2)
    opt.weight_casts = casts
    _grads(params, 0)
    opt.step()
    for c, p in zip(copies, params):
        _assert_copy(c, p)
    copied = []
    real = torch._foreach_copy_
    try:
        torch._foreach_copy_ = lambda dst, src: (copied.extend(dst), real(dst, src))
        casts.refresh()                           # all three written by the step: nothing to copy
        assert copied == []
        opt.step()                                # the same gradients, a second update
        with torch.no_grad():
            params[1].mul_(2.0)                   # changed after the step (a checkpoint load would do this)
        casts.refresh()
        assert [c.data_ptr() for c in copied] == [copies[1].data_ptr()]
        casts.refresh()                           # the marks are spent: everything again
        assert len(copied) == 4
    finally:
        torch._foreach_copy_ = real
    assert all(torch.equal(c, p.detach().to(torch.bfloat16)) for c, p in zip(copies, params))


def test_optimizer_runs_torchs_step_for_what_the_kernel_does_not_take():
    mine, ref = _model_params(), _model_params()
    opt = AdamW(mine, lr=1e-2)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    _grads(mine, 0)
    assert opt._plans() is None                   # no copies kept: torch's (faster) kernel
    opt.weight_casts = WeightCasts()
    assert opt._plans() is None                   # none to write (fp32 training): the same
    opt.weight_casts = _casts(mine)
    assert opt._plans() is not None
    for group in opt.param_groups + opt_ref.param_groups:
        group["maximize"] = True
    assert opt._plans() is None
    _grads(mine, 0), _grads(ref, 0)
    opt.step(), opt_ref.step()
    assert all(torch.equal(p, q) for p, q in zip(mine, ref))


def test_optimizer_step_reads_nothing_back(monkeypatch):
    """The kernel's step (found_inf included, as the guard hands it) never reads a device value on the host: the
    pretraining loop's sync-freedom (tests/training/test_pretrain_sync_free.py runs fp32, where torch's step runs)."""
    params = _model_params()
    opt = AdamW(params, lr=1e-2)
    opt.weight_casts = _casts(params)
    _grads(params, 0)
    found_inf = torch.zeros((), device=DEVICE)
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        def read(self, *a, _name=name, **k):
            raise AssertionError(f"Tensor.{_name} during the optimizer step")
        monkeypatch.setattr(torch.Tensor, name, read)
    with _NoReads():                              # reads inside torch's ops (a foreach op given one tensor)
        opt.step()                                # the first step builds the plan (host-side checks only)
        opt.found_inf = found_inf
        opt.step()
        _grads(params, 1)                         # new gradients: the kept plan takes them
        opt.step()


class _NoReads(TorchDispatchMode):
    """Fails on any op that reads a tensor's value on the host, wherever it is called from."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero,
                                   torch.ops.aten.is_nonzero, torch.ops.aten.equal):
            raise AssertionError(f"{func} during the optimizer step")
        return func(*args, **(kwargs or {}))
