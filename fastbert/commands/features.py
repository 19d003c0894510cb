"""``fastbert features``: hidden-state features of chosen layers for every line of a file (.npy)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fastbert.commands import add_kernels_argument


def add_parser(sub):
    p = sub.add_parser("features", help="extract hidden-state features (any layer, sum/concat of the last 4)",
                       description="Feature-based BERT: hidden states of the chosen layer(s) for every line of "
                                   "--input, saved as one .npy array. A line 'a ||| b' is encoded as a sentence pair; "
                                   "a .tsv file (GLUE's layout recognised, or --column) is read by column, never "
                                   "embedding its header, ids or labels. "
                                   "--pool none gives (lines, tokens, dim) zero-padded, with the tokens of each line "
                                   "in OUT.tokens.json; mean / cls give (lines, dim).")
    p.add_argument("--model", required=True, help="HF BERT checkpoint directory (config.json, weights, vocab.txt)")
    p.add_argument("--input", required=True,
                   help="text file, one input per line (.txt, .xz, .gz), or a .tsv file read by column")
    p.add_argument("--column", default=None, metavar="NAME",
                   help="tab-separated input: the text column, a header name or a 0-based number (no header); "
                        "default: GLUE's text column(s) for a .tsv file")
    p.add_argument("--pair-column", default=None, metavar="NAME",
                   help="with --column: the second text of a sentence pair")
    p.add_argument("--layers", default="last",
                   help="last | second-to-last | sum-last-4 | concat-last-4 | N (0 = embeddings, 1..L, "
                        "negative from the end); default last")
    p.add_argument("--out", required=True, help="output .npy file")
    p.add_argument("--pool", choices=("none", "mean", "cls"), default="none",
                   help="none: per token; mean: over real tokens; cls: the [CLS] vector (default none)")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    add_kernels_argument(p)
    p.add_argument("--device", default=None)


def run(args) -> int:
    import numpy as np

    from fastbert.analysis.features import extract_features, parse_layers
    from fastbert.analysis.loading import load_encoder, read_inputs
    from fastbert.errors import UsageError
    from fastbert.io import atomic_path, atomic_write_text

    out = Path(args.out)
    if out.suffix != ".npy":
        raise UsageError(f"--out {out} must end in .npy")
    if args.max_seq_len < 2 or args.batch_size < 1:
        raise UsageError("--max-seq-len must be >= 2 and --batch-size >= 1")
    texts, pairs = read_inputs(args.input, column=args.column, pair_column=args.pair_column)
    model, tokenizer, _ = load_encoder(args.model, args.kernels, args.device)
    try:
        parse_layers(args.layers, model.config.num_hidden_layers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.max_seq_len > model.config.max_position_embeddings:
        raise UsageError(f"--max-seq-len {args.max_seq_len} exceeds the model's max_position_embeddings "
                         f"{model.config.max_position_embeddings}")
    feats, tokens = extract_features(model, tokenizer, texts, pairs, args.layers, args.pool, args.max_seq_len,
                                     args.batch_size, progress=True)
    with atomic_path(out) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, feats)
    if args.pool == "none":
        atomic_write_text(out.with_suffix(".tokens.json"), json.dumps(tokens, ensure_ascii=False) + "\n")
    print(f"wrote {out} {tuple(feats.shape)} (layers={args.layers}, pool={args.pool})", file=sys.stderr)
    return 0
