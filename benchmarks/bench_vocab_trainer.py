"""Benchmark: fastbert's WordPiece vocabulary trainer vs HF tokenizers' WordPieceTrainer.

On the English Wikipedia sample (WikiExtractor output, 32 xz files, ~33 MB of text): trains an
uncased vocabulary on the first files with each trainer and measures
  * training time (reading + decompressing + counting + merging, wall clock, same thread count),
    for both of fastbert's scores ("ratio" and "gain", see fastbert/tokenization/vocab_trainer.py);
  * tokens per word on the held-out files with each vocabulary (words = BERT basic-tokenizer
    words), and the share of [UNK] tokens.
Both vocabularies hold the same number of real tokens: fastbert's also carries BERT's 999
special / [unusedN] entries, HF's only its 5 special tokens.

    python benchmarks/bench_vocab_trainer.py [--train-files 28] [--vocab-size 30522] [--threads N]
"""
from __future__ import annotations

import argparse
import lzma
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "pretrain" / "enwiki_wikiextractor"
HF_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def read_lines(files: list[Path]) -> list[str]:
    """Text lines without WikiExtractor's <doc ...> / </doc> markup."""
    lines = []
    for f in files:
        with lzma.open(f, "rt", encoding="utf-8") as text:
            for line in text:
                if line.startswith("<doc ") or line.startswith("</doc>"):
                    continue
                lines.append(line)
    return lines


def count_fastbert(files, threads):
    from fastbert.tokenization.vocab_trainer import count_words
    t0 = time.perf_counter()
    counts = count_words(files, lowercase=True, num_threads=threads, progress=False)
    return counts, time.perf_counter() - t0


def train_fastbert(counts, count_s, vocab_size, min_frequency, limit_alphabet, score):
    from fastbert.tokenization.vocab_trainer import train_from_counts
    t0 = time.perf_counter()
    result = train_from_counts(counts, vocab_size, min_frequency, limit_alphabet, score=score, progress=False)
    merge_s = time.perf_counter() - t0
    return result.vocab, {"count_s": count_s, "merge_s": merge_s, "total_s": count_s + merge_s,
                          "merges": len(result.merges)}


def train_hf(files, vocab_size, min_frequency, limit_alphabet):
    from tokenizers import BertWordPieceTokenizer
    t0 = time.perf_counter()
    lines = read_lines(files)  # HF trains from Python strings: reading is part of its cost
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=min_frequency, limit_alphabet=limit_alphabet,
                            special_tokens=HF_SPECIALS, show_progress=False)
    t1 = time.perf_counter()
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get), {"total_s": t1 - t0}


def evaluate(vocab: list[str], lines: list[str]) -> dict:
    """Tokens per word and [UNK] share on ``lines`` (HF's Rust WordPiece: same ids as ours, faster)."""
    from tokenizers import BertWordPieceTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vocab.txt"
        path.write_text("".join(t + "\n" for t in vocab), encoding="utf-8")
        tok = BertWordPieceTokenizer(str(path), lowercase=True)
    words = tokens = unks = 0
    unk_id = tok.token_to_id("[UNK]")
    pre = tok.pre_tokenizer
    normalizer = tok.normalizer
    for enc, line in zip(tok.encode_batch(lines, add_special_tokens=False), lines):
        words += len(pre.pre_tokenize_str(normalizer.normalize_str(line)))
        tokens += len(enc.ids)
        unks += enc.ids.count(unk_id)
    return {"tokens_per_word": tokens / max(words, 1), "unk_pct": 100.0 * unks / max(tokens, 1),
            "words": words, "tokens": tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder of wiki_NN.xz files")
    ap.add_argument("--train-files", type=int, default=28, help="files to train on; the rest are held out")
    ap.add_argument("--vocab-size", type=int, default=30522, help="fastbert vocab size (BERT layout)")
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--limit-alphabet", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both trainers")
    args = ap.parse_args(argv)

    files = sorted(args.data.glob("*.xz"))
    if len(files) <= args.train_files:
        print(f"need more than {args.train_files} files in {args.data}, found {len(files)}", file=sys.stderr)
        return 1
    train, held_out = files[:args.train_files], files[args.train_files:]
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # HF tokenizers' thread pool (read at first use)
    from fastbert.tokenization.vocab_trainer import special_layout
    n_reserved = len(special_layout())
    hf_size = args.vocab_size - n_reserved + len(HF_SPECIALS)  # same number of real tokens

    print(f"train: {len(train)} files ({sum(f.stat().st_size for f in train) / 1e6:.1f} MB xz), held out: "
          f"{len(held_out)} files; {args.threads} threads; cpu: {os.cpu_count()} cores")
    counts, count_s = count_fastbert(train, args.threads)
    rows = []
    for score in ("ratio", "gain"):
        vocab, t = train_fastbert(counts, count_s, args.vocab_size, args.min_frequency, args.limit_alphabet, score)
        rows.append((f"fastbert score={score}", vocab, t))
    theirs, theirs_t = train_hf(train, hf_size, args.min_frequency, args.limit_alphabet)
    rows.append(("HF WordPieceTrainer", theirs, theirs_t))
    lines = read_lines(held_out)

    n_real = lambda v: sum(1 for t in v if not (t.startswith("[") and t.endswith("]") and len(t) > 2))  # noqa: E731
    header = (f"{'trainer':<22} {'vocab':>6} {'real':>6} {'count s':>8} {'merge s':>8} {'total s':>8} "
              f"{'tokens/word':>12} {'[UNK] %':>8}")
    print(f"distinct words: {len(counts):,}\n\n{header}\n{'-' * len(header)}")
    for name, vocab, t in rows:
        ev = evaluate(vocab, lines)
        print(f"{name:<22} {len(vocab):>6} {n_real(vocab):>6} {t.get('count_s', float('nan')):>8.2f} "
              f"{t.get('merge_s', float('nan')):>8.2f} {t['total_s']:>8.2f} {ev['tokens_per_word']:>12.4f} "
              f"{ev['unk_pct']:>8.3f}")
    print(f"\nheld-out: {ev['words']:,} words. HF's total includes reading the files in Python; its trainer is "
          f"BPE-style (merges by pair frequency) with the ## prefix.")
    for name, vocab, t in rows[:2]:
        print(f"{name}: {len(set(vocab) & set(theirs)):,} tokens shared with HF's; "
              f"training {theirs_t['total_s'] / t['total_s']:.2f}x HF's speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
