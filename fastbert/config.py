"""BertConfig: one dataclass passed whole to every module, with presets and HF config.json I/O."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fastbert.errors import ConfigError

KERNELS = ("torch", "triton")

# Published BERT shapes (Devlin et al. 2019; the compact models of Turc et al. 2019).
# name: (layers, hidden); heads = hidden / 64, intermediate = 4 * hidden.
PRESETS = {
    "tiny": (2, 128),
    "mini": (4, 256),
    "small": (4, 512),
    "medium": (8, 512),
    "base": (12, 768),
    "large": (24, 1024),
}

# Activations, the one map of their names: fastbert's name -> torch's GELU ``approximate`` (what
# the fused bias + GELU op takes); HF's config.json names -> fastbert's on load, and back on save.
GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}
ACTIVATIONS = tuple(GELU_APPROXIMATE)
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_HF_ACT_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0
    # HF's field; only "absolute" is implemented (relative_key / relative_key_query are refused).
    position_embedding_type: str = "absolute"
    prenorm: bool = False
    # "torch" | "triton", or "auto" (or None): resolved when the config is made or validated, by the one
    # rule fastbert.ops.resolve_kernels (no device known here: triton when CUDA is available). Callers
    # that know the model's device resolve against it first (fastbert pretrain's model.kernels).
    kernels: str = "torch"
    # BertForPreTraining / BertForMaskedLM with labels: False (HF's outputs) also returns the dense
    # (batch, seq, vocab) logits; True returns only the sparse MLM loss (never the full logits), the
    # speed path `fastbert pretrain` sets. Runtime only: not written to config.json.
    sparse_prediction: bool = False
    # True: in training forwards the encoder's linear layers run their GEMMs in FP8 with per-tensor
    # delayed scaling (fastbert/ops/fp8.py; `fastbert pretrain train.precision=fp8` sets it); eval and
    # no-grad forwards keep 16/32-bit GEMMs. Runtime only: not written to config.json.
    fp8: bool = False
    # Task heads (HF fields of the same name).
    num_labels: int = 2
    problem_type: str | None = None
    classifier_dropout: float | None = None
    id2label: dict[int, str] | None = None
    # Fields of an HF config.json that fastbert keeps but does not use (round-tripped on save).
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size", "num_labels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"BertConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(
                f"BertConfig.hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}); pick a head count that divides it (e.g. hidden_size // 64)")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"BertConfig.hidden_act={self.hidden_act!r} is not supported; use one of {ACTIVATIONS}")
        if self.kernels in (None, "auto"):
            from fastbert.ops import resolve_kernels
            self.kernels = resolve_kernels(self.kernels)
        if self.kernels not in KERNELS:
            raise ConfigError(f"BertConfig.kernels={self.kernels!r} is not known; use 'auto' or one of {KERNELS}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"BertConfig.{name} must be in [0, 1), got {p!r}")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"BertConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"BertConfig.pad_token_id={self.pad_token_id} must lie in [0, vocab_size={self.vocab_size})")
        if self.position_embedding_type != "absolute":
            raise ConfigError(f"position_embedding_type={self.position_embedding_type!r} is not supported; fastbert "
                              "implements absolute position embeddings only")
        if self.extra.get("is_decoder") or self.extra.get("add_cross_attention"):
            raise ConfigError("decoder / cross-attention BERT configs are not supported by fastbert")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def replace(self, **changes) -> "BertConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS, key=list(PRESETS).index)}")
        layers, hidden = PRESETS[name]
        base = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
                    intermediate_size=4 * hidden)
        base.update(overrides)
        return cls(**base)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_dict(cls, d: dict) -> "BertConfig":
        d = dict(d)
        known = {f.name for f in fields(cls)} - {"extra", "sparse_prediction", "fp8"}
        if "hidden_act" in d:
            act = d["hidden_act"]
            if act not in HF_ACTIVATIONS:
                raise ConfigError(f"hidden_act={act!r} in config is not supported; fastbert supports "
                                  f"{sorted(HF_ACTIVATIONS)}")
            d["hidden_act"] = HF_ACTIVATIONS[act]
        if "fastbert_prenorm" in d:
            d["prenorm"] = d.pop("fastbert_prenorm")
        if d.get("id2label"):
            d["id2label"] = {int(k): v for k, v in d["id2label"].items()}
            d.setdefault("num_labels", len(d["id2label"]))
        kwargs = {k: d.pop(k) for k in list(d) if k in known}
        d.pop("label2id", None)
        if kwargs.get("pad_token_id") is None:
            kwargs["pad_token_id"] = 0
        return cls(**kwargs, extra=d)

    def to_dict(self) -> dict:
        d = dict(self.extra)
        d.update({
            "architectures": d.get("architectures", ["BertModel"]),
            "model_type": "bert",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": _HF_ACT_OUT[self.hidden_act],
            "hidden_dropout_prob": self.hidden_dropout_prob,
            "attention_probs_dropout_prob": self.attention_probs_dropout_prob,
            "max_position_embeddings": self.max_position_embeddings,
            "type_vocab_size": self.type_vocab_size,
            "layer_norm_eps": self.layer_norm_eps,
            "initializer_range": self.initializer_range,
            "pad_token_id": self.pad_token_id,
            "position_embedding_type": "absolute",
            "fastbert_prenorm": self.prenorm,
        })
        if self.problem_type is not None:
            d["problem_type"] = self.problem_type
        if self.classifier_dropout is not None:
            d["classifier_dropout"] = self.classifier_dropout
        labels = self.id2label or {i: f"LABEL_{i}" for i in range(self.num_labels)}
        d["id2label"] = {str(k): v for k, v in labels.items()}
        d["label2id"] = {v: k for k, v in labels.items()}
        return d

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "BertConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e}); pass an HF BERT config.json") from None
        return cls.from_dict(d)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **overrides) -> "BertConfig":
        path = Path(directory)
        if path.is_dir():
            path = path / "config.json"
        cfg = cls.from_json_file(path)
        return cfg.replace(**overrides) if overrides else cfg

    def to_json_file(self, path: str | os.PathLike) -> None:
        from fastbert.io import atomic_write_text
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.to_json_file(Path(directory) / "config.json")


def gelu_approximate(hidden_act) -> str | None:
    """torch's GELU ``approximate`` for an activation name, fastbert's or HF's (``"none"`` /
    ``"tanh"``), or None for any other activation (a name or a function)."""
    if not isinstance(hidden_act, str):
        return None
    return GELU_APPROXIMATE.get(HF_ACTIVATIONS.get(hidden_act, ""))
