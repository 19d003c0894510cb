"""``fastbert cluster``: k-means over mean-pooled sentence embeddings of the lines of a file."""
from __future__ import annotations

import json
import sys

from fastbert.commands import add_kernels_argument


def add_parser(sub):
    p = sub.add_parser("cluster", help="k-means clustering of sentence embeddings",
                       description="Embed every line of --input (Sentence-BERT mean pooling, L2-normalized) and "
                                   "group the lines into --k clusters with k-means (k-means++, best of --n-init). "
                                   "Prints each cluster's lines; --out writes them as JSON.")
    p.add_argument("--model", required=True, help="HF BERT checkpoint directory (e.g. the output of sbert-train)")
    p.add_argument("--input", required=True,
                   help="text file, one sentence per line (.txt, .xz, .gz), or a .tsv file read by column")
    p.add_argument("--column", default=None, metavar="NAME",
                   help="tab-separated input: the text column, a header name or a 0-based number (no header); "
                        "default: GLUE's first text column for a .tsv file")
    p.add_argument("--k", type=int, required=True, help="number of clusters")
    p.add_argument("--out", default=None, help="write {clusters: [[line, ...], ...], labels: [...]} to this JSON file")
    p.add_argument("--n-init", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    add_kernels_argument(p)
    p.add_argument("--device", default=None)


def run(args) -> int:
    from fastbert.analysis.clustering import kmeans
    from fastbert.analysis.loading import load_encoder, read_inputs
    from fastbert.errors import UsageError
    from fastbert.io import atomic_write_text
    from fastbert.sentence_embeddings import encode_sentences

    texts, _ = read_inputs(args.input, pair_separator="\0", column=args.column)  # every line is one sentence
    if not 1 <= args.k <= len(texts):
        raise UsageError(f"--k {args.k} must be between 1 and the number of lines ({len(texts)})")
    if args.n_init < 1:
        raise UsageError("--n-init must be >= 1")
    model, tokenizer, device = load_encoder(args.model, args.kernels, args.device)
    emb = encode_sentences(model, tokenizer, texts, batch_size=args.batch_size, max_length=args.max_length,
                           normalize=True, progress=True, device=device).numpy()
    result = kmeans(emb, args.k, n_init=args.n_init, seed=args.seed)
    clusters = [[texts[i] for i in range(len(texts)) if result.labels[i] == c] for c in range(args.k)]
    for c, members in enumerate(clusters):
        print(f"\ncluster {c + 1} ({len(members)} lines)")
        for line in members[:10]:
            print(f"  {line if len(line) <= 120 else line[:117] + '...'}")
        if len(members) > 10:
            print(f"  ... {len(members) - 10} more")
    if args.out:
        atomic_write_text(args.out, json.dumps({"k": args.k, "inertia": result.inertia,
                                                "labels": result.labels.tolist(), "clusters": clusters},
                                               ensure_ascii=False, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0
