"""Repeat a fine-tuning run over several seeds and report median and spread (``fastbert finetune
--seeds N``): GLUE-size dev sets swing by a point or more between seeds, so one number is not a
result.

    from fastbert.training.seeds import run_seeds
    report = run_seeds(lambda seed, out: run_finetune(..., output=out, train_args=replace(args, seed=seed)),
                       seeds=[42, 43, 44, 45, 46], out_dir=Path("runs/finetune-sst2"))

Each seed writes into ``OUT/seed-<seed>/`` (its own metrics, manifest and model); ``OUT/seeds.json``
gets the per-seed metrics and, per metric, median / mean / std / min / max. A seed that is already
finished (``OUT/seed-<seed>/metrics.json`` present) is read back instead of rerun, so an
interrupted sweep continues where it stopped.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Optional

from fastbert.io import atomic_write_text
from fastbert.training.manifest import build_manifest, seed_summary, write_manifest


def seed_dir(out_dir: Path, seed: int) -> Path:
    return Path(out_dir) / f"seed-{seed}"


def _finished(out_dir: Path, seed: int) -> Optional[dict]:
    path = seed_dir(out_dir, seed) / "metrics.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return data.get("metrics", data) if isinstance(data, dict) else None


def run_seeds(run_one: Callable[[int, Path], dict], seeds: Iterable[int], out_dir, *, config: Optional[dict] = None,
              log: Callable[[str], None] = print) -> dict:
    """``run_one(seed, seed_out_dir)`` returns that run's dev metrics ``{name: value}``. Returns (and
    writes, from rank 0, to ``out_dir/seeds.json``) ``{"seeds", "per_seed", "summary"}``."""
    out_dir = Path(out_dir)
    seeds = [int(s) for s in seeds]
    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"seeds must be distinct and at least one, got {seeds}")
    per_seed: dict[int, dict] = {}
    for i, seed in enumerate(seeds):
        done = _finished(out_dir, seed)
        if done is not None:
            log(f"[seeds] seed {seed}: already finished, read from {seed_dir(out_dir, seed)}")
            per_seed[seed] = done
            continue
        log(f"[seeds] seed {seed} ({i + 1}/{len(seeds)})")
        per_seed[seed] = dict(run_one(seed, seed_dir(out_dir, seed)))
    summary = seed_summary(per_seed)
    report = {"seeds": seeds, "per_seed": {str(s): m for s, m in per_seed.items()}, "summary": summary}
    if int(os.environ.get("RANK", "0")) == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "seeds.json", json.dumps(report, indent=1) + "\n")
        write_manifest(out_dir / "manifest.json",
                       build_manifest("finetune-seeds", config=config or {}, seed=None, seeds=seeds,
                                      metrics=summary))
        log(format_summary(summary, len(seeds)))
    return report


def format_summary(summary: dict, n: int) -> str:
    lines = [f"over {n} seed(s): metric  median  [min, max]  mean +- std"]
    for name, s in sorted(summary.items()):
        lines.append(f"  {name}  {s['median']:.4f}  [{s['min']:.4f}, {s['max']:.4f}]  {s['mean']:.4f} +- {s['std']:.4f}")
    return "\n".join(lines)
