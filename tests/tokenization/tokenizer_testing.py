"""Set-up shared by test_reference_tokenizer.py and test_wordpiece.py: the tokenizer configurations,
HF ``BertTokenizerFast`` with the same options, and the multilingual test corpus.

HF is loaded with ``BertTokenizerFast.from_pretrained(dir, ...)``: in transformers 5,
``BertTokenizerFast(vocab_file=...)`` silently ignores the file and builds an empty vocabulary.
"""
from __future__ import annotations

import lzma
import zipfile

# (vocab directory, tokenizer options). The first four are the vocabularies as published; the
# others exercise the remaining option combinations.
CONFIGS = [
    ("bert-base-uncased", dict(lowercase=True)),
    ("bert-base-cased", dict(lowercase=False)),
    ("bert-base-multilingual-cased", dict(lowercase=False)),
    ("bert-base-chinese", dict(lowercase=False)),
    ("bert-base-uncased", dict(lowercase=True, strip_accents=False)),
    ("bert-base-multilingual-cased", dict(lowercase=False, strip_accents=True, tokenize_chinese_chars=False)),
]
CONFIG_IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in opts.items())}" for name, opts in CONFIGS]


def hf_options(opts: dict) -> dict:
    """Our tokenizer options as HF ``BertTokenizerFast`` keyword arguments."""
    out = {"do_lower_case": opts["lowercase"]}
    for key in ("strip_accents", "tokenize_chinese_chars"):
        if key in opts:
            out[key] = opts[key]
    return out


def load_hf(directory, opts):
    """HF ``BertTokenizerFast`` of a vocabulary directory, with our options ``opts``."""
    from transformers import BertTokenizerFast
    return BertTokenizerFast.from_pretrained(str(directory), **hf_options(opts))


def tokenizer_and_hf(cls, data_dir, index: int):
    """(``cls`` tokenizer, HF BertTokenizerFast) with the vocabulary and options of ``CONFIGS[index]``."""
    name, opts = CONFIGS[index]
    directory = data_dir / "vocab" / name
    ours = cls(directory / "vocab.txt", **opts)
    hf = load_hf(directory, opts)
    assert len(hf) == len(ours)  # guards against HF silently loading another vocabulary
    return ours, hf


def read_corpus(data_dir, udhr_lines_per_file: int) -> tuple[list[str], int]:
    """Real lines in many languages: 1500 non-empty lines each of two English Wikipedia files, UD
    Chinese and Japanese test text, and the first ``udhr_lines_per_file`` lines of every UDHR
    translation. Returns (lines, number of UDHR translations read)."""
    lines: list[str] = []
    for name in ("wiki_00.xz", "wiki_17.xz"):
        with lzma.open(data_dir / "pretrain" / "enwiki_wikiextractor" / name, "rt", encoding="utf-8") as f:
            lines += [line for line in f.read().split("\n") if line.strip()][:1500]
    for name in ("ja_gsd_test.txt", "zh_simplified_gsd_test.txt"):
        lines += (data_dir / "multilingual" / "ud_gsd" / "text" / name).read_text(encoding="utf-8").split("\n")
    with zipfile.ZipFile(data_dir / "multilingual" / "udhr2.zip") as z:
        names = sorted(n for n in z.namelist() if n.endswith(".txt"))
        for name in names:
            lines += z.read(name).decode("utf-8").split("\n")[:udhr_lines_per_file]
    return lines, len(names)


def wiki_lines(data_dir, count: int) -> list[str]:
    """The first ``count`` text lines (non-empty, no WikiExtractor ``<doc>`` markers) of the English
    Wikipedia sample, reading ``wiki_00.xz``, ``wiki_01.xz``, ... in order until there are enough.
    Raises ValueError when the whole sample holds fewer, so a test never compares less than it says."""
    files = sorted((data_dir / "pretrain" / "enwiki_wikiextractor").glob("wiki_*.xz"))
    out: list[str] = []
    for path in files:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            out += [line for line in f.read().split("\n") if line.strip() and not line.startswith(("<doc", "</doc"))]
        if len(out) >= count:
            return out[:count]
    raise ValueError(f"the Wikipedia sample ({len(files)} files) holds {len(out)} text lines, fewer than {count}")


def first_mismatch(lines, ours, theirs):
    """A message naming the first line where ``ours`` and ``theirs`` differ, or None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"line {i}: {lines[i]!r}\n ours: {a}\n HF:   {b}"
    return None
