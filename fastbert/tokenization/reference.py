"""Pure-Python BERT WordPiece tokenizer: the oracle the C++ tokenizer is tested against.

Three stages, as in google-research/bert and HF tokenizers:

1. basic tokenizer (`BasicTokenizer`): drop control characters, map whitespace to " ", put spaces
   around CJK ideographs, NFD + drop non-spacing marks (accent strip), lowercase, then split on
   whitespace and isolate punctuation. Every output character remembers the index of the
   original character it came from, which gives HF-style character offsets.
2. WordPiece: greedy longest-match-first with the "##" continuation prefix; a word with an
   unmatchable piece, or longer than `max_input_chars_per_word`, becomes one [UNK].
3. post-processing (`ReferenceTokenizer.encode`): [CLS] a [SEP] (b [SEP]), token type ids,
   HF "longest_first" truncation, padding.

The semantics are those of HF `BertTokenizerFast` (the Rust BertNormalizer / BertPreTokenizer /
WordPiece), which differ from google-research/bert's Python in a few places:
  * only Cc, Cf, Co, Cs characters (and U+0000, U+FFFD) are dropped; unassigned ones (Cn) stay;
  * whitespace is Unicode White_Space (U+2028 and U+2029 split words; U+001C..U+001F are Cc: dropped);
  * accents are stripped before lowercasing, and `strip_accents=None` means "same as lowercase";
  * special tokens ([CLS], [SEP], [PAD], [MASK], [UNK]) written in the raw text are matched
    anywhere as whole strings before normalization, so "a[MASK]b" gives a, [MASK], b.
Character classes come from Python's `unicodedata`; HF compiles in other Unicode versions, so the
two can disagree on characters whose category changed or that were assigned recently (none occur
in the test corpora; see tests/tokenization/test_reference_tokenizer.py).
"""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

# load_vocab is re-exported (__all__).
from fastbert.tokenization.base import TokenizerBase, load_vocab, padded_width

# ----------------------------------------------------------------------------------------------
# Character classes (HF tokenizers semantics)
# ----------------------------------------------------------------------------------------------

# Ranges of the CJK Unified / Compatibility ideographs that HF's BertNormalizer spaces out.
# (HF starts the Extension E block at U+2B920, not U+2B820 as google-research/bert does.)
_CJK_RANGES = (
    (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0x2F800, 0x2FA1F),
)
_CONTROL_CATEGORIES = frozenset(("Cc", "Cf", "Co", "Cs"))


def is_whitespace(ch: str) -> bool:
    """Unicode White_Space. Python's str.isspace also accepts U+001C..U+001F, which are not."""
    return ch.isspace() and not ("\x1c" <= ch <= "\x1f")


def is_control(ch: str) -> bool:
    """Characters the normalizer drops: Cc/Cf/Co/Cs except tab/newline/CR, plus NUL and U+FFFD."""
    if ch in "\t\n\r":
        return False
    return ch == "\ufffd" or unicodedata.category(ch) in _CONTROL_CATEGORIES


def is_punctuation(ch: str) -> bool:
    """ASCII punctuation (including $+<=>^`|~, which Unicode calls symbols) or any P* category."""
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def is_chinese_char(ch: str) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


# Kinds of normalized characters, for the pre-tokenizer.
_WORD, _ISOLATED, _SPACE = 0, 1, 2


class BasicTokenizer:
    """Normalization + pre-tokenization into words, with each word's original character positions."""

    def __init__(self, lowercase: bool = True, strip_accents: bool | None = None,
                 tokenize_chinese_chars: bool = True):
        self.lowercase = bool(lowercase)
        self.strip_accents = self.lowercase if strip_accents is None else bool(strip_accents)
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        self._cache: dict[str, tuple[tuple[str, int], ...]] = {}

    def _classify(self, ch: str) -> tuple[tuple[str, int], ...]:
        """The normalized characters one original character turns into, each with its kind."""
        if is_control(ch):
            return ()
        if is_whitespace(ch):
            return ((" ", _SPACE),)
        text = ch
        if self.strip_accents:
            text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
        if self.lowercase:
            text = text.lower()  # one char at a time: no final-sigma context, like Rust's to_lowercase
        out = tuple((c, _SPACE if is_whitespace(c) else _ISOLATED if is_punctuation(c) else _WORD)
                    for c in text)
        if self.tokenize_chinese_chars and is_chinese_char(ch):
            out = ((" ", _SPACE),) + out + ((" ", _SPACE),)
        return out

    def split(self, text: str, base: int = 0) -> list[tuple[str, list[int]]]:
        """Words of ``text`` as (normalized word, original index of each of its characters).

        ``base`` is added to every index (the position of ``text`` inside the full input).
        """
        cache = self._cache
        words: list[tuple[str, list[int]]] = []
        chars: list[str] = []
        pos: list[int] = []
        for i, ch in enumerate(text, base):
            pieces = cache.get(ch)
            if pieces is None:
                pieces = cache[ch] = self._classify(ch)
            for c, kind in pieces:
                if kind == _WORD:
                    chars.append(c)
                    pos.append(i)
                    continue
                if chars:
                    words.append(("".join(chars), pos))
                    chars, pos = [], []
                if kind == _ISOLATED:
                    words.append((c, [i]))
        if chars:
            words.append(("".join(chars), pos))
        return words


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

class ReferenceTokenizer(TokenizerBase):
    """BERT WordPiece tokenizer in plain Python, with the results of HF ``BertTokenizerFast``.

    Args:
        vocab_path: a vocab.txt (or a directory holding one).
        lowercase: lowercase the text (uncased vocabularies). HF's ``do_lower_case``.
        strip_accents: NFD + drop non-spacing marks; ``None`` follows ``lowercase`` (as HF).
        tokenize_chinese_chars: give each CJK ideograph its own word.
        max_input_chars_per_word: longer words become one [UNK].
        model_max_length: default ``max_length`` when truncating with ``max_length=None``.
    """

    def __init__(self, vocab_path: str | Path, lowercase: bool = True, strip_accents: bool | None = None,
                 tokenize_chinese_chars: bool = True, max_input_chars_per_word: int = 100,
                 unk_token: str = "[UNK]", sep_token: str = "[SEP]", pad_token: str = "[PAD]",
                 cls_token: str = "[CLS]", mask_token: str = "[MASK]", model_max_length: int | None = None):
        tokens = self._init_vocab(vocab_path, lowercase, strip_accents, tokenize_chinese_chars)
        if max_input_chars_per_word < 1:
            raise ValueError(f"max_input_chars_per_word must be >= 1, got {max_input_chars_per_word}")
        self.max_input_chars_per_word = int(max_input_chars_per_word)
        self._init_special_tokens(model_max_length, unk_token, sep_token, pad_token, cls_token, mask_token)
        self.basic = BasicTokenizer(lowercase, strip_accents, tokenize_chinese_chars)
        # Longest token in characters, without "##": bounds the longest-match search.
        self._max_piece_chars = max(len(t[2:] if t.startswith("##") else t) for t in tokens)
        specials = [t for t in self.all_special_tokens if t in self.vocab]
        # Leftmost match, longest first (like HF's added-token matcher).
        self._special_re = (re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
                            if specials else None)
        self._special_first_chars = {t[0] for t in specials if t}
        self._word_cache: dict[str, list[tuple[int, int, int]]] = {}

    # -- special tokens (from_pretrained, save_pretrained, the *_token_id properties: TokenizerBase) --

    def is_special(self, token_or_id: str | int) -> bool:
        if isinstance(token_or_id, str):
            return token_or_id in self.all_special_tokens
        return int(token_or_id) in self.all_special_ids

    def __repr__(self) -> str:
        return (f"ReferenceTokenizer({str(self.vocab_path)!r}, vocab_size={self.vocab_size}, lowercase={self.lowercase}, "
                f"strip_accents={self.strip_accents}, tokenize_chinese_chars={self.tokenize_chinese_chars})")

    # -- tokenization --------------------------------------------------------------------------

    def _wordpiece(self, word: str) -> list[tuple[int, int, int]]:
        """(id, start, end) of the pieces of one normalized word; start/end index its characters."""
        cached = self._word_cache.get(word)
        if cached is not None:
            return cached
        vocab, n = self.vocab, len(word)
        pieces: list[tuple[int, int, int]] = []
        if n > self.max_input_chars_per_word:
            pieces = [(self.vocab[self.unk_token], 0, n)]
        else:
            start = 0
            while start < n:
                for end in range(min(n, start + self._max_piece_chars), start, -1):
                    idx = vocab.get(word[start:end] if start == 0 else "##" + word[start:end])
                    if idx is not None:
                        pieces.append((idx, start, end))
                        start = end
                        break
                else:  # no piece matches at `start`: the whole word is unknown
                    pieces = [(self.vocab[self.unk_token], 0, n)]
                    break
        if len(self._word_cache) > 200_000:
            self._word_cache.clear()
        self._word_cache[word] = pieces
        return pieces

    def _encode_text(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and (start, end) character offsets into ``text`` of one text, without [CLS]/[SEP]."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        segments = [(0, len(text), None)]
        if self._special_re is not None and any(c in text for c in self._special_first_chars):
            segments, last = [], 0
            for m in self._special_re.finditer(text):
                segments.append((last, m.start(), None))
                segments.append((m.start(), m.end(), self.vocab[m.group()]))
                last = m.end()
            segments.append((last, len(text), None))
        for start, end, special_id in segments:
            if special_id is not None:
                ids.append(special_id)
                offsets.append((start, end))
                continue
            for word, pos in self.basic.split(text[start:end], base=start):
                for idx, s, e in self._wordpiece(word):
                    ids.append(idx)
                    offsets.append((pos[s], pos[e - 1] + 1))
        return ids, offsets

    def tokenize(self, text: str) -> list[str]:
        """WordPiece tokens of ``text`` (no [CLS]/[SEP])."""
        return [self.ids_to_tokens[i] for i in self._encode_text(text)[0]]

    # -- encoding (__call__ and encode: TokenizerBase) -------------------------------------------

    def encode_batch(self, texts: list[str], text_pairs: list[str] | None = None, add_special_tokens: bool = True,
                     max_length: int | None = None, truncation: bool | str = True, padding: bool | str = False,
                     return_offsets: bool = False, pad_to_multiple_of: int | None = None,
                     return_special_tokens_mask: bool = False) -> dict:
        """Encode a list of texts (or pairs) as ``[CLS] a [SEP] (b [SEP])``. Returns a dict of lists of
        lists, as ``encode``.

        truncation: True / "longest_first" (HF's: trim the longer of a pair), "only_first",
            "only_second", or False. With ``max_length=None`` it truncates to ``model_max_length``.
        padding: False, True / "longest" (to the longest row of the batch), or "max_length".
        """
        strategy, max_length, padding = self._batch_options(texts, text_pairs, max_length, truncation, padding,
                                                            pad_to_multiple_of)
        texts = list(texts)
        if text_pairs is not None:
            text_pairs = list(text_pairs)
            if len(text_pairs) != len(texts):
                raise ValueError(f"texts and text_pairs differ in length ({len(texts)} != {len(text_pairs)})")
        encs = [self._encode_one(t, None if text_pairs is None else text_pairs[i], add_special_tokens,
                                 max_length, strategy) for i, t in enumerate(texts)]
        longest = max((len(e["input_ids"]) for e in encs), default=0)
        target = padded_width(longest, padding, max_length, pad_to_multiple_of) or 0
        rows = [self._finish(e, target, return_offsets, return_special_tokens_mask) for e in encs]
        keys = (["input_ids", "token_type_ids", "attention_mask"] + (["offsets"] if return_offsets else [])
                + (["special_tokens_mask"] if return_special_tokens_mask else []))
        return {k: [r[k] for r in rows] for k in keys}

    def _encode_one(self, text, text_pair, add_special_tokens, max_length, strategy) -> dict:
        a, a_off = self._encode_text(text)
        b, b_off = self._encode_text(text_pair) if text_pair is not None else (None, None)
        n_special = (3 if b is not None else 2) if add_special_tokens else 0
        if strategy != "none" and max_length is not None:
            budget = max_length - n_special
            if budget < 0:
                raise ValueError(f"max_length={max_length} is too short for the {n_special} special tokens "
                                 f"[CLS]/[SEP]; use max_length >= {n_special}")
            len_a, len_b = _truncated_lengths(len(a), None if b is None else len(b), budget, strategy)
            a, a_off = a[:len_a], a_off[:len_a]
            if b is not None:
                b, b_off = b[:len_b], b_off[:len_b]
        if add_special_tokens:
            cls, sep = self.cls_token_id, self.sep_token_id
            ids = [cls] + a + [sep]
            offsets = [(0, 0)] + a_off + [(0, 0)]
            special = [1] + [0] * len(a) + [1]
            if b is not None:
                ids += b + [sep]
                offsets += b_off + [(0, 0)]
                special += [0] * len(b) + [1]
            n_first = len(a) + 2
        else:
            ids, offsets = a + (b or []), a_off + (b_off or [])
            special = [0] * len(ids)
            n_first = len(a)
        types = [0] * n_first + [1] * (len(ids) - n_first)
        return {"input_ids": ids, "token_type_ids": types, "offsets": offsets, "special_tokens_mask": special}

    def _finish(self, enc: dict, target: int, return_offsets: bool, return_special_tokens_mask: bool = False) -> dict:
        ids, types, offsets, special = (enc[k] for k in ("input_ids", "token_type_ids", "offsets",
                                                         "special_tokens_mask"))
        mask = [1] * len(ids)
        pad = target - len(ids)
        if pad > 0:
            ids = ids + [self.pad_token_id] * pad
            types = types + [0] * pad
            mask = mask + [0] * pad
            offsets = offsets + [(0, 0)] * pad
            special = special + [1] * pad
        out = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
        if return_offsets:
            out["offsets"] = offsets
        if return_special_tokens_mask:
            out["special_tokens_mask"] = special
        return out

    # decode, batch_decode, convert_tokens_to_ids, convert_ids_to_tokens: TokenizerBase.


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

def _truncated_lengths(len_a: int, len_b: int | None, budget: int, strategy: str) -> tuple[int, int | None]:
    """Lengths after truncation to ``budget`` tokens, as HF tokenizers' ``truncate_encodings``."""
    if len_b is None:  # "only_second" without a pair is refused before (TokenizerBase._batch_options)
        return min(len_a, budget), None
    total = len_a + len_b
    if total <= budget:
        return len_a, len_b
    if budget == 0:  # HF empties both sequences, whatever the strategy
        return 0, 0
    if strategy == "longest_first":
        # The shorter keeps its length if the longer can absorb the cut; otherwise both get half.
        n1, n2 = sorted((len_a, len_b))
        n2 = n1 if n1 > budget else max(n1, budget - n1)
        if n1 + n2 > budget:
            n1 = budget // 2
            n2 = n1 + budget % 2
        return (n2, n1) if len_a > len_b else (n1, n2)
    to_remove = total - budget
    target = len_a if strategy == "only_first" else len_b
    if target <= to_remove:
        which = "first" if strategy == "only_first" else "second"
        raise ValueError(f"truncation={strategy!r} cannot fit max_length: the {which} sequence has {target} tokens "
                         f"but {to_remove} must go; use truncation='longest_first' or a larger max_length")
    if strategy == "only_first":
        return len_a - to_remove, len_b
    return len_a, len_b - to_remove


__all__ = ["ReferenceTokenizer", "BasicTokenizer", "load_vocab", "is_whitespace", "is_control",
           "is_punctuation", "is_chinese_char"]
