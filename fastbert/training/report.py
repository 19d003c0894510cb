"""The end of a pretraining run, for a person: the held-out MLM accuracy beside the range measured for
the same config and step count, a few fill-mask predictions of the trained model on sentences it never
saw, and a loss curve (``OUTPUT_DIR/loss_curve.png``) drawn from ``metrics.jsonl``.

``REFERENCE`` holds held-out MLM accuracy ranges measured with the shipped configs (``configs/tiny.json``:
the demo) at a few step counts, over seeds; a run of another preset, or beyond the last measured step,
says so instead of guessing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

# preset -> [(optimizer steps, lowest, highest held-out MLM accuracy)], configs/tiny.json (global batch 64,
# seq 128, lr 2e-3, 3-minute schedule), CPU. PROVISIONAL ranges around the few points measured so far: the
# issue-16 demo run (held-out 0.0607 after ~330 steps) and seed 0's training-window accuracy (0.049 / 0.052 /
# 0.056 at steps 40 / 80 / 120, tests/reliability/record_guard_traces.py); to be replaced by held-out
# evaluations over seeds.
REFERENCE: dict[str, list[tuple[int, float, float]]] = {
    "tiny": [(80, 0.04, 0.06), (160, 0.05, 0.07), (240, 0.05, 0.08), (320, 0.05, 0.09)],
}

SENTENCES = [                    # written for this report: in no corpus the demo trains on
    "the capital of france is [MASK].",
    "she opened the door and walked into the [MASK].",
    "the war ended in [MASK] after four years of fighting.",
    "he played the [MASK] in a rock band for ten years.",
]


def final_report(cfg, summary: dict) -> list[str]:
    """Lines to print after ``final: ...`` (rank 0). Writes the loss curve; never raises for a plot."""
    lines = []
    ev = summary.get("eval") or {}
    if "mlm_acc" in ev:
        lines.append(expected_line(cfg.model.preset, int(summary["steps"]), float(ev["mlm_acc"]),
                                   {"time_budget": cfg.train.time_budget}))
    if summary.get("hf_dir"):
        try:
            lines += fill_mask_lines(Path(summary["hf_dir"]))
        except Exception as e:      # a report line must not fail a finished run
            lines.append(f"(no fill-mask examples: {e.__class__.__name__}: {e})")
    out_dir = Path(cfg.output_dir)
    try:
        png = write_loss_curve(out_dir / "metrics.jsonl", out_dir / "loss_curve.png")
        if png:
            lines.append(f"loss curve: {png}")
    except Exception as e:
        lines.append(f"(no loss curve: {e.__class__.__name__}: {e})")
    return lines


def expected_range(preset: str, steps: int) -> Optional[tuple[int, float, float]]:
    """The measured (step, lo, hi) nearest below ``steps`` (None: no reference for this preset/length)."""
    table = REFERENCE.get(preset, [])
    below = [row for row in table if row[0] <= steps * 1.1]
    return below[-1] if below else None


def expected_line(preset: str, steps: int, acc: float, train: dict) -> str:
    ref = expected_range(preset, steps)
    longer = ("train.time_budget=10m" if train.get("time_budget") is not None else f"train.max_steps={2 * steps}")
    if ref is None:
        return (f"expected: no reference measured for preset {preset!r} at {steps} steps; compare runs of the same "
                f"config with each other (metrics.jsonl). Train longer with {longer}.")
    ref_steps, lo, hi = ref
    verdict = "within" if lo <= acc <= hi else ("above" if acc > hi else "BELOW")
    beyond = REFERENCE[preset][-1][0]
    note = "" if steps <= beyond * 1.1 else f" (measured up to {beyond} steps; more steps should do better)"
    return (f"expected: MLM accuracy {lo:.2f}-{hi:.2f} after ~{ref_steps} steps of the {preset} demo{note}; this run: "
            f"{acc:.4f}, {verdict} the range. At this budget the model has learned word frequencies and little "
            f"context, so it mostly predicts common words; train longer ({longer}, or a GPU) for real predictions.")


def fill_mask_lines(hf_dir: Path, top: int = 3) -> list[str]:
    """Top predictions for each [MASK] in SENTENCES, from the exported model."""
    import torch

    from fastbert import BertForMaskedLM
    from fastbert.tokenization import load_tokenizer
    tok = load_tokenizer(hf_dir)
    model = BertForMaskedLM.from_pretrained(hf_dir, kernels="torch").eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                       token_type_ids=enc["token_type_ids"]).logits
    probs = logits.float().softmax(-1)
    vocab = {i: t for t, i in tok.vocab.items()} if hasattr(tok, "vocab") else None
    lines = [f"fill-mask on sentences it never saw (top {top}):"]
    for row, text in enumerate(SENTENCES):
        pos = (enc["input_ids"][row] == tok.mask_token_id).nonzero().flatten()
        if not len(pos):
            continue
        p, ids = probs[row, pos[0]].topk(top)
        words = [vocab[int(i)] if vocab else tok.convert_ids_to_tokens(int(i)) for i in ids]
        guesses = ", ".join(f"{w} {q:.2f}" for w, q in zip(words, p.tolist()))
        lines.append(f"  {text}  ->  {guesses}")
    return lines


def read_curve(metrics: Path) -> tuple[list, list, list]:
    """(train points, eval points, resume steps) from metrics.jsonl: the last run's records win where
    runs overlap (a resumed run continues the curve)."""
    train, evals, resumes = {}, {}, []
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue                               # a line cut short by a kill
        if r.get("event") == "train" and "loss" in r:
            train[r["step"]] = r["loss"]
        elif r.get("event") == "eval" and "mlm_loss" in r:
            evals[r["step"]] = r["mlm_loss"]
        elif r.get("event") == "resume":
            resumes.append(r["step"])
    return sorted(train.items()), sorted(evals.items()), resumes


def write_loss_curve(metrics: Path, png: Path) -> Optional[Path]:
    if not metrics.is_file():
        return None
    train, evals, resumes = read_curve(metrics)
    if not train and not evals:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastbert.io import atomic_path
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss (log window)")
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out MLM loss")
    for i, step in enumerate(resumes):
        ax.axvline(step, color="grey", linestyle=":", label="resumed" if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"{metrics.parent.name}: pretraining loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return png
