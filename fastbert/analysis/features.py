"""Feature extraction (BERT's feature-based approach): hidden states of chosen layers per token, or
pooled per input.

Layers are numbered as HF's ``output_hidden_states``: 0 is the embedding output, ``1..L`` the
encoder layers, so ``last`` is ``L``. Combinations follow Devlin et al. (2019, Table 7):
``sum-last-4`` adds layers ``L-3..L``; ``concat-last-4`` concatenates them (last layer first, as
Google's extract_features.py lists them) giving ``4 x hidden`` features.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from fastbert.model import mean_pool
from fastbert.tasks.base import as_list

LAYER_SPECS = ("last", "second-to-last", "sum-last-4", "concat-last-4")
POOLING = ("none", "mean", "cls")


def parse_layers(spec: str, num_layers: int) -> tuple[list[int], str]:
    """``(hidden-state indices, "sum" | "concat" | "one")`` for a ``--layers`` value."""
    spec = str(spec).strip().lower()
    if spec == "last":
        return [num_layers], "one"
    if spec == "second-to-last":
        return [num_layers - 1], "one"
    if spec in ("sum-last-4", "concat-last-4"):
        if num_layers < 4:
            raise ValueError(f"--layers {spec} needs at least 4 layers; this model has {num_layers}")
        return [num_layers - i for i in range(4)], spec.split("-")[0]
    try:
        n = int(spec)
    except ValueError:
        raise ValueError(f"--layers {spec!r} is not valid; use {', '.join(LAYER_SPECS)} or a layer number "
                         f"0..{num_layers} (0 = embeddings, negative counts from the end)") from None
    if n < 0:
        n += num_layers + 1
    if not 0 <= n <= num_layers:
        raise ValueError(f"--layers {spec}: this model has layers 0..{num_layers} (0 = embeddings)")
    return [n], "one"


def combine_layers(hidden_states: Sequence[torch.Tensor], spec: str) -> torch.Tensor:
    """``(B, S, D)`` features from HF-style ``hidden_states`` (``num_layers + 1`` of ``(B, S, H)``)."""
    idx, how = parse_layers(spec, len(hidden_states) - 1)
    chosen = [hidden_states[i] for i in idx]
    if how == "sum":
        return torch.stack(chosen).sum(0)
    if how == "concat":
        return torch.cat(chosen, dim=-1)
    return chosen[0]


def pool(features: torch.Tensor, attention_mask: torch.Tensor, how: str) -> torch.Tensor:
    if how == "mean":
        return mean_pool(features, attention_mask)
    if how == "cls":
        return features[:, 0]
    if how == "none":
        return features
    raise ValueError(f"--pool {how!r} is not valid; use one of {POOLING}")


@torch.no_grad()
def extract_features(model, tokenizer, texts: Sequence[str], pairs: Optional[Sequence[Optional[str]]] = None,
                     layers: str = "last", pooling: str = "none", max_seq_len: int = 128, batch_size: int = 32,
                     progress: bool = False) -> tuple[np.ndarray, list[list[str]]]:
    """Features of every input (float32) and its tokens.

    ``pooling="none"``: ``(N, S, D)`` with ``S`` the longest input in tokens, zero beyond each
    input's length (``len(tokens[i])``); ``"mean"`` / ``"cls"``: ``(N, D)``.
    """
    parse_layers(layers, model.config.num_hidden_layers)  # fail before any work
    device = next(model.parameters()).device
    model.eval()
    encs = []
    for i, text in enumerate(texts):
        pair = pairs[i] if pairs is not None else None
        enc = tokenizer.encode(text, pair, max_length=max_seq_len, truncation=True)
        encs.append({k: as_list(enc[k]) for k in ("input_ids", "token_type_ids", "attention_mask")})
    tokens = [tokenizer.convert_ids_to_tokens(e["input_ids"]) for e in encs]
    longest = max(len(t) for t in tokens)
    width = model.config.hidden_size * (4 if layers == "concat-last-4" else 1)
    out = np.zeros((len(texts), longest, width) if pooling == "none" else (len(texts), width), dtype=np.float32)
    bar = tqdm(total=len(texts), desc="features", unit="input", disable=not progress, dynamic_ncols=True)
    for start in range(0, len(texts), batch_size):
        chunk = encs[start:start + batch_size]
        n = max(len(e["input_ids"]) for e in chunk)

        def padded(key):
            return torch.tensor([e[key] + [0] * (n - len(e[key])) for e in chunk], device=device)

        ids = torch.tensor([e["input_ids"] + [tokenizer.pad_token_id] * (n - len(e["input_ids"])) for e in chunk],
                           device=device)
        mask = padded("attention_mask")
        hidden = model(input_ids=ids, attention_mask=mask, token_type_ids=padded("token_type_ids"),
                       output_hidden_states=True).hidden_states
        feats = pool(combine_layers([h.float() for h in hidden], layers), mask, pooling)
        feats = feats * mask.unsqueeze(-1) if pooling == "none" else feats  # padding rows are exactly 0
        out[start:start + len(chunk), ...] = _fit(feats.cpu().numpy(), out.shape[1] if pooling == "none" else None)
        bar.update(len(chunk))
    bar.close()
    return out, tokens


def _fit(a: np.ndarray, seq: Optional[int]) -> np.ndarray:
    if seq is None or a.shape[1] == seq:
        return a
    return np.pad(a, ((0, 0), (0, seq - a.shape[1]), (0, 0)))
