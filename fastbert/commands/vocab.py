"""``fastbert vocab``: train a BERT WordPiece vocabulary (vocab.txt) on text files."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

EPILOG = """\
corpus: plain text (.txt), xz (.xz) or gzip (.gz) files, or directories of them; WikiExtractor
<doc ...> / </doc> lines are skipped. Words are split as the BERT basic tokenizer does
(lowercase + accent strip unless --cased; CJK characters and punctuation stand alone).

layout (as BERT's): [PAD]=0, [unused0..98], [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103,
[unused99..], then the characters, then the merged pieces in merge order.

example:
  fastbert vocab --corpus ../shared/data/pretrain/enwiki_wikiextractor --vocab-size 30522 \\
      --score gain --out runs/vocab/
"""


def add_parser(sub):
    from fastbert.tokenization.vocab_trainer import BERT_NUM_UNUSED, SCORES

    p = sub.add_parser("vocab", help="train a WordPiece vocabulary (vocab.txt) on text files",
                       description="Train a BERT WordPiece vocabulary: count words (multithreaded C++), start from "
                                   "characters and repeatedly merge the pair with the highest score.",
                       epilog=EPILOG, formatter_class=_formatter())
    p.add_argument("--corpus", nargs="+", required=True, metavar="FILE",
                   help="text files (.txt, .xz, .gz) or directories of them")
    p.add_argument("--out", required=True,
                   help="vocab.txt to write; a directory (existing, or ending in /) gets vocab.txt and "
                        "tokenizer_config.json")
    p.add_argument("--vocab-size", type=int, default=30522, help="entries in all, specials included (default 30522)")
    p.add_argument("--cased", action="store_true", help="keep case and accents (default: lowercase + strip accents)")
    p.add_argument("--min-frequency", type=int, default=2, help="never merge pairs seen fewer times (default 2)")
    p.add_argument("--score", choices=SCORES, default="ratio",
                   help="ratio: count(ab)/(count(a)count(b)) (default); gain: that ratio weighted by frequency, "
                        "the unigram log-likelihood gain, which gives fewer tokens per word")
    p.add_argument("--limit-alphabet", type=int, default=1000,
                   help="keep the N most frequent characters (default 1000; 0 = all)")
    p.add_argument("--num-unused", type=int, default=BERT_NUM_UNUSED,
                   help=f"[unusedN] slots (default {BERT_NUM_UNUSED}, as BERT)")
    p.add_argument("--threads", type=int, default=None, help="counting threads (default: every core)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    from fastbert.errors import UsageError
    from fastbert.io import atomic_write_text
    from fastbert.tokenization.vocab_trainer import count_words, expand_corpus, save_vocab, train_from_counts

    if args.vocab_size < 1:
        raise UsageError(f"--vocab-size must be positive, got {args.vocab_size}")
    if args.min_frequency < 1:
        raise UsageError(f"--min-frequency must be >= 1, got {args.min_frequency}")
    if args.limit_alphabet < 0 or args.num_unused < 0:
        raise UsageError("--limit-alphabet and --num-unused must be >= 0")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    try:
        files = expand_corpus(args.corpus)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    out = Path(args.out)
    as_dir = out.is_dir() or str(args.out).endswith(("/", "\\"))
    if not as_dir and out.parent.exists() and not out.parent.is_dir():
        raise UsageError(f"--out {out}: {out.parent} is not a directory")

    lowercase = not args.cased
    start = time.perf_counter()
    counts = count_words(files, lowercase=lowercase, num_threads=args.threads, progress=not args.quiet)
    result = train_from_counts(counts, args.vocab_size, args.min_frequency, args.limit_alphabet or None,
                               args.num_unused, score=args.score, progress=not args.quiet)
    path = save_vocab(result.vocab, out / "vocab.txt" if as_dir else out)
    if as_dir:
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": lowercase, "strip_accents": None,
                  "tokenize_chinese_chars": True}
        atomic_write_text(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    print(f"wrote {len(result.vocab)} tokens to {path} ({len(result.alphabet)} characters, "
          f"{len(result.new_tokens)} merged pieces; {len(counts):,} distinct words, "
          f"{result.words_skipped:,} left out; {time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0


def _formatter():
    import argparse
    return argparse.RawDescriptionHelpFormatter
