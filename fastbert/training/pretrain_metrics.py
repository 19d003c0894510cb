"""Pretraining measurements: device-side sums over a logging window, evaluation on fixed validation
batches, and the train metrics (loss, accuracy, throughput, MFU, ETA) the loop logs."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from fastbert.training.engine import TrainEngine, all_reduce_sum, to_device
from fastbert.training.logging import train_flops_per_sequence


class Accumulator:
    """Device-side sums over a logging window (no host sync until ``reduce``)."""

    KEYS = ("loss", "micro", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "tokens", "sequences")
    HOST = (1, 6, 7)            # micro, tokens, sequences: counted on the host, moved once per merge

    def __init__(self, device):
        self.device = torch.device(device)
        self._host_index = torch.tensor(self.HOST, device=self.device)
        self.reset()

    def reset(self):
        self.t = torch.zeros(len(self.KEYS), dtype=torch.float64, device=self.device)
        self.host = [0.0] * len(self.HOST)

    def add(self, out, next_sentence_label, tokens: int, sequences: int):
        """Add one micro-batch: the model's device scalars; the host counts stay on the host."""
        zero = out.loss.detach().new_zeros((), dtype=torch.float64)
        dev = lambda v: zero if v is None else v.detach().double()  # noqa: E731
        nsp, nsp_count = getattr(out, "nsp_correct", None), getattr(out, "nsp_count", None)
        if nsp is None or next_sentence_label is None:
            nsp = nsp_count = None
        elif nsp_count is None:
            nsp_count = zero + float(next_sentence_label.numel())
        self.t += torch.stack([dev(out.loss), zero, dev(getattr(out, "mlm_correct", None)),
                               dev(getattr(out, "mlm_count", None)), dev(nsp), dev(nsp_count), zero, zero])
        for i, v in enumerate((1.0, float(tokens), float(sequences))):
            self.host[i] += v

    def merge(self, other: "Accumulator", weight: Optional[torch.Tensor] = None) -> None:
        """Add ``other``'s sums (times a device 0/1 ``weight``: the guard's verdict, not read here)."""
        host = torch.tensor(other.host, dtype=torch.float64, pin_memory=self.device.type == "cuda")
        t = other.t.index_add(0, self._host_index,
                              host.to(self.device, non_blocking=True))
        self.t += t if weight is None else t * weight
        other.reset()

    def reduce(self, extra: list[float]) -> tuple[dict, list[float]]:
        """All-reduce (sum) the window and ``extra`` values in one collective."""
        import torch.distributed as dist
        t = torch.cat([self.t, torch.tensor(extra, dtype=torch.float64, device=self.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        vals = t.tolist()
        self.reset()
        return dict(zip(self.KEYS, vals[:len(self.KEYS)])), vals[len(self.KEYS):]


def host_counts(batch: dict, per_row: int, span: int = 1) -> tuple[int, int]:
    """Real tokens and sequences of a loader batch, counted on its host tensors (``numpy()`` refuses a
    device tensor: this never waits on the GPU). ``span``: rows a packing bin spans (its first ``span *
    per_row`` segments are sequences, data/static_batch.py)."""
    cu = batch["cu_seqlens"].numpy()
    return int(batch["attention_mask"].numpy().sum()), \
        int((np.diff(cu, axis=-1).reshape(-1, span * (per_row + 1))[:, :span * per_row] > 0).sum())


def static_inputs(batch: dict, collator, device, span: int = 1) -> dict:
    """Model kwargs for one static-shape micro-batch (data/static_batch.py): masking on the device into
    the collator's fixed slots; every shape is fixed by (rows, seq_len, per_row). The masking sees each
    packing bin of ``span`` rows as one row (a word or sequence may continue into the next row)."""
    b = to_device(batch, device)
    rows, seq_len = b["input_ids"].shape
    ids, positions, targets = collator.masked_slots(b["input_ids"].view(rows // span, span * seq_len),
                                                    b["attention_mask"].view(rows // span, span * seq_len))
    packed = {"input_ids": ids.view(rows, seq_len), "token_type_ids": b["token_type_ids"],
              "position_ids": b["position_ids"], "cu_seqlens": b["cu_seqlens"], "max_seqlen": seq_len,
              "mlm_positions": positions, "mlm_targets": targets}
    if "next_sentence_label" in b:
        packed["cls_positions"] = b["cls_positions"]
        packed["next_sentence_label"] = b["next_sentence_label"]
    return {"packed": packed}


def evaluate(engine: TrainEngine, batches: list, collator, collator_state: dict) -> dict:
    """MLM loss / accuracy (and NSP accuracy) on the fixed validation batches, all ranks together.
    The eval collator restarts from the same state each time: the same tokens are masked every eval."""
    collator.load_state_dict(collator_state)
    engine.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=engine.device)
    has_nsp = getattr(engine.module, "has_nsp", False)
    with torch.no_grad():
        for batch in batches:
            kw = static_inputs(batch, collator, engine.device)
            if not has_nsp:
                kw["packed"].pop("next_sentence_label", None)
            out = engine(**kw)
            count = out.mlm_count.double()
            mlm_loss = out.mlm_loss if getattr(out, "mlm_loss", None) is not None else out.loss
            zero = count * 0
            nsp_c = out.nsp_correct.double() if getattr(out, "nsp_correct", None) is not None else zero
            nsp_n = out.nsp_count.double() if getattr(out, "nsp_count", None) is not None else zero
            sums += torch.stack([mlm_loss.detach().double() * count, out.mlm_correct.double(), count, nsp_c, nsp_n])
    engine.train()
    loss_x_n, correct, n, nsp_c, nsp_n = all_reduce_sum(sums.tolist(), engine.device)
    result = {"mlm_loss": loss_x_n / max(n, 1), "mlm_acc": correct / max(n, 1), "mlm_tokens": n}
    if nsp_n:
        result["nsp_acc"] = nsp_c / nsp_n
    return result


def train_metrics(s: dict, engine: TrainEngine, lr: float, steps: int, dt: float, mc, avg_len, peak) -> dict:
    # Real sequences (several share a row when packing), the unit HF's sequences/s counts too.
    seqs = s["sequences"] or steps * engine.global_batch_size
    seq_per_s = seqs / dt if dt > 0 else 0.0
    tokens_per_s = s["tokens"] / dt if dt > 0 else 0.0
    # A window whose every step the guard skipped has no loss to report.
    m = {"loss": s["loss"] / s["micro"] if s["micro"] else float("nan"), "lr": lr, "seq_per_s": seq_per_s, "tokens_per_s": tokens_per_s,
         "skipped_steps": engine.skipped_steps, "grad_norm": engine.grad_norm()}
    if s["mlm_count"]:
        m["mlm_acc"] = s["mlm_correct"] / s["mlm_count"]
    if s["nsp_count"]:
        m["nsp_acc"] = s["nsp_correct"] / s["nsp_count"]
    if engine.loss_scale is not None:
        m["loss_scale"] = engine.loss_scale
    if peak and seq_per_s:
        seq_len = s["tokens"] / max(1.0, seqs)
        masked = s["mlm_count"] / max(1.0, seqs)
        flops = train_flops_per_sequence(mc.hidden_size, mc.num_hidden_layers, mc.intermediate_size, mc.vocab_size,
                                         seq_len or avg_len, masked)
        m["mfu"] = flops * seq_per_s / (peak * 1e12 * engine.dist.world_size)
    return m
