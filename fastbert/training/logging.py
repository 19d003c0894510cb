"""Training logs: console progress (seq/s, tokens/s, MFU, ETA), JSONL, TensorBoard; the FLOP model.

Only rank 0 writes. JSONL lines are ``{"event": "train"|"eval"|"checkpoint"|..., "step": ..., "run": ...}``
and are flushed at once so a killed run keeps everything it logged. A resumed run appends to the same
file; ``run`` (start time and process id, e.g. ``20261126-093400-4242``) tells the runs apart.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

# Dense bf16 peak of common cards (TFLOP/s, no sparsity), used for MFU when not given in the config.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "A10G": 125.0, "L4": 121.0, "V100": 125.0}


def peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def train_flops_per_sequence(hidden: int, layers: int, intermediate: int, vocab: int, seq_len: float,
                             masked_per_seq: float) -> float:
    """Training FLOPs (forward + backward = 3 x forward, 2 FLOPs per multiply-add) of one sequence.

    Per token and layer: QKV + output projections ``4 H^2`` and the FFN ``2 H I`` multiply-adds;
    attention scores and weighted sum ``2 S H``. The sparse MLM head costs ``H^2 + H V`` only per
    masked token; NSP and embeddings are negligible.
    """
    per_token = layers * (4 * hidden * hidden + 2 * hidden * intermediate + 2 * seq_len * hidden)
    head = masked_per_seq * (hidden * hidden + hidden * vocab)
    return 6.0 * (seq_len * per_token + head)


def _fmt_duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class MetricsLogger:
    def __init__(self, out_dir, enabled: bool = True, tensorboard: bool = True, console=sys.stdout):
        self.enabled = enabled
        self.console = console
        self.out_dir = Path(out_dir)
        self.want_tensorboard = tensorboard
        self.jsonl = None
        self.tb = None
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

    def _open(self) -> None:
        """Files are created at the first record, so a run that fails its checks leaves nothing behind."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.out_dir / "metrics.jsonl", "a", buffering=1)
        if self.want_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.out_dir / "tensorboard"))
            except Exception as e:  # tensorboard missing is not fatal: the JSONL has everything
                self.print(f"[fastbert] TensorBoard disabled ({e.__class__.__name__}: {e})")

    def print(self, text: str) -> None:
        if self.enabled and self.console is not None:
            print(text, file=self.console, flush=True)

    def log(self, event: str, step: int, **values) -> None:
        if not self.enabled:
            return
        if self.jsonl is None:
            self._open()
        record = {"event": event, "step": step, "time": time.time(), "run": self.run_id, **values}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(f"{event}/{k}", v, step)

    def progress(self, step: int, total: Optional[int], m: dict, eta_s: float) -> None:
        parts = [f"step {step}" + (f"/{total}" if total else ""), f"loss {m['loss']:.4f}"]
        if m.get("mlm_acc") is not None:
            parts.append(f"mlm_acc {m['mlm_acc']:.3f}")
        parts.append(f"lr {m['lr']:.3g}")
        parts.append(f"{m['seq_per_s']:.1f} seq/s")
        parts.append(f"{m['tokens_per_s']:.0f} tok/s")
        if m.get("mfu") is not None:
            parts.append(f"MFU {100 * m['mfu']:.1f}%")
        if m.get("skipped_steps"):
            parts.append(f"skipped {m['skipped_steps']}")
        if m.get("loss_scale") is not None:
            parts.append(f"scale {m['loss_scale']:.0f}")
        parts.append(f"ETA {_fmt_duration(eta_s)}")
        self.print(" | ".join(parts))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
