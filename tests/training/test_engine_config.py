"""The DeepSpeed config fastbert builds (batch arithmetic, precision, conflicts), optimizer groups,
the plain-PyTorch LAMB, and checkpoint retention."""
from __future__ import annotations

import json

import pytest
import torch

from fastbert.training.checkpoint import MARKER, apply_retention, complete_tags, find_latest
from fastbert.training.engine import EngineConfigError, build_ds_config
from fastbert.training.optim import AdamW, TorchLamb, param_groups
from fastbert.training.optim_spec import OptimizerSpec

CPU = torch.device("cpu")


def cfg(base=None, **kw):
    args = dict(micro_batch_size=8, global_batch_size=64, world_size=2, precision="fp32", gradient_clipping=1.0,
                optimizer=OptimizerSpec(), device=CPU)
    args.update(kw)
    return build_ds_config(base, **args)


def test_batch_arithmetic_and_defaults(tmp_path):
    c = cfg("configs/ds_zero2.json")
    assert (c["train_batch_size"], c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (64, 8, 4)
    assert c["zero_optimization"]["stage"] == 2 and c["gradient_clipping"] == 1.0
    assert c["optimizer"]["type"] == "Adam" and c["optimizer"]["params"]["adam_w_mode"] is True
    assert not c["bf16"]["enabled"] and not c["fp16"]["enabled"]
    client = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    assert "optimizer" not in cfg(None, client_optimizer=client) and "zero_allow_untested_optimizer" not in cfg(
        None, client_optimizer=client)
    # DeepSpeed's ZeRO checks an optimizer's exact type: fastbert's AdamW (a subclass) and LAMB must be allowed
    assert cfg(None, client_optimizer=AdamW(client.param_groups[0]["params"]))["zero_allow_untested_optimizer"]
    assert cfg(None, client_optimizer=TorchLamb(client.param_groups[0]["params"]))["zero_allow_untested_optimizer"]
    assert cfg(None, zero_stage=3)["zero_optimization"]["stage"] == 3


def test_fp16_gets_dynamic_loss_scaling():
    c = cfg(None, precision="fp16", device=torch.device("cuda", 0))
    assert c["fp16"]["enabled"] and c["fp16"]["loss_scale"] == 0


@pytest.mark.parametrize("kw,match", [
    (dict(global_batch_size=60), "not a multiple"),
    (dict(precision="bf16"), "needs a CUDA device"),
    (dict(optimizer=OptimizerSpec(type="lamb"), zero_stage=2), "LAMB"),
    (dict(base={"scheduler": {"type": "WarmupLR"}}), "scheduler"),
    (dict(base={"optimizer": {"type": "Adam", "params": {"lr": 1}}}), "optimizer"),
    (dict(base={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}), "offload"),
    (dict(zero_stage=4), "stage"),
])
def test_conflicts_are_errors(kw, match):
    base = kw.pop("base", None)
    with pytest.raises(EngineConfigError, match=match):
        cfg(base, **kw)


def test_missing_ds_json():
    with pytest.raises(EngineConfigError, match="not found"):
        cfg("configs/nope.json")


def test_shipped_configs_are_consistent():
    from fastbert.training.config import load_config
    for name in ("tiny", "base", "academic-budget-large"):
        c = load_config(f"configs/{name}.json")
        ds = json.load(open(c.train.deepspeed))
        assert "zero_optimization" in ds
    big = load_config("configs/academic-budget-large.json")
    t = big.train
    assert big.model.preset == "large" and big.model.prenorm is True
    assert t.global_batch_size == 4096 and t.time_budget == "24h" and t.warmup == 0.06
    assert t.optimizer == {"type": "adamw", "lr": 1e-3, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01}
    assert big.data.prepare.nsp is False and big.data.prepare.seq_len == 128
    assert json.load(open(t.deepspeed))["zero_optimization"]["stage"] == 2


def test_config_errors():
    from fastbert.training.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="unknown config key 'train.max_step'"):
        load_config("configs/tiny.json", ["train.max_step=3"])
    with pytest.raises(ConfigError, match="set a budget"):
        load_config("configs/tiny.json", ["train.time_budget=null"])
    c = load_config("configs/tiny.json", ["train.max_steps=5", "model.overrides.hidden_dropout_prob=0.0"])
    assert c.train.max_steps == 5 and c.model.overrides == {"hidden_dropout_prob": 0.0}


def test_param_groups_skip_decay_for_bias_and_layernorm():
    from fastbert import BertConfig, BertForMaskedLM
    model = BertForMaskedLM(BertConfig.preset("tiny", vocab_size=100))
    decay, no_decay = param_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 for p in decay["params"])
    assert all("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in no_decay["params"])


def test_torch_lamb_matches_the_formula():
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=torch.float64)
    g = torch.randn(4, 3, dtype=torch.float64)
    p = torch.nn.Parameter(w.clone())
    opt = TorchLamb([p], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    for _ in range(2):
        p.grad = g.clone()
        opt.step()
    # By hand, two steps with the same gradient.
    ref = w.clone()
    m = v = torch.zeros_like(w)
    for t in (1, 2):
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        u = (m / (1 - 0.9 ** t)) / ((v / (1 - 0.99 ** t)).sqrt() + 1e-6) + 0.01 * ref
        ref = ref - 0.1 * (ref.norm() / u.norm()) * u
    torch.testing.assert_close(p.detach(), ref, rtol=1e-12, atol=1e-12)


def make_tag(root, step, complete=True):
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (d / MARKER).write_text(json.dumps({"step": step, "world_size": 1}))


def test_retention_never_deletes_the_newest_good(tmp_path):
    for s in (10, 20, 30):
        make_tag(tmp_path, s)
    make_tag(tmp_path, 25, complete=False)          # a save that crashed
    make_tag(tmp_path, 40, complete=False)          # a save in progress / crashed after the newest good one
    removed = apply_retention(tmp_path, keep=1)
    assert sorted(removed) == ["step_00000010", "step_00000020", "step_00000025"]
    assert [t for _, t in complete_tags(tmp_path)] == ["step_00000030"]
    assert (tmp_path / "step_00000040").is_dir()    # newer than the newest good one: left alone
    assert find_latest(tmp_path) == "step_00000030"
    (tmp_path / "latest").write_text("step_00000040\n")   # points at an incomplete one: ignored
    assert find_latest(tmp_path) == "step_00000030"


def test_zero_stage_auto_picks_zero0_where_the_replicated_state_fits():
    """train.zero_stage=auto: ZeRO-0 (measured fastest on one and two GPUs) on one rank, and on several
    where 16 bytes a parameter take at most half a device; the JSON's stage otherwise, a resumed run's
    own stage, and never over an explicit offload or ZeRO-3."""
    from fastbert.training.pretrain import resolve_zero_stage
    z2 = {"zero_optimization": {"stage": 2}}
    gib = 2 ** 30
    assert resolve_zero_stage("auto", z2, 1) == 0
    assert resolve_zero_stage("auto", z2, 2, state_bytes=16 * 110_000_000, device_bytes=80 * gib) == 0
    assert resolve_zero_stage("auto", z2, 8, state_bytes=16 * 3_000_000_000, device_bytes=80 * gib) is None
    assert resolve_zero_stage("auto", z2, 2) is None                       # device memory unknown (CPU ranks)
    assert resolve_zero_stage("auto", z2, 2, saved=2, state_bytes=1, device_bytes=gib) == 2
    assert resolve_zero_stage("auto", {"zero_optimization": {"stage": 3}}, 1) is None
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert resolve_zero_stage("auto", offload, 2, state_bytes=1, device_bytes=gib) is None
    assert resolve_zero_stage(1, z2, 1) == 1


def test_fp8_precision_resolves_to_its_engine_precision():
    """train.precision=fp8 is bf16 autocast plus BertConfig.fp8 on a GPU with FP8 tensor cores; on the CPU the
    engine runs fp32 (torch's FP8 GEMM emulation, for tests); anything but a fastbert model is refused."""
    from fastbert.training.engine import build_engine, resolve_precision
    assert resolve_precision("fp8", CPU) == "fp32"
    with pytest.raises(EngineConfigError, match="needs a fastbert model"):
        build_engine(torch.nn.Linear(16, 16), precision="fp8")
