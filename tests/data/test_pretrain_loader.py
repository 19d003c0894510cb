"""The training order and loader: global batches independent of the rank/accumulation split, epochs,
O(1) resume without replay, padding and token types."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastbert.data.prepare import PrepareConfig, prepare
from fastbert.data.pretrain_dataset import GlobalOrder, PretrainData, PretrainLoader, eval_batches
from fastbert.data.shards import ShardError

WIKI = "pretrain/enwiki_wikiextractor"
VOCAB = "vocab/bert-base-uncased/vocab.txt"


@pytest.fixture(scope="module")
def data(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("loader") / "data"
    prepare(PrepareConfig(corpus=[str(sorted((data_dir / WIKI).glob("*.xz"))[0])], vocab=str(data_dir / VOCAB),
                          out=str(out), nsp=True, seq_len=64, val_fraction=0.1), progress=False)
    return PretrainData(out, "train")


@pytest.mark.parametrize("world,accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_global_batch_is_independent_of_split(world, accum):
    order = GlobalOrder(1000, 64, seed=0)
    micro = 64 // (world * accum)
    for step in (0, 5, 16):                         # 1000 // 64 = 15 steps per epoch: 16 is in epoch 1
        got = np.concatenate([order.micro_batch(step, m, r, world, micro) for m in range(accum) for r in range(world)])
        ref = GlobalOrder(1000, 64, seed=0)
        want = np.concatenate([ref.micro_batch(step, m, 0, 1, 8) for m in range(8)])
        assert sorted(got.tolist()) == sorted(want.tolist())
        assert len(set(got.tolist())) == 64


def test_epochs_cover_every_sequence_once_then_reshuffle():
    order = GlobalOrder(100, 10, seed=1)
    epoch0 = np.concatenate([order.micro_batch(s, 0, 0, 1, 10) for s in range(10)])
    epoch1 = np.concatenate([order.micro_batch(s, 0, 0, 1, 10) for s in range(10, 20)])
    assert sorted(epoch0.tolist()) == list(range(100)) == sorted(epoch1.tolist())
    assert epoch0.tolist() != epoch1.tolist()
    with pytest.raises(ShardError, match="fewer than one global batch"):
        GlobalOrder(5, 10, seed=0)


def test_loader_resume_needs_no_replay(data):
    order = GlobalOrder(len(data), 16, seed=3)
    kw = dict(rank=1, world=2, micro_batch=4, grad_accum=2)
    full = PretrainLoader(data, order, **kw)
    it = iter(full)
    ref = [next(it) for _ in range(10)]               # steps 0..4, two micro-batches each
    full.close()
    resumed = PretrainLoader(data, GlobalOrder(len(data), 16, seed=3), start_step=3, **kw)
    it = iter(resumed)
    got = [next(it) for _ in range(4)]
    resumed.close()
    for (s1, m1, b1), (s2, m2, b2) in zip(ref[6:], got):
        assert (s1, m1) == (s2, m2)
        assert all(torch.equal(b1[k], b2[k]) for k in b1)


def test_batch_padding_and_token_types(data):
    b = data.batch(range(8))
    ids, mask, types = b["input_ids"], b["attention_mask"], b["token_type_ids"]
    assert ids.shape[1] % 8 == 0 and ids.shape[1] <= 64
    for row, i in enumerate(range(8)):
        shard, j = data.locate(i)
        seq = np.asarray(shard.sequence(j))
        n, bs = len(seq), int(shard.bstart[j])
        assert (ids[row, :n] == seq).all() and (ids[row, n:] == 0).all()
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert not types[row, :bs].any() and types[row, bs:n].all() and not types[row, n:].any()
    assert set(b["next_sentence_label"].tolist()) <= {0, 1}
    assert data.batch(range(4), pad_to=64)["input_ids"].shape == (4, 64)


def test_eval_batches_are_disjoint_across_ranks(data_dir, data):
    val = PretrainData(data.data_dir, "val")
    r0 = eval_batches(val, rank=0, world=2, micro_batch=4, max_batches=3)
    r1 = eval_batches(val, rank=1, world=2, micro_batch=4, max_batches=3)
    assert len(r0) == len(r1) == min(3, len(val) // 8)
    assert not torch.equal(r0[0]["input_ids"][:, :8], r1[0]["input_ids"][:, :8])
