"""Property tests (hypothesis, bounded): on random Unicode the C++ WordPieceTokenizer never crashes and
always gives HF BertTokenizerFast's ids and offsets, for single texts, batches and truncated pairs."""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
transformers = pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastbert.tokenization.wordpiece import WordPieceTokenizer  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Characters that stress the normalizer: marks, controls, zero-width, whitespace variants, CJK
# (incl. HF's Extension-E quirk), Hangul, emoji, characters HF's Unicode tables see differently
# from Python's, musical marks that canonical ordering swaps, and the special-token brackets.
TRICKY = list(
    "aAzZ09 \t\n\r.,!?-'\"[]#$~^`|" "éÉñÑßİıΣσς" "\u0300\u0301\u0323\u0308\u0345\u093C\u0F71"
    "\u200b\u200c\u200d\u2060\ufeff\u00ad\x00\x07\x1b\x7f\x85\ufffd\u2028\u3000\u00a0"
    "中文字日本語한국어\uAC00\uD7A3\u1100\u3042\u30A2\uF900\uFA6C"
    "\U00020000\U0002B820\U0002B920\U0002F800\U0001F600\U0001F468\U0001F3FB\u2764\ufe0f"
    "\u0890\u08E2\u0898\u1DF6\u1734\u166D\u2E43\U00011938\uA7CB\U0001D16D\U0001D165\U0001D15E"
) + ["[CLS]", "[SEP]", "[MASK]", "[UNK]", "[PAD]", "##", "un", "##aff"]

tricky_text = st.lists(st.sampled_from(TRICKY) | st.characters(blacklist_categories=("Cs",)),
                       max_size=40).map("".join)
any_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)
texts = tricky_text | any_text


@pytest.fixture(scope="module", params=[("bert-base-uncased", True), ("bert-base-multilingual-cased", False)],
                ids=["uncased", "multilingual-cased"])
def pair(request, data_dir):
    name, lowercase = request.param
    directory = data_dir / "vocab" / name
    ours = WordPieceTokenizer(directory / "vocab.txt", lowercase=lowercase)
    hf = transformers.BertTokenizerFast.from_pretrained(str(directory), do_lower_case=lowercase)
    assert len(hf) == len(ours)
    return ours, hf


def _check(ours_enc, hf_enc):
    assert ours_enc["input_ids"] == hf_enc["input_ids"]
    assert ours_enc["token_type_ids"] == hf_enc["token_type_ids"]
    hf_offsets = hf_enc["offset_mapping"]
    if hf_offsets and isinstance(hf_offsets[0], list):
        hf_offsets = [[tuple(o) for o in row] for row in hf_offsets]
    else:
        hf_offsets = [tuple(o) for o in hf_offsets]
    assert ours_enc["offset_mapping"] == hf_offsets


@settings(max_examples=100, **SETTINGS)
@given(text=texts)
def test_random_text_matches_hf(pair, text):
    ours, hf = pair
    _check(ours(text, return_offsets_mapping=True), hf(text, return_offsets_mapping=True))


@settings(max_examples=30, **SETTINGS)
@given(batch=st.lists(texts, min_size=1, max_size=8), pairs=st.lists(texts, min_size=8, max_size=8),
       max_length=st.integers(min_value=3, max_value=24))
def test_random_batches_and_pairs_match_hf(pair, batch, pairs, max_length):
    ours, hf = pair
    seconds = pairs[:len(batch)]
    _check(ours(batch, return_offsets_mapping=True), hf(batch, return_offsets_mapping=True))
    kwargs = dict(truncation=True, max_length=max_length, padding="max_length", return_offsets_mapping=True)
    _check(ours(batch, seconds, **kwargs), hf(batch, seconds, **kwargs))
