"""The batched GPU path of ``WordPieceTokenizer.encode_batch(..., device="cuda")``.

The whole pipeline runs on the device, as data-parallel kernels (csrc/cuda/wordpiece_kernels.h)
chained with torch scans:

    texts (Python's string storage, packed on the host, one H2D copy)
      -> count_chars / cumsum / write_chars   normalized UTF-8 bytes + original index + class per byte
      -> word_starts / nonzero                 one entry per word
      -> word_tokens (count) / cumsum / word_tokens (write)   WordPiece (LinMaxMatch) per word
      -> token counts per text -> HF truncation (host, tiny) -> assemble   padded or flat rows

Results equal the CPU path's exactly. ``emulate=True`` runs the same kernels as CPU loops
(fastbert._wordpiece.gpu_emulation) on CPU tensors: that is how CI tests this file without a GPU.
"""
from __future__ import annotations

import numpy as np

from fastbert.tokenization.base import padded_width

NO_ERROR = np.iinfo(np.int64).max
MAX_CHARS = 2**31 - 1  # original character indices are int32 on the device


def cuda_module():
    """fastbert._wordpiece_cuda, or a RuntimeError saying why it is missing."""
    try:
        from fastbert import _wordpiece_cuda
        return _wordpiece_cuda
    except ImportError as e:
        import torch
        reason = ("this torch has no CUDA (" + torch.__version__ + ")" if torch.version.cuda is None
                  else f"it was not built ({e})")
        raise RuntimeError(
            "the CUDA tokenizer (fastbert._wordpiece_cuda) is not available: " + reason + ". It is built by "
            "`pip install --no-build-isolation -e .` when nvcc and a CUDA build of torch are present; "
            "otherwise call encode_batch without device= (CPU, all cores)") from None


class _Ops:
    """Kernel launcher: CUDA tensors to fastbert._wordpiece_cuda on the current torch stream, or CPU tensors
    (as NumPy arrays) to the emulation."""

    def __init__(self, module, emulate: bool):
        self.module, self.emulate = module, emulate
        self.stream = 0  # set per batch: torch.cuda.current_stream(device).cuda_stream

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        if self.emulate:
            return lambda tensors, scalars: fn({k: v.numpy() for k, v in tensors.items()}, scalars)
        return lambda tensors, scalars: fn(tensors, dict(scalars, stream=self.stream))


class CudaWordPiece:
    """Device-resident tables of one WordPieceTokenizer and the batched encode."""

    def __init__(self, tokenizer, emulate: bool = False):
        import torch

        self.tokenizer = tokenizer
        self.emulate = emulate
        if emulate:
            from fastbert import _wordpiece
            self.ops = _Ops(_wordpiece.gpu_emulation, True)
        else:
            self.ops = _Ops(cuda_module(), False)
            if not torch.cuda.is_available():
                raise RuntimeError("device='cuda' asked for, but torch sees no CUDA device")
        tables = tokenizer._core.tables()
        self._host = {}
        for name, value in tables.items():
            if isinstance(value, np.ndarray):  # unsigned tables travel as signed views of the same width
                value = value.view({np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32}.get(value.dtype,
                                                                                                      value.dtype))
                self._host[name] = torch.from_numpy(np.ascontiguousarray(value))
        specials = sorted(((t, tokenizer.vocab[t]) for t in dict.fromkeys(tokenizer.all_special_tokens)
                           if t and t in tokenizer.vocab), key=lambda x: -len(x[0]))
        self._check_specials([t for t, _ in specials])
        chars = [ord(c) for t, _ in specials for c in t]
        self._host["special_chars"] = torch.tensor(chars or [0], dtype=torch.int32)
        self._host["special_offsets"] = torch.tensor(np.cumsum([0] + [len(t) for t, _ in specials]), dtype=torch.int32)
        self._host["special_ids"] = torch.tensor([i for _, i in specials] or [0], dtype=torch.int32)
        self.scalars = {"n_dec": len(tables["dec_cp"]), "n_ccc": len(tables["ccc_lo"]), "root": tables["root"],
                        "suffix_root": tables["suffix_root"], "n_specials": len(specials),
                        "special_max_len": max((len(t) for t, _ in specials), default=0),
                        "max_chars": tokenizer.max_input_chars_per_word, "unk_id": tokenizer.unk_token_id}
        self._tables = {}  # per device

    @staticmethod
    def _check_specials(tokens):
        # The kernels find special tokens at every position independently, which equals the CPU's
        # left-to-right scan only if no two occurrences can overlap.
        for a in tokens:
            for b in tokens:
                if any(a[k:] == b[:len(a) - k] for k in range(1, len(a)) if len(b) >= len(a) - k) or \
                        (a != b and b in a[1:]):
                    raise ValueError(f"special tokens {a!r} and {b!r} can overlap in a text; the GPU path "
                                     f"supports only non-overlapping special tokens (use the CPU path)")

    def tables(self, device):
        key = str(device)
        if key not in self._tables:
            self._tables[key] = {k: v.to(device) for k, v in self._host.items()}
        return self._tables[key]

    def encode_batch(self, texts, text_pairs, device, add_special_tokens, max_length, truncation, padding,
                     pad_to_multiple_of, return_offsets, cls_id, sep_id, pad_id, split_rows: bool = True) -> dict:
        """Arguments as fastbert._wordpiece.WordPieceCore.encode_batch. Padded: (rows, width) tensors. Not padded:
        lists of per-row views, or with split_rows=False flat tensors plus ``row_splits``."""
        import torch

        from fastbert import _wordpiece

        device = torch.device("cpu") if self.emulate else torch.device(device)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self.ops.stream = torch.cuda.current_stream(device).cuda_stream
        if isinstance(texts, str):
            raise TypeError("encode_batch takes a list of texts; use encode() for one text")
        texts = list(texts)
        pairs = None if text_pairs is None else list(text_pairs)
        rows = len(texts)
        seg_byte, seg_kind, seg_char, total_bytes = _wordpiece.text_layout(texts, pairs)
        n_chars, n_segs = int(seg_char[-1]), len(seg_kind)
        if n_chars > MAX_CHARS:
            raise ValueError(f"a GPU batch holds at most {MAX_CHARS} characters ({n_chars} given); split the batch")
        pin = device.type == "cuda"
        host = torch.empty(max(total_bytes, 1), dtype=torch.uint8, pin_memory=pin)
        _wordpiece.pack_texts(texts, pairs, host.numpy(), seg_byte)

        def put(array):
            return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=pin)

        t = dict(self.tables(device))
        t.update(text=host.to(device, non_blocking=pin), seg_byte=put(seg_byte), seg_kind=put(seg_kind),
                 seg_char=put(seg_char))
        # Segment of each character: +1 where a segment starts, then a running sum.
        starts = torch.zeros(n_chars + 1, dtype=torch.int32, device=device)
        starts.index_add_(0, t["seg_char"][1:n_segs], torch.ones(max(n_segs - 1, 0), dtype=torch.int32, device=device))
        t["char_seg"] = torch.cumsum(starts[:n_chars], 0, dtype=torch.int32)
        s = dict(self.scalars, n_chars=n_chars)

        t["out_bytes"] = torch.empty(n_chars, dtype=torch.int32, device=device)
        t["error"] = torch.full((1,), NO_ERROR, dtype=torch.int64, device=device)
        self.ops.count_chars(t, s)
        byte_end = torch.cumsum(t["out_bytes"], 0, dtype=torch.int64)
        n_bytes = int(byte_end[-1]) if n_chars else 0
        t["byte_pos"] = byte_end - t["out_bytes"]
        t["bytes"] = torch.empty(n_bytes, dtype=torch.uint8, device=device)
        t["orig"] = torch.empty(n_bytes, dtype=torch.int32, device=device)
        t["flags"] = torch.empty(n_bytes, dtype=torch.uint8, device=device)
        self.ops.write_chars(t, s)
        s["n_bytes"] = n_bytes
        t["is_start"] = torch.empty(n_bytes, dtype=torch.uint8, device=device)
        self.ops.word_starts(t, s)
        t["word_start"] = torch.nonzero(t["is_start"]).flatten()
        n_words = t["word_start"].numel()
        s["n_words"] = n_words
        t["tok_count"] = torch.empty(n_words, dtype=torch.int32, device=device)
        t["word_seg"] = torch.empty(n_words, dtype=torch.int32, device=device)
        t["overflow"] = torch.full((1,), NO_ERROR, dtype=torch.int64, device=device)
        self.ops.word_tokens(t, dict(s, mode=0))
        tok_end = torch.cumsum(t["tok_count"], 0, dtype=torch.int64)
        n_tokens = int(tok_end[-1]) if n_words else 0
        t["tok_pos"] = tok_end - t["tok_count"]
        for name in ("tok_id", "tok_begin", "tok_end"):
            t[name] = torch.empty(max(n_tokens, 1), dtype=torch.int32, device=device)
        self.ops.word_tokens(t, dict(s, mode=1))
        seg_count = torch.zeros(n_segs, dtype=torch.int64, device=device)
        seg_count.index_add_(0, t["word_seg"].long(), t["tok_count"].long())
        t["seg_tok_start"] = torch.zeros(n_segs + 1, dtype=torch.int64, device=device)
        t["seg_tok_start"][1:] = torch.cumsum(seg_count, 0)

        error = int(t["error"].item())
        if error != NO_ERROR:
            self._raise_surrogate(error, seg_char, texts, pairs)
        if int(t["overflow"].item()) != NO_ERROR:  # > 64 marks in one run of one word: rare; CPU it is
            cpu = self.tokenizer.encode_batch(texts, pairs, add_special_tokens, None if max_length < 0 else max_length,
                                              False if truncation == "none" else truncation,
                                              False if padding == "none" else padding, return_offsets,
                                              pad_to_multiple_of=pad_to_multiple_of or None)
            return {k: (torch.from_numpy(v).to(device) if isinstance(v, np.ndarray)
                        else [torch.from_numpy(x).to(device) for x in v]) for k, v in cpu.items()}

        len_a, len_b, total = _wordpiece.row_layout(seg_count.cpu().numpy(), rows, pairs is not None,
                                                    add_special_tokens, max_length, truncation)
        longest = int(total.max()) if rows else 0
        flat = padding == "none"
        if padding == "max_length":
            too_long = np.flatnonzero(total > max_length)
            if too_long.size:
                r = int(too_long[0])
                raise ValueError(f"row {r} has {int(total[r])} tokens, more than max_length={max_length} (truncation "
                                 f"is off), so the rows cannot form one array; pass truncation=True or "
                                 f"padding='longest'")
        width = longest if flat else padded_width(longest, padding, max_length, pad_to_multiple_of)
        row_offset = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(total, out=row_offset[1:])
        size = int(row_offset[-1]) if flat else rows * width
        t.update(len_a=put(len_a), len_b=put(len_b), total=put(total), row_offset=put(row_offset))
        t["ids"] = torch.empty(size, dtype=torch.int64, device=device)
        t["types"] = torch.empty(size, dtype=torch.int64, device=device)
        t["mask"] = torch.empty(0 if flat else size, dtype=torch.int64, device=device)
        t["offsets"] = torch.empty(2 * size if return_offsets else 0, dtype=torch.int64, device=device)
        self.ops.assemble(t, {"flat": int(flat), "with_offsets": int(return_offsets), "rows": rows, "width": width,
                              "add_special": int(add_special_tokens), "cls_id": cls_id, "sep_id": sep_id,
                              "pad_id": pad_id})
        out = {"input_ids": t["ids"], "token_type_ids": t["types"]}
        if flat:
            out["attention_mask"] = torch.ones(size, dtype=torch.int64, device=device)
            if return_offsets:
                out["offsets"] = t["offsets"].view(size, 2)
            if not split_rows:
                return dict(out, row_splits=put(row_offset))
            lengths = total.tolist()
            return {k: list(torch.split(v, lengths)) for k, v in out.items()}
        out = {k: v.view(rows, width) for k, v in out.items()}
        out["attention_mask"] = t["mask"].view(rows, width)
        if return_offsets:
            out["offsets"] = t["offsets"].view(rows, width, 2)
        return out

    @staticmethod
    def _raise_surrogate(g: int, seg_char, texts, pairs):
        s = int(np.searchsorted(seg_char, g, side="right")) - 1
        which, index = ("texts", s) if s < len(texts) else ("text_pairs", s - len(texts))
        text = texts[index] if which == "texts" else pairs[index]
        position = g - int(seg_char[s])
        raise ValueError(f"{which}[{index}] contains a lone surrogate U+{ord(text[position]):04X} at character "
                         f"{position}: it has no UTF-8 form, so it cannot be tokenized (HF raises too). Repair the "
                         f"text, e.g. s.encode('utf-16', 'surrogatepass').decode('utf-16', 'replace')")
