"""Sentence embeddings (Sentence-BERT mean pooling) and nearest-neighbour search over them."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from fastbert.model import mean_pool


@torch.no_grad()
def encode_sentences(model, tokenizer, texts: Sequence[str], batch_size: int = 64, max_length: int = 256,
                     normalize: bool = True, progress: bool = False, device=None) -> torch.Tensor:
    """Mean-pooled embeddings ``(len(texts), hidden)`` (fp32, on CPU), L2-normalized by default.

    ``model`` is a fastbert ``BertModel``; texts are sorted by length so batches carry little padding.
    """
    device = device or next(model.parameters()).device
    model.eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.empty(len(texts), model.config.hidden_size)
    bar = tqdm(total=len(texts), desc="embed", unit="line", disable=not progress, dynamic_ncols=True)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            enc = tokenizer([texts[i] for i in idx], max_length=max_length, truncation=True, padding="longest",
                            return_tensors="pt")
            ids = enc["input_ids"].to(device)
            mask = enc["attention_mask"].to(device)
            hidden = model(input_ids=ids, attention_mask=mask, token_type_ids=enc["token_type_ids"].to(device))
            emb = mean_pool(hidden.last_hidden_state.float(), mask)
            if normalize:
                emb = torch.nn.functional.normalize(emb, dim=-1)
            out[idx] = emb.cpu()
            bar.update(len(idx))
    except BaseException:
        bar.leave = False          # the error message gets the line, not a half-drawn bar
        raise
    finally:
        bar.close()
    return out


def top_k(queries: torch.Tensor, corpus: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Cosine-similarity top-k (inputs L2-normalized): ``(scores, indices)`` each ``(queries, k)``."""
    k = min(k, corpus.shape[0])
    scores = queries @ corpus.T
    values, indices = scores.topk(k, dim=-1)
    return values.numpy(), indices.numpy()


def read_lines(path, limit: int | None = None) -> list[str]:
    """Non-empty lines of a .txt/.xz/.gz file (WikiExtractor ``<doc>`` markers skipped)."""
    from fastbert.textio import READ_ERRORS, open_text, unreadable
    lines: list[str] = []
    try:
        with open_text(path) as f:
            for line in f:
                line = line.strip()
                if not line or (line.startswith("<doc") or line == "</doc>"):
                    continue
                lines.append(line)
                if limit is not None and len(lines) >= limit:
                    break
    except READ_ERRORS as e:
        raise unreadable(path, e) from None
    return lines

