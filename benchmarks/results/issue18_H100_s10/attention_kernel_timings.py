"""Session 10: per-kernel attention timings (graph replay), p=0 vs p=0.1, launch candidates."""
import json, math, os, sys
import torch, triton
sys.path.insert(0, os.getcwd())
from triton.testing import do_bench
from benchmarks.cuda_graph import capture
from fastbert.ops import attention as A
from fastbert.ops._common import dropout_seed
dev = "cuda"; DT = torch.bfloat16
def gms(fn):
    try:
        g = capture(fn); t = do_bench(g.replay, warmup=10, rep=60, return_mode="median"); del g; return t * 1e3
    except Exception as e:
        print("ERR", type(e).__name__, str(e)[:120]); torch.cuda.synchronize(); return float("nan")

def case(B, H, S, D=64):
    T = B * S
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(T, 3, H, D, device=dev, dtype=DT, generator=g)
    dout = torch.randn(T, H, D, device=dev, dtype=DT, generator=g)
    cu = torch.arange(0, T + 1, S, device=dev, dtype=torch.int32)
    return qkv, dout, cu

def parts(mask):
    return A._mask_parts(mask) if hasattr(A, '_mask_parts') else (mask, mask)

def launch_dq(cfg, dout, q, k, v, out, lse, mask, cu, S, p, scale, delta, dq):
    bm, bn, w, st = cfg
    consts = A._kernel_constants(q, p)
    common = (lse.stride(0), *A._mask_strides(mask), scale * A._LOG2E, scale, A._dropout_args(p)[1])
    A._bwd_dq_kernel[(triton.cdiv(S, bm), cu.shape[0] - 1, q.shape[1])](
        q, k, v, out, dout, lse, delta, parts(mask)[0], dq, cu, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), out.stride(0), out.stride(1), dq.stride(0), dq.stride(1),
        *common, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st, **consts)

def launch_dkdv(cfg, dout, q, k, v, out, lse, mask, cu, S, p, scale, delta, dq, dk, dv):
    bm, bn, w, st = cfg
    consts = A._kernel_constants(q, p)
    common = (lse.stride(0), *A._mask_strides(mask), scale * A._LOG2E, scale, A._dropout_args(p)[1])
    A._bwd_dkdv_kernel[(triton.cdiv(S, bn), cu.shape[0] - 1, q.shape[1])](
        q, k, v, out, dout, lse, delta, parts(mask)[1], dq, dk, dv, cu, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), out.stride(0), out.stride(1), dq.stride(0), dq.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *common, 0,
        BLOCK_M=bm, BLOCK_N=bn, FUSED_DQ=False, num_warps=w, num_stages=st, **consts)

rows = []
def rec(**kw):
    rows.append(kw); print(json.dumps(kw), flush=True)

# ---- S = 512
B, H, S = 16, 16, 512
qkv, dout, cu = case(B, H, S)
q, k, v = qkv.unbind(1); scale = 1 / math.sqrt(64)
seeds = {0.0: None, 0.1: dropout_seed(0.1, 0, q.device)}
fw = {p: A.varlen_attention_forward(q, k, v, cu, S, p, scale, seeds[p]) for p in (0.0, 0.1)}
FWD = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3)]
for cfg in FWD:
    r = {}
    for p in (0.0, 0.1):
        A._GPU_CONFIGS[("fwd", 64, "long")] = cfg
        r[p] = gms(lambda: A.varlen_attention_forward(q, k, v, cu, S, p, scale, seeds[p]))
    rec(kernel="fwd512", cfg=cfg, p0_us=round(r[0.0], 1), p01_us=round(r[0.1], 1))
A._GPU_CONFIGS[("fwd", 64, "long")] = (64, 64, 4, 3)
T = q.shape[0]
delta = torch.empty((H, T), dtype=torch.float32, device=dev)
dqkv = torch.empty((T, 3, H, 64), dtype=DT, device=dev); dq, dk, dv = dqkv.unbind(1)
DQ = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 4)]
for cfg in DQ:
    r = {}
    for p in (0.0, 0.1):
        out, lse, mask = fw[p]
        r[p] = gms(lambda: launch_dq(cfg, dout, q, k, v, out, lse, mask, cu, S, p, scale, delta, dq))
    rec(kernel="dq512", cfg=cfg, p0_us=round(r[0.0], 1), p01_us=round(r[0.1], 1))
DKDV = [(32, 128, 4, 2), (32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 2)]
for cfg in DKDV:
    r = {}
    for p in (0.0, 0.1):
        out, lse, mask = fw[p]
        launch_dq((64, 32, 4, 3), dout, q, k, v, out, lse, mask, cu, S, p, scale, delta, dq)
        r[p] = gms(lambda: launch_dkdv(cfg, dout, q, k, v, out, lse, mask, cu, S, p, scale, delta, dq, dk, dv))
    rec(kernel="dkdv512", cfg=cfg, p0_us=round(r[0.0], 1), p01_us=round(r[0.1], 1))

# ---- S = 128 (the BERT-large step's shape): fwd and the fused short backward, p=0 vs p=0.1
B, H, S = 128, 16, 128
qkv, dout, cu = case(B, H, S)
q, k, v = qkv.unbind(1)
fw = {p: A.varlen_attention_forward(q, k, v, cu, S, p, scale, seeds[p]) for p in (0.0, 0.1)}
r = {p: gms(lambda: A.varlen_attention_forward(q, k, v, cu, S, p, scale, seeds[p])) for p in (0.0, 0.1)}
rec(kernel="fwd128", cfg=A._GPU_CONFIGS[("fwd", 64, "short")], p0_us=round(r[0.0], 1), p01_us=round(r[0.1], 1))
r = {p: gms(lambda: A._backward_packed(dout, q, k, v, *fw[p], cu, S, p, scale)) for p in (0.0, 0.1)}
rec(kernel="bwd128", cfg=A._SHORT_BWD_LAUNCH[128], p0_us=round(r[0.0], 1), p01_us=round(r[0.1], 1))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "attn_kernels.json"), "w"), indent=1)
