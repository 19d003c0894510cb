"""Where a pretraining run starts: which checkpoint, whether it fits this model, and on how many ranks.

Guarantee when the number of ranks changes (the global batch stays the same; the checkpoint is
converted once to DeepSpeed's universal format and loaded on the new rank count):

* identical: the model weights (bit for bit; the SHA-256 stored in the checkpoint marker is checked
  on load and logged as ``weights_match``), the optimizer state (fp32 masters and Adam moments), the
  step count, the learning-rate schedule (step-based: the same LR at every step; time-based: the
  elapsed training time carries over), the guard's statistics and the data stream: step ``s``
  trains on exactly the same sequences, because the global order depends only on the seed and the
  global batch, never on how a batch is split over ranks and accumulation steps;
* not identical: which tokens get masked and the dropout masks (per-rank random streams, re-seeded
  from (seed, rank, step) because the old ranks' streams do not map onto the new ones), and the
  floating-point order of the gradient reduction. The loss after the change therefore follows the
  same curve statistically, not bit for bit; with the same rank count a resume IS bit-identical.
"""
from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fastbert.training import checkpoint as ckpt
from fastbert.training.engine import DistInfo, barrier

SIGNATURE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "max_position_embeddings", "type_vocab_size", "prenorm")


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run; the message says what to do."""


def model_signature(model) -> dict:
    c = model.config
    sig = {k: getattr(c, k) for k in SIGNATURE_KEYS}
    sig["head"] = type(model).__name__
    return sig


def check_signature(ckpt_dir: Path, tag: str, signature: dict) -> None:
    saved = ckpt.read_marker(ckpt_dir, tag).get("model")
    if not saved:
        return                        # written before signatures existed
    diff = {k: (saved.get(k), v) for k, v in signature.items() if saved.get(k) != v}
    if diff:
        listing = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
        raise ResumeError(f"checkpoint {ckpt_dir / tag} belongs to a different model ({listing}; e.g. data "
                          "prepared with another vocabulary); use a new output_dir, or checkpoint.resume=never to "
                          "start over in this one")


def choose_resume(resume, ckpt_dir: Path, dist: DistInfo, ds_config: dict, log,
                  signature: Optional[dict] = None) -> tuple[Optional[str], dict]:
    """The checkpoint tag to resume from (None = fresh start) and the DeepSpeed config to build with.
    ``auto``/``must`` take the newest complete checkpoint, or the newest GOOD one when the newest is
    marked bad. A checkpoint written by another number of ranks is converted to DeepSpeed's universal
    format once (rank 0) and loaded from there."""
    if resume == "never":
        return None, ds_config
    tag = resume if resume not in ("auto", "must") else ckpt.find_latest(ckpt_dir)
    if tag is None:
        if resume == "must":
            raise FileNotFoundError(f"checkpoint.resume=must but {ckpt_dir} holds no complete checkpoint")
        return None, ds_config
    if not (ckpt_dir / tag / ckpt.MARKER).is_file():
        raise FileNotFoundError(f"checkpoint {ckpt_dir / tag} not found or incomplete; complete checkpoints: "
                                f"{[t for _, t in ckpt.complete_tags(ckpt_dir)] or 'none'}")
    if resume in ("auto", "must") and not ckpt.is_good(ckpt_dir, tag):
        good = ckpt.find_latest_good(ckpt_dir)
        if good is not None:
            log.print(f"[fastbert] {tag} is marked bad (non-finite weights or a guard failure streak); "
                      f"resuming from the last good checkpoint {good}")
            tag = good
    if signature is not None:
        check_signature(ckpt_dir, tag, signature)
    return universal_if_needed(ckpt_dir, tag, dist, ds_config, log)


def universal_if_needed(ckpt_dir: Path, tag: str, dist: DistInfo, ds_config: dict, log) -> tuple[str, dict]:
    universal = dict(ds_config, checkpoint=dict(ds_config.get("checkpoint", {}), load_universal=True))
    if tag.endswith(ckpt.UNIVERSAL_SUFFIX):
        return tag, universal
    saved_world = ckpt.checkpoint_world_size(ckpt_dir, tag)
    if saved_world == dist.world_size:
        return tag, ds_config
    if ckpt.read_marker(ckpt_dir, tag).get("zero_stage") == 0 and \
            ds_config.get("zero_optimization", {}).get("stage", 0) == 0:
        # ZeRO-0 checkpoints hold whole (unpartitioned) states: every rank count loads them as they are.
        return tag, ds_config
    log.print(f"[fastbert] {tag} was written by {saved_world} ranks; converting it to DeepSpeed's universal "
              f"format to resume on {dist.world_size}")
    if dist.is_main:
        ckpt.convert_to_universal(ckpt_dir, tag)
    barrier()
    return tag + ckpt.UNIVERSAL_SUFFIX, universal


def reseed(seed: int, rank: int, step: int, collator) -> None:
    """Fresh per-rank RNG streams for a resume on another rank count: a function of (seed, rank, step),
    so the run stays reproducible and never replays the masks of step 0."""
    digest = hashlib.sha256(f"fastbert-reseed:{seed}:{rank}:{step}".encode()).digest()
    s = int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)
    random.seed(s)
    np.random.seed(s % 2 ** 32)
    torch.manual_seed(s)
    collator.generator.manual_seed(s ^ 0x5DEECE66D)
