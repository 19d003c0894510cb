"""``fastbert.ops.launch``: Triton launches that skip Triton's per-launch host work once a specialization has run.

On the CPU (the interpreter) the shortcut is off and the kernels are Triton's own objects; its dispatch logic is
tested here against a stand-in for a ``JITFunction`` that records which path each launch took. On a GPU the tests
launch real kernels on aligned and misaligned inputs, alternating, and compare with the shortcut turned off.
"""
import pytest
import torch

from fastbert.ops import launch
from fastbert.ops._common import INTERPRET, cdiv, next_power_of_2
from fastbert.ops.launch import FastKernel


class _Hooks:
    def __init__(self):
        self.calls = []


class _Runtime:
    def __init__(self):
        self.launch_enter_hook, self.launch_exit_hook = _Hooks(), _Hooks()
        self.add_stages_inspection_hook = None


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


class _JitFunction:
    """What FastKernel reads of a ``JITFunction``: ``device_caches[device][4]`` (the binder), ``pre_run_hooks``,
    ``[grid](...)`` (Triton's own path: here it records the launch and returns a compiled kernel)."""

    def __init__(self):
        self.log, self.pre_run_hooks, self.device_caches = [], [], {}
        self.fn = "the python function"

    def binder(self, x, n, BLOCK=16, **options):  # noqa: N803 - a constexpr's name
        align = [x] if isinstance(x, list) else ("D" if x % 16 == 0 else None)  # a list: an unhashable specialization
        spec = [("*fp32", align), ("i32", "D" if n % 16 == 0 else None), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, spec, options

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.device_caches.setdefault(0, ({}, {}, None, None, self.binder))
            self.log.append(("triton", grid, args, kwargs))
            return _Compiled(self.log)
        return run


@pytest.fixture
def switched_on(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)  # off under the interpreter; the stand-in needs no GPU


def _kernel():
    fn, runtime = _JitFunction(), _Runtime()
    return FastKernel(fn, (_JitFunction, runtime, lambda: 0, lambda device: 7)), fn, runtime


def test_first_launch_of_a_specialization_goes_through_triton_then_launches_directly(switched_on):
    k, fn, _ = _kernel()
    k[(3,)](32, 64, BLOCK=16, num_warps=4)  # no binder yet for the device: Triton's path
    k[(3,)](32, 64, BLOCK=16, num_warps=4)  # now a known device, but not yet a known specialization
    k[(5, 2)](48, 80, BLOCK=16, num_warps=4)  # same specialization (aligned, divisible): direct
    assert [e[0] for e in fn.log] == ["triton", "triton", "direct"]
    assert fn.log[2][1] == (5, 2, 1, 7, "function", "metadata", None, None, None, 48, 80, 16)
    k[(1,)](33, 64, BLOCK=16, num_warps=4)  # misaligned pointer: another specialization, Triton compiles it
    k[(1,)](32, 65, BLOCK=16, num_warps=4)  # n not divisible by 16: another one
    k[(1,)](32, 64, BLOCK=32, num_warps=4)  # another constexpr
    k[(1,)](32, 64, BLOCK=16, num_warps=8)  # another option
    assert [e[0] for e in fn.log[3:]] == ["triton"] * 4
    k[(1,)](17, 64, BLOCK=16, num_warps=4)
    k[(1,)](32, 63, BLOCK=16, num_warps=4)
    k[(1,)](0, 0, BLOCK=32, num_warps=4)
    k[(1,)](0, 0, BLOCK=16, num_warps=8)
    assert [e[0] for e in fn.log[7:]] == ["direct"] * 4
    k[(1,)]([32], 64)  # a specialization that cannot be a dict key: Triton's path, every time
    k[(1,)]([32], 64)
    assert [e[0] for e in fn.log[11:]] == ["triton"] * 2


def test_grid_functions_hooks_and_the_switch(switched_on):
    k, fn, runtime = _kernel()
    for _ in range(2):
        k[(1,)](32, 64)
    k[lambda bound: (bound["n"] // 16, 2)](32, 64)
    assert fn.log[-1] == ("direct", (4, 2, 1, 7, "function", "metadata", None, None, None, 32, 64, 16))
    runtime.launch_enter_hook.calls.append(print)  # a profiler watching launches: Triton's path, hooks called
    k[(1,)](32, 64)
    runtime.launch_enter_hook.calls.clear()
    fn.pre_run_hooks.append(print)
    k[(1,)](32, 64)
    fn.pre_run_hooks.clear()
    runtime.add_stages_inspection_hook = print
    k[(1,)](32, 64)
    runtime.add_stages_inspection_hook = None
    old, launch.ENABLED = launch.ENABLED, False
    try:
        k[(1,)](32, 64)
    finally:
        launch.ENABLED = old
    assert [e[0] for e in fn.log[-4:]] == ["triton"] * 4
    k[(1,)](32, 64)
    assert fn.log[-1][0] == "direct"
    assert k.fn == "the python function"  # attributes of the JITFunction read through


def test_interpreter_leaves_kernels_as_triton_made_them():
    from fastbert.ops import attention, layer_norm
    if INTERPRET:
        assert not launch.ENABLED
        assert not isinstance(attention._fwd_kernel, FastKernel)
        assert launch.fast_launch(layer_norm._ln_fwd_kernel) is layer_norm._ln_fwd_kernel


def test_host_cdiv_and_next_power_of_2_are_tritons():
    triton = pytest.importorskip("triton")
    for n in range(0, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


# ------------------------------------------------------------------------------------------------------------- GPU
def _with_switch(on: bool, f):
    old, launch.ENABLED = launch.ENABLED, on
    try:
        return f()
    finally:
        launch.ENABLED = old


@pytest.mark.gpu
def test_gpu_alignment_and_divisibility_pick_their_own_compiled_kernels():
    """LayerNorm on a 16-byte-aligned input and on views 2 bytes off (misaligned), with row counts divisible by 16 and
    not, alternating: every result equals Triton's own launch path's, bit for bit (a kernel compiled for aligned
    pointers launched on a misaligned one would read wrong rows or fault)."""
    from fastbert.ops.layer_norm import _ln_fwd_kernel, dropout_add_layer_norm
    assert isinstance(_ln_fwd_kernel, FastKernel)
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4096 * 768 + 1, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(768, device="cuda", generator=g)
    b = torch.randn(768, device="cuda", generator=g)
    cases = [(rows, off) for rows in (4096, 4001) for off in (0, 1)]
    for _ in range(3):
        for rows, off in cases:
            x = base[off:off + rows * 768].view(rows, 768)
            fast = dropout_add_layer_norm(x, None, w, b, 1e-5)
            slow = _with_switch(False, lambda: dropout_add_layer_norm(x, None, w, b, 1e-5))
            ref = torch.nn.functional.layer_norm(x.float(), (768,), w, b, 1e-5)
            assert torch.equal(fast, slow), (rows, off)
            assert (fast.float() - ref).abs().max() < 0.05, (rows, off)
    assert len(_ln_fwd_kernel._compiled) >= 2


@pytest.mark.gpu
def test_gpu_training_step_equals_tritons_launch_path():
    """A BERT training step (fused kernels, dropout on, bf16 autocast, padded batch): loss, logits and every gradient
    with the shortcut equal those with Triton's own launch path, bit for bit, except where two steps on Triton's
    path differ themselves (the embedding backward accumulates with atomics): there within what those two differ by
    plus one bf16 step."""
    import fastbert
    cfg = fastbert.BertConfig.preset("small", num_labels=3, kernels="triton")
    torch.manual_seed(0)
    model = fastbert.BertForSequenceClassification(cfg).cuda().train()
    lengths = torch.tensor([37, 5, 64, 20])
    mask = (torch.arange(64)[None] < lengths[:, None]).long().cuda()
    ids = (torch.randint(5, cfg.vocab_size, (4, 64)) * mask.cpu()).cuda()
    labels = torch.tensor([0, 2, 1, 1]).cuda()
    names = ["loss", "logits"] + [n for n, _ in model.named_parameters()]

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return [out.loss.detach(), out.logits.detach()] + [p.grad.clone() for p in model.parameters()]

    step()  # compile
    fast = step()
    slow, slow_again = _with_switch(False, step), _with_switch(False, step)
    for name, f, s, s2 in zip(names, fast, slow, slow_again):
        if torch.equal(s, s2):
            assert torch.equal(f, s), name
        else:
            spread = (s - s2).abs().max().item()
            assert "embeddings" in name, (name, spread)
            assert (f - s).abs().max().item() <= 2 * spread + 2**-8 * s.abs().max().item(), name
