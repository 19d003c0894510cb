"""``fastbert attention``: every layer/head attention map of one input, a PNG grid, and the
most-attended token per head (Clark et al. 2019)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fastbert.commands import add_kernels_argument


def add_parser(sub):
    p = sub.add_parser("attention", help="attention maps per layer and head, PNG grid, most-attended tokens",
                       description="Write OUT/attentions.npy (layers, heads, tokens, tokens; rows are queries), "
                                   "OUT/tokens.json, OUT/attention_grid.png and OUT/heads.json (most-attended "
                                   "token and attention to [CLS]/[SEP]/punctuation per head), and print a table.")
    p.add_argument("--model", required=True, help="HF BERT checkpoint directory (config.json, weights, vocab.txt)")
    p.add_argument("--text", required=True, help="the input text")
    p.add_argument("--pair", default=None, help="optional second segment (sentence pair)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--no-png", action="store_true", help="skip the PNG grid")
    add_kernels_argument(p)
    p.add_argument("--device", default=None)


def run(args) -> int:
    import numpy as np

    from fastbert.analysis.attention import attention_maps, head_statistics, plot_grid, summarize
    from fastbert.analysis.loading import load_encoder
    from fastbert.errors import UsageError
    from fastbert.io import atomic_path, atomic_write_text

    if not args.text.strip():
        raise UsageError("--text is empty")
    if args.max_seq_len < 3:
        raise UsageError("--max-seq-len must be >= 3")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")
    model, tokenizer, _ = load_encoder(args.model, args.kernels, args.device)
    if args.max_seq_len > model.config.max_position_embeddings:
        raise UsageError(f"--max-seq-len {args.max_seq_len} exceeds the model's max_position_embeddings "
                         f"{model.config.max_position_embeddings}")
    tokens, maps = attention_maps(model, tokenizer, args.text, args.pair, args.max_seq_len)
    stats = head_statistics(maps, tokens)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "attentions.npy") as tmp:
        with open(tmp, "wb") as f:
            np.save(f, maps.astype(np.float32))
    atomic_write_text(out / "tokens.json", json.dumps(tokens, ensure_ascii=False) + "\n")
    atomic_write_text(out / "heads.json", json.dumps({"tokens": tokens, "summary": summarize(stats), "heads": stats},
                                                     ensure_ascii=False, indent=1) + "\n")
    if not args.no_png:
        with atomic_path(out / "attention_grid.png") as tmp:
            plot_grid(maps, tokens, tmp)
    print(f"{len(tokens)} tokens, {maps.shape[0]} layers x {maps.shape[1]} heads -> {out}", file=sys.stderr)
    print("layer head  most-attended        weight  [CLS]  [SEP]  punct  entropy")
    for s in stats:
        print(f"{s['layer']:5d} {s['head']:4d}  {s['most_attended'][:14]:<14} @{s['position']:<4d} {s['weight']:6.3f} "
              f"{s['to_cls']:6.3f} {s['to_sep']:6.3f} {s['to_punct']:6.3f} {s['entropy']:8.3f}")
    return 0
