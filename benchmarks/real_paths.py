"""The commands users run, timed beside what they would run instead, on one card in one run.

    python3 benchmarks/real_paths.py --parts pretrain --data DIR --out OUT
    python3 benchmarks/real_paths.py --parts finetune --glue GLUE_DIR --vocab VOCAB_DIR --out OUT
    python3 benchmarks/real_paths.py --parts pretrain --variants default --gpus 1,2,4 --data DIR --out OUT  # 4 GPUs
    python3 benchmarks/real_paths.py --parts pretrain --variants "" --gpus 1,2 --gpu-variants default,z1-pack,z2-pack \
        --data DIR --out OUT                                               # ZeRO-0/1/2 on 2 GPUs
    python3 benchmarks/real_paths.py --parts ttq --data DIR --out OUT
    python3 benchmarks/real_paths.py --parts large --large-data MLM_DIR --out OUT   # BERT-large, academic budget

``pretrain``: BERT-base, seq 128, micro batch 128, bf16, real prepared Wikipedia data (DIR from
``fastbert prepare --nsp --seq-len 128``): HF ``BertForPreTraining`` (SDPA) in a bare loop (bf16
autocast, fused AdamW) and fastbert's model in the same bare loop (the model alone), then the real
``fastbert pretrain`` command (DeepSpeed, loader, device masking, guard, logging) for each variant
in ``--variants`` (ZeRO stage, packing, guard; ``no-sm90``: the FFN's GELU as passes of their own, not inside the
sm_90 GEMMs, through ``FASTBERT_GEMM_SM90=0``; ``no-graph-accum``: accumulated gradients added by autograd after
each graph replay, through ``FASTBERT_GRAPH_ACCUMULATE=0``; ``no-weight-casts``: the weights cast to 16 bits in
every forward, not once per optimizer step, through ``FASTBERT_WEIGHT_CASTS=0``). sequences/s count real sequences
(several share a row when fastbert packs), so every line measures the same data consumed per second.

``finetune``: ``fastbert finetune --task sst2`` beside HF ``Trainer`` (SDPA, bf16,
``DataCollatorWithPadding``) from the same random-init BERT-base checkpoint (HF layout, the
bert-base-uncased vocabulary), the same examples (``--ft-train`` of SST-2's train set, 0 = all), one
epoch, batch 32, lr 2e-5: training seconds and dev accuracy.

``ttq``: time to quality, the small preset (L=4, H=512) for ``--ttq-steps`` steps of 256 sequences:
HF's bare loop beside the ``fastbert pretrain`` command (``benchmarks/time_to_quality.py``, ways hf and
fb-pretrain), both final models evaluated on the same held-out batches and masks.

``large``: BERT-large through ``configs/academic-budget-large.json`` (MLM_DIR from ``fastbert prepare
--seq-len 128``), without and with the recipe's gradient accumulation, beside HF's bare loop at the same
sizes, micro batch and accumulation; ``--large-variants`` from the same table as ``--variants``.

Writes ``OUT/real_paths_<card>.json`` (every figure, with the card) and prints the table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

VARIANTS = {  # name: (extra `fastbert pretrain` overrides, environment set for the command)
    "default": ([], {}),                                  # what `fastbert pretrain` does unless told otherwise
    "z0-pack": (["train.zero_stage=0"], {}),
    "z1-pack": (["train.zero_stage=1"], {}),
    "z2-pack": (["train.zero_stage=2"], {}),
    "z1-none": (["train.zero_stage=1", "data.packing=none"], {}),
    "z1-pack-noguard": (["train.zero_stage=1", "guard.enabled=false"], {}),
    "default-noguard": (["guard.enabled=false"], {}),
    "eager": (["train.cuda_graphs=false"], {}),
    "span1": (["data.pack_span=1"], {}),                   # one row a packing bin (the layout before spans)
    "fp8": (["train.precision=fp8"], {}),
    "no-sm90": ([], {"FASTBERT_GEMM_SM90": "0"}),          # the FFN without the sm_90 GELU GEMMs
    "no-graph-accum": ([], {"FASTBERT_GRAPH_ACCUMULATE": "0"}),  # autograd adds each micro-batch's gradients
    "no-qkv-fused": ([], {"FASTBERT_QKV_ATTENTION": "0"}),  # the QKV projection and attention as two ops
    "no-weight-casts": ([], {"FASTBERT_WEIGHT_CASTS": "0"}),  # the weights cast to 16 bits in every forward
    "fp8-no-graph-accum": (["train.precision=fp8"], {"FASTBERT_GRAPH_ACCUMULATE": "0"}),
}
FT_VARIANTS = {  # name: extra `fastbert finetune` flags
    "default": [],                                          # token-bucketed batches, CUDA graphs
    "eager": ["--no-cuda-graphs"],                          # the same batches, every step eager
    "padded": ["--no-static-batches", "--no-cuda-graphs"],  # padded batches (before static batches)
}


BENCH_OVERRIDES = ["log.every_steps=5", "eval.every_steps=null", "eval.every_minutes=null", "eval.batches=4",
                   "checkpoint.every_minutes=null", "checkpoint.every_steps=null", "checkpoint.at_end=false",
                   "export.hf=false"]   # a timed run: no evaluation, checkpoint or export inside it


def pretrain_command(out: Path, data: Path, steps: int, micro: int, extra, log: Path, gpus: int = 1,
                     config: str = "configs/base.json", skip: int = 10, env: dict | None = None) -> dict:
    """``fastbert pretrain --config CONFIG`` for ``steps`` optimizer steps; its throughput is the median of the
    logged windows after step ``skip``. With ``configs/base.json`` the micro batch, bf16 and an AdamW recipe are
    set here (the variants' ``extra`` on top); another config keeps its own recipe but for ``extra``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}",
                f"--master_port={29700 + gpus}"] if gpus > 1 else [sys.executable]
    recipe = ["train.deepspeed=null", "train.precision=bf16", f"train.micro_batch_size={micro}",
              f"train.global_batch_size={micro * gpus}", "train.warmup=0.1",
              'train.optimizer={"type":"adamw","lr":5e-4,"betas":[0.9,0.98],"eps":1e-6,"weight_decay":0.01}'] \
        if config == "configs/base.json" else ["train.time_budget=null"]
    cmd = [*launcher, "-m", "fastbert.commands.pretrain", "--config", config, f"output_dir={out}", f"data.dir={data}",
           "data.auto_prepare=false", f"train.max_steps={steps}", *recipe, *BENCH_OVERRIDES, *extra]
    from gpu_pretrain_check import read_records, run_logged
    ok, wall = run_logged(cmd, log, env)
    if not ok:
        return {"ok": False, "wall_s": wall}
    recs = read_records(out)
    train = [r for r in recs if r["event"] == "train"]
    start = next((r for r in recs if r["event"] == "start"), {})
    later = [r for r in train if r["step"] > skip] or train
    median = statistics.median(r["seq_per_s"] for r in later)
    guard = [r for r in recs if r["event"] == "guard"]
    return {"ok": True, "wall_s": wall, "seq_per_s": median, "min_window_seq_per_s": min(r["seq_per_s"] for r in later),
            "min_over_median": min(r["seq_per_s"] for r in later) / median,
            "windows": [round(r["seq_per_s"], 1) for r in train],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "mfu": statistics.median(r.get("mfu") or 0 for r in later),
            "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"], "guard_events": len(guard),
            "first_window_s": train[0].get("elapsed_s"), "zero_stage": start.get("zero_stage"),
            "grad_accum": start.get("grad_accum")}


def part_pretrain(args, res: dict) -> None:
    from gpu_pretrain_check import hf_baseline
    data, out = Path(args.data), Path(args.out)
    res["hf_bare_loop"] = hf_baseline(data, args.micro, steps=20, which="hf")
    print("hf bare loop:", res["hf_bare_loop"], flush=True)
    if args.bare_fastbert:
        res["fastbert_bare_loop"] = hf_baseline(data, args.micro, steps=20, which="fastbert")
        print("fastbert model, bare loop:", res["fastbert_bare_loop"], flush=True)
    for name in filter(None, args.variants.split(",")):
        r = pretrain_command(out / f"pt_{name}", data, args.steps, args.micro, VARIANTS[name][0],
                             out / f"log_pt_{name}.txt", env=VARIANTS[name][1])
        res[f"fastbert_pretrain_{name}"] = r
        print(f"fastbert pretrain {name}:", {k: v for k, v in r.items() if k != "windows"}, flush=True)
        save(args, res)
    counts = [int(n) for n in args.gpus.split(",")] if args.gpus else []
    for n in counts:          # weak scaling: the same micro batch per GPU, the defaults otherwise
        for name in args.gpu_variants.split(","):   # and other ZeRO stages beside the defaults
            key = f"gpus{n}" + ("" if name == "default" else f"_{name}")
            r = pretrain_command(out / f"pt_{key}", data, args.steps, args.micro, VARIANTS[name][0],
                                 out / f"log_pt_{key}.txt", gpus=n, env=VARIANTS[name][1])
            res[f"fastbert_pretrain_{key}"] = r
            print(f"fastbert pretrain on {n} GPU(s), {name}:", {k: v for k, v in r.items() if k != "windows"},
                  flush=True)
            save(args, res)
    one = res.get("fastbert_pretrain_gpus1", {}).get("seq_per_s")
    for n in counts:
        r = res[f"fastbert_pretrain_gpus{n}"]
        if one and r.get("ok"):
            r["scaling_efficiency"] = r["seq_per_s"] / (n * one)


def part_large(args, res: dict) -> None:
    """BERT-large through the academic-budget recipe (``configs/academic-budget-large.json``: Pre-LN, MLM only,
    micro batch 128, its optimizer and DeepSpeed JSON) on one GPU, at each gradient accumulation of
    ``--large-accum`` (32 = the recipe's global batch of 4,096 on one GPU), beside HF's ``BertForMaskedLM``
    (BERT-large sizes, SDPA) in the bare loop with the same micro batch and accumulation."""
    from gpu_pretrain_check import hf_baseline
    data, out = Path(args.large_data), Path(args.out)

    def recipe(key: str, accum: int, hf: dict, steps: int, extra=(), gpus: int = 1, env=None) -> dict:
        r = pretrain_command(out / f"pt_{key}", data, steps, args.micro,
                             [f"train.global_batch_size={args.micro * accum}", "log.every_steps=3", *extra],
                             out / f"log_pt_{key}.txt", gpus=gpus, config="configs/academic-budget-large.json",
                             skip=steps // 3, env=env)
        r["vs_hf"] = r["seq_per_s"] / hf["seq_per_s"] if r.get("ok") else None
        res[f"fastbert_pretrain_{key}"] = r
        print(f"fastbert pretrain academic-budget-large, {key}:", {k: v for k, v in r.items() if k != "windows"},
              flush=True)
        save(args, res)
        return r

    for accum in (int(a) for a in args.large_accum.split(",")):
        hf = hf_baseline(data, args.micro, steps=max(20, 2 * accum), which="hf", preset="large", accum=accum)
        res[f"hf_bare_loop_large_accum{accum}"] = hf
        print(f"hf bare loop, BERT-large, accumulation {accum}:", hf, flush=True)
        steps = max(30 // accum, 6) * 3      # logged windows of 3 steps; the first third is warm-up
        for name in filter(None, args.large_variants.split(",")):
            recipe(f"large_accum{accum}" + ("" if name == "default" else f"_{name}"), accum, hf, steps,
                   VARIANTS[name][0], env=VARIANTS[name][1])
    one = res.get(f"fastbert_pretrain_large_accum{accum}", {}).get("seq_per_s")
    for n in (int(g) for g in args.large_gpus.split(",") if g and int(g) > 1):
        # the recipe's global batch on n GPUs: the last accumulation's global batch, accumulation / n each
        r = recipe(f"large_gpus{n}", accum, hf, steps, gpus=n)
        if r.get("ok") and one:
            r["scaling_efficiency"] = r["seq_per_s"] / (n * one)
            save(args, res)


def make_random_checkpoint(vocab_dir: Path, out: Path) -> Path:
    """A random-init BERT-base in HF layout with the bert-base-uncased vocabulary (both tools start here)."""
    import shutil
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2))
    model.save_pretrained(out)
    for name in ("vocab.txt", "tokenizer_config.json"):
        if (vocab_dir / name).is_file():
            shutil.copy(vocab_dir / name, out / name)
    return out


def hf_trainer_sst2(ckpt: Path, glue: Path, out: Path, n_train: int) -> dict:
    import numpy as np
    import torch
    import transformers
    from transformers import (BertForSequenceClassification, BertTokenizerFast, DataCollatorWithPadding, Trainer,
                              TrainingArguments)
    tok = BertTokenizerFast.from_pretrained(ckpt)

    def load(split, limit):
        lines = (glue / "SST-2" / f"{split}.tsv").read_text(encoding="utf-8").splitlines()[1:]  # header first
        rows = [line.rsplit("\t", 1) for line in lines if line.strip()]
        rows = rows[:limit] if limit else rows
        enc = tok([sentence for sentence, _ in rows], truncation=True, max_length=128)
        return [{"input_ids": i, "token_type_ids": t, "attention_mask": m, "labels": int(label)}
                for i, t, m, (_, label) in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"], rows)]

    train, dev = load("train", n_train), load("dev", 0)
    model = BertForSequenceClassification.from_pretrained(ckpt, attn_implementation="sdpa")
    targs = TrainingArguments(output_dir=str(out), per_device_train_batch_size=32, per_device_eval_batch_size=128,
                              learning_rate=2e-5, num_train_epochs=1, warmup_steps=0.1, weight_decay=0.01, bf16=True,
                              logging_steps=100, save_strategy="no", report_to=[], seed=42, dataloader_num_workers=2)

    def metrics(p):
        return {"accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())}
    trainer = Trainer(model=model, args=targs, train_dataset=train, eval_dataset=dev,
                      data_collator=DataCollatorWithPadding(tok), compute_metrics=metrics)
    t0 = time.time()
    tr = trainer.train()
    train_s = time.time() - t0
    ev = trainer.evaluate()
    del trainer, model
    torch.cuda.empty_cache()
    return {"train_s": train_s, "train_runtime": tr.metrics.get("train_runtime"), "steps": tr.global_step,
            "accuracy": ev.get("eval_accuracy"), "transformers": transformers.__version__}


def fastbert_sst2(ckpt: Path, glue: Path, out: Path, n_train: int, extra=()) -> dict:
    cmd = [sys.executable, "-m", "fastbert.cli", "finetune", "--task", "sst2", "--data", str(glue / "SST-2"),
           "--model", str(ckpt), "--output", str(out), "--epochs", "1", "--batch-size", "32", "--lr", "2e-5",
           "--precision", "bf16", "--kernels", "triton", *extra]
    if n_train:
        cmd += ["--max-train-samples", str(n_train)]
    t0 = time.time()
    log = out.parent / f"log_{out.name}.txt"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=f,
                            stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    if rc != 0:
        print("fastbert finetune failed:\n" + log.read_text()[-3000:], flush=True)
        return {"ok": False, "wall_s": wall}
    m = json.loads((out / "metrics.json").read_text())
    return {"ok": True, "wall_s": wall, "train_s": m.get("train", {}).get("train_seconds"),
            "steps": m.get("train", {}).get("steps"), "accuracy": m.get("metrics", {}).get("accuracy")}


def part_finetune(args, res: dict) -> None:
    out = Path(args.out)
    ckpt = make_random_checkpoint(Path(args.vocab), out / "ckpt")
    glue = Path(args.glue)
    res["hf_trainer_sst2"] = hf_trainer_sst2(ckpt, glue, out / "ft_hf", args.ft_train)
    print("HF Trainer sst2:", res["hf_trainer_sst2"], flush=True)
    for name in filter(None, args.ft_variants.split(",")):
        key = name.replace("@", "_run")
        r = fastbert_sst2(ckpt, glue, out / f"ft_fastbert_{key}", args.ft_train, FT_VARIANTS[name.split("@")[0]])
        res[f"fastbert_finetune_sst2_{key}"] = r
        print(f"fastbert finetune sst2 {key}:", r, flush=True)
        save(args, res)


def part_ttq(args, res: dict) -> None:
    """Time to quality, small preset: HF's bare loop beside the `fastbert pretrain` command
    (benchmarks/time_to_quality.py's pretrain part, ways hf and fb-pretrain)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import time_to_quality
    out = Path(args.out) / "ttq"
    out.mkdir(parents=True, exist_ok=True)
    summary = time_to_quality.main(["--parts", "pretrain", "--data", str(args.data), "--out", str(out),
                                    "--steps", str(args.ttq_steps), "--seeds", "0", "--ways", "hf,fb-pretrain"])
    res["time_to_quality"] = summary["pretrain"]["agreement"]


def save(args, res: dict) -> Path:
    """Write what is measured so far (a run cut short keeps its figures)."""
    name = "real_paths_" + "".join(c if c.isalnum() else "_" for c in res["card"]) + ".json"
    path = Path(args.json_dir or args.out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    return path


def table(res: dict) -> str:
    rows = [("what", "seq/s or train s", "ratio")]
    hf = res.get("hf_bare_loop", {}).get("seq_per_s")
    bare = res.get("fastbert_bare_loop", {}).get("seq_per_s")
    first = {k: res.get(k, {}).get("first_pass_seq_per_s") for k in ("hf_bare_loop", "fastbert_bare_loop")}
    cold = {k: f" (first pass {v:.0f})" if v else "" for k, v in first.items()}
    if hf:
        rows.append(("HF BertForPreTraining bare loop (SDPA, bf16)", f"{hf:.0f}{cold['hf_bare_loop']}", "1.00x"))
    if bare:
        rows.append(("fastbert model, same bare loop", f"{bare:.0f}{cold['fastbert_bare_loop']}",
                     f"{bare / hf:.2f}x" if hf else ""))
    for k, v in res.items():
        if k.startswith("hf_bare_loop_large_"):
            rows.append((f"HF BertForMaskedLM BERT-large bare loop, {k[19:]}", f"{v['seq_per_s']:.0f}", "1.00x"))
        elif k.startswith("fastbert_pretrain_large_") and v.get("ok"):
            eff = f", weak-scaling efficiency {v['scaling_efficiency']:.0%}" if v.get("scaling_efficiency") else ""
            rows.append((f"fastbert pretrain academic-budget-large, {k[24:]}",
                         f"{v['seq_per_s']:.0f} (min window {v['min_over_median']:.0%} of median{eff})",
                         f"{v['vs_hf']:.2f}x HF (1 GPU)" if "gpus" in k else f"{v['vs_hf']:.2f}x HF"))
        elif k.startswith("fastbert_pretrain_") and v.get("ok"):
            extra = f" (min window {v['min_over_median']:.0%} of median; {v['guard_events']} guard events)"
            if "scaling_efficiency" in v:
                extra += f", weak-scaling efficiency {v['scaling_efficiency']:.0%}"
            rows.append((f"fastbert pretrain {k[18:]}", f"{v['seq_per_s']:.0f}{extra}",
                         (f"{v['seq_per_s'] / hf:.2f}x HF" if hf else "") +
                         (f", {v['seq_per_s'] / bare:.0%} of bare" if bare else "")))
    t = res.get("hf_trainer_sst2")
    if t:
        rows.append(("HF Trainer sst2 (train s, dev acc)", f"{t['train_s']:.1f} s, {t['accuracy']:.4f}", "1.00x"))
    for k, f in res.items():
        if t and k.startswith("fastbert_finetune_sst2") and f.get("ok") and f.get("train_s"):
            rows.append((f"fastbert finetune sst2 {k[23:]} (train s, dev acc)",
                         f"{f['train_s']:.1f} s, {f['accuracy']:.4f}", f"{t['train_s'] / f['train_s']:.2f}x faster"))
    q = res.get("time_to_quality", {})
    if "hf" in q:
        rows.append(("time to quality, small preset: HF bare loop (train s, final held-out MLM loss)",
                     f"{q['hf']['train_seconds']:.1f} s, {q['hf']['final_mlm_loss']:.3f}", "1.00x"))
    if "fb-pretrain" in q:
        f = q["fb-pretrain"]
        rows.append(("time to quality: fastbert pretrain (train s, final loss on the same masks)",
                     f"{f['train_seconds']:.1f} s, {f['final_mlm_loss']:.3f}",
                     f"{f['seconds_vs_hf']:.2f}x HF's seconds (target <= 0.5x, loss <= HF + 0.02: "
                     f"{'met' if f['time_to_quality_target_met'] else 'missed'})"))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(" | ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="pretrain,finetune")
    p.add_argument("--data", help="prepared NSP data, seq 128 (pretrain)")
    p.add_argument("--glue", help="GLUE root with SST-2 (finetune)")
    p.add_argument("--vocab", help="folder with the bert-base-uncased vocab.txt (finetune)")
    p.add_argument("--out", required=True, help="working folder (runs, logs)")
    p.add_argument("--json-dir", help="where real_paths_<card>.json goes (default: --out)")
    p.add_argument("--large-data", help="prepared MLM-only data, seq 128 (large: `fastbert prepare --seq-len 128`)")
    p.add_argument("--large-accum", default="1,32", help="gradient accumulations of the large part (32: the "
                   "academic-budget recipe's global batch of 4,096 on one GPU)")
    p.add_argument("--large-variants", default="default", help="`fastbert pretrain` variants of the large part")
    p.add_argument("--large-gpus", default="", help="also run the large part's last accumulation on these GPU counts "
                   "(the same global batch, weak scaling against one GPU; a multi-GPU kind)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro", type=int, default=128)
    p.add_argument("--variants", default="default,z1-pack,z2-pack,z1-none,default-noguard")
    p.add_argument("--gpus", default="", help="weak scaling, e.g. 1,2,4: `fastbert pretrain` (defaults) on that many "
                   "GPUs with micro batch --micro per GPU (a multi-GPU kind)")
    p.add_argument("--gpu-variants", default="default",
                   help="variants run at each --gpus count, e.g. default,z1-pack,z2-pack (ZeRO stage per world size)")
    p.add_argument("--bare-fastbert", action="store_true",
                   help="also time fastbert's model (padded batches, dynamic shapes) in HF's bare loop")
    p.add_argument("--ft-variants", default="default@1,default@2,eager,padded",
                   help=f"fastbert finetune runs, in order: {', '.join(FT_VARIANTS)}; NAME@N repeats a variant "
                        "(the first run of a fresh machine tunes Triton cold, later ones read the tuning cache)")
    p.add_argument("--ft-train", type=int, default=0, help="SST-2 training examples (0 = all 67,349)")
    p.add_argument("--ttq-steps", type=int, default=3000, help="time-to-quality steps (small preset, batch 256)")
    args = p.parse_args()
    unknown = [n for v in (args.variants, args.gpu_variants, args.large_variants) for n in v.split(",")
               if n and n not in VARIANTS]
    if unknown:  # before HF's baseline runs, not after it
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    import torch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(0)
    res = {"card": card, "torch": torch.__version__, "micro_batch": args.micro, "steps": args.steps}
    parts = args.parts.split(",")
    if "pretrain" in parts:
        part_pretrain(args, res)
    save(args, res)
    if "large" in parts:
        part_large(args, res)
    if "finetune" in parts:
        part_finetune(args, res)
    save(args, res)
    if "ttq" in parts:
        part_ttq(args, res)
    save(args, res)
    print(f"\n==== {card} ====\n" + table(res), flush=True)


if __name__ == "__main__":
    main()
