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

from fastbert.tokenization.base import TokenizerBase, as_tensors, padded_width


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

    # -- encoding (__call__ and encode: TokenizerBase) -------------------------------------------

    def tokenize(self, text: str) -> list[str]:
        """WordPiece tokens of ``text`` (no [CLS]/[SEP])."""
        ids, _ = self._core.encode(text)
        return [self.ids_to_tokens[i] for i in ids.tolist()]

    def encode_batch(self, texts: list[str], text_pairs: list[str] | None = None, add_special_tokens: bool = True,
                     max_length: int | None = None, truncation: bool | str = True, padding: bool | str = False,
                     return_offsets: bool = False, num_threads: int | None = None, return_tensors: str | None = None,
                     device=None, pad_to_multiple_of: int | None = None,
                     return_special_tokens_mask: bool = False) -> dict:
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
            return_special_tokens_mask: add ``special_tokens_mask``, 1 at the [CLS] / [SEP] / padding
                that encoding added (a [MASK] or [UNK] from the text is 0, as HF).

        Returns a dict with ``input_ids``, ``token_type_ids``, ``attention_mask`` (and ``offsets``):
        int64 arrays of shape (rows, width) (offsets (rows, width, 2)) when padding; with
        ``padding=False`` a list of one 1-D array per row, views of one buffer (``return_tensors``
        then needs rows of one length). Making those per-row views costs about as much as the
        tokenization itself: for corpora, ``encode_flat`` is the fast path.
        """
        strategy, max_length, padding = self._batch_options(texts, text_pairs, max_length, truncation, padding,
                                                            pad_to_multiple_of)
        if return_tensors not in (None, "np", "pt"):
            raise ValueError(f"return_tensors must be None, 'np' or 'pt', got {return_tensors!r}")
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
        elif padding == "max_length" and strategy == "none" and max_length is not None:
            # HF keeps rows longer than max_length whole when truncation is off: pad the others.
            flat = self._core.encode_batch(texts, text_pairs, num_threads=int(num_threads or 0),
                                           **{**args, "padding": "none"})
            enc = _pad_flat(flat, padded_width(0, padding, max_length, pad_to_multiple_of), args["pad_id"])
        else:
            enc = self._core.encode_batch(texts, text_pairs, num_threads=int(num_threads or 0), **args)
            if padding == "none":
                splits = enc.pop("row_splits")
                enc["attention_mask"] = np.ones(len(enc["input_ids"]), dtype=np.int64)
                bounds = list(zip(splits[:-1].tolist(), splits[1:].tolist()))
                enc = {key: [value[a:b] for a, b in bounds] for key, value in enc.items()}
        if return_special_tokens_mask:
            mask, types, is_pair = enc["attention_mask"], enc["token_type_ids"], text_pairs is not None
            if isinstance(mask, list):  # one 1-D row each (no padding, or rows longer than max_length)
                enc["special_tokens_mask"] = [added_special_mask(m[None], t[None], add_special_tokens, is_pair)[0]
                                              for m, t in zip(mask, types)]
            else:
                enc["special_tokens_mask"] = added_special_mask(mask, types, add_special_tokens, is_pair)
        if return_tensors is not None:
            enc = as_tensors(enc, return_tensors, device)
        keys = ("input_ids", "token_type_ids", "attention_mask", "offsets", "special_tokens_mask")
        return {key: enc[key] for key in keys if key in enc}

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


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


__all__ = ["WordPieceTokenizer"]
