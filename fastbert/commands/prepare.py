"""``fastbert prepare``: corpus files -> tokenized, packed, sharded pretraining data (fastbert/data/prepare.py)."""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser(
        "prepare", help="tokenize and pack a text corpus into pretraining shards",
        description="Read .txt/.xz/.gz/.bz2 files or WikiExtractor output, split documents into sentences, "
                    "tokenize, pack BERT pretraining sequences (doc-aware; optional NSP pairs) and write .npy "
                    "shards + index.json, holding out whole documents for validation. Rerunning skips the "
                    "shards already finished.")
    p.add_argument("--corpus", required=True, nargs="+", metavar="FILE_OR_DIR",
                   help="input files or folders (read recursively)")
    p.add_argument("--vocab", required=True, help="vocab.txt (or a folder holding one)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seq-len", type=int, default=128, help="maximum sequence length incl. [CLS]/[SEP] (default 128)")
    p.add_argument("--nsp", action="store_true", help="make [CLS] A [SEP] B [SEP] pairs with NSP labels "
                   "(50%% random next); default: one segment per sequence (MLM only)")
    p.add_argument("--workers", type=int, default=1, help="parallel processes, one input file each (default 1)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="fraction of documents held out for validation (default 0.01)")
    p.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="probability of a shorter random target length (default 0.1, as BERT)")
    p.add_argument("--seed", type=int, default=12345)
    case = p.add_mutually_exclusive_group()
    case.add_argument("--lowercase", dest="lowercase", action="store_true", default=None,
                      help="lowercase the text (uncased vocabularies); default: from tokenizer_config.json or "
                           "guessed from the vocabulary")
    case.add_argument("--cased", dest="lowercase", action="store_false", help="keep case (cased vocabularies)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    import json

    from fastbert.data.prepare import PrepareConfig, prepare

    cfg = PrepareConfig(corpus=args.corpus, vocab=args.vocab, out=args.out, seq_len=args.seq_len, nsp=args.nsp,
                        workers=args.workers, val_fraction=args.val_fraction, short_seq_prob=args.short_seq_prob,
                        seed=args.seed, lowercase=args.lowercase)
    index = prepare(cfg, progress=not args.quiet)
    summary = {split: {k: v for k, v in s.items() if k != "shards"} for split, s in index["splits"].items()}
    print(json.dumps({"out": args.out, "seq_len": index["seq_len"], "nsp": index["nsp"],
                      "lowercase": index["lowercase"], **summary}, indent=1))
    return 0
