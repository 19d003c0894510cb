"""Session 10 probe: attention backends (fastbert Triton vs torch's bundled FA2 / cuDNN varlen vs SDPA dense),
fwd+bwd GPU time from CUDA-graph replay; LayerNorm fused vs eager fwd+bwd (graph replay)."""
import json, math, os, sys, time
import torch
sys.path.insert(0, os.getcwd())
from triton.testing import do_bench_cudagraph
from fastbert.ops import attention as A
from fastbert.ops.layer_norm import dropout_add_layer_norm, dropout_add_layer_norm_ref
torch.manual_seed(0)
dev = "cuda"; DT = torch.bfloat16
rows = []
def rec(**kw):
    rows.append(kw); print(json.dumps(kw), flush=True)

def bench(fn):
    fn(); torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=200, return_mode="median")

def attn_case(B, H, S, D, p):
    T = B * S
    qkv = torch.randn(T, 3, H, D, device=dev, dtype=DT)
    cu = torch.arange(0, T + 1, S, device=dev, dtype=torch.int32)
    dout = torch.randn(T, H, D, device=dev, dtype=DT)
    q, k, v = qkv.unbind(1)
    scale = 1 / math.sqrt(D)
    seed = torch.tensor([7], device=dev, dtype=torch.int64)
    shape = f"{B},{H},{S},{D}"
    # fastbert
    def fb_fwd():
        return A.varlen_attention_forward(q, k, v, cu, S, p, scale, seed)
    o, lse, mask = fb_fwd()
    def fb_all():
        o, lse, mask = fb_fwd()
        return A._backward_packed(dout, q, k, v, o, lse, mask, cu, S, p, scale)
    res = {}
    res["fastbert"] = (bench(lambda: fb_fwd()), bench(fb_all))
    ref = fb_all() if p == 0 else None
    ref_o = fb_fwd()[0] if p == 0 else None
    # FA2 varlen (torch bundled)
    try:
        fa = torch.ops.aten._flash_attention_forward
        fb_ = torch.ops.aten._flash_attention_backward
        def fa_fwd():
            return fa(q, k, v, cu, cu, S, S, p, False, False, scale=scale)
        def fa_all(stack=True):
            o, l, rng, un, _ = fa_fwd()
            dq, dk, dv = fb_(dout, q, k, v, o, l, cu, cu, S, S, p, False, rng, un, scale=scale)
            return torch.stack((dq, dk, dv), 1) if stack else dq
        res["fa2_varlen"] = (bench(lambda: fa_fwd()), bench(fa_all))
        res["fa2_varlen_nostack"] = (float("nan"), bench(lambda: fa_all(False)))
        if p == 0:
            g = fa_all(); o2 = fa_fwd()[0]
            rec(check="fa2_vs_fastbert", shape=shape, out_err=(o2.float() - ref_o.float()).abs().max().item(),
                grad_err=(g.float() - ref.float()).abs().max().item(), ref_max=ref.float().abs().max().item())
    except Exception as e:
        rec(error="fa2", shape=shape, msg=repr(e)[:300])
    # cuDNN varlen
    try:
        cf = torch.ops.aten._cudnn_attention_forward
        cb = torch.ops.aten._cudnn_attention_backward
        def cd_fwd():
            return cf(q, k, v, None, cu, cu, S, S, True, p, False, False, scale=scale)
        def cd_all():
            r = cd_fwd()
            o, l, sd, off = r[0], r[1], r[6], r[7]
            dq, dk, dv = cb(dout, q, k, v, o, l, sd, off, torch.empty(0, device=dev, dtype=DT), cu, cu, S, S, p,
                            False, scale=scale)
            return torch.stack((dq, dk, dv), 1)
        if p == 0:
            g = cd_all(); o2 = cd_fwd()[0]
            rec(check="cudnn_vs_fastbert", shape=shape, out_err=(o2.float() - ref_o.float()).abs().max().item(),
                grad_err=(g.float() - ref.float()).abs().max().item())
        res["cudnn_varlen"] = (bench(lambda: cd_fwd()), bench(cd_all))
    except Exception as e:
        rec(error="cudnn", shape=shape, msg=repr(e)[:300])
    # SDPA dense (B, H, S, D), grads via autograd
    from torch.nn.attention import sdpa_kernel, SDPBackend
    qd = qkv.view(B, S, 3, H, D).permute(2, 0, 3, 1, 4)
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            leaves = [t.detach().requires_grad_() for t in qd]
            dd = torch.randn(B, H, S, D, device=dev, dtype=DT)
            def sd_fwd():
                with sdpa_kernel(be):
                    return torch.nn.functional.scaled_dot_product_attention(*leaves, dropout_p=p)
            def sd_all():
                o = sd_fwd()
                return torch.autograd.grad(o, leaves, dd)
            res[name] = (bench(lambda: sd_fwd()), bench(sd_all))
        except Exception as e:
            rec(error=name, shape=shape, msg=repr(e)[:300])
    for k_, (f, fb2) in res.items():
        rec(op="attn", shape=shape, p=p, impl=k_, fwd_ms=round(f, 4), fwdbwd_ms=round(fb2, 4),
            vs_fastbert=round(res["fastbert"][1] / fb2, 3))

for (B, H, S, D) in ((128, 16, 128, 64), (256, 12, 128, 64), (32, 16, 512, 64)):
    for p in (0.0, 0.1):
        attn_case(B, H, S, D, p)

# LayerNorm fwd+bwd, graph replay, 32768 tokens
for n in (768, 1024):
    m = 32768
    x, r, dy = (torch.randn(m, n, device=dev, dtype=DT) for _ in range(3))
    w = 1 + 0.1 * torch.randn(n, device=dev, dtype=DT); b, xb = (0.1 * torch.randn(n, device=dev, dtype=DT) for _ in range(2))
    ins = [t.detach().requires_grad_() for t in (x, r, w, b, xb)]
    def fused():
        y = dropout_add_layer_norm(*ins[:4], 1e-12, x_bias=ins[4], dropout_p=0.1, seed=1)
        return torch.autograd.grad(y, ins, dy)
    def eager():
        y = dropout_add_layer_norm_ref(*ins[:4], 1e-12, x_bias=ins[4], dropout_p=0.1)
        return torch.autograd.grad(y, ins, dy)
    def fused_f():
        with torch.no_grad():
            return dropout_add_layer_norm(*ins[:4], 1e-12, x_bias=ins[4], dropout_p=0.1, seed=1)
    def eager_f():
        with torch.no_grad():
            return dropout_add_layer_norm_ref(*ins[:4], 1e-12, x_bias=ins[4], dropout_p=0.1)
    te, tf = bench(eager), bench(fused)
    tef, tff = bench(eager_f), bench(fused_f)
    rec(op="ln", n=n, m=m, eager_fwdbwd=round(te, 4), fused_fwdbwd=round(tf, 4), speedup=round(te / tf, 2),
        eager_fwd=round(tef, 4), fused_fwd=round(tff, 4), bwd_est_eager=round(te - tef, 4), bwd_est_fused=round(tf - tff, 4),
        bwd_speedup=round((te - tef) / (tf - tff), 2))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
