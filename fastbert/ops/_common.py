"""Plumbing shared by the fused Triton ops: the one guarded Triton import, custom-op registration,
dropout seeds and masks, launch settings, input checks.

Triton is optional (``pip install triton``, or the ``fastbert[triton]`` extra): every op file takes
``triton`` and ``tl`` from here, never imports Triton itself. Without Triton they are stand-ins, so
the op files still import and their plain-PyTorch references (``kernels="torch"``) run; defining a
kernel is a no-op, and launching one, or any other use, raises the one error that names the fix.

Dropout everywhere uses Triton's counter-based Philox generator (``PHILOX_ROUNDS`` rounds) keyed by an
integer seed and a counter per row and group of eight columns (``dropout_bits``), so a backward can draw the
forward's mask again (the row-wise ops) or read the bits the forward stored (attention, Pre-LN's LayerNorm),
and ``dropout_mask`` reproduces it for tests. The seed reaches the
kernels as a one-element int64 tensor on the device (``dropout_seed``): drawn there by torch's
generator, it needs no host round trip, and a CUDA graph replay draws a fresh one.
"""
from __future__ import annotations

import contextlib
import os
import re
import threading

# Tuning paid once: Triton stores each autotuned kernel's choice on disk, keyed by the card and the
# shape bucket, so a second run (and every later step) never tunes again. TRITON_CACHE_AUTOTUNING=0
# turns it off. Set before any @triton.autotune below is defined (they read it then).
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
# Shapes: Triton compiles a variant of a kernel for every integer argument that is divisible by 16 and
# one that is not. Arguments that follow a batch's token count (row counts, rows per program, strides of
# (heads, tokens) tensors) are in each kernel's do_not_specialize: HF-style padded batches have another
# count every step, and the first one divisible by 16 recompiled every kernel (a 7.5 s step on an H100,
# BERT-base, benchmarks/RESULTS.md). They bound masks and loops, or offset a head's rows from an
# unaligned sequence start: no alignment the compiler could use is lost.

import torch  # noqa: E402

from fastbert.ops import weight_casts  # noqa: E402
from fastbert.ops.launch import fast_launch  # noqa: E402,F401 - the op files take it from here

TRITON_MISSING = ("fastbert's fused kernels (kernels='triton') need the triton package: pip install triton "
                  "(or pip install 'fastbert[triton]'); or use kernels='torch', which runs anywhere")


def _triton_missing(*_, **__):
    raise RuntimeError(TRITON_MISSING)


class _MissingKernel:
    """A kernel defined without Triton: launching it (``kernel[grid](...)``) or calling it raises."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = self.__qualname__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid):
        return _triton_missing

    def __call__(self, *args, **kwargs):
        _triton_missing()


class _MissingTriton:
    """Stands in for both ``triton`` and ``triton.language`` when Triton is not installed: the
    decorators and ``Config`` / ``constexpr`` used while an op file is imported work; anything else
    raises :data:`TRITON_MISSING`."""

    def jit(self, fn=None, **_):
        return _MissingKernel if fn is None else _MissingKernel(fn)

    def autotune(self, *_, **__):
        return lambda kernel: kernel

    heuristics = autotune

    def Config(self, *args, **kwargs):  # noqa: N802 - triton's name
        return args, kwargs

    def constexpr(self, value=None):
        return value

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        _triton_missing()


try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # the references (kernels="torch") work without it
    triton = tl = _MissingTriton()
    HAS_TRITON = False


def require_triton():
    """Raise the error that says how to get the fused kernels, unless Triton is installed."""
    if not HAS_TRITON:
        _triton_missing()


# Triton reads TRITON_INTERPRET when a kernel is defined; tests/conftest.py sets it before import.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Widest row the row-wise kernels (LayerNorm, embeddings) hold in registers.
MAX_FUSED_HIDDEN = 8192


# ----------------------------------------------------------------------------- custom ops
def register_op(name, schema, impl, fake):
    """Register ``impl`` as ``torch.ops.fastbert.<name>`` with a fake (meta) kernel, so that
    ``torch.compile`` treats it as one opaque node, and return a caller that goes through the
    custom op only while compiling: in eager mode the dispatcher round-trip (~100 us) costs more
    than most BERT-sized kernels, so ``impl`` is called directly. On a torch without
    ``torch.library.custom_op`` (< 2.4) ``impl`` is returned unchanged and the ops run eagerly. Arguments
    the schema marks as written (``Tensor(a!)``) are declared mutated."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:  # pragma: no cover - torch < 2.4
        return impl
    try:
        op = getattr(torch.ops.fastbert, name)  # already registered (module reloaded)
    except (AttributeError, RuntimeError):
        mutated = tuple(re.findall(r"Tensor\(\w!\)\??\s+(\w+)", schema))
        registered = custom_op(f"fastbert::{name}", impl, mutates_args=mutated, schema=schema)
        registered.register_fake(fake)
        op = getattr(torch.ops.fastbert, name)

    def call(*args):
        return op(*args) if torch.compiler.is_compiling() else impl(*args)

    call.op = op
    call.__name__ = call.__qualname__ = name
    call.__doc__ = impl.__doc__
    return call


class _SeedDraws:
    """Seeds for ``dropout_seed`` drawn ``size`` at a time (one kernel), handed out one by one."""

    def __init__(self, device, size: int):
        self.device, self.size = torch.device(device), max(1, int(size))
        self.values, self.used = None, 0

    def take(self) -> torch.Tensor:
        if self.values is None or self.used == self.size:
            self.values, self.used = torch.randint(0, 2**31 - 1, (self.size,), dtype=torch.int64,
                                                   device=self.device), 0
        self.used += 1
        return self.values[self.used - 1:self.used]


_draws = threading.local()  # .current: the _SeedDraws of the forward running in this thread, or None


@contextlib.contextmanager
def seed_draws(device, size: int):
    """Inside the block, ``dropout_seed(p, None, device)`` takes its seeds from draws of ``size`` seeds at a time:
    a model's forward draws all its dropout sites' seeds in one kernel (BERT-large: 72 launches fewer a step)
    instead of one each. Lazy: a forward without dropout draws nothing."""
    prev = getattr(_draws, "current", None)
    _draws.current = _SeedDraws(device, size)
    try:
        yield
    finally:
        _draws.current = prev


def dropout_seed(dropout_p: float, seed, device):
    """The dropout seed as the kernels read it: a one-element int64 tensor on ``device``, or None
    when dropout is off. ``seed=None`` draws one with torch's generator for ``device``, on the
    device (no host sync; ``torch.manual_seed`` fixes it; graph-safe, so each CUDA graph replay
    draws anew and activation checkpointing's RNG restore redraws the same), or takes the next of
    the running forward's draws (``seed_draws``); an int or a tensor fixes it."""
    if dropout_p == 0.0:
        return None
    if seed is None:
        draws = getattr(_draws, "current", None)
        if draws is not None and draws.device == torch.device(device) and not torch.compiler.is_compiling():
            return draws.take()
        return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
    if torch.is_tensor(seed):
        return seed.reshape(1).to(device=device, dtype=torch.int64)
    return torch.full((1,), int(seed) % 2**31, dtype=torch.int64, device=device)


def autocast_dtype(device: torch.device):
    """The dtype torch.autocast would run matmuls in on ``device``, or None outside autocast
    (custom ops are opaque to autocast, so the matmul ops cast their inputs themselves)."""
    try:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
    except (TypeError, AttributeError):  # pragma: no cover - torch < 2.4
        if device.type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    return None


def autocast_inputs(*tensors):
    """``tensors`` cast to the dtype ``torch.autocast`` runs matmuls in, as ``F.linear`` casts its inputs
    (custom ops are opaque to autocast); unchanged outside autocast. None entries stay None. A parameter's cast
    comes from the active ``weight_casts.WeightCasts`` where there is one (made once per optimizer step)."""
    dtype = autocast_dtype(next(t for t in tensors if t is not None).device)
    if dtype is None:
        return tensors
    return tuple(weight_casts.cast(t, dtype) if t is not None else None for t in tensors)


# ----------------------------------------------------------------------------- checks
def check_triton_device(*tensors):
    """Triton kernels need Triton, and CUDA tensors or the interpreter (TRITON_INTERPRET=1) for CPU ones."""
    require_triton()
    for t in tensors:
        if t is not None and not t.is_cuda and not INTERPRET:
            raise RuntimeError(
                f"fastbert Triton ops need CUDA tensors, got one on {t.device}; run on a GPU, set "
                "TRITON_INTERPRET=1 (slow, for tests), or use kernels='torch'")


def check_dropout_p(dropout_p: float):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")


def check_hidden(n: int, what: str):
    if n > MAX_FUSED_HIDDEN:
        raise ValueError(f"{what}: hidden size {n} exceeds the fused kernels' limit of {MAX_FUSED_HIDDEN}; "
                         "use kernels='torch' for wider rows")


# ----------------------------------------------------------------------------- launch settings
def _row_block_n(n_cols: int) -> int:
    """BLOCK_N of the row kernels: whole rows, >= 8 columns (dropout draws 8 columns per Philox call)."""
    return max(8, next_power_of_2(n_cols))


def row_block(n_cols: int):
    """(BLOCK_M, BLOCK_N, num_warps) for a kernel that keeps whole rows of ``n_cols`` in registers:
    several short rows per program so each program moves ~4K elements (16-byte accesses, enough
    loads in flight), one long row with more warps for wide hidden sizes. A warp a 1,024 elements: the
    LayerNorm forward at BERT's sizes ran 15-25% faster with 4 warps than with 8 on an H200 (graph-replayed,
    benchmarks/RESULTS.md, twentieth session)."""
    block_n = _row_block_n(n_cols)
    block_m = max(1, min(4096 // block_n, 16))
    num_warps = max(1, min(block_m * block_n // 1024, 16))
    return block_m, block_n, num_warps


def bwd_row_partition(m: int, n_cols: int, device: torch.device, elems_per_program: int = 2048,
                      warps_per_sm: int = 16):
    """(BLOCK_M, BLOCK_N, num_warps, programs, rows_per_program) for a row-wise backward that also
    reduces column sums (LayerNorm, embeddings): about ``warps_per_sm`` warps of programs an SM, each program
    walking whole BLOCK_M strips (about ``elems_per_program`` elements, 256 a warp) of its rows and writing one
    partial sum. The embeddings' backward runs 2,048 elements a program (two programs of 8 warps an SM at BERT's
    sizes); the LayerNorm backward, which loads the next strip during this one's math, 1,024 (four programs of 4
    warps): 23-34% faster than 2,048 without the prefetch on an H200 (benchmarks/RESULTS.md, twenty-second
    session)."""
    block_n = _row_block_n(n_cols)
    block_m = max(1, min(elems_per_program // block_n, 8))
    num_warps = max(1, min(block_m * block_n // 256, 16))
    programs_per_sm = max(1, warps_per_sm // num_warps)
    programs = max(1, min(cdiv(m, block_m), num_sms(device) * programs_per_sm))
    rows_per_program = cdiv(cdiv(max(m, 1), programs), block_m) * block_m
    programs = max(1, cdiv(m, rows_per_program))
    return block_m, block_n, num_warps, programs, rows_per_program


@fast_launch
@triton.jit
def _sum_partials_kernel(PART, OUT0, OUT1, OUT2, P, N, K: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """OUT<k>[cols] = sum over p of PART[p, k, cols], for one column strip (program_id 0) of one k
    (program_id 1), cast to OUT<k>'s dtype."""
    k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p in range(0, P, BLOCK_P):
        rows = p + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < P) & (cols[None, :] < N)
        acc += tl.load(PART + rows.to(tl.int64)[:, None] * (K * N) + k * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if k == 0:
        tl.store(OUT0 + cols, total.to(OUT0.dtype.element_ty), mask=cols < N)
    elif k == 1:
        tl.store(OUT1 + cols, total.to(OUT1.dtype.element_ty), mask=cols < N)
    elif K == 3:
        tl.store(OUT2 + cols, total.to(OUT2.dtype.element_ty), mask=cols < N)


def sum_partials(part: torch.Tensor, dtypes) -> list:
    """The per-program partial column sums ``part`` ``(programs, K, N)`` (fp32; K = 1 to 3) of a row-wise
    kernel, summed over programs into K separate vectors of ``dtypes``, in one launch (a torch sum per
    vector costs a launch each, ~6 us of GPU time apiece at BERT sizes; torch's sums over the rows of the FP8
    casts' (256, 3072 or 4096) partials averaged ~12 us each in an H100 profile)."""
    programs, k, n = part.shape
    outs = [torch.empty((n,), dtype=dt, device=part.device) for dt in dtypes]
    if n > 0:
        block_n = min(next_power_of_2(n), 32)  # narrow strips: enough programs for a few-us kernel
        _sum_partials_kernel[(cdiv(n, block_n), k)](
            part, outs[0], outs[min(1, k - 1)], outs[k - 1], programs, n, K=k, BLOCK_P=128, BLOCK_N=block_n,
            num_warps=4)
    return outs


def column_sums(part: torch.Tensor) -> torch.Tensor:
    """The fp32 column sums ``(N,)`` of the partial-sum rows ``part`` ``(programs, N)`` (fp32, contiguous) a kernel
    wrote, one row a program or tile: :func:`sum_partials` with one vector."""
    return sum_partials(part.view(part.shape[0], 1, part.shape[1]), [torch.float32])[0]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code: ``triton.cdiv`` is a constexpr function there (~2.5 us a call, a few hundred
    calls an eager BERT-base step; ``fastbert.ops.launch`` says why host time counts)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (``cdiv`` says why): the least power of 2 >= n, 0 for 0."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_SMS: dict = {}  # CUDA device index -> SM count


def device_index(device: torch.device) -> int:
    """A CUDA device's index; the current device's for a bare ``torch.device("cuda")``."""
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        index = device_index(device)
        if index not in _SMS:
            _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return _SMS[index]
    return 2  # interpreter: few programs run fastest


def raw_stream(device: torch.device) -> int:
    """The handle of ``device``'s current CUDA stream: ``torch.cuda.current_stream(device).cuda_stream`` without
    building a ``Stream`` object (tens of calls an eager step, from the GEMMs called through ctypes)."""
    return torch._C._cuda_getCurrentRawStream(device_index(device))


# ----------------------------------------------------------------------------- dropout
# Philox4x32 with 7 rounds, the fewest that pass BigCrush (Salmon et al. 2011, "Parallel random numbers: as easy
# as 1, 2, 3"), as FlashAttention draws its dropout; Triton's default is 10. Attention's forward at (32, 16, 512)
# with p = 0.1 runs 258 -> 238 us on an H200 (benchmarks/RESULTS.md, twenty-eighth session).
PHILOX_ROUNDS = tl.constexpr(7)


def drop_threshold(dropout_p: float) -> int:
    """Dropout as an integer test on 16 random bits: drop when they fall below round(p * 2^16), so p is
    kept within 2^-17."""
    return min(int(dropout_p * 2**16 + 0.5), 2**16 - 1)


@triton.jit
def dropout_bits(seed, rows, col_start, n_cols, threshold, BLOCK_N: tl.constexpr):
    """The keep-mask of columns col_start + [0, BLOCK_N) packed into bytes: a uint8 tile (len(rows),
    BLOCK_N // 8) whose byte j holds columns col_start + 8j + [0, 8), column 8j + k in bit k (1 = kept).

    One Philox call yields four 32-bit numbers, eight 16-bit halves; they serve eight consecutive
    columns (counter = row * ceil(n_cols / 8) + col // 8; column 8j + k takes half k % 2, low first, of
    number k // 2), so dropout costs a kernel an eighth of a Philox call per element: memory-bound
    kernels stay memory-bound, and attention's score tiles spend little on it. ``seed`` is an integer
    (the attention kernels put their (sequence, head) stream in its high 32 bits); ``col_start`` must
    be a multiple of 8 and BLOCK_N >= 8. A kernel that stores these bytes lets its backward read the
    mask instead of drawing it again (attention).
    """
    groups = col_start // 8 + tl.arange(0, BLOCK_N // 8)
    counters = rows.to(tl.int64)[:, None] * ((n_cols + 7) // 8) + groups[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counters, PHILOX_ROUNDS)
    thr = threshold.to(tl.uint32)
    bits = ((r0 & 0xFFFF) >= thr).to(tl.uint32)
    bits |= ((r0 >> 16) >= thr).to(tl.uint32) << 1
    bits |= ((r1 & 0xFFFF) >= thr).to(tl.uint32) << 2
    bits |= ((r1 >> 16) >= thr).to(tl.uint32) << 3
    bits |= ((r2 & 0xFFFF) >= thr).to(tl.uint32) << 4
    bits |= ((r2 >> 16) >= thr).to(tl.uint32) << 5
    bits |= ((r3 & 0xFFFF) >= thr).to(tl.uint32) << 6
    bits |= ((r3 >> 16) >= thr).to(tl.uint32) << 7
    return bits.to(tl.uint8)


@triton.jit
def keep_from_bits(bits):
    """The bool keep-mask (rows, 8 * bytes) of a :func:`dropout_bits` tile (rows, bytes)."""
    b = bits.to(tl.int32)
    # interleave(a, b) puts a at the even columns, b at the odd ones: column 8j + k takes bit k of byte j
    even = tl.interleave(tl.interleave(b & 1, (b >> 4) & 1), tl.interleave((b >> 2) & 1, (b >> 6) & 1))
    odd = tl.interleave(tl.interleave((b >> 1) & 1, (b >> 5) & 1), tl.interleave((b >> 3) & 1, (b >> 7) & 1))
    return tl.interleave(even, odd) != 0


@triton.jit
def dropout_keep(seed, rows, col_start, n_cols, threshold, BLOCK_N: tl.constexpr):
    """Keep-mask (True = kept) of shape (len(rows), BLOCK_N) for columns col_start + [0, BLOCK_N): the
    :func:`dropout_bits` draw, unpacked."""
    return keep_from_bits(dropout_bits(seed, rows, col_start, n_cols, threshold, BLOCK_N))


@fast_launch
@triton.jit(do_not_specialize=["threshold"])
def _dropout_mask_kernel(OUT, M, N, threshold, SEED, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_start = tl.program_id(1) * BLOCK_N
    cols = col_start + tl.arange(0, BLOCK_N)
    keep = dropout_keep(tl.load(SEED), rows, col_start, N, threshold, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(OUT + rows.to(tl.int64)[:, None] * N + cols[None, :], keep.to(tl.int8), mask=mask)


def dropout_mask(seed, n_rows: int, n_cols: int, dropout_p: float, device) -> torch.Tensor:
    """The bool keep-mask ``(n_rows, n_cols)`` that the fused ops draw for ``seed`` (int or the
    seed tensor) and ``dropout_p``."""
    out = torch.empty((n_rows, n_cols), dtype=torch.int8, device=device)
    check_triton_device(out)
    grid = (cdiv(n_rows, 16), cdiv(n_cols, 256))
    _dropout_mask_kernel[grid](out, n_rows, n_cols, drop_threshold(dropout_p), dropout_seed(1.0, seed, device),
                               BLOCK_M=16, BLOCK_N=256)
    return out.bool()
