"""``fastbert embed``: mean-pooled sentence embeddings of every line of a corpus, then top-k search."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fastbert.commands import add_kernels_argument


def add_parser(sub):
    p = sub.add_parser("embed", help="sentence embeddings for every line of a corpus + top-k semantic search",
                       description="Embed every line of FILE(s) with a BERT checkpoint (Sentence-BERT mean pooling) "
                                   "and print the top-k nearest lines for each query.")
    p.add_argument("--model", required=True, help="HF BERT checkpoint directory (config.json, weights, vocab.txt)")
    p.add_argument("--corpus", required=True, nargs="+", help="text file(s): .txt, .xz or .gz, one passage per line")
    p.add_argument("--query", action="append", default=[], help="query text (repeatable)")
    p.add_argument("--top-k", type=int, default=5, help="neighbours per query (default 5)")
    p.add_argument("--max-lines", type=int, default=None, help="embed at most this many lines")
    p.add_argument("--max-length", type=int, default=256, help="token limit per line (default 256)")
    p.add_argument("--batch-size", type=int, default=64)
    add_kernels_argument(p)
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--save", default=None, help="write the embeddings to this .npy file")
    p.add_argument("--json", action="store_true", help="print results as JSON")


def run(args) -> int:
    import numpy as np
    import torch

    from fastbert import BertModel
    from fastbert.errors import UsageError, not_a_checkpoint_hint
    from fastbert.io import atomic_path
    from fastbert.ops import resolve_kernels
    from fastbert.sentence_embeddings import encode_sentences, read_lines, top_k
    from fastbert.tokenization import load_tokenizer

    if args.top_k < 1:
        raise UsageError("--top-k must be >= 1")
    model_dir = Path(args.model)
    if not (model_dir / "vocab.txt").is_file():
        raise UsageError(f"{model_dir} has no vocab.txt: pass an HF checkpoint directory with its tokenizer files"
                         + not_a_checkpoint_hint(model_dir))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kernels = resolve_kernels(args.kernels, device)
    lines = []
    for path in args.corpus:
        lines += read_lines(path, None if args.max_lines is None else args.max_lines - len(lines))
        if args.max_lines is not None and len(lines) >= args.max_lines:
            break
    if not lines:
        raise UsageError(f"no text lines found in {', '.join(args.corpus)}")
    tokenizer = load_tokenizer(model_dir)
    model = BertModel.from_pretrained(model_dir, kernels=kernels).to(device)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    print(f"embedding {len(lines):,} lines with {model_dir.name} ({kernels} kernels, {device})", file=sys.stderr)
    corpus = encode_sentences(model, tokenizer, lines, batch_size=args.batch_size, max_length=args.max_length,
                              progress=True, device=device)
    if args.save:
        with atomic_path(args.save) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, corpus.numpy())
    results = []
    if args.query:
        queries = encode_sentences(model, tokenizer, args.query, max_length=args.max_length, device=device)
        scores, indices = top_k(queries, corpus, args.top_k)
        for q, s_row, i_row in zip(args.query, scores, indices):
            results.append({"query": q, "hits": [{"score": float(s), "line": int(i), "text": lines[i]}
                                                 for s, i in zip(s_row, i_row)]})
    if args.json:
        print(json.dumps(results, ensure_ascii=False, indent=2))
    else:
        for r in results:
            print(f"\nquery: {r['query']}")
            for rank, h in enumerate(r["hits"], 1):
                text = h["text"] if len(h["text"]) <= 160 else h["text"][:157] + "..."
                print(f"  {rank}. {h['score']:.3f}  [line {h['line']}] {text}")
    return 0
