"""Run manifests: what produced a checkpoint or a result, in one ``manifest.json``.

A manifest records the config, the seed, package versions, the git commit of the fastbert checkout,
the hardware (and, for distributed runs, every rank's host and device from the preflight), the
measured throughput and the latest evaluation. Pretraining writes one into every checkpoint and
keeps ``OUTPUT_DIR/manifest.json`` current; ``seed_summary`` condenses per-seed fine-tuning scores
(``fastbert finetune --seeds N``) into median and spread.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Optional

from fastbert.io import atomic_write_text

PACKAGES = ("fastbert", "torch", "deepspeed", "triton", "transformers", "tokenizers", "numpy", "safetensors")


@lru_cache(maxsize=1)
def package_versions() -> dict:
    """Versions of the packages that decide numerics and behaviour (None = not installed)."""
    from importlib import metadata
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        import torch
        out["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["cudnn"] = torch.backends.cudnn.version()
            nccl = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # noqa: BLE001 - a manifest never fails a run
        pass
    return out


@lru_cache(maxsize=1)
def git_info() -> Optional[dict]:
    """Commit of the checkout fastbert is imported from, and whether tracked files differ from it."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": commit or None, "dirty": bool(status.strip())}


def _cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    return None


def hardware() -> dict:
    """This host: CPU, memory, visible GPUs."""
    import torch
    hw = {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": _cpu_model(),
          "cpu_count": os.cpu_count(), "memory_gib": _memory_gib(), "gpus": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            hw["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2 ** 30, 1),
                               "capability": f"{p.major}.{p.minor}"})
    return hw


def build_manifest(kind: str, *, config: dict, seed: Optional[int], step: Optional[int] = None,
                   throughput: Optional[dict] = None, distributed: Optional[dict] = None, **extra) -> dict:
    return {
        "kind": kind,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": step,
        "seed": seed,
        "command": sys.argv,
        "config": config,
        "packages": package_versions(),
        "git": git_info(),
        "hardware": hardware(),
        "distributed": distributed,
        "throughput": throughput,
        **extra,
    }


def write_manifest(path, manifest: dict) -> Path:
    path = Path(path)
    atomic_write_text(path, json.dumps(manifest, indent=1, default=str) + "\n")
    return path


def _flat(scores: dict, prefix: str = "") -> dict:
    """Nested metrics (MNLI's matched / mismatched) as ``{"matched/accuracy": ...}``."""
    out = {}
    for name, value in scores.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{name}/"))
        else:
            out[f"{prefix}{name}"] = value
    return out


def seed_summary(per_seed: dict) -> dict:
    """``{seed: {metric: value}}`` -> ``{metric: {median, mean, std, min, max, n, values}}`` over the
    seeds that report the metric (std is the sample standard deviation; 0 for one seed)."""
    metrics: dict[str, dict] = {}
    for seed, scores in sorted(per_seed.items()):
        for name, value in _flat(scores).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics.setdefault(name, {})[seed] = float(value)
    out = {}
    for name, by_seed in metrics.items():
        values = list(by_seed.values())
        out[name] = {"median": statistics.median(values), "mean": statistics.fmean(values),
                     "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                     "min": min(values), "max": max(values), "n": len(values),
                     "values": {str(s): v for s, v in by_seed.items()}}
    return out
