"""The pretraining config: a JSON file (configs/*.json) merged over DEFAULTS, plus ``key=value``
overrides from the command line (``train.max_steps=200``, ``data.dir=/scratch/wiki``; values are
parsed as JSON when they can be, else kept as strings). Unknown keys are errors, so a typo never
silently falls back to a default. Relative paths are relative to the working directory."""
from __future__ import annotations

import copy
import json
from pathlib import Path

DEFAULTS: dict = {
    "output_dir": "runs/pretrain",
    "model": {
        "preset": "base",            # tiny | mini | small | medium | base | large (fastbert.config.PRESETS)
        "prenorm": False,            # Pre-LN (academic-budget recipe) or Post-LN (original BERT, HF-loadable)
        "kernels": "auto",           # auto = triton on CUDA, torch on CPU
        "head": "auto",              # auto = pretraining (MLM + NSP) with NSP data, else masked_lm
        "overrides": {},             # any BertConfig field, e.g. {"hidden_dropout_prob": 0.0}
    },
    "data": {
        "dir": "runs/data/enwiki-128",
        "auto_prepare": True,        # run `fastbert prepare` with data.prepare when data.dir is not prepared
        "prepare": {
            "corpus": ["../shared/data/pretrain/enwiki_wikiextractor"],
            "vocab": "../shared/data/vocab/bert-base-uncased/vocab.txt",
            "seq_len": 128, "nsp": False, "val_fraction": 0.01, "short_seq_prob": 0.1, "seed": 12345,
            "workers": 2,
        },
        "masking": {"rate": 0.15, "mask_prob": 0.8, "random_prob": 0.1, "random_tokens": "uniform",
                    "whole_word": False},
        # Static-shape batches (data/static_batch.py): "pack" puts up to per_row prepared sequences in each
        # row of seq_len tokens (global_batch_size then counts rows); "none" keeps one sequence per row.
        "packing": "pack",
        "per_row": 4,
        "prefetch": 4,
    },
    "train": {
        "micro_batch_size": 32,      # per rank
        "global_batch_size": 256,    # sequences per optimizer step (gradient accumulation fills the gap)
        "max_steps": None,           # step budget (and a hard cap when time_budget is set)
        "time_budget": None,         # wall-clock budget, e.g. "24h"; the LR schedule then follows time
        "warmup": 0.06,              # fraction of the budget
        "schedule": "linear",        # linear (decay to 0) | constant (after warmup)
        "optimizer": {"type": "adamw", "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01},
        "gradient_clipping": 1.0,
        "precision": "auto",         # auto = bf16 on CUDA (fp16 where bf16 is missing), fp32 on CPU
        "deepspeed": None,           # DeepSpeed JSON (ZeRO, offload); None = ZeRO stage train.zero_stage
        # "auto": stage 0 on one rank (measured fastest, benchmarks/RESULTS.md) unless the JSON offloads or asks
        # for ZeRO-3 (memory), else the JSON's stage; a number overrides the JSON's stage.
        "zero_stage": "auto",
        "seed": 42,
        "deterministic": False,      # bit-identical loss curves for the same seed and hardware (training/determinism.py)
        "clock": "monotonic",        # tests: "fake:TICK[:SKEW]"
    },
    # Spike / NaN guard (training/guard.py): skip bad steps, roll back to the last good checkpoint on repeats.
    "guard": {
        "enabled": True, "window": 50, "min_history": 10, "loss_factor": 3.0, "grad_norm_factor": 10.0,
        "rollback_after": 3, "max_rollbacks": 5,
        "inject_nan_steps": [], "inject_spike_steps": [], "inject_spike_factor": 100.0,
    },
    # Multi-rank start-up and liveness (training/preflight.py).
    "dist": {"preflight": True, "connect_timeout_s": 120.0, "collective_timeout_s": 1800.0,
             "heartbeat_s": 5.0, "heartbeat_timeout_s": 120.0},
    "eval": {"every_steps": None, "every_minutes": None, "batches": 50, "micro_batch_size": None, "at_end": True},
    "checkpoint": {"every_steps": None, "every_minutes": 30, "keep": 2, "resume": "auto", "at_end": True,
                   "hf": True},              # hf: HF-loadable weights in every checkpoint (step_N/hf/)
    "log": {"every_steps": 10, "tensorboard": True, "peak_tflops": None},
    "export": {"hf": True},
}

_OPEN_DICTS = {("model", "overrides"), ("train", "optimizer")}


class ConfigError(ValueError):
    pass


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
    t = cfg["train"]
    if t["max_steps"] is None and t["time_budget"] is None:
        raise ConfigError("set a budget: train.max_steps=N and/or train.time_budget=DURATION (e.g. '24h')")
    if t["max_steps"] is not None and (not isinstance(t["max_steps"], int) or t["max_steps"] <= 0):
        raise ConfigError(f"train.max_steps must be a positive integer, got {t['max_steps']!r}")
    for k in ("micro_batch_size", "global_batch_size"):
        if not isinstance(t[k], int) or t[k] <= 0:
            raise ConfigError(f"train.{k} must be a positive integer, got {t[k]!r}")
    if cfg["log"]["every_steps"] is None or cfg["log"]["every_steps"] < 1:
        raise ConfigError("log.every_steps must be >= 1")
    if cfg["checkpoint"]["keep"] < 1:
        raise ConfigError("checkpoint.keep must be >= 1 (the newest good checkpoint is never deleted)")
    g = cfg["guard"]
    for k in ("window", "min_history", "rollback_after"):
        if not isinstance(g[k], int) or g[k] < 1:
            raise ConfigError(f"guard.{k} must be a positive integer, got {g[k]!r}")
    if g["min_history"] > g["window"]:
        raise ConfigError("guard.min_history must be <= guard.window")
    for k in ("loss_factor", "grad_norm_factor"):
        if g[k] is not None and (not isinstance(g[k], (int, float)) or (g[k] and g[k] <= 1)):
            raise ConfigError(f"guard.{k} must be > 1 (or 0/null to turn that check off), got {g[k]!r}")
    for k in ("connect_timeout_s", "collective_timeout_s", "heartbeat_timeout_s"):
        if not isinstance(cfg["dist"][k], (int, float)) or cfg["dist"][k] <= 0:
            raise ConfigError(f"dist.{k} must be a positive number of seconds, got {cfg['dist'][k]!r}")
    hb, hbt = cfg["dist"]["heartbeat_s"], cfg["dist"]["heartbeat_timeout_s"]
    if hb and hbt < 2 * hb:
        raise ConfigError(f"dist.heartbeat_timeout_s ({hbt}) must be at least twice dist.heartbeat_s ({hb})")
    if cfg["checkpoint"]["resume"] not in ("auto", "never", "must") and not isinstance(cfg["checkpoint"]["resume"], str):
        raise ConfigError("checkpoint.resume is 'auto', 'never', 'must' or a checkpoint tag")
