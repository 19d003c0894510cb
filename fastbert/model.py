"""BERT encoder: embeddings, fused-QKV attention, FFN, Post-LN / Pre-LN layers, unpadded encoder, pooler.

The public API takes ``(batch, seq)`` ids and an ``attention_mask`` like HF's. The encoder unpads
once on entry and every layer works on ``(total_tokens, hidden)`` with int32 ``cu_seqlens``;
outputs are padded back only on exit. Every op goes through ``fastbert.ops.get_ops(kernels)``,
so ``kernels="torch"`` (reference) and ``kernels="triton"`` (fused) share one model.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastbert.config import BertConfig
from fastbert.ops import get_ops
from fastbert.ops.attention import attention_probs_ref
from fastbert.padding import Unpadded, pad, unpad_mask

_GELU_APPROX = {"gelu": "none", "gelu_tanh": "tanh"}


class ModelOutput(OrderedDict):
    """HF-style output: attribute and key access; indexing and iteration skip fields that are None."""

    def __init__(self, **fields):
        super().__init__((k, v) for k, v in fields.items() if v is not None)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            if name.startswith("__"):
                raise AttributeError(name) from None
            return None

    def __getitem__(self, key):
        if isinstance(key, (int, slice)):
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def to_tuple(self):
        return tuple(self.values())


def new_seed() -> int:
    """A dropout seed for the fused kernels, drawn from torch's CPU generator (no device sync)."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


class InputError(ValueError):
    """Bad model input (ids out of range, sequence too long...); the message says how to fix it."""


# ---------------------------------------------------------------------------------- modules
class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, ops, input_ids, position_ids, token_type_ids):
        """All inputs ``(tokens,)``; returns ``(tokens, hidden)``."""
        p = self.config.hidden_dropout_prob if self.training else 0.0
        return ops.embeddings(
            input_ids, position_ids, token_type_ids, self.word_embeddings.weight,
            self.position_embeddings.weight, self.token_type_embeddings.weight,
            self.LayerNorm.weight, self.LayerNorm.bias, self.config.layer_norm_eps,
            dropout_p=p, seed=new_seed() if p > 0 else None,
            padding_idx=self.word_embeddings.padding_idx)


class BertSelfAttention(nn.Module):
    """One fused QKV projection; ``qkv.weight`` is ``cat(query, key, value)`` of HF's layout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, ops, x, cu_seqlens, max_seqlen, output_attentions=False):
        cfg = self.config
        T = x.shape[0]
        qkv = self.qkv(x).view(T, 3, cfg.num_attention_heads, cfg.head_dim)  # (T, 3, nh, hd)
        p = cfg.attention_probs_dropout_prob if self.training else 0.0
        ctx = ops.attention_qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p=p,
                                      seed=new_seed() if p > 0 else None)  # (T, nh, hd)
        probs = None
        if output_attentions:
            q, k, _ = qkv.unbind(dim=1)  # (T, nh, hd) each
            probs = attention_probs_ref(q, k, cu_seqlens, max_seqlen)
        return ctx.reshape(T, cfg.hidden_size), probs


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertLayer(nn.Module):
    """Post-LN (original BERT) or Pre-LN (academic-budget recipe), chosen by ``config.prenorm``.

    Parameter names follow HF's. In Pre-LN, ``attention.output.LayerNorm`` normalizes the block
    input before attention and ``output.LayerNorm`` the residual stream before the FFN.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.attention = BertAttention(config)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def _ffn(self, ops, h):
        up = self.intermediate.dense
        h = ops.linear_bias_gelu(h, up.weight, up.bias, approximate=_GELU_APPROX[self.config.hidden_act])
        return F.linear(h, self.output.dense.weight)  # bias added inside the fused residual LayerNorm

    def forward(self, ops, x, cu_seqlens, max_seqlen, output_attentions=False):
        cfg = self.config
        eps = cfg.layer_norm_eps
        p = cfg.hidden_dropout_prob if self.training else 0.0
        attn_out, ln_attn = self.attention.output.dense, self.attention.output.LayerNorm
        ln_ffn = self.output.LayerNorm

        def add_norm(y, residual, ln, y_bias, prenorm=False):
            return ops.dropout_add_layer_norm(y, residual, ln.weight, ln.bias, eps, x_bias=y_bias, dropout_p=p,
                                              prenorm=prenorm, seed=new_seed() if p > 0 else None)

        if not cfg.prenorm:
            ctx, probs = self.attention.self(ops, x, cu_seqlens, max_seqlen, output_attentions)
            x = add_norm(F.linear(ctx, attn_out.weight), x, ln_attn, attn_out.bias)
            x = add_norm(self._ffn(ops, x), x, ln_ffn, self.output.dense.bias)
            return x, probs
        h = ops.dropout_add_layer_norm(x, None, ln_attn.weight, ln_attn.bias, eps)
        ctx, probs = self.attention.self(ops, h, cu_seqlens, max_seqlen, output_attentions)
        h, x = add_norm(F.linear(ctx, attn_out.weight), x, ln_ffn, attn_out.bias, prenorm=True)
        y = self._ffn(ops, h) + self.output.dense.bias
        x = x + (F.dropout(y, p, training=True) if p > 0 else y)
        return x, probs


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        # Pre-LN needs a final LayerNorm on the residual stream; Post-LN ends normalized already.
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.prenorm else None

    def forward(self, ops, x, cu_seqlens, max_seqlen, output_hidden_states=False, output_attentions=False):
        """``x``: ``(tokens, hidden)``. Returns (last hidden, all hidden states or None, attentions or None)."""
        hidden_states = [x] if output_hidden_states else None
        attentions = [] if output_attentions else None
        for layer in self.layer:
            x, probs = layer(ops, x, cu_seqlens, max_seqlen, output_attentions)
            if output_hidden_states:
                hidden_states.append(x)
            if output_attentions:
                attentions.append(probs)
        if self.final_layer_norm is not None:
            ln = self.final_layer_norm
            x = ops.dropout_add_layer_norm(x, None, ln.weight, ln.bias, self.config.layer_norm_eps)
            if output_hidden_states:
                hidden_states[-1] = x
        return x, hidden_states, attentions


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_token):
        return torch.tanh(self.dense(first_token))


# ---------------------------------------------------------------------------------- base class
class BertPreTrainedModel(nn.Module):
    """Init, HF checkpoint I/O and helpers shared by BertModel and the task heads."""

    base_model_prefix = "bert"
    # Parameters of the task head (newly initialized when loading a checkpoint that lacks them).
    head_prefixes: tuple[str, ...] = ()

    def __init__(self, config: BertConfig):
        super().__init__()
        config.validate()
        self.config = config

    @property
    def ops(self):
        return get_ops(self.config.kernels)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def init_weights(self):
        self.apply(self._init_weights)
        self.tie_weights()

    def tie_weights(self):
        """Heads with a decoder tie it to the word embeddings (overridden there)."""

    def set_kernels(self, kernels: str):
        """Switch between ``"torch"`` and ``"triton"`` kernels in place."""
        self.config.kernels = kernels
        self.config.validate()
        return self

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for m in self.modules():
                if isinstance(m, nn.Embedding):
                    params.pop(id(m.weight), None)
        return sum(p.numel() for p in params.values())

    @classmethod
    def from_pretrained(cls, directory, config: BertConfig | None = None, **config_overrides):
        from fastbert.hf import load_pretrained
        return load_pretrained(cls, directory, config=config, **config_overrides)

    def save_pretrained(self, directory, safe_serialization: bool = True):
        from fastbert.hf import save_pretrained
        save_pretrained(self, directory)


class BertModel(BertPreTrainedModel):
    """HF-compatible ``BertModel`` with an unpadded encoder."""

    # Check token ids against the vocabulary on every call (one small device sync, shared with the
    # length lookup that unpadding needs anyway).
    validate_inputs = True

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.init_weights()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    # ------------------------------------------------------------------ input checks
    def _check_and_unpad(self, input_ids, attention_mask, token_type_ids, position_ids) -> Unpadded:
        """Validate the inputs and describe their real tokens. Shape checks are free; the value checks
        (id ranges) and the longest length come back from the device in ONE transfer, and with
        ``validate_inputs = False`` (set by trainers whose data was validated when it was prepared)
        only the length is fetched."""
        cfg = self.config
        if input_ids is None:
            raise InputError("input_ids is required (fastbert does not take inputs_embeds)")
        if input_ids.dim() != 2:
            raise InputError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        seq = input_ids.shape[1]
        if seq > cfg.max_position_embeddings and position_ids is None:
            raise InputError(
                f"sequence length {seq} exceeds max_position_embeddings={cfg.max_position_embeddings}; "
                f"truncate inputs to {cfg.max_position_embeddings} tokens (tokenizer max_length)")
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                        ("position_ids", position_ids)):
            if t is not None and t.shape != input_ids.shape:
                raise InputError(f"{name} has shape {tuple(t.shape)} but input_ids has {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        info = unpad_mask(attention_mask, max_seqlen=0)  # the real value comes with the stats below
        if not input_ids.numel():
            return info
        stats = [info.cu_seqlens.diff().max()]
        if self.validate_inputs:
            types = token_type_ids if token_type_ids is not None else input_ids.new_zeros(1)
            stats += [input_ids.min(), input_ids.max(), types.min(), types.max()]
        stats = torch.stack([t.to(torch.int64) for t in stats]).tolist()  # the one device -> host sync
        info = info._replace(max_seqlen=int(stats[0]))
        if self.validate_inputs:
            lo, hi, tlo, thi = stats[1:]
            if lo < 0 or hi >= cfg.vocab_size:
                raise InputError(
                    f"token id {hi if hi >= cfg.vocab_size else lo} is outside the vocabulary [0, {cfg.vocab_size}); "
                    "the tokenizer's vocab does not match this model (use the model's own vocab.txt)")
            if tlo < 0 or thi >= cfg.type_vocab_size:
                raise InputError(f"token_type_ids must lie in [0, type_vocab_size={cfg.type_vocab_size})")
        return info

    # ------------------------------------------------------------------ forward
    def encode_unpadded(self, input_ids, cu_seqlens, max_seqlen, token_type_ids=None, position_ids=None,
                        output_hidden_states=False, output_attentions=False):
        """Run the encoder on already-unpadded ``(tokens,)`` ids; returns ``(tokens, hidden)`` and extras.

        ``position_ids`` default to each token's index within its sequence.
        """
        ops = self.ops
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if position_ids is None:
            starts = torch.repeat_interleave(cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long(),
                                             output_size=input_ids.shape[0])
            position_ids = torch.arange(input_ids.shape[0], device=input_ids.device) - starts
        x = self.embeddings(ops, input_ids, position_ids, token_type_ids)
        return self.encoder(ops, x, cu_seqlens, max_seqlen, output_hidden_states, output_attentions)

    def run(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
            output_attentions=False, output_hidden_states=False):
        """Check, unpad, encode. Returns ``(tokens, hidden)``, the Unpadded info, hidden states, attentions."""
        info = self._check_and_unpad(input_ids, attention_mask, token_type_ids, position_ids)
        flat = lambda t: None if t is None else t.reshape(-1).index_select(0, info.indices)  # noqa: E731
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x, hidden, attn = self.encode_unpadded(
            flat(input_ids), info.cu_seqlens, info.max_seqlen, flat(token_type_ids), flat(position_ids),
            output_hidden_states, output_attentions)
        return x, info, hidden, attn

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                output_attentions=False, output_hidden_states=False, return_dict=True, **unused):
        _reject_unsupported(unused)
        x, info, hidden, attn = self.run(input_ids, attention_mask, token_type_ids, position_ids,
                                         output_attentions, output_hidden_states)
        seq = pad(x, info)  # (B, S, H)
        out = ModelOutput(last_hidden_state=seq,
                          pooler_output=self.pooler(seq[:, 0]) if self.pooler is not None else None,
                          hidden_states=padded_hidden_states(hidden, info),
                          attentions=padded_attentions(attn, info))
        return out if return_dict else out.to_tuple()


def first_token_rows(x: torch.Tensor, info: Unpadded) -> torch.Tensor:
    """``(batch, hidden)``: each sequence's first token ([CLS]) from the unpadded ``(tokens, hidden)``;
    zeros for empty sequences (all-padding rows)."""
    if x.shape[0] == 0:
        return x.new_zeros(info.batch, x.shape[1])
    lengths = info.cu_seqlens[1:] - info.cu_seqlens[:-1]
    rows = x.index_select(0, info.cu_seqlens[:-1].long().clamp(max=x.shape[0] - 1))
    return rows * (lengths > 0).unsqueeze(1).to(x.dtype)


def padded_hidden_states(hidden, info: Unpadded):
    return tuple(pad(h, info) for h in hidden) if hidden is not None else None


def padded_attentions(attn, info: Unpadded):
    """``(B, nh, maxlen, maxlen)`` maps padded to the input length ``(B, nh, S, S)``."""
    if attn is None:
        return None
    extra = info.seqlen - info.max_seqlen
    return tuple(F.pad(a, (0, extra, 0, extra)) for a in attn)


def _reject_unsupported(kwargs: dict):
    ignored_none = {k for k, v in kwargs.items() if v is None}
    bad = sorted(set(kwargs) - ignored_none - {"use_cache"})
    if bad:
        raise InputError(f"unsupported argument(s) {bad}: fastbert's BERT takes input_ids, attention_mask, "
                         "token_type_ids, position_ids, labels and the output_* flags")


def mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence-BERT mean pooling over real tokens: ``(B, S, H) -> (B, H)``."""
    m = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    return (last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1e-9)


def gelu_approx(config: BertConfig) -> str:
    return _GELU_APPROX[config.hidden_act]
