"""Where the FP8 cast kernel and the reference disagree on the card (a diagnostic for tests/ops/test_fp8.py)."""
import torch
import torch.nn.functional as F
from fastbert.ops.fp8 import E4M3, E5M2, AmaxHistory, cast_fp8_ref, cast_fp8_triton, pre_op_ref, fp8_ffn, fp8_linear

torch.manual_seed(0)


def hist():
    h = AmaxHistory(3, "cuda")
    h.advance()
    return h


def report(name, x, gelu=None, z=None, dtype=E5M2, colsum=True):
    v = pre_op_ref(x, gelu, z)
    hk, hr = hist(), hist()
    for h in (hk, hr):
        h.amax[0, 0] = v.abs().max().item()
    k8, kt, ks, kc = cast_fp8_triton(x, hk, 0, dtype, colsum=colsum, gelu=gelu, z=z)
    r8, rt, rs = cast_fp8_ref(v, hr, 0, dtype)
    torch.cuda.synchronize()
    kf, rf, ktf = k8.float(), r8.float(), kt.float()
    bad = (kf != rf) & ~(kf.isnan() & rf.isnan())
    badt = (ktf != kf.t()) & ~(ktf.isnan() & kf.t().isnan())
    print(f"{name}: shape {tuple(x.shape)} {x.dtype} -> {dtype}: scale k {ks.item():.4g} r {rs.item():.4g}; "
          f"x8 mismatches {int(bad.sum())} (max |diff| {float((kf - rf).abs().nan_to_num(0).max()):.3g}), "
          f"nan k {int(kf.isnan().sum())} r {int(rf.isnan().sum())}; x8t != x8.T at {int(badt.sum())} "
          f"(nan in x8t {int(ktf.isnan().sum())}); amax k {hk.amax[0,1].item():.5g} r {hr.amax[0,1].item():.5g}"
          + (f"; colsum err {float((kc - v.sum(0)).abs().max()):.3g}" if kc is not None else ""))
    if int(badt.sum()):
        idx = badt.nonzero()[:5].tolist()
        print("   x8t bad at", idx, [(ktf[i, j].item(), kf.t()[i, j].item()) for i, j in idx])


for shape in ((40, 96), (64, 128), (64, 32), (1024, 512), (37, 70)):
    for src in (torch.bfloat16, torch.float16, torch.float32):
        z = (torch.randn(*shape, device="cuda") * 2).to(src)
        dy = (torch.randn(*shape, device="cuda") * 1e-3).to(src)
        report("plain e5m2 colsum", dy, dtype=E5M2)
        report("plain e4m3", z, dtype=E4M3, colsum=False)
        report("gelu fwd", z, gelu="none", dtype=E4M3, colsum=False)
        report("gelu bwd", dy, gelu="none", z=z, dtype=E5M2)

# the failing ffn test, step by step
g = torch.Generator().manual_seed(9)
t, h, i = 64, 32, 128
x = torch.randn(t, h, generator=g).cuda()
w1 = (torch.randn(i, h, generator=g) * h ** -0.5).cuda()
b1 = (torch.randn(i, generator=g) * 0.1).cuda()
w2 = (torch.randn(h, i, generator=g) * i ** -0.5).cuda()
dy = (torch.randn(t, h, generator=g) * 1e-3).cuda()
hh = AmaxHistory(6, "cuda")
hh.advance()
leaves = [a.clone().requires_grad_() for a in (x, w1, b1, w2)]
with torch.autocast("cuda", dtype=torch.bfloat16):
    out = fp8_ffn(*leaves, hh, 0, "none")
out.backward(dy.to(out.dtype))
for n, a in zip(("dx", "dw1", "db1", "dw2"), leaves):
    gnan = a.grad.isnan()
    rows = gnan.reshape(gnan.shape[0], -1).any(1).nonzero().flatten().tolist()[:20]
    print(f"ffn {n}: nan {int(gnan.sum())} of {a.grad.numel()}, rows with nan {rows}")
print("history", hh.amax[:, :2].tolist())
leaves = [a.clone().requires_grad_() for a in (x, w1, b1)]
y = fp8_linear(leaves[0], leaves[1], leaves[2], AmaxHistory(3, "cuda"), 0)
y.backward(torch.randn_like(y) * 1e-3)
print("linear fp32+bias:", [(n, int(a.grad.isnan().sum())) for n, a in zip(("dx", "dw", "db"), leaves)],
      "out err", float(((y.detach() - F.linear(x, w1, b1)).norm() / F.linear(x, w1, b1).norm())))
