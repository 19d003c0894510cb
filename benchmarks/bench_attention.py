"""Varlen flash attention (fastbert, Triton) vs torch ``F.scaled_dot_product_attention`` on BERT shapes.

For every (B, H, S, D) and length distribution, FIRST checks correctness on the card (fastbert's
output and dq/dk/dv against an fp32 reference, within 2x SDPA's own bf16 error + atol), then times
forward and forward+backward with CUDA events (``triton.testing.do_bench``, median), two ways:

  graph    the call replayed from a CUDA graph: GPU time, no host overhead on either side (the
           kernels' speed, and what a training step sees when the host runs ahead of the GPU)
  eager    plain calls: adds Python, autograd and launch overhead; ``host us`` is the host's time
           per call. fastbert's Python autograd.Function + Triton launches cost more host time than
           SDPA's C++ path, so at these sizes eager numbers can measure the host, not the kernels.

Length distributions:

  full     every sequence S tokens: SDPA without a mask (the backend torch picks: cuDNN on an H100, torch 2.11)
  uniform  lengths uniform in [0.3 S, S] (65% fill): SDPA on the padded batch with a boolean key-padding mask
  fill60   lengths uniform in [0.2 S, S] (60% fill: issue 18's condition), SDPA as for uniform
  wiki     lengths of real Wikipedia paragraphs (bert-base WordPiece, benchmarks/data), clipped to S

fastbert runs on the unpadded tokens only (the encoder unpads once per model, not per layer), called as
the model calls it: ``varlen_attention_qkvpacked`` on the fused QKV projection's output, its gradient
produced packed (before the tenth session the script unbound q, k, v first and so also timed the stack
copy of their gradients, which the model never makes). SDPA gets separate q, k, v, as HF calls it.
Each provider is timed without dropout and with p=0.1 (BERT's attention dropout; SDPA draws its own
mask), and compared with SDPA at the same dropout.
TFLOP/s count real tokens only, for every provider: forward 4 * H * D * sum(len^2) (QK^T and PV),
forward+backward 3.5x that (the backward's five GEMMs = 2.5x forward). Padding work is never credited.

  python3 benchmarks/bench_attention.py                 # table + $OUT/bench_attention.json
  python3 benchmarks/bench_attention.py --sweep short   # first re-tune short-sequence launches (all: + S=512)
  python3 -m pytest benchmarks/bench_attention.py       # pytest-benchmark (needs CUDA)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.cuda_graph import capture  # noqa: E402
from fastbert.ops import attention as attn  # noqa: E402
from fastbert.ops._common import dropout_seed  # noqa: E402
from fastbert.ops.attention import varlen_attention_qkvpacked, varlen_attention_ref  # noqa: E402

SHAPES = [(64, 16, 128, 64), (64, 12, 128, 64), (16, 16, 512, 64), (32, 12, 512, 64)]
DISTS = ("full", "uniform", "fill60", "wiki")
LOW_END = {"uniform": 0.3, "fill60": 0.2}  # the shortest length of the uniform distributions, as a fraction of S
ATOL_BF16 = 1e-2


# ---------------------------------------------------------------------------------- cases
def sample_lengths(dist: str, batch: int, seq: int, rng: np.random.Generator) -> list[int]:
    if dist == "full":
        return [seq] * batch
    if dist in LOW_END:
        return rng.integers(math.ceil(LOW_END[dist] * seq), seq + 1, size=batch).tolist()
    counts = np.array(json.loads((HERE / "data" / "wiki_paragraph_lengths.json").read_text())["counts"], float)
    counts[:3] = 0  # a sequence has at least [CLS] x [SEP]
    return np.minimum(rng.choice(len(counts), size=batch, p=counts / counts.sum()), seq).tolist()


@dataclass
class Case:
    batch: int
    heads: int
    seq: int
    head_dim: int
    dist: str
    lengths: list
    qkv: torch.Tensor        # (T, 3, H, D) leaf: real tokens only
    dout: torch.Tensor       # (T, H, D)
    cu_seqlens: torch.Tensor
    padded: tuple            # q, k, v (B, H, S, D) leaves, padding zero
    dout_padded: torch.Tensor
    key_mask: torch.Tensor | None  # (B, 1, 1, S) bool, None when every sequence is full

    @property
    def fill(self) -> float:
        return sum(self.lengths) / (self.batch * self.seq)

    def flops(self, pass_: str) -> float:
        fwd = 4.0 * self.heads * self.head_dim * sum(n * n for n in self.lengths)
        return fwd if pass_ == "fwd" else 3.5 * fwd


def make_case(shape, dist, dtype=torch.bfloat16, seed=0) -> Case:
    batch, heads, seq, head_dim = shape
    rng = np.random.default_rng(seed)
    lengths = sample_lengths(dist, batch, seq, rng)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cu = cu.cuda()
    total = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(total, 3, heads, head_dim, device="cuda", generator=g).to(dtype)
    dout = torch.randn(total, heads, head_dim, device="cuda", generator=g).to(dtype)
    real = torch.arange(seq, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]  # (B, S)
    idx = real.flatten().nonzero().flatten()

    def to_padded(x):  # (T, H, D) -> (B, H, S, D)
        out = x.new_zeros(batch * seq, heads, head_dim).index_copy(0, idx, x)
        return out.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous()

    padded = tuple(to_padded(qkv[:, i]).requires_grad_() for i in range(3))
    key_mask = None if dist == "full" else real[:, None, None, :]
    return Case(batch, heads, seq, head_dim, dist, lengths, qkv.requires_grad_(), dout, cu, padded,
                to_padded(dout), key_mask)


def unpad_bhsd(x: torch.Tensor, case: Case) -> torch.Tensor:
    """(B, H, S, D) -> (T, H, D) real tokens."""
    real = torch.arange(case.seq, device=x.device)[None, :] < torch.tensor(case.lengths, device=x.device)[:, None]
    return x.transpose(1, 2).reshape(case.batch * case.seq, case.heads, case.head_dim)[real.flatten()]


# ---------------------------------------------------------------------------------- providers
def fastbert_fwd(case, dropout_p=0.0):
    """As the model calls it: on the fused QKV projection's output, its gradient produced packed."""
    return varlen_attention_qkvpacked(case.qkv, case.cu_seqlens, max(case.lengths), dropout_p=dropout_p, seed=0)


def sdpa_fwd(case, dropout_p=0.0):
    q, k, v = case.padded
    return F.scaled_dot_product_attention(q, k, v, attn_mask=case.key_mask, dropout_p=dropout_p)


def fwd_bwd(fwd, inputs, dout):
    def step():
        out = fwd()
        torch.autograd.grad(out, inputs, dout)
    return step


def providers(case):
    """name -> (forward fn, forward+backward fn)."""
    fb = lambda: fastbert_fwd(case)  # noqa: E731
    fb_drop = lambda: fastbert_fwd(case, 0.1)  # noqa: E731
    sd = lambda: sdpa_fwd(case)  # noqa: E731
    sd_drop = lambda: sdpa_fwd(case, 0.1)  # noqa: E731
    sdpa_name = "sdpa" if case.key_mask is None else "sdpa+mask"
    return {
        sdpa_name: (sd, fwd_bwd(sd, case.padded, case.dout_padded)),
        "fastbert": (fb, fwd_bwd(fb, case.qkv, case.dout)),
        sdpa_name + " p=0.1": (sd_drop, fwd_bwd(sd_drop, case.padded, case.dout_padded)),
        "fastbert p=0.1": (fb_drop, fwd_bwd(fb_drop, case.qkv, case.dout)),
    }


# ---------------------------------------------------------------------------------- correctness
def check(case) -> dict:
    """fastbert and SDPA (bf16) vs an fp32 reference, real tokens only; raises on failure."""
    qkv32 = case.qkv.detach().float().requires_grad_()
    out32 = varlen_attention_ref(*qkv32.unbind(1), case.cu_seqlens, max(case.lengths))
    (g32,) = torch.autograd.grad(out32, qkv32, case.dout.float())
    out = fastbert_fwd(case)
    (g,) = torch.autograd.grad(out, case.qkv, case.dout)
    out_s = sdpa_fwd(case)
    gs = torch.autograd.grad(out_s, case.padded, case.dout_padded)
    errs = {"out": ((out.float() - out32).abs().max().item(), (unpad_bhsd(out_s, case).float() - out32).abs().max().item())}
    for i, name in enumerate(("dq", "dk", "dv")):
        errs[name] = ((g[:, i].float() - g32[:, i]).abs().max().item(),
                      (unpad_bhsd(gs[i], case).float() - g32[:, i]).abs().max().item())
    bad = {k: v for k, v in errs.items() if not (math.isfinite(v[0]) and v[0] <= 2 * v[1] + ATOL_BF16)}
    if bad:
        raise AssertionError(f"fastbert vs fp32 reference too far at {case_name(case)}: "
                             + ", ".join(f"{k}: {a:.3g} (sdpa {b:.3g})" for k, (a, b) in bad.items()))
    return {k: {"fastbert": a, "sdpa": b} for k, (a, b) in errs.items()}


# ---------------------------------------------------------------------------------- timing
def time_ms(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def graph_ms(fn) -> float:
    """GPU time of ``fn`` replayed from a CUDA graph: no Python / launch overhead on either side."""
    graph = capture(fn)
    ms = time_ms(graph.replay)
    del graph
    return ms


def host_us(fn, n=100) -> float:
    """Wall-clock microseconds per eager call, GPU queue fed: when it exceeds the GPU time, the eager
    timing measures the host (Python, autograd, launches), not the kernels."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def case_name(case) -> str:
    return f"B={case.batch} H={case.heads} S={case.seq} D={case.head_dim} {case.dist}"


def bench_case(case) -> list[dict]:
    rows = []
    for name, (fwd, step) in providers(case).items():
        for pass_, fn in (("fwd", fwd), ("fwd+bwd", step)):
            if name.endswith("p=0.1") and pass_ == "fwd":
                continue
            row = dict(shape=[case.batch, case.heads, case.seq, case.head_dim], dist=case.dist,
                       fill=round(case.fill, 3), provider=name, pass_=pass_, graph_ms=graph_ms(fn),
                       eager_ms=time_ms(fn), host_us=host_us(fn))
            row["tflops"] = case.flops(pass_) / row["graph_ms"] / 1e9
            rows.append(row)
    for row in rows:  # speed-up over SDPA (with its mask where there is padding), same pass, mode and dropout
        drop = row["provider"].endswith("p=0.1")
        base = next(r for r in rows if r["provider"].startswith("sdpa") and r["pass_"] == row["pass_"]
                    and r["provider"].endswith("p=0.1") == drop)
        row["speedup_graph"] = base["graph_ms"] / row["graph_ms"]
        row["speedup_eager"] = base["eager_ms"] / row["eager_ms"]
    return rows


# ---------------------------------------------------------------------------------- launch-config sweep
SWEEP_SHORT = {  # sequences <= 128
    "fwd": [(64, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 3), (128, 64, 8, 2), (128, 64, 4, 3)],
    # (num_warps, programs an SM, num_stages) of the fused short backward, per length bucket
    "bwd128": [(8, 1, 2), (8, 1, 1), (8, 2, 1)],
    "bwd64": [(4, 2, 2), (4, 1, 2), (4, 2, 1), (8, 1, 2), (4, 3, 2)],
}
SWEEP_LONG = {  # longer sequences: the two-kernel backward
    "fwd": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (128, 64, 4, 3), (64, 32, 4, 3)],
    "dq": [(64, 32, 4, 3), (64, 32, 4, 4), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 5)],
    "dkdv": [(32, 128, 4, 3), (32, 128, 4, 2), (32, 128, 4, 4), (16, 128, 4, 3), (32, 128, 8, 3), (32, 64, 4, 3)],
}


def _apply(kind, bucket, choice, dropout):
    """Set one launch choice in the attention module's table for runs with (``dropout``) or without dropout; the
    backward kernels (dq, dkdv, the fused short one) have one table for both."""
    if kind == "fwd":
        attn._GPU_CONFIGS[("fwd_dropout" if dropout else "fwd", 64, bucket)] = choice
    elif kind in ("dq", "dkdv"):
        attn._GPU_CONFIGS[(kind, 64, bucket)] = choice
    else:
        attn._SHORT_BWD_LAUNCH[128 if kind == "bwd128" else 64] = choice


def _state():
    return dict(attn._GPU_CONFIGS), dict(attn._SHORT_BWD_LAUNCH)


def _restore(state):
    attn._GPU_CONFIGS, attn._SHORT_BWD_LAUNCH = (dict(x) for x in state)


def sweep(which: str) -> dict:
    """Time launch candidates kernel by kernel (GPU time, CUDA graphs) with attention dropout p=0.1 (BERT's
    training setting, where register pressure is highest) and without, and keep the fastest of each applied to
    its table (the forward has one per setting; the backward kernels one for both, ranked with dropout). Backward
    candidates are timed as the whole backward."""
    plans = []
    if which in ("short", "all"):
        # 128-token buckets on full rows (packed pretraining), the 64-token one on real paragraph lengths
        plans += [(make_case((128, 16, 128, 64), "full"), "short", {k: SWEEP_SHORT[k] for k in ("fwd", "bwd128")}),
                  (make_case((64, 16, 128, 64), "wiki"), "short", {"bwd64": SWEEP_SHORT["bwd64"]})]
    if which == "all":
        plans.append((make_case((16, 16, 512, 64), "full"), "long", SWEEP_LONG))
    results = {}
    for case, bucket, plan in plans:
        q, k, v = case.qkv.detach().unbind(1)
        args = (case.cu_seqlens, max(case.lengths), 0.0, 1 / math.sqrt(case.head_dim))
        train = (case.cu_seqlens, max(case.lengths), 0.1, 1 / math.sqrt(case.head_dim))
        seed = dropout_seed(0.1, 0, q.device)
        out, lse, mask = attn.varlen_attention_forward(q, k, v, *args, 0)
        out_d, lse_d, mask_d = attn.varlen_attention_forward(q, k, v, *train, seed)
        runs = {  # kind -> (with dropout, without)
            "fwd": (lambda: attn.varlen_attention_forward(q, k, v, *train, seed),
                    lambda: attn.varlen_attention_forward(q, k, v, *args, 0)),
            "bwd": (lambda: attn._backward_packed(case.dout, q, k, v, out_d, lse_d, mask_d, *train),
                    lambda: attn._backward_packed(case.dout, q, k, v, out, lse, mask, *args)),
        }
        key = case_name(case)
        results[key] = {}
        for kind, candidates in plan.items():
            with_drop, without = runs["fwd" if kind == "fwd" else "bwd"]
            timings = []
            for choice in candidates:
                state = _state()
                _apply(kind, bucket, choice, True)
                _apply(kind, bucket, choice, False)
                try:
                    timings.append((graph_ms(with_drop), graph_ms(without), str(choice), choice))
                except Exception as e:  # noqa: BLE001 - out of shared memory etc.: report, go on
                    print(f"  sweep {kind} {choice}: {type(e).__name__}: {str(e)[:80]}")
                _restore(state)
            best_drop, best_p0 = min(timings, key=lambda t: t[0]), min(timings, key=lambda t: t[1])
            _apply(kind, bucket, best_p0[3], False)
            _apply(kind, bucket, best_drop[3], True)  # the backward: one table, ranked with dropout
            results[key][kind] = [{"choice": c, "ms": t, "ms_without_dropout": t0} for t, t0, c, _ in timings]
            print(f"  sweep {key} {kind} (p=0.1; p=0 in brackets): " + "  ".join(
                f"{c}={t * 1e3:.1f}us [{t0 * 1e3:.1f}]" for t, t0, c, _ in timings) +
                f"  -> {best_drop[2]} with dropout, {best_p0[2]} without", flush=True)
    return results


# ---------------------------------------------------------------------------------- script
def print_table(rows):
    print("\ngraph = CUDA-graph replay (GPU time); eager = plain calls (includes Python/launch overhead)")
    print(f"{'shape (B,H,S,D)':<18}{'lengths':<9}{'fill':>5}  {'provider':<15}{'pass':<8}{'graph ms':>9}"
          f"{'TFLOP/s':>8}{'vs SDPA':>8}  {'eager ms':>9}{'vs SDPA':>8}{'host us':>8}")
    for r in rows:
        print(f"{str(tuple(r['shape'])):<18}{r['dist']:<9}{r['fill']:>5.2f}  {r['provider']:<15}{r['pass_']:<8}"
              f"{r['graph_ms']:>9.4f}{r['tflops']:>8.1f}{r['speedup_graph']:>7.2f}x  {r['eager_ms']:>9.4f}"
              f"{r['speedup_eager']:>7.2f}x{r['host_us']:>8.0f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dists", default=",".join(DISTS), help="comma list of: " + ", ".join(DISTS))
    ap.add_argument("--shapes", default=None, help="e.g. 64x16x128x64,16x16x512x64 (default: the four BERT shapes)")
    ap.add_argument("--sweep", choices=("none", "short", "all"), default="none",
                    help="first time launch-config candidates (short: sequences <= 128; all: also 512) "
                         "and run the table with the fastest")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for bench_attention.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA device", file=sys.stderr)
        return 2
    shapes = SHAPES if args.shapes is None else [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dists = args.dists.split(",")
    import triton
    result = dict(correctness={}, rows=[])
    if args.sweep != "none":
        result["sweep"] = sweep(args.sweep)
    result["meta"] = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, dtype="bfloat16",
        configs={"/".join(map(str, k)): v for k, v in attn._GPU_CONFIGS.items()},
        short_bwd=dict(max_seqlen=attn._SHORT_BWD_MAX, warps_programs_per_sm_stages=attn._SHORT_BWD_LAUNCH))
    print(json.dumps(result["meta"]), flush=True)
    for shape in shapes:
        for dist in dists:
            case = make_case(shape, dist)
            result["correctness"][case_name(case)] = check(case)
            print(f"correct: {case_name(case)} fill {case.fill:.2f}", flush=True)
            result["rows"] += bench_case(case)
            del case
            torch.cuda.empty_cache()
    print_table(result["rows"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_attention.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out / 'bench_attention.json'}")
    return 0


# ---------------------------------------------------------------------------------- pytest-benchmark
try:
    import pytest
except ImportError:  # pragma: no cover - running as a script without pytest
    pytest = None

if pytest is not None:
    _needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

    @_needs_cuda
    @pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
    @pytest.mark.parametrize("provider", ["fastbert", "sdpa"])
    @pytest.mark.parametrize("dist", ["full", "uniform"])
    @pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
    def test_attention(benchmark, shape, dist, provider, pass_):
        case = make_case(shape, dist)
        if provider == "fastbert":
            check(case)
        fns = providers(case)
        fwd, step = fns["fastbert"] if provider == "fastbert" else next(v for k, v in fns.items() if k.startswith("sdpa"))
        fn = fwd if pass_ == "fwd" else step
        fn()

        def run():
            fn()
            torch.cuda.synchronize()

        benchmark.extra_info.update(fill=case.fill, flops=case.flops(pass_))
        benchmark(run)


if __name__ == "__main__":
    sys.exit(main())
