"""16-bit copies of fp32 master weights, cast once per optimizer step rather than in every forward.

Under ``torch.autocast`` the fused ops take their fp32 parameters and cast them to the autocast dtype inside
(``linear.py``), in every forward: ~150 casts of 335 M parameters a BERT-large micro-batch (~0.75 ms of an H200 and
a launch each, benchmarks/RESULTS.md), the same values in all 32 micro-batches of the academic-budget recipe's
accumulated step. While a :class:`WeightCasts` is active (``with casts.active():``) the ops take a parameter's copy
from it instead: made at its first use, and rewritten in place by :meth:`WeightCasts.refresh` (one multi-tensor copy
into the same buffers, so CUDA graphs that read them stay valid), which the owner calls whenever the weights may
have changed since: ``TrainEngine`` before the first micro-batch of every optimizer step, when its steps accumulate
several micro-batches (training/engine.py; with one, the refresh is every cast again, each step).
Outside ``active()`` nothing is kept and the ops cast as before. The copies hold the casts' own values, so results
are bit-identical either way. ``FASTBERT_WEIGHT_CASTS=0`` turns them off where training would keep them
(:func:`enabled`).

An optimizer that writes the copies itself as it updates the weights (``training.optim.AdamW``, through
``ops/adamw.py``) takes them with :meth:`WeightCasts.copies_of` and says so with :meth:`WeightCasts.written`: the
next refresh skips those copies, unless the weight changed again since (its autograd version moved: a checkpoint
load, any in-place op on it), and forgets the marks, so later refreshes copy everything again.

A copy may be asked for padded with zero rows (``cast(p, dtype, rows=...)``: the MLM decoder's, to a whole number of
64-row blocks, ``ops/mlm_loss.py``): the op gets the whole padded buffer; refresh and the optimizer write its first
rows, the copy proper, and the zero rows stay.

A ``WeightCasts(derived=True)`` also keeps what other ops make from a parameter (:func:`derived`: the FP8 linears'
weight codes, their transpose and scale, ``ops/fp8.py``): made by the op's own function at first use, remade by
each refresh and copied into the same buffers. Training turns this on when an optimizer step accumulates several
micro-batches (training/engine.py): the later micro-batches then skip those casts. No optimizer writes these.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

_state = threading.local()  # .casts: the active WeightCasts of this thread, or None


def _fits(p: torch.nn.Parameter, copy: torch.Tensor) -> bool:
    """Whether ``copy`` can still hold ``p``'s values (``p`` has not changed shape or device since it was made)."""
    return copy.shape == p.shape and copy.device == p.device


class WeightCasts:
    """A parameter's copy in a dtype, per (parameter, dtype, padded rows or None) first asked for while active."""

    def __init__(self, derived: bool = False):
        # (id(parameter), dtype, rows) -> (parameter, its copy); with rows, the copy is the first rows of a buffer
        # padded with zero rows (kept in _padded), which is what get returns
        self._copies: dict[tuple[int, torch.dtype, int | None], tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self._padded: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}
        self._written: dict[int, int] = {}   # id(parameter) -> its version when an optimizer wrote its copy
        self.generation = 0   # moves whenever a copy is made or dropped: what copies_of gave may be stale
        # (id(parameter), key) -> (parameter, make, its tensors) while keeping derived values (``derived``)
        self._derived: dict | None = {} if derived else None

    def __len__(self) -> int:
        return len(self._copies)

    @property
    def keeps_derived(self) -> bool:
        """Whether :func:`derived` values are kept here (the constructor's ``derived``)."""
        return self._derived is not None

    def derive(self, p: torch.nn.Parameter, key, make) -> tuple:
        """``make(p)`` (a tuple of tensors), kept per (parameter, ``key``) and given again until :meth:`refresh`
        remakes it in place. Only where :attr:`keeps_derived` (the caller, :func:`derived`, checks)."""
        hit = self._derived.get((id(p), key))
        if hit is not None and hit[0] is p:
            return hit[2]
        with torch.no_grad():
            made = tuple(make(p))
        self._derived[(id(p), key)] = (p, make, made)
        return made

    def get(self, p: torch.nn.Parameter, dtype: torch.dtype, rows: int | None = None) -> torch.Tensor:
        """``p``'s copy in ``dtype`` (made now if there is none, or if ``p`` changed shape or device since); with
        ``rows``, inside a buffer of that many rows whose rows past p's are zeros (:func:`padded`), which is
        returned. The copy proper (the buffer's first rows) is what refresh and an optimizer write."""
        key = (id(p), dtype, rows)
        hit = self._copies.get(key)  # the entry holds p: its id cannot be reused while the entry lives
        if hit is not None and _fits(*hit):
            return hit[1] if rows is None else self._padded[key]
        with torch.no_grad():
            whole = p.detach().to(dtype, copy=True) if rows is None else padded(p.detach(), dtype, rows)
        if rows is not None:
            self._padded[key] = whole
        self._copies[key] = (p, whole[:p.shape[0]] if rows is not None else whole)
        self.generation += 1
        return whole

    def copies_of(self, params) -> list:
        """Each parameter's copy where it has exactly one (in any dtype) that still fits it, else None: what an
        optimizer may write with the parameter's new values (then :meth:`written`)."""
        found: dict = {}
        for p, copy in self._copies.values():
            found.setdefault(id(p), []).append(copy if _fits(p, copy) else None)
        return [c[0] if c is not None and len(c) == 1 else None for c in (found.get(id(p)) for p in params)]

    def written(self, params) -> None:
        """``params``' copies (from :meth:`copies_of`) hold their current values: the next refresh skips them."""
        for p in params:
            self._written[id(p)] = p._version

    @torch.no_grad()
    def refresh(self) -> None:
        """Rewrite every copy from its parameter's current values: one multi-tensor copy per (device, dtype
        pair), except the copies an optimizer wrote since the last refresh of parameters unchanged since then.
        Through ``.data``, so a copy's autograd version does not move (a forward's saved copy stays usable by
        its backward when nothing changed); a parameter that changed shape or device gets a new copy at its next
        use instead. Derived values (:meth:`derive`) are all remade and copied into their buffers."""
        written, self._written = self._written, {}
        groups: dict = {}
        for key, (p, copy) in list(self._copies.items()):
            if written.get(id(p)) == p._version:   # (copies_of gave it: it fitted then, and p has not changed)
                continue
            if not _fits(p, copy):
                del self._copies[key]
                self._padded.pop(key, None)
                self.generation += 1
                continue
            dst, src = groups.setdefault((p.device, p.dtype, copy.dtype), ([], []))
            dst.append(copy.data)
            src.append(p.data)
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)
        for key, (p, make, made) in list((self._derived or {}).items()):
            new = tuple(make(p))
            if all(d.shape == n.shape and d.dtype == n.dtype and d.device == n.device for d, n in zip(made, new)):
                for d, n in zip(made, new):
                    d.data.copy_(n)
            else:   # p changed shape or device: new buffers
                self._derived[key] = (p, make, new)

    @contextlib.contextmanager
    def active(self):
        """The ops of this thread take parameters' copies from here inside the block."""
        prev = getattr(_state, "casts", None)
        _state.casts = self
        try:
            yield self
        finally:
            _state.casts = prev


def enabled() -> bool:
    """Whether training keeps the copies (``FASTBERT_WEIGHT_CASTS``, default on)."""
    return os.environ.get("FASTBERT_WEIGHT_CASTS", "1") != "0"


def padded(t: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """``t`` in ``dtype`` with zero rows appended up to ``rows`` rows (one cast-copy, one fill)."""
    out = t.new_empty((rows, *t.shape[1:]), dtype=dtype)
    out[:t.shape[0]].copy_(t)
    out[t.shape[0]:].zero_()
    return out


def cast(t: torch.Tensor, dtype: torch.dtype, rows: int | None = None) -> torch.Tensor:
    """``t.to(dtype)``, with ``rows`` padded with zero rows to that many rows (:func:`padded`); for a parameter
    while a :class:`WeightCasts` is active, its copy from there."""
    if rows == t.shape[0]:
        rows = None
    if t.dtype == dtype and rows is None:
        return t
    casts = getattr(_state, "casts", None)
    if casts is not None and isinstance(t, torch.nn.Parameter) and not torch.compiler.is_compiling():
        return casts.get(t, dtype, rows)
    return t.to(dtype) if rows is None else padded(t, dtype, rows)


def derived(p: torch.Tensor, key, make) -> tuple | None:
    """While a :class:`WeightCasts` made with ``derived=True`` is active: ``make(p)``, a tuple of tensors made from
    parameter ``p`` (``key`` names what, per parameter), made once and kept there until its refresh. Otherwise
    None: nothing keeps it, the caller makes its own."""
    casts = getattr(_state, "casts", None)
    if (casts is None or not casts.keeps_derived or not isinstance(p, torch.nn.Parameter)
            or torch.compiler.is_compiling()):
        return None
    return casts.derive(p, key, make)
