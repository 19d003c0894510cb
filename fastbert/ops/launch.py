"""Triton launches with less host work: ``@fast_launch`` over an entry kernel's ``@triton.jit``.

An eager training step (HF Trainer, a user's own loop) is host-bound at BERT sizes: the GPU finishes a kernel
before Python has issued the next. Triton's ``kernel[grid](...)`` took 53-86 us of host time a launch in an eager
BERT-base fine-tuning step on the GPU hosts (H200, Triton 3.6; ``cuLaunchKernelEx`` itself ~12 us of it): besides
its binder it adds options to the call, looks the device up twice, hashes ``str(options)``, checks the kernel's
globals, builds launch metadata for hooks that are not there and calls two empty hook chains from C.
``fast_launch`` keeps the part that decides which compiled kernel runs, Triton's own binder (its native
per-argument specialization: dtypes, 16-byte alignment, divisibility by 16, the value 1), looks the result up in a
dict of the kernels compiled so far and launches a hit directly: 40-49 us a launch in the same steps
(``benchmarks/RESULTS.md``, thirtieth session). Anything else goes through ``kernel[grid](...)`` unchanged: the
first launch of each specialization (it compiles), a launch while a Triton hook is installed (profilers: launch
hooks, pre-run hooks, a pipeline inspection hook), the interpreter (``TRITON_INTERPRET=1``), a Triton without the
internals used here (checked when a kernel is wrapped), and ``FASTBERT_FAST_LAUNCH=0``.

What the shortcut does not see: a change of ``TRITON_DEBUG`` or ``TRITON_INSTRUMENTATION_MODE`` after a
specialization's first launch, and a change of a kernel's global variables (fastbert's are constants).
"""
from __future__ import annotations

import os

import torch

# read at every launch: benchmarks and tests turn the shortcut off and on in one process
ENABLED = os.environ.get("FASTBERT_FAST_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def _internals():
    """``(JITFunction, Triton's runtime knobs, current device getter, raw stream getter)`` when this Triton has
    what the shortcut uses, else None."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
        from torch._C import _cuda_getCurrentRawStream
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    hooks = [getattr(runtime, name, None) for name in ("launch_enter_hook", "launch_exit_hook")]
    if not all(hasattr(h, "calls") for h in hooks) or not hasattr(JITFunction, "create_binder"):
        return None
    return JITFunction, runtime, torch.cuda.current_device, _cuda_getCurrentRawStream


class FastKernel:
    """A ``@triton.jit`` entry kernel whose ``kernel[grid](*args, **kwargs)`` takes the shortcut (module doc).
    Attribute reads go to the wrapped ``JITFunction`` (``.fn``, ``.warmup``, ``.cache``...)."""

    def __init__(self, jit_fn, internals):
        self.jit_fn = jit_fn
        _, self._runtime, self._device, self._stream = internals
        self._compiled = {}  # (device, specialization, options) -> CompiledKernel
        self.__name__ = getattr(jit_fn, "__name__", "kernel")
        self.__doc__ = getattr(jit_fn, "__doc__", None)

    def __getattr__(self, name):
        return getattr(self.__dict__["jit_fn"], name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        if not ENABLED:
            return self.jit_fn[grid](*args, **kwargs)
        device = self._device()
        caches = self.jit_fn.device_caches.get(device)
        if caches is None or self._hooked():
            return self._slow(grid, args, kwargs, None)
        bound, specialization, options = caches[4](*args, **kwargs)  # Triton's binder
        key = (device, tuple(specialization), tuple(options.items()))
        try:
            kernel = self._compiled.get(key)
        except TypeError:  # an argument Triton specializes on something unhashable: Triton's own path
            return self._slow(grid, args, kwargs, None)
        if kernel is None:
            return self._slow(grid, args, kwargs, key)
        if callable(grid):
            grid = grid(bound)
        n = len(grid)
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *bound.values())
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
            self._compiled[key] = kernel
        return kernel


def fast_launch(kernel):
    """``kernel`` (a ``@triton.jit`` entry kernel) wrapped in :class:`FastKernel`, or unchanged where the shortcut
    does not apply (module doc): under the interpreter, with ``FASTBERT_FAST_LAUNCH=0``, without Triton, for an
    autotuned kernel, or on a Triton without the internals it uses."""
    if not ENABLED:
        return kernel
    internals = _internals()
    if internals is None or not isinstance(kernel, internals[0]) or not all(
            hasattr(kernel, a) for a in ("device_caches", "pre_run_hooks")):
        return kernel
    return FastKernel(kernel, internals)
