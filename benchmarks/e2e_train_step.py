"""End-to-end training-step benchmark: full optimizer steps of BertForPreTraining, fastbert vs HF.

One process, one card, the same batches for every contender: 15% of real tokens masked (80/10/10 is
irrelevant to speed, so masked ids are kept), NSP labels, and either
  padded: lengths drawn from real Wikipedia paragraph lengths (benchmarks/data), padded to --seq, or
  packed: every sequence full (what `fastbert prepare` produces: packed segments),
  sst2:   real SST-2 sentence lengths padded to --seq (the fine-tuning shape).
Contenders: hf-eager, hf-sdpa, hf-compile (SDPA + torch.compile), fb-torch, fb-triton, fb-compile
(fb-triton under torch.compile: Inductor fuses the glue around the fastbert custom ops), hf-patch
(HF SDPA model + fastbert.patch). All run bf16 autocast over fp32 weights with fused AdamW.

Before timing, every contender's first-batch loss (eval mode, shared weights) is checked against
HF SDPA's. Timing: CUDA events around --steps full steps after --warmup steps.

Model FLOPs per step (the same for every contender; padding is never counted):
  6 * T * L * (4H^2 + 2HI)              dense matmuls, T real tokens
  + 12 * L * H * sum_i len_i^2          attention scores and context (fwd 4*len*H per token, x3)
  + 6 * M * (H^2 + H*V)                 MLM head on the M masked tokens
MFU divides by the card's dense bf16 peak (989 TFLOP/s for H100/H200 SXM).

  python3 benchmarks/e2e_train_step.py --preset large --seq 128 --batch 128 --mode packed
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
PEAK_BF16 = 989.4e12
CONTENDERS = ("hf-eager", "hf-sdpa", "hf-compile", "fb-torch", "fb-triton", "fb-compile", "hf-patch")


def lengths_for(mode: str, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    if mode == "packed":
        return np.full(batch, seq)
    source = {"padded": "wiki_paragraph_lengths.json", "sst2": "sst2_lengths.json"}[mode]
    counts = np.array(json.loads((HERE / "data" / source).read_text())["counts"], dtype=np.float64)
    counts[:3] = 0  # a sequence has at least [CLS] x [SEP]
    lengths = rng.choice(len(counts), size=batch, p=counts / counts.sum())
    return np.minimum(lengths, seq)


def make_batches(n, batch, seq, vocab, mode, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = lengths_for(mode, batch, seq, rng)
        mask = (np.arange(seq)[None] < lengths[:, None])
        ids = rng.integers(1000, vocab, size=(batch, seq)) * mask
        ids[:, 0] = 101
        ids[np.arange(batch), lengths - 1] = 102
        types = (np.arange(seq)[None] >= (lengths[:, None] // 2)) & mask
        pick = (rng.random((batch, seq)) < 0.15) & mask
        pick[:, 0] = False
        labels = np.where(pick, ids, -100)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).long().cuda()  # noqa: E731
        out.append(dict(input_ids=t(ids), attention_mask=t(mask), token_type_ids=t(types), labels=t(labels),
                        next_sentence_label=t(rng.integers(0, 2, size=batch))))
    return out


def model_flops(batch, cfg) -> float:
    L, H, I, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    lengths = batch["attention_mask"].sum(1).double()
    T = float(lengths.sum())
    M = float((batch["labels"] != -100).sum())
    return 6 * T * L * (4 * H * H + 2 * H * I) + 12 * L * H * float((lengths ** 2).sum()) + 6 * M * (H * H + H * V)


def hf_config(preset: str, seq: int):
    import transformers
    from fastbert import BertConfig
    fb = BertConfig.preset(preset, max_position_embeddings=max(512, seq))
    d = fb.to_dict()
    d.pop("fastbert_prenorm", None)
    return transformers.BertConfig(**d), fb


def build(name, hf_state, hcfg, fcfg):
    import transformers
    import fastbert
    from fastbert.hf import load_converted
    if name.startswith("hf"):
        impl = "eager" if name == "hf-eager" else "sdpa"
        model = transformers.BertForPreTraining(hcfg, attn_implementation=impl) if _takes_impl() \
            else transformers.BertForPreTraining(hcfg)
        model.config._attn_implementation = impl
        model.load_state_dict(hf_state, strict=False)
        model = model.cuda()
        if name == "hf-patch":
            fastbert.patch(model, kernels="triton")
        step_model = torch.compile(model) if name == "hf-compile" else model
        return model, step_model
    cfg = fcfg.replace(kernels="torch" if name == "fb-torch" else "triton")
    model = fastbert.BertForPreTraining(cfg)
    load_converted(model, hf_state)
    model = model.cuda()
    return model, (torch.compile(model) if name == "fb-compile" else model)


def _takes_impl():
    import inspect
    import transformers
    return "attn_implementation" in inspect.signature(transformers.BertForPreTraining.__init__).parameters


def first_loss(step_model, batch):
    step_model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = step_model(**batch).loss.float().item()
    step_model.train()
    return loss


def run_contender(name, batches, hf_state, hcfg, fcfg, warmup, steps, profile=False):
    model, step_model = build(name, hf_state, hcfg, fcfg)
    check = first_loss(step_model, batches[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, fused=True)

    def step(b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.time()
    for i in range(warmup):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(steps):
        loss = step(batches[i % len(batches)])
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                step(batches[i % len(batches)])
            torch.cuda.synchronize()
        print(f"--- profile {name} (3 steps) ---")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    res = dict(contender=name, ms_per_step=ms, check_loss=check, final_loss=float(loss.detach()), warmup_s=compile_s,
               peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30)
    del model, step_model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="large")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--mode", choices=("packed", "padded", "sst2"), default="packed")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--profile", default="", help="comma-separated contenders to profile (torch profiler, 3 steps)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("e2e_train_step.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    hcfg, fcfg = hf_config(args.preset, args.seq)
    import transformers
    torch.manual_seed(0)
    hf_state = transformers.BertForPreTraining(hcfg).state_dict()
    batches = make_batches(8, args.batch, args.seq, fcfg.vocab_size, args.mode)
    flops = np.mean([model_flops(b, fcfg) for b in batches])
    real = np.mean([float(b["attention_mask"].sum()) for b in batches])
    card = torch.cuda.get_device_name()
    print(f"# {card}, torch {torch.__version__}, transformers {transformers.__version__}; {args.preset} "
          f"seq {args.seq} batch {args.batch} mode {args.mode}: {real / args.batch:.1f} real tokens/seq, "
          f"{flops / 1e12:.2f} model TFLOP/step", flush=True)
    results = []
    for name in args.contenders.split(","):
        try:
            r = run_contender(name, batches, hf_state, hcfg, fcfg, args.warmup, args.steps,
                              profile=name in args.profile.split(","))
        except Exception as e:  # report and go on: one broken contender must not hide the others
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        r.update(seq_per_s=args.batch / r["ms_per_step"] * 1e3, tokens_per_s=real / r["ms_per_step"] * 1e3,
                 tflops=flops / r["ms_per_step"] / 1e9)
        r["mfu"] = r["tflops"] * 1e12 / PEAK_BF16
        results.append(r)
        print(f"{name:11s} {r['ms_per_step']:8.2f} ms/step  {r['seq_per_s']:8.0f} seq/s  check loss "
              f"{r['check_loss']:.4f}  peak {r['peak_mem_gb']:.1f} GB", flush=True)
    base = {r["contender"]: r for r in results}
    ref = base.get("hf-sdpa")
    print("\n| contender | ms/step | seq/s | tokens/s | model TFLOP/s | MFU | peak GB | loss diff vs hf-sdpa | "
          "x hf-sdpa | x hf-compile |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        sp = lambda k: f"{base[k]['ms_per_step'] / r['ms_per_step']:.2f}" if k in base else "-"  # noqa: E731
        diff = f"{abs(r['check_loss'] - ref['check_loss']):.4f}" if ref else "-"
        print(f"| {r['contender']} | {r['ms_per_step']:.2f} | {r['seq_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['tflops']:.0f} | {r['mfu']:.1%} | {r['peak_mem_gb']:.1f} | {diff} | {sp('hf-sdpa')} | "
              f"{sp('hf-compile')} |")
    if args.out:
        path = Path(args.out) / f"e2e_{args.preset}_s{args.seq}_b{args.batch}_{args.mode}.json"
        path.write_text(json.dumps(dict(card=card, args=vars(args), flops_per_step=flops, results=results), indent=2))


if __name__ == "__main__":
    main()
