"""Microbenchmarks of the fused Triton ops against torch eager and torch.compile, on one GPU.

    python3 benchmarks/bench_ops.py                 # all ops, BERT-base and BERT-large shapes
    python3 benchmarks/bench_ops.py --ops ln,ffn --no-compile

First every op is checked on the card against its plain-PyTorch reference (fp32 reference,
kernel error <= 2x torch's own bf16 error + atol); then each contender is timed in the same run
with CUDA events (triton.testing.do_bench, median, L2 flushed between runs) on random data, by default
replayed from a CUDA graph (GPU time; ``--timing eager``: plain calls, host overhead included).
Reported: milliseconds, achieved bandwidth (memory-bound ops: the bytes the fused op must move,
the same count for every contender) or TFLOP/s (matmul ops), speed-up over torch eager, and peak
memory allocated above the inputs. A table is printed last; with $OUT set, JSON goes to
$OUT/bench_ops.json.

Contenders per op:
  ln    residual + bias + dropout + LayerNorm: fastbert | torch eager reference | torch.compile(reference)
  ffn   gelu(x @ W.T + b), up-projection: fastbert | cuBLAS (F.linear) + separate F.gelu | torch.compile
  block the FFN block gelu(x @ W1.T + b1) @ W2.T, forward + backward, erf and tanh GELU: fastbert ffn (tanh:
        GELU and its derivative in cuBLASLt's GEMM epilogues) | cuBLAS + separate F.gelu | torch.compile
  emb   word + position + type gather, LayerNorm, dropout: fastbert | eager reference | torch.compile
  mlm   MLM head + loss at batch 128 x seq 128, 15% masked, vocab 30522: fastbert sparse fused |
        HF BertOnlyMLMHead on every token + CrossEntropyLoss (dense) | the same compiled |
        fastbert's sparse torch reference
  sm90  the FFN's GELU GEMMs with the exact GELU in CUTLASS sm_90a epilogues (ops/gemm_sm90.py), each launch shape:
        up-projection z = x W1^T + b1, y = gelu(z); the down-projection's input gradient dz = (d W2) * gelu'(z)
        with d(b1) |
        what runs without them (cuBLAS GEMM, then fastbert's Triton GELU / GELU' + d(bias) pass) | the cuBLAS GEMM
        alone; and the FFN block forward + backward both ways. BERT-large rows at TOKENS / 2 (the b128 step's)
  fp8   the encoder's four linears: bf16 cuBLAS (autocast F.linear) | fastbert FP8 linear (delayed-scaling
        casts + _scaled_mm), forward + backward; the cast alone (bytes: read 2, write 2 x 1 per element)
        and the FP8 GEMM alone beside the bf16 GEMM
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cuda_graph import capture  # noqa: E402
from fastbert.ops._common import dropout_mask  # noqa: E402
from fastbert.ops.embeddings import bert_embeddings, bert_embeddings_ref  # noqa: E402
from fastbert.ops.ffn import ffn, ffn_ref, gelu_grad_ref, linear_bias_gelu, linear_bias_gelu_ref  # noqa: E402
from fastbert.ops.layer_norm import dropout_add_layer_norm, dropout_add_layer_norm_ref  # noqa: E402
from fastbert.ops.mlm_loss import sparse_mlm_loss, sparse_mlm_loss_ref  # noqa: E402

DT = torch.bfloat16
DEV = "cuda"
TOKENS = 32768          # e.g. batch 256 x seq 128 of real (unpadded) tokens
TIMING = "graph"        # --timing
HIDDENS = (768, 1024)   # BERT-base, BERT-large
VOCAB = 30522
MLM_BATCH, MLM_SEQ = 128, 128
ROWS: list[dict] = []
CHECKS: list[dict] = []


# ----------------------------------------------------------------------------- helpers
def timed(fn):
    """(median ms, peak MiB allocated above what was live before the call). ``TIMING`` "graph": the GPU time
    of ``fn`` replayed from a CUDA graph (no host overhead on either side: what a graph-replayed training
    step sees); "eager": plain calls, Python, autograd and launches included."""
    if DEV != "cuda":  # --smoke on the CPU (interpreter): run once, no timing worth the name
        import time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3, 0.0
    from triton.testing import do_bench
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    if TIMING == "graph":
        graph = capture(fn)
        ms = do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
        del graph
        return ms, peak
    return do_bench(fn, warmup=25, rep=100, return_mode="median"), peak


def record(op, shape, mode, impl, ms, peak, *, nbytes=None, flops=None, eager_ms=None):
    row = dict(op=op, shape=shape, mode=mode, impl=impl, ms=round(ms, 4), peak_mib=round(peak, 1))
    if nbytes is not None:
        row["TB/s"] = round(nbytes / ms / 1e9, 3)
    if flops is not None:
        row["TFLOP/s"] = round(flops / ms / 1e9, 1)
    if eager_ms is not None:
        row["speedup_vs_eager"] = round(eager_ms / ms, 2)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def grad_fn(fn, inputs, grads):
    """A closure running fn forward + backward w.r.t. inputs (returning nothing)."""
    def run():
        outs = fn()
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        torch.autograd.grad([o for o in outs[:len(grads)]], inputs, grads[:len(outs)])
    return run


def maybe_compile(fn, enabled):
    return torch.compile(fn, dynamic=False) if enabled else None


def randn(*shape, g, scale=1.0, shift=0.0):
    return shift + scale * torch.randn(*shape, generator=g).to(DEV, DT)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def check(name, out, same, ref, atol=1e-2):
    """Kernel error vs the fp32 reference within 2x torch's own same-dtype error + atol."""
    ref = ref.double()
    err = (out.double() - ref).abs().max().item()
    err_same = (same.double() - ref).abs().max().item()
    tol = 2 * err_same + atol * max(1.0, ref.abs().max().item())
    ok = err <= tol and err == err  # NaN fails
    CHECKS.append(dict(check=name, err=err, torch_err=err_same, ok=ok))
    print(f"check {name:<40} kernel err {err:9.3g}  torch same-dtype err {err_same:9.3g}  {'PASS' if ok else 'FAIL'}",
          flush=True)


def leaves(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() if t is not None else None for t in tensors]


# ----------------------------------------------------------------------------- LayerNorm
def ln_inputs(m, n, g):
    return [randn(m, n, g=g),                       # x (matmul output, no bias)
            randn(m, n, g=g),                       # residual
            randn(n, g=g, scale=0.1, shift=1.0),    # weight
            randn(n, g=g, scale=0.1),               # bias
            randn(n, g=g, scale=0.1)]               # x_bias


def bench_ln(n, compile_):
    g = gen(0)
    m = TOKENS
    x, r, w, b, xb = ln_inputs(m, n, g)
    shape = f"{m}x{n}"
    # correctness (full op: bias + dropout + residual, prenorm outputs) vs fp32 with the same mask
    mask = dropout_mask(3, m, n, 0.1, DEV)
    dy = randn(m, n, g=g)

    def masked_ref(x, r, w, b, xb):
        return dropout_add_layer_norm_ref((x + xb) * mask / 0.9, r, w, b, 1e-12)
    results = []
    for fn, dt in ((lambda *a: dropout_add_layer_norm(*a[:4], 1e-12, x_bias=a[4], dropout_p=0.1, seed=3), DT),
                   (masked_ref, DT), (masked_ref, torch.float32)):
        ins = leaves((x, r, w, b, xb), dt)
        out = fn(*ins)
        results.append((out, torch.autograd.grad(out, ins, dy.to(dt))))
    for i, name in enumerate(("out", "dx", "dresidual", "dweight", "dbias", "dx_bias")):
        get = (lambda r: r[0]) if i == 0 else (lambda r, i=i: r[1][i - 1])
        check(f"ln {shape} {name}", *(get(r) for r in results))

    # forward: residual add + LayerNorm (the baseline) and the full training op
    for label, kw, extra in (("add+LN", {}, None), ("bias+dropout+add+LN", dict(dropout_p=0.1), xb)):
        fused = lambda: dropout_add_layer_norm(x, r, w, b, 1e-12, x_bias=extra, seed=1, **kw)  # noqa: E731
        eager = lambda: dropout_add_layer_norm_ref(x, r, w, b, 1e-12, x_bias=extra, **kw)  # noqa: E731
        nbytes = 3 * m * n * 2  # read x, residual; write y
        with torch.no_grad():
            t_e, p_e = timed(eager)
            record("ln", shape, f"fwd {label}", "torch eager", t_e, p_e, nbytes=nbytes, eager_ms=t_e)
            comp = maybe_compile(dropout_add_layer_norm_ref, compile_)
            if comp is not None:
                t, p = timed(lambda: comp(x, r, w, b, 1e-12, x_bias=extra, **kw))
                record("ln", shape, f"fwd {label}", "torch.compile", t, p, nbytes=nbytes, eager_ms=t_e)
            t, p = timed(fused)
            record("ln", shape, f"fwd {label}", "fastbert", t, p, nbytes=nbytes, eager_ms=t_e)

    # forward + backward of the full op: bytes the fused op must move (fwd 3, bwd x, res, dy in; dx, dres out)
    nbytes = 8 * m * n * 2
    ins = leaves((x, r, w, b, xb))
    kw = dict(x_bias=ins[4], dropout_p=0.1)
    t_e, p_e = timed(grad_fn(lambda: dropout_add_layer_norm_ref(*ins[:4], 1e-12, **kw), ins, [dy]))
    record("ln", shape, "fwd+bwd bias+dropout+add+LN", "torch eager", t_e, p_e, nbytes=nbytes, eager_ms=t_e)
    comp = maybe_compile(dropout_add_layer_norm_ref, compile_)
    if comp is not None:
        t, p = timed(grad_fn(lambda: comp(*ins[:4], 1e-12, **kw), ins, [dy]))
        record("ln", shape, "fwd+bwd bias+dropout+add+LN", "torch.compile", t, p, nbytes=nbytes, eager_ms=t_e)
    t, p = timed(grad_fn(lambda: dropout_add_layer_norm(*ins[:4], 1e-12, seed=1, **kw), ins, [dy]))
    record("ln", shape, "fwd+bwd bias+dropout+add+LN", "fastbert", t, p, nbytes=nbytes, eager_ms=t_e)


# ----------------------------------------------------------------------------- FFN
def cublas_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def bench_ffn(k, compile_):
    g = gen(1)
    m, n = TOKENS, 4 * k
    x = randn(m, k, g=g)
    w = randn(n, k, g=g, scale=k ** -0.5)
    b = randn(n, g=g, scale=0.1)
    dy = randn(m, n, g=g)
    shape = f"{m}x{k}->{n}"
    results = []
    for fn, dt in ((linear_bias_gelu, DT), (linear_bias_gelu_ref, DT), (linear_bias_gelu_ref, torch.float32)):
        ins = leaves((x, w, b), dt)
        out = fn(*ins)
        results.append((out, torch.autograd.grad(out, ins, dy.to(dt))))
    for i, name in enumerate(("out", "dx", "dweight", "dbias")):
        get = (lambda r: r[0]) if i == 0 else (lambda r, i=i: r[1][i - 1])
        check(f"ffn {shape} {name}", *(get(r) for r in results))

    flops = 2 * m * n * k
    with torch.no_grad():
        t_e, p_e = timed(lambda: cublas_gelu(x, w, b))
        record("ffn", shape, "fwd (inference)", "cuBLAS + F.gelu", t_e, p_e, flops=flops, eager_ms=t_e)
        comp = maybe_compile(cublas_gelu, compile_)
        if comp is not None:
            t, p = timed(lambda: comp(x, w, b))
            record("ffn", shape, "fwd (inference)", "torch.compile", t, p, flops=flops, eager_ms=t_e)
        t, p = timed(lambda: F.linear(x, w, b))
        record("ffn", shape, "fwd (inference)", "cuBLAS GEMM+bias alone (no GELU)", t, p, flops=flops, eager_ms=t_e)
        t, p = timed(lambda: linear_bias_gelu(x, w, b))
        record("ffn", shape, "fwd (inference)", "fastbert", t, p, flops=flops, eager_ms=t_e)
    # training: the forward also keeps the pre-activation for the backward (as eager torch does)
    ins = leaves((x, w, b))
    t_e, p_e = timed(lambda: cublas_gelu(*ins))
    record("ffn", shape, "fwd (training)", "cuBLAS + F.gelu", t_e, p_e, flops=flops, eager_ms=t_e)
    t, p = timed(lambda: linear_bias_gelu(*ins))
    record("ffn", shape, "fwd (training)", "fastbert", t, p, flops=flops, eager_ms=t_e)
    t_e, p_e = timed(grad_fn(lambda: cublas_gelu(*ins), ins, [dy]))
    record("ffn", shape, "fwd+bwd", "cuBLAS + F.gelu", t_e, p_e, flops=3 * flops, eager_ms=t_e)
    comp = maybe_compile(cublas_gelu, compile_)
    if comp is not None:
        t, p = timed(grad_fn(lambda: comp(*ins), ins, [dy]))
        record("ffn", shape, "fwd+bwd", "torch.compile", t, p, flops=3 * flops, eager_ms=t_e)
    t, p = timed(grad_fn(lambda: linear_bias_gelu(*ins), ins, [dy]))
    record("ffn", shape, "fwd+bwd", "fastbert", t, p, flops=3 * flops, eager_ms=t_e)


def bench_block(k, compile_):
    g = gen(5)
    m, n = TOKENS, 4 * k
    x = randn(m, k, g=g)
    w1, b1 = randn(n, k, g=g, scale=k ** -0.5), randn(n, g=g, scale=0.1)
    w2 = randn(k, n, g=g, scale=n ** -0.5)
    dy = randn(m, k, g=g)
    shape = f"{m}x{k}->{n}->{k}"
    flops = 3 * 2 * (2 * m * n * k)  # two GEMMs, forward + backward
    for approx in ("none", "tanh"):
        results = []
        for fn, dt in ((ffn, DT), (ffn_ref, DT), (ffn_ref, torch.float32)):
            ins = leaves((x, w1, b1, w2), dt)
            out = fn(*ins, approximate=approx)
            results.append((out, torch.autograd.grad(out, ins, dy.to(dt))))
        for i, name in enumerate(("out", "dx", "dw1", "db1", "dw2")):
            get = (lambda r: r[0]) if i == 0 else (lambda r, i=i: r[1][i - 1])
            check(f"block {approx} {shape} {name}", *(get(r) for r in results))
        ins = leaves((x, w1, b1, w2))
        mode = f"fwd+bwd, {approx} GELU"
        t_e, p_e = timed(grad_fn(lambda: ffn_ref(*ins, approximate=approx), ins, [dy]))
        record("block", shape, mode, "cuBLAS + F.gelu", t_e, p_e, flops=flops, eager_ms=t_e)
        comp = maybe_compile(lambda *t: ffn_ref(*t, approximate=approx), compile_)
        if comp is not None:
            t, p = timed(grad_fn(lambda: comp(*ins), ins, [dy]))
            record("block", shape, mode, "torch.compile", t, p, flops=flops, eager_ms=t_e)
        t, p = timed(grad_fn(lambda: ffn(*ins, approximate=approx), ins, [dy]))
        record("block", shape, mode, "fastbert", t, p, flops=flops, eager_ms=t_e)


# ----------------------------------------------------------------------------- FFN GEMMs with GELU epilogues (sm_90)
def _sm90_checks(gemm_sm90, m, k, n, g, tag):
    """Every launch shape's y = gelu(z), g = gelu'(z) and dz = (d @ w2) * g against float64, beside torch's bf16
    error on the same inputs."""
    x, w, b = randn(m, k, g=g), randn(n, k, g=g, scale=k ** -0.5), randn(n, g=g, scale=0.1)
    d, w2 = randn(m, k, g=g), randn(k, n, g=g, scale=n ** -0.5)
    z_ref = F.linear(x.double(), w.double(), b.double())
    z_t = F.linear(x, w, b)
    g_t = gelu_grad_ref(z_t).to(DT)  # the derivative as the backward reads it
    dz_ref = (d.double() @ w2.double()) * g_t.double()
    dz_t = ((d @ w2).float() * g_t.float()).to(DT)
    for v in range(gemm_sm90.variants()):
        gemm_sm90.VARIANT.update(bias_gelu=v, dgelu=v)
        y, gz = gemm_sm90.bias_gelu(x, w, b)
        check(f"sm90 v{v} {tag} y", y, F.gelu(z_t), F.gelu(z_ref))
        check(f"sm90 v{v} {tag} gelu'(z)", gz, g_t, gelu_grad_ref(z_ref))
        dz, db = gemm_sm90.dgelu(d, w2, g_t)
        check(f"sm90 v{v} {tag} dz", dz, dz_t, dz_ref)
        check(f"sm90 v{v} {tag} dbias", db, dz_t.float().sum(0), dz_ref.sum(0))


def bench_sm90(k, compile_):
    from fastbert.ops import gemm_sm90
    from fastbert.ops.ffn import gelu_bwd, gelu_grad_ref, linear_bias_gelu_fwd
    why = gemm_sm90.ready() if DEV == "cuda" else "no GPU"
    if why:
        print(f"sm90: skipped ({why})", flush=True)
        return
    default = dict(gemm_sm90.VARIANT)
    g = gen(9)
    m, n = (TOKENS // 2 if k >= 1024 else TOKENS), 4 * k
    _sm90_checks(gemm_sm90, 1000, k, n, g, f"1000x{k}->{n}")  # a partial last row tile
    _sm90_checks(gemm_sm90, 96, 40, 72, g, "96x40->72")        # partial K and N tiles
    _sm90_checks(gemm_sm90, m, k, n, g, f"{m}x{k}->{n}")
    x, w, b = randn(m, k, g=g), randn(n, k, g=g, scale=k ** -0.5), randn(n, g=g, scale=0.1)
    d, w2 = randn(m, k, g=g), randn(k, n, g=g, scale=n ** -0.5)
    z = F.linear(x, w, b)
    gz = gelu_grad_ref(z).to(DT)
    flops = 2 * m * n * k
    shape = f"{m}x{k}->{n}"
    gemm_sm90.ENABLED = False
    t_g, p = timed(lambda: F.linear(x, w, b))
    record("sm90", shape, "up-projection fwd", "cuBLAS GEMM+bias alone", t_g, p, flops=flops)
    t_e, p = timed(lambda: linear_bias_gelu_fwd(x, w, b, "none", True))
    record("sm90", shape, "up-projection fwd", "cuBLAS + Triton GELU (without sm90)", t_e, p, flops=flops, eager_ms=t_e)
    gemm_sm90.ENABLED = True
    for v in range(gemm_sm90.variants()):
        gemm_sm90.VARIANT["bias_gelu"] = v
        t, p = timed(lambda: gemm_sm90.bias_gelu(x, w, b))
        record("sm90", shape, "up-projection fwd", f"sm90 bias+GELU v{v}", t, p, flops=flops, eager_ms=t_e)
    gemm_sm90.ENABLED = False
    t_g, p = timed(lambda: d @ w2)
    record("sm90", shape, "down-projection dgrad", "cuBLAS GEMM alone", t_g, p, flops=flops)
    t_e, p = timed(lambda: gelu_bwd(d @ w2, z, "none"))
    record("sm90", shape, "down-projection dgrad", "cuBLAS + Triton GELU' + d(bias) (without sm90)", t_e, p,
           flops=flops, eager_ms=t_e)
    gemm_sm90.ENABLED = True
    for v in range(gemm_sm90.variants()):
        gemm_sm90.VARIANT["dgelu"] = v
        t, p = timed(lambda: gemm_sm90.dgelu(d, w2, gz))
        record("sm90", shape, "down-projection dgrad", f"sm90 dGELU + d(bias) v{v}", t, p, flops=flops,
               eager_ms=t_e)
    gemm_sm90.VARIANT.update(default)
    ins = leaves((x, w, b, w2))  # ffn's w2 is (hidden, intermediate), as here
    dy = randn(m, k, g=g)
    for enabled in (False, True):
        gemm_sm90.ENABLED = enabled
        t, p = timed(grad_fn(lambda: ffn(*ins), ins, [dy]))
        record("sm90", f"{m}x{k}->{n}->{k}", "FFN block fwd+bwd", "with sm90" if enabled else "without sm90", t, p,
               flops=3 * 2 * flops)
    gemm_sm90.ENABLED = True


# ----------------------------------------------------------------------------- FP8 linears
def bench_fp8(h, compile_):
    """The encoder's four linears at hidden ``h`` (QKV h->3h, attention output h->h, up h->4h, down 4h->h):
    bf16 cuBLAS (F.linear) vs fastbert's FP8 linear (casts with delayed scaling + three _scaled_mm), forward
    + backward; the FP8 GEMMs alone on pre-cast operands show what the casts cost."""
    from fastbert.ops.fp8 import E4M3, AmaxHistory, cast_fp8, fp8_linear
    g = gen(5)
    m = TOKENS
    for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
        shape = f"{m}x{k}->{n}"
        act = DT if DEV == "cuda" else torch.float32   # bf16 activations under autocast; fp32 on the CPU smoke
        x = randn(m, k, g=g).to(act)
        w = randn(n, k, g=g, scale=k ** -0.5).float()   # fp32 master weights, as under autocast
        b = randn(n, g=g, scale=0.1).float()
        dy = randn(m, n, g=g, scale=1e-3).to(act)
        history = AmaxHistory(3, DEV)
        history.advance()

        def fp8_fn(*a):
            return fp8_linear(*a, history, 0)

        def bf16_fn(xx, ww, bb):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=DEV == "cuda"):
                return F.linear(xx, ww, bb)
        outs = []
        for fn, dt in ((fp8_fn, None), (F.linear, torch.float32)):
            ins = leaves((x, w, b), dt)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=DEV == "cuda" and dt is None):
                out = fn(*ins)
            outs.append((out, torch.autograd.grad(out, ins, dy.to(out.dtype))))
        for i, name in enumerate(("out", "dx", "dweight")):
            a, r = (outs[0][0], outs[1][0]) if i == 0 else (outs[0][1][i - 1], outs[1][1][i - 1])
            err = ((a.double() - r.double()).norm() / r.double().norm()).item()
            bound = 0.06 if i == 0 else 0.11   # the format's rounding (tests/ops/test_fp8.py says why)
            CHECKS.append(dict(check=f"fp8 {shape} {name}", err=err, torch_err=bound, ok=err <= bound))
            print(f"check fp8 {shape} {name:<8} relative error {err:.4f} (bound {bound})", flush=True)
        flops = 2 * m * n * k
        ins = leaves((x, w, b))
        t_e, p_e = timed(grad_fn(lambda: bf16_fn(*ins), ins, [dy]))
        record("fp8", shape, "fwd+bwd", "bf16 cuBLAS (autocast F.linear)", t_e, p_e, flops=3 * flops, eager_ms=t_e)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=DEV == "cuda"):
            t, p = timed(grad_fn(lambda: fp8_fn(*ins), ins, [dy]))
        record("fp8", shape, "fwd+bwd", "fastbert fp8_linear", t, p, flops=3 * flops, eager_ms=t_e)
        with torch.no_grad():
            x8, x8t, sx, _ = cast_fp8(x, history, 0, E4M3)
            w8, w8t, sw, _ = cast_fp8(w, history, 1, E4M3)
            t, p = timed(lambda: cast_fp8(x, history, 0, E4M3))
            record("fp8", shape, "cast x (+transpose, amax)", "fastbert", t, p, nbytes=x.numel() * 4, eager_ms=t)
            if DEV == "cuda":  # each of the three GEMMs alone, FP8 on pre-cast operands beside bf16 cuBLAS
                from fastbert.ops.fp8 import E5M2
                g8, g8t, sg, _ = cast_fp8(dy, history, 2, E5M2)
                wb, dyb = w.to(DT), dy.to(DT)
                gemms = {
                    "fwd x W^T": (lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=DT,
                                                           use_fast_accum=True), lambda: x @ wb.t()),
                    "dgrad dy W": (lambda: torch._scaled_mm(g8, w8t.t(), scale_a=sg, scale_b=sw, out_dtype=DT),
                                   lambda: dyb @ wb),
                    "wgrad dy^T x": (lambda: torch._scaled_mm(g8t, x8t.t(), scale_a=sg, scale_b=sx,
                                                              out_dtype=torch.float32), lambda: dyb.t() @ x),
                }
                for what, (f8, f16) in gemms.items():
                    t, p = timed(f8)
                    record("fp8", shape, f"GEMM {what}", "_scaled_mm fp8", t, p, flops=flops)
                    t, p = timed(f16)
                    record("fp8", shape, f"GEMM {what}", "bf16 cuBLAS", t, p, flops=flops)


# ----------------------------------------------------------------------------- embeddings
def bench_emb(n, compile_):
    g = gen(2)
    m = TOKENS
    ids = torch.randint(0, VOCAB, (m,), generator=g).to(DEV)
    pos = torch.arange(m, device=DEV) % 128
    typ = (torch.arange(m, device=DEV) % 128 >= 64).long()
    tables = [randn(VOCAB, n, g=g, scale=0.02), randn(512, n, g=g, scale=0.02), randn(2, n, g=g, scale=0.02),
              randn(n, g=g, scale=0.1, shift=1.0), randn(n, g=g, scale=0.1)]
    dy = randn(m, n, g=g)
    shape = f"{m}x{n}"
    mask = dropout_mask(4, m, n, 0.1, DEV)

    def masked_ref(*t):
        return bert_embeddings_ref(ids, pos, typ, *t, 1e-12, padding_idx=0) * mask / 0.9
    results = []
    for fn, dt in ((lambda *t: bert_embeddings(ids, pos, typ, *t, 1e-12, dropout_p=0.1, seed=4, padding_idx=0), DT),
                   (masked_ref, DT), (masked_ref, torch.float32)):
        ins = leaves(tables, dt)
        out = fn(*ins)
        results.append((out, torch.autograd.grad(out, ins, dy.to(dt))))
    for i, name in enumerate(("out", "dword", "dposition", "dtype", "dln_weight", "dln_bias")):
        get = (lambda r: r[0]) if i == 0 else (lambda r, i=i: r[1][i - 1])
        check(f"emb {shape} {name}", *(get(r) for r in results))

    nbytes = 4 * m * n * 2  # three gathered rows + the output
    kw = dict(dropout_p=0.1, padding_idx=0)
    with torch.no_grad():
        t_e, p_e = timed(lambda: bert_embeddings_ref(ids, pos, typ, *tables, 1e-12, **kw))
        record("emb", shape, "fwd", "torch eager", t_e, p_e, nbytes=nbytes, eager_ms=t_e)
        comp = maybe_compile(bert_embeddings_ref, compile_)
        if comp is not None:
            t, p = timed(lambda: comp(ids, pos, typ, *tables, 1e-12, **kw))
            record("emb", shape, "fwd", "torch.compile", t, p, nbytes=nbytes, eager_ms=t_e)
        t, p = timed(lambda: bert_embeddings(ids, pos, typ, *tables, 1e-12, seed=1, **kw))
        record("emb", shape, "fwd", "fastbert", t, p, nbytes=nbytes, eager_ms=t_e)
    ins = leaves(tables)
    t_e, p_e = timed(grad_fn(lambda: bert_embeddings_ref(ids, pos, typ, *ins, 1e-12, **kw), ins, [dy]))
    record("emb", shape, "fwd+bwd", "torch eager", t_e, p_e, eager_ms=t_e)
    comp = maybe_compile(bert_embeddings_ref, compile_)
    if comp is not None:
        t, p = timed(grad_fn(lambda: comp(ids, pos, typ, *ins, 1e-12, **kw), ins, [dy]))
        record("emb", shape, "fwd+bwd", "torch.compile", t, p, eager_ms=t_e)
    t, p = timed(grad_fn(lambda: bert_embeddings(ids, pos, typ, *ins, 1e-12, seed=1, **kw), ins, [dy]))
    record("emb", shape, "fwd+bwd", "fastbert", t, p, eager_ms=t_e)


# ----------------------------------------------------------------------------- MLM loss
def bench_mlm(h, compile_):
    from transformers import BertConfig as HFConfig
    from transformers.models.bert.modeling_bert import BertOnlyMLMHead
    g = gen(3)
    batch, seq = MLM_BATCH, MLM_SEQ
    m = batch * seq
    hidden = randn(m, h, g=g)
    labels = torch.randint(0, VOCAB, (m,), generator=g)
    labels[torch.rand(m, generator=g) >= 0.15] = -100
    labels = labels.to(DEV)
    torch.manual_seed(0)
    head = BertOnlyMLMHead(HFConfig(hidden_size=h, vocab_size=VOCAB)).to(DEV, DT)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.uniform_(-0.1, 0.1)
        head.predictions.transform.LayerNorm.weight.add_(1)
    t = head.predictions.transform
    dec = head.predictions.decoder
    # transformers 5 gives the decoder its own bias; older versions share head.predictions.bias
    params = [t.dense.weight, t.dense.bias, t.LayerNorm.weight, t.LayerNorm.bias, dec.weight,
              dec.bias if dec.bias is not None else head.predictions.bias]
    shape = f"{batch}x{seq} h{h} V{VOCAB} ({int((labels != -100).sum())} masked)"

    def sparse(fn, hid, ps):
        return fn(hid, labels, ps[0], ps[1], ps[2], ps[3], 1e-12, ps[4], ps[5])

    results = []
    for fn, dt in ((sparse_mlm_loss, DT), (sparse_mlm_loss_ref, DT), (sparse_mlm_loss_ref, torch.float32)):
        ins = leaves([hidden] + params, dt)
        loss, correct, count = sparse(fn, ins[0], ins[1:])
        results.append((loss, torch.autograd.grad(loss, ins), int(correct), int(count)))
    check(f"mlm {shape} loss", *(r[0] for r in results))
    for i, name in enumerate(("dhidden", "ddense_w", "ddense_b", "dln_w", "dln_b", "ddecoder_w", "ddecoder_b")):
        check(f"mlm h{h} {name}", *(r[1][i] for r in results))
    ok = results[0][3] == results[2][3] and abs(results[0][2] - results[2][2]) <= 2
    CHECKS.append(dict(check=f"mlm h{h} counts", ok=ok, fused=results[0][2:], ref=results[2][2:]))

    ins = leaves([hidden] + params)

    def hf_dense(hid, module):
        scores = module(hid.view(batch, seq, h))  # (B, S, V)
        return F.cross_entropy(scores.view(-1, VOCAB), labels)

    hf_params = params  # the parameters HF's forward uses
    t_e, p_e = timed(grad_fn(lambda: hf_dense(ins[0], head), [ins[0]] + hf_params, [None]))
    record("mlm", shape, "fwd+bwd", "HF dense head", t_e, p_e, eager_ms=t_e)
    if compile_:
        comp_head = torch.compile(head, dynamic=False)
        t, p = timed(grad_fn(lambda: hf_dense(ins[0], comp_head), [ins[0]] + hf_params, [None]))
        record("mlm", shape, "fwd+bwd", "HF dense head, torch.compile", t, p, eager_ms=t_e)
    t, p = timed(grad_fn(lambda: sparse(sparse_mlm_loss_ref, ins[0], ins[1:])[0], ins, [None]))
    record("mlm", shape, "fwd+bwd", "fastbert sparse torch ref", t, p, eager_ms=t_e)
    t, p = timed(grad_fn(lambda: sparse(sparse_mlm_loss, ins[0], ins[1:])[0], ins, [None]))
    record("mlm", shape, "fwd+bwd", "fastbert fused", t, p, eager_ms=t_e)
    ROWS[-1]["memory_vs_hf"] = round(p_e / max(p, 1e-6), 2)


# ----------------------------------------------------------------------------- main
def print_table():
    cols = ["op", "shape", "mode", "impl", "ms", "TB/s", "TFLOP/s", "speedup_vs_eager", "peak_mib"]
    widths = {c: max([len(c), *(len(str(r.get(c, ""))) for r in ROWS)]) for c in cols}
    print("\n" + "  ".join(c.ljust(widths[c]) for c in cols))
    for r in ROWS:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))
    bad = [c["check"] for c in CHECKS if not c["ok"]]
    print(f"\ncorrectness: {len(CHECKS) - len(bad)}/{len(CHECKS)} checks passed" + (f"; FAILED: {bad}" if bad else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default="ln,ffn,block,emb,mlm,fp8,sm90",
                    help="comma-separated subset of ln,ffn,block,emb,mlm,fp8,sm90")
    ap.add_argument("--hidden", default=",".join(map(str, HIDDENS)), help="hidden sizes to sweep")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile contenders")
    ap.add_argument("--timing", choices=("graph", "eager"), default="graph",
                    help="graph: GPU time of CUDA-graph replays, every contender alike (default; before the tenth "
                         "session the script timed eager calls); eager: plain calls, host overhead included")
    ap.add_argument("--compile-hidden", default=None,
                    help="hidden sizes at which to time torch.compile (default: all; compiling costs ~10-30 s each)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script, times nothing real)")
    args = ap.parse_args(argv)
    global DEV, DT, TOKENS, VOCAB, MLM_BATCH, MLM_SEQ, TIMING
    TIMING = args.timing
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernels in the Triton interpreter: set TRITON_INTERPRET=1")
        DEV, DT, TOKENS, VOCAB, MLM_BATCH, MLM_SEQ = "cpu", torch.float16, 64, 300, 4, 16
        args.no_compile = True
        if args.hidden == ",".join(map(str, HIDDENS)):
            args.hidden = "48"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_ops.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1 on the CPU)")
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}  torch {torch.__version__}  timing: {TIMING}", flush=True)
    import triton
    print(f"triton {triton.__version__}", flush=True)
    benches = {"ln": bench_ln, "ffn": bench_ffn, "block": bench_block, "emb": bench_emb, "mlm": bench_mlm,
               "fp8": bench_fp8, "sm90": bench_sm90}
    for op in args.ops.split(","):
        for h in map(int, args.hidden.split(",")):
            compile_here = not args.no_compile and (
                args.compile_hidden is None or str(h) in args.compile_hidden.split(","))
            benches[op](h, compile_here)
            torch.cuda.empty_cache()
    print_table()
    out = os.environ.get("OUT")
    if out:
        meta = dict(device=name, torch=torch.__version__, triton=triton.__version__, timing=TIMING)
        Path(out, "bench_ops.json").write_text(json.dumps(dict(meta=meta, checks=CHECKS, rows=ROWS), indent=1))
    return 0 if all(c["ok"] for c in CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
