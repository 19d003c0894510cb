"""The C++ ``WordPieceTokenizer``: exact ids AND offsets vs HF ``BertTokenizerFast`` and vs the pure-Python
reference on real text in many languages for the four BERT vocabularies; every code point vs HF's
normalizer + pre-tokenizer; pairs, truncation, padding, tensors, threads; golden cases; bad input.

HF set-up and the corpus: tokenizer_testing.py.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fastbert.tokenization.reference import ReferenceTokenizer
from fastbert.tokenization.wordpiece import WordPieceTokenizer
from tokenizer_testing import CONFIG_IDS, CONFIGS, first_mismatch, load_hf, read_corpus, tokenizer_and_hf, wiki_lines

transformers = pytest.importorskip("transformers")
BertTokenizerFast = transformers.BertTokenizerFast


@pytest.fixture(scope="module")
def corpus(data_dir) -> list[str]:
    """~12k real lines: English Wikipedia, UD Chinese and Japanese, the first lines of every UDHR translation."""
    lines, n_udhr = read_corpus(data_dir, udhr_lines_per_file=20)
    assert n_udhr > 380
    assert len(lines) >= 11000
    return lines


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=CONFIG_IDS)
def pair(request, data_dir):
    """(WordPieceTokenizer, HF BertTokenizerFast) with the same vocabulary and options."""
    return tokenizer_and_hf(WordPieceTokenizer, data_dir, request.param)


@pytest.fixture(scope="module")
def uncased(data_dir):
    return WordPieceTokenizer(data_dir / "vocab" / "bert-base-uncased" / "vocab.txt")


@pytest.fixture(scope="module")
def hf_uncased(data_dir):
    return load_hf(data_dir / "vocab" / "bert-base-uncased", dict(lowercase=True))


def _hf_offsets(enc):
    return [[tuple(o) for o in row] for row in enc["offset_mapping"]]


# ----------------------------------------------------------------------------------------------
# Parity with HF and the reference on real text
# ----------------------------------------------------------------------------------------------

def test_ids_and_offsets_match_hf(pair, corpus):
    ours, hf = pair
    got = ours(corpus, return_offsets_mapping=True)
    theirs = hf(corpus, return_offsets_mapping=True)
    assert got["input_ids"] == theirs["input_ids"], first_mismatch(corpus, got["input_ids"], theirs["input_ids"])
    hf_offsets = _hf_offsets(theirs)
    assert got["offset_mapping"] == hf_offsets, first_mismatch(corpus, got["offset_mapping"], hf_offsets)
    assert got["token_type_ids"] == theirs["token_type_ids"]
    assert sum(map(len, got["input_ids"])) > 200_000  # the corpus really was tokenized
    unk = ours.unk_token_id
    assert sum(row.count(unk) for row in got["input_ids"]) > 0  # [UNK] paths were exercised


@pytest.mark.parametrize("index", range(4), ids=CONFIG_IDS[:4])
def test_ids_and_offsets_match_reference(index, data_dir, corpus):
    name, opts = CONFIGS[index]
    ours = WordPieceTokenizer(data_dir / "vocab" / name / "vocab.txt", **opts)
    ref = ReferenceTokenizer(data_dir / "vocab" / name / "vocab.txt", **opts)
    lines = corpus[::4]
    got = ours.encode_batch(lines, return_offsets=True)
    expected = ref.encode_batch(lines, return_offsets=True)
    ids = [row.tolist() for row in got["input_ids"]]
    assert ids == expected["input_ids"], first_mismatch(lines, ids, expected["input_ids"])
    offsets = [[tuple(o) for o in row.tolist()] for row in got["offsets"]]
    assert offsets == expected["offsets"], first_mismatch(lines, offsets, expected["offsets"])


def test_tokenize_and_decode_match_hf(pair, corpus):
    ours, hf = pair
    lines = corpus[::13]
    for line in lines:
        assert ours.tokenize(line) == hf.tokenize(line), line
    for line in lines[:200]:
        ids = ours.encode(line)["input_ids"]
        assert ids == hf(line)["input_ids"], line
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), line


@pytest.mark.parametrize("options", [
    dict(lowercase=True),
    dict(lowercase=False),
    dict(lowercase=True, strip_accents=False),
    dict(lowercase=False, strip_accents=True, tokenize_chinese_chars=False),
], ids=["uncased", "cased", "lower-no-strip", "strip-no-chinese"])
def test_every_code_point_matches_hf_normalizer_and_pre_tokenizer(data_dir, options):
    """Normalization + pre-tokenization (words and their original offsets) of every code point,
    assigned or not, against HF's BertNormalizer and BertPreTokenizer: the generated Unicode tables
    with their HF compatibility overrides agree with HF everywhere."""
    from tokenizers import PreTokenizedString
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    ours = WordPieceTokenizer(data_dir / "vocab" / "bert-base-uncased" / "vocab.txt", **options)
    chars = [chr(cp) for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]
    text = "".join("x" + c for c in chars)  # a letter between characters keeps most words apart
    normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=options.get("tokenize_chinese_chars", True),
                                strip_accents=options.get("strip_accents"), lowercase=options["lowercase"])
    pts = PreTokenizedString(text)
    pts.normalize(normalizer.normalize)
    BertPreTokenizer().pre_tokenize(pts)
    theirs = [(w, off) for w, off, _ in pts.get_splits(offset_referential="original", offset_type="char")]
    got = ours._core.pre_tokenize(text)
    assert len(got) == len(theirs)
    assert got == theirs, first_mismatch([text] * len(got), got, theirs)


def test_canonical_reordering_matches_hf(hf_uncased, uncased, data_dir):
    """With strip_accents, HF's NFD sorts non-starters across characters: marks HF keeps (Mc with a
    combining class) are reordered; marks unknown to HF's NFD block the reordering."""
    texts = [
        "a\U0001D16D\U0001D165b",             # ccc 226 then 216: swapped
        "a\U0001D16D\u0301\U0001D165b",       # a stripped non-starter in between: still swapped
        "a\U0001D16D\u0F71\U0001D165 x",      # U+0F71 (ccc 129, stripped)
        "a\U0001D16D\u093C\U0001D165 x",      # U+093C (ccc 7): stripped
        "\U0001D16D\U0001D165 \U0001D165\U0001D16D",
        "a\U0001D16D\u1DF6\U0001D165",        # U+1DF6: unknown to HF's NFD: a starter, blocks
    ]
    normalizer_words = [uncased._core.pre_tokenize(t) for t in texts]
    from tokenizers import PreTokenizedString
    for text, words in zip(texts, normalizer_words):
        pts = PreTokenizedString(text)
        pts.normalize(hf_uncased.backend_tokenizer.normalizer.normalize)
        hf_uncased.backend_tokenizer.pre_tokenizer.pre_tokenize(pts)
        assert [w for w, _ in words] == [w for w, _, _ in pts.get_splits()], text
    multi = WordPieceTokenizer(data_dir / "vocab" / "bert-base-multilingual-cased" / "vocab.txt",
                               lowercase=False, strip_accents=True)
    hf_multi = load_hf(data_dir / "vocab" / "bert-base-multilingual-cased", dict(lowercase=False, strip_accents=True))
    for text in texts:
        assert multi(text)["input_ids"] == hf_multi(text)["input_ids"], text


# ----------------------------------------------------------------------------------------------
# Pairs, truncation, padding, tensors, threads
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_length", [8, 19, 64])
def test_pairs_with_truncation_match_hf(pair, corpus, max_length):
    ours, hf = pair
    firsts, seconds = corpus[0:1500:3], corpus[1:1500:3]
    got = ours(firsts, seconds, max_length=max_length, truncation=True, return_offsets_mapping=True)
    theirs = hf(firsts, seconds, max_length=max_length, truncation=True, return_offsets_mapping=True)
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert got[key] == theirs[key], first_mismatch(firsts, got[key], theirs[key])
    assert got["offset_mapping"] == _hf_offsets(theirs)
    assert max(map(len, got["input_ids"])) == max_length


@pytest.mark.parametrize("strategy", ["longest_first", "only_first", "only_second"])
def test_truncation_strategies_match_hf(uncased, hf_uncased, strategy):
    """Every split of lengths (0..7, 0..7) under every max_length, including HF's errors. HF is called
    with a batch of one: a single call drops an empty text_pair ("" is falsy), a batch keeps it, as we do."""
    for n_a in range(8):
        for n_b in range(8):
            a, b = " ".join("a" * n_a), " ".join("b" * n_b)
            for max_length in range(3, n_a + n_b + 4):
                try:
                    expected = hf_uncased([a], [b], truncation=strategy, max_length=max_length)["input_ids"][0]
                except Exception:  # HF's Rust TruncationError
                    with pytest.raises(ValueError, match="cannot fit"):
                        uncased.encode(a, b, truncation=strategy, max_length=max_length)
                    continue
                got = uncased.encode(a, b, truncation=strategy, max_length=max_length)["input_ids"]
                assert got == expected, (n_a, n_b, max_length)


@pytest.mark.parametrize("padding,max_length,multiple", [
    (True, None, None), ("longest", 40, None), ("max_length", 48, None), ("longest", None, 8), ("max_length", 24, 8),
])
def test_padding_modes_match_hf(pair, corpus, padding, max_length, multiple):
    ours, hf = pair
    texts, pairs = corpus[100:140], corpus[200:240]
    for text_pairs in (None, pairs):
        kwargs = dict(padding=padding, max_length=max_length, truncation=max_length is not None,
                      pad_to_multiple_of=multiple)
        got = ours(texts, text_pairs, return_offsets_mapping=True, **kwargs)
        theirs = hf(texts, text_pairs, return_offsets_mapping=True, **kwargs)
        assert len({len(row) for row in got["input_ids"]}) == 1, "padding must give rows of one length"
        for key in ("input_ids", "token_type_ids", "attention_mask"):
            assert got[key] == theirs[key], key
        assert got["offset_mapping"] == _hf_offsets(theirs)
        arrays = ours.encode_batch(texts, text_pairs, return_offsets=True, **kwargs)
        assert arrays["input_ids"].dtype == np.int64 and arrays["input_ids"].ndim == 2
        assert arrays["input_ids"].tolist() == theirs["input_ids"]
        assert arrays["offsets"].shape == arrays["input_ids"].shape + (2,)


def test_encode_batch_arrays(uncased, hf_uncased, corpus):
    texts = corpus[:50]
    ragged = uncased.encode_batch(texts, return_offsets=True)
    assert isinstance(ragged["input_ids"], list) and len(ragged["input_ids"]) == 50
    assert all(row.dtype == np.int64 and row.ndim == 1 for row in ragged["input_ids"])
    assert [row.tolist() for row in ragged["input_ids"]] == hf_uncased(texts)["input_ids"]
    assert all((m == 1).all() for m in ragged["attention_mask"])
    assert all(o.shape == (len(r), 2) for o, r in zip(ragged["offsets"], ragged["input_ids"]))
    plain = uncased.encode_batch(texts, add_special_tokens=False)
    assert [row.tolist() for row in plain["input_ids"]] == hf_uncased(texts, add_special_tokens=False)["input_ids"]
    ids, splits = uncased.encode_flat(texts)
    assert ids.dtype == np.int32 and splits.tolist()[0] == 0 and splits[-1] == len(ids)
    assert [ids[a:b].tolist() for a, b in zip(splits[:-1], splits[1:])] == [r.tolist() for r in plain["input_ids"]]
    empty = uncased.encode_batch([], padding=True)
    assert empty["input_ids"].shape == (0, 0)


def test_return_tensors(uncased, hf_uncased, corpus):
    torch = pytest.importorskip("torch")
    ours = uncased(corpus[:16], padding=True, return_tensors="pt")
    theirs = hf_uncased(corpus[:16], padding=True, return_tensors="pt")
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert torch.equal(ours[key], theirs[key])
    pt = uncased.encode_batch(corpus[:16], padding=True, return_tensors="pt")
    assert pt["input_ids"].dtype == torch.int64 and torch.equal(pt["input_ids"], theirs["input_ids"])
    assert uncased(corpus[:4], padding=True, return_tensors="np")["input_ids"].shape[0] == 4
    with pytest.raises(ValueError, match="padding"):
        uncased(corpus[:16], return_tensors="np")
    same = uncased.encode_batch(["a b", "c d"], return_tensors="np")  # equal lengths stack without padding
    assert same["input_ids"].shape == (2, 4)


def test_threads_give_identical_results(uncased, corpus):
    texts = corpus[:3000]
    one = uncased.encode_batch(texts, num_threads=1, padding=True, return_offsets=True)
    for threads in (2, 3, None):
        many = uncased.encode_batch(texts, num_threads=threads, padding=True, return_offsets=True)
        for key in one:
            np.testing.assert_array_equal(one[key], many[key])


def test_encode_batch_releases_the_gil(uncased, corpus):
    """While one thread encodes a big batch, another thread keeps running Python code."""
    texts = corpus[:3000]
    t0 = time.perf_counter()
    uncased.encode_flat(texts, num_threads=1)
    once = time.perf_counter() - t0
    texts = texts * max(2, int(0.5 / max(once, 1e-4)) + 1)  # ~0.5 s of work on any machine
    gaps, done = [], threading.Event()

    def spin():
        last = time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    worker = threading.Thread(target=spin)
    worker.start()
    time.sleep(0.05)
    start = time.perf_counter()
    uncased.encode_flat(texts, num_threads=1)
    elapsed = time.perf_counter() - start
    done.set()
    worker.join()
    assert elapsed > 0.1, "batch too small to tell"
    assert max(gaps) < 0.5 * elapsed, (max(gaps), elapsed)


def test_concurrent_callers(uncased, corpus):
    texts = corpus[:2000]
    expected = uncased.encode_flat(texts)[0]
    results = [None] * 4

    def run(i):
        results[i] = uncased.encode_flat(texts, num_threads=2)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_array_equal(r, expected)


# ----------------------------------------------------------------------------------------------
# Golden cases
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def tiny_vocab(tmp_path):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "want", "##want", "##ed", "wa", "un", "runn", "##ing",
              ",", "low", "lowest", "##aff", "##able", "a", "##b", "##c"]
    path = tmp_path / "vocab.txt"
    path.write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    return path


def test_golden_wordpiece(tiny_vocab):
    tok = WordPieceTokenizer(tiny_vocab)
    assert tok.tokenize("unaffable") == ["un", "##aff", "##able"]
    assert tok.tokenize("UNwant\u00E9d,running") == ["un", "##want", "##ed", ",", "runn", "##ing"]
    assert tok.tokenize("unwantedX running") == ["[UNK]", "runn", "##ing"]  # unmatchable piece: one [UNK]
    assert tok.tokenize("abcbcb") == ["a", "##b", "##c", "##b", "##c", "##b"]
    assert tok.tokenize("lowest low lowe") == ["lowest", "low", "[UNK]"]
    short = WordPieceTokenizer(tiny_vocab, max_input_chars_per_word=5)
    assert short.tokenize("abcbc abcbcb") == ["a", "##b", "##c", "##b", "##c", "[UNK]"]  # over-long word
    enc = short.encode("abcbcb x", return_offsets=True)
    assert enc["offsets"] == [(0, 0), (0, 6), (7, 8), (0, 0)]
    assert tok.encode("un [MASK] [mask]")["input_ids"] == [2, 9, 4, 1, 1, 1, 3]  # special tokens in raw text


def test_golden_unicode_cases(data_dir, hf_uncased, uncased):
    cased = WordPieceTokenizer(data_dir / "vocab" / "bert-base-cased" / "vocab.txt", lowercase=False)
    hf_cased = load_hf(data_dir / "vocab" / "bert-base-cased", dict(lowercase=False))
    multi = WordPieceTokenizer(data_dir / "vocab" / "bert-base-multilingual-cased" / "vocab.txt", lowercase=False)
    hf_multi = load_hf(data_dir / "vocab" / "bert-base-multilingual-cased", dict(lowercase=False))
    cases = [
        "cafe\u0301 na\u0308ive \u00C5ngstr\u00F6m",     # combining marks
        "I\u0307stanbul \u0130stanbul \u03A3\u0391\u03A3",  # lowercase with marks, final sigma per character
        "hi \U0001F600 \U0001F468\u200D\U0001F469\u200D\U0001F467 \u2764\uFE0F!",  # emoji, ZWJ, variation selector
        "zero\u200Bwidth\u200C join\u200D\uFEFFer",     # zero-width and BOM characters are dropped
        "ctrl\x00\x07\x1b[0m\x7f chars\u0085\u2028next",  # control characters, NEL, line separator
        "\U00020000\U0002A6D6\U0002B820\U0002B920 \u4E2D\u6587",  # non-BMP CJK (and HF's Ext-E quirk)
        "\uAC00\uD7A3 \u1100\u1161",                     # Hangul: NFD to jamo when stripping accents
        "", "   ", "\t\n\r\u3000", "\x00\x01",         # empty and whitespace-only
        "a[SEP]b[CLS][PAD] [MASK]", "[UNK][UNK]",       # special tokens written in the text
        "x" * 100 + " " + "y" * 101,                     # the word length limit
    ]
    for ours, hf in ((uncased, hf_uncased), (cased, hf_cased), (multi, hf_multi)):
        for text in cases:
            got = ours(text, return_offsets_mapping=True)
            theirs = hf(text, return_offsets_mapping=True)
            assert got["input_ids"] == theirs["input_ids"], text
            assert got["offset_mapping"] == [tuple(o) for o in theirs["offset_mapping"]], text
    assert uncased.tokenize("") == [] and uncased.encode("   ")["input_ids"] == [101, 102]
    assert uncased.tokenize("hi \U0001F600") == ["hi", "[UNK]"]


# ----------------------------------------------------------------------------------------------
# API and bad input
# ----------------------------------------------------------------------------------------------

def test_vocab_api(uncased, hf_uncased):
    assert len(uncased) == uncased.vocab_size == 30522
    assert uncased.vocab["hello"] == hf_uncased.vocab["hello"]
    assert uncased.convert_tokens_to_ids(["hello", "nonexistent-token"]) == [7592, 100]
    assert uncased.convert_ids_to_tokens([101, 7592, 102], skip_special_tokens=True) == ["hello"]
    assert (uncased.cls_token_id, uncased.sep_token_id, uncased.pad_token_id, uncased.mask_token_id,
            uncased.unk_token_id) == (101, 102, 0, 103, 100)
    with pytest.raises(ValueError, match="out of range"):
        uncased.convert_ids_to_tokens([10**6])


def test_from_pretrained_and_save(tmp_path, minilm_dir, corpus):
    tok = WordPieceTokenizer.from_pretrained(minilm_dir)
    hf = BertTokenizerFast.from_pretrained(str(minilm_dir))
    assert tok.lowercase and tok.model_max_length == 512
    lines = corpus[::40]
    assert tok(lines, truncation=True)["input_ids"] == hf(lines, truncation=True)["input_ids"]
    long = " ".join(["word"] * 1000)
    assert len(tok.encode(long)["input_ids"]) == 512  # model_max_length applies with truncation=True
    tok.save_pretrained(tmp_path)
    again = WordPieceTokenizer.from_pretrained(tmp_path)
    assert again.encode_batch(lines, padding=True)["input_ids"].tolist() == \
        tok.encode_batch(lines, padding=True)["input_ids"].tolist()


def test_load_tokenizer_prefers_cpp(data_dir):
    from fastbert.tokenization import load_tokenizer
    assert isinstance(load_tokenizer(data_dir / "vocab" / "bert-base-uncased"), WordPieceTokenizer)


def test_bad_input(tmp_path, uncased):
    with pytest.raises(FileNotFoundError, match="vocab file not found"):
        WordPieceTokenizer(tmp_path / "missing.txt")
    no_unk = tmp_path / "no_unk.txt"
    no_unk.write_text("[CLS]\n[SEP]\nhello\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"no unknown token '\[UNK\]'"):
        WordPieceTokenizer(no_unk)
    no_cls = tmp_path / "no_cls.txt"
    no_cls.write_text("[UNK]\n[SEP]\n[PAD]\nhello\n", encoding="utf-8")
    tok = WordPieceTokenizer(no_cls)
    assert tok.tokenize("hello world") == ["hello", "[UNK]"]
    with pytest.raises(ValueError, match=r"no '\[CLS\]' token \(cls_token\)"):
        tok.encode("hello")
    assert tok.encode_batch(["hello"], add_special_tokens=False)["input_ids"][0].tolist() == [3]
    with pytest.raises(ValueError, match=r"lone surrogate U\+D83D at character 3"):
        uncased.tokenize("abc\ud83d")
    with pytest.raises(ValueError, match=r"texts\[1\] contains a lone surrogate U\+DC00"):
        uncased.encode_batch(["fine", "x\udc00"])
    with pytest.raises(ValueError, match=r"text_pairs\[0\] contains a lone surrogate"):
        uncased.encode_batch(["fine"], ["\udfff"])
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str"):
        uncased.encode_batch(["a", 3])
    with pytest.raises(TypeError, match="list of texts"):
        uncased.encode_batch("a single string")
    with pytest.raises(ValueError, match="differ in length"):
        uncased.encode_batch(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="too short for the 3 special tokens"):
        uncased.encode_batch(["a"], ["b"], max_length=2)
    with pytest.raises(ValueError, match="needs max_length"):
        uncased.encode_batch(["a"], padding="max_length")
    # padding="max_length" without truncation keeps longer rows whole, as HF: then one array per row
    ragged = uncased.encode_batch(["a b c d", "a"], padding="max_length", max_length=4, truncation=False)
    assert [row.tolist() for row in ragged["input_ids"]] == [[101, 1037, 1038, 1039, 1040, 102], [101, 1037, 102, 0]]
    assert [row.tolist() for row in ragged["attention_mask"]] == [[1] * 6, [1, 1, 1, 0]]
    even = uncased.encode_batch(["a b", "a"], padding="max_length", max_length=6, truncation=False,
                                pad_to_multiple_of=4, return_offsets=True)
    assert even["input_ids"].tolist() == [[101, 1037, 1038, 102, 0, 0, 0, 0], [101, 1037, 102, 0, 0, 0, 0, 0]]
    assert even["offsets"].shape == (2, 8, 2) and even["offsets"][0, :4].tolist() == [[0, 0], [0, 1], [2, 3], [0, 0]]
    with pytest.raises(ValueError, match="unknown padding"):
        uncased.encode_batch(["a"], padding="sideways")
    with pytest.raises(ValueError, match="unknown truncation"):
        uncased.encode_batch(["a"], truncation="middle")
    with pytest.raises(ValueError, match="num_threads"):
        uncased.encode_batch(["a"], num_threads=0)
    with pytest.raises(ValueError, match="max_input_chars_per_word"):
        WordPieceTokenizer(no_cls, max_input_chars_per_word=0)


# ----------------------------------------------------------------------------------------------
# The GPU pipeline's kernels, emulated on the CPU (tests/tokenization/test_wordpiece_gpu.py runs
# them on a GPU)
# ----------------------------------------------------------------------------------------------

GPU_CASES = [
    dict(padding=True),
    dict(padding=False),
    dict(padding="max_length", max_length=24, truncation=True),
    dict(padding="longest", max_length=24, truncation="longest_first", pad_to_multiple_of=8),
    dict(padding=False, add_special_tokens=False, truncation=False),
]
GPU_TRICKY = ["", " ", "a[SEP]b[CLS] [MASK]x [UNK]", "\u0300\U0001D16D z", "x\U0001D16D\u0301\U0001D165y",
              "\x00ctrl\u200b zero \U0001F600 \U00020000\u4E2D \uAC00", "word " * 60 + "x" * 150]


def gpu_path_equals_cpu(tok, gpu, texts, pairs, device, **kwargs):
    """encode_batch on the GPU pipeline (real or emulated) equals the CPU path, every key, every row."""
    import torch
    cpu = tok.encode_batch(texts, pairs, return_offsets=True, **kwargs)
    args = dict(add_special_tokens=kwargs.get("add_special_tokens", True), return_offsets=True)
    from fastbert.tokenization.base import padding_mode, truncation_strategy
    strategy = truncation_strategy(kwargs.get("truncation", True))
    max_length = tok._resolve_max_length(kwargs.get("max_length"), strategy != "none", kwargs.get("padding", False),
                                         kwargs.get("pad_to_multiple_of"))
    padding = padding_mode(kwargs.get("padding", False))
    got = gpu.encode_batch(texts, pairs, device, max_length=-1 if max_length is None else max_length,
                           truncation=strategy, padding=padding, pad_to_multiple_of=kwargs.get("pad_to_multiple_of") or 0,
                           cls_id=tok.cls_token_id, sep_id=tok.sep_token_id, pad_id=tok.pad_token_id, **args)
    assert set(got) == set(cpu)
    for key in cpu:
        if isinstance(cpu[key], list):
            assert len(got[key]) == len(cpu[key])
            for a, b in zip(cpu[key], got[key]):
                assert isinstance(b, torch.Tensor) and b.device.type == torch.device(device).type
                np.testing.assert_array_equal(a, b.cpu().numpy(), err_msg=key)
        else:
            np.testing.assert_array_equal(cpu[key], got[key].cpu().numpy(), err_msg=key)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=CONFIG_IDS)
def test_gpu_pipeline_emulated_equals_cpu(index, data_dir, corpus):
    from fastbert.tokenization._cuda import CudaWordPiece
    name, opts = CONFIGS[index]
    tok = WordPieceTokenizer(data_dir / "vocab" / name / "vocab.txt", **opts)
    gpu = CudaWordPiece(tok, emulate=True)
    texts = corpus[index::7][:1500] + GPU_TRICKY
    pairs = corpus[index + 3::7][:len(texts)]
    for i, kwargs in enumerate(GPU_CASES):
        gpu_path_equals_cpu(tok, gpu, texts, pairs if i % 2 else None, "cpu", **kwargs)
    gpu_path_equals_cpu(tok, gpu, [], None, "cpu", padding=True)


def test_wiki_lines_feed_the_gpu_comparison(data_dir, tmp_path):
    """test_wordpiece_gpu.py::test_cuda_equals_cpu takes 2 x 6000 + 7 lines from wiki_lines: more than
    wiki_00.xz + wiki_01.xz hold, so the helper must read on, and fail loudly when it runs out."""
    import lzma
    lines = wiki_lines(data_dir, 12_007)
    assert len(lines) == 12_007
    assert all(line.strip() and not line.startswith(("<doc", "</doc")) for line in lines)
    assert len(wiki_lines(data_dir, 10)) == 10 and wiki_lines(data_dir, 10) == lines[:10]
    folder = tmp_path / "pretrain" / "enwiki_wikiextractor"
    folder.mkdir(parents=True)
    for i in range(2):
        with lzma.open(folder / f"wiki_0{i}.xz", "wt", encoding="utf-8") as f:
            f.write(f'<doc id="{i}">\nline {i}a\n\nline {i}b\n</doc>\n')
    assert wiki_lines(tmp_path, 3) == ["line 0a", "line 0b", "line 1a"]
    with pytest.raises(ValueError, match="holds 4 text lines, fewer than 5"):
        wiki_lines(tmp_path, 5)


def test_gpu_pipeline_emulated_errors(uncased):
    from fastbert.tokenization._cuda import CudaWordPiece
    gpu = CudaWordPiece(uncased, emulate=True)
    args = dict(add_special_tokens=True, max_length=-1, truncation="none", padding="longest", pad_to_multiple_of=0,
                return_offsets=False, cls_id=101, sep_id=102, pad_id=0)
    with pytest.raises(ValueError, match=r"text_pairs\[1\] contains a lone surrogate U\+DC00 at character 2"):
        gpu.encode_batch(["a", "b"], ["ok", "xy\udc00"], "cpu", **args)
    with pytest.raises(ValueError, match="can overlap"):
        CudaWordPiece._check_specials(["[AB]", "B]x"])
    CudaWordPiece._check_specials(["[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"])


def test_cuda_unavailable_message(uncased):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: tests/tokenization/test_wordpiece_gpu.py covers the GPU path")
    with pytest.raises(RuntimeError, match="CUDA"):
        uncased.encode_batch(["a"], device="cuda")
