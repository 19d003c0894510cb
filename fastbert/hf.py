"""HF checkpoint interop: state-dict conversion both ways, ``from_pretrained`` and ``save_pretrained``.

fastbert keeps HF's parameter names except for attention, where one fused ``attention.self.qkv``
(weight ``(3H, H)`` = ``cat(query, key, value)``) replaces HF's three projections. Loading accepts
any HF Bert* checkpoint directory (config.json + model.safetensors, a sharded safetensors index,
or pytorch_model.bin) and maps between bare ``BertModel`` keys and ``bert.``-prefixed head keys.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from fastbert.config import BertConfig
from fastbert.io import atomic_path

log = logging.getLogger("fastbert")

_QKV = re.compile(r"^(.*attention\.self\.)(query|key|value)\.(weight|bias)$")
_FUSED = re.compile(r"^(.*attention\.self\.)qkv\.(weight|bias)$")
# Keys HF checkpoints carry that fastbert derives or does not keep.
_DROP = re.compile(r"(^|\.)embeddings\.position_ids$|^cls\.predictions\.decoder\.(weight|bias)$")
_ENCODER_ROOTS = ("embeddings.", "encoder.", "pooler.")
# The tied MLM decoder: {its key: the key of the tensor it is tied to}, in a head's HF layout.
_TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
         "cls.predictions.decoder.bias": "cls.predictions.bias"}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message lists every offending tensor."""


# ---------------------------------------------------------------------------------- conversion
def hf_to_fastbert(state: dict[str, torch.Tensor], prefix_encoder: bool) -> dict[str, torch.Tensor]:
    """Convert an HF Bert* state dict to fastbert's layout.

    ``prefix_encoder``: the target model keeps its encoder under ``bert.`` (task heads) rather than
    at the top level (``BertModel``).
    """
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if prefix_encoder and key.startswith(_ENCODER_ROOTS):
            key = "bert." + key
        elif not prefix_encoder and key.startswith("bert."):
            key = key[len("bert."):]
        if _DROP.search(key):
            continue
        m = _QKV.match(key)
        if m:
            parts.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = value
            continue
        out[key] = value
    for (stem, kind), qkv in parts.items():
        missing = [n for n in ("query", "key", "value") if n not in qkv]
        if missing:
            raise CheckpointError(f"checkpoint has an incomplete attention projection at {stem}: missing "
                                  f"{', '.join(f'{stem}{n}.{kind}' for n in missing)}")
        out[f"{stem}qkv.{kind}"] = torch.cat([qkv["query"], qkv["key"], qkv["value"]], dim=0)
    return out


def fastbert_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convert a fastbert state dict to HF's layout (split QKV). The MLM decoder is tied (weight = the
    word embeddings, bias = ``cls.predictions.bias``), so, as HF saves it, it is not written again:
    HF ties it back on load."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in _TIED:
            continue
        m = _FUSED.match(key)
        if m:
            for name, chunk in zip(("query", "key", "value"), value.chunk(3, dim=0)):
                out[f"{m.group(1)}{name}.{m.group(2)}"] = chunk.clone()
            continue
        out[key] = value
    return {k: v.detach().contiguous() for k, v in out.items()}


# ---------------------------------------------------------------------------------- reading
def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory, from safetensors (single or sharded) or a .bin."""
    from safetensors.torch import load_file

    single, index, binary = (directory / n for n in
                             ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(load_file(str(directory / shard)))
        return state
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"no weights in {directory}: expected model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def load_pretrained(cls, directory, config: BertConfig | None = None, torch_dtype=None, **config_overrides):
    """Build ``cls`` from a local HF checkpoint directory. New task-head weights are initialized
    (and reported); any missing encoder weight or shape mismatch raises one CheckpointError."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {directory} (pass a local HF BERT checkpoint "
                                "directory holding config.json and model.safetensors)")
    if config is None:
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"{directory / 'config.json'} not found: an HF checkpoint directory needs config.json")
        config = BertConfig.from_pretrained(directory, **config_overrides)
    elif config_overrides:
        config = config.replace(**config_overrides)
    state = read_state_dict(directory)
    model = cls(config)
    load_converted(model, state)
    if torch_dtype is not None:
        model.to(torch_dtype)
    return model


def load_converted(model, hf_state: dict[str, torch.Tensor]) -> None:
    """Load an HF-layout state dict into a fastbert model with the checks described above."""
    # A task head holds its encoder under ``bert.`` (HF's base_model_prefix); a bare BertModel is the
    # encoder. Asked of the model, not by isinstance, so that this file needs nothing of model.py.
    prefixed = isinstance(getattr(model, model.base_model_prefix, None), torch.nn.Module)
    _check_tied(hf_state)
    state = hf_to_fastbert(hf_state, prefix_encoder=prefixed)
    expected = model.state_dict()
    tied = {"cls.predictions.decoder.weight"}
    new_ok = tuple(model.head_prefixes) + (("bert.pooler.",) if prefixed else ("pooler.",))
    missing = [k for k in expected if k not in state and k not in tied]
    fatal = [k for k in missing if not k.startswith(new_ok)]
    mismatched = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
                  for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if fatal or mismatched:
        lines = []
        if fatal:
            lines.append(f"missing from the checkpoint ({len(fatal)}): " + ", ".join(fatal))
        if mismatched:
            lines.append(f"shape mismatch ({len(mismatched)}): " + "; ".join(mismatched))
        raise CheckpointError("checkpoint does not fit " + type(model).__name__ + ":\n  " + "\n  ".join(lines)
                              + "\n  (check that config.json matches the weights, or pass matching config overrides)")
    unexpected = sorted(k for k in state if k not in expected)
    if missing:
        log.warning("%s: newly initialized (not in the checkpoint): %s", type(model).__name__, ", ".join(missing))
    if unexpected:
        log.info("%s: checkpoint tensors not used: %s", type(model).__name__, ", ".join(unexpected))
    with torch.no_grad():
        for k, v in state.items():
            if k in expected:
                expected[k].copy_(v)


def _check_tied(hf_state: dict[str, torch.Tensor]) -> None:
    """A checkpoint may store the tied decoder weight (older HF and fastbert did) or not (HF, fastbert
    now); if it does, it must be the word embeddings, which fastbert ties it to."""
    key, source = "cls.predictions.decoder.weight", _TIED["cls.predictions.decoder.weight"]
    if key in hf_state and source in hf_state and not torch.equal(hf_state[key], hf_state[source]):
        raise CheckpointError(f"{key} differs from {source}: this checkpoint has an untied MLM decoder "
                              "(tie_word_embeddings=false); fastbert ties the decoder to the word embeddings, "
                              "as BERT does")


# ---------------------------------------------------------------------------------- writing
def save_pretrained(model, directory) -> None:
    """Write config.json and model.safetensors that HF transformers loads (Post-LN models)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = str(model.dtype).replace("torch.", "")
    if model.config.prenorm:
        log.warning("Pre-LN model: HF transformers' BertModel is Post-LN only, so this checkpoint loads "
                    "correctly in fastbert (fastbert_prenorm=true) but not as an HF BertModel")
    state = fastbert_to_hf({k: v.cpu() for k, v in model.state_dict().items()})
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    from fastbert.io import atomic_write_text
    atomic_write_text(directory / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
