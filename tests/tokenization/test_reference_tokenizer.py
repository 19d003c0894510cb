"""The pure-Python reference tokenizer: golden cases, bad input, and exact parity (ids AND offsets)
with HF ``BertTokenizerFast`` on real text in many languages for the four BERT vocabularies.

HF set-up and the corpus: tokenizer_testing.py.
"""
from __future__ import annotations

import json
import unicodedata

import pytest

from fastbert.tokenization.reference import BasicTokenizer, ReferenceTokenizer
from tokenizer_testing import CONFIG_IDS, CONFIGS, first_mismatch, read_corpus, tokenizer_and_hf

transformers = pytest.importorskip("transformers")
BertTokenizerFast = transformers.BertTokenizerFast


@pytest.fixture(scope="module")
def corpus(data_dir) -> list[str]:
    """~10k real lines: English Wikipedia, UD Chinese and Japanese, every UDHR translation."""
    lines, _ = read_corpus(data_dir, udhr_lines_per_file=16)
    assert len(lines) >= 9000
    return lines


@pytest.fixture(scope="module", params=range(len(CONFIGS)), ids=CONFIG_IDS)
def pair(request, data_dir):
    """(ReferenceTokenizer, HF BertTokenizerFast) with the same vocabulary and options."""
    return tokenizer_and_hf(ReferenceTokenizer, data_dir, request.param)


# ----------------------------------------------------------------------------------------------
# Parity with HF on real text
# ----------------------------------------------------------------------------------------------

def test_ids_and_offsets_match_hf(pair, corpus):
    ref, hf = pair
    ours = ref.encode_batch(corpus, return_offsets=True)
    theirs = hf(corpus, return_offsets_mapping=True)
    assert ours["input_ids"] == theirs["input_ids"], first_mismatch(corpus, ours["input_ids"], theirs["input_ids"])
    hf_offsets = [[tuple(o) for o in row] for row in theirs["offset_mapping"]]
    assert ours["offsets"] == hf_offsets, first_mismatch(corpus, ours["offsets"], hf_offsets)
    assert sum(map(len, ours["input_ids"])) > 200_000  # the corpus really was tokenized
    unk = ref.unk_token_id
    assert sum(row.count(unk) for row in ours["input_ids"]) > 0  # [UNK] paths were exercised


def test_tokenize_and_decode_match_hf(pair, corpus):
    ref, hf = pair
    lines = corpus[::13]
    for line in lines:
        assert ref.tokenize(line) == hf.tokenize(line), line
    for line in lines[:300]:
        ids = ref.encode(line)["input_ids"]
        for skip in (True, False):
            assert ref.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), line


@pytest.mark.parametrize("max_length", [9, 64])
def test_pairs_with_truncation_match_hf(pair, corpus, max_length):
    ref, hf = pair
    firsts, seconds = corpus[0::12], corpus[5::12]  # wiki, UD and UDHR lines
    ours = ref.encode_batch(firsts, seconds, max_length=max_length, truncation=True, return_offsets=True)
    theirs = hf(firsts, seconds, max_length=max_length, truncation=True, return_offsets_mapping=True)
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert ours[key] == theirs[key], first_mismatch(firsts, ours[key], theirs[key])
    assert ours["offsets"] == [[tuple(o) for o in row] for row in theirs["offset_mapping"]]
    assert max(map(len, ours["input_ids"])) == max_length


@pytest.mark.parametrize("padding,max_length,multiple", [
    (True, None, None), ("longest", 40, None), ("max_length", 48, None), ("longest", None, 8), ("max_length", 24, 8),
])
def test_padding_modes_match_hf(pair, corpus, padding, max_length, multiple):
    ref, hf = pair
    texts, pairs = corpus[100:140], corpus[200:240]
    for text_pairs in (None, pairs):
        kwargs = dict(padding=padding, max_length=max_length, truncation=max_length is not None,
                      pad_to_multiple_of=multiple)
        ours = ref(texts, text_pairs, return_offsets_mapping=True, **kwargs)
        theirs = hf(texts, text_pairs, return_offsets_mapping=True, **kwargs)
        lengths = {len(row) for row in ours["input_ids"]}
        assert len(lengths) == 1, "padding must give rows of one length"
        for key in ("input_ids", "token_type_ids", "attention_mask"):
            assert ours[key] == theirs[key], key
        assert ours["offset_mapping"] == [[tuple(o) for o in row] for row in theirs["offset_mapping"]]


def test_return_tensors(pair, corpus):
    torch = pytest.importorskip("torch")
    ref, hf = pair
    ours = ref(corpus[:16], padding=True, return_tensors="pt")
    theirs = hf(corpus[:16], padding=True, return_tensors="pt")
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert torch.equal(ours[key], theirs[key])
    assert ref(corpus[:4], padding=True, return_tensors="np")["input_ids"].shape[0] == 4
    with pytest.raises(ValueError, match="padding"):
        ref(corpus[:16], return_tensors="np")


@pytest.mark.parametrize("strategy", ["longest_first", "only_first", "only_second"])
def test_truncation_strategies_match_hf(data_dir, strategy):
    """Every split of lengths (0..9, 0..9) under every max_length, including HF's errors. HF is called
    with a batch of one: a single call drops an empty text_pair ("" is falsy), a batch keeps it, as we do."""
    ref = ReferenceTokenizer(data_dir / "vocab" / "bert-base-uncased" / "vocab.txt")
    hf = BertTokenizerFast.from_pretrained(str(data_dir / "vocab" / "bert-base-uncased"))
    for n_a in range(10):
        for n_b in range(10):
            a, b = " ".join("a" * n_a), " ".join("b" * n_b)
            for max_length in range(3, n_a + n_b + 4):
                try:
                    expected = hf([a], [b], truncation=strategy, max_length=max_length)["input_ids"][0]
                except Exception:  # HF's Rust TruncationError
                    with pytest.raises(ValueError, match="cannot fit"):
                        ref.encode(a, b, truncation=strategy, max_length=max_length)
                    continue
                got = ref.encode(a, b, truncation=strategy, max_length=max_length)["input_ids"]
                assert got == expected, (n_a, n_b, max_length)


@pytest.mark.parametrize("options", [
    dict(lowercase=True, strip_accents=None, tokenize_chinese_chars=True),
    dict(lowercase=False, strip_accents=None, tokenize_chinese_chars=True),
    dict(lowercase=True, strip_accents=False, tokenize_chinese_chars=True),
    dict(lowercase=False, strip_accents=True, tokenize_chinese_chars=False),
])
def test_every_stable_code_point_matches_hf(options):
    """Normalization + pre-tokenization (words and their original offsets) of every code point
    assigned since Unicode 3.2 with an unchanged category, against HF's BertNormalizer and
    BertPreTokenizer. Newer or re-categorized characters may differ: HF compiles in its own
    Unicode tables, this module uses Python's."""
    from tokenizers import PreTokenizedString
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    old = unicodedata.ucd_3_2_0
    chars = [chr(cp) for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF
             and old.category(chr(cp)) != "Cn" and old.category(chr(cp)) == unicodedata.category(chr(cp))]
    text = "".join("x" + c for c in chars)  # a letter between characters keeps words apart
    normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=options["tokenize_chinese_chars"],
                                strip_accents=options["strip_accents"], lowercase=options["lowercase"])
    pts = PreTokenizedString(text)
    pts.normalize(normalizer.normalize)
    BertPreTokenizer().pre_tokenize(pts)
    theirs = [(w, off) for w, off, _ in pts.get_splits(offset_referential="original", offset_type="char")]
    ours = [(w, (pos[0], pos[-1] + 1)) for w, pos in BasicTokenizer(**options).split(text)]
    assert len(ours) == len(theirs)
    assert ours == theirs, first_mismatch([text] * len(ours), ours, theirs)


def test_from_pretrained_matches_hf_on_minilm(minilm_dir, corpus):
    ref = ReferenceTokenizer.from_pretrained(minilm_dir)
    hf = BertTokenizerFast.from_pretrained(str(minilm_dir))
    assert ref.lowercase and ref.model_max_length == 512
    lines = corpus[::20]
    assert ref(lines, truncation=True)["input_ids"] == hf(lines, truncation=True)["input_ids"]


# ----------------------------------------------------------------------------------------------
# Golden cases on a hand-built vocabulary
# ----------------------------------------------------------------------------------------------

TOY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "want", "##want", "##ed",
             "runn", "##ing", ",", ".", "hello", "hallo", "hä", "##llo", "博", "推", "ah", "zz", "a", "b", "[", "]",
             "x", "##x"]


@pytest.fixture()
def toy_vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("".join(t + "\n" for t in TOY_VOCAB), encoding="utf-8")
    return path


@pytest.fixture()
def toy(toy_vocab):
    return ReferenceTokenizer(toy_vocab)


@pytest.mark.parametrize("text,tokens", [
    ("unaffable", ["un", "##aff", "##able"]),
    ("UNwant\u00E9d,running", ["un", "##want", "##ed", ",", "runn", "##ing"]),
    ("unwantedX", ["un", "##want", "##ed", "##x"]),
    ("unaffablez", ["[UNK]"]),                     # '##z' is not in the vocabulary: the whole word is [UNK]
    ("  \tHeLLo!how  \n Are yoU?  ", ["hello", "[UNK]", "[UNK]", "[UNK]", "[UNK]", "[UNK]"]),
    ("H\u00E4LLo", ["hallo"]),                     # accent stripped, then lowercased
    ("Ha\u0308llo", ["hallo"]),                    # decomposed input: the combining mark is dropped
    ("ah\u535A\u63A8zz", ["ah", "博", "推", "zz"]),  # CJK ideographs become words of their own
    ("he\u200bl\x00lo\ufffd", ["hello"]),          # zero-width space, NUL and U+FFFD are dropped
    ("a\u2028b\u3000a", ["a", "b", "a"]),           # line separator and ideographic space split words
    ("", []),
    (" \t\n\r\u3000 ", []),
    ("a[MASK]b [mask]", ["a", "[MASK]", "b", "[", "[UNK]", "]"]),
])
def test_golden_tokens(toy, text, tokens):
    assert toy.tokenize(text) == tokens


def test_options_change_normalization(toy_vocab):
    assert ReferenceTokenizer(toy_vocab, strip_accents=False).tokenize("H\u00E4LLo") == ["hä", "##llo"]
    assert ReferenceTokenizer(toy_vocab, lowercase=False).tokenize("hello Hello") == ["hello", "[UNK]"]
    assert ReferenceTokenizer(toy_vocab, tokenize_chinese_chars=False).tokenize("ah\u535A") == ["[UNK]"]


def test_long_words_become_one_unk(toy_vocab):
    tok = ReferenceTokenizer(toy_vocab, max_input_chars_per_word=6)
    assert tok.tokenize("unaffable un") == ["[UNK]", "un"]
    default = ReferenceTokenizer(toy_vocab)
    assert default.tokenize("x" * 100) == ["x"] + ["##x"] * 99
    assert default.tokenize("x" * 101 + " a") == ["[UNK]", "a"]
    enc = default.encode("x" * 101 + " a", return_offsets=True)
    assert enc["offsets"] == [(0, 0), (0, 101), (102, 103), (0, 0)]


def test_offsets_point_into_the_original_text(toy):
    text = " \u00C4h\u535A un\u200baffable,"
    enc = toy.encode(text, return_offsets=True)
    tokens = toy.convert_ids_to_tokens(enc["input_ids"])
    assert tokens == ["[CLS]", "ah", "博", "un", "##aff", "##able", ",", "[SEP]"]
    pieces = [text[s:e] for s, e in enc["offsets"]]
    assert pieces == ["", "\u00C4h", "\u535A", "un", "aff", "able", ",", ""]  # U+200B is dropped


def test_encode_pair_layout(toy):
    enc = toy.encode("hello", "un ah", return_offsets=True)
    assert toy.convert_ids_to_tokens(enc["input_ids"]) == ["[CLS]", "hello", "[SEP]", "un", "ah", "[SEP]"]
    assert enc["token_type_ids"] == [0, 0, 0, 1, 1, 1]
    assert enc["attention_mask"] == [1] * 6
    assert enc["offsets"] == [(0, 0), (0, 5), (0, 0), (0, 2), (3, 5), (0, 0)]
    bare = toy.encode("hello", "un", add_special_tokens=False)
    assert bare["input_ids"] == [toy.vocab["hello"], toy.vocab["un"]] and bare["token_type_ids"] == [0, 1]


def test_decode_and_conversions(toy):
    ids = toy.encode("unaffable, hello.")["input_ids"]
    assert toy.decode(ids) == "unaffable, hello."
    assert toy.decode(ids, skip_special_tokens=False) == "[CLS] unaffable, hello. [SEP]"
    assert toy.convert_tokens_to_ids(["un", "nope"]) == [5, toy.unk_token_id]
    assert toy.convert_ids_to_tokens(5) == "un"
    assert toy.get_special_tokens_mask(ids, already_has_special_tokens=True) == [1] + [0] * (len(ids) - 2) + [1]
    assert toy.is_special("[MASK]") and toy.is_special(toy.mask_token_id) and not toy.is_special("un")
    assert (toy.pad_token_id, toy.unk_token_id, toy.cls_token_id, toy.sep_token_id, toy.mask_token_id) == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="out of range"):
        toy.decode([len(TOY_VOCAB)])


def test_save_and_load_round_trip(toy, tmp_path, data_dir):
    ref = ReferenceTokenizer(data_dir / "vocab" / "bert-base-cased" / "vocab.txt", lowercase=False, model_max_length=32)
    ref.save_pretrained(tmp_path / "tok")
    again = ReferenceTokenizer.from_pretrained(tmp_path / "tok")
    assert (again.lowercase, again.model_max_length, again.vocab) == (False, 32, ref.vocab)
    hf = BertTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    text = "Héllo Wörld, unaffable " * 10
    assert again(text, truncation=True)["input_ids"] == hf(text, truncation=True)["input_ids"]
    assert len(again(text, truncation=True)["input_ids"]) == 32


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------

def write_vocab(tmp_path, tokens):
    path = tmp_path / "vocab.txt"
    path.write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    return path


def test_missing_vocab_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="vocab file not found.*nope.txt"):
        ReferenceTokenizer(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="vocab file not found"):
        ReferenceTokenizer.from_pretrained(tmp_path)  # a directory without vocab.txt
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        ReferenceTokenizer.from_pretrained(tmp_path / "missing")


def test_vocab_without_unk(tmp_path):
    path = write_vocab(tmp_path, ["[PAD]", "[CLS]", "[SEP]", "hello"])
    with pytest.raises(ValueError, match=r"no unknown token '\[UNK\]'.*vocab.txt|vocab.txt.*no unknown token"):
        ReferenceTokenizer(path)
    assert ReferenceTokenizer(path, unk_token="hello").tokenize("hello x") == ["hello", "hello"]


def test_missing_special_tokens_fail_when_used(tmp_path):
    tok = ReferenceTokenizer(write_vocab(tmp_path, ["[UNK]", "hello"]))
    assert tok.tokenize("hello") == ["hello"]  # no special token needed
    assert tok.encode("hello", add_special_tokens=False)["input_ids"] == [1]
    with pytest.raises(ValueError, match=r"no '\[CLS\]' token"):
        tok.encode("hello")
    with pytest.raises(ValueError, match=r"no '\[PAD\]' token"):
        tok.encode_batch(["hello", "hello hello"], add_special_tokens=False, padding=True)
    with pytest.raises(ValueError, match=r"no '\[MASK\]' token"):
        tok.mask_token_id


def test_bad_vocab_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        ReferenceTokenizer(empty)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("[UNK]\nh\xe9llo\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        ReferenceTokenizer(latin1)
    bad_config = tmp_path / "dir"
    bad_config.mkdir()
    write_vocab(bad_config, ["[UNK]"])
    (bad_config / "tokenizer_config.json").write_text("{nope")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        ReferenceTokenizer.from_pretrained(bad_config)


def test_bad_arguments(toy):
    with pytest.raises(ValueError, match="too short"):
        toy.encode("hello", "un", max_length=2)
    with pytest.raises(ValueError, match="needs max_length"):
        toy.encode("hello", padding="max_length")
    with pytest.raises(ValueError, match="unknown padding"):
        toy.encode("hello", padding="left")
    with pytest.raises(ValueError, match="unknown truncation"):
        toy.encode("hello", truncation="middle", max_length=4)
    with pytest.raises(TypeError, match="list of texts"):
        toy.encode_batch("hello")
    with pytest.raises(TypeError, match="must be a str"):
        toy.encode(3)


def test_from_pretrained_reads_config(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_vocab(directory, TOY_VOCAB)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"do_lower_case": False, "strip_accents": None, "model_max_length": 4, "unk_token": {"content": "[UNK]"}}))
    tok = ReferenceTokenizer.from_pretrained(directory)
    assert not tok.lowercase and tok.model_max_length == 4
    assert tok("hello un ah", truncation=True)["input_ids"] == [2, 15, 5, 3]
    assert ReferenceTokenizer.from_pretrained(directory, lowercase=True).lowercase
