"""Shared pieces of the reliability tests: the pretraining harness of tests/training, a tiny model
config (1 layer, hidden 32) on a 32-token slice of the real Wikipedia sample, and CLI runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))

from pretrain_harness import (REPO, by_step, cpu_env, free_port, kill9, launch, prepare_slice,  # noqa: E402,F401
                              records, run, torchrun_cmd, wait, wait_for, write_config)
from pretrain_harness import descendants as descendants_of  # noqa: E402,F401

TINY_MODEL = {"preset": "tiny", "overrides": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                              "intermediate_size": 64}}


def tiny_config(data: Path, out: Path, *, steps: int = 20, ckpt_every: int = 5, keep: int = 2, **sections) -> dict:
    """One process, ZeRO-1 fp32, global batch 8 = 4 x 2 accumulation; dropout stays on."""
    cfg = {
        "output_dir": str(out),
        "model": TINY_MODEL,
        "data": {"dir": str(data), "auto_prepare": False},
        "train": {"micro_batch_size": 4, "global_batch_size": 8, "max_steps": steps, "precision": "fp32",
                  "zero_stage": 1, "optimizer": {"type": "adamw", "lr": 1e-3}},
        "eval": {"every_steps": None, "batches": 2, "at_end": True},
        "checkpoint": {"every_steps": ckpt_every, "every_minutes": None, "keep": keep},
        "log": {"every_steps": 1, "tensorboard": False},
        "export": {"hf": True},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def cli_cmd(config: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "fastbert.cli", "pretrain", "--config", str(config), *overrides]


def run_cli(config: Path, log_path: Path, *overrides: str, timeout: float = 240) -> None:
    run(cli_cmd(config, *overrides), log_path, timeout)


def marker(ckpt_dir: Path, tag: str) -> dict:
    return json.loads((ckpt_dir / tag / "fastbert_complete.json").read_text())


def checkpoint_tags(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step_")
                  and (p / "fastbert_complete.json").is_file())
