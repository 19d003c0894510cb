"""GPU check of the pretraining engine (issue 6), run on the GPU host.

    python3 scripts/gpu_pretrain_check.py single --data DIR --out $OUT   # one GPU
    python3 scripts/gpu_pretrain_check.py multi  --data DIR --out $OUT   # two GPUs (nvidia-h100-x2)

``single``: BERT-base, bf16, ZeRO-2, DeepSpeed FusedAdam through the real ``fastbert pretrain`` loop
(loader, device masking, evaluation, checkpoint, HF export): the loss falls; seq/s beside HF
transformers' ``BertForPreTraining`` (SDPA, bf16 autocast, fused torch AdamW) timed in the same run on
the same batches (same masking), with CUDA events after warm-up.

``multi``: the same model on 1 GPU (ZeRO-2) and on 2 GPUs (ZeRO-2 and ZeRO-3) at the same per-GPU
batch (weak scaling): seq/s and scaling efficiency; then the 2-GPU ZeRO-2 checkpoint is resumed on 1
GPU (DeepSpeed universal conversion) and must continue from its loss.

DIR is a folder made by ``fastbert prepare --nsp --seq-len 128`` (carried to the host: ../shared
does not travel). Writes ``pretrain_check_<mode>.json`` and the runs' logs under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def launch(out: Path, data: Path, nproc: int, zero: int, steps: int, micro: int, global_batch: int, log: Path,
           extra=(), kernels: str = "auto") -> dict:
    """One ``fastbert pretrain`` run (torchrun when nproc > 1). Returns the parsed metrics."""
    launch.port = getattr(launch, "port", 29610) + 1      # a fresh port per run: no TIME_WAIT clashes
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={launch.port}",
           "-m", "fastbert.commands.pretrain"] if nproc > 1 else [sys.executable, "-m", "fastbert.commands.pretrain"]
    cmd += ["--config", "configs/base.json", f"output_dir={out}", f"data.dir={data}", "data.auto_prepare=false",
            f"train.deepspeed=configs/ds_zero{zero}.json", "train.precision=bf16", f"train.max_steps={steps}",
            f"train.micro_batch_size={micro}", f"train.global_batch_size={global_batch}", "train.warmup=0.1",
            'train.optimizer={"type":"adamw","lr":5e-4,"betas":[0.9,0.98],"eps":1e-6,"weight_decay":0.01}',
            "log.every_steps=5", "eval.every_steps=null", "eval.batches=4", "checkpoint.every_minutes=null",
            "checkpoint.every_steps=null", "export.hf=false", f"model.kernels={kernels}", *extra]
    ok, wall = run_logged(cmd, log)
    if not ok:
        return {"ok": False, "wall_s": wall}
    recs = read_records(out)
    train = [r for r in recs if r["event"] == "train"]
    steady = [r["seq_per_s"] for r in train[2:]] or [r["seq_per_s"] for r in train]
    ev = [r for r in recs if r["event"] == "eval"]
    return {"ok": True, "wall_s": wall, "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"],
            "losses": [round(r["loss"], 4) for r in train], "seq_per_s": statistics.median(steady),
            "tokens_per_s": statistics.median([r["tokens_per_s"] for r in train[2:]] or [0]),
            "mfu": statistics.median([r.get("mfu") or 0 for r in train[2:]] or [0]),
            "eval": ev[-1] if ev else None, "steps": train[-1]["step"],
            "resumed": [r for r in recs if r["event"] == "resume"]}


def run_logged(cmd, log: Path, env: dict | None = None) -> tuple[bool, float]:
    """Run ``cmd`` in the repository (``env``: variables set on top of this process's), its output to ``log``:
    (succeeded, seconds). A failure prints the log's end."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", **(env or {}))
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    if rc != 0:
        print(f"run failed ({rc}): {' '.join(map(str, cmd))}\n" + log.read_text()[-4000:], flush=True)
    return rc == 0, wall


def read_records(out: Path) -> list[dict]:
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def hf_baseline(data: Path, micro: int, steps: int = 20, warmup: int = 5, which: str = "hf", preset: str = "base",
                accum: int = 1) -> dict:
    """A bare loop (no DeepSpeed, no loader thread): bf16 autocast over fp32 weights, fused torch AdamW,
    on the same batches (same masking) as the fastbert runs, timed twice: ``seq_per_s`` from the second
    pass (steady state), ``first_pass_*`` from the first (new token counts compile or tune once).
    ``which``: "hf" = transformers' BertForPreTraining (SDPA); "fastbert" = fastbert.BertForPreTraining
    (Triton kernels): the model's own speed, to separate it from the training loop's overhead. Data without
    NSP labels trains the masked-LM models (``BertForMaskedLM``). ``preset``: "base" or "large". ``accum``:
    micro-batches a step (the loss divided by it, the optimizer every ``accum``-th); ``steps`` and ``warmup``
    are micro-batches, rounded up to whole steps."""
    import torch
    import transformers
    import fastbert
    from fastbert.data.masking import collator_for
    from fastbert.data.pretrain_dataset import GlobalOrder, PretrainData

    dev = torch.device("cuda")
    train = PretrainData(data, "train")
    nsp = bool(train.index.get("nsp", True))
    steps, warmup = (-(-n // accum) * accum for n in (steps, warmup))
    order = GlobalOrder(len(train), micro, seed=42)
    collator = collator_for(data, seed=0, device=dev)
    cfg = fastbert.BertConfig.preset(preset, vocab_size=train.index["vocab_size"], kernels="triton")
    if which == "hf":  # the preset's sizes in HF's config
        d = cfg.to_dict()
        d.pop("fastbert_prenorm")
        hf_cfg = transformers.BertConfig(**d, attn_implementation="sdpa")
        model = (transformers.BertForPreTraining if nsp else transformers.BertForMaskedLM)(hf_cfg).to(dev).train()
    else:
        model = (fastbert.BertForPreTraining if nsp else fastbert.BertForMaskedLM)(cfg).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = []
    for s in range(warmup + steps):
        b = {k: torch.from_numpy(v).to(dev) for k, v in train.batch(order.micro_batch(s, 0, 0, 1, micro)).items()}
        b["input_ids"], b["labels"] = collator(b["input_ids"], b["attention_mask"])
        batches.append(b)

    def step(i, b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**b).loss
        (loss / accum if accum > 1 else loss).backward()
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    for i, b in enumerate(batches[:warmup]):
        step(i, b)

    def timed_pass():
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i, b in enumerate(batches[warmup:]):
            loss = step(i, b)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps, loss

    # Padded batches of other lengths each step: the first pass meets token counts the warm-up did not and
    # pays what they compile or tune (kept on disk for later runs); the second pass over the same batches is
    # the steady state a longer run settles to.
    first_ms, _ = timed_pass()
    ms, loss = timed_pass()
    tokens = sum(int(b["attention_mask"].sum()) for b in batches[warmup:]) / steps
    mem = torch.cuda.max_memory_allocated() / 2 ** 30
    del model, opt
    torch.cuda.empty_cache()
    return {"seq_per_s": micro * 1000 / ms, "tokens_per_s": tokens * 1000 / ms, "step_ms": ms,
            "first_pass_seq_per_s": micro * 1000 / first_ms, "first_pass_step_ms": first_ms,
            "last_loss": float(loss.detach()), "peak_mem_gib": mem, "preset": preset, "accum": accum}


def single(args) -> dict:
    import torch
    out = Path(args.out)
    micro = args.micro
    res = {"device": torch.cuda.get_device_name(0), "micro_batch": micro}
    res["hf_bert_for_pretraining_sdpa"] = hf_baseline(Path(args.data), micro)
    print("HF:", res["hf_bert_for_pretraining_sdpa"], flush=True)
    for kernels in ("triton", "torch"):
        r = launch(out / f"run_{kernels}", Path(args.data), 1, 2, args.steps, micro, micro,
                   out / f"log_single_{kernels}.txt", extra=["export.hf=true"], kernels=kernels)
        res[f"fastbert_{kernels}"] = r
        print(f"fastbert kernels={kernels}:", {k: v for k, v in r.items() if k != "losses"}, flush=True)
        if kernels == "triton" and r["ok"] and not args.both:
            break
    hf = out / "run_triton" / "hf"
    res["hf_export_files"] = sorted(p.name for p in hf.iterdir()) if hf.is_dir() else None
    return res


def multi(args) -> dict:
    import torch
    out, data, micro, steps = Path(args.out), Path(args.data), args.micro, args.steps
    res = {"device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", "micro_batch_per_gpu": micro}
    parts = args.parts.split(",")
    if "bare" in parts:
        for which in ("hf", "fastbert"):
            res[f"bare_loop_{which}"] = hf_baseline(data, micro, which=which)
            print(f"bare loop {which}:", res[f"bare_loop_{which}"], flush=True)
    if "z2_1" in parts:
        res["1gpu_zero2"] = launch(out / "z2_1", data, 1, 2, steps, micro, micro, out / "log_z2_1.txt")
    res["2gpu_zero2"] = launch(out / "z2_2", data, 2, 2, steps, micro, 2 * micro, out / "log_z2_2.txt")
    if "resume" in parts and res["2gpu_zero2"].get("ok"):
        resume_on_one(res, out, data, steps, micro)
    if "z3_2" in parts:
        res["2gpu_zero3"] = launch(out / "z3_2", data, 2, 3, steps, micro, 2 * micro, out / "log_z3_2.txt")
    one = res.get("1gpu_zero2", {}).get("seq_per_s")
    for k in ("2gpu_zero2", "2gpu_zero3"):
        if one and res[k].get("ok"):
            res[k]["scaling_efficiency"] = res[k]["seq_per_s"] / (2 * one)
    return res


def resume_on_one(res: dict, out: Path, data: Path, steps: int, micro: int) -> None:
    """Resume the 2-GPU ZeRO-2 checkpoint on 1 GPU (same global batch, accumulation 2)."""
    shutil.copytree(out / "z2_2" / "checkpoints", out / "resume_1" / "checkpoints")
    r = launch(out / "resume_1", data, 1, 2, steps + 10, micro, 2 * micro, out / "log_resume_1.txt")
    r["previous_last_loss"] = res["2gpu_zero2"].get("last_loss")
    res["resume_2_to_1"] = r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("single", "multi"))
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro", type=int, default=128)
    p.add_argument("--both", action="store_true", help="single: time kernels=torch too")
    p.add_argument("--parts", default="bare,z2_1,resume,z3_2",
                   help="multi: which runs besides the 2-GPU ZeRO-2 one (bare, z2_1, resume, z3_2)")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    res = single(args) if args.mode == "single" else multi(args)
    (Path(args.out) / f"pretrain_check_{args.mode}.json").write_text(json.dumps(res, indent=1))
    print("\n==== summary ====")
    for k, v in res.items():
        if isinstance(v, dict):
            v = {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items() if kk != "losses"}
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
