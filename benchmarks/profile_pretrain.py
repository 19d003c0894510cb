"""Where a `fastbert pretrain` (or `fastbert finetune`) step goes: the real command's loop, in-process,
under torch.profiler.

    python3 benchmarks/profile_pretrain.py --data DIR --out OUT [KEY=VALUE ...]
    python3 benchmarks/profile_pretrain.py --config configs/academic-budget-large.json --data MLM_DIR --out OUT
    python3 benchmarks/profile_pretrain.py --finetune --glue GLUE --vocab VOCAB_DIR --out OUT

Runs the same configuration as ``benchmarks/real_paths.py`` (BERT-base, seq 128, micro batch 128,
bf16; another ``--config`` keeps its own recipe, DeepSpeed and accumulation included), profiles
``--active`` optimizer steps after ``--skip`` steps, and prints the step's wall time,
the GPU's busy time in it, the top host (CPU) and device (CUDA) ops, and the number of
device-to-host synchronisations per step (``cudaStreamSynchronize`` / ``cudaMemcpy`` D2H /
``cudaEventSynchronize`` calls). Writes a Chrome trace to OUT/trace.json. The command's seq/s counts
sequences, and a packed micro-batch row holds about 1.3 of them (Wikipedia at 128 tokens), so its step time is
tokens / (tokens/s), not micro batch / (seq/s).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", help="prepared NSP data, seq 128 (pretrain; MLM-only data for an MLM-only config)")
    p.add_argument("--config", default="configs/base.json", help="the pretraining config (pretrain)")
    p.add_argument("--finetune", action="store_true",
                   help="profile `fastbert finetune --task sst2` (random-init BERT-base, batch 32, bf16) instead")
    p.add_argument("--glue", help="GLUE root with SST-2 (--finetune)")
    p.add_argument("--vocab", help="folder with the bert-base-uncased vocab.txt (--finetune)")
    p.add_argument("--out", required=True)
    p.add_argument("--skip", type=int, default=15)
    p.add_argument("--active", type=int, default=5)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fastbert.training import engine as engine_mod
    from fastbert.training.config import load_config
    from fastbert.training.pretrain import run_pretraining

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = args.skip + args.active + 2
    recipe = ["train.deepspeed=null", "train.precision=bf16", "train.micro_batch_size=128",
              "train.global_batch_size=128"] if args.config == "configs/base.json" else ["train.time_budget=null"]
    cfg = None if args.finetune else load_config(REPO / args.config, [
        f"output_dir={out / 'run'}", f"data.dir={args.data}", "data.auto_prepare=false", *recipe,
        f"train.max_steps={steps}", "log.every_steps=5", "eval.every_steps=null", "eval.every_minutes=null",
        "eval.at_end=false", "checkpoint.every_minutes=null", "checkpoint.every_steps=null",
        "checkpoint.at_end=false", "export.hf=false", *args.overrides])
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False)
    state = {"n": 0, "t0": None}
    original = engine_mod.TrainEngine.step

    def step(self):
        boundary = original(self)
        if boundary:
            state["n"] += 1
            if state["n"] == args.skip:
                torch.cuda.synchronize()
                prof.start()
                state["t0"] = time.perf_counter()
            elif state["n"] == args.skip + args.active:
                torch.cuda.synchronize()
                state["wall"] = (time.perf_counter() - state["t0"]) / args.active
                prof.stop()
        return boundary

    engine_mod.TrainEngine.step = step
    if args.finetune:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from real_paths import make_random_checkpoint
        from fastbert.cli import main as cli_main
        ckpt = make_random_checkpoint(Path(args.vocab), out / "ckpt")
        cli_main(["finetune", "--task", "sst2", "--data", str(Path(args.glue) / "SST-2"), "--model", str(ckpt),
                  "--output", str(out / "ft"), "--epochs", "1", "--batch-size", "32", "--precision", "bf16",
                  "--kernels", "triton", "--max-train-samples", str(32 * (steps + 5))])
    else:
        run_pretraining(cfg)
    ka = prof.key_averages()
    per = 1.0 / args.active
    gpu_us = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = {e.key: e.count * per for e in ka
             if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
             or (e.key.startswith("cudaMemcpy") and "Async" not in e.key)}
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                    "cudaLaunchKernelExC")) * per
    print(f"\nstep wall {state['wall'] * 1e3:.1f} ms | GPU busy {gpu_us * per / 1e3:.1f} ms/step "
          f"({gpu_us * per / 1e6 / state['wall']:.0%}) | kernel launches {launches:.0f}/step | syncs/step {syncs}")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    prof.export_chrome_trace(str(out / "trace.json"))


if __name__ == "__main__":
    main()
