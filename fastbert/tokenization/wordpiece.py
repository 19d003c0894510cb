"""``WordPieceTokenizer``: the C++ BERT WordPiece tokenizer (extension ``fastbert._wordpiece``).

Same API and results as the pure-Python oracle (``fastbert.tokenization.reference``) and HF
``BertTokenizerFast``, plus ``encode_batch`` returning NumPy arrays / torch tensors built in C++
(no Python object per token), on all cores with the GIL released, or on the GPU with
``device="cuda"`` (csrc/cuda, see ``fastbert.tokenization._cuda``).

One pass over each text's code points does BERT normalization (drop control characters, map
whitespace to " ", space out CJK ideographs, NFD + drop accents, lowercase), pre-tokenization
(split on whitespace, isolate punctuation), special-token matching in the raw text, and
WordPiece (LinMaxMatch over a double-array trie) as soon as each word ends.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fastbert.tokenization.base import TokenizerBase, default_truncation

_TRUNCATION = {True: "longest_first", False: "none", None: "none", "do_not_truncate": "none",
               "longest_first": "longest_first", "only_first": "only_first", "only_second": "only_second"}


def _load_core():
    try:
        from fastbert import _wordpiece
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError(f"the fastbert C++ extension is not built ({e}); run "
                          f"`pip install --no-build-isolation -e .` in the fastbert checkout") from None
    if not hasattr(_wordpiece, "WordPieceCore"):  # pragma: no cover
        raise ImportError("fastbert._wordpiece has no WordPieceCore: rebuild the extension "
                          "(`pip install --no-build-isolation -e .`)")
    return _wordpiece


class WordPieceTokenizer(TokenizerBase):
    """BERT WordPiece tokenizer in C++, with the results of HF ``BertTokenizerFast``.

    Args:
        vocab_path: a vocab.txt (or a directory holding one).
        lowercase: lowercase the text (uncased vocabularies). HF's ``do_lower_case``.
        strip_accents: NFD + drop non-spacing marks; ``None`` follows ``lowercase`` (as HF).
        tokenize_chinese_chars: give each CJK ideograph its own word.
        max_input_chars_per_word: longer words become one [UNK].
        model_max_length: default ``max_length`` when truncating with ``max_length=None``.
        *_token: the special tokens; each one present in the vocabulary is also matched as a whole
            string in the raw text (as HF's added tokens), so "a[MASK]b" gives a, [MASK], b.
    """

    def __init__(self, vocab_path: str | Path, lowercase: bool = True, strip_accents: bool | None = None,
                 tokenize_chinese_chars: bool = True, max_input_chars_per_word: int = 100,
                 unk_token: str = "[UNK]", sep_token: str = "[SEP]", pad_token: str = "[PAD]",
                 cls_token: str = "[CLS]", mask_token: str = "[MASK]", model_max_length: int | None = None):
        ext = _load_core()
        tokens = self._init_vocab(vocab_path, lowercase, strip_accents, tokenize_chinese_chars)
        if int(max_input_chars_per_word) < 1:
            raise ValueError(f"max_input_chars_per_word must be >= 1, got {max_input_chars_per_word}")
        self.max_input_chars_per_word = int(max_input_chars_per_word)
        self._init_special_tokens(model_max_length, unk_token, sep_token, pad_token, cls_token, mask_token)
        specials = [(t, self.vocab[t]) for t in dict.fromkeys(self.all_special_tokens) if t and t in self.vocab]
        strip = self.lowercase if strip_accents is None else bool(strip_accents)
        self._core = ext.WordPieceCore(tokens, self.lowercase, strip, self.tokenize_chinese_chars,
                                       self.max_input_chars_per_word, self.vocab[unk_token], specials)
        self._cuda = None  # fastbert.tokenization._cuda.CudaWordPiece, made on first use

    # from_pretrained, save_pretrained, special tokens, __len__ / vocab_size, convert_tokens_to_ids,
    # convert_ids_to_tokens, decode and batch_decode: TokenizerBase.

    # decode / batch_decode refuse a bare int (list(5) raises TypeError), unlike the reference.
    @staticmethod
    def _id_list(ids) -> list:
        return _to_list(ids)

    # -- encoding --------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[str]:
        """WordPiece tokens of ``text`` (no [CLS]/[SEP])."""
        ids, _ = self._core.encode(text)
        return [self.ids_to_tokens[i] for i in ids.tolist()]

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True,
               max_length: int | None = None, truncation: bool | str = True, padding: bool | str = False,
               return_offsets: bool = False, pad_to_multiple_of: int | None = None) -> dict:
        """Encode one text (or pair) as ``[CLS] a [SEP] (b [SEP])``. Returns a dict of lists:
        ``input_ids``, ``token_type_ids``, ``attention_mask`` and, with ``return_offsets``,
        ``offsets`` ((start, end) character positions in the original text; (0, 0) for special
        tokens and padding). Options as ``encode_batch``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}; use encode_batch() for a list")
        if text_pair is not None and not isinstance(text_pair, str):
            raise TypeError(f"text_pair must be a str, got {type(text_pair).__name__}")
        enc = self.encode_batch([text], None if text_pair is None else [text_pair], add_special_tokens, max_length,
                                truncation, "longest" if padding in (False, None) else padding, return_offsets,
                                num_threads=1, pad_to_multiple_of=pad_to_multiple_of)
        out = {key: value[0].tolist() for key, value in enc.items()}
        if return_offsets:
            out["offsets"] = [tuple(o) for o in out["offsets"]]
        return out

    def encode_batch(self, texts: list[str], text_pairs: list[str] | None = None, add_special_tokens: bool = True,
                     max_length: int | None = None, truncation: bool | str = True, padding: bool | str = False,
                     return_offsets: bool = False, num_threads: int | None = None, return_tensors: str | None = None,
                     device=None, pad_to_multiple_of: int | None = None) -> dict:
        """Encode a batch of texts (or pairs) into arrays, on all cores (or the GPU).

        Args:
            texts, text_pairs: lists of str; rows are ``[CLS] a [SEP] (b [SEP])``.
            max_length: row length limit for truncation and ``padding="max_length"``; ``None``
                means ``model_max_length`` (no limit if unset).
            truncation: True / "longest_first" (HF's: trim the longer of a pair), "only_first",
                "only_second", or False.
            padding: False (rows keep their lengths), True / "longest", or "max_length".
            return_offsets: add ``offsets``: (start, end) character positions into the original
                text, HF ``offset_mapping`` semantics ((0, 0) for special tokens and padding).
            num_threads: CPU threads (default: all cores).
            return_tensors: None or "np" (NumPy arrays), or "pt" (torch tensors).
            device: "cuda" (or a CUDA torch.device) tokenizes on the GPU and returns CUDA tensors.
            pad_to_multiple_of: round the padded width up to a multiple of this.

        Returns a dict with ``input_ids``, ``token_type_ids``, ``attention_mask`` (and ``offsets``):
        int64 arrays of shape (rows, width) (offsets (rows, width, 2)) when padding; with
        ``padding=False`` a list of one 1-D array per row, views of one buffer (``return_tensors``
        then needs rows of one length). Making those per-row views costs about as much as the
        tokenization itself: for corpora, ``encode_flat`` is the fast path.
        """
        if isinstance(texts, str):
            raise TypeError("encode_batch takes a list of texts; use encode() for one text")
        if return_tensors not in (None, "np", "pt"):
            raise ValueError(f"return_tensors must be None, 'np' or 'pt', got {return_tensors!r}")
        strategy = _truncation_strategy(truncation)
        if strategy == "only_second" and text_pairs is None:
            raise ValueError("truncation='only_second' needs text_pairs")
        max_length = self._resolve_max_length(max_length, strategy != "none", padding, pad_to_multiple_of)
        padding = _padding_mode(padding)
        if num_threads is not None and int(num_threads) < 1:
            raise ValueError(f"num_threads must be >= 1 (or None for all cores), got {num_threads}")
        cls_id = sep_id = -1
        if add_special_tokens:
            cls_id, sep_id = self.cls_token_id, self.sep_token_id
        pad_id = self.pad_token_id if padding != "none" else 0
        args = dict(add_special_tokens=bool(add_special_tokens), max_length=-1 if max_length is None else max_length,
                    truncation=strategy, padding=padding, pad_to_multiple_of=int(pad_to_multiple_of or 0),
                    return_offsets=bool(return_offsets), cls_id=cls_id, sep_id=sep_id, pad_id=pad_id)
        if device is not None and _is_cuda(device):
            enc = self._cuda_path().encode_batch(texts, text_pairs, device=device, **args)
            return _as_tensors(enc, return_tensors) if return_tensors is not None else enc
        if padding == "max_length" and strategy == "none" and max_length is not None:
            # HF keeps rows longer than max_length whole when truncation is off: pad the others.
            flat = self._core.encode_batch(texts, text_pairs, num_threads=int(num_threads or 0),
                                           **{**args, "padding": "none"})
            multiple = int(pad_to_multiple_of or 1)
            enc = _pad_flat(flat, -(-max_length // multiple) * multiple, args["pad_id"])
        else:
            enc = self._core.encode_batch(texts, text_pairs, num_threads=int(num_threads or 0), **args)
        if padding == "none":
            splits = enc.pop("row_splits")
            enc["attention_mask"] = np.ones(len(enc["input_ids"]), dtype=np.int64)
            bounds = list(zip(splits[:-1].tolist(), splits[1:].tolist()))
            enc = {key: [value[a:b] for a, b in bounds] for key, value in enc.items()}
        if return_tensors is not None:
            enc = _as_tensors(enc, return_tensors, device)
        return {key: enc[key] for key in ("input_ids", "token_type_ids", "attention_mask", "offsets") if key in enc}

    def encode_flat(self, texts: list[str], num_threads: int | None = None, device=None):
        """Token ids of every text back to back, without special tokens, and ``row_splits``
        (len(texts) + 1 int64): text i is ``ids[row_splits[i]:row_splits[i + 1]]``. The fastest path,
        for corpus preparation. NumPy (ids int32), or with ``device="cuda"`` torch tensors on the GPU
        (ids int64)."""
        if num_threads is not None and int(num_threads) < 1:
            raise ValueError(f"num_threads must be >= 1 (or None for all cores), got {num_threads}")
        if device is not None and _is_cuda(device):
            enc = self._cuda_path().encode_batch(
                texts, None, device=device, add_special_tokens=False, max_length=-1, truncation="none",
                padding="none", pad_to_multiple_of=0, return_offsets=False, cls_id=-1, sep_id=-1, pad_id=0,
                split_rows=False)
            return enc["input_ids"], enc["row_splits"]
        return self._core.encode_flat(texts, int(num_threads or 0))

    def _cuda_path(self):
        if self._cuda is None:
            from fastbert.tokenization._cuda import CudaWordPiece
            self._cuda = CudaWordPiece(self)
        return self._cuda

    def __call__(self, text, text_pair=None, add_special_tokens: bool = True, padding: bool | str = False,
                 truncation: bool | str | None = None, max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, return_tensors: str | None = None,
                 return_token_type_ids: bool = True, return_attention_mask: bool = True,
                 return_offsets_mapping: bool = False, return_special_tokens_mask: bool = False,
                 num_threads: int | None = None, device=None) -> dict:
        """Like HF ``tokenizer(text, text_pair, ...)``: a str gives lists, a list of str gives lists of
        lists (or, with ``return_tensors="np"/"pt"``, arrays / tensors). ``truncation=None``
        truncates only when ``max_length`` is given and padding is off (HF's default); offsets come as
        ``offset_mapping``; ``special_tokens_mask`` marks the [CLS] / [SEP] / padding this call added
        (a [MASK] or [UNK] from the text is 0, as HF)."""
        truncation = default_truncation(truncation, max_length, padding)
        batched = not isinstance(text, str)
        if batched:
            if text_pair is not None and isinstance(text_pair, str):
                raise TypeError("text is a list but text_pair is a str; pass a list of pairs")
            texts, pairs = text, text_pair
        else:
            texts, pairs = [text], None if text_pair is None else [text_pair]
        enc = self.encode_batch(texts, pairs, add_special_tokens, max_length, truncation, padding,
                                return_offsets_mapping, num_threads, None, device, pad_to_multiple_of)
        if return_offsets_mapping:
            enc["offset_mapping"] = enc.pop("offsets")
        if return_special_tokens_mask:
            mask, types, is_pair = enc["attention_mask"], enc["token_type_ids"], pairs is not None
            if isinstance(mask, list):  # one 1-D row each (no padding, or rows longer than max_length)
                enc["special_tokens_mask"] = [added_special_mask(m[None], t[None], add_special_tokens, is_pair)[0]
                                              for m, t in zip(mask, types)]
            else:
                enc["special_tokens_mask"] = added_special_mask(mask, types, add_special_tokens, is_pair)
        if not return_token_type_ids:
            del enc["token_type_ids"]
        if not return_attention_mask:
            del enc["attention_mask"]
        if return_tensors is not None:
            return _as_tensors(enc, return_tensors, device)
        out = {}
        for key, value in enc.items():
            rows = [_row_list(row, key) for row in value]
            out[key] = rows if batched else rows[0]
        return out

# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------

def added_special_mask(attention_mask, token_type_ids, add_special_tokens: bool, is_pair: bool):
    """HF's ``special_tokens_mask`` of right-padded rows ``(rows, width)`` (NumPy arrays or torch
    tensors): 1 at padding and, with ``add_special_tokens``, at the [CLS] and [SEP] that encoding
    added ([CLS] first, [SEP] last, and for a pair the [SEP] ending the first segment, the last
    token of type 0). A [MASK] or [UNK] that came from the text is 0."""
    real = attention_mask != 0
    special = ~real
    if add_special_tokens:
        pos = real.cumsum(-1)                    # 1-based position of each real token
        n_real = real.sum(-1)[..., None]
        special = special | (real & ((pos == 1) | (pos == n_real)))
        if is_pair:
            n_first = (real & (token_type_ids == 0)).sum(-1)[..., None]
            special = special | (real & (pos == n_first))
    return special * 1                           # int64, NumPy or torch


def _pad_flat(flat: dict, width: int, pad_id: int) -> dict:
    """A ``padding="none"`` encoding (ids back to back, ``row_splits``) with every row padded to
    ``width``: ``(rows, width)`` arrays, or, when a row is longer (HF's ``padding="max_length"``
    without truncation keeps it whole), a list of one 1-D array per row."""
    splits = flat.pop("row_splits")
    lengths = np.diff(splits)
    flat["attention_mask"] = np.ones(len(flat["input_ids"]), dtype=np.int64)
    fill = {"input_ids": pad_id, "token_type_ids": 0, "attention_mask": 0, "offsets": 0}
    if lengths.max(initial=0) <= width:
        rows = np.repeat(np.arange(len(lengths)), lengths)
        cols = np.arange(splits[-1]) - np.repeat(splits[:-1], lengths)
        out = {}
        for key, value in flat.items():
            out[key] = np.full((len(lengths), width) + value.shape[1:], fill[key], dtype=np.int64)
            out[key][rows, cols] = value
        return out
    out = {key: [] for key in flat}
    for start, end in zip(splits[:-1].tolist(), splits[1:].tolist()):
        pad = max(0, width - (end - start))
        for key, value in flat.items():
            out[key].append(np.concatenate([value[start:end], np.full((pad,) + value.shape[1:], fill[key])]))
    return out


def _to_list(ids) -> list:
    if hasattr(ids, "tolist"):  # numpy array / torch tensor
        return ids.tolist()
    return list(ids)


def _row_list(row, key: str) -> list:
    values = row.tolist()
    return [tuple(o) for o in values] if key == "offset_mapping" else values


def _truncation_strategy(truncation) -> str:
    try:
        return _TRUNCATION[truncation]
    except (KeyError, TypeError):
        raise ValueError(f"unknown truncation {truncation!r}; use True, False or one of "
                         f"'longest_first', 'only_first', 'only_second'") from None


def _padding_mode(padding) -> str:
    if padding is True or padding == "longest":
        return "longest"
    if padding is False or padding is None or padding == "do_not_pad":
        return "none"
    if padding == "max_length":
        return "max_length"
    raise ValueError(f"unknown padding {padding!r}; use False, True / 'longest' or 'max_length'")


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def _as_tensors(enc: dict, kind: str, device=None) -> dict:
    """NumPy arrays ("np") or torch tensors ("pt", moved to ``device``); rows of a ragged list must be
    of one length."""
    if kind not in ("np", "pt"):
        raise ValueError(f"return_tensors must be None, 'np' or 'pt', got {kind!r}")
    out = {}
    for key, value in enc.items():
        if isinstance(value, list):
            if len({len(row) for row in value}) > 1:
                raise ValueError(f"return_tensors={kind!r} needs rows of equal length; pass padding=True "
                                 f"or padding='max_length'")
            if value and hasattr(value[0], "cpu"):  # torch tensors from the GPU path
                import torch
                value = torch.stack(value)
            else:
                value = np.stack(value) if value else np.zeros((0, 0), dtype=np.int64)
        if hasattr(value, "cpu"):  # a torch tensor
            out[key] = value.cpu().numpy() if kind == "np" else value
            continue
        if kind == "pt":
            import torch
            value = torch.from_numpy(value)
            if device is not None:
                value = value.to(device)
        out[key] = value
    return out


__all__ = ["WordPieceTokenizer"]
