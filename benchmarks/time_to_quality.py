"""Time-to-quality proof (issue 11): the academic-budget recipe scaled down, fastbert vs HF on the same
data, then fine-tuned. One script, resumable per part (a finished run's JSON is reused), writing JSON
and PNGs under --out.

Parts:
  pretrain  The `small` preset (L=4, H=512) pretrained for --steps optimizer steps on one card:
            hf          HF BertForMaskedLM (SDPA) in a plain loop (what a user would otherwise run);
            fb-torch, fb-triton   fastbert's model in the same plain loop, kernels="torch" / "triton",
                        on the SAME batches and masks as hf (padded rows, shapes change every step);
            fb-pretrain the `fastbert pretrain` command itself (static packed batches, CUDA graphs, the
                        DeepSpeed engine and its defaults), same preset, steps, batch, optimizer and
                        schedule, its own data order and masks; its final model (the HF export) is
                        evaluated on the same held-out batches and masks as the others, its curve
                        between comes from its own evaluations (the same held-out split, other masks).
            fb-pretrain-fp8  the same command with train.precision=fp8 (FP8 GEMMs; opt-in: --ways); the
                        summary gives its final loss beside fb-pretrain's (issue 18: within +-0.02).
            --seeds seeds each (model init and dropout). MLM loss / accuracy on a fixed held-out set every
            --eval-every steps, training seconds per run (warm-up, tuning and graph capture included;
            evaluation left out); plots loss vs step and loss vs seconds. All use Post-LN: HF's BertModel
            has no Pre-LN, and the curves must be the same model to be comparable (`--prenorm` runs the
            fastbert ways Pre-LN instead). Academic-budget hyperparameters scaled to the run: AdamW lr --lr,
            betas (0.9, 0.98), eps 1e-6, weight decay 0.01, warmup 6% of the steps then linear decay to 0,
            MLM only, seq 128, bf16 autocast on GPU. The summary gives each way's final loss beside HF's and
            its training seconds as a fraction of HF's (issue 14's target: HF's final loss +-0.02 in <= 0.5x).
  finetune  `fastbert finetune` of the pretrained fastbert (triton) checkpoint and of a random-init model of
            the same shape on SST-2 and MRPC, --ft-seeds seeds each; medians and the margin.
  minilm    all-MiniLM-L6-v2 fine-tuned on full SST-2 and MRPC with fastbert (triton) and with HF (a plain HF
            loop) on the same card: dev scores and the wall-clock ratio.
  project   24hBERT's budget (~95 M sequences of 128 tokens) projected on 1 and 8 cards from a measured
            BERT-large seq-128 throughput (an e2e_train_step.py JSON or --seq-per-s):
            hours = 95e6 / (seq_per_s * cards * efficiency) / 3600.

  python3 benchmarks/time_to_quality.py --parts pretrain,project --data runs/data/enwiki-128 --out runs/ttq
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
WAYS = ("hf", "fb-torch", "fb-triton", "fb-pretrain", "fb-pretrain-fp8")
COMMAND_WAYS = {"fb-pretrain": "auto", "fb-pretrain-fp8": "fp8"}  # the command, by its train.precision
BUDGET_SEQUENCES = 95e6  # 24hBERT (Izsak et al. 2021): ~23k steps x 4096 sequences of 128 tokens


# ----------------------------------------------------------------------------------- data
class SameBatches:
    """Step ``s`` always gives the same sequences and the same masks, whichever model consumes it."""

    def __init__(self, data_dir, batch: int, seed: int, device):
        from fastbert.data.masking import collator_for
        from fastbert.data.pretrain_dataset import GlobalOrder, PretrainData
        self.train = PretrainData(data_dir, "train")
        self.val = PretrainData(data_dir, "val")
        self.order = GlobalOrder(len(self.train), batch, seed)
        self.batch, self.seed, self.device = batch, seed, torch.device(device)
        self.collator = collator_for(data_dir, seed=seed, device=self.device)

    def _masked(self, arrays: dict, mask_seed: int) -> dict:
        b = {k: torch.from_numpy(v).to(self.device) for k, v in arrays.items()}
        self.collator.generator.manual_seed(mask_seed)
        ids, labels = self.collator(b["input_ids"], b["attention_mask"])
        return dict(input_ids=ids, attention_mask=b["attention_mask"], token_type_ids=b["token_type_ids"],
                    labels=labels)

    def step(self, s: int) -> dict:
        idx = self.order.micro_batch(s, 0, 0, 1, self.batch)
        return self._masked(self.train.batch(idx, pad_to=self.train.seq_len), self.seed * 1_000_003 + s)

    def eval_set(self, batches: int) -> list[dict]:
        n = min(batches * self.batch, len(self.val)) // self.batch * self.batch
        if n == 0:
            raise SystemExit(f"the validation split has {len(self.val)} sequences, fewer than one batch "
                             f"({self.batch}); prepare with a larger --val-fraction")
        return [self._masked(self.val.batch(range(i, i + self.batch), pad_to=self.val.seq_len), -1 - i)
                for i in range(0, n, self.batch)]


# ----------------------------------------------------------------------------------- models
def build_model(way: str, preset: str, vocab_size: int, pad_id: int, prenorm: bool, seed: int, device):
    import fastbert
    torch.manual_seed(seed)
    cfg = fastbert.BertConfig.preset(preset, vocab_size=vocab_size, pad_token_id=pad_id,
                                     prenorm=prenorm and way != "hf",
                                     kernels="triton" if way == "fb-triton" else "torch")
    fb = fastbert.BertForMaskedLM(cfg)  # the init all three ways share
    if way != "hf":
        return fb.to(device)
    import transformers
    from fastbert.hf import fastbert_to_hf
    d = cfg.to_dict()
    d.pop("fastbert_prenorm")
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**d))
    hf.config._attn_implementation = "sdpa"
    state = fastbert_to_hf({k: v for k, v in fb.state_dict().items()})
    hf.load_state_dict({k: v for k, v in state.items() if k in hf.state_dict()}, strict=False)
    return hf.to(device)


def mlm_stats(model, batch) -> tuple[torch.Tensor, float, float]:
    """(loss for backward, summed NLL, correct) with the same definition for HF and fastbert."""
    out = model(**batch)
    if getattr(out, "mlm_count", None) is not None:  # fastbert sparse head: mean over predicted tokens
        n = float(out.mlm_count)
        return out.loss, float(out.loss.detach()) * n, float(out.mlm_correct)
    labels = batch["labels"]
    keep = labels != -100
    logits = out.logits[keep].float()
    nll = torch.nn.functional.cross_entropy(logits, labels[keep], reduction="sum")
    return out.loss, float(nll), float((logits.argmax(-1) == labels[keep]).sum())


@torch.no_grad()
def evaluate(model, eval_set, autocast) -> dict:
    model.eval()
    nll = correct = count = 0.0
    for b in eval_set:
        with autocast():
            _, s, c = mlm_stats(model, b)
        nll += s
        correct += c
        count += float((b["labels"] != -100).sum())
    model.train()
    return {"mlm_loss": nll / count, "mlm_acc": correct / count}


def autocast_for(device: torch.device):
    """The autocast context every way trains and evaluates under: bf16 on a GPU, none on the CPU."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def lr_at(step: int, total: int, peak: float, warmup: float) -> float:
    w = max(1, int(round(warmup * total)))
    return peak * (step + 1) / w if step < w else peak * max(0.0, (total - step) / max(1, total - w))


def pretrain_run(way: str, seed: int, args, data: SameBatches, eval_set, out: Path) -> dict:
    path = out / f"pretrain_{way}_seed{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    device = data.device
    idx = data.train.index
    model = build_model(way, args.preset, idx["vocab_size"], idx["special_ids"]["pad"], args.prenorm, seed, device)
    model.train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01,
                            fused=fused)
    on_gpu = device.type == "cuda"
    autocast = autocast_for(device)
    curve = [{"step": 0, "seconds": 0.0, **evaluate(model, eval_set, autocast)}]
    torch.manual_seed(seed + 1)  # dropout stream
    train_s = 0.0
    print(f"[pretrain] {way} seed {seed}: step 0 {curve[0]}", flush=True)
    for s in range(args.steps):
        batch = data.step(s)
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(s, args.steps, args.lr, 0.06)
        with autocast():
            loss, _, _ = mlm_stats(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.synchronize()
        train_s += time.perf_counter() - t0
        if (s + 1) % args.eval_every == 0 or s + 1 == args.steps:
            point = {"step": s + 1, "seconds": train_s, "train_loss": float(loss.detach()),
                     **evaluate(model, eval_set, autocast)}
            curve.append(point)
            print(f"[pretrain] {way} seed {seed}: {point}", flush=True)
    res = {"way": way, "seed": seed, "preset": args.preset, "prenorm": args.prenorm and way != "hf",
           "steps": args.steps, "batch": args.batch, "lr": args.lr, "train_seconds": train_s,
           "device": torch.cuda.get_device_name() if on_gpu else "cpu", "curve": curve}
    if way == "fb-triton" and seed == args.seeds[0]:
        ckpt = out / "pretrained-fastbert"
        model.save_pretrained(ckpt)
        (ckpt / "vocab.txt").write_text((Path(args.data) / "vocab.txt").read_text())
        res["checkpoint"] = str(ckpt)
    from fastbert.io import atomic_write_text
    atomic_write_text(path, json.dumps(res, indent=2))
    return res


def pretrain_command_run(seed: int, args, eval_set, out: Path, way: str = "fb-pretrain") -> dict:
    """``fastbert pretrain`` (the command, in a child process) with the benchmark's recipe and the way's
    ``train.precision``; its final HF export evaluated on ``eval_set``."""
    path = out / f"pretrain_{way}_seed{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    run_dir = out / f"{way}_seed{seed}"
    cfg = {
        "output_dir": str(run_dir),
        "model": {"preset": args.preset, "head": "masked_lm", "prenorm": args.prenorm, "kernels": "auto"},
        "data": {"dir": str(args.data), "auto_prepare": False},
        "train": {"micro_batch_size": args.batch, "global_batch_size": args.batch, "max_steps": args.steps,
                  "warmup": 0.06, "schedule": "linear", "gradient_clipping": 1.0, "precision": COMMAND_WAYS[way],
                  "seed": seed, "optimizer": {"type": "adamw", "lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-6,
                                              "weight_decay": 0.01}},
        "eval": {"every_steps": args.eval_every, "batches": args.eval_batches, "at_end": False},
        "checkpoint": {"every_steps": None, "every_minutes": None, "at_end": True, "resume": "never"},
        "log": {"every_steps": math.gcd(args.eval_every, args.steps), "tensorboard": False},
        "export": {"hf": True},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / f"{way}_seed{seed}.json").write_text(json.dumps(cfg, indent=1))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fastbert.cli", "pretrain", "--config",
                    str(run_dir.parent / f"{way}_seed{seed}.json")], check=True)
    command_s = time.perf_counter() - t0
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train_s = {r["step"]: r["train_s"] for r in records if r["event"] == "train"}
    curve = [{"step": r["step"], "seconds": train_s.get(r["step"]), "mlm_loss": r["mlm_loss"], "mlm_acc": r["mlm_acc"],
              "eval_masks": "own"} for r in records if r["event"] == "eval"]
    summary = json.loads((run_dir / "summary.json").read_text())
    import fastbert
    device = eval_set[0]["input_ids"].device
    model = fastbert.BertForMaskedLM.from_pretrained(run_dir / "hf").to(device)
    on_gpu = device.type == "cuda"
    autocast = autocast_for(device)
    final = {"step": summary["steps"], "seconds": summary["train_s"], **evaluate(model, eval_set, autocast),
             "eval_masks": "shared"}
    curve = [p for p in curve if p["step"] < final["step"]] + [final]
    print(f"[pretrain] {way} seed {seed}: {final} (command {command_s:.1f}s)", flush=True)
    res = {"way": way, "seed": seed, "preset": args.preset, "prenorm": args.prenorm, "steps": args.steps,
           "batch": args.batch, "lr": args.lr, "train_seconds": summary["train_s"], "command_seconds": command_s,
           "device": torch.cuda.get_device_name() if on_gpu else "cpu", "curve": curve, "config": cfg}
    from fastbert.io import atomic_write_text
    atomic_write_text(path, json.dumps(res, indent=2))
    return res


def plot_curves(runs: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"hf": "tab:blue", "fb-torch": "tab:orange", "fb-triton": "tab:green", "fb-pretrain": "tab:red",
              "fb-pretrain-fp8": "tab:purple"}
    for xkey, name in (("step", "loss_vs_step.png"), ("seconds", "loss_vs_seconds.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in runs:
            xs = [p[xkey] for p in r["curve"]]
            ys = [p["mlm_loss"] for p in r["curve"]]
            ax.plot(xs, ys, color=colors[r["way"]], alpha=0.85, label=f"{r['way']} seed {r['seed']}")
        ax.set_xlabel("optimizer step" if xkey == "step" else "training seconds")
        ax.set_ylabel("held-out MLM loss")
        ax.set_title(f"{runs[0]['preset']} preset, {runs[0]['steps']} steps x {runs[0]['batch']} seq, "
                     f"{runs[0]['device']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)


def agreement(runs: list[dict]) -> dict:
    """Final held-out loss/accuracy per way (mean over seeds), the seed spread, and wall-clock."""
    table = {}
    for way in WAYS:
        rs = [r for r in runs if r["way"] == way]
        if not rs:
            continue
        losses = [r["curve"][-1]["mlm_loss"] for r in rs]
        accs = [r["curve"][-1]["mlm_acc"] for r in rs]
        table[way] = {"final_mlm_loss": statistics.mean(losses), "final_mlm_acc": statistics.mean(accs),
                      "seed_spread_loss": max(losses) - min(losses), "train_seconds": statistics.mean(
                          r["train_seconds"] for r in rs)}
    if "hf" in table:
        noise = max(v["seed_spread_loss"] for v in table.values())
        for v in table.values():
            v["loss_diff_vs_hf"] = v["final_mlm_loss"] - table["hf"]["final_mlm_loss"]
            v["within_seed_noise"] = abs(v["loss_diff_vs_hf"]) <= max(noise, 1e-3) * 2
            v["speedup_vs_hf"] = table["hf"]["train_seconds"] / v["train_seconds"]
            v["seconds_vs_hf"] = v["train_seconds"] / table["hf"]["train_seconds"]
            # Issue 14's time-to-quality target: HF's final held-out loss (+-0.02) in <= 0.5x its seconds.
            v["reaches_hf_loss"] = v["final_mlm_loss"] <= table["hf"]["final_mlm_loss"] + 0.02
            v["time_to_quality_target_met"] = v["reaches_hf_loss"] and v["seconds_vs_hf"] <= 0.5
    if "fb-pretrain" in table and "fb-pretrain-fp8" in table:  # FP8 against the same command in bf16
        fp8, bf16 = table["fb-pretrain-fp8"], table["fb-pretrain"]
        fp8["loss_diff_vs_bf16"] = fp8["final_mlm_loss"] - bf16["final_mlm_loss"]
        fp8["within_0.02_of_bf16"] = abs(fp8["loss_diff_vs_bf16"]) <= 0.02
        fp8["speedup_vs_bf16"] = bf16["train_seconds"] / fp8["train_seconds"]
    return table


def part_pretrain(args, out: Path) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = SameBatches(args.data, args.batch, seed=1234, device=device)
    eval_set = data.eval_set(args.eval_batches)
    runs = [pretrain_command_run(seed, args, eval_set, out, way) if way in COMMAND_WAYS else
            pretrain_run(way, seed, args, data, eval_set, out) for seed in args.seeds for way in args.ways]
    plot_curves(runs, out)
    summary = {"runs": [f"pretrain_{r['way']}_seed{r['seed']}.json" for r in runs], "agreement": agreement(runs),
               "plots": ["loss_vs_step.png", "loss_vs_seconds.png"]}
    (out / "pretrain_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["agreement"], indent=2))
    return summary


# ----------------------------------------------------------------------------------- fine-tuning
def finetune(model_dir: str, task: str, data_dir: Path, seed: int, out: Path, extra: list[str]) -> dict:
    metrics = out / "metrics.json"
    if not metrics.is_file():
        cmd = [sys.executable, "-m", "fastbert.cli", "finetune", "--task", task, "--data", str(data_dir),
               "--model", model_dir, "--output", str(out), "--seed", str(seed), *extra]
        subprocess.run(cmd, check=True)
    return json.loads(metrics.read_text())


def main_metric(task: str, metrics: dict) -> float:
    """The task's main dev metric from ``fastbert finetune``'s metrics.json (dev scores under "metrics")."""
    metrics = metrics.get("metrics", metrics)
    for key in ("accuracy", "eval_accuracy", "acc"):
        if key in metrics:
            return float(metrics[key])
    flat = metrics.get("eval", metrics)
    for key in ("accuracy", "f1"):
        if key in flat:
            return float(flat[key])
    raise KeyError(f"no accuracy in {task} metrics: {sorted(metrics)}")


def part_finetune(args, out: Path) -> dict:
    ckpt = out / "pretrained-fastbert"
    if not (ckpt / "config.json").is_file():
        raise SystemExit("run --parts pretrain first (it writes the pretrained fastbert checkpoint)")
    random_dir = out / "random-init"
    if not (random_dir / "config.json").is_file():
        import fastbert
        cfg = fastbert.BertConfig.from_pretrained(ckpt)
        torch.manual_seed(0)
        fastbert.BertForMaskedLM(cfg).save_pretrained(random_dir)
        (random_dir / "vocab.txt").write_text((ckpt / "vocab.txt").read_text())
    glue = Path(args.glue)
    result = {}
    for task, folder in (("sst2", "SST-2"), ("mrpc", "MRPC")):
        for name, model_dir in (("pretrained", ckpt), ("random", random_dir)):
            scores = [main_metric(task, finetune(str(model_dir), task, glue / folder, seed,
                                                 out / f"ft_{task}_{name}_seed{seed}", args.ft_args))
                      for seed in args.ft_seeds]
            result.setdefault(task, {})[name] = {"scores": scores, "median": statistics.median(scores)}
        result[task]["margin"] = result[task]["pretrained"]["median"] - result[task]["random"]["median"]
    (out / "finetune_summary.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


def part_minilm(args, out: Path) -> None:
    """fastbert (triton) vs a plain HF loop on full SST-2 and MRPC with all-MiniLM-L6-v2: the check script
    (scripts/gpu_finetune_check.py, same features, batches, order and schedule on both sides)."""
    dest = out / "minilm"
    if (dest / "gpu_finetune_check.json").is_file():
        return
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(REPO / "scripts/gpu_finetune_check.py"), "run", "--out", str(dest)],
                   check=True)


# ----------------------------------------------------------------------------------- projection
def part_project(args, out: Path) -> dict:
    seq_per_s = args.seq_per_s
    source = "--seq-per-s"
    if seq_per_s is None and args.e2e_json:
        rec = json.loads(Path(args.e2e_json).read_text())
        best = max((r for r in rec["results"] if r["contender"].startswith("fb")), key=lambda r: r["seq_per_s"])
        seq_per_s, source = best["seq_per_s"], f"{args.e2e_json} ({best['contender']}, {rec['card']})"
    if seq_per_s is None:
        raise SystemExit("project needs --seq-per-s or --e2e-json (a benchmarks/e2e_train_step.py result)")
    proj = {"budget_sequences": BUDGET_SEQUENCES, "seq_per_s_one_card": seq_per_s, "source": source,
            "formula": "hours = budget_sequences / (seq_per_s_one_card * cards * efficiency) / 3600"}
    for cards, eff in ((1, 1.0), (8, args.efficiency)):
        proj[f"hours_{cards}_cards"] = BUDGET_SEQUENCES / (seq_per_s * cards * eff) / 3600
    proj["efficiency_8_cards"] = args.efficiency
    (out / "projection.json").write_text(json.dumps(proj, indent=2))
    print(json.dumps(proj, indent=2))
    return proj


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="pretrain,finetune,minilm,project")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/time_to_quality"))
    p.add_argument("--data", default="runs/data/enwiki-128", help="a `fastbert prepare` folder (MLM, seq 128)")
    p.add_argument("--preset", default="small")
    p.add_argument("--prenorm", action="store_true")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--ways", type=lambda s: s.split(","), default=list(WAYS[:4]),
                   help=f"comma-separated, of {','.join(WAYS)}")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--glue", default=str(REPO.parent / "shared/data/glue"))
    p.add_argument("--ft-seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--ft-args", type=lambda s: s.split(), default=[], help="extra `fastbert finetune` arguments")
    p.add_argument("--seq-per-s", type=float, default=None)
    p.add_argument("--e2e-json", default=None)
    p.add_argument("--efficiency", type=float, default=0.9, help="assumed 8-card scaling efficiency")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    unknown = set(parts) - {"pretrain", "finetune", "minilm", "project"}
    if unknown:
        raise SystemExit(f"unknown part(s) {sorted(unknown)}; choose from pretrain, finetune, minilm, project")
    done = {}
    if "pretrain" in parts:
        done["pretrain"] = part_pretrain(args, out)
    if "finetune" in parts:
        done["finetune"] = part_finetune(args, out)
    if "minilm" in parts:
        part_minilm(args, out)
    if "project" in parts:
        done["project"] = part_project(args, out)
    return done


if __name__ == "__main__":
    main()
