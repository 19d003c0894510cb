"""Checkpoints: DeepSpeed state + per-rank RNG/data state, consolidated HF weights, a manifest, a
completion marker, ``latest``, retention.

Layout of ``<dir>``::

    step_00000100/                     one tag per checkpoint
        mp_rank_00_model_states.pt     DeepSpeed (model, client state)
        *_optim_states.pt              DeepSpeed (ZeRO partitions of the optimizer)
        fastbert_rank00000.pt          this rank's RNG states and loader position (torch.save)
        hf/                            HF-loadable weights (config.json, model.safetensors, vocab.txt):
                                       fine-tune from here, no conversion step (written atomically)
        manifest.json                  config, seed, versions, git commit, hardware, throughput
        fastbert_complete.json         written LAST, atomically, by rank 0 after every rank finished;
                                       holds "good" (finite weights, no guard failure streak) and the
                                       SHA-256 of the weights (checked again on resume)
    latest                             tag of the newest COMPLETE checkpoint (atomic rename)

A crash in the middle of a save leaves a tag without ``fastbert_complete.json``: it is never loaded
and is removed by the next successful save. Retention keeps the ``keep`` newest complete checkpoints
AND the newest good one, so the checkpoint a rollback needs is never deleted. Assumes ``<dir>`` is on
a file system shared by all nodes.
"""
from __future__ import annotations

import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from fastbert.io import atomic_path, atomic_write_text
from fastbert.training.engine import TrainEngine, barrier

MARKER = "fastbert_complete.json"
TAG_RE = re.compile(r"^step_(\d{8,})$")
UNIVERSAL_SUFFIX = "_universal"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"fastbert_rank{rank:05d}.pt"


def complete_tags(ckpt_dir: Path) -> list[tuple[int, str]]:
    """(step, tag) of complete checkpoints, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = TAG_RE.match(p.name)
        if m and p.is_dir() and (p / MARKER).is_file():
            found.append((int(m.group(1)), p.name))
    return sorted(found)


def read_marker(ckpt_dir, tag: str) -> dict:
    return json.loads((Path(ckpt_dir) / tag / MARKER).read_text())


def is_good(ckpt_dir, tag: str) -> bool:
    """Checkpoints written before the "good" field existed count as good."""
    try:
        return bool(read_marker(ckpt_dir, tag).get("good", True))
    except (OSError, json.JSONDecodeError):
        return False


def find_latest_good(ckpt_dir) -> Optional[str]:
    """Tag of the newest complete checkpoint marked good (the rollback target), else None."""
    for _, tag in reversed(complete_tags(ckpt_dir)):
        if is_good(ckpt_dir, tag):
            return tag
    return None


def find_latest(ckpt_dir) -> Optional[str]:
    """Tag of the newest complete checkpoint (``latest`` if it names a complete one), else None."""
    ckpt_dir = Path(ckpt_dir)
    latest = ckpt_dir / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if (ckpt_dir / tag / MARKER).is_file():
            return tag
    tags = complete_tags(ckpt_dir)
    return tags[-1][1] if tags else None


def capture_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(engine: TrainEngine, ckpt_dir, step: int, client_state: dict, rank_state: dict,
                    keep: int = 2, info: Optional[dict] = None,
                    extra: Optional[Callable[[Path], None]] = None) -> Path:
    """Collective: every rank must call it. ``extra(tag_dir)`` runs on every rank once the DeepSpeed
    and rank files are complete and before the marker (HF weights, manifest). ``info`` goes into the
    marker. Returns the tag directory."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    rank = engine.dist.rank
    if rank == 0 and tag_dir.exists():
        shutil.rmtree(tag_dir)        # a stale, incomplete save of the same step
    barrier()
    client_state = dict(client_state, world_size=engine.dist.world_size, step=step)
    engine.ds.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    rank_state = dict(rank_state, rng=capture_rng_state(), rank=rank, world_size=engine.dist.world_size)
    with atomic_path(rank_file(tag_dir, rank)) as tmp:
        torch.save(rank_state, tmp)
    barrier()
    if extra is not None:
        extra(tag_dir)
        barrier()
    if rank == 0:
        marker = {"step": step, "tag": tag, "world_size": engine.dist.world_size, "time": time.time(),
                  **(info or {})}
        atomic_write_text(tag_dir / MARKER, json.dumps(marker, indent=1) + "\n")
        atomic_write_text(ckpt_dir / "latest", tag + "\n")
        apply_retention(ckpt_dir, keep)
    barrier()
    return tag_dir


def apply_retention(ckpt_dir: Path, keep: int) -> list[str]:
    """Delete complete checkpoints beyond the ``keep`` newest, except the newest GOOD one, and
    incomplete ones older than the newest complete one. Returns the removed tags."""
    keep = max(1, int(keep))
    tags = complete_tags(ckpt_dir)
    if not tags:
        return []
    newest = tags[-1][0]
    good = find_latest_good(ckpt_dir)
    removed = [t for _, t in tags[:-keep] if t != good]
    for p in Path(ckpt_dir).iterdir():
        m = TAG_RE.match(p.name)
        if m and p.is_dir() and not (p / MARKER).is_file() and int(m.group(1)) < newest:
            removed.append(p.name)
    for t in removed:
        shutil.rmtree(Path(ckpt_dir) / t, ignore_errors=True)
    for p in Path(ckpt_dir).glob(f"step_*{UNIVERSAL_SUFFIX}"):    # conversions of deleted checkpoints
        if not (Path(ckpt_dir) / p.name[:-len(UNIVERSAL_SUFFIX)]).is_dir():
            shutil.rmtree(p, ignore_errors=True)
    return removed


def checkpoint_world_size(ckpt_dir, tag: str) -> int:
    return int(json.loads((Path(ckpt_dir) / tag / MARKER).read_text())["world_size"])


def convert_to_universal(ckpt_dir, tag: str) -> str:
    """Convert checkpoint ``tag`` into DeepSpeed's universal format (``<tag>_universal``), which loads on
    any number of ranks. Runs DeepSpeed's converter in a subprocess; call on one rank only."""
    import os
    import subprocess
    import sys
    ckpt_dir = Path(ckpt_dir)
    target = ckpt_dir / (tag + UNIVERSAL_SUFFIX)
    if (target / MARKER).is_file():
        return target.name
    tmp = ckpt_dir / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt_dir / tag),
           "--output_folder", str(tmp), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if res.returncode != 0:
        raise RuntimeError(f"converting {ckpt_dir / tag} to DeepSpeed's universal format failed:\n{res.stderr[-3000:]}")
    marker = json.loads((ckpt_dir / tag / MARKER).read_text())
    atomic_write_text(tmp / MARKER, json.dumps(dict(marker, universal=True, source=tag), indent=1) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target.name


def load_checkpoint(engine: TrainEngine, ckpt_dir, tag: Optional[str] = None,
                    load_optimizer: bool = True) -> tuple[dict, Optional[dict]]:
    """Load model + optimizer (DeepSpeed) and this rank's state. Returns ``(client_state, rank_state)``;
    ``rank_state`` is None when the checkpoint was written with a different number of ranks (model,
    optimizer, schedule and data position still resume; RNG streams are then re-seeded)."""
    ckpt_dir = Path(ckpt_dir)
    tag = tag or find_latest(ckpt_dir)
    if tag is None:
        raise FileNotFoundError(f"no complete checkpoint in {ckpt_dir}")
    if not (ckpt_dir / tag).is_dir():
        have = [t for _, t in complete_tags(ckpt_dir)]
        raise FileNotFoundError(f"checkpoint {ckpt_dir / tag} not found; complete checkpoints there: {have or 'none'}")
    if not (ckpt_dir / tag / MARKER).is_file():
        raise FileNotFoundError(f"checkpoint {ckpt_dir / tag} is incomplete (no {MARKER}); it was interrupted "
                                "while saving: resume from an earlier tag")
    path, client_state = engine.ds.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=load_optimizer,
                                                   load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    client_state = client_state or {}
    rank_state = None
    if client_state.get("world_size") == engine.dist.world_size:
        f = rank_file(ckpt_dir / tag, engine.dist.rank)
        if f.is_file():
            rank_state = torch.load(f, map_location="cpu", weights_only=False)
            restore_rng_state(rank_state["rng"])
    return client_state, rank_state
