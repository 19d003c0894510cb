"""``fastbert.ops.launch``: Triton launches that skip Triton's per-launch host work once a specialization has run.

On the CPU (the interpreter) the shortcut is off and the kernels are Triton's own objects; its dispatch logic is
tested here against a stand-in for a ``JITFunction`` that records which path each launch took, and the C binding's
keys against Triton's own binder. On a GPU the tests
launch real kernels on aligned and misaligned inputs, alternating, and compare with the shortcut turned off.
"""
import pytest
import torch

from fastbert._launch import prepare  # built by setup.py wherever fastbert is installed: a missing one fails here
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


def _params(fn, constexprs=(), dns=(), dns_align=()):
    """Triton's ``KernelParam`` fields that ``launch.plan_of`` reads, for the parameters of ``fn``."""
    import inspect
    from types import SimpleNamespace
    return [SimpleNamespace(is_constexpr=name in constexprs, do_not_specialize=name in dns,
                            do_not_specialize_on_alignment=name in dns_align)
            for name in inspect.signature(fn).parameters]


class _JitFunction:
    """What FastKernel reads of a ``JITFunction``: ``signature``, ``params``, ``pre_run_hooks``, ``[grid](...)``
    (Triton's own path: here it records the launch and returns a compiled kernel)."""

    def __init__(self):
        import inspect

        def kernel(x, n, BLOCK=16):  # noqa: N803 - a constexpr's name
            pass
        self.signature, self.params = inspect.signature(kernel), _params(kernel, constexprs=("BLOCK",))
        self.log, self.pre_run_hooks = [], []
        self.fn = "the python function"

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return _Compiled(self.log)
        return run


@pytest.fixture
def switched_on(monkeypatch):
    monkeypatch.setattr(launch, "ENABLED", True)  # off under the interpreter; the stand-in needs no GPU


def _kernel():
    fn, runtime = _JitFunction(), _Runtime()
    return FastKernel(fn, (_JitFunction, runtime, lambda: 0, lambda device: 7, prepare)), fn, runtime


def _at(address: int, dtype=torch.float32) -> torch.Tensor:
    """A CPU tensor whose data_ptr() is ``address`` modulo 64 (a view into a 64-byte-aligned buffer): of ``dtype``,
    or of bytes where ``address`` is not a multiple of its size."""
    base = torch.empty(256, dtype=torch.uint8)
    skip = (-base.data_ptr()) % 64 + address % 64
    return base[skip:skip + 64].view(dtype) if dtype.itemsize == 1 or address % dtype.itemsize == 0 \
        else base[skip:skip + 64]


def test_first_launch_of_a_specialization_goes_through_triton_then_launches_directly(switched_on):
    k, fn, _ = _kernel()
    x, y, odd = _at(0), _at(32), _at(4)
    k[(3,)](x, 64, BLOCK=16, num_warps=4)  # not yet a known specialization: Triton's path
    k[(5, 2)](y, 80, BLOCK=16, num_warps=4)  # same specialization (aligned, divisible): direct
    assert [e[0] for e in fn.log] == ["triton", "direct"]
    assert fn.log[1][1] == (5, 2, 1, 7, "function", "metadata", None, None, None, y.data_ptr(), 80, 16)
    k[(1,)](odd, 64, BLOCK=16, num_warps=4)  # misaligned pointer: another specialization, Triton compiles it
    k[(1,)](x, 65, BLOCK=16, num_warps=4)  # n not divisible by 16: another one
    k[(1,)](x, 1, BLOCK=16, num_warps=4)  # n == 1: another one
    k[(1,)](x, 64, BLOCK=32, num_warps=4)  # another constexpr
    k[(1,)](x, 64, BLOCK=16, num_warps=8)  # another option
    k[(1,)](x.double(), 64, BLOCK=16, num_warps=4)  # another dtype
    k[(1,)](x, 2**40, BLOCK=16, num_warps=4)  # a 64-bit int
    assert [e[0] for e in fn.log[2:]] == ["triton"] * 7
    k[(1,)](_at(36), 64, BLOCK=16, num_warps=4)
    k[(1,)](y, 63, BLOCK=16, num_warps=4)
    k[(1,)](y, 1, BLOCK=16, num_warps=4)
    k[(1,)](y, 0, BLOCK=32, num_warps=4)
    k[(1,)](y, 0, BLOCK=16, num_warps=8)
    k[(1,)](y.double(), 0, BLOCK=16, num_warps=4)
    k[(1,)](y, 2**41, BLOCK=16, num_warps=4)
    k[(1,)](y, 0)  # BLOCK's default, no options: a new key (the options are part of it)
    assert [e[0] for e in fn.log[9:]] == ["direct"] * 7 + ["triton"]
    k[(1,)](x, n=64, BLOCK=16, num_warps=4)  # keywords bind as positions do: the same key
    assert fn.log[-1][0] == "direct"
    k[(1,)]([32], 64)  # an argument prepare does not handle: Triton's path, every time
    k[(1,)]([32], 64)
    k[(1,)](x, 64, BLOCK=[16])  # an unhashable constexpr: the same
    k[(1,)](x, 64, BLOCK=[16])
    k[(1,)](x, 64, n=3)  # n twice: Triton's path (which raises Python's error)
    assert [e[0] for e in fn.log[-5:]] == ["triton"] * 5


def test_grid_functions_hooks_and_the_switch(switched_on):
    k, fn, runtime = _kernel()
    x = _at(0)
    for _ in range(2):
        k[(1,)](x, 64)
    assert fn.log[-1] == ("direct", (1, 1, 1, 7, "function", "metadata", None, None, None, x.data_ptr(), 64, 16))
    k[lambda bound: (bound["n"] // 16, 2)](x, 64)  # a grid function: Triton's path
    runtime.launch_enter_hook.calls.append(print)  # a profiler watching launches: Triton's path, hooks called
    k[(1,)](x, 64)
    runtime.launch_enter_hook.calls.clear()
    fn.pre_run_hooks.append(print)
    k[(1,)](x, 64)
    fn.pre_run_hooks.clear()
    runtime.add_stages_inspection_hook = print
    k[(1,)](x, 64)
    runtime.add_stages_inspection_hook = None
    old, launch.ENABLED = launch.ENABLED, False
    try:
        k[(1,)](x, 64)
    finally:
        launch.ENABLED = old
    assert [e[0] for e in fn.log[-5:]] == ["triton"] * 5
    k[(1,)](x, 64)
    assert fn.log[-1][0] == "direct"
    assert k.fn == "the python function"  # attributes of the JITFunction read through


class CudaLauncher:
    """A stand-in for Triton 3.6's ``CompiledKernel.run`` (``direct_launch`` looks at the class name)."""

    def __init__(self, log, scratch=0):
        self.log, self.global_scratch_size, self.profile_scratch_size = log, scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, False

    def launch(self, *args):
        self.log.append(("c launch", args))

    def __call__(self, *args):
        self.log.append(("direct", args))


def test_triton_3_6s_c_launch_function_is_called_without_its_python_wrapper(switched_on, monkeypatch):
    """On Triton 3.6, a kernel without scratch buffers launches through its ``CudaLauncher.launch`` (the generated C
    function) with the arguments ``CudaLauncher.__call__`` would pass it; with scratch buffers, or another Triton,
    through ``run`` (which allocates them)."""
    k, fn, _ = _kernel()
    x = _at(0)

    def compiled(scratch):
        c = _Compiled(fn.log)
        c.run = CudaLauncher(fn.log, scratch)
        return c

    for version_36, scratch, expected in ((True, 0, "c launch"), (True, 256, "direct"), (False, 0, "direct")):
        monkeypatch.setattr(launch, "_TRITON_3_6", version_36)
        k._compiled.clear()
        monkeypatch.setattr(_JitFunction, "__getitem__", lambda self, grid: (
            lambda *a, **kw: (self.log.append(("triton", grid, a, kw)), compiled(scratch))[1]))
        k[(1,)](x, 64)
        k[(2, 3)](x, 64)
        assert fn.log[-1][0] == expected, (version_36, scratch)
        if expected == "c launch":
            assert fn.log[-1][1] == (2, 3, 1, 7, "function", False, False, None, None, "metadata", None, None, None,
                                     x.data_ptr(), 64, 16)
    assert launch.direct_launch(print) is None


def _probe_kernel(X, Y, n, m, s, f, flag, N_CONST, BLOCK: "tl.constexpr" = 16, stride=1):  # noqa: N803
    """A kernel signature for the key test (never compiled): tensors (Y without alignment specialization), ints (m
    without specialization), a float, a bool, a plain parameter used as a constexpr, a constexpr with a default
    and an int with one."""


def test_prepare_keys_refine_tritons_specialization():
    """For calls over tensors of several dtypes at aligned and misaligned addresses, None, ints around the values
    Triton specializes on (1, multiples of 16, the 32-bit, 64-bit and unsigned 64-bit ranges), floats, bools,
    constexprs and options: calls with equal ``prepare`` keys have equal specializations by Triton's own binder
    (so the kernel kept under a key is the one Triton picks), and ``prepare``'s arguments are the binder's with
    each tensor replaced by its address."""
    import itertools
    import random
    jit = pytest.importorskip("triton.runtime.jit")
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    params = _params(_probe_kernel, constexprs=("N_CONST", "BLOCK"), dns=("m",), dns_align=("Y",))
    for p, name in zip(params, ("X", "Y", "n", "m", "s", "f", "flag", "N_CONST", "BLOCK", "stride")):
        p.name, p.annotation_type, p.is_const = name, "", False
    import inspect
    sig = inspect.signature(_probe_kernel)
    binder = jit.create_function_from_signature(sig, params, CUDABackend(GPUTarget("cuda", 90, 32)))
    plan = launch.plan_of(type("K", (), {"signature": sig, "params": params})())
    tensors = [_at(a, dt) for a in (0, 2, 4, 16, 48) for dt in (torch.float32, torch.bfloat16, torch.uint8)]
    ints = [0, 1, 2, 15, 16, 17, 32, -16, -1, 2**31 - 16, 2**31, 2**31 + 16, 2**40 + 1, 2**63 - 16, 2**63, 2**64 - 16]
    rng = random.Random(0)
    triton_of, seen = {}, 0
    for _ in range(4000):
        args = [rng.choice(tensors), rng.choice(tensors + [None]), rng.choice(ints), rng.choice(ints),
                rng.choice([0.5, -2.0, 1e30]), rng.choice([0.25, 3.0]), rng.choice([True, False]),
                rng.choice([1, 2, 64, None])]
        kwargs = {}
        if rng.random() < 0.5:
            kwargs["BLOCK"] = rng.choice([16, 32])
        if rng.random() < 0.5:
            kwargs["stride"] = rng.choice(ints)
        if rng.random() < 0.3:
            kwargs["num_warps"] = rng.choice([4, 8])
        mine = prepare(plan, tuple(args), kwargs)
        assert mine is not None, (args, kwargs)
        key, ordered = mine
        bound, spec, options = binder(*args, **kwargs)
        theirs = (tuple(spec), tuple(options.items()))
        assert triton_of.setdefault(key, theirs) == theirs, (args, kwargs)
        assert ordered == tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in bound.values())
        seen += 1
    assert seen == 4000 and len(triton_of) > 200  # many distinct specializations met
    # what prepare leaves to Triton's path
    x = tensors[0]
    assert prepare(plan, (x, x, 1, 1, 0.5, 0.5, True), {}) is None  # N_CONST missing
    assert prepare(plan, (x, x, 2**64, 1, 0.5, 0.5, True, 1), {}) is None  # beyond 64 bits
    assert prepare(plan, (x, x, -2**63 - 1, 1, 0.5, 0.5, True, 1), {}) is None
    assert prepare(plan, (x, "a string", 1, 1, 0.5, 0.5, True, 1), {}) is None
    sub = x.as_subclass(type("Sub", (torch.Tensor,), {}))
    assert prepare(plan, (sub, x, 1, 1, 0.5, 0.5, True, 1), {}) is None  # a tensor subclass
    assert prepare(plan, (x, x, 1, 1, 0.5, 0.5, True, 1), {"n": 3}) is None  # n twice
    assert prepare(plan, tuple(itertools.repeat(x, 11)), {}) is None  # too many
    with pytest.raises(TypeError):
        prepare(plan, [x], {})


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
