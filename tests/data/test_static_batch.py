"""Static-shape batches: the layout of rows, segments, positions and NSP slots; packing; the loader's
static mode (fixed shapes for every micro-batch, packed rows, split-independent global batches)."""
from __future__ import annotations

import numpy as np
import pytest

from fastbert.data.prepare import PrepareConfig, prepare
from fastbert.data.pretrain_dataset import GlobalOrder, PackedOrder, PretrainData, PretrainLoader
from fastbert.data.static_batch import build_rows, pack_rows

WIKI = "pretrain/enwiki_wikiextractor"
VOCAB = "vocab/bert-base-uncased/vocab.txt"


def test_build_rows_layout():
    a = (np.array([101, 5, 6, 102, 7, 102]), 4, 1)     # [CLS] x y [SEP] z [SEP], segment B from 4, random next
    b = (np.array([101, 8, 102]), 0, 0)
    c = (np.array([101, 9, 9, 9, 102]), 0, 0)
    out = build_rows([[a, b], [c]], seq_len=10, per_row=3, pad_id=0, nsp=True)
    assert out["input_ids"].shape == (2, 10)
    assert out["input_ids"][0].tolist() == [101, 5, 6, 102, 7, 102, 101, 8, 102, 0]
    assert out["attention_mask"][0].tolist() == [1] * 9 + [0]
    assert out["token_type_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert out["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 0]
    # per row: 3 sequence slots + the padding tail; empty slots have length 0
    assert np.diff(out["cu_seqlens"]).tolist() == [6, 3, 0, 1, 5, 0, 0, 5]
    assert out["cu_seqlens"].dtype == np.int32 and out["cu_seqlens"][-1] == 20
    assert out["cls_positions"].tolist() == [0, 6, 0, 10, 10, 10]
    assert out["next_sentence_label"].tolist() == [1, 0, -100, 0, -100, -100]


def test_build_rows_rejects_overflow():
    with pytest.raises(ValueError, match="do not fit"):
        build_rows([[(np.arange(6), 0, 0), (np.arange(6), 0, 0)]], seq_len=10, per_row=2, pad_id=0, nsp=False)
    with pytest.raises(ValueError, match="more than per_row"):
        build_rows([[(np.arange(2), 0, 0)] * 3], seq_len=10, per_row=2, pad_id=0, nsp=False)


def test_pack_rows_first_fit_keeps_every_sequence_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 129, size=500).tolist()
    rows = pack_rows(lengths, 128, per_row=4)
    flat = [i for r in rows for i in r]
    assert sorted(flat) == list(range(500))
    assert all(sum(lengths[i] for i in r) <= 128 and len(r) <= 4 for r in rows)
    assert all(r == sorted(r) for r in rows)
    # first fit fills rows well: far fewer rows than sequences
    assert len(rows) < 0.8 * 500


@pytest.fixture(scope="module")
def data(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("static") / "data"
    prepare(PrepareConfig(corpus=[str(p) for p in sorted((data_dir / WIKI).glob("*.xz"))[:2]],
                          vocab=str(data_dir / VOCAB), out=str(out), nsp=True, seq_len=64, val_fraction=0.05),
            progress=False)
    return PretrainData(out, "train")


@pytest.mark.parametrize("world,accum", [(1, 4), (2, 2), (4, 1)])
def test_packed_global_batch_is_independent_of_split(data, world, accum):
    order = PackedOrder(data.lengths(), 32, seed=3, seq_len=data.seq_len, per_row=4)
    micro = 32 // (world * accum)
    ref = PackedOrder(data.lengths(), 32, seed=3, seq_len=data.seq_len, per_row=4)
    for step in (0, 3, order.steps_first_epoch + 1):          # the last one is in epoch 1
        got = [tuple(r) for m in range(accum) for w in range(world) for r in order.micro_rows(step, m, w, world, micro)]
        want = [tuple(r) for r in ref.micro_rows(step, 0, 0, 1, 32)]
        assert got == want and len(got) == 32


def test_packed_epoch_covers_sequences_once(data):
    order = PackedOrder(data.lengths(), 16, seed=0, seq_len=data.seq_len, per_row=4)
    seen = [i for s in range(order.steps_first_epoch) for r in order.micro_rows(s, 0, 0, 1, 16) for i in r]
    assert len(seen) == len(set(seen))
    assert len(seen) > 0.9 * len(data) * (order.steps_first_epoch * 16) / len(order.rows(0))
    fill = sum(data.lengths()[seen]) / (order.steps_first_epoch * 16 * data.seq_len)
    assert fill > 0.9, f"packed rows are only {fill:.0%} full"


@pytest.mark.parametrize("packing", ["pack", "none"])
def test_static_loader_shapes_never_change(data, packing):
    per_row = 4 if packing == "pack" else 1
    order = (PackedOrder(data.lengths(), 8, 0, data.seq_len, per_row) if packing == "pack"
             else GlobalOrder(len(data), 8, 0))
    loader = PretrainLoader(data, order, rank=0, world=1, micro_batch=4, grad_accum=2, per_row=per_row)
    shapes = set()
    it = iter(loader)
    try:
        for _ in range(12):
            _, _, batch = next(it)
            shapes.add(tuple((k, tuple(v.shape)) for k, v in sorted(batch.items())))
            real = batch["attention_mask"].sum().item()
            assert real == int(np.diff(batch["cu_seqlens"].numpy()).reshape(4, per_row + 1)[:, :per_row].sum())
    finally:
        loader.close()
    assert len(shapes) == 1
    assert dict(next(iter(shapes)))["cu_seqlens"] == (4 * (per_row + 1) + 1,)
