"""Triton launches with less host work: ``@fast_launch`` over an entry kernel's ``@triton.jit``.

An eager training step (HF Trainer, a user's own loop) is host-bound at BERT sizes: the GPU finishes a kernel
before Python has issued the next. Triton's ``kernel[grid](...)`` took 53-86 us of host time a launch in an eager
BERT-base fine-tuning step on the GPU hosts (H200, Triton 3.6; ``cuLaunchKernelEx`` itself ~12 us of it): its
binder (a generated Python function that binds the ~20-45 arguments and specializes each), options added to the
call, two device lookups, a hash of ``str(options)``, a check of the kernel's globals, launch metadata for hooks
that are not there, two empty hook chains called from C, and in Triton's C launcher, for every tensor, a call of
its ``data_ptr()`` and a driver query (``cuPointerGetAttribute``).

``fast_launch`` does that work once per specialization. ``fastbert._launch.prepare`` (C, ``csrc/launch``) binds a
call's arguments to the kernel's parameters and returns a key that tells apart every pair of calls Triton would
compile differently (constexpr values; each tensor's dtype and 16-byte alignment; each int's divisibility by 16,
the value 1 and its 32/64-bit range, as the parameter's ``do_not_specialize`` flags let Triton see them; None,
bools, floats; the launch options), plus the arguments in the kernel's order with each tensor replaced by its
address. A key seen before launches its compiled kernel directly through Triton's own C launcher (an address is
passed as is, no driver query; on Triton 3.6 its C launch function is called without the Python wrapper around it,
which only allocates scratch buffers fastbert's kernels do not have: ``direct_launch``). Anything else goes
through ``kernel[grid](...)`` unchanged, and its compiled kernel is kept under the key: the first launch of each
specialization (it compiles), an argument of another kind (a tensor subclass, an object with ``data_ptr``, an
unhashable constexpr), a grid function, a launch while a Triton hook is installed (profilers: launch hooks,
pre-run hooks, a pipeline inspection hook), the interpreter (``TRITON_INTERPRET=1``), a Triton without the
internals used here or a build without ``fastbert._launch`` (checked when a kernel is wrapped), and
``FASTBERT_FAST_LAUNCH=0``. The key refines Triton's own specialization,
so a kernel kept under it is the one Triton would have picked (``tests/ops/test_launch.py`` checks the keys
against Triton's binder).

What the shortcut does not see: a change of ``TRITON_DEBUG`` or ``TRITON_INSTRUMENTATION_MODE`` after a
specialization's first launch, a change of a kernel's global variables (fastbert's are constants), and a CPU
tensor passed to a CUDA kernel (Triton's driver query would name it; fastbert's ops dispatch on the device first).
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

# read at every launch: benchmarks and tests turn the shortcut off and on in one process
ENABLED = os.environ.get("FASTBERT_FAST_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"

CONSTEXPR, NO_SPECIALIZE, NO_ALIGN = 1, 2, 4  # csrc/launch/launch_key.cpp's parameter flags


def _triton_version() -> tuple:
    try:
        import triton
    except ImportError:
        return ()
    return tuple(triton.__version__.split(".")[:2])


_TRITON_3_6 = _triton_version() == ("3", "6")  # the launcher layout direct_launch knows
_NO_DEFAULT = object()


def _prepare():
    """``fastbert._launch.prepare``, or None in a build without it."""
    try:
        from fastbert._launch import prepare
    except ImportError:
        return None
    return prepare


@functools.lru_cache(maxsize=None)
def _internals():
    """``(JITFunction, Triton's runtime knobs, current device getter, raw stream getter, prepare)`` when this Triton
    and this build have what the shortcut uses, else None; looked up once, not once per wrapped kernel."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
        from torch._C import _cuda_getCurrentRawStream
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    hooks = [getattr(runtime, name, None) for name in ("launch_enter_hook", "launch_exit_hook")]
    prepare = _prepare()
    if not all(hasattr(h, "calls") for h in hooks) or prepare is None:
        return None
    return JITFunction, runtime, torch.cuda.current_device, _cuda_getCurrentRawStream, prepare


def plan_of(jit_fn) -> tuple:
    """What ``prepare`` needs of a kernel's signature: ``(names, flags, defaults, index, tensor types, no-default
    marker)``, from the ``JITFunction``'s ``signature`` and ``params`` (Triton's ``KernelParam``: ``is_constexpr``,
    ``do_not_specialize``, ``do_not_specialize_on_alignment``)."""
    names = tuple(jit_fn.signature.parameters)
    flags = tuple(CONSTEXPR * bool(p.is_constexpr) + NO_SPECIALIZE * bool(p.do_not_specialize)
                  + NO_ALIGN * bool(p.do_not_specialize_on_alignment) for p in jit_fn.params)
    defaults = tuple(_NO_DEFAULT if p.default is inspect.Parameter.empty else p.default
                     for p in jit_fn.signature.parameters.values())
    return names, flags, defaults, {n: i for i, n in enumerate(names)}, (torch.Tensor, torch.nn.Parameter), _NO_DEFAULT


class FastKernel:
    """A ``@triton.jit`` entry kernel whose ``kernel[grid](*args, **kwargs)`` takes the shortcut (module doc).
    Attribute reads go to the wrapped ``JITFunction`` (``.fn``, ``.warmup``, ``.cache``...)."""

    def __init__(self, jit_fn, internals):
        self.jit_fn = jit_fn
        _, self._runtime, self._device, self._stream, self._prepare = internals
        self._plan = plan_of(jit_fn)
        self._compiled = {}  # (device, prepare's key) -> (CompiledKernel, direct_launch(its run))
        self.__name__ = getattr(jit_fn, "__name__", "kernel")
        self.__doc__ = getattr(jit_fn, "__doc__", None)

    def __getattr__(self, name):
        return getattr(self.__dict__["jit_fn"], name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        if not ENABLED or callable(grid) or self._hooked():
            return self._slow(grid, args, kwargs, None)
        prepared = self._prepare(self._plan, args, kwargs)
        if prepared is None:  # an argument of a kind prepare leaves to Triton
            return self._slow(grid, args, kwargs, None)
        key, ordered = prepared
        device = self._device()
        try:
            entry = self._compiled.get((device, key))
        except TypeError:  # an unhashable constexpr: Triton's own path
            return self._slow(grid, args, kwargs, None)
        if entry is None:
            return self._slow(grid, args, kwargs, (device, key))
        kernel, direct = entry
        n = len(grid)
        g1, g2 = grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        if direct is not None:  # Triton's C launch function itself (direct_launch)
            direct[0](grid[0], g1, g2, self._stream(device), kernel.function, direct[1], direct[2], None, None,
                      kernel.packed_metadata, None, None, None, *ordered)
        else:
            kernel.run(grid[0], g1, g2, self._stream(device), kernel.function, kernel.packed_metadata, None, None,
                       None, *ordered)
        return kernel

    def _hooked(self) -> bool:
        """Whether something watches Triton's launches or compiles (launch hooks, pre-run hooks, a pipeline
        inspection hook): then every launch takes Triton's own path."""
        runtime = self._runtime
        return bool(runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls or self.jit_fn.pre_run_hooks
                    or getattr(runtime, "add_stages_inspection_hook", None) is not None)

    def _slow(self, grid, args, kwargs, key):
        kernel = self.jit_fn[grid](*args, **kwargs)
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        if key is not None and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            self._compiled[key] = (kernel, direct_launch(kernel.run))
        return kernel


def direct_launch(run) -> tuple | None:
    """``(launch, cooperative grid, PDL)`` of a compiled kernel's ``run`` when it is Triton 3.6's ``CudaLauncher``
    and the kernel needs no scratch buffers, else None. That ``run`` is Python: it allocates the kernel's global and
    profiling scratch buffers (none for fastbert's kernels) and then calls ``launch``, Triton's generated C
    function, as ``launch(gx, gy, gz, stream, function, cooperative, pdl, global scratch, profile scratch,
    metadata, launch metadata, enter hook, exit hook, *args)``; the shortcut calls that directly. Other Triton
    versions (3.9's launcher takes other arguments) keep ``run``."""
    if not _TRITON_3_6 or type(run).__name__ != "CudaLauncher" or not callable(getattr(run, "launch", None)):
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl


def fast_launch(kernel):
    """``kernel`` (a ``@triton.jit`` entry kernel) wrapped in :class:`FastKernel`, or unchanged where the shortcut
    does not apply (module doc): under the interpreter, with ``FASTBERT_FAST_LAUNCH=0``, without Triton, for an
    autotuned kernel, on a Triton without the internals it uses, or in a build without ``fastbert._launch``."""
    if not ENABLED:
        return kernel
    internals = _internals()
    if internals is None or not isinstance(kernel, internals[0]) or not all(
            hasattr(kernel, a) for a in ("signature", "params", "pre_run_hooks")):
        return kernel
    return FastKernel(kernel, internals)
