"""The pretraining config: a JSON file (configs/*.json) merged over DEFAULTS, plus ``key=value``
overrides from the command line (``train.max_steps=200``, ``data.dir=/scratch/wiki``; values are
parsed as JSON when they can be, else kept as strings), parsed ONCE at load into the dataclass
sections below (``cfg.train.max_steps``, ``cfg.data.masking.rate``). Unknown keys are errors, so a
typo never silently falls back to a default; every value is checked against its type
(config_keys.py) and the sections check what spans keys, all at load, before anything is created.
Relative paths are relative to the working directory.

config_keys.KEYS is the one table of keys, defaults, types and meanings; the sections name the same
keys as fields (tests/training/test_config_keys.py checks that they agree) and hold no defaults.
"""
from __future__ import annotations

import copy
import json
import math
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Optional, Union

from fastbert.errors import ConfigError
from fastbert.training.config_keys import KEYS, defaults, leaves, problem
from fastbert.training.schedules import parse_duration

DEFAULTS: dict = defaults()         # every key with its type and meaning: training/config_keys.py

_OPEN_DICTS = {("model", "overrides"), ("train", "optimizer")}


# ------------------------------------------------------------------------------------------ sections
@dataclass
class ModelSection:
    preset: str
    prenorm: bool
    kernels: str                    # auto | torch | triton (resolved against the device in build_model)
    head: str
    overrides: dict


@dataclass
class PrepareSection:
    corpus: Union[str, list]
    vocab: str
    seq_len: int
    nsp: bool
    val_fraction: float
    short_seq_prob: float
    seed: int
    workers: int


@dataclass
class MaskingSection:
    rate: float
    mask_prob: float
    random_prob: float
    random_tokens: str
    whole_word: bool

    def __post_init__(self):
        if self.mask_prob + self.random_prob > 1:
            raise ConfigError(f"data.masking.mask_prob + random_prob must be <= 1, got {self.mask_prob} + "
                              f"{self.random_prob}")


@dataclass
class DataSection:
    dir: str
    auto_prepare: bool
    prepare: PrepareSection
    masking: MaskingSection
    packing: str
    per_row: int
    pack_span: int
    prefetch: int

    @property
    def sequences_per_row(self) -> int:
        """Prepared sequences a row holds at most: ``per_row`` when packing, else 1."""
        return self.per_row if self.packing == "pack" else 1

    def span_for(self, micro_batch_size: int) -> int:
        """Rows a packing bin spans at this micro batch (``data/static_batch.py``): 1 without packing."""
        return math.gcd(self.pack_span, micro_batch_size) if self.packing == "pack" else 1


@dataclass
class TrainSection:
    micro_batch_size: int
    global_batch_size: int
    max_steps: Optional[int]
    time_budget: Union[str, float, None]     # as written ("24h"); time_budget_s is the parsed value
    warmup: float
    schedule: str
    optimizer: dict
    gradient_clipping: Optional[float]
    precision: str
    deepspeed: Optional[str]
    zero_stage: Union[str, int, None]
    cuda_graphs: bool
    seed: int
    deterministic: bool
    clock: str
    time_budget_s: Optional[float] = field(init=False, repr=False)

    def __post_init__(self):
        self.time_budget_s = None if self.time_budget is None else parse_duration(self.time_budget)
        if self.max_steps is None and self.time_budget is None:
            raise ConfigError("set a budget: train.max_steps=N and/or train.time_budget=DURATION (e.g. '24h')")
        if self.deepspeed is not None and not Path(self.deepspeed).is_file():
            raise ConfigError(f"train.deepspeed: {self.deepspeed} is not a file; see configs/ds_zero*.json")


@dataclass
class GuardSection:                 # the keys of training/guard.py's DEFAULTS; SpikeGuard takes as_dict()
    enabled: bool
    window: int
    min_history: int
    warmup_steps: int
    loss_factor: Optional[float]
    grad_norm_factor: Optional[float]
    noise_sigmas: float
    rollback_after: int
    max_rollbacks: int
    inject_nan_steps: list
    inject_spike_steps: list
    inject_spike_factor: float

    def __post_init__(self):
        if self.min_history > self.window:
            raise ConfigError("guard.min_history must be <= guard.window")


@dataclass
class DistSection:                  # the keys of training/preflight.py's DEFAULTS
    preflight: bool
    connect_timeout_s: float
    collective_timeout_s: float
    heartbeat_s: float
    heartbeat_timeout_s: float

    def __post_init__(self):
        hb, hbt = self.heartbeat_s, self.heartbeat_timeout_s
        if hb and hbt < 2 * hb:
            raise ConfigError(f"dist.heartbeat_timeout_s ({hbt}) must be at least twice dist.heartbeat_s ({hb})")


@dataclass
class EvalSection:
    every_steps: Optional[int]
    every_minutes: Optional[float]
    batches: int
    micro_batch_size: Optional[int]
    at_end: bool


@dataclass
class CheckpointSection:
    every_steps: Optional[int]
    every_minutes: Optional[float]
    keep: int
    resume: str
    at_end: bool
    hf: bool
    interrupt_timeout_s: float


@dataclass
class LogSection:
    every_steps: int
    tensorboard: bool
    peak_tflops: Optional[float]


@dataclass
class ExportSection:
    hf: bool


@dataclass
class PretrainConfig:
    output_dir: str
    model: ModelSection
    data: DataSection
    train: TrainSection
    guard: GuardSection
    dist: DistSection
    eval: EvalSection
    checkpoint: CheckpointSection
    log: LogSection
    export: ExportSection

    @classmethod
    def from_dict(cls, cfg: dict) -> "PretrainConfig":
        """Sections from a merged config whose values have passed their type checks."""
        return _build(cls, cfg)

    def to_dict(self) -> dict:
        """The nested dict of every key as set (config.json, the manifest, --show-config)."""
        return as_dict(self)


def _build(cls, values: dict):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _build(hints[f.name], values[f.name]) if is_dataclass(hints[f.name])
                  else copy.deepcopy(values[f.name]) for f in fields(cls) if f.init})


def as_dict(section) -> dict:
    """A section (or the whole config) as the nested dict of its keys, in their order."""
    return {f.name: as_dict(getattr(section, f.name)) if is_dataclass(getattr(section, f.name))
            else copy.deepcopy(getattr(section, f.name)) for f in fields(section) if f.init}


# ------------------------------------------------------------------------------------------ loading
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


def load_config(path=None, overrides=()) -> PretrainConfig:
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
    check_types(cfg)
    return PretrainConfig.from_dict(cfg)


def check_types(cfg: dict) -> None:
    """Every leaf of a merged config against its type in config_keys.KEYS."""
    types = {key: typ for key, _, typ, _ in KEYS}
    for key, value in leaves(cfg):
        if key not in types:
            raise ConfigError(f"{key} is a section, not a value: set its keys, e.g. "
                              f"{next(k for k in types if k.startswith(key + '.'))}=...")
        wrong = problem(key, value, types[key])
        if wrong:
            raise ConfigError(f"{key}={json.dumps(value)} {wrong} (fastbert pretrain --show-config lists every key)")
