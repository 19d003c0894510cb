"""Static-shape batches: the layout of rows, segments, positions and NSP slots; packing; the loader's
static mode (fixed shapes for every micro-batch, packed rows, split-independent global batches)."""
from __future__ import annotations

import numpy as np
import pytest

from fastbert.data.prepare import PrepareConfig, prepare
from fastbert.data.pretrain_dataset import GlobalOrder, PackedOrder, PretrainData, PretrainLoader
from fastbert.data.static_batch import build_rows, pack_rows
from fastbert.training.pretrain_metrics import host_counts

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


def test_build_rows_span_layout():
    """A bin of two rows: the second sequence continues into row 2, the padding tail (13 tokens, longer than a
    row) is split into segments of at most seq_len at the end of the bin's slots."""
    a = (np.array([101, 5, 6, 7, 8, 102]), 0, 0)
    b = (np.array([101, 9, 9, 9, 9, 9, 9, 102]), 4, 1)
    c = (np.array([101, 3, 102]), 0, 0)
    out = build_rows([[a, b], [c]], seq_len=10, per_row=2, pad_id=0, nsp=True, span=2)
    assert out["input_ids"].shape == (4, 10)
    assert out["input_ids"][:2].reshape(-1).tolist() == [101, 5, 6, 7, 8, 102, 101, 9, 9, 9,
                                                         9, 9, 9, 102] + [0] * 6
    assert out["position_ids"][1].tolist() == [4, 5, 6, 7, 0, 0, 0, 0, 0, 0]
    assert out["token_type_ids"][1].tolist() == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    # per bin: 4 sequence slots, then 2 padding slots (6 = span * (per_row + 1) segments)
    assert np.diff(out["cu_seqlens"]).tolist() == [6, 8, 0, 0, 0, 6, 3, 0, 0, 0, 10, 7]
    assert out["cu_seqlens"].shape == (4 * 3 + 1,) and out["cu_seqlens"][-1] == 40
    assert out["cls_positions"].tolist() == [0, 6, 0, 0, 20, 20, 20, 20]
    assert out["next_sentence_label"].tolist() == [0, 1, -100, -100, 0, -100, -100, -100]
    one = build_rows([[a], [c]], seq_len=10, per_row=2, pad_id=0, nsp=True)
    same = build_rows([[a], [c]], seq_len=10, per_row=2, pad_id=0, nsp=True, span=1)
    assert all(np.array_equal(one[k], same[k]) for k in one)
    with pytest.raises(ValueError, match="do not fit 2 rows"):
        build_rows([[b, b, b]], seq_len=10, per_row=2, pad_id=0, nsp=False, span=2)


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


@pytest.mark.parametrize("span", [1, 4])
@pytest.mark.parametrize("world,accum", [(1, 4), (2, 2), (4, 1)])
def test_packed_global_batch_is_independent_of_split(data, world, accum, span):
    order = PackedOrder(data.lengths(), 32, seed=3, seq_len=data.seq_len, per_row=4, span=span)
    micro = 32 // (world * accum)
    ref = PackedOrder(data.lengths(), 32, seed=3, seq_len=data.seq_len, per_row=4, span=span)
    for step in (0, 3, order.steps_first_epoch + 1):          # the last one is in epoch 1
        got = [tuple(r) for m in range(accum) for w in range(world) for r in order.micro_rows(step, m, w, world, micro)]
        want = [tuple(r) for r in ref.micro_rows(step, 0, 0, 1, 32)]
        assert got == want and len(got) == 32 // span


@pytest.mark.parametrize("span", [1, 4])
def test_packed_epoch_covers_sequences_once(data, span):
    order = PackedOrder(data.lengths(), 16, seed=0, seq_len=data.seq_len, per_row=4, span=span)
    seen = [i for s in range(order.steps_first_epoch) for r in order.micro_rows(s, 0, 0, 1, 16) for i in r]
    assert len(seen) == len(set(seen))
    assert len(seen) > 0.9 * len(data) * (order.steps_first_epoch * 16) / (len(order.bins(0)) * order.span)
    fill = sum(data.lengths()[seen]) / (order.steps_first_epoch * 16 * data.seq_len)
    assert fill > 0.9, f"packed rows are only {fill:.0%} full"


def test_packing_span_fills_rows_better(data):
    """Bins of four rows leave less padding than one-row bins on the same epoch (sequences near a row's
    length fit beside one another only across rows)."""
    fills = []
    for span in (1, 4):
        order = PackedOrder(data.lengths(), 16, seed=0, seq_len=data.seq_len, per_row=4, span=span)
        fills.append(sum(data.lengths()) / (len(order.bins(0)) * span * data.seq_len))
    assert fills[1] > fills[0] + 0.005, fills


def test_packed_order_refuses_a_micro_batch_that_splits_a_bin(data):
    order = PackedOrder(data.lengths(), 16, seed=0, seq_len=data.seq_len, per_row=4, span=4)
    with pytest.raises(ValueError, match="multiple of the packing span 4"):
        order.micro_rows(0, 0, 0, 1, 6)
    with pytest.raises(ValueError, match="multiple of the packing span 4"):
        PackedOrder(data.lengths(), 18, seed=0, seq_len=data.seq_len, per_row=4, span=4)


@pytest.mark.parametrize("packing,span", [("pack", 1), ("pack", 2), ("none", 1)])
def test_static_loader_shapes_never_change(data, packing, span):
    per_row = 4 if packing == "pack" else 1
    order = (PackedOrder(data.lengths(), 8, 0, data.seq_len, per_row, span=span) if packing == "pack"
             else GlobalOrder(len(data), 8, 0))
    loader = PretrainLoader(data, order, rank=0, world=1, micro_batch=4, grad_accum=2, per_row=per_row)
    assert loader.span == span
    shapes = set()
    it = iter(loader)
    try:
        for _ in range(12):
            _, _, batch = next(it)
            shapes.add(tuple((k, tuple(v.shape)) for k, v in sorted(batch.items())))
            real = batch["attention_mask"].sum().item()
            segments = np.diff(batch["cu_seqlens"].numpy()).reshape(4 // span, span * (per_row + 1))
            assert real == int(segments[:, :span * per_row].sum())      # the sequences' slots
            assert segments.max() <= data.seq_len                      # no segment longer than max_seqlen
            assert host_counts(batch, per_row, span) == (real, int((segments[:, :span * per_row] > 0).sum()))
    finally:
        loader.close()
    assert len(shapes) == 1
    assert dict(next(iter(shapes)))["cu_seqlens"] == (4 * (per_row + 1) + 1,)
