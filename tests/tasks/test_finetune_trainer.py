"""The fine-tuning loop's pieces: parameter groups (encoder vs head LR, no decay on biases and
LayerNorm, frozen encoder), the warmup/decay schedule and the deterministic, rank-sharded batches."""
import dataclasses
from types import SimpleNamespace

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
    assert mult[0] == 0.0 and mult[5] == pytest.approx(0.5) and mult[10] == 1.0    # 10 warmup steps
    assert all(a > b for a, b in zip(mult[10:], mult[11:])) and mult[-1] == pytest.approx(1 / 90)
    assert lr_multiplier(4, 100, 10) == pytest.approx(lr_multiplier(4, 100, 0.1))    # warmup given in steps


# ------------------------------------------------------------------ defaults vs HF Trainer / run_glue (item 9)
@pytest.mark.parametrize("total, warmup", [(100, 0.1), (7, 0.1), (61, 0.06), (50, 5), (10, 0.0), (3, 0.5)])
def test_schedule_is_hf_linear_schedule_with_warmup(total, warmup):
    """fastbert finetune's LR at every step is HF's get_linear_schedule_with_warmup with HF's warmup
    rounding (TrainingArguments.get_warmup_steps: ceil(total x fraction), or a step count)."""
    transformers = pytest.importorskip("transformers")
    # TrainingArguments cannot be built without accelerate: call its method on the one field it reads.
    n_warmup = transformers.TrainingArguments.get_warmup_steps(SimpleNamespace(warmup_steps=warmup), total)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, n_warmup, total)
    hf = []
    for _ in range(total):
        hf.append(optimizer.param_groups[0]["lr"])      # the LR this optimizer step uses
        optimizer.step()
        scheduler.step()
    assert [lr_multiplier(s, total, warmup) for s in range(total)] == pytest.approx(hf, abs=1e-12)


def test_decay_exclusions_match_hf_trainer(model):
    """No weight decay on biases and LayerNorm weights, exactly the parameters HF Trainer exempts, on an
    HF model (hf_reference / fastbert.patch) and on fastbert's own (fused QKV) model."""
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32))
    for m in (hf_model, model):
        names = {id(p): n for n, p in m.named_parameters()}
        decayed = {names[id(p)] for g in param_groups(m, 1e-5, None, 0.01, False) if g["weight_decay"] > 0
                   for p in g["params"]}
        assert decayed == set(transformers.Trainer.get_decay_parameter_names(None, m))


def test_finetune_defaults_pinned():
    """The defaults of `fastbert finetune` (CLI and TrainArgs agree): HF's AdamW betas / eps, clipping at
    1.0 and head LR = LR; BERT's recipe (Devlin et al. 2019) where HF's TrainingArguments differ:
    lr 2e-5 (HF 5e-5), batch 32 (HF 8), 10% warmup (HF 0), weight decay 0.01 (HF 0). README lists both."""
    from fastbert.cli import build_parser
    from fastbert.tasks.trainer import ADAM_BETAS, ADAM_EPS, TrainArgs
    transformers = pytest.importorskip("transformers")
    hf = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)})
    assert ADAM_BETAS == (hf.adam_beta1, hf.adam_beta2) and ADAM_EPS == hf.adam_epsilon
    ours = TrainArgs()
    assert ours.max_grad_norm == hf.max_grad_norm == 1.0 and ours.head_lr is None
    assert ours.epochs == hf.num_train_epochs == 3.0
    assert (ours.lr, ours.batch_size, ours.warmup, ours.weight_decay) == (2e-5, 32, 0.1, 0.01)
    cli = build_parser().parse_args(["finetune", "--task", "stsb", "--data", "d", "--model", "m"])
    assert (cli.lr, cli.head_lr, cli.batch_size, cli.warmup, cli.weight_decay, cli.max_grad_norm, cli.epochs,
            cli.seed) == (ours.lr, ours.head_lr, ours.batch_size, ours.warmup, ours.weight_decay,
                          ours.max_grad_norm, ours.epochs, ours.seed)


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


def test_regression_head_as_hf_run_glue(minilm_dir):
    """`fastbert finetune --task stsb` builds what HF run_glue builds for STS-B (num_labels=1): the
    checkpoint's pooler, a new classifier drawn from N(0, initializer_range) with zero bias, classifier
    dropout = hidden_dropout_prob, and the MSE loss of HF on float labels."""
    transformers = pytest.importorskip("transformers")
    from fastbert.tasks.glue import GlueFinetuneTask
    kwargs = GlueFinetuneTask("stsb", data=".", tokenizer=None).model_kwargs()
    assert kwargs["num_labels"] == 1 and kwargs["problem_type"] == "regression"
    torch.manual_seed(0)
    fb = BertForSequenceClassification.from_pretrained(minilm_dir, **kwargs).eval()
    hf = transformers.BertForSequenceClassification.from_pretrained(str(minilm_dir), num_labels=1).eval()
    assert hf.config.problem_type in (None, "regression")
    assert torch.equal(fb.bert.pooler.dense.weight, hf.bert.pooler.dense.weight)   # from the checkpoint
    for m in (fb, hf):
        assert m.dropout.p == m.config.hidden_dropout_prob == 0.1
        assert not m.classifier.bias.any()
        assert abs(m.classifier.weight.std().item() - m.config.initializer_range) < 0.003
        assert abs(m.classifier.weight.mean().item()) < 0.004
    with torch.no_grad():
        hf.classifier.load_state_dict(fb.classifier.state_dict())
        ids = torch.tensor([[101, 7592, 2088, 102, 0], [101, 2023, 2003, 1037, 102]])
        batch = dict(input_ids=ids, attention_mask=(ids > 0).long(), labels=torch.tensor([3.8, 0.4]))
        ours, theirs = fb(**batch), hf(**batch)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)


def tiny_finetune(kernels, precision, n_examples, log_every):
    """(model, fine-tuning engine, args, examples): a 1-layer classifier on ``n_examples`` random examples of 5 to
    21 tokens, batch 4, one epoch."""
    import numpy as np
    from fastbert.tasks.trainer import TrainArgs, build_finetune_engine
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=32, num_labels=2, kernels=kernels)
    model = BertForSequenceClassification(cfg)
    args = TrainArgs(epochs=1, batch_size=4, log_every=log_every, progress=False, precision=precision, seed=0)
    engine = build_finetune_engine(model, param_groups(model, args.lr, None, args.weight_decay, False), args)
    rng = np.random.default_rng(0)
    examples = [{"input_ids": [1] + rng.integers(5, 100, size=int(rng.integers(3, 20))).tolist() + [2],
                 "labels": int(rng.integers(0, 2))} for _ in range(n_examples)]
    return model, engine, args, examples


def packed_rows(rows):
    """The static-batch collate: the examples back to back, padded to a token bucket (max_seqlen 32)."""
    from fastbert.data.static_batch import pack_examples
    return {"packed": {**pack_examples(rows, 32), "max_seqlen": 32}}


def test_finetune_steps_read_nothing_back_between_logs(monkeypatch):
    """The fine-tuning loop on static batches (the GPU path; Triton's interpreter here) reads no value
    from the device inside a step: Tensor.item / tolist / __bool__ / nonzero run only at the
    log_every steps, where the losses of the window are read together. Two reads are of host tensors
    by design and allowed: the epoch's permutation (drawn with a CPU generator, once an epoch) and
    the step counters of torch's foreach AdamW, the CPU optimizer (CUDA uses the fused AdamW, whose
    counters stay on the device and are never read)."""
    import sys

    from fastbert.tasks.trainer import train
    _, engine, args, features = tiny_finetune("triton", "fp32", 24, log_every=3)
    steps, reads = [], []
    engine_step = engine.step

    def counted_step():
        applied = engine_step()
        steps.append(applied)
        return applied
    monkeypatch.setattr(engine, "step", counted_step)
    for name in ("item", "tolist", "__bool__", "nonzero"):
        def read(self, *a, _orig=getattr(torch.Tensor, name), _name=name, **k):
            caller = sys._getframe(1)
            host = caller.f_code.co_name == "epoch_batches" or "torch/optim/" in caller.f_code.co_filename
            if not host:
                reads.append((len(steps), f"{_name} in {caller.f_code.co_filename}:{caller.f_lineno}"))
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, read)
    result = train(engine, features, packed_rows, args)
    monkeypatch.undo()
    assert len(steps) == 6 and result.steps == 6 and len(result.losses) == 6
    assert reads and all(n in (3, 6) for n, _ in reads), [r for r in reads if r[0] not in (3, 6)][:3]


def test_finetune_fp8_precision_trains_with_the_fp8_gemms():
    """``--precision fp8``: the fine-tuning engine turns on BertConfig.fp8 (on the CPU the engine runs fp32 and
    torch emulates the FP8 GEMMs), and the encoder's casts record their amaxes while the loss stays finite. The
    one layer is the last, which computes only the 4 pooled rows after attention: too few for FP8's GEMMs
    (multiples of 16), so its output projection and FFN run in the engine's precision, and only the QKV
    projection's casts (input, weight, gradient: history rows 0-2) record amaxes."""
    import numpy as np
    from fastbert.tasks.trainer import train
    model, engine, args, features = tiny_finetune("torch", "fp8", 8, log_every=2)
    assert model.config.fp8 and engine.precision == "fp32"
    result = train(engine, features, packed_rows, args)
    assert result.steps == 2 and all(np.isfinite(loss) for _, loss in result.losses)
    history = model.bert.encoder._fp8_history
    assert history is not None and (history.amax[:3].amax(1) > 0).all() and not history.amax[3:].any()
