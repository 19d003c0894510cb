"""Dynamic masking statistics on > 1M real tokens (Wikipedia slice, bert-base-uncased ids): 15% +- 0.3%
chosen, 80/10/10 +- 1%, never a special or padding token; whole-word masking, unigram replacements,
seeding and exact state restore."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastbert.data.masking import IGNORE_INDEX, MaskingCollator, collator_for
from fastbert.data.prepare import PrepareConfig, prepare
from fastbert.data.pretrain_dataset import PretrainData

WIKI = "pretrain/enwiki_wikiextractor"
VOCAB = "vocab/bert-base-uncased/vocab.txt"
SPECIAL = [0, 100, 101, 102, 103]  # [PAD] [UNK] [CLS] [SEP] [MASK]
MASK = 103


@pytest.fixture(scope="module")
def prepared(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mask") / "data"
    files = [str(p) for p in sorted((data_dir / WIKI).glob("*.xz"))[:2]]
    prepare(PrepareConfig(corpus=files, vocab=str(data_dir / VOCAB), out=str(out), nsp=True, val_fraction=0.0),
            progress=False)
    return out


@pytest.fixture(scope="module")
def batches(prepared):
    """Padded (64, <=128) batches covering the whole train split (~0.46M real tokens)."""
    data = PretrainData(prepared, "train")
    out = []
    for start in range(0, len(data) - 64, 64):
        b = data.batch(range(start, start + 64))
        out.append((torch.from_numpy(b["input_ids"]), torch.from_numpy(b["attention_mask"])))
    return out


def masked_stats(collator, batches, passes):
    n_real = n_chosen = n_mask = n_random = n_keep = 0
    for _ in range(passes):
        for ids, attn in batches:
            out, labels = collator(ids, attn)
            chosen = labels != IGNORE_INDEX
            assert torch.equal(labels[chosen], ids[chosen])                 # labels = original ids
            assert torch.equal(out[~chosen], ids[~chosen])                  # nothing else touched
            special = torch.isin(ids, torch.tensor(SPECIAL))
            assert not (chosen & special).any() and not (chosen & (attn == 0)).any()
            real = (attn == 1) & ~special
            n_real += int(real.sum())
            n_chosen += int(chosen.sum())
            n_mask += int((chosen & (out == MASK)).sum())
            n_keep += int((chosen & (out == ids)).sum())
            n_random += int((chosen & (out != MASK) & (out != ids)).sum())
            assert not torch.isin(out[chosen & (out != MASK)], torch.tensor(SPECIAL)).any()
    return n_real, n_chosen, n_mask, n_random, n_keep


def test_rates_on_a_million_tokens(prepared, batches):
    collator = collator_for(prepared, seed=0)
    n_real, n_chosen, n_mask, n_random, n_keep = masked_stats(collator, batches, passes=3)
    assert n_real >= 1_000_000
    assert n_chosen / n_real == pytest.approx(0.15, abs=0.003)
    assert n_mask / n_chosen == pytest.approx(0.8, abs=0.01)
    # A random replacement equal to the original (p = 1/30k) counts as kept: negligible here.
    assert n_random / n_chosen == pytest.approx(0.1, abs=0.01)
    assert n_keep / n_chosen == pytest.approx(0.1, abs=0.01)


def test_per_sequence_count_is_rate_times_length(prepared, batches):
    ids, attn = batches[0]
    _, labels = collator_for(prepared, seed=1)(ids, attn)
    eligible = ((attn == 1) & ~torch.isin(ids, torch.tensor(SPECIAL))).sum(1).float()
    chosen = (labels != IGNORE_INDEX).sum(1).float()
    assert ((chosen - 0.15 * eligible).abs() < 1.0).all()          # floor or ceil of rate * n


def test_other_rate(prepared, batches):
    collator = collator_for(prepared, seed=2, rate=0.3)
    n_real, n_chosen, *_ = masked_stats(collator, batches[:40], passes=1)
    assert n_chosen / n_real == pytest.approx(0.3, abs=0.005)


def test_whole_word_masking(prepared, batches):
    collator = collator_for(prepared, seed=3, whole_word=True)
    vocab = (prepared / "vocab.txt").read_text().splitlines()
    cont = torch.tensor([t.startswith("##") for t in vocab])
    n_real = n_chosen = 0
    for ids, attn in batches[:40]:
        _, labels = collator(ids, attn)
        chosen = labels != IGNORE_INDEX
        is_cont = cont[ids] & (attn == 1)
        # A ## piece is chosen exactly when the piece before it is (same word), unless it follows a special.
        prev_chosen = torch.zeros_like(chosen)
        prev_chosen[:, 1:] = chosen[:, :-1]
        prev_special = torch.ones_like(chosen)
        prev_special[:, 1:] = torch.isin(ids[:, :-1], torch.tensor(SPECIAL))
        inner = is_cont & ~prev_special
        assert torch.equal(chosen[inner], prev_chosen[inner])
        n_real += int(((attn == 1) & ~torch.isin(ids, torch.tensor(SPECIAL))).sum())
        n_chosen += int(chosen.sum())
    assert n_chosen / n_real == pytest.approx(0.15, abs=0.01)


def test_unigram_replacements_follow_frequencies(prepared, batches):
    counts = np.load(prepared / "unigram.npy").astype(np.float64)
    counts[SPECIAL] = 0
    p = counts / counts.sum()
    collator = MaskingCollator(30522, SPECIAL, MASK, random_tokens="unigram", unigram_counts=np.load(prepared / "unigram.npy"),
                               mask_prob=0.0, random_prob=1.0, seed=4)
    drawn = []
    for ids, attn in batches[:60]:
        out, labels = collator(ids, attn)
        drawn.append(out[labels != IGNORE_INDEX])
    drawn = torch.cat(drawn).numpy()
    top = np.argsort(-p)[:5]                                      # "the", ",", ".", "of", "and"
    freq = np.array([(drawn == t).mean() for t in top])
    se = np.sqrt(p[top] * (1 - p[top]) / len(drawn))
    assert (np.abs(freq - p[top]) < 5 * se).all(), (freq, p[top])
    assert not np.isin(drawn, SPECIAL).any()


def test_seeded_and_state_restores_exactly(prepared, batches):
    a, b = collator_for(prepared, seed=5), collator_for(prepared, seed=5)
    ids, attn = batches[0]
    assert all(torch.equal(x, y) for x, y in zip(a(ids, attn), b(ids, attn)))
    state = a.state_dict()
    first = a(*batches[1])
    a(*batches[2])
    a.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(a(*batches[1]), first))
    c = collator_for(prepared, seed=6)
    assert not torch.equal(c(ids, attn)[1], collator_for(prepared, seed=5)(ids, attn)[1])


def test_bad_settings():
    with pytest.raises(ValueError, match="rate"):
        MaskingCollator(100, [0], 1, rate=0.0)
    with pytest.raises(ValueError, match="unigram_counts"):
        MaskingCollator(100, [0], 1, random_tokens="unigram")
    with pytest.raises(ValueError, match="whole_word"):
        MaskingCollator(100, [0], 1, whole_word=True)


def test_ranks_and_slot_order_without_sorts():
    """The collator's two sort-free steps equal the sorts they replace (so a seed masks the same tokens as before):
    a permutation's inverse as a scatter is its argsort (the units' ranks), and the chosen-first order of the static
    slots is the stable argsort of the 0/1 key."""
    from fastbert.data.masking import _chosen_first, _inverse
    g = torch.Generator().manual_seed(0)
    score = torch.rand(5, 37, generator=g)
    score[:, ::3] = 2.0  # ties, as the non-units' fill value makes them
    perm = score.argsort(dim=1)
    assert torch.equal(_inverse(perm), perm.argsort(dim=1))
    for p in (0.0, 0.15, 0.5, 1.0):
        flat = torch.rand(301, generator=g) < p
        assert torch.equal(_chosen_first(flat), torch.argsort((~flat).to(torch.uint8), stable=True))
