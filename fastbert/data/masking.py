"""Dynamic MLM masking on the device, fresh for every batch (RoBERTa-style dynamic masking).

For each sequence, ``k`` of its ``n`` eligible tokens are chosen for prediction, where ``k`` is
``rate * n`` rounded up or down at random (so the rate is exact in expectation and per-sequence
counts match BERT's fixed ``round(rate * n)`` within one). Eligible = a real token (attention mask 1)
that is not a special token ([CLS], [SEP], [PAD], [MASK], [UNK]). Of the chosen tokens 80% become
[MASK], 10% a random token, 10% stay (each decided per token). Random tokens are drawn uniformly
from the non-special vocabulary, or by unigram frequency of the training data.

Whole-word masking chooses words instead of tokens (a word = a piece not starting with ``##`` plus
the ``##`` pieces after it): ``k`` words of the ``n_words`` eligible ones with ``k ~ rate * n_words``,
so the expected share of masked tokens is still ``rate``.

Output: ``(input_ids, labels)`` with ``labels = -100`` where nothing is predicted (what the sparse MLM
head expects), or, for static shapes (``masked_slots``), ``(input_ids, positions, targets)``: a fixed
number of slots per batch (``capacity``: the most tokens the per-row rule can choose), the chosen
flat positions first and unused slots with target -100, so the MLM head's shapes never change and
nothing is read back from the device. Both draw the same random numbers: the same tokens are masked.
Randomness comes from one ``torch.Generator`` on the device, seeded per rank; its state
is saved with checkpoints (``state_dict``) for exact resume. No host synchronisation.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

IGNORE_INDEX = -100


class MaskingCollator:
    def __init__(self, vocab_size: int, special_ids: Sequence[int], mask_id: int, *, rate: float = 0.15,
                 mask_prob: float = 0.8, random_prob: float = 0.1, random_tokens: str = "uniform",
                 unigram_counts=None, whole_word: bool = False, continuation=None, seed: int = 0,
                 device="cpu"):
        if not 0.0 < rate < 1.0:
            raise ValueError(f"masking rate must be in (0, 1), got {rate}")
        if mask_prob < 0 or random_prob < 0 or mask_prob + random_prob > 1.0:
            raise ValueError(f"mask_prob ({mask_prob}) + random_prob ({random_prob}) must lie in [0, 1]")
        if random_tokens not in ("uniform", "unigram"):
            raise ValueError(f"random_tokens must be 'uniform' or 'unigram', got {random_tokens!r}")
        self.device = torch.device(device)
        self.vocab_size, self.mask_id = int(vocab_size), int(mask_id)
        self.rate, self.mask_prob, self.random_prob = float(rate), float(mask_prob), float(random_prob)
        self.random_tokens, self.whole_word = random_tokens, bool(whole_word)
        special = torch.zeros(vocab_size, dtype=torch.bool)
        special[torch.as_tensor(list(special_ids), dtype=torch.long)] = True
        self.special = special.to(self.device)
        self.normal_ids = (~special).nonzero().squeeze(1).to(self.device)  # candidates for random replacement
        if random_tokens == "unigram":
            if unigram_counts is None:
                raise ValueError("random_tokens='unigram' needs unigram_counts (unigram.npy of the prepared data)")
            w = torch.as_tensor(unigram_counts, dtype=torch.float64).clone()
            if w.numel() != vocab_size:
                raise ValueError(f"unigram_counts has {w.numel()} entries, vocabulary has {vocab_size}")
            w[special] = 0
            if not w.sum() > 0:
                raise ValueError("unigram_counts hold no non-special tokens")
            self.unigram = (w / w.sum()).float().to(self.device)
        if whole_word:
            if continuation is None:
                raise ValueError("whole_word masking needs the vocabulary ('##' continuation flags)")
            self.continuation = torch.as_tensor(continuation, dtype=torch.bool).to(self.device)
        self.seed = int(seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)

    # ---------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"seed": self.seed, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    # ---------------------------------------------------------------------- masking
    def _rand(self, shape) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=self.device)

    def choose(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Boolean (batch, seq): the positions to predict."""
        eligible = attention_mask.bool() & ~self.special[input_ids]
        batch, seq = input_ids.shape
        if self.whole_word:
            prev_eligible = torch.zeros_like(eligible)
            prev_eligible[:, 1:] = eligible[:, :-1]
            # A unit starts at a non-## piece, or at a ## piece with nothing eligible before it.
            start = eligible & (~self.continuation[input_ids] | ~prev_eligible)
        else:
            start = eligible
        n_units = start.sum(dim=1)                                        # (batch,)
        k = torch.floor(n_units.to(torch.float32) * self.rate + self._rand((batch,))).long()
        score = self._rand((batch, seq)).masked_fill(~start, 2.0)        # non-units sort last
        rank = _inverse(score.argsort(dim=1))                             # (batch, seq): rank among units
        chosen_start = start & (rank < k.unsqueeze(1))
        if not self.whole_word:
            return chosen_start
        # Spread each start's choice to its ## pieces: index of the latest start at or before i.
        pos = torch.arange(seq, device=self.device).expand(batch, seq)
        start_pos = torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values
        return eligible & chosen_start.gather(1, start_pos)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """``input_ids``, ``attention_mask``: (batch, seq) on the device. Returns (masked ids, labels)."""
        input_ids, chosen = self._choose_on_device(input_ids, attention_mask)
        labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        return self._corrupt(input_ids, chosen), labels

    def capacity(self, batch: int, seq: int) -> int:
        """Slots of ``masked_slots`` for a (batch, seq) input: per row at most floor(seq * rate) + 1
        tokens are chosen (whole-word masking has no such bound: every token)."""
        return batch * seq if self.whole_word else batch * min(seq, int(seq * self.rate) + 1)

    def masked_slots(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Static-shape masking: ``(masked ids (batch, seq), positions (capacity,), targets (capacity,))``;
        ``positions`` index the flattened (batch * seq) tokens; unused slots point at 0 with target -100."""
        input_ids, chosen = self._choose_on_device(input_ids, attention_mask)
        flat = chosen.reshape(-1)
        slots = self.capacity(*input_ids.shape)
        order = _chosen_first(flat)[:slots]  # no count read back on the host
        used = flat.index_select(0, order)
        positions = torch.where(used, order, torch.zeros_like(order))
        targets = torch.where(used, input_ids.reshape(-1).index_select(0, order), torch.full_like(order, IGNORE_INDEX))
        return self._corrupt(input_ids, chosen), positions, targets

    def _choose_on_device(self, input_ids, attention_mask):
        input_ids = input_ids.to(self.device, non_blocking=True).long()
        attention_mask = attention_mask.to(self.device, non_blocking=True)
        return input_ids, self.choose(input_ids, attention_mask)

    def _corrupt(self, input_ids, chosen):
        """80% [MASK], 10% random, 10% kept among the chosen tokens."""
        u = self._rand(input_ids.shape)
        to_mask = chosen & (u < self.mask_prob)
        to_random = chosen & (u >= self.mask_prob) & (u < self.mask_prob + self.random_prob)
        if self.random_tokens == "uniform":
            idx = torch.randint(0, self.normal_ids.numel(), input_ids.shape, generator=self.generator,
                                device=self.device)
            random_ids = self.normal_ids[idx]
        else:
            random_ids = torch.multinomial(self.unigram, input_ids.numel(), replacement=True,
                                           generator=self.generator).view_as(input_ids)
        out = torch.where(to_mask, torch.full_like(input_ids, self.mask_id), input_ids)
        return torch.where(to_random, random_ids, out)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of each row's permutation ``perm`` ``(batch, n)`` (what ``perm.argsort(dim=1)`` is), as one
    scatter instead of a sort."""
    return torch.empty_like(perm).scatter_(1, perm, torch.arange(perm.shape[1], device=perm.device).expand_as(perm))


def _chosen_first(flat: torch.Tensor) -> torch.Tensor:
    """Indices of the True entries of the 1-D bool ``flat`` in order, then of the False ones in order (what a stable
    argsort of ``~flat`` gives), without a sort: a True entry goes to its rank among the True ones, a False one to
    the count of True ones plus its rank among the False ones."""
    before = flat.cumsum(0)
    dest = torch.where(flat, before - 1, before[-1] + torch.arange(flat.numel(), device=flat.device) - before)
    return _inverse(dest.unsqueeze(0))[0]


def continuation_flags(vocab_tokens: Sequence[str]) -> torch.Tensor:
    """True for ``##`` pieces (continuations of the previous piece's word)."""
    return torch.tensor([t.startswith("##") for t in vocab_tokens], dtype=torch.bool)


def read_vocab(path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def collator_for(data_dir, *, rate: float = 0.15, random_tokens: str = "uniform", whole_word: bool = False,
                 seed: int = 0, device="cpu", mask_prob: float = 0.8, random_prob: float = 0.1,
                 index: Optional[dict] = None) -> MaskingCollator:
    """A collator configured from a prepared data folder (its vocabulary, special ids, unigram counts)."""
    import numpy as np
    from pathlib import Path
    from fastbert.data.shards import load_index
    data_dir = Path(data_dir)
    index = index or load_index(data_dir)
    special = index["special_ids"]
    vocab = read_vocab(data_dir / "vocab.txt") if whole_word else None
    counts = np.load(data_dir / "unigram.npy") if random_tokens == "unigram" else None
    return MaskingCollator(index["vocab_size"], sorted(set(special.values())), special["mask"], rate=rate,
                           mask_prob=mask_prob, random_prob=random_prob, random_tokens=random_tokens,
                           unigram_counts=counts, whole_word=whole_word,
                           continuation=continuation_flags(vocab) if vocab else None, seed=seed, device=device)
