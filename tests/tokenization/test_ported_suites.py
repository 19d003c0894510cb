"""Ports of google-research/bert's ``tokenization_test.py`` and HF transformers'
``tests/models/bert/test_tokenization_bert.py``, plus the special-tokens-mask and padding checks of
HF's ``test_tokenization_common.py`` that BERT's tokenizer runs, against both fastbert tokenizers (the
C++ ``WordPieceTokenizer`` and the pure-Python ``ReferenceTokenizer``), with HF ``BertTokenizerFast``
(and, for the basic-tokenizer cases, HF's Python ``BasicTokenizer``) on the same inputs side by side.

Every case checks the suite's own expected values AND equality with HF. fastbert has no public
BasicTokenizer / WordpieceTokenizer stage (the C++ tokenizer does both in one pass over the text), so
the basic-tokenizer cases run through ``tokenize()`` with a vocabulary holding exactly the expected
words: a normalization or splitting difference then shows as another piece or an ``[UNK]``. Left out,
because fastbert has no such option: ``BasicTokenizer(remove_control_chars=False)`` and
``do_basic_tokenize=False`` (fastbert, like ``BertTokenizerFast``, always cleans and splits).
"""
from __future__ import annotations

import pytest

from fastbert.tokenization.reference import ReferenceTokenizer, is_control, is_punctuation, is_whitespace
from fastbert.tokenization.wordpiece import WordPieceTokenizer
from tokenizer_testing import hf_options

transformers = pytest.importorskip("transformers")
from transformers import BertTokenizerFast  # noqa: E402
from transformers.models.bert.tokenization_bert_legacy import BasicTokenizer as HFBasicTokenizer  # noqa: E402

TOKENIZERS = [WordPieceTokenizer, ReferenceTokenizer]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# google-research/bert tokenization_test.py
GOOGLE_VOCAB = ["[UNK]", "[CLS]", "[SEP]", "want", "##want", "##ed", "wa", "un", "runn", "##ing", ","]
# HF test_tokenization_bert.py setUp
HF_VOCAB = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "want", "##want", "##ed", "wa", "un", "runn", "##ing", ",",
            "low", "lowest"]


@pytest.fixture(params=TOKENIZERS, ids=["cpp", "reference"])
def cls(request):
    return request.param


def build(tmp_path, tokens, cls, **opts):
    """(ours, HF BertTokenizerFast) over a vocab.txt holding ``tokens``; ``opts`` in fastbert's names."""
    directory = tmp_path / f"vocab-{abs(hash(tuple(tokens)))}"
    directory.mkdir(exist_ok=True)
    (directory / "vocab.txt").write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    hf = BertTokenizerFast.from_pretrained(str(directory), **hf_options({"lowercase": True, **opts}))
    return cls(directory / "vocab.txt", **opts), hf


def shared(data_dir, name, cls, **opts):
    """(ours, HF) over one of the published BERT vocabularies in ../shared/data/vocab."""
    directory = data_dir / "vocab" / name
    hf = BertTokenizerFast.from_pretrained(str(directory), **hf_options({"lowercase": True, **opts}))
    ours = cls(directory / "vocab.txt", **opts)
    assert len(ours) == len(hf)
    return ours, hf


def basic_case(tmp_path, cls, text, expected, hf_basic=None, **opts):
    """The basic tokenizer's words for ``text`` are ``expected``, for ours, HF fast, and HF's Python one."""
    ours, hf = build(tmp_path, SPECIALS + sorted(set(expected) - set(SPECIALS)), cls, **opts)
    assert ours.tokenize(text) == expected
    assert hf.tokenize(text) == expected
    if hf_basic is not None:
        assert hf_basic.tokenize(text) == expected


# ---------------------------------------------------------------------------------------------------
# google-research/bert tokenization_test.py
# ---------------------------------------------------------------------------------------------------

def test_google_full_tokenizer(tmp_path, cls):
    ours, hf = build(tmp_path, GOOGLE_VOCAB, cls)
    tokens = ours.tokenize("UNwant\u00E9d,running")
    assert tokens == ["un", "##want", "##ed", ",", "runn", "##ing"] == hf.tokenize("UNwant\u00E9d,running")
    assert ours.convert_tokens_to_ids(tokens) == [7, 4, 5, 10, 8, 9] == hf.convert_tokens_to_ids(tokens)


def test_google_chinese(tmp_path, cls):
    basic_case(tmp_path, cls, "ah\u535A\u63A8zz", ["ah", "\u535A", "\u63A8", "zz"], HFBasicTokenizer())


def test_google_basic_tokenizer_lower(tmp_path, cls):
    basic_case(tmp_path, cls, " \tHeLLo!how  \n Are yoU?  ", ["hello", "!", "how", "are", "you", "?"],
               HFBasicTokenizer(do_lower_case=True))
    basic_case(tmp_path, cls, "H\u00E9llo", ["hello"], HFBasicTokenizer(do_lower_case=True))


def test_google_basic_tokenizer_no_lower(tmp_path, cls):
    basic_case(tmp_path, cls, " \tHeLLo!how  \n Are yoU?  ", ["HeLLo", "!", "how", "Are", "yoU", "?"],
               HFBasicTokenizer(do_lower_case=False), lowercase=False)


@pytest.mark.parametrize("vocab", [GOOGLE_VOCAB[:-1], HF_VOCAB], ids=["google", "hf"])
def test_wordpiece_tokenizer(tmp_path, cls, vocab):
    """Google's and HF's test_wordpiece_tokenizer (same cases; HF's vocabulary adds a few tokens)."""
    ours, hf = build(tmp_path, vocab, cls)
    for text, expected in [("", []), ("unwanted running", ["un", "##want", "##ed", "runn", "##ing"]),
                           ("unwantedX running", ["[UNK]", "runn", "##ing"])]:
        assert ours.tokenize(text) == expected == hf.tokenize(text)


def test_google_convert_tokens_to_ids(tmp_path, cls):
    ours, hf = build(tmp_path, GOOGLE_VOCAB[:-1], cls)
    tokens = ["un", "##want", "##ed", "runn", "##ing"]
    assert ours.convert_tokens_to_ids(tokens) == [7, 4, 5, 8, 9] == hf.convert_tokens_to_ids(tokens)


def test_is_whitespace_control_punctuation(tmp_path, cls):
    """Google's (and HF's) _is_whitespace / _is_control / _is_punctuation cases: on the reference's
    character classes directly, and on both tokenizers through what each class does to "a{c}b"
    (whitespace splits, a control character is dropped, punctuation is its own word)."""
    whitespace, not_whitespace = [" ", "\t", "\r", "\n", "\u00A0"], ["A", "-"]
    control, not_control = ["\u0005"], ["A", " ", "\t", "\r"]
    punctuation, not_punctuation = ["-", "$", "`", "."], ["A", " "]
    assert all(map(is_whitespace, whitespace)) and not any(map(is_whitespace, not_whitespace))
    assert all(map(is_control, control)) and not any(map(is_control, not_control))
    assert all(map(is_punctuation, punctuation)) and not any(map(is_punctuation, not_punctuation))
    ours, hf = build(tmp_path, SPECIALS + ["a", "b", "ab", "aab", "-", "$", "`", "."], cls)
    for c in whitespace:
        assert ours.tokenize(f"a{c}b") == ["a", "b"] == hf.tokenize(f"a{c}b")
    for c in control:
        assert ours.tokenize(f"a{c}b") == ["ab"] == hf.tokenize(f"a{c}b")
    for c in punctuation:
        assert ours.tokenize(f"a{c}b") == ["a", c, "b"] == hf.tokenize(f"a{c}b")
    assert ours.tokenize("aAb") == ["aab"] == hf.tokenize("aAb")  # "A" is none of the three


# ---------------------------------------------------------------------------------------------------
# HF tests/models/bert/test_tokenization_bert.py
# ---------------------------------------------------------------------------------------------------

def test_hf_full_tokenizer(tmp_path, cls):
    ours, hf = build(tmp_path, HF_VOCAB, cls)
    tokens = ours.tokenize("UNwant\u00E9d,running")
    assert tokens == ["un", "##want", "##ed", ",", "runn", "##ing"] == hf.tokenize("UNwant\u00E9d,running")
    assert ours.convert_tokens_to_ids(tokens) == [9, 6, 7, 12, 10, 11]


def test_hf_rust_and_python_full_tokenizers(tmp_path):
    """HF compares its Python and Rust tokenizers; here the C++ one, the Python reference and HF's Rust one."""
    sequence = "UNwant\u00E9d,running"
    for lowercase in (True, False):
        cpp, hf = build(tmp_path, HF_VOCAB, WordPieceTokenizer, lowercase=lowercase)
        ref, _ = build(tmp_path, HF_VOCAB, ReferenceTokenizer, lowercase=lowercase)
        assert cpp.tokenize(sequence) == ref.tokenize(sequence) == hf.tokenize(sequence)
        for add in (False, True):
            want = hf.encode(sequence, add_special_tokens=add)
            assert cpp.encode(sequence, add_special_tokens=add)["input_ids"] == want
            assert ref.encode(sequence, add_special_tokens=add)["input_ids"] == want


@pytest.mark.parametrize("lowercase, strip_accents, expected, hello", [
    (True, False, ["hällo", "!", "how", "are", "you", "?"], ["h\u00E9llo"]),
    (True, True, ["hallo", "!", "how", "are", "you", "?"], ["hello"]),
    (True, None, ["hallo", "!", "how", "are", "you", "?"], ["hello"]),
    (False, False, ["HäLLo", "!", "how", "Are", "yoU", "?"], None),
    (False, True, ["HaLLo", "!", "how", "Are", "yoU", "?"], None),
], ids=["lower-keep-accents", "lower-strip", "lower-default", "cased-keep-accents", "cased-strip"])
def test_hf_basic_tokenizer_accents(tmp_path, cls, lowercase, strip_accents, expected, hello):
    opts = dict(lowercase=lowercase) | ({} if strip_accents is None else dict(strip_accents=strip_accents))
    hf_basic = HFBasicTokenizer(do_lower_case=lowercase, strip_accents=strip_accents)
    basic_case(tmp_path, cls, " \tHäLLo!how  \n Are yoU?  ", expected, hf_basic, **opts)
    if hello is not None:
        basic_case(tmp_path, cls, "H\u00E9llo", hello, hf_basic, **opts)


def test_hf_basic_tokenizer_respects_never_split_tokens(tmp_path, cls):
    """HF's BasicTokenizer(never_split=["[UNK]"]): fastbert (like BertTokenizerFast) matches every special
    token of the vocabulary as a whole in the raw text."""
    basic_case(tmp_path, cls, " \tHeLLo!how  \n Are yoU? [UNK]", ["HeLLo", "!", "how", "Are", "yoU", "?", "[UNK]"],
               HFBasicTokenizer(do_lower_case=False, never_split=["[UNK]"]), lowercase=False)


def test_hf_basic_tokenizer_splits_on_punctuation(tmp_path, cls):
    basic_case(tmp_path, cls, "a\n'll !!to?'d of, can't.",
               ["a", "'", "ll", "!", "!", "to", "?", "'", "d", "of", ",", "can", "'", "t", "."], HFBasicTokenizer())


def test_hf_basic_tokenizer_remove_control_chars(tmp_path, cls):
    ours, hf = build(tmp_path, HF_VOCAB, cls)
    assert ours.tokenize("\u200E\u200F") == [] == hf.tokenize("\u200E\u200F")


def test_hf_clean_text(tmp_path, cls):
    """huggingface/tokenizers#340: a soft hyphen alone gives no token."""
    ours, hf = build(tmp_path, HF_VOCAB, cls)
    texts = ["Test", "\xad", "test"]
    assert [ours.tokenize(t) for t in texts] == [["[UNK]"], [], ["[UNK]"]] == [hf.tokenize(t) for t in texts]


def test_hf_sequence_builders(data_dir, cls):
    ours, hf = shared(data_dir, "bert-base-uncased", cls)
    text = ours.encode("sequence builders", add_special_tokens=False)["input_ids"]
    text_2 = ours.encode("multi-sequence build", add_special_tokens=False)["input_ids"]
    assert text == hf.encode("sequence builders", add_special_tokens=False)
    assert ours.encode("sequence builders")["input_ids"] == [101] + text + [102]
    pair = ours.encode("sequence builders", "multi-sequence build")["input_ids"]
    assert pair == [101] + text + [102] + text_2 + [102] == hf.encode("sequence builders", "multi-sequence build")


@pytest.mark.parametrize("name, lowercase", [("bert-base-uncased", True), ("bert-base-cased", False)])
def test_hf_offsets_with_special_characters(data_dir, cls, name, lowercase):
    ours, hf = shared(data_dir, name, cls, lowercase=lowercase)
    sentence = f"A, naïve {ours.mask_token} AllenNLP sentence."
    expected = ([((0, 0), "[CLS]"), ((0, 1), "A"), ((1, 2), ","), ((3, 5), "na"), ((5, 6), "##ï"), ((6, 8), "##ve"),
                 ((9, 15), "[MASK]"), ((16, 21), "Allen"), ((21, 23), "##NL"), ((23, 24), "##P"),
                 ((25, 33), "sentence"), ((33, 34), "."), ((0, 0), "[SEP]")]
                if not lowercase else
                [((0, 0), "[CLS]"), ((0, 1), "a"), ((1, 2), ","), ((3, 8), "naive"), ((9, 15), "[MASK]"),
                 ((16, 21), "allen"), ((21, 23), "##nl"), ((23, 24), "##p"), ((25, 33), "sentence"),
                 ((33, 34), "."), ((0, 0), "[SEP]")])
    enc = ours(sentence, return_attention_mask=False, return_token_type_ids=False, return_offsets_mapping=True)
    theirs = hf(sentence, return_attention_mask=False, return_token_type_ids=False, return_offsets_mapping=True)
    assert set(enc) == set(theirs) == {"input_ids", "offset_mapping"}
    assert ours.convert_ids_to_tokens(enc["input_ids"]) == [t for _, t in expected]
    assert [tuple(o) for o in enc["offset_mapping"]] == [o for o, _ in expected]
    assert enc["input_ids"] == theirs["input_ids"]
    assert [tuple(o) for o in enc["offset_mapping"]] == [tuple(o) for o in theirs["offset_mapping"]]


def test_hf_change_tokenize_chinese_chars(data_dir, cls):
    chars = ["的", "人", "有"]
    for spaced in (True, False):
        ours, hf = shared(data_dir, "bert-base-uncased", cls, tokenize_chinese_chars=spaced)
        got = ours.convert_ids_to_tokens(ours.encode("".join(chars), add_special_tokens=False)["input_ids"])
        expected = chars if spaced else [c if i == 0 else f"##{c}" for i, c in enumerate(chars)]
        assert got == expected == hf.convert_ids_to_tokens(hf.encode("".join(chars), add_special_tokens=False))


# ---------------------------------------------------------------------------------------------------
# HF test_tokenization_common.py: special tokens mask, padding to a multiple (issue 15, item 5)
# ---------------------------------------------------------------------------------------------------

def _lists(enc: dict) -> dict:
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in enc.items()}


@pytest.mark.parametrize("args, expected", [
    (("This is a test", "Hello [MASK] world"), [1, 0, 0, 0, 0, 1, 0, 0, 0, 1]),
    (("hello ☃☃ world",), [1, 0, 0, 0, 1]),
], ids=["mask-in-text", "unk-in-text"])
def test_special_tokens_mask_marks_only_added_tokens(data_dir, cls, args, expected):
    """A [MASK] or [UNK] that comes from the text is not special (so an MLM collator may mask it)."""
    ours, hf = shared(data_dir, "bert-base-uncased", cls)
    enc = ours(*args, return_special_tokens_mask=True)
    assert enc["special_tokens_mask"] == expected == hf(*args, return_special_tokens_mask=True)["special_tokens_mask"]
    assert ours.unk_token_id in enc["input_ids"] or ours.mask_token_id in enc["input_ids"]


@pytest.mark.parametrize("kwargs", [
    dict(padding=True), dict(padding=True, return_tensors="np"), dict(padding=True, return_tensors="pt"),
    dict(padding=False), dict(add_special_tokens=False, padding=True), dict(padding="max_length", max_length=16),
    dict(max_length=6, truncation=True, padding=True), dict(max_length=9, truncation="only_second"),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_special_tokens_mask_batches_match_hf(data_dir, cls, kwargs):
    ours, hf = shared(data_dir, "bert-base-uncased", cls)
    if cls is ReferenceTokenizer and kwargs.get("return_tensors") == "pt":
        pytest.importorskip("torch")
    texts = ["a [UNK] b [MASK]", "[CLS] inside [SEP] the text", "x"]
    pairs = ["[PAD] y", "z ☃", "w w w [SEP]"]
    for text_pairs in (None, pairs):
        if kwargs.get("truncation") == "only_second" and text_pairs is None:
            continue
        got = _lists(ours(texts, text_pairs, return_special_tokens_mask=True, **kwargs))
        want = _lists(hf(texts, text_pairs, return_special_tokens_mask=True, **kwargs))
        assert got == want, kwargs


@pytest.mark.parametrize("pair", [None, "This one too please."])
def test_hf_special_tokens_mask(data_dir, cls, pair):
    """HF's test_special_tokens_mask / _input_pairs: removing the masked positions gives the encoding
    without special tokens; get_special_tokens_mask as HF's data collators call it."""
    ours, hf = shared(data_dir, "bert-base-uncased", cls)
    seq = "Encode this."
    bare = ours.encode(seq, pair, add_special_tokens=False)["input_ids"]
    enc = ours(seq, pair, add_special_tokens=True, return_special_tokens_mask=True)
    kept = [x for x, special in zip(enc["input_ids"], enc["special_tokens_mask"]) if not special]
    assert kept == bare and len(enc["special_tokens_mask"]) == len(enc["input_ids"])
    assert enc["special_tokens_mask"] == hf(seq, pair, return_special_tokens_mask=True)["special_tokens_mask"]
    ids = [101, 5, ours.unk_token_id, ours.mask_token_id, 102, 0]
    assert ours.get_special_tokens_mask(ids, already_has_special_tokens=True) == [1, 0, 1, 1, 1, 1] == \
        hf.get_special_tokens_mask(ids, already_has_special_tokens=True)
    a = ours.encode(seq, add_special_tokens=False)["input_ids"]
    b = None if pair is None else ours.encode(pair, add_special_tokens=False)["input_ids"]
    assert ours.get_special_tokens_mask(a, b) == [1] + [0] * len(a) + [1] + ([] if b is None else [0] * len(b) + [1])
    with pytest.raises(ValueError, match="already_has_special_tokens"):
        ours.get_special_tokens_mask(ids, [5], already_has_special_tokens=True)


def test_hf_padding_to_multiple_of(data_dir, cls):
    ours, hf = shared(data_dir, "bert-base-uncased", cls)
    for text in ("", "This is a sample input"):
        assert all(len(v) % 8 == 0 for v in ours(text, padding=True, pad_to_multiple_of=8).values())
    assert all(len(v) % 8 != 0 for v in ours("This", pad_to_multiple_of=8).values())  # no padding asked for
    assert all(len(v) % 8 == 0 for v in ours("This", padding=True, truncation=True, pad_to_multiple_of=8).values())
    for kwargs in (dict(padding=True, truncation=True, max_length=12, pad_to_multiple_of=8),
                   dict(padding="max_length", truncation=True, max_length=30, pad_to_multiple_of=16)):
        with pytest.raises(ValueError) as theirs:
            hf("This", **kwargs)
        with pytest.raises(ValueError) as mine:
            ours("This", **kwargs)
        assert str(mine.value) == str(theirs.value)
        with pytest.raises(ValueError, match="not a multiple of pad_to_multiple_of"):
            ours.encode_batch(["This"], **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(max_length=30, pad_to_multiple_of=16, padding="max_length"),   # no truncation asked: rows of 32
    dict(max_length=30, pad_to_multiple_of=16, padding=True),           # max_length is ignored, as HF
    dict(max_length=30, pad_to_multiple_of=16),                         # truncation only, no padding
    dict(max_length=5, padding="max_length"),                           # longer rows are kept, not cut
], ids=["max_length-padding", "longest-padding", "no-padding", "no-truncation"])
def test_truncation_default_matches_hf(data_dir, cls, kwargs):
    """truncation=None truncates only when max_length is given and padding is off (HF's rule)."""
    ours, hf = shared(data_dir, "bert-base-uncased", cls)
    texts = ["a b c", "a b c d e f g h i j k l"]
    assert _lists(ours(texts, **kwargs)) == _lists(hf(texts, **kwargs))
