"""The pretraining config table (training/config_keys.py): every key is documented and typed,
``--show-config`` lists them all, every shipped config loads, and a bad value stops the command with
exit status 2 before anything is created."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fastbert.training.config import ConfigError, load_config
from fastbert.training.config_keys import KEYS, describe, leaves
from pretrain_harness import REPO, cpu_env


def test_every_key_has_a_type_and_a_meaning_and_appears_in_the_listing():
    text = describe()
    for key, default, typ, meaning in KEYS:
        assert typ and len(meaning.split()) >= 2, key
        assert f"\n{key} " in text, key
    assert [k for k, _ in leaves(load_config(None, ["train.max_steps=1"]).to_dict())] == [k for k, *_ in KEYS]


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.json")
                                        if not p.name.startswith("ds_")))
def test_shipped_configs_load(path, monkeypatch):
    monkeypatch.chdir(REPO)
    load_config(path)


@pytest.mark.parametrize("override,message", [
    ("train.time_budget=ten", 'train.time_budget="ten" is not a duration'),
    ("train.max_steps=0", "train.max_steps=0 must be an integer > 0"),
    ("train.warmup=1.5", "must be a number in [0, 1]"),
    ("model.preset=huge", "must be one of tiny | mini"),
    ("guard.loss_factor=0.5", "must be > 1 (or 0/null"),
    ("train.optimizer.lr=fast", "has lr='fast'"),
    ("model.overrides.hiden_size=8", "unknown BertConfig field(s) ['hiden_size']"),
    ("log.tensorboard=yes", "must be true or false"),
    ("train=3", "is a section, not a value"),
    # rules across keys, checked by the sections at load
    ("guard.min_history=60", "guard.min_history must be <= guard.window"),
    ("dist.heartbeat_timeout_s=6", "must be at least twice dist.heartbeat_s"),
    ("data.masking.random_prob=0.5", "mask_prob + random_prob must be <= 1"),
    ("train.deepspeed=configs/nope.json", "is not a file"),
])
def test_bad_values_are_rejected_at_load(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / "tiny.json", [override])
    assert message in str(e.value)


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "fastbert.cli", "pretrain", *args], cwd=cwd, env=cpu_env(),
                          capture_output=True, text=True, timeout=120)


def test_show_config_lists_every_key_and_what_the_config_changes():
    res = _cli("--show-config", "--config", "configs/tiny.json")
    assert res.returncode == 0, res.stderr
    for key, *_ in KEYS:
        assert f"\n{key} " in res.stdout, key
    assert 'configs/tiny.json: "3m"' in res.stdout                # train.time_budget set by tiny.json
    assert _cli("--show-config").returncode == 0                  # no config, no budget: still lists


def test_bad_value_is_a_usage_error_and_creates_nothing(tmp_path: Path):
    out = tmp_path / "out"
    res = _cli("--config", "configs/tiny.json", "train.time_budget=ten", f"output_dir={out}")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.count("fastbert pretrain: error: ") == 1 and "is not a duration" in res.stderr
    assert not out.exists()
    res = _cli("--config", str(tmp_path / "missing.json"))
    assert res.returncode == 2 and "config file not found" in res.stderr


def test_guard_defaults_agree_with_the_guard():
    from fastbert.training.guard import DEFAULTS as GUARD
    assert {k[len("guard."):]: d for k, d, *_ in KEYS if k.startswith("guard.")} == GUARD


def test_config_is_parsed_at_load_into_typed_sections():
    from dataclasses import fields, is_dataclass

    from fastbert.training.config import PretrainConfig, as_dict
    from fastbert.training.preflight import DEFAULTS as DIST
    cfg = load_config(REPO / "configs" / "tiny.json", ["train.max_steps=7", "data.masking.rate=0.2"])
    assert isinstance(cfg, PretrainConfig) and all(is_dataclass(getattr(cfg, f.name)) for f in fields(cfg)
                                                    if f.name != "output_dir")
    assert cfg.train.time_budget == "3m" and cfg.train.time_budget_s == 180.0     # parsed once, at load
    assert cfg.train.max_steps == 7 and cfg.data.masking.rate == 0.2 and cfg.model.preset == "tiny"
    assert set(as_dict(cfg.dist)) == set(DIST)
    from fastbert.training.guard import DEFAULTS as GUARD
    assert as_dict(cfg.guard).keys() == GUARD.keys()


def test_unknown_key_stops_the_command_before_anything_starts(tmp_path: Path):
    out = tmp_path / "out"
    res = _cli("--config", "configs/tiny.json", "train.time_budgit=5m", f"output_dir={out}")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "unknown config key 'train.time_budgit'" in res.stderr and "[fastbert]" not in res.stdout
    assert not out.exists()
