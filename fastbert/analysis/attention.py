"""Attention analysis: every layer's and head's attention map for one input, a PNG grid of them,
and the per-head statistics of Clark et al. (2019, "What Does BERT Look At?").

For each head, ``most_attended`` is the token that receives the most attention on average over
the query positions (the paper's observation: many heads put most of their weight on [SEP],
[CLS] or periods); the head's average attention to [CLS], to [SEP] and to punctuation, and the
mean entropy of its attention rows (nats) come with it.
"""
from __future__ import annotations

import string
from typing import Optional

import numpy as np
import torch


@torch.no_grad()
def attention_maps(model, tokenizer, text: str, pair: Optional[str] = None, max_seq_len: int = 512
                   ) -> tuple[list[str], np.ndarray]:
    """Tokens and the ``(layers, heads, seq, seq)`` attention probabilities (rows: queries) of one input."""
    enc = tokenizer.encode(text, pair, max_length=max_seq_len, truncation=True)
    enc = {k: [int(i) for i in enc[k]] for k in ("input_ids", "token_type_ids")}
    device = next(model.parameters()).device
    ids = torch.tensor([enc["input_ids"]], device=device)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                token_type_ids=torch.tensor([enc["token_type_ids"]], device=device), output_attentions=True)
    maps = torch.stack([a[0].float() for a in out.attentions]).cpu().numpy()  # (L, H, S, S)
    return tokenizer.convert_ids_to_tokens(enc["input_ids"]), maps


def _is_punct(token: str) -> bool:
    return bool(token) and all(ch in string.punctuation for ch in token)


def head_statistics(maps: np.ndarray, tokens: list[str]) -> list[dict]:
    """One dict per (layer, head), 1-based numbers: most-attended token and attention shares."""
    L, H, S, _ = maps.shape
    cls = np.array([t == "[CLS]" for t in tokens])
    sep = np.array([t == "[SEP]" for t in tokens])
    punct = np.array([_is_punct(t) for t in tokens])
    received = maps.mean(axis=2)                                    # (L, H, S): mean over queries
    entropy = -(maps * np.log(np.clip(maps, 1e-12, None))).sum(-1).mean(-1)  # (L, H)
    stats = []
    for layer in range(L):
        for head in range(H):
            r = received[layer, head]
            j = int(r.argmax())
            stats.append({"layer": layer + 1, "head": head + 1, "most_attended": tokens[j], "position": j,
                          "weight": float(r[j]), "to_cls": float(r[cls].sum()), "to_sep": float(r[sep].sum()),
                          "to_punct": float(r[punct].sum()), "entropy": float(entropy[layer, head])})
    return stats


def summarize(stats: list[dict]) -> dict:
    """How many heads attend most to [CLS], [SEP], punctuation or another token."""
    kinds = {"[CLS]": 0, "[SEP]": 0, "punctuation": 0, "other": 0}
    for s in stats:
        t = s["most_attended"]
        kinds[t if t in ("[CLS]", "[SEP]") else "punctuation" if _is_punct(t) else "other"] += 1
    return {"heads": len(stats), "most_attended_kind": kinds,
            "mean_to_cls": float(np.mean([s["to_cls"] for s in stats])),
            "mean_to_sep": float(np.mean([s["to_sep"] for s in stats]))}


def plot_grid(maps: np.ndarray, tokens: list[str], path, max_labelled_tokens: int = 24) -> None:
    """Every head's map in a ``layers x heads`` grid of heat maps, saved as PNG (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, H, S, _ = maps.shape
    cell = 1.6 if S <= max_labelled_tokens else 1.2
    fig, axes = plt.subplots(L, H, figsize=(H * cell, L * cell), squeeze=False)
    label = S <= max_labelled_tokens and H <= 16
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            ax.imshow(maps[layer, head], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"head {head + 1}", fontsize=7)
            if head == 0:
                ax.set_ylabel(f"layer {layer + 1}", fontsize=7)
    if label:  # token labels on the bottom-left map only, where they do not clutter the grid
        ax = axes[L - 1][0]
        ax.set_xticks(range(S))
        ax.set_xticklabels(tokens, rotation=90, fontsize=4)
        ax.set_yticks(range(S))
        ax.set_yticklabels(tokens, fontsize=4)
    fig.suptitle("attention maps (rows: queries, columns: keys)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
