"""One data-parallel rank at ZeRO-0 (`fastbert pretrain`'s and `fastbert finetune`'s engines): the backward leaves
the gradients where autograd put them (DeepSpeed's reduction over one rank, a flatten + all-reduce + copy back, is
skipped) and they equal plain torch's; the weights' 16-bit copies are rewritten once per optimizer step, or written by
fastbert's AdamW itself."""
import subprocess
import sys

SCRIPT = r'''
import copy, os
import torch
import fastbert.training.engine as eng
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
    os.environ.pop(k, None)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
ref = copy.deepcopy(model)
e = eng.build_engine(model, optimizer={"type": "adamw", "lr": 1e-3}, micro_batch_size=4, global_batch_size=8,
                     precision="fp32", gradient_clipping=0.0, zero_stage=0)
assert e.zero_stage == 0 and e.ds.dp_world_size == 1 and e.ds.enable_backward_allreduce is False
def reduced(*a, **k):
    raise AssertionError("gradients reduced over one rank")
e.ds.allreduce_gradients = reduced
before = [p.detach().clone() for p in model.parameters()]
xs = [torch.randn(4, 8) for _ in range(2)]
for i, x in enumerate(xs):              # two micro-batches: accumulation, then the boundary
    e.backward(e(x).pow(2).mean())
    (ref(x).pow(2).mean() / 2).backward()
    if i == 1:                          # the accumulated gradients, as the optimizer will see them
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)
    e.step()
assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))  # the update ran
from fastbert.tasks.trainer import TrainArgs, build_finetune_engine, param_groups   # `fastbert finetune`'s engine
head = torch.nn.Linear(8, 2)
ft = build_finetune_engine(head, param_groups(head, 1e-3, None, 0.01, False), TrainArgs(batch_size=4, progress=False))
assert ft.ds.enable_backward_allreduce is False
assert ft.grad_accum == 1 and ft.casts is None      # one micro-batch a step: no 16-bit copies kept

# The weights' 16-bit copies (ops/weight_casts.py), kept when a step accumulates: rewritten before the first
# micro-batch of each optimizer step, the same buffers reused by the step's other micro-batches and after the update.
from fastbert.ops import weight_casts
class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 2)
        self.seen = []
    def forward(self, x):
        c = weight_casts.cast(self.lin.weight, torch.float16)
        self.seen.append((c, c.clone(), self.lin.weight.detach().half()))
        return self.lin(x)
probe = Probe()
e = eng.build_engine(probe, optimizer={"type": "adamw", "lr": 1e-1}, micro_batch_size=4, global_batch_size=8,
                     precision="fp32", gradient_clipping=0.0, zero_stage=0)
refreshes = []
real_refresh = e.casts.refresh
e.casts.refresh = lambda: (refreshes.append(len(probe.seen)), real_refresh())
for i in range(4):                     # two optimizer steps of two micro-batches
    e.backward(e(torch.randn(4, 8)).pow(2).mean())
    e.step()
assert refreshes == [0, 2], refreshes
assert e.casts.keeps_derived                   # several micro-batches: the FP8 weight casts are kept too
assert all(c is probe.seen[0][0] for c, _, _ in probe.seen)                   # one buffer throughout
assert all(torch.equal(v, w) for _, v, w in probe.seen)                       # each forward saw the current weights
assert not torch.equal(probe.seen[1][1], probe.seen[2][1])                    # the update reached the copy

# With fastbert's AdamW (what CUDA runs; here through the Triton interpreter) the copies are kept with one
# micro-batch a step too: the optimizer writes them, and the refresh before the next forward copies nothing.
from fastbert.training import optim
eng.build_client_optimizer = lambda spec, groups, *a, **k: optim.AdamW(groups, lr=spec.lr)
probe = Probe()
e = eng.build_engine(probe, optimizer={"type": "adamw", "lr": 1e-1}, micro_batch_size=4, global_batch_size=4,
                     precision="fp32", gradient_clipping=0.0, zero_stage=0)
assert e.grad_accum == 1 and e.casts is not None and e.ds.optimizer.weight_casts is e.casts
assert not e.casts.keeps_derived               # one micro-batch: the FP8 weight casts stay in the forward
copied = []
real_copy = torch._foreach_copy_
torch._foreach_copy_ = lambda dst, src: (copied.append(len(dst)), real_copy(dst, src))
for i in range(3):
    e.backward(e(torch.randn(4, 8)).pow(2).mean())
    e.step()
torch._foreach_copy_ = real_copy
assert copied == [], copied                                                   # never cast again after the first
assert all(c is probe.seen[0][0] for c, _, _ in probe.seen)
assert all(torch.equal(v, w) for _, v, w in probe.seen)                       # each forward saw the current weights
assert not torch.equal(probe.seen[0][1], probe.seen[1][1])

# ZeRO-2 hands fastbert's AdamW its flat fp32 partitions (DeepSpeed checks the optimizer's exact type, so the engine
# allows it by name): no copies to write there, and the steps equal torch's AdamW's.
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
ref = copy.deepcopy(model)
e = eng.build_engine(model, optimizer={"type": "adamw", "lr": 1e-2}, micro_batch_size=4, global_batch_size=4,
                     precision="fp32", gradient_clipping=0.0, zero_stage=2)
assert e.casts is None and isinstance(e.ds.optimizer.optimizer, optim.AdamW)
opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
for i in range(3):
    x = torch.randn(4, 8)
    e.backward(e(x).pow(2).mean())
    e.step()
    ref(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
for p, q in zip(model.parameters(), ref.parameters()):   # Adam's m / sqrt(v) magnifies rounding where gradients are
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-4)   # small; a wrong step is off by ~lr
print("OK")
'''


def test_single_rank_zero0_skips_the_reduction_and_trains_as_torch():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "OK"
