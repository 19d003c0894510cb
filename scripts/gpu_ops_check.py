"""Convergence check of the fused ops on a GPU: a tiny BERT pretrained for 300 steps with
kernels="triton" and with kernels="torch", from the same initial weights on the same batches,
must give the same loss curve (dropout masks differ between the paths, so the curves agree
statistically, not bitwise).

    python3 scripts/gpu_ops_check.py [--steps 300] [--preset tiny]

Data are synthetic but learnable: each sequence draws its tokens from one of 16 topics (disjoint
vocabulary slices, Zipf inside), so a masked token is predictable from its context and the MLM
loss falls well below log(vocab). Training: BertForPreTraining (MLM only), AdamW, linear warm-up and decay, bf16
autocast over fp32 weights, dropout 0.1. Exit status 1 when the curves disagree; with $OUT set the
curves go to $OUT/convergence.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastbert.config import BertConfig  # noqa: E402
from fastbert.heads import BertForPreTraining  # noqa: E402

PAD, CLS, SEP, MASK, FIRST = 0, 1, 2, 3, 4


def make_batches(steps, batch, seq, vocab, seed=0, topics=16):
    """(input_ids, attention_mask, labels) per step, int64 on the CPU. Each sequence draws its
    tokens from one of ``topics`` disjoint slices of the vocabulary (Zipf-distributed inside the
    slice), so a masked token's topic is predictable from its context."""
    rng = np.random.default_rng(seed)
    per_topic = (vocab - FIRST) // topics
    zipf = 1.0 / np.arange(1, per_topic + 1)
    zipf /= zipf.sum()
    out = []
    for _ in range(steps):
        lengths = rng.integers(seq // 2, seq + 1, size=batch)
        topic = rng.integers(0, topics, size=(batch, 1))
        ids = FIRST + topic * per_topic + rng.choice(per_topic, size=(batch, seq), p=zipf)
        ids[:, 0] = CLS
        ids[np.arange(batch), lengths - 1] = SEP
        mask = np.arange(seq)[None] < lengths[:, None]
        ids = np.where(mask, ids, PAD)
        pick = (rng.random((batch, seq)) < 0.15) & mask & (ids >= FIRST)
        labels = np.where(pick, ids, -100)
        r = rng.random((batch, seq))
        inputs = ids.copy()
        inputs[pick & (r < 0.8)] = MASK
        rand = pick & (r >= 0.8) & (r < 0.9)
        inputs[rand] = rng.integers(FIRST, vocab, size=int(rand.sum()))
        out.append(tuple(torch.from_numpy(a) for a in (inputs, mask.astype(np.int64), labels)))
    return out


def train(model, batches, lr, warmup):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps = len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / (steps - warmup))))
    model.train()
    losses = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ids, mask, labels in batches:
        ids, mask, labels = ids.cuda(), mask.cuda(), labels.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    return losses, (time.perf_counter() - t0) / steps * 1e3


def smooth(xs, k=20):
    return [float(np.mean(xs[max(0, i - k + 1):i + 1])) for i in range(len(xs))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1028)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tol", type=float, default=0.03, help="allowed relative gap of the final smoothed losses")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_ops_check.py needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    cfg = BertConfig.preset(args.preset, vocab_size=args.vocab, max_position_embeddings=args.seq)
    torch.manual_seed(0)
    init = BertForPreTraining(cfg).cuda()
    batches = make_batches(args.steps, args.batch, args.seq, args.vocab)
    curves, ms = {}, {}
    for kernels in ("torch", "triton"):
        model = copy.deepcopy(init).set_kernels(kernels)
        torch.manual_seed(1)
        curves[kernels], ms[kernels] = train(model, batches, args.lr, warmup=max(1, args.steps // 10))
    s_torch, s_triton = smooth(curves["torch"]), smooth(curves["triton"])
    print(f"{'step':>5} {'torch':>8} {'triton':>8}   (20-step moving average)")
    for i in range(0, args.steps, 25):
        print(f"{i:5d} {s_torch[i]:8.4f} {s_triton[i]:8.4f}")
    print(f"{args.steps - 1:5d} {s_torch[-1]:8.4f} {s_triton[-1]:8.4f}")
    gap = abs(s_triton[-1] - s_torch[-1]) / s_torch[-1]
    max_gap = max(abs(a - b) / b for a, b in zip(s_triton[25:], s_torch[25:]))
    start = math.log(args.vocab)
    finite = all(math.isfinite(x) for c in curves.values() for x in c)
    learned = s_torch[-1] < 0.8 * start and s_triton[-1] < 0.8 * start
    ok = finite and learned and gap <= args.tol
    print(f"final smoothed loss: torch {s_torch[-1]:.4f}, triton {s_triton[-1]:.4f} (log V = {start:.2f}); "
          f"relative gap {gap:.4f} (max over steps >= 25: {max_gap:.4f}); ms/step torch {ms['torch']:.1f}, "
          f"triton {ms['triton']:.1f}  -> {'PASS' if ok else 'FAIL'}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "convergence.json").write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), args=vars(args), curves=curves, ms_per_step=ms,
            final_gap=gap, max_gap=max_gap, ok=ok), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
