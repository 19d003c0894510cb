"""The fine-tuning loop's pieces: parameter groups (encoder vs head LR, no decay on biases and
LayerNorm, frozen encoder), the warmup/decay schedule and the deterministic, rank-sharded batches."""
import pytest
import torch

from fastbert import BertConfig, BertForSequenceClassification
from fastbert.tasks.trainer import (epoch_batches, lr_multiplier, pad_batch, param_groups, set_group_lrs,
                                    steps_per_epoch, total_steps)


@pytest.fixture
def model():
    cfg = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    return BertForSequenceClassification(cfg)


def test_param_groups_split_encoder_head_and_decay(model):
    groups = {g["name"]: g for g in param_groups(model, lr=1e-5, head_lr=1e-3, weight_decay=0.01,
                                                 freeze_encoder=False)}
    assert set(groups) == {"encoder", "encoder_no_decay", "head", "head_no_decay"}
    assert groups["encoder"]["lr"] == groups["encoder_no_decay"]["base_lr"] == 1e-5
    assert groups["head"]["lr"] == groups["head_no_decay"]["lr"] == 1e-3
    assert groups["encoder"]["weight_decay"] == groups["head"]["weight_decay"] == 0.01
    assert groups["encoder_no_decay"]["weight_decay"] == groups["head_no_decay"]["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in groups["head"]["params"]] == ["classifier.weight"]
    no_decay = [names[id(p)] for p in groups["encoder_no_decay"]["params"]]
    assert all(n.endswith("bias") or "LayerNorm" in n for n in no_decay)
    assert sum(len(g["params"]) for g in groups.values()) == len(list(model.parameters()))
    optimizer = torch.optim.AdamW([{k: v for k, v in g.items() if k != "name"} for g in groups.values()])
    set_group_lrs(optimizer, 0.5)
    lrs = {g["base_lr"]: g["lr"] for g in optimizer.param_groups}
    assert lrs == {1e-5: 5e-6, 1e-3: 5e-4}


def test_freeze_encoder_trains_only_the_head(model):
    groups = param_groups(model, lr=1e-5, head_lr=None, weight_decay=0.01, freeze_encoder=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["classifier.weight", "classifier.bias"]
    assert {g["name"] for g in groups} == {"head", "head_no_decay"} and groups[0]["lr"] == 1e-5  # head_lr defaults to lr


def test_warmup_then_linear_decay():
    mult = [lr_multiplier(s, 100, 0.1) for s in range(100)]
    assert mult[0] == pytest.approx(0.05) and mult[9] == pytest.approx(0.95)       # midpoint of each step
    assert max(mult) == pytest.approx(mult[10]) and mult[10] == pytest.approx(1 - 0.5 / 90)
    assert all(a > b for a, b in zip(mult[10:], mult[11:])) and 0 < mult[-1] < 0.01
    assert lr_multiplier(4, 100, 10) == pytest.approx(lr_multiplier(4, 100, 0.1))    # warmup given in steps


def test_batches_are_deterministic_and_sharded():
    one = epoch_batches(50, 8, seed=7, epoch=0)
    assert one == epoch_batches(50, 8, seed=7, epoch=0) != epoch_batches(50, 8, seed=7, epoch=1)
    assert sorted(i for b in one for i in b) == list(range(50)) and len(one) == steps_per_epoch(50, 8) == 7
    assert len(one[-1]) == 2                                   # one process keeps the short last batch
    r0, r1 = (epoch_batches(50, 4, seed=7, epoch=0, rank=r, world=2) for r in (0, 1))
    assert len(r0) == len(r1) == steps_per_epoch(50, 4, world=2) == 7
    assert all(len(b) == 4 for b in r0 + r1)                   # ranks filled up to equal batches
    assert [a + b for a, b in zip(r0, r1)][:6] == one[:6]      # same global batches as one process of 8
    assert total_steps(50, 8, 2.5) == 18


def test_pad_batch_pads_each_field():
    rows = [{"input_ids": [1, 2, 3], "labels": [5, -100, 6], "y": 1},
            {"input_ids": [4], "labels": [7], "y": 0}]
    out = pad_batch(rows, {"input_ids": 9, "labels": -100})
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert out["labels"].tolist() == [[5, -100, 6], [7, -100, -100]] and out["y"].tolist() == [1, 0]
    nested = pad_batch([{"input_ids": [[1, 2], [3]]}, {"input_ids": [[4], [5, 6, 7]]}], {})
    assert nested["input_ids"].shape == (2, 2, 3) and nested["input_ids"].dtype == torch.long
