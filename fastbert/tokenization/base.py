"""``TokenizerBase``: what the C++ ``WordPieceTokenizer`` and the pure-Python ``ReferenceTokenizer``
share, word for word: the HF-style front end (``__call__``, ``encode``, and the call options as HF
resolves them: truncation strategy, padding mode, row length limit, padded width, tensors), the
vocabulary and its file, HF checkpoint loading / saving, special tokens, id <-> token conversion and
decoding. An engine provides ``tokenize`` and ``encode_batch``: how rows are encoded.

``SPECIAL_TOKEN_NAMES`` and ``load_vocab`` live here so that this module needs neither subclass;
``fastbert.tokenization.reference`` re-exports both (other modules import them from there).
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKEN_NAMES = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TRUNCATION_STRATEGIES = ("longest_first", "only_first", "only_second")
# HF writes model_max_length = int(1e30) when a checkpoint sets no limit.
_NO_LIMIT = 10**12
# HF's WordPiece decoder clean-up, applied to each (space-prefixed) token.
_DECODE_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                   (" 'm", "'m"), (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def load_vocab(path: str | Path) -> list[str]:
    """Tokens of a vocab.txt, one per line, id = line number. Lines end at "\\n" only (the Chinese
    vocabulary holds a U+2028 token, which str.splitlines would split)."""
    path = Path(path)
    if path.is_dir():
        path = path / "vocab.txt"
    if not path.is_file():
        raise FileNotFoundError(
            f"vocab file not found: {path}. Pass a BERT vocab.txt (one token per line) or a checkpoint "
            f"directory that holds one; `fastbert vocab --corpus FILES --out vocab.txt` trains one.")
    try:
        with open(path, encoding="utf-8") as f:
            tokens = [line.rstrip("\n") for line in f]
    except UnicodeDecodeError as e:
        raise ValueError(f"vocab file {path} is not UTF-8 ({e}); re-save it as UTF-8, one token per line") from None
    if not tokens:
        raise ValueError(f"vocab file {path} is empty; it needs one token per line, including [UNK]")
    return tokens


def cleanup_token(token: str) -> str:
    """HF's WordPiece decoder clean-up of one (space-prefixed) token: " ." -> ".", " n't" -> "n't", ..."""
    for dirty, clean in _DECODE_CLEANUP:
        token = token.replace(dirty, clean)
    return token


def default_truncation(truncation, max_length: int | None, padding):
    """HF's ``truncation=None``: truncate (longest first) only when ``max_length`` is given and
    ``padding`` is off; with padding on, ``max_length`` is then a padding length only."""
    if truncation is None:
        return max_length is not None and (padding is False or padding is None)
    return truncation


def truncation_strategy(truncation) -> str:
    """HF's ``truncation`` argument as one spelling: "longest_first" (True), "only_first",
    "only_second", or "none" (False, None, "do_not_truncate")."""
    if truncation is True:
        return "longest_first"
    if truncation is False or truncation is None or truncation == "do_not_truncate":
        return "none"
    if truncation in TRUNCATION_STRATEGIES:
        return truncation
    raise ValueError(f"unknown truncation {truncation!r}; use True, False or one of "
                     f"'longest_first', 'only_first', 'only_second'")


def padding_mode(padding) -> str:
    """HF's ``padding`` argument as one spelling: "longest" (True), "max_length", or "none"
    (False, None, "do_not_pad")."""
    if padding is True or padding == "longest":
        return "longest"
    if padding is False or padding is None or padding == "do_not_pad":
        return "none"
    if padding == "max_length":
        return "max_length"
    raise ValueError(f"unknown padding {padding!r}; use False, True / 'longest' or 'max_length'")


def padded_width(longest: int, padding: str, max_length: int | None, pad_to_multiple_of: int | None) -> int | None:
    """The width rows are padded to (``padding`` as ``padding_mode`` spells it), or None when padding is
    off: the longest row, or ``max_length`` (rows longer than it, when not truncated, stay as they are,
    as HF), rounded up to a multiple of ``pad_to_multiple_of``."""
    if padding == "none":
        return None
    width = max_length if padding == "max_length" else longest
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    return width


def as_tensors(enc: dict, kind: str, device=None) -> dict:
    """``enc`` (rows as arrays, tensors or lists) as int64 NumPy arrays ("np") or torch tensors ("pt",
    moved to ``device``); the rows of a ragged list must be of one length."""
    import numpy as np
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
                value = np.asarray(value, dtype=np.int64) if value else np.zeros((0, 0), dtype=np.int64)
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


def row_list(row, key: str) -> list:
    """One encoded row (array, tensor or list) as a Python list; offsets as (start, end) tuples."""
    values = row.tolist() if hasattr(row, "tolist") else list(row)
    return [tuple(o) for o in values] if key in ("offsets", "offset_mapping") else values


def to_id_list(ids) -> list:
    """``ids`` (a list, NumPy array or torch tensor; a bare int becomes [int]) as a Python list."""
    if hasattr(ids, "tolist"):  # numpy array / torch tensor
        ids = ids.tolist()
    return [ids] if isinstance(ids, int) else list(ids)


class TokenizerBase:
    """Shared part of the BERT WordPiece tokenizers. A subclass's ``__init__`` calls
    ``_init_vocab`` and ``_init_special_tokens`` (in that order, its own checks between them)."""

    # How decode / batch_decode turn their argument into a list; a subclass may be stricter.
    _id_list = staticmethod(to_id_list)

    def _init_vocab(self, vocab_path: str | Path, lowercase: bool, strip_accents: bool | None,
                    tokenize_chinese_chars: bool) -> list[str]:
        """Load the vocabulary file and keep the normalization options; returns the tokens."""
        self.vocab_path = Path(vocab_path)
        tokens = load_vocab(vocab_path)
        self.ids_to_tokens: list[str] = tokens
        self.vocab: dict[str, int] = {tok: i for i, tok in enumerate(tokens)}  # a repeated line: last id wins, as HF
        self.lowercase = bool(lowercase)
        self.strip_accents = strip_accents
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        return tokens

    def _init_special_tokens(self, model_max_length: int | None, unk_token: str, sep_token: str, pad_token: str,
                             cls_token: str, mask_token: str) -> None:
        """Keep ``model_max_length`` and the special tokens; the vocabulary must hold ``unk_token``."""
        self.model_max_length = (None if model_max_length is None or model_max_length >= _NO_LIMIT
                                 else int(model_max_length))
        self.unk_token, self.sep_token, self.pad_token = unk_token, sep_token, pad_token
        self.cls_token, self.mask_token = cls_token, mask_token
        if unk_token not in self.vocab:
            raise ValueError(
                f"vocab file {self.vocab_path} has no unknown token {unk_token!r}. Add a line {unk_token} "
                f"(BERT vocabularies have it at id 100) or pass unk_token= the token your vocabulary uses.")

    # -- HF checkpoint directories -----------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, directory: str | Path, **kwargs):
        """Load vocab.txt and tokenizer_config.json (do_lower_case, strip_accents,
        tokenize_chinese_chars, model_max_length, special tokens) of an HF checkpoint directory.
        Keyword arguments override the file."""
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {directory}; pass a directory with vocab.txt "
                                    f"(and optionally tokenizer_config.json), or a vocab.txt to {cls.__name__}()")
        options: dict = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{config_path} is not valid JSON ({e}); fix or delete it") from None
            if "do_lower_case" in config:
                options["lowercase"] = bool(config["do_lower_case"])
            for key in ("strip_accents", "tokenize_chinese_chars", "model_max_length", "max_input_chars_per_word"):
                if config.get(key) is not None:
                    options[key] = config[key]
            for key in SPECIAL_TOKEN_NAMES:
                value = config.get(key)
                if isinstance(value, dict):  # serialized AddedToken
                    value = value.get("content")
                if isinstance(value, str):
                    options[key] = value
        options.update(kwargs)
        return cls(directory / "vocab.txt", **options)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write vocab.txt and tokenizer_config.json (atomically) so that from_pretrained, and HF, load them."""
        from fastbert.io import atomic_write_text
        directory = Path(directory)
        atomic_write_text(directory / "vocab.txt", "".join(t + "\n" for t in self.ids_to_tokens))
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": self.lowercase,
                  "strip_accents": self.strip_accents, "tokenize_chinese_chars": self.tokenize_chinese_chars,
                  "max_input_chars_per_word": self.max_input_chars_per_word,
                  **{name: getattr(self, name) for name in SPECIAL_TOKEN_NAMES}}
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")

    # -- vocabulary and special tokens -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.ids_to_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.ids_to_tokens)

    def _special_id(self, name: str) -> int:
        token = getattr(self, name)
        idx = self.vocab.get(token)
        if idx is None:
            raise ValueError(f"vocab file {self.vocab_path} has no {token!r} token ({name}), which this call needs. "
                             f"Add it to the vocabulary (BERT: [PAD]=0, [UNK]=100, [CLS]=101, [SEP]=102, "
                             f"[MASK]=103) or pass {name}= the token your vocabulary uses.")
        return idx

    unk_token_id = property(lambda self: self._special_id("unk_token"))
    sep_token_id = property(lambda self: self._special_id("sep_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    cls_token_id = property(lambda self: self._special_id("cls_token"))
    mask_token_id = property(lambda self: self._special_id("mask_token"))

    @property
    def all_special_tokens(self) -> list[str]:
        return [getattr(self, name) for name in SPECIAL_TOKEN_NAMES]

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special tokens present in the vocabulary."""
        return [self.vocab[t] for t in self.all_special_tokens if t in self.vocab]

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens: bool = False
                                ) -> list[int]:
        """HF's ``get_special_tokens_mask``. Ids without special tokens (``already_has_special_tokens=False``):
        the mask of the row that adding [CLS]/[SEP] would build, ``[1] + [0] * len(a) + [1]``
        (``+ [0] * len(b) + [1]`` for a pair). Ids that already hold them: 1 where an id is a special
        token's ([CLS], [SEP], [PAD], [MASK], [UNK]), as HF's data collators compute it."""
        if already_has_special_tokens:
            if token_ids_1 is not None:
                raise ValueError("token_ids_1 must be None when already_has_special_tokens=True: the ids "
                                 "already form one row with its special tokens")
            special = set(self.all_special_ids)
            return [int(i in special) for i in to_id_list(token_ids_0)]
        mask = [1] + [0] * len(to_id_list(token_ids_0)) + [1]
        if token_ids_1 is not None:
            mask += [0] * len(to_id_list(token_ids_1)) + [1]
        return mask

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        """Id of each token; tokens not in the vocabulary give the [UNK] id."""
        unk = self.unk_token_id
        if isinstance(tokens, str):
            return self.vocab.get(tokens, unk)
        return [self.vocab.get(t, unk) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False) -> str | list[str]:
        # A NumPy integer scalar or 0-d array / tensor has ndim == 0: one token, as for an int.
        if isinstance(ids, int) or (hasattr(ids, "ndim") and ids.ndim == 0):
            return self.ids_to_tokens[self._check_id(int(ids))]
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self.ids_to_tokens[self._check_id(i)] for i in to_id_list(ids) if i not in special]

    def _check_id(self, i: int) -> int:
        if not 0 <= i < len(self.ids_to_tokens):
            raise ValueError(f"token id {i} is out of range for the vocabulary of {len(self.ids_to_tokens)} tokens "
                             f"({self.vocab_path}); were the ids made with another vocabulary?")
        return i

    # -- the HF-style front end ---------------------------------------------------------------------

    def __call__(self, text, text_pair=None, add_special_tokens: bool = True, padding: bool | str = False,
                 truncation: bool | str | None = None, max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, return_tensors: str | None = None,
                 return_token_type_ids: bool = True, return_attention_mask: bool = True,
                 return_offsets_mapping: bool = False, return_special_tokens_mask: bool = False,
                 **engine_options) -> dict:
        """Like HF ``tokenizer(text, text_pair, ...)``: a str gives lists, a list of str gives lists of
        lists, ``return_tensors="np"/"pt"`` arrays / tensors of shape (rows, width). ``truncation=None``
        truncates only when ``max_length`` is given and padding is off (HF's default); offsets come as
        ``offset_mapping``; ``special_tokens_mask`` marks the [CLS] / [SEP] / padding this call added
        (a [MASK] or [UNK] from the text is 0, as HF). ``engine_options`` go to ``encode_batch``
        (``WordPieceTokenizer``: ``num_threads``, ``device``)."""
        truncation = default_truncation(truncation, max_length, padding)
        batched = not isinstance(text, str)
        if batched:
            if text_pair is not None and isinstance(text_pair, str):
                raise TypeError("text is a list but text_pair is a str; pass a list of pairs")
            texts, pairs = text, text_pair
        else:
            texts, pairs = [text], None if text_pair is None else [text_pair]
        enc = self.encode_batch(texts, pairs, add_special_tokens, max_length, truncation, padding,
                                return_offsets=return_offsets_mapping, pad_to_multiple_of=pad_to_multiple_of,
                                return_special_tokens_mask=return_special_tokens_mask, **engine_options)
        if return_offsets_mapping:
            enc["offset_mapping"] = enc.pop("offsets")
        if not return_token_type_ids:
            del enc["token_type_ids"]
        if not return_attention_mask:
            del enc["attention_mask"]
        if return_tensors is not None:
            return as_tensors(enc, return_tensors, engine_options.get("device"))
        out = {}
        for key, value in enc.items():
            rows = [row_list(row, key) for row in value]
            out[key] = rows if batched else rows[0]
        return out

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True,
               max_length: int | None = None, truncation: bool | str = True, padding: bool | str = False,
               return_offsets: bool = False, pad_to_multiple_of: int | None = None,
               return_special_tokens_mask: bool = False) -> dict:
        """Encode one text (or pair) as ``[CLS] a [SEP] (b [SEP])``.

        Returns a dict of lists: ``input_ids``, ``token_type_ids``, ``attention_mask``; with
        ``return_offsets``, ``offsets``: (start, end) character positions in the original text of
        each token, (0, 0) for [CLS]/[SEP]/padding; with ``return_special_tokens_mask``,
        ``special_tokens_mask``: 1 at the [CLS]/[SEP]/padding that encoding added (HF's: a [MASK]
        or [UNK] from the text is 0). Options as ``encode_batch``.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}; use encode_batch() for a list")
        if text_pair is not None and not isinstance(text_pair, str):
            raise TypeError(f"text_pair must be a str, got {type(text_pair).__name__}")
        enc = self.encode_batch([text], None if text_pair is None else [text_pair], add_special_tokens, max_length,
                                truncation, padding, return_offsets=return_offsets,
                                pad_to_multiple_of=pad_to_multiple_of,
                                return_special_tokens_mask=return_special_tokens_mask)
        return {key: row_list(value[0], key) for key, value in enc.items()}

    # -- call options --------------------------------------------------------------------------------

    def _batch_options(self, texts, text_pairs, max_length: int | None, truncation, padding,
                       pad_to_multiple_of: int | None) -> tuple[str, int | None, str]:
        """Check one ``encode_batch`` call's arguments and resolve them as HF does: ``(truncation
        strategy, row length limit, padding mode)``, spelled as ``truncation_strategy`` and
        ``padding_mode`` spell them."""
        if isinstance(texts, str):
            raise TypeError("encode_batch takes a list of texts; use encode() for one text")
        strategy, mode = truncation_strategy(truncation), padding_mode(padding)
        if strategy == "only_second" and text_pairs is None:
            raise ValueError("truncation='only_second' needs text_pairs")
        max_length = self._resolve_max_length(max_length, strategy != "none", padding, pad_to_multiple_of)
        return strategy, max_length, mode

    def _resolve_max_length(self, max_length: int | None, truncating: bool, padding,
                            pad_to_multiple_of: int | None) -> int | None:
        """The row length limit of one call, as HF resolves it: ``model_max_length`` when ``max_length``
        is None and the call truncates or pads to ``"max_length"``. Raises HF's errors: padding to
        ``"max_length"`` with no length, a negative length, and truncating and padding to a length that
        is not a multiple of ``pad_to_multiple_of`` (the padded rows would be longer than the limit)."""
        if max_length is None and (truncating or padding == "max_length"):
            max_length = self.model_max_length
        if padding == "max_length" and max_length is None:
            raise ValueError("padding='max_length' needs max_length (or a tokenizer with model_max_length)")
        if max_length is not None and max_length < 0:
            raise ValueError(f"max_length must be >= 0, got {max_length}")
        if pad_to_multiple_of is not None and int(pad_to_multiple_of) < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        pads = padding not in (False, None, "do_not_pad")
        if truncating and pads and pad_to_multiple_of and max_length is not None and max_length % pad_to_multiple_of:
            raise ValueError(f"Truncation and padding are both activated but truncation length ({max_length}) is not "
                             f"a multiple of pad_to_multiple_of ({pad_to_multiple_of}).")
        return max_length

    # -- decoding ----------------------------------------------------------------------------------

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``: pieces joined by spaces, "##" continuations glued on, and HF's per-token
        clean-up (" ." -> ".", " ," -> ",", " n't" -> "n't", ...)."""
        tokens = self.convert_ids_to_tokens(self._id_list(ids), skip_special_tokens=skip_special_tokens)
        parts = []
        for i, tok in enumerate(tokens):
            if i > 0:
                tok = tok[2:] if tok.startswith("##") else " " + tok
            parts.append(cleanup_token(tok))
        return "".join(parts)

    def batch_decode(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in self._id_list(sequences)]


__all__ = ["TokenizerBase", "SPECIAL_TOKEN_NAMES", "TRUNCATION_STRATEGIES", "load_vocab", "cleanup_token",
           "default_truncation", "truncation_strategy", "padding_mode", "padded_width", "as_tensors", "row_list",
           "to_id_list"]
