"""The pretraining config: a JSON file (configs/*.json) merged over DEFAULTS, plus ``key=value``
overrides from the command line (``train.max_steps=200``, ``data.dir=/scratch/wiki``; values are
parsed as JSON when they can be, else kept as strings). Unknown keys are errors, so a typo never
silently falls back to a default, and every value is checked against its type (config_keys.py) at
load, before anything is created. Relative paths are relative to the working directory."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from fastbert.errors import ConfigError
from fastbert.training.config_keys import KEYS, defaults, leaves, problem

DEFAULTS: dict = defaults()         # every key with its type and meaning: training/config_keys.py

_OPEN_DICTS = {("model", "overrides"), ("train", "optimizer")}


def _merge(base: dict, update: dict, path: tuple = ()) -> dict:
    out = copy.deepcopy(base)
    for key, value in update.items():
        here = path + (key,)
        if key not in base and path not in _OPEN_DICTS:
            raise ConfigError(f"unknown config key {'.'.join(here)!r}; known keys under "
                              f"{'.'.join(path) or 'the top level'}: {sorted(base)}")
        if isinstance(base.get(key), dict) and isinstance(value, dict) and here not in _OPEN_DICTS:
            out[key] = _merge(base[key], value, here)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> tuple[list[str], object]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. train.max_steps=200)")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().split("."), value


def load_config(path=None, overrides=()) -> dict:
    cfg = copy.deepcopy(DEFAULTS)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {p}; see configs/ (tiny.json, base.json, "
                                    "academic-budget-large.json)")
        try:
            user = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        user.pop("_comment", None)
        cfg = _merge(cfg, user)
    for text in overrides:
        keys, value = parse_override(text)
        nested: dict = value
        for k in reversed(keys):
            nested = {k: nested}
        cfg = _merge(cfg, nested)
    validate(cfg)
    return cfg


def validate(cfg: dict) -> None:
    types = {key: typ for key, _, typ, _ in KEYS}
    for key, value in leaves(cfg):
        if key not in types:
            raise ConfigError(f"{key} is a section, not a value: set its keys, e.g. "
                              f"{next(k for k in types if k.startswith(key + '.'))}=...")
        wrong = problem(key, value, types[key])
        if wrong:
            raise ConfigError(f"{key}={json.dumps(value)} {wrong} (fastbert pretrain --show-config lists every key)")
    t = cfg["train"]
    if t["max_steps"] is None and t["time_budget"] is None:
        raise ConfigError("set a budget: train.max_steps=N and/or train.time_budget=DURATION (e.g. '24h')")
    if t["deepspeed"] is not None and not Path(t["deepspeed"]).is_file():
        raise ConfigError(f"train.deepspeed: {t['deepspeed']} is not a file; see configs/ds_zero*.json")
    g = cfg["guard"]
    if g["min_history"] > g["window"]:
        raise ConfigError("guard.min_history must be <= guard.window")
    hb, hbt = cfg["dist"]["heartbeat_s"], cfg["dist"]["heartbeat_timeout_s"]
    if hb and hbt < 2 * hb:
        raise ConfigError(f"dist.heartbeat_timeout_s ({hbt}) must be at least twice dist.heartbeat_s ({hb})")
    m = cfg["data"]["masking"]
    if m["mask_prob"] + m["random_prob"] > 1:
        raise ConfigError(f"data.masking.mask_prob + random_prob must be <= 1, got {m['mask_prob']} + "
                          f"{m['random_prob']}")
