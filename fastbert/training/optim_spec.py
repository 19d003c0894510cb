"""The optimizer's settings (``train.optimizer`` in a pretraining config, the fine-tuning flags): what to run,
checked without torch; ``optim.py`` builds it. DeepSpeed's config entry for the optimizers DeepSpeed builds
itself comes from here too."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OptimizerSpec:
    type: str = "adamw"
    lr: float = 1e-4
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.01
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.type = self.type.lower()
        if self.type not in ("adamw", "adam", "lamb"):
            raise ValueError(f"optimizer type {self.type!r} is not supported; use 'adamw' or 'lamb'")
        self.betas = tuple(float(b) for b in self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optimizer betas must be two numbers in [0, 1), got {self.betas}")

    @classmethod
    def from_dict(cls, d: dict) -> "OptimizerSpec":
        d = dict(d)
        known = {"type", "lr", "betas", "eps", "weight_decay"}
        return cls(**{k: d.pop(k) for k in list(d) if k in known}, extra=d)


def ds_optimizer_entry(spec: OptimizerSpec) -> dict:
    """The ``optimizer`` entry of a DeepSpeed config (DeepSpeed picks the fused/CPU implementation)."""
    params = {"lr": spec.lr, "betas": list(spec.betas), "eps": spec.eps, "weight_decay": spec.weight_decay}
    if spec.type in ("adamw", "adam"):
        params["adam_w_mode"] = spec.type == "adamw"
        params.update(spec.extra)
        return {"type": "Adam", "params": params}
    params.update(spec.extra)
    return {"type": "Lamb", "params": params}
