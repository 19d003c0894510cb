"""Consolidated HF weights next to the sharded DeepSpeed state, and a fingerprint of the weights.

``write_hf_dir`` writes an HF-loadable folder (``config.json``, ``model.safetensors``, ``vocab.txt``,
``tokenizer_config.json``) from the fp32 weights, atomically: everything goes to a hidden sibling
folder first, which is renamed into place once complete. The weights come from the module itself
when it holds them in full and in fp32 (ZeRO 0-2 in fp32 or bf16, which is autocast over fp32 weights),
else from DeepSpeed's fp32 consolidation of the checkpoint just written (ZeRO-3 partitions, or fp16's
16-bit module weights with fp32 masters in the optimizer). Only rank 0 reads and writes; no collectives.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json")


def module_holds_fp32_weights(engine) -> bool:
    """ZeRO 0-2 with fp32 parameters: fp32 runs and bf16 (autocast over fp32 weights). fp16 keeps 16-bit
    module weights (fp32 masters in the optimizer), ZeRO-3 partitions them."""
    return engine.zero_stage < 3 and all(p.dtype == torch.float32 for p in engine.module.parameters())


def consolidated_model(engine, model_cls, config, ckpt_dir: Path, tag: str):
    """The trained model with full fp32 weights (rank 0 only; call after the checkpoint is on disk)."""
    if module_holds_fp32_weights(engine):
        return engine.module
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    model = model_cls(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # The decoder weight is the tied word embedding: absent from DeepSpeed's de-duplicated dict.
    missing = [k for k in missing if not k.endswith("predictions.decoder.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF export: checkpoint/model mismatch (missing {missing}, unexpected {unexpected})")
    return model


def write_hf_dir(model, target: Path, data_dir: Optional[Path] = None) -> Path:
    """Write ``model`` (+ the tokenizer files of ``data_dir``) to ``target`` atomically."""
    target = Path(target)
    tmp = target.parent / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if data_dir is not None and (Path(data_dir) / name).is_file():
            shutil.copyfile(Path(data_dir) / name, tmp / name)
    replace_dir(tmp, target)
    return target


def replace_dir(src: Path, target: Path) -> None:
    """Move folder ``src`` to ``target``, replacing an existing ``target`` (the old one is moved aside
    first, so a reader sees either the old or the new complete folder, never a mix)."""
    old = target.parent / f".{target.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(src, target)
    shutil.rmtree(old, ignore_errors=True)


def copy_hf_dir(source: Path, target: Path) -> Path:
    """Publish a checkpoint's ``hf/`` folder as ``target`` (copy, then atomic rename)."""
    tmp = target.parent / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    replace_dir(tmp, target)
    return target


def weights_fingerprint(module: torch.nn.Module) -> Optional[str]:
    """SHA-256 over the parameter names and bytes (shared tensors once); None when the module does not
    hold its weights (ZeRO-3 partitions them). Equal fingerprints = bit-identical weights."""
    h = hashlib.sha256()
    seen = set()
    for name, p in sorted(module.named_parameters(remove_duplicate=False), key=lambda kv: kv[0]):
        if hasattr(p, "ds_tensor") or p.numel() == 0:
            return None
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = p.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def all_finite(module: torch.nn.Module) -> bool:
    """True when every parameter this rank holds (its ZeRO-3 partition, else the full tensor) is finite."""
    flags = []
    for p in module.parameters():
        t = getattr(p, "ds_tensor", None)
        t = p.detach() if t is None else t
        if t.numel():
            flags.append(torch.isfinite(t).all())
    return not flags or bool(torch.stack(flags).all())   # one read, not one per parameter
